//! Per-session worker identities: each live session gets its own uid (and a group of the same
//! number) from the configured range, so sessions cannot signal each other or read each
//! other's files even where another wall fails (RLIMIT_NPROC also counts per uid).
//!
//! Numbers are allocated lowest-free-first and returned when the [`UidLease`] drops, which the
//! session does only after its worker is dead and its directory removed.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// The pool of worker uids `[base, base + count)`.
#[derive(Debug, Clone)]
pub struct UidPool {
    base: u32,
    count: u32,
    used: Arc<Mutex<BTreeSet<u32>>>,
}

/// One allocated uid; returned to the pool on drop.
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    used: Arc<Mutex<BTreeSet<u32>>>,
}

impl UidLease {
    /// The uid (also used as the gid).
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        self.used.lock().unwrap().remove(&self.uid);
    }
}

impl UidPool {
    /// A pool of `count` uids from `base`.
    pub fn new(base: u32, count: u32) -> Self {
        Self {
            base,
            count,
            used: Arc::default(),
        }
    }

    /// Allocates the lowest free uid, or `None` when all are in use.
    pub fn allocate(&self) -> Option<UidLease> {
        let mut used = self.used.lock().unwrap();
        let uid = (self.base..self.base + self.count).find(|u| !used.contains(u))?;
        used.insert(uid);
        Some(UidLease {
            uid,
            used: self.used.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_until_released() {
        let p = UidPool::new(5000, 2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_ne!(a.uid(), b.uid());
        assert!(p.allocate().is_none());
        let ua = a.uid();
        drop(a);
        assert_eq!(p.allocate().unwrap().uid(), ua);
    }
}
