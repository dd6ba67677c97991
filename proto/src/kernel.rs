//! The `org.sandcell.Kernel` Varlink interface: types shared by `sandcelld` and its clients.
//!
//! The IDL in `org.sandcell.Kernel.varlink` (this crate's root) is the contract; the types here
//! mirror it field by field and a test checks that every method and error of the IDL has its
//! Rust counterpart. Sizes are bytes, times seconds.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::cell::{
    CellError, DisplayKind, INSPECT_DEFAULT_ITEMS, INSPECT_MAX_ITEMS, MAX_ERROR_MESSAGE, Stream,
    Variable,
};

/// The interface name.
pub const INTERFACE: &str = "org.sandcell.Kernel";

/// The IDL text served by `org.varlink.service.GetInterfaceDescription`.
pub const IDL: &str = include_str!("../org.sandcell.Kernel.varlink");

/// Default socket path of the data plane.
pub const DEFAULT_SOCKET: &str = "/run/sandcell/org.sandcell.Kernel";

/// Largest Varlink message the daemon reads, bytes (its terminating NUL excluded); a longer
/// one ends the connection.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// A session id as the daemon makes them: 32 lowercase hex digits (128 bits from
/// `getrandom(2)`), usable as one path component, D-Bus object path element and cgroup name.
/// This is the *local* id: sessions are keyed by it.
///
/// On the wire a daemon with a node identifier gives the *node-qualified* form
/// `<node>.<local id>` ([`SessionId::qualified`]); clients may send either form. The node is
/// everything before the last dot (a node identifier may contain dots; a local id never
/// does), 1 to [`MAX_NODE_ID_LEN`] characters of `[A-Za-z0-9._-]` ([`check_node_id`]).
///
/// The one validator of session ids: the daemon's lookups, the D-Bus shim and clients all
/// parse with [`SessionId::parse`] (local ids) or [`SessionId::parse_qualified`] (either
/// form). On the wire a session id stays a `string`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

/// A string that is not a [`SessionId`]; `reason` says what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSessionId {
    /// What is wrong, e.g. "not 32 lowercase hex digits".
    pub reason: &'static str,
}

impl std::fmt::Display for InvalidSessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid session id: {}", self.reason)
    }
}

impl std::error::Error for InvalidSessionId {}

impl SessionId {
    /// Length of an id, in characters.
    pub const LEN: usize = 32;

    /// The id of 16 random bytes (the caller draws them from `getrandom(2)`).
    pub fn from_random(bytes: [u8; 16]) -> SessionId {
        use std::fmt::Write;
        let mut s = String::with_capacity(Self::LEN);
        for b in bytes {
            let _ = write!(s, "{b:02x}");
        }
        SessionId(s)
    }

    /// Parses `s`: exactly [`SessionId::LEN`] characters of `0-9a-f`.
    pub fn parse(s: &str) -> Result<SessionId, InvalidSessionId> {
        if s.len() == Self::LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(SessionId(s.to_owned()))
        } else {
            Err(InvalidSessionId {
                reason: "not 32 lowercase hex digits",
            })
        }
    }

    /// Whether `s` parses as a session id.
    pub fn is_valid(s: &str) -> bool {
        Self::parse(s).is_ok()
    }

    /// Parses a session id as a client may give it: a local id (node `None`), or
    /// `<node>.<local id>` (the node: the text before the last dot, checked by
    /// [`check_node_id`]).
    pub fn parse_qualified(s: &str) -> Result<(Option<&str>, SessionId), InvalidSessionId> {
        match s.rsplit_once('.') {
            None => Ok((None, Self::parse(s)?)),
            Some((node, local)) => {
                check_node_id(node)?;
                Ok((Some(node), Self::parse(local)?))
            }
        }
    }

    /// The id as a daemon whose node identifier is `node` gives it: `<node>.<id>`, or the
    /// local id alone when `node` is empty (qualification off).
    pub fn qualified(&self, node: &str) -> String {
        if node.is_empty() {
            self.0.clone()
        } else {
            format!("{node}.{}", self.0)
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for SessionId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for SessionId {
    type Error = InvalidSessionId;
    fn try_from(s: String) -> Result<SessionId, InvalidSessionId> {
        SessionId::parse(&s)
    }
}

impl From<SessionId> for String {
    fn from(id: SessionId) -> String {
        id.0
    }
}

/// Longest node identifier, in characters.
pub const MAX_NODE_ID_LEN: usize = 64;

/// Checks a node identifier: 1 to [`MAX_NODE_ID_LEN`] characters of `[A-Za-z0-9._-]`. (The
/// empty configuration value, which turns qualification off, is not an identifier.)
pub fn check_node_id(node: &str) -> Result<(), InvalidSessionId> {
    if node.is_empty() || node.len() > MAX_NODE_ID_LEN {
        return Err(InvalidSessionId {
            reason: "a node identifier has 1 to 64 characters",
        });
    }
    if !node
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(InvalidSessionId {
            reason: "a node identifier has only the characters A-Z a-z 0-9 . _ -",
        });
    }
    Ok(())
}

/// Longest cell token (`Execute`'s and `Submit`'s `token`), in characters.
pub const MAX_CELL_TOKEN_LEN: usize = 64;

/// How many cells' tokens a session remembers: its newest 8 cells started with one, the
/// number of finished cells whose results it retains.
pub const CELL_TOKENS_KEPT: usize = 8;

/// Checks a cell token: 1 to [`MAX_CELL_TOKEN_LEN`] characters of `[A-Za-z0-9._-]`; the
/// error is the reason, for `InvalidParameter`.
pub fn check_cell_token(token: &str) -> Result<(), &'static str> {
    if token.is_empty() || token.len() > MAX_CELL_TOKEN_LEN {
        return Err("a cell token has 1 to 64 characters");
    }
    if !token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("a cell token has only the characters A-Z a-z 0-9 . _ -");
    }
    Ok(())
}

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
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// The cell may call the client's tools (`host_call` frames, answered by `HostReply`);
    /// absent or false: a host call raises in the cell at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_calls: Option<bool>,
    /// Show the value of the cell's last expression as a REPL does (absent: true; see the
    /// IDL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_last_expression: Option<bool>,
    /// Rich output (absent: false): the cell's last expression, explicit display calls and
    /// figures come as [`Display`] frames (MIME bundles) instead of stdout text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rich_output: Option<bool>,
    /// A subset of the environment's egress allowlist for this session: host names and
    /// leading-`*.` wildcard domains (at most 256, each at most 253 characters), every one
    /// within the environment's list (absent: the environment's whole list). An entry
    /// outside it, or any entry for an environment without egress, is `InvalidParameter`
    /// with parameter `egress` naming it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<String>>,
}

