//! The Varlink transport of the daemon: bounded reading, linear writing, passed descriptors.
//!
//! zlink's own connection is not used on the server side, for three reasons measured on zlink
//! 0.8: its writer serializes a message into a buffer that starts at 256 bytes and, when the
//! message does not fit, grows it by 256 bytes and serializes the whole message again, so a
//! reply of n bytes costs O(n^2 / 256) (seconds of CPU for a 4 MiB error reply echoing a
//! client string: docs/internals/hostile-input.md, "Hostile clients"); its reader grows a buffer to the largest message
//! ever received and never gives it back; and it reads 256 bytes per system call.
//!
//! Here a message is read in chunks of [`READ_CHUNK`] bytes, bounded by [`MAX_MESSAGE`], must
//! complete within [`MESSAGE_SECONDS`] once its first byte arrived, and the buffer is released
//! once a message larger than [`KEEP_BUFFER`] was handed out. Bytes buffered beyond
//! [`KEEP_BUFFER`] draw on one daemon-wide read-ahead budget ([`READ_AHEAD_BYTES`]): a reader
//! that finds it exhausted waits (the kernel's socket buffer pushes back on its client).
//! Replies are serialized once with `serde_json` (linear) and written whole.
//!
//! Every byte the daemon holds for a client is charged to a daemon-wide reply budget
//! ([`REPLY_BYTES`]) and a per-uid one ([`REPLY_BYTES_PER_UID`]) until the kernel has handed
//! it to the client, in one place: [`Writer::send`], the only way bytes reach a client. It
//! charges each reply of every method (errors included) and each batch of streamed frames,
//! with what the connection's kernel send queue holds; a reply that does not fit is answered
//! `CapacityExceeded` instead (replies of at most [`SMALL_REPLY_BYTES`] are charged but never
//! refused), streamed frames wait for room. Once written, bytes stay charged while they sit
//! in the kernel's send queue (`SIOCOUTQ`, [`Writer::watch`]), which `SO_SNDBUF` keeps small
//! ([`SEND_BUFFER_BYTES`]); a connection whose queue does not shrink for
//! [`SEND_STALL_SECONDS`] is ended, and keeps its charge (and its place under the connection
//! caps) until its client has read or closed ([`Writer::linger`]). Replies that are large
//! before they are encoded (`GetFile`, `ListFiles`, an `Attach` replay) are also charged
//! ([`ReplyCharge`]) before anything is read. A client that sends calls and never reads the
//! replies thus holds at most its uid's share of daemon memory; past it, its calls are
//! answered `CapacityExceeded` at once.
//!
//! Descriptors (`SCM_RIGHTS`, for `PutFile`): at most [`MAX_FDS`] per `recvmsg` (more truncate
//! the control data, which ends the connection; the kernel closes the excess) and per message,
//! close-on-exec. They are owned by [`PassedFds`], whose drop closes them on a thread of its
//! own, never on the async runtime's threads: `close()` of a TCP socket with `SO_LINGER` blocks
//! for the linger time, of a FUSE file until its server answers. Sockets get `SO_LINGER` off
//! before the close. A uid with more than [`MAX_DISPOSING_PER_UID`] descriptors still being
//! closed is not read from until they are.

use crate::files::UploadFd;
use serde::Serialize;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Largest message accepted from a client, in bytes: the source ceiling with room for JSON
/// escaping and the envelope (`sandcell_proto` checks this at compile time).
pub const MAX_MESSAGE: usize = sandcell_proto::kernel::MAX_MESSAGE_BYTES;

/// Descriptors accepted with one message (and with one `recvmsg`).
pub const MAX_FDS: usize = 4;

/// Bytes asked of the socket per read.
pub const READ_CHUNK: usize = 64 * 1024;

/// A connection's read buffer is kept between messages up to this capacity, bytes; a larger
/// one is freed once its message was handed out.
pub const KEEP_BUFFER: usize = 64 * 1024;

/// Daemon-wide budget of buffered client bytes beyond each connection's first
/// [`KEEP_BUFFER`], bytes (16 messages of the largest size; [`crate::memory`]).
pub const READ_AHEAD_BYTES: usize = crate::memory::READ_AHEAD_BYTES as usize;

