use crate::codec::*;
use crate::endpoint::Endpoint;
use crate::error::ZmqResult;
use crate::fair_queue::{FairQueue, QueueInner};
use crate::message::*;
use crate::transport::AcceptStopHandle;
use crate::util::PeerIdentity;
use crate::write_queue::{message_bytes, HighWater, PEER_QUEUE_BYTES, PEER_QUEUE_MESSAGES};
use crate::{async_rt, CaptureSocket, SocketOptions};
use crate::{
    MultiPeerBackend, Socket, SocketBackend, SocketEvent, SocketRecv, SocketSend, SocketType,
    ZmqError,
};

use async_trait::async_trait;
use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;

use std::collections::HashMap;
use std::sync::Arc;

/// sandcell: the most messages queued for one subscriber (libzmq's default ZMQ_SNDHWM).
pub const XPUB_QUEUE_MESSAGES: usize = PEER_QUEUE_MESSAGES;

/// sandcell: the most bytes queued for one subscriber; past either bound a message for that
/// subscriber is dropped, as a libzmq PUB socket drops at its high-water mark.
pub const XPUB_QUEUE_BYTES: usize = PEER_QUEUE_BYTES;

pub(crate) struct XPubSubscriber {
    pub(crate) subscriptions: Vec<Vec<u8>>,
    // sandcell: messages go to a writer task per subscriber through a bounded queue. The
    // published socket awaited each subscriber's write in `send`, so one subscriber that
    // connected and never read (its TCP window full) stopped every later `send`.
    pub(crate) send_queue: mpsc::Sender<ZmqMessage>,
    // Messages and bytes queued and not yet written.
    pub(crate) queued: Arc<HighWater>,
}

/// sandcell: queues `message` for one subscriber, or drops it when the subscriber's queue is
/// at [`XPUB_QUEUE_MESSAGES`] or [`XPUB_QUEUE_BYTES`]; false when the subscriber's writer
/// has ended.
fn queue_for(subscriber: &XPubSubscriber, message: &ZmqMessage) -> bool {
    let bytes = message_bytes(message);
    if !subscriber.queued.admit(bytes) {
        return true;
    }
    match subscriber.send_queue.clone().try_send(message.clone()) {
        Ok(()) => true,
        Err(e) => {
            subscriber.queued.release(1, bytes);
            !e.is_disconnected()
        }
    }
}

pub(crate) struct XPubSocketBackend {
    subscribers: scc::HashMap<PeerIdentity, XPubSubscriber>,
    fair_queue_inner: Arc<Mutex<QueueInner<ZmqFramedRead, PeerIdentity>>>,
    socket_monitor: Mutex<Option<mpsc::Sender<SocketEvent>>>,
    socket_options: Arc<SocketOptions>,
}

impl XPubSocketBackend {
    fn message_received(&self, peer_id: &PeerIdentity, message: Message) {
        if let Message::Message(m) = &message {
            if m.len() == 1
                && m.iter()
                    .next()
                    .is_some_and(|f| f.len() > MAX_TOPIC_BYTES + 1)
            {
                return;
            }
        }
        let data = match message {
            Message::Message(m) => {
                if m.len() != 1 {
                    return;
                }
                m.into_vec().pop().unwrap_or_default()
            }
            _ => return,
        };

        if data.is_empty() {
            return;
        }

        match data.first() {
            Some(1) => {
                // Subscribe. sandcell: at most `MAX_SUBSCRIPTIONS` topics of at most
                // `MAX_TOPIC_BYTES` each per subscriber, no duplicates: the published socket
                // kept every subscription, so one connection without the key could make a
                // Jupyter kernel hold gigabytes of topics, and each unsubscription scanned them
                // all on the kernel's one thread (10,000 of them against a million topics
                // stopped it for 48 s). A topic past the bounds is ignored.
                let topic = &data[1..];
                if topic.len() <= MAX_TOPIC_BYTES {
                    if let Some(mut entry) = self.subscribers.get_sync(peer_id) {
                        if entry.subscriptions.len() < MAX_SUBSCRIPTIONS
                            && !entry.subscriptions.iter().any(|s| s.as_slice() == topic)
                        {
                            entry.subscriptions.push(Vec::from(topic));
                        }
                    }
                }
            }
            Some(0) => {
                // Unsubscribe
                let sub = Vec::from(&data[1..]);
                if let Some(mut entry) = self.subscribers.get_sync(peer_id) {
                    if let Some(index) = entry.subscriptions.iter().position(|s| s == &sub) {
                        entry.subscriptions.remove(index);
                    }
                }
            }
            _ => {}
        }
    }
}

impl SocketBackend for XPubSocketBackend {
    fn socket_type(&self) -> SocketType {
        SocketType::XPUB
    }

    fn socket_options(&self) -> &Arc<SocketOptions> {
        &self.socket_options
    }

    fn shutdown(&self) {
        self.subscribers.clear_sync();
    }

    fn monitor(&self) -> &Mutex<Option<mpsc::Sender<SocketEvent>>> {
        &self.socket_monitor
    }
}

