//! Safe wrappers for the system calls the daemon would otherwise make by hand: pidfds
//! (pidfd_open(2), pidfd_send_signal(2), poll(2) on a pidfd; Linux 5.3 on), signals by pid
//! (kill(2), tgkill(2)), descriptors marked close-on-exec before an exec (close_range(2)),
//! what a pipe holds and can take (`FIONREAD`, `F_GETPIPE_SZ`) and random bytes (getrandom(2)). Every wrapper reports a failure as a [`std::io::Error`]; none panics, so a
//! failed system call never takes the root daemon down. The rest of the daemon calls these
//! instead of `libc::syscall` or `libc::getrandom`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `pid` as a `pid_t`, refusing 0 (pidfd_open(2) would name no process; kill(2) the caller's
/// process group) and values above `i32::MAX` with `EINVAL`.
fn pid_t(pid: u32) -> io::Result<libc::pid_t> {
    match libc::pid_t::try_from(pid) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    }
}

/// `pidfd_open(pid, 0)`: a close-on-exec descriptor naming the process `pid` for as long as it
/// is open (its pid cannot be reused while the process is unreaped and the descriptor open).
/// It names the intended process only if `pid` cannot have been reused before the call: the
/// caller's own unreaped child, or a process it checks after pinning (e.g. its cgroup).
///
/// Errors: `ESRCH` (no such process), `ENOSYS` (a kernel before Linux 5.3), `EINVAL` (pid 0 or
/// above `i32::MAX`), `EMFILE`/`ENFILE` (out of descriptors). See pidfd_open(2).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = pid_t(pid)?;
    // SAFETY: pidfd_open takes a pid and flags and touches no memory of ours; it returns a new
    // descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: fd was just returned by pidfd_open and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pidfd_send_signal(pidfd, signal, NULL, 0)`: sends `signal` to the process `pidfd` names;
/// signal 0 only checks that it can still be signalled (a zombie can, a reaped process
/// cannot).
///
/// Errors: `ESRCH` (the process has been reaped), `EINVAL` (not a pidfd, or a bad signal),
/// `EPERM`. See pidfd_send_signal(2).
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: a descriptor the caller keeps open for the call, no siginfo (NULL), flags 0;
    // the kernel reads no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether the process `pidfd` names has exited (a pidfd polls readable once it has, reaped
/// or not; poll(2) with a zero timeout, so this never blocks). A failed poll counts as not
/// exited.
pub fn pidfd_exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd that outlives the call, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0
}

/// Whether `fd` becomes readable (or hung up) within `wait`: poll(2), again with the time
/// left after `EINTR` or an early timeout (poll(2) may time out a little before `wait`). A
/// failed poll counts as not readable.
pub fn readable_within(fd: BorrowedFd<'_>, wait: std::time::Duration) -> bool {
    let end = std::time::Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(std::time::Instant::now());
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd that outlives the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return true;
        }
        let again = if n == 0 {
            std::time::Instant::now() < end
        } else {
            io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        };
        if !again {
            return false;
        }
    }
}

/// `kill(pid, signal)`: to the process `pid`. Safe only for a pid that cannot have been
/// reused: the caller's own unreaped child.
///
/// Errors: `EINVAL` (pid 0 or above `i32::MAX`, which kill(2) would read as a process group
/// or every process; or a bad signal), `ESRCH`, `EPERM`. See kill(2).
pub fn kill(pid: u32, signal: libc::c_int) -> io::Result<()> {
    let pid = pid_t(pid)?;
    // SAFETY: kill takes two integers and touches no memory of ours.
    cvt(unsafe { libc::kill(pid, signal) })
}

/// `kill(-pgid, signal)`: to every process of the process group `pgid` (a worker that called
/// setsid(2) leads the group of its own pid).
///
/// Errors: as [`kill`]; pgid 0 (the caller's own group) is `EINVAL`.
pub fn kill_group(pgid: u32, signal: libc::c_int) -> io::Result<()> {
    let pgid = pid_t(pgid)?;
    // SAFETY: kill takes two integers and touches no memory of ours; -pgid is below 0 since
    // pgid is above 0.
    cvt(unsafe { libc::kill(-pgid, signal) })
}

