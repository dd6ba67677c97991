//! Cells that outlive their client: the records of cells started by `Submit` (and by
//! `Execute` on a detached session), their retained output, and the relay between a
//! session's actor and whoever is attached.
//!
//! Such a cell's frames go from the actor to a *relay* task instead of to a connection. The
//! relay drains them at once (the actor never waits for a client that is not there), keeps
//! what [`Kept`] retains of each stream and the result, and forwards each frame to the
//! cell's attachment if it has one (then a slow reader slows the cell as for `Execute`: the
//! relay waits, the actor's channel fills, and the actor stops reading the worker's pipes).
//!
//! Bounds (all in `sandcell_proto::kernel`): per stream the first [`k::RETAIN_HEAD_BYTES`]
//! and the last [`k::RETAIN_TAIL_BYTES`] of text; a retained result at most
//! [`k::RETAINED_RESULT_BYTES`]; per session [`k::SESSION_RETAINED_BYTES`] (older cells'
//! output is evicted first, then their records) and the newest [`k::RESULTS_KEPT`] finished
//! records; daemon-wide [`k::DAEMON_RETAINED_BYTES`], reserved up front per running cell
//! ([`RESERVE`]) and refused (`CapacityExceeded`) when it does not fit.

use sandcell_proto::kernel::{
    self as k, CellResult, Display, Frame, HostCall, Output, Retained, RetainedStats, Started,
    Stream,
};
use sandcell_proto::worker::MAX_OUTPUT_CHUNK;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, mpsc, oneshot};

/// What a relay needs of the session its cell runs in (`session::Session` is one): its id
/// for log lines, its cell log, and a way to interrupt a cell. The relay holds the session
/// (an `Arc`) until the cell's frames end.
pub trait Host: Send + Sync + 'static {
    /// The session's id.
    fn id(&self) -> &str;
    /// The session's cell records.
    fn log(&self) -> &CellLog;
    /// Interrupts `cell` (a client's hang-up under `interrupt_on_hangup`).
    fn interrupt_cell(&self, cell: u64) -> impl Future<Output = ()> + Send;
}

/// Bytes a running cell's record reserves of its session's and the daemon's budgets: both
/// streams' head and tail, and a retained result.
pub const RESERVE: u64 =
    2 * (k::RETAIN_HEAD_BYTES + k::RETAIN_TAIL_BYTES) + k::RETAINED_RESULT_BYTES;

/// Bytes charged daemon-wide now (the sum of every live [`Charge`]).
static DAEMON_USE: AtomicU64 = AtomicU64::new(0);

/// Bytes of retained output and results charged daemon-wide now.
pub fn daemon_use() -> u64 {
    DAEMON_USE.load(Ordering::SeqCst)
}

/// A charge against the daemon-wide retention budget ([`k::DAEMON_RETAINED_BYTES`]),
/// released when dropped; it only ever shrinks after it is taken.
#[derive(Debug)]
pub struct Charge(u64);

impl Charge {
    /// Charges `bytes`, or returns the bytes in use when they do not fit.
    pub fn new(bytes: u64) -> Result<Charge, u64> {
        let mut cur = DAEMON_USE.load(Ordering::SeqCst);
        loop {
            if cur + bytes > k::DAEMON_RETAINED_BYTES {
                return Err(cur);
            }
            match DAEMON_USE.compare_exchange(cur, cur + bytes, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(Charge(bytes)),
                Err(now) => cur = now,
            }
        }
    }

    /// Lowers the charge to `to` bytes (never raises it).
    fn shrink(&mut self, to: u64) {
        if to < self.0 {
            DAEMON_USE.fetch_sub(self.0 - to, Ordering::SeqCst);
            self.0 = to;
        }
    }

    fn bytes(&self) -> u64 {
        self.0
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        DAEMON_USE.fetch_sub(self.0, Ordering::SeqCst);
    }
}

/// What is retained of one stream of one cell: the first [`k::RETAIN_HEAD_BYTES`] and the
/// last [`k::RETAIN_TAIL_BYTES`] of its text, in chunks (consecutive pieces merged up to a
/// frame's [`MAX_OUTPUT_CHUNK`], keeping the first piece's `seq`), cut on characters; for
/// stdout also its cell's display bundles, whole, within the same bytes
/// ([`Kept::push_bundle`]).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    seen: u64,
    head: Vec<(u64, Piece)>,
    head_bytes: u64,
    tail: VecDeque<(u64, Piece)>,
    tail_bytes: u64,
    /// Bytes of display bundles seen, and of those held now (in `head_bytes + tail_bytes`).
    bundles_seen: u64,
    bundles_kept: u64,
    /// A bundle did not fit the head: what follows goes to the tail (the head stays a prefix
    /// of the stream, so a replay in `seq` order keeps every piece's place).
    head_closed: bool,
    /// The session's budget took this stream's output (counted as dropped).
    evicted: bool,
}

