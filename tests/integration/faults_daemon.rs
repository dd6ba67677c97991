//! Faults of the daemon and of what it depends on, against the real daemon: the daemon killed
//! with SIGKILL while sessions are open (then started again on the same socket, state
//! directory, cgroup name and uid range), the state directory's file system full, the cgroup
//! hierarchy refusing a session's group, and polkitd and the system bus going away and coming
//! back. Each test asserts what the client saw and that nothing was left behind (worker
//! processes and uids, session directories and cgroups, admission charges).
//!
//! Needs root (cgroups, tmpfs mounts, per-session uids; polkit: useradd and polkit's
//! directories) and, for the last test, `dbus-daemon`, `busctl`, `setpriv` and `polkitd`.

use crate::common;

use common::bus::{Bus, Out, run, run_input};
use common::polkit::{POLKITD, Polkit, User};
use common::{Daemon, eventually, rand_hex, rand_u32};
use sandcell_client::{Error, KernelError};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A private worker uid range (base, count) and cgroup name, so that what another daemon on
/// this machine runs is never mistaken for a leak of this one.
fn private_identity(count: u32) -> (u32, u32, String) {
    let base = 3_300_000_000 + (rand_u32() % 100_000) * 64;
    (base, count, format!("sandcell-fault-{}", rand_hex(5)))
}

/// Pids of live processes whose real uid is in `[base, base + count)`.
fn procs_of_uids(base: u32, count: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
        if status.contains("State:\tZ") {
            continue;
        }
        if let Some(u) = uid
            && u >= base
            && u < base + count
        {
            out.push(pid);
        }
    }
    out
}

/// Every `<...>/<name>/sessions` directory in the cgroup hierarchies (v1: one per hierarchy the
/// daemon uses), found by a bounded walk of `/sys/fs/cgroup`.
fn sessions_parents(name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut level: Vec<PathBuf> = vec![PathBuf::from("/sys/fs/cgroup")];
    for _ in 0..7 {
        let mut next = Vec::new();
        for dir in &level {
            let Ok(rd) = std::fs::read_dir(dir) else {
                continue;
            };
            for e in rd.flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let p = e.path();
                if e.file_name() == name {
                    let s = p.join("sessions");
                    if s.is_dir() {
                        found.push(s);
                    }
                } else {
                    next.push(p);
                }
            }
        }
        level = next;
    }
    found
}

