//! Method dispatch for `org.sandcell.Kernel` and `org.varlink.service`.
//!
//! Replies are serialized once, in time linear in their size ([`socket::encode`]), and every
//! string a client sent that an error reply echoes is cut to [`ECHO_BYTES`] (a 4 MiB session
//! id is answered with its first bytes).

use super::socket::{self, PassedFds, Writer};
use crate::core::Core;
use crate::identity::Caller;
use sandcell_proto::kernel::{
    self as k, CloseParams, ExecuteParams, Frame, FrameReply, InterruptParams, KernelError,
    OpenParams, OpenReply, RawCall, RunParams,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use zlink::{Call, Reply};

/// A reply written, or the connection is unusable.
type Sent = std::io::Result<()>;

/// Longest string of an error reply's parameters, bytes; longer ones (client strings echoed
/// back) are cut at a character boundary and marked with `...`. At least the longest
/// node-qualified session id (97 bytes), so a valid id is echoed whole.
pub const ECHO_BYTES: usize = 128;

/// Longest `HostReply` parameters text decoded, bytes: a result and an error at their caps,
/// every byte escaped (`\uXXXX`, 6 bytes), and the other fields.
const HOST_REPLY_TEXT_MAX: usize = (k::MAX_HOST_CALL_RESULT + k::MAX_HOST_CALL_ERROR) * 6 + 4096;

/// An error reply of any interface.
#[derive(Debug, Serialize)]
struct ErrorReply {
    error: String,
    parameters: Value,
}

fn service_error(name: &str, parameters: Value) -> ErrorReply {
    ErrorReply {
        error: format!("org.varlink.service.{name}"),
        parameters,
    }
}

/// Cuts `s` to at most [`ECHO_BYTES`] bytes.
pub fn clip(s: &str) -> String {
    if s.len() <= ECHO_BYTES {
        return s.to_owned();
    }
    let mut end = ECHO_BYTES - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

fn clip_strings(v: &mut Value) {
    match v {
        Value::String(s) if s.len() > ECHO_BYTES => *s = clip(s),
        Value::Array(a) => a.iter_mut().for_each(clip_strings),
        Value::Object(o) => o.values_mut().for_each(clip_strings),
        _ => {}
    }
}

async fn send(w: &Writer, call: &Call<RawCall>, value: &impl Serialize) -> Sent {
    if call.oneway() {
        return Ok(());
    }
    let mut buf = Vec::new();
    socket::encode(&mut buf, value)?;
    deliver(w, buf).await.map(drop)
}

/// Writes one encoded reply through [`Writer::send`], which charges it to the reply budgets;
/// one that does not fit is answered `CapacityExceeded` naming the budget instead (a small
/// reply, never refused). Returns whether the reply itself was written.
async fn deliver(w: &Writer, buf: Vec<u8>) -> std::io::Result<bool> {
    match w.send(buf, socket::Kind::Reply).await {
        Ok(()) => Ok(true),
        Err(socket::SendError::Io(e)) => Err(e),
        Err(socket::SendError::Refused(r)) => {
            let e = reply_refused(r);
            let v = serde_json::to_value(&e).unwrap_or(Value::Null);
            let reply = ErrorReply {
                error: e.name(),
                parameters: v.get("parameters").cloned().unwrap_or(json!({})),
            };
            let mut buf = Vec::new();
            socket::encode(&mut buf, &reply)?;
            debug_assert!(buf.len() <= socket::SMALL_REPLY_BYTES);
            match w.send(buf, socket::Kind::Reply).await {
                Ok(()) => Ok(false),
                Err(socket::SendError::Io(e)) => Err(e),
                Err(socket::SendError::Refused(_)) => {
                    Err(std::io::Error::other("a small reply was refused"))
                }
            }
        }
    }
}

/// Answers a message that cannot be a call (not JSON, not a Varlink call object, over the
/// message bound, or not complete in time) with `org.varlink.service.InvalidParameter`
/// (`parameter`: "message"), so that a client learns why the daemon is about to end the
/// connection. Nothing of the message is echoed. The caller ends the connection afterwards
/// whatever this returns: after a malformed message the stream cannot be resynchronised.
pub async fn refuse_malformed(w: &Writer) -> Sent {
    let e = service_error("InvalidParameter", json!({ "parameter": "message" }));
    let mut buf = Vec::new();
    socket::encode(&mut buf, &e)?;
    deliver(w, buf).await.map(drop)
}

/// Bytes charged up front for a `ListFiles` reply: 1000 entries of about 1 KiB each. The
/// encoded reply is charged at its real size before it is written.
const LIST_REPLY_CHARGE: usize = 1024 * 1024;

/// Bytes charged up front for a `GetFile` reply of at most `max` bytes of file: the file bytes,
/// their base64 text and the encoded message (each 4/3 of `max`), and an envelope.
fn get_file_charge(max: u64) -> usize {
    let b64 = max.div_ceil(3) * 4;
    (max + 2 * b64) as usize + 64 * 1024
}

fn reply_refused(r: socket::ReplyRefused) -> KernelError {
    KernelError::CapacityExceeded {
        budget: r.budget.into(),
        in_use: r.in_use,
        requested: r.requested,
        max: r.max,
        retry_after_seconds: None,
    }
}

/// Sends a reply built under `charge` (taken before its content was read): once encoded, the
/// value is dropped and the charge handed over to [`deliver`], which charges the encoded
/// message until the client has it (or answers `CapacityExceeded` if it does not fit).
async fn send_charged<T: Serialize>(
    w: &Writer,
    call: &Call<RawCall>,
    value: T,
    charge: socket::ReplyCharge,
) -> Sent {
    if call.oneway() {
        return Ok(());
    }
    let mut buf = Vec::new();
    let reply = Reply::new(Some(value));
    socket::encode(&mut buf, &reply)?;
    // Only the encoded message stays alive while the client reads it.
    drop(reply);
    drop(charge);
    deliver(w, buf).await.map(drop)
}

async fn send_error(w: &Writer, call: &Call<RawCall>, mut e: ErrorReply) -> Sent {
    clip_strings(&mut e.parameters);
    send(w, call, &e).await
}

async fn send_kernel_error(w: &Writer, call: &Call<RawCall>, e: KernelError) -> Sent {
    let v = serde_json::to_value(&e).unwrap_or(Value::Null);
    let reply = ErrorReply {
        error: e.name(),
        parameters: v.get("parameters").cloned().unwrap_or(json!({})),
    };
    send_error(w, call, reply).await
}

async fn send_reply<T: Serialize>(
    w: &Writer,
    call: &Call<RawCall>,
    value: T,
    continues: bool,
) -> Sent {
    let reply = Reply::new(Some(value)).set_continues(continues.then_some(true));
    send(w, call, &reply).await
}

/// Parses `call`'s parameters as `T`, or replies `InvalidParameter` naming the field: the
/// path to the value of the wrong type (`session`, `limits.memory_bytes`), or the field serde
/// names when one is missing or unknown. Never the client's value itself.
fn params<T: DeserializeOwned>(call: &Call<RawCall>) -> Result<T, ErrorReply> {
    let mut de = serde_json::Deserializer::from_str(call.method().parameters_text());
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let parameter = if path.is_empty() || path == "." {
            // Missing or unknown fields are reported at the top level; serde names them in
            // backquotes ("missing field `code`", "unknown field `x`, expected ...").
            let msg = e.inner().to_string();
            match msg.split('`').nth(1) {
                Some(f) if msg.starts_with("missing field") || msg.starts_with("unknown field") => {
                    f.to_owned()
                }
                _ => "parameters".to_owned(),
            }
        } else {
            path
        };
        service_error("InvalidParameter", json!({ "parameter": clip(&parameter) }))
    })
}

