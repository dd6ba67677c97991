//! Frames between `sandcelld` and one worker process.
//!
//! A worker is started with this descriptor layout (see `daemon/src/worker/spawn.rs`):
//!
//! | fd | what | direction |
//! |----|------|-----------|
//! | 0 | `/dev/null` | - |
//! | 1 | R: the cell's stdout pipe, read by the daemon; Python: `/dev/null` | worker -> daemon |
//! | 2 | R: the cell's stderr pipe, read by the daemon; Python: `/dev/null` | worker -> daemon |
//! | 3 | request pipe ([`RequestHeader`] + payload) | daemon -> worker |
//! | 4 | reply pipe, JSON lines of [`WorkerMessage`] | worker -> daemon |
//!
//! Requests are a text header line followed by exactly `len` payload bytes, so that a worker in
//! a language without a JSON parser (R without jsonlite) can read them:
//!
//! ```text
//! exec 7 13 timeout_ms=10000 fuel=10000000000\nprint("hi")\n
//! ```
//!
//! Replies are one JSON object per line, each at most [`MAX_WORKER_LINE`] bytes. The daemon
//! treats every reply as hostile input: a native worker runs untrusted code in the same process
//! that writes these lines, and a cell's child process can write fd 4 too, so a cell can forge
//! them. A forged line can only misreport its own session; an oversized or malformed one ends
//! the worker as a protocol violation.
//!
//! What each worker kind may send, and when (anything else ends the worker as a protocol
//! violation, reported as `worker_crashed`):
//!
//! | frame | Python worker | R worker |
//! |-------|---------------|----------|
//! | `ready`, `fatal` | once, before the first request | once, before the first request |
//! | `started` | once per `exec`, first, for the running cell, echoing the request's `nonce` | the same |
//! | `output`, `dropped` | only for the running cell | never (R output travels on fds 1 and 2) |
//! | `done` | once per `exec`, for the running cell, echoing the request's `nonce` | the same |
//! | `inspected` | once per `inspect`, echoing its `nonce` | the same |
//! | `completions`, `help` | once per `complete`, `help`, echoing its `nonce` (see [`crate::query`]) | the same |
//! | `display` | only for the running cell of a request with `rich=1` | the same |
//! | `host_call` | only for the running cell of a request with `host_calls=1`, echoing its `nonce`, numbered from 1 per session, at most one unanswered | the same (the native Python worker likewise) |
//!
//! A host call (a cell's `host.call(name, arguments)`, R `host_call(...)`) is a `host_call`
//! line: [`WorkerMessage::HostCall`], checked by the daemon against
//! [`crate::kernel::MAX_HOST_CALL_NAME`] and [`crate::kernel::MAX_HOST_CALL_ARGUMENTS`] and
//! [`crate::kernel::valid_host_call_name`]. The daemon answers on the request pipe with a
//! `host_reply <cell> <len> call=<id>` request whose payload is one JSON object,
//! `{"result": {...}}` or `{"error": "..."}` (at most [`crate::kernel::MAX_HOST_CALL_RESULT`]
//! plus framing). A worker waiting for the answer to call `id` skips a `host_reply` naming
//! another call (one it gave up on: interrupted, timed out in the cell), and a worker reading
//! its next request skips any `host_reply` (the daemon may answer a call the cell gave up on
//! after the worker stopped waiting, before it read the cell's `done`). A `host_call` from a
//! cell whose request lacks `host_calls=1`, a second one before the first is answered, or one
//! out of bounds or out of sequence, is a protocol violation like any other: the worker
//! checks the opt-in itself and raises in the cell without writing a line, so only a forged
//! line reaches the daemon, and the forger loses only its own session.
//!
//! A native worker's `display` line (its stdout and stderr are raw pipes, read apart from the
//! reply pipe) may carry `"wait":true`: the worker then writes nothing until the daemon answers
//! with a `displayed <cell> 0` request, which it sends once it has read the raw pipes and
//! queued the bundle after what they held. That places each bundle exactly between the text
//! printed before and after the display call; without it, text printed after the call can
//! reach the daemon first. Both native workers wait from their main thread; the daemon also
//! sends one `displayed` when it continues a native worker's cell after a restart (its
//! predecessor may have died before answering), and a worker skips any `displayed` it is not
//! waiting for.
//!
//! An `inspect` request (`inspect 0 0 timeout_ms=T max_items=N nonce=X`) is not a cell: the
//! worker lists the user's variables without running a cell (no cell number, no history, no
//! output to the client) and answers with one `inspected` line. The daemon validates every
//! field against the bounds below ([`Variable::check`]); a reply out of bounds is a protocol
//! violation like any other malformed frame.
//!
//! Nothing may arrive between cells: before it writes a request the daemon drains the reply
//! pipe without blocking, and any byte found there is a violation. The `nonce` (16 lowercase
//! hex digits from the kernel's random source, new for every request) makes a `done` written
//! by a process a previous cell left behind useless: it cannot know the next request's nonce.
//! Counts of output are the bytes of `data` the daemon received; the `bytes` a worker declares
//! are informational and never raise or lower what is kept.
//!
//! Interrupts are not frames: the daemon sends SIGINT to the worker's main thread, which is the
//! only way to reach a single-threaded interpreter busy in a cell.

