//! Async client for sandcelld's `org.sandcell.Kernel` Varlink interface.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandcell_client::Error> {
//! let mut c = sandcell_client::Client::connect(sandcell_client::default_socket()).await?;
//! let out = c.run_collect("python", "print(6 * 7)", None).await?;
//! assert_eq!(out.stdout, "42\n");
//! # Ok(()) }
//! ```
//!
//! Shapes: a cell streams [`Frame`]s — first `started` (session id and cell number, needed for
//! [`Client::interrupt`] from another connection), then `output` chunks in order, last
//! `result` ([`CellResult`]: status, error with traceback, usage in seconds and bytes, and per
//! stream the bytes seen and kept). Sizes are bytes, times seconds.
//!
//! Host calls: a session opened (or a run started) with `host_calls`
//! ([`Client::open_with`], [`Client::run_with`]) may call tools the client provides; each call
//! arrives as a `host_call` frame ([`HostCall`]) and is answered with [`Client::host_reply`]
//! from another connection of the same user (the cell's own connection streams its frames
//! until the result). [`Client::finish_with_host_calls`] does both with a handler.
//!
//! Errors: [`Error::Kernel`] carries the daemon's named errors (`CapacityExceeded`,
//! `LimitExceeded`, `NoSuchSession`, `SessionEnded` with an [`EndReason`] as text, ...;
//! [`KernelError::is_no_such_session`] covers both of the latter); [`Error::Connect`] and [`Error::Protocol`] mean the
//! socket could not be used.

pub mod human;
mod reattach;

pub use reattach::{CellTrack, Reattach};

/// A fresh cell token for [`Client::execute_with_token`] and [`Client::submit_with_token`]:
/// 32 lowercase hex digits of a random (version 4) UUID, so that no other call in the
/// session repeats it by chance.
pub fn cell_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

use sandcell_proto::kernel::{self as k, FrameReply};
pub use sandcell_proto::kernel::{
    CellResult, CellStatusReply, EndReason, EnvironmentLimits, FileInfo, FileKind, Frame, HostCall,
    InterruptReply, InterruptSessionReply, KernelError, Limits, OpenParams, OpenReply, Output,
    Retained, RetainedStats, RunParams, SessionSummary, State, Status, StreamStats, Usage,
};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use zlink::connection::socket::{Socket, WriteHalf as _};
use zlink::tokio::unix;

