//! One session: a worker process, its cgroup, its directory, its admission charge, and the
//! task ("actor") that owns them all and runs cells one at a time.
//!
//! Every path out of a session — `Close`, client disconnect, worker crash, OOM, timeout kill,
//! daemon stop — goes through [`Actor::shutdown`], which kills the cgroup, reaps the worker,
//! removes the cgroup and the directory, and only then releases the uid and the admission
//! permit (DESIGN invariant: release after the worker is dead and reaped).
//!
//! The module's files, in the order a cell meets them:
//! - `mod.rs`: the public handle, [`Session`] (start, execute, inspect, interrupt, close), its
//!   limits, state, commands and events, and what its actor is launched from.
//! - `actor.rs`: the actor and its state machine: idle, one cell, an `Inspect`, the shutdown.
//! - `cell.rs`: the running cell: `CellRun` and the handlers of the cell's event loop.
//! - `cell_end.rs`: the end of a cell: its result, the processes it left running, the files
//!   it changed, and the session directory's disk budget.
//! - `idle.rs`: the idle watch: the idle timeout and the disk walks between cells.
//! - `keep.rs`: sessions kept for a successor daemon to adopt (keeper, record, adoption).
//! - `journal.rs`, `spool.rs`: a kept session's running retained cell as a successor
//!   continues it: its frames and counts, and the worker's bytes not yet journaled.
//! - `actor_tests.rs`: the actor driven by scripted fake workers.

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

