//! The running cell: [`CellRun`], the state one cell's event handlers share, and
//! [`Actor::cell_loop`], its event loop, with one handler per event (commands, the deadline
//! and its interrupt escalation, the client's channel, the worker's reply lines and raw output
//! pipes, host calls, the disk watch, the worker's exit). Each handler does a bounded amount
//! of work; output waits in a bounded backlog for a slow client.

use super::*;

/// How the loop of one cell ended.
pub(super) enum CellEnd {
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
pub(super) enum Phase {
    Running,
    Interrupted,
    TimedOut,
}

/// The state of one running cell: everything its event handlers share.
pub(super) struct CellRun {
    pub(super) cell: u64,
    /// The request's nonce, which the worker's `done` must echo.
    pub(super) nonce: String,
    /// Where frames go; dropping the receiver means the client is gone.
    pub(super) frames: mpsc::Sender<Frame>,
    /// False for a one-shot Run: a client gone ends it instead of abandoning the cell.
    pub(super) keep_session: bool,
    pub(super) grace: Duration,
    pub(super) caps: [StreamCap; 2],
    /// Display bundles: `None` without `rich_output`, else bytes seen and kept.
    pub(super) displays: Option<(u64, u64)>,
    /// Sequence number of the next output frame.
    pub(super) seq: u64,
    pub(super) phase: Phase,
    /// The cell's wall time: past it the cell is interrupted ([`WALL_SLACK`] later) and its
    /// result is `timeout`, however it ends.
    pub(super) wall: Duration,
    /// When the next escalation is due: the first SIGINT (wall time plus [`WALL_SLACK`]), or
    /// the kill (wall time plus grace, or grace after an `Interrupt`).
    pub(super) deadline: tokio::time::Instant,
    /// Once interrupted, SIGINT is repeated until the cell ends: a worker may discard one
    /// that arrives before it has read the request (it cannot tell it from a stale one).
    pub(super) repeat: tokio::time::Interval,
    /// Per raw stream: when to read it next (it was readable).
    pub(super) hold: [Option<tokio::time::Instant>; 2],
    /// Per raw stream: whether its last read was big (read again without waiting).
    pub(super) busy: [bool; 2],
    /// Output waiting for a slow client; the loop keeps serving deadlines, interrupts and
    /// closes meanwhile (a client that stops reading must not stall its session).
    pub(super) backlog: Backlog,
    pub(super) client_gone: bool,
    /// The client went away and the cell was interrupted for that (`keep_session`): its
    /// output has nobody to go to.
    pub(super) abandoned: bool,
    pub(super) buf: Vec<u8>,
    pub(super) t0: Instant,
    pub(super) cpu0: Option<f64>,
    pub(super) oom0: u64,
    /// The disk watch: when the session directory is totalled next, and the walk in flight
    /// (on the blocking pool) with its start.
    pub(super) disk_next: tokio::time::Instant,
    pub(super) disk_scan: Option<(Instant, tokio::task::JoinHandle<u64>)>,
    /// The host call waiting for the client's `HostReply`: its id and when it times out.
    pub(super) host: Option<(u64, tokio::time::Instant)>,
    /// A `host_call` frame waiting for room in the client's channel (after the output before it).
    pub(super) host_frame: Option<Frame>,
    /// Bytes for the request pipe (answers to host calls), written as the pipe takes them.
    pub(super) to_worker: Vec<u8>,
    /// When the cell started, ms since the Unix epoch (its wall time counts from here across
    /// a daemon restart).
    pub(super) started_unix_ms: u64,
    /// The journal of a retained cell whose session is kept for a successor (`journal.rs`).
    pub(super) journal: Option<journal::Journal>,
    /// The spool its pipes are read through (`spool.rs`), with the journal.
    pub(super) spool: Option<spool::Spool>,
    /// The spool offsets the journal recorded last (all `u64::MAX` before the first batch).
    pub(super) spooled_at: [u64; 3],
    /// Bytes of output frames sent per stream (what the relay's retention has seen).
    pub(super) sent: [u64; 2],
    /// The caps' bytes seen at the last journal commit, and when it was.
    pub(super) committed: (u64, Instant),
    /// A cell continued after a daemon restart whose first reply line is not read yet: the
    /// predecessor may have died in the middle of a frame, so that line may be a frame's
    /// tail (`keep.rs`, `Actor::resume_cell`).
    pub(super) resync: bool,
    /// The first reply line after the restart was not a whole frame (its bytes): the cell's
    /// stream could not be resumed exactly, and the cell was interrupted.
    pub(super) stream_cut: Option<usize>,
    /// Warnings the result carries (a daemon restart during the cell).
    pub(super) notes: Vec<String>,
    /// The daemon exits keeping its sessions: hand the cell over, then stop.
    pub(super) hand_over: Option<oneshot::Sender<()>>,
    /// The cell's stage timings (a debug line at its end: `crate::stages`).
    pub(super) stages: crate::stages::Stages,
}

impl CellRun {
    pub(super) fn new(
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
            started_unix_ms: crate::records::unix_ms(SystemTime::now()),
            journal: None,
            spool: None,
            spooled_at: [u64::MAX; 3],
            sent: [0; 2],
            committed: (0, t0),
            resync: false,
            stream_cut: None,
            notes: Vec::new(),
            hand_over: None,
            stages: crate::stages::Stages::new(),
        }
    }

