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
//! `READY=1` ends the reload. Both come with `WATCHDOG=1`: a reload need not restart the watchdog's
//! clock, so the new image pings as soon as it starts and again when ready.
//! A new image that hangs is caught by the unit's watchdog (`WatchdogSec=`), one that fails
//! exits, and `Restart=on-failure` starts a daemon that adopts the sessions, which their
//! keepers hold whatever happens to this process.
//!
//! After the exec the previous image's children (workers, keepers, the warm workers it
//! killed) are still this process's children, not init's as after an exit; the new image
//! reaps them as they exit ([`reap_inherited`]) and otherwise treats the workers as adopted
//! ones (their pidfds, never wait(2)).
//!
//! Descriptors: every descriptor above 2 is marked close-on-exec before the exec, whatever
//! opened it, except the listening socket, whose close-on-exec flag is cleared; its number
//! (and whether systemd's socket activation gave it) pass in [`LISTEN_FD_ENV`] and
//! [`ACTIVATED_ENV`], read and removed by [`take_inherited`] before any thread starts. The
//! keepers' lifelines are among those closed, so each keeper waits for an adopter as after
//! an exit.

use nix::sys::signal::{self, SigSet, SigmaskHow, Signal};
use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The listening socket's descriptor number across the exec (set by [`exec_in_place`] only).
pub const LISTEN_FD_ENV: &str = "SANDCELL_REEXEC_LISTEN_FD";

/// `1` when the listening socket came from systemd's socket activation (the idle exit applies
/// only then), `0` otherwise.
pub const ACTIVATED_ENV: &str = "SANDCELL_REEXEC_ACTIVATED";

/// The stop signal (`15`, SIGTERM, or `2`, SIGINT) that arrived while the previous image
/// handed its sessions over for the exec: the new image raises it again once its handlers
/// exist, so the stop is acted on (after the adoption) instead of being lost with the old
/// image's handlers.
pub const PENDING_SIGNAL_ENV: &str = "SANDCELL_REEXEC_PENDING_SIGNAL";

/// Variables a re-exec drops from the environment it passes on: systemd's socket activation
/// variables name descriptors by position, which the exec does not keep.
const DROPPED: &[&str] = &[
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    LISTEN_FD_ENV,
    ACTIVATED_ENV,
    PENDING_SIGNAL_ENV,
];

/// The listening socket a previous image of this process passed on, read from
/// [`LISTEN_FD_ENV`] and [`ACTIVATED_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inherited {
    /// The descriptor.
    pub fd: RawFd,
    /// Whether systemd's socket activation gave it.
    pub activated: bool,
    /// SIGTERM or SIGINT, when one arrived during the previous image's hand-over
    /// ([`PENDING_SIGNAL_ENV`]).
    pub pending_signal: Option<i32>,
}

/// Reads and removes [`LISTEN_FD_ENV`], [`ACTIVATED_ENV`] and [`PENDING_SIGNAL_ENV`], and
/// marks the descriptor close-on-exec again. `None` when the process was not re-executed, or
/// when the value is not a descriptor number above 2 (ignored: the daemon then starts as a
/// fresh one would).
///
/// # Safety
///
/// Call while the process has one thread (first thing in `main`): it removes environment
/// variables, which no other thread may read or write meanwhile (`std::env::remove_var`).
pub unsafe fn take_inherited() -> Option<Inherited> {
    let fd = std::env::var(LISTEN_FD_ENV).ok();
    let activated = std::env::var(ACTIVATED_ENV).is_ok_and(|v| v == "1");
    let pending_signal = std::env::var(PENDING_SIGNAL_ENV)
        .ok()
        .and_then(|v| parse_stop_signal(&v));
    // SAFETY: the caller guarantees that the process has one thread.
    unsafe {
        std::env::remove_var(LISTEN_FD_ENV);
        std::env::remove_var(ACTIVATED_ENV);
        std::env::remove_var(PENDING_SIGNAL_ENV);
    }
    let fd = parse_fd(fd.as_deref()?)?;
    // Close-on-exec again at once: the self-check's children must not hold the socket.
    // SAFETY: F_GETFD/F_SETFD only read and set the descriptor's flag; a descriptor that is
    // not open fails with EBADF, and take_listener then refuses it.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
    Some(Inherited {
        fd,
        activated,
        pending_signal,
    })
}

