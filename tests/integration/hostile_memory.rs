//! Hostile tenants against the daemon's own memory: clients that call every method with a
//! large answer (Inspect over Eryx, pydata and R; Attach replays; CellStatus; ListFiles;
//! GetFile; ListEnvironments; error replies) on as many connections as the caps allow and
//! read nothing. The daemon must stay alive (same pid, no OOM kill in its memory group), its
//! group's memory must stay under the bound derived from its caps, and another uid's `Run`
//! must be answered within a second throughout. Also: a configuration whose caps do not fit
//! is refused (exit 78), naming the keys.

use crate::common;

use common::Daemon;
use sandcelld::memory::{Bound, Caps};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Connection caps of the daemon under test (lower than the defaults, so a flood takes
/// seconds; the bound is derived from them by the same arithmetic).
const MAX_CONNECTIONS: u64 = 320;
const PER_UID: u64 = 64;
const SESSIONS: u64 = 16;
const SESSIONS_PER_UID: u64 = 4;

/// Attacking uids (unprivileged, none of them the victim's).
const ATTACKERS: [u32; 4] = [65534, 60101, 60102, 60103];
/// The uid whose `Run` must be answered throughout.
const VICTIM: u32 = 60199;

/// Margin under the derived bound that the group's peak must keep: a quarter (the peak must
/// stay under `memory.high`, three quarters of `memory.max`).
const MARGIN_NUM: u64 = 3;
const MARGIN_DEN: u64 = 4;

fn connect_as(uid: u32, socket: &Path) -> std::io::Result<UnixStream> {
    let socket = socket.to_owned();
    std::thread::spawn(move || {
        // SAFETY: setresuid(2) on this thread only; the thread ends right after the connect.
        let r = unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, 0) };
        assert_eq!(r, 0, "setresuid: {}", std::io::Error::last_os_error());
        UnixStream::connect(&socket)
    })
    .join()
    .unwrap()
}

fn message(method: &str, parameters: Value, more: bool) -> Vec<u8> {
    let mut m = json!({ "method": method, "parameters": parameters });
    if more {
        m["more"] = json!(true);
    }
    let mut v = serde_json::to_vec(&m).unwrap();
    v.push(0);
    v
}

fn kernel(method: &str) -> String {
    format!("org.sandcell.Kernel.{method}")
}

/// Reads one reply.
fn read_reply(s: &mut UnixStream) -> Value {
    let mut reply = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        // One byte at a time past the first NUL is never needed: replies are read in order
        // and only one is outstanding on setup connections.
        let n = s.read(&mut buf[..1]).expect("reading a reply");
        assert!(n > 0, "connection closed");
        if buf[0] == 0 {
            break;
        }
        reply.push(buf[0]);
        if reply.len() % 4096 == 0 {
            // Speed up large replies: read whatever is there, up to a NUL.
            let n = s.read(&mut buf[..4096]).unwrap();
            if let Some(i) = buf[..n].iter().position(|&b| b == 0) {
                reply.extend_from_slice(&buf[..i]);
                break;
            }
            reply.extend_from_slice(&buf[..n]);
        }
    }
    serde_json::from_slice(&reply).unwrap()
}

fn call(s: &mut UnixStream, method: &str, parameters: Value) -> Value {
    s.write_all(&message(&kernel(method), parameters, false))
        .unwrap();
    read_reply(s)
}

/// A streamed call, read to its last reply, which is returned.
fn call_streamed(s: &mut UnixStream, method: &str, parameters: Value) -> Value {
    s.write_all(&message(&kernel(method), parameters, true))
        .unwrap();
    loop {
        let r = read_reply(s);
        if r.get("continues") != Some(&json!(true)) {
            return r;
        }
    }
}

/// A session of `uid` (detached, so it outlives its setup connection) with 1000 variables.
fn session_with_variables(
    s: &mut UnixStream,
    language: &str,
    environment: Option<&str>,
    code: &str,
) -> String {
    let mut p = json!({ "language": language, "detached_idle_seconds": 600 });
    if let Some(e) = environment {
        p["environment"] = json!(e);
    }
    let r = call(s, "Open", p);
    let id = r["parameters"]["session"]
        .as_str()
        .unwrap_or_else(|| panic!("Open {language}: {r}"))
        .to_owned();
    let r = call_streamed(s, "Execute", json!({ "session": id, "code": code }));
    assert!(r.get("error").is_none(), "{language} cell: {r}");
    id
}

const PY_VARS: &str = "for i in range(1000):\n    globals()['v%d' % i] = 'é' * 500\n";
const R_VARS: &str = "for (i in 1:1000) assign(sprintf('v%d', i), strrep('é', 500))\n";

