//! What both backends need from the host: mount and membership tables, cgroup-file I/O that
//! never follows symlinks and never leaks a descriptor, and a race-free kill loop.
//!
//! Every path read here hangs off a [`Host`] so tests can point it at a temporary directory
//! (the style of Firecracker's `cgroup.rs`, which takes the mounts file as a parameter).

use super::Error;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the kernel's process tables live (`/proc` normally; a fixture in tests).
#[derive(Debug, Clone)]
pub struct Host {
    /// Root of procfs.
    pub proc_root: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Host {
            proc_root: PathBuf::from("/proc"),
        }
    }
}

/// One line of `/proc/self/mountinfo` that mounts a cgroup file system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Which part of the hierarchy is visible there (`/` unless in a container).
    pub root: String,
    /// `cgroup2` or `cgroup`.
    pub fstype: String,
    /// Super options: the v1 controllers (`memory`, `cpu,cpuacct`, `name=systemd`) and flags.
    pub options: Vec<String>,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(digits, 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text (proc(5)): `id parent major:minor root mount_point options
/// [optional fields...] - fstype source super_options`; returns the cgroup mounts.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        if left.len() < 5 || right.len() < 3 {
            continue;
        }
        let fstype = right[0];
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        mounts.push(CgroupMount {
            mount_point: PathBuf::from(unescape(left[4])),
            root: unescape(left[3]),
            fstype: fstype.to_owned(),
            options: right[2].split(',').map(str::to_owned).collect(),
        });
    }
    mounts
}

/// One line of `/proc/<pid>/cgroup`: `hierarchy-id:controllers:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Hierarchy id (0 for cgroup2).
    pub id: u32,
    /// Controllers of the hierarchy (empty for cgroup2).
    pub controllers: Vec<String>,
    /// Path of the group, relative to the hierarchy root.
    pub path: String,
}

/// Parses `/proc/<pid>/cgroup` text.
pub fn parse_proc_cgroup(text: &str) -> Vec<Membership> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.splitn(3, ':');
            let id = it.next()?.parse().ok()?;
            let ctl = it.next()?;
            let path = it.next()?.to_owned();
            let controllers = if ctl.is_empty() {
                Vec::new()
            } else {
                ctl.split(',').map(str::to_owned).collect()
            };
            Some(Membership {
                id,
                controllers,
                path,
            })
        })
        .collect()
}

impl Host {
    /// Cgroup mounts of this process's mount namespace.
    pub fn mounts(&self) -> Result<Vec<CgroupMount>, Error> {
        let path = self.proc_root.join("self/mountinfo");
        Ok(parse_mountinfo(&read(&path, "read mount table")?))
    }

    /// Whether any swap device is active (`/proc/swaps` lists more than its header). A kernel
    /// without swap support has no `/proc/swaps`: no swap.
    pub fn swap_active(&self) -> bool {
        read(&self.proc_root.join("swaps"), "read")
            .map(|t| t.lines().skip(1).any(|l| !l.trim().is_empty()))
            .unwrap_or(false)
    }

    /// Memberships of `pid` (`None`: this process).
    pub fn memberships(&self, pid: Option<u32>) -> Result<Vec<Membership>, Error> {
        let path = match pid {
            Some(p) => self.proc_root.join(p.to_string()).join("cgroup"),
            None => self.proc_root.join("self/cgroup"),
        };
        Ok(parse_proc_cgroup(&read(&path, "read cgroup membership")?))
    }
}

/// Opens `path` for reading without following a symlink in its last component; close-on-exec
/// (std sets `O_CLOEXEC` on every open), so no cgroup descriptor can reach a worker.
pub fn read(path: &Path, op: &str) -> Result<String, Error> {
    let mut s = String::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| f.read_to_string(&mut s))
        .map_err(|source| Error::Io {
            op: op.into(),
            path: path.into(),
            source,
        })?;
    Ok(s)
}

/// Writes `value` to a cgroup interface file in a single `write(2)` (cgroup files parse each
/// write separately), without following symlinks. Unit tests write regular files, which
/// they create; on cgroupfs the interface files exist or the controller is missing.
pub fn write(path: &Path, value: &str) -> Result<(), Error> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).custom_flags(libc::O_NOFOLLOW);
    if cfg!(test) {
        opts.create(true).truncate(true);
    }
    opts.open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|source| Error::Io {
            op: format!("write {value:?} to"),
            path: path.into(),
            source,
        })
}

