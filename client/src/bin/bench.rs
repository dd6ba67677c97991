//! `sandcell-bench`: latency, throughput and memory figures of a running sandcelld.
//!
//! Prints one JSON object per measurement and a table at the end; it asserts nothing (figures
//! go in reports, not in timed tests). `scripts/bench.sh` starts a daemon, runs this, and puts
//! Eryx's in-process baseline (`sandcell-python-runtime bench`) beside it.

use clap::Parser;
use sandcell_client::{Client, Status};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Measure a running sandcelld.
#[derive(Debug, Parser)]
struct Args {
    /// Socket of the daemon.
    #[arg(long)]
    socket: PathBuf,
    /// pid of the daemon, for its resident memory.
    #[arg(long)]
    daemon_pid: Option<u32>,
    /// Language to measure.
    #[arg(long, default_value = "python")]
    language: String,
    /// Environment to measure (e.g. `pydata`); unset: the language's default.
    #[arg(long)]
    environment: Option<String>,
    /// Sequential samples per latency figure.
    #[arg(long, default_value_t = 50)]
    iterations: usize,
    /// Concurrency levels for throughput (`0` alone skips throughput).
    #[arg(long, value_delimiter = ',', default_value = "1,2,8")]
    clients: Vec<usize>,
    /// Label printed with every figure (e.g. `cold`, `warm`).
    #[arg(long, default_value = "")]
    label: String,
    /// Seconds per throughput level.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Concurrent sessions for session-cell throughput (`0` alone skips it).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    sessions: Vec<usize>,
    /// cgroup v1 group name of the daemon (`cgroup_name`), to read per-session memory from
    /// `/sys/fs/cgroup/memory/<name>/sessions/*/memory.usage_in_bytes`.
    #[arg(long)]
    cgroup_name: Option<String>,
    /// Idle sessions to open for the memory figure (0 skips it).
    #[arg(long, default_value_t = 20)]
    idle_sessions: usize,
    /// Milliseconds to wait (untimed) before each one-shot and session-open latency sample,
    /// so that a warm pool refills between samples: with a pool, the figures are then those
    /// of a request that finds a warm worker. 0 measures back-to-back requests.
    #[arg(long, default_value_t = 0)]
    pace_ms: u64,
    /// Cells for the session-cell latency figure (default: 4 x `--iterations`), all in one
    /// open session, back to back. With `--iterations 0` only this figure is measured.
    #[arg(long)]
    cells: Option<usize>,
}