    /// The journal's counts now.
    pub(super) fn counts(&self) -> journal::Counts {
        journal::Counts {
            next_seq: self.seq + self.backlog.sealed as u64,
            unsent: self.backlog.unsealed_bytes() as u64,
            caps: [self.caps[0].snapshot(), self.caps[1].snapshot()],
            displays: self.displays,
            sent: self.sent,
        }
    }

    /// Ends the journal's batch when frames went into it, or when output was counted since
    /// the last commit and that was at least [`JOURNAL_COUNTS_EVERY`] ago.
    pub(super) fn commit_journal(&mut self, frames: bool) {
        if self.journal.is_none() {
            return;
        }
        let seen = self.caps[0]
            .stats()
            .seen
            .saturating_add(self.caps[1].stats().seen);
        if !frames
            && (seen == self.committed.0 || self.committed.1.elapsed() < JOURNAL_COUNTS_EVERY)
        {
            return;
        }
        let counts = self.counts();
        if let Some(j) = self.journal.as_mut() {
            j.commit(&counts);
        }
        self.committed = (seen, Instant::now());
    }

    /// A spooled cell (`spool.rs`): the output its backlog holds and has not journaled goes
    /// into the journal as the frames it becomes (numbered now; sent as the client takes
    /// them), in one batch with the spool offsets handled so far (`replies_held`: reply
    /// bytes the reader holds and has not handled) and the caps' state. Called at the end of
    /// every turn of the cell's loop, before anything is sent: a frame a client sees is
    /// always in the journal, and what a successor reads again from the spools was never
    /// journaled. Writes nothing when nothing changed.
    pub(super) fn seal(&mut self, replies_held: usize) {
        let Some(sp) = self.spool.as_ref() else {
            return;
        };
        if !self.journal.as_ref().is_some_and(|j| j.is_live()) {
            self.end_spool("the journal ended");
            return;
        }
        let at = [
            sp.read(0),
            sp.read(1),
            sp.read(spool::REPLIES).saturating_sub(replies_held as u64),
        ];
        if self.backlog.sealed == self.backlog.chunks.len() && at == self.spooled_at {
            return;
        }
        self.seal_backlog();
        if let Some(j) = self.journal.as_mut() {
            j.set_spool(at);
        }
        self.commit_journal(true);
        self.spooled_at = at;
        if let Some(sp) = self.spool.as_mut() {
            sp.release(at);
        }
    }

    /// Puts the backlog's chunks that are not sealed into the journal's batch as the frames
    /// they become (numbered from the frames before them), and seals them.
    fn seal_backlog(&mut self) {
        let start = self.backlog.sealed;
        let copies: Vec<Option<SentChunk>> = self
            .backlog
            .chunks
            .range(start..)
            .map(|c| self.chunk_text(c))
            .collect();
        let first = self.seq + start as u64;
        for (k, copy) in copies.into_iter().enumerate() {
            self.sent_chunk(first + k as u64, copy);
        }
        self.backlog.seal_all();
    }

