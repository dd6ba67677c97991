//! A scripted fake worker for the session actor's unit tests: a real child process that speaks
//! the worker protocol (`sandcell_proto::worker`) as a [`Script`] tells it, so deadlines,
//! interrupts, slow readers, output backlogs and protocol violations are tested in
//! milliseconds, without Eryx, R, cgroups, Landlock or root.
//!
//! The child is this test binary itself, run again with the single test
//! [`fake_worker_main`] selected and the script in the environment variable [`SCRIPT_ENV`];
//! without that variable the test returns at once. It gets the descriptor layout of a real
//! worker (requests on fd 3, reply lines on fd 4, a new session, SIGINT at its default), so
//! the daemon's pid, pidfd, SIGINT, kill and reap paths are the real ones; only the
//! confinement, the cgroup ([`crate::cgroup::Unconfined`]) and the uid lease are left out.
//! [`start`] spawns it, waits for its `ready` line and hands back a [`Prepared`] worker that
//! [`crate::session::Session::start`] takes over as it takes a real one.

use crate::admission::{Admission, Budgets, Charge, UidBudgets};
use crate::cgroup::{Backend, GroupLimits, SessionGroup};
use crate::worker::spawn::Spawned;
use crate::worker::start::Prepared;
use crate::worker::{InterruptTarget, LineReader, WorkerPidfd};
use sandcell_proto::kernel::Language;
use sandcell_proto::worker::{
    Op, REPLY_FD, REQUEST_FD, RequestHeader, Stream, WorkerMessage, WorkerStatus,
};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::unix::pipe;

/// The environment variable that carries the script (JSON) to the fake worker.
pub const SCRIPT_ENV: &str = "SANDCELL_FAKE_WORKER_SCRIPT";

/// The fake's raw stdout and stderr (a native worker's output pipes) are placed on these
/// descriptors by the daemon side and moved to 1 and 2 by the fake once the test harness has
/// written its own lines (to `/dev/null`).
const RAW_STDOUT_FD: i32 = 5;
const RAW_STDERR_FD: i32 = 6;

/// What a fake worker does, request by request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Script {
    /// A native worker (R, native Python): its output travels on raw stdout/stderr pipes, and
    /// an interrupt goes to its process group. Otherwise an Eryx-like worker: output in
    /// `output` frames, SIGINT to the process.
    pub native: bool,
    /// What SIGINT does to it.
    pub sigint: Sigint,
    /// The steps of each `exec` request, in order: the first list for the first cell, and so
    /// on. A cell past the end of the list reports `ok` at once.
    pub cells: Vec<Vec<Step>>,
}

impl Script {
    /// An Eryx-like worker (output frames, SIGINT to the process) that catches SIGINT.
    pub fn eryx(cells: Vec<Vec<Step>>) -> Script {
        Script {
            native: false,
            sigint: Sigint::Catch,
            cells,
        }
    }

    /// An R-like worker (raw output pipes, SIGINT to the process group) that catches SIGINT.
    pub fn native(cells: Vec<Vec<Step>>) -> Script {
        Script {
            native: true,
            sigint: Sigint::Catch,
            cells,
        }
    }

    /// The same script with SIGINT handled as `sigint`.
    pub fn sigint(mut self, sigint: Sigint) -> Script {
        self.sigint = sigint;
        self
    }
}

/// What SIGINT does to the fake worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sigint {
    /// Default action: the worker dies of it.
    Default,
    /// Ignored: the cell runs on (native code that never checks for signals).
    Ignore,
    /// Caught: [`Step::UntilInterrupt`] returns once one arrived in the current request.
    Catch,
}

