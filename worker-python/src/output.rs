//! Bounding and framing of a cell's output, and the thread that streams it while a cell runs.
//!
//! The guest streams each `sys.stdout`/`sys.stderr` write to the host as raw bytes (Eryx
//! `OutputRequest`s). [`CellOutput`] turns them into [`WorkerMessage::Output`] frames:
//! - at most `max_output` bytes per stream are forwarded; everything past that is counted and
//!   reported once, at the end of the cell, as one [`WorkerMessage::Dropped`] per stream, so
//!   `bytes seen = sum(Output.bytes) + Dropped.bytes` exactly;
//! - a frame carries at most [`MAX_OUTPUT_CHUNK`] original bytes and never splits a UTF-8
//!   character (an unfinished character is held back until its remaining bytes arrive, or
//!   escaped at the end of the cell, as [`sandcell_proto::text`] describes); a character cut
//!   by the `max_output` budget is dropped with the bytes past it;
//! - consecutive writes to the same stream are coalesced while more are already queued, so a
//!   `print` (two writes) normally becomes one frame, yet output stays live: whatever is queued
//!   is sent as soon as the queue is momentarily empty;
//! - the relative order of stdout and stderr writes is preserved.
//!
//! # Who forwards: [`Forwarder`]
//!
//! The guest runs on the cell loop's thread and blocks it while it computes, so live output
//! needs another thread; but handing every cell to a thread (one spawned per cell, or woken per
//! cell) costs more than a short cell itself (docs/internals/figures.md). So one
//! persistent thread takes a cell's output over only once the cell has run for
//! [`TAKEOVER_AFTER`]: from then on it forwards as above, each batch as soon as it is queued,
//! until the cell's channel closes. A cell that ends before that (most cells) never involves
//! the thread: the cell loop drains the channel itself after the guest call, and its frames go
//! out in the same write as its `Done`. Output of a running cell is therefore at most about
//! `2 * TAKEOVER_AFTER` late (plus scheduling), and never after its `Done`.
//!
//! The cell loop only stores the cell's start in an atomic: the thread looks at it every
//! [`TAKEOVER_AFTER`] while cells keep coming, and once no cell began for [`IDLE_AFTER`]
//! sleeps until the next `begin` unparks it (only then does `begin` make a system call).
//! The alternatives (unparking the thread for every cell, re-arming a timerfd per cell: a
//! timer reprogramming in a virtual machine) cost a measurable part of a short cell's round
//! trip (docs/internals/figures.md).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use eryx::OutputRequest;
use sandcell_proto::kernel::{
    DisplayKind, MAX_DISPLAY_BYTES, check_display_data, check_display_metadata, display_fallback,
};
use sandcell_proto::text::split_incomplete_tail;
use sandcell_proto::worker::{MAX_OUTPUT_CHUNK, MAX_WORKER_LINE, Stream, WorkerMessage};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::driver::{DISPLAY_STREAM, OUTCOME_STREAM};
use crate::host::{HOST_CALL_STREAM, HostCalls};
use crate::replies::{Lines, Replies};

/// Per-stream counters and the bytes not yet framed.
#[derive(Debug, Default)]
struct StreamState {
    /// Bytes the cell wrote to this stream.
    seen: u64,
    /// Bytes accepted for forwarding (at most the budget).
    kept: u64,
    /// Accepted bytes not yet sent (may end in an unfinished UTF-8 character).
    buf: Vec<u8>,
    /// The budget was reached: nothing more is accepted (`kept` may be below it by a
    /// character the budget cut).
    full: bool,
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
    ///
    /// Errors: a frame could not be encoded (see [`Lines::push`]).
    pub fn push(&mut self, stream: Stream, data: &[u8], out: &mut Lines) -> io::Result<()> {
        if let Some(last) = self.last
            && last != stream
        {
            self.flush_stream(last, false, out)?;
        }
        self.last = Some(stream);
        let max = self.max_output;
        let st = &mut self.streams[index(stream)];
        st.seen += data.len() as u64;
        let room = if st.full {
            0
        } else {
            max.saturating_sub(st.kept)
        };
        let take = (data.len() as u64).min(room) as usize;
        st.buf.extend_from_slice(&data[..take]);
        st.kept += take as u64;
        if take > 0 && st.kept == max {
            st.full = true;
            // The budget is used up: a character it cut never completes, so its bytes count
            // as dropped and the kept text ends on a character boundary.
            let tail = split_incomplete_tail(&st.buf).1.len();
            st.buf.truncate(st.buf.len() - tail);
            st.kept -= tail as u64;
        }
        while self.streams[index(stream)].buf.len() >= MAX_OUTPUT_CHUNK {
            self.emit_chunk(stream, MAX_OUTPUT_CHUNK, out)?;
        }
        Ok(())
    }

