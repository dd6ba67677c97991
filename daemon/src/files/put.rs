//! Uploads (`PutFile`): the checks before anything is read, the per-directory lock that
//! keeps two uploads from sharing one budget, the write to a fresh temporary (by the calling
//! thread or by a child in the session's group) and its rename over the name.

use super::beneath::{
    Created, cstr, fstat, open_files, open_parent, remove_created, validate_new_name,
};
use super::listing::list;
use super::{
    COPY_CHUNK, Error, Limits, MAX_ENTRIES, MAX_SESSION_ENTRIES, Source, TEMP_PREFIX, info, io,
    kind_of,
};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, unlinkat};
use sandcell_proto::kernel::{FileInfo, FileKind};
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

/// A lock per session directory, held by [`put`] from its budget check to its rename, so
/// that two uploads cannot both fit the budget that only one of them fits.
pub(super) fn dir_lock(dir: &Path) -> std::sync::Arc<std::sync::Mutex<()>> {
    type Locks =
        std::sync::Mutex<HashMap<std::path::PathBuf, std::sync::Arc<std::sync::Mutex<()>>>>;
    static LOCKS: std::sync::OnceLock<Locks> = std::sync::OnceLock::new();
    let mut m = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    m.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
    m.entry(dir.to_path_buf()).or_default().clone()
}

/// Random hex for temporary names (64 bits).
///
/// Errors: [`Error::Io`] (`random`) when the kernel's random source failed.
fn random_hex() -> Result<String, Error> {
    crate::sys::random_hex(8).map_err(io("random"))
}

/// Checks the size of an upload before anything is read: the declared size against
/// `max_file_bytes`, and a passed descriptor's `fstat` (a regular file of exactly `declared`
/// bytes). Errors: [`Error::TooLarge`], [`Error::BadSource`].
pub fn check_upload(declared: u64, source: &Source, limits: &Limits) -> Result<(), Error> {
    if declared > limits.max_file_bytes {
        return Err(Error::TooLarge {
            limit: "max_file_bytes",
            value: declared,
            max: limits.max_file_bytes,
        });
    }
    match source {
        Source::Inline(bytes) if bytes.len() as u64 != declared => Err(Error::BadSource {
            parameter: "size",
            reason: format!("declared {declared} bytes, data has {}", bytes.len()),
        }),
        Source::Inline(_) => Ok(()),
        Source::Fd(fd) => {
            let st = fstat(fd.as_fd()).map_err(|e| Error::BadSource {
                parameter: "fd",
                reason: format!("fstat of the passed descriptor: {e}"),
            })?;
            if kind_of(st.st_mode) != FileKind::File {
                return Err(Error::BadSource {
                    parameter: "fd",
                    reason: "the passed descriptor is not a regular file".into(),
                });
            }
            let actual = st.st_size.max(0) as u64;
            if actual > limits.max_file_bytes {
                return Err(Error::TooLarge {
                    limit: "max_file_bytes",
                    value: actual,
                    max: limits.max_file_bytes,
                });
            }
            if actual != declared {
                return Err(Error::BadSource {
                    parameter: "size",
                    reason: format!("declared {declared} bytes, the passed file has {actual}"),
                });
            }
            Ok(())
        }
    }
}

/// Stores `source` as `name` in `dir`: checks ([`check_upload`], then the session's bytes in
/// use, excluding a regular file being replaced, against `max_session_files_bytes`), creates
/// missing parent directories, writes a temporary (0600, `owner`) and renames it over `name`.
///
/// Errors: [`Error::InvalidName`], [`Error::TooLarge`], [`Error::BadSource`] (content shorter
/// than declared), [`Error::NotRegular`] (a directory, symlink or special file is in the way),
/// [`Error::NoSpace`] (the state directory's file system is full), [`Error::Io`].
pub fn put(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
) -> Result<FileInfo, Error> {
    put_until(dir, name, declared, source, owner, limits, None)
}

/// [`put`] under a deadline (`(when, seconds it stands for)`): waiting for another upload to
/// the same directory, and the copy (checked before every chunk of [`COPY_CHUNK`] bytes,
/// each a read of a local file system and a write), stop once it passes; the temporary is
/// then removed, so nothing half-written stays and its disk charge is released.
///
/// Errors: as [`put`], and [`Error::Deadline`].
///
/// A write the state directory's file system refuses for want of room (`ENOSPC`, `EDQUOT`)
/// is [`Error::NoSpace`]; the temporary and the directories the upload created are removed.
pub fn put_until(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
) -> Result<FileInfo, Error> {
    put_charged(dir, name, declared, source, owner, limits, deadline, &[])
}

