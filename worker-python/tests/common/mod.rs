//! Test harness: prepares the runtime once and drives the real `sandcell-worker-python`
//! binary over pipes on fds 3 and 4, as the daemon does.

#![allow(dead_code)]

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use sandcell_proto::worker::{
    REPLY_FD, REQUEST_FD, RequestHeader, SessionState, Stream, WorkerMessage, WorkerStatus,
};

/// Where the test runtime is cached (prepare is a no-op when its manifest is current).
pub const RUNTIME_DIR: &str = "/var/tmp/sandcell-python-runtime-test";

/// Prepares the runtime once per test process, serialised across processes with flock.
pub fn runtime_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(RUNTIME_DIR);
        let lock = File::create(format!("{RUNTIME_DIR}.lock")).expect("lock file");
        // SAFETY: flock on a descriptor we own; blocks until other test processes are done.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        let out = Command::new(env!("CARGO_BIN_EXE_sandcell-python-runtime"))
            .args(["prepare", "--out"])
            .arg(&dir)
            .output()
            .expect("run sandcell-python-runtime");
        assert!(
            out.status.success(),
            "prepare failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        drop(lock);
        dir
    })
}

/// Creates a pipe and returns (read, write), both close-on-exec, moved above fd 100 so they
/// never collide with 3 and 4 in the child.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: fds is a two-int array for pipe2 to fill.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let high = |fd: RawFd| {
        // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we own; we then close the original.
        let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100) };
        assert!(n >= 100);
        // SAFETY: closing the original we own.
        unsafe { libc::close(fd) };
        // SAFETY: n is a fresh descriptor owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(n) }
    };
    (high(fds[0]), high(fds[1]))
}

/// The confinement plan of the tests: best effort, so it works without privileges.
pub fn plan_json(session_dir: &Path) -> String {
    serde_json::json!({
        "uid": null,
        "gid": null,
        "session_dir": session_dir,
        "read_paths": [RUNTIME_DIR],
        "exec_paths": [],
        "write_paths": ["/dev/null"],
        "keep_fds": [0, 1, 2, 3, 4],
        "max_open_files": 256,
        "max_file_bytes": 1048576,
        "max_processes": 256,
        "max_address_space": null,
        "new_net_namespace": false,
        "new_ipc_namespace": false,
        "syscalls": "wasm",
        "enforcement": "best_effort"
    })
    .to_string()
}

/// What one cell produced.
#[derive(Debug, Default)]
pub struct CellRun {
    pub stdout: String,
    pub stderr: String,
    /// (stream, data, bytes) of every Output frame.
    pub frames: Vec<(Stream, String, u64)>,
    pub dropped_stdout: u64,
    pub dropped_stderr: u64,
    pub done: Option<WorkerMessage>,
    /// From sending the request to receiving Done.
    pub elapsed: Duration,
}

impl CellRun {
    pub fn status(&self) -> WorkerStatus {
        match &self.done {
            Some(WorkerMessage::Done { status, .. }) => *status,
            other => panic!("no Done: {other:?}"),
        }
    }

    pub fn state(&self) -> SessionState {
        match &self.done {
            Some(WorkerMessage::Done { state, .. }) => *state,
            other => panic!("no Done: {other:?}"),
        }
    }

    pub fn error(&self) -> sandcell_proto::worker::CellError {
        match &self.done {
            Some(WorkerMessage::Done { error: Some(e), .. }) => e.clone(),
            other => panic!("no error in {other:?}"),
        }
    }

    pub fn exit_code(&self) -> Option<i64> {
        match &self.done {
            Some(WorkerMessage::Done { exit_code, .. }) => *exit_code,
            _ => None,
        }
    }

    pub fn fuel(&self) -> Option<u64> {
        match &self.done {
            Some(WorkerMessage::Done { fuel, .. }) => *fuel,
            _ => None,
        }
    }

    pub fn warnings(&self) -> Vec<String> {
        match &self.done {
            Some(WorkerMessage::Done { warnings, .. }) => warnings.clone(),
            _ => vec![],
        }
    }

    pub fn kept(&self, s: Stream) -> u64 {
        self.frames.iter().filter(|f| f.0 == s).map(|f| f.2).sum()
    }
}

