//! The per-session keeper: a small process that holds a session's descriptors while its daemon
//! is gone, so that the session survives the daemon's death and a successor adopts it.
//!
//! After a worker is Ready, the daemon starts `sandcelld keep` ([`SUBCOMMAND`]): its own
//! executable (`/proc/self/exe`), root, in the session's cgroup (charged to the session), in
//! a new session (`setsid`), with one end of a `SOCK_SEQPACKET` socket pair on fd 3 (the
//! *lifeline*). Over it the daemon sends [`HOLD`] with `SCM_RIGHTS` (unix(7)): duplicates of
//! the worker's pidfd, an `O_DIRECTORY` descriptor of the session directory (the session's
//! tmpfs, reachable even from another mount namespace), and the daemon's ends of the worker's
//! pipes (request write end, reply read end, then stdout and stderr read ends of a native
//! worker). The keeper answers [`HELD`] and from then on only waits:
//!
//! - on [`END`] (the daemon ends the session) it exits at once;
//! - when the worker exits (its pidfd turns readable) it exits;
//! - when the lifeline closes without [`END`] (the daemon died, or exited keeping its
//!   sessions) it accepts connections on its socket (bound 0600 at start, in a root-only
//!   directory, so there is no window without it) for at most the adoption timeout
//!   (`adopt_timeout_seconds`). A connecting peer whose `SO_PEERCRED` uid is not 0 is
//!   dropped. To uid 0 it sends [`FDS`] with the same descriptors, and that connection is its
//!   lifeline from then on. Nobody in time: it kills the worker (through its pidfd) and every
//!   other process of the session's cgroup (listed in its `cgroup.procs` files, each pinned
//!   by a pidfd before the signal), releases what only a daemon would otherwise release
//!   ([`release`]: the session's file system, directory, cgroups and record) and exits: no
//!   orphan lives for ever, and nothing of it stays behind when no daemon comes back. A
//!   worker that exits while the keeper waits for an adopter is released the same way.
//!
//! A warm pooled worker's keeper is started in the pool ([`start_warm`]): its first message
//! is [`WARM`] instead of [`HOLD`], and until the daemon sends [`KEEP`] (a session took the
//! worker) a lifeline that closes without [`END`] makes it kill the worker and release at
//! once, since no successor adopts a pooled worker.
//!
//! The keeper holds the worker's pipes open, so the worker never sees end of file on its
//! request pipe while its daemon is away, and its writes wait in the pipe buffers (a worker
//! that fills them blocks until a daemon reads). Everything here is synchronous (poll(2)); it
//! allocates nothing per event, and its resident set is about 1 MiB.