use serde::{Deserialize, Serialize};

pub use crate::cell::{
    CellError, DisplayKind, INSPECT_DEFAULT_ITEMS, INSPECT_MAX_ITEMS, MAX_ERROR_MESSAGE,
    MAX_REPR_CHARS, MAX_SHAPE_DIMS, MAX_TRACEBACK, MAX_VARIABLE_NAME, MAX_VARIABLE_TYPE, Stream,
    Variable,
};

/// Longest reply line the daemon accepts from a worker, in bytes (newline excluded).
///
/// Large enough for a 64 KiB output chunk escaped as `\xNN` (4x) plus framing; a longer line
/// is a protocol violation and ends the worker.
pub const MAX_WORKER_LINE: usize = 1024 * 1024;

/// Largest output chunk a worker puts in one [`WorkerMessage::Output`], in bytes of text.
pub const MAX_OUTPUT_CHUNK: usize = 64 * 1024;

/// Request descriptor of a worker: the daemon writes requests to it, the worker reads them.
/// Every worker (`sandcell-worker-python`, `worker.R`, `worker.py`) finds it at this number.
pub const REQUEST_FD: i32 = 3;

/// Reply descriptor of a worker: JSON lines of [`WorkerMessage`] (see the module
/// documentation).
pub const REPLY_FD: i32 = 4;

/// The descriptors a worker keeps through confinement: stdin (`/dev/null`), stdout, stderr,
/// [`REQUEST_FD`] and [`REPLY_FD`].
pub const WORKER_FDS: [i32; 5] = [0, 1, 2, REQUEST_FD, REPLY_FD];

/// Protocol ceiling for one cell's source, bytes: no configuration may allow more
/// (`max_source_bytes`).
pub const SOURCE_CEILING: u64 = 512 * 1024;

/// Protocol ceiling for the kept stdout + stderr of one cell, bytes: no configuration may
/// allow more (`max_stdout_bytes + max_stderr_bytes`).
pub const OUTPUT_CEILING: u64 = 2 * 1024 * 1024;

/// Most bytes one input byte takes in a JSON string (`\u00XX`).
pub const JSON_ESCAPE_FACTOR: usize = 6;

// Compile-time checks of the worker ceilings against the bounds of the lines that carry them
// (those against a Varlink message are in the crate root).
// An output chunk, escaped, fits one reply line with room for its framing.
const _: () = assert!(MAX_OUTPUT_CHUNK * JSON_ESCAPE_FACTOR + 4096 <= MAX_WORKER_LINE);
// An error's message and traceback, escaped, fit one `done` line.
const _: () =
    assert!((MAX_ERROR_MESSAGE + MAX_TRACEBACK) * JSON_ESCAPE_FACTOR + 4096 <= MAX_WORKER_LINE);
