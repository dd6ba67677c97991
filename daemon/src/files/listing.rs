//! Listing a session directory and counting what it costs: a bounded, lstat-only walk
//! ([`list`], [`list_within`]) giving the visible entries, their fingerprints for a cell's
//! change list, and the [`Usage`] charged against the disk budget.

use super::beneath::{lstat_at, open_root, openat2};
use super::{
    Error, FILES_DIR, FLAT_SCRATCH_DIR, MAX_DEPTH, MAX_ENTRIES, MAX_SESSION_ENTRIES,
    MAX_WALK_DEPTH, TEMP_PREFIX, info, io, kind_of,
};
use sandcell_proto::kernel::{FileInfo, FileKind};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// Most bytes of [`Listing::encode_stamps`]: 4 MiB.
pub const MAX_STAMPS_BYTES: usize = 4 * 1024 * 1024;

/// Per-entry fingerprint used to tell which entries a cell changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    mode: u32,
    size: i64,
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(st: &libc::stat) -> Stamp {
    Stamp {
        mode: st.st_mode,
        size: st.st_size,
        ino: st.st_ino,
        mtime: (st.st_mtime, st.st_mtime_nsec),
        ctime: (st.st_ctime, st.st_ctime_nsec),
    }
}

/// A bounded, lstat-only walk of a session directory.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Entries sorted by name.
    pub files: Vec<FileInfo>,
    /// Not every entry is in `files`: more than [`MAX_ENTRIES`] visible entries, a directory
    /// at [`MAX_DEPTH`] that holds more, or the directory is over its entry budget
    /// ([`Usage::over`]). A session whose listing is truncated after a cell ends.
    pub truncated: bool,
    /// What the whole directory costs, hidden entries included.
    pub usage: Usage,
    stamps: HashMap<String, Stamp>,
    /// Charged bytes of each listed regular file (for an upload replacing it).
    pub(super) charges: HashMap<String, u64>,
}

/// What a session directory costs (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes charged: per inode the larger of `st_size` and `st_blocks * 512` (symlinks,
    /// directories and special files: their blocks); the session directory itself, which
    /// the daemon made, is not charged.
    pub bytes: u64,
    /// Entries counted (any kind, any depth, hidden ones included), at most
    /// [`MAX_SESSION_ENTRIES`] + 1.
    pub entries: u64,
    /// More than [`MAX_SESSION_ENTRIES`] entries, or directories deeper than
    /// [`MAX_WALK_DEPTH`]: the walk stopped, and `bytes` is a lower bound.
    pub over: bool,
}

/// Bytes an inode is charged: the larger of its size and its allocated blocks for a regular
/// file (a sparse file is charged its size, blocks reserved past the end are charged too),
/// the allocated blocks of anything else.
fn charge(st: &libc::stat) -> u64 {
    let blocks = (st.st_blocks.max(0) as u64).saturating_mul(512);
    match kind_of(st.st_mode) {
        FileKind::File => blocks.max(st.st_size.max(0) as u64),
        _ => blocks,
    }
}

impl Listing {
    /// Bytes the session directory is charged against `max_session_files_bytes`:
    /// [`Usage::bytes`] (every entry, hidden ones included, the larger of size and allocated
    /// blocks). `u64::MAX` when the directory is over its entry budget, so that a caller
    /// comparing bytes alone still sees it over.
    pub fn regular_bytes(&self) -> u64 {
        if self.usage.over {
            u64::MAX
        } else {
            self.usage.bytes
        }
    }