/// Session groups under the `sessions` parents of cgroup name `name`.
fn session_groups(parents: &[PathBuf]) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for p in parents {
        if let Ok(rd) = std::fs::read_dir(p) {
            v.extend(
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    v
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// Whether `e` is what a client sees when the daemon dies under it: the transport failed, or
/// the cell's stream ended before its result.
fn is_lost_daemon(e: &Error) -> bool {
    matches!(e, Error::Protocol(_) | Error::Incomplete)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_with_sessions_open_is_swept_by_its_successor() {
    if !is_root() || common::insecure() {
        sandcell_testing::skip!(
            "root",
            "the sweep of cgroups and worker uids needs a root daemon with cgroups"
        );
    }
    let (base, count, name) = private_identity(16);
    let (base_s, count_s) = (base.to_string(), count.to_string());
    let env = [
        ("SANDCELL_WORKER_UID_BASE", base_s.as_str()),
        ("SANDCELL_WORKER_UID_COUNT", count_s.as_str()),
        ("SANDCELL_CGROUP_NAME", name.as_str()),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
    ];
    let mut first = Daemon::start(&env);
    let state = first.dir.path().join("state");
    let sessions = state.join("sessions");

    // An idle session with a variable, and one in the middle of a long cell.
    let mut a = first.client().await;
    let sa = a.open("python", None, None).await.unwrap().session;
    a.execute_collect(&sa, "v = 41").await.unwrap();
    let mut b = first.client().await;
    let sb = b.open("python", None, None).await.unwrap().session;
    b.execute(&sb, "import time\ntime.sleep(50)\n")
        .await
        .unwrap();
    b.next_frame()
        .await
        .unwrap()
        .started
        .expect("started first");
    let workers = first.descendants();
    assert!(!workers.is_empty(), "no worker processes");
    assert!(!procs_of_uids(base, count).is_empty(), "no worker uids");
    let parents = sessions_parents(&name);
    assert!(!parents.is_empty(), "no cgroup parent named {name}");
    // One group per session in each hierarchy (v1: memory, pids, cpu).
    assert_eq!(session_groups(&parents).len(), 2 * parents.len());
    assert_eq!(entries(&sessions).len(), 2);

    // SIGKILL: no shutdown path runs.
    // (Reaped by the harness's drop, which must not signal a recycled pid.)
    let _ = first.child.kill();
    let t0 = Instant::now();
    let seen_b = tokio::time::timeout(Duration::from_secs(10), b.finish(|_| {}))
        .await
        .expect("the running cell's client must be answered, not hang");
    let err_b = seen_b.expect_err("a cell whose daemon died cannot have a result");
    assert!(is_lost_daemon(&err_b), "typed transport error: {err_b:?}");
    let seen_a = tokio::time::timeout(Duration::from_secs(10), a.execute_collect(&sa, "print(v)"))
        .await
        .expect("the idle session's client must be answered, not hang");
    let err_a = seen_a.expect_err("a session whose daemon died cannot run a cell");
    assert!(is_lost_daemon(&err_a), "typed transport error: {err_a:?}");
    eprintln!(
        "clients saw {err_b} (running cell) and {err_a} (next call) within {:?}",
        t0.elapsed()
    );

    // The successor, on the same socket, state directory, cgroup name and uid range.
    let state_s = state.display().to_string();
    let mut env2 = env.to_vec();
    env2.push(("SANDCELL_STATE_DIR", state_s.as_str()));
    let second = Daemon::start_on(&first.socket, &env2);
    assert!(
        second
            .log_text()
            .contains("killed and removed session groups left by a previous daemon"),
        "no sweep logged:\n{}",
        second.log_text()
    );
    assert!(
        workers.iter().all(|&p| !alive(p)),
        "workers of the killed daemon still run: {:?}",
        workers.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
    assert_eq!(
        procs_of_uids(base, count),
        Vec::<u32>::new(),
        "processes still run as worker uids"
    );
    assert_eq!(
        session_groups(&parents),
        Vec::<PathBuf>::new(),
        "session cgroups left"
    );
    assert_eq!(
        entries(&sessions),
        Vec::<String>::new(),
        "session directories left"
    );

    // The successor serves: the old sessions are reported ended, a new one runs.
    let mut c = second.client().await;
    match c.execute_collect(&sa, "print(v)").await {
        Err(Error::Kernel(KernelError::SessionEnded { reason, .. }))
            if reason == "daemon_restarted" => {}
        other => panic!("a session of the killed daemon must be reported ended: {other:?}"),
    }
    let out = c.run_collect("python", "print(6 * 7)", None).await.unwrap();
    assert_eq!(out.stdout, "42\n");
    let s = c.open("python", None, None).await.unwrap().session;
    let out = c.execute_collect(&s, "w = 1\nprint(w + 1)").await.unwrap();
    assert_eq!(out.stdout, "2\n");
    c.close(&s).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || second.descendants().is_empty()
            && procs_of_uids(base, count).is_empty()
            && entries(&sessions).is_empty()),
        "the successor's session left something"
    );
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::Builder::new()
            .prefix("sandcell-full-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0711")])
            .arg("tmpfs")
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "mount -t tmpfs failed");
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Fills the file system of `dir` with `dir/filler` until a write fails with `ENOSPC`.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0x5au8; 64 << 10];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    // What a short write left: one byte at a time until the file system refuses.
    while f.write(&[0x5a]).is_ok_and(|n| n == 1) {}
    path
}

