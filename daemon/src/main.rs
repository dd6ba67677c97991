//! `sandcelld`: the sandcell system service. See sandcelld(8).

use anyhow::{Context, bail};
use clap::Parser;
use sandcelld::auth::SocketPermissions;
use sandcelld::cgroup::{self, Backend};
use sandcelld::config::{Config, DEFAULT_CONFIG_PATH};
use sandcelld::core::Core;
use sandcelld::lifecycle::OnTerm;
use sandcelld::stages::Stages;
use sandcelld::worker::start::Options;
use sandcelld::{notify, varlink};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
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
    /// Validate the configuration (file and SANDCELL_* environment), print the configuration
    /// in force as a configuration file (every key with its value, derived values resolved,
    /// every environment served), and exit.
    #[arg(long)]
    check_config: bool,
    /// Print the kernel, its Landlock ABI, the cgroup mode and each confinement layer
    /// (active, substituted, missing) with the threats it covers, and exit: 0 when strict
    /// mode would start, 1 otherwise.
    #[arg(long)]
    check: bool,
    /// DEVELOPMENT ONLY: best-effort confinement (every missing layer is skipped) for an
    /// unprivileged daemon, without cgroups. As root, cgroups stay required. Never use in
    /// production.
    #[arg(long)]
    insecure_dev: bool,
    /// The main process of sandcell-sessions.service: hold the group where session groups
    /// live, outside sandcelld.service's, until SIGTERM (sandcelld(8), SESSIONS ACROSS
    /// RESTARTS).
    #[arg(long, hide = true)]
    hold_sessions: bool,
}

fn main() -> anyhow::Result<()> {
    // The start's stage timings (`sandcelld::timing`): from here to "ready to serve".
    let start_clock = sandcelld::stages::monotonic_us();
    let mut stages = Stages::new();
    // The listening socket of a previous image of this process (a re-exec in place), and the
    // children it left (this image reaps them), read while the process has one thread and
    // before it starts any child.
    // SAFETY: no thread has been started yet.
    let inherited = unsafe { sandcelld::reexec::take_inherited() };
    let inherited_children = if inherited.is_some() {
        sandcelld::reexec::inherited_children()
    } else {
        Vec::new()
    };
    // A session keeper (sandcelld(8), ADOPTION): started by the daemon only, never by hand.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(sandcelld::keeper::SUBCOMMAND) {
        sandcelld::keeper::main(&argv[2..]);
    }
    let args = Args::parse();
    stages.mark("args");
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDCELL_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    stages.mark("log");
    if args.hold_sessions {
        if let Err(e) = sandcelld::lifecycle::hold_sessions(Path::new("/sys/fs/cgroup")) {
            eprintln!("sandcelld --hold-sessions: {e}");
            std::process::exit(EX_CONFIG);
        }
        return Ok(());
    }
    if inherited.is_some() {
        // systemd's watchdog clock runs on across a re-exec in place: ping at once.
        if notify::watchdog_interval().is_some() {
            notify::watchdog();
        }
        sandcelld::reexec::reap_inherited(inherited_children);
    }
    let serving = !args.check_config && !args.check;
    // The confinement self-check forks test children and waits for them: it runs on a thread
    // of its own while the configuration is read and the runtime built (it needs neither).
    let self_check = serving.then(|| {
        std::thread::Builder::new()
            .name("self-check".into())
            .spawn(sandcell_confine::self_check)
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The system bus and polkit's first answer (sandcelld::dbus::Early), begun before the
    // configuration is read (neither depends on it): after a restart that kept sessions the
    // returning clients' first calls wait for polkit, so this is the start's longest path.
    let early_bus = serving.then(|| {
        let _in_runtime = runtime.enter();
        sandcelld::dbus::connect_early()
    });
    stages.mark("runtime");
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
        let node = sandcelld::node::resolve(config.daemon.node_id.as_deref());
        print!("{}", config.to_effective_toml(&node));
        if path.exists() {
            println!("# configuration OK ({})", path.display());
        } else {
            println!(
                "# configuration OK (built-in defaults and SANDCELL_* variables: {} does not exist)",
                path.display()
            );
        }
        return Ok(());
    }
    if args.check {
        std::process::exit(check(&config));
    }
    stages.mark("config");
    let self_check = self_check.context("no self-check")??;
    let early_bus = early_bus.context("no system bus attempt")?;
    let outcome = runtime.block_on(run(
        args,
        config,
        path,
        (stages, start_clock),
        (self_check, early_bus),
        inherited,
    ));
    if let Err(e) = &outcome
        && (e.downcast_ref::<Refusal>().is_some() || e.chain().any(|c| c.is::<Refusal>()))
    {
        eprintln!("sandcelld: refusing to start: {e:#}");
        std::process::exit(EX_CONFIG);
    }
    outcome
}

/// Exit status of a start-up refusal that restarting cannot cure (`EX_CONFIG`, sysexits.h):
/// the configuration is refused, the daemon is not root, the host cannot give the
/// confinement strict mode requires (Landlock, seccomp, namespaces), or no cgroup is
/// delegated. The unit's `RestartPreventExitStatus=78` then stops the restart loop; other
/// failures (a busy cgroup file, a readiness probe that failed) exit with 1 and are retried.
const EX_CONFIG: i32 = 78;

