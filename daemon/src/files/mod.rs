//! Files in and out of a session directory: every file-system operation the daemon does on a
//! session directory on a client's behalf.
//!
//! The daemon runs as root and the directory belongs to a hostile worker that can plant
//! symlinks, FIFOs and sockets, and swap entries while the daemon works. So:
//!
//! - names are validated first ([`validate_name`]): relative, `/`-separated, no `.`/`..`
//!   component, no NUL or control character, no leading `-`, at most [`MAX_NAME_BYTES`] bytes
//!   and [`MAX_DEPTH`] components;
//! - every path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//!   RESOLVE_NO_MAGICLINKS)` (or, where a sandbox refuses openat2, the equivalent walk of
//!   [`crate::resolve`]) from a descriptor of the session directory, and every further
//!   step is relative to a descriptor, never to a path: a symlink anywhere fails the call
//!   (`ELOOP`), `..` can never leave the directory;
//! - reads open with `O_NOFOLLOW | O_NONBLOCK` (a FIFO must not block) and check `fstat` is a
//!   regular file before reading a byte;
//! - writes go to a fresh temporary (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600, `fchown`ed to
//!   the worker identity) renamed over the name with `renameat` (atomic); only a regular file
//!   is ever replaced: a directory, symlink or special file in the way refuses the upload;
//! - sizes are checked from the declared size (and `fstat` of a passed descriptor) against
//!   `max_file_bytes` and `max_session_files_bytes` before anything is read;
//! - a passed descriptor ([`UploadFd`]) is read only if it is a regular file on a local file
//!   system ([`inspect_upload`], [`UPLOAD_FILE_SYSTEMS`]);
//! - listings use `fstatat(AT_SYMLINK_NOFOLLOW)` only, bounded to [`MAX_ENTRIES`] entries and
//!   [`MAX_DEPTH`] levels; the worker's scratch directory [`SCRATCH_DIR`] and in-flight
//!   uploads are left out of what is reported, never out of what is counted.
//!
//! # The layout of a session directory
//!
//! A session directory (the session's own tmpfs, owned by the daemon, mode 0711) holds two
//! directories of the worker's ([`lay_out`]): [`FILES_DIR`], the user's files, and
//! [`SCRATCH_DIR`], the worker's `TMPDIR`. Every name a client gives or is shown is relative
//! to [`FILES_DIR`], so no listing (`ListFiles`, a cell's `files`, the worker's own listing of
//! its working directory) shows the scratch; both are on the one file system, so a cell's
//! `rename(2)` from its temporary directory into its files works (across file systems, or
//! across two mounts of one, it fails `EXDEV`). The disk budget counts the whole session
//! directory, scratch included. A directory without [`FILES_DIR`] (the fake worker of the
//! library tests) is laid out flat: it is its own files directory, its scratch
//! [`FLAT_SCRATCH_DIR`].
//!
//! # The disk budget
//!
//! What a session directory costs is its [`Usage`]: every entry at any depth (hidden names,
//! the scratch directory, in-flight uploads, directories and symlinks included) counts as
//! one entry against [`MAX_SESSION_ENTRIES`] (the inode budget), and every inode is charged
//! the larger of its size and its allocated blocks (`st_blocks * 512`), once however many
//! hard links it has. A sparse file is charged its size; a file with blocks reserved past
//! its end (the worker cannot do that: `fallocate(FALLOC_FL_KEEP_SIZE)` is denied by its
//! seccomp policy, but a file can arrive from elsewhere) its blocks.
//!
//! The kernel holds the budget: each session directory is its own tmpfs of the budget's
//! size and the entry budget's inodes (`crate::session_fs`), so a write past either fails
//! with `ENOSPC` in the writer; an upload the tmpfs refuses is [`Error::TooLarge`]
//! ([`put_charged`]), and uploads are written from the session's memory cgroup. The total is
//! still taken before each upload, after each cell, and while a cell runs (the session's
//! disk watch, `session.rs`, walks again every 25-250 ms and stops the cell when over), for
//! reporting and for what a tmpfs does not bound (sparse sizes, hard links).
//!
//! All functions here block (file-system calls); callers run them on a blocking thread.

