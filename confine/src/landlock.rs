//! Step 8: Landlock.
//!
//! The ruleset *handles* every right the running kernel knows (file system, TCP, scopes) and
//! *grants* only:
//!
//! | paths | rights |
//! |-------|--------|
//! | `read_paths` | read files, list directories |
//! | `exec_paths` | the same, plus execute |
//! | `session_dir`, `write_paths` | read, write, create, remove, rename, truncate; never execute, never make devices, sockets or (ABI 9) connect to a unix socket |
//! | TCP | nothing: every bind and connect is denied (ABI 4+) |
//! | scopes | abstract unix sockets and signals are confined to the worker's own domain (ABI 6+) |
//!
//! Write paths are never executable: a cell that drops a binary into its session directory
//! cannot `execve` it (R's `system()` still runs `/bin/sh` from `exec_paths`). This is not a
//! full W^X: Landlock does not mediate `mmap(PROT_EXEC)` of a readable file (R's `dyn.load`)
//! nor executing a memfd, so a native worker must be assumed able to run native code of its
//! choosing; the walls (identity, capabilities, Landlock paths, seccomp, cgroup) are what
//! bound that code.
//!
//! The ABI is read from the kernel and the rights chosen for exactly that ABI (explicit
//! per-ABI access sets: `AccessFs::from_all(abi)`, `AccessNet::from_all(abi)`,
//! `Scope::from_all(abi)`), then the ruleset is applied with
//! [`CompatLevel::HardRequirement`], so nothing the code asked for is silently dropped. The
//! `landlock` crate recommends fixing the ABI at build time; sandcell instead enforces
//! everything the kernel offers, because the daemon runs on kernels it did not choose. There is
//! no ABI floor: [`crate::policy`] decides whether the layers present cover every threat.
//!
//! ABI 1 denies every link or rename across directories (`EXDEV`), even inside the session
//! directory: `LANDLOCK_ACCESS_FS_REFER`, which lets a ruleset allow them, arrived in ABI 2.
//! Where a mount namespace is available, [`crate::policy::evaluate`] therefore does not apply
//! ABI 1 at all and lets the mount namespace enforce the allowlist.
//!
//! For tests only, [`TEST_ABI_ENV`] lowers the ABI the daemon plans with (never raises it).
//!
//! What Landlock ABI 7 does not cover, and who does: connecting to a *pathname* unix socket
//! (until ABI 9's `ResolveUnix`) and UDP (until ABI 10): seccomp denies `socket(2)` entirely
//! (see [`crate::seccomp`]).

use crate::{Error, Plan};
use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};
use std::path::{Path, PathBuf};

/// What [`apply`] enforced.
#[derive(Debug)]
pub struct Applied {
    /// The Landlock ABI whose rights were handled.
    pub abi: i32,
    /// Paths of the plan that did not exist (no rule added).
    pub missing_paths: Vec<PathBuf>,
}

/// The running kernel's Landlock ABI, or `None` when Landlock is not built in (`ENOSYS`) or not
/// enabled at boot (`EOPNOTSUPP`).
pub fn kernel_abi() -> Option<i32> {
    // SAFETY: with a null attribute, size 0 and LANDLOCK_CREATE_RULESET_VERSION (1), the call
    // only returns the ABI version; no memory is read or written.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32,
        )
    };
    (v > 0).then_some(v as i32)
}

/// Test-only environment variable read by the daemon (never by a worker): the highest
/// Landlock ABI to plan with, `0` or `none` for no Landlock at all. It can only lower what the
/// kernel offers, and the daemon logs it as a warning at start. Not for production: it
/// appears in no shipped configuration file.
pub const TEST_ABI_ENV: &str = "SANDCELL_TEST_LANDLOCK_ABI";

/// The cap set by [`TEST_ABI_ENV`]: `Ok(None)` when unset or empty, `Ok(Some(0))` for no
/// Landlock.
///
/// Errors: a value that is neither `none` nor an integer from 0 to 255.
pub fn test_abi_cap() -> Result<Option<i32>, String> {
    let Some(v) = std::env::var_os(TEST_ABI_ENV) else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    match v.trim() {
        "" => Ok(None),
        "none" | "off" => Ok(Some(0)),
        n => n
            .parse::<u8>()
            .map(|n| Some(i32::from(n)))
            .map_err(|_| format!("{TEST_ABI_ENV}={v}: expected none or 0..255")),
    }
}

/// The ABI to use: the kernel's, lowered to `cap` if given; `None` without Landlock or with
/// `cap` 0.
pub fn effective_abi(cap: Option<i32>) -> Option<i32> {
    let kernel = kernel_abi()?;
    match cap {
        Some(c) if c <= 0 => None,
        Some(c) => Some(kernel.min(c)),
        None => Some(kernel),
    }
}

/// Rights granted on read-only paths.
fn read_rights() -> BitFlags<AccessFs> {
    AccessFs::ReadFile | AccessFs::ReadDir
}

/// Rights granted on executable paths.
fn exec_rights() -> BitFlags<AccessFs> {
    read_rights() | AccessFs::Execute
}

