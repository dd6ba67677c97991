//! The polkit [`Authority`]: asks `org.freedesktop.PolicyKit1.Authority.CheckAuthorization`
//! on the system bus, for both interfaces (the Varlink data plane and the D-Bus control
//! plane go through the same `Core::authorize`, so this is the one decision path).
//!
//! Subjects (never a bare pid: a pid can be recycled between the connection and the check,
//! polkit CVE-2013-4288; and a caller that vanishes mid-check must be refused rather than
//! mistaken for someone else, polkit CVE-2021-3560):
//! - D-Bus callers: `system-bus-name` with the sender's unique name; polkit resolves the
//!   credentials from the bus itself. The call's `ALLOW_INTERACTIVE_AUTHORIZATION` header
//!   flag is passed on as polkit flag 1 (`AllowUserInteraction`).
//! - Varlink callers: `unix-process`. With polkit >= 124 (`BackendVersion`) the kernel's
//!   pidfd for the peer (`SO_PEERPIDFD`) is passed as `pidfd` (a D-Bus `h`) together with
//!   `uid`; otherwise `pid` + `start-time` (field 22 of `/proc/<pid>/stat`, read while the
//!   pidfd proved the pid was still the peer) + `uid`. Always non-interactive (flags 0):
//!   nobody can answer a password prompt for a gateway.
//!
//! Answers for Varlink callers are cached per connection (key: connection id, which is unique
//! for the daemon's lifetime, and action), at most [`CACHE_MAX`] entries; D-Bus calls are
//! never cached. The cache is emptied whenever the bus connection is replaced. A second check
//! of a connection and action while the first is being asked waits for the first's answer
//! instead of asking polkit again (each check costs polkitd a run of its rules; after a
//! restart every returning connection's first call arrives while its check is under way).
//!
//! A caller whose start time cannot be read (it exited, or its pid names another process
//! now) is refused before polkit is asked: polkit reads a start time of 0 as "whatever
//! process has this pid now". Without a pidfd, the daemon also checks, right before asking,
//! that `/proc/<pid>/status` still shows the peer's uid and gid (from `SO_PEERCRED`) and the
//! same start time, so a recycled pid of another user is never asked about.
//!
//! Calls in flight are bounded: at most [`IN_FLIGHT_MAX`] daemon-wide and
//! [`IN_FLIGHT_PER_UID`] for one caller uid; a check waits for a place, within its own
//! timeout. dbus-daemon answers `org.freedesktop.DBus.Error.LimitsExceeded` to a connection
//! with more pending method calls than its `max_replies_per_connection` limit (128 on a
//! system bus, dbus-daemon(1)); unbounded, one uid opening a few hundred connections made
//! every check fail and so got every other uid refused.
//!
//! When polkit cannot be asked (bus gone, polkitd not answering) the decision fails closed:
//! root is allowed (polkit would allow root too), everyone else is refused until polkit
//! answers. The daemon selects this authority at start-up whenever polkit is installed
//! ([`installed`]: polkitd or sandcell's action file is present), answering or not; only on
//! a host without polkit does it keep [`crate::auth::SocketPermissions`] (the socket's mode,
//! 0660, group `sandcell`, is then the only gate). Every refusal is logged with the caller's
//! uid, pid and the action.

use crate::auth::{Action, Authority};
use crate::identity::{Caller, PidFd, Subject};
use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use zbus::zvariant::{Fd, Value};

/// Most cached answers; the whole cache is dropped when it is full.
pub const CACHE_MAX: usize = 4096;
/// How long a non-interactive check may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an interactive check (a human typing a password) may take.
pub const INTERACTIVE_TIMEOUT: Duration = Duration::from_secs(300);
/// Most `CheckAuthorization` calls in flight at once, daemon-wide: well below dbus-daemon's
/// `max_replies_per_connection` (128 on a system bus, dbus-daemon(1)).
pub const IN_FLIGHT_MAX: usize = 32;
/// Most `CheckAuthorization` calls in flight for one caller uid, so that one uid's flood of
/// connections leaves the other places to the other uids.
pub const IN_FLIGHT_PER_UID: usize = 4;
/// First polkit version that accepts a `pidfd` in a `unix-process` subject.
pub const PIDFD_MIN_VERSION: u32 = 124;

/// polkit's `CheckAuthorizationFlags.AllowUserInteraction`.
const ALLOW_USER_INTERACTION: u32 = 1;
/// How long a check waits for the daemon's first system bus connection while it is being
/// made ([`Polkit::connecting`]): 6 seconds, the first connection's own bound
/// (`dbus::FIRST_CONNECT_TIMEOUT`, 5 s) and slack. Checks fail closed after it, as without a bus.
pub const FIRST_ATTACH_WAIT: Duration = Duration::from_secs(6);

