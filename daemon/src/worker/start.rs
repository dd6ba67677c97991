//! Starting a worker, for a client's session or for a warm pool: the admission charge, a uid
//! lease, the session cgroup, the confined spawn ([`spawn::spawn`]) and the wait for `Ready`,
//! in that order. On any failure everything taken so far is released in the session release
//! order (the cgroup killed, the cgroup and the directory removed, then the uid and the
//! charge). What comes out is a [`Prepared`] worker: a session takes it over whole
//! ([`crate::session::Session::start`]) or a pool keeps it idle (`pool.rs`).
//!
//! Failures are a [`StartError`]; `From<StartError> for KernelError` gives the replies
//! clients see (`CapacityExceeded` for a budget, `WorkerFailed` with the error's text for the
//! rest), and the shims translate those as any other core error.

use crate::admission::{Admission, Charge, Permit, Refused};
use crate::cgroup::{Backend, GroupLimits, SessionGroup};
use crate::config::{Config, Engine, Environment};
use crate::identity::{Caller, UidLease, UidPool};
use crate::worker::spawn::{self, Spawned, WorkerSpec};
use sandcell_confine::Enforcement;
use sandcell_proto::kernel::{KernelError, Language};
use sandcell_proto::worker::WorkerMessage;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::watch;

/// How the daemon runs its workers.
#[derive(Debug, Clone)]
pub struct Options {
    /// Strict confinement (production) or best effort (`--insecure-dev`).
    pub enforcement: Enforcement,
    /// Per-session uids; `None` keeps the daemon's uid (development without root only).
    pub per_session_uids: bool,
}

/// A worker that has confined itself and said `Ready`, not yet owned by any session: a
/// complete session-to-be with its own cgroup, directory, uid and admission charge.
#[derive(Debug)]
pub struct Prepared {
    /// Session id it will have (a [`sandcell_proto::kernel::SessionId`], 32 hex digits).
    pub id: String,
    /// Interpreter.
    pub language: Language,
    /// Environment name.
    pub environment: String,
    /// Guest memory it was started with, bytes.
    pub guest_memory: u64,
    /// Engine string from `Ready`.
    pub engine: String,
    /// The process and its pipes.
    pub spawned: Spawned,
    /// Its cgroup.
    pub group: Arc<dyn SessionGroup>,
    /// Its directory (`<state_dir>/sessions/<id>`).
    pub session_dir: PathBuf,
    /// Its uid; `None` when workers keep the daemon's uid (development without root).
    pub lease: Option<UidLease>,
    /// Its admission charge.
    pub permit: Permit,
    /// Its keeper, started while it waited in a warm pool when the daemon keeps sessions for
    /// adoption ([`crate::keeper::start_warm`]): the session that takes it has its keeper
    /// without a process start on its `Open`.
    pub keeper: Option<crate::keeper::WarmKeeper>,
}

impl Prepared {
    /// Kills and releases an unused worker in the session release order: kill, reap, remove
    /// cgroup and directory, then uid and permit.
    pub async fn discard(mut self) {
        if let Some(k) = self.keeper.take() {
            let _ = tokio::task::spawn_blocking(move || k.end()).await;
        }
        super::kill_and_reap(
            &mut self.spawned.child,
            self.spawned.pidfd.as_ref(),
            &self.group,
        )
        .await;
        super::remove_remains(&self.id, self.group.clone(), self.session_dir.clone()).await;
        drop(self.lease.take());
        drop(self.permit);
    }

    /// Sends SIGKILL to the worker's process group and to the worker (through its pidfd where
    /// there is one), without waiting: for a daemon about to exit, whose successor's sweep
    /// removes the worker's cgroup and directory (`Backend::sweep_stale_except`). A warm
    /// worker has run no cell, so its process group holds every process it has.
    pub fn kill_now(&self) {
        if let Some(k) = &self.keeper {
            k.end_now();
        }
        // The process group of our own unreaped child: its id cannot be reused until we reap
        // the child.
        if let Some(pid) = self.spawned.child.id() {
            let _ = crate::sys::kill_group(pid, libc::SIGKILL);
        }
        super::signal_process(
            &self.spawned.child,
            self.spawned.pidfd.as_ref(),
            libc::SIGKILL,
        );
    }