/// Operations the daemon sends to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Run the payload as one cell.
    Exec,
    /// Finish and exit with status 0 (the daemon kills the worker's cgroup anyway).
    Exit,
    /// List the user's variables (no payload; answered by [`WorkerMessage::Inspected`]).
    Inspect,
    /// The answer to host call `call` of the running cell (payload: one JSON object, see the
    /// module documentation). Not a request to answer: the worker writes nothing for it.
    HostReply,
    /// Completion at `cursor` of the payload's code (answered by
    /// [`WorkerMessage::Completions`]; see [`crate::query`]).
    Complete,
    /// Help for the name at `cursor` of the payload's code (answered by
    /// [`WorkerMessage::Help`]; see [`crate::query`]).
    Help,
    /// The `display` line of the running cell that asked for it (`wait`) is placed: what the
    /// worker wrote to its raw pipes before the line has been read, so what it writes next
    /// follows the bundle. No payload; not a request to answer. A worker may also receive one
    /// it did not wait for (from a daemon that continued its cell after a restart, since the
    /// predecessor may have died before writing its own): it skips it.
    Displayed,
}

impl Op {
    /// The token on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Exec => "exec",
            Op::Exit => "exit",
            Op::Inspect => "inspect",
            Op::HostReply => "host_reply",
            Op::Complete => "complete",
            Op::Help => "help",
            Op::Displayed => "displayed",
        }
    }
}

/// The header line of a request.
///
/// Wire form:
/// `<op> <cell> <len>[ timeout_ms=<u64>][ fuel=<u64>][ max_output=<u64>][ max_items=<u64>][ call=<u64>][ cursor=<u64>][ detail=<u64>][ host_calls=1][ display=0][ rich=1][ nonce=<hex>]\n`
/// (at most [`MAX_HEADER_LINE`] bytes: every field at its largest takes about 230).
/// Workers ignore options they do not know, so an older worker runs a newer daemon's cells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    /// What to do.
    pub op: Op,
    /// Cell number within the session, starting at 1; 0 for requests that are not cells.
    pub cell: u64,
    /// Payload length in bytes (the cell's UTF-8 source for `exec`).
    pub len: u64,
    /// Wall-time limit of the cell in milliseconds; the worker enforces it where its engine can
    /// (Eryx epoch deadline), the daemon enforces it in every case.
    pub timeout_ms: Option<u64>,
    /// WebAssembly fuel for the cell (Python only; ignored by R).
    pub fuel: Option<u64>,
    /// Bytes of each output stream worth sending; the worker may stop forwarding output past it
    /// but must still count what it saw. The daemon caps independently.
    pub max_output: Option<u64>,
    /// `inspect` only: list at most this many variables (1 to [`INSPECT_MAX_ITEMS`]).
    pub max_items: Option<u64>,
    /// `host_reply` only: the host call this answers.
    pub call: Option<u64>,
    /// `complete` and `help` only: the cursor's position in the code, characters.
    pub cursor: Option<u64>,
    /// `help` only: the detail level (0 or 1).
    pub detail: Option<u64>,
    /// `exec` only: the cell may make host calls (the session or run opted in); without it a
    /// cell's host call raises at once.
    pub host_calls: bool,
    /// `exec` only: show the value of the cell's last expression as a REPL does (Python: a
    /// final expression statement not ended by `;`, through `sys.displayhook`; R: every
    /// visible top-level value, auto-printed). On the wire only when false, as `display=0`.
    pub display: bool,
    /// `exec` only: rich output (the session or run asked for `rich_output`): the last
    /// expression's value, display calls and figures go out as [`WorkerMessage::Display`]
    /// lines instead of stdout text. On the wire only when true, as `rich=1`.
    pub rich: bool,
    /// A value the worker must echo in the `done` of this request ([`NONCE_HEX_LEN`] lowercase
    /// hex digits from the kernel's random source); `None` only in tests.
    pub nonce: Option<String>,
}

/// Longest header line a worker must accept, in bytes.
pub const MAX_HEADER_LINE: usize = 256;

