//! `sandcell-python-runtime`: prepares, checks and benchmarks the Python runtime directory.
//!
//! ```text
//! sandcell-python-runtime prepare --out DIR [--force]
//! sandcell-python-runtime check --dir DIR
//! sandcell-python-runtime bench --dir DIR [--iterations N]
//! sandcell-python-runtime bench-worker --dir DIR [--worker BIN] [--code CODE] [--vary] [--iterations N]
//! ```
//!
//! `prepare` works offline from what crates.io ships in `eryx` and `eryx-runtime`: it links and
//! pre-initialises CPython (importing `PREINIT_IMPORTS` and installing the cell driver into
//! the snapshot), compiles the component ahead of time for this host, extracts Eryx's embedded
//! standard library into `DIR/python-stdlib` (never into the shared `/tmp/eryx-embedded`), and
//! writes `DIR/manifest.json` last. On a directory whose manifest is current it does nothing.
//! It prints a JSON summary on stdout. Exit status 0 on success, 1 on failure.
//!
//! `check` verifies the manifest and the cwasm hash, loads the runtime and runs `print(1)`;
//! exit status 0 when the output is `1\n`, 1 otherwise.
//!
//! `bench` prints JSON with p50/p99/mean milliseconds of in-process Eryx baselines: a fresh
//! sandbox per call, execute on an existing sandbox, a session execute, and a cell through the
//! worker's driver; plus state snapshot and rebuild costs.
//!
//! `bench-worker` drives a real `sandcell-worker-python` over its pipes and prints p50/p99 of
//! a cell's round trip (request written to `Done` read) next to a raw in-process Eryx session
//! execute of the same code (see `prepare_runtime/bench_worker.rs`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use eryx::{PythonExecutor, ResourceLimits, Sandbox, SessionExecutor};
use sandcell_worker_python::driver;
use sandcell_worker_python::interrupt::Interrupter;
use sandcell_worker_python::output::Forwarder;
use sandcell_worker_python::replies::{Lines, Replies};
use sandcell_worker_python::runtime::{
    self, Artifact, CWASM_FILE, ERYX_VERSION, MANIFEST_FILE, MANIFEST_FORMAT, Manifest,
    PREINIT_IMPORTS, PYTHON_VERSION, Preparation, STDLIB_DIR, StdlibInfo,
};
use sandcell_worker_python::session::{CellRequest, PySession};
use serde_json::json;
use std::sync::Arc;

#[path = "prepare_runtime/bench_worker.rs"]
mod bench_worker;

#[derive(Parser)]
#[command(
    name = "sandcell-python-runtime",
    about = "Prepare, check and benchmark sandcell's Python runtime"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Produce the runtime directory (offline); a no-op when it is current.
    Prepare {
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Rebuild even when the manifest is current.
        #[arg(long)]
        force: bool,
    },
    /// Verify a runtime directory and run `print(1)` with it.
    Check {
        /// Runtime directory.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Time raw session executions of CODE (after the driver is installed), for diagnosis.
    #[command(hide = true)]
    Probe {
        /// Runtime directory.
        #[arg(long)]
        dir: PathBuf,
        /// Setup code run once.
        #[arg(long, default_value = "")]
        setup: String,
        /// Code to time.
        #[arg(long)]
        code: String,
        /// Iterations.
        #[arg(long, default_value_t = 20)]
        iterations: usize,
    },
    /// Measure in-process Eryx baselines with a runtime directory.
    Bench {
        /// Runtime directory.
        #[arg(long)]
        dir: PathBuf,
        /// Iterations per measurement.
        #[arg(long, default_value_t = 100)]
        iterations: usize,
    },
    /// Drive a real worker over its pipes (as the daemon does, confinement best effort) and
    /// time each cell from writing its request to reading its `Done`, next to a raw
    /// in-process Eryx session execute of the same code.
    BenchWorker {
        /// Runtime directory.
        #[arg(long)]
        dir: PathBuf,
        /// Worker executable (default: `sandcell-worker-python` next to this one).
        #[arg(long)]
        worker: Option<PathBuf>,
        /// Cell source.
        #[arg(long, default_value = "print(1)")]
        code: String,
        /// Make every cell's source distinct (a trailing comment), so no compiled code is reused.
        #[arg(long)]
        vary: bool,
        /// Cells timed (after 20 untimed ones).
        #[arg(long, default_value_t = 1000)]
        iterations: usize,
    },
}

