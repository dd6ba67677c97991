//! Step 4: the worker's own file-system view (a mount namespace).
//!
//! Built from the same allowlist as Landlock, in the style of bubblewrap
//! (`bubblewrap.c`, `setup_newroot`):
//!
//! 1. `unshare(CLONE_NEWNS)`; every mount becomes private (`MS_REC|MS_PRIVATE`): nothing the
//!    worker mounts reaches the host, nothing the host mounts later reaches the worker;
//! 2. every allowlisted path is opened (`O_PATH`) while the host's tree is still visible;
//! 3. a new root on a tmpfs (mounted over `/tmp`, which only this namespace sees), holding:
//!    - each allowlisted path, bind-mounted (not recursively: mounts below it stay out of
//!      view) from its descriptor and remounted `ro,nosuid,nodev`; top-level symlinks such as
//!      merged-usr's `/lib -> usr/lib` are recreated as symlinks;
//!    - the session directory and the plan's write paths `rw,nosuid,nodev`, the session
//!      directory also `noexec`;
//!    - private tmpfs on `/tmp`, `/var/tmp` and `/dev/shm` (`nosuid,nodev,noexec`, 64 MiB each,
//!      charged to the session's memory cgroup); no `/dev/mqueue`;
//!    - a minimal `/dev`: `null`, `zero`, `full`, `random`, `urandom` bound from the host, and
//!      the `fd`, `stdin`, `stdout`, `stderr` symlinks;
//!    - `/mnt/data`, a second bind of the session directory (same flags); a session directory
//!      holding `data/` (the files) and `tmp/` (the scratch) is bound at `/mnt` instead, so
//!      `/mnt/data` shows the files only and `/mnt/tmp` is on the same mount;
//!    - a new procfs, read-only, with `hidepid=invisible` (Linux 5.8 or newer: per-mount
//!      procfs options): the worker sees only its own uid's processes and writes nothing
//!      there (not its own `oom_score_adj`); its host-wide `/proc/stat` is covered by a
//!      synthesized copy ([`synthesized_proc_stat`]: zero counters);
//! 4. `pivot_root(".", ".")` and a lazy unmount of the old root (the `pivot_root(2)` manual's
//!    idiom, used by runc); the root tmpfs is then remounted read-only.
//!
//! Needs CAP_SYS_ADMIN, so it runs before the identity switch; Landlock (which forbids mount
//! changes once applied) and seccomp (which denies `mount`) come after it. Paths stay the same
//! inside the view, so the plan, Landlock rules and environment variables need no
//! translation.

use crate::{Error, Plan};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// The private tmpfs mounts of the view (mode 1777, 64 MiB and 16384 inodes each, `nosuid`,
/// `nodev`, `noexec`): a fresh, empty one per worker, gone with its mount namespace. Landlock
/// lets a worker write them only when its plan names them in `write_paths`.
pub const TMPFS: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];
/// Where the view binds the session directory a second time (OpenAI code_interpreter's path);
/// a native worker makes it its working directory when it is there.
pub const MNT_DATA: &str = "/mnt/data";
/// The directory of a session directory holding the user's files, when it has one: the
/// session directory is then bound at `/mnt`, so this is `/mnt/data`, and its sibling
/// [`MNT_SCRATCH`] is `/mnt/tmp`.
pub const MNT_FILES: &str = "data";
/// The scratch directory beside [`MNT_FILES`] in a session directory (`/mnt/tmp` in the view).
pub const MNT_SCRATCH: &str = "tmp";
/// Device nodes bound into the view's `/dev`.
const DEVICES: [&str; 5] = ["null", "zero", "full", "random", "urandom"];

/// What goes where in the new root.
#[derive(Debug)]
enum Kind {
    /// Bind the path held by the descriptor, read-only unless `writable`.
    Bind {
        fd: OwnedFd,
        dir: bool,
        writable: bool,
        noexec: bool,
    },
    /// A symlink with this target.
    Symlink(PathBuf),
    /// A private tmpfs with these options.
    Tmpfs(&'static str),
    /// A bind of a host device node.
    Device(OwnedFd),
}

#[derive(Debug)]
struct Entry {
    path: PathBuf,
    kind: Kind,
}

fn err(what: impl std::fmt::Display) -> Error {
    Error::Step {
        step: "mount-namespace",
        source: std::io::Error::other(what.to_string()),
    }
}

fn os_err(what: impl std::fmt::Display) -> Error {
    let e = std::io::Error::last_os_error();
    Error::Step {
        step: "mount-namespace",
        source: std::io::Error::new(e.kind(), format!("{what}: {e}")),
    }
}

fn cpath(p: &Path) -> Result<CString, Error> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| err(format!("{} has a NUL", p.display())))
}