    /// Sends whatever is buffered, except an unfinished character at the end of a stream.
    ///
    /// Errors: as [`CellOutput::push`].
    pub fn flush(&mut self, out: &mut Lines) -> io::Result<()> {
        for s in STREAMS {
            self.flush_stream(s, false, out)?;
        }
        Ok(())
    }

    /// Ends the cell: sends everything (an unfinished character escaped), then one `Dropped`
    /// per stream that lost bytes.
    ///
    /// Errors: as [`CellOutput::push`].
    pub fn finish(mut self, out: &mut Lines) -> io::Result<()> {
        // Flush the stream written last after the other so order is kept.
        let order = match self.last {
            Some(Stream::Stdout) => [Stream::Stderr, Stream::Stdout],
            _ => [Stream::Stdout, Stream::Stderr],
        };
        for s in order {
            self.flush_stream(s, true, out)?;
        }
        for s in STREAMS {
            let st = &self.streams[index(s)];
            if st.seen > st.kept {
                out.push(&WorkerMessage::Dropped {
                    cell: self.cell,
                    stream: s,
                    bytes: st.seen - st.kept,
                })?;
            }
        }
        Ok(())
    }

    fn flush_stream(&mut self, stream: Stream, all: bool, out: &mut Lines) -> io::Result<()> {
        loop {
            let buf = &self.streams[index(stream)].buf;
            if buf.is_empty() {
                return Ok(());
            }
            let n = buf.len().min(MAX_OUTPUT_CHUNK);
            let len = if all && n == buf.len() {
                n // the end of the cell: an unfinished character is escaped
            } else {
                let (complete, _) = split_incomplete_tail(&buf[..n]);
                match (complete.is_empty(), all) {
                    (false, _) => complete.len(),
                    (true, true) => n,
                    (true, false) => return Ok(()), // only an unfinished character is left
                }
            };
            self.emit(stream, len, out)?;
        }
    }

    /// Sends up to `n` buffered bytes of `stream` as one frame, cut before an unfinished
    /// character unless that would leave nothing to send.
    fn emit_chunk(&mut self, stream: Stream, n: usize, out: &mut Lines) -> io::Result<()> {
        let st = &self.streams[index(stream)];
        let n = n.min(st.buf.len());
        let (complete, _) = split_incomplete_tail(&st.buf[..n]);
        let len = if complete.is_empty() {
            n
        } else {
            complete.len()
        };
        self.emit(stream, len, out)
    }

    /// Sends the first `len` buffered bytes of `stream` as one frame.
    fn emit(&mut self, stream: Stream, len: usize, out: &mut Lines) -> io::Result<()> {
        let st = &mut self.streams[index(stream)];
        out.push_output(self.cell, stream, &st.buf[..len])?;
        if len == st.buf.len() {
            st.buf.clear();
        } else {
            st.buf.drain(..len);
        }
        Ok(())
    }
}

/// Maps Eryx's stream number (0 stdout, 1 stderr) to a [`Stream`]; anything else is stderr
/// (except [`OUTCOME_STREAM`] during a cell, which carries the driver's outcome).
pub fn stream_of(id: u32) -> Stream {
    if id == 0 {
        Stream::Stdout
    } else {
        Stream::Stderr
    }
}

/// How long a cell runs before the [`Forwarder`] thread streams its output.
pub const TAKEOVER_AFTER: Duration = Duration::from_millis(1);