    /// The cell ended with `result`: the output its backlog holds goes into the journal as
    /// the frames it becomes, then the result, in one batch, before any of them is sent (a
    /// successor then answers for the ended cell). Nothing without a live journal.
    pub(super) fn journal_result(&mut self, result: &CellResult) {
        if !self.journal.as_ref().is_some_and(|j| j.is_live()) {
            return;
        }
        self.seal_backlog();
        if let Some(j) = self.journal.as_mut() {
            j.result(result);
        }
        self.commit_journal(true);
    }

    /// The spool stops (`why`: its file failed, or the journal ended): its files go, and a
    /// successor continues the cell as it would without one (what the daemon had read and
    /// not journaled is lost, and said so).
    pub(super) fn end_spool(&mut self, why: &str) {
        if let Some(sp) = self.spool.take() {
            tracing::warn!(
                cell = self.cell,
                why,
                "the running cell's spool ended: a successor daemon could lose the output read before its journal batch"
            );
            sp.remove();
            if let Some(j) = self.journal.as_mut() {
                j.clear_spool();
            }
        }
    }

    /// What the counts and the journal need of a chunk about to leave as a frame: a text's
    /// stream and length, and, when there is a journal, a copy of its text or bundle.
    pub(super) fn chunk_text(&self, c: &Chunk) -> Option<SentChunk> {
        let journal = self.journal.is_some();
        Some(match c {
            Chunk::Text(st, t) => SentChunk::Text(*st, t.len(), journal.then(|| t.clone())),
            Chunk::Bundle(d, n) => SentChunk::Bundle(journal.then(|| (d.clone(), *n))),
        })
    }