fn open_path(p: &Path) -> Result<OwnedFd, Error> {
    let c = cpath(p)?;
    // SAFETY: a NUL-terminated path; the result is a new descriptor we own.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    };
    if fd < 0 {
        return Err(os_err(format!("open {}", p.display())));
    }
    // SAFETY: fd is fresh and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether `p` is `/proc` or below it (procfs is mounted fresh) or below `/dev` (only the
/// minimal device set exists).
fn provided(p: &Path) -> bool {
    p.starts_with("/proc") || p.starts_with("/dev")
}

/// The entries of the view for `plan`, with descriptors opened now.
fn collect(plan: &Plan) -> Result<Vec<Entry>, Error> {
    let mut wanted: Vec<(PathBuf, bool, bool)> = Vec::new(); // path, writable, noexec
    for p in plan.read_paths.iter().chain(&plan.exec_paths) {
        wanted.push((p.clone(), false, false));
    }
    for p in &plan.write_paths {
        wanted.push((p.clone(), true, true));
    }
    wanted.push((plan.session_dir.clone(), true, true));

    let mut entries: Vec<Entry> = Vec::new();
    let mut binds: Vec<(PathBuf, bool, bool)> = Vec::new();
    for (path, writable, noexec) in wanted {
        // A private tmpfs is mounted, not bound: it must not hide what is bound below it
        // (a session directory under /var/tmp) as "already visible".
        if !path.is_absolute()
            || path.components().any(|c| matches!(c, Component::ParentDir))
            || provided(&path)
            || TMPFS.iter().any(|t| Path::new(t) == path)
        {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue; // missing: Landlock reports it
        };
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path).map_err(err)?;
            if !entries.iter().any(|e| e.path == path) {
                entries.push(Entry {
                    path: path.clone(),
                    kind: Kind::Symlink(target),
                });
            }
            if let Ok(real) = std::fs::canonicalize(&path)
                && !provided(&real)
            {
                binds.push((real, writable, noexec));
            }
        } else {
            binds.push((path, writable, noexec));
        }
    }
    // Parents first; a path named twice keeps its most permissive entry (writable sorts
    // last); a path below a bound one with the same rights is already visible.
    binds.sort();
    let mut unique: Vec<(PathBuf, bool, bool)> = Vec::new();
    for b in binds {
        if unique.last().is_some_and(|u| u.0 == b.0) {
            unique.pop();
        }
        unique.push(b);
    }
    let mut kept: Vec<(PathBuf, bool, bool)> = Vec::new();
    for b in unique {
        if kept
            .iter()
            .any(|k| b.0.starts_with(&k.0) && k.1 == b.1 && k.2 == b.2)
        {
            continue;
        }
        kept.push(b);
    }
    for (path, writable, noexec) in kept {
        let dir = std::fs::metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false);
        let fd = open_path(&path)?;
        entries.push(Entry {
            path,
            kind: Kind::Bind {
                fd,
                dir,
                writable,
                noexec,
            },
        });
    }
    for t in TMPFS {
        entries.push(Entry {
            path: t.into(),
            kind: Kind::Tmpfs("mode=1777,size=64m,nr_inodes=16384"),
        });
    }
    entries.push(Entry {
        path: "/dev".into(),
        kind: Kind::Tmpfs("mode=0755,size=64k,nr_inodes=64"),
    });
    for d in DEVICES {
        let p = Path::new("/dev").join(d);
        if p.exists() {
            entries.push(Entry {
                kind: Kind::Device(open_path(&p)?),
                path: p,
            });
        }
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        entries.push(Entry {
            path: Path::new("/dev").join(name),
            kind: Kind::Symlink(target.into()),
        });
    }
    // The session directory is also reachable as /mnt/data (the path OpenAI's
    // code_interpreter uses, and where the Eryx engine's virtual file system mounts it): a
    // second bind of the same directory, with the same flags, so nothing new becomes
    // writable (Landlock's rules are on the directory's inode, which both paths reach). A
    // bind, not a symlink: a native worker working in /mnt/data sees that path in getcwd(3)
    // (a symlink would resolve to the host path).
    //
    // A session directory laid out with its files in `data/` and its worker's scratch in
    // `tmp/` beside it is bound at /mnt instead: /mnt/data shows the files only, and /mnt/tmp
    // (TMPDIR) is on the same mount, so a rename(2) between the two works (across two mounts,
    // even of one file system, it fails EXDEV).
    let mnt = if plan.session_dir.join(MNT_FILES).is_dir() {
        Path::new(MNT_DATA).parent().unwrap_or(Path::new("/"))
    } else {
        Path::new(MNT_DATA)
    };
    if !entries.iter().any(|e| e.path.starts_with("/mnt")) && plan.session_dir.is_dir() {
        entries.push(Entry {
            path: mnt.into(),
            kind: Kind::Bind {
                fd: open_path(&plan.session_dir)?,
                dir: true,
                writable: true,
                noexec: true,
            },
        });
    }
    // Parents before children; at the same path the tmpfs comes before what goes into it.
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), Error> {
    let src_c = src.map(cpath).transpose()?;
    let target_c = cpath(target)?;
    let fs_c = fstype.map(|f| CString::new(f).expect("no NUL"));
    let data_c = data.map(|d| CString::new(d).expect("no NUL"));
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null.
    let rc = unsafe {
        libc::mount(
            src_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            target_c.as_ptr(),
            fs_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |c| c.as_ptr().cast()),
        )
    };
    if rc != 0 {
        return Err(os_err(format!(
            "mount {} on {} ({})",
            src.map(|s| s.display().to_string())
                .unwrap_or_else(|| fstype.unwrap_or("-").into()),
            target.display(),
            data.unwrap_or("")
        )));
    }
    Ok(())
}