/// Marks a start-up error as a [`EX_CONFIG`] refusal (found anywhere in the error's chain).
#[derive(Debug)]
struct Refusal(&'static str);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Refusal {}

/// Wraps `e` as a refusal with context `what`.
fn refused(e: impl Into<anyhow::Error>, what: &'static str) -> anyhow::Error {
    e.into().context(Refusal(what))
}

/// The listening socket: the one a previous image passed on (a re-exec in place), else
/// systemd's (socket activation; the descriptor named "varlink", else the first), else a
/// socket bound at `--listen`. The second value: whether systemd's socket activation gave it.
fn take_listener(
    args: &Args,
    inherited: Option<sandcelld::reexec::Inherited>,
) -> anyhow::Result<(UnixListener, bool)> {
    if let Some(i) = inherited {
        use std::os::fd::FromRawFd;
        // Only a listening Unix socket is taken; anything else refuses the start.
        let fd = i.fd;
        if !sandcelld::sys::is_unix_listener(fd) {
            bail!("descriptor {fd} passed on by the previous image is not a listening Unix socket");
        }
        // SAFETY: the previous image of this process passed this descriptor on for this use
        // alone; it is owned from here on.
        let l = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
        l.set_nonblocking(true)?;
        nix::fcntl::fcntl(
            &l,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )?;
        return Ok((UnixListener::from_std(l)?, i.activated));
    }
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
        return Err(refused(
            anyhow::anyhow!("start under systemd socket activation or pass --listen PATH"),
            "no socket",
        ));
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

fn prepare_state_dir(config: &Config, keep: &[String]) -> anyhow::Result<()> {
    let dir = sandcelld::worker::start::sessions_dir(config);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Traversable, not listable: a worker may reach its own directory only.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?;
    // Directories left by a crashed predecessor: their workers are swept with the cgroups.
    // Its session file systems first (only a predecessor run in the host's mount namespace
    // leaves any: under the unit's PrivateMounts= they went with its namespace).
    let unmounted = sandcelld::session_fs::sweep_except(&dir, keep);
    if unmounted > 0 {
        tracing::warn!(unmounted, "unmounted stale session file systems");
    }
    for e in std::fs::read_dir(&dir)?.flatten() {
        if keep.iter().any(|id| e.file_name() == id.as_str()) {
            continue;
        }
        if let Err(err) = std::fs::remove_dir_all(e.path()) {
            tracing::warn!(path = %e.path().display(), error = %err, "removing stale session directory");
        }
    }
    Ok(())
}

/// The thread running [`sandcell_confine::self_check`].
type SelfCheckThread =
    std::thread::JoinHandle<Result<sandcell_confine::SelfCheck, sandcell_confine::Error>>;

/// Runs the daemon from the socket to its exit. `start`: the stage timings since `main` and
/// `CLOCK_MONOTONIC` there (microseconds), logged with "ready to serve"; `under_way`: the
/// confinement self-check and the first system bus connection, both begun in `main`.
async fn run(
    args: Args,
    config: Config,
    config_path: PathBuf,
    start: (Stages, u64),
    under_way: (SelfCheckThread, sandcelld::dbus::Early),
    inherited: Option<sandcelld::reexec::Inherited>,
) -> anyhow::Result<()> {
    let (mut stages, start_clock) = start;
    let (self_check, early_bus) = under_way;
    // These signal handlers first: until they are installed SIGHUP, SIGUSR1 and SIGUSR2
    // would end the process (their default action), which after a re-exec in place a second
    // SIGUSR1 could do while this image starts.
    // With sessions a previous daemon kept (records in the root-only adoption directory),
    // SIGTERM and SIGINT are registered now as well: a stop or a restart that arrives while
    // they are adopted is acted on once the daemon serves (ending or keeping every session,
    // as at any other time) instead of ending this process at once, which would leave the
    // sessions to their keepers until `adopt_timeout_seconds`. An adopting start does not
    // wait for the readiness probe, so that takes no longer than the adoption (when no
    // record passes, the start runs the probe first and the stop waits for it, seconds).
    // Without records a stop ends the start at once.
    let root = nix::unistd::geteuid().is_root();
    let records_left = root && sandcelld::records::any(&config.daemon.adopt_dir);
    let mut signals = Signals::new(records_left)?;
    // A re-exec in place blocked them across its execve; one that arrived since is pending
    // and now reaches these handlers (or, for SIGTERM and SIGINT without records, its
    // default action, as in any start).
    sandcelld::reexec::unblock_signals()?;
    // A stop that reached the previous image of this process while it handed its sessions
    // over for this exec: raised again now that it is handled (acted on once serving).
    if let Some(sig) = inherited.and_then(|i| i.pending_signal) {
        if !records_left {
            // Nothing was handed over: the stop ends this image at once.
            tracing::info!(
                signal = sig,
                "a stop arrived during the re-exec: no session to keep; exiting"
            );
            notify::stopping();
            return Ok(());
        }
        tracing::info!(
            signal = sig,
            "a stop arrived during the re-exec's hand-over: acted on once the sessions are adopted"
        );
        if let Ok(sig) = nix::sys::signal::Signal::try_from(sig) {
            let _ = nix::sys::signal::raise(sig);
        }
    }
    // After a re-exec in place systemd's watchdog keeps running while this image starts (a
    // reload, for systemd), and a start without sessions to adopt runs the readiness probe
    // first (seconds under load): the watchdog is pinged until the image is ready, after
    // which the main loop pings it.
    let starting = Arc::new(std::sync::atomic::AtomicBool::new(true));
    if inherited.is_some()
        && let Some(every) = notify::watchdog_interval()
    {
        let starting = starting.clone();
        tokio::spawn(async move {
            while starting.load(std::sync::atomic::Ordering::SeqCst) {
                notify::watchdog();
                tokio::time::sleep(every).await;
            }
        });
    }
    stages.mark("signals");
    // The capacity file (metrics_file): written from the tick below, removed at a clean exit.
    let mut metrics = sandcelld::metrics::Writer::new();
    let (listener, activated) = take_listener(&args, inherited)?;
    // Kept for a re-exec in place, which passes the socket on to the new image.
    let listener_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    // With sessions kept by a previous daemon (records in the root-only adoption directory)
    // and polkit as the authority, the clients coming back are accepted from here on and
    // polkit is asked about each while the cgroups, the sweep and the adoption run
    // (varlink::early); their calls are served once the core exists. The records are only a
    // hint here: a connection taken early gets nothing a later one would not.
    let early_accept = match early_bus.initial_authority() {
        Some(polkit) if records_left => Ok(varlink::early::accept_early(listener, polkit)),
        _ => Err(listener),
    };
    stages.mark("listener");
    let check = self_check
        .join()
        .map_err(|_| anyhow::anyhow!("the confinement self-check panicked"))?
        .map_err(|e| refused(e, "confinement self-check failed"))?;
    stages.mark("self_check");
    // Sessions a previous daemon kept for adoption: their keepers are asked for the workers
    // (on a thread, while the cgroups are set up) before anything is swept, and the sweep
    // spares what passes (sandcelld(8), ADOPTION). Not before the self-check's verdict: a
    // start it refuses touches no keeper and no record.
    let collecting = (root && (args.insecure_dev || check.require_strict().is_ok())).then(|| {
        let dir = config.daemon.adopt_dir.clone();
        std::thread::Builder::new()
            .name("adopt-collect".into())
            .spawn(move || sandcelld::adopt::collect(&dir))
    });
    if let Some(cap) = check.landlock_test_cap {
        tracing::warn!(
            cap,
            kernel_abi = ?check.kernel_landlock_abi,
            "TEST ONLY: {} lowers the Landlock ABI workers use (0: none); never set it in \
             production",
            sandcell_confine::landlock::TEST_ABI_ENV
        );
    }
    let (backend, options) = enforcement(&args, &config, root, &check)?;
    announce_confinement(&check, &backend, &options)?;
    stages.mark("cgroups");
    let found = match collecting {
        Some(t) => match t.context("starting the adoption thread")?.join() {
            Ok(Ok(f)) => Some(f),
            Ok(Err(e)) => {
                tracing::warn!(dir = %config.daemon.adopt_dir.display(), error = %e, "no adoption: sessions will end with this daemon");
                None
            }
            Err(_) => anyhow::bail!("collecting the kept sessions panicked"),
        },
        None => None,
    };
    let keep_ids = found.as_ref().map(|f| f.keep_ids()).unwrap_or_default();
    stages.mark("collect");
    // Sessions a previous daemon left (it died or stopped with them): their owner markers are
    // read before the sweep removes what they held, so their owners learn daemon_restarted.
    let previous = sandcelld::ended::take_markers(&config.daemon.state_dir);
    // The warm workers a predecessor that kept its sessions killed as it exited: their groups
    // are expected here, empty or with a worker the kernel is still tearing down.
    let pool_killed = if root {
        sandcelld::adopt::take_killed_pool(&config.daemon.adopt_dir)
    } else {
        Vec::new()
    };
    let swept = backend
        .sweep_stale_except(&keep_ids)
        .context("sweeping stale session cgroups")?;
    let killed = swept
        .populated
        .iter()
        .filter(|id| !pool_killed.contains(id))
        .count();
    if killed > 0 {
        tracing::warn!(
            swept = swept.groups,
            killed,
            "killed and removed session groups left by a previous daemon"
        );
    } else if swept.groups > 0 {
        tracing::info!(
            removed = swept.groups,
            "removed session groups left by a previous daemon; no worker was killed (they were \
             empty, or held the warm workers it killed as it exited)"
        );
    }
    stages.mark("sweep");
    prepare_state_dir(&config, &keep_ids)?;
    stages.mark("state_dir");
    let idle_exit = config.daemon.idle_exit_seconds;
    let adopt_keep = sandcelld::session::Keep {
        dir: config.daemon.adopt_dir.clone(),
        timeout: Duration::from_secs(config.daemon.adopt_timeout_seconds),
    };
    let core = Core::new(
        config,
        options,
        backend.clone(),
        Arc::new(SocketPermissions),
    );
    stages.mark("core");
    tracing::info!(cgroups = core.cgroup_mode(), activated, "starting");
    // How session files and the metrics file are opened: openat2, or the equivalent walk
    // where a seccomp filter (systemd's RestrictSUIDSGID=) or the kernel refuses openat2.
    tracing::info!(
        path_resolution = sandcelld::resolve::decide(),
        "path resolution"
    );

    // Egress under this service's sandbox: probed once, before any session, so that a unit
    // without the egress drop-ins refuses those environments' Opens with the reason.
    let with_egress: Vec<String> = core
        .config()
        .environments()
        .iter()
        .filter(|e| e.egress.is_some())
        .map(|e| e.name.clone())
        .collect();
    if !with_egress.is_empty() {
        match sandcelld::egress::availability() {
            Ok(()) => tracing::info!(environments = %with_egress.join(" "), "egress available"),
            Err(u) => {
                tracing::error!(environments = %with_egress.join(" "), reason = %u.detail, "egress unavailable: Open and Run of these environments are refused (EgressUnavailable)")
            }
        }
    }

    // With sessions to adopt, their owners wait for this daemon's readiness: the probe (one
    // worker start per environment, tens of seconds under emulation) would dominate the gap
    // from the event to the first adopted call answered. It runs after serving instead, in
    // the background (its reports are the same cached ones `ListEnvironments` gives). The
    // adopted workers are the evidence that the environments start.
    let adopting = found.as_ref().map_or(0, |f| f.adoptable.len());
    if adopting == 0 {
        // With records that no session passed, SIGTERM and SIGINT are handled already: a
        // stop during the probe (seconds) ends the start, which has nothing to keep, at once.
        tokio::select! {
            probed = probe_environments(&core) => probed?,
            sig = signals.stop_requested() => {
                tracing::info!(signal = sig, "stop requested during the readiness probe: exiting");
                notify::stopping();
                // Connections taken early are closed (their clients reconnect to the next
                // daemon), as at any stop.
                if let Ok(accepting) = early_accept {
                    let _ = accepting.finish().await;
                }
                core.shutdown().await;
                return Ok(());
            }
        }
        stages.mark("probe");
    } else {
        tracing::info!(
            sessions = adopting,
            "adopting sessions of the previous daemon: the readiness probe runs after the first \
             client is served, in the background"
        );
    }
    // `stop` ends the Varlink server and the D-Bus supervisor; `hold` stops accepting without
    // closing the socket: an exit or re-exec that keeps the sessions leaves new connections
    // waiting for the next daemon instead of cutting them.
    let (stop_tx, stop_rx) = watch::channel(false);
    let (hold_tx, hold_rx) = watch::channel(false);
    let (held_tx, mut held_rx) = watch::channel(false);
    // With sessions to adopt, the socket is served while they are adopted: connections made
    // during the restart are accepted and their authorization asked (polkit's answer takes
    // about as long as the adoption), while calls wait for the adoption (Core::hold_calls): a
    // cell's call on one session for that session's, any other call for the end. The
    // authority is the one the D-Bus start selects first; where it is only known after
    // polkit's first answer, the socket is served after the D-Bus start, as without sessions
    // to adopt.
    let (listener, early) = match early_accept {
        Ok(accepting) => accepting.finish().await?,
        Err(listener) => (listener, Vec::new()),
    };
    let (early_server, listener) = if adopting > 0 && early_bus.authority_known() {
        if let Some(polkit) = early_bus.initial_authority() {
            core.set_authority(polkit);
        }
        core.hold_calls();
        let server = tokio::spawn(varlink::serve(
            core.clone(),
            listener,
            early,
            stop_rx.clone(),
            hold_rx.clone(),
            held_tx.clone(),
        ));
        (Some(server), None)
    } else {
        (None, Some((listener, early)))
    };
    // The kept sessions are adopted after the probes (which need an idle daemon and room in
    // the budgets), most recently active first, each before any call on it is answered and
    // all before any other call; their keepers hold them meanwhile.
    match found {
        Some(found) => {
            core.enable_adoption(adopt_keep);
            sandcelld::adopt::finish(&core, &backend, found, &previous);
        }
        None => core.restore_ended(&previous),
    }
    core.release_calls();
    stages.mark("adopt");
    // The D-Bus control plane and the polkit authority (sandcelld::dbus).
    // Started after the readiness probe and before the Varlink socket is served (or, while
    // adopting, after the authority it selects first was set), so polkit (when the system bus
    // and polkitd answer) decides from the first client on; without a system bus the
    // socket's permissions stay the only gate.
    // With adopted sessions the first connection is made in the background: their owners'
    // first calls wait for polkit's first answer, not for the whole bus start-up as well.
    let settings = sandcelld::dbus::Settings {
        config_path: config_path.clone(),
        config_required: args.config.is_some(),
    };
    let dbus = if adopting > 0 {
        sandcelld::dbus::start_in_background(core.clone(), settings, stop_rx.clone(), early_bus)
            .await
    } else {
        sandcelld::dbus::start(core.clone(), settings, stop_rx.clone(), early_bus).await
    };

    // With adopted sessions, the warm pools' refill and the readiness probe (worker starts,
    // seconds of CPU each on a slow machine) wait for the first cell to finish and for the
    // first call of every connection accepted during the adoption to be answered, at most
    // ADOPTED_FIRST_WAIT: the adopted sessions' owners come back first.
    let first_cell = (adopting > 0).then(|| core.events());
    stages.mark("dbus");
    if first_cell.is_none() {
        core.start_pool();
    }
    notify::ready(&status_line(&core));
    starting.store(false, std::sync::atomic::Ordering::SeqCst);
    stages.mark("ready");
    tracing::info!("ready to serve");
    stages.log_daemon("daemon_start", start_clock);

    let server = match (early_server, listener) {
        (Some(s), _) => s,
        (None, Some((l, early))) => tokio::spawn(varlink::serve(
            core.clone(),
            l,
            early,
            stop_rx,
            hold_rx,
            held_tx,
        )),
        (None, None) => unreachable!("the listener is served early or here"),
    };
    // What a SIGTERM asks systemd is made ready now, off the stop's critical path.
    tokio::spawn(sandcelld::lifecycle::prepare());
    if let Some(mut events) = first_cell {
        let core = core.clone();
        tokio::spawn(async move {
            let first = async {
                loop {
                    match events.recv().await {
                        Ok(sandcelld::session::Event::CellFinished { .. }) => break,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                        _ => {}
                    }
                }
                core.early_callers_answered().await;
            };
            let _ = tokio::time::timeout(ADOPTED_FIRST_WAIT, first).await;
            drop(events);
            core.start_pool();
            probe_in_background(core).await;
        });
    }
    let stopped = serve_until_stopped(
        &mut signals,
        &core,
        &mut metrics,
        &config_path,
        args.config.is_some(),
        (activated && idle_exit > 0).then_some(idle_exit),
    )
    .await?;
    // SIGTERM during `systemctl restart` (or the package's restart after an upgrade) keeps
    // the sessions for the next daemon; every other stop ends them (sandcelld::lifecycle).
    let stop_clock = sandcelld::stages::monotonic_us();
    let mut stages = Stages::new();
    let on_term = match stopped {
        Stopped::Term => sandcelld::lifecycle::on_term().await,
        Stopped::KeepRequested | Stopped::Reexec => OnTerm::KeepSessions,
        Stopped::Interrupt => OnTerm::EndSessions("SIGINT".into()),
        Stopped::Idle => OnTerm::EndSessions("idle exit".into()),
    };
    stages.mark("ask_systemd");
    match &on_term {
        OnTerm::KeepSessions if core.adoption_enabled() => {
            // No connection is accepted from here on (the server says so, at most 1 s):
            // new ones wait in the socket's backlog for the next image or daemon.
            let _ = hold_tx.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(1), held_rx.wait_for(|h| *h)).await;
            if stopped == Stopped::Term {
                tracing::info!("systemd is restarting the unit: keeping every session");
            }
            // A re-exec is a reload for systemd (RELOADING=1, sent just before the exec); the
            // process does not stop.
            if stopped != Stopped::Reexec {
                notify::stopping();
            }
            metrics.finish().await;
            // Warm workers belong to no session: killed here, their remains swept by the
            // successor. Not waited for: the successor (and every client waiting on the
            // socket) waits for this process's exit.
            let killed = core.kill_pool();
            if !killed.is_empty() {
                sandcelld::adopt::note_killed_pool(&core.config().daemon.adopt_dir, &killed);
                tracing::info!(
                    killed = killed.len(),
                    "warm pooled workers killed (no session to keep); the next daemon removes \
                     their groups"
                );
            }
            core.hand_over_sessions().await;
            stages.mark("hand_over");
            stages.log_daemon("daemon_stop", stop_clock);
            if stopped == Stopped::Reexec {
                // Returns only if the exec failed: the sessions are handed over already, so
                // this image exits keeping them (status 1: Restart=on-failure starts a daemon
                // that adopts them).
                sandcelld::adopt::test_hand_over_delay();
                // A stop that arrived during the hand-over goes to the new image, which acts
                // on it once it has adopted the sessions (ending them, for a stop). Asked just
                // before the exec's environment is built: one that arrives in the few
                // instructions after that (or is still in tokio's signal pipe then) is lost
                // with this image's handler, and the keepers hold the sessions.
                let e = sandcelld::reexec::exec_in_place(listener_fd, activated, &mut || {
                    signals.stop_pending()
                });
                tracing::error!(error = %e, "re-exec failed: exiting keeping every session; systemd starts the daemon again");
                core.exit_keeping_sessions_with(1);
            }
            core.exit_keeping_sessions();
        }
        OnTerm::KeepSessions => tracing::warn!(
            "systemd is restarting the unit, but adoption is not enabled here: ending every \
             session"
        ),
        OnTerm::EndSessions(why) => tracing::info!(%why, "stopping: ending every session"),
    }
    notify::stopping();
    // No capacity is offered from here on: the file goes first.
    metrics.finish().await;
    let _ = stop_tx.send(true);
    let _ = server.await;
    if let Some(d) = dbus {
        let _ = d.await; // releases the bus name
    }
    core.shutdown().await;
    if let Some(p) = &args.listen {
        let _ = std::fs::remove_file(p);
    }
    tracing::info!("stopped; every worker is reaped");
    Ok(())
}

/// The cgroup backend and the workers' options: strict confinement with cgroups as root, or
/// what `--insecure-dev` allows. Errors: not root without `--insecure-dev`, a threat without
/// an enforced layer (strict), cgroups that cannot be set up.
fn enforcement(
    args: &Args,
    config: &Config,
    root: bool,
    check: &sandcell_confine::SelfCheck,
) -> anyhow::Result<(Arc<dyn Backend>, Options)> {
    let detect_cgroups = || -> anyhow::Result<Arc<dyn Backend>> {
        Ok(Arc::from(
            cgroup::detect(&cgroup::DetectConfig {
                v1_name: config.daemon.cgroup_name.clone(),
                supervisor_memory: {
                    let b = config.memory_bound();
                    Some((b.max, b.high))
                },
                ..Default::default()
            })
            .map_err(|e| match e {
                // No delegated group, no controllers: the host's setup, not a passing failure.
                cgroup::Error::Unsupported(_) => refused(e, "cgroup setup failed"),
                other => anyhow::Error::new(other).context("cgroup setup failed"),
            })?,
        ))
    };
    if args.insecure_dev {
        // Root never loses its cgroup limits to the development flag: only an unprivileged
        // daemon (which could not manage cgroups anyway) runs without them.
        let backend: Arc<dyn Backend> = if root {
            tracing::warn!(
                "--insecure-dev as root: best-effort confinement, cgroup limits kept (the flag \
                 is meant for unprivileged development)"
            );
            detect_cgroups().context(
                "--insecure-dev as root keeps cgroup limits and cannot set them up; run \
                 unprivileged for development without cgroups",
            )?
        } else {
            tracing::warn!(
                "--insecure-dev: unprivileged, workers run WITHOUT cgroup limits and with \
                 best-effort confinement"
            );
            Arc::new(cgroup::Unconfined)
        };
        Ok((
            backend,
            Options {
                enforcement: sandcell_confine::Enforcement::BestEffort,
                per_session_uids: root,
            },
        ))
    } else {
        if !root {
            return Err(refused(
                anyhow::anyhow!(
                    "sandcelld must run as root to confine workers (or pass --insecure-dev for development)"
                ),
                "not root",
            ));
        }
        // Fail closed: a threat without an enforced layer refuses start-up, with the hint for
        // the operator.
        check
            .require_strict()
            .map_err(|e| refused(e, "confinement self-check failed"))?;
        Ok((
            detect_cgroups()?,
            Options {
                enforcement: sandcell_confine::Enforcement::Strict,
                per_session_uids: true,
            },
        ))
    }
}

/// Decides what every worker enforces on this host (`sandcell_confine::policy`), refuses a
/// strict start that leaves a threat uncovered, logs the decision once and records it for
/// every worker plan.
fn announce_confinement(
    check: &sandcell_confine::SelfCheck,
    backend: &Arc<dyn Backend>,
    options: &Options,
) -> anyhow::Result<()> {
    let cgroups = backend.mode() != "none";
    let decision = sandcell_confine::policy::evaluate(&check.host(cgroups));
    if options.enforcement == sandcell_confine::Enforcement::Strict && !decision.strict_ok() {
        return Err(refused(
            anyhow::anyhow!("{}", decision.problems().join("; ")),
            "confinement self-check failed",
        ));
    }
    let confinement = sandcelld::worker::spawn::Confinement {
        enforcement: match options.enforcement {
            sandcell_confine::Enforcement::Strict => "strict",
            sandcell_confine::Enforcement::BestEffort => "best-effort",
        },
        kernel: kernel_release(),
        kernel_landlock_abi: check.kernel_landlock_abi,
        landlock_test_cap: check.landlock_test_cap,
        cgroups: backend.mode().to_string(),
        decision,
    };
    // Once, at start: what every worker enforces, and for each layer that is not active,
    // which layers cover its threats.
    let active: Vec<&str> = confinement
        .decision
        .layers
        .iter()
        .filter(|(_, s)| *s == sandcell_confine::policy::LayerState::Active)
        .map(|(l, _)| l.name())
        .collect();
    tracing::info!(
        enforcement = confinement.enforcement,
        kernel = %confinement.kernel,
        landlock_abi = ?confinement.decision.landlock_abi,
        kernel_landlock_abi = ?confinement.kernel_landlock_abi,
        cgroups = %confinement.cgroups,
        active = %active.join(","),
        "confinement"
    );
    for note in confinement.decision.notes() {
        tracing::warn!("confinement layer {note}");
    }
    sandcelld::worker::spawn::set_confinement(confinement);
    Ok(())
}

/// Why [`serve_until_stopped`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    /// SIGTERM: systemd stops or restarts the unit (or someone sent it by hand).
    Term,
    /// SIGUSR2 with adoption enabled: exit keeping every session for the next daemon.
    KeepRequested,
    /// SIGUSR1 with adoption enabled: re-execute the installed binary in place, keeping every
    /// session for the new image (sandcelld::reexec).
    Reexec,
    /// SIGINT: an interactive stop.
    Interrupt,
    /// No session and no connection for `idle_exit` seconds.
    Idle,
}

