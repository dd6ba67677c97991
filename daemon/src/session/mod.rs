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
    /// next cell waits for them first ([`cell_end::LEFTOVER_REAP_TIMEOUT`] at most).
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
            let idle = self.idle_deadline();
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
                    self.start_idle_disk_scan();
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

/// The kill comes at least this long after the first SIGINT (a grace shorter than
/// [`WALL_SLACK`] still leaves the worker a moment to report).
const KILL_AFTER_SIGINT_MIN: Duration = Duration::from_millis(100);

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

mod cell;
use cell::{
    CellEnd, CellRun, Phase, RAW_READS_PER_WAKE, REPLY_BYTES_PER_WAKE, kind, proc_cpu_seconds,
};

mod cell_end;
use cell_end::{
    DISK_WATCH_FACTOR, DISK_WATCH_MAX, DISK_WATCH_MIN, disk_scan_done, disk_usage, list_files,
    over_disk_budget,
};

mod idle;
use idle::DISK_IDLE_WATCH;

mod keep;
pub use keep::{AdoptWith, Adoptable, Keep, NotAdopted, connect as connect_keeper};

#[cfg(test)]
mod actor_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_are_fresh_and_well_formed() {
        let a = new_nonce().unwrap();
        let b = new_nonce().unwrap();
        assert!(wire::valid_nonce(&a) && wire::valid_nonce(&b));
        assert_ne!(a, b);
    }
}
