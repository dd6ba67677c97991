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
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid, UnlinkatFlags, unlinkat};
use sandcell_proto::kernel::{FileInfo, FileKind, KernelError, media_type};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

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
/// The worker's scratch directory (R's `TMPDIR`), left out of listings (but counted).
pub const SCRATCH_DIR: &str = ".tmp";
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

/// A descriptor a client passed as a `PutFile` source. Inspect ([`inspect_upload`]) and read
/// it on the blocking pool only; dropping it hands the descriptor to the closer it was made
/// with (the Varlink transport closes passed descriptors off the async runtime).
pub struct UploadFd {
    fd: Option<OwnedFd>,
    close: Option<Box<dyn FnOnce(OwnedFd) + Send>>,
}

impl UploadFd {
    /// `fd`, to be closed by `close` when dropped unread.
    pub fn new(fd: OwnedFd, close: impl FnOnce(OwnedFd) + Send + 'static) -> UploadFd {
        UploadFd {
            fd: Some(fd),
            close: Some(Box::new(close)),
        }
    }
}

impl std::fmt::Debug for UploadFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadFd")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
}

impl Drop for UploadFd {
    fn drop(&mut self) {
        if let (Some(fd), Some(close)) = (self.fd.take(), self.close.take()) {
            close(fd);
        }
    }
}

/// File systems whose regular files `PutFile` reads: local, block- or memory-backed, where a
/// read cannot wait on another process or the network. Names as in `/proc/self/mountinfo`.
pub const UPLOAD_FILE_SYSTEMS: &[&str] = &[
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "f2fs",
];

/// Why a passed descriptor is refused as an upload source.
#[derive(Debug, thiserror::Error)]
pub enum UploadRefused {
    /// Not a regular file (a socket, pipe, device, directory).
    #[error("the passed descriptor is not a regular file")]
    NotRegular,
    /// A regular file on a file system outside [`UPLOAD_FILE_SYSTEMS`].
    #[error("the passed file is on a {0} file system; only local file systems are read")]
    FileSystem(String),
    /// The checks themselves failed.
    #[error("inspecting the passed descriptor: {0}")]
    Io(std::io::Error),
}

/// Checks an upload source without asking its file system anything (blocking; call on the
/// blocking pool). `statx` with `AT_STATX_DONT_SYNC` gives the file type and the device from
/// the kernel's cached inode (FUSE and NFS do not ask their server then; `fstatfs` would, and a
/// FUSE server could leave it unanswered). The file's mount is then found in
/// `/proc/self/mountinfo` and must be of a type in [`UPLOAD_FILE_SYSTEMS`]. Returns the
/// descriptor for reading.
pub fn inspect_upload(mut u: UploadFd) -> Result<OwnedFd, (UploadFd, UploadRefused)> {
    let fd = u.fd.as_ref().expect("an upload holds its descriptor");
    let (mode, dev) = match cached_stat(fd.as_raw_fd()) {
        Ok(v) => v,
        Err(e) => return Err((u, UploadRefused::Io(e))),
    };
    if mode & libc::S_IFMT != libc::S_IFREG {
        return Err((u, UploadRefused::NotRegular));
    }
    let fstype = match mount_type(fd.as_raw_fd(), dev) {
        Ok(Some(t)) => t,
        // Sockets, pipes and memfds live on internal mounts that mountinfo does not list, and
        // a file on a mount the daemon's namespace lacks cannot be judged: refused.
        Ok(None) => return Err((u, UploadRefused::FileSystem("unlisted".into()))),
        Err(e) => return Err((u, UploadRefused::Io(e))),
    };
    if !UPLOAD_FILE_SYSTEMS.contains(&fstype.as_str()) {
        return Err((u, UploadRefused::FileSystem(fstype)));
    }
    Ok(u.fd.take().expect("checked above"))
}

/// `(st_mode, "major:minor" of st_dev)` of `fd` from the cached inode
/// (`statx(2)` with `AT_EMPTY_PATH | AT_STATX_DONT_SYNC`).
fn cached_stat(fd: i32) -> std::io::Result<(u32, String)> {
    // SAFETY: an all-zero statx is valid; statx writes into it.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open, the path is a NUL-terminated empty string, `st` is valid for writes.
    let r = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            &mut st,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((
        u32::from(st.stx_mode),
        format!("{}:{}", st.stx_dev_major, st.stx_dev_minor),
    ))
}

/// The file system type of the mount `fd` is on, from `/proc/self/mountinfo`: the line whose
/// mount id (`/proc/self/fdinfo`, `mnt_id`) and device both match, else any line of the same
/// device. Mount ids are per mount namespace: a client's file opened outside the daemon's
/// namespace (systemd's `ProtectSystem=` gives the daemon its own) carries an id that names
/// another mount here, or none; the device names the same file system in every namespace.
/// `None` when no mount of that device is listed (sockets, pipes, memfds, or a file system
/// the daemon's namespace does not have).
fn mount_type(fd: i32, dev: String) -> std::io::Result<Option<String>> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    let mnt = info
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .map(|v| v.trim().to_owned());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    // (mount id, device, file system type) of each line.
    let rows = mounts.lines().filter_map(|l| {
        let mut f = l.split(' ');
        let id = f.next()?;
        let device = f.nth(1)?;
        let fstype = l.split_once(" - ")?.1.split(' ').next()?;
        Some((id, device, fstype))
    });
    let mut same_device = None;
    for (id, device, fstype) in rows {
        if device != dev {
            continue;
        }
        if mnt.as_deref() == Some(id) {
            return Ok(Some(fstype.to_owned()));
        }
        same_device.get_or_insert_with(|| fstype.to_owned());
    }
    Ok(same_device)
}

/// Checks `name` and splits it into its components. Every name a worker can create and a
/// listing reports passes, so nothing is listed that cannot be fetched or deleted: tabs,
/// newlines and other control characters, and a leading `-`, are allowed (clients escape
/// names before printing them). Uploads are stricter ([`validate_new_name`]).
///
/// Errors: [`Error::InvalidName`] for an empty or absolute name, an empty, `.` or `..`
/// component, a NUL, a component over 255 bytes, more than [`MAX_DEPTH`] components or
/// [`MAX_NAME_BYTES`] bytes, or the daemon's reserved temporary prefix.
pub fn validate_name(name: &str) -> Result<Vec<&str>, Error> {
    let bad = |reason: &str| Error::InvalidName {
        name: name.chars().take(256).collect(),
        reason: reason.into(),
    };
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(bad("longer than 1024 bytes"));
    }
    if name.contains('\0') {
        return Err(bad("contains NUL"));
    }
    if name.starts_with('/') {
        return Err(bad("absolute"));
    }
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() > MAX_DEPTH {
        return Err(bad("more than 4 components"));
    }
    for p in &parts {
        match *p {
            "" => return Err(bad("empty component")),
            "." | ".." => return Err(bad("'.' or '..' component")),
            p if p.len() > MAX_COMPONENT_BYTES => return Err(bad("component over 255 bytes")),
            p if p.starts_with(TEMP_PREFIX) => return Err(bad("reserved prefix")),
            _ => {}
        }
    }
    Ok(parts)
}

