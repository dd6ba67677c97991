//! Sessions outlive their daemon, against the real daemon, workers, cgroups and keepers: a
//! daemon killed with SIGKILL, or told to exit keeping sessions (SIGUSR2), is followed by a
//! new daemon on the same configuration and state that adopts every session: variables, worker
//! pids, files, owners, per-uid charges and idle deadlines are as before. A plain SIGTERM still
//! ends every worker; a record that does not match the live worker ends its session
//! (`adoption_refused`) and signals nobody; keepers nobody adopts end their sessions after
//! `adopt_timeout_seconds`.

use crate::common;

use common::{Daemon, call_as, rand_hex};
use sandcell_client::{Client, Error, KernelError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

macro_rules! skip_unless_root {
    () => {
        if common::insecure() {
            sandcell_testing::skip!(
                "root",
                "keepers join session cgroups and adoption needs a root daemon with cgroups"
            );
        }
    };
}

/// The record of session `id` in `adopt`: (worker pid, keeper pid).
fn record_pids(adopt: &Path, id: &str) -> (u32, u32) {
    let text = std::fs::read_to_string(adopt.join(format!("{id}.json")))
        .unwrap_or_else(|e| panic!("record of {id}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    (
        v["worker"]["pid"].as_u64().unwrap() as u32,
        v["keeper"]["pid"].as_u64().unwrap() as u32,
    )
}

/// Waits (at most 30 s) until the daemon `d` killed itself at a kill seam has exited.
fn wait_dead(d: &mut Daemon) {
    let t0 = Instant::now();
    while !matches!(d.child.try_wait(), Ok(Some(_))) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the daemon did not die"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn kill_daemon(d: &mut Daemon, signal: i32) {
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(d.child.id() as i32, signal) };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = d.child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the daemon did not exit on signal {signal}");
}

struct Setup {
    env: Vec<(String, String)>,
    adopt: PathBuf,
}

impl Setup {
    /// The test's cgroup name (`SANDCELL_CGROUP_NAME`), unique per test.
    fn cgroup_name(&self) -> &str {
        self.env
            .iter()
            .find(|(k, _)| k == "SANDCELL_CGROUP_NAME")
            .map(|(_, v)| v.as_str())
            .expect("first_daemon sets SANDCELL_CGROUP_NAME")
    }
}

/// Where the test daemons' cgroup v1 groups named `name` are: in each v1 hierarchy of memory,
/// pids or cpu, below this process's own group when that is a systemd unit's and below the
/// root otherwise, as the v1 backend places them (`cgroup::v1::V1::open`); empty without v1
/// hierarchies.
fn v1_groups(name: &str) -> Vec<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut dirs = Vec::new();
    for m in mounts.lines() {
        let f: Vec<&str> = m.split(' ').collect();
        if f.len() < 4 || f[2] != "cgroup" {
            continue;
        }
        let opts: Vec<&str> = f[3].split(',').collect();
        let Some(c) = ["memory", "pids", "cpu"]
            .into_iter()
            .find(|c| opts.contains(c))
        else {
            continue;
        };
        let parent = own
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
                Some((controllers, path))
            })
            .find(|(cs, _)| cs.split(',').any(|x| x == c))
            .map(|(_, p)| p)
            .filter(|p| sandcelld::cgroup::v1::is_systemd_unit_group(p))
            .unwrap_or("/");
        dirs.push(
            Path::new(f[1])
                .join(parent.trim_start_matches('/'))
                .join(name),
        );
    }
    dirs
}

/// Every directory below `dir` (itself included), deepest first.
fn dirs_deepest_first(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(dirs_deepest_first(&e.path()));
            }
        }
    }
    if dir.is_dir() {
        out.push(dir.to_path_buf());
    }
    out
}

/// Test hygiene: the empty groups a test's daemons left (a daemon that died or exited keeping
/// its sessions leaves its `supervisor/` and `sessions/`, which under systemd are the unit's
/// to remove) go when the test ends. Only empty groups can be removed (rmdir(2) of a group
/// that holds a process fails with EBUSY): a daemon or keeper still alive keeps its own.
impl Drop for Setup {
    fn drop(&mut self) {
        for g in v1_groups(self.cgroup_name()) {
            for d in dirs_deepest_first(&g) {
                let _ = std::fs::remove_dir(d);
            }
        }
    }
}

/// Asserts that the daemons of `setup`, all stopped with SIGTERM (every session ended), left
/// no cgroup behind: a worker start the stop cut short (a warm worker's, begun by the first
/// cell after an adoption) left its session group before the daemon swept at its exit.
fn assert_no_groups_left(setup: &Setup) {
    let groups = v1_groups(setup.cgroup_name());
    if groups.is_empty() {
        eprintln!(
            "note: no cgroup v1 hierarchy of memory, pids or cpu here: the groups left by the \
             stop are not checked"
        );
        return;
    }
    let t0 = Instant::now();
    loop {
        let left: Vec<PathBuf> = groups.iter().flat_map(|g| dirs_deepest_first(g)).collect();
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "groups left after the daemon stopped: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first daemon, and the settings its successors start with (same cgroup name, state
/// directory and adoption directory).
fn first_daemon(extra: &[(&str, &str)]) -> (Daemon, Setup) {
    first_daemon_in(extra, false)
}

/// [`first_daemon`], in a private mount namespace with `private_mounts` (as the unit starts
/// it: `PrivateMounts=yes`).
fn first_daemon_in(extra: &[(&str, &str)], private_mounts: bool) -> (Daemon, Setup) {
    let cgroup = format!("sandcell-adopt-{}", rand_hex(5));
    let mut env: Vec<(String, String)> = vec![("SANDCELL_CGROUP_NAME".into(), cgroup)];
    for (k, v) in extra {
        env.push((k.to_string(), v.to_string()));
    }
    let borrowed: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let d = if private_mounts {
        Daemon::start_private_mounts(&borrowed, None)
    } else {
        Daemon::start(&borrowed)
    };
    let state = d.dir.path().join("state");
    let adopt = d.dir.path().join("adopt");
    env.push(("SANDCELL_STATE_DIR".into(), state.display().to_string()));
    env.push(("SANDCELL_ADOPT_DIR".into(), adopt.display().to_string()));
    (d, Setup { env, adopt })
}

/// After a call that `first`'s death at its test seam cut (`cut` must say so): waits for the
/// daemon's end, checks that the session's `worker` outlived it, and starts the successor.
fn successor_after_cut<T: std::fmt::Debug>(
    first: &mut Daemon,
    setup: &Setup,
    worker: u32,
    cut: &Result<T, Error>,
) -> Daemon {
    assert!(
        matches!(cut, Err(e) if e.is_call_cut()),
        "{cut:?}\n{}",
        first.log_text()
    );
    wait_dead(first);
    assert!(alive(worker), "the worker died with the daemon");
    successor(first, setup)
}

fn successor(first: &Daemon, s: &Setup) -> Daemon {
    let borrowed: Vec<(&str, &str)> = s
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    Daemon::start_on(&first.socket, &borrowed)
}

/// [`successor`] in a mount namespace of its own, as every start of the unit gets one: the
/// session file systems its predecessor mounted are not in it.
fn successor_private(first: &Daemon, s: &Setup) -> Daemon {
    let borrowed: Vec<(&str, &str)> = s
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    Daemon::start_private_mounts(&borrowed, Some(&first.socket))
}

async fn stdout_of(c: &mut Client, id: &str, code: &str) -> String {
    c.execute_collect(id, code)
        .await
        .unwrap_or_else(|e| panic!("Execute on {id}: {e:?}"))
        .stdout
}

async fn execute_error(c: &mut Client, id: &str) -> KernelError {
    match c.execute_collect(id, "print(1)").await {
        Err(Error::Kernel(e)) => e,
        other => panic!("Execute on {id} must fail: {other:?}"),
    }
}

/// One session of the SIGKILL test: id, language, what sets `v`, what prints it.
struct Opened {
    id: String,
    set: &'static str,
    print: &'static str,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_survive_a_daemon_killed_with_sigkill() {
    skip_unless_root!();
    let r = common::r_available();
    let pydata = common::pydata_available();
    if !r {
        eprintln!("note: R is not installed: R sessions are replaced by Python ones");
    }
    if !pydata {
        eprintln!("note: the pydata stack is not installed: its session is an Eryx one");
    }
    // Each daemon in its own mount namespace, as under the unit (PrivateMounts=yes): the
    // session file systems the first one mounted are not in its successors' namespaces.
    let (mut first, setup) = first_daemon_in(
        &[
            ("SANDCELL_LANGUAGES", if r { "python,r" } else { "python" }),
            ("SANDCELL_MAX_SESSIONS_PER_UID", "8"),
            ("SANDCELL_MAX_DETACHED_SESSIONS_PER_UID", "8"),
            ("SANDCELL_MAX_WORKER_MEMORY_BYTES_PER_UID", "8589934592"),
            ("SANDCELL_MAX_GUEST_MEMORY_BYTES_PER_UID", "1073741824"),
            ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
        ],
        true,
    );
    let mut c = first.client().await;
    let mut sessions: Vec<Opened> = Vec::new();
    // (language, environment, detached idle, host calls)
    let kinds: [(&str, Option<&str>, Option<u64>, bool); 8] = [
        ("python", None, Some(600), false),
        ("python", None, None, false),
        ("python", None, Some(600), true),
        ("python", None, Some(40), false),
        ("python", pydata.then_some("pydata"), Some(600), false),
        (if r { "r" } else { "python" }, None, Some(600), false),
        (if r { "r" } else { "python" }, None, None, false),
        ("python", None, None, true),
    ];
    for (i, (lang, env, idle, host)) in kinds.iter().enumerate() {
        let id = c
            .open_with(&sandcell_client::OpenParams {
                language: lang.to_string(),
                limits: None,
                detached_idle_seconds: *idle,
                environment: env.map(str::to_owned),
                host_calls: host.then_some(true),
                display_last_expression: None,
                rich_output: None,
                egress: None,
            })
            .await
            .unwrap_or_else(|e| panic!("open {lang} {env:?}: {e:?}"))
            .session;
        let (set, print) = if *lang == "r" {
            (["v <- 100", "v <- 105", "v <- 106"][i % 3], "cat(v)")
        } else {
            (
                [
                    "v = 100", "v = 101", "v = 102", "v = 103", "v = 104", "v = 105", "v = 106",
                    "v = 107",
                ][i],
                "print(v)",
            )
        };
        stdout_of(&mut c, &id, set).await;
        sessions.push(Opened { id, set, print });
    }
    c.put_bytes(&sessions[0].id, "kept.txt", b"survives the daemon")
        .await
        .unwrap();
    // The per-uid cap (8) is reached: one more is refused.
    let refused = c.open("python", None, Some(60)).await;
    assert!(
        matches!(
            refused,
            Err(Error::Kernel(KernelError::CapacityExceeded { .. }))
        ),
        "{refused:?}"
    );
    let idle_opened = Instant::now();
    let before: Vec<(u32, u32)> = sessions
        .iter()
        .map(|s| record_pids(&setup.adopt, &s.id))
        .collect();
    let keeper_rss: Vec<u64> = before.iter().map(|(_, k)| rss_kib(*k)).collect();
    eprintln!("keeper RSS, KiB: {keeper_rss:?}");

    // A crash: nothing of the daemon's shutdown runs. The client stays connected meanwhile
    // (a session that is not detached ends when its connection is closed, not when its
    // daemon dies).
    kill_daemon(&mut first, libc::SIGKILL);
    let t_kill = Instant::now();
    drop(c);
    for (w, k) in &before {
        assert!(
            alive(*w) && alive(*k),
            "worker {w} ({}) or keeper {k} ({}) died with the daemon:\n{}",
            alive(*w),
            alive(*k),
            first.log_text()
        );
    }
    let mut second = successor_private(&first, &setup);
    let mut c = second.client().await;
    let out = stdout_of(&mut c, &sessions[0].id, sessions[0].print).await;
    let gap = t_kill.elapsed();
    eprintln!("gap from SIGKILL to the first adopted Execute answered: {gap:?}");
    assert_eq!(out.trim(), "100");
    for (i, s) in sessions.iter().enumerate() {
        let want = s.set.rsplit(' ').next().unwrap();
        let got = stdout_of(&mut c, &s.id, s.print).await;
        assert_eq!(got.trim(), want, "session {i} ({}) lost its variable", s.id);
        let (w, _) = record_pids(&setup.adopt, &s.id);
        assert_eq!(w, before[i].0, "session {i}: the worker changed");
    }
    let pids: Vec<u32> = before.iter().map(|p| p.0).collect();
    eprintln!("worker pids before and after: {pids:?}");
    let (files, _) = c.list_files(&sessions[0].id).await.unwrap();
    assert!(files.iter().any(|f| f.name == "kept.txt"), "{files:?}");
    // The daemon and the worker see one directory: a file put now is read by the cell, and
    // a file the cell writes is listed and read back.
    c.put_bytes(&sessions[0].id, "put-after.txt", b"put after adoption")
        .await
        .unwrap();
    let read = stdout_of(
        &mut c,
        &sessions[0].id,
        "print(open('/mnt/data/put-after.txt').read()); n = open('/mnt/data/cell.txt', 'w').write('from the cell')",
    )
    .await;
    assert_eq!(read.trim(), "put after adoption");
    let (_, got, _) = c
        .get_file_chunk(&sessions[0].id, "cell.txt", 0, None)
        .await
        .unwrap();
    assert_eq!(got, b"from the cell");
    // Owners are enforced: another uid does not see the sessions.
    let reply = call_as(
        65534,
        &second.socket,
        "Execute",
        serde_json::json!({"session": sessions[0].id, "code": "print(1)"}),
    );
    assert_eq!(
        reply["error"], "org.sandcell.Kernel.NoSuchSession",
        "{reply}"
    );
    // The per-uid charges are the same: the cap still refuses one more.
    let refused = c.open("python", None, Some(60)).await;
    assert!(
        matches!(
            refused,
            Err(Error::Kernel(KernelError::CapacityExceeded { .. }))
        ),
        "{refused:?}"
    );
    // Idle deadlines are kept: the 40 s session ends 40 s after its last cell (the one run
    // just above), whatever the adoption did.
    let _ = idle_opened;
    let t_last = Instant::now();
    let idle = &sessions[3].id;
    let t0 = Instant::now();
    loop {
        match c.list_files(idle).await {
            Err(Error::Kernel(KernelError::SessionEnded { reason, .. })) => {
                assert_eq!(reason, "idle_expired");
                break;
            }
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "idle session never expired"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(t_last.elapsed() < Duration::from_secs(45));
    // A slot is free again: one open succeeds, and then the cap holds once more.
    let extra = c.open("python", None, Some(60)).await.unwrap().session;
    stdout_of(&mut c, &extra, "x = 7").await;
    c.put_bytes(&extra, "second.txt", b"opened by the second daemon")
        .await
        .unwrap();
    // A third daemon, in a third namespace, adopts sessions whose file systems were mounted
    // in two others: the first daemon's and the second's.
    kill_daemon(&mut second, libc::SIGKILL);
    drop(c);
    let third = successor_private(&first, &setup);
    let mut c = third.client().await;
    assert_eq!(
        stdout_of(&mut c, &sessions[0].id, sessions[0].print)
            .await
            .trim(),
        "100"
    );
    assert_eq!(stdout_of(&mut c, &extra, "print(x)").await.trim(), "7");
    for (id, name) in [(&sessions[0].id, "cell.txt"), (&extra, "second.txt")] {
        let (files, _) = c.list_files(id).await.unwrap();
        assert!(files.iter().any(|f| f.name == name), "{id}: {files:?}");
    }
    drop(c);
    drop(third);
    // The successor's SIGTERM (its Drop) ended every worker and keeper.
    for (w, k) in &before {
        assert!(
            common::eventually(Duration::from_secs(20), || !alive(*w) && !alive(*k)),
            "worker {w} or keeper {k} outlived the stop"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_keeps_sessions_sigterm_ends_them_and_forged_records_are_refused() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    let b = c.open("python", None, None).await.unwrap().session;
    stdout_of(&mut c, &a, "x = 'kept-a'").await;
    stdout_of(&mut c, &b, "x = 'kept-b'").await;
    let (wa, _) = record_pids(&setup.adopt, &a);
    let (wb, _) = record_pids(&setup.adopt, &b);

    // Exit keeping sessions (the client still connected: `b` is not detached).
    kill_daemon(&mut first, libc::SIGUSR2);
    drop(c);
    assert!(alive(wa) && alive(wb));
    let mut second = successor(&first, &setup);
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(x)").await.trim(), "kept-a");
    assert_eq!(stdout_of(&mut c, &b, "print(x)").await.trim(), "kept-b");
    assert_eq!(record_pids(&setup.adopt, &a).0, wa);

    // A forged record: its worker pid names a stranger (a process of this test).
    let mut stranger = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    kill_daemon(&mut second, libc::SIGKILL);
    drop(c);
    let path = setup.adopt.join(format!("{b}.json"));
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["worker"]["pid"] = serde_json::json!(stranger.id());
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let mut third = successor(&first, &setup);
    let mut c = third.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(x)").await.trim(), "kept-a");
    match execute_error(&mut c, &b).await {
        KernelError::SessionEnded { reason, .. } => assert_eq!(reason, "adoption_refused"),
        other => panic!("forged record: {other:?}"),
    }
    assert!(
        matches!(stranger.try_wait(), Ok(None)),
        "the stranger was signalled"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(wb)),
        "the refused session's worker lives on"
    );

    // A plain SIGTERM ends every worker, and leaves no record to adopt.
    drop(c);
    kill_daemon(&mut third, libc::SIGTERM);
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(wa)),
        "SIGTERM left the worker"
    );
    assert!(!setup.adopt.join(format!("{a}.json")).exists());
}

/// The session's recorded cgroup directories (the parents of its `cgroup.procs` files) and
/// its session directory.
fn record_paths(adopt: &Path, id: &str) -> (Vec<PathBuf>, PathBuf) {
    let text = std::fs::read_to_string(adopt.join(format!("{id}.json")))
        .unwrap_or_else(|e| panic!("record of {id}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let groups = v["cgroup_procs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            Path::new(p.as_str().unwrap())
                .parent()
                .unwrap()
                .to_path_buf()
        })
        .collect();
    (groups, PathBuf::from(v["session_dir"].as_str().unwrap()))
}

/// Whether a file system is mounted on `dir` in this mount namespace.
fn mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = dir.display().to_string();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

/// A daemon killed for good (no successor on its state): after `adopt_timeout_seconds` each
/// keeper ends its worker and releases what only a daemon released before: the session's
/// tmpfs is unmounted, its directory, cgroups, record and journal are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepers_nobody_adopts_end_their_sessions_after_the_timeout() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[("SANDCELL_ADOPT_TIMEOUT_SECONDS", "2")]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "x = 1").await;
    c.put_bytes(&a, "kept.txt", b"in the session's tmpfs")
        .await
        .unwrap();
    // A second session with a cell running when the daemon dies (it has a journal too).
    let b = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &b, "y = 1").await;
    let cell = c
        .submit(
            &b,
            "import time\nprint('running', flush=True)\ntime.sleep(60)",
        )
        .await
        .unwrap();
    assert!(
        common::eventually(Duration::from_secs(20), || setup
            .adopt
            .join(format!("{b}.cell"))
            .exists()),
        "no journal for cell {cell}"
    );
    let mut kept = Vec::new();
    for s in [&a, &b] {
        let (w, k) = record_pids(&setup.adopt, s);
        let (groups, dir) = record_paths(&setup.adopt, s);
        assert!(mounted(&dir), "{} is not a mount point", dir.display());
        assert!(!groups.is_empty() && groups.iter().all(|g| g.is_dir()));
        kept.push((s.clone(), w, k, groups, dir));
    }
    drop(c);
    kill_daemon(&mut first, libc::SIGKILL);
    let t0 = Instant::now();
    for (_, w, k, _, _) in &kept {
        assert!(alive(*w) && alive(*k));
    }
    for (_, w, k, _, _) in &kept {
        assert!(
            common::eventually(Duration::from_secs(20), || !alive(*w) && !alive(*k)),
            "worker {w} or keeper {k} outlived the adoption timeout"
        );
    }
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(1500), "ended after {took:?}");
    eprintln!("an unadopted session ended {took:?} after its daemon");
    // No daemon comes back on this state: the keepers released everything themselves.
    for (id, _, _, groups, dir) in &kept {
        assert!(!mounted(dir), "{} is still mounted", dir.display());
        assert!(!dir.exists(), "{} stayed", dir.display());
        for g in groups {
            assert!(!g.exists(), "session cgroup {} stayed", g.display());
        }
        for ext in ["json", "cell", "rest", "before"] {
            let f = setup.adopt.join(format!("{id}.{ext}"));
            assert!(!f.exists(), "{} stayed", f.display());
        }
        assert!(
            !setup
                .adopt
                .join("keepers")
                .join(format!("{id}.sock"))
                .exists(),
            "the keeper's socket stayed"
        );
    }
    // The keeper's end is in the log it inherited (the daemon's standard error).
    assert!(
        first.log_text().contains("no daemon adopted it"),
        "{}",
        first.log_text()
    );
}