/// Where polkitd lives on the distributions sandcell supports (Debian/Ubuntu, Fedora/RHEL,
/// openSUSE, Arch).
pub const POLKITD_PATHS: &[&str] = &[
    "/usr/lib/polkit-1/polkitd",
    "/usr/libexec/polkitd",
    "/usr/libexec/polkit-1/polkitd",
    "/usr/lib/polkit/polkitd",
];
/// sandcell's polkit action file, as the packages install it.
pub const ACTION_FILES: &[&str] = &[
    "/usr/share/polkit-1/actions/org.sandcell.policy",
    "/etc/polkit-1/actions/org.sandcell.policy",
];

/// The first file that shows polkit is installed for sandcell (its action file), if any.
pub fn action_file_installed() -> Option<&'static str> {
    ACTION_FILES
        .iter()
        .copied()
        .find(|p| std::path::Path::new(p).exists())
}

/// The first file that shows polkit is installed on this host (polkitd, or sandcell's action
/// file), if any. A host with a system bus where this is `Some` fails closed while polkit
/// does not answer.
pub fn installed() -> Option<&'static str> {
    POLKITD_PATHS
        .iter()
        .copied()
        .find(|p| std::path::Path::new(p).exists())
        .or_else(action_file_installed)
}

/// Errors asking polkit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The daemon has no system bus connection now.
    #[error("no system bus connection; polkit cannot be asked")]
    NoBus,
    /// The D-Bus call failed (polkitd absent, bus gone, malformed subject).
    #[error("calling polkit CheckAuthorization for {action}: {source}")]
    Call {
        /// polkit action id.
        action: &'static str,
        /// The D-Bus error.
        source: zbus::Error,
    },
    /// polkit did not answer in time.
    #[error("polkit did not answer CheckAuthorization for {action} within {after:?}")]
    Timeout {
        /// polkit action id.
        action: &'static str,
        /// How long we waited.
        after: Duration,
    },
    /// The caller's start time could not be read, or `/proc/<pid>` no longer shows the peer
    /// (another uid or gid, another start time): it is refused without asking polkit.
    #[error("caller pid {pid} cannot be identified: {reason}")]
    Unidentified {
        /// The peer's pid.
        pid: u32,
        /// What did not match.
        reason: String,
    },
    /// polkit is not reachable on the bus at all.
    #[error(
        "polkit is not reachable on the system bus: {0} (install polkitd, or run without a \
         system bus to rely on the socket's permissions)"
    )]
    Unreachable(zbus::Error),
}

/// polkit's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Authorized.
    pub authorized: bool,
    /// Not authorized now, but would be after authentication (interactive callers only).
    pub challenge: bool,
}

/// A proxy for polkit's authority on `conn` that reads each property with one `Get` call
/// when asked. zbus's default (properties cached lazily) makes the first property read
/// subscribe to `PropertiesChanged` and the owner's name changes and then call `GetAll`:
/// several bus round trips, on the path of the first check after the daemon starts, for
/// values read once.
async fn authority_proxy(conn: &zbus::Connection) -> zbus::Result<PolkitAuthorityProxy<'static>> {
    PolkitAuthorityProxy::builder(conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
}

