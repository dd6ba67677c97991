//! Output bytes to text (`sandcell_proto::text`) and the host-end stream cap built on it
//! (`worker::output::StreamCap::push_bytes`, the path of R's raw stdout/stderr pipes).
//! Checked: undoing the `\xNN` escapes gives the bytes back (for input without a backslash);
//! `split_incomplete_tail` splits into a prefix and a tail of at most 3 bytes that starts a
//! character; and a stream fed in fuzzer-chosen pieces produces exactly the text of its first
//! `cap` bytes converted at once, less a character the cap cuts, with exact seen/kept counts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_proto::text::{escape_lossy, split_incomplete_tail};
use sandcelld::worker::output::StreamCap;

fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1] == b'x' {
            let hex = std::str::from_utf8(&b[i + 2..i + 4]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fuzz_target!(|input: &[u8]| {
    // First two bytes: the cap (0..=65535, 65535 = everything) and a seed for piece sizes.
    let [cap_hi, seed, data @ ..] = input else {
        return;
    };
    let text = escape_lossy(data);
    if !data.contains(&b'\\') {
        assert_eq!(unescape(&text), data, "escapes do not give the bytes back");
    }
    if let Ok(s) = std::str::from_utf8(data) {
        assert_eq!(text, s, "valid UTF-8 must pass unchanged");
    }
    let (head, tail) = split_incomplete_tail(data);
    assert_eq!(head.len() + tail.len(), data.len());
    assert!(tail.len() <= 3);
    if let Some(&lead) = tail.first() {
        assert!(matches!(lead, 0xc2..=0xf4), "tail starts with {lead:#x}");
    }

    let cap = if *cap_hi == 255 {
        u64::MAX
    } else {
        *cap_hi as u64 * 3
    };
    let mut sc = StreamCap::new(cap);
    let mut out = String::new();
    let mut rest = data;
    let mut state = *seed as usize;
    while !rest.is_empty() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = (state >> 8) % 9 + 1;
        let (piece, r) = rest.split_at(n.min(rest.len()));
        rest = r;
        if let Some(t) = sc.push_bytes(piece) {
            out.push_str(&t);
        }
    }
    if let Some(t) = sc.finish() {
        out.push_str(&t);
    }
    // Once the cap is reached, a character it cuts is dropped: the kept text ends on a
    // character boundary and `kept` does not count the cut character's bytes.
    let kept = if (data.len() as u64) >= cap {
        split_incomplete_tail(&data[..cap as usize]).0.len()
    } else {
        data.len()
    };
    assert_eq!(
        out,
        escape_lossy(&data[..kept]),
        "piecewise conversion differs"
    );
    let s = sc.stats();
    assert_eq!(s.seen, data.len() as u64);
    assert_eq!(s.kept, kept as u64);
    assert_eq!(s.truncated, s.seen > s.kept);
});