/// Seconds within which a message must be complete once its first byte arrived; a client that
/// trickles a message slower than that is disconnected.
pub const MESSAGE_SECONDS: u64 = 30;

/// Descriptors of one uid that may be waiting to be closed before its connections are no
/// longer read from.
pub const MAX_DISPOSING_PER_UID: usize = 16;

/// Daemon-wide budget of replies being built, written or queued in the kernel, bytes
/// (`daemon_reply_bytes`; [`crate::memory::REPLY_BYTES`]).
pub const REPLY_BYTES: usize = crate::memory::REPLY_BYTES as usize;

/// Share of [`REPLY_BYTES`] one uid may hold, bytes (`reply_bytes_per_uid`): a quarter, so one
/// uid that stops reading leaves room for others.
pub const REPLY_BYTES_PER_UID: usize = crate::memory::REPLY_BYTES_PER_UID as usize;

/// Bytes charged to the reply budgets: daemon-wide, and per uid.
static REPLY_IN_USE: LazyLock<Mutex<(usize, HashMap<u32, usize>)>> =
    LazyLock::new(|| Mutex::new((0, HashMap::new())));

/// A refused reply charge: the budget that was full (`daemon_reply_bytes` or
/// `reply_bytes_per_uid`), its use, the request and its maximum, bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyRefused {
    pub budget: &'static str,
    pub in_use: u64,
    pub requested: u64,
    pub max: u64,
}

/// Bytes of a large reply charged to the reply budgets; returned when dropped.
#[derive(Debug)]
pub struct ReplyCharge {
    uid: u32,
    bytes: usize,
}

impl ReplyCharge {
    /// Charges `bytes` to the daemon-wide and `uid`'s reply budgets, or says which is full.
    pub fn new(uid: u32, bytes: usize) -> Result<ReplyCharge, ReplyRefused> {
        Self::charge(uid, bytes, REPLY_BYTES, REPLY_BYTES_PER_UID)
    }

    fn charge(
        uid: u32,
        bytes: usize,
        total_max: usize,
        uid_max: usize,
    ) -> Result<ReplyCharge, ReplyRefused> {
        // A new charge is an empty one grown to `bytes`; dropped on refusal, it returns nothing.
        let mut c = ReplyCharge { uid, bytes: 0 };
        c.resize_within(bytes, total_max, uid_max)?;
        Ok(c)
    }

    /// Changes the charge to `bytes` (the reply's encoded size once known), or says which
    /// budget growing to it would overflow (the charge is then unchanged).
    pub fn resize(&mut self, bytes: usize) -> Result<(), ReplyRefused> {
        self.resize_within(bytes, REPLY_BYTES, REPLY_BYTES_PER_UID)
    }

    fn resize_within(
        &mut self,
        bytes: usize,
        total_max: usize,
        uid_max: usize,
    ) -> Result<(), ReplyRefused> {
        let mut g = REPLY_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        let mine = g.1.get(&self.uid).copied().unwrap_or(0);
        if bytes > self.bytes {
            let more = bytes - self.bytes;
            if mine + more > uid_max {
                return Err(ReplyRefused {
                    budget: "reply_bytes_per_uid",
                    in_use: mine as u64,
                    requested: more as u64,
                    max: uid_max as u64,
                });
            }
            if g.0 + more > total_max {
                return Err(ReplyRefused {
                    budget: "daemon_reply_bytes",
                    in_use: g.0 as u64,
                    requested: more as u64,
                    max: total_max as u64,
                });
            }
        }
        g.0 = g.0 - self.bytes + bytes;
        g.1.insert(self.uid, mine - self.bytes + bytes);
        self.bytes = bytes;
        Ok(())
    }

    /// Sets the charge to `bytes` whatever the budgets hold (for bytes that exist already and
    /// are bounded otherwise: a connection's send queue, a small reply).
    pub fn force(&mut self, bytes: usize) {
        self.resize_within(bytes, usize::MAX, usize::MAX)
            .expect("an unbounded budget takes any charge");
    }