/// How long the forwarder thread keeps looking (every [`TAKEOVER_AFTER`]) for a new cell
/// before it sleeps until one begins: between cells closer than this, `begin` wakes nothing.
pub const IDLE_AFTER: Duration = Duration::from_millis(10);

/// Encoded bytes the forwarder collects before writing even while more output is queued.
const WRITE_BATCH: usize = 256 * 1024;

/// The running cell's output, shared by the cell loop and the forwarder thread.
struct Live {
    rx: UnboundedReceiver<OutputRequest>,
    out: CellOutput,
    /// The last message on [`OUTCOME_STREAM`]: the driver's outcome, not output.
    outcome: Option<Vec<u8>>,
    /// Every sender is gone and the queue was drained (by the forwarder).
    closed: bool,
    /// Writing to the reply pipe failed.
    error: Option<io::Error>,
    /// Turns a marker on [`HOST_CALL_STREAM`] into its `host_call` line.
    host: Option<Arc<HostCalls>>,
    /// The cell has rich output: bundles on [`DISPLAY_STREAM`] become `display` lines
    /// (without it they are ignored).
    rich: bool,
}

struct Shared {
    base: Instant,
    /// Start of the running cell in nanoseconds after `base` (unique per cell), 0 for none.
    started: AtomicU64,
    /// Start of the latest cell, running or not (0 before the first).
    latest: AtomicU64,
    /// The forwarder thread sleeps without a timeout and must be unparked for a new cell.
    idle: AtomicBool,
    live: Mutex<Option<Live>>,
    replies: Arc<Replies>,
}

impl Shared {
    fn now(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    fn lock(&self) -> MutexGuard<'_, Option<Live>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The output forwarder: one persistent thread for the worker's lifetime (see the module
/// docs). [`Forwarder::begin`] before a guest call, [`Forwarder::end`] after it.
pub struct Forwarder {
    shared: Arc<Shared>,
    thread: std::thread::Thread,
    /// Last value stored in `started` (kept unique).
    last_start: u64,
    /// Host calls of the cells, whose lines travel in the output channel.
    host: Option<Arc<HostCalls>>,
    /// Cells begun from now on have rich output.
    rich: bool,
}

impl Forwarder {
    /// Starts the forwarder thread, writing to `replies`.
    ///
    /// Errors: the thread could not be spawned.
    pub fn start(replies: Arc<Replies>) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            base: Instant::now(),
            started: AtomicU64::new(0),
            latest: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            live: Mutex::new(None),
            replies,
        });
        let s = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("output".into())
            .spawn(move || watch(&s))?;
        Ok(Self {
            shared,
            thread: handle.thread().clone(),
            last_start: 0,
            host: None,
            rich: false,
        })
    }

    /// Writes the `host_call` line a cell's host call puts in its output channel (a marker on
    /// [`HOST_CALL_STREAM`]) in its place among the cell's output (see [`crate::host`]).
    pub fn set_host_calls(&mut self, host: Arc<HostCalls>) {
        self.host = Some(host);
    }

    /// Whether the cells begun from now on have rich output (the request's `rich`).
    pub fn set_rich(&mut self, rich: bool) {
        self.rich = rich;
    }

    /// The reply pipe.
    pub fn replies(&self) -> &Arc<Replies> {
        &self.shared.replies
    }

    /// A cell (`cell`, at most `max_output` bytes per stream) is about to run: returns the
    /// sender to hand to Eryx. Every sender must be gone when [`Forwarder::end`] is called
    /// (Eryx drops it when the execution returns or is dropped). Makes no system call unless
    /// the thread has gone idle ([`IDLE_AFTER`] without a cell).
    pub fn begin(&mut self, cell: u64, max_output: u64) -> UnboundedSender<OutputRequest> {
        let (tx, rx) = unbounded_channel();
        *self.shared.lock() = Some(Live {
            rx,
            out: CellOutput::new(cell, max_output),
            outcome: None,
            closed: false,
            error: None,
            host: self.host.clone(),
            rich: self.rich,
        });
        let start = self.shared.now().max(self.last_start + 1);
        self.last_start = start;
        self.shared.latest.store(start, Ordering::Relaxed);
        self.shared.started.store(start, Ordering::SeqCst);
        if self.shared.idle.swap(false, Ordering::SeqCst) {
            self.thread.unpark();
        }
        tx
    }

