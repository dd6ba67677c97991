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
//! - [`dbus`]: the row types of the `org.sandcell.Manager1` D-Bus interface.
//!
//! Nothing here performs I/O beyond parsing and formatting in memory.

pub mod dbus;
pub mod kernel;
pub mod query;
pub mod text;
pub mod worker;
