//! The confinement policy as data: which layer stops which threat, and at which Landlock ABI.
//!
//! Strict mode does not require one particular kernel. It requires that every [`Threat`] has
//! at least one *enforced* layer on this host; it then enforces every layer the host offers,
//! and says once, at start, which optional layers are missing and what covers their threats.
//! [`evaluate`] is that decision; [`THREATS`] is the table it reads, and the table printed in
//! sandcelld(8) and docs/internals/confinement.md.
//!
//! A layer *covers* a threat when it stops it on its own. Layers that only narrow a threat
//! (file permissions for the per-session uid, the network namespace for pathname unix sockets)
//! are listed in [`ThreatRow::partial`] for the record, but never count.
//!
//! Landlock rights by ABI (Linux kernel documentation, `userspace-api/landlock.rst`):
//!
//! | ABI | kernel | adds |
//! |-----|--------|------|
//! | 1 | 5.13 | file-system access rights; every link or rename across directories is denied (`EXDEV`) |
//! | 2 | 5.19 | `REFER`: links and renames across directories, checked like the rights of both ends |
//! | 3 | 6.2 | `TRUNCATE`: `truncate(2)`, `O_TRUNC` |
//! | 4 | 6.7 | TCP bind and connect |
//! | 5 | 6.10 | `IOCTL_DEV`: ioctls on device files |
//! | 6 | 6.12 | scopes: abstract unix sockets and signals outside the domain |
//! | 7 | 6.15 | audit logging of denials (no new restriction) |
//!
//! ABI 1 is not applied when the mount namespace is available: its blanket refusal of
//! cross-directory renames breaks ordinary file handling inside the session directory (R's
//! `tempfile()` lives in a subdirectory, and `file.rename()` of a result into the session
//! directory fails with `EXDEV`), while the mount namespace enforces the same path allowlist.
//! Landlock is then reported as *substituted*.

use serde::{Deserialize, Serialize};

/// One confinement layer (or, for Landlock, one group of rights arriving with an ABI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layer {
    /// Every session runs as its own uid and gid, with no supplementary group and no
    /// capability.
    SessionUid,
    /// An empty network namespace (loopback down) and a private IPC namespace per worker.
    NetworkNamespace,
    /// The worker's system-call filter (no `socket(2)`, no namespaces, no `mount`, ...).
    Seccomp,
    /// The session cgroup: memory.max, memory.swap.max=0, pids.max, cpu.max.
    Cgroups,
    /// A per-worker mount namespace: a new root holding only the allowlisted paths
    /// (read-only), the session directory (read-write), private tmpfs /tmp, /var/tmp and
    /// /dev/shm, a minimal /dev and a procfs with `hidepid=invisible`.
    MountNamespace,
    /// Landlock ABI 1: file-system rights on the path allowlist.
    LandlockFs,
    /// Landlock ABI 2: `REFER`.
    LandlockRefer,
    /// Landlock ABI 3: `TRUNCATE`.
    LandlockTruncate,
    /// Landlock ABI 4: TCP bind and connect.
    LandlockTcp,
    /// Landlock ABI 5: `IOCTL_DEV`.
    LandlockIoctlDev,
    /// Landlock ABI 6: signal and abstract-unix-socket scopes.
    LandlockScopes,
}

/// Every layer, in the order reports list them.
pub const LAYERS: [Layer; 11] = [
    Layer::SessionUid,
    Layer::NetworkNamespace,
    Layer::Seccomp,
    Layer::Cgroups,
    Layer::MountNamespace,
    Layer::LandlockFs,
    Layer::LandlockRefer,
    Layer::LandlockTruncate,
    Layer::LandlockTcp,
    Layer::LandlockIoctlDev,
    Layer::LandlockScopes,
];

impl Layer {
    /// The Landlock ABI that brings this layer, `None` for the layers that are not Landlock.
    pub fn landlock_abi(self) -> Option<i32> {
        match self {
            Layer::LandlockFs => Some(1),
            Layer::LandlockRefer => Some(2),
            Layer::LandlockTruncate => Some(3),
            Layer::LandlockTcp => Some(4),
            Layer::LandlockIoctlDev => Some(5),
            Layer::LandlockScopes => Some(6),
            _ => None,
        }
    }

