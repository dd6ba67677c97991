//! Test harness: starts a real `sandcelld` on a private socket with real workers.
//!
//! As root the daemon runs exactly as in production (cgroups, per-session uids, strict
//! confinement). Without root, or with `SANDCELL_TEST_INSECURE=1`, it runs with
//! `--insecure-dev` and says so on stderr.
#![allow(dead_code)]

pub mod bus;
pub mod cells;
pub mod polkit;
pub mod unit_sandbox;

use sandcell_client::Client;
use std::io::Read;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

/// Directory holding the built binaries (target/release).
pub fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_sandcelld"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The prepared Eryx runtime, prepared once if needed.
pub fn python_runtime() -> PathBuf {
    static ONCE: Once = Once::new();
    let dir = std::env::var_os("SANDCELL_TEST_PYTHON_RUNTIME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/sandcell-cache/python-runtime"));
    ONCE.call_once(|| {
        let prep = bin_dir().join("sandcell-python-runtime");
        assert!(
            prep.exists(),
            "{} missing: build the workspace first (scripts/test.sh does)",
            prep.display()
        );
        let st = Command::new(&prep)
            .arg("prepare")
            .arg("--out")
            .arg(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "preparing the Python runtime failed");
    });
    dir
}

/// Whether tests run the daemon in development mode.
pub fn insecure() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || std::env::var_os("SANDCELL_TEST_INSECURE").is_some() {
        // The tests go on, but what they check of cgroups and strict confinement is skipped.
        sandcell_testing::skip_part!(
            if root { "cgroups" } else { "root" },
            "sandcelld runs with --insecure-dev (not root, or SANDCELL_TEST_INSECURE set): no \
             cgroups, best-effort confinement"
        );
        true
    } else {
        false
    }
}

/// A running daemon.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
    pub log: PathBuf,
}

/// `n` random bytes in hex.
pub fn rand_hex(n: usize) -> String {
    sandcelld::sys::random_hex(n).expect("getrandom(2)")
}

/// A random `u32`.
pub fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    sandcelld::sys::random_bytes(&mut b).expect("getrandom(2)");
    u32::from_le_bytes(b)
}

fn unique() -> String {
    rand_hex(6)
}

/// The sandbox of units/sandcelld.service, built once per test process (it runs
/// systemd-analyze).
fn unit_sandbox_of_unit() -> &'static unit_sandbox::UnitSandbox {
    static S: std::sync::OnceLock<unit_sandbox::UnitSandbox> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        eprintln!(
            "note: sandcelld runs under units/sandcelld.service's seccomp filters, bounding set \
             and no_new_privs ({}=1)",
            unit_sandbox::ENV
        );
        unit_sandbox::UnitSandbox::of_unit()
    })
}

impl Daemon {
    /// Starts sandcelld with extra `SANDCELL_*` settings and waits until it is ready.
    pub fn start(env: &[(&str, &str)]) -> Daemon {
        Self::start_cmd(env, None)
    }

    /// As [`Daemon::start`], but under `systemd-socket-activate`.
    pub fn start_activated(env: &[(&str, &str)]) -> Daemon {
        Self::start_cmd(env, Some(()))
    }

    /// As [`Daemon::start`], but with the configuration file `config` instead of an empty one.
    pub fn start_with_config(config: &Path, env: &[(&str, &str)]) -> Daemon {
        Self::start_full(env, None, Some(config))
    }

    /// As [`Daemon::start`], but listening on `socket` (e.g. the socket of a daemon that was
    /// killed, to start its successor where its clients connect).
    pub fn start_on(socket: &Path, env: &[(&str, &str)]) -> Daemon {
        Self::start_at(env, None, None, Some(socket), false, None)
    }

    /// As [`Daemon::start_with_config`], listening on `socket` (a successor's start).
    pub fn start_on_with_config(socket: &Path, config: &Path, env: &[(&str, &str)]) -> Daemon {
        Self::start_at(env, None, Some(config), Some(socket), false, None)
    }

    /// As [`Daemon::start_with_config`], under `sandbox` (a unit file's, with or without
    /// drop-ins: [`unit_sandbox::UnitSandbox::from_unit_with`]) whatever
    /// `SANDCELL_TEST_UNIT_SANDBOX` says.
    pub fn start_in_sandbox(
        config: &Path,
        env: &[(&str, &str)],
        sandbox: &unit_sandbox::UnitSandbox,
    ) -> Daemon {
        Self::start_at(env, None, Some(config), None, false, Some(sandbox))
    }