/// `tgkill(tgid, tid, signal)`: to the one thread `tid` of the process `tgid` (a process's
/// main thread has the tid of its pid).
///
/// Errors: as [`kill`]. See tgkill(2).
pub fn tgkill(tgid: u32, tid: u32, signal: libc::c_int) -> io::Result<()> {
    let (tgid, tid) = (pid_t(tgid)?, pid_t(tid)?);
    // SAFETY: tgkill takes three integers and touches no memory of ours.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, tgid, tid, signal) };
    cvt(if rc == 0 { 0 } else { -1 })
}

/// `close_range(first, ~0U, CLOSE_RANGE_CLOEXEC)`: marks every descriptor from `first` up
/// close-on-exec, so the next execve(2) closes them (descriptors below `first` are kept).
/// Async-signal-safe (one system call, no allocation): meant for a `pre_exec` hook between
/// fork and exec, where std's own exec-error pipe must stay open until the exec.
///
/// Errors: the thread's `errno` (`ENOSYS` before Linux 5.11, which added
/// `CLOSE_RANGE_CLOEXEC`; `EINVAL`). See close_range(2).
pub fn close_range_cloexec(first: u32) -> io::Result<()> {
    // SAFETY: close_range takes three integers and touches no memory of ours; marking
    // descriptors close-on-exec closes none of them now.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    cvt(if rc == 0 { 0 } else { -1 })
}

/// 0 as `Ok`, anything else as the thread's `errno`.
fn cvt(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Fills `buf` from the kernel's random source (getrandom(2), retried on `EINTR` and short
/// reads; blocks only until the pool is initialised at boot).
///
/// Errors: the kernel's random source failed (`ENOSYS` before Linux 3.17, or a seccomp filter
/// that refuses getrandom); `buf` is then not to be used.
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    getrandom::getrandom(buf).map_err(|e| match e.raw_os_error() {
        Some(errno) => io::Error::from_raw_os_error(errno),
        None => io::Error::other(e.to_string()),
    })
}