/// Session files live in each session's own tmpfs, not on the state directory's file system:
/// when that is full, uploads and cells' writes still go to their sessions, and sessions
/// still start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_directory_leaves_the_sessions_files_alone() {
    if !is_root() {
        sandcell_testing::skip!("root", "mounting a tmpfs as the state directory needs root");
    }
    let fs = Tmpfs::mount("24m");
    let state = fs.path().join("state");
    let state_s = state.display().to_string();
    let d = Daemon::start(&[
        ("SANDCELL_STATE_DIR", state_s.as_str()),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "8"),
    ]);
    let sessions = state.join("sessions");
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.put_bytes(&s, "before.txt", b"room\n").await.unwrap();

    let filler = fill(fs.path());
    let data = vec![7u8; 256 << 10];
    let info = c.put_bytes(&s, "sub/dir/early.bin", &data).await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    let mut src = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut src, &data).unwrap();
    let info = c.put_fd(&s, "fd.bin", src).await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    let out = c
        .execute_collect(
            &s,
            "with open('early.bin', 'wb') as f:\n    f.write(b'x' * 1000000)\nprint('written')\n",
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "written\n", "{:?}", out.result);
    // Starting a session needs no room.
    let out = c
        .run_collect("python", "print('one-shot')", None)
        .await
        .unwrap();
    assert_eq!(out.stdout, "one-shot\n", "{:?}", out.result);

    // Room again: everything works.
    std::fs::remove_file(&filler).unwrap();
    let info = c.put_bytes(&s, "sub/dir/data.bin", &data).await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    let out = c
        .execute_collect(
            &s,
            "with open('out.bin', 'wb') as f:\n    f.write(b'x' * 1000000)\nprint(len(open('sub/dir/data.bin', 'rb').read()))\n",
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "262144\n", "{:?}", out.result);
    assert!(
        out.result
            .files
            .iter()
            .any(|f| f.name == "out.bin" && f.size == 1_000_000)
    );
    c.close(&s).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || entries(&sessions).is_empty()
            && d.descendants().is_empty()),
        "left after close: {:?}",
        entries(&sessions)
    );
    drop(c);
    drop(d);
}

