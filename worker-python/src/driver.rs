//! The Python side of a cell: the driver module and the code the worker hands to Eryx.
//!
//! Eryx 0.10 runs a string of Python in a namespace it keeps across executions and reports an
//! uncaught exception only as formatted text. The worker instead runs every cell through a
//! small driver module (`driver.py`, installed in the guest as `_sandcell`, baked into the
//! pre-initialised snapshot and re-installed when missing) which:
//! - compiles the cell as `<cell N>` so tracebacks and [`DriverResult`] lines are the cell's
//!   own line numbers (no preamble offsets), and registers the source with `linecache`;
//! - shows the value of a final expression statement as the pydata engine does (its repr on
//!   stdout through `sys.displayhook`, `<repr failed: Type: message>` when the repr raises,
//!   nothing for `None` or after a trailing `;`), unless the request's `display=0` turned it
//!   off ([`cell_code`]);
//! - maps `SystemExit` to `exited`, `MemoryError` to `memory_exhausted` and any other
//!   exception to `error` with type, bounded message, bounded traceback and line;
//! - replaces `sys.stdout`/`sys.stderr` during the cell with line-buffered writers that send
//!   each line (or 8 KiB) to the host and keep nothing afterwards (Eryx's own writers
//!   accumulate the whole output in guest memory); `sys.stdout.buffer` passes bytes through;
//! - caps `sys.setrecursionlimit` (deep recursion would overflow the WebAssembly stack and
//!   abort the worker) and pickles the namespace for state snapshots (`snapshot`/`restore`,
//!   see [`crate::session`]);
//! - reports a cell's outcome as JSON on [`OUTCOME_STREAM`], the last message of the execution
//!   (the snapshot and restore calls report theirs as a dict in the variable
//!   [`RESULT_VARIABLE`], which Eryx JSON-encodes as the execution's result and removes from
//!   the namespace; Eryx's default result variable is `result`, which would silently delete a
//!   user's own `result` after every cell).
//!
//! The cell source travels base64-encoded inside a one-line call, so no quoting of user text
//! is ever needed. A cell can break or replace the driver; it then only misreports its own
//! session, and the host still bounds and validates everything it reads back.
//!
//! # Per-cell cost
//!
//! Inside the guest, compiling is the dominant cost of a short cell: a fixed cost plus a cost
//! per syntax node. Eryx compiles the code string of every execution, and the driver compiles
//! the cell again under its own file name, so the driver (`driver.py`) keeps both small:
//! - the one-line call is `__sandcell__('<base64>',N)`, through the builtin [`ENTRY`] (no name
//!   in the user namespace), and `_eryx_compile`, which Eryx's `_eryx_exec` finds in its
//!   `__main__` before the builtin `compile`, recognises exactly the worker's two per-cell
//!   lines and returns code compiled once instead (anything else goes to the real compile);
//! - a source run again unchanged reuses its code object, renamed to the new cell, once a
//!   compile with every warning recorded showed it compiles cleanly (so warnings, errors,
//!   file names and line numbers are those of a fresh compile);
//! - after a cell that left an all-immutable namespace bound to the very objects of the last
//!   snapshot, `run` says `unchanged` and the worker takes no new snapshot
//!   ([`DriverResult::unchanged`]).
//!
//! The figures (`sandcell-python-runtime probe`) are in docs/internals/figures.md.

use base64_engine::encode as b64;
use serde::Deserialize;

/// Python source of the driver module: the Complete/Help module the native worker shares
/// (`worker-native/python/query.py`) followed by `driver.py`.
pub const DRIVER_SOURCE: &str = concat!(
    include_str!("../../worker-native/python/query.py"),
    include_str!("driver.py")
);

/// Identity of [`DRIVER_SOURCE`]: 64-bit FNV-1a of its bytes. The installer skips a driver
/// whose recorded hash matches (the one baked into the snapshot) and replaces any other.
pub const DRIVER_HASH: u64 = fnv1a(DRIVER_SOURCE.as_bytes());

/// 64-bit FNV-1a (not cryptographic: it only tells driver versions apart).
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

/// Name of the guest variable the driver writes its outcome to (Eryx's result variable).
///
/// Names starting with `_eryx_` are excluded from Eryx's state snapshots.
pub const RESULT_VARIABLE: &str = "_eryx_sandcell_result";