/// Length of a request nonce, in hex digits (64 random bits).
pub const NONCE_HEX_LEN: usize = 16;

/// Whether `s` is a well-formed nonce: [`NONCE_HEX_LEN`] lowercase hex digits.
pub fn valid_nonce(s: &str) -> bool {
    s.len() == NONCE_HEX_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl RequestHeader {
    /// An `exec` header for a cell of `len` source bytes.
    pub fn exec(cell: u64, len: u64) -> Self {
        Self {
            op: Op::Exec,
            cell,
            len,
            timeout_ms: None,
            fuel: None,
            max_output: None,
            max_items: None,
            call: None,
            cursor: None,
            detail: None,
            host_calls: false,
            display: true,
            rich: false,
            nonce: None,
        }
    }

    /// Formats the header line, newline included.
    pub fn to_line(&self) -> String {
        let mut s = format!("{} {} {}", self.op.as_str(), self.cell, self.len);
        if let Some(v) = self.timeout_ms {
            s.push_str(&format!(" timeout_ms={v}"));
        }
        if let Some(v) = self.fuel {
            s.push_str(&format!(" fuel={v}"));
        }
        if let Some(v) = self.max_output {
            s.push_str(&format!(" max_output={v}"));
        }
        if let Some(v) = self.max_items {
            s.push_str(&format!(" max_items={v}"));
        }
        if let Some(v) = self.call {
            s.push_str(&format!(" call={v}"));
        }
        if let Some(v) = self.cursor {
            s.push_str(&format!(" cursor={v}"));
        }
        if let Some(v) = self.detail {
            s.push_str(&format!(" detail={v}"));
        }
        if self.host_calls {
            s.push_str(" host_calls=1");
        }
        if !self.display {
            s.push_str(" display=0");
        }
        if self.rich {
            s.push_str(" rich=1");
        }
        if let Some(v) = &self.nonce {
            s.push_str(&format!(" nonce={v}"));
        }
        s.push('\n');
        s
    }

    /// Parses a header line (without its newline).
    ///
    /// Errors: a message naming the first field that is missing or not a number.
    pub fn parse(line: &str) -> Result<Self, String> {
        let mut it = line.split(' ');
        let op = match it.next() {
            Some("exec") => Op::Exec,
            Some("exit") => Op::Exit,
            Some("inspect") => Op::Inspect,
            Some("host_reply") => Op::HostReply,
            Some("complete") => Op::Complete,
            Some("help") => Op::Help,
            Some("displayed") => Op::Displayed,
            other => return Err(format!("unknown op {other:?}")),
        };
        let num = |v: Option<&str>, what: &str| -> Result<u64, String> {
            v.ok_or_else(|| format!("missing {what}"))?
                .parse()
                .map_err(|_| format!("bad {what}"))
        };
        let cell = num(it.next(), "cell")?;
        let len = num(it.next(), "len")?;
        let mut h = Self {
            op,
            cell,
            len,
            timeout_ms: None,
            fuel: None,
            max_output: None,
            max_items: None,
            call: None,
            cursor: None,
            detail: None,
            host_calls: false,
            display: true,
            rich: false,
            nonce: None,
        };
        for kv in it {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("bad option {kv:?}"))?;
            match k {
                "timeout_ms" => h.timeout_ms = Some(num(Some(v), k)?),
                "fuel" => h.fuel = Some(num(Some(v), k)?),
                "max_output" => h.max_output = Some(num(Some(v), k)?),
                "max_items" => h.max_items = Some(num(Some(v), k)?),
                "call" => h.call = Some(num(Some(v), k)?),
                "cursor" => h.cursor = Some(num(Some(v), k)?),
                "detail" => h.detail = Some(num(Some(v), k)?),
                "host_calls" => h.host_calls = num(Some(v), k)? != 0,
                "rich" => h.rich = num(Some(v), k)? != 0,
                "display" => {
                    h.display = match v {
                        "0" => false,
                        "1" => true,
                        _ => return Err("bad display".into()),
                    }
                }
                "nonce" if valid_nonce(v) => h.nonce = Some(v.to_owned()),
                "nonce" => return Err("bad nonce".into()),
                _ => {} // unknown options are ignored for forward compatibility
            }
        }
        Ok(h)
    }
}

