//! Warm worker pools: a bounded number of pre-started, already confined, Ready workers per
//! environment (`python`, `pydata`, `r`, and any the operator declares), so that `Open` and
//! `Run` skip the worker's start-up. Each environment's pool is sized by its `pool_min` and
//! `pool_max` (the language's default environment falls back to `pool_<language>_min/max`).
//!
//! Rules (the shape follows systemd-nsresourced's bounded pool of pre-forked workers):
//! - a pooled worker is a complete, unused session-to-be: its own cgroup, uid, directory and
//!   admission charge, taken from the same budgets as any session;
//! - a worker leaves the pool at most once and is never returned: one-shot `Run` keeps its
//!   fresh-sandbox-per-call semantics;
//! - the pool keeps `min` idle workers, grows to `max` while workers are being taken (a take in
//!   the last `pool_idle_seconds`), shrinks back to `min` when idle, and empties entirely
//!   after `pool_empty_seconds` without a take (so an idle machine keeps no warm worker);
//! - refills are rate-limited (`pool_refill_per_second`) and run on one background task, never
//!   on a client's path;
//! - when admission refuses a client and idle pooled workers hold charges, one is evicted and
//!   the client admitted: the pool never causes a refusal.
//!
//! The pool knows no core: the refill task ([`run`]) fills it from a [`Source`] (the core,
//! which starts workers with `worker::start`), and what it plans per round (targets, starts,
//! retirements) is tested with a fake source.

use crate::config::{Config, Environment};
use crate::worker::start::{Prepared, StartError};
use sandcell_proto::dbus::PoolRow;
use sandcell_proto::kernel::Language;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// A worker a pool can keep idle: a [`Prepared`] worker in the daemon, a fake in tests.
pub trait Warm: std::fmt::Debug + Send + 'static {
    /// Its session id (for the log).
    fn id(&self) -> &str;
    /// Guest memory it was started with, bytes (a take must ask for exactly this).
    fn guest_memory(&self) -> u64;
    /// Whether it still runs (checked before it is handed out).
    fn alive(&mut self) -> bool;
    /// Kills and releases it (it never served a session).
    fn discard(self) -> impl Future<Output = ()> + Send;
}

impl Warm for Prepared {
    fn id(&self) -> &str {
        &self.id
    }
    fn guest_memory(&self) -> u64 {
        self.guest_memory
    }
    fn alive(&mut self) -> bool {
        Prepared::alive(self)
    }
    fn discard(self) -> impl Future<Output = ()> + Send {
        Prepared::discard(self)
    }
}

/// What the refill task fills the pools from: the daemon's core (through its worker
/// starter), or a fake in tests. The task holds it weakly between rounds.
pub trait Source: Send + Sync + 'static {
    /// The workers it starts.
    type Worker: Warm;
    /// The configuration in force (environments and their pool sizes, refill rate, idle
    /// time, guest memory); `None` once the daemon stops, which ends the refill task.
    fn config(&self) -> Option<Arc<Config>>;
    /// Starts a worker of `env` with `guest_memory` bytes for a pool (no client: it is not
    /// listed as starting and cannot be cancelled).
    ///
    /// Errors: as [`crate::worker::start::Starter::start`]; a refusal with a
    /// [`StartError::budget`] makes the task retry after 1 s, any other failure after 5 s.
    fn start(
        &self,
        env: &Environment,
        guest_memory: u64,
    ) -> impl Future<Output = Result<Self::Worker, StartError>> + Send;
    /// The pools it fills.
    fn pool(&self) -> &Pool<Self::Worker>;
}

/// Pool figures for one environment (shown on D-Bus as `org.sandcell.Manager1.Pools`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Environment name.
    pub environment: String,
    /// Its language.
    pub language: Language,
    /// Idle warm workers now.
    pub idle: usize,
    /// How many the pool aims to keep now: `min`, or `max` while workers are being taken.
    pub target: usize,
    /// Configured minimum as the refill task last applied it: 0 for an environment no longer
    /// served (its idle workers are ended) and before the task's first pass.
    pub min: usize,
    /// Configured maximum, applied likewise.
    pub max: usize,
    /// Workers taken from the pool since start.
    pub taken: u64,
    /// Opens that found no idle worker (of their guest memory) since start, while the
    /// environment had a pool (`max` > 0).
    pub missed: u64,
}

