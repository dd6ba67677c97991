//! Following a started cell to its result (`run`, `exec`, `attach`): its output on standard
//! output and standard error (escaped on a terminal), its displays, then a summary on
//! standard error (warnings, the files it made, what was dropped or truncated, the error with
//! its traceback and a hint for a missing module), and the exit status its result maps to
//! ([`exit_for`]). With `--json`, every frame as one JSON line instead.

use crate::out::{escape_message, escape_name, for_terminal};
use crate::{ctrlc, hostcmd, progress};
use sandcell_client::{CellResult, CellTrack, Client, Error, FileInfo, Status};
use std::io::Write;

/// How to follow a cell: the printing mode and who else wants to know about it.
pub struct Follow<'a> {
    /// `--json`: frames as JSON lines, no human summary.
    pub json: bool,
    /// Answers the cell's host calls; `None`: the cell makes none (the daemon refuses them).
    pub host: Option<&'a mut hostcmd::HostHandler>,
    /// Learns the cell from its `started` frame, for Ctrl-C.
    pub following: Option<&'a ctrlc::Following>,
    /// `exec`: print the cell's number on standard error when it starts.
    pub announce: bool,
    /// `exec`, `attach`: follow the cell again when a daemon restart cuts the call
    /// ([`Client::next_frame_following`]); `None`: a cut is reported.
    pub track: Option<CellTrack>,
}

/// The exit status for a cell's result status: 0 ok; 1 error; 4 timeout; 5 interrupted or
/// cancelled; 6 out of memory or fuel; 7 worker crashed; 10 the cell exited the interpreter.
pub fn exit_for(status: Status) -> u8 {
    match status {
        Status::Ok => 0,
        Status::Error => 1,
        Status::Timeout => 4,
        Status::Interrupted | Status::Cancelled => 5,
        Status::MemoryExhausted | Status::Oom | Status::FuelExhausted => 6,
        Status::WorkerCrashed => 7,
        Status::Exited => 10,
    }
}

/// How many of a cell's files [`list_files`] names; the rest are counted.
const FILES_LISTED: usize = 20;

/// Tells the user on standard error which files the cell created or changed (a plot's name is
/// otherwise visible only with `--json`): one line per file, `sandcellctl: file NAME (SIZE
/// bytes, MEDIA TYPE)`, at most [`FILES_LISTED`] lines and then a count. Names are escaped as
/// every name is ([`escape_name`]).
fn list_files(err: &mut impl Write, files: &[FileInfo]) {
    for f in files.iter().take(FILES_LISTED) {
        let _ = writeln!(
            err,
            "sandcellctl: file {} ({} bytes, {})",
            escape_name(&f.name),
            f.size,
            escape_name(&f.media_type)
        );
    }
    if files.len() > FILES_LISTED {
        let _ = writeln!(
            err,
            "sandcellctl: and {} more files",
            files.len() - FILES_LISTED
        );
    }
}

impl Follow<'_> {
    /// Follows the started cell on `c` to its result, printing its output; returns the exit
    /// status ([`exit_for`]) and the result. With `announce`, the cell's number is printed on
    /// standard error when it starts (`sandcellctl: cell N started; interrupt it with:
    /// sandcellctl interrupt SESSION N`). On a terminal, a silent cell shows its elapsed time
    /// ([`progress`]).
    ///
    /// Errors: the connection's, and a host call's answer that could not be sent.
    pub async fn result(mut self, c: &mut Client) -> Result<(u8, CellResult), Error> {
        let out_tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
        let err_tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let mut out = std::io::stdout();
        let mut err = std::io::stderr();
        let mut session = String::new();
        let progress = progress::Progress::start(err_tty && !self.json);
        let mut reattached = 0;
        loop {
            let f = match &mut self.track {
                Some(t) => {
                    let f = c.next_frame_following(t).await?;
                    if t.reattached() > reattached {
                        reattached = t.reattached();
                        if !self.json {
                            let _ = writeln!(
                                err,
                                "sandcellctl: sandcelld restarted; following the cell again"
                            );
                        }
                    }
                    f
                }
                None => c.next_frame().await?,
            };
            progress.output();
            if let Some(s) = &f.started {
                session = s.session.clone();
                progress.started(s.cell);
                self.started(&mut err, &s.session, s.cell);
            }
            if let (Some(h), Some(call)) = (self.host.as_deref_mut(), &f.host_call) {
                h.answer(&session, call).await?;
            }
            if self.json {
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::to_string(&f).expect("frames serialise")
                );
                let _ = out.flush();
            }
            if let Some(o) = &f.output
                && !self.json
            {
                match o.stream {
                    sandcell_proto::kernel::Stream::Stdout => {
                        let _ = out.write_all(for_terminal(&o.text, out_tty).as_bytes());
                        let _ = out.flush();
                    }
                    sandcell_proto::kernel::Stream::Stderr => {
                        let _ = err.write_all(for_terminal(&o.text, err_tty).as_bytes());
                    }
                }
            }
            if let Some(d) = &f.display
                && !self.json
            {
                display(&mut out, &mut err, d, out_tty);
            }
            if let Some(r) = f.result {
                if !self.json {
                    summary(&mut err, c, &r).await;
                }
                return Ok((exit_for(r.status), r));
            }
        }
    }

    /// Follows the started cell to its result; returns the exit status ([`Follow::result`]).
    pub async fn status(self, c: &mut Client) -> Result<u8, Error> {
        self.result(c).await.map(|(code, _)| code)
    }

    /// The `started` frame: tells Ctrl-C which cell runs, and with `announce` the user.
    fn started(&self, err: &mut impl Write, session: &str, cell: u64) {
        if let Some(f) = self.following {
            f.started(session, cell);
        }
        if self.announce && !self.json {
            let _ = writeln!(
                err,
                "sandcellctl: cell {cell} started; interrupt it with: sandcellctl interrupt {} {cell}",
                escape_name(session),
            );
        }
    }
}