/// How a cell ended, as a worker sees it.
///
/// The daemon adds outcomes only it can see (OOM kill, crash, cancellation, its own deadline):
/// see `sandcell_proto::kernel::Status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerStatus {
    /// The cell ran to its end.
    Ok,
    /// The cell raised an error (Python exception, R condition).
    Error,
    /// The cell was stopped by SIGINT.
    Interrupted,
    /// The engine's own wall-time limit stopped the cell.
    Timeout,
    /// The WebAssembly fuel budget ran out.
    FuelExhausted,
    /// The guest ran out of memory inside its own limit (Python MemoryError, R allocation error).
    MemoryExhausted,
    /// The cell asked to end the interpreter (`sys.exit(n)`, R `quit()`), with `exit_code`.
    Exited,
}

/// What became of the session's variables after a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Variables are as the cell left them.
    #[default]
    Kept,
    /// The interpreter was rebuilt and the variables restored as they were before the cell.
    Restored,
    /// The interpreter was rebuilt and the variables could not be restored (see the error).
    Lost,
}

/// One JSON line from a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum WorkerMessage {
    /// Sent once, after the interpreter is initialised and confined, before any request is read.
    Ready {
        /// `python` or `r`.
        language: String,
        /// Engine description, e.g. `eryx 0.10.1`, `R 4.2.2`.
        engine: String,
    },
    /// The worker cannot go on (confinement or interpreter start failed); sent at most once,
    /// by the worker's own trusted code before any cell ran, just before it exits. The daemon
    /// logs `stage` and `reason` for the operator.
    Fatal {
        /// `confine`, `runtime`, ...
        stage: String,
        /// What failed, bounded by [`MAX_ERROR_MESSAGE`].
        reason: String,
    },
    /// The worker read a whole `exec` request: sent once per `exec`, before anything else of
    /// the cell. It is how a successor daemon tells whether the request written just before
    /// its predecessor died reached the worker (a pipe keeps no count of what went through
    /// it): a `started` line, or any other, on the reply pipe says it did. The daemon needs
    /// nothing else from it; a forged one can only say so of its own session's cell.
    Started {
        /// Cell number from the request.
        cell: u64,
        /// The request's `nonce`, echoed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
    },
    /// Output of a cell (Python worker only; R output travels on fds 1 and 2).
    Output {
        /// Cell the output belongs to.
        cell: u64,
        /// Which stream.
        stream: Stream,
        /// Text, invalid UTF-8 escaped as by [`crate::text::escape_lossy`].
        data: String,
        /// Original byte length of this chunk, before escaping. Informational only: the daemon
        /// counts and caps the bytes of `data` it received, never this figure.
        bytes: u64,
    },
    /// A MIME bundle of the running cell (requests with `rich=1` only), ordered with its
    /// output: the daemon checks it ([`crate::kernel::check_display_data`]), counts it
    /// against the cell's stdout budget and forwards it as a `display` frame. A worker
    /// replaces a bundle over [`crate::kernel::MAX_DISPLAY_BYTES`] by its text/plain itself
    /// (the line must stay under [`MAX_WORKER_LINE`]); the daemon does so again for a
    /// forged one.
    Display {
        /// Cell the bundle belongs to.
        cell: u64,
        /// Result or display.
        kind: DisplayKind,
        /// MIME type to representation.
        data: serde_json::Map<String, serde_json::Value>,
        /// The bundle's metadata (see [`crate::kernel::Display::metadata`]), checked by
        /// [`crate::kernel::check_display_metadata`].
        #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
        metadata: serde_json::Map<String, serde_json::Value>,
        /// Why the worker replaced the bundle by its text/plain, when it did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        /// A native worker (its stdout and stderr are raw pipes, read apart from this line)
        /// that sets it waits after the line, writing nothing, for a [`Op::Displayed`]
        /// request, which the daemon sends once it has read the raw pipes and queued the
        /// bundle after what they held: so what the cell printed before the display call
        /// comes before the bundle, and what it prints after comes after it. A worker that
        /// lies only reorders its own cell's output.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        wait: bool,
    },
    /// Output the worker saw but did not send (past `max_output`), so the daemon's counts of
    /// bytes seen stay exact.
    Dropped {
        /// Cell the output belongs to.
        cell: u64,
        /// Which stream.
        stream: Stream,
        /// Bytes not sent.
        bytes: u64,
    },
    /// A cell finished. Exactly one per `exec` request.
    Done {
        /// Cell number from the request.
        cell: u64,
        /// The request's `nonce`, echoed; the daemon refuses a `done` without the right one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
        /// How it ended.
        status: WorkerStatus,
        /// The error, for `error`, `memory_exhausted` and engine failures.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<CellError>,
        /// Exit code for `exited`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit_code: Option<i64>,
        /// WebAssembly fuel the cell consumed (Python).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fuel: Option<u64>,
        /// What became of the session's variables.
        #[serde(default)]
        state: SessionState,
        /// Warnings raised by the cell (R `warning()`), each bounded like messages.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        warnings: Vec<String>,
    },
    /// The answer to an `inspect` request. Exactly one per `inspect`.
    Inspected {
        /// The request's `nonce`, echoed; the daemon refuses an answer without the right one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
        /// The user's variables in name order, at most the request's `max_items`.
        variables: Vec<Variable>,
        /// More variables exist than are listed (over `max_items`, or over
        /// [`MAX_INSPECT_LINE`] bytes of reply).
        truncated: bool,
    },
    /// The answer to a `complete` request. Exactly one per `complete`.
    Completions {
        /// The request's `nonce`, echoed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
        /// The matches and the replaced range ([`crate::query::check_completions`]).
        #[serde(flatten)]
        reply: crate::query::CompleteReply,
    },
    /// The answer to a `help` request. Exactly one per `help`.
    Help {
        /// The request's `nonce`, echoed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
        /// Whether a name was found and its bundle ([`crate::query::check_help`]).
        #[serde(flatten)]
        reply: crate::query::HelpReply,
    },
    /// The running cell calls a tool of the client (see the module documentation); the
    /// worker then waits for the `host_reply` request naming `call`.
    HostCall {
        /// Cell number from the request.
        cell: u64,
        /// The request's `nonce`, echoed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
        /// Number of the call in the session: 1 for the first, then one more per call.
        call: u64,
        /// The tool's name: 1 to [`crate::kernel::MAX_HOST_CALL_NAME`] bytes of
        /// `[A-Za-z0-9_.-]`.
        name: String,
        /// Its arguments: a JSON object of at most [`crate::kernel::MAX_HOST_CALL_ARGUMENTS`]
        /// bytes (as the daemon serialises it).
        arguments: serde_json::Value,
    },
}

