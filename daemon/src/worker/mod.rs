//! Worker processes: how they start ([`spawn`]), how their replies are read ([`LineReader`]),
//! and how their output is bounded ([`output`]).

pub mod output;
pub mod spawn;

use crate::cgroup::SessionGroup;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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

    /// Whether a complete line is already buffered (the next [`LineReader::next_line`] returns
    /// without reading).
    pub fn has_line(&self) -> bool {
        self.buf.contains(&b'\n')
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

/// Kills every process of a worker, then reaps it: SIGKILL to its process group (it called
/// setsid, so the group id is its pid) and to itself, then the whole cgroup (what left the
/// group), then `wait`. The first half of the release order (ARCHITECTURE.md, "Release after
/// reaping").
pub async fn kill_and_reap(
    pid: u32,
    child: &mut tokio::process::Child,
    group: &Arc<dyn SessionGroup>,
) {
    let pid = pid as libc::pid_t;
    // SAFETY: signals to our own unreaped child and its process group; nothing else can hold
    // that pid until we reap it.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
        libc::kill(pid, libc::SIGKILL);
    }
    let group = group.clone();
    let _ = tokio::task::spawn_blocking(move || group.kill_all(Duration::from_secs(10))).await;
    let _ = child.wait().await;
}

/// Removes what a dead worker leaves: its cgroup, then its session directory, logging failures.
/// `remove_dir_all` unlinks symlinks a cell planted and never follows them, and the worker is
/// dead, so nothing races with it (Judge0 CVE-2024-28185). The second half of the release order.
pub async fn remove_remains(session: &str, group: Arc<dyn SessionGroup>, dir: PathBuf) {
    let removed = tokio::task::spawn_blocking(move || {
        let g = group.remove();
        let d = match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        (g, d)
    })
    .await;
    if let Ok((g, d)) = removed {
        if let Err(e) = g {
            tracing::warn!(session, error = %e, "removing session cgroup");
        }
        if let Err(e) = d {
            tracing::warn!(session, error = %e, "removing session directory");
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