/// [`validate_name`] for a name a client creates (`PutFile`): additionally no control
/// character, no invisible formatting character
/// ([`sandcell_proto::text::is_invisible_format`]) and no component
/// starting with `-`, so that an upload never makes a name a shell or a terminal would
/// misread. Errors: [`Error::InvalidName`].
pub fn validate_new_name(name: &str) -> Result<Vec<&str>, Error> {
    let parts = validate_name(name)?;
    let bad = |reason: &str| Error::InvalidName {
        name: name.chars().take(256).collect(),
        reason: reason.into(),
    };
    if name.chars().any(char::is_control) {
        return Err(bad("contains a control character"));
    }
    if name.chars().any(sandcell_proto::text::is_invisible_format) {
        return Err(bad(
            "contains an invisible formatting character (bidirectional control, zero width)",
        ));
    }
    if parts.iter().any(|p| p.starts_with('-')) {
        return Err(bad("component starts with '-'"));
    }
    Ok(parts)
}

/// `openat2(dir, path, flags | O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
/// RESOLVE_NO_MAGICLINKS)`, or the equivalent walk where openat2 is refused
/// ([`crate::resolve`]): nothing outside `dir`, no symlink and no /proc magic link is ever
/// followed (openat2(2), Linux 5.6).
fn openat2(dir: BorrowedFd<'_>, path: &str, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    crate::resolve::open(
        dir,
        Path::new(path),
        flags,
        mode,
        crate::resolve::Scope::Beneath,
    )
}

fn cstr(name: &str) -> Result<CString, Error> {
    CString::new(name).map_err(|_| Error::InvalidName {
        name: name.into(),
        reason: "contains NUL".into(),
    })
}

fn fstat(fd: BorrowedFd<'_>) -> std::io::Result<libc::stat> {
    Ok(nix::sys::stat::fstat(fd)?)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: never follows a symlink. `name` is one component.
fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<libc::stat> {
    Ok(nix::sys::stat::fstatat(
        dir,
        name,
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?)
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

/// Opens the session directory itself (no symlink as its last component).
fn open_root(dir: &Path) -> Result<OwnedFd, Error> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| io("open session directory")(e).at("."))?;
    Ok(f.into())
}

use std::os::unix::fs::OpenOptionsExt;

/// Classifies what is at `name` without following anything, for an error message: a symlink
/// on the way (or at the end) is `symlink`.
fn classify(root: BorrowedFd<'_>, name: &str) -> Error {
    match openat2(root, name, libc::O_PATH | libc::O_NOFOLLOW, 0) {
        Ok(fd) => match fstat(fd.as_fd()) {
            Ok(st) => Error::NotRegular {
                name: name.into(),
                kind: kind_of(st.st_mode),
            },
            Err(e) => Error::Io {
                op: "fstat",
                path: name.into(),
                source: e,
            },
        },
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Error::NoSuchFile(name.into()),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Error::NotRegular {
            name: name.into(),
            kind: FileKind::Symlink,
        },
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Error::NotRegular {
            name: name.into(),
            kind: FileKind::File,
        },
        Err(e) => Error::Io {
            op: "open",
            path: name.into(),
            source: e,
        },
    }
}

/// Directories an upload created on its way to its name, outermost first: each as (a
/// descriptor of its parent, its name), so a failed upload removes them again without
/// resolving a path.
type Created = Vec<(OwnedFd, CString)>;

/// Removes the directories of `created` that are still empty, innermost first.
fn remove_created(created: &Created) {
    for (parent, name) in created.iter().rev() {
        // AT_REMOVEDIR removes an empty directory entry only, never following a symlink.
        let _ = unlinkat(parent, name.as_c_str(), UnlinkatFlags::RemoveDir);
    }
}

/// Opens the directory holding the last component of `parts`, creating missing directories
/// (mode 0700, owned by `owner`) when `create`, and noting each one it created in `created`.
fn open_parent(
    root: &OwnedFd,
    name: &str,
    parts: &[&str],
    create: bool,
    owner: Option<(u32, u32)>,
    created: &mut Created,
) -> Result<OwnedFd, Error> {
    let mut cur = root.try_clone().map_err(io("dup"))?;
    for p in &parts[..parts.len() - 1] {
        if create {
            let c = cstr(p)?;
            // mkdirat never follows a symlink in its last component.
            match nix::sys::stat::mkdirat(&cur, c.as_c_str(), Mode::from_bits_retain(0o700)) {
                Ok(()) => {
                    created.push((cur.try_clone().map_err(io("dup"))?, c.clone()));
                    if let Some((uid, gid)) = owner {
                        // AT_SYMLINK_NOFOLLOW changes the entry itself.
                        nix::unistd::fchownat(
                            &cur,
                            c.as_c_str(),
                            Some(Uid::from_raw(uid)),
                            Some(Gid::from_raw(gid)),
                            AtFlags::AT_SYMLINK_NOFOLLOW,
                        )
                        .map_err(|e| io("fchownat")(e.into()))?;
                    }
                }
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(io("mkdirat")(e.into())),
            }
        }
        cur = match openat2(
            cur.as_fd(),
            p,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        ) {
            Ok(fd) => fd,
            Err(_) => return Err(classify(root.as_fd(), name)),
        };
    }
    Ok(cur)
}

/// Per-entry fingerprint used to tell which entries a cell changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    mode: u32,
    size: i64,
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(st: &libc::stat) -> Stamp {
    Stamp {
        mode: st.st_mode,
        size: st.st_size,
        ino: st.st_ino,
        mtime: (st.st_mtime, st.st_mtime_nsec),
        ctime: (st.st_ctime, st.st_ctime_nsec),
    }
}

/// A bounded, lstat-only walk of a session directory.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Entries sorted by name.
    pub files: Vec<FileInfo>,
    /// Not every entry is in `files`: more than [`MAX_ENTRIES`] visible entries, a directory
    /// at [`MAX_DEPTH`] that holds more, or the directory is over its entry budget
    /// ([`Usage::over`]). A session whose listing is truncated after a cell ends.
    pub truncated: bool,
    /// What the whole directory costs, hidden entries included.
    pub usage: Usage,
    stamps: HashMap<String, Stamp>,
    /// Charged bytes of each listed regular file (for an upload replacing it).
    charges: HashMap<String, u64>,
}

