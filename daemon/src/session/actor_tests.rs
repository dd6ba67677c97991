//! The session actor driven by scripted fake workers (`crate::worker::fake`): deadlines,
//! interrupts, slow readers and backlogs, protocol violations and crashes, each checked by the
//! statuses, frames, counts and session ends a client sees. No Eryx, R, cgroup or root is
//! needed, and limits are tens or hundreds of milliseconds; nothing here asserts how long
//! anything took.

use super::cell::BACKLOG_BYTES;
use super::*;
use crate::admission::Admission;
use crate::identity::Subject;
use crate::worker::fake::{self, Script, Sigint, Step, flood_text};
use sandcell_proto::worker::MAX_OUTPUT_CHUNK;

/// Limits with a wall time and a grace of `wall_ms` and `grace_ms`, and room for 2 MiB of
/// output per stream.
fn limits(wall_ms: u64, grace_ms: u64) -> SessionLimits {
    SessionLimits {
        wall: Duration::from_millis(wall_ms),
        fuel: 1,
        guest_memory: 1,
        stdout: 2 << 20,
        stderr: 2 << 20,
        grace: Duration::from_millis(grace_ms),
        files_bytes: 1 << 30,
        host_calls: None,
        display: true,
        rich: false,
    }
}

/// A session over a fake worker, with what its end reported.
struct Open {
    session: Arc<Session>,
    ended: Arc<Mutex<Option<Ending>>>,
    admission: Admission,
    dir: PathBuf,
}

/// What a client saw of one cell.
#[derive(Debug)]
struct Seen {
    /// Output frames in arrival order: (seq, stream, text).
    outputs: Vec<(u64, Stream, String)>,
    result: CellResult,
}

impl Seen {
    fn text(&self, stream: Stream) -> String {
        self.outputs
            .iter()
            .filter(|o| o.1 == stream)
            .map(|o| o.2.as_str())
            .collect()
    }

    fn error_message(&self) -> String {
        self.result
            .error
            .as_ref()
            .map(|e| format!("{}: {}", e.kind, e.message))
            .unwrap_or_default()
    }
}

/// Bounds every wait of a test: a broken actor fails the test instead of hanging it. Not a
/// timing assertion: a healthy run is far inside it.
const PATIENCE: Duration = Duration::from_secs(30);

async fn open(script: Script, limits: SessionLimits) -> Open {
    let (prepared, admission) = fake::start(&script).await;
    let dir = prepared.session_dir.clone();
    let ended: Arc<Mutex<Option<Ending>>> = Arc::default();
    let on_end = {
        let ended = ended.clone();
        Box::new(move |_: &str, why: &Ending| *ended.lock().unwrap() = Some(why.clone()))
    };
    let owner = Caller {
        uid: 0,
        gid: 0,
        pid: std::process::id(),
        connection: 1,
        subject: Subject::Daemon,
    };
    let (events, _) = tokio::sync::broadcast::channel(64);
    let session = Session::start(prepared, owner, None, limits, on_end, events);
    Open {
        session,
        ended,
        admission,
        dir,
    }
}

impl Open {
    /// Starts the next cell; frames go to a channel of `capacity` the caller reads (or not).
    async fn submit(&self, capacity: usize) -> mpsc::Receiver<Frame> {
        let (tx, rx) = mpsc::channel(capacity);
        self.session
            .execute("cell".into(), tx, false, None)
            .await
            .expect("the session takes a cell");
        rx
    }

    /// Runs the next cell and reads every frame of it.
    async fn run(&self) -> Seen {
        let mut rx = self.submit(16).await;
        collect(&mut rx, true).await
    }

    /// Waits until the session has released everything; returns why it ended.
    async fn end(&self) -> Ending {
        tokio::time::timeout(PATIENCE, self.session.released())
            .await
            .expect("the session ends");
        let ending = self.ended.lock().unwrap().clone().expect("on_end ran");
        // Released in order: the permit is back, the directory gone, the worker reaped.
        assert_eq!(self.admission.snapshot().1.sessions, 0);
        assert!(!self.dir.exists(), "{} left behind", self.dir.display());
        assert!(!std::path::Path::new(&format!("/proc/{}", self.session.pid)).exists());
        assert_eq!(self.session.info.lock().unwrap().state, SessionState::Ended);
        ending
    }

