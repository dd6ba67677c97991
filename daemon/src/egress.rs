//! The daemon's side of a worker's egress: before a worker of an environment with egress is
//! forked, [`prepare_namespace`] makes its network namespace (loopback up, the proxy listener
//! bound in it), which the child joins before exec; when its session starts, [`open`] grants
//! the listener to `sandcell-egress` over the control socket ([`grant`]) with the session's
//! list; the worker holds the grant for its life, and the daemon asks the proxy for the
//! session's counters every [`COUNTERS_EVERY`] ([`counts`], [`totals`]: the metrics file).
//! Whether the service's sandbox allows any of it is probed once ([`availability`]).
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

/// How often the daemon asks the proxy for a granted session's counters.
pub const COUNTERS_EVERY: Duration = Duration::from_secs(2);

/// One session's egress counters, as the proxy answers the control line `counters`
/// (sandcell-egress's control protocol).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct Counts {
    /// Requests the proxy served (a CONNECT tunnel or a plain HTTP request).
    pub allowed: u64,
    /// Requests refused (each an HTTP 403 or 405/400 with its reason).
    pub refused: u64,
    /// Bytes relayed, both directions.
    pub bytes: u64,
    /// Connections the proxy accepted from the session.
    pub connections: u64,
}

impl Counts {
    /// What was counted since `earlier`, counter by counter (never below zero).
    pub fn since(self, earlier: Counts) -> Counts {
        Counts {
            allowed: self.allowed.saturating_sub(earlier.allowed),
            refused: self.refused.saturating_sub(earlier.refused),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            connections: self.connections.saturating_sub(earlier.connections),
        }
    }
}

impl Counts {
    /// The larger of `self` and `o`, counter by counter.
    pub fn max(self, o: Counts) -> Counts {
        Counts {
            allowed: self.allowed.max(o.allowed),
            refused: self.refused.max(o.refused),
            bytes: self.bytes.max(o.bytes),
            connections: self.connections.max(o.connections),
        }
    }
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.allowed += o.allowed;
        self.refused += o.refused;
        self.bytes += o.bytes;
        self.connections += o.connections;
    }
}

/// Granted sessions' last counters, and the sum over sessions whose grant ended.
#[derive(Default)]
struct Ledger {
    live: std::collections::HashMap<String, Counts>,
    ended: Counts,
}