/// The socket to use: `$SANDCELL_SOCKET`, else `/run/sandcell/org.sandcell.Kernel`.
pub fn default_socket() -> PathBuf {
    std::env::var_os("SANDCELL_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| k::DEFAULT_SOCKET.into())
}

/// The `limit` of the `LimitExceeded` a call longer than the protocol's message bound
/// (`sandcell_proto::kernel::MAX_MESSAGE_BYTES`, 4 MiB of JSON) gets, refused before anything
/// is sent: the daemon would end the connection without an answer.
pub const MESSAGE_LIMIT: &str = "max_message_bytes";

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be reached. Displayed as one sentence naming the socket, the
    /// OS error and what to check.
    #[error("cannot reach sandcelld at {}: {}", path.display(), connect_cause(source))]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: zlink::Error,
    },
    /// The daemon refused the call with one of the interface's named errors. Displayed as
    /// one human sentence ([`human::describe`]); the error's name and parameters are in the
    /// value.
    #[error("{}", human::describe(.0))]
    Kernel(KernelError),
    /// Transport or protocol failure (including `org.varlink.service` errors). A connection
    /// the daemon closed mid-call ([`Error::is_call_cut`]) says that sandcelld restarted or
    /// crashed.
    #[error("the connection to sandcelld failed: {0}{note}", note = cut_note(.0))]
    Protocol(#[from] zlink::Error),
    /// The stream ended before a result ([`Error::is_call_cut`]).
    #[error("the daemon closed the cell's stream before its result{CUT_NOTE}")]
    Incomplete,
    /// A local file could not be read or written, or the daemon's data was not base64.
    #[error("{what}: {}", io_text(source))]
    File {
        /// What was done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl Error {
    /// True when the daemon closed the connection in the middle of the call (end of stream,
    /// `ECONNRESET` or `EPIPE`): sandcelld restarted (`systemctl restart`, a package upgrade,
    /// `SIGUSR2`) or crashed. Reconnect at once (new connections wait on the activation
    /// socket during a restart); a `Submit` cell or a detached session's cell goes on in the
    /// successor (follow it with `Attach`), an `Execute` cell of a session that is not
    /// detached is interrupted and its session kept.
    pub fn is_call_cut(&self) -> bool {
        match self {
            Error::Incomplete => true,
            Error::Protocol(e) => zlink_cut(e),
            _ => false,
        }
    }
}

impl Client {
    /// Whether sandcelld has closed this connection, found without waiting (a peek that reads
    /// end of stream or fails other than with `EAGAIN`). A connection kept idle across a
    /// restart of sandcelld is closed by it, and a call sent on it would be cut
    /// ([`Error::is_unsent`]). A connection with bytes waiting is not closed.
    pub fn is_closed(&self) -> bool {
        use std::os::fd::{AsFd, AsRawFd};
        let fd = self.write.as_fd().as_raw_fd();
        let mut b = [0u8; 1];
        // SAFETY: recv(2) writes at most one byte into `b`; MSG_PEEK leaves it unread and
        // MSG_DONTWAIT never blocks.
        let n = unsafe {
            libc::recv(
                fd,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

impl Error {
    /// Whether the call never reached sandcelld: writing it failed with `EPIPE` because the
    /// daemon had closed the connection first (a connection kept idle across a restart of
    /// sandcelld). Nothing acted on such a call, so it may be sent again on a new connection;
    /// a call cut after it was written (end of stream, `ECONNRESET`) may have been acted on.
    pub fn is_unsent(&self) -> bool {
        matches!(self, Error::Protocol(zlink::Error::Io(io)) if io.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

/// What [`Error`]'s text adds for a call the daemon cut by closing the connection.
const CUT_NOTE: &str = " (the call was cut: sandcelld restarted or crashed; reconnect, and follow a running cell with Attach)";

fn zlink_cut(e: &zlink::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
    match e {
        zlink::Error::UnexpectedEof => true,
        zlink::Error::Io(io) => matches!(io.kind(), UnexpectedEof | ConnectionReset | BrokenPipe),
        _ => false,
    }
}

fn cut_note(e: &zlink::Error) -> &'static str {
    if zlink_cut(e) { CUT_NOTE } else { "" }
}

/// An I/O error's text without Rust's ` (os error N)` suffix.
fn io_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    text.split(" (os error").next().unwrap_or(&text).to_owned()
}

/// The OS error of a failed connect, with what to check for the common ones.
fn connect_cause(e: &zlink::Error) -> String {
    let zlink::Error::Io(io) = e else {
        return e.to_string();
    };
    let hint = match io.kind() {
        std::io::ErrorKind::NotFound => {
            " (no socket there: is sandcelld installed and its socket unit enabled? \
             --socket or $SANDCELL_SOCKET names another socket)"
        }
        std::io::ErrorKind::ConnectionRefused => {
            " (nothing listens there: is sandcelld's socket unit running?)"
        }
        std::io::ErrorKind::PermissionDenied => {
            " (the socket's mode or group does not admit this user)"
        }
        _ => "",
    };
    format!("{}{hint}", io_text(io))
}

/// The JSON parameters of a call, from its typed parameter struct (`sandcell_proto::kernel`).
fn params<T: Serialize>(p: &T) -> Value {
    serde_json::to_value(p).expect("parameter structs serialise")
}

/// A connection to sandcelld.
#[derive(Debug)]
pub struct Client {
    /// Replies are read through zlink's reader.
    read: zlink::connection::ReadConnection<<unix::Stream as Socket>::ReadHalf>,
    /// Calls are encoded here with `serde_json` and written whole: zlink's writer grows its
    /// buffer 256 bytes at a time and encodes the message again at each step, so a 1 MiB
    /// call cost seconds of CPU and a 3 MiB one 22 s.
    write: <unix::Stream as Socket>::WriteHalf,
    /// The socket it was connected to: a re-attach ([`Client::next_frame_following`])
    /// connects to it again.
    socket: PathBuf,
}

/// Everything a finished cell produced, collected.
#[derive(Debug, Clone)]
pub struct Collected {
    /// Session id.
    pub session: String,
    /// Cell number.
    pub cell: u64,
    /// Kept stdout text.
    pub stdout: String,
    /// Kept stderr text.
    pub stderr: String,
    /// The cell's display bundles in order (sessions and runs with `rich_output` only).
    pub displays: Vec<k::Display>,
    /// The result.
    pub result: CellResult,
}

/// The frames of one cell gathered as they arrive: the session and cell of its `started`
/// frame and the text of each stream, until the frame with the result.
#[derive(Default)]
struct Collector {
    session: String,
    cell: u64,
    stdout: String,
    stderr: String,
    displays: Vec<k::Display>,
}

impl Collector {
    /// Takes `f`'s started, output and result parts (passing an output chunk to
    /// `on_output`); returns the collection once `f` carries the result. Other parts (a host
    /// call) stay in `f`.
    fn take(&mut self, f: &mut Frame, on_output: &mut impl FnMut(&Output)) -> Option<Collected> {
        if let Some(s) = f.started.take() {
            self.session = s.session;
            self.cell = s.cell;
        }
        if let Some(o) = f.output.take() {
            on_output(&o);
            match o.stream {
                k::Stream::Stdout => self.stdout.push_str(&o.text),
                k::Stream::Stderr => self.stderr.push_str(&o.text),
            }
        }
        if let Some(d) = f.display.take() {
            self.displays.push(d);
        }
        let result = f.result.take()?;
        Some(Collected {
            session: std::mem::take(&mut self.session),
            cell: self.cell,
            stdout: std::mem::take(&mut self.stdout),
            stderr: std::mem::take(&mut self.stderr),
            displays: std::mem::take(&mut self.displays),
            result,
        })
    }
}

impl Error {
    /// The error as one JSON object (what `sandcellctl --json` prints): a daemon's refusal as
    /// the daemon sent it, `{"error": "org.sandcell.Kernel.<Name>", "parameters": {...}}`,
    /// other errors as `{"error": "sandcell.client.<Kind>"}` (`CallCut` for a call the daemon
    /// cut by closing the connection, [`Error::is_call_cut`]); both with `"message"`, the
    /// human sentence of [`Error`]'s `Display`.
    pub fn to_json(&self) -> Value {
        let mut v = match self {
            _ if self.is_call_cut() => serde_json::json!({"error": "sandcell.client.CallCut"}),
            Error::Kernel(k) => serde_json::to_value(k).unwrap_or(Value::Null),
            Error::Connect { path, .. } => serde_json::json!({
                "error": "sandcell.client.ConnectionFailed",
                "parameters": {"socket": path.display().to_string()},
            }),
            Error::Protocol(_) => serde_json::json!({"error": "sandcell.client.ProtocolError"}),
            Error::Incomplete => serde_json::json!({"error": "sandcell.client.Incomplete"}),
            Error::File { .. } => serde_json::json!({"error": "sandcell.client.FileError"}),
        };
        if let Value::Object(m) = &mut v {
            m.insert("message".into(), Value::String(self.to_string()));
        }
        v
    }
}

impl Client {
    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Client, Error> {
        let path = path.as_ref();
        let conn = unix::connect(path).await.map_err(|source| Error::Connect {
            path: path.to_owned(),
            source,
        })?;
        let (read, write) = conn.split();
        Ok(Client {
            read,
            write: write.into_write_half(),
            socket: path.to_owned(),
        })
    }

    async fn call<R: serde::de::DeserializeOwned + std::fmt::Debug>(
        &mut self,
        method: &str,
        parameters: Value,
    ) -> Result<R, Error> {
        self.call_with_fds(method, parameters, vec![]).await
    }

    async fn call_with_fds<R: serde::de::DeserializeOwned + std::fmt::Debug>(
        &mut self,
        method: &str,
        parameters: Value,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<R, Error> {
        self.send(method, parameters, false, &fds).await?;
        let (reply, _fds) = self.read.receive_reply::<R, KernelError>().await?;
        match reply {
            Ok(r) => r.into_parameters().ok_or(Error::Incomplete),
            Err(e) => Err(Error::Kernel(e)),
        }
    }

    async fn start_cell(&mut self, method: &str, parameters: Value) -> Result<(), Error> {
        self.send(method, parameters, true, &[]).await
    }

    /// Writes one call of `org.sandcell.Kernel.<method>`, NUL-terminated, with `fds` passed
    /// along with its first byte.
    async fn send(
        &mut self,
        method: &str,
        parameters: Value,
        more: bool,
        fds: &[std::os::fd::OwnedFd],
    ) -> Result<(), Error> {
        let mut call = serde_json::json!({
            "method": format!("{}.{method}", k::INTERFACE),
            "parameters": parameters,
        });
        if more {
            call["more"] = Value::Bool(true);
        }
        let mut buf = serde_json::to_vec(&call).expect("a JSON value serialises");
        // The daemon ends a connection whose message passes the protocol's bound before it
        // can answer, which would read as a restart: refused here, before anything is sent,
        // as the Python client does.
        if buf.len() > k::MAX_MESSAGE_BYTES {
            return Err(Error::Kernel(KernelError::LimitExceeded {
                limit: MESSAGE_LIMIT.into(),
                value: buf.len() as u64,
                max: k::MAX_MESSAGE_BYTES as u64,
            }));
        }
        buf.push(0);
        self.write.write(&buf, fds, None).await?;
        Ok(())
    }

    /// Reads the next frame of the running cell; `None` after the result.
    pub async fn next_frame(&mut self) -> Result<Frame, Error> {
        let (reply, _fds) = self.read.receive_reply::<FrameReply, KernelError>().await?;
        match reply {
            Ok(r) => r
                .into_parameters()
                .map(|p| p.frame)
                .ok_or(Error::Incomplete),
            Err(e) => Err(Error::Kernel(e)),
        }
    }

    /// Starts a one-shot cell in a fresh sandbox; read it with [`Client::next_frame`] until a
    /// frame has `result`.
    pub async fn run(
        &mut self,
        language: &str,
        code: &str,
        limits: Option<&Limits>,
    ) -> Result<(), Error> {
        self.run_in(language, None, code, limits).await
    }

    /// [`Client::run`] in the named `environment` (`None`: the language's default).
    /// Errors besides `run`'s: `NoSuchEnvironment`, `EnvironmentMismatch`.
    pub async fn run_in(
        &mut self,
        language: &str,
        environment: Option<&str>,
        code: &str,
        limits: Option<&Limits>,
    ) -> Result<(), Error> {
        self.run_with(&k::RunParams {
            language: language.into(),
            code: code.into(),
            limits: limits.cloned(),
            environment: environment.map(str::to_owned),
            host_calls: None,
            display_last_expression: None,
            rich_output: None,
            egress: None,
        })
        .await
    }

    /// Starts a one-shot cell with every parameter of `Run` (e.g. `host_calls`); read it with
    /// [`Client::next_frame`] or [`Client::finish_with_host_calls`].
    pub async fn run_with(&mut self, p: &RunParams) -> Result<(), Error> {
        self.start_cell("Run", params(p)).await
    }

    /// [`Client::run_in`], then [`Client::finish`].
    pub async fn run_collect_in(
        &mut self,
        language: &str,
        environment: Option<&str>,
        code: &str,
        limits: Option<&Limits>,
    ) -> Result<Collected, Error> {
        self.run_in(language, environment, code, limits).await?;
        self.finish(|_| {}).await
    }

    /// The environments the daemon serves (`ListEnvironments`), in name order.
    pub async fn list_environments(&mut self) -> Result<Vec<k::Environment>, Error> {
        let r: k::ListEnvironmentsReply = self
            .call("ListEnvironments", params(&k::ListEnvironmentsParams {}))
            .await?;
        Ok(r.environments)
    }

    /// Starts a cell in an open session; read it with [`Client::next_frame`].
    pub async fn execute(&mut self, session: &str, code: &str) -> Result<(), Error> {
        self.execute_with_token(session, code, None).await
    }

    /// [`Client::execute`] with a cell token (1 to 64 characters of `[A-Za-z0-9._-]`): on a
    /// detached session, repeating the call with the same token after a cut (a daemon
    /// restart before the started frame arrived) follows the cell the first call started,
    /// if it did, instead of running the code twice.
    pub async fn execute_with_token(
        &mut self,
        session: &str,
        code: &str,
        token: Option<&str>,
    ) -> Result<(), Error> {
        let p = k::ExecuteParams {
            session: session.into(),
            code: code.into(),
            token: token.map(Into::into),
        };
        self.start_cell("Execute", params(&p)).await
    }

    /// Starts a cell in `session` that runs on without this client (`Submit`) and returns
    /// its number; follow it with [`Client::attach`] or ask [`Client::cell_status`].
    /// Errors: as `execute`, and `CapacityExceeded` (`retained_output_bytes`).
    pub async fn submit(&mut self, session: &str, code: &str) -> Result<u64, Error> {
        self.submit_with_token(session, code, None).await
    }

    /// [`Client::submit`] with a cell token: a repeat with the same token answers the number
    /// of the cell the first call started instead of starting another.
    pub async fn submit_with_token(
        &mut self,
        session: &str,
        code: &str,
        token: Option<&str>,
    ) -> Result<u64, Error> {
        let p = k::SubmitParams {
            session: session.into(),
            code: code.into(),
            token: token.map(Into::into),
        };
        let r: k::SubmitReply = self.call("Submit", params(&p)).await?;
        Ok(r.cell)
    }

    /// Follows `cell` of `session` (`Attach`): read it with [`Client::next_frame`] or
    /// [`Client::finish`] (retained output first, then live output and the result).
    /// Errors (when reading): `NoSuchCell`, `AttachmentReplaced`.
    pub async fn attach(&mut self, session: &str, cell: u64) -> Result<(), Error> {
        let p = k::CellParams {
            session: session.into(),
            cell,
        };
        self.start_cell("Attach", params(&p)).await
    }

    /// The state of `cell` of `session` without waiting (`CellStatus`): `running`, a result
    /// status, or `lost`, and the retained result once it ended. Errors: `NoSuchCell`.
    pub async fn cell_status(
        &mut self,
        session: &str,
        cell: u64,
    ) -> Result<CellStatusReply, Error> {
        let p = k::CellParams {
            session: session.into(),
            cell,
        };
        self.call("CellStatus", params(&p)).await
    }

    /// Reads frames until the result, calling `on_output` for each output chunk.
    pub async fn finish(&mut self, mut on_output: impl FnMut(&Output)) -> Result<Collected, Error> {
        let mut c = Collector::default();
        loop {
            let mut f = self.next_frame().await?;
            if let Some(done) = c.take(&mut f, &mut on_output) {
                return Ok(done);
            }
        }
    }

    /// Runs `code` one-shot and collects its output.
    pub async fn run_collect(
        &mut self,
        language: &str,
        code: &str,
        limits: Option<&Limits>,
    ) -> Result<Collected, Error> {
        self.run(language, code, limits).await?;
        self.finish(|_| {}).await
    }

    /// Runs a cell in `session` and collects its output.
    pub async fn execute_collect(&mut self, session: &str, code: &str) -> Result<Collected, Error> {
        self.execute(session, code).await?;
        self.finish(|_| {}).await
    }

    /// Opens a persistent session. With `detached_idle_seconds`, it outlives this connection.
    pub async fn open(
        &mut self,
        language: &str,
        limits: Option<&Limits>,
        detached_idle_seconds: Option<u64>,
    ) -> Result<OpenReply, Error> {
        self.open_in(language, None, limits, detached_idle_seconds)
            .await
    }

    /// [`Client::open`] in the named `environment` (`None`: the language's default).
    /// Errors besides `open`'s: `NoSuchEnvironment`, `EnvironmentMismatch`.
    pub async fn open_in(
        &mut self,
        language: &str,
        environment: Option<&str>,
        limits: Option<&Limits>,
        detached_idle_seconds: Option<u64>,
    ) -> Result<OpenReply, Error> {
        self.open_with(&k::OpenParams {
            language: language.into(),
            limits: limits.cloned(),
            detached_idle_seconds,
            environment: environment.map(str::to_owned),
            host_calls: None,
            display_last_expression: None,
            rich_output: None,
            egress: None,
        })
        .await
    }

    /// Opens a session with every parameter of `Open` (e.g. `host_calls`).
    pub async fn open_with(&mut self, p: &OpenParams) -> Result<OpenReply, Error> {
        self.call("Open", params(p)).await
    }

    /// Answers host call `call` of `session`: `Ok(object)` is returned to the cell (a JSON
    /// object of at most [`k::MAX_HOST_CALL_RESULT`] bytes), `Err(message)` raised in it (at
    /// most [`k::MAX_HOST_CALL_ERROR`] bytes). From any connection of the session's owner but
    /// the one streaming the cell.
    /// Errors: `NoSuchHostCall` (the call does not wait: answered, timed out, its cell ended,
    /// or never made), `LimitExceeded`, `InvalidParameter` (a result that is not an object),
    /// `NoSuchSession`.
    pub async fn host_reply(
        &mut self,
        session: &str,
        call: u64,
        answer: Result<Value, String>,
    ) -> Result<(), Error> {
        let (result, error) = match answer {
            Ok(v) => (Some(v), None),
            Err(e) => (None, Some(e)),
        };
        let p = k::HostReplyParams {
            session: session.into(),
            call,
            result,
            error,
        };
        let _: Value = self.call("HostReply", params(&p)).await?;
        Ok(())
    }

    /// [`Client::finish`] for a cell that may call tools: each `host_call` frame goes to
    /// `handler` (given the session id and the call), whose answer is sent with
    /// [`Client::host_reply`] over `replies`, a second connection of the same user. A
    /// `NoSuchHostCall` refusal (the call timed out or the cell was interrupted meanwhile) is
    /// not an error here: the cell's result tells what happened.
    pub async fn finish_with_host_calls(
        &mut self,
        replies: &mut Client,
        mut on_output: impl FnMut(&Output),
        mut handler: impl FnMut(&str, &HostCall) -> Result<Value, String>,
    ) -> Result<Collected, Error> {
        let mut c = Collector::default();
        loop {
            let mut f = self.next_frame().await?;
            if let Some(done) = c.take(&mut f, &mut on_output) {
                return Ok(done);
            }
            if let Some(h) = f.host_call {
                let answer = handler(&c.session, &h);
                match replies.host_reply(&c.session, h.call, answer).await {
                    Ok(()) | Err(Error::Kernel(KernelError::NoSuchHostCall { .. })) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Interrupts `cell` of `session` (from any connection of the same user).
    pub async fn interrupt(&mut self, session: &str, cell: u64) -> Result<InterruptReply, Error> {
        let p = k::InterruptParams {
            session: session.into(),
            cell,
        };
        self.call("Interrupt", params(&p)).await
    }

    /// Interrupts whatever cell `session` runs now, without knowing its number (from any
    /// connection of the same user); the reply names the cell that was running.
    /// Errors: `NoSuchSession`, `PermissionDenied`.
    pub async fn interrupt_session(
        &mut self,
        session: &str,
    ) -> Result<k::InterruptSessionReply, Error> {
        let p = k::InterruptSessionParams {
            session: session.into(),
        };
        self.call("InterruptSession", params(&p)).await
    }

    /// The caller's own sessions (its uid's, from any connection), oldest first, and whether
    /// more exist than the daemon lists (1000).
    pub async fn list_sessions(&mut self) -> Result<(Vec<k::SessionSummary>, bool), Error> {
        let r: k::ListSessionsReply = self
            .call("ListSessions", params(&k::ListSessionsParams {}))
            .await?;
        Ok((r.sessions, r.truncated))
    }

    /// Lists the user's variables of `session` (name, type, approximate size, shape, short
    /// repr), at most `max_items` (1 to [`k::INSPECT_MAX_ITEMS`]; default
    /// [`k::INSPECT_DEFAULT_ITEMS`]); returns them and whether more exist. Not a cell: cell
    /// numbers and history stay as they were.
    /// Errors: `SessionBusy` (a cell runs), `LimitExceeded` (`max_items`), `NoSuchSession`,
    /// `WorkerFailed` (the worker did not answer in time or broke the protocol; the session
    /// ended).
    pub async fn inspect(
        &mut self,
        session: &str,
        max_items: Option<u64>,
    ) -> Result<(Vec<k::Variable>, bool), Error> {
        let p = k::InspectParams {
            session: session.into(),
            max_items,
        };
        let r: k::InspectReply = self.call("Inspect", params(&p)).await?;
        Ok((r.variables, r.truncated))
    }

    /// Completion at `cursor` (characters; `None`: the end) of `code` in `session`: the
    /// matches, each replacing `code[cursor_start..cursor_end]` (characters), at most
    /// [`sandcell_proto::query::COMPLETE_MAX_MATCHES`] (`truncated` says more exist). Not a
    /// cell. Errors: `SessionBusy` (a cell runs), `LimitExceeded` (`max_source_bytes`),
    /// `InvalidParameter` (`cursor` past the end), `NoSuchSession`, `WorkerFailed` (the
    /// worker did not answer in time or broke the protocol; the session ended).
    pub async fn complete(
        &mut self,
        session: &str,
        code: &str,
        cursor: Option<u64>,
    ) -> Result<sandcell_proto::query::CompleteReply, Error> {
        let p = sandcell_proto::query::CompleteParams {
            session: session.into(),
            code: code.into(),
            cursor,
        };
        self.call("Complete", params(&p)).await
    }

    /// Help for the name at `cursor` (characters; `None`: the end) of `code` in `session`, or
    /// for the call the cursor is in: whether one was found and a MIME bundle (`text/plain`),
    /// with `detail` 1 also the source. Not a cell. Errors: as [`Client::complete`], and
    /// `InvalidParameter` (`detail` above 1).
    pub async fn help(
        &mut self,
        session: &str,
        code: &str,
        cursor: Option<u64>,
        detail: Option<u64>,
    ) -> Result<sandcell_proto::query::HelpReply, Error> {
        let p = sandcell_proto::query::HelpParams {
            session: session.into(),
            code: code.into(),
            cursor,
            detail,
        };
        self.call("Help", params(&p)).await
    }

    /// Ends `session`; returns after its worker is gone.
    pub async fn close(&mut self, session: &str) -> Result<(), Error> {
        let p = k::CloseParams {
            session: session.into(),
        };
        let _: Value = self.call("Close", params(&p)).await?;
        Ok(())
    }

    /// Stores `data` as `name` (a relative path) in `session`'s directory, inline: at most
    /// [`k::MAX_INLINE_BYTES`] (2 MiB); use [`Client::put_file`] for files on disk.
    /// Errors: `InvalidFileName`, `LimitExceeded` (`max_file_bytes`,
    /// `max_session_files_bytes`, `inline_bytes`), `SessionBusy`, `NotRegularFile`.
    pub async fn put_bytes(
        &mut self,
        session: &str,
        name: &str,
        data: &[u8],
    ) -> Result<FileInfo, Error> {
        let p = params(&k::PutFileParams {
            session: session.into(),
            name: name.into(),
            size: data.len() as u64,
            data: Some(k::encode_base64(data)),
            fd: None,
        });
        let r: k::PutFileReply = self.call("PutFile", p).await?;
        Ok(r.file)
    }

    /// Stores the regular file `file` as `name`, passing its descriptor (the daemon reads
    /// it; its size is declared from `fstat`). Errors as [`Client::put_bytes`], and
    /// [`Error::File`] when `file` cannot be inspected.
    pub async fn put_fd(
        &mut self,
        session: &str,
        name: &str,
        file: std::fs::File,
    ) -> Result<FileInfo, Error> {
        let size = file
            .metadata()
            .map_err(|source| Error::File {
                what: "stat".into(),
                source,
            })?
            .len();
        self.put_fd_declared(session, name, file.into(), size).await
    }

    /// As [`Client::put_fd`] with an explicit declared `size` (the daemon checks it against
    /// the limits first, then against the descriptor's `fstat`).
    pub async fn put_fd_declared(
        &mut self,
        session: &str,
        name: &str,
        fd: std::os::fd::OwnedFd,
        size: u64,
    ) -> Result<FileInfo, Error> {
        let p = params(&k::PutFileParams {
            session: session.into(),
            name: name.into(),
            size,
            data: None,
            fd: Some(0),
        });
        let r: k::PutFileReply = self.call_with_fds("PutFile", p, vec![fd]).await?;
        Ok(r.file)
    }

    /// Uploads the local regular file at `path` as `name` (by descriptor).
    ///
    /// Errors: `Error::File` when `path` cannot be opened or is not a regular file (it is
    /// opened non-blocking, so a FIFO is refused instead of waiting for a writer).
    pub async fn put_file(
        &mut self,
        session: &str,
        name: &str,
        path: impl AsRef<Path>,
    ) -> Result<FileInfo, Error> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.as_ref();
        let what = || format!("open {}", path.display());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|source| Error::File {
                what: what(),
                source,
            })?;
        let meta = f.metadata().map_err(|source| Error::File {
            what: what(),
            source,
        })?;
        if !meta.is_file() {
            return Err(Error::File {
                what: what(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
            });
        }
        self.put_fd(session, name, f).await
    }

    /// Lists `session`'s directory (lstat: symlinks and special files are reported as such);
    /// returns the entries and whether the daemon cut the listing at its bound.
    pub async fn list_files(&mut self, session: &str) -> Result<(Vec<FileInfo>, bool), Error> {
        let r: k::ListFilesReply = self
            .call(
                "ListFiles",
                params(&k::ListFilesParams {
                    session: session.into(),
                }),
            )
            .await?;
        Ok((r.files, r.truncated))
    }

    /// Reads one chunk of `name`: at most `max_bytes` (default and ceiling 1 MiB) from
    /// `offset`. Returns the file's description, the bytes, and whether they reach its end.
    pub async fn get_file_chunk(
        &mut self,
        session: &str,
        name: &str,
        offset: u64,
        max_bytes: Option<u64>,
    ) -> Result<(FileInfo, Vec<u8>, bool), Error> {
        let p = k::GetFileParams {
            session: session.into(),
            name: name.into(),
            offset: Some(offset),
            max_bytes,
        };
        let r: k::GetFileReply = self.call("GetFile", params(&p)).await?;
        let bytes = k::decode_base64(&r.data).map_err(|e| Error::File {
            what: "decoding GetFile data".into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        Ok((r.file, bytes, r.eof))
    }

    /// Reads the whole regular file `name`, chunk by chunk, into `out`; returns its
    /// description and the bytes written. Errors: `NoSuchFile`, `NotRegularFile` (symlinks,
    /// directories, FIFOs are refused), `InvalidFileName`; [`Error::File`] when `out` fails.
    pub async fn get_file(
        &mut self,
        session: &str,
        name: &str,
        mut out: impl std::io::Write,
    ) -> Result<(FileInfo, u64), Error> {
        let mut offset = 0u64;
        loop {
            let (info, bytes, eof) = self.get_file_chunk(session, name, offset, None).await?;
            out.write_all(&bytes).map_err(|source| Error::File {
                what: "write".into(),
                source,
            })?;
            offset += bytes.len() as u64;
            // A file that shrank meanwhile returns nothing: stop rather than loop.
            if eof || bytes.is_empty() {
                return Ok((info, offset));
            }
        }
    }

    /// Removes `name` (a file, a symlink itself, or an empty directory) from `session`.
    pub async fn delete_file(&mut self, session: &str, name: &str) -> Result<(), Error> {
        let _: Value = self
            .call(
                "DeleteFile",
                params(&k::DeleteFileParams {
                    session: session.into(),
                    name: name.into(),
                }),
            )
            .await?;
        Ok(())
    }
}