/// What a session directory costs (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes charged: per inode the larger of `st_size` and `st_blocks * 512` (symlinks,
    /// directories and special files: their blocks); the session directory itself, which
    /// the daemon made, is not charged.
    pub bytes: u64,
    /// Entries counted (any kind, any depth, hidden ones included), at most
    /// [`MAX_SESSION_ENTRIES`] + 1.
    pub entries: u64,
    /// More than [`MAX_SESSION_ENTRIES`] entries, or directories deeper than
    /// [`MAX_WALK_DEPTH`]: the walk stopped, and `bytes` is a lower bound.
    pub over: bool,
}

/// Bytes an inode is charged: the larger of its size and its allocated blocks for a regular
/// file (a sparse file is charged its size, blocks reserved past the end are charged too),
/// the allocated blocks of anything else.
fn charge(st: &libc::stat) -> u64 {
    let blocks = (st.st_blocks.max(0) as u64).saturating_mul(512);
    match kind_of(st.st_mode) {
        FileKind::File => blocks.max(st.st_size.max(0) as u64),
        _ => blocks,
    }
}

impl Listing {
    /// Bytes the session directory is charged against `max_session_files_bytes`:
    /// [`Usage::bytes`] (every entry, hidden ones included, the larger of size and allocated
    /// blocks). `u64::MAX` when the directory is over its entry budget, so that a caller
    /// comparing bytes alone still sees it over.
    pub fn regular_bytes(&self) -> u64 {
        if self.usage.over {
            u64::MAX
        } else {
            self.usage.bytes
        }
    }

    /// Entries of `self` that are new or changed since `before`: files, symlinks and special
    /// files whose type, size, inode, mtime or ctime differ; directories only when new.
    pub fn changed_since(&self, before: &Listing) -> Vec<FileInfo> {
        self.files
            .iter()
            .filter(
                |f| match (before.stamps.get(&f.name), self.stamps.get(&f.name)) {
                    (None, _) => true,
                    (Some(_), _) if f.kind == FileKind::Dir => false,
                    (Some(a), Some(b)) => a != b,
                    (Some(_), None) => false,
                },
            )
            .cloned()
            .collect()
    }
}

/// A directory stream that reads one entry per call and lends its descriptor for the
/// `*at` calls on its entries. nix's `Dir` does not fit: its borrowing iterator rewinds the
/// stream when dropped, and its owning iterator lends no descriptor, so this keeps libc's.
struct DirStream(*mut libc::DIR);

impl DirStream {
    fn open(fd: OwnedFd) -> std::io::Result<DirStream> {
        let raw = fd.as_raw_fd();
        // SAFETY: `raw` is an open directory descriptor; on success fdopendir owns it (we
        // forget `fd`), on failure we still own it and `fd` closes it.
        let d = unsafe { libc::fdopendir(raw) };
        if d.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        std::mem::forget(fd);
        Ok(DirStream(d))
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the DIR is open for `self`'s lifetime and owns this descriptor.
        unsafe { BorrowedFd::borrow_raw(libc::dirfd(self.0)) }
    }

    /// Next entry name (without `.` and `..`), or `None` at the end.
    fn next(&mut self) -> Option<CString> {
        loop {
            // SAFETY: the DIR is open; readdir64's result is valid until the next call on
            // it, and the name is copied before that.
            let e = unsafe { libc::readdir64(self.0) };
            if e.is_null() {
                return None;
            }
            // SAFETY: d_name is NUL-terminated within the entry.
            let name = unsafe { CStr::from_ptr((*e).d_name.as_ptr()) };
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                return Some(name.to_owned());
            }
        }
    }
}

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: the DIR is open and closed exactly once here.
        unsafe { libc::closedir(self.0) };
    }
}

/// Lists `dir` without following anything: at most [`MAX_ENTRIES`] entries, [`MAX_DEPTH`]
/// levels; [`SCRATCH_DIR`] (top level) and upload temporaries are left out of `files` but
/// counted in `usage`, as is everything else down to [`MAX_WALK_DEPTH`] levels and up to
/// [`MAX_SESSION_ENTRIES`] entries. Names that are not UTF-8 are counted, not listed: every
/// listed name can be fetched. At most [`MAX_WALK_DEPTH`] + 1 descriptors are open at once.
///
/// Errors: the directory itself cannot be opened.
pub fn list(dir: &Path) -> Result<Listing, Error> {
    Ok(list_within(dir, u64::MAX)?.unwrap_or_default())
}

/// [`list`], or `None` as soon as the walk meets more than `max_entries` entries (any kind,
/// any depth, hidden ones included): a walk whose cost is bounded by the caller.
///
/// Errors: the directory itself cannot be opened.
pub fn list_within(dir: &Path, max_entries: u64) -> Result<Option<Listing>, Error> {
    let root = open_root(dir)?;
    let mut out = Listing::default();
    // Inodes with several links, charged once.
    let mut linked: std::collections::HashSet<(u64, u64)> = std::collections::HashSet::new();
    // Depth-first: one open directory per level. (stream, name prefix, depth from 1, hidden)
    let mut stack: Vec<(DirStream, String, usize, bool)> = match DirStream::open(root) {
        Ok(ds) => vec![(ds, String::new(), 1, false)],
        Err(e) => return Err(io("read session directory")(e).at(".")),
    };
    while let Some((ds, prefix, depth, hidden)) = stack.last_mut() {
        let Some(c) = ds.next() else {
            stack.pop();
            continue;
        };
        let (depth, parent_hidden) = (*depth, *hidden);
        let Ok(st) = lstat_at(ds.fd(), &c) else {
            continue; // removed meanwhile
        };
        out.usage.entries += 1;
        if out.usage.entries > max_entries {
            return Ok(None);
        }
        if out.usage.entries > MAX_SESSION_ENTRIES {
            out.usage.over = true;
            out.truncated = true;
            break;
        }
        let first_link = st.st_nlink <= 1 || linked.insert((st.st_dev, st.st_ino));
        if first_link {
            out.usage.bytes = out.usage.bytes.saturating_add(charge(&st));
        }
        // A name that is not UTF-8 cannot be asked for (names travel as JSON strings): it is
        // counted but not listed, nor is anything below it.
        let (leaf, unnamed) = match c.to_str() {
            Ok(l) => (l.to_owned(), false),
            Err(_) => (c.to_string_lossy().into_owned(), true),
        };
        let hide = parent_hidden
            || unnamed
            || (depth == 1 && leaf == SCRATCH_DIR)
            || leaf.starts_with(TEMP_PREFIX)
            || depth > MAX_DEPTH;
        let name = format!("{prefix}{leaf}");
        let kind = kind_of(st.st_mode);
        let mut sub = None;
        if kind == FileKind::Dir {
            if depth < MAX_WALK_DEPTH {
                sub = openat2(
                    ds.fd(),
                    &leaf,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                )
                .ok()
                .and_then(|fd| DirStream::open(fd).ok());
            } else {
                out.usage.over = true;
                out.truncated = true;
            }
            if !hide && depth >= MAX_DEPTH {
                out.truncated = true;
            }
        }
        if !hide {
            if out.files.len() >= MAX_ENTRIES {
                out.truncated = true;
            } else {
                out.stamps.insert(name.clone(), stamp(&st));
                if kind == FileKind::File {
                    out.charges.insert(name.clone(), charge(&st));
                }
                out.files.push(info(name.clone(), &st));
            }
        }
        if let Some(sub) = sub {
            stack.push((sub, format!("{name}/"), depth + 1, hide));
        }
    }
    out.files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Some(out))
}

