//! sandcell's Python worker: CPython inside Eryx 0.10 (WebAssembly on wasmtime), one process
//! per session, speaking the daemon<->worker protocol of `sandcell_proto::worker`.
//!
//! This crate is the only one in the tree that links Eryx and wasmtime (the daemon
//! never does). Two executables use it:
//! - `sandcell-worker-python` ([`worker`]): confines itself (`sandcell_confine`), loads the
//!   prepared runtime ([`runtime`]), keeps one session ([`session`]) and serves cells from fd 3,
//!   replying on fd 4 ([`protocol`], [`replies`], [`output`]); SIGINT stops the running cell
//!   ([`interrupt`]); cells call the client's tools through a host-backed file ([`host`]).
//! - `sandcell-python-runtime`: prepares the runtime directory offline (`prepare`), checks it
//!   (`check`), measures in-process Eryx baselines (`bench`) and a real worker's cell round
//!   trip over its pipes next to raw Eryx (`bench-worker`).
//!
//! Guest-side behaviour (tracebacks with the cell's own line numbers, `SystemExit`, output
//! streaming without guest buffering) lives in the driver module ([`driver`]).
//!
//! # Files
//!
//! The session directory (`SANDCELL_SESSION_DIR`: 0700, the worker's uid, the one read-write
//! path Landlock grants) is the guest's `/mnt/data`, read-write, and the working directory
//! of every cell (set when an instance is created or rebuilt; a cell's `os.chdir` lasts for
//! the session, as in CPython). It is a real host directory mounted with Eryx's `vfs` feature
//! (`VolumeMount`, eryx-vfs' hybrid `wasi:filesystem`), not a copy: a file a cell writes is
//! on disk as the cell writes it, an upload is visible to the next cell, and nothing is
//! synchronised at cell boundaries. The mount keeps a descriptor of the directory opened at
//! instance creation; every guest path is resolved beneath it by `cap-primitives`
//! (`openat2(RESOLVE_BENEATH)` where the kernel has it, component-by-component resolution
//! otherwise), so `..` cannot climb out and nothing else of the host is named.
//!
//! - **Symlinks** (eryx-vfs 0.10.1, pinned by `tests/files.rs`). A link that resolves inside
//!   the directory works (`alias -> data.csv`). One that leads out (`-> /etc/shadow`, or
//!   `../../..`) or nowhere fails with `OSError` on open and `stat`, and makes `os.listdir` of
//!   its directory fail with `EIO` (eryx-vfs stats every entry, following links); the guest
//!   can `os.remove` it. `stat` and `lstat` both follow links (`os.path.islink` is always
//!   False); `os.scandir` entries report `is_symlink()`. A cell can make links with relative
//!   targets only (an absolute target is refused); one that climbs out is made but leads
//!   nowhere, and the daemon never follows a link (`RESOLVE_NO_SYMLINKS`). Hard links are
//!   refused.
//! - **Sizes.** One file is bounded by `RLIMIT_FSIZE` (the plan's `max_file_bytes`, 256 MiB
//!   from the daemon): the worker ignores `SIGXFSZ`, so the write that crosses it fails with
//!   `OSError` (`EFBIG` on the host; eryx-vfs 0.10.1 reports a failed stream write as `EIO`)
//!   and the session goes on. Eryx 0.10's VFS quota (`max_vfs_bytes`) covers only its
//!   in-memory storage, not a host mount, so the bytes a cell or a session writes in total,
//!   and the number of files, are *not* bounded by the worker: that needs a bound on the file
//!   system of the session directories (quota, or a size-limited mount), or a check by the
//!   daemon after each cell. eryx-vfs 0.10.1 also reports a short write as complete, so when
//!   the write that reaches the limit is the cell's last one the file silently ends at
//!   exactly `max_file_bytes` bytes (wasi-libc writes in chunks of at most 64 KiB, so any
//!   later write does fail).
//! - **Scratch.** `/tmp` is Eryx's in-memory VFS storage (a `vfs` session always has one),
//!   at most [`session::SCRATCH_MAX_BYTES`] (then `OSError`, `EIO`), kept across rebuilds,
//!   gone with the session, never in the session directory.
//! - **State.** Files are not part of state snapshots: they stay on disk through a rebuild,
//!   and the rebuilt instance mounts the same directory again.

pub mod driver;
pub mod host;
pub mod interrupt;
pub mod output;
pub mod protocol;
pub mod replies;
pub mod runtime;
pub mod session;
pub mod worker;