#[zbus::proxy(
    interface = "org.freedesktop.PolicyKit1.Authority",
    default_service = "org.freedesktop.PolicyKit1",
    default_path = "/org/freedesktop/PolicyKit1/Authority",
    gen_blocking = false
)]
trait PolkitAuthority {
    /// `CheckAuthorization((sa{sv}) subject, s action_id, a{ss} details, u flags,
    /// s cancellation_id) -> (bbb{ss})`.
    fn check_authorization(
        &self,
        subject: &(&str, HashMap<&str, Value<'_>>),
        action_id: &str,
        details: HashMap<&str, &str>,
        flags: u32,
        cancellation_id: &str,
    ) -> zbus::Result<(bool, bool, HashMap<String, String>)>;

    /// e.g. `"122"`.
    #[zbus(property)]
    fn backend_version(&self) -> zbus::Result<String>;
}

/// The polkit authority. Cheap to share; the bus connection is attached and detached by the
/// D-Bus service as the system bus comes and goes.
#[derive(Debug)]
pub struct Polkit {
    bus: RwLock<Option<zbus::Connection>>,
    pidfd_subjects: AtomicBool,
    cache: Mutex<HashMap<(u64, Action), bool>>,
    /// Checks of a cacheable (connection, action) being asked now: a second check of the pair
    /// waits for the first. An entry lives while some check of it runs or waits (removed by
    /// the last one, [`AskingGuard`]), so the map is bounded by the checks under way.
    asking: Mutex<HashMap<(u64, Action), Asking>>,
    /// Places for calls in flight, daemon-wide ([`IN_FLIGHT_MAX`]).
    in_flight: Arc<Semaphore>,
    /// Places for calls in flight per caller uid ([`IN_FLIGHT_PER_UID`]); an entry lives
    /// while some check of that uid holds or waits for one.
    per_uid: Mutex<HashMap<u32, Arc<Semaphore>>>,
    /// `false` while the first bus connection is being made in the background
    /// ([`Polkit::connecting`]): checks wait for it instead of failing closed at once.
    settled: tokio::sync::watch::Sender<bool>,
}

impl Default for Polkit {
    fn default() -> Polkit {
        Polkit {
            bus: RwLock::new(None),
            pidfd_subjects: AtomicBool::new(false),
            cache: Mutex::new(HashMap::new()),
            asking: Mutex::new(HashMap::new()),
            in_flight: Arc::new(Semaphore::new(IN_FLIGHT_MAX)),
            per_uid: Mutex::new(HashMap::new()),
            settled: tokio::sync::watch::Sender::new(true),
        }
    }
}

/// The two places a check in flight holds: its uid's and the daemon-wide one.
type Places = (OwnedSemaphorePermit, OwnedSemaphorePermit);

impl Polkit {
    /// An authority with no bus yet (every non-root caller refused until [`Polkit::attach`]).
    pub fn new() -> Arc<Polkit> {
        Arc::new(Polkit::default())
    }

    /// Uses `conn` from now on and checks that polkit answers on it (reading `BackendVersion`,
    /// which also activates polkitd where it is bus-activatable); returns polkit's version.
    ///
    /// Errors: [`Error::Unreachable`]; the connection is used all the same, so that a polkitd
    /// that appears later on the same bus is asked (until then checks fail closed).
    pub async fn attach(&self, conn: &zbus::Connection) -> Result<String, Error> {
        *self.bus.write().unwrap() = Some(conn.clone());
        self.cache.lock().unwrap().clear();
        self.pidfd_subjects.store(false, Ordering::SeqCst);
        let proxy = authority_proxy(conn).await.map_err(Error::Unreachable)?;
        let version = tokio::time::timeout(CHECK_TIMEOUT, proxy.backend_version())
            .await
            .map_err(|_| {
                Error::Unreachable(zbus::Error::Failure("BackendVersion timed out".into()))
            })?
            .map_err(Error::Unreachable)?;
        let major = version
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        self.pidfd_subjects
            .store(major >= PIDFD_MIN_VERSION, Ordering::SeqCst);
        Ok(version)
    }

    /// The first bus connection is being made in the background (the daemon serves clients
    /// meanwhile): until [`Polkit::settle`], a check waits for it (and for polkit's version), at most
    /// [`FIRST_ATTACH_WAIT`], and then decides as it would have with the connection made
    /// first. Never lets anyone in that polkit would refuse: without a bus after the wait the
    /// check fails closed.
    pub fn connecting(&self) {
        self.settled.send_replace(false);
    }

    /// The first connection attempt ended ([`Polkit::attach`] done, or no connection):
    /// waiting checks go on.
    pub fn settle(&self) {
        self.settled.send_replace(true);
    }

    /// Forgets the bus connection (it closed); checks fail closed until the next attach.
    pub fn detach(&self) {
        *self.bus.write().unwrap() = None;
        self.cache.lock().unwrap().clear();
    }

    /// Whether `unix-process` subjects carry a pidfd (polkit >= 124).
    pub fn uses_pidfd(&self) -> bool {
        self.pidfd_subjects.load(Ordering::SeqCst)
    }

    /// Asks polkit whether `caller` may do `action`, uncached.
    ///
    /// Errors: [`Error::NoBus`], [`Error::Call`], [`Error::Timeout`].
    pub async fn ask(&self, caller: &Caller, action: Action) -> Result<Decision, Error> {
        let (subject, interactive) = self.subject(caller)?;
        if !*self.settled.borrow() {
            let mut rx = self.settled.subscribe();
            let _ = tokio::time::timeout(FIRST_ATTACH_WAIT, rx.wait_for(|s| *s)).await;
        }
        let conn = self.bus.read().unwrap().clone().ok_or(Error::NoBus)?;
        let id = action.id();
        let call = |source| Error::Call { action: id, source };
        let proxy = authority_proxy(&conn).await.map_err(call)?;
        let flags = if interactive {
            ALLOW_USER_INTERACTION
        } else {
            0
        };
        let after = if interactive {
            INTERACTIVE_TIMEOUT
        } else {
            CHECK_TIMEOUT
        };
        // The wait for a place counts against the check's timeout.
        let answer = tokio::time::timeout(after, async {
            let _places = self.place_for(caller.uid).await.ok_or(Error::NoBus)?;
            proxy
                .check_authorization(&subject, id, HashMap::new(), flags, "")
                .await
                .map_err(call)
        })
        .await
        .map_err(|_| Error::Timeout { action: id, after })??;
        Ok(Decision {
            authorized: answer.0,
            challenge: answer.1,
        })
    }

