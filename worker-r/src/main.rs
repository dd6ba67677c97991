//! `sandcell-worker-r`: the R worker launcher.
//!
//! Started by `sandcelld` inside the session's cgroup with the descriptor layout of
//! `sandcell_proto::worker` (fd 0 `/dev/null`, fds 1 and 2 the cell's stdout and stderr pipes,
//! fd 3 the request pipe, fd 4 the reply pipe). In order, it:
//!
//! 1. reads the confinement plan ([`sandcell_confine::Plan::from_env`]); when the plan switches
//!    identity, gives the request and reply pipes (fds 3 and 4) to that uid/gid so that R can
//!    reopen them by path after the switch (see [`hand_pipes_to`]); then enters the plan
//!    ([`sandcell_confine::enter`]); on failure it prints the reason on stderr and exits with
//!    [`sandcell_confine::EXIT_CONFINE_FAILED`] before anything else happens;
//! 2. changes directory to the session directory (`SANDCELL_SESSION_DIR`, else the plan's
//!    `session_dir`) and makes sure the private temporary directory exists
//!    (`<session>/.tmp`, or `SANDCELL_TMPDIR`);
//! 3. finds the worker script (see [`resolve_script`]);
//! 4. resets every signal disposition to its default and unblocks all signals (an inherited
//!    `SIG_IGN` for SIGINT survives `execve` and R honours it, which would make cells
//!    uninterruptible: seed 001, transport.py);
//! 5. replaces itself with R's own executable, `$R_HOME/bin/exec/R` (not the `/usr/bin/R` shell
//!    wrapper: about 30 ms faster and needs no shell, `sed` or `uname` inside the confinement),
//!    as `R --vanilla --no-echo --no-restore --file=<script>`, with an environment built only
//!    from the allowlist in [`r_environment`].
//!
//! Descriptors 0-4 are passed on as they are (fds 3 and 4 only change owner, step 1); the
//! embedded script's pipe, when used, is the only descriptor added. Failures after confinement
//! exit with [`EXIT_LAUNCH_FAILED`].
//!
//! Environment read by the launcher (all set by the daemon; none is passed on as such except
//! `SANDCELL_SESSION_DIR`):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `SANDCELL_CONFINE` | JSON confinement plan (required) | - |
//! | `SANDCELL_SESSION_DIR` | working directory of the cells | plan's `session_dir` |
//! | `SANDCELL_TMPDIR` | R's `TMPDIR` (must be writable under the plan) | `<session>/.tmp` |
//! | `SANDCELL_R_HOME` | R installation | `/usr/lib/R` |
//! | `SANDCELL_R_WORKER_SCRIPT` | worker script path (development) | see [`resolve_script`] |

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Exit status when confinement succeeded but R could not be started (bad session directory,
/// missing script, `execve` failure). Distinct from [`sandcell_confine::EXIT_CONFINE_FAILED`].
pub const EXIT_LAUNCH_FAILED: i32 = 96;

/// The worker script compiled into the launcher, used when no script file is found.
const EMBEDDED_SCRIPT: &str = include_str!("../worker.R");

/// Name of the script file looked for next to the launcher executable.
const SCRIPT_NEXT_TO_EXE: &str = "sandcell-worker.R";

/// Default R installation (Debian's `r-base-core`).
const DEFAULT_R_HOME: &str = "/usr/lib/R";

/// Where the worker script comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Script {
    /// A file R reads with `--file=`.
    File(PathBuf),
    /// The copy compiled into the launcher: handed to R through a pipe that R opens as
    /// `/proc/self/fd/<n>` (nothing is written to disk; needs `/proc` in the worker's view).
    Embedded,
}

/// Finds the worker script: `$SANDCELL_R_WORKER_SCRIPT` if set (it must exist), else
/// `sandcell-worker.R` in the directory of `exe` if that file exists, else the embedded copy.
///
/// Errors: `SANDCELL_R_WORKER_SCRIPT` names a path that is not a readable file.
fn resolve_script(explicit: Option<&OsStr>, exe: Option<&Path>) -> Result<Script, String> {
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(Script::File(p))
        } else {
            Err(format!(
                "SANDCELL_R_WORKER_SCRIPT={} is not a file",
                p.display()
            ))
        };
    }
    if let Some(dir) = exe.and_then(Path::parent) {
        let p = dir.join(SCRIPT_NEXT_TO_EXE);
        if p.is_file() {
            return Ok(Script::File(p));
        }
    }
    Ok(Script::Embedded)
}

