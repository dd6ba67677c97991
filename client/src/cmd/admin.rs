//! The D-Bus commands, over `org.sandcell.Sandcell1` on the system bus ([`crate::dbus`];
//! `$DBUS_SYSTEM_BUS_ADDRESS` honoured; polkit decides inside sandcelld, `--interactive` lets
//! it ask for a password): `list` (every live session), `status`, `terminate`, `reload`, and
//! the D-Bus half of `interrupt SESSION` (another user's session, for an administrator).
//!
//! Exit status: 0 ok; 1 an interrupt not delivered; 2 bus unreachable; 3 the daemon refused
//! (error name printed, e.g. `org.sandcell.Sandcell1.PermissionDenied`).

use super::{Ctx, Outcome, session};
use crate::dbus::{self, Admin, SessionInfo};
use crate::out::{self, escape_message, escape_name};

/// `list [--own]`.
#[derive(Debug, clap::Args)]
pub struct List {
    /// List one's own sessions over the Varlink socket (no D-Bus needed).
    #[arg(long)]
    own: bool,
}

impl List {
    /// Every live session over D-Bus; one's own over the socket with `--own`, or after a note
    /// on standard error when the system bus is unreachable.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        if self.own {
            return session::list_own(ctx).await;
        }
        let rows = match connect(ctx).await {
            Ok(a) => a.list().await,
            Err(e) => Err(e),
        };
        let rows = match rows {
            Ok(rows) => rows,
            Err(dbus::Error::Bus(b)) => {
                errln!(
                    "sandcellctl: the system bus is unreachable ({}); listing your own sessions over the Varlink socket",
                    escape_message(&dbus::bus_cause(&b))
                );
                return session::list_own(ctx).await;
            }
            Err(e) => return Err(e.into()),
        };
        if ctx.json {
            out::json(&rows);
        } else {
            print_sessions(&rows);
        }
        Ok(0)
    }
}

/// The table of `list`: columns as wide as their widest entry (node-qualified ids are longer
/// than 32 characters), then the count.
fn print_sessions(rows: &[SessionInfo]) {
    let width = |f: &dyn Fn(&SessionInfo) -> String, min: usize| {
        rows.iter()
            .map(|s| f(s).chars().count())
            .fold(min, usize::max)
    };
    let idw = width(&|s| escape_name(&s.id), "SESSION".len());
    let lw = width(&|s| escape_name(&s.language), "LANGUAGE".len());
    let sw = width(&|s| escape_name(&s.state), "STATE".len());
    outln!(
        "{:<idw$} {:<lw$} {:>6} {:>8} {:<sw$} {:<20} {:>6} {:>10} {:>7}",
        "SESSION",
        "LANGUAGE",
        "UID",
        "PID",
        "STATE",
        "STARTED",
        "CELLS",
        "MEMORY",
        "EGRESS"
    );
    for s in rows {
        outln!(
            "{:<idw$} {:<lw$} {:>6} {:>8} {:<sw$} {:<20} {:>6} {:>10} {:>7}",
            escape_name(&s.id),
            escape_name(&s.language),
            s.uid,
            s.pid,
            escape_name(&s.state),
            dbus::utc(s.started_usec),
            s.cells_run,
            dbus::human_bytes(s.memory_bytes),
            egress_column(s.egress.as_ref())
        );
    }
    outln!("\n{} listed.", super::session::sessions_counted(rows.len()));
}

/// The EGRESS column: requests allowed/refused, `-` without an egress grant.
fn egress_column(e: Option<&std::collections::BTreeMap<String, u64>>) -> String {
    match e {
        Some(m) => format!(
            "{}/{}",
            m.get("allowed").copied().unwrap_or(0),
            m.get("refused").copied().unwrap_or(0)
        ),
        None => "-".into(),
    }
}

