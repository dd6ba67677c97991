//! Host calls from Eryx cells: `from sandcell import host; host.call("name", {...})` calls a
//! tool of the client and returns its result, synchronously, in ordinary (non-async) cell
//! code, as in the native engines (proto `worker.rs`, "host calls").
//!
//! # The way out of the guest: a host-backed file
//!
//! Eryx 0.10.1's own callbacks are async in the guest (`await name()`: the `invoke` import is
//! a component-model async function), so a blocking `host.call` cannot be built on them: a
//! synchronous cell would have to run an event loop of its own, and the call would return
//! nothing to code that is not a coroutine. File I/O, on the other hand, is blocking from the
//! guest's point of view while eryx-vfs serves it on the host with `async fn`s
//! ([`VfsStorage`]). So the scratch storage mounted at [`crate::session::GUEST_SCRATCH_DIR`]
//! is wrapped ([`HostFile`]) and one path in it, [`GUEST_HOST_FILE`], is not a file: the
//! guest's `host.call` (in `driver.py`) opens it, writes its request
//! (`{"name": ..., "arguments": {...}}`, with `os.pwrite`) and reads the answer (`os.pread`
//! from offset 0 until the end); the first read after a request makes the call. Nothing else
//! of the host is reachable through it: it names no host path, and everything the guest writes
//! is checked here as the native workers check their own cells' calls (name, arguments object,
//! size, opt-in, one call at a time), because here the guest is the untrusted side. It is not
//! listed, cannot be created, removed or renamed, and takes no room in the scratch budget.
//!
//! # Waiting: blocking, with the interrupt and the deadline in the wait
//!
//! The read that makes the call blocks the thread that runs the guest (the cell loop's
//! thread, as a CPU-bound guest does) in `poll(2)` on the request pipe and an eventfd, until
//! the `host_reply` naming the call, the cell's SIGINT, or the cell's deadline. It does not
//! wait as a pending future: Eryx's own timeout and the cell loop's cancellation would then
//! drop the execution, which kills the instance (a rebuild from the last snapshot, losing what
//! the interrupted cell had assigned). Blocking, the wait ends on its own terms and returns to
//! the guest, which raises:
//! - the client's answer: the result, or `HostCallError` with its error (the daemon's own
//!   `host_call_timeout_seconds` arrives the same way, as an error answer);
//! - SIGINT: the watcher thread hands the interrupt to the waiting call
//!   ([`HostCalls::interrupt`]) instead of stopping the guest; the guest raises
//!   `KeyboardInterrupt`, the cell ends `interrupted` and the instance and its variables stay
//!   (the daemon's SIGINT repeats stop the guest the usual way if the cell catches it);
//! - the cell's deadline: `HostCallError`, and the cell ends `timeout` as any other (at the
//!   guest's next epoch check, or by the daemon's SIGINT and kill). A cell that catches it and
//!   calls again after its deadline gets `HostCallError` at once and no line is written: the
//!   daemon still counts the given-up call as in flight and would end the worker for a second
//!   one.
//!
//! The request pipe is read here directly (through the same [`Requests`] reader as the
//! worker's request loop): the daemon writes nothing else while a cell runs. A `host_reply`
//! naming another call (one given up on) is skipped; anything else ends the worker with status
//! 2, as a malformed request does. Bytes of a reply that arrive after the wait gave up stay for
//! the request loop, which skips them.
//!
//! # Order with the cell's output
//!
//! The `host_call` line must follow the output the cell wrote before the call. That output is
//! in Eryx's output channel, drained by the cell loop or by the output thread
//! ([`crate::output`]); so the line travels through the same channel, as a marker on
//! [`HOST_CALL_STREAM`] that the drainer turns into the line ([`HostCalls::take_line`]). The
//! wait for the answer starts once the line is queued; a call given up before that (the
//! deadline) never writes its line.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use async_trait::async_trait;
use eryx::OutputRequest;
use eryx::vfs::{ArcStorage, DirEntry, Metadata, VfsError, VfsResult, VfsStorage};
use sandcell_proto::kernel::{MAX_HOST_CALL_ARGUMENTS, MAX_HOST_CALL_NAME, valid_host_call_name};
use sandcell_proto::worker::{MAX_HEADER_LINE, Op, RequestHeader, WorkerMessage};
use serde_json::json;
use tokio::sync::mpsc::UnboundedSender;

