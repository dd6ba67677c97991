//! The Jupyter wire format (messaging protocol 5.3,
//! <https://jupyter-client.readthedocs.io/en/stable/messaging.html#the-wire-protocol>): a
//! ZeroMQ multipart message of routing identities, the delimiter `<IDS|MSG>`, the HMAC
//! signature (lower-case hex), the header, parent header, metadata and content (JSON), then
//! binary buffers.
//!
//! Bounds: at most [`MAX_FRAMES`] frames, each at most [`MAX_FRAME_BYTES`], in all at most
//! [`MAX_MESSAGE_BYTES`]; a message outside them, without its delimiter or parts, with a bad
//! signature, with a signature already seen (a replay) or with a header that is not a JSON
//! object is refused with a [`WireError`] (the kernel logs it and never answers it: it has no
//! verified request to answer, and a message over the bounds is not even read far enough to
//! verify its signature). A signed message with a valid header whose parent header, metadata
//! or content is not a JSON object is accepted with [`Message::invalid`] set, so the kernel
//! can answer it with an error reply instead of leaving its client waiting.
//!
//! Replays: the signatures of the last [`DIGEST_HISTORY_SIZE`] accepted messages are kept
//! (as jupyter_client's `Session.digest_history`, `jupyter_client/session.py`, whose
//! `deserialize` refuses a "Duplicate Signature"); when the history is over its size, the
//! oldest tenth is dropped (jupyter_client drops a random tenth). A message signed with the
//! key is unique by its header's `msg_id` and `date`, so a repeated signature is a captured
//! message sent again.

use bytes::Bytes;
use hmac::{Hmac, KeyInit, Mac};
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::Sha256;
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

/// Most frames one message may have (identities, delimiter, five parts and buffers).
pub const MAX_FRAMES: usize = 64;
/// Largest frame, bytes.
pub const MAX_FRAME_BYTES: usize = 32 << 20;
/// Largest message (all frames together), bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// The delimiter frame between routing identities and the signature.
pub const DELIMITER: &[u8] = b"<IDS|MSG>";
/// Signatures of accepted messages kept to refuse replays (jupyter_client's default
/// `Session.digest_history_size`, 2^16); 32 bytes each.
pub const DIGEST_HISTORY_SIZE: usize = 1 << 16;
/// Protocol version this kernel speaks.
pub const PROTOCOL_VERSION: &str = "5.3";