    /// Bytes charged.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for ReplyCharge {
    fn drop(&mut self) {
        let mut g = REPLY_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= self.bytes;
        if let Some(mine) = g.1.get_mut(&self.uid) {
            *mine -= self.bytes;
            if *mine == 0 {
                g.1.remove(&self.uid);
            }
        }
    }
}

/// Bytes charged to the reply budgets now, daemon-wide and for `uid`.
pub fn reply_bytes_in_use(uid: u32) -> (usize, usize) {
    let g = REPLY_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
    (g.0, g.1.get(&uid).copied().unwrap_or(0))
}

static READ_AHEAD: LazyLock<Arc<Semaphore>> =
    LazyLock::new(|| Arc::new(Semaphore::new(READ_AHEAD_BYTES / READ_CHUNK)));

/// One message as received: its bytes (without the terminating NUL) and its descriptors.
#[derive(Debug)]
pub struct Message {
    /// The JSON text.
    pub bytes: Vec<u8>,
    /// Descriptors passed with it.
    pub fds: PassedFds,
    /// Read-ahead budget held while the message is alive.
    _budget: Vec<OwnedSemaphorePermit>,
}

/// The read side of a client connection.
#[derive(Debug)]
pub struct Reader {
    inner: OwnedReadHalf,
    uid: u32,
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a NUL.
    scanned: usize,
    /// Descriptors with the buffer position of the last byte that came with them.
    pending: Vec<(usize, Vec<OwnedFd>)>,
    budget: Vec<OwnedSemaphorePermit>,
    started: Option<tokio::time::Instant>,
    partial: Arc<AtomicBool>,
}

/// The write side of a client connection: its socket and the charge of the bytes it holds
/// for the client (a reply being written and the kernel's send queue).
#[derive(Debug)]
pub struct Writer {
    half: OwnedWriteHalf,
    held: Mutex<ReplyCharge>,
    /// A [`Writer::send`] is under way (it owns the charge meanwhile).
    sending: AtomicBool,
    /// Woken after every send, for [`Writer::watch`].
    wrote: Notify,
}

/// Splits an accepted connection for a client of `uid`, after setting its `SO_SNDBUF` to
/// [`SEND_BUFFER_BYTES`].
pub fn split(stream: UnixStream, uid: u32) -> (Reader, Writer) {
    set_send_buffer(&stream);
    let (r, w) = stream.into_split();
    (
        Reader {
            inner: r,
            uid,
            buf: Vec::new(),
            scanned: 0,
            pending: Vec::new(),
            budget: Vec::new(),
            started: None,
            partial: Arc::default(),
        },
        Writer {
            half: w,
            held: Mutex::new(ReplyCharge { uid, bytes: 0 }),
            sending: AtomicBool::new(false),
            wrote: Notify::new(),
        },
    )
}

/// Sets `SO_SNDBUF` to [`SEND_BUFFER_BYTES`] (the kernel doubles it; socket(7)). A failure is
/// logged: the kernel's default then applies, still charged while queued.
fn set_send_buffer(s: &UnixStream) {
    let v = SEND_BUFFER_BYTES as libc::c_int;
    // SAFETY: setsockopt reads one int.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "SO_SNDBUF not set");
    }
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

impl Reader {
    /// Whether part of a message is buffered (a call is on its way).
    pub fn partial(&self) -> bool {
        !self.buf.is_empty()
    }

    /// A flag that tells other tasks whether part of a message is buffered.
    pub fn partial_flag(&self) -> Arc<AtomicBool> {
        self.partial.clone()
    }