/// Where `path` of the view lives while the view is built under `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn mountpoint(target: &Path, dir: bool) -> Result<(), Error> {
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| err(format!("mkdir {}: {e}", parent.display())))?;
    }
    if std::fs::symlink_metadata(target).is_ok() {
        return Ok(());
    }
    let r = if dir {
        std::fs::create_dir(target)
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(target)
            .map(drop)
    };
    r.map_err(|e| err(format!("create {}: {e}", target.display())))
}

/// Builds the view of `plan` and moves the calling process into it. See the module
/// documentation for what the view holds.
///
/// Errors: [`Error::Unavailable`] when the mount namespace cannot be created (no
/// CAP_SYS_ADMIN, `RestrictNamespaces=` without `mnt`, a seccomp filter denying `unshare` or
/// `mount`); [`Error::Step`] (`mount-namespace`) when a mount of the view fails.
pub fn apply(plan: &Plan) -> Result<(), Error> {
    // The directories made for the view (mount points and their parents on the new root's
    // tmpfs) must be searchable by the worker's uid after the identity switch: a daemon run
    // with systemd's UMask=0077 would otherwise leave them 0700 root's, and every path below
    // them (the session directory itself) unreachable. The caller's umask is restored after.
    // SAFETY: umask has no preconditions and cannot fail.
    let old = unsafe { libc::umask(0o022) };
    let r = build_view(plan);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r
}

