//! `sandcell-egress`: serves the egress of sandcell sessions (see the library's docs).
//!
//! The control socket comes from systemd socket activation (`LISTEN_FDS=1`, see
//! sd_listen_fds(3); `sandcell-egress.socket`) or is bound at `--control`.

use clap::Parser;
use sandcell_egress::control::{self, Server};
use sandcell_egress::proxy::Resolver;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Parser)]
#[command(version, about = "sandcell's allowlisting egress proxy")]
struct Args {
    /// Bind the control socket here (without socket activation).
    #[arg(long)]
    control: Option<PathBuf>,
    /// A hosts(5) file consulted before the system resolver.
    #[arg(long)]
    hosts_file: Option<PathBuf>,
    /// Resolve only through --hosts-file (tests: nothing leaves the machine).
    #[arg(long, requires = "hosts_file")]
    hosts_only: bool,
    /// The uid of the only peer allowed on the control socket (sandcelld: root).
    #[arg(long, default_value_t = 0)]
    allowed_uid: u32,
    /// Sessions served at once.
    #[arg(long, default_value_t = 4096)]
    max_sessions: usize,
}

/// Worker threads of the proxy's runtime: the CPUs, at most 4 (relaying is I/O-bound).
const MAX_WORKER_THREADS: usize = 4;
/// Threads for name lookups (the system resolver blocks), at most; with the workers and the
/// main thread well within the unit's `TasksMax=64`. Lookups past it wait for a thread.
const MAX_LOOKUP_THREADS: usize = 16;

/// One runtime of a bounded number of threads: tokio's default starts one worker per CPU
/// and panics when a thread cannot be made ("OS can't spawn worker thread"), which under
/// `TasksMax=64` would be every start on a machine of 64 CPUs or more.
fn main() -> anyhow::Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cpus.clamp(1, MAX_WORKER_THREADS))
        .max_blocking_threads(MAX_LOOKUP_THREADS)
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let resolver = match &args.hosts_file {
        Some(p) => Resolver::with_hosts_file(p, args.hosts_only)?,
        None => Resolver::system(),
    };
    let listener = match (&args.control, activated()) {
        (_, Some(l)) => l,
        (Some(path), None) => {
            let _ = std::fs::remove_file(path);
            let l = std::os::unix::net::UnixListener::bind(path)?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            l
        }
        (None, None) => anyhow::bail!("no control socket: use socket activation or --control"),
    };
    listener.set_nonblocking(true)?;
    let server = Arc::new(Server {
        resolver: Arc::new(resolver),
        allowed_uid: args.allowed_uid,
        sessions: Arc::new(tokio::sync::Semaphore::new(args.max_sessions)),
        remembered: Default::default(),
    });
    control::run(tokio::net::UnixListener::from_std(listener)?, server).await?;
    Ok(())
}

/// The socket systemd passed (`LISTEN_PID` is this process, `LISTEN_FDS=1`: fd 3).
fn activated() -> Option<std::os::unix::net::UnixListener> {
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let n: u32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    if pid != std::process::id() || n != 1 {
        return None;
    }
    // SAFETY: systemd passed descriptor 3 to this process for it to own (sd_listen_fds(3)).
    Some(unsafe { std::os::unix::net::UnixListener::from_raw_fd(3) })
}
