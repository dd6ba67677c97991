//! A zlink transport over a Unix stream that bounds the size of one incoming message.
//!
//! zlink buffers a message until its terminating NUL and allows up to 100 MB; a hostile client
//! could make the daemon hold that much per connection. This transport counts the bytes since
//! the last NUL as they are read and fails the read once a message exceeds [`MAX_MESSAGE`],
//! which ends the connection. It does not accept file descriptors.

use std::os::fd::{AsFd, BorrowedFd};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use zlink::connection::socket::{self, ReadResult};

/// Largest message accepted from a client, in bytes: the source ceiling (512 KiB) with room
/// for JSON escaping (a `\u0000` escape is 6 bytes per source byte) and the envelope.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// A Unix stream with a bounded read side.
#[derive(Debug)]
pub struct BoundedStream(UnixStream);

impl BoundedStream {
    /// Wraps an accepted connection.
    pub fn new(stream: UnixStream) -> Self {
        Self(stream)
    }
}

/// Read half that fails a message longer than [`MAX_MESSAGE`].
#[derive(Debug)]
pub struct ReadHalf {
    inner: OwnedReadHalf,
    since_nul: usize,
}

/// Write half.
#[derive(Debug)]
pub struct WriteHalf(OwnedWriteHalf);

impl socket::Socket for BoundedStream {
    type ReadHalf = ReadHalf;
    type WriteHalf = WriteHalf;

    fn split(self) -> (ReadHalf, WriteHalf) {
        let (r, w) = self.0.into_split();
        (
            ReadHalf {
                inner: r,
                since_nul: 0,
            },
            WriteHalf(w),
        )
    }
}

impl socket::ReadHalf for ReadHalf {
    async fn read(&mut self, buf: &mut [u8]) -> zlink::Result<ReadResult> {
        let n = self.inner.read(buf).await?;
        let got = &buf[..n];
        self.since_nul = match got.iter().rposition(|&b| b == 0) {
            Some(i) => n - i - 1,
            None => self.since_nul + n,
        };
        if self.since_nul > MAX_MESSAGE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("message exceeds {MAX_MESSAGE} bytes"),
            )
            .into());
        }
        Ok(ReadResult::new(n))
    }
}

impl AsFd for ReadHalf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        let s: &UnixStream = self.inner.as_ref();
        s.as_fd()
    }
}

impl socket::UnixSocket for ReadHalf {}

impl socket::WriteHalf for WriteHalf {
    async fn write(
        &mut self,
        buf: &[u8],
        fds: &[impl AsFd],
        _credentials: Option<&zlink::connection::PassedCredentials>,
    ) -> zlink::Result<()> {
        if !fds.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "descriptor passing is not offered",
            )
            .into());
        }
        self.0.write_all(buf).await?;
        Ok(())
    }
}
