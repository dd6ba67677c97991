//! Names and their resolution beneath a session directory: what a name may be
//! ([`validate_name`], [`validate_new_name`]), and every open of one from a descriptor of the
//! directory with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` or
//! its equivalent walk ([`crate::resolve`]); no symlink is followed, `..` never leaves it.

use super::{
    Error, FILES_DIR, MAX_COMPONENT_BYTES, MAX_DEPTH, MAX_NAME_BYTES, SCRATCH_DIR, TEMP_PREFIX, io,
    kind_of,
};
use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid, UnlinkatFlags, unlinkat};
use sandcell_proto::kernel::FileKind;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

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
pub(super) fn openat2(
    dir: BorrowedFd<'_>,
    path: &str,
    flags: i32,
    mode: u32,
) -> std::io::Result<OwnedFd> {
    crate::resolve::open(
        dir,
        Path::new(path),
        flags,
        mode,
        crate::resolve::Scope::Beneath,
    )
}

pub(super) fn cstr(name: &str) -> Result<CString, Error> {
    CString::new(name).map_err(|_| Error::InvalidName {
        name: name.into(),
        reason: "contains NUL".into(),
    })
}

pub(super) fn fstat(fd: BorrowedFd<'_>) -> std::io::Result<libc::stat> {
    Ok(nix::sys::stat::fstat(fd)?)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: never follows a symlink. `name` is one component.
pub(super) fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<libc::stat> {
    Ok(nix::sys::stat::fstatat(
        dir,
        name,
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?)
}

/// Opens the session directory itself (no symlink as its last component).
pub(super) fn open_root(dir: &Path) -> Result<OwnedFd, Error> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| io("open session directory")(e).at("."))?;
    Ok(f.into())
}

use std::os::unix::fs::OpenOptionsExt;

/// Opens the directory client-given names are resolved beneath: the session directory's
/// [`FILES_DIR`] (no symlink) when it has one, else the session directory itself (laid out
/// flat).
///
/// Errors: [`Error::Io`] when either cannot be opened (a symlink at [`FILES_DIR`] included).
pub(super) fn open_files(dir: &Path) -> Result<OwnedFd, Error> {
    let root = open_root(dir)?;
    match openat2(
        root.as_fd(),
        FILES_DIR,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    ) {
        Ok(fd) => Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(root),
        Err(e) => Err(io("open the files directory")(e).at(".")),
    }
}

/// The directory of the session directory `dir` that holds the user's files: `dir/`
/// [`FILES_DIR`] when that is a directory (not a symlink), else `dir` (laid out flat).
pub fn files_dir(dir: &Path) -> std::path::PathBuf {
    let files = dir.join(FILES_DIR);
    match std::fs::symlink_metadata(&files) {
        Ok(m) if m.is_dir() => files,
        _ => dir.to_path_buf(),
    }
}

/// Lays out the new session directory `dir` (the module's "layout of a session directory"):
/// creates [`FILES_DIR`] and [`SCRATCH_DIR`] (mode 0700, owned by `uid`:`gid` where given),
/// and, when the worker has an identity of its own (`uid`), gives `dir` itself to the
/// daemon's identity with mode 0711, so the worker can reach both but neither rename nor
/// replace them.
///
/// Errors: the failed `mkdir(2)`, `lchown(2)` or `chmod(2)`.
pub fn lay_out(dir: &Path, uid: Option<u32>, gid: Option<u32>) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    for d in [FILES_DIR, SCRATCH_DIR] {
        let p = dir.join(d);
        std::fs::DirBuilder::new().mode(0o700).create(&p)?;
        if uid.is_some() || gid.is_some() {
            std::os::unix::fs::lchown(&p, uid, gid)?;
        }
    }
    if uid.is_some() {
        std::os::unix::fs::lchown(
            dir,
            Some(nix::unistd::geteuid().as_raw()),
            Some(nix::unistd::getegid().as_raw()),
        )?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(())
}

/// Classifies what is at `name` without following anything, for an error message: a symlink
/// on the way (or at the end) is `symlink`.
pub(super) fn classify(root: BorrowedFd<'_>, name: &str) -> Error {
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
pub(super) type Created = Vec<(OwnedFd, CString)>;

/// Removes the directories of `created` that are still empty, innermost first.
pub(super) fn remove_created(created: &Created) {
    for (parent, name) in created.iter().rev() {
        // AT_REMOVEDIR removes an empty directory entry only, never following a symlink.
        let _ = unlinkat(parent, name.as_c_str(), UnlinkatFlags::RemoveDir);
    }
}

/// Opens the directory holding the last component of `parts`, creating missing directories
/// (mode 0700, owned by `owner`) when `create`, and noting each one it created in `created`.
pub(super) fn open_parent(
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
