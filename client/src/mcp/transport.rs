//! The stdio transport of `sandcellctl mcp`: newline-delimited JSON-RPC 2.0 (MCP
//! specification, "Transports: stdio": one message a line, no embedded newlines) read with
//! a bounded line reader, so that every line gets an answer or is passed on:
//!
//! - a line that is not JSON is answered `-32700` (Parse error) with `"id": null`
//!   (JSON-RPC 2.0 specification, §5 "Response object" and §5.1 "Error object");
//! - a line longer than the cap is answered `-32600` (Invalid Request) naming the cap in its
//!   message and in `data.max_line_bytes`, with the request's `id` when it stands within the
//!   line's first [`ID_SCAN_BYTES`] bytes (else `null`); the reader never holds more than the
//!   cap of one line and discards the rest up to its newline as it arrives, so a line without
//!   end does not grow the process;
//! - JSON that is no JSON-RPC message is answered `-32602` (Invalid params) when it names a
//!   method and an id (a request whose parameters do not fit the method), else `-32600`, with
//!   its id when it has a valid one; a notification (a method, no id) that does not parse is
//!   dropped, since JSON-RPC never answers a notification;
//! - a request naming a method of the MCP specification whose parameters do not fit it
//!   (`"arguments": "print(1)"` for `tools/call`) is answered `-32602`, not "method not found";
//! - a request whose `id` is the id of a request still unanswered is answered `-32600` (MCP
//!   specification, "Requests": an id must not be reused within a session), since both
//!   answers would carry the same id;
//! - every other line is handed to `rmcp` as the message it parsed to.
//!
//! Back-pressure: at most [`MAX_UNANSWERED`] requests are read and not yet answered; the
//! transport reads no further line until an answer has been written (or the client cancelled
//! a request). `rmcp` writes each answer from a task of its own, so without this a client that
//! sends requests and never reads standard output would make the server queue answers without
//! bound.
//!
//! `rmcp`'s own `AsyncRwTransport` drops unparsable and oversized lines without an answer
//! and writes error responses without an `id` member; this one writes `"id": null` instead,
//! which JSON-RPC 2.0 requires and the MCP Python SDK's `JSONRPCError` expects.

use rmcp::model::{ClientNotification, ClientRequest, ErrorData, JsonRpcMessage, RequestId};
use rmcp::service::RoleServer;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};

/// Bytes at the start of an oversized line searched for its request `id`.
pub const ID_SCAN_BYTES: usize = 64 * 1024;
/// Read buffer of standard input, bytes.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Longest tool or method name echoed back in an error message, bytes.
const ECHO_BYTES: usize = 200;
/// Requests read and not yet answered; no line is read beyond them until an answer is
/// written. Above the server's 16 tool calls in flight, so a call refused as busy is answered.
pub const MAX_UNANSWERED: usize = 32;
/// The request methods of the MCP specification (2025-06-18 and later): a request naming one
/// of these whose parameters do not parse is answered `-32602` (Invalid params).
const MCP_METHODS: &[&str] = &[
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "resources/subscribe",
    "resources/unsubscribe",
    "completion/complete",
    "logging/setLevel",
    "tasks/get",
    "tasks/list",
    "tasks/cancel",
    "tasks/result",
];

type Pending = Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

/// A [`Transport`] for the server role over a byte reader and writer (standard input and
/// output), one JSON-RPC message a line, lines at most `max_line_bytes` long.
pub struct LineTransport<R, W> {
    read: BufReader<R>,
    line: Vec<u8>,
    max_line_bytes: usize,
    /// Dropping the rest of an oversized line, up to its newline.
    discarding: bool,
    write: Arc<Mutex<Option<W>>>,
    /// An error answer being written; `receive` finishes it before reading on (so a flood of
    /// bad lines waits on a reader that does not read, instead of queueing answers).
    pending: Option<Pending>,
    /// Permits for requests read and not yet answered ([`MAX_UNANSWERED`]).
    unanswered: Arc<Semaphore>,
    /// The permit taken for the next line (released if it is no request).
    permit: Option<OwnedSemaphorePermit>,
    /// The requests read and not yet answered, each holding its permit until its answer is
    /// written or the client cancels it.
    open: Arc<StdMutex<HashMap<RequestId, OwnedSemaphorePermit>>>,
}