/// One retained piece of a stream: text, or a display bundle with the bytes of its `data`
/// JSON (never cut).
#[derive(Debug)]
enum Piece {
    Text(String),
    Bundle(Box<Display>, u64),
}

/// Appends `text` (frame `seq`) to the `last` chunk when the result still fits a frame; else
/// returns the new chunk to push.
fn push_merged(last: Option<&mut (u64, Piece)>, seq: u64, text: &str) -> Option<(u64, Piece)> {
    match last {
        Some((_, Piece::Text(t))) if t.len() + text.len() <= MAX_OUTPUT_CHUNK => {
            t.push_str(text);
            None
        }
        _ => Some((seq, Piece::Text(text.to_owned()))),
    }
}

impl Kept {
    /// Takes in the text of output frame `seq`.
    pub(crate) fn push(&mut self, seq: u64, mut text: &str) {
        self.seen += text.len() as u64;
        if self.evicted {
            return;
        }
        if !self.head_closed && self.head_bytes < k::RETAIN_HEAD_BYTES {
            let mut end = ((k::RETAIN_HEAD_BYTES - self.head_bytes) as usize).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let (h, rest) = text.split_at(end);
            if !h.is_empty() {
                if let Some(c) = push_merged(self.head.last_mut(), seq, h) {
                    self.head.push(c);
                }
                self.head_bytes += h.len() as u64;
            }
            text = rest;
        }
        if text.is_empty() {
            return;
        }
        if let Some(c) = push_merged(self.tail.back_mut(), seq, text) {
            self.tail.push_back(c);
        }
        self.tail_bytes += text.len() as u64;
        self.trim_tail();
    }

    /// Drops the oldest of the tail until it holds at most [`k::RETAIN_TAIL_BYTES`]: text is
    /// cut on a character boundary, a bundle goes whole.
    fn trim_tail(&mut self) {
        while self.tail_bytes > k::RETAIN_TAIL_BYTES {
            let excess = (self.tail_bytes - k::RETAIN_TAIL_BYTES) as usize;
            let Some(front) = self.tail.front_mut() else {
                break;
            };
            match &mut front.1 {
                Piece::Bundle(_, n) => {
                    let n = *n;
                    self.tail_bytes -= n;
                    self.bundles_kept -= n;
                    self.tail.pop_front();
                }
                Piece::Text(t) if t.len() <= excess => {
                    self.tail_bytes -= t.len() as u64;
                    self.tail.pop_front();
                }
                Piece::Text(t) => {
                    let mut cut = excess;
                    while !t.is_char_boundary(cut) {
                        cut += 1;
                    }
                    t.drain(..cut);
                    self.tail_bytes -= cut as u64;
                }
            }
        }
    }

    /// Retains display bundle `d` of `bytes` bytes (frame `d.seq`): whole in the head when it
    /// fits there, else at the end of the tail (older pieces leave it; the head takes nothing
    /// more); one bigger than the tail is retained as its text/plain with a note instead.
    pub(crate) fn push_bundle(&mut self, mut d: Display, mut bytes: u64) {
        self.bundles_seen += bytes;
        if self.evicted {
            return;
        }
        let seq = d.seq;
        if !self.head_closed && self.head_bytes + bytes <= k::RETAIN_HEAD_BYTES {
            self.head.push((seq, Piece::Bundle(Box::new(d), bytes)));
            self.head_bytes += bytes;
            self.bundles_kept += bytes;
            return;
        }
        self.head_closed = true;
        if bytes > k::RETAIN_TAIL_BYTES {
            d.data = k::display_fallback(&d.data);
            d.note = Some(format!(
                "bundle of {bytes} bytes over the {}-byte retention: text/plain only",
                k::RETAIN_TAIL_BYTES
            ));
            bytes = serde_json::to_vec(&d.data).map_or(u64::MAX, |v| v.len() as u64);
            if bytes > k::RETAIN_TAIL_BYTES {
                return;
            }
        }
        self.tail
            .push_back((seq, Piece::Bundle(Box::new(d), bytes)));
        self.tail_bytes += bytes;
        self.bundles_kept += bytes;
        self.trim_tail();
    }

    /// Bytes held (text and bundles).
    fn kept(&self) -> u64 {
        self.head_bytes + self.tail_bytes
    }

    /// The retained text chunks, head then tail: (`seq` of the chunk's first frame, text).
    /// Display bundles are left out ([`Kept::bundles`]).
    pub(crate) fn chunks(&self) -> impl Iterator<Item = (u64, &str)> {
        self.head
            .iter()
            .chain(self.tail.iter())
            .filter_map(|(q, p)| match p {
                Piece::Text(t) => Some((*q, t.as_str())),
                Piece::Bundle(..) => None,
            })
    }

