//! Cells that outlive their client, through a real sandcelld: `Submit` returns at once,
//! `CellStatus` answers without waiting, `Attach` replays the retained output then streams
//! live frames and the result, one attachment per cell; output retained while nobody is
//! attached keeps head and tail with exact counts; a client hanging up during an `Execute` on
//! a detached session costs nothing (or interrupts, with `interrupt_on_hangup`); the
//! retention budgets hold against many Submits; another uid learns nothing; Python and R.

use crate::common;

use common::{Daemon, call_as, r_available};
use sandcell_client::{Client, Error, KernelError, Status};
use sandcell_proto::kernel as k;
use std::time::{Duration, Instant};

async fn status(c: &mut Client, session: &str, cell: u64) -> k::CellStatusReply {
    c.cell_status(session, cell).await.unwrap()
}

/// Polls `CellStatus` until the cell ended (at most 30 s); returns its result.
async fn wait_ended(c: &mut Client, session: &str, cell: u64) -> k::CellResult {
    let t0 = Instant::now();
    loop {
        let s = status(c, session, cell).await;
        if s.state != "running" {
            return s
                .result
                .unwrap_or_else(|| panic!("state {} without result", s.state));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "cell {cell} still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn no_such_cell(e: &Error) -> bool {
    matches!(e, Error::Kernel(KernelError::NoSuchCell { .. }))
}

#[tokio::test]
async fn submit_returns_at_once_and_cell_status_follows_the_cell() {
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let s = a.open("python", None, None).await.unwrap().session;
    let cell = a
        .submit(&s, "import time\ntime.sleep(1.5)\nprint('done')")
        .await
        .unwrap();
    assert_eq!(cell, 1);
    // Submit returned while the cell sleeps: the same connection asks at once.
    let st = status(&mut a, &s, cell).await;
    assert_eq!(st.state, "running", "{st:?}");
    assert!(st.result.is_none());
    // One cell at a time, as for Execute.
    let e = a.submit(&s, "print(2)").await.unwrap_err();
    assert!(
        matches!(&e, Error::Kernel(KernelError::SessionBusy { cell: 1, .. })),
        "{e:?}"
    );
    let r = wait_ended(&mut a, &s, cell).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let kept = r
        .retained
        .expect("a submitted cell's result has retention counts");
    assert_eq!(
        (kept.stdout.seen, kept.stdout.kept, kept.stdout.dropped),
        (5, 5, 0)
    );
    assert_eq!(status(&mut a, &s, cell).await.state, "ok");
    // Unknown cells.
    for n in [0, 2, 99] {
        let e = a.cell_status(&s, n).await.unwrap_err();
        assert!(no_such_cell(&e), "cell {n}: {e:?}");
    }
    // Variables persist as for Execute.
    let c2 = a.submit(&s, "x = 41").await.unwrap();
    wait_ended(&mut a, &s, c2).await;
    let out = a.execute_collect(&s, "print(x + 1)").await.unwrap();
    assert_eq!(out.stdout, "42\n");
    // Another uid can neither ask nor attach (and does not learn the session exists).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(
            &d.socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        for method in ["CellStatus", "Attach", "Submit"] {
            let mut p = serde_json::json!({"session": s, "cell": cell});
            if method == "Submit" {
                p = serde_json::json!({"session": s, "code": "print(1)"});
            }
            let reply = call_as(65534, &d.socket, method, p);
            assert_eq!(
                reply["error"], "org.sandcell.Kernel.NoSuchSession",
                "{method}: {reply}"
            );
        }
    }
}

#[tokio::test]
async fn attach_replays_then_streams_live_and_after_the_end_replays() {
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    let cell = a
        .submit(
            &s,
            "import sys, time\nprint('before')\nprint('err', file=sys.stderr)\nsys.stdout.flush()\ntime.sleep(1.5)\nprint('after')",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(status(&mut a, &s, cell).await.state, "running");
    let mut b = d.client().await;
    b.attach(&s, cell).await.unwrap();
    let first = b.next_frame().await.unwrap();
    let started = first.started.expect("the first frame is started");
    assert_eq!((started.session.as_str(), started.cell), (s.as_str(), cell));
    // The replay comes before the cell ends: "before" while the cell still sleeps.
    let mut seen = Vec::new();
    loop {
        let f = b.next_frame().await.unwrap();
        if let Some(o) = f.output {
            assert_eq!(o.cell, cell);
            seen.push((o.stream, o.text.clone()));
            if o.text.contains("before") {
                assert_eq!(
                    status(&mut a, &s, cell).await.state,
                    "running",
                    "the replay arrived while the cell runs"
                );
            }
        }
        if let Some(r) = f.result {
            assert_eq!(r.status, Status::Ok);
            let kept = r.retained.unwrap();
            assert_eq!((kept.stdout.seen, kept.stderr.seen), (13, 4));
            break;
        }
    }
    let stdout: String = seen
        .iter()
        .filter(|(s, _)| *s == k::Stream::Stdout)
        .map(|(_, t)| t.as_str())
        .collect();
    assert_eq!(stdout, "before\nafter\n");
    assert!(
        seen.iter()
            .any(|(s, t)| *s == k::Stream::Stderr && t == "err\n")
    );
    // After the end: the retained output and the result, at once, on a fresh connection.
    let mut c = d.client().await;
    c.attach(&s, cell).await.unwrap();
    let got = c.finish(|_| {}).await.unwrap();
    assert_eq!(got.stdout, "before\nafter\n");
    assert_eq!(got.stderr, "err\n");
    assert_eq!(got.result.status, Status::Ok);
    // Unknown cell.
    c.attach(&s, 7).await.unwrap();
    let e = c.next_frame().await.unwrap_err();
    assert!(no_such_cell(&e), "{e:?}");
}

#[tokio::test]
async fn a_second_attach_replaces_the_first() {
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    let cell = a
        .submit(&s, "import time\nprint('x')\ntime.sleep(2)\nprint('y')")
        .await
        .unwrap();
    let mut first = d.client().await;
    first.attach(&s, cell).await.unwrap();
    assert!(first.next_frame().await.unwrap().started.is_some());
    let mut second = d.client().await;
    second.attach(&s, cell).await.unwrap();
    let e = loop {
        match first.next_frame().await {
            Ok(f) => assert!(f.result.is_none(), "the replaced attachment got the result"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(&e, Error::Kernel(KernelError::AttachmentReplaced { cell: c, .. }) if *c == cell),
        "{e:?}"
    );
    let got = second.finish(|_| {}).await.unwrap();
    assert_eq!(got.stdout, "x\ny\n");
    assert_eq!(got.result.status, Status::Ok);
}

/// The `Execute` that started a cell on a detached session is an attachment like any other:
/// an `Attach` from another connection takes the cell over, and the `Execute` ends with
/// `AttachmentReplaced` (never the result), having had the output sent before the take-over.
#[tokio::test]
async fn an_attach_replaces_the_execute_that_started_the_cell() {
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    a.execute(
        &s,
        "import time\nprint('x', flush=True)\ntime.sleep(2)\nprint('y')",
    )
    .await
    .unwrap();
    let cell = a.next_frame().await.unwrap().started.unwrap().cell;
    let mut second = d.client().await;
    second.attach(&s, cell).await.unwrap();
    let e = loop {
        match a.next_frame().await {
            Ok(f) => assert!(f.result.is_none(), "the replaced Execute got the result"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(&e, Error::Kernel(KernelError::AttachmentReplaced { cell: c, .. }) if *c == cell),
        "{e:?}"
    );
    let got = second.finish(|_| {}).await.unwrap();
    assert_eq!(got.stdout, "x\ny\n");
    assert_eq!(got.result.status, Status::Ok);
}

#[tokio::test]
async fn a_flood_while_detached_keeps_head_and_tail_with_exact_counts() {
    let d = Daemon::start(&[("SANDCELL_MAX_STDOUT_BYTES", "1048576")]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    // 20,000 lines of 50 bytes: 1,000,000 bytes, all within the stream's cap.
    let cell = a
        .submit(
            &s,
            "for i in range(20000):\n    print(f'{i:07d}' + 'x' * 42)",
        )
        .await
        .unwrap();
    let r = wait_ended(&mut a, &s, cell).await;
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.stdout.seen, 1_000_000);
    let kept = r.retained.unwrap().stdout;
    let window = k::RETAIN_HEAD_BYTES + k::RETAIN_TAIL_BYTES;
    assert_eq!(kept.seen, 1_000_000);
    assert_eq!(kept.kept, window);
    assert_eq!(kept.dropped, 1_000_000 - window);
    let mut b = d.client().await;
    b.attach(&s, cell).await.unwrap();
    let got = b.finish(|_| {}).await.unwrap();
    assert_eq!(got.stdout.len() as u64, window);
    let line = |i: u32| format!("{i:07}{}\n", "x".repeat(42));
    assert!(got.stdout.starts_with(&(line(0) + &line(1))));
    assert!(got.stdout.ends_with(&(line(19_998) + &line(19_999))));
    assert_eq!(got.result.retained.unwrap().stdout, kept);
}

/// Hang up during an Execute on a detached session, then ask from a new connection.
async fn hang_up_mid_execute(d: &Daemon) -> (String, k::CellResult) {
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    a.execute(
        &s,
        "import time\nprint('start', flush=True)\ntime.sleep(1.5)\nprint('end')",
    )
    .await
    .unwrap();
    let started = a.next_frame().await.unwrap().started.unwrap();
    let out = a.next_frame().await.unwrap().output.unwrap();
    assert_eq!(out.text, "start\n");
    drop(a);
    let mut b = d.client().await;
    let r = wait_ended(&mut b, &s, started.cell).await;
    b.attach(&s, started.cell).await.unwrap();
    let got = b.finish(|_| {}).await.unwrap();
    assert_eq!(got.result.status, r.status);
    (got.stdout, r)
}

#[tokio::test]
async fn a_client_hanging_up_mid_execute_on_a_detached_session_costs_nothing() {
    let d = Daemon::start(&[]);
    let (stdout, r) = hang_up_mid_execute(&d).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert_eq!(stdout, "start\nend\n");
    let kept = r.retained.unwrap();
    assert_eq!((kept.stdout.seen, kept.stdout.dropped), (10, 0));
    assert!(d.log_text().contains("it runs on, its output retained"));
}

#[tokio::test]
async fn interrupt_on_hangup_interrupts_and_the_status_is_kept() {
    let d = Daemon::start(&[("SANDCELL_INTERRUPT_ON_HANGUP", "true")]);
    let (stdout, r) = hang_up_mid_execute(&d).await;
    assert_eq!(r.status, Status::Interrupted, "{r:?}");
    assert_eq!(stdout, "start\n");
    assert!(!r.session_ended);
}

#[tokio::test]
async fn retention_budgets_hold_against_many_submits() {
    let d = Daemon::start(&[("SANDCELL_MAX_STDOUT_BYTES", "1048576")]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    let rss0 = d.rss();
    let cells = 20u64;
    for i in 1..=cells {
        // 600,000 bytes each: head and tail full, the middle dropped.
        let cell = a.submit(&s, "print('y' * 599999)").await.unwrap();
        assert_eq!(cell, i);
        assert_eq!(wait_ended(&mut a, &s, cell).await.status, Status::Ok);
    }
    let mut kept_total = 0;
    let mut listed = 0;
    for cell in 1..=cells {
        match a.cell_status(&s, cell).await {
            Ok(st) => {
                listed += 1;
                let kept = st.result.unwrap().retained.unwrap();
                assert_eq!(kept.stdout.seen, 600_000);
                assert_eq!(kept.stdout.seen, kept.stdout.kept + kept.stdout.dropped);
                kept_total += kept.stdout.kept + kept.stderr.kept;
            }
            Err(e) => {
                assert!(no_such_cell(&e), "{e:?}");
                assert!(
                    cell <= cells - k::RESULTS_KEPT as u64,
                    "cell {cell} dropped"
                );
            }
        }
    }
    assert_eq!(listed, k::RESULTS_KEPT as u64);
    assert!(
        kept_total <= k::SESSION_RETAINED_BYTES,
        "{kept_total} bytes retained"
    );
    // The newest cell keeps its whole window.
    let newest = status(&mut a, &s, cells).await.result.unwrap();
    assert_eq!(
        newest.retained.unwrap().stdout.kept,
        k::RETAIN_HEAD_BYTES + k::RETAIN_TAIL_BYTES
    );
    let grown = d.rss().saturating_sub(rss0);
    eprintln!(
        "figure: {cells} submits of 600,000 bytes: {listed} records, {kept_total} bytes retained, daemon RSS +{} KiB",
        grown / 1024
    );
}

/// A Submit racing the session's Close answers with a cell or a typed "gone" error, never
/// WorkerFailed, never a hang.
#[tokio::test]
async fn a_submit_racing_close_gets_a_typed_answer() {
    let d = Daemon::start(&[]);
    let mut outcomes = [0u32; 2];
    for _ in 0..6 {
        let mut a = d.client().await;
        let mut b = d.client().await;
        let s = a.open("python", None, Some(60)).await.unwrap().session;
        let s2 = s.clone();
        let close = tokio::spawn(async move { b.close(&s2).await });
        let r = tokio::time::timeout(Duration::from_secs(20), a.submit(&s, "print(1)"))
            .await
            .expect("Submit hung while the session closed");
        match r {
            Ok(_) => outcomes[0] += 1,
            Err(Error::Kernel(e)) if e.is_no_such_session() => outcomes[1] += 1,
            Err(e) => panic!("Submit racing Close: {e:?}"),
        }
        close.await.unwrap().unwrap();
    }
    eprintln!(
        "figure: Submit racing Close: {} accepted, {} gone",
        outcomes[0], outcomes[1]
    );
}

#[tokio::test]
async fn r_cells_submit_and_attach() {
    if !r_available() {
        sandcell_testing::skip!("r", "R is not installed");
    }
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", "python,r")]);
    let mut a = d.client().await;
    let s = a.open("r", None, Some(60)).await.unwrap().session;
    let cell = a
        .submit(&s, "cat('hi\\n'); Sys.sleep(1); cat('bye\\n'); x <- 7")
        .await
        .unwrap();
    assert_eq!(status(&mut a, &s, cell).await.state, "running");
    let mut b = d.client().await;
    b.attach(&s, cell).await.unwrap();
    let got = b.finish(|_| {}).await.unwrap();
    assert_eq!(got.stdout, "hi\nbye\n");
    assert_eq!(got.result.status, Status::Ok);
    let r = wait_ended(&mut a, &s, cell).await;
    assert_eq!(r.retained.unwrap().stdout.seen, 7);
    let out = a.execute_collect(&s, "cat(x + 1, '\\n')").await.unwrap();
    assert_eq!(out.stdout, "8 \n");
}

/// `sandcellctl submit` prints the cell number at once, `cell-status` the state and the
/// retention counts, `attach` the retained output and the exit status of `exec`.
#[tokio::test]
async fn sandcellctl_submits_attaches_and_asks() {
    let ctl = common::bin_dir().join("sandcellctl");
    if !ctl.exists() {
        sandcell_testing::skip!("built", "{} not built", ctl.display());
    }
    let d = Daemon::start(&[]);
    let mut a = d.client().await;
    let s = a.open("python", None, Some(60)).await.unwrap().session;
    let work = tempfile::tempdir().unwrap();
    let code = work.path().join("cell.py");
    std::fs::write(
        &code,
        "import time\nprint('one')\ntime.sleep(1)\nprint('two')\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&ctl)
            .arg("--socket")
            .arg(&d.socket)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (code_, out, err) = run(&["submit", &s, code.to_str().unwrap()]);
    assert_eq!((code_, out.as_str()), (Some(0), "1\n"), "{err}");
    let (code_, out, err) = run(&["cell-status", &s, "1"]);
    assert_eq!((code_, out.as_str()), (Some(0), "running\n"), "{err}");
    let (code_, out, err) = run(&["attach", &s, "1"]);
    assert_eq!((code_, out.as_str()), (Some(0), "one\ntwo\n"), "{err}");
    let (code_, out, err) = run(&["cell-status", &s, "1"]);
    assert_eq!(code_, Some(0), "{err}");
    assert_eq!(
        out,
        "ok\nstdout: 8 bytes seen, 8 retained, 0 dropped\nstderr: 0 bytes seen, 0 retained, 0 dropped\n"
    );
    let (code_, _, err) = run(&["cell-status", &s, "5"]);
    assert_ne!(code_, Some(0));
    assert!(err.contains("NoSuchCell"), "{err}");
}

/// A detached rich session's cell: its display frames are retained with its output (in
/// stdout's retention, bytes exact) and `Attach` replays them in `seq` order with the output
/// frames; a bundle bigger than the retention's tail comes back as its text/plain with a note.
#[tokio::test]
async fn attach_replays_display_frames_in_order() {
    // Room in the cell's stdout budget for the big bundle: only the retention replaces it.
    let d = Daemon::start(&[("SANDCELL_MAX_STDOUT_BYTES", "1048576")]);
    let mut a = d.client().await;
    let s = a
        .open_with(&sandcell_client::OpenParams {
            language: "python".into(),
            limits: None,
            detached_idle_seconds: Some(60),
            environment: None,
            host_calls: None,
            display_last_expression: None,
            rich_output: Some(true),
            egress: None,
        })
        .await
        .unwrap()
        .session;
    let cell = a
        .submit(
            &s,
            "from sandcell import display\nprint('one')\n\
             display({'text/plain': 'small', 'text/html': '<b>s</b>'}, raw=True)\n\
             print('two')\n\
             display({'text/plain': 'big', 'image/png': 'A' * (100 * 1024)}, raw=True)\n\
             print('three')\n6 * 7",
        )
        .await
        .unwrap();
    let r = wait_ended(&mut a, &s, cell).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let live = r.displays.expect("displays counted");
    let kept = r.retained.expect("retained");
    let shown = kept.displays.expect("displays retained");
    assert_eq!(shown.seen, live.kept, "every bundle sent is counted");
    assert_eq!(shown.seen, shown.kept + shown.dropped);
    assert_eq!(kept.stdout.seen, "one\ntwo\nthree\n".len() as u64);

    let mut b = d.client().await;
    b.attach(&s, cell).await.unwrap();
    let mut order = Vec::new();
    let mut bytes = 0u64;
    let mut seqs = Vec::new();
    loop {
        let f = b.next_frame().await.unwrap();
        if let Some(o) = &f.output {
            order.push(o.text.clone());
            seqs.push(o.seq);
        }
        if let Some(dsp) = &f.display {
            bytes += serde_json::to_vec(&dsp.data).unwrap().len() as u64;
            let text = dsp.data["text/plain"].as_str().unwrap().to_owned();
            match text.as_str() {
                "small" => assert_eq!(dsp.data["text/html"], "<b>s</b>"),
                "big" => {
                    assert_eq!(dsp.data.len(), 1, "text/plain only");
                    assert!(
                        dsp.note.as_deref().unwrap_or("").contains("retention"),
                        "{dsp:?}"
                    );
                }
                "42" => assert_eq!(dsp.kind, k::DisplayKind::Result),
                other => panic!("unexpected bundle {other:?}"),
            }
            order.push(format!("[{text}]"));
            seqs.push(dsp.seq);
        }
        if let Some(r) = f.result {
            assert_eq!(r.retained.unwrap().displays.unwrap(), shown);
            break;
        }
    }
    assert_eq!(
        order.concat(),
        "one\n[small]two\n[big]three\n[42]",
        "{order:?}"
    );
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(
        bytes, shown.kept,
        "the replay carries exactly the kept bytes"
    );
    assert!(shown.dropped > 100 * 1024, "{shown:?}");
}
