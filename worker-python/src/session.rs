//! One Python session: an Eryx `SessionExecutor` that keeps globals across cells, and what
//! keeps those globals alive when the instance has to be rebuilt.
//!
//! # Status mapping
//!
//! | what happened | `status` | instance |
//! |---|---|---|
//! | driver reports `ok` / `error` / `exited` / `memory_exhausted` | same | kept |
//! | uncaught exception outside the driver (driver broken by the cell) | `error` (`memory_exhausted` for MemoryError) | kept |
//! | Eryx timeout (epoch deadline or async timeout) | `timeout` | rebuilt |
//! | fuel ran out | `fuel_exhausted` | rebuilt |
//! | SIGINT (see [`crate::interrupt`]) | `interrupted` | rebuilt (kept if it came before the guest started) |
//! | a trap (stack overflow, abort) | `error`, type `SandboxTrap` | rebuilt |
//! | the guest called WASI's `exit` (`os._exit`, a C-level `exit`) | `exited`, code 0 or 1, a warning | rebuilt |
//!
//! # State across rebuilds: snapshot after every completed cell
//!
//! After a timeout, fuel exhaustion, interrupt or trap, the WebAssembly instance is dead
//! (wasmtime poisons a component instance that trapped, and an execution dropped mid-call
//! leaves no store). The worker keeps the user's variables by taking a snapshot after each
//! completed cell (the driver's `snapshot`: C pickle, with functions and classes of the
//! namespace pickled by value); a rebuild loads the last snapshot, re-imports module bindings
//! (pickling skips modules) and reports `state: restored`, with a warning naming any variable
//! that could not be pickled or was nested too deeply to pickle safely. If no snapshot covers
//! the namespace (the last one failed, e.g. over [`MAX_SNAPSHOT_BYTES`]) or a restore fails,
//! the report is `state: lost` with an error saying what was lost and from which cell the
//! variables come. Never a silently empty namespace.
//!
//! Decision (figures from `sandcell-python-runtime bench` in
//! docs/internals/figures.md): Eryx's own `snapshot_state()` (dill's pure-Python pickler, every value pickled
//! twice) costs far too much per cell; the driver's snapshot (C pickle; only functions and
//! classes defined in cells go by value, via `marshal`/dill) costs a small fraction of it,
//! and so does a rebuild with restore. Which cell
//! will need the snapshot cannot be known in advance (the timeout comes from the cell after),
//! so a snapshot is taken after every completed cell, but *after* its `Done` is sent
//! ([`PySession::finish_cell`]): it is not part of the cell's round trip, and the next request
//! simply waits for it. A snapshot is bounded by [`SNAPSHOT_TIMEOUT`] (pickling can run user
//! `__reduce__` code) and [`MAX_SNAPSHOT_BYTES`].
//!
//! One exception: when the driver reports the namespace `unchanged` (every name still bound
//! to the very object of the last snapshot, all of them immutable or modules under the same
//! name: see `driver.py`), the snapshot held is already the state after this cell and none
//! is taken ([`crate::driver::DriverResult::unchanged`]). Otherwise a request sent right
//! after the previous `Done` waits for that cell's snapshot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use eryx::vfs::{ArcStorage, InMemoryStorage};
use eryx::{
    CancellationToken, Error as EryxError, PythonExecutor, ResourceLimits, SessionExecutor,
    VfsConfig, VolumeMount,
};
use sandcell_proto::worker::{
    CellError, MAX_ERROR_MESSAGE, MAX_INSPECT_LINE, MAX_REPR_CHARS, MAX_SHAPE_DIMS, MAX_TRACEBACK,
    MAX_VARIABLE_NAME, MAX_VARIABLE_TYPE, SessionState, Variable, WorkerMessage, WorkerStatus,
    bound_text,
};

use crate::driver::{self, DriverResult};
use crate::host::{HostCalls, HostFile};
use crate::interrupt::{Interrupter, Target};
use crate::output::Forwarder;
use crate::replies::Lines;