    /// The guest call has ended (its sender is gone): appends the output not yet sent, then
    /// one `Dropped` per stream that lost bytes, to `lines`, and returns the driver's outcome
    /// (the last message on [`OUTCOME_STREAM`]), if any. Waits for the forwarder thread if it
    /// is forwarding this cell (it stops once the channel is closed).
    ///
    /// Errors: writing to the reply pipe failed while the cell ran (the daemon is gone).
    pub fn end(&mut self, lines: &mut Lines) -> io::Result<Option<Vec<u8>>> {
        self.shared.started.store(0, Ordering::SeqCst);
        let live = self.shared.lock().take();
        let Some(mut live) = live else {
            return Ok(None);
        };
        if let Some(e) = live.error {
            return Err(e);
        }
        if !live.closed {
            while let Ok(req) = live.rx.try_recv() {
                live.accept(req, lines)?;
            }
        }
        live.out.finish(lines)?;
        Ok(live.outcome)
    }
}

/// The forwarder thread: looks at the running cell every [`TAKEOVER_AFTER`] and streams one
/// that has run that long; after [`IDLE_AFTER`] without a cell it sleeps until `begin`
/// unparks it.
fn watch(shared: &Shared) {
    let after = TAKEOVER_AFTER.as_nanos() as u64;
    let idle_after = IDLE_AFTER.as_nanos() as u64;
    // The cell this thread already forwarded to its end (it may still be marked running).
    let mut finished = 0;
    // When this thread last woke from idle.
    let mut woke = shared.now();
    loop {
        let started = shared.started.load(Ordering::SeqCst);
        let now = shared.now();
        if started != 0 && started != finished {
            if now < started + after {
                std::thread::park_timeout(Duration::from_nanos(started + after - now));
            } else {
                take_over(shared, started);
                finished = started;
            }
            continue;
        }
        let active = shared.latest.load(Ordering::Relaxed).max(woke);
        if now.saturating_sub(active) < idle_after {
            std::thread::park_timeout(TAKEOVER_AFTER);
            continue;
        }
        // Idle: sleep until `begin` unparks (a spurious wake just loops).
        shared.idle.store(true, Ordering::SeqCst);
        let again = shared.started.load(Ordering::SeqCst);
        if again == 0 || again == finished {
            std::thread::park();
        }
        shared.idle.store(false, Ordering::SeqCst);
        woke = shared.now();
    }
}

/// Forwards the output of the cell that started at `started`, live, until its channel closes.
/// Holds the lock meanwhile, so [`Forwarder::end`] waits for the last batch to be written.
fn take_over(shared: &Shared, started: u64) {
    let mut guard = shared.lock();
    if shared.started.load(Ordering::SeqCst) != started {
        return; // that cell ended meanwhile
    }
    let Some(live) = guard.as_mut() else { return };
    if live.closed || live.error.is_some() {
        return;
    }
    let mut lines = Lines::new();
    let r = forward(live, &shared.replies, &mut lines);
    live.closed = true;
    if let Err(e) = r {
        // The daemon is gone: discard the rest of the cell's output as it comes.
        live.rx.close();
        while live.rx.try_recv().is_ok() {}
        live.error = Some(e);
    }
}

impl Live {
    /// Takes one message: output, the driver's outcome, or a host call's marker (its line
    /// follows the output before it).
    fn accept(&mut self, req: OutputRequest, lines: &mut Lines) -> io::Result<()> {
        if req.stream == OUTCOME_STREAM {
            self.outcome = Some(req.data);
            return Ok(());
        }
        if req.stream == HOST_CALL_STREAM {
            if let Some(msg) = self.host.as_ref().and_then(|h| h.take_line(&req.data)) {
                self.out.flush(lines)?;
                lines.push(&msg)?;
            }
            return Ok(());
        }
        if req.stream == DISPLAY_STREAM {
            if self.rich
                && let Some(msg) = display_line(self.out.cell, &req.data)
            {
                self.out.flush(lines)?;
                lines.push(&msg)?;
            }
            return Ok(());
        }
        self.out.push(stream_of(req.stream), &req.data, lines)
    }
}

