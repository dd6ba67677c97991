//! The `pydata` environment through a real sandcelld: native CPython with Debian's scientific
//! stack in a confined worker (`sandcell-worker-python-native`), the analyses of
//! `examples/pydata/` with their exact expected output, plots returned as PNG files,
//! interrupts that keep the session, tracebacks with the user's lines, exits, and the walls
//! of the native engine (files, network, processes, resources).
//!
//! Skipped, with the reason printed, when /usr/bin/python3 or one of the packages is missing
//! (scripts/setup.sh installs them).

use crate::common;

use common::{Daemon, eventually};
use sandcell_client::{Client, Collected, State, Status};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PACKAGES: &str = "numpy, pandas, scipy, matplotlib, statsmodels";

fn pydata_available() -> bool {
    let ok = Path::new("/usr/bin/python3").exists()
        && Command::new("/usr/bin/python3")
            .args(["-I", "-c", &format!("import {PACKAGES}")])
            .env("MPLBACKEND", "Agg")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "skipped: /usr/bin/python3 cannot import {PACKAGES} (scripts/setup.sh installs python3-numpy python3-pandas python3-scipy python3-matplotlib python3-statsmodels)"
        );
    }
    ok
}

fn daemon(extra: &[(&str, &str)]) -> Option<Daemon> {
    if !pydata_available() {
        return None;
    }
    Some(Daemon::start(extra))
}

async fn open(c: &mut Client) -> String {
    c.open_in("python", Some("pydata"), None, None)
        .await
        .expect("open pydata")
        .session
}

async fn cell(c: &mut Client, s: &str, code: &str) -> Collected {
    c.execute_collect(s, code).await.expect("execute")
}

fn examples() -> std::path::PathBuf {
    common::manifest_dir().join("../examples/pydata")
}

/// A native worker writes its own private /tmp, /var/tmp and /dev/shm (Python's tempfile,
/// multiprocessing's semaphores, R's tempdir()), which no other session sees.
#[tokio::test]
async fn native_workers_write_their_own_private_tmp() {
    let with_r = common::r_available();
    let languages = if with_r { "python,r" } else { "python" };
    let Some(d) = daemon(&[("SANDCELL_LANGUAGES", languages)]) else {
        return;
    };
    let mut c = d.client().await;
    let s = match c.open_in("python", Some("pydata"), None, None).await {
        Ok(o) => o.session,
        Err(e) => panic!("open pydata: {e:?}\n{}", d.log_text()),
    };
    let r = cell(
        &mut c,
        &s,
        "import multiprocessing, tempfile\n\
         for d in ('/tmp', '/var/tmp', '/dev/shm'):\n\
         \x20   open(d + '/mine', 'w').write(d)\n\
         \x20   print(open(d + '/mine').read())\n\
         with tempfile.NamedTemporaryFile() as f: print(f.write(b'1'))\n\
         multiprocessing.Lock(); print('lock')\n",
    )
    .await;
    assert_eq!(r.result.status, Status::Ok, "{r:?}");
    assert_eq!(r.stdout, "/tmp\n/var/tmp\n/dev/shm\n1\nlock\n");
    let other = open(&mut c).await;
    let r = cell(
        &mut c,
        &other,
        "import os; print([os.path.exists(d + '/mine') for d in ('/tmp', '/var/tmp', '/dev/shm')])",
    )
    .await;
    assert_eq!(r.stdout, "[False, False, False]\n", "{r:?}");
    if with_r {
        let rs = c
            .open_in("r", None, None, None)
            .await
            .expect("open r")
            .session;
        let r = cell(
            &mut c,
            &rs,
            "writeLines('x', '/tmp/r'); f <- tempfile(); writeLines('y', f); cat(readLines('/tmp/r'), readLines(f), file.exists('/tmp/mine'), '\\n')",
        )
        .await;
        assert_eq!(r.stdout, "x y FALSE \n", "{r:?}");
    }
}

