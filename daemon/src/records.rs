//! Session records: what a successor daemon needs to adopt a live session, written by the
//! daemon only, in a root-only directory (`adopt_dir`, default `/run/sandcell/adopt`, mode
//! 0700, on tmpfs: a reboot, which ends every worker, also forgets every record).
//!
//! One JSON file per session, `<adopt_dir>/<id>.json`, mode 0600, replaced atomically (a
//! temporary file in the same directory renamed over it; rename(2)), written when the session
//! opens and after each cell; removed when the session ends. The keepers' sockets are in
//! `<adopt_dir>/keepers/<id>.sock`. Nothing a tenant can write is read: the directory and the
//! files are root's, and every field that names a process is checked against the live
//! process before it is trusted (`crate::adopt`).

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Version of the record format; a record of another version is not adopted.
pub const VERSION: u32 = 1;

/// Most bytes of one record file read.
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// A process named for good: its pid and its start time (`/proc/<pid>/stat` field 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcId {
    /// The pid.
    pub pid: u32,
    /// Start time, clock ticks since boot.
    pub start_time: u64,
}

/// A session's limits as recorded (durations in milliseconds, sizes in bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Wall time of one cell, ms.
    pub wall_ms: u64,
    /// Fuel of one Python cell.
    pub fuel: u64,
    /// Guest memory, bytes.
    pub guest_memory: u64,
    /// stdout bytes kept per cell.
    pub stdout: u64,
    /// stderr bytes kept per cell.
    pub stderr: u64,
    /// Kill grace, ms.
    pub grace_ms: u64,
    /// Disk budget, bytes.
    pub files_bytes: u64,
    /// Host-call opt-in: the call timeout, ms.
    pub host_calls_ms: Option<u64>,
    /// Whether cells show their last expression.
    pub display: bool,
    /// Whether cells send rich output (display frames); absent in older records: off.
    #[serde(default)]
    pub rich: bool,
}

impl From<&crate::session::SessionLimits> for Limits {
    fn from(l: &crate::session::SessionLimits) -> Self {
        Limits {
            wall_ms: l.wall.as_millis() as u64,
            fuel: l.fuel,
            guest_memory: l.guest_memory,
            stdout: l.stdout,
            stderr: l.stderr,
            grace_ms: l.grace.as_millis() as u64,
            files_bytes: l.files_bytes,
            host_calls_ms: l.host_calls.map(|d| d.as_millis() as u64),
            display: l.display,
            rich: l.rich,
        }
    }
}

impl From<&Limits> for crate::session::SessionLimits {
    fn from(l: &Limits) -> Self {
        use std::time::Duration;
        crate::session::SessionLimits {
            wall: Duration::from_millis(l.wall_ms),
            fuel: l.fuel,
            guest_memory: l.guest_memory,
            stdout: l.stdout,
            stderr: l.stderr,
            grace: Duration::from_millis(l.grace_ms),
            files_bytes: l.files_bytes,
            host_calls: l.host_calls_ms.map(Duration::from_millis),
            display: l.display,
            rich: l.rich,
        }
    }
}

