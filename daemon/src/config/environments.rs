//! Named environments: the `[environments.<name>]` tables as written ([`EnvironmentConfig`]),
//! the shipped ones ([`shipped_environments`]), and their merge into the environments the
//! daemon serves ([`Config::environments`]), pool sizes resolved.

use super::{Config, Error, online_cpus, pool_sizes};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How an environment runs its cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// CPython inside Eryx (WebAssembly on wasmtime), Python only: two walls.
    Eryx,
    /// The system's interpreter, confined by the OS (the native seccomp profile, Landlock,
    /// namespaces, cgroup, uid): `sandcell-worker-r` for R, `sandcell-worker-python-native`
    /// for Python.
    Native,
}

impl Engine {
    /// `eryx` or `native`.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Eryx => "eryx",
            Engine::Native => "native",
        }
    }
}

/// One `[environments.<name>]` table as written by the operator.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentConfig {
    /// `python` or `r`.
    pub language: String,
    /// `eryx` (Python only) or `native`.
    pub engine: Engine,
    /// The language's default environment (at most one per language; unset: the shipped
    /// default of that language stays the default).
    #[serde(default)]
    pub default: bool,
    /// Native engines: the interpreter (Python: the `python3` executable, default
    /// `/usr/bin/python3`; R: the R home, default `/usr/lib/R`).
    #[serde(default)]
    pub interpreter: Option<PathBuf>,
    /// Native engines: extra directories the worker may read, put first on the library path
    /// (Python: `sys.path`; R: `.libPaths()`). Absolute paths.
    #[serde(default)]
    pub library_paths: Vec<PathBuf>,
    /// Native Python: modules a warm pool worker imports before it says Ready, so it has them
    /// loaded when its session opens (a worker started for a waiting client skips them).
    #[serde(default)]
    pub preload: Vec<String>,
    /// Warm workers kept idle at least (unset: `pool_<language>_min` for the language's
    /// default environment, 0 for others).
    #[serde(default)]
    pub pool_min: Option<usize>,
    /// Warm workers kept idle at most while sessions are being opened (unset: as `pool_min`).
    #[serde(default)]
    pub pool_max: Option<usize>,
    /// Python engines: a directory of wheels (`*.whl`, with an optional `SHA256SUMS`
    /// manifest) that cells install from with `sandcell.install("pkg==1.2")` into the
    /// session (see `crate::packages`). Absolute path; unset: no installs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wheelhouse: Option<PathBuf>,
    /// R: a local CRAN-style repository (`src/contrib/PACKAGES` and the tarballs it lists) of
    /// binary packages that cells install from with `install.packages("pkg")` into the
    /// session. Absolute path; unset: no installs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cran_repository: Option<PathBuf>,
    /// Native engines: network access through sandcell's egress proxy, `"none"` (the
    /// default) or a table ([`EgressConfig`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressSetting>,
    /// `false` removes a shipped environment of this name.
    #[serde(default = "yes")]
    pub enabled: bool,
}

/// An environment's `egress` key as written: `"none"` or a table.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum EgressSetting {
    /// `"none"`: no network (the default).
    Word(String),
    /// An allowlist with its caps.
    Table(EgressConfig),
}

/// An environment's egress policy: the hosts a session may reach through the proxy, on
/// which ports, with which caps per session.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// Lowercase DNS names and leading-`*.` wildcards (one or more labels below the name,
    /// never the name itself), 1-256 entries.
    pub hosts: Vec<String>,
    /// Destination ports (default 80 and 443), 1-64 entries.
    #[serde(default = "egress_ports")]
    pub ports: Vec<u16>,
    /// Bytes relayed per session, both directions (default 256 MiB).
    #[serde(default = "egress_bytes")]
    pub max_bytes: u64,
    /// Connections of one session open at once (default 16, at most 4096).
    #[serde(default = "egress_connections")]
    pub max_connections: u32,
    /// Connections over a session's life (default 1024).
    #[serde(default = "egress_total_connections")]
    pub max_total_connections: u64,
    /// Life of one connection, seconds (default 300).
    #[serde(default = "egress_seconds")]
    pub max_seconds: u64,
}

