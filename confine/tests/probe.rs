//! Runs `sandcell-confine-probe` under real plans and checks what the kernel let through.
//!
//! Needs root (to switch identity, unshare and drop capabilities) and a kernel with Landlock
//! ABI >= 6 and seccomp; each test prints why it skips otherwise. The confinement happens in
//! the probe process, never in the test harness.
//!
//! The `*_at_every_level` tests lower the Landlock ABI through the plan's `landlock_abi_cap`
//! (the daemon sets it from its start-up decision) to each level the code distinguishes,
//! down to none (the mount namespace alone), and assert the same walls at each.

use sandcell_confine::{Enforcement, PLAN_ENV, Plan, SyscallProfile};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

const PROBE: &str = env!("CARGO_BIN_EXE_sandcell-confine-probe");
/// An otherwise unused uid/gid for the worker identity.
const WORKER_ID: u32 = 64123;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Returns the tier missing and why, or `None` when the host can run the strict tests.
fn skip_reason() -> Option<(&'static str, String)> {
    if !is_root() {
        return Some(("root", "needs root (identity switch, namespaces)".into()));
    }
    match sandcell_confine::landlock::kernel_abi() {
        Some(abi) if abi >= 6 => None,
        other => Some((
            "landlock",
            format!("needs landlock abi >= 6, kernel has {other:?}"),
        )),
    }
}

macro_rules! require_host {
    () => {
        if let Some((tier, why)) = skip_reason() {
            sandcell_testing::skip!(tier, "{why}");
        }
    };
}

/// A private directory tree for one test: `<dir>/session` owned by the worker, `<dir>` itself
/// world-writable (so a denied write there is Landlock's doing, not file permissions), and a
/// listening pathname unix socket with mode 0777.
struct Fixture {
    dir: PathBuf,
    session: PathBuf,
    socket: PathBuf,
    _listener: std::os::unix::net::UnixListener,
}

