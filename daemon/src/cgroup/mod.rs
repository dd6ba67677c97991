//! Session cgroups: one limited group per worker, inside the daemon's delegated subtree.
//!
//! The daemon codes against [`Backend`] and [`SessionGroup`]; `v2.rs` implements the
//! production layout (`<delegated root>/supervisor` for sandcelld itself,
//! `<delegated root>/sessions/<id>` per worker), `v1.rs` the same guarantees on hybrid hosts
//! whose memory/pids/cpu controllers are cgroup v1 hierarchies. [`Unconfined`] is the explicit,
//! loudly named development backend (`--insecure-dev`): it creates nothing and limits nothing.
//!
//! How a worker joins its group: before forking, the daemon opens every path returned by
//! [`SessionGroup::procs_files`] with `O_WRONLY | O_CLOEXEC`; in the child, between fork and
//! exec, it writes `"0"` to each (async-signal-safe: `write(2)` only), so the worker is inside
//! its group before its first instruction. The parent then calls [`SessionGroup::verify_member`]
//! before sending the first request (attach first, then verify the membership and the limit).
//!
//! Descriptor hygiene (runc CVE-2024-21626 leaked a cgroup directory fd into containers):
//! every file and directory of the cgroup tree is opened close-on-exec (Rust's `std` opens
//! everything with `O_CLOEXEC`, pidfds are always close-on-exec) and held only for the call
//! that needs it; the daemon keeps no cgroup directory open. Interface files are opened with
//! `O_NOFOLLOW` and directories are listed without following symlinks (cgroupfs has none;
//! a symlink there would be an attack, not a layout).
//!
//! Detection order ([`detect`]): cgroup v2 if the daemon's own cgroup2 group offers memory and
//! pids in `cgroup.controllers`; otherwise v1 if memory and pids v1 hierarchies are mounted;
//! otherwise an error telling the operator what to set up.

pub(crate) mod host;
pub mod v1;
pub mod v2;

pub use host::{Host, Leftover, wait_reaped};

use std::path::PathBuf;
use std::time::Duration;

/// Limits of one session's group. All sizes in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLimits {
    /// memory.max (v2) / memory.limit_in_bytes (v1); swap is always 0 where it can be set.
    pub memory_bytes: u64,
    /// pids.max.
    pub max_pids: u64,
    /// cpu.max as (quota, period) in microseconds; `None` for no CPU cap.
    pub cpu_max: Option<(u64, u64)>,
}

/// Errors of the cgroup layer; each says what to configure where a fix is known.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file of the cgroup tree could not be read or written.
    #[error("cgroup {op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `write memory.max`, ...).
        op: String,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The host does not offer what the daemon needs.
    #[error("cgroup setup: {0}")]
    Unsupported(String),
    /// A worker is not where it must be, or a limit did not take.
    #[error("cgroup verification failed: {0}")]
    Verify(String),
}

/// How long a kill of a session group (a worker's release, a failed start, the start-up sweep
/// of a predecessor's groups) waits for the group to empty before it reports
/// [`Error::Verify`]: 10 s. SIGKILL'd processes normally leave within milliseconds; one in
/// uninterruptible sleep (a hung file system) may take longer, and then the group cannot be
/// removed.
pub const KILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The daemon's own memory bound for [`DetectConfig::default`]: `memory.max` of its
/// supervisor group with the default caps, in bytes. The daemon sets the bound its
/// configuration implies ([`crate::memory::Bound`]): everything it holds per session and per
/// connection is bounded, so a daemon past it is a bug or an attack that slipped a bound: the
/// kernel then OOM-kills the daemon alone (systemd restarts it) instead of the host's other
/// services. Workers leave the group before they run anything (they are forked into their
/// session group), so none of their memory counts here.
pub fn supervisor_memory_default() -> (u64, u64) {
    let b = crate::config::Config::default().memory_bound();
    (b.max, b.high)
}

