//! `Complete` and `Help` of an idle session: one request to the worker and its one answer,
//! bounded in time and bytes as `Inspect` is (see `sandcell_proto::query`).
//!
//! Refused while a cell runs (`SessionBusy`): the answer would come from the interpreter
//! the cell occupies, and computing it runs the user's code (attribute lookups, R methods)
//! beside the cell. Nothing of it is a cell: no cell number, nothing in history, no output.

use super::{
    Actor, Command, Ending, INTERRUPT_REPEAT, InspectRefused, InterruptReply,
    KILL_AFTER_SIGINT_MIN, REPLY_BYTES_PER_WAKE, Session, SessionState, describe_exit, kind,
    new_nonce,
};
use crate::worker::Fill;
use sandcell_proto::kernel::{EndReason, InterruptReason};
use sandcell_proto::query::{self, CompleteReply, HelpReply};
use sandcell_proto::worker::{self as wire, RequestHeader, WorkerMessage};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

/// What an editor asks between cells (already validated by the caller).
#[derive(Debug, Clone)]
pub enum Query {
    /// Matches at `cursor` (characters) of `code`.
    Complete {
        /// The code, at most `max_source_bytes`.
        code: String,
        /// The cursor, at most the code's length in characters.
        cursor: u64,
    },
    /// Help for the name at `cursor` of `code`, at `detail` 0 or 1.
    Help {
        /// The code, at most `max_source_bytes`.
        code: String,
        /// The cursor, at most the code's length in characters.
        cursor: u64,
        /// 0 or 1.
        detail: u64,
    },
}

/// The worker's checked answer to a [`Query`].
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// To [`Query::Complete`].
    Completions(CompleteReply),
    /// To [`Query::Help`].
    Help(HelpReply),
}

/// Reply channel of a [`Command::Query`].
pub type QueryReply = oneshot::Sender<Result<Answer, InspectRefused>>;

impl Session {
    /// Asks the idle session's worker `q` (see the module documentation). Refused while a cell
    /// runs ([`InspectRefused::Busy`]); a worker that breaks the protocol or does not answer
    /// in time ends the session ([`InspectRefused::Failed`]).
    pub async fn query(&self, q: Query) -> Result<Answer, InspectRefused> {
        {
            let info = self.info.lock().unwrap();
            match info.state {
                SessionState::Running => {
                    return Err(InspectRefused::Busy(info.running_cell.unwrap_or(0)));
                }
                SessionState::Ended => return Err(InspectRefused::Ended),
                SessionState::Idle => {}
            }
        }
        let (tx, rx) = oneshot::channel();
        self.cmds
            .send(Command::Query {
                query: q,
                reply: tx,
            })
            .await
            .map_err(|_| InspectRefused::Ended)?;
        rx.await.unwrap_or(Err(InspectRefused::Ended))
    }
}

impl Actor {
    /// Answers a [`Command::Query`] of the idle session, as [`Actor::inspect`] answers an
    /// `Inspect`: a `complete` or `help` request (fresh nonce, the worker's budget
    /// [`query::QUERY_BUDGET_MS`]), then the worker's one answer, checked before it is
    /// passed on. Commands are served meanwhile (Close ends the wait; an Execute is deferred;
    /// another query or Inspect is refused as busy). No answer after
    /// [`query::QUERY_DEADLINE_MS`]: SIGINT, repeated; none after the kill grace too, any
    /// other line, or the worker's exit: the session ends (returns `Some((reason, close
    /// waiter))`).
    pub(super) async fn query(
        &mut self,
        q: Query,
        reply: QueryReply,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let what = match q {
            Query::Complete { .. } => "Complete",
            Query::Help { .. } => "Help",
        };
        if let Err(why) = self.drain_stale() {
            return refuse(what, reply, why);
        }
        let nonce = match new_nonce() {
            Ok(n) => n,
            Err(e) => return refuse(what, reply, format!("no random nonce for the request: {e}")),
        };
        let (code, cursor) = match &q {
            Query::Complete { code, cursor } | Query::Help { code, cursor, .. } => {
                (code.as_bytes(), *cursor)
            }
        };
        let code_chars = query::char_len(&String::from_utf8_lossy(code));
        let mut header = RequestHeader::exec(0, code.len() as u64);
        match &q {
            Query::Complete { .. } => {
                header.op = wire::Op::Complete;
                header.max_items = Some(query::COMPLETE_MAX_MATCHES as u64);
            }
            Query::Help { detail, .. } => {
                header.op = wire::Op::Help;
                header.detail = Some(*detail);
            }
        }
        header.timeout_ms = Some(query::QUERY_BUDGET_MS);
        header.cursor = Some(cursor);
        header.nonce = Some(nonce.clone());
        let mut request = header.to_line().into_bytes();
        request.extend_from_slice(code);
        let deadline = Duration::from_millis(query::QUERY_DEADLINE_MS);
        self.ask_worker(what, request, deadline, reply, cmds, |line| {
            check_answer(line, &nonce, &q, code_chars)
        })
        .await
    }

