//! The confinement sequence of a sandcell worker.
//!
//! `sandcelld` decides *what* a worker may do and writes it into a [`Plan`]; the worker
//! executable (trusted code, started by the daemon as root inside its session cgroup) calls
//! [`enter`] as the first thing in `main`, before it loads an interpreter or reads a request.
//! After `enter` returns, the process is confined for good; nothing it does can undo it.
//!
//! The plan travels in the environment variable [`PLAN_ENV`] as JSON; [`Plan::from_env`] reads
//! and removes it.
//!
//! # The sequence
//!
//! [`enter`] is one straight function in the style of Firecracker's jailer
//! (`src/jailer/src/env.rs`, `Env::run`): each step is a call into its own module, in this
//! order, and the order matters (each step says why it sits where it does):
//!
//! | # | step | module | needs |
//! |---|------|--------|-------|
//! | 0 | the plan is sane; one thread only | here | - |
//! | 1 | close every fd not in `keep_fds`; no terminal | [`fds`] | - |
//! | 2 | rlimits (core 0, nofile, fsize, nproc, optional AS) | [`rlimits`] | root to raise hard limits |
//! | 3 | unshare network and IPC namespaces | [`namespaces`] | CAP_SYS_ADMIN |
//! | 3b | mount namespace: a new root built from the allowlist (if planned) | [`mounts`] | CAP_SYS_ADMIN |
//! | 4 | drop the bounding and ambient sets, lock securebits | [`caps`] | CAP_SETPCAP |
//! | 5 | setgroups([]), setresgid, setresuid | [`identity`] | CAP_SETGID, CAP_SETUID |
//! | 6 | clear permitted/effective/inheritable, verify all five sets empty | [`caps`] | - |
//! | 7 | no_new_privs | [`caps`] | - |
//! | 8 | Landlock: file system, TCP, scopes | [`landlock`] | no_new_privs |
//! | 9 | close again whatever steps 1-8 opened | [`fds`] | - |
//! | 10 | seccomp, last | [`seccomp`] | no_new_privs |
//!
//! The cgroup is not a step here: the daemon puts the child in its session group between fork
//! and exec, before this code runs (see `daemon/src/cgroup/mod.rs`).
//!
//! # Enforcement
//!
//! Under [`Enforcement::Strict`] every step must succeed, and the layers the plan asks for
//! must cover every threat of [`policy::THREATS`] (checked by [`Plan::validate`] before any
//! step); anything else is an [`Error`] and the worker exits with [`EXIT_CONFINE_FAILED`]
//! before running anything. Landlock is applied at the ABI [`policy::evaluate`] chooses for
//! the kernel (lowered by [`Plan::landlock_abi_cap`]). Under
//! [`Enforcement::BestEffort`] (the daemon's loudly named development flag), a layer that the
//! kernel or the caller's privileges cannot provide is skipped and listed in
//! [`Report::skipped`]; steps 0, 1 and 2 are never skipped.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

pub mod caps;
pub mod fds;
pub mod identity;
pub mod landlock;
pub mod mounts;
pub mod namespaces;
pub mod policy;
pub mod rlimits;
pub mod seccomp;
pub mod selfcheck;

pub use selfcheck::{SelfCheck, self_check};

/// Environment variable that carries the JSON [`Plan`] from the daemon to a worker.
pub const PLAN_ENV: &str = "SANDCELL_CONFINE";

/// Which system-call policy a worker gets (see [`seccomp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyscallProfile {
    /// A WebAssembly host (the Python worker): no fork, no exec, no sockets; threads allowed.
    Wasm,
    /// A native interpreter (R): fork and exec allowed (R's `system()`), no sockets (R only
    /// calls `socket(AF_UNIX)` for glibc's nscd lookup and falls back to files, measured with
    /// strace), stream socketpairs only, no namespaces, no tracing.
    Native,
}

/// What to do when a layer the plan asks for is not available in the running kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Fail: the worker exits before running anything (production).
    Strict,
    /// Skip the missing layer and say so in [`Report::skipped`] (`--insecure-dev`, unprivileged
    /// development).
    BestEffort,
}

