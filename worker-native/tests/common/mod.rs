//! What the two native engines' test binaries share: how a launcher is started (its
//! confinement plan, environment and worker script) over sandcell-testing's one worker
//! harness, and the cell round trip with the output on fds 1 and 2.

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sandcell_confine::{Enforcement, Plan, SyscallProfile};
use sandcell_proto::worker::RequestHeader;
pub use sandcell_testing::worker::Cell;
use sandcell_testing::worker::{Output, WorkerProcess};

/// The R launcher built with these tests.
pub const R_LAUNCHER: &str = env!("CARGO_BIN_EXE_sandcell-worker-r");
/// The native CPython launcher built with these tests.
pub const PYTHON_LAUNCHER: &str = env!("CARGO_BIN_EXE_sandcell-worker-python-native");
/// The nonce the pydata tests send with every cell (the worker must echo it).
pub const NONCE: &str = "0123456789abcdef";

/// Which native engine a worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `sandcell-worker-r` with `r/worker.R`.
    R,
    /// `sandcell-worker-python-native` with `python/worker.py`.
    Python,
}

/// Options of one worker start. Each test binary gives it its `Default`.
#[derive(Clone)]
pub struct Start {
    /// Which engine.
    pub engine: Engine,
    /// Pass the worker script's path (else the launcher looks next to itself, then uses its
    /// embedded copy).
    pub script: bool,
    /// Launcher executable to run instead of the engine's built one.
    pub launcher: Option<PathBuf>,
    /// Run as this uid/gid under strict enforcement (root only).
    pub strict_as: Option<u32>,
    /// SANDCELL_CPU_THREADS.
    pub threads: Option<u32>,
    /// SANDCELL_PYTHON_PRELOAD.
    pub preload: Option<String>,
    /// RLIMIT_AS for the plan, in bytes.
    pub max_address_space: Option<u64>,
    /// The pydata tests' start: their plan paths (Python's configuration, the font caches,
    /// the CPU topology), the example CSVs in the session, a nonce on every cell.
    pub pydata: bool,
}

/// The package directory: the one cargo names at run time, the compile-time one only as a
/// fallback (a shared target directory can hold a test binary that another checkout built,
/// and cargo keeps it fresh across checkouts).
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The pydata examples (code, expected output, CSVs).
pub fn examples() -> PathBuf {
    manifest_dir().join("../examples/pydata")
}

/// The dynamic loader the interpreters name as their ELF interpreter, resolved (Landlock
/// rules are bound to the file; execve checks the execute right on it too).
fn loader() -> PathBuf {
    std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2")
        .or_else(|_| std::fs::canonicalize("/lib/ld-linux-aarch64.so.1"))
        .unwrap_or_else(|_| PathBuf::from("/lib64/ld-linux-x86-64.so.2"))
}

