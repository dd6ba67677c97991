use crate::codec::*;
use crate::endpoint::Endpoint;
use crate::error::*;
use crate::fair_queue::{FairQueue, QueueInner};
use crate::transport::AcceptStopHandle;
use crate::*;
use crate::{SocketType, ZmqResult};

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;

use std::collections::HashMap;
use std::sync::Arc;

/// sandcell: the most bytes of a request's envelope (its routing ids and delimiter) that
/// REP takes; a request with a larger one is dropped.
pub const MAX_ENVELOPE_BYTES: usize = 4096;

/// sandcell: the most frames of a request's envelope.
pub const MAX_ENVELOPE_FRAMES: usize = 32;

struct RepPeer {
    pub(crate) _identity: PeerIdentity,
    // sandcell: shared, so that `send` takes it out of the peer table before it awaits the
    // write. The published `send` held the table's entry across that await; a peer that did
    // not read kept it held, and `peer_disconnected` (a blocking `remove_sync`, called on
    // the runtime's thread when another peer left) then blocked that thread for good.
    pub(crate) send_queue: Arc<futures::lock::Mutex<ZmqFramedWrite>>,
}

struct RepSocketBackend {
    pub(crate) peers: scc::HashMap<PeerIdentity, RepPeer>,
    fair_queue_inner: Arc<Mutex<QueueInner<ZmqFramedRead, PeerIdentity>>>,
    socket_monitor: Mutex<Option<mpsc::Sender<SocketEvent>>>,
    socket_options: Arc<SocketOptions>,
}

pub struct RepSocket {
    backend: Arc<RepSocketBackend>,
    envelope: Option<ZmqMessage>,
    current_request: Option<PeerIdentity>,
    fair_queue: FairQueue<ZmqFramedRead, PeerIdentity>,
    binds: HashMap<Endpoint, AcceptStopHandle>,
}

impl Drop for RepSocket {
    fn drop(&mut self) {
        self.backend.shutdown();
    }
}

#[async_trait]
impl Socket for RepSocket {
    fn with_options(options: SocketOptions) -> Self {
        let mut fair_queue = FairQueue::new(true);
        let backend = Arc::new(RepSocketBackend {
            peers: scc::HashMap::new(),
            fair_queue_inner: fair_queue.inner(),
            socket_monitor: Mutex::new(None),
            socket_options: Arc::new(options),
        });

        let backend_weak = Arc::downgrade(&backend);
        fair_queue.set_on_disconnect(move |peer_id: PeerIdentity| {
            if let Some(backend) = backend_weak.upgrade() {
                backend.peer_disconnected(&peer_id);
            }
        });

        Self {
            backend,
            envelope: None,
            current_request: None,
            fair_queue,
            binds: HashMap::new(),
        }
    }

    fn backend(&self) -> Arc<dyn MultiPeerBackend> {
        self.backend.clone()
    }

    fn binds(&mut self) -> &mut HashMap<Endpoint, AcceptStopHandle> {
        &mut self.binds
    }

    fn monitor(&mut self) -> mpsc::Receiver<SocketEvent> {
        let (sender, receiver) = mpsc::channel(1024);
        self.backend.socket_monitor.lock().replace(sender);
        receiver
    }
}

#[async_trait]
impl MultiPeerBackend for RepSocketBackend {
    async fn peer_connected(self: Arc<Self>, peer_id: &PeerIdentity, io: FramedIo) {
        let (recv_queue, send_queue) = io.into_parts();

        self.peers
            .upsert_async(
                peer_id.clone(),
                RepPeer {
                    _identity: peer_id.clone(),
                    send_queue: Arc::new(futures::lock::Mutex::new(send_queue)),
                },
            )
            .await;
        self.fair_queue_inner
            .lock()
            .insert(peer_id.clone(), recv_queue);
    }

    fn peer_disconnected(&self, peer_id: &PeerIdentity) {
        if let Some(monitor) = self.monitor().lock().as_mut() {
            let _ = monitor.try_send(SocketEvent::Disconnected(peer_id.clone()));
        }
        self.peers.remove_sync(peer_id);
        // sandcell: the peer's stream leaves the fair queue too. The published socket kept a
        // stream that had failed there, so every later `recv` returned its error again (a
        // kernel's heartbeat loop spun on "bytes remaining in stream" after one half-sent
        // frame from a peer that left).
        self.fair_queue_inner.lock().remove(peer_id);
    }
}

