//! Opening a path without following a symlink: `openat2(2)` where the kernel and the sandbox
//! allow it, an equivalent component-by-component walk where they do not.
//!
//! Every path the daemon opens on a hostile tenant's behalf (a session directory's files,
//! [`crate::files`]) or in a directory it must trust (the metrics file, [`crate::metrics`])
//! goes through [`open`]. With [`Scope::Beneath`] it is what
//! `openat2(dir, path, how{flags, mode, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS})` does (openat2(2), Linux 5.6): nothing outside `dir`, no symlink
//! and no /proc magic link is ever followed; with [`Scope::Anywhere`] the same without
//! `RESOLVE_BENEATH` (an absolute path, or `..` above the start, is allowed).
//!
//! # Why a fallback
//!
//! openat2 is refused in places the daemon runs: systemd's `RestrictSUIDSGID=yes` (in
//! sandcelld.service) cannot see the mode inside openat2's `struct open_how` (seccomp sees
//! only registers), so it makes openat2 fail with `ENOSYS` for the whole unit, so that libc
//! falls back to openat (systemd.exec(5), `RestrictSUIDSGID=`; systemd's
//! `seccomp_restrict_suid_sgid`). Other seccomp sandboxes answer it with `EPERM`
//! (`SystemCallErrorNumber=EPERM` for a system call outside `SystemCallFilter=`), and kernels
//! before 5.6 with `ENOSYS`.
//!
//! # The walk
//!
//! Where openat2 is refused, [`open`] walks the path from `dir` one component at a time:
//! each component is opened with `openat(cur, component, O_PATH | O_NOFOLLOW | O_CLOEXEC)`
//! and checked with `fstat` on the descriptor it got (a symlink, magic links included,
//! is `ELOOP`; anything but a directory before the last component is `ENOTDIR`), so what is
//! checked is what the next step walks from, however the tree changes meanwhile. `.` is
//! skipped; `..` goes back to the descriptor the walk held for the parent (never re-resolved,
//! so a directory moved elsewhere meanwhile cannot lead out), and with [`Scope::Beneath`]
//! `..` above `dir` or an absolute path is `EXDEV`, as openat2 answers. The last component is
//! opened with the caller's flags plus `O_NOFOLLOW` relative to its parent's descriptor (a
//! symlink there is `ELOOP`, an `O_PATH | O_NOFOLLOW` open gets the link itself, as with
//! openat2); nothing is ever reopened through `/proc/self/fd`. The refusals and their errors
//! (`ELOOP`, `EXDEV`, `ENOTDIR`, `ENOENT`, the final open's own) are openat2's, so callers
//! map errors the same way in both modes (the unit tests run both on the same cases).
//!
//! Why not the `pathrs` crate (libpathrs, which has an emulated resolver beside openat2;
//! 0.2.6 builds here, pure Rust): its resolver has `RESOLVE_IN_ROOT` semantics (`..` and absolute symlinks are clamped to the
//! root instead of refused), its emulated mode checks every step and reopens `O_PATH`
//! handles through procfs (`/proc/self/fd`, a handle it mounts with `fsopen`/`open_tree`),
//! which the workers' own seccomp filters and hidepid mounts may refuse, and it reports its
//! own error type rather than the errno callers already map. The walk needs nothing but
//! openat and fstat.
//!
//! # When the walk is used
//!
//! Once per process a probe (`openat2(AT_FDCWD, "/", O_PATH | O_DIRECTORY,
//! RESOLVE_NO_SYMLINKS)`) decides: success means openat2 works; `ENOSYS`, `EPERM`, `E2BIG`
//! or `EINVAL` mean it is refused for good and every later call walks. Any other probe error
//! (`EMFILE`, `ENOMEM`, `EINTR`, ...) is transient: that call walks, and the next one probes
//! again. Where openat2 works, `EAGAIN` (a rename or mount somewhere on the host during
//! the lookup, which `RESOLVE_BENEATH` refuses to risk; a tenant can cause it at will) is
//! retried a few times and then walked, and a later `ENOSYS` (a seccomp filter installed
//! after the probe) walks too and marks openat2 refused.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};

/// Where a path may lead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Beneath the starting directory only (`RESOLVE_BENEATH`): an absolute path or a `..`
    /// above it is `EXDEV`.
    Beneath,
    /// Anywhere (an absolute path resolves from the process's root); still no symlink.
    Anywhere,
}

/// How [`open`] resolves: `0` not probed yet, [`KERNEL`] openat2, [`WALK`] the walk.
static MODE: AtomicU8 = AtomicU8::new(0);
const KERNEL: u8 = 1;
const WALK: u8 = 2;
/// Tries of openat2 that answer `EAGAIN` before one call walks instead.
const EAGAIN_TRIES: usize = 4;

