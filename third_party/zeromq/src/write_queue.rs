use crate::codec::{CodecResult, Message, ZmqFramedWrite};

use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};

use std::sync::atomic::{AtomicUsize, Ordering};

const WRITE_BATCH_LIMIT: usize = 128;

/// sandcell: the most messages queued for one peer of a ROUTER or XPUB socket (libzmq's
/// default ZMQ_SNDHWM; the published crate queued 100,000 messages of any size per peer).
pub const PEER_QUEUE_MESSAGES: usize = 1000;

/// sandcell: the most bytes queued for one peer of a ROUTER or XPUB socket. Past either
/// bound a message for that peer is dropped, as libzmq drops at its high-water mark.
pub const PEER_QUEUE_BYTES: usize = 64 * 1024 * 1024;

/// sandcell: the bytes of a message's frames.
pub(crate) fn message_bytes(message: &crate::ZmqMessage) -> usize {
    message.iter().map(|f| f.len()).sum()
}

fn queued_bytes(message: &Message) -> usize {
    match message {
        Message::Message(m) => message_bytes(m),
        _ => 0,
    }
}

/// sandcell: the most bytes queued for all peers of all sockets of the process together.
/// A peer that never reads holds up to [`PEER_QUEUE_BYTES`]; without a total, ten such
/// peers of one key holder held 640 MiB of replies. Past it a message is dropped as past a
/// peer's own bound.
pub const TOTAL_QUEUE_BYTES: usize = 256 * 1024 * 1024;

/// sandcell: the bytes counted by every [`HighWater`] that uses the process-wide total.
static TOTAL_QUEUED: AtomicUsize = AtomicUsize::new(0);

/// sandcell: the messages and bytes queued for one peer and not yet written, within
/// [`PEER_QUEUE_MESSAGES`] and [`PEER_QUEUE_BYTES`], and with every other peer within
/// [`TOTAL_QUEUE_BYTES`]. Counted here, not by the channel: a cloned futures Sender has a
/// slot of its own, so the channel's bound alone does not hold for sends through clones.
/// What a peer still holds when its count is dropped (the peer left with messages queued)
/// returns to the total.
#[derive(Debug)]
pub(crate) struct HighWater {
    messages: AtomicUsize,
    bytes: AtomicUsize,
    total: &'static AtomicUsize,
    total_bound: usize,
}

impl Default for HighWater {
    fn default() -> Self {
        Self::within(&TOTAL_QUEUED, TOTAL_QUEUE_BYTES)
    }
}

impl HighWater {
    /// A count whose bytes also count against `total`, which stays within `total_bound`.
    pub(crate) fn within(total: &'static AtomicUsize, total_bound: usize) -> Self {
        Self {
            messages: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            total,
            total_bound,
        }
    }

    /// Counts a message of `bytes` if it fits the peer's bounds and the total; false
    /// (nothing counted) if not.
    pub(crate) fn admit(&self, bytes: usize) -> bool {
        let before = self.messages.fetch_add(1, Ordering::AcqRel);
        let held = self.bytes.fetch_add(bytes, Ordering::AcqRel);
        let all = self.total.fetch_add(bytes, Ordering::AcqRel);
        if before >= PEER_QUEUE_MESSAGES
            || held + bytes > PEER_QUEUE_BYTES
            || all + bytes > self.total_bound
        {
            self.release(1, bytes);
            return false;
        }
        true
    }

    /// Uncounts `messages` messages of `bytes` in all (written, or not queued after all).
    pub(crate) fn release(&self, messages: usize, bytes: usize) {
        self.messages.fetch_sub(messages, Ordering::AcqRel);
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.total.fetch_sub(bytes, Ordering::AcqRel);
    }
}

impl Drop for HighWater {
    fn drop(&mut self) {
        self.total
            .fetch_sub(*self.bytes.get_mut(), Ordering::AcqRel);
    }
}

