//! Adoption at start: the sessions a previous daemon kept (sandcelld(8), ADOPTION).
//!
//! In two steps around the start-up sweep. [`collect`], before anything is swept: every
//! record in `adopt_dir` is read, its keeper asked for the descriptors and what it hands over
//! checked against the record (`session::connect_keeper`). The ids that pass are spared by the
//! sweep of stale cgroups, session file systems and session directories. [`finish`], once the
//! core exists: each is adopted (`Core::adopt`: admission, uid, cgroup, actor); what fails
//! there has its group killed and removed. Every session that is not adopted is recorded as
//! ended, `daemon_restarted` (its keeper is gone, or a cell was running) or
//! `adoption_refused` (its record did not match the live processes, or it could not be taken
//! over), so its owner learns what became of it.

use crate::cgroup::Backend;
use crate::core::Core;
use crate::session::{Adoptable, NotAdopted};
use sandcell_proto::kernel::EndReason;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

/// What [`collect`] found.
#[derive(Debug, Default)]
pub struct Found {
    /// Sessions ready to adopt.
    pub adoptable: Vec<Adoptable>,
    /// Sessions not adopted: id, owner uid, reason, why.
    pub not_adopted: Vec<(String, u32, EndReason, String)>,
}

impl Found {
    /// The ids the start-up sweep must spare.
    pub fn keep_ids(&self) -> Vec<String> {
        self.adoptable.iter().map(|a| a.record.id.clone()).collect()
    }

    /// Whether `id` had a record (adoptable or not).
    pub fn knows(&self, id: &str) -> bool {
        self.adoptable.iter().any(|a| a.record.id == id)
            || self.not_adopted.iter().any(|n| n.0 == id)
    }
}

/// How long a starting daemon asks for `<adopt_dir>/lock` before it concludes that another
/// live daemon holds it: 5 s. A daemon killed (SIGKILL, or a crash) while it forked a child
/// (a worker or keeper between fork(2) and exec(2)) leaves the lock held by that child until
/// its exec closes the close-on-exec descriptor; refusing at once would end every session.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads the records in `dir` (made root-only if missing) and connects to their keepers.
/// Records of sessions not adopted are removed.
///
/// Errors: the directory cannot be made, or another live daemon holds it (its lock
/// `<dir>/lock`, held for the daemon's life: one daemon instance per `adopt_dir`; asked for
/// [`LOCK_WAIT`]).
pub fn collect(dir: &Path) -> std::io::Result<Found> {
    crate::records::prepare(dir)?;
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("lock"))?;
    let t0 = std::time::Instant::now();
    let mut lock = lock;
    loop {
        match nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            // Held until this process exits (the descriptor is close-on-exec: no worker or
            // keeper keeps it).
            Ok(held) => {
                std::mem::forget(held);
                if t0.elapsed() >= std::time::Duration::from_millis(20) {
                    tracing::info!(
                        waited_ms = t0.elapsed().as_millis() as u64,
                        "the adoption lock was still held (by a child the previous daemon forked) and is taken now"
                    );
                }
                break;
            }
            // A predecessor killed while it forked a child still holds the lock through that
            // child until the child's exec(2) closes it: asked again for a while.
            Err((file, nix::errno::Errno::EAGAIN)) if t0.elapsed() < LOCK_WAIT => {
                lock = file;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err((_, e)) => {
                return Err(std::io::Error::other(format!(
                    "another daemon holds {}: {e}",
                    dir.join("lock").display()
                )));
            }
        }
    }
    let mut found = Found::default();
    let mut readable = Vec::new();
    for (id, record) in crate::records::read_all(dir) {
        match record {
            Ok(r) => readable.push(r),
            Err(why) => {
                tracing::warn!(session = %id, why, "session record unreadable: not adopted");
                crate::records::remove(dir, &id);
            }
        }
    }
    for (id, owner, checked) in connect_keepers(dir, readable) {
        match checked {
            Ok(a) => found.adoptable.push(a),
            Err(NotAdopted::Gone(why)) => {
                tracing::warn!(session = %id, why, "session of the previous daemon not adopted (daemon_restarted)");
                crate::records::remove(dir, &id);
                found
                    .not_adopted
                    .push((id, owner, EndReason::DaemonRestarted, why));
            }
            Err(NotAdopted::Refused(why)) => {
                tracing::warn!(session = %id, why, "session record does not match the live processes: not adopted (adoption_refused)");
                crate::records::remove(dir, &id);
                found
                    .not_adopted
                    .push((id, owner, EndReason::AdoptionRefused, why));
            }
        }
    }
    // Sockets of keepers without a record (their session ended meanwhile) go too.
    if let Ok(entries) = std::fs::read_dir(crate::records::keepers_dir(dir)) {
        for e in entries.flatten() {
            let name = e.file_name();
            let id = name.to_string_lossy();
            let id = id.trim_end_matches(".sock");
            if !found.adoptable.iter().any(|a| a.record.id == id) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(found)
}

/// Most keepers [`collect`] asks at once. Each answer is a round trip with a keeper process
/// that must be scheduled to answer, so asking several at a time shortens a restart's start
/// (the returning clients wait for it); bounded, so that thousands of kept sessions do not
/// mean thousands of threads.
pub const COLLECT_THREADS: usize = 8;

/// [`crate::session::connect_keeper`] for every record, on this thread and at most
/// `COLLECT_THREADS - 1` others (fewer when no thread can be had: this one then asks the
/// rest): `(id, owner uid, outcome)` per record, in no particular order.
fn connect_keepers(
    dir: &Path,
    records: Vec<crate::records::Record>,
) -> Vec<(String, u32, Result<Adoptable, NotAdopted>)> {
    let helpers = records.len().min(COLLECT_THREADS).saturating_sub(1);
    let queue = std::sync::Mutex::new(records);
    let done = std::sync::Mutex::new(Vec::new());
    let work = || {
        loop {
            let Some(r) = queue.lock().unwrap().pop() else {
                break;
            };
            let (id, owner) = (r.id.clone(), r.owner_uid);
            let checked = crate::session::connect_keeper(dir, r);
            done.lock().unwrap().push((id, owner, checked));
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            let _ = std::thread::Builder::new()
                .name("adopt-keeper".into())
                .spawn_scoped(scope, work);
        }
        work();
    });
    done.into_inner().unwrap()
}

