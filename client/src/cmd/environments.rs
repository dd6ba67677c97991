//! `sandcellctl environments`: the environments the daemon serves (Varlink
//! `ListEnvironments`) with their default limits; and [`language`], the language a command
//! sends when the user named only an environment.

use super::{Ctx, Outcome};
use crate::dbus::human_bytes;
use crate::out::{self, escape_name};
use sandcell_client::{Client, EnvironmentLimits};

/// `environments [--packages]`.
#[derive(Debug, clap::Args)]
pub struct Environments {
    /// Also print every environment's installed packages with their versions.
    #[arg(long)]
    packages: bool,
}

impl Environments {
    /// Prints one row per environment, its default limits under it (and with `--packages` its
    /// packages); `--json`: the `ListEnvironments` reply's list.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let envs = ctx.connect().await?.list_environments().await?;
        if ctx.json {
            out::json(&envs);
            return Ok(0);
        }
        let nw = envs
            .iter()
            .map(|e| escape_name(&e.name).chars().count())
            .fold(16, usize::max);
        outln!(
            "{:<nw$} {:<8} {:<7} {:<7} {:<5} {:<24} {:>8}",
            "NAME",
            "LANGUAGE",
            "ENGINE",
            "DEFAULT",
            "READY",
            "VERSION",
            "PACKAGES"
        );
        for e in &envs {
            let count = format!(
                "{}{}",
                e.packages.len(),
                if e.packages_truncated { "+" } else { "" }
            );
            outln!(
                "{:<nw$} {:<8} {:<7} {:<7} {:<5} {:<24} {:>8}",
                escape_name(&e.name),
                escape_name(&e.language),
                escape_name(&e.engine),
                if e.default { "yes" } else { "no" },
                if e.ready { "yes" } else { "no" },
                escape_name(&e.interpreter_version),
                count
            );
            if let Some(r) = &e.reason {
                outln!("  not ready: {}", escape_name(r));
            }
            if let Some(l) = &e.limits {
                for line in limit_lines(l) {
                    outln!("  {line}");
                }
            }
            for line in source_lines(&e.package_sources, self.packages) {
                outln!("  {line}");
            }
            if let Some(g) = &e.egress {
                outln!("  {}", egress_line(g));
            }
            if self.packages {
                for p in &e.packages {
                    outln!("  {} {}", escape_name(&p.name), escape_name(&p.version));
                }
            }
        }
        Ok(0)
    }
}

/// An environment's egress policy on one line: hosts, ports, caps per session.
pub(crate) fn egress_line(g: &sandcell_proto::kernel::EgressPolicy) -> String {
    let hosts: Vec<String> = g.hosts.iter().map(|h| escape_name(h)).collect();
    let ports: Vec<String> = g.ports.iter().map(u16::to_string).collect();
    format!(
        "egress (HTTP_PROXY): {}; ports {}; per session {} bytes, {} connections at once, \
         {} in all, {} s each",
        hosts.join(" "),
        ports.join(","),
        g.max_bytes,
        g.max_connections,
        g.max_total_connections,
        g.max_seconds
    )
}

/// Most package names shown per source without `--packages`.
const SOURCE_NAMES_SHOWN: usize = 10;

/// The package sources of an environment, one line each under its row: kind, package count,
/// hash manifest, and the names (the first [`SOURCE_NAMES_SHOWN`] unless `all`).
fn source_lines(sources: &[sandcell_proto::kernel::PackageSource], all: bool) -> Vec<String> {
    sources
        .iter()
        .map(|s| {
            let how = match s.kind.as_str() {
                "wheelhouse" => "sandcell.install(...)",
                "cran_repository" => "install.packages(...)",
                _ => "",
            };
            let mut line = format!(
                "installable ({}, {how}): {} package{}{}",
                escape_name(&s.kind),
                s.packages,
                if s.packages == 1 { "" } else { "s" },
                if s.hash_manifest {
                    ", hash-checked"
                } else {
                    ""
                }
            );
            if let Some(r) = &s.reason {
                line.push_str(&format!(": {}", escape_name(r)));
            } else if !s.names.is_empty() {
                let shown = if all {
                    s.names.len()
                } else {
                    s.names.len().min(SOURCE_NAMES_SHOWN)
                };
                let names: Vec<String> = s.names[..shown].iter().map(|n| escape_name(n)).collect();
                let more = s.names_truncated || shown < s.names.len();
                line.push_str(&format!(
                    ": {}{}",
                    names.join(" "),
                    if more { " ..." } else { "" }
                ));
            }
            line
        })
        .collect()
}

/// The default limits of an environment, as `environments` prints them under its row: one
/// line per cell, one per session, each value with its sandcelld.toml key.
fn limit_lines(l: &EnvironmentLimits) -> [String; 2] {
    let mut cell = format!(
        "per cell: wall time {} s [execution_wall_time_seconds]",
        l.wall_time_seconds
    );
    if let Some(f) = l.fuel {
        cell.push_str(&format!(", fuel {f} WebAssembly instructions [max_fuel]"));
    }
    cell.push_str(&format!(
        ", output kept {} stdout / {} stderr [max_stdout_bytes, max_stderr_bytes]",
        human_bytes(Some(l.stdout_bytes)),
        human_bytes(Some(l.stderr_bytes))
    ));
    let mut session = format!(
        "per session: memory {} [max_worker_memory_bytes]",
        human_bytes(Some(l.memory_bytes))
    );
    if let Some(g) = l.guest_memory_bytes {
        session.push_str(&format!(
            ", interpreter memory {} [max_guest_memory_bytes]",
            human_bytes(Some(g))
        ));
    }
    let cpus = if l.cpus > 0.0 {
        format!("{} CPU", l.cpus)
    } else {
        "no CPU cap".into()
    };
    session.push_str(&format!(
        ", disk {} [max_session_files_bytes], one file {} [max_file_bytes], {cpus} [worker_cpus], detached idle at most {} s [max_detached_idle_seconds]",
        human_bytes(Some(l.disk_bytes)),
        human_bytes(Some(l.file_bytes)),
        l.detached_idle_seconds
    ));
    [cell, session]
}

/// The language to send with `Run` or `Open`: `explicit` (`--language`) when given; else the
/// language of `environment` as `ListEnvironments` names it (an environment implies its
/// language, so `run -e r -` runs R); else `fallback()` (for `run`, the code file's
/// extension; for `open`, python). An environment the daemon does not list, or a listing
/// that fails, also gets `fallback()`: the call then fails with the daemon's own error
/// (`NoSuchEnvironment` names the environments served). An explicit language that does not
/// match the environment is left for the daemon to refuse (`EnvironmentMismatch`).
pub async fn language(
    c: &mut Client,
    explicit: Option<String>,
    environment: Option<&str>,
    fallback: impl FnOnce() -> String,
) -> String {
    if let Some(l) = explicit {
        return l;
    }
    let Some(name) = environment else {
        return fallback();
    };
    let listed = c.list_environments().await.unwrap_or_default();
    listed
        .into_iter()
        .find(|e| e.name == name)
        .map(|e| e.language)
        .unwrap_or_else(fallback)
}