/// A `display` frame: its text/plain on standard output; on standard error the other types
/// it carries (shown with `--json`) and its note.
fn display(
    out: &mut impl Write,
    err: &mut impl Write,
    d: &sandcell_proto::kernel::Display,
    out_tty: bool,
) {
    let text = d
        .data
        .get("text/plain")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let _ = writeln!(out, "{}", for_terminal(text, out_tty));
    let _ = out.flush();
    let others: Vec<&str> = d
        .data
        .keys()
        .map(String::as_str)
        .filter(|t| *t != "text/plain")
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            err,
            "sandcellctl: {} also carries {} (see --json)",
            d.kind.as_str(),
            others.join(", ")
        );
    }
    if let Some(note) = &d.note {
        let _ = writeln!(err, "sandcellctl: {}", escape_message(note));
    }
}

/// The human summary of a result on standard error: warnings, the files, what a detached
/// cell's streams dropped; for a cell that did not end `ok`, the traceback and one line
/// `sandcellctl: cell N STATUS: KIND: MESSAGE` (sandcellctl's own lines escape what the cell
/// chose the same way on a terminal and a pipe) and, for a missing module, the environment
/// that has it; truncated streams.
async fn summary(err: &mut impl Write, c: &mut Client, r: &CellResult) {
    for w in &r.warnings {
        let _ = writeln!(err, "sandcellctl: warning: {}", escape_message(w));
    }
    list_files(err, &r.files);
    if let Some(kept) = &r.retained {
        let displays = kept.displays.map(|s| ("displays", s));
        for (name, s) in [("stdout", kept.stdout), ("stderr", kept.stderr)]
            .into_iter()
            .chain(displays)
        {
            if s.dropped > 0 {
                let _ = writeln!(
                    err,
                    "sandcellctl: {name}: {} of {} bytes retained while detached, {} dropped",
                    s.kept, s.seen, s.dropped
                );
            }
        }
    }
    if r.status == Status::Ok {
        for (name, s) in [("stdout", r.stdout), ("stderr", r.stderr)] {
            if s.truncated {
                let _ = writeln!(
                    err,
                    "sandcellctl: {name} truncated: kept {} of {} bytes",
                    s.kept, s.seen
                );
            }
        }
        return;
    }
    let mut line = format!("sandcellctl: cell {} {}", r.cell, r.status.as_str());
    if let Some(e) = &r.error {
        line.push_str(&format!(
            ": {}: {}",
            escape_message(&e.kind),
            escape_message(&e.message)
        ));
        if let Some(tb) = &e.traceback {
            let _ = writeln!(err, "{}", escape_message(tb));
        }
    }
    if let Some(code) = r.exit_code {
        line.push_str(&format!(" (exit code {code})"));
    }
    for (name, s) in [("stdout", r.stdout), ("stderr", r.stderr)] {
        if s.truncated {
            line.push_str(&format!(
                "; {name} truncated: kept {} of {} bytes",
                s.kept, s.seen
            ));
        }
    }
    let _ = writeln!(err, "{line}");
    if let Some(module) = r
        .error
        .as_ref()
        .and_then(|e| sandcell_client::human::missing_module(&e.kind, &e.message))
        && let Ok(envs) = c.list_environments().await
        && let Some(hint) = sandcell_client::human::module_hint(&module, &envs, "python")
    {
        let _ = writeln!(err, "sandcellctl: hint: {}", escape_message(&hint));
    }
}
