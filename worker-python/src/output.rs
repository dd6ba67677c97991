//! Bounding and framing of a cell's output.
//!
//! The guest streams each `sys.stdout`/`sys.stderr` write to the host as raw bytes (Eryx
//! `OutputRequest`s). [`CellOutput`] turns them into [`WorkerMessage::Output`] frames:
//! - at most `max_output` bytes per stream are forwarded; everything past that is counted and
//!   reported once, at the end of the cell, as one [`WorkerMessage::Dropped`] per stream, so
//!   `bytes seen = sum(Output.bytes) + Dropped.bytes` exactly (seed 001: exact seen/dropped);
//! - a frame carries at most [`MAX_OUTPUT_CHUNK`] original bytes and never splits a UTF-8
//!   character (an unfinished character is held back until its remaining bytes arrive, or
//!   escaped at the end of the cell, as [`sandcell_proto::text`] describes);
//! - consecutive writes to the same stream are coalesced while more are already queued, so a
//!   `print` (two writes) normally becomes one frame, yet output stays live: whatever is queued
//!   is sent as soon as the queue is momentarily empty;
//! - the relative order of stdout and stderr writes is preserved.
//!
//! [`forward`] drives a [`CellOutput`] from Eryx's channel on a thread of its own, so that a
//! CPU-bound guest (which blocks the thread it runs on) still has its output delivered live.

use std::io;

use eryx::OutputRequest;
use sandcell_proto::text::{escape_lossy, split_incomplete_tail};
use sandcell_proto::worker::{MAX_OUTPUT_CHUNK, Stream, WorkerMessage};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::replies::Replies;

/// Per-stream counters and the bytes not yet framed.
#[derive(Debug, Default)]
struct StreamState {
    /// Bytes the cell wrote to this stream.
    seen: u64,
    /// Bytes accepted for forwarding (at most the budget).
    kept: u64,
    /// Accepted bytes not yet sent (may end in an unfinished UTF-8 character).
    buf: Vec<u8>,
}

/// Output bookkeeping of one cell.
#[derive(Debug)]
pub struct CellOutput {
    cell: u64,
    max_output: u64,
    streams: [StreamState; 2],
    /// Stream whose bytes were buffered last; switching streams flushes the other one first.
    last: Option<Stream>,
}

fn index(stream: Stream) -> usize {
    match stream {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    }
}

const STREAMS: [Stream; 2] = [Stream::Stdout, Stream::Stderr];

impl CellOutput {
    /// Bookkeeping for cell `cell`, forwarding at most `max_output` bytes per stream.
    pub fn new(cell: u64, max_output: u64) -> Self {
        Self {
            cell,
            max_output,
            streams: Default::default(),
            last: None,
        }
    }

    /// Bytes seen so far on `stream`.
    pub fn seen(&self, stream: Stream) -> u64 {
        self.streams[index(stream)].seen
    }

    /// Accepts one write of `data` to `stream`, appending any frames that became complete.
    pub fn push(&mut self, stream: Stream, data: &[u8], out: &mut Vec<WorkerMessage>) {
        if let Some(last) = self.last
            && last != stream
        {
            self.flush_stream(last, false, out);
        }
        self.last = Some(stream);
        let max = self.max_output;
        let st = &mut self.streams[index(stream)];
        st.seen += data.len() as u64;
        let room = max.saturating_sub(st.kept);
        let take = (data.len() as u64).min(room) as usize;
        st.buf.extend_from_slice(&data[..take]);
        st.kept += take as u64;
        while self.streams[index(stream)].buf.len() >= MAX_OUTPUT_CHUNK {
            self.emit_chunk(stream, MAX_OUTPUT_CHUNK, out);
        }
    }

    /// Sends whatever is buffered, except an unfinished character at the end of a stream.
    pub fn flush(&mut self, out: &mut Vec<WorkerMessage>) {
        for s in STREAMS {
            self.flush_stream(s, false, out);
        }
    }