/// The signals whose default action would end the daemon while it starts, registered at the
/// start of `run` (one that arrives meanwhile is acted on once it serves). SIGTERM and SIGINT
/// (`term`, `int`) are registered there too when the start adopts sessions, so that a stop
/// during the adoption ends them (or a restart keeps them) as the daemon decides, not their
/// keepers' timeout; otherwise they are registered when it serves and until then end it at
/// once, as systemd's stop of a starting unit expects (the start has no session to lose).
/// A signal that arrives before `run` (the first milliseconds of `main`) ends the process as
/// a crash does: the keepers hold the sessions for the next daemon, at most
/// `adopt_timeout_seconds`.
struct Signals {
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Registers SIGUSR1, SIGUSR2 and SIGHUP, and with `adopting` SIGTERM and SIGINT.
    /// Errors: tokio cannot install a handler (no signal driver).
    fn new(adopting: bool) -> std::io::Result<Signals> {
        let early = |kind: SignalKind| adopting.then(|| signal(kind)).transpose();
        Ok(Signals {
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
            hup: signal(SignalKind::hangup())?,
            term: early(SignalKind::terminate())?,
            int: early(SignalKind::interrupt())?,
        })
    }

    /// Registers SIGTERM and SIGINT if they are not yet.
    fn register_stops(&mut self) -> std::io::Result<()> {
        if self.term.is_none() {
            self.term = Some(signal(SignalKind::terminate())?);
        }
        if self.int.is_none() {
            self.int = Some(signal(SignalKind::interrupt())?);
        }
        Ok(())
    }

