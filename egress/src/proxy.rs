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
/// A relayed connection with no bytes either way for this long is closed (one clock for both
/// directions: a download whose client sends nothing after its request is not idle).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Name lookups of one session running at once (each holds a thread of the proxy's
/// blocking pool until the system resolver answers or gives up, which can take 30 s).
pub const MAX_SESSION_LOOKUPS: usize = 4;
/// Kernel buffer requested for each direction of each relayed socket, bytes (SO_RCVBUF and
/// SO_SNDBUF, socket(7); Linux doubles the value for its bookkeeping). Without it TCP
/// autotuning grows a socket whose reader stalls to `tcp_rmem`'s maximum (6 MiB by default,
/// more where tuned), none of it counted against the session's byte cap.
pub const SOCKET_BUFFER_BYTES: usize = 128 * 1024;
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
    lookups: Arc<Semaphore>,
    logged: Mutex<HashSet<String>>,
}

impl Session {
    /// A session with nothing counted yet.
    pub fn new(policy: Policy) -> Session {
        Session {
            open: Semaphore::new(policy.max_connections as usize),
            lookups: Arc::new(Semaphore::new(MAX_SESSION_LOOKUPS)),
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
    #[error("port not allowed: {1} (for {0})")]
    Port(String, u16),
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
            Refusal::Port(h, p) => Some(format!("{h}:{p}")),
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

    /// The addresses of `host` (normalized) at `port`, looked up for session `s`: at most
    /// [`MAX_SESSION_LOOKUPS`] of a session's lookups hold a thread at once, each until the
    /// system resolver returns (also after this call gave up at [`CONNECT_TIMEOUT`]), so one
    /// session's lookups of names that never answer cannot take the threads every other
    /// session's lookups need.
    async fn resolve(
        &self,
        s: &Session,
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        if let Some(ips) = self.hosts.get(host) {
            return Ok(ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect());
        }
        if self.hosts_only {
            return Err(Refusal::Resolve(host.into()));
        }
        let refused = || Refusal::Resolve(host.into());
        let found = timeout(CONNECT_TIMEOUT, async {
            let permit = s
                .lookups
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| refused())?;
            let name = host.to_string();
            tokio::task::spawn_blocking(move || {
                use std::net::ToSocketAddrs;
                let _held = permit;
                (name.as_str(), port)
                    .to_socket_addrs()
                    .map(|a| a.take(16).collect::<Vec<_>>())
            })
            .await
            .map_err(|_| refused())?
            .map_err(|_| refused())
        })
        .await
        .map_err(|_| refused())??;
        Ok(found)
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
        // Closing with unread input (a request body, or a request never read at the
        // connection cap) would send a reset, which can reach the client before it read the
        // answer: the rest of the input is read and dropped first, within bounds, each byte
        // charged to the session's byte cap (so refused requests cannot make the proxy read
        // without end); none past the session's connection cap.
        if !matches!(r, Refusal::TotalConnections(_)) {
            let _ = timeout(DRAIN_TIME, drain(&mut client, s, DRAIN_BYTES)).await;
        }
    }
}

/// Most bytes read and dropped from a refused connection before it is closed.
const DRAIN_BYTES: u64 = 4 << 20;
/// Longest time a refused connection's input is read and dropped before it is closed.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads and drops up to `max` bytes of `r` until its end of file, charging each read to
/// session `s`; never reads past what its byte cap has left.
async fn drain<R: AsyncRead + Unpin>(r: &mut R, s: &Session, max: u64) {
    let mut buf = [0u8; 16 * 1024];
    let mut seen = 0u64;
    while seen < max {
        let left = s
            .policy
            .max_bytes
            .saturating_sub(s.counters.bytes.load(Ordering::Relaxed));
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 {
            return;
        }
        match r.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                seen += n as u64;
                if !s.charge(n) {
                    return;
                }
            }
        }
    }
}

/// Makes the close of `client` a reset (SO_LINGER with a zero timeout, socket(7)), so that a
/// relay cut by a cap, the idle or life time or an error is an error for the cell's client
/// (ECONNRESET) instead of an end of file it would take for the whole answer.
fn reset_on_close(client: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = setsockopt(
        client,
        sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
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
        return Err(Refusal::Port(name, port));
    }
    if s.counters.bytes.load(Ordering::Relaxed) >= s.policy.max_bytes {
        return Err(Refusal::Bytes(s.policy.max_bytes));
    }
    let addrs = resolver.resolve(s, &name, port).await?;
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
    let mut first_own = None;
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
        if own_address(a.ip()) {
            first_own.get_or_insert(a.ip());
            continue;
        }
        if let Ok(Ok(c)) = timeout(CONNECT_TIMEOUT, connect(*a)).await {
            // The connection's own end has the destination's address: the destination is
            // this host (a check that needs no list of its addresses).
            if c.local_addr().is_ok_and(|l| l.ip() == a.ip()) {
                first_own.get_or_insert(a.ip());
                continue;
            }
            upstream = Some(c);
            break;
        }
    }
    let Some(mut upstream) = upstream else {
        return Err(match first_own {
            Some(ip) => Refusal::Address {
                host: name,
                class: OWN_CLASS,
                ip,
            },
            None => Refusal::Connect(format!("{name}:{port}")),
        });
    };
    bound_buffers(client);
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
                reset_on_close(client);
                return Ok(());
            }
        }
    }
    if !rest.is_empty() && (!s.charge(rest.len()) || upstream.write_all(&rest).await.is_err()) {
        reset_on_close(client);
        return Ok(());
    }
    let life = Duration::from_secs(s.policy.max_seconds);
    relay_within(client, &mut upstream, s, IDLE_TIMEOUT, life).await;
    Ok(())
}