/// Attaches to `cell` of session `s` through `c` (a successor's client) and waits, at most
/// 30 s, for the continued cell's end.
async fn attach_until_end(
    c: &mut sandcell_client::Client,
    s: &str,
    cell: u64,
) -> sandcell_client::Collected {
    c.attach(s, cell).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), c.finish(|_| {}))
        .await
        .expect("the continued cell ended")
        .unwrap()
}

/// The cell of the running-cell tests: prints, sleeps across the restart, prints again and
/// sets a variable.
/// Waits (at most 20 s) until the journal of session `id`'s running [`ACROSS`] cell holds
/// its first print; panics with the daemon's log otherwise.
fn wait_first_print_journaled(d: &Daemon, adopt: &Path, id: &str) {
    let journal = adopt.join(format!("{id}.cell"));
    assert!(
        common::eventually(Duration::from_secs(20), || std::fs::read(&journal)
            .is_ok_and(|b| b
                .windows(18)
                .any(|w| w == b"before the restart".as_slice()))),
        "the journal never held the first print:\n{}",
        d.log_text()
    );
}

const ACROSS: &str = "import sys, time\nprint('before the restart')\nsys.stdout.flush()\ntime.sleep(3)\nprint('after the restart')\nv = 42";

/// A detached session's `Submit` cell runs while its daemon goes (`signal`) and a successor
/// adopts it: the cell finishes in the same worker, never signalled, and Attach/CellStatus on
/// the successor give its whole output and result; the next Execute sees its variable.
async fn a_submitted_cell_continues_across(signal: i32) {
    // With SIGKILL each daemon in its own mount namespace, as under the unit.
    let private = signal == libc::SIGKILL;
    let (mut first, setup) = first_daemon_in(&[], private);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &s, "w = 'set before'").await;
    let (worker, keeper) = record_pids(&setup.adopt, &s);
    let cell = c.submit(&s, ACROSS).await.unwrap();
    // The first print is retained in the cell's journal before the daemon goes: a SIGKILL
    // gives it no chance to write anything at its end.
    wait_first_print_journaled(&first, &setup.adopt, &s);
    assert_eq!(c.cell_status(&s, cell).await.unwrap().state, "running");
    let t_event = Instant::now();
    kill_daemon(&mut first, signal);
    drop(c);
    assert!(alive(worker) && alive(keeper), "the worker or keeper died");
    let second = if private {
        successor_private(&first, &setup)
    } else {
        successor(&first, &setup)
    };
    let mut c = second.client().await;
    let st = c.cell_status(&s, cell).await.unwrap();
    eprintln!(
        "signal {signal}: CellStatus {:?} {:?} after the event",
        st.state,
        t_event.elapsed()
    );
    assert!(
        st.state == "running" || st.state == "ok",
        "{st:?}\n{}",
        second.log_text()
    );
    c.attach(&s, cell).await.unwrap();
    let got = c.finish(|_| {}).await.unwrap();
    assert_eq!(
        got.stdout,
        "before the restart\nafter the restart\n",
        "{}",
        second.log_text()
    );
    let r = &got.result;
    assert_eq!(r.status, sandcell_client::Status::Ok, "{r:?}");
    assert_eq!(r.stdout.seen, 37, "{r:?}");
    let retained = r.retained.as_ref().expect("retention counts");
    assert_eq!((retained.stdout.seen, retained.stdout.dropped), (37, 0));
    assert!(
        r.warnings.iter().any(|w| w.contains("daemon restarted")),
        "{:?}",
        r.warnings
    );
    // CellStatus agrees, on a fresh connection.
    let mut d = second.client().await;
    let st = d.cell_status(&s, cell).await.unwrap();
    assert_eq!(st.state, "ok");
    assert_eq!(st.result.unwrap().status, sandcell_client::Status::Ok);
    // The variables: the cell's and the ones before it.
    assert_eq!(
        stdout_of(&mut d, &s, "print(v, w)").await.trim(),
        "42 set before"
    );
    let (w2, _) = record_pids(&setup.adopt, &s);
    assert_eq!(w2, worker, "the worker changed");
    // The journal stays with the last retained cell's result (a later successor answers for
    // it); the spools go with their cell.
    for stream in ["stdout", "stderr", "replies"] {
        let p = setup.adopt.join(format!("{s}.spool-{stream}"));
        assert!(!p.exists(), "{} outlived its cell", p.display());
    }
    eprintln!("signal {signal}: worker pid {worker} before and after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_submitted_cell_is_continued_after_sigusr2() {
    skip_unless_root!();
    a_submitted_cell_continues_across(libc::SIGUSR2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_submitted_cell_is_continued_after_sigkill() {
    skip_unless_root!();
    a_submitted_cell_continues_across(libc::SIGKILL).await;
}

/// A worker writes half a reply frame and blocks across the daemon's end (`signal`): the
/// head the daemon had read is in the cell's reply spool past the offset its journal handled
/// (a SIGKILL gives it no chance to write anything; a planned exit writes nothing more
/// either), so the successor reads it again and the frame completes exactly when the worker
/// writes its tail: nothing is parsed from the middle of a frame, nothing is lost, and the
/// cell goes on untouched.
async fn a_half_frame_is_continued_exactly(signal: i32) {
    skip_unless_root!();
    if !common::pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "a cell writes to its worker's reply pipe (fd 4) only in the native Python worker"
        );
    }
    let (mut first, setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let s = c
        .open_with(&sandcell_client::OpenParams {
            language: "python".into(),
            detached_idle_seconds: Some(600),
            environment: Some("pydata".into()),
            rich_output: Some(true),
            ..Default::default()
        })
        .await
        .unwrap()
        .session;
    stdout_of(&mut c, &s, "w = 5").await;
    let (worker, _) = record_pids(&setup.adopt, &s);
    let cell = c
        .submit(
            &s,
            "import os, time\nos.write(4, b'{\"t\":\"display\",\"cell\":2,\"kind\":\"display\",')\ntime.sleep(3)\nos.write(4, b'\"data\":{\"text/plain\":\"whole\"}}\\n')\nprint('done')\nv = 'reached'",
        )
        .await
        .unwrap();
    assert_eq!(cell, 2, "the frame the cell writes names cell 2");
    // The daemon has read the head (no newline yet) when it goes.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    kill_daemon(&mut first, signal);
    drop(c);
    let spool = setup.adopt.join(format!("{s}.spool-replies"));
    let held = std::fs::read(&spool).unwrap_or_default();
    assert!(
        held.ends_with(b"\"kind\":\"display\","),
        "the head is not in the spool: {:?}\n{}",
        String::from_utf8_lossy(&held),
        first.log_text()
    );
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    let got = attach_until_end(&mut c, &s, cell).await;
    let r = &got.result;
    assert_eq!(
        r.status,
        sandcell_client::Status::Ok,
        "{r:?}\n{}",
        second.log_text()
    );
    assert!(r.error.is_none(), "{r:?}");
    assert!(
        r.displays.as_ref().is_some_and(|d| d.seen > 0),
        "the reassembled display frame was not counted: {r:?}"
    );
    assert_eq!(got.stdout, "done\n", "{r:?}");
    assert!(
        !r.warnings.iter().any(|w| w.contains("lost")),
        "{:?}",
        r.warnings
    );
    assert_eq!(
        stdout_of(&mut c, &s, "print(w, v)").await.trim(),
        "5 reached"
    );
    assert_eq!(record_pids(&setup.adopt, &s).0, worker);
    assert!(!spool.exists(), "the cell's reply spool outlived the cell");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_cut_by_a_crash_is_continued_exactly() {
    a_half_frame_is_continued_exactly(libc::SIGKILL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_exit_hands_a_half_read_frame_over_exactly() {
    a_half_frame_is_continued_exactly(libc::SIGUSR2).await;
}

/// A detached session's `Submit` cell that ended before its daemon went away (`signal`): the
/// successor still answers `CellStatus` and `Attach` for it from the journal (its output and
/// result), and the session goes on.
async fn an_ended_cell_is_answered_across(signal: i32) {
    let private = signal == libc::SIGKILL;
    let (mut first, setup) = first_daemon_in(&[], private);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    let cell = c
        .submit(&s, "print('finished before')\nv = 3")
        .await
        .unwrap();
    let t0 = Instant::now();
    while c.cell_status(&s, cell).await.unwrap().state == "running" {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the cell never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill_daemon(&mut first, signal);
    drop(c);
    let second = if private {
        successor_private(&first, &setup)
    } else {
        successor(&first, &setup)
    };
    let mut c = second.client().await;
    let st = c
        .cell_status(&s, cell)
        .await
        .unwrap_or_else(|e| panic!("CellStatus of the ended cell: {e:?}\n{}", second.log_text()));
    assert_eq!(st.state, "ok", "{st:?}");
    assert_eq!(st.result.unwrap().status, sandcell_client::Status::Ok);
    let got = attach_until_end(&mut c, &s, cell).await;
    assert_eq!(got.stdout, "finished before\n", "{:?}", got.result);
    assert_eq!(got.result.status, sandcell_client::Status::Ok);
    assert_eq!(stdout_of(&mut c, &s, "print(v)").await.trim(), "3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_cell_is_answered_after_sigusr2() {
    skip_unless_root!();
    an_ended_cell_is_answered_across(libc::SIGUSR2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_cell_is_answered_after_sigkill() {
    skip_unless_root!();
    an_ended_cell_is_answered_across(libc::SIGKILL).await;
}

/// The daemon dies (SIGKILL, by its test seam) right after its first splice of a retained
/// cell's output into the cell's spool, before it read the bytes back or journaled them: the
/// instant at which, without a spool, the bytes would be gone with it. The successor reads
/// them again from the spool: the cell's whole output arrives exactly once, and its result
/// says nothing was lost. In the Eryx engine the output comes on the reply pipe; in R on the
/// raw stdout pipe. The seam counts every splice: the first carries the worker's `started`
/// line, which comes at once and may be spliced before the Submit reply has left (a kill
/// there cuts the Submit); the second carries `one`, half a second later.
async fn no_output_is_lost_by_a_crash_after_a_splice(language: &str) {
    let seam = "SANDCELL_TEST_KILL_AFTER_SPLICE";
    let (mut first, mut setup) =
        first_daemon_in(&[(seam, "2"), ("SANDCELL_LANGUAGES", "python,r")], true);
    setup.env.retain(|(k, _)| k != seam);
    let mut c = first.client().await;
    let s = c.open(language, None, Some(600)).await.unwrap().session;
    let code = if language == "r" {
        "Sys.sleep(0.5); cat('one\\n'); Sys.sleep(1.5); cat('two\\n'); v <- 7"
    } else {
        "import sys, time\ntime.sleep(0.5)\nprint('one')\nsys.stdout.flush()\ntime.sleep(1.5)\nprint('two')\nv = 7"
    };
    // The cell writes nothing for half a second: Submit is answered before the first splice.
    let cell = c.submit(&s, code).await.unwrap();
    drop(c);
    let t0 = Instant::now();
    let died = loop {
        if let Ok(Some(st)) = first.child.try_wait() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the daemon never reached its seam:\n{}",
            first.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(died.signal(), Some(libc::SIGKILL), "{died:?}");
    }
    let (worker, _) = record_pids(&setup.adopt, &s);
    assert!(alive(worker), "the worker died with the daemon");
    let second = successor_private(&first, &setup);
    let mut c = second.client().await;
    let got = attach_until_end(&mut c, &s, cell).await;
    let r = &got.result;
    assert_eq!(
        r.status,
        sandcell_client::Status::Ok,
        "{r:?}\n{}",
        second.log_text()
    );
    assert_eq!(got.stdout, "one\ntwo\n", "{r:?}\n{}", second.log_text());
    assert_eq!(r.stdout.seen, 8, "{r:?}");
    assert!(
        r.warnings.iter().any(|w| w.contains("daemon restarted")),
        "{:?}",
        r.warnings
    );
    assert!(
        !r.warnings.iter().any(|w| w.contains("lost")),
        "{:?}",
        r.warnings
    );
    let print = if language == "r" {
        "cat(v)"
    } else {
        "print(v)"
    };
    assert_eq!(stdout_of(&mut c, &s, print).await.trim(), "7");
    assert_eq!(
        record_pids(&setup.adopt, &s).0,
        worker,
        "the worker changed"
    );
    for stream in ["stdout", "stderr", "replies"] {
        let p = setup.adopt.join(format!("{s}.spool-{stream}"));
        assert!(!p.exists(), "{} outlived its cell", p.display());
    }
    eprintln!("{language}: the output taken by the killed daemon arrived once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_python_output_is_lost_by_a_crash_after_a_splice() {
    skip_unless_root!();
    no_output_is_lost_by_a_crash_after_a_splice("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_r_output_is_lost_by_a_crash_after_a_splice() {
    skip_unless_root!();
    if !common::r_available() {
        sandcell_testing::skip!("r", "R is not installed");
    }
    no_output_is_lost_by_a_crash_after_a_splice("r").await;
}

/// The daemon is killed while a cell's record says its request never reached the worker
/// (`before_request`), or after the cell ended and before its result was sent (`cell_ended`):
/// the worker waits for a request either way, so the successor adopts the session idle
/// (same worker, variables kept) instead of ending it; the call in flight is cut.
async fn a_session_between_cells_is_adopted_idle(point: &str) {
    let seam = "SANDCELL_TEST_KILL_AT";
    let (mut first, mut setup) = first_daemon(&[(seam, &format!("{point}:2"))]);
    setup.env.retain(|(k, _)| k != seam);
    let mut c = first.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    assert_eq!(stdout_of(&mut c, &s, "v = 1\nprint(v)").await, "1\n");
    let (worker, _) = record_pids(&setup.adopt, &s);
    // Cell 2: the daemon dies at the seam, and the call is cut.
    let cut = c.execute_collect(&s, "v = 2").await;
    let second = successor_after_cut(&mut first, &setup, worker, &cut);
    assert!(
        second.log_text().contains("adopted idle"),
        "{}",
        second.log_text()
    );
    if point == "request_recorded" {
        assert!(
            second.log_text().contains("never reached the worker"),
            "{}",
            second.log_text()
        );
    }
    let mut c = second.client().await;
    if point != "cell_ended" {
        // The cut cell never ran: its client, which may have had its `started` frame, gets
        // a definite `cancelled` for it, never `NoSuchCell`.
        let st = c.cell_status(&s, 2).await.unwrap();
        let result = st.result.expect("the cell that never ran has a result");
        assert_eq!(result.status, sandcell_client::Status::Cancelled);
        assert!(
            result.warnings.iter().any(|w| w.contains("none of it ran")),
            "{result:?}"
        );
    }
    let want = if point == "cell_ended" { "2" } else { "1" };
    assert_eq!(stdout_of(&mut c, &s, "print(v)").await.trim(), want);
    assert_eq!(
        record_pids(&setup.adopt, &s).0,
        worker,
        "the worker changed"
    );
    c.close(&s).await.unwrap();
    // The close's cell started the warm pool's refill; the SIGTERM now lands while its
    // first worker starts, and the stop leaves no group behind.
    drop(c);
    drop(second);
    assert_no_groups_left(&setup);
    eprintln!("{point}: the session was adopted idle, v = {want}; no cgroup left by the stop");
}

/// A session whose `Open` was answered has its record and its keeper already: a crash right
/// after the answer, before any cell, keeps it (with the same worker), detached or not,
/// Python and R; an `Open` answered before the record was written ended such a session
/// `daemon_restarted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_right_after_open_keeps_the_session() {
    skip_unless_root!();
    let r = common::r_available();
    if !r {
        eprintln!("note: R is not installed: the R session is replaced by a Python one");
    }
    let languages = if r { "python,r" } else { "python" };
    let (mut first, setup) = first_daemon(&[("SANDCELL_LANGUAGES", languages)]);
    let mut c = first.client().await;
    let mut opened = Vec::new();
    let third = if r { "r" } else { "python" };
    for (language, detached) in [("python", None), ("python", Some(600)), (third, Some(600))] {
        let s = c.open(language, None, detached).await.unwrap().session;
        // The answer comes after the record: it is there now.
        let (worker, _) = record_pids(&setup.adopt, &s);
        opened.push((s, worker));
    }
    kill_daemon(&mut first, libc::SIGKILL);
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    for (s, worker) in &opened {
        let out = c.execute_collect(s, "print(6 * 7)").await;
        let out = out.unwrap_or_else(|e| panic!("{s}: {e:?}\n{}", second.log_text()));
        assert_eq!(out.stdout.trim().trim_start_matches("[1] "), "42");
        assert_eq!(
            record_pids(&setup.adopt, s).0,
            *worker,
            "the worker changed"
        );
        c.close(s).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_a_request_reaches_the_worker_keeps_the_session() {
    skip_unless_root!();
    a_session_between_cells_is_adopted_idle("before_request").await;
}

/// The daemon dies after its record offered cell 2 as running (`unconfirmed`) and before the
/// one write(2) of its request: the successor finds both pipes empty, waits for a `started`
/// line that never comes, and adopts the session idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_just_before_the_request_is_written_keeps_the_session() {
    skip_unless_root!();
    a_session_between_cells_is_adopted_idle("request_recorded").await;
}

/// The daemon dies right after the one write(2) of a submitted cell's request, while its
/// record still says the request may not have reached the worker: the successor reads the
/// worker's `started` line, continues the cell in the same worker, and an Attach gives its
/// whole output and result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_just_after_the_request_is_written_continues_the_cell() {
    skip_unless_root!();
    let seam = "SANDCELL_TEST_KILL_AT";
    let (mut first, mut setup) = first_daemon(&[(seam, "request_written:2")]);
    setup.env.retain(|(k, _)| k != seam);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    assert_eq!(stdout_of(&mut c, &s, "v = 1\nprint(v)").await, "1\n");
    let (worker, _) = record_pids(&setup.adopt, &s);
    // Cell 2: the daemon dies once its request is in the pipe (the Submit may be answered
    // first, or cut).
    let code = "import time\nprint('in the cell', flush=True)\ntime.sleep(1)\nv = 2\nprint('v', v)";
    let submitted = c.submit(&s, code).await;
    assert!(
        matches!(&submitted, Ok(2)) || matches!(&submitted, Err(e) if e.is_call_cut()),
        "{submitted:?}"
    );
    wait_dead(&mut first);
    assert!(
        first.log_text().contains("killing the daemon"),
        "{}",
        first.log_text()
    );
    assert!(alive(worker), "the worker died with the daemon");
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    let got = attach_until_end(&mut c, &s, 2).await;
    assert_eq!(got.stdout, "in the cell\nv 2\n", "{}", second.log_text());
    assert_eq!(
        got.result.status,
        sandcell_client::Status::Ok,
        "{:?}",
        got.result
    );
    assert!(
        second.log_text().contains("continuing the cell"),
        "{}",
        second.log_text()
    );
    assert_eq!(stdout_of(&mut c, &s, "print(v)").await.trim(), "2");
    assert_eq!(
        record_pids(&setup.adopt, &s).0,
        worker,
        "the worker changed"
    );
    c.close(&s).await.unwrap();
}

/// An `Execute` with a token on a detached session, cut by the daemon's death at `point` of
/// its cell (`request_written`: the worker has the code; `before_request`: it never got
/// it), and repeated with the same token on the successor as a client does when its
/// `started` frame never came: the code runs exactly once either way. A repeat of a cell
/// that reached the worker follows it (its whole output and result); one that never
/// reached it runs now. A repeat after the cell ended runs nothing, and a new token runs
/// again.
async fn a_repeated_token_runs_its_code_once(point: &str) {
    let seam = "SANDCELL_TEST_KILL_AT";
    let (mut first, mut setup) = first_daemon(&[(seam, &format!("{point}:2"))]);
    setup.env.retain(|(k, _)| k != seam);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    assert_eq!(stdout_of(&mut c, &s, "n = 0\nprint(n)").await, "0\n");
    let (worker, _) = record_pids(&setup.adopt, &s);
    let code =
        "import time\nprint('in the cell', flush=True)\ntime.sleep(1)\nn += 1\nprint('n', n)";
    let token = "repeat-me.1";
    let cut = match c.execute_with_token(&s, code, Some(token)).await {
        Ok(()) => c.finish(|_| {}).await,
        Err(e) => Err(e),
    };
    let second = successor_after_cut(&mut first, &setup, worker, &cut);
    let mut c = second.client().await;
    c.execute_with_token(&s, code, Some(token)).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), c.finish(|_| {}))
        .await
        .expect("the repeated cell ended")
        .unwrap();
    assert_eq!(got.stdout, "in the cell\nn 1\n", "{}", second.log_text());
    // A cell that never ran keeps its number (answered `cancelled`); its repeat is cell 3.
    let cell = if point == "request_written" { 2 } else { 3 };
    assert_eq!(got.cell, cell, "{got:?}");
    if point == "request_written" {
        assert!(
            second
                .log_text()
                .contains("follows the cell that has its token"),
            "{}",
            second.log_text()
        );
    }
    // After its end: the same token answers the same cell again, running nothing.
    c.execute_with_token(&s, code, Some(token)).await.unwrap();
    let again = c.finish(|_| {}).await.unwrap();
    assert_eq!(
        (again.cell, again.stdout.as_str()),
        (cell, "in the cell\nn 1\n")
    );
    assert_eq!(
        c.submit_with_token(&s, code, Some(token)).await.unwrap(),
        cell,
        "a Submit with the token names the same cell"
    );
    assert_eq!(stdout_of(&mut c, &s, "print(n)").await.trim(), "1");
    // A malformed token is refused before anything runs.
    let bad = c.execute_with_token(&s, code, Some("not a token")).await;
    let bad = match bad {
        Ok(()) => c.finish(|_| {}).await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(
        matches!(&bad, Err(sandcell_client::Error::Kernel(KernelError::InvalidParameter { parameter, .. })) if parameter == "token"),
        "{bad:?}"
    );
    assert_eq!(stdout_of(&mut c, &s, "print(n)").await.trim(), "1");
    assert_eq!(
        record_pids(&setup.adopt, &s).0,
        worker,
        "the worker changed"
    );
    c.close(&s).await.unwrap();
    eprintln!("{point}: the cut Execute repeated with its token ran its code once (n = 1)");
}

/// On a session that ends with its connection, a repeated token never runs code twice
/// either: the repeat of a `Submit` cell (retained) follows it; the repeat of an `Execute`
/// cell (nothing retained to follow) is `NoSuchCell`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_token_on_a_session_that_is_not_detached() {
    skip_unless_root!();
    let (first, _setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    assert_eq!(stdout_of(&mut c, &s, "n = 0\nprint(n)").await, "0\n");
    let code = "n += 1\nprint('n', n)";
    let cell = c.submit_with_token(&s, code, Some("sub-1")).await.unwrap();
    c.execute_with_token(&s, code, Some("sub-1")).await.unwrap();
    let got = c.finish(|_| {}).await.unwrap();
    assert_eq!((got.cell, got.stdout.as_str()), (cell, "n 1\n"));
    c.execute_with_token(&s, code, Some("exe-1")).await.unwrap();
    assert_eq!(c.finish(|_| {}).await.unwrap().stdout, "n 2\n");
    let again = match c.execute_with_token(&s, code, Some("exe-1")).await {
        Ok(()) => c.finish(|_| {}).await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(
        matches!(&again, Err(Error::Kernel(KernelError::NoSuchCell { .. }))),
        "{again:?}"
    );
    assert_eq!(stdout_of(&mut c, &s, "print(n)").await.trim(), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_token_follows_a_cell_that_reached_the_worker() {
    skip_unless_root!();
    a_repeated_token_runs_its_code_once("request_written").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_token_runs_a_cell_that_never_reached_the_worker() {
    skip_unless_root!();
    a_repeated_token_runs_its_code_once("before_request").await;
}

/// A first daemon that dies (its test seam) just before the request of its second cell
/// reaches the worker, with a detached Python session whose first cell set `n = 0`. Returns
/// the daemon, the settings a successor starts with (without the seam) and the session.
async fn dies_before_the_second_request() -> (Daemon, Setup, String) {
    let seam = "SANDCELL_TEST_KILL_AT";
    let (first, mut setup) = first_daemon(&[(seam, "before_request:2")]);
    setup.env.retain(|(k, _)| k != seam);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    assert_eq!(stdout_of(&mut c, &s, "n = 0\nprint(n)").await, "0\n");
    (first, setup, s)
}

/// `sandcellctl exec` on a detached session whose daemon dies (its test seam) before the
/// cell's request reaches the worker, after the `started` frame may have gone out: it sends
/// its call again with the cell's token once the successor is up, which runs the code that
/// never ran, once (an `Attach` to the cut cell would have found it `cancelled`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandcellctl_exec_repeats_a_cut_call_with_its_token() {
    skip_unless_root!();
    let ctl = common::bin_dir().join("sandcellctl");
    if !ctl.exists() {
        sandcell_testing::skip!("built", "{} not built", ctl.display());
    }
    let (mut first, setup, s) = dies_before_the_second_request().await;
    let work = tempfile::tempdir().unwrap();
    let code = work.path().join("cell.py");
    std::fs::write(&code, "n += 1\nprint('n', n)\n").unwrap();
    let (out, err) = (work.path().join("out"), work.path().join("err"));
    let mut exec = std::process::Command::new(&ctl)
        .arg("--socket")
        .arg(&first.socket)
        .args(["exec", &s, code.to_str().unwrap()])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    wait_dead(&mut first);
    let second = successor(&first, &setup);
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = exec.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "sandcellctl never ended after the restart"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status, Some(0), "{err}\n{}", second.log_text());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "n 1\n", "{err}");
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &s, "print(n)").await.trim(), "1");
    c.close(&s).await.unwrap();
}

/// A `sandcellctl mcp` process on the daemon's socket, initialized, with its answers read
/// by a thread. `None` (after printing why) when sandcellctl is not built.
struct Mcp {
    child: std::process::Child,
    input: Option<std::process::ChildStdin>,
    rx: std::sync::mpsc::Receiver<serde_json::Value>,
}

impl Mcp {
    fn start(socket: &Path) -> Option<Mcp> {
        use std::io::BufRead;
        let ctl = common::bin_dir().join("sandcellctl");
        if !ctl.exists() {
            eprintln!("SKIP: {} not built", ctl.display());
            return None;
        }
        let mut child = std::process::Command::new(&ctl)
            .arg("--socket")
            .arg(socket)
            .arg("mcp")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let input = child.stdin.take();
        let output = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(output).lines() {
                let Ok(line) = line else { return };
                if let Ok(v) = serde_json::from_str(&line)
                    && tx.send(v).is_err()
                {
                    return;
                }
            }
        });
        let mut m = Mcp { child, input, rx };
        m.send(&[
            serde_json::json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}}}),
            serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        ]);
        assert_eq!(m.reply(0)["result"]["serverInfo"]["name"], "sandcell");
        Some(m)
    }

    fn send(&mut self, messages: &[serde_json::Value]) {
        use std::io::Write;
        let input = self.input.as_mut().expect("stdin open");
        for m in messages {
            writeln!(input, "{m}").unwrap();
        }
        input.flush().unwrap();
    }

    /// Sends `tools/call` requests of `name` with `arguments`, one per id, at once.
    fn call(&mut self, ids: &[u64], name: &str, arguments: serde_json::Value) {
        let calls: Vec<_> = ids
            .iter()
            .map(|id| {
                serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                    "params": {"name": name, "arguments": arguments}})
            })
            .collect();
        self.send(&calls);
    }

    /// The answer to request `id` (other messages are dropped), within 90 s.
    fn reply(&self, id: u64) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            let left = Duration::from_secs(90).saturating_sub(t0.elapsed());
            let v = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no answer to request {id}"));
            if v["id"] == id {
                return v;
            }
        }
    }

    /// Two `list_files` calls at once, both answered without a tool error: they take two
    /// connections of the server's pool at once.
    fn two_list_files(&mut self, session: &str, ids: [u64; 2]) {
        self.call(&ids, "list_files", serde_json::json!({"session": session}));
        let mut answered = 0;
        while answered < 2 {
            let r = self
                .rx
                .recv_timeout(Duration::from_secs(90))
                .expect("no answer to the list_files calls");
            if ids.iter().any(|id| r["id"] == *id) {
                assert_ne!(r["result"]["isError"], true, "{r}");
                answered += 1;
            }
        }
    }

    /// Closes its standard input, as an MCP client does to stop it (or, with `sigterm`, sends
    /// SIGTERM, as one does to a server that did not exit), and waits (at most 60 s) for its
    /// exit status.
    fn end(mut self, sigterm: bool) -> Option<i32> {
        if sigterm {
            // SAFETY: a signal to our own child, not yet reaped.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        } else {
            self.input = None;
        }
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "sandcellctl mcp did not exit after its stdin closed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sandcellctl mcp`'s `execute` tool on a detached session, cut by a crash before its
/// request reached the worker: the server sends the call again with its cell token, and the
/// tool call's result is the cell's, run once. Its pooled connections that the crash closed
/// are not used for later calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_execute_repeats_a_cut_call_with_its_token() {
    skip_unless_root!();
    let (mut first, setup, s) = dies_before_the_second_request().await;
    let Some(mut mcp) = Mcp::start(&first.socket) else {
        sandcell_testing::skip!("built", "sandcellctl not built");
    };
    // Calls at once before the crash leave connections in the server's pool, which the
    // crash closes.
    mcp.two_list_files(&s, [10, 11]);
    mcp.call(
        &[1],
        "execute",
        serde_json::json!({"session": s, "code": "n += 1\nprint('n', n)"}),
    );
    wait_dead(&mut first);
    let second = successor(&first, &setup);
    let r = mcp.reply(1);
    let out = &r["result"]["structuredContent"];
    assert_eq!(out["status"], "ok", "{r}\n{}", second.log_text());
    assert_eq!(out["stdout"], "n 1\n", "{r}");
    assert_eq!(out["session"], s.as_str(), "{r}");
    // Two calls at once again take both pooled connections, one of them from before the
    // crash: neither is sent on a closed connection.
    mcp.two_list_files(&s, [2, 3]);
    assert_eq!(mcp.end(false), Some(0));
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &s, "print(n)").await.trim(), "1");
    c.close(&s).await.unwrap();
}

