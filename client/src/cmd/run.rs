//! Running cells: `run` (a fresh sandbox for one cell: a one-shot `Run`, or with `--put` or
//! `--artifacts` a session closed afterwards), `exec` (the next cell of a session), `submit`
//! (start one and leave it running), `attach` (follow a submitted cell again) and
//! `cell-status`. The code is read, and every input looked at, before connecting, so that a
//! missing file is named as such; [`follow`](super::follow) prints the cell.
//!
//! Exit status of `run`, `exec` and `attach`: the cell's ([`follow::exit_for`]); 2 usage or
//! connection problem; 3 the daemon refused the call; 130 after a second Ctrl-C
//! ([`crate::ctrlc`]).

use super::follow::{self, Follow};
use super::{Ctx, Outcome, environments, files};
use crate::ctrlc::{self, Leaving};
use crate::hostcmd::HostHandler;
use crate::out::{self, escape_name};
use sandcell_client::{CellTrack, Client, Error, Limits, OpenParams, Reattach, RunParams};
use std::io::Read;
use std::path::{Path, PathBuf};

/// `run [-l LANGUAGE] [-e NAME] [--wall-time S] [--no-display] [--rich] [--artifacts DIR]
/// [--host-call-handler CMD] [--put FILE[:NAME]]... [--egress HOST]... FILE`.
#[derive(Debug, clap::Args)]
pub struct Run {
    /// python or r; default: the environment's language with --environment, else inferred
    /// from a .R/.r or .py extension, else python.
    #[arg(long, short)]
    language: Option<String>,
    /// The environment to run in (see `sandcellctl environments`); default: the
    /// language's default environment.
    #[arg(long, short, value_name = "NAME")]
    environment: Option<String>,
    /// Lower the wall-time limit of the cell, seconds.
    #[arg(long, value_name = "SECONDS")]
    wall_time: Option<f64>,
    /// Do not show the value of the cell's last expression (print()-only output).
    #[arg(long)]
    no_display: bool,
    /// Rich output: the last expression, display() calls and figures come as MIME
    /// bundles; the terminal shows their text/plain and names the other types they carry
    /// (`--json` prints the whole `display` frames).
    #[arg(long)]
    rich: bool,
    /// Save the files the cell created or changed (plots, cleaned data) into DIR and print
    /// their paths. Runs the cell in a session closed afterwards instead of one-shot.
    #[arg(long, value_name = "DIR")]
    artifacts: Option<PathBuf>,
    /// Let the cell call tools (host calls), each answered by running CMD with `sh -c`:
    /// the call as JSON on its standard input, its standard output (a JSON object) the
    /// result; a nonzero exit raises in the cell with its standard error.
    #[arg(long, value_name = "CMD")]
    host_call_handler: Option<String>,
    /// Upload FILE into the cell's directory first, as NAME (default: FILE's file name);
    /// repeatable. The cell then runs in a session closed afterwards.
    #[arg(long = "put", value_name = "FILE[:NAME]")]
    put: Vec<String>,
    /// Narrow the session's network to HOST, which must be on the environment's egress
    /// allowlist (a name or a `*.domain` wildcard); repeatable. Default: the whole list.
    #[arg(long = "egress", value_name = "HOST")]
    egress: Vec<String>,
    /// The code file, or - for standard input.
    file: PathBuf,
}

impl Run {
    /// Runs the file in a fresh sandbox and follows it; its session ends with the command.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let puts: Vec<(PathBuf, String)> = self.put.iter().map(|p| files::put_spec(p)).collect();
        files::check_uploads(puts.iter().map(|(path, _)| path.as_path()))?;
        let code = read_code(&self.file)?;
        let mut c = ctx.connect().await?;
        let language = environments::language(
            &mut c,
            self.language.clone(),
            self.environment.as_deref(),
            || language_of(&self.file),
        )
        .await;
        let limits = self.wall_time.map(|w| Limits {
            wall_time_seconds: Some(w),
            ..Default::default()
        });
        let mut host = self
            .host_call_handler
            .clone()
            .map(|cmd| HostHandler::new(cmd, ctx.socket.clone()));
        let host_calls = host.is_some().then_some(true);
        let display = self.no_display.then_some(false);
        let rich = self.rich.then_some(true);
        let following = ctrlc::install(ctx.socket.clone(), Leaving::EndsCell);
        let follow = Follow {
            json: ctx.json,
            host: host.as_mut(),
            following: Some(&following),
            announce: false,
            track: None,
        };
        let egress = (!self.egress.is_empty()).then(|| self.egress.clone());
        if self.artifacts.is_none() && puts.is_empty() {
            c.run_with(&RunParams {
                language,
                code,
                limits,
                environment: self.environment,
                host_calls,
                display_last_expression: display,
                rich_output: rich,
                egress: egress.clone(),
            })
            .await?;
            return Ok(follow.status(&mut c).await?);
        }
        // Input files, or a directory that must outlive the result: a session closed
        // afterwards (Open, PutFile..., Execute, Close) instead of a one-shot Run.
        let session = c
            .open_with(&OpenParams {
                language,
                limits,
                detached_idle_seconds: None,
                environment: self.environment,
                host_calls,
                display_last_expression: display,
                rich_output: rich,
                egress: egress.clone(),
            })
            .await?
            .session;
        let ran = in_session(
            &mut c,
            &session,
            &puts,
            &code,
            follow,
            self.artifacts.as_deref(),
        )
        .await;
        let _ = c.close(&session).await;
        Ok(ran?)
    }
}