/// Opens sessions until one fails; returns the error (each open is answered at once).
async fn open_refused(d: &Daemon) -> KernelError {
    let mut c = d.client().await;
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), c.open("python", None, None))
        .await
        .expect("Open must be answered");
    eprintln!("Open answered in {:?}: {r:?}", t0.elapsed());
    match r {
        Err(Error::Kernel(e)) => e,
        other => panic!("Open must fail with a typed error: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cgroup_hierarchy_refusing_groups_fails_open_and_leaks_nothing() {
    if !is_root() || common::insecure() {
        sandcell_testing::skip!("cgroups", "needs a root daemon with cgroups");
    }
    // Two sessions' worth of everything: a leaked uid or charge shows as a refusal below.
    let (base, count, name) = private_identity(2);
    let (base_s, count_s) = (base.to_string(), count.to_string());
    let d = Daemon::start(&[
        ("SANDCELL_WORKER_UID_BASE", base_s.as_str()),
        ("SANDCELL_WORKER_UID_COUNT", count_s.as_str()),
        ("SANDCELL_CGROUP_NAME", name.as_str()),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "2"),
        ("SANDCELL_MAX_SESSIONS_PER_UID", "2"),
    ]);
    let sessions = d.dir.path().join("state/sessions");
    let parents = sessions_parents(&name);
    let Some(pids_parent) = parents
        .iter()
        .find(|p| p.join("pids.max").exists())
        .cloned()
    else {
        sandcell_testing::skip!(
            "cgroups",
            "no cgroup v1 pids hierarchy holds {name}/sessions (a cgroup v2 host)"
        );
    };
    let clean = || {
        d.descendants().is_empty()
            && procs_of_uids(base, count).is_empty()
            && entries(&sessions).is_empty()
            && session_groups(&parents).is_empty()
    };

    // 1. mkdir of the session's group fails: its parent is gone from the pids hierarchy.
    std::fs::remove_dir(&pids_parent).unwrap();
    for _ in 0..3 {
        match open_refused(&d).await {
            KernelError::WorkerFailed { reason } => {
                // (An error's strings are cut to 128 bytes; the log has the whole reason.)
                assert!(reason.starts_with("cgroup create"), "{reason}")
            }
            other => panic!("expected WorkerFailed, got {other:?}"),
        }
        assert!(
            eventually(Duration::from_secs(5), clean),
            "a refused Open left something"
        );
    }
    std::fs::create_dir(&pids_parent).unwrap();

    // 2. The group is made but may hold no process: pids.max = 0 on the sessions parent.
    std::fs::write(pids_parent.join("pids.max"), "0").unwrap();
    for _ in 0..3 {
        match open_refused(&d).await {
            KernelError::WorkerFailed { .. } => {}
            other => panic!("expected WorkerFailed, got {other:?}"),
        }
        assert!(
            eventually(Duration::from_secs(5), clean),
            "a refused Open left something: {:?} {:?} {:?}",
            d.descendants(),
            entries(&sessions),
            session_groups(&parents)
        );
    }
    std::fs::write(pids_parent.join("pids.max"), "max").unwrap();

    // The fault removed: two sessions at once (every uid and charge came back).
    let mut a = d.client().await;
    let mut b = d.client().await;
    let sa = a.open("python", None, None).await.unwrap().session;
    let sb = b.open("python", None, None).await.unwrap().session;
    assert_eq!(
        a.execute_collect(&sa, "print(1)").await.unwrap().stdout,
        "1\n"
    );
    assert_eq!(
        b.execute_collect(&sb, "print(2)").await.unwrap().stdout,
        "2\n"
    );
    a.close(&sa).await.unwrap();
    b.close(&sb).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), clean),
        "sessions left something"
    );
}

// ---- polkitd and the system bus ---------------------------------------------------------

/// `sandcellctl run -` of `code` as `user`, through the daemon's socket.
fn run_as(d: &Daemon, user: &User, code: &str) -> Out {
    run_input(
        Command::new("setpriv")
            .arg(format!("--reuid={}", user.uid))
            .arg(format!("--regid={}", user.gid))
            .arg("--init-groups")
            .arg(common::bin_dir().join("sandcellctl"))
            .args(["run", "-"])
            .env("SANDCELL_SOCKET", &d.socket),
        code,
    )
}

/// Asserts that `user`'s run is refused by the fail-closed authority, promptly.
fn assert_refused(d: &Daemon, user: &User, when: &str) {
    let t0 = Instant::now();
    let o = run_as(d, user, "print(1)\n");
    assert_eq!(
        o.code, 3,
        "{when}: a granted user must be refused: {} {}",
        o.stdout, o.stderr
    );
    assert!(
        o.stderr.contains("PermissionDenied") && o.stderr.contains("org.sandcell.execute"),
        "{when}: {}",
        o.stderr
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "{when}: refusal took {:?}",
        t0.elapsed()
    );
    eprintln!("{when}: granted user refused in {:?}", t0.elapsed());
}

/// Waits until `user`'s run is served again; returns how long that took.
fn assert_served_again(d: &Daemon, user: &User, when: &str) -> Duration {
    let t0 = Instant::now();
    let mut last = None;
    let ok = eventually(Duration::from_secs(45), || {
        let o = run_as(d, user, "print(6 * 7)\n");
        let ok = o.code == 0 && o.stdout == "42\n";
        last = Some((o.code, o.stdout, o.stderr));
        ok
    });
    assert!(
        ok,
        "{when}: the granted user is not served again: {last:?}\n{}",
        d.log_text()
    );
    t0.elapsed()
}