/// SIGTERM or SIGINT from its number; any other value is ignored.
fn parse_stop_signal(v: &str) -> Option<i32> {
    v.parse::<i32>()
        .ok()
        .filter(|s| *s == libc::SIGTERM || *s == libc::SIGINT)
}

/// The children a previous image of this process left (`/proc/self/task/<pid>/children`, or
/// the pids whose parent is this process in `/proc/<pid>/stat`): the workers and keepers it started and the warm workers it
/// killed. After a restart they would be init's to reap; after a re-exec they are still this
/// process's, and no code of the new image waits for them (it treats every adopted worker as
/// another process's child). Call first thing in `main`, before this image starts any child.
pub fn inherited_children() -> Vec<u32> {
    let me = std::process::id();
    // One thread now (after the exec, the main one): its children file lists them all where
    // the kernel has it (CONFIG_PROC_CHILDREN); else every process's parent is read.
    if let Ok(list) = std::fs::read_to_string(format!("/proc/self/task/{me}/children")) {
        return list
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parent_of(&s))
                == Some(me)
        })
        .collect()
}

/// The parent pid in a `/proc/<pid>/stat` line (field 4, after the command in parentheses,
/// which may itself hold spaces and parentheses: proc(5)).
fn parent_of(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Reaps `children` (from [`inherited_children`]) as each exits, on a thread of its own that
/// ends with the last: each is pinned by a pidfd (an unreaped child's pid cannot be reused),
/// polled until it turns readable, then waited for with `WNOHANG`. Without it each would stay
/// a zombie, holding its pid and (for a worker) its per-session uid, which the uid pool reads
/// as in use.
pub fn reap_inherited(children: Vec<u32>) {
    if children.is_empty() {
        return;
    }
    tracing::info!(
        children = children.len(),
        "reaping the previous image's children as they exit"
    );
    let spawned = std::thread::Builder::new()
        .name("reap-inherited".into())
        .spawn(move || {
            use std::os::fd::{AsRawFd, OwnedFd};
            let mut left: Vec<(u32, OwnedFd)> = Vec::new();
            for pid in children {
                match crate::sys::pidfd_open(pid) {
                    Ok(fd) => left.push((pid, fd)),
                    // Without a pidfd (ESRCH cannot happen to an unreaped child): a last try.
                    Err(_) => reap(pid),
                }
            }
            while !left.is_empty() {
                let mut polls: Vec<libc::pollfd> = left
                    .iter()
                    .map(|(_, fd)| libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                // SAFETY: `polls` is a valid array of `polls.len()` pollfd structures.
                let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, -1) };
                if n < 0 {
                    if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return;
                }
                let mut i = 0;
                left.retain(|(pid, _)| {
                    let exited = polls[i].revents != 0;
                    i += 1;
                    if exited {
                        reap(*pid);
                    }
                    !exited
                });
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the reaper of the previous image's children");
    }
}

fn reap(pid: u32) {
    let _ = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(pid as i32),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    );
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

/// Tells systemd the daemon is reloading (`RELOADING=1`, with `MONOTONIC_USEC` and a
/// `WATCHDOG=1`: a reload need not restart the watchdog's clock when the new image's `READY=1`
/// ends it, so the exec must not start late in the interval), then executes the
/// installed binary in place with the same arguments and environment (minus the socket
/// activation variables), passing `listener` on as [`LISTEN_FD_ENV`] and the stop signal that
/// `pending_signal` says arrived meanwhile (asked as late as possible, just before the exec's
/// environment is built) as [`PENDING_SIGNAL_ENV`]. Returns only if the exec failed, with its
/// error; the caller then exits keeping its sessions (the process is no use without a new
/// image).
pub fn exec_in_place(
    listener: RawFd,
    activated: bool,
    pending_signal: &mut dyn FnMut() -> Option<i32>,
) -> std::io::Error {
    let path = match executable() {
        Ok(p) => p,
        Err(e) => return e,
    };
    if let Err(e) = prepare_descriptors(listener) {
        return e;
    }
    let cstr = |b: &[u8]| CString::new(b).map_err(std::io::Error::other);
    let mut build = || -> std::io::Result<(CString, Vec<CString>, Vec<CString>)> {
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
        if let Some(sig) = pending_signal() {
            env.push(cstr(format!("{PENDING_SIGNAL_ENV}={sig}").as_bytes())?);
        }
        Ok((prog, args, env))
    };
    let (prog, args, env) = match build() {
        Ok(b) => b,
        Err(e) => return e,
    };
    crate::notify::reloading();
    crate::notify::watchdog();
    tracing::info!(path = %path.display(), "re-executing in place; sessions kept for the new image");
    // execve(2) resets every handled signal to its default action, and the new image handles
    // them again only once it has a runtime: a SIGUSR1, SIGUSR2 or SIGHUP in between (a second
    // `systemctl kill -s USR1` a few milliseconds after the first) would end the process
    // with its sessions handed over and no image to adopt them, and a SIGTERM or SIGINT would
    // end it without the stop the new image would act on. They are blocked here instead: the
    // mask and pending signals survive execve (signal(7), "Signal mask and pending signals"),
    // and the new image unblocks them once its handlers are installed ([`unblock_signals`]).
    let mut old = SigSet::empty();
    let blocked =
        signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&held_signals()), Some(&mut old));
    let e = match nix::unistd::execve(&prog, &args, &env) {
        Err(e) => std::io::Error::from(e),
        Ok(never) => match never {},
    };
    if blocked.is_ok() {
        let _ = signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    }
    e
}

