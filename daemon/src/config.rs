//! Operator configuration: `/etc/sandcell/sandcelld.toml`, then `SANDCELL_*` environment
//! overrides (higher precedence), then validation.
//!
//! The per-cell limits and their defaults come from an LLM gateway's embedded Eryx
//! interpreter, renamed for a service whose unit is the session. The daemon-wide budgets are
//! derived from the machine at start (the service is shared), and per-uid budgets keep room
//! for a second user:
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `max_source_bytes` | 65,536 | UTF-8 source bytes of one cell |
//! | `execution_wall_time_seconds` | 10 | wall time of one cell |
//! | `max_fuel` | 10,000,000,000 | WebAssembly fuel of one Python cell |
//! | `max_guest_memory_bytes` | 134,217,728 | Eryx guest memory of one session; admission charge |
//! | `max_stdout_bytes` | 65,536 | stdout bytes kept per cell |
//! | `max_stderr_bytes` | 65,536 | stderr bytes kept per cell |
//! | `max_concurrent_sessions` | machine: clamp(min(8 x nproc, W / 1 GiB), 2, 1024) | sessions (workers) alive at once, one-shot runs included |
//! | `max_aggregate_guest_memory_bytes` | max_concurrent_sessions x 128 MiB | admission budget of guest memory |
//! | `max_worker_memory_bytes` | 1,073,741,824 | cgroup memory.max of one worker |
//! | `max_aggregate_worker_memory_bytes` | machine: W = max(3/4 of MemTotal, 2 GiB), MiB-aligned | admission budget of worker memory |
//! | `max_sessions_per_uid` | total - max(1, total / 4) (1 when total is 1) | sessions of one client uid |
//! | `max_detached_sessions_per_uid` | max(1, max_sessions_per_uid / 2) | detached sessions of one uid |
//! | `max_guest_memory_bytes_per_uid` | total - max(one session, total / 4) | guest memory of one uid |
//! | `max_worker_memory_bytes_per_uid` | total - max(one session, total / 4) | worker memory of one uid |
//! | `max_detached_idle_seconds` | 86,400 | ceiling of a client's `detached_idle_seconds` |
//! | `max_starts_per_second_per_uid` | 20.0 | `Open`/`Run` per second of one uid (token bucket rate) |
//! | `max_start_burst_per_uid` | 40 | `Open`/`Run` in a burst of one uid (token bucket size) |
//! | `max_file_bytes` | 67,108,864 | one file uploaded to a session directory |
//! | `max_session_files_bytes` | 268,435,456 | regular files of one session directory, uploads checked against it |
//!
//! Named environments are `[environments.<name>]` tables (language, engine, default,
//! interpreter, library_paths, preload, pool_min, pool_max, enabled), merged with the shipped
//! `python` (Eryx, Python's default), `pydata` (native CPython) and `r` (native R, R's
//! default); see [`Config::environments`]. They have no environment overrides.
//!
//! Every key `k` has the override `SANDCELL_<K>` (upper case), e.g. `SANDCELL_MAX_FUEL`.
//! Validation: every number positive; one session's charges fit their aggregate
//! budgets; worker memory exceeds guest memory and is at least twice the session files; source at most 524,288 bytes and kept
//! stdout+stderr at most 2,097,152 bytes (the worker protocol's ceilings).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Default configuration file.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/sandcell/sandcelld.toml";

/// Protocol ceilings for one cell's source and its kept stdout + stderr, bytes (defined with
/// the protocol in `sandcell_proto::worker`).
pub use sandcell_proto::worker::{OUTPUT_CEILING, SOURCE_CEILING};

mod environments;
mod machine;
pub use environments::{
    EgressConfig, EgressSetting, Engine, Environment, EnvironmentConfig, shipped_environments,
};
pub use machine::{Machine, online_cpus, pool_sizes};

/// The operator's limits. All sizes in bytes, times in seconds.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// UTF-8 source bytes of one cell.
    pub max_source_bytes: u64,
    /// Wall time of one cell, seconds.
    pub execution_wall_time_seconds: f64,
    /// WebAssembly fuel of one Python cell.
    pub max_fuel: u64,
    /// Eryx guest memory of one Python session, and its admission charge.
    pub max_guest_memory_bytes: u64,
    /// stdout bytes kept per cell.
    pub max_stdout_bytes: u64,
    /// stderr bytes kept per cell.
    pub max_stderr_bytes: u64,
    /// Sessions alive at once (one-shot runs included).
    pub max_concurrent_sessions: u64,
    /// Admission budget of guest memory.
    pub max_aggregate_guest_memory_bytes: u64,
    /// cgroup memory limit of one worker.
    pub max_worker_memory_bytes: u64,
    /// Admission budget of worker memory.
    pub max_aggregate_worker_memory_bytes: u64,
    /// Bytes of one file uploaded to a session directory (`PutFile`).
    pub max_file_bytes: u64,
    /// Bytes of all regular files of one session directory (`st_size`); an upload that would
    /// exceed it is refused.
    pub max_session_files_bytes: u64,
    /// Sessions of one client uid alive at once; unset: `max_concurrent_sessions -
    /// max(1, max_concurrent_sessions / 4)` (1 when the total is 1).
    pub max_sessions_per_uid: Option<u64>,
    /// Detached sessions of one uid; unset: `max(1, max_sessions_per_uid / 2)`.
    pub max_detached_sessions_per_uid: Option<u64>,
    /// Guest memory of one uid's sessions, bytes; unset: the aggregate minus
    /// `max(max_guest_memory_bytes, aggregate / 4)`.
    pub max_guest_memory_bytes_per_uid: Option<u64>,
    /// Worker memory of one uid's sessions, bytes; unset: the aggregate minus
    /// `max(max_worker_memory_bytes, aggregate / 4)`.
    pub max_worker_memory_bytes_per_uid: Option<u64>,
    /// Ceiling of the `detached_idle_seconds` a client may ask for, seconds.
    pub max_detached_idle_seconds: u64,
    /// Session starts (`Open`, `Run`) per second of one uid: the refill rate of its token
    /// bucket.
    pub max_starts_per_second_per_uid: f64,
    /// Session starts of one uid in a burst: the size of its token bucket.
    pub max_start_burst_per_uid: u64,
}