    /// Starts this warm worker's keeper ([`crate::keeper::start_warm`]) for the sessions that
    /// `keep` keeps, so that the `Open` that takes the worker does not start one: the start
    /// moves a process into the worker's cgroups, and each such move waits for an RCU grace
    /// period (the cgroup threadgroup semaphore taken for writing, kernel
    /// `kernel/cgroup/cgroup.c`), most of the keeper's start. A keeper that cannot start
    /// is logged and left to the session (which then starts its own, as a cold worker's does).
    /// The egress listener is not held yet: it is granted with the session ([`KEEP`]).
    ///
    /// [`KEEP`]: crate::keeper::KEEP
    pub async fn start_warm_keeper(&mut self, keep: &crate::session::Keep) {
        use std::os::fd::AsFd;
        let spec = crate::keeper::Spec {
            session: self.id.clone(),
            socket: crate::records::keeper_socket(&keep.dir, &self.id),
            timeout: keep.timeout,
            session_dir: self.session_dir.clone(),
            procs: self.group.procs_files(),
        };
        let s = &self.spawned;
        let held = crate::session::held_of(
            s.pidfd.as_ref(),
            &self.session_dir,
            s.requests.as_fd(),
            s.replies.get_ref().as_fd(),
            s.stdout
                .as_ref()
                .zip(s.stderr.as_ref())
                .map(|(o, e)| (o.as_fd(), e.as_fd())),
            None,
        );
        let started = match held {
            Ok(held) => {
                tokio::task::spawn_blocking(move || crate::keeper::start_warm(&spec, &held))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
            }
            Err(e) => Err(e),
        };
        match started {
            Ok(k) => {
                tracing::debug!(session = %self.id, keeper = k.lifeline.pid, "warm worker's keeper started");
                self.keeper = Some(k);
            }
            Err(e) => {
                tracing::warn!(session = %self.id, error = %e, "warm worker's keeper did not start; its session will start one")
            }
        }
    }

    /// Whether the worker process still runs (a dead one is reaped here).
    pub fn alive(&mut self) -> bool {
        matches!(self.spawned.child.try_wait(), Ok(None))
    }
}

/// Why a worker could not be started. Its text is the `WorkerFailed` reason clients see.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A daemon-wide admission budget has no room (sessions, guest or worker memory).
    #[error("{0}")]
    Admission(Refused),
    /// Every worker uid is leased (or quarantined): `worker_uid_count` of them.
    #[error("no free worker uid (worker_uid_count {count})")]
    Uids {
        /// The configured number of worker uids.
        count: u32,
    },
    /// The session cgroup could not be created or limited.
    #[error("{0}")]
    Cgroup(crate::cgroup::Error),
    /// The session directory, the pipes or the process could not be made, or the worker is
    /// not in its cgroup.
    #[error("{0}")]
    Spawn(spawn::Error),
    /// The worker reported a `fatal` line at `stage` of its start (confinement, interpreter).
    #[error("worker failed at {stage}: {reason}")]
    Fatal {
        /// The start-up stage (e.g. `confine`, `interpreter`).
        stage: String,
        /// The worker's own reason.
        reason: String,
    },
    /// The kernel's random source failed (getrandom(2)), so no session id could be drawn.
    #[error("drawing a session id: {0}")]
    Random(std::io::Error),
    /// The worker exited before it said `Ready`.
    #[error("worker exited before it was ready ({status}); see the daemon's log")]
    ExitedEarly {
        /// Its exit status as text (`exit status: 1`, `signal: 9 (SIGKILL)`); empty if unknown.
        status: String,
    },
    /// No `Ready` within `worker_start_timeout_seconds`.
    #[error("worker not ready after {timeout:?}")]
    NotReady {
        /// The timeout in force.
        timeout: Duration,
    },
    /// The worker's first line was no `ready`/`fatal`, or it could not be read.
    #[error("{0}")]
    Protocol(String),
    /// The start was cancelled: its client went away, or `TerminateSession` named it.
    #[error("start cancelled (the client went away, or the session was terminated)")]
    Cancelled,
}

