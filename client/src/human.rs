//! One human sentence per error of `org.sandcell.Kernel`: what happened, the limit and the
//! sandcelld.toml(5) key that sets it where there is one, and what to do. The machine form
//! (the error name and its parameters) stays available from the error value itself
//! ([`KernelError::name`], its `Serialize` impl).

use sandcell_proto::kernel::KernelError;

/// The sandcelld.toml(5) key behind a `LimitExceeded` limit name, when the limit is (or a
/// request lowers) an operator's setting; `None` for the protocol's fixed bounds
/// (`inline_bytes`, `max_items`, `max_bytes`, `max_session_entries`, host-call sizes, ...).
pub fn limit_key(limit: &str) -> Option<&'static str> {
    Some(match limit {
        "max_source_bytes" => "max_source_bytes",
        "max_file_bytes" => "max_file_bytes",
        "max_session_files_bytes" => "max_session_files_bytes",
        "max_detached_idle_seconds" => "max_detached_idle_seconds",
        "wall_time_seconds" => "execution_wall_time_seconds",
        "fuel" => "max_fuel",
        "guest_memory_bytes" => "max_guest_memory_bytes",
        "stdout_bytes" => "max_stdout_bytes",
        "stderr_bytes" => "max_stderr_bytes",
        _ => return None,
    })
}

/// Limits on what a whole session directory holds: their `value` is what the session would
/// hold after the call (in use plus the call's own), not what the call alone asked for.
fn is_session_total(limit: &str) -> bool {
    matches!(
        limit,
        "max_session_files_bytes" | "max_session_entries" | "max_listed_entries"
    )
}

/// The unit suffix of a limit or budget name: ` bytes`, ` s` or nothing.
fn unit(name: &str) -> &'static str {
    if name.ends_with("_bytes") || name == "max_bytes" {
        " bytes"
    } else if name.ends_with("_seconds") {
        " s"
    } else {
        ""
    }
}

fn names(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// One sentence for `e`, without a trailing period; the strings in it come from the daemon
/// (and, for a file name, from the caller or a cell): escape them before printing them on a
/// terminal.
///
/// For example `LimitExceeded { limit: "max_source_bytes", value: 70000, max: 65536 }` reads
/// `max_source_bytes exceeded: 70000 bytes asked, at most 65536 bytes; send less, or have an
/// operator raise max_source_bytes in sandcelld.toml`.
pub fn describe(e: &KernelError) -> String {
    use KernelError as K;
    match e {
        K::InvalidParameter { parameter, reason } => {
            format!("invalid parameter {parameter}: {reason}")
        }
        K::UnsupportedLanguage {
            language,
            supported,
        } => format!(
            "language {language:?} is not served by this daemon (it serves: {})",
            names(supported)
        ),
        K::LimitExceeded { limit, value, max } => {
            let u = unit(limit);
            if is_session_total(limit) {
                let text = format!(
                    "{limit} exceeded: the session would hold {value}{u}, at most {max}{u}"
                );
                let raise = match limit_key(limit) {
                    Some(key) => format!(", or have an operator raise {key} in sandcelld.toml"),
                    None => " (a fixed bound of the protocol)".into(),
                };
                return format!(
                    "{text}; delete files from the session (they count until removed){raise}"
                );
            }
            let text = format!("{limit} exceeded: {value}{u} asked, at most {max}{u}");
            match limit_key(limit) {
                None if limit == crate::MESSAGE_LIMIT => format!(
                    "{text} (the protocol's bound on one call; nothing was sent): send less, or \
                     pass large inputs as files (sandcellctl put)"
                ),
                None => format!("{text} (a fixed bound of the protocol); send less"),
                Some(key) if key != limit => format!(
                    "{text} (a request may only lower the operator's {key} of \
                     sandcelld.toml); ask for less, or have an operator raise it"
                ),
                Some(key) => {
                    format!("{text}; send less, or have an operator raise {key} in sandcelld.toml")
                }
            }
        }
        K::CapacityExceeded {
            budget,
            in_use,
            requested,
            max,
            retry_after_seconds,
        } => {
            let key = if budget.starts_with("max_") || budget == "worker_uid_count" {
                format!("; an operator raises {budget} in sandcelld.toml")
            } else {
                String::new()
            };
            let when = match retry_after_seconds {
                Some(s) => format!("in {s:.2} s"),
                None => "later".into(),
            };
            format!(
                "the daemon is at capacity: {budget} has {in_use} in use of {max}, \
                 {requested} more asked; retry {when} or on another node{key}"
            )
        }
        K::NoSuchSession { session } => {
            format!("no session {session} for this user (never opened, or ended and forgotten)")
        }
        K::SessionEnded {
            session,
            reason,
            ended_at,
        } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            format!(
                "session {session} ended {:.0} s ago ({reason}); open a new one",
                (now - ended_at).max(0.0)
            )
        }
        K::WrongNode {
            session,
            node,
            expected,
        } => format!(
            "session {session} belongs to node {node}, not this one ({}); call that node's \
             socket",
            if expected.is_empty() {
                "unqualified ids"
            } else {
                expected
            }
        ),
        K::SessionBusy { session, cell } => {
            format!("session {session} is running cell {cell}; wait for it or interrupt it")
        }
        K::PermissionDenied { action } => format!("permission denied (polkit action {action})"),
        K::WorkerFailed { reason } => format!("the worker failed: {reason}"),
        K::InternalError { operation, reason } => format!(
            "the daemon failed on its side ({operation}: {reason}); nothing in the call was \
             wrong, it may be retried"
        ),
        K::InvalidFileName { name, reason } => format!("invalid file name {name:?}: {reason}"),
        K::NoSuchFile { name } => format!("no file {name:?} in the session directory"),
        K::NotRegularFile { name, kind } => {
            format!("{name:?} is not a regular file (it is a {kind})")
        }
        K::NoSuchEnvironment { environment, known } => format!(
            "no environment {environment:?} is served (served: {})",
            names(known)
        ),
        K::EnvironmentMismatch {
            environment,
            language,
            environment_language,
        } => format!("environment {environment:?} serves {environment_language}, not {language}"),
        K::ShuttingDown {} => {
            "the daemon is shutting down and takes no new work; retry in a moment".into()
        }
        K::NoSuchCell { session, cell } => {
            format!("session {session} has no record of cell {cell}")
        }
        K::AttachmentReplaced { session, cell } => {
            format!("a newer attach to cell {cell} of session {session} took over")
        }
        K::NoSuchHostCall { session, call } => format!(
            "host call {call} of session {session} does not wait for an answer (answered, \
             timed out, or its cell ended)"
        ),
        K::EgressUnavailable {
            environment,
            reason,
        } => format!("environment {environment:?} has egress, but {reason}"),
    }
}

