//! Serving one session's listener: accept, read a bounded head, decide, resolve, check the
//! address, connect, relay with the session's caps.

use crate::addr;
use crate::allow::{Allowlist, normalize};
use crate::request::{self, BadRequest, Target};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::timeout;

/// Time a client has to send a complete request head (slow requests hit it).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to connect to the destination.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A relayed connection with no bytes either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most distinct refused destinations logged per session (each once).
pub const MAX_LOGGED_REFUSALS: usize = 64;

/// A session's policy, as the daemon grants it.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Session id (for the journal and the counters).
    pub session: String,
    /// Host names allowed.
    pub hosts: Allowlist,
    /// Destination ports allowed.
    pub ports: Vec<u16>,
    /// Bytes relayed in both directions over the session's life.
    pub max_bytes: u64,
    /// Connections open at once.
    pub max_connections: u32,
    /// Connections over the session's life.
    pub max_total_connections: u64,
    /// Life of one connection, seconds.
    pub max_seconds: u64,
}

/// Counters of one session, reported to the daemon at revocation.
#[derive(Debug, Default, serde::Serialize)]
pub struct Counters {
    /// Requests relayed.
    pub allowed: AtomicU64,
    /// Requests refused (any reason).
    pub refused: AtomicU64,
    /// Bytes relayed, both directions.
    pub bytes: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
}

impl Counters {
    /// Sets every counter to `u`'s (a session granted again goes on from what it used).
    pub fn start_from(&self, u: crate::control::Used) {
        self.allowed.store(u.allowed, Ordering::Relaxed);
        self.refused.store(u.refused, Ordering::Relaxed);
        self.bytes.store(u.bytes, Ordering::Relaxed);
        self.connections.store(u.connections, Ordering::Relaxed);
    }
}

/// A served session.
#[derive(Debug)]
pub struct Session {
    /// Its policy.
    pub policy: Policy,
    /// Its counters.
    pub counters: Counters,
    open: Semaphore,
    logged: Mutex<HashSet<String>>,
}

impl Session {
    /// A session with nothing counted yet.
    pub fn new(policy: Policy) -> Session {
        Session {
            open: Semaphore::new(policy.max_connections as usize),
            policy,
            counters: Counters::default(),
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// Adds `n` relayed bytes; false once the session's cap is passed.
    fn charge(&self, n: usize) -> bool {
        let before = self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        before + n as u64 <= self.policy.max_bytes
    }

    fn refused(&self, r: &Refusal) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        if let Some(dest) = r.destination() {
            let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
            if logged.len() < MAX_LOGGED_REFUSALS && logged.insert(dest.clone()) {
                // Debug-formatted: the host is the cell's own text (a newline or a bidirectional
                // control character must not forge or disguise a journal line).
                tracing::warn!(session = ?self.policy.session, destination = ?dest, reason = ?r.to_string(), "egress refused");
            }
        }
    }
}

/// Why a request is refused: the one-line reason of the answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request head.
    #[error("{0}")]
    Bad(#[from] BadRequest),
    /// The host is not on the session's list.
    #[error("host not allowed: {0}")]
    Host(String),
    /// An IP literal instead of a name.
    #[error("IP address literals are not allowed, name a host: {0}")]
    Literal(String),
    /// A port not on the list.
    #[error("port not allowed: {0}")]
    Port(u16),
    /// Every address the name resolved to is in a refused class.
    #[error("{host} resolves to {} {class} address ({ip})", article(.class))]
    Address {
        /// Host.
        host: String,
        /// Class, e.g. `loopback`.
        class: &'static str,
        /// One of the addresses.
        ip: IpAddr,
    },
    /// Resolution failed.
    #[error("cannot resolve {0}")]
    Resolve(String),
    /// Connecting failed.
    #[error("cannot connect to {0}")]
    Connect(String),
    /// The session's byte cap is used up.
    #[error("byte cap reached ({0} bytes)")]
    Bytes(u64),
    /// Too many connections open at once.
    #[error("connection cap reached ({0} at once)")]
    Connections(u32),
    /// Too many connections over the session's life.
    #[error("connection cap reached ({0} in all)")]
    TotalConnections(u64),
    /// The head did not arrive in time.
    #[error("request head not received within {} s", HEAD_TIMEOUT.as_secs())]
    SlowHead,
}

impl Refusal {
    /// HTTP status of the answer: 403 for a policy refusal, 400/405 for a request the proxy
    /// does not serve, 502/504 for a destination that failed.
    pub fn status(&self) -> (u16, &'static str) {
        match self {
            Refusal::Bad(BadRequest::Form) => (405, "Method Not Allowed"),
            Refusal::Bad(_) => (400, "Bad Request"),
            Refusal::Resolve(_) | Refusal::Connect(_) => (502, "Bad Gateway"),
            Refusal::SlowHead => (408, "Request Timeout"),
            _ => (403, "Forbidden"),
        }
    }

    /// The destination named, for the once-per-session journal line.
    fn destination(&self) -> Option<String> {
        match self {
            Refusal::Host(h) | Refusal::Literal(h) | Refusal::Address { host: h, .. } => {
                Some(h.clone())
            }
            Refusal::Port(p) => Some(format!("port {p}")),
            _ => None,
        }
    }

