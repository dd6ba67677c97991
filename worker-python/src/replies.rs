//! The reply pipe (fd 4): JSON lines of [`WorkerMessage`], shared by the cell loop and the
//! output forwarder.

use std::fs::File;
use std::io::{self, Write};
use std::sync::Mutex;

use sandcell_proto::worker::{MAX_WORKER_LINE, WorkerMessage};

/// Writer of reply lines; each message is written whole under a lock so lines never interleave.
#[derive(Debug)]
pub struct Replies {
    file: Mutex<File>,
}

impl Replies {
    /// Wraps an open, writable pipe.
    pub fn new(file: File) -> Self {
        Self {
            file: Mutex::new(file),
        }
    }

    /// Writes one message as one line.
    ///
    /// Errors: the write failed (EPIPE when the daemon is gone), or the serialised line is
    /// longer than [`MAX_WORKER_LINE`] (a bug: every field is bounded before it gets here).
    pub fn send(&self, msg: &WorkerMessage) -> io::Result<()> {
        self.send_all(std::slice::from_ref(msg))
    }

    /// Writes several messages, in order, with one lock and one `write` where possible.
    ///
    /// Errors: as [`Replies::send`].
    pub fn send_all(&self, msgs: &[WorkerMessage]) -> io::Result<()> {
        if msgs.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        for m in msgs {
            let line = m.to_line();
            if line.len() - 1 > MAX_WORKER_LINE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "reply line over MAX_WORKER_LINE",
                ));
            }
            buf.extend_from_slice(&line);
        }
        let mut f = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.write_all(&buf)
    }
}
