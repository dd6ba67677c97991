//! Fail-fast admission: sessions alive at once, and the aggregate guest- and worker-memory
//! budgets. A request that does not fit is refused at once with the budget's name; nothing
//! ever waits in a queue.
//!
//! Per uid (the client's, from the socket's peer credentials), a second set of budgets keeps
//! room for other users: sessions, detached sessions, guest and worker memory
//! ([`UidBudgets`], each below its daemon-wide budget by default), and a token bucket on
//! session starts (`Open` and `Run`). A [`UidCharge`] is reserved before a worker is prepared
//! and attached to the session's [`Permit`], so it is released with it.
//!
//! A [`Permit`] is taken before a worker is spawned and released when it is dropped. The
//! session code drops it only after the worker is dead and reaped and its cgroup removed
//! (DESIGN invariant: release happens after the worker is dead).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What one session is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// Guest (interpreter) memory, bytes.
    pub guest_memory: u64,
    /// Worker cgroup memory, bytes.
    pub worker_memory: u64,
}

/// Budgets and their use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Budgets {
    /// Sessions alive at once.
    pub sessions: u64,
    /// Guest memory, bytes.
    pub guest_memory: u64,
    /// Worker memory, bytes.
    pub worker_memory: u64,
}

/// Refusal: which budget, how much is in use, how much was asked, the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("admission refused: {budget} in use {in_use} + requested {requested} > {max}")]
pub struct Refused {
    /// Configuration key of the budget.
    pub budget: &'static str,
    /// Amount in use.
    pub in_use: u64,
    /// Amount requested.
    pub requested: u64,
    /// The budget.
    pub max: u64,
    /// When a retry can succeed, milliseconds from now, where that is known (the start
    /// rate's next token); `None` for budgets that free up only when a session ends.
    pub retry_after_ms: Option<u64>,
}

/// A refusal as clients see it: `CapacityExceeded` naming the budget, with its use, the
/// amount asked and its size.
impl From<Refused> for sandcell_proto::kernel::KernelError {
    fn from(r: Refused) -> Self {
        sandcell_proto::kernel::KernelError::CapacityExceeded {
            budget: r.budget.into(),
            in_use: r.in_use,
            requested: r.requested,
            max: r.max,
            retry_after_seconds: r.retry_after_ms.map(|ms| ms as f64 / 1000.0),
        }
    }
}

/// Per-uid budgets.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UidBudgets {
    /// Sessions alive at once (one-shot runs included).
    pub sessions: u64,
    /// Detached sessions alive at once.
    pub detached: u64,
    /// Guest memory, bytes.
    pub guest_memory: u64,
    /// Worker memory, bytes.
    pub worker_memory: u64,
    /// Session starts per second (token bucket refill rate).
    pub starts_per_second: f64,
    /// Session starts in a burst (token bucket size).
    pub start_burst: u64,
}

/// One uid's use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UidUse {
    /// Sessions.
    pub sessions: u64,
    /// Detached sessions.
    pub detached: u64,
    /// Guest memory, bytes.
    pub guest_memory: u64,
    /// Worker memory, bytes.
    pub worker_memory: u64,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
struct Inner {
    max: Budgets,
    used: Budgets,
    per_uid: UidBudgets,
    uids: HashMap<u32, UidUse>,
    buckets: HashMap<u32, Bucket>,
}

/// The admission controller; cheap to clone.
#[derive(Debug, Clone)]
pub struct Admission(Arc<Mutex<Inner>>);