fn main() {
    let cli = Cli::parse();
    let r =
        match cli.cmd {
            Cmd::Prepare { out, force } => prepare_main(&out, force),
            Cmd::Check { dir } => runtime_block_on(check(&dir)).map(|v| println!("{v}")),
            Cmd::Probe {
                dir,
                setup,
                code,
                iterations,
            } => runtime_block_on(probe(&dir, &setup, &code, iterations.max(1)))
                .map(|v| println!("{v}")),
            Cmd::Bench { dir, iterations } => {
                runtime_block_on(bench(&dir, iterations.max(1))).map(|v| println!("{v}"))
            }
            Cmd::BenchWorker {
                dir,
                worker,
                code,
                vary,
                iterations,
            } => bench_worker::run(&dir, worker, &code, vary, iterations.max(1))
                .map(|v| println!("{v}")),
        };
    if let Err(e) = r {
        eprintln!("sandcell-python-runtime: {e:#}");
        std::process::exit(1);
    }
}

fn runtime_block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(f)
}

/// Peak resident set size of this process in bytes.
fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage fills the zeroed struct we pass; RUSAGE_SELF is always valid.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        (ru.ru_maxrss as u64) * 1024
    }
}

fn prepare_main(out: &Path, force: bool) -> Result<()> {
    if !force
        && let Ok(m) = Manifest::read(out)
        && m.is_current(out)
    {
        println!(
            "{}",
            json!({"status": "up-to-date", "dir": out, "manifest": m})
        );
        return Ok(());
    }
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    fs::set_permissions(out, fs::Permissions::from_mode(0o755))?;
    let staging = out.join(format!(".prepare-{}", std::process::id()));
    if staging.exists() {
        fs::remove_dir_all(&staging)?;
    }
    fs::create_dir(&staging)?;
    fs::set_permissions(&staging, fs::Permissions::from_mode(0o700))?;
    // Eryx extracts its embedded stdlib under std::env::temp_dir(); pointing TMPDIR at our own
    // fresh directory keeps it away from the shared /tmp/eryx-embedded.
    // SAFETY: no other thread exists yet (the async runtime starts below), so nothing reads
    // the environment concurrently.
    unsafe { std::env::set_var("TMPDIR", &staging) };
    let r = runtime_block_on(prepare(out, &staging));
    let _ = fs::remove_dir_all(&staging);
    let manifest = r?;
    println!(
        "{}",
        json!({"status": "prepared", "dir": out, "manifest": manifest})
    );
    Ok(())
}

/// Sets 0644 on files and 0755 on directories below `dir`.
fn normalise_modes(dir: &Path) -> Result<()> {
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let ty = entry.file_type()?;
        if ty.is_dir() {
            normalise_modes(&entry.path())?;
        } else if ty.is_file() {
            fs::set_permissions(entry.path(), fs::Permissions::from_mode(0o644))?;
        }
    }
    Ok(())
}

