//! The worker process after confinement: configuration, start-up, and the request loop.
//!
//! Threads: the main thread runs the Tokio runtime's `block_on` with the request loop and the
//! guest (a CPU-bound guest blocks it, which is why nothing else depends on it while a cell
//! runs); one Tokio worker thread (Eryx's helper tasks), Eryx's epoch ticker, the SIGINT
//! watcher ([`crate::interrupt`]) and the output forwarder ([`crate::output::Forwarder`]),
//! which streams the output of a cell that runs longer than a millisecond. No thread is
//! started per cell.
//!
//! Exit statuses: 0 on EOF of the request pipe or an `exit` request; 1 when the reply pipe
//! fails (the daemon is gone) or the descriptors are missing; 2 on a malformed request (nothing
//! is written); 3 when start-up fails (bad configuration or runtime directory), after a
//! `Fatal` reply naming the stage (`config` or `runtime`) and the reason;
//! [`sandcell_confine::EXIT_CONFINE_FAILED`] from `main` when confinement fails.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandcell_proto::worker::{
    INSPECT_BUDGET_MS, INSPECT_DEFAULT_ITEMS, INSPECT_MAX_ITEMS, WorkerMessage, report_fatal,
};

use crate::host::HostCalls;
use crate::interrupt::{self, Interrupter};
use crate::output::Forwarder;
use crate::protocol::{ReadError, Request, read_request};
use crate::replies::{Lines, Replies};
use crate::runtime::{self, ERYX_VERSION, PYTHON_VERSION};
use crate::session::{CellRequest, DEFAULT_TIMEOUT, MAX_TIMEOUT, PySession};

/// Environment variable naming the prepared runtime directory.
pub const ENV_RUNTIME: &str = "SANDCELL_PYTHON_RUNTIME";
/// Environment variable with the guest memory limit in bytes (Eryx `max_memory_bytes`).
pub const ENV_GUEST_MEMORY: &str = "SANDCELL_GUEST_MEMORY_BYTES";
/// Environment variable with the session directory, mounted read-write in the guest at
/// [`crate::session::GUEST_FILES_DIR`] (see the crate docs, "Files").
pub const ENV_SESSION_DIR: &str = "SANDCELL_SESSION_DIR";
/// Guest memory limit when [`ENV_GUEST_MEMORY`] is unset: Eryx's default, 128 MiB.
pub const DEFAULT_GUEST_MEMORY: u64 = 128 * 1024 * 1024;
/// Request and reply pipe descriptors, as the protocol defines them.
pub use sandcell_proto::worker::{REPLY_FD, REQUEST_FD};

/// Exit statuses, see the module docs.
pub mod exit {
    /// Normal end.
    pub const OK: i32 = 0;
    /// The reply pipe failed or the descriptors are missing.
    pub const IO: i32 = 1;
    /// A malformed request.
    pub const MALFORMED: i32 = 2;
    /// Start-up failed.
    pub const STARTUP: i32 = 3;
}

/// Worker configuration from the environment the daemon sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Prepared runtime directory.
    pub runtime_dir: PathBuf,
    /// Guest memory limit in bytes.
    pub guest_memory: u64,
    /// Session directory, if given.
    pub session_dir: Option<PathBuf>,
}

impl Config {
    /// Reads [`ENV_RUNTIME`] (required), [`ENV_GUEST_MEMORY`] and [`ENV_SESSION_DIR`].
    ///
    /// Errors: the runtime variable is missing, or the memory limit is not a positive integer.
    pub fn from_env() -> Result<Self, String> {
        let runtime_dir = std::env::var_os(ENV_RUNTIME)
            .map(PathBuf::from)
            .ok_or_else(|| format!("{ENV_RUNTIME} is not set"))?;
        let guest_memory = match std::env::var(ENV_GUEST_MEMORY) {
            Ok(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(format!(
                        "{ENV_GUEST_MEMORY}={v:?} is not a positive integer"
                    ));
                }
            },
            Err(_) => DEFAULT_GUEST_MEMORY,
        };
        let session_dir = std::env::var_os(ENV_SESSION_DIR).map(PathBuf::from);
        Ok(Self {
            runtime_dir,
            guest_memory,
            session_dir,
        })
    }
}