    /// The fingerprints [`Listing::changed_since`] compares, as bytes (little-endian): per
    /// entry its name's length (u32) and the name, then mode (u32), size (i64), inode (u64),
    /// mtime and ctime (seconds and nanoseconds, i64 each). `None` when they would take more
    /// than [`MAX_STAMPS_BYTES`].
    pub fn encode_stamps(&self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for (name, s) in &self.stamps {
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&s.mode.to_le_bytes());
            out.extend_from_slice(&s.size.to_le_bytes());
            out.extend_from_slice(&s.ino.to_le_bytes());
            for v in [s.mtime.0, s.mtime.1, s.ctime.0, s.ctime.1] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            if out.len() > MAX_STAMPS_BYTES {
                return None;
            }
        }
        Some(out)
    }

    /// A listing holding only the fingerprints of [`Listing::encode_stamps`]'s `bytes`: the
    /// `before` of [`Listing::changed_since`] for a cell a successor daemon continues. `None`
    /// when the bytes are cut or malformed.
    pub fn decode_stamps(mut bytes: &[u8]) -> Option<Listing> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if b.len() < n {
                return None;
            }
            let (a, rest) = b.split_at(n);
            *b = rest;
            Some(a)
        }
        fn i64_(b: &mut &[u8]) -> Option<i64> {
            Some(i64::from_le_bytes(take(b, 8)?.try_into().ok()?))
        }
        let mut l = Listing::default();
        while !bytes.is_empty() {
            let n = u32::from_le_bytes(take(&mut bytes, 4)?.try_into().ok()?) as usize;
            let name = std::str::from_utf8(take(&mut bytes, n)?).ok()?.to_owned();
            let mode = u32::from_le_bytes(take(&mut bytes, 4)?.try_into().ok()?);
            let size = i64_(&mut bytes)?;
            let ino = u64::from_le_bytes(take(&mut bytes, 8)?.try_into().ok()?);
            let mtime = (i64_(&mut bytes)?, i64_(&mut bytes)?);
            let ctime = (i64_(&mut bytes)?, i64_(&mut bytes)?);
            l.stamps.insert(
                name,
                Stamp {
                    mode,
                    size,
                    ino,
                    mtime,
                    ctime,
                },
            );
        }
        Some(l)
    }

    /// Entries of `self` that are new or changed since `before`: files, symlinks and special
    /// files whose type, size, inode, mtime or ctime differ; directories only when new.
    pub fn changed_since(&self, before: &Listing) -> Vec<FileInfo> {
        self.files
            .iter()
            .filter(
                |f| match (before.stamps.get(&f.name), self.stamps.get(&f.name)) {
                    (None, _) => true,
                    (Some(_), _) if f.kind == FileKind::Dir => false,
                    (Some(a), Some(b)) => a != b,
                    (Some(_), None) => false,
                },
            )
            .cloned()
            .collect()
    }
}

/// A directory stream that reads one entry per call and lends its descriptor for the
/// `*at` calls on its entries. nix's `Dir` does not fit: its borrowing iterator rewinds the
/// stream when dropped, and its owning iterator lends no descriptor, so this keeps libc's.
struct DirStream(*mut libc::DIR);

impl DirStream {
    fn open(fd: OwnedFd) -> std::io::Result<DirStream> {
        let raw = fd.as_raw_fd();
        // SAFETY: `raw` is an open directory descriptor; on success fdopendir owns it (we
        // forget `fd`), on failure we still own it and `fd` closes it.
        let d = unsafe { libc::fdopendir(raw) };
        if d.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        std::mem::forget(fd);
        Ok(DirStream(d))
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the DIR is open for `self`'s lifetime and owns this descriptor.
        unsafe { BorrowedFd::borrow_raw(libc::dirfd(self.0)) }
    }

    /// Next entry name (without `.` and `..`), or `None` at the end.
    fn next(&mut self) -> Option<CString> {
        loop {
            // SAFETY: the DIR is open; readdir64's result is valid until the next call on
            // it, and the name is copied before that.
            let e = unsafe { libc::readdir64(self.0) };
            if e.is_null() {
                return None;
            }
            // SAFETY: d_name is NUL-terminated within the entry.
            let name = unsafe { CStr::from_ptr((*e).d_name.as_ptr()) };
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                return Some(name.to_owned());
            }
        }
    }
}

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: the DIR is open and closed exactly once here.
        unsafe { libc::closedir(self.0) };
    }
}

/// Lists the session directory `dir` without following anything: the entries of its
/// [`FILES_DIR`] (named relative to it; of `dir` itself when laid out flat), at most
/// [`MAX_ENTRIES`] entries, [`MAX_DEPTH`] levels; everything beside [`FILES_DIR`] (the
/// scratch [`SCRATCH_DIR`]; [`FLAT_SCRATCH_DIR`] when flat) and upload temporaries are left
/// out of `files` but counted in `usage`, as is everything else down to [`MAX_WALK_DEPTH`] levels and up to
/// [`MAX_SESSION_ENTRIES`] entries. Names that are not UTF-8 are counted, not listed: every
/// listed name can be fetched. At most [`MAX_WALK_DEPTH`] + 2 descriptors are open at once.
///
/// Errors: the directory itself cannot be opened.
pub fn list(dir: &Path) -> Result<Listing, Error> {
    Ok(list_within(dir, u64::MAX)?.unwrap_or_default())
}

