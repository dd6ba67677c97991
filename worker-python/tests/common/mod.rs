//! What the Eryx worker's test binaries share: the runtime, prepared once, and the real
//! `sandcell-worker-python` binary started as the daemon starts it, driven over pipes on fds
//! 3 and 4 by sandcell-testing's one worker harness.

#![allow(dead_code)]

use std::fs::File;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sandcell_proto::worker::{RequestHeader, Stream};
use sandcell_testing::worker::{Cell, Output, WorkerProcess};

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

/// What one cell produced: the harness's [`Cell`] with the text of its `output` frames.
#[derive(Debug)]
pub struct CellRun {
    /// The text of its stdout frames.
    pub stdout: String,
    /// The text of its stderr frames.
    pub stderr: String,
    cell: Cell,
}

impl From<Cell> for CellRun {
    fn from(cell: Cell) -> CellRun {
        CellRun {
            stdout: cell.frame_text(Stream::Stdout),
            stderr: cell.frame_text(Stream::Stderr),
            cell,
        }
    }
}

impl Deref for CellRun {
    type Target = Cell;
    fn deref(&self) -> &Cell {
        &self.cell
    }
}

/// A running worker: the harness's process, started as the daemon starts the Eryx worker.
pub struct Worker {
    process: WorkerProcess,
    /// From the spawn to `ready`.
    pub ready_after: Duration,
}

impl Deref for Worker {
    type Target = WorkerProcess;
    fn deref(&self) -> &WorkerProcess {
        &self.process
    }
}

impl DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut WorkerProcess {
        &mut self.process
    }
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
        let (language, _, _) = w.await_ready(Duration::from_secs(30));
        assert_eq!(language, "python");
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
        let session_dir = sandcell_testing::worker::session_dir("sandcell-pytest");
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
            .env("SANDCELL_SESSION_DIR", &session_dir);
        if let Some(m) = guest_memory {
            cmd.env("SANDCELL_GUEST_MEMORY_BYTES", m.to_string());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let process = WorkerProcess::spawn(cmd, session_dir, Output::Discard);
        Worker {
            ready_after: process.spawned_in,
            process,
        }
    }

    /// The host session directory given to the worker (`SANDCELL_SESSION_DIR`).
    pub fn session_dir(&self) -> &Path {
        self.process.session()
    }

    /// Starts a worker with the default guest memory.
    pub fn start() -> Worker {
        Self::start_with_memory(None)
    }

    /// Sends an exec request.
    pub fn send(&mut self, cell: u64, code: &str, opts: &Opts) {
        let mut h = RequestHeader::exec(cell, code.len() as u64);
        h.timeout_ms = opts.timeout_ms;
        h.fuel = opts.fuel;
        h.max_output = opts.max_output;
        h.display = opts.display.unwrap_or(true);
        self.process.send(&h, code.as_bytes());
    }

    /// Reads messages of `cell` until its Done (panics after `limit`).
    pub fn collect(&mut self, cell: u64, limit: Duration) -> CellRun {
        self.process.collect(cell, Instant::now(), limit).into()
    }

    /// Sends a cell and waits for its Done.
    pub fn run(&mut self, cell: u64, code: &str, opts: &Opts) -> CellRun {
        let start = Instant::now();
        self.send(cell, code, opts);
        self.process
            .collect(cell, start, Duration::from_secs(60))
            .into()
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
}
