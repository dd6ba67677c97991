//! The capacity file for schedulers: the daemon's figures in the Prometheus text exposition
//! format (version 0.0.4), written to `metrics_file` for a node exporter's textfile collector
//! (node_exporter `--collector.textfile.directory`), so the daemon needs no network listener.
//!
//! - **What**: the figures of the D-Bus `ActiveSessions`, `Admission` and `Pools` properties
//!   (one source: the same core calls), worker uids, connections, retained output, the
//!   daemon-wide per-uid maxima, and counters since start (cells by status, sessions opened
//!   and ended, OOM kills, egress requests and bytes summed over sessions). Every sample carries the `node` label (`node_id`, empty when ids
//!   are not qualified). Units are in the names (`_bytes`, `_seconds`, `_total`; counts of
//!   sessions, workers, uids and connections have none). Per-uid *use* is not written: the
//!   file is world-readable (0644), and which uids use the service is shown on D-Bus only to
//!   root and holders of `org.sandcell.manage-sessions`; nor are session ids or owners.
//! - **When**: from the main loop's one-second tick, every `metrics_interval_seconds`. The
//!   figures are gathered and rendered on the loop (short lock holds, a few KiB of text); the
//!   file is written on the blocking pool, at most one write at a time: a write still in
//!   progress (a slow or hung file system) makes the next ones skip, and the loop never waits
//!   for it.
//! - **Where**: the daemon is root and rewrites, then removes, the file by name, so the path
//!   must not let anyone else choose what gets replaced: no symlink anywhere in it
//!   (`openat2(RESOLVE_NO_SYMLINKS)`), a directory owned by the daemon's user and writable by
//!   no one else, and the name itself absent or a regular file of the daemon's (never a
//!   socket such as the daemon's own, a directory, or another user's file). All later steps
//!   are `*at` calls on that directory. A path that fails these checks is refused (logged as
//!   any failure) and nothing is written.
//! - **How**: a temporary `.<name>.tmp` in the same directory (`O_EXCL | O_NOFOLLOW`, mode
//!   0644 whatever the umask), then `rename(2)` over the file, so a reader sees the old file
//!   or the new one, never part of one; no fsync (the file lives in `/run`, and a crash loses
//!   nothing that the next write does not restore). A temporary never matches `*.prom`.
//! - **Failures** are logged, rate-limited (the first, then at most one line per
//!   [`LOG_EVERY`] with the count since the last line, and one line when writes work again);
//!   they never stop the daemon.
//! - **Exit**: a clean exit (stop, idle exit) removes the file, so an exporter never reports
//!   the capacity of a daemon that is gone. After a crash the file stays until the next
//!   daemon rewrites it; `sandcell_metrics_timestamp_seconds` (and node_exporter's
//!   `node_textfile_mtime_seconds`) tell its age. Samples carry no timestamps: the textfile
//!   collector refuses them.

use crate::core::Core;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, unlinkat};
use sandcell_proto::kernel::Status;
use std::ffi::{CStr, CString};
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

/// Shortest gap between two log lines about failed writes.
pub const LOG_EVERY: Duration = Duration::from_secs(300);

/// Slack of the due check against the main loop's one-second tick.
const TICK_SLACK: Duration = Duration::from_millis(500);

/// How long a clean exit waits for a write in progress, then for the removal.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// One warm pool's figures (the D-Bus `Pools` row): workers, and counts since start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFigures {
    /// Environment name.
    pub environment: String,
    /// Idle warm workers now.
    pub idle: u64,
    /// Workers the pool aims to keep now.
    pub target: u64,
    /// Configured minimum, as last applied.
    pub min: u64,
    /// Configured maximum, as last applied.
    pub max: u64,
    /// Workers taken from the pool since start.
    pub taken: u64,
    /// Opens that found no idle worker since start.
    pub missed: u64,
}