impl Admission {
    /// A controller with daemon-wide budgets `max` and per-uid budgets `per_uid`.
    pub fn new(max: Budgets, per_uid: UidBudgets) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            max,
            used: Budgets::default(),
            per_uid,
            uids: HashMap::new(),
            buckets: HashMap::new(),
        })))
    }

    /// Replaces the budgets (configuration reload); sessions already admitted keep their charge.
    pub fn set_budgets(&self, max: Budgets, per_uid: UidBudgets) {
        let mut g = self.0.lock().unwrap();
        g.max = max;
        g.per_uid = per_uid;
    }

    /// Per-uid budgets in force.
    pub fn uid_budgets(&self) -> UidBudgets {
        self.0.lock().unwrap().per_uid
    }

    /// Use of every uid holding sessions.
    pub fn uid_use(&self) -> Vec<(u32, UidUse)> {
        let g = self.0.lock().unwrap();
        let mut v: Vec<_> = g.uids.iter().map(|(u, x)| (*u, *x)).collect();
        v.sort_by_key(|(u, _)| *u);
        v
    }

    /// Takes one token of `uid`'s session-start bucket, or refuses (`starts_per_uid`).
    pub fn take_start(&self, uid: u32) -> Result<(), Refused> {
        let mut g = self.0.lock().unwrap();
        let (rate, burst) = (g.per_uid.starts_per_second, g.per_uid.start_burst as f64);
        let now = Instant::now();
        if g.buckets.len() > 4096 {
            // Forget full buckets (uids idle long enough to have refilled).
            g.buckets
                .retain(|_, b| b.tokens + now.duration_since(b.at).as_secs_f64() * rate < burst);
        }
        let b = g.buckets.entry(uid).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(burst);
        b.at = now;
        if b.tokens < 1.0 {
            return Err(Refused {
                budget: "max_starts_per_second_per_uid",
                in_use: burst as u64,
                requested: 1,
                max: burst as u64,
                // The bucket gains `rate` tokens a second; one is due after (1 - tokens) / rate.
                retry_after_ms: (rate > 0.0)
                    .then(|| ((1.0 - b.tokens) / rate * 1000.0).ceil().max(1.0) as u64),
            });
        }
        b.tokens -= 1.0;
        Ok(())
    }

    /// Reserves one session of `uid` with `charge` (detached or not) against the per-uid
    /// budgets. When the daemon-wide budget of the same kind is exhausted too, the refusal
    /// names the daemon-wide budget.
    pub fn reserve_uid(
        &self,
        uid: u32,
        charge: Charge,
        detached: bool,
    ) -> Result<UidCharge, Refused> {
        let mut g = self.0.lock().unwrap();
        let u = g.uids.get(&uid).copied().unwrap_or_default();
        let p = g.per_uid;
        let checks = [
            (
                "max_sessions_per_uid",
                u.sessions,
                1,
                p.sessions,
                ("max_concurrent_sessions", g.used.sessions, g.max.sessions),
            ),
            (
                "max_detached_sessions_per_uid",
                u.detached,
                u64::from(detached),
                p.detached,
                ("", 0, u64::MAX),
            ),
            (
                "max_guest_memory_bytes_per_uid",
                u.guest_memory,
                charge.guest_memory,
                p.guest_memory,
                (
                    "max_aggregate_guest_memory_bytes",
                    g.used.guest_memory,
                    g.max.guest_memory,
                ),
            ),
            (
                "max_worker_memory_bytes_per_uid",
                u.worker_memory,
                charge.worker_memory,
                p.worker_memory,
                (
                    "max_aggregate_worker_memory_bytes",
                    g.used.worker_memory,
                    g.max.worker_memory,
                ),
            ),
        ];
        for (budget, in_use, requested, max, (global, g_use, g_max)) in checks {
            if requested > 0 && in_use.saturating_add(requested) > max {
                if g_use.saturating_add(requested) > g_max {
                    return Err(Refused {
                        budget: global,
                        in_use: g_use,
                        requested,
                        max: g_max,
                        retry_after_ms: None,
                    });
                }
                return Err(Refused {
                    budget,
                    in_use,
                    requested,
                    max,
                    retry_after_ms: None,
                });
            }
        }
        let e = g.uids.entry(uid).or_default();
        e.sessions += 1;
        e.detached += u64::from(detached);
        e.guest_memory += charge.guest_memory;
        e.worker_memory += charge.worker_memory;
        Ok(UidCharge {
            admission: self.clone(),
            uid,
            charge,
            detached,
        })
    }

    /// Budgets and current use.
    pub fn snapshot(&self) -> (Budgets, Budgets) {
        let g = self.0.lock().unwrap();
        (g.max, g.used)
    }

    /// Admits one session with `charge`, or says which budget is exhausted.
    pub fn try_admit(&self, charge: Charge) -> Result<Permit, Refused> {
        self.admit(charge, false)
    }

    /// Admits one warm pool worker with `charge` only while a session of the same charge
    /// still fits after it (one session and its memory stay free in every budget), so a pool
    /// refill never takes the last capacity a client's `Open` or `Run` needs. Errors: as
    /// [`Admission::try_admit`], `requested` being the charge with that room.
    pub fn try_admit_leaving_room(&self, charge: Charge) -> Result<Permit, Refused> {
        self.admit(charge, true)
    }

    fn admit(&self, charge: Charge, leave_room: bool) -> Result<Permit, Refused> {
        let room = u64::from(leave_room) + 1;
        let mut g = self.0.lock().unwrap();
        let checks = [
            (
                "max_concurrent_sessions",
                g.used.sessions,
                room,
                g.max.sessions,
            ),
            (
                "max_aggregate_guest_memory_bytes",
                g.used.guest_memory,
                charge.guest_memory.saturating_mul(room),
                g.max.guest_memory,
            ),
            (
                "max_aggregate_worker_memory_bytes",
                g.used.worker_memory,
                charge.worker_memory.saturating_mul(room),
                g.max.worker_memory,
            ),
        ];
        for (budget, in_use, requested, max) in checks {
            if in_use.saturating_add(requested) > max {
                return Err(Refused {
                    budget,
                    in_use,
                    requested,
                    max,
                    retry_after_ms: None,
                });
            }
        }
        g.used.sessions += 1;
        g.used.guest_memory += charge.guest_memory;
        g.used.worker_memory += charge.worker_memory;
        Ok(Permit {
            admission: self.clone(),
            charge,
            owner: None,
        })
    }
}

