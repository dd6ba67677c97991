//! The D-Bus face of sandcelld: the control plane `org.sandcell.Sandcell1` on the system bus.
//!
//! A thin shim, like `varlink/`: it identifies the caller from the bus (never from the
//! message), calls the core, and turns core errors into D-Bus errors. Files:
//! - `mod.rs` (this file): the connection, its supervisor (reconnect with backoff), the
//!   translation of core events into signals, PropertiesChanged for the pools (compared
//!   once a second: the refill task emits no events), caller identification, the error names;
//! - `manager.rs`: `org.sandcell.Manager1` at `/org/sandcell/Sandcell1`;
//! - `session.rs`: `org.sandcell.Session1` at `/org/sandcell/Sandcell1/session/<id>`.
//!
//! The bus is used only when one is there: `DBUS_SYSTEM_BUS_ADDRESS`, else the socket
//! `/run/dbus/system_bus_socket` if it exists. Which authority decides is settled at
//! start-up, before the Varlink socket is served, and logged (`authorization: ...`):
//! - polkit installed ([`crate::polkit::installed`]: polkitd or sandcell's action file on a
//!   host with a system bus; sandcell's action file on a host without one, where polkitd
//!   cannot run): the polkit authority ([`crate::polkit::Polkit`]), answering or not. While
//!   polkit does not answer (not started, bus gone) it fails closed: only root is allowed;
//! - polkit not installed at all: [`crate::auth::SocketPermissions`]; if polkit appears on
//!   the bus later, it is selected then.
//!
//! If the bus goes away the daemon keeps serving Varlink and reconnects with a backoff from
//! 1 s doubling to 30 s.
//!
//! Visibility: a session's object and properties are shown to its owner, root, and holders
//! of `org.sandcell.manage-sessions` only (property reads of anyone else fail with
//! `org.freedesktop.DBus.Error.AccessDenied`; `ListSessions` and `GetSession` filter). The
//! shipped bus policy delivers sandcelld's signals (which name owners) to root only, and
//! lets only root list the session objects by introspection.
//!
//! Shipped with it (repository root): `dbus/org.sandcell.Sandcell1.conf` (bus policy),
//! `dbus/org.sandcell.Sandcell1.service` (activation), `dbus/org.sandcell.Manager1.xml` and
//! `dbus/org.sandcell.Session1.xml` (introspection, checked against the live objects by
//! `tests/integration/dbus_polkit.rs`).

mod manager;
mod session;

pub use manager::Manager;
pub use session::SessionObject;

use crate::core::Core;
use crate::identity::{Caller, Subject};
use crate::polkit::Polkit;
use crate::session::Event;
use sandcell_proto::kernel::KernelError;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, watch};
use zbus::object_server::InterfaceRef;
use zbus::zvariant::OwnedObjectPath;

/// Well-known bus name.
pub const BUS_NAME: &str = "org.sandcell.Sandcell1";
/// The manager object.
pub const MANAGER_PATH: &str = "/org/sandcell/Sandcell1";
/// Parent of the session objects.
pub const SESSION_PATH_PREFIX: &str = "/org/sandcell/Sandcell1/session";
/// The system bus socket used when `DBUS_SYSTEM_BUS_ADDRESS` is unset.
pub const SYSTEM_BUS_SOCKET: &str = "/run/dbus/system_bus_socket";
/// First reconnect delay; doubles up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest reconnect delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How long the first connection attempt at start-up may take.
pub const FIRST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the pools are compared with what was last signalled (`Pools` and `Admission`
/// PropertiesChanged). Pools change on the refill task, which emits no events; a check is
/// one lock and a few integers.
pub const POOL_CHECK: Duration = Duration::from_secs(1);

/// What the control plane needs besides the core.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The configuration file the daemon was started with (re-read by `Reload`).
    pub config_path: PathBuf,
    /// Whether that file must exist (it was named with `--config`).
    pub config_required: bool,
}