impl Fixture {
    fn new() -> Fixture {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sandcell-confine-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("session")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(dir.join("session"), Some(WORKER_ID), Some(WORKER_ID)).unwrap();
        let socket = dir.join("daemon.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
        Fixture {
            session: dir.join("session"),
            dir,
            socket,
            _listener: listener,
        }
    }

    fn plan(&self, profile: SyscallProfile) -> Plan {
        Plan {
            uid: Some(WORKER_ID),
            gid: Some(WORKER_ID),
            session_dir: self.session.clone(),
            // No /proc: enter() must not need it after Landlock.
            read_paths: vec!["/etc/passwd".into()],
            exec_paths: vec!["/usr".into(), "/does-not-exist".into()],
            write_paths: vec!["/dev/null".into()],
            keep_fds: vec![0, 1, 2],
            max_open_files: 64,
            max_file_bytes: 1 << 20,
            max_processes: 4096,
            max_address_space: None,
            new_net_namespace: true,
            new_ipc_namespace: true,
            syscalls: profile,
            enforcement: Enforcement::Strict,
            landlock_abi_cap: None,
            mount_namespace: false,
            tcp_connect_port: None,
            net_namespace_entered: false,
        }
    }

    /// The plan at Landlock level `level` (0: none) with the mount namespace.
    fn level_plan(&self, profile: SyscallProfile, level: i32) -> Plan {
        let mut plan = self.plan(profile);
        plan.landlock_abi_cap = Some(level);
        plan.mount_namespace = true;
        // The dynamic loader's path (/lib64/ld-linux-x86-64.so.2 on x86-64): inside the
        // mount namespace only allowlisted paths exist at all.
        plan.read_paths.extend(["/lib".into(), "/lib64".into()]);
        plan
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one probe run printed and how it ended.
struct Run {
    out: Value,
    status: std::process::ExitStatus,
    stderr: String,
}

impl Run {
    fn check(&self, name: &str, arg: &str) -> &Value {
        self.out["checks"]
            .as_array()
            .unwrap_or_else(|| panic!("no checks in {}\nstderr: {}", self.out, self.stderr))
            .iter()
            .find(|c| c["check"] == name && c["arg"] == arg)
            .unwrap_or_else(|| panic!("no check {name}={arg} in {}", self.out))
    }
    fn allowed(&self, name: &str, arg: &str) -> bool {
        self.check(name, arg)["allowed"].as_bool().unwrap()
    }
    fn errno(&self, name: &str, arg: &str) -> i64 {
        self.check(name, arg)["errno"].as_i64().unwrap()
    }
}

/// Runs the probe with `plan` (or `--no-enter` when `None`) and `checks`. The probe also gets
/// a directory fd of `/etc` at fd 7 without close-on-exec, the kind of leak runc
/// CVE-2024-21626 was about; `enter` must close it.
fn probe(plan: Option<&Plan>, checks: &[&str], run_as: Option<u32>) -> Run {
    let etc = std::fs::File::open("/etc").unwrap();
    let etc_fd = std::os::fd::AsRawFd::as_raw_fd(&etc);
    let mut cmd = Command::new(PROBE);
    match plan {
        Some(p) => {
            cmd.env(PLAN_ENV, serde_json::to_string(p).unwrap());
        }
        None => {
            cmd.arg("--no-enter");
        }
    }
    cmd.args(checks)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(id) = run_as {
        cmd.uid(id).gid(id);
    }
    // SAFETY: dup2 and fcntl are async-signal-safe; the closure touches no Rust state.
    unsafe {
        cmd.pre_exec(move || {
            // dup2(7, 7) would keep close-on-exec: clear the flag instead.
            let rc = if etc_fd == 7 {
                libc::fcntl(7, libc::F_SETFD, 0)
            } else {
                libc::dup2(etc_fd, 7)
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = cmd.output().unwrap();
    drop(etc);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let first = stdout.lines().next().unwrap_or("null");
    Run {
        out: serde_json::from_str(first).unwrap_or(Value::Null),
        status: output.status,
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Spawns `sleep` as `uid` outside any sandbox: a same-uid neighbour the worker must not
/// signal.
fn neighbour(uid: u32) -> std::process::Child {
    Command::new("sleep")
        .arg("60")
        .uid(uid)
        .gid(uid)
        .spawn()
        .unwrap()
}

const HOSTILE: &[&str] = &[
    "ids",
    "caps",
    "nnp",
    "seccomp-mode",
    "proc-status",
    "fds",
    "read=/etc/shadow",
    "read=/etc/hostname",
    "read=/etc/passwd",
    "socket=inet",
    "socket=inet6",
    "socket=unix",
    "socket=netlink",
    "socket=packet",
    "socketpair=stream",
    "socketpair=dgram",
    "ptrace=1",
    "kill=1",
    "unshare",
    "clone-newuser",
    "clone3",
    "mount",
    "bpf",
    "io_uring",
    "userfaultfd",
    "perf",
    "keyctl",
    "personality",
    "tiocsti",
    "chroot",
    "setuid0",
    "thread",
    "mmap-exec",
];

/// Assertions common to both profiles.
fn assert_confined(run: &Run, fx: &Fixture, plan: &Plan) {
    assert!(
        run.status.success(),
        "probe failed: {:?} {}",
        run.status,
        run.stderr
    );
    assert!(run.out["enter_error"].is_null(), "{}", run.out);
    let report = &run.out["report"];
    assert_eq!(report["seccomp"], true);
    assert!(report["landlock_abi"].as_i64().unwrap() >= 6);
    assert_eq!(report["skipped"], serde_json::json!([]));
    assert!(
        report["closed_fds"].as_array().unwrap().contains(&7.into()),
        "the leaked /etc fd was not reported closed: {report}"
    );
    assert_eq!(
        report["missing_paths"],
        serde_json::json!(["/does-not-exist"])
    );

    // Identity.
    let ids = &run.check("ids", "")["detail"];
    let id = u64::from(WORKER_ID);
    assert_eq!(ids["uid"], serde_json::json!([id, id, id]));
    assert_eq!(ids["gid"], serde_json::json!([id, id, id]));
    assert_eq!(ids["groups"], 0);
    // Capabilities, all five sets, by syscall and by /proc/self/status.
    let caps = &run.check("caps", "")["detail"];
    for set in ["eff", "prm", "inh", "bnd", "amb"] {
        assert_eq!(caps[set], 0, "{set} not empty: {caps}");
    }
    let status = &run.check("proc-status", "")["detail"];
    for key in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status[key], "0000000000000000", "{key}: {status}");
    }
    assert_eq!(status["NoNewPrivs"], "1");
    assert_eq!(status["Seccomp"], "2");
    assert_eq!(run.check("nnp", "")["detail"], 1);
    assert_eq!(run.check("seccomp-mode", "")["detail"], 2);
    // Descriptors: only the kept ones.
    assert_eq!(
        run.check("fds", "")["detail"],
        serde_json::json!(plan.keep_fds)
    );

    // Files: /etc/shadow (DAC would refuse too), /etc/hostname (world-readable: only Landlock
    // refuses), /etc/passwd granted.
    assert!(!run.allowed("read", "/etc/shadow"));
    assert!(!run.allowed("read", "/etc/hostname"));
    assert_eq!(run.errno("read", "/etc/hostname"), i64::from(libc::EACCES));
    assert!(run.allowed("read", "/etc/passwd"));
    let outside = fx.dir.join("outside.txt");
    let inside = fx.session.join("inside.txt");
    let outside = outside.to_str().unwrap();
    let inside = inside.to_str().unwrap();
    assert!(
        !run.allowed("write", outside),
        "wrote outside the session dir"
    );
    assert!(!Path::new(outside).exists());
    assert!(run.allowed("write", inside));

    // Network and IPC: no sockets of any family; stream socketpairs only.
    for family in ["inet", "inet6", "unix", "netlink", "packet"] {
        assert!(!run.allowed("socket", family), "socket({family}) allowed");
        assert_eq!(run.errno("socket", family), i64::from(libc::EPERM));
    }
    assert!(run.allowed("socketpair", "stream"));
    assert!(!run.allowed("socketpair", "dgram"));
    let socket = fx.socket.to_str().unwrap();
    assert!(
        !run.allowed("connect-unix", socket),
        "connected to the daemon-like socket"
    );

    // Other processes and kernel surface.
    for (check, arg) in [
        ("ptrace", "1"),
        ("kill", "1"),
        ("unshare", ""),
        ("clone-newuser", ""),
        ("mount", ""),
        ("bpf", ""),
        ("io_uring", ""),
        ("userfaultfd", ""),
        ("perf", ""),
        ("keyctl", ""),
        ("personality", ""),
        ("tiocsti", ""),
        ("chroot", ""),
        ("setuid0", ""),
    ] {
        assert!(!run.allowed(check, arg), "{check} {arg} allowed");
        assert_eq!(run.errno(check, arg), i64::from(libc::EPERM), "{check}");
    }
    assert_eq!(run.errno("clone3", ""), i64::from(libc::ENOSYS));
    // What the engines need.
    assert!(run.allowed("thread", ""));
    assert!(run.allowed("mmap-exec", ""));
}

fn checks_with(extra: &[String]) -> Vec<String> {
    HOSTILE
        .iter()
        .map(|s| s.to_string())
        .chain(extra.iter().cloned())
        .collect()
}

#[test]
fn native_profile_confines_and_allows_fork_exec() {
    require_host!();
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Native);
    plan.read_paths.push("/proc".into()); // for the proc-status check
    let daemon_pid = std::process::id();
    let extra = vec![
        format!("write={}", fx.dir.join("outside.txt").display()),
        format!("write={}", fx.session.join("inside.txt").display()),
        format!("connect-unix={}", fx.socket.display()),
        format!("kill={daemon_pid}"),
        "exec=/nonexistent".into(),
        "spawn=/bin/true".into(),
        "fork".into(),
    ];
    let checks = checks_with(&extra);
    let refs: Vec<&str> = checks.iter().map(String::as_str).collect();
    let run = probe(Some(&plan), &refs, None);
    assert_confined(&run, &fx, &plan);
    assert!(
        !run.allowed("kill", &daemon_pid.to_string()),
        "signalled the daemon"
    );
    // Native: fork and exec work (R's system()); execve of a missing file says ENOENT.
    assert!(run.allowed("fork", ""));
    assert!(
        run.allowed("spawn", "/bin/true"),
        "{}",
        run.check("spawn", "/bin/true")
    );
    assert_eq!(run.errno("exec", "/nonexistent"), i64::from(libc::ENOENT));
}

#[test]
fn wasm_profile_denies_fork_and_exec_but_not_threads() {
    require_host!();
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Wasm);
    plan.read_paths.push("/proc".into()); // for the proc-status check
    let extra = vec![
        format!("write={}", fx.dir.join("outside.txt").display()),
        format!("write={}", fx.session.join("inside.txt").display()),
        format!("connect-unix={}", fx.socket.display()),
        "exec=/nonexistent".into(),
        "spawn=/bin/true".into(),
        "fork".into(),
    ];
    let checks = checks_with(&extra);
    let refs: Vec<&str> = checks.iter().map(String::as_str).collect();
    let run = probe(Some(&plan), &refs, None);
    assert_confined(&run, &fx, &plan);
    assert!(!run.allowed("fork", ""));
    assert!(!run.allowed("spawn", "/bin/true"));
    assert_eq!(run.errno("exec", "/nonexistent"), i64::from(libc::EPERM));
}

#[test]
fn x32_and_foreign_syscalls_kill_the_process() {
    require_host!();
    let fx = Fixture::new();
    for profile in [SyscallProfile::Wasm, SyscallProfile::Native] {
        // The plan has no /proc: also shows enter() completes without it.
        let run = probe(Some(&fx.plan(profile)), &["ids", "fds", "x32"], None);
        assert_eq!(
            run.status.signal(),
            Some(libc::SIGSYS),
            "{profile:?}: the x32 call did not kill the probe: {:?} {}",
            run.status,
            run.out
        );
        // And it was confined up to that point.
        assert_eq!(
            run.check("ids", "")["detail"]["uid"][0],
            u64::from(WORKER_ID)
        );
    }
}

#[test]
fn landlock_signal_scope_protects_same_uid_neighbours() {
    require_host!();
    let fx = Fixture::new();
    let mut sleeper = neighbour(WORKER_ID);
    let target = sleeper.id().to_string();
    let check = format!("kill={target}");
    // Control: the same uid without confinement may signal it, so a denial below is the
    // sandbox's doing.
    let free = probe(None, &[&check], Some(WORKER_ID));
    let confined = probe(Some(&fx.plan(SyscallProfile::Native)), &[&check], None);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(
        free.allowed("kill", &target),
        "control run could not signal: {}",
        free.out
    );
    assert!(
        !confined.allowed("kill", &target),
        "confined worker signalled a neighbour"
    );
    assert_eq!(confined.errno("kill", &target), i64::from(libc::EPERM));
}

#[test]
fn strict_refuses_root_and_missing_identity() {
    require_host!();
    let fx = Fixture::new();
    for (uid, gid) in [
        (Some(0), Some(WORKER_ID)),
        (Some(WORKER_ID), Some(0)),
        (None, None),
    ] {
        let mut plan = fx.plan(SyscallProfile::Native);
        plan.uid = uid;
        plan.gid = gid;
        let run = probe(Some(&plan), &["ids"], None);
        assert_eq!(
            run.status.code(),
            Some(sandcell_confine::EXIT_CONFINE_FAILED)
        );
        let err = run.out["enter_error"].as_str().unwrap();
        assert!(err.contains("non-root uid and gid"), "{err}");
    }
}

#[test]
fn a_missing_kept_fd_or_a_terminal_is_refused() {
    require_host!();
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Native);
    plan.keep_fds = vec![0, 1, 2, 9];
    let run = probe(Some(&plan), &["ids"], None);
    assert_eq!(
        run.status.code(),
        Some(sandcell_confine::EXIT_CONFINE_FAILED)
    );
    assert!(
        run.out["enter_error"]
            .as_str()
            .unwrap()
            .contains("descriptor 9"),
        "{}",
        run.out
    );

    // A pseudo-terminal handed to the worker as stdin.
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two fds into the locals; name/termios/winsize may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0);
    let plan = fx.plan(SyscallProfile::Native);
    let mut cmd = Command::new(PROBE);
    cmd.env(PLAN_ENV, serde_json::to_string(&plan).unwrap())
        .arg("ids")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: dup2 is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(slave, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = cmd.output().unwrap();
    // SAFETY: both fds are ours and closed once.
    unsafe {
        libc::close(master);
        libc::close(slave);
    }
    let out: Value =
        serde_json::from_slice(output.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    assert_eq!(
        output.status.code(),
        Some(sandcell_confine::EXIT_CONFINE_FAILED)
    );
    assert!(
        out["enter_error"].as_str().unwrap().contains("terminal"),
        "{out}"
    );
}

#[test]
fn best_effort_without_root_keeps_landlock_and_seccomp() {
    require_host!();
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Native);
    plan.uid = None;
    plan.gid = None;
    plan.enforcement = Enforcement::BestEffort;
    // Run the probe itself as the unprivileged uid: what a developer's `--insecure-dev` does.
    let run = probe(
        Some(&plan),
        &["ids", "read=/etc/hostname", "socket=inet", "caps"],
        Some(WORKER_ID),
    );
    assert!(
        run.status.success(),
        "{:?} {} {}",
        run.status,
        run.out,
        run.stderr
    );
    let skipped: Vec<String> =
        serde_json::from_value(run.out["report"]["skipped"].clone()).unwrap();
    for layer in ["namespaces", "bounding-caps", "identity"] {
        assert!(
            skipped.iter().any(|s| s.starts_with(layer)),
            "{layer} not in {skipped:?}"
        );
    }
    assert_eq!(run.out["report"]["seccomp"], true);
    assert!(run.out["report"]["landlock_abi"].as_i64().is_some());
    assert!(!run.allowed("read", "/etc/hostname"));
    assert!(!run.allowed("socket", "inet"));
    assert_eq!(run.check("caps", "")["detail"]["eff"], 0);
}

#[test]
fn self_check_reports_a_capable_host() {
    let check = sandcell_confine::self_check().unwrap();
    eprintln!("self_check: {check:?}");
    assert!(check.no_new_privs, "{check:?}");
    assert!(check.seccomp, "{check:?}");
    if skip_reason().is_none() {
        assert!(check.namespaces);
        assert!(check.root);
        assert!(check.problems.is_empty(), "{:?}", check.problems);
        check.require_strict().unwrap();
    } else {
        assert!(!check.problems.is_empty());
        assert!(check.require_strict().is_err());
    }
}

/// Median cost of `enter()` over 50 worker starts, per step and as process wall time, with and
/// without the network namespace. Run with `--ignored --nocapture`.
#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn bench_enter_cost() {
    require_host!();
    let fx = Fixture::new();
    const N: usize = 50;
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let wall = |plan: Option<&Plan>| {
        let mut walls = Vec::new();
        let mut enters = Vec::new();
        let mut steps: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        for _ in 0..N {
            let t = std::time::Instant::now();
            let run = probe(plan, &[], None);
            walls.push(t.elapsed().as_micros() as u64);
            if plan.is_some() {
                enters.push(run.out["enter_micros"].as_u64().unwrap());
                for s in run.out["report"]["steps"].as_array().unwrap() {
                    steps
                        .entry(s["step"].as_str().unwrap().to_string())
                        .or_default()
                        .push(s["micros"].as_u64().unwrap());
                }
            }
        }
        (
            median(walls),
            if enters.is_empty() { 0 } else { median(enters) },
            steps,
        )
    };
    let (bare, _, _) = wall(None);
    println!("process start without enter: median wall {bare} us");
    for (label, netns, profile) in [
        ("native, netns+ipc", true, SyscallProfile::Native),
        ("native, no netns", false, SyscallProfile::Native),
        ("wasm, netns+ipc", true, SyscallProfile::Wasm),
    ] {
        let mut plan = fx.plan(profile);
        plan.new_net_namespace = netns;
        plan.new_ipc_namespace = netns;
        let (w, e, steps) = wall(Some(&plan));
        println!("{label}: median wall {w} us, enter() {e} us");
        for (step, v) in steps {
            println!("    {step:14} {:>6} us", median(v));
        }
    }
}

/// R under the native profile: `system()` (fork + exec of /bin/sh), graphics, its temp dir
/// and a catchable over-allocation work; the network and unlisted files do not.
#[test]
fn native_profile_runs_r() {
    require_host!();
    let rscript = "/usr/lib/R/bin/Rscript";
    if !Path::new(rscript).exists() {
        sandcell_testing::skip!("r", "R is not installed ({rscript})");
    }
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Native);
    // What R reads at start.
    plan.read_paths = [
        "/etc/R",
        "/etc/fonts",
        "/etc/ld.so.cache",
        "/etc/nsswitch.conf",
        "/etc/passwd",
        "/etc/group",
        "/var/cache/fontconfig",
        "/dev/urandom",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    plan.max_open_files = 256;
    plan.max_address_space = Some(4 << 30);
    let code = r#"
        cat(system("echo from-sh", intern = TRUE), "\n")
        png(file.path(tempdir(), "a.png")); plot(1); invisible(dev.off())
        cat("png", file.exists(file.path(tempdir(), "a.png")), "\n")
        cat("hostname", class(try(readLines("/etc/hostname"), silent = TRUE)), "\n")
        cat("net", class(try(readLines(url("http://127.0.0.1:1/")), silent = TRUE)), "\n")
        cat("alloc", class(try(numeric(1e9), silent = TRUE)), "\n")
    "#;
    let output = Command::new(PROBE)
        .env_clear()
        .env(PLAN_ENV, serde_json::to_string(&plan).unwrap())
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", &fx.session)
        .env("TMPDIR", &fx.session)
        .args(["--", rscript, "-e", code])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "R failed: {stdout}\n{stderr}");
    assert!(stdout.contains("from-sh"), "{stdout}\n{stderr}");
    assert!(stdout.contains("png TRUE"), "{stdout}");
    assert!(stdout.contains("hostname try-error"), "{stdout}");
    assert!(stdout.contains("net try-error"), "{stdout}");
    assert!(stdout.contains("alloc try-error"), "{stdout}");
}

/// The Landlock levels the code distinguishes that this kernel can show, highest first: the
/// kernel's own ABI (at most 7), each lower one, and 0 (no Landlock: the mount namespace
/// alone).
fn levels() -> Vec<i32> {
    let k = sandcell_confine::landlock::kernel_abi().unwrap_or(0).min(7);
    (0..=k).rev().collect()
}

/// What the policy applies at `level` with a mount namespace: ABI 2 and up as asked, ABI 1
/// substituted, none at 0.
fn expected_abi(level: i32) -> Option<i64> {
    (level >= 2).then_some(i64::from(level))
}

fn chown_worker(p: &Path) {
    std::os::unix::fs::chown(p, Some(WORKER_ID), Some(WORKER_ID)).unwrap();
}

#[test]
fn native_walls_hold_at_every_level() {
    require_host!();
    let daemon_pid = std::process::id().to_string();
    for level in levels() {
        let fx = Fixture::new();
        let plan = fx.level_plan(SyscallProfile::Native, level);
        // A world-writable host file next to the session: only the sandbox protects it.
        let victim = fx.dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o666)).unwrap();
        std::fs::create_dir(fx.session.join("a")).unwrap();
        std::fs::write(fx.session.join("a/f"), "f").unwrap();
        std::fs::copy("/bin/true", fx.session.join("true")).unwrap();
        for p in ["a", "a/f", "true"] {
            chown_worker(&fx.session.join(p));
        }
        let s = |p: &str| fx.session.join(p).display().to_string();
        let o = |p: &str| fx.dir.join(p).display().to_string();
        let checks: Vec<String> = vec![
            "ids".into(),
            "caps".into(),
            "nnp".into(),
            "seccomp-mode".into(),
            "fds".into(),
            "read=/etc/shadow".into(),
            "read=/etc/hostname".into(),
            "read=/etc/passwd".into(),
            "read=/proc/1/cmdline".into(),
            format!("read=/proc/{daemon_pid}/cmdline"),
            format!("write={}", o("outside.txt")),
            format!("write={}", s("inside.txt")),
            format!("truncate={}", victim.display()),
            format!("truncate={}", s("a/f")),
            format!("mkdir={}", s("b")),
            format!("rename={},{}", s("a/f"), s("b/f")),
            format!("rename={},{}", s("inside.txt"), o("moved.txt")),
            format!("link={},{}", victim.display(), s("victim")),
            format!("link=/etc/passwd,{}", s("pw")),
            format!("connect-unix={}", fx.socket.display()),
            format!("kill={daemon_pid}"),
            format!("spawn={}", s("true")),
            "spawn=/usr/bin/true".into(),
            "socket=inet".into(),
            "socket=unix".into(),
            "mount".into(),
            "ptrace=1".into(),
            "list=/".into(),
        ];
        let refs: Vec<&str> = checks.iter().map(String::as_str).collect();
        let run = probe(Some(&plan), &refs, None);
        let ctx = format!("level {level}: {}\n{}", run.out, run.stderr);
        assert!(run.status.success(), "{ctx}");
        assert!(run.out["enter_error"].is_null(), "{ctx}");
        let report = &run.out["report"];
        assert_eq!(report["seccomp"], true, "{ctx}");
        assert_eq!(report["mount_namespace"], true, "{ctx}");
        assert_eq!(
            report["landlock_abi"].as_i64(),
            expected_abi(level),
            "{ctx}"
        );
        let skipped = report["skipped"].as_array().unwrap();
        if level >= 2 {
            assert!(skipped.is_empty(), "{ctx}");
        } else {
            assert_eq!(skipped.len(), 1, "{ctx}");
            assert!(
                skipped[0].as_str().unwrap().starts_with("landlock:"),
                "{ctx}"
            );
        }
        let id = u64::from(WORKER_ID);
        assert_eq!(
            run.check("ids", "")["detail"]["uid"],
            serde_json::json!([id, id, id])
        );
        assert_eq!(run.check("caps", "")["detail"]["eff"], 0);
        assert_eq!(run.check("seccomp-mode", "")["detail"], 2);
        assert_eq!(
            run.check("fds", "")["detail"],
            serde_json::json!(plan.keep_fds)
        );

        // Denied at every level.
        let denied = [
            ("read", "/etc/shadow".to_string()),
            ("read", "/etc/hostname".into()),
            ("read", "/proc/1/cmdline".into()),
            ("read", format!("/proc/{daemon_pid}/cmdline")),
            ("write", o("outside.txt")),
            ("truncate", victim.display().to_string()),
            ("rename", format!("{},{}", s("inside.txt"), o("moved.txt"))),
            ("link", format!("{},{}", victim.display(), s("victim"))),
            ("link", format!("/etc/passwd,{}", s("pw"))),
            ("connect-unix", fx.socket.display().to_string()),
            ("kill", daemon_pid.clone()),
            ("spawn", s("true")),
            ("socket", "inet".into()),
            ("socket", "unix".into()),
            ("mount", String::new()),
            ("ptrace", "1".into()),
        ];
        for (check, arg) in &denied {
            assert!(
                !run.allowed(check, arg),
                "level {level}: {check}={arg} allowed: {}",
                run.check(check, arg)
            );
        }
        // Allowed at every level: ordinary work inside the session, including a rename
        // across its directories (which Landlock ABI 1 alone would refuse).
        for (check, arg) in [
            ("read", "/etc/passwd".to_string()),
            ("write", s("inside.txt")),
            ("truncate", s("a/f")),
            ("mkdir", s("b")),
            ("rename", format!("{},{}", s("a/f"), s("b/f"))),
            ("spawn", "/usr/bin/true".into()),
        ] {
            assert!(
                run.allowed(check, &arg),
                "level {level}: {check}={arg} denied: {}",
                run.check(check, &arg)
            );
        }
        // Host-side effects: exactly the session's.
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "precious",
            "level {level}"
        );
        assert!(!fx.dir.join("outside.txt").exists(), "level {level}");
        assert!(!fx.dir.join("moved.txt").exists(), "level {level}");
        assert!(fx.session.join("inside.txt").exists(), "level {level}");
        assert!(fx.session.join("b/f").exists(), "level {level}");
        // The root of the view: only allowlisted trees (Landlock levels refuse the listing).
        if run.allowed("list", "/") {
            let names = run.check("list", "/")["detail"].clone();
            for hidden in ["root", "home", "boot", "run", "srv"] {
                assert!(
                    !names.as_array().unwrap().contains(&hidden.into()),
                    "level {level}: / lists {names}"
                );
            }
        }
    }
}