    /// Waits for a place for one call of `uid`: first one of the uid's
    /// [`IN_FLIGHT_PER_UID`], then one of the daemon's [`IN_FLIGHT_MAX`]. `None` only if a
    /// semaphore was closed, which this type never does.
    async fn place_for(&self, uid: u32) -> Option<Places> {
        let mine = {
            let mut m = self.per_uid.lock().unwrap();
            // Entries nobody holds or waits on are dropped, so the map is bounded by the
            // uids with a check under way.
            m.retain(|_, s| Arc::strong_count(s) > 1);
            m.entry(uid)
                .or_insert_with(|| Arc::new(Semaphore::new(IN_FLIGHT_PER_UID)))
                .clone()
        };
        let own = mine.acquire_owned().await.ok()?;
        let shared = self.in_flight.clone().acquire_owned().await.ok()?;
        Some((own, shared))
    }

    /// The polkit subject for `caller` and whether the check may be interactive.
    ///
    /// Errors: [`Error::Unidentified`] for a process whose start time is unknown (never sent
    /// as 0), or, without a pidfd, whose `/proc` entry no longer matches the peer.
    #[allow(clippy::type_complexity, clippy::result_large_err)]
    fn subject<'a>(
        &self,
        caller: &'a Caller,
    ) -> Result<((&'static str, HashMap<&'static str, Value<'a>>), bool), Error> {
        let mut d: HashMap<&'static str, Value<'a>> = HashMap::new();
        match &caller.subject {
            Subject::BusName { name, interactive } => {
                d.insert("name", Value::from(name.as_str()));
                Ok((("system-bus-name", d), *interactive))
            }
            Subject::Process {
                pid,
                start_time,
                pidfd,
            } => {
                if *start_time == 0 {
                    return Err(Error::Unidentified {
                        pid: *pid,
                        reason: "its start time could not be read (it exited, or the pid \
                                 names another process now)"
                            .into(),
                    });
                }
                if pidfd.is_none() {
                    same_process(*pid, *start_time, caller.uid, caller.gid)
                        .map_err(|reason| Error::Unidentified { pid: *pid, reason })?;
                }
                match pidfd {
                    Some(PidFd(fd)) if self.uses_pidfd() => {
                        d.insert("pidfd", Value::from(Fd::from(fd.as_fd())));
                    }
                    _ => {}
                }
                d.insert("pid", Value::from(*pid));
                d.insert("start-time", Value::from(*start_time));
                // polkit reads `uid` as int32 and refuses the check if it does not match the
                // process's real uid.
                d.insert("uid", Value::from(caller.uid as i32));
                Ok((("unix-process", d), false))
            }
            Subject::Daemon => {
                let pid = std::process::id();
                let t = start_time(pid).ok_or_else(|| Error::Unidentified {
                    pid,
                    reason: "the daemon's own start time could not be read".into(),
                })?;
                d.insert("pid", Value::from(pid));
                d.insert("start-time", Value::from(t));
                d.insert("uid", Value::from(caller.uid as i32));
                Ok((("unix-process", d), false))
            }
        }
    }

    async fn decide(&self, caller: &Caller, action: Action) -> bool {
        let cacheable = matches!(caller.subject, Subject::Process { .. }) && caller.connection != 0;
        if caller.subject == Subject::Daemon {
            return true;
        }
        if !cacheable {
            return self
                .ask_once(caller, action, false)
                .await
                .unwrap_or_else(|ok| ok);
        }
        let key = (caller.connection, action);
        if let Some(&ok) = self.cache.lock().unwrap().get(&key) {
            return ok;
        }
        // One question to polkit per (connection, action) at a time: a check that finds one
        // being asked waits for its answer. A failure is not shared (nor cached): each waiter
        // then asks in turn, so while polkit does not answer the calls of one connection wait
        // one check timeout each (a connection's calls are answered in order anyway).
        let cell = self.asking.lock().unwrap().entry(key).or_default().clone();
        let guard = AskingGuard {
            polkit: self,
            key,
            cell: Some(cell),
        };
        let cell = guard.cell.as_ref().expect("set above");
        match cell
            .get_or_try_init(|| self.ask_once(caller, action, true))
            .await
        {
            Ok(&ok) => ok,
            Err(ok) => ok,
        }
    }

    /// Asks polkit once and logs the answer. `Ok`: polkit's answer (cached under the caller's
    /// connection when `cacheable`); `Err`: the fail-closed decision when polkit could not
    /// answer or the caller could not be identified (never cached).
    async fn ask_once(
        &self,
        caller: &Caller,
        action: Action,
        cacheable: bool,
    ) -> Result<bool, bool> {
        match self.ask(caller, action).await {
            Ok(d) => {
                tracing::debug!(
                    action = action.id(),
                    uid = caller.uid,
                    pid = caller.pid,
                    authorized = d.authorized,
                    challenge = d.challenge,
                    "polkit answered"
                );
                if !d.authorized {
                    tracing::warn!(
                        action = action.id(),
                        uid = caller.uid,
                        gid = caller.gid,
                        pid = caller.pid,
                        subject = subject_kind(caller),
                        "authorization refused by polkit"
                    );
                }
                if cacheable {
                    let mut c = self.cache.lock().unwrap();
                    if c.len() >= CACHE_MAX {
                        c.clear();
                    }
                    c.insert((caller.connection, action), d.authorized);
                }
                Ok(d.authorized)
            }
            Err(e @ Error::Unidentified { .. }) => {
                tracing::warn!(error = %e, action = action.id(), uid = caller.uid,
                    gid = caller.gid, pid = caller.pid, "authorization refused: caller not identified");
                Err(false)
            }
            Err(e) => {
                // Fail closed; root would be allowed by polkit in any case.
                let ok = caller.uid == 0;
                tracing::warn!(error = %e, action = action.id(), uid = caller.uid,
                    gid = caller.gid, pid = caller.pid, subject = subject_kind(caller),
                    allowed = ok, "polkit unavailable: refusing everyone but root");
                Err(ok)
            }
        }
    }
}

/// The answer of a check being asked, shared by the checks that wait for it.
type Asking = Arc<tokio::sync::OnceCell<bool>>;

/// Held by each check of a (connection, action) in [`Polkit::decide`]; the last one to go
/// (answered, failed or cancelled with its connection) removes the pair's entry. Every
/// reference to an entry's cell is taken and dropped under the map's lock, so the count read
/// there is exact.
struct AskingGuard<'a> {
    polkit: &'a Polkit,
    key: (u64, Action),
    cell: Option<Asking>,
}