/// A lock per session directory, held by [`put`] from its budget check to its rename, so
/// that two uploads cannot both fit the budget that only one of them fits.
fn dir_lock(dir: &Path) -> std::sync::Arc<std::sync::Mutex<()>> {
    type Locks =
        std::sync::Mutex<HashMap<std::path::PathBuf, std::sync::Arc<std::sync::Mutex<()>>>>;
    static LOCKS: std::sync::OnceLock<Locks> = std::sync::OnceLock::new();
    let mut m = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    m.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
    m.entry(dir.to_path_buf()).or_default().clone()
}

/// Random hex for temporary names (64 bits).
///
/// Errors: [`Error::Io`] (`random`) when the kernel's random source failed.
fn random_hex() -> Result<String, Error> {
    crate::sys::random_hex(8).map_err(io("random"))
}

/// Checks the size of an upload before anything is read: the declared size against
/// `max_file_bytes`, and a passed descriptor's `fstat` (a regular file of exactly `declared`
/// bytes). Errors: [`Error::TooLarge`], [`Error::BadSource`].
pub fn check_upload(declared: u64, source: &Source, limits: &Limits) -> Result<(), Error> {
    if declared > limits.max_file_bytes {
        return Err(Error::TooLarge {
            limit: "max_file_bytes",
            value: declared,
            max: limits.max_file_bytes,
        });
    }
    match source {
        Source::Inline(bytes) if bytes.len() as u64 != declared => Err(Error::BadSource {
            parameter: "size",
            reason: format!("declared {declared} bytes, data has {}", bytes.len()),
        }),
        Source::Inline(_) => Ok(()),
        Source::Fd(fd) => {
            let st = fstat(fd.as_fd()).map_err(|e| Error::BadSource {
                parameter: "fd",
                reason: format!("fstat of the passed descriptor: {e}"),
            })?;
            if kind_of(st.st_mode) != FileKind::File {
                return Err(Error::BadSource {
                    parameter: "fd",
                    reason: "the passed descriptor is not a regular file".into(),
                });
            }
            let actual = st.st_size.max(0) as u64;
            if actual > limits.max_file_bytes {
                return Err(Error::TooLarge {
                    limit: "max_file_bytes",
                    value: actual,
                    max: limits.max_file_bytes,
                });
            }
            if actual != declared {
                return Err(Error::BadSource {
                    parameter: "size",
                    reason: format!("declared {declared} bytes, the passed file has {actual}"),
                });
            }
            Ok(())
        }
    }
}

/// Stores `source` as `name` in `dir`: checks ([`check_upload`], then the session's bytes in
/// use, excluding a regular file being replaced, against `max_session_files_bytes`), creates
/// missing parent directories, writes a temporary (0600, `owner`) and renames it over `name`.
///
/// Errors: [`Error::InvalidName`], [`Error::TooLarge`], [`Error::BadSource`] (content shorter
/// than declared), [`Error::NotRegular`] (a directory, symlink or special file is in the way),
/// [`Error::NoSpace`] (the state directory's file system is full), [`Error::Io`].
pub fn put(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
) -> Result<FileInfo, Error> {
    put_until(dir, name, declared, source, owner, limits, None)
}

/// [`put`] under a deadline (`(when, seconds it stands for)`): waiting for another upload to
/// the same directory, and the copy (checked before every chunk of [`COPY_CHUNK`] bytes,
/// each a read of a local file system and a write), stop once it passes; the temporary is
/// then removed, so nothing half-written stays and its disk charge is released.
///
/// Errors: as [`put`], and [`Error::Deadline`].
///
/// A write the state directory's file system refuses for want of room (`ENOSPC`, `EDQUOT`)
/// is [`Error::NoSpace`]; the temporary and the directories the upload created are removed.
pub fn put_until(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
) -> Result<FileInfo, Error> {
    put_charged(dir, name, declared, source, owner, limits, deadline, &[])
}

/// [`put_until`], with the content written by a child process that joins the session's group
/// first (`charge_to`: its `cgroup.procs` files, [`crate::session_fs::copy_in_group`]), so
/// that a session file system's pages are charged to the session's memory, not the
/// daemon's; empty: written by the calling thread.
///
/// Errors: as [`put_until`]; a write the session's own file system refuses (`ENOSPC`) is
/// [`Error::TooLarge`] naming `max_session_files_bytes` (or `max_session_entries` when it
/// has no inode left), never [`Error::NoSpace`].
#[allow(clippy::too_many_arguments)]
pub fn put_charged(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
    charge_to: &[std::path::PathBuf],
) -> Result<FileInfo, Error> {
    let mut created = Created::new();
    let r = put_inner(
        dir,
        name,
        declared,
        source,
        owner,
        limits,
        deadline,
        &mut created,
        charge_to,
    );
    if r.is_err() {
        remove_created(&created);
    }
    r.map_err(|e| match e {
        Error::Io { source, .. }
            if source.raw_os_error() == Some(libc::ENOSPC)
                && crate::session_fs::is_bounded(dir) =>
        {
            crate::session_fs::refusal(dir, declared, limits.max_session_files_bytes).unwrap_or(
                Error::TooLarge {
                    limit: "max_session_files_bytes",
                    value: limits.max_session_files_bytes.saturating_add(1),
                    max: limits.max_session_files_bytes,
                },
            )
        }
        Error::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            let (in_use, max) = space(dir);
            Error::NoSpace {
                in_use,
                requested: declared,
                max,
            }
        }
        other => other.at(name),
    })
}