    /// As [`Daemon::start_in_sandbox`], listening on `socket` (a successor's start under the
    /// same unit's sandbox).
    pub fn start_on_in_sandbox(
        socket: &Path,
        config: &Path,
        env: &[(&str, &str)],
        sandbox: &unit_sandbox::UnitSandbox,
    ) -> Daemon {
        Self::start_at(env, None, Some(config), Some(socket), false, Some(sandbox))
    }

    /// As [`Daemon::start`] (or [`Daemon::start_on`] with `socket`), in a mount namespace of
    /// its own whose mounts do not propagate back (`unshare(CLONE_NEWNS)`, then `/` made a
    /// recursive slave), as systemd starts the unit (`PrivateMounts=yes`, systemd.exec(5)):
    /// what the daemon mounts (session file systems) only it and its children see.
    pub fn start_private_mounts(env: &[(&str, &str)], socket: Option<&Path>) -> Daemon {
        Self::start_at(env, None, None, socket, true, None)
    }

    fn start_cmd(env: &[(&str, &str)], activated: Option<()>) -> Daemon {
        Self::start_full(env, activated, None)
    }

    fn start_full(env: &[(&str, &str)], activated: Option<()>, config: Option<&Path>) -> Daemon {
        Self::start_at(env, activated, config, None, false, None)
    }

