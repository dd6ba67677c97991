//! The language-neutral part of sandcell's native worker launchers (`sandcell-worker-r`,
//! `sandcell-worker-python-native`).
//!
//! A native launcher is started by `sandcelld` inside the session's cgroup with the descriptor
//! layout of `sandcell_proto::worker` (fd 0 `/dev/null`, fds 1 and 2 the cell's stdout and
//! stderr pipes, fd 3 the request pipe, fd 4 the reply pipe). Every launcher does the same
//! steps, in this order, and only then replaces itself with its interpreter:
//!
//! 1. [`confine`]: reads the confinement plan ([`sandcell_confine::Plan::from_env`]), optionally
//!    gives the protocol pipes to the worker identity (R reopens them by path, see
//!    [`hand_pipes_to`]), and enters the plan ([`sandcell_confine::enter`]); on failure it
//!    prints the reason on stderr and exits with [`sandcell_confine::EXIT_CONFINE_FAILED`];
//! 2. [`enter_session`]: changes directory to the session's files directory
//!    (`SANDCELL_SESSION_DIR`) and creates the private temporary directory (`SANDCELL_TMPDIR`,
//!    which the daemon puts beside the files directory, else `<session>/.tmp`); inside the
//!    mount namespace the working directory is `/mnt/data` and the temporary directory
//!    `/mnt/tmp`. The temporary directory is on the session's own file system and mount, so a
//!    file a cell made with `tempfile()` can be renamed into place (a rename across file
//!    systems or mounts fails `EXDEV`) and counts against the disk budget, and it is not in
//!    the listing of the files directory;
//! 3. [`reset_signals`] just before `execve` (an inherited `SIG_IGN` for SIGINT survives
//!    `execve`, and both R and CPython honour it, which would make cells uninterruptible).
//!
//! The interpreter's environment is built only from allowlists: [`common_environment`] holds
//! what every native interpreter gets, including the thread counts of BLAS and OpenMP pools
//! ([`cpu_threads`]) and the font caches ([`font_environment`]).

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

/// Exit status when confinement succeeded but the interpreter could not be started (bad
/// session directory, missing script, `execve` failure). Distinct from
/// [`sandcell_confine::EXIT_CONFINE_FAILED`].
pub const EXIT_LAUNCH_FAILED: i32 = 96;

/// The request and reply pipes (see `sandcell_proto::worker`).
pub const PROTOCOL_FDS: [RawFd; 2] = [3, 4];

/// Largest BLAS/OpenMP thread count a launcher passes on (`SANDCELL_CPU_THREADS` is clamped).
pub const MAX_CPU_THREADS: u32 = 64;

/// Root-owned, read-only directory holding matplotlib's prebuilt font list
/// (`fontlist-v*.json`), built once per host by `scripts/font-cache.sh`.
pub const DEFAULT_MPL_CACHE: &str = "/var/cache/sandcell/matplotlib";

/// Prints `msg` on stderr (the cell stderr pipe, read by the daemon) prefixed with `prog`, and
/// exits with `code`.
pub fn fail(prog: &str, code: i32, msg: &str) -> ! {
    eprintln!("{prog}: {msg}");
    std::process::exit(code)
}

/// Step 1: reads the plan, hands the protocol pipes to the worker identity when `hand_pipes`
/// (and the plan switches identity), and enters the plan. Layers skipped under the development
/// flag are named on stderr, where the daemon logs them before `ready`. Exits on failure.
pub fn confine(prog: &str, hand_pipes: bool) -> sandcell_confine::Plan {
    let plan = match sandcell_confine::Plan::from_env() {
        Ok(p) => p,
        Err(e) => fail(prog, sandcell_confine::EXIT_CONFINE_FAILED, &e.to_string()),
    };
    if hand_pipes
        && let (Some(uid), Some(gid)) = (plan.uid, plan.gid)
        && let Err(e) = hand_pipes_to(uid, gid, &PROTOCOL_FDS)
    {
        fail(prog, sandcell_confine::EXIT_CONFINE_FAILED, &e);
    }
    match sandcell_confine::enter(&plan) {
        Ok(report) => {
            for skipped in &report.skipped {
                eprintln!("{prog}: confinement layer skipped: {skipped}");
            }
        }
        Err(e) => fail(prog, sandcell_confine::EXIT_CONFINE_FAILED, &e.to_string()),
    }
    plan
}