/// One uid's reservation of one session; released on drop.
#[derive(Debug)]
pub struct UidCharge {
    admission: Admission,
    uid: u32,
    charge: Charge,
    detached: bool,
}

impl Drop for UidCharge {
    fn drop(&mut self) {
        let mut g = self.admission.0.lock().unwrap();
        if let Some(e) = g.uids.get_mut(&self.uid) {
            e.sessions -= 1;
            e.detached -= u64::from(self.detached);
            e.guest_memory -= self.charge.guest_memory;
            e.worker_memory -= self.charge.worker_memory;
            if *e == UidUse::default() {
                g.uids.remove(&self.uid);
            }
        }
    }
}

/// One admitted session's charge; released on drop (with its owner's [`UidCharge`]).
#[derive(Debug)]
pub struct Permit {
    admission: Admission,
    charge: Charge,
    owner: Option<UidCharge>,
}

impl Permit {
    /// The charge held.
    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// Attaches the owner's per-uid reservation, released together with this permit.
    pub fn attach(&mut self, owner: UidCharge) {
        self.owner = Some(owner);
    }

    /// Gives the owner's per-uid reservation back now, keeping the daemon-wide charge until
    /// the permit drops (after the worker is reaped). Called when a session's end is decided,
    /// before its client sees the last result: a client that opens its next session at once
    /// must not be refused for the one that is ending, while the machine-wide budgets still
    /// count the worker until it is gone.
    pub fn release_owner(&mut self) {
        drop(self.owner.take());
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        drop(self.owner.take());
        let mut g = self.admission.0.lock().unwrap();
        g.used.sessions -= 1;
        g.used.guest_memory -= self.charge.guest_memory;
        g.used.worker_memory -= self.charge.worker_memory;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_uid() -> UidBudgets {
        UidBudgets {
            sessions: 2,
            detached: 1,
            guest_memory: 1000,
            worker_memory: 1000,
            starts_per_second: 1.0,
            start_burst: 3,
        }
    }

    #[test]
    fn per_uid_budgets_leave_room_for_another_uid() {
        let a = Admission::new(
            Budgets {
                sessions: 3,
                guest_memory: 3000,
                worker_memory: 3000,
            },
            per_uid(),
        );
        let c = Charge {
            guest_memory: 10,
            worker_memory: 10,
        };
        let r1 = a.reserve_uid(1000, c, true).unwrap();
        let e = a.reserve_uid(1000, c, true).unwrap_err();
        assert_eq!(e.budget, "max_detached_sessions_per_uid");
        let mut p = a.try_admit(c).unwrap();
        p.attach(r1);
        let _r2 = a.reserve_uid(1000, c, false).unwrap();
        let e = a.reserve_uid(1000, c, false).unwrap_err();
        assert_eq!((e.budget, e.in_use, e.max), ("max_sessions_per_uid", 2, 2));
        let _r3 = a.reserve_uid(1001, c, false).unwrap();
        drop(p);
        assert_eq!(
            a.uid_use()
                .iter()
                .find(|(u, _)| *u == 1000)
                .unwrap()
                .1
                .sessions,
            1
        );
        assert!(a.reserve_uid(1000, c, true).is_ok());
    }

    #[test]
    fn an_ending_session_gives_back_its_uid_quota_before_its_daemon_wide_charge() {
        let a = Admission::new(
            Budgets {
                sessions: 3,
                guest_memory: 3000,
                worker_memory: 3000,
            },
            per_uid(),
        );
        let c = Charge {
            guest_memory: 10,
            worker_memory: 10,
        };
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut p = a.try_admit(c).unwrap();
            p.attach(a.reserve_uid(1000, c, false).unwrap());
            held.push(p);
        }
        assert!(
            a.reserve_uid(1000, c, false).is_err(),
            "the uid is at its cap"
        );
        // The first session's end is decided: the uid may open again at once, but the
        // daemon-wide count keeps the ending worker until its permit drops.
        held[0].release_owner();
        let r = a.reserve_uid(1000, c, false).unwrap();
        assert_eq!(a.snapshot().1.sessions, 2);
        let mut p = a.try_admit(c).unwrap();
        p.attach(r);
        assert_eq!(
            a.try_admit(c).unwrap_err().budget,
            "max_concurrent_sessions"
        );
        drop(held);
        assert_eq!(a.snapshot().1.sessions, 1);
        assert_eq!(a.uid_use()[0].1.sessions, 1);
    }

