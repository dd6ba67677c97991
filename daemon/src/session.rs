//! One session: a worker process, its cgroup, its directory, its admission charge, and the
//! task ("actor") that owns them all and runs cells one at a time.
//!
//! Every path out of a session — `Close`, client disconnect, worker crash, OOM, timeout kill,
//! daemon stop — goes through [`Actor::shutdown`], which kills the cgroup, reaps the worker,
//! removes the cgroup and the directory, and only then releases the uid and the admission
//! permit (DESIGN invariant: release after the worker is dead and reaped).

use crate::admission::Permit;
use crate::cgroup::SessionGroup;
use crate::identity::UidLease;
use crate::worker::LineReader;
use crate::worker::output::StreamCap;
use crate::worker::spawn::Spawned;
use sandcell_proto::kernel::{
    CellResult, Frame, InterruptReply, Language, Output, Started, State, Status, Usage,
};
use sandcell_proto::worker::{self as wire, RequestHeader, Stream, WorkerMessage, WorkerStatus};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

/// Who called: taken from the connection's peer credentials (never from the message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Peer uid.
    pub uid: u32,
    /// Peer gid.
    pub gid: u32,
    /// Peer pid at connect time.
    pub pid: u32,
    /// Connection id (unique per daemon run); 0 for the daemon itself and D-Bus callers.
    pub connection: u64,
    /// How the authority (polkit) identifies the caller; never a bare pid (see [`Subject`]).
    pub subject: Subject,
}

/// The caller as an authorization subject (polkit's `unix-process` or `system-bus-name`).
///
/// A bare pid is never a subject: a pid can be recycled between the connection and the check,
/// and a caller that vanishes mid-check must be refused, not mistaken for another process
/// (polkit CVE-2013-4288, the pid-reuse race; CVE-2021-3560, a requester killed mid-check was
/// treated as root). Hence start time + uid, and a pidfd where the kernel gives one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// The daemon itself (readiness probe).
    Daemon,
    /// A local process from a socket's peer credentials.
    Process {
        /// Peer pid at connect time.
        pid: u32,
        /// Start time of `pid`: `/proc/<pid>/stat` field 22, clock ticks since boot; read
        /// while the pidfd proved the pid still named the peer. 0 if unknown.
        start_time: u64,
        /// `SO_PEERPIDFD` (Linux 6.5+), shared by every clone of the caller.
        pidfd: Option<PidFd>,
    },
    /// A D-Bus peer, by its unique name on the system bus (e.g. `:1.42`).
    BusName {
        /// Unique bus name of the sender.
        name: String,
        /// The call carried `ALLOW_INTERACTIVE_AUTHORIZATION`: polkit may prompt.
        interactive: bool,
    },
}

/// A process file descriptor, shared; two are equal when they are the same descriptor.
#[derive(Debug, Clone)]
pub struct PidFd(pub Arc<std::os::fd::OwnedFd>);

impl PartialEq for PidFd {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for PidFd {}

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
}

/// Public, cheap-to-read state of a session (for listing and routing).
#[derive(Debug, Clone)]
pub struct Info {
    /// Cell running now.
    pub running_cell: Option<u64>,
    /// Cells finished.
    pub cells_run: u64,
    /// `starting`, `idle`, `running`, `ended`.
    pub state: &'static str,
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
    /// The session directory (issue #8: files in and out, see `files.rs`).
    pub dir: PathBuf,
    /// The worker's uid and gid (files the daemon stores there are theirs); `None` when the
    /// worker keeps the daemon's identity (development).
    pub worker_ids: Option<(u32, u32)>,
    /// Bumped after every change the daemon makes to the session directory (`PutFile`,
    /// `DeleteFile`), so the actor knows when its last listing is out of date.
    files_generation: std::sync::atomic::AtomicU64,
    cmds: mpsc::Sender<Command>,
    group: Arc<dyn SessionGroup>,
}

/// Called once when a session has released everything: (session id, reason).
pub type OnEnd = Box<dyn FnOnce(&str, &str) + Send>;

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
    /// End the session; `done` fires after everything is released.
    Close {
        /// Why (for the log and the D-Bus signal).
        reason: String,
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
    /// A session ended and everything it held is released.
    Closed {
        /// Session id.
        id: String,
        /// Why.
        reason: String,
    },
}