    /// SIGTERM or SIGINT (their numbers) when one arrived and was not taken yet; does not
    /// wait.
    fn stop_pending(&mut self) -> Option<i32> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for (stream, sig) in [
            (self.term.as_mut(), libc::SIGTERM),
            (self.int.as_mut(), libc::SIGINT),
        ] {
            if let Some(s) = stream
                && s.poll_recv(&mut cx).is_ready()
            {
                return Some(sig);
            }
        }
        None
    }

    /// Waits for SIGTERM or SIGINT (their numbers), if registered; never returns otherwise.
    async fn stop_requested(&mut self) -> i32 {
        match (self.term.as_mut(), self.int.as_mut()) {
            (Some(term), Some(int)) => tokio::select! {
                _ = term.recv() => libc::SIGTERM,
                _ = int.recv() => libc::SIGINT,
            },
            _ => std::future::pending().await,
        }
    }
}

/// Serves until SIGTERM or SIGINT, or, with `idle_exit`, until no session or connection was
/// left for that many seconds, and says which; SIGHUP reloads `config_path`. Every second: the sd_notify
/// status, the metrics file, the watchdog, and a heap trim every [`TRIM_EVERY`].
async fn serve_until_stopped(
    signals: &mut Signals,
    core: &Arc<Core>,
    metrics: &mut sandcelld::metrics::Writer,
    config_path: &Path,
    config_required: bool,
    idle_exit: Option<u64>,
) -> anyhow::Result<Stopped> {
    signals.register_stops()?;
    let Signals {
        usr1,
        usr2,
        hup,
        term: Some(term),
        int: Some(int),
    } = signals
    else {
        anyhow::bail!("SIGTERM and SIGINT are not registered");
    };
    let watchdog = notify::watchdog_interval();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_busy = Instant::now();
    let mut last_watchdog = Instant::now();
    let mut last_trim = Instant::now();
    loop {
        tokio::select! {
            // A stop comes first when several signals are pending (the select is otherwise
            // random): a SIGTERM is never dropped for a SIGUSR1 or SIGUSR2 that arrived with it.
            biased;
            _ = term.recv() => { tracing::info!("SIGTERM: stopping"); return Ok(Stopped::Term); }
            _ = int.recv() => { tracing::info!("SIGINT: stopping"); return Ok(Stopped::Interrupt); }
            // Before the other signals, so that a flood of them cannot hold back the watchdog
            // (it is ready at most once a second).
            _ = tick.tick() => {
                notify::status(&status_line(core));
                metrics.tick(core).await;
                if let Some(every) = watchdog && last_watchdog.elapsed() >= every {
                    notify::watchdog();
                    last_watchdog = Instant::now();
                }
                if last_trim.elapsed() >= TRIM_EVERY {
                    return_free_memory();
                    last_trim = Instant::now();
                }
                if core.sessions().is_empty() && core.connection_count() == 0 {
                    if let Some(idle_exit) = idle_exit && last_busy.elapsed() >= Duration::from_secs(idle_exit) {
                        tracing::info!(idle_exit, "idle: exiting; systemd starts the daemon again on the next connection");
                        return Ok(Stopped::Idle);
                    }
                } else {
                    last_busy = Instant::now();
                }
            }
            _ = usr2.recv() => {
                if core.adoption_enabled() {
                    tracing::info!("SIGUSR2: exiting, keeping sessions for the next daemon");
                    return Ok(Stopped::KeepRequested);
                }
                tracing::warn!("SIGUSR2: adoption is not enabled; ignored");
            }
            _ = usr1.recv() => {
                if core.adoption_enabled() {
                    tracing::info!("SIGUSR1: re-executing in place, keeping sessions");
                    return Ok(Stopped::Reexec);
                }
                tracing::warn!("SIGUSR1: adoption is not enabled, so a re-exec would end every session; ignored (restart the unit instead)");
            }
            _ = hup.recv() => { let _ = core.reload_from(config_path, config_required, "SIGHUP"); }
        }
    }
}