#[test]
fn wasm_walls_hold_at_every_level() {
    require_host!();
    for level in levels() {
        let fx = Fixture::new();
        let plan = fx.level_plan(SyscallProfile::Wasm, level);
        let s = |p: &str| fx.session.join(p).display().to_string();
        let checks = [
            "read=/etc/shadow".to_string(),
            "read=/etc/hostname".into(),
            format!("write={}", fx.dir.join("outside.txt").display()),
            format!("write={}", s("inside.txt")),
            "fork".into(),
            "spawn=/bin/true".into(),
            "thread".into(),
            "mmap-exec".into(),
            "socket=unix".into(),
        ];
        let refs: Vec<&str> = checks.iter().map(String::as_str).collect();
        let run = probe(Some(&plan), &refs, None);
        let ctx = format!("level {level}: {}\n{}", run.out, run.stderr);
        assert!(run.status.success(), "{ctx}");
        assert_eq!(
            run.out["report"]["landlock_abi"].as_i64(),
            expected_abi(level),
            "{ctx}"
        );
        for c in [
            "read=/etc/shadow",
            "read=/etc/hostname",
            "fork",
            "spawn=/bin/true",
            "socket=unix",
        ] {
            let (n, a) = c.split_once('=').unwrap_or((c, ""));
            assert!(!run.allowed(n, a), "level {level}: {c} allowed");
        }
        assert!(!run.allowed("write", &fx.dir.join("outside.txt").display().to_string()));
        assert!(run.allowed("write", &s("inside.txt")), "{ctx}");
        assert!(
            run.allowed("thread", "") && run.allowed("mmap-exec", ""),
            "{ctx}"
        );
    }
}