/// D-Bus errors of `org.sandcell.Manager1` and `org.sandcell.Session1`.
///
/// Names: `org.sandcell.Sandcell1.<Variant>`; the text says what and, where known, what to do.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.sandcell.Sandcell1")]
pub enum Error {
    /// A zbus failure.
    #[zbus(error)]
    ZBus(zbus::Error),
    /// No session with this id.
    NoSuchSession(String),
    /// polkit (or the socket-permission fallback) refused; the text names the action.
    PermissionDenied(String),
    /// `Reload`: the configuration file is invalid; the previous configuration stays.
    InvalidConfig(String),
    /// A parameter is malformed.
    InvalidParameter(String),
    /// The daemon is stopping.
    ShuttingDown(String),
    /// Anything else.
    Failed(String),
}

impl From<KernelError> for Error {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::NoSuchSession { session } => {
                Error::NoSuchSession(format!("no session {session}"))
            }
            KernelError::WrongNode {
                session,
                node,
                expected,
            } => Error::NoSuchSession(format!(
                "session {session} is on node {node}, not on this node ({expected:?})"
            )),
            KernelError::PermissionDenied { action } => {
                Error::PermissionDenied(format!("not authorized for {action}"))
            }
            KernelError::InvalidParameter { parameter, reason } => {
                Error::InvalidParameter(format!("{parameter}: {reason}"))
            }
            KernelError::ShuttingDown {} => Error::ShuttingDown("sandcelld is stopping".into()),
            other => Error::Failed(other.to_string()),
        }
    }
}

impl From<zbus::fdo::Error> for Error {
    fn from(e: zbus::fdo::Error) -> Self {
        Error::Failed(e.to_string())
    }
}

/// Object path of session `id`.
pub fn session_path(id: &str) -> OwnedObjectPath {
    OwnedObjectPath::try_from(format!("{SESSION_PATH_PREFIX}/{id}"))
        .expect("session ids are lowercase hex, valid path elements")
}

/// Validates a session id from a D-Bus caller ([`sandcell_proto::kernel::SessionId`]).
pub(crate) fn check_id(id: &str) -> Result<(), Error> {
    sandcell_proto::kernel::SessionId::parse_qualified(id)
        .map(drop)
        .map_err(|e| Error::InvalidParameter(format!("session id {id:?}: {}", e.reason)))
}

/// The system bus address, if there is a system bus: `DBUS_SYSTEM_BUS_ADDRESS`, else
/// `unix:path=/run/dbus/system_bus_socket` when that socket exists.
pub fn system_bus_address() -> Option<String> {
    match std::env::var("DBUS_SYSTEM_BUS_ADDRESS") {
        Ok(a) if !a.is_empty() => Some(a),
        _ => std::path::Path::new(SYSTEM_BUS_SOCKET)
            .exists()
            .then(|| format!("unix:path={SYSTEM_BUS_SOCKET}")),
    }
}

/// Identifies the sender of a method call from the bus daemon's records of its connection
/// (`GetConnectionCredentials`), never from the message body. The polkit subject is the
/// sender's unique name; `ALLOW_INTERACTIVE_AUTHORIZATION` is honoured.
pub(crate) async fn caller(
    conn: &zbus::Connection,
    header: &zbus::message::Header<'_>,
) -> Result<Caller, Error> {
    let sender = header
        .sender()
        .ok_or_else(|| Error::Failed("method call without a sender".into()))?;
    let dbus = zbus::fdo::DBusProxy::new(conn).await?;
    let creds = dbus
        .get_connection_credentials(sender.clone().into())
        .await?;
    let uid = creds
        .unix_user_id()
        .ok_or_else(|| Error::Failed("the bus does not know the caller's uid".into()))?;
    let interactive = header
        .primary()
        .flags()
        .contains(zbus::message::Flags::AllowInteractiveAuth);
    Ok(Caller {
        uid,
        gid: creds
            .unix_group_ids()
            .and_then(|g| g.first().copied())
            .unwrap_or(u32::MAX),
        pid: creds.process_id().unwrap_or(0),
        connection: 0,
        subject: Subject::BusName {
            name: sender.to_string(),
            interactive,
        },
    })
}