    /// Name used in logs, `sandcelld --check`, and the D-Bus `Confinement` property.
    pub fn name(self) -> &'static str {
        match self {
            Layer::SessionUid => "session-uid",
            Layer::NetworkNamespace => "network-namespace",
            Layer::Seccomp => "seccomp",
            Layer::Cgroups => "cgroups",
            Layer::MountNamespace => "mount-namespace",
            Layer::LandlockFs => "landlock-fs",
            Layer::LandlockRefer => "landlock-refer",
            Layer::LandlockTruncate => "landlock-truncate",
            Layer::LandlockTcp => "landlock-tcp",
            Layer::LandlockIoctlDev => "landlock-ioctl-dev",
            Layer::LandlockScopes => "landlock-scopes",
        }
    }
}

/// What an untrusted cell might try.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Threat {
    /// Read host files outside the allowlist (`/etc/shadow`, other sessions, home directories).
    ReadHostFiles,
    /// Create or change files outside the session directory.
    WriteOutsideSession,
    /// Signal (or ptrace) processes other than the session's own.
    SignalOthers,
    /// Reach a unix socket (pathname or abstract), TCP or UDP endpoint.
    ReachSockets,
    /// ioctls on device files (terminals, block devices, ...).
    DeviceIoctls,
    /// Truncate a file outside the session directory.
    TruncateOutside,
    /// Link or rename files across directories to move them out of, or into, the allowlist.
    ReparentFiles,
    /// Reserve host-wide resources: memory, processes, CPU, System V IPC, shared memory.
    ReserveHostResources,
    /// Leave the session cgroup (and its limits).
    CgroupEscape,
    /// Read `/proc/<pid>` of other processes (command lines, environments, maps).
    ProcOfOthers,
}

/// One row of the policy table.
#[derive(Debug, Clone, Copy)]
pub struct ThreatRow {
    /// The threat.
    pub threat: Threat,
    /// Short name, for logs and reports.
    pub name: &'static str,
    /// Layers that stop the threat on their own.
    pub covered_by: &'static [Layer],
    /// Layers that narrow it but do not stop it, and how.
    pub partial: &'static str,
}

/// The policy: for each threat, the layers that stop it.
pub const THREATS: &[ThreatRow] = &[
    ThreatRow {
        threat: Threat::ReadHostFiles,
        name: "read-host-files",
        covered_by: &[Layer::LandlockFs, Layer::MountNamespace],
        partial: "session-uid: file modes only (world-readable files stay readable)",
    },
    ThreatRow {
        threat: Threat::WriteOutsideSession,
        name: "write-outside-session",
        covered_by: &[Layer::LandlockFs, Layer::MountNamespace],
        partial: "session-uid: file modes only (world-writable files and directories stay writable)",
    },
    ThreatRow {
        threat: Threat::SignalOthers,
        name: "signal-others",
        // kill(2) needs the same uid or CAP_KILL: each session has its own uid, no capability,
        // and its uid runs nothing else (the uid is released only after its cgroup is empty).
        covered_by: &[Layer::SessionUid, Layer::LandlockScopes],
        partial: "seccomp: ptrace denied",
    },
    ThreatRow {
        threat: Threat::ReachSockets,
        name: "reach-sockets",
        // socket(2) is denied for every family; the worker holds only its protocol pipes.
        covered_by: &[Layer::Seccomp],
        partial: "network-namespace: no TCP/UDP route, abstract unix names are per namespace; \
                  landlock-tcp: TCP only; landlock-scopes: abstract unix only; \
                  mount-namespace: pathname sockets outside the view",
    },
    ThreatRow {
        threat: Threat::DeviceIoctls,
        name: "device-ioctls",
        // An ioctl needs an open device: the allowlist opens only /dev/null and /dev/urandom,
        // and kept descriptors are pipes, never terminals.
        covered_by: &[
            Layer::LandlockFs,
            Layer::LandlockIoctlDev,
            Layer::MountNamespace,
        ],
        partial: "seccomp: TIOCSTI, TIOCLINUX and similar commands denied",
    },
    ThreatRow {
        threat: Threat::TruncateOutside,
        name: "truncate-outside-session",
        covered_by: &[Layer::LandlockTruncate, Layer::MountNamespace],
        partial: "landlock-fs: opening for writing only (truncate(2) and O_RDONLY|O_TRUNC pass); \
                  session-uid: file modes only",
    },
    ThreatRow {
        threat: Threat::ReparentFiles,
        name: "link-rename-across-directories",
        // ABI 1 denies every cross-directory link or rename; ABI 2 checks both ends. Across
        // bind mounts, link and rename fail with EXDEV.
        covered_by: &[
            Layer::LandlockFs,
            Layer::LandlockRefer,
            Layer::MountNamespace,
        ],
        partial: "session-uid: fs.protected_hardlinks",
    },
    ThreatRow {
        threat: Threat::ReserveHostResources,
        name: "reserve-host-resources",
        covered_by: &[Layer::Cgroups],
        partial: "rlimits: per uid; network-namespace: private IPC namespace; \
                  mount-namespace: private /dev/shm",
    },
    ThreatRow {
        threat: Threat::CgroupEscape,
        name: "cgroup-escape",
        // cgroup.procs files are root's: moving a process needs write access to the common
        // ancestor's cgroup.procs.
        covered_by: &[Layer::SessionUid, Layer::LandlockFs, Layer::MountNamespace],
        partial: "seccomp: no new cgroup namespace",
    },
    ThreatRow {
        threat: Threat::ProcOfOthers,
        name: "proc-of-others",
        covered_by: &[Layer::LandlockFs, Layer::MountNamespace],
        partial: "session-uid: environ and maps need ptrace access; cmdline and stat do not",
    },
];