/// Adopts what [`collect`] found into `core`; records the rest as ended. `previous` are the
/// owner markers of the previous daemon's sessions (recorded `daemon_restarted` unless
/// adopted or refused here). Returns how many sessions were adopted.
pub fn finish(
    core: &Arc<Core>,
    backend: &Arc<dyn Backend>,
    found: Found,
    previous: &[(String, u32)],
) -> usize {
    test_delay();
    let now = SystemTime::now();
    let mut adopted = 0;
    let mut ended = found.not_adopted;
    let rest: Vec<(String, u32)> = previous
        .iter()
        .filter(|(id, _)| {
            !found.adoptable.iter().any(|a| a.record.id == *id) && !ended.iter().any(|n| n.0 == *id)
        })
        .cloned()
        .collect();
    let mut adoptable = found.adoptable;
    adoptable.sort_by_key(|a| std::cmp::Reverse(last_active_ms(&a.record)));
    for a in adoptable {
        let (id, owner) = (a.record.id.clone(), a.record.owner_uid);
        // One timing line per session (`what="adopted"`, debug level): the order the sessions
        // were adopted in and what each took.
        let mut stages = crate::stages::Stages::new();
        let outcome = core.adopt(a);
        stages.mark("adopt");
        stages.log("adopted", &id);
        match outcome {
            Ok(_) => {
                adopted += 1;
                test_step_delay();
            }
            Err(why) => {
                tracing::warn!(session = %id, why, "session not adopted (adoption_refused)");
                // The worker was checked to be the session's own: its group is killed.
                let limits = crate::cgroup::GroupLimits {
                    memory_bytes: 0,
                    max_pids: 0,
                    cpu_max: None,
                };
                if let Ok(g) = backend.adopt(&id, &limits) {
                    let _ = g.kill_all(crate::cgroup::KILL_TIMEOUT);
                    let _ = g.remove();
                }
                let dir = crate::worker::start::sessions_dir(&core.config()).join(&id);
                let _ = crate::session_fs::unmount(&dir);
                let _ = std::fs::remove_dir_all(&dir);
                crate::records::remove(&core.config().daemon.adopt_dir, &id);
                ended.push((id, owner, EndReason::AdoptionRefused, why));
            }
        }
    }
    for (id, owner, reason, _) in &ended {
        core.ended().record(id, *owner, *reason, now);
        crate::ended::unmark(&core.config().daemon.state_dir, id, *owner);
    }
    core.restore_ended(&rest);
    if adopted > 0 || !ended.is_empty() {
        tracing::info!(
            adopted,
            not_adopted = ended.len(),
            "sessions of the previous daemon"
        );
    }
    adopted
}

/// When record `r`'s session was last active, ms since the Unix epoch: its last cell's end
/// (or its open), or the start of the cell it was running if later. [`finish`] adopts the
/// sessions in this order, latest first: a client that was running cells when the daemon went
/// away is the one most likely to be waiting, and its calls wait for its session's adoption
/// only (`varlink::kernel::wait_for_adoption`).
fn last_active_ms(r: &crate::records::Record) -> u64 {
    let running = r.running.as_ref().map_or(0, |c| c.started_unix_ms);
    r.last_activity_unix_ms.max(running)
}

