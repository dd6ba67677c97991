//! The control socket: how sandcelld grants and revokes a session's egress.
//!
//! One Unix stream connection per session. sandcelld (peer credentials checked: the uid
//! given, root in production, see unix(7) `SO_PEERCRED`) sends one JSON line, the [`Grant`],
//! at most [`MAX_LINE`] bytes, with exactly one descriptor attached to its first byte
//! (`SCM_RIGHTS`, unix(7)): a listening TCP socket bound on `127.0.0.1` inside the session
//! worker's network namespace. The proxy answers one line, `{"ok":true}` or
//! `{"error":"REASON"}`, then serves the listener. The line `counters` is answered with the
//! session's counters so far as one JSON line (`{"allowed":N,"refused":N,"bytes":N,
//! "connections":N}`: requests served and refused, bytes relayed both ways, connections
//! accepted) and the session goes on; sandcelld sends one line at a time and reads its answer
//! before the next. The session is revoked by any other line (`revoke`) or by the
//! connection's end: the proxy closes the listener and every connection of the session, and
//! (when revoked with a line) answers the session's final counters likewise.

use crate::allow::Allowlist;
use crate::proxy::{self, Policy, Resolver, Session};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockType, getsockopt, recvmsg, sockopt};
use serde::{Deserialize, Serialize};
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, watch};

/// Most bytes of a grant line, newline included.
pub const MAX_LINE: usize = 64 * 1024;
/// Most host patterns in a grant.
pub const MAX_HOSTS: usize = 256;
/// Most ports in a grant.
pub const MAX_PORTS: usize = 64;

/// A session's egress, as sandcelld grants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Session id.
    pub session: String,
    /// Host names and `*.` wildcards allowed.
    pub hosts: Vec<String>,
    /// Destination ports allowed.
    pub ports: Vec<u16>,
    /// Bytes relayed over the session's life, both directions.
    pub max_bytes: u64,
    /// Connections open at once.
    pub max_connections: u32,
    /// Connections over the session's life.
    pub max_total_connections: u64,
    /// Life of one connection, seconds.
    pub max_seconds: u64,
    /// What the session used under earlier grants (absent: nothing): a daemon that adopts a
    /// session grants it again with the counters it last read, so that its budgets
    /// (`max_bytes`, `max_total_connections`) go on from there, not from zero. The proxy
    /// takes, counter by counter, the larger of these and what it counted itself for the
    /// same session id ([`Server::remembered`]).
    #[serde(default, skip_serializing_if = "Used::is_zero")]
    pub used: Used,
}

/// A session's counters: requests served and refused, bytes relayed both ways, connections
/// accepted (the `counters` answer's fields).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Used {
    /// Requests served.
    #[serde(default)]
    pub allowed: u64,
    /// Requests refused.
    #[serde(default)]
    pub refused: u64,
    /// Bytes relayed, both directions.
    #[serde(default)]
    pub bytes: u64,
    /// Connections accepted.
    #[serde(default)]
    pub connections: u64,
}

impl Used {
    /// Each counter at most 2^62: counts added to it later cannot wrap around (a forged
    /// `used` of 2^64 - 1 would make the next connection count from zero).
    pub fn bounded(self) -> Used {
        const MAX: u64 = 1 << 62;
        Used {
            allowed: self.allowed.min(MAX),
            refused: self.refused.min(MAX),
            bytes: self.bytes.min(MAX),
            connections: self.connections.min(MAX),
        }
    }

    /// Nothing counted.
    pub fn is_zero(&self) -> bool {
        *self == Used::default()
    }

    /// Counter by counter, the larger of the two.
    pub fn max(self, o: Used) -> Used {
        Used {
            allowed: self.allowed.max(o.allowed),
            refused: self.refused.max(o.refused),
            bytes: self.bytes.max(o.bytes),
            connections: self.connections.max(o.connections),
        }
    }

    fn of(s: &Session) -> Used {
        let c = &s.counters;
        Used {
            allowed: c.allowed.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
        }
    }
}

/// How long the proxy keeps a revoked session's counters for a grant of the same session
/// that may follow (a daemon that restarted and adopted it): one hour.
pub const REMEMBER_FOR: std::time::Duration = std::time::Duration::from_secs(3600);
/// Most revoked sessions whose counters the proxy keeps; the oldest go first.
pub const MAX_REMEMBERED: usize = 4096;

/// The counters of sessions granted lately, by session id: live ones (their counters as
/// they grow) and revoked ones (for [`REMEMBER_FOR`], at most [`MAX_REMEMBERED`]). A grant
/// of an id found here goes on from its counters: a daemon's restart, which revokes every
/// grant with its control connections, does not give a session its budgets again.
#[derive(Debug, Default)]
pub struct Remembered {
    by_id: std::sync::Mutex<std::collections::HashMap<String, Kept>>,
}

