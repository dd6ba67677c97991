//! The daemon's side of a worker's egress: once a worker of an environment with egress is
//! ready, [`open`] makes the proxy listener inside its network namespace ([`listener_in`])
//! and grants it to `sandcell-egress` over the control socket ([`grant`]); the worker holds
//! the grant for its life.
//!
//! The daemon never connects anywhere itself: it only creates a listening socket in the
//! worker's namespace and hands it over with `SCM_RIGHTS` (unix(7)). The grant lasts while the
//! returned control connection is open; dropping it (at Close) revokes the session's egress.

use std::io::{self, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The proxy's port inside every egress worker's network namespace (each namespace is the
/// worker's own, so one fixed port never collides, and a warm worker's environment can name
/// it before its session is known: `HTTP_PROXY=http://127.0.0.1:3128`).
pub const PROXY_PORT: u16 = 3128;

/// Where `sandcell-egress.socket` listens.
pub const CONTROL_SOCKET: &str = "/run/sandcell-egress/control";

/// Longest the proxy may take to answer a grant.
pub const GRANT_TIMEOUT: Duration = Duration::from_secs(5);

/// A listening TCP socket on `127.0.0.1:`[`PROXY_PORT`] inside the network namespace of
/// process `pid`, with that namespace's loopback brought up (a new namespace's `lo` is down,
/// and connecting to 127.0.0.1 then fails with `ENETUNREACH`).
///
/// The work happens on a short-lived thread that enters the namespace (setns(2) moves only
/// the calling thread) and ends there. `SIOCSIFFLAGS` goes through an `AF_UNIX` socket
/// (netdevice(7): any socket serves), so only the listener itself is an `AF_INET` socket.
/// Needs `CAP_SYS_ADMIN` (setns) and `CAP_NET_ADMIN` over the namespace.
///
/// Errors: the namespace cannot be opened or entered, `lo` cannot be brought up, the port
/// cannot be bound.
pub fn listener_in(pid: i32) -> io::Result<OwnedFd> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<OwnedFd> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(io::Error::from)?;
            loopback_up()?;
            let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, PROXY_PORT))?;
            Ok(OwnedFd::from(l))
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

/// Brings `lo` of the calling thread's network namespace up.
fn loopback_up() -> io::Result<()> {
    let sock = std::os::unix::net::UnixDatagram::unbound()?;
    // SAFETY: an all-zero ifreq is a valid value (a name of NULs, a zero union).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS and SIOCSIFFLAGS read and write this ifreq, which lives across
    // both calls; the descriptor is open.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Hands `listener` with `grant` to the proxy at `control` and waits for its answer. The
/// session's egress lasts while the returned connection is open.
///
/// Errors: the proxy cannot be reached, or refuses (its reason in the message).
pub fn grant(
    control: &Path,
    listener: &OwnedFd,
    grant: &sandcell_egress::control::Grant,
) -> io::Result<UnixStream> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let ctl = UnixStream::connect(control)?;
    ctl.set_read_timeout(Some(GRANT_TIMEOUT))?;
    ctl.set_write_timeout(Some(GRANT_TIMEOUT))?;
    let mut line = serde_json::to_vec(grant).map_err(io::Error::other)?;
    line.push(b'\n');
    let fds = [listener.as_raw_fd()];
    let sent = sendmsg::<()>(
        ctl.as_raw_fd(),
        &[io::IoSlice::new(&line)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)?;
    (&ctl).write_all(&line[sent..])?;
    let mut answer = Vec::new();
    let mut b = [0u8; 1];
    while answer.len() < 4096 {
        if (&ctl).read(&mut b)? == 0 || b[0] == b'\n' {
            break;
        }
        answer.push(b[0]);
    }
    let v: serde_json::Value = serde_json::from_slice(&answer)
        .map_err(|_| io::Error::other("the egress proxy answered no JSON line"))?;
    if v["ok"] == true {
        ctl.set_read_timeout(None)?;
        return Ok(ctl);
    }
    Err(io::Error::other(format!(
        "the egress proxy refused the grant: {}",
        v["error"].as_str().unwrap_or("no reason")
    )))
}

/// The proxy's control socket: `SANDCELL_EGRESS_CONTROL` when set (tests), else
/// [`CONTROL_SOCKET`].
pub fn control_socket() -> std::path::PathBuf {
    std::env::var_os("SANDCELL_EGRESS_CONTROL")
        .map(Into::into)
        .unwrap_or_else(|| CONTROL_SOCKET.into())
}

/// Gives the worker `pid` (confined and ready, in its own network namespace) its egress under
/// `policy`: the listener in its namespace, granted to the proxy, the grant held by a task
/// until the process exits (its pidfd turns readable, pidfd_open(2)), which revokes it. A
/// failure (the proxy is not running, the daemon lacks `CAP_NET_ADMIN`) is logged as a
/// warning with the reason, and the worker then reaches nothing (its connects fail with
/// `ENETUNREACH`).
pub async fn open(id: &str, pid: u32, policy: &crate::config::EgressConfig) {
    // Opened first, while the worker is certainly alive: the pidfd names this process even
    // if its pid is reused later.
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        let reason = io::Error::last_os_error();
        tracing::warn!(session = %id, %reason, "egress not granted (pidfd_open): the session has no network");
        return;
    }
    // SAFETY: the descriptor was just returned to this process and is owned here only.
    let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) };
    let Some(ctl) = granted(id, pid, policy).await else {
        return;
    };
    // SAFETY: `pidfd` is an open descriptor owned by the AsyncFd from here on: it stays open,
    // naming the worker's pidfd, until the AsyncFd is dropped.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    };
    let Ok(exit) = registered else {
        return;
    };
    tokio::spawn(async move {
        let _ = exit.readable().await;
        drop(ctl);
    });
}

