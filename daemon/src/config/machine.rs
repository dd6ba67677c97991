//! The defaults derived from the machine: [`Machine`] (online CPUs, `MemTotal`), the
//! daemon-wide and per-uid budgets [`Limits::for_machine`] computes from it, and the warm
//! pool sizes [`pool_sizes`] derives from those budgets.

use super::Limits;

/// Facts about the machine the defaults are derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// Online CPUs.
    pub cpus: u64,
    /// `MemTotal` of /proc/meminfo, bytes.
    pub memory: u64,
}

impl Machine {
    /// This machine (1 CPU and 4 GiB when they cannot be read).
    pub fn detect() -> Machine {
        // SAFETY: sysconf has no preconditions.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u64;
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            })
            .map(|kib| kib * 1024)
            .unwrap_or(4 << 30);
        Machine { cpus, memory }
    }
}

pub(super) const GIB: u64 = 1 << 30;

pub(super) const MIB: u64 = 1 << 20;

/// `total - max(one, total / 4)`, but at least `one` (a uid can always have one session).
fn share(total: u64, one: u64) -> u64 {
    total.saturating_sub(one.max(total / 4)).max(one.min(total))
}

/// Online CPUs (sysconf(3) `_SC_NPROCESSORS_ONLN`, at least 1).
pub fn online_cpus() -> u64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u64
}

/// The warm pool sizes `(min, max)` of `n` environments whose sizes the operator left unset,
/// in priority order (the first `defaults` are the languages' default environments, Python
/// before R; then the shipped `pydata`), from the budgets in `limits`, `cpus`, and `sized`,
/// the maxima the operator set for other pools:
///
/// ```text
/// share = min(max_concurrent_sessions / 4,
///             max_aggregate_worker_memory_bytes / 4 / max_worker_memory_bytes)
/// warm  = max(defaults, share - sized)         total warm workers these pools may hold
/// min   = 1 for the first `warm` environments, 0 for the rest
/// max   = min, plus one more for each environment in turn while the sum of the maxima is
///         below `warm` and the extra ones number fewer than `cpus`
/// ```
///
/// So the pools hold at most the quarter of the session and worker-memory budgets that the
/// per-uid quotas keep from any one tenant (`max_sessions_per_uid` is the total less a
/// quarter), but always one warm worker per default environment; the extra workers a pool
/// grows to while being taken are at most one per CPU (starting them costs CPU). Every warm
/// worker is a session of the admission budgets, inside `max_concurrent_sessions`, and a
/// refill that would take the last free session or the last worker's memory is refused
/// (see `crate::admission::Admission::try_admit_leaving_room`).
pub fn pool_sizes(
    limits: &Limits,
    cpus: u64,
    defaults: usize,
    n: usize,
    sized: usize,
) -> Vec<(usize, usize)> {
    let per_worker = limits.max_worker_memory_bytes.max(1);
    let share = (limits.max_concurrent_sessions / 4)
        .min(limits.max_aggregate_worker_memory_bytes / 4 / per_worker);
    let warm = usize::try_from(share)
        .unwrap_or(usize::MAX)
        .saturating_sub(sized)
        .max(defaults);
    let mut out: Vec<(usize, usize)> = (0..n)
        .map(|i| (usize::from(i < warm), usize::from(i < warm)))
        .collect();
    let mut total = out.iter().map(|s| s.1).sum::<usize>();
    let mut extra = 0u64;
    while total < warm && extra < cpus {
        let before = total;
        for s in out.iter_mut().filter(|s| s.0 > 0) {
            if total >= warm || extra >= cpus {
                break;
            }
            s.1 += 1;
            total += 1;
            extra += 1;
        }
        if total == before {
            break;
        }
    }
    out
}

impl Limits {
    /// The defaults for `m`: per-cell limits fixed, daemon-wide budgets derived from the
    /// machine so that one gateway alone can use most of it:
    /// worker memory W = max(3/4 of MemTotal, 2 GiB) rounded down to a MiB,
    /// sessions = clamp(min(8 x CPUs, W / 1 GiB), 2, 1024), guest memory = sessions x 128 MiB.
    pub fn for_machine(m: Machine) -> Limits {
        let worker_memory = (m.memory / 4 * 3).max(2 * GIB) / MIB * MIB;
        let sessions = (m.cpus * 8).min(worker_memory / GIB).clamp(2, 1024);
        Limits {
            max_source_bytes: 65_536,
            execution_wall_time_seconds: 10.0,
            max_fuel: 10_000_000_000,
            max_guest_memory_bytes: 128 * MIB,
            max_stdout_bytes: 65_536,
            max_stderr_bytes: 65_536,
            max_concurrent_sessions: sessions,
            max_aggregate_guest_memory_bytes: sessions * 128 * MIB,
            max_worker_memory_bytes: GIB,
            max_aggregate_worker_memory_bytes: worker_memory,
            max_file_bytes: 64 * MIB,
            max_session_files_bytes: 256 * MIB,
            max_sessions_per_uid: None,
            max_detached_sessions_per_uid: None,
            max_guest_memory_bytes_per_uid: None,
            max_worker_memory_bytes_per_uid: None,
            max_detached_idle_seconds: 86_400,
            max_starts_per_second_per_uid: 20.0,
            max_start_burst_per_uid: 40,
        }
    }

    /// Sessions of one uid: the key, or the total less a quarter (at least 1 left for others).
    pub fn sessions_per_uid(&self) -> u64 {
        self.max_sessions_per_uid.unwrap_or_else(|| {
            let t = self.max_concurrent_sessions;
            if t <= 1 { t } else { t - (t / 4).max(1) }
        })
    }

    /// Detached sessions of one uid.
    pub fn detached_per_uid(&self) -> u64 {
        self.max_detached_sessions_per_uid
            .unwrap_or_else(|| (self.sessions_per_uid() / 2).max(1))
    }

    /// Guest memory of one uid, bytes.
    pub fn guest_memory_per_uid(&self) -> u64 {
        self.max_guest_memory_bytes_per_uid.unwrap_or_else(|| {
            share(
                self.max_aggregate_guest_memory_bytes,
                self.max_guest_memory_bytes,
            )
        })
    }

    /// Worker memory of one uid, bytes.
    pub fn worker_memory_per_uid(&self) -> u64 {
        self.max_worker_memory_bytes_per_uid.unwrap_or_else(|| {
            share(
                self.max_aggregate_worker_memory_bytes,
                self.max_worker_memory_bytes,
            )
        })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::for_machine(Machine::detect())
    }
}