#[tokio::test]
async fn pydata_analyses_print_exact_results_and_plots_arrive_as_png() {
    let Some(d) = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]) else {
        return;
    };
    let mut c = d.client().await;
    let s = open(&mut c).await;
    for csv in ["mtcars.csv", "sleep.csv"] {
        let data = std::fs::read(examples().join(csv)).unwrap();
        c.put_bytes(&s, csv, &data).await.unwrap();
    }
    for name in [
        "pandas_groupby",
        "numpy_linalg",
        "scipy_welch",
        "statsmodels_ols",
        "matplotlib_plot",
    ] {
        let code = std::fs::read_to_string(examples().join(format!("{name}.py"))).unwrap();
        let want = std::fs::read_to_string(examples().join(format!("{name}.out"))).unwrap();
        let out = cell(&mut c, &s, &code).await;
        assert_eq!(
            out.result.status,
            Status::Ok,
            "{name}: {:?}\n{}",
            out.result,
            out.stderr
        );
        assert_eq!(out.stdout, want, "{name}");
        if name == "matplotlib_plot" {
            let names: Vec<_> = out.result.files.iter().map(|f| f.name.clone()).collect();
            let png = format!("plot-{}-001.png", out.cell);
            let f = out
                .result
                .files
                .iter()
                .find(|f| f.name == png)
                .unwrap_or_else(|| panic!("{png} not among the cell's files {names:?}"));
            assert_eq!(f.media_type, "image/png");
            // Only the plot: no font cache or configuration leaks into the session's files.
            assert_eq!(names, std::slice::from_ref(&png), "{names:?}");
            let mut bytes = Vec::new();
            c.get_file(&s, &png, &mut bytes).await.unwrap();
            assert!(
                bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 5000,
                "not a PNG: {} bytes",
                bytes.len()
            );
        }
    }
    // scipy's Welch test matches R's t.test on the same data (t = -1.8608, p = 0.07939).
    let out = cell(
        &mut c,
        &s,
        "print(round(res.statistic, 4), round(res.pvalue, 5))",
    )
    .await;
    assert_eq!(out.stdout, "-1.8608 0.07939\n");
}

#[tokio::test]
async fn pydata_session_state_tracebacks_exits_and_threads() {
    let Some(d) = daemon(&[("SANDCELL_WORKER_CPUS", "2")]) else {
        return;
    };
    let mut c = d.client().await;
    let o = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .unwrap();
    assert!(o.engine.starts_with("CPython 3."), "{}", o.engine);
    let s = o.session;
    cell(&mut c, &s, "import numpy as np\nx = np.arange(5)").await;
    let out = cell(&mut c, &s, "x.sum()").await;
    assert_eq!(out.stdout, "10\n", "the last expression is shown");
    // The user's line numbers, in the error and in the traceback.
    let out = cell(&mut c, &s, "a = 1\n\ndef f(v):\n    return v / 0\n\nf(a)\n").await;
    assert_eq!(out.result.status, Status::Error);
    let e = out.result.error.clone().unwrap();
    assert_eq!(e.kind, "ZeroDivisionError", "{e:?}");
    assert_eq!(e.line, Some(4), "{e:?}");
    let tb = e.traceback.unwrap_or_default();
    assert!(
        tb.contains("line 6") && tb.contains("return v / 0"),
        "traceback without the user's lines: {tb}"
    );
    assert_eq!(out.result.state, State::Kept);
    // BLAS/OpenMP pools follow the session's CPU quota (2 CPUs here); the working directory
    // is the session directory.
    let out = cell(
        &mut c,
        &s,
        "import os\nprint(os.environ['OPENBLAS_NUM_THREADS'], os.environ['OMP_NUM_THREADS'])\nprint(os.getcwd() == os.environ['SANDCELL_SESSION_DIR'], os.environ.get('MPLBACKEND'))",
    )
    .await;
    assert_eq!(out.stdout, "2 2\nTrue Agg\n", "{:?}", out.result);
    // The session directory is also /mnt/data (inside the worker's mount namespace).
    if !common::insecure() {
        let out = cell(
            &mut c,
            &s,
            "import os\nopen('/mnt/data/via-mnt.txt', 'w').write('hi')\nprint(os.path.samefile('/mnt/data', '.'))",
        )
        .await;
        assert_eq!(out.stdout, "True\n", "{:?}", out.result);
        assert!(
            out.result.files.iter().any(|f| f.name == "via-mnt.txt"),
            "{:?}",
            out.result.files
        );
    }
    let out = cell(&mut c, &s, "print(x.tolist())").await;
    assert_eq!(out.stdout, "[0, 1, 2, 3, 4]\n");
    // sys.exit(n) ends the session with its code.
    let out = cell(&mut c, &s, "import sys\nsys.exit(3)").await;
    assert_eq!(out.result.status, Status::Exited, "{:?}", out.result);
    assert_eq!(out.result.exit_code, Some(3));
    assert!(out.result.session_ended);
    // os._exit is a crash.
    let out = c
        .run_collect_in("python", Some("pydata"), "import os\nos._exit(0)", None)
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::WorkerCrashed, "{:?}", out.result);
}