    /// The next complete message; `Ok(None)` when the client closed the connection between
    /// messages. Errors: the socket failed, a message exceeds [`MAX_MESSAGE`] bytes or
    /// [`MAX_FDS`] descriptors, took longer than [`MESSAGE_SECONDS`], or the connection ended
    /// inside one.
    pub async fn next(&mut self) -> std::io::Result<Option<Message>> {
        loop {
            if let Some(i) = self.buf[self.scanned..].iter().position(|&b| b == 0) {
                return Ok(Some(self.take(self.scanned + i)));
            }
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_MESSAGE {
                return Err(invalid(format!("message exceeds {MAX_MESSAGE} bytes")));
            }
            wait_disposals(self.uid).await;
            // Beyond the first chunk, every chunk buffered draws on the daemon-wide budget.
            if self.buf.len() >= KEEP_BUFFER {
                let deadline = self.deadline();
                let permit = tokio::time::timeout_at(deadline, READ_AHEAD.clone().acquire_owned())
                    .await
                    .map_err(|_| {
                        invalid(format!("message not complete after {MESSAGE_SECONDS} s"))
                    })?
                    .expect("the read-ahead semaphore is never closed");
                self.budget.push(permit);
            }
            let deadline = self.deadline();
            let (n, fds) = match tokio::time::timeout_at(deadline, self.read_chunk()).await {
                Ok(r) => r?,
                Err(_) => {
                    return Err(invalid(format!(
                        "message not complete after {MESSAGE_SECONDS} s"
                    )));
                }
            };
            if n == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if self.started.is_none() {
                self.started = Some(tokio::time::Instant::now());
            }
            self.partial.store(true, Ordering::Relaxed);
            if !fds.is_empty() {
                // On Linux the descriptors came with the last byte of this read.
                self.pending.push((self.buf.len() - 1, fds));
            }
        }
    }

    fn deadline(&self) -> tokio::time::Instant {
        match self.started {
            Some(t) => t + Duration::from_secs(MESSAGE_SECONDS),
            None => tokio::time::Instant::now() + Duration::from_secs(86_400 * 365),
        }
    }

    /// Splits off the message ending with the NUL at `nul`.
    fn take(&mut self, nul: usize) -> Message {
        let rest = self.buf.split_off(nul + 1);
        let mut bytes = std::mem::replace(&mut self.buf, rest);
        bytes.pop();
        if self.buf.is_empty() && self.buf.capacity() > KEEP_BUFFER {
            self.buf = Vec::new();
        }
        self.scanned = 0;
        let mut fds = Vec::new();
        let mut kept = Vec::new();
        for (pos, v) in std::mem::take(&mut self.pending) {
            if pos <= nul {
                fds.extend(v);
            } else {
                kept.push((pos - nul - 1, v));
            }
        }
        self.pending = kept;
        // Budget: the message keeps what its bytes drew; what is left over stays buffered.
        let held = self
            .buf
            .len()
            .saturating_sub(KEEP_BUFFER)
            .div_ceil(READ_CHUNK);
        let budget = self.budget.split_off(held.min(self.budget.len()));
        self.partial.store(!self.buf.is_empty(), Ordering::Relaxed);
        self.started = if self.buf.is_empty() {
            None
        } else {
            Some(tokio::time::Instant::now())
        };
        let count = fds.len();
        let fds = PassedFds::new(fds, self.uid);
        if count > MAX_FDS {
            // Dropped (closed off-runtime); the caller sees a message with too many.
            tracing::debug!(count, "message with too many descriptors");
        }
        Message {
            bytes,
            fds,
            _budget: budget,
        }
    }

    /// One non-blocking `recvmsg` of at most [`READ_CHUNK`] bytes appended to the buffer.
    async fn read_chunk(&mut self) -> std::io::Result<(usize, Vec<OwnedFd>)> {
        let old = self.buf.len();
        let want = READ_CHUNK.min(MAX_MESSAGE + 1 - old.min(MAX_MESSAGE));
        self.buf.resize(old + want, 0);
        let r = loop {
            let s: &UnixStream = self.inner.as_ref();
            if let Err(e) = s.readable().await {
                break Err(e);
            }
            match s.try_io(Interest::READABLE, || {
                recv_with_fds(s, &mut self.buf[old..old + want])
            }) {
                Ok(r) => break Ok(r),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => break Err(e),
            }
        };
        match r {
            Ok((n, fds)) => {
                self.buf.truncate(old + n);
                let pending: usize = self.pending.iter().map(|(_, v)| v.len()).sum();
                if pending + fds.len() > MAX_FDS {
                    drop(PassedFds::new(fds, self.uid));
                    return Err(invalid(format!(
                        "more than {MAX_FDS} descriptors with one message"
                    )));
                }
                Ok((n, fds))
            }
            Err(e) => {
                self.buf.truncate(old);
                Err(e)
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        for (_, v) in std::mem::take(&mut self.pending) {
            drop(PassedFds::new(v, self.uid));
        }
    }
}

/// Control buffer for [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuf([u8; 64]);

/// One non-blocking `recvmsg` into `buf`: the bytes read and the descriptors that came with
/// them (close-on-exec). Errors: the OS error (`WouldBlock` when nothing is ready), or
/// `InvalidData` when more than [`MAX_FDS`] descriptors were sent at once (the kernel closes
/// those that did not fit; those that did are closed off the runtime).
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
        // Never closed here, on the runtime's thread.
        drop(PassedFds::new_unowned(fds));
        return Err(invalid(format!(
            "more than {MAX_FDS} descriptors in one message"
        )));
    }
    Ok((n as usize, fds))
}

