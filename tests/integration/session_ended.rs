//! Sessions say why they ended, against the real daemon: after Close, idle expiry, a killed
//! worker and a daemon restart (killed, or stopped) a call naming the session answers its
//! owner `SessionEnded` with the reason; another uid and an id that never existed get
//! `NoSuchSession`; the store of ended sessions is bounded.

use crate::common;

use common::{Daemon, call_as, rand_hex};
use sandcell_client::{Client, Error, KernelError};
use std::time::{Duration, Instant, SystemTime};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The error `Execute` on `id` answers (it must fail).
async fn execute_error(c: &mut Client, id: &str) -> KernelError {
    match c.execute_collect(id, "print(1)").await {
        Err(Error::Kernel(e)) => e,
        other => panic!("Execute on {id} must fail with a named error: {other:?}"),
    }
}

/// Asserts `e` is `SessionEnded` for `id` with `reason`, ended within `window` seconds of now.
fn assert_ended(e: &KernelError, id: &str, reason: &str, window: f64) {
    match e {
        KernelError::SessionEnded {
            session,
            reason: r,
            ended_at,
        } => {
            assert_eq!(session, id);
            assert_eq!(r, reason, "{e:?}");
            let age = now() - ended_at;
            assert!(
                (-1.0..window).contains(&age),
                "ended_at {ended_at} is {age} s before now"
            );
        }
        other => panic!("expected SessionEnded({reason}) for {id}, got {other:?}"),
    }
}

#[tokio::test]
async fn a_closed_session_answers_session_ended_to_its_owner_only() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&s, "x = 1").await.unwrap();
    c.close(&s).await.unwrap();

    // Every method naming the session tells its owner.
    let e = execute_error(&mut c, &s).await;
    assert_ended(&e, &s, "closed", 30.0);
    assert!(e.is_no_such_session());
    match c.close(&s).await {
        Err(Error::Kernel(e)) => assert_ended(&e, &s, "closed", 30.0),
        other => panic!("Close of a closed session: {other:?}"),
    }
    match c.list_files(&s).await {
        Err(Error::Kernel(e)) => assert_ended(&e, &s, "closed", 30.0),
        other => panic!("ListFiles of a closed session: {other:?}"),
    }
    match c.interrupt(&s, 1).await {
        Err(Error::Kernel(e)) => assert_ended(&e, &s, "closed", 30.0),
        other => panic!("Interrupt of a closed session: {other:?}"),
    }

    // An id that never existed is NoSuchSession, echoed as given.
    let never = rand_hex(16);
    match execute_error(&mut c, &never).await {
        KernelError::NoSuchSession { session } => assert_eq!(session, never),
        other => panic!("a never-existing id: {other:?}"),
    }
    // So is something that is not an id at all.
    let e = execute_error(&mut c, "not-a-session").await;
    assert!(
        matches!(e, KernelError::NoSuchSession { .. }),
        "a malformed id: {e:?}"
    );

    // Another uid learns nothing: NoSuchSession, exactly as for an id that never existed.
    if is_root() {
        std::fs::set_permissions(
            &d.socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        for (method, params) in [
            (
                "Execute",
                serde_json::json!({"session": s, "code": "print(1)"}),
            ),
            ("Close", serde_json::json!({"session": s})),
            ("ListFiles", serde_json::json!({"session": s})),
        ] {
            let reply = call_as(65534, &d.socket, method, params);
            assert_eq!(
                reply["error"], "org.sandcell.Kernel.NoSuchSession",
                "{method} as another uid: {reply}"
            );
            assert_eq!(reply["parameters"], serde_json::json!({"session": s}));
        }
    } else {
        sandcell_testing::skip!("root", "asking as another uid needs setresuid");
    }
}

