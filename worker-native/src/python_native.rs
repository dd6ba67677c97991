//! `sandcell-worker-python-native`: the native CPython worker launcher (the `pydata`
//! environment's engine: the system's CPython with Debian's scientific stack).
//!
//! It confines itself exactly like the R launcher (same plan, cgroup, identity, Landlock,
//! seccomp, network namespace; the steps live in this crate's library), then replaces itself
//! with the system's `python3` running `worker.py`, the persistent Python side of
//! `sandcell_proto::worker`. In order:
//!
//! 1. [`confine`] (the protocol pipes are used as inherited descriptors: CPython, unlike R,
//!    never reopens them by path, so they keep their owner);
//! 2. [`enter_session`]: working directory = session directory, private `<session>/.tmp`;
//! 3. prepares matplotlib's configuration directory `<tmp>/matplotlib` with links to the
//!    host's prebuilt font list ([`prepare_mpl_config`]), so no session rebuilds it;
//! 4. finds the worker script ([`resolve_script`]): `$SANDCELL_PYTHON_WORKER_SCRIPT`, else
//!    `sandcell-worker.py` next to the launcher, else the copy compiled in, passed with `-c`;
//! 5. [`reset_signals`], then `execve` of `python3 -I -B <script>` with only the allowlisted
//!    environment of [`python_environment`]. `-I` (isolated mode) ignores every `PYTHON*`
//!    variable and the user site directory and puts neither the script's directory nor the
//!    working directory first on `sys.path`; `-B` writes no `.pyc` files.
//!
//! Environment read by the launcher (set by the daemon):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `SANDCELL_CONFINE` | JSON confinement plan (required) | - |
//! | `SANDCELL_SESSION_DIR` | working directory of the cells | plan's `session_dir` |
//! | `SANDCELL_TMPDIR` | `TMPDIR` (must be writable under the plan) | `<session>/.tmp` |
//! | `SANDCELL_PYTHON` | the interpreter | `/usr/bin/python3` |
//! | `SANDCELL_CPU_THREADS` | BLAS/OpenMP threads (the session's CPU quota) | 1 |
//! | `SANDCELL_MPL_CACHE` | prebuilt matplotlib font list directory | `/var/cache/sandcell/matplotlib` |
//! | `SANDCELL_PYTHON_PATH` | extra library directories (`:`-separated), passed on | - |
//! | `SANDCELL_PYTHON_PRELOAD` | modules imported before `ready` (`,`-separated), passed on | - |
//! | `SANDCELL_PYTHON_WORKER_SCRIPT` | worker script path (development) | see step 4 |
//!
//! Exit statuses: [`sandcell_confine::EXIT_CONFINE_FAILED`] before confinement,
//! [`EXIT_LAUNCH_FAILED`] after it, else the worker's own (see `worker.py`).

use sandcell_worker_native::{
    DEFAULT_MPL_CACHE, EXIT_LAUNCH_FAILED, Script, SessionPaths, common_environment, confine,
    cpu_threads, enter_session, fail, prepare_mpl_config, reset_signals, resolve_script,
};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Name used in diagnostics.
const PROG: &str = "sandcell-worker-python-native";

/// The worker script compiled into the launcher, used when no script file is found: the
/// shared Complete/Help module `query.py` followed by `worker.py` (the packages install the
/// same concatenation as `sandcell-worker.py`).
const EMBEDDED_SCRIPT: &str = concat!(
    include_str!("../python/query.py"),
    include_str!("../python/worker.py")
);

/// Name of the script file looked for next to the launcher executable.
const SCRIPT_NEXT_TO_EXE: &str = "sandcell-worker.py";

/// Development variable naming the worker script.
const SCRIPT_VAR: &str = "SANDCELL_PYTHON_WORKER_SCRIPT";

/// Debian's interpreter (never a `python3` found on `PATH`, which may be a user's shim).
const DEFAULT_PYTHON: &str = "/usr/bin/python3";

/// Variables passed on to the worker unchanged when the daemon set them.
const PASSED_ON: [&str; 2] = ["SANDCELL_PYTHON_PATH", "SANDCELL_PYTHON_PRELOAD"];