/// [`apply`] under a umask of 0022.
fn build_view(plan: &Plan) -> Result<(), Error> {
    // The working directory is kept when it is part of the view (same path), else "/".
    let cwd = std::env::current_dir().ok();
    // SAFETY: unshare takes only flags; the process is single-threaded (checked in step 0).
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(Error::Unavailable {
            layer: "mount-namespace",
            reason: format!(
                "unshare(CLONE_NEWNS): {} ({})",
                std::io::Error::last_os_error(),
                crate::policy::hint(crate::policy::Layer::MountNamespace)
            ),
        });
    }
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    // Opened now, in the new namespace (a bind from a mount of another namespace is EINVAL),
    // and before the tmpfs below hides /tmp.
    let entries = collect(plan)?;
    let root = Path::new("/tmp");
    mount(
        Some(Path::new("tmpfs")),
        root,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=0755,size=1m,nr_inodes=4096"),
    )?;
    let proc_fd = |fd: &OwnedFd| PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    for e in &entries {
        let target = under(root, &e.path);
        match &e.kind {
            Kind::Symlink(to) => {
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|x| err(format!("mkdir {}: {x}", parent.display())))?;
                }
                if std::fs::symlink_metadata(&target).is_err() {
                    std::os::unix::fs::symlink(to, &target)
                        .map_err(|x| err(format!("symlink {}: {x}", target.display())))?;
                }
            }
            Kind::Tmpfs(opts) => {
                mountpoint(&target, true)?;
                // Device nodes are separate bind mounts with their own flags, so /dev's
                // tmpfs can be nodev too.
                mount(
                    Some(Path::new("tmpfs")),
                    &target,
                    Some("tmpfs"),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    Some(opts),
                )?;
            }
            Kind::Device(fd) => {
                mountpoint(&target, false)?;
                mount(Some(&proc_fd(fd)), &target, None, libc::MS_BIND, None)?;
                mount(
                    None,
                    &target,
                    None,
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NOEXEC,
                    None,
                )?;
            }
            Kind::Bind {
                fd,
                dir,
                writable,
                noexec,
            } => {
                mountpoint(&target, *dir)?;
                mount(Some(&proc_fd(fd)), &target, None, libc::MS_BIND, None)?;
                let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV;
                if !writable {
                    flags |= libc::MS_RDONLY;
                }
                if *noexec {
                    flags |= libc::MS_NOEXEC;
                }
                mount(None, &target, None, flags, None)?;
            }
        }
    }
    // procfs: the worker sees its own uid's processes only. Per-mount procfs options arrived
    // in Linux 5.8 (with hidepid=invisible); before that every procfs of a pid namespace
    // shared one superblock, and mounting with hidepid= would change the host's /proc. So
    // there is no fallback: an older kernel fails here (and in `probe`).
    let proc = under(root, Path::new("/proc"));
    mountpoint(&proc, true)?;
    // Read-only: a cell writes nothing under /proc, in particular not its own
    // /proc/self/oom_score_adj (lowering it would make another process the OOM killer's
    // choice; the kernel bounds it only where the daemon holds CAP_SYS_RESOURCE, proc(5)).
    mount(
        Some(Path::new("proc")),
        &proc,
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY,
        Some("hidepid=invisible"),
    )?;
    // /proc/stat is host-wide (every CPU's times, the host's process counts): a cell must
    // not watch other tenants' activity through it, yet libraries read it on import (psutil
    // reads its first line to learn the kernel's CPU-time fields, and prints a traceback
    // when it cannot: `import sklearn` through joblib). A synthesized copy is bound over it,
    // in the style of lxcfs: the host's field count and boot time, every counter zero.
    let stat_src = under(root, Path::new(PROC_STAT_SOURCE));
    std::fs::write(&stat_src, synthesized_proc_stat())
        .map_err(|x| err(format!("write {}: {x}", stat_src.display())))?;
    let stat = under(root, Path::new(PROC_STAT));
    mount(Some(&stat_src), &stat, None, libc::MS_BIND, None)?;
    mount(
        None,
        &stat,
        None,
        libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC,
        None,
    )?;
    // The source keeps its name: an unlinked file still held by the bind would make the read-only
    // remount of the root below fail (EBUSY).
    // The minimal /dev is complete: make its tmpfs read-only.
    mount(
        None,
        &under(root, Path::new("/dev")),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some("mode=0755"),
    )?;
    drop(entries); // the O_PATH descriptors

    let root_c = cpath(root)?;
    let dot = CString::new(".").expect("no NUL");
    // SAFETY: NUL-terminated paths; pivot_root(".", ".") stacks the old root on the new one,
    // which the lazy unmount then removes (pivot_root(2), NOTES).
    unsafe {
        if libc::chdir(root_c.as_ptr()) != 0 {
            return Err(os_err("chdir to the new root"));
        }
        if libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) != 0 {
            return Err(os_err("pivot_root"));
        }
        if libc::umount2(dot.as_ptr(), libc::MNT_DETACH) != 0 {
            return Err(os_err("unmount the old root"));
        }
        let slash = CString::new("/").expect("no NUL");
        if libc::chdir(slash.as_ptr()) != 0 {
            return Err(os_err("chdir /"));
        }
    }
    if let Some(cwd) = cwd {
        let _ = std::env::set_current_dir(cwd);
    }
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=0755"),
    )?;
    Ok(())
}

