//! `sandcelld`: the sandcell system service. See sandcelld(8).

use anyhow::{Context, bail};
use clap::Parser;
use sandcell_proto::kernel::{Frame, Status};
use sandcelld::auth::SocketPermissions;
use sandcelld::cgroup::{self, Backend};
use sandcelld::config::{Config, DEFAULT_CONFIG_PATH};
use sandcelld::core::{Core, Options};
use sandcelld::session::Caller;
use sandcelld::{notify, varlink};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Runs untrusted Python and R code cells in confined workers, for local gateways.
#[derive(Debug, Parser)]
#[command(name = "sandcelld", version, about)]
struct Args {
    /// Configuration file (TOML). A missing default file means built-in defaults.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Listen on this socket path instead of taking the socket from systemd.
    #[arg(long, value_name = "PATH")]
    listen: Option<PathBuf>,
    /// Validate the configuration (file and SANDCELL_* environment), print it, and exit.
    #[arg(long)]
    check_config: bool,
    /// DEVELOPMENT ONLY: run workers without cgroups and with best-effort confinement
    /// (every missing layer is skipped). Never use in production.
    #[arg(long)]
    insecure_dev: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDCELL_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let (path, required) = match &args.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
    };
    let config = match Config::load(&path, required, std::env::vars()) {
        Ok(c) => c,
        Err(e) => {
            // EX_CONFIG (sysexits.h): a permanent failure the unit does not retry
            // (RestartPreventExitStatus=78).
            eprintln!("sandcelld: configuration refused: {e}");
            std::process::exit(78);
        }
    };
    if args.check_config {
        println!("{config:#?}");
        println!("configuration OK ({})", path.display());
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args, config, path))
}

fn take_listener(args: &Args) -> anyhow::Result<(UnixListener, bool)> {
    let mut fds = listenfd::ListenFd::from_env();
    if fds.len() > 0 {
        // Prefer the descriptor named "varlink" (FileDescriptorName=), else the first.
        let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
        let idx = names.split(':').position(|n| n == "varlink").unwrap_or(0);
        let l = fds
            .take_unix_listener(idx)?
            .context("LISTEN_FDS has no Unix listening socket")?;
        l.set_nonblocking(true)?;
        return Ok((UnixListener::from_std(l)?, true));
    }
    let Some(p) = &args.listen else {
        bail!("no socket: start under systemd socket activation or pass --listen PATH");
    };
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_socket_like() => std::fs::remove_file(p)?,
        Ok(_) => bail!("{} exists and is not a socket", p.display()),
        Err(_) => {}
    }
    let l = UnixListener::bind(p).with_context(|| format!("binding {}", p.display()))?;
    // Owner and group only, as the shipped socket unit (SocketMode=0660).
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o660))?;
    Ok((l, false))
}

trait SocketLike {
    fn is_socket_like(&self) -> bool;
}
impl SocketLike for std::fs::FileType {
    fn is_socket_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_socket()
    }
}

fn prepare_state_dir(config: &Config) -> anyhow::Result<()> {
    let dir = sandcelld::core::sessions_dir(config);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Traversable, not listable: a worker may reach its own directory only.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?;
    // Directories left by a crashed predecessor: their workers are swept with the cgroups.
    for e in std::fs::read_dir(&dir)?.flatten() {
        if let Err(err) = std::fs::remove_dir_all(e.path()) {
            tracing::warn!(path = %e.path().display(), error = %err, "removing stale session directory");
        }
    }
    Ok(())
}

