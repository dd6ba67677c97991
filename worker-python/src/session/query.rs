//! `complete` and `help` in the Eryx engine: the driver's `query` (see `driver.py`, "Complete
//! and Help") runs as one execution that is not a cell, and its one answer is bounded here
//! before it leaves (see `sandcell_proto::query`).

use super::{EryxError, INSPECT_SLACK, PySession};
use crate::driver;
use sandcell_proto::query::{self, CompleteReply, HelpReply};
use sandcell_proto::worker::{Op, RequestHeader, WorkerMessage};
use std::time::Duration;

/// Most bytes of the driver's answer read from the guest.
const MAX_ANSWER_BYTES: usize = 2 * sandcell_proto::query::MAX_HELP_BYTES;

impl PySession {
    /// Answers a `complete` or `help` request (`header.op`) for `code`: the driver's answer,
    /// checked and bounded, or an empty answer when the guest gave none in time (the
    /// instance is then dead and the next cell rebuilds it from its snapshot, as after an
    /// `inspect` that outlived its limit). Not a cell: nothing is snapshotted, no output
    /// is forwarded.
    pub async fn query(&mut self, header: &RequestHeader, code: &[u8]) -> WorkerMessage {
        let text = String::from_utf8_lossy(code);
        let chars = query::char_len(&text);
        let cursor = header.cursor.unwrap_or(chars).min(chars);
        let budget = Duration::from_millis(
            header
                .timeout_ms
                .unwrap_or(query::QUERY_BUDGET_MS)
                .min(query::QUERY_BUDGET_MS),
        );
        let complete = header.op == Op::Complete;
        let empty = || {
            if complete {
                WorkerMessage::Completions {
                    nonce: header.nonce.clone(),
                    reply: CompleteReply {
                        matches: Vec::new(),
                        cursor_start: cursor,
                        cursor_end: cursor,
                        truncated: false,
                    },
                }
            } else {
                let mut data = serde_json::Map::new();
                data.insert("text/plain".into(), "".into());
                WorkerMessage::Help {
                    nonce: header.nonce.clone(),
                    reply: HelpReply { found: false, data },
                }
            }
        };
        self.finish_cell().await;
        if self.dead {
            return empty();
        }
        let (op, arg) = if complete {
            (
                "complete",
                header
                    .max_items
                    .unwrap_or(query::COMPLETE_MAX_MATCHES as u64)
                    .clamp(1, query::COMPLETE_MAX_MATCHES as u64),
            )
        } else {
            (
                "help",
                header.detail.unwrap_or(0).min(query::HELP_MAX_DETAIL),
            )
        };
        let source = driver::query_code(op, code, cursor, arg, budget.as_millis() as u64);
        let mut retried = false;
        loop {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            self.session
                .set_execution_timeout(Some(budget + INSPECT_SLACK));
            let r = self
                .session
                .execute(&source)
                .with_output_streaming(tx)
                .run()
                .await;
            let mut answer: Option<Vec<u8>> = None;
            while let Ok(req) = rx.try_recv() {
                if req.stream == driver::QUERY_STREAM && req.data.len() <= MAX_ANSWER_BYTES {
                    answer = Some(req.data);
                }
            }
            match &r {
                Ok(_) => {}
                Err(EryxError::PythonException(text)) => {
                    if answer.is_none() && !retried && driver::driver_missing(text) {
                        retried = true;
                        if self.install().await.is_ok() {
                            continue;
                        }
                    }
                }
                Err(_) => self.dead = true,
            }
            let Some(answer) = answer else {
                return empty();
            };
            return if complete {
                match serde_json::from_slice::<CompleteReply>(&answer) {
                    Ok(mut reply) => {
                        reply.matches.retain(|m| m.len() <= query::MAX_MATCH_BYTES);
                        if reply.matches.len() > query::COMPLETE_MAX_MATCHES {
                            reply.matches.truncate(query::COMPLETE_MAX_MATCHES);
                            reply.truncated = true;
                        }
                        if query::check_completions(&reply, chars, cursor).is_err() {
                            return empty();
                        }
                        WorkerMessage::Completions {
                            nonce: header.nonce.clone(),
                            reply,
                        }
                    }
                    Err(_) => empty(),
                }
            } else {
                match serde_json::from_slice::<HelpReply>(&answer) {
                    Ok(reply) if query::check_help(&reply).is_ok() => WorkerMessage::Help {
                        nonce: header.nonce.clone(),
                        reply,
                    },
                    _ => empty(),
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_call_names_the_drivers_entry() {
        assert_eq!(
            driver::query_code("complete", b"import o", 8, 500, 2000),
            "__sandcell__.query('complete','aW1wb3J0IG8=',8,500,2000)\n"
        );
        assert!(driver::DRIVER_SOURCE.contains("_run_here.query = _query_here"));
        assert!(driver::DRIVER_SOURCE.contains("QUERY_STREAM = 12"));
    }
}
