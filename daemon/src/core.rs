//! The daemon's core: sessions, admission, identities, and the one authorization path.
//!
//! Architecture invariant: this module knows neither Varlink nor D-Bus. The `varlink/` and
//! `dbus/` shims translate their calls into the methods here, and every method follows
//! the same order: validate -> look up -> authorize -> act.

use crate::admission::{Admission, Budgets, Refused, UidBudgets, UidCharge};
use crate::auth::{Action, Authority};
use crate::cgroup::Backend;
use crate::config::{self, Config, Environment};
use crate::identity::{Caller, UidPool};
use crate::session::{Event, ExecuteRefused, Session, SessionLimits};
use crate::worker::start::{Options, Prepared, StartError, StartFor, Starter, StartingInfo};
use sandcell_proto::kernel::{
    EndReason, Frame, InterruptReason, InterruptReply, KernelError, Language, Limits,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};
use tokio::sync::{broadcast, mpsc, watch};

mod connections;
mod files;
mod own;
mod query;
pub use connections::{ConnectionRefused, Shares};
pub use files::{PUT_FILE_SECONDS, Upload};

/// What `Open` asks for: a session of `language` (`python` or `r`) in `environment` (unset:
/// the language's default), with the client's lowering of the per-cell `limits`.
#[derive(Debug, Clone, Copy)]
pub struct OpenRequest<'a> {
    /// `python` or `r`.
    pub language: &'a str,
    /// A named environment of that language (unset: the language's default).
    pub environment: Option<&'a str>,
    /// Per-cell limits the client lowers (never raises) for this session.
    pub limits: Option<&'a Limits>,
    /// Detached: the session survives its connection this many seconds idle (1 to
    /// `max_detached_idle_seconds`); unset: it ends with its connection.
    pub detached_idle_seconds: Option<u64>,
    /// The session's cells may call the client's tools (each call waits at most
    /// `host_call_timeout_seconds` for `HostReply`).
    pub host_calls: bool,
    /// What its cells show: the last expression's value (`display_last_expression`) and
    /// MIME bundles (`rich_output`).
    pub shown: crate::session::Shown,
    /// The session's subset of its environment's egress allowlist (host names and `*.`
    /// wildcards, each within the environment's list: [`session_egress`]); unset: the whole
    /// list.
    pub egress: Option<&'a [String]>,
}

/// What `Run` asks for its one-shot session: as [`OpenRequest`], never detached.
#[derive(Debug, Clone, Copy)]
pub struct RunRequest<'a> {
    /// `python` or `r`.
    pub language: &'a str,
    /// A named environment of that language (unset: the language's default).
    pub environment: Option<&'a str>,
    /// Per-cell limits the client lowers (never raises) for this cell.
    pub limits: Option<&'a Limits>,
    /// The cell may call the client's tools (as [`OpenRequest::host_calls`]).
    pub host_calls: bool,
    /// What the cell shows (as [`OpenRequest::shown`]).
    pub shown: crate::session::Shown,
    /// The session's egress subset (as [`OpenRequest::egress`]).
    pub egress: Option<&'a [String]>,
}

/// The entries of `hosts` (a session's egress list) that lie within `allowed` (an
/// environment's list), each judged on its own; malformed entries are dropped.
pub fn still_allowed(allowed: &[String], hosts: &[String]) -> Vec<String> {
    use sandcell_egress::allow::Allowlist;
    let Ok(wide) = Allowlist::parse(allowed) else {
        return Vec::new();
    };
    hosts
        .iter()
        .filter(|h| {
            Allowlist::parse(std::slice::from_ref(*h))
                .is_ok_and(|one| wide.outside(&one).is_empty())
        })
        .cloned()
        .collect()
}

/// The hosts a session of `env` may reach through the egress proxy: `requested` (host names
/// and leading-`*.` wildcards, at most `sandcell_egress::control::MAX_HOSTS`) when every
/// entry lies within the environment's allowlist, else the whole list; `None` for an
/// environment without egress.
///
/// Errors: `InvalidParameter` (parameter `egress`) naming the first entry that is malformed
/// or outside the environment's list, or any entry for an environment without egress.
pub fn session_egress(
    env: &Environment,
    requested: Option<&[String]>,
) -> Result<Option<Vec<String>>, KernelError> {
    use sandcell_egress::allow::Allowlist;
    let bad = |reason: String| KernelError::InvalidParameter {
        parameter: "egress".into(),
        reason,
    };
    let Some(policy) = &env.egress else {
        return match requested {
            Some(r) if !r.is_empty() => Err(bad(format!(
                "environment {} has no egress: {} not allowed",
                env.name,
                sandcell_proto::text::escape_lossy(r[0].as_bytes())
                    .chars()
                    .take(80)
                    .collect::<String>()
            ))),
            _ => Ok(None),
        };
    };
    let Some(requested) = requested else {
        return Ok(Some(policy.hosts.clone()));
    };
    let max = sandcell_egress::control::MAX_HOSTS;
    if requested.len() > max {
        return Err(bad(format!("at most {max} hosts")));
    }
    let wide = Allowlist::parse(&policy.hosts).map_err(|e| bad(e.to_string()))?;
    let narrow = Allowlist::parse(requested).map_err(|e| bad(e.to_string()))?;
    if let Some(p) = wide.outside(&narrow).first() {
        return Err(bad(format!(
            "not in environment {}'s egress allowlist: {p}",
            env.name
        )));
    }
    Ok(Some(
        narrow.patterns().iter().map(ToString::to_string).collect(),
    ))
}

/// Frames a cell's channel holds (the actor waits when it is full).
pub(crate) const FRAME_QUEUE: usize = 64;

/// Why [`Core::start_cell`] started nothing.
enum Started {
    /// The call's token names this cell of the session.
    Repeated(u64),
    /// The error to answer.
    Refused(KernelError),
}

