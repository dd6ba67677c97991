//! A zlink transport over a Unix stream that bounds the size of one incoming message.
//!
//! zlink buffers a message until its terminating NUL and allows up to 100 MB; a hostile client
//! could make the daemon hold that much per connection. This transport counts the bytes since
//! the last NUL as they are read and fails the read once a message exceeds [`MAX_MESSAGE`],
//! which ends the connection.
//!
//! It receives file descriptors (`SCM_RIGHTS`, for `PutFile`), bounded too: at most
//! [`MAX_FDS`] per `recvmsg` (more truncate the control data, which ends the connection; the
//! kernel closes the excess) and at most [`MAX_FDS`] received since the last message end.
//! Descriptors arrive close-on-exec (`MSG_CMSG_CLOEXEC`), so a worker forked meanwhile never
//! inherits one. It sends none.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use zlink::connection::socket::{self, ReadResult};

/// Largest message accepted from a client, in bytes: the source ceiling (512 KiB) with room
/// for JSON escaping (a `\u0000` escape is 6 bytes per source byte) and the envelope.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// Descriptors accepted with one message (and with one `recvmsg`).
pub const MAX_FDS: usize = 4;

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
    fds_since_nul: usize,
}

/// Write half.
#[derive(Debug)]
pub struct WriteHalf(OwnedWriteHalf);

impl socket::Socket for BoundedStream {
    type ReadHalf = ReadHalf;
    type WriteHalf = WriteHalf;

    const CAN_TRANSFER_FDS: bool = true;

    fn split(self) -> (ReadHalf, WriteHalf) {
        let (r, w) = self.0.into_split();
        (
            ReadHalf {
                inner: r,
                since_nul: 0,
                fds_since_nul: 0,
            },
            WriteHalf(w),
        )
    }
}

impl socket::ReadHalf for ReadHalf {
    async fn read(&mut self, buf: &mut [u8]) -> zlink::Result<ReadResult> {
        let (n, fds) = loop {
            let s: &UnixStream = self.inner.as_ref();
            s.readable().await?;
            match s.try_io(Interest::READABLE, || recv_with_fds(s, buf)) {
                Ok(r) => break r,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let got = &buf[..n];
        self.fds_since_nul = if got.contains(&0) {
            fds.len()
        } else {
            self.fds_since_nul + fds.len()
        };
        if self.fds_since_nul > MAX_FDS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("more than {MAX_FDS} descriptors with one message"),
            )
            .into());
        }
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
        Ok(ReadResult::new(n).set_fds(fds))
    }
}

/// Control buffer for [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuf([u8; 64]);

/// One non-blocking `recvmsg` into `buf`: the bytes read and the descriptors that came with
/// them (close-on-exec). Errors: the OS error (`WouldBlock` when nothing is ready), or
/// `InvalidData` when more than [`MAX_FDS`] descriptors were sent at once (the kernel closes
/// those that did not fit; those that did are closed here).
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = ControlBuf([0; 64]);
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<libc::c_int>()) as u32) };
    debug_assert!(space as usize <= control.0.len());
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` describes `buf` and `control`, both valid for writes of the given lengths.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the CMSG_* macros walk the control data the kernel wrote into `control`, within
    // msg_controllen; each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors,
    // fresh and owned by this process.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("more than {MAX_FDS} descriptors in one message"),
        ));
    }
    Ok((n as usize, fds))
}

impl AsFd for ReadHalf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        let s: &UnixStream = self.inner.as_ref();
        s.as_fd()
    }
}

impl socket::UnixSocket for ReadHalf {}

impl WriteHalf {
    /// Writes all of `buf` (whole Varlink messages, each ending in NUL) through a shared
    /// reference: how a batch of frames bypasses zlink's per-message write (zlink 0.8 has no
    /// public way to queue several replies). zlink's own buffer is empty between its calls,
    /// since each of its sends flushes, so messages never interleave.
    ///
    /// Errors: the peer is gone or the socket failed.
    pub async fn write_all_shared(&self, mut buf: &[u8]) -> std::io::Result<()> {
        let stream: &UnixStream = self.0.as_ref();
        while !buf.is_empty() {
            stream.writable().await?;
            match stream.try_write(buf) {
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

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