/// Time a worker gives the user's code (`repr`, `__sizeof__`, R `str`/`dim` methods) during
/// one `inspect`, in milliseconds (`timeout_ms` of the request); past it the remaining values
/// get placeholders. The daemon's own deadline is [`INSPECT_DEADLINE_MS`].
pub const INSPECT_BUDGET_MS: u64 = 4000;

/// When the daemon interrupts a worker that has not answered an `inspect` (SIGINT, as for a
/// cell), in milliseconds after the request; it ends the session if no answer comes within
/// the session's kill grace after that.
pub const INSPECT_DEADLINE_MS: u64 = 5000;

/// Longest `inspected` line a worker writes, bytes: it stops listing before its line would
/// exceed this and says `truncated`. Half of [`MAX_WORKER_LINE`], so a worker's estimate may
/// be off without breaking the protocol.
pub const MAX_INSPECT_LINE: usize = 512 * 1024;

const _: () = assert!(MAX_INSPECT_LINE <= MAX_WORKER_LINE);

impl WorkerMessage {
    /// Parses one reply line; errors describe why the line is not a valid message.
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        if line.len() > MAX_WORKER_LINE {
            return Err(format!(
                "line of {} bytes exceeds {MAX_WORKER_LINE}",
                line.len()
            ));
        }
        serde_json::from_slice(line).map_err(|e| e.to_string())
    }

    /// Serialises the message as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).expect("worker messages always serialise");
        v.push(b'\n');
        v
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary, appending a marker that says how
/// many bytes were cut.
pub fn bound_text(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... [{} more bytes]", &s[..end], s.len() - end)
}

