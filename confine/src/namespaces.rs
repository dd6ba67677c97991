//! Step 3: namespaces.
//!
//! `unshare(CLONE_NEWNET)` gives the worker a network namespace with only a loopback interface,
//! which is down: even a socket obtained some other way has nowhere to go. `CLONE_NEWIPC` hides
//! the host's System V IPC objects and POSIX message queues. Both need CAP_SYS_ADMIN, so this
//! runs before the identity switch. No user namespace: the worker is started by root and
//! needs none, and seccomp denies creating one afterwards.
//!
//! Cost: creating a network namespace is the slowest step of [`crate::enter`] (see the
//! measurements in the crate's tests); its teardown is asynchronous in the kernel.

use crate::Error;

/// Unshares the requested namespaces; does nothing if neither is requested.
///
/// Errors: [`Error::Unavailable`] with the OS error (`EPERM` without CAP_SYS_ADMIN, `EINVAL`
/// on a kernel built without network namespaces).
pub fn unshare(net: bool, ipc: bool) -> Result<(), Error> {
    let mut flags = 0;
    if net {
        flags |= libc::CLONE_NEWNET;
    }
    if ipc {
        flags |= libc::CLONE_NEWIPC;
    }
    if flags == 0 {
        return Ok(());
    }
    // SAFETY: unshare takes only flags; the process is single-threaded (checked in step 0).
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(Error::Unavailable {
            layer: "namespaces",
            reason: format!(
                "unshare(CLONE_NEWNET|CLONE_NEWIPC): {} (the worker must start as root with \
                 CAP_SYS_ADMIN in its bounding set)",
                std::io::Error::last_os_error()
            ),
        });
    }
    Ok(())
}