/// The system bus connection begun at the very start of the daemon, before its core exists:
/// the bus handshake (`Hello`) and polkit's first answer (`BackendVersion`) then overlap the
/// rest of the start (the confinement self-check, the cgroup set-up, the adoption of kept
/// sessions) instead of following it. After a restart that kept sessions, their owners' first
/// calls wait for polkit's first answer, so this is on the path from the restart to the first
/// adopted cell answered. [`start`] or [`start_in_background`] then serve the control plane
/// on that connection. Made by [`connect_early`].
pub struct Early {
    address: Option<String>,
    polkit: Arc<Polkit>,
    first: Option<tokio::task::JoinHandle<Option<FirstBus>>>,
}

/// Calls [`Polkit::settle`] when dropped.
struct Settle(Arc<Polkit>);

impl Drop for Settle {
    fn drop(&mut self) {
        self.0.settle();
    }
}

/// The early connection and what polkit answered on it.
type FirstBus = (zbus::Connection, Result<String, crate::polkit::Error>);

/// Begins the first system bus connection in the background (at most
/// [`FIRST_CONNECT_TIMEOUT`]) when there is a system bus, and attaches the polkit authority
/// to it: when polkit is installed, every authorization check waits for this attempt
/// (`Polkit::connecting`, at most `polkit::FIRST_ATTACH_WAIT`) and never decides without it.
/// Call from within the daemon's runtime.
pub fn connect_early() -> Early {
    let address = system_bus_address();
    let polkit = Polkit::new();
    let first = address.clone().map(|address| {
        if crate::polkit::installed().is_some() {
            polkit.connecting();
        }
        let polkit = polkit.clone();
        tokio::spawn(async move {
            // Checks waiting for the first attempt go on (with polkit, or failing closed)
            // however this task ends, a panic included.
            let _settle = Settle(polkit.clone());
            let clock = crate::stages::monotonic_us();
            let mut stages = crate::stages::Stages::new();
            let made = tokio::time::timeout(FIRST_CONNECT_TIMEOUT, async {
                let conn = zbus::connection::Builder::address(address.as_str())?
                    .build()
                    .await?;
                stages.mark("connect");
                let answer = polkit.attach(&conn).await;
                stages.mark("polkit");
                Ok::<_, zbus::Error>((conn, answer))
            })
            .await;
            stages.log_daemon("bus", clock);
            match made {
                Ok(Ok(first)) => Some(first),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, %address, "system bus: first connection failed; retrying in the background");
                    None
                }
                Err(_) => {
                    tracing::warn!(%address, "system bus: first connection timed out; retrying in the background");
                    None
                }
            }
        })
    });
    Early {
        address,
        polkit,
        first,
    }
}

impl Early {
    /// The polkit authority when the daemon's start selects it at once (what [`start`] and
    /// [`start_in_background`] do first): polkit is installed and there is a system bus, or
    /// sandcell's polkit action file is installed and there is none (polkit then refuses
    /// everyone but root). `None`: the socket's permissions decide until the bus says more.
    pub fn initial_authority(&self) -> Option<Arc<Polkit>> {
        let selected = match &self.address {
            Some(_) => crate::polkit::installed().is_some(),
            None => crate::polkit::action_file_installed().is_some(),
        };
        selected.then(|| self.polkit.clone())
    }

    /// Whether the authority of the daemon's first client is known before the D-Bus start:
    /// polkit is selected at once ([`Early::initial_authority`]), or there is no system bus
    /// (then nothing later changes it). `false` when there is a bus but polkit's presence is
    /// only learned from its first answer: no client call may be decided before that.
    pub fn authority_known(&self) -> bool {
        self.address.is_none() || self.initial_authority().is_some()
    }
}

