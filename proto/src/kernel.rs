//! The `org.sandcell.Kernel` Varlink interface: types shared by `sandcelld` and its clients.
//!
//! The IDL in `org.sandcell.Kernel.varlink` (this crate's root) is the contract; the types here
//! mirror it field by field and a test checks that every method and error of the IDL has its
//! Rust counterpart. Sizes are bytes, times seconds.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::worker::{CellError, Stream};

/// The interface name.
pub const INTERFACE: &str = "org.sandcell.Kernel";

/// The IDL text served by `org.varlink.service.GetInterfaceDescription`.
pub const IDL: &str = include_str!("../org.sandcell.Kernel.varlink");

/// Default socket path of the data plane.
pub const DEFAULT_SOCKET: &str = "/run/sandcell/org.sandcell.Kernel";

/// Languages a session can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// CPython inside Eryx (WebAssembly).
    Python,
    /// Native R.
    R,
}

impl Language {
    /// `"python"` or `"r"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::R => "r",
        }
    }

    /// Parses `python` / `r` (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "python" | "py" => Some(Language::Python),
            "r" => Some(Language::R),
            _ => None,
        }
    }
}

/// Per-session limits a client may ask for; each can only lower the operator's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Wall-time limit of one cell, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time_seconds: Option<f64>,
    /// WebAssembly fuel budget of one cell (Python only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// Interpreter memory limit in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_memory_bytes: Option<u64>,
    /// Bytes of stdout kept per cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_bytes: Option<u64>,
    /// Bytes of stderr kept per cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_bytes: Option<u64>,
}

/// Parameters of `Run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunParams {
    /// `python` or `r`.
    pub language: String,
    /// The cell's source, UTF-8.
    pub code: String,
    /// Optional lower limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// Environment name (see `ListEnvironments`); absent: the language's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

/// Parameters of `Open`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenParams {
    /// `python` or `r`.
    pub language: String,
    /// Optional lower limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// Keep the session after the connection ends, for this many idle seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detached_idle_seconds: Option<u64>,
    /// Environment name (see `ListEnvironments`); absent: the language's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

/// Most packages `ListEnvironments` lists per environment.
pub const MAX_LISTED_PACKAGES: usize = 500;

/// One installed package of an environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Package {
    /// Distribution (Python) or package (R) name.
    pub name: String,
    /// Its version string.
    pub version: String,
}

/// A named environment, as `ListEnvironments` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    /// Name, e.g. `python`, `pydata`, `r`.
    pub name: String,
    /// `python` or `r`.
    pub language: String,
    /// `eryx` or `native`.
    pub engine: String,
    /// The language's default environment.
    pub default: bool,
    /// Interpreter version, e.g. `CPython 3.11.2` (empty when not ready).
    pub interpreter_version: String,
    /// A confined probe session started and ran a cell at daemon start.
    pub ready: bool,
    /// Why not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Installed packages in name order, at most [`MAX_LISTED_PACKAGES`].
    #[serde(default)]
    pub packages: Vec<Package>,
    /// More packages are installed than listed.
    #[serde(default)]
    pub packages_truncated: bool,
}

/// Parameters of `ListEnvironments` (none).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListEnvironmentsParams {}

/// Reply of `ListEnvironments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListEnvironmentsReply {
    /// Every environment served, in name order.
    pub environments: Vec<Environment>,
}

/// Reply of `Open`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenReply {
    /// Session id (opaque, URL-safe).
    pub session: String,
    /// The interpreter's description.
    pub engine: String,
}

/// Parameters of `Execute`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecuteParams {
    /// Session id from `Open`.
    pub session: String,
    /// The cell's source, UTF-8.
    pub code: String,
}

/// Parameters of `Interrupt`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptParams {
    /// Session id.
    pub session: String,
    /// Cell number from the `started` frame.
    pub cell: u64,
}

/// Reply of `Interrupt`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterruptReply {
    /// Whether SIGINT reached the named, running cell.
    pub delivered: bool,
    /// `delivered`, `not_running` (no cell runs), `other_cell` (another cell runs),
    /// `session_ending`.
    pub reason: String,
}

/// Parameters of `Close`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloseParams {
    /// Session id.
    pub session: String,
}

/// First frame of a cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Started {
    /// Session id.
    pub session: String,
    /// Cell number within the session, from 1.
    pub cell: u64,
}

/// A chunk of output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// Cell number.
    pub cell: u64,
    /// Frame sequence number within the cell, from 0.
    pub seq: u64,
    /// `stdout` or `stderr`.
    pub stream: Stream,
    /// Text; invalid UTF-8 bytes escaped as `\xNN`.
    pub text: String,
}