/// [`put_until`], with the content written by a child process that joins the session's group
/// first (`charge_to`: its `cgroup.procs` files, [`crate::session_fs::copy_in_group`]), so
/// that a session file system's pages are charged to the session's memory, not the
/// daemon's; empty: written by the calling thread.
///
/// Errors: as [`put_until`]; a write the session's own file system refuses (`ENOSPC`) is
/// [`Error::TooLarge`] naming `max_session_files_bytes` (or `max_session_entries` when it
/// has no inode left), never [`Error::NoSpace`].
#[allow(clippy::too_many_arguments)]
pub fn put_charged(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
    charge_to: &[std::path::PathBuf],
) -> Result<FileInfo, Error> {
    let mut created = Created::new();
    let r = put_inner(
        dir,
        name,
        declared,
        source,
        owner,
        limits,
        deadline,
        &mut created,
        charge_to,
    );
    if r.is_err() {
        remove_created(&created);
    }
    r.map_err(|e| match e {
        Error::Io { source, .. }
            if source.raw_os_error() == Some(libc::ENOSPC)
                && crate::session_fs::is_bounded(dir) =>
        {
            crate::session_fs::refusal(dir, declared, limits.max_session_files_bytes).unwrap_or(
                Error::TooLarge {
                    limit: "max_session_files_bytes",
                    value: limits.max_session_files_bytes.saturating_add(1),
                    max: limits.max_session_files_bytes,
                },
            )
        }
        Error::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            let (in_use, max) = space(dir);
            Error::NoSpace {
                in_use,
                requested: declared,
                max,
            }
        }
        other => other.at(name),
    })
}

/// Bytes in use and in all on the file system of `dir` (`statvfs`: blocks less those
/// available to an unprivileged writer, and blocks; fragment size units); zeros when unknown.
fn space(dir: &Path) -> (u64, u64) {
    let Ok(st) = nix::sys::statvfs::statvfs(dir) else {
        return (0, 0);
    };
    let unit = st.fragment_size();
    let total = st.blocks().saturating_mul(unit);
    let avail = st.blocks_available().saturating_mul(unit);
    (total.saturating_sub(avail), total)
}

#[allow(clippy::too_many_arguments)]
fn put_inner(
    dir: &Path,
    name: &str,
    declared: u64,
    source: Source,
    owner: Option<(u32, u32)>,
    limits: &Limits,
    deadline: Option<(std::time::Instant, u64)>,
    created: &mut Created,
    charge_to: &[std::path::PathBuf],
) -> Result<FileInfo, Error> {
    let parts = validate_new_name(name)?;
    check_upload(declared, &source, limits)?;
    let lock = dir_lock(dir);
    let _held = match deadline {
        None => lock.lock().unwrap_or_else(|e| e.into_inner()),
        Some((when, secs)) => loop {
            match lock.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    if std::time::Instant::now() >= when {
                        return Err(Error::Deadline(secs));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        },
    };
    let listing = list(dir)?;
    let existing = listing.files.iter().find(|f| f.name == name);
    let replaced = existing
        .map(|f| match f.kind {
            FileKind::File => Ok(listing.charges.get(name).copied().unwrap_or(f.size)),
            kind => Err(Error::NotRegular {
                name: name.into(),
                kind,
            }),
        })
        .transpose()?
        .unwrap_or(0);
    // A new name adds itself and any missing parent directory (at most MAX_DEPTH entries).
    let new_entries = if existing.is_some() { 0 } else { parts.len() };
    let all = listing.usage.entries + new_entries as u64;
    if listing.usage.over || all > MAX_SESSION_ENTRIES {
        return Err(Error::TooLarge {
            limit: "max_session_entries",
            value: all,
            max: MAX_SESSION_ENTRIES,
        });
    }
    let visible = (listing.files.len() + new_entries) as u64;
    if existing.is_none() && (listing.truncated || visible > MAX_ENTRIES as u64) {
        return Err(Error::TooLarge {
            limit: "max_listed_entries",
            value: visible,
            max: MAX_ENTRIES as u64,
        });
    }
    let in_use = listing.regular_bytes().saturating_sub(replaced);
    if in_use.saturating_add(declared) > limits.max_session_files_bytes {
        return Err(Error::TooLarge {
            limit: "max_session_files_bytes",
            value: in_use.saturating_add(declared),
            max: limits.max_session_files_bytes,
        });
    }
    let root = open_files(dir)?;
    let parent = open_parent(&root, name, &parts, true, owner, created)?;
    let leaf = cstr(parts[parts.len() - 1])?;
    let tmp_name = format!("{TEMP_PREFIX}{}", random_hex()?);
    let tmp = cstr(&tmp_name)?;
    // O_EXCL|O_NOFOLLOW creates a new file or fails, never opening something that exists.
    let out = std::fs::File::from(
        nix::fcntl::openat(
            &parent,
            tmp.as_c_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_retain(0o600),
        )
        .map_err(|e| io("create temporary")(e.into()))?,
    );
    let unlink_tmp = || {
        // Removes our own temporary.
        let _ = unlinkat(&parent, tmp.as_c_str(), UnlinkatFlags::NoRemoveDir);
    };
    let written = (|| -> Result<(), Error> {
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&out, Some(uid), Some(gid)).map_err(io("fchown"))?;
        }
        if charge_to.is_empty() {
            write_content(&out, declared, source, deadline)
        } else {
            write_in_group(&out, declared, source, deadline, charge_to)
        }
    })();
    if let Err(e) = written {
        unlink_tmp();
        return Err(e);
    }
    // renameat replaces a regular file or a symlink entry without following it and fails
    // on a directory.
    if let Err(e) = nix::fcntl::renameat(&parent, tmp.as_c_str(), &parent, leaf.as_c_str()) {
        unlink_tmp();
        return Err(match e {
            Errno::EISDIR | Errno::ENOTEMPTY | Errno::EEXIST => Error::NotRegular {
                name: name.into(),
                kind: FileKind::Dir,
            },
            e => io("rename")(e.into()),
        });
    }
    let st = fstat(out.as_fd()).map_err(io("fstat"))?;
    Ok(info(name.into(), &st))
}

