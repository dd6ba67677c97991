//! The Varlink face of sandcelld: `org.sandcell.Kernel` and `org.varlink.service`.
//!
//! A thin shim: it reads calls, checks their parameters' shape, calls the core, and writes
//! replies and named errors. Each connection is served by its own task, so a handler that waits
//! for a cell never stalls another client; a second task per connection reads ahead (at most
//! one message beyond the one being answered) and notices a hang-up at once, even during a
//! silent cell. Calls on one connection are answered in order, as Varlink requires.
//!
//! Every byte written to a client goes through [`socket::Writer::send`], which charges it to
//! the reply budgets until the kernel's send queue has handed it over (socket.rs).
//!
//! Connections are capped in total (`daemon.max_connections`) and per uid
//! (`daemon.max_connections_per_uid`), with room kept for root and for uids under their share
//! (core/connections.rs): one over a cap is logged with its uid, answered `CapacityExceeded`
//! naming the budget on its first call, and closed. A connection with no call in flight, no partial message and no session it owns is
//! closed after `daemon.connection_idle_seconds`.

pub mod early;
mod kernel;
pub mod socket;

use crate::core::Core;
use crate::identity::Caller;
use sandcell_proto::kernel::RawCall;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};

/// Accepts connections until `stop` turns true; each is served on its own task. From when
/// `hold` turns true, accepts nothing more (and says so on `held`) but keeps the socket open
/// until `stop`.
///
/// When `stop` fires, connections not yet accepted stay queued in the listening socket
/// (systemd keeps it), so a socket-activated daemon that exits loses nothing.
///
/// `early`: connections accepted before the core existed ([`early::accept_early`]); they are
/// counted under the connection caps and served first, in their accept order.
pub async fn serve(
    core: Arc<Core>,
    listener: UnixListener,
    early: Vec<early::EarlyConnection>,
    mut stop: watch::Receiver<bool>,
    mut hold: watch::Receiver<bool>,
    held: watch::Sender<bool>,
) {
    raise_nofile(&core);
    // Every early id is the connection's for good, admitted or refused: polkit may already
    // have answered under it, so the core never gives it to another connection.
    if let Some(last) = early.iter().map(|e| e.id).max() {
        core.reserve_connection_ids(last);
    }
    for e in early {
        let credentials = (e.uid, e.gid, e.pid, e.pidfd);
        if let Some(admitted) = admit_connection(&core, e.stream, Ok(credentials), Some(e.id)) {
            tokio::spawn(serve_connection(core.clone(), admitted));
        }
    }
    // One descriptor in reserve: when accept fails for want of descriptors, it is given up to
    // accept the waiting client and answer it by name, instead of leaving that client waiting
    // in the backlog until some descriptor is closed (the libev/nginx "reserve fd" idiom).
    let mut reserve = std::fs::File::open("/dev/null").ok();
    loop {
        if *hold.borrow() {
            // Held: the socket stays open and connections wait in its backlog for the next
            // image or daemon (an exit or re-exec that keeps sessions).
            held.send_replace(true);
            let _ = stop.wait_for(|s| *s).await;
            return;
        }
        tokio::select! {
            // Stop and hold before any accept that is ready at the same time.
            biased;
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            _ = async { let _ = hold.wait_for(|h| *h).await; } => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Counted under the connection caps here, in accept order, before its
                    // task runs: tasks run in any order, and a connection accepted later must
                    // never take the place of one accepted before it.
                    let credentials = socket::peer_credentials(&stream);
                    if let Some(admitted) = admit_connection(&core, stream, credentials, None) {
                        tokio::spawn(serve_connection(core.clone(), admitted));
                    }
                }
                Err(e) => {
                    let out_of_fds =
                        matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
                    tracing::warn!(error = %e, "accept failed");
                    if out_of_fds && reserve.take().is_some() {
                        refuse_one(&listener).await;
                        reserve = std::fs::File::open("/dev/null").ok();
                    } else {
                        // The pending connection stays queued; retry shortly.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            },
        }
    }
}

/// Refused connections being answered at once at most; more are closed unanswered, so that a
/// flood of refused connections holds at most this many descriptors for at most
/// [`REFUSAL_SECONDS`] each.
pub const MAX_REFUSALS_IN_FLIGHT: usize = 64;

/// Longest wait for a refused connection's first call, seconds.
pub const REFUSAL_SECONDS: u64 = 1;

static REFUSALS_IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Answers a connection the connection caps refused: reads its first call and answers
/// `CapacityExceeded` naming the budget (`max_connections`, `max_connections_per_uid` or
/// `connections_reserved`; `requested` 1), then closes it. Beyond
/// [`MAX_REFUSALS_IN_FLIGHT`] refusals at once, the connection is closed unanswered.
async fn refuse_connection(stream: tokio::net::UnixStream, r: &crate::core::ConnectionRefused) {
    if REFUSALS_IN_FLIGHT.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSALS_IN_FLIGHT {
        REFUSALS_IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let reply = format!(
        "{{\"error\":\"org.sandcell.Kernel.CapacityExceeded\",\"parameters\":{{\"budget\":\"{}\",\"in_use\":{},\"requested\":1,\"max\":{}}}}}\0",
        r.budget, r.in_use, r.max
    );
    answer_first_call(stream, reply).await;
    REFUSALS_IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
}

/// Reads a client's first call (at most 64 KiB, [`REFUSAL_SECONDS`]), writes `reply` (an
/// encoded error, NUL-terminated) and closes the connection.
async fn answer_first_call(mut stream: tokio::net::UnixStream, reply: String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(Duration::from_secs(REFUSAL_SECONDS), async {
        let mut buf = [0u8; 4096];
        let mut read = 0usize;
        while read < 64 << 10 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    read += n;
                    if buf[..n].contains(&0) {
                        break;
                    }
                }
            }
        }
        let _ = stream.write_all(reply.as_bytes()).await;
    })
    .await;
}