async fn granted(id: &str, pid: u32, policy: &crate::config::EgressConfig) -> Option<UnixStream> {
    let g = sandcell_egress::control::Grant {
        session: id.to_string(),
        hosts: policy.hosts.clone(),
        ports: policy.ports.clone(),
        max_bytes: policy.max_bytes,
        max_connections: policy.max_connections,
        max_total_connections: policy.max_total_connections,
        max_seconds: policy.max_seconds,
    };
    let control = control_socket();
    let done = tokio::task::spawn_blocking(move || -> io::Result<UnixStream> {
        let fd = listener_in(pid as i32)?;
        grant(&control, &fd, &g)
    })
    .await
    .unwrap_or_else(|e| Err(io::Error::other(e.to_string())));
    match done {
        Ok(ctl) => Some(ctl),
        Err(e) => {
            tracing::warn!(session = %id, reason = %e, "egress not granted: the session has no network");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A worker stand-in in its own network namespace; the daemon's two steps give it a
    /// listener served by a real proxy (in process, over a real control socket), and a
    /// request made from inside that namespace gets the proxy's answer.
    #[test]
    fn a_listener_in_a_workers_namespace_is_served_by_the_proxy() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            sandcell_testing::skip!(
                "root",
                "not root (setns and CAP_NET_ADMIN over the namespace)"
            );
        }
        if Command::new("unshare").arg("--version").output().is_err()
            || Command::new("nsenter").arg("--version").output().is_err()
        {
            sandcell_testing::skip!("root", "util-linux's unshare or nsenter is missing");
        }
        let mut worker = Command::new("unshare")
            .args(["-n", "sleep", "60"])
            .spawn()
            .unwrap();
        let pid = worker.id() as i32;
        // unshare execs sleep once the namespace exists.
        let own = std::fs::read_link("/proc/self/ns/net").unwrap();
        let t0 = std::time::Instant::now();
        while std::fs::read_link(format!("/proc/{pid}/ns/net"))
            .ok()
            .as_ref()
            == Some(&own)
        {
            assert!(t0.elapsed() < Duration::from_secs(5), "no new namespace");
            std::thread::sleep(Duration::from_millis(10));
        }

        let dir = std::env::temp_dir().join(format!("sc-egress-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let control = dir.join("control");
        let _ = std::fs::remove_file(&control);
        let std_listener = std::os::unix::net::UnixListener::bind(&control).unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let server = std::sync::Arc::new(sandcell_egress::control::Server {
            resolver: std::sync::Arc::new(sandcell_egress::proxy::Resolver::parse_hosts(
                "127.0.0.1 inward.test\n",
                true,
            )),
            allowed_uid: 0,
            sessions: std::sync::Arc::new(tokio::sync::Semaphore::new(4)),
        });
        rt.spawn(async move {
            let l = tokio::net::UnixListener::from_std(std_listener).unwrap();
            let _ = sandcell_egress::control::run(l, server).await;
        });

        let fd = listener_in(pid).expect("listener in the worker's namespace");
        let g = sandcell_egress::control::Grant {
            session: "unit".into(),
            hosts: vec!["inward.test".into()],
            ports: vec![80],
            max_bytes: 1 << 20,
            max_connections: 4,
            max_total_connections: 100,
            max_seconds: 10,
        };
        let ctl = grant(&control, &fd, &g).expect("granted");
        drop(fd);
        let ask = |req: &str| {
            let o = Command::new("nsenter")
                .args(["-t", &pid.to_string(), "-n", "/usr/bin/python3", "-c"])
                .arg(
                    "import socket,sys\n\
                     c=socket.create_connection(('127.0.0.1',3128),timeout=10)\n\
                     c.sendall(sys.argv[1].encode())\n\
                     b=b''\n\
                     while True:\n\
                     \x20   d=c.recv(4096)\n\
                     \x20   if not d: break\n\
                     \x20   b+=d\n\
                     sys.stdout.write(b.decode())",
                )
                .arg(req)
                .stderr(Stdio::piped())
                .output()
                .unwrap();
            (
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            )
        };
        let (out, err) = ask("GET http://elsewhere.test/ HTTP/1.1\r\n\r\n");
        assert!(
            out.ends_with("sandcell egress: host not allowed: elsewhere.test\n"),
            "{out}{err}"
        );
        let (out, err) = ask("GET http://inward.test/ HTTP/1.1\r\n\r\n");
        assert!(
            out.contains("inward.test resolves to a loopback address"),
            "{out}{err}"
        );
        // Revocation: the end of the control connection closes the listener.
        drop(ctl);
        std::thread::sleep(Duration::from_millis(300));
        let (out, err) = ask("GET http://elsewhere.test/ HTTP/1.1\r\n\r\n");
        assert!(
            out.is_empty() && err.contains("ConnectionRefused"),
            "{out}{err}"
        );
        let _ = worker.kill();
        let _ = worker.wait();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