use crate::protocol::MAX_PAYLOAD;

/// Guest path of the host-call file (inside the scratch directory; see the module docs).
pub const GUEST_HOST_FILE: &str = "/tmp/.sandcell-host";

/// Output stream number of the marker that stands for a `host_call` line in the cell's output
/// channel (data: the call number, 8 bytes little-endian).
pub const HOST_CALL_STREAM: u32 = 10;

/// Most request bytes the guest may write for one call: the arguments' bound plus room for
/// the name and the framing. Past it the call raises `ValueError` without a line.
pub const MAX_REQUEST: usize = MAX_HOST_CALL_ARGUMENTS + MAX_HOST_CALL_NAME + 1024;

/// Exit status of the worker when the daemon breaks the protocol during a wait (as
/// [`crate::worker::exit::MALFORMED`]).
const EXIT_MALFORMED: i32 = 2;

/// The request pipe (fd 3) as the worker reads it: bytes put back by a host-call wait that
/// gave up come first, then the pipe.
pub struct Requests {
    file: File,
    /// Bytes read from the pipe by a wait and not consumed (the start of a later reply).
    put_back: Vec<u8>,
}

impl Requests {
    /// Wraps the request pipe.
    pub fn new(file: File) -> Self {
        Self {
            file,
            put_back: Vec::new(),
        }
    }
}

impl Requests {
    /// Whether no put-back bytes wait (the next read goes to the pipe).
    pub fn is_empty(&self) -> bool {
        self.put_back.is_empty()
    }
}

impl Read for Requests {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.put_back.is_empty() {
            let n = buf.len().min(self.put_back.len());
            buf[..n].copy_from_slice(&self.put_back[..n]);
            self.put_back.drain(..n);
            return Ok(n);
        }
        self.file.read(buf)
    }
}

/// The running cell, as host calls see it.
struct CellCtx {
    cell: u64,
    nonce: Option<String>,
    /// The request said `host_calls=1`.
    enabled: bool,
    /// When the cell's wall time ends.
    deadline: Instant,
    /// The cell's output channel (for the line's marker); dropped at [`HostCalls::end`].
    output: UnboundedSender<OutputRequest>,
}

#[derive(Default)]
struct State {
    cell: Option<CellCtx>,
    /// Number of the session's last call.
    seq: u64,
    /// The request being written by the guest.
    request: Vec<u8>,
    /// The guest wrote more than [`MAX_REQUEST`] bytes or out of order.
    bad_request: bool,
    /// The answer the guest reads (JSON object), until its next request.
    answer: Vec<u8>,
    /// The line of the call being made, until the output drainer queues it.
    line: Option<(u64, WorkerMessage)>,
    /// A call waits (from its line being made to its answer).
    waiting: bool,
    /// The waiting call's line is queued for the reply pipe.
    queued: bool,
    /// SIGINT reached the waiting call.
    interrupted: bool,
}

/// The host-call side of one worker (see the module docs).
pub struct HostCalls {
    state: Mutex<State>,
    /// Woken (written) when the line is queued or an interrupt arrives.
    wake: OwnedFd,
    requests: Mutex<BufReader<Requests>>,
}

/// How a wait ended.
enum Waited {
    Answer(Vec<u8>),
    Interrupted,
    Deadline,
    Eof,
}

fn answer_raise(kind: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({ "raise": kind, "error": message })).unwrap_or_default()
}

fn protocol_fail(why: &str) -> ! {
    eprintln!("sandcell-worker-python: {why}");
    std::process::exit(EXIT_MALFORMED);
}