/// The parameters of `$call` as `$t`, or returns the `InvalidParameter` reply ([`params`])
/// from the calling function.
macro_rules! parse {
    ($w:expr, $call:expr, $t:ty) => {
        match params::<$t>($call) {
            Ok(p) => p,
            Err(e) => return send_error($w, $call, e).await,
        }
    };
}

/// Answers `call` with `result`: its value as the one reply, or its error.
async fn answer<T: Serialize>(
    w: &Writer,
    call: &Call<RawCall>,
    result: Result<T, KernelError>,
) -> Sent {
    match result {
        Ok(v) => send_reply(w, call, v, false).await,
        Err(e) => send_kernel_error(w, call, e).await,
    }
}

/// Answers one call; `fds` are the descriptors passed with it: only `PutFile` takes one (and
/// exactly the one it names), any other call that comes with descriptors is refused with
/// `InvalidParameter` (`fd`). Unused descriptors are closed off the runtime when dropped. An
/// `Err` means the connection is unusable.
pub async fn handle(
    core: &Core,
    caller: &Caller,
    w: &Writer,
    call: Call<RawCall>,
    fds: PassedFds,
) -> Sent {
    let call = &call;
    let method = call.method().method.clone();
    let (iface, name) = method.rsplit_once('.').unwrap_or(("", method.as_str()));
    let takes_fds = iface == k::INTERFACE && name == "PutFile";
    if !(fds.is_empty() || takes_fds) {
        let e = KernelError::InvalidParameter {
            parameter: "fd".into(),
            reason: format!(
                "this method takes no descriptors ({} passed; closed unread)",
                fds.len()
            ),
        };
        drop(fds);
        return send_kernel_error(w, call, e).await;
    }
    match iface {
        "org.varlink.service" => return service(w, call, name).await,
        k::INTERFACE => {}
        _ => {
            return send_error(
                w,
                call,
                service_error("InterfaceNotFound", json!({ "interface": iface })),
            )
            .await;
        }
    }
    kernel(core, caller, w, call, name, fds).await
}