/// The session directory and the private temporary directory of a confined launcher.
#[derive(Debug, Clone)]
pub struct SessionPaths {
    /// Working directory of the cells (`SANDCELL_SESSION_DIR`, else the plan's).
    pub session: PathBuf,
    /// The interpreter's `TMPDIR` (`SANDCELL_TMPDIR`, which the daemon puts beside the files
    /// directory, `/mnt/tmp` in the view; else `<session>/.tmp`, which the daemon leaves out
    /// of a cell's `files`).
    pub tmp: PathBuf,
}

/// Step 2: enters the session directory and creates the temporary directory, with the
/// worker's own rights (after [`confine`]). Exits with [`EXIT_LAUNCH_FAILED`] on failure.
pub fn enter_session(prog: &str, plan: &sandcell_confine::Plan) -> SessionPaths {
    let mut session = std::env::var_os("SANDCELL_SESSION_DIR")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| plan.session_dir.clone());
    if let Err(e) = std::env::set_current_dir(&session) {
        fail(
            prog,
            EXIT_LAUNCH_FAILED,
            &format!("cannot enter session directory {}: {e}", session.display()),
        );
    }
    // Inside the mount namespace the session directory is bound a second time at /mnt/data:
    // the cells work there, so getcwd(3) shows /mnt/data (as in the Eryx engine and OpenAI's
    // code_interpreter) rather than a host path.
    let mnt_data = Path::new(sandcell_confine::mounts::MNT_DATA);
    let in_view = same_directory(mnt_data, &session) && std::env::set_current_dir(mnt_data).is_ok();
    let mut tmp = std::env::var_os("SANDCELL_TMPDIR")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| session.join(".tmp"));
    if in_view {
        session = mnt_data.to_path_buf();
        // The daemon's scratch directory beside the files is /mnt/tmp in the view, on the
        // same mount as /mnt/data (a rename between two mounts fails EXDEV).
        let mnt_tmp = mnt_data
            .parent()
            .unwrap_or(Path::new("/"))
            .join(sandcell_confine::mounts::MNT_SCRATCH);
        if same_directory(&mnt_tmp, &tmp) {
            tmp = mnt_tmp;
        }
    }
    if let Err(e) = std::fs::create_dir_all(&tmp) {
        fail(
            prog,
            EXIT_LAUNCH_FAILED,
            &format!("cannot create temporary directory {}: {e}", tmp.display()),
        );
    }
    SessionPaths { session, tmp }
}

