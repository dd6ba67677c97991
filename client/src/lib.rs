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
//! Errors: [`Error::Kernel`] carries the daemon's named errors (`CapacityExceeded`,
//! `LimitExceeded`, `NoSuchSession`, ...); [`Error::Connect`] and [`Error::Protocol`] mean the
//! socket could not be used.

pub use sandcell_proto::kernel::{
    CellResult, Frame, InterruptReply, KernelError, Limits, OpenReply, Output, State, Status, StreamStats, Usage,
};
use sandcell_proto::kernel::{self as k, FrameReply};
use serde::Serialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use zlink::tokio::unix;
use zlink::{Call, Connection};

/// The socket to use: `$SANDCELL_SOCKET`, else `/run/sandcell/org.sandcell.Kernel`.
pub fn default_socket() -> PathBuf {
    std::env::var_os("SANDCELL_SOCKET").map(PathBuf::from).unwrap_or_else(|| k::DEFAULT_SOCKET.into())
}

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be reached.
    #[error("connecting to {path}: {source}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: zlink::Error,
    },
    /// The daemon refused the call with one of the interface's named errors.
    #[error("{0}")]
    Kernel(KernelError),
    /// Transport or protocol failure (including `org.varlink.service` errors).
    #[error("varlink: {0}")]
    Protocol(#[from] zlink::Error),
    /// The stream ended before a result.
    #[error("the daemon closed the cell's stream before its result")]
    Incomplete,
}

/// A connection to sandcelld.
#[derive(Debug)]
pub struct Client {
    conn: Connection<unix::Stream>,
}

#[derive(Debug, Serialize)]
struct MethodCall<'a> {
    method: &'a str,
    parameters: Value,
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
    /// The result.
    pub result: CellResult,
}

impl Client {
    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Client, Error> {
        let path = path.as_ref();
        let conn = unix::connect(path).await.map_err(|source| Error::Connect { path: path.to_owned(), source })?;
        Ok(Client { conn })
    }

    async fn call<R: serde::de::DeserializeOwned + std::fmt::Debug>(&mut self, method: &str, parameters: Value) -> Result<R, Error> {
        let m = MethodCall { method: &format!("{}.{method}", k::INTERFACE), parameters };
        self.conn.send_call(&Call::new(&m), vec![]).await?;
        let (reply, _fds) = self.conn.receive_reply::<R, KernelError>().await?;
        match reply {
            Ok(r) => r.into_parameters().ok_or(Error::Incomplete),
            Err(e) => Err(Error::Kernel(e)),
        }
    }

    async fn start_cell(&mut self, method: &str, parameters: Value) -> Result<(), Error> {
        let m = MethodCall { method: &format!("{}.{method}", k::INTERFACE), parameters };
        self.conn.send_call(&Call::new(&m).set_more(true), vec![]).await?;
        Ok(())
    }

    /// Reads the next frame of the running cell; `None` after the result.
    pub async fn next_frame(&mut self) -> Result<Frame, Error> {
        let (reply, _fds) = self.conn.receive_reply::<FrameReply, KernelError>().await?;
        match reply {
            Ok(r) => r.into_parameters().map(|p| p.frame).ok_or(Error::Incomplete),
            Err(e) => Err(Error::Kernel(e)),
        }
    }

    /// Starts a one-shot cell in a fresh sandbox; read it with [`Client::next_frame`] until a
    /// frame has `result`.
    pub async fn run(&mut self, language: &str, code: &str, limits: Option<&Limits>) -> Result<(), Error> {
        let mut p = json!({ "language": language, "code": code });
        if let Some(l) = limits {
            p["limits"] = serde_json::to_value(l).expect("limits serialise");
        }
        self.start_cell("Run", p).await
    }

    /// Starts a cell in an open session; read it with [`Client::next_frame`].
    pub async fn execute(&mut self, session: &str, code: &str) -> Result<(), Error> {
        self.start_cell("Execute", json!({ "session": session, "code": code })).await
    }

    /// Reads frames until the result, calling `on_output` for each output chunk.
    pub async fn finish(&mut self, mut on_output: impl FnMut(&Output)) -> Result<Collected, Error> {
        let (mut session, mut cell, mut stdout, mut stderr) = (String::new(), 0, String::new(), String::new());
        loop {
            let f = self.next_frame().await?;
            if let Some(s) = f.started {
                session = s.session;
                cell = s.cell;
            }
            if let Some(o) = f.output {
                on_output(&o);
                match o.stream {
                    k::Stream::Stdout => stdout.push_str(&o.text),
                    k::Stream::Stderr => stderr.push_str(&o.text),
                }
            }
            if let Some(result) = f.result {
                return Ok(Collected { session, cell, stdout, stderr, result });
            }
        }
    }

    /// Runs `code` one-shot and collects its output.
    pub async fn run_collect(&mut self, language: &str, code: &str, limits: Option<&Limits>) -> Result<Collected, Error> {
        self.run(language, code, limits).await?;
        self.finish(|_| {}).await
    }

    /// Runs a cell in `session` and collects its output.
    pub async fn execute_collect(&mut self, session: &str, code: &str) -> Result<Collected, Error> {
        self.execute(session, code).await?;
        self.finish(|_| {}).await
    }

    /// Opens a persistent session. With `detached_idle_seconds`, it outlives this connection.
    pub async fn open(&mut self, language: &str, limits: Option<&Limits>, detached_idle_seconds: Option<u64>) -> Result<OpenReply, Error> {
        let mut p = json!({ "language": language });
        if let Some(l) = limits {
            p["limits"] = serde_json::to_value(l).expect("limits serialise");
        }
        if let Some(d) = detached_idle_seconds {
            p["detached_idle_seconds"] = json!(d);
        }
        self.call("Open", p).await
    }

    /// Interrupts `cell` of `session` (from any connection of the same user).
    pub async fn interrupt(&mut self, session: &str, cell: u64) -> Result<InterruptReply, Error> {
        self.call("Interrupt", json!({ "session": session, "cell": cell })).await
    }

    /// Ends `session`; returns after its worker is gone.
    pub async fn close(&mut self, session: &str) -> Result<(), Error> {
        let _: Value = self.call("Close", json!({ "session": session })).await?;
        Ok(())
    }
}