/// Reads a key of a flat-keyed file (`memory.events`, `memory.oom_control`, `cgroup.events`).
pub fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Reads a file holding one number (`memory.current`, `memory.peak`, ...).
pub fn number(path: &Path) -> Option<u64> {
    read(path, "read").ok()?.trim().parse().ok()
}

/// Reads one number from offset 0 of an open cgroup file (`pread`, so the descriptor can be
/// read again).
pub fn number_at(file: &std::fs::File) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 32];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// Opens `path` read-write without following symlinks and writes `value` to it in one
/// `write(2)`, keeping the descriptor: for files whose write affects later reads through the
/// same descriptor (`memory.peak` since Linux 6.12).
pub fn open_reset(path: &Path, value: &str) -> Result<std::fs::File, Error> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(true).custom_flags(libc::O_NOFOLLOW);
    if cfg!(test) {
        opts.create(true);
    }
    opts.open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()).map(|()| f))
        .map_err(|source| Error::Io {
            op: format!("write {value:?} to"),
            path: path.into(),
            source,
        })
}

/// Creates directory `path`; an existing one is an error unless `exist_ok`.
pub fn mkdir(path: &Path, exist_ok: bool) -> Result<(), Error> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e)
            if exist_ok && e.kind() == std::io::ErrorKind::AlreadyExists && is_real_dir(path) =>
        {
            Ok(())
        }
        Err(source) => Err(Error::Io {
            op: "create".into(),
            path: path.into(),
            source,
        }),
    }
}

/// Whether `path` is a directory and not a symlink to one.
pub fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path)
        .map(|m| m.is_dir())
        .unwrap_or(false)
}

/// Subdirectories of `dir` (symlinks excluded), by name; empty if `dir` does not exist.
pub fn subdirs(dir: &Path) -> Result<Vec<String>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Io {
                op: "list".into(),
                path: dir.into(),
                source,
            });
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| Error::Io {
            op: "list".into(),
            path: dir.into(),
            source,
        })?;
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if let (true, Some(name)) = (is_dir, entry.file_name().to_str()) {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Removes the (empty) group directory `path`, retrying for up to `patience` while the kernel
/// still counts exiting tasks (`EBUSY`). A missing directory is fine.
pub fn rmdir(path: &Path, patience: Duration) -> Result<(), Error> {
    let start = Instant::now();
    loop {
        match std::fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < patience => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(source) => {
                return Err(Error::Io {
                    op: "remove".into(),
                    path: path.into(),
                    source,
                });
            }
        }
    }
}

