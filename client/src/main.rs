//! `sandcellctl`: run code through sandcelld from the shell. See sandcellctl(1).
//!
//! Exit status of `run` and `exec`: 0 ok; 1 the cell raised an error; 2 usage or connection
//! problem; 3 the daemon refused the call (a named error, printed); 4 timeout; 5 interrupted
//! or cancelled; 6 out of memory or fuel (memory_exhausted, oom, fuel_exhausted); 7 worker
//! crashed; 10 the cell exited the interpreter (`sys.exit`, `quit`).
//!
//! Administration over D-Bus (`list`, `status`, `terminate`, `interrupt SESSION` without a
//! cell, `reload`) talks to `org.sandcell.Sandcell1` on the system bus
//! (`$DBUS_SYSTEM_BUS_ADDRESS` honoured); polkit decides inside sandcelld. Exit status: 0 ok;
//! 1 the interrupt was not delivered; 2 bus unreachable; 3 the daemon refused (error name
//! printed, e.g. `org.sandcell.Sandcell1.PermissionDenied`).

use clap::{CommandFactory, Parser, Subcommand};

/// `println!` that never panics: when standard output is a closed pipe (`sandcellctl
/// environments --packages | head`), sandcellctl ends quietly with status 0 (the reader took
/// what it wanted); another write error is reported and ends it with status 2.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($t)*) {
            $crate::output_failed(e)
        }
    }};
}

/// `eprintln!` that never panics (a closed standard error is ignored).
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod ctrlc;
mod dbus;
mod hostcmd;
mod mcp;
mod progress;
use sandcell_client::{Client, Error, KernelError, Limits, Status};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