/// Bytes in use and in all on the file system of `dir` (`statvfs`: blocks less those
/// available to an unprivileged writer, and blocks; fragment size units); zeros when unknown.
fn space(dir: &Path) -> (u64, u64) {
    let Ok(st) = nix::sys::statvfs::statvfs(dir) else {
        return (0, 0);
    };
    let unit = st.fragment_size();
    let total = st.blocks().saturating_mul(unit);
    let avail = st.blocks_available().saturating_mul(unit);
    (total.saturating_sub(avail), total)
}

#[allow(clippy::too_many_arguments)]
fn put_inner(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
    created: &mut Created,
    charge_to: &[std::path::PathBuf],
) -> Result<FileInfo, Error> {
    let parts = validate_new_name(name)?;
    check_upload(declared, &source, limits)?;
    let lock = dir_lock(dir);
    let _held = match deadline {
        None => lock.lock().unwrap_or_else(|e| e.into_inner()),
        Some((when, secs)) => loop {
            match lock.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    if std::time::Instant::now() >= when {
                        return Err(Error::Deadline(secs));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        },
    };
    let listing = list(dir)?;
    let existing = listing.files.iter().find(|f| f.name == name);
    let replaced = existing
        .map(|f| match f.kind {
            FileKind::File => Ok(listing.charges.get(name).copied().unwrap_or(f.size)),
            kind => Err(Error::NotRegular {
                name: name.into(),
                kind,
            }),
        })
        .transpose()?
        .unwrap_or(0);
    // A new name adds itself and any missing parent directory (at most MAX_DEPTH entries).
    let new_entries = if existing.is_some() { 0 } else { parts.len() };
    let all = listing.usage.entries + new_entries as u64;
    if listing.usage.over || all > MAX_SESSION_ENTRIES {
        return Err(Error::TooLarge {
            limit: "max_session_entries",
            value: all,
            max: MAX_SESSION_ENTRIES,
        });
    }
    let visible = (listing.files.len() + new_entries) as u64;
    if existing.is_none() && (listing.truncated || visible > MAX_ENTRIES as u64) {
        return Err(Error::TooLarge {
            limit: "max_listed_entries",
            value: visible,
            max: MAX_ENTRIES as u64,
        });
    }
    let in_use = listing.regular_bytes().saturating_sub(replaced);
    if in_use.saturating_add(declared) > limits.max_session_files_bytes {
        return Err(Error::TooLarge {
            limit: "max_session_files_bytes",
            value: in_use.saturating_add(declared),
            max: limits.max_session_files_bytes,
        });
    }
    let root = open_root(dir)?;
    let parent = open_parent(&root, name, &parts, true, owner, created)?;
    let leaf = cstr(parts[parts.len() - 1])?;
    let tmp_name = format!("{TEMP_PREFIX}{}", random_hex()?);
    let tmp = cstr(&tmp_name)?;
    // O_EXCL|O_NOFOLLOW creates a new file or fails, never opening something that exists.
    let out = std::fs::File::from(
        nix::fcntl::openat(
            &parent,
            tmp.as_c_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_retain(0o600),
        )
        .map_err(|e| io("create temporary")(e.into()))?,
    );
    let unlink_tmp = || {
        // Removes our own temporary.
        let _ = unlinkat(&parent, tmp.as_c_str(), UnlinkatFlags::NoRemoveDir);
    };
    let written = (|| -> Result<(), Error> {
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&out, Some(uid), Some(gid)).map_err(io("fchown"))?;
        }
        if charge_to.is_empty() {
            write_content(&out, declared, source, deadline)
        } else {
            write_in_group(&out, declared, source, deadline, charge_to)
        }
    })();
    if let Err(e) = written {
        unlink_tmp();
        return Err(e);
    }
    // renameat replaces a regular file or a symlink entry without following it and fails
    // on a directory.
    if let Err(e) = nix::fcntl::renameat(&parent, tmp.as_c_str(), &parent, leaf.as_c_str()) {
        unlink_tmp();
        return Err(match e {
            Errno::EISDIR | Errno::ENOTEMPTY | Errno::EEXIST => Error::NotRegular {
                name: name.into(),
                kind: FileKind::Dir,
            },
            e => io("rename")(e.into()),
        });
    }
    let st = fstat(out.as_fd()).map_err(io("fstat"))?;
    Ok(info(name.into(), &st))
}

fn write_content(
    out: &std::fs::File,
    declared: u64,
    source: Source,
    deadline: Option<(std::time::Instant, u64)>,
) -> Result<(), Error> {
    use std::io::Write;
    let mut w = out;
    let past =
        || deadline.and_then(|(when, secs)| (std::time::Instant::now() >= when).then_some(secs));
    match source {
        Source::Inline(bytes) => {
            for chunk in bytes.chunks(COPY_CHUNK) {
                if let Some(secs) = past() {
                    return Err(Error::Deadline(secs));
                }
                w.write_all(chunk).map_err(io("write"))?;
            }
            Ok(())
        }
        Source::Fd(fd) => {
            let src = std::fs::File::from(fd);
            let mut buf = vec![0u8; COPY_CHUNK];
            let mut done: u64 = 0;
            while done < declared {
                if let Some(secs) = past() {
                    return Err(Error::Deadline(secs));
                }
                let want = ((declared - done) as usize).min(buf.len());
                let n = std::os::unix::fs::FileExt::read_at(&src, &mut buf[..want], done).map_err(
                    |e| Error::BadSource {
                        parameter: "fd",
                        reason: format!("read of the passed descriptor: {e}"),
                    },
                )?;
                if n == 0 {
                    return Err(Error::BadSource {
                        parameter: "fd",
                        reason: format!("the passed file ended after {done} of {declared} bytes"),
                    });
                }
                w.write_all(&buf[..n]).map_err(io("write"))?;
                done += n as u64;
            }
            Ok(())
        }
    }
}