/// Import names whose distribution (package) name differs, for [`module_hint`].
const MODULE_PACKAGES: &[(&str, &str)] = &[
    ("sklearn", "scikit-learn"),
    ("PIL", "pillow"),
    ("yaml", "pyyaml"),
    ("bs4", "beautifulsoup4"),
    ("cv2", "opencv-python"),
    ("dateutil", "python-dateutil"),
    ("skimage", "scikit-image"),
];

fn norm(name: &str) -> String {
    name.to_lowercase().replace(['-', '.'], "_")
}

/// The top-level module of a `ModuleNotFoundError` message (`No module named 'pandas.x'`
/// gives `pandas`), or `None`.
pub fn missing_module(kind: &str, message: &str) -> Option<String> {
    if kind != "ModuleNotFoundError" {
        return None;
    }
    let rest = message.split("No module named '").nth(1)?;
    let name: String = rest
        .chars()
        .take_while(|c| *c != '\'' && *c != '.')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// A sentence naming the ready environments of `language` whose installed packages include
/// `module` (from `ListEnvironments`), or `None` when none has it.
pub fn module_hint(
    module: &str,
    environments: &[sandcell_proto::kernel::Environment],
    language: &str,
) -> Option<String> {
    let dist = MODULE_PACKAGES
        .iter()
        .find(|(m, _)| *m == module)
        .map_or(module, |(_, d)| d);
    let want = [norm(module), norm(dist)];
    let having: Vec<&str> = environments
        .iter()
        .filter(|e| e.language == language && e.ready)
        .filter(|e| e.packages.iter().any(|p| want.contains(&norm(&p.name))))
        .map(|e| e.name.as_str())
        .collect();
    let first = having.first()?;
    Some(format!(
        "{module} is not installed in this environment; environment {} has it \
         (sandcellctl run -e {first})",
        having.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_their_key_and_read_as_sentences() {
        let e = KernelError::LimitExceeded {
            limit: "max_source_bytes".into(),
            value: 70000,
            max: 65536,
        };
        assert_eq!(
            describe(&e),
            "max_source_bytes exceeded: 70000 bytes asked, at most 65536 bytes; send less, \
             or have an operator raise max_source_bytes in sandcelld.toml"
        );
        let e = KernelError::LimitExceeded {
            limit: "wall_time_seconds".into(),
            value: 90,
            max: 10,
        };
        assert!(describe(&e).contains("execution_wall_time_seconds"));
        // A session total is what the session would hold, not what the call asked.
        let e = KernelError::LimitExceeded {
            limit: "max_session_entries".into(),
            value: 4097,
            max: 4096,
        };
        assert_eq!(
            describe(&e),
            "max_session_entries exceeded: the session would hold 4097, at most 4096; delete \
             files from the session (they count until removed) (a fixed bound of the protocol)"
        );
        let e = KernelError::LimitExceeded {
            limit: "max_session_files_bytes".into(),
            value: 300,
            max: 256,
        };
        assert!(
            describe(&e).starts_with(
                "max_session_files_bytes exceeded: the session would hold 300 bytes, at most 256 \
                 bytes; delete files"
            ) && describe(&e).ends_with("raise max_session_files_bytes in sandcelld.toml"),
            "{}",
            describe(&e)
        );
        let e = KernelError::CapacityExceeded {
            budget: "max_concurrent_sessions".into(),
            in_use: 8,
            requested: 1,
            max: 8,
            retry_after_seconds: None,
        };
        let d = describe(&e);
        assert!(d.contains("retry later") && !d.contains('{'), "{d}");
    }

    #[test]
    fn a_missing_module_is_found_in_another_environment() {
        assert_eq!(
            missing_module("ModuleNotFoundError", "No module named 'pandas.core'").as_deref(),
            Some("pandas")
        );
        assert_eq!(missing_module("ImportError", "No module named 'x'"), None);
        let env = |name: &str, pkgs: &[&str]| sandcell_proto::kernel::Environment {
            name: name.into(),
            language: "python".into(),
            engine: "native".into(),
            default: false,
            interpreter_version: String::new(),
            ready: true,
            reason: None,
            packages: pkgs
                .iter()
                .map(|p| sandcell_proto::kernel::Package {
                    name: (*p).into(),
                    version: "1".into(),
                })
                .collect(),
            packages_truncated: false,
            package_sources: Vec::new(),
            egress: None,
            limits: None,
        };
        let envs = [
            env("python", &[]),
            env("pydata", &["pandas", "scikit-learn"]),
        ];
        let h = module_hint("sklearn", &envs, "python").unwrap();
        assert!(h.contains("environment pydata has it"), "{h}");
        assert_eq!(module_hint("torch", &envs, "python"), None);
    }
}