/// Wall-time limit of a cell whose request has no `timeout_ms` (the daemon enforces its own).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest cell wall-time limit honoured; longer requests are cut to it (an interrupt advances
/// the engine epoch once per 10 ms of the limit, so the limit must stay finite).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Wall-time limit of the worker's own guest calls (driver install, restore).
pub const INTERNAL_TIMEOUT: Duration = Duration::from_secs(30);
/// Wall-time limit of a state snapshot.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(10);
/// Eryx's epoch tick (eryx 0.10.1 `EPOCH_TICK_INTERVAL`).
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Guest path of the session directory (the path OpenAI's `code_interpreter` uses); cells start
/// with it as their working directory.
pub const GUEST_FILES_DIR: &str = "/mnt/data";
/// Guest path of the in-memory scratch directory (Eryx's VFS storage: a session built with the
/// `vfs` feature always has one, so it is put where `tempfile` looks).
pub const GUEST_SCRATCH_DIR: &str = "/tmp";
/// Bytes of file content the scratch directory holds at most (host memory of the worker,
/// outside the guest memory limit, inside the worker's cgroup); a write past it fails in the
/// guest with `OSError` (`EIO`: eryx-vfs 0.10.1 loses the `ENOSPC` of a stream write). Kept
/// across rebuilds, lost with the session.
pub const SCRATCH_MAX_BYTES: u64 = 32 * 1024 * 1024;

/// Parameters of one cell.
#[derive(Debug, Clone)]
pub struct CellRequest<'a> {
    /// Cell number from the request.
    pub cell: u64,
    /// The source bytes (UTF-8 expected).
    pub source: &'a [u8],
    /// Wall-time limit.
    pub timeout: Duration,
    /// Fuel limit, if any.
    pub fuel: Option<u64>,
    /// Bytes per stream worth forwarding.
    pub max_output: u64,
    /// Show the value of a final expression statement (the request's `display`).
    pub display: bool,
    /// Rich output: MIME bundles instead of stdout text (the request's `rich`).
    pub rich: bool,
    /// The request's `nonce`, echoed by the cell's `host_call` lines.
    pub nonce: Option<String>,
    /// The cell may make host calls (the request's `host_calls=1`, see [`crate::host`]).
    pub host_calls: bool,
}

/// Largest snapshot kept, in bytes; a larger namespace is not captured (state `lost` on a
/// later rebuild, with this reason).
pub const MAX_SNAPSHOT_BYTES: usize = 32 * 1024 * 1024;

/// The last usable snapshot.
struct Saved {
    /// Pickled values (the driver's format).
    blob: Vec<u8>,
    /// Module bindings: global name -> module name.
    modules: std::collections::BTreeMap<String, String>,
    /// Names that could not be pickled.
    skipped: Vec<String>,
    after_cell: u64,
}

/// Timing figures of the session, for tests and reports.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Duration of the last snapshot.
    pub last_snapshot: Duration,
    /// Size of the last snapshot in bytes.
    pub last_snapshot_bytes: usize,
    /// Duration of the last rebuild (reset + install + restore).
    pub last_rebuild: Duration,
}

/// How an execution ended, before mapping to a status.
enum RunEnd {
    /// The execution returned, with the outcome the driver sent, if any.
    Returned(Result<eryx::ExecutionOutput, EryxError>, Option<Vec<u8>>),
    /// SIGINT before the guest started: nothing ran.
    InterruptedBeforeStart,
    /// SIGINT while the guest was parked in a host call: the execution was dropped.
    Dropped,
}

/// A Python session inside one worker.
pub struct PySession {
    executor: Arc<PythonExecutor>,
    session: SessionExecutor,
    saved: Option<Saved>,
    /// Why the namespace is newer than `saved` (a snapshot failed), if it is.
    stale: Option<String>,
    /// A cell completed since the session started (so an empty `saved` means loss).
    had_cells: bool,
    /// The instance must be rebuilt before the next use.
    dead: bool,
    /// A completed cell whose snapshot is still to be taken ([`PySession::finish_cell`]).
    pending_checkpoint: Option<u64>,
    /// The session directory is mounted at [`GUEST_FILES_DIR`].
    files: bool,
    /// Host calls of the cells, through the host-call file in the scratch directory.
    host: Option<Arc<HostCalls>>,
    /// Figures.
    pub stats: Stats,
}

fn ticks(d: Duration) -> u64 {
    (d.as_millis() / EPOCH_TICK.as_millis()) as u64
}

fn cell_error(kind: &str, message: &str, traceback: Option<&str>, line: Option<u64>) -> CellError {
    CellError {
        kind: bound_text(kind, 256),
        message: bound_text(message, MAX_ERROR_MESSAGE),
        traceback: traceback.map(|t| bound_text(t, MAX_TRACEBACK)),
        line,
        call: None,
    }
}

/// The warning beside an exit the guest made through WASI rather than `SystemExit`.
const GUEST_EXIT_WARNING: &str = "the cell ended the interpreter (os._exit or a C-level exit); \
WASI preview 2's exit carries only success or failure, so any non-zero code reads as 1; \
sys.exit(n) keeps n";

/// The exit status of a guest that called WASI's `exit` (`os._exit`, libc `exit`), from the
/// text of Eryx's execution error: wasmtime reports it as `Exited with i32 exit status N`
/// (`wasmtime_wasi::I32Exit`, an `i32`) in the error chain, and Eryx keeps only the chain's
/// text. WASI preview 2's `wasi:cli/exit.exit` takes a result, not a code, so N is 0 or 1.
/// `None` when the text has no such line (a trap) or N is no `i32`.
fn guest_exit_code(text: &str) -> Option<i64> {
    const MARK: &str = "Exited with i32 exit status ";
    let at = text.rfind(MARK)? + MARK.len();
    let rest = &text[at..];
    let end = rest
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
        .map_or(rest.len(), |(i, _)| i);
    rest[..end].parse::<i32>().ok().map(i64::from)
}

