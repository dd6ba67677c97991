//! One's own sessions over the Varlink socket: `open` (a detached session), `close`,
//! `inspect` (its variables), `interrupt` (a cell by number, or whatever the session runs:
//! over the socket first, then over D-Bus for a session the socket does not show) and
//! `list --own`.

use super::{Ctx, Outcome, admin, environments};
use crate::out::{self, escape_name};
use crate::report::Failure;
use sandcell_client::{Error, KernelError};

/// `open [-l LANGUAGE] [-e NAME] [--idle SECONDS] [--host-calls] [--no-display] [--egress HOST]...`.
#[derive(Debug, clap::Args)]
pub struct Open {
    /// python or r; default: the environment's language with --environment, else python.
    #[arg(long, short)]
    language: Option<String>,
    /// The environment (see `sandcellctl environments`); default: the language's default
    /// environment.
    #[arg(long, short, value_name = "NAME")]
    environment: Option<String>,
    /// Idle lifetime in seconds.
    #[arg(long, default_value_t = 600)]
    idle: u64,
    /// Let the session's cells call tools (answer them with `exec --host-call-handler`).
    #[arg(long)]
    host_calls: bool,
    /// No cell of the session shows its last expression's value (print()-only output).
    #[arg(long)]
    no_display: bool,
    /// Narrow the session's network to HOST, which must be on the environment's egress
    /// allowlist (a name or a `*.domain` wildcard); repeatable. Default: the whole list.
    #[arg(long = "egress", value_name = "HOST")]
    egress: Vec<String>,
}

impl Open {
    /// Opens the session and prints its id (`--json`: the whole `Open` reply).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let mut c = ctx.connect().await?;
        let language =
            environments::language(&mut c, self.language, self.environment.as_deref(), || {
                "python".into()
            })
            .await;
        let o = c
            .open_with(&sandcell_client::OpenParams {
                language,
                limits: None,
                detached_idle_seconds: Some(self.idle),
                environment: self.environment,
                host_calls: self.host_calls.then_some(true),
                display_last_expression: self.no_display.then_some(false),
                rich_output: None,
                egress: (!self.egress.is_empty()).then_some(self.egress),
            })
            .await?;
        if ctx.json {
            out::json(&o);
        } else {
            outln!("{}", o.session);
        }
        Ok(0)
    }
}

/// `close SESSION`.
#[derive(Debug, clap::Args)]
pub struct Close {
    /// Session id.
    session: String,
}

impl Close {
    /// Closes the session; one already ended is a note on standard error (`--json`: the object
    /// `{"session", "already_ended": true, "reason"}` on standard output) and status 0 (the
    /// wish is fulfilled).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let mut c = ctx.connect().await?;
        match c.close(&self.session).await {
            Ok(()) => Ok(0),
            Err(Error::Kernel(KernelError::SessionEnded { reason, .. })) => {
                if ctx.json {
                    out::json(&serde_json::json!({
                        "session": self.session,
                        "already_ended": true,
                        "reason": reason,
                    }));
                    return Ok(0);
                }
                errln!(
                    "sandcellctl: session {} had already ended ({}); nothing to close",
                    escape_name(&self.session),
                    escape_name(&reason)
                );
                Ok(0)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// `inspect SESSION [--max-items N]`.
#[derive(Debug, clap::Args)]
pub struct Inspect {
    /// Session id.
    session: String,
    /// List at most N variables (1 to 1000; the daemon's default is 100).
    #[arg(long, value_name = "N")]
    max_items: Option<u64>,
}

impl Inspect {
    /// Prints the session's variables, one a line (`--json`: `{"variables", "truncated"}`).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let mut c = ctx.connect().await?;
        let (vars, truncated) = c.inspect(&self.session, self.max_items).await?;
        if ctx.json {
            out::json(&serde_json::json!({ "variables": vars, "truncated": truncated }));
            return Ok(0);
        }
        outln!(
            "{:<20} {:<28} {:>10} {:<12} REPR",
            "NAME",
            "TYPE",
            "SIZE",
            "SHAPE"
        );
        for v in &vars {
            let shape = v
                .shape
                .as_ref()
                .map(|s| s.iter().map(u64::to_string).collect::<Vec<_>>().join("x"))
                .unwrap_or_default();
            outln!(
                "{:<20} {:<28} {:>10} {:<12} {}",
                escape_name(&v.name),
                escape_name(&v.kind),
                v.size_bytes.map(|n| n.to_string()).unwrap_or_default(),
                shape,
                escape_name(&v.repr)
            );
        }
        if truncated {
            outln!("(more variables exist than are listed)");
        }
        Ok(0)
    }
}

/// A sentence on standard error for an interrupt that was not delivered (`reason` one of
/// the protocol's `InterruptReason` strings); standard output keeps the bare reason for
/// scripts. Nothing for `delivered` or a reason this version does not know.
fn explain_undelivered(reason: &str, session: &str, cell: Option<u64>) {
    use sandcell_proto::kernel::InterruptReason as R;
    let which = cell.map_or_else(|| "the running cell".to_owned(), |n| format!("cell {n}"));
    let why = match R::parse(reason) {
        Some(R::NotRunning) => match cell {
            Some(n) => format!(
                "cell {n} of session {session:?} is not running (it finished, or never started)"
            ),
            None => format!("no cell is running in session {session:?}"),
        },
        Some(R::OtherCell) => format!(
            "{which} of session {session:?} is not the one running; nothing was interrupted"
        ),
        Some(R::AlreadyInterrupted) => format!(
            "{which} of session {session:?} was already interrupted; sandcelld escalates on its own (SIGINT again, then SIGKILL)"
        ),
        Some(R::SessionEnding) => {
            format!("session {session:?} is ending (closed, expired, or its worker died)")
        }
        Some(R::Delivered) | None => return,
    };
    errln!("sandcellctl: not interrupted: {why}");
}

/// `interrupt SESSION [CELL]`.
#[derive(Debug, clap::Args)]
pub struct Interrupt {
    /// Session id.
    session: String,
    /// Cell number (`exec` prints it when the cell starts); omit for the running cell.
    cell: Option<u64>,
}

impl Interrupt {
    /// Interrupts and prints the daemon's reason (`delivered`, `not_running`, ...; `--json`:
    /// the whole reply); status 0 when delivered, 1 when not. Without CELL, a socket that
    /// cannot be reached, or a session it does not show as the caller's, sends the interrupt
    /// over D-Bus instead ([`admin::interrupt`]).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let Some(cell) = self.cell else {
            return self.running_cell(ctx).await;
        };
        let mut c = ctx.connect().await?;
        let r = c.interrupt(&self.session, cell).await?;
        if ctx.json {
            out::json(&r);
        } else {
            outln!("{}", r.reason);
            explain_undelivered(&r.reason, &self.session, Some(cell));
        }
        Ok(if r.delivered { 0 } else { 1 })
    }

