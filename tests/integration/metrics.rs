//! The capacity file (`metrics_file`) against the real daemon: it appears within its interval,
//! every line parses as the Prometheus text exposition format (a strict parser below), its
//! figures follow a session opening, running cells and closing, a reader never sees part of a
//! file while it is rewritten, an empty path turns it off (also by reload, which removes it),
//! a bad interval or path refuses start-up with the key named, and a clean exit (stop, idle
//! exit) removes it. `admission_dbus.rs` compares it with the D-Bus properties.

use crate::common;

use common::{Daemon, eventually};
use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One parsed sample: the metric name and its labels in the order written.
type Series = (String, Vec<(String, String)>);

/// A parsed exposition: samples with their values, and each family's type.
#[derive(Debug, Default)]
struct Exposition {
    samples: BTreeMap<Series, f64>,
    types: BTreeMap<String, String>,
}

impl Exposition {
    /// The value of `name` with the labels `labels` besides `node` (which every sample has).
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples.iter().find_map(|((n, l), v)| {
            let rest: Vec<(&str, &str)> = l
                .iter()
                .filter(|(k, _)| k != "node")
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            (n == name && rest == labels).then_some(*v)
        })
    }

    fn value(&self, name: &str) -> f64 {
        self.get(name, &[])
            .unwrap_or_else(|| panic!("{name} is not in the file"))
    }
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_' || (colon && c == b':'))
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || (colon && c == b':'))
}

/// Parses `text` strictly as the text exposition format 0.0.4 as this daemon writes it (only
/// gauges and counters): `# HELP name text` and `# TYPE name gauge|counter` once per family,
/// before its samples; samples `name{label="value",...} value` with the escapes `\\`, `\"`
/// and `\n` only, contiguous per family, no series twice, no timestamps (the textfile
/// collector refuses them); counters end in `_total`; the text ends with a line feed.
fn parse(text: &str) -> Result<Exposition, String> {
    if !text.ends_with('\n') {
        return Err("no line feed at the end".into());
    }
    let mut out = Exposition::default();
    let mut helps = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut done: Vec<String> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let err = |why: &str| Err(format!("line {}: {why}: {line:?}", n + 1));
        if let Some(rest) = line.strip_prefix("# ") {
            let (kw, rest) = rest.split_once(' ').unwrap_or((rest, ""));
            let (name, arg) = rest.split_once(' ').unwrap_or((rest, ""));
            if !is_name(name, true) {
                return err("bad metric name");
            }
            if current.as_deref() != Some(name) {
                if done.iter().any(|d| d == name) {
                    return err("family written twice");
                }
                if let Some(c) = current.take() {
                    done.push(c);
                }
                current = Some(name.to_owned());
            }
            match kw {
                "HELP" => {
                    let mut chars = arg.chars();
                    while let Some(c) = chars.next() {
                        if c == '\\' && !matches!(chars.next(), Some('\\' | 'n')) {
                            return err("bad escape in HELP");
                        }
                    }
                    if helps.insert(name.to_owned(), arg.to_owned()).is_some() {
                        return err("second HELP");
                    }
                }
                "TYPE" => {
                    if !matches!(arg, "gauge" | "counter") {
                        return err("type is not gauge or counter");
                    }
                    if arg == "counter" && !name.ends_with("_total") {
                        return err("a counter without _total");
                    }
                    if out.types.insert(name.to_owned(), arg.to_owned()).is_some() {
                        return err("second TYPE");
                    }
                    if out.samples.keys().any(|(s, _)| s == name) {
                        return err("TYPE after samples");
                    }
                }
                _ => return err("a comment that is neither HELP nor TYPE"),
            }
            continue;
        }
        // A sample: name, optional {labels}, one space, the value, nothing else.
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| format!("line {}: no value: {line:?}", n + 1))?;
        let name = &line[..name_end];
        if !is_name(name, true) {
            return err("bad metric name");
        }
        if current.as_deref() != Some(name) || !out.types.contains_key(name) {
            return err("a sample outside its family (or before its TYPE)");
        }
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(r) = rest.strip_prefix('{') {
            let mut r = r;
            loop {
                if let Some(after) = r.strip_prefix('}') {
                    rest = after;
                    break;
                }
                let eq = r
                    .find('=')
                    .ok_or_else(|| format!("line {}: label without =", n + 1))?;
                let key = &r[..eq];
                if !is_name(key, false) || key.starts_with("__") {
                    return err("bad label name");
                }
                r = r[eq + 1..]
                    .strip_prefix('"')
                    .ok_or_else(|| format!("line {}: unquoted label value", n + 1))?;
                let mut value = String::new();
                let mut chars = r.char_indices();
                let end = loop {
                    match chars.next() {
                        None => return err("unterminated label value"),
                        Some((i, '"')) => break i,
                        Some((_, '\\')) => match chars.next() {
                            Some((_, '\\')) => value.push('\\'),
                            Some((_, '"')) => value.push('"'),
                            Some((_, 'n')) => value.push('\n'),
                            _ => return err("bad escape in a label value"),
                        },
                        Some((_, c)) => value.push(c),
                    }
                };
                if labels.iter().any(|(k, _): &(String, String)| k == key) {
                    return err("label twice");
                }
                labels.push((key.to_owned(), value));
                r = &r[end + 1..];
                if let Some(after) = r.strip_prefix(',') {
                    r = after;
                } else if !r.starts_with('}') {
                    return err("junk after a label value");
                }
            }
        }
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| format!("line {}: no space before the value", n + 1))?;
        if value.contains(' ') {
            return err("a timestamp or junk after the value");
        }
        let v: f64 = match value {
            "NaN" => f64::NAN,
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .map_err(|_| format!("line {}: bad value", n + 1))?,
        };
        if out.samples.insert((name.to_owned(), labels), v).is_some() {
            return err("series twice");
        }
    }
    Ok(out)
}