/// A session `sandcellctl mcp` opened without `detached_idle_seconds` survives a crash of
/// sandcelld without an owner (its owner connection died with the daemon); the server keeps
/// using and listing it, and closes it when its stdin closes, so that it still ends with the
/// server instead of living on for `max_detached_idle_seconds`. Its other session, detached,
/// is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_closes_the_sessions_a_crash_left_without_an_owner_when_it_exits() {
    skip_unless_root!();
    mcp_closes_ownerless_sessions_at_exit(false).await;
}

/// As above, the server stopped with SIGTERM instead of by the end of its stdin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_closes_the_sessions_a_crash_left_without_an_owner_on_sigterm() {
    skip_unless_root!();
    mcp_closes_ownerless_sessions_at_exit(true).await;
}

async fn mcp_closes_ownerless_sessions_at_exit(sigterm: bool) {
    let (mut first, setup) = first_daemon(&[]);
    let Some(mut mcp) = Mcp::start(&first.socket) else {
        sandcell_testing::skip!("built", "sandcellctl not built");
    };
    let open = |mcp: &mut Mcp, id: u64, args: serde_json::Value| -> String {
        mcp.call(&[id], "open_session", args);
        let r = mcp.reply(id);
        r["result"]["structuredContent"]["session"]
            .as_str()
            .unwrap_or_else(|| panic!("{r}"))
            .to_owned()
    };
    let owned = open(&mut mcp, 1, serde_json::json!({}));
    let detached = open(
        &mut mcp,
        2,
        serde_json::json!({"detached_idle_seconds": 600}),
    );
    mcp.call(
        &[3],
        "execute",
        serde_json::json!({"session": owned, "code": "x = 41"}),
    );
    assert_eq!(mcp.reply(3)["result"]["structuredContent"]["status"], "ok");
    kill_daemon(&mut first, libc::SIGKILL);
    let second = successor(&first, &setup);
    mcp.call(
        &[4],
        "execute",
        serde_json::json!({"session": owned, "code": "print(x + 1)"}),
    );
    let r = mcp.reply(4);
    assert_eq!(
        r["result"]["structuredContent"]["stdout"],
        "42\n",
        "{r}\n{}",
        second.log_text()
    );
    mcp.call(&[5], "list_sessions", serde_json::json!({}));
    let r = mcp.reply(5);
    let listed: Vec<_> = r["result"]["structuredContent"]["sessions"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"))
        .iter()
        .map(|s| s["session"].as_str().unwrap().to_owned())
        .collect();
    assert!(listed.contains(&owned), "{r}");
    assert!(listed.contains(&detached), "{r}");
    assert_eq!(mcp.end(sigterm), Some(0));
    let mut c = second.client().await;
    match execute_error(&mut c, &owned).await {
        KernelError::SessionEnded { reason, .. } => assert_eq!(reason, "closed"),
        other => panic!("{other:?}"),
    }
    let out = c.execute_collect(&detached, "print(1)").await;
    assert!(out.is_ok(), "{out:?}\n{}", second.log_text());
    c.close(&detached).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_cell_ended_keeps_the_session() {
    skip_unless_root!();
    a_session_between_cells_is_adopted_idle("cell_ended").await;
}

/// A retained R cell floods its output (40 MB, far past its cap, on its raw stdout pipe):
/// every byte goes through its spool, and the spool's allocated size stays bounded (what the journal has
/// accounted for is released as the cell runs), so a tenant cannot grow the adoption
/// directory's file system with output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_cell_keeps_its_spool_bounded() {
    skip_unless_root!();
    use std::os::unix::fs::MetadataExt;
    if !common::r_available() {
        sandcell_testing::skip!("r", "R writes its output to a raw pipe, spooled as a whole");
    }
    let (first, setup) = first_daemon(&[("SANDCELL_LANGUAGES", "python,r")]);
    let mut c = first.client().await;
    let s = c.open("r", None, Some(600)).await.unwrap().session;
    let cell = c
        .submit(
            &s,
            "line <- strrep('x', 99999); for (i in 1:400) cat(line, '\\n', sep = ''); v <- 1",
        )
        .await
        .unwrap();
    let spool = setup.adopt.join(format!("{s}.spool-stdout"));
    let (mut most, mut seen_size) = (0u64, 0u64);
    let t0 = Instant::now();
    while c.cell_status(&s, cell).await.unwrap().state == "running" {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the cell never ended"
        );
        if let Ok(m) = std::fs::metadata(&spool) {
            most = most.max(m.blocks() * 512);
            seen_size = seen_size.max(m.len());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let got = attach_until_end(&mut c, &s, cell).await;
    assert_eq!(got.result.stdout.seen, 40_000_000, "{:?}", got.result);
    eprintln!("spool: at most {most} bytes allocated while its offsets reached {seen_size} bytes");
    assert!(
        most <= 8 * 1024 * 1024,
        "the spool held {most} bytes at once\n{}",
        first.log_text()
    );
    assert!(!spool.exists(), "the spool outlived its cell");
}

/// A cell started by `Execute` on a session that is not detached: the restart cuts the call
/// that started it, so the successor interrupts it (as for a client that goes away during a
/// cell) and keeps the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execute_cut_by_the_restart_is_interrupted_and_its_session_kept() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    stdout_of(&mut c, &s, "w = 9").await;
    let (worker, _) = record_pids(&setup.adopt, &s);
    c.execute(&s, "import time\ntime.sleep(30)\nw = 10")
        .await
        .unwrap();
    assert!(
        common::eventually(Duration::from_secs(20), || {
            std::fs::read_to_string(setup.adopt.join(format!("{s}.json")))
                .is_ok_and(|t| t.contains("\"running\":{"))
        }),
        "the record never showed the running cell"
    );
    kill_daemon(&mut first, libc::SIGUSR2);
    let t0 = Instant::now();
    let second = successor(&first, &setup);
    let mut c2 = second.client().await;
    // The interrupted cell ends within moments; then the session takes cells again.
    let out = loop {
        match c2.execute_collect(&s, "print(w)").await {
            Ok(got) => break got.stdout,
            Err(Error::Kernel(KernelError::SessionBusy { .. })) => {
                assert!(t0.elapsed() < Duration::from_secs(20), "still busy");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e:?}\n{}", second.log_text()),
        }
    };
    assert_eq!(out.trim(), "9");
    assert_eq!(record_pids(&setup.adopt, &s).0, worker);
    drop(c);
}

/// The session keepers the daemon `daemon` started (its children running `sandcelld keep`).
fn keepers_of(daemon: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 2..].split(' ').nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(daemon) && common::is_keeper(pid) {
            out.push(pid);
        }
    }
    out
}