    /// The retained display bundles, head then tail: (bundle, the bytes it counts).
    pub(crate) fn bundles(&self) -> impl Iterator<Item = (&Display, u64)> {
        self.head
            .iter()
            .chain(self.tail.iter())
            .filter_map(|(_, p)| match p {
                Piece::Bundle(d, n) => Some((&**d, *n)),
                Piece::Text(_) => None,
            })
    }

    /// Sets the bytes seen (a record rebuilt from a journal whose older output was already
    /// cut to its head and tail); never below what is kept.
    pub(crate) fn set_seen(&mut self, seen: u64) {
        self.seen = seen.max(self.kept());
    }

    /// The text's retention: seen, kept and dropped bytes.
    pub(crate) fn stats(&self) -> RetainedStats {
        let kept = self.kept() - self.bundles_kept;
        RetainedStats {
            seen: self.seen,
            kept,
            dropped: self.seen - kept,
        }
    }

    /// The bundles' retention, when the stream had any.
    fn bundle_stats(&self) -> Option<RetainedStats> {
        (self.bundles_seen > 0).then(|| RetainedStats {
            seen: self.bundles_seen,
            kept: self.bundles_kept,
            dropped: self.bundles_seen - self.bundles_kept,
        })
    }

    fn evict(&mut self) {
        self.head = Vec::new();
        self.tail = VecDeque::new();
        self.head_bytes = 0;
        self.tail_bytes = 0;
        self.bundles_kept = 0;
        self.evicted = true;
    }
}

/// The record of one cell.
#[derive(Debug)]
pub struct Record {
    cell: u64,
    streams: [Kept; 2],
    /// The retained copy of the result ([`trim_result`]), once the cell ended.
    result: Option<CellResult>,
    /// Bytes of `result` as JSON.
    result_bytes: u64,
    /// The cell's frames stopped without a result (the session ended first).
    lost: bool,
    /// The cell's last host call, until it is answered (`HostReply`) or the cell ends: an
    /// `Attach` replays it so the attached client can answer (a call that timed out since
    /// is replayed too; answering it is `NoSuchHostCall`). At most one call waits per cell.
    host_call: Option<HostCall>,
    /// Where live frames go.
    attach: Option<mpsc::Sender<Frame>>,
    /// Told when a newer `Attach` takes the cell over from `attach` (see [`Attachment`]).
    replaced: Option<oneshot::Sender<()>>,
    /// The attachment is the `Execute` that started the cell and the operator chose
    /// `interrupt_on_hangup`: its hang-up interrupts the cell.
    hangup_interrupts: bool,
    charge: Charge,
    /// Wakes the relay when the attachment changed.
    wake: Arc<Notify>,
}

impl Record {
    /// The record of a running cell `cell` retaining `streams`, charged `charge`, with no
    /// attachment.
    fn new(cell: u64, streams: [Kept; 2], charge: Charge) -> Record {
        Record {
            cell,
            streams,
            result: None,
            result_bytes: 0,
            lost: false,
            host_call: None,
            attach: None,
            replaced: None,
            hangup_interrupts: false,
            charge,
            wake: Arc::new(Notify::new()),
        }
    }

    fn done(&self) -> bool {
        self.result.is_some() || self.lost
    }

    fn retained(&self) -> Retained {
        Retained {
            stdout: self.streams[0].stats(),
            stderr: self.streams[1].stats(),
            displays: self.streams[0].bundle_stats(),
        }
    }

    /// The `state` of `CellStatus`.
    fn state(&self) -> String {
        match (&self.result, self.lost) {
            (Some(r), _) => r.status.as_str().to_owned(),
            (None, true) => "lost".to_owned(),
            (None, false) => "running".to_owned(),
        }
    }

    /// The result as `CellStatus` and `Attach` give it: with the retention counts of now.
    fn result(&self) -> Option<CellResult> {
        let mut r = self.result.clone()?;
        r.retained = Some(self.retained());
        Some(r)
    }