impl StartError {
    /// The budget a capacity refusal names (`max_concurrent_sessions`, ...,
    /// `worker_uid_count`); `None` for a failure of the worker's start itself.
    pub fn budget(&self) -> Option<&'static str> {
        match self {
            StartError::Admission(r) => Some(r.budget),
            StartError::Uids { .. } => Some("worker_uid_count"),
            _ => None,
        }
    }
}

impl From<StartError> for KernelError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::Admission(r) => r.into(),
            StartError::Uids { count } => KernelError::CapacityExceeded {
                budget: "worker_uid_count".into(),
                in_use: u64::from(count),
                requested: 1,
                max: u64::from(count),
                retry_after_seconds: None,
            },
            other => KernelError::WorkerFailed {
                reason: other.to_string(),
            },
        }
    }
}

/// A worker being started for a client: visible in listings (state `starting`), cancelled by
/// `TerminateSession` or when its client goes away.
#[derive(Debug)]
struct Starting {
    owner: Caller,
    language: Language,
    since: SystemTime,
    cancel: Arc<watch::Sender<bool>>,
}

/// A session whose worker is still starting, as listed.
#[derive(Debug, Clone)]
pub struct StartingInfo {
    /// Session id it will have.
    pub id: String,
    /// Interpreter.
    pub language: Language,
    /// Owner uid.
    pub uid: u32,
    /// Owner pid.
    pub pid: u32,
    /// When the start began.
    pub since: SystemTime,
}

/// Who asked for a worker and how to call its start off (a client's start; the pool's
/// starts have none).
#[derive(Debug)]
pub struct StartFor {
    owner: Caller,
    cancel: watch::Receiver<bool>,
    cancel_tx: Arc<watch::Sender<bool>>,
}

impl StartFor {
    /// A start for `owner`, cancelled once `cancel` holds `true`.
    pub fn new(owner: Caller, cancel: Arc<watch::Sender<bool>>) -> StartFor {
        StartFor {
            owner,
            cancel: cancel.subscribe(),
            cancel_tx: cancel,
        }
    }
}

/// What a session run by `engine` with `guest_memory` bytes is charged: guest memory is
/// Eryx's linear memory (native engines are charged none of it), worker memory is
/// `max_worker_memory_bytes` of `cfg`.
pub fn charge(cfg: &Config, engine: Engine, guest_memory: u64) -> Charge {
    Charge {
        guest_memory: if engine == Engine::Eryx {
            guest_memory
        } else {
            0
        },
        worker_memory: cfg.limits.max_worker_memory_bytes,
    }
}

/// `<state_dir>/sessions`.
pub fn sessions_dir(c: &Config) -> PathBuf {
    c.daemon.state_dir.join("sessions")
}

/// A new session id: 128 random bits as a [`sandcell_proto::kernel::SessionId`].
///
/// Errors: the kernel's random source failed ([`crate::sys::random_bytes`]).
pub fn new_session_id() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    crate::sys::random_bytes(&mut b)?;
    Ok(sandcell_proto::kernel::SessionId::from_random(b).into_string())
}

/// Starts workers: holds what every start draws on (admission, uids, cgroups) and the list of
/// the starts under way for clients.
pub struct Starter {
    admission: Admission,
    cgroups: Arc<dyn Backend>,
    uids: UidPool,
    options: Options,
    /// Workers being started for a client, by session id (listed as `starting`).
    starting: Mutex<HashMap<String, Starting>>,
}

impl std::fmt::Debug for Starter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Starter")
            .field("cgroups", &self.cgroups.mode())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Removes a starting worker from the listing when its start ends, however it ends.
struct Unlist<'a> {
    starter: &'a Starter,
    id: String,
}

impl Drop for Unlist<'_> {
    fn drop(&mut self) {
        self.starter.starting.lock().unwrap().remove(&self.id);
    }
}

