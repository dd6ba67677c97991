//! The control protocol end to end, in process: a listener handed over a Unix socket with
//! `SCM_RIGHTS` and one JSON line is served with the granted policy, a second descriptor or
//! a malformed grant is refused, and closing the control connection revokes the session.

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use sandcell_egress::control::{self, Server};
use sandcell_egress::proxy::Resolver;
use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

fn start() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sandcell-egress-test-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("control-{}", rand_suffix()));
    let std = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std.set_nonblocking(true).unwrap();
    let server = Arc::new(Server {
        resolver: Arc::new(Resolver::parse_hosts("127.0.0.1 local.test\n", true)),
        // SAFETY: geteuid has no preconditions.
        allowed_uid: unsafe { libc::geteuid() },
        sessions: Arc::new(tokio::sync::Semaphore::new(8)),
        remembered: Default::default(),
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    std::thread::spawn(move || {
        rt.block_on(async move {
            let l = tokio::net::UnixListener::from_std(std).unwrap();
            let _ = control::run(l, server).await;
        })
    });
    path
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn grant_line(session: &str) -> String {
    format!(
        "{}\n",
        serde_json::json!({"session": session, "hosts": ["local.test", "*.ok.test"],
            "ports": [80], "max_bytes": 1000, "max_connections": 4,
            "max_total_connections": 10, "max_seconds": 5})
    )
}

/// A listener on a free loopback port granted to the proxy at `path` with `line`: the
/// control connection (after the proxy's `ok`) and the port.
fn granted(path: &std::path::Path, line: &str) -> (UnixStream, u16) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut ctl = UnixStream::connect(path).unwrap();
    send(&ctl, line, &[listener.as_raw_fd()]);
    drop(listener); // the proxy holds the only copy now
    assert_eq!(read_line(&mut ctl), r#"{"ok":true}"#);
    (ctl, port)
}

fn send(ctl: &UnixStream, line: &str, fds: &[i32]) {
    let iov = [IoSlice::new(line.as_bytes())];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(ctl.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
}

fn read_line(ctl: &mut UnixStream) -> String {
    ctl.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while ctl.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
        out.push(b[0]);
    }
    String::from_utf8(out).unwrap()
}

fn ask(port: u16, req: &str) -> String {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out
}

#[test]
fn a_handed_listener_is_served_and_revoked_at_close() {
    let path = start();
    let (mut ctl, port) = granted(&path, &grant_line("s1"));
    let a = ask(port, "GET http://other.test/ HTTP/1.1\r\n\r\n");
    assert!(a.starts_with("HTTP/1.1 403 Forbidden"), "{a}");
    assert!(
        a.ends_with("sandcell egress: host not allowed: other.test\n"),
        "{a}"
    );
    let a = ask(port, "CONNECT local.test:80 HTTP/1.1\r\n\r\n");
    assert!(
        a.contains("local.test resolves to a loopback address (127.0.0.1)"),
        "{a}"
    );
    // `counters`: the figures so far, and the session goes on serving.
    ctl.write_all(b"counters\n").unwrap();
    let so_far: serde_json::Value = serde_json::from_str(&read_line(&mut ctl)).unwrap();
    assert_eq!(so_far["refused"], 2, "{so_far}");
    let a = ask(port, "GET http://other.test/ HTTP/1.1\r\n\r\n");
    assert!(a.starts_with("HTTP/1.1 403 Forbidden"), "still served: {a}");
    ctl.write_all(b"counters\n").unwrap();
    let so_far: serde_json::Value = serde_json::from_str(&read_line(&mut ctl)).unwrap();
    assert_eq!(so_far["refused"], 3, "{so_far}");
    // Revoke with a line: the counters come back, the listener is gone.
    ctl.write_all(b"revoke\n").unwrap();
    let counters: serde_json::Value = serde_json::from_str(&read_line(&mut ctl)).unwrap();
    assert_eq!(counters["refused"], 3, "{counters}");
    assert_eq!(counters["allowed"], 0, "{counters}");
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the listener outlived its revocation"
    );
}

#[test]
fn the_end_of_the_control_connection_revokes() {
    let path = start();
    let (ctl, port) = granted(&path, &grant_line("s2"));
    // A connection held open (a slow request) ends with the session too.
    let mut held = TcpStream::connect(("127.0.0.1", port)).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    drop(ctl);
    let mut b = [0u8; 16];
    assert_eq!(
        held.read(&mut b).unwrap_or(0),
        0,
        "the held connection was not closed"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn bad_grants_are_refused() {
    let path = start();
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut ctl = UnixStream::connect(&path).unwrap();
    send(&ctl, &grant_line("s3"), &[a.as_raw_fd(), b.as_raw_fd()]);
    assert!(read_line(&mut ctl).contains("one listener descriptor expected"));

    let mut ctl = UnixStream::connect(&path).unwrap();
    send(&ctl, &grant_line("s4"), &[]);
    assert!(read_line(&mut ctl).contains("no listener descriptor"));

    let mut ctl = UnixStream::connect(&path).unwrap();
    send(&ctl, "{\"session\":\"s5\"}\n", &[a.as_raw_fd()]);
    assert!(read_line(&mut ctl).contains("grant"), "missing fields");

    // A descriptor that is not a listening socket.
    let (x, _y) = UnixStream::pair().unwrap();
    let mut ctl = UnixStream::connect(&path).unwrap();
    send(&ctl, &grant_line("s6"), &[x.as_raw_fd()]);
    assert!(read_line(&mut ctl).contains("not a listening stream socket"));

    // An endless line.
    let mut ctl = UnixStream::connect(&path).unwrap();
    let long = "x".repeat(control::MAX_LINE + 10);
    let _ = ctl.write_all(long.as_bytes());
    assert!(read_line(&mut ctl).contains("longer than"));
}

/// Counters of `session` through a `counters` line.
fn counters(ctl: &mut UnixStream) -> serde_json::Value {
    ctl.write_all(b"counters\n").unwrap();
    serde_json::from_str(&read_line(ctl)).unwrap()
}

/// A daemon that restarts loses its control connections, which revokes every grant; its
/// successor grants the adopted sessions again. The budgets go on from what each session used,
/// whether the proxy remembers it (same proxy) or only the grant says it (a new proxy).
#[test]
fn a_session_granted_again_goes_on_from_what_it_used() {
    let path = start();
    let (mut ctl, port) = granted(&path, &grant_line("again"));
    for _ in 0..3 {
        let a = ask(port, "GET http://other.test/ HTTP/1.1\r\n\r\n");
        assert!(a.starts_with("HTTP/1.1 403"), "{a}");
    }
    assert_eq!(counters(&mut ctl)["connections"], 3);
    drop(ctl);
    std::thread::sleep(Duration::from_millis(200));
    // The same session granted again (no `used` in the grant): the proxy's own counters.
    let (mut ctl, port) = granted(&path, &grant_line("again"));
    let c = counters(&mut ctl);
    assert_eq!(
        (c["connections"].clone(), c["refused"].clone()),
        (3.into(), 3.into()),
        "{c}"
    );
    // A session this proxy never saw, granted with what it used under another proxy: 10
    // connections of its 10 are gone.
    let mut g: serde_json::Value = serde_json::from_str(grant_line("elsewhere").trim()).unwrap();
    g["used"] = serde_json::json!({"connections": 10, "bytes": 5});
    let (mut ctl2, port2) = granted(&path, &format!("{g}\n"));
    let a = ask(port2, "GET http://local.test/ HTTP/1.1\r\n\r\n");
    assert!(a.contains("connection cap reached (10 in all)"), "{a}");
    assert_eq!(counters(&mut ctl2)["bytes"], 5);
    // The first session still serves, from 3.
    let a = ask(port, "GET http://other.test/ HTTP/1.1\r\n\r\n");
    assert!(a.starts_with("HTTP/1.1 403"), "{a}");
    assert_eq!(counters(&mut ctl)["connections"], 4);
}