/// A one-shot `Run` is never adopted (once its cell is queued a successor could only end it),
/// so its session gets no keeper and no record, which would cost the `Run` a process start
/// before its cell; a session opened beside it has both. A restart during the `Run` still
/// ends its session (`daemon_restarted`, from the owner marker) and its worker (the
/// successor's sweep of its cgroup), and the opened session is adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_shot_run_has_no_keeper_and_a_restart_ends_its_session() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let kept = c.open("python", None, None).await.unwrap().session;
    assert_eq!(
        stdout_of(&mut c, &kept, "v = 41\nprint(v + 1)").await,
        "42\n"
    );
    assert!(
        setup.adopt.join(format!("{kept}.json")).exists(),
        "the opened session has no record"
    );
    assert_eq!(
        keepers_of(first.pid()).len(),
        1,
        "the opened session's keeper"
    );
    let before = first.descendants();
    let mut r = first.client().await;
    r.run("python", "import time\ntime.sleep(30)", None)
        .await
        .unwrap();
    let started = r.next_frame().await.unwrap().started.expect("started");
    let s = started.session;
    let mut worker = None;
    assert!(
        common::eventually(Duration::from_secs(20), || {
            worker = first
                .descendants()
                .into_iter()
                .find(|p| !before.contains(p));
            worker.is_some()
        }),
        "the one-shot Run's worker was not found"
    );
    let worker = worker.unwrap();
    // A keeper and the first record come before the session's first command: had the Run's
    // session been kept, both would be there once its cell started.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !setup.adopt.join(format!("{s}.json")).exists(),
        "the one-shot Run's session has a record"
    );
    assert_eq!(
        keepers_of(first.pid()).len(),
        1,
        "the one-shot Run's session has a keeper"
    );
    kill_daemon(&mut first, libc::SIGUSR2);
    drop(r);
    drop(c);
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    match execute_error(&mut c, &s).await {
        KernelError::SessionEnded { reason, .. } => assert_eq!(reason, "daemon_restarted"),
        other => panic!("{other:?}"),
    }
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(worker)),
        "the one-shot worker lives on"
    );
    assert_eq!(stdout_of(&mut c, &kept, "print(v)").await, "41\n");
}

