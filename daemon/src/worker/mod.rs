//! Worker processes: how they are spawned confined ([`spawn`]), how a start is charged,
//! placed and awaited until `Ready` ([`start`]), how their replies are read ([`LineReader`]),
//! how their output is bounded ([`output`]), and how they are signalled: only while they are
//! the daemon's unreaped children ([`kill_and_reap`], [`InterruptTarget::send`]).

#[cfg(test)]
pub mod fake;
pub mod output;
pub mod process;
pub mod spawn;
pub mod start;

use crate::cgroup::SessionGroup;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use sandcell_proto::worker::MAX_WORKER_LINE;
use tokio::io::AsyncReadExt;

/// Reads newline-terminated lines of at most [`MAX_WORKER_LINE`] bytes from a worker.
///
/// Linear in the bytes read: each byte is searched for a newline once (`scanned`), consumed
/// lines only advance an offset (`start`), and the buffer is compacted only when the consumed
/// prefix is at least half of it, so a flood of short lines costs no repeated `memmove` or
/// search over the whole buffer. The buffer never holds more than one read past
/// [`MAX_WORKER_LINE`] of an unfinished line.
///
/// Cancel-safe: bytes read before a cancelled call stay buffered for the next one.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Bytes before `start` are consumed.
    start: usize,
    /// `buf[start..scanned]` holds no newline.
    scanned: usize,
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

/// Bytes asked for by one read of a reply pipe.
const READ_CHUNK: usize = 64 * 1024;

impl<R> LineReader<R> {
    /// Wraps `inner`.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            eof: false,
        }
    }

    /// Wraps `inner`, with `bytes` already read from it and not yet consumed (what a
    /// predecessor daemon's reader held when it handed the stream over).
    pub fn with_buffered(inner: R, bytes: Vec<u8>) -> Self {
        Self {
            inner,
            buf: bytes,
            start: 0,
            scanned: 0,
            eof: false,
        }
    }

    /// The bytes read and not yet returned as lines (a partial line included).
    pub fn unconsumed(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    /// The reader.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Bytes buffered and not yet returned as lines (a partial line included).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Whether a complete line may be buffered: bytes not yet searched for a newline remain
    /// (after [`LineReader::take_line`] returned `None`, none do). Constant time.
    pub fn may_have_line(&self) -> bool {
        self.scanned.max(self.start) < self.buf.len()
    }

    /// Whether end of file was seen.
    pub fn at_eof(&self) -> bool {
        self.eof
    }

    /// The next complete buffered line without its newline, reading nothing. `Ok(None)` when
    /// no complete line is buffered.
    ///
    /// Errors: [`LineError::TooLong`] when the unfinished line already exceeds the limit.
    pub fn take_line(&mut self) -> Result<Option<Vec<u8>>, LineError> {
        let from = self.scanned.max(self.start);
        match self.buf[from..].iter().position(|&b| b == b'\n') {
            Some(i) => {
                let end = from + i;
                if end - self.start > MAX_WORKER_LINE {
                    return Err(LineError::TooLong);
                }
                let line = self.buf[self.start..end].to_vec();
                self.start = end + 1;
                self.scanned = self.start;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                    self.scanned = 0;
                }
                Ok(Some(line))
            }
            None => {
                self.scanned = self.buf.len();
                if self.buf.len() - self.start > MAX_WORKER_LINE {
                    return Err(LineError::TooLong);
                }
                Ok(None)
            }
        }
    }

    /// Makes room for one read at the end of the buffer (compacting a consumed prefix that is
    /// at least half of it); returns where the new bytes' slot starts.
    fn spare(&mut self) -> usize {
        if self.start > 0 && self.start * 2 >= self.buf.len() {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        let len = self.buf.len();
        self.buf.resize(len + READ_CHUNK, 0);
        len
    }

    /// Keeps `n` of the bytes read into the slot [`LineReader::spare`] made; 0 means end of
    /// file (callers reset `eof` for a read that failed or would block).
    fn keep(&mut self, n: usize) {
        let len = self.buf.len() - READ_CHUNK + n;
        self.buf.truncate(len);
        if n == 0 {
            self.eof = true;
        }
        if self.buf.capacity() > 4 * (MAX_WORKER_LINE + READ_CHUNK) {
            self.buf.shrink_to(MAX_WORKER_LINE + READ_CHUNK);
        }
    }
}