/// Blocks until `fd` is readable or at end of file (or polling fails, which the following read
/// then reports). Does not consume anything.
fn wait_readable(fd: i32) {
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; poll only inspects the descriptor.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Takes ownership of an inherited descriptor after checking it is open.
fn inherited(fd: i32) -> Option<File> {
    // SAFETY: F_GETFD only queries the descriptor table.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return None;
    }
    // SAFETY: the daemon's descriptor layout (proto worker.rs) gives this process fds 3 and 4;
    // the descriptor is open (checked above) and nothing else in this process owns it.
    Some(unsafe { File::from_raw_fd(fd) })
}

/// Makes a write past `RLIMIT_FSIZE` (the confinement plan's `max_file_bytes`) fail with
/// `EFBIG` instead of killing the worker with `SIGXFSZ`: the guest then gets an `OSError`
/// (eryx-vfs 0.10.1 reports it as `EIO`) and the session goes on.
///
/// Errors: `sigaction` failed.
pub fn ignore_sigxfsz() -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction with SIG_IGN is a valid disposition; no handler code runs.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_IGN;
        libc::sigaction(libc::SIGXFSZ, &sa, std::ptr::null_mut())
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Everything after confinement: returns the process exit status.
pub fn run_confined() -> i32 {
    if let Err(e) = ignore_sigxfsz() {
        report_fatal("runtime", &format!("ignoring SIGXFSZ: {e}"));
        return exit::STARTUP;
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            report_fatal("config", &e);
            return exit::STARTUP;
        }
    };
    let (Some(requests), Some(replies)) = (inherited(REQUEST_FD), inherited(REPLY_FD)) else {
        eprintln!("sandcell-worker-python: descriptors {REQUEST_FD} and {REPLY_FD} must be open");
        return exit::IO;
    };
    let interrupter = Arc::new(Interrupter::new());
    if let Err(e) = interrupt::install(Arc::clone(&interrupter)) {
        report_fatal("runtime", &format!("installing the SIGINT handler: {e}"));
        return exit::STARTUP;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            report_fatal("runtime", &format!("starting the async runtime: {e}"));
            return exit::STARTUP;
        }
    };
    let replies = Arc::new(Replies::new(replies));
    let code = rt.block_on(serve(config, requests, replies, interrupter));
    // Do not wait for Eryx's helper threads (the epoch ticker never ends).
    rt.shutdown_background();
    code
}

