//! One harness for the worker tests of the three engines (R, native CPython, CPython in Eryx):
//! it starts a worker process with the descriptor layout of [`sandcell_proto::worker`] (fd 0
//! `/dev/null`, fd 3 requests, fd 4 JSON-lines replies, fds 1 and 2 pipes the harness reads or
//! passed on), sends requests built with [`RequestHeader`], and parses every reply line with
//! [`WorkerMessage::parse`], so the tests also pin each worker's replies to proto's types.
//!
//! What differs between the engines (the launcher, its environment and its confinement plan)
//! stays with the engine's tests: they build the [`Command`] and hand it to
//! [`WorkerProcess::spawn`].

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sandcell_proto::worker::{
    CellError, MAX_WORKER_LINE, REPLY_FD, REQUEST_FD, RequestHeader, SessionState, Stream,
    WorkerMessage, WorkerStatus,
};

/// A pipe whose two ends are close-on-exec and numbered 10 or above, so that `dup2` onto
/// [`REQUEST_FD`] and [`REPLY_FD`] in the child can never overwrite one end with the other.
/// Returns (read end, write end); panics when the system refuses a descriptor.
pub fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let high = |fd: RawFd| {
        // SAFETY: duplicating a descriptor we own; the original is closed right after.
        let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        assert!(new >= 10);
        // SAFETY: `fd` came from pipe2 above and is not used again.
        unsafe { libc::close(fd) };
        // SAFETY: `new` is a fresh descriptor owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(new) }
    };
    (high(fds[0]), high(fds[1]))
}

fn set_nonblocking(fd: &OwnedFd) {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
}

/// Reads what is available from a non-blocking `fd` into `buf`; false at end of file.
fn read_available(fd: &OwnedFd, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 65536];
    loop {
        // SAFETY: reading into a local buffer of the stated length.
        let n = unsafe { libc::read(fd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
        if n <= 0 {
            // 0: end of file; -1: EAGAIN (or EINTR), nothing more for now.
            return n != 0;
        }
        buf.extend_from_slice(&chunk[..n as usize]);
    }
}

/// Spawns `cmd`, retrying while its executable is "busy" (ETXTBSY): a launcher a test binary
/// copied can be, for as long as another test thread's fork still holds the copy's write
/// descriptor before its exec. Panics when spawning fails otherwise.
pub fn spawn_retrying(cmd: &mut Command) -> Child {
    let mut tries = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            r => return r.expect("spawn worker"),
        }
    }
}

/// A fresh, empty directory `<temp>/<prefix>-<pid>-<n>` for one worker's session (removed when
/// the [`WorkerProcess`] given it is dropped).
pub fn session_dir(prefix: &str) -> PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let n = SEQ.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the session directory");
    dir
}

/// What becomes of the worker's fds 1 and 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Pipes the harness reads while it waits for replies (the native engines write a cell's
    /// output there); the worker leads its own process group, killed whole on drop.
    Pipes,
    /// stdout to `/dev/null`, stderr the test's own (the Eryx worker sends output as frames).
    Discard,
}

/// Why no reply line came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoReply {
    /// The wait's time ran out.
    Timeout,
    /// The reply pipe reached end of file.
    Eof,
}

/// One `display` frame: kind, MIME bundle, note.
#[derive(Debug, Clone)]
pub struct Shown {
    /// A display call or the cell's result.
    pub kind: sandcell_proto::kernel::DisplayKind,
    /// MIME type -> data (text, or base64 for images).
    pub data: serde_json::Map<String, serde_json::Value>,
    /// Why the bundle was reduced, when it was.
    pub note: Option<String>,
}

impl Shown {
    /// Its `text/plain`.
    pub fn text(&self) -> &str {
        self.data["text/plain"].as_str().unwrap_or_default()
    }
}

/// What one cell produced, up to and including its `done`.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The `done` message itself.
    pub done: WorkerMessage,
    /// Its status.
    pub status: WorkerStatus,
    /// What became of the session's variables.
    pub state: SessionState,
    /// Its error, for `error`, `memory_exhausted` and engine failures.
    pub error: Option<CellError>,
    /// Exit code, for `exited`.
    pub exit_code: Option<i64>,
    /// Fuel the cell consumed (Eryx).
    pub fuel: Option<u64>,
    /// Warnings the cell raised.
    pub warnings: Vec<String>,
    /// The echoed nonce.
    pub nonce: Option<String>,
    /// Bytes the worker wrote to fd 1 meanwhile ([`Output::Pipes`] only).
    pub stdout: Vec<u8>,
    /// Bytes the worker wrote to fd 2 meanwhile ([`Output::Pipes`] only).
    pub stderr: Vec<u8>,
    /// (stream, text, bytes) of every `output` frame.
    pub frames: Vec<(Stream, String, u64)>,
    /// Every `display` frame (rich output), with the fd 1 bytes read when it arrived.
    pub displays: Vec<(Shown, usize)>,
    /// Bytes of stdout the worker's `dropped` frames counted.
    pub dropped_stdout: u64,
    /// Bytes of stderr the worker's `dropped` frames counted.
    pub dropped_stderr: u64,
    /// Length of the `done` line in bytes (without its newline).
    pub line_len: usize,
    /// When the first fd 1 byte arrived, from the request.
    pub first_stdout: Option<Duration>,
    /// From the request to the `done`.
    pub elapsed: Duration,
}