    #[test]
    fn a_pool_admission_leaves_one_session_and_its_memory_free() {
        let a = Admission::new(
            Budgets {
                sessions: 3,
                guest_memory: 300,
                worker_memory: 250,
            },
            per_uid(),
        );
        let c = Charge {
            guest_memory: 100,
            worker_memory: 100,
        };
        // Worker memory: 100 used + 2 x 100 > 250, though a plain admission fits.
        let _p1 = a.try_admit_leaving_room(c).unwrap();
        let e = a.try_admit_leaving_room(c).unwrap_err();
        assert_eq!(
            (e.budget, e.in_use, e.requested),
            ("max_aggregate_worker_memory_bytes", 100, 200)
        );
        let _p2 = a.try_admit(c).unwrap();
        // Sessions: one left free is never taken by a pool.
        let a = Admission::new(
            Budgets {
                sessions: 2,
                guest_memory: 1000,
                worker_memory: 1000,
            },
            per_uid(),
        );
        let _p1 = a.try_admit_leaving_room(c).unwrap();
        let e = a.try_admit_leaving_room(c).unwrap_err();
        assert_eq!(
            (e.budget, e.in_use, e.max),
            ("max_concurrent_sessions", 1, 2)
        );
        assert_eq!(a.snapshot().1.sessions, 1);
        let _p2 = a.try_admit(c).unwrap();
    }

    #[test]
    fn start_rate_is_a_token_bucket() {
        let a = Admission::new(Budgets::default(), per_uid());
        for _ in 0..3 {
            a.take_start(7).unwrap();
        }
        let e = a.take_start(7).unwrap_err();
        assert_eq!(e.budget, "max_starts_per_second_per_uid");
        // Rate 1 per second, bucket empty: the next token is due in at most a second.
        let after = e
            .retry_after_ms
            .expect("the start rate knows when to retry");
        assert!((900..=1000).contains(&after), "retry after {after} ms");
        let k = sandcell_proto::kernel::KernelError::from(e);
        assert!(
            matches!(k, sandcell_proto::kernel::KernelError::CapacityExceeded { retry_after_seconds: Some(s), .. } if s > 0.8 && s <= 1.0),
            "{k:?}"
        );
        a.take_start(8).unwrap();
    }

    #[test]
    fn refuses_at_once_and_releases_on_drop() {
        let a = Admission::new(
            Budgets {
                sessions: 2,
                guest_memory: 300,
                worker_memory: 1000,
            },
            per_uid(),
        );
        let c = Charge {
            guest_memory: 128,
            worker_memory: 400,
        };
        let p1 = a.try_admit(c).unwrap();
        let p2 = a.try_admit(c).unwrap();
        let e = a.try_admit(c).unwrap_err();
        assert_eq!(e.budget, "max_concurrent_sessions");
        drop(p1);
        let big = Charge {
            guest_memory: 200,
            worker_memory: 1,
        };
        assert_eq!(
            a.try_admit(big).unwrap_err().budget,
            "max_aggregate_guest_memory_bytes"
        );
        drop(p2);
        assert_eq!(a.snapshot().1, Budgets::default());
    }
}