async fn root_runs(d: &Daemon, when: &str) {
    let mut c = d.client().await;
    let out = c
        .run_collect("python", "print('root')", None)
        .await
        .unwrap_or_else(|e| panic!("{when}: root must be served: {e}"));
    assert_eq!(out.stdout, "root\n", "{when}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polkitd_and_the_bus_going_away_fail_closed_and_recover() {
    if !is_root() {
        sandcell_testing::skip!(
            "root",
            "useradd, polkit's directories and setpriv need root"
        );
    }
    for tool in ["dbus-daemon", "busctl", "setpriv"] {
        if Command::new(tool).arg("--version").output().is_err() {
            sandcell_testing::skip!("dbus", "{tool} missing");
        }
    }
    if !Path::new(POLKITD).exists() {
        sandcell_testing::skip!("polkit", "{POLKITD} missing (apt-get install polkitd)");
    }
    let mut bus = Bus::start();
    let mut pk = Polkit::start(&bus, &format!("sctf{}", rand_hex(3)));
    let alice = pk.add_user("f", true);
    let d = Daemon::start(&[("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)]);
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    assert!(
        d.log_text().contains("polkit decides authorization"),
        "polkit not selected:\n{}",
        d.log_text()
    );
    let o = run_as(&d, &alice, "print(6 * 7)\n");
    assert_eq!((o.code, o.stdout.as_str()), (0, "42\n"), "{}", o.stderr);

    // polkitd stops: fail closed (root only), then served again once it is back.
    pk.stop_polkitd();
    assert!(eventually(Duration::from_secs(10), || !bus.polkit_up()));
    assert_refused(&d, &alice, "polkitd stopped");
    root_runs(&d, "polkitd stopped").await;
    pk.start_polkitd(&bus);
    let took = assert_served_again(&d, &alice, "polkitd restarted");
    eprintln!("polkitd restarted: granted user served again after {took:?}");

    // The bus goes away (polkitd with it): Varlink keeps serving root, fails closed for the
    // rest, and the daemon reconnects when the bus is back.
    let ups = |d: &Daemon| d.log_text().matches("D-Bus control plane up").count();
    let ups0 = ups(&d);
    bus.stop();
    pk.stop_polkitd();
    assert!(
        eventually(Duration::from_secs(10), || d
            .log_text()
            .contains("system bus connection lost")),
        "the daemon did not notice the bus going away:\n{}",
        d.log_text()
    );
    root_runs(&d, "bus gone").await;
    assert_refused(&d, &alice, "bus gone");
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&s, "k = 5").await.unwrap();
    bus.restart();
    pk.start_polkitd(&bus);
    assert!(
        eventually(Duration::from_secs(45), || ups(&d) > ups0),
        "no reconnect within 45 s:\n{}",
        d.log_text()
    );
    let took = assert_served_again(&d, &alice, "bus restarted");
    eprintln!("bus restarted: granted user served again after {took:?}");
    // The session opened while the bus was gone is counted on the new connection (once the
    // one-shot runs above are released), and kept its state.
    let mut last = String::new();
    assert!(
        eventually(Duration::from_secs(10), || {
            let o = run(bus.busctl().args([
                "get-property",
                "org.sandcell.Sandcell1",
                "/org/sandcell/Sandcell1",
                "org.sandcell.Manager1",
                "ActiveSessions",
            ]));
            last = format!("{} {} {}", o.code, o.stdout.trim(), o.stderr);
            o.code == 0 && o.stdout.trim() == "u 1"
        }),
        "ActiveSessions after the reconnect: {last}"
    );
    assert_eq!(
        c.execute_collect(&s, "print(k)").await.unwrap().stdout,
        "5\n"
    );
    c.close(&s).await.unwrap();
    assert!(eventually(Duration::from_secs(10), || d
        .descendants()
        .is_empty()));
    drop(c);
    drop(d);
    drop(pk);
    drop(bus);
}