fn egress_ports() -> Vec<u16> {
    vec![80, 443]
}
fn egress_bytes() -> u64 {
    256 << 20
}
fn egress_connections() -> u32 {
    16
}
fn egress_total_connections() -> u64 {
    1024
}
fn egress_seconds() -> u64 {
    300
}

impl EgressConfig {
    /// Checks the table. Errors: what is wrong, as a sentence.
    pub fn check(&self) -> Result<(), String> {
        if self.hosts.is_empty() || self.hosts.len() > sandcell_egress::control::MAX_HOSTS {
            return Err(format!(
                "egress.hosts: 1-{} names expected (egress = \"none\" for none)",
                sandcell_egress::control::MAX_HOSTS
            ));
        }
        sandcell_egress::allow::Allowlist::parse(&self.hosts)
            .map_err(|e| format!("egress.hosts: {e}"))?;
        if self.ports.is_empty()
            || self.ports.len() > sandcell_egress::control::MAX_PORTS
            || self.ports.contains(&0)
        {
            return Err(format!(
                "egress.ports: 1-{} ports of 1-65535 expected",
                sandcell_egress::control::MAX_PORTS
            ));
        }
        if self.max_bytes == 0
            || self.max_connections == 0
            || self.max_connections > 4096
            || self.max_total_connections == 0
            || self.max_seconds == 0
        {
            return Err("egress: max_bytes, max_connections (at most 4096), \
                        max_total_connections and max_seconds must be positive"
                .into());
        }
        Ok(())
    }

    /// One line for operators: hosts, ports and caps.
    pub fn summary(&self) -> String {
        format!(
            "{}; ports {}; {} bytes, {} connections at once, {} in all, {} s each",
            self.hosts.join(" "),
            self.ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(","),
            self.max_bytes,
            self.max_connections,
            self.max_total_connections,
            self.max_seconds
        )
    }
}

fn yes() -> bool {
    true
}

/// An environment as the daemon serves it: the shipped ones merged with the file's, pool
/// sizes resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Environment {
    /// Its name (`[a-z0-9_-]`, 1-32 characters).
    pub name: String,
    /// Its language.
    pub language: sandcell_proto::kernel::Language,
    /// Its engine.
    pub engine: Engine,
    /// The language's default.
    pub default: bool,
    /// Native engines: the interpreter (Python executable or R home).
    pub interpreter: Option<PathBuf>,
    /// Extra read-only library directories.
    pub library_paths: Vec<PathBuf>,
    /// Modules imported before Ready (native Python).
    pub preload: Vec<String>,
    /// Warm pool minimum.
    pub pool_min: usize,
    /// Warm pool maximum.
    pub pool_max: usize,
    /// The operator's package source, if any: a wheelhouse (Python) or a CRAN-style
    /// repository (R), read-only in the worker.
    pub package_source: Option<crate::packages::Source>,
    /// The egress policy, if any (native engines only; checked).
    pub egress: Option<EgressConfig>,
}

/// The environments shipped: `python` (Eryx, Python's default), `pydata` (native CPython with
/// Debian's scientific stack), `r` (native R, R's default).
pub fn shipped_environments() -> Vec<(String, EnvironmentConfig)> {
    let env = |language: &str, engine, default, interpreter: Option<&str>| EnvironmentConfig {
        language: language.into(),
        engine,
        default,
        interpreter: interpreter.map(PathBuf::from),
        library_paths: Vec::new(),
        preload: Vec::new(),
        pool_min: None,
        pool_max: None,
        wheelhouse: None,
        cran_repository: None,
        egress: None,
        enabled: true,
    };
    vec![
        ("python".into(), env("python", Engine::Eryx, true, None)),
        (
            "pydata".into(),
            EnvironmentConfig {
                // Imported by a warm worker before it is ready, so that a session's first
                // import of them costs milliseconds; one missing is reported on stderr, not
                // fatal.
                preload: ["numpy", "pandas", "matplotlib"].map(String::from).to_vec(),
                ..env("python", Engine::Native, false, Some("/usr/bin/python3"))
            },
        ),
        (
            "r".into(),
            env("r", Engine::Native, true, Some("/usr/lib/R")),
        ),
    ]
}