/// [`list`], or `None` as soon as the walk meets more than `max_entries` entries (any kind,
/// any depth, hidden ones included): a walk whose cost is bounded by the caller.
///
/// Errors: the directory itself cannot be opened.
pub fn list_within(dir: &Path, max_entries: u64) -> Result<Option<Listing>, Error> {
    let root = open_root(dir)?;
    let mut out = Listing::default();
    // Inodes with several links, charged once.
    let mut linked: std::collections::HashSet<(u64, u64)> = std::collections::HashSet::new();
    // Laid out with a files directory, the walk starts one level above the names it reports:
    // at depth 0, where only the files directory is walked as depth 1 (listed), and
    // everything else is hidden.
    let files = CString::new(FILES_DIR).expect("no NUL");
    let split = lstat_at(root.as_fd(), &files).is_ok_and(|st| kind_of(st.st_mode) == FileKind::Dir);
    let top = if split { 0 } else { 1 };
    // Depth-first: one open directory per level. (stream, name prefix, depth, hidden)
    let mut stack: Vec<(DirStream, String, usize, bool)> = match DirStream::open(root) {
        Ok(ds) => vec![(ds, String::new(), top, split)],
        Err(e) => return Err(io("read session directory")(e).at(".")),
    };
    while let Some((ds, prefix, depth, hidden)) = stack.last_mut() {
        let Some(c) = ds.next() else {
            stack.pop();
            continue;
        };
        let (depth, parent_hidden) = (*depth, *hidden);
        let Ok(st) = lstat_at(ds.fd(), &c) else {
            continue; // removed meanwhile
        };
        out.usage.entries += 1;
        if out.usage.entries > max_entries {
            return Ok(None);
        }
        if out.usage.entries > MAX_SESSION_ENTRIES {
            out.usage.over = true;
            out.truncated = true;
            break;
        }
        let first_link = st.st_nlink <= 1 || linked.insert((st.st_dev, st.st_ino));
        if first_link {
            out.usage.bytes = out.usage.bytes.saturating_add(charge(&st));
        }
        // A name that is not UTF-8 cannot be asked for (names travel as JSON strings): it is
        // counted but not listed, nor is anything below it.
        let (leaf, unnamed) = match c.to_str() {
            Ok(l) => (l.to_owned(), false),
            Err(_) => (c.to_string_lossy().into_owned(), true),
        };
        let hide = parent_hidden
            || unnamed
            || (!split && depth == 1 && leaf == FLAT_SCRATCH_DIR)
            || leaf.starts_with(TEMP_PREFIX)
            || depth > MAX_DEPTH;
        let name = format!("{prefix}{leaf}");
        let kind = kind_of(st.st_mode);
        let mut sub = None;
        if kind == FileKind::Dir {
            if depth < MAX_WALK_DEPTH {
                sub = openat2(
                    ds.fd(),
                    &leaf,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                )
                .ok()
                .and_then(|fd| DirStream::open(fd).ok());
            } else {
                out.usage.over = true;
                out.truncated = true;
            }
            if !hide && depth >= MAX_DEPTH {
                out.truncated = true;
            }
        }
        if !hide {
            if out.files.len() >= MAX_ENTRIES {
                out.truncated = true;
            } else {
                out.stamps.insert(name.clone(), stamp(&st));
                if kind == FileKind::File {
                    out.charges.insert(name.clone(), charge(&st));
                }
                out.files.push(info(name.clone(), &st));
            }
        }
        if let Some(sub) = sub {
            if depth == 0 && leaf == FILES_DIR {
                stack.push((sub, String::new(), 1, false));
                continue;
            }
            stack.push((sub, format!("{name}/"), depth + 1, hide));
        }
    }
    out.files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Some(out))
}
