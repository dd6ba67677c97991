//! The proxy binary against a real, private "internet": a web server in a network namespace
//! the test creates, reached from the proxy's own namespace over a veth pair (addresses
//! 11.0.0.0/24, nothing leaves the machine and the host's network is untouched), names from
//! a hosts file (`--hosts-only`). Listeners are handed over the control socket exactly as
//! sandcelld hands them.
//!
//! Needs root and iproute2's `ip`; skips with the reason otherwise.

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use sandcell_testing::netns::{PROXY_NS, PrivateNet};
use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

struct World {
    net: PrivateNet,
    control: PathBuf,
    _dir: PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

/// The test tier that is missing (`root`) and why.
fn skip_reason() -> Option<(&'static str, String)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some((
            "root",
            "not root (network namespaces need CAP_SYS_ADMIN)".into(),
        ));
    }
    if !sandcell_testing::netns::ip_available() {
        return Some(("netns", "iproute2's ip is missing".into()));
    }
    if Command::new("/usr/bin/python3").arg("-V").output().is_err() {
        return Some((
            "root",
            "/usr/bin/python3 (the web server) is missing".into(),
        ));
    }
    None
}

fn world() -> World {
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("sandcell-egress-netns-{pid}"));
    std::fs::create_dir_all(dir.join("www")).unwrap();
    std::fs::write(
        dir.join("www/hello.txt"),
        "hello from the private internet\n",
    )
    .unwrap();
    std::fs::write(dir.join("www/big.bin"), vec![b'x'; 2 << 20]).unwrap();
    std::fs::write(
        dir.join("hosts"),
        "11.0.0.2 data.test other.test data.sub.test\n11.0.0.1 self.test\n127.0.0.1 loop.test\n\
         10.1.2.3 ten.test\n169.254.169.254 meta.test\n::ffff:127.0.0.1 mapped.test\n",
    )
    .unwrap();
    let mut w = World {
        net: PrivateNet::new("sce"),
        control: dir.join("control"),
        _dir: dir.clone(),
    };
    w.net.serve_http(&dir.join("www"));
    let mut proxy = w.net.command_in(
        PROXY_NS,
        std::path::Path::new(env!("CARGO_BIN_EXE_sandcell-egress")),
    );
    proxy
        .arg("--control")
        .arg(&w.control)
        .arg("--hosts-file")
        .arg(dir.join("hosts"))
        .arg("--hosts-only")
        .env("RUST_LOG", "warn");
    w.net.spawn(proxy);
    let t0 = Instant::now();
    while !w.control.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the proxy did not bind its control socket"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    w
}