#[derive(Debug)]
struct Kept {
    /// The live grant's session (`None` once revoked: only its counters are kept, not its
    /// policy and logged refusals, so that remembered sessions stay small).
    session: Option<Arc<Session>>,
    /// Its counters at revocation.
    used: Used,
    /// When it was revoked (`None`: live).
    revoked: Option<std::time::Instant>,
}

impl Remembered {
    /// Registers `s` as the live session of its id; returns what the id had used before
    /// (zero when unknown), or `None` (nothing registered) while another grant of the same
    /// id is live: two grants of one session would each get its whole budget. A revoked
    /// one is replaced.
    fn granted(&self, s: &Arc<Session>) -> Option<Used> {
        let mut m = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        m.retain(|_, k| {
            k.revoked
                .is_none_or(|t| now.duration_since(t) < REMEMBER_FOR)
        });
        let revoked = m.values().filter(|k| k.revoked.is_some()).count();
        if revoked >= MAX_REMEMBERED {
            let oldest: Vec<String> = {
                let mut v: Vec<_> = m
                    .iter()
                    .filter_map(|(id, k)| k.revoked.map(|t| (t, id.clone())))
                    .collect();
                v.sort();
                v.into_iter()
                    .take(revoked + 1 - MAX_REMEMBERED)
                    .map(|(_, id)| id)
                    .collect()
            };
            for id in oldest {
                m.remove(&id);
            }
        }
        if m.get(&s.policy.session)
            .is_some_and(|k| k.revoked.is_none())
        {
            return None;
        }
        let before = m.get(&s.policy.session).map(|k| k.used).unwrap_or_default();
        m.insert(
            s.policy.session.clone(),
            Kept {
                session: Some(s.clone()),
                used: Used::default(),
                revoked: None,
            },
        );
        Some(before)
    }

    /// `s` was revoked: its counters are kept for [`REMEMBER_FOR`] (unless a later grant of
    /// its id replaced it already).
    fn revoked(&self, s: &Arc<Session>) {
        let mut m = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = m.get_mut(&s.policy.session)
            && k.session.as_ref().is_some_and(|live| Arc::ptr_eq(live, s))
        {
            k.used = Used::of(s);
            k.session = None;
            k.revoked = Some(std::time::Instant::now());
        }
    }

    /// Sessions known: (live, revoked).
    pub fn len(&self) -> (usize, usize) {
        let m = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        let revoked = m.values().filter(|k| k.revoked.is_some()).count();
        (m.len() - revoked, revoked)
    }
}

impl Grant {
    /// The policy it grants.
    ///
    /// Errors: a reason, as a sentence.
    pub fn policy(&self) -> Result<Policy, String> {
        if self.session.is_empty() || self.session.len() > 128 {
            return Err("session id of 1-128 bytes expected".into());
        }
        if self.hosts.len() > MAX_HOSTS || self.ports.len() > MAX_PORTS {
            return Err(format!("at most {MAX_HOSTS} hosts and {MAX_PORTS} ports"));
        }
        if self.max_connections == 0 || self.max_connections > 4096 {
            return Err("max_connections of 1-4096 expected".into());
        }
        Ok(Policy {
            session: self.session.clone(),
            hosts: Allowlist::parse(&self.hosts).map_err(|e| e.to_string())?,
            ports: self.ports.clone(),
            max_bytes: self.max_bytes,
            max_connections: self.max_connections,
            max_total_connections: self.max_total_connections,
            max_seconds: self.max_seconds.max(1),
        })
    }
}

/// The control server's settings.
#[derive(Debug)]
pub struct Server {
    /// Name resolution of every session.
    pub resolver: Arc<Resolver>,
    /// The only peer uid accepted.
    pub allowed_uid: u32,
    /// Sessions served at once.
    pub sessions: Arc<Semaphore>,
    /// Counters of the sessions granted lately, which a new grant of the same id goes on
    /// from.
    pub remembered: Remembered,
}

/// Accepts control connections until the listener fails.
pub async fn run(listener: UnixListener, server: Arc<Server>) -> io::Result<()> {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "control accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let server = server.clone();
        tokio::spawn(async move {
            if let Err(e) = session(stream, &server).await {
                tracing::warn!(error = %e, "control connection");
            }
        });
    }
}

async fn answer(stream: &mut UnixStream, line: &serde_json::Value) -> io::Result<()> {
    let mut s = line.to_string();
    s.push('\n');
    stream.write_all(s.as_bytes()).await
}

