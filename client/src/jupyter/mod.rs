//! `sandcellctl kernel`: a Jupyter kernel (messaging protocol 5.3,
//! <https://jupyter-client.readthedocs.io/en/stable/messaging.html>) mapped onto one sandcell
//! session, started by Jupyter from a kernelspec as
//! `sandcellctl kernel -f {connection_file} --kernel sandcell-pydata`.
//!
//! Sockets (bound on the connection file's ports; `tcp` only): shell and control ROUTER,
//! iopub PUB, stdin ROUTER (bound, never asked: cells have no stdin), heartbeat REP (echo).
//! Every message is HMAC-SHA256 signed with the file's key; one with a bad signature, a
//! signature seen before (a replayed message), too many frames or too many bytes
//! ([`wire`]'s bounds: a signed message over them is not answered either, since it is not
//! read far enough to be verified) is dropped and logged on standard error, never answered.
//! A signed message with a valid header whose content is unusable (not JSON, not an object,
//! a field of the wrong type, a `cursor_pos` beyond the code) is answered with its
//! `<type>_reply` of status `error` (`ename` `InvalidRequest`, `evalue` naming the
//! problem), so its client does not wait forever. Every request is framed by `status`
//! `busy` and `idle` on iopub.
//!
//! Start: the sockets are bound and `kernel_info_request` answered at once; the session is
//! opened concurrently (`Open` with rich output) and awaited by the first request that
//! needs it. An `Open` refusal is logged and reported as the first `execute_request`'s
//! error; the next cell tries again.
//!
//! Requests:
//! - `execute_request`: one `Execute`; `output` frames become `stream`, display frames
//!   `display_data` or (the last expression's value) `execute_result`; an error becomes an
//!   `error` message and reply with the traceback's lines; `execute_input` and the
//!   `execution_count` as ipykernel does: only a cell with `store_history` (and not `silent`)
//!   advances it; the others report the last stored cell's count. After the cell's output,
//!   a `stderr` stream says what the result reports was cut (`sandcell: stdout truncated:
//!   kept 65536 of 1000001 bytes`, the same for stderr and display bundles) and gives its
//!   warnings and hints (`sandcell: warning: ...`, `sandcell: hint: pandas is not installed
//!   in this environment; environment 'pydata' has it ...` for a missing module another
//!   environment has), before the error. A cell that ended the session (worker crashed,
//!   `oom`, `exited`) says so in its error; the next cell opens a new session and says why
//!   on stderr first. Tracebacks name the session's own cell numbers (`<cell N>`, as the
//!   daemon numbers cells): they count every cell the session ran, silent ones included,
//!   and start from 1 in a new session, so they can differ from `execution_count` (the
//!   new-session note says so). `user_expressions` are not evaluated (evaluating them would run code
//!   beside the cell, outside its accounting and the history): each key is answered with an
//!   error entry (`ename` `NotImplementedError`). IPython magics and shell escapes (`%timeit`,
//!   `!ls`) are not supported: the cell is plain Python and they are a `SyntaxError`.
//! - `interrupt_request` (control; `interrupt_mode: message`): `InterruptSession` from a
//!   second connection; the variables stay.
//! - `shutdown_request`: the session is closed (`Close`: a session a restarted sandcelld
//!   adopted no longer ends with the kernel's connection), the request is replied on its
//!   channel and iopub, then the kernel exits. jupyter_client restarts a kernel by starting a
//!   new process, so a restart is a new session.
//! - `complete_request`, `inspect_request`: the session's `Complete` and `Help`; without a
//!   session, the language's keywords and common names and the names the kernel's history
//!   assigns (no help).
//! - `is_complete_request`: decided locally ([`complete`]).
//! - `history_request`: the kernel's own history (`tail`, `range`, `search` with a glob
//!   pattern and `unique`) of the last 10 000 cells and at most 16 MiB: each cell's code and
//!   its result's text are cut at 64 KiB (on a character boundary), and the oldest cells go
//!   first. A reply carries at most 4 MiB of code and output text (the newest entries that
//!   fit).
//! - `comm_info_request`: no comms; `comm_open`: answered with `comm_close` (comms and
//!   widgets are not supported); `comm_msg`, `comm_close`: ignored.
//! - `input()`: a cell's stdin is `/dev/null`, so Python's `input()` raises `EOFError`;
//!   the error's value says why.

pub mod complete;
pub mod wire;