/// A cgroup implementation (v2, v1 hybrid, or none).
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// `"v2"`, `"v1"` (hybrid host) or `"none"` (development, unconfined).
    fn mode(&self) -> &'static str;
    /// Whether a cpu limit ([`GroupLimits::cpu_max`]) can be enforced; [`Backend::create`]
    /// refuses one otherwise.
    fn supports_cpu(&self) -> bool {
        true
    }
    /// Creates the group of session `id` with `limits`. Fails if it exists.
    fn create(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error>;
    /// Kills and removes every session group left by a previous daemon; says how many, and
    /// how many of them still held a process.
    fn sweep_stale(&self) -> Result<Swept, Error> {
        self.sweep_stale_except(&[])
    }
    /// [`Backend::sweep_stale`], sparing the groups of the sessions in `keep` (adopted).
    fn sweep_stale_except(&self, keep: &[String]) -> Result<Swept, Error>;
    /// The existing group of session `id` (a session adopted from a previous daemon), with
    /// `limits` as they were set; nothing is created or written.
    ///
    /// Errors: the group does not exist, or `id` is not a session id.
    fn adopt(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error>;
    /// Bounds the daemon's own memory: `max` and `high` bytes on its supervisor group (v2:
    /// `<root>/supervisor`, where [`detect`] moved it; v1: a `<parent>/<name>/supervisor`
    /// group of the memory hierarchy that the daemon moves itself into, and out of again in
    /// [`Backend::release`]). Returns the group's path for the log.
    ///
    /// Errors: [`Error::Io`] when a file cannot be written.
    fn bound_supervisor(&self, _max: u64, _high: u64) -> Result<Option<PathBuf>, Error> {
        Ok(None)
    }
    /// Removes what [`detect`] created for this daemon instance once every session is gone
    /// (v1: the empty `<name>/sessions` and `<name>` groups; v2: nothing, the delegated root
    /// belongs to systemd). Call at shutdown, after the last session's `remove`.
    fn release(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// What [`Backend::sweep_stale_except`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Session groups removed.
    pub groups: usize,
    /// The names (session ids) of those that still held a process when the sweep found them
    /// (killed by the sweep). A daemon that exits keeping sessions kills its warm pooled
    /// workers without waiting and leaves their groups to its successor, so these may also be
    /// workers it killed that the kernel was still tearing down.
    pub populated: Vec<String>,
}

/// One session's group.
pub trait SessionGroup: Send + Sync + std::fmt::Debug {
    /// The `cgroup.procs` files a child writes `"0"` to, one per hierarchy (v1 has several).
    fn procs_files(&self) -> Vec<PathBuf>;
    /// Checks that `pid` is in this group in every hierarchy and that the limits are in force.
    fn verify_member(&self, pid: u32) -> Result<(), Error>;
    /// Number of OOM kills in this group so far (memory.events `oom_kill` / v1 memory.oom_control).
    fn oom_kills(&self) -> u64;
    /// Memory charged now, in bytes, if known.
    fn memory_current(&self) -> Option<u64>;
    /// Peak memory charged, in bytes, if known (memory.peak / v1 max_usage_in_bytes): since
    /// the last successful [`SessionGroup::reset_memory_peak`], else since the group was made.
    fn memory_peak(&self) -> Option<u64>;
    /// Starts a new peak window, so that [`SessionGroup::memory_peak`] reports one cell's
    /// peak. v1: a write to `memory.max_usage_in_bytes` resets the watermark to the current
    /// usage. v2: a write to `memory.peak` resets the peak seen through that one file
    /// descriptor (Linux 6.12+, Documentation/admin-guide/cgroup-v2.rst), so the group keeps
    /// the descriptor and reads through it. Returns false where the kernel cannot reset (v2
    /// before 6.12, or no memory controller): the peak is then the group's lifetime peak.
    fn reset_memory_peak(&self) -> bool {
        false
    }
    /// Sends SIGKILL to every process in the group (cgroup.kill where available) and waits until
    /// the group is empty or `timeout` passes.
    fn kill_all(&self, timeout: Duration) -> Result<(), Error>;
    /// Kills every process in the group except `keep` (the worker), race-free through pidfds
    /// (see [`host::kill_others`]), and waits until they have exited. Called at the end of
    /// every cell: a cell's processes do not outlive the cell. Returns the processes killed,
    /// each pinned by its pidfd (see [`host::wait_reaped`]: they are zombies until reaped).
    ///
    /// Errors: [`Error::Verify`] if others are still alive after `timeout`.
    fn kill_others(&self, keep: u32, timeout: Duration) -> Result<Vec<Leftover>, Error>;
    /// Whether the group holds no process but `keep` now: a read of its `cgroup.procs` files
    /// (an unreadable one counts as empty, as in [`SessionGroup::kill_others`]).
    fn holds_only(&self, keep: u32) -> bool {
        host::listed_pids(&self.procs_files())
            .iter()
            .all(|&pid| pid == keep || host::is_keeper(pid))
    }
    /// Removes the group; call after [`SessionGroup::kill_all`] and after reaping the worker.
    fn remove(&self) -> Result<(), Error>;
}

/// What [`detect`] needs to know besides the host itself.
#[derive(Debug, Clone)]
pub struct DetectConfig {
    /// v1 only: the group, relative to each hierarchy's root, under which `<v1_name>/sessions`
    /// is made; `None` = the daemon's own group in each hierarchy if it is a systemd unit's
    /// (`*.service`/`*.scope`, delegated with `Delegate=yes`), else the hierarchy root `/`.
    /// Ignored on v2, where the delegated root is the daemon's own group.
    pub v1_parent: Option<PathBuf>,
    /// v1 only: the daemon instance's group name (`sandcell`, the `cgroup_name` setting).
    pub v1_name: String,
    /// Where procfs is (tests point it at a fixture).
    pub host: Host,
    /// The daemon's own memory bound (`max`, `high`) in bytes, set on its supervisor group;
    /// `None` leaves it unbounded (tests of layouts only).
    pub supervisor_memory: Option<(u64, u64)>,
}

impl Default for DetectConfig {
    fn default() -> Self {
        DetectConfig {
            v1_parent: None,
            v1_name: "sandcell".into(),
            host: Host::default(),
            supervisor_memory: Some(supervisor_memory_default()),
        }
    }
}

/// Finds the cgroup layout of this host and prepares it (see the module documentation):
/// v2 moves the daemon into `<root>/supervisor` and enables the controllers; v1 creates the
/// `sessions` parents. Call once at start, before starting threads that fork workers.
///
/// Errors: [`Error::Unsupported`] with an operator hint when neither a delegated v2 root with
/// memory and pids nor v1 memory and pids hierarchies are available, or when the daemon sits
/// in the v2 root cgroup; [`Error::Io`] when setting up fails (not root, `EBUSY`).
pub fn detect(config: &DetectConfig) -> Result<Box<dyn Backend>, Error> {
    let backend = detect_layout(config)?;
    if let Some((max, high)) = config.supervisor_memory
        && let Some(group) = backend.bound_supervisor(max, high)?
    {
        tracing::info!(
            group = %group.display(),
            memory_max = max,
            memory_high = high,
            "sandcelld's own memory is bounded"
        );
    }
    Ok(backend)
}

fn detect_layout(config: &DetectConfig) -> Result<Box<dyn Backend>, Error> {
    let host = config.host.clone();
    let mounts = host.mounts()?;
    let own = host.memberships(None)?;
    let unified = own.iter().find(|m| m.id == 0 && m.controllers.is_empty());
    let cgroup2 = mounts.iter().find(|m| m.fstype == "cgroup2");
    if let (Some(mount), Some(own)) = (cgroup2, unified) {
        // A daemon restarted inside its unit may already sit in supervisor/.
        let rel = own
            .path
            .strip_suffix("/supervisor")
            .unwrap_or(&own.path)
            .to_owned();
        let visible = rel
            .strip_prefix(mount.root.trim_end_matches('/'))
            .unwrap_or(&rel);
        let root = mount.mount_point.join(visible.trim_start_matches('/'));
        if v2::V2::usable(&root) {
            if rel == "/" {
                return Err(Error::Unsupported(
                    "sandcelld runs in the root cgroup, so nothing is delegated to it: run it \
                     from sandcelld.service with Delegate=yes"
                        .into(),
                ));
            }
            let home = sessions_home(&mount.mount_point, mount.root.as_str(), &rel);
            match &home {
                Some(h) => tracing::info!(
                    sessions = %h.rel,
                    "session groups live in {}, outside sandcelld.service: a restart or a \
                     crash of the daemon does not end them",
                    v2::SESSIONS_UNIT
                ),
                None if std::env::var_os("INVOCATION_ID").is_some() => tracing::warn!(
                    "{} is not running beside sandcelld.service: session groups live in the \
                     daemon's own group, and every restart of the daemon ends every session",
                    v2::SESSIONS_UNIT
                ),
                None => {}
            }
            if let Some((max, high)) = config.supervisor_memory {
                v2::V2::preset_supervisor(&root, max, high);
            }
            return Ok(Box::new(v2::V2::open_with(host, root, rel, home)?));
        }
    }
    let v1_usable =
        v1::find_mount(&mounts, "memory").is_some() && v1::find_mount(&mounts, "pids").is_some();
    if v1_usable {
        return Ok(Box::new(v1::V1::open(
            host,
            config.v1_parent.as_deref(),
            &config.v1_name,
        )?));
    }
    Err(Error::Unsupported(
        "no cgroup with the memory and pids controllers is available to sandcelld: run it \
         from sandcelld.service with Delegate=yes on a cgroup v2 host (or, on a hybrid host, \
         mount the v1 memory and pids controllers)"
            .into(),
    ))
}

/// The companion unit's group beside the daemon's own unit (`rel`, the daemon's delegated
/// root as `/proc/self/cgroup` shows it: `/system.slice/sandcelld.service` gives
/// `/system.slice/sandcell-sessions.service`), when it exists and its main process has left
/// it for `holder/` (what `sandcelld --hold-sessions` does before it reports ready).
fn sessions_home(
    mount_point: &std::path::Path,
    mount_root: &str,
    rel: &str,
) -> Option<v2::SessionsHome> {
    let parent = rel.rsplit_once('/').map(|(p, _)| p)?;
    let home_rel = format!("{parent}/{}", v2::SESSIONS_UNIT);
    if home_rel == rel {
        return None;
    }
    let visible = home_rel
        .strip_prefix(mount_root.trim_end_matches('/'))
        .unwrap_or(&home_rel);
    let dir = mount_point.join(visible.trim_start_matches('/'));
    dir.join(v2::HOLDER)
        .is_dir()
        .then_some(v2::SessionsHome { dir, rel: home_rel })
}

/// The development backend: no groups, no limits. Only used with `--insecure-dev`.
#[derive(Debug, Default)]
pub struct Unconfined;

#[derive(Debug)]
struct NoGroup;

impl Backend for Unconfined {
    fn mode(&self) -> &'static str {
        "none"
    }
    fn create(&self, _id: &str, _limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        Ok(Box::new(NoGroup))
    }
    fn sweep_stale_except(&self, _keep: &[String]) -> Result<Swept, Error> {
        Ok(Swept::default())
    }
    fn adopt(&self, _id: &str, _limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        Ok(Box::new(NoGroup))
    }
}

impl SessionGroup for NoGroup {
    fn procs_files(&self) -> Vec<PathBuf> {
        Vec::new()
    }
    fn verify_member(&self, _pid: u32) -> Result<(), Error> {
        Ok(())
    }
    fn oom_kills(&self) -> u64 {
        0
    }
    fn memory_current(&self) -> Option<u64> {
        None
    }
    fn memory_peak(&self) -> Option<u64> {
        None
    }
    fn kill_all(&self, _timeout: Duration) -> Result<(), Error> {
        Ok(())
    }
    fn kill_others(&self, _keep: u32, _timeout: Duration) -> Result<Vec<Leftover>, Error> {
        Ok(Vec::new())
    }
    fn remove(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake host: procfs files and cgroup mounts in a temp dir.
    fn fake(mountinfo: &str, self_cgroup: &str) -> (PathBuf, DetectConfig) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("sandcell-detect-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("proc/self")).unwrap();
        let mountinfo = mountinfo.replace("@", dir.to_str().unwrap());
        std::fs::write(dir.join("proc/self/mountinfo"), mountinfo).unwrap();
        std::fs::write(dir.join("proc/self/cgroup"), self_cgroup).unwrap();
        let config = DetectConfig {
            v1_parent: Some("/".into()),
            v1_name: "sandcell".into(),
            host: Host {
                proc_root: dir.join("proc"),
            },
            supervisor_memory: Some(supervisor_memory_default()),
        };
        (dir, config)
    }

    #[test]
    fn pure_v2_with_delegation_is_v2() {
        let (dir, config) = fake(
            "30 1 0:26 / @/cg rw - cgroup2 cgroup2 rw\n",
            "0::/system.slice/sandcelld.service/supervisor\n",
        );
        let root = dir.join("cg/system.slice/sandcelld.service");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::write(root.join("cgroup.procs"), "").unwrap();
        let backend = detect(&config).unwrap();
        assert_eq!(backend.mode(), "v2");
        assert!(
            root.join("sessions").is_dir(),
            "root taken from the parent of supervisor/"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn v2_in_the_root_cgroup_is_refused() {
        let (dir, config) = fake("30 1 0:26 / @/cg rw - cgroup2 cgroup2 rw\n", "0::/\n");
        std::fs::create_dir_all(dir.join("cg")).unwrap();
        std::fs::write(dir.join("cg/cgroup.controllers"), "memory pids\n").unwrap();
        let err = detect(&config).unwrap_err().to_string();
        assert!(err.contains("Delegate=yes"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hybrid_without_v2_controllers_is_v1() {
        let (dir, config) = fake(
            "32 31 0:27 / @/unified rw - cgroup2 cgroup2 rw\n\
             37 31 0:32 / @/memory rw - cgroup cgroup rw,memory\n\
             38 31 0:33 / @/pids rw - cgroup cgroup rw,pids\n",
            "8:pids:/\n4:memory:/\n0::/\n",
        );
        for d in ["unified", "memory", "pids"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("unified/cgroup.controllers"), "hugetlb\n").unwrap();
        let backend = detect(&config).unwrap();
        assert_eq!(backend.mode(), "v1");
        assert!(!backend.supports_cpu());
        assert!(dir.join("memory/sandcell/sessions").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nothing_usable_is_an_error_with_a_hint() {
        let (dir, config) = fake(
            "32 31 0:27 / @/unified rw - cgroup2 cgroup2 rw\n",
            "0::/x\n",
        );
        std::fs::create_dir_all(dir.join("unified/x")).unwrap();
        std::fs::write(dir.join("unified/x/cgroup.controllers"), "hugetlb\n").unwrap();
        let err = detect(&config).unwrap_err().to_string();
        assert!(err.contains("Delegate=yes"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