/// The signals the daemon handles (SIGUSR1, SIGUSR2, SIGHUP, SIGTERM, SIGINT), which a
/// re-exec in place holds blocked from just before its execve until the new image handles
/// them.
fn held_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGHUP,
        Signal::SIGTERM,
        Signal::SIGINT,
    ] {
        set.add(s);
    }
    set
}

/// Unblocks, in the calling thread, the signals a re-exec in place blocked across its execve
/// (a no-op in a process started any other way): called once the new image's handlers are
/// installed, so that one that arrived meanwhile, held pending, is delivered to them. Threads
/// made before this keep them blocked; the kernel delivers a process's signal to a thread
/// that does not block it (signal(7)), here the caller, and children get an empty mask
/// (the standard library's spawn resets it). Errors: those of pthread_sigmask(3), which are
/// for invalid arguments only.
pub fn unblock_signals() -> std::io::Result<()> {
    signal::pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&held_signals()), None)
        .map_err(std::io::Error::from)
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
    fn only_sigterm_and_sigint_are_carried_across_the_exec() {
        assert_eq!(parse_stop_signal("15"), Some(libc::SIGTERM));
        assert_eq!(parse_stop_signal("2"), Some(libc::SIGINT));
        for bad in ["9", "10", "0", "-15", "", "x", "15 "] {
            assert_eq!(parse_stop_signal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_parent_is_read_after_the_command() {
        assert_eq!(parent_of("42 (sandcelld) S 7 42 42 0"), Some(7));
        assert_eq!(parent_of("42 (a) b) (c) R 9 1 1"), Some(9));
        assert_eq!(parent_of("42 (x"), None);
    }

    #[test]
    fn an_inherited_child_is_reaped_once_it_exits() {
        let child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let pid = child.id();
        // The child is this process's (a test thread forked it, so the main thread's
        // children file need not list it; its stat names the parent).
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        assert_eq!(parent_of(&stat), Some(std::process::id()));
        std::mem::forget(child);
        reap_inherited(vec![pid]);
        let t0 = std::time::Instant::now();
        while std::fs::metadata(format!("/proc/{pid}")).is_ok() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "{pid} was not reaped"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
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