/// Settings of the daemon itself (not limits).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Daemon {
    /// Exit after this many seconds with no session and no connection, when socket-activated;
    /// 0 never exits.
    pub idle_exit_seconds: u64,
    /// Seconds a worker has to become ready.
    pub worker_start_timeout_seconds: f64,
    /// Grace after a cell's wall time before the daemon interrupts, then kills, the worker.
    pub kill_grace_seconds: f64,
    /// Seconds a cell's host call waits for the client's `HostReply`; then the call raises
    /// in the cell. The wait also counts against the cell's wall time.
    pub host_call_timeout_seconds: f64,
    /// Directory of worker executables (`SANDCELL_WORKER_DIR`).
    pub worker_dir: PathBuf,
    /// Prepared Eryx runtime directory (see `sandcell-python-runtime prepare`).
    pub python_runtime_dir: PathBuf,
    /// State directory; session directories go in `<state_dir>/sessions`, created 0711
    /// root-owned (traversable, not listable).
    pub state_dir: PathBuf,
    /// Languages served.
    pub languages: Vec<String>,
    /// First uid of the per-session worker identity range.
    pub worker_uid_base: u32,
    /// Number of uids in the range (caps sessions alive at once too).
    pub worker_uid_count: u32,
    /// pids.max of a session's cgroup.
    pub max_worker_pids: u64,
    /// cpu.max quota of a session as a fraction of one CPU (e.g. 1.0 = one core); 0 = no cap.
    pub worker_cpus: f64,
    /// On cgroup v1 hosts, the group (in each of the memory, pids and cpu hierarchies) under
    /// which `sessions/<id>` groups are made; one name per daemon instance. Ignored on v2, where
    /// the delegated root is the service's own group.
    pub cgroup_name: String,
    /// Whether any warm pool is kept (false: every pool size counts as 0).
    pub pools: bool,
    /// Warm workers of Python's default environment kept idle at least (0 = no pool); unset:
    /// derived from the machine and the budgets ([`pool_sizes`]).
    pub pool_python_min: Option<usize>,
    /// Warm workers of Python's default environment kept idle at most, while sessions are
    /// being opened; unset: as `pool_python_min` when that is set, else derived.
    pub pool_python_max: Option<usize>,
    /// Warm workers of R's default environment kept idle at least (0 = no pool); unset:
    /// derived.
    pub pool_r_min: Option<usize>,
    /// Warm workers of R's default environment kept idle at most; unset: as `pool_r_min`
    /// when that is set, else derived.
    pub pool_r_max: Option<usize>,
    /// Warm workers started per second at most.
    pub pool_refill_per_second: f64,
    /// Seconds without a take after which a pool shrinks back to its minimum.
    pub pool_idle_seconds: u64,
    /// Seconds without a take (counted from the pool's first round when nothing was ever
    /// taken) after which a pool empties entirely, so an idle machine keeps no warm worker;
    /// 0 = keep `min` for ever.
    pub pool_empty_seconds: u64,
    /// Client connections open at once; one more is closed at once (and logged).
    pub max_connections: u64,
    /// Client connections of one uid open at once.
    pub max_connections_per_uid: u64,
    /// Seconds after which a connection with no call in flight and no session it owns is
    /// closed.
    pub connection_idle_seconds: u64,
    /// A client that hangs up during an `Execute` on a detached session interrupts its cell
    /// (false: the cell runs on, its output retained for `Attach` as for `Submit`). Either
    /// way its status is kept for `CellStatus`. Sessions that end with their connection end.
    pub interrupt_on_hangup: bool,
    /// The node identifier in session ids (`<node>.<local id>`): 1 to 64 characters of
    /// `[A-Za-z0-9._-]`; the empty string turns qualification off. Unset: the machine's
    /// sandcell-specific id (see `node::app_specific`). Read at start; a reload keeps the
    /// identifier in force.
    pub node_id: Option<String>,
    /// The capacity file in the Prometheus text exposition format (format 0.0.4) for a node
    /// exporter's textfile collector (`metrics.rs`): an absolute path, rewritten atomically
    /// every `metrics_interval_seconds` (a temporary in the same directory, renamed over it),
    /// mode 0644, removed when the daemon exits cleanly. The empty path turns it off.
    pub metrics_file: PathBuf,
    /// Seconds between two rewrites of `metrics_file`, in
    /// [[`METRICS_INTERVAL_MIN`], [`METRICS_INTERVAL_MAX`]] (the main loop ticks once a second).
    pub metrics_interval_seconds: u64,
    /// Ceiling of the daemon's own memory bound, bytes; 0 = none besides the machine's memory.
    /// The bound itself follows from the caps ([`crate::memory`]; sandcelld(8), MEMORY): a
    /// configuration whose caps need more is refused, naming them.
    pub memory_max_bytes: u64,
    /// Seconds a session's keeper waits for a new daemon to adopt the session after its
    /// daemon died or exited keeping sessions; then it kills the session's processes
    /// (sandcelld(8), ADOPTION).
    pub adopt_timeout_seconds: u64,
    /// Root-only directory (mode 0700) of the session records and keeper sockets a successor
    /// daemon adopts sessions from; on tmpfs (`/run`).
    pub adopt_dir: PathBuf,
}

/// Default `adopt_dir`.
pub const DEFAULT_ADOPT_DIR: &str = "/run/sandcell/adopt";

/// Shortest `metrics_interval_seconds`: the daemon's main loop ticks once a second.
pub const METRICS_INTERVAL_MIN: u64 = 1;

/// Longest `metrics_interval_seconds` (an hour; exporters scrape every 15 to 60 s).
pub const METRICS_INTERVAL_MAX: u64 = 3600;

/// Default `metrics_file`: in the socket's directory `/run/sandcell` (root's, mode 0755, made
/// by `sandcelld.socket` and tmpfiles; the unit makes it writable with `ReadWritePaths=`).
pub const DEFAULT_METRICS_FILE: &str = "/run/sandcell/metrics.prom";

