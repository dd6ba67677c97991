//! Step 10, last: the system-call policy.
//!
//! The policy is data: [`DENY`] is a table of system calls the worker may not make, each with
//! the condition under which it is denied, the profiles it applies to, and the reason (the
//! style of Firecracker's `resources/seccomp/*.json`). It is a deny list over a default of
//! "allow": the walls around files and the network are Landlock and the absence of sockets;
//! this filter removes the kernel attack surface an untrusted cell has no business touching
//! (the interfaces behind most container-escape and privilege-escalation bugs: namespaces,
//! bpf, io_uring, userfaultfd, perf, keyrings, ptrace), the calls that would undo the
//! other walls, and the calls that take from a pool the whole host shares.
//!
//! # What stays allowed, and why that is harmless
//!
//! Beyond the kernel attack surface, [`DENY`] removes every call that reserves a host-wide
//! resource or makes the whole host work for one worker (legacy AIO's `fs.aio-max-nr`,
//! `sync`/`syncfs`, block reservations past the end of a file). Each family left at the
//! default "allow" was checked against that bar; where a pool is counted, it is counted per
//! uid, per process, per namespace or per cgroup, all of which are the session's own (each
//! session has its own uid, cgroup, IPC and network namespace), never host-wide:
//!
//! - files (`open*`, `read*`, `write*`, `*stat*`, `rename*`, `unlink*`, `mkdir*`, `link*`,
//!   `fsync`, `fdatasync`, `sync_file_range`, `copy_file_range`, `splice`, `fadvise64`,
//!   `readahead`, `flock`, `fcntl` locks): Landlock decides which paths; RLIMIT_FSIZE bounds
//!   each file, the daemon's per-session disk budget (sizes, allocated blocks, entries) the
//!   whole directory; flushing or advising one's own files touches only them (a
//!   `POSIX_FADV_DONTNEED` on a shared read-only library costs others a re-read at most);
//!   `fallocate` is kept to mode 0 and hole punching ([`When::FallocateReserving`]);
//! - memory (`mmap`, `mremap`, `madvise`, `mlock*`, `memfd_create`, `mbind`,
//!   `set_mempolicy`, `pkey_*`, `mseal`): charged to the session's memory cgroup; locked
//!   memory is further bounded by RLIMIT_MEMLOCK per process;
//! - processes and threads (`clone` without namespace flags, `execve` in the native
//!   profile, `wait*`, `kill`, `tgkill`, `pidfd_open`, `pidfd_send_signal`): pids.max of the
//!   session cgroup and RLIMIT_NPROC of its own uid; signals reach only the same uid and,
//!   with Landlock's signal scope, only the worker's own domain;
//! - scheduling (`sched_*`, `setpriority`, `ioprio_set`, `sched_setaffinity`): without
//!   CAP_SYS_NICE/CAP_SYS_ADMIN a process can only lower its own priority, cannot enter a
//!   real-time or deadline class (RLIMIT_RTPRIO is 0), and stays inside its cpuset and the
//!   cgroup's cpu.max;
//! - event and timer descriptors (`epoll*`, `eventfd`, `timerfd*`, `signalfd`, `inotify*`,
//!   `timer_create`, `pipe*`): bounded per uid (`max_user_watches`, `max_user_instances`,
//!   RLIMIT_SIGPENDING, `pipe-user-pages-soft`) and by RLIMIT_NOFILE; the session's uid is
//!   its own, so one session cannot starve another;
//! - System V IPC and POSIX message queues (`shm*`, `sem*`, `msg*`, `mq_*`): the worker has
//!   its own IPC namespace, whose objects die with it; shared memory is charged to its
//!   memory cgroup, queues to RLIMIT_MSGQUEUE of its uid;
//! - identity and limits (`get*id`, `setrlimit`, `prlimit64`, `capget`, `prctl`,
//!   `landlock_*`, `seccomp`): can only drop what the worker has (no_new_privs and empty
//!   capability sets make the `set*id` calls fail);
//! - information (`uname`, `sysinfo`, `getrusage`, `times`, `clock_gettime`, `getrandom`,
//!   `getcpu`): read-only, no host-wide state is changed;
//! - `ioctl` other than the rows below: only on descriptors Landlock let the worker open
//!   (its own files, pipes, `/dev/null`, `/dev/urandom`); the privileged commands need
//!   capabilities the worker dropped.
//!
//! The sockets family is denied outright (below), which also removes netlink, packet and
//! `AF_ALG` sockets and every socket-buffer pool.
//!
//! seccompiler allows one match action per filter, so the policy is three stacked filters.
//! For each call the kernel runs all of them and applies the most severe result
//! (KILL_PROCESS > ERRNO > ALLOW):
//!
//! 1. [`arch_filter`], hand-written BPF: kill the process on a foreign architecture (i386
//!    `int 0x80`) and on x32 system-call numbers (`nr | 0x40000000`). seccompiler checks the
//!    architecture but not the x32 bit (rust-vmm/seccompiler#74; the same bypass was
//!    google/kafel#19): on a kernel with x32 enabled, x32 numbers reach the same handlers
//!    under `AUDIT_ARCH_X86_64` and would skip every rule keyed on the 64-bit number.
//! 2. [`DENY`] → `EPERM`.
//! 3. [`ENOSYS`] → `ENOSYS`: `clone3` takes its flags in memory, where a filter cannot read
//!    them; glibc (2.34+) falls back to `clone` on `ENOSYS`, whose flags [`DENY`] can check.
//!
//! Arguments the kernel reads as 32-bit (`int`/`unsigned int`: the socket family, an ioctl
//! command, a persona) are compared as 32-bit words (`Dword`): comparing all 64 bits would let
//! a caller set high bits the kernel ignores and slip past the rule.