fn oom_score_adj(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// A restart that keeps sessions kills the warm pool's idle worker itself: it belongs to no
/// session (no keeper, no record), so nothing adopts it, and left behind the successor's
/// start-up sweep would kill it (on the VM, one "worker" of two was signalled on every
/// upgrade and crash). The exit does not wait for the worker's end; the successor removes
/// the empty group and kills nothing. The keeper runs at oom_score_adj -1000 (spared by its
/// group's memory.oom.group kill), the worker at 1000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_restart_kills_the_pooled_workers_and_the_successor_kills_nothing() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "1"),
    ]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "x = 'kept'").await;
    let (w, k) = record_pids(&setup.adopt, &a);
    assert_eq!(oom_score_adj(w), "1000", "the worker's oom_score_adj");
    if has_sys_resource() {
        assert_eq!(
            oom_score_adj(k),
            "-1000",
            "the keeper's oom_score_adj (OOM_SCORE_ADJ_MIN)"
        );
    } else {
        eprintln!(
            "note: this machine's root has no CAP_SYS_RESOURCE: the keeper keeps the daemon's \
             oom_score_adj ({}), -1000 is not checked here",
            oom_score_adj(k)
        );
    }
    // An idle pooled worker beside the session's.
    let pooled = || -> Vec<u32> {
        first
            .descendants()
            .into_iter()
            .filter(|p| *p != w && *p != k && is_worker(*p))
            .collect()
    };
    assert!(
        common::eventually(Duration::from_secs(20), || first
            .log_text()
            .contains("warm worker ready")
            && !pooled().is_empty()),
        "the pool did not fill:\n{}",
        first.log_text()
    );
    let pooled = pooled();
    kill_daemon(&mut first, libc::SIGUSR2);
    drop(c);
    let log = first.log_text();
    assert!(
        log.contains("warm pooled workers killed"),
        "the exiting daemon left its pooled worker:\n{log}"
    );
    assert!(alive(w) && alive(k));
    // The successor at once: its sweep may find a killed worker not yet torn down, which the
    // predecessor's list (pool-killed) marks as expected.
    let second = successor(&first, &setup);
    // Killed by the exiting daemon, which does not wait for their end (the kernel's
    // teardown of a worker would hold the exit, and every waiting client, with it).
    for p in &pooled {
        assert!(
            common::eventually(Duration::from_secs(10), || !alive(*p) || !is_worker(*p)),
            "pooled worker {p} outlived its daemon"
        );
    }
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(x)").await.trim(), "kept");
    let log = second.log_text();
    assert!(
        !log.contains("killed and removed session groups left by a previous daemon"),
        "the successor killed a worker:\n{log}"
    );
    assert!(
        log.contains("removed session groups left by a previous daemon; no worker was killed"),
        "the successor did not remove the pooled worker's empty group:\n{log}"
    );
    assert_eq!(record_pids(&setup.adopt, &a).0, w);
}

