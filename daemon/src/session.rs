//! One session: a worker process, its cgroup, its directory, its admission charge, and the
//! task ("actor") that owns them all and runs cells one at a time.
//!
//! Every path out of a session — `Close`, client disconnect, worker crash, OOM, timeout kill,
//! daemon stop — goes through [`Actor::shutdown`], which kills the cgroup, reaps the worker,
//! removes the cgroup and the directory, and only then releases the uid and the admission
//! permit (DESIGN invariant: release after the worker is dead and reaped).

use crate::admission::Permit;
use crate::cgroup::SessionGroup;
use crate::identity::{Caller, UidLease};
use crate::worker::output::StreamCap;
use crate::worker::start::Prepared;
use crate::worker::{Fill, LineReader};
use sandcell_proto::kernel::{
    CellResult, Display, DisplayKind, EndReason, Frame, InspectReply, InterruptReason,
    InterruptReply, Language, Output, Started, State, Status, StreamStats, Usage,
};
use sandcell_proto::worker::{
    self as wire, MAX_WORKER_LINE, RequestHeader, Stream, WorkerMessage, WorkerStatus,
};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

/// Limits in force for one session, after the client's lowering.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionLimits {
    /// Wall time of one cell.
    pub wall: Duration,
    /// Fuel of one Python cell.
    pub fuel: u64,
    /// Guest memory, bytes.
    pub guest_memory: u64,
    /// stdout bytes kept per cell.
    pub stdout: u64,
    /// stderr bytes kept per cell.
    pub stderr: u64,
    /// Grace after the wall time before SIGINT, and after SIGINT before SIGKILL.
    pub grace: Duration,
    /// Bytes of regular files the session directory may hold (`max_session_files_bytes`).
    pub files_bytes: u64,
    /// The session's cells may call the client's tools (`Open`/`Run` with `host_calls`): how
    /// long a call waits for `HostReply` (`host_call_timeout_seconds`). `None`: a cell's host
    /// call raises at once, and a `host_call` line from its worker is a protocol violation.
    pub host_calls: Option<Duration>,
    /// Not a limit but the client's choice for every cell (`display_last_expression`):
    /// whether the worker shows the last expression's value; sent as `display=0` when false.
    pub display: bool,
    /// Not a limit either (`rich_output`): the worker sends the last expression's value,
    /// display calls and figures as MIME bundles (`display` frames); sent as `rich=1`.
    pub rich: bool,
}

/// What the cells of a session show (`display_last_expression`, `rich_output`); a plain
/// `bool` converts to it as the display choice without rich output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    /// Show the last expression's value (`display_last_expression`, default true).
    pub display: bool,
    /// Send MIME bundles (`rich_output`, default false).
    pub rich: bool,
}

impl From<bool> for Shown {
    fn from(display: bool) -> Self {
        Shown {
            display,
            rich: false,
        }
    }
}

/// What a session is doing, as listings show it (`idle`, `running`, `ended`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// No cell runs; the next `Execute` may start.
    Idle,
    /// A cell runs (or was admitted and is about to).
    Running,
    /// The session ended or is ending; it takes no more cells.
    Ended,
}

impl SessionState {
    /// The listed name: `idle`, `running`, `ended`.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Idle => "idle",
            SessionState::Running => "running",
            SessionState::Ended => "ended",
        }
    }
}

impl std::fmt::Display for SessionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Public, cheap-to-read state of a session (for listing and routing).
#[derive(Debug, Clone)]
pub struct Info {
    /// Cell running now.
    pub running_cell: Option<u64>,
    /// Cells finished.
    pub cells_run: u64,
    /// The number of the newest cell started (0: none yet); cells are numbered from 1.
    pub cells_started: u64,
    /// What it is doing (a worker still starting is not a session yet: listings show it as
    /// `starting` from `Core::starting_sessions`).
    pub state: SessionState,
    /// Last time a cell ended or the session opened.
    pub last_activity: Instant,
}

/// What the daemon's core sees of a session.
#[derive(Debug)]
pub struct Session {
    /// Session id.
    pub id: String,
    /// Interpreter.
    pub language: Language,
    /// Who opened it.
    pub owner: Caller,
    /// Survives its connection for this long idle, if set.
    pub detached_idle: Option<Duration>,
    /// A session that was not detached, adopted from a previous daemon (its connection went
    /// with that daemon): it ends after this long idle (`max_detached_idle_seconds`).
    pub adopted_idle: Option<Duration>,
    /// Opened at.
    pub started: SystemTime,
    /// Engine string from the worker's `Ready`.
    pub engine: String,
    /// Worker pid.
    pub pid: u32,
    /// Limits in force.
    pub limits: SessionLimits,
    /// Mutable state.
    pub info: Mutex<Info>,
    /// The session directory (files in and out: `files.rs`).
    pub dir: PathBuf,
    /// The worker's uid and gid (files the daemon stores there are theirs); `None` when the
    /// worker keeps the daemon's identity (development).
    pub worker_ids: Option<(u32, u32)>,
    /// Bumped after every change the daemon makes to the session directory (`PutFile`,
    /// `DeleteFile`), so the actor knows when its last listing is out of date.
    files_generation: std::sync::atomic::AtomicU64,
    /// Records of the cells started by `Submit` (or by `Execute` on a detached session):
    /// retained output and results for `Attach` and `CellStatus` (`cells.rs`).
    pub cells: crate::cells::CellLog,
    cmds: mpsc::Sender<Command>,
    group: Arc<dyn SessionGroup>,
}

/// Called once when a session has released everything: (session id, why it ended).
pub type OnEnd = Box<dyn FnOnce(&str, &Ending) + Send>;

/// Why a session ended: the code its owner is told (`SessionEnded`) and the text that is
/// logged and sent with the D-Bus `SessionClosed` signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    /// The code.
    pub reason: EndReason,
    /// For the log and the D-Bus signal, e.g. "the worker was killed by signal 9 while idle".
    pub detail: String,
}

