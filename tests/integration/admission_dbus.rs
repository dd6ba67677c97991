//! Per-uid admission on D-Bus: the `UidAdmission` property of `org.sandcell.Manager1`, on a
//! private system-like bus with the shipped policy. Root sees every uid holding sessions; an
//! unprivileged caller (here `nobody`, through `setpriv`) sees only its own uid, never who
//! else uses the service or how much. And the capacity file (`metrics_file`) says what the
//! `ActiveSessions`, `Admission` and `Pools` properties say.
//!
//! Needs root and the packages `dbus-daemon`, `systemd` (busctl) and `util-linux` (setpriv);
//! without them the test prints why it skips.

use crate::common;

use common::bus::Bus;
use common::{Daemon, eventually};
use std::process::Command;
use std::time::Duration;

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

impl Bus {
    fn property(&self, property: &str) -> String {
        let o = Command::new("busctl")
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .args([
                "--system",
                "get-property",
                "org.sandcell.Sandcell1",
                "/org/sandcell/Sandcell1",
                "org.sandcell.Manager1",
                property,
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{property}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
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

/// The sample `name{node="",<labels>} value` of a metrics file, as an integer.
fn sample(text: &str, name: &str, labels: &str) -> Option<u64> {
    let head = format!("{name}{{node=\"\"{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&head))
        .map(|v| v.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_file_says_what_the_dbus_properties_say() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    let bus = Bus::start();
    let dir = tempfile::Builder::new()
        .prefix("sandcell-metrics-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let file = dir.path().join("metrics.prom");
    let d = Daemon::start(&[
        ("DBUS_SYSTEM_BUS_ADDRESS", &bus.address),
        ("SANDCELL_METRICS_FILE", &file.display().to_string()),
        ("SANDCELL_METRICS_INTERVAL_SECONDS", "1"),
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
    ]);
    let mut c = d.client().await;
    let _s = c.open("python", None, Some(60)).await.unwrap().session;
    assert!(
        eventually(Duration::from_secs(20), || bus.uid_admission(0).0 == 0),
        "the manager object did not appear on the bus"
    );
    // Settled: the session open, the pool refilled to its target (its workers are charged
    // too; the target is the maximum for a while after a take).
    let python = ",environment=\"python\"";
    let settled = || {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let idle = sample(&text, "sandcell_pool_idle_workers", python);
        sample(&text, "sandcell_sessions", "") == Some(1)
            && idle.is_some_and(|i| i > 0)
            && idle == sample(&text, "sandcell_pool_target_workers", python)
    };
    assert!(
        eventually(Duration::from_secs(30), settled),
        "the file did not settle:\n{}",
        std::fs::read_to_string(&file).unwrap_or_default()
    );
    std::thread::sleep(Duration::from_millis(1500));
    let text = std::fs::read_to_string(&file).unwrap();

    // ActiveSessions: "u 1".
    let active = bus.property("ActiveSessions");
    assert_eq!(
        active
            .split_whitespace()
            .nth(1)
            .map(|v| v.parse::<u64>().unwrap()),
        sample(&text, "sandcell_sessions", ""),
        "{active}"
    );
    // Admission: a(stt) N "budget" in_use max ...
    let admission = bus.property("Admission");
    let mut w = admission.split_whitespace();
    assert_eq!(w.next(), Some("a(stt)"), "{admission}");
    let n: usize = w.next().unwrap().parse().unwrap();
    assert_eq!(n, 3, "{admission}");
    for _ in 0..n {
        let budget = w.next().unwrap().trim_matches('"').to_string();
        let used: u64 = w.next().unwrap().parse().unwrap();
        let max: u64 = w.next().unwrap().parse().unwrap();
        let family = match budget.as_str() {
            "max_concurrent_sessions" => "sandcell_admission_sessions",
            "max_aggregate_guest_memory_bytes" => "sandcell_admission_guest_memory",
            "max_aggregate_worker_memory_bytes" => "sandcell_admission_worker_memory",
            other => panic!("a budget the file does not know: {other}"),
        };
        let unit = if family.ends_with("sessions") {
            ""
        } else {
            "_bytes"
        };
        assert_eq!(
            sample(&text, &format!("{family}{unit}"), ""),
            Some(used),
            "{budget}\n{text}"
        );
        assert_eq!(
            sample(&text, &format!("{family}_max{unit}"), ""),
            Some(max),
            "{budget}"
        );
    }
    // The session and the idle pooled workers are all charged.
    let idle = sample(&text, "sandcell_pool_idle_workers", python).unwrap();
    assert_eq!(
        sample(&text, "sandcell_admission_sessions", ""),
        Some(1 + idle),
        "{text}"
    );
    // Pools: a(suuuutt) N "env" idle target min max taken missed ...
    let pools = bus.property("Pools");
    let mut w = pools.split_whitespace();
    assert_eq!(w.next(), Some("a(suuuutt)"), "{pools}");
    let n: usize = w.next().unwrap().parse().unwrap();
    assert!(n >= 3, "{pools}");
    for _ in 0..n {
        let env = w.next().unwrap().trim_matches('"').to_string();
        let label = format!(",environment=\"{env}\"");
        for family in [
            "sandcell_pool_idle_workers",
            "sandcell_pool_target_workers",
            "sandcell_pool_min_workers",
            "sandcell_pool_max_workers",
            "sandcell_pool_taken_total",
            "sandcell_pool_missed_total",
        ] {
            let v: u64 = w.next().unwrap().parse().unwrap();
            assert_eq!(
                sample(&text, family, &label),
                Some(v),
                "{family} {env}\n{pools}\n{text}"
            );
        }
    }
}
