//! Starting a worker: the one place where a worker's confinement is decided and applied.
//!
//! [`spawn`] does, in this order:
//! 1. creates the session directory (mode 0700, owned by the worker identity; `mkdir` never
//!    follows a symlink in its last component and the parents are root-owned) and mounts the
//!    session's bounded tmpfs on it (`crate::session_fs`);
//! 2. writes the [`Plan`] the worker executable applies to itself before anything else
//!    (`sandcell_confine::enter`: fds, rlimits, namespaces, identity, no_new_privs,
//!    capabilities, Landlock, seccomp — see docs/internals/confinement.md, "Confinement order");
//! 3. builds an environment from an allowlist (never the daemon's own);
//! 4. forks; between fork and exec the child (async-signal-safe calls only) joins the session
//!    cgroup by writing `"0"` to each pre-opened `cgroup.procs`, starts a new session (no
//!    controlling terminal: bubblewrap CVE-2017-5226), puts the protocol pipes on fds 3 and 4,
//!    resets SIGINT/SIGQUIT to their defaults (an inherited SIG_IGN survives exec: execve(2)),
//!    and marks every other descriptor close-on-exec (runc CVE-2024-21626); and sets its
//!    `oom_score_adj` to 1000, so that the kernel's OOM killer picks a cell first and the
//!    daemon (`OOMScoreAdjust=-500` in sandcelld.service) last: without it every worker would
//!    inherit the daemon's protection. The child still holds the daemon's capabilities there;
//!    with CAP_SYS_RESOURCE the kernel also raises its `oom_score_adj_min` to 1000 (proc(5)),
//!    so the cell cannot lower the value again (the worker's read-only procfs and Landlock
//!    refuse the write too);
//! 5. after the fork, the parent verifies that the worker is in its cgroup.
//!
//! Which optional layers the plans ask for (the Landlock ABI, the mount namespace) is decided
//! once at start by `sandcell_confine::policy::evaluate` and recorded with
//! [`set_confinement`]; every plan follows that record.
//!
//! Nothing untrusted runs until the worker has confined itself and said `Ready`.

use crate::cgroup::SessionGroup;
use crate::config::Engine;
use sandcell_confine::{Enforcement, Plan, SyscallProfile};
use sandcell_proto::kernel::Language;
use sandcell_proto::worker::{REPLY_FD, REQUEST_FD};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use tokio::net::unix::pipe;

/// The daemon's start-up confinement decision: what every worker enforces, for plans, logs,
/// `sandcelld --check` and the D-Bus `Confinement` property.
#[derive(Debug, Clone)]
pub struct Confinement {
    /// `strict` or `best-effort` (`--insecure-dev`).
    pub enforcement: &'static str,
    /// `uname -r`.
    pub kernel: String,
    /// The kernel's Landlock ABI (`None`: no Landlock).
    pub kernel_landlock_abi: Option<i32>,
    /// The test-only cap in force, if any.
    pub landlock_test_cap: Option<i32>,
    /// cgroup mode (`v2`, `v1`, `none`).
    pub cgroups: String,
    /// The policy's decision.
    pub decision: sandcell_confine::policy::Decision,
}

impl Confinement {
    /// The record as a string map: `enforcement`, `kernel`, `kernel-landlock-abi`,
    /// `landlock-abi` (applied by workers; `none`), `landlock-test-cap` (only when set),
    /// `cgroups`, `strict` (`yes`/`no`), `layer.<name>` = `active`/`substituted`/`missing`,
    /// `threat.<name>` = the active layers that stop it, joined by `+` (empty: uncovered).
    pub fn map(&self) -> BTreeMap<String, String> {
        let abi = |a: Option<i32>| a.map_or("none".to_string(), |a| a.to_string());
        let mut m = BTreeMap::new();
        m.insert("enforcement".into(), self.enforcement.into());
        m.insert("kernel".into(), self.kernel.clone());
        m.insert("kernel-landlock-abi".into(), abi(self.kernel_landlock_abi));
        m.insert("landlock-abi".into(), abi(self.decision.landlock_abi));
        if let Some(cap) = self.landlock_test_cap {
            m.insert("landlock-test-cap".into(), cap.to_string());
        }
        m.insert("cgroups".into(), self.cgroups.clone());
        m.insert(
            "strict".into(),
            if self.decision.strict_ok() {
                "yes"
            } else {
                "no"
            }
            .into(),
        );
        for (layer, state) in &self.decision.layers {
            m.insert(format!("layer.{}", layer.name()), state.as_str().into());
        }
        for (threat, by) in &self.decision.threats {
            let by: Vec<&str> = by.iter().map(|l| l.name()).collect();
            m.insert(format!("threat.{threat}"), by.join("+"));
        }
        m
    }
}

