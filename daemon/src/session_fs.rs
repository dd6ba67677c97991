//! Each session directory is its own file system: a tmpfs the daemon mounts on
//! `<state_dir>/sessions/<id>` before the worker starts, limited to the session's disk budget
//! (`size=` `max_session_files_bytes`, rounded down to a page) and entry budget
//! (`nr_inodes=` [`crate::files::MAX_SESSION_ENTRIES`] + 1, the root included). The kernel
//! then refuses the write that would pass either budget (`ENOSPC`), whoever writes and
//! whenever: a cell, a thread a cell left running while the session is idle, or an upload.
//! The walks of `files.rs` stay, for reporting and for what a tmpfs does not bound (sparse
//! sizes, hard links).
//!
//! Memory: a tmpfs keeps its files in memory, and the kernel charges each page to the memory
//! cgroup of the process that allocates it (`mm/shmem.c`, `mem_cgroup_charge`; the same on
//! cgroup v1 and v2). Cells write from the session's group, so their files count against
//! `max_worker_memory_bytes`; uploads are copied by a short-lived child placed in the
//! session's group ([`copy_in_group`]), never by the daemon's own threads, so no tenant's
//! files are charged to the daemon's memory. With no swap (memory.swap.max=0, memsw on v1)
//! the pages cannot be reclaimed: a session's files and its interpreter share its memory
//! limit, and the configuration keeps the disk budget at most half of it.
//!
//! Mounts live in the daemon's mount namespace (`PrivateMounts=yes` under the unit: they die
//! with the daemon). A worker's own namespace is a copy taken after the mount, so the tmpfs is
//! what it binds as its session directory. Every release path unmounts (lazily: a blocking
//! file call may still hold a descriptor) before the group and the directory are removed, so
//! the pages are freed while their group still exists; [`sweep`] unmounts what a predecessor
//! run in the host's namespace left behind.
//!
//! All functions block; callers run them on a blocking thread or at start-up.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Page size the tmpfs size is rounded down to, bytes.
const PAGE: u64 = 4096;

/// The mount options of a session's tmpfs: `size=` the budget rounded down to a page (at
/// least one page), `nr_inodes=` the entry budget plus the root, `mode=0700`, owned by the
/// worker identity when there is one.
pub fn options(budget_bytes: u64, uid: Option<u32>, gid: Option<u32>) -> String {
    let size = (budget_bytes / PAGE).max(1) * PAGE;
    let mut o = format!(
        "size={size},nr_inodes={},mode=0700",
        crate::files::MAX_SESSION_ENTRIES + 1
    );
    if let Some(u) = uid {
        o.push_str(&format!(",uid={u}"));
    }
    if let Some(g) = gid {
        o.push_str(&format!(",gid={g}"));
    }
    o
}