#[derive(Debug)]
struct Lane<W> {
    language: Language,
    idle: VecDeque<W>,
    last_take: Option<Instant>,
    /// When the lane was made (the pool's first round for the environment).
    since: Instant,
    target: usize,
    min: usize,
    max: usize,
    taken: u64,
    missed: u64,
}

impl<W> Lane<W> {
    fn new(language: Language) -> Lane<W> {
        Lane {
            language,
            idle: VecDeque::new(),
            last_take: None,
            since: Instant::now(),
            target: 0,
            min: 0,
            max: 0,
            taken: 0,
            missed: 0,
        }
    }
}

/// The pools of all environments, by environment name, of workers `W` ([`Prepared`] in the
/// daemon).
#[derive(Debug)]
pub struct Pool<W> {
    lanes: Mutex<BTreeMap<String, Lane<W>>>,
    wake: tokio::sync::Notify,
    /// Warm workers being started now (their admission charges are held already).
    filling: tokio::sync::watch::Sender<usize>,
    /// One-shot `Run`s whose cell has not ended yet ([`Pool::hold`]).
    holds: Arc<tokio::sync::watch::Sender<usize>>,
}

/// Holds the refill back while it lives: one count of a counter the refill waits to see at
/// zero ([`Pool::hold`]; the adopting daemon's connections, `Core::early_caller`).
#[derive(Debug)]
pub struct RefillHold(Arc<tokio::sync::watch::Sender<usize>>);

impl RefillHold {
    /// Counts one more on `counter` until the returned hold is dropped.
    pub fn on(counter: &Arc<tokio::sync::watch::Sender<usize>>) -> RefillHold {
        counter.send_modify(|n| *n += 1);
        RefillHold(counter.clone())
    }
}

impl Drop for RefillHold {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl<W> Default for Pool<W> {
    fn default() -> Self {
        Pool {
            lanes: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            filling: tokio::sync::watch::Sender::new(0),
            holds: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }
}

impl<W> Pool<W> {
    /// Holds the refill back: no warm worker starts while a hold lives, for at most
    /// [`MAX_HOLD`] per start. A one-shot `Run` holds it until its session ends, so that the
    /// worker it took runs its cell without a replacement's start (the interpreter loading,
    /// R's or pandas' imports: hundreds of milliseconds of CPU) beside it on the same CPUs.
    pub fn hold(&self) -> RefillHold {
        RefillHold::on(&self.holds)
    }

    /// Waits until no [`RefillHold`] lives, at most [`MAX_HOLD`].
    async fn held_back(&self) {
        let mut rx = self.holds.subscribe();
        let _ = tokio::time::timeout(MAX_HOLD, rx.wait_for(|n| *n == 0)).await;
    }
}

impl<W: Warm> Pool<W> {
    /// Takes a warm worker of `environment` (of `language`) started with `guest_memory`
    /// bytes, if one is idle. Dead idle workers met on the way are discarded on a task of
    /// their own; the refill task is woken.
    pub fn take(&self, environment: &str, language: Language, guest_memory: u64) -> Option<W> {
        let mut lanes = self.lanes.lock().unwrap();
        let l = lanes
            .entry(environment.to_owned())
            .or_insert_with(|| Lane::new(language));
        // Only an environment that has a pool can be busy or miss it: not the readiness
        // probe, which runs before the refill task's first pass, nor one with 0 and 0.
        let pooled = l.max > 0;
        if pooled {
            l.last_take = Some(Instant::now());
        }
        let mut found = None;
        let mut dead = Vec::new();
        while let Some(mut p) = l.idle.pop_front() {
            if !p.alive() {
                dead.push(p);
                continue;
            }
            if p.guest_memory() == guest_memory {
                found = Some(p);
                break;
            }
            l.idle.push_back(p);
            break;
        }
        match found {
            Some(_) => l.taken += 1,
            None if pooled => l.missed += 1,
            None => {}
        }
        drop(lanes);
        for p in dead {
            tokio::spawn(p.discard());
        }
        self.wake.notify_one();
        found
    }