#[tokio::test]
async fn pydata_interrupts_end_the_cell_and_keep_the_variables() {
    let Some(d) = daemon(&[
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120"),
        ("SANDCELL_WORKER_CPUS", "2"),
    ]) else {
        return;
    };
    let mut a = d.client().await;
    let s = open(&mut a).await;
    cell(
        &mut a,
        &s,
        "import numpy as np, time\nkeep = 'kept'\nm = np.random.default_rng(1).standard_normal((700, 700))",
    )
    .await;
    // time.sleep, and BLAS products on two OpenBLAS threads: SIGINT goes to the main thread.
    for code in ["time.sleep(100)", "while True:\n    m = m @ m / 700.0"] {
        a.execute(&s, code).await.unwrap();
        let started = a.next_frame().await.unwrap().started.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut b = d.client().await;
        let t0 = Instant::now();
        assert!(b.interrupt(&s, started.cell).await.unwrap().delivered);
        let out = a.finish(|_| {}).await.unwrap();
        // Not interrupted, the cell would run for 100 s or until the wall time.
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{code}: took {:?}",
            t0.elapsed()
        );
        assert_eq!(
            out.result.status,
            Status::Interrupted,
            "{code}: {:?}",
            out.result
        );
        assert_eq!(out.result.state, State::Kept);
        let after = cell(&mut a, &s, "print(keep, m.shape)").await;
        assert_eq!(after.stdout, "kept (700, 700)\n", "{:?}", after.result);
    }
}

#[tokio::test]
async fn pydata_walls_hold() {
    let Some(d) = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "20")]) else {
        return;
    };
    let mut c = d.client().await;
    let pid = d.pid();
    let blocked: Vec<(&str, String)> = vec![
        ("read /etc/shadow", "open('/etc/shadow').read()".into()),
        ("list /root", "import os\nassert os.listdir('/root')".into()),
        (
            "list other sessions",
            "import os\nassert len(os.listdir('..')) > 1".into(),
        ),
        (
            "tcp to 127.0.0.1",
            "import socket\nsocket.create_connection(('127.0.0.1', 22), 2)".into(),
        ),
        (
            "unix socket",
            "import socket\nsocket.socket(socket.AF_UNIX).connect('/run/dbus/system_bus_socket')"
                .into(),
        ),
        ("signal the daemon", format!("import os\nos.kill({pid}, 9)")),
        (
            "read the daemon's /proc",
            format!("open('/proc/{pid}/cmdline').read()"),
        ),
        (
            "shell reads /etc/shadow",
            "import subprocess\nsubprocess.run(['cat', '/etc/shadow'], check=True)".into(),
        ),
        (
            "write /usr",
            "open('/usr/lib/python3/dist-packages/evil.py', 'w').write('x')".into(),
        ),
    ];
    for (what, code) in &blocked {
        let out = c
            .run_collect_in("python", Some("pydata"), code, None)
            .await
            .unwrap();
        assert_eq!(
            out.result.status,
            Status::Error,
            "{what}: not blocked: {out:?}"
        );
    }
    // A write to /tmp lands in the session's private /tmp, never the host's.
    let out = c
        .run_collect_in(
            "python",
            Some("pydata"),
            "open('/tmp/sandcell-escape-pydata', 'w').write('x')",
            None,
        )
        .await
        .unwrap();
    assert_ne!(out.result.status, Status::WorkerCrashed, "{out:?}");
    assert!(!Path::new("/tmp/sandcell-escape-pydata").exists());

    // Identity and layers, seen from inside.
    let out = c
        .run_collect_in(
            "python",
            Some("pydata"),
            "for l in open('/proc/self/status'):\n    if l.split(':')[0] in ('Uid', 'CapEff', 'NoNewPrivs', 'Seccomp'):\n        print(l.strip())\nprint(open('/proc/self/cgroup').read())",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{out:?}");
    if !common::insecure() {
        let field = |k: &str| {
            out.stdout
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .unwrap_or("")
                .to_string()
        };
        assert!(field("Uid:").parse::<u64>().unwrap() >= 3_000_000_000);
        assert_eq!(field("CapEff:"), "0000000000000000");
        assert_eq!(field("NoNewPrivs:"), "1");
        assert_eq!(field("Seccomp:"), "2");
        assert!(out.stdout.contains("/sessions/"), "{}", out.stdout);
    }

    // Processes: a fork bomb stops at pids.max; a leftover child does not outlive its cell.
    let mut s = d.client().await;
    let sess = open(&mut s).await;
    let out = cell(
        &mut s,
        &sess,
        "import subprocess\nsubprocess.Popen(['sleep', '1000'])\nprint('started')",
    )
    .await;
    assert_eq!(out.stdout, "started\n", "{:?} {}", out.result, out.stderr);
    assert!(
        eventually(Duration::from_secs(5), || d
            .descendants()
            .iter()
            .all(|p| !cmdline(*p).starts_with("sleep"))),
        "a cell's child outlived its cell"
    );
    let out = cell(
        &mut s,
        &sess,
        "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', n < 1000)",
    )
    .await;
    assert_eq!(out.stdout, "stopped True\n", "{:?}", out.result);
    // Memory: a 4 GiB allocation fails or is OOM-killed; the daemon lives.
    let out = c
        .run_collect_in(
            "python",
            Some("pydata"),
            "b = bytearray(4 << 30)\nprint(len(b))",
            None,
        )
        .await
        .unwrap();
    assert!(
        matches!(
            out.result.status,
            Status::Oom | Status::MemoryExhausted | Status::Error
        ),
        "{:?}",
        out.result
    );
    // Output floods are bounded at the host end with exact counts.
    let out = c
        .run_collect_in(
            "python",
            Some("pydata"),
            "import os\nfor _ in range(1000):\n    os.write(1, b'x' * 999 + b'\\n')",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.result.stdout.seen, 1_000_000, "{:?}", out.result);
    assert!(out.result.stdout.truncated);
    assert!(d.child_alive());
}

