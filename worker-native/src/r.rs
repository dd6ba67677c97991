//! `sandcell-worker-r`: the R worker launcher.
//!
//! Started by `sandcelld` inside the session's cgroup with the descriptor layout of
//! `sandcell_proto::worker` (fd 0 `/dev/null`, fds 1 and 2 the cell's stdout and stderr pipes,
//! fd 3 the request pipe, fd 4 the reply pipe). In order, it:
//!
//! 1. reads the confinement plan ([`sandcell_confine::Plan::from_env`]); when the plan switches
//!    identity, gives the request and reply pipes (fds 3 and 4) to that uid/gid so that R can
//!    reopen them by path after the switch (see [`sandcell_worker_native::hand_pipes_to`]); then
//!    enters the plan ([`sandcell_confine::enter`]); on failure it prints the reason on stderr
//!    and exits with [`sandcell_confine::EXIT_CONFINE_FAILED`] before anything else happens;
//! 2. changes directory to the session directory (`SANDCELL_SESSION_DIR`, else the plan's
//!    `session_dir`) and makes sure the private temporary directory exists
//!    (`<session>/.tmp`, or `SANDCELL_TMPDIR`);
//! 3. finds the worker script (see [`sandcell_worker_native::resolve_script`]);
//! 4. resets every signal disposition to its default and unblocks all signals (an inherited
//!    `SIG_IGN` for SIGINT survives `execve` and R honours it, which would make cells
//!    uninterruptible);
//! 5. replaces itself with R's own executable, `$R_HOME/bin/exec/R` (not the `/usr/bin/R` shell
//!    wrapper: it starts faster and needs no shell, `sed` or `uname` inside the confinement),
//!    as `R --vanilla --no-echo --no-restore --file=<script>`, with an environment built only
//!    from the allowlist in [`r_environment`].
//!
//! Descriptors 0-4 are passed on as they are (fds 3 and 4 only change owner, step 1); the
//! embedded script's pipe, when used, is the only descriptor added. Failures after confinement
//! exit with [`EXIT_LAUNCH_FAILED`]. The steps shared with the other native launcher live in
//! the crate's library (`src/lib.rs`).
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
//! | `SANDCELL_R_WORKER_SCRIPT` | worker script path (development) | `sandcell-worker.R` next to the launcher, else embedded |

use sandcell_worker_native::{
    EXIT_LAUNCH_FAILED, Script, SessionPaths, common_environment, confine, embedded_script_pipe,
    enter_session, fail, reset_signals, resolve_script,
};
use std::ffi::{OsStr, OsString};
use std::os::fd::IntoRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Name used in diagnostics.
const PROG: &str = "sandcell-worker-r";

/// The worker script compiled into the launcher, used when no script file is found.
const EMBEDDED_SCRIPT: &str = include_str!("../r/worker.R");

/// Name of the script file looked for next to the launcher executable.
const SCRIPT_NEXT_TO_EXE: &str = "sandcell-worker.R";

/// Development variable naming the worker script.
const SCRIPT_VAR: &str = "SANDCELL_R_WORKER_SCRIPT";

/// Default R installation (Debian's `r-base-core`).
const DEFAULT_R_HOME: &str = "/usr/lib/R";