/// Run Python and R code cells through sandcelld.
#[derive(Debug, Parser)]
#[command(
    name = "sandcellctl",
    version,
    about = "Run Python and R code cells through sandcelld"
)]
struct Args {
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

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run FILE (or - for stdin) in a fresh sandbox, streaming its output.
    Run {
        /// python or r; inferred from a .R/.r or .py extension, else python.
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
        /// The code file, or - for standard input.
        file: PathBuf,
    },
    /// Upload FILE into SESSION's directory as NAME (default: FILE's file name).
    Put {
        /// Session id.
        session: String,
        /// Local file (passed to the daemon as a descriptor).
        file: PathBuf,
        /// Relative path in the session directory.
        name: Option<String>,
    },
    /// Download NAME from SESSION's directory into OUT (default: NAME's file name; - for
    /// standard output).
    Get {
        /// Session id.
        session: String,
        /// Relative path in the session directory.
        name: String,
        /// Where to write.
        out: Option<PathBuf>,
    },
    /// Open a detached session that lives IDLE seconds without cells; prints its id.
    Open {
        /// python or r.
        #[arg(long, short, default_value = "python")]
        language: String,
        /// The environment (see `sandcellctl environments`); default: the language's default
        /// environment.
        #[arg(long, short, value_name = "NAME")]
        environment: Option<String>,
        /// Idle lifetime in seconds.
        #[arg(long, default_value_t = 600)]
        idle: u64,
        /// Let the session's cells call tools (answer them with `exec --host-call-handler`).
        #[arg(long)]
        host_calls: bool,
        /// No cell of the session shows its last expression's value (print()-only output).
        #[arg(long)]
        no_display: bool,
    },
    /// Run FILE (or -) as the next cell of SESSION.
    Exec {
        /// Session id from `open`.
        session: String,
        /// Answer the cell's host calls with CMD (as for `run`; the session must have been
        /// opened with `--host-calls`).
        #[arg(long, value_name = "CMD")]
        host_call_handler: Option<String>,
        /// The code file, or -.
        file: PathBuf,
    },
    /// Start FILE (or -) as the next cell of SESSION without waiting for it; prints the cell
    /// number. The cell runs on without a client; its output is retained for `attach`.
    Submit {
        /// Session id from `open`.
        session: String,
        /// The code file, or -.
        file: PathBuf,
    },
    /// Follow CELL of SESSION: the output retained so far, then live output and the result
    /// (exit status as for `exec`). A newer attach to the cell ends this one.
    Attach {
        /// Session id.
        session: String,
        /// Cell number from `submit`.
        cell: u64,
    },
    /// Print CELL's state without waiting: running, its result status (ok, error, ...) with
    /// the counts of output retained and dropped, or lost.
    CellStatus {
        /// Session id.
        session: String,
        /// Cell number from `submit`.
        cell: u64,
    },
    /// Interrupt CELL of SESSION; without CELL, whatever cell SESSION is running. Over the
    /// Varlink socket for one's own sessions; without CELL, a session the socket does not
    /// show (another user's, for an administrator) is interrupted over D-Bus.
    Interrupt {
        /// Session id.
        session: String,
        /// Cell number (`exec` prints it when the cell starts); omit for the running cell.
        cell: Option<u64>,
    },
    /// List the environments the daemon serves: name, language, engine, default, ready,
    /// interpreter version, installed packages.
    Environments {
        /// Also print every environment's installed packages with their versions.
        #[arg(long)]
        packages: bool,
    },
    /// List SESSION's variables between cells: name, type, approximate size, shape and a
    /// short repr (escaped like every cell-derived string). Not a cell: cell numbers and
    /// history stay as they were.
    Inspect {
        /// Session id.
        session: String,
        /// List at most N variables (1 to 1000; the daemon's default is 100).
        #[arg(long, value_name = "N")]
        max_items: Option<u64>,
    },
    /// Close SESSION.
    Close {
        /// Session id.
        session: String,
    },
    /// List live sessions (D-Bus): id, language, owner uid and pid, state, start, cells, memory.
    /// With --own, or when the system bus is unreachable, list one's own sessions over the
    /// Varlink socket instead: id, language, state, running cell, cells, start, detached.
    List {
        /// List one's own sessions over the Varlink socket (no D-Bus needed).
        #[arg(long)]
        own: bool,
    },
    /// Show daemon-wide figures (D-Bus): version, cgroup mode, Landlock ABI, admission use,
    /// warm pools per language.
    Status,
    /// End SESSION, whoever owns it (D-Bus; polkit: manage-own-sessions or manage-sessions).
    Terminate {
        /// Session id.
        session: String,
    },
    /// Make sandcelld re-read its configuration (D-Bus; polkit: org.sandcell.reload).
    Reload,
    /// Serve the Model Context Protocol on standard input and output (JSON-RPC lines), for
    /// agents that launch tools as a subprocess: run code, sessions, files, plots; see
    /// docs/mcp.md. Sessions opened through it end when it ends unless opened detached.
    Mcp,
    /// Print the completion script for SHELL (bash, zsh, fish, elvish or powershell) on
    /// standard output; the packages install those for bash, zsh and fish.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// The default limits of an environment, as `environments` prints them under its row: one
/// line per cell, one per session, each value with its sandcelld.toml key.
fn limit_lines(l: &sandcell_client::EnvironmentLimits) -> [String; 2] {
    let mut cell = format!(
        "per cell: wall time {} s [execution_wall_time_seconds]",
        l.wall_time_seconds
    );
    if let Some(f) = l.fuel {
        cell.push_str(&format!(", fuel {f} WebAssembly instructions [max_fuel]"));
    }
    cell.push_str(&format!(
        ", output kept {} stdout / {} stderr [max_stdout_bytes, max_stderr_bytes]",
        dbus::human_bytes(Some(l.stdout_bytes)),
        dbus::human_bytes(Some(l.stderr_bytes))
    ));
    let mut session = format!(
        "per session: memory {} [max_worker_memory_bytes]",
        dbus::human_bytes(Some(l.memory_bytes))
    );
    if let Some(g) = l.guest_memory_bytes {
        session.push_str(&format!(
            ", interpreter memory {} [max_guest_memory_bytes]",
            dbus::human_bytes(Some(g))
        ));
    }
    let cpus = if l.cpus > 0.0 {
        format!("{} CPU", l.cpus)
    } else {
        "no CPU cap".into()
    };
    session.push_str(&format!(
        ", disk {} [max_session_files_bytes], one file {} [max_file_bytes], {cpus} [worker_cpus], detached idle at most {} s [max_detached_idle_seconds]",
        dbus::human_bytes(Some(l.disk_bytes)),
        dbus::human_bytes(Some(l.file_bytes)),
        l.detached_idle_seconds
    ));
    [cell, session]
}

/// Ends sandcellctl after a failed write to standard output: quietly (status 0) for a closed
/// pipe, else with a message (status 2).
fn output_failed(e: std::io::Error) -> ! {
    if e.kind() != std::io::ErrorKind::BrokenPipe {
        errln!("sandcellctl: writing to standard output: {e}");
        std::process::exit(2);
    }
    std::process::exit(0);
}

/// Runs a D-Bus subcommand; `None` if `cmd` is a Varlink one.
async fn admin(cmd: &Cmd, json: bool, interactive: bool) -> Option<ExitCode> {
    match cmd {
        Cmd::List { own: false } | Cmd::Status | Cmd::Terminate { .. } | Cmd::Reload => {}
        Cmd::Interrupt { cell: None, .. } => {}
        _ => return None,
    }
    let r: Result<u8, dbus::Error> = async {
        let a = dbus::Admin::connect(interactive).await?;
        match cmd {
            Cmd::List { .. } => {
                let rows = a.list().await?;
                if json {
                    outln!("{}", serde_json::to_string(&rows).expect("serialises"));
                } else {
                    // Columns as wide as their widest entry: node-qualified ids are longer
                    // than 32 characters.
                    let width = |f: &dyn Fn(&dbus::SessionInfo) -> String, min: usize| {
                        rows.iter()
                            .map(|s| f(s).chars().count())
                            .fold(min, usize::max)
                    };
                    let idw = width(&|s| escape_name(&s.id), "SESSION".len());
                    let lw = width(&|s| escape_name(&s.language), "LANGUAGE".len());
                    let sw = width(&|s| escape_name(&s.state), "STATE".len());
                    outln!(
                        "{:<idw$} {:<lw$} {:>6} {:>8} {:<sw$} {:<20} {:>6} {:>10}",
                        "SESSION",
                        "LANGUAGE",
                        "UID",
                        "PID",
                        "STATE",
                        "STARTED",
                        "CELLS",
                        "MEMORY"
                    );
                    for s in &rows {
                        outln!(
                            "{:<idw$} {:<lw$} {:>6} {:>8} {:<sw$} {:<20} {:>6} {:>10}",
                            escape_name(&s.id),
                            escape_name(&s.language),
                            s.uid,
                            s.pid,
                            escape_name(&s.state),
                            dbus::utc(s.started_usec),
                            s.cells_run,
                            dbus::human_bytes(s.memory_bytes)
                        );
                    }
                    outln!("\n{} sessions listed.", rows.len());
                }
            }
            Cmd::Status => {
                let st = a.status().await?;
                if json {
                    outln!("{}", serde_json::to_string(&st).expect("serialises"));
                } else {
                    outln!("version:         {}", st.version);
                    outln!("cgroups:         {}", st.cgroup_mode);
                    outln!("landlock abi:    {}", st.landlock_abi);
                    if !st.confinement.is_empty() {
                        outln!("confinement:");
                        for (k, v) in &st.confinement {
                            outln!("  {k:40} {v}");
                        }
                    }
                    outln!("active sessions: {}", st.active_sessions);
                    for (budget, used, max) in &st.admission {
                        outln!("{budget}: {used} of {max}");
                    }
                    outln!(
                        "\n{:<8} {:>5} {:>6} {:>4} {:>4} {:>8} {:>8}",
                        "POOL",
                        "IDLE",
                        "TARGET",
                        "MIN",
                        "MAX",
                        "TAKEN",
                        "MISSED"
                    );
                    for p in &st.pools {
                        outln!(
                            "{:<8} {:>5} {:>6} {:>4} {:>4} {:>8} {:>8}",
                            p.language,
                            p.idle,
                            p.target,
                            p.min,
                            p.max,
                            p.taken,
                            p.missed
                        );
                    }
                }
            }
            Cmd::Terminate { session } => a.terminate(session).await?,
            Cmd::Reload => a.reload().await?,
            Cmd::Interrupt { session, .. } => {
                let (delivered, reason) = a.interrupt(session).await?;
                if json {
                    outln!(
                        "{}",
                        serde_json::json!({"delivered": delivered, "reason": reason})
                    );
                } else {
                    outln!("{reason}");
                }
                return Ok(if delivered { 0 } else { 1 });
            }
            _ => unreachable!("filtered above"),
        }
        Ok(0)
    }
    .await;
    if let (Cmd::List { .. }, Err(dbus::Error::Bus(b))) = (cmd, &r) {
        errln!(
            "sandcellctl: the system bus is unreachable ({}); listing your own sessions over the Varlink socket",
            escape_message(&b.to_string())
        );
        return None;
    }
    Some(match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if json {
                let v = match &e {
                    dbus::Error::Refused { name, message } => {
                        serde_json::json!({"error": name, "message": message})
                    }
                    dbus::Error::Bus(b) => serde_json::json!({
                        "error": "sandcell.client.BusUnreachable",
                        "message": format!("system bus: {b}"),
                    }),
                };
                errln!("{v}");
            } else {
                errln!("sandcellctl: {}", escape_message(&e.to_string()));
            }
            ExitCode::from(match e {
                dbus::Error::Refused { .. } => 3,
                dbus::Error::Bus(_) => 2,
            })
        }
    })
}

