//! `org.sandcell.Manager1` at `/org/sandcell/Sandcell1`: list, inspect, terminate and
//! interrupt sessions, reload the configuration, live figures and session signals.
//!
//! Every method goes through the core (validate -> look up -> authorize -> act). Listing
//! shows a caller its own sessions, and everyone's with `org.sandcell.manage-sessions`.
//! Session ids are not capabilities (every action checks the owner and asks polkit), and
//! they are not secret either: session object paths appear in introspection and in the
//! broadcast `SessionOpened` signal, as machined's machines do.

use super::{Error, Settings, caller, check_id, session_path};
use crate::auth::Action;
use crate::core::Core;
use std::sync::Arc;
use std::time::UNIX_EPOCH;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::OwnedObjectPath;

/// One row of `ListSessions` ([`sandcell_proto::dbus::SessionRow`]).
pub type SessionRow = sandcell_proto::dbus::SessionRow<OwnedObjectPath>;

pub use sandcell_proto::dbus::{AdmissionRow, PackageSourceRow, PoolRow};

/// One row of the `Environments` property: name, language, engine, default, interpreter
/// version, ready, reason (empty when ready), packages as (name, version) pairs.
pub type EnvironmentRow = (
    String,
    String,
    String,
    bool,
    String,
    bool,
    String,
    Vec<(String, String)>,
);

/// The manager object.
#[derive(Debug)]
pub struct Manager {
    core: Arc<Core>,
    settings: Arc<Settings>,
}

impl Manager {
    /// A manager over `core`.
    pub fn new(core: Arc<Core>, settings: Arc<Settings>) -> Self {
        Manager { core, settings }
    }
}