fn ledger() -> std::sync::MutexGuard<'static, Ledger> {
    static L: std::sync::OnceLock<std::sync::Mutex<Ledger>> = std::sync::OnceLock::new();
    L.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The counters of session `id` while its egress is granted, as last asked (at most
/// [`COUNTERS_EVERY`] old); `None`: no grant (none yet, ended, or no egress).
pub fn counts(id: &str) -> Option<Counts> {
    ledger().live.get(id).copied()
}

/// Counters summed over every session granted since start: the ended ones' final figures
/// and the live ones' latest. Never decreases.
pub fn totals() -> Counts {
    let l = ledger();
    let mut t = l.ended;
    for c in l.live.values() {
        t += *c;
    }
    t
}

/// Where the packages install the drop-ins that give the shipped units what egress needs
/// (`units/egress/` in the source tree): `sandcelld.service.conf` (`RestrictAddressFamilies=`
/// `AF_INET AF_INET6`, `CAP_NET_ADMIN` in the bounding set, `IPAddressAllow=localhost`) and
/// `sandcell-sessions.service.conf` (`IPAddressAllow=localhost`). Inactive until the operator
/// links them into `/etc/systemd/system/<unit>.d/` (sandcelld(8), EGRESS).
pub const DROP_IN_DIR: &str = "/usr/share/sandcell/egress";

/// How the operator turns egress on under the shipped units, as the refusal and `--check`
/// say it.
pub fn enable_hint() -> String {
    format!(
        "link the drop-ins {DROP_IN_DIR}/sandcelld.service.conf and \
         {DROP_IN_DIR}/sandcell-sessions.service.conf into \
         /etc/systemd/system/sandcelld.service.d/ and \
         /etc/systemd/system/sandcell-sessions.service.d/, then systemctl daemon-reload and \
         systemctl restart sandcelld.service (sandcelld(8), EGRESS)"
    )
}

/// Why egress cannot be given here ([`availability`]).
#[derive(Debug, Clone)]
pub struct Unavailable {
    /// What is missing and the drop-in that adds it, at most 128 bytes (an error reply's
    /// strings are cut there), e.g. `the service lacks CAP_NET_ADMIN AF_INET: link
    /// /usr/share/sandcell/egress/sandcelld.service.conf`. `EgressUnavailable`'s reason.
    pub reason: String,
    /// Each failed step with its OS error, and how to link the drop-ins (the log,
    /// `sandcelld --check`, the `Confinement` property).
    pub detail: String,
}

/// Whether this process can give workers egress, probed once (the first call) and kept.
///
/// The probe does in a throw-away network namespace (a short-lived thread unshares one:
/// unshare(2) with `CLONE_NEWNET` moves only the calling thread) what [`prepare_namespace`] and an
/// egress worker do: brings `lo` up (`CAP_NET_ADMIN`), binds an `AF_INET` listener on
/// 127.0.0.1 (`RestrictAddressFamilies=`) and connects to it (a cgroup's `IPAddressDeny=`
/// drops loopback packets; systemd.resource-control(5)). Under systemd (sd_booted(3), with the
/// session groups in `sandcell-sessions.service`) it also asks systemd for that unit's
/// `IPAddressAllow=` (`systemctl show`), since the workers' traffic passes that unit's filter,
/// which this process cannot try from its own cgroup.
pub fn availability() -> &'static Result<(), Unavailable> {
    static PROBED: std::sync::OnceLock<Result<(), Unavailable>> = std::sync::OnceLock::new();
    PROBED.get_or_init(|| {
        let (lacks, detail) = match probe_here() {
            Ok(()) => match sessions_unit_allows_loopback() {
                Ok(()) => return Ok(()),
                Err(d) => {
                    let unit = crate::cgroup::v2::SESSIONS_UNIT;
                    return Err(Unavailable {
                        reason: format!("{unit} drops loopback: link {DROP_IN_DIR}/{unit}.conf"),
                        detail: format!("egress is unavailable: {d}; {}", enable_hint()),
                    });
                }
            },
            Err(e) => e,
        };
        Err(Unavailable {
            reason: format!(
                "the service lacks {}: link {DROP_IN_DIR}/sandcelld.service.conf",
                lacks.join(" ")
            ),
            detail: format!(
                "egress is unavailable under this service's sandbox: {detail}; {}",
                enable_hint()
            ),
        })
    })
}

/// How long the probe's loopback connection may take before it counts as dropped.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The probe of [`availability`] in this process: `Err((what is lacking, in short; each
/// failed step with its OS error))`.
fn probe_here() -> Result<(), (Vec<&'static str>, String)> {
    std::thread::scope(|s| {
        s.spawn(|| -> Result<(), (Vec<&'static str>, String)> {
            if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                return Err((
                    vec!["CLONE_NEWNET"],
                    format!("no network namespace for the probe ({e})"),
                ));
            }
            let mut lacks = Vec::new();
            let mut detail = Vec::new();
            let up = loopback_up().map_err(|e| {
                lacks.push("CAP_NET_ADMIN");
                detail.push(format!(
                    "cannot bring a worker namespace's loopback up ({e}; needs CAP_NET_ADMIN \
                     in CapabilityBoundingSet=)"
                ));
            });
            let bound = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| {
                lacks.push("AF_INET");
                detail.push(format!(
                    "no AF_INET socket ({e}; needs AF_INET AF_INET6 in RestrictAddressFamilies=)"
                ));
            });
            if let (Ok(()), Ok(l)) = (up, bound) {
                let connected = l.local_addr().and_then(|to| {
                    std::net::TcpStream::connect_timeout(&to, PROBE_TIMEOUT).map(drop)
                });
                if let Err(e) = connected {
                    lacks.push("IPAddressAllow=localhost");
                    detail.push(format!(
                        "loopback traffic is dropped ({e}; needs IPAddressAllow=localhost \
                         beside IPAddressDeny=)"
                    ));
                }
            }
            if !lacks.is_empty() {
                return Err((lacks, detail.join("; ")));
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err((vec!["a probe"], "the probe thread panicked".into())))
    })
}