    /// Evicts the idle worker that waited longest, of any language, and waits until its
    /// charge is released. When none is idle but warm workers are being started (holding
    /// admission charges a client may need), waits until those starts end (Ready or failed,
    /// within the worker start timeout) and evicts one of them. Returns false when the pool
    /// has nothing to give back.
    pub async fn evict_one(&self) -> bool {
        let take = || {
            let mut lanes = self.lanes.lock().unwrap();
            lanes.values_mut().find_map(|l| l.idle.pop_front())
        };
        let mut victim = take();
        if victim.is_none() && *self.filling.borrow() > 0 {
            let mut rx = self.filling.subscribe();
            let _ = rx.wait_for(|n| *n == 0).await;
            victim = take();
        }
        match victim {
            Some(p) => {
                p.discard().await;
                true
            }
            None => false,
        }
    }

    /// Discards every idle worker (daemon stop); returns how many. A start under way when
    /// the daemon stops ends in a discard, not in the pool (`run`'s round sees the stop):
    /// this waits for it, at most [`DRAIN_START_WAIT`], so that nothing it started outlives
    /// the stop (its group and session directory were left behind otherwise). The idle
    /// workers are discarded all at once (their kills and teardowns overlap) and before that
    /// wait, not after it.
    pub async fn drain(&self) -> usize {
        // Pairs with the fence in `Refill::round` (the stop flag is set before this runs).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut set = tokio::task::JoinSet::new();
        let mut n = 0;
        for p in self.take_idle() {
            set.spawn(p.discard());
            n += 1;
        }
        if *self.filling.borrow() > 0 {
            let mut rx = self.filling.subscribe();
            let _ = tokio::time::timeout(DRAIN_START_WAIT, rx.wait_for(|n| *n == 0)).await;
            for p in self.take_idle() {
                set.spawn(p.discard());
                n += 1;
            }
        }
        while set.join_next().await.is_some() {}
        n
    }

    /// Takes every idle worker out of the pools at once, without waiting for a start under
    /// way (a daemon about to exit kills them and leaves their remains to its successor's
    /// sweep).
    pub fn take_idle(&self) -> Vec<W> {
        let mut lanes = self.lanes.lock().unwrap();
        lanes.values_mut().flat_map(|l| l.idle.drain(..)).collect()
    }

    fn push(&self, environment: &str, language: Language, p: W) {
        self.lanes
            .lock()
            .unwrap()
            .entry(environment.to_owned())
            .or_insert_with(|| Lane::new(language))
            .idle
            .push_back(p);
    }

    fn pop_surplus(&self, environment: &str) -> Option<W> {
        self.lanes
            .lock()
            .unwrap()
            .get_mut(environment)
            .and_then(|l| l.idle.pop_back())
    }
}

impl<W> Pool<W> {
    /// Figures for each environment that has or had a pool, in name order.
    pub fn status(&self) -> Vec<Status> {
        let lanes = self.lanes.lock().unwrap();
        lanes
            .iter()
            .map(|(name, l)| Status {
                environment: name.clone(),
                language: l.language,
                idle: l.idle.len(),
                target: l.target,
                min: l.min,
                max: l.max,
                taken: l.taken,
                missed: l.missed,
            })
            .collect()
    }

    /// The rows of the D-Bus `Pools` property (and the metrics file's pool figures), one per
    /// environment (shipped, configured in `config`, or still holding a pool), in name order;
    /// an environment whose pool never ran has a row of zeros.
    pub fn rows(&self, config: &Config) -> Vec<PoolRow> {
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let mut rows: BTreeMap<String, PoolRow> = crate::config::shipped_environments()
            .into_iter()
            .map(|(name, _)| name)
            .chain(config.environments.keys().cloned())
            .map(|name| (name.clone(), (name, 0, 0, 0, 0, 0, 0)))
            .collect();
        let live = self.status().into_iter().map(|s| {
            (
                s.environment.clone(),
                n(s.idle),
                n(s.target),
                n(s.min),
                n(s.max),
                s.taken,
                s.missed,
            )
        });
        for row in live {
            rows.insert(row.0.clone(), row);
        }
        rows.into_values().collect()
    }

    /// Wakes the refill task (after a take).
    pub fn notifier(&self) -> &tokio::sync::Notify {
        &self.wake
    }