/// What one line turned out to be.
enum Parsed {
    Message(Box<RxJsonRpcMessage<RoleServer>>),
    Answer(Vec<u8>),
    Skip,
}

enum LineRead {
    Line,
    Oversized(Option<RequestId>),
    Eof,
}

impl<R, W> LineTransport<R, W>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    /// A transport reading `read` and writing `write`; lines over `max_line_bytes` bytes
    /// (newline included) are refused.
    pub fn new(read: R, write: W, max_line_bytes: usize) -> Self {
        LineTransport {
            read: BufReader::with_capacity(READ_BUFFER_BYTES, read),
            line: Vec::new(),
            max_line_bytes,
            discarding: false,
            write: Arc::new(Mutex::new(Some(write))),
            pending: None,
            unanswered: Arc::new(Semaphore::new(MAX_UNANSWERED)),
            permit: None,
            open: Arc::new(StdMutex::new(HashMap::new())),
        }
    }

    /// Reads one line into `self.line`, never holding more than `max_line_bytes` of it.
    /// Cancel-safe: bytes are moved from the reader's buffer into `self.line` with no await in
    /// between, and the state lives in `self`.
    async fn read_line(&mut self) -> io::Result<LineRead> {
        loop {
            let available = self.read.fill_buf().await?;
            if available.is_empty() {
                return Ok(LineRead::Eof);
            }
            let newline = available.iter().position(|&b| b == b'\n');
            let take = newline.map_or(available.len(), |i| i + 1);
            let mut outcome = None;
            if self.discarding {
                if newline.is_some() {
                    self.discarding = false;
                }
            } else if self.line.len().saturating_add(take) > self.max_line_bytes {
                let id =
                    recover_id(&self.line[..self.line.len().min(ID_SCAN_BYTES)]).or_else(|| {
                        (self.line.is_empty())
                            .then(|| recover_id(&available[..take.min(ID_SCAN_BYTES)]))
                            .flatten()
                    });
                self.line = Vec::new();
                self.discarding = newline.is_none();
                outcome = Some(LineRead::Oversized(id));
            } else {
                self.line.extend_from_slice(&available[..take]);
                if newline.is_some() {
                    outcome = Some(LineRead::Line);
                }
            }
            self.read.consume(take);
            if let Some(o) = outcome {
                return Ok(o);
            }
        }
    }

    /// Lets message `m` through to `rmcp`: a request takes the permit held for it (refused
    /// with an error line when its id is the id of a request still unanswered); a client's
    /// cancellation of a request gives that request's permit back.
    fn admit(
        &mut self,
        m: RxJsonRpcMessage<RoleServer>,
    ) -> Result<RxJsonRpcMessage<RoleServer>, Vec<u8>> {
        let mut open = self.open.lock().unwrap();
        match &m {
            JsonRpcMessage::Request(r) => {
                if open.contains_key(&r.id) {
                    let e = ErrorData::invalid_request(
                        format!(
                            "Invalid Request: id {} is the id of a request not yet answered; \
                             a request id must not be reused",
                            truncate(&r.id.to_string(), ECHO_BYTES)
                        ),
                        None,
                    );
                    return Err(error_line(None, e));
                }
                if let Some(p) = self.permit.take() {
                    open.insert(r.id.clone(), p);
                }
            }
            JsonRpcMessage::Notification(n) => {
                if let ClientNotification::CancelledNotification(c) = &n.notification
                    && let Some(id) = &c.params.request_id
                {
                    open.remove(id);
                }
            }
            _ => {}
        }
        Ok(m)
    }

    /// Writes `bytes` (one line, newline included) under the writer's lock.
    fn write_line(&self, bytes: Vec<u8>) -> Pending {
        let write = self.write.clone();
        Box::pin(async move {
            let mut w = write.lock().await;
            let w = w
                .as_mut()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "transport closed"))?;
            w.write_all(&bytes).await?;
            w.flush().await
        })
    }
}