use nix::cmsg_space;
use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, socket, socketpair,
    sockopt,
};
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `argv[1]` of a keeper: `sandcelld keep <session id> <socket> <timeout seconds>
/// <session directory> <cgroup.procs file>...` (not a documented command: only the daemon
/// starts it).
pub const SUBCOMMAND: &str = "keep";

/// The keeper's lifeline descriptor.
pub const LIFELINE_FD: RawFd = 3;

/// Daemon to keeper, with the descriptors: hold them.
pub const HOLD: &[u8] = b"hold";
/// Daemon to keeper, with the descriptors of a warm pooled worker: hold them, but only for a
/// session to come ([`KEEP`]). Until then the worker belongs to no session, so a lifeline
/// that closes without [`END`] ends it at once (a successor adopts no pooled worker).
pub const WARM: &[u8] = b"warm";
/// Daemon to a [`WARM`] keeper, with the session's egress listener when it has one: the
/// worker is a session's now; keep it for an adopter from here on. Answered with [`HELD`].
pub const KEEP: &[u8] = b"keep";
/// Keeper to daemon: the descriptors are held.
pub const HELD: &[u8] = b"held";
/// Daemon to keeper: the session ends; exit now without waiting for an adopter.
pub const END: &[u8] = b"end";
/// Keeper to an adopting daemon, with the descriptors.
pub const FDS: &[u8] = b"fds";

/// The keeper's `oom_score_adj` (`/proc/<pid>/oom_score_adj`, proc(5)): -1000, never chosen
/// by the kernel's OOM killer, and spared by the OOM kill of its session's group.
pub const KEEPER_OOM_SCORE_ADJ: &[u8] = b"-1000";

/// Most descriptors one message carries: pidfd, directory, request, reply, stdout, stderr,
/// egress listener.
pub const MAX_FDS: usize = 7;

/// How long a daemon waits for a keeper's answer (`HELD`, `FDS`).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// The descriptors a keeper holds, in message order.
#[derive(Debug)]
pub struct Held {
    /// The worker's pidfd.
    pub pidfd: OwnedFd,
    /// The session directory (`O_DIRECTORY`).
    pub dir: OwnedFd,
    /// Write end of the worker's request pipe.
    pub requests: OwnedFd,
    /// Read end of the worker's reply pipe.
    pub replies: OwnedFd,
    /// Read ends of a native worker's stdout and stderr.
    pub raw: Option<(OwnedFd, OwnedFd)>,
    /// The session's egress listener (`127.0.0.1:3128` in the worker's network namespace), when
    /// it has egress: a successor grants it to the proxy again.
    pub egress: Option<OwnedFd>,
}

impl Held {
    fn borrowed(&self) -> Vec<RawFd> {
        let mut v = vec![
            self.pidfd.as_raw_fd(),
            self.dir.as_raw_fd(),
            self.requests.as_raw_fd(),
            self.replies.as_raw_fd(),
        ];
        if let Some((o, e)) = &self.raw {
            v.push(o.as_raw_fd());
            v.push(e.as_raw_fd());
        }
        if let Some(l) = &self.egress {
            v.push(l.as_raw_fd());
        }
        v
    }

    /// The descriptors in the order [`Held::borrowed`] sends them: 4, then 2 raw pipes, then
    /// the egress listener (an odd count has it).
    fn from_fds(mut fds: Vec<OwnedFd>) -> std::io::Result<Held> {
        if !(4..=MAX_FDS).contains(&fds.len()) {
            return Err(std::io::Error::other(format!(
                "{} descriptors instead of 4 to {MAX_FDS}",
                fds.len()
            )));
        }
        let egress = if fds.len() % 2 == 1 { fds.pop() } else { None };
        let raw = if fds.len() == 6 {
            let e = fds.pop().unwrap();
            let o = fds.pop().unwrap();
            Some((o, e))
        } else {
            None
        };
        let replies = fds.pop().unwrap();
        let requests = fds.pop().unwrap();
        let dir = fds.pop().unwrap();
        let pidfd = fds.pop().unwrap();
        Ok(Held {
            pidfd,
            dir,
            requests,
            replies,
            raw,
            egress,
        })
    }
}

/// Sends `msg` with `fds` on the seqpacket socket `sock`.
///
/// Errors: `sendmsg(2)` failed.
pub fn send(sock: BorrowedFd<'_>, msg: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let iov = [IoSlice::new(msg)];
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Receives one message of at most 64 bytes and its descriptors (close-on-exec) from `sock`;
/// an empty message is end of file.
///
/// Errors: `recvmsg(2)` failed, or the message or its descriptors were cut.
pub fn recv(sock: BorrowedFd<'_>) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = [0u8; 64];
    let mut space = cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = loop {
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other?,
        }
    };
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: descriptors the kernel just installed in this process for us.
            fds.extend(v.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
        }
    }
    if msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC)
    {
        return Err(std::io::Error::other("message or descriptors cut"));
    }
    let n = msg.bytes;
    Ok((buf[..n].to_vec(), fds))
}

/// `/proc/<pid>/stat` field 22: the process's start time in clock ticks since boot (proc(5));
/// with the pid it names one process for good.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: split after the last.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The pid a pidfd names (`Pid:` of its fdinfo); `None` once the process has exited and been
/// reaped (`-1`).
pub fn pidfd_pid(pidfd: BorrowedFd<'_>) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|&p| p > 0)
        .map(|p| p as u32)
}

fn signal_pidfd(pidfd: BorrowedFd<'_>, signal: libc::c_int) -> bool {
    crate::sys::pidfd_send_signal(pidfd, signal).is_ok()
}

/// poll(2) for input on `fds` for at most `timeout_ms` (-1: no bound); which are readable
/// (or at end of file, or failed). `EINTR` is an empty answer.
///
/// Errors: poll failed otherwise.
fn poll_in(fds: &[BorrowedFd<'_>], timeout_ms: i32) -> std::io::Result<Vec<bool>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` holds `p.len()` valid pollfd structures.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(p.iter().map(|x| x.revents != 0).collect())
}

fn readable(fd: BorrowedFd<'_>) -> bool {
    poll_in(&[fd], 0).is_ok_and(|r| r[0])
}

/// The keeper's side: what `sandcelld keep ...` runs. Never returns.
pub fn main(args: &[String]) -> ! {
    let code = match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandcelld keeper: {e}");
            1
        }
    };
    std::process::exit(code)
}

struct Args {
    session: String,
    socket: PathBuf,
    timeout: Duration,
    /// `<state_dir>/sessions/<id>`, where the daemon mounted the session's tmpfs.
    session_dir: PathBuf,
    procs: Vec<PathBuf>,
}

fn parse(args: &[String]) -> std::io::Result<Args> {
    let bad = || {
        std::io::Error::other(
            "usage: sandcelld keep <session> <socket> <seconds> <session dir> <cgroup.procs>...",
        )
    };
    if args.len() < 4 {
        return Err(bad());
    }
    Ok(Args {
        session: args[0].clone(),
        socket: PathBuf::from(&args[1]),
        timeout: Duration::from_secs(args[2].parse().map_err(|_| bad())?),
        session_dir: PathBuf::from(&args[3]),
        procs: args[4..].iter().map(PathBuf::from).collect(),
    })
}