/// How often the daemon hands freed heap memory back to the kernel.
const TRIM_EVERY: Duration = Duration::from_secs(30);

/// Returns the free memory at the top of every glibc malloc arena to the kernel
/// (`malloc_trim(3)`). Without it, the memory of bursts (a flood of replies, many connections
/// at once) stays in the daemon's resident set after it is freed, which is what the unit's
/// `MemoryHigh=` and the OOM killer see; the trim costs a walk of the arenas every
/// [`TRIM_EVERY`].
fn return_free_memory() {
    // SAFETY: malloc_trim only releases memory the allocator holds free; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `uname -r`.
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The cgroup mode this host offers, found without changing anything: `v2` when the unified
/// hierarchy has the memory and pids controllers, `v1` when those are v1 hierarchies,
/// `none` otherwise.
fn cgroup_mode_readonly() -> &'static str {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut v1 = (false, false);
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        match f[2] {
            "cgroup2" => {
                let c = std::fs::read_to_string(format!("{}/cgroup.controllers", f[1]))
                    .unwrap_or_default();
                let have: Vec<&str> = c.split_whitespace().collect();
                if have.contains(&"memory") && have.contains(&"pids") {
                    return "v2";
                }
            }
            "cgroup" => {
                let opts: Vec<&str> = f[3].split(',').collect();
                v1.0 |= opts.contains(&"memory");
                v1.1 |= opts.contains(&"pids");
            }
            _ => {}
        }
    }
    if v1 == (true, true) { "v1" } else { "none" }
}