    /// The frames an `Attach` replays: `started`, the retained output and display bundles in
    /// `seq` order, then the result if the cell ended, else its unanswered host call if one
    /// waits.
    fn replay(&self, session: &str) -> Vec<Frame> {
        let mut out: Vec<(u64, Stream, &Piece)> = Vec::new();
        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
            let s = &self.streams[i];
            out.extend(s.head.iter().map(|(q, p)| (*q, stream, p)));
            out.extend(s.tail.iter().map(|(q, p)| (*q, stream, p)));
        }
        out.sort_by_key(|(q, ..)| *q);
        let mut frames = vec![Frame {
            started: Some(Started {
                session: session.to_owned(),
                cell: self.cell,
            }),
            ..Default::default()
        }];
        frames.extend(out.into_iter().map(|(seq, stream, piece)| match piece {
            Piece::Text(text) => Frame {
                output: Some(Output {
                    cell: self.cell,
                    seq,
                    stream,
                    text: text.clone(),
                }),
                ..Default::default()
            },
            Piece::Bundle(d, _) => Frame {
                display: Some((**d).clone()),
                ..Default::default()
            },
        }));
        if let Some(result) = self.result() {
            frames.push(Frame {
                result: Some(result),
                ..Default::default()
            });
        } else if let Some(h) = self.host_call.as_ref().filter(|_| !self.lost) {
            frames.push(Frame {
                host_call: Some(h.clone()),
                ..Default::default()
            });
        }
        frames
    }

    /// Drops the retained output (its bytes count as dropped); the result stays.
    fn evict_output(&mut self) {
        for s in &mut self.streams {
            s.evict();
        }
        let to = if self.done() {
            self.result_bytes
        } else {
            self.charge.bytes()
        };
        self.charge.shrink(to);
    }

    /// Takes in a frame on its way to the attachment: output is retained, a result gets the
    /// retention counts and its trimmed copy is kept; the charge shrinks to what is held.
    fn absorb(&mut self, frame: &mut Frame) {
        if let Some(h) = &frame.host_call {
            self.host_call = Some(h.clone());
        }
        if let Some(o) = &frame.output {
            let i = usize::from(o.stream == Stream::Stderr);
            self.streams[i].push(o.seq, &o.text);
        }
        if let Some(d) = &frame.display {
            // Counted as the cell counts it (`CellResult.displays`): its data's JSON text.
            let bytes = serde_json::to_vec(&d.data).map_or(0, |v| v.len() as u64);
            self.streams[0].push_bundle(d.clone(), bytes);
        }
        if let Some(r) = frame.result.as_mut() {
            self.host_call = None;
            r.retained = Some(self.retained());
            let copy = trim_result(r.clone());
            self.result_bytes = json_len(&copy);
            self.result = Some(copy);
            let kept = self.streams[0].kept() + self.streams[1].kept();
            self.charge.shrink(kept + self.result_bytes);
        }
    }
}