use crate::{Error, SyscallProfile};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};
use std::collections::BTreeMap;
use std::io;

/// Which profiles a [`Deny`] entry applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profiles {
    /// Both the Wasm and the native profile.
    Both,
    /// Only the WebAssembly host (the Python worker).
    Wasm,
}

/// When a call of a [`Deny`] entry is denied.
#[derive(Debug, Clone, Copy)]
pub enum When {
    /// Whatever the arguments.
    Always,
    /// `clone` creating a process rather than a thread (`CLONE_THREAD` clear in arg 0).
    CloneWithoutThread,
    /// `clone` with any namespace flag in arg 0.
    CloneNamespace,
    /// `socketpair` other than `AF_UNIX` + `SOCK_STREAM`.
    SocketpairNotUnixStream,
    /// `socket` other than `AF_INET`/`AF_INET6` + `SOCK_STREAM` with protocol 0 or
    /// `IPPROTO_TCP` (egress workers, in place of [`When::Always`]).
    SocketNotInetStream,
    /// `ioctl` with one of these commands (arg 1, 32-bit).
    IoctlCommands(&'static [u32]),
    /// `personality` with a persona other than these (arg 0, 32-bit).
    PersonalityOtherThan(&'static [u32]),
    /// `fallocate` with a mode (arg 1, 32-bit) that is neither 0 nor includes
    /// `FALLOC_FL_PUNCH_HOLE`: `KEEP_SIZE`, `ZERO_RANGE|KEEP_SIZE`, `INSERT_RANGE`,
    /// `COLLAPSE_RANGE`, `UNSHARE_RANGE`, ... Mode 0 grows the file's size, which
    /// RLIMIT_FSIZE bounds and the session's disk budget sees; punching a hole frees blocks.
    /// `KEEP_SIZE` reserves blocks past the end of the file with its size unchanged, and the
    /// kernel checks RLIMIT_FSIZE only when the size grows (`inode_newsize_ok` is skipped for
    /// `KEEP_SIZE` in ext4/xfs/btrfs fallocate): 1 GiB reserved under a 256 MiB limit.
    FallocateReserving,
}

/// One row of the policy.
#[derive(Debug, Clone, Copy)]
pub struct Deny {
    /// System-call name, for humans and tests.
    pub name: &'static str,
    /// System-call number on the build architecture.
    pub nr: libc::c_long,
    /// Condition.
    pub when: When,
    /// Profiles the row applies to.
    pub profiles: Profiles,
    /// Why the worker may not make this call.
    pub reason: &'static str,
}

macro_rules! deny {
    ($name:ident, $when:expr, $profiles:ident, $reason:expr) => {
        Deny {
            name: stringify!($name),
            nr: pastey::paste!(nr::[<SYS_ $name>]),
            when: $when,
            profiles: Profiles::$profiles,
            reason: $reason,
        }
    };
}

/// System-call numbers by name: the libc crate's `SYS_<name>` constants, and the two that it
/// lacks for some targets. An item declared here shadows libc's glob-imported one.
#[allow(non_upper_case_globals)]
mod nr {
    pub use libc::*;
    /// `io_pgetevents` (Linux 4.18).
    #[cfg(target_arch = "x86_64")]
    pub const SYS_io_pgetevents: c_long = 333;
    /// `io_pgetevents` (Linux 4.18; the generic table's number).
    #[cfg(not(target_arch = "x86_64"))]
    pub const SYS_io_pgetevents: c_long = 292;
    /// `cachestat` (Linux 6.5; the same number on every architecture's table).
    pub const SYS_cachestat: c_long = 451;
}

/// `TIOCSTI`: push a byte into a terminal's input queue.
const TIOCSTI: u32 = 0x5412;
/// `TIOCLINUX`: console selection/paste, the same injection on a virtual console.
const TIOCLINUX: u32 = 0x541C;
/// XFS space-reservation ioctls (`_IOW('X', n, struct xfs_flock64)`, 48 bytes): `ALLOCSP`
/// (10), `ALLOCSP64` (36), `RESVSP` (40), `RESVSP64` (42), `ZERO_RANGE` (57). `RESVSP*`
/// reserve blocks beyond the end of the file like `fallocate(FALLOC_FL_KEEP_SIZE)`, which
/// RLIMIT_FSIZE does not bound (`xfs_ioc_space`, fs/xfs/xfs_ioctl.c).
const XFS_SPACE_IOCTLS: &[u32] = &[
    0x4030_580A,
    0x4030_5824,
    0x4030_5828,
    0x4030_582A,
    0x4030_5839,
];
/// Personas glibc and ordinary programs use: `PER_LINUX`, `PER_LINUX32`, `UNAME26`,
/// `PER_LINUX32|UNAME26`, and the query `0xffffffff` (Docker's default profile allows the same).
const ALLOWED_PERSONAS: &[u32] = &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// The policy, denied with `EPERM`. Rows are grouped by the reason they exist.
#[rustfmt::skip]
pub const DENY: &[Deny] = &[
    // --- Other processes: reading or steering them bypasses every per-process wall. ---
    deny!(ptrace, When::Always, Both, "reads/writes other processes' memory; before Linux 4.8 a tracer could rewrite a call after seccomp allowed it"),
    deny!(process_vm_readv, When::Always, Both, "reads another process's memory (ptrace access)"),
    deny!(process_vm_writev, When::Always, Both, "writes another process's memory (ptrace access)"),
    deny!(process_madvise, When::Always, Both, "acts on another process's memory (ptrace access)"),
    deny!(pidfd_getfd, When::Always, Both, "copies a descriptor out of another process (ptrace access)"),
    deny!(kcmp, When::Always, Both, "compares kernel objects of other processes: an information leak"),
    // --- Mounts and roots: the file-system view must stay the one Landlock was built on. ---
    deny!(mount, When::Always, Both, "changes the mount table"),
    deny!(umount2, When::Always, Both, "changes the mount table"),
    deny!(pivot_root, When::Always, Both, "changes the root"),
    deny!(chroot, When::Always, Both, "changes the root"),
    deny!(open_tree, When::Always, Both, "new mount API: clones mount trees"),
    deny!(move_mount, When::Always, Both, "new mount API"),
    deny!(fsopen, When::Always, Both, "new mount API: file-system contexts are kernel parser attack surface"),
    deny!(fsconfig, When::Always, Both, "new mount API"),
    deny!(fsmount, When::Always, Both, "new mount API"),
    deny!(fspick, When::Always, Both, "new mount API"),
    deny!(mount_setattr, When::Always, Both, "new mount API"),
    // --- Namespaces: a user namespace hands out CAP_NET_ADMIN & co. over kernel code that many
    //     privilege escalations went through; the worker's namespaces are set by step 3. ---
    deny!(unshare, When::Always, Both, "creates namespaces (user namespaces expose root-only kernel code)"),
    deny!(setns, When::Always, Both, "joins other namespaces"),
    deny!(clone, When::CloneNamespace, Both, "clone with CLONE_NEW* creates namespaces, as unshare"),
    // --- Kernel subsystems with a long exploit record and no use in a cell. ---
    deny!(bpf, When::Always, Both, "eBPF verifier bugs are a recurring privilege escalation"),
    deny!(perf_event_open, When::Always, Both, "side channels and a long CVE record"),
    deny!(userfaultfd, When::Always, Both, "pauses kernel page faults: widens race windows in kernel exploits"),
    deny!(io_uring_setup, When::Always, Both, "io_uring operations are not seen by seccomp and have a long CVE record"),
    deny!(io_uring_enter, When::Always, Both, "io_uring, see io_uring_setup"),
    deny!(io_uring_register, When::Always, Both, "io_uring, see io_uring_setup"),
    deny!(keyctl, When::Always, Both, "kernel keyrings are not namespaced (CVE-2016-0728)"),
    deny!(add_key, When::Always, Both, "kernel keyrings, see keyctl"),
    deny!(request_key, When::Always, Both, "kernel keyrings, see keyctl"),
    deny!(name_to_handle_at, When::Always, Both, "file handles resolve outside the caller's view"),
    deny!(open_by_handle_at, When::Always, Both, "opens files by handle, bypassing paths (the 2014 'shocker' container escape)"),
    deny!(lookup_dcookie, When::Always, Both, "profiling interface, leaks paths"),
    deny!(syslog, When::Always, Both, "kernel log: leaks addresses"),
    deny!(migrate_pages, When::Always, Both, "moves another process's pages"),
    deny!(move_pages, When::Always, Both, "moves another process's pages"),
    deny!(personality, When::PersonalityOtherThan(ALLOWED_PERSONAS), Both, "personas like ADDR_NO_RANDOMIZE weaken exec'd programs; old bugs in non-Linux personas"),
    deny!(ioctl, When::IoctlCommands(&[TIOCSTI, TIOCLINUX]), Both, "terminal input injection (bubblewrap CVE-2017-5226)"),
    // --- Host administration (also gated by capabilities the worker no longer has). ---
    deny!(kexec_load, When::Always, Both, "host administration"),
    deny!(kexec_file_load, When::Always, Both, "host administration"),
    deny!(reboot, When::Always, Both, "host administration"),
    deny!(swapon, When::Always, Both, "host administration"),
    deny!(swapoff, When::Always, Both, "host administration"),
    deny!(init_module, When::Always, Both, "loads kernel code"),
    deny!(finit_module, When::Always, Both, "loads kernel code"),
    deny!(delete_module, When::Always, Both, "unloads kernel code"),
    deny!(acct, When::Always, Both, "host administration"),
    deny!(quotactl, When::Always, Both, "host administration"),
    deny!(quotactl_fd, When::Always, Both, "host administration"),
    deny!(settimeofday, When::Always, Both, "sets the host clock"),
    deny!(clock_settime, When::Always, Both, "sets the host clock"),
    deny!(clock_adjtime, When::Always, Both, "sets the host clock"),
    deny!(adjtimex, When::Always, Both, "sets the host clock"),
    deny!(sethostname, When::Always, Both, "host identity"),
    deny!(setdomainname, When::Always, Both, "host identity"),
    deny!(vhangup, When::Always, Both, "hangs up terminals"),
    deny!(fanotify_init, When::Always, Both, "watches whole mounts"),
    deny!(nfsservctl, When::Always, Both, "host administration (removed in Linux 3.1)"),
    #[cfg(target_arch = "x86_64")]
    deny!(sysfs, When::Always, Both, "obsolete file-system type query; nothing a cell needs"),
    #[cfg(target_arch = "x86_64")]
    deny!(ustat, When::Always, Both, "obsolete per-device file-system statistics of the host"),
    // --- Host-global kernel resources: one worker could use up a pool every process of the
    //     host draws from, or make the whole host do work for it. ---
    deny!(io_setup, When::Always, Both, "legacy AIO contexts draw from the host-wide fs.aio-max-nr (65536): one worker took them all"),
    deny!(io_destroy, When::Always, Both, "legacy AIO, see io_setup"),
    deny!(io_submit, When::Always, Both, "legacy AIO, see io_setup"),
    deny!(io_cancel, When::Always, Both, "legacy AIO, see io_setup"),
    deny!(io_getevents, When::Always, Both, "legacy AIO, see io_setup"),
    deny!(io_pgetevents, When::Always, Both, "legacy AIO, see io_setup"),
    deny!(sync, When::Always, Both, "writes back every dirty page of every file system on the host"),
    deny!(syncfs, When::Always, Both, "writes back a whole (shared) file system; fsync/fdatasync of one's own files stay allowed"),
    deny!(fallocate, When::FallocateReserving, Both, "reserving blocks past the end of a file escapes RLIMIT_FSIZE and the session's size accounting"),
    deny!(ioctl, When::IoctlCommands(XFS_SPACE_IOCTLS), Both, "XFS block reservation, the ioctl form of fallocate(KEEP_SIZE)"),
    deny!(memfd_secret, When::Always, Both, "secret memory is removed from the kernel's direct map (a host-wide cost) and nothing in a cell needs it"),
    deny!(cachestat, When::Always, Both, "page-cache state of shared files: a cross-tenant side channel"),
    #[cfg(target_arch = "x86_64")]
    deny!(iopl, When::Always, Both, "raw I/O port access"),
    #[cfg(target_arch = "x86_64")]
    deny!(ioperm, When::Always, Both, "raw I/O port access"),
    #[cfg(target_arch = "x86_64")]
    deny!(modify_ldt, When::Always, Both, "segment descriptors: past kernel bugs (CVE-2015-5157), unused by 64-bit programs"),
    #[cfg(target_arch = "x86_64")]
    deny!(uselib, When::Always, Both, "obsolete a.out loader"),
    // --- The network. Landlock (ABI 7) does not control pathname AF_UNIX connect nor UDP, so
    //     the worker gets no sockets at all: it talks over the pipes the daemon handed it.
    //     Measured: R calls socket(AF_UNIX) only for glibc's nscd lookup and falls back to
    //     /etc/passwd on EPERM. ---
    deny!(socket, When::Always, Both, "no sockets: the daemon's and the bus's pathname sockets are reachable otherwise"),
    deny!(socketpair, When::SocketpairNotUnixStream, Both, "a datagram socketpair socket can sendto() any pathname socket; stream pairs are closed systems"),
    // --- The WebAssembly host never starts programs; threads (CLONE_THREAD) stay allowed. ---
    deny!(execve, When::Always, Wasm, "the Python worker never runs programs"),
    deny!(execveat, When::Always, Wasm, "the Python worker never runs programs"),
    deny!(clone, When::CloneWithoutThread, Wasm, "the Python worker never forks; threads are allowed"),
    #[cfg(target_arch = "x86_64")]
    deny!(fork, When::Always, Wasm, "the Python worker never forks"),
    #[cfg(target_arch = "x86_64")]
    deny!(vfork, When::Always, Wasm, "the Python worker never forks"),
];

/// Calls answered with `ENOSYS` (filter 3), so that libc falls back to a call [`DENY`] can
/// inspect.
pub const ENOSYS: &[(&str, libc::c_long, &str)] = &[(
    "clone3",
    libc::SYS_clone3,
    "flags live in memory where BPF cannot read them; glibc retries with clone",
)];

/// The namespace flags of `clone(2)` arg 0. `CLONE_NEWTIME` is absent: in `clone` its bit is
/// part of the exit signal, and it is only accepted by `clone3` and `unshare`, both denied.
const CLONE_NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
];

#[cfg(target_arch = "x86_64")]
const TARGET: Option<TargetArch> = Some(TargetArch::x86_64);
#[cfg(target_arch = "aarch64")]
const TARGET: Option<TargetArch> = Some(TargetArch::aarch64);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const TARGET: Option<TargetArch> = None;

/// `AUDIT_ARCH_*` of the build architecture.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 183 | 0x8000_0000 | 0x4000_0000;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: u32 = 0;

/// Classic BPF opcodes (`<linux/bpf_common.h>`).
/// `BPF_LD | BPF_W | BPF_ABS`: load a 32-bit word of `seccomp_data`.
const BPF_LD_W_ABS: u16 = 0x20;
/// `BPF_JMP | BPF_JEQ | BPF_K`.
const BPF_JEQ_K: u16 = 0x15;
/// `BPF_JMP | BPF_JGE | BPF_K`.
const BPF_JGE_K: u16 = 0x35;
/// `BPF_RET | BPF_K`.
const BPF_RET_K: u16 = 0x06;

/// The x32 ABI marks its system-call numbers with this bit (`__X32_SYSCALL_BIT`).
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, Error> {
    SeccompCondition::new(arg, len, op, value).map_err(build_error)
}

fn one(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, Error> {
    SeccompRule::new(conditions).map_err(build_error)
}

fn build_error(e: impl std::fmt::Display) -> Error {
    Error::Step {
        step: "seccomp",
        source: io::Error::other(format!("building the filter: {e}")),
    }
}

impl When {
    /// The seccompiler rules of the condition (OR of ANDs); `None` for [`When::Always`].
    fn rules(self) -> Result<Option<Vec<SeccompRule>>, Error> {
        use SeccompCmpArgLen::{Dword, Qword};
        use SeccompCmpOp::{Eq, MaskedEq, Ne};
        let rules = match self {
            When::Always => return Ok(None),
            When::CloneWithoutThread => {
                let thread = libc::CLONE_THREAD as u64;
                vec![one(vec![cond(0, Qword, MaskedEq(thread), 0)?])?]
            }
            When::CloneNamespace => CLONE_NAMESPACE_FLAGS
                .iter()
                .map(|&f| one(vec![cond(0, Qword, MaskedEq(f as u64), f as u64)?]))
                .collect::<Result<_, _>>()?,
            When::SocketpairNotUnixStream => {
                let mut rules = vec![one(vec![cond(0, Dword, Ne, libc::AF_UNIX as u64)?])?];
                // The kernel masks the type with SOCK_TYPE_MASK (0xf); flags sit above it.
                for ty in (0..16u64).filter(|t| *t != libc::SOCK_STREAM as u64) {
                    rules.push(one(vec![cond(1, Dword, MaskedEq(0xf), ty)?])?);
                }
                rules
            }
            When::SocketNotInetStream => {
                let mut rules = vec![
                    one(vec![
                        cond(0, Dword, Ne, libc::AF_INET as u64)?,
                        cond(0, Dword, Ne, libc::AF_INET6 as u64)?,
                    ])?,
                    one(vec![
                        cond(2, Dword, Ne, 0)?,
                        cond(2, Dword, Ne, libc::IPPROTO_TCP as u64)?,
                    ])?,
                ];
                // The kernel masks the type with SOCK_TYPE_MASK (0xf); flags sit above it.
                for ty in (0..16u64).filter(|t| *t != libc::SOCK_STREAM as u64) {
                    rules.push(one(vec![cond(1, Dword, MaskedEq(0xf), ty)?])?);
                }
                rules
            }
            When::IoctlCommands(cmds) => cmds
                .iter()
                .map(|&c| one(vec![cond(1, Dword, Eq, u64::from(c))?]))
                .collect::<Result<_, _>>()?,
            When::PersonalityOtherThan(allowed) => vec![one(allowed
                .iter()
                .map(|&p| cond(0, Dword, Ne, u64::from(p)))
                .collect::<Result<_, _>>()?)?],
            When::FallocateReserving => {
                let punch = libc::FALLOC_FL_PUNCH_HOLE as u64;
                vec![one(vec![
                    cond(1, Dword, Ne, 0)?,
                    cond(1, Dword, MaskedEq(punch), 0)?,
                ])?]
            }
        };
        Ok(Some(rules))
    }
}

/// Whether a row of [`DENY`] applies to `profile`.
fn applies(row: &Deny, profile: SyscallProfile) -> bool {
    row.profiles == Profiles::Both
        || (row.profiles == Profiles::Wasm && profile == SyscallProfile::Wasm)
}

/// Filter 2 of the policy for `profile`, compiled.
///
/// Errors: [`Error::Unavailable`] on an architecture without a policy; [`Error::Step`] if
/// seccompiler rejects the table (a bug caught by the unit tests).
pub fn deny_filter(profile: SyscallProfile) -> Result<BpfProgram, Error> {
    deny_filter_with(profile, false)
}

/// [`deny_filter`], with `inet_stream`: the native profile's `socket` row denies only what
/// is not a TCP socket ([`When::SocketNotInetStream`]), for workers with egress.
///
/// Errors: as [`deny_filter`].
pub fn deny_filter_with(profile: SyscallProfile, inet_stream: bool) -> Result<BpfProgram, Error> {
    let arch = target()?;
    // None = denied unconditionally; Some(rules) = denied when any rule matches.
    let mut map: BTreeMap<i64, Option<Vec<SeccompRule>>> = BTreeMap::new();
    for row in DENY.iter().filter(|r| applies(r, profile)) {
        let when = if inet_stream && profile == SyscallProfile::Native && row.nr == libc::SYS_socket
        {
            When::SocketNotInetStream
        } else {
            row.when
        };
        let new = when.rules()?;
        let entry = map.entry(row.nr).or_insert_with(|| Some(Vec::new()));
        match (entry.as_mut(), new) {
            (_, None) => *entry = None,
            (Some(existing), Some(rules)) => existing.extend(rules),
            (None, Some(_)) => {}
        }
    }
    let rules = map
        .into_iter()
        .map(|(nr, rules)| (nr, rules.unwrap_or_default()))
        .collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(build_error)?;
    BpfProgram::try_from(filter).map_err(build_error)
}

/// Filter 3: [`ENOSYS`] rows, compiled.
///
/// Errors: as [`deny_filter`].
pub fn enosys_filter() -> Result<BpfProgram, Error> {
    let rules = ENOSYS.iter().map(|(_, nr, _)| (*nr, Vec::new())).collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        target()?,
    )
    .map_err(build_error)?;
    BpfProgram::try_from(filter).map_err(build_error)
}

/// Filter 1: kill the process on a foreign architecture or an x32 system-call number.
///
/// ```text
/// 0: A = seccomp_data.arch
/// 1: if A != AUDIT_ARCH goto 5
/// 2: A = seccomp_data.nr              (x86_64 only, see below)
/// 3: if A >= X32_SYSCALL_BIT goto 5
/// 4: return ALLOW
/// 5: return KILL_PROCESS
/// ```
/// On aarch64 there is no x32; instructions 2-3 are left out and the jump adjusted.
pub fn arch_filter() -> BpfProgram {
    const NR_OFFSET: u32 = 0; // offsetof(struct seccomp_data, nr)
    const ARCH_OFFSET: u32 = 4; // offsetof(struct seccomp_data, arch)
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let mut prog = vec![ins(BPF_LD_W_ABS, 0, 0, ARCH_OFFSET)];
    if cfg!(target_arch = "x86_64") {
        prog.push(ins(BPF_JEQ_K, 0, 3, AUDIT_ARCH));
        prog.push(ins(BPF_LD_W_ABS, 0, 0, NR_OFFSET));
        prog.push(ins(BPF_JGE_K, 1, 0, X32_SYSCALL_BIT));
    } else {
        prog.push(ins(BPF_JEQ_K, 0, 1, AUDIT_ARCH));
    }
    prog.push(ins(BPF_RET_K, 0, 0, libc::SECCOMP_RET_ALLOW));
    prog.push(ins(BPF_RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS));
    prog
}

fn target() -> Result<TargetArch, Error> {
    TARGET.ok_or_else(|| Error::Unavailable {
        layer: "seccomp",
        reason: format!("no policy for architecture {}", std::env::consts::ARCH),
    })
}

/// Builds the three filters for `profile` and installs them on the calling thread. Needs
/// no_new_privs (step 7) or CAP_SYS_ADMIN.
///
/// Errors: [`Error::Unavailable`] when the kernel refuses filters (`EINVAL`: no
/// CONFIG_SECCOMP_FILTER; `EACCES`: no_new_privs missing) or the architecture has no policy.
pub fn install(profile: SyscallProfile) -> Result<(), Error> {
    install_with(profile, false)
}

/// [`install`] with the `socket` row of [`deny_filter_with`].
///
/// Errors: as [`install`].
pub fn install_with(profile: SyscallProfile, inet_stream: bool) -> Result<(), Error> {
    let filters = [
        arch_filter(),
        deny_filter_with(profile, inet_stream)?,
        enosys_filter()?,
    ];
    for prog in &filters {
        seccompiler::apply_filter(prog).map_err(|e| Error::Unavailable {
            layer: "seccomp",
            reason: format!(
                "installing a filter: {e} (the kernel needs CONFIG_SECCOMP_FILTER=y; a container \
                 runtime may forbid seccomp)"
            ),
        })?;
    }
    Ok(())
}

/// What [`probe_in_child`] found.
#[derive(Debug, Clone, Copy, Default)]
pub struct Probes {
    /// `PR_SET_NO_NEW_PRIVS` worked.
    pub no_new_privs: bool,
    /// A filter installed and denied a call with `EPERM`.
    pub seccomp: bool,
    /// `unshare(CLONE_NEWNET | CLONE_NEWIPC)` worked.
    pub namespaces: bool,
}

/// Forks a child that tries namespaces, no_new_privs and a one-rule seccomp filter (deny
/// `getppid` with `EPERM`), and reports which worked. The child makes raw system calls only
/// (async-signal-safe), so this is safe from a multi-threaded daemon.
///
/// Errors: the OS error of `fork` or `waitpid`.
pub fn probe_in_child() -> io::Result<Probes> {
    let prog = [
        sock_filter {
            code: BPF_LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0,
        },
        sock_filter {
            code: BPF_JEQ_K,
            jt: 0,
            jf: 1,
            k: libc::SYS_getppid as u32,
        },
        sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: fork in a possibly multi-threaded process: the child only makes raw system calls
    // on memory prepared before the fork (prog, fprog) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let mut bits = 0;
        // SAFETY: integer arguments only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWIPC) } == 0 {
            bits |= 4;
        }
        // SAFETY: integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } == 0 {
            bits |= 1;
            // SAFETY: fprog points at prog, both alive; the kernel copies the program.
            let installed = unsafe {
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &fprog as *const _,
                    0,
                    0,
                )
            } == 0;
            // SAFETY: getppid has no arguments; the filter makes it fail with EPERM.
            let denied = unsafe { libc::syscall(libc::SYS_getppid) } == -1
                // SAFETY: __errno_location returns this thread's errno slot.
                && unsafe { *libc::__errno_location() } == libc::EPERM;
            if installed && denied {
                bits |= 2;
            }
        }
        // SAFETY: _exit is async-signal-safe and never returns.
        unsafe { libc::_exit(bits) };
    }
    let mut status = 0;
    // SAFETY: pid is our child; status is a valid out pointer.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(io::Error::last_os_error());
    }
    let bits = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        0
    };
    Ok(Probes {
        no_new_privs: bits & 1 != 0,
        seccomp: bits & 2 != 0,
        namespaces: bits & 4 != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_has_a_reason_and_compiles() {
        for row in DENY {
            assert!(!row.reason.is_empty(), "{} has no reason", row.name);
            row.when.rules().unwrap();
        }
        for profile in [SyscallProfile::Wasm, SyscallProfile::Native] {
            let prog = deny_filter(profile).unwrap();
            assert!(
                prog.len() > DENY.len() / 2,
                "{profile:?}: {} instructions",
                prog.len()
            );
            assert!(prog.len() < 4096, "over BPF_MAXINSNS");
        }
        assert!(!enosys_filter().unwrap().is_empty());
    }

    #[test]
    fn unconditional_rows_are_not_duplicated() {
        let mut seen = std::collections::HashSet::new();
        for row in DENY.iter().filter(|r| matches!(r.when, When::Always)) {
            assert!(
                seen.insert((row.nr, row.profiles == Profiles::Wasm)),
                "{} twice",
                row.name
            );
        }
    }

    #[test]
    fn wasm_denies_exec_native_does_not() {
        let names = |p| {
            DENY.iter()
                .filter(|r| applies(r, p))
                .map(|r| r.name)
                .collect::<Vec<_>>()
        };
        assert!(names(SyscallProfile::Wasm).contains(&"execve"));
        assert!(!names(SyscallProfile::Native).contains(&"execve"));
        assert!(names(SyscallProfile::Native).contains(&"socket"));
        // A Wasm filter is strictly bigger than a native one.
        assert!(
            deny_filter(SyscallProfile::Wasm).unwrap().len()
                > deny_filter(SyscallProfile::Native).unwrap().len()
        );
    }

    /// In a child: no_new_privs, the native policy, then the host-global calls. Each check
    /// sets one bit of the exit status when the call did what the policy says.
    #[test]
    fn native_policy_denies_host_global_calls_and_block_reservations() {
        let progs = [
            arch_filter(),
            deny_filter(SyscallProfile::Native).unwrap(),
            enosys_filter().unwrap(),
        ];
        let fprogs: Vec<libc::sock_fprog> = progs
            .iter()
            .map(|p| libc::sock_fprog {
                len: p.len() as u16,
                filter: p.as_ptr() as *mut libc::sock_filter,
            })
            .collect();
        let path = std::env::temp_dir().join(format!("sandcell-seccomp-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        // SAFETY: the child makes raw system calls only on memory prepared before the fork,
        // and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: raw system calls with integer arguments or pointers prepared above.
            unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    libc::_exit(200);
                }
                for f in &fprogs {
                    if libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, f, 0, 0) != 0 {
                        libc::_exit(201);
                    }
                }
                let eperm = |r: libc::c_long| r == -1 && *libc::__errno_location() == libc::EPERM;
                let mut bits = 0;
                let mut ctx: u64 = 0;
                if eperm(libc::syscall(libc::SYS_io_setup, 1, &mut ctx as *mut u64)) {
                    bits |= 1;
                }
                if eperm(libc::syscall(libc::SYS_sync)) {
                    bits |= 2;
                }
                if eperm(libc::syscall(libc::SYS_syncfs, fd)) {
                    bits |= 4;
                }
                if eperm(libc::syscall(
                    libc::SYS_fallocate,
                    fd,
                    libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    1i64 << 30,
                )) {
                    bits |= 8;
                }
                // Mode 0 and hole punching stay allowed (EOPNOTSUPP on a file system without
                // them is fine: only EPERM would be the filter).
                let r = libc::syscall(libc::SYS_fallocate, fd, 0, 0, 4096);
                if !eperm(r) {
                    bits |= 16;
                }
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                if !eperm(libc::syscall(libc::SYS_fallocate, fd, punch, 0, 4096)) {
                    bits |= 32;
                }
                if eperm(libc::syscall(libc::SYS_io_uring_setup, 1, 0)) {
                    bits |= 64;
                }
                libc::_exit(bits);
            }
        }
        let mut status = 0;
        // SAFETY: pid is our child; status a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        let bits = libc::WEXITSTATUS(status);
        assert!(bits < 200, "could not install the filter: {bits}");
        assert_eq!(
            bits, 127,
            "io_setup 1, sync 2, syncfs 4, keep_size 8, mode0 16, punch 32, io_uring 64"
        );
        assert!(std::os::unix::fs::MetadataExt::blocks(&file.metadata().unwrap()) * 512 < 1 << 20);
    }

    #[test]
    fn arch_filter_shape() {
        let prog = arch_filter();
        let last = prog.last().unwrap();
        assert_eq!(last.k, libc::SECCOMP_RET_KILL_PROCESS);
        // Every jump lands inside the program.
        for (i, ins) in prog.iter().enumerate() {
            if ins.code & 0x07 == 0x05 {
                assert!(i + 1 + (ins.jt as usize) < prog.len());
                assert!(i + 1 + (ins.jf as usize) < prog.len());
            }
        }
    }
}