/// [`relay`] for at most `life`; a relay that did not finish (cut by the byte cap, `idle`,
/// `life` or an error) makes the close of `client` a reset.
async fn relay_within(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    s: &Session,
    idle: Duration,
    life: Duration,
) {
    let finished = timeout(life, relay(client, upstream, s, idle))
        .await
        .unwrap_or(false);
    if !finished {
        reset_on_close(client);
    }
}

/// The class named when a host resolves to an address of the proxy's own host.
const OWN_CLASS: &str = "local interface";

/// Whether `ip` is an address of this host's interfaces: a socket binds to it (bind(2) gives
/// `EADDRNOTAVAIL` for any other address), asked only while the kernel refuses non-local
/// binds (`net.ipv4.ip_nonlocal_bind` and `net.ipv6.ip_nonlocal_bind` 0, their default);
/// otherwise the check after connecting decides. Needs only the address families the proxy
/// has (no netlink).
fn own_address(ip: IpAddr) -> bool {
    use std::sync::OnceLock;
    static NONLOCAL: OnceLock<bool> = OnceLock::new();
    let nonlocal = *NONLOCAL.get_or_init(|| {
        [
            "/proc/sys/net/ipv4/ip_nonlocal_bind",
            "/proc/sys/net/ipv6/ip_nonlocal_bind",
        ]
        .iter()
        .any(|p| std::fs::read_to_string(p).is_ok_and(|v| v.trim() != "0"))
    });
    !nonlocal && std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Connects to `a` with [`SOCKET_BUFFER_BYTES`] buffers.
async fn connect(a: SocketAddr) -> io::Result<TcpStream> {
    let sock = match a {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES as u32)?;
    sock.set_send_buffer_size(SOCKET_BUFFER_BYTES as u32)?;
    sock.connect(a).await
}

/// Gives the accepted `client` socket [`SOCKET_BUFFER_BYTES`] buffers (best effort).
fn bound_buffers(client: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = setsockopt(client, sockopt::RcvBuf, &SOCKET_BUFFER_BYTES);
    let _ = setsockopt(client, sockopt::SndBuf, &SOCKET_BUFFER_BYTES);
}

/// Relays `client` and `upstream` both ways until both ends finished (true), an error, the
/// byte cap, or `idle` with no byte in either direction (false).
async fn relay(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    s: &Session,
    idle: Duration,
) -> bool {
    let last = AtomicU64::new(0);
    let start = tokio::time::Instant::now();
    let (cr, cw) = client.split();
    let (ur, uw) = upstream.split();
    tokio::try_join!(
        one_way(cr, uw, s, &last, start, idle),
        one_way(ur, cw, s, &last, start, idle)
    )
    .is_ok()
}

/// Copies `r` to `w` until end of file, an error or the byte cap, or until `idle` passed
/// since `last` (ms after `start`, moved by either direction) with nothing read.
async fn one_way<R, W>(
    mut r: R,
    mut w: W,
    s: &Session,
    last: &AtomicU64,
    start: tokio::time::Instant,
    idle: Duration,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    let deadline = || start + Duration::from_millis(last.load(Ordering::Relaxed)) + idle;
    loop {
        let n = match tokio::time::timeout_at(deadline(), r.read(&mut buf)).await {
            Ok(n) => n?,
            // The other direction may have moved meanwhile: its time counts too.
            Err(_) if deadline() > tokio::time::Instant::now() => continue,
            Err(_) => return Err(io::Error::from(io::ErrorKind::TimedOut)),
        };
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        last.fetch_max(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        if !s.charge(n) {
            return Err(io::Error::other("byte cap reached"));
        }
        w.write_all(&buf[..n]).await?;
    }
}

/// "a" or "an" before an address class's name ("a unique-local": the sound, not the letter).
fn article(class: &str) -> &'static str {
    if class.starts_with(['a', 'e', 'i', 'o', 'u']) && !class.starts_with("uni") {
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
        assert!(a.contains("port not allowed: 22 (for ok.test)"), "{a}");
        let a = ask(port, "CONNECT 93.184.216.34:443 HTTP/1.1\r\n\r\n").await;
        assert!(a.contains("IP address literals are not allowed"), "{a}");
        let a = ask(port, "GET /x HTTP/1.1\r\n\r\n").await;
        assert!(a.starts_with("HTTP/1.1 405"), "{a}");
        assert_eq!(s.counters.refused.load(Ordering::Relaxed), 7);
        assert_eq!(s.counters.allowed.load(Ordering::Relaxed), 0);
    }

    /// A connected pair of TCP streams on loopback.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    /// The idle clock is one for both directions: a download that trickles while its client
    /// sends nothing after the request is relayed to its end, past the idle time; a relay
    /// with nothing moving either way ends at it.
    #[tokio::test]
    async fn a_one_way_download_is_not_idle() {
        let s = Session::new(policy(&["ok.test"]));
        let idle = Duration::from_millis(300);
        // cell <-> (client, upstream) <-> server
        let (mut cell, mut client) = pair().await;
        let (mut upstream, mut server) = pair().await;
        let sender = tokio::spawn(async move {
            for _ in 0..12 {
                server.write_all(b"x").await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            drop(server);
        });
        let relayed = tokio::spawn(async move {
            relay(&mut client, &mut upstream, &s, idle).await;
        });
        let mut got = Vec::new();
        timeout(Duration::from_secs(10), cell.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, vec![b'x'; 12], "the trickle was cut");
        sender.await.unwrap();
        relayed.await.unwrap();

        let s = Session::new(policy(&["ok.test"]));
        let (_cell, mut client) = pair().await;
        let (mut upstream, _server) = pair().await;
        let t0 = tokio::time::Instant::now();
        timeout(
            Duration::from_secs(10),
            relay(&mut client, &mut upstream, &s, idle),
        )
        .await
        .expect("an idle relay ends");
        assert!(t0.elapsed() >= idle, "{:?}", t0.elapsed());
    }

    /// A download cut by the byte cap is an error for the cell's client (a reset), not an end
    /// of file that would pass for the whole answer; one that finishes ends normally.
    #[tokio::test]
    async fn a_relay_cut_by_the_byte_cap_resets_the_client() {
        for (cap, cut) in [(1000u64, true), (1 << 20, false)] {
            let mut p = policy(&["ok.test"]);
            p.max_bytes = cap;
            let s = Arc::new(Session::new(p));
            let (mut cell, mut client) = pair().await;
            let (mut upstream, mut server) = pair().await;
            let sender = tokio::spawn(async move {
                let _ = server.write_all(&[b'x'; 5000]).await;
                drop(server);
            });
            let relayed = tokio::spawn(async move {
                let idle = Duration::from_secs(5);
                relay_within(
                    &mut client,
                    &mut upstream,
                    &s,
                    idle,
                    Duration::from_secs(10),
                )
                .await;
            });
            let mut got = Vec::new();
            let r = timeout(Duration::from_secs(10), cell.read_to_end(&mut got))
                .await
                .unwrap();
            if cut {
                let e = r.expect_err("a cut download must not end like a whole one");
                assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
                assert!(got.len() < 5000, "{}", got.len());
            } else {
                assert_eq!(r.unwrap(), 5000);
            }
            sender.await.unwrap();
            relayed.await.unwrap();
        }
    }

    /// A refused request with a body still gets its 403 and reason: the proxy reads the body
    /// before closing instead of resetting a connection with unread input.
    #[tokio::test]
    async fn a_refused_request_with_a_body_gets_its_answer() {
        let mut p = policy(&["ok.test"]);
        p.max_bytes = 8 << 20;
        let (port, s, _tx) = start(p, "").await;
        let c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let (mut r, mut w) = c.into_split();
        let writer = tokio::spawn(async move {
            let body = vec![b'b'; 1 << 20];
            let head = format!(
                "POST http://other.test/upload HTTP/1.1\r\nHost: other.test\r\n\
                 Content-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = w.write_all(head.as_bytes()).await;
            let _ = w.write_all(&body).await;
            w
        });
        let mut out = Vec::new();
        timeout(Duration::from_secs(20), r.read_to_end(&mut out))
            .await
            .unwrap()
            .expect("the answer, not a reset");
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 403"), "{out}");
        assert!(out.contains("host not allowed: other.test"), "{out}");
        drop(writer.await.unwrap());
        // What was read and dropped counts against the session's byte cap (the drain goes on
        // after the answer: waited for); a session at its cap has nothing drained.
        let t0 = tokio::time::Instant::now();
        while s.counters.bytes.load(Ordering::Relaxed) < (1 << 20) - (16 << 10) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the drained body was not charged: {}",
                s.counters.bytes.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A session at its byte cap has nothing of a refused request drained: the cap is never
    /// passed by what the proxy reads and drops.
    #[tokio::test]
    async fn nothing_is_drained_past_the_byte_cap() {
        let mut p = policy(&["ok.test"]);
        p.max_bytes = 100;
        let (port, s, _tx) = start(p, "").await;
        s.counters.bytes.store(100, Ordering::Relaxed);
        let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let head = "POST http://other.test/x HTTP/1.1\r\nContent-Length: 65536\r\n\r\n";
        let _ = c.write_all(head.as_bytes()).await;
        let _ = c.write_all(&[b'b'; 65536]).await;
        let mut out = Vec::new();
        let _ = timeout(Duration::from_secs(10), c.read_to_end(&mut out)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(s.counters.bytes.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn articles() {
        assert_eq!(article("unique-local"), "a");
        assert_eq!(article("unspecified"), "an");
        assert_eq!(article("loopback"), "a");
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