/// Python that installs the driver as `sys.modules['_sandcell']` unless the current version is
/// already there, and binds its entry point, the builtin [`ENTRY`]. Binds no name in the user
/// namespace (the helper deletes itself).
pub fn install_code() -> String {
    format!(
        "def _eryx_sandcell_install(src, version):\n    \
             import sys, base64\n    \
             m = sys.modules.get('_sandcell')\n    \
             if getattr(m, 'SANDCELL_HASH', None) != version:\n        \
                 m = type(sys)('_sandcell')\n        \
                 exec(compile(base64.b64decode(src).decode('utf-8'), '<sandcell-driver>', 'exec'), m.__dict__)\n        \
                 m.SANDCELL_HASH = version\n        \
                 sys.modules['_sandcell'] = m\n    \
             m._bind()\n\
         _eryx_sandcell_install('{}', {DRIVER_HASH})\n\
         del _eryx_sandcell_install\n",
        b64(DRIVER_SOURCE.as_bytes())
    )
}

/// The builtin through which the worker's one-line calls reach the driver (its `_bind`).
///
/// Eryx compiles every code string it executes, at a cost per syntax node inside the guest,
/// so the call is kept short: `__sandcell__('...',3)` rather than
/// `__import__('_sandcell').run('...', globals(), 3)` (and nothing at all is compiled through
/// `_eryx_compile`). A builtin rather than
/// a global keeps the user namespace as it was.
pub const ENTRY: &str = "__sandcell__";

/// Whether a source may contain top-level `await`, `async for` or `async with`, in which case
/// it runs through the driver's `run_async` (Eryx's async path). A false positive only costs
/// the async path; a source without these words cannot use top-level await.
pub fn needs_async(source: &str) -> bool {
    source.contains("await") || source.contains("async")
}

/// The one-line Python the worker executes for cell `cell` with `source`. With `display`,
/// the driver shows the value of a final expression statement (not ended by `;`) on stdout;
/// with `rich`, as a MIME bundle on [`DISPLAY_STREAM`] (and `sandcell.display` sends bundles
/// too). The mode goes as a last argument, bit 1 display, bit 2 rich, left out when it is
/// plain display (1).
pub fn cell_code(cell: u64, source: &str, display: bool, rich: bool) -> String {
    let off = match (display, rich) {
        (true, false) => "",
        (false, false) => ",0",
        (false, true) => ",2",
        (true, true) => ",3",
    };
    if needs_async(source) {
        let encoded = b64(source.as_bytes());
        return format!(
            "await __import__('_sandcell').run_async('{encoded}', globals(), {cell}{off})\n"
        );
    }
    let mut code = String::with_capacity(source.len().div_ceil(3) * 4 + 40);
    code.push_str(ENTRY);
    code.push_str("('");
    base64_engine::encode_into(source.as_bytes(), &mut code);
    code.push_str("',");
    code.push_str(&cell.to_string());
    code.push_str(off);
    code.push_str(")\n");
    code
}

/// Output stream number on which the driver's `inspect` sends its listing: first
/// `{"names": [[name, type], ...], "truncated": bool}`, then one [`InspectItem`] per name.
pub const INSPECT_STREAM: u32 = 9;

/// Python that lists the namespace's variables on [`INSPECT_STREAM`] (at most `max_items`;
/// the user's code it calls gets `budget_ms` in all).
pub fn inspect_code(max_items: u64, budget_ms: u64) -> String {
    format!("{ENTRY}.inspect({max_items},{budget_ms})\n")
}

/// Output stream number on which the driver's `query` sends its answer to a `complete` or
/// `help` (one JSON object: a `sandcell_proto::query::CompleteReply` or `HelpReply`).
pub const QUERY_STREAM: u32 = 12;

/// Python that runs the driver's `query` on `code` (`op` `complete` or `help`; `arg` the match
/// cap or the detail level; `cursor` in characters; the user's code gets `budget_ms`).
pub fn query_code(op: &str, code: &[u8], cursor: u64, arg: u64, budget_ms: u64) -> String {
    format!(
        "{ENTRY}.query('{op}','{}',{cursor},{arg},{budget_ms})\n",
        b64(code)
    )
}