/// Microseconds since the Unix epoch.
pub(crate) fn usec(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The rows of `ListSessions` for sessions of `uid` (all when `None`), by start time.
pub(crate) fn rows(core: &Core, uid: Option<u32>) -> Vec<SessionRow> {
    let mut sessions = core.sessions();
    sessions.retain(|s| uid.is_none_or(|u| s.owner.uid == u));
    sessions.sort_by_key(|s| s.started);
    sessions
        .iter()
        .map(|s| {
            let info = s.info.lock().unwrap().clone();
            (
                core.public_id(&s.id),
                s.language.as_str().to_string(),
                s.owner.uid,
                s.owner.pid,
                info.state.to_string(),
                usec(s.started),
                info.cells_run,
                s.memory_current().unwrap_or(u64::MAX),
                session_path(&s.id),
            )
        })
        .chain(
            // Workers still starting for a client: listed so that they can be terminated.
            core.starting_sessions()
                .into_iter()
                .filter(|s| uid.is_none_or(|u| s.uid == u))
                .map(|s| {
                    (
                        core.public_id(&s.id),
                        s.language.as_str().to_string(),
                        s.uid,
                        s.pid,
                        "starting".to_string(),
                        usec(s.since),
                        0,
                        u64::MAX,
                        session_path(&s.id),
                    )
                }),
        )
        .collect()
}

impl Manager {
    /// Whose sessions the caller may see: `None` (everyone's) with manage-sessions, else the
    /// caller's uid. Never prompts: listing is not worth a password.
    async fn lister(
        &self,
        conn: &zbus::Connection,
        header: &zbus::message::Header<'_>,
    ) -> Result<Option<u32>, Error> {
        let mut who = caller(conn, header).await?;
        if let crate::identity::Subject::BusName { interactive, .. } = &mut who.subject {
            *interactive = false;
        }
        Ok(match self.core.authorize(&who, Action::ManageAll).await {
            Ok(()) => None,
            Err(_) => Some(who.uid),
        })
    }
}

#[zbus::interface(name = "org.sandcell.Manager1")]
impl Manager {
    /// Live sessions: (id, language, owner uid, owner pid, state, started µs since the epoch,
    /// cells run, memory in use in bytes or 2^64-1 if unknown, object path). The caller's
    /// own sessions; everyone's with org.sandcell.manage-sessions (asked without prompting).
    #[zbus(out_args("sessions"))]
    async fn list_sessions(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
    ) -> Result<Vec<SessionRow>, Error> {
        let who = self.lister(conn, &header).await?;
        Ok(rows(&self.core, who))
    }

    /// Object path of session `id`, visible as in ListSessions.
    /// Errors: NoSuchSession, InvalidParameter.
    #[zbus(out_args("path"))]
    async fn get_session(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        id: &str,
    ) -> Result<OwnedObjectPath, Error> {
        check_id(id)?;
        let local = self.core.resolve(id)?;
        let who = self.lister(conn, &header).await?;
        if rows(&self.core, who)
            .iter()
            .any(|r| r.8 == session_path(local))
        {
            Ok(session_path(local))
        } else {
            Err(Error::NoSuchSession(format!("no session {id}")))
        }
    }

    /// Ends session `id` (kill, reap, release); returns when everything is released.
    /// Needs org.sandcell.manage-own-sessions for one's own session, org.sandcell.manage-sessions
    /// for another uid's. Errors: NoSuchSession, PermissionDenied, InvalidParameter.
    async fn terminate_session(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        id: &str,
    ) -> Result<(), Error> {
        check_id(id)?;
        let who = caller(conn, &header).await?;
        Ok(self.core.terminate(&who, id).await?)
    }

    /// Interrupts the cell session `id` is running (SIGINT; the session keeps its state).
    /// `delivered` is false with `reason` `not_running` when no cell runs, or
    /// `session_ending`. Same authorization as TerminateSession.
    #[zbus(out_args("delivered", "reason"))]
    async fn interrupt_session(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        id: &str,
    ) -> Result<(bool, String), Error> {
        check_id(id)?;
        let who = caller(conn, &header).await?;
        let r = self.core.interrupt_running(&who, id).await?;
        Ok((r.delivered, r.reason))
    }

    /// Re-reads the configuration file the daemon was started with (and its SANDCELL_*
    /// environment); new limits apply to sessions opened from now on. An invalid file is
    /// refused with InvalidConfig and the previous configuration stays in force. The same
    /// path as SIGHUP; either way `Admission` and `Pools` then change (PropertiesChanged).
    /// Needs org.sandcell.reload.
    async fn reload(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
    ) -> Result<(), Error> {
        let who = caller(conn, &header).await?;
        self.core.authorize(&who, Action::Reload).await?;
        self.core
            .reload_from(
                &self.settings.config_path,
                self.settings.config_required,
                &format!("D-Bus Reload by uid {}", who.uid),
            )
            .map_err(|e| {
                Error::InvalidConfig(format!("{e}; the previous configuration stays in force"))
            })?;
        Ok(())
    }

    /// Sessions alive now.
    #[zbus(property)]
    async fn active_sessions(&self) -> u32 {
        self.core.sessions().len() as u32
    }

    /// Admission use against each budget: (budget, in use, maximum); sessions are counted,
    /// memories are bytes. Idle pooled workers are charged like sessions.
    #[zbus(property)]
    async fn admission(&self) -> Vec<AdmissionRow> {
        let (max, used) = self.core.admission();
        vec![
            (
                "max_concurrent_sessions".into(),
                used.sessions,
                max.sessions,
            ),
            (
                "max_aggregate_guest_memory_bytes".into(),
                used.guest_memory,
                max.guest_memory,
            ),
            (
                "max_aggregate_worker_memory_bytes".into(),
                used.worker_memory,
                max.worker_memory,
            ),
        ]
    }

    /// Per-uid admission: (uid, budget, in use, maximum) for `max_sessions_per_uid`,
    /// `max_detached_sessions_per_uid` (sessions) and `max_guest_memory_bytes_per_uid`,
    /// `max_worker_memory_bytes_per_uid` (bytes). Root and holders of
    /// org.sandcell.manage-sessions (asked without prompting) see every uid holding sessions;
    /// anyone else sees only their own uid (with 0 in use when they hold none), since which
    /// uids use the service and how much is not theirs to know. Computed per caller, so no
    /// PropertiesChanged is emitted for it: read it when needed.
    #[zbus(property(emits_changed_signal = "false"), name = "UidAdmission")]
    async fn uid_admission(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> Result<Vec<(u32, String, u64, u64)>, zbus::fdo::Error> {
        // The daemon itself (no caller): nothing to show.
        let Some(h) = header else {
            return Ok(Vec::new());
        };
        let mut who = caller(conn, &h)
            .await
            .map_err(|e| zbus::fdo::Error::Failed(format!("{e:?}")))?;
        if let crate::identity::Subject::BusName { interactive, .. } = &mut who.subject {
            *interactive = false;
        }
        let only = if who.uid == 0 || self.core.authorize(&who, Action::ManageAll).await.is_ok() {
            None
        } else {
            Some(who.uid)
        };
        let (max, mut used) = self.core.uid_admission();
        if let Some(uid) = only {
            used.retain(|(u, _)| *u == uid);
            if used.is_empty() {
                used.push((uid, Default::default()));
            }
        }
        let mut rows = Vec::with_capacity(used.len() * 4);
        for (uid, u) in used {
            rows.push((uid, "max_sessions_per_uid".into(), u.sessions, max.sessions));
            rows.push((
                uid,
                "max_detached_sessions_per_uid".into(),
                u.detached,
                max.detached,
            ));
            rows.push((
                uid,
                "max_guest_memory_bytes_per_uid".into(),
                u.guest_memory,
                max.guest_memory,
            ));
            rows.push((
                uid,
                "max_worker_memory_bytes_per_uid".into(),
                u.worker_memory,
                max.worker_memory,
            ));
        }
        Ok(rows)
    }

    /// Warm worker pools, one row per environment (`pydata`, `python`, `r`, and any the
    /// operator declares), whether or not it is served: (environment, idle workers now,
    /// target now, configured minimum, configured maximum, workers taken from the pool since
    /// the daemon started, opens that found no idle worker while the environment had a
    /// pool). The four numbers after the name count workers; the target is the minimum, or
    /// the maximum while workers are being taken; minimum and maximum are those the refill
    /// task last applied (0 for an environment not served). PropertiesChanged follows a
    /// change within about a second (the pools are compared once a second).
    #[zbus(property)]
    async fn pools(&self) -> Vec<PoolRow> {
        self.core.pool().rows(&self.core.config())
    }

    /// The package sources sessions install from, one row per source of each environment
    /// served, from the configuration (no probe runs): (environment, kind (`wheelhouse` or
    /// `cran_repository`), packages offered, installs checked against a hash manifest, package
    /// names in name order, at most 500; empty when the source cannot be read now). Never a
    /// host path.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn package_sources(&self) -> Vec<PackageSourceRow> {
        let config = self.core.config();
        config
            .environments()
            .iter()
            .flat_map(|e| {
                e.package_source.iter().map(|src| {
                    let inv = src.inventory();
                    (
                        e.name.clone(),
                        inv.kind,
                        inv.packages,
                        inv.hash_manifest,
                        inv.names,
                    )
                })
            })
            .collect()
    }

    /// The environments served, as Varlink `ListEnvironments` reports them: (name, language,
    /// engine, default, interpreter version, ready, reason (empty when ready), packages as
    /// (name, version) pairs in name order, at most 500). Reading it may run the confined
    /// check of an environment not checked yet (one short one-shot session each).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn environments(&self) -> Vec<EnvironmentRow> {
        self.core
            .list_environments()
            .await
            .into_iter()
            .map(|e| {
                (
                    e.name,
                    e.language,
                    e.engine,
                    e.default,
                    e.interpreter_version,
                    e.ready,
                    e.reason.unwrap_or_default(),
                    e.packages
                        .into_iter()
                        .map(|p| (p.name, p.version))
                        .collect(),
                )
            })
            .collect()
    }

    /// sandcelld's version.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

    /// Landlock ABI of the running kernel (0: Landlock unavailable).
    #[zbus(property(emits_changed_signal = "const"), name = "LandlockABI")]
    async fn landlock_abi(&self) -> i32 {
        sandcell_confine::landlock::kernel_abi().unwrap_or(0)
    }

    /// cgroup mode in use: `v2`, `v1` or `none` (development mode).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn cgroup_mode(&self) -> String {
        self.core.cgroup_mode().to_string()
    }

    /// The confinement decided at start: `enforcement`, `kernel`, `kernel-landlock-abi`,
    /// `landlock-abi` (applied by workers), `cgroups`, `strict`, `layer.<name>` (`active`,
    /// `substituted`, `missing`) and `threat.<name>` (the active layers that stop it, joined
    /// by `+`). Empty before the decision is made. Also `egress`: `not configured` (no
    /// environment has egress), `available`, or `unavailable: <reason>` (the service's
    /// sandbox lacks what egress needs; the reason names the drop-in that adds it).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn confinement(&self) -> std::collections::HashMap<String, String> {
        let mut map: std::collections::HashMap<String, String> =
            crate::worker::spawn::confinement()
                .map(|c| c.map().into_iter().collect())
                .unwrap_or_default();
        if !map.is_empty() {
            let egress = if self
                .core
                .config()
                .environments()
                .iter()
                .all(|e| e.egress.is_none())
            {
                "not configured".to_string()
            } else {
                match crate::egress::availability() {
                    Ok(()) => "available".to_string(),
                    Err(u) => format!("unavailable: {}", u.detail),
                }
            };
            map.insert("egress".into(), egress);
        }
        map
    }

    /// A session is ready: id, owner uid, language, object path.
    #[zbus(signal)]
    pub async fn session_opened(
        emitter: &SignalEmitter<'_>,
        id: &str,
        uid: u32,
        language: &str,
        path: OwnedObjectPath,
    ) -> zbus::Result<()>;

    /// A session ended and everything it held is released: id, reason.
    #[zbus(signal)]
    pub async fn session_closed(
        emitter: &SignalEmitter<'_>,
        id: &str,
        reason: &str,
    ) -> zbus::Result<()>;

    /// A cell finished: session id, cell number, status (`ok`, `error`, `timeout`, ...).
    #[zbus(signal)]
    pub async fn cell_finished(
        emitter: &SignalEmitter<'_>,
        id: &str,
        cell: u64,
        status: &str,
    ) -> zbus::Result<()>;

    /// The kernel OOM-killed the worker of session `id` (its cgroup's memory limit).
    #[zbus(signal, name = "WorkerOOMKilled")]
    pub async fn worker_oom_killed(emitter: &SignalEmitter<'_>, id: &str) -> zbus::Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use zbus::zvariant::Type;

    const XML: &str = include_str!("../../../dbus/org.sandcell.Manager1.xml");

    /// The row types (defined once, in `sandcell_proto::dbus`) have the signatures the shipped
    /// introspection XML declares.
    #[test]
    fn row_signatures_match_the_introspection_xml() {
        for (sig, what) in [
            (<Vec<SessionRow>>::SIGNATURE.to_string(), "ListSessions"),
            (<Vec<PoolRow>>::SIGNATURE.to_string(), "Pools"),
            (<Vec<AdmissionRow>>::SIGNATURE.to_string(), "Admission"),
        ] {
            assert!(
                XML.contains(&format!("type=\"{sig}\"")),
                "{what}: {sig} is not in org.sandcell.Manager1.xml"
            );
        }
    }
}