impl Ending {
    /// `reason` with the text `detail`.
    pub fn new(reason: EndReason, detail: impl Into<String>) -> Ending {
        Ending {
            reason,
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// Requests to a session's actor.
#[derive(Debug)]
pub enum Command {
    /// Run a cell; frames go to `frames` (`started`, outputs, `result`).
    Execute {
        /// Source.
        code: String,
        /// Where frames go; dropping the receiver cancels the cell.
        frames: mpsc::Sender<Frame>,
        /// One-shot Run: report `state: none` and end the session after the cell.
        one_shot: bool,
    },
    /// Interrupt `cell` if it is running.
    Interrupt {
        /// Cell number.
        cell: u64,
        /// Answer.
        reply: oneshot::Sender<InterruptReply>,
    },
    /// Answer host call `call` of the running cell with `payload` (`{"result": {...}}` or
    /// `{"error": "..."}`, bounded by the caller); `reply` says whether that call was waiting.
    HostReply {
        /// Call id.
        call: u64,
        /// The JSON payload for the worker.
        payload: Vec<u8>,
        /// Answer: false when no such call waits (`NoSuchHostCall`).
        reply: oneshot::Sender<bool>,
    },
    /// List the user's variables (the session is idle); see [`Actor::inspect`].
    Inspect {
        /// At most this many (already validated: 1 to `INSPECT_MAX_ITEMS`).
        max_items: u64,
        /// Answer.
        reply: oneshot::Sender<Result<InspectReply, InspectRefused>>,
    },
    /// A completion or help of the idle session; see [`query`].
    Query {
        /// What is asked (already validated).
        query: query::Query,
        /// Answer.
        reply: query::QueryReply,
    },
    /// End the session; `done` fires after everything is released.
    Close {
        /// Why.
        reason: Ending,
        /// Fires when released.
        done: oneshot::Sender<()>,
    },
}

/// Something worth telling the control plane about.
#[derive(Debug, Clone)]
pub enum Event {
    /// A session is ready.
    Opened {
        /// Session id.
        id: String,
        /// Owner uid.
        uid: u32,
        /// Language.
        language: Language,
    },
    /// A cell finished.
    CellFinished {
        /// Session id.
        id: String,
        /// Cell number.
        cell: u64,
        /// Status on the wire.
        status: Status,
    },
    /// The kernel OOM-killed a worker.
    OomKilled {
        /// Session id.
        id: String,
    },
    /// The configuration was reloaded (SIGHUP or D-Bus `Reload`): budgets and pool sizes may
    /// have changed.
    Reloaded,
    /// A session ended and everything it held is released.
    Closed {
        /// Session id.
        id: String,
        /// Why, as text.
        reason: String,
        /// Why, as the code its owner is told.
        code: EndReason,
    },
}

impl Session {
    /// Creates the session record of the Ready worker `prepared`, owned by `owner`, and starts
    /// its actor. `detached_idle`: the session survives its connection for this long idle;
    /// `on_end` runs once everything is released; `events` gets the session's events.
    pub fn start(
        prepared: Prepared,
        owner: Caller,
        detached_idle: Option<Duration>,
        limits: SessionLimits,
        on_end: OnEnd,
        events: tokio::sync::broadcast::Sender<Event>,
    ) -> Arc<Session> {
        Self::start_kept(prepared, owner, detached_idle, limits, on_end, events, None)
    }

    /// [`Session::start`], and with `keep` the session gets a keeper and a record, so that a
    /// successor daemon can adopt it (`keep.rs`).
    pub fn start_kept(
        prepared: Prepared,
        owner: Caller,
        detached_idle: Option<Duration>,
        limits: SessionLimits,
        on_end: OnEnd,
        events: tokio::sync::broadcast::Sender<Event>,
        keep: Option<keep::Keep>,
    ) -> Arc<Session> {
        let Prepared {
            id,
            language,
            engine,
            spawned,
            group,
            session_dir,
            lease: uid,
            permit,
            environment,
            ..
        } = prepared;
        let pid = spawned.pid;
        let (interrupt, raw_output) = (spawned.interrupt, spawned.stdout.is_some());
        Self::launch(Launch {
            id,
            language,
            engine,
            environment,
            owner,
            detached_idle,
            adopted_idle: None,
            limits,
            on_end,
            events,
            child: crate::worker::process::WorkerProcess::Child(spawned.child),
            pid,
            pidfd: spawned.pidfd,
            requests: spawned.requests,
            replies: spawned.replies,
            stdout: spawned.stdout,
            stderr: spawned.stderr,
            group,
            session_dir,
            uid,
            permit,
            interrupt,
            raw_output,
            next_cell: 1,
            cells_run: 0,
            host_calls_made: 0,
            last_activity: Instant::now(),
            started: SystemTime::now(),
            keep,
            lifeline: None,
        })
    }

    /// Creates the session record and starts its actor.
    fn launch(l: Launch) -> Arc<Session> {
        let (tx, rx) = mpsc::channel(16);
        let session = Arc::new(Session {
            id: l.id.clone(),
            language: l.language,
            owner: l.owner,
            detached_idle: l.detached_idle,
            adopted_idle: l.adopted_idle,
            started: l.started,
            engine: l.engine,
            pid: l.pid,
            limits: l.limits.clone(),
            info: Mutex::new(Info {
                running_cell: None,
                cells_run: l.cells_run,
                cells_started: l.next_cell.saturating_sub(1),
                state: SessionState::Idle,
                last_activity: l.last_activity,
            }),
            dir: l.session_dir.clone(),
            worker_ids: l.uid.as_ref().map(|u| (u.uid(), u.uid())),
            files_generation: std::sync::atomic::AtomicU64::new(0),
            cells: Default::default(),
            cmds: tx,
            group: l.group.clone(),
        });
        let oom_seen = l.group.oom_kills();
        let actor = Actor {
            session: session.clone(),
            child: l.child,
            pid: l.pid,
            pidfd: l.pidfd,
            requests: l.requests,
            replies: l.replies,
            stdout: l.stdout,
            stderr: l.stderr,
            group: l.group,
            session_dir: l.session_dir,
            uid: l.uid,
            permit: Some(l.permit),
            next_cell: l.next_cell,
            ended: false,
            on_end: Some(l.on_end),
            events: l.events,
            known_files: None,
            oom_seen,
            deferred: None,
            interrupt: l.interrupt,
            raw_output: l.raw_output,
            leftovers: Vec::new(),
            host_calls_made: l.host_calls_made,
            disk_next: tokio::time::Instant::now() + DISK_IDLE_WATCH,
            disk_scan: None,
            kept: l
                .keep
                .map(|k| keep::Kept::new(k, l.environment, l.lifeline)),
        };
        tokio::spawn(actor.run(rx));
        session
    }

    /// Queues a cell. Fails with the running cell's number when one is running.
    pub async fn execute(
        &self,
        code: String,
        frames: mpsc::Sender<Frame>,
        one_shot: bool,
    ) -> Result<(), ExecuteRefused> {
        {
            let mut info = self.info.lock().unwrap();
            match info.state {
                SessionState::Running => {
                    return Err(ExecuteRefused::Busy(info.running_cell.unwrap_or(0)));
                }
                SessionState::Ended => return Err(ExecuteRefused::Ended),
                SessionState::Idle => info.state = SessionState::Running,
            }
        }
        self.cmds
            .send(Command::Execute {
                code,
                frames,
                one_shot,
            })
            .await
            .map_err(|_| ExecuteRefused::Ended)
    }

    /// Lists the user's variables: at most `max_items` (validated by the caller). Refused while
    /// a cell runs ([`InspectRefused::Busy`]); a worker that breaks the protocol or does not
    /// answer in time ends the session ([`InspectRefused::Failed`]).
    pub async fn inspect(&self, max_items: u64) -> Result<InspectReply, InspectRefused> {
        {
            let info = self.info.lock().unwrap();
            match info.state {
                SessionState::Running => {
                    return Err(InspectRefused::Busy(info.running_cell.unwrap_or(0)));
                }
                SessionState::Ended => return Err(InspectRefused::Ended),
                SessionState::Idle => {}
            }
        }
        let (tx, rx) = oneshot::channel();
        self.cmds
            .send(Command::Inspect {
                max_items,
                reply: tx,
            })
            .await
            .map_err(|_| InspectRefused::Ended)?;
        rx.await.unwrap_or(Err(InspectRefused::Ended))
    }

    /// Asks the actor to interrupt `cell`.
    pub async fn interrupt(&self, cell: u64) -> InterruptReply {
        let (tx, rx) = oneshot::channel();
        let gone = || InterruptReply {
            delivered: false,
            reason: InterruptReason::SessionEnding.into(),
        };
        if self
            .cmds
            .send(Command::Interrupt { cell, reply: tx })
            .await
            .is_err()
        {
            return gone();
        }
        rx.await.unwrap_or_else(|_| gone())
    }

    /// Hands the answer to host call `call` to the running cell; false when no such call waits
    /// (never made, answered, timed out, its cell ended, or the session ended).
    pub async fn host_reply(&self, call: u64, payload: Vec<u8>) -> bool {
        let (tx, rx) = oneshot::channel();
        if self
            .cmds
            .send(Command::HostReply {
                call,
                payload,
                reply: tx,
            })
            .await
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Waits until the session's actor has released everything (returns at once for a
    /// session that ended; never for one that lives on).
    pub async fn released(&self) {
        self.cmds.closed().await;
    }

    /// Ends the session and waits until everything is released.
    pub async fn close(&self, reason: EndReason, detail: &str) {
        let (tx, rx) = oneshot::channel();
        if self
            .cmds
            .send(Command::Close {
                reason: Ending::new(reason, detail),
                done: tx,
            })
            .await
            .is_ok()
        {
            let _ = rx.await;
        } else {
            // The actor is already ending; wait for it to finish releasing.
            self.cmds.closed().await;
        }
    }

    /// Records that the daemon changed the session directory (after `PutFile` or
    /// `DeleteFile`): the next cell lists it afresh before it starts.
    pub fn files_changed(&self) {
        self.files_generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// The `cgroup.procs` files of the session's group: what an upload's copier joins, so
    /// that the session file system's pages are charged to the session
    /// ([`crate::files::put_charged`]).
    pub fn group_procs(&self) -> Vec<PathBuf> {
        self.group.procs_files()
    }

    fn files_generation(&self) -> u64 {
        self.files_generation
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Memory charged to the session's cgroup now, bytes.
    pub fn memory_current(&self) -> Option<u64> {
        self.group.memory_current()
    }
}

impl crate::cells::Host for Session {
    fn id(&self) -> &str {
        &self.id
    }

    fn log(&self) -> &crate::cells::CellLog {
        &self.cells
    }

    async fn interrupt_cell(&self, cell: u64) {
        self.interrupt(cell).await;
    }
}

/// Why `Execute` was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecuteRefused {
    /// A cell is running.
    Busy(u64),
    /// The session has ended.
    Ended,
}

/// Why `Inspect` was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InspectRefused {
    /// A cell is running (its number; 0 for another `Inspect`).
    Busy(u64),
    /// The session has ended.
    Ended,
    /// The worker broke the protocol or did not answer in time; the session ended (why).
    Failed(String),
}

/// How the loop of one cell ended.
enum CellEnd {
    Done(WorkerMessage),
    /// The worker closed its reply pipe, died, or broke the protocol.
    WorkerGone(String),
    /// The daemon killed the worker after the grace period.
    Killed,
    /// The client went away or the session was closed.
    Cancelled(Option<(Ending, oneshot::Sender<()>)>),
    /// The session directory went over its disk budget while the cell ran (why).
    DiskFull(String),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Interrupted,
    TimedOut,
}

/// Reply lines handled per wake-up of a cell's loop at most; then the loop serves its control
/// events (deadline, Interrupt, Close, a client gone, daemon stop) before reading on.
const LINES_PER_WAKE: usize = 64;

/// Bytes read from the reply pipe per wake-up at most (a complete line of up to
/// [`MAX_WORKER_LINE`] bytes is still assembled over several wake-ups).
const REPLY_BYTES_PER_WAKE: usize = 256 * 1024;

/// Reply lines read after the worker exited, looking for its `done`, at most.
const EXIT_LINES: usize = 1024;

/// Reads of a raw output pipe per wake-up at most (of [`RAW_READ_BYTES`] each).
const RAW_READS_PER_WAKE: usize = 16;

/// Bytes asked for by one read of a raw output pipe.
const RAW_READ_BYTES: usize = 64 * 1024;

/// Bytes of output text a cell may have waiting for its client. Past it the daemon stops
/// reading that worker's pipes until the client has taken some (backpressure: the worker
/// blocks on a full pipe; its deadline still runs).
const BACKLOG_BYTES: usize = 256 * 1024;

/// One item waiting for the client: a chunk of output text, or a display bundle (its `seq`
/// is set when it is sent).
#[derive(Debug)]
enum Chunk {
    Text(Stream, String),
    Bundle(Box<Display>, usize),
}

impl Chunk {
    /// Bytes it holds (a bundle: its data's JSON text, as counted when it came).
    fn bytes(&self) -> usize {
        match self {
            Chunk::Text(_, t) => t.len(),
            Chunk::Bundle(_, n) => *n,
        }
    }

    /// Its frame, numbered `seq`.
    fn into_frame(self, cell: u64, seq: u64) -> Frame {
        match self {
            Chunk::Text(stream, text) => output_frame(cell, seq, stream, text),
            Chunk::Bundle(mut d, _) => {
                d.seq = seq;
                Frame {
                    display: Some(*d),
                    ..Default::default()
                }
            }
        }
    }

    /// The chunk a frame that could not be sent came from.
    fn from_frame(f: Frame) -> Chunk {
        match (f.output, f.display) {
            (_, Some(d)) => {
                let n = serde_json::to_vec(&d.data).map_or(0, |v| v.len());
                Chunk::Bundle(Box::new(d), n)
            }
            (Some(o), None) => Chunk::Text(o.stream, o.text),
            (None, None) => Chunk::Text(Stream::Stdout, String::new()),
        }
    }
}

/// Output of one cell waiting for its client: text chunks of at most
/// [`sandcell_proto::worker::MAX_OUTPUT_CHUNK`] bytes and display bundles, in order, with
/// their total bytes.
#[derive(Debug, Default)]
struct Backlog {
    chunks: std::collections::VecDeque<Chunk>,
    bytes: usize,
}

impl Backlog {
    /// Whether more output may be read for it.
    fn has_room(&self) -> bool {
        self.bytes < BACKLOG_BYTES
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Appends `text`, merging with the last chunk of the same stream and cutting on
    /// character boundaries so that no chunk exceeds the frame size.
    fn push(&mut self, stream: Stream, mut text: &str) {
        use sandcell_proto::worker::MAX_OUTPUT_CHUNK;
        while !text.is_empty() {
            let merge = match self.chunks.back() {
                Some(Chunk::Text(s, t)) if *s == stream && t.len() < MAX_OUTPUT_CHUNK => {
                    MAX_OUTPUT_CHUNK - t.len()
                }
                _ => 0,
            };
            let room = if merge > 0 { merge } else { MAX_OUTPUT_CHUNK };
            let mut end = room.min(text.len());
            while end < text.len() && !text.is_char_boundary(end) {
                end -= 1;
            }
            if end == 0 {
                // Not even one character fits the last chunk: start a new one (a whole frame
                // always has room for a character).
                self.chunks.push_back(Chunk::Text(stream, String::new()));
                continue;
            }
            let (head, rest) = text.split_at(end);
            match self.chunks.back_mut() {
                Some(Chunk::Text(s, t)) if merge > 0 && *s == stream => t.push_str(head),
                _ => self.chunks.push_back(Chunk::Text(stream, head.to_owned())),
            }
            self.bytes += head.len();
            text = rest;
        }
    }

    /// Appends a display bundle of `bytes` bytes.
    fn push_bundle(&mut self, d: Display, bytes: usize) {
        self.bytes += bytes;
        self.chunks.push_back(Chunk::Bundle(Box::new(d), bytes));
    }

    /// Puts a chunk back at the front (the channel was full).
    fn push_front(&mut self, c: Chunk) {
        self.bytes += c.bytes();
        self.chunks.push_front(c);
    }

    fn pop(&mut self) -> Option<Chunk> {
        let c = self.chunks.pop_front()?;
        self.bytes -= c.bytes();
        Some(c)
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.bytes = 0;
    }
}

/// The state of one running cell: everything its event handlers share.
struct CellRun {
    cell: u64,
    /// The request's nonce, which the worker's `done` must echo.
    nonce: String,
    /// Where frames go; dropping the receiver means the client is gone.
    frames: mpsc::Sender<Frame>,
    /// False for a one-shot Run: a client gone ends it instead of abandoning the cell.
    keep_session: bool,
    grace: Duration,
    caps: [StreamCap; 2],
    /// Display bundles: `None` without `rich_output`, else bytes seen and kept.
    displays: Option<(u64, u64)>,
    /// Sequence number of the next output frame.
    seq: u64,
    phase: Phase,
    /// The cell's wall time: past it the cell is interrupted ([`WALL_SLACK`] later) and its
    /// result is `timeout`, however it ends.
    wall: Duration,
    /// When the next escalation is due: the first SIGINT (wall time plus [`WALL_SLACK`]), or
    /// the kill (wall time plus grace, or grace after an `Interrupt`).
    deadline: tokio::time::Instant,
    /// Once interrupted, SIGINT is repeated until the cell ends: a worker may discard one
    /// that arrives before it has read the request (it cannot tell it from a stale one).
    repeat: tokio::time::Interval,
    /// Per raw stream: when to read it next (it was readable).
    hold: [Option<tokio::time::Instant>; 2],
    /// Per raw stream: whether its last read was big (read again without waiting).
    busy: [bool; 2],
    /// Output waiting for a slow client; the loop keeps serving deadlines, interrupts and
    /// closes meanwhile (a client that stops reading must not stall its session).
    backlog: Backlog,
    client_gone: bool,
    /// The client went away and the cell was interrupted for that (`keep_session`): its
    /// output has nobody to go to.
    abandoned: bool,
    buf: Vec<u8>,
    t0: Instant,
    cpu0: Option<f64>,
    oom0: u64,
    /// The disk watch: when the session directory is totalled next, and the walk in flight
    /// (on the blocking pool) with its start.
    disk_next: tokio::time::Instant,
    disk_scan: Option<(Instant, tokio::task::JoinHandle<u64>)>,
    /// The host call waiting for the client's `HostReply`: its id and when it times out.
    host: Option<(u64, tokio::time::Instant)>,
    /// A `host_call` frame waiting for room in the client's channel (after the output before it).
    host_frame: Option<Frame>,
    /// Bytes for the request pipe (answers to host calls), written as the pipe takes them.
    to_worker: Vec<u8>,
}

impl CellRun {
    fn new(
        cell: u64,
        nonce: String,
        frames: mpsc::Sender<Frame>,
        keep_session: bool,
        limits: &SessionLimits,
        pid: u32,
        oom0: u64,
    ) -> CellRun {
        let t0 = Instant::now();
        let mut repeat = tokio::time::interval(Duration::from_millis(250));
        repeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        CellRun {
            cell,
            nonce,
            frames,
            keep_session,
            grace: limits.grace,
            caps: [StreamCap::new(limits.stdout), StreamCap::new(limits.stderr)],
            displays: limits.rich.then_some((0, 0)),
            seq: 0,
            phase: Phase::Running,
            deadline: tokio::time::Instant::from_std(t0 + limits.wall + WALL_SLACK),
            wall: limits.wall,
            repeat,
            hold: [None, None],
            busy: [false; 2],
            backlog: Backlog::default(),
            client_gone: false,
            abandoned: false,
            buf: Vec::new(),
            t0,
            cpu0: proc_cpu_seconds(pid),
            oom0,
            disk_next: tokio::time::Instant::from_std(t0 + DISK_WATCH_MIN),
            disk_scan: None,
            host: None,
            host_frame: None,
            to_worker: Vec::new(),
        }
    }

    /// Whether the loop should wait for room in the client's channel.
    fn wants_room(&self) -> bool {
        (!self.backlog.is_empty() || self.host_frame.is_some())
            && !self.abandoned
            && !self.client_gone
    }

    /// A display bundle of the cell: checked, counted against the stdout budget and queued;
    /// one over [`sandcell_proto::kernel::MAX_DISPLAY_BYTES`] or the budget's room is
    /// replaced by its text/plain with a note, and dropped when even that does not fit.
    /// Errors: why the bundle breaks the protocol.
    fn on_display(
        &mut self,
        kind: DisplayKind,
        data: serde_json::Map<String, serde_json::Value>,
        note: Option<String>,
    ) -> Result<(), String> {
        use sandcell_proto::kernel::{MAX_DISPLAY_BYTES, check_display_data, display_fallback};
        let Some((seen, kept)) = self.displays.as_mut() else {
            return Err("display in a cell without rich_output".into());
        };
        let size = check_display_data(&data)?;
        if note.as_ref().is_some_and(|n| n.len() > 1024) {
            return Err("display note over 1024 bytes".into());
        }
        *seen = seen.saturating_add(size as u64);
        let (data, size, note) = if size > MAX_DISPLAY_BYTES {
            let f = display_fallback(&data);
            let n = serde_json::to_vec(&f).map_or(usize::MAX, |v| v.len());
            let why = format!(
                "bundle of {size} bytes over the {MAX_DISPLAY_BYTES}-byte cap: text/plain only"
            );
            (f, n, Some(why))
        } else {
            (data, size, note)
        };
        let (data, size, note) = if self.caps[0].reserve(size as u64) {
            (data, size, note)
        } else {
            let f = display_fallback(&data);
            let n = serde_json::to_vec(&f).map_or(usize::MAX, |v| v.len());
            if n >= size || !self.caps[0].reserve(n as u64) {
                return Ok(());
            }
            (
                f,
                n,
                Some(format!(
                    "bundle of {size} bytes over the cell's remaining output budget: text/plain only"
                )),
            )
        };
        *kept += size as u64;
        if !self.abandoned {
            self.backlog.push_bundle(
                Display {
                    cell: self.cell,
                    seq: 0,
                    kind,
                    data,
                    note,
                },
                size,
            );
        }
        Ok(())
    }

    /// Queues output for the client (nothing, once the cell is abandoned).
    fn queue(&mut self, stream: Stream, text: String) {
        if !self.abandoned {
            self.backlog.push(stream, &text);
        }
    }

    /// Hands over what the client's channel takes now; the rest waits for room.
    fn flush(&mut self) {
        while let Some(c) = self.backlog.pop() {
            match self.frames.try_send(c.into_frame(self.cell, self.seq)) {
                Ok(()) => self.seq += 1,
                Err(mpsc::error::TrySendError::Full(f)) => {
                    self.backlog.push_front(Chunk::from_frame(f));
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.client_gone = true;
                    return;
                }
            }
        }
        if self.backlog.is_empty()
            && let Some(f) = self.host_frame.take()
        {
            match self.frames.try_send(f) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(f)) => self.host_frame = Some(f),
                Err(mpsc::error::TrySendError::Closed(_)) => self.client_gone = true,
            }
        }
    }

    /// Reads what raw stream `i` holds now, at most `max_reads` reads, through its cap into
    /// the backlog; closes `rx` at end of file. Returns the bytes read. `direct` asks the
    /// kernel whatever readiness the runtime has cached (for the last read after `done`,
    /// which must see every byte written before it); the loop's reads go through the runtime,
    /// which clears the pipe's readiness when it is empty.
    fn read_raw(
        &mut self,
        rx: &mut Option<pipe::Receiver>,
        i: usize,
        stream: Stream,
        max_reads: usize,
        direct: bool,
    ) -> usize {
        if self.buf.len() < RAW_READ_BYTES {
            self.buf.resize(RAW_READ_BYTES, 0);
        }
        let mut total = 0;
        for _ in 0..max_reads {
            let Some(r) = rx.as_mut() else { break };
            let got = if direct {
                crate::worker::read_now(std::os::fd::AsRawFd::as_raw_fd(r), &mut self.buf)
            } else {
                r.try_read(&mut self.buf)
            };
            match got {
                Ok(0) => {
                    *rx = None;
                    break;
                }
                Ok(n) => {
                    total += n;
                    if let Some(t) = self.caps[i].push_bytes(&self.buf[..n]) {
                        self.queue(stream, t);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    *rx = None;
                    break;
                }
            }
        }
        total
    }
}

/// Room in the client's channel: the oldest waiting chunk goes now (the rest with the loop's
/// flush).
fn send_one(permit: mpsc::OwnedPermit<Frame>, run: &mut CellRun) {
    if let Some(c) = run.backlog.pop() {
        permit.send(c.into_frame(run.cell, run.seq));
        run.seq += 1;
    } else if let Some(f) = run.host_frame.take() {
        permit.send(f);
    }
}

/// Waits for room in the client's channel; the permit borrows nothing (the cell's state stays
/// free for the handler).
async fn reserve_owned(
    frames: &mpsc::Sender<Frame>,
) -> Result<mpsc::OwnedPermit<Frame>, mpsc::error::SendError<()>> {
    frames.clone().reserve_owned().await
}

/// A fresh request nonce: 64 bits from `getrandom(2)` as 16 lowercase hex digits.
///
/// Errors: the kernel's random source failed.
fn new_nonce() -> std::io::Result<String> {
    crate::sys::random_hex(wire::NONCE_HEX_LEN / 2)
}

/// Everything a session's actor starts from: a spawned worker ([`Session::start_kept`]) or an
/// adopted one (`keep.rs`).
struct Launch {
    id: String,
    language: Language,
    engine: String,
    environment: String,
    owner: Caller,
    detached_idle: Option<Duration>,
    adopted_idle: Option<Duration>,
    limits: SessionLimits,
    on_end: OnEnd,
    events: tokio::sync::broadcast::Sender<Event>,
    child: crate::worker::process::WorkerProcess,
    pid: u32,
    pidfd: Option<crate::worker::WorkerPidfd>,
    requests: pipe::Sender,
    replies: LineReader<pipe::Receiver>,
    stdout: Option<pipe::Receiver>,
    stderr: Option<pipe::Receiver>,
    group: Arc<dyn SessionGroup>,
    session_dir: PathBuf,
    uid: Option<UidLease>,
    permit: Permit,
    interrupt: crate::worker::InterruptTarget,
    raw_output: bool,
    next_cell: u64,
    cells_run: u64,
    host_calls_made: u64,
    last_activity: Instant,
    started: SystemTime,
    keep: Option<keep::Keep>,
    lifeline: Option<crate::keeper::Lifeline>,
}

struct Actor {
    session: Arc<Session>,
    child: crate::worker::process::WorkerProcess,
    /// The worker's pid (for `/proc` reads; never signalled once the child is reaped).
    pid: u32,
    /// The worker's pidfd, when the kernel gave one.
    pidfd: Option<crate::worker::WorkerPidfd>,
    requests: pipe::Sender,
    replies: LineReader<pipe::Receiver>,
    stdout: Option<pipe::Receiver>,
    stderr: Option<pipe::Receiver>,
    group: Arc<dyn SessionGroup>,
    session_dir: PathBuf,
    uid: Option<UidLease>,
    permit: Option<Permit>,
    next_cell: u64,
    ended: bool,
    on_end: Option<OnEnd>,
    events: tokio::sync::broadcast::Sender<Event>,
    /// The session directory as the last cell left it, with the files generation it was
    /// taken at: the next cell's "before" listing when nothing has changed since, so a cell
    /// does not wait for a directory walk before its request reaches the worker.
    known_files: Option<(u64, crate::files::Listing)>,
    /// OOM kills of the session's group already accounted for (read after each cell, off the
    /// reply path; compared when a worker dies).
    oom_seen: u64,
    /// An `Execute` admitted while the previous result waited for its reader (at most one:
    /// admission marks the session running); run before the next command.
    deferred: Option<Command>,
    /// Where an interrupt is aimed (the worker kind decides).
    interrupt: crate::worker::InterruptTarget,
    /// The worker's output travels on raw stdout/stderr pipes (native R and Python), so an
    /// `output`/`dropped` frame from it is a protocol violation.
    raw_output: bool,
    /// Processes the last cell left running, killed at its end: zombies until their parent
    /// (init, for an orphan) reaps them, and until then they count against `pids.max`. The
    /// next cell waits for them first ([`LEFTOVER_REAP_TIMEOUT`] at most).
    leftovers: Vec<crate::cgroup::Leftover>,
    /// Id of the session's last host call (0: none yet); the next must be one more.
    host_calls_made: u64,
    /// The disk watch between cells (see [`DISK_IDLE_WATCH`]): when the session directory is
    /// totalled next, and the walk in flight with its start. A cell takes the walk in flight
    /// over and hands back the one it leaves, so a session never walks twice at once.
    disk_next: tokio::time::Instant,
    disk_scan: Option<(Instant, tokio::task::JoinHandle<u64>)>,
    /// The session's keeper and record, when sessions are kept for adoption (`keep.rs`).
    kept: Option<keep::Kept>,
}

impl Actor {
    async fn run(mut self, mut cmds: mpsc::Receiver<Command>) {
        let reason: Ending;
        let mut close_done: Option<oneshot::Sender<()>> = None;
        self.start_keeper().await;
        loop {
            self.persist();
            if let Some(Command::Execute {
                code,
                frames,
                one_shot,
            }) = self.deferred.take()
            {
                if let Some(end) = self.execute_cell(code, frames, one_shot, &mut cmds).await {
                    reason = end.0;
                    close_done = end.1;
                    break;
                }
                self.disk_next = tokio::time::Instant::now() + DISK_IDLE_WATCH;
                continue;
            }
            let idle = self
                .session
                .detached_idle
                .or(self.session.adopted_idle)
                .map(|d| {
                    let last = self.session.info.lock().unwrap().last_activity;
                    tokio::time::Instant::from_std(last + d)
                });
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None => { reason = Ending::new(EndReason::Disconnected, "abandoned"); break; }
                    Some(Command::Execute { code, frames, one_shot }) => {
                        if let Some(end) = self.execute_cell(code, frames, one_shot, &mut cmds).await {
                            reason = end.0;
                            close_done = end.1;
                            break;
                        }
                        self.disk_next = tokio::time::Instant::now() + DISK_IDLE_WATCH;
                    }
                    Some(Command::Interrupt { reply, .. }) => {
                        let _ = reply.send(InterruptReply { delivered: false, reason: InterruptReason::NotRunning.into() });
                    }
                    Some(Command::HostReply { reply, .. }) => {
                        let _ = reply.send(false);
                    }
                    Some(Command::Inspect { max_items, reply }) => {
                        if let Some(end) = self.inspect(max_items, reply, &mut cmds).await {
                            reason = end.0;
                            close_done = end.1;
                            break;
                        }
                    }
                    Some(Command::Query { query, reply }) => {
                        if let Some(end) = self.query(query, reply, &mut cmds).await {
                            reason = end.0;
                            close_done = end.1;
                            break;
                        }
                    }
                    Some(Command::Close { reason: r, done }) => { reason = r; close_done = Some(done); break; }
                },
                status = self.child.wait() => {
                    reason = Ending::new(EndReason::WorkerCrashed, match status {
                        Ok(st) => format!("the worker {} while idle", describe_exit(st)),
                        Err(e) => format!("worker exited while idle ({e})"),
                    });
                    break;
                }
                _ = async { match idle { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                    reason = Ending::new(EndReason::IdleExpired, "idle timeout");
                    break;
                }
                _ = tokio::time::sleep_until(self.disk_next), if self.disk_scan.is_none() => {
                    let dir = self.session_dir.clone();
                    self.disk_scan = Some((Instant::now(), tokio::task::spawn_blocking(move || disk_usage(&dir))));
                }
                walked = disk_scan_done(&mut self.disk_scan), if self.disk_scan.is_some() => {
                    if let Some(end) = self.on_idle_disk_usage(walked) {
                        reason = end;
                        break;
                    }
                }
            }
        }
        self.shutdown(&reason).await;
        if let Some(done) = close_done {
            let _ = done.send(());
        }
        // Refuse whatever is still queued.
        cmds.close();
        while let Some(cmd) = cmds.recv().await {
            match cmd {
                Command::Interrupt { reply, .. } => {
                    let _ = reply.send(InterruptReply {
                        delivered: false,
                        reason: InterruptReason::SessionEnding.into(),
                    });
                }
                Command::Close { done, .. } => {
                    let _ = done.send(());
                }
                Command::Inspect { reply, .. } => {
                    let _ = reply.send(Err(InspectRefused::Ended));
                }
                Command::Query { reply, .. } => {
                    let _ = reply.send(Err(InspectRefused::Ended));
                }
                Command::HostReply { reply, .. } => {
                    let _ = reply.send(false);
                }
                Command::Execute { .. } => {}
            }
        }
    }

    fn signal_interrupt(&self) {
        // R: the whole process group; native Python: its main thread (tgkill); Eryx: the
        // process. See `InterruptTarget`.
        self.interrupt.send(self.child.id(), self.pidfd.as_ref());
    }

    /// Runs one cell. Returns `Some((reason, close_waiter))` when the session ended with it.
    ///
    /// The cell's life: `started` to the client; the stale-byte check of the worker's pipes;
    /// the request (with a fresh nonce); the event loop ([`Actor::cell_loop`]) until the
    /// worker's `done` or another end; then the result ([`Actor::finish_cell`]).
    async fn execute_cell(
        &mut self,
        code: String,
        frames: mpsc::Sender<Frame>,
        one_shot: bool,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let cell = self.next_cell;
        self.next_cell += 1;
        {
            let mut info = self.session.info.lock().unwrap();
            info.running_cell = Some(cell);
            info.cells_started = cell;
            info.state = SessionState::Running;
        }
        self.persist();
        let started = Frame {
            started: Some(Started {
                session: self.session.id.clone(),
                cell,
            }),
            ..Default::default()
        };
        let mut close_req: CloseRequest = None;
        let client_gone =
            !send_or_command(&frames, started, cmds, &mut close_req, &mut self.deferred).await;
        // A session outlives a client that goes away during its cell: the cell is interrupted
        // (killed after the grace if it ignores that) and its output dropped, and the variables
        // stay. The session itself ends only as its owner decides: a non-detached session when
        // its connection closes (Core::connection_closed sends a Close). A one-shot Run is killed
        // at once instead: nothing is left to keep.
        let keep_session = !one_shot;
        if client_gone && close_req.is_none() && keep_session {
            // Nobody to run it for, and it has not started: the session stays as it was.
            let mut info = self.session.info.lock().unwrap();
            info.running_cell = None;
            info.state = SessionState::Idle;
            info.last_activity = Instant::now();
            return None;
        }
        // The session directory before the cell, to report what it changed: the listing the
        // last cell ended with, unless the daemon changed the directory since.
        let generation = self.session.files_generation();
        let files_before = match self.known_files.take() {
            Some((g, listing)) if g == generation => Some(listing),
            _ => list_files(self.session_dir.clone()).await,
        };
        let limits = self.session.limits.clone();
        self.wait_leftovers_reaped().await;
        // `usage.peak_memory_bytes` is this cell's peak where the kernel can reset it.
        self.group.reset_memory_peak();
        let (nonce, nonce_error) = match new_nonce() {
            Ok(n) => (n, None),
            Err(e) => (String::new(), Some(e)),
        };
        let mut run = CellRun::new(
            cell,
            nonce,
            frames,
            keep_session,
            &limits,
            self.pid,
            self.oom_seen,
        );
        run.disk_scan = self.disk_scan.take();
        let end = if client_gone {
            CellEnd::Cancelled(close_req.take())
        } else if let Some(e) = nonce_error {
            CellEnd::WorkerGone(format!("no random nonce for the request: {e}"))
        } else if let Err(why) = self.drain_stale() {
            CellEnd::WorkerGone(why)
        } else {
            let mut header = RequestHeader::exec(cell, code.len() as u64);
            header.timeout_ms = Some(limits.wall.as_millis() as u64);
            header.fuel = Some(limits.fuel);
            header.max_output = Some(limits.stdout.max(limits.stderr));
            header.display = limits.display;
            header.rich = limits.rich;
            header.nonce = Some(run.nonce.clone());
            header.host_calls = limits.host_calls.is_some();
            let mut request = header.to_line().into_bytes();
            request.extend_from_slice(code.as_bytes());
            drop(code);
            match tokio::time::timeout(
                limits.wall + limits.grace,
                self.requests.write_all(&request),
            )
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
            {
                Err(e) => CellEnd::WorkerGone(format!("writing the request: {e}")),
                Ok(()) => {
                    drop(request);
                    self.cell_loop(&mut run, cmds).await
                }
            }
        };
        self.disk_scan = run.disk_scan.take();
        self.finish_cell(run, end, one_shot, close_req, files_before, cmds)
            .await
    }

    /// Answers an `Inspect` of the idle session: writes an `inspect` request (fresh nonce, the
    /// worker's budget [`wire::INSPECT_BUDGET_MS`]) and waits for the worker's `inspected`
    /// line, which it validates (count and every field's bounds) before it answers. Commands
    /// are served meanwhile (Close ends the wait; an Execute is deferred; Interrupt finds no
    /// cell). No answer after [`wire::INSPECT_DEADLINE_MS`]: SIGINT (repeated as for a cell);
    /// none after the kill grace too, or any other line, or the worker's exit: the session
    /// ends (returns `Some((reason, close waiter))`, as [`Actor::execute_cell`]).
    async fn inspect(
        &mut self,
        max_items: u64,
        reply: oneshot::Sender<Result<InspectReply, InspectRefused>>,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let fail = |reply: oneshot::Sender<Result<InspectReply, InspectRefused>>, why: String| {
            let _ = reply.send(Err(InspectRefused::Failed(why.clone())));
            Some((
                Ending::new(EndReason::WorkerCrashed, format!("Inspect: {why}")),
                None,
            ))
        };
        if let Err(why) = self.drain_stale() {
            return fail(reply, why);
        }
        let nonce = match new_nonce() {
            Ok(n) => n,
            Err(e) => return fail(reply, format!("no random nonce for the request: {e}")),
        };
        let mut header = RequestHeader::exec(0, 0);
        header.op = wire::Op::Inspect;
        header.timeout_ms = Some(wire::INSPECT_BUDGET_MS);
        header.max_items = Some(max_items);
        header.nonce = Some(nonce.clone());
        let deadline = Duration::from_millis(wire::INSPECT_DEADLINE_MS);
        let grace = self.session.limits.grace.max(KILL_AFTER_SIGINT_MIN);
        let t0 = tokio::time::Instant::now();
        match tokio::time::timeout(
            deadline + grace,
            self.requests.write_all(header.to_line().as_bytes()),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return fail(reply, format!("writing the request: {e}")),
            Err(_) => return fail(reply, "writing the request timed out".into()),
        }
        let mut interrupted = false;
        let mut next_signal = t0 + deadline;
        let kill_at = t0 + deadline + grace;
        loop {
            let step: Option<Result<InspectReply, String>> = tokio::select! {
                biased;
                cmd = cmds.recv() => match cmd {
                    Some(Command::Interrupt { reply, .. }) => {
                        let _ = reply.send(InterruptReply {
                            delivered: false,
                            reason: InterruptReason::NotRunning.into(),
                        });
                        None
                    }
                    Some(Command::Inspect { reply, .. }) => {
                        let _ = reply.send(Err(InspectRefused::Busy(0)));
                        None
                    }
                    Some(Command::Query { reply, .. }) => {
                        let _ = reply.send(Err(InspectRefused::Busy(0)));
                        None
                    }
                    Some(Command::HostReply { reply, .. }) => {
                        let _ = reply.send(false);
                        None
                    }
                    Some(cmd @ Command::Execute { .. }) => {
                        self.deferred = Some(cmd);
                        None
                    }
                    Some(Command::Close { reason, done }) => {
                        let _ = reply.send(Err(InspectRefused::Ended));
                        return Some((reason, Some(done)));
                    }
                    None => {
                        let _ = reply.send(Err(InspectRefused::Ended));
                        return Some((Ending::new(EndReason::Disconnected, "abandoned"), None));
                    }
                },
                _ = tokio::time::sleep_until(kill_at) => {
                    Some(Err(format!("the worker did not answer within {} ms", (deadline + grace).as_millis())))
                }
                _ = tokio::time::sleep_until(next_signal) => {
                    // R and native Python turn it into placeholders and answer; Eryx ends the
                    // guest call (the instance is rebuilt from its snapshot before the next cell).
                    self.signal_interrupt();
                    if !interrupted {
                        tracing::info!(session = %self.session.id, "Inspect: no answer in time, interrupting the worker");
                    }
                    interrupted = true;
                    next_signal = tokio::time::Instant::now() + INTERRUPT_REPEAT;
                    None
                }
                () = self.replies.readable() => self.inspect_replies(&nonce, max_items),
                status = self.child.wait() => Some(Err(match status {
                    Ok(st) => format!("the worker {} during Inspect", describe_exit(st)),
                    Err(e) => format!("the worker exited during Inspect ({e})"),
                })),
            };
            match step {
                None => {}
                Some(Ok(r)) => {
                    let _ = reply.send(Ok(r));
                    return None;
                }
                Some(Err(why)) => {
                    tracing::warn!(session = %self.session.id, why, "Inspect failed: the session ends");
                    return fail(reply, why);
                }
            }
        }
    }

    /// Reads the reply pipe during an `Inspect` (at most [`REPLY_BYTES_PER_WAKE`] bytes per
    /// call; the first complete line decides): the answer, validated, or why the worker
    /// broke the protocol; `None` while no complete line is there.
    fn inspect_replies(
        &mut self,
        nonce: &str,
        max_items: u64,
    ) -> Option<Result<InspectReply, String>> {
        let mut bytes = 0usize;
        loop {
            match self.replies.take_line() {
                Ok(Some(line)) => return Some(check_inspected(&line, nonce, max_items)),
                Ok(None) if bytes >= REPLY_BYTES_PER_WAKE => break,
                Ok(None) => match self.replies.try_fill() {
                    Ok(Fill::Read(n)) => bytes += n,
                    Ok(Fill::Empty) => break,
                    Ok(Fill::Eof) => return Some(Err("worker closed its reply pipe".into())),
                    Err(e) => return Some(Err(format!("protocol violation: {e}"))),
                },
                Err(e) => return Some(Err(format!("protocol violation: {e}"))),
            }
        }
        None
    }

    /// Waits (on the blocking pool, at most [`LEFTOVER_REAP_TIMEOUT`]) until the processes the
    /// previous cell left behind and the daemon killed are reaped, so that their zombies no
    /// longer hold the session's `pids.max` when this cell forks. Those the worker itself must
    /// reap (its own children) are not waited for; what is still there at the bound is logged.
    async fn wait_leftovers_reaped(&mut self) {
        if self.leftovers.is_empty() {
            return;
        }
        let killed = std::mem::take(&mut self.leftovers);
        let worker = self.pid;
        let t0 = Instant::now();
        let left = tokio::task::spawn_blocking(move || {
            crate::cgroup::wait_reaped(
                &crate::cgroup::Host::default().proc_root,
                &killed,
                worker,
                LEFTOVER_REAP_TIMEOUT,
            )
        })
        .await
        .unwrap_or(0);
        if left > 0 {
            tracing::warn!(session = %self.session.id, zombies = left, "processes killed after the last cell are not reaped yet");
        } else {
            tracing::debug!(session = %self.session.id, waited_ms = t0.elapsed().as_millis() as u64, "leftovers of the last cell reaped");
        }
    }

    /// Empties the worker's pipes before a request is written, without blocking. Bytes on the
    /// reply pipe are a protocol violation (a worker writes nothing between cells; a process
    /// a previous cell left behind may have); bytes on the raw output pipes are discarded
    /// (what a cell left running writes there between cells: a process before the end-of-cell
    /// sweep stopped it, or a thread of a native Python worker) and logged.
    ///
    /// Errors: the violation, or the pipe's end, as the reason the worker ends.
    fn drain_stale(&mut self) -> Result<(), String> {
        match self.replies.drain_stale(MAX_WORKER_LINE) {
            Ok((0, false)) => {}
            Ok((0, true)) => return Err("worker closed its reply pipe".into()),
            Ok((n, _)) => {
                return Err(format!(
                    "protocol violation: {n} bytes on the reply pipe between cells"
                ));
            }
            Err(e) => return Err(format!("protocol violation: {e}")),
        }
        let mut buf = [0u8; 16 * 1024];
        let mut stale = 0usize;
        for rx in [&mut self.stdout, &mut self.stderr] {
            for _ in 0..RAW_READS_PER_WAKE {
                let Some(r) = rx.as_mut() else { break };
                match crate::worker::read_now(std::os::fd::AsRawFd::as_raw_fd(r), &mut buf) {
                    Ok(0) => {
                        *rx = None;
                        break;
                    }
                    Ok(n) => stale += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        *rx = None;
                        break;
                    }
                }
            }
        }
        if stale > 0 {
            tracing::debug!(session = %self.session.id, stale, "output written between cells discarded");
        }
        Ok(())
    }

    /// The event loop of one running cell: waits for the next event and hands it to its
    /// handler, each of which does a bounded amount of work, until one of them ends the cell.
    /// Control events (commands, the deadline, the interrupt repeat, the client's channel)
    /// come first; the worker's pipes are read only while the cell's backlog has room.
    async fn cell_loop(
        &mut self,
        run: &mut CellRun,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> CellEnd {
        loop {
            let room = run.backlog.has_room();
            let hold_until = run.hold.iter().flatten().min().copied();
            let step: Option<CellEnd> = tokio::select! {
                biased;
                cmd = cmds.recv() => self.on_command(run, cmd),
                _ = tokio::time::sleep_until(run.deadline) => self.on_deadline(run),
                _ = run.repeat.tick(), if run.phase != Phase::Running => {
                    self.signal_interrupt();
                    None
                }
                _ = run.frames.closed(), if !run.abandoned => {
                    run.client_gone = true;
                    None
                }
                permit = reserve_owned(&run.frames), if run.wants_room() => {
                    match permit {
                        Ok(p) => send_one(p, run),
                        Err(_) => run.client_gone = true,
                    }
                    None
                }
                () = self.replies.readable(), if room => self.on_replies(run),
                ready = ready_opt(&self.stdout), if room && run.hold[0].is_none() => {
                    self.on_raw_ready(run, 0, ready);
                    None
                }
                ready = ready_opt(&self.stderr), if room && run.hold[1].is_none() => {
                    self.on_raw_ready(run, 1, ready);
                    None
                }
                _ = tokio::time::sleep_until(hold_until.unwrap_or(run.deadline)), if room && hold_until.is_some() => {
                    self.on_raw_due(run);
                    None
                }
                _ = tokio::time::sleep_until(run.host.map_or(run.deadline, |h| h.1)), if run.host.is_some() => {
                    self.on_host_timeout(run);
                    None
                }
                ready = self.requests.writable(), if !run.to_worker.is_empty() => {
                    self.on_request_writable(run, ready)
                }
                _ = tokio::time::sleep_until(run.disk_next), if run.disk_scan.is_none() => {
                    let dir = self.session_dir.clone();
                    run.disk_scan = Some((
                        Instant::now(),
                        tokio::task::spawn_blocking(move || disk_usage(&dir)),
                    ));
                    None
                }
                bytes = disk_scan_done(&mut run.disk_scan), if run.disk_scan.is_some() => {
                    self.on_disk_usage(run, bytes)
                }
                // Last: a worker that wrote its `done` and exited (R's quit()) is served by the
                // reply branch first.
                status = self.child.wait() => self.on_worker_exit(run, status),
            };
            if let Some(end) = step {
                return end;
            }
            // While the worker's next message may already be buffered, read it first: output
            // chunks merge, and a cell's last output leaves together with its result.
            if !run.client_gone && !self.replies.may_have_line() {
                run.flush();
            }
            if run.client_gone
                && !run.abandoned
                && let Some(end) = self.on_client_gone(run)
            {
                return end;
            }
        }
    }

    /// A command while the cell runs.
    fn on_command(&mut self, run: &mut CellRun, cmd: Option<Command>) -> Option<CellEnd> {
        match cmd {
            Some(Command::Interrupt { cell, reply }) => {
                let r = if cell != run.cell {
                    InterruptReply {
                        delivered: false,
                        reason: InterruptReason::OtherCell.into(),
                    }
                } else if run.phase != Phase::Running {
                    InterruptReply {
                        delivered: false,
                        reason: InterruptReason::AlreadyInterrupted.into(),
                    }
                } else {
                    self.signal_interrupt();
                    run.phase = Phase::Interrupted;
                    // A host call the cell waits for raises the interrupt: it is finished.
                    run.host = None;
                    // Documented escalation: a cell that ignores SIGINT (native code, BLAS) is
                    // killed after the grace, and the session ends.
                    run.deadline = tokio::time::Instant::now() + run.grace;
                    InterruptReply {
                        delivered: true,
                        reason: InterruptReason::Delivered.into(),
                    }
                };
                let _ = reply.send(r);
                None
            }
            Some(Command::Inspect { reply, .. }) => {
                let _ = reply.send(Err(InspectRefused::Busy(run.cell)));
                None
            }
            Some(Command::Query { reply, .. }) => {
                let _ = reply.send(Err(InspectRefused::Busy(run.cell)));
                None
            }
            Some(Command::HostReply {
                call,
                payload,
                reply,
            }) => {
                let _ = reply.send(self.on_host_reply(run, call, payload));
                None
            }
            Some(Command::Close { reason, done }) => Some(CellEnd::Cancelled(Some((reason, done)))),
            Some(Command::Execute { .. }) => None, // refused by Session::execute
            None => Some(CellEnd::Cancelled(None)),
        }
    }

    /// The deadline passed: [`WALL_SLACK`] after the wall time, interrupt (SIGINT, repeated)
    /// and kill at the wall time plus the grace; at the end of a grace, kill.
    ///
    /// The worker's own limit (R's `setTimeLimit`, Eryx's epoch deadline) is not relied on
    /// alone: R checks its limit only between R-level operations, so a cell in `Sys.sleep`,
    /// `system()` or native code ran on until the daemon's SIGINT.
    fn on_deadline(&mut self, run: &mut CellRun) -> Option<CellEnd> {
        if run.phase == Phase::Running {
            self.signal_interrupt();
            run.phase = Phase::TimedOut;
            run.host = None;
            let kill_at = tokio::time::Instant::from_std(run.t0 + run.wall + run.grace);
            run.deadline = kill_at.max(tokio::time::Instant::now() + KILL_AFTER_SIGINT_MIN);
            None
        } else {
            Some(CellEnd::Killed)
        }
    }

    /// A total of the session directory finished (`bytes`, with the walk's duration): over
    /// the budget ends the cell (and its session); otherwise the next walk is due after
    /// [`DISK_WATCH_FACTOR`] times this one's duration, within [`DISK_WATCH_MIN`] and
    /// [`DISK_WATCH_MAX`].
    fn on_disk_usage(
        &mut self,
        run: &mut CellRun,
        (bytes, took): (u64, Duration),
    ) -> Option<CellEnd> {
        if let Some(why) = over_disk_budget(bytes, self.session.limits.files_bytes) {
            return Some(CellEnd::DiskFull(why));
        }
        let wait = (took * DISK_WATCH_FACTOR).clamp(DISK_WATCH_MIN, DISK_WATCH_MAX);
        run.disk_next = tokio::time::Instant::now() + wait;
        None
    }

    /// A total of the session directory taken between cells finished: over the budget (bytes
    /// or entries), the session ends as an over-budget cell ends it (`disk_quota`; the
    /// shutdown kills and reaps the worker, with any thread of it still writing, and removes
    /// the directory); otherwise the next walk is due [`DISK_IDLE_WATCH`] later, or
    /// [`DISK_WATCH_FACTOR`] times this walk's duration when that is longer.
    fn on_idle_disk_usage(&mut self, (bytes, took): (u64, Duration)) -> Option<Ending> {
        if let Some(why) = over_disk_budget(bytes, self.session.limits.files_bytes) {
            tracing::warn!(session = %self.session.id, reason = %why, "disk budget exceeded between cells");
            return Some(Ending::new(
                EndReason::DiskQuota,
                format!("{why} (between cells)"),
            ));
        }
        self.disk_next =
            tokio::time::Instant::now() + (took * DISK_WATCH_FACTOR).max(DISK_IDLE_WATCH);
        None
    }

    /// The client went away mid-cell: a one-shot Run ends; a session's cell is interrupted and
    /// its output dropped from now on, and the session stays.
    fn on_client_gone(&mut self, run: &mut CellRun) -> Option<CellEnd> {
        if !run.keep_session {
            return Some(CellEnd::Cancelled(None));
        }
        run.abandoned = true;
        run.backlog.clear();
        run.host_frame = None;
        if run.phase == Phase::Running {
            self.signal_interrupt();
            run.phase = Phase::Interrupted;
            run.deadline = tokio::time::Instant::now() + run.grace;
        }
        tracing::info!(session = %self.session.id, cell = run.cell, "client gone during the cell: interrupting it, the session stays");
        None
    }

    /// The reply pipe is readable: handles at most [`LINES_PER_WAKE`] lines and reads at most
    /// [`REPLY_BYTES_PER_WAKE`] bytes, stopping early when the backlog fills; what is left
    /// waits for the next turn of the loop, after the control events.
    fn on_replies(&mut self, run: &mut CellRun) -> Option<CellEnd> {
        let (mut lines, mut bytes) = (0usize, 0usize);
        while lines < LINES_PER_WAKE && run.backlog.has_room() {
            match self.replies.take_line() {
                Ok(Some(line)) => {
                    lines += 1;
                    if let Some(end) = self.on_line(run, &line) {
                        return Some(end);
                    }
                }
                Ok(None) if bytes >= REPLY_BYTES_PER_WAKE => break,
                Ok(None) => match self.replies.try_fill() {
                    Ok(Fill::Read(n)) => bytes += n,
                    Ok(Fill::Empty) => break,
                    Ok(Fill::Eof) => {
                        return Some(CellEnd::WorkerGone("worker closed its reply pipe".into()));
                    }
                    Err(e) => return Some(CellEnd::WorkerGone(format!("protocol violation: {e}"))),
                },
                Err(e) => return Some(CellEnd::WorkerGone(format!("protocol violation: {e}"))),
            }
        }
        None
    }

    /// The worker exited during the cell: a `done` it wrote first still counts (R's quit()
    /// reports `exited`, then exits); whatever else is buffered is read, bounded, and the cell
    /// ends with the worker gone.
    fn on_worker_exit(
        &mut self,
        run: &mut CellRun,
        status: std::io::Result<std::process::ExitStatus>,
    ) -> Option<CellEnd> {
        for _ in 0..EXIT_LINES {
            match self.replies.take_line() {
                Ok(Some(line)) => match self.on_line(run, &line) {
                    Some(end @ CellEnd::Done(_)) => return Some(end),
                    Some(_) => break,
                    None => {}
                },
                Ok(None) => match self.replies.try_fill() {
                    Ok(Fill::Read(_)) => {}
                    _ => break,
                },
                Err(_) => break,
            }
        }
        Some(CellEnd::WorkerGone(match status {
            Ok(st) => format!("worker {}", describe_exit(st)),
            Err(e) => format!("worker exited ({e})"),
        }))
    }

    /// One reply line of the running cell. What a worker may send is in
    /// `sandcell_proto::worker`; anything else ends it as a protocol violation.
    fn on_line(&mut self, run: &mut CellRun, line: &[u8]) -> Option<CellEnd> {
        let violation =
            |why: String| Some(CellEnd::WorkerGone(format!("protocol violation: {why}")));
        let msg = match WorkerMessage::parse(line) {
            Ok(m) => m,
            Err(e) => return violation(e),
        };
        let raw_output = self.raw_output;
        match msg {
            WorkerMessage::Output { .. } | WorkerMessage::Dropped { .. } if raw_output => {
                violation(format!("a native worker sent {}", kind(&msg)))
            }
            WorkerMessage::Output { cell, .. }
            | WorkerMessage::Dropped { cell, .. }
            | WorkerMessage::Display { cell, .. }
            | WorkerMessage::Done { cell, .. }
                if cell != run.cell =>
            {
                violation(format!(
                    "{} for cell {cell} while cell {} runs",
                    kind(&msg),
                    run.cell
                ))
            }
            WorkerMessage::Output { stream, data, .. } => {
                if let Some(t) = run.caps[idx(stream)].push_text(&data) {
                    run.queue(stream, t);
                }
                None
            }
            WorkerMessage::Dropped { stream, bytes, .. } => {
                run.caps[idx(stream)].push_dropped(bytes);
                None
            }
            WorkerMessage::Display {
                kind, data, note, ..
            } => {
                if raw_output {
                    // What a native worker printed before the bundle is in the raw pipes:
                    // take it now, so the bundle follows it.
                    self.take_raw(run);
                }
                run.on_display(kind, data, note).err().and_then(violation)
            }
            WorkerMessage::Done { ref nonce, .. } if nonce.as_deref() != Some(&run.nonce) => {
                violation("done without the request's nonce".into())
            }
            m @ WorkerMessage::Done { .. } => Some(CellEnd::Done(m)),
            WorkerMessage::HostCall {
                cell,
                nonce,
                call,
                name,
                arguments,
            } => self
                .on_host_call(run, cell, nonce, call, name, arguments)
                .err()
                .and_then(violation),
            other => violation(format!("unexpected {}", kind(&other))),
        }
    }

    /// A `host_call` line of the running cell: checked (opt-in, nonce, sequence, one at a
    /// time, name and arguments' bounds), then the call waits for the client's `HostReply`
    /// (its frame goes to the client after the output before it) until the session's
    /// `host_call_timeout_seconds`. Errors: why the line breaks the protocol.
    fn on_host_call(
        &mut self,
        run: &mut CellRun,
        cell: u64,
        nonce: Option<String>,
        call: u64,
        name: String,
        arguments: serde_json::Value,
    ) -> Result<(), String> {
        use sandcell_proto::kernel::{HostCall, MAX_HOST_CALL_ARGUMENTS, valid_host_call_name};
        let Some(timeout) = self.session.limits.host_calls else {
            return Err("host_call in a session without host_calls".into());
        };
        if cell != run.cell {
            return Err(format!(
                "host_call for cell {cell} while cell {} runs",
                run.cell
            ));
        }
        if nonce.as_deref() != Some(&run.nonce) {
            return Err("host_call without the request's nonce".into());
        }
        if let Some((waiting, _)) = run.host {
            return Err(format!("host_call {call} while call {waiting} waits"));
        }
        if call != self.host_calls_made + 1 {
            return Err(format!(
                "host_call numbered {call} after {}",
                self.host_calls_made
            ));
        }
        if !valid_host_call_name(&name) {
            return Err("host_call with an invalid name".into());
        }
        if !arguments.is_object() {
            return Err("host_call arguments are not an object".into());
        }
        let size = serde_json::to_vec(&arguments).map_or(usize::MAX, |v| v.len());
        if size > MAX_HOST_CALL_ARGUMENTS {
            return Err(format!("host_call arguments of {size} bytes"));
        }
        // Output a native worker wrote before its line may still be in the raw pipes (read
        // 1 ms late to coalesce): take it now, so the frame follows it, as a result does.
        self.take_raw(run);
        self.host_calls_made = call;
        run.host = Some((call, tokio::time::Instant::now() + timeout));
        if !run.abandoned {
            run.host_frame = Some(Frame {
                host_call: Some(HostCall {
                    cell,
                    call,
                    name,
                    arguments,
                }),
                ..Default::default()
            });
        }
        Ok(())
    }

    /// Reads what the raw output pipes hold now (a native worker's output written before the
    /// line being handled), so that the line's frame follows it.
    fn take_raw(&mut self, run: &mut CellRun) {
        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
            let rx = if i == 0 {
                &mut self.stdout
            } else {
                &mut self.stderr
            };
            run.read_raw(rx, i, stream, RAW_READS_PER_WAKE, true);
        }
    }

    /// The client's answer to host call `call`: queued for the worker when that call waits
    /// (returns true), else refused (`NoSuchHostCall`).
    fn on_host_reply(&mut self, run: &mut CellRun, call: u64, payload: Vec<u8>) -> bool {
        if run.host.is_none_or(|(waiting, _)| waiting != call) {
            return false;
        }
        run.host = None;
        self.answer_host_call(run, call, &payload);
        true
    }

    /// The waiting host call timed out: it raises in the cell; a later `HostReply` for it is
    /// `NoSuchHostCall`.
    fn on_host_timeout(&mut self, run: &mut CellRun) {
        let Some((call, _)) = run.host.take() else {
            return;
        };
        let secs = self
            .session
            .limits
            .host_calls
            .unwrap_or_default()
            .as_secs_f64();
        let payload = serde_json::to_vec(&serde_json::json!({
            "error": format!("host call {call} timed out: no answer from the client within {secs} s")
        }))
        .unwrap_or_default();
        tracing::info!(session = %self.session.id, cell = run.cell, call, "host call timed out");
        self.answer_host_call(run, call, &payload);
    }

    /// Queues a `host_reply` request for the worker (written as the pipe takes it).
    fn answer_host_call(&mut self, run: &mut CellRun, call: u64, payload: &[u8]) {
        let mut header = RequestHeader::exec(run.cell, payload.len() as u64);
        header.op = wire::Op::HostReply;
        header.call = Some(call);
        run.to_worker.extend_from_slice(header.to_line().as_bytes());
        run.to_worker.extend_from_slice(payload);
    }

    /// The request pipe takes bytes: writes what waits for the worker (a worker that does not
    /// read is stopped by its deadline like any other).
    fn on_request_writable(
        &mut self,
        run: &mut CellRun,
        ready: std::io::Result<()>,
    ) -> Option<CellEnd> {
        if let Err(e) = ready {
            return Some(CellEnd::WorkerGone(format!("request pipe: {e}")));
        }
        match self.requests.try_write(&run.to_worker) {
            Ok(n) => {
                run.to_worker.drain(..n);
                if run.to_worker.is_empty() {
                    run.to_worker = Vec::new();
                }
                None
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => Some(CellEnd::WorkerGone(format!("writing a host reply: {e}"))),
        }
    }

    /// A raw output pipe became readable (or failed): the first bytes after a quiet spell are
    /// read [`OUTPUT_COALESCE`] later, together with what follows them (R writes each piece
    /// of a `cat` separately); a busy stream is read at once.
    fn on_raw_ready(&mut self, run: &mut CellRun, i: usize, ready: bool) {
        if ready {
            run.hold[i] = Some(next_read(run.busy[i]));
        } else if i == 0 {
            self.stdout = None;
        } else {
            self.stderr = None;
        }
    }

    /// A held raw stream is due: reads it, at most [`RAW_READS_PER_WAKE`] reads.
    fn on_raw_due(&mut self, run: &mut CellRun) {
        let now = tokio::time::Instant::now();
        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
            if run.hold[i].is_some_and(|t| t <= now) {
                run.hold[i] = None;
                let rx = if i == 0 {
                    &mut self.stdout
                } else {
                    &mut self.stderr
                };
                let n = run.read_raw(rx, i, stream, RAW_READS_PER_WAKE, false);
                run.busy[i] = n >= BUSY_STREAM_BYTES;
            }
        }
    }

    /// The end of a cell's output: what the worker wrote to its raw pipes before its `done`
    /// is already there and is taken, bounded (at most a pipe's capacity), and each stream's
    /// cap gives up its kept tail.
    fn take_last_output(&mut self, run: &mut CellRun, end: &CellEnd) {
        if matches!(end, CellEnd::Done(_)) {
            run.read_raw(
                &mut self.stdout,
                0,
                Stream::Stdout,
                RAW_READS_PER_WAKE,
                true,
            );
            run.read_raw(
                &mut self.stderr,
                1,
                Stream::Stderr,
                RAW_READS_PER_WAKE,
                true,
            );
        }
        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
            if let Some(t) = run.caps[i].finish() {
                run.queue(stream, t);
            }
        }
    }

    /// Everything after the cell's loop: late output, the result, the files, the end of the
    /// cell's leftover processes, and the result's delivery.
    async fn finish_cell(
        &mut self,
        mut run: CellRun,
        end: CellEnd,
        one_shot: bool,
        mut close_req: CloseRequest,
        files_before: Option<crate::files::Listing>,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let cell = run.cell;
        let limits = self.session.limits.clone();
        self.take_last_output(&mut run, &end);
        let cancelled = matches!(end, CellEnd::Cancelled(_));
        if cancelled {
            close_req.get_or_insert((
                Ending::new(EndReason::Disconnected, "cancelled"),
                oneshot::channel().0,
            ));
        }
        let (mut result, mut ending) = self.result_of(&run, end).await;
        if one_shot {
            result.state = State::None;
            result.session_ended = true;
            ending.get_or_insert((
                Ending::new(EndReason::OneShot, "one-shot run finished"),
                None,
            ));
        }
        // The cell's leftover processes go (a cell's processes do not outlive the cell), then
        // the entries of the session directory the cell created or changed are listed.
        let generation = self.session.files_generation();
        let sweep = ending.is_none().then(|| (self.group.clone(), self.pid));
        let after = cell_files(self.session_dir.clone(), files_before, sweep).await;
        let over = after.ends_session(limits.files_bytes);
        if after.partial && over.is_none() {
            result.warnings.push(format!(
                "the session directory holds more than {} entries or names more than {} levels deep; the list of files this cell changed may be incomplete",
                crate::files::MAX_ENTRIES,
                crate::files::MAX_DEPTH
            ));
        }
        result.files = after.changed;
        self.known_files = after.listing.map(|l| (generation, l));
        if !after.stopped.is_empty() {
            result.warnings.push(format!(
                "{} process(es) the cell left running were stopped: a cell's processes do not outlive it",
                after.stopped.len()
            ));
        }
        self.leftovers = after.stopped;
        if ending.is_none()
            && let Some(why) = over
        {
            self.kill_and_reap().await;
            result.state = State::Lost;
            result.session_ended = true;
            result.warnings.push(format!(
                "{why}; the session ended and its files were removed"
            ));
            ending = Some((why, None));
        }
        if result.status == sandcell_proto::kernel::Status::FuelExhausted {
            result
                .warnings
                .push(crate::environments::fuel_exhausted(limits.fuel));
        }
        let status = result.status;
        let wall = result.usage.wall_seconds;
        // The rest of the output, in order, right before the result, so the connection writes
        // them together (one write, one wake-up of the client for a short cell). A cell that was
        // cancelled (client gone, session closed) waits for nobody: it gets no more frames.
        while let Some(c) = run.backlog.pop() {
            let f = c.into_frame(cell, run.seq);
            run.seq += 1;
            if !send_or_command(&run.frames, f, cmds, &mut close_req, &mut self.deferred).await {
                run.backlog.clear();
            }
        }
        let result_frame = Frame {
            result: Some(result),
            ..Default::default()
        };
        // The session is idle (or ended) before its client can see the result: a client that
        // sends its next cell the moment the result arrives must not find the session busy.
        // Such an Execute, arriving while the result waits for a slow reader, is kept in
        // `deferred` and run next.
        {
            let mut info = self.session.info.lock().unwrap();
            info.running_cell = None;
            info.cells_run += 1;
            info.last_activity = Instant::now();
            info.state = if ending.is_some() {
                SessionState::Ended
            } else {
                SessionState::Idle
            };
        }
        if cancelled {
            let _ = run.frames.try_send(result_frame);
            close_req = None;
        } else {
            let _ = send_or_command(
                &run.frames,
                result_frame,
                cmds,
                &mut close_req,
                &mut self.deferred,
            )
            .await;
        }
        // A Close that came while a slow client held the frames: honour it now.
        if let Some((reason, done)) = close_req.take() {
            if ending.is_none() {
                self.kill_and_reap().await;
            }
            ending = Some((reason, Some(done)));
            self.session.info.lock().unwrap().state = SessionState::Ended;
        }
        // Bookkeeping after the result is on its way.
        tracing::info!(session = %self.session.id, uid = self.session.owner.uid, cell, status = status.as_str(), wall, "cell finished");
        if ending.is_none() {
            // A cell's child process (R's system()) can be OOM-killed without ending the
            // session; count it here so a later death is not blamed on it.
            self.oom_seen = self.group.oom_kills();
        }
        crate::counters::counters().cell_finished(status);
        let _ = self.events.send(Event::CellFinished {
            id: self.session.id.clone(),
            cell,
            status,
        });
        ending
    }

    /// The result of a cell that ended with `end`, and whether (and why) the session ends
    /// with it. Kills and reaps the worker when it is gone or must go.
    async fn result_of(
        &mut self,
        run: &CellRun,
        end: CellEnd,
    ) -> (CellResult, Option<(Ending, Option<oneshot::Sender<()>>)>) {
        let mut usage = Usage {
            wall_seconds: run.t0.elapsed().as_secs_f64(),
            cpu_seconds: proc_cpu_seconds(self.pid)
                .zip(run.cpu0)
                .map(|(a, b)| (a - b).max(0.0)),
            peak_memory_bytes: self.group.memory_peak(),
            fuel: None,
        };
        let mut result = CellResult {
            cell: run.cell,
            status: Status::Ok,
            error: None,
            exit_code: None,
            usage: Usage::default(),
            stdout: run.caps[0].stats(),
            stderr: run.caps[1].stats(),
            state: State::Kept,
            session_ended: false,
            warnings: Vec::new(),
            files: Vec::new(),
            displays: run.displays.map(|(seen, kept)| StreamStats {
                seen,
                kept,
                truncated: seen > kept,
            }),
            retained: None,
        };
        let ending = match end {
            CellEnd::Done(done) => self.finished(run, done, &mut usage, &mut result).await,
            CellEnd::DiskFull(why) => Some(self.disk_full(run, why, &mut result).await),
            end @ (CellEnd::Killed | CellEnd::WorkerGone(_) | CellEnd::Cancelled(_)) => {
                Some(self.lost(run, end, &mut usage, &mut result).await)
            }
        };
        result.usage = usage;
        (result, ending)
    }

    /// The result of a cell whose worker reported `done` (into `result`, its fuel into
    /// `usage`); the session ends with it only when the cell ended the interpreter and the
    /// worker exited.
    async fn finished(
        &mut self,
        run: &CellRun,
        done: WorkerMessage,
        usage: &mut Usage,
        result: &mut CellResult,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let WorkerMessage::Done {
            status,
            error,
            exit_code,
            fuel,
            state,
            warnings,
            ..
        } = done
        else {
            unreachable!("only Done messages end a cell")
        };
        usage.fuel = fuel;
        // A cell that ran past its wall time timed out, however it ended: a cell whose
        // `system('sleep 100')` was stopped by the SIGINT goes on to its end and
        // reports ok.
        let overran = run.phase == Phase::TimedOut || usage.wall_seconds > run.wall.as_secs_f64();
        // Likewise a cell interrupted by its client reports interrupted however it
        // ended: R ignores SIGINT while it waits in `system()`, so such a cell can
        // finish (running the statements after the interrupt) and say ok.
        let interrupted = run.phase == Phase::Interrupted;
        result.status = match (status, overran) {
            (
                WorkerStatus::Ok
                | WorkerStatus::Error
                | WorkerStatus::Interrupted
                | WorkerStatus::Timeout,
                true,
            ) => Status::Timeout,
            (WorkerStatus::Ok | WorkerStatus::Error, _) if interrupted => Status::Interrupted,
            (WorkerStatus::Ok, _) => Status::Ok,
            (WorkerStatus::Error, _) => Status::Error,
            (WorkerStatus::Interrupted, _) => Status::Interrupted,
            (WorkerStatus::Timeout, _) => Status::Timeout,
            (WorkerStatus::FuelExhausted, _) => Status::FuelExhausted,
            (WorkerStatus::MemoryExhausted, _) => Status::MemoryExhausted,
            (WorkerStatus::Exited, _) => Status::Exited,
        };
        result.error = error;
        if result.status == Status::Timeout && result.error.is_none() {
            result.error = Some(wire::CellError {
                kind: "Timeout".into(),
                message: format!(
                    "the cell ran {:.1} s, past its wall time of {:.1} s",
                    usage.wall_seconds,
                    run.wall.as_secs_f64()
                ),
                ..Default::default()
            });
        }
        result.exit_code = exit_code;
        result.state = match state {
            wire::SessionState::Kept => State::Kept,
            wire::SessionState::Restored => State::Restored,
            wire::SessionState::Lost => State::Lost,
        };
        result.warnings = warnings;
        // A worker whose interpreter ended (R's quit()) exits after reporting it: then
        // the session ends here, and says so. (Python's sys.exit does not end Eryx.)
        if result.status == Status::Exited
            && let Ok(_) = tokio::time::timeout(Duration::from_millis(500), self.child.wait()).await
        {
            self.kill_and_reap().await;
            result.state = State::Lost;
            result.session_ended = true;
            return Some((
                Ending::new(EndReason::Exited, "the cell ended the interpreter"),
                None,
            ));
        }
        None
    }

    /// The result of a cell stopped because its session went over its disk budget: the
    /// session ends (killed and reaped here).
    async fn disk_full(
        &mut self,
        run: &CellRun,
        why: String,
        result: &mut CellResult,
    ) -> (Ending, Option<oneshot::Sender<()>>) {
        // Everything of the session stops at once (the worker and whatever it started),
        // so nothing writes on; the session ends and its directory is removed.
        self.kill_and_reap().await;
        result.status = Status::Error;
        result.state = State::Lost;
        result.session_ended = true;
        result.error = Some(wire::CellError {
            kind: "DiskQuotaExceeded".into(),
            message: format!(
                "{why}; the cell was stopped, the session ended and its files were removed"
            ),
            ..Default::default()
        });
        result.warnings.push(format!(
            "{why}; the session ended and its files were removed"
        ));
        tracing::warn!(session = %self.session.id, cell = run.cell, reason = %why, "disk budget exceeded during a cell");
        (Ending::new(EndReason::DiskQuota, why), None)
    }

    /// The result of a cell whose worker is gone or must go (killed at its deadline or for
    /// ignoring an interrupt, dead, OOM-killed, or its session cancelled): the worker is
    /// killed and reaped here, and the session ends.
    async fn lost(
        &mut self,
        run: &CellRun,
        end: CellEnd,
        usage: &mut Usage,
        result: &mut CellResult,
    ) -> (Ending, Option<oneshot::Sender<()>>) {
        // A worker that closed its pipes or broke the protocol is usually dying: its
        // exit status (a signal, an exit code) tells an operator why, so it is waited
        // for briefly before the daemon's own kill would mask it.
        let end = match end {
            CellEnd::WorkerGone(why) => {
                match tokio::time::timeout(WORKER_EXIT_WAIT, self.child.wait()).await {
                    Ok(Ok(st)) if !why.contains(&describe_exit(st)) => {
                        CellEnd::WorkerGone(format!("{why}; the worker {}", describe_exit(st)))
                    }
                    _ => CellEnd::WorkerGone(why),
                }
            }
            other => other,
        };
        // The worker is gone or must go: kill the whole group, reap, then decide.
        self.kill_and_reap().await;
        let oom = self.group.oom_kills() > run.oom0;
        let (status, why) = match &end {
            _ if oom => (
                Status::Oom,
                "worker OOM-killed at its cgroup memory limit".to_string(),
            ),
            CellEnd::Killed if run.phase == Phase::TimedOut => (
                Status::Timeout,
                "cell ignored the interrupt at its wall time; worker killed".into(),
            ),
            CellEnd::Killed => (
                Status::Interrupted,
                "cell ignored the interrupt; worker killed".into(),
            ),
            CellEnd::Cancelled(Some((r, _))) => (Status::Cancelled, r.detail.clone()),
            CellEnd::Cancelled(None) => (Status::Cancelled, "client disconnected".into()),
            CellEnd::WorkerGone(why) => (Status::WorkerCrashed, why.clone()),
            CellEnd::Done(_) | CellEnd::DiskFull(_) => unreachable!(),
        };
        if status == Status::WorkerCrashed {
            tracing::warn!(session = %self.session.id, cell = run.cell, reason = %why, "worker ended");
        }
        if oom {
            crate::counters::counters().oom_killed();
            let _ = self.events.send(Event::OomKilled {
                id: self.session.id.clone(),
            });
        }
        result.status = status;
        result.state = State::Lost;
        result.session_ended = true;
        if status != Status::Cancelled {
            result.error = Some(wire::CellError {
                kind: "SessionLost".into(),
                message: format!("{why}; the session's variables are lost"),
                ..Default::default()
            });
        }
        let code = match (status, &end) {
            (Status::Oom, _) => EndReason::Oom,
            (Status::Timeout | Status::Interrupted, _) => EndReason::Killed,
            (_, CellEnd::Cancelled(_)) => EndReason::Disconnected,
            _ => EndReason::WorkerCrashed,
        };
        usage.peak_memory_bytes = self.group.memory_peak().or(usage.peak_memory_bytes);
        match end {
            CellEnd::Cancelled(Some((r, done))) => (r, Some(done)),
            _ => (Ending::new(code, why), None),
        }
    }

    async fn kill_and_reap(&mut self) {
        self.child
            .kill_and_reap(self.pidfd.as_ref(), &self.group)
            .await;
    }

    /// Releases everything, in the order of the module documentation. Idempotent.
    async fn shutdown(&mut self, reason: &Ending) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.session.info.lock().unwrap().state = SessionState::Ended;
        // The keeper exits without waiting for an adopter; the record goes.
        self.end_keeper();
        // Ask politely first only when idle: there is nothing worth saving, so just kill.
        self.kill_and_reap().await;
        self.reap_keeper().await;
        crate::worker::remove_remains(
            &self.session.id,
            self.group.clone(),
            self.session_dir.clone(),
        )
        .await;
        self.uid.take();
        self.permit.take();
        tracing::info!(session = %self.session.id, uid = self.session.owner.uid, reason = %reason.detail, code = reason.reason.as_str(), "session closed");
        if let Some(f) = self.on_end.take() {
            f(&self.session.id, reason);
        }
        crate::counters::counters().session_ended();
        let _ = self.events.send(Event::Closed {
            id: self.session.id.clone(),
            reason: reason.detail.clone(),
            code: reason.reason,
        });
    }
}