/// Why a received message was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// More than [`MAX_FRAMES`] frames.
    #[error("{count} frames (at most {max})")]
    TooManyFrames {
        /// Frames received.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A frame over [`MAX_FRAME_BYTES`] or a message over [`MAX_MESSAGE_BYTES`].
    #[error("{bytes} bytes in a frame or message (at most {max})")]
    TooLarge {
        /// Bytes received.
        bytes: usize,
        /// The bound.
        max: usize,
    },
    /// No `<IDS|MSG>` delimiter, or fewer than five frames after it.
    #[error("not a Jupyter message: {0}")]
    Malformed(&'static str),
    /// The signature does not match the connection file's key.
    #[error("bad signature")]
    BadSignature,
    /// The header is not a JSON object.
    #[error("the {part} is not a JSON object")]
    NotJson {
        /// Which part.
        part: &'static str,
    },
    /// The signature is one of a message accepted before: a captured message sent again.
    #[error("duplicate signature (a replayed message)")]
    Replayed,
}

/// The signatures (raw HMAC bytes) of the last [`DIGEST_HISTORY_SIZE`] accepted messages, in
/// arrival order.
#[derive(Default)]
struct DigestHistory {
    seen: HashSet<Vec<u8>>,
    order: VecDeque<Vec<u8>>,
}

impl DigestHistory {
    /// Records `digest`; `false` when it was already there.
    fn insert(&mut self, digest: Vec<u8>, cap: usize) -> bool {
        if !self.seen.insert(digest.clone()) {
            return false;
        }
        self.order.push_back(digest);
        if self.order.len() > cap {
            let cull = (self.order.len() / 10).max(self.order.len() - cap);
            for d in self.order.drain(..cull) {
                self.seen.remove(&d);
            }
        }
        true
    }
}

/// HMAC-SHA256 signing with the connection file's key; an empty key signs nothing (the
/// signature frame is empty and not checked), as the protocol allows.
/// Clones share one replay history (see the module's documentation).
#[derive(Clone)]
pub struct Signer {
    mac: Option<Hmac<Sha256>>,
    history: Arc<Mutex<DigestHistory>>,
    history_size: usize,
}

impl Signer {
    /// A signer for `key` (the connection file's `key`, used as bytes). `scheme` must be
    /// `hmac-sha256` (the only scheme Jupyter uses); other schemes are an error.
    pub fn new(key: &str, scheme: &str) -> Result<Signer, String> {
        let history = Arc::new(Mutex::new(DigestHistory::default()));
        if key.is_empty() {
            return Ok(Signer {
                mac: None,
                history,
                history_size: DIGEST_HISTORY_SIZE,
            });
        }
        if scheme != "hmac-sha256" {
            return Err(format!(
                "signature scheme {scheme:?} is not supported (only hmac-sha256)"
            ));
        }
        let mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).map_err(|e| e.to_string())?;
        Ok(Signer {
            mac: Some(mac),
            history,
            history_size: DIGEST_HISTORY_SIZE,
        })
    }

    /// Records the signature (hex) of an accepted message; `false` when it was seen before
    /// (a replay). Without a key nothing is signed and nothing is recorded.
    fn remember(&self, signature: &[u8]) -> bool {
        if self.mac.is_none() {
            return true;
        }
        // Decoded, so that the same signature in upper-case hex is the same.
        let Ok(raw) = hex::decode(signature) else {
            return false;
        };
        self.history
            .lock()
            .expect("digest history lock")
            .insert(raw, self.history_size)
    }

    /// The lower-case hex signature of the four JSON parts, or `""` without a key.
    pub fn sign(&self, parts: &[&[u8]; 4]) -> String {
        let Some(mac) = &self.mac else {
            return String::new();
        };
        let mut m = mac.clone();
        for p in parts {
            m.update(p);
        }
        hex::encode(m.finalize().into_bytes())
    }

    /// Whether `signature` (hex) is right for `parts` (compared in constant time).
    pub fn verify(&self, signature: &[u8], parts: &[&[u8]; 4]) -> bool {
        let Some(mac) = &self.mac else {
            return true;
        };
        let Ok(sig) = hex::decode(signature) else {
            return false;
        };
        let mut m = mac.clone();
        for p in parts {
            m.update(p);
        }
        m.verify_slice(&sig).is_ok()
    }
}

/// One received message.
#[derive(Debug, Clone)]
pub struct Message {
    /// Routing identities (ROUTER sockets), echoed on the reply.
    pub identities: Vec<Bytes>,
    /// Header: `msg_id`, `session`, `username`, `date`, `msg_type`, `version`.
    pub header: Map<String, Value>,
    /// Content (empty when [`Message::invalid`] is set).
    pub content: Map<String, Value>,
    /// Why the parent header, metadata or content cannot be used (not JSON, not an object),
    /// e.g. `the content is not valid JSON (lone leading surrogate in hex escape at line 1
    /// column 17)`; the header is valid and the signature right, so the kernel answers it
    /// with an error reply.
    pub invalid: Option<String>,
    /// Bytes of all its frames.
    pub bytes: usize,
}

impl Message {
    /// The header's `msg_type` (`""` when absent).
    pub fn msg_type(&self) -> &str {
        self.header
            .get("msg_type")
            .and_then(Value::as_str)
            .unwrap_or("")
    }
}

/// `b` as a JSON object, or why not (`the content is not valid JSON (...)`, `the content is
/// not a JSON object (an array)`).
fn object(part: &str, b: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(b) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(v) => {
            let kind = match v {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                _ => "an array",
            };
            Err(format!("the {part} is not a JSON object ({kind})"))
        }
        Err(e) => Err(format!("the {part} is not valid JSON ({e})")),
    }
}

