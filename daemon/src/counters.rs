//! The daemon-wide counters since start: cells finished by status, sessions opened and ended,
//! workers OOM-killed. The session actor and the core count; the metrics file reads them.

use sandcell_proto::kernel::Status;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters since the daemon started (process-wide: one daemon per process).
#[derive(Debug, Default)]
pub struct Counters {
    cells: [AtomicU64; Status::ALL.len()],
    sessions_opened: AtomicU64,
    sessions_ended: AtomicU64,
    oom_kills: AtomicU64,
}

/// The daemon's counters.
pub fn counters() -> &'static Counters {
    static C: OnceLock<Counters> = OnceLock::new();
    C.get_or_init(Counters::default)
}

impl Counters {
    /// A cell finished with `status`.
    pub fn cell_finished(&self, status: Status) {
        self.cells[status as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A session is ready (one-shot runs and readiness probes included).
    pub fn session_opened(&self) {
        self.sessions_opened.fetch_add(1, Ordering::Relaxed);
    }

    /// A session ended and released everything.
    pub fn session_ended(&self) {
        self.sessions_ended.fetch_add(1, Ordering::Relaxed);
    }

    /// The kernel OOM-killed a worker.
    pub fn oom_killed(&self) {
        self.oom_kills.fetch_add(1, Ordering::Relaxed);
    }

    /// Cells finished with `status` since start.
    pub fn cells(&self, status: Status) -> u64 {
        self.cells[status as usize].load(Ordering::Relaxed)
    }

    /// Sessions opened since start.
    pub fn sessions_opened(&self) -> u64 {
        self.sessions_opened.load(Ordering::Relaxed)
    }

    /// Sessions ended since start.
    pub fn sessions_ended(&self) -> u64 {
        self.sessions_ended.load(Ordering::Relaxed)
    }

    /// Workers OOM-killed since start.
    pub fn oom_kills(&self) -> u64 {
        self.oom_kills.load(Ordering::Relaxed)
    }
}
