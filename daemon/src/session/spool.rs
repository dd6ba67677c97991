//! The spool of a retained cell whose session is kept for a successor: every byte the daemon
//! takes from the worker's pipes (the reply pipe, and a native worker's raw stdout and
//! stderr) is first moved into a root-only file in the adoption directory with splice(2),
//! then read from there. splice(2) moves the pipe's pages into the file inside the kernel, so
//! at every instant a byte the worker wrote is either still in its pipe or in the spool file,
//! never only in the memory of a daemon that may be killed with SIGKILL.
//!
//! Each journal batch (`journal.rs`) records, in the same `write(2)` as the frames it
//! accounts for, how far each spool has been handled. A successor continues each stream at
//! that offset: bytes a killed daemon took from a pipe and had not yet journaled are read
//! again, once; bytes it had journaled are never read again. What precedes the handled
//! offset is released with `fallocate(FALLOC_FL_PUNCH_HOLE)` (supported by tmpfs and ext4,
//! fallocate(2)), so a spool holds at most what was read since the last batch while offsets
//! keep growing.
//!
//! Files: `<adopt_dir>/<id>.spool-<stream>` (`records::spool_path`), mode 0600, created when
//! the cell's journal is, removed when the cell ends.

use crate::records;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The streams a spool keeps, in the order of the journal's offsets.
pub(crate) const STREAMS: [&str; 3] = ["stdout", "stderr", "replies"];

/// Index of the reply pipe's spool.
pub(crate) const REPLIES: usize = 2;

/// Spool bytes already handled that are released at once when at least this many.
const RELEASE_BYTES: u64 = 256 * 1024;

/// Most bytes a successor reads from one spool past its handled offset: a daemon reads at
/// most a few reads of each stream (and one reply line) between two journal batches.
pub(crate) const MAX_TAIL_BYTES: u64 = 8 * 1024 * 1024;

/// One stream's spool file.
#[derive(Debug)]
struct One {
    file: File,
    /// Bytes moved into the file so far (its end).
    end: u64,
    /// Bytes read back from it so far.
    read: u64,
    /// Bytes released (punched) from its start.
    released: u64,
}

/// The spool files of one running cell.
#[derive(Debug)]
pub(crate) struct Spool {
    files: [One; 3],
    paths: [PathBuf; 3],
}

impl Spool {
    /// New, empty spool files for session `id` in `dir` (older ones are replaced); `replies`
    /// is what the reply reader holds already and has not handled (it is written first, so
    /// the reply spool's handled offset is its bytes read minus what the reader still holds).
    ///
    /// Errors: a file cannot be created or written.
    pub(crate) fn create(dir: &Path, id: &str, replies: &[u8]) -> std::io::Result<Spool> {
        let paths = STREAMS.map(|s| records::spool_path(dir, id, s));
        let open = |p: &PathBuf| -> std::io::Result<One> {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(p)?;
            Ok(One {
                file,
                end: 0,
                read: 0,
                released: 0,
            })
        };
        let files = [open(&paths[0])?, open(&paths[1])?, open(&paths[2])?];
        let mut s = Spool { files, paths };
        if !replies.is_empty() {
            s.files[REPLIES].file.write_all_at(replies, 0)?;
            s.files[REPLIES].end = replies.len() as u64;
            s.files[REPLIES].read = replies.len() as u64;
        }
        Ok(s)
    }