/// The confinement plan of the tests: the paths R reads at start, the worker's own
/// `/proc/<pid>`, no `/tmp`; with `pydata`, also Python's configuration (`/etc/python3.*`,
/// `/etc/matplotlibrc`), the prebuilt font caches and the CPU topology OpenBLAS reads.
pub fn plan(session: &Path, max_address_space: Option<u64>, pydata: bool) -> Plan {
    let p = |s: &str| PathBuf::from(s);
    let mut read_paths = vec![
        p("/usr"),
        p("/etc/R"),
        p("/etc/fonts"),
        p("/etc/ld.so.cache"),
        p("/etc/nsswitch.conf"),
        p("/etc/passwd"),
        p("/etc/group"),
        p("/var/cache/fontconfig"),
        p("/dev/urandom"),
        // sandcell-confine's final fd sweep lists /proc/self/fd after Landlock is on.
        // Landlock resolves the link when the rule is made: this grants the worker's own
        // /proc/<pid> only. The interpreters need none of /proc for fds 3 and 4 (pipes).
        p("/proc/self"),
        manifest_dir(),
    ];
    if pydata {
        read_paths.extend([
            p("/etc/matplotlibrc"),
            p("/var/cache/sandcell"),
            p("/sys/devices/system/cpu"),
        ]);
        if let Ok(rd) = std::fs::read_dir("/etc") {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("python3") {
                    read_paths.push(e.path());
                }
            }
        }
        read_paths.retain(|p| p.exists());
    }
    // Built through serde so that plan fields added later take their defaults.
    serde_json::from_value(serde_json::json!({
        "uid": null,
        "gid": null,
        "session_dir": session,
        "read_paths": read_paths,
        // The interpreters, /bin/sh and coreutils for system(), and the dynamic loader.
        "exec_paths": [p("/usr/lib/R"), p("/usr/bin"), loader()],
        "write_paths": [p("/dev/null")],
        "keep_fds": [0, 1, 2, 3, 4],
        "max_open_files": 256,
        "max_file_bytes": 1u64 << 30,
        "max_processes": 4096,
        "max_address_space": max_address_space,
        "new_net_namespace": true,
        "new_ipc_namespace": true,
        "syscalls": SyscallProfile::Native,
        "enforcement": Enforcement::BestEffort,
    }))
    .expect("plan")
}

/// A running native worker: the harness's process with the engine it runs.
pub struct Worker {
    process: WorkerProcess,
    engine: Engine,
    nonce: Option<&'static str>,
    next_cell: u64,
    /// The session directory.
    pub session: PathBuf,
    /// Time from spawn to `ready`.
    pub startup: Duration,
    /// stderr written before `ready` (launcher diagnostics).
    pub boot_stderr: Vec<u8>,
    /// The engine `ready` named.
    pub engine_name: String,
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

impl Worker {
    /// Starts a worker as `opts` says and waits for its `ready` (panics on anything else).
    pub fn start_with(opts: Start) -> Worker {
        let session = sandcell_testing::worker::session_dir(if opts.pydata {
            "sandcell-wpn"
        } else {
            "sandcell-wr"
        });
        if opts.pydata {
            for csv in ["mtcars.csv", "sleep.csv"] {
                std::fs::copy(examples().join(csv), session.join(csv)).unwrap();
            }
        }
        let mut plan = plan(&session, opts.max_address_space, opts.pydata);
        if let Some(id) = opts.strict_as {
            for e in std::fs::read_dir(&session).unwrap().flatten() {
                std::os::unix::fs::chown(e.path(), Some(id), Some(id)).unwrap();
            }
            std::os::unix::fs::chown(&session, Some(id), Some(id)).unwrap();
            plan.uid = Some(id);
            plan.gid = Some(id);
            plan.enforcement = Enforcement::Strict;
        }
        let (launcher, script_var, script, language) = match opts.engine {
            Engine::R => (R_LAUNCHER, "SANDCELL_R_WORKER_SCRIPT", "r/worker.R", "r"),
            Engine::Python => (
                PYTHON_LAUNCHER,
                "SANDCELL_PYTHON_WORKER_SCRIPT",
                "python/worker.py",
                "python",
            ),
        };
        let mut cmd = Command::new(opts.launcher.unwrap_or_else(|| launcher.into()));
        cmd.env_clear()
            .env("SANDCELL_CONFINE", serde_json::to_string(&plan).unwrap())
            .env("SANDCELL_SESSION_DIR", &session)
            .env(
                "SANDCELL_TEST_CANARY",
                if opts.pydata {
                    "must-not-reach-python"
                } else {
                    "must-not-reach-r"
                },
            );
        if let Some(n) = opts.threads {
            cmd.env("SANDCELL_CPU_THREADS", n.to_string());
        }
        if opts.script {
            cmd.env(script_var, manifest_dir().join(script));
        }
        if let Some(p) = &opts.preload {
            cmd.env("SANDCELL_PYTHON_PRELOAD", p);
        }
        let t0 = Instant::now();
        let mut process = WorkerProcess::spawn(cmd, session.clone(), Output::Pipes);
        let (ready_language, engine_name, boot_stderr) =
            process.await_ready(Duration::from_secs(60));
        assert_eq!(ready_language, language);
        if opts.engine == Engine::R {
            assert!(engine_name.starts_with("R "), "{engine_name}");
        }
        Worker {
            process,
            engine: opts.engine,
            nonce: opts.pydata.then_some(NONCE),
            next_cell: 1,
            session,
            startup: t0.elapsed(),
            boot_stderr,
            engine_name,
        }
    }