    fn state(&self) -> SessionState {
        self.session.info.lock().unwrap().state
    }
}

/// Reads frames up to the result (`started` first when `from_start`).
async fn collect(rx: &mut mpsc::Receiver<Frame>, from_start: bool) -> Seen {
    let mut outputs = Vec::new();
    let mut first = from_start;
    loop {
        let f = tokio::time::timeout(PATIENCE, rx.recv())
            .await
            .expect("frames keep coming")
            .expect("the cell ends with a result");
        if first {
            assert!(f.started.is_some(), "first frame: {f:?}");
            first = false;
            continue;
        }
        if let Some(o) = f.output {
            outputs.push((o.seq, o.stream, o.text));
        } else if let Some(result) = f.result {
            let seqs: Vec<u64> = outputs.iter().map(|o| o.0).collect();
            let want: Vec<u64> = (0..outputs.len() as u64).collect();
            assert_eq!(seqs, want, "output frames numbered in order");
            return Seen { outputs, result };
        } else {
            panic!("unexpected frame {f:?}");
        }
    }
}

/// Waits (bounded) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < PATIENCE, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn output_and_results_reach_the_client_in_order() {
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "hello\n".into()),
            Step::Output(Stream::Stderr, "careful\n".into()),
            Step::Done(WorkerStatus::Ok),
        ]]),
        limits(10_000, 1_000),
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.result.cell, 1);
    assert_eq!(c.result.status, Status::Ok);
    assert_eq!(c.text(Stream::Stdout), "hello\n");
    assert_eq!(c.text(Stream::Stderr), "careful\n");
    assert_eq!((c.result.stdout.seen, c.result.stdout.kept), (6, 6));
    // A cell past the script reports ok: the session runs on with cell 2.
    let c = s.run().await;
    assert_eq!((c.result.cell, c.result.status), (2, Status::Ok));
    assert_eq!(s.state(), SessionState::Idle);
    s.session.close(EndReason::Closed, "test").await;
    assert_eq!(s.end().await.reason, EndReason::Closed);

    // A native worker's output written before its `done` leaves before the result.
    let s = open(
        Script::native(vec![vec![
            Step::Raw(Stream::Stdout, "from R\n".into()),
            Step::Raw(Stream::Stderr, "warning\n".into()),
            Step::Done(WorkerStatus::Ok),
        ]]),
        limits(10_000, 1_000),
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.result.status, Status::Ok);
    assert_eq!(c.text(Stream::Stdout), "from R\n");
    assert_eq!(c.text(Stream::Stderr), "warning\n");
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn output_past_the_cap_is_counted_not_sent() {
    let mut l = limits(10_000, 1_000);
    l.stdout = 1000;
    let s = open(
        Script::eryx(vec![vec![
            Step::Flood {
                stream: Stream::Stdout,
                bytes: 5000,
                chunk: 300,
                raw: false,
            },
            Step::Done(WorkerStatus::Ok),
        ]]),
        l.clone(),
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.text(Stream::Stdout), flood_text(5000, 300)[..1000]);
    let st = c.result.stdout;
    assert_eq!((st.seen, st.kept, st.truncated), (5000, 1000, true));
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;

    // The same through a native worker's raw pipe.
    let s = open(
        Script::native(vec![vec![
            Step::Flood {
                stream: Stream::Stdout,
                bytes: 5000,
                chunk: 300,
                raw: true,
            },
            Step::Done(WorkerStatus::Ok),
        ]]),
        l,
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.text(Stream::Stdout), flood_text(5000, 300)[..1000]);
    let st = c.result.stdout;
    assert_eq!((st.seen, st.kept, st.truncated), (5000, 1000, true));
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn a_timeout_the_worker_reports_keeps_the_session() {
    // The worker stops at the daemon's SIGINT (after the wall time) and says `timeout`.
    let s = open(
        Script::eryx(vec![vec![
            Step::UntilInterrupt,
            Step::Done(WorkerStatus::Timeout),
        ]]),
        limits(100, 5_000),
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.result.status, Status::Timeout);
    assert!(!c.result.session_ended);
    assert_eq!(c.result.state, State::Kept);
    assert!(c.error_message().starts_with("Timeout: "), "{c:?}");
    assert_eq!(s.run().await.result.status, Status::Ok);
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn a_cell_that_ran_past_its_wall_time_is_a_timeout_however_it_ends() {
    // Busy through the SIGINT (R's system()), then `ok`, before the kill: still a timeout,
    // and the session keeps its variables. The second cell ends past its wall time, before
    // the SIGINT is due (`WALL_SLACK` later) on an unhurried machine.
    let s = open(
        Script::eryx(vec![
            vec![Step::Sleep(400), Step::Done(WorkerStatus::Ok)],
            vec![Step::Sleep(130), Step::Done(WorkerStatus::Ok)],
        ]),
        limits(100, 10_000),
    )
    .await;
    for cell in [1, 2] {
        let c = s.run().await;
        assert_eq!(c.result.status, Status::Timeout, "cell {cell}");
        assert!(!c.result.session_ended);
        assert!(c.error_message().starts_with("Timeout: "), "{c:?}");
    }
    assert_eq!(s.run().await.result.status, Status::Ok);
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn a_cell_that_ignores_its_deadline_is_killed_and_its_session_ends() {
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "working\n".into()),
            Step::Sleep(60_000),
        ]])
        .sigint(Sigint::Ignore),
        limits(100, 200),
    )
    .await;
    let c = s.run().await;
    assert_eq!(c.result.status, Status::Timeout);
    assert!(c.result.session_ended);
    assert_eq!(c.result.state, State::Lost);
    assert!(c.error_message().starts_with("SessionLost: "), "{c:?}");
    // The output before the kill still reached the client.
    assert_eq!(c.text(Stream::Stdout), "working\n");
    let ending = s.end().await;
    assert_eq!(ending.reason, EndReason::Killed);
    assert_eq!(
        s.session
            .execute("x".into(), mpsc::channel(1).0, false, None)
            .await,
        Err(ExecuteRefused::Ended)
    );
}