static CONFINEMENT: OnceLock<Confinement> = OnceLock::new();

/// Records the start-up decision; the first call wins (the daemon decides once).
pub fn set_confinement(c: Confinement) {
    let _ = CONFINEMENT.set(c);
}

/// The start-up decision, once made.
pub fn confinement() -> Option<&'static Confinement> {
    CONFINEMENT.get()
}

/// What to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Interpreter.
    pub language: Language,
    /// How it runs: Eryx (Python only) or the native interpreter.
    pub engine: Engine,
    /// Native engines: the interpreter (Python: the `python3` executable; R: the R home);
    /// `None`: the launcher's default.
    pub interpreter: Option<PathBuf>,
    /// Native engines: extra read-only library directories.
    pub library_paths: Vec<PathBuf>,
    /// Native engines: the environment's package source (a wheelhouse or a CRAN-style
    /// repository), read-only in the worker's view and named by its variable
    /// (`crate::packages::Source::env_var`); installs go to the session's scratch directory.
    pub package_source: Option<crate::packages::Source>,
    /// The environment has egress (native engines): TCP sockets to the proxy port allowed
    /// and `HTTP_PROXY`/`HTTPS_PROXY` set (see `crate::egress`).
    pub egress: bool,
    /// Native Python: modules imported before Ready.
    pub preload: Vec<String>,
    /// BLAS/OpenMP threads of a native Python worker: the session's CPU quota, rounded up
    /// (at least 1).
    pub cpu_threads: u32,
    /// Session id, used in paths.
    pub session_id: String,
    /// Session directory to create.
    pub session_dir: PathBuf,
    /// Worker identity; `None` keeps the daemon's (development only).
    pub uid: Option<u32>,
    /// Worker group; `None` keeps the daemon's.
    pub gid: Option<u32>,
    /// Directory holding `sandcell-worker-python`, `sandcell-worker-r`.
    pub worker_dir: PathBuf,
    /// Prepared Eryx runtime.
    pub python_runtime_dir: PathBuf,
    /// Eryx guest memory, bytes.
    pub guest_memory_bytes: u64,
    /// Address-space limit for native workers, bytes (RLIMIT_AS), if any.
    pub native_address_space: Option<u64>,
    /// RLIMIT_FSIZE, bytes: the session's disk budget (`max_session_files_bytes`), so no one
    /// file a cell writes outgrows it (workers ignore SIGXFSZ: the write fails with `EFBIG`).
    pub max_file_bytes: u64,
    /// Strict in production; best effort only with `--insecure-dev`.
    pub enforcement: Enforcement,
}

/// A started worker.
#[derive(Debug)]
pub struct Spawned {
    /// The process.
    pub child: tokio::process::Child,
    /// Its pid.
    pub pid: u32,
    /// Its pidfd, opened before anything could reap it; `None` where the kernel has no
    /// `pidfd_open` (then it is signalled by pid, and only while unreaped).
    pub pidfd: Option<super::WorkerPidfd>,
    /// Write end of the request pipe (worker fd 3).
    pub requests: pipe::Sender,
    /// Reply lines from the worker (its fd 4).
    pub replies: super::LineReader<pipe::Receiver>,
    /// Read end of the worker's stdout (native workers only).
    pub stdout: Option<pipe::Receiver>,
    /// Read end of the worker's stderr (native workers only).
    pub stderr: Option<pipe::Receiver>,
    /// Where an interrupt is aimed.
    pub interrupt: super::InterruptTarget,
    /// Egress workers: the proxy listener on `127.0.0.1:3128` of the worker's network
    /// namespace, made by the daemon before the fork ([`crate::egress::prepare_namespace`]),
    /// for [`crate::egress::open`] to grant when its session starts.
    pub egress_listener: Option<OwnedFd>,
    /// The hosts the session's egress grant allows (set when it is granted), which its record
    /// keeps for a successor's grant after a restart.
    pub egress_hosts: Option<Vec<String>>,
}

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was done.
        op: String,
        /// The error.
        source: std::io::Error,
    },
    /// The worker is not in its cgroup.
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::Error),
}