/// What a directory holds as the daemon charges it: per regular file the larger of its size
/// and its allocated blocks, per other entry its blocks, at any depth (entries vanishing
/// meanwhile are skipped).
fn charged(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for e in entries.flatten() {
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        total += if m.is_file() {
            m.len().max(m.blocks() * 512)
        } else {
            m.blocks() * 512
        };
        if m.is_dir() {
            total += charged(&e.path());
        }
    }
    total
}

/// Python threads a cell starts run on after the cell (they cannot be stopped without ending
/// the worker). Four of them writing as fast as they can while the session is idle meet the
/// kernel's bound, not the next walk: the session's own file system refuses the write past
/// the budget (`ENOSPC` in every thread), the directory never holds more than the budget, and
/// the session lives on to say so and to free its space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pydata_threads_writing_between_cells_get_enospc_at_the_disk_budget() {
    const BUDGET: u64 = 256 << 20;
    let budget = BUDGET.to_string();
    let Some(d) = daemon(&[
        ("SANDCELL_MAX_SESSION_FILES_BYTES", budget.as_str()),
        ("SANDCELL_MAX_FILE_BYTES", budget.as_str()),
    ]) else {
        return;
    };
    let mut c = d.client().await;
    let s = open(&mut c).await;
    let dir = d.dir.path().join("state/sessions").join(&s);
    // Four writers of 4 MiB files, 1.6 GiB in all if nothing stops them, after the cell ends.
    let out = cell(
        &mut c,
        &s,
        "import threading, time\nerrs = []\ndef w(t):\n    time.sleep(0.3)\n    try:\n        for i in range(100):\n            with open(f'fill{t}-{i}.bin', 'wb') as f:\n                for _ in range(4):\n                    f.write(b'x' * (1 << 20))\n    except OSError as e:\n        errs.append(e.errno)\nts = [threading.Thread(target=w, args=(t,), daemon=True) for t in range(4)]\nfor t in ts:\n    t.start()\nprint('started')",
    )
    .await;
    assert_eq!(out.stdout, "started\n", "{:?} {}", out.result, out.stderr);
    assert_eq!(out.result.state, State::Kept, "{:?}", out.result);
    // Sample what reaches the directory while the threads write.
    let t0 = Instant::now();
    let mut peak = 0u64;
    while t0.elapsed() < Duration::from_secs(4) {
        peak = peak.max(charged(&dir));
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!(
        "four idle writers: peak {} MiB observed in the session directory (budget {} MiB)",
        peak >> 20,
        BUDGET >> 20
    );
    assert!(
        peak <= BUDGET,
        "{peak} bytes reached the directory, over the budget {BUDGET}"
    );
    // Every thread met ENOSPC (28); the session lives on and can free its space.
    let out = cell(
        &mut c,
        &s,
        "for t in ts:\n    t.join(10)\nprint(sorted(set(errs)), len(errs))\nimport glob, os\nfor f in glob.glob('fill*'):\n    os.remove(f)\nopen('after.txt', 'w').write('ok')\nprint(open('after.txt').read())",
    )
    .await;
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{:?} {}",
        out.result,
        out.stderr
    );
    assert_eq!(out.stdout, "[28] 4\nok\n", "{:?}", out.result);
    assert!(!out.result.session_ended);
    assert!(d.child_alive());
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// `import sklearn` (joblib imports psutil, which reads the first line of /proc/stat at
/// import) prints nothing: the worker's /proc/stat is a synthesized copy with the host's
/// fields and zero counters, so no other tenant's CPU use shows through it.
#[tokio::test]
async fn importing_sklearn_prints_nothing_and_proc_stat_shows_no_host_activity() {
    let Some(d) = daemon(&[]) else { return };
    if common::insecure() {
        return;
    }
    let mut c = d.client().await;
    let s = open(&mut c).await;
    let out = cell(&mut c, &s, "import sklearn, psutil\nprint('imported')").await;
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.stdout, "imported\n");
    assert_eq!(out.stderr, "", "import sklearn wrote on stderr");
    let out = cell(
        &mut c,
        &s,
        "first = open('/proc/stat').readline().split()\nprint(first[0], set(first[1:]), len(first) > 8)\nimport psutil\nprint(psutil.cpu_times().user)",
    )
    .await;
    assert_eq!(out.stdout, "cpu {'0'} True\n0.0\n", "{:?}", out.result);
    // Other processes' /proc stays closed.
    let out = cell(
        &mut c,
        &s,
        "import os\nprint(os.path.exists('/proc/1/stat'), os.path.exists('/proc/self/stat'))",
    )
    .await;
    assert_eq!(out.stdout, "False True\n", "{:?}", out.result);
}