/// `sandcelld --check`: prints what strict mode would enforce on this host; returns the exit
/// status (0: strict mode would start).
fn check(config: &Config) -> i32 {
    print_environment_policy(config);
    let check = match sandcell_confine::self_check() {
        Ok(c) => c,
        Err(e) => {
            println!("self-check failed: {e}");
            return 1;
        }
    };
    let cgroups = cgroup_mode_readonly();
    let decision = sandcell_confine::policy::evaluate(&check.host(cgroups != "none"));
    let abi = |a: Option<i32>| a.map_or("none".to_string(), |a| a.to_string());
    println!("kernel:               {}", kernel_release());
    println!(
        "landlock abi:         {} (kernel), {} (workers)",
        abi(check.kernel_landlock_abi),
        abi(decision.landlock_abi)
    );
    if let Some(cap) = check.landlock_test_cap {
        println!(
            "landlock test cap:    {cap} ({} is set: TEST ONLY)",
            sandcell_confine::landlock::TEST_ABI_ENV
        );
    }
    println!("cgroups:              {cgroups}");
    println!("layers:");
    for (layer, state) in &decision.layers {
        println!("  {:20} {}", layer.name(), state.as_str());
    }
    println!("threats:");
    for (threat, by) in &decision.threats {
        let by: Vec<&str> = by.iter().map(|l| l.name()).collect();
        println!(
            "  {:32} {}",
            threat,
            if by.is_empty() {
                "NOT COVERED".to_string()
            } else {
                by.join(", ")
            }
        );
    }
    for note in decision.notes() {
        println!("note: {note}");
    }
    let mut problems = check.problems.clone();
    if cgroups == "none" {
        problems.push(sandcell_confine::policy::hint(
            sandcell_confine::policy::Layer::Cgroups,
        ));
    }
    if problems.is_empty() && decision.strict_ok() {
        println!("strict mode: would start");
        0
    } else {
        for p in problems.iter().chain(decision.problems().iter()) {
            println!("problem: {p}");
        }
        println!("strict mode: REFUSED");
        1
    }
}

