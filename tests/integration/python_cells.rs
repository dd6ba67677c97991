//! Python cells through a real sandcelld, real Eryx workers, real sockets.

use crate::common;

use common::{Daemon, call_as, eventually};
use sandcell_client::{Error, KernelError, Limits, State, Status};
use std::time::{Duration, Instant};

fn examples() -> std::path::PathBuf {
    common::manifest_dir().join("../examples/python")
}

#[tokio::test]
async fn examples_print_their_published_answers() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let mut n = 0;
    for e in std::fs::read_dir(examples()).unwrap().flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("py") {
            continue;
        }
        let code = std::fs::read_to_string(&p).unwrap();
        let want = std::fs::read_to_string(p.with_extension("out")).unwrap();
        let out = c.run_collect("python", &code, None).await.unwrap();
        assert_eq!(
            out.result.status,
            Status::Ok,
            "{}: {:?}",
            p.display(),
            out.result.error
        );
        assert_eq!(out.stdout, want, "{}", p.display());
        assert_eq!(out.result.state, State::None);
        assert!(out.result.session_ended);
        n += 1;
    }
    assert!(n >= 5, "examples missing");
}

#[tokio::test]
async fn session_keeps_variables_and_sessions_are_isolated() {
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let mut b = d.client().await;
    let sa = a.open("python", None, None).await.unwrap().session;
    let sb = b.open("python", None, None).await.unwrap().session;
    assert_ne!(sa, sb);
    a.execute_collect(&sa, "x = 41\nimport math").await.unwrap();
    let out = a
        .execute_collect(&sa, "x += 1\nprint(x, math.sqrt(16))")
        .await
        .unwrap();
    assert_eq!(out.stdout, "42 4.0\n");
    assert_eq!(out.cell, 2);
    // Session b does not see a's variables.
    let out = b
        .execute_collect(&sb, "print('x' in globals())")
        .await
        .unwrap();
    assert_eq!(out.stdout, "False\n");
    // Another uid cannot use a's session, nor learn that it exists (root may: it owns
    // every session, and this test's clients are root when the test runs as root).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(
            &d.socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        let reply = call_as(
            65534,
            &d.socket,
            "Execute",
            serde_json::json!({"session": sa, "code": "print(1)"}),
        );
        assert_eq!(
            reply["error"], "org.sandcell.Kernel.NoSuchSession",
            "{reply}"
        );
        assert_eq!(reply["parameters"]["session"], sa.as_str(), "{reply}");
    } else {
        let e = b.execute_collect(&sa, "print(1)").await.unwrap_err();
        assert!(
            matches!(e, Error::Kernel(KernelError::NoSuchSession { .. })),
            "{e:?}"
        );
    }
    // One-shot runs do not share state either.
    a.run_collect("python", "y = 5", None).await.unwrap();
    let out = a
        .run_collect("python", "print('y' in globals())", None)
        .await
        .unwrap();
    assert_eq!(out.stdout, "False\n");
    a.close(&sa).await.unwrap();
    let e = a.execute_collect(&sa, "print(x)").await.unwrap_err();
    assert!(
        matches!(&e, Error::Kernel(KernelError::SessionEnded { reason, .. }) if reason == "closed"),
        "{e:?}"
    );
}