/// Everything the file says, gathered at one moment. Sizes in bytes, times in seconds since
/// the Unix epoch, the rest counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Node identifier (the `node` label of every sample).
    pub node: String,
    /// sandcelld's version.
    pub version: String,
    /// cgroup mode (`v2`, `v1`, `none`).
    pub cgroups: String,
    /// When the daemon started.
    pub started: f64,
    /// When this snapshot was taken.
    pub now: f64,
    /// Sessions alive (D-Bus `ActiveSessions`).
    pub sessions: u64,
    /// Workers being started for a client.
    pub starting: u64,
    /// Admission use: sessions (idle pooled workers included), guest and worker memory.
    pub used: crate::admission::Budgets,
    /// Admission budgets.
    pub max: crate::admission::Budgets,
    /// Per-uid maxima (configuration; per-uid use is not written).
    pub per_uid: crate::admission::UidBudgets,
    /// Client uids holding sessions now (a count, no uid).
    pub client_uids: u64,
    /// Worker uids leased now, and the range's size.
    pub worker_uids: (u64, u64),
    /// Open client connections and their cap.
    pub connections: (u64, u64),
    /// Retained output charged daemon-wide now, and its budget.
    pub retained: (u64, u64),
    /// Warm pools, in environment name order.
    pub pools: Vec<PoolFigures>,
    /// Cells finished since start, by status, in [`Status::ALL`] order.
    pub cells: Vec<(Status, u64)>,
    /// Sessions opened since start.
    pub sessions_opened: u64,
    /// Sessions ended since start.
    pub sessions_ended: u64,
    /// Workers OOM-killed since start.
    pub oom_kills: u64,
    /// Egress through the proxy since start, summed over sessions (ended sessions' final
    /// figures, live ones' latest: [`crate::egress::totals`]).
    pub egress: crate::egress::Counts,
}

fn epoch_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// When this process started (the first call; `Writer::new` makes it early).
fn process_start() -> SystemTime {
    static T: OnceLock<SystemTime> = OnceLock::new();
    *T.get_or_init(SystemTime::now)
}

impl Snapshot {
    /// The figures of `core` now.
    pub fn of(core: &Core) -> Snapshot {
        let (max, used) = core.admission();
        let (per_uid, uids) = core.uid_admission();
        let cfg = core.config();
        let c = crate::counters::counters();
        Snapshot {
            node: core.node_id().to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            cgroups: core.cgroup_mode().to_owned(),
            started: epoch_seconds(process_start()),
            now: epoch_seconds(SystemTime::now()),
            sessions: core.sessions().len() as u64,
            starting: core.starting_sessions().len() as u64,
            used,
            max,
            per_uid,
            client_uids: uids.iter().filter(|(_, u)| u.sessions > 0).count() as u64,
            worker_uids: core.worker_uids(),
            connections: (core.connection_count(), cfg.daemon.max_connections),
            retained: (
                crate::cells::daemon_use(),
                sandcell_proto::kernel::DAEMON_RETAINED_BYTES,
            ),
            pools: core
                .pool()
                .rows(&core.config())
                .into_iter()
                .map(
                    |(environment, idle, target, min, max, taken, missed)| PoolFigures {
                        environment,
                        idle: idle.into(),
                        target: target.into(),
                        min: min.into(),
                        max: max.into(),
                        taken,
                        missed,
                    },
                )
                .collect(),
            cells: Status::ALL.iter().map(|s| (*s, c.cells(*s))).collect(),
            sessions_opened: c.sessions_opened(),
            sessions_ended: c.sessions_ended(),
            oom_kills: c.oom_kills(),
            egress: crate::egress::totals(),
        }
    }

    /// The exposition text: `# HELP`, `# TYPE` and the samples of each metric family, one
    /// family at a time, each sample labelled with the node; ends with a newline.
    pub fn render(&self) -> String {
        let mut out = Exposition::new(&self.node);
        self.render_daemon(&mut out);
        self.render_admission(&mut out);
        self.render_limits(&mut out);
        self.render_pools(&mut out);
        self.render_counters(&mut out);
        out.text
    }