/// One live session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// [`VERSION`].
    pub version: u32,
    /// Session id (32 hex digits).
    pub id: String,
    /// The owner's uid and gid.
    pub owner_uid: u32,
    /// The owner's gid.
    pub owner_gid: u32,
    /// `python` or `r`.
    pub language: String,
    /// Environment name.
    pub environment: String,
    /// The engine string of the worker's `Ready`.
    pub engine: String,
    /// How an interrupt is aimed: `process_group`, `process`, `main_thread`.
    pub interrupt: String,
    /// Native worker: output on raw stdout/stderr pipes.
    pub raw_output: bool,
    /// Limits in force.
    pub limits: Limits,
    /// Detached: idle seconds it survives its connection.
    pub detached_idle_seconds: Option<u64>,
    /// Opened at, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// Last activity (open or a cell's end), ms since the Unix epoch: the idle deadline is
    /// this plus the idle time.
    pub last_activity_unix_ms: u64,
    /// Admission charge: guest memory, bytes.
    pub charge_guest_memory: u64,
    /// Admission charge: worker memory, bytes.
    pub charge_worker_memory: u64,
    /// The number the next cell gets.
    pub next_cell: u64,
    /// Cells finished.
    pub cells_run: u64,
    /// Host calls made so far (the next must be one more).
    pub host_calls_made: u64,
    /// The tokens of the newest cells started with one (`Info::tokens`): cell number and
    /// token, oldest first. A successor keeps those that pass `check_cell_token`, at most
    /// `CELL_TOKENS_KEPT`. Absent in records of older daemons.
    #[serde(default)]
    pub tokens: Vec<(u64, String)>,
    /// The cell running when the record was written, if any.
    pub running_cell: Option<u64>,
    /// What a successor needs to continue that cell, once its request reached the worker
    /// (absent while the request is being written, and in records of older daemons: such a
    /// cell is not continued, its session ends `daemon_restarted`).
    #[serde(default)]
    pub running: Option<RunningCell>,
    /// Where cell `running_cell` is while `running` does not describe it (the few
    /// milliseconds before its request reaches the worker, and after its result is known):
    /// whether a successor may adopt the session idle. Absent in records of older daemons and
    /// while the request is being written: the session then ends `daemon_restarted`, since
    /// the worker may hold part of a request.
    #[serde(default)]
    pub pending: Option<PendingCell>,
    /// The hosts of the session's egress grant, when it has one; its keeper holds the
    /// listener, which a successor grants again within the environment's allowlist then in
    /// force.
    #[serde(default)]
    pub egress_hosts: Option<Vec<String>>,
    /// The session's egress counters as last read from the proxy when the record was
    /// written (they are read every 2 s; the record is written at each cell's start and
    /// end): a successor grants the session again from these, unless the proxy, which keeps
    /// a revoked session's counters for an hour, knows larger ones.
    #[serde(default)]
    pub egress_counts: Option<crate::egress::Counts>,
    /// The keeper.
    pub keeper: ProcId,
    /// The worker.
    pub worker: ProcId,
    /// The worker's uid (`None`: the daemon's, development).
    pub worker_uid: Option<u32>,
    /// The session cgroup's `cgroup.procs` files.
    pub cgroup_procs: Vec<PathBuf>,
    /// The session directory.
    pub session_dir: PathBuf,
}

/// Cell `running_cell` of a record whose `running` does not describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingCell {
    /// Where the cell is.
    pub stage: PendingStage,
    /// The cell of a one-shot `Run`: its session is not adopted (its caller is gone).
    pub one_shot: bool,
}

/// [`PendingCell::stage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PendingStage {
    /// No byte of the cell's request was written to the worker: the worker waits for a
    /// request, and the cell never ran (its client's call was cut).
    BeforeRequest,
    /// The request is being written: the worker may hold part of it.
    WritingRequest,
    /// The worker's `done` was read and the session goes on: the worker waits for its next
    /// request (the result went with the client's connection).
    Ended,
}