/// Answers a call of `org.sandcell.Kernel` method `name`.
async fn kernel(
    core: &Core,
    caller: &Caller,
    w: &Writer,
    call: &Call<RawCall>,
    name: &str,
    fds: PassedFds,
) -> Sent {
    if core.calls_held() {
        wait_for_adoption(core, call, name).await;
    }
    match name {
        "Run" | "Execute" | "Attach" if !call.more() => {
            send_error(w, call, service_error("ExpectedMore", json!({}))).await
        }
        "Run" => run(core, caller, w, call).await,
        "Execute" => execute(core, caller, w, call).await,
        "Submit" => {
            let p = parse!(w, call, k::SubmitParams);
            let r = core.submit(caller, &p.session, p.code, p.token).await;
            answer(w, call, r.map(|cell| k::SubmitReply { cell })).await
        }
        "CellStatus" => {
            let p = parse!(w, call, k::CellParams);
            answer(w, call, core.cell_status(caller, &p.session, p.cell).await).await
        }
        "Attach" => {
            let p = parse!(w, call, k::CellParams);
            attach(core, caller, w, call, p).await
        }
        "Open" => open(core, caller, w, call).await,
        "Inspect" => {
            let p = parse!(w, call, k::InspectParams);
            answer(w, call, core.inspect(caller, &p.session, p.max_items).await).await
        }
        "Complete" => {
            let p = parse!(w, call, sandcell_proto::query::CompleteParams);
            answer(w, call, core.complete(caller, p).await).await
        }
        "Help" => {
            let p = parse!(w, call, sandcell_proto::query::HelpParams);
            answer(w, call, core.help(caller, p).await).await
        }
        "Interrupt" => {
            let p = parse!(w, call, InterruptParams);
            answer(w, call, core.interrupt(caller, &p.session, p.cell).await).await
        }
        "InterruptSession" => {
            let p = parse!(w, call, k::InterruptSessionParams);
            answer(
                w,
                call,
                core.interrupt_own_session(caller, &p.session).await,
            )
            .await
        }
        "ListSessions" => {
            let _ = parse!(w, call, k::ListSessionsParams);
            answer(w, call, core.list_own_sessions(caller).await).await
        }
        "HostReply" => {
            // `result` is any JSON object, decoded as a tree (about 32 bytes a value): text
            // longer than the largest valid reply can encode to (every byte of the result
            // and error escaped as `\uXXXX`) is refused before it is decoded.
            let text = call.method().parameters_text().len();
            if text > HOST_REPLY_TEXT_MAX {
                let e = KernelError::LimitExceeded {
                    limit: "host_call_result_bytes".into(),
                    value: text as u64,
                    max: k::MAX_HOST_CALL_RESULT as u64,
                };
                return send_kernel_error(w, call, e).await;
            }
            let p = parse!(w, call, k::HostReplyParams);
            let r = core
                .host_reply(caller, &p.session, p.call, p.result, p.error)
                .await;
            answer(w, call, r.map(|()| json!({}))).await
        }
        "ListFiles" => list_files(core, caller, w, call).await,
        "GetFile" => get_file(core, caller, w, call).await,
        "PutFile" => {
            let p = parse!(w, call, k::PutFileParams);
            answer(w, call, put_file(core, caller, p, fds).await).await
        }
        "DeleteFile" => {
            let p = parse!(w, call, k::DeleteFileParams);
            let r = core.delete_file(caller, &p.session, &p.name).await;
            answer(w, call, r.map(|()| json!({}))).await
        }
        "ListEnvironments" => {
            let _ = parse!(w, call, k::ListEnvironmentsParams);
            let environments = core.list_environments().await;
            send_reply(w, call, k::ListEnvironmentsReply { environments }, false).await
        }
        "Close" => {
            let p = parse!(w, call, CloseParams);
            answer(
                w,
                call,
                core.close(caller, &p.session).await.map(|()| json!({})),
            )
            .await
        }
        _ => {
            send_error(
                w,
                call,
                service_error("MethodNotFound", json!({ "method": call.method().method })),
            )
            .await
        }
    }
}

