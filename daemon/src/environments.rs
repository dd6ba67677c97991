//! Named environments: whether each is ready, its interpreter's version and its installed
//! packages, as `ListEnvironments` and the D-Bus `Environments` property report them.
//!
//! The environments themselves are configuration (`[environments.<name>]`, see
//! `config::Config::environments`). What is reported about one is learned by running one cell
//! in a confined one-shot session of it, through the normal path (admission, cgroup, uid,
//! Landlock, seccomp, no network): the worker's own interpreter lists what it can import. Nothing
//! is ever installed. Every environment is checked when the daemon starts, before it says it is
//! ready (a language's default environment must pass, or the daemon refuses to start; another
//! one is then listed as not ready, with the reason). Results are kept until the environment's
//! configuration changes (a reload: it is then checked again on the next listing); a check
//! that could not run for want of capacity, or because the daemon is stopping, is not kept.
//!
//! This module is the registry of those reports and reads a probe's output; the core runs the
//! probe cells (`Core::environment_report`, `Core::list_environments`).

use crate::config::{Engine, Environment};
use sandcell_proto::kernel::{self as k, Frame, KernelError, MAX_LISTED_PACKAGES, Package, Status};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::{OnceCell, mpsc};

/// Bytes of a probe cell's output that are read at most (names and versions of at most
/// [`MAX_LISTED_PACKAGES`] packages fit comfortably).
const MAX_PROBE_OUTPUT: usize = 64 * 1024;

/// Longest package name or version kept, bytes.
const MAX_FIELD: usize = 128;

/// What a check found.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The probe cell ran and ended `ok`.
    pub ready: bool,
    /// Why not.
    pub reason: Option<String>,
    /// First line of the probe's output, e.g. `CPython 3.11.2`.
    pub version: String,
    /// Installed packages, name order, at most [`MAX_LISTED_PACKAGES`].
    pub packages: Vec<Package>,
    /// More were installed.
    pub truncated: bool,
}

/// A check done or under way, with the configuration it was done for.
type Check = (Environment, Arc<OnceCell<Report>>);

/// Checks done or under way, by environment name.
#[derive(Debug, Default)]
pub struct Reports {
    cells: Mutex<BTreeMap<String, Check>>,
}

impl Reports {
    /// The report of `env`: kept from an earlier check of the same configuration, or checked
    /// now by `probe` (whose `Err` is not kept: the report then says the check did not run).
    pub async fn get<F, P>(&self, env: &Environment, probe: P) -> Report
    where
        P: FnOnce() -> F,
        F: Future<Output = Result<Report, KernelError>>,
    {
        match self.try_get(env, probe).await {
            Ok(r) => r,
            Err(e) => not_ready(format!("not checked yet: {e}")),
        }
    }

    /// [`Reports::get`], with the probe's `Err` (the check did not run; nothing kept) given
    /// back instead of a report that says so.
    pub async fn try_get<F, P>(&self, env: &Environment, probe: P) -> Result<Report, KernelError>
    where
        P: FnOnce() -> F,
        F: Future<Output = Result<Report, KernelError>>,
    {
        let cell = self.cell(env);
        cell.get_or_try_init(probe).await.cloned()
    }

    fn cell(&self, env: &Environment) -> Arc<OnceCell<Report>> {
        let mut cells = self.cells.lock().unwrap();
        match cells.get(&env.name) {
            Some((e, c)) if e == env => c.clone(),
            _ => {
                let c = Arc::new(OnceCell::new());
                cells.insert(env.name.clone(), (env.clone(), c.clone()));
                c
            }
        }
    }
}

/// The probe cell of `env`: prints the interpreter's version on its first line, then one
/// `name<TAB>version` line per installed package.
pub fn probe_code(env: &Environment) -> &'static str {
    match (env.language, env.engine) {
        (k::Language::R, _) => {
            "local({ ip <- installed.packages(fields = character(0)); \
             cat('R ', R.version$major, '.', R.version$minor, '\\n', sep = ''); \
             cat(paste0(ip[, 'Package'], '\\t', ip[, 'Version'], '\\n'), sep = '') })"
        }
        (k::Language::Python, Engine::Native) => {
            "import sys, importlib.metadata as _m\n\
             print('CPython %d.%d.%d' % sys.version_info[:3])\n\
             for _d in _m.distributions():\n    \
             try:\n        print('%s\\t%s' % (_d.metadata['Name'], _d.version))\n    \
             except Exception:\n        pass\n"
        }
        // Eryx: the standard library only; nothing else can be imported.
        (k::Language::Python, Engine::Eryx) => {
            "import sys\nprint('CPython %d.%d.%d (Eryx)' % sys.version_info[:3])\n"
        }
    }
}

/// Parses a probe's output: (version, packages in name order without duplicates, truncated).
/// Lines that are not `name<TAB>version` are skipped; fields are cut to 128 bytes.
pub fn parse_inventory(out: &str) -> (String, Vec<Package>, bool) {
    let cut = |s: &str| {
        let mut end = s.len().min(MAX_FIELD);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s[..end].to_owned()
    };
    let mut lines = out.lines();
    let version = cut(lines.next().unwrap_or("").trim());
    let mut by_name: BTreeMap<String, Package> = BTreeMap::new();
    for l in lines {
        let Some((n, v)) = l.split_once('\t') else {
            continue;
        };
        let (n, v) = (n.trim(), v.trim());
        if n.is_empty() || n == "None" || v.is_empty() {
            continue;
        }
        by_name.entry(n.to_ascii_lowercase()).or_insert(Package {
            name: cut(n),
            version: cut(v),
        });
    }
    let truncated = by_name.len() > MAX_LISTED_PACKAGES;
    let packages = by_name.into_values().take(MAX_LISTED_PACKAGES).collect();
    (version, packages, truncated)
}

