//! `--host-call-handler CMD`: a cell's host calls answered by a command.
//!
//! For each `host_call` frame, `sh -c CMD` runs with the call on standard input as one JSON
//! object, `{"session": ID, "cell": N, "call": N, "name": NAME, "arguments": {...}}`. Exit
//! status 0: its standard output, a JSON object of at most 256 KiB, is the result returned to
//! the cell. Any other status (or output that is not a JSON object, or too long): the call
//! raises in the cell with the command's standard error (at most 16 KiB, cut beyond) or a
//! sentence saying what was wrong. The answer goes over a second connection to the socket.

use sandcell_client::{Client, Error, HostCall, KernelError};
use sandcell_proto::kernel::{MAX_HOST_CALL_ERROR, MAX_HOST_CALL_RESULT};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Answers host calls with a command (or, without one, refuses them at once).
pub struct HostHandler {
    cmd: Option<String>,
    socket: PathBuf,
    replies: Option<Client>,
}

/// Reads `r` to its end, keeping at most `max` bytes; returns them and whether more came.
fn read_bounded(mut r: impl Read, max: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut more = false;
    let mut buf = [0u8; 16 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = max.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                more |= n > room;
            }
        }
    }
    (kept, more)
}

impl HostHandler {
    /// A handler running `cmd`, answering over a new connection to `socket`.
    pub fn new(cmd: String, socket: PathBuf) -> HostHandler {
        HostHandler {
            cmd: Some(cmd),
            socket,
            replies: None,
        }
    }

    /// A handler without a command, for `exec` without `--host-call-handler`: a host call
    /// of the cell (a session opened with `--host-calls`) raises in the cell at once instead
    /// of waiting for the daemon's `host_call_timeout_seconds`.
    pub fn refusing(socket: PathBuf) -> HostHandler {
        HostHandler {
            cmd: None,
            socket,
            replies: None,
        }
    }

    /// Runs the command for `call` of `session` and returns its answer.
    fn run(&self, session: &str, call: &HostCall) -> Result<Value, String> {
        let Some(cmd) = &self.cmd else {
            return Err("sandcellctl has no handler for host calls (pass \
                        --host-call-handler CMD to exec)"
                .into());
        };
        let input = serde_json::json!({
            "session": session,
            "cell": call.cell,
            "call": call.call,
            "name": call.name,
            "arguments": call.arguments,
        });
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(cmd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("the host call handler could not start: {e}"))?;
        let mut stdin = child.stdin.take().expect("piped");
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(input.to_string().as_bytes());
        });
        let stderr = child.stderr.take().expect("piped");
        let errs = std::thread::spawn(move || read_bounded(stderr, MAX_HOST_CALL_ERROR - 64));
        let (out, out_more) =
            read_bounded(child.stdout.take().expect("piped"), MAX_HOST_CALL_RESULT);
        let status = child.wait();
        let _ = writer.join();
        let (err, err_more) = errs.join().unwrap_or_default();
        let status = status.map_err(|e| format!("waiting for the host call handler: {e}"))?;
        if !status.success() {
            let mut text = String::from_utf8_lossy(&err).trim_end().to_owned();
            if err_more {
                text.push_str(" [cut]");
            }
            if text.is_empty() {
                text = format!("the host call handler failed ({status})");
            }
            return Err(text);
        }
        if out_more {
            return Err(format!(
                "the host call handler printed more than {MAX_HOST_CALL_RESULT} bytes"
            ));
        }
        match serde_json::from_slice::<Value>(&out) {
            Ok(v) if v.is_object() => Ok(v),
            _ => Err("the host call handler printed no JSON object".into()),
        }
    }

    /// Answers `call` of `session`: runs the command and sends its answer. A call that no
    /// longer waits (`NoSuchHostCall`: timed out, interrupted; `SessionEnded` or
    /// `NoSuchSession`: a one-shot run or a session that ended meanwhile) is not an error: the
    /// stream still carries the cell's result, which the caller goes on to read.
    pub async fn answer(&mut self, session: &str, call: &HostCall) -> Result<(), Error> {
        let answer = self.run(session, call);
        if self.replies.is_none() {
            self.replies = Some(Client::connect(&self.socket).await?);
        }
        let c = self.replies.as_mut().expect("connected above");
        match c.host_reply(session, call.call, answer).await {
            Ok(())
            | Err(Error::Kernel(
                KernelError::NoSuchHostCall { .. }
                | KernelError::SessionEnded { .. }
                | KernelError::NoSuchSession { .. },
            )) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