/// Parses and verifies one multipart message (see the module's bounds).
pub fn parse(frames: &[Bytes], signer: &Signer) -> Result<Message, WireError> {
    if frames.len() > MAX_FRAMES {
        return Err(WireError::TooManyFrames {
            count: frames.len(),
            max: MAX_FRAMES,
        });
    }
    let mut total = 0usize;
    for f in frames {
        if f.len() > MAX_FRAME_BYTES {
            return Err(WireError::TooLarge {
                bytes: f.len(),
                max: MAX_FRAME_BYTES,
            });
        }
        total += f.len();
    }
    if total > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLarge {
            bytes: total,
            max: MAX_MESSAGE_BYTES,
        });
    }
    let d = frames
        .iter()
        .position(|f| f.as_ref() == DELIMITER)
        .ok_or(WireError::Malformed("no <IDS|MSG> delimiter"))?;
    let rest = &frames[d + 1..];
    if rest.len() < 5 {
        return Err(WireError::Malformed(
            "fewer than five frames after <IDS|MSG>",
        ));
    }
    let parts = [&rest[1][..], &rest[2][..], &rest[3][..], &rest[4][..]];
    if !signer.verify(&rest[0], &parts) {
        return Err(WireError::BadSignature);
    }
    if !signer.remember(&rest[0]) {
        return Err(WireError::Replayed);
    }
    let header = object("header", parts[0]).map_err(|_| WireError::NotJson { part: "header" })?;
    let checked = object("parent header", parts[1])
        .and_then(|_| object("metadata", parts[2]))
        .and_then(|_| object("content", parts[3]));
    let (content, invalid) = match checked {
        Ok(c) => (c, None),
        Err(why) => (Map::new(), Some(why)),
    };
    Ok(Message {
        identities: frames[..d].to_vec(),
        header,
        content,
        invalid,
        bytes: total,
    })
}

/// A new header for a message of `msg_type` in kernel session `session`.
pub fn header(msg_type: &str, session: &str) -> Value {
    serde_json::json!({
        "msg_id": uuid::Uuid::new_v4().to_string(),
        "session": session,
        "username": "sandcell",
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "msg_type": msg_type,
        "version": PROTOCOL_VERSION,
    })
}

/// The frames of a message: `identities`, the delimiter, the signature and the four parts.
pub fn frames(
    signer: &Signer,
    identities: &[Bytes],
    header: &Value,
    parent: &Value,
    content: &Value,
) -> Vec<Bytes> {
    let h = serde_json::to_vec(header).expect("JSON serialises");
    let p = serde_json::to_vec(parent).expect("JSON serialises");
    let m = b"{}".to_vec();
    let c = serde_json::to_vec(content).expect("JSON serialises");
    let sig = signer.sign(&[&h, &p, &m, &c]);
    let mut out = identities.to_vec();
    out.push(Bytes::from_static(DELIMITER));
    out.push(Bytes::from(sig));
    out.extend([h, p, m, c].map(Bytes::from));
    out
}

/// The connection file Jupyter writes for a kernel
/// (<https://jupyter-client.readthedocs.io/en/stable/kernels.html#connection-files>).
#[derive(Debug, Clone, Deserialize)]
pub struct ConnectionInfo {
    /// `tcp` (addresses `ip:port`) or `ipc` (Unix sockets at the paths `ip-port`, as
    /// jupyter_client names them for `KernelManager(transport="ipc")`).
    #[serde(default = "tcp")]
    pub transport: String,
    /// Address to bind, e.g. `127.0.0.1`.
    pub ip: String,
    /// Shell ROUTER port.
    pub shell_port: u16,
    /// IOPub PUB port.
    pub iopub_port: u16,
    /// Stdin ROUTER port.
    pub stdin_port: u16,
    /// Control ROUTER port.
    pub control_port: u16,
    /// Heartbeat REP port.
    pub hb_port: u16,
    /// HMAC key (empty: unsigned).
    #[serde(default)]
    pub key: String,
    /// `hmac-sha256`.
    #[serde(default = "sha256")]
    pub signature_scheme: String,
}

fn tcp() -> String {
    "tcp".into()
}

fn sha256() -> String {
    "hmac-sha256".into()
}