impl Cell {
    /// Its fd 1 output as text (invalid UTF-8 replaced).
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Its error; panics when it has none.
    #[track_caller]
    pub fn err(&self) -> &CellError {
        self.error
            .as_ref()
            .unwrap_or_else(|| panic!("cell has no error: {self:?}"))
    }

    /// Panics unless it ended `ok`.
    #[track_caller]
    pub fn assert_ok(&self) -> &Self {
        assert_eq!(
            self.status,
            WorkerStatus::Ok,
            "{self:?} stdout={} stderr={}",
            self.out(),
            String::from_utf8_lossy(&self.stderr)
        );
        self
    }

    /// The text of its `output` frames of `stream`, in order.
    pub fn frame_text(&self, stream: Stream) -> String {
        self.frames
            .iter()
            .filter(|f| f.0 == stream)
            .map(|f| f.1.as_str())
            .collect()
    }

    /// Bytes of `stream` its `output` frames carried.
    pub fn kept(&self, stream: Stream) -> u64 {
        self.frames
            .iter()
            .filter(|f| f.0 == stream)
            .map(|f| f.2)
            .sum()
    }
}

/// A running worker with its pipes: killed (with its process group under
/// [`Output::Pipes`]) and its session directory removed on drop.
pub struct WorkerProcess {
    /// The worker process.
    pub child: Child,
    req: Option<File>,
    rep: OwnedFd,
    out: Option<OwnedFd>,
    err: Option<OwnedFd>,
    rep_buf: Vec<u8>,
    session: PathBuf,
    group: bool,
    /// From the spawn to its return.
    pub spawned_in: Duration,
}

impl WorkerProcess {
    /// Spawns `cmd` (environment, launcher and arguments set by the caller) with the request
    /// and reply pipes on [`REQUEST_FD`] and [`REPLY_FD`], stdin `/dev/null` and fds 1 and 2 as
    /// `output` says. `session` is the worker's session directory, removed on drop.
    pub fn spawn(mut cmd: Command, session: PathBuf, output: Output) -> WorkerProcess {
        let (req_r, req_w) = pipe();
        let (rep_r, rep_w) = pipe();
        cmd.stdin(Stdio::null());
        let (out, err) = match output {
            Output::Pipes => {
                let (out_r, out_w) = pipe();
                let (err_r, err_w) = pipe();
                cmd.stdout(Stdio::from(out_w))
                    .stderr(Stdio::from(err_w))
                    .process_group(0);
                (Some(out_r), Some(err_r))
            }
            Output::Discard => {
                cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
                (None, None)
            }
        };
        let (a, b) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
        // SAFETY: only async-signal-safe dup2 calls between fork and exec; the sources are 10
        // or above, so they never alias 3 or 4, and dup2 clears close-on-exec on the copies.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(a, REQUEST_FD) != REQUEST_FD || libc::dup2(b, REPLY_FD) != REPLY_FD {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let t0 = Instant::now();
        let child = spawn_retrying(&mut cmd);
        let spawned_in = t0.elapsed();
        // The command holds the child's ends of fds 1 and 2: drop them with it.
        drop(cmd);
        drop((req_r, rep_w));
        for fd in [Some(&rep_r), out.as_ref(), err.as_ref()]
            .into_iter()
            .flatten()
        {
            set_nonblocking(fd);
        }
        WorkerProcess {
            child,
            req: Some(File::from(req_w)),
            rep: rep_r,
            out,
            err,
            rep_buf: Vec::new(),
            session,
            group: output == Output::Pipes,
            spawned_in,
        }
    }

    /// The worker's pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The worker's session directory.
    pub fn session(&self) -> &Path {
        &self.session
    }