fn io(op: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let op = op.into();
    move |source| Error::Io { op, source }
}

/// The worker executable for `language` run by `engine`.
pub fn executable(worker_dir: &Path, language: Language, engine: Engine) -> PathBuf {
    worker_dir.join(match (language, engine) {
        (Language::Python, Engine::Eryx) => "sandcell-worker-python",
        (Language::Python, Engine::Native) => "sandcell-worker-python-native",
        (Language::R, _) => "sandcell-worker-r",
    })
}

/// Read-only paths every native worker needs beside the shared libraries: data files under
/// `/usr/share` (R's library, matplotlib's data, fonts), font configuration and the host's
/// font caches, the user database (R and Python's `getpass`/`pwd` read it), the process's own
/// `/proc/self`, and Debian's alternatives (libblas.so.3 and liblapack.so.3 resolve through
/// `/etc/alternatives`; Landlock does not mediate symlink lookups, but inside the mount
/// namespace only allowlisted paths exist).
const NATIVE_READ: [&str; 9] = [
    "/usr/share",
    "/etc/fonts",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/var/cache/fontconfig",
    "/proc/self",
    "/etc/alternatives",
    "/sys/devices/system/cpu",
];

/// Read-only paths of the native Python worker beside [`NATIVE_READ`]: Debian's interpreter
/// configuration (`sysconfig` reads `/etc/python3.<minor>/sitecustomize.py`), matplotlib's
/// system configuration, and the root-owned font list built once per host by
/// `scripts/font-cache.sh` (`/var/cache/sandcell/matplotlib`). `/sys/devices/system/cpu` (in
/// [`NATIVE_READ`]) is where OpenBLAS and `os.cpu_count` look for CPUs.
fn python_native_read() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = [
        "/etc/matplotlibrc",
        "/var/cache/sandcell",
        "/etc/mime.types",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    if let Ok(dir) = std::fs::read_dir("/etc") {
        for e in dir.flatten() {
            let name = e.file_name();
            if name.to_str().is_some_and(|n| n.starts_with("python3")) {
                v.push(e.path());
            }
        }
    }
    v
}

