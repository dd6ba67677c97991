//! Fail-fast admission: sessions alive at once, and the aggregate guest- and worker-memory
//! budgets (seed 000). A request that does not fit is refused at once with the budget's name;
//! nothing ever waits in a queue.
//!
//! A [`Permit`] is taken before a worker is spawned and released when it is dropped. The
//! session code drops it only after the worker is dead and reaped and its cgroup removed
//! (DESIGN invariant: release happens after the worker is dead).

use std::sync::{Arc, Mutex};

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
}

#[derive(Debug)]
struct Inner {
    max: Budgets,
    used: Budgets,
}

/// The admission controller; cheap to clone.
#[derive(Debug, Clone)]
pub struct Admission(Arc<Mutex<Inner>>);

impl Admission {
    /// A controller with budgets `max`.
    pub fn new(max: Budgets) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            max,
            used: Budgets::default(),
        })))
    }

    /// Replaces the budgets (configuration reload); sessions already admitted keep their charge.
    pub fn set_budgets(&self, max: Budgets) {
        self.0.lock().unwrap().max = max;
    }

    /// Budgets and current use.
    pub fn snapshot(&self) -> (Budgets, Budgets) {
        let g = self.0.lock().unwrap();
        (g.max, g.used)
    }

    /// Admits one session with `charge`, or says which budget is exhausted.
    pub fn try_admit(&self, charge: Charge) -> Result<Permit, Refused> {
        let mut g = self.0.lock().unwrap();
        let checks = [
            (
                "max_concurrent_sessions",
                g.used.sessions,
                1,
                g.max.sessions,
            ),
            (
                "max_aggregate_guest_memory_bytes",
                g.used.guest_memory,
                charge.guest_memory,
                g.max.guest_memory,
            ),
            (
                "max_aggregate_worker_memory_bytes",
                g.used.worker_memory,
                charge.worker_memory,
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
                });
            }
        }
        g.used.sessions += 1;
        g.used.guest_memory += charge.guest_memory;
        g.used.worker_memory += charge.worker_memory;
        Ok(Permit {
            admission: self.clone(),
            charge,
        })
    }
}

/// One admitted session's charge; released on drop.
#[derive(Debug)]
pub struct Permit {
    admission: Admission,
    charge: Charge,
}

impl Permit {
    /// The charge held.
    pub fn charge(&self) -> Charge {
        self.charge
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut g = self.admission.0.lock().unwrap();
        g.used.sessions -= 1;
        g.used.guest_memory -= self.charge.guest_memory;
        g.used.worker_memory -= self.charge.worker_memory;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_at_once_and_releases_on_drop() {
        let a = Admission::new(Budgets {
            sessions: 2,
            guest_memory: 300,
            worker_memory: 1000,
        });
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