/// The complete environment R is started with, as (name, value) pairs.
///
/// Nothing is inherited: the daemon's own environment never reaches a cell. `r_home` is the R
/// installation; the Debian split layout (`/usr/share/R/...`) is named when `r_home` is
/// `/usr/lib/R`, otherwise R derives those directories from `R_HOME`. `session` becomes `HOME`
/// and `SANDCELL_SESSION_DIR`, `tmp` becomes `TMPDIR` (where R creates its per-process
/// `Rtmp*` directory). BLAS and OpenMP are held to one thread so that SIGINT, sent to the
/// main thread, reaches the thread doing the work, and so a session's CPU use matches its
/// `cpu.max`. `TZ=UTC` avoids a time-zone lookup that differs between hosts.
fn r_environment(r_home: &Path, session: &Path, tmp: &Path) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = Vec::new();
    let mut set = |k: &str, v: &OsStr| env.push((k.into(), v.to_owned()));
    set("R_HOME", r_home.as_os_str());
    if r_home == Path::new(DEFAULT_R_HOME) {
        set("R_SHARE_DIR", OsStr::new("/usr/share/R/share"));
        set("R_INCLUDE_DIR", OsStr::new("/usr/share/R/include"));
        set("R_DOC_DIR", OsStr::new("/usr/share/R/doc"));
    }
    set("PATH", OsStr::new("/usr/bin:/bin"));
    set("HOME", session.as_os_str());
    set("SANDCELL_SESSION_DIR", session.as_os_str());
    set("TMPDIR", tmp.as_os_str());
    set("LANG", OsStr::new("C.UTF-8"));
    set("TZ", OsStr::new("UTC"));
    set("OMP_NUM_THREADS", OsStr::new("1"));
    set("OPENBLAS_NUM_THREADS", OsStr::new("1"));
    env
}

/// Command-line arguments after `argv[0]` for R reading the worker script from `script`.
fn r_arguments(script: &Path) -> Vec<OsString> {
    let mut file = OsString::from("--file=");
    file.push(script);
    vec![
        "--vanilla".into(),
        "--no-echo".into(),
        "--no-restore".into(),
        file,
    ]
}