/// The confinement plan of a worker: what it may read, execute and write.
pub fn plan(spec: &WorkerSpec) -> Plan {
    // Shared libraries and the dynamic loader's cache: every native program needs them.
    let mut read_paths: Vec<PathBuf> = [
        "/usr/lib",
        "/lib",
        "/lib64",
        "/usr/lib64",
        "/etc/ld.so.cache",
        "/dev/urandom",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    let mut exec_paths = vec![spec.worker_dir.clone()];
    let native = |read_paths: &mut Vec<PathBuf>, exec_paths: &mut Vec<PathBuf>| {
        read_paths.extend(NATIVE_READ.iter().map(PathBuf::from));
        read_paths.extend(spec.library_paths.iter().cloned());
        // Read-only, never writable: installs copy out of it into the session.
        read_paths.extend(spec.package_source.iter().map(|s| s.path.clone()));
        // /bin/sh plus coreutils for system()/subprocess, and the dynamic loader: execve
        // checks the execute right on the ELF interpreter too (measured).
        for p in ["/usr/bin", "/bin"] {
            exec_paths.push(p.into());
        }
        if let Ok(loader) = std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2") {
            exec_paths.push(loader);
        }
    };
    let (syscalls, max_address_space) = match (spec.language, spec.engine) {
        (Language::Python, Engine::Eryx) => {
            read_paths.push(spec.python_runtime_dir.clone());
            // wasmtime sizes its thread pool and checks CPU features from here.
            read_paths.push("/sys/devices/system/cpu".into());
            (SyscallProfile::Wasm, None)
        }
        (Language::Python, Engine::Native) => {
            native(&mut read_paths, &mut exec_paths);
            read_paths.extend(python_native_read());
            // The interpreter and whatever its path resolves through (python3 -> python3.11).
            if let Some(i) = &spec.interpreter {
                read_paths.push(i.clone());
                exec_paths.push(i.clone());
                if let Ok(real) = std::fs::canonicalize(i) {
                    exec_paths.push(real);
                }
            }
            (SyscallProfile::Native, spec.native_address_space)
        }
        (Language::R, _) => {
            native(&mut read_paths, &mut exec_paths);
            // R's configuration, and R itself.
            read_paths.push("/etc/R".into());
            exec_paths.push(
                spec.interpreter
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("/usr/lib/R")),
            );
            (SyscallProfile::Native, spec.native_address_space)
        }
    };
    read_paths.retain(|p| p.exists());
    exec_paths.retain(|p| p.exists());
    // Without a recorded decision (library tests), the kernel's Landlock and no mount
    // namespace: what the worker's own policy check then accepts or refuses.
    let (landlock_abi_cap, mount_namespace) = match confinement() {
        Some(c) => (
            Some(c.decision.landlock_abi.unwrap_or(0)),
            c.decision.mount_namespace,
        ),
        None => (None, false),
    };
    // A native worker may write its own private /tmp, /var/tmp and /dev/shm (tmpfs mounts of
    // its mount namespace: Python's tempfile, multiprocessing's semaphores, joblib, R's
    // tempdir()). Without a mount namespace those paths are the host's, shared by every
    // session, and stay unwritable.
    let mut write_paths: Vec<PathBuf> = vec!["/dev/null".into()];
    if mount_namespace && syscalls == SyscallProfile::Native {
        write_paths.extend(sandcell_confine::mounts::TMPFS.iter().map(PathBuf::from));
        // The view's /proc/stat is a synthesized copy with zero counters (psutil reads it on
        // import); without the view it is the host's and stays unreadable.
        read_paths.push(sandcell_confine::mounts::PROC_STAT.into());
    }
    Plan {
        uid: spec.uid,
        gid: spec.gid,
        session_dir: spec.session_dir.clone(),
        read_paths,
        exec_paths,
        write_paths,
        keep_fds: sandcell_proto::worker::WORKER_FDS.to_vec(),
        max_open_files: 256,
        max_file_bytes: spec.max_file_bytes,
        max_processes: 256,
        max_address_space,
        new_net_namespace: true,
        new_ipc_namespace: true,
        syscalls,
        enforcement: spec.enforcement,
        landlock_abi_cap,
        mount_namespace,
        tcp_connect_port: (spec.egress && syscalls == SyscallProfile::Native)
            .then_some(crate::egress::PROXY_PORT),
        // `spawn` makes an egress worker's namespace and the child joins it before exec.
        net_namespace_entered: spec.egress && spec.engine == Engine::Native,
    }
}