/// Bytes asked of the kernel as `SO_SNDBUF` on every accepted connection
/// ([`crate::memory::SEND_BUFFER_BYTES`]). The kernel doubles the value (socket(7)), so a
/// connection's send queue takes about 32 KiB of the daemon's memory before `write()` blocks,
/// instead of the default `wmem_default` (about 208 KiB; 232 KiB measured with overhead).
pub const SEND_BUFFER_BYTES: usize = crate::memory::SEND_BUFFER_BYTES as usize;

/// Kernel memory one connection's send queue can hold, bytes
/// ([`crate::memory::SEND_QUEUE_BOUND`]).
pub const SEND_QUEUE_BOUND: usize = crate::memory::SEND_QUEUE_BOUND as usize;

/// Replies of at most this many bytes are never refused for want of reply budget (errors,
/// `CapacityExceeded` itself, `Open`, small statuses): they are charged all the same, and
/// the connection's fixed share of the daemon's memory covers one of them.
pub const SMALL_REPLY_BYTES: usize = 4 * 1024;

/// Seconds a connection's send queue may stay non-empty without the client taking a byte of
/// it (and a reply or frame may wait to enter the kernel) before the connection is ended.
pub const SEND_STALL_SECONDS: u64 = 30;

/// Shortest and longest interval between two looks at a connection's send queue (`SIOCOUTQ`)
/// while it is not empty.
const QUEUE_POLL_MIN: Duration = Duration::from_millis(20);
const QUEUE_POLL_MAX: Duration = Duration::from_secs(1);

/// What kind of bytes a [`Writer::send`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A reply: refused with [`SendError::Refused`] when it does not fit the reply budgets
    /// (unless it is at most [`SMALL_REPLY_BYTES`]).
    Reply,
    /// Frames of a stream already under way: wait for the budgets to have room (a client
    /// that reads nothing stalls its own stream), ending the connection after
    /// [`SEND_STALL_SECONDS`].
    Stream,
}

/// Why a [`Writer::send`] did not write.
#[derive(Debug)]
pub enum SendError {
    /// The reply does not fit a reply budget; nothing was written, the connection is fine.
    Refused(ReplyRefused),
    /// The connection is unusable (peer gone, socket failed, or stalled:
    /// `TimedOut`).
    Io(std::io::Error),
}

impl From<std::io::Error> for SendError {
    fn from(e: std::io::Error) -> Self {
        SendError::Io(e)
    }
}

/// Bytes of the kernel's send queue of socket `fd` not yet taken by the peer (`SIOCOUTQ`,
/// unix(7): on a Unix socket, the memory its queued buffers take, overhead included); 0 when
/// the socket cannot say.
fn send_queue(fd: std::os::fd::RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one int.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    if r == 0 { n.max(0) as usize } else { 0 }
}

impl Writer {
    fn fd(&self) -> std::os::fd::RawFd {
        let s: &UnixStream = self.half.as_ref();
        s.as_raw_fd()
    }

    /// Bytes of this connection's kernel send queue not yet taken by the client.
    pub fn queued(&self) -> usize {
        send_queue(self.fd())
    }

