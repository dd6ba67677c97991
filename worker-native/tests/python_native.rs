//! End-to-end tests of the native Python worker: the built `sandcell-worker-python-native`
//! launcher, really confined (best-effort enforcement as the caller; strict as uid 65534 where
//! the test runs as root), running `worker-native/python/worker.py` on Debian's /usr/bin/python3 with its
//! scientific stack, driven over the descriptor layout of `sandcell_proto::worker` exactly as
//! the daemon drives it (fd 0 `/dev/null`, fds 1 and 2 pipes, fd 3 requests, fd 4 JSON-lines
//! replies), with sandcell-testing's one worker harness (`sandcell_testing::worker`), which
//! parses every reply line with `sandcell_proto::worker::WorkerMessage::parse`.
//!
//! The analyses are the files of `examples/pydata/` with their exact expected output.
//! Skipped, with a printed reason, when /usr/bin/python3 or a package is missing. Figures:
//! `cargo test -p sandcell-worker-native --release --test python_native -- --nocapture figures`.

mod common;

use common::{Engine, Start, Worker, examples};
use sandcell_proto::worker::{MAX_ERROR_MESSAGE, MAX_TRACEBACK, WorkerMessage, WorkerStatus};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const PYTHON: &str = "/usr/bin/python3";

/// Why /usr/bin/python3 cannot import `modules`, or `None` when it can.
fn python_lacks(modules: &[&str]) -> Option<String> {
    if !Path::new(PYTHON).exists() {
        return Some(format!("{PYTHON} is missing (apt-get install python3)"));
    }
    if modules.is_empty() {
        return None;
    }
    let code = format!("import {}", modules.join(", "));
    let ok = Command::new(PYTHON)
        .args(["-I", "-c", &code])
        .env("MPLBACKEND", "Agg")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    (!ok).then(|| {
        format!(
            "{PYTHON} cannot `{code}` (scripts/setup.sh installs python3-numpy python3-pandas \
             python3-scipy python3-matplotlib python3-statsmodels)"
        )
    })
}

/// `format!` giving a `&'static str`, for lists of probes.
macro_rules! f {
    ($($t:tt)*) => { &*Box::leak(format!($($t)*).into_boxed_str()) };
}

/// Skips the calling test (`need!("its name", "numpy", ...)`) unless /usr/bin/python3 can
/// import the modules.
macro_rules! need {
    ($name:expr $(, $m:expr)*) => {
        if let Some(why) = python_lacks(&[$($m),*]) {
            sandcell_testing::skip!("pydata", "{why}");
        }
    };
}

fn example(name: &str) -> (String, String) {
    let code = std::fs::read_to_string(examples().join(format!("{name}.py"))).unwrap();
    let out = std::fs::read_to_string(examples().join(format!("{name}.out"))).unwrap();
    (code, out)
}

impl Default for Start {
    /// The pydata tests' start: the built CPython launcher, `python/worker.py` named by path,
    /// two CPU threads.
    fn default() -> Self {
        Start {
            engine: Engine::Python,
            script: true,
            launcher: None,
            strict_as: None,
            threads: Some(2),
            preload: None,
            max_address_space: None,
            pydata: true,
        }
    }
}

impl Worker {
    fn start() -> Worker {
        Self::start_with(Start::default())
    }
}

fn is_png(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.len() > 1000 && b.starts_with(b"\x89PNG\r\n\x1a\n"))
}