/// Parameters of `Open`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// The session's cells may call the client's tools (see [`RunParams::host_calls`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_calls: Option<bool>,
    /// Show the value of each cell's last expression as a REPL does (absent: true; see
    /// `Run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_last_expression: Option<bool>,
    /// Rich output for every cell of the session (absent: false; see
    /// [`RunParams::rich_output`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rich_output: Option<bool>,
    /// The session's subset of its environment's egress allowlist (see
    /// [`RunParams::egress`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<String>>,
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

/// A package source an operator named for an environment (sandcelld.toml `wheelhouse` or
/// `cran_repository`), as `ListEnvironments` reports it: what it offers, never where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageSource {
    /// `wheelhouse` (Python wheels, `sandcell.install(...)`) or `cran_repository` (R binary
    /// packages, `install.packages(...)`).
    pub kind: String,
    /// Number of distinct packages offered.
    pub packages: u64,
    /// Their names in name order (Python: normalized as PEP 503 says), at most
    /// [`MAX_LISTED_PACKAGES`].
    #[serde(default)]
    pub names: Vec<String>,
    /// More packages are offered than named.
    #[serde(default)]
    pub names_truncated: bool,
    /// Installs are checked against a hash manifest (a wheelhouse's `SHA256SUMS`, a CRAN
    /// index's `MD5sum` fields).
    #[serde(default)]
    pub hash_manifest: bool,
    /// Why nothing is listed (the source cannot be read now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// An environment's egress policy (sandcelld.toml `egress`), as `ListEnvironments` reports it:
/// the hosts a session may reach through sandcell's proxy (`HTTP_PROXY`/`HTTPS_PROXY` in the
/// worker), on which ports, with which caps per session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// Lowercase DNS names and leading-`*.` wildcards (names strictly below).
    pub hosts: Vec<String>,
    /// Destination ports.
    pub ports: Vec<u16>,
    /// Bytes relayed per session, both directions.
    pub max_bytes: u64,
    /// Connections of one session open at once.
    pub max_connections: u32,
    /// Connections over a session's life.
    pub max_total_connections: u64,
    /// Life of one connection, seconds.
    pub max_seconds: u64,
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
    /// Package sources a session of this environment can install from into the session
    /// (absent: none, the packages above are all there is).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub package_sources: Vec<PackageSource>,
    /// The egress policy (absent: no network at all, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
    /// The operator's limits a session of this environment gets when the client asks for
    /// none (a daemon before this field: absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<EnvironmentLimits>,
}

/// The default (and highest) limits of an environment's sessions, from sandcelld.toml.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentLimits {
    /// Wall time of one cell, seconds (`execution_wall_time_seconds`).
    pub wall_time_seconds: f64,
    /// Memory of one session (its worker's cgroup `memory.max`), bytes
    /// (`max_worker_memory_bytes`).
    pub memory_bytes: u64,
    /// Interpreter memory of one session in the Eryx engine, bytes (`max_guest_memory_bytes`);
    /// absent for native engines, whose interpreter has the session's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_memory_bytes: Option<u64>,
    /// WebAssembly fuel of one cell in the Eryx engine (`max_fuel`: about one unit per
    /// WebAssembly instruction); absent for native engines, which have no fuel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// Bytes of one session directory (`max_session_files_bytes`).
    pub disk_bytes: u64,
    /// Bytes of one file in it (`max_file_bytes`).
    pub file_bytes: u64,
    /// Output kept per cell on stdout and on stderr, bytes (`max_stdout_bytes`,
    /// `max_stderr_bytes`).
    pub stdout_bytes: u64,
    /// See `stdout_bytes`.
    pub stderr_bytes: u64,
    /// CPUs of one session (its cgroup's `cpu.max` as a fraction of one CPU,
    /// `worker_cpus`; 0: no cap).
    pub cpus: f64,
    /// Longest idle lifetime of a detached session, seconds (`max_detached_idle_seconds`).
    pub detached_idle_seconds: u64,
    /// UTF-8 source bytes of one cell's code (`max_source_bytes`; longer code is
    /// `LimitExceeded`); absent from a daemon before this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_bytes: Option<u64>,
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
    /// The caller's name for this cell, 1 to [`MAX_CELL_TOKEN_LEN`] characters of
    /// `[A-Za-z0-9._-]` ([`check_cell_token`]): a call repeated with the same token does not
    /// run the code again while the session remembers the token (its newest
    /// [`CELL_TOKENS_KEPT`] cells', across a daemon restart too) but follows the cell that has
    /// it; a repeat whose cell has nothing retained to follow (an `Execute`'s cell on a
    /// session that ends with its connection, or a record already dropped) is `NoSuchCell`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Parameters of `Submit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitParams {
    /// Session id from `Open`.
    pub session: String,
    /// The cell's source, UTF-8.
    pub code: String,
    /// The caller's name for this cell, 1 to [`MAX_CELL_TOKEN_LEN`] characters of
    /// `[A-Za-z0-9._-]` ([`check_cell_token`]): a call repeated with the same token does not
    /// start another cell while the session remembers the token (its newest
    /// [`CELL_TOKENS_KEPT`] cells', across a daemon restart too) but answers the number of
    /// the cell that has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Reply of `Submit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubmitReply {
    /// The cell's number (for `Attach`, `CellStatus`, `Interrupt`).
    pub cell: u64,
}

/// Parameters of `Attach` and `CellStatus`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellParams {
    /// Session id.
    pub session: String,
    /// Cell number.
    pub cell: u64,
}

/// Reply of `CellStatus`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellStatusReply {
    /// `running`, a [`Status`] as text once the cell ended (`ok`, `error`, ...), or `lost`
    /// (the session ended before the cell could report).
    pub state: String,
    /// The result once the cell ended (its retained copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<CellResult>,
}

/// Parameters of `Inspect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InspectParams {
    /// Session id.
    pub session: String,
    /// List at most this many variables: 1 to [`INSPECT_MAX_ITEMS`], default
    /// [`INSPECT_DEFAULT_ITEMS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_items: Option<u64>,
}

/// Reply of `Inspect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReply {
    /// The user's variables in name order.
    pub variables: Vec<Variable>,
    /// More variables exist than are listed.
    pub truncated: bool,
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
    /// One of [`InterruptReason`], as text (a client keeps working when a newer daemon adds
    /// a reason).
    pub reason: String,
}

