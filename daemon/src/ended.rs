//! Sessions that ended lately: whose they were, why and when they ended, so that a call naming
//! one answers its owner `SessionEnded` instead of `NoSuchSession`.
//!
//! The store is bounded twice: the newest [`MAX_RECORDS`] ended sessions, each for at most
//! [`MAX_AGE`]; older records are dropped (the id then answers `NoSuchSession`, as one that
//! never existed). A record holds the id as a number, the owner's uid, the reason and the
//! time: about 70 bytes with the map's and queue's overhead, so at most about 300 KiB.
//!
//! Records live in memory. So that a restarted daemon can still tell owners what became of
//! their sessions, every live session also has an empty *owner marker* file
//! `<state_dir>/owners/<id>.<uid>` (created when the session starts, removed when it ends,
//! kept when the daemon stops). At start-up, before the sweep of leftover session cgroups and
//! directories, the new daemon turns the markers it finds into `daemon_restarted` records and
//! removes them. A marker holds no data (its name says everything), so it needs an inode but
//! no block of a full file system.

use sandcell_proto::kernel::{EndReason, KernelError, SessionId};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// Most ended sessions remembered; the oldest record goes first.
pub const MAX_RECORDS: usize = 4096;

/// How long a record is kept after its session ended.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Name of the owner markers' directory under the state directory.
const MARKERS_DIR: &str = "owners";

/// One ended session.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Record {
    /// The owner's uid.
    pub owner: u32,
    /// Why it ended.
    pub reason: EndReason,
    /// When it ended (for `daemon_restarted`: when this daemon found its marker).
    pub ended_at: SystemTime,
}

/// The bounded store of ended sessions.
#[derive(Debug, Default)]
pub struct Ended {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By id (the 128-bit number its 32 hex digits spell).
    records: HashMap<u128, Record>,
    /// Ids in the order they were recorded (oldest first); an id recorded twice appears twice
    /// and only its newest entry is live.
    order: VecDeque<(u128, SystemTime)>,
}

/// The number a session id's 32 hex digits spell; `None` for anything else.
fn key(id: &str) -> Option<u128> {
    SessionId::parse(id).ok()?;
    u128::from_str_radix(id, 16).ok()
}

impl Ended {
    /// Records that session `id` of `owner` ended for `reason` at `ended_at`. An id that is
    /// not a session id is ignored.
    pub fn record(&self, id: &str, owner: u32, reason: EndReason, ended_at: SystemTime) {
        let Some(k) = key(id) else { return };
        let mut inner = self.inner.lock().unwrap();
        inner.records.insert(
            k,
            Record {
                owner,
                reason,
                ended_at,
            },
        );
        inner.order.push_back((k, ended_at));
        inner.prune(SystemTime::now());
    }

    /// The record of `id` that a caller of `uid` may learn: its owner's, or any for root.
    pub fn lookup(&self, id: &str, uid: u32) -> Option<Record> {
        let k = key(id)?;
        let mut inner = self.inner.lock().unwrap();
        inner.prune(SystemTime::now());
        inner
            .records
            .get(&k)
            .copied()
            .filter(|r| r.owner == uid || uid == 0)
    }

    /// Records held now.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().records.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The error for a call of `uid` naming `id`, which is not a live session it may use:
    /// `SessionEnded` when the store has a record `uid` may learn, else `NoSuchSession`.
    /// `echo` is the id as echoed back (cut when a client sent something long).
    pub fn error_for(&self, id: &str, uid: u32, echo: String) -> KernelError {
        match self.lookup(id, uid) {
            Some(r) => KernelError::SessionEnded {
                session: echo,
                reason: r.reason.as_str().into(),
                ended_at: r
                    .ended_at
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
            },
            None => KernelError::NoSuchSession { session: echo },
        }
    }
}

impl Inner {
    /// Drops records past [`MAX_RECORDS`] or older than [`MAX_AGE`], and queue entries of ids
    /// recorded again since.
    fn prune(&mut self, now: SystemTime) {
        while let Some(&(k, at)) = self.order.front() {
            let old = now.duration_since(at).is_ok_and(|age| age > MAX_AGE);
            let over = self.order.len() > MAX_RECORDS;
            if !(old || over) {
                break;
            }
            self.order.pop_front();
            // Only the newest entry of an id removes its record.
            if self.records.get(&k).is_some_and(|r| r.ended_at == at)
                && !self.order.iter().any(|&(k2, _)| k2 == k)
            {
                self.records.remove(&k);
            }
        }
    }
}