/// One session's control connection: grant, serve, revoke.
async fn session(mut stream: UnixStream, server: &Server) -> io::Result<()> {
    let cred = stream.peer_cred()?;
    if cred.uid() != server.allowed_uid {
        answer(
            &mut stream,
            &serde_json::json!({"error": "peer not allowed"}),
        )
        .await?;
        return Ok(());
    }
    let (line, fd) = match receive_grant(&stream).await {
        Ok(got) => got,
        Err(e) => {
            answer(&mut stream, &serde_json::json!({"error": e.to_string()})).await?;
            return Ok(());
        }
    };
    let started = (|| {
        let grant: Grant = serde_json::from_slice(&line).map_err(|e| format!("grant: {e}"))?;
        let policy = grant.policy()?;
        let fd = fd.ok_or("no listener descriptor attached")?;
        let listener = listener_from(fd)?;
        Ok::<_, String>((policy, listener, grant.used))
    })();
    let (policy, listener, used) = match started {
        Ok(s) => s,
        Err(e) => {
            answer(&mut stream, &serde_json::json!({"error": e})).await?;
            return Ok(());
        }
    };
    let Ok(_slot) = server.sessions.clone().try_acquire_owned() else {
        answer(
            &mut stream,
            &serde_json::json!({"error": "too many sessions"}),
        )
        .await?;
        return Ok(());
    };
    let id = policy.session.clone();
    let s = Arc::new(Session::new(policy));
    let Some(known) = server.remembered.granted(&s) else {
        answer(
            &mut stream,
            &serde_json::json!({"error": "the session already has a live grant"}),
        )
        .await?;
        return Ok(());
    };
    let before = known.max(used.bounded());
    s.counters.start_from(before);
    let (tx, rx) = watch::channel(false);
    let served = tokio::spawn(proxy::serve(
        listener,
        s.clone(),
        server.resolver.clone(),
        rx,
    ));
    answer(&mut stream, &serde_json::json!({"ok": true})).await?;
    tracing::info!(session = ?id, bytes_before = before.bytes, connections_before = before.connections, "egress granted");
    // `counters`: answered, the session goes on. Any other line, or the end: revoke.
    let asked = loop {
        let mut buf = Vec::new();
        let read = {
            let mut reader = BufReader::new(&mut stream);
            let mut limited = tokio::io::AsyncReadExt::take(&mut reader, 64);
            limited.read_until(b'\n', &mut buf).await
        };
        match read {
            Ok(n) if n > 0 && buf.trim_ascii() == b"counters" => {
                if answer(&mut stream, &counters_of(&s)).await.is_err() {
                    break false;
                }
            }
            Ok(n) => break n > 0,
            Err(_) => break false,
        }
    };
    let _ = tx.send(true);
    let _ = served.await;
    server.remembered.revoked(&s);
    let counters = counters_of(&s);
    tracing::info!(session = ?id, %counters, "egress revoked");
    if asked {
        answer(&mut stream, &counters).await?;
    }
    Ok(())
}

/// The session's counters as the control line answers them.
fn counters_of(s: &Session) -> serde_json::Value {
    let c = &s.counters;
    serde_json::json!({
        "allowed": c.allowed.load(Ordering::Relaxed),
        "refused": c.refused.load(Ordering::Relaxed),
        "bytes": c.bytes.load(Ordering::Relaxed),
        "connections": c.connections.load(Ordering::Relaxed),
    })
}

/// Reads the grant line (through its newline, at most [`MAX_LINE`] bytes) and the descriptor
/// sent with it. More than one descriptor is refused (all are closed).
async fn receive_grant(stream: &UnixStream) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut line = Vec::new();
    let mut fd: Option<OwnedFd> = None;
    loop {
        let mut buf = [0u8; 4096];
        let (n, fds) = stream
            .async_io(Interest::READABLE, || {
                recv_once(stream.as_raw_fd(), &mut buf)
            })
            .await?;
        let extra = fds.len() > 1 || (fd.is_some() && !fds.is_empty());
        let mut fds = fds.into_iter();
        if fd.is_none() {
            fd = fds.next();
        }
        if extra {
            return Err(io::Error::other("one listener descriptor expected"));
        }
        if n == 0 {
            return Err(io::Error::other("connection closed before the grant line"));
        }
        if let Some(i) = buf[..n].iter().position(|b| *b == b'\n') {
            if i + 1 != n {
                return Err(io::Error::other("nothing may follow the grant line"));
            }
            line.extend_from_slice(&buf[..i]);
            return Ok((line, fd));
        }
        line.extend_from_slice(&buf[..n]);
        if line.len() >= MAX_LINE {
            return Err(io::Error::other(format!(
                "grant line longer than {MAX_LINE} bytes"
            )));
        }
    }
}