impl<R: tokio::io::AsyncRead + Unpin> LineReader<R> {
    /// The next line without its newline; `None` at end of file (a partial last line is
    /// dropped: the worker died mid-write).
    pub async fn next_line(&mut self) -> Result<Option<Vec<u8>>, LineError> {
        loop {
            if let Some(line) = self.take_line()? {
                return Ok(Some(line));
            }
            if self.eof {
                return Ok(None);
            }
            let at = self.spare();
            match self.inner.read(&mut self.buf[at..]).await {
                Ok(n) => self.keep(n),
                Err(e) => {
                    self.keep(0);
                    self.eof = false;
                    return Err(e.into());
                }
            }
        }
    }
}

/// What one non-blocking read of a reply pipe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// This many bytes were added to the buffer.
    Read(usize),
    /// Nothing to read now (readiness is cleared: wait for [`LineReader::readable`]).
    Empty,
    /// End of file: the worker closed its reply pipe.
    Eof,
}

impl LineReader<tokio::net::unix::pipe::Receiver> {
    /// Waits until the pipe is readable (or failed, which the next read reports).
    pub async fn readable(&self) {
        if self.may_have_line() {
            return;
        }
        if self.eof {
            return std::future::pending().await;
        }
        let _ = self.inner.readable().await;
    }

    /// One non-blocking read into the buffer.
    ///
    /// Errors: reading failed.
    pub fn try_fill(&mut self) -> Result<Fill, LineError> {
        self.try_fill_with(|r, buf| r.try_read(buf))
    }

    /// [`LineReader::try_fill`] through `read`, which is given the pipe and the free part of
    /// the buffer and returns the bytes it put there (0 at end of file, `WouldBlock` when
    /// there are none): a spooled cell moves them through its spool file first
    /// (`session::spool`).
    ///
    /// Errors: reading failed.
    pub fn try_fill_with(
        &mut self,
        read: impl FnOnce(&tokio::net::unix::pipe::Receiver, &mut [u8]) -> std::io::Result<usize>,
    ) -> Result<Fill, LineError> {
        if self.eof {
            return Ok(Fill::Eof);
        }
        let at = self.spare();
        match read(&self.inner, &mut self.buf[at..]) {
            Ok(0) => {
                self.keep(0);
                Ok(Fill::Eof)
            }
            Ok(n) => {
                self.keep(n);
                Ok(Fill::Read(n))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.keep(0);
                self.eof = false;
                Ok(Fill::Empty)
            }
            Err(e) => {
                self.keep(0);
                self.eof = false;
                Err(e.into())
            }
        }
    }

    /// Empties the pipe and the buffer without blocking; returns the bytes found (a worker
    /// writes nothing between cells, so any is a protocol violation) and whether the pipe is
    /// at end of file. Reads at most `limit` bytes. Asks the kernel, not the runtime's cached
    /// readiness, so bytes written an instant ago are found too.
    ///
    /// Errors: reading failed.
    pub fn drain_stale(&mut self, limit: usize) -> Result<(usize, bool), LineError> {
        use std::os::fd::AsRawFd;
        let mut found = self.buffered();
        self.buf.clear();
        self.start = 0;
        self.scanned = 0;
        if self.eof {
            return Ok((found, true));
        }
        let mut chunk = [0u8; 16 * 1024];
        while found < limit {
            match read_now(self.inner.as_raw_fd(), &mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return Ok((found, true));
                }
                Ok(n) => found += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok((found, false)),
                Err(e) => return Err(e.into()),
            }
        }
        Ok((found, false))
    }
}