/// Output accounting of one stream, in bytes of the original output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamStats {
    /// Bytes the cell wrote.
    pub seen: u64,
    /// Bytes sent to the client.
    pub kept: u64,
    /// `seen > kept`.
    pub truncated: bool,
}

/// Resource use of one cell.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Wall time from request to result, seconds.
    pub wall_seconds: f64,
    /// CPU time of the worker and its children during the cell, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<f64>,
    /// Peak memory charged to the session's cgroup, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// WebAssembly fuel consumed (Python).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
}

/// How a cell ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ran to its end.
    Ok,
    /// Raised an error.
    Error,
    /// Stopped by `Interrupt`.
    Interrupted,
    /// Wall-time limit reached.
    Timeout,
    /// Fuel budget used up (Python).
    FuelExhausted,
    /// Interpreter memory limit reached inside the interpreter (MemoryError, R allocation error).
    MemoryExhausted,
    /// The kernel OOM-killed the worker at its cgroup memory limit.
    Oom,
    /// The cell ended the interpreter (`sys.exit`, `quit()`), see `exit_code`.
    Exited,
    /// The worker died or broke the protocol.
    WorkerCrashed,
    /// The client went away or the session was closed while the cell ran.
    Cancelled,
}

impl Status {
    /// The status as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Interrupted => "interrupted",
            Status::Timeout => "timeout",
            Status::FuelExhausted => "fuel_exhausted",
            Status::MemoryExhausted => "memory_exhausted",
            Status::Oom => "oom",
            Status::Exited => "exited",
            Status::WorkerCrashed => "worker_crashed",
            Status::Cancelled => "cancelled",
        }
    }
}

/// What became of the session's variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// As the cell left them.
    Kept,
    /// Restored as they were before the cell.
    Restored,
    /// Gone.
    Lost,
    /// One-shot Run: there is no session to keep.
    None,
}

/// The result of a cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    /// Cell number.
    pub cell: u64,
    /// How it ended.
    pub status: Status,
    /// The error raised by the code, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CellError>,
    /// Exit code for `exited`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    /// Resource use.
    pub usage: Usage,
    /// stdout accounting.
    pub stdout: StreamStats,
    /// stderr accounting.
    pub stderr: StreamStats,
    /// What became of the variables.
    pub state: State,
    /// Whether the session ended with this cell.
    pub session_ended: bool,
    /// Warnings raised by the cell.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// Entries of the session directory the cell created or changed (lstat, never followed).
    #[serde(default)]
    pub files: Vec<FileInfo>,
}

/// Largest decoded `data` of one `PutFile` call, bytes: base64 of it fits the daemon's 4 MiB
/// message bound. Bigger files are passed as a descriptor.
pub const MAX_INLINE_BYTES: u64 = 2 * 1024 * 1024;

/// Default and ceiling of `GetFile`'s `max_bytes`, bytes.
pub const MAX_CHUNK_BYTES: u64 = 1024 * 1024;

/// What a directory entry is, by `lstat` (a symlink is never followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (reported, never followed or read).
    Symlink,
    /// A FIFO, socket or device node.
    Special,
}

impl FileKind {
    /// The kind as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Dir => "dir",
            FileKind::Symlink => "symlink",
            FileKind::Special => "special",
        }
    }
}

/// One entry of a session directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Path relative to the session directory, `/`-separated.
    pub name: String,
    /// Bytes (`st_size`; of the link itself for a symlink, 0 for directories and specials).
    pub size: u64,
    /// Guessed from the extension ([`media_type`]).
    pub media_type: String,
    /// What the entry is.
    pub kind: FileKind,
    /// Last modification, seconds since the Unix epoch.
    pub modified: f64,
}

/// The media type of a file named `name`, from its extension (case-insensitive);
/// `application/octet-stream` when unknown.
pub fn media_type(name: &str) -> &'static str {
    let ext = name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "pdf" => "application/pdf",
        "csv" => "text/csv",
        "tsv" => "text/tab-separated-values",
        "txt" | "log" | "md" | "r" | "py" => "text/plain",
        "json" => "application/json",
        "html" | "htm" => "text/html",
        "xml" => "application/xml",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        "parquet" => "application/vnd.apache.parquet",
        _ => "application/octet-stream",
    }
}

/// Standard base64 (RFC 4648, padded) of `bytes`, as `data` fields carry it.
pub fn encode_base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes a `data` field (standard base64, padded). Errors: the text is not base64.
pub fn decode_base64(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(text)
}

/// Parameters of `PutFile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutFileParams {
    /// Session id.
    pub session: String,
    /// Relative path in the session directory.
    pub name: String,
    /// Declared size, bytes; must match the content.
    pub size: u64,
    /// Content, base64 (at most [`MAX_INLINE_BYTES`] decoded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// Index of the descriptor passed with the call (0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd: Option<u64>,
}