/// The `display` line for a bundle the driver sent on [`DISPLAY_STREAM`]
/// (`{"kind": ..., "data": {...}, "metadata": {...}}`, metadata optional), or `None` for one
/// that is malformed (the guest is untrusted: a bad bundle is dropped, never a protocol
/// violation; metadata that is not a JSON object or is over
/// [`sandcell_proto::kernel::MAX_DISPLAY_METADATA_BYTES`] is left out). A bundle over
/// [`MAX_DISPLAY_BYTES`], metadata included, is replaced by its text/plain with a note.
pub fn display_line(cell: u64, data: &[u8]) -> Option<WorkerMessage> {
    #[derive(serde::Deserialize)]
    struct Sent {
        kind: DisplayKind,
        data: serde_json::Map<String, serde_json::Value>,
        #[serde(default)]
        metadata: serde_json::Value,
    }
    if data.len() > MAX_WORKER_LINE {
        return None;
    }
    let sent: Sent = serde_json::from_slice(data).ok()?;
    let mut size = check_display_data(&sent.data).ok()?;
    let metadata = match sent.metadata {
        serde_json::Value::Object(m) => match check_display_metadata(&m) {
            Ok(n) => {
                size += n;
                m
            }
            Err(_) => Default::default(),
        },
        _ => Default::default(),
    };
    let (data, metadata, note) = if size > MAX_DISPLAY_BYTES {
        (
            display_fallback(&sent.data),
            Default::default(),
            Some(format!(
                "bundle of {size} bytes over the {MAX_DISPLAY_BYTES}-byte cap: text/plain only"
            )),
        )
    } else {
        (sent.data, metadata, None)
    };
    Some(WorkerMessage::Display {
        cell,
        kind: sent.kind,
        data,
        metadata,
        note,
        wait: false,
    })
}

