//! The test tier "under the unit's sandbox": starts a process with what `units/sandcelld.service`
//! changes about the answers of system calls, on a machine where systemd is not PID 1.
//!
//! Read from the unit file at test time (so editing the unit changes the test), and applied
//! between fork and exec as systemd applies them (systemd.exec(5)):
//!
//! - `SystemCallFilter=` (every line, in order; `~` lines remove), its groups expanded with the
//!   host's `systemd-analyze syscall-filter` (the host's systemd, as the packaged service would
//!   get), `@default` always allowed in an allow-list; a call outside it answers
//!   `SystemCallErrorNumber=` (default: the process is killed, as systemd does);
//! - `RestrictSUIDSGID=yes`: `chmod`, `fchmod`, `fchmodat`, `fchmodat2`, `mknod`, `mknodat`
//!   with `S_ISUID`/`S_ISGID` in the mode, `open`/`openat` with `O_CREAT` and such a mode,
//!   `creat` with one: `EPERM`; `openat2` (whose mode seccomp cannot see): `ENOSYS`;
//! - `RestrictNamespaces=`: `unshare`/`clone` with a namespace flag not listed, `setns` to a
//!   type not listed (or type 0): `EPERM`; `clone3` (flags in memory): `ENOSYS`;
//! - `RestrictAddressFamilies=` (an allow-list): `socket` of any other family: `EAFNOSUPPORT`;
//! - `LockPersonality=yes`: `personality` other than `PER_LINUX` or a query: `EPERM`;
//! - `RestrictRealtime=yes`: `sched_setscheduler` to `SCHED_FIFO`/`SCHED_RR`: `EPERM`;
//! - `MemoryDenyWriteExecute=yes`: `mmap` writable and executable, `mprotect`/`pkey_mprotect`
//!   to executable: `EPERM`;
//! - `ProtectClock=`, `ProtectKernelModules=`, `PrivateDevices=`, `ProtectKernelLogs=`,
//!   `ProtectHostname=`: the system-call groups they deny (`@clock`, `@module`, `@raw-io`,
//!   `syslog`, `sethostname`/`setdomainname`);
//! - `NoNewPrivileges=yes`; `CapabilityBoundingSet=` (every other capability dropped from the
//!   bounding set).
//!
//! Not modelled: mount namespaces (`ProtectSystem=`, `PrivateTmp=`, `PrivateDevices=`'s /dev,
//! `ProtectProc=`), `PrivateNetwork=`, `IPAddressDeny=`: they change what paths and addresses
//! exist, not what system calls answer; the VM tier covers them under real systemd.
//!
//! `SANDCELL_TEST_UNIT_SANDBOX=1` makes [`crate::common::Daemon`] start every daemon this way.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The environment variable that makes the harness start daemons under the unit's sandbox.
pub const ENV: &str = "SANDCELL_TEST_UNIT_SANDBOX";

/// Set by a test that always wants the sandbox (whatever [`ENV`] says).
pub static FORCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`ENV`] is set to `1` (or [`FORCE`] is set).
pub fn enabled() -> bool {
    FORCE.load(std::sync::atomic::Ordering::Relaxed) || std::env::var(ENV).is_ok_and(|v| v == "1")
}

/// The unit file of the repository.
pub fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../units/sandcelld.service")
}

/// The egress proxy's unit, `units/sandcell-egress.service`.
pub fn egress_unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../units/sandcell-egress.service")
}

/// The packages' egress drop-in for the daemon's unit (installed inactive in
/// /usr/share/sandcell/egress/; linked in by the operator to turn egress on).
pub fn egress_drop_in_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../units/egress/sandcelld.service.conf")
}

/// What a process started through [`UnitSandbox::apply`] gets.
#[derive(Clone)]
pub struct UnitSandbox {
    /// Seccomp programs, installed in this order.
    filters: Vec<Vec<libc::sock_filter>>,
    /// Capabilities dropped from the bounding set.
    drop_caps: Vec<u32>,
    no_new_privs: bool,
    /// System calls the allow-list admits, by name (for the audit test).
    pub allowed: BTreeSet<String>,
}

/// `[Service]` settings of a unit file: every value of each key, in order.
pub fn service_settings(text: &str) -> HashMap<String, Vec<String>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let mut in_service = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            in_service = line == "[Service]";
            continue;
        }
        if !in_service {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            out.entry(k.trim().to_owned())
                .or_default()
                .push(v.trim().to_owned());
        }
    }
    out
}

