//! `sandcellctl mcp`: a Model Context Protocol server over stdio (MCP specification,
//! <https://modelcontextprotocol.io/specification>, "Transports: stdio" and "Server: Tools"),
//! built on the official Rust SDK (`rmcp`).
//!
//! It runs as the calling user and talks to sandcelld through [`sandcell_client::Client`]
//! like any other client, so the daemon's authorization, per-uid quotas and session
//! ownership apply unchanged. Shapes:
//!
//! - one *owner* connection opens every session; sessions opened without
//!   `detached_idle_seconds` belong to it and end when this process ends (the MCP client
//!   closed stdin, sent SIGTERM or killed it); detached ones outlive it for their idle time.
//!   A restart of sandcelld breaks the owner connection and the successor keeps its
//!   sessions without an owner; this server closes those when it exits (stdin closed,
//!   SIGTERM, SIGINT: [`serve`]), so they still end with it, except after a SIGKILL;
//! - every other call, cells included, takes a connection from a small pool ([`POOL_IDLE`]
//!   kept idle) or opens one, and gives it back once answered (a cell: after its result);
//! - at most [`MAX_IN_FLIGHT`] tool calls run at once; more are refused at once with the tool
//!   error `sandcell.mcp.Busy`;
//! - every input line is answered or passed on ([`transport`]): a line that is not JSON gets
//!   `-32700` (Parse error, `"id": null`), a line longer than [`MAX_LINE_BYTES`] gets
//!   `-32600` naming the cap (and is never held whole), a call of a tool this server does not
//!   have gets `-32602` (Invalid params), as the MCP specification's "Server: Tools, Error
//!   Handling" lists unknown tools among protocol errors (revisions 2025-06-18 and
//!   2025-11-25);
//! - code longer than the daemon's `max_source_bytes` (which `ListEnvironments` reports in
//!   each environment's `limits.source_bytes`; a daemon that does not report it is held to
//!   the protocol ceiling, [`sandcell_proto::worker::SOURCE_CEILING`]) is refused before
//!   sending with the daemon's own error, `org.sandcell.Kernel.LimitExceeded` naming
//!   `max_source_bytes`;
//! - a cell that fails is a tool result with `isError` and the traceback; a refused call is a
//!   tool result with `isError` whose structured content is the daemon's typed error
//!   (`{"error": "org.sandcell.Kernel.<Name>", "parameters": {...}, "message": ...}`);
//! - with a progress token, each output chunk is sent as a progress notification (its text,
//!   at most [`MAX_PROGRESS_TEXT`] bytes); a `notifications/cancelled` for a running call
//!   interrupts its cell (`Interrupt`); the SDK sends no response to a cancelled request (MCP
//!   "Cancellation"), so with a progress token a last progress notification carries
//!   `[status: interrupted]`;
//! - `execute` sends a fresh cell token; a call cut by a restart of sandcelld is sent again
//!   with it ([`Client::next_frame_following`]), so a detached session's cell is followed into
//!   the successor and its code runs once;
//! - plots a session cell wrote (PNG files it created or changed, e.g. matplotlib's
//!   `plot-<cell>-NNN.png`) come back as image content, each at most [`MAX_IMAGE_BYTES`],
//!   at most [`MAX_IMAGES`] per result.

use rmcp::handler::server::common::{schema_for_output, schema_for_type};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities,
    ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use sandcell_client::{CellTrack, Client, Error, KernelError, Limits, Reattach, Status};
use sandcell_proto::kernel as k;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Semaphore, watch};

pub mod transport;

/// Tool calls running at once; more are refused with `sandcell.mcp.Busy`.
pub const MAX_IN_FLIGHT: usize = 16;
/// Idle daemon connections kept for reuse.
pub const POOL_IDLE: usize = 4;
/// Longest JSON-RPC line read from stdin, bytes (newline included): room for a 1 MiB upload
/// in base64 (1.4 MiB), or as text unless most of it needs JSON escapes (`\u0000` is six
/// bytes for one). A longer line is answered `-32600` naming this cap.
pub const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;
/// Largest upload, bytes after decoding (half the daemon's inline limit: the Varlink message
/// carrying it in base64 stays under 1.5 MiB).
pub const MAX_UPLOAD_BYTES: u64 = k::MAX_INLINE_BYTES / 2;
/// Longest code of one cell this server sends to a daemon that does not report its
/// `max_source_bytes` (in `ListEnvironments`' `limits.source_bytes`), bytes: the protocol
/// ceiling no configuration may exceed. A daemon that reports it is held to its own figure
/// (64 KiB as shipped, sandcelld.toml(5)).
pub const MAX_CODE_BYTES: u64 = sandcell_proto::worker::SOURCE_CEILING;
/// Largest image returned as image content, bytes (before base64).
pub const MAX_IMAGE_BYTES: u64 = 1024 * 1024;
/// Images returned per result; further ones are named in `images_omitted`.
pub const MAX_IMAGES: usize = 8;
/// Bytes of a download per call (default 256 KiB; `max_bytes` up to the daemon's chunk of 1 MiB).
pub const DEFAULT_DOWNLOAD_BYTES: u64 = 256 * 1024;
/// Text of one progress notification, bytes.
pub const MAX_PROGRESS_TEXT: usize = 8 * 1024;
/// Sessions remembered for `list_sessions`.
pub const MAX_TRACKED_SESSIONS: usize = 256;

// ---------------------------------------------------------------- tool inputs

/// Optional per-cell limits; absent fields take the daemon's defaults (sandcelld.toml(5)).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct LimitsIn {
    /// Wall-time limit of one cell, seconds.
    wall_time_seconds: Option<f64>,
    /// Interpreter memory limit, bytes.
    memory_bytes: Option<u64>,
    /// WebAssembly fuel budget of one cell (the `python` environment only).
    fuel: Option<u64>,
    /// Bytes of stdout kept per cell.
    stdout_bytes: Option<u64>,
    /// Bytes of stderr kept per cell.
    stderr_bytes: Option<u64>,
}