/// A running worker.
pub struct Worker {
    pub child: Child,
    requests: Option<File>,
    lines: Receiver<Vec<u8>>,
    pub ready_after: Duration,
    session_dir: PathBuf,
}

/// Options of one exec request.
#[derive(Debug, Clone, Default)]
pub struct Opts {
    pub timeout_ms: Option<u64>,
    pub fuel: Option<u64>,
    pub max_output: Option<u64>,
    /// `Some(false)`: the request says `display=0`.
    pub display: Option<bool>,
}

impl Worker {
    /// Starts a worker with the given guest memory limit and waits for Ready.
    pub fn start_with_memory(guest_memory: Option<u64>) -> Worker {
        Self::start_with(guest_memory, None)
    }

    /// Starts a worker; `plan` maps the session directory to the confinement plan JSON
    /// (default: [`plan_json`]).
    pub fn start_with(guest_memory: Option<u64>, plan: Option<&dyn Fn(&Path) -> String>) -> Worker {
        let mut w = Self::spawn(guest_memory, plan, &[]);
        let start = Instant::now();
        match w.next(Duration::from_secs(30)) {
            Some(WorkerMessage::Ready { language, .. }) => assert_eq!(language, "python"),
            other => panic!("expected Ready, got {other:?}"),
        }
        w.ready_after += start.elapsed();
        w
    }