/// Everything a worker needs to confine itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// Identity to switch to; `None` keeps the current one (development without root only;
    /// refused under [`Enforcement::Strict`], as is 0).
    pub uid: Option<u32>,
    /// Group to switch to; supplementary groups are always cleared when switching. Same rules
    /// as `uid`.
    pub gid: Option<u32>,
    /// The session's private directory: the only place the worker may write besides
    /// `write_paths`. Must exist. Read, write, create, remove; never execute.
    pub session_dir: PathBuf,
    /// Paths the worker may read (and list), recursively. Missing paths are skipped and listed
    /// in [`Report::missing_paths`].
    pub read_paths: Vec<PathBuf>,
    /// Paths the worker may read and execute files from, recursively. Missing paths are skipped.
    pub exec_paths: Vec<PathBuf>,
    /// Extra paths the worker may write besides the session directory (e.g. `/dev/null`).
    /// Missing paths are skipped.
    pub write_paths: Vec<PathBuf>,
    /// Descriptors to keep open; every other one is closed (runc CVE-2024-21626). Each must be
    /// open when [`enter`] runs and none may be a terminal.
    pub keep_fds: Vec<i32>,
    /// RLIMIT_NOFILE (soft and hard).
    pub max_open_files: u64,
    /// RLIMIT_FSIZE in bytes (soft and hard).
    pub max_file_bytes: u64,
    /// RLIMIT_NPROC (soft and hard). Counts every task of the uid, threads included, so it
    /// must leave room for the engine's threads. A backstop only: pids.max in the cgroup is the
    /// real limit, since RLIMIT_NPROC is per uid, not per session.
    pub max_processes: u64,
    /// RLIMIT_AS in bytes, if any (turns an R over-allocation into a catchable error; do not
    /// set it for wasmtime, which reserves large virtual regions).
    pub max_address_space: Option<u64>,
    /// Enter an empty network namespace (only a loopback interface, down).
    pub new_net_namespace: bool,
    /// Enter a new IPC namespace (no System V IPC or POSIX queues shared with the host).
    pub new_ipc_namespace: bool,
    /// The system-call policy.
    pub syscalls: SyscallProfile,
    /// What to do when a layer is missing.
    pub enforcement: Enforcement,
    /// Highest Landlock ABI to apply (`0`: none); `None` for the kernel's. The daemon sets it
    /// from its start-up decision, so every worker enforces what the daemon announced.
    #[serde(default)]
    pub landlock_abi_cap: Option<i32>,
    /// Build a mount namespace holding only the allowlisted paths (see [`mounts`]).
    #[serde(default)]
    pub mount_namespace: bool,
    /// Egress: the one TCP port the worker may connect to (its proxy listener on
    /// `127.0.0.1` in its own network namespace). With a port, the native seccomp profile
    /// allows `socket(AF_INET or AF_INET6, SOCK_STREAM, 0 or IPPROTO_TCP)` and Landlock (ABI
    /// 4 and later) allows TCP connect to this port only; `None`: no socket of any family.
    #[serde(default)]
    pub tcp_connect_port: Option<u16>,
    /// The launcher already moved the worker (between fork and exec, setns(2)) into a fresh
    /// network namespace of its own that the daemon prepared (egress: its loopback up and the
    /// proxy listener bound there, so the daemon never has to enter a worker's namespace,
    /// which needs ptrace access to it). Step 3 then unshares no other; with
    /// `new_net_namespace` it still counts as the worker's own namespace.
    #[serde(default)]
    pub net_namespace_entered: bool,
}