/// The view's `/proc/stat`: a synthesized file bound over the procfs one (see
/// [`synthesized_proc_stat`]); a plan may list it among its read paths.
pub const PROC_STAT: &str = "/proc/stat";
/// Where the view keeps the file bound over [`PROC_STAT`] (on its read-only root).
const PROC_STAT_SOURCE: &str = "/.sandcell-proc-stat";

/// The content of the view's `/proc/stat` (format: proc_stat(5)): a `cpu` line and one
/// `cpuN` line per online CPU with as many fields as the host's (all zero), the host's
/// `btime`, and zero `intr`, `ctxt`, `processes`, `procs_running` (1) and `procs_blocked`.
/// Read from the host's /proc/stat (still visible when the view is built); ten fields and
/// no CPU lines beyond `cpu` when that fails.
pub fn synthesized_proc_stat() -> String {
    let host = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let mut out = String::new();
    let mut btime = 0u64;
    for line in host.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some(cpu) if cpu.starts_with("cpu") => {
                let n = words.count();
                out.push_str(cpu);
                out.push_str(if cpu == "cpu" { " " } else { "" });
                for _ in 0..n {
                    out.push_str(" 0");
                }
                out.push('\n');
            }
            Some("btime") => btime = words.next().and_then(|b| b.parse().ok()).unwrap_or(0),
            _ => {}
        }
    }
    if out.is_empty() {
        out.push_str("cpu  0 0 0 0 0 0 0 0 0 0\n");
    }
    out.push_str(&format!(
        "intr 0\nctxt 0\nbtime {btime}\nprocesses 0\nprocs_running 1\nprocs_blocked 0\n"
    ));
    out
}