/// The cell a session was running when its record was written, as a successor continues it
/// (`session::keep`). Its retained output so far is in the session's journal
/// ([`journal_path`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunningCell {
    /// The cell's number.
    pub cell: u64,
    /// The request's nonce, which the worker's `done` echoes (16 hex digits).
    pub nonce: String,
    /// When the cell started, ms since the Unix epoch: its wall time counts from here, so
    /// the time the daemon was away counts too.
    pub started_unix_ms: u64,
    /// Its frames go through a relay that retains them (`Submit`, or `Execute` on a detached
    /// session): the successor continues it and keeps retaining. Otherwise the `Execute`
    /// that started it went with the daemon's connection: the successor interrupts it, as
    /// for a client that goes away during a cell, and the session stays.
    pub retained: bool,
    /// `running`, `interrupted` (an `Interrupt` was delivered) or `timed_out` (past its wall
    /// time): the escalation the successor resumes.
    pub phase: String,
    /// CPU seconds of the worker when the cell started (for `usage.cpu_seconds`).
    pub cpu0: Option<f64>,
    /// A host call of the cell waiting for its answer: the successor answers it with an
    /// error (the client that was to answer it is gone).
    #[serde(default)]
    pub host_waiting: Option<u64>,
    /// The cell of a one-shot `Run`: nothing is left to keep once its caller is gone, so a
    /// successor ends the session (`daemon_restarted`) instead of continuing it.
    #[serde(default)]
    pub one_shot: bool,
    /// The record was made just before the cell's request was written with one write(2)
    /// into the worker's empty request pipe, which takes all of it or none: Linux's pipe
    /// write (fs/pipe.c, `pipe_write`) copies the whole of a non-blocking write that fits
    /// the free slots (pipe(7) promises that only up to `PIPE_BUF`; a short count makes the
    /// writer take the record's offer back before it writes on). A successor that finds
    /// it set asks the pipes whether it arrived ([`crate::session::keep`]): bytes still in
    /// the request pipe, or any line on the reply pipe (the worker writes `started` first
    /// when a request is whole), say it did; neither within [`UNCONFIRMED_WAIT`] says it
    /// did not, and the session is adopted idle.
    #[serde(default)]
    pub unconfirmed: bool,
}

/// How long a successor waits for the reply pipe of a worker whose record is
/// [`RunningCell::unconfirmed`] and whose request pipe is empty, before it concludes that
/// the request never reached the worker: 2 s. A worker that read its request writes
/// `started` at once; the wait covers one that was not scheduled meanwhile.
pub const UNCONFIRMED_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The journal of session `id`'s running cell: its retained output and counts, appended as
/// frames leave the actor (`session::journal`), at most [`JOURNAL_MAX_BYTES`].
pub fn journal_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.cell"))
}

/// The listing of session `id`'s directory before its running cell
/// (`crate::files::Listing::encode_stamps`), from which a successor that continues the cell
/// lists the files it changed.
pub fn before_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.before"))
}

/// The spool of `stream` (`stdout`, `stderr` or `replies`) of session `id`'s running
/// retained cell: the bytes taken from that worker pipe, moved there with splice(2) before
/// the daemon reads them, so a successor continues the stream where the journal says
/// (`session::spool`).
pub fn spool_path(dir: &Path, id: &str, stream: &str) -> PathBuf {
    dir.join(format!("{id}.spool-{stream}"))
}

/// The reply bytes a daemon that exited keeping its sessions had read from session `id`'s
/// worker and not yet handled (a frame's head, or whole frames), which its successor reads
/// first.
pub fn rest_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.rest"))
}

/// Most bytes of a running cell's journal: the per-session retention bound
/// (`sandcell_proto::kernel::SESSION_RETAINED_BYTES`, 1 MiB).
pub const JOURNAL_MAX_BYTES: u64 = sandcell_proto::kernel::SESSION_RETAINED_BYTES;

/// Session `id`'s egress counters as last read from the proxy (JSON
/// [`crate::egress::Counts`]), rewritten at each read that changed them (every
/// [`crate::egress::COUNTERS_EVERY`]), so that a successor whose proxy died with its
/// predecessor goes on from at most one read interval behind, not from the record's counters
/// of the cell's start.
pub fn egress_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.egress"))
}

/// Most bytes of an egress counters file read: four counters of at most 20 digits.
pub const MAX_EGRESS_BYTES: u64 = 4096;

/// Writes session `id`'s egress counters `c` atomically beside its record (mode 0600).
///
/// Errors: the file cannot be written or renamed.
pub fn write_egress(dir: &Path, id: &str, c: &crate::egress::Counts) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(c).map_err(std::io::Error::other)?;
    write_atomic(
        &dir.join(format!(".{id}.egress.tmp")),
        &egress_path(dir, id),
        &bytes,
    )
}

