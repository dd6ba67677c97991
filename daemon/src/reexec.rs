//! The in-place re-exec: the daemon replaces its own image with the installed binary
//! (`execve(2)` of its executable's path) after handing its sessions over, exactly as an exit
//! that keeps sessions does, and the new image adopts them as a successor would.
//!
//! What it saves, against a restart of the unit: systemd's stop and start jobs, the unit's
//! sandbox set-up (namespaces, mounts, seccomp filters) and the exec of a new process. The
//! process keeps its pid, its cgroup, its namespaces, its capabilities and its place in the
//! unit, so systemd never sees it go; the listening socket passes through the exec, so a
//! connection made meanwhile waits in its backlog and is served by the new image. This is
//! the package upgrade's path (SIGUSR1 from the package's postinst, when the unit file did
//! not change): systemd itself re-executes in place for `daemon-reexec` on the same ground.
//!
//! Around the exec the daemon tells systemd `RELOADING=1` (sd_notify(3)); the new image's
//! `READY=1` ends the reload. A new image that does not come up is caught by the unit's
//! watchdog (`WatchdogSec=`) or exits, and `Restart=on-failure` starts a daemon that adopts
//! the sessions, which their keepers hold whatever happens to this process.
//!
//! Descriptors: every descriptor above 2 is marked close-on-exec before the exec, whatever
//! opened it, except the listening socket, whose close-on-exec flag is cleared; its number
//! (and whether systemd's socket activation gave it) pass in [`LISTEN_FD_ENV`] and
//! [`ACTIVATED_ENV`], read and removed by [`take_inherited`] before any thread starts. The
//! keepers' lifelines are among those closed, so each keeper waits for an adopter exactly as
//! after an exit.

use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The listening socket's descriptor number across the exec (set by [`exec_in_place`] only).
pub const LISTEN_FD_ENV: &str = "SANDCELL_REEXEC_LISTEN_FD";

/// `1` when the listening socket came from systemd's socket activation (the idle exit applies
/// only then), `0` otherwise.
pub const ACTIVATED_ENV: &str = "SANDCELL_REEXEC_ACTIVATED";

/// Variables a re-exec drops from the environment it passes on: systemd's socket activation
/// variables name descriptors by position, which the exec does not keep.
const DROPPED: &[&str] = &[
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    LISTEN_FD_ENV,
    ACTIVATED_ENV,
];

/// The listening socket a previous image of this process passed on, read from
/// [`LISTEN_FD_ENV`] and [`ACTIVATED_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inherited {
    /// The descriptor.
    pub fd: RawFd,
    /// Whether systemd's socket activation gave it.
    pub activated: bool,
}

/// Reads and removes [`LISTEN_FD_ENV`] and [`ACTIVATED_ENV`]. `None` when the process was not
/// re-executed, or when the value is not a descriptor number above 2 (ignored: the daemon then
/// starts as a fresh one would). Call first thing in `main`, while the process has one thread.
pub fn take_inherited() -> Option<Inherited> {
    let fd = std::env::var(LISTEN_FD_ENV).ok();
    let activated = std::env::var(ACTIVATED_ENV).is_ok_and(|v| v == "1");
    // SAFETY: called from `main` before any thread is started (the Rust 2024 rule for
    // `remove_var`: no other thread may read or write the environment meanwhile).
    unsafe {
        std::env::remove_var(LISTEN_FD_ENV);
        std::env::remove_var(ACTIVATED_ENV);
    }
    parse_fd(fd.as_deref()?).map(|fd| Inherited { fd, activated })
}

fn parse_fd(v: &str) -> Option<RawFd> {
    v.parse::<RawFd>().ok().filter(|&fd| fd > 2)
}

/// The path to execute: the executable this process was started from, as the kernel names it
/// (`/proc/self/exe`), without the ` (deleted)` the kernel appends once a package upgrade has
/// replaced the file, so that the installed (new) binary is the one executed.
fn executable() -> std::io::Result<PathBuf> {
    let link = std::fs::read_link("/proc/self/exe")?;
    let bytes = link.as_os_str().as_bytes();
    let trimmed = bytes.strip_suffix(b" (deleted)").unwrap_or(bytes);
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(trimmed)))
}