use bytes::Bytes;
use sandcell_client::{Client, Error as ClientError, KernelError, Status};
use sandcell_proto::kernel::{DisplayKind, Stream};
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use wire::{ConnectionInfo, Message, Signer};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The kernels: Jupyter kernel name -> (sandcell language, environment or `None` for the
/// language's default, display name, Jupyter language).
pub const KERNELS: [(&str, &str, Option<&str>, &str, &str); 3] = [
    (
        "sandcell-python",
        "python",
        None,
        "Python (sandcell)",
        "python",
    ),
    (
        "sandcell-pydata",
        "python",
        Some("pydata"),
        "Python (sandcell pydata)",
        "python",
    ),
    ("sandcell-r", "r", None, "R (sandcell)", "R"),
];

/// Why the kernel could not start.
#[derive(Debug, thiserror::Error)]
pub enum KernelFailure {
    /// The connection file could not be read or parsed.
    #[error("connection file {path}: {why}")]
    ConnectionFile {
        /// Its path.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
    /// `--kernel` names no kernel of [`KERNELS`].
    #[error("unknown kernel {0:?} (sandcell-python, sandcell-pydata or sandcell-r)")]
    UnknownKernel(String),
    /// A socket could not be bound.
    #[error("cannot bind {endpoint}: {why}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        why: String,
    },
}

macro_rules! log {
    ($($t:tt)*) => { eprintln!("sandcell kernel: {}", format!($($t)*)) };
}

/// How long a heartbeat echo may take, seconds: a bound only, since the REP socket never
/// waits for a pinger to read (an echo its socket cannot take is finished in the background,
/// and the next echo for that pinger is dropped until it is).
const HB_SEND_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The largest heartbeat ping echoed, bytes (jupyter_client pings with 4 bytes, `ping`):
/// a larger one is skipped, so that no pinger can park large echoes in the kernel.
const MAX_PING_BYTES: usize = 64 << 10;

/// How long iopub messages are held for the first subscriber (see `serve`).
const IOPUB_HOLD: std::time::Duration = std::time::Duration::from_secs(2);

/// Cells the kernel's history keeps (the oldest go first), for `history_request`.
const MAX_HISTORY: usize = 10_000;
/// Bytes of a result's `text/plain` the history keeps.
const MAX_HISTORY_OUTPUT: usize = 64 << 10;
/// Bytes of a cell's code the history keeps.
const MAX_HISTORY_CODE: usize = 64 << 10;
/// Bytes of code and result text the whole history keeps (the oldest cells go first).
const MAX_HISTORY_BYTES: usize = 16 << 20;
/// Bytes of code and result text one `history_reply` carries (the newest entries that fit).
const MAX_HISTORY_REPLY_BYTES: usize = 4 << 20;
/// How long a cell's missing-module hint may wait for `ListEnvironments`.
const HINT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// What the request handlers share: signing, the iopub queue, the language and the id of
/// the current sandcell session (for interrupts from the control channel).
#[derive(Clone)]
struct Shared {
    signer: Signer,
    /// This kernel's Jupyter session id (headers' `session`).
    session: String,
    iopub: mpsc::Sender<(String, Value, Value)>,
    language: &'static str,
    environment: Option<&'static str>,
    /// The sandcell session id once open.
    sandcell: Arc<Mutex<Option<String>>>,
    /// The interpreter version from `ListEnvironments` (`Some("")` when unknown).
    version: watch::Receiver<Option<String>>,
    socket: PathBuf,
    shutdown: mpsc::Sender<()>,
}

impl Shared {
    async fn publish(&self, msg_type: &str, content: Value, parent: &Value) {
        let _ = self
            .iopub
            .send((msg_type.to_owned(), content, parent.clone()))
            .await;
    }

    /// Ends the handling of `req` on a ROUTER channel (shell or control): sends `reply` (a
    /// message type and its content; a `shutdown_reply` is also published on iopub), then the
    /// `idle` status, and after a `shutdown_request` tells the kernel to stop.
    async fn answer(
        &self,
        socket: &mut zeromq::RouterSocket,
        req: &Message,
        reply: Option<(&str, Value)>,
        parent: &Value,
    ) {
        let mut stop = false;
        if let Some((t, content)) = reply {
            let _ = socket.send(self.frames(req, t, &content)).await;
            if t == "shutdown_reply" && content["status"] == "ok" {
                stop = true;
                self.publish(t, content, parent).await;
            }
        }
        self.publish("status", json!({"execution_state": "idle"}), parent)
            .await;
        if stop {
            let _ = self.shutdown.send(()).await;
        }
    }

    fn frames(&self, req: &Message, msg_type: &str, content: &Value) -> ZmqMessage {
        let frames = wire::frames(
            &self.signer,
            &req.identities,
            &wire::header(msg_type, &self.session),
            &Value::Object(req.header.clone()),
            content,
        );
        ZmqMessage::try_from(frames).expect("a message has frames")
    }

    async fn kernel_info(&self) -> Value {
        let mut rx = self.version.clone();
        let version = tokio::time::timeout(std::time::Duration::from_millis(500), async {
            rx.wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|v| v.clone())
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
        let language_info = if self.language == "r" {
            json!({"name": "R", "version": version, "mimetype": "text/x-r-source",
                   "file_extension": ".r", "pygments_lexer": "r", "codemirror_mode": "r"})
        } else {
            json!({"name": "python", "version": version, "mimetype": "text/x-python",
                   "file_extension": ".py", "pygments_lexer": "ipython3",
                   "codemirror_mode": {"name": "ipython", "version": 3},
                   "nbconvert_exporter": "python"})
        };
        json!({
            "status": "ok",
            "protocol_version": wire::PROTOCOL_VERSION,
            "implementation": "sandcell",
            "implementation_version": env!("CARGO_PKG_VERSION"),
            "language_info": language_info,
            "banner": "sandcell: cells run confined (Landlock, seccomp, cgroups) by sandcelld",
            "help_links": [{"text": "sandcell", "url": "https://github.com/sandcell/sandcell"}],
            "debugger": false,
        })
    }
}

/// Binds `endpoint` on `s`.
async fn bind<S: Socket>(s: &mut S, endpoint: String) -> Result<(), KernelFailure> {
    s.bind(&endpoint)
        .await
        .map(|_| ())
        .map_err(|e| KernelFailure::Bind {
            endpoint,
            why: e.to_string(),
        })
}

/// Runs kernel `kernel` (a name of [`KERNELS`]) on the sockets of `connection_file`, with
/// sandcelld at `socket`, until a `shutdown_request`. Errors: [`KernelFailure`] before the
/// sockets are bound; afterwards failures are logged and answered, never fatal.
pub async fn serve(
    socket: PathBuf,
    connection_file: &Path,
    kernel: &str,
) -> Result<(), KernelFailure> {
    let (_, language, environment, _, _) = KERNELS
        .iter()
        .find(|k| k.0 == kernel)
        .copied()
        .ok_or_else(|| KernelFailure::UnknownKernel(kernel.to_owned()))?;
    raise_descriptor_limit();
    let cf = |why: String| KernelFailure::ConnectionFile {
        path: connection_file.to_owned(),
        why,
    };
    let text = std::fs::read(connection_file).map_err(|e| cf(e.to_string()))?;
    let info: ConnectionInfo = serde_json::from_slice(&text).map_err(|e| cf(e.to_string()))?;
    match info.transport.as_str() {
        "tcp" => {}
        "ipc" => {
            // The sockets are files: only the kernel's own user may connect to them
            // (connecting to a Unix socket needs write permission on it, unix(7)), so no
            // other local user can read iopub or send requests, whatever the directory.
            // SAFETY: umask(2) cannot fail; the kernel creates no file another user needs.
            unsafe { libc::umask(0o077) };
        }
        other => {
            return Err(cf(format!(
                "transport {other:?} is not supported (tcp or ipc)"
            )));
        }
    }
    let signer = Signer::new(&info.key, &info.signature_scheme).map_err(cf)?;

    // The session and the language version, concurrently with binding.
    let (version_tx, version_rx) = watch::channel(None);
    {
        let socket = socket.clone();
        tokio::spawn(async move {
            let v = interpreter_version(&socket, language, environment).await;
            let _ = version_tx.send(Some(v));
        });
    }
    let opening = open(socket.clone(), language, environment);

    let mut shell = zeromq::RouterSocket::new();
    let mut control = zeromq::RouterSocket::new();
    let mut stdin = zeromq::RouterSocket::new();
    let mut iopub = zeromq::XPubSocket::new();
    let mut hb = zeromq::RepSocket::new();
    bind(&mut shell, info.endpoint(info.shell_port)).await?;
    bind(&mut control, info.endpoint(info.control_port)).await?;
    bind(&mut stdin, info.endpoint(info.stdin_port)).await?;
    bind(&mut iopub, info.endpoint(info.iopub_port)).await?;
    bind(&mut hb, info.endpoint(info.hb_port)).await?;

    let (iopub_tx, mut iopub_rx) = mpsc::channel::<(String, Value, Value)>(256);
    let (shutdown_tx, mut shutdown_rx) = mpsc::channel(1);
    let shared = Shared {
        signer: signer.clone(),
        session: uuid::Uuid::new_v4().to_string(),
        iopub: iopub_tx,
        language,
        environment,
        sandcell: Arc::new(Mutex::new(None)),
        version: version_rx,
        socket,
        shutdown: shutdown_tx,
    };
    let topic_session = shared.session.clone();
    let iopub_task = tokio::spawn(async move {
        // Messages published before the first subscription would be lost (a PUB socket
        // drops what no subscriber wants), and jupyter_client's wait_for_ready waits 0.2 s
        // for a status on iopub after each kernel_info_reply: the first messages are held
        // until a client subscribes (XPUB shows subscriptions), at most IOPUB_HOLD.
        let mut held: std::collections::VecDeque<ZmqMessage> = Default::default();
        let mut subscribed = false;
        let deadline = tokio::time::sleep(IOPUB_HOLD);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                m = iopub_rx.recv() => {
                    let Some((msg_type, content, parent)) = m else { break };
                    let topic = Bytes::from(format!("kernel.{topic_session}.{msg_type}"));
                    let frames = wire::frames(
                        &signer,
                        &[topic],
                        &wire::header(&msg_type, &topic_session),
                        &parent,
                        &content,
                    );
                    let m = ZmqMessage::try_from(frames).expect("frames");
                    if subscribed {
                        if let Err(e) = iopub.send(m).await {
                            log!("iopub: {e}");
                        }
                    } else if held.len() < 1024 {
                        held.push_back(m);
                    }
                }
                r = iopub.recv() => {
                    // A subscription (first byte 1) or unsubscription (0): XPUB's own
                    // bookkeeping is done in recv.
                    if let Ok(m) = r
                        && m.get(0).is_some_and(|f| f.first() == Some(&1))
                        && !subscribed
                    {
                        subscribed = true;
                        for m in held.drain(..) {
                            let _ = iopub.send(m).await;
                        }
                    }
                }
                () = &mut deadline, if !subscribed => {
                    subscribed = true;
                    held.clear();
                }
            }
        }
    });
    // Anyone who can connect may ping (heartbeats are not signed): a malformed ping is
    // skipped, and a pinger that does not read its echoes gets no more of them while one
    // waits for it, without delaying the others (the REP socket's send never waits). The
    // heartbeat runs on a thread of its own: the REP socket's disconnect handling takes a
    // blocking lock on its peer table, which, under a flood of unread pings from several
    // connections, blocked the kernel's one thread for good (shell, control and iopub with it).
    let _ = std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let (mut errors, mut last_logged) = (0u64, None);
                loop {
                    match hb.recv().await {
                        Ok(m) => {
                            let bytes: usize = m.iter().map(Bytes::len).sum();
                            if bytes > MAX_PING_BYTES {
                                // Not echoed: an echo waits in the socket's write buffer for
                                // a pinger that need not read it.
                                log!("heartbeat: a ping of {bytes} bytes skipped (over {MAX_PING_BYTES})");
                                drop_message(m, bytes);
                                continue;
                            }
                            let _ = tokio::time::timeout(HB_SEND_WAIT, hb.send(m)).await;
                        }
                        Err(zeromq::ZmqError::NoMessage) => break,
                        Err(e) => {
                            // At most one line a second, and a pause after each error: an
                            // error repeated without end (a runtime shutting down) never
                            // spins the thread or floods the log.
                            errors += 1;
                            if last_logged.is_none_or(|t: std::time::Instant| {
                                t.elapsed() >= std::time::Duration::from_secs(1)
                            }) {
                                log!("heartbeat: {e} ({errors} errors so far)");
                                last_logged = Some(std::time::Instant::now());
                            }
                            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        }
                    }
                }
            });
        });
    tokio::spawn(async move {
        // Cells never ask for input; what arrives here is read and dropped.
        while let Ok(m) = stdin.recv().await {
            let bytes: usize = m.iter().map(Bytes::len).sum();
            drop_message(m, bytes);
        }
    });
    let control_task = tokio::spawn(serve_control(control, shared.clone()));
    let shell_task = tokio::spawn(serve_shell(shell, shared.clone(), opening));
    drop(shared);
    tokio::select! {
        _ = shutdown_rx.recv() => {}
        () = parent_gone() => {
            // As ipykernel's parent poller: a kernel whose launcher died (a notebook server
            // or script killed) exits, and its session ends with its connection.
            log!("the process that started the kernel is gone: exiting");
        }
    }
    // Let the replies and iopub messages already queued go out.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    shell_task.abort();
    control_task.abort();
    iopub_task.abort();
    Ok(())
}

/// Returns once this process's parent is no longer the one it started with (it died and
/// the process was reparented), checked every second; never when it started under PID 1.
async fn parent_gone() {
    // SAFETY: getppid(2) cannot fail.
    let first = unsafe { libc::getppid() };
    if first == 1 {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        // SAFETY: as above.
        if unsafe { libc::getppid() } != first {
            return;
        }
    }
}

