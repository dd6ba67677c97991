//! The configuration parser: `/etc/sandcell/sandcelld.toml` text (`Config::parse`), then
//! `SANDCELL_*` overrides (`Config::apply_env`), then `Config::validate`. The input is the
//! TOML text, optionally followed by a line `#ENV` and `NAME=value` lines. Checked: nothing
//! panics (no arithmetic overflow either), and a configuration that validates keeps every
//! invariant the daemon relies on, computed here without overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcelld::config::{Config, OUTPUT_CEILING, SOURCE_CEILING};
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (toml_text, env_text) = match text.split_once("#ENV\n") {
        Some((t, e)) => (t, e),
        None => (text, ""),
    };
    let env: Vec<(String, String)> = env_text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let mut cfg = match Config::parse(Path::new("fuzz.toml"), toml_text) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.to_string();
            if env.is_empty() {
                return;
            }
            Config::default()
        }
    };
    if let Err(e) = cfg.apply_env(env) {
        let _ = e.to_string();
        return;
    }
    match cfg.validate() {
        Ok(()) => {
            let l = &cfg.limits;
            let d = &cfg.daemon;
            for v in [
                l.max_source_bytes,
                l.max_fuel,
                l.max_guest_memory_bytes,
                l.max_stdout_bytes,
                l.max_stderr_bytes,
                l.max_concurrent_sessions,
                l.max_file_bytes,
                l.max_session_files_bytes,
            ] {
                assert!(v > 0);
            }
            assert!(l.max_source_bytes <= SOURCE_CEILING);
            assert!(
                l.max_stdout_bytes as u128 + l.max_stderr_bytes as u128 <= OUTPUT_CEILING as u128,
                "kept output {} + {} above the protocol ceiling",
                l.max_stdout_bytes,
                l.max_stderr_bytes
            );
            assert!(l.max_guest_memory_bytes <= l.max_aggregate_guest_memory_bytes);
            assert!(l.max_worker_memory_bytes <= l.max_aggregate_worker_memory_bytes);
            assert!(l.max_worker_memory_bytes > l.max_guest_memory_bytes);
            assert!(l.max_file_bytes <= l.max_session_files_bytes);
            let w = l.execution_wall_time_seconds;
            assert!(w.is_finite() && w > 0.0 && w <= 86_400.0);
            // The daemon turns these into Durations: must not panic.
            let _ = std::time::Duration::from_secs_f64(w);
            let _ = std::time::Duration::from_secs_f64(d.worker_start_timeout_seconds);
            let _ = std::time::Duration::from_secs_f64(d.kill_grace_seconds);
            assert!(d.worker_uid_count > 0 && d.worker_uid_base >= 1000);
            assert!((d.worker_uid_base as u64 + d.worker_uid_count as u64) < u32::MAX as u64 - 1);
            assert!(!d.cgroup_name.is_empty() && d.cgroup_name.len() <= 64);
            assert!(!d.cgroup_name.contains('/') && d.cgroup_name != "." && d.cgroup_name != "..");
            for e in cfg.environments() {
                assert!(e.pool_min <= e.pool_max);
                assert!(e.pool_max as u64 <= l.max_concurrent_sessions);
            }
            assert!(!d.languages.is_empty());
            // cpu.max quota as the daemon computes it.
            let _ = (d.worker_cpus * 100_000.0) as u64;
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