/// What the host offers, as found at daemon start (or capped for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Host {
    /// Landlock ABI to use: the kernel's, lowered by a test cap if any; `None` without
    /// Landlock.
    pub landlock_abi: Option<i32>,
    /// seccomp filters can be installed.
    pub seccomp: bool,
    /// The daemon is root: workers get their own uid.
    pub session_uids: bool,
    /// Network and IPC namespaces can be created.
    pub network_namespace: bool,
    /// A mount namespace can be created and mounts made in it.
    pub mount_namespace: bool,
    /// Session cgroups with their limits are in use.
    pub cgroups: bool,
}

/// The state of one layer after [`evaluate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayerState {
    /// Enforced for every worker.
    Active,
    /// Available but deliberately not used; another layer enforces what it would.
    Substituted,
    /// Not available on this host (or with these privileges).
    Missing,
}

impl LayerState {
    /// `active`, `substituted` or `missing`.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerState::Active => "active",
            LayerState::Substituted => "substituted",
            LayerState::Missing => "missing",
        }
    }
}

/// The outcome of [`evaluate`]: what workers will enforce and whether strict mode may start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The host the decision was made for.
    pub host: Host,
    /// Landlock ABI workers apply, `None` for no Landlock at all.
    pub landlock_abi: Option<i32>,
    /// Whether workers build a mount namespace.
    pub mount_namespace: bool,
    /// Each layer's state, in [`LAYERS`] order.
    pub layers: Vec<(Layer, LayerState)>,
    /// Each threat (by [`ThreatRow::name`]) with the active layers that stop it, in
    /// [`THREATS`] order.
    pub threats: Vec<(String, Vec<Layer>)>,
}

impl Decision {
    /// The state of `layer`.
    pub fn state(&self, layer: Layer) -> LayerState {
        self.layers
            .iter()
            .find(|(l, _)| *l == layer)
            .map(|(_, s)| *s)
            .unwrap_or(LayerState::Missing)
    }

    /// Names of the threats no active layer stops; strict mode starts only when empty.
    pub fn uncovered(&self) -> Vec<&str> {
        self.threats
            .iter()
            .filter(|(_, by)| by.is_empty())
            .map(|(t, _)| t.as_str())
            .collect()
    }

    /// Whether strict mode may start.
    pub fn strict_ok(&self) -> bool {
        self.uncovered().is_empty()
    }

    /// One line per layer that is not active: `"<layer> missing: <threat> covered by <layers>"`
    /// (what the daemon logs once at start).
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (layer, state) in &self.layers {
            if *state == LayerState::Active {
                continue;
            }
            let mut covers = Vec::new();
            for row in THREATS.iter().filter(|r| r.covered_by.contains(layer)) {
                let by = self
                    .threats
                    .iter()
                    .find(|(t, _)| t == row.name)
                    .map(|(_, by)| by.iter().map(|l| l.name()).collect::<Vec<_>>())
                    .unwrap_or_default();
                covers.push(if by.is_empty() {
                    format!("{} NOT COVERED", row.name)
                } else {
                    format!("{} by {}", row.name, by.join("+"))
                });
            }
            let why = match (layer, state) {
                (Layer::LandlockFs, LayerState::Substituted) => {
                    " (landlock abi 1 refuses every rename across directories; the mount \
                     namespace enforces the same allowlist)"
                }
                _ => "",
            };
            out.push(format!(
                "{} {}{why}: {}",
                layer.name(),
                state.as_str(),
                if covers.is_empty() {
                    "no threat depends on it alone".to_string()
                } else {
                    covers.join("; ")
                }
            ));
        }
        out
    }

    /// Operator hints for each uncovered threat.
    pub fn problems(&self) -> Vec<String> {
        self.uncovered()
            .into_iter()
            .map(|t| {
                let row = THREATS.iter().find(|r| r.name == t).expect("from THREATS");
                let hint = row
                    .covered_by
                    .iter()
                    .map(|l| hint(*l))
                    .collect::<Vec<_>>()
                    .join("; or ");
                format!("no enforced layer stops {t}: {hint}")
            })
            .collect()
    }
}