    fn start_at(
        env: &[(&str, &str)],
        activated: Option<()>,
        config: Option<&Path>,
        socket: Option<&Path>,
        private_mounts: bool,
        sandbox: Option<&unit_sandbox::UnitSandbox>,
    ) -> Daemon {
        let runtime = python_runtime();
        let dir = tempfile::Builder::new()
            .prefix("sandcell-test-")
            .tempdir_in("/var/tmp")
            .unwrap();
        // The state dir must be traversable by per-session worker uids.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        let socket = socket.map_or_else(|| dir.path().join("kernel.sock"), Path::to_path_buf);
        let log = dir.path().join("daemon.log");
        let daemon = Path::new(env!("CARGO_BIN_EXE_sandcelld"));
        std::fs::write(dir.path().join("none.toml"), "").unwrap();
        let cgroup = format!("sandcell-test-{}", unique());
        let mut vars: Vec<(String, String)> = vec![
            (
                "SANDCELL_WORKER_DIR".into(),
                bin_dir().display().to_string(),
            ),
            (
                "SANDCELL_PYTHON_RUNTIME_DIR".into(),
                runtime.display().to_string(),
            ),
            (
                "SANDCELL_STATE_DIR".into(),
                dir.path().join("state").display().to_string(),
            ),
            ("SANDCELL_CGROUP_NAME".into(), cgroup),
            // Session records and keeper sockets of this daemon only (never the machine's
            // /run/sandcell/adopt, which a daemon would adopt from).
            (
                "SANDCELL_ADOPT_DIR".into(),
                dir.path().join("adopt").display().to_string(),
            ),
            ("SANDCELL_LANGUAGES".into(), "python".into()),
            ("SANDCELL_LOG".into(), "info".into()),
            // Bare session ids, so tests can name session directories and D-Bus object paths
            // by the id Open gives; tests/node_ids.rs covers qualified ids (and the default,
            // by removing this with "-SANDCELL_NODE_ID").
            ("SANDCELL_NODE_ID".into(), String::new()),
            // No capacity file (never /run/sandcell/metrics.prom, shared by every daemon on
            // the machine); tests/metrics.rs sets its own.
            ("SANDCELL_METRICS_FILE".into(), String::new()),
            // Room for a few sessions per test; tests of admission set their own budgets.
            ("SANDCELL_MAX_CONCURRENT_SESSIONS".into(), "8".into()),
            // Warm pools are on by default; a test that counts workers or admission charges
            // must not see them, so the tests of pools turn them on ("SANDCELL_POOLS", "true").
            ("SANDCELL_POOLS".into(), "false".into()),
            (
                "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES".into(),
                (8u64 << 27).to_string(),
            ),
            (
                "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES".into(),
                (8u64 << 30).to_string(),
            ),
        ];
        for (k, v) in env {
            if let Some(k) = k.strip_prefix('-') {
                vars.retain(|(x, _)| x != k);
                continue;
            }
            vars.retain(|(x, _)| x != k);
            vars.push((k.to_string(), v.to_string()));
        }
        let mut args: Vec<String> = Vec::new();
        if insecure() {
            args.push("--insecure-dev".into());
        }
        args.push("--config".into());
        args.push(match config {
            Some(c) => c.display().to_string(),
            None => dir.path().join("none.toml").display().to_string(),
        });
        let mut cmd = match activated {
            None => {
                let mut c = Command::new(daemon);
                c.arg("--listen").arg(&socket).args(&args).envs(vars);
                c
            }
            Some(()) => {
                // systemd-socket-activate passes no environment but what -E names.
                let mut c = Command::new("systemd-socket-activate");
                c.arg("-l").arg(&socket).arg("--fdname=varlink");
                for (k, v) in &vars {
                    c.arg(format!("--setenv={k}={v}"));
                }
                c.arg(daemon).args(&args);
                c
            }
        };
        if private_mounts {
            use std::os::unix::process::CommandExt;
            // SAFETY: unshare(2) and mount(2) only, between fork and exec; nothing allocated.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::unshare(libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::mount(
                        c"none".as_ptr(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_SLAVE,
                        std::ptr::null(),
                    ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if let Some(sandbox) = sandbox {
            sandbox.apply(&mut cmd);
        } else if unit_sandbox::enabled() {
            unit_sandbox_of_unit().apply(&mut cmd);
        }
        // Readiness as systemd learns it (sd_notify(3)): the daemon sends READY=1 to the
        // datagram socket NOTIFY_SOCKET names once it serves. Under socket activation the
        // daemon starts on the first connection, so the listening socket is what is awaited.
        let notify = match activated {
            None => {
                let path = dir.path().join("notify");
                let sock = UnixDatagram::bind(&path).expect("binding the notify socket");
                cmd.env("NOTIFY_SOCKET", &path);
                Some(sock)
            }
            Some(()) => None,
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = cmd.spawn().expect("starting sandcelld");
        let mut d = Daemon {
            child,
            socket,
            dir,
            log,
        };
        match notify {
            Some(sock) => d.wait_notified_ready(&sock),
            None => d.wait_listening(),
        }
        d
    }

    /// Waits for READY=1 on `sock` (the daemon's NOTIFY_SOCKET); panics with the daemon's log
    /// if it exits first or is not ready within 120 s.
    fn wait_notified_ready(&mut self, sock: &UnixDatagram) {
        let t0 = Instant::now();
        // The timeout only bounds how late an early exit of the daemon is noticed.
        sock.set_read_timeout(Some(Duration::from_millis(250)))
            .unwrap();
        let mut buf = [0u8; 4096];
        loop {
            match sock.recv(&mut buf) {
                Ok(n) => {
                    if buf[..n].split(|&b| b == b'\n').any(|l| l == b"READY=1") {
                        return;
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => panic!("reading the notify socket: {e}"),
            }
            self.check_starting(t0);
        }
    }

    /// Waits until systemd-socket-activate listens on the socket (it starts the daemon on the
    /// first connection) and opens it to every uid.
    fn wait_listening(&mut self) {
        let t0 = Instant::now();
        while !self.socket.exists() {
            self.check_starting(t0);
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::set_permissions(
            &self.socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
    }

    /// Panics with the daemon's log if it has exited or 120 s have passed since `t0`.
    fn check_starting(&mut self, t0: Instant) {
        if let Ok(Some(st)) = self.child.try_wait() {
            panic!(
                "sandcelld exited ({st}) before it was ready:\n{}",
                self.log_text()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "sandcelld not ready after 120 s:\n{}",
            self.log_text()
        );
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// A new client connection.
    pub async fn client(&self) -> Client {
        Client::connect(&self.socket)
            .await
            .expect("connecting to sandcelld")
    }

    /// Pid of the daemon process (under socket activation, of systemd-socket-activate, which
    /// execs the daemon in place).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Pids of every live descendant of the daemon (its workers and what they started).
    pub fn descendants(&self) -> Vec<u32> {
        descendants(self.pid())
    }

    /// Whether the daemon process is still running.
    pub fn child_alive(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .is_ok_and(|s| !s.contains(") Z "))
    }

    /// The daemon's resident memory, bytes.
    pub fn rss(&self) -> u64 {
        rss(self.pid())
    }

    /// SIGTERM, then wait up to `timeout` for exit; returns the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: a signal to our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.terminate(Duration::from_secs(20)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        unmount_below(self.dir.path());
    }
}

/// Lazily unmounts every mount below `dir` in this mount namespace: session file systems a
/// killed test daemon left (a daemon under its unit keeps them in its private namespace).
pub fn unmount_below(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path; umount2 touches nothing else.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Resident memory of `pid`, bytes.
pub fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Whether `pid` is a session keeper (`sandcelld keep`): it lives exactly as long as its
/// session's worker, so worker counts leave it out.
pub fn is_keeper(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.split(|&b| b == 0).nth(1) == Some(b"keep".as_slice()))
        .unwrap_or(false)
}

/// Whether `pid` runs the same executable as `root` (the daemon): a keeper, also in the
/// moment between its fork and its exec, when its command line is still the daemon's.
/// Workers run other executables (the Eryx worker, R, Python).
fn runs_daemon_exe(pid: u32, root_exe: Option<&std::path::Path>) -> bool {
    root_exe.is_some_and(|r| {
        std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e.as_path() == r)
    })
}

/// Pids of every live descendant of `root` but session keepers (workers, their children, the
/// daemon's other children).
pub fn descendants(root: u32) -> Vec<u32> {
    let root_exe = std::fs::read_link(format!("/proc/{root}/exe")).ok();
    let mut parent = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split(' ').collect();
        if let Some(pp) = f.get(1).and_then(|p| p.parse::<u32>().ok()) {
            parent.insert(pid, pp);
        }
    }
    let mut out = Vec::new();
    for (&pid, _) in parent.iter() {
        if is_keeper(pid) || runs_daemon_exe(pid, root_exe.as_deref()) {
            continue;
        }
        let mut p = pid;
        while let Some(&pp) = parent.get(&p) {
            if pp == root {
                out.push(pid);
                break;
            }
            if pp <= 1 {
                break;
            }
            p = pp;
        }
    }
    out
}

/// Waits until `f` holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// The package directory: the one cargo names at run time, the compile-time one only as a
/// fallback (a shared target directory can hold a test binary that another checkout built,
/// and cargo keeps it fresh across checkouts).
#[allow(dead_code)]
pub fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Whether R is installed (the R tiers need `/usr/lib/R/bin/exec/R`).
pub fn r_available() -> bool {
    Path::new("/usr/lib/R/bin/exec/R").exists()
}

/// Whether the `pydata` environment's interpreter can import numpy and pandas.
pub fn pydata_available() -> bool {
    Path::new("/usr/bin/python3").exists()
        && Command::new("/usr/bin/python3")
            .args(["-I", "-c", "import numpy, pandas"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// One raw call of `org.sandcell.Kernel.<method>` as `uid`, on a fresh connection made by a
/// thread that changes only its own uid to connect (the raw `setresuid` system call, not
/// glibc's process-wide one; the saved uid stays 0). Streaming methods (`Run`, `Execute`,
/// `Attach`) are called with `more`; the first reply is returned.
pub fn call_as(
    uid: u32,
    socket: &Path,
    method: &str,
    parameters: serde_json::Value,
) -> serde_json::Value {
    use std::io::Write;
    let socket = socket.to_owned();
    let mut stream = std::thread::spawn(move || {
        // SAFETY: setresuid(2) on this thread only; the thread ends right after the connect.
        let r = unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, 0) };
        assert_eq!(r, 0, "setresuid: {}", std::io::Error::last_os_error());
        std::os::unix::net::UnixStream::connect(&socket).expect("connect as another uid")
    })
    .join()
    .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut msg = serde_json::to_vec(&serde_json::json!({
        "method": format!("org.sandcell.Kernel.{method}"),
        "parameters": parameters,
        "more": matches!(method, "Run" | "Execute" | "Attach"),
    }))
    .unwrap();
    msg.push(0);
    stream.write_all(&msg).unwrap();
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while stream.read(&mut byte).unwrap() == 1 && byte[0] != 0 {
        reply.push(byte[0]);
    }
    serde_json::from_slice(&reply).unwrap()
}