/// Why confinement failed. The worker prints it and exits with [`EXIT_CONFINE_FAILED`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plan was missing, not valid JSON, or not acceptable under its enforcement.
    #[error("reading confinement plan from {PLAN_ENV}: {0}")]
    Plan(String),
    /// One step of the sequence failed.
    #[error("confinement step {step} failed: {source}")]
    Step {
        /// The step's name, as in the table of the crate documentation.
        step: &'static str,
        /// The OS error, or a description wrapped in one.
        source: std::io::Error,
    },
    /// A layer the plan requires is not available.
    #[error("confinement layer {layer} unavailable: {reason}")]
    Unavailable {
        /// `landlock`, `seccomp`, ...
        layer: &'static str,
        /// What is missing and what to configure.
        reason: String,
    },
}

/// Exit status of a worker whose confinement failed.
pub const EXIT_CONFINE_FAILED: i32 = 97;

impl Plan {
    /// Reads the plan from [`PLAN_ENV`] and removes the variable from the environment.
    pub fn from_env() -> Result<Plan, Error> {
        let raw = std::env::var(PLAN_ENV).map_err(|e| Error::Plan(e.to_string()))?;
        // SAFETY: called at the start of main, before the worker starts any thread.
        unsafe { std::env::remove_var(PLAN_ENV) };
        serde_json::from_str(&raw).map_err(|e| Error::Plan(e.to_string()))
    }

    /// Checks what can be checked without touching the process.
    ///
    /// Errors: under [`Enforcement::Strict`], a missing or zero uid/gid; in every mode, a
    /// relative `session_dir` or a negative fd.
    pub fn validate(&self) -> Result<(), Error> {
        if self.enforcement == Enforcement::Strict {
            match (self.uid, self.gid) {
                (Some(u), Some(g)) if u != 0 && g != 0 => {}
                _ => {
                    return Err(Error::Plan(format!(
                        "strict enforcement needs a non-root uid and gid, plan has uid {:?} gid {:?} \
                         (the daemon leases one per session from daemon.worker_uid_base and \
                         daemon.worker_uid_count in sandcelld.toml)",
                        self.uid, self.gid
                    )));
                }
            }
        }
        if !self.session_dir.is_absolute() {
            return Err(Error::Plan(format!(
                "session_dir {} is not absolute",
                self.session_dir.display()
            )));
        }
        if let Some(fd) = self.keep_fds.iter().find(|fd| **fd < 0) {
            return Err(Error::Plan(format!("keep_fds contains negative fd {fd}")));
        }
        if self.enforcement == Enforcement::Strict {
            let d = policy::evaluate(&self.host());
            if !d.strict_ok() {
                return Err(Error::Plan(format!(
                    "the planned layers leave threats uncovered: {}",
                    d.problems().join("; ")
                )));
            }
        }
        Ok(())
    }

    /// The layers this plan asks for on the running kernel, as [`policy::Host`]. Cgroups are
    /// the daemon's part (the worker is already in its group) and count as present.
    pub fn host(&self) -> policy::Host {
        policy::Host {
            landlock_abi: landlock::effective_abi(self.landlock_abi_cap),
            seccomp: true,
            session_uids: matches!((self.uid, self.gid), (Some(u), Some(g)) if u != 0 && g != 0),
            network_namespace: self.new_net_namespace,
            mount_namespace: self.mount_namespace,
            cgroups: true,
        }
    }
}

/// How long one step of [`enter`] took.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTime {
    /// Step name (see the crate documentation's table).
    pub step: String,
    /// Wall time in microseconds.
    pub micros: u64,
}

/// What [`enter`] applied, for the worker's self-description and the hostile-cell tests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    /// Landlock ABI level enforced, or `None` when not applied.
    pub landlock_abi: Option<i32>,
    /// Whether the worker runs in its own mount namespace (see [`mounts`]).
    #[serde(default)]
    pub mount_namespace: bool,
    /// Whether the seccomp filters are installed.
    pub seccomp: bool,
    /// Layers skipped under [`Enforcement::BestEffort`], each `"<layer>: <reason>"`.
    pub skipped: Vec<String>,
    /// Paths of the plan that did not exist and got no Landlock rule.
    pub missing_paths: Vec<PathBuf>,
    /// Descriptors found open beyond `keep_fds` and closed by step 1 (their numbers only).
    pub closed_fds: Vec<i32>,
    /// Time spent in each step, in order.
    pub steps: Vec<StepTime>,
}

