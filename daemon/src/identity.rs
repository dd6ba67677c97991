//! Identities: who calls ([`Caller`], its authorization [`Subject`]) and who runs
//! ([`UidPool`]).
//!
//! Callers come from the transport, never from a message: a Varlink connection's peer
//! credentials and pidfd, or a D-Bus sender's unique name.
//!
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

/// Who called: taken from the connection's peer credentials (never from the message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Peer uid.
    pub uid: u32,
    /// Peer gid.
    pub gid: u32,
    /// Peer pid at connect time.
    pub pid: u32,
    /// Connection id (unique per daemon run); 0 for the daemon itself and D-Bus callers.
    pub connection: u64,
    /// How the authority (polkit) identifies the caller; never a bare pid (see [`Subject`]).
    pub subject: Subject,
}

/// The caller as an authorization subject (polkit's `unix-process` or `system-bus-name`).
///
/// A bare pid is never a subject: a pid can be recycled between the connection and the check,
/// and a caller that vanishes mid-check must be refused, not mistaken for another process
/// (polkit CVE-2013-4288, the pid-reuse race; CVE-2021-3560, a requester killed mid-check was
/// treated as root). Hence start time + uid, and a pidfd where the kernel gives one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// The daemon itself (readiness probe).
    Daemon,
    /// A local process from a socket's peer credentials.
    Process {
        /// Peer pid at connect time.
        pid: u32,
        /// Start time of `pid`: `/proc/<pid>/stat` field 22, clock ticks since boot; read
        /// while the pidfd proved the pid still named the peer. 0 if unknown.
        start_time: u64,
        /// `SO_PEERPIDFD` (Linux 6.5+), shared by every clone of the caller.
        pidfd: Option<PidFd>,
    },
    /// A D-Bus peer, by its unique name on the system bus (e.g. `:1.42`).
    BusName {
        /// Unique bus name of the sender.
        name: String,
        /// The call carried `ALLOW_INTERACTIVE_AUTHORIZATION`: polkit may prompt.
        interactive: bool,
    },
}

/// A process file descriptor, shared; two are equal when they are the same descriptor.
#[derive(Debug, Clone)]
pub struct PidFd(pub Arc<std::os::fd::OwnedFd>);

impl PartialEq for PidFd {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for PidFd {}

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

    /// Leases `uid` itself: the uid of a worker adopted from a previous daemon. `None` when
    /// it is outside the range or leased already.
    pub fn claim(&self, uid: u32) -> Option<UidLease> {
        if uid < self.base || uid - self.base >= self.count {
            return None;
        }
        if !self.used.lock().unwrap().insert(uid) {
            return None;
        }
        Some(UidLease {
            uid,
            used: self.used.clone(),
        })
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