/// Best-effort type and message from CPython's formatted traceback text (last line
/// `Type: message`).
fn parse_exception_text(text: &str) -> CellError {
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    let (kind, message) = match last.split_once(": ") {
        Some((k, m)) if !k.contains(' ') => (k, m),
        _ if !last.contains(' ') && !last.is_empty() => (last, ""),
        _ => ("Exception", last),
    };
    cell_error(kind, message, Some(text), None)
}

impl PySession {
    /// Starts a session on `executor` with at most `guest_memory` bytes of guest memory and
    /// installs the driver. `files_dir`, when given, is the host session directory, mounted
    /// read-write at [`GUEST_FILES_DIR`] (see the crate docs, "Files"); the in-memory scratch
    /// directory [`GUEST_SCRATCH_DIR`] is always there.
    ///
    /// Errors: `files_dir` cannot be opened as a directory, the instance cannot be created or
    /// the driver cannot be installed.
    pub async fn new(
        executor: Arc<PythonExecutor>,
        guest_memory: Option<u64>,
        files_dir: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        Self::with_host_calls(executor, guest_memory, files_dir, None).await
    }

    /// [`PySession::new`] whose cells make host calls through `host` (see [`crate::host`]):
    /// the scratch directory gets the host-call file.
    ///
    /// Errors: as [`PySession::new`].
    pub async fn with_host_calls(
        executor: Arc<PythonExecutor>,
        guest_memory: Option<u64>,
        files_dir: Option<&std::path::Path>,
        host: Option<Arc<HostCalls>>,
    ) -> anyhow::Result<Self> {
        let limits = ResourceLimits::default()
            .with_execution_timeout(INTERNAL_TIMEOUT)
            .with_max_memory_bytes(guest_memory)
            .with_max_fuel(None);
        let mut scratch =
            ArcStorage::new(Arc::new(InMemoryStorage::with_max_bytes(SCRATCH_MAX_BYTES)));
        if let Some(h) = &host {
            scratch = ArcStorage::new(Arc::new(HostFile::new(scratch, Arc::clone(h))));
        }
        let mut vfs = VfsConfig::new(GUEST_SCRATCH_DIR);
        if let Some(dir) = files_dir {
            // Eryx mounts a single file instead when the host path is a file: insist on a
            // directory, without following a symlink in its last component.
            let meta = std::fs::symlink_metadata(dir)
                .with_context(|| format!("session directory {}", dir.display()))?;
            anyhow::ensure!(
                meta.is_dir(),
                "session directory {} is not a directory",
                dir.display()
            );
            vfs = vfs.with_volume(VolumeMount::new(dir, GUEST_FILES_DIR));
        }
        let session = SessionExecutor::new_with_vfs_config_and_limits(
            executor.clone(),
            &[],
            scratch,
            vfs,
            &limits,
        )
        .await
        .context("creating the Python instance")?;
        let mut s = Self {
            executor,
            session,
            saved: None,
            stale: None,
            had_cells: false,
            dead: false,
            pending_checkpoint: None,
            files: files_dir.is_some(),
            host,
            stats: Stats::default(),
        };
        s.install().await.context("installing the cell driver")?;
        Ok(s)
    }

    /// The executor (for interrupts and benchmarks).
    pub fn executor(&self) -> &Arc<PythonExecutor> {
        &self.executor
    }

    /// Runs worker-internal Python (no output, no fuel limit) and returns the driver result.
    async fn internal(&mut self, code: &str) -> Result<Option<DriverResult>, EryxError> {
        self.session.set_execution_timeout(Some(INTERNAL_TIMEOUT));
        let out = self.session.execute(code).run().await?;
        Ok(out
            .result
            .as_deref()
            .and_then(|j| DriverResult::parse(j).ok()))
    }

    /// Installs the driver (unless the snapshot already has this version), empties the
    /// namespace of pre-initialisation leftovers and, with a session directory, makes
    /// [`GUEST_FILES_DIR`] the working directory (wasi-libc keeps it in guest memory, so a
    /// fresh instance needs it again); used on a fresh instance and when a cell removed the
    /// driver.
    async fn install(&mut self) -> Result<(), EryxError> {
        let mut code = format!(
            "{}__import__('_sandcell').clean(globals())\n",
            driver::install_code()
        );
        if self.files {
            code.push_str(&format!("__import__('os').chdir('{GUEST_FILES_DIR}')\n"));
        }
        self.internal(&code).await.map(|_| ())
    }

