//! Authorization: the one decision path both interfaces use (validate -> look up ->
//! **authorize** -> act). The actions are the polkit actions shipped in
//! `polkit/org.sandcell.policy`.

use crate::identity::Caller;

/// Something a caller may be allowed to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Open sessions and run cells (`org.sandcell.execute`).
    Execute,
    /// Interrupt or close one's own sessions (`org.sandcell.manage-own-sessions`).
    ManageOwn,
    /// Interrupt or close any session (`org.sandcell.manage-sessions`).
    ManageAll,
    /// Reload the configuration (`org.sandcell.reload`).
    Reload,
}

impl Action {
    /// The polkit action id.
    pub fn id(self) -> &'static str {
        match self {
            Action::Execute => "org.sandcell.execute",
            Action::ManageOwn => "org.sandcell.manage-own-sessions",
            Action::ManageAll => "org.sandcell.manage-sessions",
            Action::Reload => "org.sandcell.reload",
        }
    }
}

/// Decides whether `caller` may do `action`.
pub trait Authority: Send + Sync {
    /// True when allowed. Implementations prompt only for D-Bus callers that set the
    /// allow-interactive-authorization flag; Varlink checks are never interactive.
    fn check<'a>(
        &'a self,
        caller: &'a Caller,
        action: Action,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>>;
}

/// The socket's file permissions are the only gate: whoever can connect (root and group
/// `sandcell`, socket mode 0660) may run code and manage their own sessions; managing other
/// users' sessions and reloading need root. Used only where polkit is not installed (see
/// `polkit::installed`); a host with polkit installed but not answering fails closed instead.
#[derive(Debug, Default)]
pub struct SocketPermissions;

impl Authority for SocketPermissions {
    fn check<'a>(
        &'a self,
        caller: &'a Caller,
        action: Action,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>> {
        let ok = match action {
            Action::Execute | Action::ManageOwn => true,
            Action::ManageAll | Action::Reload => caller.uid == 0,
        };
        if !ok {
            tracing::warn!(
                action = action.id(),
                uid = caller.uid,
                gid = caller.gid,
                pid = caller.pid,
                "authorization refused (socket permissions: this action needs root)"
            );
        }
        Box::pin(std::future::ready(ok))
    }
}