/// Binds and listens on `path` (mode 0600, a stale socket file replaced).
///
/// Errors: the socket calls failed.
pub fn listen_at(path: &Path) -> std::io::Result<OwnedFd> {
    let s = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let _ = std::fs::remove_file(path);
    bind(s.as_raw_fd(), &UnixAddr::new(path)?)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    listen(&s, Backlog::new(4)?)?;
    Ok(s)
}

fn run(args: &[String]) -> std::io::Result<i32> {
    let a = parse(args)?;
    // SAFETY: fd 3 was placed by the daemon for this process; nothing else owns it.
    let lifeline = unsafe { OwnedFd::from_raw_fd(LIFELINE_FD) };
    let listener = listen_at(&a.socket)?;
    let r = keep(&a, lifeline, &listener);
    let _ = std::fs::remove_file(&a.socket);
    r
}

/// What ended the wait on a lifeline.
#[derive(Debug, PartialEq, Eq)]
enum Wait {
    /// [`END`]: the session ends.
    End,
    /// The worker exited.
    WorkerGone,
    /// The lifeline closed without [`END`].
    Orphaned,
}

fn wait_lifeline(lifeline: BorrowedFd<'_>, pidfd: BorrowedFd<'_>) -> std::io::Result<Wait> {
    loop {
        let p = poll_in(&[lifeline, pidfd], -1)?;
        if p[1] {
            return Ok(Wait::WorkerGone);
        }
        if p[0] {
            return Ok(match recv(lifeline) {
                Ok((m, _)) if m == END => Wait::End,
                Ok((m, _)) if m.is_empty() => Wait::Orphaned,
                Ok(_) => continue,
                Err(_) => Wait::Orphaned,
            });
        }
    }
}

/// What ended a warm keeper's wait.
enum Warmed {
    /// [`KEEP`], with the egress listener when one came.
    Keep(Option<OwnedFd>),
    /// [`END`], the worker's exit, or the lifeline closed: the keeper's work is over.
    Over(Wait),
}

/// A [`WARM`] keeper waits for its worker to become a session's ([`KEEP`]) or to be
/// discarded ([`END`]).
fn wait_warm(lifeline: BorrowedFd<'_>, pidfd: BorrowedFd<'_>) -> std::io::Result<Warmed> {
    loop {
        let p = poll_in(&[lifeline, pidfd], -1)?;
        if p[1] {
            return Ok(Warmed::Over(Wait::WorkerGone));
        }
        if p[0] {
            return Ok(match recv(lifeline) {
                Ok((m, mut fds)) if m == KEEP && fds.len() <= 1 => Warmed::Keep(fds.pop()),
                Ok((m, _)) if m == END => Warmed::Over(Wait::End),
                Ok((m, _)) if m.is_empty() => Warmed::Over(Wait::Orphaned),
                Ok(_) => continue,
                Err(_) => Warmed::Over(Wait::Orphaned),
            });
        }
    }
}

fn keep(a: &Args, lifeline: OwnedFd, listener: &OwnedFd) -> std::io::Result<i32> {
    let (m, fds) = recv(lifeline.as_fd())?;
    if m != HOLD && m != WARM {
        return Err(std::io::Error::other("the daemon did not send hold"));
    }
    let mut held = Held::from_fds(fds)?;
    send(lifeline.as_fd(), HELD, &[])?;
    if m == WARM {
        match wait_warm(lifeline.as_fd(), held.pidfd.as_fd())? {
            Warmed::Keep(egress) => {
                if egress.is_some() {
                    held.egress = egress;
                }
                send(lifeline.as_fd(), HELD, &[])?;
            }
            Warmed::Over(Wait::Orphaned) => {
                // The daemon died with this worker in its pool: no successor adopts it, so
                // it ends now, and what it held is released as for a session nobody adopted.
                kill_session(held.pidfd.as_fd(), &a.procs);
                release(a, held);
                return Ok(0);
            }
            Warmed::Over(_) => return Ok(0),
        }
    }
    let mut lifeline = lifeline;
    loop {
        match wait_lifeline(lifeline.as_fd(), held.pidfd.as_fd())? {
            Wait::End => return Ok(0),
            Wait::WorkerGone => {
                eprintln!("sandcelld keeper: session {}: the worker exited", a.session);
                return Ok(0);
            }
            Wait::Orphaned => {}
        }
        drop(lifeline);
        match adoption(a, &held, listener)? {
            Some(l) => lifeline = l,
            None => {
                // Orphaned, and the worker is gone (ended here or by itself): no daemon will
                // release the session, so the keeper does.
                kill_session(held.pidfd.as_fd(), &a.procs);
                release(a, held);
                return Ok(0);
            }
        }
    }
}