    /// Pickles the namespace through the driver. Errors carry a reason and whether the
    /// instance died (timeout or trap).
    async fn capture(&mut self) -> Result<(Vec<u8>, DriverResult), (String, bool)> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.session.set_execution_timeout(Some(SNAPSHOT_TIMEOUT));
        let r = self
            .session
            .execute(driver::snapshot_code())
            .with_output_streaming(tx)
            .run()
            .await;
        let mut blob = Vec::new();
        let mut over = false;
        while let Ok(req) = rx.try_recv() {
            if req.stream == driver::SNAPSHOT_STREAM {
                if blob.len() + req.data.len() > MAX_SNAPSHOT_BYTES {
                    over = true;
                } else {
                    blob.extend_from_slice(&req.data);
                }
            }
        }
        match r {
            Ok(out) => match out.result.as_deref().map(DriverResult::parse) {
                Some(Ok(_)) if over => Err((
                    format!("the namespace pickles to more than {MAX_SNAPSHOT_BYTES} bytes"),
                    false,
                )),
                Some(Ok(res)) => Ok((blob, res)),
                _ => Err(("the cell driver reported no snapshot".into(), false)),
            },
            Err(EryxError::PythonException(text)) => {
                let e = parse_exception_text(&text);
                Err((format!("{}: {}", e.kind, e.message), false))
            }
            Err(e) => Err((e.to_string(), true)),
        }
    }

    /// Takes a snapshot of the namespace after `cell`, bounded by [`SNAPSHOT_TIMEOUT`].
    async fn checkpoint(&mut self, cell: u64) {
        let start = Instant::now();
        let r = self.capture().await;
        self.stats.last_snapshot = start.elapsed();
        match r {
            Ok((blob, res)) => {
                self.stats.last_snapshot_bytes = blob.len();
                self.saved = Some(Saved {
                    blob,
                    modules: res.modules,
                    skipped: res.missing,
                    after_cell: cell,
                });
                self.stale = None;
            }
            Err((why, dead)) => {
                self.stale = Some(format!("the snapshot after cell {cell} failed: {why}"));
                if dead {
                    self.dead = true;
                }
            }
        }
    }

    /// Rebuilds the instance and restores the last snapshot. Returns the resulting state and,
    /// when something was lost, what (for the error) plus warnings.
    async fn rebuild(&mut self) -> (SessionState, Option<String>, Vec<String>) {
        let start = Instant::now();
        let r = self.rebuild_inner().await;
        self.stats.last_rebuild = start.elapsed();
        r
    }

    /// A fresh instance with the driver.
    async fn fresh_instance(&mut self) -> Result<(), String> {
        self.dead = true;
        self.session
            .reset(&[])
            .await
            .map_err(|e| format!("could not rebuild the interpreter: {e}"))?;
        self.install()
            .await
            .map_err(|e| format!("could not reinstall the cell driver: {e}"))?;
        self.dead = false;
        Ok(())
    }

    async fn rebuild_inner(&mut self) -> (SessionState, Option<String>, Vec<String>) {
        if let Err(e) = self.fresh_instance().await {
            return (
                SessionState::Lost,
                Some(format!("all variables lost: {e}")),
                vec![],
            );
        }
        let Some(saved) = self.saved.as_ref() else {
            return match self.stale.take() {
                Some(why) if self.had_cells => (
                    SessionState::Lost,
                    Some(format!("all variables lost: {why}")),
                    vec![],
                ),
                _ => (SessionState::Restored, None, vec![]),
            };
        };
        let after_cell = saved.after_cell;
        let mut warnings = Vec::new();
        if !saved.skipped.is_empty() {
            warnings.push(bound_text(
                &format!("not restored: {}", saved.skipped.join(", ")),
                MAX_ERROR_MESSAGE,
            ));
        }
        let code = driver::restore_code(&saved.blob, &saved.modules);
        let failure = match self.internal(&code).await {
            Ok(Some(r)) => {
                if !r.missing.is_empty() {
                    warnings.push(bound_text(
                        &format!("modules not re-imported: {}", r.missing.join(", ")),
                        MAX_ERROR_MESSAGE,
                    ));
                }
                None
            }
            Ok(None) => Some("the cell driver reported nothing".to_string()),
            Err(EryxError::PythonException(text)) => {
                let e = parse_exception_text(&text);
                Some(format!("{}: {}", e.kind, e.message))
            }
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = failure {
            // The instance may be half-restored: start again from an empty one.
            self.saved = None;
            self.stale = None;
            let extra = self
                .fresh_instance()
                .await
                .err()
                .map(|e| format!("; {e}"))
                .unwrap_or_default();
            return (
                SessionState::Lost,
                Some(format!(
                    "all variables lost: restoring the snapshot after cell {after_cell} failed: {why}{extra}"
                )),
                warnings,
            );
        }
        if let Some(why) = self.stale.take() {
            // Keep `saved`: it still describes the namespace just restored.
            return (
                SessionState::Lost,
                Some(format!(
                    "variables restored as they were after cell {after_cell}; later changes lost: {why}"
                )),
                warnings,
            );
        }
        (SessionState::Restored, None, warnings)
    }

    /// Cell `cell` completed with the instance alive: its snapshot is due, unless the driver
    /// reported the namespace `unchanged` since the snapshot this session holds (then that
    /// snapshot is also the state after `cell`).
    fn completed(&mut self, cell: u64, unchanged: bool) {
        match &mut self.saved {
            Some(saved) if unchanged && self.stale.is_none() => saved.after_cell = cell,
            _ => self.pending_checkpoint = Some(cell),
        }
    }

    /// Takes the snapshot of the cell that just completed, if any. Called after its `Done` was
    /// sent, so the snapshot's cost is not part of the cell's round trip; the next request
    /// waits for it.
    pub async fn finish_cell(&mut self) {
        if let Some(cell) = self.pending_checkpoint.take()
            && !self.dead
        {
            self.checkpoint(cell).await;
        }
    }

    /// Runs one cell, streaming its output through `output`, and returns its `Done` message.
    ///
    /// Output not yet sent when the cell ends (all of it, for a cell shorter than
    /// [`crate::output::TAKEOVER_AFTER`]) and the `Dropped` counts are left in `lines`, for
    /// the caller to write together with the `Done`, in one write.
    ///
    /// `interrupter` must have seen `begin_cell` for this request; the caller calls `end_cell`
    /// before sending the result. Errors only when the reply pipe fails (the daemon is gone).
    pub async fn exec_cell(
        &mut self,
        req: &CellRequest<'_>,
        output: &mut Forwarder,
        interrupter: &Interrupter,
        lines: &mut Lines,
    ) -> std::io::Result<WorkerMessage> {
        let cell = req.cell;
        let done = |status, error, exit_code, fuel, state, warnings| WorkerMessage::Done {
            cell,
            nonce: None,
            status,
            error,
            exit_code,
            fuel,
            state,
            warnings,
        };
        let source = match std::str::from_utf8(req.source) {
            Ok(s) => s,
            Err(e) => {
                let msg = format!(
                    "cell source is not valid UTF-8 (invalid byte at offset {})",
                    e.valid_up_to()
                );
                let err = cell_error("SyntaxError", &msg, None, None);
                return Ok(done(
                    WorkerStatus::Error,
                    Some(err),
                    None,
                    None,
                    SessionState::Kept,
                    vec![],
                ));
            }
        };
        self.finish_cell().await;
        let mut warnings = Vec::new();
        let mut state = SessionState::Kept;
        if self.dead {
            let (s, lost, w) = self.rebuild().await;
            warnings.extend(w);
            state = s;
            if self.dead {
                let err = cell_error(
                    "SandboxError",
                    lost.as_deref().unwrap_or("the interpreter is unavailable"),
                    None,
                    None,
                );
                return Ok(done(
                    WorkerStatus::Error,
                    Some(err),
                    None,
                    None,
                    SessionState::Lost,
                    warnings,
                ));
            }
            if let Some(lost) = lost {
                warnings.push(lost);
            }
        }

        let code = driver::cell_code(cell, source, req.display, req.rich);
        let mut retried = false;
        loop {
            let fired = Arc::new(AtomicBool::new(false));
            let (end, fuel_used) = self
                .run(req, &code, output, interrupter, &fired, lines)
                .await?;
            let interrupted = fired.load(Ordering::SeqCst);
            let (status, error, exit_code, fuel, rebuild) = match end {
                RunEnd::InterruptedBeforeStart => {
                    (WorkerStatus::Interrupted, None, None, Some(0), false)
                }
                RunEnd::Dropped => (WorkerStatus::Interrupted, None, None, None, true),
                RunEnd::Returned(Ok(out), outcome) => {
                    let fuel = out.fuel_consumed;
                    let outcome = match &outcome {
                        Some(o) => Some(DriverResult::parse(o)),
                        None => out.result.as_deref().map(DriverResult::parse),
                    };
                    match outcome {
                        Some(Ok(r)) => {
                            self.had_cells = true;
                            let (mut status, error, code) = map_driver(&r);
                            if interrupted
                                && error
                                    .as_ref()
                                    .is_some_and(|e| e.kind == "KeyboardInterrupt")
                            {
                                // A host call took the SIGINT and the cell let the
                                // KeyboardInterrupt through: interrupted, instance kept; the
                                // error stays, its traceback saying where the cell was.
                                status = WorkerStatus::Interrupted;
                            }
                            self.completed(cell, r.unchanged);
                            (status, error, code, fuel, false)
                        }
                        _ => {
                            // The cell disabled the driver's report (e.g. deleted its result).
                            self.had_cells = true;
                            self.pending_checkpoint = Some(cell);
                            let err = cell_error(
                                "SandboxError",
                                "the cell driver reported no outcome",
                                None,
                                None,
                            );
                            (WorkerStatus::Error, Some(err), None, fuel, false)
                        }
                    }
                }
                RunEnd::Returned(Err(EryxError::PythonException(text)), _) => {
                    if !retried && driver::driver_missing(&text) {
                        retried = true;
                        if self.install().await.is_ok() {
                            continue;
                        }
                    }
                    self.had_cells = true;
                    self.pending_checkpoint = Some(cell);
                    let status = if text.contains("MemoryError") {
                        WorkerStatus::MemoryExhausted
                    } else {
                        WorkerStatus::Error
                    };
                    (
                        status,
                        Some(parse_exception_text(&text)),
                        None,
                        fuel_used,
                        false,
                    )
                }
                RunEnd::Returned(Err(e), _) if interrupted => {
                    let _ = e;
                    (WorkerStatus::Interrupted, None, None, fuel_used, true)
                }
                RunEnd::Returned(Err(EryxError::Timeout(_)), _) => {
                    (WorkerStatus::Timeout, None, None, fuel_used, true)
                }
                RunEnd::Returned(Err(EryxError::FuelExhausted { consumed, .. }), _) => (
                    WorkerStatus::FuelExhausted,
                    None,
                    None,
                    Some(consumed),
                    true,
                ),
                RunEnd::Returned(Err(EryxError::Cancelled), _) => {
                    (WorkerStatus::Interrupted, None, None, fuel_used, true)
                }
                RunEnd::Returned(Err(EryxError::Execution(ref text)), _)
                    if guest_exit_code(text).is_some() =>
                {
                    // The cell ended the interpreter itself (`os._exit`, a C-level `exit`):
                    // the guest called WASI's `exit`, which ends the instance. Told as an
                    // exit, as `sys.exit` is; the instance is rebuilt from the last snapshot.
                    warnings.push(GUEST_EXIT_WARNING.to_string());
                    (
                        WorkerStatus::Exited,
                        None,
                        guest_exit_code(text),
                        fuel_used,
                        true,
                    )
                }
                RunEnd::Returned(Err(e), _) => {
                    // A trap (stack overflow, abort, ...): the first line says what, the rest
                    // is wasmtime's backtrace.
                    let text = e.to_string();
                    let first = text.lines().next().unwrap_or_default();
                    let (status, kind) =
                        if text.contains("out of memory") || text.contains("memory allocation") {
                            (WorkerStatus::MemoryExhausted, "MemoryError")
                        } else {
                            (WorkerStatus::Error, "SandboxTrap")
                        };
                    (
                        status,
                        Some(cell_error(kind, first, Some(&text), None)),
                        None,
                        fuel_used,
                        true,
                    )
                }
            };
            let mut error = error;
            if rebuild || self.dead {
                // The cell's output goes out now, not after the rebuild.
                output.replies().write(lines)?;
                let (s, lost, w) = self.rebuild().await;
                state = s;
                warnings.extend(w);
                if let Some(lost) = lost {
                    match &error {
                        None => error = Some(cell_error("StateLost", &lost, None, None)),
                        Some(_) => warnings.push(lost),
                    }
                }
            }
            return Ok(done(status, error, exit_code, fuel, state, warnings));
        }
    }

    /// One execution of `code` with output forwarding and interrupt arming; the output not
    /// yet sent is left in `lines`.
    async fn run(
        &mut self,
        req: &CellRequest<'_>,
        code: &str,
        output: &mut Forwarder,
        interrupter: &Interrupter,
        fired: &Arc<AtomicBool>,
        lines: &mut Lines,
    ) -> std::io::Result<(RunEnd, Option<u64>)> {
        output.set_rich(req.rich);
        let tx = output.begin(req.cell, req.max_output);
        if let Some(h) = &self.host {
            h.begin(
                req.cell,
                req.nonce.clone(),
                req.host_calls,
                Instant::now() + req.timeout,
                tx.clone(),
            );
        }

        let token = CancellationToken::new();
        let host_call = self.host.clone().map(|h| {
            let take: Box<dyn Fn() -> bool + Send + Sync> = Box::new(move || h.interrupt());
            take
        });
        interrupter.arm(Target {
            token: token.clone(),
            fired: Arc::clone(fired),
            stop_guest: Target::epoch_advance(Arc::clone(&self.executor), ticks(req.timeout) + 3),
            host_call,
        });
        let initial_fuel = req.fuel.unwrap_or(u64::MAX);
        let end = if token.is_cancelled() {
            drop(tx);
            RunEnd::InterruptedBeforeStart
        } else {
            self.session.set_execution_timeout(Some(req.timeout));
            let mut builder = self.session.execute(code).with_output_streaming(tx);
            if let Some(f) = req.fuel {
                builder = builder.with_fuel_limit(f);
            }
            tokio::select! {
                biased;
                () = token.cancelled() => RunEnd::Dropped,
                r = builder.run() => RunEnd::Returned(r, None),
            }
        };
        // Before anything else touches the engine: a stop in progress finishes first, and
        // no later SIGINT advances the epoch under the next instance.
        interrupter.disarm();
        if let Some(h) = &self.host {
            // Its output sender goes before the output is gathered.
            h.end();
        }
        if matches!(end, RunEnd::Dropped) {
            self.dead = true;
        }
        let fuel_used = self
            .session
            .store()
            .and_then(|s| s.get_fuel().ok())
            .map(|left| initial_fuel.saturating_sub(left));
        // Every sender is gone: Eryx dropped its own with the execution (returned or dropped).
        let outcome = output.end(lines)?;
        let end = match end {
            RunEnd::Returned(r, _) => RunEnd::Returned(r, outcome),
            other => other,
        };
        Ok((end, fuel_used))
    }

    /// Lists the user's variables (`Inspect`): at most `max_items`, the user's code the driver
    /// calls given `budget` in all (see `driver.py`, "Inspect"). Not a cell: nothing is
    /// snapshotted and no output is forwarded. The execution's own limit is `budget` plus
    /// [`INSPECT_SLACK`]; when the guest outlives it (stuck in C code, or in a sleep the
    /// driver could not bound), the values not yet described get placeholders, the instance
    /// is dead and the next cell rebuilds it from the last snapshot (state `restored`).
    /// Everything the guest sent is bounded here before it leaves: names, types, reprs,
    /// shapes, count and the line's size (see `sandcell_proto::worker::Variable`).
    pub async fn inspect(&mut self, max_items: u64, budget: Duration) -> (Vec<Variable>, bool) {
        self.finish_cell().await;
        if self.dead {
            // Only a failed snapshot or rebuild leaves a dead instance between cells; the
            // next cell reports what became of the variables.
            return (Vec::new(), true);
        }
        let code = driver::inspect_code(max_items, budget.as_millis() as u64);
        let mut retried = false;
        loop {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            self.session
                .set_execution_timeout(Some(budget + INSPECT_SLACK));
            let r = self
                .session
                .execute(&code)
                .with_output_streaming(tx)
                .run()
                .await;
            let mut names: Option<driver::InspectNames> = None;
            let mut items: Vec<Option<driver::InspectItem>> = Vec::new();
            let mut received = 0usize;
            while let Ok(req) = rx.try_recv() {
                if req.stream != driver::INSPECT_STREAM {
                    continue;
                }
                received += req.data.len();
                if received > 4 * MAX_INSPECT_LINE {
                    break;
                }
                match &names {
                    None => {
                        if let Ok(n) = serde_json::from_slice::<driver::InspectNames>(&req.data) {
                            items = vec![None; n.names.len()];
                            names = Some(n);
                        }
                    }
                    Some(_) => {
                        if let Ok(item) = serde_json::from_slice::<driver::InspectItem>(&req.data)
                            && let Some(slot) = items.get_mut(item.i)
                        {
                            *slot = Some(item);
                        }
                    }
                }
            }
            let completed = match &r {
                Ok(_) => true,
                Err(EryxError::PythonException(text)) => {
                    if names.is_none() && !retried && driver::driver_missing(text) {
                        retried = true;
                        if self.install().await.is_ok() {
                            continue;
                        }
                    }
                    true
                }
                Err(_) => {
                    // Timed out, trapped or cancelled: the instance is gone.
                    self.dead = true;
                    false
                }
            };
            let Some(names) = names else {
                return (Vec::new(), true);
            };
            return listing(names, items, max_items, completed);
        }
    }

    /// Rebuilds the instance from the last snapshot as a timeout would (bench and tests);
    /// returns the resulting state, what was lost, and warnings.
    pub async fn force_rebuild(&mut self) -> (SessionState, Option<String>, Vec<String>) {
        self.rebuild().await
    }

    /// Takes a snapshot now and returns its duration and size (bench and tests).
    ///
    /// Errors: the driver could not pickle the namespace.
    pub async fn measure_snapshot(&mut self) -> Result<(Duration, usize), String> {
        let start = Instant::now();
        let (blob, _) = self.capture().await.map_err(|(why, _)| why)?;
        Ok((start.elapsed(), blob.len()))
    }
}