/// The methods whose whole effect is on the one session their `session` parameter names
/// (its actor and its cells): while the daemon adopts its predecessor's sessions, such a call
/// waits for that session's adoption only. Every other call (`Open`, `Run`, `Close`,
/// `ListSessions`, the file methods, `HostReply`, ...) touches budgets, listings or files
/// that the rest of the adoption still changes, and waits for its end.
const ONE_SESSION_METHODS: &[&str] = &[
    "Execute",
    "Submit",
    "Attach",
    "CellStatus",
    "Interrupt",
    "InterruptSession",
    "Inspect",
];

/// Waits while calls are held for the adoption of a predecessor's sessions
/// ([`Core::hold_calls`]): a call of [`ONE_SESSION_METHODS`] until its session is adopted (or
/// the adoption ends: an id that was not adopted then gets the answer any lookup gives, never
/// `NoSuchSession` before the end), any other call until the adoption ends. The adoption takes
/// the most recently active sessions first (`adopt::finish`), so the owner who was running
/// cells at the restart is answered before the others are adopted.
async fn wait_for_adoption(core: &Core, call: &Call<RawCall>, name: &str) {
    #[derive(serde::Deserialize)]
    struct Named {
        session: String,
    }
    if ONE_SESSION_METHODS.contains(&name)
        && let Ok(n) = serde_json::from_str::<Named>(call.method().parameters_text())
    {
        core.session_calls_released(&n.session).await;
    } else {
        core.calls_released().await;
    }
}

/// `Run` (the caller checked `more`): a one-shot session's frames, streamed.
async fn run(core: &Core, caller: &Caller, w: &Writer, call: &Call<RawCall>) -> Sent {
    let (tx, rx) = mpsc::channel::<Frame>(64);
    let p = parse!(w, call, RunParams);
    let started = core
        .run(
            caller,
            crate::core::RunRequest {
                language: &p.language,
                environment: p.environment.as_deref(),
                limits: p.limits.as_ref(),
                host_calls: p.host_calls.unwrap_or(false),
                shown: crate::session::Shown {
                    display: p.display_last_expression.unwrap_or(true),
                    rich: p.rich_output.unwrap_or(false),
                },
                egress: p.egress.as_deref(),
            },
            p.code,
            tx,
        )
        .await;
    stream_cell(core, caller, w, call, rx, None, started).await
}

