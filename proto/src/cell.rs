//! What both wires say alike about a cell: its output streams, its error, the variables
//! `Inspect` lists, whether a display is a result, and the bounds on them. [`crate::kernel`]
//! and [`crate::worker`] both import these (and re-export them, so either path names them);
//! neither imports the other.

use serde::{Deserialize, Serialize};

/// Longest error message a worker reports, in bytes; longer ones are cut with a marker
/// (`stop(strrep("x", 2e8))` must not build a 200 MB frame).
pub const MAX_ERROR_MESSAGE: usize = 16 * 1024;

/// Longest traceback a worker reports, in bytes.
pub const MAX_TRACEBACK: usize = 32 * 1024;

/// Output stream of a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// `"stdout"` or `"stderr"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// An error raised by a cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CellError {
    /// Exception class or R condition class, e.g. `ZeroDivisionError`, `simpleError`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The message, at most [`MAX_ERROR_MESSAGE`] bytes.
    pub message: String,
    /// Formatted traceback, at most [`MAX_TRACEBACK`] bytes, with the user's line numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceback: Option<String>,
    /// Line in the user's cell (1-based) where the error was raised, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u64>,
    /// The failing call (R's `conditionCall`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
}

/// Default number of variables an `inspect` lists.
pub const INSPECT_DEFAULT_ITEMS: u64 = 100;

/// Most variables one `inspect` lists (the Varlink `max_items` ceiling).
pub const INSPECT_MAX_ITEMS: u64 = 1000;

/// Longest a variable's name may be in an `inspected` frame, bytes; a worker leaves longer
/// names out (and says `truncated`).
pub const MAX_VARIABLE_NAME: usize = 256;

/// Longest a variable's type (Python type name, R class) may be, bytes; workers cut longer
/// ones.
pub const MAX_VARIABLE_TYPE: usize = 256;

/// Longest a variable's `repr` may be, in characters (a cut one ends with `...`).
pub const MAX_REPR_CHARS: usize = 200;

/// Most dimensions a variable's `shape` may have (numpy allows 64).
pub const MAX_SHAPE_DIMS: usize = 64;

/// One variable of a session, as `Inspect` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Variable {
    /// The name it is bound to (never one starting with `_`), at most [`MAX_VARIABLE_NAME`]
    /// bytes.
    pub name: String,
    /// Python: the value's type, module-qualified unless builtin (`int`,
    /// `pandas.core.frame.DataFrame`); R: its first class (`data.frame`, `matrix`,
    /// `numeric`). At most [`MAX_VARIABLE_TYPE`] bytes.
    #[serde(rename = "type")]
    pub kind: String,
    /// Approximate size in bytes: numpy `nbytes`, pandas `memory_usage(deep=False)` summed,
    /// else `sys.getsizeof` (Python); `object.size` (R). Absent when it could not be had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Dimensions of arrays, data frames and matrices (numpy/pandas `shape`, R `dim()`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// A short representation, at most [`MAX_REPR_CHARS`] characters: Python a bounded
    /// `reprlib` repr, R the first lines of `str()`. A placeholder in angle brackets when it
    /// failed or ran out of time (`<repr failed: ValueError>`, `<repr timed out>`,
    /// `<repr skipped: time budget used up>`).
    pub repr: String,
}

impl Variable {
    /// Checks a worker's variable against the bounds above. Errors: what is out of bounds.
    pub fn check(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_VARIABLE_NAME {
            return Err(format!("variable name of {} bytes", self.name.len()));
        }
        if self.name.starts_with('_') {
            return Err("variable name starting with _".into());
        }
        if self.kind.len() > MAX_VARIABLE_TYPE {
            return Err(format!("variable type of {} bytes", self.kind.len()));
        }
        if self.repr.chars().count() > MAX_REPR_CHARS {
            return Err("repr longer than its bound".into());
        }
        if self
            .shape
            .as_ref()
            .is_some_and(|s| s.len() > MAX_SHAPE_DIMS)
        {
            return Err("shape with too many dimensions".into());
        }
        Ok(())
    }
}

/// Whether a display frame is the cell's result or an explicit display.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisplayKind {
    /// The value of the cell's last expression (Jupyter's `execute_result`).
    Result,
    /// A display call, a figure, R graphics or an R printed value (Jupyter's `display_data`).
    Display,
}

impl DisplayKind {
    /// `"result"` or `"display"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DisplayKind::Result => "result",
            DisplayKind::Display => "display",
        }
    }
}
