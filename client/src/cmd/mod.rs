//! sandcellctl's command line (clap's derive API) and its dispatch: [`Args`] holds the global
//! options and one subcommand; each subcommand's arguments and code live in its own module:
//!
//! - [`run`]: `run`, `exec`, `submit`, `attach`, `cell-status` (cells; [`follow`] prints a
//!   followed cell's output and result)
//! - [`session`]: `open`, `close`, `inspect`, `interrupt`, `list --own` (one's own sessions
//!   over the Varlink socket)
//! - [`files`]: `put`, `get`, and `run --put` / `run --artifacts`
//! - [`environments`]: `environments`, and the language an environment implies
//! - [`admin`]: the D-Bus commands `list`, `status`, `terminate`, `reload`, and `interrupt`
//!   of another user's session
//! - [`mcp`]: `mcp`, the MCP server ([`crate::mcp`])
//! - [`kernel`]: `kernel`, a Jupyter kernel ([`crate::jupyter`])
//! - [`completions`]: `completions SHELL`
//!
//! A command returns its exit status or a [`Failure`], which [`crate::report`] renders.

pub mod admin;
pub mod completions;
pub mod environments;
pub mod files;
pub mod follow;
pub mod kernel;
pub mod mcp;
pub mod run;
pub mod session;

use crate::report::{self, Failure};
use clap::{Parser, Subcommand};
use sandcell_client::Client;
use std::path::PathBuf;
use std::process::ExitCode;

/// Run Python and R code cells through sandcelld.
#[derive(Debug, Parser)]
#[command(
    name = "sandcellctl",
    version,
    about = "Run Python and R code cells through sandcelld"
)]
pub struct Args {
    /// Socket of sandcelld [env: SANDCELL_SOCKET; default /run/sandcell/org.sandcell.Kernel].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print frames (and D-Bus listings) as JSON instead of plain output.
    #[arg(long, global = true)]
    json: bool,
    /// D-Bus commands: let polkit ask for a password (needs a polkit agent, e.g. pkttyagent).
    #[arg(long, global = true)]
    interactive: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The subcommands, in the order `--help` lists them.
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run FILE (or - for stdin) in a fresh sandbox, streaming its output.
    Run(run::Run),
    /// Upload FILE into SESSION's directory as NAME (default: FILE's file name).
    Put(files::Put),
    /// Download NAME from SESSION's directory into OUT (default: NAME's file name; - for
    /// standard output).
    Get(files::Get),
    /// Open a detached session that lives IDLE seconds without cells; prints its id.
    Open(session::Open),
    /// Run FILE (or -) as the next cell of SESSION.
    Exec(run::Exec),
    /// Start FILE (or -) as the next cell of SESSION without waiting for it; prints the cell
    /// number. The cell runs on without a client; its output is retained for `attach`.
    Submit(run::Submit),
    /// Follow CELL of SESSION: the output retained so far, then live output and the result
    /// (exit status as for `exec`). A newer attach to the cell ends this one.
    Attach(run::Attach),
    /// Print CELL's state without waiting: running, its result status (ok, error, ...) with
    /// the counts of output retained and dropped, or lost.
    CellStatus(run::CellStatus),
    /// Interrupt CELL of SESSION; without CELL, whatever cell SESSION is running. Over the
    /// Varlink socket for one's own sessions; without CELL, a session the socket does not
    /// show (another user's, for an administrator) is interrupted over D-Bus.
    Interrupt(session::Interrupt),
    /// List the environments the daemon serves: name, language, engine, default, ready,
    /// interpreter version, installed packages.
    Environments(environments::Environments),
    /// List SESSION's variables between cells: name, type, approximate size, shape and a
    /// short repr (escaped like every cell-derived string). Not a cell: cell numbers and
    /// history stay as they were.
    Inspect(session::Inspect),
    /// Close SESSION.
    Close(session::Close),
    /// List live sessions (D-Bus): id, language, owner uid and pid, state, start, cells, memory,
    /// egress requests allowed/refused.
    /// With --own, or when the system bus is unreachable, list one's own sessions over the
    /// Varlink socket instead: id, language, state, running cell, cells, start, detached.
    List(admin::List),
    /// Show daemon-wide figures (D-Bus): version, cgroup mode, Landlock ABI, admission use,
    /// warm pools per language.
    Status,
    /// End SESSION, whoever owns it (D-Bus; polkit: manage-own-sessions or manage-sessions).
    Terminate(admin::Terminate),
    /// Make sandcelld re-read its configuration (D-Bus; polkit: org.sandcell.reload).
    Reload,
    /// Serve the Model Context Protocol on standard input and output (JSON-RPC lines), for
    /// agents that launch tools as a subprocess: run code, sessions, files, plots; see
    /// docs/mcp.md. Sessions opened through it end when it ends unless opened detached.
    Mcp,
    /// Serve as a Jupyter kernel on the sockets of a connection file (as Jupyter starts it
    /// from a kernelspec): cells run in one sandcell session of the kernel's environment.
    #[command(
        after_help = "--json and --interactive have no effect here: a kernel speaks only the \
                      Jupyter messaging protocol, and asks polkit nothing."
    )]
    Kernel(kernel::Kernel),
    /// Print the completion script for SHELL (bash, zsh, fish, elvish or powershell) on
    /// standard output; the packages install those for bash, zsh and fish.
    Completions(completions::Completions),
}

