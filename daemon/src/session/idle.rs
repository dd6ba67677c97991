//! The idle watch: what an idle session's actor waits for besides commands and its worker's
//! exit. A detached (or adopted) session ends after its idle time without a cell; and the
//! session directory is totalled every [`DISK_IDLE_WATCH`], since threads a cell left in a
//! native worker can write on after it, so an idle session over its disk budget ends as an
//! over-budget cell ends it.

use super::*;

/// The disk watch between cells: a cell's Python threads (native worker) run on after it,
/// and can write, so an idle session's directory is totalled too, this long after the
/// previous walk ended (or [`DISK_WATCH_FACTOR`] times that walk's duration, when longer:
/// the same cost bound as during a cell). One walk per interval per idle session, never two
/// at once; what a writer adds within one interval is the overshoot before the session ends.
pub(super) const DISK_IDLE_WATCH: Duration = Duration::from_secs(1);

impl Actor {
    /// When the idle session ends unless a cell or a command comes first: its last activity
    /// plus its detached (or adopted) idle time; `None` when it does not expire while idle.
    pub(super) fn idle_deadline(&self) -> Option<tokio::time::Instant> {
        self.session
            .detached_idle
            .or(self.session.adopted_idle)
            .map(|d| {
                let last = self.session.info.lock().unwrap().last_activity;
                tokio::time::Instant::from_std(last + d)
            })
    }

    /// Starts a total of the idle session's directory on the blocking pool (its result comes
    /// to [`Actor::on_idle_disk_usage`]).
    pub(super) fn start_idle_disk_scan(&mut self) {
        let dir = self.session.dir.clone();
        self.disk_scan = Some((
            Instant::now(),
            tokio::task::spawn_blocking(move || disk_usage(&dir)),
        ));
    }

    /// A total of the session directory taken between cells finished: over the budget (bytes
    /// or entries), the session ends as an over-budget cell ends it (`disk_quota`; the
    /// shutdown kills and reaps the worker, with any thread of it still writing, and removes
    /// the directory); otherwise the next walk is due [`DISK_IDLE_WATCH`] later, or
    /// [`DISK_WATCH_FACTOR`] times this walk's duration when that is longer.
    pub(super) fn on_idle_disk_usage(&mut self, (bytes, took): (u64, Duration)) -> Option<Ending> {
        if let Some(why) = over_disk_budget(bytes, self.session.limits.files_bytes) {
            tracing::warn!(session = %self.session.id, reason = %why, "disk budget exceeded between cells");
            return Some(Ending::new(
                EndReason::DiskQuota,
                format!("{why} (between cells)"),
            ));
        }
        self.disk_next =
            tokio::time::Instant::now() + (took * DISK_WATCH_FACTOR).max(DISK_IDLE_WATCH);
        None
    }
}