/// The live loop: each wake-up takes whatever is queued, coalesces it, and writes it at once.
fn forward(live: &mut Live, replies: &Replies, lines: &mut Lines) -> io::Result<()> {
    while let Some(first) = live.rx.blocking_recv() {
        live.accept(first, lines)?;
        // Coalesce whatever is already queued; stop at the first empty poll so output is live.
        while let Ok(req) = live.rx.try_recv() {
            live.accept(req, lines)?;
            if lines.len() >= WRITE_BATCH {
                replies.write(lines)?;
            }
        }
        live.out.flush(lines)?;
        replies.write(lines)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn parse(lines: &Lines) -> Vec<WorkerMessage> {
        lines
            .as_bytes()
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| WorkerMessage::parse(l).unwrap())
            .collect()
    }

    fn texts(lines: &Lines) -> Vec<(Stream, String, u64)> {
        parse(lines)
            .into_iter()
            .filter_map(|m| match m {
                WorkerMessage::Output {
                    stream,
                    data,
                    bytes,
                    ..
                } => Some((stream, data, bytes)),
                _ => None,
            })
            .collect()
    }

    fn dropped(lines: &Lines, s: Stream) -> u64 {
        parse(lines)
            .into_iter()
            .map(|m| match m {
                WorkerMessage::Dropped { stream, bytes, .. } if stream == s => bytes,
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn display_lines_are_checked_bounded_and_dropped_when_malformed() {
        let m = display_line(
            3,
            br#"{"kind":"result","data":{"text/plain":"2","text/html":"<b>2</b>"},"metadata":{"text/html":{"isolated":true}}}"#,
        )
        .unwrap();
        match m {
            WorkerMessage::Display {
                cell,
                kind,
                data,
                metadata,
                note,
                ..
            } => {
                assert_eq!((cell, kind, note), (3, DisplayKind::Result, None));
                assert_eq!(data["text/html"], "<b>2</b>");
                assert_eq!(metadata["text/html"]["isolated"], true);
            }
            other => panic!("{other:?}"),
        }
        // Metadata that is not an object, or too large, is left out; the bundle stays.
        let large = format!(
            r#"{{"kind":"display","data":{{"text/plain":"x"}},"metadata":{{"a":"{}"}}}}"#,
            "m".repeat(5000)
        );
        for line in [
            &br#"{"kind":"display","data":{"text/plain":"x"},"metadata":[1]}"#[..],
            large.as_bytes(),
        ] {
            match display_line(1, line) {
                Some(WorkerMessage::Display { data, metadata, .. }) => {
                    assert_eq!(data["text/plain"], "x");
                    assert!(metadata.is_empty());
                }
                other => panic!("{other:?}"),
            }
        }
        // Malformed bundles from the guest are dropped, never a protocol violation.
        for bad in [
            &br#"{"kind":"result","data":{"text/html":"x"}}"#[..],
            br#"{"kind":"other","data":{"text/plain":"x"}}"#,
            br#"not json"#,
            br#"{"kind":"display","data":{"text/plain":"x","BAD":"y"}}"#,
        ] {
            assert!(
                display_line(1, bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // Over the cap: text/plain only, with a note; the line stays under the limit.
        let big = format!(
            r#"{{"kind":"display","data":{{"text/plain":"fig","image/png":"{}"}}}}"#,
            "A".repeat(MAX_DISPLAY_BYTES)
        );
        let m = display_line(2, big.as_bytes()).unwrap();
        let mut lines = Lines::new();
        lines.push(&m).unwrap();
        match m {
            WorkerMessage::Display { data, note, .. } => {
                assert_eq!(data.len(), 1);
                assert_eq!(data["text/plain"], "fig");
                assert!(note.unwrap().contains("cap"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn coalesces_and_keeps_order_across_streams() {
        let mut o = CellOutput::new(1, 1000);
        let mut f = Lines::new();
        o.push(Stream::Stdout, b"a", &mut f).unwrap();
        o.push(Stream::Stdout, b"\n", &mut f).unwrap();
        assert!(f.is_empty());
        o.push(Stream::Stderr, b"e\n", &mut f).unwrap();
        o.push(Stream::Stdout, b"b\n", &mut f).unwrap();
        o.finish(&mut f).unwrap();
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
        let mut f = Lines::new();
        o.push(Stream::Stdout, &vec![b'x'; 1_000_000], &mut f)
            .unwrap();
        o.push(Stream::Stdout, b"\n", &mut f).unwrap();
        o.finish(&mut f).unwrap();
        let kept: u64 = texts(&f).iter().map(|t| t.2).sum();
        assert_eq!(kept, 1000);
        assert_eq!(dropped(&f, Stream::Stdout), 1_000_001 - 1000);
        assert_eq!(dropped(&f, Stream::Stderr), 0);
    }

    #[test]
    fn chunks_never_split_a_character() {
        let mut o = CellOutput::new(1, u64::MAX);
        let mut f = Lines::new();
        // 'a' then ✓ (3 bytes) repeated: chunk boundaries fall inside characters.
        let mut data = vec![b'a'];
        for _ in 0..50_000 {
            data.extend_from_slice("✓".as_bytes());
        }
        o.push(Stream::Stdout, &data, &mut f).unwrap();
        o.finish(&mut f).unwrap();
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
        let mut f = Lines::new();
        let check = "✓".as_bytes();
        o.push(Stream::Stdout, &check[..1], &mut f).unwrap();
        o.flush(&mut f).unwrap();
        assert!(texts(&f).is_empty());
        o.push(Stream::Stdout, &check[1..], &mut f).unwrap();
        o.finish(&mut f).unwrap();
        assert_eq!(texts(&f), vec![(Stream::Stdout, "✓".into(), 3)]);
    }

    #[test]
    fn invalid_bytes_are_escaped_and_counted_raw() {
        let mut o = CellOutput::new(1, 100);
        let mut f = Lines::new();
        o.push(Stream::Stdout, b"a\xffb", &mut f).unwrap();
        o.finish(&mut f).unwrap();
        assert_eq!(texts(&f), vec![(Stream::Stdout, "a\\xffb".into(), 3)]);
    }

    #[test]
    fn budget_cutting_a_character_drops_it() {
        let mut o = CellOutput::new(1, 2);
        let mut f = Lines::new();
        o.push(Stream::Stdout, "a✓".as_bytes(), &mut f).unwrap();
        o.push(Stream::Stdout, b"more", &mut f).unwrap();
        o.finish(&mut f).unwrap();
        assert_eq!(texts(&f), vec![(Stream::Stdout, "a".into(), 1)]);
        assert_eq!(dropped(&f, Stream::Stdout), 7);
    }

    /// A forwarder writing to a pipe whose read end is returned (non-blocking).
    fn forwarder() -> (Forwarder, std::fs::File) {
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: a two-int array for pipe2 to fill.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), flags) };
        assert_eq!(rc, 0);
        // SAFETY: fresh descriptors owned by nothing else.
        let (r, w) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        let f = Forwarder::start(Arc::new(Replies::new(w))).unwrap();
        (f, r)
    }

    fn written(r: &mut std::fs::File) -> Vec<WorkerMessage> {
        use std::io::Read;
        let mut bytes = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&buf[..n]);
        }
        let mut l = Lines::new();
        l.buf_for_tests().extend_from_slice(&bytes);
        parse(&l)
    }

    fn send(tx: &UnboundedSender<OutputRequest>, stream: u32, data: &[u8]) {
        tx.send(OutputRequest {
            stream,
            data: data.to_vec(),
        })
        .unwrap();
    }

    #[test]
    fn a_short_cell_is_left_for_the_done_write() {
        let (mut f, mut r) = forwarder();
        let mut left = 0;
        for cell in 1..=50 {
            let tx = f.begin(cell, 1000);
            send(&tx, 0, b"a\n");
            send(&tx, 1, b"e\n");
            drop(tx);
            let mut lines = Lines::new();
            assert_eq!(f.end(&mut lines).unwrap(), None);
            // Descheduled past TAKEOVER_AFTER, the thread may have sent some: same frames.
            let mut all = written(&mut r);
            if all.is_empty() {
                left += 1;
            }
            all.extend(parse(&lines));
            let want = [(Stream::Stdout, "a\n"), (Stream::Stderr, "e\n")];
            assert_eq!(all.len(), 2, "{all:?}");
            for (m, (stream, text)) in all.iter().zip(want) {
                assert_eq!(
                    m,
                    &WorkerMessage::Output {
                        cell,
                        stream,
                        data: text.into(),
                        bytes: 2
                    }
                );
            }
        }
        assert!(left > 0, "no cell was left for its Done write");
    }

    #[test]
    fn a_long_cell_is_streamed_live_with_exact_counts() {
        let (mut f, mut r) = forwarder();
        let tx = f.begin(9, 5);
        send(&tx, 0, b"abc");
        let start = Instant::now();
        let mut live = Vec::new();
        while live.is_empty() && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
            live = written(&mut r);
        }
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(
            live,
            vec![WorkerMessage::Output {
                cell: 9,
                stream: Stream::Stdout,
                data: "abc".into(),
                bytes: 3
            }]
        );
        send(&tx, 0, b"defgh");
        drop(tx);
        let mut lines = Lines::new();
        assert_eq!(f.end(&mut lines).unwrap(), None);
        let mut all = written(&mut r);
        all.extend(parse(&lines));
        assert_eq!(
            all,
            vec![
                WorkerMessage::Output {
                    cell: 9,
                    stream: Stream::Stdout,
                    data: "de".into(),
                    bytes: 2
                },
                WorkerMessage::Dropped {
                    cell: 9,
                    stream: Stream::Stdout,
                    bytes: 3
                }
            ]
        );
        // The next cell starts clean and short again.
        let tx = f.begin(10, 5);
        send(&tx, 0, b"x");
        drop(tx);
        let mut lines = Lines::new();
        assert_eq!(f.end(&mut lines).unwrap(), None);
        assert_eq!(texts(&lines), vec![(Stream::Stdout, "x".into(), 1)]);
        assert!(written(&mut r).is_empty());
    }
}