/// The worker's environment: built from nothing, never copied from the daemon.
fn environment(spec: &WorkerSpec, plan: &Plan) -> Vec<(String, String)> {
    // The worker works in the files directory and keeps its scratch beside it, on the same
    // file system (crate::files: the layout of a session directory).
    let dir = crate::files::files_dir(&spec.session_dir);
    let scratch = if dir == spec.session_dir {
        dir.join(crate::files::FLAT_SCRATCH_DIR)
    } else {
        spec.session_dir.join(crate::files::SCRATCH_DIR)
    };
    let dir = dir.display().to_string();
    let scratch = scratch.display().to_string();
    let scratch_dir = scratch.clone();
    let mut env = vec![
        ("PATH".into(), "/usr/bin:/bin".into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("HOME".into(), dir.clone()),
        ("TMPDIR".into(), scratch.clone()),
        ("SANDCELL_TMPDIR".into(), scratch),
        ("SANDCELL_SESSION_DIR".into(), dir),
        (
            sandcell_confine::PLAN_ENV.into(),
            serde_json::to_string(plan).expect("plan serialises"),
        ),
    ];
    match (spec.language, spec.engine) {
        (Language::Python, Engine::Native) => {
            if let Some(i) = &spec.interpreter {
                env.push(("SANDCELL_PYTHON".into(), i.display().to_string()));
            }
            let libs: Vec<String> = spec
                .library_paths
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            if !libs.is_empty() {
                env.push(("SANDCELL_PYTHON_PATH".into(), libs.join(":")));
            }
            if !spec.preload.is_empty() {
                env.push(("SANDCELL_PYTHON_PRELOAD".into(), spec.preload.join(",")));
            }
            env.push((
                "SANDCELL_CPU_THREADS".into(),
                spec.cpu_threads.max(1).to_string(),
            ));
        }
        (Language::R, _) => {
            if let Some(i) = &spec.interpreter {
                env.push(("SANDCELL_R_HOME".into(), i.display().to_string()));
            }
        }
        _ => {}
    }
    if let Some(src) = &spec.package_source {
        // The source, and the per-session directory installs go to (on the session's own
        // file system, so installed bytes count against its disk budget and end with it).
        env.push((src.env_var().into(), src.path.display().to_string()));
        env.push((
            "SANDCELL_PACKAGES_DIR".into(),
            Path::new(&scratch_dir)
                .join(crate::packages::SESSION_PACKAGES_DIR)
                .display()
                .to_string(),
        ));
    }
    if spec.egress && spec.engine == Engine::Native {
        // pip, requests, urllib, curl and R's download.file read these.
        let proxy = format!("http://127.0.0.1:{}", crate::egress::PROXY_PORT);
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.push((k.into(), proxy.clone()));
        }
        env.push(("NO_PROXY".into(), String::new()));
        env.push(("no_proxy".into(), String::new()));
    }
    if spec.engine == Engine::Eryx {
        env.push((
            "SANDCELL_PYTHON_RUNTIME".into(),
            spec.python_runtime_dir.display().to_string(),
        ));
        env.push((
            "SANDCELL_GUEST_MEMORY_BYTES".into(),
            spec.guest_memory_bytes.to_string(),
        ));
    }
    env
}

/// Creates `dir` mode 0700 owned by `uid:gid` without following a symlink.
pub fn create_session_dir(dir: &Path, uid: Option<u32>, gid: Option<u32>) -> std::io::Result<()> {
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    if uid.is_some() || gid.is_some() {
        std::os::unix::fs::lchown(dir, uid, gid)?;
    }
    Ok(())
}

/// A pipe whose both ends are close-on-exec, each moved above fd 63 so that placing them on
/// fds 0-4 in the child can never overwrite another descriptor the child still needs.
pub(crate) fn high_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
    Ok((dup_high(r)?, dup_high(w)?))
}