/// A client that sends its next cell the moment a result arrives never finds the session
/// busy (the session goes idle before its result is visible). Four sessions at once on two
/// cores, so that the daemon's threads race the clients.
#[tokio::test]
async fn back_to_back_cells_never_find_the_session_busy() {
    let d = Daemon::start(&[]);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let s = c.open("python", None, None).await.unwrap().session;
            c.execute_collect(&s, "n = 0").await.unwrap();
            for i in 1..=1000u32 {
                let out = c.execute_collect(&s, "n += 1").await;
                assert!(out.is_ok(), "cell {i}: {out:?}");
                assert_eq!(out.unwrap().result.status, Status::Ok);
            }
            let out = c.execute_collect(&s, "print(n)").await.unwrap();
            assert_eq!(out.stdout, "1000\n");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// With `interrupt_on_hangup`, a client that goes away during a cell (Ctrl-C on sandcellctl)
/// costs that cell, not the session: the cell is interrupted, and the detached session keeps
/// its variables for the next connection. The same holds for a session used from a second
/// connection of its owner. (Without it the cell runs on: `submit_attach.rs`.)
#[tokio::test]
async fn a_client_gone_mid_cell_interrupts_the_cell_and_keeps_the_session() {
    let d = Daemon::start(&[
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120"),
        ("SANDCELL_INTERRUPT_ON_HANGUP", "true"),
    ]);
    let mut owner = d.client().await;
    let s = owner.open("python", None, Some(300)).await.unwrap().session;
    owner.execute_collect(&s, "x = 41").await.unwrap();
    for round in 0..2 {
        let mut c = d.client().await;
        c.execute(
            &s,
            "import time\nprint('started', flush=True)\ntime.sleep(60)",
        )
        .await
        .unwrap();
        // Wait until the cell runs, then hang up.
        loop {
            let f = c.next_frame().await.unwrap();
            if f.output.is_some() {
                break;
            }
        }
        drop(c);
        if round == 0 {
            drop(owner);
            owner = d.client().await;
        }
        // The interrupted cell winds down; then the session takes cells again.
        let t0 = Instant::now();
        let out = loop {
            match owner.execute_collect(&s, "x += 1\nprint(x)").await {
                Err(Error::Kernel(KernelError::SessionBusy { .. }))
                    if t0.elapsed() < Duration::from_secs(10) =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                r => break r.unwrap(),
            }
        };
        assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
        assert_eq!(out.stdout, format!("{}\n", 42 + round));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
    // Each round's next cell ran within 5 s of the client leaving mid-loop, so the loop was
    // interrupted rather than left to its wall time, and `x` shows the session kept its state.
}

#[tokio::test]
async fn infinite_loop_times_out_and_session_survives() {
    // Fuel high enough that the wall time, not the fuel, ends the loop.
    let d = Daemon::start(&[
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "2"),
        ("SANDCELL_MAX_FUEL", "1000000000000000"),
    ]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&s, "keep = [1, 2, 3]").await.unwrap();
    let t0 = Instant::now();
    let out = c
        .execute_collect(&s, "while True:\n    pass\n")
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Timeout, "{:?}", out.result);
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t0.elapsed()
    );
    assert_ne!(out.result.state, State::Kept);
    let after = c.execute_collect(&s, "print(sum(keep))").await.unwrap();
    if out.result.state == State::Restored {
        assert_eq!(
            after.stdout, "6\n",
            "restored state lost variables: {:?}",
            after.result
        );
    } else {
        // The loss must be reported, never silent.
        assert_eq!(out.result.state, State::Lost);
        assert!(out.result.error.is_some());
    }
}

#[tokio::test]
async fn fuel_ends_a_loop() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let limits = Limits {
        fuel: Some(50_000_000),
        ..Default::default()
    };
    let out = c
        .run_collect("python", "n = 0\nwhile True:\n    n += 1\n", Some(&limits))
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::FuelExhausted, "{:?}", out.result);
    assert!(out.result.usage.fuel.unwrap_or(0) > 0);
    // The result says what fuel is and which key raises it.
    let w = out.result.warnings.join("\n");
    assert!(
        w.contains("WebAssembly") && w.contains("max_fuel") && w.contains("50000000"),
        "{w}"
    );
}

