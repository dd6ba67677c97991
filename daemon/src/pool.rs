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
//!   the last `pool_idle_seconds`), and shrinks back to `min` when idle;
//! - refills are rate-limited (`pool_refill_per_second`) and run on one background task, never
//!   on a client's path;
//! - when admission refuses a client and idle pooled workers hold charges, one is evicted and
//!   the client admitted: the pool never causes a refusal.

use crate::admission::Permit;
use crate::cgroup::SessionGroup;
use crate::core::Core;
use crate::identity::UidLease;
use crate::worker::spawn::Spawned;
use sandcell_proto::kernel::{KernelError, Language};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// A worker that has confined itself and said `Ready`, not yet owned by any session.
#[derive(Debug)]
pub struct Prepared {
    /// Session id it will have.
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
    /// Its directory.
    pub session_dir: PathBuf,
    /// Its uid.
    pub lease: Option<UidLease>,
    /// Its admission charge.
    pub permit: Permit,
}

impl Prepared {
    /// Kills and releases an unused worker in the session release order: kill, reap, remove
    /// cgroup and directory, then uid and permit.
    pub async fn discard(mut self) {
        crate::worker::kill_and_reap(self.spawned.pid, &mut self.spawned.child, &self.group).await;
        crate::worker::remove_remains(&self.id, self.group.clone(), self.session_dir.clone()).await;
        drop(self.lease.take());
        drop(self.permit);
    }

    fn alive(&mut self) -> bool {
        matches!(self.spawned.child.try_wait(), Ok(None))
    }
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
struct Lane {
    language: Language,
    idle: VecDeque<Prepared>,
    last_take: Option<Instant>,
    target: usize,
    min: usize,
    max: usize,
    taken: u64,
    missed: u64,
}

impl Lane {
    fn new(language: Language) -> Lane {
        Lane {
            language,
            idle: VecDeque::new(),
            last_take: None,
            target: 0,
            min: 0,
            max: 0,
            taken: 0,
            missed: 0,
        }
    }
}

/// The pools of all environments, by environment name.
#[derive(Debug, Default)]
pub struct Pool {
    lanes: Mutex<BTreeMap<String, Lane>>,
    wake: tokio::sync::Notify,
}

impl Pool {
    /// Takes a warm worker of `environment` (of `language`) started with `guest_memory`, if
    /// one is idle.
    pub fn take(
        &self,
        environment: &str,
        language: Language,
        guest_memory: u64,
    ) -> Option<Prepared> {
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
            if p.guest_memory == guest_memory {
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
    /// charge is released. Returns false when the pool is empty.
    pub async fn evict_one(&self) -> bool {
        let victim = {
            let mut lanes = self.lanes.lock().unwrap();
            lanes.values_mut().find_map(|l| l.idle.pop_front())
        };
        match victim {
            Some(p) => {
                p.discard().await;
                true
            }
            None => false,
        }
    }

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

    /// Discards every idle worker (daemon stop).
    pub async fn drain(&self) {
        let all: Vec<Prepared> = {
            let mut lanes = self.lanes.lock().unwrap();
            lanes.values_mut().flat_map(|l| l.idle.drain(..)).collect()
        };
        for p in all {
            p.discard().await;
        }
    }

    fn push(&self, p: Prepared) {
        let language = p.language;
        self.lanes
            .lock()
            .unwrap()
            .entry(p.environment.clone())
            .or_insert_with(|| Lane::new(language))
            .idle
            .push_back(p);
    }

    /// Decides the target of `environment` and returns (idle, target).
    fn plan(
        &self,
        environment: &str,
        language: Language,
        min: usize,
        max: usize,
        idle_after: Duration,
    ) -> (usize, usize) {
        let mut lanes = self.lanes.lock().unwrap();
        let l = lanes
            .entry(environment.to_owned())
            .or_insert_with(|| Lane::new(language));
        let busy = l.last_take.is_some_and(|t| t.elapsed() < idle_after);
        (l.min, l.max) = (min, max);
        l.target = if busy { max } else { min };
        (l.idle.len(), l.target)
    }

    fn pop_surplus(&self, environment: &str) -> Option<Prepared> {
        self.lanes
            .lock()
            .unwrap()
            .get_mut(environment)
            .and_then(|l| l.idle.pop_back())
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

/// The refill task: keeps each pool at its target, at most `pool_refill_per_second` starts a
/// second, until the daemon stops. Holds the core weakly between rounds; during a round and
/// its pause it holds a strong reference, so it ends at the first round
/// that finds the core stopping or gone.
pub async fn run(core: Weak<Core>) {
    let mut backoff_until = Instant::now();
    // Per environment: the last refill was refused by admission (said once, not every second).
    let mut refused: BTreeMap<String, bool> = BTreeMap::new();
    loop {
        let Some(c) = core.upgrade() else { return };
        if c.stopping() {
            return;
        }
        let cfg = c.config();
        let d = &cfg.daemon;
        let pause = Duration::from_secs_f64(1.0 / d.pool_refill_per_second.max(0.001));
        let idle_after = Duration::from_secs(d.pool_idle_seconds);
        let mut started = false;
        let envs = cfg.environments();
        // Environments no longer served (a reload dropped them) drain to nothing.
        let mut todo: Vec<(String, Language, usize, usize)> = envs
            .iter()
            .map(|e| (e.name.clone(), e.language, e.pool_min, e.pool_max))
            .collect();
        for (name, language) in c.pool().names() {
            if !envs.iter().any(|e| e.name == name) {
                todo.push((name, language, 0, 0));
            }
        }
        for (name, lang, min, max) in todo {
            let (idle, target) = c.pool().plan(&name, lang, min, max, idle_after);
            if idle > target {
                if let Some(p) = c.pool().pop_surplus(&name) {
                    p.discard().await;
                }
            } else if idle < target && !started && Instant::now() >= backoff_until {
                started = true;
                let Some(env) = envs.iter().find(|e| e.name == name) else {
                    continue;
                };
                match c
                    .prepare_worker(env, cfg.limits.max_guest_memory_bytes, None)
                    .await
                {
                    Ok(p) => {
                        tracing::info!(environment = %name, language = lang.as_str(), session = %p.id, "warm worker ready");
                        refused.insert(name.clone(), false);
                        c.pool().push(p);
                    }
                    // No room: clients come first; try again later.
                    Err(KernelError::CapacityExceeded { budget, .. }) => {
                        if !refused.insert(name.clone(), true).unwrap_or(false) {
                            tracing::info!(environment = %name, idle, target, budget = %budget, "warm pool below its target: admission has no room (sessions and other pools use the budget); retrying every second");
                        }
                        backoff_until = Instant::now() + Duration::from_secs(1)
                    }
                    Err(e) => {
                        tracing::warn!(environment = %name, error = %e, "warm pool: worker failed to start; retrying in 5 s");
                        backoff_until = Instant::now() + Duration::from_secs(5);
                    }
                }
            }
        }
        let wait = if started {
            pause
        } else {
            Duration::from_millis(500)
        };
        let core_ref = c.clone();
        drop(c);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = core_ref.pool().notifier().notified(), if !started => {}
        }
        drop(core_ref);
    }
}

impl Pool {
    /// Wakes the refill task (after a take).
    pub fn notifier(&self) -> &tokio::sync::Notify {
        &self.wake
    }
}