impl Info {
    /// The cell whose token is `token`, if it is among [`Info::tokens`].
    pub fn cell_with_token(&self, token: &str) -> Option<u64> {
        self.tokens
            .iter()
            .find(|(_, t)| t == token)
            .map(|(c, _)| *c)
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
    /// The tokens of the newest cells started with one, oldest first, at most
    /// [`sandcell_proto::kernel::CELL_TOKENS_KEPT`]: a call repeated with one of them
    /// starts nothing ([`ExecuteRefused::Repeated`]); it follows that cell when its output
    /// is retained (`Submit`, `Execute` on a detached session).
    pub tokens: Vec<(u64, String)>,
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
    /// The session directory (files in and out: `files/`). For a session adopted from a
    /// daemon in another mount namespace, a path through the descriptor `dir_view` (`keep.rs`).
    pub dir: PathBuf,
    /// The descriptor `dir` names, held (never read) as long as the session object lives, so
    /// its number is not reused while `dir` names it (`keep.rs`).
    _dir_view: Option<std::os::fd::OwnedFd>,
    /// The worker's uid and gid (files the daemon stores there are theirs); `None` when the
    /// worker keeps the daemon's identity (development).
    pub worker_ids: Option<(u32, u32)>,
    /// Bumped after every change the daemon makes to the session directory (`PutFile`,
    /// `DeleteFile`), so the actor knows when its last listing is out of date.
    files_generation: std::sync::atomic::AtomicU64,
    /// Set by [`Session::hand_over`]: the daemon exits keeping the session, and its actor
    /// starts no cell and writes no request from then on ([`Session::handed_over`]).
    handed_over: std::sync::atomic::AtomicBool,
    /// Records of the cells started by `Submit` (or by `Execute` on a detached session):
    /// retained output and results for `Attach` and `CellStatus` (`cells.rs`).
    pub cells: crate::cells::CellLog,
    cmds: mpsc::Sender<Command>,
    group: Arc<dyn SessionGroup>,
    /// True once the actor has started the session's keeper and written its record (or
    /// knows it has none): see [`Session::recorded`].
    recorded: tokio::sync::watch::Sender<bool>,
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
        /// `frames` go to a relay that retains them (`cells.rs`): a successor daemon
        /// continues the cell if this one goes away (`keep.rs`).
        retained: bool,
        /// The caller's token for the cell: kept in [`Info::tokens`] with the cell's
        /// number.
        token: Option<String>,
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
    /// The daemon exits keeping its sessions: a running cell's state is handed over to the
    /// successor exactly (its unsent output into its journal, the reply bytes read and not
    /// yet handled beside its record) and the actor stops reading; `done` fires then.
    HandOver {
        /// Fires when handed over.
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
            keeper: warm,
            ..
        } = prepared;
        // A warm keeper serves a kept session; any other ends it, off the caller's path.
        let warm = match (warm, &keep) {
            (Some(w), Some(_)) => Some(w),
            (Some(w), None) => {
                tokio::task::spawn_blocking(move || w.end());
                None
            }
            (None, _) => None,
        };
        let pid = spawned.pid;
        let (interrupt, raw_output) = (spawned.interrupt, spawned.stdout.is_some());
        let egress = spawned.egress_listener.zip(spawned.egress_hosts);
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
            tokens: Vec::new(),
            host_calls_made: 0,
            last_activity: Instant::now(),
            started: SystemTime::now(),
            keep,
            lifeline: None,
            warm,
            dir_view: None,
            resume: None,
            egress,
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
                running_cell: l.resume.as_ref().map(|r| r.running.cell),
                cells_run: l.cells_run,
                cells_started: l.next_cell.saturating_sub(1),
                tokens: l.tokens,
                state: if l.resume.is_some() {
                    SessionState::Running
                } else {
                    SessionState::Idle
                },
                last_activity: l.last_activity,
            }),
            dir: l
                .dir_view
                .as_ref()
                .map_or_else(|| l.session_dir.clone(), keep::view_path),
            _dir_view: l.dir_view,
            worker_ids: l.uid.as_ref().map(|u| (u.uid(), u.uid())),
            files_generation: std::sync::atomic::AtomicU64::new(0),
            handed_over: std::sync::atomic::AtomicBool::new(false),
            cells: Default::default(),
            cmds: tx,
            group: l.group.clone(),
            recorded: tokio::sync::watch::Sender::new(false),
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
                .map(|k| keep::Kept::new(k, l.environment, l.lifeline, l.warm)),
            running: None,
            pending: None,
            resume: l.resume,
            egress: l.egress,
        };
        tokio::spawn(actor.run(rx));
        session
    }

    /// Waits until a successor daemon would adopt this session: its keeper runs and its record
    /// is written. At once for a session that is not kept (a one-shot `Run`, a daemon that
    /// keeps no sessions) or whose keeper could not start (logged). `Open` answers only after
    /// this, so a session whose id a client has learned survives a crash of the daemon from
    /// then on; before, a crash ends it `daemon_restarted` (its owner marker).
    pub async fn recorded(&self) {
        let mut rx = self.recorded.subscribe();
        // The sender lives in `self`: `wait_for` ends only when the value turns true.
        let _ = rx.wait_for(|r| *r).await;
    }

    /// The cell whose token is `token`, while the session remembers it ([`Info::tokens`]).
    pub fn cell_with_token(&self, token: &str) -> Option<u64> {
        self.info.lock().unwrap().cell_with_token(token)
    }

    /// Queues a cell. Fails with the running cell's number when one is running. With a
    /// `token` the session remembers, nothing starts: [`ExecuteRefused::Repeated`] names
    /// the cell that has it (checked before `Busy`, so a repeat finds its own running cell).
    pub async fn execute(
        &self,
        code: String,
        frames: mpsc::Sender<Frame>,
        one_shot: bool,
        token: Option<String>,
    ) -> Result<(), ExecuteRefused> {
        self.queue_cell(code, frames, one_shot, false, token).await
    }

    /// [`Session::execute`] of a cell whose `frames` go to a relay that retains them
    /// (`cells.rs`): a successor daemon continues it when this one goes away (`keep.rs`).
    /// `token` as for [`Session::execute`].
    pub async fn execute_retained(
        &self,
        code: String,
        frames: mpsc::Sender<Frame>,
        token: Option<String>,
    ) -> Result<(), ExecuteRefused> {
        self.queue_cell(code, frames, false, true, token).await
    }

    async fn queue_cell(
        &self,
        code: String,
        frames: mpsc::Sender<Frame>,
        one_shot: bool,
        retained: bool,
        token: Option<String>,
    ) -> Result<(), ExecuteRefused> {
        {
            let mut info = self.info.lock().unwrap();
            if let Some(cell) = token.as_deref().and_then(|t| info.cell_with_token(t)) {
                return Err(ExecuteRefused::Repeated(cell));
            }
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
                retained,
                token,
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

    /// Hands a running cell over for a successor daemon ([`Command::HandOver`]); returns once
    /// it is (or at once when the session runs no cell or is ending). After it the session
    /// serves nothing more: the daemon exits.
    pub async fn hand_over(&self) {
        // First, whatever the state: an Execute queued around this moment must not start, or
        // the exit could cut it between its record and its request (see `handed_over`).
        self.handed_over
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if self.info.lock().unwrap().state != SessionState::Running {
            return;
        }
        let (tx, rx) = oneshot::channel();
        if self.cmds.send(Command::HandOver { done: tx }).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Whether [`Session::hand_over`] was called: the daemon is exiting keeping this session
    /// for a successor. A cell not yet written to the worker then never is: had the exit
    /// come between the cell's record (which offers it to the successor as running,
    /// unconfirmed) and its request, the successor would wait `records::UNCONFIRMED_WAIT`
    /// (2 s, holding up every adoption) to learn that the request never arrived. Its caller's
    /// call gets no answer from this daemon: the exit cuts it, and the caller sends it again
    /// to the successor.
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(std::sync::atomic::Ordering::SeqCst)
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
    /// The call's token is the token of this cell: nothing was started.
    Repeated(u64),
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
    /// [`Info::tokens`] as recorded (adoption) or empty (a new session).
    tokens: Vec<(u64, String)>,
    host_calls_made: u64,
    last_activity: Instant,
    started: SystemTime,
    keep: Option<keep::Keep>,
    lifeline: Option<crate::keeper::Lifeline>,
    /// The keeper a warm pooled worker came with ([`crate::keeper::start_warm`]).
    warm: Option<crate::keeper::WarmKeeper>,
    /// The session directory's descriptor, when its mount is not in this daemon's namespace.
    dir_view: Option<std::os::fd::OwnedFd>,
    /// The cell a predecessor daemon was running, continued first (`keep.rs`).
    resume: Option<keep::Resume>,
    /// A duplicate of the session's granted egress listener and the hosts of its grant.
    egress: Option<(std::os::fd::OwnedFd, Vec<String>)>,
}

mod actor;
use actor::{
    Actor, CloseRequest, INTERRUPT_REPEAT, KILL_AFTER_SIGINT_MIN, describe_exit, new_nonce,
    send_or_command,
};

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

mod journal;
mod keep;
mod spool;

pub mod query;
pub use keep::{AdoptWith, Adoptable, Keep, NotAdopted, connect as connect_keeper, held_of};

#[cfg(test)]
mod actor_tests;