impl Config {
    /// The environments served, in name order: the shipped ones, each replaced by a file
    /// table of the same name (or removed by `enabled = false`), plus the file's new ones;
    /// only those of a language in `daemon.languages`. Each served language has exactly one
    /// default. A configuration that passed [`Config::validate`] never fails here.
    pub fn environments(&self) -> Vec<Environment> {
        self.try_environments().unwrap_or_default()
    }

    /// The served environment named `name`.
    pub fn environment(&self, name: &str) -> Option<Environment> {
        self.environments().into_iter().find(|e| e.name == name)
    }

    pub(super) fn try_environments(&self) -> Result<Vec<Environment>, Error> {
        use sandcell_proto::kernel::Language;
        let invalid = |reason: String| Error::Invalid {
            key: "environments",
            reason,
        };
        let mut merged: std::collections::BTreeMap<String, (EnvironmentConfig, bool)> =
            shipped_environments()
                .into_iter()
                .map(|(n, e)| (n, (e, true)))
                .collect();
        for (name, e) in &self.environments {
            if name.is_empty()
                || name.len() > 32
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            {
                return Err(invalid(format!(
                    "{name:?}: a name is 1-32 characters of [a-z0-9_-]"
                )));
            }
            merged.insert(name.clone(), (e.clone(), false));
        }
        let served: Vec<Language> = self
            .daemon
            .languages
            .iter()
            .filter_map(|l| Language::parse(l))
            .collect();
        // A default named in the file wins over a shipped one of the same language.
        let file_default = |lang: Language| {
            merged.values().any(|(e, shipped)| {
                !shipped && e.enabled && e.default && Language::parse(&e.language) == Some(lang)
            })
        };
        let mut out = Vec::new();
        // Environments whose pool sizes are derived: (priority, index in `out`).
        let mut derived: Vec<(u8, usize)> = Vec::new();
        for (name, (e, shipped)) in &merged {
            if !e.enabled {
                continue;
            }
            let language = Language::parse(&e.language).ok_or_else(|| {
                invalid(format!(
                    "{name}: unknown language {:?} (python, r)",
                    e.language
                ))
            })?;
            if !served.contains(&language) {
                continue;
            }
            if e.engine == Engine::Eryx
                && (language != Language::Python
                    || e.interpreter.is_some()
                    || !e.library_paths.is_empty()
                    || !e.preload.is_empty())
            {
                return Err(invalid(format!(
                    "{name}: the eryx engine runs Python only, with no interpreter, library_paths or preload"
                )));
            }
            if language == Language::R && !e.preload.is_empty() {
                return Err(invalid(format!("{name}: preload is for Python only")));
            }
            let package_source = match (language, &e.wheelhouse, &e.cran_repository) {
                (_, None, None) => None,
                (Language::Python, Some(p), None) if e.engine == Engine::Native => {
                    Some(crate::packages::Source::wheelhouse(p.clone()))
                }
                (Language::Python, Some(_), None) => {
                    return Err(invalid(format!(
                        "{name}: the eryx engine cannot install packages (no wheelhouse): \
                         its interpreter sees only its own file system"
                    )));
                }
                (Language::R, None, Some(p)) => {
                    Some(crate::packages::Source::cran_repository(p.clone()))
                }
                (Language::Python, _, Some(_)) => {
                    return Err(invalid(format!(
                        "{name}: cran_repository is for R; Python environments name a wheelhouse"
                    )));
                }
                (Language::R, Some(_), _) => {
                    return Err(invalid(format!(
                        "{name}: wheelhouse is for Python; R environments name a cran_repository"
                    )));
                }
            };
            for p in e
                .interpreter
                .iter()
                .chain(&e.library_paths)
                .chain(&e.wheelhouse)
                .chain(&e.cran_repository)
            {
                let ok = p.is_absolute()
                    && p.to_str()
                        .is_some_and(|s| !s.contains(':') && !s.contains(','))
                    && !p.components().any(|c| c == std::path::Component::ParentDir);
                if !ok {
                    return Err(invalid(format!(
                        "{name}: {} must be an absolute path without '..', ':' or ','",
                        p.display()
                    )));
                }
            }
            for m in &e.preload {
                if m.is_empty()
                    || m.len() > 128
                    || !m
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
                {
                    return Err(invalid(format!(
                        "{name}: preload {m:?} is not a module name"
                    )));
                }
            }
            let egress = match &e.egress {
                None => None,
                Some(EgressSetting::Word(w)) if w == "none" => None,
                Some(EgressSetting::Word(w)) => {
                    return Err(invalid(format!(
                        "{name}: egress = {w:?}: \"none\" or a table with hosts expected"
                    )));
                }
                Some(EgressSetting::Table(t)) => {
                    if e.engine == Engine::Eryx {
                        return Err(invalid(format!(
                            "{name}: the eryx engine has no egress: its WebAssembly guest is \
                             given no sockets (use engine = \"native\")"
                        )));
                    }
                    t.check().map_err(|r| invalid(format!("{name}: {r}")))?;
                    let mut t = t.clone();
                    t.hosts = t.hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
                    Some(t)
                }
            };
            let default = if *shipped && file_default(language) {
                false
            } else {
                e.default
            };
            let d = &self.daemon;
            let (lang_min, lang_max) = match language {
                Language::Python => (d.pool_python_min, d.pool_python_max),
                Language::R => (d.pool_r_min, d.pool_r_max),
            };
            let sizes = |min: Option<usize>, max: Option<usize>| match (min, max) {
                (None, None) => None,
                (Some(a), None) => Some((a, a)),
                (None, Some(b)) => Some((0, b)),
                (Some(a), Some(b)) => Some((a, b)),
            };
            // Unset sizes: the language's default and the shipped pydata are sized from the
            // machine and the budgets below; other environments have no pool.
            let (pool_min, pool_max) = match sizes(e.pool_min, e.pool_max) {
                Some(s) => s,
                None if default => match sizes(lang_min, lang_max) {
                    Some(s) => s,
                    None => {
                        derived.push((0, out.len()));
                        (0, 0)
                    }
                },
                // The shipped pydata (a shipped environment that is no language's default).
                None if *shipped && !e.default => {
                    derived.push((1, out.len()));
                    (0, 0)
                }
                None => (0, 0),
            };
            if pool_max < pool_min {
                return Err(invalid(format!(
                    "{name}: pool_max {pool_max} is below pool_min {pool_min}"
                )));
            }
            out.push(Environment {
                name: name.clone(),
                language,
                engine: e.engine,
                default,
                interpreter: e.interpreter.clone(),
                library_paths: e.library_paths.clone(),
                preload: e.preload.clone(),
                pool_min,
                pool_max,
                package_source,
                egress,
            });
        }
        // Language defaults first (Python before R), then the shipped pydata.
        derived.sort_by_key(|&(priority, i)| (priority, out[i].language != Language::Python, i));
        let defaults = derived.iter().filter(|(p, _)| *p == 0).count();
        let sized: usize = (0..out.len())
            .filter(|i| !derived.iter().any(|(_, j)| j == i))
            .map(|i| out[i].pool_max)
            .sum();
        let shares = pool_sizes(&self.limits, online_cpus(), defaults, derived.len(), sized);
        for ((_, i), (min, max)) in derived.into_iter().zip(shares) {
            (out[i].pool_min, out[i].pool_max) = (min, max);
        }
        for lang in served {
            let n = out
                .iter()
                .filter(|e| e.language == lang && e.default)
                .count();
            if n != 1 {
                return Err(invalid(format!(
                    "language {} has {n} default environments (exactly one is needed)",
                    lang.as_str()
                )));
            }
        }
        Ok(out)
    }
}