impl Starter {
    /// A starter charging `admission`, leasing from `uids` (when `options` asks for
    /// per-session uids) and creating groups with `cgroups`.
    pub fn new(
        admission: Admission,
        cgroups: Arc<dyn Backend>,
        uids: UidPool,
        options: Options,
    ) -> Starter {
        Starter {
            admission,
            cgroups,
            uids,
            options,
            starting: Mutex::default(),
        }
    }

    /// The worker uids it leases from (shared: leases return on drop).
    pub fn uids(&self) -> &UidPool {
        &self.uids
    }

    /// Workers starting for clients now, oldest first.
    pub fn starting(&self) -> Vec<StartingInfo> {
        let mut v: Vec<_> = self
            .starting
            .lock()
            .unwrap()
            .iter()
            .map(|(id, s)| StartingInfo {
                id: id.clone(),
                language: s.language,
                uid: s.owner.uid,
                pid: s.owner.pid,
                since: s.since,
            })
            .collect();
        v.sort_by_key(|s| s.since);
        v
    }

    /// The owner uid and cancel switch of the start of session `id`, if one is under way.
    pub fn find_starting(&self, id: &str) -> Option<(u32, Arc<watch::Sender<bool>>)> {
        self.starting
            .lock()
            .unwrap()
            .get(id)
            .map(|s| (s.owner.uid, s.cancel.clone()))
    }

    /// Whether the start of session `id` is still under way (listed).
    pub fn is_starting(&self, id: &str) -> bool {
        self.starting.lock().unwrap().contains_key(id)
    }