    /// Ends the cell: sends everything (an unfinished character escaped), then one `Dropped`
    /// per stream that lost bytes.
    pub fn finish(mut self, out: &mut Vec<WorkerMessage>) {
        // Flush the stream written last after the other so order is kept.
        let order = match self.last {
            Some(Stream::Stdout) => [Stream::Stderr, Stream::Stdout],
            _ => [Stream::Stdout, Stream::Stderr],
        };
        for s in order {
            self.flush_stream(s, true, out);
        }
        for s in STREAMS {
            let st = &self.streams[index(s)];
            if st.seen > st.kept {
                out.push(WorkerMessage::Dropped {
                    cell: self.cell,
                    stream: s,
                    bytes: st.seen - st.kept,
                });
            }
        }
    }

    fn flush_stream(&mut self, stream: Stream, all: bool, out: &mut Vec<WorkerMessage>) {
        loop {
            let buf = &self.streams[index(stream)].buf;
            if buf.is_empty() {
                return;
            }
            let n = buf.len().min(MAX_OUTPUT_CHUNK);
            let len = if all && n == buf.len() {
                n // the end of the cell: an unfinished character is escaped
            } else {
                let (complete, _) = split_incomplete_tail(&buf[..n]);
                match (complete.is_empty(), all) {
                    (false, _) => complete.len(),
                    (true, true) => n,
                    (true, false) => return, // only an unfinished character is left
                }
            };
            self.emit(stream, len, out);
        }
    }

    /// Sends up to `n` buffered bytes of `stream` as one frame, cut before an unfinished
    /// character unless that would leave nothing to send.
    fn emit_chunk(&mut self, stream: Stream, n: usize, out: &mut Vec<WorkerMessage>) {
        let st = &self.streams[index(stream)];
        let n = n.min(st.buf.len());
        let (complete, _) = split_incomplete_tail(&st.buf[..n]);
        let len = if complete.is_empty() {
            n
        } else {
            complete.len()
        };
        self.emit(stream, len, out);
    }

    /// Sends the first `len` buffered bytes of `stream` as one frame.
    fn emit(&mut self, stream: Stream, len: usize, out: &mut Vec<WorkerMessage>) {
        let st = &mut self.streams[index(stream)];
        let chunk: Vec<u8> = st.buf.drain(..len).collect();
        out.push(WorkerMessage::Output {
            cell: self.cell,
            stream,
            data: escape_lossy(&chunk),
            bytes: chunk.len() as u64,
        });
    }
}

/// Maps Eryx's stream number (0 stdout, 1 stderr) to a [`Stream`]; anything else is stderr.
pub fn stream_of(id: u32) -> Stream {
    if id == 0 {
        Stream::Stdout
    } else {
        Stream::Stderr
    }
}

