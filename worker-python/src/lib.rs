//! sandcell's Python worker: CPython inside Eryx 0.10 (WebAssembly on wasmtime), one process
//! per session, speaking the daemon<->worker protocol of `sandcell_proto::worker`.
//!
//! This crate is the only one in the tree that links Eryx and wasmtime (DESIGN.md: the daemon
//! never does). Two executables use it:
//! - `sandcell-worker-python` ([`worker`]): confines itself (`sandcell_confine`), loads the
//!   prepared runtime ([`runtime`]), keeps one session ([`session`]) and serves cells from fd 3,
//!   replying on fd 4 ([`protocol`], [`replies`], [`output`]); SIGINT stops the running cell
//!   ([`interrupt`]).
//! - `sandcell-python-runtime`: prepares the runtime directory offline (`prepare`), checks it
//!   (`check`) and measures in-process Eryx baselines (`bench`).
//!
//! Guest-side behaviour (tracebacks with the cell's own line numbers, `SystemExit`, output
//! streaming without guest buffering) lives in the driver module ([`driver`]).

pub mod driver;
pub mod interrupt;
pub mod output;
pub mod protocol;
pub mod replies;
pub mod runtime;
pub mod session;
pub mod worker;