/// Marks every open descriptor above 2 close-on-exec, except `keep`, whose flag is cleared.
///
/// Errors: `keep` is not open; `/proc/self/fd` cannot be read.
fn prepare_descriptors(keep: RawFd) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    use std::os::fd::BorrowedFd;
    // SAFETY: `keep` is the daemon's listening socket, open for the rest of the process.
    let k = unsafe { BorrowedFd::borrow_raw(keep) };
    fcntl(k, FcntlArg::F_SETFD(FdFlag::empty()))?;
    for e in std::fs::read_dir("/proc/self/fd")? {
        let Some(fd) = e?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        if fd <= 2 || fd == keep {
            continue;
        }
        // SAFETY: a descriptor listed as open; only its flag is changed (a descriptor closed
        // meanwhile, such as the directory's own, fails with EBADF, which is ignored).
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        let _ = fcntl(b, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
    }
    Ok(())
}

/// Tells systemd the daemon is reloading (`RELOADING=1` with `MONOTONIC_USEC`, which systemd
/// 253 and later require with it; 252 ignores it), then executes the installed binary in place
/// with the same arguments and environment (minus the socket activation variables), passing
/// `listener` on as [`LISTEN_FD_ENV`]. Returns only if the exec failed, with its error; the
/// caller then exits keeping its sessions (the process is no use without a new image).
pub fn exec_in_place(listener: RawFd, activated: bool) -> std::io::Error {
    let path = match executable() {
        Ok(p) => p,
        Err(e) => return e,
    };
    if let Err(e) = prepare_descriptors(listener) {
        return e;
    }
    let cstr = |b: &[u8]| CString::new(b).map_err(std::io::Error::other);
    let build = || -> std::io::Result<(CString, Vec<CString>, Vec<CString>)> {
        let prog = cstr(path.as_os_str().as_bytes())?;
        let args = std::env::args_os()
            .map(|a| cstr(a.as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut env: Vec<CString> = Vec::new();
        for (k, v) in std::env::vars_os() {
            if DROPPED.iter().any(|d| k == *d) {
                continue;
            }
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            env.push(cstr(&kv)?);
        }
        env.push(cstr(format!("{LISTEN_FD_ENV}={listener}").as_bytes())?);
        env.push(cstr(
            format!("{ACTIVATED_ENV}={}", if activated { 1 } else { 0 }).as_bytes(),
        )?);
        Ok((prog, args, env))
    };
    let (prog, args, env) = match build() {
        Ok(b) => b,
        Err(e) => return e,
    };
    crate::notify::reloading();
    tracing::info!(path = %path.display(), "re-executing in place; sessions kept for the new image");
    match nix::unistd::execve(&prog, &args, &env) {
        Err(e) => std::io::Error::from(e),
        Ok(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_descriptors_above_stderr_are_taken() {
        assert_eq!(parse_fd("3"), Some(3));
        assert_eq!(parse_fd("17"), Some(17));
        for bad in ["0", "2", "-1", "", "x", "3 "] {
            assert_eq!(parse_fd(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_executable_is_named_without_deleted() {
        let p = executable().unwrap();
        assert!(p.is_absolute());
        assert!(!p.to_string_lossy().ends_with(" (deleted)"));
    }

    #[test]
    fn descriptors_are_marked_close_on_exec_but_the_listener() {
        use nix::fcntl::{FcntlArg, FdFlag, fcntl};
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // The listener's flag is cleared...
        let keep = std::os::fd::AsRawFd::as_raw_fd(&a);
        prepare_descriptors(keep).unwrap();
        let flags = |f: std::os::fd::BorrowedFd<'_>| {
            FdFlag::from_bits_truncate(fcntl(f, FcntlArg::F_GETFD).unwrap())
        };
        assert!(!flags(a.as_fd()).contains(FdFlag::FD_CLOEXEC));
        // ... and every other one set, whatever it was.
        fcntl(b.as_fd(), FcntlArg::F_SETFD(FdFlag::empty())).unwrap();
        prepare_descriptors(keep).unwrap();
        assert!(flags(b.as_fd()).contains(FdFlag::FD_CLOEXEC));
        assert!(!flags(a.as_fd()).contains(FdFlag::FD_CLOEXEC));
    }
}