/// Accepts one waiting client with the descriptor just freed, reads its first call (at most
/// 64 KiB, 1 s) and answers `CapacityExceeded` (budget `daemon_descriptors`, the
/// RLIMIT_NOFILE in force as `in_use` and `max`), then closes the connection.
async fn refuse_one(listener: &UnixListener) {
    let Ok(Ok((stream, _))) =
        tokio::time::timeout(Duration::from_millis(100), listener.accept()).await
    else {
        return;
    };
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .unwrap_or((0, 0));
    let reply = format!(
        "{{\"error\":\"org.sandcell.Kernel.CapacityExceeded\",\"parameters\":{{\"budget\":\"daemon_descriptors\",\"in_use\":{n},\"requested\":1,\"max\":{n}}}}}\0",
        n = soft
    );
    answer_first_call(stream, reply).await;
    tracing::warn!("a client was refused: the daemon is out of descriptors");
}

/// Descriptors the daemon needs besides connections and sessions (listening socket, bus
/// connection, log, cgroup and /proc files opened briefly, descriptors being closed).
pub const NOFILE_SLACK: u64 = 256;

/// Descriptors one session holds open in the daemon (request and reply pipes, the raw output
/// pipes of an R worker, the child's pidfd, directory descriptors while files move).
pub const FDS_PER_SESSION: u64 = 8;

/// Descriptors one connection may hold: its socket, the peer's pidfd, and the descriptors
/// passed with the call being answered and with the one read ahead.
pub const FDS_PER_CONNECTION: u64 = 2 + 2 * socket::MAX_FDS as u64;

