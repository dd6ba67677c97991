//! Per-stage timings of a request's path through the daemon (a `Run`, a cell, a session's
//! end), logged as one debug line each under the `sandcelld::timing` target: enable them
//! with `SANDCELL_LOG=info,sandcelld::timing=debug`. A line reads
//! `stages="authorize=12 admission=3 take=5 …" total_us=…`: microseconds spent in each stage
//! since the previous mark, in order. Taking a mark is one `Instant::now()` and a push onto a
//! vector of at most [`MAX_MARKS`] entries (later marks are dropped), so the timings cost
//! nothing measurable when the target is off.

use std::fmt::Write as _;
use std::time::Instant;

/// Marks kept per [`Stages`]; more are dropped (a loop that marks cannot grow it).
pub const MAX_MARKS: usize = 24;

/// The target of the timing lines.
pub const TARGET: &str = "sandcelld::timing";

/// Stage timings since a start: [`Stages::mark`] records the time since the previous mark
/// under a name.
#[derive(Debug, Clone)]
pub struct Stages {
    start: Instant,
    last: Instant,
    marks: Vec<(&'static str, u64)>,
}

impl Default for Stages {
    fn default() -> Self {
        Self::new()
    }
}

impl Stages {
    /// Starts timing now.
    pub fn new() -> Stages {
        let now = Instant::now();
        Stages {
            start: now,
            last: now,
            marks: Vec::new(),
        }
    }

    /// Whether the timing lines are enabled (marks can be skipped when not).
    pub fn enabled() -> bool {
        tracing::enabled!(target: TARGET, tracing::Level::DEBUG)
    }

    /// Ends stage `name` now: the microseconds since the previous mark (or the start).
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        if self.marks.len() < MAX_MARKS {
            let us = now.saturating_duration_since(self.last).as_micros() as u64;
            self.marks.push((name, us));
        }
        self.last = now;
    }

    /// Microseconds from the start to the last mark.
    pub fn total_us(&self) -> u64 {
        self.last.saturating_duration_since(self.start).as_micros() as u64
    }

    /// The marks as `name=us name=us …`.
    pub fn line(&self) -> String {
        let mut s = String::new();
        for (i, (name, us)) in self.marks.iter().enumerate() {
            if i > 0 {
                s.push(' ');
            }
            let _ = write!(s, "{name}={us}");
        }
        s
    }

    /// Logs the stages of the daemon's own start (`what="daemon_start"`), first system bus
    /// connection (`"bus"`) or exit keeping sessions (`"daemon_stop"`) at info level (a line or
    /// three per daemon: they say where a restart's gap went), with `monotonic_us`:
    /// `CLOCK_MONOTONIC` at [`Stages::new`], microseconds, the clock of systemd's
    /// `ExecMainStartTimestampMonotonic` (the fork of the main process) and of
    /// `journalctl -o short-monotonic`, so that a start's time before `main` (the unit's
    /// sandbox set-up, the exec) is the difference of the two.
    pub fn log_daemon(&self, what: &'static str, monotonic_us: u64) {
        tracing::info!(
            target: TARGET,
            what,
            monotonic_us,
            stages = %self.line(),
            total_us = self.total_us(),
            "stages"
        );
    }

    /// Logs the stages of `what` (e.g. `"run"`, `"cell"`) of `session` at debug level.
    pub fn log(&self, what: &'static str, session: &str) {
        tracing::debug!(
            target: TARGET,
            session,
            what,
            stages = %self.line(),
            total_us = self.total_us(),
            "stages"
        );
    }
}

/// `CLOCK_MONOTONIC` now, microseconds (0 if the clock cannot be read).
pub fn monotonic_us() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1_000)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_in_order_and_bounded() {
        let mut s = Stages::new();
        std::thread::sleep(std::time::Duration::from_millis(2));
        s.mark("a");
        s.mark("b");
        for _ in 0..100 {
            s.mark("c");
        }
        let line = s.line();
        assert!(line.starts_with("a="), "{line}");
        let a: u64 = line["a=".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(a >= 2000, "the first stage took the sleep: {line}");
        assert_eq!(line.split(' ').count(), MAX_MARKS, "{line}");
        assert!(s.total_us() >= a);
    }
}
