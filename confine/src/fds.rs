//! Step 1: descriptors. Close everything not handed over on purpose; no terminal anywhere.
//!
//! Why: a descriptor inherited by accident outlives every later layer. Landlock checks paths
//! when they are opened, not descriptors already open, and seccomp does not look at which fd a
//! call uses. runc CVE-2024-21626 ("Leaky Vessels") was exactly this: an fd of the host's
//! `/sys/fs/cgroup` leaked into the container and `openat(leaked_fd, "../../..")` reached the
//! host file system. A terminal is the other classic: bubblewrap CVE-2017-5226, where a sandboxed
//! program used `ioctl(TIOCSTI)` on the inherited tty to type commands into the user's shell.

use std::io;

/// Closes every descriptor not in `keep` and returns the numbers of those that were open.
///
/// Uses `close_range(2)` (Linux 5.9) over the gaps between the kept fds, after listing
/// `/proc/self/fd` so the report says what was closed. Every fd of `keep` must be open.
///
/// Errors: a kept fd that is not open (`EBADF` with its number), or the OS error of
/// `close_range`/listing.
pub fn close_all_except(keep: &[i32]) -> io::Result<Vec<i32>> {
    let mut keep: Vec<i32> = keep.to_vec();
    keep.sort_unstable();
    keep.dedup();

    let before = open_fds()?;
    for fd in &keep {
        if !before.contains(fd) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("descriptor {fd} of keep_fds is not open (the daemon must set it up)"),
            ));
        }
    }
    let stray: Vec<i32> = before
        .iter()
        .copied()
        .filter(|fd| keep.binary_search(fd).is_err())
        .collect();

    close_gaps(&keep)?;

    let after = open_fds()?;
    if after != keep {
        return Err(io::Error::other(format!(
            "descriptors {after:?} open after closing, expected exactly {keep:?}"
        )));
    }
    Ok(stray)
}

/// Closes every descriptor not in `keep` (sorted, deduplicated) without looking at
/// `/proc`: usable after Landlock, which may hide `/proc`. Then checks with `fcntl(F_GETFD)`
/// that, below `limit`, only the kept descriptors are open (new descriptors get the lowest free
/// number, and RLIMIT_NOFILE, set in step 2, bounds them).
///
/// Errors: the OS error of `close_range`, or the descriptors found open.
pub fn close_all_except_after_landlock(keep: &[i32], limit: u64) -> io::Result<()> {
    let mut keep: Vec<i32> = keep.to_vec();
    keep.sort_unstable();
    keep.dedup();
    close_gaps(&keep)?;
    let limit = limit.clamp(1, 1 << 20) as i32;
    // SAFETY: F_GETFD only queries descriptor flags.
    let open: Vec<i32> = (0..limit)
        .filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1)
        .collect();
    let expected: Vec<i32> = keep.iter().copied().filter(|&fd| fd < limit).collect();
    if open != expected {
        return Err(io::Error::other(format!(
            "descriptors {open:?} open after closing, expected exactly {expected:?}"
        )));
    }
    Ok(())
}

/// Closes the gaps between the sorted kept fds, as inclusive ranges:
/// `[0, k0-1], [k0+1, k1-1], ..., [kn+1, MAX]`.
fn close_gaps(keep: &[i32]) -> io::Result<()> {
    let mut low: u32 = 0;
    for &fd in keep {
        let fd = fd as u32;
        if fd > low {
            close_range(low, fd - 1)?;
        }
        low = fd + 1;
    }
    close_range(low, u32::MAX)
}

/// `close_range(first, last, 0)`; falls back to closing one by one over `/proc/self/fd` on
/// kernels without it.
fn close_range(first: u32, last: u32) -> io::Result<()> {
    // SAFETY: close_range takes two integers and flags; it only closes descriptors of this
    // process, none of which are owned by Rust objects at this point of the worker's start
    // (the caller runs before main opens anything; an fd owned by a Rust object would only
    // see EBADF on its later close, never a wrong file, since nothing opens new fds in between).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    for fd in open_fds()? {
        if fd as u32 >= first && fd as u32 <= last {
            // SAFETY: closing a descriptor number of this process; see above.
            unsafe { libc::close(fd) };
        }
    }
    Ok(())
}

/// The open descriptors of this process, sorted, excluding the one used to list them.
pub fn open_fds() -> io::Result<Vec<i32>> {
    let dir = std::fs::read_dir("/proc/self/fd")?;
    let mut fds = Vec::new();
    let mut names = Vec::new();
    for entry in dir {
        names.push(entry?.file_name());
    }
    // The ReadDir's own descriptor is closed now; any fd listed that is no longer open was it.
    for name in names {
        if let Some(fd) = name.to_str().and_then(|s| s.parse::<i32>().ok()) {
            // SAFETY: F_GETFD only queries the descriptor flags.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1 {
                fds.push(fd);
            }
        }
    }
    fds.sort_unstable();
    Ok(fds)
}

/// Fails if any kept descriptor is a terminal, or if the process still has a controlling
/// terminal (the daemon calls `setsid()` between fork and exec; this calls it again, which
/// fails harmlessly with `EPERM` when the process already leads its session).
///
/// Errors: `fd N is a terminal ...` or `the process has a controlling terminal ...`.
pub fn ensure_no_terminal(keep: &[i32]) -> io::Result<()> {
    for &fd in keep {
        // SAFETY: isatty only queries the descriptor.
        if unsafe { libc::isatty(fd) } == 1 {
            return Err(io::Error::other(format!(
                "fd {fd} is a terminal; a worker must never hold one (bubblewrap CVE-2017-5226, \
                 TIOCSTI): connect it to a pipe or /dev/null"
            )));
        }
    }
    // SAFETY: setsid has no memory-safety preconditions; EPERM (already a group leader) is fine.
    unsafe { libc::setsid() };
    // SAFETY: the path is a NUL-terminated literal; O_NOCTTY keeps this open from acquiring a
    // terminal; the descriptor, if any, is closed right below.
    let fd = unsafe {
        libc::open(
            c"/dev/tty".as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if fd >= 0 {
        // SAFETY: fd was just returned by open and is owned here.
        unsafe { libc::close(fd) };
        return Err(io::Error::other(
            "the process has a controlling terminal (open /dev/tty succeeded); the daemon must \
             call setsid() before exec",
        ));
    }
    Ok(())
}