/// The ids of the keepers in `adopt` that serve no recorded session: warm pooled workers'.
fn warm_keepers(adopt: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(adopt.join("keepers"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let id = name.strip_suffix(".sock")?.to_string();
                    (!adopt.join(format!("{id}.json")).exists()).then_some(id)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A warm pooled worker comes with its keeper: the session that takes it has the keeper
/// that was started in the pool (its socket was there before the `Open`), no process is
/// started on the `Open`'s path, and the session survives a crash like any other. A
/// one-shot `Run` on a warm worker ends its keeper. The pooled workers a crash leaves are
/// ended by their own keepers at once, and their directories released, before any successor
/// starts: no successor adopts a pooled worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_worker_comes_with_its_keeper_which_ends_it_when_the_daemon_dies() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "2"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
    ]);
    let state = PathBuf::from(
        &setup
            .env
            .iter()
            .find(|(k, _)| k == "SANDCELL_STATE_DIR")
            .unwrap()
            .1,
    );
    assert!(
        common::eventually(Duration::from_secs(60), || warm_keepers(&setup.adopt).len()
            >= 2),
        "no warm keepers: {:?}\n{}",
        warm_keepers(&setup.adopt),
        first.log_text()
    );
    let mut c = first.client().await;
    // A one-shot Run takes a warm worker and ends its keeper.
    let before = warm_keepers(&setup.adopt);
    let out = c.run_collect("python", "print(6 * 7)", None).await.unwrap();
    assert_eq!(out.stdout.trim(), "42");
    assert!(
        common::eventually(Duration::from_secs(10), || {
            let now = warm_keepers(&setup.adopt);
            before.iter().filter(|id| !now.contains(*id)).count() == 1
        }),
        "the Run's warm keeper stayed: {before:?} {:?}",
        warm_keepers(&setup.adopt)
    );
    assert!(
        common::eventually(Duration::from_secs(60), || warm_keepers(&setup.adopt).len()
            >= 2),
        "the pool did not refill"
    );
    let before = warm_keepers(&setup.adopt);
    let a = c.open("python", None, None).await.unwrap().session;
    let b = c.open("python", None, Some(600)).await.unwrap().session;
    for s in [&a, &b] {
        assert!(
            before.contains(s),
            "{s} did not come with its warm keeper: {before:?}\n{}",
            first.log_text()
        );
    }
    stdout_of(&mut c, &a, "x = 'a'").await;
    stdout_of(&mut c, &b, "y = 'b'").await;
    let (wa, ka) = record_pids(&setup.adopt, &a);
    let (wb, kb) = record_pids(&setup.adopt, &b);
    assert!(
        common::eventually(Duration::from_secs(60), || warm_keepers(&setup.adopt).len()
            >= 2),
        "the pool did not refill"
    );
    // Let a refill in flight settle: the pool holds two idle workers and starts no more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warm = warm_keepers(&setup.adopt);
    let pooled: Vec<u32> = first
        .descendants()
        .into_iter()
        .filter(|p| ![wa, wb].contains(p) && is_worker(*p))
        .collect();
    assert!(!pooled.is_empty(), "no pooled worker");
    kill_daemon(&mut first, libc::SIGKILL);
    drop(c);
    for p in &pooled {
        assert!(
            common::eventually(Duration::from_secs(10), || !alive(*p) || !is_worker(*p)),
            "pooled worker {p} outlived its daemon"
        );
    }
    assert!(
        common::eventually(Duration::from_secs(10), || warm_keepers(&setup.adopt)
            .is_empty()),
        "warm keepers stayed after their daemon: {:?}",
        warm_keepers(&setup.adopt)
    );
    for id in &warm {
        let dir = state.join("sessions").join(id);
        assert!(
            common::eventually(Duration::from_secs(10), || !dir.exists()),
            "{} stayed",
            dir.display()
        );
    }
    assert!(alive(wa) && alive(ka) && alive(wb) && alive(kb));
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(x)").await.trim(), "a");
    assert_eq!(stdout_of(&mut c, &b, "print(y)").await.trim(), "b");
    assert_eq!(record_pids(&setup.adopt, &a), (wa, ka));
    assert_eq!(record_pids(&setup.adopt, &b), (wb, kb));
}

/// Whether this process holds CAP_SYS_RESOURCE (needed to lower an oom_score_adj, proc(5)).
fn has_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        // CAP_SYS_RESOURCE is capability 24 (linux/capability.h).
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

/// Whether `pid` runs under a per-session worker uid (not root, not this test's uid).
fn is_worker(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok())
        })
        .is_some_and(|uid| uid != 0)
}