/// One `recvmsg`: bytes read and the descriptors received (owned, close-on-exec).
fn recv_once(raw: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = [IoSliceMut::new(buf)];
    // Room for as many descriptors as one message can carry (SCM_MAX_FD, 253, unix(7)): a
    // truncated control message would leave the descriptors that did arrive unowned, and
    // so open for good; every one is owned here and closed with the refusal.
    let mut space = nix::cmsg_space!([RawFd; 253]);
    let msg = recvmsg::<()>(raw, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    let truncated = msg.cmsgs().is_err();
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(v) = c {
                // SAFETY: SCM_RIGHTS gave this process these new descriptors; nothing else
                // owns them.
                fds.extend(v.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
            }
        }
    }
    if truncated {
        return Err(io::Error::other("too many descriptors attached"));
    }
    Ok((msg.bytes, fds))
}

/// The received descriptor as a listener, if it is a listening TCP socket.
fn listener_from(fd: OwnedFd) -> Result<tokio::net::TcpListener, String> {
    let listening = getsockopt(&fd, sockopt::AcceptConn).map_err(|e| format!("descriptor: {e}"))?;
    let ty = getsockopt(&fd, sockopt::SockType).map_err(|e| format!("descriptor: {e}"))?;
    if !listening || ty != SockType::Stream {
        return Err("the descriptor is not a listening stream socket".into());
    }
    let std = std::net::TcpListener::from(fd);
    let local = std.local_addr().map_err(|e| format!("descriptor: {e}"))?;
    if !local.ip().is_loopback() {
        return Err(format!("the listener is bound on {local}, not loopback"));
    }
    std.set_nonblocking(true).map_err(|e| e.to_string())?;
    tokio::net::TcpListener::from_std(std).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_bounded() {
        let g = Grant {
            session: "s1".into(),
            hosts: vec!["pypi.org".into()],
            ports: vec![443],
            max_bytes: 1,
            max_connections: 1,
            max_total_connections: 1,
            max_seconds: 1,
            used: Used::default(),
        };
        assert!(g.policy().is_ok());
        let many = Grant {
            hosts: vec!["a.org".into(); MAX_HOSTS + 1],
            ..g.clone()
        };
        assert!(many.policy().is_err());
        let bad = Grant {
            hosts: vec!["*.org".into()],
            ..g.clone()
        };
        assert!(bad.policy().unwrap_err().contains("wildcard"));
        let none = Grant {
            max_connections: 0,
            ..g.clone()
        };
        assert!(none.policy().is_err());
        assert!(serde_json::from_str::<Grant>(r#"{"session":"s","hosts":[],"ports":[],"max_bytes":1,"max_connections":1,"max_total_connections":1,"max_seconds":1,"x":1}"#).is_err());
        // Nothing used: the field is left out, as a proxy before it expects.
        assert!(!serde_json::to_string(&g).unwrap().contains("used"));
    }

    fn session(id: &str) -> Arc<Session> {
        let g = Grant {
            session: id.into(),
            hosts: vec![],
            ports: vec![80],
            max_bytes: 1,
            max_connections: 1,
            max_total_connections: 1,
            max_seconds: 1,
            used: Used::default(),
        };
        Arc::new(Session::new(g.policy().unwrap()))
    }

    #[test]
    fn revoked_counters_are_kept_for_the_same_id_and_bounded() {
        let r = Remembered::default();
        let a = session("a");
        assert!(r.granted(&a).unwrap().is_zero());
        // A second grant of a live id is refused.
        assert_eq!(r.granted(&session("a")), None);
        a.counters.bytes.store(7, Ordering::Relaxed);
        r.revoked(&a);
        // Only the counters are kept: the session (policy, logged refusals) is let go.
        assert_eq!(Arc::strong_count(&a), 1);
        let again = session("a");
        assert_eq!(r.granted(&again).unwrap().bytes, 7);
        // The earlier session's late revocation does not mark the new one revoked.
        r.revoked(&a);
        assert_eq!(r.len(), (1, 0));
        for i in 0..MAX_REMEMBERED + 10 {
            let s = session(&format!("s{i}"));
            r.granted(&s);
            r.revoked(&s);
        }
        let (live, revoked) = r.len();
        assert_eq!(live, 1);
        assert!(revoked <= MAX_REMEMBERED, "{revoked}");
        // The oldest went first.
        assert!(r.granted(&session("s0")).unwrap().is_zero());
        assert_eq!(
            Used {
                connections: u64::MAX,
                ..Used::default()
            }
            .bounded()
            .connections,
            1 << 62
        );
    }
}