async fn prepare(out: &Path, staging: &Path) -> Result<Manifest> {
    let start = Instant::now();
    let extracted =
        eryx::embedded_stdlib::EmbeddedStdlib::get().context("extracting the embedded stdlib")?;
    if !extracted.path().starts_with(staging) {
        bail!(
            "Eryx extracted the stdlib to {} instead of the staging directory",
            extracted.path().display()
        );
    }
    let stdlib = staging.join(STDLIB_DIR);
    fs::rename(extracted.path(), &stdlib).context("moving the stdlib into place")?;
    normalise_modes(&stdlib)?;
    let t_stdlib = start.elapsed();

    let setup = driver::install_code();
    let component =
        eryx::preinit::pre_initialize(&stdlib, None, PREINIT_IMPORTS, &[], Some(&setup))
            .await
            .context("pre-initialising CPython")?;
    let t_preinit = start.elapsed();
    let cwasm = PythonExecutor::precompile(&component).context("compiling the component")?;
    let t_compile = start.elapsed();
    eprintln!(
        "stdlib {:.1}s, link+preinit {:.1}s, compile {:.1}s",
        t_stdlib.as_secs_f64(),
        (t_preinit - t_stdlib).as_secs_f64(),
        (t_compile - t_preinit).as_secs_f64()
    );
    let staged_cwasm = staging.join(CWASM_FILE);
    fs::write(&staged_cwasm, &cwasm)?;
    fs::set_permissions(&staged_cwasm, fs::Permissions::from_mode(0o644))?;
    let cwasm_sha = runtime::sha256_file(&staged_cwasm)?;
    let (files, bytes, tree_sha) = runtime::hash_tree(&stdlib)?;

    // Replace: the old manifest goes first, the new one comes last, so an interrupted prepare
    // never leaves a manifest describing other files.
    let manifest_path = out.join(MANIFEST_FILE);
    if manifest_path.exists() {
        fs::remove_file(&manifest_path)?;
    }
    let final_stdlib = out.join(STDLIB_DIR);
    if final_stdlib.exists() {
        fs::remove_dir_all(&final_stdlib)?;
    }
    fs::rename(&stdlib, &final_stdlib)?;
    fs::rename(&staged_cwasm, out.join(CWASM_FILE))?;

    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        eryx_version: ERYX_VERSION.into(),
        python_version: PYTHON_VERSION.into(),
        engine_config_version: PythonExecutor::ENGINE_CONFIG_VERSION,
        target: runtime::target(),
        cpu_level: "native".into(),
        cpu_features: runtime::host_cpu_features(),
        preinit_imports: PREINIT_IMPORTS.iter().map(|s| s.to_string()).collect(),
        driver_hash: driver::DRIVER_HASH,
        cwasm: Artifact {
            file: CWASM_FILE.into(),
            bytes: cwasm.len() as u64,
            sha256: cwasm_sha,
        },
        stdlib: StdlibInfo {
            dir: STDLIB_DIR.into(),
            files,
            bytes,
            sha256: tree_sha,
        },
        prepared: Preparation {
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            seconds: start.elapsed().as_secs_f64(),
            peak_rss_bytes: peak_rss_bytes(),
            component_bytes: component.len() as u64,
        },
    };
    let tmp = out.join(format!("{MANIFEST_FILE}.tmp"));
    fs::write(&tmp, serde_json::to_vec_pretty(&manifest)?)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
    fs::rename(&tmp, &manifest_path)?;
    check(out).await.context("checking the prepared runtime")?;
    Ok(manifest)
}