/// Raises the soft RLIMIT_NOFILE to the hard limit and warns when even that cannot hold
/// `max_connections x FDS_PER_CONNECTION (10) + max_concurrent_sessions x FDS_PER_SESSION (8)
/// + NOFILE_SLACK (256)` descriptors.
fn raise_nofile(core: &Core) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let mut soft = 0;
    if let Ok((cur, max)) = getrlimit(Resource::RLIMIT_NOFILE) {
        soft = cur;
        if cur < max && setrlimit(Resource::RLIMIT_NOFILE, max, max).is_ok() {
            soft = max;
        }
    }
    let cfg = core.config();
    let need = cfg.daemon.max_connections * FDS_PER_CONNECTION
        + cfg.limits.max_concurrent_sessions * FDS_PER_SESSION
        + NOFILE_SLACK;
    if soft < need {
        tracing::warn!(
            nofile = soft,
            need,
            "RLIMIT_NOFILE is below max_connections x 10 + max_concurrent_sessions x 8 + 256; raise LimitNOFILE= or lower the caps"
        );
    } else {
        tracing::info!(nofile = soft, need, "descriptor limit");
    }
}

/// An accepted connection, counted under the connection caps.
struct Admitted {
    stream: tokio::net::UnixStream,
    uid: u32,
    gid: u32,
    pid: u32,
    pidfd: Option<std::os::fd::OwnedFd>,
    guard: crate::core::ConnectionGuard,
}

/// Counts the connection with the peer's `credentials` (uid, gid, pid, pidfd) under the caps
/// (as connection `id` when it was numbered before the core existed); a refused one is
/// answered on its own task (the client is told why on its first call), one without
/// credentials is dropped. Synchronous, so connections are counted in accept order.
fn admit_connection(
    core: &Arc<Core>,
    stream: tokio::net::UnixStream,
    credentials: std::io::Result<(u32, u32, u32, Option<std::os::fd::OwnedFd>)>,
    id: Option<u64>,
) -> Option<Admitted> {
    let (uid, gid, pid, pidfd) = match credentials {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no peer credentials; dropping connection");
            return None;
        }
    };
    match core.connection_opened_as(uid, pid, id) {
        Ok(guard) => Some(Admitted {
            stream,
            uid,
            gid,
            pid,
            pidfd,
            guard,
        }),
        Err(r) => {
            // Refused and logged by the core.
            drop(pidfd);
            tokio::spawn(async move { refuse_connection(stream, &r).await });
            None
        }
    }
}

/// The caller on connection `id` from its peer's credentials (`SO_PEERCRED`, and the peer's
/// pidfd where the kernel gives one). pid + start time + pidfd make the polkit subject, never
/// a bare pid (polkit CVE-2013-4288: a bare pid can be reused between the connection and the
/// check).
fn peer_caller(
    uid: u32,
    gid: u32,
    pid: u32,
    id: u64,
    pidfd: Option<&std::os::fd::OwnedFd>,
) -> Caller {
    Caller {
        uid,
        gid,
        pid,
        connection: id,
        subject: crate::polkit::process_subject(pid, pidfd.map(|f| f.as_fd())),
    }
}