#[tokio::test]
async fn own_sessions_are_listed_and_their_running_cell_interrupted_by_session() {
    let d = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120")]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(600)).await.unwrap().session;
    let mut b = d.client().await;
    // Nothing has run: an interrupt names no cell, and a cell number never reached is
    // NoSuchCell, not not_running.
    let r = b.interrupt_session(&s).await.unwrap();
    assert_eq!(
        (r.delivered, r.reason.as_str(), r.cell),
        (false, "not_running", None)
    );
    for cell in [0, 1, 99] {
        match b.interrupt(&s, cell).await.unwrap_err() {
            Error::Kernel(KernelError::NoSuchCell { cell: c, .. }) => assert_eq!(c, cell),
            other => panic!("cell {cell}: {other:?}"),
        }
    }
    a.execute(&s, "import time\ntime.sleep(60)\n")
        .await
        .unwrap();
    let started = a
        .next_frame()
        .await
        .unwrap()
        .started
        .expect("started frame first");
    // Listed from another connection of the same uid, running that cell.
    let (rows, truncated) = b.list_sessions().await.unwrap();
    assert!(!truncated);
    let row = rows
        .iter()
        .find(|r| r.session == s)
        .expect("own session listed");
    assert_eq!(row.language, "python");
    assert_eq!(row.detached_idle_seconds, Some(600));
    assert!(!row.this_connection);
    assert!(row.started > 1.0e9, "{row:?}");
    assert_eq!(row.running_cell, Some(started.cell), "{row:?}");
    assert_eq!(row.state, "running");
    // Interrupted without knowing the cell's number.
    let r = b.interrupt_session(&s).await.unwrap();
    assert!(r.delivered, "{r:?}");
    assert_eq!(r.cell, Some(started.cell));
    let out = a.finish(|_| {}).await.unwrap();
    assert_eq!(out.result.status, Status::Interrupted);
    // The finished cell is not running: not_running, not NoSuchCell.
    let r = b.interrupt(&s, started.cell).await.unwrap();
    assert_eq!(r.reason, "not_running");
    let (rows, _) = a.list_sessions().await.unwrap();
    let row = rows.iter().find(|r| r.session == s).unwrap();
    assert_eq!(
        (row.state.as_str(), row.cells_run, row.this_connection),
        ("idle", 1, true)
    );
    a.close(&s).await.unwrap();
    let (rows, _) = b.list_sessions().await.unwrap();
    assert!(rows.iter().all(|r| r.session != s), "{rows:?}");
}

#[tokio::test]
async fn interrupt_from_another_connection_ends_sleep_within_a_second() {
    let d = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120")]);
    let mut a = d.client().await;
    let s = a.open("python", None, None).await.unwrap().session;
    a.execute_collect(&s, "v = 'still here'").await.unwrap();
    a.execute(&s, "import time\ntime.sleep(60)\n")
        .await
        .unwrap();
    let started = a
        .next_frame()
        .await
        .unwrap()
        .started
        .expect("started frame first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut b = d.client().await;
    let t0 = Instant::now();
    let r = b.interrupt(&s, started.cell).await.unwrap();
    assert!(r.delivered, "{r:?}");
    let out = a.finish(|_| {}).await.unwrap();
    // Not interrupted, the cell would sleep 60 s.
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "interrupt took {:?}",
        t0.elapsed()
    );
    assert_eq!(out.result.status, Status::Interrupted);
    // Between cells an interrupt reaches nobody and says so.
    let r = b.interrupt(&s, started.cell).await.unwrap();
    assert!(!r.delivered);
    assert_eq!(r.reason, "not_running");
    let after = a.execute_collect(&s, "print(v)").await.unwrap();
    assert_eq!(after.stdout, "still here\n", "{:?}", out.result);
}

#[tokio::test]
async fn print_flood_is_truncated_with_exact_counts_and_memory_stays_bounded() {
    let d = Daemon::start(&[("SANDCELL_MAX_STDOUT_BYTES", "1000")]);
    let before = d.rss();
    let mut c = d.client().await;
    let out = c
        .run_collect(
            "python",
            "for i in range(200):\n    print('x' * 9999)\n",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.result.stdout.seen, 200 * 10_000);
    assert_eq!(out.result.stdout.kept, 1000);
    assert!(out.result.stdout.truncated);
    assert_eq!(out.stdout.len(), 1000);
    let after = d.rss();
    assert!(
        after < before + 32 * 1024 * 1024,
        "daemon RSS grew from {before} to {after}"
    );
}

#[tokio::test]
async fn raw_descriptor_writes_go_nowhere() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let out = c
        .run_collect(
            "python",
            "import os\nos.write(1, b'RAWMARK-1\\n')\nos.write(2, b'RAWMARK-2\\n')\nprint('ok')",
            None,
        )
        .await
        .unwrap();
    assert!(
        !out.stdout.contains("RAWMARK") && !out.stderr.contains("RAWMARK"),
        "{out:?}"
    );
    assert!(!d.log_text().contains("RAWMARK"));
}