/// Opens `path` relative to `dir` (`AT_FDCWD` allowed) with `flags | O_CLOEXEC` (`mode` for
/// `O_CREAT`), following no symlink and no magic link anywhere, within `scope`.
///
/// Errors are openat2's with `RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` (plus
/// `RESOLVE_BENEATH` for [`Scope::Beneath`]) in either mode: `ELOOP` for a symlink on the
/// way or at the end (except that `O_PATH | O_NOFOLLOW` opens a final symlink itself),
/// `EXDEV` for a way out of a [`Scope::Beneath`] directory, `ENOTDIR`, `ENOENT`, an empty
/// path `ENOENT`, a path with NUL `EINVAL`, and the final open's own (`EACCES`, `EISDIR`,
/// ...).
pub fn open(
    dir: BorrowedFd<'_>,
    path: &Path,
    flags: i32,
    mode: u32,
    scope: Scope,
) -> io::Result<OwnedFd> {
    if decide() == "undecided" {
        return walk(dir, path, flags, mode, scope);
    }
    if MODE.load(Ordering::Relaxed) == WALK {
        return walk(dir, path, flags, mode, scope);
    }
    for _ in 0..EAGAIN_TRIES {
        match kernel(dir, path, flags, mode, scope) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                MODE.store(WALK, Ordering::Relaxed);
                break;
            }
            r => return r,
        }
    }
    walk(dir, path, flags, mode, scope)
}

/// Decides now how [`open`] resolves (probing once, as its first call would) and names it,
/// for the start-up log: `"openat2"` or `"walk"` (openat2 refused), `"undecided"` after a
/// transient probe error (the next call probes again).
pub fn decide() -> &'static str {
    if MODE.load(Ordering::Relaxed) == 0 {
        match probe() {
            Some(true) => MODE.store(KERNEL, Ordering::Relaxed),
            Some(false) => MODE.store(WALK, Ordering::Relaxed),
            None => {}
        }
    }
    match uses_openat2() {
        Some(true) => "openat2",
        Some(false) => "walk",
        None => "undecided",
    }
}

/// Whether [`open`] uses openat2 (`Some(true)`), the walk (`Some(false)`), or has not decided
/// yet (`None`). For start-up logs and tests.
pub fn uses_openat2() -> Option<bool> {
    match MODE.load(Ordering::Relaxed) {
        KERNEL => Some(true),
        WALK => Some(false),
        _ => None,
    }
}

/// `Some(true)`: openat2 works; `Some(false)`: refused for good; `None`: unknown (a transient
/// error).
fn probe() -> Option<bool> {
    match kernel(
        cwd(),
        Path::new("/"),
        libc::O_PATH | libc::O_DIRECTORY,
        0,
        Scope::Anywhere,
    ) {
        Ok(_) => Some(true),
        Err(e) => match e.raw_os_error() {
            Some(libc::ENOSYS | libc::EPERM | libc::E2BIG | libc::EINVAL) => Some(false),
            _ => None,
        },
    }
}