/// The first message of an `inspect` listing.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct InspectNames {
    /// `[name, type]` of each variable listed, in name order.
    pub names: Vec<(String, String)>,
    /// More variables exist than are listed.
    #[serde(default)]
    pub truncated: bool,
}

/// One variable's figures in an `inspect` listing.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct InspectItem {
    /// Index into [`InspectNames::names`].
    pub i: usize,
    /// Approximate size, bytes.
    pub size_bytes: Option<u64>,
    /// Dimensions (numpy, pandas).
    pub shape: Option<Vec<u64>>,
    /// Short repr or placeholder.
    #[serde(default)]
    pub repr: String,
}

/// Output stream number on which the driver's `snapshot` sends the pickled namespace.
pub const SNAPSHOT_STREAM: u32 = 7;

/// Output stream number on which the driver's `run`/`run_async` send a cell's outcome (a
/// [`DriverResult`] as JSON), as the last message of the execution.
pub const OUTCOME_STREAM: u32 = 8;

/// Output stream number on which the driver sends a cell's MIME bundles (rich output only):
/// `{"kind": "result"|"display", "data": {...}}` as JSON, turned into a `display` line by
/// the output forwarder (`crate::output`), which bounds and checks it.
pub const DISPLAY_STREAM: u32 = 11;

/// Python that pickles the namespace (sent on [`SNAPSHOT_STREAM`]) and reports module
/// bindings, names and unpicklable names in the driver result.
pub fn snapshot_code() -> &'static str {
    "__sandcell__.snapshot()\n"
}

/// Python that loads a snapshot blob into the namespace and re-imports `modules`
/// (global name -> module name); names that could not be re-imported come back in `missing`.
pub fn restore_code(blob: &[u8], modules: &std::collections::BTreeMap<String, String>) -> String {
    let modules = serde_json::to_string(modules).unwrap_or_else(|_| "{}".into());
    format!(
        "__import__('_sandcell').restore(globals(), '{}', __import__('json').loads(__import__('base64').b64decode('{}').decode()))\n",
        b64(blob),
        b64(modules.as_bytes())
    )
}

/// Whether an uncaught exception text means the driver module is missing or broken (a cell
/// removed it), so that the worker re-installs it and runs the cell again. Only errors raised
/// before the cell's own code started can match.
pub fn driver_missing(exception_text: &str) -> bool {
    exception_text.contains("No module named '_sandcell'")
        || exception_text.contains("module '_sandcell' has no attribute")
        || exception_text.contains("name '__sandcell__' is not defined")
}

/// An error as the driver describes it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct DriverError {
    /// Exception class, module-qualified unless builtin or `__main__`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `str(exception)`, cut at 16384 characters by the driver.
    pub message: String,
    /// Formatted traceback restricted to cell frames, at most 80 frames.
    pub traceback: Option<String>,
    /// Line in the current cell where the error was raised.
    pub line: Option<u64>,
}

/// The outcome dict written by the driver (`RESULT_VARIABLE`), decoded from Eryx's JSON result.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct DriverResult {
    /// `ok`, `error`, `exited` or `memory_exhausted`.
    pub status: String,
    /// For `exited`.
    pub exit_code: Option<i64>,
    /// For `error` and `memory_exhausted`.
    pub error: Option<DriverError>,
    /// From `snapshot`: global name -> module name of module bindings, e.g. `np` -> `numpy`.
    #[serde(default)]
    pub modules: std::collections::BTreeMap<String, String>,
    /// From `snapshot`: names of the pickled values (at most 4096).
    #[serde(default)]
    pub names: Vec<String>,
    /// From `run`: the namespace is provably the one the driver's last snapshot captured
    /// (same objects, all immutable), so no new snapshot is needed (see `driver.py`).
    #[serde(default)]
    pub unchanged: bool,
    /// From `snapshot`: names that could not be pickled; from `restore`: module bindings that
    /// could not be re-imported.
    #[serde(default)]
    pub missing: Vec<String>,
}

impl DriverResult {
    /// Parses Eryx's JSON result string, or the outcome sent on [`OUTCOME_STREAM`].
    ///
    /// Errors: the JSON text is not an object of this shape.
    pub fn parse(json: impl AsRef<[u8]>) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(json.as_ref())
    }
}