/// Time an `inspect` execution gets beyond its budget for the user's code.
pub const INSPECT_SLACK: Duration = Duration::from_millis(500);

/// The bounded listing of an `inspect` from the guest's names and items; a name without an
/// item gets `<repr timed out>` (the first) or `<repr skipped: time budget used up>` (the
/// rest) when the execution did not complete, `<repr failed: no answer>` when it did.
fn listing(
    names: driver::InspectNames,
    items: Vec<Option<driver::InspectItem>>,
    max_items: u64,
    completed: bool,
) -> (Vec<Variable>, bool) {
    let mut truncated = names.truncated;
    let mut out = Vec::new();
    let mut size = 128usize;
    let mut missing = 0usize;
    for ((name, kind), item) in names.names.into_iter().zip(items) {
        if out.len() as u64 >= max_items {
            truncated = true;
            break;
        }
        if name.is_empty() || name.starts_with('_') || name.len() > MAX_VARIABLE_NAME {
            truncated = true;
            continue;
        }
        let mut v = Variable {
            name,
            kind: bound_text(&kind, MAX_VARIABLE_TYPE - 64),
            size_bytes: None,
            shape: None,
            repr: String::new(),
        };
        match item {
            Some(it) => {
                v.size_bytes = it.size_bytes;
                v.shape = it.shape.filter(|s| s.len() <= MAX_SHAPE_DIMS);
                v.repr = short_repr(&it.repr);
            }
            None if completed => v.repr = "<repr failed: no answer>".into(),
            None => {
                v.repr = if missing == 0 {
                    "<repr timed out>".into()
                } else {
                    "<repr skipped: time budget used up>".into()
                };
                missing += 1;
            }
        }
        size += serde_json::to_vec(&v)
            .map(|b| b.len() + 1)
            .unwrap_or(usize::MAX / 2);
        if size > MAX_INSPECT_LINE {
            truncated = true;
            break;
        }
        out.push(v);
    }
    (out, truncated)
}