fn json_len(r: &CellResult) -> u64 {
    serde_json::to_vec(r).map(|v| v.len() as u64).unwrap_or(0)
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn cut(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// The copy of a result a record keeps: at most [`k::RETAINED_RESULT_BYTES`] of JSON. A
/// longer one loses `files` entries from the end, then its error texts and warnings are cut
/// (to 4 KiB each, 16 warnings of 1 KiB); a warning says what was left out.
fn trim_result(mut r: CellResult) -> CellResult {
    let max = k::RETAINED_RESULT_BYTES;
    if json_len(&r) <= max {
        return r;
    }
    let files = r.files.len();
    while !r.files.is_empty() && json_len(&r) > max - 256 {
        let n = r.files.len().div_ceil(8);
        r.files.truncate(r.files.len() - n);
    }
    if json_len(&r) > max - 256 {
        r.warnings.truncate(16);
        for w in &mut r.warnings {
            cut(w, 1024);
        }
        if let Some(e) = r.error.as_mut() {
            cut(&mut e.kind, 1024);
            cut(&mut e.message, 4096);
            if let Some(t) = e.traceback.as_mut() {
                cut(t, 4096);
            }
            if let Some(c) = e.call.as_mut() {
                cut(c, 1024);
            }
        }
    }
    r.warnings.push(format!(
        "the retained result was cut to {max} bytes ({} of {files} file entries kept)",
        r.files.len()
    ));
    r
}

/// The records of one session's cells, oldest first.
#[derive(Debug, Default)]
pub struct CellLog {
    records: Mutex<VecDeque<Arc<Mutex<Record>>>>,
}

/// Why a cell could not be given a record.
#[derive(Debug)]
pub struct NoRoom {
    /// Bytes charged daemon-wide.
    pub in_use: u64,
}

impl CellLog {
    /// Host call `call` was answered: an `Attach` no longer replays it.
    pub fn host_answered(&self, call: u64) {
        for rec in self.records.lock().unwrap().iter() {
            let mut r = rec.lock().unwrap();
            if r.host_call.as_ref().is_some_and(|h| h.call == call) {
                r.host_call = None;
            }
        }
    }

    fn get(&self, cell: u64) -> Option<Arc<Mutex<Record>>> {
        self.records
            .lock()
            .unwrap()
            .iter()
            .find(|r| r.lock().unwrap().cell == cell)
            .cloned()
    }

    /// Bytes the session's records hold or have reserved.
    pub fn bytes(&self) -> u64 {
        self.records
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.lock().unwrap().charge.bytes())
            .sum()
    }

    /// Number of records (finished and running).
    pub fn len(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    /// Whether the session has no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes room for `need` more bytes within [`k::SESSION_RETAINED_BYTES`] (or all the
    /// room there is, with `everything`): evicts finished cells' output, oldest first, then
    /// their records; and keeps at most [`k::RESULTS_KEPT`] finished records.
    fn make_room(&self, need: u64, everything: bool) {
        let mut recs = self.records.lock().unwrap();
        let mut finished = recs.iter().filter(|r| r.lock().unwrap().done()).count();
        while finished > k::RESULTS_KEPT {
            let Some(i) = recs.iter().position(|r| r.lock().unwrap().done()) else {
                break;
            };
            recs.remove(i);
            finished -= 1;
        }
        let total = |recs: &VecDeque<Arc<Mutex<Record>>>| -> u64 {
            recs.iter().map(|r| r.lock().unwrap().charge.bytes()).sum()
        };
        for r in recs.iter() {
            if !everything && total(&recs) + need <= k::SESSION_RETAINED_BYTES {
                return;
            }
            let mut r = r.lock().unwrap();
            if r.done() {
                r.evict_output();
            }
        }
        while total(&recs) + need > k::SESSION_RETAINED_BYTES {
            let Some(i) = recs.iter().position(|r| r.lock().unwrap().done()) else {
                break;
            };
            recs.remove(i);
        }
    }

    /// Reserves [`RESERVE`] bytes for a new cell's record: room is made in the session first
    /// ([`CellLog::make_room`]); when the daemon-wide budget still has no room, the session's
    /// own finished output goes too, and then it is refused.
    pub fn reserve(&self) -> Result<Charge, NoRoom> {
        self.make_room(RESERVE, false);
        Charge::new(RESERVE).or_else(|_| {
            self.make_room(RESERVE, true);
            Charge::new(RESERVE).map_err(|in_use| NoRoom { in_use })
        })
    }

    /// `CellStatus`: (state, result), or `None` for a cell without a record.
    pub fn status(&self, cell: u64) -> Option<(String, Option<CellResult>)> {
        let rec = self.get(cell)?;
        let r = rec.lock().unwrap();
        Some((r.state(), r.result()))
    }

    /// `Attach`: the frames to replay (ending with the result if the cell ended), and, for a
    /// running cell, `to` becomes its attachment; an older one is told it was replaced
    /// (its `replaced` fires). `None` for a cell without a record.
    pub fn attach(&self, session: &str, cell: u64, to: Attachment) -> Option<Vec<Frame>> {
        self.attach_or_return(session, cell, to).ok()
    }

    /// [`CellLog::attach`], giving `to` back when the cell has no record.
    pub fn attach_or_return(
        &self,
        session: &str,
        cell: u64,
        to: Attachment,
    ) -> Result<Vec<Frame>, Attachment> {
        let Some(rec) = self.get(cell) else {
            return Err(to);
        };
        let mut r = rec.lock().unwrap();
        let replay = r.replay(session);
        if !r.done() {
            r.attach = Some(to.frames);
            if let Some(old) = r.replaced.replace(to.replaced) {
                let _ = old.send(());
            }
            r.hangup_interrupts = false;
            r.wake.notify_one();
        }
        Ok(replay)
    }
}

/// A client following a cell (`Execute` on a detached session, `Attach`): its frames go to
/// `frames`; `replaced` fires when a newer `Attach` takes the cell over, after which nothing
/// more is sent to `frames` (what is already queued there is still the client's). Dropped
/// without firing when the cell ends or the client hangs up.
pub struct Attachment {
    /// Where the cell's live frames go.
    pub frames: mpsc::Sender<Frame>,
    /// Fires once, when a newer attachment replaces this one.
    pub replaced: oneshot::Sender<()>,
}

/// Starts the relay of a cell whose frames the actor sends on `rx` (see the module
/// documentation): its record, charged `charge`, joins `session`'s log when the `started`
/// frame arrives, and the cell's number is sent on the returned channel (which closes
/// without one when the session ended before the cell started). `attach` is the first
/// attachment (an `Execute`'s client); `hangup_interrupts`: its hang-up interrupts the cell.
pub fn relay<S: Host>(
    session: Arc<S>,
    mut rx: mpsc::Receiver<Frame>,
    attach: Option<Attachment>,
    hangup_interrupts: bool,
    charge: Charge,
) -> oneshot::Receiver<u64> {
    let (started_tx, started_rx) = oneshot::channel();
    let (attach, replaced) = match attach {
        Some(a) => (Some(a.frames), Some(a.replaced)),
        None => (None, None),
    };
    tokio::spawn(async move {
        let Some(first) = rx.recv().await else {
            return;
        };
        let Some(cell) = first.started.as_ref().map(|s| s.cell) else {
            return;
        };
        let mut r = Record::new(cell, Default::default(), charge);
        r.attach = attach.clone();
        r.replaced = replaced;
        r.hangup_interrupts = hangup_interrupts;
        let wake = r.wake.clone();
        let rec = Arc::new(Mutex::new(r));
        session.log().records.lock().unwrap().push_back(rec.clone());
        let _ = started_tx.send(cell);
        if let Some(tx) = attach {
            deliver(&session, &rec, &wake, tx, first).await;
        }
        relay_loop(session, rec, wake, rx).await;
    });
    started_rx
}

/// The relay of cell `cell` of `session` continued by a successor daemon: its record holds
/// `streams` (rebuilt from the cell's journal) and joins the session's log now, charged
/// `charge`; the actor's frames come on `rx` (no `started` frame: an `Attach` replays it).
pub(crate) fn resume<S: Host>(
    session: Arc<S>,
    rx: mpsc::Receiver<Frame>,
    cell: u64,
    streams: [Kept; 2],
    charge: Charge,
) {
    let r = Record::new(cell, streams, charge);
    let wake = r.wake.clone();
    let rec = Arc::new(Mutex::new(r));
    session.log().records.lock().unwrap().push_back(rec.clone());
    tokio::spawn(relay_loop(session, rec, wake, rx));
}

/// The record of cell `cell` of `session` that ended before a successor daemon started: its
/// `streams` (from the cell's journal) and `result`, charged `charge`, join the session's log
/// whole, before any client can ask (`CellStatus` and `Attach` answer it at once; no relay).
pub(crate) fn ended<S: Host>(
    session: &Arc<S>,
    cell: u64,
    streams: [Kept; 2],
    result: CellResult,
    charge: Charge,
) {
    let mut rec = Record::new(cell, streams, charge);
    rec.absorb(&mut Frame {
        result: Some(result),
        ..Default::default()
    });
    session
        .log()
        .records
        .lock()
        .unwrap()
        .push_back(Arc::new(Mutex::new(rec)));
    session.log().make_room(0, false);
}

/// The relay's loop (module documentation): takes in each frame, hands it to the
/// attachment, until the result or the end of the frames.
async fn relay_loop<S: Host>(
    session: Arc<S>,
    rec: Arc<Mutex<Record>>,
    wake: Arc<Notify>,
    mut rx: mpsc::Receiver<Frame>,
) {
    loop {
        let target = rec.lock().unwrap().attach.clone();
        tokio::select! {
            frame = rx.recv() => {
                let Some(mut frame) = frame else {
                    let mut r = rec.lock().unwrap();
                    if !r.done() {
                        r.lost = true;
                        r.attach = None;
                        r.replaced = None;
                        let to = r.streams[0].kept() + r.streams[1].kept();
                        r.charge.shrink(to);
                    }
                    break;
                };
                let last = frame.result.is_some();
                let target = {
                    let mut r = rec.lock().unwrap();
                    r.absorb(&mut frame);
                    r.attach.clone()
                };
                if let Some(tx) = target {
                    deliver(&session, &rec, &wake, tx, frame).await;
                }
                if last {
                    let mut r = rec.lock().unwrap();
                    r.attach = None;
                    r.replaced = None;
                    drop(r);
                    session.log().make_room(0, false);
                    break;
                }
            }
            () = attachment_closed(&target) => {
                if let Some(tx) = &target {
                    hung_up(&session, &rec, tx);
                }
            }
            () = wake.notified() => {}
        }
    }
}

async fn attachment_closed(target: &Option<mpsc::Sender<Frame>>) {
    match target {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

/// Sends `frame` to the attachment `tx`, unless a newer attachment replaces it meanwhile
/// (the frame was taken into the retention before, so the newer one's replay has it).
///
/// A wake-up alone is no replacement: `Attach` wakes the relay when it sets an attachment,
/// and a wake-up that found the relay busy is kept by the `Notify` until the next wait, here,
/// for the very attachment it announced. Only an attachment that is no longer `tx` ends the
/// send; otherwise dropping the frame would lose it for the client that attached last (its
/// replay was taken before the frame arrived).
async fn deliver<S: Host>(
    session: &Arc<S>,
    rec: &Arc<Mutex<Record>>,
    wake: &Notify,
    tx: mpsc::Sender<Frame>,
    frame: Frame,
) {
    let send = tx.send(frame);
    tokio::pin!(send);
    loop {
        tokio::select! {
            sent = &mut send => {
                if sent.is_err() {
                    hung_up(session, rec, &tx);
                }
                return;
            }
            () = wake.notified() => {
                let current = rec
                    .lock()
                    .unwrap()
                    .attach
                    .as_ref()
                    .is_some_and(|a| a.same_channel(&tx));
                if !current {
                    return;
                }
            }
        }
    }
}

/// The attachment `tx` went away: the cell runs on unattached, or, when it was the
/// `Execute` that started it and the operator chose `interrupt_on_hangup`, is interrupted.
fn hung_up<S: Host>(session: &Arc<S>, rec: &Arc<Mutex<Record>>, tx: &mpsc::Sender<Frame>) {
    let (cell, interrupt) = {
        let mut r = rec.lock().unwrap();
        if !r.attach.as_ref().is_some_and(|a| a.same_channel(tx)) {
            return;
        }
        r.attach = None;
        r.replaced = None;
        (r.cell, std::mem::take(&mut r.hangup_interrupts))
    };
    if interrupt {
        tracing::info!(session = %session.id(), cell, "client gone during the cell: interrupting it (interrupt_on_hangup)");
        let s = session.clone();
        tokio::spawn(async move {
            s.interrupt_cell(cell).await;
        });
    } else {
        tracing::info!(session = %session.id(), cell, "client gone during the cell: it runs on, its output retained");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session as the relay sees it: an id and a cell log.
    #[derive(Default)]
    struct TestHost {
        log: CellLog,
    }

    impl Host for TestHost {
        fn id(&self) -> &str {
            "test"
        }
        fn log(&self) -> &CellLog {
            &self.log
        }
        async fn interrupt_cell(&self, _cell: u64) {}
    }

    /// The result of cell `cell` that ended `ok` with nothing to report.
    fn ok_result(cell: u64) -> CellResult {
        CellResult {
            cell,
            status: k::Status::Ok,
            error: None,
            exit_code: None,
            usage: Default::default(),
            stdout: Default::default(),
            stderr: Default::default(),
            state: k::State::Kept,
            session_ended: false,
            warnings: Vec::new(),
            files: Vec::new(),
            displays: None,
            retained: None,
        }
    }

    fn text(seq: u64, t: &str) -> Frame {
        Frame {
            output: Some(Output {
                cell: 5,
                seq,
                stream: Stream::Stdout,
                text: t.into(),
            }),
            ..Default::default()
        }
    }

    /// A client attaches to a continued cell while its relay is busy (the wake-up of the
    /// `Attach` is kept for the relay's next wait): every frame after the replay still
    /// reaches that client, once, in order. The wake-up used to be taken for a replacement,
    /// and the frame being delivered was dropped: a line lost for the client that attached.
    #[tokio::test]
    async fn an_attach_that_finds_the_relay_busy_loses_no_frame() {
        for _ in 0..50 {
            let host = Arc::new(TestHost::default());
            let (tx, rx) = mpsc::channel(16);
            let mut kept: [Kept; 2] = Default::default();
            kept[0].push(0, "0\n");
            resume(host.clone(), rx, 5, kept, Charge::new(0).unwrap());
            // Attach: the replay, then the attachment, whose wake-up nobody waits for yet
            // when the relay is still busy with its start.
            let (frames, mut got) = mpsc::channel(64);
            let (replaced, _r) = oneshot::channel();
            let replay = host
                .log
                .attach("test", 5, Attachment { frames, replaced })
                .unwrap();
            let mut out: String = replay
                .iter()
                .filter_map(|f| f.output.as_ref().map(|o| o.text.clone()))
                .collect();
            for (i, t) in ["1\n", "2\n", "3\n"].iter().enumerate() {
                tx.send(text(i as u64 + 1, t)).await.unwrap();
            }
            tx.send(Frame {
                result: Some(ok_result(5)),
                ..Default::default()
            })
            .await
            .unwrap();
            loop {
                let f = tokio::time::timeout(std::time::Duration::from_secs(5), got.recv())
                    .await
                    .expect("the relay delivers the result")
                    .expect("the attachment stays until the result");
                if let Some(o) = &f.output {
                    out.push_str(&o.text);
                }
                if f.result.is_some() {
                    break;
                }
            }
            assert_eq!(out, "0\n1\n2\n3\n");
        }
    }

    #[test]
    fn a_flood_keeps_head_and_tail_with_exact_counts() {
        let mut s = Kept::default();
        let line = "0123456789abcdef".repeat(64); // 1 KiB
        for seq in 0..1000u64 {
            s.push(seq, &line);
        }
        let st = s.stats();
        assert_eq!(st.seen, 1000 * 1024);
        assert_eq!(st.kept, k::RETAIN_HEAD_BYTES + k::RETAIN_TAIL_BYTES);
        assert_eq!(st.seen, st.kept + st.dropped);
        assert_eq!(s.head[0].0, 0, "the head starts with the first frame");
        assert!(s.tail.len() <= 2, "{} tail chunks", s.tail.len());
        let tail: String = s
            .tail
            .iter()
            .map(|(_, p)| match p {
                Piece::Text(t) => t.as_str(),
                Piece::Bundle(..) => "",
            })
            .collect();
        assert!(tail.ends_with(&line));
        // Characters are never cut.
        let mut u = Kept::default();
        for seq in 0..100_000u64 {
            u.push(seq, "✓");
        }
        assert!(u.head_bytes <= k::RETAIN_HEAD_BYTES && u.tail_bytes <= k::RETAIN_TAIL_BYTES);
        assert_eq!(u.stats().seen, 300_000);
        u.evict();
        assert_eq!(u.stats().dropped, 300_000);
    }

    fn bundle(seq: u64, png_bytes: usize) -> (Display, u64) {
        let mut data = serde_json::Map::new();
        data.insert("text/plain".into(), format!("<plot {seq}>").into());
        data.insert("image/png".into(), "A".repeat(png_bytes).into());
        let n = serde_json::to_vec(&data).unwrap().len() as u64;
        let d = Display {
            cell: 1,
            seq,
            kind: k::DisplayKind::Display,
            data,
            metadata: Default::default(),
            note: None,
        };
        (d, n)
    }

    #[test]
    fn bundles_share_stdouts_retention_whole_with_exact_counts() {
        let mut s = Kept::default();
        let mut seen = 0;
        // A small bundle in the head, one over the tail as its text/plain with a note, then
        // text and bundles enough to push the early tail out whole.
        let (d, n) = bundle(0, 1000);
        seen += n;
        s.push_bundle(d, n);
        s.push(1, &"x".repeat(60 * 1024));
        let (d, n) = bundle(2, 100 * 1024);
        seen += n;
        s.push_bundle(d, n);
        let fallback = s.tail.back().map(|(_, p)| match p {
            Piece::Bundle(d, n) => (d.data.len(), d.note.clone(), *n),
            Piece::Text(_) => panic!("a bundle"),
        });
        let (types, note, fb) = fallback.unwrap();
        assert_eq!(types, 1);
        assert!(note.unwrap().contains("retention: text/plain only"));
        for seq in 3..20 {
            let (d, n) = bundle(seq, 10 * 1024);
            seen += n;
            s.push_bundle(d, n);
        }
        let st = s.bundle_stats().unwrap();
        assert_eq!(st.seen, seen);
        assert_eq!(st.seen, st.kept + st.dropped);
        assert!(s.kept() <= k::RETAIN_HEAD_BYTES + k::RETAIN_TAIL_BYTES);
        // Only whole bundles: the head's first, the newest in the tail; the fallback is gone.
        let held: Vec<u64> = s
            .head
            .iter()
            .chain(s.tail.iter())
            .filter_map(|(q, p)| matches!(p, Piece::Bundle(..)).then_some(*q))
            .collect();
        assert_eq!(held[0], 0);
        assert_eq!(*held.last().unwrap(), 19);
        assert!(!held.contains(&2), "{held:?}");
        let kept_bundles: u64 = s
            .head
            .iter()
            .chain(s.tail.iter())
            .filter_map(|(_, p)| match p {
                Piece::Bundle(_, n) => Some(*n),
                Piece::Text(_) => None,
            })
            .sum();
        assert_eq!(kept_bundles, st.kept);
        assert!(fb < 100);
        // Text counts stay apart and exact.
        let t = s.stats();
        assert_eq!(t.seen, 60 * 1024);
        assert_eq!(t.seen, t.kept + t.dropped);
        s.evict();
        assert_eq!(s.bundle_stats().unwrap().dropped, seen);
    }

    #[test]
    fn the_daemon_budget_is_a_hard_cap() {
        let mut held = Vec::new();
        while let Ok(c) = Charge::new(RESERVE) {
            held.push(c);
        }
        assert!(daemon_use() <= k::DAEMON_RETAINED_BYTES);
        assert!(daemon_use() + RESERVE > k::DAEMON_RETAINED_BYTES);
        let n = held.len() as u64;
        assert_eq!(n, k::DAEMON_RETAINED_BYTES / RESERVE);
        held.truncate(1);
        held[0].shrink(10);
        assert!(Charge::new(RESERVE).is_ok());
    }

    #[test]
    fn a_big_result_is_trimmed_for_retention() {
        let r = CellResult {
            warnings: vec!["w".repeat(100_000)],
            files: (0..1000)
                .map(|i| k::FileInfo {
                    name: format!("{i:01000}"),
                    size: 1,
                    media_type: "text/plain".into(),
                    kind: k::FileKind::File,
                    modified: 0.0,
                })
                .collect(),
            ..ok_result(1)
        };
        let t = trim_result(r);
        assert!(json_len(&t) <= k::RETAINED_RESULT_BYTES, "{}", json_len(&t));
    }
}