fn dup_high(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor we own; the result is a new descriptor we take ownership of.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 64) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` is a fresh descriptor returned by fcntl, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// Starts the worker of `spec` inside `group`. See the module documentation for the order.
pub fn spawn(spec: &WorkerSpec, group: &Arc<dyn SessionGroup>) -> Result<Spawned, Error> {
    create_session_dir(&spec.session_dir, spec.uid, spec.gid)
        .map_err(io(format!("create {}", spec.session_dir.display())))?;
    // The session's own file system, bounded by its disk and entry budgets; mounted before
    // the fork, so the worker's mount namespace (a copy of the daemon's) binds it.
    if let Err(e) =
        crate::session_fs::mount(&spec.session_dir, spec.max_file_bytes, spec.uid, spec.gid)
    {
        if spec.enforcement == Enforcement::Strict {
            return Err(Error::Io {
                op: format!(
                    "mount the session file system on {} (needs CAP_SYS_ADMIN and the mount \
                     system calls)",
                    spec.session_dir.display()
                ),
                source: e,
            });
        }
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(error = %e, "no session file system (best effort): the disk budget is held by the walks only");
        });
    }
    // The user's files and the worker's scratch side by side on that file system.
    crate::files::lay_out(&spec.session_dir, spec.uid, spec.gid)
        .map_err(io(format!("lay out {}", spec.session_dir.display())))?;
    // Egress (native engines): the worker's network namespace is made here, loopback up and
    // the proxy listener bound in it; the child joins it before exec.
    let egress = if spec.egress && spec.engine == Engine::Native {
        Some(crate::egress::prepare_namespace().map_err(io(
            "prepare the egress worker's network namespace (needs CAP_NET_ADMIN and AF_INET)",
        ))?)
    } else {
        None
    };
    let plan = plan(spec);

    // Opened before the fork, close-on-exec, so the child only has to write(2).
    let procs: Vec<OwnedFd> = group
        .procs_files()
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(p)
                .map(OwnedFd::from)
                .and_then(dup_high)
                .map_err(io(format!("open {}", p.display())))
        })
        .collect::<Result<_, _>>()?;

    let (req_r, req_w) = high_pipe().map_err(io("pipe"))?;
    let (rep_r, rep_w) = high_pipe().map_err(io("pipe"))?;
    let devnull = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(io("open /dev/null"))
    };
    let (stdout, stderr, out_r, err_r) = match spec.engine {
        // A native interpreter's own stdout/stderr are the cell's streams, drained and bounded
        // by the daemon.
        Engine::Native => {
            let (or, ow) = high_pipe().map_err(io("pipe"))?;
            let (er, ew) = high_pipe().map_err(io("pipe"))?;
            (
                std::process::Stdio::from(ow),
                std::process::Stdio::from(ew),
                Some(or),
                Some(er),
            )
        }
        // Eryx lets raw guest writes to fds 1 and 2 through to the host process: they go to
        // /dev/null and never reach the daemon, its log, or the client.
        Engine::Eryx => (devnull()?.into(), devnull()?.into(), None, None),
    };
    let exe = executable(&spec.worker_dir, spec.language, spec.engine);

    let mut cmd = tokio::process::Command::new(&exe);
    cmd.env_clear()
        .envs(environment(spec, &plan))
        .current_dir("/")
        .stdin(devnull()?)
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true);
    let procs_raw: Vec<RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let (req_raw, rep_raw) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
    let netns_raw = egress.as_ref().map_or(-1, |e| e.namespace.as_raw_fd());
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (write, open, close, setsid, setns, dup2, signal,
    // close_range);
    // it allocates nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &procs_raw {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // The OOM killer's first choice is a cell, never the daemon (whose negative
            // OOMScoreAdjust= every child inherits). Written while the child holds the
            // daemon's capabilities: with CAP_SYS_RESOURCE the kernel raises the process's
            // oom_score_adj_min to the same 1000, so nothing it runs can lower it (proc(5)).
            let adj = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if adj < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let written = libc::write(adj, b"1000".as_ptr().cast(), 4);
            libc::close(adj);
            if written != 4 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // An egress worker's own network namespace, made by the daemon (setns(2)).
            if netns_raw >= 0 && libc::setns(netns_raw, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::dup2(req_raw, REQUEST_FD) < 0 || libc::dup2(rep_raw, REPLY_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            // Every descriptor above 4 is closed by the exec (CLOSE_RANGE_CLOEXEC keeps std's
            // own exec-error pipe working until then).
            crate::sys::close_range_cloexec(5)?;
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(io(format!("spawn {}", exe.display())))?;
    // The parent keeps only its own ends: the child's ends and the cgroup files close here.
    drop(cmd);
    drop((req_r, rep_w, procs));
    // The worker holds its namespace now; the daemon keeps only the listener.
    let egress_listener = egress.map(|e| e.listener);
    let pid = child.id().unwrap_or(0);
    group.verify_member(pid)?;
    // Nothing has waited for the child yet, so `pid` still names it.
    let pidfd = super::WorkerPidfd::open(pid).ok();
    let requests = pipe::Sender::from_owned_fd(req_w).map_err(io("request pipe"))?;
    let replies =
        super::LineReader::new(pipe::Receiver::from_owned_fd(rep_r).map_err(io("reply pipe"))?);
    let stdout = out_r
        .map(pipe::Receiver::from_owned_fd)
        .transpose()
        .map_err(io("stdout pipe"))?;
    let stderr = err_r
        .map(pipe::Receiver::from_owned_fd)
        .transpose()
        .map_err(io("stderr pipe"))?;
    let interrupt = match (spec.language, spec.engine) {
        (Language::R, _) => super::InterruptTarget::ProcessGroup,
        (Language::Python, Engine::Native) => super::InterruptTarget::MainThread,
        (Language::Python, Engine::Eryx) => super::InterruptTarget::Process,
    };
    Ok(Spawned {
        child,
        pid,
        pidfd,
        requests,
        replies,
        stdout,
        stderr,
        interrupt,
        egress_listener,
        egress_hosts: None,
    })
}