/// `systemctl show --property <prop> --value <unit>`: `None` where systemd does not run
/// (sd_booted(3): no /run/systemd/system), `systemctl` is missing or fails.
fn systemctl_show(unit: &str, prop: &str) -> Option<String> {
    if !Path::new("/run/systemd/system").exists() {
        return None;
    }
    let o = std::process::Command::new("systemctl")
        .args(["show", "--property", prop, "--value", unit])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// Whether `unit`, loaded in systemd, drops loopback traffic: `IPAddressDeny=` set and
/// `IPAddressAllow=` without a loopback address. `Ok` where systemd or the unit is absent.
fn unit_allows_loopback(unit: &str) -> Result<(), String> {
    if systemctl_show(unit, "LoadState").as_deref() != Some("loaded") {
        return Ok(());
    }
    let deny = systemctl_show(unit, "IPAddressDeny").unwrap_or_default();
    let allow = systemctl_show(unit, "IPAddressAllow").unwrap_or_default();
    if deny.is_empty()
        || allow
            .split_whitespace()
            .any(|a| a.starts_with("127.") || a == "::1/128")
    {
        return Ok(());
    }
    Err(format!(
        "{unit} drops the workers' loopback traffic (IPAddressDeny={deny}, \
         IPAddressAllow={allow}; needs IPAddressAllow=localhost)"
    ))
}

/// Under systemd with the session groups' unit loaded: whether its `IPAddressAllow=` admits
/// loopback (the workers' traffic passes that unit's filter, which the daemon cannot try from
/// its own cgroup).
fn sessions_unit_allows_loopback() -> Result<(), String> {
    unit_allows_loopback(crate::cgroup::v2::SESSIONS_UNIT)
}

/// What systemd says of the shipped units, for `sandcelld --check` run outside them:
/// `sandcelld.service` has `AF_INET` in `RestrictAddressFamilies=`, `CAP_NET_ADMIN` in its
/// bounding set and loopback allowed, and `sandcell-sessions.service` loopback allowed. `Ok`
/// where systemd does not run or the units are not loaded; `Err(reason)` naming what is
/// missing and the drop-ins ([`enable_hint`]).
pub fn units_allow() -> Result<(), String> {
    let unit = "sandcelld.service";
    let mut missing = Vec::new();
    if systemctl_show(unit, "LoadState").as_deref() == Some("loaded") {
        let families = systemctl_show(unit, "RestrictAddressFamilies").unwrap_or_default();
        if !families.is_empty()
            && !families.starts_with('~')
            && !families.split_whitespace().any(|f| f == "AF_INET")
        {
            missing.push(format!(
                "{unit} has RestrictAddressFamilies={families} (needs AF_INET AF_INET6)"
            ));
        }
        let caps = systemctl_show(unit, "CapabilityBoundingSet").unwrap_or_default();
        if !caps
            .split_whitespace()
            .any(|c| c.eq_ignore_ascii_case("cap_net_admin"))
        {
            missing.push(format!(
                "{unit} has no CAP_NET_ADMIN in CapabilityBoundingSet="
            ));
        }
        if let Err(e) = unit_allows_loopback(unit) {
            missing.push(e);
        }
    }
    if let Err(e) = sessions_unit_allows_loopback() {
        missing.push(e);
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "egress is unavailable under the installed units: {}; {}",
            missing.join("; "),
            enable_hint()
        ))
    }
}