    /// Charges admission, leases a uid, creates the cgroup and directory, spawns a confined
    /// worker for `env` with `guest_memory` bytes, and waits (at most
    /// `worker_start_timeout_seconds` of `cfg`) for its `Ready`. On any failure everything
    /// taken so far is released. With `start_for` (a client's start, not the pool's), the
    /// worker is listed as `starting` until then, and its cancellation ends the wait for
    /// `Ready` at once; without it (a warm pool's start) admission leaves a session of room
    /// ([`crate::admission::Admission::try_admit_leaving_room`]) and the environment's
    /// `preload` modules are imported before `Ready` (a client's own start skips them).
    ///
    /// Errors: every [`StartError`].
    pub async fn start(
        &self,
        cfg: &Config,
        env: &Environment,
        guest_memory: u64,
        start_for: Option<StartFor>,
    ) -> Result<Prepared, StartError> {
        let mut stages = crate::stages::Stages::new();
        let language = env.language;
        // A pool's start (no client) never takes the last free session or memory.
        let pooled = start_for.is_none();
        let charge = charge(cfg, env.engine, guest_memory);
        let permit = if pooled {
            self.admission.try_admit_leaving_room(charge)
        } else {
            self.admission.try_admit(charge)
        }
        .map_err(StartError::Admission)?;
        let lease = if self.options.per_session_uids {
            Some(self.uids.allocate().ok_or(StartError::Uids {
                count: cfg.daemon.worker_uid_count,
            })?)
        } else {
            None
        };
        let id = new_session_id().map_err(StartError::Random)?;
        let mut cancel = None;
        let _listed = start_for.map(|s| {
            self.starting.lock().unwrap().insert(
                id.clone(),
                Starting {
                    owner: s.owner,
                    language,
                    since: SystemTime::now(),
                    cancel: s.cancel_tx,
                },
            );
            cancel = Some(s.cancel);
            Unlist {
                starter: self,
                id: id.clone(),
            }
        });
        let uid = lease.as_ref().map(|l| l.uid());
        // BLAS/OpenMP threads follow the session's CPU quota (all CPUs when uncapped).
        let cpu_threads = if cfg.daemon.worker_cpus > 0.0 {
            cfg.daemon.worker_cpus.ceil() as u32
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
        };
        let spec = WorkerSpec {
            language,
            engine: env.engine,
            interpreter: env.interpreter.clone(),
            library_paths: env.library_paths.clone(),
            package_source: env.package_source.clone(),
            egress: env.egress.is_some(),
            // Only a warm worker imports the preloads ahead of its session; a client waiting
            // for its own worker does not wait for modules its cells may never import.
            preload: if pooled {
                env.preload.clone()
            } else {
                Vec::new()
            },
            cpu_threads: cpu_threads.max(1),
            session_id: id.clone(),
            session_dir: sessions_dir(cfg).join(&id),
            uid,
            gid: uid,
            worker_dir: cfg.daemon.worker_dir.clone(),
            python_runtime_dir: cfg.daemon.python_runtime_dir.clone(),
            guest_memory_bytes: guest_memory,
            native_address_space: None,
            max_file_bytes: cfg.limits.max_session_files_bytes,
            enforcement: self.options.enforcement,
        };
        let cpu_max = (cfg.daemon.worker_cpus > 0.0)
            .then_some(((cfg.daemon.worker_cpus * 100_000.0) as u64, 100_000));
        let limits = GroupLimits {
            memory_bytes: cfg.limits.max_worker_memory_bytes,
            max_pids: cfg.daemon.max_worker_pids,
            cpu_max,
        };
        // The cgroup, the session directory and its file system (a mount), and the fork and
        // exec run on the blocking pool: milliseconds, tens under load, that would otherwise
        // stall a runtime thread and every task queued behind it (other sessions' cells).
        let made = {
            let (cgroups, id, spec) = (self.cgroups.clone(), id.clone(), spec.clone());
            tokio::task::spawn_blocking(move || {
                let group: Arc<dyn SessionGroup> = cgroups
                    .create(&id, &limits)
                    .map(Arc::from)
                    .map_err(StartError::Cgroup)?;
                let spawned = spawn::spawn(&spec, &group);
                Ok::<_, StartError>((group, spawned))
            })
            .await
            .unwrap_or_else(|e| {
                Err(StartError::Spawn(spawn::Error::Io {
                    op: "start the worker".into(),
                    source: std::io::Error::other(e.to_string()),
                }))
            })?
        };
        stages.mark("cgroup_spawn");
        let (group, spawned) = made;
        let mut spawned = match spawned {
            Ok(s) => s,
            Err(e) => return Err(failed(&id, StartError::Spawn(e), group, spec.session_dir).await),
        };
        // The worker confines itself, loads its interpreter and says Ready; nothing is sent to
        // it before that.
        let timeout = Duration::from_secs_f64(cfg.daemon.worker_start_timeout_seconds);
        let ready = wait_ready(&mut spawned, timeout, cancel.as_mut()).await;
        stages.mark("ready");
        stages.log(if pooled { "pool_start" } else { "start" }, &id);
        match ready {
            Ok(engine) => Ok(Prepared {
                id,
                language,
                environment: env.name.clone(),
                guest_memory,
                engine,
                spawned,
                group,
                session_dir: spec.session_dir,
                lease,
                permit,
                keeper: None,
            }),
            Err(e) => {
                let _ = spawned.child.start_kill();
                let _ = spawned.child.wait().await;
                // Before Ready only trusted code (the launcher, the confinement) has written
                // to stderr: log its head for the operator (never sent to the client).
                if let Some(err) = spawned.stderr.as_mut() {
                    let mut buf = vec![0u8; 4096];
                    if let Ok(n) = err.try_read(&mut buf)
                        && n > 0
                    {
                        let text = sandcell_proto::text::escape_lossy(&buf[..n]);
                        tracing::warn!(session = %id, stderr = %text.trim_end(), "worker stderr before it was ready");
                    }
                }
                Err(failed(&id, e, group, spec.session_dir).await)
            }
        }
    }
}