async fn check(dir: &Path) -> Result<serde_json::Value> {
    let manifest = Manifest::read(dir)?;
    if let Some(why) = manifest.incompatibility() {
        bail!("{why}");
    }
    let sha = runtime::sha256_file(&dir.join(&manifest.cwasm.file))?;
    if sha != manifest.cwasm.sha256 {
        bail!("{} does not match its manifest hash", manifest.cwasm.file);
    }
    let start = Instant::now();
    let (executor, _) = runtime::load_executor(dir)?;
    let load = start.elapsed();
    let out = executor
        .execute("print(1)")
        .run()
        .await
        .context("running print(1)")?;
    if out.stdout != b"1\n" {
        bail!(
            "print(1) printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(
        json!({"status": "ok", "dir": dir, "load_ms": ms(load), "first_execute_ms": ms(start.elapsed() - load)}),
    )
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// p50, p99 and mean of `samples`, in milliseconds.
fn summary(mut samples: Vec<Duration>) -> serde_json::Value {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    json!({"n": samples.len(), "p50_ms": ms(pick(0.5)), "p99_ms": ms(pick(0.99)), "mean_ms": ms(mean)})
}

/// A few small variables, a function and a class.
const SMALL_NAMESPACE: &str = "x = 1\ny = 'abc'\nz = [1, 2, 3]\ndef f(a):\n    return a + x\nclass C:\n    def m(self):\n        return f(1)\nc = C()\nimport math\n";
/// About 1 MB once pickled.
const ONE_MB_NAMESPACE: &str =
    "big = list(range(100000))\nd = {str(i): i for i in range(10000)}\ns = 'x' * 500000\n";

async fn probe(dir: &Path, setup: &str, code: &str, n: usize) -> Result<serde_json::Value> {
    let (executor, _) = runtime::load_executor(dir)?;
    let mut session =
        SessionExecutor::new_with_limits(Arc::new(executor), &[], &ResourceLimits::default())
            .await?;
    session.execute(driver::install_code()).run().await?;
    if !setup.is_empty() {
        session.execute(setup).run().await?;
    }
    let mut t = Vec::with_capacity(n);
    let mut last = None;
    for _ in 0..n {
        let s = Instant::now();
        last = Some(session.execute(code).run().await);
        t.push(s.elapsed());
    }
    let last = match last {
        Some(Ok(o)) => json!({"stdout": String::from_utf8_lossy(&o.stdout), "result": o.result}),
        Some(Err(e)) => json!({"error": e.to_string()}),
        None => json!(null),
    };
    Ok(json!({"timing": summary(t), "last": last}))
}

/// Runs one cell through the worker's session path.
async fn run_cell(
    ps: &mut PySession,
    output: &mut Forwarder,
    interrupter: &Interrupter,
    cell: u64,
    src: &str,
) -> Result<()> {
    let req = CellRequest {
        cell,
        source: src.as_bytes(),
        timeout: Duration::from_secs(60),
        fuel: None,
        max_output: 1 << 20,
        display: true,
        rich: false,
        nonce: None,
        host_calls: false,
    };
    interrupter.begin_cell();
    let mut lines = Lines::new();
    let r = ps.exec_cell(&req, output, interrupter, &mut lines).await;
    interrupter.end_cell();
    lines.push(&r?)?;
    output.replies().write(&mut lines)?;
    ps.finish_cell().await;
    Ok(())
}

async fn bench(dir: &Path, n: usize) -> Result<serde_json::Value> {
    let manifest = Manifest::read(dir)?;
    let cwasm = dir.join(&manifest.cwasm.file);
    let stdlib = dir.join(&manifest.stdlib.dir);
    let build = || -> Result<Sandbox> {
        // SAFETY: the same artefact load_executor accepts (checked below before first use).
        let b = unsafe { Sandbox::builder().with_precompiled_file(&cwasm) };
        Ok(b.with_python_stdlib(&stdlib)
            .with_trace_collection(false)
            .build()?)
    };
    runtime::load_executor(dir)?; // manifest, compatibility and ownership checks

    // (a) fresh sandbox per call: build + execute print(1).
    let mut fresh = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let sb = build()?;
        let r = sb.execute("print(1)").await?;
        fresh.push(t.elapsed());
        anyhow::ensure!(r.stdout == b"1\n", "unexpected output");
    }
    // (b) execute on an existing sandbox (fresh Python instance per call).
    let sb = build()?;
    let mut existing = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        sb.execute("print(1)").await?;
        existing.push(t.elapsed());
    }
    // (c) one cell in an in-process session, raw and through the worker's driver.
    let (executor, _) = runtime::load_executor(dir)?;
    let executor = std::sync::Arc::new(executor);
    let limits = ResourceLimits::default();
    let mut session = SessionExecutor::new_with_limits(executor.clone(), &[], &limits).await?;
    session.execute(driver::install_code()).run().await?;
    let mut raw = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        session.execute("print(1)").run().await?;
        raw.push(t.elapsed());
    }
    let mut via_driver = Vec::with_capacity(n);
    for i in 0..n {
        let code = driver::cell_code(i as u64 + 1, "print(1)", true, false);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let t = Instant::now();
        session
            .execute(code)
            .with_output_streaming(tx)
            .run()
            .await?;
        via_driver.push(t.elapsed());
        let mut outcome = false;
        while let Ok(m) = rx.try_recv() {
            outcome |= m.stream == driver::OUTCOME_STREAM;
        }
        anyhow::ensure!(outcome, "driver reported nothing");
    }
    // (d) Eryx's own snapshot_state (dill), for comparison with the driver's.
    session
        .execute(driver::cell_code(10_001, SMALL_NAMESPACE, true, false))
        .run()
        .await?;
    let mut eryx_snap_small = Vec::with_capacity(n.min(20));
    for _ in 0..n.min(20) {
        let t = Instant::now();
        session.snapshot_state().await?;
        eryx_snap_small.push(t.elapsed());
    }
    session
        .execute(driver::cell_code(10_002, ONE_MB_NAMESPACE, true, false))
        .run()
        .await?;
    let mut eryx_snap_big = Vec::with_capacity(n.min(5));
    for _ in 0..n.min(5) {
        let t = Instant::now();
        session.snapshot_state().await?;
        eryx_snap_big.push(t.elapsed());
    }
    drop(session);

    // (e) the worker's own session: a whole cell (driver + output + snapshot), the driver's
    // snapshot, and a rebuild (reset + driver + restore).
    let replies = Arc::new(Replies::new(
        fs::OpenOptions::new().write(true).open("/dev/null")?,
    ));
    let mut output = Forwarder::start(replies)?;
    let interrupter = Interrupter::default();
    let mut ps = PySession::new(executor.clone(), Some(128 * 1024 * 1024), None).await?;
    let mut worker_cell = Vec::with_capacity(n);
    let mut worker_cell_snap = Vec::with_capacity(n);
    for i in 0..n {
        let req = CellRequest {
            cell: i as u64 + 1,
            source: b"print(1)",
            timeout: Duration::from_secs(10),
            fuel: None,
            max_output: 1 << 20,
            display: true,
            rich: false,
            nonce: None,
            host_calls: false,
        };
        let t = Instant::now();
        interrupter.begin_cell();
        let mut lines = Lines::new();
        let done = ps
            .exec_cell(&req, &mut output, &interrupter, &mut lines)
            .await?;
        interrupter.end_cell();
        lines.push(&done)?;
        output.replies().write(&mut lines)?;
        worker_cell.push(t.elapsed());
        ps.finish_cell().await;
        worker_cell_snap.push(t.elapsed());
    }
    run_cell(&mut ps, &mut output, &interrupter, 100_001, SMALL_NAMESPACE).await?;
    let mut snap_small = Vec::with_capacity(n);
    let mut small_bytes = 0;
    for _ in 0..n {
        let (d, b) = ps.measure_snapshot().await.map_err(anyhow::Error::msg)?;
        snap_small.push(d);
        small_bytes = b;
    }
    let mut rebuild_small = Vec::with_capacity(n.min(50));
    for _ in 0..n.min(50) {
        let t = Instant::now();
        let (state, lost, _) = ps.force_rebuild().await;
        rebuild_small.push(t.elapsed());
        anyhow::ensure!(lost.is_none(), "rebuild lost state: {state:?} {lost:?}");
    }
    run_cell(
        &mut ps,
        &mut output,
        &interrupter,
        100_002,
        ONE_MB_NAMESPACE,
    )
    .await?;
    let mut snap_big = Vec::with_capacity(n.min(20));
    let mut big_bytes = 0;
    for _ in 0..n.min(20) {
        let (d, b) = ps.measure_snapshot().await.map_err(anyhow::Error::msg)?;
        snap_big.push(d);
        big_bytes = b;
    }
    let mut rebuild_big = Vec::with_capacity(n.min(10));
    for _ in 0..n.min(10) {
        let t = Instant::now();
        let (state, lost, _) = ps.force_rebuild().await;
        rebuild_big.push(t.elapsed());
        anyhow::ensure!(lost.is_none(), "rebuild lost state: {state:?} {lost:?}");
    }

    Ok(json!({
        "eryx": ERYX_VERSION,
        "iterations": n,
        "fresh_sandbox_build_and_execute": summary(fresh),
        "execute_on_existing_sandbox": summary(existing),
        "session_execute_raw": summary(raw),
        "session_cell_via_driver": summary(via_driver),
        "eryx_snapshot_state_small": summary(eryx_snap_small),
        "eryx_snapshot_state_1mb": summary(eryx_snap_big),
        "worker_cell_print1_until_done": summary(worker_cell),
        "worker_cell_print1_incl_snapshot": summary(worker_cell_snap),
        "driver_snapshot_small": summary(snap_small),
        "driver_snapshot_small_bytes": small_bytes,
        "driver_snapshot_1mb": summary(snap_big),
        "driver_snapshot_1mb_bytes": big_bytes,
        "rebuild_small": summary(rebuild_small),
        "rebuild_1mb": summary(rebuild_big),
        "peak_rss_bytes": peak_rss_bytes(),
    }))
}