/// Whether `a` is a bind mount (a directory, not a symlink) of the same directory as `b`.
fn same_directory(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::symlink_metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.is_dir() && x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Threads a session's BLAS and OpenMP pools may use: `SANDCELL_CPU_THREADS` (set by the
/// daemon from the session's CPU quota, rounded up), clamped to 1..=[`MAX_CPU_THREADS`];
/// 1 when unset or not a number.
pub fn cpu_threads(value: Option<&OsStr>) -> u32 {
    value
        .and_then(OsStr::to_str)
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(1)
        .clamp(1, MAX_CPU_THREADS)
}

/// Environment entries every native interpreter gets, as (name, value) pairs.
///
/// Nothing is inherited: the daemon's own environment never reaches a cell. The session
/// directory becomes `HOME` and `SANDCELL_SESSION_DIR`, `tmp` becomes `TMPDIR`. `threads`
/// bounds OpenBLAS, OpenMP, MKL and numexpr pools, so a session's CPU use matches its
/// `cpu.max` (more threads than that only contend with each other). `TZ=UTC` avoids a
/// time-zone lookup that differs between hosts.
pub fn common_environment(paths: &SessionPaths, threads: u32) -> Vec<(OsString, OsString)> {
    let n = OsString::from(threads.to_string());
    let mut env: Vec<(OsString, OsString)> = vec![
        ("PATH".into(), "/usr/bin:/bin".into()),
        ("HOME".into(), paths.session.clone().into_os_string()),
        (
            "SANDCELL_SESSION_DIR".into(),
            paths.session.clone().into_os_string(),
        ),
        ("TMPDIR".into(), paths.tmp.clone().into_os_string()),
        ("LANG".into(), "C.UTF-8".into()),
        ("TZ".into(), "UTC".into()),
    ];
    for k in [
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    ] {
        env.push((k.into(), n.clone()));
    }
    env.extend(font_environment(&paths.tmp));
    env.extend(package_environment());
    env
}

/// The variables of per-session packages, passed on from the launcher's environment when the
/// daemon set them (the environment has a package source): `SANDCELL_WHEELHOUSE` or
/// `SANDCELL_CRAN_REPOSITORY` (the read-only source) and `SANDCELL_PACKAGES_DIR` (where the
/// session's installs go, on its own file system). `worker.py` (`sandcell.install`) and
/// `worker.R` (`install.packages`) read them. With egress, also the proxy variables
/// (`HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY` and their lowercase forms) that pip, urllib,
/// requests, curl and R's `download.file` read.
pub fn package_environment() -> Vec<(OsString, OsString)> {
    [
        "SANDCELL_WHEELHOUSE",
        "SANDCELL_CRAN_REPOSITORY",
        "SANDCELL_PACKAGES_DIR",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    ]
    .into_iter()
    .filter_map(|k| std::env::var_os(k).map(|v| (k.into(), v)))
    .collect()
}

/// Where font caches come from and go to.
///
/// fontconfig reads the host's system cache (`/var/cache/fontconfig`, root-owned, rebuilt by
/// `fc-cache -s` at setup and by the fontconfig package's triggers) and writes a per-user cache
/// only for directories whose system cache is missing or stale, under `$XDG_CACHE_HOME`
/// (`$HOME/.cache` by default). `HOME` is the session directory, so a stale system cache used
/// to leave `.cache/fontconfig/*` among a cell's files; pointing `XDG_CACHE_HOME` into the
/// private temporary directory keeps any such rebuild out of the session's files.
pub fn font_environment(tmp: &Path) -> Vec<(OsString, OsString)> {
    vec![("XDG_CACHE_HOME".into(), tmp.join("cache").into_os_string())]
}

/// Prepares matplotlib's configuration directory `dir` (inside the private temporary
/// directory): creates it and links every `fontlist-*.json` of the read-only `prebuilt`
/// directory into it, so the first plot of a session reads the host's font list instead of
/// scanning every font (matplotlib needs a writable `MPLCONFIGDIR`, otherwise it makes a
/// temporary one and rebuilds the list there). A missing `prebuilt` directory is not an error:
/// matplotlib then builds the list in `dir` on first use.
///
/// Errors: `dir` cannot be created.
pub fn prepare_mpl_config(dir: &Path, prebuilt: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let Ok(entries) = std::fs::read_dir(prebuilt) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let s = name.to_string_lossy();
        if s.starts_with("fontlist-") && s.ends_with(".json") {
            let link = dir.join(&name);
            let _ = std::fs::remove_file(&link);
            let _ = std::os::unix::fs::symlink(e.path(), &link);
        }
    }
    Ok(())
}

/// Where a worker script comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Script {
    /// A file the interpreter reads.
    File(PathBuf),
    /// The copy compiled into the launcher.
    Embedded,
}

/// Finds a worker script: `explicit` (the value of the launcher's development variable named
/// `var`) if set (it must be a file), else `next_to_exe` in the directory of `exe` if that file
/// exists, else the embedded copy.
///
/// Errors: `explicit` names a path that is not a file.
pub fn resolve_script(
    var: &str,
    explicit: Option<&OsStr>,
    exe: Option<&Path>,
    next_to_exe: &str,
) -> Result<Script, String> {
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(Script::File(p))
        } else {
            Err(format!("{var}={} is not a file", p.display()))
        };
    }
    if let Some(dir) = exe.and_then(Path::parent) {
        let p = dir.join(next_to_exe);
        if p.is_file() {
            return Ok(Script::File(p));
        }
    }
    Ok(Script::Embedded)
}