/// An `Execute` whose token names `cell` of `s`: followed as `Attach` follows it (the
/// frames to replay; live ones go to `to`). A cell that has just started may not have its
/// record yet (the actor remembers the token first, the relay registers the record when its
/// `started` frame passes): while it is the running cell, the record is waited for, at most
/// [`REPEAT_RECORD_WAIT`].
///
/// Errors: `NoSuchCell` when nothing of the cell is retained (an `Execute` on a session that
/// ends with its connection, a record already dropped); `SessionBusy` for a running cell
/// of a detached session whose record did not come in time.
async fn follow_repeat(
    s: &Session,
    session: &str,
    cell: u64,
    mut to: crate::cells::Attachment,
) -> Result<Option<(u64, Vec<Frame>)>, KernelError> {
    tracing::info!(session = %s.id, cell, "a repeated Execute follows the cell that has its token");
    let t0 = std::time::Instant::now();
    loop {
        match s.cells.attach_or_return(&s.id, cell, to) {
            Ok(replay) => return Ok(Some((cell, replay))),
            Err(back) => to = back,
        }
        // Only a detached session's Execute gets its record after its token; a cell that is
        // not running anymore has its record by now, or never had one.
        let running = s.info.lock().unwrap().running_cell == Some(cell);
        if !running || s.detached_idle.is_none() {
            return Err(KernelError::NoSuchCell {
                session: echo_id(session),
                cell,
            });
        }
        if t0.elapsed() >= REPEAT_RECORD_WAIT {
            return Err(KernelError::SessionBusy {
                session: echo_id(session),
                cell,
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How long a repeated `Execute` waits for the record of the running cell its token names
/// (registered within microseconds of the cell's start, unless the daemon is starved).
const REPEAT_RECORD_WAIT: Duration = Duration::from_secs(1);

/// Checks `Execute`'s and `Submit`'s optional cell token.
///
/// Errors: `InvalidParameter` (`token`), for a token that `check_cell_token` refuses.
fn check_token(token: Option<&str>) -> Result<(), KernelError> {
    match token.map(sandcell_proto::kernel::check_cell_token) {
        Some(Err(reason)) => Err(KernelError::InvalidParameter {
            parameter: "token".into(),
            reason: reason.into(),
        }),
        _ => Ok(()),
    }
}

/// Reserves retention for a new cell record of `s`.
///
/// Errors: `CapacityExceeded` (`retained_output_bytes`).
fn retention_charge(s: &Session) -> Result<crate::cells::Charge, KernelError> {
    s.cells
        .reserve()
        .map_err(|r| KernelError::CapacityExceeded {
            budget: "retained_output_bytes".into(),
            in_use: r.in_use,
            requested: crate::cells::RESERVE,
            max: sandcell_proto::kernel::DAEMON_RETAINED_BYTES,
            retry_after_seconds: None,
        })
}

/// The core.
pub struct Core {
    config: RwLock<Arc<Config>>,
    admission: Admission,
    cgroups: Arc<dyn Backend>,
    /// Starts workers (admission charge, uid, cgroup, spawn, Ready) and lists the starts
    /// under way for clients (listed as `starting`).
    starter: Starter,
    authority: RwLock<Arc<dyn Authority>>,
    sessions: Arc<Mutex<HashMap<String, Arc<Session>>>>,
    /// Sessions that ended lately, for `SessionEnded`.
    ended: Arc<crate::ended::Ended>,
    /// The node identifier in session ids (empty: ids are not qualified); fixed at start.
    node: String,
    events: broadcast::Sender<Event>,
    stopping: AtomicBool,
    connections: AtomicU64,
    next_connection: AtomicU64,
    /// Open connections per client uid.
    connections_per_uid: Mutex<HashMap<u32, u64>>,
    /// Rate limit of the refusal lines a uid's connections and session starts cause.
    refusal_log: crate::loglimit::LogLimit,
    pool: crate::pool::Pool<Prepared>,
    /// Readiness and inventory of each environment (`ListEnvironments`).
    environments: crate::environments::Reports,
    /// This core, weakly, so work that must finish can run on its own task.
    me: std::sync::Weak<Core>,
    /// How sessions are kept for a successor daemon (`None`: they end with this one).
    keep: std::sync::OnceLock<crate::session::Keep>,
    /// `false` while client calls are held ([`Core::hold_calls`]): connections are accepted
    /// and authorized but their calls wait until [`Core::release_calls`].
    calls_open: tokio::sync::watch::Sender<bool>,
    /// Connections accepted while calls were held whose first call is not answered yet
    /// ([`Core::early_caller`]).
    early_callers: Arc<tokio::sync::watch::Sender<usize>>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("cgroups", &self.cgroups.mode())
            .finish_non_exhaustive()
    }
}

fn budgets(c: &Config) -> Budgets {
    Budgets {
        sessions: c.limits.max_concurrent_sessions,
        guest_memory: c.limits.max_aggregate_guest_memory_bytes,
        worker_memory: c.limits.max_aggregate_worker_memory_bytes,
    }
}

fn uid_budgets(c: &Config) -> UidBudgets {
    let l = &c.limits;
    UidBudgets {
        sessions: l.sessions_per_uid(),
        detached: l.detached_per_uid(),
        guest_memory: l.guest_memory_per_uid(),
        worker_memory: l.worker_memory_per_uid(),
        starts_per_second: l.max_starts_per_second_per_uid,
        start_burst: l.max_start_burst_per_uid,
    }
}

/// A client connection counted against the connection caps; give it back with
/// [`Core::connection_closed`].
#[derive(Debug)]
pub struct ConnectionGuard {
    id: u64,
    uid: u32,
}

impl ConnectionGuard {
    /// The connection's id.
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// Longest client-given session id echoed in an error, bytes (real ids are 32).
/// The longest valid node-qualified id (a 64-character node, a dot, 32 hex digits): 97.
const ECHO_ID_BYTES: usize =
    sandcell_proto::kernel::MAX_NODE_ID_LEN + 1 + sandcell_proto::kernel::SessionId::LEN;

/// A client-given session id as echoed in errors: as given when it has the shape of an id,
/// else cut to its first bytes.
fn echo_id(id: &str) -> String {
    if id.len() <= ECHO_ID_BYTES {
        return id.to_owned();
    }
    let mut end = ECHO_ID_BYTES - 3;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &id[..end])
}

impl Core {
    /// A core serving `config` with `cgroups` and `authority`.
    pub fn new(
        config: Config,
        options: Options,
        cgroups: Arc<dyn Backend>,
        authority: Arc<dyn Authority>,
    ) -> Arc<Core> {
        let (events, _) = broadcast::channel(256);
        let admission = Admission::new(budgets(&config), uid_budgets(&config));
        let uids = UidPool::new(
            config.daemon.worker_uid_base,
            config.daemon.worker_uid_count,
        );
        Arc::new_cyclic(|me| Core {
            me: me.clone(),
            starter: Starter::new(admission.clone(), cgroups.clone(), uids, options),
            admission,
            node: crate::node::resolve(config.daemon.node_id.as_deref()),
            config: RwLock::new(Arc::new(config)),
            cgroups,
            authority: RwLock::new(authority),
            sessions: Arc::default(),
            ended: Arc::default(),
            events,
            stopping: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            next_connection: AtomicU64::new(1),
            connections_per_uid: Mutex::default(),
            refusal_log: crate::loglimit::LogLimit::default(),
            pool: crate::pool::Pool::default(),
            environments: crate::environments::Reports::default(),
            keep: std::sync::OnceLock::new(),
            calls_open: tokio::sync::watch::Sender::new(true),
            early_callers: Arc::new(tokio::sync::watch::Sender::new(0)),
        })
    }

    /// Holds client calls until [`Core::release_calls`]: a daemon that adopts its
    /// predecessor's sessions serves its socket while it adopts them, so that a connection
    /// made during the restart is accepted and its authorization asked meanwhile
    /// (`varlink::serve_connection`). A cell's call on one session goes on once that session
    /// is adopted ([`Core::session_calls_released`]); every other call sees the daemon only
    /// once every session is adopted or recorded as ended.
    pub fn hold_calls(&self) {
        self.calls_open.send_replace(false);
    }

    /// Lets held calls go on ([`Core::hold_calls`]).
    pub fn release_calls(&self) {
        self.calls_open.send_replace(true);
    }

    /// Whether client calls are held now.
    pub fn calls_held(&self) -> bool {
        !*self.calls_open.borrow()
    }

    /// Counts a connection accepted while calls are held ([`Core::hold_calls`]) until the
    /// returned guard is dropped: when its first call is answered, or it closes.
    pub fn early_caller(&self) -> crate::pool::RefillHold {
        crate::pool::RefillHold::on(&self.early_callers)
    }

    /// Waits until every connection accepted while calls were held has had its first call
    /// answered or closed ([`Core::early_caller`]): a daemon that adopted sessions holds back
    /// its warm pools' refill and readiness probe (worker starts, CPU their owners' first
    /// calls would wait behind) until then, for a bounded time.
    pub async fn early_callers_answered(&self) {
        let mut rx = self.early_callers.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Waits until client calls are not held.
    pub async fn calls_released(&self) {
        let mut rx = self.calls_open.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }

    /// Waits until a call on session `id` (as the client gave it, node-qualified or not) may
    /// go on: at once when calls are not held; while they are ([`Core::hold_calls`]), as soon
    /// as `id` is adopted ([`Core::adopt`] wakes the waiters of each session it registers) or
    /// calls are released, whichever comes first.
    pub async fn session_calls_released(&self, id: &str) {
        let local = self.resolve(id).ok();
        let mut rx = self.calls_open.subscribe();
        let _ = rx
            .wait_for(|open| {
                *open || local.is_some_and(|l| self.sessions.lock().unwrap().contains_key(l))
            })
            .await;
    }

    /// Keeps every client session opened from now on for adoption by a successor daemon
    /// (a keeper and a record per session; sandcelld(8), ADOPTION).
    pub fn enable_adoption(&self, keep: crate::session::Keep) {
        let _ = self.keep.set(keep);
    }

    /// Adopts a previous daemon's session `a` (checked by `session::connect_keeper`): takes
    /// its admission charge and per-uid reservation again (as it had them), its worker uid,
    /// its cgroup, and registers it under its id with its owner. A session that was not
    /// detached has lost its connection: it ends after `max_detached_idle_seconds` idle.
    ///
    /// Errors: why it could not be adopted (a budget that no longer has room, a uid or cgroup
    /// that cannot be taken, the descriptors): the keeper is told to end, and the caller
    /// records the session as ended with `adoption_refused`.
    pub fn adopt(&self, a: crate::session::Adoptable) -> Result<Arc<Session>, String> {
        let r = a.record.clone();
        let refuse = |why: String| {
            a.end();
            why
        };
        let Some(keep) = self.keep.get().cloned() else {
            return Err(refuse("adoption is not enabled".into()));
        };
        let cfg = self.config();
        let charge = crate::admission::Charge {
            guest_memory: r.charge_guest_memory,
            worker_memory: r.charge_worker_memory,
        };
        let detached = r.detached_idle_seconds.is_some();
        let mut permit = match self.admission.try_admit(charge) {
            Ok(p) => p,
            Err(e) => return Err(refuse(format!("admission: {}", KernelError::from(e)))),
        };
        match self.admission.reserve_uid(r.owner_uid, charge, detached) {
            Ok(u) => permit.attach(u),
            Err(e) => return Err(refuse(format!("admission: {}", KernelError::from(e)))),
        }
        let uid = match r.worker_uid {
            Some(u) => match self.starter.uids().claim(u) {
                Some(l) => Some(l),
                None => return Err(refuse(format!("worker uid {u} is not free"))),
            },
            None => None,
        };
        let cpu_max = (cfg.daemon.worker_cpus > 0.0)
            .then_some(((cfg.daemon.worker_cpus * 100_000.0) as u64, 100_000));
        let group: Arc<dyn crate::cgroup::SessionGroup> = match self.cgroups.adopt(
            &r.id,
            &crate::cgroup::GroupLimits {
                memory_bytes: cfg.limits.max_worker_memory_bytes,
                max_pids: cfg.daemon.max_worker_pids,
                cpu_max,
            },
        ) {
            Ok(g) => Arc::from(g),
            Err(e) => return Err(refuse(format!("cgroup: {e}"))),
        };
        let registry = self.sessions.clone();
        let ended = self.ended.clone();
        let state_dir = cfg.daemon.state_dir.clone();
        let owner = r.owner_uid;
        crate::ended::mark(&state_dir, &r.id, owner);
        let caller = Caller {
            uid: r.owner_uid,
            gid: r.owner_gid,
            pid: 0,
            connection: 0,
            subject: crate::identity::Subject::Process {
                pid: 0,
                start_time: 0,
                pidfd: None,
            },
        };
        let adopted_idle =
            (!detached).then(|| Duration::from_secs(cfg.limits.max_detached_idle_seconds));
        // The session's egress, granted again with the hosts it had that the environment's
        // allowlist still allows (each entry kept or dropped on its own); none when none is
        // left or the environment lost its egress (safer: no network).
        let egress = r.egress_hosts.as_deref().and_then(|hosts| {
            let env = cfg.environment(&r.environment)?;
            let policy = env.egress.clone()?;
            let hosts = still_allowed(&policy.hosts, hosts);
            if hosts.is_empty() {
                tracing::warn!(session = %r.id, "none of the adopted session's egress hosts is allowed any more: no grant");
                return None;
            }
            match session_egress(&env, Some(&hosts)) {
                Ok(Some(hosts)) => Some(crate::config::EgressConfig { hosts, ..policy }),
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(session = %r.id, error = %e, "the adopted session's egress is not granted again");
                    None
                }
            }
        });
        let session = crate::session::Session::adopt(
            a,
            crate::session::AdoptWith {
                owner: caller,
                group,
                uid,
                permit,
                adopted_idle,
                on_end: Box::new(move |id, ending: &crate::session::Ending| {
                    ended.record(id, owner, ending.reason, SystemTime::now());
                    registry.lock().unwrap().remove(id);
                    if ending.reason != EndReason::DaemonStopping {
                        crate::ended::unmark(&state_dir, id, owner);
                    }
                }),
                events: self.events.clone(),
                keep,
                egress,
            },
        )
        .map_err(|e| format!("taking the worker over: {e}"))?;
        self.sessions
            .lock()
            .unwrap()
            .insert(r.id.clone(), session.clone());
        // Logged before its held calls go on, so the line precedes any answer on it.
        tracing::info!(session = %r.id, uid = owner, worker = r.worker.pid, keeper = r.keeper.pid, "session adopted");
        // Its owner's calls held for it go on now (Core::session_calls_released).
        self.calls_open.send_modify(|_| {});
        crate::counters::counters().session_opened();
        Ok(session)
    }

    /// The warm worker pools.
    pub fn pool(&self) -> &crate::pool::Pool<Prepared> {
        &self.pool
    }

    /// The readiness and inventory of `env`: kept from an earlier check of the same
    /// configuration, or learned now by running its probe cell (`environments.rs`).
    pub async fn environment_report(&self, env: &Environment) -> crate::environments::Report {
        self.environments
            .get(env, || self.probe_environment(env))
            .await
    }

    /// [`Core::environment_report`], telling a check that could not run (`Err`: admission
    /// refused the probe's one-shot session, e.g. `CapacityExceeded`, or the daemon is
    /// stopping; nothing is cached) from a report (`Ok`, cached, ready or not).
    pub async fn environment_check(
        &self,
        env: &Environment,
    ) -> Result<crate::environments::Report, KernelError> {
        self.environments
            .try_get(env, || self.probe_environment(env))
            .await
    }

    /// Every environment served, in name order, with its report (checks run as needed, one
    /// at a time): `ListEnvironments` and the D-Bus `Environments` property.
    pub async fn list_environments(&self) -> Vec<sandcell_proto::kernel::Environment> {
        let mut out = Vec::new();
        for env in self.config().environments() {
            let r = self.environment_report(&env).await;
            let mut listed = crate::environments::listing(&env, r);
            listed.limits = Some(crate::environments::default_limits(&self.config(), &env));
            out.push(listed);
        }
        out
    }

    /// Runs the probe cell of `env` as a one-shot session of the daemon's own. `Err` only for
    /// reasons that say nothing about the environment (no capacity now, the daemon stopping).
    async fn probe_environment(
        &self,
        env: &Environment,
    ) -> Result<crate::environments::Report, KernelError> {
        let caller = Caller {
            uid: 0,
            gid: 0,
            pid: std::process::id(),
            connection: 0,
            subject: crate::identity::Subject::Daemon,
        };
        let (tx, rx) = mpsc::channel::<Frame>(16);
        if let Err(e) = self
            .run(
                &caller,
                RunRequest {
                    language: env.language.as_str(),
                    environment: Some(&env.name),
                    limits: None,
                    host_calls: false,
                    shown: true.into(),
                    egress: None,
                },
                crate::environments::probe_code(env).into(),
                tx,
            )
            .await
        {
            return crate::environments::refused(e);
        }
        Ok(crate::environments::read_probe(rx).await)
    }

    /// Starts the warm-pool refill task (a no-op while every pool size is 0).
    pub fn start_pool(self: &Arc<Self>) {
        tokio::spawn(crate::pool::run(Arc::downgrade(self)));
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.config.read().unwrap().clone()
    }

    /// Applies a new, already validated configuration to sessions opened from now on.
    pub fn reload(&self, config: Config) {
        self.admission
            .set_budgets(budgets(&config), uid_budgets(&config));
        *self.config.write().unwrap() = Arc::new(config);
    }

    /// Re-reads the configuration file `path` (a missing file is fine unless `required`) and
    /// the SANDCELL_* environment, and applies the result to sessions opened from now on: the
    /// one reload path of SIGHUP and D-Bus `Reload`. `by` names who asked, for the log. An
    /// invalid configuration is refused with its error and the previous one stays in force.
    /// Subscribers of [`Core::events`] get [`Event::Reloaded`] (the D-Bus shim announces the
    /// new admission figures with it).
    pub fn reload_from(&self, path: &Path, required: bool, by: &str) -> Result<(), config::Error> {
        match Config::load(path, required, std::env::vars()) {
            Ok(c) => {
                self.reload(c);
                tracing::info!(
                    by,
                    "configuration reloaded; new limits apply to new sessions"
                );
                let _ = self.events.send(Event::Reloaded);
                Ok(())
            }
            Err(e) => {
                tracing::error!(by, error = %e, "reload refused; the previous configuration stays in force");
                Err(e)
            }
        }
    }

    /// Replaces the authority (the polkit authority is selected once the system bus
    /// answers); decisions already taken are not revisited.
    pub fn set_authority(&self, authority: Arc<dyn Authority>) {
        *self.authority.write().unwrap() = authority;
    }

    /// Budgets and their use.
    pub fn admission(&self) -> (Budgets, Budgets) {
        self.admission.snapshot()
    }

    /// cgroup mode in use (`v2`, `v1`, `none`).
    pub fn cgroup_mode(&self) -> &'static str {
        self.cgroups.mode()
    }

    /// Subscribes to session events.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Sessions that ended lately.
    pub fn ended(&self) -> &crate::ended::Ended {
        &self.ended
    }

    /// Records the sessions a previous daemon left owner markers of as ended with
    /// `daemon_restarted` (ids and owners from [`crate::ended::take_markers`], read before the
    /// start-up sweep).
    pub fn restore_ended(&self, previous: &[(String, u32)]) {
        let now = SystemTime::now();
        for (id, owner) in previous {
            self.ended
                .record(id, *owner, EndReason::DaemonRestarted, now);
        }
        if !previous.is_empty() {
            tracing::info!(
                sessions = previous.len(),
                "sessions of the previous daemon recorded as ended (daemon_restarted)"
            );
        }
    }

    /// The error for a call of `caller` naming `id` that is no live session it may use:
    /// `SessionEnded` to the owner (and root) of a session that ended lately, else
    /// `NoSuchSession`.
    fn gone(&self, caller: &Caller, id: &str) -> KernelError {
        let local = self.resolve(id).unwrap_or(id);
        self.ended.error_for(local, caller.uid, echo_id(id))
    }

    /// The node identifier in session ids (empty: ids are not qualified).
    pub fn node_id(&self) -> &str {
        &self.node
    }

    /// The local session id `id` as clients see it: `<node>.<id>`, or `id` when the daemon
    /// has no node identifier.
    pub fn public_id(&self, id: &str) -> String {
        if self.node.is_empty() {
            id.to_owned()
        } else {
            format!("{}.{id}", self.node)
        }
    }

    /// The local id a client-given session id names: a node-qualified id of this node gives
    /// its local part; a bare id (or anything that is no qualified id) is looked up as given.
    ///
    /// Errors: `WrongNode` for a qualified id of another node (or any qualified id when the
    /// daemon has no node identifier).
    pub fn resolve<'a>(&self, id: &'a str) -> Result<&'a str, KernelError> {
        match sandcell_proto::kernel::SessionId::parse_qualified(id) {
            Ok((Some(node), _)) if node != self.node => Err(KernelError::WrongNode {
                session: echo_id(id),
                node: node.to_owned(),
                expected: self.node.clone(),
            }),
            Ok((Some(_), local)) => Ok(&id[id.len() - local.as_str().len()..]),
            _ => Ok(id),
        }
    }

    /// [`Core::gone`] for a session found while it was ending: waits (at most 10 s) until it
    /// has released everything and is recorded, so the answer is the same as a moment later.
    /// Like [`Self::gone_after`], but `None` when `s` is still live after a short wait: a
    /// failure seen meanwhile was not caused by the session ending.
    async fn ended_while(&self, caller: &Caller, s: &Session, id: &str) -> Option<KernelError> {
        tokio::time::timeout(Duration::from_secs(2), s.released())
            .await
            .ok()
            .map(|_| self.gone(caller, id))
    }

    /// The error for a cell of session `id` whose frames stopped before its result: the
    /// session's own end (`NoSuchSession` or `SessionEnded` with its reason) when it ended
    /// meanwhile (a cell queued just as its owner's connection closed is dropped with the
    /// session), else `WorkerFailed`.
    pub async fn cell_cut(&self, caller: &Caller, id: &str) -> KernelError {
        let cut = KernelError::WorkerFailed {
            reason: "the session ended without a result".into(),
        };
        match self.lookup(caller, id) {
            Err(gone) => gone,
            Ok(s) => self.ended_while(caller, &s, id).await.unwrap_or(cut),
        }
    }

    async fn gone_after(&self, caller: &Caller, s: &Session, id: &str) -> KernelError {
        let _ = tokio::time::timeout(Duration::from_secs(10), s.released()).await;
        self.gone(caller, id)
    }

    /// Live sessions.
    pub fn sessions(&self) -> Vec<Arc<Session>> {
        self.sessions.lock().unwrap().values().cloned().collect()
    }

    /// Whether `connection` owns a session that ends with it (not detached).
    pub fn connection_owns_sessions(&self, connection: u64) -> bool {
        self.sessions
            .lock()
            .unwrap()
            .values()
            .any(|s| s.owner.connection == connection && s.detached_idle.is_none())
    }

    /// Ends the sessions that end with `connection` (not detached): `Disconnected`.
    pub async fn close_owned_sessions(&self, connection: u64) {
        let owned: Vec<_> = self
            .sessions()
            .into_iter()
            .filter(|s| s.owner.connection == connection && s.detached_idle.is_none())
            .collect();
        for s in owned {
            s.close(EndReason::Disconnected, "client disconnected")
                .await;
        }
    }

    /// A connection ended: its sessions that are not detached end too (killed and reaped).
    pub async fn connection_closed(&self, guard: ConnectionGuard) {
        self.close_owned_sessions(guard.id).await;
        {
            let mut per_uid = self.connections_per_uid.lock().unwrap();
            if let Some(n) = per_uid.get_mut(&guard.uid) {
                *n -= 1;
                if *n == 0 {
                    per_uid.remove(&guard.uid);
                }
            }
        }
        self.connections.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sessions whose worker is still starting for a client (not yet in [`Core::sessions`]).
    pub fn starting_sessions(&self) -> Vec<StartingInfo> {
        self.starter.starting()
    }

    /// Per-uid budgets in force and the use of every uid holding sessions.
    pub fn uid_admission(&self) -> (UidBudgets, Vec<(u32, crate::admission::UidUse)>) {
        (self.admission.uid_budgets(), self.admission.uid_use())
    }

    /// Worker uids leased now and the size of their range (`worker_uid_count`).
    pub fn worker_uids(&self) -> (u64, u64) {
        self.starter.uids().usage()
    }

    /// Open connections.
    pub fn connection_count(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Whether the daemon is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    fn check_source(&self, code: &str) -> Result<(), KernelError> {
        let max = self.config().limits.max_source_bytes;
        if code.len() as u64 > max {
            return Err(KernelError::LimitExceeded {
                limit: "max_source_bytes".into(),
                value: code.len() as u64,
                max,
            });
        }
        Ok(())
    }

    fn session_limits(
        &self,
        language: Language,
        asked: Option<&Limits>,
    ) -> Result<SessionLimits, KernelError> {
        let cfg = self.config();
        let l = &cfg.limits;
        let a = asked.cloned().unwrap_or_default();
        let lower = |name: &str, asked: Option<u64>, max: u64| -> Result<u64, KernelError> {
            match asked {
                None => Ok(max),
                Some(0) => Err(KernelError::InvalidParameter {
                    parameter: format!("limits.{name}"),
                    reason: "must be positive".into(),
                }),
                Some(v) if v > max => Err(KernelError::LimitExceeded {
                    limit: name.into(),
                    value: v,
                    max,
                }),
                Some(v) => Ok(v),
            }
        };
        let wall = match a.wall_time_seconds {
            None => l.execution_wall_time_seconds,
            // Below 10 ms a limit cannot be kept (worker timers and the daemon's grace are
            // coarser), so it is refused rather than silently stretched.
            Some(w) if !(w.is_finite() && w >= 0.01) => {
                return Err(KernelError::InvalidParameter {
                    parameter: "limits.wall_time_seconds".into(),
                    reason: "must be a number of seconds, at least 0.01".into(),
                });
            }
            Some(w) if w > l.execution_wall_time_seconds => {
                return Err(KernelError::LimitExceeded {
                    limit: "wall_time_seconds".into(),
                    value: w.ceil() as u64,
                    max: l.execution_wall_time_seconds as u64,
                });
            }
            Some(w) => w,
        };
        let _ = language;
        let guest_memory = lower(
            "guest_memory_bytes",
            a.guest_memory_bytes,
            l.max_guest_memory_bytes,
        )?;
        // CPython in Eryx needs about 17 MiB of linear memory to start (259 WebAssembly pages
        // measured); refuse less up front instead of failing the worker's start.
        if a.guest_memory_bytes.is_some() && guest_memory < MIN_GUEST_MEMORY {
            return Err(KernelError::InvalidParameter {
                parameter: "limits.guest_memory_bytes".into(),
                reason: format!("must be at least {MIN_GUEST_MEMORY} bytes"),
            });
        }
        Ok(SessionLimits {
            wall: Duration::from_secs_f64(wall),
            fuel: lower("fuel", a.fuel, l.max_fuel)?,
            guest_memory,
            stdout: lower("stdout_bytes", a.stdout_bytes, l.max_stdout_bytes)?,
            stderr: lower("stderr_bytes", a.stderr_bytes, l.max_stderr_bytes)?,
            grace: Duration::from_secs_f64(cfg.daemon.kill_grace_seconds),
            files_bytes: cfg.limits.max_session_files_bytes,
            host_calls: None,
            display: true,
            rich: false,
        })
    }

    fn language(&self, name: &str) -> Result<Language, KernelError> {
        let cfg = self.config();
        let supported = cfg.daemon.languages.clone();
        match Language::parse(name) {
            Some(l) if supported.iter().any(|s| Language::parse(s) == Some(l)) => Ok(l),
            _ => Err(KernelError::UnsupportedLanguage {
                language: name.into(),
                supported,
            }),
        }
    }

    /// The environment a session of `language` runs in: `name`, or the language's default.
    ///
    /// Errors: `UnsupportedLanguage`; `NoSuchEnvironment` (listing the names served) for an
    /// unknown name; `EnvironmentMismatch` when the environment serves another language.
    pub fn resolve_environment(
        &self,
        language: &str,
        name: Option<&str>,
    ) -> Result<Environment, KernelError> {
        let language = self.language(language)?;
        let envs = self.config().environments();
        let found = match name {
            None => envs.iter().find(|e| e.language == language && e.default),
            Some(n) => envs.iter().find(|e| e.name == n),
        };
        match found {
            Some(e) if e.language == language => Ok(e.clone()),
            Some(e) => Err(KernelError::EnvironmentMismatch {
                environment: e.name.clone(),
                language: language.as_str().into(),
                environment_language: e.language.as_str().into(),
            }),
            None => Err(KernelError::NoSuchEnvironment {
                environment: name.unwrap_or(language.as_str()).into(),
                known: envs.iter().map(|e| e.name.clone()).collect(),
            }),
        }
    }

    /// Looks up a session the caller may use: its owner, or root. Others get `NoSuchSession`
    /// (the session's existence is not revealed).
    fn lookup(&self, caller: &Caller, id: &str) -> Result<Arc<Session>, KernelError> {
        let local = self.resolve(id)?;
        let s = self.sessions.lock().unwrap().get(local).cloned();
        match s {
            Some(s) if s.owner.uid == caller.uid || caller.uid == 0 => Ok(s),
            _ => Err(self.gone(caller, id)),
        }
    }

    /// The one authorization step: asks the authority in force whether `caller` may do
    /// `action`. Errors: `PermissionDenied` naming the polkit action.
    pub async fn authorize(&self, caller: &Caller, action: Action) -> Result<(), KernelError> {
        let authority = self.authority.read().unwrap().clone();
        let mut stages = crate::stages::Stages::new();
        let allowed = authority.check(caller, action).await;
        if crate::stages::Stages::enabled() {
            // Timed on its own too: after a restart, the first check waits for polkit.
            stages.mark("check");
            stages.log("authorize", action.id());
        }
        if allowed {
            Ok(())
        } else {
            Err(KernelError::PermissionDenied {
                action: action.id().into(),
            })
        }
    }

    /// Opens a session: admission, identity, cgroup, confined worker, `Ready`.
    ///
    /// Errors: `ShuttingDown`, `UnsupportedLanguage`, `LimitExceeded`, `InvalidParameter`,
    /// `PermissionDenied`, `CapacityExceeded` (at once, never queued), `WorkerFailed`,
    /// `EgressUnavailable` (an environment with egress the service's sandbox cannot give,
    /// [`crate::egress::availability`]).
    pub async fn open(
        &self,
        caller: &Caller,
        language: &str,
        environment: Option<&str>,
        limits: Option<&Limits>,
        detached_idle_seconds: Option<u64>,
    ) -> Result<Arc<Session>, KernelError> {
        self.open_with(
            caller,
            OpenRequest {
                language,
                environment,
                limits,
                detached_idle_seconds,
                host_calls: false,
                shown: true.into(),
                egress: None,
            },
        )
        .await
    }

    /// [`Core::open`] with every choice of `Open` ([`OpenRequest`]: also host calls and what
    /// the cells show).
    pub async fn open_with(
        &self,
        caller: &Caller,
        request: OpenRequest<'_>,
    ) -> Result<Arc<Session>, KernelError> {
        self.open_timed(caller, request, false, &mut crate::stages::Stages::new())
            .await
    }

    /// [`Core::open_with`], marking its stages (authorization, admission, the worker, the
    /// session's start) in `stages`. `one_shot`: the session of a `Run`, which ends after its
    /// one cell and is never kept for adoption (no keeper, no record: see
    /// [`Core::start_session`]).
    async fn open_timed(
        &self,
        caller: &Caller,
        request: OpenRequest<'_>,
        one_shot: bool,
        stages: &mut crate::stages::Stages,
    ) -> Result<Arc<Session>, KernelError> {
        let OpenRequest {
            language,
            environment,
            limits,
            detached_idle_seconds,
            host_calls,
            shown,
            egress,
        } = request;
        // validate
        if self.stopping() {
            return Err(KernelError::ShuttingDown {});
        }
        let env = self.resolve_environment(language, environment)?;
        // Egress the service's sandbox cannot give is refused here, not at the first cell
        // that fetches something. The daemon's own readiness probe runs no network cell.
        if env.egress.is_some()
            && !matches!(caller.subject, crate::identity::Subject::Daemon)
            && let Err(u) = crate::egress::availability()
        {
            return Err(KernelError::EgressUnavailable {
                environment: env.name.clone(),
                reason: u.reason.clone(),
            });
        }
        let egress = session_egress(&env, egress)?;
        let language = env.language;
        let mut limits = self.session_limits(language, limits)?;
        if host_calls {
            limits.host_calls = Some(Duration::from_secs_f64(
                self.config().daemon.host_call_timeout_seconds,
            ));
        }
        limits.display = shown.display;
        limits.rich = shown.rich;
        let max_idle = self.config().limits.max_detached_idle_seconds;
        let detached = match detached_idle_seconds {
            Some(0) => {
                return Err(KernelError::InvalidParameter {
                    parameter: "detached_idle_seconds".into(),
                    reason: "must be positive".into(),
                });
            }
            Some(s) if s > max_idle => {
                return Err(KernelError::LimitExceeded {
                    limit: "max_detached_idle_seconds".into(),
                    value: s,
                    max: max_idle,
                });
            }
            s => s.map(Duration::from_secs),
        };
        stages.mark("validate");
        // authorize
        self.authorize(caller, Action::Execute).await?;
        stages.mark("authorize");
        // per-uid rate and budgets, before any worker is touched
        let refused = |r: Refused| {
            if let Some(held_back) = self.refusal_log.admit(caller.uid) {
                tracing::warn!(
                    uid = caller.uid,
                    pid = caller.pid,
                    budget = r.budget,
                    in_use = r.in_use,
                    requested = r.requested,
                    max = r.max,
                    held_back,
                    "session refused: capacity exceeded"
                );
            }
            KernelError::from(r)
        };
        // The daemon's own readiness probe is not a client: it spends no client's tokens.
        if !matches!(caller.subject, crate::identity::Subject::Daemon) {
            self.admission.take_start(caller.uid).map_err(refused)?;
        }
        let charge = crate::worker::start::charge(&self.config(), env.engine, limits.guest_memory);
        let reserved = self
            .admission
            .reserve_uid(caller.uid, charge, detached.is_some())
            .map_err(refused)?;
        stages.mark("admission");
        // act
        self.spawn_session(
            caller, &env, limits, detached, reserved, one_shot, egress, stages,
        )
        .await
    }

    // The request's parts, each used once; bundling them would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn spawn_session(
        &self,
        caller: &Caller,
        env: &Environment,
        limits: SessionLimits,
        detached: Option<Duration>,
        reserved: UidCharge,
        one_shot: bool,
        egress: Option<Vec<String>>,
        stages: &mut crate::stages::Stages,
    ) -> Result<Arc<Session>, KernelError> {
        // A warm worker, when one fits: already confined and Ready, never used before.
        let warm = self.pool.take(&env.name, env.language, limits.guest_memory);
        let from_pool = warm.is_some();
        let mut prepared = match warm {
            Some(p) => {
                stages.mark("pool_take");
                p
            }
            None => {
                let p = self
                    .prepare_detached(caller, env, limits.guest_memory)
                    .await?;
                stages.mark("worker_start");
                p
            }
        };
        prepared.permit.attach(reserved);
        // The session's egress is granted when it starts, with its own list: a warm worker's
        // listener (bound in its namespace at spawn) waits unserved until then.
        if let (Some(policy), Some(hosts)) = (&env.egress, egress)
            && let Some(listener) = prepared.spawned.egress_listener.take()
        {
            // A duplicate stays with the session: its keeper holds it, and a successor daemon
            // grants it again after a restart (`session::keep`).
            prepared.spawned.egress_listener = listener.try_clone().ok();
            prepared.spawned.egress_hosts = Some(hosts.clone());
            let policy = crate::config::EgressConfig {
                hosts,
                ..policy.clone()
            };
            let none = crate::egress::Counts::default();
            let keep = self.keep.get().filter(|_| !one_shot).map(|k| k.dir.clone());
            crate::egress::open(
                &prepared.id,
                prepared.spawned.pid,
                listener,
                &policy,
                none,
                keep,
            )
            .await;
            stages.mark("egress_grant");
        }
        let s = self.start_session(prepared, caller, limits, detached, from_pool, one_shot);
        stages.mark("session_start");
        s.recorded().await;
        stages.mark("recorded");
        Ok(s)
    }

    /// A worker start ([`Starter::start`]) on a task of its own, so that a client that goes
    /// away while its worker starts cannot leave a cgroup or directory behind: the task always
    /// finishes. When nobody waits for the worker any more (the client went away), its start
    /// is cancelled at once (killed, reaped, released) rather than awaited until Ready or the
    /// start timeout. When admission refuses and idle pooled workers hold charges, one is
    /// evicted and the start tried once more.
    ///
    /// Errors: `ShuttingDown`, and the [`StartError`]s as clients see them
    /// (`CapacityExceeded`, `WorkerFailed`).
    async fn prepare_detached(
        &self,
        caller: &Caller,
        env: &Environment,
        guest_memory: u64,
    ) -> Result<Prepared, KernelError> {
        let me = self.me.upgrade().ok_or(KernelError::ShuttingDown {})?;
        let env = env.clone();
        let (mut tx, rx) = tokio::sync::oneshot::channel();
        let owner = caller.clone();
        tokio::spawn(async move {
            // A receiver kept for the whole task: a send to a channel without one is lost.
            let (cancel_tx, _open) = watch::channel(false);
            let cancel_tx = Arc::new(cancel_tx);
            let start = |owner: Caller| Some(StartFor::new(owner, cancel_tx.clone()));
            let cfg = me.config();
            let work = async {
                match me
                    .starter
                    .start(&cfg, &env, guest_memory, start(owner.clone()))
                    .await
                {
                    // Idle pooled workers hold admission charges: give one back rather than
                    // refuse.
                    Err(e) if e.budget().is_some() && me.pool.evict_one().await => {
                        me.starter
                            .start(&cfg, &env, guest_memory, start(owner))
                            .await
                    }
                    other => other,
                }
            };
            tokio::pin!(work);
            let r = tokio::select! {
                r = &mut work => r,
                _ = tx.closed() => {
                    let _ = cancel_tx.send(true);
                    work.await
                }
            };
            if let Err(Ok(p)) = tx.send(r.map_err(KernelError::from)) {
                tracing::info!(session = %p.id, "client left while its worker started; discarding it");
                p.discard().await;
            }
        });
        rx.await.unwrap_or(Err(KernelError::ShuttingDown {}))
    }

    /// Turns a Ready worker into a session owned by `caller`.
    ///
    /// A client's session is kept for adoption (a keeper process and a record, when the daemon
    /// keeps sessions), unless it is `one_shot`: a successor never adopts a `Run`'s session
    /// (once its cell is queued, its record names a one-shot cell and adoption ends it
    /// `daemon_restarted`; before that its id is known to nobody), so its keeper would be a
    /// process start (the daemon's executable, a handshake: milliseconds, on the `Run`'s
    /// path before its cell) and two record writes per cell for nothing. Without them a
    /// daemon that dies during the `Run` leaves the worker to the same ends as a pooled
    /// worker's: its own end at the cell's `timeout_ms` and the end of file on its request
    /// pipe, and the successor's start-up sweep of its cgroup; the owner marker still makes
    /// the successor report the session `daemon_restarted`.
    fn start_session(
        &self,
        p: Prepared,
        caller: &Caller,
        limits: SessionLimits,
        detached: Option<Duration>,
        warm: bool,
        one_shot: bool,
    ) -> Arc<Session> {
        let registry = self.sessions.clone();
        let ended = self.ended.clone();
        let id = p.id.clone();
        let language = p.language;
        // The owner marker lets a successor daemon tell the owner this session ended. The
        // daemon's own probe sessions are neither marked nor recorded: nobody asks for them.
        let state_dir = self.config().daemon.state_dir.clone();
        let owner = caller.uid;
        let client = !matches!(caller.subject, crate::identity::Subject::Daemon);
        if client {
            crate::ended::mark(&state_dir, &id, owner);
        }
        let keep = self.keep.get().filter(|_| client && !one_shot).cloned();
        let session = Session::start_kept(
            p,
            caller.clone(),
            detached,
            limits,
            Box::new(move |id, ending: &crate::session::Ending| {
                if client {
                    ended.record(id, owner, ending.reason, SystemTime::now());
                }
                registry.lock().unwrap().remove(id);
                // A stopping daemon keeps the marker: its successor reports daemon_restarted.
                if client && ending.reason != EndReason::DaemonStopping {
                    crate::ended::unmark(&state_dir, id, owner);
                }
            }),
            self.events.clone(),
            keep,
        );
        self.sessions
            .lock()
            .unwrap()
            .insert(id.clone(), session.clone());
        tracing::info!(session = %id, uid = caller.uid, pid = caller.pid, language = language.as_str(), warm, "session opened");
        crate::counters::counters().session_opened();
        let _ = self.events.send(Event::Opened {
            id,
            uid: caller.uid,
            language,
        });
        session
    }

    /// Runs `code` as a cell of `session`; frames go to `frames`. On a detached session the
    /// cell gets a record (`cells.rs`): its frames pass through a relay, so a client that
    /// hangs up leaves it running with its output retained (or interrupted, with the
    /// operator's `interrupt_on_hangup`), and `CellStatus`/`Attach` tell how it ended.
    ///
    /// With a `token` the session remembers ([`crate::session::Info::tokens`]), nothing runs:
    /// the call follows the cell that has it, as `Attach` does, and the answer is `Some` of
    /// the cell's number and the frames to replay (live frames then go to `to`). `None`: the
    /// cell started and its frames go to `to`.
    ///
    /// Errors: as `Submit` for a detached session; else `InvalidParameter` (`token`),
    /// `LimitExceeded`, `NoSuchSession`, `SessionEnded`, `PermissionDenied`, `SessionBusy`;
    /// for a repeat, `NoSuchCell` when nothing of the cell is retained (an `Execute` on a
    /// session that ends with its connection, or a record already dropped).
    pub async fn execute(
        &self,
        caller: &Caller,
        session: &str,
        code: String,
        token: Option<String>,
        to: crate::cells::Attachment,
    ) -> Result<Option<(u64, Vec<Frame>)>, KernelError> {
        check_token(token.as_deref())?;
        self.check_source(&code)?;
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        // A repeat needs no retention of its own (checked again as the cell is queued).
        if let Some(cell) = token.as_deref().and_then(|t| s.cell_with_token(t)) {
            return follow_repeat(&s, session, cell, to).await;
        }
        if s.detached_idle.is_none() {
            // Not retained: nobody can attach to it, so nobody replaces `to`. A repeat that
            // raced the check above names a cell whose output nobody kept: NoSuchCell, and
            // nothing runs twice.
            return match self
                .start_cell(caller, &s, session, code, to.frames, false, token)
                .await
            {
                Ok(()) => Ok(None),
                Err(Started::Repeated(cell)) => Err(KernelError::NoSuchCell {
                    session: echo_id(session),
                    cell,
                }),
                Err(Started::Refused(e)) => Err(e),
            };
        }
        let charge = retention_charge(&s)?;
        let (tx, rx) = mpsc::channel(FRAME_QUEUE);
        match self
            .start_cell(caller, &s, session, code, tx, true, token)
            .await
        {
            Ok(()) => {}
            Err(Started::Repeated(cell)) => return follow_repeat(&s, session, cell, to).await,
            Err(Started::Refused(e)) => return Err(e),
        }
        let hangup = self.config().daemon.interrupt_on_hangup;
        drop(crate::cells::relay(s, rx, Some(to), hangup, charge));
        Ok(None)
    }

    /// Hands `code` to the session's actor; frames go to `frames`, a relay that retains
    /// them when `retained` (a successor daemon then continues the cell). `token`: the
    /// caller's name for the cell, which the session remembers.
    #[allow(clippy::too_many_arguments)]
    async fn start_cell(
        &self,
        caller: &Caller,
        s: &Arc<Session>,
        session: &str,
        code: String,
        frames: mpsc::Sender<Frame>,
        retained: bool,
        token: Option<String>,
    ) -> Result<(), Started> {
        let queued = if retained {
            s.execute_retained(code, frames, token).await
        } else {
            s.execute(code, frames, false, token).await
        };
        match queued {
            Ok(()) => Ok(()),
            Err(ExecuteRefused::Busy(cell)) => Err(Started::Refused(KernelError::SessionBusy {
                session: session.into(),
                cell,
            })),
            Err(ExecuteRefused::Repeated(cell)) => Err(Started::Repeated(cell)),
            Err(ExecuteRefused::Ended) => {
                Err(Started::Refused(self.gone_after(caller, s, session).await))
            }
        }
    }

    /// Starts `code` as a cell of `session` that nobody needs to follow (`Submit`) and
    /// returns its number once it started: its output is retained for `Attach`, its result
    /// for `CellStatus` (`cells.rs`).
    ///
    /// Errors: `LimitExceeded` (source), `NoSuchSession`/`SessionEnded` (also when the
    /// session ends before the cell starts), `PermissionDenied` (`org.sandcell.execute`),
    /// `SessionBusy`, `CapacityExceeded` (`retained_output_bytes`: the daemon-wide retention
    /// budget has no room for the cell's reservation).
    pub async fn submit(
        &self,
        caller: &Caller,
        session: &str,
        code: String,
        token: Option<String>,
    ) -> Result<u64, KernelError> {
        check_token(token.as_deref())?;
        self.check_source(&code)?;
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        if let Some(cell) = token.as_deref().and_then(|t| s.cell_with_token(t)) {
            tracing::info!(session = %s.id, cell, "a repeated Submit answers the cell that has its token");
            return Ok(cell);
        }
        let charge = retention_charge(&s)?;
        let (tx, rx) = mpsc::channel(FRAME_QUEUE);
        match self
            .start_cell(caller, &s, session, code, tx, true, token)
            .await
        {
            Ok(()) => {}
            Err(Started::Repeated(cell)) => {
                tracing::info!(session = %s.id, cell, "a repeated Submit answers the cell that has its token");
                return Ok(cell);
            }
            Err(Started::Refused(e)) => return Err(e),
        }
        match crate::cells::relay(s.clone(), rx, None, false, charge).await {
            Ok(cell) => Ok(cell),
            // The actor dropped the cell: the session ended before it started.
            Err(_) => Err(self.gone_after(caller, &s, session).await),
        }
    }

    /// `Attach`: the frames to replay; live frames go to `to` while the cell runs, until a
    /// newer `Attach` replaces it.
    ///
    /// Errors: `NoSuchSession`/`SessionEnded`, `PermissionDenied` (`org.sandcell.execute`),
    /// `NoSuchCell`.
    pub async fn attach(
        &self,
        caller: &Caller,
        session: &str,
        cell: u64,
        to: crate::cells::Attachment,
    ) -> Result<Vec<Frame>, KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        s.cells
            .attach(&s.id, cell, to)
            .ok_or_else(|| KernelError::NoSuchCell {
                session: echo_id(session),
                cell,
            })
    }

    /// `CellStatus`: the cell's state and, once it ended, its retained result.
    ///
    /// Errors: as [`Core::attach`].
    pub async fn cell_status(
        &self,
        caller: &Caller,
        session: &str,
        cell: u64,
    ) -> Result<sandcell_proto::kernel::CellStatusReply, KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        let (state, result) = s
            .cells
            .status(cell)
            .ok_or_else(|| KernelError::NoSuchCell {
                session: echo_id(session),
                cell,
            })?;
        Ok(sandcell_proto::kernel::CellStatusReply { state, result })
    }

    /// After an attachment's frames stopped without a result: the session ended
    /// (`NoSuchSession`/`SessionEnded`), or else `WorkerFailed`.
    pub async fn stream_lost(&self, caller: &Caller, session: &str) -> KernelError {
        match self.lookup(caller, session) {
            Ok(s) => match tokio::time::timeout(Duration::from_secs(10), s.released()).await {
                Ok(()) => self.gone(caller, session),
                Err(_) => KernelError::WorkerFailed {
                    reason: "the cell's frames stopped without a result".into(),
                },
            },
            Err(e) => e,
        }
    }

    /// One-shot run: a fresh session (`session`, never detached) for one cell, `code`, whose
    /// frames go to `frames`; the session ends after it.
    pub async fn run(
        &self,
        caller: &Caller,
        session: RunRequest<'_>,
        code: String,
        frames: mpsc::Sender<Frame>,
    ) -> Result<(), KernelError> {
        let mut stages = crate::stages::Stages::new();
        // The source is checked before any worker starts.
        self.check_source(&code)?;
        let RunRequest {
            language,
            environment,
            limits,
            host_calls,
            shown,
            egress,
        } = session;
        let request = OpenRequest {
            language,
            environment,
            limits,
            detached_idle_seconds: None,
            host_calls,
            shown,
            egress,
        };
        // No warm worker starts beside this Run's cell (it would compete for the CPUs); the
        // refill resumes when the session ends, or after `pool::MAX_HOLD`.
        let hold = self.pool.hold();
        let s = self.open_timed(caller, request, true, &mut stages).await?;
        let queued = s.execute(code, frames, true, None).await;
        stages.mark("queued");
        stages.log("run", &s.id);
        if queued.is_ok() {
            let session = s.clone();
            tokio::spawn(async move {
                let _hold = hold;
                let _ = tokio::time::timeout(crate::pool::MAX_HOLD, session.released()).await;
            });
        }
        if let Err(e) = queued {
            s.close(EndReason::WorkerCrashed, "one-shot run could not start")
                .await;
            return Err(match e {
                ExecuteRefused::Busy(cell) | ExecuteRefused::Repeated(cell) => {
                    KernelError::SessionBusy {
                        session: s.id.clone(),
                        cell,
                    }
                }
                ExecuteRefused::Ended => KernelError::WorkerFailed {
                    reason: "worker ended before the cell".into(),
                },
            });
        }
        Ok(())
    }

    /// Lists the user's variables of `session` (`Inspect`): at most `max_items` (default
    /// [`sandcell_proto::kernel::INSPECT_DEFAULT_ITEMS`]).
    ///
    /// Errors: `InvalidParameter` (`max_items` 0), `LimitExceeded` (`max_items` above
    /// [`sandcell_proto::kernel::INSPECT_MAX_ITEMS`]), `NoSuchSession`, `PermissionDenied` (`org.sandcell.execute`:
    /// the listing runs the session's code, its reprs), `SessionBusy` (a cell runs),
    /// `WorkerFailed` (the worker broke the protocol or did not answer; the session ended).
    pub async fn inspect(
        &self,
        caller: &Caller,
        session: &str,
        max_items: Option<u64>,
    ) -> Result<sandcell_proto::kernel::InspectReply, KernelError> {
        let max_items = match max_items {
            None => sandcell_proto::kernel::INSPECT_DEFAULT_ITEMS,
            Some(0) => {
                return Err(KernelError::InvalidParameter {
                    parameter: "max_items".into(),
                    reason: "must be positive".into(),
                });
            }
            Some(n) if n > sandcell_proto::kernel::INSPECT_MAX_ITEMS => {
                return Err(KernelError::LimitExceeded {
                    limit: "max_items".into(),
                    value: n,
                    max: sandcell_proto::kernel::INSPECT_MAX_ITEMS,
                });
            }
            Some(n) => n,
        };
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        s.inspect(max_items)
            .await
            .map_err(|e| query::refused("Inspect", session, e))
    }

    /// Interrupts `cell` of `session`. Errors: `NoSuchSession`, `PermissionDenied`,
    /// `NoSuchCell` (a number the session never reached).
    pub async fn interrupt(
        &self,
        caller: &Caller,
        session: &str,
        cell: u64,
    ) -> Result<InterruptReply, KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::ManageOwn).await?;
        own::check_cell_reached(&s, session, cell)?;
        Ok(s.interrupt(cell).await)
    }

    /// Answers host call `call` of `session` (`HostReply`): `Ok` carries the tool's result
    /// object, `Err` its error message. Authorized as [`Core::interrupt`] (any connection of
    /// the owner).
    ///
    /// Errors: `InvalidParameter` (both or neither of result and error, a result that is not
    /// an object), `LimitExceeded` (`host_call_result_bytes`, `host_call_error_bytes`),
    /// `NoSuchSession`, `PermissionDenied`, `NoSuchHostCall` (no such call waits in that
    /// session).
    pub async fn host_reply(
        &self,
        caller: &Caller,
        session: &str,
        call: u64,
        result: Option<serde_json::Value>,
        error: Option<String>,
    ) -> Result<(), KernelError> {
        use sandcell_proto::kernel::{MAX_HOST_CALL_ERROR, MAX_HOST_CALL_RESULT};
        let payload = match (result, error) {
            (Some(r), None) => {
                if !r.is_object() {
                    return Err(KernelError::InvalidParameter {
                        parameter: "result".into(),
                        reason: "must be a JSON object".into(),
                    });
                }
                let payload =
                    serde_json::to_vec(&serde_json::json!({ "result": r })).unwrap_or_default();
                // The object's own bytes: the payload minus `{"result":` and `}`.
                let size = payload.len().saturating_sub(11) as u64;
                if size > MAX_HOST_CALL_RESULT as u64 {
                    return Err(KernelError::LimitExceeded {
                        limit: "host_call_result_bytes".into(),
                        value: size,
                        max: MAX_HOST_CALL_RESULT as u64,
                    });
                }
                payload
            }
            (None, Some(e)) => {
                if e.len() > MAX_HOST_CALL_ERROR {
                    return Err(KernelError::LimitExceeded {
                        limit: "host_call_error_bytes".into(),
                        value: e.len() as u64,
                        max: MAX_HOST_CALL_ERROR as u64,
                    });
                }
                serde_json::to_vec(&serde_json::json!({ "error": e })).unwrap_or_default()
            }
            _ => {
                return Err(KernelError::InvalidParameter {
                    parameter: "result".into(),
                    reason: "exactly one of result and error must be given".into(),
                });
            }
        };
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::ManageOwn).await?;
        if s.host_reply(call, payload).await {
            s.cells.host_answered(call);
            Ok(())
        } else {
            Err(KernelError::NoSuchHostCall {
                session: session.into(),
                call,
            })
        }
    }

    /// Ends `session`; returns after its worker is reaped and everything released.
    pub async fn close(&self, caller: &Caller, session: &str) -> Result<(), KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::ManageOwn).await?;
        s.close(EndReason::Closed, "closed by client").await;
        Ok(())
    }

    /// Looks up a session for administration (the D-Bus control plane): any caller learns
    /// whether it exists (listing is public), and acting on it needs `manage-own-sessions`
    /// for the owner's uid and `manage-sessions` for anyone else.
    ///
    /// Errors: `NoSuchSession`, `PermissionDenied`.
    async fn lookup_managed(&self, caller: &Caller, id: &str) -> Result<Arc<Session>, KernelError> {
        let id = self.resolve(id)?;
        let s = self.sessions.lock().unwrap().get(id).cloned();
        let Some(s) = s else {
            return Err(KernelError::NoSuchSession {
                session: echo_id(id),
            });
        };
        let action = if s.owner.uid == caller.uid {
            Action::ManageOwn
        } else {
            Action::ManageAll
        };
        self.authorize(caller, action).await?;
        Ok(s)
    }

    /// The cancel switch of a starting session `id` that `caller` may terminate (as
    /// [`Core::lookup_managed`] authorizes); `None` when no such start is under way.
    async fn starting_cancel(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Option<Arc<watch::Sender<bool>>>, KernelError> {
        let Some((owner, cancel)) = self.starter.find_starting(id) else {
            return Ok(None);
        };
        let action = if owner == caller.uid {
            Action::ManageOwn
        } else {
            Action::ManageAll
        };
        self.authorize(caller, action).await?;
        Ok(Some(cancel))
    }

    /// Ends `session` for an administrator (D-Bus `TerminateSession`); returns after its
    /// worker is reaped and everything released. Errors: `NoSuchSession`, `PermissionDenied`.
    pub async fn terminate(&self, caller: &Caller, session: &str) -> Result<(), KernelError> {
        let session = self.resolve(session)?;
        if let Some(cancel) = self.starting_cancel(caller, session).await? {
            tracing::info!(
                session,
                by_uid = caller.uid,
                "starting session terminated by request"
            );
            let _ = cancel.send(true);
            // The start ends (kill, reap, release) on its own task; wait until it is unlisted.
            let t0 = std::time::Instant::now();
            while self.starter.is_starting(session) && t0.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            return Ok(());
        }
        let s = self.lookup_managed(caller, session).await?;
        tracing::info!(
            session,
            by_uid = caller.uid,
            "session terminated by request"
        );
        s.close(
            EndReason::Terminated,
            &format!("terminated by uid {}", caller.uid),
        )
        .await;
        Ok(())
    }

    /// Interrupts whatever cell `session` is running (D-Bus `InterruptSession`); the reply
    /// says whether SIGINT was delivered and why not (`not_running`, `session_ending`).
    /// Errors: `NoSuchSession`, `PermissionDenied`.
    pub async fn interrupt_running(
        &self,
        caller: &Caller,
        session: &str,
    ) -> Result<InterruptReply, KernelError> {
        let s = self.lookup_managed(caller, session).await?;
        let running = s.info.lock().unwrap().running_cell;
        match running {
            Some(cell) => Ok(s.interrupt(cell).await),
            None => Ok(InterruptReply {
                delivered: false,
                reason: InterruptReason::NotRunning.into(),
            }),
        }
    }

    /// Whether sessions are kept for adoption ([`Core::enable_adoption`]).
    pub fn adoption_enabled(&self) -> bool {
        self.keep.get().is_some()
    }

    /// Kills the warm pools' idle workers (SIGKILL, not waited for) and stops refilling them:
    /// before [`Core::exit_keeping_sessions`]. A pooled worker belongs to no session, so no
    /// successor adopts it (its warm keeper is told to end). Its reap, cgroup and directory
    /// are left to the successor (its start sweeps every session group it does not adopt, and
    /// the directories with them): waiting for them here would hold this process's exit, and
    /// with it every client waiting on the socket, for as long as the kernel takes to tear the
    /// workers down.
    /// A worker still starting for a pool is not waited for either: the same sweep ends it.
    /// Returns their session ids (the names of their groups).
    pub fn kill_pool(&self) -> Vec<String> {
        self.stopping.store(true, Ordering::SeqCst);
        let idle = self.pool.take_idle();
        for p in &idle {
            p.kill_now();
        }
        idle.iter().map(|p| p.id.clone()).collect()
    }

    /// Exits the process keeping every session for the next daemon: each session's record
    /// is current (written on every change), so the process exits at once; the lifelines
    /// close with it and every keeper waits for an adopter (`adopt_timeout_seconds`). Workers
    /// are not signalled; warm pooled workers are not kept ([`Core::kill_pool`] first). A
    /// cell running now goes on in its worker: the next daemon continues it (a retained
    /// cell's output so far is in its journal; an `Execute` whose connection this exit cuts
    /// is interrupted there, its session kept). The call a restart that keeps sessions makes
    /// (sandcelld(8), ADOPTION).
    pub fn exit_keeping_sessions(&self) -> ! {
        self.exit_keeping_sessions_with(0)
    }

    /// [`Core::exit_keeping_sessions`] with exit status `status` (1 after a failed re-exec in
    /// place, so that `Restart=on-failure` starts the next daemon).
    pub fn exit_keeping_sessions_with(&self, status: i32) -> ! {
        self.stopping.store(true, Ordering::SeqCst);
        tracing::info!(
            sessions = self.sessions().len(),
            status,
            "exiting; sessions kept for the next daemon"
        );
        std::process::exit(status)
    }

    /// Before [`Core::exit_keeping_sessions`]: stops taking work and hands every running cell
    /// over to the successor exactly (`Session::hand_over`: unsent output journaled, reply
    /// bytes read and not handled written beside the record), at most 2 s in all; a cell not
    /// handed over by then is continued as after a crash.
    pub async fn hand_over_sessions(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut set = tokio::task::JoinSet::new();
        for s in self.sessions() {
            set.spawn(async move { s.hand_over().await });
        }
        let all = async { while set.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(2), all)
            .await
            .is_err()
        {
            tracing::warn!("not every running cell was handed over within 2 s");
        }
    }

    /// Stops taking work and ends every session (killed and reaped).
    pub async fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut set = tokio::task::JoinSet::new();
        for s in self.sessions() {
            set.spawn(async move { s.close(EndReason::DaemonStopping, "daemon stopping").await });
        }
        while set.join_next().await.is_some() {}
        self.pool.drain().await;
        // Every session has ended: a group still here is one a worker start cut short by the
        // exit left (a client's Open, a probe or a warm start under way). Killed and removed
        // now, so that a clean stop leaves no group for a successor's sweep.
        let cgroups = self.cgroups.clone();
        match tokio::task::spawn_blocking(move || cgroups.sweep_stale()).await {
            Ok(Ok(swept)) if swept.groups > 0 => tracing::info!(
                removed = swept.groups,
                killed = swept.populated.len(),
                "removed session groups of worker starts the stop cut short"
            ),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "sweeping session groups at stop"),
            Err(e) => tracing::warn!(error = %e, "sweeping session groups at stop"),
        }
        // Every session group is gone; remove the daemon's own parents (v1) too.
        if let Err(e) = self.cgroups.release() {
            tracing::warn!(error = %e, "releasing the cgroup subtree");
        }
    }
}