#[async_trait]
impl MultiPeerBackend for XPubSocketBackend {
    async fn peer_connected(self: Arc<Self>, peer_id: &PeerIdentity, io: FramedIo) {
        let (recv_queue, mut send_queue) = io.into_parts();
        // `queue_for` keeps the queue at XPUB_QUEUE_MESSAGES (see `XPubSubscriber::queued`).
        let (queue_sender, mut queue_receiver) = mpsc::channel::<ZmqMessage>(XPUB_QUEUE_MESSAGES);
        let queued = Arc::new(HighWater::default());
        let writer_queued = queued.clone();
        let writer_backend = Arc::downgrade(&self);
        let writer_peer = peer_id.clone();
        async_rt::task::spawn(async move {
            while let Some(message) = queue_receiver.next().await {
                let bytes = message_bytes(&message);
                let sent = send_queue.send(Message::Message(message)).await;
                writer_queued.release(1, bytes);
                if let Err(e) = sent {
                    log::debug!("Error sending message to subscriber: {:?}", e);
                    if let Some(backend) = writer_backend.upgrade() {
                        backend.peer_disconnected(&writer_peer);
                    }
                    break;
                }
            }
        });

        self.subscribers
            .upsert_async(
                peer_id.clone(),
                XPubSubscriber {
                    subscriptions: vec![],
                    send_queue: queue_sender,
                    queued,
                },
            )
            .await;

        self.fair_queue_inner
            .lock()
            .insert(peer_id.clone(), recv_queue);
    }

    fn peer_disconnected(&self, peer_id: &PeerIdentity) {
        log::info!("Client disconnected {:?}", peer_id);
        self.subscribers.remove_sync(peer_id);
        self.fair_queue_inner.lock().remove(peer_id);
    }
}

/// sandcell: the most topics one subscriber may hold (Jupyter's clients subscribe to one,
/// the empty topic).
pub const MAX_SUBSCRIPTIONS: usize = 64;

/// sandcell: the longest topic kept, bytes.
pub const MAX_TOPIC_BYTES: usize = 1024;

pub struct XPubSocket {
    pub(crate) backend: Arc<XPubSocketBackend>,
    fair_queue: FairQueue<ZmqFramedRead, PeerIdentity>,
    binds: HashMap<Endpoint, AcceptStopHandle>,
}

impl Drop for XPubSocket {
    fn drop(&mut self) {
        self.backend.shutdown();
    }
}

#[async_trait]
impl SocketSend for XPubSocket {
    async fn send(&mut self, message: ZmqMessage) -> ZmqResult<()> {
        let first_frame = match message.get(0) {
            Some(frame) => frame,
            None => return Ok(()), // Empty message, nothing to publish
        };
        let mut dead_peers = Vec::new();
        let mut iter = self.backend.subscribers.begin_async().await;
        while let Some(subscriber) = iter {
            if subscriber.subscriptions.iter().any(|sub_filter| {
                sub_filter.len() <= first_frame.len()
                    && sub_filter.as_slice() == &first_frame[0..sub_filter.len()]
            }) && !queue_for(&subscriber, &message)
            {
                dead_peers.push(subscriber.key().clone());
            }
            iter = subscriber.next_async().await;
        }
        for peer in dead_peers {
            self.backend.peer_disconnected(&peer);
        }
        Ok(())
    }
}

#[async_trait]
impl SocketRecv for XPubSocket {
    async fn recv(&mut self) -> ZmqResult<ZmqMessage> {
        loop {
            match self.fair_queue.next().await {
                Some((peer_id, Ok(Message::Message(message)))) => {
                    // Process the subscription message internally to update tracking
                    self.backend
                        .message_received(&peer_id, Message::Message(message.clone()));
                    // Also expose it to the application
                    return Ok(message);
                }
                Some((_peer_id, Ok(_msg))) => {
                    // Ignore non-message frames
                }
                Some((peer_id, Err(e))) => {
                    self.backend.peer_disconnected(&peer_id);
                    return Err(e.into());
                }
                None => {
                    return Err(ZmqError::NoMessage);
                }
            }
        }
    }
}

impl CaptureSocket for XPubSocket {}

#[async_trait]
impl Socket for XPubSocket {
    fn with_options(options: SocketOptions) -> Self {
        let mut fair_queue = FairQueue::new(true);
        let backend = Arc::new(XPubSocketBackend {
            subscribers: scc::HashMap::new(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::async_rt;
    use crate::util::tests::{
        test_bind_to_any_port_helper, test_bind_to_unspecified_interface_helper,
    };
    use crate::ZmqResult;
    use std::net::IpAddr;

    #[async_rt::test]
    async fn test_bind_to_any_port() -> ZmqResult<()> {
        let s = XPubSocket::new();
        test_bind_to_any_port_helper(s).await
    }

    #[async_rt::test]
    async fn test_bind_to_any_ipv4_interface() -> ZmqResult<()> {
        let any_ipv4: IpAddr = "0.0.0.0".parse().unwrap();
        let s = XPubSocket::new();
        test_bind_to_unspecified_interface_helper(any_ipv4, s, 4020).await
    }

    #[async_rt::test]
    async fn test_bind_to_any_ipv6_interface() -> ZmqResult<()> {
        let any_ipv6: IpAddr = "::".parse().unwrap();
        let s = XPubSocket::new();
        test_bind_to_unspecified_interface_helper(any_ipv6, s, 4030).await
    }
}