/// Files a cell leaves in the session directory: a bounded lstat-only listing of
/// `dir`; `None` if it cannot be read.
async fn list_files(dir: PathBuf) -> Option<crate::files::Listing> {
    tokio::task::spawn_blocking(move || crate::files::list(&dir).ok())
        .await
        .ok()
        .flatten()
}

/// What the end of a cell found in its session (see [`cell_files`]).
struct AfterCell {
    /// Entries created or changed since the listing before the cell.
    changed: Vec<sandcell_proto::kernel::FileInfo>,
    /// Bytes of regular files in the directory.
    bytes: u64,
    /// The directory is over its entry budget: more than [`crate::files::MAX_SESSION_ENTRIES`]
    /// entries, or deeper than [`crate::files::MAX_WALK_DEPTH`] levels.
    crowded: bool,
    /// The listing shows only part of the directory (more than [`crate::files::MAX_ENTRIES`]
    /// visible entries, or names deeper than [`crate::files::MAX_DEPTH`] levels): `changed`
    /// may be incomplete. Not an ending: the budgets are what bound the directory.
    partial: bool,
    /// The listing itself (the next cell's "before").
    listing: Option<crate::files::Listing>,
    /// Processes the cell left running that were killed (zombies until reaped).
    stopped: Vec<crate::cgroup::Leftover>,
    /// Why leftover processes could not all be killed.
    sweep_error: Option<String>,
}