/// `status`: daemon-wide figures.
pub async fn status(ctx: &Ctx) -> Outcome {
    let st = connect(ctx).await?.status().await?;
    // Each environment's egress policy comes from ListEnvironments on the Varlink socket
    // (the D-Bus status carries the package sources, not the policies).
    let envs = match ctx.connect().await {
        Ok(mut c) => c.list_environments().await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if ctx.json {
        let mut v = serde_json::to_value(&st).unwrap_or_default();
        v["egress"] = match &envs {
            Ok(envs) => envs
                .iter()
                .map(|e| {
                    (
                        e.name.clone(),
                        serde_json::to_value(&e.egress).unwrap_or_default(),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into(),
            Err(e) => serde_json::json!({"error": e}),
        };
        out::json(&v);
        return Ok(0);
    }
    outln!("version:         {}", st.version);
    outln!("cgroups:         {}", st.cgroup_mode);
    outln!("landlock abi:    {}", st.landlock_abi);
    if !st.confinement.is_empty() {
        outln!("confinement:");
        for (k, v) in &st.confinement {
            outln!("  {k:40} {v}");
        }
    }
    outln!("active sessions: {}", st.active_sessions);
    for (budget, used, max) in &st.admission {
        outln!("{budget}: {used} of {max}");
    }
    outln!(
        "\n{:<8} {:>5} {:>6} {:>4} {:>4} {:>8} {:>8}",
        "POOL",
        "IDLE",
        "TARGET",
        "MIN",
        "MAX",
        "TAKEN",
        "MISSED"
    );
    for p in &st.pools {
        outln!(
            "{:<8} {:>5} {:>6} {:>4} {:>4} {:>8} {:>8}",
            p.language,
            p.idle,
            p.target,
            p.min,
            p.max,
            p.taken,
            p.missed
        );
    }
    if !st.package_sources.is_empty() {
        outln!("\npackage sources:");
        for s in &st.package_sources {
            outln!("  {}", source_line(s));
        }
    }
    match &envs {
        Ok(envs) => {
            outln!("\negress per environment:");
            for e in envs {
                let policy = e
                    .egress
                    .as_ref()
                    .map_or_else(|| "none".to_string(), crate::cmd::environments::egress_line);
                outln!("  {}: {policy}", escape_name(&e.name));
            }
        }
        Err(e) => outln!("\negress per environment: unknown ({})", escape_name(e)),
    }
    Ok(0)
}

/// One package source as `status` prints it: environment, kind, package count, whether
/// hash-checked, and the first few names.
fn source_line(s: &dbus::SourceInfo) -> String {
    const SHOWN: usize = 10;
    let mut line = format!(
        "{} {}: {} package{}{}",
        escape_name(&s.environment),
        escape_name(&s.kind),
        s.packages,
        if s.packages == 1 { "" } else { "s" },
        if s.hash_manifest {
            ", hash-checked"
        } else {
            ""
        },
    );
    if !s.names.is_empty() {
        let names: Vec<String> = s.names.iter().take(SHOWN).map(|n| escape_name(n)).collect();
        line.push_str(": ");
        line.push_str(&names.join(" "));
        if s.packages as usize > names.len() {
            line.push_str(" ...");
        }
    }
    line
}

/// `terminate SESSION`.
#[derive(Debug, clap::Args)]
pub struct Terminate {
    /// Session id.
    session: String,
}

impl Terminate {
    /// Ends the session; status 0, nothing printed.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        connect(ctx).await?.terminate(&self.session).await?;
        Ok(0)
    }
}

/// `reload`: sandcelld re-reads its configuration; status 0, nothing printed.
pub async fn reload(ctx: &Ctx) -> Outcome {
    connect(ctx).await?.reload().await?;
    Ok(0)
}

/// `interrupt SESSION` over D-Bus: prints the reason (`--json`: `{"delivered", "reason"}`);
/// status 0 when delivered, 1 when not.
pub async fn interrupt(ctx: &Ctx, session: &str) -> Outcome {
    let (delivered, reason) = connect(ctx).await?.interrupt(session).await?;
    if ctx.json {
        out::json(&serde_json::json!({"delivered": delivered, "reason": reason}));
    } else {
        outln!("{reason}");
    }
    Ok(if delivered { 0 } else { 1 })
}

async fn connect(ctx: &Ctx) -> Result<Admin, dbus::Error> {
    Admin::connect(ctx.interactive).await
}