use nix::errno::Errno;
use nix::unistd::{UnlinkatFlags, unlinkat};
use sandcell_proto::kernel::{FileInfo, FileKind, KernelError, media_type};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

mod beneath;
mod listing;
mod put;
#[cfg(test)]
mod tests;
mod upload_fd;

pub use beneath::{files_dir, lay_out, validate_name, validate_new_name};
pub use listing::{Listing, MAX_STAMPS_BYTES, Usage, list, list_within};
pub use put::{check_upload, put, put_charged, put_until};
pub use upload_fd::{UPLOAD_FILE_SYSTEMS, UploadFd, UploadRefused, inspect_upload};

use beneath::{classify, cstr, fstat, lstat_at, open_files, open_parent, openat2};

/// Entries a listing or a cell's change list reports at most.
pub const MAX_ENTRIES: usize = 1000;
/// Path components of a name at most (and levels a listing descends).
pub const MAX_DEPTH: usize = 4;
/// Bytes of a whole name at most.
pub const MAX_NAME_BYTES: usize = 1024;
/// Bytes of one component at most (NAME_MAX).
pub const MAX_COMPONENT_BYTES: usize = 255;
/// Entries a session directory may hold in all (the inode budget): every name at any depth,
/// hidden ones, the scratch directory's and in-flight uploads included. The walk that counts
/// them stops one past this.
pub const MAX_SESSION_ENTRIES: u64 = 4096;
/// Levels the counting walk descends (below [`MAX_DEPTH`] only hidden entries can be: names
/// of more components are refused); deeper is over budget. Also bounds the descriptors a
/// walk holds open (one per level).
pub const MAX_WALK_DEPTH: usize = 16;
/// The directory of a session directory holding the user's files: what `/mnt/data` shows a
/// worker, and what every client-given name is relative to.
pub const FILES_DIR: &str = "data";
/// The directory of a session directory holding the worker's scratch (`TMPDIR`, R's
/// `tempdir()`, Python's `tempfile`), beside [`FILES_DIR`]: never listed, always counted.
pub const SCRATCH_DIR: &str = "tmp";
/// The scratch directory of a session directory laid out flat (without [`FILES_DIR`]), left
/// out of listings (but counted).
pub const FLAT_SCRATCH_DIR: &str = ".tmp";
/// Prefix of the daemon's in-flight upload temporaries, left out of listings.
const TEMP_PREFIX: &str = ".sandcell-put-";
/// Copy buffer for descriptor uploads, bytes.
const COPY_CHUNK: usize = 64 * 1024;
/// How long after an upload's deadline its answer waits for the copy to stop and remove its
/// temporary: the copy checks the deadline before each chunk, and a chunk of a local file is
/// read and written in far less.
pub const PUT_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Budget named by `CapacityExceeded` when the state directory's file system refuses the
/// daemon's own write for want of room (`ENOSPC`, `EDQUOT`).
pub const STATE_DIRECTORY_SPACE: &str = "state_directory_space";

