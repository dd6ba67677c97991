//! Warm worker pools: sessions start from pre-started, confined workers; a worker
//! is never reused; idle pooled workers never cause a refusal.

use crate::common;

use common::{Daemon, eventually};
use std::time::Duration;

#[tokio::test]
async fn sessions_take_warm_workers_and_never_reuse_them() {
    let d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
    ]);
    assert!(
        eventually(Duration::from_secs(10), || d
            .log_text()
            .contains("warm worker ready")),
        "pool did not fill"
    );
    let mut c = d.client().await;
    let a = c
        .run_collect("python", "secret = 42\nprint('a')", None)
        .await
        .unwrap();
    assert_eq!(a.stdout, "a\n");
    assert!(d.log_text().contains("warm=true"), "{}", d.log_text());
    // The next run gets another worker: the first one's state is gone with it.
    assert!(eventually(Duration::from_secs(10), || !d
        .descendants()
        .is_empty()));
    let b = c
        .run_collect("python", "print('secret' in globals())", None)
        .await
        .unwrap();
    assert_eq!(b.stdout, "False\n");
    assert_ne!(a.session, b.session);
    // Under use the pool grows to its maximum, and never above it.
    assert!(
        eventually(Duration::from_secs(10), || d.descendants().len() == 2),
        "{:?}",
        d.descendants()
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(d.descendants().len(), 2);
}

#[tokio::test]
async fn idle_pooled_workers_are_evicted_rather_than_refusing_a_client() {
    let d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "2"),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "2"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "1"),
        ("SANDCELL_LANGUAGES", "python,r"),
    ]);
    assert!(eventually(Duration::from_secs(10), || d
        .log_text()
        .contains("warm worker ready")));
    let mut c = d.client().await;
    // Sessions the pool cannot serve: R, or Python with another guest memory.
    let lang = if std::path::Path::new("/usr/lib/R/bin/exec/R").exists() {
        "r"
    } else {
        "python"
    };
    let limits = sandcell_client::Limits {
        guest_memory_bytes: Some(64 << 20),
        ..Default::default()
    };
    // The first takes the free session; the second finds both held (the warm worker and
    // the first) and still opens: the warm worker gives way.
    let first = c.open(lang, Some(&limits), None).await.unwrap();
    let s = c.open(lang, Some(&limits), None).await;
    let s = s.expect("a pooled worker must give way");
    assert_eq!(d.descendants().len(), 2, "{}", d.log_text());
    c.close(&s.session).await.unwrap();
    c.close(&first.session).await.unwrap();
}

/// A refill never takes the last free session: a pool asked to hold the whole budget holds
/// all of it but one, and a tenant's Open takes that one without evicting anything.
#[tokio::test]
async fn a_refill_leaves_one_session_free() {
    let d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "3"),
        ("SANDCELL_POOL_PYTHON_MIN", "3"),
        ("SANDCELL_POOL_PYTHON_MAX", "3"),
        ("SANDCELL_POOL_REFILL_PER_SECOND", "50"),
    ]);
    assert!(
        eventually(Duration::from_secs(15), || d
            .log_text()
            .contains("admission has no room")),
        "{}",
        d.log_text()
    );
    assert_eq!(d.descendants().len(), 2, "{}", d.log_text());
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(d.descendants().len(), 2, "the pool took the last session");
    let mut c = d.client().await;
    let limits = sandcell_client::Limits {
        guest_memory_bytes: Some(64 << 20),
        ..Default::default()
    };
    let s = c.open("python", Some(&limits), None).await.unwrap();
    // Both warm workers are still there beside the tenant's session: nothing was evicted.
    assert_eq!(d.descendants().len(), 3, "{}", d.log_text());
    assert_eq!(d.log_text().matches("warm worker ready").count(), 2);
    c.close(&s.session).await.unwrap();
}

#[tokio::test]
async fn stopping_the_daemon_reaps_pooled_workers() {
    let mut d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "2"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
    ]);
    assert!(eventually(Duration::from_secs(10), || d
        .descendants()
        .len()
        == 2));
    // A pidfd names the process itself, so a pid reused after the worker is gone cannot
    // pass for it, and a worker that the daemon left behind (reparented, not killed) still
    // shows as running.
    let workers: Vec<(u32, std::os::fd::OwnedFd)> = d
        .descendants()
        .into_iter()
        .filter_map(|w| pidfd_open(w).map(|fd| (w, fd)))
        .collect();
    assert_eq!(workers.len(), 2, "the pooled workers are running");
    for (w, fd) in &workers {
        assert!(!exited(fd), "worker {w} is running before the stop");
    }
    assert!(
        d.terminate(Duration::from_secs(20)).is_some(),
        "daemon did not stop"
    );
    // SIGKILL is asynchronous: allow the kernel a moment to tear a killed worker down.
    for (w, fd) in &workers {
        assert!(
            eventually(Duration::from_secs(5), || exited(fd)),
            "worker {w} survived the daemon's stop"
        );
    }
}

/// A pidfd for `pid`, `None` when it is already gone.
fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    sandcelld::sys::pidfd_open(pid).ok()
}

/// Whether the process behind a pidfd has exited (pidfd_open(2): readable once it has).
fn exited(fd: &std::os::fd::OwnedFd) -> bool {
    sandcelld::sys::pidfd_exited(std::os::fd::AsFd::as_fd(fd))
}