/// A directory for the file, readable by everyone (as /run/sandcell is).
fn metrics_dir() -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("sandcell-metrics-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// Reads and parses the file; panics with the text when it does not parse.
fn read(path: &Path) -> Option<Exposition> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}")))
}

/// Waits (at most `secs`) until the file parses and `f` holds of it; returns the last parse.
fn wait_for(path: &Path, secs: u64, what: &str, f: impl Fn(&Exposition) -> bool) -> Exposition {
    let t0 = Instant::now();
    loop {
        if let Some(e) = read(path)
            && f(&e)
        {
            return e;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s; the file:\n{}",
            std::fs::read_to_string(path).unwrap_or_else(|e| e.to_string())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_follows_sessions_is_never_torn_and_goes_at_exit() {
    let dir = metrics_dir();
    let path = dir.path().join("metrics.prom");
    let p = path.display().to_string();
    let t0 = Instant::now();
    let mut d = Daemon::start(&[
        ("SANDCELL_METRICS_FILE", &p),
        ("SANDCELL_METRICS_INTERVAL_SECONDS", "1"),
        ("SANDCELL_NODE_ID", "node-m.example"),
    ]);
    let ready = t0.elapsed();

    // It appears within one interval of readiness (the first tick writes it).
    assert!(
        eventually(Duration::from_secs(2), || path.exists()),
        "no file 2 s after readiness ({ready:?} to start)"
    );
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    // SAFETY: geteuid has no preconditions.
    assert_eq!(meta.uid(), unsafe { libc::geteuid() });
    let e = read(&path).unwrap();
    for (name, labels) in e.samples.keys() {
        assert_eq!(
            labels.first(),
            Some(&("node".to_string(), "node-m.example".to_string())),
            "{name}"
        );
    }
    assert_eq!(e.value("sandcell_up"), 1.0);
    let build: Vec<_> = e
        .samples
        .iter()
        .filter(|((n, _), _)| n == "sandcell_build_info")
        .collect();
    assert_eq!(build.len(), 1, "{build:?}");
    let ((_, labels), v) = build[0];
    assert_eq!(*v, 1.0);
    assert!(
        labels.contains(&("version".into(), env!("CARGO_PKG_VERSION").into())),
        "{labels:?}"
    );
    assert_eq!(e.types["sandcell_cells_total"], "counter");
    assert_eq!(e.value("sandcell_sessions"), 0.0);
    // The harness's budgets (tests/integration/common): 8 sessions, 8 x 128 MiB guest,
    // 8 GiB worker memory.
    assert_eq!(e.value("sandcell_admission_sessions_max"), 8.0);
    assert_eq!(
        e.value("sandcell_admission_guest_memory_max_bytes"),
        (8u64 << 27) as f64
    );
    assert_eq!(
        e.value("sandcell_admission_worker_memory_max_bytes"),
        (8u64 << 30) as f64
    );
    assert_eq!(e.value("sandcell_admission_sessions"), 0.0);
    assert_eq!(
        e.value("sandcell_retained_output_max_bytes"),
        (64u64 << 20) as f64
    );
    assert_eq!(e.value("sandcell_worker_uids_max"), 65_536.0);
    assert_eq!(e.value("sandcell_connections_max"), 1024.0);
    // One row per environment, as the D-Bus Pools property (no pools configured here).
    for env in ["pydata", "python", "r"] {
        assert_eq!(
            e.get("sandcell_pool_idle_workers", &[("environment", env)]),
            Some(0.0),
            "{env}"
        );
    }
    // The readiness probe's one-shot session counts.
    let opened0 = e.value("sandcell_sessions_opened_total");
    assert!(opened0 >= 1.0, "{opened0}");
    let ok0 = e.get("sandcell_cells_total", &[("status", "ok")]).unwrap();
    let err0 = e
        .get("sandcell_cells_total", &[("status", "error")])
        .unwrap();

    // A session: sessions, admission, uids, connections; its cells by status.
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&s, "print(1)").await.unwrap();
    let r = c.execute_collect(&s, "1/0").await.unwrap();
    assert_eq!(r.result.status.as_str(), "error");
    let e = wait_for(&path, 3, "the open session", |e| {
        e.value("sandcell_sessions") == 1.0
            && e.get("sandcell_cells_total", &[("status", "error")]) == Some(err0 + 1.0)
    });
    assert_eq!(e.value("sandcell_admission_sessions"), 1.0);
    assert!(e.value("sandcell_admission_guest_memory_bytes") > 0.0);
    assert!(e.value("sandcell_admission_worker_memory_bytes") > 0.0);
    assert_eq!(e.value("sandcell_connections"), 1.0);
    assert_eq!(e.value("sandcell_client_uids"), 1.0);
    if !common::insecure() {
        assert_eq!(e.value("sandcell_worker_uids"), 1.0);
    }
    assert_eq!(
        e.get("sandcell_cells_total", &[("status", "ok")]),
        Some(ok0 + 1.0)
    );
    assert_eq!(e.value("sandcell_sessions_opened_total"), opened0 + 1.0);

    // Rewrites are renames: a reader that reads the whole file in a loop while it is
    // rewritten sees complete files only, and more than one of them (new inodes).
    let reader = {
        let path = path.clone();
        std::thread::spawn(move || {
            let (mut reads, mut inodes, mut stamps) = (0u64, Vec::new(), Vec::new());
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(3500) {
                let f = std::fs::File::open(&path).unwrap();
                let ino = f.metadata().unwrap().ino();
                let text = std::io::read_to_string(f).unwrap();
                let e = parse(&text).unwrap_or_else(|e| panic!("read {reads}: {e}\n{text}"));
                // The last family is there: the file was read whole.
                assert!(e.get("sandcell_oom_kills_total", &[]).is_some(), "{text}");
                let stamp = e.value("sandcell_metrics_timestamp_seconds");
                if !inodes.contains(&ino) {
                    inodes.push(ino);
                }
                if !stamps.contains(&stamp.to_bits()) {
                    stamps.push(stamp.to_bits());
                }
                reads += 1;
            }
            (reads, inodes.len(), stamps.len())
        })
    };
    // Meanwhile the figures change, so the files differ.
    for _ in 0..3 {
        c.execute_collect(&s, "print(2)").await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (reads, inodes, stamps) = reader.join().unwrap();
    eprintln!("metrics: {reads} whole reads, {inodes} files, {stamps} timestamps");
    assert!(reads > 100, "{reads}");
    assert!(
        inodes >= 2 && stamps >= 2,
        "{inodes} inodes, {stamps} timestamps"
    );

    // Closed: back to zero, the end counted.
    let ended0 = read(&path).unwrap().value("sandcell_sessions_ended_total");
    c.close(&s).await.unwrap();
    let e = wait_for(&path, 3, "the closed session", |e| {
        e.value("sandcell_sessions") == 0.0 && e.value("sandcell_admission_sessions") == 0.0
    });
    assert_eq!(e.value("sandcell_sessions_ended_total"), ended0 + 1.0);
    assert_eq!(e.value("sandcell_admission_worker_memory_bytes"), 0.0);
    drop(c);

    // A clean exit removes the file (and leaves no temporary).
    let st = d
        .terminate(Duration::from_secs(20))
        .expect("the daemon stops");
    assert!(st.success(), "{st}");
    assert_eq!(entries(dir.path()), Vec::<String>::new());
    assert!(
        d.log_text().contains("metrics file removed"),
        "{}",
        d.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_path_turns_it_off_at_start_and_by_reload() {
    let dir = metrics_dir();
    let path = dir.path().join("node.prom");
    let conf = dir.path().join("sandcelld.toml");
    std::fs::write(
        &conf,
        format!(
            "[daemon]\nmetrics_file = \"{}\"\nmetrics_interval_seconds = 1\n",
            path.display()
        ),
    )
    .unwrap();

    // The environment's empty value wins over the file's path: nothing is written.
    let d = Daemon::start_with_config(&conf, &[("SANDCELL_METRICS_FILE", "")]);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(entries(dir.path()), ["sandcelld.toml"]);
    drop(d);

    // The file's path in force: written; a reload to "" removes it.
    let d = Daemon::start_with_config(&conf, &[("-SANDCELL_METRICS_FILE", "")]);
    wait_for(&path, 3, "the configured file", |e| {
        e.value("sandcell_up") == 1.0
    });
    std::fs::write(&conf, "[daemon]\nmetrics_file = \"\"\n").unwrap();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    assert!(
        eventually(Duration::from_secs(5), || !path.exists()),
        "still there after the reload turned it off:\n{}",
        d.log_text()
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(entries(dir.path()), ["sandcelld.toml"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_exit_removes_the_file() {
    if !std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .any(|d| d.join("systemd-socket-activate").exists())
    {
        sandcell_testing::skip!(
            "socket-activation",
            "systemd-socket-activate not installed (package systemd)"
        );
    }
    let dir = metrics_dir();
    let path = dir.path().join("metrics.prom");
    let p = path.display().to_string();
    let mut d = Daemon::start_activated(&[
        ("SANDCELL_IDLE_EXIT_SECONDS", "2"),
        ("SANDCELL_METRICS_FILE", &p),
        ("SANDCELL_METRICS_INTERVAL_SECONDS", "1"),
    ]);
    let mut c = d.client().await;
    c.run_collect("python", "print(1)", None).await.unwrap();
    wait_for(&path, 5, "the activated daemon's file", |e| {
        e.value("sandcell_up") == 1.0
    });
    drop(c);
    let mut status = None;
    eventually(Duration::from_secs(15), || {
        status = d.child.try_wait().ok().flatten();
        status.is_some()
    });
    let status = status.unwrap_or_else(|| panic!("no idle exit:\n{}", d.log_text()));
    assert!(status.success(), "{status:?}");
    assert!(d.log_text().contains("idle: exiting"), "{}", d.log_text());
    assert_eq!(entries(dir.path()), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_cannot_be_written_is_logged_once_and_the_daemon_serves_on() {
    let dir = metrics_dir();
    let path = dir.path().join("missing/metrics.prom");
    let d = Daemon::start(&[
        ("SANDCELL_METRICS_FILE", &path.display().to_string()),
        ("SANDCELL_METRICS_INTERVAL_SECONDS", "1"),
    ]);
    std::thread::sleep(Duration::from_millis(3500));
    let mut c = d.client().await;
    let out = c.run_collect("python", "print(6 * 7)", None).await.unwrap();
    assert_eq!(out.stdout, "42\n");
    // Four or more failed writes by now, one line about them (the next in 5 minutes).
    let log = d.log_text();
    let lines = log.matches("metrics file: write failed").count();
    assert_eq!(lines, 1, "{log}");
    assert_eq!(entries(dir.path()), Vec::<String>::new());
}

/// Starts sandcelld with `env` and an empty configuration; it must refuse with exit status
/// 78 and name `key` on stderr.
fn refused(env: &[(&str, &str)], key: &str) {
    let dir = metrics_dir();
    let conf = dir.path().join("none.toml");
    std::fs::write(&conf, "").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--listen")
        .arg(dir.path().join("k.sock"))
        .arg("--config")
        .arg(&conf)
        .env("SANDCELL_LOG", "info")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{env:?}: {stderr}");
    assert!(
        stderr.contains("configuration refused") && stderr.contains(key),
        "{env:?}: {stderr}"
    );
}

#[test]
fn a_bad_interval_or_path_refuses_start_up_naming_the_key() {
    refused(
        &[("SANDCELL_METRICS_INTERVAL_SECONDS", "0")],
        "invalid value for metrics_interval_seconds: 0 is not in [1, 3600]",
    );
    refused(
        &[("SANDCELL_METRICS_INTERVAL_SECONDS", "86400")],
        "invalid value for metrics_interval_seconds: 86400 is not in [1, 3600]",
    );
    refused(
        &[("SANDCELL_METRICS_INTERVAL_SECONDS", "5s")],
        "environment variable SANDCELL_METRICS_INTERVAL_SECONDS",
    );
    refused(
        &[("SANDCELL_METRICS_FILE", "metrics.prom")],
        "invalid value for metrics_file",
    );
}

#[test]
fn the_strict_parser_refuses_what_the_format_does_not_allow() {
    let ok = "# HELP a_total A \\\\ help\\n.\n# TYPE a_total counter\na_total{node=\"x\\\"y\\\\z\\n\",s=\"ok\"} 3\n";
    let e = parse(ok).unwrap();
    assert_eq!(e.get("a_total", &[("s", "ok")]), Some(3.0));
    assert!(e.samples.keys().any(|(_, l)| l[0].1 == "x\"y\\z\n"));
    for bad in [
        "# TYPE a gauge\na 1",                             // no final line feed
        "# TYPE a gauge\na{node=\"x\"} 1 1764660000000\n", // a timestamp
        "# TYPE a gauge\na{node=\"x\\t\"} 1\n",            // a bad escape
        "# TYPE a gauge\na{node=\"x} 1\n",                 // unterminated
        "a 1\n",                                           // no TYPE
        "# TYPE a counter\na 1\n",                         // counter without _total
        "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\na 2\n", // family not contiguous
        "# TYPE a gauge\na{n=\"1\"} 1\na{n=\"1\"} 2\n",    // series twice
        "# TYPE a gauge\na one\n",                         // not a number
        "# TYPE a gauge\na{n=\"1\",n=\"2\"} 1\n",          // label twice
        "# TYPE 1a gauge\n1a 1\n",                         // bad name
        "# comment\n",                                     // neither HELP nor TYPE
    ] {
        assert!(parse(bad).is_err(), "accepted: {bad:?}");
    }
}

/// The daemon's unit test of its renderer covers the escapes; this one holds the shipped path
/// default to the unit's writable directory.
#[test]
fn the_default_path_is_in_the_units_writable_directory() {
    let unit =
        std::fs::read_to_string(common::manifest_dir().join("../units/sandcelld.service")).unwrap();
    let default = PathBuf::from(sandcelld::config::DEFAULT_METRICS_FILE);
    let dir = default.parent().unwrap().display().to_string();
    assert!(
        unit.lines()
            .any(|l| l == format!("ReadWritePaths=-{dir}") || l == format!("ReadWritePaths={dir}")),
        "units/sandcelld.service does not make {dir} writable"
    );
    let socket =
        std::fs::read_to_string(common::manifest_dir().join("../units/sandcelld.socket")).unwrap();
    assert!(
        socket.contains(&format!("ListenStream={dir}/")),
        "{dir} is not the socket's directory"
    );
}
