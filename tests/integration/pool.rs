//! Warm worker pools: sessions start from pre-started, confined workers; a worker
//! is never reused; idle pooled workers never cause a refusal.

use crate::common;

use common::{Daemon, eventually};
use std::time::Duration;

#[tokio::test]
async fn sessions_take_warm_workers_and_never_reuse_them() {
    let d = Daemon::start(&[
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
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "2"),
        ("SANDCELL_POOL_PYTHON_MIN", "2"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
        ("SANDCELL_LANGUAGES", "python,r"),
    ]);
    assert!(eventually(Duration::from_secs(10), || d
        .log_text()
        .matches("warm worker ready")
        .count()
        == 2));
    let mut c = d.client().await;
    // Both admission slots are held by idle Python workers; an R session still opens.
    let lang = if std::path::Path::new("/usr/lib/R/bin/exec/R").exists() {
        "r"
    } else {
        "python"
    };
    let s = c
        .open(
            lang,
            Some(&sandcell_client::Limits {
                guest_memory_bytes: Some(64 << 20),
                ..Default::default()
            }),
            None,
        )
        .await;
    let s = s.expect("a pooled worker must give way");
    c.close(&s.session).await.unwrap();
}

#[tokio::test]
async fn stopping_the_daemon_reaps_pooled_workers() {
    let mut d = Daemon::start(&[
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