/// `n` random bytes as `2 * n` lowercase hex digits.
///
/// Errors: as [`random_bytes`].
pub fn random_hex(n: usize) -> io::Result<String> {
    let mut b = vec![0u8; n];
    random_bytes(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Bytes in the pipe of `fd` not yet read (either end): `ioctl(FIONREAD)`, pipe(7).
///
/// Errors: `fd` is not a pipe or socket (`EINVAL`, `ENOTTY`).
pub fn pipe_unread(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which points to `n`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The capacity of the pipe of `fd`, bytes: `fcntl(F_GETPIPE_SZ)`, fcntl(2) (65,536 unless
/// changed, and less for a user past `/proc/sys/fs/pipe-user-pages-soft`, pipe(7)).
///
/// Errors: `fd` is not a pipe (`EBADF`, `EINVAL`).
pub fn pipe_capacity(fd: BorrowedFd<'_>) -> io::Result<usize> {
    // SAFETY: F_GETPIPE_SZ takes no argument and touches no memory of ours.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETPIPE_SZ) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(r).unwrap_or(0))
}

/// Whether `fd` is an open, listening Unix stream socket (`SO_DOMAIN`: `AF_UNIX`; `SO_TYPE`:
/// `SOCK_STREAM`; `SO_ACCEPTCONN`: listening). A descriptor that is not open, or not a
/// socket, is not one.
pub fn is_unix_listener(fd: std::os::fd::RawFd) -> bool {
    let int_opt = |opt: libc::c_int| -> Option<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt(2) writes at most `len` bytes into `v`; a descriptor that is not
        // open or not a socket fails (EBADF, ENOTSOCK).
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(v)
    };
    int_opt(libc::SO_DOMAIN) == Some(libc::AF_UNIX)
        && int_opt(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && int_opt(libc::SO_ACCEPTCONN) == Some(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_pipe_tells_what_it_holds_and_takes_from_either_end() {
        let (r, w) = nix::unistd::pipe().unwrap();
        assert_eq!(pipe_unread(w.as_fd()).unwrap(), 0);
        nix::unistd::write(&w, b"hello").unwrap();
        assert_eq!(pipe_unread(w.as_fd()).unwrap(), 5);
        assert_eq!(pipe_unread(r.as_fd()).unwrap(), 5);
        assert!(pipe_capacity(w.as_fd()).unwrap() >= 4096);
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(pipe_capacity(file.as_fd()).is_err());
        assert!(readable_within(r.as_fd(), std::time::Duration::ZERO));
        // Close-on-exec: a child another test forks meanwhile must not keep the write end
        // open past its exec, or the end of file below would never come.
        let (r2, w2) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let t0 = std::time::Instant::now();
        assert!(!readable_within(
            r2.as_fd(),
            std::time::Duration::from_millis(50)
        ));
        assert!(
            t0.elapsed() >= std::time::Duration::from_millis(50),
            "{:?}",
            t0.elapsed()
        );
        drop(w2);
        // Bounded, not immediate: a child forked by another test between our pipe2 and its
        // exec holds a copy of the write end until that exec.
        assert!(readable_within(
            r2.as_fd(),
            std::time::Duration::from_secs(10)
        ));
    }

    #[test]
    fn pid_zero_and_huge_pids_are_refused_not_passed_on() {
        for pid in [0, u32::MAX, i32::MAX as u32 + 1] {
            let e = pidfd_open(pid).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "pid {pid}");
        }
    }

    #[test]
    fn a_child_is_pinned_signalled_and_seen_to_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = match pidfd_open(child.id()) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                eprintln!("skip: pidfd_open(2) unavailable on this kernel (before Linux 5.3)");
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Err(e) => panic!("pidfd_open of our own child: {e}"),
        };
        assert!(!pidfd_exited(fd.as_fd()));
        pidfd_send_signal(fd.as_fd(), 0).expect("a live child takes signal 0");
        pidfd_send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
        let t0 = std::time::Instant::now();
        while !pidfd_exited(fd.as_fd()) {
            assert!(t0.elapsed().as_secs() < 10, "the killed child never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // A zombie still takes signal 0; once reaped, ESRCH.
        pidfd_send_signal(fd.as_fd(), 0).expect("an unreaped zombie takes signal 0");
        child.wait().unwrap();
        let e = pidfd_send_signal(fd.as_fd(), 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }

    #[test]
    fn a_descriptor_that_is_no_pidfd_is_an_error() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let e = pidfd_send_signal(f.as_fd(), 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }

    #[test]
    fn kill_refuses_the_pids_that_would_widen_its_reach() {
        for pid in [0, u32::MAX] {
            assert_eq!(kill(pid, 0).unwrap_err().raw_os_error(), Some(libc::EINVAL));
            assert_eq!(
                kill_group(pid, 0).unwrap_err().raw_os_error(),
                Some(libc::EINVAL)
            );
            assert_eq!(
                tgkill(pid, pid, 0).unwrap_err().raw_os_error(),
                Some(libc::EINVAL)
            );
        }
        let me = std::process::id();
        kill(me, 0).expect("signal 0 to ourselves");
        tgkill(me, me, 0).expect("signal 0 to our main thread");
    }

    #[test]
    fn random_hex_is_fresh_and_sized() {
        let a = random_hex(16).unwrap();
        let b = random_hex(16).unwrap();
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
        assert_eq!(random_hex(0).unwrap(), "");
    }

    #[test]
    fn only_a_listening_unix_socket_is_a_unix_listener() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let l = std::os::unix::net::UnixListener::bind(dir.path().join("s")).unwrap();
        assert!(super::is_unix_listener(l.as_raw_fd()));
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(!super::is_unix_listener(a.as_raw_fd()));
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(!super::is_unix_listener(f.as_raw_fd()));
        assert!(!super::is_unix_listener(-1));
    }
}