/// The descriptor `AT_FDCWD` (the working directory), for [`open`] with [`Scope::Anywhere`]
/// and an absolute path.
pub fn cwd() -> BorrowedFd<'static> {
    // SAFETY: AT_FDCWD is never closed; it only ever reaches *at system calls.
    unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) }
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// openat2 itself, no fallback.
#[doc(hidden)]
pub fn kernel(
    dir: BorrowedFd<'_>,
    path: &Path,
    flags: i32,
    mode: u32,
    scope: Scope,
) -> io::Result<OwnedFd> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let mut resolve = ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS;
    if scope == Scope::Beneath {
        resolve |= ResolveFlag::RESOLVE_BENEATH;
    }
    let how = OpenHow::new()
        .flags(OFlag::from_bits_retain(flags | libc::O_CLOEXEC))
        .mode(nix::sys::stat::Mode::from_bits_retain(mode))
        .resolve(resolve);
    let c = cpath(path)?;
    Ok(nix::fcntl::openat2(dir, c.as_c_str(), how)?)
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)`.
fn openat(dir: BorrowedFd<'_>, name: &[u8], flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| errno(libc::EINVAL))?;
    // SAFETY: a valid C string and directory descriptor; the result is a fresh descriptor.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a descriptor this process now owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn file_type(fd: BorrowedFd<'_>) -> io::Result<libc::mode_t> {
    Ok(nix::sys::stat::fstat(fd)?.st_mode & libc::S_IFMT)
}

/// The walk (see the module documentation), no openat2.
#[doc(hidden)]
pub fn walk(
    dir: BorrowedFd<'_>,
    path: &Path,
    flags: i32,
    mode: u32,
    scope: Scope,
) -> io::Result<OwnedFd> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() {
        return Err(errno(libc::ENOENT));
    }
    if bytes.contains(&0) {
        return Err(errno(libc::EINVAL));
    }
    if bytes.len() >= libc::PATH_MAX as usize {
        return Err(errno(libc::ENAMETOOLONG));
    }
    let absolute = bytes[0] == b'/';
    if absolute && scope == Scope::Beneath {
        return Err(errno(libc::EXDEV));
    }
    // A trailing `/` (or `/.`) asks for a directory, as path resolution does.
    let trailing_dir = bytes.ends_with(b"/") || bytes.ends_with(b"/.") || bytes == b".";
    let parts: Vec<&[u8]> = bytes
        .split(|b| *b == b'/')
        .filter(|p| !p.is_empty() && *p != b".")
        .collect();
    // The directories walked so far, innermost last; empty: `dir` itself.
    let mut stack: Vec<OwnedFd> = Vec::new();
    if absolute {
        stack.push(openat(
            dir,
            b"/",
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        )?);
    }
    // How many of `stack` a `..` may not pop (the start); with Scope::Beneath a `..` there
    // is EXDEV.
    let mut floor = stack.len();
    let Some((last, inner)) = parts.split_last() else {
        // "." or "/": the start itself, opened with the caller's flags.
        return openat(top(dir, &stack), b".", flags, mode);
    };
    for p in inner {
        step(dir, &mut stack, &mut floor, p, scope)?;
    }
    if *last == b".." || trailing_dir {
        // A directory is asked for: walk into it as into any other, then open it.
        step(dir, &mut stack, &mut floor, last, scope)?;
        return openat(top(dir, &stack), b".", flags, mode);
    }
    let fd = openat(top(dir, &stack), last, flags | libc::O_NOFOLLOW, mode)?;
    if flags & libc::O_PATH != 0 && flags & libc::O_NOFOLLOW == 0 {
        // Without O_NOFOLLOW, openat2 refuses a final symlink even for O_PATH.
        if file_type(fd.as_fd())? == libc::S_IFLNK {
            return Err(errno(libc::ELOOP));
        }
    }
    Ok(fd)
}

/// The directory the walk is in.
fn top<'a>(dir: BorrowedFd<'a>, stack: &'a [OwnedFd]) -> BorrowedFd<'a> {
    stack.last().map(|f| f.as_fd()).unwrap_or(dir)
}

/// One component: `..` back to the held parent, anything else opened with
/// `O_PATH | O_NOFOLLOW` and checked to be a directory.
fn step(
    dir: BorrowedFd<'_>,
    stack: &mut Vec<OwnedFd>,
    floor: &mut usize,
    part: &[u8],
    scope: Scope,
) -> io::Result<()> {
    if part == b".." {
        if stack.len() > *floor {
            stack.pop();
            return Ok(());
        }
        if scope == Scope::Beneath {
            return Err(errno(libc::EXDEV));
        }
        // Above the start with Scope::Anywhere: the kernel's own `..` (never a symlink),
        // which becomes the new start.
        let up = openat(top(dir, stack), b"..", libc::O_PATH | libc::O_DIRECTORY, 0)?;
        stack.push(up);
        *floor = stack.len();
        return Ok(());
    }
    let fd = openat(top(dir, stack), part, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
    match file_type(fd.as_fd())? {
        libc::S_IFDIR => {
            stack.push(fd);
            Ok(())
        }
        libc::S_IFLNK => Err(errno(libc::ELOOP)),
        _ => Err(errno(libc::ENOTDIR)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// What an open came to: the file's type, device and inode, or the errno.
    #[derive(Debug, PartialEq, Eq)]
    enum Outcome {
        Opened(libc::mode_t, u64, u64),
        Failed(i32),
    }

    fn outcome(r: io::Result<OwnedFd>) -> Outcome {
        match r {
            Ok(fd) => {
                let st = nix::sys::stat::fstat(&fd).expect("fstat");
                Outcome::Opened(st.st_mode & libc::S_IFMT, st.st_dev, st.st_ino)
            }
            Err(e) => Outcome::Failed(e.raw_os_error().expect("an errno")),
        }
    }

    /// A tree with every case: files, deep directories, symlinks in and out, a dangling one,
    /// a FIFO, a socket-less special file.
    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().expect("tempdir");
        let r = t.path();
        std::fs::create_dir_all(r.join("d/e/f/g/h/i/j/k")).unwrap();
        std::fs::write(r.join("f"), b"x").unwrap();
        std::fs::write(r.join("d/e/f/g/h/i/j/k/deep"), b"x").unwrap();
        std::fs::write(r.join("d/file"), b"x").unwrap();
        symlink("f", r.join("link")).unwrap();
        symlink("d", r.join("dlink")).unwrap();
        symlink("/etc", r.join("out")).unwrap();
        symlink("../../..", r.join("d/up")).unwrap();
        symlink("nowhere", r.join("dangling")).unwrap();
        nix::unistd::mkfifo(
            &r.join("fifo"),
            nix::sys::stat::Mode::from_bits_retain(0o600),
        )
        .unwrap();
        t
    }

    const PATHS: &[&str] = &[
        "f",
        "./f",
        "d//file",
        "d/file",
        "d/file/",
        "d/e/f/g/h/i/j/k/deep",
        "d/e/f/g/h/i/j/k/",
        "missing",
        "d/missing/x",
        "f/x",
        "link",
        "link/x",
        "dlink",
        "dlink/file",
        "out",
        "out/passwd",
        "d/up",
        "d/up/etc",
        "dangling",
        "fifo",
        "..",
        "../x",
        "d/..",
        "d/../f",
        "d/../../f",
        "d/e/../../f",
        ".",
        "./",
        "d/.",
        "/etc",
        "/etc/passwd",
        "/",
        "",
        "/proc/self/root",
        "/proc/self/root/etc",
        "/proc/self/cwd",
        "/proc/self/fd/0",
        "/proc/self/exe",
    ];

    const FLAGS: &[i32] = &[
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        libc::O_RDONLY | libc::O_NONBLOCK,
        libc::O_PATH | libc::O_NOFOLLOW,
        libc::O_PATH,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
    ];

    /// Runs openat2 and the walk on every case and returns the cases where they differ.
    fn differences(root: BorrowedFd<'_>) -> Vec<String> {
        let mut out = Vec::new();
        for scope in [Scope::Beneath, Scope::Anywhere] {
            for &flags in FLAGS {
                for p in PATHS {
                    let k = outcome(kernel(root, Path::new(p), flags, 0, scope));
                    let w = outcome(walk(root, Path::new(p), flags, 0, scope));
                    if k != w {
                        out.push(format!(
                            "{p:?} {scope:?} flags {flags:#o}: openat2 {k:?}, walk {w:?}"
                        ));
                    }
                }
            }
        }
        out
    }

    fn kernel_has_openat2() -> bool {
        if probe() == Some(true) {
            return true;
        }
        eprintln!(
            "skipped: openat2 is refused here (old kernel or a seccomp filter), nothing to compare the walk with"
        );
        false
    }

    #[test]
    fn walk_matches_openat2_on_every_case() {
        if !kernel_has_openat2() {
            return;
        }
        let t = tree();
        let root: OwnedFd = std::fs::File::open(t.path()).unwrap().into();
        let d = differences(root.as_fd());
        assert!(
            d.is_empty(),
            "openat2 and the walk differ:\n{}",
            d.join("\n")
        );
    }

    #[test]
    fn walk_matches_openat2_on_magic_links() {
        if !kernel_has_openat2() {
            return;
        }
        // /proc/self's entries: root, cwd, exe and fd/N are magic links.
        let proc: OwnedFd = std::fs::File::open("/proc/self").unwrap().into();
        for scope in [Scope::Beneath, Scope::Anywhere] {
            for &flags in FLAGS {
                for p in [
                    "root", "root/etc", "cwd", "exe", "fd/0", "fd", "status", "../self",
                ] {
                    let k = outcome(kernel(proc.as_fd(), Path::new(p), flags, 0, scope));
                    let w = outcome(walk(proc.as_fd(), Path::new(p), flags, 0, scope));
                    assert_eq!(k, w, "{p:?} {scope:?} flags {flags:#o}");
                }
            }
        }
        // And they are refused, not followed.
        let e = walk(
            proc.as_fd(),
            Path::new("root/etc"),
            libc::O_PATH,
            0,
            Scope::Beneath,
        );
        assert_eq!(e.unwrap_err().raw_os_error(), Some(libc::ELOOP));
    }

    #[test]
    fn walk_refuses_what_openat2_refuses() {
        let t = tree();
        let root: OwnedFd = std::fs::File::open(t.path()).unwrap().into();
        let err = |p: &str, scope| {
            walk(
                root.as_fd(),
                Path::new(p),
                libc::O_RDONLY | libc::O_NOFOLLOW,
                0,
                scope,
            )
            .unwrap_err()
            .raw_os_error()
        };
        assert_eq!(err("link", Scope::Beneath), Some(libc::ELOOP));
        assert_eq!(err("dlink/file", Scope::Beneath), Some(libc::ELOOP));
        assert_eq!(err("out/passwd", Scope::Anywhere), Some(libc::ELOOP));
        assert_eq!(err("..", Scope::Beneath), Some(libc::EXDEV));
        assert_eq!(err("d/../../f", Scope::Beneath), Some(libc::EXDEV));
        assert_eq!(err("/etc/passwd", Scope::Beneath), Some(libc::EXDEV));
        assert_eq!(err("f/x", Scope::Beneath), Some(libc::ENOTDIR));
        assert_eq!(err("d/missing/x", Scope::Beneath), Some(libc::ENOENT));
        assert_eq!(err("", Scope::Beneath), Some(libc::ENOENT));
        let long = "a/".repeat(libc::PATH_MAX as usize);
        assert_eq!(err(&long, Scope::Beneath), Some(libc::ENAMETOOLONG));
        let ok = walk(
            root.as_fd(),
            Path::new("d/e/f/g/h/i/j/k/deep"),
            libc::O_RDONLY,
            0,
            Scope::Beneath,
        );
        assert_eq!(file_type(ok.unwrap().as_fd()).unwrap(), libc::S_IFREG);
    }

    /// Environment variable naming the errno the re-executed test answers openat2 with.
    const CHILD: &str = "SANDCELL_RESOLVE_TEST_OPENAT2_ERRNO";

    /// Installs a seccomp filter answering openat2 with `err` (what systemd's
    /// RestrictSUIDSGID= and SystemCallErrorNumber= do), for this process.
    fn refuse_openat2(err: i32) {
        #[cfg(target_arch = "x86_64")]
        const ARCH: u32 = 0xc000_003e;
        #[cfg(target_arch = "aarch64")]
        const ARCH: u32 = 0xc000_00b7;
        let stmt = |code: u32, k: u32| libc::sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        };
        let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt,
            jf,
            k,
        };
        let ld = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u32;
        let ret = (libc::BPF_RET | libc::BPF_K) as u32;
        let mut prog = [
            stmt(ld, 4), // seccomp_data.arch
            jeq(ARCH, 0, 2),
            stmt(ld, 0), // seccomp_data.nr
            jeq(libc::SYS_openat2 as u32, 1, 0),
            stmt(ret, libc::SECCOMP_RET_ALLOW),
            stmt(ret, libc::SECCOMP_RET_ERRNO | err as u32),
        ];
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_mut_ptr(),
        };
        // SAFETY: plain prctl calls with a valid, live filter program.
        unsafe {
            assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
            assert_eq!(
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &fprog as *const _
                ),
                0,
                "seccomp: {}",
                io::Error::last_os_error()
            );
        }
    }

    /// Under a seccomp filter refusing openat2 (re-executed in a child process, so the filter
    /// binds nothing else), [`open`] walks and gives what it gives where openat2 works.
    #[test]
    fn open_walks_where_seccomp_refuses_openat2() {
        if let Ok(err) = std::env::var(CHILD) {
            let err: i32 = err.parse().unwrap();
            let t = tree();
            let root: OwnedFd = std::fs::File::open(t.path()).unwrap().into();
            // Before the filter: what openat2 gives.
            let mut want = Vec::new();
            for p in PATHS {
                want.push(outcome(kernel(
                    root.as_fd(),
                    Path::new(p),
                    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
                    0,
                    Scope::Beneath,
                )));
            }
            refuse_openat2(err);
            assert_eq!(
                kernel(
                    root.as_fd(),
                    Path::new("f"),
                    libc::O_RDONLY,
                    0,
                    Scope::Beneath
                )
                .unwrap_err()
                .raw_os_error(),
                Some(err),
                "the filter refuses openat2"
            );
            for (p, w) in PATHS.iter().zip(want) {
                let got = outcome(open(
                    root.as_fd(),
                    Path::new(p),
                    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
                    0,
                    Scope::Beneath,
                ));
                assert_eq!(got, w, "{p:?}");
            }
            assert_eq!(uses_openat2(), Some(false));
            return;
        }
        if !kernel_has_openat2() {
            return;
        }
        for err in [libc::ENOSYS, libc::EPERM] {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args([
                    "--exact",
                    "resolve::tests::open_walks_where_seccomp_refuses_openat2",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, err.to_string())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "child with openat2 -> errno {err}: {text}"
            );
            assert!(text.contains("1 passed"), "the child ran the test: {text}");
        }
    }
}
