//! The session's actor: the task that owns the worker, its pipes, cgroup, directory, uid and
//! admission permit, and its state machine ([`Actor::run`]): idle, it waits for a command, the
//! worker's exit or the idle watch (`idle.rs`); an `Execute` runs one cell
//! ([`Actor::execute_cell`]: the request, then the cell's loop in `cell.rs` and its end in
//! `cell_end.rs`); an `Inspect` asks the idle worker for its variables; every way out ends in
//! [`Actor::shutdown`], which releases everything in the order the session module states.

use super::*;

/// Most commands an actor keeps unanswered between its session's hand-over and the daemon's
/// exit ([`Actor::hold_until_exit`]); later ones are dropped (their callers are told the
/// session ended, which the exit makes moot).
const HELD_AT_EXIT: usize = 16;

pub(super) struct Actor {
    pub(super) session: Arc<Session>,
    pub(super) child: crate::worker::process::WorkerProcess,
    /// The worker's pid (for `/proc` reads; never signalled once the child is reaped).
    pub(super) pid: u32,
    /// The worker's pidfd, when the kernel gave one.
    pub(super) pidfd: Option<crate::worker::WorkerPidfd>,
    pub(super) requests: pipe::Sender,
    pub(super) replies: LineReader<pipe::Receiver>,
    pub(super) stdout: Option<pipe::Receiver>,
    pub(super) stderr: Option<pipe::Receiver>,
    pub(super) group: Arc<dyn SessionGroup>,
    pub(super) session_dir: PathBuf,
    pub(super) uid: Option<UidLease>,
    pub(super) permit: Option<Permit>,
    pub(super) next_cell: u64,
    pub(super) ended: bool,
    pub(super) on_end: Option<OnEnd>,
    pub(super) events: tokio::sync::broadcast::Sender<Event>,
    /// The session directory as the last cell left it, with the files generation it was
    /// taken at: the next cell's "before" listing when nothing has changed since, so a cell
    /// does not wait for a directory walk before its request reaches the worker.
    pub(super) known_files: Option<(u64, crate::files::Listing)>,
    /// OOM kills of the session's group already accounted for (read after each cell, off the
    /// reply path; compared when a worker dies).
    pub(super) oom_seen: u64,
    /// An `Execute` admitted while the previous result waited for its reader (at most one:
    /// admission marks the session running); run before the next command.
    pub(super) deferred: Option<Command>,
    /// Where an interrupt is aimed (the worker kind decides).
    pub(super) interrupt: crate::worker::InterruptTarget,
    /// The worker's output travels on raw stdout/stderr pipes (native R and Python), so an
    /// `output`/`dropped` frame from it is a protocol violation.
    pub(super) raw_output: bool,
    /// Processes the last cell left running, killed at its end: zombies until their parent
    /// (init, for an orphan) reaps them, and until then they count against `pids.max`. The
    /// next cell waits for them first ([`cell_end::LEFTOVER_REAP_TIMEOUT`] at most).
    pub(super) leftovers: Vec<crate::cgroup::Leftover>,
    /// Id of the session's last host call (0: none yet); the next must be one more.
    pub(super) host_calls_made: u64,
    /// The disk watch between cells (see [`DISK_IDLE_WATCH`]): when the session directory is
    /// totalled next, and the walk in flight with its start. A cell takes the walk in flight
    /// over and hands back the one it leaves, so a session never walks twice at once.
    pub(super) disk_next: tokio::time::Instant,
    pub(super) disk_scan: Option<(Instant, tokio::task::JoinHandle<u64>)>,
    /// The session's keeper and record, when sessions are kept for adoption (`keep.rs`).
    pub(super) kept: Option<keep::Kept>,
    /// The running cell as its record tells a successor (`keep.rs`): set once its request
    /// reached the worker, updated when its escalation or host call changes, cleared at its
    /// end.
    pub(super) running: Option<crate::records::RunningCell>,
    /// Where the cell in `info.running_cell` is while `running` does not describe it (before
    /// its request reached the worker, after its end), as its record tells a successor.
    pub(super) pending: Option<crate::records::PendingCell>,
    /// The cell a predecessor daemon was running: continued before anything else.
    pub(super) resume: Option<keep::Resume>,
    /// A duplicate of the session's granted egress listener and the hosts of its grant: the
    /// keeper holds it and the record names the hosts, so a successor grants it again.
    pub(super) egress: Option<(std::os::fd::OwnedFd, Vec<String>)>,
}

