//! `Complete` and `Help`: what an editor asks a session between cells, on both wires.
//!
//! Neither is a cell: no cell number, nothing recorded in history, no output to the client.
//! The daemon refuses both while a cell runs (`SessionBusy`), as it does `Inspect`: the
//! interpreter is single-threaded, and answering from it while a cell runs would mean
//! running the user's code (attribute lookups, R's `.DollarNames` methods) beside the cell.
//!
//! Positions are in Unicode code points (characters) of `code`, as the Jupyter messaging
//! protocol counts `cursor_pos` since version 5.2
//! (<https://jupyter-client.readthedocs.io/en/stable/messaging.html#cursor-pos-unicode-note>).
//!
//! Worker side (see [`crate::worker`]): `complete 0 <len> timeout_ms=T cursor=C max_items=N
//! nonce=X` and `help 0 <len> timeout_ms=T cursor=C detail=D nonce=X`, each followed by the
//! code (`len` bytes of UTF-8), answered by exactly one `completions` or `help` line echoing the
//! nonce. The daemon checks every field of the answer with [`check_completions`] and
//! [`check_help`]; an answer out of bounds is a protocol violation like any other.

use serde::{Deserialize, Serialize};

/// Most matches one `Complete` returns; a worker lists at most this many and says `truncated`.
pub const COMPLETE_MAX_MATCHES: usize = 500;

/// Longest match, bytes; a worker leaves longer ones out (and says `truncated`).
pub const MAX_MATCH_BYTES: usize = 256;

/// Most bytes of the `help` bundle's JSON text (`data`); a worker cuts its text to
/// [`HELP_TEXT_BYTES`] first, which escaped (at most 6 bytes a byte) stays under it.
pub const MAX_HELP_BYTES: usize = 512 * 1024;

const _: () = assert!(HELP_TEXT_BYTES * crate::worker::JSON_ESCAPE_FACTOR + 4096 <= MAX_HELP_BYTES);
const _: () = assert!(MAX_HELP_BYTES + 4096 <= crate::worker::MAX_WORKER_LINE);

/// Most bytes of `text/plain` (and of any other text type) a worker puts in a `help` bundle; a
/// longer text is cut on a character boundary and ends with `... [cut]`.
pub const HELP_TEXT_BYTES: usize = 64 * 1024;

/// Time a worker gives the user's code a completion or help may call (attribute lookups,
/// `__getattr__`, `__dir__`, R `.DollarNames` methods, docstring properties), milliseconds
/// (`timeout_ms` of the request); past it the worker answers with what it has (no matches, or
/// `found: false`).
pub const QUERY_BUDGET_MS: u64 = 2000;

/// When the daemon interrupts a worker that has not answered a `complete` or `help` (SIGINT,
/// as for a cell), milliseconds after the request; it ends the session (`WorkerFailed`) if no
/// answer comes within the session's kill grace after that.
pub const QUERY_DEADLINE_MS: u64 = 3000;

/// Highest `detail` of `Help` (Jupyter's `detail_level`: 0 the signature and docstring, 1 also
/// the source where the engine has it).
pub const HELP_MAX_DETAIL: u64 = 1;

/// Parameters of `Complete`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteParams {
    /// Session id.
    pub session: String,
    /// The code around the cursor (the whole cell in Jupyter), at most `max_source_bytes`.
    pub code: String,
    /// Position of the cursor in `code`, characters (0 to its length); absent: its end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<u64>,
}

/// Reply of `Complete`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompleteReply {
    /// Replacements of `code[cursor_start..cursor_end]`, at most [`COMPLETE_MAX_MATCHES`], each
    /// at most [`MAX_MATCH_BYTES`].
    pub matches: Vec<String>,
    /// Start of the replaced range, characters.
    pub cursor_start: u64,
    /// End of the replaced range, characters (the cursor).
    pub cursor_end: u64,
    /// More matches exist than are listed.
    pub truncated: bool,
}

/// Parameters of `Help`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HelpParams {
    /// Session id.
    pub session: String,
    /// The code around the cursor, at most `max_source_bytes`.
    pub code: String,
    /// Position of the cursor in `code`, characters; absent: its end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<u64>,
    /// 0 (default) or 1 ([`HELP_MAX_DETAIL`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<u64>,
}

/// Reply of `Help`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelpReply {
    /// Whether a name was found at the cursor.
    pub found: bool,
    /// A MIME bundle (`text/plain` always; empty text when not found), at most
    /// [`MAX_HELP_BYTES`] of JSON, each text at most [`HELP_TEXT_BYTES`] (plus a cut marker).
    pub data: serde_json::Map<String, serde_json::Value>,
}

/// The characters of `code`, as a count for cursors.
pub fn char_len(code: &str) -> u64 {
    code.chars().count() as u64
}