    /// The whole answer.
    pub fn answer(&self) -> Vec<u8> {
        let (code, text) = self.status();
        let body = format!("sandcell egress: {self}\n");
        format!(
            "HTTP/1.1 {code} {text}\r\nContent-Type: text/plain; charset=utf-8\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }
}

/// Name resolution: a hosts file first (`address name...` lines, `#` comments), then the
/// system resolver unless `hosts_only`.
#[derive(Debug, Default)]
pub struct Resolver {
    hosts: HashMap<String, Vec<IpAddr>>,
    hosts_only: bool,
}

impl Resolver {
    /// A resolver reading `path` (format of hosts(5)), bounded to 1 MiB.
    ///
    /// Errors: the file cannot be read.
    pub fn with_hosts_file(path: &Path, hosts_only: bool) -> io::Result<Resolver> {
        use std::io::Read;
        let mut text = String::new();
        std::fs::File::open(path)?
            .take(1 << 20)
            .read_to_string(&mut text)?;
        Ok(Resolver::parse_hosts(&text, hosts_only))
    }

    /// A resolver over hosts(5) text.
    pub fn parse_hosts(text: &str, hosts_only: bool) -> Resolver {
        let mut hosts: HashMap<String, Vec<IpAddr>> = HashMap::new();
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or_default();
            let mut words = line.split_whitespace();
            let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) else {
                continue;
            };
            for name in words {
                if let Ok(n) = normalize(name) {
                    hosts.entry(n).or_default().push(ip);
                }
            }
        }
        Resolver { hosts, hosts_only }
    }

    /// The system resolver only.
    pub fn system() -> Resolver {
        Resolver::default()
    }

    /// The addresses of `host` (normalized) at `port`.
    async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Refusal> {
        if let Some(ips) = self.hosts.get(host) {
            return Ok(ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect());
        }
        if self.hosts_only {
            return Err(Refusal::Resolve(host.into()));
        }
        let found = timeout(CONNECT_TIMEOUT, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| Refusal::Resolve(host.into()))?
            .map_err(|_| Refusal::Resolve(host.into()))?;
        Ok(found.take(16).collect())
    }
}

/// Serves `listener` for `session` until `revoked` turns true (or its sender is dropped):
/// then the listener is closed and every connection of the session ends.
pub async fn serve(
    listener: TcpListener,
    session: Arc<Session>,
    resolver: Arc<Resolver>,
    mut revoked: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = revoked.wait_for(|r| *r) => return,
        };
        let Ok((stream, _)) = accepted else {
            // EMFILE and the like: do not spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (session, resolver, mut revoked) = (session.clone(), resolver.clone(), revoked.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = connection(stream, &session, &resolver) => {}
                _ = revoked.wait_for(|r| *r) => {}
            }
        });
    }
}

async fn connection(mut client: TcpStream, s: &Session, resolver: &Resolver) {
    let total = s.counters.connections.fetch_add(1, Ordering::Relaxed) + 1;
    let permit = if total > s.policy.max_total_connections {
        Err(Refusal::TotalConnections(s.policy.max_total_connections))
    } else {
        s.open
            .try_acquire()
            .map_err(|_| Refusal::Connections(s.policy.max_connections))
    };
    let result = match permit {
        Ok(_permit) => handle(&mut client, s, resolver).await,
        Err(r) => Err(r),
    };
    if let Err(r) = result {
        s.refused(&r);
        let _ = timeout(Duration::from_secs(5), client.write_all(&r.answer())).await;
        let _ = client.shutdown().await;
    }
}

