//! sandcellctl as a user meets it: the built binary against a real sandcelld (started here on
//! a private socket with the built workers, as root), its messages, exit statuses and
//! signals; terminal-specific behaviour on a pseudo-terminal.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The built sandcellctl.
fn ctl() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandcellctl"))
}

/// The directory of the built binaries (sandcelld and the workers sit beside sandcellctl).
fn bin_dir() -> PathBuf {
    ctl().parent().unwrap().to_owned()
}

/// A sandcelld on a private socket; stopped (SIGTERM, then SIGKILL) when dropped.
struct Daemon {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts one with extra `SANDCELL_*` settings, or `None` (having said why on stderr)
    /// when this machine cannot run it: not root, or the workspace's binaries not built.
    fn start(env: &[(&str, &str)]) -> Option<Daemon> {
        if !sandcell_testing::is_root() {
            sandcell_testing::skipped(
                "root",
                "cli",
                "sandcelld runs as root here (cgroups, per-session uids)",
            );
            return None;
        }
        let daemon = bin_dir().join("sandcelld");
        if !daemon.exists() {
            sandcell_testing::skipped(
                "built",
                "cli",
                &format!(
                    "{} is not built (cargo build --workspace --bins)",
                    daemon.display()
                ),
            );
            return None;
        }
        let runtime = std::env::var_os("SANDCELL_TEST_PYTHON_RUNTIME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/tmp/sandcell-cache/python-runtime"));
        let dir = tempfile::Builder::new()
            .prefix("sandcell-cli-test-")
            .tempdir_in("/var/tmp")
            .unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        let socket = dir.path().join("kernel.sock");
        let log = dir.path().join("daemon.log");
        std::fs::write(dir.path().join("none.toml"), "").unwrap();
        // The temporary directory's random suffix also names this daemon's cgroup.
        let tag = dir.path().file_name().unwrap().to_string_lossy()["sandcell-cli-test-".len()..]
            .to_string();
        let mut cmd = Command::new(&daemon);
        cmd.arg("--listen")
            .arg(&socket)
            .arg("--config")
            .arg(dir.path().join("none.toml"))
            .env("SANDCELL_WORKER_DIR", bin_dir())
            .env("SANDCELL_PYTHON_RUNTIME_DIR", &runtime)
            .env("SANDCELL_STATE_DIR", dir.path().join("state"))
            .env("SANDCELL_CGROUP_NAME", format!("sandcell-cli-test-{tag}"))
            .env("SANDCELL_LANGUAGES", "python")
            .env("SANDCELL_LOG", "info")
            .env("SANDCELL_NODE_ID", "")
            .env("SANDCELL_METRICS_FILE", "")
            .env("SANDCELL_ADOPT_DIR", dir.path().join("adopt"))
            .env("SANDCELL_MAX_CONCURRENT_SESSIONS", "6")
            .env(
                "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES",
                (6u64 << 27).to_string(),
            )
            .env(
                "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES",
                (6u64 << 30).to_string(),
            );
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut d = Daemon {
            child: cmd.spawn().expect("starting sandcelld"),
            socket,
            log,
            _dir: dir,
        };
        let t0 = Instant::now();
        while !d.log_text().contains("ready to serve") {
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("sandcelld exited ({st}):\n{}", d.log_text());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "sandcelld not ready after 120 s:\n{}",
                d.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(d)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// sandcellctl with `--socket` of this daemon and `args`.
    fn ctl(&self) -> Command {
        let mut c = Command::new(ctl());
        c.arg("--socket").arg(&self.socket);
        c
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cmd` to its end with `input` on standard input (nothing when `None`).
fn run(cmd: &mut Command, input: Option<&str>) -> Output {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("starting sandcellctl");
    if let Some(text) = input {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A file in a fresh temporary directory holding `content`.
fn script(dir: &Path, name: &str, content: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

#[test]
fn a_missing_code_file_is_named_before_connecting() {
    // No daemon: the file is looked at first, so the socket's absence never shows.
    let out = run(
        Command::new(ctl())
            .args(["--socket", "/nonexistent/kernel.sock", "run"])
            .arg("no-such-script.py"),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(
        err,
        "sandcellctl: cannot read the code file no-such-script.py: No such file or directory\n"
    );
    let out = run(
        Command::new(ctl()).args([
            "--socket",
            "/nonexistent/kernel.sock",
            "put",
            "0123",
            "no-such-data.csv",
        ]),
        None,
    );
    assert!(
        text(&out.stderr).contains("cannot upload no-such-data.csv: No such file or directory"),
        "{}",
        text(&out.stderr)
    );
    // With --json, the error is one JSON object.
    let out = run(
        Command::new(ctl())
            .args(["--json", "--socket", "/nonexistent/kernel.sock", "run"])
            .arg("no-such-script.py"),
        None,
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stderr).expect("a JSON error");
    assert_eq!(v["error"], "sandcell.client.FileError");
    assert!(v["message"].as_str().unwrap().contains("no-such-script.py"));
}

#[test]
fn an_unreachable_socket_is_one_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let code = script(dir.path(), "a.py", "print(1)\n");
    let out = run(
        Command::new(ctl())
            .args(["--socket", "/nonexistent/kernel.sock", "run"])
            .arg(&code),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with(
            "sandcellctl: cannot reach sandcelld at /nonexistent/kernel.sock: No such file or \
             directory (no socket there"
        ),
        "{err}"
    );
    assert!(
        !err.contains("os error") && !err.contains("varlink:"),
        "{err}"
    );
}

#[test]
fn a_usage_error_under_json_is_one_json_object() {
    let out = run(
        Command::new(ctl()).args(["--json", "run", "--bogus", "f.py"]),
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    let v: serde_json::Value = serde_json::from_str(err.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {err}"));
    assert_eq!(v["error"], "sandcell.client.Usage", "{v}");
    assert!(v["message"].as_str().unwrap().contains("--bogus"), "{v}");
    // Without --json: clap's own message, same status.
    let out = run(Command::new(ctl()).args(["run", "--bogus", "f.py"]), None);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).starts_with("error: "),
        "{}",
        text(&out.stderr)
    );
    // --help is help, with or without --json.
    let out = run(Command::new(ctl()).args(["--json", "--help"]), None);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("Usage"));
}

#[test]
fn refusals_read_as_sentences_and_as_json_with_json() {
    let Some(d) = Daemon::start(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let code = script(dir.path(), "a.py", "print(1)\n");
    let out = run(
        d.ctl().args(["run", "--wall-time", "100000"]).arg(&code),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.starts_with(
            "sandcellctl: LimitExceeded: wall_time_seconds exceeded: 100000 s asked, at most "
        ) && err.contains("execution_wall_time_seconds")
            && !err.contains('{'),
        "{err}"
    );
    let out = run(
        d.ctl()
            .args(["--json", "run", "--wall-time", "100000"])
            .arg(&code),
        None,
    );
    assert_eq!(out.status.code(), Some(3));
    let v: serde_json::Value = serde_json::from_slice(&out.stderr).expect("a JSON error");
    assert_eq!(v["error"], "org.sandcell.Kernel.LimitExceeded");
    assert_eq!(v["parameters"]["limit"], "wall_time_seconds");
    assert!(v["message"].as_str().unwrap().contains("exceeded"));
}

/// Code over the protocol's bound on one call (4 MiB of JSON) is refused before anything is
/// sent, as a `LimitExceeded` naming `max_message_bytes`: sent, the daemon would end the
/// connection unanswered, which reads as a restart of the daemon.
#[test]
fn a_call_over_the_message_bound_is_refused_before_it_is_sent() {
    let Some(d) = Daemon::start(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let big = script(
        dir.path(),
        "big.py",
        &format!("# {}\nprint(1)\n", "x".repeat(5 << 20)),
    );
    let out = run(d.ctl().arg("run").arg(&big), None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.starts_with("sandcellctl: LimitExceeded: max_message_bytes exceeded: ")
            && err.contains("nothing was sent")
            && !err.contains("restarted"),
        "{err}"
    );
    // The connection was never cut: the daemon answers the next call as before.
    let small = script(dir.path(), "a.py", "print(1)\n");
    let out = run(d.ctl().arg("run").arg(&small), None);
    assert_eq!(text(&out.stdout), "1\n", "{}", text(&out.stderr));
}

/// Opens a detached session with `sandcellctl open`; returns its id.
fn open_session(d: &Daemon) -> String {
    let out = run(d.ctl().args(["open", "--idle", "120"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout).trim().to_owned()
}

/// Starts `sandcellctl exec SESSION FILE` and waits until its standard output has a line
/// (the cell's first print); returns the child and that line.
fn exec_started(d: &Daemon, session: &str, file: &Path) -> (Child, String) {
    let mut child = d
        .ctl()
        .args(["exec", session])
        .arg(file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\n") {
        assert_eq!(
            out.read(&mut b).unwrap(),
            1,
            "sandcellctl exec printed nothing"
        );
        line.push(b[0]);
    }
    (child, text(&line))
}

fn sigint(child: &Child) {
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
}

/// Waits up to `limit` for `child` to exit; returns its status and standard error.
fn wait_for(child: &mut Child, limit: Duration) -> (Option<i32>, String) {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (st.code(), err);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sandcellctl did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ctrl_c_interrupts_the_cell_and_frees_the_session() {
    let Some(d) = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let session = open_session(&d);
    let slow = script(
        dir.path(),
        "slow.py",
        "import time\nprint('started', flush=True)\ntime.sleep(50)\n",
    );
    let (mut child, line) = exec_started(&d, &session, &slow);
    assert_eq!(line, "started\n");
    let t0 = Instant::now();
    sigint(&child);
    let (code, err) = wait_for(&mut child, Duration::from_secs(20));
    assert_eq!(code, Some(5), "interrupted is exit status 5; stderr: {err}");
    assert!(err.contains("sandcellctl: interrupting cell "), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(15));
    // The session is free at once: no SessionBusy for the next cell.
    let quick = script(dir.path(), "quick.py", "print('next')\n");
    let out = run(d.ctl().args(["exec", &session]).arg(&quick), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "next\n");
    let _ = run(d.ctl().args(["close", &session]), None);
}

#[test]
fn a_second_ctrl_c_detaches() {
    // A cell that ignores interrupts: native CPython (pydata) raises KeyboardInterrupt for
    // each of the daemon's repeated SIGINTs, and the cell catches them.
    let pydata = Command::new("/usr/bin/python3")
        .args(["-I", "-c", "import numpy, pandas"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !pydata {
        sandcell_testing::skip!(
            "pydata",
            "a cell that catches KeyboardInterrupt needs pydata"
        );
    }
    let Some(d) = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        d.ctl()
            .args(["open", "--idle", "120", "--environment", "pydata"]),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = text(&out.stdout).trim().to_owned();
    let stubborn = script(
        dir.path(),
        "stubborn.py",
        "import time\nprint('started', flush=True)\nwhile True:\n    try:\n        \
         time.sleep(50)\n    except KeyboardInterrupt:\n        pass\n",
    );
    let (mut child, _) = exec_started(&d, &session, &stubborn);
    sigint(&child);
    std::thread::sleep(Duration::from_millis(1500));
    if let Some(st) = child.try_wait().unwrap() {
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        panic!("the first Ctrl-C ended sandcellctl ({st}) while the cell ran: {err}");
    }
    let t0 = Instant::now();
    sigint(&child);
    let (code, err) = wait_for(&mut child, Duration::from_secs(5));
    assert_eq!(code, Some(130), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(err.contains("sandcellctl: detached"), "{err}");
    let _ = run(d.ctl().args(["close", &session]), None);
}

/// Runs `cmd` with standard output a pipe whose reading end is already closed (every write
/// fails with EPIPE); returns the exit status and standard error.
fn with_closed_stdout(cmd: &mut Command) -> (Option<i32>, String) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills fds with two new descriptors on success.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fresh descriptors, owned from here on.
    let (r, w) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    drop(r);
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(w))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (out.status.code(), text(&out.stderr))
}

#[test]
fn completions_for_bash_zsh_and_fish() {
    for (shell, mark) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef sandcellctl"),
        ("fish", "complete -c sandcellctl"),
    ] {
        let out = run(Command::new(ctl()).args(["completions", shell]), None);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(mark), "{shell}: {script:.200}");
        for sub in ["run", "exec", "environments", "completions"] {
            assert!(script.contains(sub), "{shell} completion lacks {sub}");
        }
    }
}

#[test]
fn a_closed_pipe_never_panics() {
    let (code, err) = with_closed_stdout(Command::new(ctl()).args(["completions", "bash"]));
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let Some(d) = Daemon::start(&[]) else { return };
    let (code, err) = with_closed_stdout(d.ctl().args(["environments", "--packages"]));
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn closing_an_ended_session_is_not_an_error() {
    let Some(d) = Daemon::start(&[]) else { return };
    let session = open_session(&d);
    let out = run(d.ctl().args(["close", &session]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(d.ctl().args(["close", &session]), None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        err,
        format!("sandcellctl: session {session} had already ended (closed); nothing to close\n")
    );
    // With --json the note is an object on standard output, and standard error stays empty.
    let out = run(d.ctl().args(["--json", "close", &session]), None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
    let v: serde_json::Value = serde_json::from_str(&text(&out.stdout)).unwrap();
    assert_eq!(v["session"], session.as_str());
    assert_eq!(v["already_ended"], true);
    assert_eq!(v["reason"], "closed");
}

/// A new pseudo-terminal: its master and slave ends.
fn openpty() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills the two descriptors; the name, termios and winsize are unused.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: fresh descriptors, owned from here on.
    unsafe {
        (
            std::fs::File::from_raw_fd(master),
            std::fs::File::from_raw_fd(slave),
        )
    }
}

/// Runs `cmd` with standard error on a new pseudo-terminal (standard output a pipe);
/// returns what the terminal received.
fn stderr_on_pty(cmd: &mut Command) -> String {
    let (mut master, slave) = openpty();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(slave))
        .spawn()
        .unwrap();
    // Drop the command's copy of the slave end: once the child exits, reads end with EIO.
    cmd.stderr(Stdio::null());
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match master.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    child.wait().unwrap();
    text(&got)
}

#[test]
fn own_messages_escape_cell_text_alike_on_a_terminal_and_a_pipe() {
    let Some(d) = Daemon::start(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let code = script(
        dir.path(),
        "raise.py",
        "raise ValueError('\\x1b]0;pwned\\x07\\x1b[31mred')\n",
    );
    let piped = run(d.ctl().arg("run").arg(&code), None);
    let piped = text(&piped.stderr);
    let on_tty = stderr_on_pty(d.ctl().arg("run").arg(&code));
    for (how, err) in [("pipe", &piped), ("terminal", &on_tty)] {
        let line = err
            .lines()
            .find(|l| l.starts_with("sandcellctl: cell "))
            .unwrap_or_else(|| panic!("{how}: no summary line in {err:?}"));
        assert!(!line.contains('\x1b'), "{how}: raw escape in {line:?}");
        assert!(
            line.contains("ValueError: \\x1b]0;pwned\\x07\\x1b[31mred"),
            "{how}: {line:?}"
        );
        assert!(!err.contains('\x1b'), "{how}: raw escape in {err:?}");
    }
}

#[test]
fn run_put_uploads_inputs_so_the_pydata_examples_run_as_written() {
    let pydata = Command::new("/usr/bin/python3")
        .args([
            "-I",
            "-c",
            "import numpy, pandas, scipy, matplotlib, statsmodels",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !pydata {
        sandcell_testing::skip!(
            "pydata",
            "the pydata examples need Debian's scientific stack"
        );
    }
    let Some(d) = Daemon::start(&[]) else { return };
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pydata");
    let mut ran = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("py") {
            continue;
        }
        let expected = std::fs::read_to_string(path.with_extension("out")).unwrap();
        let out = run(
            d.ctl()
                .args(["run", "--environment", "pydata", "--put"])
                .arg(examples.join("mtcars.csv"))
                .arg("--put")
                .arg(format!(
                    "{}:sleep.csv",
                    examples.join("sleep.csv").display()
                ))
                .arg(&path),
            None,
        );
        let err = text(&out.stderr);
        assert!(out.status.success(), "{}: {err}", path.display());
        assert_eq!(text(&out.stdout), expected, "{}: {err}", path.display());
        ran += 1;
    }
    assert_eq!(ran, 5, "the five pydata examples");
    // A missing input is named before connecting.
    let out = run(
        d.ctl()
            .args(["run", "--put", "no-such.csv"])
            .arg(examples.join("pandas_groupby.py")),
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot upload no-such.csv: No such file or directory"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_missing_module_names_the_environment_that_has_it() {
    let pydata = Command::new("/usr/bin/python3")
        .args(["-I", "-c", "import numpy, pandas"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !pydata {
        sandcell_testing::skip!("pydata", "the hint names the pydata environment");
    }
    let Some(d) = Daemon::start(&[]) else { return };
    let out = run(d.ctl().args(["run", "-"]), Some("import pandas\n"));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "sandcellctl: hint: pandas is not installed in this environment; environment \
             pydata has it (sandcellctl run -e pydata)"
        ),
        "{err}"
    );
}

#[test]
fn a_host_call_without_a_handler_fails_at_once() {
    let Some(d) = Daemon::start(&[]) else { return };
    let out = run(
        d.ctl().args(["open", "--idle", "120", "--host-calls"]),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = text(&out.stdout).trim().to_owned();
    let t0 = Instant::now();
    let out = run(
        d.ctl().args(["exec", &session, "-"]),
        Some("from sandcell import host\nhost.call('tool', {'a': 1})\n"),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "waited {:?}",
        t0.elapsed()
    );
    assert!(err.contains("no handler for host calls"), "{err}");
    let _ = run(d.ctl().args(["close", &session]), None);
}

#[test]
fn exec_names_its_cell_and_interrupt_and_list_need_no_bus() {
    let Some(d) = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let session = open_session(&d);
    // One's own sessions over the socket, without D-Bus.
    let out = run(d.ctl().args(["--json", "list", "--own"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["sessions"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|r| r["session"] == session.as_str() && r["state"] == "idle"),
        "{v}"
    );
    // A cell number the session never reached is NoSuchCell.
    let out = run(d.ctl().args(["interrupt", &session, "7"]), None);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("NoSuchCell"),
        "{}",
        text(&out.stderr)
    );
    let slow = script(
        dir.path(),
        "slow.py",
        "import time\nprint('started', flush=True)\ntime.sleep(50)\n",
    );
    let (mut child, line) = exec_started(&d, &session, &slow);
    assert_eq!(line, "started\n");
    let out = run(d.ctl().args(["list", "--own"]), None);
    let listing = text(&out.stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with(&session) && l.contains("running")),
        "{listing}"
    );
    // Interrupted without its number, over the socket.
    let out = run(d.ctl().args(["interrupt", &session]), None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "delivered (cell 1)\n");
    let (code, err) = wait_for(&mut child, Duration::from_secs(20));
    assert_eq!(code, Some(5), "{err}");
    // exec said which cell it started, and how to interrupt it.
    assert!(
        err.contains(&format!(
            "sandcellctl: cell 1 started; interrupt it with: sandcellctl interrupt {session} 1"
        )),
        "{err}"
    );
    let out = run(d.ctl().args(["--json", "interrupt", &session]), None);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["reason"], "not_running", "{v}");
    // Without --json: the bare reason on standard output for scripts, a sentence on standard
    // error for people.
    let out = run(d.ctl().args(["interrupt", &session, "1"]), None);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "not_running\n");
    assert!(
        text(&out.stderr).contains("sandcellctl: not interrupted: cell 1 of session")
            && text(&out.stderr).contains("is not running"),
        "{}",
        text(&out.stderr)
    );
    let _ = run(d.ctl().args(["close", &session]), None);
}

#[test]
fn a_silent_cell_shows_its_elapsed_time_on_a_terminal_only() {
    let Some(d) = Daemon::start(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let quiet = script(
        dir.path(),
        "quiet.py",
        "import time\ntime.sleep(4)\nprint('done')\n",
    );
    let on_tty = stderr_on_pty(d.ctl().arg("run").arg(&quiet));
    assert!(
        on_tty.contains("\r\x1b[2Ksandcellctl: cell 1 running, ") && on_tty.contains(" s"),
        "no elapsed time on the terminal: {on_tty:?}"
    );
    // Erased before anything else is written, and at the end.
    assert!(on_tty.ends_with("\r\x1b[2K"), "{on_tty:?}");
    let piped = run(d.ctl().arg("run").arg(&quiet), None);
    assert_eq!(text(&piped.stdout), "done\n");
    assert_eq!(text(&piped.stderr), "", "a pipe gets no elapsed time");
    // A cell that prints keeps its output clean.
    let chatty = script(dir.path(), "chatty.py", "print('quick')\n");
    let on_tty = stderr_on_pty(d.ctl().arg("run").arg(&chatty));
    assert!(!on_tty.contains("running"), "{on_tty:?}");
}

#[test]
fn environments_state_the_default_limits_with_their_keys() {
    let Some(d) = Daemon::start(&[]) else { return };
    let out = run(d.ctl().arg("environments"), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    for want in [
        "per cell: wall time 10 s [execution_wall_time_seconds]",
        "fuel 10000000000 WebAssembly instructions [max_fuel]",
        "per session: memory 1.0 GiB [max_worker_memory_bytes]",
        "disk 256.0 MiB [max_session_files_bytes]",
    ] {
        assert!(o.contains(want), "{want:?} missing in:\n{o}");
    }
    let out = run(d.ctl().args(["--json", "environments"]), None);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let py = v
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "python")
        .expect("python listed");
    assert_eq!(py["limits"]["wall_time_seconds"], 10.0, "{py}");
    assert_eq!(py["limits"]["fuel"], 10_000_000_000u64, "{py}");
}

/// Whether Debian's R is installed (the R worker's interpreter); says why not on stderr.
fn has_r(test: &str) -> bool {
    let ok = Path::new("/usr/lib/R/bin/exec/R").exists();
    if !ok {
        sandcell_testing::skipped("r", test, "R is not installed (/usr/lib/R)");
    }
    ok
}

#[test]
fn an_environment_implies_its_language() {
    if !has_r("an_environment_implies_its_language") {
        return;
    }
    let Some(d) = Daemon::start(&[("SANDCELL_LANGUAGES", "python,r")]) else {
        return;
    };
    let r_code = "cat(sprintf('%d from %s\\n', 6L * 7L, R.version$language))\n";
    // From standard input, no extension to go by: the environment's language.
    let out = run(d.ctl().args(["run", "-e", "r", "-"]), Some(r_code));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "42 from R\n");
    // The environment wins over a file name's extension, too.
    let dir = tempfile::tempdir().unwrap();
    let named_py = script(dir.path(), "analysis.py", r_code);
    let out = run(d.ctl().args(["run", "-e", "r"]).arg(&named_py), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "42 from R\n");
    // A session opened with an environment only.
    let out = run(d.ctl().args(["open", "--idle", "60", "-e", "r"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = text(&out.stdout).trim().to_owned();
    let out = run(d.ctl().args(["exec", &session, "-"]), Some(r_code));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "42 from R\n");
    let _ = run(d.ctl().args(["close", &session]), None);
    // An explicit language still wins, and a contradiction is the daemon's to refuse.
    let out = run(
        d.ctl().args(["run", "-l", "python", "-e", "r", "-"]),
        Some(r_code),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.starts_with("sandcellctl: EnvironmentMismatch: "),
        "{err}"
    );
    // An unknown environment is named by the daemon, with the ones it serves.
    let out = run(d.ctl().args(["run", "-e", "no-such-env", "-"]), Some("1\n"));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.starts_with("sandcellctl: NoSuchEnvironment: ") && err.contains("no-such-env"),
        "{err}"
    );
}

/// Starts `cmd` in a new session whose controlling terminal is a new pseudo-terminal (its
/// standard input; standard output and error are pipes); returns the child and the
/// terminal's master end, where writing `\x03` is the user's Ctrl-C: the terminal sends
/// SIGINT to its foreground process group, sandcellctl's.
fn spawn_on_pty(cmd: &mut Command) -> (Child, std::fs::File) {
    use std::os::unix::process::CommandExt;
    let (master, slave) = openpty();
    // SAFETY: setsid and ioctl are async-signal-safe; the child makes standard input (the
    // terminal) its controlling terminal, with its own process group in the foreground.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .stdin(Stdio::from(slave))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    cmd.stdin(Stdio::null());
    (child, master)
}

/// Reads `child`'s standard output up to its first newline.
fn first_line(child: &mut Child) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\n") {
        assert_eq!(out.read(&mut b).unwrap(), 1, "sandcellctl printed nothing");
        line.push(b[0]);
    }
    text(&line)
}

/// The caller's sessions over the socket (`list --own --json`): `(id, state)` pairs.
fn own_sessions(d: &Daemon) -> Vec<(String, String)> {
    let out = run(d.ctl().args(["--json", "list", "--own"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["session"].as_str().unwrap().to_owned(),
                s["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Whether the daemon lists environment `name` as ready (`environments --json`).
fn environment_ready(d: &Daemon, name: &str) -> bool {
    let out = run(d.ctl().args(["--json", "environments"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == name && e["ready"] == true)
}

/// A Python cell that prints `started` and then catches every KeyboardInterrupt (native
/// CPython raises one for each of the daemon's SIGINTs): only ending its session stops it.
const STUBBORN: &str = "import time\nprint('started', flush=True)\nwhile True:\n    try:\n        \
                        time.sleep(50)\n    except KeyboardInterrupt:\n        pass\n";

/// Ctrl-C on `tty` once, checks that sandcellctl (`child`) follows on, Ctrl-C again; returns
/// the exit status and standard error.
fn ctrl_c_twice(child: &mut Child, tty: &mut std::fs::File) -> (Option<i32>, String) {
    tty.write_all(b"\x03").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first Ctrl-C ended sandcellctl"
    );
    tty.write_all(b"\x03").unwrap();
    wait_for(child, Duration::from_secs(5))
}

#[test]
fn a_second_ctrl_c_says_what_becomes_of_the_cell() {
    let Some(d) = Daemon::start(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")]) else {
        return;
    };
    if !environment_ready(&d, "pydata") {
        sandcell_testing::skip!(
            "pydata",
            "a cell that catches KeyboardInterrupt needs the pydata environment"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let stubborn = script(dir.path(), "stubborn.py", STUBBORN);

    // A one-shot run: its session is the connection's, so the second Ctrl-C ends it.
    let (mut child, mut tty) = spawn_on_pty(d.ctl().args(["run", "-e", "pydata"]).arg(&stubborn));
    assert_eq!(first_line(&mut child), "started\n");
    let sessions = own_sessions(&d);
    assert!(
        sessions.iter().any(|(_, state)| state == "running"),
        "{sessions:?}"
    );
    let (code, err) = ctrl_c_twice(&mut child, &mut tty);
    assert_eq!(code, Some(130), "{err}");
    assert!(err.contains("(Ctrl-C again to stop it at once)"), "{err}");
    assert!(
        err.contains("sandcellctl: stopped; session ")
            && err.contains(" ends with sandcellctl's connection, and cell 1 with it"),
        "{err}"
    );
    assert!(!err.contains("detached"), "{err}");
    // ... and so it does: the session is gone (soon; the daemon reaps the worker first).
    let t0 = Instant::now();
    while !own_sessions(&d).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the run's session outlived sandcellctl: {:?}",
            own_sessions(&d)
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // exec in a detached session: the second Ctrl-C detaches and the cell runs on.
    let opened = run(d.ctl().args(["open", "-e", "pydata"]), None);
    assert!(opened.status.success(), "{}", text(&opened.stderr));
    let session = text(&opened.stdout).trim().to_owned();
    let (mut child, mut tty) = spawn_on_pty(d.ctl().args(["exec", &session]).arg(&stubborn));
    assert_eq!(first_line(&mut child), "started\n");
    let (code, err) = ctrl_c_twice(&mut child, &mut tty);
    assert_eq!(code, Some(130), "{err}");
    let detached =
        format!("sandcellctl: detached; cell 1 of session {session} runs on without sandcellctl");
    assert!(err.contains(&detached), "{err}");
    assert!(
        err.contains(&format!("sandcellctl attach {session} 1")),
        "{err}"
    );
    let status = run(d.ctl().args(["cell-status", &session, "1"]), None);
    assert_eq!(
        text(&status.stdout),
        "running\n",
        "{}",
        text(&status.stderr)
    );
    let _ = run(d.ctl().args(["close", &session]), None);
}

#[test]
fn without_a_system_bus_the_message_says_what_is_wrong() {
    let no_bus = "unix:path=/nonexistent/system_bus_socket";
    // A D-Bus command: one sentence, no Rust error decoration.
    let out = run(
        Command::new(ctl())
            .env("DBUS_SYSTEM_BUS_ADDRESS", no_bus)
            .arg("status"),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("sandcellctl: cannot reach the system bus: ")
            && err.contains("No such file or directory")
            && !err.contains("os error")
            && !err.contains('`'),
        "{err}"
    );
    let Some(d) = Daemon::start(&[]) else { return };
    // interrupt SESSION: the socket knows no such session and the bus cannot be asked; the
    // socket's answer is the one that helps.
    let out = run(
        d.ctl()
            .env("DBUS_SYSTEM_BUS_ADDRESS", no_bus)
            .args(["interrupt", "no-such-session"]),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.starts_with("sandcellctl: NoSuchSession: "), "{err}");
    let out = run(
        d.ctl().env("DBUS_SYSTEM_BUS_ADDRESS", no_bus).args([
            "--json",
            "interrupt",
            "no-such-session",
        ]),
        None,
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stderr).expect("a JSON error");
    assert_eq!(v["error"], "org.sandcell.Kernel.NoSuchSession", "{v}");
    // Neither the socket nor the bus: the socket is named.
    let out = run(
        Command::new(ctl())
            .env("DBUS_SYSTEM_BUS_ADDRESS", no_bus)
            .args(["--socket", "/nonexistent/kernel.sock", "interrupt", "s1"]),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("sandcellctl: cannot reach sandcelld at /nonexistent/kernel.sock"),
        "{err}"
    );
}

#[test]
fn get_saves_into_a_directory_and_never_shares_its_partial_file() {
    let Some(d) = Daemon::start(&[]) else { return };
    let session = open_session(&d);
    let dir = tempfile::tempdir().unwrap();
    let data = script(dir.path(), "a.csv", "x,y\n1,2\n");
    let out = run(d.ctl().args(["put", &session]).arg(&data), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(
        d.ctl().args(["put", &session]).arg(&data).arg("a.json"),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Into an existing directory, as cp does: NAME's last component there.
    let into = dir.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let out = run(d.ctl().args(["get", &session, "a.csv"]).arg(&into), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(into.join("a.csv")).unwrap(),
        "x,y\n1,2\n"
    );
    // a.csv and a.json fetched at once into one directory: each whole, no partial left.
    std::fs::create_dir(dir.path().join("both")).unwrap();
    let children: Vec<Child> = ["a.csv", "a.json"]
        .iter()
        .map(|name| {
            d.ctl()
                .args(["get", &session, name])
                .arg(dir.path().join("both").join(name))
                .stdin(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("both"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["a.csv", "a.json"]);
    for n in &names {
        assert_eq!(
            std::fs::read_to_string(dir.path().join("both").join(n)).unwrap(),
            "x,y\n1,2\n"
        );
    }
    // A name with no last component needs OUT, and says so before connecting.
    let out = run(
        Command::new(ctl()).args(["--socket", "/nonexistent/kernel.sock", "get", "s1", ".."]),
        None,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(
        err,
        "sandcellctl: cannot download ..: it has no file name to save it as; give OUT\n"
    );
    let _ = run(d.ctl().args(["close", &session]), None);
}