/// `Execute` (the caller checked `more`): the cell's frames, streamed.
async fn execute(core: &Core, caller: &Caller, w: &Writer, call: &Call<RawCall>) -> Sent {
    let (to, rx, replaced) = attachment();
    let p = parse!(w, call, ExecuteParams);
    match core.execute(caller, &p.session, p.code, p.token, to).await {
        // A repeat (its token names a cell of the session): followed as `Attach` follows it.
        Ok(Some((cell, replay))) => {
            let charge = match socket::ReplyCharge::new(caller.uid, ATTACH_REPLY_CHARGE) {
                Ok(c) => c,
                Err(r) => return send_kernel_error(w, call, reply_refused(r)).await,
            };
            let at = (p.session.as_str(), cell);
            follow(core, caller, w, call, at, replay, charge, rx, replaced).await
        }
        started => stream_cell(core, caller, w, call, rx, Some(replaced), started.map(drop)).await,
    }
}

/// A new attachment for a cell's live frames: the side the cell's relay holds, the frames'
/// receiver, and the signal that a newer `Attach` took over.
fn attachment() -> (
    crate::cells::Attachment,
    mpsc::Receiver<Frame>,
    oneshot::Receiver<()>,
) {
    let (frames, rx) = mpsc::channel::<Frame>(64);
    let (replaced, replaced_rx) = oneshot::channel();
    (
        crate::cells::Attachment { frames, replaced },
        rx,
        replaced_rx,
    )
}

/// Answers a `Run` or `Execute` whose cell `started` (or was refused): its frames from `rx`
/// until the result, or the error that ends the stream.
async fn stream_cell(
    core: &Core,
    caller: &Caller,
    w: &Writer,
    call: &Call<RawCall>,
    rx: mpsc::Receiver<Frame>,
    replaced: Option<oneshot::Receiver<()>>,
    started: Result<(), KernelError>,
) -> Sent {
    if let Err(e) = started {
        return send_kernel_error(w, call, e).await;
    }
    match stream_frames(w, call, rx, replaced, core).await? {
        Streamed::Result => Ok(()),
        Streamed::Replaced(cell) => {
            let session = params::<ExecuteParams>(call)
                .map(|p| p.session)
                .unwrap_or_default();
            send_kernel_error(w, call, KernelError::AttachmentReplaced { session, cell }).await
        }
        Streamed::Stopped => {
            // The frames stopped before a result: an `Execute` queued just as its session
            // ended (its owner's connection closed, an admin's Close) is dropped with the
            // session, and is answered with the session's end. Anything else is a worker
            // failure.
            let e = match params::<ExecuteParams>(call) {
                Ok(p) if call.method().method.ends_with(".Execute") => {
                    core.cell_cut(caller, &p.session).await
                }
                _ => KernelError::WorkerFailed {
                    reason: "the session ended without a result".into(),
                },
            };
            send_kernel_error(w, call, e).await
        }
    }
}

/// `Open`: a session, named as clients see it.
async fn open(core: &Core, caller: &Caller, w: &Writer, call: &Call<RawCall>) -> Sent {
    let p = parse!(w, call, OpenParams);
    let opened = core
        .open_with(
            caller,
            crate::core::OpenRequest {
                language: &p.language,
                environment: p.environment.as_deref(),
                limits: p.limits.as_ref(),
                detached_idle_seconds: p.detached_idle_seconds,
                host_calls: p.host_calls.unwrap_or(false),
                shown: crate::session::Shown {
                    display: p.display_last_expression.unwrap_or(true),
                    rich: p.rich_output.unwrap_or(false),
                },
                egress: p.egress.as_deref(),
            },
        )
        .await;
    match opened {
        Ok(s) => {
            let reply = OpenReply {
                session: core.public_id(&s.id),
                engine: s.engine.clone(),
            };
            send_reply(w, call, reply, false).await
        }
        Err(e) => send_kernel_error(w, call, e).await,
    }
}

// The two replies that are large before they are encoded (`ListFiles`, `GetFile`) are charged
// to the reply budgets before anything is read (socket.rs, ReplyCharge); once encoded, every
// reply is charged by `Writer::send` until the client has it.