/// Reply of `PutFile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PutFileReply {
    /// The stored file.
    pub file: FileInfo,
}

/// Parameters of `ListFiles`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListFilesParams {
    /// Session id.
    pub session: String,
}

/// Reply of `ListFiles`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListFilesReply {
    /// Entries, sorted by name.
    pub files: Vec<FileInfo>,
    /// The walk stopped at its entry or depth bound.
    pub truncated: bool,
}

/// Parameters of `GetFile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetFileParams {
    /// Session id.
    pub session: String,
    /// Relative path in the session directory.
    pub name: String,
    /// First byte to read (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// Bytes to read at most (default and ceiling [`MAX_CHUNK_BYTES`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// Reply of `GetFile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetFileReply {
    /// The file as opened.
    pub file: FileInfo,
    /// The bytes read, base64.
    pub data: String,
    /// `offset` + bytes read reached the end of the file.
    pub eof: bool,
}

/// Parameters of `DeleteFile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteFileParams {
    /// Session id.
    pub session: String,
    /// Relative path in the session directory.
    pub name: String,
}

/// One streamed frame of `Run` / `Execute`: exactly one field is set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Frame {
    /// First frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<Started>,
    /// Output chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Output>,
    /// Last frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<CellResult>,
}

/// Reply parameters of `Run` and `Execute`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameReply {
    /// The frame.
    pub frame: Frame,
}

/// The errors of `org.sandcell.Kernel`, as in the IDL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "error", content = "parameters")]
pub enum KernelError {
    /// A parameter is missing or malformed.
    #[serde(rename = "org.sandcell.Kernel.InvalidParameter")]
    InvalidParameter {
        /// Parameter name.
        parameter: String,
        /// What is wrong.
        reason: String,
    },
    /// The language is not served.
    #[serde(rename = "org.sandcell.Kernel.UnsupportedLanguage")]
    UnsupportedLanguage {
        /// Requested language.
        language: String,
        /// Languages served.
        supported: Vec<String>,
    },
    /// A per-call value exceeds its limit.
    #[serde(rename = "org.sandcell.Kernel.LimitExceeded")]
    LimitExceeded {
        /// Limit name, as in the configuration (e.g. `max_source_bytes`).
        limit: String,
        /// Requested value.
        value: u64,
        /// The limit.
        max: u64,
    },
    /// Admission refused.
    #[serde(rename = "org.sandcell.Kernel.CapacityExceeded")]
    CapacityExceeded {
        /// Budget name (e.g. `max_concurrent_sessions`).
        budget: String,
        /// Amount in use.
        in_use: u64,
        /// Amount requested.
        requested: u64,
        /// The budget.
        max: u64,
    },
    /// No such session for this caller.
    #[serde(rename = "org.sandcell.Kernel.NoSuchSession")]
    NoSuchSession {
        /// Session id.
        session: String,
    },
    /// The session is running a cell.
    #[serde(rename = "org.sandcell.Kernel.SessionBusy")]
    SessionBusy {
        /// Session id.
        session: String,
        /// Running cell.
        cell: u64,
    },
    /// Authorization refused.
    #[serde(rename = "org.sandcell.Kernel.PermissionDenied")]
    PermissionDenied {
        /// polkit action id.
        action: String,
    },
    /// A worker failed to start.
    #[serde(rename = "org.sandcell.Kernel.WorkerFailed")]
    WorkerFailed {
        /// Why.
        reason: String,
    },
    /// A file name is refused.
    #[serde(rename = "org.sandcell.Kernel.InvalidFileName")]
    InvalidFileName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No entry of that name in the session directory.
    #[serde(rename = "org.sandcell.Kernel.NoSuchFile")]
    NoSuchFile {
        /// The name.
        name: String,
    },
    /// The entry is not a regular file; it is neither read nor replaced.
    #[serde(rename = "org.sandcell.Kernel.NotRegularFile")]
    NotRegularFile {
        /// The name.
        name: String,
        /// `dir`, `symlink`, `special`, or `foreign` (not owned by the session's worker).
        kind: String,
    },
    /// No environment of that name is served.
    #[serde(rename = "org.sandcell.Kernel.NoSuchEnvironment")]
    NoSuchEnvironment {
        /// The name asked for.
        environment: String,
        /// The names served.
        known: Vec<String>,
    },
    /// The environment serves another language.
    #[serde(rename = "org.sandcell.Kernel.EnvironmentMismatch")]
    EnvironmentMismatch {
        /// The name asked for.
        environment: String,
        /// The language asked for.
        language: String,
        /// The environment's language.
        environment_language: String,
    },
    /// The daemon is stopping.
    #[serde(rename = "org.sandcell.Kernel.ShuttingDown")]
    ShuttingDown {},
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = serde_json::to_value(self).unwrap_or(Value::Null);
        let name = v["error"]
            .as_str()
            .unwrap_or("?")
            .trim_start_matches("org.sandcell.Kernel.");
        write!(f, "{name}: {}", v["parameters"])
    }
}