/// What an operator can do to provide `layer`.
pub fn hint(layer: Layer) -> String {
    match layer {
        Layer::SessionUid => "run sandcelld as root (sandcelld.service)".into(),
        Layer::NetworkNamespace => {
            "allow net and ipc in RestrictNamespaces= and keep CAP_SYS_ADMIN".into()
        }
        Layer::Seccomp => "use a kernel with CONFIG_SECCOMP_FILTER=y".into(),
        Layer::Cgroups => {
            "give sandcelld a delegated cgroup (Delegate=yes) with memory, pids and cpu".into()
        }
        Layer::MountNamespace => "allow mnt in RestrictNamespaces= and the @mount system calls \
             in SystemCallFilter= of sandcelld.service, and keep CAP_SYS_ADMIN"
            .into(),
        l => format!(
            "boot a kernel with landlock abi >= {} in lsm= (CONFIG_SECURITY_LANDLOCK=y)",
            l.landlock_abi().unwrap_or(1)
        ),
    }
}

/// Decides what workers enforce on `host`: every available layer, except Landlock ABI 1 when
/// the mount namespace can stand in for it (see the module documentation).
pub fn evaluate(host: &Host) -> Decision {
    let abi = host.landlock_abi.filter(|a| *a >= 1);
    let landlock_abi = match abi {
        Some(1) if host.mount_namespace => None,
        other => other,
    };
    let mut layers = Vec::new();
    for layer in LAYERS {
        let state = match layer {
            Layer::SessionUid => present(host.session_uids),
            Layer::NetworkNamespace => present(host.network_namespace),
            Layer::Seccomp => present(host.seccomp),
            Layer::Cgroups => present(host.cgroups),
            Layer::MountNamespace => present(host.mount_namespace),
            l => {
                let need = l.landlock_abi().expect("landlock layer");
                match (abi, landlock_abi) {
                    (_, Some(used)) if used >= need => LayerState::Active,
                    (Some(have), None) if have >= need => LayerState::Substituted,
                    _ => LayerState::Missing,
                }
            }
        };
        layers.push((layer, state));
    }
    let threats = THREATS
        .iter()
        .map(|row| {
            let by = row
                .covered_by
                .iter()
                .copied()
                .filter(|l| {
                    layers
                        .iter()
                        .any(|(x, s)| x == l && *s == LayerState::Active)
                })
                .collect();
            (row.name.to_string(), by)
        })
        .collect();
    Decision {
        host: *host,
        landlock_abi,
        mount_namespace: host.mount_namespace,
        layers,
        threats,
    }
}

fn present(yes: bool) -> LayerState {
    if yes {
        LayerState::Active
    } else {
        LayerState::Missing
    }
}