/// Releases what an orphaned session holds once its processes are dead, as a daemon's end of
/// a session would, for a session no daemon came back for:
///
/// 1. its tmpfs on `session_dir` is unmounted (`umount2(2)`, `MNT_DETACH | UMOUNT_NOFOLLOW`),
///    only when the file system mounted there is the one whose directory the daemon handed
///    over (same device and inode as the held descriptor: `fstat(2)` against `lstat(2)`);
/// 2. the descriptors are closed (the last reference to the tmpfs, whose pages are then
///    freed) and the empty mount point removed;
/// 3. the keeper leaves its session's cgroups (writing its pid to the `cgroup.procs` of the
///    first group beside `sessions/` that takes it: the companion unit's `holder/`, the
///    daemon's `supervisor/`, else, on cgroup v1 where any group may hold processes, the
///    parent of `sessions/`) and removes them (`rmdir(2)`, which the kernel refuses while a
///    process is left: a group that is not empty stays);
/// 4. the session's record, cell journal, handed-over reply bytes and keeper socket go from
///    the adoption directory (the socket's grandparent).
///
/// What it trusts: only its own arguments and descriptors, both from the root daemon that
/// started it (the paths are root's: `<state_dir>/sessions`, the session's cgroups, the
/// root-only adoption directory), never a file a tenant can write; every step is
/// best-effort and logged on failure. Privileges: the daemon's (root, `CAP_SYS_ADMIN` for
/// the unmount in its mount namespace, the unit's system-call filter, which allows
/// `@mount`). Under the unit the mount namespace is the daemon's private one
/// (`PrivateMounts=yes`), which ends with its last process anyway; run outside it (tests,
/// development), the tmpfs would otherwise stay mounted in the host's namespace for good.
fn release(a: &Args, held: Held) {
    if same_file(held.dir.as_fd(), &a.session_dir)
        && let Err(e) = crate::session_fs::unmount(&a.session_dir)
    {
        eprintln!(
            "sandcelld keeper: session {}: unmounting {}: {e}",
            a.session,
            a.session_dir.display()
        );
    }
    drop(held);
    if let Err(e) = std::fs::remove_dir(&a.session_dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!(
            "sandcelld keeper: session {}: removing {}: {e}",
            a.session,
            a.session_dir.display()
        );
    }
    leave_and_remove_groups(&a.session, &a.procs);
    if let Some(dir) = a.socket.parent().and_then(Path::parent) {
        crate::records::remove(dir, &a.session);
    }
}

/// Whether `path` (not followed when a symlink) names the file `fd` is open on.
fn same_file(fd: BorrowedFd<'_>, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(held), Ok(there)) = (nix::sys::stat::fstat(fd), std::fs::symlink_metadata(path)) else {
        return false;
    };
    held.st_dev == there.dev() && held.st_ino == there.ino()
}

/// The keeper leaves the session groups named by `procs` (see [`release`]) and removes them.
fn leave_and_remove_groups(session: &str, procs: &[PathBuf]) {
    let me = std::process::id().to_string();
    for p in procs {
        let Some(group) = p.parent() else { continue };
        let Some(home) = group.parent().and_then(Path::parent) else {
            continue;
        };
        let left = [
            home.join(crate::cgroup::v2::HOLDER),
            home.join("supervisor"),
            home.to_path_buf(),
        ]
        .iter()
        .any(|g| crate::cgroup::host::write(&g.join("cgroup.procs"), &me).is_ok());
        if !left {
            eprintln!(
                "sandcelld keeper: session {session}: no group beside {} takes the keeper; {} stays",
                group.display(),
                group.display()
            );
            continue;
        }
        if let Err(e) = crate::cgroup::host::rmdir(group, Duration::from_secs(2)) {
            eprintln!("sandcelld keeper: session {session}: {e}");
        }
    }
}

/// Waits for an adopter for at most the timeout: `Some(new lifeline)`, or `None` when the
/// worker exited or nobody came (then the session's processes are killed).
fn adoption(a: &Args, held: &Held, listener: &OwnedFd) -> std::io::Result<Option<OwnedFd>> {
    let deadline = Instant::now() + a.timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            eprintln!(
                "sandcelld keeper: session {}: no daemon adopted it within {} s; ending it",
                a.session,
                a.timeout.as_secs()
            );
            kill_session(held.pidfd.as_fd(), &a.procs);
            return Ok(None);
        }
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        let p = poll_in(&[listener.as_fd(), held.pidfd.as_fd()], ms)?;
        if p[1] {
            return Ok(None);
        }
        if !p[0] {
            continue;
        }
        let Ok(c) = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) else {
            continue;
        };
        // SAFETY: accept4 returned a new descriptor owned by nobody else.
        let c = unsafe { OwnedFd::from_raw_fd(c) };
        match getsockopt(&c, sockopt::PeerCredentials) {
            Ok(cred) if cred.uid() == 0 => {}
            _ => continue,
        }
        if send(c.as_fd(), FDS, &held.borrowed()).is_ok() {
            return Ok(Some(c));
        }
    }
}

