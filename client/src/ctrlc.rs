//! Ctrl-C (SIGINT) while `sandcellctl run` or `exec` follows a cell: the first one interrupts
//! the cell (an `Interrupt` call over a second connection) and keeps following it, so its
//! result, normally `interrupted`, is printed and the session is free for the next cell; a
//! second one, or a cell that has not ended [`INTERRUPT_WAIT`] after the first, detaches:
//! sandcellctl exits with status 130 (128 + SIGINT) at once.

use crate::escape_name;
use sandcell_client::Client;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the first Ctrl-C waits for the interrupted cell's result before detaching.
pub const INTERRUPT_WAIT: Duration = Duration::from_secs(10);

/// Exit status after detaching: 128 + SIGINT, as a shell reports a command ended by Ctrl-C.
pub const DETACHED: i32 = 130;

/// The cell being followed, as its `started` frame names it; shared with the signal task.
#[derive(Clone, Default)]
pub struct Following(Arc<Mutex<Option<(String, u64)>>>);

impl Following {
    /// Records the session and cell of a `started` frame.
    pub fn started(&self, session: &str, cell: u64) {
        *self.0.lock().expect("not poisoned") = Some((session.to_owned(), cell));
    }

    fn get(&self) -> Option<(String, u64)> {
        self.0.lock().expect("not poisoned").clone()
    }
}

/// Takes over SIGINT for the rest of the process (from now on Ctrl-C no longer kills
/// sandcellctl) and returns the record the caller fills from the `started` frame. Errors
/// installing the handler leave the default action (Ctrl-C ends sandcellctl).
pub fn install(socket: PathBuf) -> Following {
    let following = Following::default();
    let f = following.clone();
    let Ok(mut sig) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
    else {
        return following;
    };
    tokio::spawn(async move {
        sig.recv().await;
        let Some((session, cell)) = f.get() else {
            errln!("sandcellctl: cancelled before the cell started");
            std::process::exit(DETACHED);
        };
        let shown = escape_name(&session);
        errln!("sandcellctl: interrupting cell {cell} of session {shown} (Ctrl-C again to detach)");
        let sent = async {
            let mut c = Client::connect(&socket).await?;
            c.interrupt(&session, cell).await
        };
        match tokio::time::timeout(INTERRUPT_WAIT, sent).await {
            Ok(Ok(r)) if !r.delivered => {
                errln!(
                    "sandcellctl: interrupt not delivered: {}",
                    crate::escape_message(&r.reason)
                );
            }
            Ok(Err(e)) => {
                errln!(
                    "sandcellctl: interrupt failed: {}",
                    crate::escape_message(&e.to_string())
                );
            }
            _ => {}
        }
        tokio::select! {
            _ = sig.recv() => {
                errln!(
                    "sandcellctl: detached; cell {cell} of session {shown} may still be running"
                );
            }
            () = tokio::time::sleep(INTERRUPT_WAIT) => {
                errln!(
                    "sandcellctl: cell {cell} did not end within {} s of the interrupt; detached",
                    INTERRUPT_WAIT.as_secs()
                );
            }
        }
        std::process::exit(DETACHED);
    });
    following
}