/// Parameters of `InterruptSession`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptSessionParams {
    /// Session id.
    pub session: String,
}

/// Reply of `InterruptSession`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterruptSessionReply {
    /// Whether SIGINT reached the session's running cell.
    pub delivered: bool,
    /// One of [`InterruptReason`], as text: `delivered`, `not_running` (no cell runs),
    /// `already_interrupted`, `session_ending`.
    pub reason: String,
    /// The cell that was running, if one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<u64>,
}

/// Parameters of `ListSessions` (none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ListSessionsParams {}

/// One of the caller's sessions, as `ListSessions` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSummary {
    /// Session id, as `Open` gave it.
    pub session: String,
    /// `python` or `r`.
    pub language: String,
    /// `idle`, `running`, `ended` (ending now) or `starting` (its worker is not ready yet).
    pub state: String,
    /// The running cell's number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_cell: Option<u64>,
    /// Cells finished.
    pub cells_run: u64,
    /// When it opened, seconds since the Unix epoch.
    pub started: f64,
    /// The idle lifetime of a detached session, seconds (absent: it ends with its connection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detached_idle_seconds: Option<u64>,
    /// Whether it belongs to the connection that lists it.
    pub this_connection: bool,
}

/// Reply of `ListSessions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListSessionsReply {
    /// The caller's sessions, oldest first (at most [`MAX_LISTED_SESSIONS`]).
    pub sessions: Vec<SessionSummary>,
    /// Whether the caller has more sessions than listed.
    pub truncated: bool,
}

/// Most sessions one `ListSessions` reply lists.
pub const MAX_LISTED_SESSIONS: usize = 1000;

/// Longest name of a host call's tool, bytes (of `[A-Za-z0-9_.-]`, at least one).
pub const MAX_HOST_CALL_NAME: usize = 128;

/// Largest arguments object of a host call, bytes of JSON as the daemon serialises it; a
/// worker that sends more breaks the protocol (the cell's own `host.call` raises first).
pub const MAX_HOST_CALL_ARGUMENTS: usize = 256 * 1024;

/// Largest `result` object of a `HostReply`, bytes of JSON as the daemon serialises it
/// (above: `LimitExceeded`, limit `host_call_result_bytes`).
pub const MAX_HOST_CALL_RESULT: usize = 256 * 1024;

/// Longest `error` of a `HostReply`, bytes (above: `LimitExceeded`, limit
/// `host_call_error_bytes`).
pub const MAX_HOST_CALL_ERROR: usize = MAX_ERROR_MESSAGE;

// A host call's frame (arguments re-serialised, at most 6x when every byte is escaped) and a
// HostReply's result fit one Varlink message.
const _: () = assert!(MAX_HOST_CALL_ARGUMENTS * 6 + 4096 <= MAX_MESSAGE_BYTES);
const _: () = assert!(MAX_HOST_CALL_RESULT * 6 + 4096 <= MAX_MESSAGE_BYTES);

/// Whether `name` is a valid tool name for a host call: 1 to [`MAX_HOST_CALL_NAME`] bytes of
/// `[A-Za-z0-9_.-]`.
pub fn valid_host_call_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_HOST_CALL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A cell's call of a tool the client provides (the `host_call` frame of `Run`/`Execute`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCall {
    /// The calling cell.
    pub cell: u64,
    /// Call id, per session from 1: name it in `HostReply`.
    pub call: u64,
    /// The tool's name (see [`valid_host_call_name`]).
    pub name: String,
    /// Its arguments, a JSON object of at most [`MAX_HOST_CALL_ARGUMENTS`] bytes.
    pub arguments: Value,
}

/// Parameters of `HostReply`: exactly one of `result` and `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostReplyParams {
    /// Session id.
    pub session: String,
    /// Call id from the `host_call` frame.
    pub call: u64,
    /// The tool's result, a JSON object of at most [`MAX_HOST_CALL_RESULT`] bytes: returned
    /// to the cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// The tool failed: raised in the cell with this message (at most
    /// [`MAX_HOST_CALL_ERROR`] bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Why an `Interrupt` was or was not delivered (the reply's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterruptReason {
    /// SIGINT reached the named, running cell (`delivered` is true).
    Delivered,
    /// No cell runs (it finished, or none started).
    NotRunning,
    /// Another cell of the session runs.
    OtherCell,
    /// The cell was already interrupted; the daemon escalates on its own (SIGINT again, then
    /// SIGKILL after the grace), so a second request changes nothing.
    AlreadyInterrupted,
    /// The session is ending (closed, expired, or its worker died).
    SessionEnding,
}

impl InterruptReason {
    /// Every reason, in the IDL's order.
    pub const ALL: [InterruptReason; 5] = [
        InterruptReason::Delivered,
        InterruptReason::NotRunning,
        InterruptReason::OtherCell,
        InterruptReason::AlreadyInterrupted,
        InterruptReason::SessionEnding,
    ];

    /// The reason on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            InterruptReason::Delivered => "delivered",
            InterruptReason::NotRunning => "not_running",
            InterruptReason::OtherCell => "other_cell",
            InterruptReason::AlreadyInterrupted => "already_interrupted",
            InterruptReason::SessionEnding => "session_ending",
        }
    }

    /// The reason for a wire string, `None` for one this version does not know.
    pub fn parse(s: &str) -> Option<InterruptReason> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl From<InterruptReason> for String {
    fn from(r: InterruptReason) -> String {
        r.as_str().to_owned()
    }
}

/// Why a session ended: the `reason` of the `SessionEnded` error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EndReason {
    /// `Close` by its owner.
    Closed,
    /// The owner's connection closed (a session that was not detached).
    Disconnected,
    /// A detached session reached its idle timeout.
    IdleExpired,
    /// The worker died, broke the protocol, or left processes that could not be stopped.
    WorkerCrashed,
    /// The kernel OOM-killed the worker at its cgroup memory limit.
    Oom,
    /// A cell ignored the interrupt (its own or the one at its wall time) and the worker was
    /// killed.
    Killed,
    /// A cell ended the interpreter (R's `quit()`).
    Exited,
    /// The session directory went over `max_session_files_bytes` or its entry bound, or its
    /// file system filled up; its files were removed.
    DiskQuota,
    /// An administrator ended it (D-Bus `TerminateSession`).
    Terminated,
    /// A one-shot `Run` finished (its session ends with its cell).
    OneShot,
    /// The daemon was stopping.
    DaemonStopping,
    /// A previous daemon held it and stopped or died; this daemon found its record.
    DaemonRestarted,
    /// A previous daemon held it and this daemon found its keeper, but the record did not
    /// match the live processes (a pid reused, another start time, another cgroup) or the
    /// session could not be taken over: it was not adopted, and nothing the record named was
    /// signalled.
    AdoptionRefused,
}