fn read_code(file: &PathBuf) -> std::io::Result<String> {
    if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        Ok(s)
    } else {
        std::fs::read_to_string(file)
    }
}

/// Output of untrusted cells, made safe for a terminal: control characters other than newline
/// and tab (escape sequences could retitle or clear the terminal, or worse) are shown as
/// `\xNN` / `\u{NNNN}`. Unchanged when the stream is not a terminal (pipes get exact text).
fn for_terminal(text: &str, tty: bool) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !tty || !text.chars().any(bad) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut s = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !bad(c) {
            s.push(c);
        } else if (c as u32) < 0x80 {
            s.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            s.push_str(&format!("\\u{{{:04x}}}", c as u32));
        }
    }
    std::borrow::Cow::Owned(s)
}

/// A name a cell chose (a file name, a path under DIR), printable on one line whether or not
/// the stream is a terminal: every control character (tab and newline too) and every
/// invisible formatting character as `\xNN` / `\u{NNNN}`, and `\` as `\\`.
fn escape_name(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '\\' {
            s.push_str("\\\\");
        } else if c.is_control() && (c as u32) < 0x80 {
            s.push_str(&format!("\\x{:02x}", c as u32));
        } else if c.is_control() || sandcell_proto::text::is_invisible_format(c) {
            s.push_str(&format!("\\u{{{:04x}}}", c as u32));
        } else {
            s.push(c);
        }
    }
    s
}

