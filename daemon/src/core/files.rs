//! The session-file calls (`PutFile`, `ListFiles`, `GetFile`, `DeleteFile`): validate ->
//! look up -> authorize (as `Execute`) -> act, the acting on the blocking pool; the file work
//! itself (names, listing, bounded reads and writes, budgets) is `crate::files`.

use super::Core;
use crate::auth::Action;
use crate::identity::Caller;
use crate::session::{Session, SessionState};
use sandcell_proto::kernel::KernelError;
use std::sync::Arc;
use std::time::Duration;

/// The content of an upload: decoded inline bytes, or a passed descriptor (inspected and read
/// on the blocking pool only).
#[derive(Debug)]
pub enum Upload {
    /// Decoded inline data.
    Inline(Vec<u8>),
    /// A descriptor the client passed.
    Fd(crate::files::UploadFd),
}

/// Seconds a `PutFile` may take on the blocking pool before its client is answered with
/// `LimitExceeded` (`put_file_seconds`).
pub const PUT_FILE_SECONDS: u64 = 60;

impl Core {
    /// The file budgets in force now (`max_file_bytes`, `max_session_files_bytes`, bytes).
    fn file_limits(&self) -> crate::files::Limits {
        let cfg = self.config();
        crate::files::Limits {
            max_file_bytes: cfg.limits.max_file_bytes,
            max_session_files_bytes: cfg.limits.max_session_files_bytes,
        }
    }

    /// A session for a file call: validate -> look up -> authorize (as `Execute`).
    async fn file_session(
        &self,
        caller: &Caller,
        session: &str,
    ) -> Result<Arc<Session>, KernelError> {
        let s = self.lookup(caller, session)?;
        self.authorize(caller, Action::Execute).await?;
        Ok(s)
    }

    /// Stores `source` as `name` in `session`'s directory, owned by its worker identity, mode
    /// 0600. `size` is the declared size, checked against `max_file_bytes` before the session
    /// is looked up. A passed descriptor is inspected on the blocking pool only (its mount must
    /// be a local file system, then `fstat`: a regular file of `size` bytes) and read there,
    /// within [`PUT_FILE_SECONDS`].
    ///
    /// Errors: `InvalidFileName`, `LimitExceeded` (`max_file_bytes`,
    /// `max_session_files_bytes`, `put_file_seconds`), `InvalidParameter` (size mismatch,
    /// unusable descriptor: not a regular file, or on a file system such as FUSE, NFS, CIFS,
    /// 9p, proc or sysfs), `NoSuchSession`, `PermissionDenied`, `SessionBusy` (a cell is
    /// running), `NotRegularFile` (something other than a regular file is in the way),
    /// `LimitExceeded` also when the session's own file system refuses the write (`ENOSPC`:
    /// `max_session_files_bytes`, or `max_session_entries` with no inode left; a cell's thread
    /// may fill it meanwhile), `CapacityExceeded` (budget `state_directory_space`: the state
    /// directory's file system has no room; `in_use` and `max` are its used and total bytes,
    /// `requested` the size),
    /// `InternalError` (any other I/O error of the daemon's own).
    pub async fn put_file(
        &self,
        caller: &Caller,
        session: &str,
        name: &str,
        size: u64,
        source: Upload,
    ) -> Result<sandcell_proto::kernel::FileInfo, KernelError> {
        let limits = self.file_limits();
        crate::files::validate_name(name)?;
        if size > limits.max_file_bytes {
            return Err(KernelError::LimitExceeded {
                limit: "max_file_bytes".into(),
                value: size,
                max: limits.max_file_bytes,
            });
        }
        if let Upload::Inline(bytes) = &source
            && bytes.len() as u64 != size
        {
            return Err(KernelError::InvalidParameter {
                parameter: "size".into(),
                reason: format!("declared {size} bytes, data has {}", bytes.len()),
            });
        }
        let s = self.file_session(caller, session).await?;
        let busy = {
            let info = s.info.lock().unwrap();
            match info.state {
                SessionState::Running => Some(Some(info.running_cell.unwrap_or(0))),
                SessionState::Ended => Some(None),
                SessionState::Idle => None,
            }
        };
        match busy {
            Some(Some(cell)) => {
                return Err(KernelError::SessionBusy {
                    session: session.into(),
                    cell,
                });
            }
            Some(None) => return Err(self.gone_after(caller, &s, session).await),
            None => {}
        }
        let (dir, owner, name_owned) = (s.dir.clone(), s.worker_ids, name.to_owned());
        let charge_to = s.group_procs();
        // The copy itself stops at the deadline and removes its temporary (files::put_until);
        // the answer waits a little longer for that, so nothing half-written outlives it.
        let deadline = (
            std::time::Instant::now() + Duration::from_secs(PUT_FILE_SECONDS),
            PUT_FILE_SECONDS,
        );
        let task = tokio::task::spawn_blocking(move || {
            let source = match source {
                Upload::Inline(bytes) => crate::files::Source::Inline(bytes),
                Upload::Fd(u) => match crate::files::inspect_upload(u) {
                    Ok(fd) => crate::files::Source::Fd(fd),
                    Err((u, why)) => {
                        drop(u);
                        return Err(KernelError::InvalidParameter {
                            parameter: "fd".into(),
                            reason: why.to_string(),
                        });
                    }
                },
            };
            crate::files::put_charged(
                &dir,
                &name_owned,
                size,
                source,
                owner,
                &limits,
                Some(deadline),
                &charge_to,
            )
            .map_err(KernelError::from)
        });
        let stored = tokio::time::timeout(
            Duration::from_secs(PUT_FILE_SECONDS) + crate::files::PUT_STOP_GRACE,
            task,
        )
        .await;
        // Even a failed store may have left a partial file behind.
        s.files_changed();
        let stored = match stored {
            Err(_) => {
                tracing::warn!(
                    session,
                    uid = caller.uid,
                    name,
                    "upload exceeded its deadline"
                );
                return Err(KernelError::LimitExceeded {
                    limit: "put_file_seconds".into(),
                    value: PUT_FILE_SECONDS,
                    max: PUT_FILE_SECONDS,
                });
            }
            Ok(joined) => joined.map_err(file_task_failed)??,
        };
        tracing::info!(session, uid = caller.uid, name, size, "file stored");
        Ok(stored)
    }