/// Waits for the worker's first line, at most `timeout`, or until `cancel` turns true;
/// returns the engine string of its `Ready`.
///
/// Errors: [`StartError::Cancelled`], [`StartError::NotReady`], [`StartError::Fatal`],
/// [`StartError::ExitedEarly`], [`StartError::Protocol`].
async fn wait_ready(
    spawned: &mut Spawned,
    timeout: Duration,
    cancel: Option<&mut watch::Receiver<bool>>,
) -> Result<String, StartError> {
    let cancelled = async {
        match cancel {
            Some(c) => {
                let _ = c.wait_for(|c| *c).await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    let ready = tokio::select! {
        r = tokio::time::timeout(timeout, spawned.replies.next_line()) => r,
        _ = cancelled => return Err(StartError::Cancelled),
    };
    match ready {
        Ok(Ok(Some(line))) => match WorkerMessage::parse(&line) {
            Ok(WorkerMessage::Ready { engine, .. }) => Ok(engine),
            Ok(WorkerMessage::Fatal { stage, reason }) => Err(StartError::Fatal { stage, reason }),
            Ok(_) => Err(StartError::Protocol(
                "worker spoke before it was ready".into(),
            )),
            Err(e) => Err(StartError::Protocol(format!("bad ready line: {e}"))),
        },
        Ok(Ok(None)) => {
            let status = spawned
                .child
                .wait()
                .await
                .map(|s| s.to_string())
                .unwrap_or_default();
            Err(StartError::ExitedEarly { status })
        }
        Ok(Err(e)) => Err(StartError::Protocol(e.to_string())),
        Err(_) => Err(StartError::NotReady { timeout }),
    }
}

/// Releases what a failed start of session `id` took (its cgroup's processes killed, the
/// cgroup and `dir` removed), logs `e` and returns it; the uid and the charge are released by
/// the caller's drop, after this.
async fn failed(id: &str, e: StartError, group: Arc<dyn SessionGroup>, dir: PathBuf) -> StartError {
    let g = group.clone();
    let _ = tokio::task::spawn_blocking(move || g.kill_all(crate::cgroup::KILL_TIMEOUT)).await;
    super::remove_remains(id, group, dir).await;
    tracing::warn!(reason = %e, "worker failed to start");
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> Refused {
        Refused {
            budget: "max_concurrent_sessions",
            in_use: 4,
            requested: 1,
            max: 4,
            retry_after_ms: None,
        }
    }

    #[test]
    fn capacity_refusals_keep_their_budget() {
        assert_eq!(
            StartError::Admission(refused()).budget(),
            Some("max_concurrent_sessions")
        );
        assert_eq!(
            KernelError::from(StartError::Admission(refused())),
            KernelError::CapacityExceeded {
                budget: "max_concurrent_sessions".into(),
                in_use: 4,
                requested: 1,
                max: 4,
                retry_after_seconds: None,
            }
        );
        assert_eq!(
            KernelError::from(StartError::Uids { count: 3 }),
            KernelError::CapacityExceeded {
                budget: "worker_uid_count".into(),
                in_use: 3,
                requested: 1,
                max: 3,
                retry_after_seconds: None,
            }
        );
        assert_eq!(StartError::Cancelled.budget(), None);
    }

    #[test]
    fn start_failures_are_worker_failed_with_the_former_reasons() {
        let reason = |e: StartError| match KernelError::from(e) {
            KernelError::WorkerFailed { reason } => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            reason(StartError::Fatal {
                stage: "landlock".into(),
                reason: "EPERM".into()
            }),
            "worker failed at landlock: EPERM"
        );
        assert_eq!(
            reason(StartError::ExitedEarly {
                status: "exit status: 1".into()
            }),
            "worker exited before it was ready (exit status: 1); see the daemon's log"
        );
        assert_eq!(
            reason(StartError::NotReady {
                timeout: Duration::from_secs(20)
            }),
            "worker not ready after 20s"
        );
        assert_eq!(
            reason(StartError::Protocol(
                "worker spoke before it was ready".into()
            )),
            "worker spoke before it was ready"
        );
        assert_eq!(
            reason(StartError::Cancelled),
            "start cancelled (the client went away, or the session was terminated)"
        );
        assert_eq!(
            reason(StartError::Cgroup(crate::cgroup::Error::Verify("x".into()))),
            "cgroup verification failed: x"
        );
    }
}