impl<R, W> Transport<RoleServer> for LineTransport<R, W>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let answered = match &item {
            JsonRpcMessage::Response(r) => Some(r.id.clone()),
            JsonRpcMessage::Error(e) => e.id.clone(),
            _ => None,
        };
        let open = self.open.clone();
        let write = encode(&item).map(|bytes| self.write_line(bytes));
        async move {
            let r = match write {
                Ok(w) => w.await,
                Err(e) => Err(e),
            };
            // The answer is written (or cannot be): the request's permit goes back, and the
            // reader may read on.
            if let Some(id) = answered {
                open.lock().unwrap().remove(&id);
            }
            r
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            if let Some(p) = self.pending.as_mut() {
                let r = p.await;
                self.pending = None;
                if r.is_err() {
                    return None;
                }
            }
            if self.permit.is_none() {
                self.permit = Some(self.unanswered.clone().acquire_owned().await.ok()?);
            }
            match self.read_line().await {
                Ok(LineRead::Line) => {}
                Ok(LineRead::Oversized(id)) => {
                    let max = self.max_line_bytes;
                    let e = ErrorData::invalid_request(
                        format!(
                            "the message is longer than {max} bytes, the most this server \
                             reads in one line (max_line_bytes); it was discarded"
                        ),
                        Some(json!({"max_line_bytes": max})),
                    );
                    self.pending = Some(self.write_line(error_line(id, e)));
                    continue;
                }
                Ok(LineRead::Eof) | Err(_) => return None,
            }
            let parsed = parse(&self.line);
            self.line.clear();
            match parsed {
                Parsed::Message(m) => match self.admit(*m) {
                    Ok(m) => return Some(m),
                    Err(bytes) => self.pending = Some(self.write_line(bytes)),
                },
                Parsed::Answer(bytes) => self.pending = Some(self.write_line(bytes)),
                Parsed::Skip => {}
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        let w = self.write.lock().await.take();
        if let Some(mut w) = w {
            w.shutdown().await?;
        }
        Ok(())
    }
}

/// One message as a line: its JSON and a newline. An error response without an id gets
/// `"id": null` (JSON-RPC 2.0 §5: "If there was an error in detecting the id in the Request
/// object (e.g. Parse error/Invalid Request), it MUST be Null").
fn encode(item: &TxJsonRpcMessage<RoleServer>) -> io::Result<Vec<u8>> {
    let mut bytes = match item {
        JsonRpcMessage::Error(e) if e.id.is_none() => {
            let mut v = serde_json::to_value(item)?;
            v["id"] = Value::Null;
            serde_json::to_vec(&v)?
        }
        _ => serde_json::to_vec(item)?,
    };
    bytes.push(b'\n');
    Ok(bytes)
}

fn error_line(id: Option<RequestId>, e: ErrorData) -> Vec<u8> {
    let id = id.map_or(Value::Null, RequestId::into_json_value);
    let mut bytes = serde_json::to_vec(&json!({"jsonrpc": "2.0", "id": id, "error": e}))
        .unwrap_or_else(|_| {
            br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"internal error"}}"#
                .to_vec()
        });
    bytes.push(b'\n');
    bytes
}

