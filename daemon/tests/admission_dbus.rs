//! Per-uid admission on D-Bus: the `UidAdmission` property of `org.sandcell.Manager1`, on a
//! private system-like bus with the shipped policy. Root sees every uid holding sessions; an
//! unprivileged caller (here `nobody`, through `setpriv`) sees only its own uid, never who
//! else uses the service or how much.
//!
//! Needs root and the packages `dbus-daemon`, `systemd` (busctl) and `util-linux` (setpriv);
//! without them the test prints why it skips.

mod common;

use common::{Daemon, eventually};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn repo() -> PathBuf {
    common::manifest_dir().join("..")
}

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (setpriv to another uid needs root)".into());
    }
    for tool in ["dbus-daemon", "busctl", "setpriv"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Some(format!("{tool} missing"));
        }
    }
    None
}

/// A private system-like bus with the shipped policy of sandcelld's name.
struct Bus {
    child: Child,
    _dir: tempfile::TempDir,
    address: String,
}

impl Bus {
    fn start() -> Bus {
        let dir = tempfile::Builder::new()
            .prefix("sandcell-bus-")
            .tempdir_in("/var/tmp")
            .unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        let socket = dir.path().join("system_bus_socket");
        let config = dir.path().join("system.conf");
        let shipped = repo().join("dbus/org.sandcell.Sandcell1.conf");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <auth>EXTERNAL</auth>
  <listen>unix:path={socket}</listen>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
  </policy>
  <include>{shipped}</include>
</busconfig>
"#,
                socket = socket.display(),
                shipped = shipped.display()
            ),
        )
        .unwrap();
        let child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting dbus-daemon");
        assert!(
            eventually(Duration::from_secs(10), || socket.exists()),
            "dbus-daemon did not start"
        );
        Bus {
            child,
            address: format!("unix:path={}", socket.display()),
            _dir: dir,
        }
    }

    /// `busctl get-property` of the manager's `UidAdmission`, as `uid` (root when 0).
    fn uid_admission(&self, uid: u32) -> (i32, String, String) {
        let mut cmd = if uid == 0 {
            Command::new("busctl")
        } else {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg("busctl");
            c
        };
        let o = cmd
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .args([
                "--system",
                "get-property",
                "org.sandcell.Sandcell1",
                "/org/sandcell/Sandcell1",
                "org.sandcell.Manager1",
                "UidAdmission",
            ])
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rows of a busctl `a(ustt)` answer: (uid, budget, in use, max).
fn rows(out: &str) -> Vec<(u32, String, u64, u64)> {
    let mut words = out.split_whitespace();
    assert_eq!(words.next(), Some("a(ustt)"), "{out}");
    let n: usize = words.next().unwrap().parse().unwrap();
    let mut v = Vec::new();
    for _ in 0..n {
        let uid = words.next().unwrap().parse().unwrap();
        let budget = words.next().unwrap().trim_matches('"').to_string();
        let used = words.next().unwrap().parse().unwrap();
        let max = words.next().unwrap().parse().unwrap();
        v.push((uid, budget, used, max));
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uid_admission_shows_everyone_to_root_and_only_themselves_to_others() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    let bus = Bus::start();
    let d = Daemon::start(&[("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)]);
    // Two sessions of uid 0 (the test), one detached.
    let mut c = d.client().await;
    let _a = c.open("python", None, None).await.unwrap().session;
    let _b = c.open("python", None, Some(60)).await.unwrap().session;
    assert!(
        eventually(Duration::from_secs(20), || bus.uid_admission(0).0 == 0),
        "the manager object did not appear on the bus"
    );

    let (code, out, err) = bus.uid_admission(0);
    assert_eq!(code, 0, "{err}");
    let root = rows(&out);
    eprintln!("root sees {root:?}");
    let get = |v: &[(u32, String, u64, u64)], uid: u32, budget: &str| {
        v.iter()
            .find(|r| r.0 == uid && r.1 == budget)
            .map(|r| (r.2, r.3))
    };
    let (used, max) = get(&root, 0, "max_sessions_per_uid").expect("root sees uid 0");
    assert_eq!(used, 2, "{root:?}");
    assert!(max >= 2);
    assert_eq!(get(&root, 0, "max_detached_sessions_per_uid").unwrap().0, 1);
    assert!(get(&root, 0, "max_worker_memory_bytes_per_uid").unwrap().0 > 0);

    // nobody: only its own uid, nothing in use, the same maxima; no trace of uid 0.
    let nobody = 65534;
    let (code, out, err) = bus.uid_admission(nobody);
    assert_eq!(code, 0, "{err}");
    let theirs = rows(&out);
    eprintln!("nobody sees {theirs:?}");
    assert!(!theirs.is_empty());
    assert!(
        theirs.iter().all(|r| r.0 == nobody && r.2 == 0),
        "another uid's use leaked: {theirs:?}"
    );
    assert_eq!(get(&theirs, nobody, "max_sessions_per_uid").unwrap().1, max);
}
