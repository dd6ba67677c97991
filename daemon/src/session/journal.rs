//! The journal of a running cell whose output is retained (`Submit`, or `Execute` on a
//! detached session), so that a successor daemon continues the cell with everything it
//! retained before: a daemon killed with SIGKILL gets no chance to write anything at its end,
//! so the journal is written as the output leaves the actor.
//!
//! One file per session, `<adopt_dir>/<id>.cell` (`records::journal_path`), mode 0600 in the
//! root-only adoption directory, created when the cell's request has reached the worker and
//! removed when the cell ends. It is a sequence of binary entries (little-endian), appended
//! with one `write(2)` per batch of frames:
//!
//! - output: tag `1`, stream (`0` stdout, `1` stderr), the frame's `seq` (u64), the text's
//!   length (u32), the text (UTF-8);
//! - display bundle (`rich_output`): tag `3`, the frame's `seq` (u64), the bytes the bundle
//!   counts (its data's JSON text, u64), the length of the `Display` as JSON (u32), that JSON
//!   (the display frame as a client gets it, so an `Attach` after a restart replays it);
//! - counts: tag `2`, the next frame's `seq` (u64), bytes the actor held but had not yet sent
//!   (u64), per stream the cap's state (cap, seen, kept as u64, then the held-back incomplete
//!   UTF-8 tail: its length (u8, at most 3) and bytes), display bundles (u8 flag, seen and
//!   kept as u64), and per stream the bytes of output frames sent (u64, what the relay's
//!   retention counts as seen).
//!
//! - spool offsets (`spool.rs`): tag `4`, then per spool (stdout, stderr, replies) the bytes
//!   of it the batch accounts for (u64); written just before the counts entry of every batch
//!   of a cell whose pipes are spooled, so a successor continues each stream exactly there.
//!
//! - the cell's result, once it ended: tag `5`, the length of the `CellResult` as JSON (u32),
//!   that JSON; in the cell's last batch, with the frames that precede the result. The file
//!   then stays (until the session's next retained cell starts or the session ends), so a
//!   successor that comes before a client fetched the result still answers `CellStatus` and
//!   `Attach` for it.
//!
//! Every batch ends with a counts entry, so a reader keeps what precedes the last complete
//! counts entry and ignores the rest (a write cut by the daemon's death). The file never
//! exceeds [`records::JOURNAL_MAX_BYTES`] (the per-session retention bound): when a batch
//! would pass it, the file is rewritten (a temporary renamed over it) with what the relay
//! retains, the first and last 64 KiB of each stream (`cells::Kept`), and the batch's counts.
//! A write that fails is logged once and ends the journal (the file is removed): the cell
//! runs on, never waiting for a write, and a successor continues it without the output
//! retained before its start, and says so in the result.

use crate::cells::Kept;
use crate::records;
use sandcell_proto::kernel::Display;
use sandcell_proto::worker::Stream;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

const TAG_OUTPUT: u8 = 1;
const TAG_COUNTS: u8 = 2;
const TAG_DISPLAY: u8 = 3;
const TAG_SPOOL: u8 = 4;
const TAG_RESULT: u8 = 5;

/// A stream cap's state ([`crate::worker::output::StreamCap::snapshot`]).
pub(crate) type CapState = (u64, u64, u64, Vec<u8>);

/// The counts of a running cell at the end of a batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Counts {
    /// The `seq` of the next frame.
    pub(crate) next_seq: u64,
    /// Bytes of output the actor held for the relay and had not sent (lost if the daemon
    /// died before sending them).
    pub(crate) unsent: u64,
    /// stdout's and stderr's caps.
    pub(crate) caps: [CapState; 2],
    /// Display bundles: bytes seen and kept, with `rich_output`.
    pub(crate) displays: Option<(u64, u64)>,
    /// Bytes of output frames sent per stream.
    pub(crate) sent: [u64; 2],
}

/// What a journal holds: the output frames (seq, stream, text) in order, the display
/// bundles (with the bytes each counts) in order, and the last counts.
#[derive(Debug, Default)]
pub(crate) struct Restored {
    pub(crate) outputs: Vec<(u64, Stream, String)>,
    pub(crate) displays: Vec<(Display, u64)>,
    pub(crate) counts: Option<Counts>,
    /// The spool offsets of the last batch (`spool.rs`), when the cell's pipes were spooled.
    pub(crate) spool: Option<[u64; 3]>,
    /// The cell's result, when it ended.
    pub(crate) result: Option<sandcell_proto::kernel::CellResult>,
}