async fn run(args: Args, config: Config, config_path: PathBuf) -> anyhow::Result<()> {
    let (listener, activated) = take_listener(&args)?;
    let root = nix::unistd::geteuid().is_root();
    let (backend, options): (Arc<dyn Backend>, Options) = if args.insecure_dev {
        tracing::warn!(
            "--insecure-dev: workers run WITHOUT cgroup limits and with best-effort confinement"
        );
        (
            Arc::new(cgroup::Unconfined),
            Options {
                enforcement: sandcell_confine::Enforcement::BestEffort,
                per_session_uids: root,
            },
        )
    } else {
        if !root {
            bail!(
                "sandcelld must run as root to confine workers (or pass --insecure-dev for development)"
            );
        }
        let check = sandcell_confine::self_check().context("confinement self-check failed")?;
        // Fail closed: any missing layer refuses start-up, with the hint for the operator.
        check
            .require_strict()
            .context("confinement self-check failed")?;
        tracing::info!(?check, "confinement self-check passed");
        let backend: Arc<dyn Backend> = Arc::from(
            cgroup::detect(&cgroup::DetectConfig {
                v1_name: config.daemon.cgroup_name.clone(),
                ..Default::default()
            })
            .context("cgroup setup failed")?,
        );
        (
            backend,
            Options {
                enforcement: sandcell_confine::Enforcement::Strict,
                per_session_uids: true,
            },
        )
    };
    let swept = backend
        .sweep_stale()
        .context("sweeping stale session cgroups")?;
    if swept > 0 {
        tracing::warn!(
            swept,
            "killed and removed session groups left by a previous daemon"
        );
    }
    prepare_state_dir(&config)?;
    let idle_exit = config.daemon.idle_exit_seconds;
    let languages = config.daemon.languages.clone();
    let core = Core::new(config, options, backend, Arc::new(SocketPermissions));
    tracing::info!(cgroups = core.cgroup_mode(), activated, "starting");

    for lang in &languages {
        probe(&core, lang)
            .await
            .with_context(|| format!("readiness probe ({lang}) failed"))?;
    }
    // ---- issue #5: D-Bus control plane + polkit authority (sandcelld::dbus) ----
    // Started after the readiness probe and before the Varlink socket is served, so polkit
    // (when the system bus and polkitd answer) decides from the first client on; without a
    // system bus the socket's permissions stay the only gate. `stop_tx` is created here so
    // the D-Bus supervisor stops with the rest.
    let (stop_tx, stop_rx) = watch::channel(false);
    let dbus = sandcelld::dbus::start(
        core.clone(),
        sandcelld::dbus::Settings {
            config_path: config_path.clone(),
            config_required: args.config.is_some(),
        },
        stop_rx.clone(),
    )
    .await;
    // ---- end issue #5 ----

    core.start_pool();
    notify::ready(&status_line(&core));
    tracing::info!("ready to serve");

    let server = tokio::spawn(varlink::serve(core.clone(), listener, stop_rx));
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let watchdog = notify::watchdog_interval();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_busy = Instant::now();
    let mut last_watchdog = Instant::now();
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: stopping"); break; }
            _ = int.recv() => { tracing::info!("SIGINT: stopping"); break; }
            _ = hup.recv() => {
                match Config::load(&config_path, args.config.is_some(), std::env::vars()) {
                    Ok(c) => { core.reload(c); tracing::info!("configuration reloaded; new limits apply to new sessions"); }
                    Err(e) => tracing::error!(error = %e, "reload refused; the previous configuration stays in force"),
                }
            }
            _ = tick.tick() => {
                notify::status(&status_line(&core));
                if let Some(every) = watchdog && last_watchdog.elapsed() >= every {
                    notify::watchdog();
                    last_watchdog = Instant::now();
                }
                if core.sessions().is_empty() && core.connection_count() == 0 {
                    if activated && idle_exit > 0 && last_busy.elapsed() >= Duration::from_secs(idle_exit) {
                        tracing::info!(idle_exit, "idle: exiting; systemd starts the daemon again on the next connection");
                        break;
                    }
                } else {
                    last_busy = Instant::now();
                }
            }
        }
    }
    notify::stopping();
    let _ = stop_tx.send(true);
    let _ = server.await;
    if let Some(d) = dbus {
        let _ = d.await; // issue #5: releases the bus name
    }
    core.shutdown().await;
    if let Some(p) = &args.listen {
        let _ = std::fs::remove_file(p);
    }
    tracing::info!("stopped; every worker is reaped");
    Ok(())
}

fn status_line(core: &Core) -> String {
    let (max, used) = core.admission();
    format!(
        "{} sessions (max {}), {} connections, cgroups {}",
        used.sessions,
        max.sessions,
        core.connection_count(),
        core.cgroup_mode()
    )
}

/// Starts a worker through the normal path and runs a trivial cell.
async fn probe(core: &Arc<Core>, language: &str) -> anyhow::Result<()> {
    let caller = Caller {
        uid: 0,
        gid: 0,
        pid: std::process::id(),
        connection: 0,
        subject: sandcelld::session::Subject::Daemon,
    };
    let code = match language {
        "r" => "cat(1, '\\n', sep = '')",
        _ => "print(1)",
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Frame>(16);
    core.run(&caller, language, code.into(), None, tx)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out = String::new();
    while let Some(f) = rx.recv().await {
        if let Some(o) = f.output {
            out.push_str(&o.text);
        }
        if let Some(r) = f.result {
            if r.status != Status::Ok || out != "1\n" {
                bail!(
                    "probe cell ended {:?} with output {out:?} (error: {:?})",
                    r.status,
                    r.error
                );
            }
            // Ready means idle: the probe's worker is reaped and its charge released.
            let t0 = Instant::now();
            while !core.sessions().is_empty() {
                if t0.elapsed() > Duration::from_secs(10) {
                    bail!("probe session was not released");
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            return Ok(());
        }
    }
    bail!("probe cell produced no result")
}