/// Rights granted on the session directory and write paths for `abi`: everything handled but
/// execute, device nodes, and unix sockets.
fn write_rights(abi: ABI) -> BitFlags<AccessFs> {
    AccessFs::from_all(abi)
        & !(AccessFs::Execute
            | AccessFs::MakeChar
            | AccessFs::MakeBlock
            | AccessFs::MakeSock
            | AccessFs::ResolveUnix)
}

/// Restricts the calling thread (and its future children) to `plan`'s paths, handling the
/// rights of Landlock ABI `version` (at most the kernel's).
///
/// Errors: [`Error::Unavailable`] when the kernel has no Landlock or an older ABI than
/// `version`; [`Error::Step`] (`landlock`) when the ruleset cannot be built or applied, or the
/// session directory does not exist.
pub fn apply(plan: &Plan, version: i32) -> Result<Applied, Error> {
    match kernel_abi() {
        None => {
            return Err(Error::Unavailable {
                layer: "landlock",
                reason: "the kernel has no landlock (boot with lsm=...,landlock)".into(),
            });
        }
        Some(k) if k < version => {
            return Err(Error::Unavailable {
                layer: "landlock",
                reason: format!("abi {version} asked for, the kernel has {k}"),
            });
        }
        Some(_) => {}
    }
    let abi = ABI::from(version);
    let failed = |what: &str, e: &dyn std::fmt::Display| Error::Step {
        step: "landlock",
        source: std::io::Error::other(format!("{what}: {e}")),
    };

    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi))
        .map_err(|e| failed("handling file-system rights", &e))?;
    if !AccessNet::from_all(abi).is_empty() {
        ruleset = ruleset
            .handle_access(AccessNet::from_all(abi))
            .map_err(|e| failed("handling network rights", &e))?;
    }
    if !Scope::from_all(abi).is_empty() {
        ruleset = ruleset
            .scope(Scope::from_all(abi))
            .map_err(|e| failed("adding scopes", &e))?;
    }
    let mut created = ruleset
        .create()
        .map_err(|e| failed("creating the ruleset", &e))?;

    let mut missing = Vec::new();
    let groups: [(&[PathBuf], BitFlags<AccessFs>); 3] = [
        (&plan.read_paths, read_rights()),
        (&plan.exec_paths, exec_rights()),
        (&plan.write_paths, write_rights(abi)),
    ];
    if !plan.session_dir.is_dir() {
        return Err(failed(
            "session directory",
            &format!("{} is not a directory", plan.session_dir.display()),
        ));
    }
    if let Some(port) = plan.tcp_connect_port
        && AccessNet::from_all(abi).contains(AccessNet::ConnectTcp)
    {
        created = created
            .add_rule(landlock::NetPort::new(port, AccessNet::ConnectTcp))
            .map_err(|e| failed(&format!("rule for TCP port {port}"), &e))?;
    }
    let session = [plan.session_dir.clone()];
    for (paths, rights) in groups
        .into_iter()
        .chain([(&session[..], write_rights(abi))])
    {
        for path in paths {
            match rule(path, rights, abi) {
                Ok(Some(r)) => {
                    created = created
                        .add_rule(r)
                        .map_err(|e| failed(&format!("rule for {}", path.display()), &e))?;
                }
                Ok(None) => missing.push(path.clone()),
                Err(e) => return Err(e),
            }
        }
    }

    let status = created
        .restrict_self()
        .map_err(|e| failed("landlock_restrict_self", &e))?;
    if status.ruleset != RulesetStatus::FullyEnforced {
        return Err(failed("enforcement", &format!("{:?}", status.ruleset)));
    }
    Ok(Applied {
        abi: version.min(abi as i32),
        missing_paths: missing,
    })
}

/// A rule granting `rights` beneath `path` (only the file rights if `path` is not a
/// directory), or `None` if `path` does not exist.
fn rule(
    path: &Path,
    rights: BitFlags<AccessFs>,
    abi: ABI,
) -> Result<Option<PathBeneath<PathFd>>, Error> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Step {
                step: "landlock",
                source: std::io::Error::new(e.kind(), format!("stat {}: {e}", path.display())),
            });
        }
    };
    let rights = if meta.is_dir() {
        rights
    } else {
        rights & AccessFs::from_file(abi)
    };
    // PathFd opens with O_PATH | O_CLOEXEC; it is closed when the rule is dropped.
    let fd = PathFd::new(path).map_err(|e| Error::Step {
        step: "landlock",
        source: std::io::Error::other(format!("open {}: {e}", path.display())),
    })?;
    Ok(Some(PathBeneath::new(fd, rights)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_paths_are_never_executable() {
        for v in 1..=10 {
            let abi = ABI::from(v);
            let w = write_rights(abi);
            assert!(!w.contains(AccessFs::Execute), "abi {v}");
            assert!(
                !w.contains(AccessFs::MakeChar | AccessFs::MakeBlock),
                "abi {v}"
            );
            assert!(
                w.contains(AccessFs::WriteFile | AccessFs::MakeReg),
                "abi {v}"
            );
        }
        assert!(!read_rights().contains(AccessFs::Execute));
        assert!(exec_rights().contains(AccessFs::Execute));
    }
}