    /// Spawns a worker without waiting for Ready; `env` overrides variables.
    /// `ready_after` holds the time spent spawning.
    pub fn spawn(
        guest_memory: Option<u64>,
        plan: Option<&dyn Fn(&Path) -> String>,
        env: &[(&str, &str)],
    ) -> Worker {
        let runtime = runtime_dir();
        let (req_r, req_w) = pipe();
        let (rep_r, rep_w) = pipe();
        let session_dir = std::env::temp_dir().join(format!(
            "sandcell-pytest-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&session_dir).unwrap();
        // SANDCELL_TEST_WORKER_BIN runs another build of the worker (figures before/after).
        let bin = std::env::var_os("SANDCELL_TEST_WORKER_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_sandcell-worker-python").into());
        let mut cmd = Command::new(bin);
        cmd.env_clear()
            .env(
                "SANDCELL_CONFINE",
                plan.map(|p| p(&session_dir))
                    .unwrap_or_else(|| plan_json(&session_dir)),
            )
            .env("SANDCELL_PYTHON_RUNTIME", runtime)
            .env("SANDCELL_SESSION_DIR", &session_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(m) = guest_memory {
            cmd.env("SANDCELL_GUEST_MEMORY_BYTES", m.to_string());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let (a, b) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
        // SAFETY: only async-signal-safe dup2 calls between fork and exec; the sources are
        // above 100, so they never alias 3 or 4, and dup2 clears close-on-exec on the copies.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(a, REQUEST_FD) != REQUEST_FD || libc::dup2(b, REPLY_FD) != REPLY_FD {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let start = Instant::now();
        let child = cmd.spawn().expect("spawn worker");
        drop(req_r);
        drop(rep_w);
        let (tx, rx) = channel();
        let rep = File::from(rep_r);
        std::thread::spawn(move || {
            let mut r = BufReader::new(rep);
            loop {
                let mut line = Vec::new();
                match r.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if tx.send(line).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Worker {
            child,
            requests: Some(File::from(req_w)),
            lines: rx,
            ready_after: start.elapsed(),
            session_dir,
        }
    }

    /// The host session directory given to the worker (`SANDCELL_SESSION_DIR`).
    pub fn session_dir(&self) -> &Path {
        &self.session_dir
    }

    /// Starts a worker with the default guest memory.
    pub fn start() -> Worker {
        Self::start_with_memory(None)
    }

    /// The next reply message, or None on timeout or EOF.
    pub fn next(&mut self, timeout: Duration) -> Option<WorkerMessage> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                assert!(line.ends_with(b"\n"), "unterminated line");
                Some(WorkerMessage::parse(&line[..line.len() - 1]).expect("valid reply line"))
            }
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Whether the reply pipe has reached EOF within `timeout` with no further message.
    pub fn reply_eof(&mut self, timeout: Duration) -> bool {
        matches!(
            self.lines.recv_timeout(timeout),
            Err(RecvTimeoutError::Disconnected)
        )
    }

    /// Writes raw bytes to the request pipe.
    pub fn write_raw(&mut self, bytes: &[u8]) {
        self.requests
            .as_mut()
            .expect("request pipe open")
            .write_all(bytes)
            .unwrap();
    }

    /// Closes the request pipe (EOF for the worker).
    pub fn close_requests(&mut self) {
        self.requests = None;
    }

    /// Sends an exec request.
    pub fn send(&mut self, cell: u64, code: &str, opts: &Opts) {
        let mut h = RequestHeader::exec(cell, code.len() as u64);
        h.timeout_ms = opts.timeout_ms;
        h.fuel = opts.fuel;
        h.max_output = opts.max_output;
        h.display = opts.display.unwrap_or(true);
        let mut bytes = h.to_line().into_bytes();
        bytes.extend_from_slice(code.as_bytes());
        self.write_raw(&bytes);
    }

    /// Reads messages of `cell` until its Done (panics after `limit`).
    pub fn collect(&mut self, cell: u64, limit: Duration) -> CellRun {
        let start = Instant::now();
        let mut run = CellRun::default();
        loop {
            let left = limit.saturating_sub(start.elapsed());
            let msg = self
                .next(left)
                .unwrap_or_else(|| panic!("no Done for cell {cell} within {limit:?}: {run:?}"));
            match &msg {
                WorkerMessage::Output {
                    cell: c,
                    stream,
                    data,
                    bytes,
                } => {
                    assert_eq!(*c, cell);
                    match stream {
                        Stream::Stdout => run.stdout.push_str(data),
                        Stream::Stderr => run.stderr.push_str(data),
                    }
                    run.frames.push((*stream, data.clone(), *bytes));
                }
                WorkerMessage::Dropped {
                    cell: c,
                    stream,
                    bytes,
                } => {
                    assert_eq!(*c, cell);
                    match stream {
                        Stream::Stdout => run.dropped_stdout += bytes,
                        Stream::Stderr => run.dropped_stderr += bytes,
                    }
                }
                WorkerMessage::Done { cell: c, .. } => {
                    assert_eq!(*c, cell);
                    run.done = Some(msg);
                    run.elapsed = start.elapsed();
                    return run;
                }
                WorkerMessage::Ready { .. } => panic!("second Ready"),
                WorkerMessage::Inspected { .. } => panic!("Inspected during cell {cell}"),
                WorkerMessage::Completions { .. } | WorkerMessage::Help { .. } => {
                    panic!("a completion or help answer during cell {cell}")
                }
                WorkerMessage::HostCall { .. } => panic!("HostCall during cell {cell}"),
                WorkerMessage::Display { .. } => panic!("Display without rich output, cell {cell}"),
                WorkerMessage::Fatal { stage, reason } => panic!("Fatal {stage}: {reason}"),
            }
        }
    }

    /// Sends a cell and waits for its Done.
    pub fn run(&mut self, cell: u64, code: &str, opts: &Opts) -> CellRun {
        let start = Instant::now();
        self.send(cell, code, opts);
        let mut r = self.collect(cell, Duration::from_secs(60));
        r.elapsed = start.elapsed();
        r
    }

    /// Sends a cell with default options and waits for its Done.
    pub fn cell(&mut self, cell: u64, code: &str) -> CellRun {
        self.run(
            cell,
            code,
            &Opts {
                timeout_ms: Some(30_000),
                ..Opts::default()
            },
        )
    }

    /// Sends SIGINT to the worker.
    pub fn sigint(&self) {
        // SAFETY: kill with the pid of our own child, which is not reaped before Drop.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        assert_eq!(rc, 0);
    }

    /// Waits for the worker to exit (panics after `limit`).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                start.elapsed() < limit,
                "worker did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A field of /proc/<pid>/status, e.g. `Seccomp`.
    pub fn proc_status(&self, field: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with(&format!("{field}:")))
            .unwrap();
        line.split_once(':').unwrap().1.trim().to_string()
    }

    /// Resident set size of the worker in bytes (from /proc).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.session_dir);
    }
}