/// Every engine works in /mnt/data, as OpenAI's code_interpreter does: getcwd shows that
/// path (not the daemon's state directory) and a listing of it holds the cell's files only
/// (no scratch entry of the worker's).
#[tokio::test]
async fn every_engine_works_in_mnt_data() {
    let with_r = common::r_available();
    let languages = if with_r { "python,r" } else { "python" };
    let Some(d) = daemon(&[("SANDCELL_LANGUAGES", languages)]) else {
        return;
    };
    if common::insecure() {
        return;
    }
    let mut c = d.client().await;
    let py = "import os\nopen('mine.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))";
    for env in ["pydata", "python"] {
        // The native engines' scratch directory (TMPDIR) is beside /mnt/data, not in it.
        let want = "/mnt/data\n['mine.txt']\n";
        let s = c
            .open_in("python", Some(env), None, None)
            .await
            .unwrap()
            .session;
        let out = cell(&mut c, &s, py).await;
        assert_eq!(out.stdout, want, "{env}: {:?}", out.result);
        c.close(&s).await.unwrap();
    }
    if with_r {
        let s = c.open_in("r", None, None, None).await.unwrap().session;
        let out = cell(
            &mut c,
            &s,
            "writeLines('x', 'mine.txt'); cat(getwd(), '\\n'); cat(list.files(all.files = TRUE, no.. = TRUE), '\\n')",
        )
        .await;
        assert_eq!(out.stdout, "/mnt/data \nmine.txt \n", "r: {:?}", out.result);
        // R's tempdir() works, and a temporary file can be renamed into place.
        let out = cell(
            &mut c,
            &s,
            "f <- tempfile(); writeLines('t', f); stopifnot(file.rename(f, 'moved.txt')); cat(readLines('moved.txt'))",
        )
        .await;
        assert_eq!(out.stdout, "t", "r: {:?}", out.result);
        c.close(&s).await.unwrap();
    } else {
        sandcell_testing::skip_part!(
            "r",
            "R is not installed: its working directory is not checked"
        );
    }
}

