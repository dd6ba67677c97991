//! The daemon's reader of worker replies, fed what a hostile worker may write on its reply
//! pipe: `worker::LineReader` (reads of fuzzer-chosen sizes), `WorkerMessage::parse` of each
//! line, and host-end output accounting (`worker::output::StreamCap`) of the `Output` and
//! `Dropped` messages. Checked: the lines are exactly the
//! newline-separated pieces of the input (a partial last line dropped), a parsed message
//! serialises and parses back to itself, kept bytes never exceed the cap and `truncated` says
//! whether bytes were dropped. The request header parser (`RequestHeader::parse`) gets each line
//! too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_proto::worker::{RequestHeader, Stream, WorkerMessage};
use sandcelld::worker::LineReader;
use sandcelld::worker::output::StreamCap;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, ReadBuf};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    })
}

/// A reader that hands out `data` in pieces whose sizes cycle through `sizes`.
struct Chunked<'a> {
    data: &'a [u8],
    sizes: &'a [u8],
    i: usize,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let want = if self.sizes.is_empty() {
            usize::MAX
        } else {
            self.sizes[self.i % self.sizes.len()] as usize + 1
        };
        self.i += 1;
        let n = want.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

fuzz_target!(|input: &[u8]| {
    // First byte: how many following bytes are read sizes (at most 7), then the cap.
    let Some((&n, rest)) = input.split_first() else {
        return;
    };
    let n = (n as usize % 8).min(rest.len());
    let (sizes, rest) = rest.split_at(n);
    let Some((&cap, data)) = rest.split_first() else {
        return;
    };
    let cap = cap as u64;
    let expected: Vec<&[u8]> = {
        let mut v: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
        v.pop(); // after the last newline: a partial line (or nothing), dropped at EOF
        v
    };
    let lines = runtime().block_on(async {
        let mut r = LineReader::new(Chunked { data, sizes, i: 0 });
        let mut lines = Vec::new();
        while let Some(line) = r.next_line().await.expect("in-memory reads do not fail") {
            lines.push(line);
        }
        lines
    });
    assert_eq!(lines.len(), expected.len());
    for (a, b) in lines.iter().zip(&expected) {
        assert_eq!(a.as_slice(), *b);
    }
    let mut caps = [StreamCap::new(cap), StreamCap::new(cap)];
    for line in &lines {
        if let Ok(s) = std::str::from_utf8(line) {
            if let Ok(h) = RequestHeader::parse(s) {
                let again = h.to_line();
                assert_eq!(RequestHeader::parse(again.trim_end()).unwrap(), h);
            }
        }
        let Ok(m) = WorkerMessage::parse(line) else {
            continue;
        };
        let bytes = m.to_line();
        assert_eq!(bytes.last(), Some(&b'\n'));
        let again = WorkerMessage::parse(&bytes[..bytes.len() - 1]).expect("own line parses");
        assert_eq!(again, m);
        let idx = |s: Stream| if s == Stream::Stdout { 0 } else { 1 };
        match m {
            WorkerMessage::Output { stream, data, .. } => {
                // Text frames count as the bytes of text received (the length a worker declares
                // is not trusted); the raw-bytes path of the same cap is fuzzed by `text`.
                if let Some(t) = caps[idx(stream)].push_bytes(data.as_bytes()) {
                    assert!(t.len() as u64 <= 4 * cap, "forwarded more than the cap");
                }
            }
            WorkerMessage::Dropped { stream, bytes, .. } => caps[idx(stream)].push_dropped(bytes),
            _ => {}
        }
        for c in &caps {
            let s = c.stats();
            assert!(s.kept <= cap, "kept {} above the cap {cap}", s.kept);
            assert_eq!(s.truncated, s.seen > s.kept);
        }
    }
});
