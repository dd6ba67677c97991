//! Rate limits for log lines a client can cause.
//!
//! Every refusal is logged with its caller, but a client that retries in a loop must not turn
//! the journal into its own flood: journald drops a service's messages past its own
//! `RateLimitBurst` (10000 per 30 s by default, journald.conf(5)), and would then drop the
//! lines of every other tenant with them. Per key (a uid), at most [`BURST`] lines per
//! [`WINDOW`] are written; the lines held back are counted, and the next line written says how
//! many were.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines written per key per [`WINDOW`].
pub const BURST: u32 = 10;

/// The window of [`BURST`].
pub const WINDOW: Duration = Duration::from_secs(10);

/// Keys remembered before old windows are forgotten (a bound on the table, not on uids).
const MAX_KEYS: usize = 4096;

/// One rate limit, e.g. for connection refusals.
#[derive(Debug, Default)]
pub struct LogLimit {
    /// Per key: start of its window, lines written in it, lines held back since the last one
    /// written.
    keys: Mutex<HashMap<u32, (Instant, u32, u64)>>,
}

impl LogLimit {
    /// Whether a line for `key` may be written now: `Some(held back before it)` or `None`
    /// (the caller skips the line; it is counted).
    pub fn admit(&self, key: u32) -> Option<u64> {
        self.admit_at(key, Instant::now())
    }

    fn admit_at(&self, key: u32, now: Instant) -> Option<u64> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= MAX_KEYS && !keys.contains_key(&key) {
            keys.retain(|_, (start, _, held)| now.duration_since(*start) < WINDOW || *held > 0);
            if keys.len() >= MAX_KEYS {
                keys.clear();
            }
        }
        let e = keys.entry(key).or_insert((now, 0, 0));
        if now.duration_since(e.0) >= WINDOW {
            e.0 = now;
            e.1 = 0;
        }
        if e.1 < BURST {
            e.1 += 1;
            Some(std::mem::take(&mut e.2))
        } else {
            e.2 += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_window_then_the_count_of_lines_held_back() {
        let l = LogLimit::default();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(l.admit_at(7, t0), Some(0));
        }
        for _ in 0..25 {
            assert_eq!(l.admit_at(7, t0), None);
        }
        // Another key has its own budget.
        assert_eq!(l.admit_at(8, t0), Some(0));
        assert_eq!(l.admit_at(7, t0 + WINDOW), Some(25));
        assert_eq!(l.admit_at(7, t0 + WINDOW), Some(0));
    }
}