    /// The daemon itself: up, version, start time, this file's time, sessions alive and starting.
    fn render_daemon(&self, out: &mut Exposition<'_>) {
        out.family(
            "sandcell_up",
            "gauge",
            "1 while sandcelld runs (the file is removed when it stops).",
        )
        .sample(&[], 1);
        out.family(
            "sandcell_build_info",
            "gauge",
            "sandcelld's version and cgroup mode; always 1.",
        )
        .sample(&[("version", &self.version), ("cgroups", &self.cgroups)], 1);
        out.family(
            "sandcell_start_time_seconds",
            "gauge",
            "When sandcelld started, seconds since the Unix epoch.",
        )
        .sample_f(&[], self.started);
        out.family(
            "sandcell_metrics_timestamp_seconds",
            "gauge",
            "When this file was written, seconds since the Unix epoch.",
        )
        .sample_f(&[], self.now);
        out.family(
            "sandcell_sessions",
            "gauge",
            "Sessions alive (one-shot runs included; D-Bus ActiveSessions).",
        )
        .sample(&[], self.sessions);
        out.family(
            "sandcell_sessions_starting",
            "gauge",
            "Workers being started for a client.",
        )
        .sample(&[], self.starting);
    }

    /// Admission: use and budget of sessions, guest memory and worker memory.
    fn render_admission(&self, out: &mut Exposition<'_>) {
        let budgets = [
            (
                "sandcell_admission_sessions",
                "Sessions charged to admission (idle pooled workers included).",
                self.used.sessions,
                "sandcell_admission_sessions_max",
                "max_concurrent_sessions: sessions alive at once.",
                self.max.sessions,
            ),
            (
                "sandcell_admission_guest_memory_bytes",
                "Guest memory charged to admission.",
                self.used.guest_memory,
                "sandcell_admission_guest_memory_max_bytes",
                "max_aggregate_guest_memory_bytes: the guest memory budget.",
                self.max.guest_memory,
            ),
            (
                "sandcell_admission_worker_memory_bytes",
                "Worker (cgroup) memory charged to admission.",
                self.used.worker_memory,
                "sandcell_admission_worker_memory_max_bytes",
                "max_aggregate_worker_memory_bytes: the worker memory budget.",
                self.max.worker_memory,
            ),
        ];
        for (name, help, used, max_name, max_help, max) in budgets {
            out.family(name, "gauge", help).sample(&[], used);
            out.family(max_name, "gauge", max_help).sample(&[], max);
        }
    }

    /// Per-uid maxima, uids, connections and retained output.
    fn render_limits(&self, out: &mut Exposition<'_>) {
        for (name, help, v) in [
            (
                "sandcell_uid_sessions_max",
                "max_sessions_per_uid: sessions of one client uid.",
                self.per_uid.sessions,
            ),
            (
                "sandcell_uid_detached_sessions_max",
                "max_detached_sessions_per_uid: detached sessions of one client uid.",
                self.per_uid.detached,
            ),
            (
                "sandcell_uid_guest_memory_max_bytes",
                "max_guest_memory_bytes_per_uid: guest memory of one client uid.",
                self.per_uid.guest_memory,
            ),
            (
                "sandcell_uid_worker_memory_max_bytes",
                "max_worker_memory_bytes_per_uid: worker memory of one client uid.",
                self.per_uid.worker_memory,
            ),
            (
                "sandcell_client_uids",
                "Client uids holding sessions now.",
                self.client_uids,
            ),
            (
                "sandcell_worker_uids",
                "Worker uids leased now (one per session and idle pooled worker).",
                self.worker_uids.0,
            ),
            (
                "sandcell_worker_uids_max",
                "worker_uid_count: the worker uid range.",
                self.worker_uids.1,
            ),
            (
                "sandcell_connections",
                "Client connections open.",
                self.connections.0,
            ),
            (
                "sandcell_connections_max",
                "max_connections: client connections open at once.",
                self.connections.1,
            ),
            (
                "sandcell_retained_output_bytes",
                "Retained cell output and results charged daemon-wide (Submit, detached sessions).",
                self.retained.0,
            ),
            (
                "sandcell_retained_output_max_bytes",
                "The daemon-wide retained output budget (retained_output_bytes).",
                self.retained.1,
            ),
        ] {
            out.family(name, "gauge", help).sample(&[], v);
        }
    }