/// One `read(2)` of the non-blocking descriptor `fd` into `buf`, retried on `EINTR`: asks the
/// kernel directly, whatever readiness the async runtime has cached (`WouldBlock` when empty).
///
/// Errors: the read failed.
pub fn read_now(fd: std::os::fd::RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes; `fd` is a descriptor the caller owns.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A pidfd of a worker, opened right after the spawn while the worker was the daemon's
/// unreaped child, so it names that process for good: a signal through it reaches the worker
/// or, once the worker has exited, nobody (`ESRCH`), never a process that took its pid.
#[derive(Debug)]
pub struct WorkerPidfd(OwnedFd);

impl WorkerPidfd {
    /// `pidfd_open(pid)`; call only while `pid` is the caller's unreaped child.
    ///
    /// Errors: the kernel has no `pidfd_open` (before Linux 5.3) or the process is gone.
    pub fn open(pid: u32) -> std::io::Result<WorkerPidfd> {
        crate::sys::pidfd_open(pid).map(WorkerPidfd)
    }

    /// `pidfd_send_signal(signal)`; a worker that has exited is not an error.
    pub fn signal(&self, signal: libc::c_int) {
        let _ = crate::sys::pidfd_send_signal(self.0.as_fd(), signal);
    }
}

/// Sends `signal` to the worker `child`: through `pidfd` when there is one, else by pid, and
/// only while `child` is unreaped (tokio forgets the pid once it reaped the child).
pub(crate) fn signal_process(
    child: &tokio::process::Child,
    pidfd: Option<&WorkerPidfd>,
    signal: libc::c_int,
) {
    match (pidfd, child.id()) {
        (Some(fd), _) => fd.signal(signal),
        // Our own unreaped child: nothing else can hold its pid.
        (None, Some(pid)) => {
            let _ = crate::sys::kill(pid, signal);
        }
        (None, None) => {}
    }
}

/// Where a worker's interrupt (SIGINT) is aimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterruptTarget {
    /// The whole process group (R: R ignores SIGINT while it waits for a `system()` child, so
    /// the child must get it too; its launcher pins BLAS/OpenMP pools to one thread, so R's
    /// main thread is the only one to take it).
    ProcessGroup,
    /// The process (the Eryx worker, which forwards it to the guest).
    Process,
    /// The process's main thread only, with `tgkill` (native CPython: Python runs signal
    /// handlers only in its main thread, and a process-directed signal may be taken by any
    /// thread that does not block it, e.g. an OpenBLAS worker thread, and then reach Python
    /// late or never).
    MainThread,
}

impl InterruptTarget {
    /// Sends SIGINT to the worker whose pid is `worker` (its main thread's tid is its pid,
    /// and it called setsid, so its process-group id is its pid too). `None` (a child that is
    /// reaped, an adopted worker whose pidfd reported its exit: see
    /// [`process::WorkerProcess::id`]) sends nothing: its pid, and the group id, could then
    /// name another process. A failure (the worker exited meanwhile) leaves nothing to
    /// interrupt.
    pub fn send(self, worker: Option<u32>, pidfd: Option<&WorkerPidfd>) {
        let Some(pid) = worker else { return };
        match self {
            // The group of our own live worker: its id cannot be reused meanwhile.
            InterruptTarget::ProcessGroup => {
                let _ = crate::sys::kill_group(pid, libc::SIGINT);
            }
            InterruptTarget::Process => match pidfd {
                Some(fd) => fd.signal(libc::SIGINT),
                // `worker` is the caller's live worker (an unreaped child, or an adopted
                // worker whose pidfd just said it lives).
                None => {
                    let _ = crate::sys::kill(pid, libc::SIGINT);
                }
            },
            // The main thread of our own live worker.
            InterruptTarget::MainThread => {
                let _ = crate::sys::tgkill(pid, pid, libc::SIGINT);
            }
        }
    }
}

/// Kills every process of a worker, then reaps it: SIGKILL to its process group (it called
/// setsid, so the group id is its pid) and to itself while it is unreaped, then the whole
/// cgroup (what left the group; at most [`crate::cgroup::KILL_TIMEOUT`]), then `wait`. A
/// worker already reaped (its exit was awaited) gets no signal by pid: only its cgroup is
/// killed. The first half of the release order (ARCHITECTURE.md, "Release after reaping").
pub async fn kill_and_reap(
    child: &mut tokio::process::Child,
    pidfd: Option<&WorkerPidfd>,
    group: &Arc<dyn SessionGroup>,
) {
    if let Some(pid) = child.id() {
        // The process group of our own unreaped child; its id cannot be reused until we reap
        // the child.
        let _ = crate::sys::kill_group(pid, libc::SIGKILL);
    }
    signal_process(child, pidfd, libc::SIGKILL);
    let group = group.clone();
    let _ = tokio::task::spawn_blocking(move || group.kill_all(crate::cgroup::KILL_TIMEOUT)).await;
    let _ = child.wait().await;
}