async fn serve_connection(core: Arc<Core>, admitted: Admitted) {
    let Admitted {
        stream,
        uid,
        gid,
        pid,
        pidfd,
        guard,
    } = admitted;
    let id = guard.id();
    let caller = peer_caller(uid, gid, pid, id, pidfd.as_ref());
    drop(pidfd);
    tracing::debug!(connection = id, uid, pid, "client connected");
    // Counted until its first call is answered: the adopting daemon's pool refill waits.
    let mut early = core.calls_held().then(|| core.early_caller());
    if early.is_some() {
        // The daemon is adopting its predecessor's sessions (a restart that kept them): the
        // caller's authorization to run code is asked now, beside the adoption, and cached
        // for this connection (on a task of its own: no call waits for it but the ones that
        // need it). Each call waits for the adoption (`kernel::wait_for_adoption`): a cell's
        // call on one session only for that session's, any other call for its end.
        tracing::info!(
            connection = id,
            uid,
            pid,
            "connection accepted while adopting sessions: its calls wait for the adoption"
        );
        let (ask_core, ask_caller) = (core.clone(), caller.clone());
        tokio::spawn(async move {
            let _ = ask_core
                .authorize(&ask_caller, crate::auth::Action::Execute)
                .await;
        });
    }
    let (mut read, write) = socket::split(stream, uid);
    let write = Arc::new(write);
    let partial = read.partial_flag();
    // Keeps the connection's charge equal to its kernel send queue; a queue that stays full
    // ends the connection (the reader then sees end of file).
    let watcher = {
        let write = write.clone();
        tokio::spawn(async move {
            write.watch().await;
            tracing::info!(
                connection = id,
                uid,
                pid,
                queued = write.queued(),
                stall_seconds = socket::SEND_STALL_SECONDS,
                "closing a connection whose client reads nothing of its replies"
            );
            write.end();
        })
    };
    let (calls_tx, mut calls_rx) = mpsc::channel::<socket::Message>(1);
    let (closed_tx, mut closed_rx) = watch::channel(false);
    // Set when the connection ends on a message that cannot be a call (over the bound, not
    // complete in time): the client is told before the connection ends.
    let refused = Arc::new(AtomicBool::new(false));
    let refused_by_reader = refused.clone();
    let reader = tokio::spawn(async move {
        loop {
            match read.next().await {
                Ok(Some(m)) => {
                    if calls_tx.send(m).await.is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        refused_by_reader.store(true, Ordering::Relaxed);
                    }
                    tracing::debug!(connection = id, error = %e, "connection ends");
                    break;
                }
            }
        }
        let _ = closed_tx.send(true);
    });
    loop {
        let idle = Duration::from_secs(core.config().daemon.connection_idle_seconds);
        let msg = tokio::select! {
            c = calls_rx.recv() => match c { Some(c) => c, None => break },
            _ = async { let _ = closed_rx.wait_for(|c| *c).await; } => {
                // Calls already read are still answered unless the peer is gone for good;
                // a write to a closed socket fails and ends the loop.
                match calls_rx.try_recv() {
                    Ok(c) => c,
                    Err(_) => {
                        if refused.load(Ordering::Relaxed) {
                            let _ = kernel::refuse_malformed(&write).await;
                        }
                        break;
                    }
                }
            }
            _ = tokio::time::sleep(idle) => {
                if partial.load(Ordering::Relaxed) || core.connection_owns_sessions(id) {
                    continue;
                }
                tracing::info!(connection = id, uid, pid, idle_seconds = idle.as_secs(), "closing idle connection");
                break;
            }
        };
        let socket::Message { bytes, fds, .. } = msg;
        let call = match serde_json::from_slice::<zlink::Call<RawCall>>(&bytes) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(connection = id, error = %e, "malformed call; connection ends");
                let _ = kernel::refuse_malformed(&write).await;
                break;
            }
        };
        drop(bytes);
        let mut closed = closed_rx.clone();
        let handled = tokio::select! {
            r = kernel::handle(&core, &caller, &write, call, fds) => r,
            // The client hung up: drop the handler, which drops the cell's frame receiver;
            // the session actor sees that and cancels the cell (kill, reap, release).
            _ = async { let _ = closed.wait_for(|c| *c).await; } => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        early.take();
        if let Err(e) = handled {
            if e.kind() == std::io::ErrorKind::TimedOut {
                tracing::info!(
                    connection = id,
                    uid,
                    pid,
                    queued = write.queued(),
                    stall_seconds = socket::SEND_STALL_SECONDS,
                    "closing a connection whose client reads nothing of its replies"
                );
            }
            break;
        }
    }
    reader.abort();
    let _ = reader.await;
    watcher.abort();
    let _ = watcher.await;
    // Sessions end with their connection at once; the connection's place under the caps and
    // its charge are kept until the client has taken (or dropped) what the kernel still
    // queues for it.
    core.close_owned_sessions(id).await;
    write.linger().await;
    core.connection_closed(guard).await;
    tracing::debug!(connection = id, "client disconnected");
}