/// Standard base64 (RFC 4648, with padding), enough for the driver's needs without a crate.
mod base64_engine {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    /// Encodes `data` as padded standard base64.
    pub fn encode(data: &[u8]) -> String {
        let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
        encode_into(data, &mut out);
        out
    }

    /// Appends `data` as padded standard base64 to `out`.
    pub fn encode_into(data: &[u8], out: &mut String) {
        out.reserve(data.len().div_ceil(3) * 4);
        for chunk in data.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            out.push(ALPHABET[(n >> 18) as usize & 63] as char);
            out.push(ALPHABET[(n >> 12) as usize & 63] as char);
            out.push(if chunk.len() > 1 {
                ALPHABET[(n >> 6) as usize & 63] as char
            } else {
                '='
            });
            out.push(if chunk.len() > 2 {
                ALPHABET[n as usize & 63] as char
            } else {
                '='
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_carries_the_complete_and_help_module_the_native_worker_shares() {
        let shared = include_str!("../../worker-native/python/query.py");
        assert!(DRIVER_SOURCE.starts_with(shared));
        assert!(shared.contains("\ndef query_complete(") && shared.contains("\ndef query_help("));
        // Defined once, in the shared part: the driver's own source does not redefine them.
        let own = &DRIVER_SOURCE[shared.len()..];
        assert!(!own.contains("\ndef query_complete(") && !own.contains("\ndef query_help("));
        assert!(own.contains("query_complete(") && own.contains("query_help("));
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        assert_eq!(b64(b""), "");
        assert_eq!(b64(b"f"), "Zg==");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"foobar"), "Zm9vYmFy");
        assert_eq!(b64("✓".as_bytes()), "4pyT");
    }

    #[test]
    fn driver_constants_match_source() {
        assert!(DRIVER_SOURCE.contains(&format!("RESULT = '{RESULT_VARIABLE}'")));
        assert!(DRIVER_SOURCE.contains(&format!("SNAPSHOT_STREAM = {SNAPSHOT_STREAM}\n")));
        assert!(DRIVER_SOURCE.contains(&format!("OUTCOME_STREAM = {OUTCOME_STREAM}\n")));
        assert!(DRIVER_SOURCE.contains(&format!("INSPECT_STREAM = {INSPECT_STREAM}\n")));
        assert!(DRIVER_SOURCE.contains(&format!("DISPLAY_STREAM = {DISPLAY_STREAM}\n")));
        assert!(DRIVER_SOURCE.contains("_run_here.inspect = _inspect_here"));
        assert_eq!(inspect_code(5, 4000), format!("{ENTRY}.inspect(5,4000)\n"));
        assert!(DRIVER_SOURCE.contains(&format!("_builtins.{ENTRY} = _run_here")));
        assert!(snapshot_code().starts_with(&format!("{ENTRY}.snapshot()")));
        assert!(install_code().contains(&DRIVER_HASH.to_string()));
    }

    #[test]
    fn cell_code_picks_the_async_driver_only_when_needed() {
        assert_eq!(
            cell_code(3, "print(1)", true, false),
            "__sandcell__('cHJpbnQoMSk=',3)\n"
        );
        assert_eq!(
            cell_code(3, "print(1)", false, false),
            "__sandcell__('cHJpbnQoMSk=',3,0)\n"
        );
        let a = cell_code(4, "await x()", true, false);
        assert!(a.starts_with("await __import__('_sandcell').run_async("));
        assert!(a.ends_with(", globals(), 4)\n"), "{a}");
        assert!(cell_code(4, "await x()", false, false).ends_with(", globals(), 4,0)\n"));
    }

    #[test]
    fn driver_result_parses_error_and_snapshot_fields() {
        let r = DriverResult::parse(
            r#"{"status":"error","error":{"type":"ZeroDivisionError","message":"division by zero","traceback":"T","line":2},"modules":{"m":"math"},"names":["x"],"missing":["g"]}"#,
        )
        .unwrap();
        assert_eq!(r.status, "error");
        assert_eq!(r.error.as_ref().unwrap().line, Some(2));
        assert_eq!(r.modules.get("m").map(String::as_str), Some("math"));
        assert_eq!(
            (r.names.clone(), r.missing.clone()),
            (vec!["x".to_string()], vec!["g".to_string()])
        );
    }
}
