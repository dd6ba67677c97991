//! The Varlink face of sandcelld: `org.sandcell.Kernel` and `org.varlink.service`.
//!
//! A thin shim: it reads calls, checks their parameters' shape, calls the core, and writes
//! replies and named errors. Each connection is served by its own task, so a handler that waits
//! for a cell never stalls another client; a second task per connection reads ahead and
//! notices a hang-up at once, even during a silent cell (zlink's own `Server` does neither:
//! PLATFORM-NOTES). Calls on one connection are answered in order, as Varlink requires.

mod kernel;
pub mod socket;

use crate::core::Core;
use crate::session::Caller;
use sandcell_proto::kernel::RawCall;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use zlink::Connection;

/// Accepts connections until `stop` turns true; each is served on its own task.
///
/// When `stop` fires, connections not yet accepted stay queued in the listening socket
/// (systemd keeps it), so a socket-activated daemon that exits loses nothing.
pub async fn serve(core: Arc<Core>, listener: UnixListener, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let core = core.clone();
                    tokio::spawn(serve_connection(core, stream));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
        }
    }
}

async fn serve_connection(core: Arc<Core>, stream: tokio::net::UnixStream) {
    let id = core.connection_opened();
    let mut conn = Connection::new(socket::BoundedStream::new(stream));
    let caller = match conn.peer_credentials().await {
        Ok(c) => Caller {
            uid: c.unix_user_id().as_raw(),
            gid: c.unix_primary_group_id().as_raw(),
            pid: c.process_id().as_raw_nonzero().get() as u32,
            connection: id,
            // issue #5: pid + start time + pidfd, the polkit subject (never a bare pid).
            subject: crate::polkit::process_subject(
                c.process_id().as_raw_nonzero().get() as u32,
                c.process_fd(),
            ),
        },
        Err(e) => {
            tracing::warn!(error = %e, "no peer credentials; dropping connection");
            core.connection_closed(id).await;
            return;
        }
    };
    tracing::debug!(
        connection = id,
        uid = caller.uid,
        pid = caller.pid,
        "client connected"
    );
    let (mut read, mut write) = conn.split();
    let (calls_tx, mut calls_rx) = mpsc::channel::<(zlink::Call<RawCall>, Vec<OwnedFd>)>(8);
    let (closed_tx, mut closed_rx) = watch::channel(false);
    let reader = tokio::spawn(async move {
        loop {
            match read.receive_call::<RawCall>().await {
                Ok((call, fds)) => {
                    if calls_tx.send((call, fds)).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(connection = id, error = %e, "connection ends");
                    break;
                }
            }
        }
        let _ = closed_tx.send(true);
    });
    loop {
        let (call, fds) = tokio::select! {
            c = calls_rx.recv() => match c { Some(c) => c, None => break },
            _ = async { let _ = closed_rx.wait_for(|c| *c).await; } => {
                // Calls already read are still answered unless the peer is gone for good;
                // a write to a closed socket fails and ends the loop.
                match calls_rx.try_recv() { Ok(c) => c, Err(_) => break }
            }
        };
        let mut closed = closed_rx.clone();
        let handled = tokio::select! {
            r = kernel::handle(&core, &caller, &mut write, call, fds) => r,
            // The client hung up: drop the handler, which drops the cell's frame receiver;
            // the session actor sees that and cancels the cell (kill, reap, release).
            _ = async { let _ = closed.wait_for(|c| *c).await; } => Err(zlink::Error::Io(std::io::ErrorKind::BrokenPipe.into())),
        };
        if handled.is_err() {
            break;
        }
    }
    reader.abort();
    core.connection_closed(id).await;
    tracing::debug!(connection = id, "client disconnected");
}