    /// Bytes this connection holds charged to the reply budgets now (a reply being written and
    /// the kernel's send queue).
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).bytes()
    }

    /// Sets the charge to the send queue's size (never refused: bounded by
    /// [`SEND_QUEUE_BOUND`]).
    fn settle(&self) {
        let q = self.queued();
        self.held.lock().unwrap_or_else(|e| e.into_inner()).force(q);
    }

    /// Writes `buf` (whole Varlink messages, each ending in NUL): the one way bytes reach a
    /// client, so every reply of every method is charged. The charge is the message plus what
    /// the kernel's send queue already holds, to the daemon-wide and the client uid's reply
    /// budgets ([`REPLY_BYTES`], [`REPLY_BYTES_PER_UID`]); once written, the message's bytes
    /// stay charged as long as they sit in the send queue (see [`Writer::watch`]).
    ///
    /// Errors: [`SendError::Refused`] for a [`Kind::Reply`] of more than
    /// [`SMALL_REPLY_BYTES`] that does not fit (nothing written); [`SendError::Io`] when the
    /// peer is gone or the socket failed, or `TimedOut` when the client took nothing for
    /// [`SEND_STALL_SECONDS`] (the caller then ends the connection).
    pub async fn send(&self, buf: Vec<u8>, kind: Kind) -> Result<(), SendError> {
        struct Sending<'a>(&'a Writer);
        impl Drop for Sending<'_> {
            fn drop(&mut self) {
                self.0.settle();
                self.0.sending.store(false, Ordering::Relaxed);
                self.0.wrote.notify_one();
            }
        }
        self.sending.store(true, Ordering::Relaxed);
        let _sending = Sending(self);
        let stall = Duration::from_secs(SEND_STALL_SECONDS);
        let since = tokio::time::Instant::now();
        let mut pause = QUEUE_POLL_MIN;
        loop {
            let charged = {
                let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
                let want = self.queued() + buf.len();
                if buf.len() <= SMALL_REPLY_BYTES {
                    h.force(want);
                    Ok(())
                } else {
                    h.resize(want)
                }
            };
            match (charged, kind) {
                (Ok(()), _) => break,
                (Err(r), Kind::Reply) => return Err(SendError::Refused(r)),
                (Err(_), Kind::Stream) if since.elapsed() >= stall => {
                    return Err(stalled().into());
                }
                (Err(_), Kind::Stream) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(QUEUE_POLL_MAX);
                }
            }
        }
        let stream: &UnixStream = self.half.as_ref();
        let mut rest = &buf[..];
        while !rest.is_empty() {
            match tokio::time::timeout(stall, stream.writable()).await {
                Ok(r) => r?,
                Err(_) => return Err(stalled().into()),
            }
            match stream.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Keeps this connection's charge equal to its kernel send queue while the queue drains
    /// (looking every 20 ms to 1 s while it is not empty, and after every write), and returns
    /// when the queue stayed non-empty without shrinking for [`SEND_STALL_SECONDS`]: the
    /// client stopped reading, and the caller ends the connection.
    pub async fn watch(&self) {
        let stall = Duration::from_secs(SEND_STALL_SECONDS);
        let mut last = (0usize, tokio::time::Instant::now());
        let mut pause = QUEUE_POLL_MIN;
        loop {
            let wrote = self.wrote.notified();
            let q = self.queued();
            if !self.sending.load(Ordering::Relaxed) {
                self.settle();
            }
            if q == 0 {
                wrote.await;
                last = (0, tokio::time::Instant::now());
                pause = QUEUE_POLL_MIN;
                continue;
            }
            if q != last.0 {
                if q < last.0 {
                    pause = QUEUE_POLL_MIN;
                }
                last = (q, tokio::time::Instant::now());
            } else if last.1.elapsed() >= stall && !self.sending.load(Ordering::Relaxed) {
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(QUEUE_POLL_MAX);
        }
    }

    /// Shuts the connection down both ways (`shutdown(2)`): the reader sees end of file and
    /// writes fail, so the connection's task ends it.
    pub fn end(&self) {
        let s: &UnixStream = self.half.as_ref();
        let _ = nix::sys::socket::shutdown(s.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    /// Ends the connection for the client (`shutdown(2)` both ways: it reads what is queued,
    /// then end of file) and returns once the kernel's send queue is empty, keeping it
    /// charged until then: bytes a client leaves unread stay in the daemon's memory (they are
    /// the daemon's socket buffers, in the client's receive queue) until it reads them or
    /// closes its end, whatever the daemon does with its own end.
    pub async fn linger(&self) {
        self.end();
        let mut pause = QUEUE_POLL_MIN;
        loop {
            self.settle();
            if self.queued() == 0 {
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(QUEUE_POLL_MAX);
        }
    }
}

fn stalled() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("the client took nothing of its replies for {SEND_STALL_SECONDS} s"),
    )
}

/// Appends `value` as one Varlink message (JSON and a NUL) to `buf`, in time linear in its
/// size.
pub fn encode(buf: &mut Vec<u8>, value: &impl Serialize) -> std::io::Result<()> {
    serde_json::to_writer(&mut *buf, value).map_err(std::io::Error::other)?;
    buf.push(0);
    Ok(())
}

/// Peer credentials of a connection: uid, gid, pid, and a pidfd where the kernel offers
/// `SO_PEERPIDFD` (Linux 6.5).
pub fn peer_credentials(s: &UnixStream) -> std::io::Result<(u32, u32, u32, Option<OwnedFd>)> {
    let c = s.peer_cred()?;
    let pid = c
        .pid()
        .filter(|p| *p > 0)
        .ok_or_else(|| invalid("no peer pid".into()))? as u32;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // SAFETY: on success `fd` is a fresh pidfd owned by this process.
    let pidfd = (r == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) });
    Ok((c.uid(), c.gid(), pid, pidfd))
}