/// Kills the worker through its pidfd, then every process listed in `procs` (each pinned by
/// a pidfd before the signal, never signalled by a bare pid) but this keeper, for at most a
/// few seconds.
fn kill_session(worker: BorrowedFd<'_>, procs: &[PathBuf]) {
    signal_pidfd(worker, libc::SIGKILL);
    let me = std::process::id();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        let mut any = false;
        for pid in crate::cgroup::host::listed_pids(procs) {
            if pid == me {
                continue;
            }
            let Ok(fd) = crate::sys::pidfd_open(pid) else {
                continue;
            };
            if !readable(fd.as_fd()) {
                any = true;
                signal_pidfd(fd.as_fd(), libc::SIGKILL);
            }
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// The daemon's side.

/// A daemon's connection to a session's keeper. Dropping it without [`Lifeline::end`] leaves
/// the keeper waiting for an adopter (what a daemon that dies does).
#[derive(Debug)]
pub struct Lifeline {
    sock: OwnedFd,
    /// The keeper's pid.
    pub pid: u32,
    /// Its start time ([`start_time`]).
    pub start_time: u64,
}

impl Lifeline {
    /// Tells the keeper the session ends, so it exits without waiting for an adopter.
    pub fn end(&self) {
        let _ = send(self.sock.as_fd(), END, &[]);
    }

    /// Whether the keeper closed its end (it exited).
    pub fn closed(&self) -> bool {
        readable(self.sock.as_fd())
    }
}

fn set_timeout(s: &OwnedFd) -> std::io::Result<()> {
    let tv = nix::sys::time::TimeVal::new(ANSWER_TIMEOUT.as_secs() as _, 0);
    setsockopt_timeout(s, tv)
}

fn setsockopt_timeout(s: &OwnedFd, tv: nix::sys::time::TimeVal) -> std::io::Result<()> {
    nix::sys::socket::setsockopt(s, sockopt::ReceiveTimeout, &tv)?;
    Ok(())
}

/// How to start a keeper.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The session id.
    pub session: String,
    /// Its socket (in the root-only keepers directory).
    pub socket: PathBuf,
    /// Adoption timeout.
    pub timeout: Duration,
    /// The session directory (`<state_dir>/sessions/<id>`, the session's tmpfs mount point),
    /// which an orphaned keeper unmounts and removes ([`release`]).
    pub session_dir: PathBuf,
    /// The session cgroup's `cgroup.procs` files: the keeper joins them, and kills what they
    /// list when nobody adopts it.
    pub procs: Vec<PathBuf>,
}

/// Starts the keeper of `spec` holding `held` (the descriptors are duplicated into it and
/// stay the caller's). Blocks until it answered (at most [`ANSWER_TIMEOUT`]). The keeper is
/// the caller's child: the caller reaps it (`std::process::Child` returned).
///
/// Errors: the socket pair, the cgroup files, the spawn, or the handshake failed.
pub fn start(spec: &Spec, held: &Held) -> std::io::Result<(Lifeline, std::process::Child)> {
    spawn(spec, held, HOLD)
}

/// Starts the keeper of a warm pooled worker ([`WARM`]): [`start`] for a session to come,
/// off the path of the `Open` that takes the worker. The keeper is started as any other (its
/// process, its cgroups, its socket: the session id is the worker's already); the session
/// that takes the worker makes it its keeper with [`WarmKeeper::keep`], and a worker
/// discarded from the pool ends it with [`WarmKeeper::end`].
///
/// Errors: as [`start`].
pub fn start_warm(spec: &Spec, held: &Held) -> std::io::Result<WarmKeeper> {
    let (lifeline, child) = spawn(spec, held, WARM)?;
    Ok(WarmKeeper {
        lifeline,
        child,
        socket: spec.socket.clone(),
    })
}

/// A keeper started for a warm pooled worker ([`start_warm`]), this daemon's child.
#[derive(Debug)]
pub struct WarmKeeper {
    /// Its lifeline (pid and start time included).
    pub lifeline: Lifeline,
    /// The process, reaped by whoever ends it.
    pub child: std::process::Child,
    socket: PathBuf,
}

impl WarmKeeper {
    /// Makes it the session's keeper: sends [`KEEP`] with `egress` (the session's egress
    /// listener, duplicated into it) and waits for [`HELD`], at most [`ANSWER_TIMEOUT`].
    /// Blocks. From then on it is any session's keeper: the lifeline and child are the
    /// caller's.
    ///
    /// Errors: the send, or no [`HELD`] in time (the keeper is then not the session's; end
    /// it with [`WarmKeeper::end`]).
    pub fn keep(&self, egress: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
        let fds: Vec<RawFd> = egress.iter().map(|f| f.as_raw_fd()).collect();
        send(self.lifeline.sock.as_fd(), KEEP, &fds)?;
        set_timeout(&self.lifeline.sock)?;
        let (m, _) = recv(self.lifeline.sock.as_fd())?;
        setsockopt_timeout(&self.lifeline.sock, nix::sys::time::TimeVal::new(0, 0))?;
        if m != HELD {
            return Err(std::io::Error::other("the keeper did not answer held"));
        }
        Ok(())
    }

    /// Sends [`END`] without waiting: the keeper exits (removing its socket) and leaves the
    /// worker alone. For a daemon about to exit, whose successor reaps nothing of it.
    pub fn end_now(&self) {
        self.lifeline.end();
    }

    /// Ends it and reaps it: [`END`], then its exit waited for at most [`ANSWER_TIMEOUT`],
    /// after which it is killed (a signal to this daemon's unreaped child, whose pid cannot
    /// have been reused). Its socket is removed in any case: a keeper that did not exit by
    /// itself (killed by its session group's kill before it read [`END`], or by hand) leaves
    /// it, and no other keeper binds its path (the session id is this worker's). Blocks.
    pub fn end(mut self) {
        self.lifeline.end();
        let t0 = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) {
            if t0.elapsed() >= ANSWER_TIMEOUT {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn spawn(
    spec: &Spec,
    held: &Held,
    first: &'static [u8],
) -> std::io::Result<(Lifeline, std::process::Child)> {
    use std::os::unix::process::CommandExt;
    let (mine, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    let procs: Vec<OwnedFd> = spec
        .procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags_cloexec()
                .open(p)
                .map(OwnedFd::from)
        })
        .collect::<Result<_, _>>()?;
    let procs_raw: Vec<RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let theirs_raw = theirs.as_raw_fd();
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0("sandcelld-keeper")
        .arg(SUBCOMMAND)
        .arg(&spec.session)
        .arg(&spec.socket)
        .arg(spec.timeout.as_secs().to_string())
        .arg(&spec.session_dir)
        .args(&spec.procs)
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    // SAFETY: only async-signal-safe calls (open, write, close, setsid, dup2, close_range)
    // between fork and exec; nothing is allocated.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &procs_raw {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // OOM_SCORE_ADJ_MIN, as the companion unit's holder (OOMScoreAdjust=-1000): the
            // session's group has memory.oom.group=1, and the kernel's OOM kill of a group
            // spares only its members at -1000 (mm/oom_kill.c, oom_kill_memcg_member). The
            // worker (1000) is the one to go; the keeper's memory is fixed (a handful of
            // descriptors, nothing a cell controls), and it sees the worker's end on its pidfd
            // and exits by itself. Needs CAP_SYS_RESOURCE (proc(5)); without it the keeper
            // keeps the daemon's value.
            let adj = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if adj >= 0 {
                let _ = libc::write(
                    adj,
                    KEEPER_OOM_SCORE_ADJ.as_ptr().cast(),
                    KEEPER_OOM_SCORE_ADJ.len(),
                );
                libc::close(adj);
            }
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::dup2(theirs_raw, LIFELINE_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            crate::sys::close_range_cloexec((LIFELINE_FD + 1) as u32)?;
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop((theirs, procs));
    let pid = child.id();
    let handshake = (|| {
        send(mine.as_fd(), first, &held.borrowed())?;
        set_timeout(&mine)?;
        let (m, _) = recv(mine.as_fd())?;
        if m != HELD {
            return Err(std::io::Error::other("the keeper did not answer held"));
        }
        Ok(())
    })();
    if let Err(e) = handshake {
        // SAFETY: a signal to our own unreaped child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let mut child = child;
        let _ = child.wait();
        return Err(e);
    }
    let start_time = start_time(pid).unwrap_or(0);
    Ok((
        Lifeline {
            sock: mine,
            pid,
            start_time,
        },
        child,
    ))
}

/// Connects to the keeper listening on `socket` and takes its descriptors over; the
/// connection is the keeper's new lifeline. The peer's pid comes from `SO_PEERCRED`.
///
/// Errors: nobody listens, the peer is not root, or it sent no [`FDS`].
pub fn adopt(socket: &Path) -> std::io::Result<(Lifeline, Held)> {
    let s = socket_seqpacket()?;
    connect(s.as_raw_fd(), &UnixAddr::new(socket)?)?;
    let cred = getsockopt(&s, sockopt::PeerCredentials)?;
    if cred.uid() != 0 {
        return Err(std::io::Error::other(format!(
            "the peer on {} runs as uid {}, not root",
            socket.display(),
            cred.uid()
        )));
    }
    set_timeout(&s)?;
    let (m, fds) = recv(s.as_fd())?;
    if m != FDS {
        return Err(std::io::Error::other("the keeper sent no descriptors"));
    }
    let held = Held::from_fds(fds)?;
    let pid = cred.pid() as u32;
    // Blocking reads from here on belong to nobody: the lifeline is only polled.
    setsockopt_timeout(&s, nix::sys::time::TimeVal::new(0, 0))?;
    Ok((
        Lifeline {
            sock: s,
            pid,
            start_time: start_time(pid).unwrap_or(0),
        },
        held,
    ))
}

fn socket_seqpacket() -> std::io::Result<OwnedFd> {
    Ok(socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

trait CloexecOpen {
    fn custom_flags_cloexec(&mut self) -> &mut Self;
}

impl CloexecOpen for std::fs::OpenOptions {
    fn custom_flags_cloexec(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe() -> (OwnedFd, OwnedFd) {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap()
    }

    /// The keeper's protocol, its side run on a thread of this test: hold, orphaned by the
    /// lifeline's close, adopted by a new connection that gets the same pipes, and `end`.
    #[test]
    fn hold_orphan_adopt_end() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("k.sock");
        let Running {
            mut sleeper,
            held,
            req_r,
            rep_w,
            mine,
            keeper,
            ..
        } = fixture(
            sock.clone(),
            dir.path(),
            dir.path().join("no-such-session"),
            Duration::from_secs(20),
        )
        .run(HOLD);
        // The daemon's own ends go (only the keeper holds the pipes now) and it dies: the
        // lifeline closes without `end`.
        let (life, got) = orphan_and_adopt(held, mine, &rep_w, &sock);
        assert_eq!(life.pid, std::process::id());
        let mut buf = [0u8; 16];
        nix::unistd::write(&got.requests, b"x").unwrap();
        assert_eq!(nix::unistd::read(&req_r, &mut buf).unwrap(), 1);
        assert_eq!(pidfd_pid(got.pidfd.as_fd()), Some(sleeper.id()));
        // The request pipe never saw end of file: the keeper held its write end throughout.
        life.end();
        assert_eq!(keeper.join().unwrap(), 0);
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }

    /// Nobody adopts: after the timeout the worker is killed, the keeper releases the
    /// session's directory and record (no mount and no cgroup here: the integration tests
    /// cover those) and ends.
    #[test]
    fn unadopted_worker_is_killed_after_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("keepers")).unwrap();
        let sock = dir.path().join("keepers").join("t.sock");
        let session_dir = dir.path().join("session");
        std::fs::create_dir(&session_dir).unwrap();
        for f in ["t.json", "t.cell", "t.rest", "u.json"] {
            std::fs::write(dir.path().join(f), b"{}").unwrap();
        }
        let Running {
            mut sleeper,
            mine,
            keeper,
            ..
        } = fixture(
            sock.clone(),
            &session_dir,
            session_dir.clone(),
            Duration::from_secs(1),
        )
        .run(HOLD);
        drop(mine);
        let t0 = Instant::now();
        assert_eq!(keeper.join().unwrap(), 0);
        assert!(t0.elapsed() >= Duration::from_millis(900));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(sleeper.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!session_dir.exists(), "the session directory stayed");
        for f in ["t.json", "t.cell", "t.rest"] {
            assert!(!dir.path().join(f).exists(), "{f} stayed");
        }
        assert!(
            dir.path().join("u.json").exists(),
            "another session's record went"
        );
    }

    /// A keeper's test set-up: a `sleep` as its worker, the worker's pipes (the ends the
    /// test keeps: the request pipe's read end, the reply pipe's write end), the lifeline pair
    /// and the keeper's arguments (session `t`, no cgroups).
    struct Fixture {
        sleeper: std::process::Child,
        held: Held,
        req_r: OwnedFd,
        rep_w: OwnedFd,
        mine: OwnedFd,
        theirs: OwnedFd,
        args: Args,
    }

    /// [`Fixture`] whose held directory is `held_dir`, its keeper listening on `socket` and
    /// releasing `session_dir`, adopted within `timeout`.
    fn fixture(
        socket: PathBuf,
        held_dir: &Path,
        session_dir: PathBuf,
        timeout: Duration,
    ) -> Fixture {
        let sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pidfd = crate::sys::pidfd_open(sleeper.id()).unwrap();
        let (req_r, req_w) = pipe();
        let (rep_r, rep_w) = pipe();
        let held = Held {
            pidfd,
            dir: std::fs::File::open(held_dir).unwrap().into(),
            requests: req_w,
            replies: rep_r,
            raw: None,
            egress: None,
        };
        let (mine, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let args = Args {
            session: "t".into(),
            socket,
            timeout,
            session_dir,
            procs: Vec::new(),
        };
        Fixture {
            sleeper,
            held,
            req_r,
            rep_w,
            mine,
            theirs,
            args,
        }
    }

    /// A keeper running on a thread of the test, past its first message's answer.
    struct Running {
        sleeper: std::process::Child,
        held: Held,
        req_r: OwnedFd,
        rep_w: OwnedFd,
        mine: OwnedFd,
        keeper: std::thread::JoinHandle<i32>,
        socket: PathBuf,
        session_dir: PathBuf,
    }

    impl Fixture {
        /// Starts the keeper (listening first, as its process does) and sends it `first`
        /// ([`HOLD`] or [`WARM`]) with the descriptors; it answered [`HELD`].
        fn run(self, first: &'static [u8]) -> Running {
            let Fixture {
                sleeper,
                held,
                req_r,
                rep_w,
                mine,
                theirs,
                args,
            } = self;
            let (socket, session_dir) = (args.socket.clone(), args.session_dir.clone());
            let listener = listen_at(&socket).unwrap();
            let keeper = std::thread::spawn(move || keep(&args, theirs, &listener).unwrap());
            send(mine.as_fd(), first, &held.borrowed()).unwrap();
            assert_eq!(recv(mine.as_fd()).unwrap().0, HELD);
            Running {
                sleeper,
                held,
                req_r,
                rep_w,
                mine,
                keeper,
                socket,
                session_dir,
            }
        }
    }

    /// The daemon's ends (`held`) go and its lifeline (`mine`) closes without `end`; a reply
    /// the worker writes meanwhile on `rep_w` waits in the pipe, and the adopter on `socket`
    /// reads it. Returns the adopter's lifeline and descriptors.
    fn orphan_and_adopt(
        held: Held,
        mine: OwnedFd,
        rep_w: &OwnedFd,
        socket: &Path,
    ) -> (Lifeline, Held) {
        drop(held);
        drop(mine);
        nix::unistd::write(rep_w, b"line\n").unwrap();
        let (life, got) = adopt(socket).unwrap();
        let mut buf = [0u8; 16];
        let n = nix::unistd::read(&got.replies, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"line\n");
        (life, got)
    }

    /// A [`Fixture`] for a warm keeper, its session directory made under `dir`.
    fn warm_fixture(dir: &Path) -> Fixture {
        let session_dir = dir.join("session");
        std::fs::create_dir(&session_dir).unwrap();
        fixture(
            dir.join("t.sock"),
            &session_dir,
            session_dir.clone(),
            Duration::from_secs(20),
        )
    }

    /// A warm keeper made a session's keeper (`keep`, with an egress listener) is one like
    /// any other: orphaned, it waits, and its adopter gets the pipes and the listener.
    #[test]
    fn warm_then_keep_is_adopted_with_its_egress_listener() {
        let dir = tempfile::tempdir().unwrap();
        let Running {
            mut sleeper,
            held,
            rep_w,
            mine,
            socket: sock,
            keeper,
            ..
        } = warm_fixture(dir.path()).run(WARM);
        let (egress, _egress_peer) = pipe();
        send(mine.as_fd(), KEEP, &[egress.as_raw_fd()]).unwrap();
        assert_eq!(recv(mine.as_fd()).unwrap().0, HELD);
        let (life, got) = orphan_and_adopt(held, mine, &rep_w, &sock);
        assert!(got.egress.is_some(), "the egress listener was not held");
        assert!(
            sleeper.try_wait().unwrap().is_none(),
            "the worker was ended"
        );
        life.end();
        assert_eq!(keeper.join().unwrap(), 0);
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }

    /// A warm keeper whose daemon dies before any session took the worker ends the worker at
    /// once and releases its directory: no successor adopts a pooled worker.
    #[test]
    fn warm_keeper_orphaned_ends_its_worker_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let Running {
            mut sleeper,
            held,
            mine,
            session_dir,
            keeper,
            ..
        } = warm_fixture(dir.path()).run(WARM);
        drop(held);
        let t0 = Instant::now();
        drop(mine);
        assert_eq!(keeper.join().unwrap(), 0);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "it waited for an adopter"
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(sleeper.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!session_dir.exists(), "the session directory stayed");
    }

    /// A warm keeper told `end` (its worker discarded from the pool, or taken by a one-shot
    /// `Run`) exits and leaves the worker alone.
    #[test]
    fn warm_keeper_ended_leaves_the_worker() {
        let dir = tempfile::tempdir().unwrap();
        let Running {
            mut sleeper,
            mine,
            session_dir,
            keeper,
            ..
        } = warm_fixture(dir.path()).run(WARM);
        send(mine.as_fd(), END, &[]).unwrap();
        assert_eq!(keeper.join().unwrap(), 0);
        assert!(
            sleeper.try_wait().unwrap().is_none(),
            "the worker was ended"
        );
        assert!(session_dir.exists(), "the session directory went");
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }

    /// A warm keeper that died before it read `end` (its session group's kill took it, as
    /// when a one-shot `Run` on its worker ended at once) leaves its socket: `end` removes it.
    #[test]
    fn ending_a_warm_keeper_that_died_removes_its_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("t.sock");
        let bound = listen_at(&socket).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        child.kill().unwrap();
        let (mine, _theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let w = WarmKeeper {
            lifeline: Lifeline {
                sock: mine,
                pid: child.id(),
                start_time: 0,
            },
            child,
            socket: socket.clone(),
        };
        drop(bound);
        assert!(socket.exists());
        w.end();
        assert!(!socket.exists(), "the dead keeper's socket stayed");
    }
}
