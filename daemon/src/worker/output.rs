//! Host-end output bounding: keep the first N bytes of each stream,
//! count and discard the rest as it arrives, and say exactly how much was seen and kept.
//!
//! The daemon applies this to every byte a worker produces, whether it comes as `Output`
//! frames (Python) or straight from the worker's stdout/stderr pipes (R), so a cell printing
//! 300 MB costs the daemon at most the cap in memory and never touches a disk.

use sandcell_proto::kernel::StreamStats;
use sandcell_proto::text::{escape_lossy, split_incomplete_tail};

/// Bounded accounting of one stream of one cell.
#[derive(Debug)]
pub struct StreamCap {
    cap: u64,
    seen: u64,
    kept: u64,
    /// Bytes of an unfinished UTF-8 character held back from the last chunk (at most 3).
    pending: Vec<u8>,
}

impl StreamCap {
    /// A stream keeping at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Self {
            cap,
            seen: 0,
            kept: 0,
            pending: Vec::new(),
        }
    }

    /// Accounts raw bytes and returns the text to forward, if any. Bytes past the cap are
    /// counted and dropped. A UTF-8 character cut by a read boundary is held until the next
    /// call; one cut by the cap itself is dropped with the bytes past the cap (the kept text
    /// ends on a character boundary, and `kept` does not count the cut character's bytes).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Option<String> {
        self.seen = self.seen.saturating_add(bytes.len() as u64);
        let room = self.cap.saturating_sub(self.kept);
        if room == 0 {
            return None;
        }
        let take = (bytes.len() as u64).min(room) as usize;
        self.kept += take as u64;
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(&bytes[..take]);
        let at_cap = self.kept == self.cap;
        let (complete, tail) = split_incomplete_tail(&buf);
        let text = escape_lossy(complete);
        if at_cap {
            // Nothing more of this stream is kept: the unfinished character never completes.
            // Setting `kept` past the cap's reach keeps later bytes out as well.
            self.kept -= tail.len() as u64;
            self.cap = self.kept;
        } else {
            self.pending = tail.to_vec();
        }
        (!text.is_empty()).then_some(text)
    }

    /// Accounts text that a worker already converted (`Output` frames) and returns the part
    /// to forward. What counts is the bytes of `text` the daemon received, never a length the
    /// worker declares (a forged `bytes: 0` would otherwise pass any cap); the kept part is
    /// cut on a character boundary at the cap.
    pub fn push_text(&mut self, text: &str) -> Option<String> {
        let len = text.len() as u64;
        self.seen = self.seen.saturating_add(len);
        let room = self.cap.saturating_sub(self.kept);
        if room == 0 {
            return None;
        }
        if len <= room {
            self.kept += len;
            return (!text.is_empty()).then(|| text.to_owned());
        }
        let mut end = room as usize;
        while end > 0 && !text.is_char_boundary(end) {
            end -= 1;
        }
        self.kept += end as u64;
        // The cut character never completes: nothing later is kept either.
        self.cap = self.kept;
        (end > 0).then(|| text[..end].to_owned())
    }

    /// Accounts bytes a worker saw but did not send (`Dropped` frames, Python only). Only the
    /// `seen` count grows, saturating at `u64::MAX`: nothing is kept, so a false figure cannot
    /// raise what reaches the client, only misreport its own cell's count.
    pub fn push_dropped(&mut self, n: u64) {
        self.seen = self.seen.saturating_add(n);
    }

    /// Takes `n` bytes of the budget for something kept whole (a display bundle), without
    /// counting them as this stream's output: true when they fit the room left, else
    /// nothing changes.
    pub fn reserve(&mut self, n: u64) -> bool {
        if self.cap.saturating_sub(self.kept) < n {
            return false;
        }
        self.cap -= n;
        true
    }

    /// Flushes a held-back partial character (escaped), at the end of a cell.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.pending);
        (!rest.is_empty()).then(|| escape_lossy(&rest))
    }

    /// The cap's whole state: (cap, seen, kept, the incomplete UTF-8 tail held back, at most
    /// 3 bytes), for a successor daemon to continue the stream ([`StreamCap::restore`]).
    pub fn snapshot(&self) -> (u64, u64, u64, Vec<u8>) {
        (self.cap, self.seen, self.kept, self.pending.clone())
    }

    /// A cap continuing from a [`StreamCap::snapshot`]; `None` when the state is not one a
    /// cap can be in (kept over the cap or over seen, a held-back tail of more than 3 bytes).
    pub fn restore(cap: u64, seen: u64, kept: u64, pending: Vec<u8>) -> Option<Self> {
        (kept <= cap && kept <= seen && pending.len() <= 3).then_some(Self {
            cap,
            seen,
            kept,
            pending,
        })
    }

    /// Seen/kept/truncated so far.
    pub fn stats(&self) -> StreamStats {
        StreamStats {
            seen: self.seen,
            kept: self.kept,
            truncated: self.seen > self.kept,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_head_and_counts_rest_exactly() {
        let mut c = StreamCap::new(10);
        assert_eq!(c.push_bytes(b"12345").as_deref(), Some("12345"));
        assert_eq!(c.push_bytes(b"6789abcdef").as_deref(), Some("6789a"));
        assert_eq!(c.push_bytes(&[b'x'; 1000]), None);
        assert_eq!(
            c.stats(),
            StreamStats {
                seen: 1015,
                kept: 10,
                truncated: true
            }
        );
    }

    /// A forged `dropped` count (a worker's reply pipe is written by untrusted code) saturates
    /// instead of wrapping: found by the `worker_reply` fuzz target, two `dropped` lines of
    /// 13333333333333333300 bytes each.
    #[test]
    fn forged_dropped_counts_saturate() {
        let mut c = StreamCap::new(4);
        c.push_bytes(b"abcdef");
        c.push_dropped(13_333_333_333_333_333_300);
        c.push_dropped(13_333_333_333_333_333_300);
        c.push_text("more");
        let s = c.stats();
        assert_eq!((s.seen, s.kept, s.truncated), (u64::MAX, 4, true));
    }

    #[test]
    fn reserved_bytes_leave_the_stream_less_room() {
        let mut c = StreamCap::new(10);
        assert!(c.reserve(6));
        assert!(!c.reserve(5), "only 4 bytes left");
        assert_eq!(c.push_text("abcdef").as_deref(), Some("abcd"));
        assert!(!c.reserve(1));
        assert_eq!(c.stats().kept, 4);
    }

    #[test]
    fn exact_fit_is_not_truncated() {
        let mut c = StreamCap::new(3);
        c.push_bytes(b"abc");
        assert!(!c.stats().truncated);
    }

    #[test]
    fn split_character_is_reassembled() {
        let s = "✓".as_bytes();
        let mut c = StreamCap::new(100);
        assert_eq!(c.push_bytes(&s[..1]), None);
        assert_eq!(c.push_bytes(&s[1..]).as_deref(), Some("✓"));
        assert_eq!(c.push_bytes(b"\xff").as_deref(), Some("\\xff"));
    }

    #[test]
    fn a_character_cut_by_the_cap_is_dropped_not_escaped() {
        // "a✓✓": the cap of 5 bytes falls inside the second check mark.
        let mut c = StreamCap::new(5);
        assert_eq!(c.push_bytes("a✓✓".as_bytes()).as_deref(), Some("a✓"));
        assert_eq!(c.push_bytes(b"more"), None);
        assert_eq!(c.finish(), None);
        let st = c.stats();
        assert_eq!((st.seen, st.kept, st.truncated), (11, 4, true));
        // Cut across two reads: the pending lead byte plus the cap.
        let mut c = StreamCap::new(3);
        let s = "é✓".as_bytes();
        assert_eq!(c.push_bytes(&s[..3]).as_deref(), Some("é"));
        assert_eq!(c.push_bytes(&s[3..]), None);
        assert_eq!(c.stats().kept, 2);
    }

    #[test]
    fn text_frames_count_what_arrived() {
        // A frame declaring 0 bytes used to pass the cap; the text itself is what counts.
        let mut c = StreamCap::new(4);
        assert_eq!(c.push_text("ab").as_deref(), Some("ab"));
        assert_eq!(c.push_text("cdef").as_deref(), Some("cd"));
        assert_eq!(c.push_text("x"), None);
        assert_eq!(c.stats().kept, 4);
        assert_eq!(c.stats().seen, 7);
        let mut c = StreamCap::new(3);
        assert_eq!(
            c.push_text("a✓").as_deref(),
            Some("a"),
            "cut on a character boundary"
        );
        assert_eq!(c.stats().kept, 1);
        assert_eq!(c.push_text("bc"), None, "nothing after a cut character");
    }

    #[test]
    fn text_frames_are_capped() {
        let mut c = StreamCap::new(4);
        assert_eq!(c.push_text("abcdef").as_deref(), Some("abcd"));
        c.push_dropped(100);
        assert_eq!(
            c.stats(),
            StreamStats {
                seen: 106,
                kept: 4,
                truncated: true
            }
        );
    }
}