/// What every command may use: the global options.
pub struct Ctx {
    /// The Varlink socket (`--socket`, else `$SANDCELL_SOCKET`, else the system's).
    pub socket: PathBuf,
    /// `--json`: frames, listings and errors as JSON.
    pub json: bool,
    /// `--interactive`: polkit may ask for a password (D-Bus commands).
    pub interactive: bool,
}

impl Ctx {
    /// Connects to the Varlink socket.
    pub async fn connect(&self) -> Result<Client, sandcell_client::Error> {
        Client::connect(&self.socket).await
    }
}

/// What a command returns: its exit status, or a failure for [`report::fail`].
pub type Outcome = Result<u8, Failure>;

/// Runs the command `args` names; returns sandcellctl's exit status.
pub async fn dispatch(args: Args) -> ExitCode {
    let ctx = Ctx {
        socket: args.socket.unwrap_or_else(sandcell_client::default_socket),
        json: args.json,
        interactive: args.interactive,
    };
    let outcome = match args.cmd {
        Cmd::Run(a) => a.run(&ctx).await,
        Cmd::Put(a) => a.run(&ctx).await,
        Cmd::Get(a) => a.run(&ctx).await,
        Cmd::Open(a) => a.run(&ctx).await,
        Cmd::Exec(a) => a.run(&ctx).await,
        Cmd::Submit(a) => a.run(&ctx).await,
        Cmd::Attach(a) => a.run(&ctx).await,
        Cmd::CellStatus(a) => a.run(&ctx).await,
        Cmd::Interrupt(a) => a.run(&ctx).await,
        Cmd::Environments(a) => a.run(&ctx).await,
        Cmd::Inspect(a) => a.run(&ctx).await,
        Cmd::Close(a) => a.run(&ctx).await,
        Cmd::List(a) => a.run(&ctx).await,
        Cmd::Status => admin::status(&ctx).await,
        Cmd::Terminate(a) => a.run(&ctx).await,
        Cmd::Reload => admin::reload(&ctx).await,
        Cmd::Mcp => mcp::run(&ctx).await,
        Cmd::Kernel(a) => a.run(&ctx).await,
        Cmd::Completions(a) => a.run(),
    };
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(e) => report::fail(e, ctx.json),
    }
}

/// The `clap` command, for [`completions`].
fn command() -> clap::Command {
    <Args as clap::CommandFactory>::command()
}