/// The complete environment of the interpreter: the native workers' allowlist, matplotlib's
/// non-interactive backend and configuration directory `mpl_config`, and the `passed` pairs.
fn python_environment(
    paths: &SessionPaths,
    threads: u32,
    mpl_config: &Path,
    passed: Vec<(OsString, OsString)>,
) -> Vec<(OsString, OsString)> {
    let mut env = common_environment(paths, threads);
    env.push(("MPLBACKEND".into(), "Agg".into()));
    env.push(("MPLCONFIGDIR".into(), mpl_config.as_os_str().to_owned()));
    env.extend(passed);
    env
}

/// Command-line arguments after `argv[0]`.
fn python_arguments(script: &Script) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec!["-I".into(), "-B".into()];
    match script {
        Script::File(p) => a.push(p.as_os_str().to_owned()),
        Script::Embedded => {
            a.push("-c".into());
            a.push(EMBEDDED_SCRIPT.into());
        }
    }
    a
}

fn main() {
    let plan = confine(PROG, false);
    // Confined from here on: every path below is resolved with the worker's own rights.
    let paths = enter_session(PROG, &plan);
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let python = var("SANDCELL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PYTHON));
    let threads = cpu_threads(var("SANDCELL_CPU_THREADS").as_deref());
    let mpl_config = paths.tmp.join("matplotlib");
    let prebuilt = var("SANDCELL_MPL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MPL_CACHE));
    if let Err(e) = prepare_mpl_config(&mpl_config, &prebuilt) {
        fail(
            PROG,
            EXIT_LAUNCH_FAILED,
            &format!("cannot create {}: {e}", mpl_config.display()),
        );
    }
    let passed: Vec<(OsString, OsString)> = PASSED_ON
        .iter()
        .filter_map(|k| var(k).map(|v| (OsString::from(*k), v)))
        .collect();

    let explicit = var(SCRIPT_VAR);
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

    reset_signals();
    let err = Command::new(&python)
        .arg0("python3")
        .args(python_arguments(&script))
        .env_clear()
        .envs(python_environment(&paths, threads, &mpl_config, passed))
        .exec();
    fail(
        PROG,
        EXIT_LAUNCH_FAILED,
        &format!("cannot execute {}: {err}", python.display()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_script_is_the_shared_query_module_then_the_worker() {
        let shared = include_str!("../python/query.py");
        let worker = include_str!("../python/worker.py");
        assert_eq!(EMBEDDED_SCRIPT, format!("{shared}{worker}"));
        assert!(worker.contains("query_complete(") && !worker.contains("\ndef query_complete("));
    }

    #[test]
    fn embedded_script_fits_one_argument() {
        // Linux refuses a single argument longer than MAX_ARG_STRLEN (32 pages, 128 KiB).
        assert!(EMBEDDED_SCRIPT.len() < 128 * 1024 - 1);
        assert!(!EMBEDDED_SCRIPT.contains('\0'));
        let a = python_arguments(&Script::Embedded);
        assert_eq!(a[..3], ["-I", "-B", "-c"]);
        let f = python_arguments(&Script::File("/x/w.py".into()));
        assert_eq!(f.last().unwrap(), "/x/w.py");
    }

    #[test]
    fn environment_is_only_the_allowlist() {
        let paths = SessionPaths {
            session: "/s".into(),
            tmp: "/s/.tmp".into(),
        };
        let env = python_environment(
            &paths,
            2,
            Path::new("/s/.tmp/matplotlib"),
            vec![("SANDCELL_PYTHON_PRELOAD".into(), "numpy".into())],
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("MPLBACKEND"), Some("Agg".into()));
        assert_eq!(get("MPLCONFIGDIR"), Some("/s/.tmp/matplotlib".into()));
        assert_eq!(get("OPENBLAS_NUM_THREADS"), Some("2".into()));
        assert_eq!(get("SANDCELL_PYTHON_PRELOAD"), Some("numpy".into()));
        assert!(
            !env.iter()
                .any(|(k, _)| k == "SANDCELL_CONFINE" || k == "PYTHONPATH" || k == "LD_PRELOAD")
        );
    }
}