/// At most [`MAX_REPR_CHARS`] characters of `s`, a cut one ending with `...`.
fn short_repr(s: &str) -> String {
    if s.chars().count() <= MAX_REPR_CHARS {
        return s.to_owned();
    }
    let mut t: String = s.chars().take(MAX_REPR_CHARS - 3).collect();
    t.push_str("...");
    t
}

/// Maps the driver's outcome to a status, error and exit code.
fn map_driver(r: &DriverResult) -> (WorkerStatus, Option<CellError>, Option<i64>) {
    let err = r
        .error
        .as_ref()
        .map(|e| cell_error(&e.kind, &e.message, e.traceback.as_deref(), e.line));
    match r.status.as_str() {
        "ok" => (WorkerStatus::Ok, None, None),
        "exited" => (WorkerStatus::Exited, None, Some(r.exit_code.unwrap_or(0))),
        "memory_exhausted" => (WorkerStatus::MemoryExhausted, err, None),
        _ => (
            WorkerStatus::Error,
            err.or_else(|| {
                Some(cell_error(
                    "SandboxError",
                    "the cell driver reported an unknown outcome",
                    None,
                    None,
                ))
            }),
            None,
        ),
    }
}

mod query;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_exit_is_read_from_the_error_chain_and_a_trap_is_not() {
        let exit = "WASM execution error: error while executing at wasm backtrace:\n    \
                    0: 0xeced2e - libc.so!exit_exit\n\nCaused by:\n    Exited with i32 exit status 1";
        assert_eq!(guest_exit_code(exit), Some(1));
        assert_eq!(guest_exit_code("Exited with i32 exit status 0\n"), Some(0));
        assert_eq!(guest_exit_code("Exited with i32 exit status -2"), Some(-2));
        let trap = "WASM execution error: error while executing at wasm backtrace:\n\nCaused by:\n    \
                    wasm trap: call stack exhausted";
        assert_eq!(guest_exit_code(trap), None);
        assert_eq!(guest_exit_code("Exited with i32 exit status x"), None);
        assert_eq!(
            guest_exit_code("Exited with i32 exit status 99999999999"),
            None
        );
    }

    #[test]
    fn exception_text_gives_type_and_message() {
        let e = parse_exception_text(
            "Traceback (most recent call last):\n  File \"<user>\", line 1\nValueError: bad: value\n",
        );
        assert_eq!(
            (e.kind.as_str(), e.message.as_str()),
            ("ValueError", "bad: value")
        );
        let e = parse_exception_text("KeyboardInterrupt\n");
        assert_eq!(
            (e.kind.as_str(), e.message.as_str()),
            ("KeyboardInterrupt", "")
        );
    }

    #[test]
    fn driver_outcomes_map_to_statuses() {
        let r = DriverResult {
            status: "exited".into(),
            exit_code: Some(3),
            ..Default::default()
        };
        assert_eq!(map_driver(&r), (WorkerStatus::Exited, None, Some(3)));
        let r = DriverResult {
            status: "weird".into(),
            ..Default::default()
        };
        assert_eq!(map_driver(&r).0, WorkerStatus::Error);
        assert!(map_driver(&r).1.is_some());
    }

    #[test]
    fn inspect_listings_are_bounded_and_filled() {
        let names = driver::InspectNames {
            names: vec![
                ("a".into(), "int".into()),
                ("_hidden".into(), "int".into()),
                ("b".into(), "t".repeat(1000)),
                ("c".into(), "int".into()),
                ("d".into(), "int".into()),
            ],
            truncated: false,
        };
        let item = |i, repr: &str| {
            Some(driver::InspectItem {
                i,
                size_bytes: Some(28),
                shape: None,
                repr: repr.into(),
            })
        };
        let items = vec![
            item(0, "1"),
            item(1, "2"),
            item(2, &"x".repeat(500)),
            None,
            None,
        ];
        let (vars, truncated) = listing(names, items, 10, false);
        assert!(truncated, "the hidden name was left out");
        assert_eq!(vars.len(), 4);
        for v in &vars {
            assert_eq!(v.check(), Ok(()), "{v:?}");
        }
        assert_eq!(vars[0].repr, "1");
        assert_eq!(vars[1].repr.chars().count(), MAX_REPR_CHARS);
        assert_eq!(vars[2].repr, "<repr timed out>");
        assert_eq!(vars[3].repr, "<repr skipped: time budget used up>");
        let names = driver::InspectNames {
            names: vec![("a".into(), "int".into()), ("b".into(), "int".into())],
            truncated: false,
        };
        let (vars, truncated) = listing(names, vec![None, None], 1, true);
        assert_eq!((vars.len(), truncated), (1, true));
        assert_eq!(vars[0].repr, "<repr failed: no answer>");
    }

    #[test]
    fn long_messages_are_bounded() {
        let e = cell_error(
            "E",
            &"x".repeat(MAX_ERROR_MESSAGE * 3),
            Some(&"t".repeat(MAX_TRACEBACK * 2)),
            None,
        );
        assert!(e.message.len() < MAX_ERROR_MESSAGE + 64);
        assert!(e.traceback.unwrap().len() < MAX_TRACEBACK + 64);
    }
}