/// The successor of a daemon that kept sessions probes its environments in the background;
/// when the adopted sessions hold the capacity the probe needs (here the only slot), the
/// refusal (`CapacityExceeded`) says nothing about the environment: it is not logged as an
/// environment that is not ready, nothing is cached, and a later listing checks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_after_adoption_is_no_failure_when_the_adopted_sessions_hold_the_capacity() {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[("SANDCELL_MAX_CONCURRENT_SESSIONS", "1")]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "x = 3").await;
    kill_daemon(&mut first, libc::SIGKILL);
    drop(c);
    let second = successor(&first, &setup);
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(x)").await.trim(), "3");
    assert!(
        common::eventually(Duration::from_secs(30), || second
            .log_text()
            .contains("readiness probe not run after adoption")),
        "no deferred probe:\n{}",
        second.log_text()
    );
    let log = second.log_text();
    assert!(
        log.contains("CapacityExceeded"),
        "the reason is not given:\n{log}"
    );
    assert!(
        !log.contains("environment not ready after adoption"),
        "a false failure:\n{log}"
    );
    // Nothing was cached: once the slot is free, a listing checks the environment again.
    c.close(&a).await.unwrap();
    let t0 = Instant::now();
    loop {
        let envs = c.list_environments().await.unwrap();
        let py = envs.iter().find(|e| e.name == "python").unwrap().clone();
        if py.ready {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "python never checked after the slot was freed: {py:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The client's view of a call the restart cut: the cell's stream ends with an error that
/// [`Error::is_call_cut`] recognises and whose text says that sandcelld restarted or crashed.
async fn a_cut_call_is_recognised(signal: i32) {
    skip_unless_root!();
    let (mut first, setup) = first_daemon(&[]);
    let mut c = first.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.execute(&s, "import time\ntime.sleep(30)").await.unwrap();
    assert!(
        common::eventually(Duration::from_secs(20), || {
            std::fs::read_to_string(setup.adopt.join(format!("{s}.json")))
                .is_ok_and(|t| t.contains("\"running\":{"))
        }),
        "the record never showed the running cell"
    );
    kill_daemon(&mut first, signal);
    let e = c.finish(|_| {}).await.expect_err("the cut call must fail");
    assert!(e.is_call_cut(), "{e:?}");
    assert!(e.to_string().contains("restarted or crashed"), "{e}");
    let second = successor(&first, &setup);
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_by_a_planned_exit_is_recognised() {
    a_cut_call_is_recognised(libc::SIGUSR2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_by_a_crash_is_recognised() {
    a_cut_call_is_recognised(libc::SIGKILL).await;
}

/// The cell `sandcellctl` follows across a restart: prints a line every 0.4 s, then sets `w`.
const COUNTING: &str =
    "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.4)\nw = 8";

/// `sandcellctl exec` and `sandcellctl attach` cut by a restart (`signal`) follow their cells
/// in the successor by themselves: every line once, the cell's result and exit status, a note
/// on standard error; a session that really ended gives its typed error.
async fn sandcellctl_follows_across(signal: i32) {
    skip_unless_root!();
    let ctl = common::bin_dir().join("sandcellctl");
    if !ctl.exists() {
        sandcell_testing::skip!("built", "{} not built", ctl.display());
    }
    let private = signal == libc::SIGKILL;
    let (mut first, setup) = first_daemon_in(&[], private);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    let b = c.open("python", None, Some(600)).await.unwrap().session;
    let gone = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "w = 7").await;
    let work = tempfile::tempdir().unwrap();
    let code = work.path().join("cell.py");
    std::fs::write(&code, COUNTING).unwrap();
    let cell_b = c.submit(&b, COUNTING).await.unwrap();
    let cell_gone = c
        .submit(&gone, "import time\ntime.sleep(60)")
        .await
        .unwrap();
    let spawn = |name: &str, args: &[&str]| {
        let out = work.path().join(format!("{name}.out"));
        let err = work.path().join(format!("{name}.err"));
        let child = std::process::Command::new(&ctl)
            .arg("--socket")
            .arg(&first.socket)
            .args(args)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        (child, out, err)
    };
    let cell_b_s = cell_b.to_string();
    let cell_gone_s = cell_gone.to_string();
    let mut exec = spawn("exec", &["exec", &a, code.to_str().unwrap()]);
    let mut attach = spawn("attach", &["attach", &b, &cell_b_s]);
    let mut ended = spawn("ended", &["--json", "attach", &gone, &cell_gone_s]);
    // Both have printed their first lines when the daemon goes.
    for (_, out, _) in [&exec, &attach] {
        assert!(
            common::eventually(Duration::from_secs(30), || std::fs::read_to_string(out)
                .is_ok_and(|t| t.starts_with("0\n1\n"))),
            "{} never showed the first lines:\n{}",
            out.display(),
            first.log_text()
        );
    }
    kill_daemon(&mut first, signal);
    drop(c);
    // The session of `ended` is not adopted: its record is removed before the successor
    // starts, as for a session whose keeper is gone.
    std::fs::remove_file(setup.adopt.join(format!("{gone}.json"))).unwrap();
    let second = if private {
        successor_private(&first, &setup)
    } else {
        successor(&first, &setup)
    };
    let wait = |child: &mut std::process::Child| {
        let t0 = Instant::now();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "sandcellctl never ended after the restart"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let want: String = (0..8).map(|i| format!("{i}\n")).collect();
    for (name, (child, out, err)) in [("exec", &mut exec), ("attach", &mut attach)] {
        let code_ = wait(child);
        let out = std::fs::read_to_string(out).unwrap();
        let err = std::fs::read_to_string(err).unwrap();
        assert_eq!(code_, Some(0), "{name}: {err}\n{}", second.log_text());
        assert_eq!(out, want, "{name}: the output was repeated or lost\n{err}");
        assert!(
            err.contains("sandcelld restarted; following the cell again"),
            "{name}: {err}"
        );
    }
    // The session that really ended: its typed error, status 3.
    let code_ = wait(&mut ended.0);
    let err = std::fs::read_to_string(&ended.2).unwrap();
    assert_eq!(code_, Some(3), "{err}");
    assert!(
        err.contains("org.sandcell.Kernel.SessionEnded")
            || err.contains("org.sandcell.Kernel.NoSuchSession"),
        "{err}"
    );
    let mut c = second.client().await;
    assert_eq!(stdout_of(&mut c, &a, "print(w)").await.trim(), "8");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandcellctl_follows_its_cell_across_a_planned_exit() {
    sandcellctl_follows_across(libc::SIGUSR2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandcellctl_follows_its_cell_across_a_crash() {
    sandcellctl_follows_across(libc::SIGKILL).await;
}

/// A rich session's running cell shows a display bundle (image/png) before the daemon goes
/// (`signal`): an `Attach` on the successor replays the bundle whole, in its place between
/// the output lines, with the retention counts of a cell that never crossed a restart.
async fn display_bundles_survive(signal: i32) {
    skip_unless_root!();
    let private = signal == libc::SIGKILL;
    let (mut first, setup) = first_daemon_in(&[], private);
    let mut c = first.client().await;
    let s = c
        .open_with(&sandcell_client::OpenParams {
            language: "python".into(),
            limits: None,
            detached_idle_seconds: Some(600),
            environment: None,
            host_calls: None,
            display_last_expression: None,
            rich_output: Some(true),
            egress: None,
        })
        .await
        .unwrap()
        .session;
    stdout_of(&mut c, &s, "w = 1").await;
    c.put_bytes(&s, "put.txt", b"before the cell")
        .await
        .unwrap();
    let cell = c
        .submit(
            &s,
            "import sys, time\nfrom sandcell import display\nprint('before')\n\
             display({'text/plain': 'a plot', 'image/png': 'iVBORw0KGgoAAAANSUhEUg=='}, raw=True)\n\
             n = open('/mnt/data/early.txt', 'w').write('before the restart')\n\
             sys.stdout.flush()\ntime.sleep(3)\nprint('after')\n\
             n = open('/mnt/data/late.txt', 'w').write('after the restart')",
        )
        .await
        .unwrap();
    let journal = setup.adopt.join(format!("{s}.cell"));
    assert!(
        common::eventually(Duration::from_secs(30), || std::fs::read(&journal)
            .is_ok_and(|b| b.windows(6).any(|w| w == b"a plot".as_slice()))),
        "the journal never held the bundle:\n{}",
        first.log_text()
    );
    kill_daemon(&mut first, signal);
    drop(c);
    let second = if private {
        successor_private(&first, &setup)
    } else {
        successor(&first, &setup)
    };
    let mut c = second.client().await;
    c.attach(&s, cell).await.unwrap();
    let mut frames = Vec::new();
    let r = loop {
        let f = tokio::time::timeout(Duration::from_secs(30), c.next_frame())
            .await
            .expect("the continued cell ended")
            .unwrap();
        if let Some(r) = f.result.clone() {
            break r;
        }
        frames.push(f);
    };
    assert_eq!(r.status, sandcell_client::Status::Ok, "{r:?}");
    let order: Vec<String> = frames
        .iter()
        .filter_map(|f| {
            f.output.as_ref().map(|o| o.text.clone()).or_else(|| {
                f.display
                    .as_ref()
                    .map(|d| format!("<{}>", d.data["text/plain"]))
            })
        })
        .collect();
    assert_eq!(
        order.concat(),
        "before\n<\"a plot\">after\n",
        "{frames:?}\n{}",
        second.log_text()
    );
    let d = frames.iter().find_map(|f| f.display.as_ref()).unwrap();
    assert_eq!(d.data["image/png"], "iVBORw0KGgoAAAANSUhEUg==");
    let kept = r.retained.as_ref().expect("retention counts");
    let bundles = kept.displays.expect("the bundle is counted");
    assert!(bundles.kept > 0 && bundles.dropped == 0, "{kept:?}");
    // The files it changed are listed, as for a cell that never crossed a restart; the one
    // put before it is not.
    let mut names: Vec<&str> = r.files.iter().map(|f| f.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["early.txt", "late.txt"], "{:?}", r.warnings);
    assert!(
        !r.warnings.iter().any(|w| w.contains("not listed")),
        "{:?}",
        r.warnings
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn display_bundles_are_replayed_after_a_planned_exit() {
    display_bundles_survive(libc::SIGUSR2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn display_bundles_are_replayed_after_a_crash() {
    display_bundles_survive(libc::SIGKILL).await;
}

/// systemd's side of a SIGTERM, on a private bus: `Manager.GetUnitByPID` names a unit whose
/// `Job` property is a job of type `job_type` (org.freedesktop.systemd1(5)), as systemd 252
/// answers during `systemctl restart` ("restart") or `systemctl stop` ("stop").
mod fake_systemd {
    use zbus::zvariant::OwnedObjectPath;

    pub const UNIT: &str = "/org/freedesktop/systemd1/unit/sandcelld_2eservice";
    pub const JOB: &str = "/org/freedesktop/systemd1/job/7";

    pub struct Manager;
    #[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
    impl Manager {
        #[zbus(name = "GetUnitByPID")]
        fn get_unit_by_pid(&self, _pid: u32) -> OwnedObjectPath {
            OwnedObjectPath::try_from(UNIT).unwrap()
        }
    }

    pub struct Unit;
    #[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
    impl Unit {
        #[zbus(property)]
        fn job(&self) -> (u32, OwnedObjectPath) {
            (7, OwnedObjectPath::try_from(JOB).unwrap())
        }
    }

    pub struct Job(pub String);
    #[zbus::interface(name = "org.freedesktop.systemd1.Job")]
    impl Job {
        #[zbus(property)]
        fn job_type(&self) -> String {
            self.0.clone()
        }
    }

    /// Claims org.freedesktop.systemd1 on `address` (the bus policy lets root own it).
    pub async fn serve(address: &str, job_type: &str) -> zbus::Connection {
        zbus::connection::Builder::address(address)
            .unwrap()
            .name("org.freedesktop.systemd1")
            .unwrap()
            .serve_at("/org/freedesktop/systemd1", Manager)
            .unwrap()
            .serve_at(UNIT, Unit)
            .unwrap()
            .serve_at(JOB, Job(job_type.to_owned()))
            .unwrap()
            .build()
            .await
            .expect("claiming org.freedesktop.systemd1 on the private bus")
    }
}

/// The gap a client sees across a restart that keeps sessions: from the signal (`signal`:
/// SIGUSR2, or SIGTERM during a systemd restart job) to the first `Execute` on an adopted
/// session answered, with a successor started as soon as the old daemon is gone (as systemd
/// does after the stop). With a Submit cell running across the event: it is continued and its
/// whole output retrievable. Prints the figures (old daemon's exit, successor ready, first
/// answer).
async fn gap_across(signal: i32) {
    let bus = common::bus::Bus::start();
    let _systemd = fake_systemd::serve(&bus.address, "restart").await;
    let (mut first, setup) = first_daemon(&[
        ("DBUS_SYSTEM_BUS_ADDRESS", bus.address.as_str()),
        ("INVOCATION_ID", "0123456789abcdef0123456789abcdef"),
    ]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "v = 'kept'").await;
    let (worker, _) = record_pids(&setup.adopt, &a);
    let cell = c.submit(&s, ACROSS).await.unwrap();
    wait_first_print_journaled(&first, &setup.adopt, &s);
    // The prepared systemd connection is made in the background after "ready".
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    kill_daemon(&mut first, signal);
    let t_exit = t0.elapsed();
    drop(c);
    let log = first.log_text();
    if signal == libc::SIGTERM {
        assert!(
            log.contains("systemd is restarting the unit: keeping every session"),
            "SIGTERM during a restart job was not read as one:\n{log}"
        );
    }
    let second = successor(&first, &setup);
    let t_ready = t0.elapsed();
    let mut c = second.client().await;
    let got = stdout_of(&mut c, &a, "print(v)").await;
    let t_first = t0.elapsed();
    assert_eq!(got.trim(), "kept");
    assert_eq!(
        record_pids(&setup.adopt, &a).0,
        worker,
        "the worker changed"
    );
    eprintln!(
        "gap across signal {signal}: old daemon gone after {:.3} s, successor ready after {:.3} s, \
         first adopted Execute answered {:.3} s after the signal",
        t_exit.as_secs_f64(),
        t_ready.as_secs_f64(),
        t_first.as_secs_f64()
    );
    let got = attach_until_end(&mut c, &s, cell).await;
    assert_eq!(
        got.stdout,
        "before the restart\nafter the restart\n",
        "{}",
        second.log_text()
    );
    assert_eq!(got.result.status, sandcell_client::Status::Ok);
    // The bus still answers "restart", so the successor's SIGTERM at the end would keep the
    // sessions for a daemon that never comes: they end here instead.
    c.close(&a).await.unwrap();
    c.close(&s).await.unwrap();
}

/// SIGTERM while systemd runs a restart job on the unit (read over the system bus, as
/// systemd 252 answers it): every session and the running cell are kept, as with SIGUSR2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_systemd_restart_job_keeps_sessions_and_the_running_cell() {
    skip_unless_root!();
    gap_across(libc::SIGTERM).await;
}

/// The gap of a restart by SIGUSR2 (no bus question at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gap_of_a_kept_restart_by_sigusr2() {
    skip_unless_root!();
    gap_across(libc::SIGUSR2).await;
}

/// SIGTERM while systemd runs a stop job on the unit (`systemctl stop`, package removal):
/// every worker ends and no record is left, whatever a prepared connection holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_systemd_stop_job_ends_every_session() {
    skip_unless_root!();
    let bus = common::bus::Bus::start();
    let _systemd = fake_systemd::serve(&bus.address, "stop").await;
    let (mut first, setup) = first_daemon(&[
        ("DBUS_SYSTEM_BUS_ADDRESS", bus.address.as_str()),
        ("INVOCATION_ID", "0123456789abcdef0123456789abcdef"),
    ]);
    let mut c = first.client().await;
    let a = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &a, "v = 1").await;
    let (worker, keeper) = record_pids(&setup.adopt, &a);
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(c);
    kill_daemon(&mut first, libc::SIGTERM);
    let log = first.log_text();
    assert!(
        log.contains("systemd job \\\"stop\\\"") || log.contains("systemd job \"stop\""),
        "the stop job was not read:\n{log}"
    );
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(worker) && !alive(keeper)),
        "a stop left the worker or its keeper"
    );
    assert!(!setup.adopt.join(format!("{a}.json")).exists());
}

/// Waits (at most 60 s) until the daemon's log says "ready to serve" `n` times; panics with
/// the log if the daemon exits first.
fn wait_ready_times(d: &mut Daemon, n: usize) {
    let t0 = Instant::now();
    while d.log_text().matches("ready to serve").count() < n {
        if let Ok(Some(st)) = d.child.try_wait() {
            panic!("the daemon exited ({st}):\n{}", d.log_text());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not ready {n} times after 60 s:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGUSR1, the package upgrade's path: the daemon re-executes its binary in place. The same
/// process (pid) serves on; the listening socket passes through the exec, so a connection
/// made while the new image starts is served, its call on a session held until that session
/// is adopted; and every session is kept: worker pids, variables (Python and R), files, and a
/// Submit cell running across the exec, continued with its whole output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reexec_in_place_keeps_the_process_its_socket_and_every_session() {
    skip_unless_root!();
    let r = common::r_available();
    if !r {
        eprintln!("note: R is not installed: the R session is left out");
    }
    // The new image waits 1 s before it adopts (a test seam), so the connection made during
    // the re-exec is accepted while the adoption is under way: its call must wait for it.
    let (mut first, setup) = first_daemon(&[
        ("SANDCELL_LANGUAGES", if r { "python,r" } else { "python" }),
        ("SANDCELL_TEST_ADOPT_DELAY_MS", "1000"),
    ]);
    let pid = first.pid();
    let mut c = first.client().await;
    let py = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &py, "w = 'set before'").await;
    let rs = if r {
        let id = c.open("r", None, Some(600)).await.unwrap().session;
        stdout_of(&mut c, &id, "x <- 7").await;
        Some(id)
    } else {
        None
    };
    c.put_bytes(&py, "kept.txt", b"survives the re-exec")
        .await
        .unwrap();
    let (worker, keeper) = record_pids(&setup.adopt, &py);
    let r_worker = rs.as_ref().map(|id| record_pids(&setup.adopt, id).0);
    let cell = c.submit(&py, ACROSS).await.unwrap();
    wait_first_print_journaled(&first, &setup.adopt, &py);
    let t_event = Instant::now();
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    drop(c);
    // Once the old image says it re-executes it accepts nothing more: a connection made now
    // is the new image's.
    wait_reexec_begun(&first);
    let ready_before = first.log_text().matches("ready to serve").count();
    let mut c = first.client().await;
    let st = c.cell_status(&py, cell).await.unwrap();
    // Accepted while the adoption was under way, answered only once its session was adopted
    // (never NoSuchSession meanwhile; the other sessions may still be being adopted).
    let log = first.log_text();
    let after = &log[log.find("re-executing in place").unwrap()..];
    let accepted = after.find("connection accepted while adopting sessions");
    let py_adopted = after.find(&format!("session adopted session={py}"));
    assert!(
        accepted.is_some() && py_adopted.is_some(),
        "the connection was not accepted during the adoption, or answered before its \
         session was adopted:\n{log}"
    );
    eprintln!(
        "SIGUSR1: CellStatus {:?} {:?} after the signal (the new image was {} when the \
         connection was made)",
        st.state,
        t_event.elapsed(),
        if ready_before >= 2 {
            "ready"
        } else {
            "starting"
        }
    );
    wait_ready_times(&mut first, 2);
    assert!(
        matches!(first.child.try_wait(), Ok(None)),
        "the daemon process exited"
    );
    assert_eq!(first.pid(), pid);
    let log = first.log_text();
    assert!(
        log.contains("sessions of the previous daemon adopted=")
            && !log.contains("killed and removed session groups"),
        "{log}"
    );
    assert!(alive(worker) && alive(keeper), "the worker or keeper died");
    c.attach(&py, cell).await.unwrap();
    let got = c.finish(|_| {}).await.unwrap();
    assert_eq!(
        got.stdout, "before the restart\nafter the restart\n",
        "{log}"
    );
    assert_eq!(got.result.status, sandcell_client::Status::Ok);
    assert_eq!(
        stdout_of(&mut c, &py, "print(v, w)").await.trim(),
        "42 set before"
    );
    assert_eq!(
        record_pids(&setup.adopt, &py).0,
        worker,
        "the worker changed"
    );
    if let (Some(id), Some(w)) = (&rs, r_worker) {
        assert_eq!(stdout_of(&mut c, id, "cat(x)").await.trim(), "7");
        assert_eq!(record_pids(&setup.adopt, id).0, w, "the R worker changed");
    }
    let (_, bytes, _) = c.get_file_chunk(&py, "kept.txt", 0, None).await.unwrap();
    assert_eq!(bytes, b"survives the re-exec");
    // The new image keeps its sessions across a second re-exec too.
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    wait_ready_times(&mut first, 3);
    let mut d = first.client().await;
    assert_eq!(
        stdout_of(&mut d, &py, "print(v)").await.trim(),
        "42",
        "{}",
        first.log_text()
    );
    eprintln!("re-exec: pid {pid} kept, worker {worker} kept, twice");
    // The first image's children (workers, keepers) are still the daemon's: once their
    // sessions end, the new image reaps them (no zombie left holding a pid and a uid).
    d.close(&py).await.unwrap();
    if let Some(id) = &rs {
        d.close(id).await.unwrap();
    }
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(worker)
            && zombie_children(pid).is_empty()),
        "zombie children of the daemon: {:?}\n{}",
        zombie_children(pid),
        first.log_text()
    );
    kill_daemon(&mut first, libc::SIGTERM);
}

/// The daemon's children that exited and nobody reaped (state `Z` in `/proc/<pid>/stat`).
fn zombie_children(daemon: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let mut f = rest.split_whitespace();
            let state = f.next();
            let parent = f.next().and_then(|p| p.parse::<u32>().ok());
            state == Some("Z") && parent == Some(daemon)
        })
        .collect()
}

/// While a daemon adopts its predecessor's sessions, a cell's call on a session waits for that
/// session's adoption only, and the most recently active session is adopted first: the owner
/// who was running cells at the restart is answered while the others are still being
/// adopted. A call on a session not yet adopted waits for it (never `NoSuchSession`), and a
/// call that is not about one session (`ListSessions`) waits for the whole adoption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_on_an_adopted_session_waits_for_that_session_only() {
    skip_unless_root!();
    // The new image waits 3 s after each session it adopts (a test seam).
    let (mut first, _setup) = first_daemon(&[("SANDCELL_TEST_ADOPT_STEP_MS", "3000")]);
    let pid = first.pid();
    let mut c = first.client().await;
    let older = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &older, "v = 'older'").await;
    let recent = c.open("python", None, Some(600)).await.unwrap().session;
    tokio::time::sleep(Duration::from_millis(20)).await;
    stdout_of(&mut c, &recent, "v = 'recent'").await;
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    drop(c);
    wait_reexec_begun(&first);
    let mut c = first.client().await;
    let t_call = Instant::now();
    assert_eq!(
        stdout_of(&mut c, &recent, "print(v)").await.trim(),
        "recent"
    );
    let answered = t_call.elapsed();
    let log = first.log_text();
    let after_exec = &log[log.find("re-executing in place").unwrap()..];
    assert!(
        !after_exec.contains("sessions of the previous daemon adopted="),
        "the call on the session adopted first waited for the whole adoption:\n{log}"
    );
    let adopted_at = |id: &str| {
        after_exec
            .lines()
            .position(|l| l.contains("session adopted") && l.contains(id))
    };
    assert!(
        adopted_at(&recent).is_some() && adopted_at(&older).is_none(),
        "the most recently active session was not adopted first:\n{log}"
    );
    // The session not yet adopted: its call waits for it.
    assert_eq!(stdout_of(&mut c, &older, "print(v)").await.trim(), "older");
    let (listed, _) = c.list_sessions().await.unwrap();
    let log = first.log_text();
    assert!(
        log[log.find("re-executing in place").unwrap()..]
            .contains("sessions of the previous daemon adopted=2"),
        "ListSessions was answered before the adoption ended:\n{log}"
    );
    assert_eq!(listed.len(), 2, "{listed:?}");
    eprintln!(
        "adoption step 3 s: the most recent session's Execute answered {answered:?} after the \
         connection, before the other session was adopted"
    );
    c.close(&recent).await.unwrap();
    c.close(&older).await.unwrap();
    kill_daemon(&mut first, libc::SIGTERM);
}

/// After an adoption the warm pools' refill (worker starts, CPU the returning clients would
/// wait behind) waits until every connection accepted during the adoption has had its first
/// call answered, not only for the first cell to finish: a client that connected during the
/// restart and has not been answered yet holds it back (for at most 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_refill_waits_for_the_first_call_of_each_connection_made_during_the_adoption() {
    skip_unless_root!();
    let (mut first, _setup) = first_daemon(&[
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "1"),
        ("SANDCELL_TEST_ADOPT_DELAY_MS", "1500"),
    ]);
    let pid = first.pid();
    assert!(
        common::eventually(Duration::from_secs(60), || first
            .log_text()
            .contains("warm worker ready")),
        "the pool was never filled:\n{}",
        first.log_text()
    );
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &s, "v = 1").await;
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    drop(c);
    wait_reexec_begun(&first);
    let mark = first.log_text().len();
    // Both connect during the adoption's 1.5 s delay: one stays silent, the other runs a cell
    // (the first cell to finish after the adoption).
    let mut quiet = first.client().await;
    let mut busy = first.client().await;
    assert_eq!(stdout_of(&mut busy, &s, "print(v)").await.trim(), "1");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = first.log_text();
    assert!(
        log[mark..]
            .matches("connection accepted while adopting sessions")
            .count()
            == 2,
        "the connections were not made during the adoption:\n{log}"
    );
    assert!(
        !log[mark..].contains("warm worker ready"),
        "the refill ran while a connection made during the adoption had no answer yet:\n{log}"
    );
    let (listed, _) = quiet.list_sessions().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        common::eventually(Duration::from_secs(60), || first.log_text()[mark..]
            .contains("warm worker ready")),
        "the pool was not refilled after every early connection was answered:\n{}",
        first.log_text()
    );
    eprintln!("the refill waited for the silent connection's first call");
    busy.close(&s).await.unwrap();
    kill_daemon(&mut first, libc::SIGTERM);
}