/// The pids listed in `cgroup.procs` files (deduplicated).
pub fn listed_pids(procs_files: &[PathBuf]) -> Vec<u32> {
    let mut pids: Vec<u32> = procs_files
        .iter()
        .filter_map(|f| read(f, "read").ok())
        .flat_map(|s| {
            s.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Sends SIGKILL to `pid` only if, once pinned by a pidfd, it is still a member
/// (`is_member`). Reading `cgroup.procs` and killing by pid races with the pid being reused
/// by an unrelated process; a pidfd pins the process, and the membership check after pinning
/// tells whether the pinned process is ours. Returns whether a signal was sent.
pub fn kill_if_member(pid: u32, is_member: &dyn Fn(u32) -> bool) -> bool {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor (always
    // close-on-exec) or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
    if fd < 0 {
        return false; // gone already (ESRCH)
    }
    // SAFETY: fd was just returned by pidfd_open and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    if !is_member(pid) {
        return false;
    }
    // SAFETY: pidfd is a valid pidfd; no siginfo; flags 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    rc == 0
}

/// Kills every process listed in `procs_files` (re-reading them, since a process may fork
/// while it is being killed) until they list none or `timeout` passes.
///
/// Errors: [`Error::Verify`] if processes remain after `timeout`.
pub fn kill_loop(
    procs_files: &[PathBuf],
    is_member: &dyn Fn(u32) -> bool,
    timeout: Duration,
) -> Result<(), Error> {
    let start = Instant::now();
    loop {
        let pids = listed_pids(procs_files);
        if pids.is_empty() {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(Error::Verify(format!(
                "{} processes still in {} after {timeout:?}: {pids:?}",
                pids.len(),
                procs_files
                    .first()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            )));
        }
        for pid in pids {
            kill_if_member(pid, is_member);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether the process behind `pidfd` has exited (its pidfd polls readable).
pub(crate) fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0
}

/// Session keepers (`crate::keeper`) living in session groups: pid and start time. The end
/// of a cell stops every process of its group but the worker and these.
static KEEPERS: std::sync::Mutex<Vec<(u32, u64)>> = std::sync::Mutex::new(Vec::new());

/// Marks the keeper `pid` (started at `start_time`, `/proc/<pid>/stat` field 22) as one that
/// [`kill_others`] spares.
pub fn protect_keeper(pid: u32, start_time: u64) {
    KEEPERS.lock().unwrap().push((pid, start_time));
}

/// Undoes [`protect_keeper`].
pub fn unprotect_keeper(pid: u32) {
    KEEPERS.lock().unwrap().retain(|k| k.0 != pid);
}

/// Whether `pid` is a protected keeper (its start time checked, so a process that reused
/// the pid of a dead keeper is not spared).
pub fn is_keeper(pid: u32) -> bool {
    let Some(&(_, t)) = KEEPERS.lock().unwrap().iter().find(|k| k.0 == pid) else {
        return false;
    };
    crate::keeper::start_time(pid) == Some(t)
}

/// Kills every process listed in `procs_files` except `keep` and the session's keeper (the worker itself), each
/// through a pidfd: `pidfd_open(pid)` pins the process, `is_member` (reading
/// `/proc/<pid>/cgroup` after the pin) confirms the pinned process is still in the group,
/// and only then `pidfd_send_signal(SIGKILL)`. A pid is never signalled bare: between reading
/// `cgroup.procs` and the signal it could have been reused by an unrelated process. If the
/// pinned process died and its pid was reused before the membership check, the check reads
/// the newcomer, and the signal through the pidfd still reaches only the dead original
/// (`ESRCH`). Re-reads the files until no other live process is listed (killed processes
/// cannot fork; new children of not-yet-killed ones are found on the next pass), waiting for
/// each killed process to exit. Returns the processes signalled (zombies until reaped: see
/// [`wait_reaped`]).
///
/// Errors: [`Error::Verify`] if other processes are still alive after `timeout`.
pub fn kill_others(
    procs_files: &[PathBuf],
    keep: u32,
    is_member: &dyn Fn(u32) -> bool,
    timeout: Duration,
) -> Result<Vec<Leftover>, Error> {
    let start = Instant::now();
    let mut signalled: Vec<Leftover> = Vec::new();
    loop {
        let mut alive: Vec<OwnedFd> = Vec::new();
        for pid in listed_pids(procs_files) {
            if pid == keep || is_keeper(pid) {
                continue;
            }
            // SAFETY: pidfd_open takes a pid and flags; returns a new close-on-exec fd or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
            if fd < 0 {
                continue; // gone already
            }
            // SAFETY: fd was just returned by pidfd_open and is owned by nobody else.
            let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            if pidfd_exited(&pidfd) || !is_member(pid) {
                continue;
            }
            // SAFETY: pidfd is a valid pidfd; no siginfo; flags 0.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0u32,
                )
            };
            if rc == 0 {
                signalled.push(Leftover {
                    pid,
                    pidfd: pidfd.try_clone().ok(),
                });
                alive.push(pidfd);
            }
        }
        if alive.is_empty() {
            return Ok(signalled);
        }
        // Wait for the killed ones to be gone before looking again.
        while !alive.iter().all(pidfd_exited) {
            if start.elapsed() >= timeout {
                return Err(Error::Verify(format!(
                    "processes other than the worker still alive in {} after {timeout:?}",
                    procs_files
                        .first()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if start.elapsed() >= timeout {
            return Err(Error::Verify(format!(
                "processes other than the worker keep appearing in {} after {timeout:?}",
                procs_files
                    .first()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            )));
        }
    }
}

/// A process [`kill_others`] killed: its pid, and a pidfd pinning it until it is reaped.
#[derive(Debug)]
pub struct Leftover {
    /// The pid it had.
    pub pid: u32,
    /// Pins the process (its pid cannot be reused while this is open and it is unreaped).
    pub pidfd: Option<OwnedFd>,
}

/// Whether the process behind `pidfd` is gone, reaped by its parent: a zombie still takes a
/// signal (`pidfd_send_signal` of 0 succeeds), a reaped process does not (`ESRCH`).
fn reaped(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd is a valid pidfd; signal 0 only checks; no siginfo; flags 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The parent pid of `pid` (`/proc/<pid>/stat` field 4), if it can be read.
fn parent_of(proc_root: &Path, pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    s[s.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// Waits until every process in `killed` is reaped, at most `timeout`: a killed process is a
/// zombie that still counts against the group's `pids.max` (and holds its uid) until its
/// parent reaps it, which for an orphan is init or a subreaper, in its own time (here up to
/// 2 s). Zombies whose parent is `worker` are not waited for: only the worker can reap its
/// own children. Returns how many were not reaped in time (0: all gone).
pub fn wait_reaped(proc_root: &Path, killed: &[Leftover], worker: u32, timeout: Duration) -> usize {
    let start = Instant::now();
    loop {
        let waiting = killed
            .iter()
            .filter(|l| match &l.pidfd {
                Some(fd) => !reaped(fd) && parent_of(proc_root, l.pid) != Some(worker),
                None => false,
            })
            .count();
        if waiting == 0 || start.elapsed() >= timeout {
            return waiting;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `value` rounded down to the page size, as the kernel stores memory limits.
pub fn page_floor(value: u64) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    value / page * page
}

/// Checks a cgroup name component (a session id, which `sandcell_proto::kernel::SessionId`
/// validates, or the configured `cgroup_name`): 1-64 characters of `[A-Za-z0-9_-]`, so it is
/// one path component whatever its origin.
pub fn check_id(id: &str) -> Result<(), Error> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::Unsupported(format!(
            "session id {id:?} is not 1-64 characters of [A-Za-z0-9_-]"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 31 0:28 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
36 31 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:14 - cgroup cgroup rw,cpu,cpuacct
37 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,nosuid shared:15 - cgroup cgroup rw,memory
38 31 0:33 / /sys/fs/cgroup/with\\040space rw shared:16 - cgroup cgroup rw,pids
";

    #[test]
    fn mountinfo_finds_cgroup_mounts_and_their_controllers() {
        let m = parse_mountinfo(HYBRID);
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0].fstype, "cgroup2");
        assert_eq!(m[0].mount_point, PathBuf::from("/sys/fs/cgroup/unified"));
        assert!(m[2].options.contains(&"cpu".to_string()));
        assert!(m[2].options.contains(&"cpuacct".to_string()));
        assert_eq!(m[3].root, "/docker/abc");
        assert_eq!(m[4].mount_point, PathBuf::from("/sys/fs/cgroup/with space"));
    }

    #[test]
    fn proc_cgroup_lines() {
        let m = parse_proc_cgroup(
            "12:pids:/a/b\n4:cpu,cpuacct:/\n0::/system.slice/x.service\n1:name=systemd:/u\n",
        );
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].controllers, vec!["pids"]);
        assert_eq!(m[0].path, "/a/b");
        assert_eq!(m[1].controllers, vec!["cpu", "cpuacct"]);
        assert_eq!(m[2].id, 0);
        assert!(m[2].controllers.is_empty());
        assert_eq!(m[2].path, "/system.slice/x.service");
    }

    #[test]
    fn keyed_files() {
        let t = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(keyed(t, "oom_kill"), Some(3));
        assert_eq!(keyed(t, "oom"), None);
        assert_eq!(keyed("populated 1\nfrozen 0\n", "populated"), Some(1));
    }

    #[test]
    fn ids_are_single_components() {
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
        check_id("s-1_AB").unwrap();
    }

    #[test]
    fn subdirs_skip_symlinks_and_files() {
        let dir = std::env::temp_dir().join(format!("sandcell-host-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::write(dir.join("f"), "").unwrap();
        std::os::unix::fs::symlink("/", dir.join("link")).unwrap();
        assert_eq!(subdirs(&dir).unwrap(), vec!["a"]);
        assert!(
            mkdir(&dir.join("link"), true).is_err(),
            "a symlink is not an existing group"
        );
        mkdir(&dir.join("a"), true).unwrap();
        assert!(mkdir(&dir.join("a"), false).is_err());
        assert!(read(&dir.join("link"), "read").is_err(), "O_NOFOLLOW");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