impl HostCalls {
    /// The host-call side reading requests from `requests` (the worker's fd 3).
    ///
    /// Errors: the eventfd could not be created.
    pub fn new(requests: File) -> io::Result<Arc<Self>> {
        // SAFETY: eventfd with valid flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(Self {
            state: Mutex::new(State::default()),
            // SAFETY: eventfd just returned this descriptor; nothing else owns it.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            requests: Mutex::new(BufReader::new(Requests::new(requests))),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The request reader, for the worker's request loop (never held while a cell runs).
    pub fn requests(&self) -> MutexGuard<'_, BufReader<Requests>> {
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a local to our eventfd; a full counter only loses a
        // duplicate wake-up.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn drain_wake(&self) {
        let mut v: u64 = 0;
        // SAFETY: reading 8 bytes into a local from our non-blocking eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// Cell `cell` starts: its host calls are allowed when `enabled` (the request's
    /// `host_calls=1`), wait at most until `deadline`, and put their lines in `output`.
    pub fn begin(
        &self,
        cell: u64,
        nonce: Option<String>,
        enabled: bool,
        deadline: Instant,
        output: UnboundedSender<OutputRequest>,
    ) {
        let mut s = self.lock();
        s.cell = Some(CellCtx {
            cell,
            nonce,
            enabled,
            deadline,
            output,
        });
        s.request.clear();
        s.bad_request = false;
        s.answer.clear();
        s.line = None;
        s.waiting = false;
        s.queued = false;
        s.interrupted = false;
    }

    /// The guest call ended: drops the output sender (the output drainer waits for every
    /// sender to go) and forgets the cell's request and answer.
    pub fn end(&self) {
        let mut s = self.lock();
        s.cell = None;
        s.request = Vec::new();
        s.answer = Vec::new();
        s.line = None;
        s.waiting = false;
    }

    /// SIGINT during the cell: when a call waits, it takes the interrupt (its guest raises
    /// `KeyboardInterrupt`) and this returns true; otherwise false, and the caller stops the
    /// guest the usual way.
    pub fn interrupt(&self) -> bool {
        let mut s = self.lock();
        if !s.waiting {
            return false;
        }
        s.interrupted = true;
        drop(s);
        self.notify();
        true
    }

    /// The output drainer met the marker `data` on [`HOST_CALL_STREAM`]: the `host_call`
    /// line to write now, unless that call was given up.
    pub fn take_line(&self, data: &[u8]) -> Option<WorkerMessage> {
        let call = u64::from_le_bytes(data.try_into().ok()?);
        let mut s = self.lock();
        if s.line.as_ref().is_none_or(|(c, _)| *c != call) {
            return None;
        }
        let (_, msg) = s.line.take()?;
        s.queued = true;
        drop(s);
        self.notify();
        Some(msg)
    }

    /// The guest wrote `data` at `offset` of the host-call file: part of its next request.
    fn write_request(&self, offset: u64, data: &[u8]) {
        let mut s = self.lock();
        if offset == 0 {
            s.request.clear();
            s.bad_request = false;
            s.answer.clear();
        }
        if offset != s.request.len() as u64 || s.request.len() + data.len() > MAX_REQUEST {
            s.bad_request = true;
            return;
        }
        s.request.extend_from_slice(data);
    }

    /// The guest truncated or rewrote the file: a new, empty request.
    fn reset_request(&self) {
        let mut s = self.lock();
        s.request.clear();
        s.bad_request = false;
    }

    /// The guest reads `len` bytes at `offset`: the first read after a request makes the call
    /// (blocking until its answer); reads return slices of the answer.
    fn read_answer(&self, offset: u64, len: u64) -> Vec<u8> {
        let mut s = self.lock();
        if offset == 0 && (!s.request.is_empty() || s.bad_request) {
            let request = std::mem::take(&mut s.request);
            let bad = std::mem::take(&mut s.bad_request);
            drop(s);
            let answer = if bad {
                answer_raise(
                    "ValueError",
                    &format!(
                        "a host call's request is at most {MAX_REQUEST} bytes, written in order"
                    ),
                )
            } else {
                self.call(&request)
            };
            s = self.lock();
            s.answer = answer;
        }
        let start = (offset as usize).min(s.answer.len());
        let end = start.saturating_add(len as usize).min(s.answer.len());
        s.answer[start..end].to_vec()
    }

    /// Checks a request, sends its line, waits for its answer: the answer object for the
    /// guest (`{"result": ...}`, `{"error": ...}`, `{"raise": type, "error": ...}` or
    /// `{"interrupted": true}`).
    fn call(&self, request: &[u8]) -> Vec<u8> {
        #[derive(serde::Deserialize)]
        struct Req {
            name: serde_json::Value,
            #[serde(default)]
            arguments: serde_json::Value,
        }
        let Ok(req) = serde_json::from_slice::<Req>(request) else {
            return answer_raise("ValueError", "a host call's request is not JSON");
        };
        let name = match req.name {
            serde_json::Value::String(n) if valid_host_call_name(&n) => n,
            _ => {
                return answer_raise(
                    "ValueError",
                    &format!(
                        "a host call's name is 1 to {MAX_HOST_CALL_NAME} characters of [A-Za-z0-9_.-]"
                    ),
                );
            }
        };
        let arguments = match req.arguments {
            serde_json::Value::Null => json!({}),
            a @ serde_json::Value::Object(_) => a,
            _ => return answer_raise("TypeError", "a host call's arguments are a dict"),
        };
        let mut s = self.lock();
        let Some(ctx) = s.cell.as_ref().filter(|c| c.enabled) else {
            return answer_raise(
                "HostCallError",
                "host calls are not enabled for this session (open it with host_calls)",
            );
        };
        if s.waiting {
            return answer_raise(
                "HostCallError",
                "another host call of this cell waits for its answer",
            );
        }
        if serde_json::to_vec(&arguments).map_or(usize::MAX, |v| v.len()) > MAX_HOST_CALL_ARGUMENTS
        {
            return answer_raise(
                "ValueError",
                &format!(
                    "a host call's arguments are at most {MAX_HOST_CALL_ARGUMENTS} bytes of JSON"
                ),
            );
        }
        if Instant::now() >= ctx.deadline {
            // A call given up at the deadline may still be waiting at the daemon until it
            // ends the cell: a cell that catches the error and calls again must not write a
            // second line (the daemon allows one call in flight and ends the worker).
            return answer_raise(
                "HostCallError",
                "the cell's wall time ran out; no host call is made",
            );
        }
        let call = s.seq + 1;
        let msg = WorkerMessage::HostCall {
            cell: ctx.cell,
            nonce: ctx.nonce.clone(),
            call,
            name,
            arguments,
        };
        let deadline = ctx.deadline;
        let marker = OutputRequest {
            stream: HOST_CALL_STREAM,
            data: call.to_le_bytes().to_vec(),
        };
        if ctx.output.send(marker).is_err() {
            return answer_raise("HostCallError", "the cell's output channel is closed");
        }
        s.seq = call;
        s.line = Some((call, msg));
        s.waiting = true;
        s.queued = false;
        s.interrupted = false;
        drop(s);
        let waited = self.wait(call, deadline);
        let mut s = self.lock();
        s.waiting = false;
        s.line = None;
        drop(s);
        match waited {
            Waited::Answer(payload) => payload,
            Waited::Interrupted => br#"{"interrupted":true}"#.to_vec(),
            Waited::Deadline => answer_raise(
                "HostCallError",
                &format!("the cell's wall time ran out while host call {call} waited"),
            ),
            Waited::Eof => answer_raise(
                "HostCallError",
                "the request pipe closed while a host call waited",
            ),
        }
    }

    /// Waits for the line of `call` to be queued, then for its answer; gives up at the
    /// deadline or (once the line is queued) at an interrupt.
    fn wait(&self, call: u64, deadline: Instant) -> Waited {
        // The line first: an interrupt now is kept for the wait below.
        loop {
            let mut s = self.lock();
            if s.queued {
                break;
            }
            if Instant::now() >= deadline {
                // Never written: the call did not happen.
                s.line = None;
                s.seq = call - 1;
                return Waited::Deadline;
            }
            drop(s);
            self.poll(None, deadline);
            self.drain_wake();
        }
        let mut reader = self.requests();
        let mut buf = reader.buffer().to_vec();
        let n = buf.len();
        reader.consume(n);
        let put_back = |reader: &mut BufReader<Requests>, buf: Vec<u8>| {
            let inner = reader.get_mut();
            let mut rest = buf;
            rest.extend_from_slice(&inner.put_back);
            inner.put_back = rest;
        };
        loop {
            // Whole requests in `buf`: each must be a `host_reply`.
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                if nl > MAX_HEADER_LINE {
                    protocol_fail("request header too long while a host call waits");
                }
                let line = String::from_utf8_lossy(&buf[..nl]).into_owned();
                let header = RequestHeader::parse(&line).unwrap_or_else(|e| protocol_fail(&e));
                if header.op != Op::HostReply {
                    protocol_fail(&format!(
                        "unexpected request while a host call waits: {:?}",
                        header.op
                    ));
                }
                if header.len > MAX_PAYLOAD {
                    protocol_fail("host reply payload too large");
                }
                let end = nl + 1 + header.len as usize;
                if buf.len() < end {
                    break;
                }
                let payload = buf[nl + 1..end].to_vec();
                buf.drain(..end);
                if header.call == Some(call) {
                    if !buf.is_empty() {
                        protocol_fail("bytes after a host reply");
                    }
                    return Waited::Answer(payload);
                }
                // The answer to a call given up on: skipped.
            }
            if buf.len() > MAX_HEADER_LINE && !buf.contains(&b'\n') {
                protocol_fail("request header too long while a host call waits");
            }
            if self.lock().interrupted {
                put_back(&mut reader, buf);
                return Waited::Interrupted;
            }
            if Instant::now() >= deadline {
                put_back(&mut reader, buf);
                return Waited::Deadline;
            }
            let fd = reader.get_ref().file.as_raw_fd();
            if self.poll(Some(fd), deadline) {
                let mut chunk = vec![0u8; 64 * 1024];
                match reader.get_mut().file.read(&mut chunk) {
                    Ok(0) => return Waited::Eof,
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return Waited::Eof,
                }
            } else {
                self.drain_wake();
            }
        }
    }