/// A test seam: with `SANDCELL_TEST_ADOPT_STEP_MS=N` in its environment the daemon waits N
/// milliseconds (at most 10 s) after each session it adopts, so that a test sees a call on an
/// adopted session answered while the others are still being adopted.
fn test_step_delay() {
    test_seam_wait(
        "SANDCELL_TEST_ADOPT_STEP_MS",
        "SANDCELL_TEST_ADOPT_STEP_MS: waiting after adopting a session",
    );
}

/// A test seam: with `SANDCELL_TEST_ADOPT_DELAY_MS=N` in its environment the daemon waits N
/// milliseconds (at most 10 s) before it adopts its predecessor's sessions, so that a test
/// connects while the adoption is under way (its calls must wait for the adoption).
fn test_delay() {
    test_seam_wait(
        "SANDCELL_TEST_ADOPT_DELAY_MS",
        "SANDCELL_TEST_ADOPT_DELAY_MS: waiting before the adoption",
    );
}

/// A test seam: with `SANDCELL_TEST_HAND_OVER_DELAY_MS=N` in its environment a daemon that
/// re-executes in place waits N milliseconds (at most 10 s) after handing its sessions over,
/// before the exec, so that a test can send a stop signal during the hand-over.
pub fn test_hand_over_delay() {
    test_seam_wait(
        "SANDCELL_TEST_HAND_OVER_DELAY_MS",
        "SANDCELL_TEST_HAND_OVER_DELAY_MS: waiting after the hand-over, before the exec",
    );
}

/// Sleeps the milliseconds the environment variable `var` gives (at most 10 s), saying `why`
/// in a warning; nothing when it is unset or not a number. Workers and keepers never see
/// these variables (their environments are built from nothing), and the shipped units do not
/// set them.
fn test_seam_wait(var: &str, why: &'static str) {
    let Some(ms) = std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()) else {
        return;
    };
    tracing::warn!(ms, "{why}");
    std::thread::sleep(std::time::Duration::from_millis(ms.min(10_000)));
}

/// The file in `adopt_dir` where a daemon exiting with its sessions kept lists the warm
/// pooled workers it killed without waiting (one session id a line), for its successor.
pub const POOL_KILLED: &str = "pool-killed";

/// Most bytes of [`POOL_KILLED`] read: pools hold tens of workers, 33 bytes a line.
const POOL_KILLED_MAX_BYTES: u64 = 64 * 1024;

/// Writes [`POOL_KILLED`] (the daemon only: `dir` is root's, mode 0700). Failures are logged:
/// the list only tells the successor's log an expected leftover from a surprise.
pub fn note_killed_pool(dir: &Path, ids: &[String]) {
    if ids.is_empty() {
        return;
    }
    let mut text = ids.join("\n");
    text.push('\n');
    if let Err(e) = std::fs::write(dir.join(POOL_KILLED), text) {
        tracing::warn!(dir = %dir.display(), error = %e, "writing the list of killed pooled workers");
    }
}

/// Reads and removes [`POOL_KILLED`]: the session ids of the warm workers a predecessor
/// killed as it exited keeping its sessions (empty when there is no list). At most
/// 64 KiB are read; a line that is not a session id is ignored. The list decides nothing but
/// how the sweep of their groups is logged: every group not adopted is swept either way.
pub fn take_killed_pool(dir: &Path) -> Vec<String> {
    use std::io::Read;
    let path = dir.join(POOL_KILLED);
    let mut text = String::new();
    let read = std::fs::File::open(&path)
        .and_then(|f| f.take(POOL_KILLED_MAX_BYTES).read_to_string(&mut text));
    let _ = std::fs::remove_file(&path);
    if read.is_err() {
        return Vec::new();
    }
    text.lines()
        .filter(|l| sandcell_proto::kernel::SessionId::parse_qualified(l).is_ok())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock held through another open file description (as a child forked by a killed
    /// daemon holds it until its exec) and released 300 ms later: `collect` waits for it
    /// instead of refusing adoption.
    #[test]
    fn a_lock_released_soon_after_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        crate::records::prepare(dir.path()).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.path().join("lock"))
            .unwrap();
        let held = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .unwrap();
        let t0 = std::time::Instant::now();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        });
        let found = collect(dir.path()).expect("the lock is taken once released");
        assert!(t0.elapsed() >= std::time::Duration::from_millis(250));
        assert!(found.adoptable.is_empty());
        release.join().unwrap();
    }
}