impl SocketBackend for RepSocketBackend {
    fn socket_type(&self) -> SocketType {
        SocketType::REP
    }

    fn socket_options(&self) -> &Arc<SocketOptions> {
        &self.socket_options
    }

    fn shutdown(&self) {
        self.peers.clear_sync();
    }

    fn monitor(&self) -> &Mutex<Option<mpsc::Sender<SocketEvent>>> {
        &self.socket_monitor
    }
}

#[async_trait]
impl SocketSend for RepSocket {
    async fn send(&mut self, mut message: ZmqMessage) -> ZmqResult<()> {
        match self.current_request.take() {
            Some(peer_id) => {
                // sandcell: the writer is taken out of the table first (see `RepPeer`).
                let writer = self
                    .backend
                    .peers
                    .read_async(&peer_id, |_, peer| peer.send_queue.clone())
                    .await;
                if let Some(writer) = writer {
                    if let Some(envelope) = self.envelope.take() {
                        message.prepend(&envelope);
                    }
                    // sandcell: a reply never waits for its peer to read, as libzmq's REP
                    // drops a reply at the peer's high-water mark. The published send awaited
                    // the write: one peer that sent requests and did not read the replies
                    // held every other peer's request until its socket buffer drained (a
                    // heartbeat flooded by pingers that never read stopped for minutes). The
                    // write is tried at once; what the socket cannot take yet is finished by
                    // a task that holds the peer's writer, and a reply for a peer whose
                    // writer is still held is dropped.
                    let Some(mut w) = writer.try_lock_owned() else {
                        log::debug!(
                            "peer {:?} has not taken its last reply: reply dropped",
                            peer_id
                        );
                        return Ok(());
                    };
                    let mut write =
                        Box::pin(async move { w.send(Message::Message(message)).await });
                    match futures::poll!(&mut write) {
                        std::task::Poll::Ready(r) => r?,
                        std::task::Poll::Pending => {
                            crate::async_rt::task::spawn(async move {
                                let _ = write.await;
                            });
                        }
                    }
                    Ok(())
                } else {
                    Err(ZmqError::ReturnToSender {
                        reason: "Client disconnected",
                        message,
                    })
                }
            }
            None => Err(ZmqError::ReturnToSender {
                reason: "Unable to send reply. No request in progress",
                message,
            }),
        }
    }
}

#[async_trait]
impl SocketRecv for RepSocket {
    async fn recv(&mut self) -> ZmqResult<ZmqMessage> {
        loop {
            match self.fair_queue.next().await {
                Some((peer_id, Ok(message))) => match message {
                    Message::Message(mut m) => {
                        // sandcell: a malformed request (no envelope) is dropped, as libzmq's
                        // REP drops it, instead of failing this receive: the published socket
                        // returned an error for each, and a flood of one-frame messages kept
                        // a heartbeat loop busy with errors for minutes.
                        if m.len() < 2 {
                            continue;
                        }
                        let mut at = 1;
                        for (index, frame) in m.iter().enumerate() {
                            if frame.is_empty() {
                                // Include delimiter in envelope.
                                at = index + 1;
                                break;
                            }
                        }
                        let data = m.split_off(at);
                        // sandcell: the envelope goes back with the reply, so it is bounded
                        // like the request: routing ids are at most 255 bytes (ZMTP 3.0), and
                        // a request whose envelope passes `MAX_ENVELOPE_BYTES` is dropped. The
                        // published socket echoed any envelope, so a caller's check of the
                        // request's size (a heartbeat's) missed a 60 MB envelope, which then
                        // waited in a write buffer for a peer that never read.
                        let envelope: usize = m.iter().map(|f| f.len()).sum();
                        if envelope > MAX_ENVELOPE_BYTES || m.len() > MAX_ENVELOPE_FRAMES {
                            continue;
                        }
                        self.envelope = Some(m);
                        self.current_request = Some(peer_id);
                        return Ok(data);
                    }
                    Message::Greeting(_) | Message::Command(_) => {
                        // Ignore non-message frames. REP sockets should only process actual messages.
                    }
                },
                Some((peer_id, Err(_e))) => {
                    // sandcell: one peer's broken stream ends that peer, not this receive
                    // (libzmq's REP never reports a peer's error to its caller): the published
                    // socket returned it, and a caller that paused after each error was held
                    // back by a flood of reset connections.
                    self.backend.peer_disconnected(&peer_id);
                }
                None => {
                    return Err(ZmqError::NoMessage);
                }
            };
        }
    }
}