/// `ListFiles`, charged [`LIST_REPLY_CHARGE`] up front.
async fn list_files(core: &Core, caller: &Caller, w: &Writer, call: &Call<RawCall>) -> Sent {
    let p = parse!(w, call, k::ListFilesParams);
    let charge = match socket::ReplyCharge::new(caller.uid, LIST_REPLY_CHARGE) {
        Ok(c) => c,
        Err(r) => return send_kernel_error(w, call, reply_refused(r)).await,
    };
    match core.list_files(caller, &p.session).await {
        Ok((files, truncated)) => {
            send_charged(w, call, k::ListFilesReply { files, truncated }, charge).await
        }
        Err(e) => send_kernel_error(w, call, e).await,
    }
}

/// `GetFile`, charged [`get_file_charge`] of the chunk asked for up front.
async fn get_file(core: &Core, caller: &Caller, w: &Writer, call: &Call<RawCall>) -> Sent {
    let p = parse!(w, call, k::GetFileParams);
    let max = p
        .max_bytes
        .unwrap_or(k::MAX_CHUNK_BYTES)
        .clamp(1, k::MAX_CHUNK_BYTES);
    let charge = match socket::ReplyCharge::new(caller.uid, get_file_charge(max)) {
        Ok(c) => c,
        Err(r) => return send_kernel_error(w, call, reply_refused(r)).await,
    };
    let got = core
        .get_file(
            caller,
            &p.session,
            &p.name,
            p.offset.unwrap_or(0),
            p.max_bytes,
        )
        .await;
    match got {
        Ok((file, bytes, eof)) => {
            let data = k::encode_base64(&bytes);
            drop(bytes);
            send_charged(w, call, k::GetFileReply { file, data, eof }, charge).await
        }
        Err(e) => send_kernel_error(w, call, e).await,
    }
}

/// `PutFile`: the content is inline base64 `data` or the descriptor at index `fd` among
/// those passed with the call; never both.
async fn put_file(
    core: &Core,
    caller: &Caller,
    p: k::PutFileParams,
    mut fds: PassedFds,
) -> Result<Value, KernelError> {
    let invalid = |parameter: &str, reason: &str| KernelError::InvalidParameter {
        parameter: parameter.into(),
        reason: reason.into(),
    };
    let passed = fds.len();
    if passed > 1 || (passed == 1 && p.fd.is_none()) {
        return Err(invalid(
            "fd",
            "pass exactly the one descriptor that fd names",
        ));
    }
    let source = match (p.data, p.fd) {
        (Some(_), Some(_)) => return Err(invalid("fd", "give data or fd, not both")),
        (Some(data), None) => {
            // 4 base64 characters per 3 bytes: refuse before decoding anything too long.
            let max = k::MAX_INLINE_BYTES;
            if data.len() as u64 > max.div_ceil(3) * 4 {
                return Err(KernelError::LimitExceeded {
                    limit: "inline_bytes".into(),
                    value: data.len() as u64 / 4 * 3,
                    max,
                });
            }
            let bytes = k::decode_base64(&data).map_err(|e| invalid("data", &e.to_string()))?;
            crate::core::Upload::Inline(bytes)
        }
        (None, Some(i)) => {
            let i = usize::try_from(i).unwrap_or(usize::MAX);
            match fds.take(i) {
                Some(u) => crate::core::Upload::Fd(u),
                None => {
                    return Err(invalid("fd", "no such descriptor was passed with the call"));
                }
            }
        }
        (None, None) if p.size == 0 => crate::core::Upload::Inline(Vec::new()),
        (None, None) => return Err(invalid("data", "give data or fd")),
    };
    let file = core
        .put_file(caller, &p.session, &p.name, p.size, source)
        .await?;
    Ok(json!(k::PutFileReply { file }))
}

/// How a stream of frames ended.
enum Streamed {
    /// With the result (the call is answered).
    Result,
    /// A newer `Attach` took over (the cell's number); the call still needs its error.
    Replaced(u64),
    /// The frames stopped without a result; the call still needs its error.
    Stopped,
}