/// Starts the control plane on `early`'s connection if there is a system bus; returns its
/// supervisor task.
///
/// The first connection is awaited here (begun by [`connect_early`], at most
/// [`FIRST_CONNECT_TIMEOUT`]), so that the polkit authority is in force before the Varlink
/// socket is served; later attempts run in the background. The task ends when `stop` turns
/// true.
pub async fn start(
    core: Arc<Core>,
    settings: Settings,
    stop: watch::Receiver<bool>,
    early: Early,
) -> Option<tokio::task::JoinHandle<()>> {
    start_with(core, settings, stop, false, early).await
}

/// As [`start`], but when polkit is installed the first connection is not awaited, and
/// returns at once: polkit is the authority from the first client on all the same, and each
/// check waits for that first connection (`Polkit::connecting`, at most
/// `polkit::FIRST_ATTACH_WAIT`) and then decides as it would have with the connection made
/// first. A daemon that adopted its predecessor's sessions starts this way, so that their
/// owners' first calls are not held behind the control plane's own set-up (its objects and
/// name). Without polkit installed, as [`start`] (the socket's permissions must not decide
/// while polkit's presence is unknown).
pub async fn start_in_background(
    core: Arc<Core>,
    settings: Settings,
    stop: watch::Receiver<bool>,
    early: Early,
) -> Option<tokio::task::JoinHandle<()>> {
    start_with(core, settings, stop, true, early).await
}

async fn start_with(
    core: Arc<Core>,
    settings: Settings,
    stop: watch::Receiver<bool>,
    background: bool,
    early: Early,
) -> Option<tokio::task::JoinHandle<()>> {
    let Some(address) = early.address else {
        match crate::polkit::action_file_installed() {
            Some(evidence) => {
                core.set_authority(early.polkit);
                tracing::error!(
                    evidence,
                    "authorization: FAIL-CLOSED: polkit is installed for sandcell but there is \
                     no system bus (DBUS_SYSTEM_BUS_ADDRESS unset, {SYSTEM_BUS_SOCKET} absent) \
                     to ask it on; only root may run code"
                );
            }
            None => tracing::warn!(
                "authorization: socket permissions only: no system bus \
                 (DBUS_SYSTEM_BUS_ADDRESS unset, {SYSTEM_BUS_SOCKET} absent) and polkit is not \
                 installed for sandcell; D-Bus control plane off; every user who can open the \
                 socket may run code"
            ),
        }
        return None;
    };
    let sup = Supervisor {
        core,
        settings: Arc::new(settings),
        address,
        polkit: early.polkit,
        polkit_selected: AtomicBool::new(false),
    };
    let installed = crate::polkit::installed();
    if let Some(evidence) = installed {
        // Fail closed from the first client on; polkit decides once it answers.
        sup.core.set_authority(sup.polkit.clone());
        sup.polkit_selected.store(true, Ordering::SeqCst);
        tracing::info!(
            evidence,
            "polkit is installed: polkit decides authorization (only root until it answers)"
        );
    }
    if background && installed.is_some() {
        return Some(tokio::spawn(async move {
            let first = sup.first_connection(early.first).await;
            sup.run(first, stop).await
        }));
    }
    let first = sup.first_connection(early.first).await;
    Some(tokio::spawn(sup.run(first, stop)))
}

struct Supervisor {
    core: Arc<Core>,
    settings: Arc<Settings>,
    address: String,
    polkit: Arc<Polkit>,
    polkit_selected: AtomicBool,
}

/// A live connection with everything served on it.
struct Live {
    conn: zbus::Connection,
    events: broadcast::Receiver<Event>,
    manager: InterfaceRef<Manager>,
    /// Ids of the session objects exported on `conn`.
    exported: Mutex<HashSet<String>>,
}

impl Supervisor {
    /// The control plane on the early connection ([`connect_early`]); `None` (logged) when
    /// there is none or serving on it failed (the supervisor retries in the background).
    async fn first_connection(
        &self,
        early: Option<tokio::task::JoinHandle<Option<FirstBus>>>,
    ) -> Option<Live> {
        let (conn, polkit) = match early?.await {
            Ok(first) => first?,
            Err(e) => {
                tracing::error!(error = %e, "system bus: the first connection's task failed; retrying in the background");
                return None;
            }
        };
        match self.serve_on(conn, polkit).await {
            Ok(live) => Some(live),
            Err(e) => {
                tracing::warn!(error = %e, address = %self.address, "system bus: serving on the first connection failed; retrying in the background");
                None
            }
        }
    }