/// One step of a cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Step {
    /// An `output` frame of the running cell on the reply pipe.
    Output(Stream, String),
    /// Bytes on the worker's own stdout or stderr (a native worker's output).
    Raw(Stream, String),
    /// `bytes` of output ([`flood_text`]) in pieces of `chunk` bytes: `output` frames, or raw
    /// writes when `raw`.
    Flood {
        /// Which stream.
        stream: Stream,
        /// Bytes in all.
        bytes: usize,
        /// Bytes per frame or write.
        chunk: usize,
        /// Raw writes to fd 1/2 instead of frames.
        raw: bool,
    },
    /// The cell's `done` with this status, echoing the request's cell and nonce.
    Done(WorkerStatus),
    /// A line written as it is (a newline is added); `{cell}` and `{nonce}` are replaced by
    /// the request's. For forged and malformed frames.
    Line(String),
    /// This many bytes of `x` with no newline: past `MAX_WORKER_LINE`, a line too long.
    Unterminated(usize),
    /// Sleeps this many milliseconds whatever signal comes (a cell busy in native code).
    Sleep(u64),
    /// Waits until SIGINT arrived during this request (for good when it is ignored).
    UntilInterrupt,
    /// Creates an empty file of this name in the session directory (the worker's working
    /// directory): a mark the test can see without reading the worker's pipes.
    Touch(String),
    /// Exits at once with this status.
    Exit(i32),
}

/// The output a [`Step::Flood`] of `bytes` in pieces of `chunk` writes: piece `i` is the
/// letter `a + i % 26` repeated, so a lost or reordered piece shows.
pub fn flood_text(bytes: usize, chunk: usize) -> String {
    let mut s = String::with_capacity(bytes);
    let mut i = 0u8;
    while s.len() < bytes {
        let n = chunk.min(bytes - s.len());
        s.extend(std::iter::repeat_n(char::from(b'a' + i % 26), n));
        i = i.wrapping_add(1) % 26;
    }
    s
}

/// Spawns a fake worker running `script`, waits for its `ready` and returns it as a
/// [`Prepared`] worker: no cgroup ([`crate::cgroup::Unconfined`]), no uid lease, a fresh
/// session directory under the temporary directory (removed when its session ends) and an
/// admission permit of its own, charged to the returned [`Admission`] (whose use falls back to
/// zero once the session has released it).
pub async fn start(script: &Script) -> (Prepared, Admission) {
    let id = crate::worker::start::new_session_id().expect("random session id");
    let session_dir = std::env::temp_dir().join(format!("sandcell-fake-{id}"));
    std::fs::create_dir(&session_dir).expect("session directory");
    let limits = GroupLimits {
        memory_bytes: 0,
        max_pids: 0,
        cpu_max: None,
    };
    let group: Arc<dyn SessionGroup> =
        Arc::from(crate::cgroup::Unconfined.create(&id, &limits).unwrap());
    let admission = Admission::new(
        Budgets {
            sessions: 1,
            guest_memory: 1,
            worker_memory: 1,
        },
        UidBudgets::default(),
    );
    let permit = admission
        .try_admit(Charge {
            guest_memory: 1,
            worker_memory: 1,
        })
        .unwrap();
    let mut spawned = spawn(script, &session_dir);
    let line = tokio::time::timeout(Duration::from_secs(30), spawned.replies.next_line())
        .await
        .expect("the fake worker said nothing")
        .unwrap()
        .expect("the fake worker exited before it was ready");
    let engine = match WorkerMessage::parse(&line).unwrap() {
        WorkerMessage::Ready { engine, .. } => engine,
        other => panic!("fake worker's first line: {other:?}"),
    };
    let prepared = Prepared {
        id,
        language: if script.native {
            Language::R
        } else {
            Language::Python
        },
        environment: "fake".into(),
        guest_memory: 1,
        engine,
        spawned,
        group,
        session_dir,
        lease: None,
        permit,
        keeper: None,
    };
    (prepared, admission)
}

