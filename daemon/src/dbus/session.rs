//! `org.sandcell.Session1` at `/org/sandcell/Sandcell1/session/<id>`: one object per live
//! session, exported when it opens and removed when it has released everything.
//!
//! Its properties (owner uid and pid, state, memory, ...) are read only by the session's
//! owner, root, and holders of `org.sandcell.manage-sessions` (asked without prompting);
//! anyone else gets `org.freedesktop.DBus.Error.AccessDenied`, and the refusal is logged.

use super::manager::usec;
use super::{Error, caller};
use crate::auth::Action;
use crate::core::Core;
use crate::session::Session;
use std::sync::Arc;

/// One session's object.
#[derive(Debug)]
pub struct SessionObject {
    core: Arc<Core>,
    session: Arc<Session>,
}

impl SessionObject {
    /// The object of `session`.
    pub fn new(core: Arc<Core>, session: Arc<Session>) -> Self {
        SessionObject { core, session }
    }

    /// Whether the sender of `header` may read this session's properties: its owner, root,
    /// or a holder of manage-sessions. No header: the daemon itself (PropertiesChanged).
    ///
    /// Errors: `AccessDenied` for anyone else, `Failed` when the sender is unknown.
    async fn visible(
        &self,
        conn: &zbus::Connection,
        header: Option<&zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<()> {
        let Some(header) = header else {
            return Ok(());
        };
        let mut who = caller(conn, header)
            .await
            .map_err(|e| zbus::fdo::Error::Failed(format!("{e:?}")))?;
        if who.uid == 0 || who.uid == self.session.owner.uid {
            return Ok(());
        }
        if let crate::identity::Subject::BusName { interactive, .. } = &mut who.subject {
            *interactive = false;
        }
        match self.core.authorize(&who, Action::ManageAll).await {
            Ok(()) => Ok(()),
            Err(_) => {
                tracing::warn!(
                    uid = who.uid,
                    pid = who.pid,
                    session = %self.session.id,
                    action = Action::ManageAll.id(),
                    "D-Bus: session properties refused to a caller who is not the owner"
                );
                Err(zbus::fdo::Error::AccessDenied(format!(
                    "session {} belongs to another user (reading it needs {})",
                    self.session.id,
                    Action::ManageAll.id()
                )))
            }
        }
    }
}

#[zbus::interface(name = "org.sandcell.Session1")]
impl SessionObject {
    /// Ends the session (as Manager1.TerminateSession).
    async fn terminate(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
    ) -> Result<(), Error> {
        let who = caller(conn, &header).await?;
        Ok(self.core.terminate(&who, &self.session.id).await?)
    }

    /// Interrupts the running cell (as Manager1.InterruptSession).
    #[zbus(out_args("delivered", "reason"))]
    async fn interrupt(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
    ) -> Result<(bool, String), Error> {
        let who = caller(conn, &header).await?;
        let r = self.core.interrupt_running(&who, &self.session.id).await?;
        Ok((r.delivered, r.reason))
    }

    /// Session id (32 lowercase hex characters).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn id(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<String> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.core.public_id(&self.session.id))
    }

    /// `python` or `r`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn language(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<String> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.language.as_str().to_string())
    }

    /// uid of the client that opened the session.
    #[zbus(property(emits_changed_signal = "const"), name = "OwnerUID")]
    async fn owner_uid(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u32> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.owner.uid)
    }

    /// pid of the client that opened the session (at connect time).
    #[zbus(property(emits_changed_signal = "const"), name = "OwnerPID")]
    async fn owner_pid(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u32> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.owner.pid)
    }

    /// pid of the worker process.
    #[zbus(property(emits_changed_signal = "const"), name = "WorkerPID")]
    async fn worker_pid(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u32> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.pid)
    }

    /// Engine reported by the worker (e.g. Eryx and CPython versions).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn engine(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<String> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.engine.clone())
    }

    /// Opened at, µs since the Unix epoch.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn started(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u64> {
        self.visible(conn, header.as_ref()).await?;
        Ok(usec(self.session.started))
    }

    /// Idle lifetime of a detached session in seconds; 0 if it ends with its connection.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn detached_idle_seconds(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u64> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.detached_idle.map(|d| d.as_secs()).unwrap_or(0))
    }

    /// `starting`, `idle`, `running` or `ended`.
    #[zbus(property)]
    async fn state(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<String> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.info.lock().unwrap().state.to_string())
    }

    /// Cells finished.
    #[zbus(property)]
    async fn cells_run(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u64> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.info.lock().unwrap().cells_run)
    }

    /// Cell running now; 0 when none.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn running_cell(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u64> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.info.lock().unwrap().running_cell.unwrap_or(0))
    }

    /// The session's egress through the proxy, as last asked (every 2 seconds): `allowed` and
    /// `refused` requests, `bytes` relayed (both directions) and `connections` accepted;
    /// empty when the session has no egress grant.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn egress(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<std::collections::HashMap<String, u64>> {
        self.visible(conn, header.as_ref()).await?;
        Ok(crate::egress::counts(&self.session.id)
            .map(|c| {
                [
                    ("allowed", c.allowed),
                    ("refused", c.refused),
                    ("bytes", c.bytes),
                    ("connections", c.connections),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect()
            })
            .unwrap_or_default())
    }

    /// Memory charged to the worker's cgroup now, bytes; 2^64-1 when unknown (no cgroup).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory_current(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: Option<zbus::message::Header<'_>>,
    ) -> zbus::fdo::Result<u64> {
        self.visible(conn, header.as_ref()).await?;
        Ok(self.session.memory_current().unwrap_or(u64::MAX))
    }
}