/// Waits (at most 30 s) until the daemon `d` says it re-executes in place: from then on it
/// accepts nothing, so a connection made now is the new image's.
fn wait_reexec_begun(d: &Daemon) {
    let t0 = Instant::now();
    while !d.log_text().contains("re-executing in place") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no re-exec:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A client that reconnects while the successor starts (here: a re-exec in place, the
/// listening socket passed through the exec; a restart by systemd keeps it the same way) is
/// accepted before the new image has set up its cgroups, and polkit (a real polkitd on a
/// private bus) is asked about it then; its call on a kept session is answered after that
/// session's adoption, as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_while_the_successor_starts_is_accepted_early() {
    skip_unless_root!();
    if !Path::new(common::polkit::POLKITD).exists() {
        sandcell_testing::skip!(
            "integration",
            "polkitd is not installed ({}); scripts/setup.sh installs it",
            common::polkit::POLKITD
        );
    }
    let bus = common::bus::Bus::start();
    let _pk = common::polkit::Polkit::start(&bus, &format!("scte{}", rand_hex(3)));
    let (mut first, _setup) = first_daemon(&[("DBUS_SYSTEM_BUS_ADDRESS", bus.address.as_str())]);
    assert!(
        first.log_text().contains("polkit decides authorization"),
        "polkit not selected:\n{}",
        first.log_text()
    );
    let pid = first.pid();
    let mut c = first.client().await;
    let py = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &py, "w = 'set before'").await;
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    drop(c);
    // The old image accepts nothing more once it says it re-executes: this connection waits
    // in the socket's backlog for the new image.
    wait_reexec_begun(&first);
    let mut c = first.client().await;
    assert_eq!(
        stdout_of(&mut c, &py, "print(w)").await.trim(),
        "set before"
    );
    let log = first.log_text();
    let after = &log[log.find("re-executing in place").unwrap()..];
    let early = after.find("connection accepted while the daemon starts");
    let cgroups = after.find("starting cgroups=");
    assert!(
        matches!((early, cgroups), (Some(e), Some(g)) if e < g),
        "the waiting connection was not accepted before the cgroups were set up:\n{log}"
    );
    // Numbered 1 and asked about at once (the id its polkit answer is kept under).
    assert!(
        after.contains("connection accepted while the daemon starts connection=1 uid=0")
            && after.contains("polkit_asked=true"),
        "the early connection was not numbered 1 or polkit was not asked:\n{log}"
    );
    // A connection made after the start is served too.
    wait_ready_times(&mut first, 2);
    let mut c2 = first.client().await;
    assert_eq!(
        stdout_of(&mut c2, &py, "print(w)").await.trim(),
        "set before"
    );
    c2.close(&py).await.unwrap();
}

/// A stop that arrives while the daemon adopts sessions (here: SIGTERM during a re-exec's
/// adoption, held for 4 s) is acted on once the adoption is done: without systemd's restart
/// job it ends every session at once, as at any other time. Before, SIGTERM was registered
/// only when the daemon served, so it ended the starting process and left the sessions to
/// their keepers until the adoption timeout (here 120 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_the_adoption_ends_every_session_at_once() {
    skip_unless_root!();
    let (mut first, setup, s, (worker, keeper), mark) =
        reexec_with_one_session(&[("SANDCELL_TEST_ADOPT_DELAY_MS", "4000")]).await;
    wait_reexec_begun(&first);
    let t0 = Instant::now();
    while !first.log_text()[mark..].contains("adopting sessions of the previous daemon") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the new image did not begin the adoption:\n{}",
            first.log_text()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        !first.log_text()[mark..].contains("sessions of the previous daemon adopted="),
        "the adoption ended before the stop was sent:\n{}",
        first.log_text()
    );
    kill_daemon(&mut first, libc::SIGTERM);
    let status = first.child.try_wait().unwrap().expect("exited");
    let log = first.log_text();
    assert!(
        status.success(),
        "SIGTERM during the adoption ended the process ({status:?}) instead of stopping it:\n{log}"
    );
    let after = &log[mark..];
    let adopted = after
        .find("sessions of the previous daemon adopted=1")
        .unwrap();
    let stopping = after.find("stopping: ending every session").unwrap();
    assert!(adopted < stopping, "{after}");
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(worker) && !alive(keeper)),
        "the session's worker or keeper lives on after the stop"
    );
    assert!(!setup.adopt.join(format!("{s}.json")).exists());
    assert_no_groups_left(&setup);
    eprintln!(
        "SIGTERM {} ms into the adoption's delay: the adoption finished, then every session ended",
        t0.elapsed().as_millis()
    );
}

/// A stop that reaches a re-exec in place while the old image hands its sessions over (held
/// here for 5 s after the hand-over, room for a stalled test thread on a loaded machine) is
/// not lost with the old image's handlers: the new image gets it
/// (`SANDCELL_REEXEC_PENDING_SIGNAL`), adopts the sessions and then ends every one of them at
/// once, not after the keepers' adoption timeout (here 120 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_reexecs_hand_over_reaches_the_new_image() {
    skip_unless_root!();
    let (mut first, setup, s, (worker, keeper), mark) =
        reexec_with_one_session(&[("SANDCELL_TEST_HAND_OVER_DELAY_MS", "5000")]).await;
    let t0 = Instant::now();
    while !first.log_text()[mark..].contains("SANDCELL_TEST_HAND_OVER_DELAY_MS") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no hand-over:\n{}",
            first.log_text()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    kill_daemon(&mut first, libc::SIGTERM);
    let status = first.child.try_wait().unwrap().expect("exited");
    let log = first.log_text();
    assert!(status.success(), "{status:?}:\n{log}");
    let after = &log[mark..];
    let order = [
        "re-executing in place",
        "a stop arrived during the re-exec's hand-over",
        "sessions of the previous daemon adopted=1",
        "stopping: ending every session",
    ];
    let mut at = 0;
    for line in order {
        at += after[at..]
            .find(line)
            .unwrap_or_else(|| panic!("no {line:?} after the previous step:\n{after}"));
    }
    assert!(
        common::eventually(Duration::from_secs(20), || !alive(worker) && !alive(keeper)),
        "the session's worker or keeper lives on after the stop"
    );
    assert!(!setup.adopt.join(format!("{s}.json")).exists());
    assert_no_groups_left(&setup);
}

/// A second SIGUSR1 that arrives while the first re-exec's new image starts (a second
/// `systemctl kill -s USR1` moments after the first): the process lives on, re-executes again
/// once it handles signals, and keeps the session. Without the signals held blocked across
/// the execve, their default action ended the process before its handlers were installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_during_a_reexecs_start_do_not_end_the_process() {
    skip_unless_root!();
    let (mut first, _setup, s, (worker, _keeper), mark) = reexec_with_one_session(&[]).await;
    let pid = first.pid();
    let t0 = Instant::now();
    while !first.log_text()[mark..].contains("re-executing in place; sessions kept") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no re-exec:\n{}",
            first.log_text()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    // SIGUSR1 then SIGHUP every millisecond for 30 ms: some reach the new image before its
    // handlers are installed.
    for i in 0..30 {
        let sig = if i % 2 == 0 {
            libc::SIGUSR1
        } else {
            libc::SIGHUP
        };
        // SAFETY: signals to our own child, not yet reaped.
        unsafe { libc::kill(pid as i32, sig) };
        std::thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    let out = loop {
        assert!(
            first.child.try_wait().unwrap().is_none(),
            "the daemon died during the re-exec:\n{}",
            first.log_text()
        );
        if let Ok(mut c) = Client::connect(&first.socket).await
            && let Ok(r) = c.execute_collect(&s, "print(v)").await
        {
            break r.stdout;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the session was never served again:\n{}",
            first.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(out, "1\n");
    assert_eq!(first.pid(), pid);
    assert!(alive(worker), "the worker died");
    let mut c = first.client().await;
    c.close(&s).await.unwrap();
}

/// A first daemon started with `extra` and an adoption timeout of 120 s, one detached Python
/// session in it with `v = 1`, then SIGUSR1 (a re-exec in place). Returns the daemon, its
/// settings, the session, its (worker, keeper) pids and the log's length before the signal.
async fn reexec_with_one_session(
    extra: &[(&str, &str)],
) -> (Daemon, Setup, String, (u32, u32), usize) {
    let mut env = vec![("SANDCELL_ADOPT_TIMEOUT_SECONDS", "120")];
    env.extend_from_slice(extra);
    let (first, setup) = first_daemon(&env);
    let mut c = first.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    stdout_of(&mut c, &s, "v = 1").await;
    let pids = record_pids(&setup.adopt, &s);
    let mark = first.log_text().len();
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe { libc::kill(first.pid() as i32, libc::SIGUSR1) };
    drop(c);
    (first, setup, s, pids, mark)
}