/// A report of an environment that is not ready, and why.
fn not_ready(reason: String) -> Report {
    Report {
        ready: false,
        reason: Some(reason),
        version: String::new(),
        packages: Vec::new(),
        truncated: false,
    }
}

/// What the probe cell of an environment found, from the frames of its one-shot run (after
/// the run was admitted): ready with its version and packages when it ended `ok` and printed
/// a version; else not ready, with the reason.
pub async fn read_probe(mut frames: mpsc::Receiver<Frame>) -> Report {
    let mut out = String::new();
    while let Some(f) = frames.recv().await {
        if let Some(o) = f.output
            && o.stream == k::Stream::Stdout
            && out.len() < MAX_PROBE_OUTPUT
        {
            out.push_str(&o.text);
        }
        if let Some(r) = f.result {
            if r.status != Status::Ok {
                let why = r
                    .error
                    .map(|e| format!(": {}: {}", e.kind, e.message))
                    .unwrap_or_default();
                return not_ready(format!("the probe cell ended {:?}{why}", r.status));
            }
            let (version, packages, truncated) = parse_inventory(&out);
            if version.is_empty() {
                return not_ready("the probe cell printed no interpreter version".into());
            }
            return Report {
                ready: true,
                reason: None,
                version,
                packages,
                truncated,
            };
        }
    }
    not_ready("the probe cell produced no result".into())
}

/// The probe's result for a run that was refused: `Err` for reasons that say nothing about
/// the environment (no capacity now, the daemon stopping), which are not kept; else a report
/// of an environment that is not ready.
pub fn refused(e: KernelError) -> Result<Report, KernelError> {
    match e {
        e @ (KernelError::CapacityExceeded { .. } | KernelError::ShuttingDown {}) => Err(e),
        e => Ok(not_ready(e.to_string())),
    }
}

/// An environment as `ListEnvironments` lists it, with its report.
pub fn listing(env: &Environment, r: Report) -> k::Environment {
    k::Environment {
        name: env.name.clone(),
        language: env.language.as_str().into(),
        engine: env.engine.as_str().into(),
        default: env.default,
        interpreter_version: r.version,
        ready: r.ready,
        reason: r.reason,
        packages: r.packages,
        packages_truncated: r.truncated,
        package_sources: env
            .package_source
            .iter()
            .map(crate::packages::Source::inventory)
            .collect(),
        egress: env.egress.as_ref().map(|e| k::EgressPolicy {
            hosts: e.hosts.clone(),
            ports: e.ports.clone(),
            max_bytes: e.max_bytes,
            max_connections: e.max_connections,
            max_total_connections: e.max_total_connections,
            max_seconds: e.max_seconds,
        }),
        limits: None,
    }
}

/// The warning a `fuel_exhausted` cell's result carries: what fuel is and who raises it.
pub fn fuel_exhausted(fuel: u64) -> String {
    format!(
        "the cell used up its fuel: {fuel} units of WebAssembly work (about one per \
         instruction the Python interpreter runs in the Eryx engine), a budget per cell that \
         stops runaway computation; split the work into several cells, use the pydata \
         environment (no fuel), or have an operator raise max_fuel in sandcelld.toml (a \
         client may only ask for less, with limits.fuel)"
    )
}

/// The limits a session of `env` gets under `cfg` when its client asks for none.
pub fn default_limits(cfg: &crate::config::Config, env: &Environment) -> k::EnvironmentLimits {
    let l = &cfg.limits;
    let eryx = env.engine == crate::config::Engine::Eryx;
    k::EnvironmentLimits {
        wall_time_seconds: l.execution_wall_time_seconds,
        memory_bytes: l.max_worker_memory_bytes,
        guest_memory_bytes: eryx.then_some(l.max_guest_memory_bytes),
        fuel: eryx.then_some(l.max_fuel),
        disk_bytes: l.max_session_files_bytes,
        file_bytes: l.max_file_bytes,
        stdout_bytes: l.max_stdout_bytes,
        stderr_bytes: l.max_stderr_bytes,
        cpus: cfg.daemon.worker_cpus,
        detached_idle_seconds: l.max_detached_idle_seconds,
        source_bytes: Some(l.max_source_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inventory_is_parsed_sorted_and_bounded() {
        let (v, p, t) = parse_inventory(
            "CPython 3.11.2\nnumpy\t1.24.2\nPandas\t1.5.3\nbad line\nnumpy\t9\nNone\t1\n",
        );
        assert_eq!(v, "CPython 3.11.2");
        assert_eq!(
            p.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["numpy", "Pandas"]
        );
        assert_eq!(p[0].version, "1.24.2");
        assert!(!t);
        let mut many = String::from("R 4.2.2\n");
        for i in 0..(MAX_LISTED_PACKAGES + 5) {
            many.push_str(&format!("p{i:04}\t1.0\n"));
        }
        let (_, p, t) = parse_inventory(&many);
        assert_eq!(p.len(), MAX_LISTED_PACKAGES);
        assert!(t);
        let (v, p, _) = parse_inventory("");
        assert!(v.is_empty() && p.is_empty());
    }
}