/// Applies the plan to the calling process. Must be called while the process has one thread
/// (Landlock and seccomp apply to the calling thread only, and a second thread would keep the
/// old identity's view of everything).
///
/// Errors: see [`Error`]; the process may be partially confined after an error and must exit
/// (with [`EXIT_CONFINE_FAILED`]) instead of running anything.
pub fn enter(plan: &Plan) -> Result<Report, Error> {
    let mut report = Report::default();
    let mut clock = Clock::start();
    let strict = plan.enforcement == Enforcement::Strict;

    // 0. The plan is acceptable, and we are alone: every later step changes only the calling
    //    thread (setresuid via glibc aside), so a second thread would escape all of them.
    plan.validate()?;
    ensure_single_threaded().map_err(step("threads"))?;
    clock.lap(&mut report, "preflight");

    // 1. Descriptors. Close everything the daemon did not hand over on purpose: an inherited
    //    directory fd (runc CVE-2024-21626: a leaked cgroup fd let the container open host paths
    //    relative to it) or socket is an escape hatch no later layer closes. Then make sure no
    //    kept fd is a terminal and there is no controlling terminal (bubblewrap CVE-2017-5226:
    //    TIOCSTI on an inherited tty pushes commands into the user's shell).
    report.closed_fds = fds::close_all_except(&plan.keep_fds).map_err(step("fds"))?;
    fds::ensure_no_terminal(&plan.keep_fds).map_err(step("terminal"))?;
    clock.lap(&mut report, "fds");

    // 2. Resource limits, while still root so hard limits can be set to any value and can
    //    never be raised again by the worker.
    rlimits::apply(plan).map_err(step("rlimits"))?;
    clock.lap(&mut report, "rlimits");

    // 3. Namespaces (needs CAP_SYS_ADMIN, so before the identity switch): an empty network
    //    namespace means no route anywhere even if a socket were obtained; a private IPC
    //    namespace hides the host's System V shared memory and message queues.
    let ns = namespaces::unshare(
        plan.new_net_namespace && !plan.net_namespace_entered,
        plan.new_ipc_namespace,
    );
    layer(&mut report, strict, "namespaces", ns)?;
    clock.lap(&mut report, "namespaces");

    // 3b. Mount namespace (needs CAP_SYS_ADMIN, and must precede Landlock, which forbids
    //     mount changes): the worker's file-system view holds only the allowlist.
    if plan.mount_namespace {
        let mounted = mounts::apply(plan);
        report.mount_namespace = mounted.is_ok();
        layer(&mut report, strict, "mount-namespace", mounted)?;
        clock.lap(&mut report, "mount-namespace");
    }

    // 4. Capabilities, part one (needs CAP_SETPCAP, so before the identity switch): empty the
    //    bounding and ambient sets so no later execve can gain a capability, and lock
    //    securebits so root-uid semantics cannot bring them back.
    let bounding = caps::drop_bounding_and_lock();
    layer(&mut report, strict, "bounding-caps", bounding)?;
    clock.lap(&mut report, "bounding-caps");

    // 5. Identity: supplementary groups first (setgroups needs CAP_SETGID, lost with the uid),
    //    then gid, then uid. The kernel clears permitted/effective on the uid switch.
    match (plan.uid, plan.gid) {
        (Some(uid), Some(gid)) => identity::switch(uid, gid).map_err(step("identity"))?,
        // Plan::validate refused this under Strict.
        _ => report
            .skipped
            .push("identity: the plan keeps the caller's uid/gid".into()),
    }
    clock.lap(&mut report, "identity");

    // 6. Capabilities, part two: clear whatever is left in permitted, effective and inheritable
    //    and verify all five sets are empty. Not skippable: it cannot fail for lack of privilege.
    caps::clear_and_verify(!strict).map_err(step("capabilities"))?;
    clock.lap(&mut report, "capabilities");

    // 7. no_new_privs: execve can never again grant privileges (setuid bits, file caps). Also a
    //    precondition of Landlock and seccomp for an unprivileged process.
    caps::set_no_new_privs().map_err(step("no_new_privs"))?;
    clock.lap(&mut report, "no_new_privs");

    // 8. Landlock: read-only, read+exec and read-write trees; no TCP bind/connect; signal and
    //    abstract-socket scopes, as far as the ABI the policy chose goes. Rules open the paths,
    //    so it runs before the final fd sweep.
    let mut host = plan.host();
    host.mount_namespace = report.mount_namespace;
    match policy::evaluate(&host).landlock_abi {
        Some(abi) => match landlock::apply(plan, abi) {
            Ok(applied) => {
                report.landlock_abi = Some(applied.abi);
                report.missing_paths = applied.missing_paths;
            }
            Err(e) => layer(&mut report, strict, "landlock", Err(e))?,
        },
        None => {
            let why = if host.landlock_abi.is_some() && report.mount_namespace {
                "abi 1 substituted by the mount namespace (abi 1 refuses every rename across \
                 directories)"
            } else {
                "not available on this kernel, or disabled by the plan"
            };
            // Under strict enforcement a missing Landlock is acceptable only when the layers
            // in force still cover every threat (Plan::validate checked the plan; this checks
            // what was actually applied).
            if !strict || policy::evaluate(&host).strict_ok() {
                report.skipped.push(format!("landlock: {why}"));
            } else {
                return Err(Error::Unavailable {
                    layer: "landlock",
                    reason: why.into(),
                });
            }
        }
    }
    clock.lap(&mut report, "landlock");

    // 9. Close again anything steps 2-8 opened and failed to close (they should not have).
    //    Without /proc, which Landlock may now hide.
    fds::close_all_except_after_landlock(&plan.keep_fds, plan.max_open_files)
        .map_err(step("fds-final"))?;
    clock.lap(&mut report, "fds-final");

    // 10. seccomp, last: it also denies calls the earlier steps needed (unshare, socket).
    let inet = plan.tcp_connect_port.is_some() && plan.syscalls == SyscallProfile::Native;
    match seccomp::install_with(plan.syscalls, inet) {
        Ok(()) => report.seccomp = true,
        Err(e) => layer(&mut report, strict, "seccomp", Err(e))?,
    }
    clock.lap(&mut report, "seccomp");

    Ok(report)
}

