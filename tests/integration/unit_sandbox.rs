//! The daemon under its own unit's sandbox (units/sandcelld.service's seccomp filters,
//! capability bounding set and no_new_privs, applied by tests/integration/common/unit_sandbox.rs
//! without systemd): the sandbox answers as systemd's would, and what it refuses (openat2,
//! which `RestrictSUIDSGID=yes` answers with ENOSYS) does not cost a tenant a file download
//! or the operator the metrics file.

use crate::common;

use common::Daemon;
use common::unit_sandbox::{self, UnitSandbox};
use sandcell_client::Status;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

/// Environment variable that makes this test binary, re-executed under the sandbox, run the
/// probes of [`the_sandbox_answers_as_the_unit_says`] instead.
const CHILD: &str = "SANDCELL_UNIT_SANDBOX_PROBE_CHILD";

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn errno_of(rc: i64) -> i32 {
    if rc >= 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap()
    }
}

/// What each probe answered in the child: `name=errno` lines (0: success).
fn probes() -> Vec<(&'static str, i32)> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let cfile = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
    let how = [libc::O_RDONLY as u64, 0, 0];
    let slash = c"/";
    let none = c"/nonexistent-swap";
    // SAFETY: plain system calls with valid arguments; each one's effect is undone or harmless
    // (the child exits right after).
    unsafe {
        vec![
            (
                "openat2",
                errno_of(libc::syscall(
                    libc::SYS_openat2,
                    libc::AT_FDCWD,
                    slash.as_ptr(),
                    how.as_ptr(),
                    24usize,
                )),
            ),
            (
                "openat",
                errno_of(libc::open(slash.as_ptr(), libc::O_RDONLY) as i64),
            ),
            (
                "chmod_755",
                errno_of(libc::chmod(cfile.as_ptr(), 0o755) as i64),
            ),
            (
                "chmod_4755",
                errno_of(libc::chmod(cfile.as_ptr(), 0o4755) as i64),
            ),
            (
                "chmod_2755",
                errno_of(libc::chmod(cfile.as_ptr(), 0o2755) as i64),
            ),
            (
                "socket_inet",
                errno_of(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) as i64),
            ),
            (
                "socket_unix",
                errno_of(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) as i64),
            ),
            (
                "unshare_user",
                errno_of(libc::unshare(libc::CLONE_NEWUSER) as i64),
            ),
            (
                "unshare_pid",
                errno_of(libc::unshare(libc::CLONE_NEWPID) as i64),
            ),
            (
                "clone3",
                errno_of(libc::syscall(libc::SYS_clone3, 0usize, 0usize)),
            ),
            (
                "personality_query",
                errno_of(libc::personality(0xffff_ffff) as i64),
            ),
            (
                "personality_other",
                errno_of(libc::personality(0x0040000) as i64),
            ),
            ("swapoff", errno_of(libc::swapoff(none.as_ptr()) as i64)),
            (
                "no_new_privs",
                libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0),
            ),
            (
                "bounding_net_admin",
                libc::prctl(libc::PR_CAPBSET_READ, 12 /* CAP_NET_ADMIN */, 0, 0, 0),
            ),
            (
                "bounding_sys_admin",
                libc::prctl(libc::PR_CAPBSET_READ, 21 /* CAP_SYS_ADMIN */, 0, 0, 0),
            ),
        ]
    }
}