/// Removes what a dead worker leaves: its session file system (unmounted), its cgroup, then
/// its session directory, logging failures.
/// `remove_dir_all` unlinks symlinks a cell planted and never follows them, and the worker is
/// dead, so nothing races with it (Judge0 CVE-2024-28185). The second half of the release order.
pub async fn remove_remains(session: &str, group: Arc<dyn SessionGroup>, dir: PathBuf) {
    let removed = tokio::task::spawn_blocking(move || {
        // The session file system first: its pages are charged to the group, and are freed
        // while the group still exists.
        if let Err(e) = crate::session_fs::unmount(&dir) {
            tracing::warn!(path = %dir.display(), error = %e, "unmounting the session file system");
        }
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

    fn no_group() -> Arc<dyn SessionGroup> {
        let limits = crate::cgroup::GroupLimits {
            memory_bytes: 0,
            max_pids: 0,
            cpu_max: None,
        };
        use crate::cgroup::Backend;
        Arc::from(crate::cgroup::Unconfined.create("t", &limits).unwrap())
    }

    #[tokio::test]
    async fn a_worker_is_killed_through_its_pidfd_and_its_pid_forgotten_once_reaped() {
        use std::os::unix::process::ExitStatusExt;
        let group = no_group();
        let mut child = tokio::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let pidfd = WorkerPidfd::open(child.id().unwrap()).unwrap();
        let t0 = std::time::Instant::now();
        kill_and_reap(&mut child, Some(&pidfd), &group).await;
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(child.wait().await.unwrap().signal(), Some(libc::SIGKILL));
        // What every signal by pid relies on: once reaped, the child has no pid any more.
        assert_eq!(child.id(), None);
        kill_and_reap(&mut child, Some(&pidfd), &group).await;
        InterruptTarget::ProcessGroup.send(child.id(), None);

        // A worker found dead (the pool's liveness check reaps it) is forgotten too.
        let mut child = tokio::process::Command::new("true").spawn().unwrap();
        while matches!(child.try_wait(), Ok(None)) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(child.id(), None);
        kill_and_reap(&mut child, None, &group).await;
    }

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
        // A line of exactly the limit passes; one byte more does not.
        let mut exact = vec![b'y'; MAX_WORKER_LINE];
        exact.push(b'\n');
        exact.extend_from_slice(&[b'z'; MAX_WORKER_LINE + 1]);
        exact.push(b'\n');
        let mut r = LineReader::new(&exact[..]);
        assert_eq!(r.next_line().await.unwrap().unwrap().len(), MAX_WORKER_LINE);
        assert!(matches!(r.next_line().await, Err(LineError::TooLong)));
    }

    #[tokio::test]
    async fn many_short_lines_cost_linear_time_and_bounded_memory() {
        // 400,000 lines in one stream: a reader that moved the buffer or searched it from the
        // start for every line would take minutes here.
        let mut data = Vec::new();
        for i in 0..400_000u32 {
            data.extend_from_slice(format!("{i}\n").as_bytes());
        }
        let mut r = LineReader::new(&data[..]);
        let t0 = std::time::Instant::now();
        let mut n = 0u32;
        while let Some(line) = r.next_line().await.unwrap() {
            assert_eq!(line, n.to_string().as_bytes());
            n += 1;
            assert!(r.buf.len() <= 2 * READ_CHUNK + MAX_WORKER_LINE);
        }
        assert_eq!(n, 400_000);
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t0.elapsed()
        );
    }

    #[tokio::test]
    async fn pipe_reads_are_non_blocking_and_stale_bytes_are_found() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::net::unix::pipe::pipe().unwrap();
        let mut r = LineReader::new(rx);
        assert_eq!(r.try_fill().unwrap(), Fill::Empty);
        assert!(!r.may_have_line());
        tx.write_all(b"{\"a\":1}\npart").await.unwrap();
        r.readable().await;
        assert!(matches!(r.try_fill().unwrap(), Fill::Read(12)));
        assert!(r.may_have_line());
        assert_eq!(r.take_line().unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(r.take_line().unwrap(), None);
        assert!(!r.may_have_line());
        tx.write_all(b"more").await.unwrap();
        assert_eq!(r.drain_stale(1 << 20).unwrap(), (8, false));
        assert_eq!(r.buffered(), 0);
        assert_eq!(r.drain_stale(1 << 20).unwrap(), (0, false));
        drop(tx);
        assert_eq!(r.drain_stale(1 << 20).unwrap(), (0, true));
    }
}