#[tokio::test]
async fn an_interrupt_reaches_only_the_running_cell_and_keeps_the_session() {
    let s = open(
        Script::eryx(vec![
            vec![
                Step::Output(Stream::Stdout, "ready\n".into()),
                Step::UntilInterrupt,
                Step::Done(WorkerStatus::Interrupted),
            ],
            // Finishes the statements after the interrupt and says ok (R in system()).
            vec![
                Step::Output(Stream::Stdout, "ready\n".into()),
                Step::UntilInterrupt,
                Step::Done(WorkerStatus::Ok),
            ],
        ]),
        limits(30_000, 5_000),
    )
    .await;
    let reason = |r: InterruptReason| String::from(r);
    let idle = s.session.interrupt(1).await;
    assert_eq!(
        (idle.delivered, idle.reason),
        (false, reason(InterruptReason::NotRunning))
    );
    for cell in [1, 2] {
        let mut rx = s.submit(16).await;
        // The cell runs once its first output is here.
        let f = rx.recv().await.unwrap();
        assert_eq!(f.started.unwrap().cell, cell);
        let f = rx.recv().await.unwrap();
        assert_eq!(f.output.unwrap().text, "ready\n");
        let other = s.session.interrupt(cell + 1).await;
        assert_eq!(
            (other.delivered, other.reason),
            (false, reason(InterruptReason::OtherCell))
        );
        let r = s.session.interrupt(cell).await;
        assert_eq!(
            (r.delivered, r.reason),
            (true, reason(InterruptReason::Delivered))
        );
        let c = collect(&mut rx, false).await;
        assert_eq!(c.result.status, Status::Interrupted, "cell {cell}");
        assert!(!c.result.session_ended);
        assert_eq!(c.result.state, State::Kept);
    }
    assert_eq!(s.run().await.result.status, Status::Ok);
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn a_cell_that_ignores_its_interrupt_is_killed_after_the_grace() {
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "ready\n".into()),
            Step::Sleep(60_000),
        ]])
        .sigint(Sigint::Ignore),
        limits(60_000, 200),
    )
    .await;
    let mut rx = s.submit(16).await;
    rx.recv().await.unwrap();
    assert_eq!(rx.recv().await.unwrap().output.unwrap().text, "ready\n");
    assert!(s.session.interrupt(1).await.delivered);
    let again = s.session.interrupt(1).await;
    assert!(!again.delivered);
    let c = collect(&mut rx, false).await;
    assert_eq!(c.result.status, Status::Interrupted);
    assert!(c.result.session_ended);
    assert_eq!(c.result.state, State::Lost);
    assert_eq!(s.end().await.reason, EndReason::Killed);
}