/// Writes a [`WorkerMessage::Fatal`] line to the reply descriptor, best effort, and also to
/// stderr. For a worker's own start-up failures only (confinement, interpreter load).
pub fn report_fatal(stage: &str, reason: &str) {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    let msg = WorkerMessage::Fatal {
        stage: stage.into(),
        reason: bound_text(reason, MAX_ERROR_MESSAGE),
    };
    // SAFETY: fd 4 is the reply pipe the daemon placed there; ManuallyDrop keeps it open.
    let mut f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(REPLY_FD) });
    let _ = f.write_all(&msg.to_line());
    eprintln!("sandcell worker: {stage}: {reason}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let mut h = RequestHeader::exec(7, 13);
        h.timeout_ms = Some(10_000);
        h.fuel = Some(5);
        let line = h.to_line();
        assert_eq!(line, "exec 7 13 timeout_ms=10000 fuel=5\n");
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);
    }

    #[test]
    fn header_carries_a_nonce_and_fits_the_limit() {
        let mut h = RequestHeader::exec(u64::MAX, u64::MAX);
        h.timeout_ms = Some(u64::MAX);
        h.fuel = Some(u64::MAX);
        h.max_output = Some(u64::MAX);
        h.max_items = Some(u64::MAX);
        h.display = false;
        h.host_calls = true;
        h.rich = true;
        h.nonce = Some("0123456789abcdef".into());
        let line = h.to_line();
        assert!(line.len() <= MAX_HEADER_LINE, "{} bytes", line.len());
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);
        assert!(valid_nonce(h.nonce.as_deref().unwrap()));
        assert!(RequestHeader::parse("exec 1 0 nonce=XYZ").is_err());
        assert!(RequestHeader::parse("exec 1 0 nonce=0123").is_err());
    }

    #[test]
    fn header_display_option_is_sent_only_when_off() {
        let mut h = RequestHeader::exec(2, 3);
        assert_eq!(h.to_line(), "exec 2 3\n");
        h.display = false;
        assert_eq!(h.to_line(), "exec 2 3 display=0\n");
        assert_eq!(RequestHeader::parse("exec 2 3 display=0").unwrap(), h);
        assert!(RequestHeader::parse("exec 2 3 display=1").unwrap().display);
        assert!(RequestHeader::parse("exec 2 3 display=no").is_err());
        // Unknown options are ignored (forward compatibility).
        assert!(RequestHeader::parse("exec 2 3 colour=7").unwrap().display);
    }

    #[test]
    fn header_rejects_garbage() {
        assert!(RequestHeader::parse("exec x 1").is_err());
        assert!(RequestHeader::parse("rm 1 1").is_err());
        assert!(RequestHeader::parse("exec 1").is_err());
    }

    #[test]
    fn message_round_trip() {
        let m = WorkerMessage::Done {
            cell: 3,
            nonce: Some("0123456789abcdef".into()),
            status: WorkerStatus::Error,
            error: Some(CellError {
                kind: "ValueError".into(),
                message: "x".into(),
                ..Default::default()
            }),
            exit_code: None,
            fuel: Some(10),
            state: SessionState::Kept,
            warnings: vec![],
        };
        let line = m.to_line();
        assert_eq!(WorkerMessage::parse(&line[..line.len() - 1]).unwrap(), m);
    }

    #[test]
    fn started_is_the_line_the_r_and_python_workers_write() {
        // worker.R and worker.py build this line by hand.
        let line = br#"{"t":"started","cell":7,"nonce":"0123456789abcdef"}"#;
        let m = WorkerMessage::Started {
            cell: 7,
            nonce: Some("0123456789abcdef".into()),
        };
        assert_eq!(WorkerMessage::parse(line).unwrap(), m);
        assert_eq!(&m.to_line()[..line.len()], line);
    }

    #[test]
    fn inspect_header_and_reply_round_trip() {
        let mut h = RequestHeader::exec(0, 0);
        h.op = Op::Inspect;
        h.timeout_ms = Some(INSPECT_BUDGET_MS);
        h.max_items = Some(INSPECT_MAX_ITEMS);
        h.nonce = Some("0123456789abcdef".into());
        let line = h.to_line();
        assert_eq!(
            line,
            "inspect 0 0 timeout_ms=4000 max_items=1000 nonce=0123456789abcdef\n"
        );
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);
        let v = Variable {
            name: "df".into(),
            kind: "pandas.core.frame.DataFrame".into(),
            size_bytes: Some(24),
            shape: Some(vec![3, 2]),
            repr: "   a  b\n0  1  x".into(),
        };
        let m = WorkerMessage::Inspected {
            nonce: h.nonce.clone(),
            variables: vec![v.clone()],
            truncated: false,
        };
        let line = m.to_line();
        assert!(String::from_utf8_lossy(&line).contains(r#""type":"pandas.core.frame.DataFrame""#));
        assert_eq!(WorkerMessage::parse(&line[..line.len() - 1]).unwrap(), m);
        assert_eq!(v.check(), Ok(()));
        for bad in [
            Variable {
                name: String::new(),
                ..v.clone()
            },
            Variable {
                name: "_x".into(),
                ..v.clone()
            },
            Variable {
                name: "n".repeat(MAX_VARIABLE_NAME + 1),
                ..v.clone()
            },
            Variable {
                kind: "t".repeat(MAX_VARIABLE_TYPE + 1),
                ..v.clone()
            },
            Variable {
                repr: "é".repeat(MAX_REPR_CHARS + 1),
                ..v.clone()
            },
            Variable {
                shape: Some(vec![1; MAX_SHAPE_DIMS + 1]),
                ..v.clone()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert!(
            Variable {
                repr: "é".repeat(MAX_REPR_CHARS),
                ..v
            }
            .check()
            .is_ok()
        );
    }

    #[test]
    fn host_reply_header_and_host_call_round_trip() {
        let mut h = RequestHeader::exec(4, 17);
        h.op = Op::HostReply;
        h.call = Some(u64::MAX);
        h.nonce = Some("0123456789abcdef".into());
        let line = h.to_line();
        assert!(line.len() <= MAX_HEADER_LINE, "{} bytes", line.len());
        assert_eq!(RequestHeader::parse(line.trim_end()).unwrap(), h);
        let mut d = RequestHeader::exec(4, 0);
        d.op = Op::Displayed;
        assert_eq!(d.to_line(), "displayed 4 0\n");
        assert_eq!(RequestHeader::parse(d.to_line().trim_end()).unwrap(), d);
        let mut e = RequestHeader::exec(4, 1);
        e.host_calls = true;
        assert_eq!(e.to_line(), "exec 4 1 host_calls=1\n");
        assert_eq!(RequestHeader::parse(e.to_line().trim_end()).unwrap(), e);
        let m = WorkerMessage::HostCall {
            cell: 4,
            nonce: Some("0123456789abcdef".into()),
            call: 1,
            name: "search".into(),
            arguments: serde_json::json!({"q": "x"}),
        };
        let line = m.to_line();
        assert!(String::from_utf8_lossy(&line).starts_with(r#"{"t":"host_call""#));
        assert_eq!(WorkerMessage::parse(&line[..line.len() - 1]).unwrap(), m);
    }

    #[test]
    fn bound_text_cuts_on_char_boundary() {
        assert_eq!(bound_text("ab✓cd", 3), "ab... [5 more bytes]");
        assert_eq!(bound_text("abc", 3), "abc");
    }
}