/// The per-ABI table of sandcelld(8): for Landlock ABI `abi` (0 = none) on a host with every
/// other layer, each threat with the layers that stop it. Used by the documentation test and
/// `sandcelld --check`.
pub fn table(abi: i32, mount_namespace: bool) -> Vec<(String, Vec<Layer>)> {
    evaluate(&Host {
        landlock_abi: (abi > 0).then_some(abi),
        seccomp: true,
        session_uids: true,
        network_namespace: true,
        mount_namespace,
        cgroups: true,
    })
    .threats
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(abi: Option<i32>, mount: bool) -> Host {
        Host {
            landlock_abi: abi,
            seccomp: true,
            session_uids: true,
            network_namespace: true,
            mount_namespace: mount,
            cgroups: true,
        }
    }

    #[test]
    fn every_threat_has_a_row_and_every_row_a_non_landlock_or_landlock_cover() {
        assert_eq!(THREATS.len(), 10);
        for row in THREATS {
            assert!(!row.covered_by.is_empty(), "{}", row.name);
        }
    }

    #[test]
    fn with_a_mount_namespace_every_abi_starts() {
        for abi in [
            None,
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(5),
            Some(6),
            Some(7),
        ] {
            let d = evaluate(&host(abi, true));
            assert!(d.strict_ok(), "{abi:?}: {:?}", d.uncovered());
            assert!(d.mount_namespace);
        }
    }

    #[test]
    fn abi_1_is_substituted_by_the_mount_namespace() {
        let d = evaluate(&host(Some(1), true));
        assert_eq!(d.landlock_abi, None);
        assert_eq!(d.state(Layer::LandlockFs), LayerState::Substituted);
        assert_eq!(d.state(Layer::LandlockRefer), LayerState::Missing);
        assert!(
            d.notes()
                .iter()
                .any(|n| n.contains("landlock-fs substituted"))
        );
        // Without a mount namespace ABI 1 is applied (best effort), but truncate is uncovered.
        let d = evaluate(&host(Some(1), false));
        assert_eq!(d.landlock_abi, Some(1));
        assert_eq!(d.uncovered(), vec!["truncate-outside-session"]);
    }

    #[test]
    fn without_a_mount_namespace_abi_3_is_the_floor() {
        for (abi, ok) in [
            (None, false),
            (Some(1), false),
            (Some(2), false),
            (Some(3), true),
            (Some(6), true),
            (Some(7), true),
        ] {
            let d = evaluate(&host(abi, false));
            assert_eq!(d.strict_ok(), ok, "{abi:?}: {:?}", d.uncovered());
            if !ok {
                assert!(!d.problems().is_empty());
                assert!(
                    d.problems()[0].contains("RestrictNamespaces"),
                    "{:?}",
                    d.problems()
                );
            }
        }
    }

    #[test]
    fn debian_12_abi_2_starts_with_the_mount_namespace() {
        let d = evaluate(&host(Some(2), true));
        assert!(d.strict_ok());
        assert_eq!(d.landlock_abi, Some(2));
        assert_eq!(d.state(Layer::LandlockRefer), LayerState::Active);
        assert_eq!(d.state(Layer::LandlockTruncate), LayerState::Missing);
        let trunc = &d
            .threats
            .iter()
            .find(|(t, _)| t == "truncate-outside-session")
            .unwrap()
            .1;
        assert_eq!(trunc, &vec![Layer::MountNamespace]);
        let signal = &d
            .threats
            .iter()
            .find(|(t, _)| t == "signal-others")
            .unwrap()
            .1;
        assert_eq!(signal, &vec![Layer::SessionUid]);
    }

    #[test]
    fn required_layers_are_required_at_every_abi() {
        for abi in [None, Some(2), Some(7)] {
            for strip in [
                |h: &mut Host| h.seccomp = false,
                |h: &mut Host| h.cgroups = false,
                |h: &mut Host| h.session_uids = false,
            ] {
                let mut h = host(abi, true);
                strip(&mut h);
                let d = evaluate(&h);
                // Seccomp alone stops sockets, cgroups alone stop resource reservation; without
                // session uids, ABI < 6 leaves signals uncovered.
                if !h.session_uids && abi == Some(7) {
                    assert!(d.strict_ok());
                } else {
                    assert!(!d.strict_ok(), "{abi:?} {h:?}");
                }
            }
        }
    }

    #[test]
    fn abi_7_without_mount_namespace_has_everything_but_it() {
        let d = evaluate(&host(Some(7), false));
        assert!(d.strict_ok());
        for (l, s) in &d.layers {
            if *l == Layer::MountNamespace {
                assert_eq!(*s, LayerState::Missing);
            } else {
                assert_eq!(*s, LayerState::Active, "{l:?}");
            }
        }
        assert_eq!(d.notes().len(), 1);
        assert!(
            d.notes()[0].starts_with("mount-namespace missing"),
            "{:?}",
            d.notes()
        );
    }

    #[test]
    fn table_lists_landlock_layers_by_abi() {
        let t5 = table(5, true);
        let ioctl = &t5.iter().find(|(t, _)| t == "device-ioctls").unwrap().1;
        assert!(ioctl.contains(&Layer::LandlockIoctlDev));
        let t4 = table(4, true);
        let ioctl = &t4.iter().find(|(t, _)| t == "device-ioctls").unwrap().1;
        assert!(!ioctl.contains(&Layer::LandlockIoctlDev));
        let t0 = table(0, true);
        assert!(t0.iter().all(|(_, by)| !by.is_empty()));
    }
}
