//! Hostile clients: a member of group `sandcell` with a raw socket. Each test drives the real
//! daemon and asserts the bound: huge strings are answered fast with a bounded echo, passed
//! descriptors never stall the daemon, idle connections cannot exhaust its descriptors, one
//! uid cannot hold every session, session starts are rate-limited, a few uids that fill the
//! connection caps leave room for root and a fresh uid (and refused connections are told
//! why), and a worker that hangs at start is cancelled when its client goes away.

use crate::common;

use common::{Daemon, eventually};
use sandcell_client::{Error, KernelError, Limits, Status};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// User and CPU seconds the process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = s.rfind(')').map(|i| &s[i + 2..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split(' ').collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / hz
}

/// Sends `msg` (a whole message without its NUL) with `fds` in one `sendmsg`, then its NUL.
fn send_with_fds(s: &UnixStream, msg: &[u8], fds: &[i32]) {
    send_unterminated(s, msg, fds);
    let mut w = s;
    w.write_all(&[0]).unwrap();
}

/// Sends `msg` with `fds` (descriptors with its first bytes) but not the NUL that ends it.
fn send_unterminated(s: &UnixStream, msg: &[u8], fds: &[i32]) {
    let mut data = msg.to_vec();
    // Descriptors go with the first bytes; the rest follows in ordinary writes.
    let first = data.len().min(4096);
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: first,
    };
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_* compute within `control`, which is large enough for 4 descriptors.
        unsafe {
            let len = std::mem::size_of_val(fds) as u32;
            m.msg_control = control.as_mut_ptr().cast();
            m.msg_controllen = libc::CMSG_SPACE(len) as _;
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(len) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut i32, fds.len());
        }
    }
    // SAFETY: `m` describes valid buffers.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &m, 0) };
    assert!(n > 0, "sendmsg: {}", std::io::Error::last_os_error());
    let mut w = s;
    w.write_all(&data[n as usize..]).unwrap();
}