impl Actor {
    pub(super) async fn run(mut self, mut cmds: mpsc::Receiver<Command>) {
        let reason: Ending;
        let mut close_done: Option<oneshot::Sender<()>> = None;
        let mut stages = crate::stages::Stages::new();
        self.start_keeper().await;
        // An adopted session's record is already there, and one continuing a cell is
        // rewritten only once that cell is resumed (`resume_cell`).
        if self.resume.is_none() {
            self.persist();
        }
        self.session.recorded.send_replace(true);
        stages.mark("keeper");
        stages.log("actor_start", &self.session.id);
        loop {
            if let Some(r) = self.resume.take() {
                if let Some(end) = self.resume_cell(r, &mut cmds).await {
                    reason = end.0;
                    close_done = end.1;
                    break;
                }
                self.disk_next = tokio::time::Instant::now() + DISK_IDLE_WATCH;
            }
            self.persist();
            if let Some(Command::Execute {
                code,
                frames,
                one_shot,
                retained,
                token,
            }) = self.deferred.take()
            {
                if let Some(end) = self
                    .execute_cell(code, frames, one_shot, retained, token, &mut cmds)
                    .await
                {
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
                    Some(Command::Execute { code, frames, one_shot, retained, token }) => {
                        if let Some(end) = self.execute_cell(code, frames, one_shot, retained, token, &mut cmds).await {
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
                    Some(Command::HandOver { done }) => { let _ = done.send(()); }
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
        let mut stages = crate::stages::Stages::new();
        self.shutdown(&reason, &mut stages).await;
        stages.log("shutdown", &self.session.id);
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
                Command::HandOver { done } => {
                    let _ = done.send(());
                }
                Command::Execute { .. } => {}
            }
        }
    }

    /// After [`Session::hand_over`], instead of a cell: keeps `call` (the cell's frame sender,
    /// or the whole cell) unanswered until the daemon's exit cuts its caller's connection,
    /// and answers only what the exit path waits for (`HandOver`) or what needs no cell
    /// (`Interrupt`: not running; `HostReply`: no call waits). Never returns.
    async fn hold_until_exit<T: Send>(
        &mut self,
        call: T,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let _call = call;
        // Commands whose callers get no answer either; the session is Running, so Session
        // refuses Execute, Inspect and Query before they reach the actor, and these few are
        // bounded by the exit that follows within the hand-over's 2 s.
        let mut held: Vec<Command> = Vec::new();
        while let Some(cmd) = cmds.recv().await {
            match cmd {
                Command::HandOver { done } => {
                    let _ = done.send(());
                }
                Command::Interrupt { reply, .. } => {
                    let _ = reply.send(InterruptReply {
                        delivered: false,
                        reason: InterruptReason::NotRunning.into(),
                    });
                }
                Command::HostReply { reply, .. } => {
                    let _ = reply.send(false);
                }
                other if held.len() < HELD_AT_EXIT => held.push(other),
                _ => {}
            }
        }
        std::future::pending().await
    }

    pub(super) fn signal_interrupt(&self) {
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
        retained: bool,
        token: Option<String>,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        if self.session.handed_over() {
            return self.hold_until_exit(frames, cmds).await;
        }
        let mut stages = crate::stages::Stages::new();
        let cell = self.next_cell;
        self.next_cell += 1;
        {
            let mut info = self.session.info.lock().unwrap();
            info.running_cell = Some(cell);
            info.cells_started = cell;
            info.state = SessionState::Running;
            if let Some(t) = token {
                remember_token(&mut info.tokens, cell, t);
            }
        }
        self.pending = Some(crate::records::PendingCell {
            stage: crate::records::PendingStage::BeforeRequest,
            one_shot,
        });
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
        stages.mark("started");
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
            // It never ran: a repeat of its call runs it.
            info.tokens.retain(|(c, _)| *c != cell);
            drop(info);
            self.pending = None;
            self.persist();
            return None;
        }
        // The session directory before the cell, to report what it changed: the listing the
        // last cell ended with, unless the daemon changed the directory since.
        let generation = self.session.files_generation();
        let files_before = match self.known_files.take() {
            Some((g, listing)) if g == generation => Some(listing),
            _ => list_files(self.session.dir.clone()).await,
        };
        stages.mark("files_before");
        let limits = self.session.limits.clone();
        self.wait_leftovers_reaped().await;
        // `usage.peak_memory_bytes` is this cell's peak where the kernel can reset it.
        self.group.reset_memory_peak();
        stages.mark("leftovers");
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
        run.stages = stages;
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
            keep::kill_seam("before_request", cell);
            if self.session.handed_over() {
                // The record says the request was not written (`BeforeRequest`): the
                // successor adopts the session idle at once.
                return self.hold_until_exit(run, cmds).await;
            }
            let wait = limits.wall + limits.grace;
            match self
                .write_request(&mut run, &request, retained, files_before.as_ref(), wait)
                .await
            {
                Err(e) => CellEnd::WorkerGone(format!("writing the request: {e}")),
                Ok(()) => {
                    drop(request);
                    run.stages.mark("request");
                    let end = self.cell_loop(&mut run, cmds).await;
                    run.stages.mark("cell");
                    end
                }
            }
        };
        run.stages.mark("record_end");
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
    pub(super) async fn inspect(
        &mut self,
        max_items: u64,
        reply: oneshot::Sender<Result<InspectReply, InspectRefused>>,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        if let Err(why) = self.drain_stale() {
            return query::refuse("Inspect", reply, why);
        }
        let nonce = match new_nonce() {
            Ok(n) => n,
            Err(e) => {
                let why = format!("no random nonce for the request: {e}");
                return query::refuse("Inspect", reply, why);
            }
        };
        let mut header = RequestHeader::exec(0, 0);
        header.op = wire::Op::Inspect;
        header.timeout_ms = Some(wire::INSPECT_BUDGET_MS);
        header.max_items = Some(max_items);
        header.nonce = Some(nonce.clone());
        let deadline = Duration::from_millis(wire::INSPECT_DEADLINE_MS);
        let request = header.to_line().into_bytes();
        self.ask_worker("Inspect", request, deadline, reply, cmds, |line| {
            check_inspected(line, &nonce, max_items)
        })
        .await
    }

    /// Empties the worker's pipes before a request is written, without blocking. Bytes on the
    /// reply pipe are a protocol violation (a worker writes nothing between cells; a process
    /// a previous cell left behind may have); bytes on the raw output pipes are discarded
    /// (what a cell left running writes there between cells: a process before the end-of-cell
    /// sweep stopped it, or a thread of a native Python worker) and logged.
    ///
    /// Errors: the violation, or the pipe's end, as the reason the worker ends.
    pub(super) fn drain_stale(&mut self) -> Result<(), String> {
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

    pub(super) async fn kill_and_reap(&mut self) {
        self.child
            .kill_and_reap(self.pidfd.as_ref(), &self.group)
            .await;
    }

    /// Releases everything, in the order of the module documentation. Idempotent.
    pub(super) async fn shutdown(&mut self, reason: &Ending, stages: &mut crate::stages::Stages) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.session.info.lock().unwrap().state = SessionState::Ended;
        // The keeper exits without waiting for an adopter; the record goes.
        self.end_keeper();
        stages.mark("end_keeper");
        // Ask politely first only when idle: there is nothing worth saving, so just kill.
        self.kill_and_reap().await;
        stages.mark("kill_reap");
        self.reap_keeper().await;
        stages.mark("reap_keeper");
        crate::worker::remove_remains(
            &self.session.id,
            self.group.clone(),
            self.session_dir.clone(),
        )
        .await;
        stages.mark("remains");
        self.uid.take();
        self.permit.take();
        stages.mark("release");
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

/// Adds `cell`'s `token` to `tokens` (oldest first), dropping the oldest past
/// [`sandcell_proto::kernel::CELL_TOKENS_KEPT`] and any older cell with the same token (the
/// newest cell answers a repeat).
pub(super) fn remember_token(tokens: &mut Vec<(u64, String)>, cell: u64, token: String) {
    tokens.retain(|(_, t)| *t != token);
    tokens.push((cell, token));
    let over = tokens
        .len()
        .saturating_sub(sandcell_proto::kernel::CELL_TOKENS_KEPT);
    tokens.drain(..over);
}

/// A fresh request nonce: 64 bits from `getrandom(2)` as 16 lowercase hex digits.
///
/// Errors: the kernel's random source failed.
pub(super) fn new_nonce() -> std::io::Result<String> {
    crate::sys::random_hex(wire::NONCE_HEX_LEN / 2)
}

/// How a worker ended, for a crash report: "was killed by signal 9 (SIGKILL)" or "exited with
/// status 2".
pub(super) fn describe_exit(st: std::process::ExitStatus) -> String {
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
pub(super) const KILL_AFTER_SIGINT_MIN: Duration = Duration::from_millis(100);

/// How often an unanswered `Inspect` repeats its SIGINT (as a cell's interrupt does).
pub(super) const INTERRUPT_REPEAT: Duration = Duration::from_millis(250);

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
pub(super) type CloseRequest = Option<(Ending, oneshot::Sender<()>)>;

/// Sends `frame`, still answering commands while the client is slow to read: an interrupt is
/// reported undelivered (the cell is over or not yet started), a Close stops the wait and is
/// kept in `close`, an Execute (admitted once the session went idle, before its result was
/// read) is kept in `deferred`. Returns false when the frame was not sent.
pub(super) async fn send_or_command(
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
                // The cell is over: nothing to hand over.
                Some(Command::HandOver { done }) => {
                    let _ = done.send(());
                }
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