/// Mounts the session tmpfs ([`options`]) on the existing directory `dir`, `nosuid`, `nodev`,
/// `noexec`.
///
/// Errors: the `mount(2)` error (`EPERM` without CAP_SYS_ADMIN, e.g. an unprivileged
/// development daemon).
pub fn mount(
    dir: &Path,
    budget_bytes: u64,
    uid: Option<u32>,
    gid: Option<u32>,
) -> std::io::Result<()> {
    use nix::mount::MsFlags;
    let opts = options(budget_bytes, uid, gid);
    nix::mount::mount(
        Some("sandcell-session"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(opts.as_str()),
    )
    .map_err(std::io::Error::from)
}

/// Unmounts what is mounted on `dir`, lazily (`MNT_DETACH`: a descriptor still open below it
/// keeps the file system alive until closed, then its pages are freed), never following a
/// symlink. `Ok(false)` when nothing is mounted there (`EINVAL`) or `dir` is gone.
///
/// Errors: any other `umount2(2)` error.
pub fn unmount(dir: &Path) -> std::io::Result<bool> {
    use nix::mount::MntFlags;
    match nix::mount::umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether `dir` is a session file system: a tmpfs mounted on `dir` itself (its device
/// differs from its parent's).
pub fn is_bounded(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(fs) = nix::sys::statfs::statfs(dir) else {
        return false;
    };
    // `TMPFS_MAGIC` of linux/magic.h.
    if fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
        return false;
    }
    match (
        std::fs::symlink_metadata(dir),
        dir.parent().map(std::fs::symlink_metadata),
    ) {
        (Ok(d), Some(Ok(p))) => d.dev() != p.dev(),
        _ => false,
    }
}

/// The typed refusal for a write into the session file system `dir` that the kernel refused
/// with `ENOSPC`: [`crate::files::Error::TooLarge`] naming `max_session_entries` when no
/// inode is left, else `max_session_files_bytes` with the bytes in use plus `requested`.
/// `None` when `dir` is no session file system (the state directory's own file system is
/// full: the caller's `NoSpace`).
pub fn refusal(dir: &Path, requested: u64, budget_bytes: u64) -> Option<crate::files::Error> {
    if !is_bounded(dir) {
        return None;
    }
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    if st.files_free() == 0 {
        let max = crate::files::MAX_SESSION_ENTRIES;
        return Some(crate::files::Error::TooLarge {
            limit: "max_session_entries",
            value: max + 1,
            max,
        });
    }
    let unit = st.fragment_size();
    let used = st
        .blocks()
        .saturating_sub(st.blocks_free())
        .saturating_mul(unit);
    Some(crate::files::Error::TooLarge {
        limit: "max_session_files_bytes",
        value: used.saturating_add(requested).max(budget_bytes + 1),
        max: budget_bytes,
    })
}

/// The session file systems mounted at or below `sessions` in this mount namespace (from
/// `/proc/self/mountinfo`), deepest first.
fn mounted_below(sessions: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .filter(|p| p.starts_with(sessions) && p != sessions)
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    v.dedup();
    v
}

/// A mountinfo path with its octal escapes (`\040` for a space, proc(5)) decoded.
fn unescape(s: &str) -> std::ffi::OsString {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    std::ffi::OsStr::from_bytes(&out).to_owned()
}

/// Unmounts every session file system a predecessor left below `sessions` (a daemon run
/// without a private mount namespace and killed before its release), so that the stale
/// directories can be removed. Returns how many were unmounted; failures are logged.
pub fn sweep(sessions: &Path) -> usize {
    sweep_except(sessions, &[])
}

/// [`sweep`], sparing the file systems of the sessions in `keep` (adopted from a previous
/// daemon).
pub fn sweep_except(sessions: &Path, keep: &[String]) -> usize {
    let mut n = 0;
    for p in mounted_below(sessions) {
        if keep.iter().any(|id| p == sessions.join(id)) {
            continue;
        }
        match unmount(&p) {
            Ok(true) => n += 1,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "unmounting a stale session file system")
            }
        }
    }
    n
}

/// Where [`copy_in_group`] takes its bytes from.
#[derive(Debug, Clone, Copy)]
pub enum CopySource<'a> {
    /// Bytes in memory.
    Bytes(&'a [u8]),
    /// A regular file, read from offset 0 with `pread`.
    Fd(RawFd),
}

/// How a [`copy_in_group`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copied {
    /// Every byte is written.
    Done,
    /// The deadline passed first.
    Deadline,
    /// The source file ended after this many bytes.
    Short(u64),
    /// Reading the source failed with this errno.
    Read(i32),
    /// Writing failed with this errno (`ENOSPC`: the session file system is full).
    Write(i32),
    /// The child could not join the session's group (errno).
    Join(i32),
    /// The child was killed by this signal (the session's memory limit: the OOM killer).
    Killed(i32),
}

/// The child's report through its pipe: outcome code, errno, bytes done.
const REPORT: usize = 16;