/// Puts `script` into a pipe and returns the read end, inheritable (no `FD_CLOEXEC`), for the
/// interpreter to open as `/proc/self/fd/<fd>`.
///
/// The whole script is written before the interpreter starts, so the pipe is grown to hold it
/// when it is larger than the default capacity (64 KiB). Errors: the pipe cannot be created,
/// grown or written.
pub fn embedded_script_pipe(script: &[u8]) -> std::io::Result<OwnedFd> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    if script.len() > 64 * 1024 {
        let want = libc::c_int::try_from(script.len()).unwrap_or(libc::c_int::MAX);
        // SAFETY: F_SETPIPE_SZ on a pipe descriptor we own; no memory is passed.
        if unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, want) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let mut w = std::fs::File::from(write);
    w.write_all(script)?;
    drop(w); // the interpreter sees end of file after the script
    // SAFETY: F_SETFD on a descriptor we own; clears FD_CLOEXEC so the interpreter inherits it.
    if unsafe { libc::fcntl(read.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(read)
}

/// Gives the pipes on `fds` to the worker's identity, before [`sandcell_confine::enter`]
/// switches to it.
///
/// R cannot use an inherited descriptor directly: it reopens the pipe through
/// `/proc/self/fd/<n>`, and that open is checked against the pipe's owner and mode like any
/// file. A pipe made by the daemon belongs to root with mode 0600, so a worker running as its
/// own uid could not reopen it. This is the one thing a launcher does before confinement; it
/// runs no untrusted code and touches only descriptors that are pipes (a regular file or
/// anything else passed by mistake is refused, never chowned).
///
/// Errors: a descriptor is closed, is not a pipe, or cannot be chowned.
pub fn hand_pipes_to(uid: u32, gid: u32, fds: &[RawFd]) -> Result<(), String> {
    for &fd in fds {
        // SAFETY: `st` is a local stat buffer fstat fills; `fd` is only inspected.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(format!("fd {fd}: {}", std::io::Error::last_os_error()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFIFO {
            return Err(format!(
                "fd {fd} is not a pipe (the daemon must pass pipes on fds 3 and 4)"
            ));
        }
        if st.st_uid == uid && st.st_gid == gid {
            continue;
        }
        // SAFETY: fchown on a descriptor checked above to be a pipe; no memory involved.
        if unsafe { libc::fchown(fd, uid, gid) } != 0 {
            return Err(format!(
                "cannot give the pipe on fd {fd} to uid {uid}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Resets every catchable signal to its default action and unblocks all signals, so the
/// interpreter starts as if from a clean `execve` (dispositions set to `SIG_IGN` would
/// otherwise survive it); then ignores SIGXFSZ, on purpose: RLIMIT_FSIZE is the session's
/// disk budget, and a write past it must fail with `EFBIG` (an error the cell sees) instead
/// of killing the interpreter. The ignored disposition survives `execve` and `fork`, so the
/// processes a cell starts inherit it.
pub fn reset_signals() {
    for sig in 1..libc::SIGRTMIN() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installing SIG_DFL is always sound; failures (invalid numbers) are ignored.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
    // SAFETY: installing SIG_IGN is always sound.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_resolution_order() {
        let dir =
            std::env::temp_dir().join(format!("sandcell-launcher-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("sandcell-worker-x");
        let var = "SANDCELL_X_WORKER_SCRIPT";
        // Nothing next to the executable: embedded copy.
        assert_eq!(
            resolve_script(var, None, Some(&exe), "w.x"),
            Ok(Script::Embedded)
        );
        let next = dir.join("w.x");
        std::fs::write(&next, "1").unwrap();
        assert_eq!(
            resolve_script(var, None, Some(&exe), "w.x"),
            Ok(Script::File(next.clone()))
        );
        // An explicit path wins, and must exist.
        let explicit = dir.join("other.x");
        let err = resolve_script(var, Some(explicit.as_os_str()), Some(&exe), "w.x").unwrap_err();
        assert!(err.starts_with(var), "{err}");
        std::fs::write(&explicit, "1").unwrap();
        assert_eq!(
            resolve_script(var, Some(explicit.as_os_str()), Some(&exe), "w.x"),
            Ok(Script::File(explicit))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn embedded_script_round_trips_through_the_pipe() {
        let big = vec![b'#'; 200 * 1024]; // larger than a default pipe
        let fd = embedded_script_pipe(&big).unwrap();
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(
            flags & libc::FD_CLOEXEC,
            0,
            "the interpreter must inherit the script pipe"
        );
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut std::fs::File::from(fd), &mut back).unwrap();
        assert_eq!(back, big);
    }

    #[test]
    fn only_pipes_are_handed_over() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let err = hand_pipes_to(0, 0, &[file.as_raw_fd()]).unwrap_err();
        assert!(err.contains("not a pipe"), "{err}");
        // A pipe already owned by the target identity is left alone (no privilege needed).
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        hand_pipes_to(uid, gid, &[r.as_raw_fd(), w.as_raw_fd()]).unwrap();
    }

    #[test]
    fn thread_counts_are_bounded() {
        assert_eq!(cpu_threads(None), 1);
        assert_eq!(cpu_threads(Some(OsStr::new("4"))), 4);
        assert_eq!(cpu_threads(Some(OsStr::new("0"))), 1);
        assert_eq!(cpu_threads(Some(OsStr::new("x"))), 1);
        assert_eq!(cpu_threads(Some(OsStr::new("100000"))), MAX_CPU_THREADS);
        let paths = SessionPaths {
            session: "/s".into(),
            tmp: "/s/.tmp".into(),
        };
        let env = common_environment(&paths, 3);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("OPENBLAS_NUM_THREADS"), Some("3".into()));
        assert_eq!(get("OMP_NUM_THREADS"), Some("3".into()));
        assert_eq!(get("HOME"), Some("/s".into()));
        assert_eq!(get("TMPDIR"), Some("/s/.tmp".into()));
        // Font cache rebuilds (if any) go to the private temporary directory, not the
        // session's files.
        assert_eq!(get("XDG_CACHE_HOME"), Some("/s/.tmp/cache".into()));
    }

    #[test]
    fn mpl_config_links_the_prebuilt_font_list() {
        let base = std::env::temp_dir().join(format!("sandcell-mpl-test-{}", std::process::id()));
        let prebuilt = base.join("prebuilt");
        std::fs::create_dir_all(&prebuilt).unwrap();
        std::fs::write(prebuilt.join("fontlist-v330.json"), "{}").unwrap();
        std::fs::write(prebuilt.join("other.txt"), "x").unwrap();
        let dir = base.join("cfg");
        prepare_mpl_config(&dir, &prebuilt).unwrap();
        let link = dir.join("fontlist-v330.json");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            prebuilt.join("fontlist-v330.json")
        );
        assert!(!dir.join("other.txt").exists());
        // Idempotent, and a missing prebuilt directory is fine.
        prepare_mpl_config(&dir, &prebuilt).unwrap();
        prepare_mpl_config(&base.join("cfg2"), &base.join("absent")).unwrap();
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// The value of `NAME <- expr` (R) or `NAME = expr` (Python) in `script`, where `expr` is
    /// a product of integer literals (`1024L * 1024L`, `16 * 1024`, `3`).
    fn script_int(script: &str, name: &str) -> usize {
        let line = script
            .lines()
            .find_map(|l| {
                l.strip_prefix(name).and_then(|r| {
                    r.trim_start()
                        .strip_prefix("<-")
                        .or_else(|| r.trim_start().strip_prefix('='))
                })
            })
            .unwrap_or_else(|| panic!("{name} is not assigned at the start of a line"));
        let expr = line.split('#').next().unwrap();
        expr.split('*')
            .map(|f| {
                f.trim()
                    .trim_end_matches('L')
                    .parse::<usize>()
                    .unwrap_or_else(|e| panic!("{name}: {f:?}: {e}"))
            })
            .product()
    }

    /// worker.R and worker.py restate the protocol's numbers (R and Python cannot read the
    /// Rust constants); they must be the ones `sandcell_proto::worker` defines.
    #[test]
    fn script_constants_match_the_protocol() {
        use sandcell_proto::worker as w;
        let r = include_str!("../r/worker.R");
        assert_eq!(script_int(r, "MAX_WORKER_LINE"), w::MAX_WORKER_LINE);
        assert_eq!(script_int(r, "MAX_ERROR_MESSAGE"), w::MAX_ERROR_MESSAGE);
        assert_eq!(script_int(r, "MAX_TRACEBACK"), w::MAX_TRACEBACK);
        assert!(r.contains(&format!("IN_PATH <- \"/proc/self/fd/{}\"", w::REQUEST_FD)));
        assert!(r.contains(&format!("OUT_PATH <- \"/proc/self/fd/{}\"", w::REPLY_FD)));
        assert!(r.contains(&format!("[0-9a-f]{{{}}}", w::NONCE_HEX_LEN)));
        let py = include_str!("../python/worker.py");
        assert_eq!(script_int(py, "MAX_WORKER_LINE"), w::MAX_WORKER_LINE);
        assert_eq!(script_int(py, "MAX_HEADER_LINE"), w::MAX_HEADER_LINE);
        assert_eq!(script_int(py, "MAX_ERROR_MESSAGE"), w::MAX_ERROR_MESSAGE);
        assert_eq!(script_int(py, "MAX_TRACEBACK"), w::MAX_TRACEBACK);
        assert_eq!(script_int(py, "REQ_FD"), w::REQUEST_FD as usize);
        assert_eq!(script_int(py, "REP_FD"), w::REPLY_FD as usize);
        assert!(py.contains(&format!("if len(v) != {} or", w::NONCE_HEX_LEN)));
        // The bounds of an `inspected` reply, and the Eryx driver's restatement of them.
        let driver = include_str!("../../worker-python/src/driver.py");
        for script in [r, py, driver] {
            assert_eq!(script_int(script, "MAX_REPR_CHARS"), w::MAX_REPR_CHARS);
            assert_eq!(
                script_int(script, "MAX_VARIABLE_NAME"),
                w::MAX_VARIABLE_NAME
            );
            assert_eq!(
                script_int(script, "MAX_VARIABLE_TYPE"),
                w::MAX_VARIABLE_TYPE
            );
            assert_eq!(script_int(script, "MAX_SHAPE_DIMS"), w::MAX_SHAPE_DIMS);
        }
        assert_eq!(script_int(r, "MAX_HEADER_LINE"), w::MAX_HEADER_LINE);
        // The bounds of `completions` and `help` answers (the Eryx worker checks the driver's
        // answer again in Rust); both Python engines take them from the shared query.py.
        let query = include_str!("../python/query.py");
        for script in [r, query] {
            assert_eq!(
                script_int(script, "MAX_MATCH_BYTES"),
                sandcell_proto::query::MAX_MATCH_BYTES
            );
            assert_eq!(
                script_int(script, "HELP_TEXT_BYTES"),
                sandcell_proto::query::HELP_TEXT_BYTES
            );
        }
        assert_eq!(
            script_int(r, "MAX_MATCHES"),
            sandcell_proto::query::COMPLETE_MAX_MATCHES
        );
        assert_eq!(
            script_int(query, "COMPLETE_MAX_MATCHES"),
            sandcell_proto::query::COMPLETE_MAX_MATCHES
        );
        for script in [r, py] {
            // The bounds a host call checks before it sends anything.
            use sandcell_proto::kernel as k;
            assert_eq!(
                script_int(script, "MAX_HOST_CALL_NAME"),
                k::MAX_HOST_CALL_NAME
            );
            assert_eq!(
                script_int(script, "MAX_HOST_CALL_ARGUMENTS"),
                k::MAX_HOST_CALL_ARGUMENTS
            );
            assert_eq!(script_int(script, "MAX_INSPECT_LINE"), w::MAX_INSPECT_LINE);
            assert_eq!(
                script_int(script, "INSPECT_DEFAULT_ITEMS") as u64,
                w::INSPECT_DEFAULT_ITEMS
            );
            assert_eq!(
                script_int(script, "INSPECT_MAX_ITEMS") as u64,
                w::INSPECT_MAX_ITEMS
            );
        }
    }
}