fn trivial(language: &str) -> &'static str {
    if language == "r" {
        "cat(1, '\\n')"
    } else {
        "print(1)"
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Prints one latency figure as JSON (`p50`, `p99`, `max`, milliseconds) and returns its p50
/// and p99.
fn report(name: &str, mut ms: Vec<f64>) -> (f64, f64) {
    let (p50, p99) = (percentile(&mut ms, 0.5), percentile(&mut ms, 0.99));
    let max = percentile(&mut ms, 1.0);
    println!(
        "{}",
        serde_json::json!({"figure": name, "unit": "ms", "samples": ms.len(), "p50": p50, "p99": p99, "max": max})
    );
    (p50, p99)
}

fn rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let code = trivial(&a.language);
    let env = a.environment.as_deref();
    let mut table: Vec<(String, String)> = Vec::new();
    let mut c = Client::connect(&a.socket).await?;

    // Warm up (page cache, first worker).
    for _ in 0..3 {
        c.run_collect_in(&a.language, env, code, None).await?;
    }
    let mut ms = Vec::new();
    let pace = Duration::from_millis(a.pace_ms);
    for _ in 0..a.iterations {
        tokio::time::sleep(pace).await;
        let t = Instant::now();
        let out = c.run_collect_in(&a.language, env, code, None).await?;
        anyhow::ensure!(
            out.result.status == Status::Ok,
            "one-shot cell failed: {:?}",
            out.result
        );
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    if !ms.is_empty() {
        let (p50, p99) = report("oneshot_latency", ms);
        table.push((
            "one-shot trivial cell (new worker each)".into(),
            format!("p50 {p50:.2} ms, p99 {p99:.2} ms"),
        ));
    }

    // open + one trivial cell + close: what a short-lived session costs a client.
    let mut ms = Vec::new();
    for _ in 0..a.iterations {
        tokio::time::sleep(pace).await;
        let t = Instant::now();
        let s = c.open_in(&a.language, env, None, None).await?.session;
        let out = c.execute_collect(&s, code).await?;
        c.close(&s).await?;
        anyhow::ensure!(
            out.result.status == Status::Ok,
            "session cell failed: {:?}",
            out.result
        );
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    if !ms.is_empty() {
        let (p50, p99) = report("open_cell_close_latency", ms);
        table.push((
            "open + trivial cell + close".into(),
            format!("p50 {p50:.2} ms, p99 {p99:.2} ms"),
        ));
    }

    tokio::time::sleep(pace).await;
    let t = Instant::now();
    let s = c.open_in(&a.language, env, None, None).await?.session;
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "{}",
        serde_json::json!({"figure": "session_open", "unit": "ms", "value": open_ms})
    );
    table.push(("session open".into(), format!("{open_ms:.2} ms")));
    let mut ms = Vec::new();
    for _ in 0..a.cells.unwrap_or(a.iterations * 4) {
        let t = Instant::now();
        let out = c.execute_collect(&s, code).await?;
        anyhow::ensure!(
            out.result.status == Status::Ok,
            "session cell failed: {:?}",
            out.result
        );
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (p50, p99) = report("session_cell_latency", ms);
    table.push((
        "session cell, trivial".into(),
        format!("p50 {p50:.2} ms, p99 {p99:.2} ms"),
    ));
    c.close(&s).await?;

    for &n in a.clients.iter().filter(|&&n| n > 0) {
        let deadline = Instant::now() + Duration::from_secs_f64(a.seconds);
        let mut tasks = Vec::new();
        for _ in 0..n {
            let socket = a.socket.clone();
            let lang = a.language.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = Client::connect(&socket).await?;
                let (mut ok, mut refused) = (0u64, 0u64);
                while Instant::now() < deadline {
                    match c.run_collect(&lang, trivial(&lang), None).await {
                        Ok(o) if o.result.status == Status::Ok => ok += 1,
                        Ok(o) => anyhow::bail!("cell failed: {:?}", o.result),
                        Err(sandcell_client::Error::Kernel(_)) => refused += 1,
                        Err(e) => return Err(e.into()),
                    }
                }
                anyhow::Ok((ok, refused))
            }));
        }
        let t0 = Instant::now();
        let (mut ok, mut refused) = (0, 0);
        for t in tasks {
            let (o, r) = t.await??;
            ok += o;
            refused += r;
        }
        let secs = t0.elapsed().as_secs_f64();
        let rate = ok as f64 / secs;
        println!(
            "{}",
            serde_json::json!({"figure": "oneshot_throughput", "clients": n, "cells_per_second": rate, "refused": refused})
        );
        table.push((
            format!("one-shot throughput, {n} clients"),
            format!("{rate:.1} cells/s ({refused} refused)"),
        ));
    }

    for &n in a.sessions.iter().filter(|&&n| n > 0) {
        let deadline = Instant::now() + Duration::from_secs_f64(a.seconds);
        let mut tasks = Vec::new();
        for _ in 0..n {
            let socket = a.socket.clone();
            let lang = a.language.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = Client::connect(&socket).await?;
                let s = c.open(&lang, None, None).await?.session;
                let mut ok = 0u64;
                while Instant::now() < deadline {
                    let o = c.execute_collect(&s, trivial(&lang)).await?;
                    anyhow::ensure!(o.result.status == Status::Ok, "cell failed: {:?}", o.result);
                    ok += 1;
                }
                c.close(&s).await?;
                anyhow::Ok(ok)
            }));
        }
        let t0 = Instant::now();
        let mut ok = 0;
        for t in tasks {
            ok += t.await??;
        }
        let rate = ok as f64 / t0.elapsed().as_secs_f64();
        println!(
            "{}",
            serde_json::json!({"figure": "session_cell_throughput", "sessions": n, "cells_per_second": rate})
        );
        table.push((
            format!("session cells/s, {n} sessions"),
            format!("{rate:.0} cells/s"),
        ));
    }

    if let Some(pid) = a.daemon_pid {
        let idle = rss(pid).unwrap_or(0);
        let mut sessions = Vec::new();
        let mut conns = Vec::new();
        for _ in 0..a.idle_sessions {
            let mut c = Client::connect(&a.socket).await?;
            match c.open_in(&a.language, env, None, None).await {
                Ok(o) => sessions.push(o.session),
                Err(e) => {
                    eprintln!("stopped opening sessions: {e}");
                    break;
                }
            }
            conns.push(c);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let busy = rss(pid).unwrap_or(0);
        if let Some(name) = &a.cgroup_name {
            let dir = format!("/sys/fs/cgroup/memory/{name}/sessions");
            let per: Vec<u64> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    std::fs::read_to_string(e.path().join("memory.usage_in_bytes"))
                        .ok()?
                        .trim()
                        .parse()
                        .ok()
                })
                .collect();
            if !per.is_empty() {
                let mean = per.iter().sum::<u64>() as f64 / per.len() as f64;
                println!(
                    "{}",
                    serde_json::json!({"figure": "session_cgroup_memory", "sessions": per.len(), "mean_bytes": mean})
                );
                table.push((
                    "worker memory per idle session (cgroup)".into(),
                    format!("{:.1} MiB", mean / 1048576.0),
                ));
            }
        }
        let per = if sessions.is_empty() {
            0.0
        } else {
            (busy as f64 - idle as f64) / sessions.len() as f64
        };
        println!(
            "{}",
            serde_json::json!({"figure": "daemon_rss", "idle_bytes": idle, "with_sessions": sessions.len(), "bytes": busy, "per_session_bytes": per})
        );
        table.push((
            "daemon RSS idle".into(),
            format!("{:.1} MiB", idle as f64 / 1048576.0),
        ));
        table.push((
            format!("daemon RSS with {} idle sessions", sessions.len()),
            format!(
                "{:.1} MiB ({:.1} KiB per session)",
                busy as f64 / 1048576.0,
                per / 1024.0
            ),
        ));
        drop(conns);
    }

    println!();
    println!("-- {} {}", a.language, a.label);
    for (k, v) in table {
        println!("{k:<45} {v}");
    }
    Ok(())
}