/// The complete environment R is started with, as (name, value) pairs.
///
/// The common allowlist of native workers ([`common_environment`]) plus R's own variables.
/// R's garbage collector is given larger first thresholds (`R_NSIZE`, `R_VSIZE`,
/// `R_GC_MEM_GROW`), so that a collection rarely falls inside a short cell.
/// `r_home` is the R installation; the Debian split layout (`/usr/share/R/...`) is named when
/// `r_home` is `/usr/lib/R`, otherwise R derives those directories from `R_HOME`. BLAS and
/// OpenMP are held to one thread: the daemon sends SIGINT to R's whole process group (R ignores
/// SIGINT while it waits for a `system()` child), and a process-directed signal may be taken
/// by any thread that does not block it, so R's main thread must be the only one.
fn r_environment(r_home: &Path, paths: &SessionPaths) -> Vec<(OsString, OsString)> {
    let mut env = common_environment(paths, 1);
    let mut set = |k: &str, v: &OsStr| env.push((k.into(), v.to_owned()));
    set("R_HOME", r_home.as_os_str());
    // R's garbage collector starts with small thresholds (350,000 cons cells, 6 MB of
    // vector heap) and a trivial cell's garbage makes it run every few dozen cells, each time
    // inside a cell; larger first thresholds and the fastest heap growth (R's `?Memory`:
    // `R_NSIZE`, `R_VSIZE`, `R_GC_MEM_GROW` 0 to 3) make that rare. The cost is garbage kept
    // longer: at most 1,000,000 cells of 56 bytes and 32 MB of vectors, against the worker's
    // memory limit.
    set("R_GC_MEM_GROW", OsStr::new("3"));
    set("R_NSIZE", OsStr::new("1000000"));
    set("R_VSIZE", OsStr::new("32M"));
    if r_home == Path::new(DEFAULT_R_HOME) {
        set("R_SHARE_DIR", OsStr::new("/usr/share/R/share"));
        set("R_INCLUDE_DIR", OsStr::new("/usr/share/R/include"));
        set("R_DOC_DIR", OsStr::new("/usr/share/R/doc"));
    }
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

fn main() {
    // R reopens fds 3 and 4 by path, so they are handed to the worker identity first.
    let plan = confine(PROG, true);
    // Confined from here on: every path below is resolved with the worker's own rights.
    let paths = enter_session(PROG, &plan);
    let r_home = std::env::var_os("SANDCELL_R_HOME")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_R_HOME));

    let explicit = std::env::var_os(SCRIPT_VAR);
    let exe = std::env::current_exe().ok();
    let script = match resolve_script(
        SCRIPT_VAR,
        explicit.as_deref(),
        exe.as_deref(),
        SCRIPT_NEXT_TO_EXE,
    ) {
        Ok(s) => s,
        Err(e) => fail(PROG, EXIT_LAUNCH_FAILED, &e),
    };
    let script_path = match script {
        Script::File(p) => p,
        Script::Embedded => match embedded_script_pipe(EMBEDDED_SCRIPT.as_bytes()) {
            // The descriptor stays open across execve; R opens it by path.
            Ok(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.into_raw_fd())),
            Err(e) => fail(
                PROG,
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
        .envs(r_environment(&r_home, &paths))
        .exec();
    fail(
        PROG,
        EXIT_LAUNCH_FAILED,
        &format!("cannot execute {}: {err}", r_exe.display()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_is_only_the_allowlist() {
        let paths = SessionPaths {
            session: "/s".into(),
            tmp: "/s/.tmp".into(),
        };
        let env = r_environment(Path::new("/usr/lib/R"), &paths);
        let names: Vec<_> = env.iter().map(|(k, _)| k.to_str().unwrap()).collect();
        assert!(names.contains(&"R_HOME") && names.contains(&"R_SHARE_DIR"));
        assert!(names.contains(&"R_NSIZE") && names.contains(&"R_VSIZE"));
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("SANDCELL_CONFINE") || *n == "LD_PRELOAD")
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("HOME"), Some("/s".into()));
        assert_eq!(get("TMPDIR"), Some("/s/.tmp".into()));
        assert_eq!(get("OPENBLAS_NUM_THREADS"), Some("1".into()));
        // A non-Debian R home lets R derive its share/include/doc directories itself.
        let other = r_environment(Path::new("/opt/R"), &paths);
        assert!(!other.iter().any(|(k, _)| k == "R_SHARE_DIR"));
    }

    #[test]
    fn arguments_name_the_script() {
        let a = r_arguments(Path::new("/x/w.R"));
        assert_eq!(a.last().unwrap(), "--file=/x/w.R");
        assert!(a.contains(&"--vanilla".into()) && a.contains(&"--no-echo".into()));
    }
}