/// The interpreter version of the environment (`3.11.2`, `4.2.2`), or `""`.
async fn interpreter_version(socket: &Path, language: &str, environment: Option<&str>) -> String {
    let Ok(mut c) = Client::connect(socket).await else {
        return String::new();
    };
    let Ok(envs) = c.list_environments().await else {
        return String::new();
    };
    envs.iter()
        .find(|e| {
            e.language == language
                && match environment {
                    None => e.default,
                    Some(n) => e.name == n,
                }
        })
        .and_then(|e| {
            // "CPython 3.11.2", "CPython 3.14.0 (Eryx)", "R 4.2.2".
            e.interpreter_version
                .split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .find(|w| w.contains('.') && w.starts_with(|c: char| c.is_ascii_digit()))
                .map(|w| w.trim_end_matches('.').to_owned())
        })
        .unwrap_or_default()
}

type Opening = JoinHandle<Result<(Client, String), ClientError>>;

/// Opens a session (rich output) on a new connection, in the background.
fn open(socket: PathBuf, language: &'static str, environment: Option<&'static str>) -> Opening {
    tokio::spawn(async move {
        let mut c = Client::connect(&socket).await?;
        let r = c
            .open_with(&sandcell_client::OpenParams {
                language: language.into(),
                limits: None,
                detached_idle_seconds: None,
                environment: environment.map(str::to_owned),
                host_calls: None,
                display_last_expression: None,
                rich_output: Some(true),
                egress: None,
            })
            .await?;
        Ok((c, r.session))
    })
}

/// The session a request uses.
enum Slot {
    /// Being opened.
    Opening(Opening),
    /// Open: its connection and id.
    Ready(Client, String),
    /// None: the last one ended (why) or could not be opened; the next cell opens one.
    Gone(Option<String>),
}

/// A message of at least this many bytes returns the heap's free memory to the kernel
/// once handled (see [`release_memory`]).
const RELEASE_AFTER_BYTES: usize = 1 << 20;

/// Returns the allocator's free memory to the operating system (glibc's `malloc_trim(3)`):
/// after a message of many megabytes, glibc's per-thread arenas would otherwise keep the
/// freed pages, and the kernel's resident memory would stay at its largest message's
/// copies. Elsewhere a no-op.
fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory; it touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Drops a message (its frames) of `bytes` bytes, releasing memory after a large one.
fn drop_message<T>(message: T, bytes: usize) {
    drop(message);
    if bytes >= RELEASE_AFTER_BYTES {
        release_memory();
    }
}

/// Receives one message from a ROUTER, verified; `None` when the socket failed.
async fn receive(s: &mut zeromq::RouterSocket, shared: &Shared, channel: &str) -> Option<Message> {
    loop {
        let m = match s.recv().await {
            Ok(m) => m,
            Err(e) => {
                log!("{channel}: {e}");
                return None;
            }
        };
        let frames = m.into_vec();
        let bytes: usize = frames.iter().map(Bytes::len).sum();
        match wire::parse(&frames, &shared.signer) {
            Ok(msg)
                if msg.header.get("session").and_then(Value::as_str) == Some(&shared.session) =>
            {
                // One of this kernel's own messages sent back (anyone may read iopub over
                // tcp): answering it would publish a new status pair that is sent back in
                // turn, a loop without end.
                if let Some(more) = log_drop_now() {
                    log!(
                        "{channel}: dropped a message this kernel sent ({more} more dropped unlogged)"
                    );
                }
            }
            Ok(msg) if !is_request(msg.msg_type()) => {
                if let Some(more) = log_drop_now() {
                    log!(
                        "{channel}: dropped a {:?} message, not a request ({more} more dropped unlogged)",
                        msg.msg_type().chars().take(64).collect::<String>()
                    );
                }
            }
            Ok(msg) => return Some(msg),
            Err(e) => {
                if let Some(more) = log_drop_now() {
                    if more > 0 {
                        log!("{channel}: dropped a message: {e} ({more} more dropped unlogged)");
                    } else {
                        log!("{channel}: dropped a message: {e}");
                    }
                }
                drop_message(frames, bytes);
            }
        }
    }
}

/// The lines of a worker's traceback text (none without one), as an `error` message's
/// `traceback` carries them.
fn traceback_lines(t: Option<&str>) -> Vec<String> {
    t.map(|t| {
        t.trim_end_matches('\n')
            .split('\n')
            .map(str::to_owned)
            .collect()
    })
    .unwrap_or_default()
}

