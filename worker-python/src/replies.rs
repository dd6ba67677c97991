//! The reply pipe (fd 4): JSON lines of [`WorkerMessage`], shared by the cell loop and the
//! output forwarder.
//!
//! Lines are encoded straight into one buffer ([`Lines`]) and written with one `write` per
//! batch: a cell's last output frames and its `Done` normally leave in a single write, so the
//! daemon wakes once for them.

use std::fs::File;
use std::io::{self, Write};
use std::sync::Mutex;

use sandcell_proto::text::escape_lossy;
use sandcell_proto::worker::{MAX_WORKER_LINE, Stream, WorkerMessage};
use serde::Serialize;

/// Encoded reply lines waiting to be written, in order.
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
}

/// An `Output` frame borrowing its text: serialises exactly as [`WorkerMessage::Output`]
/// (checked by a test) without building an owned message first.
#[derive(Serialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum Borrowed<'a> {
    Output {
        cell: u64,
        stream: Stream,
        data: &'a str,
        bytes: u64,
    },
}

impl Lines {
    /// No lines.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes waiting.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// The encoded lines (each ends with a newline).
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    #[cfg(test)]
    pub(crate) fn buf_for_tests(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// Forgets what is waiting.
    pub fn clear(&mut self) {
        self.buf.clear();
    }

    fn encode<T: Serialize>(&mut self, value: &T) -> io::Result<()> {
        let start = self.buf.len();
        serde_json::to_writer(&mut self.buf, value).map_err(io::Error::other)?;
        if self.buf.len() - start > MAX_WORKER_LINE {
            self.buf.truncate(start);
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "reply line over MAX_WORKER_LINE",
            ));
        }
        self.buf.push(b'\n');
        Ok(())
    }

    /// Appends one message.
    ///
    /// Errors: the line would be longer than [`MAX_WORKER_LINE`] (a bug: every field is
    /// bounded before it gets here); nothing is appended then.
    pub fn push(&mut self, msg: &WorkerMessage) -> io::Result<()> {
        self.encode(msg)
    }

    /// Appends an `Output` frame of the original bytes `data` (escaped as
    /// [`sandcell_proto::text::escape_lossy`] does; valid UTF-8 is not copied on the way).
    ///
    /// Errors: as [`Lines::push`].
    pub fn push_output(&mut self, cell: u64, stream: Stream, data: &[u8]) -> io::Result<()> {
        let escaped;
        let text = match std::str::from_utf8(data) {
            Ok(t) => t,
            Err(_) => {
                escaped = escape_lossy(data);
                &escaped
            }
        };
        self.encode(&Borrowed::Output {
            cell,
            stream,
            data: text,
            bytes: data.len() as u64,
        })
    }
}

/// Capacity of the shared encoding buffer kept between writes.
const KEEP_CAPACITY: usize = 256 * 1024;

/// Writer of reply lines; each batch is written whole under a lock so lines never interleave.
#[derive(Debug)]
pub struct Replies {
    inner: Mutex<(File, Lines)>,
}

impl Replies {
    /// Wraps an open, writable pipe.
    pub fn new(file: File) -> Self {
        Self {
            inner: Mutex::new((file, Lines::new())),
        }
    }

    /// Writes one message as one line.
    ///
    /// Errors: the write failed (EPIPE when the daemon is gone), or the serialised line is
    /// longer than [`MAX_WORKER_LINE`] (a bug: every field is bounded before it gets here).
    pub fn send(&self, msg: &WorkerMessage) -> io::Result<()> {
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (file, lines) = &mut *g;
        lines.clear();
        lines.push(msg)?;
        let r = file.write_all(lines.as_bytes());
        lines.clear();
        r
    }

    /// Writes every line of `lines`, in order, with one `write` where the pipe takes it, and
    /// empties `lines`.
    ///
    /// Errors: the write failed (EPIPE when the daemon is gone).
    pub fn write(&self, lines: &mut Lines) -> io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        let r = {
            let mut g = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            g.0.write_all(lines.as_bytes())
        };
        lines.clear();
        if lines.buf.capacity() > KEEP_CAPACITY {
            lines.buf = Vec::new();
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_output_frames_are_output_messages() {
        for (data, text) in [
            (&b"a\"\\\n\t\x01 \xe2\x9c\x93"[..], "a\"\\\n\t\u{1} ✓"),
            (&b"a\xffb"[..], "a\\xffb"),
            (&b""[..], ""),
        ] {
            let mut l = Lines::new();
            l.push_output(7, Stream::Stderr, data).unwrap();
            let msg = WorkerMessage::Output {
                cell: 7,
                stream: Stream::Stderr,
                data: text.into(),
                bytes: data.len() as u64,
            };
            assert_eq!(l.as_bytes(), &msg.to_line()[..]);
        }
    }

    #[test]
    fn lines_append_in_order_and_refuse_overlong_lines() {
        let mut l = Lines::new();
        let done = WorkerMessage::Dropped {
            cell: 1,
            stream: Stream::Stdout,
            bytes: 3,
        };
        l.push_output(1, Stream::Stdout, b"x").unwrap();
        l.push(&done).unwrap();
        let text = String::from_utf8(l.as_bytes().to_vec()).unwrap();
        let parsed: Vec<_> = text
            .lines()
            .map(|x| WorkerMessage::parse(x.as_bytes()).unwrap())
            .collect();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[1], done);
        let before = l.len();
        let huge = "\u{1}".repeat(MAX_WORKER_LINE / 4);
        assert!(l.push_output(1, Stream::Stdout, huge.as_bytes()).is_err());
        assert_eq!(l.len(), before, "a refused line leaves nothing behind");
    }
}
