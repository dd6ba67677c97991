//! The one place where sandcellctl's failures become what a person or a program reads, and an
//! exit status: [`Failure`] gathers the Varlink client's errors and the D-Bus commands'
//! errors; [`fail`] prints one escaped sentence (`sandcellctl: ...`) or, with `--json`, one
//! JSON object on standard error.
//!
//! Exit status: 3 when the daemon refused the call with a named error (Varlink or D-Bus), 2
//! for everything else (a local file, the socket or the bus unreachable, the protocol).

use crate::dbus;
use crate::out::escape_message;
use sandcell_client::Error;
use std::process::ExitCode;

/// A failure of a command.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// From the Varlink socket (org.sandcell.Kernel) or a local file.
    #[error(transparent)]
    Kernel(#[from] Error),
    /// From the system bus (org.sandcell.Sandcell1).
    #[error(transparent)]
    Bus(#[from] dbus::Error),
}

impl Failure {
    /// The exit status for this failure: 3 for a daemon's refusal, 2 otherwise.
    pub fn exit_status(&self) -> u8 {
        match self {
            Failure::Kernel(Error::Kernel(_)) | Failure::Bus(dbus::Error::Refused { .. }) => 3,
            _ => 2,
        }
    }

    /// The failure as one JSON object, `{"error": NAME, "message": SENTENCE, ...}`: a Varlink
    /// error with its `parameters` ([`Error::to_json`]); a D-Bus refusal with its D-Bus
    /// error name; an unreachable bus as `sandcell.client.BusUnreachable`.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Failure::Kernel(e) => e.to_json(),
            Failure::Bus(dbus::Error::Refused { name, message }) => {
                serde_json::json!({"error": name, "message": message})
            }
            Failure::Bus(b @ dbus::Error::Bus(_)) => serde_json::json!({
                "error": "sandcell.client.BusUnreachable",
                "message": b.to_string(),
            }),
        }
    }

    /// The failure as one line for a person, `sandcellctl: ...` without the newline: a Varlink
    /// refusal led by the error's short name as org.sandcell.Kernel(7) lists it
    /// (`sandcellctl: LimitExceeded: ...`), a D-Bus refusal by its full name; escaped whether
    /// or not standard error is a terminal (the daemon's strings may carry a cell's or a
    /// caller's text).
    pub fn human(&self) -> String {
        match self {
            Failure::Kernel(e @ Error::Kernel(k)) => {
                let name = k.name();
                let short = name.rsplit('.').next().unwrap_or_default();
                format!("sandcellctl: {short}: {}", escape_message(&e.to_string()))
            }
            other => format!("sandcellctl: {}", escape_message(&other.to_string())),
        }
    }
}

/// Reports `e` on standard error, as one human sentence or with `json` as one JSON object,
/// and returns its exit status ([`Failure::exit_status`]).
pub fn fail(e: impl Into<Failure>, json: bool) -> ExitCode {
    let e = e.into();
    if json {
        errln!("{}", e.to_json());
    } else {
        errln!("{}", e.human());
    }
    ExitCode::from(e.exit_status())
}