/// [`write_content`] by a child process in the session's group ([`put_charged`]).
fn write_in_group(
    out: &std::fs::File,
    declared: u64,
    source: Source,
    deadline: Option<(std::time::Instant, u64)>,
    charge_to: &[std::path::PathBuf],
) -> Result<(), Error> {
    use crate::session_fs::{Copied, CopySource};
    let copied = match &source {
        Source::Inline(bytes) => crate::session_fs::copy_in_group(
            charge_to,
            out.as_raw_fd(),
            CopySource::Bytes(bytes),
            declared.min(bytes.len() as u64),
            deadline.map(|d| d.0),
        ),
        Source::Fd(fd) => crate::session_fs::copy_in_group(
            charge_to,
            out.as_raw_fd(),
            CopySource::Fd(fd.as_raw_fd()),
            declared,
            deadline.map(|d| d.0),
        ),
    }
    .map_err(io("copy into the session's group"))?;
    let errno = |n: i32| std::io::Error::from_raw_os_error(n);
    match copied {
        Copied::Done => Ok(()),
        Copied::Deadline => Err(Error::Deadline(deadline.map_or(0, |d| d.1))),
        Copied::Short(done) => Err(Error::BadSource {
            parameter: "fd",
            reason: format!("the passed file ended after {done} of {declared} bytes"),
        }),
        Copied::Read(n) => Err(Error::BadSource {
            parameter: "fd",
            reason: format!("read of the passed descriptor: {}", errno(n)),
        }),
        Copied::Write(n) => Err(io("write")(errno(n))),
        // The join is a migration, which the pids controller lets past pids.max (only fork
        // and clone are refused, cgroup-v2.rst "PID"); should a kernel refuse it with EAGAIN
        // all the same, the session runs as many processes as it may: the typed limit.
        Copied::Join(libc::EAGAIN) => {
            let (current, max) = pids_of(charge_to).unwrap_or((0, 0));
            Err(Error::TooLarge {
                limit: "max_worker_pids",
                value: current + 1,
                max,
            })
        }
        Copied::Join(n) => Err(io("join the session's group")(errno(n))),
        Copied::Killed(sig) => Err(io("copy into the session's group")(std::io::Error::other(
            format!("the copier was killed by signal {sig} (the session's memory limit)"),
        ))),
    }
}