fn exit_for(status: Status) -> u8 {
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

/// Reports `e` on standard error and returns the exit status for it (3 for a daemon's
/// refusal, 2 otherwise). One human sentence, `sandcellctl: ...` (a daemon's refusal led by
/// the error's short name, `sandcellctl: LimitExceeded: ...`), escaped whether or not
/// standard error is a terminal (the daemon's strings may carry a cell's or a caller's
/// text); with `--json`, the error as one JSON object ([`Error::to_json`]) instead.
fn fail(e: Error, json: bool) -> ExitCode {
    if json {
        errln!("{}", e.to_json());
    } else if let Error::Kernel(k) = &e {
        // The error's name first, as org.sandcell.Kernel(7) lists it, then the sentence.
        let name = k.name();
        let short = name.rsplit('.').next().unwrap_or_default();
        errln!("sandcellctl: {short}: {}", escape_message(&e.to_string()));
    } else {
        errln!("sandcellctl: {}", escape_message(&e.to_string()));
    }
    ExitCode::from(match e {
        Error::Kernel(_) => 3,
        _ => 2,
    })
}

/// A message of sandcellctl's own that carries text from the daemon or a cell: control
/// characters other than newline and tab shown as `\xNN` / `\u{NNNN}`, on a terminal or not.
fn escape_message(text: &str) -> String {
    for_terminal(text, true).into_owned()
}

/// `run --put FILE[:NAME]`: the local path and the name in the cell's directory. The whole
/// argument is the path when a file of that name exists (a path may contain `:`); otherwise
/// it splits at the last `:`. Without a name, the path's file name.
fn put_spec(arg: &str) -> (PathBuf, String) {
    let whole = PathBuf::from(arg);
    let (path, name) = match arg.rsplit_once(':') {
        Some((p, n)) if !whole.exists() && !p.is_empty() && !n.is_empty() => {
            (PathBuf::from(p), Some(n.to_owned()))
        }
        _ => (whole, None),
    };
    let name = name.unwrap_or_else(|| {
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    (path, name)
}

/// The code of `run`, `exec` and `submit` (`-`: standard input), read before connecting so
/// that a missing file is named as such.
fn read_code_named(file: &PathBuf) -> Result<String, Error> {
    read_code(file).map_err(|source| Error::File {
        what: if file.as_os_str() == "-" {
            "cannot read the code from standard input".into()
        } else {
            format!("cannot read the code file {}", file.display())
        },
        source,
    })
}

async fn stream(
    c: &mut Client,
    json: bool,
    host: Option<&mut hostcmd::HostHandler>,
    following: Option<&ctrlc::Following>,
    announce: bool,
) -> Result<u8, Error> {
    stream_result(c, json, host, following, announce)
        .await
        .map(|(code, _)| code)
}

/// How many of a cell's files [`list_files`] names; the rest are counted.
const FILES_LISTED: usize = 20;

/// Tells the user on standard error which files the cell created or changed (a plot's name is
/// otherwise visible only with `--json`): one line per file, `sandcellctl: file NAME (SIZE
/// bytes, MEDIA TYPE)`, at most [`FILES_LISTED`] lines and then a count. Names are escaped as
/// every name is ([`escape_name`]).
fn list_files(err: &mut impl Write, files: &[sandcell_client::FileInfo]) {
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

/// Why a file name from a cell is not saved under `--artifacts`, or its components.
///
/// Refused: an empty or absolute name, an empty, `.` or `..` component, any component that
/// starts with `.` (a cell must not plant `.bashrc`, `.git/config` or `.ssh/authorized_keys`
/// in DIR), control characters (a name with a newline misleads whoever reads the listing
/// line by line), and more than 4 components (the daemon's own bound).
fn artifact_parts(name: &str) -> Result<Vec<&str>, &'static str> {
    if name.is_empty() {
        return Err("empty name");
    }
    if name.starts_with('/') {
        return Err("absolute name");
    }
    if name
        .chars()
        .any(|c| c.is_control() || sandcell_proto::text::is_invisible_format(c))
    {
        return Err("control or invisible characters in the name");
    }
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 4 {
        return Err("more than 4 components");
    }
    for p in &parts {
        if p.is_empty() {
            return Err("empty component");
        }
        if p.starts_with('.') {
            return Err("a component starts with '.' (hidden files, '.' and '..' are not saved)");
        }
        // A name like `-rf` in DIR turns a later `rm *` there into `rm -rf ...`.
        if p.starts_with('-') {
            return Err("a component starts with '-' (it would read as an option to shell tools)");
        }
    }
    Ok(parts)
}

/// `openat(dir, name, flags | O_CLOEXEC | O_NOFOLLOW, mode)`: never follows a symlink in the
/// last component; `name` is one component.
fn open_at(
    dir: &std::fs::File,
    name: &str,
    flags: i32,
    mode: u32,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = std::ffi::CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `dir` is an open directory and `c` NUL-terminated for the call's duration.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            mode as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor returned by the kernel, owned from here on.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Opens (creating) the directory `name` beneath `dir`: `mkdirat` then `openat` with
/// `O_DIRECTORY | O_NOFOLLOW`, so a symlink in DIR is never followed.
fn subdir_at(dir: &std::fs::File, name: &str) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let c = std::ffi::CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: as in `open_at`; mkdirat never follows a symlink in its last component.
    if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o777) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

/// Saves the regular files among `files` (a cell's `files`) from `session` into `dir`,
/// printing each path saved (escaped), and nothing else is written. Every file is created
/// new (`O_CREAT | O_EXCL | O_NOFOLLOW`) beneath a descriptor of DIR, with subdirectories
/// opened `O_NOFOLLOW`: an existing file is never overwritten, a symlink never followed.
/// Names [`artifact_parts`] refuses, existing files, symlinks and special files are skipped
/// with a note on standard error.
async fn save_artifacts(
    c: &mut Client,
    session: &str,
    files: &[sandcell_client::FileInfo],
    dir: &std::path::Path,
) -> Result<(), Error> {
    let local = |what: String| move |source| Error::File { what, source };
    std::fs::create_dir_all(dir).map_err(local(format!("create {}", dir.display())))?;
    let root = std::fs::File::open(dir).map_err(local(format!("open {}", dir.display())))?;
    for f in files {
        let shown = escape_name(&f.name);
        if f.kind != sandcell_client::FileKind::File {
            if f.kind != sandcell_client::FileKind::Dir {
                errln!("sandcellctl: not saved: {shown} is a {}", f.kind.as_str());
            }
            continue;
        }
        let parts = match artifact_parts(&f.name) {
            Ok(p) => p,
            Err(why) => {
                errln!("sandcellctl: not saved: {shown}: {why}");
                continue;
            }
        };
        let (leaf, parents) = parts.split_last().expect("at least one component");
        let mut cur = root.try_clone().map_err(local("dup".into()))?;
        let mut blocked = None;
        for p in parents {
            match subdir_at(&cur, p) {
                Ok(d) => cur = d,
                Err(e) => {
                    blocked = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = blocked {
            errln!("sandcellctl: not saved: {shown}: {e}");
            continue;
        }
        let path = dir.join(&f.name);
        let out = match open_at(
            &cur,
            leaf,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o666,
        ) {
            Ok(out) => out,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                errln!(
                    "sandcellctl: not saved: {} exists (never overwritten)",
                    escape_name(&path.display().to_string())
                );
                continue;
            }
            Err(e) => {
                errln!("sandcellctl: not saved: {shown}: {e}");
                continue;
            }
        };
        let mut w = std::io::BufWriter::new(out);
        let got = c.get_file(session, &f.name, &mut w).await;
        let flushed = got.and_then(|_| {
            w.flush().map_err(|source| Error::File {
                what: format!("write {}", path.display()),
                source,
            })
        });
        if let Err(e) = flushed {
            // Remove the partial file we created (by its descriptor's directory).
            if let Ok(cname) = std::ffi::CString::new(*leaf) {
                use std::os::fd::AsRawFd;
                // SAFETY: `cur` is open and `cname` NUL-terminated; removes our own file.
                unsafe { libc::unlinkat(cur.as_raw_fd(), cname.as_ptr(), 0) };
            }
            return Err(e);
        }
        outln!("{}", escape_name(&path.display().to_string()));
    }
    Ok(())
}

/// Follows the started cell on `c` to its result, printing its output; `following` (when
/// Ctrl-C interrupts it) learns the cell from its `started` frame. With `announce` (`exec`),
/// the cell's number is printed on standard error when it starts (`sandcellctl: cell N
/// started; interrupt it with: sandcellctl interrupt SESSION N`). On a terminal, a silent
/// cell shows its elapsed time ([`progress`]).
async fn stream_result(
    c: &mut Client,
    json: bool,
    mut host: Option<&mut hostcmd::HostHandler>,
    following: Option<&ctrlc::Following>,
    announce: bool,
) -> Result<(u8, Option<sandcell_client::CellResult>), Error> {
    let out_tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let err_tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    let mut session = String::new();
    let progress = progress::Progress::start(err_tty && !json);
    loop {
        let f = c.next_frame().await?;
        progress.output();
        if let Some(s) = &f.started {
            session = s.session.clone();
            progress.started(s.cell);
            if let Some(f) = following {
                f.started(&s.session, s.cell);
            }
            if announce && !json {
                let _ = writeln!(
                    err,
                    "sandcellctl: cell {} started; interrupt it with: sandcellctl interrupt {} {}",
                    s.cell,
                    escape_name(&s.session),
                    s.cell
                );
            }
        }
        if let (Some(h), Some(call)) = (host.as_deref_mut(), &f.host_call) {
            h.answer(&session, call).await?;
        }
        if json {
            let _ = writeln!(
                out,
                "{}",
                serde_json::to_string(&f).expect("frames serialise")
            );
            let _ = out.flush();
        }
        if let Some(o) = &f.output
            && !json
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
            && !json
        {
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
        if let Some(r) = f.result {
            if !json {
                for w in &r.warnings {
                    let _ = writeln!(err, "sandcellctl: warning: {}", escape_message(w));
                }
                list_files(&mut err, &r.files);
                if let Some(kept) = &r.retained {
                    for (name, s) in [("stdout", kept.stdout), ("stderr", kept.stderr)] {
                        if s.dropped > 0 {
                            let _ = writeln!(
                                err,
                                "sandcellctl: {name}: {} of {} bytes retained while detached, {} dropped",
                                s.kept, s.seen, s.dropped
                            );
                        }
                    }
                }
            }
            if !json && r.status != Status::Ok {
                let mut line = format!("sandcellctl: cell {} {}", r.cell, r.status.as_str());
                if let Some(e) = &r.error {
                    // sandcellctl's own lines escape what the cell chose the same way on a
                    // terminal and a pipe; only the cell's streams pass exactly to a pipe.
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
                    && let Some(hint) =
                        sandcell_client::human::module_hint(&module, &envs, "python")
                {
                    let _ = writeln!(err, "sandcellctl: hint: {}", escape_message(&hint));
                }
            } else if !json {
                for (name, s) in [("stdout", r.stdout), ("stderr", r.stderr)] {
                    if s.truncated {
                        let _ = writeln!(
                            err,
                            "sandcellctl: {name} truncated: kept {} of {} bytes",
                            s.kept, s.seen
                        );
                    }
                }
            }
            return Ok((exit_for(r.status), Some(r)));
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Cmd::Completions { shell } = args.cmd {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Args::command(), "sandcellctl", &mut script);
        if let Err(e) = std::io::Write::write_all(&mut std::io::stdout(), &script) {
            output_failed(e);
        }
        return ExitCode::SUCCESS;
    }
    if let Cmd::Mcp = args.cmd {
        let socket = args.socket.unwrap_or_else(sandcell_client::default_socket);
        return match mcp::serve(socket).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                errln!("sandcellctl mcp: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    // An interrupt without a cell tries the Varlink socket first (one's own sessions, no
    // D-Bus needed), then D-Bus.
    let own_interrupt = matches!(args.cmd, Cmd::Interrupt { cell: None, .. });
    if !own_interrupt && let Some(code) = admin(&args.cmd, args.json, args.interactive).await {
        return code;
    }
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(sandcell_client::default_socket);
    // Local inputs first: a missing file is named before any connection is tried.
    let code = match &args.cmd {
        Cmd::Run { file, put, .. } => {
            for p in put {
                let (path, _) = put_spec(p);
                if let Err(source) = std::fs::metadata(&path) {
                    let what = format!("cannot upload {}", path.display());
                    return fail(Error::File { what, source }, args.json);
                }
            }
            match read_code_named(file) {
                Ok(c) => c,
                Err(e) => return fail(e, args.json),
            }
        }
        Cmd::Exec { file, .. } | Cmd::Submit { file, .. } => match read_code_named(file) {
            Ok(c) => c,
            Err(e) => return fail(e, args.json),
        },
        Cmd::Put { file, .. } => {
            if let Err(source) = std::fs::metadata(file) {
                let what = format!("cannot upload {}", file.display());
                return fail(Error::File { what, source }, args.json);
            }
            String::new()
        }
        _ => String::new(),
    };
    let mut c = match Client::connect(&socket).await {
        Ok(c) => c,
        Err(_) if own_interrupt => {
            return admin(&args.cmd, args.json, args.interactive)
                .await
                .expect("an interrupt without a cell is a D-Bus command");
        }
        Err(e) => return fail(e, args.json),
    };
    if let Cmd::Interrupt {
        session,
        cell: None,
    } = &args.cmd
    {
        return match c.interrupt_session(session).await {
            Ok(r) => {
                if args.json {
                    outln!("{}", serde_json::to_string(&r).expect("serialises"));
                } else {
                    match r.cell {
                        Some(n) => outln!("{} (cell {n})", r.reason),
                        None => outln!("{}", r.reason),
                    }
                }
                ExitCode::from(if r.delivered { 0 } else { 1 })
            }
            // Not one of the caller's sessions: an administrator's, over D-Bus.
            Err(Error::Kernel(
                KernelError::NoSuchSession { .. } | KernelError::PermissionDenied { .. },
            )) => admin(&args.cmd, args.json, args.interactive)
                .await
                .expect("an interrupt without a cell is a D-Bus command"),
            Err(e) => fail(e, args.json),
        };
    }
    let r: Result<u8, Error> = async {
        match &args.cmd {
            Cmd::Run {
                language,
                environment,
                wall_time,
                no_display,
                rich,
                artifacts,
                host_call_handler,
                put,
                file,
            } => {
                let code = code.clone();
                let lang = language.clone().unwrap_or_else(|| {
                    match file.extension().and_then(|e| e.to_str()) {
                        Some("R" | "r") => "r".into(),
                        _ => "python".into(),
                    }
                });
                let limits = wall_time.map(|w| Limits {
                    wall_time_seconds: Some(w),
                    ..Default::default()
                });
                let mut host = host_call_handler
                    .clone()
                    .map(|cmd| hostcmd::HostHandler::new(cmd, socket.clone()));
                let host_calls = host.is_some().then_some(true);
                let display = no_display.then_some(false);
                let following = ctrlc::install(socket.clone());
                if artifacts.is_none() && put.is_empty() {
                    c.run_with(&sandcell_client::RunParams {
                        language: lang,
                        code,
                        limits,
                        environment: environment.clone(),
                        host_calls,
                        display_last_expression: display,
                        rich_output: rich.then_some(true),
                    })
                    .await?;
                    return stream(&mut c, args.json, host.as_mut(), Some(&following), false).await;
                }
                // Input files, or a directory that must outlive the result: a session closed
                // afterwards (Open, PutFile..., Execute, Close) instead of a one-shot Run.
                let session = c
                    .open_with(&sandcell_client::OpenParams {
                        language: lang,
                        limits,
                        detached_idle_seconds: None,
                        environment: environment.clone(),
                        host_calls,
                        display_last_expression: display,
                        rich_output: rich.then_some(true),
                    })
                    .await?
                    .session;
                let ran = async {
                    for p in put {
                        let (path, name) = put_spec(p);
                        c.put_file(&session, &name, &path).await?;
                    }
                    c.execute(&session, &code).await?;
                    let (status, result) =
                        stream_result(&mut c, args.json, host.as_mut(), Some(&following), false)
                            .await?;
                    if let Some(dir) = artifacts {
                        let files = result.map(|r| r.files).unwrap_or_default();
                        save_artifacts(&mut c, &session, &files, dir).await?;
                    }
                    Ok(status)
                }
                .await;
                let _ = c.close(&session).await;
                ran
            }
            Cmd::Put {
                session,
                file,
                name,
            } => {
                let name = match name {
                    Some(n) => n.clone(),
                    None => file
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                };
                let info = c.put_file(session, &name, file).await?;
                if args.json {
                    outln!("{}", serde_json::to_string(&info).expect("serialises"));
                } else {
                    outln!("{} {} bytes", escape_name(&info.name), info.size);
                }
                Ok(0)
            }
            Cmd::Get { session, name, out } => {
                let out = out.clone().unwrap_or_else(|| {
                    PathBuf::from(std::path::Path::new(name).file_name().unwrap_or_default())
                });
                if out.as_os_str() == "-" {
                    c.get_file(session, name, std::io::stdout().lock()).await?;
                } else {
                    // Written next to OUT first, renamed into place only when complete.
                    let tmp = out.with_extension("sandcellctl-part");
                    let f = std::fs::File::create(&tmp).map_err(|source| Error::File {
                        what: format!("create {}", tmp.display()),
                        source,
                    })?;
                    let got = c.get_file(session, name, std::io::BufWriter::new(f)).await;
                    if let Err(e) = got {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(e);
                    }
                    std::fs::rename(&tmp, &out).map_err(|source| Error::File {
                        what: format!("rename to {}", out.display()),
                        source,
                    })?;
                }
                Ok(0)
            }
            Cmd::Environments { packages } => {
                let envs = c.list_environments().await?;
                if args.json {
                    outln!("{}", serde_json::to_string(&envs).expect("serialises"));
                    return Ok(0);
                }
                let nw = envs
                    .iter()
                    .map(|e| escape_name(&e.name).chars().count())
                    .fold(16, usize::max);
                outln!(
                    "{:<nw$} {:<8} {:<7} {:<7} {:<5} {:<24} {:>8}",
                    "NAME",
                    "LANGUAGE",
                    "ENGINE",
                    "DEFAULT",
                    "READY",
                    "VERSION",
                    "PACKAGES"
                );
                for e in &envs {
                    let count = format!(
                        "{}{}",
                        e.packages.len(),
                        if e.packages_truncated { "+" } else { "" }
                    );
                    outln!(
                        "{:<nw$} {:<8} {:<7} {:<7} {:<5} {:<24} {:>8}",
                        escape_name(&e.name),
                        escape_name(&e.language),
                        escape_name(&e.engine),
                        if e.default { "yes" } else { "no" },
                        if e.ready { "yes" } else { "no" },
                        escape_name(&e.interpreter_version),
                        count
                    );
                    if let Some(r) = &e.reason {
                        outln!("  not ready: {}", escape_name(r));
                    }
                    if let Some(l) = &e.limits {
                        for line in limit_lines(l) {
                            outln!("  {line}");
                        }
                    }
                    if *packages {
                        for p in &e.packages {
                            outln!("  {} {}", escape_name(&p.name), escape_name(&p.version));
                        }
                    }
                }
                Ok(0)
            }
            Cmd::Open {
                language,
                environment,
                idle,
                host_calls,
                no_display,
            } => {
                let o = c
                    .open_with(&sandcell_client::OpenParams {
                        language: language.clone(),
                        limits: None,
                        detached_idle_seconds: Some(*idle),
                        environment: environment.clone(),
                        host_calls: host_calls.then_some(true),
                        display_last_expression: no_display.then_some(false),
                        rich_output: None,
                    })
                    .await?;
                if args.json {
                    outln!("{}", serde_json::to_string(&o).expect("serialises"));
                } else {
                    outln!("{}", o.session);
                }
                Ok(0)
            }
            Cmd::Exec {
                session,
                host_call_handler,
                file: _,
            } => {
                // Without a command, a host call of the cell is refused at once.
                let mut host = Some(match host_call_handler.clone() {
                    Some(cmd) => hostcmd::HostHandler::new(cmd, socket.clone()),
                    None => hostcmd::HostHandler::refusing(socket.clone()),
                });
                let following = ctrlc::install(socket.clone());
                c.execute(session, &code).await?;
                stream(&mut c, args.json, host.as_mut(), Some(&following), true).await
            }
            Cmd::Submit { session, file: _ } => {
                let cell = c.submit(session, &code).await?;
                if args.json {
                    outln!("{}", serde_json::json!({ "cell": cell }));
                } else {
                    outln!("{cell}");
                }
                Ok(0)
            }
            Cmd::Attach { session, cell } => {
                c.attach(session, *cell).await?;
                stream(&mut c, args.json, None, None, false).await
            }
            Cmd::CellStatus { session, cell } => {
                let r = c.cell_status(session, *cell).await?;
                if args.json {
                    outln!("{}", serde_json::to_string(&r).expect("serialises"));
                    return Ok(0);
                }
                outln!("{}", escape_name(&r.state));
                if let Some(res) = &r.result {
                    if let Some(e) = &res.error {
                        outln!(
                            "error: {}: {}",
                            escape_name(&e.kind),
                            escape_name(&e.message)
                        );
                    }
                    if let Some(kept) = &res.retained {
                        for (name, s) in [("stdout", kept.stdout), ("stderr", kept.stderr)] {
                            outln!(
                                "{name}: {} bytes seen, {} retained, {} dropped",
                                s.seen,
                                s.kept,
                                s.dropped
                            );
                        }
                    }
                    return Ok(exit_for(res.status));
                }
                Ok(0)
            }
            Cmd::Interrupt {
                session,
                cell: Some(cell),
            } => {
                let r = c.interrupt(session, *cell).await?;
                if args.json {
                    outln!("{}", serde_json::to_string(&r).expect("serialises"));
                } else {
                    outln!("{}", r.reason);
                }
                Ok(if r.delivered { 0 } else { 1 })
            }
            Cmd::Inspect { session, max_items } => {
                let (vars, truncated) = c.inspect(session, *max_items).await?;
                if args.json {
                    let v = serde_json::json!({ "variables": vars, "truncated": truncated });
                    outln!("{v}");
                    return Ok(0);
                }
                outln!(
                    "{:<20} {:<28} {:>10} {:<12} REPR",
                    "NAME",
                    "TYPE",
                    "SIZE",
                    "SHAPE"
                );
                for v in &vars {
                    let shape = v
                        .shape
                        .as_ref()
                        .map(|s| s.iter().map(u64::to_string).collect::<Vec<_>>().join("x"))
                        .unwrap_or_default();
                    outln!(
                        "{:<20} {:<28} {:>10} {:<12} {}",
                        escape_name(&v.name),
                        escape_name(&v.kind),
                        v.size_bytes.map(|n| n.to_string()).unwrap_or_default(),
                        shape,
                        escape_name(&v.repr)
                    );
                }
                if truncated {
                    outln!("(more variables exist than are listed)");
                }
                Ok(0)
            }
            Cmd::Close { session } => match c.close(session).await {
                Ok(()) => Ok(0),
                // Already ended: the wish is fulfilled; say so and succeed.
                Err(Error::Kernel(KernelError::SessionEnded { reason, .. })) => {
                    errln!(
                        "sandcellctl: session {} had already ended ({}); nothing to close",
                        escape_name(session),
                        escape_name(&reason)
                    );
                    Ok(0)
                }
                Err(e) => Err(e),
            },
            Cmd::List { .. } => {
                let (rows, truncated) = c.list_sessions().await?;
                if args.json {
                    let v = serde_json::json!({ "sessions": rows, "truncated": truncated });
                    outln!("{v}");
                    return Ok(0);
                }
                let idw = rows
                    .iter()
                    .map(|s| escape_name(&s.session).chars().count())
                    .fold("SESSION".len(), usize::max);
                outln!(
                    "{:<idw$} {:<8} {:<8} {:>7} {:>6} {:<20} DETACHED",
                    "SESSION",
                    "LANGUAGE",
                    "STATE",
                    "RUNNING",
                    "CELLS",
                    "STARTED"
                );
                for s in &rows {
                    let started = (s.started * 1e6) as u64;
                    outln!(
                        "{:<idw$} {:<8} {:<8} {:>7} {:>6} {:<20} {}",
                        escape_name(&s.session),
                        escape_name(&s.language),
                        escape_name(&s.state),
                        s.running_cell.map_or("-".into(), |c| c.to_string()),
                        s.cells_run,
                        dbus::utc(started),
                        s.detached_idle_seconds
                            .map_or("no".into(), |i| format!("idle {i} s")),
                    );
                }
                outln!(
                    "\n{} sessions listed{}.",
                    rows.len(),
                    if truncated { " (more exist)" } else { "" }
                );
                Ok(0)
            }
            // Handled by `admin` before the socket is opened.
            Cmd::Status
            | Cmd::Terminate { .. }
            | Cmd::Reload
            | Cmd::Interrupt { cell: None, .. }
            | Cmd::Completions { .. }
            | Cmd::Mcp => {
                unreachable!("D-Bus commands and completions are handled first")
            }
        }
    }
    .await;
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => fail(e, args.json),
    }
}

#[cfg(test)]
mod artifact_tests {
    use super::{artifact_parts, escape_name};

    #[test]
    fn hidden_absolute_and_dot_names_are_not_saved() {
        for bad in [
            ".bashrc",
            ".git/config",
            ".ssh/authorized_keys",
            "a/.ssh/authorized_keys",
            "../x",
            "a/../../x",
            "./x",
            "/etc/passwd",
            "a//b",
            "",
            "a\nb",
            "a\tb",
            "x\u{202e}fdp.exe",
            "a/b/c/d/e",
            "-rf",
            "plots/--force",
        ] {
            assert!(artifact_parts(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            artifact_parts("plots/p-1.png").unwrap(),
            ["plots", "p-1.png"]
        );
    }

    #[test]
    fn names_print_on_one_line() {
        assert_eq!(escape_name("a\tb\nc"), "a\\x09b\\x0ac");
        assert_eq!(escape_name("a\\b"), "a\\\\b");
        assert_eq!(escape_name("\u{202e}x"), "\\u{202e}x");
        assert_eq!(escape_name("plain.png"), "plain.png");
    }
}

#[cfg(test)]
mod terminal_tests {
    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(
            super::for_terminal("a\x1b]0;pwned\x07b\n", true),
            "a\\x1b]0;pwned\\x07b\n"
        );
        assert_eq!(super::for_terminal("a\x1b[2J", false), "a\x1b[2J");
        assert_eq!(super::for_terminal("tab\tok\n", true), "tab\tok\n");
    }
}