/// Starts the session, sends `Ready`, and serves requests until EOF, `exit` or an error.
pub async fn serve(
    config: Config,
    requests: File,
    replies: Arc<Replies>,
    interrupter: Arc<Interrupter>,
) -> i32 {
    let executor = match runtime::load_executor(&config.runtime_dir) {
        Ok((e, _)) => Arc::new(e),
        Err(e) => {
            report_fatal("runtime", &format!("{e:#}"));
            return exit::STARTUP;
        }
    };
    let host = match HostCalls::new(requests) {
        Ok(h) => h,
        Err(e) => {
            report_fatal("runtime", &format!("preparing host calls: {e}"));
            return exit::STARTUP;
        }
    };
    let files = config.session_dir.as_deref();
    let mut session = match PySession::with_host_calls(
        executor,
        Some(config.guest_memory),
        files,
        Some(Arc::clone(&host)),
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            report_fatal("runtime", &format!("{e:#}"));
            return exit::STARTUP;
        }
    };
    let mut output = match Forwarder::start(Arc::clone(&replies)) {
        Ok(f) => f,
        Err(e) => {
            report_fatal("runtime", &format!("starting the output thread: {e}"));
            return exit::STARTUP;
        }
    };
    output.set_host_calls(Arc::clone(&host));
    let ready = WorkerMessage::Ready {
        language: "python".into(),
        engine: format!("eryx {ERYX_VERSION} (CPython {PYTHON_VERSION})"),
    };
    if replies.send(&ready).is_err() {
        return exit::IO;
    }
    let mut lines = Lines::new();
    loop {
        // Wait until a request is in the pipe without consuming it, then count SIGINTs from
        // now on: those sent for the previous cell are stale and dropped, and one meant for
        // this cell that came earlier is sent again by the daemon (every 250 ms).
        // (Host calls read the pipe while the cell runs: the reader is not held past this.)
        let request = {
            let mut reader = host.requests();
            if reader.buffer().is_empty() && reader.get_ref().is_empty() {
                wait_readable(REQUEST_FD);
            }
            interrupter.begin_cell();
            read_request(&mut *reader)
        };
        match request {
            Err(ReadError::Eof) | Ok(Request::Exit) => return exit::OK,
            Err(ReadError::Malformed(why)) => {
                eprintln!("sandcell-worker-python: malformed request: {why}");
                return exit::MALFORMED;
            }
            Err(ReadError::Io(e)) => {
                eprintln!("sandcell-worker-python: reading requests: {e}");
                return exit::IO;
            }
            Ok(Request::Inspect { header }) => {
                let max_items = header
                    .max_items
                    .unwrap_or(INSPECT_DEFAULT_ITEMS)
                    .clamp(1, INSPECT_MAX_ITEMS);
                let budget = Duration::from_millis(
                    header
                        .timeout_ms
                        .unwrap_or(INSPECT_BUDGET_MS)
                        .min(INSPECT_BUDGET_MS),
                );
                let (variables, truncated) = session.inspect(max_items, budget).await;
                interrupter.end_cell();
                let msg = WorkerMessage::Inspected {
                    nonce: header.nonce.clone(),
                    variables,
                    truncated,
                };
                if replies.send(&msg).is_err() {
                    return exit::IO;
                }
            }
            Ok(Request::Query { header, code }) => {
                let msg = session.query(&header, &code).await;
                interrupter.end_cell();
                if replies.send(&msg).is_err() {
                    return exit::IO;
                }
            }
            Ok(Request::Exec { header, source }) => {
                // The request is whole here: a successor daemon learns from this line that it
                // reached the worker.
                let started = WorkerMessage::Started {
                    cell: header.cell,
                    nonce: header.nonce.clone(),
                };
                if replies.send(&started).is_err() {
                    return exit::IO;
                }
                let req = CellRequest {
                    cell: header.cell,
                    source: &source,
                    timeout: header
                        .timeout_ms
                        .map(Duration::from_millis)
                        .unwrap_or(DEFAULT_TIMEOUT)
                        .min(MAX_TIMEOUT),
                    fuel: header.fuel,
                    max_output: header.max_output.unwrap_or(u64::MAX),
                    display: header.display,
                    rich: header.rich,
                    nonce: header.nonce.clone(),
                    host_calls: header.host_calls,
                };
                let done = session
                    .exec_cell(&req, &mut output, &interrupter, &mut lines)
                    .await;
                interrupter.end_cell();
                match done {
                    Ok(mut done) => {
                        // Echo the request's nonce: the daemon accepts no `done` without it.
                        if let WorkerMessage::Done { nonce, .. } = &mut done {
                            nonce.clone_from(&header.nonce);
                        }
                        // The cell's last output frames and its Done: one write.
                        if lines.push(&done).is_err() || replies.write(&mut lines).is_err() {
                            return exit::IO;
                        }
                        session.finish_cell().await;
                    }
                    Err(e) => {
                        eprintln!("sandcell-worker-python: reply pipe: {e}");
                        return exit::IO;
                    }
                }
            }
        }
    }
}