    /// Sends one cell without waiting; its number.
    pub fn send(&mut self, code: &[u8], timeout_ms: Option<u64>) -> u64 {
        self.send_with(code, timeout_ms, false)
    }

    /// Sends one cell without waiting, with rich output when `rich` (`rich=1`); its number.
    pub fn send_with(&mut self, code: &[u8], timeout_ms: Option<u64>, rich: bool) -> u64 {
        let cell = self.next_cell;
        self.next_cell += 1;
        let mut h = RequestHeader::exec(cell, code.len() as u64);
        h.timeout_ms = timeout_ms;
        h.rich = rich;
        h.nonce = self.nonce.map(String::from);
        self.process.send(&h, code);
        cell
    }

    /// Waits for the `done` of `cell` (sent at `t0`): a native worker sends nothing else, and
    /// echoes the nonce it was sent.
    pub fn wait_done(&mut self, cell: u64, t0: Instant, timeout: Duration) -> Cell {
        let c = self.process.collect(cell, t0, timeout);
        assert!(
            c.frames.is_empty() && c.dropped_stdout == 0 && c.dropped_stderr == 0,
            "a native worker sends nothing but done: {c:?}"
        );
        assert_eq!(c.nonce.as_deref(), self.nonce, "done must echo the nonce");
        c
    }

    /// Runs `code` with a timeout option.
    pub fn exec_opts(&mut self, code: &str, timeout_ms: Option<u64>) -> Cell {
        let t0 = Instant::now();
        let cell = self.send(code.as_bytes(), timeout_ms);
        self.wait_done(cell, t0, Duration::from_secs(120))
    }

    /// Runs `code` as a cell with rich output (display frames before its `done`).
    pub fn exec_rich(&mut self, code: &str) -> Cell {
        let t0 = Instant::now();
        let cell = self.send_with(code.as_bytes(), None, true);
        self.wait_done(cell, t0, Duration::from_secs(120))
    }

    /// Runs `code`.
    pub fn exec(&mut self, code: &str) -> Cell {
        self.exec_opts(code, None)
    }

    /// SIGINT as the daemon sends it: to the process for R, to the main thread for Python
    /// (a process-directed signal could be taken by an OpenBLAS thread).
    pub fn sigint(&self) {
        match self.engine {
            Engine::R => self.process.sigint(),
            Engine::Python => self.process.sigint_main_thread(),
        }
    }

    /// Interrupts `code` after `after`; the cell and how long the interrupt took.
    pub fn interrupt(&mut self, code: &str, after: Duration) -> (Cell, Duration) {
        let t0 = Instant::now();
        let cell = self.send(code.as_bytes(), None);
        std::thread::sleep(after);
        let sent = Instant::now();
        self.sigint();
        let c = self.wait_done(cell, t0, Duration::from_secs(30));
        (c, sent.elapsed())
    }

    /// Names in the session directory, recursively, leaving out `.tmp` (as the daemon does).
    pub fn session_files(&self) -> Vec<String> {
        fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let rel = e.path().strip_prefix(base).unwrap().display().to_string();
                if rel == ".tmp" {
                    continue;
                }
                if e.file_type().unwrap().is_dir() {
                    walk(base, &e.path(), out);
                }
                out.push(rel);
            }
        }
        let mut v = Vec::new();
        walk(&self.session, &self.session, &mut v);
        v.sort();
        v
    }
}