/// An egress worker's network namespace, made before the worker exists.
pub struct PreparedNamespace {
    /// The namespace (`/proc/thread-self/ns/net` of the thread that made it): the worker
    /// joins it with setns(2) between fork and exec; dropped once it has.
    pub namespace: OwnedFd,
    /// A listening TCP socket on `127.0.0.1:`[`PROXY_PORT`] inside it, granted to the proxy
    /// once the worker is ready ([`open`]).
    pub listener: OwnedFd,
}

/// A fresh network namespace with its loopback up (a new namespace's `lo` is down, and
/// connecting to 127.0.0.1 then fails with `ENETUNREACH`) and the proxy listener bound in it.
///
/// The work happens on a short-lived thread that unshares a network namespace (unshare(2)
/// with `CLONE_NEWNET` moves only the calling thread) and ends there; the namespace lives on
/// through the returned descriptors. Made by the daemon rather than entered later: entering
/// a worker's namespace through `/proc/<pid>/ns/net` or its pidfd needs ptrace access to the
/// worker (`CAP_SYS_PTRACE` once it runs as its session uid, ptrace(2) "Ptrace access mode
/// checking"), which the daemon's unit does not have. `SIOCSIFFLAGS` goes through an
/// `AF_UNIX` socket (netdevice(7): any socket serves), so only the listener itself is an
/// `AF_INET` socket. Needs `CAP_SYS_ADMIN` (unshare) and `CAP_NET_ADMIN` over the namespace.
///
/// Errors: the namespace cannot be made, `lo` cannot be brought up, the port cannot be
/// bound.
pub fn prepare_namespace() -> io::Result<PreparedNamespace> {
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<PreparedNamespace> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            loopback_up()?;
            let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, PROXY_PORT))?;
            let ns = std::fs::File::open("/proc/thread-self/ns/net")?;
            Ok(PreparedNamespace {
                namespace: OwnedFd::from(ns),
                listener: OwnedFd::from(l),
            })
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

/// Gives the worker `pid` (confined and ready, in the namespace [`prepare_namespace`] made)
/// its egress under `policy`: `listener` (bound in its namespace) granted to the proxy, the
/// grant held by a task until the process exits (its pidfd turns readable, pidfd_open(2)),
/// which revokes it. A failure (the proxy is not running) is logged as a warning with the
/// reason, and the worker then reaches nothing (its connects are refused). `used`: what the
/// session used under earlier grants (an adopted session's record keeps the counters last
/// read), from which its budgets and counters go on. `keep`: the directory of session
/// records when the session outlives the daemon, where each read that changed the counters is
/// written ([`crate::records::write_egress`]) and removed when the worker exits.
pub async fn open(
    id: &str,
    pid: u32,
    listener: OwnedFd,
    policy: &crate::config::EgressConfig,
    used: Counts,
    keep: Option<std::path::PathBuf>,
) {
    // Refused at Open with the reason (EgressUnavailable); a warm worker started meanwhile
    // gets nothing, and the log says why once, at start.
    if availability().is_err() {
        return;
    }
    // Opened first, while the worker is certainly alive: the pidfd names this process even
    // if its pid is reused later.
    let pidfd = match crate::sys::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(reason) => {
            tracing::warn!(session = %id, %reason, "egress not granted (pidfd_open): the session has no network");
            return;
        }
    };
    // A duplicate, to grant again when the proxy restarts (its grants end with it).
    let again = listener.try_clone().ok();
    let first = granted(id, listener, policy, used, false).await;
    // SAFETY: `pidfd` is an open descriptor owned by the AsyncFd from here on: it stays open,
    // naming the worker's pidfd, until the AsyncFd is dropped.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    };
    let Ok(exit) = registered else {
        return;
    };
    let id = id.to_string();
    let policy = policy.clone();
    ledger().live.insert(id.clone(), used);
    tokio::spawn(async move {
        let mut last = used;
        let mut ctl = first;
        let mut wait = REGRANT_FIRST;
        loop {
            if let Some(c) = ctl.take() {
                match serve_grant(&id, c, &exit, &mut last, keep.as_deref()).await {
                    Served::WorkerGone => break,
                    Served::ProxyGone => {
                        tracing::warn!(session = %id, "the egress proxy stopped answering: the session's grant is asked again until it does");
                        wait = REGRANT_FIRST;
                    }
                }
            }
            // No grant: the proxy is not running (or refused). Asked again, from what the
            // session used, until it answers or the worker exits.
            let Some(l) = again.as_ref().and_then(|l| l.try_clone().ok()) else {
                break;
            };
            tokio::select! {
                _ = exit.readable() => break,
                () = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(REGRANT_MAX);
            ctl = granted(&id, l, &policy, last, true).await;
            if ctl.is_some() {
                tracing::info!(session = %id, bytes = last.bytes, connections = last.connections, "egress granted again");
            }
        }
        if let Some(dir) = &keep {
            let _ = std::fs::remove_file(crate::records::egress_path(dir, &id));
        }
        let mut l = ledger();
        l.live.remove(&id);
        // Only what this daemon saw relayed: the rest was counted by its predecessor.
        l.ended += last.since(used);
    });
}