impl EndReason {
    /// Every reason, in the IDL's order.
    pub const ALL: [EndReason; 13] = [
        EndReason::Closed,
        EndReason::Disconnected,
        EndReason::IdleExpired,
        EndReason::WorkerCrashed,
        EndReason::Oom,
        EndReason::Killed,
        EndReason::Exited,
        EndReason::DiskQuota,
        EndReason::Terminated,
        EndReason::OneShot,
        EndReason::DaemonStopping,
        EndReason::DaemonRestarted,
        EndReason::AdoptionRefused,
    ];

    /// The reason on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Closed => "closed",
            EndReason::Disconnected => "disconnected",
            EndReason::IdleExpired => "idle_expired",
            EndReason::WorkerCrashed => "worker_crashed",
            EndReason::Oom => "oom",
            EndReason::Killed => "killed",
            EndReason::Exited => "exited",
            EndReason::DiskQuota => "disk_quota",
            EndReason::Terminated => "terminated",
            EndReason::OneShot => "one_shot",
            EndReason::DaemonStopping => "daemon_stopping",
            EndReason::DaemonRestarted => "daemon_restarted",
            EndReason::AdoptionRefused => "adoption_refused",
        }
    }

    /// The reason for a wire string, `None` for one this version does not know.
    pub fn parse(s: &str) -> Option<EndReason> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for EndReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
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

/// Most bytes one display bundle may take, as the JSON text of its `data` object. A bundle
/// over it is replaced by its `text/plain` (cut to [`DISPLAY_FALLBACK_BYTES`]) with a
/// [`Display::note`]; an image is never cut.
pub const MAX_DISPLAY_BYTES: usize = 512 * 1024;

/// Most bytes of `text/plain` a replaced bundle keeps (see [`MAX_DISPLAY_BYTES`]).
pub const DISPLAY_FALLBACK_BYTES: usize = 4096;

/// Most MIME types in one bundle.
pub const MAX_DISPLAY_TYPES: usize = 16;

/// Longest MIME type name in a bundle, bytes.
pub const MAX_MIME_TYPE: usize = 128;

/// A MIME bundle a cell shows (only in sessions and runs with `rich_output`), ordered with the
/// output frames by `seq`.
///
/// `data` maps MIME types (`text/plain` always, a string; `text/html`, `text/markdown`,
/// `text/latex`, `image/svg+xml` strings; `image/png` base64 text; `application/json` any
/// JSON value) to the representation, as the Jupyter display protocol
/// (<https://ipython.readthedocs.io/en/stable/config/integrating.html>) and nbformat's
/// `display_data` define them. The JSON text of `data` is at most [`MAX_DISPLAY_BYTES`] and
/// counts against the cell's stdout budget (`max_stdout_bytes`); a bundle that does not fit
/// is replaced by its `text/plain` with a `note` saying why, and dropped (still counted in
/// `CellResult.displays.seen`) when even that does not fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Display {
    /// Cell number.
    pub cell: u64,
    /// Frame sequence number within the cell, shared with `output` frames.
    pub seq: u64,
    /// Result or display.
    pub kind: DisplayKind,
    /// MIME type to representation.
    pub data: serde_json::Map<String, serde_json::Value>,
    /// The bundle's metadata as the display protocol gives it (for example
    /// `{"image/png": {"width": 200}}` from an `IPython.display.Image(width=200)`): a JSON
    /// object of at most [`MAX_DISPLAY_METADATA_BYTES`], counted with `data` against the
    /// budget; empty when there is none or the bundle was replaced by its `text/plain`.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Why the bundle was replaced by its `text/plain`, when it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Most bytes of a bundle's metadata (its JSON text).
pub const MAX_DISPLAY_METADATA_BYTES: usize = 4096;

/// Checks a bundle's `metadata` as a worker sent it and returns the bytes of its JSON text
/// (0 when empty). Errors: it is over [`MAX_DISPLAY_METADATA_BYTES`].
pub fn check_display_metadata(
    metadata: &serde_json::Map<String, serde_json::Value>,
) -> Result<usize, String> {
    if metadata.is_empty() {
        return Ok(0);
    }
    let n = serde_json::to_vec(metadata).map_or(usize::MAX, |v| v.len());
    if n > MAX_DISPLAY_METADATA_BYTES {
        return Err(format!("display metadata of {n} bytes"));
    }
    Ok(n)
}

/// Whether `t` may name a MIME type in a bundle: 1 to [`MAX_MIME_TYPE`] bytes of
/// `[a-z0-9.+-]`, one `/` inside (RFC 6838 names, lower case).
pub fn valid_mime_type(t: &str) -> bool {
    t.len() <= MAX_MIME_TYPE
        && t.split_once('/').is_some_and(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && (a.bytes().chain(b.bytes()))
                    .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'+' | b'-'))
        })
}

/// Whether a bundle's value of MIME type `t` is binary data carried as base64 text: every
/// `image/*` but `image/svg+xml`, and `application/pdf`, as nbformat stores them.
pub fn is_base64_mime_type(t: &str) -> bool {
    (t.starts_with("image/") && t != "image/svg+xml") || t == "application/pdf"
}

/// Whether `text` is base64 (RFC 4648 section 4, the standard alphabet with `=` padding):
/// ASCII whitespace anywhere is ignored (line breaks as MIME and Python's `b2a_base64` put
/// them), the rest is a multiple of 4 characters with at most two `=` at its end.
pub fn valid_base64(text: &str) -> bool {
    let mut n = 0usize;
    let mut pad = 0usize;
    for c in text.bytes() {
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => continue,
            b'=' => pad += 1,
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' if pad == 0 => {}
            _ => return false,
        }
        n += 1;
    }
    n.is_multiple_of(4) && pad <= 2
}