/// A whole line (newline included): the message it holds, an error answer, or nothing (a
/// blank line, a notification that does not parse).
fn parse(line: &[u8]) -> Parsed {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // RFC 8259 §8.1: a parser may ignore a leading byte order mark.
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Parsed::Skip;
    }
    let e = match serde_json::from_slice::<RxJsonRpcMessage<RoleServer>>(line) {
        Ok(JsonRpcMessage::Request(r))
            if matches!(&r.request, ClientRequest::CustomRequest(c)
                if MCP_METHODS.contains(&c.method.as_str())) =>
        {
            // A method of the specification whose parameters did not parse as its own falls
            // through to the custom request; its own parser's error is the one to name.
            let method = r.request.method().to_owned();
            let detail = match method.as_str() {
                "tools/call" => "params must be an object with a string `name` and, optionally, \
                                 an object `arguments`"
                    .to_owned(),
                _ => "params must be an object of the shape the MCP specification gives".into(),
            };
            return Parsed::Answer(error_line(
                Some(r.id),
                ErrorData::invalid_params(
                    format!(
                        "Invalid params: the parameters do not fit method {:?}: {detail}",
                        truncate(&method, ECHO_BYTES)
                    ),
                    None,
                ),
            ));
        }
        Ok(m) => return Parsed::Message(Box::new(m)),
        Err(e) => e,
    };
    let v = match serde_json::from_slice::<Value>(line) {
        Ok(v) => v,
        Err(e) => {
            return Parsed::Answer(error_line(
                None,
                ErrorData::parse_error(
                    format!("Parse error: the line is not JSON ({e})"),
                    Some(json!({"line_bytes": line.len()})),
                ),
            ));
        }
    };
    let method = v.get("method").and_then(Value::as_str);
    let id = v.get("id");
    if method.is_some() && id.is_none() {
        return Parsed::Skip;
    }
    let id = id.and_then(|i| serde_json::from_value::<RequestId>(i.clone()).ok());
    let error = match method {
        Some(m) if id.is_some() && v.get("jsonrpc") == Some(&json!("2.0")) => {
            ErrorData::invalid_params(
                format!(
                    "Invalid params: the parameters do not fit method {:?}: {e}",
                    truncate(m, ECHO_BYTES)
                ),
                None,
            )
        }
        _ => ErrorData::invalid_request(
            format!("Invalid Request: not a JSON-RPC 2.0 message: {e}"),
            None,
        ),
    };
    Parsed::Answer(error_line(id, error))
}