/// How long a session without a grant waits before its first new request for one, then
/// doubling up to [`REGRANT_MAX`].
pub const REGRANT_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between two requests for a session's grant while the proxy is away.
pub const REGRANT_MAX: Duration = Duration::from_secs(10);

/// How [`serve_grant`] ended.
enum Served {
    /// The worker exited; the grant is revoked.
    WorkerGone,
    /// The proxy stopped answering (it exited or restarted); the grant is gone with it.
    ProxyGone,
}

/// Holds the grant on `ctl` for session `id`: asks its counters every [`COUNTERS_EVERY`]
/// into `last` and the ledger (and, when they changed, into `keep`'s counters file), until
/// the worker exits (`exit` turns readable: the grant is revoked) or the proxy stops
/// answering.
async fn serve_grant(
    id: &str,
    ctl: UnixStream,
    exit: &tokio::io::unix::AsyncFd<OwnedFd>,
    last: &mut Counts,
    keep: Option<&std::path::Path>,
) -> Served {
    let ctl = match ctl
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(ctl))
    {
        Ok(c) => c,
        Err(_) => return Served::ProxyGone,
    };
    let (rd, mut wr) = ctl.into_split();
    let mut rd = tokio::io::BufReader::new(rd);
    let mut tick = tokio::time::interval(COUNTERS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = exit.readable() => break,
            _ = tick.tick() => match ask(&mut rd, &mut wr, b"counters\n").await {
                Some(c) => {
                    if let Some(dir) = keep.filter(|_| c != *last)
                        && let Err(e) = crate::records::write_egress(dir, id, &c)
                    {
                        tracing::debug!(session = %id, error = %e, "writing the egress counters");
                    }
                    *last = c;
                    if let Some(l) = ledger().live.get_mut(id) {
                        *l = c;
                    }
                }
                None => return Served::ProxyGone,
            },
        }
    }
    // The worker is gone: revoke, keeping the final figures; the end of the connection
    // revokes in any case.
    if let Some(c) = ask(&mut rd, &mut wr, b"revoke\n").await {
        *last = c;
    }
    Served::WorkerGone
}