/// Checks a bundle's `data` as a worker sent it and returns the bytes of its JSON text.
///
/// Errors (the bundle is malformed, a protocol violation): no `text/plain` string, more than
/// [`MAX_DISPLAY_TYPES`] types, a type that is not [`valid_mime_type`], a value other than
/// a string where one is required (every type but `application/json` and `*+json`), or a
/// binary type's value that is not [`valid_base64`] (see [`is_base64_mime_type`]).
pub fn check_display_data(
    data: &serde_json::Map<String, serde_json::Value>,
) -> Result<usize, String> {
    if !data.get("text/plain").is_some_and(|v| v.is_string()) {
        return Err("display without a text/plain string".into());
    }
    if data.len() > MAX_DISPLAY_TYPES {
        return Err(format!("display with {} MIME types", data.len()));
    }
    for (k, v) in data {
        if !valid_mime_type(k) {
            return Err("display with an invalid MIME type".into());
        }
        let json = k == "application/json" || k.ends_with("+json");
        if !json && !v.is_string() {
            return Err(format!("display {k} is not a string"));
        }
        if is_base64_mime_type(k) && !v.as_str().is_some_and(valid_base64) {
            return Err(format!("display {k} is not base64"));
        }
    }
    Ok(serde_json::to_vec(data).map_or(usize::MAX, |v| v.len()))
}

/// The bundle that replaces one over its cap: its `text/plain` alone, cut to
/// [`DISPLAY_FALLBACK_BYTES`] on a character boundary.
pub fn display_fallback(
    data: &serde_json::Map<String, serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    let text = data
        .get("text/plain")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let mut end = text.len().min(DISPLAY_FALLBACK_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut m = serde_json::Map::new();
    m.insert("text/plain".into(), text[..end].into());
    m
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
    /// Peak memory charged to the session's cgroup during this cell, bytes. The window is
    /// reset before each cell on cgroup v1 and on cgroup v2 with Linux 6.12+ (a write to
    /// `memory.peak` resets it for that descriptor); on older v2 kernels it is the session's
    /// peak since it started.
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
    /// Every status, in declaration order (`ALL[s as usize] == s`).
    pub const ALL: [Status; 10] = [
        Status::Ok,
        Status::Error,
        Status::Interrupted,
        Status::Timeout,
        Status::FuelExhausted,
        Status::MemoryExhausted,
        Status::Oom,
        Status::Exited,
        Status::WorkerCrashed,
        Status::Cancelled,
    ];

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
    /// Display bundles of the cell (sessions and runs with `rich_output` only): `seen` bytes
    /// of bundle JSON the cell produced, `kept` bytes sent in `display` frames (replaced
    /// bundles count what was sent). A cell with a record (`Submit`, or `Execute` on a
    /// detached session) retains its display frames with its stdout for `Attach` (see
    /// [`Retained::displays`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displays: Option<StreamStats>,
    /// What the daemon retained of the cell's output for `Attach` (cells started by `Submit`,
    /// or by `Execute` on a detached session); absent for other cells.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained: Option<Retained>,
}

/// Output the daemon retained of one cell for `Attach`, per stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retained {
    /// stdout.
    pub stdout: RetainedStats,
    /// stderr.
    pub stderr: RetainedStats,
    /// Display bundles (cells with `rich_output` that showed any), in bytes of their `data`
    /// JSON as counted in `CellResult.displays`. They share stdout's retention: its first
    /// [`RETAIN_HEAD_BYTES`] and last [`RETAIN_TAIL_BYTES`] hold text and whole bundles
    /// together. A bundle is never cut: one that fits neither is retained as its text/plain
    /// with a note (counted as kept at that size), and one evicted from the tail is dropped
    /// whole. `Attach` replays the retained bundles as `display` frames, in `seq` order with
    /// the output frames.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displays: Option<RetainedStats>,
}

/// Retention of one stream of one cell, in bytes of output text (as in `output` frames: the
/// bytes the stream's cap kept, invalid UTF-8 escaped). `seen = kept + dropped`, exactly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedStats {
    /// Bytes of text the cell's frames carried.
    pub seen: u64,
    /// Bytes retained now: at most [`RETAIN_HEAD_BYTES`] from the start and
    /// [`RETAIN_TAIL_BYTES`] from the end.
    pub kept: u64,
    /// Bytes not retained (the middle of a longer output, or all of it once the session's or
    /// the daemon's budget evicted it).
    pub dropped: u64,
}

/// Bytes of text retained from the start of each stream of a cell, for `Attach`.
pub const RETAIN_HEAD_BYTES: u64 = 64 * 1024;

/// Bytes of text retained from the end of each stream of a cell, for `Attach`.
pub const RETAIN_TAIL_BYTES: u64 = 64 * 1024;

/// Largest retained result, bytes of JSON: a longer one keeps fewer `files` entries and
/// shorter error texts in its retained copy (the attached client got it whole).
pub const RETAINED_RESULT_BYTES: u64 = 64 * 1024;

/// Output and results one session retains, bytes: a running cell reserves its most
/// (2 x (head + tail) + result = 320 KiB); older cells' output is evicted, oldest first, to
/// stay within it, then their results.
pub const SESSION_RETAINED_BYTES: u64 = 1024 * 1024;

/// Output and results all sessions retain, bytes. A `Submit` (or an `Execute` on a detached
/// session) whose reservation does not fit after its own session's old output is evicted is
/// refused: `CapacityExceeded`, budget `retained_output_bytes`.
pub const DAEMON_RETAINED_BYTES: u64 = 64 * 1024 * 1024;