/// Writes `declared` bytes of `src` to `out` from a child process that first joins the
/// session's group (writes `"0"` to each of `procs`, its `cgroup.procs` files), so that the
/// tmpfs pages are charged to the session's memory cgroup, not to the daemon's. The child
/// checks `deadline` before each 64 KiB chunk. With no `procs` (no cgroups) the child stays
/// in the daemon's group.
///
/// Errors: `fork`, `pipe` or `waitpid` failed, or a `procs` file could not be opened.
pub fn copy_in_group(
    procs: &[PathBuf],
    out: RawFd,
    src: CopySource<'_>,
    declared: u64,
    deadline: Option<std::time::Instant>,
) -> std::io::Result<Copied> {
    use std::os::unix::fs::OpenOptionsExt;
    let procs: Vec<OwnedFd> = procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(p)
                .map(OwnedFd::from)
        })
        .collect::<Result<_, _>>()?;
    let procs_raw: Vec<RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
    // The deadline as a CLOCK_MONOTONIC time (what Instant measures on Linux), computed
    // before the fork: the child only compares.
    let limit = deadline.map(|d| {
        let left = d.saturating_duration_since(std::time::Instant::now());
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec into `now`.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        (now.tv_sec as i128) * 1_000_000_000 + now.tv_nsec as i128 + left.as_nanos() as i128
    });
    let mut buf = vec![0u8; 64 * 1024];
    let buf_ptr = buf.as_mut_ptr();
    let wfd = w.as_raw_fd();
    // SAFETY: the child below makes only async-signal-safe calls (write, pread,
    // clock_gettime, _exit) on memory allocated before the fork; it touches no lock and
    // allocates nothing, so forking from a multi-threaded process is sound.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above; every pointer is valid for the lengths given.
        unsafe {
            let report = |code: u32, errno: i32, done: u64| -> ! {
                let mut b = [0u8; REPORT];
                b[..4].copy_from_slice(&code.to_ne_bytes());
                b[4..8].copy_from_slice(&errno.to_ne_bytes());
                b[8..].copy_from_slice(&done.to_ne_bytes());
                libc::write(wfd, b.as_ptr().cast(), REPORT);
                libc::_exit(0)
            };
            let errno = || *libc::__errno_location();
            for &fd in &procs_raw {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    report(6, errno(), 0);
                }
            }
            let past = || {
                limit.is_some_and(|l| {
                    let mut t = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t);
                    (t.tv_sec as i128) * 1_000_000_000 + t.tv_nsec as i128 >= l
                })
            };
            let write_all = |p: *const u8, n: usize, done: u64| {
                let mut off = 0usize;
                while off < n {
                    let k = libc::write(out, p.add(off).cast(), n - off);
                    if k < 0 {
                        if errno() == libc::EINTR {
                            continue;
                        }
                        report(5, errno(), done);
                    }
                    off += k as usize;
                }
            };
            let mut done: u64 = 0;
            while done < declared {
                if past() {
                    report(2, 0, done);
                }
                let want = ((declared - done) as usize).min(64 * 1024);
                match src {
                    CopySource::Bytes(b) => {
                        write_all(b.as_ptr().add(done as usize), want, done);
                        done += want as u64;
                    }
                    CopySource::Fd(fd) => {
                        let n = libc::pread(fd, buf_ptr.cast(), want, done as libc::off_t);
                        if n < 0 {
                            if errno() == libc::EINTR {
                                continue;
                            }
                            report(4, errno(), done);
                        }
                        if n == 0 {
                            report(3, 0, done);
                        }
                        write_all(buf_ptr, n as usize, done);
                        done += n as u64;
                    }
                }
            }
            report(1, 0, done)
        }
    }
    drop(w);
    drop(procs);
    let status = loop {
        let mut st = 0;
        // SAFETY: waits for our own child.
        let rc = unsafe { libc::waitpid(pid, &mut st, 0) };
        if rc == pid {
            break st;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    };
    drop(buf);
    if libc::WIFSIGNALED(status) {
        return Ok(Copied::Killed(libc::WTERMSIG(status)));
    }
    let mut b = [0u8; REPORT];
    let n = nix::unistd::read(&r, &mut b).map_err(std::io::Error::from)?;
    if n != REPORT {
        return Err(std::io::Error::other(
            "the upload's copier exited without a report",
        ));
    }
    let code = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes"));
    let errno = i32::from_ne_bytes(b[4..8].try_into().expect("4 bytes"));
    let done = u64::from_ne_bytes(b[8..].try_into().expect("8 bytes"));
    Ok(match code {
        1 => Copied::Done,
        2 => Copied::Deadline,
        3 => Copied::Short(done),
        4 => Copied::Read(errno),
        5 => Copied::Write(errno),
        _ => Copied::Join(errno),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_hold_the_budgets() {
        assert_eq!(
            options(20_000, Some(7), Some(8)),
            "size=16384,nr_inodes=4097,mode=0700,uid=7,gid=8"
        );
        assert_eq!(options(1, None, None), "size=4096,nr_inodes=4097,mode=0700");
        assert_eq!(
            options(256 << 20, None, None),
            format!("size={},nr_inodes=4097,mode=0700", 256u64 << 20)
        );
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape("/a\\040b/c"), std::ffi::OsString::from("/a b/c"));
        assert_eq!(unescape("/plain"), std::ffi::OsString::from("/plain"));
        assert_eq!(unescape("/end\\04"), std::ffi::OsString::from("/end\\04"));
    }

    #[test]
    fn a_copy_outside_any_group_writes_every_byte_or_says_why() {
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let out = tempfile::tempfile().unwrap();
        let r = copy_in_group(
            &[],
            out.as_raw_fd(),
            CopySource::Bytes(&data),
            data.len() as u64,
            None,
        )
        .unwrap();
        assert_eq!(r, Copied::Done);
        assert_eq!(
            std::fs::read(format!("/proc/self/fd/{}", out.as_raw_fd())).unwrap(),
            data
        );

        let src = tempfile::tempfile().unwrap();
        src.set_len(1000).unwrap();
        let out = tempfile::tempfile().unwrap();
        let r = copy_in_group(
            &[],
            out.as_raw_fd(),
            CopySource::Fd(src.as_raw_fd()),
            5000,
            None,
        )
        .unwrap();
        assert_eq!(r, Copied::Short(1000));
        let r = copy_in_group(
            &[],
            out.as_raw_fd(),
            CopySource::Fd(src.as_raw_fd()),
            1000,
            Some(std::time::Instant::now()),
        )
        .unwrap();
        assert_eq!(r, Copied::Deadline);
    }

    /// The kernel bound itself, where this test may mount (root): a write past the budget
    /// fails with ENOSPC and is mapped to the typed budget error.
    #[test]
    fn a_session_tmpfs_refuses_the_write_past_its_budget() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("s");
        std::fs::create_dir(&dir).unwrap();
        if let Err(e) = mount(&dir, 64 * 1024, None, None) {
            eprintln!("skipped: cannot mount a tmpfs here ({e}); needs root");
            return;
        }
        assert!(is_bounded(&dir));
        assert!(!is_bounded(d.path()));
        let e = std::fs::write(dir.join("big"), vec![1u8; 128 * 1024]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        match refusal(&dir, 10, 64 * 1024) {
            Some(crate::files::Error::TooLarge { limit, max, .. }) => {
                assert_eq!(limit, "max_session_files_bytes");
                assert_eq!(max, 64 * 1024);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(mounted_below(d.path()), vec![dir.clone()]);
        assert_eq!(sweep(d.path()), 1);
        assert!(!is_bounded(&dir));
        assert!(!unmount(&dir).unwrap());
    }
}
