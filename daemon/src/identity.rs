//! Per-session worker identities: each live session gets its own uid (and a group of the same
//! number) from the configured range, so sessions cannot signal each other or read each
//! other's files even where another wall fails (RLIMIT_NPROC also counts per uid).
//!
//! Numbers are allocated lowest-free-first and returned when the [`UidLease`] drops, which the
//! session does only after its worker is dead and its directory removed. A uid is not leased
//! again while any process still has it (real, effective, saved or file-system uid in
//! `/proc/<pid>/status`): a process that outlived its session (escaped its cgroup, or is
//! being reaped) would otherwise share the next session's identity, signals and files. Such
//! a uid is skipped (quarantined) until its processes are gone, and the skip is logged.

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

    /// Uids leased now (one per live session and idle pooled worker), and the size of the
    /// range.
    pub fn usage(&self) -> (u64, u64) {
        (
            self.used.lock().unwrap().len() as u64,
            u64::from(self.count),
        )
    }

    /// Allocates the lowest free uid that no process has, or `None` when all are in use or
    /// quarantined. Reads `/proc` once per call (and only when a free uid exists).
    pub fn allocate(&self) -> Option<UidLease> {
        self.allocate_with(live_uids)
    }

    fn allocate_with(&self, live: impl FnOnce() -> BTreeSet<u32>) -> Option<UidLease> {
        let mut used = self.used.lock().unwrap();
        let range = self.base..self.base.saturating_add(self.count);
        if range.clone().all(|u| used.contains(&u)) {
            return None;
        }
        let live = live();
        let mut quarantined = Vec::new();
        let uid = range.filter(|u| !used.contains(u)).find(|u| {
            let busy = live.contains(u);
            if busy {
                quarantined.push(*u);
            }
            !busy
        });
        if !quarantined.is_empty() {
            tracing::warn!(
                uids = ?quarantined,
                "worker uids not reused: processes with these uids still run"
            );
        }
        let uid = uid?;
        used.insert(uid);
        Some(UidLease {
            uid,
            used: self.used.clone(),
        })
    }
}

/// Every uid (real, effective, saved, file-system) of every process in `/proc`. Processes
/// that vanish while being read are skipped.
pub fn live_uids() -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        if let Some(line) = status.lines().find_map(|l| l.strip_prefix("Uid:")) {
            out.extend(
                line.split_whitespace()
                    .filter_map(|v| v.parse::<u32>().ok()),
            );
        }
    }
    out
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

    #[test]
    fn a_uid_with_live_processes_is_not_leased() {
        let p = UidPool::new(5000, 3);
        let a = p
            .allocate_with(|| [5000u32, 5001].into_iter().collect())
            .unwrap();
        assert_eq!(a.uid(), 5002);
        assert!(
            p.allocate_with(|| [5000u32, 5001].into_iter().collect())
                .is_none()
        );
        assert_eq!(p.allocate_with(BTreeSet::new).unwrap().uid(), 5000);
    }

    #[test]
    fn live_uids_sees_this_process() {
        let me = nix::unistd::getuid().as_raw();
        assert!(live_uids().contains(&me));
    }
}