#[tokio::test]
async fn a_slow_reader_stalls_no_interrupt_and_loses_no_output() {
    // More output than the backlog, the client's channel and the pipe hold together: the
    // worker blocks on its pipe while the client reads nothing.
    let total = 1 << 20;
    let s = open(
        Script::eryx(vec![vec![
            Step::Flood {
                stream: Stream::Stdout,
                bytes: total,
                chunk: MAX_OUTPUT_CHUNK,
                raw: false,
            },
            Step::UntilInterrupt,
            Step::Done(WorkerStatus::Interrupted),
        ]]),
        limits(30_000, 10_000),
    )
    .await;
    let mut rx = s.submit(1).await;
    assert!(rx.recv().await.unwrap().started.is_some());
    // Stalled: the channel holds a frame nobody takes.
    until("the client's channel is full", || rx.len() == 1).await;
    let r = tokio::time::timeout(PATIENCE, s.session.interrupt(1))
        .await
        .expect("the actor answers while its client does not read");
    assert!(r.delivered);
    let c = collect(&mut rx, false).await;
    assert_eq!(c.result.status, Status::Interrupted);
    assert!(!c.result.session_ended);
    assert!(c.text(Stream::Stdout) == flood_text(total, MAX_OUTPUT_CHUNK));
    let st = c.result.stdout;
    assert_eq!((st.seen, st.kept), (total as u64, total as u64));
    assert!(c.outputs.iter().all(|o| o.2.len() <= MAX_OUTPUT_CHUNK));
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[tokio::test]
async fn a_client_that_never_reads_bounds_the_backlog_and_stalls_no_deadline() {
    // The worker would write 8 MiB and say ok at once if the daemon read it all; with the
    // backlog bounded it blocks on its pipe until the deadline kills it.
    let total = 8 << 20;
    let s = open(
        Script::eryx(vec![vec![
            Step::Flood {
                stream: Stream::Stdout,
                bytes: total,
                chunk: MAX_OUTPUT_CHUNK,
                raw: false,
            },
            Step::Touch("flood-written".into()),
            Step::Done(WorkerStatus::Ok),
        ]])
        .sigint(Sigint::Ignore),
        limits(200, 200),
    )
    .await;
    let mut rx = s.submit(1).await;
    let pid = s.session.pid;
    let written = s.dir.join("flood-written");
    // Nothing is read until the worker is gone (or, were the backlog unbounded, has written
    // its whole flood).
    until("the worker is killed and reaped", || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists() || written.exists()
    })
    .await;
    assert!(
        !written.exists(),
        "the worker wrote 8 MiB while its client read nothing"
    );
    let c = collect(&mut rx, true).await;
    assert_eq!(c.result.status, Status::Timeout);
    assert!(c.result.session_ended);
    let st = c.result.stdout;
    // What was read: the backlog, a frame in the channel, a line in flight; never the flood.
    assert!(
        st.seen <= (BACKLOG_BYTES + 4 * MAX_OUTPUT_CHUNK) as u64,
        "{st:?}"
    );
    assert_eq!(st.kept, st.seen);
    assert_eq!(
        c.text(Stream::Stdout),
        flood_text(total, MAX_OUTPUT_CHUNK)[..st.kept as usize]
    );
    assert_eq!(s.end().await.reason, EndReason::Killed);
}