    /// Decides the target of `environment`: `max` while it was taken from in the last
    /// `idle_after`, 0 when nothing was taken for `empty_after` (counted from the lane's
    /// first plan when nothing was ever taken; zero = never), else `min`; returns (idle,
    /// target).
    fn plan(
        &self,
        environment: &str,
        language: Language,
        min: usize,
        max: usize,
        idle_after: Duration,
        empty_after: Duration,
    ) -> (usize, usize) {
        let mut lanes = self.lanes.lock().unwrap();
        let l = lanes
            .entry(environment.to_owned())
            .or_insert_with(|| Lane::new(language));
        let busy = l.last_take.is_some_and(|t| t.elapsed() < idle_after);
        let active = l.last_take.unwrap_or(l.since).elapsed();
        let empty = !empty_after.is_zero() && active >= empty_after;
        (l.min, l.max) = (min, max);
        l.target = if busy {
            max
        } else if empty {
            0
        } else {
            min
        };
        (l.idle.len(), l.target)
    }

    /// Names of the environments with a lane (that have or had a pool).
    fn names(&self) -> Vec<(String, Language)> {
        self.lanes
            .lock()
            .unwrap()
            .iter()
            .map(|(n, l)| (n.clone(), l.language))
            .collect()
    }
}

/// What the refill task remembers between rounds.
#[derive(Debug)]
struct Refill {
    /// No start before this (after a refused or failed one).
    backoff_until: Instant,
    /// Per environment: the last refill was refused by admission (said once, not every
    /// round).
    refused: BTreeMap<String, bool>,
}

impl Refill {
    fn new() -> Refill {
        Refill {
            backoff_until: Instant::now(),
            refused: BTreeMap::new(),
        }
    }

