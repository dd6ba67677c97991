//! Ctrl-C (SIGINT) while `sandcellctl run` or `exec` follows a cell: the first one interrupts
//! the cell (an `Interrupt` call over a second connection) and keeps following it, so its
//! result, normally `interrupted`, is printed and the session is free for the next cell. A
//! second one, or a cell that has not ended [`INTERRUPT_WAIT`] after the first, ends
//! sandcellctl with status 130 (128 + SIGINT) at once, and what that does to the cell depends
//! on whose session it runs in ([`Leaving`]): a `run`'s session belongs to sandcellctl's
//! connection and ends with it, the cell with it (the daemon ends a connection's sessions when
//! the connection closes); an `exec`'s session is detached, so the cell runs on without a
//! client (unless sandcelld.toml sets `interrupt_on_hangup`) and `attach` follows it again.

use crate::out::{escape_message, escape_name};
use sandcell_client::Client;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the first Ctrl-C waits for the interrupted cell's result before giving up on it.
pub const INTERRUPT_WAIT: Duration = Duration::from_secs(10);

/// Exit status after giving up on the cell: 128 + SIGINT, as a shell reports a command ended
/// by Ctrl-C.
pub const DETACHED: i32 = 130;

/// What ending sandcellctl does to the cell it follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaving {
    /// `run`: the session is the connection's own (a one-shot `Run`, or the session `run
    /// --put`/`--artifacts` opens), so it ends when sandcellctl does, and the cell with it.
    EndsCell,
    /// `exec` in a detached session: the cell goes on without a client.
    CellRunsOn,
}

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
/// sandcellctl) and returns the record the caller fills from the `started` frame; `leaving`
/// says what ending sandcellctl does to the cell, which the messages tell the user. Errors
/// installing the handler leave the default action (Ctrl-C ends sandcellctl).
pub fn install(socket: PathBuf, leaving: Leaving) -> Following {
    let following = Following::default();
    let f = following.clone();
    let Ok(mut sig) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
    else {
        return following;
    };
    tokio::spawn(async move {
        sig.recv().await;
        let Some((session, cell)) = f.get() else {
            errln!("{}", before_start(leaving));
            std::process::exit(DETACHED);
        };
        let shown = escape_name(&session);
        let again = match leaving {
            Leaving::EndsCell => "Ctrl-C again to stop it at once",
            Leaving::CellRunsOn => "Ctrl-C again to detach",
        };
        errln!("sandcellctl: interrupting cell {cell} of session {shown} ({again})");
        let sent = async {
            let mut c = Client::connect(&socket).await?;
            c.interrupt(&session, cell).await
        };
        match tokio::time::timeout(INTERRUPT_WAIT, sent).await {
            Ok(Ok(r)) if !r.delivered => {
                errln!(
                    "sandcellctl: interrupt not delivered: {}",
                    escape_message(&r.reason)
                );
            }
            Ok(Err(e)) => {
                errln!(
                    "sandcellctl: interrupt failed: {}",
                    escape_message(&e.to_string())
                );
            }
            _ => {}
        }
        let why = tokio::select! {
            _ = sig.recv() => None,
            () = tokio::time::sleep(INTERRUPT_WAIT) => Some(INTERRUPT_WAIT),
        };
        errln!("{}", giving_up(leaving, &shown, cell, why));
        std::process::exit(DETACHED);
    });
    following
}

/// The line for a Ctrl-C before the `started` frame.
fn before_start(leaving: Leaving) -> &'static str {
    match leaving {
        Leaving::EndsCell => "sandcellctl: cancelled before the cell started",
        // The Execute call may already be with the daemon, and a detached session's cell
        // does not need its client.
        Leaving::CellRunsOn => {
            "sandcellctl: detached before the cell started; it may run all the same (sandcellctl list --own shows it)"
        }
    }
}

/// The line sandcellctl ends with after a second Ctrl-C (`waited` `None`), or after the
/// interrupted cell has not ended within `waited`; `session` escaped already.
fn giving_up(leaving: Leaving, session: &str, cell: u64, waited: Option<Duration>) -> String {
    let lead = match waited {
        None => "sandcellctl: ".to_owned(),
        Some(w) => format!(
            "sandcellctl: cell {cell} did not end within {} s of the interrupt; ",
            w.as_secs()
        ),
    };
    match leaving {
        Leaving::EndsCell => format!(
            "{lead}stopped; session {session} ends with sandcellctl's connection, and cell {cell} with it"
        ),
        Leaving::CellRunsOn => format!(
            "{lead}detached; cell {cell} of session {session} runs on without sandcellctl \
             (interrupted instead where sandcelld.toml sets interrupt_on_hangup); the \
             interrupt is sent, and a cell that ignores it has its worker killed after the \
             grace, which ends the session; follow it again with: sandcellctl attach \
             {session} {cell}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{Leaving, giving_up};
    use std::time::Duration;

    #[test]
    fn the_last_line_says_what_happens_to_the_cell() {
        let run = giving_up(Leaving::EndsCell, "s1", 1, None);
        assert_eq!(
            run,
            "sandcellctl: stopped; session s1 ends with sandcellctl's connection, and cell 1 with it"
        );
        let exec = giving_up(Leaving::CellRunsOn, "s1", 2, Some(Duration::from_secs(10)));
        assert!(
            exec.starts_with(
                "sandcellctl: cell 2 did not end within 10 s of the interrupt; detached; cell 2 \
                 of session s1 runs on"
            ),
            "{exec}"
        );
        assert!(exec.ends_with("sandcellctl attach s1 2"), "{exec}");
        // The user learns a cell that ignores the interrupt costs the session.
        assert!(
            exec.contains("worker killed") && exec.contains("ends the session"),
            "{exec}"
        );
    }
}
