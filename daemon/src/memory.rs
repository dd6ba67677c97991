//! The daemon's own memory bound, derived from its caps (sandcelld(8), "MEMORY").
//!
//! The daemon's memory group (`supervisor`: v2 `memory.max` / `memory.high`, v1
//! `memory.limit_in_bytes` / `memory.memsw.limit_in_bytes` / `memory.soft_limit_in_bytes`) is
//! set from the configuration, never the other way round:
//!
//! ```text
//! max = BASELINE_BYTES
//!     + max_connections x (CONNECTION_USER_BYTES + CONNECTION_KERNEL_BYTES)
//!     + REPLY_BYTES + READ_AHEAD_BYTES + DAEMON_RETAINED_BYTES
//!     + max_concurrent_sessions x SESSION_BYTES
//! high = max x 3 / 4
//! ```
//!
//! Every term is a bound the daemon enforces: connections by `daemon.max_connections`, the
//! bytes a connection holds beyond its fixed share by the reply budget (`Writer::send` in
//! varlink/socket.rs), client bytes buffered beyond a connection's first read chunk by the
//! read-ahead budget, retained cell output by the retention budget (cells.rs), and each
//! session's relay by its bounded queues. One uid's share is the same sum over its own caps
//! (`max_connections_per_uid`, `reply_bytes_per_uid`, `max_sessions_per_uid`, its retention):
//! each term at most the daemon-wide one, so no uid's share reaches the limit, and the shares
//! of all uids together are bounded by the daemon-wide terms. A configuration whose sum does
//! not fit under `daemon.memory_max_bytes` (when set) or the machine's memory is refused at
//! start (exit 78), naming the keys.

/// Memory of the daemon with no client, bytes: the runtime, its thread stacks, the
/// configuration, logging and D-Bus, with room (an idle daemon's group measured about 10 MiB).
pub const BASELINE_BYTES: u64 = 64 * 1024 * 1024;

/// User-space memory one connection may hold outside the reply and read-ahead budgets, bytes:
/// its read buffer (up to 128 KiB of capacity below the read-ahead threshold), the first
/// 64 KiB of the one message read ahead and of the one being answered (as bytes, then
/// parsed), its two tasks, and one small reply (at most 4 KiB, never refused).
pub const CONNECTION_USER_BYTES: u64 = 320 * 1024;

/// `SO_SNDBUF` asked for every accepted connection, bytes; the kernel doubles it (socket(7)).
pub const SEND_BUFFER_BYTES: u64 = 16 * 1024;

/// Kernel memory one connection's send queue can hold, bytes: twice [`SEND_BUFFER_BYTES`]
/// (the kernel's doubling), plus one more socket buffer of up to half that, which a Unix
/// stream `sendmsg` may queue once the queue is just under the limit (`net/unix/af_unix.c`),
/// plus per-buffer overhead, rounded up: 64 KiB (measured: 34 KiB). Charged to the reply
/// budgets while queued, whatever its size.
pub const SEND_QUEUE_BOUND: u64 = 4 * SEND_BUFFER_BYTES;

/// Kernel memory of one connection besides its send queue (the socket pair's structures, the
/// peer's pidfd), rounded up, bytes.
pub const CONNECTION_SOCKET_BYTES: u64 = 4 * 1024;

/// Kernel memory one connection holds in the daemon's group, bytes.
pub const CONNECTION_KERNEL_BYTES: u64 = SEND_QUEUE_BOUND + CONNECTION_SOCKET_BYTES;

/// Daemon-wide reply budget (`daemon_reply_bytes`), bytes: replies being written and the
/// connections' send queues.
pub const REPLY_BYTES: u64 = 64 * 1024 * 1024;

/// Share of [`REPLY_BYTES`] one uid may hold (`reply_bytes_per_uid`), bytes: a quarter, so one
/// uid that stops reading leaves room for others.
pub const REPLY_BYTES_PER_UID: u64 = 16 * 1024 * 1024;

/// Daemon-wide budget of client bytes buffered beyond each connection's first read chunk,
/// bytes (16 messages of the largest size).
pub const READ_AHEAD_BYTES: u64 = 64 * 1024 * 1024;

/// Memory of one live session in the daemon outside the retention budget, bytes: the worker's
/// reply line being read and decoded (at most 1 MiB each), its frame queues (64 + 16 frames of
/// at most 64 KiB of text), and its actor. A warm pool worker is a session here too: it holds
/// one of `max_concurrent_sessions` from its start (its admission permit), so the pools need
/// no term of their own.
pub const SESSION_BYTES: u64 = 8 * 1024 * 1024;

/// The caps the bound follows from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// `daemon.max_connections`.
    pub max_connections: u64,
    /// `daemon.max_connections_per_uid`.
    pub max_connections_per_uid: u64,
    /// `limits.max_concurrent_sessions`.
    pub max_concurrent_sessions: u64,
    /// `limits.max_sessions_per_uid` (derived when unset).
    pub max_sessions_per_uid: u64,
    /// `daemon.memory_max_bytes`: 0 = no ceiling besides the machine's memory.
    pub memory_max_bytes: u64,
}

/// The daemon's memory bound and its terms, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// [`BASELINE_BYTES`].
    pub baseline: u64,
    /// `max_connections x (CONNECTION_USER_BYTES + CONNECTION_KERNEL_BYTES)`.
    pub connections: u64,
    /// [`REPLY_BYTES`] + [`READ_AHEAD_BYTES`] + the retention budget.
    pub budgets: u64,
    /// `max_concurrent_sessions x SESSION_BYTES`.
    pub sessions: u64,
    /// The sum: `memory.max` (v2), `memory.limit_in_bytes` and `memory.memsw.limit_in_bytes`
    /// (v1) of the daemon's group.
    pub max: u64,
    /// Three quarters of `max`: `memory.high` (v2), `memory.soft_limit_in_bytes` (v1).
    pub high: u64,
    /// One uid's share: the same sum over its own caps (always below `max`).
    pub per_uid: u64,
}

