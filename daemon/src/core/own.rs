//! The caller's own sessions over Varlink: `ListSessions` and `InterruptSession`, and the
//! check that an `Interrupt` names a cell the session reached.

use super::Core;
use crate::auth::Action;
use crate::identity::Caller;
use crate::session::Session;
use sandcell_proto::kernel::{
    InterruptReason, InterruptSessionReply, KernelError, ListSessionsReply, MAX_LISTED_SESSIONS,
    SessionSummary,
};
use std::time::{SystemTime, UNIX_EPOCH};

fn epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Core {
    /// The sessions whose owner has `caller`'s uid (from any of its connections), oldest
    /// first, with the workers still starting for it; at most [`MAX_LISTED_SESSIONS`]
    /// (`truncated` says more exist). Root lists its own; everyone's is D-Bus's
    /// `ListSessions`. Authorized as `Execute` (whoever may open a session may list it).
    ///
    /// Errors: `PermissionDenied`.
    pub async fn list_own_sessions(
        &self,
        caller: &Caller,
    ) -> Result<ListSessionsReply, KernelError> {
        self.authorize(caller, Action::Execute).await?;
        let mut mine: Vec<_> = self
            .sessions()
            .into_iter()
            .filter(|s| s.owner.uid == caller.uid)
            .collect();
        mine.sort_by_key(|s| s.started);
        let mut sessions: Vec<SessionSummary> = mine
            .iter()
            .map(|s| {
                let info = s.info.lock().unwrap().clone();
                SessionSummary {
                    session: self.public_id(&s.id),
                    language: s.language.as_str().into(),
                    state: info.state.to_string(),
                    running_cell: info.running_cell,
                    cells_run: info.cells_run,
                    started: epoch(s.started),
                    detached_idle_seconds: s.detached_idle.map(|d| d.as_secs()),
                    this_connection: s.owner.connection == caller.connection,
                }
            })
            .collect();
        let mut starting: Vec<_> = self
            .starting_sessions()
            .into_iter()
            .filter(|s| s.uid == caller.uid)
            .collect();
        starting.sort_by_key(|s| s.since);
        sessions.extend(starting.into_iter().map(|s| SessionSummary {
            session: self.public_id(&s.id),
            language: s.language.as_str().into(),
            state: "starting".into(),
            running_cell: None,
            cells_run: 0,
            started: epoch(s.since),
            detached_idle_seconds: None,
            this_connection: false,
        }));
        let truncated = sessions.len() > MAX_LISTED_SESSIONS;
        sessions.truncate(MAX_LISTED_SESSIONS);
        Ok(ListSessionsReply {
            sessions,
            truncated,
        })
    }

    /// Interrupts whatever cell `session` runs now (`InterruptSession`), authorized as
    /// `Interrupt` (any connection of the owner, or root). `cell` in the reply is the cell
    /// that was running; `not_running` when none was.
    ///
    /// Errors: `NoSuchSession`, `SessionEnded`, `WrongNode`, `PermissionDenied`.
    pub async fn interrupt_own_session(
        &self,
        caller: &Caller,
        session: &str,
    ) -> Result<InterruptSessionReply, KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::ManageOwn).await?;
        let running = s.info.lock().unwrap().running_cell;
        match running {
            Some(cell) => {
                let r = s.interrupt(cell).await;
                Ok(InterruptSessionReply {
                    delivered: r.delivered,
                    reason: r.reason,
                    cell: Some(cell),
                })
            }
            None => Ok(InterruptSessionReply {
                delivered: false,
                reason: InterruptReason::NotRunning.into(),
                cell: None,
            }),
        }
    }
}

/// `NoSuchCell` when `cell` is a number `s` never reached: 0, or above the newest cell
/// started (a cell's number is recorded before its `started` frame is sent, so a client never
/// holds a number above it).
pub(super) fn check_cell_reached(s: &Session, session: &str, cell: u64) -> Result<(), KernelError> {
    let newest = s.info.lock().unwrap().cells_started;
    if cell == 0 || cell > newest {
        return Err(KernelError::NoSuchCell {
            session: super::echo_id(session),
            cell,
        });
    }
    Ok(())
}