    /// Connects and attaches polkit, then serves on the connection ([`Supervisor::serve_on`]).
    async fn connect(&self) -> Result<Live, zbus::Error> {
        let conn = zbus::connection::Builder::address(self.address.as_str())?
            .build()
            .await?;
        let polkit = self.polkit.attach(&conn).await;
        self.serve_on(conn, polkit).await
    }

    /// Serves the manager on `conn`, claims the name, registers live sessions, and selects
    /// polkit if it answered (`polkit`: what [`Polkit::attach`] on `conn` returned).
    async fn serve_on(
        &self,
        conn: zbus::Connection,
        polkit: Result<String, crate::polkit::Error>,
    ) -> Result<Live, zbus::Error> {
        // Subscribe before taking the snapshot of sessions, so no event falls in between.
        let events = self.core.events();
        let manager = Manager::new(self.core.clone(), self.settings.clone());
        conn.object_server().at(MANAGER_PATH, manager).await?;
        conn.request_name(BUS_NAME).await?;
        let manager = conn
            .object_server()
            .interface::<_, Manager>(MANAGER_PATH)
            .await?;
        let exported = Mutex::new(HashSet::new());
        for s in self.core.sessions() {
            add_session(&conn, &self.core, &exported, s.id.clone()).await;
        }
        match polkit {
            Ok(version) => {
                if !self.polkit_selected.swap(true, Ordering::SeqCst) {
                    self.core.set_authority(self.polkit.clone());
                }
                tracing::info!(
                    %version,
                    pidfd = self.polkit.uses_pidfd(),
                    "authorization: polkit decides authorization (Varlink and D-Bus)"
                );
            }
            Err(e) if self.polkit_selected.load(Ordering::SeqCst) => {
                tracing::error!(error = %e, "authorization: FAIL-CLOSED: polkit is installed but not answering; refusing everyone but root until it does");
            }
            Err(e) => {
                tracing::warn!(error = %e, "authorization: socket permissions only: polkit is not installed (no polkitd, no sandcell action file) and not answering; the socket's permissions stay the only authorization");
            }
        }
        tracing::info!(name = BUS_NAME, address = %self.address, "D-Bus control plane up");
        Ok(Live {
            conn,
            events,
            manager,
            exported,
        })
    }