    /// Asks the idle worker one question (`what`: `Inspect`, `Complete`, `Help`): writes
    /// `request`, then serves commands while it waits for the worker's one answer line, which
    /// `check` turns into the answer sent on `reply` (or into why the line breaks the
    /// protocol). Close ends the wait; an Execute is deferred; Interrupt finds no cell;
    /// another question is refused as busy. No answer after `deadline`: SIGINT, repeated
    /// every [`INTERRUPT_REPEAT`]; none after the kill grace too, a line `check` refuses, or
    /// the worker's exit: the session ends (returns `Some((reason, close waiter))`, as
    /// [`Actor::execute_cell`] does).
    pub(super) async fn ask_worker<T>(
        &mut self,
        what: &'static str,
        request: Vec<u8>,
        deadline: Duration,
        reply: oneshot::Sender<Result<T, InspectRefused>>,
        cmds: &mut mpsc::Receiver<Command>,
        mut check: impl FnMut(&[u8]) -> Result<T, String>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let grace = self.session.limits.grace.max(KILL_AFTER_SIGINT_MIN);
        let t0 = tokio::time::Instant::now();
        match tokio::time::timeout(deadline + grace, self.requests.write_all(&request)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return refuse(what, reply, format!("writing the request: {e}")),
            Err(_) => return refuse(what, reply, "writing the request timed out".into()),
        }
        drop(request);
        let mut interrupted = false;
        let mut next_signal = t0 + deadline;
        let kill_at = t0 + deadline + grace;
        loop {
            let step: Option<Result<T, String>> = tokio::select! {
                biased;
                cmd = cmds.recv() => match cmd {
                    Some(Command::Interrupt { reply, .. }) => {
                        let _ = reply.send(InterruptReply {
                            delivered: false,
                            reason: InterruptReason::NotRunning.into(),
                        });
                        None
                    }
                    Some(Command::Inspect { reply, .. }) => {
                        let _ = reply.send(Err(InspectRefused::Busy(0)));
                        None
                    }
                    Some(Command::Query { reply, .. }) => {
                        let _ = reply.send(Err(InspectRefused::Busy(0)));
                        None
                    }
                    Some(Command::HostReply { reply, .. }) => {
                        let _ = reply.send(false);
                        None
                    }
                    Some(cmd @ Command::Execute { .. }) => {
                        self.deferred = Some(cmd);
                        None
                    }
                    Some(Command::HandOver { done }) => {
                        let _ = done.send(());
                        None
                    }
                    Some(Command::Close { reason, done }) => {
                        let _ = reply.send(Err(InspectRefused::Ended));
                        return Some((reason, Some(done)));
                    }
                    None => {
                        let _ = reply.send(Err(InspectRefused::Ended));
                        return Some((Ending::new(EndReason::Disconnected, "abandoned"), None));
                    }
                },
                _ = tokio::time::sleep_until(kill_at) => {
                    Some(Err(format!("the worker did not answer within {} ms", (deadline + grace).as_millis())))
                }
                _ = tokio::time::sleep_until(next_signal) => {
                    // R and native Python turn it into placeholders and answer; Eryx ends the
                    // guest call (the instance is rebuilt from its snapshot before the next cell).
                    self.signal_interrupt();
                    if !interrupted {
                        tracing::info!(session = %self.session.id, what, "no answer in time, interrupting the worker");
                    }
                    interrupted = true;
                    next_signal = tokio::time::Instant::now() + INTERRUPT_REPEAT;
                    None
                }
                () = self.replies.readable() => self.answer_line(&mut check),
                status = self.child.wait() => Some(Err(match status {
                    Ok(st) => format!("the worker {} during {what}", describe_exit(st)),
                    Err(e) => format!("the worker exited during {what} ({e})"),
                })),
            };
            match step {
                None => {}
                Some(Ok(a)) => {
                    let _ = reply.send(Ok(a));
                    return None;
                }
                Some(Err(why)) => {
                    tracing::warn!(session = %self.session.id, what, why, "the session ends");
                    return refuse(what, reply, why);
                }
            }
        }
    }

