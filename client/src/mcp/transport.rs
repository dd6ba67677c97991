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
//! - every other line is handed to `rmcp` as the message it parsed to.
//!
//! `rmcp`'s own `AsyncRwTransport` drops unparsable and oversized lines without an answer
//! and writes error responses without an `id` member; this one writes `"id": null` instead,
//! which JSON-RPC 2.0 requires and the MCP Python SDK's `JSONRPCError` expects.

use rmcp::model::{ErrorData, JsonRpcMessage, RequestId};
use rmcp::service::RoleServer;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
use serde_json::{Value, json};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;

/// Bytes at the start of an oversized line searched for its request `id`.
pub const ID_SCAN_BYTES: usize = 64 * 1024;
/// Read buffer of standard input, bytes.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Longest tool or method name echoed back in an error message, bytes.
const ECHO_BYTES: usize = 200;

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
        let write = encode(&item).map(|bytes| self.write_line(bytes));
        async move { write?.await }
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
                Parsed::Message(m) => return Some(*m),
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
    fn an_error_without_id_is_written_with_id_null() {
        let m: TxJsonRpcMessage<RoleServer> =
            JsonRpcMessage::error(ErrorData::invalid_request("x", None), None);
        let v: Value = serde_json::from_slice(&encode(&m).unwrap()).unwrap();
        assert!(v.as_object().unwrap().contains_key("id") && v["id"].is_null());
    }
}