/// Why a file operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The name is refused by [`validate_name`].
    #[error("invalid file name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Nothing of that name.
    #[error("no such file {0:?}")]
    NoSuchFile(String),
    /// The entry (or a component on its way) is not a regular file / directory.
    #[error("{name:?} is a {}, not a regular file", kind.as_str())]
    NotRegular {
        /// The name.
        name: String,
        /// What it is.
        kind: FileKind,
    },
    /// The file belongs to someone other than the session's worker: a hard link the worker
    /// made to a file it does not own is never read with the daemon's rights.
    #[error("{0:?} is not owned by the session's worker")]
    Foreign(String),
    /// A size limit: `limit` is the configuration key.
    #[error("{limit}: {value} exceeds {max}")]
    TooLarge {
        /// `max_file_bytes`, `max_session_files_bytes`, `max_worker_pids` (an upload into a
        /// session at its process limit), `max_session_entries` (every entry,
        /// [`MAX_SESSION_ENTRIES`]) or `max_listed_entries` ([`MAX_ENTRIES`]).
        limit: &'static str,
        /// Requested bytes (for the session limit: in use + requested).
        value: u64,
        /// The limit.
        max: u64,
    },
    /// The content does not match what was declared, or the passed descriptor is unusable.
    #[error("{parameter}: {reason}")]
    BadSource {
        /// `size`, `data` or `fd`.
        parameter: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The upload's deadline passed before it was stored: nothing of it is left.
    #[error("the upload did not finish within {0} s")]
    Deadline(u64),
    /// The file system of the state directory has no room (`ENOSPC`, or `EDQUOT` when a
    /// quota applies) for the daemon's own write: nothing of the upload is left. `in_use` and
    /// `max` are that file system's used and total bytes (`statvfs`), `requested` the
    /// upload's declared size.
    #[error("state directory full: {in_use} of {max} bytes in use, {requested} requested")]
    NoSpace {
        /// Bytes in use on the file system (blocks less those available to the daemon).
        in_use: u64,
        /// Bytes the upload declared.
        requested: u64,
        /// Bytes of the file system.
        max: u64,
    },
    /// An OS call failed on the daemon's side: a server fault, never the client's.
    #[error("{op} {path:?}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The name it was done to, relative to the session directory ("." for the directory
        /// itself; empty until the public function that failed fills it in).
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

impl Error {
    /// Names `path` (relative to the session directory) in an [`Error::Io`] that does not
    /// name one yet; other errors are returned unchanged.
    fn at(self, path: &str) -> Self {
        match self {
            Error::Io {
                op,
                path: p,
                source,
            } if p.is_empty() => Error::Io {
                op,
                path: path.into(),
                source,
            },
            e => e,
        }
    }
}

impl From<Error> for KernelError {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidName { name, reason } => KernelError::InvalidFileName { name, reason },
            Error::NoSuchFile(name) => KernelError::NoSuchFile { name },
            Error::NotRegular { name, kind } => KernelError::NotRegularFile {
                name,
                kind: kind.as_str().into(),
            },
            Error::Foreign(name) => KernelError::NotRegularFile {
                name,
                kind: "foreign".into(),
            },
            Error::TooLarge { limit, value, max } => KernelError::LimitExceeded {
                limit: limit.into(),
                value,
                max,
            },
            Error::BadSource { parameter, reason } => KernelError::InvalidParameter {
                parameter: parameter.into(),
                reason,
            },
            Error::Deadline(secs) => KernelError::LimitExceeded {
                limit: "put_file_seconds".into(),
                value: secs,
                max: secs,
            },
            Error::NoSpace {
                in_use,
                requested,
                max,
            } => KernelError::CapacityExceeded {
                budget: STATE_DIRECTORY_SPACE.into(),
                in_use,
                requested,
                max,
                retry_after_seconds: None,
            },
            Error::Io { op, path, source } => KernelError::InternalError {
                operation: op.into(),
                reason: format!("{path}: {source}"),
            },
        }
    }
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io {
        op,
        path: String::new(),
        source,
    }
}

/// Size limits of uploads, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One file.
    pub max_file_bytes: u64,
    /// Everything a session directory holds, as charged by [`Usage::bytes`].
    pub max_session_files_bytes: u64,
}

/// Where an upload's bytes come from.
#[derive(Debug)]
pub enum Source {
    /// Decoded inline data.
    Inline(Vec<u8>),
    /// A descriptor the client passed; must be a regular file of exactly the declared size.
    Fd(OwnedFd),
}

fn kind_of(mode: libc::mode_t) -> FileKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => FileKind::File,
        libc::S_IFDIR => FileKind::Dir,
        libc::S_IFLNK => FileKind::Symlink,
        _ => FileKind::Special,
    }
}

fn info(name: String, st: &libc::stat) -> FileInfo {
    let kind = kind_of(st.st_mode);
    FileInfo {
        media_type: match kind {
            FileKind::File => media_type(&name).into(),
            FileKind::Dir => "inode/directory".into(),
            FileKind::Symlink => "inode/symlink".into(),
            FileKind::Special => "inode/x-special".into(),
        },
        size: match kind {
            FileKind::File | FileKind::Symlink => st.st_size.max(0) as u64,
            _ => 0,
        },
        kind,
        modified: st.st_mtime as f64 + st.st_mtime_nsec as f64 / 1e9,
        name,
    }
}