impl ConnectionInfo {
    /// The endpoint of `port`, e.g. `tcp://127.0.0.1:5555`, or for `ipc`
    /// `ipc:///run/user/1000/jupyter/kernel-1-ipc-5` (`ip` is the path's prefix).
    pub fn endpoint(&self, port: u16) -> String {
        if self.transport == "ipc" {
            format!("ipc://{}-{port}", self.ip)
        } else if self.ip.contains(':') {
            format!("{}://[{}]:{port}", self.transport, self.ip)
        } else {
            format!("{}://{}:{port}", self.transport, self.ip)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_jupyter_client_for_tcp_ipv6_and_ipc() {
        let info = |transport: &str, ip: &str| -> ConnectionInfo {
            serde_json::from_value(serde_json::json!({
                "transport": transport, "ip": ip, "shell_port": 1, "iopub_port": 2,
                "stdin_port": 3, "control_port": 4, "hb_port": 5,
            }))
            .unwrap()
        };
        assert_eq!(
            info("tcp", "127.0.0.1").endpoint(5555),
            "tcp://127.0.0.1:5555"
        );
        assert_eq!(info("tcp", "::1").endpoint(5555), "tcp://[::1]:5555");
        assert_eq!(
            info("ipc", "/run/user/1000/kernel-ipc").endpoint(3),
            "ipc:///run/user/1000/kernel-ipc-3"
        );
    }

    fn msg(signer: &Signer, msg_type: &str) -> Vec<Bytes> {
        frames(
            signer,
            &[Bytes::from_static(b"peer")],
            &header(msg_type, "s"),
            &serde_json::json!({}),
            &serde_json::json!({"code": "1"}),
        )
    }

    #[test]
    fn a_signed_message_round_trips() {
        let s = Signer::new("secret", "hmac-sha256").unwrap();
        let m = parse(&msg(&s, "execute_request"), &s).unwrap();
        assert_eq!(m.msg_type(), "execute_request");
        assert_eq!(m.identities, vec![Bytes::from_static(b"peer")]);
        assert_eq!(m.content["code"], "1");
    }

    #[test]
    fn a_forged_signature_is_refused() {
        let s = Signer::new("secret", "hmac-sha256").unwrap();
        let forger = Signer::new("guess", "hmac-sha256").unwrap();
        assert_eq!(
            parse(&msg(&forger, "execute_request"), &s).unwrap_err(),
            WireError::BadSignature
        );
        // A right signature over other content: the content was changed in transit.
        let mut f = msg(&s, "execute_request");
        let n = f.len();
        f[n - 1] = Bytes::from_static(b"{\"code\": \"import os\"}");
        assert_eq!(parse(&f, &s).unwrap_err(), WireError::BadSignature);
        // No signature at all, and one that is not hex.
        let mut f = msg(&s, "execute_request");
        f[2] = Bytes::new();
        assert_eq!(parse(&f, &s).unwrap_err(), WireError::BadSignature);
        f[2] = Bytes::from_static(b"zz");
        assert_eq!(parse(&f, &s).unwrap_err(), WireError::BadSignature);
    }

    #[test]
    fn hostile_framing_is_bounded() {
        let s = Signer::new("k", "hmac-sha256").unwrap();
        let mut f = msg(&s, "kernel_info_request");
        let ids: Vec<Bytes> = (0..MAX_FRAMES).map(|_| Bytes::from_static(b"x")).collect();
        f.splice(0..0, ids);
        assert_eq!(
            parse(&f, &s).unwrap_err(),
            WireError::TooManyFrames {
                count: MAX_FRAMES + 7,
                max: MAX_FRAMES
            }
        );
        let mut f = msg(&s, "kernel_info_request");
        f.push(Bytes::from(vec![0u8; MAX_FRAME_BYTES + 1]));
        assert!(matches!(
            parse(&f, &s).unwrap_err(),
            WireError::TooLarge { .. }
        ));
        let mut f = msg(&s, "kernel_info_request");
        for _ in 0..3 {
            f.push(Bytes::from(vec![0u8; MAX_FRAME_BYTES]));
        }
        assert!(matches!(
            parse(&f, &s).unwrap_err(),
            WireError::TooLarge {
                max: MAX_MESSAGE_BYTES,
                ..
            }
        ));
        assert!(matches!(
            parse(&[Bytes::from_static(b"a")], &s).unwrap_err(),
            WireError::Malformed(_)
        ));
        let f = msg(&s, "x");
        assert!(matches!(
            parse(&f[..5], &s).unwrap_err(),
            WireError::Malformed(_)
        ));
    }

    #[test]
    fn parts_must_be_objects() {
        let s = Signer::new("k", "hmac-sha256").unwrap();
        let h = b"[]".to_vec();
        let sig = s.sign(&[&h, b"{}", b"{}", b"{}"]);
        let f: Vec<Bytes> = vec![
            Bytes::from_static(DELIMITER),
            Bytes::from(sig),
            Bytes::from(h),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
        ];
        assert_eq!(
            parse(&f, &s).unwrap_err(),
            WireError::NotJson { part: "header" }
        );
    }

    /// A signed message whose header is valid and whose content is not a JSON object.
    fn with_content(s: &Signer, content: &[u8]) -> Vec<Bytes> {
        let h = serde_json::to_vec(&header("complete_request", "s")).unwrap();
        let sig = s.sign(&[&h, b"{}", b"{}", content]);
        vec![
            Bytes::from_static(DELIMITER),
            Bytes::from(sig),
            Bytes::from(h),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::copy_from_slice(content),
        ]
    }

    #[test]
    fn signed_but_unusable_content_is_kept_to_be_answered() {
        let s = Signer::new("k", "hmac-sha256").unwrap();
        // A lone surrogate (Python's json accepts it; JSON text cannot carry it as UTF-8).
        let m = parse(&with_content(&s, br#"{"code": "\ud800"}"#), &s).unwrap();
        assert_eq!(m.msg_type(), "complete_request");
        let why = m.invalid.unwrap();
        assert!(why.starts_with("the content is not valid JSON ("), "{why}");
        assert!(m.content.is_empty());
        for (c, kind) in [
            (&b"[1]"[..], "an array"),
            (b"7", "a number"),
            (b"\"x\"", "a string"),
            (b"null", "null"),
        ] {
            let m = parse(&with_content(&s, c), &s).unwrap();
            assert_eq!(
                m.invalid.as_deref(),
                Some(&*format!("the content is not a JSON object ({kind})"))
            );
        }
        let m = parse(&with_content(&s, b"{}"), &s).unwrap();
        assert_eq!(m.invalid, None);
    }

    #[test]
    fn a_replayed_message_is_refused() {
        let s = Signer::new("secret", "hmac-sha256").unwrap();
        let f = msg(&s, "execute_request");
        parse(&f, &s).unwrap();
        assert_eq!(parse(&f, &s).unwrap_err(), WireError::Replayed);
        // The same signature in upper-case hex is the same signature.
        let mut upper = f.clone();
        upper[2] = Bytes::from(upper[2].to_ascii_uppercase());
        assert_eq!(parse(&upper, &s).unwrap_err(), WireError::Replayed);
        // Clones (the shell and control channels) share the history.
        assert_eq!(parse(&f, &s.clone()).unwrap_err(), WireError::Replayed);
        // A new message (new msg_id and date) is accepted.
        parse(&msg(&s, "execute_request"), &s).unwrap();
        // A forged message is not recorded: it cannot push real signatures out.
        let forger = Signer::new("guess", "hmac-sha256").unwrap();
        let forged = msg(&forger, "execute_request");
        assert_eq!(parse(&forged, &s).unwrap_err(), WireError::BadSignature);
        assert_eq!(s.history.lock().unwrap().order.len(), 2);
        // Without a key nothing is signed, so nothing can be told apart.
        let none = Signer::new("", "hmac-sha256").unwrap();
        let f = msg(&none, "execute_request");
        parse(&f, &none).unwrap();
        parse(&f, &none).unwrap();
    }

    #[test]
    fn the_replay_history_is_bounded_and_drops_the_oldest() {
        let mut s = Signer::new("secret", "hmac-sha256").unwrap();
        s.history_size = 100;
        let sent: Vec<Vec<Bytes>> = (0..101).map(|_| msg(&s, "execute_request")).collect();
        for f in &sent {
            parse(f, &s).unwrap();
        }
        // Over the size by one: the oldest tenth went.
        let h = s.history.lock().unwrap();
        assert_eq!((h.order.len(), h.seen.len()), (91, 91));
        drop(h);
        parse(&sent[0], &s).unwrap();
        assert_eq!(parse(&sent[100], &s).unwrap_err(), WireError::Replayed);
        assert_eq!(parse(&sent[10], &s).unwrap_err(), WireError::Replayed);
    }

    #[test]
    fn other_schemes_are_refused() {
        assert!(Signer::new("k", "hmac-md5").is_err());
        assert!(Signer::new("", "hmac-md5").is_ok());
    }
}