// ---- descriptors passed by clients ----

#[derive(Default)]
struct Disposing {
    per_uid: Mutex<HashMap<u32, usize>>,
    done: Notify,
}

static DISPOSING: LazyLock<Disposing> = LazyLock::new(Disposing::default);

fn disposing(uid: u32) -> usize {
    DISPOSING
        .per_uid
        .lock()
        .unwrap()
        .get(&uid)
        .copied()
        .unwrap_or(0)
}

/// Waits while `uid` has more than [`MAX_DISPOSING_PER_UID`] descriptors being closed.
async fn wait_disposals(uid: u32) {
    loop {
        let notified = DISPOSING.done.notified();
        if disposing(uid) <= MAX_DISPOSING_PER_UID {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
    }
}

/// Descriptors a client passed. Dropping closes them on a thread of their own (after turning
/// `SO_LINGER` off on sockets), never on the caller's thread.
#[derive(Debug, Default)]
pub struct PassedFds {
    fds: Vec<OwnedFd>,
    uid: Option<u32>,
}

impl PassedFds {
    fn new(fds: Vec<OwnedFd>, uid: u32) -> Self {
        Self {
            fds,
            uid: Some(uid),
        }
    }

    fn new_unowned(fds: Vec<OwnedFd>) -> Self {
        Self { fds, uid: None }
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.fds.len()
    }

    /// Whether none was passed.
    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Takes the descriptor at `i` out (to be used on the blocking pool only: inspect it with
    /// [`crate::files::inspect_upload`]); `None` when there is no such index. Dropped, it is
    /// closed as the others are.
    pub fn take(&mut self, i: usize) -> Option<UploadFd> {
        let uid = self.uid;
        (i < self.fds.len())
            .then(|| UploadFd::new(self.fds.swap_remove(i), move |fd| dispose(vec![fd], uid)))
    }
}

impl Drop for PassedFds {
    fn drop(&mut self) {
        dispose(std::mem::take(&mut self.fds), self.uid);
    }
}

/// Closes `fds` on a new thread. Sockets first get `SO_LINGER` off, so their close returns at
/// once; anything else (a FUSE or NFS file flushes on close) may block that thread only.
fn dispose(fds: Vec<OwnedFd>, uid: Option<u32>) {
    if fds.is_empty() {
        return;
    }
    let n = fds.len();
    if let Some(uid) = uid {
        *DISPOSING.per_uid.lock().unwrap().entry(uid).or_default() += n;
    }
    let work = move || {
        for fd in fds {
            no_linger(&fd);
            drop(fd);
        }
        if let Some(uid) = uid {
            let mut m = DISPOSING.per_uid.lock().unwrap();
            if let Some(c) = m.get_mut(&uid) {
                *c = c.saturating_sub(n);
                if *c == 0 {
                    m.remove(&uid);
                }
            }
            drop(m);
            DISPOSING.done.notify_waiters();
        }
    };
    let spawned = std::thread::Builder::new()
        .name("sandcelld-fd-close".into())
        .stack_size(64 * 1024)
        .spawn(work);
    if let Err(e) = spawned {
        // Without a thread the descriptors are leaked rather than closed on the runtime: a
        // bounded cost (at most MAX_FDS per message) against a stalled daemon.
        tracing::warn!(error = %e, "no thread to close passed descriptors; leaking them");
    }
}

/// Turns lingering off on a socket (no-op for anything else): its close then returns at once
/// and the kernel finishes the connection in the background.
fn no_linger(fd: &OwnedFd) {
    let off = libc::linger {
        l_onoff: 0,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads `off` for its size; on a non-socket it fails with ENOTSOCK.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&off as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

#[cfg(test)]
mod reply_budget_tests {
    use super::*;

    #[test]
    fn charges_are_bounded_per_uid_and_in_total_and_returned_on_drop() {
        let uid = 4_000_000_001;
        let a = ReplyCharge::charge(uid, 600, usize::MAX / 2, 1000).unwrap();
        let refused = ReplyCharge::charge(uid, 500, usize::MAX / 2, 1000).unwrap_err();
        assert_eq!(
            refused,
            ReplyRefused {
                budget: "reply_bytes_per_uid",
                in_use: 600,
                requested: 500,
                max: 1000
            }
        );
        // Another uid is not held back by the first one's share.
        let total = reply_bytes_in_use(uid).0;
        let b = ReplyCharge::charge(uid + 1, 500, total + 500, 1000).unwrap();
        let refused = ReplyCharge::charge(uid + 2, 1, total + 500, 1000).unwrap_err();
        assert_eq!(refused.budget, "daemon_reply_bytes");
        let mut a = a;
        a.resize(100).unwrap();
        assert_eq!(reply_bytes_in_use(uid).1, 100);
        // Growing past the uid's share is refused and leaves the charge as it was.
        assert_eq!(
            a.resize_within(2000, usize::MAX / 2, 1000)
                .unwrap_err()
                .budget,
            "reply_bytes_per_uid"
        );
        assert_eq!(a.bytes(), 100);
        drop(a);
        drop(b);
        assert_eq!(reply_bytes_in_use(uid).1, 0);
        assert_eq!(reply_bytes_in_use(uid + 1).1, 0);
        assert!(ReplyCharge::charge(uid, 1000, usize::MAX / 2, 1000).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_split_and_large_buffers_are_released() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut r, _w) = split(a, 1);
        let big = vec![b'x'; 300 * 1024];
        let mut data = big.clone();
        data.push(0);
        data.extend_from_slice(b"{}\0{\"a\"");
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut b = b;
            b.write_all(&data).await.unwrap();
            b
        });
        let m = r.next().await.unwrap().unwrap();
        assert_eq!(m.bytes.len(), big.len());
        let b = writer.await.unwrap();
        let m2 = r.next().await.unwrap().unwrap();
        assert_eq!(m2.bytes, b"{}");
        assert!(r.buf.capacity() <= KEEP_BUFFER, "{}", r.buf.capacity());
        assert!(r.partial());
        drop(b);
        assert!(r.next().await.is_err(), "a message cut by EOF is an error");
    }

    #[test]
    fn encoding_a_large_reply_is_linear() {
        let s = "é".repeat(4 << 20);
        let t0 = std::time::Instant::now();
        let mut buf = Vec::new();
        encode(
            &mut buf,
            &serde_json::json!({ "error": "x", "parameters": { "s": s } }),
        )
        .unwrap();
        assert_eq!(*buf.last().unwrap(), 0);
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}