impl Default for Daemon {
    fn default() -> Self {
        Self {
            idle_exit_seconds: 120,
            worker_start_timeout_seconds: 20.0,
            kill_grace_seconds: 2.0,
            host_call_timeout_seconds: 60.0,
            worker_dir: PathBuf::from("/usr/libexec/sandcell"),
            python_runtime_dir: PathBuf::from("/var/lib/sandcell/python-runtime"),
            state_dir: PathBuf::from("/var/lib/sandcell"),
            languages: vec!["python".into(), "r".into()],
            worker_uid_base: 3_000_000_000,
            worker_uid_count: 65_536,
            max_worker_pids: 64,
            worker_cpus: 1.0,
            cgroup_name: "sandcell".into(),
            pools: true,
            pool_python_min: None,
            pool_python_max: None,
            pool_r_min: None,
            pool_r_max: None,
            pool_refill_per_second: 4.0,
            pool_idle_seconds: 60,
            pool_empty_seconds: 600,
            max_connections: 1024,
            max_connections_per_uid: 256,
            connection_idle_seconds: 120,
            interrupt_on_hangup: false,
            node_id: None,
            metrics_file: PathBuf::from(DEFAULT_METRICS_FILE),
            adopt_timeout_seconds: 60,
            adopt_dir: PathBuf::from(DEFAULT_ADOPT_DIR),
            metrics_interval_seconds: 5,
            memory_max_bytes: 0,
        }
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[limits]`.
    pub limits: Limits,
    /// `[daemon]`.
    pub daemon: Daemon,
    /// `[environments.<name>]` tables: each replaces the shipped environment of its name or
    /// adds one (see [`Config::environments`]).
    pub environments: std::collections::BTreeMap<String, EnvironmentConfig>,
}

/// A configuration error; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has an unknown key or a value of the wrong type.
    #[error("parsing {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key).
        message: String,
    },
    /// An environment override is not a valid value.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong.
        reason: String,
    },
    /// A value is out of range.
    #[error("invalid value for {key}: {reason}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An environment's package source (`wheelhouse`, `cran_repository`) cannot be used: it
    /// does not exist, is not a directory, cannot be read, or (a CRAN repository) has no
    /// `src/contrib/PACKAGES` index.
    #[error("environment {environment}: {key} {}: {reason}", path.display())]
    PackageSource {
        /// The environment.
        environment: String,
        /// `wheelhouse` or `cran_repository`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
        /// What is wrong, with the fix where one is known.
        reason: String,
    },
}

impl Config {
    /// Loads `path` (a missing file is fine only when `required` is false), applies the
    /// environment `env` (pairs of name and value; pass `std::env::vars()`), and validates.
    pub fn load(
        path: &Path,
        required: bool,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, Error> {
        let mut cfg = match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(path, &text)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Config::default(),
            Err(source) => {
                return Err(Error::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        cfg.apply_env(env)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration in force as a configuration file (TOML): every key of `[limits]`
    /// and `[daemon]` with its value, derived values resolved (the per-uid budgets and the
    /// node identifier, given the machine's node identifier `node`), and every environment
    /// the daemon serves, shipped ones included. Feeding it back to [`Config::parse`] gives
    /// the same limits. `sandcelld --check-config` prints it; the packaging check reads the
    /// key list from it.
    pub fn to_effective_toml(&self, node: &str) -> String {
        let mut c = self.clone();
        let l = &mut c.limits;
        l.max_sessions_per_uid = Some(self.limits.sessions_per_uid());
        l.max_detached_sessions_per_uid = Some(self.limits.detached_per_uid());
        l.max_guest_memory_bytes_per_uid = Some(self.limits.guest_memory_per_uid());
        l.max_worker_memory_bytes_per_uid = Some(self.limits.worker_memory_per_uid());
        c.daemon.node_id = Some(node.to_owned());
        // The language keys as resolved: the sizes of each language's default environment.
        for e in self.environments().iter().filter(|e| e.default) {
            let (min, max) = match e.language {
                sandcell_proto::kernel::Language::Python => {
                    (&mut c.daemon.pool_python_min, &mut c.daemon.pool_python_max)
                }
                sandcell_proto::kernel::Language::R => {
                    (&mut c.daemon.pool_r_min, &mut c.daemon.pool_r_max)
                }
            };
            (*min, *max) = (Some(e.pool_min), Some(e.pool_max));
        }
        for k in [
            &mut c.daemon.pool_python_min,
            &mut c.daemon.pool_python_max,
            &mut c.daemon.pool_r_min,
            &mut c.daemon.pool_r_max,
        ] {
            k.get_or_insert(0);
        }
        c.environments = self
            .environments()
            .into_iter()
            .map(|e| {
                let table = EnvironmentConfig {
                    language: e.language.as_str().to_owned(),
                    engine: e.engine,
                    default: e.default,
                    interpreter: e.interpreter,
                    library_paths: e.library_paths,
                    preload: e.preload,
                    pool_min: Some(e.pool_min),
                    pool_max: Some(e.pool_max),
                    wheelhouse: e
                        .package_source
                        .as_ref()
                        .filter(|s| s.kind == crate::packages::Kind::Wheelhouse)
                        .map(|s| s.path.clone()),
                    cran_repository: e
                        .package_source
                        .as_ref()
                        .filter(|s| s.kind == crate::packages::Kind::CranRepository)
                        .map(|s| s.path.clone()),
                    egress: e.egress.map(EgressSetting::Table),
                    enabled: true,
                };
                (e.name, table)
            })
            .collect();
        toml::to_string(&c).unwrap_or_else(|e| format!("# not representable as TOML: {e}\n"))
    }

    /// Parses TOML text; unknown keys are errors.
    pub fn parse(path: &Path, text: &str) -> Result<Config, Error> {
        toml::from_str(text).map_err(|e| Error::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Applies `SANDCELL_<KEY>` overrides. Unknown `SANDCELL_` variables are ignored, since
    /// the prefix is shared with the CLI (`SANDCELL_SOCKET`) and development knobs.
    pub fn apply_env(
        &mut self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(), Error> {
        for (var, value) in env {
            let Some(key) = var.strip_prefix("SANDCELL_") else {
                continue;
            };
            let key = key.to_ascii_lowercase();
            let l = &mut self.limits;
            let d = &mut self.daemon;
            let u64v = || parse_num::<u64>(&var, &value);
            match key.as_str() {
                "max_source_bytes" => l.max_source_bytes = u64v()?,
                "execution_wall_time_seconds" => {
                    l.execution_wall_time_seconds = parse_num(&var, &value)?
                }
                "max_fuel" => l.max_fuel = u64v()?,
                "max_guest_memory_bytes" => l.max_guest_memory_bytes = u64v()?,
                "max_stdout_bytes" => l.max_stdout_bytes = u64v()?,
                "max_stderr_bytes" => l.max_stderr_bytes = u64v()?,
                "max_concurrent_sessions" => l.max_concurrent_sessions = u64v()?,
                "max_aggregate_guest_memory_bytes" => l.max_aggregate_guest_memory_bytes = u64v()?,
                "max_worker_memory_bytes" => l.max_worker_memory_bytes = u64v()?,
                "max_aggregate_worker_memory_bytes" => {
                    l.max_aggregate_worker_memory_bytes = u64v()?
                }
                "max_file_bytes" => l.max_file_bytes = u64v()?,
                "max_session_files_bytes" => l.max_session_files_bytes = u64v()?,
                "max_sessions_per_uid" => l.max_sessions_per_uid = Some(u64v()?),
                "max_detached_sessions_per_uid" => l.max_detached_sessions_per_uid = Some(u64v()?),
                "max_guest_memory_bytes_per_uid" => {
                    l.max_guest_memory_bytes_per_uid = Some(u64v()?)
                }
                "max_worker_memory_bytes_per_uid" => {
                    l.max_worker_memory_bytes_per_uid = Some(u64v()?)
                }
                "max_detached_idle_seconds" => l.max_detached_idle_seconds = u64v()?,
                "max_starts_per_second_per_uid" => {
                    l.max_starts_per_second_per_uid = parse_num(&var, &value)?
                }
                "max_start_burst_per_uid" => l.max_start_burst_per_uid = u64v()?,
                "max_connections" => d.max_connections = u64v()?,
                "max_connections_per_uid" => d.max_connections_per_uid = u64v()?,
                "connection_idle_seconds" => d.connection_idle_seconds = u64v()?,
                "interrupt_on_hangup" => {
                    d.interrupt_on_hangup = match value.trim() {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => {
                            return Err(Error::Env {
                                var: var.clone(),
                                reason: format!("{value:?} is not true, false, 1 or 0"),
                            });
                        }
                    }
                }
                "idle_exit_seconds" => d.idle_exit_seconds = u64v()?,
                "worker_start_timeout_seconds" => {
                    d.worker_start_timeout_seconds = parse_num(&var, &value)?
                }
                "kill_grace_seconds" => d.kill_grace_seconds = parse_num(&var, &value)?,
                "host_call_timeout_seconds" => {
                    d.host_call_timeout_seconds = parse_num(&var, &value)?
                }
                "worker_dir" => d.worker_dir = PathBuf::from(&value),
                "python_runtime_dir" => d.python_runtime_dir = PathBuf::from(&value),
                "state_dir" => d.state_dir = PathBuf::from(&value),
                "languages" => {
                    d.languages = value
                        .split(',')
                        .map(|s| s.trim().to_owned())
                        .filter(|s| !s.is_empty())
                        .collect()
                }
                "worker_uid_base" => d.worker_uid_base = parse_num(&var, &value)?,
                "worker_uid_count" => d.worker_uid_count = parse_num(&var, &value)?,
                "max_worker_pids" => d.max_worker_pids = u64v()?,
                "worker_cpus" => d.worker_cpus = parse_num(&var, &value)?,
                "cgroup_name" => d.cgroup_name = value.clone(),
                "pools" => {
                    d.pools = value.trim().parse().map_err(|_| Error::Env {
                        var: var.clone(),
                        reason: format!("{value:?} is not true or false"),
                    })?
                }
                "pool_python_min" => d.pool_python_min = Some(parse_num(&var, &value)?),
                "pool_python_max" => d.pool_python_max = Some(parse_num(&var, &value)?),
                "pool_r_min" => d.pool_r_min = Some(parse_num(&var, &value)?),
                "pool_r_max" => d.pool_r_max = Some(parse_num(&var, &value)?),
                "pool_refill_per_second" => d.pool_refill_per_second = parse_num(&var, &value)?,
                "pool_idle_seconds" => d.pool_idle_seconds = u64v()?,
                "pool_empty_seconds" => d.pool_empty_seconds = u64v()?,
                "node_id" => d.node_id = Some(value.clone()),
                "metrics_file" => d.metrics_file = PathBuf::from(&value),
                "adopt_timeout_seconds" => d.adopt_timeout_seconds = u64v()?,
                "adopt_dir" => d.adopt_dir = PathBuf::from(&value),
                "metrics_interval_seconds" => d.metrics_interval_seconds = u64v()?,
                "memory_max_bytes" => d.memory_max_bytes = u64v()?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Refuses nonsense: zeros, per-session charges above their budgets, values above the
    /// protocol ceilings.
    pub fn validate(&self) -> Result<(), Error> {
        let l = &self.limits;
        Self::validate_positive(l)?;
        Self::validate_file_limits(l)?;
        self.validate_per_uid()?;
        if let Some(node) = &self.daemon.node_id
            && !node.is_empty()
        {
            sandcell_proto::kernel::check_node_id(node).map_err(|e| Error::Invalid {
                key: "node_id",
                reason: e.reason.into(),
            })?;
        }
        self.validate_metrics()?;
        Self::validate_session_limits(l)?;
        self.validate_workers()?;
        self.validate_pools_and_languages()?;
        self.validate_package_sources()?;
        self.validate_memory()
    }

    /// Every environment's package source exists, is a readable directory and (a CRAN
    /// repository) has its index. Checked here, at start and reload, and not in
    /// [`Config::environments`], which must not change with the file system.
    fn validate_package_sources(&self) -> Result<(), Error> {
        for env in self.try_environments()? {
            if let Some(src) = &env.package_source {
                src.check().map_err(|reason| Error::PackageSource {
                    environment: env.name.clone(),
                    key: src.kind.key(),
                    path: src.path.clone(),
                    reason,
                })?;
            }
        }
        Ok(())
    }

    /// The caps the daemon's own memory bound follows from.
    pub fn memory_caps(&self) -> crate::memory::Caps {
        crate::memory::Caps {
            max_connections: self.daemon.max_connections,
            max_connections_per_uid: self.daemon.max_connections_per_uid,
            max_concurrent_sessions: self.limits.max_concurrent_sessions,
            max_sessions_per_uid: self.limits.sessions_per_uid(),
            memory_max_bytes: self.daemon.memory_max_bytes,
        }
    }

    /// The daemon's own memory bound ([`crate::memory::Bound`]), bytes.
    pub fn memory_bound(&self) -> crate::memory::Bound {
        crate::memory::Bound::derive(&self.memory_caps())
    }

    /// The caps fit the daemon's memory: under `memory_max_bytes` when set, and under the
    /// machine's memory.
    fn validate_memory(&self) -> Result<(), Error> {
        let caps = self.memory_caps();
        crate::memory::Bound::derive(&caps)
            .check(&caps, crate::memory::machine_bytes())
            .map_err(|(key, reason)| Error::Invalid { key, reason })
    }

    /// Limits and budgets that must not be zero.
    fn validate_positive(l: &Limits) -> Result<(), Error> {
        let positive: [(&'static str, u64); 9] = [
            ("max_source_bytes", l.max_source_bytes),
            ("max_fuel", l.max_fuel),
            ("max_guest_memory_bytes", l.max_guest_memory_bytes),
            ("max_stdout_bytes", l.max_stdout_bytes),
            ("max_stderr_bytes", l.max_stderr_bytes),
            ("max_concurrent_sessions", l.max_concurrent_sessions),
            (
                "max_aggregate_guest_memory_bytes",
                l.max_aggregate_guest_memory_bytes,
            ),
            ("max_worker_memory_bytes", l.max_worker_memory_bytes),
            (
                "max_aggregate_worker_memory_bytes",
                l.max_aggregate_worker_memory_bytes,
            ),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(Error::Invalid {
                    key,
                    reason: "must be positive".into(),
                });
            }
        }
        Ok(())
    }

    /// A cell's wall time, the protocol ceilings of source and output, and one session's
    /// memory within the budgets (and its worker's above its guest's).
    fn validate_session_limits(l: &Limits) -> Result<(), Error> {
        let wall = l.execution_wall_time_seconds;
        if !(wall.is_finite() && wall > 0.0 && wall <= 86_400.0) {
            return Err(Error::Invalid {
                key: "execution_wall_time_seconds",
                reason: format!("{wall} is not in (0, 86400]"),
            });
        }
        if l.max_source_bytes > SOURCE_CEILING {
            return Err(Error::Invalid {
                key: "max_source_bytes",
                reason: format!(
                    "{} exceeds the protocol ceiling {SOURCE_CEILING}",
                    l.max_source_bytes
                ),
            });
        }
        if l.max_stdout_bytes.saturating_add(l.max_stderr_bytes) > OUTPUT_CEILING {
            return Err(Error::Invalid {
                key: "max_stdout_bytes",
                reason: format!(
                    "stdout + stderr ({}) exceed the protocol ceiling {OUTPUT_CEILING}",
                    l.max_stdout_bytes.saturating_add(l.max_stderr_bytes)
                ),
            });
        }
        if l.max_guest_memory_bytes > l.max_aggregate_guest_memory_bytes {
            return Err(Error::Invalid {
                key: "max_guest_memory_bytes",
                reason: "exceeds max_aggregate_guest_memory_bytes".into(),
            });
        }
        if l.max_worker_memory_bytes > l.max_aggregate_worker_memory_bytes {
            return Err(Error::Invalid {
                key: "max_worker_memory_bytes",
                reason: "exceeds max_aggregate_worker_memory_bytes".into(),
            });
        }
        if l.max_worker_memory_bytes <= l.max_guest_memory_bytes {
            return Err(Error::Invalid {
                key: "max_worker_memory_bytes",
                reason: "must exceed max_guest_memory_bytes".into(),
            });
        }
        Ok(())
    }

    /// Worker timeouts, CPUs, the worker uid range, pids and the cgroup name.
    fn validate_workers(&self) -> Result<(), Error> {
        let d = &self.daemon;
        for (key, v) in [
            (
                "worker_start_timeout_seconds",
                d.worker_start_timeout_seconds,
            ),
            ("kill_grace_seconds", d.kill_grace_seconds),
            ("host_call_timeout_seconds", d.host_call_timeout_seconds),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 3600.0) {
                return Err(Error::Invalid {
                    key,
                    reason: format!("{v} is not in (0, 3600]"),
                });
            }
        }
        if !(d.worker_cpus.is_finite() && d.worker_cpus >= 0.0 && d.worker_cpus <= 1024.0) {
            return Err(Error::Invalid {
                key: "worker_cpus",
                reason: format!("{} is not in [0, 1024]", d.worker_cpus),
            });
        }
        if d.worker_uid_count == 0
            || d.worker_uid_base < 1000
            || d.worker_uid_base
                .checked_add(d.worker_uid_count)
                .is_none_or(|end| end >= u32::MAX - 1)
        {
            return Err(Error::Invalid {
                key: "worker_uid_base",
                reason: "the range must be non-empty, above 999, and below 4294967294".into(),
            });
        }
        if d.max_worker_pids == 0 {
            return Err(Error::Invalid {
                key: "max_worker_pids",
                reason: "must be positive".into(),
            });
        }
        if d.cgroup_name.is_empty()
            || d.cgroup_name.len() > 64
            || !d
                .cgroup_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(Error::Invalid {
                key: "cgroup_name",
                reason: "1-64 characters of [A-Za-z0-9_-]".into(),
            });
        }
        Ok(())
    }

    /// Pool sizes within admission, the refill rate, the languages served, and each
    /// environment's pool.
    fn validate_pools_and_languages(&self) -> Result<(), Error> {
        let (l, d) = (&self.limits, &self.daemon);
        for (key, min, max) in [
            ("pool_python_max", d.pool_python_min, d.pool_python_max),
            ("pool_r_max", d.pool_r_min, d.pool_r_max),
        ] {
            // Unset keys are derived within the budgets; set ones are checked here.
            let (min, max) = match (min, max) {
                (Some(a), Some(b)) => (a, b),
                (Some(a), None) => (a, a),
                (None, Some(b)) => (0, b),
                (None, None) => continue,
            };
            if max < min {
                return Err(Error::Invalid {
                    key,
                    reason: format!("{max} is below the minimum {min}"),
                });
            }
            if (max as u64) > l.max_concurrent_sessions {
                return Err(Error::Invalid {
                    key,
                    reason: "exceeds max_concurrent_sessions".into(),
                });
            }
        }
        if !(d.pool_refill_per_second.is_finite()
            && d.pool_refill_per_second > 0.0
            && d.pool_refill_per_second <= 1000.0)
        {
            return Err(Error::Invalid {
                key: "pool_refill_per_second",
                reason: "must be in (0, 1000]".into(),
            });
        }
        if d.languages.is_empty() {
            return Err(Error::Invalid {
                key: "languages",
                reason: "at least one language".into(),
            });
        }
        for lang in &d.languages {
            if sandcell_proto::kernel::Language::parse(lang).is_none() {
                return Err(Error::Invalid {
                    key: "languages",
                    reason: format!("unknown language {lang:?} (python, r)"),
                });
            }
        }
        let envs = self.try_environments()?;
        for env in &envs {
            if env.pool_max as u64 > l.max_concurrent_sessions {
                return Err(Error::Invalid {
                    key: "environments",
                    reason: format!("{}: pool_max exceeds max_concurrent_sessions", env.name),
                });
            }
        }
        Ok(())
    }
}

impl Config {
    /// Per-uid budgets and connection caps: positive, within their daemon-wide budgets, and
    /// room for at least one session.
    fn validate_per_uid(&self) -> Result<(), Error> {
        let l = &self.limits;
        let d = &self.daemon;
        for (key, v, max, max_key) in [
            (
                "max_sessions_per_uid",
                l.sessions_per_uid(),
                l.max_concurrent_sessions,
                "max_concurrent_sessions",
            ),
            (
                "max_detached_sessions_per_uid",
                l.detached_per_uid(),
                l.sessions_per_uid(),
                "max_sessions_per_uid",
            ),
            (
                "max_guest_memory_bytes_per_uid",
                l.guest_memory_per_uid(),
                l.max_aggregate_guest_memory_bytes,
                "max_aggregate_guest_memory_bytes",
            ),
            (
                "max_worker_memory_bytes_per_uid",
                l.worker_memory_per_uid(),
                l.max_aggregate_worker_memory_bytes,
                "max_aggregate_worker_memory_bytes",
            ),
            (
                "max_connections_per_uid",
                d.max_connections_per_uid,
                d.max_connections,
                "max_connections",
            ),
        ] {
            if v == 0 {
                return Err(Error::Invalid {
                    key,
                    reason: "must be positive".into(),
                });
            }
            if v > max {
                return Err(Error::Invalid {
                    key,
                    reason: format!("{v} exceeds {max_key} ({max})"),
                });
            }
        }
        for (key, v, one, one_key) in [
            (
                "max_guest_memory_bytes_per_uid",
                l.guest_memory_per_uid(),
                l.max_guest_memory_bytes,
                "max_guest_memory_bytes",
            ),
            (
                "max_worker_memory_bytes_per_uid",
                l.worker_memory_per_uid(),
                l.max_worker_memory_bytes,
                "max_worker_memory_bytes",
            ),
        ] {
            if v < one {
                return Err(Error::Invalid {
                    key,
                    reason: format!("{v} is below one session's {one_key} ({one})"),
                });
            }
        }
        if l.max_detached_idle_seconds == 0 || l.max_detached_idle_seconds > 7 * 86_400 {
            return Err(Error::Invalid {
                key: "max_detached_idle_seconds",
                reason: "must be in [1, 604800]".into(),
            });
        }
        let r = l.max_starts_per_second_per_uid;
        if !(r.is_finite() && r > 0.0 && r <= 100_000.0) {
            return Err(Error::Invalid {
                key: "max_starts_per_second_per_uid",
                reason: "must be in (0, 100000]".into(),
            });
        }
        if l.max_start_burst_per_uid == 0 {
            return Err(Error::Invalid {
                key: "max_start_burst_per_uid",
                reason: "must be positive".into(),
            });
        }
        if d.max_connections == 0 || d.connection_idle_seconds == 0 {
            return Err(Error::Invalid {
                key: if d.max_connections == 0 {
                    "max_connections"
                } else {
                    "connection_idle_seconds"
                },
                reason: "must be positive".into(),
            });
        }
        Ok(())
    }

    /// The capacity file: off (empty) or an absolute path naming a file (no `..`, not a
    /// directory's trailing `/`); its interval within its bounds.
    fn validate_metrics(&self) -> Result<(), Error> {
        let d = &self.daemon;
        let p = &d.metrics_file;
        if !p.as_os_str().is_empty() {
            let text = p.to_str().unwrap_or("");
            let ok = p.is_absolute()
                && !text.ends_with('/')
                && !text.contains('\n')
                && p.file_name().is_some()
                && !p.components().any(|c| c == std::path::Component::ParentDir);
            if !ok {
                return Err(Error::Invalid {
                    key: "metrics_file",
                    reason: format!(
                        "{} is not an absolute path of a file (without '..'); \"\" turns it off",
                        p.display()
                    ),
                });
            }
        }
        let i = d.metrics_interval_seconds;
        if !(METRICS_INTERVAL_MIN..=METRICS_INTERVAL_MAX).contains(&i) {
            return Err(Error::Invalid {
                key: "metrics_interval_seconds",
                reason: format!("{i} is not in [{METRICS_INTERVAL_MIN}, {METRICS_INTERVAL_MAX}]"),
            });
        }
        Ok(())
    }

    /// Session-file limits: both positive, one file within the session's total, the total
    /// at most half of the worker's memory.
    fn validate_file_limits(l: &Limits) -> Result<(), Error> {
        for (key, v) in [
            ("max_file_bytes", l.max_file_bytes),
            ("max_session_files_bytes", l.max_session_files_bytes),
        ] {
            if v == 0 {
                return Err(Error::Invalid {
                    key,
                    reason: "must be positive".into(),
                });
            }
        }
        if l.max_file_bytes > l.max_session_files_bytes {
            return Err(Error::Invalid {
                key: "max_file_bytes",
                reason: "exceeds max_session_files_bytes".into(),
            });
        }
        // A session's files live in a tmpfs whose pages are charged to its worker's memory
        // cgroup (sandcelld(8), DISK): a full directory leaves the interpreter at least half.
        if l.max_session_files_bytes > l.max_worker_memory_bytes / 2 {
            return Err(Error::Invalid {
                key: "max_session_files_bytes",
                reason: format!(
                    "{} exceeds half of max_worker_memory_bytes ({}): a session's files are \
                     held in memory charged to its worker",
                    l.max_session_files_bytes, l.max_worker_memory_bytes
                ),
            });
        }
        Ok(())
    }
}

fn parse_num<T: std::str::FromStr>(var: &str, value: &str) -> Result<T, Error> {
    value.trim().parse().map_err(|_| Error::Env {
        var: var.to_owned(),
        reason: format!("{value:?} is not a valid number"),
    })
}

#[cfg(test)]
mod tests {
    use super::machine::{GIB, MIB};
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_derived_from_the_machine_and_valid() {
        let c = Config::default();
        assert_eq!(c.limits.max_source_bytes, 65_536);
        c.validate().unwrap();
        // This machine's shape in the development notes: 2 CPUs, 24 GiB.
        let l = Limits::for_machine(Machine {
            cpus: 2,
            memory: 24 * GIB,
        });
        assert_eq!(l.max_concurrent_sessions, 16);
        assert_eq!(l.max_aggregate_worker_memory_bytes, 18 * GIB);
        assert_eq!(l.sessions_per_uid(), 12);
        assert_eq!(l.detached_per_uid(), 6);
        assert_eq!(l.worker_memory_per_uid(), 18 * GIB - 18 * GIB / 4);
        assert_eq!(l.guest_memory_per_uid(), 12 * 128 * MIB);
        // A small machine still offers a second uid a session.
        for (cpus, memory) in [(1, GIB), (1, 2 * GIB), (4, 3 * GIB), (64, 512 * GIB)] {
            let l = Limits::for_machine(Machine { cpus, memory });
            let c = Config {
                limits: l.clone(),
                ..Config::default()
            };
            c.validate().unwrap();
            assert!(
                l.sessions_per_uid() < l.max_concurrent_sessions,
                "{cpus} {memory}"
            );
            assert!(l.worker_memory_per_uid() < l.max_aggregate_worker_memory_bytes);
        }
    }

    #[test]
    fn per_uid_budgets_are_checked() {
        let mut c = Config::default();
        c.limits.max_sessions_per_uid = Some(c.limits.max_concurrent_sessions + 1);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_sessions_per_uid"), "{e}");
        let mut c = Config::default();
        c.apply_env(env(&[("SANDCELL_MAX_WORKER_MEMORY_BYTES_PER_UID", "1")]))
            .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_worker_memory_bytes_per_uid"), "{e}");
        let mut c = Config::default();
        c.daemon.max_connections_per_uid = c.daemon.max_connections + 1;
        assert!(c.validate().is_err());
    }

    #[test]
    fn env_overrides_file() {
        let mut c = Config::parse(Path::new("t"), "[limits]\nmax_fuel = 5\n").unwrap();
        assert_eq!(c.limits.max_fuel, 5);
        c.apply_env(env(&[
            ("SANDCELL_MAX_FUEL", "7"),
            ("SANDCELL_SOCKET", "/x"),
        ]))
        .unwrap();
        assert_eq!(c.limits.max_fuel, 7);
    }

    #[test]
    fn unknown_key_is_named() {
        let e = Config::parse(Path::new("t"), "[limits]\nmax_fuels = 5\n").unwrap_err();
        assert!(e.to_string().contains("max_fuels"), "{e}");
    }

    #[test]
    fn nonsense_is_refused() {
        let mut c = Config::default();
        c.limits.max_fuel = 0;
        assert!(c.validate().unwrap_err().to_string().contains("max_fuel"));
        let mut c = Config::default();
        c.limits.max_guest_memory_bytes = c.limits.max_aggregate_guest_memory_bytes + 1;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_worker_memory_bytes = c.limits.max_guest_memory_bytes;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_source_bytes = SOURCE_CEILING + 1;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_file_bytes = c.limits.max_session_files_bytes + 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_file_bytes"), "{e}");
        let mut c = Config::default();
        c.apply_env(env(&[("SANDCELL_MAX_SESSION_FILES_BYTES", "0")]))
            .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_session_files_bytes"), "{e}");
        let e = Config::default()
            .apply_env(env(&[("SANDCELL_MAX_FUEL", "lots")]))
            .unwrap_err();
        assert!(e.to_string().contains("SANDCELL_MAX_FUEL"));
    }

    #[test]
    fn the_disk_budget_fits_in_half_the_worker_memory() {
        // A session's files are a tmpfs charged to its worker's memory cgroup.
        let mut c = Config::default();
        c.apply_env(env(&[
            ("SANDCELL_MAX_WORKER_MEMORY_BYTES", "268435456"),
            ("SANDCELL_MAX_SESSION_FILES_BYTES", "134217728"),
        ]))
        .unwrap();
        c.validate().unwrap();
        c.apply_env(env(&[("SANDCELL_MAX_SESSION_FILES_BYTES", "134217729")]))
            .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("max_session_files_bytes") && e.contains("max_worker_memory_bytes"),
            "{e}"
        );
    }

    #[test]
    fn pool_sizes_follow_the_budgets_and_the_cpus() {
        let machine = |cpus, gib| {
            Limits::for_machine(Machine {
                cpus,
                memory: gib * GIB,
            })
        };
        // 2 CPUs, 24 GiB: 16 sessions, 18 GiB of worker memory; a quarter is 4 warm workers.
        let l = machine(2, 24);
        assert_eq!(pool_sizes(&l, 2, 2, 3, 0), [(1, 2), (1, 1), (1, 1)]);
        // 2 CPUs, 4 GiB: 3 sessions, a quarter is none, but each default keeps one; no pydata.
        let l = machine(2, 4);
        assert_eq!(pool_sizes(&l, 2, 2, 3, 0), [(1, 1), (1, 1), (0, 0)]);
        // 64 CPUs, 256 GiB: 192 sessions, 48 warm workers, the extra ones capped by the CPUs.
        let l = machine(64, 256);
        let s = pool_sizes(&l, 64, 2, 3, 0);
        assert!(s.iter().all(|&(min, max)| min == 1 && max > min), "{s:?}");
        assert_eq!(s.iter().map(|x| x.1).sum::<usize>(), 48);
        assert_eq!(pool_sizes(&l, 4, 2, 3, 0), [(1, 3), (1, 2), (1, 2)]);
        // Worker memory bounds the share too: 4 GiB of it, 1 GiB a worker, is 1 warm worker.
        let mut l = machine(64, 256);
        l.max_aggregate_worker_memory_bytes = 4 * GIB;
        assert_eq!(pool_sizes(&l, 64, 1, 2, 0), [(1, 1), (0, 0)]);
        // Never above the session budget, never max below min.
        for sessions in 1..40 {
            let mut l = machine(8, 64);
            l.max_concurrent_sessions = sessions;
            for (min, max) in pool_sizes(&l, 8, 2, 3, 0) {
                assert!(min <= max && max as u64 <= sessions.max(1), "{sessions}");
            }
        }
    }

    #[test]
    fn shipped_pools_are_derived_and_an_operator_size_wins() {
        let mut c = Config {
            limits: Limits::for_machine(Machine {
                cpus: 2,
                memory: 24 * GIB,
            }),
            ..Config::default()
        };
        c.validate().unwrap();
        let sizes = |c: &Config, n: &str| {
            let e = c.environment(n).unwrap();
            (e.pool_min, e.pool_max)
        };
        let cpus = online_cpus();
        let want = pool_sizes(&c.limits, cpus, 2, 3, 0);
        assert_eq!(sizes(&c, "python"), want[0]);
        assert_eq!(sizes(&c, "r"), want[1]);
        assert_eq!(sizes(&c, "pydata"), want[2]);
        // The effective file names the language keys with the derived sizes.
        let text = c.to_effective_toml("n");
        assert!(
            text.contains(&format!("pool_python_min = {}", want[0].0)),
            "{text}"
        );
        assert!(
            text.contains(&format!("pool_r_max = {}", want[1].1)),
            "{text}"
        );
        // A language key set by the operator wins (max unset: as min); pydata stays derived.
        c.apply_env(env(&[("SANDCELL_POOL_PYTHON_MIN", "0")]))
            .unwrap();
        c.validate().unwrap();
        assert_eq!(sizes(&c, "python"), (0, 0));
        let want = pool_sizes(&c.limits, cpus, 1, 2, 0);
        assert_eq!((sizes(&c, "r"), sizes(&c, "pydata")), (want[0], want[1]));
        // Pools the operator sized count against the share: 16 sessions give 4, python's
        // maximum of 3 leaves 1, which R's default takes; none for pydata.
        c.limits = Limits::for_machine(Machine {
            cpus: 2,
            memory: 24 * GIB,
        });
        c.apply_env(env(&[
            ("SANDCELL_POOL_PYTHON_MIN", "1"),
            ("SANDCELL_POOL_PYTHON_MAX", "3"),
        ]))
        .unwrap();
        c.validate().unwrap();
        assert_eq!(sizes(&c, "python"), (1, 3));
        assert_eq!((sizes(&c, "r"), sizes(&c, "pydata")), ((1, 1), (0, 0)));
    }

    #[test]
    fn environments_merge_with_the_shipped_ones() {
        let c = Config::default();
        let envs = c.environments();
        let names: Vec<&str> = envs.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["pydata", "python", "r"]);
        let py = c.environment("python").unwrap();
        assert!(py.default && py.engine == Engine::Eryx);
        let pd = c.environment("pydata").unwrap();
        assert!(!pd.default && pd.engine == Engine::Native);
        assert!(c.environment("r").unwrap().default);

        // A file default replaces the shipped one; a pool of its own; a removal.
        let c = Config::parse(
            Path::new("t"),
            "[daemon]\npool_python_min = 1\npool_python_max = 2\n\n[environments.pydata]\nlanguage = \"python\"\nengine = \"native\"\ndefault = true\npool_min = 1\npool_max = 3\npreload = [\"numpy\"]\n\n[environments.r]\nlanguage = \"r\"\nengine = \"native\"\nenabled = false\n",
        )
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("language r has 0 default"), "{e}");
        let mut c2 = c.clone();
        c2.daemon.languages = vec!["python".into()];
        c2.validate().unwrap();
        let pd = c2.environment("pydata").unwrap();
        assert!(pd.default && pd.pool_min == 1 && pd.pool_max == 3);
        let py = c2.environment("python").unwrap();
        assert!(!py.default && py.pool_max == 0);
        assert!(c2.environment("r").is_none());

        // Nonsense is named.
        for bad in [
            "[environments.x]\nlanguage = \"r\"\nengine = \"eryx\"\n",
            "[environments.x]\nlanguage = \"cobol\"\nengine = \"native\"\n",
            "[environments.x]\nlanguage = \"python\"\nengine = \"native\"\nlibrary_paths = [\"rel\"]\n",
            "[environments.x]\nlanguage = \"python\"\nengine = \"native\"\ndefault = true\n[environments.y]\nlanguage = \"python\"\nengine = \"native\"\ndefault = true\n",
            "[environments.Bad]\nlanguage = \"python\"\nengine = \"native\"\n",
            "[environments.x]\nlanguage = \"python\"\nengine = \"native\"\npreload = [\"os; rm\"]\n",
        ] {
            let c = Config::parse(Path::new("t"), bad).unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("environments"), "{bad}: {e}");
        }
        assert!(
            Config::parse(
                Path::new("t"),
                "[environments.x]\nlanguage = \"python\"\nengine = \"wasm\"\n"
            )
            .is_err()
        );
    }

    /// `--check-config` prints a file that loads back to the same configuration in force, and
    /// names every key (the packaging check reads the key list from it).
    #[test]
    fn effective_toml_round_trips_and_names_every_key() {
        let c = Config::parse(
            Path::new("t"),
            "[limits]\nmax_concurrent_sessions = 9\n[environments.sci]\nlanguage = \"python\"\nengine = \"native\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        let text = c.to_effective_toml("node-a");
        let back = Config::parse(Path::new("t"), &text).unwrap();
        back.validate().unwrap();
        assert_eq!(back.to_effective_toml("node-a"), text);
        assert_eq!(back.limits.sessions_per_uid(), c.limits.sessions_per_uid());
        assert_eq!(back.environments(), c.environments());
        for key in [
            "max_sessions_per_uid = ",
            "max_worker_memory_bytes_per_uid = ",
            "node_id = \"node-a\"",
            "[environments.sci]",
            "[environments.python]",
        ] {
            assert!(text.contains(key), "{key} missing from\n{text}");
        }
    }

    #[test]
    fn metrics_keys_are_checked() {
        let c = Config::default();
        assert_eq!(c.daemon.metrics_file, Path::new(DEFAULT_METRICS_FILE));
        assert_eq!(c.daemon.metrics_interval_seconds, 5);
        for (file, interval, bad) in [
            ("", "5", None),
            ("/var/lib/node_exporter/textfile/sandcell.prom", "1", None),
            ("/run/sandcell/metrics.prom", "3600", None),
            (
                "/run/sandcell/metrics.prom",
                "0",
                Some("metrics_interval_seconds"),
            ),
            (
                "/run/sandcell/metrics.prom",
                "3601",
                Some("metrics_interval_seconds"),
            ),
            ("metrics.prom", "5", Some("metrics_file")),
            ("/run/sandcell/", "5", Some("metrics_file")),
            ("/run/sandcell/../x.prom", "5", Some("metrics_file")),
            ("/", "5", Some("metrics_file")),
        ] {
            let mut c = Config::default();
            c.apply_env(env(&[
                ("SANDCELL_METRICS_FILE", file),
                ("SANDCELL_METRICS_INTERVAL_SECONDS", interval),
            ]))
            .unwrap();
            match (c.validate(), bad) {
                (Ok(()), None) => {}
                (Err(Error::Invalid { key, .. }), Some(k)) => {
                    assert_eq!(key, k, "{file} {interval}")
                }
                (r, _) => panic!("{file} {interval}: {r:?}"),
            }
        }
        let e = Config::default()
            .apply_env(env(&[("SANDCELL_METRICS_INTERVAL_SECONDS", "soon")]))
            .unwrap_err();
        assert!(
            e.to_string().contains("SANDCELL_METRICS_INTERVAL_SECONDS"),
            "{e}"
        );
    }

    #[test]
    fn kept_output_sum_does_not_wrap() {
        // u64::MAX + 2 wrapped to 1 in release builds and passed the ceiling check.
        let mut c = Config::default();
        c.apply_env(env(&[
            ("SANDCELL_MAX_STDOUT_BYTES", "18446744073709551615"),
            ("SANDCELL_MAX_STDERR_BYTES", "2"),
        ]))
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_stdout_bytes"), "{e}");
    }

    #[test]
    fn egress_is_none_by_default_and_checked() {
        let conf = |table: &str| {
            let mut c = Config::parse(Path::new("t"), table)?;
            c.daemon.languages = vec!["python".into(), "r".into()];
            c.validate()?;
            Ok::<_, Error>(c)
        };
        let c = conf("").unwrap();
        assert!(c.environments().iter().all(|e| e.egress.is_none()));
        let c = conf("[environments.pydata]\nlanguage = \"python\"\nengine = \"native\"\negress = \"none\"\n").unwrap();
        assert_eq!(c.environment("pydata").unwrap().egress, None);
        let t = "[environments.net]\nlanguage = \"python\"\nengine = \"native\"\n\
                 egress = { hosts = [\"PyPI.org\", \"*.pythonhosted.org\"], ports = [443] }\n";
        let c = conf(t).unwrap();
        let g = c.environment("net").unwrap().egress.unwrap();
        assert_eq!(g.hosts, ["pypi.org", "*.pythonhosted.org"]);
        assert_eq!(
            (g.ports.as_slice(), g.max_bytes, g.max_connections),
            (&[443u16][..], 256 << 20, 16)
        );
        assert!(
            c.to_effective_toml("n").contains("pythonhosted"),
            "kept in the effective file"
        );
        for (bad, why) in [
            ("egress = \"all\"", "\"none\" or a table"),
            ("egress = { hosts = [] }", "egress.hosts"),
            ("egress = { hosts = [\"*.org\"] }", "wildcard"),
            ("egress = { hosts = [\"10.0.0.1\"] }", "not a DNS host name"),
            (
                "egress = { hosts = [\"a.org\"], ports = [0] }",
                "egress.ports",
            ),
            (
                "egress = { hosts = [\"a.org\"], max_connections = 0 }",
                "positive",
            ),
        ] {
            let t =
                format!("[environments.net]\nlanguage = \"python\"\nengine = \"native\"\n{bad}\n");
            let e = conf(&t).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = conf("[environments.net]\nlanguage = \"python\"\nengine = \"eryx\"\negress = { hosts = [\"a.org\"] }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("eryx engine has no egress"), "{e}");
    }

    #[test]
    fn package_sources_are_checked() {
        let dir = std::env::temp_dir().join(format!("sc-config-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = |table: &str| {
            let mut c = Config::parse(Path::new("t"), table).unwrap();
            c.daemon.languages = vec!["python".into(), "r".into()];
            c
        };
        let wh = |engine: &str, p: &Path| {
            format!(
                "[environments.x]\nlanguage = \"python\"\nengine = \"{engine}\"\nwheelhouse = \"{}\"\n",
                p.display()
            )
        };
        // A wheelhouse that exists: served, and named in the effective configuration.
        let c = conf(&wh("native", &dir));
        c.validate().unwrap();
        let x = c.environment("x").unwrap();
        let src = x.package_source.unwrap();
        assert_eq!(
            (src.kind, src.path),
            (crate::packages::Kind::Wheelhouse, dir.clone())
        );
        assert!(c.to_effective_toml("n").contains("wheelhouse = "));
        // Missing: a typed error naming the environment, the key and the path.
        let missing = dir.join("missing");
        let e = conf(&wh("native", &missing)).validate().unwrap_err();
        assert!(
            matches!(&e, Error::PackageSource { environment, key: "wheelhouse", path, .. }
                if environment == "x" && path == &missing),
            "{e:?}"
        );
        // Not for Eryx, not across languages, never relative.
        let e = conf(&wh("eryx", &dir)).validate().unwrap_err().to_string();
        assert!(e.contains("eryx engine cannot install packages"), "{e}");
        let e = conf(&format!(
            "[environments.x]\nlanguage = \"python\"\nengine = \"native\"\ncran_repository = \"{}\"\n",
            dir.display()
        ))
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("cran_repository is for R"), "{e}");
        let e = conf(&wh("native", Path::new("rel/dir")))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("absolute path"), "{e}");
        // A CRAN repository needs its index.
        let r = format!(
            "[environments.rr]\nlanguage = \"r\"\nengine = \"native\"\ncran_repository = \"{}\"\n",
            dir.display()
        );
        let e = conf(&r).validate().unwrap_err().to_string();
        assert!(e.contains("src/contrib/PACKAGES"), "{e}");
        std::fs::create_dir_all(dir.join("src/contrib")).unwrap();
        std::fs::write(dir.join("src/contrib/PACKAGES"), "Package: a\n").unwrap();
        conf(&r).validate().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