/// Whether a mount namespace with a tmpfs and a procfs can be built here: forks a child that
/// unshares, makes its mounts private, mounts a tmpfs on `/tmp` and a procfs with
/// `hidepid=invisible` in it (Linux 5.8 or newer), and exits.
/// The child only makes raw system calls, so this is safe from a multi-threaded process.
///
/// Errors: `fork` failed. `Ok(false)` when the child could not build the namespace.
pub fn probe() -> std::io::Result<bool> {
    let tmp = CString::new("/tmp").expect("no NUL");
    let slash = CString::new("/").expect("no NUL");
    let tmpfs = CString::new("tmpfs").expect("no NUL");
    let proc = CString::new("proc").expect("no NUL");
    let opts = CString::new("size=64k").expect("no NUL");
    let hidepid = CString::new("hidepid=invisible").expect("no NUL");
    // SAFETY: the child makes only async-signal-safe raw system calls on pre-built strings and
    // ends with _exit; the parent waits for it.
    unsafe {
        let pid = libc::fork();
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            let ok = libc::unshare(libc::CLONE_NEWNS) == 0
                && libc::mount(
                    std::ptr::null(),
                    slash.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) == 0
                && libc::mount(
                    tmpfs.as_ptr(),
                    tmp.as_ptr(),
                    tmpfs.as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    opts.as_ptr().cast(),
                ) == 0
                && libc::mkdir(c"/tmp/p".as_ptr(), 0o755) == 0
                && libc::mount(
                    proc.as_ptr(),
                    c"/tmp/p".as_ptr(),
                    proc.as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    hidepid.as_ptr().cast(),
                ) == 0;
            libc::_exit(if ok { 0 } else { 1 });
        }
        let mut status = 0;
        if libc::waitpid(pid, &mut status, 0) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_synthesized_proc_stat_has_the_hosts_fields_and_no_counts() {
        let s = synthesized_proc_stat();
        let first = s.lines().next().unwrap();
        let host = std::fs::read_to_string("/proc/stat").unwrap();
        let host_first = host.lines().next().unwrap();
        assert_eq!(
            first.split_whitespace().count(),
            host_first.split_whitespace().count()
        );
        assert!(first.starts_with("cpu  0 0"), "{first}");
        assert!(
            s.lines()
                .filter(|l| l.starts_with("cpu"))
                .all(|l| l.split_whitespace().skip(1).all(|f| f == "0")),
            "{s}"
        );
        assert!(
            s.contains("\nbtime ") && s.contains("procs_running 1"),
            "{s}"
        );
    }

    use super::*;

    /// A plan of a native worker with a mount namespace and no identity change.
    fn plan(
        session_dir: PathBuf,
        read_paths: Vec<PathBuf>,
        exec_paths: Vec<PathBuf>,
        write_paths: &[&str],
    ) -> Plan {
        Plan {
            uid: None,
            gid: None,
            session_dir,
            read_paths,
            exec_paths,
            write_paths: write_paths.iter().map(PathBuf::from).collect(),
            keep_fds: vec![],
            max_open_files: 64,
            max_file_bytes: 1,
            max_processes: 1,
            max_address_space: None,
            new_net_namespace: false,
            new_ipc_namespace: false,
            syscalls: crate::SyscallProfile::Native,
            enforcement: crate::Enforcement::BestEffort,
            landlock_abi_cap: None,
            mount_namespace: true,
            tcp_connect_port: None,
            net_namespace_entered: false,
        }
    }

    #[test]
    fn a_writable_private_tmp_hides_no_session_directory_below_it() {
        let dir = PathBuf::from(format!(
            "/var/tmp/sandcell-mounts-tmp-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(dir.join("session")).unwrap();
        let plan = plan(
            dir.join("session"),
            vec![],
            vec![],
            &["/dev/null", "/tmp", "/var/tmp", "/dev/shm"],
        );
        let entries = collect(&plan).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let binds: Vec<_> = entries
            .iter()
            .filter(|e| matches!(e.kind, Kind::Bind { .. }))
            .map(|e| e.path.clone())
            .collect();
        // The session directory, and again at /mnt/data (the working directory cells see).
        assert_eq!(binds, vec![PathBuf::from("/mnt/data"), dir.join("session")]);
        for t in TMPFS {
            assert!(
                entries
                    .iter()
                    .any(|e| e.path == Path::new(t) && matches!(e.kind, Kind::Tmpfs(_))),
                "{t}"
            );
        }
    }

    #[test]
    fn symlinked_and_nested_paths_collapse() {
        let dir = std::env::temp_dir().join(format!("sandcell-mounts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("usr/lib/sub")).unwrap();
        std::os::unix::fs::symlink("usr/lib", dir.join("lib")).unwrap();
        std::fs::create_dir_all(dir.join("session")).unwrap();
        let plan = plan(
            dir.join("session"),
            vec![dir.join("usr/lib"), dir.join("lib"), dir.join("missing")],
            vec![dir.join("usr/lib/sub"), "/proc/self".into()],
            &["/dev/null"],
        );
        let entries = collect(&plan).unwrap();
        let binds: Vec<_> = entries
            .iter()
            .filter_map(|e| match &e.kind {
                Kind::Bind { writable, .. } => Some((e.path.clone(), *writable)),
                _ => None,
            })
            .collect();
        // usr/lib once (the symlink and the nested path collapse into it), the session rw,
        // also at /mnt/data.
        assert_eq!(
            binds,
            vec![
                (PathBuf::from("/mnt/data"), true),
                (dir.join("session"), true),
                (dir.join("usr/lib"), false)
            ]
        );
        assert!(entries.iter().any(|e| e.path == dir.join("lib")
            && matches!(&e.kind, Kind::Symlink(t) if t == Path::new("usr/lib"))));
        // Parents come before their children.
        let dev = entries
            .iter()
            .position(|e| e.path == Path::new("/dev"))
            .unwrap();
        let null = entries
            .iter()
            .position(|e| e.path == Path::new("/dev/null"))
            .unwrap();
        assert!(dev < null);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_session_directory_with_a_files_directory_is_bound_at_mnt() {
        let dir =
            std::env::temp_dir().join(format!("sandcell-mounts-split-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("session").join(MNT_FILES)).unwrap();
        std::fs::create_dir_all(dir.join("session").join(MNT_SCRATCH)).unwrap();
        let plan = plan(dir.join("session"), vec![], vec![], &["/dev/null"]);
        let entries = collect(&plan).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let binds: Vec<_> = entries
            .iter()
            .filter(|e| matches!(e.kind, Kind::Bind { .. }))
            .map(|e| e.path.clone())
            .collect();
        // /mnt/data is the files, /mnt/tmp the scratch beside them, on one mount.
        assert_eq!(binds, vec![PathBuf::from("/mnt"), dir.join("session")]);
    }
}
