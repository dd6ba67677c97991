//! `org.sandcell.Session1` at `/org/sandcell/Sandcell1/session/<id>`: one object per live
//! session, exported when it opens and removed when it has released everything.

use super::manager::usec;
use super::{Error, caller};
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
    async fn id(&self) -> String {
        self.session.id.clone()
    }

    /// `python` or `r`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn language(&self) -> String {
        self.session.language.as_str().to_string()
    }

    /// uid of the client that opened the session.
    #[zbus(property(emits_changed_signal = "const"), name = "OwnerUID")]
    async fn owner_uid(&self) -> u32 {
        self.session.owner.uid
    }

    /// pid of the client that opened the session (at connect time).
    #[zbus(property(emits_changed_signal = "const"), name = "OwnerPID")]
    async fn owner_pid(&self) -> u32 {
        self.session.owner.pid
    }

    /// pid of the worker process.
    #[zbus(property(emits_changed_signal = "const"), name = "WorkerPID")]
    async fn worker_pid(&self) -> u32 {
        self.session.pid
    }

    /// Engine reported by the worker (e.g. Eryx and CPython versions).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn engine(&self) -> String {
        self.session.engine.clone()
    }

    /// Opened at, µs since the Unix epoch.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn started(&self) -> u64 {
        usec(self.session.started)
    }

    /// Idle lifetime of a detached session in seconds; 0 if it ends with its connection.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn detached_idle_seconds(&self) -> u64 {
        self.session.detached_idle.map(|d| d.as_secs()).unwrap_or(0)
    }

    /// `starting`, `idle`, `running` or `ended`.
    #[zbus(property)]
    async fn state(&self) -> String {
        self.session.info.lock().unwrap().state.to_string()
    }

    /// Cells finished.
    #[zbus(property)]
    async fn cells_run(&self) -> u64 {
        self.session.info.lock().unwrap().cells_run
    }

    /// Cell running now; 0 when none.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn running_cell(&self) -> u64 {
        self.session.info.lock().unwrap().running_cell.unwrap_or(0)
    }

    /// Memory charged to the worker's cgroup now, bytes; 2^64-1 when unknown (no cgroup).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory_current(&self) -> u64 {
        self.session.memory_current().unwrap_or(u64::MAX)
    }
}