/// `<state_dir>/owners`.
pub fn markers_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(MARKERS_DIR)
}

fn marker(state_dir: &Path, id: &str, owner: u32) -> PathBuf {
    markers_dir(state_dir).join(format!("{id}.{owner}"))
}

/// Creates the owner marker of session `id` of `owner` (an empty file, mode 0600). A failure
/// is logged: the session runs anyway, only a restart would not report it.
pub fn mark(state_dir: &Path, id: &str, owner: u32) {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = markers_dir(state_dir);
    let made = std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&dir)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(marker(state_dir, id, owner))
                .map(drop)
        });
    if let Err(e) = made {
        tracing::warn!(session = id, error = %e, "writing the session's owner marker");
    }
}

/// Removes the owner marker of session `id` of `owner`.
pub fn unmark(state_dir: &Path, id: &str, owner: u32) {
    match std::fs::remove_file(marker(state_dir, id, owner)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(session = id, error = %e, "removing the session's owner marker"),
    }
}

/// The sessions a previous daemon left markers of, as (id, owner), at most [`MAX_RECORDS`]
/// of them; every marker is removed. Names that are not `<session id>.<uid>` are removed and
/// skipped. Called at start-up, before the sweep.
pub fn take_markers(state_dir: &Path) -> Vec<(String, u32)> {
    let dir = markers_dir(state_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let parsed = name.to_str().and_then(|n| {
            let (id, uid) = n.split_once('.')?;
            SessionId::parse(id).ok()?;
            Some((id.to_owned(), uid.parse::<u32>().ok()?))
        });
        if let Some(p) = parsed
            && found.len() < MAX_RECORDS
        {
            found.push(p);
        }
        if let Err(err) = std::fs::remove_file(e.path()) {
            tracing::warn!(path = %e.path().display(), error = %err, "removing a stale owner marker");
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> String {
        format!("{n:032x}")
    }

    #[test]
    fn only_the_owner_and_root_learn_the_reason() {
        let e = Ended::default();
        let now = SystemTime::now();
        e.record(&id(1), 1000, EndReason::Closed, now);
        assert_eq!(e.lookup(&id(1), 1000).unwrap().reason, EndReason::Closed);
        assert!(e.lookup(&id(1), 0).is_some());
        assert!(e.lookup(&id(1), 1001).is_none());
        assert!(e.lookup(&id(2), 1000).is_none());
        assert!(e.lookup("not an id", 0).is_none());
        match e.error_for(&id(1), 1001, id(1)) {
            KernelError::NoSuchSession { session } => assert_eq!(session, id(1)),
            other => panic!("{other:?}"),
        }
        match e.error_for(&id(1), 1000, id(1)) {
            KernelError::SessionEnded { reason, .. } => assert_eq!(reason, "closed"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_store_keeps_the_newest_records_within_the_age() {
        let e = Ended::default();
        let now = SystemTime::now();
        for n in 0..(MAX_RECORDS as u128 + 10) {
            e.record(&id(n), 1, EndReason::Closed, now);
        }
        assert_eq!(e.len(), MAX_RECORDS);
        assert!(e.lookup(&id(9), 1).is_none(), "the oldest went first");
        assert!(e.lookup(&id(10), 1).is_some());
        let old = now - MAX_AGE - Duration::from_secs(1);
        let e = Ended::default();
        e.record(&id(1), 1, EndReason::Oom, old);
        e.record(&id(2), 1, EndReason::Oom, now);
        assert!(e.lookup(&id(1), 1).is_none(), "past the age");
        assert_eq!(e.len(), 1);
        // An id recorded again keeps its newest record.
        e.record(&id(2), 1, EndReason::Killed, now);
        assert_eq!(e.lookup(&id(2), 1).unwrap().reason, EndReason::Killed);
    }

    #[test]
    fn markers_survive_until_taken() {
        let dir = tempfile::tempdir().unwrap();
        mark(dir.path(), &id(7), 1000);
        mark(dir.path(), &id(8), 1001);
        unmark(dir.path(), &id(8), 1001);
        std::fs::write(markers_dir(dir.path()).join("junk"), "").unwrap();
        let taken = take_markers(dir.path());
        assert_eq!(taken, vec![(id(7), 1000)]);
        assert_eq!(
            std::fs::read_dir(markers_dir(dir.path())).unwrap().count(),
            0
        );
    }
}