/// `pids.current` and `pids.max` of the first group among `procs` (`cgroup.procs` files) that
/// has the pids controller; `None` when none is readable or its pids.max is `max`.
fn pids_of(procs: &[std::path::PathBuf]) -> Option<(u64, u64)> {
    procs.iter().find_map(|p| {
        let dir = p.parent()?;
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some((read("pids.current")?, read("pids.max")?))
    })
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
    let root = open_root(dir)?;
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
    let root = open_root(dir)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    // Files are charged their allocated blocks (4 KiB each at least on common file
    // systems), so the limits are in tens of KiB.
    const LIMITS: Limits = Limits {
        max_file_bytes: 100_000,
        max_session_files_bytes: 150_000,
    };

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn read_any(
        dir: &Path,
        name: &str,
        offset: u64,
        max: u64,
    ) -> Result<(FileInfo, Vec<u8>, bool), Error> {
        read(dir, name, offset, max, None)
    }

    #[test]
    fn an_upload_past_its_deadline_leaves_nothing() {
        let d = tmp();
        let src = tempfile::tempfile().unwrap();
        src.set_len(4 << 20).unwrap();
        let limits = Limits {
            max_file_bytes: 8 << 20,
            max_session_files_bytes: 8 << 20,
        };
        // The deadline passes before the first chunk is copied.
        let past = (std::time::Instant::now(), 60);
        let e = put_until(
            d.path(),
            "big",
            4 << 20,
            Source::Fd(src.into()),
            None,
            &limits,
            Some(past),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Deadline(60)), "{e:?}");
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
        assert!(left.is_empty(), "a partial file stayed: {left:?}");
        assert_eq!(list(d.path()).unwrap().usage.bytes, 0);
        // Waiting for another upload's lock counts against the deadline too.
        let lock = dir_lock(d.path());
        let held = lock.lock().unwrap();
        let soon = (
            std::time::Instant::now() + std::time::Duration::from_millis(50),
            60,
        );
        let e = put_until(
            d.path(),
            "x",
            1,
            Source::Inline(vec![1]),
            None,
            &limits,
            Some(soon),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Deadline(60)), "{e:?}");
        drop(held);
        put_until(
            d.path(),
            "x",
            1,
            Source::Inline(vec![1]),
            None,
            &limits,
            Some(soon),
        )
        .expect_err("still past");
        let later = (
            std::time::Instant::now() + std::time::Duration::from_secs(60),
            60,
        );
        put_until(
            d.path(),
            "x",
            1,
            Source::Inline(vec![1]),
            None,
            &limits,
            Some(later),
        )
        .unwrap();
    }

    #[test]
    fn foreign_files_are_not_read() {
        let d = tmp();
        std::fs::write(d.path().join("mine"), "x").unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(read(d.path(), "mine", 0, 1, Some(me)).unwrap().1, b"x");
        let other = read(d.path(), "mine", 0, 1, Some(me.wrapping_add(1)));
        assert!(matches!(other, Err(Error::Foreign(_))), "{other:?}");
    }

    #[test]
    fn names_are_validated() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a//b",
            "./a",
            "a\0b",
            "a/b/c/d/e",
            ".sandcell-put-x",
        ] {
            assert!(
                matches!(validate_name(bad), Err(Error::InvalidName { .. })),
                "{bad:?}"
            );
        }
        // What a worker can create is reachable; an upload may not create it.
        for odd in [
            "a\nb",
            "a\tb\rc",
            "-rf",
            "a/-b",
            "\x1b]0;x\x07",
            "invoice\u{202e}fdp.exe",
            "a\u{200b}b",
            "\u{2066}x",
        ] {
            assert!(validate_name(odd).is_ok(), "{odd:?}");
            assert!(
                matches!(validate_new_name(odd), Err(Error::InvalidName { .. })),
                "{odd:?}"
            );
        }
        assert!(validate_name(&"x".repeat(256)).is_err());
        assert_eq!(validate_name("data/in.csv").unwrap(), ["data", "in.csv"]);
        assert!(validate_name(".hidden").is_ok());
    }

    /// Failures on the daemon's side are server faults naming the session-relative path;
    /// a request DeleteFile does not serve (a directory with entries) is the client's.
    #[test]
    fn server_faults_are_internal_errors_with_the_path() {
        let d = tmp();
        let gone = d.path().join("no-such-session");
        let e = list(&gone).unwrap_err();
        assert!(matches!(&e, Error::Io { path, .. } if path == "."), "{e:?}");
        match KernelError::from(e) {
            KernelError::InternalError { operation, reason } => {
                assert_eq!(operation, "open session directory");
                assert!(reason.starts_with(".: "), "{reason}");
                assert!(!reason.contains("no-such-session"), "a host path: {reason}");
            }
            other => panic!("{other:?}"),
        }
        // A session directory that is not a directory.
        std::fs::write(d.path().join("plain"), b"x").unwrap();
        let e = read(&d.path().join("plain"), "a.txt", 0, 10, None).unwrap_err();
        assert!(matches!(&e, Error::Io { path, .. } if path == "."), "{e:?}");
        put(
            d.path(),
            "full/a.txt",
            1,
            Source::Inline(b"a".to_vec()),
            None,
            &LIMITS,
        )
        .unwrap();
        let e = delete(d.path(), "full").unwrap_err();
        assert!(
            matches!(&e, Error::NotRegular { name, kind: FileKind::Dir } if name == "full"),
            "{e:?}"
        );
        assert!(matches!(
            KernelError::from(e),
            KernelError::NotRegularFile { .. }
        ));
    }

    #[test]
    fn put_read_list_delete_round_trip() {
        let d = tmp();
        let f = put(
            d.path(),
            "in.csv",
            4,
            Source::Inline(b"a,b\n".to_vec()),
            None,
            &LIMITS,
        )
        .unwrap();
        assert_eq!(
            (f.size, f.kind, f.media_type.as_str()),
            (4, FileKind::File, "text/csv")
        );
        put(
            d.path(),
            "sub/x.txt",
            2,
            Source::Inline(b"hi".to_vec()),
            None,
            &LIMITS,
        )
        .unwrap();
        let (_, bytes, eof) = read_any(d.path(), "in.csv", 1, 2).unwrap();
        assert_eq!((bytes.as_slice(), eof), (&b",b"[..], false));
        let (_, bytes, eof) = read_any(d.path(), "in.csv", 3, 100).unwrap();
        assert_eq!((bytes.as_slice(), eof), (&b"\n"[..], true));
        let l = list(d.path()).unwrap();
        let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["in.csv", "sub", "sub/x.txt"]);
        // Replacing keeps one file and the new content.
        put(
            d.path(),
            "in.csv",
            1,
            Source::Inline(b"z".to_vec()),
            None,
            &LIMITS,
        )
        .unwrap();
        assert_eq!(read_any(d.path(), "in.csv", 0, 10).unwrap().1, b"z");
        delete(d.path(), "sub/x.txt").unwrap();
        assert!(matches!(
            read_any(d.path(), "sub/x.txt", 0, 1),
            Err(Error::NoSuchFile(_))
        ));
        assert!(std::fs::read_dir(d.path()).unwrap().all(|e| {
            !e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(TEMP_PREFIX)
        }));
    }

    #[test]
    fn symlinks_and_fifos_are_reported_never_followed() {
        let d = tmp();
        let outside = tmp();
        std::fs::write(outside.path().join("secret"), "s3cret").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), d.path().join("leak")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("dirlink")).unwrap();
        nix::unistd::mkfifo(
            &d.path().join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let l = list(d.path()).unwrap();
        let kinds: Vec<_> = l.files.iter().map(|f| (f.name.as_str(), f.kind)).collect();
        assert_eq!(
            kinds,
            [
                ("dirlink", FileKind::Symlink),
                ("fifo", FileKind::Special),
                ("leak", FileKind::Symlink)
            ]
        );
        for (name, kind) in [
            ("leak", FileKind::Symlink),
            ("dirlink/secret", FileKind::Symlink),
            ("fifo", FileKind::Special),
        ] {
            match read_any(d.path(), name, 0, 100) {
                Err(Error::NotRegular { kind: k, .. }) => assert_eq!(k, kind, "{name}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        // Writing through a symlinked directory is refused; over a symlink replaces the link.
        assert!(matches!(
            put(
                d.path(),
                "dirlink/x",
                1,
                Source::Inline(b"x".to_vec()),
                None,
                &LIMITS
            ),
            Err(Error::NotRegular { .. })
        ));
        assert!(matches!(
            put(
                d.path(),
                "leak",
                1,
                Source::Inline(b"x".to_vec()),
                None,
                &LIMITS
            ),
            Err(Error::NotRegular {
                kind: FileKind::Symlink,
                ..
            })
        ));
        assert_eq!(
            std::fs::read_to_string(outside.path().join("secret")).unwrap(),
            "s3cret"
        );
        assert!(!outside.path().join("x").exists());
    }

    #[test]
    fn limits_are_checked_before_reading() {
        let d = tmp();
        let e = put(
            d.path(),
            "big",
            100_001,
            Source::Inline(vec![0; 3]),
            None,
            &LIMITS,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::TooLarge {
                    limit: "max_file_bytes",
                    value: 100_001,
                    ..
                }
            ),
            "{e}"
        );
        let e = put(d.path(), "m", 3, Source::Inline(vec![0; 2]), None, &LIMITS).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadSource {
                    parameter: "size",
                    ..
                }
            ),
            "{e}"
        );
        put(
            d.path(),
            "a",
            100_000,
            Source::Inline(vec![1; 100_000]),
            None,
            &LIMITS,
        )
        .unwrap();
        let e = put(
            d.path(),
            "b",
            60_000,
            Source::Inline(vec![1; 60_000]),
            None,
            &LIMITS,
        )
        .unwrap_err();
        match e {
            Error::TooLarge {
                limit: "max_session_files_bytes",
                value,
                max: 150_000,
            } => assert!(value >= 160_000, "{value}"),
            other => panic!("{other}"),
        }
        // Replacing `a` counts its new size only.
        put(
            d.path(),
            "a",
            90_000,
            Source::Inline(vec![1; 90_000]),
            None,
            &LIMITS,
        )
        .unwrap();
        // A sparse 1 GiB file passed as a descriptor is refused from fstat alone.
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 30).unwrap();
        let e = put(
            d.path(),
            "huge",
            1 << 30,
            Source::Fd(f.into()),
            None,
            &LIMITS,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::TooLarge {
                    limit: "max_file_bytes",
                    ..
                }
            ),
            "{e}"
        );
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, b"hello").unwrap();
        put(d.path(), "fromfd", 5, Source::Fd(f.into()), None, &LIMITS).unwrap();
        assert_eq!(read_any(d.path(), "fromfd", 0, 100).unwrap().1, b"hello");
    }

    #[test]
    fn hidden_entries_blocks_and_inodes_are_charged() {
        use std::os::unix::fs::FileExt;
        let d = tmp();
        let base = list(d.path()).unwrap().usage;
        assert_eq!(base.entries, 0);
        // Hidden names, the scratch directory and a name like an upload temporary count.
        std::fs::write(d.path().join(".hidden"), vec![1u8; 10_000]).unwrap();
        std::fs::create_dir(d.path().join(SCRATCH_DIR)).unwrap();
        std::fs::write(d.path().join(SCRATCH_DIR).join("x"), vec![1u8; 20_000]).unwrap();
        std::fs::write(d.path().join(format!("{TEMP_PREFIX}zz")), vec![1u8; 30_000]).unwrap();
        let l = list(d.path()).unwrap();
        let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, [".hidden"]);
        assert_eq!(l.usage.entries, 4);
        assert!(l.usage.bytes >= 60_000, "{:?}", l.usage);
        assert_eq!(l.regular_bytes(), l.usage.bytes);
        // A sparse file is charged its size; blocks reserved past the end are charged too.
        let sparse = std::fs::File::create(d.path().join("sparse")).unwrap();
        sparse.set_len(5_000_000).unwrap();
        let l2 = list(d.path()).unwrap();
        assert!(l2.usage.bytes >= l.usage.bytes + 5_000_000);
        let reserved = std::fs::File::create(d.path().join("reserved")).unwrap();
        let r = nix::fcntl::fallocate(
            &reserved,
            nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            0,
            8 << 20,
        );
        if r.is_ok() {
            let l3 = list(d.path()).unwrap();
            assert!(
                l3.usage.bytes >= l2.usage.bytes + (8 << 20),
                "{:?}",
                l3.usage
            );
            assert_eq!(
                l3.files.iter().find(|f| f.name == "reserved").unwrap().size,
                0
            );
        } else {
            eprintln!("fallocate(KEEP_SIZE) unsupported here; reservation not checked");
        }
        // Hard links are charged once.
        reserved.write_all_at(b"x", 0).unwrap();
        let before = list(d.path()).unwrap().usage;
        std::fs::hard_link(d.path().join(".hidden"), d.path().join("link")).unwrap();
        let after = list(d.path()).unwrap().usage;
        assert_eq!(after.entries, before.entries + 1);
        assert!(after.bytes < before.bytes + 10_000);
    }

    #[test]
    fn the_entry_budget_counts_hidden_and_deep_entries() {
        let d = tmp();
        let deep = d.path().join(SCRATCH_DIR).join("a/b/c/d/e/f");
        std::fs::create_dir_all(&deep).unwrap();
        let l = list(d.path()).unwrap();
        assert!(l.files.is_empty());
        assert_eq!(l.usage.entries, 7);
        assert!(!l.truncated && !l.usage.over);
        for i in 0..MAX_SESSION_ENTRIES {
            std::fs::write(deep.join(i.to_string()), "").unwrap();
        }
        let l = list(d.path()).unwrap();
        assert!(l.usage.over && l.truncated, "{:?}", l.usage);
        assert_eq!(l.regular_bytes(), u64::MAX);
        let e = put(
            d.path(),
            "x",
            1,
            Source::Inline(b"x".to_vec()),
            None,
            &LIMITS,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::TooLarge {
                    limit: "max_session_entries",
                    ..
                }
            ),
            "{e}"
        );
        // Too deep to count is over budget too.
        let d = tmp();
        let mut p = d.path().join(SCRATCH_DIR);
        for _ in 0..MAX_WALK_DEPTH {
            p = p.join("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        assert!(list(d.path()).unwrap().usage.over);
    }

    #[test]
    fn odd_names_a_worker_makes_are_listed_and_reachable() {
        use std::os::unix::ffi::OsStrExt;
        let d = tmp();
        std::fs::write(d.path().join("a\tb\nc"), "tab").unwrap();
        std::fs::write(d.path().join("-x"), "dash").unwrap();
        std::fs::write(
            d.path().join(std::ffi::OsStr::from_bytes(b"bad\xff")),
            "latin1",
        )
        .unwrap();
        let l = list(d.path()).unwrap();
        let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["-x", "a\tb\nc"]);
        assert_eq!(l.usage.entries, 3);
        for n in names {
            read_any(d.path(), n, 0, 10).unwrap();
        }
        delete(d.path(), "a\tb\nc").unwrap();
    }

    #[test]
    fn change_list_reports_new_and_modified_entries() {
        let d = tmp();
        std::fs::write(d.path().join("same"), "1").unwrap();
        std::fs::write(d.path().join("edit"), "1").unwrap();
        std::fs::create_dir(d.path().join(SCRATCH_DIR)).unwrap();
        let before = list(d.path()).unwrap();
        std::fs::write(d.path().join("edit"), "22").unwrap();
        std::fs::write(d.path().join("new.png"), "x").unwrap();
        std::fs::write(d.path().join(SCRATCH_DIR).join("junk"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", d.path().join("leak")).unwrap();
        let after = list(d.path()).unwrap();
        let changed: Vec<_> = after
            .changed_since(&before)
            .into_iter()
            .map(|f| f.name)
            .collect();
        assert_eq!(changed, ["edit", "leak", "new.png"]);
    }

    #[test]
    fn a_bounded_walk_gives_up_past_its_budget_and_hidden_entries_count() {
        let d = tmp();
        std::fs::write(d.path().join("a"), "1").unwrap();
        std::fs::create_dir(d.path().join(SCRATCH_DIR)).unwrap();
        std::fs::write(d.path().join(SCRATCH_DIR).join("x"), "1").unwrap();
        // Three entries, one listed: the budget counts what the walk visits.
        let full = list_within(d.path(), 3)
            .unwrap()
            .expect("within its budget");
        assert_eq!(full.usage.entries, 3);
        assert_eq!(full.files.len(), 1);
        assert!(list_within(d.path(), 2).unwrap().is_none());
        assert_eq!(list(d.path()).unwrap().usage, full.usage);
    }

    #[test]
    fn uploads_from_sockets_are_refused() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let u = UploadFd::new(a.into(), drop);
        assert!(matches!(
            inspect_upload(u),
            Err((_, UploadRefused::NotRegular))
        ));
        let f = tempfile::tempfile_in("/var/tmp").unwrap();
        let u = UploadFd::new(f.into(), drop);
        if let Err((_, e)) = inspect_upload(u) {
            // /var/tmp on an unusual file system says which.
            assert!(matches!(e, UploadRefused::FileSystem(_)), "{e}");
        }
    }
}