/// Reads the head, decides, and relays. `Err`: refused before anything was relayed.
async fn handle(client: &mut TcpStream, s: &Session, resolver: &Resolver) -> Result<(), Refusal> {
    let mut buf = Vec::with_capacity(1024);
    let (target, n) = timeout(HEAD_TIMEOUT, async {
        let mut chunk = [0u8; 2048];
        loop {
            let got = client
                .read(&mut chunk)
                .await
                .map_err(|_| Refusal::SlowHead)?;
            if got == 0 {
                return Err(Refusal::Bad(BadRequest::Malformed(
                    "connection closed".into(),
                )));
            }
            buf.extend_from_slice(&chunk[..got]);
            if let Some(done) = request::parse(&buf)? {
                return Ok(done);
            }
        }
    })
    .await
    .map_err(|_| Refusal::SlowHead)??;
    let (host, port) = match &target {
        Target::Connect { host, port } | Target::Http { host, port, .. } => (host.clone(), *port),
    };
    if host.parse::<IpAddr>().is_ok() {
        return Err(Refusal::Literal(host));
    }
    let Ok(name) = normalize(&host) else {
        return Err(Refusal::Host(host.chars().take(80).collect()));
    };
    if !s.policy.hosts.allows(&name) {
        return Err(Refusal::Host(name));
    }
    if !s.policy.ports.contains(&port) {
        return Err(Refusal::Port(port));
    }
    if s.counters.bytes.load(Ordering::Relaxed) >= s.policy.max_bytes {
        return Err(Refusal::Bytes(s.policy.max_bytes));
    }
    let addrs = resolver.resolve(&name, port).await?;
    let mut first_refused = None;
    let good: Vec<SocketAddr> = addrs
        .into_iter()
        .filter(|a| match addr::refused(a.ip()) {
            Some(class) => {
                first_refused.get_or_insert((class, a.ip()));
                false
            }
            None => true,
        })
        .collect();
    if good.is_empty() {
        return Err(match first_refused {
            Some((class, ip)) => Refusal::Address {
                host: name,
                class: class.as_str(),
                ip,
            },
            None => Refusal::Resolve(name),
        });
    }
    let mut upstream = None;
    for a in &good {
        if let Ok(Ok(c)) = timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            upstream = Some(c);
            break;
        }
    }
    let Some(mut upstream) = upstream else {
        return Err(Refusal::Connect(format!("{name}:{port}")));
    };
    s.counters.allowed.fetch_add(1, Ordering::Relaxed);
    let rest = buf[n..].to_vec();
    match target {
        Target::Connect { .. } => {
            let _ = client
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await;
        }
        Target::Http { head, .. } => {
            if !s.charge(head.len()) || upstream.write_all(&head).await.is_err() {
                return Ok(());
            }
        }
    }
    if !rest.is_empty() && (!s.charge(rest.len()) || upstream.write_all(&rest).await.is_err()) {
        return Ok(());
    }
    let life = Duration::from_secs(s.policy.max_seconds);
    let (cr, cw) = client.split();
    let (ur, uw) = upstream.split();
    let _ = timeout(life, async {
        tokio::try_join!(one_way(cr, uw, s), one_way(ur, cw, s))
    })
    .await;
    Ok(())
}

/// Copies `r` to `w` until end of file, an error, the idle timeout or the byte cap.
async fn one_way<R, W>(mut r: R, mut w: W, s: &Session) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = timeout(IDLE_TIMEOUT, r.read(&mut buf))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        if !s.charge(n) {
            return Err(io::Error::other("byte cap reached"));
        }
        w.write_all(&buf[..n]).await?;
    }
}

/// "a" or "an" before an address class's name.
fn article(class: &str) -> &'static str {
    if class.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(hosts: &[&str]) -> Policy {
        Policy {
            session: "t".into(),
            hosts: Allowlist::parse(hosts).unwrap(),
            ports: vec![80, 443],
            max_bytes: 1 << 20,
            max_connections: 2,
            max_total_connections: 100,
            max_seconds: 30,
        }
    }

    async fn ask(port: u16, req: &str) -> String {
        let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        c.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        let _ = timeout(Duration::from_secs(20), c.read_to_string(&mut out)).await;
        out
    }

    async fn start(p: Policy, hosts: &str) -> (u16, Arc<Session>, watch::Sender<bool>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let s = Arc::new(Session::new(p));
        let (tx, rx) = watch::channel(false);
        tokio::spawn(serve(
            l,
            s.clone(),
            Arc::new(Resolver::parse_hosts(hosts, true)),
            rx,
        ));
        (port, s, tx)
    }

    #[tokio::test]
    async fn refusals_are_403_with_a_reason() {
        let hosts = "127.0.0.1 local.test\n10.1.2.3 ten.test\n169.254.169.254 meta.test\n";
        let (port, s, _tx) = start(
            policy(&["local.test", "ten.test", "meta.test", "ok.test"]),
            hosts,
        )
        .await;
        let a = ask(port, "CONNECT other.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(a.starts_with("HTTP/1.1 403"), "{a}");
        assert!(
            a.ends_with("sandcell egress: host not allowed: other.test\n"),
            "{a}"
        );
        let a = ask(port, "CONNECT local.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(
            a.contains("local.test resolves to a loopback address (127.0.0.1)"),
            "{a}"
        );
        let a = ask(port, "GET http://ten.test/ HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("resolves to a private address"), "{a}");
        let a = ask(port, "GET http://meta.test/latest HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("cloud metadata"), "{a}");
        let a = ask(port, "CONNECT ok.test:22 HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("port not allowed: 22"), "{a}");
        let a = ask(port, "CONNECT 93.184.216.34:443 HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("IP address literals are not allowed"), "{a}");
        let a = ask(port, "GET /x HTTP/1.1\r\n\r\n").await;
        assert!(a.starts_with("HTTP/1.1 405"), "{a}");
        assert_eq!(s.counters.refused.load(Ordering::Relaxed), 7);
        assert_eq!(s.counters.allowed.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn concurrent_connection_cap_and_revocation() {
        let (port, _s, tx) = start(policy(&["ok.test"]), "").await;
        // Two idle connections hold both slots (slow requests).
        let _a = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let _b = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let a = ask(port, "CONNECT ok.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("connection cap reached (2 at once)"), "{a}");
        tx.send(true).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            TcpStream::connect(("127.0.0.1", port)).await.is_err(),
            "listener closed at revocation"
        );
    }
}