/// Reads at most `max` bytes of the regular file `name` from `offset`. Returns the file's
/// description (from `fstat` of the opened descriptor), the bytes, and whether they reach
/// the end of the file. With `owner` (the worker's uid), a file owned by anyone else is
/// refused: the worker could have hard-linked a file it cannot read itself.
///
/// Errors: [`Error::InvalidName`], [`Error::NoSuchFile`], [`Error::NotRegular`] (a symlink
/// anywhere on the path, a directory, a FIFO, a socket, a device: none is read),
/// [`Error::Foreign`], [`Error::Io`].
pub fn read(
    dir: &Path,
    name: &str,
    offset: u64,
    max: u64,
    owner: Option<u32>,
) -> Result<(FileInfo, Vec<u8>, bool), Error> {
    read_inner(dir, name, offset, max, owner).map_err(|e| e.at(name))
}

fn read_inner(
    dir: &Path,
    name: &str,
    offset: u64,
    max: u64,
    owner: Option<u32>,
) -> Result<(FileInfo, Vec<u8>, bool), Error> {
    validate_name(name)?;
    let root = open_files(dir)?;
    // O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW and RESOLVE_* refuse
    // every symlink.
    let fd = match openat2(
        root.as_fd(),
        name,
        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY,
        0,
    ) {
        Ok(fd) => fd,
        Err(_) => return Err(classify(root.as_fd(), name)),
    };
    let st = fstat(fd.as_fd()).map_err(io("fstat"))?;
    let kind = kind_of(st.st_mode);
    if kind != FileKind::File {
        return Err(Error::NotRegular {
            name: name.into(),
            kind,
        });
    }
    if owner.is_some_and(|uid| uid != st.st_uid) {
        return Err(Error::Foreign(name.into()));
    }
    let size = st.st_size.max(0) as u64;
    let want = size.saturating_sub(offset).min(max) as usize;
    let file = std::fs::File::from(fd);
    let mut buf = vec![0u8; want];
    let mut got = 0;
    while got < want {
        let n = std::os::unix::fs::FileExt::read_at(&file, &mut buf[got..], offset + got as u64)
            .map_err(io("read"))?;
        if n == 0 {
            break; // the file shrank meanwhile
        }
        got += n;
    }
    buf.truncate(got);
    let eof = offset + got as u64 >= size;
    Ok((info(name.into(), &st), buf, eof))
}

/// Removes `name`: a file, a symlink (the link itself) or an empty directory.
///
/// Errors: [`Error::InvalidName`], [`Error::NoSuchFile`], [`Error::NotRegular`] (a symlink on
/// the way; a directory that is not empty, kind `dir`), [`Error::Io`].
pub fn delete(dir: &Path, name: &str) -> Result<(), Error> {
    delete_inner(dir, name).map_err(|e| e.at(name))
}

fn delete_inner(dir: &Path, name: &str) -> Result<(), Error> {
    let parts = validate_name(name)?;
    let root = open_files(dir)?;
    let parent = open_parent(&root, name, &parts, false, None, &mut Vec::new())?;
    let leaf = cstr(parts[parts.len() - 1])?;
    let st = match lstat_at(parent.as_fd(), &leaf) {
        Ok(st) => st,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            return Err(Error::NoSuchFile(name.into()));
        }
        Err(e) => return Err(io("fstatat")(e)),
    };
    let flags = if kind_of(st.st_mode) == FileKind::Dir {
        UnlinkatFlags::RemoveDir
    } else {
        UnlinkatFlags::NoRemoveDir
    };
    // unlinkat removes the entry itself.
    match unlinkat(&parent, leaf.as_c_str(), flags) {
        Ok(()) => {}
        // The client asked for something DeleteFile does not do: not a server fault.
        Err(Errno::ENOTEMPTY) => {
            return Err(Error::NotRegular {
                name: name.into(),
                kind: FileKind::Dir,
            });
        }
        Err(e) => return Err(io("unlink")(e.into())),
    }
    Ok(())
}