/// Landlock ABI 1 alone refuses every rename across directories, even inside the session
/// (`EXDEV`), and does not stop `truncate(2)`: strict mode refuses it without the mount
/// namespace, and the policy substitutes the mount namespace for it.
#[test]
fn abi_1_alone_is_refused_in_strict_mode_and_breaks_renames() {
    require_host!();
    let fx = Fixture::new();
    let mut plan = fx.plan(SyscallProfile::Native);
    plan.landlock_abi_cap = Some(1);
    let run = probe(Some(&plan), &["ids"], None);
    assert_eq!(
        run.status.code(),
        Some(sandcell_confine::EXIT_CONFINE_FAILED)
    );
    let err = run.out["enter_error"].as_str().unwrap();
    assert!(err.contains("truncate-outside-session"), "{err}");

    // Best effort (the development flag) applies ABI 1: the limitation shows.
    plan.enforcement = Enforcement::BestEffort;
    std::fs::create_dir(fx.session.join("a")).unwrap();
    std::fs::create_dir(fx.session.join("b")).unwrap();
    std::fs::write(fx.session.join("a/f"), "f").unwrap();
    for p in ["a", "b", "a/f"] {
        chown_worker(&fx.session.join(p));
    }
    let across = format!(
        "rename={},{}",
        fx.session.join("a/f").display(),
        fx.session.join("b/f").display()
    );
    let within = format!(
        "rename={},{}",
        fx.session.join("a/f").display(),
        fx.session.join("a/g").display()
    );
    let run = probe(Some(&plan), &[&across, &within], None);
    assert_eq!(run.out["report"]["landlock_abi"], 1, "{}", run.out);
    let (n, a) = across.split_once('=').unwrap();
    assert_eq!(run.errno(n, a), i64::from(libc::EXDEV), "{}", run.out);
    let (n, a) = within.split_once('=').unwrap();
    assert!(run.allowed(n, a), "{}", run.out);
}

