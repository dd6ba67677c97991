//! Descriptors a client passes as a `PutFile` source: who closes them, and which are read
//! ([`inspect_upload`]: a regular file on a local file system, [`UPLOAD_FILE_SYSTEMS`]).

use std::os::fd::{AsRawFd, OwnedFd};

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