impl Drop for AskingGuard<'_> {
    fn drop(&mut self) {
        let mut asking = self.polkit.asking.lock().unwrap();
        let Some(cell) = self.cell.take() else {
            return;
        };
        let ours = asking.get(&self.key).is_some_and(|c| Arc::ptr_eq(c, &cell));
        drop(cell);
        // Only the map's reference left: no other check holds or waits on it.
        if ours
            && asking
                .get(&self.key)
                .is_some_and(|c| Arc::strong_count(c) == 1)
        {
            asking.remove(&self.key);
        }
    }
}

impl Authority for Polkit {
    fn check<'a>(
        &'a self,
        caller: &'a Caller,
        action: Action,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> {
        Box::pin(self.decide(caller, action))
    }
}

/// `unix-process`, `system-bus-name` or `daemon`, for log lines.
fn subject_kind(caller: &Caller) -> &'static str {
    match caller.subject {
        Subject::Process { .. } => "unix-process",
        Subject::BusName { .. } => "system-bus-name",
        Subject::Daemon => "daemon",
    }
}

/// Checks that `pid` is still the process that connected: its start time is `start` before
/// and after reading `/proc/<pid>/status`, whose real and effective `Uid` are `uid` and
/// effective `Gid` is `gid` (the peer's `SO_PEERCRED`). Errors: what did not match.
fn same_process(pid: u32, start: u64, uid: u32, gid: u32) -> Result<(), String> {
    let started = || start_time(pid) == Some(start);
    if !started() {
        return Err("the pid names another process now".into());
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("reading /proc/{pid}/status: {e}"))?;
    let ids = parse_status_ids(&status).ok_or("malformed /proc status")?;
    if !started() {
        return Err("the pid names another process now".into());
    }
    let ((ruid, euid), egid) = ids;
    if ruid != uid || euid != uid || egid != gid {
        return Err(format!(
            "/proc shows uid {ruid}/{euid} gid {egid}, the socket said uid {uid} gid {gid}"
        ));
    }
    Ok(())
}