/// At most `max` bytes of `s`, cut at a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// The `id` member of the JSON object that `prefix` begins, when it stands (whole) in
/// `prefix`: the members before it are skipped as they parse; a member cut off by the end of
/// `prefix` ends the search.
fn recover_id(prefix: &[u8]) -> Option<RequestId> {
    struct IdSeek<'a>(&'a mut Option<RequestId>);
    impl<'de> Visitor<'de> for IdSeek<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON-RPC object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "id" {
                    *self.0 = Some(map.next_value::<RequestId>()?);
                    return Ok(());
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }
    let mut id = None;
    let mut de = serde_json::Deserializer::from_slice(prefix);
    // The object is cut short, so this ends in an error; the id, if read, is kept.
    let _ = (&mut de).deserialize_map(IdSeek(&mut id));
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    fn answer(p: Parsed) -> Value {
        match p {
            Parsed::Answer(b) => serde_json::from_slice(&b).unwrap(),
            Parsed::Message(m) => panic!("a message: {m:?}"),
            Parsed::Skip => panic!("skipped"),
        }
    }

    #[test]
    fn lines_are_classified() {
        let a = answer(parse(b"{this is not json\n"));
        assert_eq!(a["error"]["code"], -32700);
        assert!(a.as_object().unwrap().contains_key("id") && a["id"].is_null());
        let a = answer(parse(b"\xff\xfe\n"));
        assert_eq!(a["error"]["code"], -32700);
        let a = answer(parse(
            br#"{"jsonrpc":"2.0","id":3,"method":"initialize","params":7}"#,
        ));
        assert_eq!(
            (a["error"]["code"].clone(), a["id"].clone()),
            (json!(-32602), json!(3))
        );
        let a = answer(parse(br#"{"jsonrpc":"2.0","id":4,"method":5}"#));
        assert_eq!(
            (a["error"]["code"].clone(), a["id"].clone()),
            (json!(-32600), json!(4))
        );
        let a = answer(parse(br#"[1, 2]"#));
        assert_eq!(a["error"]["code"], -32600);
        assert!(a["id"].is_null());
        let a = answer(parse(br#"{"id": "x", "result": 5, "error": 1}"#));
        assert_eq!(
            (a["error"]["code"].clone(), a["id"].clone()),
            (json!(-32600), json!("x"))
        );
        assert!(matches!(parse(b"  \r\n"), Parsed::Skip));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","method":"notifications/whatever","params":7}"#),
            Parsed::Skip
        ));
        assert!(matches!(
            parse(b"\xEF\xBB\xBF{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\r\n"),
            Parsed::Message(_)
        ));
    }

    #[test]
    fn an_id_is_recovered_from_a_cut_line() {
        let id = |s: &str| recover_id(s.as_bytes()).map(RequestId::into_json_value);
        assert_eq!(
            id(r#"{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"a":"xx"#),
            Some(json!(17))
        );
        assert_eq!(
            id(r#"{"jsonrpc":"2.0","id":"k\"1","params":"#),
            Some(json!("k\"1"))
        );
        assert_eq!(id(r#"{"jsonrpc":"2.0","params":{"code":"xxxxxx"#), None);
        assert_eq!(id(r#"{"jsonrpc":"2.0","id":[1],"#), None);
        assert_eq!(id(r#"{"jsonrpc":"2.0","i"#), None);
        assert_eq!(id("xx"), None);
    }

    async fn roundtrip(input: Vec<u8>, max: usize) -> (Vec<Value>, Vec<String>) {
        let (mut client_w, server_r) = duplex(1 << 16);
        let (server_w, mut client_r) = duplex(1 << 20);
        let mut t = LineTransport::new(server_r, server_w, max);
        let writer = tokio::spawn(async move {
            for chunk in input.chunks(1000) {
                client_w.write_all(chunk).await.unwrap();
            }
        });
        let mut methods = Vec::new();
        while let Some(m) = t.receive().await {
            let v = serde_json::to_value(&m).unwrap();
            methods.push(v["method"].as_str().unwrap_or("").to_owned());
        }
        writer.await.unwrap();
        Transport::<RoleServer>::close(&mut t).await.unwrap();
        let mut out = String::new();
        client_r.read_to_string(&mut out).await.unwrap();
        let answers = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (answers, methods)
    }

    #[tokio::test]
    async fn oversized_lines_are_answered_and_not_kept() {
        let mut input =
            br#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"code":""#.to_vec();
        input.extend(std::iter::repeat_n(b'x', 50_000));
        input.extend(b"\"}}\n");
        input.extend(b"not json\n");
        input.extend(br#"{"jsonrpc":"2.0","id":10,"method":"ping"}"#);
        input.push(b'\n');
        // No newline at all: discarded as it arrives.
        input.extend(std::iter::repeat_n(b'y', 300_000));
        let (answers, methods) = roundtrip(input, 4096).await;
        assert_eq!(methods, ["ping"]);
        assert_eq!(answers.len(), 3, "{answers:?}");
        assert_eq!(answers[0]["id"], 9);
        assert_eq!(answers[0]["error"]["code"], -32600);
        assert_eq!(answers[0]["error"]["data"]["max_line_bytes"], 4096);
        assert!(
            answers[0]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("4096")
        );
        assert_eq!(answers[1]["error"]["code"], -32700);
        assert!(answers[1]["id"].is_null());
        assert_eq!(answers[2]["error"]["code"], -32600);
        assert!(answers[2]["id"].is_null());
    }

    #[test]
    fn a_specified_method_with_parameters_that_do_not_fit_is_invalid_params() {
        let a = answer(parse(
            br#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"run_code","arguments":"print(1)"}}"#,
        ));
        assert_eq!(
            (a["error"]["code"].clone(), a["id"].clone()),
            (json!(-32602), json!(5))
        );
        assert!(
            a["error"]["message"]
                .as_str()
                .unwrap()
                .contains("tools/call")
        );
        // A method no specification names is passed on (rmcp answers it "method not found").
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":6,"method":"x/y","params":{}}"#),
            Parsed::Message(_)
        ));
    }

    fn request(id: u64) -> Vec<u8> {
        format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"ping\"}}\n").into_bytes()
    }

    /// A client that sends requests and does not read the answers: the transport hands on
    /// [`MAX_UNANSWERED`] of them and reads no further line until one is answered.
    #[tokio::test]
    async fn no_line_is_read_beyond_the_unanswered_requests() {
        let (mut client_w, server_r) = duplex(1 << 20);
        let (server_w, mut client_r) = duplex(1 << 20);
        let mut t = LineTransport::new(server_r, server_w, 4096);
        for id in 0..(MAX_UNANSWERED as u64 + 10) {
            client_w.write_all(&request(id)).await.unwrap();
        }
        for _ in 0..MAX_UNANSWERED {
            t.receive().await.unwrap();
        }
        let wait = std::time::Duration::from_millis(300);
        assert!(
            tokio::time::timeout(wait, t.receive()).await.is_err(),
            "a request beyond the unanswered ones was read"
        );
        // One answer written: one more request is read, and no second.
        let answer: TxJsonRpcMessage<RoleServer> =
            JsonRpcMessage::response(rmcp::model::ServerResult::empty(()), RequestId::Number(3));
        t.send(answer).await.unwrap();
        let m = tokio::time::timeout(wait, t.receive())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            serde_json::to_value(&m).unwrap()["id"],
            json!(MAX_UNANSWERED)
        );
        assert!(tokio::time::timeout(wait, t.receive()).await.is_err());
        let mut out = vec![0u8; 4096];
        let n = client_r.read(&mut out).await.unwrap();
        assert!(String::from_utf8_lossy(&out[..n]).contains("\"id\":3"));
    }

    /// A request the client cancels gives its place back.
    #[tokio::test]
    async fn a_cancelled_request_gives_its_place_back() {
        let (mut client_w, server_r) = duplex(1 << 20);
        let (server_w, _client_r) = duplex(1 << 20);
        let mut t = LineTransport::new(server_r, server_w, 4096);
        for id in 0..(MAX_UNANSWERED as u64 - 1) {
            client_w.write_all(&request(id)).await.unwrap();
        }
        client_w
            .write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":{\"requestId\":4}}\n")
            .await
            .unwrap();
        for id in 100..103 {
            client_w.write_all(&request(id)).await.unwrap();
        }
        let wait = std::time::Duration::from_millis(300);
        let mut requests = 0;
        while let Ok(Some(m)) = tokio::time::timeout(wait, t.receive()).await {
            requests += usize::from(matches!(m, JsonRpcMessage::Request(_)));
        }
        // 31 before the cancellation, then two more: one in the place request 4 gave back.
        assert_eq!(requests, MAX_UNANSWERED + 1);
    }

    #[tokio::test]
    async fn a_reused_id_of_an_unanswered_request_is_refused() {
        let mut input = request(7);
        input.extend(request(7));
        input.extend(request(8));
        let (answers, methods) = roundtrip(input, 4096).await;
        assert_eq!(methods, ["ping", "ping"]);
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_eq!(answers[0]["error"]["code"], -32600);
        assert!(
            answers[0]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not yet answered")
        );
    }

    #[test]
    fn an_error_without_id_is_written_with_id_null() {
        let m: TxJsonRpcMessage<RoleServer> =
            JsonRpcMessage::error(ErrorData::invalid_request("x", None), None);
        let v: Value = serde_json::from_slice(&encode(&m).unwrap()).unwrap();
        assert!(v.as_object().unwrap().contains_key("id") && v["id"].is_null());
    }
}