/// What one attacking uid calls.
struct Tenant {
    uid: u32,
    /// Sessions to Inspect (Eryx, and pydata and R when available).
    inspect: Vec<String>,
    /// A session with files and a cell that printed a lot.
    files: String,
    cell: u64,
    /// Kept open for the whole test.
    _setup: UnixStream,
}

fn prepare(uid: u32, socket: &Path, pydata: bool, r: bool) -> Tenant {
    let mut s = connect_as(uid, socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let py = session_with_variables(&mut s, "python", None, PY_VARS);
    let mut inspect = vec![py.clone()];
    if pydata {
        inspect.push(session_with_variables(
            &mut s,
            "python",
            Some("pydata"),
            PY_VARS,
        ));
    }
    if r {
        inspect.push(session_with_variables(&mut s, "r", None, R_VARS));
    }
    // Files: one of 1 MiB for GetFile, 300 small ones for ListFiles.
    let big = sandcell_proto::kernel::encode_base64(&vec![b'a'; 700 * 1024]);
    let r = call(
        &mut s,
        "PutFile",
        json!({ "session": py, "name": "big", "size": 700 * 1024, "data": big }),
    );
    assert!(r.get("error").is_none(), "PutFile: {r}");
    for i in 0..300 {
        let r = call(
            &mut s,
            "PutFile",
            json!({ "session": py, "name": format!("f{i:03}-{}", "n".repeat(100)), "size": 1, "data": "YQ==" }),
        );
        assert!(r.get("error").is_none(), "PutFile: {r}");
    }
    // A cell whose retained output (head and tail) an Attach replays and CellStatus reports.
    let r = call(
        &mut s,
        "Submit",
        json!({ "session": py, "code": "import sys\nfor i in range(4000):\n    print('é' * 100)\n    print('x' * 100, file=sys.stderr)\nraise ValueError('y' * 5000)\n" }),
    );
    let cell = r["parameters"]["cell"]
        .as_u64()
        .unwrap_or_else(|| panic!("Submit: {r}"));
    let t0 = Instant::now();
    loop {
        let r = call(&mut s, "CellStatus", json!({ "session": py, "cell": cell }));
        if r["parameters"]["state"] != json!("running") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "cell not done: {r}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Tenant {
        uid,
        inspect,
        files: py,
        cell,
        _setup: s,
    }
}

/// The `i`th heavy call of a tenant: every method that answers more than a few KiB, in turn.
fn heavy_call(t: &Tenant, i: usize) -> Vec<u8> {
    let calls: Vec<(String, Value, bool)> = {
        let mut v = Vec::new();
        for s in &t.inspect {
            v.push((
                kernel("Inspect"),
                json!({ "session": s, "max_items": 1000 }),
                false,
            ));
        }
        v.push((
            kernel("Attach"),
            json!({ "session": t.files, "cell": t.cell }),
            true,
        ));
        v.push((
            kernel("CellStatus"),
            json!({ "session": t.files, "cell": t.cell }),
            false,
        ));
        v.push((kernel("ListFiles"), json!({ "session": t.files }), false));
        v.push((
            kernel("GetFile"),
            json!({ "session": t.files, "name": "big" }),
            false,
        ));
        v.push((kernel("ListEnvironments"), json!({}), false));
        // Error replies: an unknown session (its id echoed, clipped) and an unknown method.
        v.push((
            kernel("Inspect"),
            json!({ "session": "z".repeat(3_000_000) }),
            false,
        ));
        v.push((
            format!("org.sandcell.Kernel.{}", "M".repeat(1_000_000)),
            json!({}),
            false,
        ));
        v
    };
    let (m, p, more) = &calls[i % calls.len()];
    message(m, p.clone(), *more)
}

/// The daemon's memory group, from its start-up log line.
fn supervisor_group(d: &Daemon) -> (PathBuf, u64) {
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("own memory is bounded"))
        .unwrap_or_else(|| panic!("no memory bound in the log:\n{log}"));
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in {line}"))
            .to_owned()
    };
    (
        PathBuf::from(field("group")),
        field("memory_max").parse().unwrap(),
    )
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The group's memory use now (v1 usage_in_bytes, v2 memory.current).
fn usage(g: &Path) -> u64 {
    read_u64(&g.join("memory.usage_in_bytes"))
        .or_else(|| read_u64(&g.join("memory.current")))
        .unwrap_or(0)
}