    /// Reads the reply pipe while a question waits (at most [`REPLY_BYTES_PER_WAKE`] bytes per
    /// call; the first complete line decides, through `check`): the answer, or why the worker
    /// broke the protocol; `None` while no complete line is there.
    fn answer_line<T>(
        &mut self,
        check: &mut impl FnMut(&[u8]) -> Result<T, String>,
    ) -> Option<Result<T, String>> {
        let mut bytes = 0usize;
        loop {
            match self.replies.take_line() {
                Ok(Some(line)) => return Some(check(&line)),
                Ok(None) if bytes >= REPLY_BYTES_PER_WAKE => break,
                Ok(None) => match self.replies.try_fill() {
                    Ok(Fill::Read(n)) => bytes += n,
                    Ok(Fill::Empty) => break,
                    Ok(Fill::Eof) => return Some(Err("worker closed its reply pipe".into())),
                    Err(e) => return Some(Err(format!("protocol violation: {e}"))),
                },
                Err(e) => return Some(Err(format!("protocol violation: {e}"))),
            }
        }
        None
    }
}

/// Refuses a question (`what`) the worker failed: `reply` gets [`InspectRefused::Failed`]
/// with `why`, and the session ends as a crashed worker (`Some((reason, no close waiter))`).
pub(super) fn refuse<T>(
    what: &str,
    reply: oneshot::Sender<Result<T, InspectRefused>>,
    why: String,
) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
    let _ = reply.send(Err(InspectRefused::Failed(why.clone())));
    Some((
        Ending::new(EndReason::WorkerCrashed, format!("{what}: {why}")),
        None,
    ))
}

/// The answer to `q` in a worker's reply `line`, or why the line breaks the protocol: the
/// frame that answers `q`'s kind, with the request's `nonce`, within the bounds of
/// [`query::check_completions`] or [`query::check_help`].
fn check_answer(line: &[u8], nonce: &str, q: &Query, code_chars: u64) -> Result<Answer, String> {
    let violation = |why: String| format!("protocol violation: {why}");
    match (WorkerMessage::parse(line).map_err(violation)?, q) {
        (WorkerMessage::Completions { nonce: n, reply }, Query::Complete { cursor, .. }) => {
            if n.as_deref() != Some(nonce) {
                return Err(violation("completions without the request's nonce".into()));
            }
            query::check_completions(&reply, code_chars, *cursor).map_err(violation)?;
            Ok(Answer::Completions(reply))
        }
        (WorkerMessage::Help { nonce: n, reply }, Query::Help { .. }) => {
            if n.as_deref() != Some(nonce) {
                return Err(violation("help without the request's nonce".into()));
            }
            query::check_help(&reply).map_err(violation)?;
            Ok(Answer::Help(reply))
        }
        (other, _) => Err(violation(format!(
            "{} while a completion or help was answered",
            kind(&other)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_checked_against_their_request() {
        let nonce = "0123456789abcdef";
        let complete = Query::Complete {
            code: "import o".into(),
            cursor: 8,
        };
        let help = Query::Help {
            code: "print".into(),
            cursor: 5,
            detail: 0,
        };
        let good = WorkerMessage::Completions {
            nonce: Some(nonce.into()),
            reply: CompleteReply {
                matches: vec!["os".into()],
                cursor_start: 7,
                cursor_end: 8,
                truncated: false,
            },
        }
        .to_line();
        let line = &good[..good.len() - 1];
        assert!(check_answer(line, nonce, &complete, 8).is_ok());
        // Another nonce, another kind of question, a range past the code.
        assert!(check_answer(line, "fedcba9876543210", &complete, 8).is_err());
        assert!(check_answer(line, nonce, &help, 5).is_err());
        assert!(check_answer(line, nonce, &complete, 7).is_err());
        let mut data = serde_json::Map::new();
        data.insert("text/plain".into(), "print(...)".into());
        let h = WorkerMessage::Help {
            nonce: Some(nonce.into()),
            reply: HelpReply { found: true, data },
        }
        .to_line();
        assert!(check_answer(&h[..h.len() - 1], nonce, &help, 5).is_ok());
        assert!(
            check_answer(
                b"{\"t\":\"ready\",\"language\":\"r\",\"engine\":\"R\"}",
                nonce,
                &help,
                5
            )
            .is_err()
        );
    }
}