impl Restored {
    /// The relay's retention of each stream rebuilt from the journal: output and bundles
    /// taken in `seq` order, as the relay took them.
    pub(crate) fn retention(&self) -> [Kept; 2] {
        let mut kept: [Kept; 2] = Default::default();
        let (mut o, mut d) = (
            self.outputs.iter().peekable(),
            self.displays.iter().peekable(),
        );
        loop {
            let bundle_first = match (o.peek(), d.peek()) {
                (Some(a), Some(b)) => b.0.seq < a.0,
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (None, None) => break,
            };
            if bundle_first {
                let (b, bytes) = d.next().unwrap();
                kept[0].push_bundle(b.clone(), *bytes);
            } else {
                let (seq, stream, text) = o.next().unwrap();
                kept[idx(*stream)].push(*seq, text);
            }
        }
        if let Some(c) = &self.counts {
            for (i, k) in kept.iter_mut().enumerate() {
                k.set_seen(c.sent[i]);
            }
        }
        kept
    }
}

fn idx(s: Stream) -> usize {
    usize::from(s == Stream::Stderr)
}

fn put_output(buf: &mut Vec<u8>, seq: u64, stream: Stream, text: &str) {
    buf.push(TAG_OUTPUT);
    buf.push(idx(stream) as u8);
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(text.len() as u32).to_le_bytes());
    buf.extend_from_slice(text.as_bytes());
}

fn put_display(buf: &mut Vec<u8>, d: &Display, bytes: u64) {
    let Ok(json) = serde_json::to_vec(d) else {
        return;
    };
    buf.push(TAG_DISPLAY);
    buf.extend_from_slice(&d.seq.to_le_bytes());
    buf.extend_from_slice(&bytes.to_le_bytes());
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&json);
}