    async fn run(self, mut first: Option<Live>, mut stop: watch::Receiver<bool>) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let live = match first.take() {
                Some(l) => l,
                None => match self.connect().await {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?backoff, "system bus: connection failed");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        continue;
                    }
                },
            };
            backoff = BACKOFF_MIN;
            let stopped = self.serve(live, &mut stop).await;
            self.polkit.detach();
            if stopped {
                return;
            }
            tracing::warn!(retry_in = ?backoff, "system bus connection lost; Varlink keeps serving");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            }
        }
    }

    /// Forwards core events, and pool changes every [`POOL_CHECK`], until the connection
    /// closes (false) or the daemon stops (true).
    async fn serve(&self, mut live: Live, stop: &mut watch::Receiver<bool>) -> bool {
        let mut pools = self.core.pool().rows(&self.core.config());
        let mut tick = tokio::time::interval(POOL_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = self.core.pool().rows(&self.core.config());
                    if now != pools {
                        pools = now;
                        if let Err(e) = self.pools_changed(&live).await {
                            tracing::debug!(error = %e, "emitting PropertiesChanged(Pools) failed");
                        }
                    }
                }
                _ = live.conn.closed() => return false,
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    let _ = live.conn.release_name(BUS_NAME).await;
                    return true;
                }
                ev = live.events.recv() => match ev {
                    Ok(ev) => {
                        if let Err(e) = self.forward(&live, ev).await {
                            tracing::debug!(error = %e, "emitting a D-Bus signal failed");
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "D-Bus: missed session events; resynchronizing objects");
                        self.resync(&live).await;
                    }
                    Err(broadcast::error::RecvError::Closed) => return true,
                },
            }
        }
    }

    async fn forward(&self, live: &Live, ev: Event) -> zbus::Result<()> {
        let emitter = live.manager.signal_emitter();
        match ev {
            Event::Opened { id, uid, language } => {
                // A session that ended before its Opened event got here has no object.
                if self.core.sessions().iter().any(|s| s.id == id) {
                    add_session(&live.conn, &self.core, &live.exported, id.clone()).await;
                }
                let public = self.core.public_id(&id);
                Manager::session_opened(
                    emitter,
                    &public,
                    uid,
                    language.as_str(),
                    session_path(&id),
                )
                .await?;
                self.figures_changed(live).await?;
            }
            Event::Closed { id, reason, .. } => {
                live.exported.lock().unwrap().remove(&id);
                let _ = live
                    .conn
                    .object_server()
                    .remove::<SessionObject, _>(session_path(&id))
                    .await;
                Manager::session_closed(emitter, &self.core.public_id(&id), &reason).await?;
                self.figures_changed(live).await?;
            }
            Event::CellFinished { id, cell, status } => {
                Manager::cell_finished(emitter, &self.core.public_id(&id), cell, status.as_str())
                    .await?;
                if let Ok(s) = live
                    .conn
                    .object_server()
                    .interface::<_, SessionObject>(session_path(&id))
                    .await
                {
                    let g = s.get().await;
                    g.cells_run_changed(s.signal_emitter()).await?;
                    g.state_changed(s.signal_emitter()).await?;
                }
            }
            Event::OomKilled { id } => {
                Manager::worker_oom_killed(emitter, &self.core.public_id(&id)).await?;
            }
            Event::Reloaded => {
                // Pools first; figures_changed announces Admission once for both.
                let m = live.manager.get().await;
                m.pools_changed(live.manager.signal_emitter()).await?;
                self.figures_changed(live).await?;
            }
        }
        Ok(())
    }

    async fn figures_changed(&self, live: &Live) -> zbus::Result<()> {
        let m = live.manager.get().await;
        m.active_sessions_changed(live.manager.signal_emitter())
            .await?;
        m.admission_changed(live.manager.signal_emitter()).await
    }

    /// Pooled workers hold admission charges, so a pool change is an admission change too.
    async fn pools_changed(&self, live: &Live) -> zbus::Result<()> {
        let m = live.manager.get().await;
        m.pools_changed(live.manager.signal_emitter()).await?;
        m.admission_changed(live.manager.signal_emitter()).await
    }

    /// After missed events: one object per live session, no others.
    async fn resync(&self, live: &Live) {
        let live_ids: Vec<String> = self.core.sessions().iter().map(|s| s.id.clone()).collect();
        for id in &live_ids {
            add_session(&live.conn, &self.core, &live.exported, id.clone()).await;
        }
        let exported: Vec<String> = live.exported.lock().unwrap().iter().cloned().collect();
        for id in exported {
            if !live_ids.contains(&id) {
                live.exported.lock().unwrap().remove(&id);
                let _ = live
                    .conn
                    .object_server()
                    .remove::<SessionObject, _>(session_path(&id))
                    .await;
            }
        }
        let _ = self.figures_changed(live).await;
    }
}

/// Exports session `id` (if it is still alive); a second export of the same id is a no-op.
async fn add_session(
    conn: &zbus::Connection,
    core: &Arc<Core>,
    exported: &Mutex<HashSet<String>>,
    id: String,
) {
    let Some(s) = core.sessions().into_iter().find(|s| s.id == id) else {
        return;
    };
    let path = session_path(&id);
    match conn
        .object_server()
        .at(path, SessionObject::new(core.clone(), s))
        .await
    {
        Ok(_) => {
            exported.lock().unwrap().insert(id);
        }
        Err(e) => {
            tracing::warn!(session = %id, error = %e, "exporting the session object failed")
        }
    }
}