/// The group's peak (v1 max_usage_in_bytes, v2 memory.peak).
fn peak(g: &Path) -> u64 {
    read_u64(&g.join("memory.max_usage_in_bytes"))
        .or_else(|| read_u64(&g.join("memory.peak")))
        .unwrap_or(0)
}

/// OOM kills in the group so far (v1 memory.oom_control, v2 memory.events).
fn oom_kills(g: &Path) -> u64 {
    ["memory.oom_control", "memory.events"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(g.join(f)).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| l.strip_prefix("oom_kill ")?.trim().parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// One `Run` of `print(1)` as the victim uid: seconds to its first reply, and to its last.
fn victim_run(socket: &Path) -> (f64, f64) {
    let t0 = Instant::now();
    let mut s = connect_as(VICTIM, socket).expect("the victim connects");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&message(
        &kernel("Run"),
        json!({ "language": "python", "code": "print(1)" }),
        true,
    ))
    .unwrap();
    let first = read_reply(&mut s);
    let t_first = t0.elapsed().as_secs_f64();
    assert!(first.get("error").is_none(), "victim's Run: {first}");
    let mut last = first;
    while last.get("continues") == Some(&json!(true)) {
        last = read_reply(&mut s);
    }
    assert!(last.get("error").is_none(), "victim's Run: {last}");
    (t_first, t0.elapsed().as_secs_f64())
}

/// Floods from `tenants` at once, every connection their caps allow, reading nothing;
/// meanwhile samples the group and runs the victim. Returns the peak use seen and the slowest
/// victim first reply, seconds.
fn flood(d: &Daemon, tenants: &[Tenant], group: &Path, limit: u64, label: &str) -> (u64, f64) {
    let socket = d.socket.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let sampled = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, sampled, group) = (stop.clone(), sampled.clone(), group.to_owned());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                sampled.fetch_max(usage(&group), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let victim = {
        let (stop, socket) = (stop.clone(), socket.clone());
        std::thread::spawn(move || {
            let mut worst: f64 = 0.0;
            let mut runs = 0;
            while !stop.load(Ordering::Relaxed) {
                let (first, total) = victim_run(&socket);
                worst = worst.max(first);
                runs += 1;
                if first > 1.0 {
                    eprintln!("victim's Run: first reply after {first:.3} s (done {total:.3} s)");
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            (worst, runs)
        })
    };
    let t0 = Instant::now();
    let mut held: Vec<UnixStream> = Vec::new();
    let mut refused = 0;
    for t in tenants {
        // One of the uid's connections is its setup connection.
        for i in 0..(PER_UID - 1) as usize {
            let Ok(mut c) = connect_as(t.uid, &socket) else {
                refused += 1;
                continue;
            };
            c.set_nonblocking(true).unwrap();
            // Two calls per connection: one being answered, one read ahead.
            for k in 0..2 {
                let m = heavy_call(t, i * 2 + k);
                let mut rest = &m[..];
                let deadline = Instant::now() + Duration::from_secs(2);
                while !rest.is_empty() && Instant::now() < deadline {
                    match c.write(rest) {
                        Ok(n) => rest = &rest[n..],
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        Err(_) => break,
                    }
                }
            }
            held.push(c);
        }
    }
    let sent = t0.elapsed();
    // Let the daemon answer into the unread sockets for a while.
    std::thread::sleep(Duration::from_secs(8));
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let (worst, runs) = victim.join().unwrap();
    let seen = sampled.load(Ordering::Relaxed).max(peak(group));
    eprintln!(
        "figure: {label}: {} connections ({refused} refused) sent in {:.1} s reading nothing; \
         group peak {:.1} MiB of a derived {:.1} MiB; victim's Run first reply at worst {worst:.3} s over {runs} runs",
        held.len(),
        sent.as_secs_f64(),
        seen as f64 / 1048576.0,
        limit as f64 / 1048576.0,
    );
    drop(held);
    (seen, worst)
}

#[test]
fn tenants_reading_nothing_cannot_exhaust_the_daemon() {
    if !sandcell_testing::is_root() {
        sandcell_testing::skip!(
            "root",
            "acting as other uids and reading the daemon's memory group needs root"
        );
    }
    let pydata = common::pydata_available();
    let r = common::r_available();
    if !pydata {
        eprintln!("pydata Inspect left out: /usr/bin/python3 cannot import numpy and pandas");
    }
    if !r {
        eprintln!("R Inspect left out: R is not installed");
    }
    let languages = if r { "python,r" } else { "python" };
    let d = Daemon::start(&[
        ("SANDCELL_LANGUAGES", languages),
        ("SANDCELL_MAX_CONNECTIONS", &MAX_CONNECTIONS.to_string()),
        ("SANDCELL_MAX_CONNECTIONS_PER_UID", &PER_UID.to_string()),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", &SESSIONS.to_string()),
        (
            "SANDCELL_MAX_SESSIONS_PER_UID",
            &SESSIONS_PER_UID.to_string(),
        ),
        (
            "SANDCELL_MAX_DETACHED_SESSIONS_PER_UID",
            &SESSIONS_PER_UID.to_string(),
        ),
        (
            "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES",
            &(4u64 << 30).to_string(),
        ),
        (
            "SANDCELL_MAX_GUEST_MEMORY_BYTES_PER_UID",
            &(1u64 << 30).to_string(),
        ),
        (
            "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES",
            &(64u64 << 30).to_string(),
        ),
        (
            "SANDCELL_MAX_WORKER_MEMORY_BYTES_PER_UID",
            &(16u64 << 30).to_string(),
        ),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60"),
    ]);
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let pid = d.pid();
    let (group, limit) = supervisor_group(&d);
    // The bound written is the one the caps imply.
    let bound = Bound::derive(&Caps {
        max_connections: MAX_CONNECTIONS,
        max_connections_per_uid: PER_UID,
        max_concurrent_sessions: SESSIONS,
        max_sessions_per_uid: SESSIONS_PER_UID,
        memory_max_bytes: 0,
    });
    assert_eq!(limit, bound.max);
    let written = read_u64(&group.join("memory.limit_in_bytes"))
        .or_else(|| read_u64(&group.join("memory.max")))
        .expect("the group's limit");
    assert_eq!(written, bound.max, "{}", group.display());

    let tenants: Vec<Tenant> = ATTACKERS
        .iter()
        .map(|&uid| prepare(uid, &d.socket, pydata, r))
        .collect();
    {
        let mut s = connect_as(ATTACKERS[0], &d.socket).unwrap();
        let r = call(
            &mut s,
            "Inspect",
            json!({ "session": tenants[0].inspect[0], "max_items": 1000 }),
        );
        let n = serde_json::to_vec(&r).unwrap().len();
        eprintln!("figure: one Inspect reply of 1000 variables: {n} bytes");
        assert!(n > 200_000, "Inspect reply of {n} bytes");
    }
    let threshold = bound.max / MARGIN_DEN * MARGIN_NUM;
    for (label, n) in [("one uid", 1), ("four uids", ATTACKERS.len())] {
        let (seen, worst) = flood(&d, &tenants[..n], &group, bound.max, label);
        assert!(d.child_alive(), "the daemon died:\n{}", d.log_text());
        assert_eq!(d.pid(), pid);
        assert_eq!(oom_kills(&group), 0, "an OOM kill in {}", group.display());
        assert!(
            seen < threshold,
            "{label}: group peak {seen} bytes, above 3/4 of the derived bound ({threshold})"
        );
        assert!(worst < 1.0, "{label}: the victim's Run waited {worst:.3} s");
        // Still answers, and the budgets came back once the connections closed.
        let (first, _) = victim_run(&d.socket);
        assert!(first < 1.0, "after {label}: {first:.3} s");
    }
}

#[test]
fn caps_that_cannot_fit_are_refused_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[daemon]\nmemory_max_bytes = 268435456\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    for key in [
        "memory_max_bytes",
        "max_connections",
        "max_concurrent_sessions",
    ] {
        assert!(err.contains(key), "{key} not named: {err}");
    }
    // Fewer connections fit under the same ceiling.
    std::fs::write(
        &cfg,
        "[daemon]\nmemory_max_bytes = 536870912\nmax_connections = 64\nmax_connections_per_uid = 16\n[limits]\nmax_concurrent_sessions = 4\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("memory_max_bytes = 536870912"), "{text}");
}

/// A client that sends calls and reads nothing: once its send queue has not moved for
/// `SEND_STALL_SECONDS` (30 s) the daemon ends the connection, and the connection keeps its
/// place under the uid's cap until the client closes its end (the bytes queued for it are
/// the daemon's memory until then).
#[test]
fn a_client_that_reads_nothing_is_ended_and_holds_its_place_until_it_closes() {
    if !sandcell_testing::is_root() {
        sandcell_testing::skip!("root", "acting as another uid needs root");
    }
    let stall = sandcelld::varlink::socket::SEND_STALL_SECONDS;
    let d = Daemon::start(&[("SANDCELL_MAX_CONNECTIONS_PER_UID", "1")]);
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let uid = ATTACKERS[0];
    let mut hog = connect_as(uid, &d.socket).unwrap();
    let one = message(&kernel("ListEnvironments"), json!({}), false);
    let calls: Vec<u8> = one.iter().copied().cycle().take(one.len() * 2000).collect();
    hog.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = hog.write_all(&calls);
    let t0 = Instant::now();
    // A second connection of the uid is over its cap: its first call is answered
    // CapacityExceeded (or, with many refusals at once, it is closed unanswered).
    let refused = |d: &Daemon| {
        let mut c = connect_as(uid, &d.socket).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(&message(&kernel("ListEnvironments"), json!({}), false));
        match read_reply_opt(&mut c) {
            None => true,
            Some(r) => r
                .get("error")
                .and_then(Value::as_str)
                .is_some_and(|e| e.ends_with("CapacityExceeded")),
        }
    };
    assert!(
        refused(&d),
        "a second connection of a uid capped at 1 was served"
    );
    let ended = common::eventually(Duration::from_secs(stall + 20), || {
        d.log_text()
            .contains("closing a connection whose client reads nothing")
    });
    let waited = t0.elapsed().as_secs_f64();
    assert!(ended, "the connection was not ended after {waited:.0} s");
    assert!(
        waited >= stall as f64 - 1.0,
        "ended after {waited:.1} s, before the {stall} s deadline"
    );
    eprintln!("figure: a client reading nothing was ended after {waited:.1} s");
    // Still holding its place while its queue is unread.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        refused(&d),
        "the ended connection's place was given up while its queue is held"
    );
    // Reading what is queued, the client then sees the end.
    hog.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut sink = Vec::new();
    let _ = hog.read_to_end(&mut sink);
    assert!(!sink.is_empty());
    drop(hog);
    // Its place is free again.
    assert!(common::eventually(Duration::from_secs(5), || {
        let mut c = connect_as(uid, &d.socket).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(&message(&kernel("ListEnvironments"), json!({}), false))
            .is_ok()
            && read_reply_opt(&mut c).is_some()
    }));
    assert!(d.child_alive());
}

fn read_reply_opt(s: &mut UnixStream) -> Option<Value> {
    let mut reply = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let n = s.read(&mut b).ok()?;
        if n == 0 {
            return None;
        }
        if let Some(i) = b[..n].iter().position(|&x| x == 0) {
            reply.extend_from_slice(&b[..i]);
            return serde_json::from_slice(&reply).ok();
        }
        reply.extend_from_slice(&b[..n]);
    }
}

/// The daemon's peak resident set so far, bytes (`VmHWM`, proc(5)).
fn high_water(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// A call whose parameters are 4 MiB of tiny JSON values costs the daemon about its own bytes,
/// not a tree of them: decoded into a `serde_json::Value` it cost about 32 bytes a value
/// (64 MiB for one such call, per runtime thread decoding one at a time), outside every
/// budget. Each is answered `InvalidParameter`, and the connection keeps serving.
#[test]
fn a_call_of_tiny_values_costs_its_bytes_not_a_tree() {
    let d = Daemon::start(&[]);
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // Warm up: the first answered call grows the daemon's pools.
    let first = call(&mut s, "ListEnvironments", json!({}));
    assert!(first.get("error").is_none(), "{first}");
    let before = high_water(d.pid());
    let values = (sandcell_proto::kernel::MAX_MESSAGE_BYTES - 4096) / 2;
    let junk = format!("[{}0]", "0,".repeat(values - 1));
    for method in ["Inspect", "HostReply", "Open", "PutFile"] {
        let mut m = format!(
            "{{\"method\":\"{}\",\"parameters\":{{\"session\":\"x\",\"junk\":{junk}}}}}",
            kernel(method)
        )
        .into_bytes();
        m.push(0);
        assert!(m.len() <= sandcell_proto::kernel::MAX_MESSAGE_BYTES + 1);
        s.write_all(&m).unwrap();
        let reply = read_reply(&mut s);
        let error = reply.get("error").and_then(Value::as_str).unwrap_or("");
        assert!(
            error.ends_with("InvalidParameter") || error.ends_with("LimitExceeded"),
            "{method}: {reply}"
        );
    }
    let grown = high_water(d.pid()).saturating_sub(before);
    eprintln!(
        "figure: four calls of {values} JSON values each grew the daemon's peak RSS by {} KiB",
        grown / 1024
    );
    assert!(
        grown < 32 << 20,
        "the daemon's peak RSS grew by {} MiB decoding 4 MiB calls",
        grown >> 20
    );
    let again = call(&mut s, "ListEnvironments", json!({}));
    assert!(again.get("error").is_none(), "{again}");
    assert!(d.child_alive());
}