/// Sends one control `line` and reads the proxy's JSON answer (at most 4 KiB, within
/// [`GRANT_TIMEOUT`]); `None` when it does not come.
async fn ask(
    rd: &mut tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    line: &[u8],
) -> Option<Counts> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let go = async {
        wr.write_all(line).await.ok()?;
        let mut buf = Vec::new();
        let n = (&mut *rd)
            .take(4096)
            .read_until(b'\n', &mut buf)
            .await
            .ok()?;
        (n > 0).then_some(())?;
        serde_json::from_slice::<Counts>(&buf).ok()
    };
    tokio::time::timeout(GRANT_TIMEOUT, go).await.ok().flatten()
}

/// Grants `listener` to the proxy for session `id` under `policy`, going on from `used`; the
/// control connection, or `None` when the proxy cannot be reached or refuses. A failure is a
/// warning, or (`quiet`: a session asking again while the proxy is away) a debug line.
async fn granted(
    id: &str,
    listener: OwnedFd,
    policy: &crate::config::EgressConfig,
    used: Counts,
    quiet: bool,
) -> Option<UnixStream> {
    let g = grant_line(id, policy, used);
    let control = control_socket();
    let done = tokio::task::spawn_blocking(move || grant(&control, &listener, &g))
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e.to_string())));
    match done {
        Ok(ctl) => Some(ctl),
        Err(e) if quiet => {
            tracing::debug!(session = %id, reason = %e, "egress not granted yet");
            None
        }
        Err(e) => {
            tracing::warn!(session = %id, reason = %e, "egress not granted: asked again until the proxy answers; meanwhile the session's connections wait");
            None
        }
    }
}

/// The grant of session `id` under `policy`, going on from `used`.
fn grant_line(
    id: &str,
    policy: &crate::config::EgressConfig,
    used: Counts,
) -> sandcell_egress::control::Grant {
    sandcell_egress::control::Grant {
        session: id.to_string(),
        hosts: policy.hosts.clone(),
        ports: policy.ports.clone(),
        max_bytes: policy.max_bytes,
        max_connections: policy.max_connections,
        max_total_connections: policy.max_total_connections,
        max_seconds: policy.max_seconds,
        used: sandcell_egress::control::Used {
            allowed: used.allowed,
            refused: used.refused,
            bytes: used.bytes,
            connections: used.connections,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A namespace made by [`prepare_namespace`], its listener granted to a real proxy (in
    /// process, over a real control socket): a request made from inside that namespace (a
    /// process that joined it as a worker does, setns(2) between fork and exec) gets the
    /// proxy's answer.
    #[test]
    fn a_prepared_namespace_is_served_by_the_proxy() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            sandcell_testing::skip!(
                "root",
                "not root (unshare and CAP_NET_ADMIN over the namespace)"
            );
        }
        let prepared = prepare_namespace().expect("a namespace with its listener");
        let ns_raw = prepared.namespace.as_raw_fd();
        let own = std::fs::read_link("/proc/self/ns/net").unwrap();
        assert_ne!(
            std::fs::read_link(format!("/proc/self/fd/{ns_raw}")).unwrap(),
            own,
            "a namespace of its own"
        );

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
            remembered: Default::default(),
        });
        rt.spawn(async move {
            let l = tokio::net::UnixListener::from_std(std_listener).unwrap();
            let _ = sandcell_egress::control::run(l, server).await;
        });

        let fd = prepared.listener;
        let g = sandcell_egress::control::Grant {
            session: "unit".into(),
            hosts: vec!["inward.test".into()],
            ports: vec![80],
            max_bytes: 1 << 20,
            max_connections: 4,
            max_total_connections: 100,
            max_seconds: 10,
            used: Default::default(),
        };
        let ctl = grant(&control, &fd, &g).expect("granted");
        drop(fd);
        let ask = |req: &str| {
            let mut cmd = Command::new("/usr/bin/python3");
            // SAFETY: setns(2) only, between fork and exec.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setns(ns_raw, libc::CLONE_NEWNET) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let o = cmd
                .arg("-c")
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
        let _ = std::fs::remove_dir_all(&dir);
    }
}