/// Reads one reply (up to its NUL).
fn read_reply(s: &UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    let mut r = s;
    loop {
        let n = r.read(&mut buf).unwrap();
        assert!(n > 0, "the daemon closed the connection");
        if let Some(i) = buf[..n].iter().position(|&b| b == 0) {
            out.extend_from_slice(&buf[..i]);
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

fn connect(sock: &Path) -> UnixStream {
    let s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// One call on a fresh connection: the reply and how long it took.
fn raw_call(sock: &Path, call: &Value, fds: &[i32]) -> (Value, usize, Duration) {
    let s = connect(sock);
    let t0 = Instant::now();
    send_with_fds(&s, &serde_json::to_vec(call).unwrap(), fds);
    let reply = read_reply(&s);
    let took = t0.elapsed();
    (serde_json::from_slice(&reply).unwrap(), reply.len(), took)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_4_mib_session_id_is_answered_fast_with_a_bounded_echo() {
    let d = Daemon::start(&[]);
    let cpu0 = cpu_seconds(d.pid());
    let sock = d.socket.clone();
    let hostile = std::thread::spawn(move || {
        let id = "a".repeat(4 * 1024 * 1024 - 256);
        let mut out = Vec::new();
        for method in ["Execute", "Close"] {
            let mut params = json!({ "session": id });
            if method == "Execute" {
                params["code"] = json!("1");
            }
            let call = json!({
                "method": format!("org.sandcell.Kernel.{method}"),
                "parameters": params,
                "more": method == "Execute",
            });
            out.push((method, raw_call(&sock, &call, &[])));
        }
        out
    });
    // Meanwhile, a second client's trivial cell.
    let mut c = d.client().await;
    let t0 = Instant::now();
    let r = c.run_collect("python", "print(1)", None).await.unwrap();
    let bystander = t0.elapsed();
    let results = tokio::task::spawn_blocking(move || hostile.join().unwrap())
        .await
        .unwrap();
    let cpu = cpu_seconds(d.pid()) - cpu0;
    for (method, (reply, len, took)) in &results {
        eprintln!("figure: {method} with a 4 MiB session id answered in {took:?} ({len} bytes)");
        assert_eq!(
            reply["error"], "org.sandcell.Kernel.NoSuchSession",
            "{method}: {reply}"
        );
        let echoed = reply["parameters"]["session"].as_str().unwrap();
        assert!(echoed.len() <= 97, "echo of {} bytes", echoed.len());
        assert!(*len < 1024, "reply of {len} bytes");
        assert!(*took < Duration::from_secs(10), "{method} took {took:?}");
    }
    eprintln!(
        "figure: daemon CPU for both calls and a Run: {cpu:.2} s; bystander Run {bystander:?}"
    );
    assert_eq!(r.result.status, Status::Ok);
    assert_eq!(r.stdout, "1\n");
    assert!(cpu < 10.0, "daemon CPU {cpu} s");
    assert!(
        bystander < Duration::from_secs(30),
        "bystander {bystander:?}"
    );
}

/// A connected TCP socket whose close lingers: `SO_LINGER` 15 s and unsent data the peer
/// never reads. Returns it and what must stay alive (the peer and the listener).
fn lingering_socket() -> (OwnedFd, Vec<std::net::TcpStream>, std::net::TcpListener) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (peer, _) = l.accept().unwrap();
    // Small buffers fill fast; the peer never reads.
    for s in [c.as_raw_fd(), peer.as_raw_fd()] {
        let size: libc::c_int = 4096;
        // SAFETY: setsockopt reads `size`.
        unsafe {
            libc::setsockopt(
                s,
                libc::SOL_SOCKET,
                if s == c.as_raw_fd() {
                    libc::SO_SNDBUF
                } else {
                    libc::SO_RCVBUF
                },
                (&size as *const libc::c_int).cast(),
                4,
            )
        };
    }
    c.set_nonblocking(true).unwrap();
    let chunk = [b'x'; 4096];
    let mut w = &c;
    while w.write(&chunk).is_ok() {}
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 15,
    };
    // SAFETY: setsockopt reads `linger`.
    unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
    c.set_nonblocking(false).unwrap();
    (c.into(), vec![peer], l)
}

#[tokio::test(flavor = "multi_thread")]
async fn passed_lingering_sockets_are_refused_and_never_stall_the_daemon() {
    let d = Daemon::start(&[("SANDCELL_KILL_GRACE_SECONDS", "1")]);
    // A session to upload into.
    let mut owner = d.client().await;
    let session = owner.open("python", None, None).await.unwrap().session;
    // A concurrent cell with a 2 s wall limit.
    let mut cell = d.client().await;
    let limits = Limits {
        wall_time_seconds: Some(2.0),
        ..Default::default()
    };
    cell.run("python", "import time\ntime.sleep(30)", Some(&limits))
        .await
        .unwrap();
    assert!(cell.next_frame().await.unwrap().started.is_some());
    let t0 = Instant::now();
    let sock = d.socket.clone();
    let session2 = session.clone();
    let hostile = std::thread::spawn(move || {
        let mut out = Vec::new();
        // A method that takes no descriptors, then PutFile.
        for call in [
            json!({ "method": "org.sandcell.Kernel.ListFiles", "parameters": { "session": session2 } }),
            json!({ "method": "org.sandcell.Kernel.PutFile", "parameters": { "session": session2, "name": "x", "size": 0, "fd": 0 } }),
        ] {
            let (fd, _peer, _l) = lingering_socket();
            let s = connect(&sock);
            let t = Instant::now();
            send_unterminated(&s, &serde_json::to_vec(&call).unwrap(), &[fd.as_raw_fd()]);
            // Our copy goes first: the daemon's is then the last one, whose close lingers.
            drop(fd);
            std::thread::sleep(Duration::from_millis(100));
            (&s).write_all(&[0]).unwrap();
            let reply: Value = serde_json::from_slice(&read_reply(&s)).unwrap();
            out.push((reply, t.elapsed()));
            // Keep the peer unread until the daemon had every chance to block on the close.
            std::thread::sleep(Duration::from_millis(500));
        }
        out
    });
    let r = cell.finish(|_| {}).await.unwrap();
    let cell_took = t0.elapsed();
    let results = tokio::task::spawn_blocking(move || hostile.join().unwrap())
        .await
        .unwrap();
    for (reply, took) in &results {
        eprintln!("figure: call with a lingering socket answered in {took:?}: {reply}");
        assert_eq!(
            reply["error"], "org.sandcell.Kernel.InvalidParameter",
            "{reply}"
        );
        assert_eq!(reply["parameters"]["parameter"], "fd", "{reply}");
        assert!(*took < Duration::from_secs(5), "{took:?}");
    }
    eprintln!(
        "figure: wall-2 s cell ended after {cell_took:?} (status {:?})",
        r.result.status
    );
    assert_eq!(r.result.status, Status::Timeout);
    // wall 2 s + grace 1 s + slack.
    assert!(
        cell_took < Duration::from_secs(7),
        "cell took {cell_took:?}"
    );

    // PutFile reads regular files of local file systems only.
    let proc_file = std::fs::File::open("/proc/self/status").unwrap();
    let e = owner
        .put_fd_declared(&session, "p", proc_file.into(), 0)
        .await
        .unwrap_err();
    match e {
        Error::Kernel(KernelError::InvalidParameter { parameter, reason }) => {
            assert_eq!(parameter, "fd");
            assert!(reason.contains("proc"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let mut f = tempfile::tempfile_in("/var/tmp").unwrap();
    f.write_all(b"hello").unwrap();
    let info = owner.put_fd(&session, "ok.txt", f).await.unwrap();
    assert_eq!(info.size, 5);
    assert!(d.child_alive());
}

/// Runs `print(1)` as `uid` through `sandcellctl` (setpriv); `None` when sandcellctl is absent.
fn run_as(uid: u32, socket: &Path) -> Option<(i32, String, String)> {
    let exe: PathBuf = common::bin_dir().join("sandcellctl");
    if !exe.exists() {
        sandcell_testing::skip_part!("built", "{} is not built", exe.display());
        return None;
    }
    let mut child = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg(&exe)
        .args(["run", "-l", "python", "-"])
        .env("SANDCELL_SOCKET", socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"print(1)\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    Some((
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    ))
}

/// Lets every local user reach the test daemon's socket (production: group `sandcell`).
fn open_socket(d: &Daemon) {
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
}

const OTHER_UID: u32 = 65534;

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_capped_and_timed_out() {
    let d = Daemon::start(&[
        ("SANDCELL_MAX_CONNECTIONS", "300"),
        ("SANDCELL_MAX_CONNECTIONS_PER_UID", "200"),
        ("SANDCELL_CONNECTION_IDLE_SECONDS", "4"),
    ]);
    open_socket(&d);
    let sock = d.socket.clone();
    let conns: Vec<UnixStream> = (0..600)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    // Those over the per-uid cap are closed at once.
    let closed = |conns: &[UnixStream]| {
        conns
            .iter()
            .filter(|s| {
                s.set_nonblocking(true).unwrap();
                let mut b = [0u8; 1];
                let mut r = *s;
                matches!(r.read(&mut b), Ok(0))
            })
            .count()
    };
    assert!(
        eventually(Duration::from_secs(5), || closed(&conns) >= 400),
        "closed: {}",
        closed(&conns)
    );
    let fds = std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .unwrap()
        .count();
    eprintln!(
        "figure: 600 idle connections of one uid: {} closed at once, daemon holds {fds} descriptors",
        closed(&conns)
    );
    // Two per connection (the socket and the peer's pidfd), 200 connections, and a few more.
    assert!(fds < 450, "daemon holds {fds} descriptors");
    // A second uid is still served.
    if let Some((code, out, err)) = run_as(OTHER_UID, &sock) {
        assert_eq!(code, 0, "second uid's run: {out} {err}");
        assert_eq!(out, "1\n");
    }
    // The rest are closed after the idle timeout.
    assert!(
        eventually(Duration::from_secs(15), || closed(&conns) == 600),
        "still open: {}",
        600 - closed(&conns)
    );
    let log = d.log_text();
    assert!(log.contains("connection refused"), "{log}");
    assert!(log.contains("closing idle connection"), "{log}");
    // A connection with a session is not idle.
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let out = c.execute_collect(&s, "print(2)").await.unwrap();
    assert_eq!(out.stdout, "2\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_uid_hoarding_sessions_leaves_room_for_another() {
    let d = Daemon::start(&[("SANDCELL_MAX_CONCURRENT_SESSIONS", "4")]);
    open_socket(&d);
    let mut c = d.client().await;
    let mut held = Vec::new();
    let refusal = loop {
        match c.open("python", None, None).await {
            Ok(s) => held.push(s.session),
            Err(e) => break e,
        }
        assert!(held.len() <= 4, "no per-uid budget");
    };
    match refusal {
        Error::Kernel(KernelError::CapacityExceeded {
            budget,
            in_use,
            max,
            ..
        }) => {
            assert_eq!(budget, "max_sessions_per_uid");
            assert_eq!((in_use, max), (3, 3));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(held.len(), 3);
    assert!(d.log_text().contains("session refused: capacity exceeded"));
    if let Some((code, out, err)) = run_as(OTHER_UID, &d.socket) {
        assert_eq!(code, 0, "second uid's run: {out} {err}");
        assert_eq!(out, "1\n");
    }
    // Detached sessions have their own, smaller budget (1 of 3 here).
    c.close(&held.pop().unwrap()).await.unwrap();
    c.close(&held.pop().unwrap()).await.unwrap();
    c.open("python", None, Some(60)).await.unwrap();
    match c.open("python", None, Some(60)).await.unwrap_err() {
        Error::Kernel(KernelError::CapacityExceeded { budget, .. }) => {
            assert_eq!(budget, "max_detached_sessions_per_uid")
        }
        other => panic!("{other:?}"),
    }
    // The operator caps detached_idle_seconds.
    match c.open("python", None, Some(30 * 86_400)).await.unwrap_err() {
        Error::Kernel(KernelError::LimitExceeded { limit, .. }) => {
            assert_eq!(limit, "max_detached_idle_seconds")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn session_starts_are_rate_limited_per_uid() {
    let d = Daemon::start(&[
        ("SANDCELL_MAX_STARTS_PER_SECOND_PER_UID", "0.05"),
        ("SANDCELL_MAX_START_BURST_PER_UID", "2"),
    ]);
    let mut c = d.client().await;
    for _ in 0..2 {
        let s = c.open("python", None, None).await.unwrap().session;
        c.close(&s).await.unwrap();
    }
    match c.open("python", None, None).await.unwrap_err() {
        Error::Kernel(KernelError::CapacityExceeded {
            budget,
            max,
            retry_after_seconds,
            ..
        }) => {
            assert_eq!(budget, "max_starts_per_second_per_uid");
            assert_eq!(max, 2);
            // One start every 20 s: the next token is due within 20 s, and not at once.
            let after = retry_after_seconds.expect("the start rate says when to retry");
            assert!(after > 1.0 && after <= 20.0, "retry after {after} s");
        }
        other => panic!("{other:?}"),
    }
    let mut c2 = d.client().await;
    assert!(c2.run_collect("python", "1", None).await.is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_hanging_at_start_is_cancelled_when_its_client_goes_away() {
    // A worker directory whose Python worker is replaced, once the daemon is ready, by one
    // that never says Ready.
    let workers = tempfile::tempdir_in("/var/tmp").unwrap();
    std::fs::set_permissions(
        workers.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    for e in std::fs::read_dir(common::bin_dir()).unwrap().flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with("sandcell-") && e.path().is_file() {
            std::os::unix::fs::symlink(e.path(), workers.path().join(&name)).unwrap();
        }
    }
    let dir = workers.path().display().to_string();
    let d = Daemon::start(&[
        ("SANDCELL_WORKER_DIR", dir.as_str()),
        ("SANDCELL_WORKER_START_TIMEOUT_SECONDS", "120"),
    ]);
    let fake = workers.path().join("sandcell-worker-python");
    std::fs::remove_file(&fake).unwrap();
    std::fs::write(&fake, "#!/bin/sh\nexec sleep 300\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let sock = d.socket.clone();
    let client = std::thread::spawn(move || {
        let s = connect(&sock);
        send_with_fds(
            &s,
            &serde_json::to_vec(&json!({ "method": "org.sandcell.Kernel.Open", "parameters": { "language": "python" } })).unwrap(),
            &[],
        );
        s
    });
    let s = client.join().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !d.descendants().is_empty()),
        "no worker started"
    );
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    drop(s);
    // With the start timeout at 120 s, only the cancellation can end the worker this early.
    assert!(
        eventually(Duration::from_secs(5), || d.descendants().is_empty()),
        "worker still there after its client left: {:?}",
        d.descendants()
    );
    eprintln!(
        "figure: hung start released {:?} after its client left",
        t0.elapsed()
    );
}

/// Clients that ask for large replies and never read them hold at most their uid's share of
/// the reply budget (16 MiB), not a copy of every reply: before the budget, each unread 1 MiB
/// `GetFile` pinned about 2.9 MB of daemon memory per connection and 80 such connections
/// OOM-killed a daemon limited to 256 MiB.
#[tokio::test(flavor = "multi_thread")]
async fn unread_replies_cannot_grow_the_daemon() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, Some(600)).await.unwrap().session;
    let big: Vec<u8> = (0..1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    c.put_bytes(&s, "big.bin", &big).await.unwrap();
    let get = serde_json::to_vec(&json!({
        "method": "org.sandcell.Kernel.GetFile",
        "parameters": { "session": s, "name": "big.bin", "max_bytes": 1048576 }
    }))
    .unwrap();
    let list = serde_json::to_vec(&json!({
        "method": "org.sandcell.Kernel.ListFiles",
        "parameters": { "session": s }
    }))
    .unwrap();
    // Let start-up allocations settle before the baseline.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss0 = d.rss();
    let mut hoarders = Vec::new();
    for _ in 0..60 {
        let h = UnixStream::connect(&d.socket).unwrap();
        for _ in 0..3 {
            send_with_fds(&h, &get, &[]);
        }
        send_with_fds(&h, &list, &[]);
        hoarders.push(h);
        std::thread::sleep(Duration::from_millis(50));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss1 = d.rss();
    eprintln!(
        "figure: 60 connections with unread GetFile/ListFiles replies: daemon RSS {:.1} -> {:.1} MB",
        rss0 as f64 / 1e6,
        rss1 as f64 / 1e6
    );
    assert!(
        rss1 < rss0 + 48 * 1024 * 1024,
        "daemon RSS grew from {rss0} to {rss1} bytes"
    );
    // This uid's share is taken: a further large reply is refused by name, at once.
    let refused = c.get_file_chunk(&s, "big.bin", 0, None).await.unwrap_err();
    match refused {
        Error::Kernel(KernelError::CapacityExceeded { budget, max, .. }) => {
            assert_eq!(budget, "reply_bytes_per_uid");
            assert_eq!(max, 16 * 1024 * 1024);
        }
        other => panic!("{:.400}", format!("{other:?}")),
    }
    // Small calls are still served, and once the hoarders hang up the budget comes back.
    c.execute_collect(&s, "print(1)").await.unwrap();
    drop(hoarders);
    let mut served = false;
    for _ in 0..100 {
        if let Ok((_, bytes, eof)) = c.get_file_chunk(&s, "big.bin", 0, None).await {
            assert!(eof);
            assert!(bytes == big, "the file came back different");
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        served,
        "the reply budget was not returned after the hoarders left"
    );
    // The memory of the burst goes back to the kernel (malloc_trim every 30 s), instead of
    // ratcheting the daemon's resident set up after each flood.
    let settled = eventually(Duration::from_secs(45), || d.rss() < rss0 + 8 * 1024 * 1024);
    eprintln!(
        "figure: daemon RSS after the hoarders left: {:.1} MB",
        d.rss() as f64 / 1e6
    );
    assert!(
        settled,
        "daemon RSS stayed at {} bytes (baseline {rss0})",
        d.rss()
    );
}

/// A parameter of the wrong type is named by its path, never by the client's value.
#[tokio::test(flavor = "multi_thread")]
async fn type_errors_name_the_parameter_not_the_value() {
    let d = Daemon::start(&[]);
    let cases = [
        (
            json!({"method": "org.sandcell.Kernel.Execute", "more": true, "parameters": {"session": 5, "code": "1"}}),
            "session",
        ),
        (
            json!({"method": "org.sandcell.Kernel.Run", "more": true, "parameters": {"language": "python", "code": "1", "limits": {"guest_memory_bytes": "lots"}}}),
            "limits.guest_memory_bytes",
        ),
        (
            json!({"method": "org.sandcell.Kernel.Run", "more": true, "parameters": {"language": "python"}}),
            "code",
        ),
        (
            json!({"method": "org.sandcell.Kernel.Close", "parameters": {"session": "x", "evil": 1}}),
            "evil",
        ),
    ];
    for (call, parameter) in cases {
        let (reply, _, _) = raw_call(&d.socket, &call, &[]);
        assert_eq!(
            reply["error"], "org.varlink.service.InvalidParameter",
            "{call}: {reply}"
        );
        assert_eq!(
            reply["parameters"]["parameter"], parameter,
            "{call}: {reply}"
        );
    }
}

/// A message that cannot be a call is answered with `InvalidParameter` (`message`), echoing
/// nothing of it, and the connection then ends; the daemon goes on serving.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_messages_are_answered_then_the_connection_ends() {
    let d = Daemon::start(&[]);
    let secret = "do-not-echo-this";
    let cases: [&[u8]; 4] = [
        b"{\"method\": \"org.sandcell.Kernel.Run\", \"parameters\": do-not-echo-this",
        b"\xff\xfe do-not-echo-this",
        b"[\"do-not-echo-this\"]",
        b"{\"parameters\": {\"x\": \"do-not-echo-this\"}}",
    ];
    for msg in cases {
        let s = connect(&d.socket);
        send_with_fds(&s, msg, &[]);
        let reply = read_reply(&s);
        let text = String::from_utf8_lossy(&reply);
        let v: Value = serde_json::from_slice(&reply).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["error"], "org.varlink.service.InvalidParameter", "{text}");
        assert_eq!(v["parameters"]["parameter"], "message", "{text}");
        assert!(!text.contains(secret), "{text}");
        // Then the daemon ends the connection.
        let mut rest = [0u8; 16];
        let n = (&s).read(&mut rest).unwrap_or(0);
        assert_eq!(n, 0, "the connection stays open after a malformed message");
    }
    let mut c = d.client().await;
    let r = c.run_collect("python", "print(1)", None).await.unwrap();
    assert_eq!(r.stdout, "1\n");
}

/// Held by a uid through setpriv: connects `n` times to the socket, waits until the daemon
/// has answered or closed the refused ones, counts those still open, then makes one more
/// connection, sends a call on it and prints `{"held": N, "reply": "..."}`; keeps its
/// connections until its standard input closes.
const HOLDER: &str = r#"
import json, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
time.sleep(2)
still = []
for s in held:
    s.setblocking(False)
    try:
        if s.recv(1) == b"":
            continue
    except BlockingIOError:
        pass
    still.append(s)
extra = socket.socket(socket.AF_UNIX)
extra.connect(path)
extra.sendall(b'{"method":"org.varlink.service.GetInfo"}\0')
extra.settimeout(5)
reply = b""
while not reply.endswith(b"\0"):
    chunk = extra.recv(4096)
    if not chunk:
        break
    reply += chunk
print(json.dumps({"held": len(still), "reply": reply.rstrip(b"\0").decode()}), flush=True)
sys.stdin.read()
"#;

/// Starts [`HOLDER`] as `uid` with `n` connections; returns the child and its report.
fn hold_connections(uid: u32, socket: &Path, n: usize) -> (std::process::Child, Value) {
    let mut child = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(["/usr/bin/python3", "-I", "-c", HOLDER])
        .arg(socket)
        .arg(n.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("setpriv");
    let mut out = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\n") {
        match out.read(&mut b) {
            Ok(1) => line.push(b[0]),
            _ => break,
        }
    }
    let v: Value = serde_json::from_slice(&line).unwrap_or_else(|e| {
        panic!(
            "holder of uid {uid}: {e}: {:?}",
            String::from_utf8_lossy(&line)
        )
    });
    (child, v)
}

#[tokio::test(flavor = "multi_thread")]
async fn uids_filling_the_connection_caps_leave_room_for_root_and_a_fresh_uid() {
    // max_connections 32, 16 per uid: general room 20, a shared reserve of 8 at 1 per uid,
    // 4 for root (sandcelld(8), CONNECTIONS).
    let d = Daemon::start(&[
        ("SANDCELL_MAX_CONNECTIONS", "32"),
        ("SANDCELL_MAX_CONNECTIONS_PER_UID", "16"),
    ]);
    open_socket(&d);
    let (mut a, ra) = hold_connections(60_001, &d.socket, 16);
    assert_eq!(ra["held"], 16, "{ra}");
    // Over its own cap: told so by name on its first call.
    let reply: Value = serde_json::from_str(ra["reply"].as_str().unwrap()).unwrap();
    assert_eq!(
        reply["error"], "org.sandcell.Kernel.CapacityExceeded",
        "{reply}"
    );
    assert_eq!(
        reply["parameters"]["budget"], "max_connections_per_uid",
        "{reply}"
    );
    assert_eq!(reply["parameters"]["max"], 16, "{reply}");
    // The second uid fills the general room (4 more) and is refused the reserve: it holds
    // more than a reserve share.
    let (mut b, rb) = hold_connections(60_002, &d.socket, 16);
    assert_eq!(rb["held"], 4, "{rb}");
    let reply: Value = serde_json::from_str(rb["reply"].as_str().unwrap()).unwrap();
    assert_eq!(
        reply["error"], "org.sandcell.Kernel.CapacityExceeded",
        "{reply}"
    );
    assert_eq!(
        reply["parameters"]["budget"], "connections_reserved",
        "{reply}"
    );
    // A fresh uid still gets in and runs a cell.
    if let Some((code, out, err)) = run_as(60_003, &d.socket) {
        assert_eq!(code, 0, "a fresh uid's run: {out} {err}");
        assert_eq!(out, "1\n");
    }
    // So does root.
    let mut c = d.client().await;
    let out = c.run_collect("python", "print(2)", None).await.unwrap();
    assert_eq!(out.stdout, "2\n");
    let log = d.log_text();
    assert!(
        log.contains("connection refused: capacity exceeded"),
        "{log}"
    );
    for h in [&mut a, &mut b] {
        drop(h.stdin.take());
        let _ = h.wait();
    }
}
