//! A session's worker process as its actor holds it: the daemon's own child (spawned by this
//! daemon), or a worker adopted from a previous daemon, which is not this daemon's child.
//!
//! An adopted worker is not waited for (wait(2) is for a parent; after a restart its parent is
//! init, which reaps it; after a re-exec in place it is still this process's child, and
//! `reexec::reap_inherited` reaps it): its exit is seen on its pidfd, which turns readable when the process
//! exits (pidfd_open(2)), and signals go through the pidfd, which never reaches a process
//! that took the pid over. Its exit status is not known; an OOM kill is still told by the
//! session cgroup's counters.

use super::WorkerPidfd;
use crate::cgroup::SessionGroup;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use tokio::io::unix::AsyncFd;

/// The worker process.
#[derive(Debug)]
pub enum WorkerProcess {
    /// This daemon's child.
    Child(tokio::process::Child),
    /// Adopted from a previous daemon.
    Adopted {
        /// Its pid (read through the pidfd at adoption).
        pid: u32,
        /// A duplicate of its pidfd, polled for the exit.
        exit: AsyncFd<OwnedFd>,
        /// The exit was seen.
        exited: bool,
    },
}

/// The error an adopted worker's wait gives: its exit status went to its parent (init).
fn adopted_exit() -> std::io::Error {
    std::io::Error::other("exit status unknown: the adopted worker is not this daemon's child")
}

impl WorkerProcess {
    /// An adopted worker named by `pidfd` (duplicated here), with pid `pid`.
    ///
    /// Errors: the duplicate or its registration with the runtime failed.
    pub fn adopted(pid: u32, pidfd: &WorkerPidfd) -> std::io::Result<WorkerProcess> {
        let dup = pidfd.as_fd().try_clone_to_owned()?;
        // SAFETY: `dup` is an open descriptor owned by the AsyncFd from here on: it stays
        // open, naming the same pidfd, until the AsyncFd is dropped.
        let exit = unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(WorkerProcess::Adopted {
            pid,
            exit,
            exited: false,
        })
    }

    /// Waits until the worker exited. A child's status; an adopted worker's exit is an
    /// error that says its status is unknown. Cancel-safe; once exited, answers at once.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            WorkerProcess::Child(c) => c.wait().await,
            WorkerProcess::Adopted { exit, exited, .. } => {
                if !*exited {
                    let mut g = exit.readable().await?;
                    g.retain_ready();
                    *exited = true;
                }
                Err(adopted_exit())
            }
        }
    }

    /// The pid while it still names the worker: a child until it is reaped; an adopted
    /// worker until its pidfd reports the exit.
    pub fn id(&self) -> Option<u32> {
        match self {
            WorkerProcess::Child(c) => c.id(),
            WorkerProcess::Adopted { pid, exit, exited } => {
                (!*exited && !crate::cgroup::host::pidfd_exited(exit.get_ref())).then_some(*pid)
            }
        }
    }

    /// The child, when it is one.
    pub fn child(&self) -> Option<&tokio::process::Child> {
        match self {
            WorkerProcess::Child(c) => Some(c),
            WorkerProcess::Adopted { .. } => None,
        }
    }

    /// Kills every process of the worker and waits until it is gone: a child as
    /// [`super::kill_and_reap`]; an adopted worker through its pidfd and its process group
    /// (while its pidfd says it lives), then the whole cgroup, then its exit on the pidfd (at
    /// most [`crate::cgroup::KILL_TIMEOUT`]; init reaps it).
    pub async fn kill_and_reap(
        &mut self,
        pidfd: Option<&WorkerPidfd>,
        group: &Arc<dyn SessionGroup>,
    ) {
        if let WorkerProcess::Child(c) = self {
            return super::kill_and_reap(c, pidfd, group).await;
        }
        if let Some(pid) = self.id() {
            // SAFETY: the worker's process group (it called setsid): the pidfd said just now
            // that the worker lives, so its pid, the group's id, is not reused.
            unsafe {
                libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
            }
        }
        if let Some(fd) = pidfd {
            fd.signal(libc::SIGKILL);
        }
        let g = group.clone();
        let _ = tokio::task::spawn_blocking(move || g.kill_all(crate::cgroup::KILL_TIMEOUT)).await;
        let _ = tokio::time::timeout(crate::cgroup::KILL_TIMEOUT, self.wait()).await;
    }
}

impl WorkerPidfd {
    /// Wraps a pidfd received from a keeper.
    pub fn from_owned(fd: OwnedFd) -> WorkerPidfd {
        WorkerPidfd(fd)
    }

    /// A duplicate of the descriptor (for a keeper).
    ///
    /// Errors: `dup` failed.
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.0.try_clone()
    }
}

impl AsFd for WorkerPidfd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for WorkerPidfd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}