/// ((real uid, effective uid), effective gid) from a `/proc/<pid>/status` text.
fn parse_status_ids(status: &str) -> Option<((u32, u32), u32)> {
    let field = |key: &str| -> Option<Vec<u32>> {
        let line = status.lines().find_map(|l| l.strip_prefix(key))?;
        line.split_whitespace().map(|v| v.parse().ok()).collect()
    };
    let u = field("Uid:")?;
    let g = field("Gid:")?;
    Some(((*u.first()?, *u.get(1)?), *g.get(1)?))
}

/// Start time of `pid`: field 22 (`starttime`) of `/proc/<pid>/stat`, clock ticks since boot.
/// `None` if the process is gone or the line is malformed. The command name (field 2) may
/// contain spaces and parentheses, so fields are counted after the last `)`.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` begins with field 3 (state); field 22 is the 20th after it.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The pid a pidfd refers to (`Pid:` in `/proc/self/fdinfo/<fd>`): `None` if unknown, `-1`
/// once the process has exited.
fn pidfd_pid(fd: BorrowedFd<'_>) -> Option<i64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The polkit subject of a socket peer: `pid` (from `SO_PEERCRED`) with its start time, and
/// a duplicate of the peer's pidfd (`SO_PEERPIDFD`) when the kernel gave one.
///
/// With a pidfd, the start time is read only while the pidfd still names `pid` (checked
/// before and after reading), so it belongs to the peer and not to a recycled pid; if the
/// peer has already exited, the start time is 0 and polkit refuses the subject.
pub fn process_subject(pid: u32, pidfd: Option<BorrowedFd<'_>>) -> Subject {
    let pidfd = pidfd.and_then(|fd| fd.try_clone_to_owned().ok());
    let start = match &pidfd {
        Some(fd) => {
            let same = || pidfd_pid(fd.as_fd()) == Some(pid as i64);
            if same() {
                let t = start_time(pid);
                if same() { t } else { None }
            } else {
                None
            }
        }
        None => start_time(pid),
    };
    Subject::Process {
        pid,
        start_time: start.unwrap_or(0),
        pidfd: pidfd.map(|fd| PidFd(Arc::new(fd))),
    }
}

/// A fake polkit authority for unit tests (here and in the early acceptor's).
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake `org.freedesktop.PolicyKit1.Authority`: counts `CheckAuthorization` calls and
    /// answers each after 200 ms, allowing everyone.
    struct FakeAuthority {
        asked: Arc<AtomicUsize>,
    }

    #[zbus::interface(name = "org.freedesktop.PolicyKit1.Authority")]
    impl FakeAuthority {
        async fn check_authorization(
            &self,
            _subject: (String, HashMap<String, zbus::zvariant::OwnedValue>),
            _action_id: String,
            _details: HashMap<String, String>,
            _flags: u32,
            _cancellation_id: String,
        ) -> (bool, bool, HashMap<String, String>) {
            self.asked.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            (true, false, HashMap::new())
        }

        #[zbus(property)]
        async fn backend_version(&self) -> String {
            "122".into()
        }
    }

    /// A [`Polkit`] attached to a [`FakeAuthority`] over a peer-to-peer connection (the zbus
    /// `p2p` feature), and the count of questions it was asked.
    pub(crate) struct FakePolkit {
        pub(crate) polkit: Arc<Polkit>,
        pub(crate) asked: Arc<AtomicUsize>,
        _connections: (zbus::Connection, zbus::Connection),
    }

    impl FakePolkit {
        pub(crate) async fn start() -> FakePolkit {
            let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
            let asked = Arc::new(AtomicUsize::new(0));
            let fake = FakeAuthority {
                asked: asked.clone(),
            };
            let server = tokio::spawn(async move {
                zbus::connection::Builder::unix_stream(theirs)
                    .server(zbus::Guid::generate())
                    .unwrap()
                    .p2p()
                    .serve_at("/org/freedesktop/PolicyKit1/Authority", fake)
                    .unwrap()
                    .build()
                    .await
                    .unwrap()
            });
            let conn = zbus::connection::Builder::unix_stream(ours)
                .p2p()
                .build()
                .await
                .unwrap();
            let server = server.await.unwrap();
            let polkit = Polkit::new();
            assert_eq!(polkit.attach(&conn).await.unwrap(), "122");
            FakePolkit {
                polkit,
                asked,
                _connections: (conn, server),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(uid: u32, connection: u64, subject: Subject) -> Caller {
        Caller {
            uid,
            gid: uid,
            pid: 4242,
            connection,
            subject,
        }
    }

    #[test]
    fn subjects_are_never_bare_pids() {
        let p = Polkit::default();
        let bus = caller(
            1000,
            0,
            Subject::BusName {
                name: ":1.42".into(),
                interactive: true,
            },
        );
        let ((kind, d), interactive) = p.subject(&bus).unwrap();
        assert_eq!(kind, "system-bus-name");
        assert_eq!(d.get("name"), Some(&Value::from(":1.42")));
        assert_eq!(d.len(), 1);
        assert!(interactive, "the D-Bus interactive flag is honoured");

        // Ourselves, without a pidfd: /proc must show our uid, gid and start time.
        let me = std::process::id();
        let (uid, gid) = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let t = start_time(me).unwrap();
        let mut proc_ = caller(
            uid,
            7,
            Subject::Process {
                pid: me,
                start_time: t,
                pidfd: None,
            },
        );
        proc_.gid = gid;
        let ((kind, d), interactive) = p.subject(&proc_).unwrap();
        assert_eq!(kind, "unix-process");
        assert_eq!(d.get("pid"), Some(&Value::from(me)));
        assert_eq!(d.get("start-time"), Some(&Value::from(t)));
        // polkit reads uid as int32 (measured with polkit 122: a u32 is ignored).
        assert_eq!(d.get("uid"), Some(&Value::from(uid as i32)));
        assert!(!interactive, "Varlink callers are never interactive");

        // A start time of 0 is never sent; another uid or start time is refused.
        for (uid2, start2) in [(uid, 0), (uid.wrapping_add(1), t), (uid, t + 1)] {
            let other = caller(
                uid2,
                7,
                Subject::Process {
                    pid: me,
                    start_time: start2,
                    pidfd: None,
                },
            );
            let mut other = other;
            other.gid = gid;
            assert!(
                matches!(p.subject(&other), Err(Error::Unidentified { .. })),
                "uid {uid2} start {start2}"
            );
        }
    }

    /// While the first bus connection is being made, a check waits for it instead of
    /// failing closed at once; once that attempt ends without a bus it fails closed (and a
    /// check after it does not wait).
    #[tokio::test]
    async fn a_check_waits_for_the_first_connection_then_fails_closed_without_one() {
        let p = Polkit::new();
        let me = std::process::id();
        let mut c = caller(
            nix::unistd::getuid().as_raw(),
            9,
            Subject::Process {
                pid: me,
                start_time: start_time(me).unwrap(),
                pidfd: None,
            },
        );
        c.gid = nix::unistd::getgid().as_raw();
        p.connecting();
        let waiting = {
            let (p, c) = (p.clone(), c.clone());
            tokio::spawn(async move { p.ask(&c, Action::Execute).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the check did not wait for the connection"
        );
        let t = std::time::Instant::now();
        p.settle();
        let got = waiting.await.unwrap();
        assert!(matches!(got, Err(Error::NoBus)), "{got:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let t = std::time::Instant::now();
        assert!(matches!(
            p.ask(&c, Action::Execute).await,
            Err(Error::NoBus)
        ));
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    /// The first call of a connection accepted during an adoption arrives while the check
    /// begun at its accept is under way: polkit is asked once per connection and action, and
    /// both get its answer; another connection is asked about on its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_checks_of_one_connection_ask_polkit_once() {
        let fake = test_support::FakePolkit::start().await;
        let (p, asked) = (fake.polkit, fake.asked.clone());
        let me = std::process::id();
        let mut c = caller(
            nix::unistd::getuid().as_raw(),
            11,
            Subject::Process {
                pid: me,
                start_time: start_time(me).unwrap(),
                pidfd: None,
            },
        );
        c.gid = nix::unistd::getgid().as_raw();
        let (a, b) = tokio::join!(p.check(&c, Action::Execute), p.check(&c, Action::Execute));
        assert!(a && b);
        assert_eq!(asked.load(Ordering::SeqCst), 1, "polkit was asked twice");
        assert!(p.asking.lock().unwrap().is_empty(), "an entry was left");
        // Cached now; another connection of the same process is a question of its own.
        assert!(p.check(&c, Action::Execute).await);
        c.connection = 12;
        assert!(p.check(&c, Action::Execute).await);
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        // A check dropped while it waits (its connection went) leaves nothing behind.
        c.connection = 13;
        let _ = tokio::time::timeout(Duration::from_millis(50), p.check(&c, Action::Execute)).await;
        assert!(
            p.asking.lock().unwrap().is_empty(),
            "a cancelled check left an entry"
        );
        // Many checks of one new connection on several threads: one question, no entry left.
        let p = Arc::new(p);
        c.connection = 14;
        let checks: Vec<_> = (0..32)
            .map(|_| {
                let (p, c) = (p.clone(), c.clone());
                tokio::spawn(async move { p.check(&c, Action::Execute).await })
            })
            .collect();
        for t in checks {
            assert!(t.await.unwrap());
        }
        // Connections 11, 12, 13 (asked, then cancelled) and 14 once.
        assert_eq!(asked.load(Ordering::SeqCst), 4);
        assert!(p.asking.lock().unwrap().is_empty(), "an entry was left");
    }

    #[tokio::test]
    async fn unidentified_callers_are_refused_even_as_root() {
        let p = Polkit::new();
        let subject = Subject::Process {
            pid: std::process::id(),
            start_time: 0,
            pidfd: None,
        };
        assert!(!p.check(&caller(0, 3, subject), Action::Execute).await);
    }

    #[tokio::test]
    async fn one_uid_cannot_take_every_place_for_calls_in_flight() {
        let p = Polkit::default();
        let mut held = Vec::new();
        for _ in 0..IN_FLIGHT_PER_UID {
            held.push(p.place_for(1000).await.unwrap());
        }
        // The flooding uid waits for its own places ...
        let more = tokio::time::timeout(Duration::from_millis(50), p.place_for(1000)).await;
        assert!(
            more.is_err(),
            "uid 1000 got more than {IN_FLIGHT_PER_UID} places"
        );
        // ... while another uid gets one at once.
        let other = tokio::time::timeout(Duration::from_millis(50), p.place_for(1002)).await;
        assert!(
            other.is_ok_and(|p| p.is_some()),
            "uid 1002 waited behind uid 1000"
        );
        drop(held);
        // Daemon-wide: many uids together hold at most IN_FLIGHT_MAX places.
        let mut many = Vec::new();
        for uid in 0..IN_FLIGHT_MAX as u32 {
            many.push(p.place_for(2000 + uid).await.unwrap());
        }
        let over = tokio::time::timeout(Duration::from_millis(50), p.place_for(9999)).await;
        assert!(over.is_err(), "more than {IN_FLIGHT_MAX} calls in flight");
        drop(many);
        assert!(p.place_for(9999).await.is_some());
        // Idle uids are forgotten.
        assert!(p.per_uid.lock().unwrap().len() <= 1);
    }

    #[test]
    fn status_ids_are_parsed() {
        let st = "Name:\tx\nUid:\t1000\t1001\t1000\t1000\nGid:\t50\t51\t50\t50\n";
        assert_eq!(parse_status_ids(st), Some(((1000, 1001), 51)));
        assert_eq!(parse_status_ids("Uid:\tx\n"), None);
    }

    #[tokio::test]
    async fn without_polkit_only_root_is_allowed() {
        let p = Polkit::new();
        let me = std::process::id();
        let subject = Subject::Process {
            pid: me,
            start_time: start_time(me).unwrap(),
            pidfd: None,
        };
        if nix::unistd::geteuid().is_root() && nix::unistd::getegid().as_raw() == 0 {
            assert!(
                p.check(&caller(0, 1, subject.clone()), Action::Execute)
                    .await
            );
        }
        assert!(
            !p.check(&caller(1000, 2, subject.clone()), Action::Execute)
                .await
        );
        assert!(!p.check(&caller(1000, 2, subject), Action::ManageOwn).await);
        // Failures are not cached: nothing was remembered for connection 2.
        assert!(p.cache.lock().unwrap().is_empty());
    }

    #[test]
    fn start_time_is_field_22_even_with_parentheses_in_the_name() {
        let stat =
            "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1234 56";
        assert_eq!(parse_start_time(stat), Some(987654));
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn own_start_time_matches_proc_and_pidfd_names_us() {
        let me = std::process::id();
        let t = start_time(me).expect("own stat");
        assert!(t > 0);
        let Ok(fd) = crate::sys::pidfd_open(me) else {
            eprintln!("skip: pidfd_open unavailable on this kernel");
            return;
        };
        match process_subject(me, Some(fd.as_fd())) {
            Subject::Process {
                pid,
                start_time,
                pidfd,
            } => {
                assert_eq!(pid, me);
                assert_eq!(start_time, t);
                assert!(pidfd.is_some());
            }
            other => panic!("unexpected subject {other:?}"),
        }
        // A pidfd that names another process yields no start time.
        match process_subject(1, Some(fd.as_fd())) {
            Subject::Process { start_time, .. } => assert_eq!(start_time, 0),
            other => panic!("unexpected subject {other:?}"),
        }
    }
}
