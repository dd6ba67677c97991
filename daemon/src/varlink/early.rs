//! Connections accepted while a daemon that adopts its predecessor's sessions is still setting
//! up (its cgroups, the sweep, the state directory: before the core exists).
//!
//! After a restart or a crash the sessions' owners reconnect at once, and each connection's
//! first call needs polkit's answer for the connecting process (`CheckAuthorization`, a run
//! of polkitd's rules: tens to hundreds of milliseconds on a slow machine). Accepting those
//! connections at the listener stage lets the daemon ask polkit for each of them while the
//! rest of the start runs; the answer is kept under the connection's id in the polkit
//! authority's per-connection cache, exactly as if it had been asked after the accept. Nothing
//! is decided here and nothing is carried over from the previous daemon: polkit answers for
//! this connection's process, now.
//!
//! Bounds: at most [`MAX_EARLY`] connections are taken this way (the rest wait in the
//! socket's backlog, as before), and polkit is asked at once for at most
//! [`MAX_EARLY_PER_UID`] of one uid's (the others are asked about at their first call). The
//! connections are counted under the connection caps when the server takes them
//! ([`super::serve`]), in accept order; one over a cap is refused then, as any other.

use crate::auth::{Action, Authority};
use crate::polkit::Polkit;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Most connections accepted before the core exists.
pub const MAX_EARLY: usize = 64;

/// Most connections of one uid whose authorization is asked before the core exists.
pub const MAX_EARLY_PER_UID: usize = 8;

/// A connection accepted before the core existed, with its peer's credentials and its id
/// (`1..=MAX_EARLY`, in accept order; the server reserves them all, admitted or refused, and
/// the core numbers later connections after them).
pub struct EarlyConnection {
    pub(super) stream: UnixStream,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) pid: u32,
    pub(super) pidfd: Option<OwnedFd>,
    pub(super) id: u64,
}

/// The acceptor started by [`accept_early`].
pub struct EarlyAccept {
    stop: watch::Sender<bool>,
    task: JoinHandle<(UnixListener, Vec<EarlyConnection>)>,
}

/// Accepts connections on `listener` until [`EarlyAccept::finish`] (at most [`MAX_EARLY`]),
/// and asks `polkit` whether each caller may run code (`org.sandcell.execute`, cached under
/// the connection's id). Call from within the daemon's runtime.
pub fn accept_early(listener: UnixListener, polkit: Arc<Polkit>) -> EarlyAccept {
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut taken: Vec<EarlyConnection> = Vec::new();
        let mut asked: HashMap<u32, usize> = HashMap::new();
        while taken.len() < MAX_EARLY {
            tokio::select! {
                biased;
                _ = stopped.wait_for(|s| *s) => break,
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else {
                        // Left to the server's accept loop, which handles running out of
                        // descriptors.
                        break;
                    };
                    let Ok((uid, gid, pid, pidfd)) = super::socket::peer_credentials(&stream) else {
                        tracing::warn!("no peer credentials; dropping connection");
                        continue;
                    };
                    let id = taken.len() as u64 + 1;
                    let n = asked.entry(uid).or_default();
                    let ask = *n < MAX_EARLY_PER_UID;
                    if ask {
                        *n += 1;
                        let caller = super::peer_caller(uid, gid, pid, id, pidfd.as_ref());
                        let polkit = polkit.clone();
                        tokio::spawn(async move {
                            let _ = polkit.check(&caller, Action::Execute).await;
                        });
                    }
                    tracing::info!(
                        connection = id,
                        uid,
                        pid,
                        polkit_asked = ask,
                        "connection accepted while the daemon starts"
                    );
                    taken.push(EarlyConnection { stream, uid, gid, pid, pidfd, id });
                }
            }
        }
        if taken.len() >= MAX_EARLY {
            let _ = stopped.wait_for(|s| *s).await;
        }
        (listener, taken)
    });
    EarlyAccept { stop, task }
}

impl EarlyAccept {
    /// Stops accepting; returns the listener and the connections taken, in accept order.
    ///
    /// Errors: the acceptor task panicked (the listener is then lost with it).
    pub async fn finish(self) -> anyhow::Result<(UnixListener, Vec<EarlyConnection>)> {
        self.stop.send_replace(true);
        self.task
            .await
            .map_err(|e| anyhow::anyhow!("the early acceptor failed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::polkit::test_support::FakePolkit;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// 100 clients wait in the backlog when the acceptor starts: it takes [`MAX_EARLY`] of
    /// them (ids 1 to 64 in accept order) and leaves the rest queued on the listener, and
    /// polkit is asked about [`MAX_EARLY_PER_UID`] of them (all are this test's uid).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_is_taken_up_to_its_bounds_and_the_rest_stays_queued() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("socket");
        let listener = UnixListener::bind(&path).unwrap();
        let clients: Vec<std::os::unix::net::UnixStream> = (0..100)
            .map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap())
            .collect();
        let fake = FakePolkit::start().await;
        let accepting = accept_early(listener, fake.polkit.clone());
        // Taking 64 queued connections is a matter of milliseconds; polkit's questions are
        // sent as each is taken.
        let t0 = std::time::Instant::now();
        while fake.asked.load(Ordering::SeqCst) < MAX_EARLY_PER_UID {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "polkit was asked {} times",
                fake.asked.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The other 56 accepts take milliseconds; a loaded machine gets far more.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (listener, early) = accepting.finish().await.unwrap();
        assert_eq!(early.len(), MAX_EARLY);
        let ids: Vec<u64> = early.iter().map(|c| c.id).collect();
        assert_eq!(ids, (1..=MAX_EARLY as u64).collect::<Vec<_>>());
        let me = nix::unistd::getuid().as_raw();
        assert!(
            early
                .iter()
                .all(|c| c.uid == me && c.pid == std::process::id())
        );
        assert_eq!(
            fake.asked.load(Ordering::SeqCst),
            MAX_EARLY_PER_UID,
            "polkit was asked about more than one uid's bound"
        );
        // The rest are still queued, for the server's accept loop.
        let mut rest = 0;
        while let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(200), listener.accept()).await
        {
            rest += 1;
        }
        assert_eq!(rest, clients.len() - MAX_EARLY);
    }
}