#[tokio::test]
async fn a_client_gone_mid_cell_interrupts_it_and_the_session_stays() {
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "ready\n".into()),
            Step::UntilInterrupt,
            Step::Output(Stream::Stdout, "nobody reads this\n".into()),
            Step::Done(WorkerStatus::Interrupted),
        ]]),
        limits(30_000, 10_000),
    )
    .await;
    let mut rx = s.submit(16).await;
    rx.recv().await.unwrap();
    assert!(rx.recv().await.unwrap().output.is_some());
    drop(rx);
    until("the session is idle again", || {
        s.state() == SessionState::Idle
    })
    .await;
    let c = s.run().await;
    assert_eq!((c.result.cell, c.result.status), (2, Status::Ok));
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

/// A session whose worker runs `script` for its first cell: the cell's result and, when the
/// result says the session ended, how it ended (else the session is closed).
async fn violation(script: Script) -> (Seen, Option<Ending>) {
    let s = open(script, limits(10_000, 1_000)).await;
    let c = s.run().await;
    if !c.result.session_ended {
        s.session.close(EndReason::Closed, "test").await;
        return (c, None);
    }
    let ending = s.end().await;
    (c, Some(ending))
}

#[tokio::test]
async fn protocol_violations_end_the_worker_and_only_its_session() {
    use sandcell_proto::worker::MAX_WORKER_LINE;
    // A session beside them, mid-cell, that must not notice.
    let bystander = open(
        Script::eryx(vec![vec![
            Step::UntilInterrupt,
            Step::Done(WorkerStatus::Interrupted),
        ]]),
        limits(30_000, 10_000),
    )
    .await;
    let mut by_rx = bystander.submit(16).await;
    let line = |s: &str| Script::eryx(vec![vec![Step::Line(s.into()), Step::Sleep(60_000)]]);
    let cases: Vec<(&str, Script, &str)> = vec![
        (
            "done with another nonce",
            line(r#"{"t":"done","cell":{cell},"nonce":"0123456789abcdef","status":"ok"}"#),
            "done without the request's nonce",
        ),
        (
            "done without a nonce",
            line(r#"{"t":"done","cell":{cell},"status":"ok"}"#),
            "done without the request's nonce",
        ),
        (
            "done of another cell",
            line(r#"{"t":"done","cell":9,"nonce":"{nonce}","status":"ok"}"#),
            "done for cell 9 while cell 1 runs",
        ),
        (
            "output of another cell",
            line(r#"{"t":"output","cell":7,"stream":"stdout","data":"x","bytes":1}"#),
            "output for cell 7 while cell 1 runs",
        ),
        ("not JSON", line("hello"), "protocol violation: "),
        (
            "ready mid-cell",
            line(r#"{"t":"ready","language":"python","engine":"x"}"#),
            "unexpected ready",
        ),
        (
            "host call without the opt-in",
            line(
                r#"{"t":"host_call","cell":{cell},"nonce":"{nonce}","call":1,"name":"f","arguments":{}}"#,
            ),
            "host_call in a session without host_calls",
        ),
        (
            "a line too long",
            Script::eryx(vec![vec![Step::Unterminated(MAX_WORKER_LINE + 1)]]),
            "exceeds",
        ),
        (
            "an output frame from a native worker",
            Script::native(vec![vec![
                Step::Output(Stream::Stdout, "x".into()),
                Step::Sleep(60_000),
            ]]),
            "a native worker sent output",
        ),
    ];
    // Concurrently: a worker that breaks the protocol and does not exit is waited for
    // (`WORKER_EXIT_WAIT`) before it is killed, once per case.
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(what, script, why)| {
            tokio::spawn(async move {
                let (c, ending) = violation(script).await;
                (what, why, c, ending)
            })
        })
        .collect();
    for run in runs {
        let (what, why, c, ending) = run.await.unwrap();
        assert_eq!(c.result.status, Status::WorkerCrashed, "{what}");
        assert!(c.error_message().contains(why), "{what}: {c:?}");
        let ending = ending.unwrap();
        assert_eq!(ending.reason, EndReason::WorkerCrashed, "{what}");
        assert!(ending.detail.contains(why), "{what}: {ending:?}");
    }
    // Bytes after the `done` (one write with it): the next request finds them.
    let s = open(
        Script::eryx(vec![vec![
            Step::Done(WorkerStatus::Ok),
            Step::Line("{}".into()),
        ]]),
        limits(10_000, 1_000),
    )
    .await;
    assert_eq!(s.run().await.result.status, Status::Ok);
    let c = s.run().await;
    assert_eq!(c.result.status, Status::WorkerCrashed);
    assert!(
        c.error_message()
            .contains("3 bytes on the reply pipe between cells"),
        "{c:?}"
    );
    assert_eq!(s.end().await.reason, EndReason::WorkerCrashed);

    assert_eq!(bystander.state(), SessionState::Running);
    assert!(bystander.session.interrupt(1).await.delivered);
    let c = collect(&mut by_rx, true).await;
    assert_eq!(c.result.status, Status::Interrupted);
    assert_eq!(bystander.run().await.result.status, Status::Ok);
    bystander.session.close(EndReason::Closed, "test").await;
    bystander.end().await;
}

#[tokio::test]
async fn a_worker_that_dies_is_reported_with_its_exit() {
    // Mid-cell, with an exit status.
    let (c, ending) = violation(Script::eryx(vec![vec![
        Step::Output(Stream::Stdout, "last words\n".into()),
        Step::Exit(3),
    ]]))
    .await;
    assert_eq!(c.result.status, Status::WorkerCrashed);
    assert_eq!(c.text(Stream::Stdout), "last words\n");
    assert!(c.error_message().contains("exited with status 3"), "{c:?}");
    assert_eq!(ending.unwrap().reason, EndReason::WorkerCrashed);

    // Killed by the interrupt it did not handle.
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "ready\n".into()),
            Step::UntilInterrupt,
        ]])
        .sigint(Sigint::Default),
        limits(30_000, 10_000),
    )
    .await;
    let mut rx = s.submit(16).await;
    rx.recv().await.unwrap();
    rx.recv().await.unwrap();
    assert!(s.session.interrupt(1).await.delivered);
    let c = collect(&mut rx, false).await;
    assert_eq!(c.result.status, Status::WorkerCrashed);
    assert!(
        c.error_message().contains("killed by signal 2 (SIGINT)"),
        "{c:?}"
    );
    s.end().await;

    // Between cells.
    let s = open(
        Script::eryx(vec![vec![Step::Done(WorkerStatus::Ok), Step::Exit(0)]]),
        limits(10_000, 1_000),
    )
    .await;
    assert_eq!(s.run().await.result.status, Status::Ok);
    let ending = s.end().await;
    assert_eq!(ending.reason, EndReason::WorkerCrashed);
    assert!(ending.detail.ends_with("while idle"), "{ending:?}");
}