/// One connection's bound, bytes.
pub const CONNECTION_BYTES: u64 = CONNECTION_USER_BYTES + CONNECTION_KERNEL_BYTES;

impl Bound {
    /// The bound that `caps` imply (saturating: absurd caps give `u64::MAX`, refused by
    /// [`Bound::check`]).
    pub fn derive(caps: &Caps) -> Bound {
        let retained = sandcell_proto::kernel::DAEMON_RETAINED_BYTES;
        let connections = caps.max_connections.saturating_mul(CONNECTION_BYTES);
        let budgets = REPLY_BYTES + READ_AHEAD_BYTES + retained;
        let sessions = caps.max_concurrent_sessions.saturating_mul(SESSION_BYTES);
        let max = BASELINE_BYTES
            .saturating_add(connections)
            .saturating_add(budgets)
            .saturating_add(sessions);
        // A uid's retention is its sessions' budgets, at most the daemon-wide one.
        let uid_retained = caps
            .max_sessions_per_uid
            .saturating_mul(sandcell_proto::kernel::SESSION_RETAINED_BYTES)
            .min(retained);
        let per_uid = BASELINE_BYTES
            .saturating_add(
                caps.max_connections_per_uid
                    .saturating_mul(CONNECTION_BYTES),
            )
            .saturating_add(REPLY_BYTES_PER_UID + READ_AHEAD_BYTES + uid_retained)
            .saturating_add(caps.max_sessions_per_uid.saturating_mul(SESSION_BYTES));
        Bound {
            baseline: BASELINE_BYTES,
            connections,
            budgets,
            sessions,
            max,
            high: max / 4 * 3,
            per_uid,
        }
    }

    /// Refuses a bound that cannot be given: above `daemon.memory_max_bytes` when set, or
    /// above `machine_bytes` (the machine's memory, `MemTotal` of proc(5) meminfo, when
    /// known). Errors: the key to change and why, naming the caps the bound follows from.
    pub fn check(
        &self,
        caps: &Caps,
        machine_bytes: Option<u64>,
    ) -> Result<(), (&'static str, String)> {
        let terms = format!(
            "{} bytes = {} baseline + max_connections ({}) x {} per connection + {} of \
             reply, read-ahead and retention budgets + max_concurrent_sessions ({}) x {} per \
             session",
            self.max,
            self.baseline,
            caps.max_connections,
            CONNECTION_BYTES,
            self.budgets,
            caps.max_concurrent_sessions,
            SESSION_BYTES
        );
        if caps.memory_max_bytes != 0 && self.max > caps.memory_max_bytes {
            return Err((
                "memory_max_bytes",
                format!(
                    "the daemon's caps need {terms}, above memory_max_bytes ({}): lower \
                     max_connections or max_concurrent_sessions, or raise memory_max_bytes",
                    caps.memory_max_bytes
                ),
            ));
        }
        if let Some(m) = machine_bytes
            && self.max > m
        {
            return Err((
                "max_connections",
                format!(
                    "the daemon's caps need {terms}, above the machine's memory ({m} bytes): \
                     lower max_connections or max_concurrent_sessions"
                ),
            ));
        }
        Ok(())
    }
}

/// The machine's memory, bytes (`MemTotal` of /proc/meminfo, proc(5)); `None` when unknown.
pub fn machine_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(connections: u64, sessions: u64) -> Caps {
        Caps {
            max_connections: connections,
            max_connections_per_uid: connections / 4,
            max_concurrent_sessions: sessions,
            max_sessions_per_uid: sessions - sessions / 4,
            memory_max_bytes: 0,
        }
    }

    #[test]
    fn the_bound_follows_the_caps_and_holds_every_uid_share() {
        let d = Bound::derive(&caps(1024, 16));
        assert_eq!(
            d.max,
            BASELINE_BYTES
                + 1024 * CONNECTION_BYTES
                + REPLY_BYTES
                + READ_AHEAD_BYTES
                + sandcell_proto::kernel::DAEMON_RETAINED_BYTES
                + 16 * SESSION_BYTES
        );
        assert!(d.per_uid < d.max);
        assert!(d.high < d.max);
        let small = Bound::derive(&caps(64, 4));
        assert!(small.max < d.max);
        // Absurd caps saturate and are refused.
        let huge = Bound::derive(&caps(u64::MAX / 2, 16));
        assert_eq!(huge.max, u64::MAX);
        assert!(huge.check(&caps(u64::MAX / 2, 16), Some(1 << 40)).is_err());
    }

    #[test]
    fn a_ceiling_below_the_bound_is_refused_naming_the_keys() {
        let mut c = caps(1024, 16);
        c.memory_max_bytes = 256 * 1024 * 1024;
        let (key, reason) = Bound::derive(&c).check(&c, None).unwrap_err();
        assert_eq!(key, "memory_max_bytes");
        assert!(reason.contains("max_connections (1024)"), "{reason}");
        assert!(reason.contains("max_concurrent_sessions (16)"), "{reason}");
        c.memory_max_bytes = Bound::derive(&c).max;
        assert!(Bound::derive(&c).check(&c, None).is_ok());
        let c = caps(1024, 16);
        let (key, _) = Bound::derive(&c).check(&c, Some(128 << 20)).unwrap_err();
        assert_eq!(key, "max_connections");
    }
}