/// Fails unless the calling process has exactly one thread (`/proc/self/stat` field 20).
fn ensure_single_threaded() -> std::io::Result<()> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The command name (field 2) is in parentheses and may contain spaces: count from the
    // last ')'. Field 3 is the first after it, so num_threads (20) is the 18th.
    let threads = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(17))
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| std::io::Error::other("cannot parse /proc/self/stat"))?;
    if threads != 1 {
        return Err(std::io::Error::other(format!(
            "the process has {threads} threads; enter() must run before any thread starts"
        )));
    }
    Ok(())
}

/// Turns an OS error into [`Error::Step`] for `name`.
fn step(name: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Step { step: name, source }
}

/// Applies the enforcement rule to the outcome of a skippable layer: under strict enforcement an
/// error is fatal; otherwise it is recorded in [`Report::skipped`].
fn layer(
    report: &mut Report,
    strict: bool,
    name: &'static str,
    outcome: Result<(), Error>,
) -> Result<(), Error> {
    match outcome {
        Ok(()) => Ok(()),
        Err(e) if strict => Err(e),
        Err(e) => {
            report.skipped.push(format!("{name}: {e}"));
            Ok(())
        }
    }
}

/// Step timer for [`Report::steps`].
struct Clock(Instant);

impl Clock {
    fn start() -> Clock {
        Clock(Instant::now())
    }
    fn lap(&mut self, report: &mut Report, name: &str) {
        let now = Instant::now();
        report.steps.push(StepTime {
            step: name.to_owned(),
            micros: now.duration_since(self.0).as_micros() as u64,
        });
        self.0 = now;
    }
}