/// A new connection to sandcelld's socket after a restart cut the old one: attempts as
/// [`sandcell_client::Reattach::default`] (13, 0.01 s doubling to 4 s, about 21 s in all).
async fn reconnect(socket: &Path) -> Result<Client, ClientError> {
    let policy = sandcell_client::Reattach::default();
    let mut delay = policy.first_delay;
    let mut last = None;
    for _ in 0..policy.attempts {
        match Client::connect(socket).await {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(policy.max_delay);
    }
    Err(last.expect("at least one attempt"))
}

/// Whether `msg_type` is one a client sends to shell or control: a `*_request`, or a comm
/// message (answered as unsupported). Replies, status and stream messages are the kernel's own
/// kinds: never answered (no status pair is published for them).
fn is_request(msg_type: &str) -> bool {
    msg_type.ends_with("_request") || matches!(msg_type, "comm_open" | "comm_msg" | "comm_close")
}

/// Whether a dropped message may be logged now: at most one line a second over shell and
/// control together (anyone who can connect may send unsigned messages: a million of them
/// wrote a line each, 57 MB into the notebook server's log). `Some(n)`: log, `n` drops since
/// the last line went unlogged; `None`: count this one and stay quiet.
fn log_drop_now() -> Option<u64> {
    use std::sync::Mutex;
    static LAST: Mutex<(Option<std::time::Instant>, u64)> = Mutex::new((None, 0));
    let mut g = LAST.lock().unwrap_or_else(|p| p.into_inner());
    match g.0 {
        Some(t) if t.elapsed() < std::time::Duration::from_secs(1) => {
            g.1 += 1;
            None
        }
        _ => {
            g.0 = Some(std::time::Instant::now());
            Some(std::mem::take(&mut g.1))
        }
    }
}

/// Raises the soft limit on open descriptors to the hard one (getrlimit(2)): a login's soft
/// limit is often 1024, which connections that never finish their handshake can fill for the
/// 10 s each may hold one, and no client could then connect.
fn raise_descriptor_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Ends the kernel's session with `Close` (at most [`CLOSE_TIMEOUT`]), on `interrupter` or a
/// new connection. The session would also end with the kernel's connection, but not one that
/// a successor of sandcelld adopted after a restart: its connection went with the old daemon,
/// and it would wait out `max_detached_idle_seconds`.
async fn close_session(shared: &Shared, interrupter: &mut Option<Client>) {
    let Some(id) = shared.sandcell.lock().expect("lock").clone() else {
        return;
    };
    let done = tokio::time::timeout(CLOSE_TIMEOUT, async {
        if interrupter.is_none() {
            *interrupter = Client::connect(&shared.socket).await.ok();
        }
        let c = interrupter.as_mut()?;
        let mut r = c.close(&id).await;
        if r.as_ref().is_err_and(|e| e.is_call_cut())
            && let Ok(n) = Client::connect(&shared.socket).await
        {
            *c = n;
            r = c.close(&id).await;
        }
        Some(r)
    })
    .await;
    match done {
        Ok(Some(Ok(_))) => {}
        Ok(Some(Err(e))) if matches!(&e, ClientError::Kernel(k) if k.is_no_such_session()) => {}
        Ok(Some(Err(e))) => log!("shutdown: closing session {id}: {e}"),
        Ok(None) => log!("shutdown: cannot reach sandcelld to close session {id}"),
        Err(_) => log!("shutdown: closing session {id} took over {CLOSE_TIMEOUT:?}"),
    }
}

/// Longest wait for the `Close` of a shutdown.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

async fn serve_control(mut control: zeromq::RouterSocket, shared: Shared) {
    // Connected at once, while descriptors are free: the connection an interrupt needs is not
    // made while the kernel may be short of them.
    let mut interrupter: Option<Client> = Client::connect(&shared.socket).await.ok();
    while let Some(req) = receive(&mut control, &shared, "control").await {
        let parent = Value::Object(req.header.clone());
        shared
            .publish("status", json!({"execution_state": "busy"}), &parent)
            .await;
        if let Some((t, content)) = invalid_reply(&req, None) {
            shared
                .answer(&mut control, &req, Some((&t, content)), &parent)
                .await;
            continue;
        }
        let reply = match req.msg_type() {
            "kernel_info_request" => Some(("kernel_info_reply", shared.kernel_info().await)),
            "interrupt_request" => {
                let id = shared.sandcell.lock().expect("lock").clone();
                let mut failed = None;
                if let Some(id) = id {
                    if interrupter.is_none() {
                        match Client::connect(&shared.socket).await {
                            Ok(c) => interrupter = Some(c),
                            Err(e) => failed = Some(format!("cannot reach sandcelld: {e}")),
                        }
                    }
                    if let Some(c) = interrupter.as_mut() {
                        let mut done = c.interrupt_session(&id).await.map(|_| ());
                        // A connection cut by a restart of sandcelld: once more on a new one.
                        if let Err(e) = &done
                            && e.is_call_cut()
                            && let Ok(n) = Client::connect(&shared.socket).await
                        {
                            *c = n;
                            done = c.interrupt_session(&id).await.map(|_| ());
                        }
                        if let Err(e) = done {
                            if matches!(e, ClientError::Protocol(_)) || e.is_call_cut() {
                                interrupter = None;
                            }
                            failed = Some(e.to_string());
                        }
                    }
                }
                match failed {
                    // The frontend shows an error reply; an ok that did nothing looks as if the
                    // interrupt were ignored.
                    Some(why) => {
                        log!("interrupt: {why}");
                        Some((
                            "interrupt_reply",
                            json!({"status": "error", "ename": "InterruptFailed",
                                   "evalue": why, "traceback": []}),
                        ))
                    }
                    None => Some(("interrupt_reply", json!({"status": "ok"}))),
                }
            }
            "shutdown_request" => {
                let restart = req.content.get("restart").cloned().unwrap_or(json!(false));
                close_session(&shared, &mut interrupter).await;
                Some((
                    "shutdown_reply",
                    json!({"status": "ok", "restart": restart}),
                ))
            }
            other => {
                if let Some(more) = log_drop_now() {
                    log!(
                        "control: unsupported message type {other:?} ({more} more dropped unlogged)"
                    );
                }
                None
            }
        };
        shared.answer(&mut control, &req, reply, &parent).await;
    }
}

/// The shell channel's state: the session, the execution count and the history.
struct Shell {
    shared: Shared,
    slot: Slot,
    count: u64,
    history: History,
    /// When the last cell started: a connection quiet for longer than [`QUIET_CHECK`] is
    /// checked before the next cell is sent on it.
    last_cell: std::time::Instant,
}

/// How long the session's connection may be quiet before a cell checks it first.
const QUIET_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// The kernel's history: `(execution_count, code)` of the stored cells and their results'
/// text, within [`MAX_HISTORY`] cells and [`MAX_HISTORY_BYTES`] (each code and text cut at
/// [`MAX_HISTORY_CODE`] and [`MAX_HISTORY_OUTPUT`] bytes on a character boundary).
#[derive(Default)]
struct History {
    cells: std::collections::VecDeque<(u64, String)>,
    outputs: std::collections::HashMap<u64, String>,
    /// Bytes of code and output text held.
    bytes: usize,
}

/// The first at most `max` bytes of `t`, cut on a character boundary.
fn cut(t: &str, max: usize) -> &str {
    if t.len() <= max {
        return t;
    }
    let mut end = max;
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    &t[..end]
}

impl History {
    /// The `history_reply` content for request content `c` (`tail`, `range`, `search`).
    fn reply(&self, c: &Map<String, Value>) -> Value {
        let output = flag(c, "output", false);
        let n = c.get("n").and_then(Value::as_u64);
        let mut items: Vec<&(u64, String)> = self.cells.iter().collect();
        match c.get("hist_access_type").and_then(Value::as_str) {
            Some("tail") => {
                if let Some(n) = n {
                    items = items.split_off(items.len().saturating_sub(n as usize));
                }
            }
            Some("range") => {
                let lo = c.get("start").and_then(Value::as_u64).unwrap_or(0);
                let hi = c.get("stop").and_then(Value::as_u64).filter(|h| *h > 0);
                items.retain(|(l, _)| *l >= lo && hi.is_none_or(|h| *l < h));
            }
            Some("search") => {
                let pattern: Vec<char> = c
                    .get("pattern")
                    .and_then(Value::as_str)
                    .unwrap_or("*")
                    .chars()
                    .collect();
                let mut budget = SEARCH_BUDGET;
                let mut kept = Vec::new();
                for item in items {
                    match glob(&pattern, &item.1, &mut budget) {
                        Some(true) => kept.push(item),
                        Some(false) => {}
                        None => {
                            return json!({"status": "error", "ename": "LimitExceeded",
                                "evalue": format!("the history search stopped after \
                                    {SEARCH_BUDGET} steps: the pattern is too costly for \
                                    this history"),
                                "traceback": []});
                        }
                    }
                }
                items = kept;
                if flag(c, "unique", false) {
                    let mut seen = std::collections::HashSet::new();
                    let mut kept: Vec<_> = items
                        .into_iter()
                        .rev()
                        .filter(|(_, code)| seen.insert(code.clone()))
                        .collect();
                    kept.reverse();
                    items = kept;
                }
                if let Some(n) = n {
                    items = items.split_off(items.len().saturating_sub(n as usize));
                }
            }
            _ => items.clear(),
        }
        // The newest entries that fit the reply's budget.
        let mut budget = MAX_HISTORY_REPLY_BYTES;
        let mut history: Vec<Value> = Vec::new();
        for (line, code) in items.into_iter().rev() {
            let out = if output { self.outputs.get(line) } else { None };
            let size = code.len() + out.map_or(0, String::len);
            if size > budget {
                break;
            }
            budget -= size;
            history.push(if output {
                json!([0, line, [code, out]])
            } else {
                json!([0, line, code])
            });
        }
        history.reverse();
        json!({"status": "ok", "history": history})
    }

    fn push(&mut self, count: u64, code: &str) {
        let code = cut(code, MAX_HISTORY_CODE).to_owned();
        self.bytes += code.len();
        self.cells.push_back((count, code));
        self.trim();
    }

    fn set_output(&mut self, count: u64, text: String) {
        if !self.cells.iter().any(|(c, _)| *c == count) {
            return;
        }
        let text = cut(&text, MAX_HISTORY_OUTPUT).to_owned();
        self.bytes += text.len();
        if let Some(old) = self.outputs.insert(count, text) {
            self.bytes -= old.len();
        }
        self.trim();
    }

    /// Drops the oldest cells while over [`MAX_HISTORY`] cells or [`MAX_HISTORY_BYTES`].
    fn trim(&mut self) {
        while self.cells.len() > MAX_HISTORY
            || (self.bytes > MAX_HISTORY_BYTES && self.cells.len() > 1)
        {
            let Some((old, code)) = self.cells.pop_front() else {
                break;
            };
            self.bytes -= code.len();
            if let Some(t) = self.outputs.remove(&old) {
                self.bytes -= t.len();
            }
        }
    }
}

async fn serve_shell(mut shell: zeromq::RouterSocket, shared: Shared, opening: Opening) {
    let mut k = Shell {
        shared: shared.clone(),
        slot: Slot::Opening(opening),
        count: 0,
        history: History::default(),
        last_cell: std::time::Instant::now(),
    };
    while let Some(req) = receive(&mut shell, &shared, "shell").await {
        let parent = Value::Object(req.header.clone());
        shared
            .publish("status", json!({"execution_state": "busy"}), &parent)
            .await;
        if let Some((t, content)) = invalid_reply(&req, Some(k.count)) {
            shared
                .answer(&mut shell, &req, Some((&t, content)), &parent)
                .await;
            continue;
        }
        let reply = k.handle(&req, &parent).await;
        // The queue to abort is taken before the error is answered: a request the client
        // sends after it has seen the error reply is never in it, however late this task runs.
        let queued = if stops_on_error(&req, reply.as_ref()) {
            take_queued(&mut shell, &shared).await
        } else {
            Vec::new()
        };
        shared.answer(&mut shell, &req, reply, &parent).await;
        if req.bytes >= RELEASE_AFTER_BYTES {
            drop(req);
            release_memory();
        }
        abort_queued(&mut shell, &mut k, queued).await;
    }
}

/// At most this many requests are taken as queued behind a cell that stopped on its error;
/// what is still readable after them is served as usual.
const MAX_ABORTED: usize = 4096;

/// Whether `reply` ends an `execute_request` in error that asks to stop there
/// (`stop_on_error`, true unless it says false, as the messaging protocol defines it; a
/// silent cell never stops the queue).
fn stops_on_error(req: &Message, reply: Option<&(&'static str, Value)>) -> bool {
    req.msg_type() == "execute_request"
        && flag(&req.content, "stop_on_error", true)
        && !flag(&req.content, "silent", false)
        && reply.is_some_and(|(_, r)| r["status"] == "error")
}

/// The requests already readable on the shell socket, in order, up to [`MAX_ABORTED`]: a
/// zero timeout polls each receive once, so only what has arrived is taken (the socket's
/// stream keeps a partly read message for the next receive).
async fn take_queued(shell: &mut zeromq::RouterSocket, shared: &Shared) -> Vec<Message> {
    let mut queued = Vec::new();
    while queued.len() < MAX_ABORTED {
        match tokio::time::timeout(std::time::Duration::ZERO, receive(shell, shared, "shell")).await
        {
            Ok(Some(req)) => queued.push(req),
            _ => break,
        }
    }
    queued
}

/// After a cell that stopped on its error: every `execute_request` in `queued` (those
/// already sent when the error was answered) is answered `aborted` without running, as
/// ipykernel aborts its queue (a notebook's "Run All" stops at the first error). Other
/// requests in it are answered as usual, and what arrives later runs as usual.
async fn abort_queued(shell: &mut zeromq::RouterSocket, k: &mut Shell, queued: Vec<Message>) {
    let shared = k.shared.clone();
    let count = k.count;
    for req in queued {
        let parent = Value::Object(req.header.clone());
        shared
            .publish("status", json!({"execution_state": "busy"}), &parent)
            .await;
        let reply = if req.msg_type() == "execute_request" {
            log!("shell: an execute_request aborted after the error before it");
            Some((
                "execute_reply".to_owned(),
                json!({"status": "aborted", "execution_count": count,
                       "user_expressions": {}, "payload": []}),
            ))
        } else {
            invalid_reply(&req, Some(count))
        };
        match reply {
            Some((t, content)) => {
                shared
                    .answer(shell, &req, Some((&t, content)), &parent)
                    .await
            }
            None => {
                // Not an execute_request: answered as outside an abort.
                let r = k.handle(&req, &parent).await;
                shared.answer(shell, &req, r, &parent).await;
            }
        }
    }
}

fn text(content: &Map<String, Value>, key: &str) -> String {
    content
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn flag(content: &Map<String, Value>, key: &str, default: bool) -> bool {
    content.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// Why the content of a verified request cannot be used, or `None`: it is not a JSON
/// object (see [`wire::Message::invalid`]), or a field the request type defines has the
/// wrong type or range (`code` not a string, `cursor_pos` not an integer within the code's
/// length in Unicode code points, as messaging protocol 5.2+ counts it).
fn problem(req: &Message) -> Option<String> {
    if let Some(why) = &req.invalid {
        return Some(why.clone());
    }
    let c = &req.content;
    let want = |key: &str, ok: fn(&Value) -> bool, what: &str| -> Option<String> {
        match c.get(key) {
            Some(v) if !ok(v) => Some(format!("{key} is not {what}")),
            _ => None,
        }
    };
    let string = |key: &str| want(key, Value::is_string, "a string");
    let boolean = |key: &str| want(key, Value::is_boolean, "a boolean");
    let integer = |key: &str| want(key, Value::is_u64, "a non-negative integer");
    let checks: Vec<Option<String>> = match req.msg_type() {
        "execute_request" => vec![
            string("code"),
            boolean("silent"),
            boolean("store_history"),
            boolean("allow_stdin"),
            boolean("stop_on_error"),
            want("user_expressions", Value::is_object, "an object"),
        ],
        "complete_request" | "inspect_request" => {
            let mut v = vec![
                string("code"),
                integer("cursor_pos"),
                integer("detail_level"),
            ];
            if let (Some(code), Some(pos)) = (
                c.get("code").and_then(Value::as_str),
                c.get("cursor_pos").and_then(Value::as_u64),
            ) {
                let len = code.chars().count() as u64;
                if pos > len {
                    v.push(Some(format!(
                        "cursor_pos {pos} is beyond the code ({len} characters)"
                    )));
                }
            }
            v
        }
        "is_complete_request" => vec![string("code")],
        "history_request" => vec![
            string("hist_access_type"),
            string("pattern"),
            boolean("output"),
            boolean("unique"),
            integer("n"),
            integer("start"),
            integer("stop"),
        ],
        "shutdown_request" => vec![boolean("restart")],
        _ => vec![],
    };
    checks.into_iter().flatten().next()
}

/// The error reply to a request whose content cannot be used ([`problem`]): its
/// `<type>_reply` (for a type ending in `_request`) of status `error`; `count` is the
/// execution count an `execute_reply` carries. `None` for a usable request, or one whose
/// type has no reply (logged).
fn invalid_reply(req: &Message, count: Option<u64>) -> Option<(String, Value)> {
    let why = problem(req)?;
    let t = req.msg_type();
    let Some(base) = t.strip_suffix("_request") else {
        log!("dropped a {t:?} message: {why}");
        return None;
    };
    log!("refused a {t}: {why}");
    let mut content = json!({"status": "error", "ename": "InvalidRequest",
                             "evalue": format!("invalid {t}: {why}"), "traceback": []});
    if t == "execute_request" {
        content["execution_count"] = json!(count.unwrap_or(0));
        content["user_expressions"] = json!({});
        content["payload"] = json!([]);
    }
    Some((format!("{base}_reply"), content))
}

/// Whether a call that failed with `e` means the kernel's session is gone (no such session, its
/// worker failed, or the connection is in an unknown state): the next cell opens a new one.
/// Other errors (a limit, a busy session) leave the session as it was.
fn ends_session(e: &ClientError) -> bool {
    match e {
        ClientError::Kernel(k) => {
            k.is_no_such_session() || matches!(k, KernelError::WorkerFailed { .. })
        }
        ClientError::Protocol(_) => true,
        _ => false,
    }
}

/// The short name of a client error (`SessionEnded`, `ConnectionFailed`, ...).
fn error_name(e: &ClientError) -> String {
    e.to_json()["error"]
        .as_str()
        .and_then(|s| s.rsplit('.').next())
        .unwrap_or("SandcellError")
        .to_owned()
}

impl Shell {
    async fn handle(&mut self, req: &Message, parent: &Value) -> Option<(&'static str, Value)> {
        let c = &req.content;
        Some(match req.msg_type() {
            "kernel_info_request" => ("kernel_info_reply", self.shared.kernel_info().await),
            "execute_request" => ("execute_reply", self.execute(c, parent).await),
            "is_complete_request" => (
                "is_complete_reply",
                complete::is_complete(self.shared.language, &text(c, "code")),
            ),
            "complete_request" => ("complete_reply", self.complete(c).await),
            "inspect_request" => ("inspect_reply", self.inspect(c).await),
            "history_request" => ("history_reply", self.history.reply(c)),
            "comm_info_request" => ("comm_info_reply", json!({"status": "ok", "comms": {}})),
            "comm_open" => {
                let content = json!({
                    "comm_id": text(c, "comm_id"),
                    "data": {"error": "comms (widgets) are not supported by sandcell kernels"},
                });
                self.shared.publish("comm_close", content, parent).await;
                return None;
            }
            "comm_msg" | "comm_close" => return None,
            "shutdown_request" => {
                // As on control (close_session): a session adopted after a restart of
                // sandcelld does not end with this connection.
                if let Slot::Ready(client, id) = &mut self.slot {
                    let id = id.clone();
                    match tokio::time::timeout(CLOSE_TIMEOUT, client.close(&id)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => log!("shutdown: closing session {id}: {e}"),
                        Err(_) => log!("shutdown: closing session {id} took too long"),
                    }
                    self.drop_session("the kernel was shut down".into());
                }
                (
                    "shutdown_reply",
                    json!({"status": "ok", "restart": c.get("restart").cloned().unwrap_or(json!(false))}),
                )
            }
            other => {
                if let Some(more) = log_drop_now() {
                    log!(
                        "shell: unsupported message type {other:?} ({more} more dropped unlogged)"
                    );
                }
                return None;
            }
        })
    }

    /// Cell `count` failed with `e`, which ends the session: dropped (the next cell opens a
    /// new one), and the cell's error reply.
    async fn session_gone(&mut self, count: u64, e: &ClientError, parent: &Value) -> Value {
        self.drop_session(format!("the session is gone ({e})"));
        self.call_failed(count, e, parent).await
    }

    /// Cell `count`'s error reply for a call that failed with `e`: its name, its text and one
    /// traceback line saying both.
    async fn call_failed(&self, count: u64, e: &ClientError, parent: &Value) -> Value {
        let name = error_name(e);
        let line = format!("{name}: {e}");
        self.error(count, &name, &e.to_string(), vec![line], parent)
            .await
    }

    /// The open session, opening one if needed: `Ok((client, id, why the last one ended))`,
    /// or the error text of a failed `Open`.
    async fn session(&mut self) -> Result<(&mut Client, String, Option<String>), String> {
        let mut ended = None;
        loop {
            match std::mem::replace(&mut self.slot, Slot::Gone(None)) {
                Slot::Ready(c, id) => {
                    self.slot = Slot::Ready(c, id);
                    break;
                }
                Slot::Opening(h) => match h.await {
                    Ok(Ok((c, id))) => {
                        *self.shared.sandcell.lock().expect("lock") = Some(id.clone());
                        self.slot = Slot::Ready(c, id);
                    }
                    Ok(Err(e)) => {
                        log!("could not open a sandcell session: {e}");
                        return Err(format!("could not open a sandcell session: {e}"));
                    }
                    Err(e) => return Err(format!("could not open a sandcell session: {e}")),
                },
                Slot::Gone(why) => {
                    ended = why;
                    self.slot = Slot::Opening(open(
                        self.shared.socket.clone(),
                        self.shared.language,
                        self.shared.environment,
                    ));
                }
            }
        }
        let Slot::Ready(c, id) = &mut self.slot else {
            unreachable!()
        };
        Ok((c, id.clone(), ended))
    }

    fn drop_session(&mut self, why: String) {
        self.slot = Slot::Gone(Some(why));
        *self.shared.sandcell.lock().expect("lock") = None;
    }

    async fn error(
        &self,
        count: u64,
        ename: &str,
        evalue: &str,
        tb: Vec<String>,
        parent: &Value,
    ) -> Value {
        let content = json!({"ename": ename, "evalue": evalue, "traceback": tb});
        self.shared.publish("error", content, parent).await;
        json!({"status": "error", "execution_count": count, "ename": ename, "evalue": evalue,
               "traceback": tb, "user_expressions": {}, "payload": []})
    }

    /// For a cell that failed to import a module another ready environment of the language
    /// has, the sentence saying which (as `sandcellctl run` prints after `hint:`), naming
    /// the kernel of that environment; `None` otherwise or when `ListEnvironments` does not
    /// answer within [`HINT_TIMEOUT`].
    async fn module_hint(&mut self, r: &sandcell_client::CellResult) -> Option<String> {
        let e = r.error.as_ref()?;
        let module = sandcell_client::human::missing_module(&e.kind, &e.message)?;
        let language = self.shared.language;
        let Slot::Ready(client, _) = &mut self.slot else {
            return None;
        };
        let envs = tokio::time::timeout(HINT_TIMEOUT, client.list_environments())
            .await
            .ok()?
            .ok()?;
        let hint = sandcell_client::human::module_hint(&module, &envs, language)?;
        let kernel = KERNELS.iter().find(|k| {
            k.1 == language && k.2.is_some_and(|env| hint.ends_with(&format!("-e {env})")))
        });
        Some(match kernel {
            Some((name, _, _, display, _)) => {
                format!("{hint}; in Jupyter, change the kernel to {display:?} ({name})")
            }
            None => hint,
        })
    }

    async fn execute(&mut self, c: &Map<String, Value>, parent: &Value) -> Value {
        let code = text(c, "code");
        let silent = flag(c, "silent", false);
        // A silent cell is never stored (messaging spec: `silent` forces `store_history`
        // off); only stored cells advance the count, as IPython's kernel counts.
        let store = flag(c, "store_history", true) && !silent;
        if store {
            self.count += 1;
        }
        let count = self.count;
        if !silent {
            // ipykernel announces the count the cell takes if stored (the next one).
            let announced = if store { count } else { count + 1 };
            self.shared
                .publish(
                    "execute_input",
                    json!({"code": code, "execution_count": announced}),
                    parent,
                )
                .await;
        }
        if store {
            self.history.push(count, &code);
        }
        let expressions = user_expressions(c);
        let ok = json!({"status": "ok", "execution_count": count, "payload": [],
                        "user_expressions": expressions});
        if code.trim().is_empty() {
            return ok;
        }
        if let Some(why) = unsendable(&code) {
            return self
                .error(count, "LimitExceeded", &why, vec![why.clone()], parent)
                .await;
        }
        let shared = self.shared.clone();
        let quiet = self.last_cell.elapsed() > QUIET_CHECK;
        self.last_cell = std::time::Instant::now();
        let (client, id, ended) = match self.session().await {
            Ok(s) => s,
            Err(e) => {
                self.slot = Slot::Gone(None);
                return self
                    .error(count, "SessionError", &e, vec![e.clone()], parent)
                    .await;
            }
        };
        if let Some(why) = ended
            && !silent
        {
            let t = format!(
                "sandcell: {why}; a new session was started (the variables of the old one are \
                 lost; tracebacks number its cells, <cell N>, from 1 again, apart from the \
                 execution count)\n"
            );
            shared
                .publish("stream", json!({"name": "stderr", "text": t}), parent)
                .await;
        }
        let mut result_text = None;
        // The connection may have been cut while the kernel was idle (sandcelld restarted; the
        // session lives on in its successor): asked first, so that a cell is never sent on a
        // dead connection and left to guess whether it ran.
        if quiet
            && let Err(e) = client.list_sessions().await
            && e.is_call_cut()
        {
            match reconnect(&shared.socket).await {
                Ok(c) => *client = c,
                Err(e) => return self.session_gone(count, &e, parent).await,
            }
        }
        // The cell's token: a cut by a daemon restart, even before the cell's number arrived,
        // is followed by sending the same call again, which never runs the code twice.
        let token = sandcell_client::cell_token();
        let mut track = sandcell_client::CellTrack::executing(
            sandcell_client::Reattach::default(),
            &id,
            &code,
            &token,
        );
        let outcome = async {
            client.execute_with_token(&id, &code, Some(&token)).await?;
            loop {
                let f = client.next_frame_following(&mut track).await?;
                if silent {
                    if let Some(r) = f.result {
                        return Ok(r);
                    }
                    continue;
                }
                if let Some(o) = f.output {
                    let name = if o.stream == Stream::Stderr {
                        "stderr"
                    } else {
                        "stdout"
                    };
                    shared
                        .publish("stream", json!({"name": name, "text": o.text}), parent)
                        .await;
                }
                if let Some(d) = f.display {
                    if let Some(note) = &d.note {
                        let t = format!("sandcell: {note}\n");
                        shared
                            .publish("stream", json!({"name": "stderr", "text": t}), parent)
                            .await;
                    }
                    if d.kind == DisplayKind::Result {
                        result_text = d
                            .data
                            .get("text/plain")
                            .and_then(Value::as_str)
                            .map(str::to_owned);
                        shared
                            .publish(
                                "execute_result",
                                json!({"execution_count": count, "data": d.data,
                                       "metadata": d.metadata}),
                                parent,
                            )
                            .await;
                    } else {
                        shared
                            .publish(
                                "display_data",
                                json!({"data": d.data, "metadata": d.metadata, "transient": {}}),
                                parent,
                            )
                            .await;
                    }
                }
                if let Some(r) = f.result {
                    return Ok::<_, ClientError>(r);
                }
            }
        }
        .await;
        let r = match outcome {
            Ok(r) => r,
            Err(e) if e.is_call_cut() => {
                // sandcelld restarted during the cell and its successor keeps the session:
                // the kernel goes on with it on a new connection (its variables stay); the
                // cell itself was interrupted by the restart, or had not started.
                let why = match reconnect(&shared.socket).await {
                    Ok(c) => {
                        if let Slot::Ready(old, _) = &mut self.slot {
                            *old = c;
                        }
                        "sandcelld restarted during the cell: the cell was interrupted (or did \
                         not start); the session and its variables are kept"
                            .to_string()
                    }
                    Err(e2) => {
                        self.drop_session(format!("the session is gone ({e2})"));
                        format!("sandcelld restarted during the cell and did not come back ({e2})")
                    }
                };
                return self
                    .error(
                        count,
                        "DaemonRestarted",
                        &why,
                        vec![format!("DaemonRestarted: {why}")],
                        parent,
                    )
                    .await;
            }
            Err(e) if ends_session(&e) => return self.session_gone(count, &e, parent).await,
            // A refusal that keeps the session (a limit such as max_source_bytes, a busy
            // session): the cell's error, the session and its variables stay.
            Err(e) => return self.call_failed(count, &e, parent).await,
        };
        if !silent {
            let mut notes = notices(&r);
            if let Some(hint) = self.module_hint(&r).await {
                notes.push_str(&format!("sandcell: hint: {hint}\n"));
            }
            if !notes.is_empty() {
                shared
                    .publish("stream", json!({"name": "stderr", "text": notes}), parent)
                    .await;
            }
        }
        if let (Some(t), true) = (result_text, store) {
            self.history.set_output(count, t);
        }
        let status = r.status.as_str();
        if r.session_ended {
            let mut why = format!("the session ended with cell {count} ({status}");
            if !r.warnings.is_empty() {
                why += &format!(": {}", r.warnings.join("; "));
            }
            why.push(')');
            self.drop_session(why);
        }
        match (r.status, &r.error) {
            (Status::Ok, _) => ok,
            (Status::Error, Some(err)) => {
                let mut evalue = err.message.clone();
                if err.kind == "EOFError" && self.shared.language == "python" {
                    evalue += " (input() is refused: a sandcell cell has no stdin)";
                }
                let mut tb = traceback_lines(err.traceback.as_deref());
                if tb.last().is_none_or(|l| !l.starts_with(&err.kind)) {
                    tb.push(format!("{}: {evalue}", err.kind));
                }
                self.error(count, &err.kind, &evalue, tb, parent).await
            }
            (s, err) => {
                let ename = match s {
                    // R's own condition class for an interrupt, as its worker catches it.
                    Status::Interrupted if self.shared.language == "r" => "interrupt",
                    Status::Interrupted => "KeyboardInterrupt",
                    Status::Timeout => "TimeoutError",
                    // In the interpreter, or the worker killed at its cgroup's memory limit:
                    // to the notebook both are the cell's memory running out.
                    Status::MemoryExhausted | Status::Oom => "MemoryError",
                    Status::Exited => "SystemExit",
                    _ => "SandcellError",
                };
                let mut evalue = match err {
                    Some(e) if !e.message.is_empty() => e.message.clone(),
                    _ => format!("the cell ended: {status}"),
                };
                if s == Status::Exited {
                    evalue = format!(
                        "the cell ended the interpreter (exit code {})",
                        r.exit_code.map_or("?".into(), |c| c.to_string())
                    );
                }
                if r.session_ended {
                    evalue += "; the session ended, the next cell starts a new one";
                }
                // The warnings went out on stderr just before. Where the worker said where the
                // cell was (an interrupt's traceback), its lines come first, as in IPython.
                let mut tb = traceback_lines(err.as_ref().and_then(|e| e.traceback.as_deref()));
                if tb.last().is_some_and(|l| l.starts_with(ename)) {
                    tb.pop();
                }
                tb.push(format!("{ename}: {evalue}"));
                self.error(count, ename, &evalue, tb, parent).await
            }
        }
    }

    /// Handles a session query's error: a session that ended is dropped (the next cell
    /// opens a new one).
    fn query_failed(&mut self, what: &str, e: &ClientError) {
        if ends_session(e) {
            self.drop_session(format!("the session ended during a {what} ({e})"));
        } else if !matches!(e, ClientError::Kernel(KernelError::SessionBusy { .. })) {
            log!("{what}: {e}");
        }
    }

    async fn complete(&mut self, c: &Map<String, Value>) -> Value {
        let code = text(c, "code");
        let cursor = c
            .get("cursor_pos")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| code.chars().count() as u64);
        if unsendable(&code).is_some() {
            return self.local_complete(&code, cursor);
        }
        if let Ok((client, id, _)) = self.session().await {
            match client.complete(&id, &code, Some(cursor)).await {
                Ok(r) => {
                    return json!({"status": "ok", "matches": r.matches,
                                  "cursor_start": r.cursor_start, "cursor_end": r.cursor_end,
                                  "metadata": {}});
                }
                Err(e) => self.query_failed("complete", &e),
            }
        } else {
            self.slot = Slot::Gone(None);
        }
        self.local_complete(&code, cursor)
    }

    /// Completion without a session: keywords and common names of the language and the
    /// names the history assigns.
    fn local_complete(&self, code: &str, cursor: u64) -> Value {
        let before: String = code.chars().take(cursor as usize).collect();
        let token: String = before
            .chars()
            .rev()
            .take_while(|c| {
                c.is_alphanumeric() || *c == '_' || (*c == '.' && self.shared.language == "r")
            })
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let mut pool: std::collections::BTreeSet<String> = if self.shared.language == "r" {
            R_WORDS.split_whitespace().map(str::to_owned).collect()
        } else {
            PYTHON_WORDS.split_whitespace().map(str::to_owned).collect()
        };
        let assign = if self.shared.language == "r" {
            "<-"
        } else {
            "="
        };
        for (_, c) in &self.history.cells {
            for line in c.lines() {
                if let Some((lhs, rest)) = line.split_once(assign)
                    && !rest.starts_with('=')
                {
                    let name = lhs.trim();
                    if !name.is_empty()
                        && name
                            .chars()
                            .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
                    {
                        pool.insert(name.to_owned());
                    }
                }
            }
        }
        let matches: Vec<&String> = pool
            .iter()
            .filter(|n| !token.is_empty() && n.starts_with(&token))
            .collect();
        let start = cursor - token.chars().count() as u64;
        json!({"status": "ok", "matches": matches, "cursor_start": start, "cursor_end": cursor,
               "metadata": {}})
    }

    async fn inspect(&mut self, c: &Map<String, Value>) -> Value {
        let code = text(c, "code");
        let cursor = c.get("cursor_pos").and_then(Value::as_u64);
        let detail = c
            .get("detail_level")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(1);
        if unsendable(&code).is_some() {
            return json!({"status": "ok", "found": false, "data": {}, "metadata": {}});
        }
        if let Ok((client, id, _)) = self.session().await {
            match client.help(&id, &code, cursor, Some(detail)).await {
                Ok(h) => {
                    let data = if h.found {
                        Value::Object(h.data)
                    } else {
                        json!({})
                    };
                    return json!({"status": "ok", "found": h.found, "data": data,
                                  "metadata": {}});
                }
                Err(e) => self.query_failed("help", &e),
            }
        } else {
            self.slot = Slot::Gone(None);
        }
        json!({"status": "ok", "found": false, "data": {}, "metadata": {}})
    }
}

/// Room in a Varlink request for what is not the code (method, session id, cursor), bytes.
const REQUEST_OVERHEAD: usize = 64 << 10;

/// Why `code` cannot be sent to sandcelld, or `None`: as a JSON string it would make a
/// request over the daemon's message bound (`sandcell_proto::kernel::MAX_MESSAGE_BYTES`,
/// 4 MiB), and the daemon ends a connection that sends one, which would end the session.
/// Code under the bound but over the daemon's `max_source_bytes` is refused by the daemon
/// itself (`LimitExceeded`, the session stays).
fn unsendable(code: &str) -> Option<String> {
    let max = sandcell_proto::kernel::MAX_MESSAGE_BYTES - REQUEST_OVERHEAD;
    let json: usize = code
        .chars()
        .map(|c| match c {
            '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
            c if (c as u32) < 0x20 => 6,
            c => c.len_utf8(),
        })
        .sum();
    (json > max).then(|| {
        format!(
            "max_source_bytes exceeded: the cell's code is {} bytes ({json} as JSON); sandcelld \
             reads requests of at most {max} bytes of code and runs cells of at most its \
             max_source_bytes; the cell was not sent (the session and its variables stay)",
            code.len()
        )
    })
}

/// The `user_expressions` of an `execute_reply`: for each key of the request's, an error
/// entry (the sandcell kernel does not evaluate them: that would run code outside a cell).
fn user_expressions(c: &Map<String, Value>) -> Value {
    let mut out = Map::new();
    if let Some(Value::Object(asked)) = c.get("user_expressions") {
        for k in asked.keys() {
            out.insert(
                k.clone(),
                json!({"status": "error", "ename": "NotImplementedError",
                       "evalue": "the sandcell kernel does not evaluate user_expressions \
                                  (they would run code outside a cell)",
                       "traceback": []}),
            );
        }
    }
    Value::Object(out)
}

/// The `stderr` lines saying what a result reports was cut or dropped (stdout, stderr,
/// display bundles; what a detached cell's record did not retain) and its warnings, as
/// `sandcellctl run` says them; `""` when there is nothing to say.
fn notices(r: &sandcell_client::CellResult) -> String {
    let mut t = String::new();
    let displays = r.displays.map(|s| ("display bundles", s));
    for (name, s) in [("stdout", r.stdout), ("stderr", r.stderr)]
        .into_iter()
        .chain(displays)
    {
        if s.truncated {
            t += &format!(
                "sandcell: {name} truncated: kept {} of {} bytes\n",
                s.kept, s.seen
            );
        }
    }
    if let Some(kept) = &r.retained {
        let displays = kept.displays.map(|s| ("display bundles", s));
        for (name, s) in [("stdout", kept.stdout), ("stderr", kept.stderr)]
            .into_iter()
            .chain(displays)
        {
            if s.dropped > 0 {
                t += &format!(
                    "sandcell: {name}: {} of {} bytes retained while detached, {} dropped\n",
                    s.kept, s.seen, s.dropped
                );
            }
        }
    }
    for w in &r.warnings {
        t += &format!("sandcell: warning: {w}\n");
    }
    t
}

/// Whether `text` matches the shell glob `pattern` (`*`, `?` one character; as Python's
/// `fnmatch` for these two), in at most `budget` steps (each taken from it); `None` when the
/// budget runs out first. The greedy match with one backtrack point is linear in the text
/// for most patterns but takes up to text x pattern steps for some (`*aaa…b*`), hence the
/// budget.
fn glob(pattern: &[char], text: &str, budget: &mut u64) -> Option<bool> {
    let text: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while t < text.len() {
        *budget = budget.checked_sub(1)?;
        if p < pattern.len() && (pattern[p] == '?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == '*' {
            star = Some(p);
            mark = t;
            p += 1;
        } else if let Some(s) = star {
            p = s + 1;
            mark += 1;
            t = mark;
        } else {
            return Some(false);
        }
    }
    while p < pattern.len() && pattern[p] == '*' {
        p += 1;
    }
    Some(p == pattern.len())
}

/// Steps one history search may take ([`glob`]): tens of milliseconds of the shell's time.
const SEARCH_BUDGET: u64 = 20_000_000;

/// Names a Python completion offers without a session (keywords and builtins).
const PYTHON_WORDS: &str = "False None True and as assert async await break class continue def \
del elif else except finally for from global if import in is lambda nonlocal not or pass raise \
return try while with yield abs all any ascii bin bool breakpoint bytearray bytes callable chr \
classmethod compile complex delattr dict dir divmod enumerate eval exec filter float format \
frozenset getattr globals hasattr hash help hex id input int isinstance issubclass iter len \
list locals map max memoryview min next object oct open ord pow print property range repr \
reversed round set setattr slice sorted staticmethod str sum super tuple type vars zip \
ArithmeticError AssertionError AttributeError Exception KeyError IndexError ValueError \
TypeError RuntimeError StopIteration ZeroDivisionError NotImplementedError";

/// Names an R completion offers without a session.
const R_WORDS: &str = "if else repeat while function for in next break TRUE FALSE NULL Inf NaN \
NA library require print cat paste paste0 sprintf format summary str head tail nrow ncol length \
names colnames rownames data.frame matrix list vector c seq seq_len seq_along rep sum mean \
median sd var min max range quantile table unique sort order rev apply sapply lapply vapply \
mapply Map Reduce Filter do.call lm glm predict anova t.test plot hist barplot boxplot lines \
points abline legend par png dev.off read.csv write.csv readRDS saveRDS is.na ifelse which any \
all round signif abs sqrt exp log log10 nchar substr strsplit gsub sub grepl toupper tolower \
factor levels as.numeric as.integer as.character as.factor as.data.frame merge aggregate with \
subset transform stop warning message tryCatch invisible return set.seed rnorm runif sample";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_messages_are_logged_at_most_once_a_second() {
        // The first drop of a quiet second is logged; the next ones in it are only counted,
        // and the next line says how many.
        while log_drop_now().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        for _ in 0..1000 {
            assert_eq!(log_drop_now(), None);
        }
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(log_drop_now(), Some(1000));
    }

    fn request(msg_type: &str, content: Value) -> Message {
        let Value::Object(content) = content else {
            panic!()
        };
        Message {
            identities: vec![],
            header: json!({"msg_type": msg_type}).as_object().unwrap().clone(),
            content,
            invalid: None,
            bytes: 0,
        }
    }

    #[test]
    fn history_is_bounded_in_bytes_and_cut_on_characters() {
        let mut h = History::default();
        // 'é' is two bytes: a cut at 64 KiB falls inside one.
        let code = format!("x{}", "é".repeat(MAX_HISTORY_CODE));
        h.push(1, &code);
        let kept = &h.cells[0].1;
        assert_eq!(kept.len(), MAX_HISTORY_CODE - 1);
        assert!(kept.starts_with("xé"));
        h.set_output(1, "ü".repeat(MAX_HISTORY_OUTPUT));
        assert_eq!(h.outputs[&1].len(), MAX_HISTORY_OUTPUT);
        assert_eq!(h.bytes, MAX_HISTORY_CODE - 1 + MAX_HISTORY_OUTPUT);
        // 20 MiB cells, again and again: the history stays within its budget, newest kept.
        let big = "y".repeat(20 << 20);
        for n in 2..=400 {
            h.push(n, &big);
            assert!(h.bytes <= MAX_HISTORY_BYTES, "{}", h.bytes);
        }
        assert_eq!(h.cells.len(), MAX_HISTORY_BYTES / MAX_HISTORY_CODE);
        assert_eq!(h.cells.back().unwrap().0, 400);
        assert!(h.outputs.is_empty());
        let total: usize = h.cells.iter().map(|(_, c)| c.len()).sum();
        assert_eq!(total, h.bytes);
        // An output for a cell the history dropped is not kept.
        h.set_output(1, "late".into());
        assert!(!h.outputs.contains_key(&1));
    }

    #[test]
    fn unusable_requests_get_error_replies() {
        let r = request(
            "complete_request",
            json!({"code": "abc", "cursor_pos": 1_000_000_000u64}),
        );
        let (t, c) = invalid_reply(&r, Some(3)).unwrap();
        assert_eq!(t, "complete_reply");
        assert_eq!(c["status"], "error");
        assert_eq!(c["ename"], "InvalidRequest");
        assert_eq!(
            c["evalue"],
            "invalid complete_request: cursor_pos 1000000000 is beyond the code (3 characters)"
        );
        // Counted in code points: "é" is one.
        let r = request("inspect_request", json!({"code": "é", "cursor_pos": 1}));
        assert!(invalid_reply(&r, None).is_none());
        let r = request("execute_request", json!({"code": 7}));
        let (t, c) = invalid_reply(&r, Some(2)).unwrap();
        assert_eq!(t, "execute_reply");
        assert_eq!(c["execution_count"], 2);
        assert_eq!(c["evalue"], "invalid execute_request: code is not a string");
        let r = request("history_request", json!({"n": -1}));
        assert!(invalid_reply(&r, None).is_some());
        let mut r = request("execute_request", json!({}));
        r.invalid = Some("the content is not a JSON object (an array)".into());
        let (_, c) = invalid_reply(&r, Some(0)).unwrap();
        assert_eq!(
            c["evalue"],
            "invalid execute_request: the content is not a JSON object (an array)"
        );
        // A message type without a reply is not answered.
        let mut r = request("comm_msg", json!({}));
        r.invalid = Some("x".into());
        assert!(invalid_reply(&r, None).is_none());
        let r = request("execute_request", json!({"code": "1", "silent": false}));
        assert!(invalid_reply(&r, None).is_none());
    }

    #[test]
    fn code_over_the_daemons_message_bound_is_not_sent() {
        let max = sandcell_proto::kernel::MAX_MESSAGE_BYTES - REQUEST_OVERHEAD;
        assert!(unsendable(&"a".repeat(max)).is_none());
        assert!(unsendable(&"a".repeat(max + 1)).is_some());
        // Escapes count as JSON writes them.
        assert!(unsendable(&"\n".repeat(max / 2 + 1)).is_some());
        assert!(unsendable(&"\u{1}".repeat(max / 6 + 1)).is_some());
        let why = unsendable(&"é".repeat(10 << 20)).unwrap();
        assert!(why.starts_with("max_source_bytes exceeded: the cell's code is 20971520 bytes"));
    }

    #[test]
    fn every_truncation_and_warning_is_noticed() {
        let stats =
            |seen: u64, kept: u64| json!({"seen": seen, "kept": kept, "truncated": seen > kept});
        let r: sandcell_client::CellResult = serde_json::from_value(json!({
            "cell": 1, "status": "ok", "usage": {"wall_seconds": 0.1},
            "stdout": stats(1_000_001, 65_536), "stderr": stats(10, 10),
            "displays": stats(3_000_000, 1_048_576), "state": "kept", "session_ended": false,
            "warnings": ["the cell's memory was close to its limit"],
            "retained": {"stdout": {"seen": 200_000, "kept": 131_072, "dropped": 68_928},
                         "stderr": {"seen": 0, "kept": 0, "dropped": 0}},
        }))
        .unwrap();
        assert_eq!(
            notices(&r),
            "sandcell: stdout truncated: kept 65536 of 1000001 bytes\n\
             sandcell: display bundles truncated: kept 1048576 of 3000000 bytes\n\
             sandcell: stdout: 131072 of 200000 bytes retained while detached, 68928 dropped\n\
             sandcell: warning: the cell's memory was close to its limit\n"
        );
        let quiet: sandcell_client::CellResult = serde_json::from_value(json!({
            "cell": 2, "status": "ok", "usage": {"wall_seconds": 0.1},
            "stdout": stats(3, 3), "stderr": stats(0, 0), "state": "kept",
            "session_ended": false,
        }))
        .unwrap();
        assert_eq!(notices(&quiet), "");
    }

    #[test]
    fn user_expressions_are_answered_with_errors() {
        let c = json!({"user_expressions": {"a": "1+1", "b": "x"}});
        let u = user_expressions(c.as_object().unwrap());
        assert_eq!(u.as_object().unwrap().len(), 2);
        assert_eq!(u["a"]["status"], "error");
        assert_eq!(u["b"]["ename"], "NotImplementedError");
        assert!(
            u["a"]["evalue"]
                .as_str()
                .unwrap()
                .contains("does not evaluate user_expressions")
        );
        assert_eq!(user_expressions(&Map::new()), json!({}));
    }

    #[test]
    fn glob_matches_as_fnmatch() {
        let g = |p: &str, t: &str| {
            let p: Vec<char> = p.chars().collect();
            glob(&p, t, &mut SEARCH_BUDGET.clone()).unwrap()
        };
        assert!(g("6*7", "6*7"));
        assert!(g("*", ""));
        assert!(g("a*c", "abbbc"));
        assert!(g("a?c", "abc"));
        assert!(!g("a?c", "abbc"));
        assert!(!g("6*7", "6*8"));
        // `?` is one character, not one byte.
        assert!(g("s = '?'", "s = 'é'"));
    }

    #[test]
    fn a_costly_history_search_stops_at_its_budget() {
        let mut h = History::default();
        let cell = format!("a = '{}'", "a".repeat(60_000));
        for n in 1..=30 {
            h.push(n, &cell);
        }
        let pattern = format!("*{}b*", "a".repeat(60_000));
        let started = std::time::Instant::now();
        let r = h.reply(
            json!({"hist_access_type": "search", "pattern": pattern})
                .as_object()
                .unwrap(),
        );
        assert_eq!(r["status"], "error", "{r}");
        assert_eq!(r["ename"], "LimitExceeded");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        let r = h.reply(
            json!({"hist_access_type": "search", "pattern": "a = 'a*"})
                .as_object()
                .unwrap(),
        );
        assert_eq!(r["history"].as_array().unwrap().len(), 30, "{r}");
    }
}