/// The launcher models the unit: each option's refusal shows in a process started under it
/// (this test binary, re-executed).
#[test]
fn the_sandbox_answers_as_the_unit_says() {
    if std::env::var(CHILD).is_ok() {
        for (name, e) in probes() {
            println!("probe {name}={e}");
        }
        return;
    }
    if !root() {
        sandcell_testing::skip!(
            "root",
            "the unit's bounding set and filters are set as root"
        );
    }
    let sb = UnitSandbox::of_unit();
    // The allow-list from the host's systemd-analyze holds what the daemon relies on.
    for c in [
        "openat",
        "openat2",
        "clone3",
        "pidfd_open",
        "landlock_create_ruleset",
        "mount",
    ] {
        assert!(
            sb.allowed.contains(c),
            "{c} missing from the expanded SystemCallFilter"
        );
    }
    for c in [
        "ptrace",
        "swapoff",
        "reboot",
        "init_module",
        "clock_settime",
    ] {
        assert!(
            !sb.allowed.contains(c),
            "{c} allowed by the expanded SystemCallFilter"
        );
    }
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "unit_sandbox::the_sandbox_answers_as_the_unit_says",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, "1");
    sb.apply(&mut cmd);
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: std::collections::HashMap<&str, i32> = text
        .lines()
        .filter_map(|l| l.find("probe ").map(|i| &l[i + "probe ".len()..]))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let want = [
        ("openat2", libc::ENOSYS),
        ("openat", 0),
        ("chmod_755", 0),
        ("chmod_4755", libc::EPERM),
        ("chmod_2755", libc::EPERM),
        ("socket_inet", libc::EAFNOSUPPORT),
        ("socket_unix", 0),
        ("unshare_user", libc::EPERM),
        ("unshare_pid", libc::EPERM),
        ("clone3", libc::ENOSYS),
        ("personality_query", 0),
        ("personality_other", libc::EPERM),
        ("swapoff", libc::EPERM),
        ("no_new_privs", 1),
        ("bounding_net_admin", 0),
        ("bounding_sys_admin", 1),
    ];
    for (k, v) in want {
        assert_eq!(got.get(k), Some(&v), "probe {k}; all: {text}");
    }
}

/// Under the unit's sandbox (openat2 answers ENOSYS), GetFile of a file a cell wrote and the
/// metrics file work: the daemon resolves paths with its walk instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_file_and_the_metrics_file_work_under_the_unit_sandbox() {
    if !root() {
        sandcell_testing::skip!(
            "root",
            "the unit's bounding set and filters are set as root"
        );
    }
    unit_sandbox::FORCE.store(true, std::sync::atomic::Ordering::Relaxed);
    let mdir = tempfile::Builder::new()
        .prefix("sandcell-metrics-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(mdir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let metrics = mdir.path().join("metrics.prom");
    let m = metrics.display().to_string();
    let d = Daemon::start(&[
        ("SANDCELL_METRICS_FILE", &m),
        ("SANDCELL_METRICS_INTERVAL_SECONDS", "1"),
    ]);
    assert!(
        d.log_text().contains("path_resolution=\"walk\"")
            || d.log_text().contains("path_resolution=walk"),
        "the daemon saw openat2 refused and walks:\n{}",
        d.log_text()
    );
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let out = c
        .execute_collect(
            &s,
            "import os\nos.makedirs('out/deep', exist_ok=True)\n\
             open('out/deep/result.csv', 'w').write('a,b\\n1,2\\n')\nprint('done')",
        )
        .await
        .unwrap();
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{:?} {}",
        out.result,
        out.stderr
    );
    let mut got = Vec::new();
    c.get_file(&s, "out/deep/result.csv", &mut got)
        .await
        .expect("GetFile under the unit's sandbox");
    assert_eq!(got, b"a,b\n1,2\n");
    // An upload, listed and read back, and a symlink refused as it is with openat2.
    c.put_bytes(&s, "in/data.txt", b"hello").await.unwrap();
    let mut back = Vec::new();
    c.get_file(&s, "in/data.txt", &mut back).await.unwrap();
    assert_eq!(back, b"hello");
    let out = c
        .execute_collect(&s, "import os\nos.symlink('in/data.txt', 'alias')")
        .await
        .unwrap();
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{:?} {}",
        out.result,
        out.stderr
    );
    let mut none = Vec::new();
    let e = c.get_file(&s, "alias", &mut none).await.unwrap_err();
    assert!(
        format!("{e:?}").contains("symlink") || format!("{e:?}").contains("Symlink"),
        "a symlink is refused as a symlink: {e:?}"
    );
    // The metrics file appears and counts the session.
    let t0 = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(&metrics)
            && text.lines().any(|l| {
                l.split_once(' ').is_some_and(|(k, v)| {
                    (k == "sandcell_sessions" || k.starts_with("sandcell_sessions{")) && v == "1"
                })
            })
        {
            let mode = std::fs::metadata(&metrics).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no metrics file counting the session at {m} within 20 s: {:?}; log:\n{}",
            std::fs::read_to_string(&metrics),
            d.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.close(&s).await.unwrap();
}