    /// Warm pools, one sample per environment of each family.
    fn render_pools(&self, out: &mut Exposition<'_>) {
        type Pick = fn(&PoolFigures) -> u64;
        let pools: [(&str, &str, &str, Pick); 6] = [
            (
                "sandcell_pool_idle_workers",
                "gauge",
                "Warm workers idle, per environment.",
                |p| p.idle,
            ),
            (
                "sandcell_pool_target_workers",
                "gauge",
                "Warm workers the pool aims to keep now.",
                |p| p.target,
            ),
            (
                "sandcell_pool_min_workers",
                "gauge",
                "The pool's configured minimum, as last applied.",
                |p| p.min,
            ),
            (
                "sandcell_pool_max_workers",
                "gauge",
                "The pool's configured maximum, as last applied.",
                |p| p.max,
            ),
            (
                "sandcell_pool_taken_total",
                "counter",
                "Warm workers taken by sessions since start.",
                |p| p.taken,
            ),
            (
                "sandcell_pool_missed_total",
                "counter",
                "Opens that found no idle warm worker since start, while the environment had a pool.",
                |p| p.missed,
            ),
        ];
        for (name, kind, help, pick) in pools {
            let f = out.family(name, kind, help);
            for p in &self.pools {
                f.sample(&[("environment", &p.environment)], pick(p));
            }
        }
    }

    /// Counters since start: cells by status, sessions opened and ended, OOM kills, egress.
    fn render_counters(&self, out: &mut Exposition<'_>) {
        let f = out.family(
            "sandcell_cells_total",
            "counter",
            "Cells finished since start, by status.",
        );
        for (s, n) in &self.cells {
            f.sample(&[("status", s.as_str())], *n);
        }
        for (name, help, v) in [
            (
                "sandcell_sessions_opened_total",
                "Sessions opened since start (one-shot runs and readiness probes included).",
                self.sessions_opened,
            ),
            (
                "sandcell_sessions_ended_total",
                "Sessions ended and released since start.",
                self.sessions_ended,
            ),
            (
                "sandcell_oom_kills_total",
                "Workers the kernel OOM-killed since start.",
                self.oom_kills,
            ),
        ] {
            out.family(name, "counter", help).sample(&[], v);
        }
        let f = out.family(
            "sandcell_egress_requests_total",
            "counter",
            "Requests through the egress proxy since start, summed over sessions, by outcome.",
        );
        f.sample(&[("outcome", "allowed")], self.egress.allowed);
        f.sample(&[("outcome", "refused")], self.egress.refused);
        out.family(
            "sandcell_egress_bytes_total",
            "counter",
            "Bytes the egress proxy relayed since start (both directions), summed over sessions.",
        )
        .sample(&[], self.egress.bytes);
    }
}

/// An exposition being written: families and samples, each sample with the node label first.
struct Exposition<'a> {
    node: &'a str,
    text: String,
    family: &'static str,
}

impl<'a> Exposition<'a> {
    fn new(node: &'a str) -> Self {
        Exposition {
            node,
            text: String::with_capacity(8192),
            family: "",
        }
    }