/// The process half of [`start`]: pipes on fds 3 and 4 (and the raw output pipes of a native
/// worker on [`RAW_STDOUT_FD`] and [`RAW_STDERR_FD`]), a new session, SIGINT at its default,
/// `dir` its working directory.
fn spawn(script: &Script, dir: &std::path::Path) -> Spawned {
    let (req_r, req_w) = crate::worker::spawn::high_pipe().unwrap();
    let (rep_r, rep_w) = crate::worker::spawn::high_pipe().unwrap();
    let raw = script.native.then(|| {
        (
            crate::worker::spawn::high_pipe().unwrap(),
            crate::worker::spawn::high_pipe().unwrap(),
        )
    });
    let mut cmd = tokio::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "worker::fake::fake_worker_main",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(SCRIPT_ENV, serde_json::to_string(script).unwrap())
    .current_dir(dir)
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .kill_on_drop(true);
    let fds = [
        req_r.as_raw_fd(),
        rep_w.as_raw_fd(),
        raw.as_ref().map_or(-1, |((_, w), _)| w.as_raw_fd()),
        raw.as_ref().map_or(-1, |(_, (_, w))| w.as_raw_fd()),
    ];
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe calls (setsid, dup2, signal).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for (from, to) in
                fds.into_iter()
                    .zip([REQUEST_FD, REPLY_FD, RAW_STDOUT_FD, RAW_STDERR_FD])
            {
                if from >= 0 && libc::dup2(from, to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let child = cmd.spawn().expect("spawn the fake worker");
    drop(cmd);
    drop((req_r, rep_w));
    let pid = child.id().unwrap();
    let pidfd = WorkerPidfd::open(pid).ok();
    let (stdout, stderr) = match raw {
        Some(((out_r, out_w), (err_r, err_w))) => {
            drop((out_w, err_w));
            (
                Some(pipe::Receiver::from_owned_fd(out_r).unwrap()),
                Some(pipe::Receiver::from_owned_fd(err_r).unwrap()),
            )
        }
        None => (None, None),
    };
    Spawned {
        egress_listener: None,
        egress_hosts: None,
        child,
        pid,
        pidfd,
        requests: pipe::Sender::from_owned_fd(req_w).unwrap(),
        replies: LineReader::new(pipe::Receiver::from_owned_fd(rep_r).unwrap()),
        stdout,
        stderr,
        interrupt: if script.native {
            InterruptTarget::ProcessGroup
        } else {
            InterruptTarget::Process
        },
    }
}

/// Set by the SIGINT handler of a fake worker that catches it; cleared at each request.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// The fake worker's entry point: a test that returns at once unless [`SCRIPT_ENV`] holds a
/// script, and otherwise runs it and exits (never returning to the test harness).
#[test]
fn fake_worker_main() {
    let Ok(text) = std::env::var(SCRIPT_ENV) else {
        return;
    };
    let script: Script = serde_json::from_str(&text).expect("script");
    // SAFETY: installs a handler that only stores to an atomic, or a disposition; moves the
    // raw output pipes the daemon side placed on fds 5 and 6 to 1 and 2.
    unsafe {
        match script.sigint {
            Sigint::Default => {}
            Sigint::Ignore => {
                libc::signal(libc::SIGINT, libc::SIG_IGN);
            }
            Sigint::Catch => {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
            }
        }
        if script.native {
            libc::dup2(RAW_STDOUT_FD, 1);
            libc::dup2(RAW_STDERR_FD, 2);
            libc::close(RAW_STDOUT_FD);
            libc::close(RAW_STDERR_FD);
        }
    }
    // SAFETY: fds 3 and 4 are the request and reply pipes placed by `spawn`; owned from here.
    let (requests, replies) = unsafe {
        (
            std::fs::File::from_raw_fd(REQUEST_FD),
            std::fs::File::from_raw_fd(REPLY_FD),
        )
    };
    let mut requests = std::io::BufReader::new(requests);
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, replies);
    let reply = |out: &mut std::io::BufWriter<std::fs::File>, m: &WorkerMessage| {
        out.write_all(&m.to_line()).unwrap();
    };
    reply(
        &mut out,
        &WorkerMessage::Ready {
            language: if script.native { "r" } else { "python" }.into(),
            engine: "fake".into(),
        },
    );
    out.flush().unwrap();
    let mut cells = script.cells.into_iter();
    loop {
        let mut line = String::new();
        if requests.read_line(&mut line).unwrap_or(0) == 0 {
            std::process::exit(0);
        }
        INTERRUPTED.store(false, Ordering::SeqCst);
        let header = RequestHeader::parse(line.trim_end()).expect("request header");
        let mut payload = vec![0u8; header.len as usize];
        requests.read_exact(&mut payload).unwrap();
        let nonce = header.nonce.clone().unwrap_or_default();
        match header.op {
            Op::Exit => std::process::exit(0),
            Op::HostReply | Op::Displayed => continue,
            Op::Inspect => {
                reply(
                    &mut out,
                    &WorkerMessage::Inspected {
                        nonce: header.nonce.clone(),
                        variables: Vec::new(),
                        truncated: false,
                    },
                );
                out.flush().unwrap();
                continue;
            }
            Op::Complete => {
                let cursor = header.cursor.unwrap_or(0);
                reply(
                    &mut out,
                    &WorkerMessage::Completions {
                        nonce: header.nonce.clone(),
                        reply: sandcell_proto::query::CompleteReply {
                            matches: Vec::new(),
                            cursor_start: cursor,
                            cursor_end: cursor,
                            truncated: false,
                        },
                    },
                );
                out.flush().unwrap();
                continue;
            }
            Op::Help => {
                let mut data = serde_json::Map::new();
                data.insert("text/plain".into(), "".into());
                reply(
                    &mut out,
                    &WorkerMessage::Help {
                        nonce: header.nonce.clone(),
                        reply: sandcell_proto::query::HelpReply { found: false, data },
                    },
                );
                out.flush().unwrap();
                continue;
            }
            Op::Exec => {}
        }
        let steps = cells
            .next()
            .unwrap_or_else(|| vec![Step::Done(WorkerStatus::Ok)]);
        reply(
            &mut out,
            &WorkerMessage::Started {
                cell: header.cell,
                nonce: header.nonce.clone(),
            },
        );
        for step in steps {
            match step {
                Step::Output(stream, data) => reply(
                    &mut out,
                    &WorkerMessage::Output {
                        cell: header.cell,
                        stream,
                        bytes: data.len() as u64,
                        data,
                    },
                ),
                Step::Raw(stream, data) => raw_write(stream, data.as_bytes()),
                Step::Flood {
                    stream,
                    bytes,
                    chunk,
                    raw,
                } => {
                    let text = flood_text(bytes, chunk);
                    for piece in text.as_bytes().chunks(chunk.max(1)) {
                        if raw {
                            raw_write(stream, piece);
                        } else {
                            let data = String::from_utf8(piece.to_vec()).unwrap();
                            reply(
                                &mut out,
                                &WorkerMessage::Output {
                                    cell: header.cell,
                                    stream,
                                    bytes: data.len() as u64,
                                    data,
                                },
                            );
                        }
                    }
                }
                Step::Done(status) => reply(
                    &mut out,
                    &WorkerMessage::Done {
                        cell: header.cell,
                        nonce: header.nonce.clone(),
                        status,
                        error: None,
                        exit_code: (status == WorkerStatus::Exited).then_some(0),
                        fuel: None,
                        state: Default::default(),
                        warnings: Vec::new(),
                    },
                ),
                Step::Line(text) => {
                    let text = text
                        .replace("{cell}", &header.cell.to_string())
                        .replace("{nonce}", &nonce);
                    out.write_all(text.as_bytes()).unwrap();
                    out.write_all(b"\n").unwrap();
                }
                Step::Unterminated(n) => {
                    out.flush().unwrap();
                    let _ = out.get_mut().write_all(&vec![b'x'; n]);
                }
                Step::Sleep(ms) => {
                    out.flush().unwrap();
                    std::thread::sleep(Duration::from_millis(ms));
                }
                Step::UntilInterrupt => {
                    out.flush().unwrap();
                    while !INTERRUPTED.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
                Step::Touch(name) => {
                    out.flush().unwrap();
                    std::fs::write(name, b"").unwrap();
                }
                Step::Exit(code) => {
                    out.flush().unwrap();
                    std::process::exit(code);
                }
            }
        }
        out.flush().unwrap();
    }
}

/// Writes `bytes` to the fake's own stdout or stderr (a native worker's output pipes).
fn raw_write(stream: Stream, bytes: &[u8]) {
    let fd = match stream {
        Stream::Stdout => 1,
        Stream::Stderr => 2,
    };
    // SAFETY: fds 1 and 2 stay open for the process's life; ManuallyDrop keeps them so.
    let mut f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    f.write_all(bytes).unwrap();
}