/// Forwards one cell's output from `rx` to `replies` until every sender is gone, then sends
/// the tail and the `Dropped` counts. Blocks the calling thread (never call it on a Tokio
/// worker). Returns the bytes seen on (stdout, stderr).
///
/// Errors: writing to the reply pipe failed (the daemon is gone).
pub fn forward(
    cell: u64,
    max_output: u64,
    mut rx: UnboundedReceiver<OutputRequest>,
    replies: &Replies,
) -> io::Result<(u64, u64)> {
    let mut out = CellOutput::new(cell, max_output);
    let mut frames = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        out.push(stream_of(first.stream), &first.data, &mut frames);
        // Coalesce whatever is already queued; stop at the first empty poll so output is live.
        while let Ok(req) = rx.try_recv() {
            out.push(stream_of(req.stream), &req.data, &mut frames);
            if frames.len() >= 16 {
                replies.send_all(&frames)?;
                frames.clear();
            }
        }
        out.flush(&mut frames);
        replies.send_all(&frames)?;
        frames.clear();
    }
    let seen = (out.seen(Stream::Stdout), out.seen(Stream::Stderr));
    out.finish(&mut frames);
    replies.send_all(&frames)?;
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(frames: &[WorkerMessage]) -> Vec<(Stream, String, u64)> {
        frames
            .iter()
            .filter_map(|m| match m {
                WorkerMessage::Output {
                    stream,
                    data,
                    bytes,
                    ..
                } => Some((*stream, data.clone(), *bytes)),
                _ => None,
            })
            .collect()
    }

    fn dropped(frames: &[WorkerMessage], s: Stream) -> u64 {
        frames
            .iter()
            .map(|m| match m {
                WorkerMessage::Dropped { stream, bytes, .. } if *stream == s => *bytes,
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn coalesces_and_keeps_order_across_streams() {
        let mut o = CellOutput::new(1, 1000);
        let mut f = Vec::new();
        o.push(Stream::Stdout, b"a", &mut f);
        o.push(Stream::Stdout, b"\n", &mut f);
        assert!(f.is_empty());
        o.push(Stream::Stderr, b"e\n", &mut f);
        o.push(Stream::Stdout, b"b\n", &mut f);
        o.finish(&mut f);
        assert_eq!(
            texts(&f),
            vec![
                (Stream::Stdout, "a\n".into(), 2),
                (Stream::Stderr, "e\n".into(), 2),
                (Stream::Stdout, "b\n".into(), 2)
            ]
        );
    }

    #[test]
    fn bounds_output_and_counts_drops_exactly() {
        let mut o = CellOutput::new(1, 1000);
        let mut f = Vec::new();
        o.push(Stream::Stdout, &vec![b'x'; 1_000_000], &mut f);
        o.push(Stream::Stdout, b"\n", &mut f);
        o.finish(&mut f);
        let kept: u64 = texts(&f).iter().map(|t| t.2).sum();
        assert_eq!(kept, 1000);
        assert_eq!(dropped(&f, Stream::Stdout), 1_000_001 - 1000);
        assert_eq!(dropped(&f, Stream::Stderr), 0);
    }

    #[test]
    fn chunks_never_split_a_character() {
        let mut o = CellOutput::new(1, u64::MAX);
        let mut f = Vec::new();
        // 'a' then ✓ (3 bytes) repeated: chunk boundaries fall inside characters.
        let mut data = vec![b'a'];
        for _ in 0..50_000 {
            data.extend_from_slice("✓".as_bytes());
        }
        o.push(Stream::Stdout, &data, &mut f);
        o.finish(&mut f);
        let t = texts(&f);
        assert!(t.len() >= 3);
        for (_, text, bytes) in &t {
            assert!(*bytes as usize <= MAX_OUTPUT_CHUNK);
            assert_eq!(
                text.len() as u64,
                *bytes,
                "no escaping expected in valid text"
            );
            assert!(!text.contains("\\x"));
        }
        assert_eq!(t.iter().map(|x| x.2).sum::<u64>(), data.len() as u64);
    }

    #[test]
    fn character_split_across_writes_is_joined() {
        let mut o = CellOutput::new(1, 100);
        let mut f = Vec::new();
        let check = "✓".as_bytes();
        o.push(Stream::Stdout, &check[..1], &mut f);
        o.flush(&mut f);
        assert!(texts(&f).is_empty());
        o.push(Stream::Stdout, &check[1..], &mut f);
        o.finish(&mut f);
        assert_eq!(texts(&f), vec![(Stream::Stdout, "✓".into(), 3)]);
    }

    #[test]
    fn invalid_bytes_are_escaped_and_counted_raw() {
        let mut o = CellOutput::new(1, 100);
        let mut f = Vec::new();
        o.push(Stream::Stdout, b"a\xffb", &mut f);
        o.finish(&mut f);
        assert_eq!(texts(&f), vec![(Stream::Stdout, "a\\xffb".into(), 3)]);
    }

    #[test]
    fn budget_cutting_a_character_escapes_the_tail() {
        let mut o = CellOutput::new(1, 2);
        let mut f = Vec::new();
        o.push(Stream::Stdout, "a✓".as_bytes(), &mut f);
        o.finish(&mut f);
        assert_eq!(texts(&f), vec![(Stream::Stdout, "a\\xe2".into(), 2)]);
        assert_eq!(dropped(&f, Stream::Stdout), 2);
    }
}