/// Puts the embedded script into a pipe and returns the read end, inheritable (no
/// `FD_CLOEXEC`), for R to open as `/proc/self/fd/<fd>`.
///
/// The whole script is written before R starts, so the pipe is grown to hold it when it is
/// larger than the default capacity (64 KiB). Errors: the pipe cannot be created, grown or
/// written.
fn embedded_script_pipe(script: &[u8]) -> std::io::Result<OwnedFd> {
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
    drop(w); // R sees end of file after the script
    // SAFETY: F_SETFD on a descriptor we own; clears FD_CLOEXEC so R inherits it.
    if unsafe { libc::fcntl(read.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(read)
}

/// The request and reply pipes, which R reopens by path (`/proc/self/fd/3`, `/proc/self/fd/4`).
const PROTOCOL_FDS: [RawFd; 2] = [3, 4];

/// Gives the pipes on `fds` to the worker's identity, before [`sandcell_confine::enter`]
/// switches to it.
///
/// R cannot use an inherited descriptor directly: it reopens the pipe through
/// `/proc/self/fd/<n>`, and that open is checked against the pipe's owner and mode like any
/// file. A pipe made by the daemon belongs to root with mode 0600, so a worker running as its
/// own uid could not reopen it. This is the one thing the launcher does before confinement; it
/// runs no untrusted code and touches only descriptors that are pipes (a regular file or
/// anything else passed by mistake is refused, never chowned).
///
/// Errors: a descriptor is closed, is not a pipe, or cannot be chowned.
fn hand_pipes_to(uid: u32, gid: u32, fds: &[RawFd]) -> Result<(), String> {
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

/// Resets every catchable signal to its default action and unblocks all signals, so R starts
/// as if from a clean `execve` (dispositions set to `SIG_IGN` would otherwise survive it).
fn reset_signals() {
    for sig in 1..libc::SIGRTMIN() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installing SIG_DFL is always sound; failures (invalid numbers) are ignored.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
}

/// Prints `msg` on stderr (the cell stderr pipe, read by the daemon) and exits with `code`.
fn fail(code: i32, msg: &str) -> ! {
    eprintln!("sandcell-worker-r: {msg}");
    std::process::exit(code)
}

fn main() {
    let plan = match sandcell_confine::Plan::from_env() {
        Ok(p) => p,
        Err(e) => fail(sandcell_confine::EXIT_CONFINE_FAILED, &e.to_string()),
    };
    if let (Some(uid), Some(gid)) = (plan.uid, plan.gid)
        && let Err(e) = hand_pipes_to(uid, gid, &PROTOCOL_FDS)
    {
        fail(sandcell_confine::EXIT_CONFINE_FAILED, &e);
    }
    match sandcell_confine::enter(&plan) {
        // Only the development flag (best-effort enforcement) can skip a layer: say so loudly,
        // on the stream the daemon logs before `ready`.
        Ok(report) => {
            for skipped in &report.skipped {
                eprintln!("sandcell-worker-r: confinement layer skipped: {skipped}");
            }
        }
        Err(e) => fail(sandcell_confine::EXIT_CONFINE_FAILED, &e.to_string()),
    }

    // Confined from here on: every path below is resolved with the worker's own rights.
    let session = std::env::var_os("SANDCELL_SESSION_DIR")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| plan.session_dir.clone());
    if let Err(e) = std::env::set_current_dir(&session) {
        fail(
            EXIT_LAUNCH_FAILED,
            &format!("cannot enter session directory {}: {e}", session.display()),
        );
    }
    let tmp = std::env::var_os("SANDCELL_TMPDIR")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| session.join(".tmp"));
    if let Err(e) = std::fs::create_dir_all(&tmp) {
        fail(
            EXIT_LAUNCH_FAILED,
            &format!("cannot create temporary directory {}: {e}", tmp.display()),
        );
    }
    let r_home = std::env::var_os("SANDCELL_R_HOME")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_R_HOME));

    let explicit = std::env::var_os("SANDCELL_R_WORKER_SCRIPT");
    let exe = std::env::current_exe().ok();
    let script = match resolve_script(explicit.as_deref(), exe.as_deref()) {
        Ok(s) => s,
        Err(e) => fail(EXIT_LAUNCH_FAILED, &e),
    };
    let script_path = match script {
        Script::File(p) => p,
        Script::Embedded => match embedded_script_pipe(EMBEDDED_SCRIPT.as_bytes()) {
            // The descriptor stays open across execve; R opens it by path.
            Ok(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.into_raw_fd())),
            Err(e) => fail(
                EXIT_LAUNCH_FAILED,
                &format!("cannot pass the embedded worker script: {e}"),
            ),
        },
    };

    reset_signals();
    let r_exe = r_home.join("bin/exec/R");
    let err = Command::new(&r_exe)
        .arg0("R")
        .args(r_arguments(&script_path))
        .env_clear()
        .envs(r_environment(&r_home, &session, &tmp))
        .exec();
    fail(
        EXIT_LAUNCH_FAILED,
        &format!("cannot execute {}: {err}", r_exe.display()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_is_only_the_allowlist() {
        let env = r_environment(
            Path::new("/usr/lib/R"),
            Path::new("/s"),
            Path::new("/s/.tmp"),
        );
        let names: Vec<_> = env.iter().map(|(k, _)| k.to_str().unwrap()).collect();
        assert!(names.contains(&"R_HOME") && names.contains(&"R_SHARE_DIR"));
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("SANDCELL_CONFINE") || *n == "LD_PRELOAD")
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("HOME"), Some("/s".into()));
        assert_eq!(get("TMPDIR"), Some("/s/.tmp".into()));
        // A non-Debian R home lets R derive its share/include/doc directories itself.
        let other = r_environment(Path::new("/opt/R"), Path::new("/s"), Path::new("/t"));
        assert!(!other.iter().any(|(k, _)| k == "R_SHARE_DIR"));
    }

    #[test]
    fn script_resolution_order() {
        let dir =
            std::env::temp_dir().join(format!("sandcell-worker-r-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("sandcell-worker-r");
        // Nothing next to the executable: embedded copy.
        assert_eq!(resolve_script(None, Some(&exe)), Ok(Script::Embedded));
        let next = dir.join(SCRIPT_NEXT_TO_EXE);
        std::fs::write(&next, "1").unwrap();
        assert_eq!(
            resolve_script(None, Some(&exe)),
            Ok(Script::File(next.clone()))
        );
        // An explicit path wins, and must exist.
        let explicit = dir.join("other.R");
        assert!(resolve_script(Some(explicit.as_os_str()), Some(&exe)).is_err());
        std::fs::write(&explicit, "1").unwrap();
        assert_eq!(
            resolve_script(Some(explicit.as_os_str()), Some(&exe)),
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
            "R must inherit the script pipe"
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
    fn arguments_name_the_script() {
        let a = r_arguments(Path::new("/x/w.R"));
        assert_eq!(a.last().unwrap(), "--file=/x/w.R");
        assert!(a.contains(&"--vanilla".into()) && a.contains(&"--no-echo".into()));
    }
}
