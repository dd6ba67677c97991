//! Wire formats of sandcell, and nothing else.
//!
//! Architecture invariant: this crate alone knows how bytes look on sandcell's two wires.
//! - [`kernel`]: the `org.sandcell.Kernel` Varlink interface (the data plane between a gateway
//!   and `sandcelld`), its IDL text, method, reply and error types.
//! - [`worker`]: the frames between `sandcelld` and one worker process (a request pipe into the
//!   worker, a JSON-lines pipe out of it).
//! - [`text`]: how arbitrary output bytes become UTF-8 text on both wires, and which characters
//!   display invisibly.
//! - [`query`]: `Complete` and `Help` (completion and help at a cursor) on both wires.
//! - [`cell`]: what both wires say alike about a cell (streams, errors, variables, display
//!   kinds), imported by [`kernel`] and [`worker`], which do not import each other.
//! - [`dbus`]: the row types of the `org.sandcell.Manager1` D-Bus interface.
//!
//! Nothing here performs I/O beyond parsing and formatting in memory.

pub mod cell;
pub mod dbus;
pub mod kernel;
pub mod query;
pub mod text;
pub mod worker;

// Compile-time checks of the worker wire's ceilings against the Varlink messages that carry
// them.
// A cell's source travels in one Varlink call (`Run`/`Execute`), JSON-escaped.
const _: () = assert!(
    worker::SOURCE_CEILING as usize * worker::JSON_ESCAPE_FACTOR + 4096
        <= kernel::MAX_MESSAGE_BYTES
);
// A display bundle at its cap fits one reply line, and one Varlink frame, with its framing.
const _: () = assert!(kernel::MAX_DISPLAY_BYTES + 4096 <= worker::MAX_WORKER_LINE);
const _: () = assert!(kernel::MAX_DISPLAY_BYTES + 4096 <= kernel::MAX_MESSAGE_BYTES);
// Inline uploads and download chunks, base64 (4/3) inside one message.
const _: () = assert!(
    (kernel::MAX_INLINE_BYTES as usize).div_ceil(3) * 4 + 4096 <= kernel::MAX_MESSAGE_BYTES
);
const _: () =
    assert!((kernel::MAX_CHUNK_BYTES as usize).div_ceil(3) * 4 + 4096 <= kernel::MAX_MESSAGE_BYTES);

// The daemon re-encodes an `inspected` line (at most a worker line) in one Varlink reply: JSON
// text decoded and encoded again never grows (an escape stays an escape or gets shorter).
const _: () = assert!(worker::MAX_WORKER_LINE + 4096 <= kernel::MAX_MESSAGE_BYTES);
// The host_call line fits one worker line.
const _: () = assert!(kernel::MAX_HOST_CALL_ARGUMENTS * 2 + 4096 <= worker::MAX_WORKER_LINE);