/// Writes queued socket messages into the underlying framed sink in small batches.
#[inline]
pub(crate) async fn write_message_queue(
    queue_receiver: mpsc::Receiver<Message>,
    send_queue: ZmqFramedWrite,
) -> CodecResult<()> {
    write_counted_message_queue(queue_receiver, send_queue, |_, _| {}).await
}

/// sandcell: [`write_message_queue`] that calls `written` with each batch's message count
/// and bytes once they are flushed to the peer, so that a sender can count what is queued or buffered for
/// it (a ROUTER peer's high-water mark).
pub(crate) async fn write_counted_message_queue(
    mut queue_receiver: mpsc::Receiver<Message>,
    mut send_queue: ZmqFramedWrite,
    written: impl Fn(usize, usize),
) -> CodecResult<()> {
    while let Some(message) = queue_receiver.next().await {
        // When backlog already exists, feed a batch before flushing once to avoid per-message flush cost during bursts.
        let (mut count, mut size) = (1, queued_bytes(&message));
        send_queue.feed(message).await?;

        for _ in 1..WRITE_BATCH_LIMIT {
            let message = match queue_receiver.try_recv() {
                Ok(message) => message,
                Err(_) => break,
            };
            count += 1;
            size += queued_bytes(&message);
            send_queue.feed(message).await?;
        }

        send_queue.flush().await?;
        written(count, size);
    }

    Ok(())
}

#[cfg(test)]
mod tests {
    mod batch_boundaries;

    use super::*;
    use crate::codec::{CodecError, ZmqCodec};
    use crate::ZmqMessage;

    use bytes::Bytes;
    use futures::{AsyncWrite, SinkExt};
    use parking_lot::Mutex;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    #[derive(Default)]
    struct WriteStats {
        bytes: Vec<u8>,
        flushes: usize,
    }

    struct RecordingWrite {
        stats: Arc<Mutex<WriteStats>>,
    }

    impl AsyncWrite for RecordingWrite {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let mut stats = self.stats.lock();
            stats.bytes.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.stats.lock().flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    struct FailingWrite;

    impl AsyncWrite for FailingWrite {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            _buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "writer failed",
            )))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[crate::async_rt::test]
    async fn test_write_message_queue_batches_ready_messages_into_one_flush() {
        let (mut sender, receiver) = mpsc::channel(8);
        sender
            .send(Message::Message(ZmqMessage::from(Bytes::from_static(b"a"))))
            .await
            .expect("send first message");
        sender
            .send(Message::Message(ZmqMessage::from(Bytes::from_static(b"b"))))
            .await
            .expect("send second message");
        sender
            .send(Message::Message(ZmqMessage::from(Bytes::from_static(b"c"))))
            .await
            .expect("send third message");
        drop(sender);

        let stats = Arc::new(Mutex::new(WriteStats::default()));
        let writer = RecordingWrite {
            stats: Arc::clone(&stats),
        };
        let send_queue = ZmqFramedWrite::new(Box::new(writer), ZmqCodec::new());

        write_message_queue(receiver, send_queue)
            .await
            .expect("write queued messages");

        let stats = stats.lock();
        assert_eq!(1, stats.flushes);
        assert_eq!(
            stats.bytes,
            vec![0x00, 0x01, b'a', 0x00, 0x01, b'b', 0x00, 0x01, b'c']
        );
    }

    #[crate::async_rt::test]
    async fn test_write_message_queue_returns_writer_errors() {
        let (mut sender, receiver) = mpsc::channel(1);
        sender
            .send(Message::Message(ZmqMessage::from(Bytes::from_static(b"a"))))
            .await
            .expect("send message");
        drop(sender);

        let send_queue = ZmqFramedWrite::new(Box::new(FailingWrite), ZmqCodec::new());
        let error = write_message_queue(receiver, send_queue)
            .await
            .expect_err("write error");

        let CodecError::Io(error) = error else {
            panic!("unexpected error type");
        };
        assert_eq!(io::ErrorKind::BrokenPipe, error.kind());
    }
}