    /// Waits until `fd` (if any) is readable, the eventfd is written, or `deadline`; returns
    /// whether `fd` is readable.
    fn poll(&self, fd: Option<i32>, deadline: Instant) -> bool {
        let mut p = [
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: fd.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // Round up so the wait does not spin just before the deadline.
        let ms = if ms == 0 && !left.is_zero() { 1 } else { ms };
        // SAFETY: two valid pollfds (a negative fd is ignored by poll).
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
        n > 0 && p[1].revents != 0
    }
}

/// The scratch storage with the host-call file in it (see the module docs): every path but
/// [`GUEST_HOST_FILE`] goes to `inner`.
#[derive(Clone)]
pub struct HostFile {
    inner: ArcStorage,
    host: Arc<HostCalls>,
}

impl HostFile {
    /// `inner` with the host-call file of `host`.
    pub fn new(inner: ArcStorage, host: Arc<HostCalls>) -> Self {
        Self { inner, host }
    }
}

/// Whether `path` names the host-call file (`.` components and repeated slashes allowed).
fn is_host_file(path: &str) -> bool {
    let mut parts = path.split('/').filter(|p| !p.is_empty() && *p != ".");
    let mut want = GUEST_HOST_FILE.split('/').filter(|p| !p.is_empty());
    loop {
        match (parts.next(), want.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

fn denied(path: &str) -> VfsError {
    VfsError::PermissionDenied(path.to_owned())
}

#[async_trait]
impl VfsStorage for HostFile {
    async fn read(&self, path: &str) -> VfsResult<Vec<u8>> {
        if is_host_file(path) {
            return Ok(self.host.read_answer(0, MAX_PAYLOAD));
        }
        self.inner.read(path).await
    }

    async fn read_at(&self, path: &str, offset: u64, len: u64) -> VfsResult<Vec<u8>> {
        if is_host_file(path) {
            return Ok(self.host.read_answer(offset, len));
        }
        self.inner.read_at(path, offset, len).await
    }

    async fn write(&self, path: &str, data: &[u8]) -> VfsResult<()> {
        if is_host_file(path) {
            self.host.reset_request();
            if !data.is_empty() {
                self.host.write_request(0, data);
            }
            return Ok(());
        }
        self.inner.write(path, data).await
    }

    async fn write_at(&self, path: &str, offset: u64, data: &[u8]) -> VfsResult<()> {
        if is_host_file(path) {
            self.host.write_request(offset, data);
            return Ok(());
        }
        self.inner.write_at(path, offset, data).await
    }

    async fn set_size(&self, path: &str, size: u64) -> VfsResult<()> {
        if is_host_file(path) {
            if size == 0 {
                self.host.reset_request();
            }
            return Ok(());
        }
        self.inner.set_size(path, size).await
    }

    async fn delete(&self, path: &str) -> VfsResult<()> {
        if is_host_file(path) {
            return Err(denied(path));
        }
        self.inner.delete(path).await
    }

    async fn exists(&self, path: &str) -> VfsResult<bool> {
        if is_host_file(path) {
            return Ok(true);
        }
        self.inner.exists(path).await
    }

    async fn list(&self, path: &str) -> VfsResult<Vec<DirEntry>> {
        self.inner.list(path).await
    }

    async fn stat(&self, path: &str) -> VfsResult<Metadata> {
        if is_host_file(path) {
            return Ok(Metadata {
                is_dir: false,
                size: 0,
                ..Metadata::default()
            });
        }
        self.inner.stat(path).await
    }

    async fn mkdir(&self, path: &str) -> VfsResult<()> {
        if is_host_file(path) {
            return Err(denied(path));
        }
        self.inner.mkdir(path).await
    }

    async fn rmdir(&self, path: &str) -> VfsResult<()> {
        if is_host_file(path) {
            return Err(denied(path));
        }
        self.inner.rmdir(path).await
    }

    async fn rename(&self, from: &str, to: &str) -> VfsResult<()> {
        if is_host_file(from) || is_host_file(to) {
            return Err(denied(to));
        }
        self.inner.rename(from, to).await
    }

    fn mkdir_sync(&self, path: &str) -> VfsResult<()> {
        if is_host_file(path) {
            return Err(denied(path));
        }
        self.inner.mkdir_sync(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: fds is a two-int array for pipe2 to fill.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: pipe2 returned two fresh descriptors owned by nobody else.
        unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
    }

    #[test]
    fn host_file_path_matches_only_itself() {
        assert!(is_host_file("/tmp/.sandcell-host"));
        assert!(is_host_file("//tmp/./.sandcell-host"));
        assert!(!is_host_file("/tmp/.sandcell-host/x"));
        assert!(!is_host_file("/tmp/../tmp/.sandcell-host"));
        assert!(!is_host_file("/tmp"));
    }

    /// Runs one call on a thread as the guest would (write, read), with the output channel's
    /// markers turned into lines by a drainer thread; returns the answer and the line.
    fn one_call(
        host: &Arc<HostCalls>,
        enabled: bool,
        deadline: Duration,
        request: &[u8],
        reply: impl FnOnce(Option<&WorkerMessage>) + Send + 'static,
    ) -> (serde_json::Value, Option<WorkerMessage>) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<OutputRequest>();
        host.begin(5, Some("ab".into()), enabled, Instant::now() + deadline, tx);
        let h = Arc::clone(host);
        let drainer = std::thread::spawn(move || {
            // The marker, or nothing when the call was refused (the channel closes at `end`).
            let line = rx.blocking_recv().and_then(|req| {
                assert_eq!(req.stream, HOST_CALL_STREAM);
                h.take_line(&req.data)
            });
            reply(line.as_ref());
            line
        });
        host.write_request(0, request);
        let mut answer = host.read_answer(0, 4);
        let mut more = host.read_answer(4, 1 << 20);
        answer.append(&mut more);
        assert!(host.read_answer(answer.len() as u64, 10).is_empty());
        host.end();
        let line = drainer.join().unwrap();
        (serde_json::from_slice(&answer).unwrap(), line)
    }

    #[test]
    fn a_call_writes_its_line_and_returns_the_reply() {
        let (r, mut w) = pipe();
        let host = HostCalls::new(r).unwrap();
        let (answer, line) = one_call(
            &host,
            true,
            Duration::from_secs(10),
            br#"{"name":"math.add","arguments":{"a":1}}"#,
            move |line| {
                use std::io::Write;
                assert!(line.is_some());
                // A stale answer to call 7 first, then this call's.
                let stale = b"{\"error\":\"old\"}";
                let ok = b"{\"result\":{\"sum\":3}}";
                writeln!(w, "host_reply 5 {} call=7", stale.len()).unwrap();
                w.write_all(stale).unwrap();
                writeln!(w, "host_reply 5 {} call=1", ok.len()).unwrap();
                w.write_all(ok).unwrap();
            },
        );
        assert_eq!(answer, json!({"result": {"sum": 3}}));
        let Some(WorkerMessage::HostCall {
            cell,
            nonce,
            call,
            name,
            arguments,
        }) = line
        else {
            panic!("{line:?}")
        };
        assert_eq!((cell, call, name.as_str()), (5, 1, "math.add"));
        assert_eq!(nonce.as_deref(), Some("ab"));
        assert_eq!(arguments, json!({"a": 1}));
    }

    #[test]
    fn refusals_raise_without_a_line() {
        let (r, _w) = pipe();
        let host = HostCalls::new(r).unwrap();
        let t = Duration::from_secs(10);
        let (a, line) = one_call(&host, false, t, br#"{"name":"x","arguments":{}}"#, |_| {});
        assert_eq!(a["raise"], "HostCallError", "{a}");
        assert!(line.is_none());
        let (a, _) = one_call(
            &host,
            true,
            t,
            br#"{"name":"bad name","arguments":{}}"#,
            |_| {},
        );
        assert_eq!(a["raise"], "ValueError", "{a}");
        let (a, _) = one_call(&host, true, t, br#"{"name":"x","arguments":[1]}"#, |_| {});
        assert_eq!(a["raise"], "TypeError", "{a}");
        let big = format!(
            r#"{{"name":"x","arguments":{{"v":"{}"}}}}"#,
            "x".repeat(MAX_HOST_CALL_ARGUMENTS)
        );
        let (a, line) = one_call(&host, true, t, big.as_bytes(), |_| {});
        assert_eq!(a["raise"], "ValueError", "{a}");
        assert!(line.is_none());
        assert_eq!(host.lock().seq, 0, "no call was numbered");
    }

    #[test]
    fn the_deadline_and_an_interrupt_end_the_wait() {
        let (r, _w) = pipe();
        let host = HostCalls::new(r).unwrap();
        let t0 = Instant::now();
        let (a, line) = one_call(
            &host,
            true,
            Duration::from_millis(200),
            br#"{"name":"x"}"#,
            |_| {},
        );
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert!(line.is_some());
        assert!(a["error"].as_str().unwrap().contains("wall time"), "{a}");
        let h = Arc::clone(&host);
        let (a, _) = one_call(
            &host,
            true,
            Duration::from_secs(30),
            br#"{"name":"x"}"#,
            move |_| {
                std::thread::sleep(Duration::from_millis(50));
                assert!(h.interrupt());
            },
        );
        assert_eq!(a, json!({"interrupted": true}));
        assert_eq!(host.lock().seq, 2);
        assert!(!host.interrupt(), "no call waits");
    }
}