/// A session granted `hosts` with caps; returns its port and its control connection.
fn grant(
    w: &World,
    session: &str,
    hosts: &[&str],
    max_bytes: u64,
    max_connections: u32,
) -> (u16, UnixStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut ctl = UnixStream::connect(&w.control).unwrap();
    let line = format!(
        "{}\n",
        serde_json::json!({"session": session, "hosts": hosts, "ports": [80],
            "max_bytes": max_bytes, "max_connections": max_connections,
            "max_total_connections": 10000, "max_seconds": 30})
    );
    let fds = [l.as_raw_fd()];
    sendmsg::<()>(
        ctl.as_raw_fd(),
        &[IoSlice::new(line.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    ctl.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 64];
    let n = ctl.read(&mut b).unwrap();
    assert_eq!(&b[..n], b"{\"ok\":true}\n");
    (port, ctl)
}

fn ask(port: u16, req: &str) -> Vec<u8> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    c.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The server in the other namespace takes a moment to listen.
fn wait_for_web(port: u16) {
    let t0 = Instant::now();
    loop {
        let a = text(&ask(
            port,
            "GET http://data.test/hello.txt HTTP/1.1\r\n\r\n",
        ));
        if a.starts_with("HTTP/1.0 200") || a.starts_with("HTTP/1.1 200") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the web server never answered: {a}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_proxy_reaches_allowed_hosts_only_within_its_caps() {
    if let Some((tier, why)) = skip_reason() {
        sandcell_testing::skip!(tier, "{why}");
    }
    let w = world();
    let hosts = [
        "data.test",
        "*.sub.test",
        "loop.test",
        "ten.test",
        "meta.test",
        "mapped.test",
        "self.test",
    ];
    let (a, _ctl_a) = grant(&w, "a", &hosts, 64 << 20, 16);
    wait_for_web(a);

    // Allowed: absolute-form HTTP and a CONNECT tunnel.
    let r = text(&ask(
        a,
        "GET http://data.test/hello.txt HTTP/1.1\r\nAccept: */*\r\n\r\n",
    ));
    assert!(r.ends_with("hello from the private internet\n"), "{r}");
    let r = text(&ask(
        a,
        "GET http://data.sub.test/hello.txt HTTP/1.1\r\n\r\n",
    ));
    assert!(r.contains("200"), "a wildcard match: {r}");
    let r = text(&ask(
        a,
        "CONNECT data.test:80 HTTP/1.1\r\n\r\nGET /hello.txt HTTP/1.0\r\nHost: data.test\r\n\r\n",
    ));
    assert!(
        r.starts_with("HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.0 200"),
        "{r}"
    );
    assert!(r.ends_with("hello from the private internet\n"), "{r}");

    // Refused: another host, another port, internal addresses whatever the name.
    let r = text(&ask(a, "GET http://other.test/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(r.starts_with("HTTP/1.1 403 Forbidden"), "{r}");
    assert!(
        r.ends_with("sandcell egress: host not allowed: other.test\n"),
        "{r}"
    );
    let r = text(&ask(a, "CONNECT data.test:443 HTTP/1.1\r\n\r\n"));
    assert!(
        r.contains("sandcell egress: port not allowed: 443 (for "),
        "{r}"
    );
    for (host, class) in [
        ("loop.test", "loopback"),
        ("ten.test", "private"),
        ("meta.test", "cloud metadata"),
        ("mapped.test", "loopback"),
        // The proxy's own interface (its namespace's 11.0.0.1): a service of the proxy's
        // host on an allowed port is not reached through a name that resolves to it.
        ("self.test", "local interface"),
    ] {
        let r = text(&ask(a, &format!("GET http://{host}/ HTTP/1.1\r\n\r\n")));
        assert!(r.starts_with("HTTP/1.1 403"), "{host}: {r}");
        assert!(
            r.contains(&format!("{host} resolves to a {class} address")),
            "{host}: {r}"
        );
    }
    let r = text(&ask(a, "GET http://11.0.0.2/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(r.contains("IP address literals are not allowed"), "{r}");

    // A session's subset: b may reach other.test only.
    let (b, _ctl_b) = grant(&w, "b", &["other.test"], 64 << 20, 16);
    let r = text(&ask(b, "GET http://data.test/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(r.ends_with("host not allowed: data.test\n"), "{r}");
    let r = text(&ask(b, "GET http://other.test/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(r.ends_with("hello from the private internet\n"), "{r}");

    // The byte cap: a 2 MiB download under a 100 kB cap is cut, and the next request refused.
    let (c, _ctl_c) = grant(&w, "c", &["data.test"], 100_000, 16);
    let got = ask(c, "GET http://data.test/big.bin HTTP/1.1\r\n\r\n");
    assert!(
        got.len() <= 100_000 && got.len() > 1000,
        "relayed {} bytes",
        got.len()
    );
    let r = text(&ask(c, "GET http://data.test/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(
        r.ends_with("sandcell egress: byte cap reached (100000 bytes)\n"),
        "{r}"
    );

    // The connection cap: two held connections fill a cap of 2.
    let (d, _ctl_d) = grant(&w, "d", &["data.test"], 64 << 20, 2);
    let _h1 = TcpStream::connect(("127.0.0.1", d)).unwrap();
    let _h2 = TcpStream::connect(("127.0.0.1", d)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let r = text(&ask(d, "GET http://data.test/hello.txt HTTP/1.1\r\n\r\n"));
    assert!(
        r.ends_with("sandcell egress: connection cap reached (2 at once)\n"),
        "{r}"
    );

    // A flood of slow connections on one session does not stall another's.
    let (e, _ctl_e) = grant(&w, "e", &["data.test"], 64 << 20, 16);
    let flood: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", e)).ok())
        .collect();
    assert!(flood.len() >= 100, "opened {}", flood.len());
    let t0 = Instant::now();
    for _ in 0..5 {
        let r = text(&ask(a, "GET http://data.test/hello.txt HTTP/1.1\r\n\r\n"));
        assert!(r.ends_with("hello from the private internet\n"), "{r}");
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "5 fetches beside the flood took {took:?}"
    );
    drop(flood);

    // Revocation: the end of a's control connection closes its listener.
    drop(_ctl_a);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        TcpStream::connect(("127.0.0.1", a)).is_err(),
        "a's listener outlived its revocation"
    );
}
