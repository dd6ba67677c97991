//! Worker processes: how they start ([`spawn`]), how their replies are read ([`LineReader`]),
//! and how their output is bounded ([`output`]).

pub mod output;
pub mod spawn;

use sandcell_proto::worker::MAX_WORKER_LINE;
use tokio::io::AsyncReadExt;

/// Reads newline-terminated lines of at most [`MAX_WORKER_LINE`] bytes from a worker.
///
/// Cancel-safe: bytes read before a cancelled call stay buffered for the next one.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    eof: bool,
}

/// A reply line that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The worker wrote a line longer than the protocol allows.
    #[error("worker reply line exceeds {MAX_WORKER_LINE} bytes")]
    TooLong,
    /// Reading failed.
    #[error("reading worker replies: {0}")]
    Io(#[from] std::io::Error),
}

impl<R: tokio::io::AsyncRead + Unpin> LineReader<R> {
    /// Wraps `inner`.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            eof: false,
        }
    }

    /// The next line without its newline; `None` at end of file (a partial last line is
    /// dropped: the worker died mid-write).
    pub async fn next_line(&mut self) -> Result<Option<Vec<u8>>, LineError> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=i).collect();
                line.pop();
                return Ok(Some(line));
            }
            if self.buf.len() > MAX_WORKER_LINE {
                return Err(LineError::TooLong);
            }
            if self.eof {
                return Ok(None);
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.inner.read(&mut chunk).await?;
            if n == 0 {
                self.eof = true;
            } else {
                self.buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn splits_lines_and_bounds_them() {
        let data: &[u8] = b"{\"a\":1}\nsecond\npartial";
        let mut r = LineReader::new(data);
        assert_eq!(r.next_line().await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(r.next_line().await.unwrap().unwrap(), b"second");
        assert!(r.next_line().await.unwrap().is_none());
        let big = vec![b'x'; MAX_WORKER_LINE + 20_000];
        let mut r = LineReader::new(&big[..]);
        assert!(matches!(r.next_line().await, Err(LineError::TooLong)));
    }
}
