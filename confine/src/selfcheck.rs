//! The start-up self-check: which confinement layers the running kernel and the daemon's
//! privileges allow ([`self_check`]), and what stands between this host and
//! [`Enforcement::Strict`](crate::Enforcement::Strict) ([`SelfCheck::problems`], each with an operator hint). Probes that
//! change process state run in forked children ([`seccomp::probe_in_child`],
//! [`mounts::probe`]).

use crate::{Error, landlock, mounts, policy, seccomp, step};
use serde::{Deserialize, Serialize};

/// What the host offers, found by [`self_check`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SelfCheck {
    /// Landlock ABI of the running kernel, `None` if Landlock is not built in or not enabled.
    pub kernel_landlock_abi: Option<i32>,
    /// Landlock ABI to plan with: the kernel's, lowered by [`landlock::TEST_ABI_ENV`].
    pub landlock_abi: Option<i32>,
    /// The test cap in force, if any (`Some(0)`: Landlock off).
    pub landlock_test_cap: Option<i32>,
    /// Whether a seccomp filter could be installed in a forked child and denied a call there.
    pub seccomp: bool,
    /// Whether `PR_SET_NO_NEW_PRIVS` could be set in a forked child.
    pub no_new_privs: bool,
    /// Whether a forked child could unshare network and IPC namespaces (needs root).
    pub namespaces: bool,
    /// Whether a forked child could build a mount namespace with a tmpfs and a procfs.
    pub mount_namespace: bool,
    /// Whether the caller can switch identity (effective uid 0).
    pub root: bool,
    /// What stands between this host and [`Enforcement::Strict`](crate::Enforcement::Strict), each with an operator hint,
    /// assuming session cgroups are present (the daemon checks those itself). Empty when
    /// strict enforcement will work.
    pub problems: Vec<String>,
}

impl SelfCheck {
    /// The host as [`policy::evaluate`] sees it, with or without session `cgroups`.
    pub fn host(&self, cgroups: bool) -> policy::Host {
        policy::Host {
            landlock_abi: self.landlock_abi,
            seccomp: self.seccomp && self.no_new_privs,
            session_uids: self.root,
            network_namespace: self.namespaces,
            mount_namespace: self.mount_namespace,
            cgroups,
        }
    }

    /// Succeeds when every worker could be confined under [`Enforcement::Strict`](crate::Enforcement::Strict).
    ///
    /// Errors: [`Error::Unavailable`] naming every problem found, with its hint.
    pub fn require_strict(&self) -> Result<(), Error> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Unavailable {
                layer: "self-check",
                reason: self.problems.join("; "),
            })
        }
    }
}

/// Checks, at daemon start, which layers the kernel and the daemon's privileges allow. Safe
/// to call from a multi-threaded process: probes that change process state run in forked
/// children that only make raw system calls and `_exit`.
///
/// Errors: only if `fork` itself fails, or [`landlock::TEST_ABI_ENV`] is malformed; what is
/// missing is reported in [`SelfCheck::problems`].
pub fn self_check() -> Result<SelfCheck, Error> {
    let cap = landlock::test_abi_cap().map_err(Error::Plan)?;
    let mut check = SelfCheck {
        kernel_landlock_abi: landlock::kernel_abi(),
        landlock_abi: landlock::effective_abi(cap),
        landlock_test_cap: cap,
        // SAFETY: geteuid has no preconditions and cannot fail.
        root: unsafe { libc::geteuid() } == 0,
        ..SelfCheck::default()
    };
    let probes = seccomp::probe_in_child().map_err(step("self-check"))?;
    check.seccomp = probes.seccomp;
    check.no_new_privs = probes.no_new_privs;
    check.namespaces = probes.namespaces;
    check.mount_namespace = check.root && mounts::probe().map_err(step("self-check"))?;

    if !check.no_new_privs {
        check
            .problems
            .push("prctl(PR_SET_NO_NEW_PRIVS) failed in a test child".into());
    }
    if !check.seccomp {
        check.problems.push(
            "seccomp filters are unavailable: the kernel needs CONFIG_SECCOMP_FILTER=y, a \
             container runtime must not forbid seccomp(2), and sandcelld.service's \
             SystemCallFilter= must allow it"
                .into(),
        );
    }
    if !check.root {
        check.problems.push(
            "sandcelld is not running as root: it cannot switch workers to their uid \
             (run it from sandcelld.service, or pass --insecure-dev)"
                .into(),
        );
    } else if !check.namespaces {
        check.problems.push(
            "unshare(CLONE_NEWNET|CLONE_NEWIPC) failed in a test child: the daemon lacks \
             CAP_SYS_ADMIN (check CapabilityBoundingSet= and RestrictNamespaces= in \
             sandcelld.service)"
                .into(),
        );
    }
    // Every threat needs an enforced layer (network namespaces are always planned).
    if check.root && check.namespaces {
        check
            .problems
            .extend(policy::evaluate(&check.host(true)).problems());
    }
    Ok(check)
}