/// Names in a cell's report of changed files, sorted.
fn reported(out: &Collected) -> Vec<String> {
    let mut names: Vec<String> = out.result.files.iter().map(|f| f.name.clone()).collect();
    names.sort();
    names
}

/// Names `ListFiles` gives, sorted.
async fn listed(c: &mut Client, s: &str) -> Vec<String> {
    let (files, truncated) = c.list_files(s).await.unwrap();
    assert!(!truncated);
    let mut names: Vec<String> = files.into_iter().map(|f| f.name).collect();
    names.sort();
    names
}

/// The native engines' scratch (TMPDIR: Python's tempfile, R's tempdir()) is beside the
/// user's files, on the same mount: a temporary file is renamed into /mnt/data, and neither
/// the cell's own listing, the cell's report of new files, `ListFiles` nor `GetFile` sees the
/// scratch. Nothing in the cell's environment or working directory names the daemon's state
/// directory.
#[tokio::test]
async fn the_scratch_is_beside_the_files_not_among_them() {
    let with_r = common::r_available();
    let languages = if with_r { "python,r" } else { "python" };
    let Some(d) = daemon(&[("SANDCELL_LANGUAGES", languages)]) else {
        return;
    };
    if common::insecure() {
        eprintln!("skipped: no mount namespace without confinement, so no /mnt/data view");
        return;
    }
    let mut c = d.client().await;
    let s = open(&mut c).await;
    let py = "import os, tempfile\n\
              fd, p = tempfile.mkstemp(); os.write(fd, b'moved'); os.close(fd)\n\
              keep = tempfile.NamedTemporaryFile(delete=False); keep.write(b'x'); keep.close()\n\
              d = tempfile.mkdtemp(); open(os.path.join(d, 'inner'), 'w').write('i')\n\
              open('/mnt/data/user.txt', 'w').write('u')\n\
              os.rename(p, '/mnt/data/moved.txt')\n\
              print(tempfile.gettempdir())\n\
              print(sorted(os.listdir('/mnt/data')), sorted(os.listdir('.')))\n\
              print([k for k, v in os.environ.items() if '/sessions/' in v] + \
                    [os.getcwd()] * ('/sessions/' in os.getcwd()))";
    let out = cell(&mut c, &s, py).await;
    assert_eq!(
        out.stdout, "/mnt/tmp\n['moved.txt', 'user.txt'] ['moved.txt', 'user.txt']\n[]\n",
        "{:?}",
        out.result
    );
    assert_eq!(reported(&out), ["moved.txt", "user.txt"]);
    assert_eq!(listed(&mut c, &s).await, ["moved.txt", "user.txt"]);
    let mut back = Vec::new();
    c.get_file(&s, "moved.txt", &mut back).await.unwrap();
    assert_eq!(back, b"moved");
    // The scratch is not reachable by name through the files API either.
    assert!(c.get_file(&s, "../tmp", &mut Vec::new()).await.is_err());
    c.close(&s).await.unwrap();
    if !with_r {
        sandcell_testing::skip_part!("r", "R is not installed: its scratch is not checked");
        return;
    }
    let s = c.open_in("r", None, None, None).await.unwrap().session;
    let out = cell(
        &mut c,
        &s,
        "f <- tempfile(); writeLines('moved', f); dir.create(file.path(tempdir(), 'sub')); \
         writeLines('u', '/mnt/data/user.txt'); stopifnot(file.rename(f, '/mnt/data/moved.txt')); \
         cat(dirname(tempdir()), '\\n'); cat(list.files('/mnt/data', all.files = TRUE, no.. = TRUE), '\\n'); \
         cat(list.files(all.files = TRUE, no.. = TRUE), '\\n'); \
         e <- Sys.getenv(); cat(sum(grepl('/sessions/', e)) + grepl('/sessions/', getwd()), '\\n')",
    )
    .await;
    assert_eq!(
        out.stdout, "/mnt/tmp \nmoved.txt user.txt \nmoved.txt user.txt \n0 \n",
        "r: {:?}",
        out.result
    );
    assert_eq!(reported(&out), ["moved.txt", "user.txt"]);
    assert_eq!(listed(&mut c, &s).await, ["moved.txt", "user.txt"]);
    c.close(&s).await.unwrap();
}