fn write_content(
    out: &std::fs::File,
    declared: u64,
    source: Source,
    deadline: Option<(std::time::Instant, u64)>,
) -> Result<(), Error> {
    use std::io::Write;
    let mut w = out;
    let past =
        || deadline.and_then(|(when, secs)| (std::time::Instant::now() >= when).then_some(secs));
    match source {
        Source::Inline(bytes) => {
            for chunk in bytes.chunks(COPY_CHUNK) {
                if let Some(secs) = past() {
                    return Err(Error::Deadline(secs));
                }
                w.write_all(chunk).map_err(io("write"))?;
            }
            Ok(())
        }
        Source::Fd(fd) => {
            let src = std::fs::File::from(fd);
            let mut buf = vec![0u8; COPY_CHUNK];
            let mut done: u64 = 0;
            while done < declared {
                if let Some(secs) = past() {
                    return Err(Error::Deadline(secs));
                }
                let want = ((declared - done) as usize).min(buf.len());
                let n = std::os::unix::fs::FileExt::read_at(&src, &mut buf[..want], done).map_err(
                    |e| Error::BadSource {
                        parameter: "fd",
                        reason: format!("read of the passed descriptor: {e}"),
                    },
                )?;
                if n == 0 {
                    return Err(Error::BadSource {
                        parameter: "fd",
                        reason: format!("the passed file ended after {done} of {declared} bytes"),
                    });
                }
                w.write_all(&buf[..n]).map_err(io("write"))?;
                done += n as u64;
            }
            Ok(())
        }
    }
}

/// [`write_content`] by a child process in the session's group ([`put_charged`]).
fn write_in_group(
    out: &std::fs::File,
    declared: u64,
    source: Source,
    deadline: Option<(std::time::Instant, u64)>,
    charge_to: &[std::path::PathBuf],
) -> Result<(), Error> {
    use crate::session_fs::{Copied, CopySource};
    let copied = match &source {
        Source::Inline(bytes) => crate::session_fs::copy_in_group(
            charge_to,
            out.as_raw_fd(),
            CopySource::Bytes(bytes),
            declared.min(bytes.len() as u64),
            deadline.map(|d| d.0),
        ),
        Source::Fd(fd) => crate::session_fs::copy_in_group(
            charge_to,
            out.as_raw_fd(),
            CopySource::Fd(fd.as_raw_fd()),
            declared,
            deadline.map(|d| d.0),
        ),
    }
    .map_err(io("copy into the session's group"))?;
    let errno = |n: i32| std::io::Error::from_raw_os_error(n);
    match copied {
        Copied::Done => Ok(()),
        Copied::Deadline => Err(Error::Deadline(deadline.map_or(0, |d| d.1))),
        Copied::Short(done) => Err(Error::BadSource {
            parameter: "fd",
            reason: format!("the passed file ended after {done} of {declared} bytes"),
        }),
        Copied::Read(n) => Err(Error::BadSource {
            parameter: "fd",
            reason: format!("read of the passed descriptor: {}", errno(n)),
        }),
        Copied::Write(n) => Err(io("write")(errno(n))),
        // The join is a migration, which the pids controller lets past pids.max (only fork
        // and clone are refused, cgroup-v2.rst "PID"); should a kernel refuse it with EAGAIN
        // all the same, the session runs as many processes as it may: the typed limit.
        Copied::Join(libc::EAGAIN) => {
            let (current, max) = pids_of(charge_to).unwrap_or((0, 0));
            Err(Error::TooLarge {
                limit: "max_worker_pids",
                value: current + 1,
                max,
            })
        }
        Copied::Join(n) => Err(io("join the session's group")(errno(n))),
        Copied::Killed(sig) => Err(io("copy into the session's group")(std::io::Error::other(
            format!("the copier was killed by signal {sig} (the session's memory limit)"),
        ))),
    }
}

/// `pids.current` and `pids.max` of the first group among `procs` (`cgroup.procs` files) that
/// has the pids controller; `None` when none is readable or its pids.max is `max`.
fn pids_of(procs: &[std::path::PathBuf]) -> Option<(u64, u64)> {
    procs.iter().find_map(|p| {
        let dir = p.parent()?;
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some((read("pids.current")?, read("pids.max")?))
    })
}