#[tokio::test]
async fn after_the_hand_over_no_cell_starts_and_the_exit_path_is_answered() {
    let s = open(
        Script::eryx(vec![vec![Step::Done(WorkerStatus::Ok)]]),
        limits(10_000, 1_000),
    )
    .await;
    assert_eq!(s.run().await.result.status, Status::Ok);
    // The daemon exits keeping the (idle) session; a cell queued after that must not reach
    // the worker, nor be answered: the exit cuts its caller's call.
    s.session.hand_over().await;
    assert!(s.session.handed_over());
    let mut rx = s.submit(16).await;
    let got = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await;
    assert!(
        got.is_err(),
        "a cell after the hand-over got a frame: {got:?}"
    );
    assert_eq!(s.state(), SessionState::Running);
    // What the exit path and other callers still get: the hand-over's acknowledgement (this
    // one reaches the actor, since the session shows Running) and "not running".
    tokio::time::timeout(PATIENCE, s.session.hand_over())
        .await
        .expect("the held actor acknowledges a hand-over");
    let r = tokio::time::timeout(PATIENCE, s.session.interrupt(2))
        .await
        .expect("the held actor answers an interrupt");
    assert!(!r.delivered);
    assert_eq!(r.reason, InterruptReason::NotRunning.as_str());
    // Still nothing for the held cell.
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_repeated_token_names_its_cell_and_starts_nothing() {
    let s = open(
        Script::eryx(vec![vec![
            Step::Output(Stream::Stdout, "once\n".into()),
            Step::UntilInterrupt,
            Step::Done(WorkerStatus::Interrupted),
        ]]),
        limits(30_000, 10_000),
    )
    .await;
    let retained = |token: &str| {
        let (tx, rx) = mpsc::channel(16);
        let session = s.session.clone();
        let token = token.to_owned();
        async move {
            session
                .execute_retained("cell".into(), tx, Some(token))
                .await
                .map(|()| rx)
        }
    };
    let mut rx = retained("t-1").await.expect("the first call starts cell 1");
    assert!(rx.recv().await.unwrap().started.is_some());
    // While cell 1 runs: its token names it (not SessionBusy), another token is busy.
    assert_eq!(
        retained("t-1").await.err(),
        Some(ExecuteRefused::Repeated(1))
    );
    assert_eq!(retained("t-2").await.err(), Some(ExecuteRefused::Busy(1)));
    s.session.interrupt(1).await;
    let c = collect(&mut rx, false).await;
    assert_eq!(c.text(Stream::Stdout), "once\n");
    until("the session is idle again", || {
        s.state() == SessionState::Idle
    })
    .await;
    // After its end too: the repeat starts nothing, cell 2 is still to come.
    assert_eq!(
        retained("t-1").await.err(),
        Some(ExecuteRefused::Repeated(1))
    );
    assert_eq!(s.session.info.lock().unwrap().cells_started, 1);
    let mut rx = retained("t-2").await.expect("a new token starts cell 2");
    let c = collect(&mut rx, true).await;
    assert_eq!(c.result.cell, 2);
    // A session remembers its newest CELL_TOKENS_KEPT tokens.
    for n in 3..=(2 + sandcell_proto::kernel::CELL_TOKENS_KEPT as u64) {
        let mut rx = retained(&format!("t-{n}")).await.expect("a new token");
        assert_eq!(collect(&mut rx, true).await.result.cell, n);
    }
    let tokens = s.session.info.lock().unwrap().tokens.clone();
    assert_eq!(tokens.len(), sandcell_proto::kernel::CELL_TOKENS_KEPT);
    assert_eq!(tokens[0], (3, "t-3".to_owned()), "{tokens:?}");
    let mut rx = retained("t-1").await.expect("a forgotten token runs again");
    assert_eq!(collect(&mut rx, true).await.result.cell, 11);
    s.session.close(EndReason::Closed, "test").await;
    s.end().await;
}

#[test]
fn tokens_kept_from_a_record_are_well_formed_and_bounded() {
    let recorded: Vec<(u64, String)> = (1..=12)
        .map(|n| (n, format!("t{n}")))
        .chain([
            (13, "bad token".into()),
            (14, "t1".into()),
            (15, "x".into()),
        ])
        .collect();
    let kept = super::keep::recorded_tokens_for_test(&recorded, Some(15));
    // t1 moved to cell 14 (the newest cell answers), "bad token" and cell 15 (never ran)
    // are dropped; then the newest 8.
    let want: Vec<(u64, String)> = [(6, "t6"), (7, "t7"), (8, "t8"), (9, "t9")]
        .into_iter()
        .chain([(10, "t10"), (11, "t11"), (12, "t12"), (14, "t1")])
        .map(|(c, t)| (c, t.to_owned()))
        .collect();
    assert_eq!(kept, want);
}