fn put_spool(buf: &mut Vec<u8>, at: &[u64; 3]) {
    buf.push(TAG_SPOOL);
    for v in at {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

fn put_counts(buf: &mut Vec<u8>, c: &Counts) {
    buf.push(TAG_COUNTS);
    buf.extend_from_slice(&c.next_seq.to_le_bytes());
    buf.extend_from_slice(&c.unsent.to_le_bytes());
    for (cap, seen, kept, pending) in &c.caps {
        for v in [cap, seen, kept] {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        let p = &pending[..pending.len().min(3)];
        buf.push(p.len() as u8);
        buf.extend_from_slice(p);
    }
    let (flag, (seen, kept)) = match c.displays {
        Some(d) => (1u8, d),
        None => (0, (0, 0)),
    };
    buf.push(flag);
    buf.extend_from_slice(&seen.to_le_bytes());
    buf.extend_from_slice(&kept.to_le_bytes());
    for v in c.sent {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

/// A cursor over journal bytes; every read is bounds-checked.
struct Cur<'a>(&'a [u8]);

impl Cur<'_> {
    fn bytes(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.bytes(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

fn counts_of(c: &mut Cur<'_>) -> Option<Counts> {
    let next_seq = c.u64()?;
    let unsent = c.u64()?;
    let mut cap = || -> Option<CapState> {
        let (a, b, k) = (c.u64()?, c.u64()?, c.u64()?);
        let n = c.u8()? as usize;
        if n > 3 {
            return None;
        }
        Some((a, b, k, c.bytes(n)?.to_vec()))
    };
    let caps = [cap()?, cap()?];
    let flag = c.u8()?;
    let (seen, kept) = (c.u64()?, c.u64()?);
    let sent = [c.u64()?, c.u64()?];
    Some(Counts {
        next_seq,
        unsent,
        caps,
        displays: (flag == 1).then_some((seen, kept)),
        sent,
    })
}

/// Parses journal bytes: the output entries before the last complete counts entry, and that
/// entry. Stops at the first entry that is cut or malformed.
pub(crate) fn parse(bytes: &[u8]) -> Restored {
    let mut c = Cur(bytes);
    let mut out = Restored::default();
    let mut pending: Vec<(u64, Stream, String)> = Vec::new();
    let mut bundles: Vec<(Display, u64)> = Vec::new();
    let mut spool: Option<[u64; 3]> = None;
    let mut result = None;
    loop {
        let step = (|| -> Option<bool> {
            match c.u8()? {
                TAG_OUTPUT => {
                    let stream = match c.u8()? {
                        0 => Stream::Stdout,
                        1 => Stream::Stderr,
                        _ => return None,
                    };
                    let seq = c.u64()?;
                    let n = c.u32()? as usize;
                    let text = std::str::from_utf8(c.bytes(n)?).ok()?.to_owned();
                    pending.push((seq, stream, text));
                    Some(true)
                }
                TAG_DISPLAY => {
                    let seq = c.u64()?;
                    let bytes = c.u64()?;
                    let n = c.u32()? as usize;
                    let d: Display = serde_json::from_slice(c.bytes(n)?).ok()?;
                    if d.seq != seq {
                        return None;
                    }
                    bundles.push((d, bytes));
                    Some(true)
                }
                TAG_SPOOL => {
                    spool = Some([c.u64()?, c.u64()?, c.u64()?]);
                    Some(true)
                }
                TAG_RESULT => {
                    let n = c.u32()? as usize;
                    result = Some(serde_json::from_slice(c.bytes(n)?).ok()?);
                    Some(true)
                }
                TAG_COUNTS => {
                    let counts = counts_of(&mut c)?;
                    out.outputs.append(&mut pending);
                    out.displays.append(&mut bundles);
                    out.counts = Some(counts);
                    out.spool = spool.take();
                    if let Some(r) = result.take() {
                        out.result = Some(r);
                    }
                    Some(true)
                }
                _ => None,
            }
        })();
        if step != Some(true) {
            break;
        }
    }
    out
}

/// Reads the journal at `path` (at most [`records::JOURNAL_MAX_BYTES`] plus 1 MiB; it never
/// holds more than the former).
///
/// Errors: the file cannot be opened or read, is not a root-only regular file, or is longer.
pub(crate) fn read(path: &Path) -> std::io::Result<Restored> {
    read_root_only(path, records::JOURNAL_MAX_BYTES + 1024 * 1024).map(|b| parse(&b))
}

/// Reads a root-only regular file of at most `max` bytes (longer: an error).
///
/// Errors: it cannot be opened or read, is not root's, or is longer.
fn read_root_only(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != 0 || m.mode() & 0o077 != 0 {
        return Err(std::io::Error::other("not a root-only regular file"));
    }
    let mut buf = Vec::new();
    f.take(max + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(std::io::Error::other(format!("longer than {max} bytes")));
    }
    Ok(buf)
}

/// Writes the listing before a running cell (`records::before_path`): a temporary file, mode
/// 0600, renamed into place.
///
/// Errors: the file cannot be written or renamed.
pub(crate) fn write_before(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("before.tmp");
    let mut f = create(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Reads the listing before the running cell at `path` (root-only, at most
/// [`crate::files::MAX_STAMPS_BYTES`]).
///
/// Errors: it cannot be read or trusted, or does not parse.
pub(crate) fn read_before(path: &Path) -> std::io::Result<crate::files::Listing> {
    let b = read_root_only(path, crate::files::MAX_STAMPS_BYTES as u64)?;
    crate::files::Listing::decode_stamps(&b)
        .ok_or_else(|| std::io::Error::other("a malformed listing"))
}

/// Most reply bytes handed over: a reader holds at most one line of
/// [`sandcell_proto::worker::MAX_WORKER_LINE`] and the rest of one read.
pub(crate) const MAX_REST_BYTES: u64 = sandcell_proto::worker::MAX_WORKER_LINE as u64 + 256 * 1024;

/// Writes the reply bytes handed over (`records::rest_path`): a temporary file, mode 0600,
/// renamed into place, so a successor finds all of them or none.
///
/// Errors: the file cannot be written or renamed.
pub(crate) fn write_rest(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("rest.tmp");
    let mut f = create(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Takes the reply bytes handed over at `path` (the file is removed): `None` when there are
/// none (the predecessor did not exit keeping its sessions, or had no cell running).
///
/// Errors: the file is there but cannot be trusted or read.
pub(crate) fn take_rest(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let got = match read_root_only(path, MAX_REST_BYTES) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
    };
    let _ = std::fs::remove_file(path);
    Ok(got)
}

fn create(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// The writer of one cell's journal, owned by the cell's state in the actor.
#[derive(Debug)]
pub(crate) struct Journal {
    path: PathBuf,
    file: Option<std::fs::File>,
    bytes: u64,
    batch: Vec<u8>,
    session: String,
    /// The spool offsets every batch records (`spool.rs`), when the cell's pipes are spooled.
    spool: Option<[u64; 3]>,
}

impl Journal {
    /// A journal of session `session` at `path` with no file open yet, recording `spool`.
    fn closed(path: PathBuf, session: &str, spool: Option<[u64; 3]>) -> Journal {
        Journal {
            file: None,
            path,
            bytes: 0,
            batch: Vec::new(),
            session: session.to_owned(),
            spool,
        }
    }

    /// A new, empty journal at `path` (an older one is replaced). A file that cannot be made
    /// leaves the journal ended (logged).
    pub(crate) fn create(path: PathBuf, session: &str) -> Journal {
        let mut j = Journal::closed(path, session, None);
        match create(&j.path) {
            Ok(f) => j.file = Some(f),
            Err(e) => j.fail(&e),
        }
        j
    }

    /// The journal of a cell a successor continues: rewritten from what it held (`r`, without
    /// any entry the predecessor's death cut) through a temporary file renamed over it (a
    /// successor killed meanwhile leaves the old journal whole), and appended to from then
    /// on. Its batches record `r`'s spool offsets until [`Journal::set_spool`] moves them.
    pub(crate) fn resume(path: PathBuf, session: &str, r: &Restored) -> Journal {
        let mut j = Journal::closed(path, session, r.spool);
        let mut buf = Vec::new();
        if let Some(c) = &r.counts {
            for (seq, stream, text) in &r.outputs {
                put_output(&mut buf, *seq, *stream, text);
            }
            for (d, bytes) in &r.displays {
                put_display(&mut buf, d, *bytes);
            }
            if let Some(at) = &r.spool {
                put_spool(&mut buf, at);
            }
            put_counts(&mut buf, c);
        }
        let tmp = j.path.with_extension("cell.tmp");
        let made = create(&tmp).and_then(|mut f| {
            f.write_all(&buf)?;
            std::fs::rename(&tmp, &j.path)?;
            Ok(f)
        });
        match made {
            Ok(f) => {
                j.file = Some(f);
                j.bytes = buf.len() as u64;
            }
            Err(e) => j.fail(&e),
        }
        j
    }

    /// Whether the journal is still written (it ends at its first failed write).
    pub(crate) fn is_live(&self) -> bool {
        self.file.is_some()
    }

    /// The spool offsets the next batches record (`spool.rs`).
    pub(crate) fn set_spool(&mut self, at: [u64; 3]) {
        self.spool = Some(at);
    }

    /// Adds the cell's result to the batch (its last).
    pub(crate) fn result(&mut self, r: &sandcell_proto::kernel::CellResult) {
        if self.file.is_none() {
            return;
        }
        let Ok(json) = serde_json::to_vec(r) else {
            return;
        };
        self.batch.push(TAG_RESULT);
        self.batch
            .extend_from_slice(&(json.len() as u32).to_le_bytes());
        self.batch.extend_from_slice(&json);
    }

    /// The spool ended: the next batches record no offsets, and a successor continues the
    /// cell as one without a spool.
    pub(crate) fn clear_spool(&mut self) {
        self.spool = None;
    }

    /// Adds an output frame to the batch.
    pub(crate) fn output(&mut self, seq: u64, stream: Stream, text: &str) {
        if self.file.is_some() {
            put_output(&mut self.batch, seq, stream, text);
        }
    }

    /// Adds a display frame (`d.seq` set) counting `bytes` to the batch.
    pub(crate) fn display(&mut self, d: &Display, bytes: u64) {
        if self.file.is_some() {
            put_display(&mut self.batch, d, bytes);
        }
    }

    /// Ends the batch with `counts` and writes it (one `write(2)`); rewrites the file first
    /// when the batch would take it over [`records::JOURNAL_MAX_BYTES`].
    pub(crate) fn commit(&mut self, counts: &Counts) {
        if self.file.is_none() {
            self.batch.clear();
            return;
        }
        let mut batch = std::mem::take(&mut self.batch);
        if let Some(at) = &self.spool {
            put_spool(&mut batch, at);
        }
        put_counts(&mut batch, counts);
        if self.bytes + batch.len() as u64 > records::JOURNAL_MAX_BYTES {
            if let Err(e) = self.compact(&batch) {
                self.fail(&e);
            }
            return;
        }
        self.write(&batch);
    }

    fn write(&mut self, buf: &[u8]) {
        let Some(f) = self.file.as_mut() else { return };
        match f.write_all(buf) {
            Ok(()) => self.bytes += buf.len() as u64,
            Err(e) => self.fail(&e),
        }
    }

    /// Rewrites the journal as what the relay retains of it and of `batch` (which ends with
    /// its counts), through a temporary file renamed over it.
    fn compact(&mut self, batch: &[u8]) -> std::io::Result<()> {
        let mut all = Vec::new();
        std::fs::File::open(&self.path)?
            .take(records::JOURNAL_MAX_BYTES + 1024 * 1024)
            .read_to_end(&mut all)?;
        all.extend_from_slice(batch);
        let r = parse(&all);
        let Some(counts) = r.counts.clone() else {
            return Err(std::io::Error::other("the journal holds no counts"));
        };
        let kept = r.retention();
        let mut chunks: Vec<(u64, Stream, &str)> = Vec::new();
        for (i, stream) in [(0usize, Stream::Stdout), (1, Stream::Stderr)] {
            chunks.extend(kept[i].chunks().map(|(seq, t)| (seq, stream, t)));
        }
        chunks.sort_by_key(|c| c.0);
        let mut buf = Vec::new();
        for (seq, stream, text) in chunks {
            put_output(&mut buf, seq, stream, text);
        }
        for (d, bytes) in kept[0].bundles() {
            put_display(&mut buf, d, bytes);
        }
        if let Some(at) = &r.spool {
            put_spool(&mut buf, at);
        }
        put_counts(&mut buf, &counts);
        let tmp = self.path.with_extension("cell.tmp");
        let mut f = create(&tmp)?;
        f.write_all(&buf)?;
        std::fs::rename(&tmp, &self.path)?;
        self.file = Some(f);
        self.bytes = buf.len() as u64;
        Ok(())
    }

    fn fail(&mut self, e: &std::io::Error) {
        if self.file.is_some() || self.bytes == 0 {
            tracing::warn!(session = %self.session, error = %e, path = %self.path.display(), "the running cell's journal failed: a successor daemon would continue the cell without its output so far");
        }
        self.file = None;
        self.batch = Vec::new();
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(next_seq: u64, sent: [u64; 2]) -> Counts {
        Counts {
            next_seq,
            unsent: 3,
            caps: [(100, 50, 40, vec![0xe2, 0x9c]), (100, 0, 0, Vec::new())],
            displays: Some((7, 5)),
            sent,
        }
    }

    #[test]
    fn entries_round_trip_and_a_cut_batch_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.cell");
        let mut j = Journal::create(path.clone(), "s");
        j.output(0, Stream::Stdout, "one\n");
        j.output(1, Stream::Stderr, "two ✓\n");
        j.commit(&counts(2, [4, 8]));
        j.output(2, Stream::Stdout, "three\n");
        j.commit(&counts(3, [10, 8]));
        let r = read(&path).unwrap();
        assert_eq!(r.outputs.len(), 3);
        assert_eq!(r.outputs[1], (1, Stream::Stderr, "two ✓\n".to_owned()));
        assert_eq!(r.counts, Some(counts(3, [10, 8])));
        // A batch cut anywhere (the daemon died during its write) is not taken.
        let full = std::fs::read(&path).unwrap();
        let mut cut = full.clone();
        let mut tail = Vec::new();
        put_output(&mut tail, 3, Stream::Stdout, "four\n");
        put_counts(&mut tail, &counts(4, [15, 8]));
        for n in 0..tail.len() {
            cut.truncate(full.len());
            cut.extend_from_slice(&tail[..n]);
            let r = parse(&cut);
            assert_eq!(r.outputs.len(), 3, "cut at {n}");
            assert_eq!(r.counts.as_ref().unwrap().next_seq, 3);
        }
        let kept = r.retention();
        assert_eq!(kept[0].chunks().count(), 1, "merged");
        // Display bundles come back whole, in their place.
        let d = |seq: u64| Display {
            cell: 1,
            seq,
            kind: sandcell_proto::kernel::DisplayKind::Display,
            data: serde_json::from_str(r#"{"text/plain": "p", "image/png": "iVBORw0KGgo="}"#)
                .unwrap(),
            metadata: serde_json::from_str(r#"{"image/png": {"width": 200}}"#).unwrap(),
            note: None,
        };
        j.display(&d(3), 40);
        j.output(4, Stream::Stdout, "five\n");
        j.commit(&counts(5, [15, 8]));
        let r = read(&path).unwrap();
        assert_eq!(r.displays, vec![(d(3), 40)]);
        let kept = r.retention();
        assert_eq!(
            kept[0].bundles().map(|b| b.0.seq).collect::<Vec<_>>(),
            vec![3]
        );
        assert_eq!(kept[0].chunks().count(), 2, "the bundle splits the text");
        // Garbage is not trusted beyond its first bad byte.
        assert!(parse(b"\x07\x01\x02").counts.is_none());
    }

    #[test]
    fn spool_offsets_and_the_result_belong_to_their_batch_and_survive_resumption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.cell");
        let mut j = Journal::create(path.clone(), "s");
        j.set_spool([0, 0, 0]);
        j.commit(&counts(0, [0, 0]));
        j.output(0, Stream::Stdout, "one\n");
        j.set_spool([4, 0, 120]);
        j.commit(&counts(1, [4, 0]));
        let r = read(&path).unwrap();
        assert_eq!(r.spool, Some([4, 0, 120]));
        assert!(r.result.is_none());
        // A batch cut before its counts leaves the previous batch's offsets.
        let full = std::fs::read(&path).unwrap();
        let mut cut = full.clone();
        put_spool(&mut cut, &[9, 9, 9]);
        assert_eq!(parse(&cut).spool, Some([4, 0, 120]));
        // The successor's rewrite keeps them; a cleared spool writes none.
        let mut j = Journal::resume(path.clone(), "s", &r);
        assert_eq!(read(&path).unwrap().spool, Some([4, 0, 120]));
        j.clear_spool();
        j.output(1, Stream::Stdout, "two\n");
        let result = sandcell_proto::kernel::CellResult {
            cell: 1,
            status: sandcell_proto::kernel::Status::Ok,
            error: None,
            exit_code: None,
            usage: Default::default(),
            stdout: Default::default(),
            stderr: Default::default(),
            state: sandcell_proto::kernel::State::Kept,
            session_ended: false,
            warnings: Vec::new(),
            files: Vec::new(),
            displays: None,
            retained: None,
        };
        j.result(&result);
        j.commit(&counts(2, [8, 0]));
        let r = read(&path).unwrap();
        assert_eq!(r.spool, None);
        assert_eq!(r.result.as_ref().map(|r| r.cell), Some(1));
        assert_eq!(r.outputs.len(), 2);
    }

    #[test]
    fn the_file_stays_within_the_bound_and_keeps_head_and_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.cell");
        let mut j = Journal::create(path.clone(), "s");
        let line = "x".repeat(1023) + "\n";
        let mut sent = 0u64;
        for seq in 0..3000u64 {
            j.output(seq, Stream::Stdout, &line);
            sent += line.len() as u64;
            j.commit(&counts(seq + 1, [sent, 0]));
            assert!(
                std::fs::metadata(&path).unwrap().len() <= records::JOURNAL_MAX_BYTES,
                "at {seq}"
            );
        }
        let r = read(&path).unwrap();
        let kept = r.retention();
        let stats = kept[0].stats();
        assert_eq!(stats.seen, sent);
        assert_eq!(
            stats.kept,
            sandcell_proto::kernel::RETAIN_HEAD_BYTES + sandcell_proto::kernel::RETAIN_TAIL_BYTES
        );
        assert_eq!(r.counts.unwrap().next_seq, 3000);
        assert_eq!(kept[0].chunks().next().unwrap().0, 0, "the head is kept");
    }

    #[test]
    fn a_failing_journal_never_blocks_and_is_removed() {
        let mut j = Journal::create(PathBuf::from("/nonexistent-dir/s.cell"), "s");
        j.output(0, Stream::Stdout, "x");
        j.commit(&counts(1, [1, 0]));
        assert!(j.file.is_none() && j.batch.is_empty());
    }
}