/// At the end of a cell: first kills every process of the session's cgroup but the worker
/// (`sweep`: the group and the worker's pid; a cell's processes do not outlive the cell;
/// threads inside the worker, such as a native Python worker's, cannot be stopped without
/// ending it and may run on, which the disk watch between cells bounds), then lists `dir`
/// and compares it with `before` (no changes reported when either listing failed).
///
/// The common end, a cgroup that holds only the worker and a directory of at most
/// [`INLINE_END_ENTRIES`] entries, is done on the actor's own thread: a hand-off to the
/// blocking pool and back costs two thread wake-ups, more than the few reads themselves.
/// Anything more (processes to kill and wait for, a larger directory) runs off the async
/// threads.
async fn cell_files(
    dir: PathBuf,
    before: Option<crate::files::Listing>,
    sweep: Option<(Arc<dyn SessionGroup>, u32)>,
) -> AfterCell {
    let alone = sweep
        .as_ref()
        .is_none_or(|(group, keep)| group.holds_only(*keep));
    if alone && let Ok(Some(after)) = crate::files::list_within(&dir, INLINE_END_ENTRIES) {
        return AfterCell::new(before, Vec::new(), None, Some(after));
    }
    let done = tokio::task::spawn_blocking(move || {
        let (stopped, sweep_error) = match sweep {
            Some((group, keep)) => match group.kill_others(keep, LEFTOVER_KILL_TIMEOUT) {
                Ok(killed) => (killed, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            },
            None => (Vec::new(), None),
        };
        let after = crate::files::list(&dir).ok();
        (stopped, sweep_error, after)
    })
    .await;
    match done {
        Ok((stopped, sweep_error, after)) => AfterCell::new(before, stopped, sweep_error, after),
        Err(e) => AfterCell::new(before, Vec::new(), Some(e.to_string()), None),
    }
}

/// The most entries a session directory may hold for the end of a cell to be listed on the
/// actor's thread ([`cell_files`]); a walk that meets more stops and is done again off the
/// async threads. Bounds that thread's time to this many `lstat` calls.
const INLINE_END_ENTRIES: u64 = 128;

impl AfterCell {
    /// Whether the session must end after this cell, and why. A cell writes the directory
    /// directly (R, and Python through /mnt/data), so the session's disk budget
    /// (`files_bytes`) is checked after every cell. Over it, or with more entries than a
    /// listing can see, the session ends and its directory is removed: the safe side, since
    /// nothing else bounds a cell's disk use. So does a session whose leftover processes
    /// could not be stopped.
    fn ends_session(&self, files_bytes: u64) -> Option<Ending> {
        if let Some(e) = &self.sweep_error {
            Some(Ending::new(
                EndReason::WorkerCrashed,
                format!("processes the cell left running could not be stopped ({e})"),
            ))
        } else if self.crowded {
            Some(Ending::new(
                EndReason::DiskQuota,
                format!(
                    "the session directory holds more than {} entries or is deeper than {} levels",
                    crate::files::MAX_SESSION_ENTRIES,
                    crate::files::MAX_WALK_DEPTH
                ),
            ))
        } else if self.bytes > files_bytes {
            Some(Ending::new(
                EndReason::DiskQuota,
                format!(
                    "the session directory holds {} bytes, over max_session_files_bytes ({files_bytes})",
                    self.bytes
                ),
            ))
        } else {
            None
        }
    }

    /// What a cell changed: `after` compared with `before`, and what the sweep found.
    fn new(
        before: Option<crate::files::Listing>,
        stopped: Vec<crate::cgroup::Leftover>,
        sweep_error: Option<String>,
        after: Option<crate::files::Listing>,
    ) -> Self {
        let Some(after) = after else {
            return AfterCell {
                changed: Vec::new(),
                bytes: 0,
                crowded: false,
                partial: false,
                listing: None,
                stopped,
                sweep_error,
            };
        };
        AfterCell {
            changed: before.map(|b| after.changed_since(&b)).unwrap_or_default(),
            bytes: after.regular_bytes(),
            crowded: after.usage.over,
            partial: after.truncated,
            listing: Some(after),
            stopped,
            sweep_error,
        }
    }
}

/// The disk watch: while a cell runs, the session directory is totalled (the same walk as
/// after a cell: every entry, `max(st_size, st_blocks * 512)`, at most
/// [`crate::files::MAX_SESSION_ENTRIES`] entries) again this long after the previous walk
/// ended, at least...
const DISK_WATCH_MIN: Duration = Duration::from_millis(25);

/// ... and at most this long after it, ...
const DISK_WATCH_MAX: Duration = Duration::from_millis(250);

/// ... and otherwise this many times the previous walk's duration, so that the walks cost at
/// most about 1/20 of a core per running cell however many entries the directory holds.
const DISK_WATCH_FACTOR: u32 = 20;

/// The disk watch between cells: a cell's Python threads (native worker) run on after it,
/// and can write, so an idle session's directory is totalled too, this long after the
/// previous walk ended (or [`DISK_WATCH_FACTOR`] times that walk's duration, when longer:
/// the same cost bound as during a cell). One walk per interval per idle session, never two
/// at once; what a writer adds within one interval is the overshoot before the session ends.
const DISK_IDLE_WATCH: Duration = Duration::from_secs(1);

/// Why `bytes` (a [`disk_usage`] total) breaks the session's disk budget `budget`, if it does.
fn over_disk_budget(bytes: u64, budget: u64) -> Option<String> {
    if bytes <= budget {
        None
    } else if bytes == u64::MAX {
        Some(format!(
            "the session directory holds more than {} entries",
            crate::files::MAX_SESSION_ENTRIES
        ))
    } else {
        Some(format!(
            "the session directory holds {bytes} bytes, over max_session_files_bytes ({budget})"
        ))
    }
}

/// Bytes the session directory is charged now ([`crate::files::Listing::regular_bytes`]:
/// `u64::MAX` when it holds more entries than the budget); 0 when it cannot be read (the
/// check after the cell still runs).
fn disk_usage(dir: &std::path::Path) -> u64 {
    crate::files::list(dir)
        .map(|l| l.regular_bytes())
        .unwrap_or(0)
}

/// Waits for the disk walk in flight; returns its total and how long it took.
async fn disk_scan_done(
    scan: &mut Option<(Instant, tokio::task::JoinHandle<u64>)>,
) -> (u64, Duration) {
    let Some((started, handle)) = scan.as_mut() else {
        return std::future::pending().await;
    };
    let bytes = handle.await.unwrap_or(0);
    let took = started.elapsed();
    *scan = None;
    (bytes, took)
}

/// How long a worker that closed its reply pipe (or broke the protocol) is given to exit on
/// its own, so that its crash report names its signal or exit code.
const WORKER_EXIT_WAIT: Duration = Duration::from_millis(500);

/// How a worker ended, for a crash report: "was killed by signal 9 (SIGKILL)" or "exited with
/// status 2".
fn describe_exit(st: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = st.signal() {
        let name = match sig {
            libc::SIGKILL => "SIGKILL",
            libc::SIGSEGV => "SIGSEGV",
            libc::SIGABRT => "SIGABRT",
            libc::SIGBUS => "SIGBUS",
            libc::SIGILL => "SIGILL",
            libc::SIGFPE => "SIGFPE",
            libc::SIGSYS => "SIGSYS",
            libc::SIGTERM => "SIGTERM",
            libc::SIGINT => "SIGINT",
            libc::SIGHUP => "SIGHUP",
            libc::SIGPIPE => "SIGPIPE",
            libc::SIGXCPU => "SIGXCPU",
            libc::SIGXFSZ => "SIGXFSZ",
            libc::SIGQUIT => "SIGQUIT",
            _ => "",
        };
        let core = if st.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        if name.is_empty() {
            format!("was killed by signal {sig}{core}")
        } else {
            format!("was killed by signal {sig} ({name}){core}")
        }
    } else if let Some(code) = st.code() {
        format!("exited with status {code}")
    } else {
        format!("ended ({st})")
    }
}

/// How long after its wall time a running cell gets its first SIGINT. The worker's own limit
/// fires at the wall time and reports `timeout` itself where it can; this slack lets that
/// report arrive first. A cell still running then is interrupted (SIGINT every 250 ms) and
/// killed at the wall time plus the grace (`kill_grace_seconds`), which ends its session.
const WALL_SLACK: Duration = Duration::from_millis(100);

/// The kill comes at least this long after the first SIGINT (a grace shorter than
/// [`WALL_SLACK`] still leaves the worker a moment to report).
const KILL_AFTER_SIGINT_MIN: Duration = Duration::from_millis(100);

/// How long the next cell waits for the zombies of the processes the previous cell left (and
/// the daemon killed) to be reaped.
const LEFTOVER_REAP_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the end of a cell waits for the processes it left running to die.
const LEFTOVER_KILL_TIMEOUT: Duration = Duration::from_secs(2);

/// How often an unanswered `Inspect` repeats its SIGINT (as a cell's interrupt does).
const INTERRUPT_REPEAT: Duration = Duration::from_millis(250);

/// The `Inspect` answer in a worker's reply `line`, or why the line breaks the protocol: it
/// must be an `inspected` frame with the request's `nonce`, at most `max_items` variables,
/// each within the bounds of [`wire::Variable::check`].
fn check_inspected(line: &[u8], nonce: &str, max_items: u64) -> Result<InspectReply, String> {
    let violation = |why: String| format!("protocol violation: {why}");
    match WorkerMessage::parse(line).map_err(violation)? {
        WorkerMessage::Inspected {
            nonce: n,
            variables,
            truncated,
        } => {
            if n.as_deref() != Some(nonce) {
                return Err(violation("inspected without the request's nonce".into()));
            }
            if variables.len() as u64 > max_items {
                return Err(violation(format!(
                    "{} variables listed, {max_items} asked for",
                    variables.len()
                )));
            }
            for v in &variables {
                v.check().map_err(violation)?;
            }
            Ok(InspectReply {
                variables,
                truncated,
            })
        }
        other => Err(violation(format!(
            "{} while an inspect was answered",
            kind(&other)
        ))),
    }
}

/// A Close that arrived while a frame waited for a slow client: (reason, waiter).
type CloseRequest = Option<(Ending, oneshot::Sender<()>)>;

/// Sends `frame`, still answering commands while the client is slow to read: an interrupt is
/// reported undelivered (the cell is over or not yet started), a Close stops the wait and is
/// kept in `close`, an Execute (admitted once the session went idle, before its result was
/// read) is kept in `deferred`. Returns false when the frame was not sent.
async fn send_or_command(
    frames: &mpsc::Sender<Frame>,
    frame: Frame,
    cmds: &mut mpsc::Receiver<Command>,
    close: &mut CloseRequest,
    deferred: &mut Option<Command>,
) -> bool {
    if close.is_some() {
        return false;
    }
    loop {
        tokio::select! {
            permit = frames.reserve() => {
                return match permit {
                    Ok(p) => {
                        p.send(frame);
                        true
                    }
                    Err(_) => false,
                };
            }
            cmd = cmds.recv() => match cmd {
                Some(Command::Interrupt { reply, .. }) => {
                    let _ = reply.send(InterruptReply { delivered: false, reason: InterruptReason::NotRunning.into() });
                }
                // The cell's result still waits for its reader.
                Some(Command::Inspect { reply, .. }) => {
                    let _ = reply.send(Err(InspectRefused::Busy(0)));
                }
                Some(Command::Query { reply, .. }) => {
                    let _ = reply.send(Err(InspectRefused::Busy(0)));
                }
                // The cell is over (or not started): no call of it waits.
                Some(Command::HostReply { reply, .. }) => {
                    let _ = reply.send(false);
                }
                Some(Command::Close { reason, done }) => {
                    *close = Some((reason, done));
                    return false;
                }
                // Admitted only once the session is idle, i.e. while the result waits.
                Some(cmd @ Command::Execute { .. }) => *deferred = Some(cmd),
                None => {
                    *close = Some((
                        Ending::new(EndReason::Disconnected, "abandoned"),
                        oneshot::channel().0,
                    ));
                    return false;
                }
            }
        }
    }
}

/// The `output` frame carrying `text` of `stream`, number `seq` of `cell`.
fn output_frame(cell: u64, seq: u64, stream: Stream, text: String) -> Frame {
    Frame {
        output: Some(Output {
            cell,
            seq,
            stream,
            text,
        }),
        ..Default::default()
    }
}

fn idx(s: Stream) -> usize {
    match s {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    }
}

fn kind(m: &WorkerMessage) -> &'static str {
    match m {
        WorkerMessage::Ready { .. } => "ready",
        WorkerMessage::Fatal { .. } => "fatal",
        WorkerMessage::Output { .. } => "output",
        WorkerMessage::Dropped { .. } => "dropped",
        WorkerMessage::Done { .. } => "done",
        WorkerMessage::Inspected { .. } => "inspected",
        WorkerMessage::Completions { .. } => "completions",
        WorkerMessage::Help { .. } => "help",
        WorkerMessage::HostCall { .. } => "host_call",
        WorkerMessage::Display { .. } => "display",
    }
}

