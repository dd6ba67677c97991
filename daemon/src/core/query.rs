//! `Complete` and `Help` over Varlink: the checks of the caller's parameters, then the
//! session's answer (see `crate::session::query`).

use super::Core;
use crate::auth::Action;
use crate::identity::Caller;
use crate::session::InspectRefused;
use crate::session::query::{Answer, Query};
use sandcell_proto::kernel::KernelError;
use sandcell_proto::query::{self, CompleteParams, CompleteReply, HelpParams, HelpReply};

impl Core {
    /// The matches at the cursor of `p.code` in `p.session` (`Complete`).
    ///
    /// Errors: `LimitExceeded` (`max_source_bytes`: the code), `InvalidParameter` (`cursor`
    /// past the code's end), `NoSuchSession`, `PermissionDenied` (`org.sandcell.execute`: a
    /// completion runs the session's code), `SessionBusy` (a cell runs), `WorkerFailed` (the
    /// worker broke the protocol or did not answer; the session ended).
    pub async fn complete(
        &self,
        caller: &Caller,
        p: CompleteParams,
    ) -> Result<CompleteReply, KernelError> {
        let cursor = self.query_cursor(&p.code, p.cursor)?;
        let q = Query::Complete {
            code: p.code,
            cursor,
        };
        match self.ask(caller, &p.session, q).await? {
            Answer::Completions(r) => Ok(r),
            Answer::Help(_) => Err(KernelError::WorkerFailed {
                reason: "Complete: the worker answered something else".into(),
            }),
        }
    }

    /// Help for the name at the cursor of `p.code` in `p.session` (`Help`).
    ///
    /// Errors: as [`Core::complete`], and `InvalidParameter` (`detail` above
    /// [`query::HELP_MAX_DETAIL`]).
    pub async fn help(&self, caller: &Caller, p: HelpParams) -> Result<HelpReply, KernelError> {
        let cursor = self.query_cursor(&p.code, p.cursor)?;
        let detail = p.detail.unwrap_or(0);
        if detail > query::HELP_MAX_DETAIL {
            return Err(KernelError::InvalidParameter {
                parameter: "detail".into(),
                reason: format!("must be 0 to {}", query::HELP_MAX_DETAIL),
            });
        }
        let q = Query::Help {
            code: p.code,
            cursor,
            detail,
        };
        match self.ask(caller, &p.session, q).await? {
            Answer::Help(r) => Ok(r),
            Answer::Completions(_) => Err(KernelError::WorkerFailed {
                reason: "Help: the worker answered something else".into(),
            }),
        }
    }

    /// The cursor of a query: `code` within `max_source_bytes`, `cursor` at most its length
    /// in characters (absent: the end).
    fn query_cursor(&self, code: &str, cursor: Option<u64>) -> Result<u64, KernelError> {
        self.check_source(code)?;
        let len = query::char_len(code);
        match cursor {
            None => Ok(len),
            Some(c) if c <= len => Ok(c),
            Some(c) => Err(KernelError::InvalidParameter {
                parameter: "cursor".into(),
                reason: format!("{c} is past the code's {len} characters"),
            }),
        }
    }

    async fn ask(&self, caller: &Caller, session: &str, q: Query) -> Result<Answer, KernelError> {
        let what = match q {
            Query::Complete { .. } => "Complete",
            Query::Help { .. } => "Help",
        };
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        s.query(q).await.map_err(|e| refused(what, session, e))
    }
}

/// The Varlink error of a refused `what` (`Inspect`, `Complete`, `Help`) of `session`: a
/// running cell is `SessionBusy`, an ended session `NoSuchSession`, a worker that failed to
/// answer `WorkerFailed` (the session ended with it).
pub(super) fn refused(what: &str, session: &str, e: InspectRefused) -> KernelError {
    match e {
        InspectRefused::Busy(cell) => KernelError::SessionBusy {
            session: session.into(),
            cell,
        },
        InspectRefused::Ended => KernelError::NoSuchSession {
            session: session.into(),
        },
        InspectRefused::Failed(reason) => KernelError::WorkerFailed {
            reason: format!("{what}: {reason}; the session ended"),
        },
    }
}