/// Results of finished cells a session keeps for `CellStatus` and `Attach` (the newest); an
/// older cell is `NoSuchCell`.
pub const RESULTS_KEPT: usize = 8;

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
    /// The cell calls a tool of the client: answer with `HostReply`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_call: Option<HostCall>,
    /// A MIME bundle the cell shows (`rich_output` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<Display>,
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
        /// When a retry can succeed, seconds from now, where the daemon knows it (the session
        /// start rate, `max_starts_per_second_per_uid`: when the next start token is due);
        /// absent for budgets that free up only when something else ends.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_seconds: Option<f64>,
    },
    /// No such session for this caller.
    #[serde(rename = "org.sandcell.Kernel.NoSuchSession")]
    NoSuchSession {
        /// Session id.
        session: String,
    },
    /// The session ended a short while ago; only its owner and root are told.
    #[serde(rename = "org.sandcell.Kernel.SessionEnded")]
    SessionEnded {
        /// Session id as given.
        session: String,
        /// One of [`EndReason`], as text (a client keeps working when a newer daemon adds
        /// a reason).
        reason: String,
        /// When it ended, seconds since the Unix epoch (for `daemon_restarted`: when this
        /// daemon found its record).
        ended_at: f64,
    },
    /// A node-qualified session id names another node than this daemon's.
    #[serde(rename = "org.sandcell.Kernel.WrongNode")]
    WrongNode {
        /// Session id as given.
        session: String,
        /// The node the id names.
        node: String,
        /// This daemon's node identifier (empty: it gives unqualified ids).
        expected: String,
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
    /// The daemon failed on its own side (a server fault): nothing in the call was wrong.
    #[serde(rename = "org.sandcell.Kernel.InternalError")]
    InternalError {
        /// What failed, e.g. `read session directory`, `rename`, `file task`.
        operation: String,
        /// The OS error, with the path relative to the session directory where there is one.
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
    /// The session has no record of that cell (never started, or its record was dropped).
    #[serde(rename = "org.sandcell.Kernel.NoSuchCell")]
    NoSuchCell {
        /// Session id.
        session: String,
        /// Cell number.
        cell: u64,
    },
    /// A newer `Attach` to the same cell took over this attachment.
    #[serde(rename = "org.sandcell.Kernel.AttachmentReplaced")]
    AttachmentReplaced {
        /// Session id.
        session: String,
        /// Cell number.
        cell: u64,
    },
    /// A `HostReply` names no call waiting for an answer in that session (never made,
    /// answered, timed out, its cell ended, or another session's).
    #[serde(rename = "org.sandcell.Kernel.NoSuchHostCall")]
    NoSuchHostCall {
        /// Session id as given.
        session: String,
        /// Call id as given.
        call: u64,
    },
    /// The environment has egress (sandcelld.toml `egress`), but the daemon's service
    /// sandbox cannot give it (probed at start: the shipped units allow no network; the
    /// packages' egress drop-ins add what it needs, sandcelld(8) EGRESS). Refused at `Open`
    /// and `Run` rather than at the first cell that fetches something.
    #[serde(rename = "org.sandcell.Kernel.EgressUnavailable")]
    EgressUnavailable {
        /// The environment asked for.
        environment: String,
        /// What the sandbox lacks and the drop-in that adds it.
        reason: String,
    },
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
    /// Whether the error says the named session is not served (any more, or here):
    /// `NoSuchSession`, `SessionEnded` or `WrongNode`. A client that only cares whether the session is gone tests this.
    pub fn is_no_such_session(&self) -> bool {
        matches!(
            self,
            KernelError::NoSuchSession { .. }
                | KernelError::SessionEnded { .. }
                | KernelError::WrongNode { .. }
        )
    }

    /// The fully qualified Varlink error name.
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// A method call as received, before its parameters are checked.
///
/// The parameters stay JSON text until the method's own parameter type is decoded from them
/// (`serde_json`'s `RawValue`: the text is checked and copied once, no tree is built). A
/// `serde_json::Value` tree costs about 32 bytes per JSON value, so 4 MiB of `[0,0,...]`
/// (the message bound) became a 64 MiB allocation per call being decoded; typed parameters
/// skip unknown fields without allocating and hold strings at their own size.
#[derive(Debug, Deserialize)]
pub struct RawCall {
    /// Fully qualified method name.
    pub method: String,
    /// Parameters object as received (absent means none).
    #[serde(default)]
    pub parameters: Option<Box<serde_json::value::RawValue>>,
}

impl RawCall {
    /// The parameters' JSON text; `{}` when absent.
    pub fn parameters_text(&self) -> &str {
        self.parameters.as_deref().map_or("{}", |r| r.get())
    }
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
    fn cell_tokens_are_short_and_plain() {
        assert!(check_cell_token("a1.B_-").is_ok());
        assert!(check_cell_token(&"x".repeat(MAX_CELL_TOKEN_LEN)).is_ok());
        assert!(check_cell_token("").is_err());
        assert!(check_cell_token(&"x".repeat(MAX_CELL_TOKEN_LEN + 1)).is_err());
        for bad in ["a b", "a/b", "é", "a\n", "a\0"] {
            assert!(check_cell_token(bad).is_err(), "{bad:?}");
        }
        // Absent from the wire when unset: a call without a token is what it always was.
        let p = ExecuteParams {
            session: "s".into(),
            code: "1".into(),
            token: None,
        };
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"session":"s","code":"1"}"#
        );
    }

    #[test]
    fn display_bundles_are_checked_and_replaced_by_their_text() {
        let ok: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
            r#"{"text/plain":"x","text/html":"<b>x</b>","application/json":{"a":[1]},"image/png":"iVBO"}"#,
        )
        .unwrap();
        let n = check_display_data(&ok).unwrap();
        assert_eq!(n, serde_json::to_vec(&ok).unwrap().len());
        for bad in [
            r#"{"text/html":"<b>x</b>"}"#,
            r#"{"text/plain":1}"#,
            r#"{"text/plain":"x","text/html":{"a":1}}"#,
            r#"{"text/plain":"x","Text/HTML":"y"}"#,
            r#"{"text/plain":"x","nonsense":"y"}"#,
            r#"{"text/plain":"x","a/b/c":"y"}"#,
            r#"{"text/plain":"x","image/png":"not base64!"}"#,
            r#"{"text/plain":"x","image/jpeg":"iVB"}"#,
            r#"{"text/plain":"x","application/pdf":"iV=B"}"#,
        ] {
            let m: serde_json::Map<String, serde_json::Value> = serde_json::from_str(bad).unwrap();
            assert!(check_display_data(&m).is_err(), "{bad}");
        }
        let mut many = serde_json::Map::new();
        many.insert("text/plain".into(), "x".into());
        for i in 0..MAX_DISPLAY_TYPES {
            many.insert(format!("text/x-{i}"), "y".into());
        }
        assert!(check_display_data(&many).is_err());
        for good in ["", "iVBORw0KGgo=", "iVBO\nRw0K\r\nGgo=\n", "QQ==", "+/+/"] {
            assert!(valid_base64(good), "{good:?}");
        }
        for bad in ["QQ=", "Q===", "QQ=A", "QQ==QQ==", "QQ-_", "é"] {
            assert!(!valid_base64(bad), "{bad:?}");
        }
        assert!(is_base64_mime_type("image/gif") && !is_base64_mime_type("image/svg+xml"));
        assert!(valid_mime_type("image/svg+xml") && valid_mime_type("application/vnd.x-y.z+json"));
        assert!(!valid_mime_type("/") && !valid_mime_type(&format!("a/{}", "b".repeat(200))));
        let mut big = serde_json::Map::new();
        big.insert(
            "text/plain".into(),
            "é".repeat(DISPLAY_FALLBACK_BYTES).into(),
        );
        big.insert("image/png".into(), "A".repeat(MAX_DISPLAY_BYTES).into());
        let f = display_fallback(&big);
        assert_eq!(f.len(), 1);
        let t = f["text/plain"].as_str().unwrap();
        assert!(t.len() <= DISPLAY_FALLBACK_BYTES && t.len() >= DISPLAY_FALLBACK_BYTES - 1);
    }

    use zlink::idl::{Field, Interface, Type};

    /// A JSON value the IDL type accepts, with every optional field present, so a field the
    /// Rust type lacks is lost on the round trip below. Strings that Rust parses as enums get
    /// one of their values.
    fn sample(iface: &Interface<'_>, field: &str, ty: &Type<'_>) -> Value {
        match ty {
            Type::Bool => Value::Bool(true),
            Type::Int => Value::from(7u64),
            Type::Float => Value::from(1.5f64),
            Type::String => Value::from(match field {
                "status" => "ok",
                "state" => "kept",
                "kind" => "file",
                "stream" => "stdout",
                "language" => "python",
                _ => "x",
            }),
            Type::Optional(t) => sample(iface, field, t.inner()),
            Type::Array(t) => Value::Array(vec![sample(iface, field, t.inner())]),
            Type::Map(t) => serde_json::json!({ "k": sample(iface, field, t.inner()) }),
            Type::Custom(name) => {
                let name = name.to_string();
                let custom = iface
                    .custom_types()
                    .find(|c| c.name().to_string() == name)
                    .unwrap_or_else(|| panic!("type {name} is not declared"));
                let object = custom.as_object().expect("only object types are used");
                let mut v = fields(iface, object.fields());
                if name == "Display" {
                    // Its `kind` is not a file's.
                    v["kind"] = Value::from("result");
                }
                v
            }
            Type::Object(f) => fields(iface, f.iter()),
            Type::ForeignObject => serde_json::json!({ "k": [1, "x"] }),
            other => panic!("IDL type {other:?} has no sample"),
        }
    }

    fn fields<'a>(iface: &Interface<'_>, f: impl Iterator<Item = &'a Field<'a>>) -> Value {
        Value::Object(
            f.map(|f| {
                let name = f.name().to_string();
                let v = sample(iface, &name, f.ty());
                (name, v)
            })
            .collect(),
        )
    }

    /// Deserializes `v` as `T` and serializes it back: equal only when `T` has exactly the
    /// IDL's fields (parameter structs refuse unknown fields; others would drop them).
    fn round_trip<T: serde::de::DeserializeOwned + Serialize>(v: &Value) -> Result<(), String> {
        let t: T = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        let back = serde_json::to_value(&t).map_err(|e| e.to_string())?;
        if &back == v {
            Ok(())
        } else {
            Err(format!("round trip changed {v} into {back}"))
        }
    }

    /// Every method of the IDL has Rust parameter and reply types with exactly its fields.
    #[test]
    fn idl_methods_match_the_rust_types() {
        type Check = fn(&Value) -> Result<(), String>;
        fn empty(v: &Value) -> Result<(), String> {
            (v == &serde_json::json!({}))
                .then_some(())
                .ok_or(format!("{v} is not empty"))
        }
        let rust: &[(&str, Check, Check)] = &[
            ("Run", round_trip::<RunParams>, round_trip::<FrameReply>),
            ("Open", round_trip::<OpenParams>, round_trip::<OpenReply>),
            (
                "Execute",
                round_trip::<ExecuteParams>,
                round_trip::<FrameReply>,
            ),
            (
                "Interrupt",
                round_trip::<InterruptParams>,
                round_trip::<InterruptReply>,
            ),
            (
                "InterruptSession",
                round_trip::<InterruptSessionParams>,
                round_trip::<InterruptSessionReply>,
            ),
            (
                "ListSessions",
                round_trip::<ListSessionsParams>,
                round_trip::<ListSessionsReply>,
            ),
            (
                "Inspect",
                round_trip::<InspectParams>,
                round_trip::<InspectReply>,
            ),
            (
                "Complete",
                round_trip::<crate::query::CompleteParams>,
                round_trip::<crate::query::CompleteReply>,
            ),
            (
                "Help",
                round_trip::<crate::query::HelpParams>,
                round_trip::<crate::query::HelpReply>,
            ),
            ("Close", round_trip::<CloseParams>, empty),
            (
                "PutFile",
                round_trip::<PutFileParams>,
                round_trip::<PutFileReply>,
            ),
            (
                "ListFiles",
                round_trip::<ListFilesParams>,
                round_trip::<ListFilesReply>,
            ),
            (
                "GetFile",
                round_trip::<GetFileParams>,
                round_trip::<GetFileReply>,
            ),
            ("DeleteFile", round_trip::<DeleteFileParams>, empty),
            ("HostReply", round_trip::<HostReplyParams>, empty),
            (
                "Submit",
                round_trip::<SubmitParams>,
                round_trip::<SubmitReply>,
            ),
            ("Attach", round_trip::<CellParams>, round_trip::<FrameReply>),
            (
                "CellStatus",
                round_trip::<CellParams>,
                round_trip::<CellStatusReply>,
            ),
            (
                "ListEnvironments",
                round_trip::<ListEnvironmentsParams>,
                round_trip::<ListEnvironmentsReply>,
            ),
        ];
        let iface = Interface::try_from(IDL).expect("IDL parses");
        assert_eq!(iface.name().to_string(), INTERFACE);
        let mut seen = Vec::new();
        for m in iface.methods() {
            let name = m.name().to_string();
            let (_, params, reply) = rust
                .iter()
                .find(|(n, ..)| *n == name)
                .unwrap_or_else(|| panic!("IDL method {name} has no Rust types"));
            params(&fields(&iface, m.inputs()))
                .unwrap_or_else(|e| panic!("{name} parameters: {e}"));
            reply(&fields(&iface, m.outputs())).unwrap_or_else(|e| panic!("{name} reply: {e}"));
            seen.push(name);
        }
        for (n, ..) in rust {
            assert!(seen.iter().any(|s| s == n), "{n} is not in the IDL");
        }
    }

    /// The short name of every [`KernelError`] variant; the match has no wildcard, so a new
    /// variant does not compile until it is named here (and then checked against the IDL).
    fn variant_name(e: &KernelError) -> &'static str {
        match e {
            KernelError::InvalidParameter { .. } => "InvalidParameter",
            KernelError::UnsupportedLanguage { .. } => "UnsupportedLanguage",
            KernelError::LimitExceeded { .. } => "LimitExceeded",
            KernelError::CapacityExceeded { .. } => "CapacityExceeded",
            KernelError::NoSuchSession { .. } => "NoSuchSession",
            KernelError::SessionEnded { .. } => "SessionEnded",
            KernelError::WrongNode { .. } => "WrongNode",
            KernelError::SessionBusy { .. } => "SessionBusy",
            KernelError::PermissionDenied { .. } => "PermissionDenied",
            KernelError::WorkerFailed { .. } => "WorkerFailed",
            KernelError::InternalError { .. } => "InternalError",
            KernelError::InvalidFileName { .. } => "InvalidFileName",
            KernelError::NoSuchFile { .. } => "NoSuchFile",
            KernelError::NotRegularFile { .. } => "NotRegularFile",
            KernelError::NoSuchEnvironment { .. } => "NoSuchEnvironment",
            KernelError::EnvironmentMismatch { .. } => "EnvironmentMismatch",
            KernelError::ShuttingDown {} => "ShuttingDown",
            KernelError::NoSuchCell { .. } => "NoSuchCell",
            KernelError::AttachmentReplaced { .. } => "AttachmentReplaced",
            KernelError::NoSuchHostCall { .. } => "NoSuchHostCall",
            KernelError::EgressUnavailable { .. } => "EgressUnavailable",
        }
    }

    /// Every error of the IDL is a [`KernelError`] with exactly its parameters, and every
    /// [`KernelError`] is in the IDL.
    #[test]
    fn idl_errors_match_kernel_error() {
        let iface = Interface::try_from(IDL).expect("IDL parses");
        let mut variants = Vec::new();
        for e in iface.errors() {
            let name = e.name().to_string();
            let params = fields(&iface, e.fields());
            let raw = RawError {
                error: format!("{INTERFACE}.{name}"),
                parameters: Some(params.clone()),
            };
            let typed = raw
                .to_kernel_error()
                .unwrap_or_else(|| panic!("IDL error {name} is not a KernelError"));
            assert_eq!(variant_name(&typed), name);
            assert_eq!(typed.name(), raw.error);
            let back = serde_json::to_value(&typed).unwrap();
            assert_eq!(back["parameters"], params, "{name}: parameters differ");
            variants.push(typed);
        }
        // The reverse: an error the daemon could send that the IDL does not declare fails here
        // (each declared error converted above; `variant_name` lists them all).
        let all = [
            "InvalidParameter",
            "UnsupportedLanguage",
            "LimitExceeded",
            "CapacityExceeded",
            "NoSuchSession",
            "SessionEnded",
            "WrongNode",
            "SessionBusy",
            "PermissionDenied",
            "WorkerFailed",
            "InternalError",
            "InvalidFileName",
            "NoSuchFile",
            "NotRegularFile",
            "NoSuchEnvironment",
            "EnvironmentMismatch",
            "ShuttingDown",
            "NoSuchCell",
            "AttachmentReplaced",
            "NoSuchHostCall",
            "EgressUnavailable",
        ];
        for n in all {
            assert!(
                variants.iter().any(|v| variant_name(v) == n),
                "KernelError::{n} is not in the IDL"
            );
        }
        // An unknown error name is not mistaken for one of ours.
        let unknown = RawError {
            error: format!("{INTERFACE}.NoSuchThing"),
            parameters: None,
        };
        assert_eq!(unknown.to_kernel_error(), None);
    }

    #[test]
    fn interrupt_reasons_are_in_the_idl_and_round_trip() {
        for r in InterruptReason::ALL {
            assert!(
                IDL.contains(r.as_str()),
                "{} is not documented in the IDL",
                r.as_str()
            );
            assert_eq!(InterruptReason::parse(r.as_str()), Some(r));
            assert_eq!(String::from(r), r.as_str());
        }
        assert_eq!(InterruptReason::parse("no_such_reason"), None);
    }

    #[test]
    fn statuses_are_all_listed_in_order() {
        for (i, s) in Status::ALL.into_iter().enumerate() {
            assert_eq!(s as usize, i);
            assert!(IDL.contains(s.as_str()), "{} is not in the IDL", s.as_str());
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        // A status added to the enum and not to ALL fails to compile here.
        match Status::Ok {
            Status::Ok
            | Status::Error
            | Status::Interrupted
            | Status::Timeout
            | Status::FuelExhausted
            | Status::MemoryExhausted
            | Status::Oom
            | Status::Exited
            | Status::WorkerCrashed
            | Status::Cancelled => {}
        }
    }

    #[test]
    fn end_reasons_are_in_the_idl_and_round_trip() {
        for r in EndReason::ALL {
            assert!(
                IDL.contains(r.as_str()),
                "{} is not documented in the IDL",
                r.as_str()
            );
            assert_eq!(EndReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(EndReason::parse("no_such_reason"), None);
    }

    #[test]
    fn session_ids_have_one_shape() {
        let id = SessionId::from_random([0xab; 16]);
        assert_eq!(id.as_str(), "ab".repeat(16));
        assert_eq!(SessionId::parse(id.as_str()), Ok(id.clone()));
        for bad in [
            "",
            "AB".repeat(16).as_str(),
            "ab".repeat(17).as_str(),
            "../etc/passwd",
            &format!("{}/", "a".repeat(31)),
        ] {
            assert!(SessionId::parse(bad).is_err(), "{bad:?}");
        }
        let v = serde_json::to_value(&id).unwrap();
        assert_eq!(v, serde_json::json!(id.as_str()));
        // Node-qualified ids: the node is the text before the last dot.
        let local = id.as_str();
        assert_eq!(SessionId::parse_qualified(local), Ok((None, id.clone())));
        let q = id.qualified("node-1.example.org");
        assert_eq!(q, format!("node-1.example.org.{local}"));
        assert_eq!(
            SessionId::parse_qualified(&q),
            Ok((Some("node-1.example.org"), id.clone()))
        );
        assert_eq!(id.qualified(""), local);
        for bad in [
            format!(".{local}"),
            format!("n/1.{local}"),
            format!("{}.{local}", "n".repeat(65)),
            format!("n1.{local}x"),
            "n1.".to_string(),
        ] {
            assert!(SessionId::parse_qualified(&bad).is_err(), "{bad:?}");
        }
        assert!(check_node_id(&"n".repeat(64)).is_ok());
        assert!(check_node_id("").is_err());
        assert!(serde_json::from_value::<SessionId>(serde_json::json!("x")).is_err());
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