#[test]
fn variables_persist_output_goes_to_fds_and_last_value_is_shown() {
    need!("variables_persist_output_goes_to_fds_and_last_value_is_shown");
    let mut w = Worker::start();
    assert!(w.engine_name.starts_with("CPython 3."), "{}", w.engine_name);
    assert_eq!(w.exec("x = 41").assert_ok().out(), "");
    assert_eq!(w.exec("x + 1").assert_ok().out(), "42\n");
    // `;` after the last expression hides it, as in Jupyter; None is never shown.
    assert_eq!(w.exec("x + 1;").assert_ok().out(), "");
    assert_eq!(w.exec("None").assert_ok().out(), "");
    // A repr that raises shows a placeholder, as in the Eryx engine; the cell is ok.
    let c = w.exec("type('B', (), {'__repr__': lambda self: [][0]})()");
    assert_eq!(
        c.assert_ok().out(),
        "<repr failed: IndexError: list index out of range>\n"
    );
    let c = w.exec("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n's'");
    assert_eq!(c.assert_ok().out(), "to stdout\n's'\n");
    assert_eq!(String::from_utf8_lossy(&c.stderr), "to stderr\n");
    // Raw writes to fds 1 and 2 (as a C extension makes them) are output, never protocol.
    let c = w.exec("import os\nos.write(1, b'{\"t\":\"done\",\"cell\":99,\"status\":\"ok\"}\\n')\nos.write(2, b'raw err\\n');");
    assert_eq!(
        c.assert_ok().out(),
        "{\"t\":\"done\",\"cell\":99,\"status\":\"ok\"}\n"
    );
    assert_eq!(String::from_utf8_lossy(&c.stderr), "raw err\n");
    // The protocol descriptors are not inherited by programs a cell starts.
    let c = w.exec("import os; (os.get_inheritable(3), os.get_inheritable(4))");
    assert_eq!(c.assert_ok().out(), "(False, False)\n");
    // A cell's namespace is a fresh __main__, not the worker's globals.
    let c = w.exec("sorted(k for k in globals() if not k.startswith('__'))");
    assert_eq!(c.assert_ok().out(), "['os', 'sys', 'x']\n");
    w.exec("").assert_ok();
    let c = w.exec("s = 'héllo ✓'; print(s, len(s))");
    assert_eq!(c.assert_ok().out(), "héllo ✓ 7\n");
}

#[test]
fn numpy_linear_algebra_is_exact() {
    need!("numpy_linear_algebra_is_exact", "numpy");
    let mut w = Worker::start();
    let (code, out) = example("numpy_linalg");
    assert_eq!(w.exec(&code).assert_ok().out(), out);
}

#[test]
fn pandas_groupby_over_a_csv_is_exact() {
    need!("pandas_groupby_over_a_csv_is_exact", "pandas");
    let mut w = Worker::start();
    let (code, out) = example("pandas_groupby");
    assert_eq!(w.exec(&code).assert_ok().out(), out);
    // The same means as R's aggregate(mpg ~ cyl, data = mtcars, FUN = mean).
    assert!(out.contains("26.66364") && out.contains("19.74286") && out.contains("15.10000"));
}

#[test]
fn scipy_welch_test_matches_r() {
    need!("scipy_welch_test_matches_r", "scipy", "pandas");
    let mut w = Worker::start();
    let (code, out) = example("scipy_welch");
    assert_eq!(w.exec(&code).assert_ok().out(), out);
    // R: t.test(extra ~ group, data = sleep) prints t = -1.8608, df = 17.776, p-value = 0.07939.
    assert_eq!(out, "t = -1.8608\ndf = 17.7765\np = 0.07939\n");
}

#[test]
fn statsmodels_ols_matches_r_lm() {
    need!("statsmodels_ols_matches_r_lm", "statsmodels", "pandas");
    let mut w = Worker::start();
    let (code, out) = example("statsmodels_ols");
    assert_eq!(w.exec(&code).assert_ok().out(), out);
    // R: coef(lm(mpg ~ wt, data = mtcars)) is 37.285126, -5.344472.
    assert_eq!(
        out,
        "Intercept    37.2851\nwt           -5.3445\nR^2: 0.7528\n"
    );
}

