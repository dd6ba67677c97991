//! `sandcellctl`: run code through sandcelld from the shell. See sandcellctl(1).
//!
//! Exit status of `run` and `exec`: 0 ok; 1 the cell raised an error; 2 usage or connection
//! problem; 3 the daemon refused the call (a named error, printed); 4 timeout; 5 interrupted
//! or cancelled; 6 out of memory or fuel (memory_exhausted, oom, fuel_exhausted); 7 worker
//! crashed; 10 the cell exited the interpreter (`sys.exit`, `quit`); 130 after a second
//! Ctrl-C.
//!
//! Administration over D-Bus (`list`, `status`, `terminate`, `interrupt SESSION` without a
//! cell, `reload`) talks to `org.sandcell.Sandcell1` on the system bus
//! (`$DBUS_SYSTEM_BUS_ADDRESS` honoured); polkit decides inside sandcelld. Exit status: 0 ok;
//! 1 the interrupt was not delivered; 2 bus unreachable; 3 the daemon refused (error name
//! printed, e.g. `org.sandcell.Sandcell1.PermissionDenied`).
//!
//! The command line and one module per command are in [`cmd`]; errors become what a person
//! or `--json` reads in [`report`]; every line sandcellctl writes goes through [`out`].

#[macro_use]
mod out;
mod cmd;
mod ctrlc;
mod dbus;
mod hostcmd;
mod jupyter;
mod mcp;
mod progress;
mod report;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match <cmd::Args as clap::Parser>::try_parse() {
        Ok(args) => cmd::dispatch(args).await,
        Err(e) => usage_error(e),
    }
}

/// A command line clap refused: `--help` and `--version` as clap prints them; with `--json`
/// anywhere on the line, one JSON object on standard error,
/// `{"error": "sandcell.client.Usage", "message": SENTENCE}` and status 2, as every other
/// failure under `--json`; else clap's own message (status 2).
fn usage_error(e: clap::Error) -> std::process::ExitCode {
    use clap::error::ErrorKind;
    let json = std::env::args_os().any(|a| a == "--json");
    if !json || matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit();
    }
    let text = e.render().to_string();
    let message = text
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_owned();
    errln!(
        "{}",
        serde_json::json!({"error": "sandcell.client.Usage", "message": message})
    );
    std::process::ExitCode::from(2)
}