impl Session {
    /// Creates the session record and starts its actor. `spawned` must have said `Ready`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        id: String,
        language: Language,
        owner: Caller,
        detached_idle: Option<Duration>,
        engine: String,
        limits: SessionLimits,
        spawned: Spawned,
        group: Arc<dyn SessionGroup>,
        session_dir: PathBuf,
        uid: Option<UidLease>,
        permit: Permit,
        on_end: OnEnd,
        events: tokio::sync::broadcast::Sender<Event>,
    ) -> Arc<Session> {
        let (tx, rx) = mpsc::channel(16);
        let pid = spawned.pid;
        let session = Arc::new(Session {
            id: id.clone(),
            language,
            owner,
            detached_idle,
            started: SystemTime::now(),
            engine,
            pid,
            limits: limits.clone(),
            info: Mutex::new(Info {
                running_cell: None,
                cells_run: 0,
                state: "idle",
                last_activity: Instant::now(),
            }),
            dir: session_dir.clone(),
            worker_ids: uid.as_ref().map(|l| (l.uid(), l.uid())),
            files_generation: std::sync::atomic::AtomicU64::new(0),
            cmds: tx,
            group: group.clone(),
        });
        let oom_seen = group.oom_kills();
        let actor = Actor {
            session: session.clone(),
            child: spawned.child,
            pid,
            requests: spawned.requests,
            replies: spawned.replies,
            stdout: spawned.stdout,
            stderr: spawned.stderr,
            group,
            session_dir,
            uid,
            permit: Some(permit),
            next_cell: 1,
            ended: false,
            on_end: Some(on_end),
            events,
            known_files: None,
            oom_seen,
            deferred: None,
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
                "running" => return Err(ExecuteRefused::Busy(info.running_cell.unwrap_or(0))),
                "ended" => return Err(ExecuteRefused::Ended),
                _ => info.state = "running",
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

    /// Asks the actor to interrupt `cell`.
    pub async fn interrupt(&self, cell: u64) -> InterruptReply {
        let (tx, rx) = oneshot::channel();
        let gone = || InterruptReply {
            delivered: false,
            reason: "session_ending".into(),
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

    /// Ends the session and waits until everything is released.
    pub async fn close(&self, reason: &str) {
        let (tx, rx) = oneshot::channel();
        if self
            .cmds
            .send(Command::Close {
                reason: reason.into(),
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

    fn files_generation(&self) -> u64 {
        self.files_generation
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Memory charged to the session's cgroup now, bytes.
    pub fn memory_current(&self) -> Option<u64> {
        self.group.memory_current()
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

/// How the loop of one cell ended.
enum CellEnd {
    Done(WorkerMessage),
    /// The worker closed its reply pipe, died, or broke the protocol.
    WorkerGone(String),
    /// The daemon killed the worker after the grace period.
    Killed,
    /// The client went away or the session was closed.
    Cancelled(Option<(String, oneshot::Sender<()>)>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Interrupted,
    TimedOut,
}

struct Actor {
    session: Arc<Session>,
    child: tokio::process::Child,
    pid: u32,
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
}

impl Actor {
    async fn run(mut self, mut cmds: mpsc::Receiver<Command>) {
        let reason: String;
        let mut close_done: Option<oneshot::Sender<()>> = None;
        loop {
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
                continue;
            }
            let idle = self.session.detached_idle.map(|d| {
                let last = self.session.info.lock().unwrap().last_activity;
                tokio::time::Instant::from_std(last + d)
            });
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None => { reason = "abandoned".into(); break; }
                    Some(Command::Execute { code, frames, one_shot }) => {
                        if let Some(end) = self.execute_cell(code, frames, one_shot, &mut cmds).await {
                            reason = end.0;
                            close_done = end.1;
                            break;
                        }
                    }
                    Some(Command::Interrupt { reply, .. }) => {
                        let _ = reply.send(InterruptReply { delivered: false, reason: "not_running".into() });
                    }
                    Some(Command::Close { reason: r, done }) => { reason = r; close_done = Some(done); break; }
                },
                status = self.child.wait() => {
                    reason = format!("worker exited while idle ({})", status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()));
                    break;
                }
                _ = async { match idle { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                    reason = "idle timeout".into();
                    break;
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
                        reason: "session_ending".into(),
                    });
                }
                Command::Close { done, .. } => {
                    let _ = done.send(());
                }
                Command::Execute { .. } => {}
            }
        }
    }

    fn signal_interrupt(&self) {
        let pid = self.pid as libc::pid_t;
        // SAFETY: plain signal syscalls on our own child; pid is the worker's, still unreaped
        // (we hold its Child), so it cannot have been reused.
        unsafe {
            match self.session.language {
                // The whole process group: R ignores SIGINT while it waits for a system()
                // child, so the child must get it too. The launcher pins BLAS/OpenMP pools to
                // one thread, so R's main thread is the only one to take it (seed 001).
                Language::R => {
                    libc::kill(-pid, libc::SIGINT);
                }
                Language::Python => {
                    libc::kill(pid, libc::SIGINT);
                }
            }
        }
    }

    /// Runs one cell. Returns `Some((reason, close_waiter))` when the session ended with it.
    async fn execute_cell(
        &mut self,
        code: String,
        frames: mpsc::Sender<Frame>,
        one_shot: bool,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(String, Option<oneshot::Sender<()>>)> {
        let cell = self.next_cell;
        self.next_cell += 1;
        let limits = self.session.limits.clone();
        {
            let mut info = self.session.info.lock().unwrap();
            info.running_cell = Some(cell);
            info.state = "running";
        }
        let started = Frame {
            started: Some(Started {
                session: self.session.id.clone(),
                cell,
            }),
            ..Default::default()
        };
        let mut close_req: CloseRequest = None;
        let mut client_gone =
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
            info.state = "idle";
            info.last_activity = Instant::now();
            return None;
        }
        // The client went away and the cell was interrupted for that (`keep_session`).
        let mut abandoned = false;
        // Output waiting for a slow client; the cell's loop keeps serving deadlines, interrupts
        // and closes meanwhile (a client that stops reading must not stall its session).
        let mut backlog: std::collections::VecDeque<(Stream, String)> =
            std::collections::VecDeque::new();
        // issue #8: the session directory before the cell, to report what it changed: the
        // listing the last cell ended with, unless the daemon changed the directory since.
        // (A process a cell left running that writes between cells is reported with the next
        // cell: changes since the last report.)
        let generation = self.session.files_generation();
        let files_before = match self.known_files.take() {
            Some((g, listing)) if g == generation => Some(listing),
            _ => list_files(self.session_dir.clone()).await,
        };

        let mut header = RequestHeader::exec(cell, code.len() as u64);
        header.timeout_ms = Some(limits.wall.as_millis() as u64);
        header.fuel = Some(limits.fuel);
        header.max_output = Some(limits.stdout.max(limits.stderr));
        let mut request = header.to_line().into_bytes();
        request.extend_from_slice(code.as_bytes());
        drop(code);

        let cpu0 = proc_cpu_seconds(self.pid);
        let oom0 = self.oom_seen;
        let t0 = Instant::now();
        let mut caps = [StreamCap::new(limits.stdout), StreamCap::new(limits.stderr)];
        let mut seq = 0u64;
        let mut phase = Phase::Running;
        let mut deadline = tokio::time::Instant::from_std(t0 + limits.wall + limits.grace);
        // Once interrupted, SIGINT is repeated until the cell ends: a worker may discard one
        // that arrives before it has read the request (it cannot tell it from a stale one).
        let mut repeat = tokio::time::interval(Duration::from_millis(250));
        repeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut outbuf = vec![0u8; 64 * 1024];
        let mut errbuf = vec![0u8; 64 * 1024];
        // Per raw stream: when to read it next (it was readable), and whether its last read was
        // big (read again without waiting).
        let mut hold: [Option<tokio::time::Instant>; 2] = [None, None];
        let mut busy = [false; 2];
        let mut stale_frames = 0u64;

        let end = if client_gone {
            CellEnd::Cancelled(close_req.take())
        } else if let Err(e) = tokio::time::timeout(
            limits.wall + limits.grace,
            self.requests.write_all(&request),
        )
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        {
            CellEnd::WorkerGone(format!("writing the request: {e}"))
        } else {
            drop(request);
            loop {
                let mut pending: Vec<(Stream, String)> = Vec::new();
                let step: Option<CellEnd> = tokio::select! {
                    biased;
                    line = self.replies.next_line() => match line {
                        Ok(Some(l)) => match WorkerMessage::parse(&l) {
                            Ok(WorkerMessage::Output { cell: c, stream, data, bytes }) if c == cell => {
                                if let Some(t) = caps[idx(stream)].push_text(&data, bytes) { pending.push((stream, t)); }
                                None
                            }
                            Ok(WorkerMessage::Dropped { cell: c, stream, bytes }) if c == cell => {
                                caps[idx(stream)].push_dropped(bytes);
                                None
                            }
                            Ok(WorkerMessage::Output { .. } | WorkerMessage::Dropped { .. }) => { stale_frames += 1; None }
                            Ok(m @ WorkerMessage::Done { cell: c, .. }) if c == cell => Some(CellEnd::Done(m)),
                            Ok(other) => Some(CellEnd::WorkerGone(format!("protocol violation: unexpected {}", kind(&other)))),
                            Err(e) => Some(CellEnd::WorkerGone(format!("protocol violation: {e}"))),
                        },
                        Ok(None) => Some(CellEnd::WorkerGone("worker closed its reply pipe".into())),
                        Err(e) => Some(CellEnd::WorkerGone(format!("protocol violation: {e}"))),
                    },
                    // Raw output pipes (R writes each piece of a `cat` separately): the first
                    // bytes after a quiet spell are read OUTPUT_COALESCE later, together with
                    // what follows them; a busy stream is read at once.
                    ready = ready_opt(&self.stdout), if hold[0].is_none() => {
                        match ready {
                            true => hold[0] = Some(next_read(busy[0])),
                            false => self.stdout = None,
                        }
                        None
                    }
                    ready = ready_opt(&self.stderr), if hold[1].is_none() => {
                        match ready {
                            true => hold[1] = Some(next_read(busy[1])),
                            false => self.stderr = None,
                        }
                        None
                    }
                    _ = tokio::time::sleep_until(hold.iter().flatten().min().copied().unwrap_or(deadline)), if hold.iter().any(Option::is_some) => {
                        let now = tokio::time::Instant::now();
                        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
                            if hold[i].is_some_and(|t| t <= now) {
                                hold[i] = None;
                                let (rx, buf) = if i == 0 { (&mut self.stdout, &mut outbuf) } else { (&mut self.stderr, &mut errbuf) };
                                let n = drain_pipe(rx, buf, &mut caps[i], stream, &mut pending, 16);
                                busy[i] = n >= BUSY_STREAM_BYTES;
                            }
                        }
                        None
                    }
                    _ = repeat.tick(), if phase != Phase::Running => {
                        self.signal_interrupt();
                        None
                    }
                    _ = tokio::time::sleep_until(deadline) => {
                        if phase == Phase::Running {
                            // Wall time plus grace is over and the worker's own limit did not end
                            // the cell: interrupt, then kill after another grace.
                            self.signal_interrupt();
                            phase = Phase::TimedOut;
                            deadline = tokio::time::Instant::now() + limits.grace;
                            None
                        } else {
                            Some(CellEnd::Killed)
                        }
                    }
                    cmd = cmds.recv() => match cmd {
                        Some(Command::Interrupt { cell: c, reply }) => {
                            let r = if c != cell {
                                InterruptReply { delivered: false, reason: "other_cell".into() }
                            } else if phase != Phase::Running {
                                InterruptReply { delivered: false, reason: "already_interrupted".into() }
                            } else {
                                self.signal_interrupt();
                                phase = Phase::Interrupted;
                                // Documented escalation: a cell that ignores SIGINT (native code,
                                // BLAS) is killed after the grace, and the session ends.
                                deadline = tokio::time::Instant::now() + limits.grace;
                                InterruptReply { delivered: true, reason: "delivered".into() }
                            };
                            let _ = reply.send(r);
                            None
                        }
                        Some(Command::Close { reason, done }) => Some(CellEnd::Cancelled(Some((reason, done)))),
                        Some(Command::Execute { .. }) => None, // refused by Session::execute
                        None => Some(CellEnd::Cancelled(None)),
                    },
                    permit = frames.reserve(), if !backlog.is_empty() && !abandoned => match permit {
                        Ok(p) => {
                            if let Some((stream, text)) = backlog.pop_front() {
                                p.send(output_frame(cell, seq, stream, text));
                                seq += 1;
                            }
                            None
                        }
                        Err(_) => { client_gone = true; None }
                    },
                    _ = frames.closed(), if !abandoned => { client_gone = true; None }
                    status = self.child.wait() => Some(CellEnd::WorkerGone(format!("worker exited ({})", status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())))),
                };
                // Output of an abandoned cell has nobody to go to.
                for (stream, text) in pending.into_iter().filter(|_| !abandoned) {
                    queue_output(&mut backlog, stream, text);
                }
                // Hand over what the channel takes now; the rest waits for the reserve branch.
                // While the worker's next message is already buffered, read it first: output
                // chunks merge, and a cell's last output leaves together with its result.
                let more_buffered = step.is_none() && !client_gone && self.replies.has_line();
                while !more_buffered && let Some((stream, text)) = backlog.pop_front() {
                    match frames.try_send(output_frame(cell, seq, stream, text)) {
                        Ok(()) => seq += 1,
                        Err(mpsc::error::TrySendError::Full(f)) => {
                            let text = f.output.map(|o| o.text).unwrap_or_default();
                            backlog.push_front((stream, text));
                            break;
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => {
                            client_gone = true;
                            break;
                        }
                    }
                }
                if let Some(end) = step {
                    break end;
                }
                if client_gone && !abandoned {
                    if !keep_session {
                        break CellEnd::Cancelled(None);
                    }
                    abandoned = true;
                    backlog.clear();
                    if phase == Phase::Running {
                        self.signal_interrupt();
                        phase = Phase::Interrupted;
                        deadline = tokio::time::Instant::now() + limits.grace;
                    }
                    tracing::info!(session = %self.session.id, cell, "client gone during the cell: interrupting it, the session stays");
                }
            }
        };

        // Output written before the worker's reply is already in the pipes: take it, bounded.
        if matches!(end, CellEnd::Done(_)) {
            let mut late: Vec<(Stream, String)> = Vec::new();
            for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
                let (rx, buf) = if i == 0 {
                    (&mut self.stdout, &mut outbuf)
                } else {
                    (&mut self.stderr, &mut errbuf)
                };
                drain_pipe(rx, buf, &mut caps[i], stream, &mut late, 1024);
            }
            for (stream, text) in late {
                queue_output(&mut backlog, stream, text);
            }
        }
        for (i, cap) in caps.iter_mut().enumerate() {
            if let Some(t) = cap.finish() {
                let stream = if i == 0 {
                    Stream::Stdout
                } else {
                    Stream::Stderr
                };
                queue_output(&mut backlog, stream, t);
            }
        }
        let cancelled = matches!(end, CellEnd::Cancelled(_));
        if cancelled {
            close_req.get_or_insert(("cancelled".into(), oneshot::channel().0));
        }
        if stale_frames > 0 {
            tracing::debug!(session = %self.session.id, cell, stale_frames, "stale output frames counted, not forwarded");
        }

        let mut usage = Usage {
            wall_seconds: t0.elapsed().as_secs_f64(),
            cpu_seconds: proc_cpu_seconds(self.pid)
                .zip(cpu0)
                .map(|(a, b)| (a - b).max(0.0)),
            peak_memory_bytes: self.group.memory_peak(),
            fuel: None,
        };
        let mut result = CellResult {
            cell,
            status: Status::Ok,
            error: None,
            exit_code: None,
            usage: Usage::default(),
            stdout: caps[0].stats(),
            stderr: caps[1].stats(),
            state: State::Kept,
            session_ended: false,
            warnings: Vec::new(),
            files: Vec::new(),
        };
        let mut ending: Option<(String, Option<oneshot::Sender<()>>)> = None;
        match end {
            CellEnd::Done(WorkerMessage::Done {
                status,
                error,
                exit_code,
                fuel,
                state,
                warnings,
                ..
            }) => {
                usage.fuel = fuel;
                result.status = match (status, phase) {
                    (WorkerStatus::Interrupted | WorkerStatus::Timeout, Phase::TimedOut) => {
                        Status::Timeout
                    }
                    (WorkerStatus::Ok, _) => Status::Ok,
                    (WorkerStatus::Error, _) => Status::Error,
                    (WorkerStatus::Interrupted, _) => Status::Interrupted,
                    (WorkerStatus::Timeout, _) => Status::Timeout,
                    (WorkerStatus::FuelExhausted, _) => Status::FuelExhausted,
                    (WorkerStatus::MemoryExhausted, _) => Status::MemoryExhausted,
                    (WorkerStatus::Exited, _) => Status::Exited,
                };
                result.error = error;
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
                    && let Ok(Ok(_)) =
                        tokio::time::timeout(Duration::from_millis(500), self.child.wait()).await
                {
                    self.kill_and_reap().await;
                    result.state = State::Lost;
                    result.session_ended = true;
                    ending = Some(("the cell ended the interpreter".into(), None));
                }
            }
            CellEnd::Done(_) => unreachable!("only Done messages end a cell"),
            CellEnd::Killed | CellEnd::WorkerGone(_) | CellEnd::Cancelled(_) => {
                // The worker is gone or must go: kill the whole group, reap, then decide.
                self.kill_and_reap().await;
                let oom = self.group.oom_kills() > oom0;
                let (status, why) = match &end {
                    _ if oom => (
                        Status::Oom,
                        "worker OOM-killed at its cgroup memory limit".to_string(),
                    ),
                    CellEnd::Killed if phase == Phase::TimedOut => (
                        Status::Timeout,
                        "cell ignored the interrupt at its wall time; worker killed".into(),
                    ),
                    CellEnd::Killed => (
                        Status::Interrupted,
                        "cell ignored the interrupt; worker killed".into(),
                    ),
                    CellEnd::Cancelled(Some((r, _))) => (Status::Cancelled, r.clone()),
                    CellEnd::Cancelled(None) => (Status::Cancelled, "client disconnected".into()),
                    CellEnd::WorkerGone(why) => (Status::WorkerCrashed, why.clone()),
                    CellEnd::Done(_) => unreachable!(),
                };
                if oom {
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
                ending = Some(match end {
                    CellEnd::Cancelled(Some((r, done))) => (r, Some(done)),
                    _ => (why, None),
                });
                usage.peak_memory_bytes = self.group.memory_peak().or(usage.peak_memory_bytes);
            }
        }
        if one_shot {
            result.state = State::None;
            result.session_ended = true;
            ending.get_or_insert(("one-shot run finished".into(), None));
        }
        result.usage = usage;
        // issue #8: entries of the session directory the cell created or changed.
        let generation = self.session.files_generation();
        let (files, dir_bytes, crowded, after) =
            cell_files(self.session_dir.clone(), files_before).await;
        result.files = files;
        self.known_files = after.map(|l| (generation, l));
        // A cell writes the directory directly (R, and Python through /mnt/data), so the
        // session's disk budget is checked after every cell. Over it, or with more entries
        // than a listing can see, the session ends and its directory is removed: the safe
        // side, since nothing else bounds a cell's disk use.
        if ending.is_none() && (dir_bytes > limits.files_bytes || crowded) {
            self.kill_and_reap().await;
            result.state = State::Lost;
            result.session_ended = true;
            let why = if crowded {
                "the session directory holds more entries than sandcell lists (1000)".to_string()
            } else {
                format!(
                    "the session directory holds {dir_bytes} bytes, over max_session_files_bytes ({})",
                    limits.files_bytes
                )
            };
            result.warnings.push(format!(
                "{why}; the session ended and its files were removed"
            ));
            ending = Some((why, None));
        }
        let status = result.status;
        let wall = result.usage.wall_seconds;
        // The rest of the output, in order, right before the result, so the connection writes
        // them together (one write, one wake-up of the client for a short cell). A cell that was
        // cancelled (client gone, session closed) waits for nobody: it gets no more frames.
        while let Some((stream, text)) = backlog.pop_front() {
            let f = output_frame(cell, seq, stream, text);
            seq += 1;
            if !send_or_command(&frames, f, cmds, &mut close_req, &mut self.deferred).await {
                backlog.clear();
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
            info.state = if ending.is_some() { "ended" } else { "idle" };
        }
        if cancelled {
            let _ = frames.try_send(result_frame);
            close_req = None;
        } else {
            let _ = send_or_command(
                &frames,
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
            self.session.info.lock().unwrap().state = "ended";
        }
        // Bookkeeping after the result is on its way.
        tracing::info!(session = %self.session.id, uid = self.session.owner.uid, cell, status = status.as_str(), wall, "cell finished");
        if ending.is_none() {
            // A cell's child process (R's system()) can be OOM-killed without ending the
            // session; count it here so a later death is not blamed on it.
            self.oom_seen = self.group.oom_kills();
        }
        let _ = self.events.send(Event::CellFinished {
            id: self.session.id.clone(),
            cell,
            status,
        });
        ending
    }

    async fn kill_and_reap(&mut self) {
        crate::worker::kill_and_reap(self.pid, &mut self.child, &self.group).await;
    }

    /// Releases everything, in the order of the module documentation. Idempotent.
    async fn shutdown(&mut self, reason: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.session.info.lock().unwrap().state = "ended";
        // Ask politely first only when idle: there is nothing worth saving, so just kill.
        self.kill_and_reap().await;
        crate::worker::remove_remains(
            &self.session.id,
            self.group.clone(),
            self.session_dir.clone(),
        )
        .await;
        self.uid.take();
        self.permit.take();
        tracing::info!(session = %self.session.id, uid = self.session.owner.uid, reason, "session closed");
        if let Some(f) = self.on_end.take() {
            f(&self.session.id, reason);
        }
        let _ = self.events.send(Event::Closed {
            id: self.session.id.clone(),
            reason: reason.to_owned(),
        });
    }
}

/// Files a cell leaves in the session directory (issue #8): a bounded lstat-only listing of
/// `dir`; `None` if it cannot be read.
async fn list_files(dir: PathBuf) -> Option<crate::files::Listing> {
    tokio::task::spawn_blocking(move || crate::files::list(&dir).ok())
        .await
        .ok()
        .flatten()
}

/// Entries of `dir` created or changed since `before` (empty when either listing failed), the
/// directory's bytes of regular files afterwards, whether the listing was cut short, and the
/// listing itself (the next cell's "before").
async fn cell_files(
    dir: PathBuf,
    before: Option<crate::files::Listing>,
) -> (
    Vec<sandcell_proto::kernel::FileInfo>,
    u64,
    bool,
    Option<crate::files::Listing>,
) {
    let Some(after) = list_files(dir).await else {
        return (Vec::new(), 0, false, None);
    };
    let bytes = after.regular_bytes();
    let changed = before.map(|b| after.changed_since(&b)).unwrap_or_default();
    (changed, bytes, after.truncated, Some(after))
}

/// A Close that arrived while a frame waited for a slow client: (reason, waiter).
type CloseRequest = Option<(String, oneshot::Sender<()>)>;

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
                    let _ = reply.send(InterruptReply { delivered: false, reason: "not_running".into() });
                }
                Some(Command::Close { reason, done }) => {
                    *close = Some((reason, done));
                    return false;
                }
                // Admitted only once the session is idle, i.e. while the result waits.
                Some(cmd @ Command::Execute { .. }) => *deferred = Some(cmd),
                None => {
                    *close = Some(("abandoned".into(), oneshot::channel().0));
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

/// Appends output to the backlog of frames waiting for the client, merging with the last
/// chunk of the same stream (the backlog is bounded by the output caps).
fn queue_output(
    backlog: &mut std::collections::VecDeque<(Stream, String)>,
    stream: Stream,
    text: String,
) {
    if let Some((s, t)) = backlog.back_mut()
        && *s == stream
        && t.len() + text.len() <= sandcell_proto::worker::MAX_OUTPUT_CHUNK
    {
        t.push_str(&text);
        return;
    }
    backlog.push_back((stream, text));
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
        WorkerMessage::Done { .. } => "done for another cell",
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

/// Reads what `rx` holds now, at most `max_reads` reads of `buf`'s size, through `cap` into
/// `out`; closes `rx` at end of file. Returns the bytes read.
fn drain_pipe(
    rx: &mut Option<pipe::Receiver>,
    buf: &mut [u8],
    cap: &mut StreamCap,
    stream: Stream,
    out: &mut Vec<(Stream, String)>,
    max_reads: usize,
) -> usize {
    let mut total = 0;
    for _ in 0..max_reads {
        let Some(r) = rx.as_mut() else { break };
        match r.try_read(buf) {
            Ok(0) => {
                *rx = None;
                break;
            }
            Ok(n) => {
                total += n;
                if let Some(t) = cap.push_bytes(&buf[..n]) {
                    out.push((stream, t));
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