    /// One round at `now` with `cfg`: every served environment, and every one that had a
    /// pool and is no longer served (target 0), gets its target; one idle worker over its
    /// target is retired per environment, and at most one worker in the whole round is
    /// started (for the first environment, in name order, below its target), unless a
    /// refusal or failure set a back-off that `now` has not reached. Returns whether a start
    /// was tried.
    async fn round<S: Source>(&mut self, source: &S, cfg: &Config, now: Instant) -> bool {
        let d = &cfg.daemon;
        let idle_after = Duration::from_secs(d.pool_idle_seconds);
        let empty_after = Duration::from_secs(d.pool_empty_seconds);
        let pool = source.pool();
        let mut started = false;
        let envs = cfg.environments();
        // Environments no longer served (a reload dropped them) drain to nothing, and so do
        // environments with egress the service's sandbox cannot give (their Opens are refused
        // with `EgressUnavailable`: a warm worker would never be taken).
        let mut todo: Vec<(String, Language, usize, usize)> = envs
            .iter()
            .map(|e| {
                let usable = e.egress.is_none() || crate::egress::availability().is_ok();
                match d.pools && usable {
                    true => (e.name.clone(), e.language, e.pool_min, e.pool_max),
                    false => (e.name.clone(), e.language, 0, 0),
                }
            })
            .collect();
        for (name, language) in pool.names() {
            if !envs.iter().any(|e| e.name == name) {
                todo.push((name, language, 0, 0));
            }
        }
        for (name, lang, min, max) in todo {
            let (idle, target) = pool.plan(&name, lang, min, max, idle_after, empty_after);
            if idle > target {
                if let Some(p) = pool.pop_surplus(&name) {
                    p.discard().await;
                }
            } else if idle < target && !started && now >= self.backoff_until {
                started = true;
                let Some(env) = envs.iter().find(|e| e.name == name) else {
                    continue;
                };
                pool.held_back().await;
                pool.filling.send_modify(|n| *n += 1);
                // The daemon may have begun to stop while this round waited: `drain` either
                // saw this start counted (and waits for it) or this sees the stop (and starts
                // nothing); a start begun after `drain` returned would be cut by the exit and
                // leave its session group behind.
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                if source.config().is_none() {
                    pool.filling.send_modify(|n| *n -= 1);
                    return started;
                }
                let r = source.start(env, cfg.limits.max_guest_memory_bytes).await;
                if let Ok(p) = &r {
                    tracing::info!(environment = %name, language = lang.as_str(), session = %p.id(), "warm worker ready");
                    self.refused.insert(name.clone(), false);
                }
                // Pushed before the count drops, so a client waiting in `evict_one` finds it.
                // The daemon stopped meanwhile: discarded instead (`drain` waits for it).
                let r = match r {
                    Ok(p) if source.config().is_none() => {
                        p.discard().await;
                        Ok(())
                    }
                    Ok(p) => {
                        pool.push(&name, lang, p);
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                pool.filling.send_modify(|n| *n -= 1);
                match r {
                    Ok(()) => {}
                    // No room: clients come first; try again later.
                    Err(e) if e.budget().is_some() => {
                        if !self.refused.insert(name.clone(), true).unwrap_or(false) {
                            tracing::info!(environment = %name, idle, target, budget = e.budget().unwrap_or_default(), "warm pool below its target: admission has no room (sessions and other pools use the budget); retrying every second");
                        }
                        self.backoff_until = Instant::now() + REFUSED_BACKOFF;
                    }
                    Err(e) => {
                        tracing::warn!(environment = %name, error = %e, "warm pool: worker failed to start; retrying in 5 s");
                        self.backoff_until = Instant::now() + FAILED_BACKOFF;
                    }
                }
            }
        }
        started
    }
}

/// How long the refill task waits after admission refused a warm worker.
const REFUSED_BACKOFF: Duration = Duration::from_secs(1);

/// How long the refill task waits after a warm worker failed to start.
const FAILED_BACKOFF: Duration = Duration::from_secs(5);

/// How long the refill task sleeps after a round that started nothing, unless a take wakes
/// it.
const IDLE_ROUND: Duration = Duration::from_millis(500);

/// How long a warm worker's start waits at most for the [`RefillHold`]s to end (250 ms: a
/// warm one-shot `Run` takes a few milliseconds; a stuck one does not stop the refill).
pub const MAX_HOLD: Duration = Duration::from_millis(250);

/// How long [`Pool::drain`] waits for a worker start under way (seconds: 10).
pub const DRAIN_START_WAIT: Duration = Duration::from_secs(10);

/// The refill task: keeps each pool at its target, at most `pool_refill_per_second` starts a
/// second, until the daemon stops. Holds the source weakly between rounds; during a round and
/// its pause it holds a strong reference, so it ends at the first round that finds the source
/// stopping ([`Source::config`] is `None`) or gone.
pub async fn run<S: Source>(source: Weak<S>) {
    let mut refill = Refill::new();
    loop {
        let Some(s) = source.upgrade() else { return };
        let Some(cfg) = s.config() else { return };
        let started = refill.round(&*s, &cfg, Instant::now()).await;
        let wait = if started {
            Duration::from_secs_f64(1.0 / cfg.daemon.pool_refill_per_second.max(0.001))
        } else {
            IDLE_ROUND
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = s.pool().notifier().notified(), if !started => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A pooled worker that is only a record: no process, no cgroup, no uid.
    #[derive(Debug)]
    struct Fake {
        id: String,
        guest_memory: u64,
        alive: Arc<AtomicBool>,
        discarded: Arc<AtomicUsize>,
    }

    impl Warm for Fake {
        fn id(&self) -> &str {
            &self.id
        }
        fn guest_memory(&self) -> u64 {
            self.guest_memory
        }
        fn alive(&mut self) -> bool {
            self.alive.load(Ordering::SeqCst)
        }
        fn discard(self) -> impl Future<Output = ()> + Send {
            self.discarded.fetch_add(1, Ordering::SeqCst);
            std::future::ready(())
        }
    }

    /// A starter that makes [`Fake`]s, or refuses or fails as told.
    #[derive(Debug)]
    struct FakeSource {
        config: Mutex<Arc<Config>>,
        pool: Pool<Fake>,
        started: Mutex<Vec<String>>,
        refuse: AtomicBool,
        fail: AtomicBool,
        discarded: Arc<AtomicUsize>,
        alive: Arc<AtomicBool>,
        /// The daemon stops while a start is under way (`config` answers `None` after it).
        stop_during_start: AtomicBool,
        stopped: AtomicBool,
    }

    impl Source for FakeSource {
        type Worker = Fake;
        fn config(&self) -> Option<Arc<Config>> {
            (!self.stopped.load(Ordering::SeqCst)).then(|| self.config.lock().unwrap().clone())
        }
        fn start(
            &self,
            env: &Environment,
            guest_memory: u64,
        ) -> impl Future<Output = Result<Fake, StartError>> + Send {
            if self.stop_during_start.load(Ordering::SeqCst) {
                self.stopped.store(true, Ordering::SeqCst);
            }
            let r = if self.refuse.load(Ordering::SeqCst) {
                Err(StartError::Uids { count: 1 })
            } else if self.fail.load(Ordering::SeqCst) {
                Err(StartError::Cancelled)
            } else {
                let mut started = self.started.lock().unwrap();
                started.push(env.name.clone());
                Ok(Fake {
                    id: format!("{}-{}", env.name, started.len()),
                    guest_memory,
                    alive: self.alive.clone(),
                    discarded: self.discarded.clone(),
                })
            };
            std::future::ready(r)
        }
        fn pool(&self) -> &Pool<Fake> {
            &self.pool
        }
    }

    /// A configuration serving `python` (Eryx) and `r`, with the given pool sizes, an idle
    /// time of `idle_seconds` and a refill rate of 4 a second.
    fn config(python: (usize, usize), r: (usize, usize), idle_seconds: u64) -> Arc<Config> {
        let text = format!(
            "[daemon]\nlanguages = [\"python\", \"r\"]\npool_idle_seconds = {idle_seconds}\n\
             [environments.python]\nlanguage = \"python\"\nengine = \"eryx\"\ndefault = true\n\
             pool_min = {}\npool_max = {}\n\
             [environments.pydata]\nlanguage = \"python\"\nengine = \"native\"\nenabled = false\n\
             [environments.r]\nlanguage = \"r\"\nengine = \"native\"\ndefault = true\n\
             pool_min = {}\npool_max = {}\n",
            python.0, python.1, r.0, r.1
        );
        let c = Config::parse(Path::new("test.toml"), &text).unwrap();
        c.validate().unwrap();
        Arc::new(c)
    }

    fn source(cfg: Arc<Config>) -> FakeSource {
        FakeSource {
            config: Mutex::new(cfg),
            pool: Pool::default(),
            started: Mutex::default(),
            refuse: AtomicBool::new(false),
            fail: AtomicBool::new(false),
            discarded: Arc::default(),
            alive: Arc::new(AtomicBool::new(true)),
            stop_during_start: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// A worker whose start ends after the daemon began to stop is discarded, not pooled:
    /// nothing started by the pool outlives the stop.
    #[tokio::test]
    async fn a_start_that_ends_after_the_stop_is_discarded() {
        let s = source(config((1, 1), (0, 0), 60));
        s.stop_during_start.store(true, Ordering::SeqCst);
        let mut refill = Refill::new();
        let cfg = s.config().unwrap();
        assert!(refill.round(&s, &cfg, Instant::now()).await);
        assert_eq!(*s.started.lock().unwrap(), ["python"]);
        assert_eq!(idle(&s, "python"), 0);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 1);
        assert_eq!(s.pool.drain().await, 0);
    }

    /// A stop that comes while a round waits for the holds (after it chose to start, before
    /// the start counts in `filling`): the round starts nothing, so a `drain` that already
    /// returned leaves no start under way for the exit to cut (its session group stayed).
    #[tokio::test]
    async fn a_stop_during_the_hold_wait_starts_nothing() {
        let s = Arc::new(source(config((1, 1), (0, 0), 60)));
        let cfg = s.config().unwrap();
        let hold = s.pool.hold();
        let task = {
            let s = s.clone();
            tokio::spawn(async move { Refill::new().round(&*s, &cfg, Instant::now()).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        s.stopped.store(true, Ordering::SeqCst);
        assert_eq!(s.pool.drain().await, 0);
        drop(hold);
        task.await.unwrap();
        assert!(
            s.started.lock().unwrap().is_empty(),
            "a start after the stop"
        );
        assert_eq!(*s.pool.filling.borrow(), 0);
        assert_eq!(idle(&s, "python"), 0);
    }

    /// Runs `n` rounds at once (no back-off can pass meanwhile); returns the rounds that
    /// started a worker.
    async fn rounds(refill: &mut Refill, s: &FakeSource, n: usize) -> usize {
        let mut started = 0;
        for _ in 0..n {
            let cfg = s.config().unwrap();
            started += usize::from(refill.round(s, &cfg, Instant::now()).await);
        }
        started
    }

    fn idle(s: &FakeSource, env: &str) -> usize {
        s.pool
            .status()
            .iter()
            .find(|st| st.environment == env)
            .map_or(0, |st| st.idle)
    }

    /// A start waits while a hold lives (a one-shot Run's cell), and starts as soon as the
    /// hold ends, or after [`MAX_HOLD`] at most.
    #[tokio::test]
    async fn a_start_waits_for_the_holds_at_most_max_hold() {
        let s = source(config((1, 1), (0, 0), 60));
        let cfg = s.config().unwrap();
        let hold = s.pool.hold();
        let t0 = std::time::Instant::now();
        assert!(Refill::new().round(&s, &cfg, Instant::now()).await);
        let waited = t0.elapsed();
        assert!(
            waited >= MAX_HOLD && waited < MAX_HOLD * 8,
            "a live hold delays the start by MAX_HOLD: {waited:?}"
        );
        assert_eq!(*s.started.lock().unwrap(), ["python"]);
        // Released during the wait: the start follows the release, not the bound.
        let s = Arc::new(source(config((1, 1), (0, 0), 60)));
        let second = s.pool.hold();
        drop(hold);
        let t0 = std::time::Instant::now();
        let task = {
            let s = s.clone();
            let cfg = cfg.clone();
            tokio::spawn(async move { Refill::new().round(&*s, &cfg, Instant::now()).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            s.started.lock().unwrap().is_empty(),
            "started during a hold"
        );
        drop(second);
        assert!(task.await.unwrap());
        assert!(
            t0.elapsed() < MAX_HOLD,
            "waited past the release: {:?}",
            t0.elapsed()
        );
        assert_eq!(*s.started.lock().unwrap(), ["python"]);
        // Without a hold, no wait.
        let t0 = std::time::Instant::now();
        let s = source(config((1, 1), (0, 0), 60));
        assert!(Refill::new().round(&s, &cfg, Instant::now()).await);
        assert!(t0.elapsed() < MAX_HOLD, "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn fills_each_pool_to_its_minimum_one_start_a_round() {
        let s = source(config((2, 3), (1, 1), 60));
        let mut refill = Refill::new();
        assert_eq!(rounds(&mut refill, &s, 1).await, 1);
        assert_eq!(*s.started.lock().unwrap(), ["python"]);
        assert_eq!(rounds(&mut refill, &s, 5).await, 2);
        assert_eq!(*s.started.lock().unwrap(), ["python", "python", "r"]);
        assert_eq!((idle(&s, "python"), idle(&s, "r")), (2, 1));
        let st = s.pool.status();
        assert_eq!(
            st.iter()
                .map(|x| (x.environment.as_str(), x.target, x.min, x.max))
                .collect::<Vec<_>>(),
            [("python", 2, 2, 3), ("r", 1, 1, 1)]
        );
    }

    #[tokio::test]
    async fn grows_to_its_maximum_while_taken_and_shrinks_when_idle() {
        let s = source(config((1, 3), (0, 0), 60));
        let mut refill = Refill::new();
        rounds(&mut refill, &s, 2).await;
        assert_eq!(idle(&s, "python"), 1);
        let gm = s.config().unwrap().limits.max_guest_memory_bytes;
        let taken = s.pool.take("python", Language::Python, gm).unwrap();
        assert_eq!(taken.id, "python-1");
        // Taken a moment ago: the target is the maximum.
        assert_eq!(rounds(&mut refill, &s, 5).await, 3);
        assert_eq!(idle(&s, "python"), 3);
        assert_eq!(s.pool.status()[0].taken, 1);
        // With an idle time of 0 the pool is idle at once: back to the minimum, one worker
        // retired a round, none started.
        *s.config.lock().unwrap() = config((1, 3), (0, 0), 0);
        assert_eq!(rounds(&mut refill, &s, 1).await, 0);
        assert_eq!(idle(&s, "python"), 2);
        assert_eq!(rounds(&mut refill, &s, 3).await, 0);
        assert_eq!(idle(&s, "python"), 1);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn empties_after_the_empty_time_without_a_take_and_refills_on_the_next() {
        let mut c = (*config((1, 2), (0, 0), 60)).clone();
        c.daemon.pool_empty_seconds = 1;
        let s = source(Arc::new(c));
        let mut refill = Refill::new();
        rounds(&mut refill, &s, 2).await;
        assert_eq!(idle(&s, "python"), 1);
        // Nothing taken for the empty time (counted from the first round): no warm worker.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert_eq!(rounds(&mut refill, &s, 1).await, 0);
        assert_eq!(idle(&s, "python"), 0);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 1);
        assert_eq!(s.pool.status()[0].target, 0);
        // A take (here a miss) makes the pool active again: it refills.
        let gm = s.config().unwrap().limits.max_guest_memory_bytes;
        assert!(s.pool.take("python", Language::Python, gm).is_none());
        rounds(&mut refill, &s, 3).await;
        assert!(idle(&s, "python") >= 1);
    }

    #[tokio::test]
    async fn an_environment_no_longer_served_drains_to_nothing() {
        let s = source(config((0, 0), (2, 2), 60));
        let mut refill = Refill::new();
        rounds(&mut refill, &s, 2).await;
        assert_eq!(idle(&s, "r"), 2);
        let mut c = (*config((0, 0), (0, 0), 60)).clone();
        c.daemon.languages = vec!["python".into()];
        c.validate().unwrap();
        *s.config.lock().unwrap() = Arc::new(c);
        assert_eq!(rounds(&mut refill, &s, 3).await, 0);
        assert_eq!(idle(&s, "r"), 0);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 2);
        let r = s.pool.status().into_iter().find(|x| x.environment == "r");
        assert_eq!(r.map(|x| (x.target, x.min, x.max)), Some((0, 0, 0)));
    }

    #[tokio::test]
    async fn a_refused_or_failed_start_backs_off() {
        let s = source(config((1, 1), (0, 0), 60));
        let mut refill = Refill::new();
        s.refuse.store(true, Ordering::SeqCst);
        assert_eq!(rounds(&mut refill, &s, 1).await, 1);
        // Refused by admission: no new try within a second.
        assert_eq!(rounds(&mut refill, &s, 3).await, 0);
        s.refuse.store(false, Ordering::SeqCst);
        let cfg = s.config().unwrap();
        let later = Instant::now() + REFUSED_BACKOFF + Duration::from_millis(50);
        assert!(refill.round(&s, &cfg, later).await);
        assert_eq!(idle(&s, "python"), 1);
        // A failed start waits longer.
        let gm = cfg.limits.max_guest_memory_bytes;
        assert!(s.pool.take("python", Language::Python, gm).is_some());
        s.fail.store(true, Ordering::SeqCst);
        assert!(refill.round(&s, &cfg, later).await);
        let later = Instant::now() + REFUSED_BACKOFF + Duration::from_millis(50);
        assert!(!refill.round(&s, &cfg, later).await);
        let later = Instant::now() + FAILED_BACKOFF + Duration::from_millis(50);
        s.fail.store(false, Ordering::SeqCst);
        assert!(refill.round(&s, &cfg, later).await);
        assert_eq!(idle(&s, "python"), 1);
    }

    #[tokio::test]
    async fn takes_match_guest_memory_and_skip_dead_workers() {
        let s = source(config((2, 2), (0, 0), 60));
        let mut refill = Refill::new();
        rounds(&mut refill, &s, 2).await;
        let gm = s.config().unwrap().limits.max_guest_memory_bytes;
        // Another guest memory: a miss, nothing handed out or lost.
        assert!(s.pool.take("python", Language::Python, gm / 2).is_none());
        assert_eq!(idle(&s, "python"), 2);
        assert_eq!(s.pool.status()[0].missed, 1);
        // Dead workers are discarded, never handed out.
        s.alive.store(false, Ordering::SeqCst);
        assert!(s.pool.take("python", Language::Python, gm).is_none());
        tokio::task::yield_now().await;
        assert_eq!(idle(&s, "python"), 0);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 2);
        // An environment without a pool never counts a miss.
        assert!(s.pool.take("r", Language::R, gm).is_none());
        let r = s.pool.status().into_iter().find(|x| x.environment == "r");
        assert_eq!(r.map(|x| x.missed), Some(0));
    }

    #[tokio::test]
    async fn eviction_and_drain_discard_idle_workers() {
        let s = source(config((2, 2), (1, 1), 60));
        let mut refill = Refill::new();
        rounds(&mut refill, &s, 3).await;
        assert!(s.pool.evict_one().await);
        assert_eq!(s.discarded.load(Ordering::SeqCst), 1);
        s.pool.drain().await;
        assert_eq!(s.discarded.load(Ordering::SeqCst), 3);
        assert!(!s.pool.evict_one().await);
    }
}