/// `sandcelld --check`'s lines on what a session of each environment may reach beyond its
/// image: its package sources (kind, package count, hash-checked; never a host path) and its
/// egress policy (hosts, ports, caps; `none` by default).
fn print_environment_policy(config: &Config) {
    println!("environments:");
    for env in config.environments() {
        let mut sources: Vec<String> = Vec::new();
        for src in env.package_source.iter() {
            let inv = src.inventory();
            sources.push(match &inv.reason {
                Some(r) => format!("{} (unreadable: {r})", inv.kind),
                None => format!(
                    "{} ({} package{}{})",
                    inv.kind,
                    inv.packages,
                    if inv.packages == 1 { "" } else { "s" },
                    if inv.hash_manifest {
                        ", hash-checked"
                    } else {
                        ""
                    }
                ),
            });
        }
        println!(
            "  {:20} packages: {}",
            env.name,
            if sources.is_empty() {
                "none".to_string()
            } else {
                sources.join(", ")
            }
        );
        println!(
            "  {:20} egress: {}",
            "",
            env.egress
                .as_ref()
                .map_or("none".to_string(), |e| e.summary())
        );
    }
    // Whether the service's sandbox gives egress (this process's, and systemd's units where
    // systemd runs): never a surprise at the first cell that fetches something.
    if config.environments().iter().any(|e| e.egress.is_some()) {
        let state = match sandcelld::egress::availability() {
            Ok(()) => sandcelld::egress::units_allow(),
            Err(u) => Err(u.detail.clone()),
        };
        match state {
            Ok(()) => println!("egress sandbox:       available"),
            Err(reason) => println!("egress sandbox:       UNAVAILABLE: {reason}"),
        }
    }
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

/// Checks every environment through the normal path (a confined one-shot session running a
/// cell that prints the interpreter's version and installed packages). A language's default
/// environment must pass; another one that fails is listed as not ready, with the reason.
///
/// A probe answers once its cell's result arrives, while its one-shot session is still being
/// released; nothing else holds a session before the socket is served, so each probe first
/// waits (at most 10 s) for the sessions budget to be back to zero. Otherwise with
/// `max_concurrent_sessions = 1` a probe would be refused `CapacityExceeded` by the one
/// before it.
/// The readiness probe of a daemon that adopted sessions, after it serves: every environment's
/// report is made (and cached) and logged; a failed default environment is an error in the
/// log, not an exit (the adopted sessions keep being served; its report, cached, says why,
/// and opening a session of it fails as its worker fails to start). A probe that could not
/// run (admission refused it `CapacityExceeded`: the adopted sessions hold the budget it
/// needs; or the daemon is stopping) says nothing about the environment: it is logged at
/// info with the reason, nothing is cached, and the next `ListEnvironments` checks again.
/// How long a daemon that adopted sessions holds back its warm pools' refill and its
/// readiness probe for the first cell to finish and the first call of each connection
/// accepted during the adoption to be answered: 5 seconds.
const ADOPTED_FIRST_WAIT: Duration = Duration::from_secs(5);

async fn probe_in_background(core: Arc<Core>) {
    for env in core.config().environments() {
        match core.environment_check(&env).await {
            Ok(r) if r.ready => {
                tracing::info!(environment = %env.name, version = %r.version, packages = r.packages.len(), "environment ready");
            }
            Ok(r) => {
                tracing::error!(environment = %env.name, default = env.default, reason = r.reason.as_deref().unwrap_or(""), "environment not ready after adoption; sessions of it will fail to start");
            }
            Err(e) => {
                tracing::info!(environment = %env.name, reason = %e, "readiness probe not run after adoption (no room beside the adopted sessions, or stopping): not a failure; the next listing of environments checks it");
            }
        }
    }
}

async fn probe_environments(core: &Arc<Core>) -> anyhow::Result<()> {
    for env in core.config().environments() {
        let t0 = std::time::Instant::now();
        while core.admission().1.sessions > 0 && t0.elapsed() < std::time::Duration::from_secs(10) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let r = core.environment_report(&env).await;
        if r.ready {
            tracing::info!(environment = %env.name, version = %r.version, packages = r.packages.len(), "environment ready");
        } else if env.default {
            bail!(
                "readiness probe ({}, the default {} environment) failed: {}",
                env.name,
                env.language.as_str(),
                r.reason.unwrap_or_default()
            );
        } else {
            tracing::warn!(environment = %env.name, reason = r.reason.as_deref().unwrap_or(""), "environment not ready; sessions of it will fail to start");
        }
    }
    // Ready means idle: the probes' workers are reaped and their charges released.
    let t0 = Instant::now();
    while !core.sessions().is_empty() {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("probe session was not released");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}