    /// Lists `session`'s directory (lstat only, bounded); returns the entries sorted by name
    /// and whether the listing was cut at its bound.
    ///
    /// Errors: `NoSuchSession`, `PermissionDenied`, `SessionEnded` (it ended meanwhile),
    /// `InternalError` (the directory could not be read while the session lives).
    pub async fn list_files(
        &self,
        caller: &Caller,
        session: &str,
    ) -> Result<(Vec<sandcell_proto::kernel::FileInfo>, bool), KernelError> {
        let s = self.file_session(caller, session).await?;
        let dir = s.dir.clone();
        let l = match tokio::task::spawn_blocking(move || crate::files::list(&dir))
            .await
            .map_err(file_task_failed)?
        {
            Ok(l) => l,
            // A session that ends removes its directory: then the caller learns that it
            // ended. A listing that fails while the session lives is a server fault.
            Err(e) => match self.ended_while(caller, &s, session).await {
                Some(gone) => return Err(gone),
                None => return Err(e.into()),
            },
        };
        Ok((l.files, l.truncated))
    }

    /// Reads at most `max_bytes` (default and ceiling 1 MiB) of the regular file `name` from
    /// `offset`; returns its description, the bytes and whether they reach its end.
    ///
    /// Errors: `InvalidFileName`, `LimitExceeded` (`max_bytes`), `NoSuchSession`,
    /// `PermissionDenied`, `NoSuchFile`, `NotRegularFile` (symlink, directory, FIFO, ...;
    /// kind `foreign` for a file not owned by the session's worker, e.g. a hard link),
    /// `InternalError` (an I/O error of the daemon's own).
    pub async fn get_file(
        &self,
        caller: &Caller,
        session: &str,
        name: &str,
        offset: u64,
        max_bytes: Option<u64>,
    ) -> Result<(sandcell_proto::kernel::FileInfo, Vec<u8>, bool), KernelError> {
        use sandcell_proto::kernel::MAX_CHUNK_BYTES;
        crate::files::validate_name(name)?;
        let max = match max_bytes {
            None => MAX_CHUNK_BYTES,
            Some(0) => {
                return Err(KernelError::InvalidParameter {
                    parameter: "max_bytes".into(),
                    reason: "must be positive".into(),
                });
            }
            Some(m) if m > MAX_CHUNK_BYTES => {
                return Err(KernelError::LimitExceeded {
                    limit: "max_bytes".into(),
                    value: m,
                    max: MAX_CHUNK_BYTES,
                });
            }
            Some(m) => m,
        };
        let s = self.file_session(caller, session).await?;
        let (dir, name) = (s.dir.clone(), name.to_owned());
        let owner = s.worker_ids.map(|ids| ids.0);
        Ok(
            tokio::task::spawn_blocking(move || {
                crate::files::read(&dir, &name, offset, max, owner)
            })
            .await
            .map_err(file_task_failed)??,
        )
    }

    /// Removes `name` (a file, a symlink itself, or an empty directory) from `session`'s
    /// directory. Errors: `InvalidFileName`, `NoSuchSession`, `PermissionDenied`,
    /// `NoSuchFile`, `NotRegularFile` (a symlink on the way; a directory with entries, kind
    /// `dir`), `InternalError` (an I/O error of the daemon's own).
    pub async fn delete_file(
        &self,
        caller: &Caller,
        session: &str,
        name: &str,
    ) -> Result<(), KernelError> {
        crate::files::validate_name(name)?;
        let s = self.file_session(caller, session).await?;
        let (dir, name) = (s.dir.clone(), name.to_owned());
        let deleted = tokio::task::spawn_blocking(move || crate::files::delete(&dir, &name)).await;
        s.files_changed();
        Ok(deleted.map_err(file_task_failed)??)
    }
}

/// A blocking file task of the daemon's own that did not finish (it panicked or the runtime
/// is stopping): a server fault, never the worker's.
fn file_task_failed(e: tokio::task::JoinError) -> KernelError {
    KernelError::InternalError {
        operation: "file task".into(),
        reason: e.to_string(),
    }
}