#[tokio::test]
async fn exception_reports_traceback_with_user_lines_and_sys_exit_is_not_a_crash() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let out = c
        .run_collect(
            "python",
            "a = 1\nb = 0\n\ndef f():\n    return a / b\n\nf()\n",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Error);
    let e = out.result.error.unwrap();
    assert_eq!(e.kind, "ZeroDivisionError");
    assert_eq!(e.line, Some(5), "{e:?}");
    let tb = e.traceback.unwrap_or_default();
    assert!(tb.contains("line 5") && tb.contains("line 7"), "{tb}");
    let out = c
        .run_collect("python", "import sys\nprint('bye')\nsys.exit(3)\n", None)
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Exited, "{:?}", out.result);
    assert_eq!(out.result.exit_code, Some(3));
    assert_eq!(out.stdout, "bye\n");
}

#[tokio::test]
async fn oversized_source_is_refused_before_any_worker_starts() {
    let d = Daemon::start(&[("SANDCELL_MAX_SOURCE_BYTES", "100")]);
    let opened = d.log_text().matches("session opened").count(); // the readiness probe's
    let mut c = d.client().await;
    let code = format!("x = '{}'", "a".repeat(200));
    let e = c.run_collect("python", &code, None).await.unwrap_err();
    match e {
        Error::Kernel(KernelError::LimitExceeded { limit, value, max }) => {
            assert_eq!(limit, "max_source_bytes");
            assert_eq!(value, code.len() as u64);
            assert_eq!(max, 100);
        }
        other => panic!("{other:?}"),
    }
    assert!(d.descendants().is_empty());
    assert_eq!(d.log_text().matches("session opened").count(), opened);
}

#[tokio::test]
async fn capacity_is_refused_at_once_and_freed_by_disconnect() {
    let d = Daemon::start(&[
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "1"),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
    ]);
    let mut a = d.client().await;
    a.run("python", "import time\ntime.sleep(50)", None)
        .await
        .unwrap();
    assert!(a.next_frame().await.unwrap().started.is_some());
    let mut b = d.client().await;
    let t0 = Instant::now();
    let e = b.open("python", None, None).await.unwrap_err();
    // Refused at once; an Open that queued would wait for the 50 s cell.
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "refusal waited {:?}",
        t0.elapsed()
    );
    match e {
        Error::Kernel(KernelError::CapacityExceeded {
            budget,
            in_use,
            max,
            ..
        }) => {
            assert_eq!(budget, "max_concurrent_sessions");
            assert_eq!((in_use, max), (1, 1));
        }
        other => panic!("{other:?}"),
    }
    assert!(!d.descendants().is_empty());
    drop(a); // disconnect mid-cell
    assert!(
        eventually(Duration::from_secs(5), || d.descendants().is_empty()),
        "worker left behind: {:?}",
        d.descendants()
    );
    let t0 = Instant::now();
    let s = b
        .open("python", None, None)
        .await
        .expect("capacity released after the worker was reaped");
    assert!(t0.elapsed() < Duration::from_secs(5));
    b.close(&s.session).await.unwrap();
    assert!(eventually(Duration::from_secs(5), || d
        .descendants()
        .is_empty()));
}

#[tokio::test]
async fn socket_activation_serves_cells_and_exits_when_idle() {
    if which("systemd-socket-activate").is_none() {
        sandcell_testing::skip!(
            "socket-activation",
            "systemd-socket-activate not installed (package systemd)"
        );
    }
    let mut d = Daemon::start_activated(&[("SANDCELL_IDLE_EXIT_SECONDS", "2")]);
    let mut c = d.client().await;
    let out = c
        .run_collect("python", "print('activated')", None)
        .await
        .unwrap();
    assert_eq!(out.stdout, "activated\n");
    assert!(d.log_text().contains("activated=true"), "{}", d.log_text());
    drop(c);
    // Idle: the daemon exits by itself.
    let mut status = None;
    eventually(Duration::from_secs(15), || {
        status = d.child.try_wait().ok().flatten();
        status.is_some()
    });
    let status =
        status.unwrap_or_else(|| panic!("daemon did not exit when idle:\n{}", d.log_text()));
    // An idle exit is a clean one (a crash or a signal is not).
    assert!(status.success(), "{status:?}\n{}", d.log_text());
}