/// Every group `systemd-analyze syscall-filter` lists, by name, with its entries (system calls
/// and nested groups).
pub fn syscall_groups() -> HashMap<String, Vec<String>> {
    let out = Command::new("systemd-analyze")
        .arg("syscall-filter")
        .output()
        .expect("systemd-analyze (systemd) is needed to expand the unit's SystemCallFilter groups");
    assert!(
        out.status.success(),
        "systemd-analyze syscall-filter failed"
    );
    let mut groups: HashMap<String, Vec<String>> = HashMap::new();
    let mut cur: Option<String> = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.starts_with('@') {
            cur = Some(line.trim().to_owned());
            groups.entry(line.trim().to_owned()).or_default();
        } else if let Some(g) = &cur {
            let e = line.trim();
            if e.is_empty() || e.starts_with('#') {
                if e.is_empty() {
                    cur = None;
                }
                continue;
            }
            groups.get_mut(g).unwrap().push(e.to_owned());
        }
    }
    groups
}

/// The system calls `entry` (a name or `@group`) stands for.
pub fn expand(entry: &str, groups: &HashMap<String, Vec<String>>, out: &mut BTreeSet<String>) {
    if entry.starts_with('@') {
        let g = groups
            .get(entry)
            .unwrap_or_else(|| panic!("systemd-analyze knows no group {entry}"));
        for e in g {
            expand(e, groups, out);
        }
    } else {
        out.insert(entry.to_owned());
    }
}

/// This machine's system call numbers by name, from the kernel's UAPI header.
pub fn syscall_numbers() -> HashMap<String, i64> {
    let header = if cfg!(target_arch = "x86_64") {
        "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
    } else {
        "/usr/include/aarch64-linux-gnu/asm/unistd.h"
    };
    let text = std::fs::read_to_string(header)
        .unwrap_or_else(|e| panic!("{header} (linux-libc-dev) names the system calls: {e}"));
    let mut out = HashMap::new();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        if let (Some("#define"), Some(name), Some(num)) = (w.next(), w.next(), w.next())
            && let (Some(name), Ok(num)) = (name.strip_prefix("__NR_"), num.parse::<i64>())
        {
            out.insert(name.to_owned(), num);
        }
    }
    assert!(
        out.contains_key("openat"),
        "no system call numbers in {header}"
    );
    out
}

fn errno_named(name: &str) -> u32 {
    let n = match name {
        "EPERM" => libc::EPERM,
        "EACCES" => libc::EACCES,
        "ENOSYS" => libc::ENOSYS,
        "EINVAL" => libc::EINVAL,
        "ENOTSUP" | "EOPNOTSUPP" => libc::EOPNOTSUPP,
        "EAFNOSUPPORT" => libc::EAFNOSUPPORT,
        other => other
            .parse()
            .unwrap_or_else(|_| panic!("errno {other:?}: not modelled by the unit sandbox")),
    };
    n as u32
}

/// Capability names (capability.h) to numbers.
const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

fn yes(s: &HashMap<String, Vec<String>>, key: &str) -> bool {
    s.get(key)
        .and_then(|v| v.last())
        .is_some_and(|v| matches!(v.as_str(), "yes" | "true" | "on" | "1"))
}

/// Every assignment of an allow-list `key` merged as systemd does: the union of the lines
/// after the last empty one (empty when that is the last). Deny-lists (`~`) are returned as their last line (the callers
/// refuse or handle them whole).
fn merged(s: &HashMap<String, Vec<String>>, key: &str) -> Option<String> {
    let lines = s.get(key)?;
    let from = lines
        .iter()
        .rposition(|l| l.is_empty())
        .map_or(0, |i| i + 1);
    let lines = &lines[from..];
    if lines.iter().any(|l| l.starts_with('~')) {
        return lines.last().cloned();
    }
    let mut out: Vec<&str> = Vec::new();
    for w in lines.iter().flat_map(|l| l.split_whitespace()) {
        if !out.contains(&w) {
            out.push(w);
        }
    }
    Some(out.join(" "))
}

fn cond(arg: u8, len: Len, op: Op, v: u64) -> SeccompCondition {
    SeccompCondition::new(arg, len, op, v).unwrap()
}

fn rule(c: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(c).unwrap()
}

/// A filter answering `errno` for the rules given (an empty rule list: always), allowing
/// everything else.
fn deny(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: u32) -> Vec<libc::sock_filter> {
    compile(SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno),
        std::env::consts::ARCH.try_into().unwrap(),
    ))
}