    /// Starts the family `name` of `kind` (`gauge`, `counter`) with its `help` line.
    fn family(&mut self, name: &'static str, kind: &str, help: &str) -> &mut Self {
        let _ = writeln!(self.text, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        self.family = name;
        self
    }

    fn labels(&mut self, labels: &[(&str, &str)]) {
        let _ = write!(
            self.text,
            "{}{{node=\"{}\"",
            self.family,
            escape_label(self.node)
        );
        for (k, v) in labels {
            let _ = write!(self.text, ",{k}=\"{}\"", escape_label(v));
        }
        self.text.push('}');
    }

    /// One sample of the current family with an integer value.
    fn sample(&mut self, labels: &[(&str, &str)], value: u64) -> &mut Self {
        self.labels(labels);
        let _ = writeln!(self.text, " {value}");
        self
    }

    /// One sample with a fractional value (times; always finite here).
    fn sample_f(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.labels(labels);
        let _ = writeln!(self.text, " {value:.3}");
        self
    }
}

/// A label value as the exposition format writes it: `\` as `\\`, `"` as `\"`, a line feed
/// as `\n`.
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// A `# HELP` text as the exposition format writes it: `\` as `\\`, a line feed as `\n`.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The directory of `path`, opened for `*at` calls, and the file's name in it, after checking
/// that only the daemon's own user can change that directory.
///
/// The daemon runs as root and the file is rewritten and finally removed by name, so the
/// path must not let anyone else choose what gets replaced: the directory is opened with
/// `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` (no symlink anywhere in the path,
/// openat2(2); the equivalent walk of [`crate::resolve`] where a sandbox refuses openat2),
/// must be owned by the daemon's effective uid and writable by no group and no
/// other user. Errors: `InvalidInput` for a relative path or one without a file name,
/// `PermissionDenied` for a directory someone else could change, the open's own error
/// otherwise (`ELOOP` for a symlink).
fn open_parent(path: &Path) -> std::io::Result<(OwnedFd, CString)> {
    use std::os::unix::ffi::OsStrExt;
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_owned());
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(invalid("metrics_file needs a directory and a file name"));
    };
    if !path.is_absolute() {
        return Err(invalid("metrics_file must be an absolute path"));
    }
    let name = CString::new(name.as_bytes()).map_err(|_| invalid("metrics_file contains NUL"))?;
    let dir = crate::resolve::open(
        crate::resolve::cwd(),
        parent,
        libc::O_DIRECTORY | libc::O_RDONLY,
        0,
        crate::resolve::Scope::Anywhere,
    )?;
    let st = nix::sys::stat::fstat(&dir)?;
    if st.st_uid != nix::unistd::geteuid().as_raw() || st.st_mode & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the directory of metrics_file (owner uid {}, mode {:o}) must be the daemon's \
                 own and writable by no one else",
                st.st_uid,
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok((dir, name))
}

/// Whether `name` in `dir` is absent (`Ok(false)`) or a regular file of the daemon's user
/// (`Ok(true)`); anything else (a socket, a directory, a symlink, another user's file) is
/// `AlreadyExists` and is never replaced or removed.
fn ours(dir: &OwnedFd, name: &CStr) -> std::io::Result<bool> {
    match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Err(nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(e.into()),
        Ok(st)
            if st.st_mode & libc::S_IFMT == libc::S_IFREG
                && st.st_uid == nix::unistd::geteuid().as_raw() =>
        {
            Ok(true)
        }
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "metrics_file names something that is not a regular file of the daemon's; it is \
             left alone",
        )),
    }
}

/// The temporary a write goes through: `.<name>.tmp` beside the file.
fn temporary(name: &CStr) -> CString {
    let mut t = b".".to_vec();
    t.extend_from_slice(name.to_bytes());
    t.extend_from_slice(b".tmp");
    CString::new(t).expect("no NUL in a CStr")
}

/// Writes `text` to `path` atomically: a new temporary beside it (a leftover one of the
/// daemon's is removed first; `O_EXCL | O_NOFOLLOW`, mode 0644), renamed over `path`, all
/// relative to the directory [`open_parent`] checked. `path` itself must be absent or a
/// regular file of the daemon's ([`ours`]): the daemon never replaces a socket, a directory
/// or another user's file. The temporary is removed when any step fails. Blocking.
pub fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let (dir, name) = open_parent(path)?;
    ours(&dir, &name)?;
    let tmp = temporary(&name);
    if ours(&dir, &tmp)? {
        unlinkat(&dir, tmp.as_c_str(), UnlinkatFlags::NoRemoveDir)?;
    }
    let written = (|| -> std::io::Result<()> {
        let fd = nix::fcntl::openat(
            &dir,
            tmp.as_c_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_retain(0o644),
        )?;
        let mut f = std::fs::File::from(fd);
        // The unit's UMask=0077 would leave 0600: the exporter does not run as root.
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        f.write_all(text.as_bytes())?;
        drop(f);
        Ok(nix::fcntl::renameat(
            &dir,
            tmp.as_c_str(),
            &dir,
            name.as_c_str(),
        )?)
    })();
    if written.is_err() {
        let _ = unlinkat(&dir, tmp.as_c_str(), UnlinkatFlags::NoRemoveDir);
    }
    written
}