impl std::error::Error for KernelError {}

impl KernelError {
    /// The fully qualified Varlink error name.
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// A method call as received, before its parameters are checked.
#[derive(Debug, Deserialize)]
pub struct RawCall {
    /// Fully qualified method name.
    pub method: String,
    /// Parameters object (absent means none).
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// Any error reply as received by a client.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct RawError {
    /// Fully qualified error name.
    pub error: String,
    /// Error parameters.
    #[serde(default)]
    pub parameters: Option<Value>,
}

impl RawError {
    /// Converts to a [`KernelError`] when it is one of this interface's errors.
    pub fn to_kernel_error(&self) -> Option<KernelError> {
        serde_json::from_value(serde_json::json!({
            "error": self.error,
            "parameters": self.parameters.clone().unwrap_or(Value::Object(Default::default())),
        }))
        .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_idl_method_and_error_is_known() {
        let iface = zlink::idl::Interface::try_from(IDL).expect("IDL parses");
        assert_eq!(iface.name(), INTERFACE);
        let methods: Vec<_> = iface.methods().map(|m| m.name().to_string()).collect();
        assert_eq!(
            methods,
            [
                "Run",
                "Open",
                "Execute",
                "Interrupt",
                "Close",
                "PutFile",
                "ListFiles",
                "GetFile",
                "DeleteFile",
                "ListEnvironments"
            ]
        );
        let errors: Vec<_> = iface.errors().map(|e| e.name().to_string()).collect();
        for e in &errors {
            let raw = RawError {
                error: format!("{INTERFACE}.{e}"),
                parameters: None,
            };
            // Every error must at least be recognised by name (parameters may be incomplete).
            let known = serde_json::to_string(&raw).unwrap();
            assert!(known.contains(e.as_str()));
        }
        let sample = KernelError::ShuttingDown {};
        assert!(errors.iter().any(|e| sample.name().ends_with(e.as_str())));
        assert_eq!(errors.len(), 14);
        for e in ["InvalidFileName", "NoSuchFile", "NotRegularFile"] {
            assert!(errors.iter().any(|x| x == e), "{e} missing from the IDL");
        }
        let typed = KernelError::NotRegularFile {
            name: "leak".into(),
            kind: "symlink".into(),
        };
        let raw: RawError = serde_json::from_value(serde_json::to_value(&typed).unwrap()).unwrap();
        assert_eq!(raw.to_kernel_error(), Some(typed));
    }

    #[test]
    fn errors_serialise_as_varlink_errors() {
        let e = KernelError::LimitExceeded {
            limit: "max_source_bytes".into(),
            value: 10,
            max: 5,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["error"], "org.sandcell.Kernel.LimitExceeded");
        assert_eq!(v["parameters"]["max"], 5);
        let raw: RawError = serde_json::from_value(v).unwrap();
        assert_eq!(raw.to_kernel_error(), Some(e));
    }

    #[test]
    fn file_types_round_trip() {
        let f = FileInfo {
            name: "plot-1-001.png".into(),
            size: 3,
            media_type: media_type("plot-1-001.PNG").into(),
            kind: FileKind::Symlink,
            modified: 1.5,
        };
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["kind"], "symlink");
        assert_eq!(v["media_type"], "image/png");
        assert_eq!(media_type("data.csv"), "text/csv");
        assert_eq!(media_type("noext"), "application/octet-stream");
        let data = encode_base64(b"a,b\n1,2\n");
        assert_eq!(decode_base64(&data).unwrap(), b"a,b\n1,2\n");
        assert!(decode_base64("not base64!").is_err());
        // A result without `files` (an older daemon) still parses.
        let old = r#"{"cell":1,"status":"ok","usage":{"wall_seconds":0.1},"stdout":{"seen":0,"kept":0,"truncated":false},"stderr":{"seen":0,"kept":0,"truncated":false},"state":"kept","session_ended":false}"#;
        let r: CellResult = serde_json::from_str(old).unwrap();
        assert!(r.files.is_empty());
    }

    #[test]
    fn frame_has_one_field() {
        let f = Frame {
            started: Some(Started {
                session: "s".into(),
                cell: 1,
            }),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"started":{"session":"s","cell":1}}"#
        );
    }
}