fn which(cmd: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(cmd))
            .find(|p| p.exists())
    })
}

#[tokio::test]
async fn varlink_introspection_answers() {
    use std::io::{Read, Write};
    let d = Daemon::start(&[]);
    let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    let mut ask = |msg: &str| -> serde_json::Value {
        s.write_all(msg.as_bytes()).unwrap();
        s.write_all(b"\0").unwrap();
        let mut buf = Vec::new();
        let mut b = [0u8; 1];
        loop {
            s.read_exact(&mut b).unwrap();
            if b[0] == 0 {
                break;
            }
            buf.push(b[0]);
        }
        serde_json::from_slice(&buf).unwrap()
    };
    let info = ask(r#"{"method":"org.varlink.service.GetInfo"}"#);
    assert_eq!(info["parameters"]["interfaces"][1], "org.sandcell.Kernel");
    let desc = ask(
        r#"{"method":"org.varlink.service.GetInterfaceDescription","parameters":{"interface":"org.sandcell.Kernel"}}"#,
    );
    assert!(
        desc["parameters"]["description"]
            .as_str()
            .unwrap()
            .contains("method Run(")
    );
    let e = ask(r#"{"method":"org.sandcell.Kernel.Nope","parameters":{}}"#);
    assert_eq!(e["error"], "org.varlink.service.MethodNotFound");
    let e = ask(r#"{"method":"org.sandcell.Kernel.Open","parameters":{"language":"cobol"}}"#);
    assert_eq!(e["error"], "org.sandcell.Kernel.UnsupportedLanguage");
    let e = ask(r#"{"method":"org.sandcell.Kernel.Open","parameters":{"lang":"python"}}"#);
    assert_eq!(e["error"], "org.varlink.service.InvalidParameter");
    let e = ask(
        r#"{"method":"org.sandcell.Kernel.Run","parameters":{"language":"python","code":"print(1)"}}"#,
    );
    assert_eq!(e["error"], "org.varlink.service.ExpectedMore");
}

#[tokio::test]
async fn a_client_that_stops_reading_cannot_stall_its_session_or_the_daemon() {
    let mut d = Daemon::start(&[
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
        ("SANDCELL_MAX_FUEL", "1000000000000000"),
        // More kept output than the socket's buffers hold, so the daemon must wait on the client.
        ("SANDCELL_MAX_STDOUT_BYTES", "1900000"),
        ("SANDCELL_MAX_STDERR_BYTES", "100000"),
    ]);
    let mut a = d.client().await;
    let s = a.open("python", None, None).await.unwrap().session;
    // A chatty endless cell whose frames the client never reads.
    a.execute(&s, "while True:\n    print('x' * 100)\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Close from another connection of the same user is answered while the client is stuck.
    let mut b = d.client().await;
    tokio::time::timeout(Duration::from_secs(10), b.close(&s))
        .await
        .expect("Close hung behind a client that does not read")
        .unwrap();
    assert!(eventually(Duration::from_secs(5), || d
        .descendants()
        .is_empty()));
    // And the daemon stops promptly with such a client connected.
    let s2 = b.open("python", None, None).await.unwrap().session;
    b.execute(&s2, "while True:\n    print('y' * 100)\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        d.terminate(Duration::from_secs(15)).is_some(),
        "daemon did not stop:\n{}",
        d.log_text()
    );
    drop((a, b));
}

#[tokio::test]
async fn clients_leaving_while_their_worker_starts_leave_nothing_behind() {
    let d = Daemon::start(&[]);
    for i in 0..20u64 {
        let mut c = d.client().await;
        c.run("python", "print(1)", None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2 + i % 10 * 3)).await;
        drop(c); // gone before, during or after the worker's start
    }
    let sessions = d.dir.path().join("state/sessions");
    let left = || std::fs::read_dir(&sessions).map(|r| r.count()).unwrap_or(0);
    assert!(
        eventually(Duration::from_secs(15), || left() == 0
            && d.descendants().is_empty()),
        "left behind: {} session directories, workers {:?}",
        left(),
        d.descendants()
    );
}