/// The shipped defaults (no `pools = false`, no pool sizes): sizes derived from the budgets,
/// here 16 sessions and 16 GiB of worker memory, a quarter of which is 4 warm workers: one
/// per default environment and one for pydata (numpy, pandas and matplotlib preloaded), the
/// fourth for Python's default while it is taken. The first Run takes a warm worker.
#[tokio::test]
async fn default_config_keeps_a_warm_worker_per_default_environment_and_pydata() {
    let r = std::path::Path::new("/usr/lib/R/bin/exec/R").exists();
    if !r {
        eprintln!(
            "default_config_keeps_a_warm_worker_per_default_environment_and_pydata: R not installed at /usr/lib/R; checking the Python pools only"
        );
    }
    let d = Daemon::start(&[
        ("-SANDCELL_POOLS", ""),
        ("SANDCELL_LANGUAGES", if r { "python,r" } else { "python" }),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "16"),
        (
            "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES",
            &(16u64 << 27).to_string(),
        ),
        (
            "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES",
            &(16u64 << 30).to_string(),
        ),
    ]);
    let want = if r { 3 } else { 2 };
    assert!(
        eventually(Duration::from_secs(40), || d
            .log_text()
            .matches("warm worker ready")
            .count()
            >= want),
        "{:?}\n{}",
        d.descendants(),
        d.log_text()
    );
    let text = d.log_text();
    assert!(text.contains("environment=python"), "{text}");
    assert!(text.contains("environment=pydata"), "{text}");
    if r {
        assert!(text.contains("environment=r "), "{text}");
    }
    let mut c = d.client().await;
    let a = c.run_collect("python", "print(1)", None).await.unwrap();
    assert_eq!(a.stdout, "1\n");
    assert!(d.log_text().contains("warm=true"), "{}", d.log_text());
    // A pydata session from the pool has the preloaded modules imported already.
    let s = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .unwrap();
    let o = c
        .execute_collect(
            &s.session,
            "import sys\nprint(sorted(m for m in ('numpy', 'pandas') if m in sys.modules))",
        )
        .await
        .unwrap();
    c.close(&s.session).await.unwrap();
    let have_pandas = std::process::Command::new("/usr/bin/python3")
        .args(["-c", "import numpy, pandas"])
        .status()
        .is_ok_and(|s| s.success());
    if have_pandas {
        assert_eq!(o.stdout, "['numpy', 'pandas']\n", "{o:?}");
    } else {
        eprintln!(
            "default_config_keeps_a_warm_worker_per_default_environment_and_pydata: /usr/bin/python3 has no numpy or pandas; preload not checked"
        );
    }
}

/// With no take for `pool_empty_seconds` a pool empties: the daemon keeps no worker.
#[tokio::test]
async fn an_unused_pool_empties_after_the_empty_time() {
    let d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
        ("SANDCELL_POOL_EMPTY_SECONDS", "3"),
    ]);
    assert!(
        eventually(Duration::from_secs(10), || d.descendants().len() == 1),
        "pool did not fill: {}",
        d.log_text()
    );
    assert!(
        eventually(Duration::from_secs(15), || d.descendants().is_empty()),
        "pool did not empty: {:?}",
        d.descendants()
    );
    // A Run after that starts its own worker, and the pool refills behind it.
    let mut c = d.client().await;
    let a = c.run_collect("python", "print(2)", None).await.unwrap();
    assert_eq!(a.stdout, "2\n");
    assert!(
        eventually(Duration::from_secs(10), || !d.descendants().is_empty()),
        "pool did not refill after a miss"
    );
}

/// Warm workers are not sessions: a socket-activated daemon with a full pool still exits
/// when idle, and takes its pool with it.
#[tokio::test]
async fn an_activated_daemon_idle_exits_with_warm_workers() {
    if !std::path::Path::new("/usr/bin/systemd-socket-activate").exists()
        && !std::path::Path::new("/bin/systemd-socket-activate").exists()
    {
        sandcell_testing::skip!(
            "socket-activation",
            "systemd-socket-activate not installed (package systemd)"
        );
    }
    let mut d = Daemon::start_activated(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_IDLE_EXIT_SECONDS", "3"),
    ]);
    // Activation is by the first connection; it goes away at once.
    drop(d.client().await);
    assert!(
        eventually(Duration::from_secs(10), || d
            .log_text()
            .contains("warm worker ready")),
        "pool did not fill: {}",
        d.log_text()
    );
    let mut status = None;
    eventually(Duration::from_secs(20), || {
        status = d.child.try_wait().ok().flatten();
        status.is_some()
    });
    let status = status.unwrap_or_else(|| {
        panic!(
            "daemon with a warm pool did not exit when idle:\n{}",
            d.log_text()
        )
    });
    assert!(status.success(), "{status:?}\n{}", d.log_text());
}

/// Tenant sessions fill the whole session budget while the pool wants workers: every Open
/// succeeds, the pool yields (its idle workers are evicted, its refills refused).
#[tokio::test]
async fn tenants_fill_the_budget_and_the_pool_yields() {
    let d = Daemon::start(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "3"),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "3"),
        ("SANDCELL_MAX_DETACHED_SESSIONS_PER_UID", "3"),
        ("SANDCELL_POOL_PYTHON_MIN", "2"),
        ("SANDCELL_POOL_PYTHON_MAX", "3"),
    ]);
    assert!(eventually(Duration::from_secs(10), || d
        .descendants()
        .len()
        == 2));
    let mut c = d.client().await;
    let mut open = Vec::new();
    for i in 0..3 {
        let s = c.open("python", None, Some(60)).await.unwrap_or_else(|e| {
            panic!("tenant Open {i} refused while the pool held capacity: {e:?}")
        });
        open.push(s.session);
    }
    // The budget is the tenants': no warm worker runs beside their 3 sessions.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(d.descendants().len(), 3, "{}", d.log_text());
    for s in &open {
        c.close(s).await.unwrap();
    }
}