impl LimitsIn {
    fn to_limits(&self) -> Limits {
        Limits {
            wall_time_seconds: self.wall_time_seconds,
            fuel: self.fuel,
            guest_memory_bytes: self.memory_bytes,
            stdout_bytes: self.stdout_bytes,
            stderr_bytes: self.stderr_bytes,
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RunCodeIn {
    /// The code to run.
    code: String,
    /// Environment name from `list_environments`, e.g. `python`, `pydata`, `r`. Default:
    /// `python`.
    environment: Option<String>,
    /// Limits of this cell.
    limits: Option<LimitsIn>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct OpenIn {
    /// Environment name from `list_environments`, e.g. `python`, `pydata`, `r`. Default:
    /// `python`.
    environment: Option<String>,
    /// Keep the session after this MCP connection ends, until it has been idle this many
    /// seconds. Absent: the session ends with the connection.
    detached_idle_seconds: Option<u64>,
    /// Limits of each cell of the session.
    limits: Option<LimitsIn>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ExecuteIn {
    /// Session id from `open_session`.
    session: String,
    /// The code to run; variables persist across calls.
    code: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SessionIn {
    /// Session id from `open_session`.
    session: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct InterruptIn {
    /// Session id from `open_session`.
    session: String,
    /// Cell number; default: the cell this server is running in the session.
    cell: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct InspectIn {
    /// Session id from `open_session`.
    session: String,
    /// Variables to list, 1 to 1000 (default 100).
    max_items: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct UploadIn {
    /// Session id from `open_session`.
    session: String,
    /// Relative path in the session directory, e.g. `data.csv`.
    name: String,
    /// The content as UTF-8 text (give this or `base64`).
    text: Option<String>,
    /// The content in base64 (give this or `text`).
    base64: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct DownloadIn {
    /// Session id from `open_session`.
    session: String,
    /// Relative path in the session directory.
    name: String,
    /// Offset to read from, bytes (default 0).
    offset: Option<u64>,
    /// Bytes to read (default 262144, at most 1048576).
    max_bytes: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct FileIn {
    /// Session id from `open_session`.
    session: String,
    /// Relative path in the session directory.
    name: String,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct EnvironmentsIn {
    /// List each environment's installed packages too (default false).
    packages: Option<bool>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

// ---------------------------------------------------------------- tool outputs

/// The error a cell raised.
#[derive(Debug, Serialize, JsonSchema)]
struct CellErrorOut {
    /// Exception class or R condition class, e.g. `ZeroDivisionError`.
    kind: String,
    /// Its message.
    message: String,
    /// The traceback, when the interpreter gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    traceback: Option<String>,
}

/// What a cell did.
#[derive(Debug, Serialize, JsonSchema)]
struct CellOut {
    /// Session id (of the fresh sandbox for `run_code`).
    session: String,
    /// Cell number within the session.
    cell: u64,
    /// `ok`, `error`, `interrupted`, `timeout`, `fuel_exhausted`, `memory_exhausted`, `oom`,
    /// `exited`, `worker_crashed` or `cancelled`.
    status: String,
    /// Kept standard output.
    stdout: String,
    /// Kept standard error.
    stderr: String,
    /// Bytes of stdout the cell wrote beyond what was kept.
    stdout_truncated_bytes: u64,
    /// Bytes of stderr the cell wrote beyond what was kept.
    stderr_truncated_bytes: u64,
    /// The error, for status `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<CellErrorOut>,
    /// Wall time from request to result, seconds.
    wall_seconds: f64,
    /// Files of the session directory the cell created or changed.
    files: Vec<String>,
    /// Images returned as image content, in order.
    images: Vec<String>,
    /// Images not returned (too large, or past the count limit).
    images_omitted: Vec<String>,
    /// The session ended with this cell (always for `run_code`).
    session_ended: bool,
}

#[derive(Debug, Serialize, JsonSchema)]
struct OpenOut {
    /// Session id, for the other session tools.
    session: String,
    /// The environment.
    environment: String,
    /// The interpreter's description.
    engine: String,
    /// Idle seconds the session outlives this connection for; absent: it ends with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    detached_idle_seconds: Option<u64>,
}

#[derive(Debug, Serialize, JsonSchema)]
struct DoneOut {
    /// What was done.
    done: String,
}

#[derive(Debug, Serialize, JsonSchema)]
struct InterruptOut {
    /// Whether SIGINT reached the running cell.
    delivered: bool,
    /// Why not, or `delivered`.
    reason: String,
}

#[derive(Debug, Clone, Serialize, JsonSchema)]
struct SessionOut {
    /// Session id.
    session: String,
    /// Environment.
    environment: String,
    /// Idle seconds it outlives this connection for; absent: it ends with the connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    detached_idle_seconds: Option<u64>,
    /// The cell running now through this server, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    running_cell: Option<u64>,
}

#[derive(Debug, Serialize, JsonSchema)]
struct SessionsOut {
    /// Sessions opened through this MCP connection and not closed through it.
    sessions: Vec<SessionOut>,
}

#[derive(Debug, Serialize, JsonSchema)]
struct VariableOut {
    /// Name.
    name: String,
    /// Type name.
    kind: String,
    /// Approximate size, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    size_bytes: Option<u64>,
    /// Shape (arrays, data frames).
    #[serde(skip_serializing_if = "Option::is_none")]
    shape: Option<Vec<u64>>,
    /// Short representation.
    repr: String,
}

#[derive(Debug, Serialize, JsonSchema)]
struct InspectOut {
    /// The session's user variables.
    variables: Vec<VariableOut>,
    /// More exist than listed.
    truncated: bool,
}

#[derive(Debug, Serialize, JsonSchema)]
struct FileOut {
    /// Relative path.
    name: String,
    /// Bytes.
    size: u64,
    /// Media type guessed from the extension.
    media_type: String,
    /// `file`, `dir`, `symlink` or `special`.
    kind: String,
    /// Last modification, seconds since the Unix epoch.
    modified: f64,
}

impl From<&k::FileInfo> for FileOut {
    fn from(f: &k::FileInfo) -> Self {
        FileOut {
            name: f.name.clone(),
            size: f.size,
            media_type: f.media_type.clone(),
            kind: f.kind.as_str().into(),
            modified: f.modified,
        }
    }
}

#[derive(Debug, Serialize, JsonSchema)]
struct FilesOut {
    /// The session directory's entries.
    files: Vec<FileOut>,
    /// The daemon cut the listing at its bound.
    truncated: bool,
}

#[derive(Debug, Serialize, JsonSchema)]
struct UploadOut {
    /// The stored file.
    file: FileOut,
}

#[derive(Debug, Serialize, JsonSchema)]
struct DownloadOut {
    /// The file.
    file: FileOut,
    /// Offset read from, bytes.
    offset: u64,
    /// Bytes returned.
    bytes: u64,
    /// The bytes reach the end of the file.
    eof: bool,
    /// `utf-8` (the data is the text) or `base64`.
    encoding: String,
    /// The content.
    data: String,
}

#[derive(Debug, Serialize, JsonSchema)]
struct PackageOut {
    name: String,
    version: String,
}

#[derive(Debug, Serialize, JsonSchema)]
struct EnvironmentOut {
    /// Name, for `environment` of `run_code` and `open_session`.
    name: String,
    /// `python` or `r`.
    language: String,
    /// `eryx` (WebAssembly) or `native`.
    engine: String,
    /// The language's default environment.
    default: bool,
    /// Interpreter version.
    interpreter_version: String,
    /// Ready to run cells.
    ready: bool,
    /// Installed packages (with `packages: true`).
    packages: Vec<PackageOut>,
    /// More packages are installed than listed.
    packages_truncated: bool,
}

#[derive(Debug, Serialize, JsonSchema)]
struct EnvironmentsOut {
    /// The environments sandcelld serves.
    environments: Vec<EnvironmentOut>,
}

// ---------------------------------------------------------------- the tool table

const CLOSE_NOTE: &str = "Sessions opened without detached_idle_seconds end when this MCP \
connection ends; with it, they outlive it until idle that long.";

fn tools() -> Vec<Tool> {
    fn tool<I: JsonSchema + 'static, O: JsonSchema + 'static>(
        name: &'static str,
        title: &str,
        description: String,
        read_only: bool,
    ) -> Tool {
        let mut a = ToolAnnotations::with_title(title);
        a.read_only_hint = Some(read_only);
        a.open_world_hint = Some(false);
        Tool::new(name, description, schema_for_type::<I>())
            .with_raw_output_schema(schema_for_output::<O>())
            .with_annotations(a)
    }
    vec![
        tool::<RunCodeIn, CellOut>(
            "run_code",
            "Run code in a fresh sandbox",
            "Run Python or R code in a fresh confined sandbox that is discarded afterwards \
             (nothing persists; use open_session for state, files and plots). Returns stdout, \
             stderr, the status and the error with its traceback. Cancelling the call \
             interrupts the code."
                .into(),
            false,
        ),
        tool::<OpenIn, OpenOut>(
            "open_session",
            "Open a persistent session",
            format!(
                "Open a persistent Python or R session (a confined interpreter whose variables \
                 and files persist across execute calls). {CLOSE_NOTE}"
            ),
            false,
        ),
        tool::<ExecuteIn, CellOut>(
            "execute",
            "Run code in a session",
            "Run code in an open session; variables persist. Returns stdout, stderr, status, \
             error and traceback, and plots the cell made (PNG files it wrote, e.g. \
             matplotlib figures) as images. Cancelling the call interrupts the code."
                .into(),
            false,
        ),
        tool::<InterruptIn, InterruptOut>(
            "interrupt",
            "Interrupt a running cell",
            "Interrupt the code running in a session (KeyboardInterrupt in Python, an \
             interrupt condition in R); the session and its variables stay."
                .into(),
            false,
        ),
        tool::<SessionIn, DoneOut>(
            "close_session",
            "Close a session",
            "End a session: its interpreter, variables and files are gone.".into(),
            false,
        ),
        tool::<NoArgs, SessionsOut>(
            "list_sessions",
            "List sessions",
            format!("List the sessions opened through this MCP connection. {CLOSE_NOTE}"),
            true,
        ),
        tool::<InspectIn, InspectOut>(
            "inspect_variables",
            "Inspect a session's variables",
            "List a session's variables: name, type, approximate size, shape and a short \
             representation. Runs no code."
                .into(),
            true,
        ),
        tool::<UploadIn, UploadOut>(
            "upload_file",
            "Upload a file to a session",
            format!(
                "Store a file in a session's directory (the code's working directory), given \
                 as text or base64; at most {MAX_UPLOAD_BYTES} bytes."
            ),
            false,
        ),
        tool::<DownloadIn, DownloadOut>(
            "download_file",
            "Download a file from a session",
            "Read a file of a session's directory: text as text, images as image content, \
             other bytes as base64; at most 1 MiB per call (offset pages on)."
                .into(),
            true,
        ),
        tool::<SessionIn, FilesOut>(
            "list_files",
            "List a session's files",
            "List the entries of a session's directory with size, media type and modification \
             time."
                .into(),
            true,
        ),
        tool::<FileIn, DoneOut>(
            "delete_file",
            "Delete a session file",
            "Remove a file, a symlink or an empty directory from a session's directory.".into(),
            false,
        ),
        tool::<EnvironmentsIn, EnvironmentsOut>(
            "list_environments",
            "List environments",
            "List the environments sandcell serves (python, pydata, r, ...) with their \
             language, interpreter version, readiness and, on request, installed packages."
                .into(),
            true,
        ),
    ]
}

// ---------------------------------------------------------------- the server

/// A failed tool call: a daemon refusal or a local one, shown as a tool error.
struct Refusal(Value);

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Refusal(e.to_json())
    }
}

impl Refusal {
    /// A refusal by this server (`sandcell.mcp.<name>`).
    fn local(name: &str, message: impl Into<String>, parameters: Value) -> Refusal {
        Refusal(json!({
            "error": format!("sandcell.mcp.{name}"),
            "parameters": parameters,
            "message": message.into(),
        }))
    }

    fn into_result(self) -> CallToolResult {
        let name = self.0["error"].as_str().unwrap_or("error");
        let message = self.0["message"].as_str().unwrap_or("");
        let mut r = CallToolResult::error(vec![ContentBlock::text(format!("{name}: {message}"))]);
        r.structured_content = Some(self.0);
        r
    }
}

#[derive(Debug)]
struct Tracked {
    environment: String,
    detached_idle_seconds: Option<u64>,
    running_cell: Option<u64>,
    /// Opened without `detached_idle_seconds` on an owner connection that a restart of
    /// sandcelld broke: the successor keeps the session without an owner, so this server
    /// closes it when it exits ([`close_ownerless`]).
    owner_lost: bool,
}

/// The MCP server's state, shared by the calls in flight.
struct Server {
    socket: PathBuf,
    owner: Arc<tokio::sync::Mutex<Option<Client>>>,
    pool: Mutex<Vec<Client>>,
    in_flight: Arc<Semaphore>,
    sessions: Arc<Mutex<BTreeMap<String, Tracked>>>,
    environments: tokio::sync::OnceCell<Vec<k::Environment>>,
    /// The daemon's `max_source_bytes` as last listed ([`source_cap`]); 0 before any listing.
    source_cap: AtomicU64,
    tools: Vec<Tool>,
}

type Reply = Result<CallToolResult, Refusal>;

fn args<T: DeserializeOwned>(a: Option<serde_json::Map<String, Value>>) -> Result<T, Refusal> {
    serde_json::from_value(Value::Object(a.unwrap_or_default())).map_err(|e| {
        Refusal::local(
            "InvalidArguments",
            format!("the arguments do not match the tool's input schema: {e}"),
            json!({}),
        )
    })
}

/// The daemon's `max_source_bytes` as `ListEnvironments` reports it (the smallest of its
/// environments' `limits.source_bytes`), at most [`MAX_CODE_BYTES`]; that ceiling when no
/// environment reports it.
fn source_cap(envs: &[k::Environment]) -> u64 {
    envs.iter()
        .filter_map(|e| e.limits.as_ref()?.source_bytes)
        .min()
        .unwrap_or(MAX_CODE_BYTES)
        .min(MAX_CODE_BYTES)
}

fn structured<T: Serialize>(content: Vec<ContentBlock>, v: &T) -> CallToolResult {
    let v = serde_json::to_value(v).unwrap_or(Value::Null);
    let mut r = if content.is_empty() {
        CallToolResult::structured(v)
    } else {
        let mut r = CallToolResult::success(content);
        r.structured_content = Some(v);
        r
    };
    r.is_error = Some(false);
    r
}

fn status_text(s: Status) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{s:?}"))
}

impl Server {
    /// A pooled connection, or a new one. A pooled connection that sandcelld has closed (a
    /// restart while it was idle: [`Client::is_closed`]) is dropped with the rest of the pool,
    /// which dates from the same daemon, so that no call is sent on it and cut.
    async fn conn(&self) -> Result<Client, Refusal> {
        let pooled = self.pool.lock().unwrap().pop();
        match pooled {
            Some(c) if !c.is_closed() => Ok(c),
            Some(_) => {
                self.pool.lock().unwrap().clear();
                Ok(Client::connect(&self.socket).await?)
            }
            None => Ok(Client::connect(&self.socket).await?),
        }
    }

    fn put_back(&self, c: Client) {
        let mut p = self.pool.lock().unwrap();
        if p.len() < POOL_IDLE {
            p.push(c);
        }
    }

    /// Runs `f` on a pooled connection; the connection is kept when the call got an answer.
    async fn with_conn<T>(
        &self,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, Error>,
    ) -> Result<T, Refusal> {
        let mut c = self.conn().await?;
        let r = f(&mut c).await;
        if matches!(r, Ok(_) | Err(Error::Kernel(_))) {
            self.put_back(c);
        }
        Ok(r?)
    }

    async fn environments(&self) -> Result<&Vec<k::Environment>, Refusal> {
        self.environments
            .get_or_try_init(|| self.list_environments())
            .await
    }

    /// `ListEnvironments`, noting the daemon's `max_source_bytes` on the way.
    async fn list_environments(&self) -> Result<Vec<k::Environment>, Refusal> {
        let envs = self
            .with_conn(async |c| c.list_environments().await)
            .await?;
        self.source_cap.store(source_cap(&envs), Ordering::Relaxed);
        Ok(envs)
    }

    /// Refuses code longer than the daemon's `max_source_bytes` before it is sent, with the
    /// error the daemon would give (`LimitExceeded`, limit `max_source_bytes`). The figure is
    /// listed again before a refusal, in case an operator raised it since.
    async fn check_code(&self, code: &str) -> Result<(), Refusal> {
        let len = code.len() as u64;
        if self.source_cap.load(Ordering::Relaxed) == 0 {
            self.environments().await?;
        }
        if len <= self.source_cap.load(Ordering::Relaxed) {
            return Ok(());
        }
        let max = if len <= MAX_CODE_BYTES {
            source_cap(&self.list_environments().await?)
        } else {
            self.source_cap.load(Ordering::Relaxed)
        };
        if len <= max {
            return Ok(());
        }
        let mut e = Error::Kernel(KernelError::LimitExceeded {
            limit: "max_source_bytes".into(),
            value: len,
            max,
        })
        .to_json();
        if let Some(Value::String(m)) = e.get_mut("message") {
            m.push_str(" (refused by sandcellctl mcp before sending)");
        }
        Err(Refusal(e))
    }

    /// The name and language of `environment` (default `python`), from `ListEnvironments`,
    /// and whether it is its language's default (then the call names only the language, as
    /// other clients do).
    async fn language(&self, environment: Option<&str>) -> Result<(String, String, bool), Refusal> {
        let name = environment.unwrap_or("python");
        let envs = self.environments().await?;
        match envs.iter().find(|e| e.name == name) {
            Some(e) => Ok((e.name.clone(), e.language.clone(), e.default)),
            None => Err(Refusal(
                Error::Kernel(KernelError::NoSuchEnvironment {
                    environment: name.into(),
                    known: envs.iter().map(|e| e.name.clone()).collect(),
                })
                .to_json(),
            )),
        }
    }

    async fn dispatch(&self, p: CallToolRequestParams, ctx: &RequestContext<RoleServer>) -> Reply {
        let a = p.arguments;
        match p.name.as_ref() {
            "run_code" => {
                let i: RunCodeIn = args(a)?;
                self.check_code(&i.code).await?;
                let (env, lang, default) = self.language(i.environment.as_deref()).await?;
                let params = k::RunParams {
                    language: lang,
                    code: i.code,
                    limits: i.limits.as_ref().map(LimitsIn::to_limits),
                    environment: (!default).then_some(env),
                    host_calls: None,
                    display_last_expression: None,
                    rich_output: None,
                    egress: None,
                };
                // A one-shot run ends with a restart of sandcelld: nothing to follow.
                self.cell(ctx, None, None, async |c: &mut Client| {
                    c.run_with(&params).await
                })
                .await
            }
            "execute" => {
                let i: ExecuteIn = args(a)?;
                self.check_code(&i.code).await?;
                let s = i.session.clone();
                // A cell token: a restart of sandcelld that cuts the call (even before the
                // cell's number arrived) is followed by sending the same call again, which
                // follows the cell the first one started and never runs the code twice.
                let token = sandcell_client::cell_token();
                let track = CellTrack::executing(Reattach::default(), &s, &i.code, &token);
                self.cell(ctx, Some(&s), Some(track), async |c: &mut Client| {
                    c.execute_with_token(&i.session, &i.code, Some(&token))
                        .await
                })
                .await
            }
            "open_session" => self.open(args(a)?).await,
            "interrupt" => {
                let i: InterruptIn = args(a)?;
                let cell = match i.cell {
                    Some(c) => c,
                    None => self
                        .sessions
                        .lock()
                        .unwrap()
                        .get(&i.session)
                        .and_then(|t| t.running_cell)
                        .ok_or_else(|| {
                            Refusal::local(
                                "NoRunningCell",
                                "no cell of this session runs through this server; name the cell",
                                json!({"session": i.session}),
                            )
                        })?,
                };
                let r = self
                    .with_conn(async |c| c.interrupt(&i.session, cell).await)
                    .await?;
                let out = InterruptOut {
                    delivered: r.delivered,
                    reason: r.reason,
                };
                Ok(structured(vec![], &out))
            }
            "close_session" => {
                let i: SessionIn = args(a)?;
                self.with_conn(async |c| c.close(&i.session).await).await?;
                self.sessions.lock().unwrap().remove(&i.session);
                Ok(structured(
                    vec![],
                    &DoneOut {
                        done: format!("closed {}", i.session),
                    },
                ))
            }
            "list_sessions" => {
                let _: NoArgs = args(a)?;
                let sessions = self
                    .sessions
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(id, t)| SessionOut {
                        session: id.clone(),
                        environment: t.environment.clone(),
                        detached_idle_seconds: t.detached_idle_seconds,
                        running_cell: t.running_cell,
                    })
                    .collect();
                Ok(structured(vec![], &SessionsOut { sessions }))
            }
            "inspect_variables" => {
                let i: InspectIn = args(a)?;
                let (vars, truncated) = self
                    .with_conn(async |c| c.inspect(&i.session, i.max_items).await)
                    .await?;
                let variables = vars
                    .into_iter()
                    .map(|v| VariableOut {
                        name: v.name,
                        kind: v.kind,
                        size_bytes: v.size_bytes,
                        shape: v.shape,
                        repr: v.repr,
                    })
                    .collect();
                Ok(structured(
                    vec![],
                    &InspectOut {
                        variables,
                        truncated,
                    },
                ))
            }
            "upload_file" => self.upload(args(a)?).await,
            "download_file" => self.download(args(a)?).await,
            "list_files" => {
                let i: SessionIn = args(a)?;
                let (files, truncated) = self
                    .with_conn(async |c| c.list_files(&i.session).await)
                    .await?;
                let files = files.iter().map(FileOut::from).collect();
                Ok(structured(vec![], &FilesOut { files, truncated }))
            }
            "delete_file" => {
                let i: FileIn = args(a)?;
                self.with_conn(async |c| c.delete_file(&i.session, &i.name).await)
                    .await?;
                Ok(structured(
                    vec![],
                    &DoneOut {
                        done: format!("deleted {}", i.name),
                    },
                ))
            }
            "list_environments" => {
                let i: EnvironmentsIn = args(a)?;
                let envs = self.list_environments().await?;
                let with_packages = i.packages.unwrap_or(false);
                let environments = envs
                    .into_iter()
                    .map(|e| EnvironmentOut {
                        name: e.name,
                        language: e.language,
                        engine: e.engine,
                        default: e.default,
                        interpreter_version: e.interpreter_version,
                        ready: e.ready,
                        packages: if with_packages {
                            e.packages
                                .into_iter()
                                .map(|p| PackageOut {
                                    name: p.name,
                                    version: p.version,
                                })
                                .collect()
                        } else {
                            vec![]
                        },
                        packages_truncated: with_packages && e.packages_truncated,
                    })
                    .collect();
                Ok(structured(vec![], &EnvironmentsOut { environments }))
            }
            other => Err(Refusal::local(
                "NoSuchTool",
                format!("no tool named {other:?}"),
                json!({"tool": other}),
            )),
        }
    }

    async fn open(&self, i: OpenIn) -> Reply {
        if self.sessions.lock().unwrap().len() >= MAX_TRACKED_SESSIONS {
            return Err(Refusal::local(
                "TooManySessions",
                format!("this MCP connection has {MAX_TRACKED_SESSIONS} sessions open; close one"),
                json!({"max": MAX_TRACKED_SESSIONS}),
            ));
        }
        let (env, lang, default) = self.language(i.environment.as_deref()).await?;
        let params = k::OpenParams {
            language: lang,
            limits: i.limits.as_ref().map(LimitsIn::to_limits),
            detached_idle_seconds: i.detached_idle_seconds,
            environment: (!default).then(|| env.clone()),
            host_calls: None,
            display_last_expression: None,
            rich_output: None,
            egress: None,
        };
        let mut owner = self.owner.lock().await;
        if owner.as_ref().is_some_and(Client::is_closed) {
            // Closed by a restart of sandcelld while idle.
            lose_owner(&mut owner, &self.sessions);
        }
        if owner.is_none() {
            *owner = Some(Client::connect(&self.socket).await?);
        }
        let mut r = owner
            .as_mut()
            .expect("connected above")
            .open_with(&params)
            .await;
        if let Err(e) = &r
            && !matches!(e, Error::Kernel(_))
        {
            lose_owner(&mut owner, &self.sessions);
            // An open that never reached the daemon (the connection was closed by a restart
            // while idle) is sent once more, on a new owner connection.
            if e.is_unsent() {
                let mut c = Client::connect(&self.socket).await?;
                r = c.open_with(&params).await;
                if matches!(&r, Ok(_) | Err(Error::Kernel(_))) {
                    *owner = Some(c);
                }
            }
        }
        let r = r?;
        drop(owner);
        self.sessions.lock().unwrap().insert(
            r.session.clone(),
            Tracked {
                environment: env.clone(),
                detached_idle_seconds: i.detached_idle_seconds,
                running_cell: None,
                owner_lost: false,
            },
        );
        Ok(structured(
            vec![],
            &OpenOut {
                session: r.session,
                environment: env,
                engine: r.engine,
                detached_idle_seconds: i.detached_idle_seconds,
            },
        ))
    }

    /// Runs a cell started by `start` on a connection of its own: streams progress, turns a
    /// cancellation into `Interrupt`, and collects the result with the cell's images. With a
    /// `track` ([`CellTrack::executing`]), a call cut by a restart of sandcelld is followed
    /// into the successor ([`Client::next_frame_following`]): output already sent as progress
    /// is not sent again, and the result is the continued cell's.
    async fn cell(
        &self,
        ctx: &RequestContext<RoleServer>,
        session: Option<&str>,
        mut track: Option<CellTrack>,
        start: impl AsyncFnOnce(&mut Client) -> Result<(), Error>,
    ) -> Reply {
        let mut c = self.conn().await?;
        if let Err(e) = start(&mut c).await {
            // A call cut while it was sent is followed like one cut later: its repeat
            // starts the cell if the first never reached the daemon.
            if !(track.is_some() && e.is_call_cut()) {
                if matches!(e, Error::Kernel(_)) {
                    self.put_back(c);
                }
                return Err(e.into());
            }
        }
        // The cell's (session, cell), once `started` arrives; a cancellation waits for it.
        let (started_tx, mut started_rx) = watch::channel(None::<(String, u64)>);
        let ct = ctx.ct.clone();
        let socket = self.socket.clone();
        let interrupter = tokio::spawn(async move {
            ct.cancelled().await;
            let started = match started_rx.wait_for(Option::is_some).await {
                Ok(v) => v.clone(),
                Err(_) => return,
            };
            let Some((s, cell)) = started else { return };
            if let Ok(mut c) = Client::connect(&socket).await {
                let _ = c.interrupt(&s, cell).await;
            }
        });
        let progress = ctx.meta.get_progress_token();
        let peer = ctx.peer.clone();
        let mut chunks = 0u64;
        let mut stdout = String::new();
        let mut stderr = String::new();
        let mut ids = (String::new(), 0u64);
        let result = loop {
            let got = match track.as_mut() {
                Some(t) => c.next_frame_following(t).await,
                None => c.next_frame().await,
            };
            // A repeat of a cell that never ran starts it under a new number, which the
            // follower passes on without a second `started` frame.
            if let (Some(t), Some(cell)) = (&track, track.as_ref().and_then(CellTrack::cell))
                && t.reattached() > 0
                && !ids.0.is_empty()
                && cell != ids.1
            {
                ids.1 = cell;
                self.set_running(session, Some(cell));
                let _ = started_tx.send(Some((ids.0.clone(), cell)));
            }
            let f = match got {
                Ok(f) => f,
                Err(e) => {
                    interrupter.abort();
                    self.set_running(session, None);
                    if matches!(e, Error::Kernel(_)) {
                        // A refusal ends the call: the connection is clean.
                        self.put_back(c);
                    }
                    return Err(e.into());
                }
            };
            if let Some(s) = f.started {
                ids = (s.session.clone(), s.cell);
                self.set_running(session, Some(s.cell));
                let _ = started_tx.send(Some((s.session, s.cell)));
            }
            if let Some(o) = f.output {
                match o.stream {
                    k::Stream::Stdout => stdout.push_str(&o.text),
                    k::Stream::Stderr => stderr.push_str(&o.text),
                }
                if let Some(token) = &progress {
                    chunks += 1;
                    let mut text = o.text;
                    if text.len() > MAX_PROGRESS_TEXT {
                        let mut cut = MAX_PROGRESS_TEXT;
                        while !text.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        text.truncate(cut);
                    }
                    let mut n = ProgressNotificationParam::new(token.clone(), chunks as f64);
                    n.message = Some(text);
                    let _ = peer.notify_progress(n).await;
                }
            }
            if let Some(r) = f.result {
                break r;
            }
        };
        interrupter.abort();
        self.set_running(session, None);
        // The SDK drops the response to a cancelled request (MCP "Cancellation": the receiver
        // should not respond), so the last progress notification says how the cell ended.
        if ctx.ct.is_cancelled()
            && let Some(token) = &progress
        {
            let mut n = ProgressNotificationParam::new(token.clone(), (chunks + 1) as f64);
            n.message = Some(format!("[status: {}]", status_text(result.status)));
            let _ = peer.notify_progress(n).await;
        }
        if result.session_ended
            && let Some(s) = session
        {
            self.sessions.lock().unwrap().remove(s);
        }
        let (session_id, cell) = ids;
        let mut content = Vec::new();
        let mut images = Vec::new();
        let mut omitted = Vec::new();
        // The stream ended with its result: the connection is clean for the next call.
        self.put_back(c);
        if !result.session_ended && session.is_some() {
            for f in result
                .files
                .iter()
                .filter(|f| f.media_type == "image/png" && f.kind == k::FileKind::File)
            {
                if images.len() >= MAX_IMAGES || f.size > MAX_IMAGE_BYTES {
                    omitted.push(f.name.clone());
                    continue;
                }
                match self
                    .with_conn(async |c| {
                        c.get_file_chunk(&session_id, &f.name, 0, Some(MAX_IMAGE_BYTES))
                            .await
                    })
                    .await
                {
                    Ok((_, bytes, true)) => {
                        content.push(ContentBlock::image(k::encode_base64(&bytes), "image/png"));
                        images.push(f.name.clone());
                    }
                    _ => omitted.push(f.name.clone()),
                }
            }
        }
        let out = CellOut {
            session: session_id,
            cell,
            status: status_text(result.status),
            stdout_truncated_bytes: result.stdout.seen.saturating_sub(result.stdout.kept),
            stderr_truncated_bytes: result.stderr.seen.saturating_sub(result.stderr.kept),
            error: result.error.as_ref().map(|e| CellErrorOut {
                kind: e.kind.clone(),
                message: e.message.clone(),
                traceback: e.traceback.clone(),
            }),
            wall_seconds: result.usage.wall_seconds,
            files: result.files.iter().map(|f| f.name.clone()).collect(),
            images,
            images_omitted: omitted,
            session_ended: result.session_ended || session.is_none(),
            stdout,
            stderr,
        };
        let mut text = Vec::new();
        if !out.stdout.is_empty() {
            text.push(ContentBlock::text(out.stdout.clone()));
        }
        if !out.stderr.is_empty() {
            text.push(ContentBlock::text(format!("[stderr]\n{}", out.stderr)));
        }
        let mut summary = format!("[status: {}]", out.status);
        if let Some(e) = &out.error {
            summary.push_str(&format!(
                "\n{}: {}\n{}",
                e.kind,
                e.message,
                e.traceback.as_deref().unwrap_or("")
            ));
        }
        for (stream, n) in [
            ("stdout", out.stdout_truncated_bytes),
            ("stderr", out.stderr_truncated_bytes),
        ] {
            if n > 0 {
                summary.push_str(&format!("\n[{stream}: {n} bytes cut]"));
            }
        }
        text.push(ContentBlock::text(summary));
        text.append(&mut content);
        let mut r = structured(text, &out);
        r.is_error = Some(result.status != Status::Ok);
        Ok(r)
    }

    fn set_running(&self, session: Option<&str>, cell: Option<u64>) {
        if let Some(s) = session
            && let Some(t) = self.sessions.lock().unwrap().get_mut(s)
        {
            t.running_cell = cell;
        }
    }

    async fn upload(&self, i: UploadIn) -> Reply {
        let too_big = |value: u64| {
            Refusal::local(
                "LimitExceeded",
                format!("the upload is {value} bytes; at most {MAX_UPLOAD_BYTES}"),
                json!({"limit": "upload_bytes", "value": value, "max": MAX_UPLOAD_BYTES}),
            )
        };
        let data = match (i.text, i.base64) {
            (Some(t), None) => t.into_bytes(),
            (None, Some(b)) => {
                // Decoded size is at most 3/4 of the text: refuse before decoding.
                let approx = (b.len() as u64 / 4) * 3;
                if approx > MAX_UPLOAD_BYTES + 3 {
                    return Err(too_big(approx));
                }
                k::decode_base64(b.trim()).map_err(|e| {
                    Refusal::local(
                        "InvalidArguments",
                        format!("base64 is not valid: {e}"),
                        json!({"argument": "base64"}),
                    )
                })?
            }
            _ => {
                return Err(Refusal::local(
                    "InvalidArguments",
                    "give exactly one of text and base64",
                    json!({"argument": "text"}),
                ));
            }
        };
        if data.len() as u64 > MAX_UPLOAD_BYTES {
            return Err(too_big(data.len() as u64));
        }
        let f = self
            .with_conn(async |c| c.put_bytes(&i.session, &i.name, &data).await)
            .await?;
        Ok(structured(
            vec![],
            &UploadOut {
                file: FileOut::from(&f),
            },
        ))
    }

    async fn download(&self, i: DownloadIn) -> Reply {
        let offset = i.offset.unwrap_or(0);
        let max = i
            .max_bytes
            .unwrap_or(DEFAULT_DOWNLOAD_BYTES)
            .min(k::MAX_CHUNK_BYTES);
        let (info, bytes, eof) = self
            .with_conn(async |c| {
                c.get_file_chunk(&i.session, &i.name, offset, Some(max))
                    .await
            })
            .await?;
        let image = info.media_type.starts_with("image/") && info.media_type != "image/svg+xml";
        let (encoding, data, content) = match String::from_utf8(bytes) {
            Ok(t) if !image && is_text(&t) => ("utf-8", t.clone(), vec![ContentBlock::text(t)]),
            Ok(t) if image => {
                let b = k::encode_base64(t.as_bytes());
                (
                    "base64",
                    b.clone(),
                    vec![ContentBlock::image(b, info.media_type.clone())],
                )
            }
            r => {
                let bytes = r.map_or_else(|e| e.into_bytes(), String::into_bytes);
                let b = k::encode_base64(&bytes);
                let c = if image && offset == 0 && eof {
                    ContentBlock::image(b.clone(), info.media_type.clone())
                } else {
                    ContentBlock::text(format!("base64: {b}"))
                };
                ("base64", b, vec![c])
            }
        };
        let n = match encoding {
            "utf-8" => data.len() as u64,
            _ => k::decode_base64(&data).map(|d| d.len() as u64).unwrap_or(0),
        };
        Ok(structured(
            content,
            &DownloadOut {
                file: FileOut::from(&info),
                offset,
                bytes: n,
                eof,
                encoding: encoding.into(),
                data,
            },
        ))
    }
}

impl ServerHandler for Server {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("sandcell", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "sandcell runs Python and R code in confined sandboxes on this machine. \
                 run_code for one-off code; open_session, execute and close_session for state \
                 kept across calls, files and plots. Sessions opened without \
                 detached_idle_seconds end when this connection ends.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if !self.tools.iter().any(|t| t.name == request.name) {
            // MCP "Server: Tools", "Error Handling": an unknown tool is a protocol error,
            // JSON-RPC -32602 (Invalid params), not a tool result.
            let name = transport::truncate(&request.name, 200);
            return Err(ErrorData::invalid_params(
                format!("Unknown tool: {name:?}"),
                Some(json!({
                    "tool": name,
                    "known": self.tools.iter().map(|t| t.name.as_ref()).collect::<Vec<_>>(),
                })),
            ));
        }
        let Ok(_permit) = self.in_flight.clone().try_acquire_owned() else {
            return Ok(Refusal::local(
                "Busy",
                format!("{MAX_IN_FLIGHT} tool calls are running; retry when one has finished"),
                json!({"max": MAX_IN_FLIGHT}),
            )
            .into_result()
            .into());
        };
        let r = match self.dispatch(request, &context).await {
            Ok(r) => r,
            Err(e) => e.into_result(),
        };
        Ok(r.into())
    }
}

/// Whether `t` reads as text: no control characters but tab, line feed, form feed and
/// carriage return (valid UTF-8 alone would pass NUL bytes and escapes as "text").
fn is_text(t: &str) -> bool {
    !t.chars()
        .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r' | '\u{c}'))
}

/// One sentence for a failure of [`serve`]: a failed read or write of standard input or
/// output is named as such (`rmcp` words it with the transport's Rust type name).
pub fn describe_failure(e: &anyhow::Error) -> String {
    let io = e.chain().find_map(|c| {
        c.downcast_ref::<std::io::Error>()
            .or_else(|| {
                c.downcast_ref::<rmcp::transport::DynamicTransportError>()
                    .and_then(|t| t.error.downcast_ref::<std::io::Error>())
            })
            .or_else(
                || match c.downcast_ref::<rmcp::service::ServerInitializeError>() {
                    Some(rmcp::service::ServerInitializeError::TransportError {
                        error, ..
                    }) => error.error.downcast_ref::<std::io::Error>(),
                    _ => None,
                },
            )
    });
    match io {
        Some(io) if io.kind() == std::io::ErrorKind::BrokenPipe => {
            "standard output was closed (the MCP client stopped reading)".into()
        }
        Some(io) => format!("reading standard input or writing standard output failed: {io}"),
        None => format!("{e:#}"),
    }
}

/// Forgets the owner connection, which broke. The sessions it owned live on after a restart
/// of sandcelld, in the successor and without an owner (until `max_detached_idle_seconds`
/// idle, sandcelld(8)); after a stop they are gone. They stay listed, and this server closes
/// them when it exits ([`close_ownerless`]), so that they still end with it.
fn lose_owner(owner: &mut Option<Client>, sessions: &Mutex<BTreeMap<String, Tracked>>) {
    *owner = None;
    for t in sessions.lock().unwrap().values_mut() {
        t.owner_lost |= t.detached_idle_seconds.is_none();
    }
}

/// How long the exit may spend closing sessions whose owner connection was lost; the MCP
/// client that closed stdin waits before it sends SIGTERM (MCP "Lifecycle", stdio shutdown).
pub const EXIT_CLOSE: std::time::Duration = std::time::Duration::from_secs(5);

/// At exit: closes, on one new connection, each session opened without
/// `detached_idle_seconds` whose owner connection a restart of sandcelld broke (the owner is
/// checked here too, for a restart no later call noticed). Sessions of an intact owner end
/// as it closes with this process. Best effort within [`EXIT_CLOSE`] (waiting for an
/// `open_session` still in flight included): a session already gone (the daemon was
/// stopped, not restarted) or a daemon that does not answer is skipped. Returns how many
/// were closed.
async fn close_ownerless(
    socket: &std::path::Path,
    owner: &tokio::sync::Mutex<Option<Client>>,
    sessions: &Mutex<BTreeMap<String, Tracked>>,
) -> usize {
    tokio::time::timeout(EXIT_CLOSE, close_ownerless_now(socket, owner, sessions))
        .await
        .unwrap_or(0)
}

/// [`close_ownerless`] without its time bound.
async fn close_ownerless_now(
    socket: &std::path::Path,
    owner: &tokio::sync::Mutex<Option<Client>>,
    sessions: &Mutex<BTreeMap<String, Tracked>>,
) -> usize {
    let mut owner = owner.lock().await;
    if owner.as_ref().is_some_and(Client::is_closed) {
        lose_owner(&mut owner, sessions);
    }
    drop(owner);
    let ids: Vec<String> = sessions
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, t)| t.owner_lost)
        .map(|(id, _)| id.clone())
        .collect();
    if ids.is_empty() {
        return 0;
    }
    let Ok(mut c) = Client::connect(socket).await else {
        return 0;
    };
    let mut closed = 0;
    for id in &ids {
        if c.close(id).await.is_ok() {
            closed += 1;
        }
    }
    closed
}

/// How [`serve`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The MCP client closed stdin.
    Eof,
    /// SIGTERM or SIGINT arrived. The caller should end the process at once: a blocking
    /// read of a terminal's stdin cannot be cancelled, and the runtime's shutdown would wait
    /// for it.
    Signal,
}

/// Serves MCP over stdin and stdout until the client closes stdin, or SIGTERM or SIGINT
/// arrives (at any time, before `initialize` too). Sessions opened without
/// `detached_idle_seconds` end then: their owner connection closes with this process, and
/// those a restart of sandcelld left without an owner are closed ([`close_ownerless`], at
/// most [`EXIT_CLOSE`]). After the end of stdin the SDK first lets calls in flight finish,
/// for at most 5 s; a signal drops them at once. A second signal ends the process at once,
/// with status 128 + its number (143 for SIGTERM, 130 for SIGINT).
/// Errors: the transport failed to start or ended abnormally.
pub async fn serve(socket: PathBuf) -> anyhow::Result<Ended> {
    use tokio::signal::unix::{SignalKind, signal};
    let owner = Arc::new(tokio::sync::Mutex::new(None));
    let sessions = Arc::new(Mutex::new(BTreeMap::new()));
    let server = Server {
        socket: socket.clone(),
        owner: owner.clone(),
        pool: Mutex::new(Vec::new()),
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        sessions: sessions.clone(),
        environments: tokio::sync::OnceCell::new(),
        source_cap: AtomicU64::new(0),
        tools: tools(),
    };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut first = Some(first_tx);
        loop {
            let n = tokio::select! {
                _ = term.recv() => 15,
                _ = int.recv() => 2,
            };
            match first.take() {
                Some(tx) => {
                    let _ = tx.send(());
                }
                None => std::process::exit(128 + n),
            }
        }
    });
    let (r, w) = rmcp::transport::io::stdio_pipes();
    let transport = transport::LineTransport::new(r, w, MAX_LINE_BYTES);
    let serving = async move {
        let running = server.serve(transport).await?;
        running.waiting().await?;
        anyhow::Ok(())
    };
    let ended = tokio::select! {
        r = serving => r.map(|()| Ended::Eof),
        _ = first_rx => Ok(Ended::Signal),
    };
    close_ownerless(&socket, &owner, &sessions).await;
    ended
}