/// `run` in a session of its own: uploads `puts`, runs `code`, saves the cell's files into
/// `artifacts`; returns the cell's exit status.
async fn in_session(
    c: &mut Client,
    session: &str,
    puts: &[(PathBuf, String)],
    code: &str,
    follow: Follow<'_>,
    artifacts: Option<&Path>,
) -> Result<u8, Error> {
    for (path, name) in puts {
        c.put_file(session, name, path).await?;
    }
    c.execute(session, code).await?;
    let (status, result) = follow.result(c).await?;
    if let Some(dir) = artifacts {
        files::save_artifacts(c, session, &result.files, dir).await?;
    }
    Ok(status)
}

/// The language a code file's name suggests: `r` for a `.R` or `.r` extension, else python.
fn language_of(file: &Path) -> String {
    match file.extension().and_then(|e| e.to_str()) {
        Some("R" | "r") => "r".into(),
        _ => "python".into(),
    }
}

/// `exec SESSION [--host-call-handler CMD] FILE`.
#[derive(Debug, clap::Args)]
pub struct Exec {
    /// Session id from `open`.
    session: String,
    /// Answer the cell's host calls with CMD (as for `run`; the session must have been
    /// opened with `--host-calls`).
    #[arg(long, value_name = "CMD")]
    host_call_handler: Option<String>,
    /// The code file, or -.
    file: PathBuf,
}

impl Exec {
    /// Runs the file as the session's next cell and follows it, naming the cell on standard
    /// error when it starts. Without a command, a host call of the cell is refused at once.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let code = read_code(&self.file)?;
        let mut c = ctx.connect().await?;
        let mut host = match self.host_call_handler {
            Some(cmd) => HostHandler::new(cmd, ctx.socket.clone()),
            None => HostHandler::refusing(ctx.socket.clone()),
        };
        let following = ctrlc::install(ctx.socket.clone(), Leaving::CellRunsOn);
        // With a token: a cut by a daemon restart, even before the cell's number arrived, is
        // followed by sending the same call again, which never runs the code twice.
        let token = sandcell_client::cell_token();
        c.execute_with_token(&self.session, &code, Some(&token))
            .await?;
        let track = CellTrack::executing(Reattach::default(), &self.session, &code, &token);
        let follow = Follow {
            json: ctx.json,
            host: Some(&mut host),
            following: Some(&following),
            announce: true,
            track: Some(track),
        };
        Ok(follow.status(&mut c).await?)
    }
}

/// `submit SESSION FILE`.
#[derive(Debug, clap::Args)]
pub struct Submit {
    /// Session id from `open`.
    session: String,
    /// The code file, or -.
    file: PathBuf,
}

impl Submit {
    /// Starts the cell and prints its number (`--json`: `{"cell": N}`).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let code = read_code(&self.file)?;
        let mut c = ctx.connect().await?;
        let cell = c.submit(&self.session, &code).await?;
        if ctx.json {
            out::json(&serde_json::json!({ "cell": cell }));
        } else {
            outln!("{cell}");
        }
        Ok(0)
    }
}

/// `attach SESSION CELL`.
#[derive(Debug, clap::Args)]
pub struct Attach {
    /// Session id.
    session: String,
    /// Cell number from `submit`.
    cell: u64,
}

impl Attach {
    /// Follows the cell: the output retained so far, then live output and the result.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let mut c = ctx.connect().await?;
        c.attach(&self.session, self.cell).await?;
        let follow = Follow {
            json: ctx.json,
            host: None,
            following: None,
            announce: false,
            track: Some(CellTrack::attached(
                Reattach::default(),
                &self.session,
                self.cell,
            )),
        };
        Ok(follow.status(&mut c).await?)
    }
}

/// `cell-status SESSION CELL`.
#[derive(Debug, clap::Args)]
pub struct CellStatus {
    /// Session id.
    session: String,
    /// Cell number from `submit`.
    cell: u64,
}

impl CellStatus {
    /// Prints the cell's state, and for an ended cell its error and the counts of its
    /// retained output; the exit status of an ended cell is its result's, else 0 (`--json`:
    /// the whole reply, status 0).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let mut c = ctx.connect().await?;
        let r = c.cell_status(&self.session, self.cell).await?;
        if ctx.json {
            out::json(&r);
            return Ok(0);
        }
        outln!("{}", escape_name(&r.state));
        let Some(res) = &r.result else {
            return Ok(0);
        };
        if let Some(e) = &res.error {
            outln!(
                "error: {}: {}",
                escape_name(&e.kind),
                escape_name(&e.message)
            );
        }
        if let Some(kept) = &res.retained {
            let displays = kept.displays.map(|s| ("displays", s));
            for (name, s) in [("stdout", kept.stdout), ("stderr", kept.stderr)]
                .into_iter()
                .chain(displays)
            {
                outln!(
                    "{name}: {} bytes seen, {} retained, {} dropped",
                    s.seen,
                    s.kept,
                    s.dropped
                );
            }
        }
        Ok(follow::exit_for(res.status))
    }
}

/// The code of `run`, `exec` and `submit` (`-`: standard input), read before connecting so
/// that a missing file is named as such.
///
/// Errors: [`Error::File`], `cannot read the code file FILE: ...` (or `... from standard
/// input`).
fn read_code(file: &Path) -> Result<String, Error> {
    let read = if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map(|_| s)
    } else {
        std::fs::read_to_string(file)
    };
    read.map_err(|source| Error::File {
        what: if file.as_os_str() == "-" {
            "cannot read the code from standard input".into()
        } else {
            format!("cannot read the code file {}", file.display())
        },
        source,
    })
}