    /// Waits up to `timeout` for the next reply line, collecting fds 1 and 2 into `out` and
    /// `err` meanwhile (`first_out` gets the time the first fd 1 byte came). Returns the
    /// message and its line's length; panics on a line over [`MAX_WORKER_LINE`] or one
    /// [`WorkerMessage::parse`] refuses.
    pub fn read_message(
        &mut self,
        out: &mut Vec<u8>,
        err: &mut Vec<u8>,
        mut first_out: Option<&mut Option<Instant>>,
        timeout: Duration,
    ) -> Result<(WorkerMessage, usize), NoReply> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.rep_buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.rep_buf.drain(..=i).collect();
                let line = &line[..line.len() - 1];
                assert!(
                    line.len() <= MAX_WORKER_LINE,
                    "reply line of {} bytes",
                    line.len()
                );
                let msg = WorkerMessage::parse(line).unwrap_or_else(|e| {
                    panic!("bad reply line {:?}: {e}", String::from_utf8_lossy(line))
                });
                return Ok((msg, line.len()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NoReply::Timeout);
            }
            let mut fds = [Some(&self.rep), self.out.as_ref(), self.err.as_ref()]
                .into_iter()
                .flatten()
                .map(|fd| libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect::<Vec<_>>();
            let ms = (deadline - now).as_millis().min(1000) as i32;
            // SAFETY: polling valid pollfd structs owned by this frame, of the length given.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            let before = out.len();
            self.drain_output(out, err);
            if out.len() > before
                && let Some(slot) = first_out.as_deref_mut()
            {
                slot.get_or_insert_with(Instant::now);
            }
            let mut buf = Vec::new();
            let open = read_available(&self.rep, &mut buf);
            self.rep_buf.extend_from_slice(&buf);
            if !open && buf.is_empty() && !self.rep_buf.contains(&b'\n') {
                return Err(NoReply::Eof);
            }
        }
    }

    /// [`Self::read_message`], panicking when the time runs out (with the output so far);
    /// `None` at end of file.
    pub fn next_message(
        &mut self,
        out: &mut Vec<u8>,
        err: &mut Vec<u8>,
        first_out: Option<&mut Option<Instant>>,
        timeout: Duration,
    ) -> Option<(WorkerMessage, usize)> {
        match self.read_message(out, err, first_out, timeout) {
            Ok(m) => Some(m),
            Err(NoReply::Eof) => None,
            Err(NoReply::Timeout) => panic!(
                "no reply within {timeout:?}; stdout {:?} stderr {:?}",
                String::from_utf8_lossy(out),
                String::from_utf8_lossy(err)
            ),
        }
    }

    /// The next reply message, or `None` on timeout or end of file (fd 1 and 2 output read
    /// meanwhile is discarded).
    pub fn next(&mut self, timeout: Duration) -> Option<WorkerMessage> {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        self.read_message(&mut out, &mut err, None, timeout)
            .ok()
            .map(|m| m.0)
    }

    /// Whether the reply pipe reaches end of file within `timeout` with no further message.
    pub fn reply_eof(&mut self, timeout: Duration) -> bool {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        matches!(
            self.read_message(&mut out, &mut err, None, timeout),
            Err(NoReply::Eof)
        )
    }

    /// Appends what fds 1 and 2 hold now to `out` and `err`.
    pub fn drain_output(&mut self, out: &mut Vec<u8>, err: &mut Vec<u8>) {
        if let Some(fd) = &self.out {
            read_available(fd, out);
        }
        if let Some(fd) = &self.err {
            read_available(fd, err);
        }
    }

    /// Waits for the `ready` message (fd 2 output meanwhile is returned with it); panics on
    /// anything else or after `timeout`.
    pub fn await_ready(&mut self, timeout: Duration) -> (String, String, Vec<u8>) {
        let (mut o, mut e) = (Vec::new(), Vec::new());
        match self.read_message(&mut o, &mut e, None, timeout) {
            Ok((WorkerMessage::Ready { language, engine }, _)) => (language, engine, e),
            other => panic!(
                "expected ready, got {other:?}; stderr: {}",
                String::from_utf8_lossy(&e)
            ),
        }
    }

    /// The request pipe; panics once closed.
    pub fn requests(&mut self) -> &mut File {
        self.req.as_mut().expect("request pipe open")
    }

    /// Writes raw bytes to the request pipe.
    pub fn write_raw(&mut self, bytes: &[u8]) {
        self.requests().write_all(bytes).expect("write request");
    }

    /// Closes the request pipe (end of file for the worker: the daemon went away).
    pub fn close_requests(&mut self) {
        self.req = None;
    }

    /// Sends the request `header` followed by its `body` (a cell's source).
    pub fn send(&mut self, header: &RequestHeader, body: &[u8]) {
        let mut bytes = header.to_line().into_bytes();
        bytes.extend_from_slice(body);
        self.write_raw(&bytes);
    }

    /// Reads the replies of `cell` until its `done` (`t0`: when its request was sent),
    /// collecting `output` and `dropped` frames and fds 1 and 2; panics on any other message,
    /// a `done` of another cell, a `started` line after another line of the cell, end of
    /// file, or no `done` within `limit`.
    pub fn collect(&mut self, cell: u64, t0: Instant, limit: Duration) -> Cell {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut first = None;
        let mut started = false;
        let mut frames = Vec::new();
        let mut displays = Vec::new();
        let (mut dropped_stdout, mut dropped_stderr) = (0, 0);
        let start = Instant::now();
        loop {
            let left = limit.saturating_sub(start.elapsed());
            let (msg, line_len) =
                match self.read_message(&mut out, &mut err, Some(&mut first), left) {
                    Ok(m) => m,
                    Err(why) => panic!(
                        "no done for cell {cell} within {limit:?} ({why:?}); frames {frames:?} \
                     stdout {:?} stderr {:?}",
                        String::from_utf8_lossy(&out),
                        String::from_utf8_lossy(&err)
                    ),
                };
            // The caller may have read the `started` line itself; if not, it comes first.
            let is_started = matches!(msg, WorkerMessage::Started { .. });
            assert!(
                !(is_started && started),
                "cell {cell}: {msg:?} after another line of the cell"
            );
            started = true;
            match msg {
                WorkerMessage::Started { cell: c, .. } => assert_eq!(c, cell),
                WorkerMessage::Output {
                    cell: c,
                    stream,
                    data,
                    bytes,
                } => {
                    assert_eq!(c, cell);
                    frames.push((stream, data, bytes));
                }
                WorkerMessage::Display {
                    cell: c,
                    kind,
                    data,
                    note,
                    wait,
                    ..
                } => {
                    assert_eq!(c, cell);
                    self.drain_output(&mut out, &mut err);
                    displays.push((Shown { kind, data, note }, out.len()));
                    if wait {
                        // As the daemon does: the bundle is placed after the output read so
                        // far; the worker may go on.
                        let mut h = RequestHeader::exec(cell, 0);
                        h.op = sandcell_proto::worker::Op::Displayed;
                        self.send(&h, &[]);
                    }
                }
                WorkerMessage::Dropped {
                    cell: c,
                    stream,
                    bytes,
                } => {
                    assert_eq!(c, cell);
                    match stream {
                        Stream::Stdout => dropped_stdout += bytes,
                        Stream::Stderr => dropped_stderr += bytes,
                    }
                }
                WorkerMessage::Done {
                    cell: c,
                    ref nonce,
                    status,
                    ref error,
                    exit_code,
                    fuel,
                    state,
                    ref warnings,
                } => {
                    assert_eq!(c, cell);
                    // Everything the cell wrote is in the pipes before `done` is written.
                    self.drain_output(&mut out, &mut err);
                    return Cell {
                        nonce: nonce.clone(),
                        status,
                        state,
                        error: error.clone(),
                        exit_code,
                        fuel,
                        warnings: warnings.clone(),
                        done: msg,
                        stdout: out,
                        stderr: err,
                        frames,
                        displays,
                        dropped_stdout,
                        dropped_stderr,
                        line_len,
                        first_stdout: first.map(|f: Instant| f - t0),
                        elapsed: t0.elapsed(),
                    };
                }
                other => panic!("unexpected message during cell {cell}: {other:?}"),
            }
        }
    }

    /// Sends SIGINT to the worker process.
    pub fn sigint(&self) {
        // SAFETY: signalling our own child, which is not reaped before drop.
        assert_eq!(unsafe { libc::kill(self.pid(), libc::SIGINT) }, 0);
    }

    /// Sends SIGINT to the worker's main thread (tgkill), as the daemon does: a
    /// process-directed signal could be taken by another thread (OpenBLAS's).
    pub fn sigint_main_thread(&self) {
        // SAFETY: signalling the main thread (tid == pid) of our own child.
        let r = unsafe { libc::syscall(libc::SYS_tgkill, self.pid(), self.pid(), libc::SIGINT) };
        assert_eq!(r, 0);
    }

    /// Waits for the worker to exit; panics after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().expect("wait for the worker") {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "worker did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A field of `/proc/<pid>/status`, e.g. `Seccomp` (its value, trimmed).
    pub fn proc_status(&self, field: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in /proc/<pid>/status"));
        line.split_once(':').unwrap().1.trim().to_string()
    }

    /// Resident set size of the worker, in bytes (`VmRSS`).
    pub fn rss_bytes(&self) -> u64 {
        let kib = self.proc_status("VmRSS");
        kib.split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .expect("VmRSS in kB")
            * 1024
    }

    /// Threads of the worker process.
    pub fn threads(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if self.group {
            // SAFETY: killing our own child's process group (the worker and what it started).
            unsafe { libc::kill(-self.pid(), libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.session);
    }
}