/// R at every level: a tempfile renamed into the session directory, a rename across its
/// subdirectories, a PNG plot; unlisted host files stay unreadable.
#[test]
fn r_file_handling_at_every_level() {
    require_host!();
    let rscript = "/usr/lib/R/bin/Rscript";
    if !Path::new(rscript).exists() {
        sandcell_testing::skip!("r", "R is not installed ({rscript})");
    }
    for level in levels() {
        let fx = Fixture::new();
        let mut plan = fx.level_plan(SyscallProfile::Native, level);
        plan.read_paths = [
            "/usr",
            "/lib",
            "/lib64",
            "/etc/alternatives",
            "/etc/R",
            "/etc/fonts",
            "/etc/ld.so.cache",
            "/etc/nsswitch.conf",
            "/etc/passwd",
            "/etc/group",
            "/var/cache/fontconfig",
            "/dev/urandom",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        // Rscript runs R's shell wrapper (#!/bin/bash).
        plan.exec_paths.push("/bin".into());
        plan.max_open_files = 256;
        let tmp = fx.session.join(".tmp");
        std::fs::create_dir(&tmp).unwrap();
        chown_worker(&tmp);
        let code = r#"
            setwd(Sys.getenv("HOME"))
            tf <- tempfile(fileext = ".txt"); writeLines("hello", tf)
            cat("tempfile-rename", file.rename(tf, "moved.txt"), "\n")
            dir.create("sub"); writeLines("x", "sub/a.txt")
            cat("subdir-rename", file.rename("sub/a.txt", "b.txt"), "\n")
            png("plot.png"); plot(1:10); invisible(dev.off())
            cat("png", file.info("plot.png")$size > 0, "\n")
            cat("moved", readLines("moved.txt"), "\n")
            cat("shadow", class(try(readLines("/etc/shadow"), silent = TRUE)), "\n")
            cat("hostname", class(try(readLines("/etc/hostname"), silent = TRUE)), "\n")
        "#;
        let output = Command::new(PROBE)
            .env_clear()
            .env(PLAN_ENV, serde_json::to_string(&plan).unwrap())
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", &fx.session)
            .env("TMPDIR", &tmp)
            .args(["--", rscript, "-e", code])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let ctx = format!("level {level}:\n{stdout}\n{stderr}");
        assert!(output.status.success(), "{ctx}");
        for want in [
            "tempfile-rename TRUE",
            "subdir-rename TRUE",
            "png TRUE",
            "moved hello",
            "shadow try-error",
            "hostname try-error",
        ] {
            assert!(stdout.contains(want), "{want}: {ctx}");
        }
        assert!(fx.session.join("plot.png").exists(), "{ctx}");
    }
}