/// Removes `path` and a leftover temporary of it when they are regular files of the daemon's
/// ([`ours`]); returns whether `path` was there. Blocking.
fn remove(path: &Path) -> std::io::Result<bool> {
    let (dir, name) = open_parent(path)?;
    let tmp = temporary(&name);
    if ours(&dir, &tmp).unwrap_or(false) {
        let _ = unlinkat(&dir, tmp.as_c_str(), UnlinkatFlags::NoRemoveDir);
    }
    if !ours(&dir, &name)? {
        return Ok(false);
    }
    match unlinkat(&dir, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
        Err(nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(e.into()),
        Ok(()) => Ok(true),
    }
}

/// The main loop's writer of the capacity file: when a write is due, one in flight at most,
/// rate-limited failure lines.
#[derive(Debug)]
pub struct Writer {
    /// The file written last (removed when the path changes or at exit).
    current: Option<PathBuf>,
    /// When the last write was started.
    last: Option<Instant>,
    /// The write on the blocking pool, with the path it writes.
    in_flight: Option<(PathBuf, tokio::task::JoinHandle<std::io::Result<()>>)>,
    /// Failures (and skips) since the last line about them, and when that line was.
    failures: u64,
    logged: Option<Instant>,
}

impl Default for Writer {
    fn default() -> Self {
        Self::new()
    }
}

impl Writer {
    /// A writer that writes at its first [`Writer::tick`].
    pub fn new() -> Writer {
        process_start();
        Writer {
            current: None,
            last: None,
            in_flight: None,
            failures: 0,
            logged: None,
        }
    }

    fn failed(&mut self, path: &Path, what: &str, error: &dyn std::fmt::Display) {
        self.failures += 1;
        if self.logged.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::warn!(
                path = %path.display(),
                failures = self.failures,
                error = %error,
                "metrics file: {what} (logged at most every {} s; the daemon serves on)",
                LOG_EVERY.as_secs()
            );
            self.failures = 0;
            self.logged = Some(Instant::now());
        }
    }

    fn succeeded(&mut self, path: &Path) {
        if self.logged.take().is_some() {
            tracing::info!(path = %path.display(), failures = self.failures, "metrics file written again");
            self.failures = 0;
        }
    }

    /// Collects the result of a finished write; `false` while one is still in flight.
    async fn settle(&mut self) -> bool {
        let Some((path, handle)) = self.in_flight.take() else {
            return true;
        };
        if !handle.is_finished() {
            self.in_flight = Some((path, handle));
            return false;
        }
        match handle.await {
            Ok(Ok(())) => self.succeeded(&path),
            Ok(Err(e)) => self.failed(&path, "write failed", &e),
            Err(e) => self.failed(&path, "write task failed", &e),
        }
        true
    }

    /// Called on every tick of the main loop: starts a write of `core`'s figures when one is
    /// due (`metrics_interval_seconds` since the last one started) and none is in flight;
    /// removes the old file when `metrics_file` changed (reload) or was turned off. Never
    /// waits for I/O.
    pub async fn tick(&mut self, core: &Core) {
        let cfg = core.config();
        let path = &cfg.daemon.metrics_file;
        let interval = Duration::from_secs(cfg.daemon.metrics_interval_seconds);
        if !self.settle().await {
            if self.last.is_some_and(|t| t.elapsed() >= interval) {
                let p = self
                    .in_flight
                    .as_ref()
                    .map(|(p, _)| p.clone())
                    .unwrap_or_default();
                self.failed(
                    &p,
                    "a write is still in progress; this one is skipped",
                    &"slow file system",
                );
            }
            return;
        }
        let old = self.current.take_if(|c| c != path);
        if path.as_os_str().is_empty() {
            if let Some(old) = old {
                self.in_flight = Some((
                    old.clone(),
                    tokio::task::spawn_blocking(move || remove(&old).map(|_| ())),
                ));
            }
            return;
        }
        // The loop ticks once a second: half a tick of slack keeps a 1-s interval at 1 s.
        if self.current.is_some()
            && self
                .last
                .is_some_and(|t| t.elapsed() + TICK_SLACK < interval)
        {
            return;
        }
        let text = Snapshot::of(core).render();
        let target = path.clone();
        self.in_flight = Some((
            target.clone(),
            tokio::task::spawn_blocking(move || {
                if let Some(old) = old {
                    let _ = remove(&old);
                }
                write_atomic(&target, &text)
            }),
        ));
        self.current = Some(path.clone());
        self.last = Some(Instant::now());
    }

    /// At a clean exit: waits (at most 2 s) for a write in flight, then removes the file (at
    /// most 2 s more), so no exporter reports the capacity of a daemon that is gone.
    pub async fn finish(mut self) {
        if let Some((_, handle)) = self.in_flight.take() {
            let _ = tokio::time::timeout(EXIT_WAIT, handle).await;
        }
        let Some(path) = self.current.take() else {
            return;
        };
        let p = path.clone();
        match tokio::time::timeout(EXIT_WAIT, tokio::task::spawn_blocking(move || remove(&p))).await
        {
            Ok(Ok(Ok(true))) => tracing::info!(path = %path.display(), "metrics file removed"),
            Ok(Ok(Ok(false))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(path = %path.display(), error = %e, "metrics file: removal failed")
            }
            _ => {
                tracing::warn!(path = %path.display(), "metrics file: removal did not finish in time")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(node: &str) -> Snapshot {
        Snapshot {
            node: node.into(),
            version: "0.1.0".into(),
            cgroups: "v2".into(),
            started: 1_764_660_000.25,
            now: 1_764_660_100.5,
            sessions: 3,
            starting: 1,
            used: crate::admission::Budgets {
                sessions: 3,
                guest_memory: 402_653_184,
                worker_memory: 3 << 30,
            },
            max: crate::admission::Budgets {
                sessions: 16,
                guest_memory: 2 << 30,
                worker_memory: 18 << 30,
            },
            per_uid: crate::admission::UidBudgets {
                sessions: 12,
                detached: 6,
                guest_memory: 1 << 30,
                worker_memory: 12 << 30,
                starts_per_second: 20.0,
                start_burst: 40,
            },
            client_uids: 2,
            worker_uids: (4, 65_536),
            connections: (5, 1024),
            retained: (327_680, 64 << 20),
            pools: vec![PoolFigures {
                environment: "python".into(),
                idle: 2,
                target: 2,
                min: 2,
                max: 4,
                taken: 7,
                missed: 1,
            }],
            cells: Status::ALL.iter().map(|s| (*s, 0)).collect(),
            sessions_opened: 9,
            sessions_ended: 6,
            oom_kills: 0,
            egress: Default::default(),
        }
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        assert_eq!(escape_label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label("line\nnext"), "line\\nnext");
        assert_eq!(escape_label("plain-node_1.x"), "plain-node_1.x");
        assert_eq!(escape_help("a\\b\nc \"q\""), "a\\\\b\\nc \"q\"");
        let text = snapshot("we\"ird\\node\n").render();
        assert!(
            text.contains("sandcell_up{node=\"we\\\"ird\\\\node\\n\"} 1\n"),
            "{text}"
        );
        // No raw line feed inside a sample: every line is a comment or one sample.
        for line in text.lines() {
            assert!(
                line.starts_with("# ") || line.starts_with("sandcell_"),
                "{line:?}"
            );
        }
    }

    #[test]
    fn every_family_has_help_type_and_node_labelled_samples() {
        let text = snapshot("node-a").render();
        assert!(text.ends_with('\n'));
        let mut families = Vec::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            let name = line
                .strip_prefix("# HELP ")
                .and_then(|r| r.split(' ').next())
                .unwrap_or_else(|| panic!("expected a HELP line: {line:?}"));
            let kind = lines.next().unwrap();
            assert!(
                kind == format!("# TYPE {name} gauge") || kind == format!("# TYPE {name} counter"),
                "{kind}"
            );
            assert!(!families.contains(&name.to_owned()), "{name} twice");
            if kind.ends_with("counter") {
                assert!(name.ends_with("_total"), "{name}");
            }
            families.push(name.to_owned());
            while let Some(s) = lines.next_if(|l| !l.starts_with('#')) {
                assert!(s.starts_with(&format!("{name}{{node=\"node-a\"")), "{s}");
            }
        }
        for want in [
            "sandcell_up{node=\"node-a\"} 1",
            "sandcell_build_info{node=\"node-a\",version=\"0.1.0\",cgroups=\"v2\"} 1",
            "sandcell_sessions{node=\"node-a\"} 3",
            "sandcell_admission_worker_memory_bytes{node=\"node-a\"} 3221225472",
            "sandcell_admission_worker_memory_max_bytes{node=\"node-a\"} 19327352832",
            "sandcell_worker_uids{node=\"node-a\"} 4",
            "sandcell_pool_idle_workers{node=\"node-a\",environment=\"python\"} 2",
            "sandcell_pool_taken_total{node=\"node-a\",environment=\"python\"} 7",
            "sandcell_cells_total{node=\"node-a\",status=\"worker_crashed\"} 0",
            "sandcell_retained_output_bytes{node=\"node-a\"} 327680",
            "sandcell_metrics_timestamp_seconds{node=\"node-a\"} 1764660100.500",
        ] {
            assert!(text.lines().any(|l| l == want), "{want} missing:\n{text}");
        }
    }

    #[test]
    fn writes_are_atomic_renames_with_mode_0644() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.prom");
        write_atomic(&path, "a 1\n").unwrap();
        write_atomic(&path, "a 2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a 2\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        // A leftover temporary of the daemon's (a crash mid-write) is replaced.
        let tmp = dir.path().join(".metrics.prom.tmp");
        std::fs::write(&tmp, "half").unwrap();
        write_atomic(&path, "a 3\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a 3\n");
        assert!(!tmp.exists());
        // A symlink in the temporary's place is never followed, nor replaced.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        assert!(write_atomic(&path, "a 4\n").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a 3\n");
        std::fs::remove_file(&tmp).unwrap();
        // A directory that is gone: an error, nothing left behind.
        assert!(write_atomic(&dir.path().join("gone/metrics.prom"), "x").is_err());
        assert!(remove(&path).unwrap());
        assert!(!remove(&path).unwrap());
        assert!(!path.exists());
    }

    /// The daemon is root and rewrites and removes the file by name: a path that lets anyone
    /// else choose what gets replaced is refused, and nothing but a regular file of the
    /// daemon's is ever replaced or removed.
    #[test]
    fn only_a_private_directory_and_a_regular_file_of_ours_are_written() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        // A directory others may write to.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = write_atomic(&open.join("m.prom"), "x").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
        // A symlink anywhere in the path.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(write_atomic(&link.join("m.prom"), "x").is_err());
        assert!(!dir.path().join("m.prom").exists());
        // A relative path.
        assert!(write_atomic(Path::new("m.prom"), "x").is_err());
        // A socket (the daemon's own listening socket lives beside the default path), a
        // directory: left alone, by writes and by removal.
        let sock = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let e = write_atomic(&sock, "x").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
        assert!(remove(&sock).is_err());
        assert!(
            std::fs::symlink_metadata(&sock)
                .unwrap()
                .file_type()
                .is_socket()
        );
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(write_atomic(&sub, "x").is_err());
        assert!(sub.is_dir());
    }
}