/// Smallest guest memory a client may ask for, bytes (32 MiB).
pub const MIN_GUEST_MEMORY: u64 = 32 * 1024 * 1024;

/// The warm pools are filled through the core: its configuration, its stop, its starter.
impl crate::pool::Source for Core {
    type Worker = Prepared;

    fn config(&self) -> Option<Arc<Config>> {
        (!self.stopping()).then(|| Core::config(self))
    }

    async fn start(&self, env: &Environment, guest_memory: u64) -> Result<Prepared, StartError> {
        let mut p = self
            .starter
            .start(&Core::config(self), env, guest_memory, None)
            .await?;
        if let Some(keep) = self.keep.get() {
            p.start_warm_keeper(keep).await;
        }
        Ok(p)
    }

    fn pool(&self) -> &crate::pool::Pool<Prepared> {
        &self.pool
    }
}

#[cfg(test)]
mod tests {
    /// A narrowed environment list keeps each of an adopted session's hosts it still allows.
    #[test]
    fn still_allowed_keeps_each_host_on_its_own() {
        let allowed = ["data.test".to_string(), "*.sub.test".to_string()];
        let had: Vec<String> = [
            "www.sub.test",
            "other.test",
            "data.test",
            "*.sub.test",
            "not a name",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            super::still_allowed(&allowed, &had),
            ["www.sub.test", "data.test", "*.sub.test"]
        );
        assert!(super::still_allowed(&["data.test".into()], &["www.sub.test".into()]).is_empty());
    }
}