/// Appends `frame` as a reply (continued unless it carries the result) to `buf`; the
/// `started` frame names the session as clients see it ([`Core::public_id`]). Returns
/// whether it was the last.
fn encode_frame(buf: &mut Vec<u8>, mut frame: Frame, core: &Core) -> std::io::Result<bool> {
    let last = frame.result.is_some();
    if let Some(s) = frame.started.as_mut() {
        s.session = core.public_id(&s.session);
    }
    let reply = Reply::new(Some(FrameReply { frame })).set_continues((!last).then_some(true));
    socket::encode(buf, &reply)?;
    Ok(last)
}

/// Fires when `r` says a newer `Attach` took the cell over; never for `None` or an
/// attachment dropped without being replaced (the cell ended, or it is not retained).
async fn replaced_signal(r: &mut Option<oneshot::Receiver<()>>) {
    if let Some(rx) = r {
        if rx.await.is_ok() {
            return;
        }
        *r = None;
    }
    std::future::pending().await
}

/// Writes a cell's frames as they come, until the result, the end of the frames, or (for an
/// attachment, `replaced`) a newer `Attach` taking over once the frames already queued are
/// written.
async fn stream_frames(
    w: &Writer,
    call: &Call<RawCall>,
    mut rx: mpsc::Receiver<Frame>,
    mut replaced: Option<oneshot::Receiver<()>>,
    core: &Core,
) -> std::io::Result<Streamed> {
    let mut buf: Vec<u8> = Vec::new();
    let mut cell = 0;
    let mut was_replaced = false;
    loop {
        let first = if was_replaced {
            // Only what was queued before the new `Attach` is still this client's.
            match rx.try_recv() {
                Ok(f) => Some(f),
                Err(_) => return Ok(Streamed::Replaced(cell)),
            }
        } else {
            tokio::select! {
                biased;
                f = rx.recv() => f,
                () = replaced_signal(&mut replaced) => {
                    was_replaced = true;
                    replaced = None;
                    match rx.try_recv() {
                        Ok(f) => Some(f),
                        Err(_) => return Ok(Streamed::Replaced(cell)),
                    }
                }
            }
        };
        let Some(first) = first else {
            // The relay let go of this attachment: replaced, or the frames stopped.
            return Ok(match replaced.as_mut().map(|r| r.try_recv()) {
                Some(Ok(())) => Streamed::Replaced(cell),
                _ => Streamed::Stopped,
            });
        };
        // Every frame already queued goes out in one write: a short cell's output and result
        // reach the client together. Bounded by FRAME_BATCH_BYTES.
        buf.clear();
        let mut next = Some(first);
        let mut last = false;
        while let Some(frame) = next.take() {
            let started = frame.started.as_ref().map(|s| s.cell);
            if let Some(c) = started {
                cell = c;
            }
            last = encode_frame(&mut buf, frame, core)?;
            if !last && buf.len() < FRAME_BATCH_BYTES {
                next = match rx.try_recv() {
                    Ok(f) => Some(f),
                    // A cell that ends at once reaches the client in one write (one wake-up
                    // of the client) with its `started`; a longer one gets its `started` at
                    // most STARTED_COALESCE later.
                    Err(mpsc::error::TryRecvError::Empty) if started.is_some() => {
                        tokio::time::timeout(STARTED_COALESCE, rx.recv())
                            .await
                            .ok()
                            .flatten()
                    }
                    Err(_) => None,
                };
            }
        }
        if !call.oneway() && !buf.is_empty() {
            match w.send(std::mem::take(&mut buf), socket::Kind::Stream).await {
                Ok(()) => {}
                Err(socket::SendError::Io(e)) => return Err(e),
                Err(socket::SendError::Refused(_)) => {
                    return Err(std::io::Error::other("streamed frames were refused"));
                }
            }
        }
        if last {
            return Ok(Streamed::Result);
        }
    }
}