/// Waits until `rx` is readable (true) or failed (false); never returns without a pipe.
async fn ready_opt(rx: &Option<pipe::Receiver>) -> bool {
    match rx {
        Some(r) => r.readable().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// How long the first bytes on a quiet raw output pipe wait before they are read, so that a
/// burst of small writes becomes one read and one frame (R's console writes each piece of a
/// `cat(1, "\n")` separately; a short cell's output then leaves with its result). Streaming
/// output is at most this much later.
const OUTPUT_COALESCE: Duration = Duration::from_millis(1);

/// A read of at least this many bytes marks a raw stream busy: it is read again at once.
const BUSY_STREAM_BYTES: usize = 16 * 1024;

/// When to read a raw stream that just became readable: at once when it is busy, else after
/// [`OUTPUT_COALESCE`].
fn next_read(busy: bool) -> tokio::time::Instant {
    tokio::time::Instant::now()
        + if busy {
            Duration::ZERO
        } else {
            OUTPUT_COALESCE
        }
}

/// CPU seconds (user + system, children included) of `pid`, from `/proc/<pid>/stat`.
fn proc_cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime, stime, cutime, cstime are fields 14-17 of proc(5): indexes 11-14 here.
    let ticks: u64 = (11..=14)
        .filter_map(|i| f.get(i)?.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 / hz)
}

mod keep;

pub mod query;
pub use keep::{AdoptWith, Adoptable, Keep, NotAdopted, connect as connect_keeper};

#[cfg(test)]
mod actor_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use sandcell_proto::worker::MAX_OUTPUT_CHUNK;

    #[test]
    fn a_cell_ends_its_session_over_the_disk_budget_or_with_unstoppable_leftovers() {
        let after = |bytes, crowded, sweep_error: Option<&str>| AfterCell {
            changed: Vec::new(),
            bytes,
            crowded,
            partial: true,
            listing: None,
            stopped: Vec::new(),
            sweep_error: sweep_error.map(str::to_owned),
        };
        let reason = |a: AfterCell| a.ends_session(100).map(|e| e.reason);
        assert_eq!(reason(after(100, false, None)), None);
        assert_eq!(reason(after(101, false, None)), Some(EndReason::DiskQuota));
        assert_eq!(reason(after(0, true, None)), Some(EndReason::DiskQuota));
        assert_eq!(
            reason(after(101, true, Some("still alive"))),
            Some(EndReason::WorkerCrashed)
        );
        let e = after(101, false, None).ends_session(100).unwrap();
        assert!(e.detail.contains("101 bytes"), "{}", e.detail);
    }

    #[test]
    fn backlog_keeps_bundles_in_order_with_text() {
        let mut b = Backlog::default();
        b.push(Stream::Stdout, "a");
        let mut data = serde_json::Map::new();
        data.insert("text/plain".into(), "2".into());
        b.push_bundle(
            Display {
                cell: 1,
                seq: 0,
                kind: DisplayKind::Result,
                data,
                note: None,
            },
            18,
        );
        b.push(Stream::Stdout, "b");
        assert_eq!(b.bytes, 20);
        let frames: Vec<Frame> = std::iter::from_fn(|| b.pop())
            .enumerate()
            .map(|(i, c)| c.into_frame(1, i as u64))
            .collect();
        assert_eq!(
            frames.len(),
            3,
            "text after a bundle is not merged into text before it"
        );
        assert_eq!(frames[0].output.as_ref().unwrap().text, "a");
        let d = frames[1].display.as_ref().unwrap();
        assert_eq!((d.seq, d.kind), (1, DisplayKind::Result));
        assert_eq!(frames[2].output.as_ref().unwrap().seq, 2);
        assert_eq!(b.bytes, 0);
        // A frame the channel refused comes back as the same chunk.
        let back = Chunk::from_frame(frames[1].clone());
        assert!(matches!(back, Chunk::Bundle(_, 18)), "{back:?}");
    }

    #[test]
    fn backlog_merges_splits_and_counts() {
        let mut b = Backlog::default();
        b.push(Stream::Stdout, "ab");
        b.push(Stream::Stdout, "cd");
        b.push(Stream::Stderr, "e");
        assert_eq!(b.bytes, 5);
        assert_eq!(b.chunks.len(), 2, "same-stream text merges");
        // A big push is cut into frame-sized chunks on character boundaries.
        let big = "✓".repeat(MAX_OUTPUT_CHUNK);
        b.push(Stream::Stderr, &big);
        assert_eq!(b.bytes, 5 + big.len());
        let mut total = 0;
        while let Some(Chunk::Text(_, t)) = b.pop() {
            assert!(t.len() <= MAX_OUTPUT_CHUNK, "{}", t.len());
            total += t.len();
        }
        assert_eq!(total, 5 + big.len());
        assert_eq!(b.bytes, 0);
        assert!(b.has_room());
        b.push(Stream::Stdout, &"x".repeat(BACKLOG_BYTES));
        assert!(!b.has_room());
        b.clear();
        assert!(b.has_room() && b.is_empty());
    }

    #[test]
    fn nonces_are_fresh_and_well_formed() {
        let a = new_nonce().unwrap();
        let b = new_nonce().unwrap();
        assert!(wire::valid_nonce(&a) && wire::valid_nonce(&b));
        assert_ne!(a, b);
    }
}