/// Polls `ListFiles` on `id` (which does not count as activity) until the session is gone;
/// returns the error then.
async fn ended_within(c: &mut Client, id: &str, timeout: Duration) -> KernelError {
    let t0 = Instant::now();
    loop {
        match c.list_files(id).await {
            Err(Error::Kernel(e)) => return e,
            Err(e) => panic!("ListFiles on {id}: {e:?}"),
            Ok(_) => {}
        }
        assert!(t0.elapsed() < timeout, "{id} still lives after {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn idle_expiry_and_a_killed_worker_are_reported() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;

    // Idle expiry of a detached session (1 s without a cell).
    let idle = c.open("python", None, Some(1)).await.unwrap().session;
    let e = ended_within(&mut c, &idle, Duration::from_secs(30)).await;
    assert_ended(&e, &idle, "idle_expired", 30.0);
    assert_ended(
        &execute_error(&mut c, &idle).await,
        &idle,
        "idle_expired",
        30.0,
    );

    // A worker killed while its session is idle.
    let before = d.descendants();
    let s = c.open("python", None, None).await.unwrap().session;
    let workers: Vec<u32> = d
        .descendants()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    assert!(!workers.is_empty(), "no worker process for {s}");
    for &p in &workers {
        // SAFETY: kill(2) of this daemon's worker processes, found just before.
        unsafe { libc::kill(p as i32, libc::SIGKILL) };
    }
    let e = ended_within(&mut c, &s, Duration::from_secs(30)).await;
    assert_ended(&e, &s, "worker_crashed", 30.0);
    // It stays reported (the record outlives the lookup).
    assert_ended(&execute_error(&mut c, &s).await, &s, "worker_crashed", 30.0);
}

#[tokio::test]
async fn sessions_of_a_previous_daemon_answer_daemon_restarted() {
    if common::insecure() {
        sandcell_testing::skip!(
            "root",
            "the successor's sweep of the killed daemon's workers needs a root daemon with cgroups"
        );
    }
    let cgroup = format!("sandcell-ended-{}", rand_hex(5));
    let env = [("SANDCELL_CGROUP_NAME", cgroup.as_str())];
    let mut first = Daemon::start(&env);
    let state = first.dir.path().join("state");
    let state_s = state.display().to_string();
    let mut env2 = env.to_vec();
    env2.push(("SANDCELL_STATE_DIR", state_s.as_str()));

    // Killed with SIGKILL: no shutdown path runs; the owner marker is what is left.
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    c.execute_collect(&a, "v = 41").await.unwrap();
    drop(c);
    let _ = first.child.kill();
    let _ = first.child.wait();
    let t_kill = now();
    let mut second = Daemon::start_on(&first.socket, &env2);
    let mut c = second.client().await;
    let e = execute_error(&mut c, &a).await;
    assert_ended(&e, &a, "daemon_restarted", 60.0);
    match &e {
        KernelError::SessionEnded { ended_at, .. } => assert!(*ended_at >= t_kill - 1.0),
        _ => unreachable!(),
    }

    // Stopped (SIGTERM) with a session open: its successor reports it the same way.
    let b = c.open("python", None, Some(600)).await.unwrap().session;
    drop(c);
    assert!(
        second.terminate(Duration::from_secs(30)).is_some(),
        "the second daemon did not stop"
    );
    let third = Daemon::start_on(&first.socket, &env2);
    let mut c = third.client().await;
    assert_ended(
        &execute_error(&mut c, &b).await,
        &b,
        "daemon_restarted",
        60.0,
    );
    // The first daemon's session is not known twice over: its marker was taken once.
    match execute_error(&mut c, &a).await {
        KernelError::NoSuchSession { .. } => {}
        other => panic!("a session two daemons ago: {other:?}"),
    }
    // No marker is left behind for the sessions reported.
    let markers: Vec<_> = std::fs::read_dir(state.join("owners"))
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(markers.is_empty(), "markers left: {markers:?}");
}

#[tokio::test]
async fn the_store_of_ended_sessions_is_bounded() {
    // Markers a previous daemon left, more than the store holds: the successor records at most
    // MAX_RECORDS of them and removes them all.
    const MAX_RECORDS: usize = 4096;
    let d0 = Daemon::start(&[]);
    let state = d0.dir.path().join("state");
    let owners = state.join("owners");
    std::fs::create_dir_all(&owners).unwrap();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let ids: Vec<String> = (0..MAX_RECORDS + 200).map(|_| rand_hex(16)).collect();
    for id in &ids {
        std::fs::File::create(owners.join(format!("{id}.{uid}"))).unwrap();
    }
    let state_s = state.display().to_string();
    let sock = d0.dir.path().join("second.sock");
    let d = Daemon::start_on(&sock, &[("SANDCELL_STATE_DIR", state_s.as_str())]);
    let mut c = d.client().await;
    let (mut ended, mut unknown) = (0, 0);
    let t0 = Instant::now();
    for id in &ids {
        match c.close(id).await {
            Err(Error::Kernel(KernelError::SessionEnded { reason, .. })) => {
                assert_eq!(reason, "daemon_restarted");
                ended += 1;
            }
            Err(Error::Kernel(KernelError::NoSuchSession { .. })) => unknown += 1,
            other => panic!("Close of a recorded id: {other:?}"),
        }
    }
    eprintln!(
        "figure: {} lookups of ended sessions in {:?}; daemon RSS {} KiB",
        ids.len(),
        t0.elapsed(),
        d.rss() / 1024
    );
    assert_eq!(ended, MAX_RECORDS, "records kept");
    assert_eq!(unknown, 200, "ids past the bound answer NoSuchSession");
    assert_eq!(std::fs::read_dir(&owners).unwrap().count(), 0);
}

/// An `Execute` that races its session's end (the owner's connection closing while another
/// connection of the same uid sends the cell) is answered with the session's end, never with
/// a worker failure: a cell queued behind the end is dropped with the session.
#[tokio::test]
async fn an_execute_racing_the_owners_disconnect_answers_the_sessions_end() {
    let d = Daemon::start(&[]);
    let mut other = d.client().await;
    for round in 0..12 {
        let mut owner = d.client().await;
        let s = owner.open("python", None, None).await.unwrap().session;
        owner.execute_collect(&s, "a = 1").await.unwrap();
        drop(owner);
        let t0 = Instant::now();
        let e = loop {
            match other.execute_collect(&s, "print(a)").await {
                Ok(_) => {}
                Err(Error::Kernel(e)) => break e,
                Err(e) => panic!("round {round}: Execute on {s}: {e:?}"),
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "round {round}: {s} outlived its owner's connection"
            );
        };
        assert!(
            e.is_no_such_session(),
            "round {round}: an Execute racing the owner's disconnect: {e:?}"
        );
    }
}