/// Checks a worker's `completions` answer against the bounds above and against `code_chars`
/// (the request's code length in characters) and its cursor. Errors: what is out of bounds.
pub fn check_completions(
    reply: &CompleteReply,
    code_chars: u64,
    cursor: u64,
) -> Result<(), String> {
    if reply.matches.len() > COMPLETE_MAX_MATCHES {
        return Err(format!("{} matches", reply.matches.len()));
    }
    if reply.matches.iter().any(|m| m.len() > MAX_MATCH_BYTES) {
        return Err("a match longer than its bound".into());
    }
    if reply.cursor_start > reply.cursor_end || reply.cursor_end > code_chars {
        return Err(format!(
            "range {}..{} outside the code's {code_chars} characters",
            reply.cursor_start, reply.cursor_end
        ));
    }
    if reply.cursor_start > cursor {
        return Err("range starting after the cursor".into());
    }
    Ok(())
}

/// Checks a worker's `help` bundle (as [`crate::kernel::check_display_data`] does, and at
/// most [`MAX_HELP_BYTES`]). Errors: what is wrong.
pub fn check_help(reply: &HelpReply) -> Result<(), String> {
    let n = crate::kernel::check_display_data(&reply.data)?;
    if n > MAX_HELP_BYTES {
        return Err(format!("help bundle of {n} bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_are_checked() {
        let ok = CompleteReply {
            matches: vec!["os".into()],
            cursor_start: 7,
            cursor_end: 8,
            truncated: false,
        };
        assert_eq!(check_completions(&ok, 8, 8), Ok(()));
        let too_many = CompleteReply {
            matches: vec!["x".into(); COMPLETE_MAX_MATCHES + 1],
            ..ok.clone()
        };
        assert!(check_completions(&too_many, 8, 8).is_err());
        let long = CompleteReply {
            matches: vec!["x".repeat(MAX_MATCH_BYTES + 1)],
            ..ok.clone()
        };
        assert!(check_completions(&long, 8, 8).is_err());
        let past = CompleteReply {
            cursor_end: 9,
            ..ok.clone()
        };
        assert!(check_completions(&past, 8, 8).is_err());
        let reversed = CompleteReply {
            cursor_start: 8,
            cursor_end: 7,
            ..ok.clone()
        };
        assert!(check_completions(&reversed, 8, 8).is_err());
        assert!(check_completions(&ok, 8, 6).is_err());
        assert_eq!(char_len("é✓x"), 3);
    }

    #[test]
    fn worker_requests_and_answers_round_trip() {
        use crate::worker::{Op, RequestHeader, WorkerMessage};
        let mut h = RequestHeader::exec(0, 8);
        h.op = Op::Complete;
        h.timeout_ms = Some(QUERY_BUDGET_MS);
        h.cursor = Some(u64::MAX);
        h.max_items = Some(COMPLETE_MAX_MATCHES as u64);
        h.nonce = Some("0123456789abcdef".into());
        let line = h.to_line();
        assert_eq!(
            line,
            "complete 0 8 timeout_ms=2000 max_items=500 cursor=18446744073709551615 nonce=0123456789abcdef\n"
        );
        assert!(line.len() <= crate::worker::MAX_HEADER_LINE);
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);
        h.op = Op::Help;
        h.max_items = None;
        h.detail = Some(1);
        let line = h.to_line();
        assert!(line.starts_with("help 0 8 "), "{line}");
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);

        let m = WorkerMessage::Completions {
            nonce: h.nonce.clone(),
            reply: CompleteReply {
                matches: vec!["os".into(), "oct".into()],
                cursor_start: 7,
                cursor_end: 8,
                truncated: true,
            },
        };
        let line = m.to_line();
        assert!(
            String::from_utf8_lossy(&line).starts_with(r#"{"t":"completions","nonce":"#),
            "{}",
            String::from_utf8_lossy(&line)
        );
        assert_eq!(WorkerMessage::parse(&line[..line.len() - 1]).unwrap(), m);
        let mut data = serde_json::Map::new();
        data.insert("text/plain".into(), "print(...)".into());
        let m = WorkerMessage::Help {
            nonce: None,
            reply: HelpReply { found: true, data },
        };
        let line = m.to_line();
        assert_eq!(WorkerMessage::parse(&line[..line.len() - 1]).unwrap(), m);
        // The R worker writes its fields in another order; a missing field is malformed.
        assert!(WorkerMessage::parse(br#"{"t":"completions","matches":[]}"#).is_err());
        assert!(
            WorkerMessage::parse(
                br#"{"truncated":false,"cursor_end":1,"cursor_start":0,"matches":["a"],"t":"completions"}"#
            )
            .is_ok()
        );
    }

    #[test]
    fn help_is_checked() {
        let mut data = serde_json::Map::new();
        data.insert("text/plain".into(), "print(...)".into());
        assert_eq!(
            check_help(&HelpReply {
                found: true,
                data: data.clone()
            }),
            Ok(())
        );
        data.insert("text/plain".into(), "x".repeat(MAX_HELP_BYTES).into());
        assert!(
            check_help(&HelpReply {
                found: true,
                data: data.clone()
            })
            .is_err()
        );
        assert!(
            check_help(&HelpReply {
                found: false,
                data: serde_json::Map::new()
            })
            .is_err()
        );
    }
}