/// Writes `bytes` to `to` through `tmp` (mode 0600, not following a link), renamed over it.
fn write_atomic(tmp: &Path, to: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(tmp, to)
}

/// The bytes of `path` when it is a regular root-only file (uid 0, no group or other
/// permission) of at most `max` bytes, not reached through a link.
///
/// Errors: why not, as text.
fn read_root_only(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    if !m.is_file() || m.uid() != 0 || m.mode() & 0o077 != 0 {
        return Err("not a root-only regular file".to_string());
    }
    let mut buf = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|e| e.to_string())?;
    if buf.len() as u64 > max {
        return Err(format!("longer than {max} bytes"));
    }
    Ok(buf)
}

/// Session `id`'s egress counters written by [`write_egress`]; `None` when there are none, or
/// the file is not a root-only regular file of at most [`MAX_EGRESS_BYTES`] holding them.
pub fn read_egress(dir: &Path, id: &str) -> Option<crate::egress::Counts> {
    let buf = read_root_only(&egress_path(dir, id), MAX_EGRESS_BYTES).ok()?;
    serde_json::from_slice(&buf).ok()
}

/// `<dir>/keepers`, where keepers listen.
pub fn keepers_dir(dir: &Path) -> PathBuf {
    dir.join("keepers")
}

/// The socket of session `id`'s keeper.
pub fn keeper_socket(dir: &Path, id: &str) -> PathBuf {
    keepers_dir(dir).join(format!("{id}.sock"))
}

/// Creates `dir` and its `keepers` directory, root-only (0700).
///
/// Errors: the directories cannot be made or their mode set.
pub fn prepare(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for d in [dir.to_path_buf(), keepers_dir(dir)] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&d)?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

fn path_of(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.json"))
}

/// Writes `r` atomically (temporary file, mode 0600, renamed over the old record).
///
/// Errors: the file cannot be written or renamed.
pub fn write(dir: &Path, r: &Record) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    write_atomic(
        &dir.join(format!(".{}.tmp", r.id)),
        &path_of(dir, &r.id),
        &bytes,
    )
}

/// Removes session `id`'s record, its cell journal and spools, its listing before the cell,
/// its egress counters and its keeper's socket (absent ones are not an error).
pub fn remove(dir: &Path, id: &str) {
    let _ = std::fs::remove_file(path_of(dir, id));
    let _ = std::fs::remove_file(journal_path(dir, id));
    let _ = std::fs::remove_file(rest_path(dir, id));
    let _ = std::fs::remove_file(before_path(dir, id));
    let _ = std::fs::remove_file(egress_path(dir, id));
    for stream in ["stdout", "stderr", "replies"] {
        let _ = std::fs::remove_file(spool_path(dir, id, stream));
    }
    let _ = std::fs::remove_file(keeper_socket(dir, id));
}

/// Whether `dir` holds a file named like a record (`<session id>.json`), read or not: a hint
/// that the previous daemon kept sessions, trusted for nothing else.
pub fn any(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .is_some_and(|id| sandcell_proto::kernel::SessionId::parse(id).is_ok())
        })
    })
}

/// Every record in `dir`: `(id, record or why it is unreadable)`. A file that is not a
/// regular root-owned file of at most [`MAX_RECORD_BYTES`] is unreadable.
pub fn read_all(dir: &Path) -> Vec<(String, Result<Record, String>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
            continue;
        };
        if sandcell_proto::kernel::SessionId::parse(id).is_err() {
            continue;
        }
        let read = (|| {
            let buf = read_root_only(&e.path(), MAX_RECORD_BYTES)?;
            let r: Record = serde_json::from_slice(&buf).map_err(|e| e.to_string())?;
            if r.version != VERSION || r.id != id {
                return Err("another version, or another session's id".into());
            }
            Ok(r)
        })();
        out.push((id.to_string(), read));
    }
    out
}

/// Milliseconds since the Unix epoch of `t`.
pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
