//! The end of a cell, after its event loop: the result ([`Actor::finish_cell`], and the three
//! ways a cell ends: the worker's `done`, the disk budget, a worker gone or killed), the
//! processes the cell left running (killed at its end, reaped before the next cell), the
//! listing of the files it changed, and the session directory's disk budget (the walks that
//! total it, during a cell and between cells).

use super::*;

impl Actor {
    /// Waits (on the blocking pool, at most [`LEFTOVER_REAP_TIMEOUT`]) until the processes the
    /// previous cell left behind and the daemon killed are reaped, so that their zombies no
    /// longer hold the session's `pids.max` when this cell forks. Those the worker itself must
    /// reap (its own children) are not waited for; what is still there at the bound is logged.
    pub(super) async fn wait_leftovers_reaped(&mut self) {
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

    /// Everything after the cell's loop: late output, the result, the files, the end of the
    /// cell's leftover processes, and the result's delivery.
    pub(super) async fn finish_cell(
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
        run.stages.mark("result_of");
        result.warnings.append(&mut run.notes);
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
        let after = cell_files(self.session.dir.clone(), files_before, sweep).await;
        run.stages.mark("files_after");
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
        // A retained cell's journal takes the rest of its output and its result before either
        // is sent, and only then does the record stop offering the cell to a successor: a
        // daemon that dies at any point before still has the cell continued (its `done` is
        // read again from the spool), one that dies after has it answered as ended.
        run.journal_result(&result);
        // Once the record stops offering the cell, a successor adopts the session idle when it
        // goes on (the worker waits for its next request), and ends it when it ends.
        self.pending = ending.is_none().then_some(crate::records::PendingCell {
            stage: crate::records::PendingStage::Ended,
            one_shot,
        });
        self.end_running_cell(&mut run);
        super::keep::kill_seam("cell_ended", cell);
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
        self.pending = None;
        // Likewise the owner's per-uid quota: the next Run sent the moment this result arrives
        // must not count this session. The daemon-wide charge stays until the worker is reaped.
        if ending.is_some()
            && let Some(p) = self.permit.as_mut()
        {
            p.release_owner();
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
        run.stages.mark("result_sent");
        // A Close that came while a slow client held the frames: honour it now.
        if let Some((reason, done)) = close_req.take() {
            if ending.is_none() {
                self.kill_and_reap().await;
            }
            ending = Some((reason, Some(done)));
            self.session.info.lock().unwrap().state = SessionState::Ended;
        }
        // Bookkeeping after the result is on its way.
        run.stages.log("cell", &self.session.id);
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
        if let Some(bytes) = run.stream_cut
            && result.status == Status::Interrupted
        {
            result.error = Some(wire::CellError {
                kind: "DaemonRestarted".into(),
                message: format!(
                    "the daemon restarted in the middle of a frame from the worker ({bytes} bytes of its tail discarded): the cell's output could not be continued exactly, so it was interrupted"
                ),
                ..Default::default()
            });
        }
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
            (_, CellEnd::Killed) if run.stream_cut.is_some() => EndReason::DaemonRestarted,
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
}

/// Files a cell leaves in the session directory: a bounded lstat-only listing of
/// `dir`; `None` if it cannot be read.
pub(super) async fn list_files(dir: PathBuf) -> Option<crate::files::Listing> {
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
pub(super) const DISK_WATCH_MIN: Duration = Duration::from_millis(25);

/// ... and at most this long after it, ...
pub(super) const DISK_WATCH_MAX: Duration = Duration::from_millis(250);

/// ... and otherwise this many times the previous walk's duration, so that the walks cost at
/// most about 1/20 of a core per running cell however many entries the directory holds.
pub(super) const DISK_WATCH_FACTOR: u32 = 20;

/// Why `bytes` (a [`disk_usage`] total) breaks the session's disk budget `budget`, if it does.
pub(super) fn over_disk_budget(bytes: u64, budget: u64) -> Option<String> {
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
pub(super) fn disk_usage(dir: &std::path::Path) -> u64 {
    crate::files::list(dir)
        .map(|l| l.regular_bytes())
        .unwrap_or(0)
}

/// Waits for the disk walk in flight; returns its total and how long it took.
pub(super) async fn disk_scan_done(
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

/// How long the next cell waits for the zombies of the processes the previous cell left (and
/// the daemon killed) to be reaped.
pub(super) const LEFTOVER_REAP_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the end of a cell waits for the processes it left running to die.
const LEFTOVER_KILL_TIMEOUT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

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
}