    /// The spool files a predecessor left for session `id`, continued at the handled
    /// offsets `at` (from its journal): returns the spool, positioned at the files' ends,
    /// and each stream's bytes past its offset (read again by the caller, in order).
    ///
    /// Errors: a file is missing, not a root-only regular file, shorter than its offset, or
    /// holds more than [`MAX_TAIL_BYTES`] past it.
    pub(crate) fn resume(
        dir: &Path,
        id: &str,
        at: [u64; 3],
    ) -> std::io::Result<(Spool, [Vec<u8>; 3])> {
        use std::os::unix::fs::MetadataExt;
        let paths = STREAMS.map(|s| records::spool_path(dir, id, s));
        let mut tails: [Vec<u8>; 3] = Default::default();
        let mut ones = Vec::with_capacity(3);
        for (i, p) in paths.iter().enumerate() {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(p)?;
            let m = file.metadata()?;
            if !m.is_file() || m.uid() != 0 || m.mode() & 0o077 != 0 {
                return Err(std::io::Error::other(format!(
                    "{}: not a root-only regular file",
                    p.display()
                )));
            }
            let end = m.len();
            if end < at[i] || end - at[i] > MAX_TAIL_BYTES {
                return Err(std::io::Error::other(format!(
                    "{}: {end} bytes against a handled offset of {}",
                    p.display(),
                    at[i]
                )));
            }
            std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(at[i]))?;
            (&mut file).take(end - at[i]).read_to_end(&mut tails[i])?;
            ones.push(One {
                file,
                end,
                read: end,
                released: 0,
            });
        }
        let [a, b, c]: [One; 3] = ones.try_into().expect("three spools");
        Ok((
            Spool {
                files: [a, b, c],
                paths,
            },
            tails,
        ))
    }

    /// Moves at most `buf.len()` bytes from pipe `from` into spool `i` (splice(2), without
    /// blocking), then reads them back into `buf`. Returns the bytes moved: 0 at end of file
    /// (the writer closed the pipe); `WouldBlock` when the pipe is empty.
    ///
    /// Errors: splice(2) or the read back failed (a full file system: the bytes stay in the
    /// pipe).
    pub(crate) fn fill(
        &mut self,
        i: usize,
        from: impl AsFd,
        buf: &mut [u8],
    ) -> std::io::Result<usize> {
        use nix::fcntl::{SpliceFFlags, splice};
        let one = &mut self.files[i];
        let mut off = one.end as i64;
        let n = loop {
            match splice(
                from.as_fd(),
                None,
                one.file.as_fd(),
                Some(&mut off),
                buf.len(),
                SpliceFFlags::SPLICE_F_NONBLOCK,
            ) {
                Ok(n) => break n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        if n == 0 {
            return Ok(0);
        }
        one.end += n as u64;
        crash_seam();
        one.file.read_exact_at(&mut buf[..n], one.read)?;
        one.read += n as u64;
        Ok(n)
    }

    /// Bytes read back from spool `i` so far.
    pub(crate) fn read(&self, i: usize) -> u64 {
        self.files[i].read
    }

    /// The handled offsets `at` went into the journal: what precedes them is released once
    /// enough of it is (the files keep their size; offsets keep growing).
    pub(crate) fn release(&mut self, at: [u64; 3]) {
        use nix::fcntl::{FallocateFlags, fallocate};
        for (one, at) in self.files.iter_mut().zip(at) {
            if at >= one.released + RELEASE_BYTES {
                let flags =
                    FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
                if fallocate(
                    one.file.as_fd(),
                    flags,
                    one.released as i64,
                    (at - one.released) as i64,
                )
                .is_ok()
                {
                    one.released = at;
                }
            }
        }
    }

    /// Removes the spool files (the cell ended, or its journal did).
    pub(crate) fn remove(self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A test seam: with `SANDCELL_TEST_KILL_AFTER_SPLICE=N` in its environment the daemon
/// kills itself with SIGKILL right after its N-th splice into a spool, before it reads the
/// bytes back or journals them: the instant a crash would lose them without a spool. Only
/// the integration tests set it.
fn crash_seam() {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static DONE: AtomicU64 = AtomicU64::new(0);
    let Some(at) = *AT.get_or_init(|| {
        std::env::var("SANDCELL_TEST_KILL_AFTER_SPLICE")
            .ok()
            .and_then(|v| v.parse().ok())
    }) else {
        return;
    };
    if DONE.fetch_add(1, Ordering::Relaxed) + 1 == at {
        tracing::warn!("SANDCELL_TEST_KILL_AFTER_SPLICE: killing the daemon after a splice");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// Removes session `id`'s spool files in `dir` (absent ones are not an error).
pub(crate) fn remove(dir: &Path, id: &str) {
    for s in STREAMS {
        let _ = std::fs::remove_file(records::spool_path(dir, id, s));
    }
}
