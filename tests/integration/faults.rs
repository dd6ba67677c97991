//! Fault injection against the real daemon: a worker killed with SIGKILL in the middle of a
//! cell, and a worker stopped with SIGSTOP (before a cell, and while idle before Close). Each
//! test asserts what the client saw and that nothing was left behind (worker processes, the
//! session directory, the admission charge).

use crate::common;

use common::{Daemon, eventually};
use sandcell_client::{Error, KernelError, Limits, State, Status};
use std::time::{Duration, Instant};

/// Pids that appeared among the daemon's descendants since `before`.
fn new_pids(d: &Daemon, before: &[u32]) -> Vec<u32> {
    d.descendants()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect()
}

fn signal(pids: &[u32], sig: i32) {
    for &p in pids {
        // SAFETY: plain kill(2) on pids of the daemon's workers, found just before.
        unsafe { libc::kill(p as i32, sig) };
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn session_dir(d: &Daemon, id: &str) -> std::path::PathBuf {
    d.dir.path().join("state/sessions").join(id)
}

#[tokio::test]
async fn a_worker_killed_mid_cell_reports_worker_crashed_and_frees_its_capacity() {
    // Room for exactly two sessions, both of this uid.
    let d = Daemon::start(&[
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "2"),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "2"),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
    ]);
    let before = d.descendants();
    let mut a = d.client().await;
    let sa = a.open("python", None, None).await.unwrap().session;
    let workers_a = new_pids(&d, &before);
    assert!(!workers_a.is_empty(), "no worker process for session {sa}");
    let mut b = d.client().await;
    let sb = b.open("python", None, None).await.unwrap().session;
    b.execute_collect(&sb, "v = 41").await.unwrap();
    let mut c = d.client().await;
    match c.open("python", None, None).await {
        Err(Error::Kernel(KernelError::CapacityExceeded { .. })) => {}
        other => panic!("a third session must be refused while two run: {other:?}"),
    }

    a.execute(&sa, "import time\ntime.sleep(30)\n")
        .await
        .unwrap();
    let started = a
        .next_frame()
        .await
        .unwrap()
        .started
        .expect("started first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&workers_a, libc::SIGKILL);
    let t0 = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(15), a.finish(|_| {}))
        .await
        .expect("the killed cell's result must arrive, not hang")
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(out.result.cell, started.cell);
    assert_eq!(out.result.status, Status::WorkerCrashed, "{:?}", out.result);
    assert!(out.result.session_ended, "{:?}", out.result);
    assert_eq!(out.result.state, State::Lost, "{:?}", out.result);
    assert!(out.result.error.is_some(), "a crashed cell says why");

    // The other session is untouched.
    let other = b.execute_collect(&sb, "print(v + 1)").await.unwrap();
    assert_eq!(other.stdout, "42\n", "{:?}", other.result);

    // The crashed session is gone, with its processes and directory, and its capacity is free.
    assert!(eventually(Duration::from_secs(10), || workers_a
        .iter()
        .all(|&p| !alive(p))));
    assert!(
        eventually(Duration::from_secs(10), || !session_dir(&d, &sa).exists()),
        "session directory of {sa} left behind"
    );
    match a.execute_collect(&sa, "print(1)").await {
        Err(Error::Kernel(KernelError::SessionEnded { reason, .. }))
            if reason == "worker_crashed" => {}
        other => panic!("the crashed session must be gone: {other:?}"),
    }
    let t0 = Instant::now();
    let sc = loop {
        match c.open("python", None, None).await {
            Ok(o) => break o.session,
            Err(Error::Kernel(KernelError::CapacityExceeded { .. }))
                if t0.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the crashed session's capacity was not released: {e}"),
        }
    };
    let out = c.execute_collect(&sc, "print('fresh')").await.unwrap();
    assert_eq!(out.stdout, "fresh\n");
    c.close(&sc).await.unwrap();
    b.close(&sb).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || d.descendants().is_empty()),
        "workers left: {:?}",
        d.descendants()
    );
}