/// `Attach`: the retained frames, written at once under a reply-budget charge (socket.rs,
/// `ReplyCharge`: they are up to 256 KiB of text, escaped up to six times), then the live
/// frames until the result, or `AttachmentReplaced` when a newer `Attach` takes over.
async fn attach(
    core: &Core,
    caller: &Caller,
    w: &Writer,
    call: &Call<RawCall>,
    p: k::CellParams,
) -> Sent {
    let charge = match socket::ReplyCharge::new(caller.uid, ATTACH_REPLY_CHARGE) {
        Ok(c) => c,
        Err(r) => return send_kernel_error(w, call, reply_refused(r)).await,
    };
    let (to, rx, replaced) = attachment();
    let replay = match core.attach(caller, &p.session, p.cell, to).await {
        Ok(r) => r,
        Err(e) => return send_kernel_error(w, call, e).await,
    };
    let at = (p.session.as_str(), p.cell);
    follow(core, caller, w, call, at, replay, charge, rx, replaced).await
}

/// An attachment's answer: the `replay` (charged up front by `charge`, then at its encoded
/// size), then the cell's live frames from `rx` until its result, or the error that ends
/// them (`AttachmentReplaced` when a newer `Attach` took the cell over). `at`: the session
/// as the caller named it, and the cell.
#[allow(clippy::too_many_arguments)]
async fn follow(
    core: &Core,
    caller: &Caller,
    w: &Writer,
    call: &Call<RawCall>,
    (session, cell): (&str, u64),
    replay: Vec<Frame>,
    charge: socket::ReplyCharge,
    rx: mpsc::Receiver<Frame>,
    replaced: oneshot::Receiver<()>,
) -> Sent {
    let mut buf = Vec::new();
    let mut last = false;
    for frame in replay {
        last = encode_frame(&mut buf, frame, core)?;
    }
    // The replay is charged as any reply from here on (deliver); refused, it is answered
    // `CapacityExceeded` and the attachment ends.
    drop(charge);
    if !call.oneway() && !deliver(w, buf).await? {
        return Ok(());
    }
    if last {
        return Ok(());
    }
    let e = match stream_frames(w, call, rx, Some(replaced), core).await? {
        Streamed::Result => return Ok(()),
        Streamed::Replaced(_) => KernelError::AttachmentReplaced {
            session: session.into(),
            cell,
        },
        Streamed::Stopped => core.stream_lost(caller, session).await,
    };
    send_kernel_error(w, call, e).await
}

/// Bytes charged up front for an `Attach` replay: both streams' retained text, escaped, and
/// a retained result. The encoded replay is charged at its real size before it is written.
const ATTACH_REPLY_CHARGE: usize = 2 * 1024 * 1024;

/// Bytes of serialized frames after which a batch is written without waiting for more queued
/// frames (a frame's text is at most 64 KiB, six bytes per byte when escaped).
const FRAME_BATCH_BYTES: usize = 256 * 1024;

/// How long a cell's `started` frame waits for the cell's next frame before it is written
/// alone (see [`stream_frames`]).
const STARTED_COALESCE: std::time::Duration = std::time::Duration::from_millis(1);

async fn service(w: &Writer, call: &Call<RawCall>, name: &str) -> Sent {
    match name {
        "GetInfo" => {
            let info = json!({
                "vendor": "sandcell",
                "product": "sandcelld",
                "version": env!("CARGO_PKG_VERSION"),
                "url": "https://example.invalid/sandcell",
                "interfaces": ["org.varlink.service", k::INTERFACE],
            });
            send_reply(w, call, info, false).await
        }
        "GetInterfaceDescription" => {
            #[derive(serde::Deserialize)]
            struct Asked {
                #[serde(default)]
                interface: String,
            }
            let asked = serde_json::from_str::<Asked>(call.method().parameters_text())
                .map(|a| a.interface)
                .unwrap_or_default();
            let description = match asked.as_str() {
                k::INTERFACE => k::IDL.to_owned(),
                "org.varlink.service" => zlink::varlink_service::DESCRIPTION.to_string(),
                _ => {
                    return send_error(
                        w,
                        call,
                        service_error("InterfaceNotFound", json!({ "interface": asked })),
                    )
                    .await;
                }
            };
            send_reply(w, call, json!({ "description": description }), false).await
        }
        _ => {
            send_error(
                w,
                call,
                service_error(
                    "MethodNotFound",
                    json!({ "method": format!("org.varlink.service.{name}") }),
                ),
            )
            .await
        }
    }
}