    /// `interrupt SESSION`: over the socket; a socket that cannot be reached, or a session
    /// it does not show as the caller's, over D-Bus. When the bus cannot be reached either,
    /// the socket's answer is the one reported (`NoSuchSession`, or the socket's own
    /// connection error): it says what is wrong, the bus's absence does not.
    async fn running_cell(self, ctx: &Ctx) -> Outcome {
        let over_socket: Failure = match ctx.connect().await {
            Err(e) => e.into(),
            Ok(mut c) => match c.interrupt_session(&self.session).await {
                Ok(r) => {
                    if ctx.json {
                        out::json(&r);
                    } else {
                        match r.cell {
                            Some(n) => outln!("{} (cell {n})", r.reason),
                            None => outln!("{}", r.reason),
                        }
                        explain_undelivered(&r.reason, &self.session, r.cell);
                    }
                    return Ok(if r.delivered { 0 } else { 1 });
                }
                // Not one of the caller's sessions: perhaps an administrator's, over D-Bus.
                Err(
                    e @ Error::Kernel(
                        KernelError::NoSuchSession { .. } | KernelError::PermissionDenied { .. },
                    ),
                ) => e.into(),
                Err(e) => return Err(e.into()),
            },
        };
        match admin::interrupt(ctx, &self.session).await {
            Err(Failure::Bus(crate::dbus::Error::Bus(_))) => Err(over_socket),
            other => other,
        }
    }
}

/// `list --own`: the caller's sessions over the socket, one a line, columns sized to the ids
/// (`--json`: `{"sessions", "truncated"}`).
pub async fn list_own(ctx: &Ctx) -> Outcome {
    let mut c = ctx.connect().await?;
    let (rows, truncated) = c.list_sessions().await?;
    if ctx.json {
        out::json(&serde_json::json!({ "sessions": rows, "truncated": truncated }));
        return Ok(0);
    }
    let idw = rows
        .iter()
        .map(|s| escape_name(&s.session).chars().count())
        .fold("SESSION".len(), usize::max);
    outln!(
        "{:<idw$} {:<8} {:<8} {:>7} {:>6} {:<20} DETACHED",
        "SESSION",
        "LANGUAGE",
        "STATE",
        "RUNNING",
        "CELLS",
        "STARTED"
    );
    for s in &rows {
        let started = (s.started * 1e6) as u64;
        outln!(
            "{:<idw$} {:<8} {:<8} {:>7} {:>6} {:<20} {}",
            escape_name(&s.session),
            escape_name(&s.language),
            escape_name(&s.state),
            s.running_cell.map_or("-".into(), |c| c.to_string()),
            s.cells_run,
            crate::dbus::utc(started),
            s.detached_idle_seconds
                .map_or("no".into(), |i| format!("idle {i} s")),
        );
    }
    outln!(
        "\n{} listed{}.",
        sessions_counted(rows.len()),
        if truncated { " (more exist)" } else { "" }
    );
    Ok(0)
}

/// "1 session", "2 sessions": the count line under a listing.
pub(super) fn sessions_counted(n: usize) -> String {
    if n == 1 {
        "1 session".to_owned()
    } else {
        format!("{n} sessions")
    }
}