#[test]
fn matplotlib_figures_become_pngs_without_rebuilding_font_caches() {
    need!(
        "matplotlib_figures_become_pngs_without_rebuilding_font_caches",
        "matplotlib",
        "pandas"
    );
    let mut w = Worker::start();
    let before = w.session_files();
    let (code, out) = example("matplotlib_plot");
    let c = w.exec(&code);
    assert_eq!(c.assert_ok().out(), out);
    assert!(is_png(&w.session.join("plot-1-001.png")));
    // plt.show() closed the figure: nothing is left for the end of the cell.
    assert!(!w.session.join("plot-1-002.png").exists());
    // A figure left open is saved when its cell ends, and a second one after it.
    let c = w.exec(
        "import matplotlib.pyplot as plt\nplt.figure(); plt.plot([1, 3, 2])\n\
         plt.figure(); plt.bar(['a', 'b'], [2, 1]);",
    );
    c.assert_ok();
    assert!(is_png(&w.session.join("plot-2-001.png")));
    assert!(is_png(&w.session.join("plot-2-002.png")));
    assert_eq!(w.exec("len(plt.get_fignums())").out(), "0\n");
    // The backend is Agg, and nothing but the plots appeared in the session directory: no
    // .cache/fontconfig, no matplotlib font list.
    assert_eq!(
        w.exec("import matplotlib; matplotlib.get_backend()").out(),
        "'agg'\n"
    );
    let mut after = w.session_files();
    after.retain(|f| !before.contains(f));
    assert_eq!(
        after,
        ["plot-1-001.png", "plot-2-001.png", "plot-2-002.png"]
    );
    // With the host's prebuilt font list, matplotlib read it instead of scanning fonts: the
    // link the launcher made is still a link (a rebuild would have replaced it by a file).
    let prebuilt = Path::new("/var/cache/sandcell/matplotlib");
    let has_prebuilt = std::fs::read_dir(prebuilt).is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("fontlist-"))
    });
    if has_prebuilt {
        let cfg = w.session.join(".tmp/matplotlib");
        let lists: Vec<_> = std::fs::read_dir(&cfg)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("fontlist-"))
            .collect();
        assert!(!lists.is_empty());
        for e in lists {
            assert!(
                e.file_type().unwrap().is_symlink(),
                "{} was rebuilt in the session",
                e.path().display()
            );
        }
    } else {
        sandcell_testing::skip_part!(
            "fonts",
            "no prebuilt font list in {} (scripts/font-cache.sh); font-cache check skipped",
            prebuilt.display()
        );
    }
}

#[test]
fn r_plots_leave_no_font_cache_in_the_session() {
    if !Path::new("/usr/lib/R/bin/exec/R").exists() {
        sandcell_testing::skip!("r", "R is not installed");
    }
    let mut w = Worker::start_with(Start {
        engine: Engine::R,
        ..Start::default()
    });
    let before = w.session_files();
    let c = w.exec("plot(1:10, main = 'Title'); text(5, 5, 'label')");
    c.assert_ok();
    let mut after = w.session_files();
    after.retain(|f| !before.contains(f));
    assert_eq!(after, ["plot-1-001.png"]);
}

#[test]
fn interrupts_end_exactly_the_running_cell_and_keep_variables() {
    need!(
        "interrupts_end_exactly_the_running_cell_and_keep_variables",
        "numpy"
    );
    let mut w = Worker::start();
    w.exec("import numpy as np\nkeep = np.arange(5)\nm = np.random.default_rng(1).standard_normal((600, 600))")
        .assert_ok();
    // OpenBLAS runs its pool (2 threads here): SIGINT must still reach the main thread.
    w.exec("m @ m;").assert_ok();
    assert!(w.threads() >= 2, "OpenBLAS started no threads");
    for code in [
        "v = 1\nimport time\ntime.sleep(100)",
        "v = 2\nwhile True:\n    pass",
        "v = 3\nfor i in range(10**9):\n    m = m @ m / np.linalg.norm(m)",
        "v = 4\nx = np.linalg.inv(np.random.default_rng(2).standard_normal((1500, 1500)))\nwhile True:\n    x = x @ x / np.linalg.norm(x)",
    ] {
        let (c, took) = w.interrupt(code, Duration::from_millis(400));
        assert_eq!(c.status, WorkerStatus::Interrupted, "{code}: {c:?}");
        assert!(
            took < Duration::from_secs(3),
            "{code}: interrupt took {took:?}"
        );
    }
    let c = w.exec("print(v, keep.sum(), m.shape)");
    assert_eq!(c.assert_ok().out(), "4 10 (600, 600)\n");
    // A cell that swallows the first KeyboardInterrupt ends on the repeat (the daemon repeats
    // SIGINT until the cell's done).
    let t0 = Instant::now();
    let cell = w.send(
        b"import time\ntry:\n    time.sleep(100)\nexcept KeyboardInterrupt:\n    print('caught')\ntime.sleep(100)",
        None,
    );
    std::thread::sleep(Duration::from_millis(300));
    w.sigint();
    std::thread::sleep(Duration::from_millis(300));
    w.sigint();
    let c = w.wait_done(cell, t0, Duration::from_secs(10));
    assert_eq!(
        (c.status, c.out()),
        (WorkerStatus::Interrupted, "caught\n".into())
    );
}