fn compile(f: Result<SeccompFilter, seccompiler::BackendError>) -> Vec<libc::sock_filter> {
    let prog: BpfProgram = f.unwrap().try_into().unwrap();
    prog.iter()
        .map(|i| libc::sock_filter {
            code: i.code,
            jt: i.jt,
            jf: i.jf,
            k: i.k,
        })
        .collect()
}

impl UnitSandbox {
    /// The sandbox of the unit file at `unit`. Panics (naming the setting) on what it cannot
    /// model.
    pub fn from_unit(unit: &Path) -> UnitSandbox {
        Self::from_unit_with(unit, &[])
    }

    /// The sandbox of the unit file at `unit` with the drop-ins `drop_ins` read after it, in
    /// order, as systemd reads `<unit>.d/*.conf`: every assignment of a key after the unit's
    /// own, merged as systemd.exec(5) says (`RestrictAddressFamilies=` and
    /// `CapabilityBoundingSet=` allow-lists given more than once are their union; an empty
    /// assignment resets the list).
    pub fn from_unit_with(unit: &Path, drop_ins: &[PathBuf]) -> UnitSandbox {
        let mut text = std::fs::read_to_string(unit).unwrap();
        for d in drop_ins {
            text.push('\n');
            text.push_str(&std::fs::read_to_string(d).unwrap());
        }
        let s = service_settings(&text);
        let groups = syscall_groups();
        let nr = syscall_numbers();
        let num = |name: &str| nr.get(name).copied();
        let mut filters = Vec::new();

        // SystemCallFilter=: the first line decides allow-list or deny-list.
        let mut allowed = BTreeSet::new();
        let mut denied = BTreeSet::new();
        let mut allow_list = None;
        for line in s.get("SystemCallFilter").into_iter().flatten() {
            let (neg, body) = match line.strip_prefix('~') {
                Some(b) => (true, b),
                None => (false, line.as_str()),
            };
            if allow_list.is_none() {
                allow_list = Some(!neg);
                if !neg {
                    expand("@default", &groups, &mut allowed);
                }
            }
            let mut set = BTreeSet::new();
            for e in body.split_whitespace() {
                // "name:errno" sets a per-call errno; the call is what counts here.
                expand(e.split(':').next().unwrap(), &groups, &mut set);
            }
            if allow_list == Some(true) {
                if neg {
                    allowed.retain(|c| !set.contains(c));
                } else {
                    allowed.extend(set);
                }
            } else if neg {
                denied.extend(set);
            } else {
                denied.retain(|c| !set.contains(c));
            }
        }
        // Settings that add a deny-list of their own.
        let mut implied = BTreeSet::new();
        if yes(&s, "ProtectClock") {
            expand("@clock", &groups, &mut implied);
        }
        if yes(&s, "ProtectKernelModules") {
            expand("@module", &groups, &mut implied);
        }
        if yes(&s, "PrivateDevices") {
            expand("@raw-io", &groups, &mut implied);
        }
        if yes(&s, "ProtectKernelLogs") {
            implied.insert("syslog".into());
        }
        if yes(&s, "ProtectHostname") {
            implied.insert("sethostname".into());
            implied.insert("setdomainname".into());
        }
        let errno = s
            .get("SystemCallErrorNumber")
            .and_then(|v| v.last())
            .map(|e| SeccompAction::Errno(errno_named(e)))
            .unwrap_or(SeccompAction::KillProcess);
        match allow_list {
            Some(true) => {
                allowed.retain(|c| !implied.contains(c));
                let rules = allowed
                    .iter()
                    .filter_map(|c| num(c))
                    .map(|n| (n, vec![]))
                    .collect();
                filters.push(compile(SeccompFilter::new(
                    rules,
                    errno,
                    SeccompAction::Allow,
                    std::env::consts::ARCH.try_into().unwrap(),
                )));
            }
            _ => {
                denied.extend(implied);
                let rules: BTreeMap<_, _> = denied
                    .iter()
                    .filter_map(|c| num(c))
                    .map(|n| (n, vec![]))
                    .collect();
                if !rules.is_empty() {
                    filters.push(compile(SeccompFilter::new(
                        rules,
                        SeccompAction::Allow,
                        errno,
                        std::env::consts::ARCH.try_into().unwrap(),
                    )));
                }
            }
        }

        if yes(&s, "RestrictSUIDSGID") {
            let mut r: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
            let bits = [libc::S_ISUID as u64, libc::S_ISGID as u64];
            let mode_at = |arg: u8| -> Vec<SeccompRule> {
                bits.iter()
                    .map(|b| rule(vec![cond(arg, Len::Dword, Op::MaskedEq(*b), *b)]))
                    .collect()
            };
            let creat_at = |flags: u8, mode: u8| -> Vec<SeccompRule> {
                let mut v = Vec::new();
                for f in [
                    libc::O_CREAT as u64,
                    (libc::O_TMPFILE & !libc::O_DIRECTORY) as u64,
                ] {
                    for b in bits {
                        v.push(rule(vec![
                            cond(flags, Len::Dword, Op::MaskedEq(f), f),
                            cond(mode, Len::Dword, Op::MaskedEq(b), b),
                        ]));
                    }
                }
                v
            };
            for (name, rules) in [
                ("chmod", mode_at(1)),
                ("fchmod", mode_at(1)),
                ("fchmodat", mode_at(2)),
                ("fchmodat2", mode_at(2)),
                ("mknod", mode_at(1)),
                ("mknodat", mode_at(2)),
                ("creat", mode_at(1)),
                ("open", creat_at(1, 2)),
                ("openat", creat_at(2, 3)),
            ] {
                if let Some(n) = num(name) {
                    r.insert(n, rules);
                }
            }
            filters.push(deny(r, libc::EPERM as u32));
            filters.push(deny(
                [(num("openat2").unwrap(), vec![])].into_iter().collect(),
                libc::ENOSYS as u32,
            ));
        }

        if let Some(v) = s.get("RestrictNamespaces").and_then(|v| v.last()) {
            let all = [
                ("cgroup", libc::CLONE_NEWCGROUP),
                ("ipc", libc::CLONE_NEWIPC),
                ("net", libc::CLONE_NEWNET),
                ("mnt", libc::CLONE_NEWNS),
                ("pid", libc::CLONE_NEWPID),
                ("user", libc::CLONE_NEWUSER),
                ("uts", libc::CLONE_NEWUTS),
                ("time", 0x80),
            ];
            let listed: Vec<&str> = match v.as_str() {
                "yes" | "true" => vec![],
                "no" | "false" => all.iter().map(|(n, _)| *n).collect(),
                v => match v.strip_prefix('~') {
                    Some(rest) => {
                        let neg: Vec<&str> = rest.split_whitespace().collect();
                        all.iter()
                            .map(|(n, _)| *n)
                            .filter(|n| !neg.contains(n))
                            .collect()
                    }
                    None => v.split_whitespace().collect(),
                },
            };
            let refused: Vec<u64> = all
                .iter()
                .filter(|(n, _)| !listed.contains(n))
                .map(|(_, f)| *f as u64)
                .collect();
            if !refused.is_empty() {
                let mut r: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
                let flag_rules = |arg: u8| -> Vec<SeccompRule> {
                    refused
                        .iter()
                        .map(|f| rule(vec![cond(arg, Len::Qword, Op::MaskedEq(*f), *f)]))
                        .collect()
                };
                r.insert(num("unshare").unwrap(), flag_rules(0));
                r.insert(num("clone").unwrap(), flag_rules(0));
                let mut setns: Vec<SeccompRule> = refused
                    .iter()
                    .map(|f| rule(vec![cond(1, Len::Dword, Op::Eq, *f)]))
                    .collect();
                setns.push(rule(vec![cond(1, Len::Dword, Op::Eq, 0)]));
                r.insert(num("setns").unwrap(), setns);
                filters.push(deny(r, libc::EPERM as u32));
                filters.push(deny(
                    [(num("clone3").unwrap(), vec![])].into_iter().collect(),
                    libc::ENOSYS as u32,
                ));
            }
        }

        // An empty assignment lifts the restriction (systemd.exec(5)).
        if let Some(v) = merged(&s, "RestrictAddressFamilies").filter(|v| !v.is_empty()) {
            let v = &v;
            assert!(
                !v.starts_with('~'),
                "RestrictAddressFamilies=~...: a deny-list is not modelled by the unit sandbox"
            );
            let fam = |n: &str| match n {
                "AF_UNIX" | "AF_LOCAL" => libc::AF_UNIX,
                "AF_INET" => libc::AF_INET,
                "AF_INET6" => libc::AF_INET6,
                "AF_NETLINK" => libc::AF_NETLINK,
                "AF_PACKET" => libc::AF_PACKET,
                "none" => -1,
                o => panic!("RestrictAddressFamilies: {o} not modelled by the unit sandbox"),
            };
            let ok: Vec<i64> = v.split_whitespace().map(|n| fam(n) as i64).collect();
            let conds: Vec<SeccompCondition> = ok
                .iter()
                .filter(|f| **f >= 0)
                .map(|f| cond(0, Len::Dword, Op::Ne, *f as u64))
                .collect();
            let rules = if conds.is_empty() {
                vec![]
            } else {
                vec![rule(conds)]
            };
            filters.push(deny(
                [(num("socket").unwrap(), rules)].into_iter().collect(),
                libc::EAFNOSUPPORT as u32,
            ));
        }

        if yes(&s, "LockPersonality") {
            filters.push(deny(
                [(
                    num("personality").unwrap(),
                    vec![rule(vec![
                        cond(0, Len::Dword, Op::Ne, 0),
                        cond(0, Len::Dword, Op::Ne, 0xffff_ffff),
                    ])],
                )]
                .into_iter()
                .collect(),
                libc::EPERM as u32,
            ));
        }

        if yes(&s, "RestrictRealtime") {
            let rt = [libc::SCHED_FIFO as u64, libc::SCHED_RR as u64];
            let rules = rt
                .iter()
                .map(|p| {
                    rule(vec![cond(
                        1,
                        Len::Dword,
                        Op::MaskedEq(!(libc::SCHED_RESET_ON_FORK as u64) & 0xffff_ffff),
                        *p,
                    )])
                })
                .collect();
            filters.push(deny(
                [(num("sched_setscheduler").unwrap(), rules)]
                    .into_iter()
                    .collect(),
                libc::EPERM as u32,
            ));
        }

        if yes(&s, "MemoryDenyWriteExecute") {
            let wx = (libc::PROT_WRITE | libc::PROT_EXEC) as u64;
            let x = libc::PROT_EXEC as u64;
            let mut r: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
            r.insert(
                num("mmap").unwrap(),
                vec![rule(vec![cond(2, Len::Dword, Op::MaskedEq(wx), wx)])],
            );
            for n in ["mprotect", "pkey_mprotect"] {
                r.insert(
                    num(n).unwrap(),
                    vec![rule(vec![cond(2, Len::Dword, Op::MaskedEq(x), x)])],
                );
            }
            filters.push(deny(r, libc::EPERM as u32));
        }

        let mut drop_caps = Vec::new();
        if let Some(v) = merged(&s, "CapabilityBoundingSet") {
            let v = &v;
            let (neg, body) = match v.strip_prefix('~') {
                Some(b) => (true, b),
                None => (false, v.as_str()),
            };
            let named: Vec<&str> = body.split_whitespace().collect();
            for n in &named {
                assert!(CAPS.contains(n), "CapabilityBoundingSet: unknown {n}");
            }
            let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .unwrap_or(40);
            for cap in 0..=last {
                let name = CAPS.get(cap as usize).copied().unwrap_or("");
                if named.contains(&name) == neg {
                    drop_caps.push(cap);
                }
            }
        }

        UnitSandbox {
            filters,
            drop_caps,
            no_new_privs: yes(&s, "NoNewPrivileges"),
            allowed: if allow_list == Some(true) {
                allowed
            } else {
                BTreeSet::new()
            },
        }
    }

    /// The sandbox of the repository's `units/sandcelld.service`.
    pub fn of_unit() -> UnitSandbox {
        Self::from_unit(&unit_path())
    }

    /// Makes `cmd` start under the sandbox: between fork and exec, no_new_privs, the bounding
    /// set, then the seccomp filters (so the exec and everything after it is filtered, as
    /// under systemd).
    pub fn apply(&self, cmd: &mut Command) {
        let me = self.clone();
        // SAFETY: the closure only makes prctl calls on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fail = || Err(std::io::Error::last_os_error());
                if me.no_new_privs && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return fail();
                }
                for cap in &me.drop_caps {
                    if libc::prctl(libc::PR_CAPBSET_DROP, *cap as libc::c_ulong, 0, 0, 0) != 0 {
                        return fail();
                    }
                }
                for f in &me.filters {
                    let prog = libc::sock_fprog {
                        len: f.len() as u16,
                        filter: f.as_ptr() as *mut libc::sock_filter,
                    };
                    if libc::prctl(
                        libc::PR_SET_SECCOMP,
                        libc::SECCOMP_MODE_FILTER,
                        &prog as *const libc::sock_fprog,
                    ) != 0
                    {
                        return fail();
                    }
                }
                Ok(())
            });
        }
    }
}