#[tokio::test]
async fn a_stopped_worker_still_meets_its_deadline_and_close() {
    let d = Daemon::start(&[
        ("SANDCELL_KILL_GRACE_SECONDS", "1"),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "8"),
    ]);
    let wall = 2.0;
    let limits = Limits {
        wall_time_seconds: Some(wall),
        ..Default::default()
    };

    // Stopped between cells: the next cell cannot start, and still ends by its deadline.
    let before = d.descendants();
    let mut a = d.client().await;
    let sa = a.open("python", Some(&limits), None).await.unwrap().session;
    let workers_a = new_pids(&d, &before);
    a.execute_collect(&sa, "x = 1").await.unwrap();
    signal(&workers_a, libc::SIGSTOP);
    let t0 = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(30), a.execute_collect(&sa, "print(x)"))
        .await
        .expect("a stopped worker's cell must end, not hang")
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs_f64(wall + 1.0 + 5.0),
        "deadline {wall} s + grace 1 s, took {took:?}"
    );
    assert_eq!(out.result.status, Status::Timeout, "{:?}", out.result);
    assert!(out.stdout.is_empty());
    // A worker that ignored the interrupt was killed: the session ends and says so.
    if out.result.session_ended {
        assert_eq!(out.result.state, State::Lost, "{:?}", out.result);
        assert!(eventually(Duration::from_secs(10), || workers_a
            .iter()
            .all(|&p| !alive(p))));
        assert!(eventually(Duration::from_secs(10), || !session_dir(
            &d, &sa
        )
        .exists()));
    } else {
        a.close(&sa).await.unwrap();
    }

    // Stopped while idle: Close still returns promptly and removes everything.
    let before = d.descendants();
    let mut b = d.client().await;
    let sb = b.open("python", None, None).await.unwrap().session;
    let workers_b = new_pids(&d, &before);
    b.execute_collect(&sb, "y = 2").await.unwrap();
    signal(&workers_b, libc::SIGSTOP);
    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(20), b.close(&sb))
        .await
        .expect("Close of a stopped worker must return")
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "Close took {:?}",
        t0.elapsed()
    );
    assert!(
        workers_b.iter().all(|&p| !alive(p)),
        "Close returns after the worker is gone"
    );
    assert!(eventually(Duration::from_secs(10), || !session_dir(
        &d, &sb
    )
    .exists()));

    // Nothing is left and the daemon still serves.
    assert!(
        eventually(Duration::from_secs(10), || d.descendants().is_empty()),
        "workers left: {:?}",
        d.descendants()
    );
    let out = b.run_collect("python", "print(6 * 7)", None).await.unwrap();
    assert_eq!(out.stdout, "42\n");
}

/// Kills the worker of a fresh session with SIGKILL during a sleeping cell; returns the cell's
/// error.
async fn kill_mid_cell(d: &Daemon) -> sandcell_client::CellResult {
    let before = d.descendants();
    let mut a = d.client().await;
    let s = a.open("python", None, None).await.unwrap().session;
    let workers = new_pids(d, &before);
    a.execute(&s, "import time\ntime.sleep(30)\n")
        .await
        .unwrap();
    a.next_frame()
        .await
        .unwrap()
        .started
        .expect("started first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&workers, libc::SIGKILL);
    tokio::time::timeout(Duration::from_secs(15), a.finish(|_| {}))
        .await
        .expect("the killed cell's result must arrive")
        .unwrap()
        .result
}

/// The crash report of a killed worker names the signal, so that an operator can tell an
/// outside kill (or the OOM killer) from a worker that exited.
#[tokio::test]
async fn a_killed_workers_crash_report_names_the_signal() {
    let d = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]);
    let r = kill_mid_cell(&d).await;
    assert_eq!(r.status, Status::WorkerCrashed, "{r:?}");
    let err = r.error.expect("a crashed cell says why");
    assert!(
        err.message.contains("SIGKILL") || err.message.contains("signal 9"),
        "the crash report names the signal: {err:?}"
    );
}