    /// A chunk left as frame `seq` ([`CellRun::chunk_text`]): counted, and journaled (a
    /// bundle with `seq` as its frame's). Returns whether it went into the journal's batch.
    pub(super) fn sent_chunk(&mut self, seq: u64, sent: Option<SentChunk>) -> bool {
        match sent {
            None => false,
            Some(SentChunk::Text(st, n, copy)) => {
                self.sent[idx(st)] = self.sent[idx(st)].saturating_add(n as u64);
                if let (Some(j), Some(t)) = (self.journal.as_mut(), copy) {
                    j.output(seq, st, &t);
                }
                true
            }
            Some(SentChunk::Bundle(copy)) => {
                let (Some(j), Some((mut d, n))) = (self.journal.as_mut(), copy) else {
                    return false;
                };
                d.seq = seq;
                j.display(&d, n as u64);
                true
            }
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
        metadata: serde_json::Map<String, serde_json::Value>,
        note: Option<String>,
    ) -> Result<(), String> {
        use sandcell_proto::kernel::{
            MAX_DISPLAY_BYTES, check_display_data, check_display_metadata, display_fallback,
        };
        let Some((seen, kept)) = self.displays.as_mut() else {
            return Err("display in a cell without rich_output".into());
        };
        // The metadata is counted with the data; a replaced bundle drops it.
        let size = check_display_data(&data)? + check_display_metadata(&metadata)?;
        if note.as_ref().is_some_and(|n| n.len() > 1024) {
            return Err("display note over 1024 bytes".into());
        }
        *seen = seen.saturating_add(size as u64);
        let (data, metadata, size, note) = if size > MAX_DISPLAY_BYTES {
            let f = display_fallback(&data);
            let n = serde_json::to_vec(&f).map_or(usize::MAX, |v| v.len());
            let why = format!(
                "bundle of {size} bytes over the {MAX_DISPLAY_BYTES}-byte cap: text/plain only"
            );
            (f, Default::default(), n, Some(why))
        } else {
            (data, metadata, size, note)
        };
        let (data, metadata, size, note) = if self.caps[0].reserve(size as u64) {
            (data, metadata, size, note)
        } else {
            let f = display_fallback(&data);
            let n = serde_json::to_vec(&f).map_or(usize::MAX, |v| v.len());
            if n >= size || !self.caps[0].reserve(n as u64) {
                return Ok(());
            }
            (
                f,
                Default::default(),
                n,
                Some(format!(
                    "bundle of {size} bytes over the cell's remaining output budget (shared with \
                     stdout: max_stdout_bytes): text/plain only"
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
                    metadata,
                    note,
                },
                size,
            );
        }
        Ok(())
    }

    /// Queues a request of the running cell for the worker (`op`, with `payload`), written as
    /// the request pipe takes it.
    pub(super) fn queue_request(&mut self, op: wire::Op, payload: &[u8]) {
        let mut header = RequestHeader::exec(self.cell, payload.len() as u64);
        header.op = op;
        self.to_worker
            .extend_from_slice(header.to_line().as_bytes());
        self.to_worker.extend_from_slice(payload);
    }

    /// Queues output for the client (nothing, once the cell is abandoned).
    pub(super) fn queue(&mut self, stream: Stream, text: String) {
        if !self.abandoned {
            self.backlog.push(stream, &text);
        }
    }

    /// Hands over what the client's channel takes now; the rest waits for room.
    fn flush(&mut self) {
        let mut journaled = false;
        while let Some((c, sealed)) = self.backlog.pop_marked() {
            // A sealed chunk is in the journal already, counted.
            let text = if sealed { None } else { self.chunk_text(&c) };
            match self.frames.try_send(c.into_frame(self.cell, self.seq)) {
                Ok(()) => {
                    journaled |= self.sent_chunk(self.seq, text);
                    self.seq += 1;
                }
                Err(mpsc::error::TrySendError::Full(f)) => {
                    self.backlog.push_front(Chunk::from_frame(f), sealed);
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.client_gone = true;
                    return;
                }
            }
        }
        self.commit_journal(journaled);
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
            let got = match self.spool.as_mut() {
                Some(sp) if direct => sp.fill(i, &*r, &mut self.buf),
                Some(sp) => r.try_io(|| sp.fill(i, &*r, &mut self.buf)),
                None if direct => {
                    crate::worker::read_now(std::os::fd::AsRawFd::as_raw_fd(r), &mut self.buf)
                }
                None => r.try_read(&mut self.buf),
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
                Err(e) if self.spool.is_some() => {
                    // The spool's file failed (the bytes stay in the pipe): read on without it.
                    self.end_spool(&e.to_string());
                }
                Err(_) => {
                    *rx = None;
                    break;
                }
            }
        }
        total
    }
}

impl Actor {
    /// The event loop of one running cell: waits for the next event and hands it to its
    /// handler, each of which does a bounded amount of work, until one of them ends the cell.
    /// Control events (commands, the deadline, the interrupt repeat, the client's channel)
    /// come first; the worker's pipes are read only while the cell's backlog has room.
    pub(super) async fn cell_loop(
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
                    let dir = self.session.dir.clone();
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
            run.seal(self.replies.buffered());
            if let Some(done) = run.hand_over.take() {
                self.hand_over_cell(run);
                let _ = done.send(());
                // The daemon exits now; this actor reads nothing more.
                return std::future::pending().await;
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
                    run.phase = Phase::Interrupted;
                    // A host call the cell waits for raises the interrupt: it is finished.
                    run.host = None;
                    // Documented escalation: a cell that ignores SIGINT (native code, BLAS) is
                    // killed after the grace, and the session ends.
                    run.deadline = tokio::time::Instant::now() + run.grace;
                    // The record first, then the signal: the repeats follow the signal as
                    // closely as they always did.
                    self.cell_changed(run);
                    self.signal_interrupt();
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
            Some(Command::HandOver { done }) => {
                run.hand_over = Some(done);
                None
            }
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
            run.phase = Phase::TimedOut;
            run.host = None;
            self.cell_changed(run);
            self.signal_interrupt();
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

    /// The client went away mid-cell: a one-shot Run ends; a session's cell is interrupted and
    /// its output dropped from now on, and the session stays.
    fn on_client_gone(&mut self, run: &mut CellRun) -> Option<CellEnd> {
        if !run.keep_session {
            return Some(CellEnd::Cancelled(None));
        }
        run.abandoned = true;
        // Sealed chunks are in the journal under their numbers: the next frame follows them.
        run.seq += run.backlog.sealed as u64;
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
                Ok(None) => match fill_replies(&mut self.replies, run) {
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
                Ok(None) => match fill_replies(&mut self.replies, run) {
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
            Ok(m) => {
                run.resync = false;
                m
            }
            Err(_) if std::mem::take(&mut run.resync) => {
                self.on_cut_frame(run, line.len());
                return None;
            }
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
            | WorkerMessage::Started { cell, .. }
                if cell != run.cell =>
            {
                violation(format!(
                    "{} for cell {cell} while cell {} runs",
                    kind(&msg),
                    run.cell
                ))
            }
            // Only a successor daemon needs it (`session::keep`, `RunningCell::unconfirmed`).
            WorkerMessage::Started { .. } => None,
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
                kind,
                data,
                metadata,
                note,
                wait,
                ..
            } => {
                if raw_output {
                    // What a native worker printed before the bundle is in the raw pipes:
                    // take it now, so the bundle follows it.
                    self.take_raw(run);
                }
                if let Err(e) = run.on_display(kind, data, metadata, note) {
                    return violation(e);
                }
                if raw_output && wait {
                    // An honest worker reads each answer before its next line, so at most a
                    // host reply and two `displayed` wait here (one after a restart).
                    if run.to_worker.len() > MAX_UNREAD_REQUEST_BYTES {
                        return violation(format!(
                            "{} bytes of requests unread while it asks for more",
                            run.to_worker.len()
                        ));
                    }
                    // The bundle is placed after everything read so far: the worker, which
                    // waited since its line (writing nothing), may write on.
                    run.queue_request(wire::Op::Displayed, &[]);
                }
                None
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

    /// The first reply line read after a daemon restart is not a whole frame: the tail of a
    /// frame whose head the predecessor read and lost with its death. It is never parsed as
    /// a frame. The cell's stream cannot be resumed exactly (that frame may have been output,
    /// a host call or the cell's `done`), so the cell is interrupted (SIGINT, repeated, then
    /// killed after the grace, as for `Interrupt`) and its result says why; the session
    /// stays when the worker answers the interrupt.
    fn on_cut_frame(&mut self, run: &mut CellRun, bytes: usize) {
        tracing::warn!(session = %self.session.id, cell = run.cell, bytes, "the first reply line after the daemon restart is the tail of a frame the previous daemon cut: discarded, the cell is interrupted");
        run.stream_cut = Some(bytes);
        run.notes.push(format!(
            "the daemon restarted in the middle of a frame from the worker; the {bytes} bytes of its tail were discarded and the cell was interrupted"
        ));
        if run.phase == Phase::Running {
            run.phase = Phase::Interrupted;
            run.host = None;
            run.deadline = tokio::time::Instant::now() + run.grace;
            self.cell_changed(run);
            self.signal_interrupt();
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
        self.cell_changed(run);
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
        self.cell_changed(run);
        self.answer_host_call(run, call, &payload);
        true
    }

    /// The waiting host call timed out: it raises in the cell; a later `HostReply` for it is
    /// `NoSuchHostCall`.
    fn on_host_timeout(&mut self, run: &mut CellRun) {
        let Some((call, _)) = run.host.take() else {
            return;
        };
        self.cell_changed(run);
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
    pub(super) fn answer_host_call(&mut self, run: &mut CellRun, call: u64, payload: &[u8]) {
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
    pub(super) fn take_last_output(&mut self, run: &mut CellRun, end: &CellEnd) {
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
}

/// How long after its wall time a running cell gets its first SIGINT. The worker's own limit
/// fires at the wall time and reports `timeout` itself where it can; this slack lets that
/// report arrive first. A cell still running then is interrupted (SIGINT every 250 ms) and
/// killed at the wall time plus the grace (`kill_grace_seconds`), which ends its session.
pub(super) const WALL_SLACK: Duration = Duration::from_millis(100);

/// How often the journal of a cell takes new counts when no frame left (output past the
/// cap is counted, not sent).
const JOURNAL_COUNTS_EVERY: Duration = Duration::from_millis(250);

/// Reply lines handled per wake-up of a cell's loop at most; then the loop serves its control
/// events (deadline, Interrupt, Close, a client gone, daemon stop) before reading on.
const LINES_PER_WAKE: usize = 64;

/// Bytes read from the reply pipe per wake-up at most (a complete line of up to
/// [`MAX_WORKER_LINE`] bytes is still assembled over several wake-ups).
pub(super) const REPLY_BYTES_PER_WAKE: usize = 256 * 1024;

/// Reply lines read after the worker exited, looking for its `done`, at most.
const EXIT_LINES: usize = 1024;

/// Bytes of requests for the worker (host replies, `displayed` answers) that may wait unwritten
/// when a `display` line asks for another answer: one host reply at its largest and room for
/// many small answers. A worker that asks faster than it reads is ended as a protocol
/// violation instead of growing the daemon's buffer.
const MAX_UNREAD_REQUEST_BYTES: usize = sandcell_proto::kernel::MAX_HOST_CALL_RESULT + 64 * 1024;

/// Reads of a raw output pipe per wake-up at most (of [`RAW_READ_BYTES`] each).
pub(super) const RAW_READS_PER_WAKE: usize = 16;

/// Bytes asked for by one read of a raw output pipe.
const RAW_READ_BYTES: usize = 64 * 1024;

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

/// Waits until `rx` is readable (true) or failed (false); never returns without a pipe.
async fn ready_opt(rx: &Option<pipe::Receiver>) -> bool {
    match rx {
        Some(r) => r.readable().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Bytes of output text a cell may have waiting for its client. Past it the daemon stops
/// reading that worker's pipes until the client has taken some (backpressure: the worker
/// blocks on a full pipe; its deadline still runs).
pub(super) const BACKLOG_BYTES: usize = 256 * 1024;

/// One item waiting for the client: a chunk of output text, or a display bundle (its `seq`
/// is set when it is sent).
#[derive(Debug)]
pub(super) enum Chunk {
    Text(Stream, String),
    Bundle(Box<Display>, usize),
}

/// What a chunk that left as a frame leaves for the counts and the journal
/// ([`CellRun::chunk_text`]): a text's stream, its length and (with a journal) a copy; a
/// bundle's copy and counted bytes (with a journal).
pub(super) enum SentChunk {
    Text(Stream, usize, Option<String>),
    Bundle(Option<(Box<Display>, usize)>),
}

impl Chunk {
    /// Bytes it holds (a bundle: its data's JSON text, as counted when it came).
    pub(super) fn bytes(&self) -> usize {
        match self {
            Chunk::Text(_, t) => t.len(),
            Chunk::Bundle(_, n) => *n,
        }
    }

    /// Its frame, numbered `seq`.
    pub(super) fn into_frame(self, cell: u64, seq: u64) -> Frame {
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
pub(super) struct Backlog {
    pub(super) chunks: std::collections::VecDeque<Chunk>,
    pub(super) bytes: usize,
    /// The first this many chunks are sealed: in the journal under the numbers they are
    /// sent with ([`CellRun::seal`]); nothing merges into them.
    pub(super) sealed: usize,
}

impl Backlog {
    /// Whether more output may be read for it.
    fn has_room(&self) -> bool {
        self.bytes < BACKLOG_BYTES
    }

    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Appends `text`, merging with the last chunk of the same stream and cutting on
    /// character boundaries so that no chunk exceeds the frame size.
    pub(super) fn push(&mut self, stream: Stream, mut text: &str) {
        use sandcell_proto::worker::MAX_OUTPUT_CHUNK;
        while !text.is_empty() {
            let merge = match self.chunks.back() {
                Some(Chunk::Text(s, t))
                    if *s == stream
                        && t.len() < MAX_OUTPUT_CHUNK
                        && self.chunks.len() > self.sealed =>
                {
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

    /// Puts a chunk back at the front (the channel was full), sealed as it was.
    fn push_front(&mut self, c: Chunk, sealed: bool) {
        self.bytes += c.bytes();
        self.chunks.push_front(c);
        if sealed {
            self.sealed += 1;
        }
    }

    pub(super) fn pop(&mut self) -> Option<Chunk> {
        self.pop_marked().map(|(c, _)| c)
    }

    /// The oldest chunk and whether it was sealed.
    pub(super) fn pop_marked(&mut self) -> Option<(Chunk, bool)> {
        let c = self.chunks.pop_front()?;
        self.bytes -= c.bytes();
        let sealed = self.sealed > 0;
        if sealed {
            self.sealed -= 1;
        }
        Some((c, sealed))
    }

    /// Every chunk it holds is sealed now.
    fn seal_all(&mut self) {
        self.sealed = self.chunks.len();
    }

    /// Bytes of the chunks not sealed.
    fn unsealed_bytes(&self) -> usize {
        self.chunks.range(self.sealed..).map(Chunk::bytes).sum()
    }

    pub(super) fn clear(&mut self) {
        self.chunks.clear();
        self.bytes = 0;
        self.sealed = 0;
    }
}

/// Room in the client's channel: the oldest waiting chunk goes now (the rest with the loop's
/// flush).
fn send_one(permit: mpsc::OwnedPermit<Frame>, run: &mut CellRun) {
    if let Some((c, sealed)) = run.backlog.pop_marked() {
        // A spooled cell seals its backlog at the end of every turn of its loop, before
        // anything is sent: a chunk that is not sealed is one without a spool.
        debug_assert!(sealed || run.spool.is_none());
        let text = if sealed { None } else { run.chunk_text(&c) };
        permit.send(c.into_frame(run.cell, run.seq));
        let journaled = run.sent_chunk(run.seq, text);
        run.seq += 1;
        run.commit_journal(journaled);
    } else if let Some(f) = run.host_frame.take() {
        permit.send(f);
    }
}

/// One non-blocking fill of the reply reader: through the cell's spool when it has one
/// (`spool.rs`; a spool whose file fails ends, and this read goes to the pipe directly).
fn fill_replies(
    replies: &mut LineReader<pipe::Receiver>,
    run: &mut CellRun,
) -> Result<Fill, crate::worker::LineError> {
    let Some(sp) = run.spool.as_mut() else {
        return replies.try_fill();
    };
    let mut failed = None;
    let got = replies.try_fill_with(
        |r, buf| match r.try_io(|| sp.fill(spool::REPLIES, r, buf)) {
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => {
                failed = Some(e);
                r.try_read(buf)
            }
            other => other,
        },
    );
    if let Some(e) = failed {
        run.end_spool(&e.to_string());
    }
    got
}

/// Waits for room in the client's channel; the permit borrows nothing (the cell's state stays
/// free for the handler).
async fn reserve_owned(
    frames: &mpsc::Sender<Frame>,
) -> Result<mpsc::OwnedPermit<Frame>, mpsc::error::SendError<()>> {
    frames.clone().reserve_owned().await
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

pub(super) fn kind(m: &WorkerMessage) -> &'static str {
    match m {
        WorkerMessage::Ready { .. } => "ready",
        WorkerMessage::Fatal { .. } => "fatal",
        WorkerMessage::Output { .. } => "output",
        WorkerMessage::Dropped { .. } => "dropped",
        WorkerMessage::Started { .. } => "started",
        WorkerMessage::Done { .. } => "done",
        WorkerMessage::Inspected { .. } => "inspected",
        WorkerMessage::Completions { .. } => "completions",
        WorkerMessage::Help { .. } => "help",
        WorkerMessage::HostCall { .. } => "host_call",
        WorkerMessage::Display { .. } => "display",
    }
}

/// CPU seconds (user + system, children included) of `pid`, from `/proc/<pid>/stat`.
pub(super) fn proc_cpu_seconds(pid: u32) -> Option<f64> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use sandcell_proto::worker::MAX_OUTPUT_CHUNK;

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
                metadata: Default::default(),
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
}