#[test]
fn sigint_between_cells_and_during_replies_is_harmless() {
    need!("sigint_between_cells_and_during_replies_is_harmless");
    let mut w = Worker::start();
    w.exec("keep = 'yes'").assert_ok();
    for _ in 0..3 {
        w.sigint();
        std::thread::sleep(Duration::from_millis(100));
    }
    let c = w.exec("import time; time.sleep(0.3); keep");
    assert_eq!(c.assert_ok().out(), "'yes'\n");
    // Signals racing with many short cells (landing while the worker reads a request, writes
    // a reply, or starts a cell): each cell ends ok or interrupted, never the worker.
    let pid = w.pid();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let pest = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            // SAFETY: signalling the main thread of our own child.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGINT) };
            std::thread::sleep(Duration::from_micros(700));
        }
    });
    let mut interrupted = 0;
    for i in 0..300 {
        let c = w.exec(&format!("n = {i}"));
        match c.status {
            WorkerStatus::Ok => {}
            WorkerStatus::Interrupted => interrupted += 1,
            other => panic!("cell {i}: {other:?} {c:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    pest.join().unwrap();
    assert!(w.child.try_wait().unwrap().is_none());
    println!("signal storm: {interrupted} of 300 short cells interrupted");
    assert_eq!(w.exec("keep").assert_ok().out(), "'yes'\n");
}

#[test]
fn tracebacks_show_the_users_lines() {
    need!("tracebacks_show_the_users_lines");
    let mut w = Worker::start();
    let c = w.exec("def f(v):\n    w = v * 2\n    return w / 0\n\ny = 2\nf(y)\n");
    assert_eq!(c.status, WorkerStatus::Error);
    let e = c.err();
    assert_eq!(
        (e.kind.as_str(), e.message.as_str()),
        ("ZeroDivisionError", "division by zero")
    );
    assert_eq!(e.line, Some(3), "line of the raise inside the cell");
    let tb = e.traceback.as_deref().unwrap();
    assert!(
        tb.starts_with("Traceback (most recent call last):\n  File \"<cell 1>\", line 6, in <module>\n    f(y)\n  File \"<cell 1>\", line 3, in f\n    return w / 0\n"),
        "{tb}"
    );
    assert!(!tb.contains("worker.py") && !tb.contains("exec("), "{tb}");
    // Functions defined in an earlier cell keep their source lines.
    let c = w.exec("z = 1\nf(z)");
    let e = c.err();
    assert_eq!(e.line, Some(2));
    assert!(
        e.traceback
            .as_deref()
            .unwrap()
            .contains("File \"<cell 1>\", line 3, in f\n    return w / 0"),
        "{e:?}"
    );
    assert_eq!(w.exec("y").out(), "2\n");
    // Syntax errors: the line, nothing run, no worker frames.
    let c = w.exec("q = 1\nq q\n");
    let e = c.err();
    assert_eq!((e.kind.as_str(), e.line), ("SyntaxError", Some(2)));
    assert!(!e.traceback.as_deref().unwrap().contains("ast.py"), "{e:?}");
    assert_eq!(w.exec("'q' in globals()").out(), "False\n");
    // Library errors carry their qualified type.
    let c = w.exec("import json\njson.loads('{')");
    assert_eq!(c.err().kind, "json.decoder.JSONDecodeError");
    assert_eq!(c.err().line, Some(2));
    // Runaway recursion: an error with the innermost frames, bounded.
    let c = w.exec("def r(n):\n    return r(n + 1)\nr(0)");
    let e = c.err();
    assert_eq!((e.kind.as_str(), e.line), ("RecursionError", Some(2)));
    assert!(e.traceback.as_deref().unwrap().len() <= MAX_TRACEBACK + 64);
    // A huge message is bounded with a marker counting what was cut.
    let c = w.exec("raise ValueError('x' * 200_000_000)");
    let m = &c.err().message;
    assert!(m.len() <= MAX_ERROR_MESSAGE + 64, "{} bytes", m.len());
    assert!(m.ends_with(&format!(
        "... [{} more bytes]",
        200_000_000 - MAX_ERROR_MESSAGE
    )));
    assert!(c.line_len < 128 * 1024, "done line of {} bytes", c.line_len);
    // Lone surrogates cannot break the JSON reply.
    let c = w.exec("raise RuntimeError('bad \\udcff end')");
    assert_eq!(c.err().message, "bad \\udcff end");
    w.exec("1").assert_ok();
}

#[test]
fn exit_quit_and_sys_exit_report_exited() {
    need!("exit_quit_and_sys_exit_report_exited");
    for (code, want) in [
        ("print('bye'); exit()", 0),
        ("quit(3)", 3),
        ("import sys; sys.exit(4)", 4),
        ("raise SystemExit('message')", 1),
    ] {
        let mut w = Worker::start();
        w.exec("x = 1").assert_ok();
        let c = w.exec(code);
        assert_eq!(
            (c.status, c.exit_code),
            (WorkerStatus::Exited, Some(want)),
            "{code}"
        );
        assert_eq!(
            w.wait_exit(Duration::from_secs(10)).code(),
            Some(want as i32),
            "{code}"
        );
    }
    // os._exit and fatal signals end the process without a done: the daemon reports
    // worker_crashed from the exit status.
    let mut w = Worker::start();
    let cell = w.send(b"import os; os._exit(7)", None);
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let started =
        |m: Option<(WorkerMessage, usize)>| matches!(m, Some((WorkerMessage::Started { .. }, _)));
    assert!(started(w.next_message(
        &mut o,
        &mut e,
        None,
        Duration::from_secs(10)
    )));
    assert!(
        w.next_message(&mut o, &mut e, None, Duration::from_secs(10))
            .is_none(),
        "cell {cell}"
    );
    assert_eq!(w.wait_exit(Duration::from_secs(10)).code(), Some(7));
    let mut w = Worker::start();
    w.send(
        b"import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
        None,
    );
    assert!(started(w.next_message(
        &mut o,
        &mut e,
        None,
        Duration::from_secs(10)
    )));
    assert!(
        w.next_message(&mut o, &mut e, None, Duration::from_secs(10))
            .is_none()
    );
    assert_eq!(
        w.wait_exit(Duration::from_secs(10)).signal(),
        Some(libc::SIGSEGV)
    );
}

#[test]
fn exit_request_and_eof_end_the_worker() {
    need!("exit_request_and_eof_end_the_worker");
    let mut w = Worker::start();
    w.write_raw(b"exit 0 0\n");
    assert_eq!(w.wait_exit(Duration::from_secs(10)).code(), Some(0));
    let mut w = Worker::start();
    w.close_requests();
    assert_eq!(w.wait_exit(Duration::from_secs(10)).code(), Some(0));
    let mut w = Worker::start();
    w.write_raw(b"exec x 1\n");
    assert_eq!(w.wait_exit(Duration::from_secs(10)).code(), Some(2));
}

#[test]
fn forked_children_never_touch_the_protocol() {
    need!("forked_children_never_touch_the_protocol");
    let mut w = Worker::start();
    // The child returns from the cell into the worker: it must exit, not read requests.
    let c = w.exec("import os\npid = os.fork()\nif pid == 0:\n    print('child')\nelse:\n    os.waitpid(pid, 0)\n    print('parent')");
    assert_eq!(c.assert_ok().out(), "child\nparent\n");
    assert_eq!(w.exec("'still here'").assert_ok().out(), "'still here'\n");
    let c = w.exec("import subprocess; print(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout, end='')");
    assert_eq!(c.assert_ok().out(), "hi\n");
}

#[test]
fn timeout_option_stops_a_busy_cell() {
    need!("timeout_option_stops_a_busy_cell");
    let mut w = Worker::start();
    w.exec("k = 1").assert_ok();
    let c = w.exec_opts("while True:\n    pass", Some(500));
    assert_eq!(c.status, WorkerStatus::Timeout, "{c:?}");
    assert!(c.elapsed < Duration::from_secs(3));
    let c = w.exec_opts("import time; time.sleep(10)", Some(300));
    assert_eq!(c.status, WorkerStatus::Timeout, "{c:?}");
    // The limit does not outlive its cell.
    let c = w.exec("import time; time.sleep(0.7); k");
    assert_eq!(c.assert_ok().out(), "1\n");
}

#[test]
fn output_is_live() {
    need!("output_is_live");
    let mut w = Worker::start();
    let c = w.exec("import time\nprint('first')\ntime.sleep(1)\nprint('second')");
    assert_eq!(c.assert_ok().out(), "first\nsecond\n");
    let first = c.first_stdout.unwrap();
    assert!(
        c.elapsed - first > Duration::from_millis(700),
        "first at {first:?}"
    );
}

#[test]
fn memory_errors_are_memory_exhausted() {
    need!("memory_errors_are_memory_exhausted", "numpy");
    let mut w = Worker::start_with(Start {
        max_address_space: Some(4 << 30),
        ..Start::default()
    });
    w.exec("import numpy as np; keep = 1").assert_ok();
    let c = w.exec("x = np.ones(10**10)"); // 80 GB under a 4 GiB RLIMIT_AS
    assert_eq!(c.status, WorkerStatus::MemoryExhausted, "{c:?}");
    assert_eq!(w.exec("(keep, 'x' in globals())").out(), "(1, False)\n");
}

#[test]
fn environment_is_clean_threads_follow_the_cpu_limit_and_cwd_is_the_session() {
    need!("environment_is_clean_threads_follow_the_cpu_limit_and_cwd_is_the_session");
    let mut w = Worker::start_with(Start {
        threads: Some(3),
        ..Start::default()
    });
    let c = w.exec("import os; print(sorted(os.environ)); print(os.getcwd())");
    let out = c.assert_ok().out();
    assert!(
        !out.contains("SANDCELL_TEST_CANARY") && !out.contains("SANDCELL_CONFINE"),
        "{out}"
    );
    assert!(
        out.ends_with(&format!("{}\n", w.session.display())),
        "{out}"
    );
    let c = w.exec("import os, sys, tempfile\n[os.environ[k] for k in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MPLBACKEND', 'HOME')] + [tempfile.gettempdir(), sys.flags.isolated]");
    assert_eq!(
        c.out(),
        format!(
            "['3', '3', 'Agg', '{}', '{}', 1]\n",
            w.session.display(),
            w.session.join(".tmp").display()
        )
    );
    // Uploaded modules import from the session directory (after the system's own).
    std::fs::write(w.session.join("helper_mod.py"), "VALUE = 7\n").unwrap();
    assert_eq!(w.exec("import helper_mod; helper_mod.VALUE").out(), "7\n");
}

#[test]
fn preloaded_modules_are_ready_before_the_first_cell() {
    need!(
        "preloaded_modules_are_ready_before_the_first_cell",
        "pandas"
    );
    let mut w = Worker::start_with(Start {
        preload: Some("numpy, pandas, no_such_module".into()),
        ..Start::default()
    });
    assert!(
        String::from_utf8_lossy(&w.boot_stderr).contains("preloading no_such_module failed"),
        "{}",
        String::from_utf8_lossy(&w.boot_stderr)
    );
    let c = w.exec("import sys; ('pandas' in sys.modules, 'pd' in globals())");
    assert_eq!(c.assert_ok().out(), "(True, False)\n");
    let c = w.exec("import pandas as pd");
    assert!(c.elapsed < Duration::from_millis(100), "{:?}", c.elapsed);
}

#[test]
fn embedded_script_is_used_without_a_file() {
    need!("embedded_script_is_used_without_a_file");
    let dir = std::env::temp_dir().join(format!("sandcell-wpn-exe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("sandcell-worker-python-native");
    std::fs::copy(common::PYTHON_LAUNCHER, &exe).unwrap();
    let mut w = Worker::start_with(Start {
        script: false,
        launcher: Some(exe),
        ..Start::default()
    });
    assert_eq!(w.exec("1 + 1").assert_ok().out(), "2\n");
    let c = w.exec("1/0");
    assert_eq!(c.err().line, Some(1));
    drop(w);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The hostile categories of the R worker, for this engine: files, network, processes,
/// resources. Strict enforcement as uid 65534 where the test runs as root.
#[test]
fn hostile_cells_are_contained() {
    need!("hostile_cells_are_contained");
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut w = Worker::start_with(Start {
        strict_as: root.then_some(65534),
        ..Start::default()
    });
    if root {
        assert!(
            w.boot_stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&w.boot_stderr)
        );
        assert_eq!(
            w.exec("import os; os.getuid(), os.getgid(), os.getgroups()")
                .out(),
            "(65534, 65534, [])\n"
        );
    }
    let probe = |w: &mut Worker, what: &str, code: &str| -> String {
        let c = w.exec(&format!(
            "try:\n    r = ({code})\n    print('ALLOWED', repr(r)[:80])\nexcept BaseException as e:\n    print('DENIED', type(e).__name__)"
        ));
        let out = c.assert_ok().out();
        assert!(out.starts_with("DENIED"), "{what}: {out}");
        out
    };
    // Files: host secrets and other directories, reading and writing outside the session.
    for (what, code) in [
        ("read /etc/shadow", "open('/etc/shadow').read()"),
        ("read /etc/hostname", "open('/etc/hostname').read()"),
        ("list /root", "__import__('os').listdir('/root')"),
        ("list /home", "__import__('os').listdir('/home')"),
        ("read another process", "open('/proc/1/cmdline').read()"),
        ("list processes", "__import__('os').listdir('/proc')"),
        (
            "write /usr/lib",
            "open('/usr/lib/python3/dist-packages/evil.py', 'w').write('x')",
        ),
        (
            "replace the font cache",
            "open('/var/cache/fontconfig/x', 'w').write('x')",
        ),
        (
            "write the session's parent",
            f!("open('{}/../escape', 'w').write('x')", w.session.display()),
        ),
        (
            "execute from the session",
            "__import__('subprocess').run(['./run.sh'])",
        ),
    ] {
        if what == "execute from the session" {
            std::fs::write(w.session.join("run.sh"), "#!/bin/sh\necho pwned\n").unwrap();
            std::fs::set_permissions(
                w.session.join("run.sh"),
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .unwrap();
        }
        probe(&mut w, what, code);
    }
    // /tmp and /var/tmp: denied, or a private directory the host never sees.
    w.exec("for p in ('/tmp/sandcell-escape', '/var/tmp/sandcell-escape'):\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass").assert_ok();
    // Symlinks leading out of the session lead nowhere.
    let c = w.exec("import os; os.symlink('/etc/shadow', 'link'); open('link').read()");
    assert_eq!(c.status, WorkerStatus::Error, "{c:?}");
    // Network: no sockets at all (AF_INET, AF_INET6, AF_UNIX to the daemon or the bus).
    for (what, code) in [
        ("tcp socket", "__import__('socket').socket()"),
        ("udp socket", "__import__('socket').socket(2, 2)"),
        ("unix socket", "__import__('socket').socket(1, 1)"),
        ("dns", "__import__('socket').getaddrinfo('example.com', 80)"),
        (
            "http",
            "__import__('urllib.request').request.urlopen('http://1.1.1.1', timeout=2)",
        ),
    ] {
        probe(&mut w, what, code);
    }
    // Processes: no signals to processes outside the session, no tracing, no namespaces.
    w.exec("def ok0(r):\n    if r != 0:\n        raise PermissionError(r)\n    return r")
        .assert_ok();
    for (what, code) in [
        ("signal init", "__import__('os').kill(1, 0)"),
        (
            "signal the test",
            f!("__import__('os').kill({}, 0)", std::process::id()),
        ),
        (
            "ptrace",
            "ok0(__import__('ctypes').CDLL(None).ptrace(16, 1, 0, 0))",
        ),
        (
            "user namespace",
            "ok0(__import__('ctypes').CDLL(None).unshare(0x10000000))",
        ),
        (
            "mount namespace",
            "ok0(__import__('ctypes').CDLL(None).unshare(0x00020000))",
        ),
    ] {
        probe(&mut w, what, code);
    }
    // Its own children are fine, and die with the cell's process group.
    let c = w.exec("import subprocess; subprocess.run(['true']).returncode");
    assert_eq!(c.assert_ok().out(), "0\n");
    // Resources: the file-size limit holds, and the worker survives.
    let c = w.exec("f = open('big', 'wb'); f.seek((1 << 30) + 10); f.write(b'x'); f.flush()");
    assert_ne!(c.status, WorkerStatus::Ok, "{c:?}");
    assert_eq!(w.exec("2 + 2").assert_ok().out(), "4\n");
    // Nothing escaped.
    assert!(!Path::new("/tmp/sandcell-escape").exists());
    assert!(!Path::new("/var/tmp/sandcell-escape").exists());
}

#[test]
fn missing_plan_exits_before_python_starts() {
    let out = Command::new(common::PYTHON_LAUNCHER)
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(sandcell_confine::EXIT_CONFINE_FAILED)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("SANDCELL_CONFINE"));
}

/// Prints the start-up and round-trip figures; asserts only gross regressions.
#[test]
fn figures() {
    need!("figures", "pandas");
    let mut w = Worker::start();
    let startup = w.startup;
    w.exec("1;").assert_ok();
    let mut times: Vec<Duration> = (0..200).map(|_| w.exec("print(1)").elapsed).collect();
    times.sort();
    let (p50, p99) = (times[100], times[197]);
    let import = w.exec("import pandas as pd").assert_ok().elapsed;
    let rss = w.rss_bytes() / 1024;
    let plot = w
        .exec("import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()")
        .assert_ok()
        .elapsed;
    let pre = Worker::start_with(Start {
        preload: Some("numpy,pandas".into()),
        ..Start::default()
    });
    let mut pre = pre;
    let pre_import = pre.exec("import pandas as pd").assert_ok().elapsed;
    println!(
        "figures: start to ready {startup:?}; trivial cell print(1) p50 {p50:?} p99 {p99:?}; \
         first `import pandas` {import:?} (preloaded worker: start {:?}, import {pre_import:?}); \
         RSS after pandas {rss} KiB; first plot of the session {plot:?}",
        pre.startup
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let strict = Worker::start_with(Start {
            strict_as: Some(65534),
            ..Start::default()
        });
        println!(
            "figures: start to ready, strict as uid 65534: {:?}",
            strict.startup
        );
    }
    assert!(p50 < Duration::from_millis(50), "p50 {p50:?}");
}
