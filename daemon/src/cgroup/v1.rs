//! cgroup v1 on hybrid hosts: memory, pids and (optionally) cpu are separate v1 hierarchies
//! (`Documentation/admin-guide/cgroup-v1/memory.rst`, `pids.rst`), as on the development and
//! CI machines.
//!
//! ```text
//! <hierarchy mount>/<parent>/<name>/sessions/<id>     in each of memory, pids [, cpu]
//! ```
//!
//! `<parent>` is configurable ([`super::DetectConfig::v1_parent`]); by default it is the
//! daemon's own group in each hierarchy when that is a systemd unit's group (what systemd
//! delegates with `Delegate=yes` on a hybrid host, see [`is_systemd_unit_group`]), else the
//! hierarchy root. `<name>` is one name per daemon instance (`sandcell`).
//! [`Backend::release`] removes `<name>/sessions` and `<name>` again when the daemon stops.
//!
//! The same guarantees as v2, with v1's files:
//! - memory: `memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` set to the same value
//!   so swap cannot extend it (when swap accounting exists; otherwise `memory.swappiness` 0);
//! - pids: `pids.max`; cpu: `cpu.cfs_period_us` and `cpu.cfs_quota_us`;
//! - OOM kills: `oom_kill` in `memory.oom_control`. With memsw equal to the limit, `failcnt`
//!   stays 0 (measured), so it is not a usable OOM signal. v1 has no `memory.oom.group`: the
//!   kernel kills one process; the daemon ends the session on any OOM kill;
//! - peak: `memory.max_usage_in_bytes`;
//! - kill: v1 has no `cgroup.kill`, so [`host::kill_loop`] re-reads `cgroup.procs` of every
//!   hierarchy and SIGKILLs each listed pid through a pidfd after checking it is still a
//!   member (no pid-reuse race) until all are empty; a fork bomb converges because pids.max
//!   bounds it and killed processes cannot fork.

use super::host::{self, CgroupMount, Host};
use super::{Backend, Error, GroupLimits, SessionGroup};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One v1 hierarchy and where sandcell's session groups live in it.
#[derive(Debug, Clone)]
pub struct Hierarchy {
    /// The controller that identifies the hierarchy (`memory`, `pids`, `cpu`).
    pub controller: &'static str,
    /// File-system path of `.../sessions`.
    pub base: PathBuf,
    /// The same path relative to the hierarchy root, as `/proc/<pid>/cgroup` shows it.
    pub base_rel: String,
    /// Where the hierarchy is mounted.
    pub mount_point: PathBuf,
    /// Which part of the hierarchy the mount shows (`/` outside containers).
    pub mount_root: String,
}

impl Hierarchy {
    /// File-system path of the group `rel` (as `/proc/<pid>/cgroup` shows it), if the mount
    /// shows it.
    fn path_of(&self, rel: &str) -> Option<PathBuf> {
        let root = self.mount_root.trim_end_matches('/');
        let visible = rel.strip_prefix(root)?;
        if !(visible.is_empty() || visible.starts_with('/')) {
            return None;
        }
        Some(self.mount_point.join(visible.trim_start_matches('/')))
    }
}

/// The daemon's own memory group on v1 ([`Backend::bound_supervisor`]): where it is, and the
/// `cgroup.procs` of the group it came from (it moves back there in [`Backend::release`]).
#[derive(Debug)]
struct Supervisor {
    dir: PathBuf,
    back: PathBuf,
}

/// The v1 backend.
#[derive(Debug)]
pub struct V1 {
    host: Host,
    memory: Hierarchy,
    pids: Hierarchy,
    cpu: Option<Hierarchy>,
    supervisor: std::sync::Mutex<Option<Supervisor>>,
}

/// Finds the v1 mount carrying `controller` (exact option match: `cpu` is not `cpuset`).
pub fn find_mount<'a>(mounts: &'a [CgroupMount], controller: &str) -> Option<&'a CgroupMount> {
    mounts
        .iter()
        .find(|m| m.fstype == "cgroup" && m.options.iter().any(|o| o == controller))
}

impl V1 {
    /// Locates the hierarchies and creates `<parent>/<name>/sessions` in each.
    ///
    /// `parent`: hierarchy-relative parent group; `None` = the daemon's own group in each.
    ///
    /// Errors: [`Error::Unsupported`] when memory or pids is not mounted as v1, or the
    /// daemon's group lies outside what the mount shows; [`Error::Io`] when the directories
    /// cannot be created (not root).
    pub fn open(host: Host, parent: Option<&Path>, name: &str) -> Result<V1, Error> {
        host::check_id(name)?;
        let mounts = host.mounts()?;
        let own = host.memberships(None)?;
        let locate = |controller: &'static str| -> Result<Option<Hierarchy>, Error> {
            let Some(mount) = find_mount(&mounts, controller) else {
                return Ok(None);
            };
            let parent_rel = match parent {
                Some(p) => p.to_string_lossy().into_owned(),
                None => own
                    .iter()
                    .find(|m| m.controllers.iter().any(|c| c == controller))
                    .map(|m| without_own_supervisor(&m.path, name))
                    .filter(|p| is_systemd_unit_group(p))
                    .unwrap_or_else(|| "/".into()),
            };
            let base_rel = format!("{}/{name}/sessions", parent_rel.trim_end_matches('/'));
            let base_rel = if base_rel.starts_with('/') {
                base_rel
            } else {
                format!("/{base_rel}")
            };
            let visible = base_rel
                .strip_prefix(mount.root.trim_end_matches('/'))
                .filter(|rest| rest.starts_with('/'))
                .ok_or_else(|| {
                    Error::Unsupported(format!(
                        "the {controller} group {base_rel} is outside the mounted part of the \
                         hierarchy ({}); set the v1 parent group to a path under it",
                        mount.root
                    ))
                })?;
            let base = mount.mount_point.join(visible.trim_start_matches('/'));
            mkdir_all(&mount.mount_point, &base)?;
            Ok(Some(Hierarchy {
                controller,
                base,
                base_rel,
                mount_point: mount.mount_point.clone(),
                mount_root: mount.root.clone(),
            }))
        };
        let missing = |c: &str| {
            Error::Unsupported(format!(
                "no cgroup v1 {c} hierarchy is mounted and no cgroup v2 root with memory and \
                 pids was found; run sandcelld under systemd with Delegate=yes on a cgroup v2 \
                 host, or mount the v1 {c} controller"
            ))
        };
        let memory = locate("memory")?.ok_or_else(|| missing("memory"))?;
        let pids = locate("pids")?.ok_or_else(|| missing("pids"))?;
        let cpu = locate("cpu")?;
        Ok(V1 {
            host,
            memory,
            pids,
            cpu,
            supervisor: std::sync::Mutex::new(None),
        })
    }

    fn hierarchies(&self) -> Vec<&Hierarchy> {
        let mut v = vec![&self.memory, &self.pids];
        v.extend(self.cpu.as_ref());
        v
    }
}

/// Whether a hierarchy-relative group path is a systemd unit's own group (it ends in
/// `.service` or `.scope`): systemd delegated it and kills whatever is left in it when the
/// unit stops. Any other group the daemon happens to sit in (a container runtime's, a CI
/// harness's) was not delegated to it and is not nested into.
pub fn is_systemd_unit_group(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|last| last.ends_with(".service") || last.ends_with(".scope"))
}

/// Creates `target` and its missing parents below `mount` (never above it), refusing
/// symlinks on the way.
fn mkdir_all(mount: &Path, target: &Path) -> Result<(), Error> {
    let rel = target.strip_prefix(mount).map_err(|_| {
        Error::Unsupported(format!(
            "{} is not under {}",
            target.display(),
            mount.display()
        ))
    })?;
    let mut path = mount.to_path_buf();
    for component in rel.components() {
        path.push(component);
        host::mkdir(&path, true)?;
    }
    Ok(())
}

impl Backend for V1 {
    fn mode(&self) -> &'static str {
        "v1"
    }

    fn supports_cpu(&self) -> bool {
        self.cpu.is_some()
    }

    fn create(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        host::check_id(id)?;
        if limits.cpu_max.is_some() && self.cpu.is_none() {
            return Err(Error::Unsupported(
                "a cpu limit was asked for but no cgroup v1 cpu hierarchy is mounted; mount it \
                 or set worker_cpus = 0"
                    .into(),
            ));
        }
        let mut group = V1Group {
            host: self.host.clone(),
            dirs: Vec::new(),
            limits: limits.clone(),
        };
        for h in self.hierarchies() {
            let dir = h.base.join(id);
            if let Err(e) = host::mkdir(&dir, false) {
                let _ = group.remove();
                return Err(e);
            }
            group.dirs.push(Dir {
                controller: h.controller,
                path: dir,
                rel: format!("{}/{id}", h.base_rel),
            });
        }
        if let Err(e) = group.apply_limits() {
            let _ = group.remove();
            return Err(e);
        }
        Ok(Box::new(group))
    }

    fn bound_supervisor(&self, max: u64, high: u64) -> Result<Option<PathBuf>, Error> {
        // The daemon's own memory group, whatever it was, may be shared (the hierarchy root,
        // or a unit's group): it moves into a group of its own next to `sessions`.
        let own = self.host.memberships(None)?;
        let from = own
            .iter()
            .find(|m| m.controllers.iter().any(|c| c == "memory"))
            .map(|m| m.path.clone())
            .unwrap_or_else(|| "/".into());
        let Some(name_dir) = self.memory.base.parent() else {
            return Ok(None);
        };
        let dir = name_dir.join("supervisor");
        let back = self
            .memory
            .path_of(&from)
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "sandcelld's memory group {from} is outside the mounted hierarchy"
                ))
            })?
            .join("cgroup.procs");
        if from.ends_with("/supervisor") && self.memory.path_of(&from).as_deref() == Some(&*dir) {
            // Already there (a re-exec in place, or a daemon started inside the group). The
            // bound follows this configuration, which may differ from the last one's. The way
            // back at the end is the group the groups were made below (a systemd unit's
            // group, else the hierarchy's root), so that its stop can remove them.
            set_supervisor_limits(&dir, max, high)?;
            if let Some(parent) = name_dir.parent() {
                *self.supervisor.lock().unwrap_or_else(|e| e.into_inner()) = Some(Supervisor {
                    dir: dir.clone(),
                    back: parent.join("cgroup.procs"),
                });
            }
            return Ok(Some(dir));
        }
        host::mkdir(&dir, true)?;
        set_supervisor_limits(&dir, max, high)?;
        // Writing a pid to cgroup.procs moves every thread of the process.
        host::write(&dir.join("cgroup.procs"), &std::process::id().to_string())?;
        *self.supervisor.lock().unwrap_or_else(|e| e.into_inner()) = Some(Supervisor {
            dir: dir.clone(),
            back,
        });
        Ok(Some(dir))
    }

    fn release(&self) -> Result<(), Error> {
        // The daemon leaves its supervisor group first, so the groups can go.
        if let Some(sup) = self
            .supervisor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            host::write(&sup.back, &std::process::id().to_string())?;
            let _ = host::rmdir(&sup.dir, Duration::from_secs(1));
        }
        // Only empty groups can be removed: sessions still alive keep theirs (EBUSY), which
        // is not an error here: the next daemon sweeps them.
        for h in self.hierarchies() {
            for dir in [Some(h.base.as_path()), h.base.parent()]
                .into_iter()
                .flatten()
            {
                if let Err(e) = std::fs::remove_dir(dir) {
                    match e.raw_os_error() {
                        Some(libc::ENOENT | libc::EBUSY | libc::ENOTEMPTY) => {}
                        _ => {
                            return Err(Error::Io {
                                op: "remove".into(),
                                path: dir.into(),
                                source: e,
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn adopt(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        host::check_id(id)?;
        let group = self.group_of(id, limits.clone());
        if let Some(d) = group.dirs.iter().find(|d| !d.path.is_dir()) {
            return Err(Error::Verify(format!(
                "{} does not exist",
                d.path.display()
            )));
        }
        Ok(Box::new(group))
    }

    fn sweep_stale_except(&self, keep: &[String]) -> Result<super::Swept, Error> {
        let mut names: Vec<String> = Vec::new();
        for h in self.hierarchies() {
            names.extend(host::subdirs(&h.base)?);
        }
        names.sort();
        names.dedup();
        names.retain(|n| !keep.contains(n));
        // Every group is tried even if an earlier one fails; the first error is returned.
        let mut first_error = None;
        let mut populated = Vec::new();
        for name in &names {
            let group = V1Group {
                host: self.host.clone(),
                dirs: self
                    .hierarchies()
                    .into_iter()
                    .map(|h| Dir {
                        controller: h.controller,
                        path: h.base.join(name),
                        rel: format!("{}/{name}", h.base_rel),
                    })
                    .collect(),
                limits: GroupLimits {
                    memory_bytes: 0,
                    max_pids: 0,
                    cpu_max: None,
                },
            };
            if !host::listed_pids(&group.procs_files()).is_empty() {
                populated.push(name.clone());
            }
            if let Err(e) = group
                .kill_all(super::KILL_TIMEOUT)
                .and_then(|()| group.remove())
            {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(
            Ok(super::Swept {
                groups: names.len(),
                populated,
            }),
            Err,
        )
    }
}

impl V1 {
    /// The groups of session `id` in every hierarchy (nothing is made).
    fn group_of(&self, id: &str, limits: GroupLimits) -> V1Group {
        V1Group {
            host: self.host.clone(),
            dirs: self
                .hierarchies()
                .into_iter()
                .map(|h| Dir {
                    controller: h.controller,
                    path: h.base.join(id),
                    rel: format!("{}/{id}", h.base_rel),
                })
                .collect(),
            limits,
        }
    }
}

/// A session's directory in one hierarchy.
#[derive(Debug, Clone)]
struct Dir {
    controller: &'static str,
    path: PathBuf,
    rel: String,
}

/// `path` without a trailing `/<name>/supervisor`: where a daemon already in its own
/// supervisor group (a re-exec in place moved nothing) made its groups below, so that a
/// re-executed daemon under a systemd unit finds the same layout as its first image.
fn without_own_supervisor(path: &str, name: &str) -> String {
    path.strip_suffix("/supervisor")
        .and_then(|p| p.strip_suffix(name))
        .and_then(|p| p.strip_suffix('/'))
        .map(|p| if p.is_empty() { "/" } else { p })
        .unwrap_or(path)
        .to_string()
}

/// Sets the daemon's memory group `dir` to `max` bytes (memory and memory+swap, so swap adds
/// nothing) and its soft limit to `high`. The kernel refuses a memory limit above the
/// memory+swap one and the other way round (`EINVAL`, cgroup-v1/memory.rst), so when the
/// first write of the pair fails it is retried after the second.
fn set_supervisor_limits(dir: &Path, max: u64, high: u64) -> Result<(), Error> {
    let limit = max.to_string();
    let mem = dir.join("memory.limit_in_bytes");
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    if memsw.exists() {
        if host::write(&mem, &limit).is_err() {
            host::write(&memsw, &limit)?;
            host::write(&mem, &limit)?;
        } else {
            host::write(&memsw, &limit)?;
        }
    } else {
        host::write(&mem, &limit)?;
    }
    host::write(
        &dir.join("memory.soft_limit_in_bytes"),
        &high.min(max).to_string(),
    )
}

/// One session's v1 groups (one directory per hierarchy).
#[derive(Debug)]
pub struct V1Group {
    host: Host,
    dirs: Vec<Dir>,
    limits: GroupLimits,
}

impl V1Group {
    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|d| d.controller == controller)
            .map(|d| d.path.as_path())
    }

    fn apply_limits(&self) -> Result<(), Error> {
        let l = &self.limits;
        let memory = self.dir("memory").expect("memory hierarchy");
        let bytes = l.memory_bytes.to_string();
        host::write(&memory.join("memory.limit_in_bytes"), &bytes)?;
        // memsw (memory + swap) must be >= the memory limit; both start unlimited, so setting
        // the memory limit first and memsw to the same value always works.
        let memsw = memory.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            host::write(&memsw, &bytes)?;
        } else {
            // No swap accounting (swapaccount=0): keep the group from swapping at all.
            host::write(&memory.join("memory.swappiness"), "0")?;
        }
        let pids = self.dir("pids").expect("pids hierarchy");
        host::write(&pids.join("pids.max"), &l.max_pids.to_string())?;
        if let (Some((quota, period)), Some(cpu)) = (l.cpu_max, self.dir("cpu")) {
            host::write(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
            host::write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
        Ok(())
    }

    fn procs(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|d| d.path.join("cgroup.procs"))
            .collect()
    }
}

/// Whether `pid` is in any of `dirs` according to `/proc/<pid>/cgroup`.
fn member_of_any(host: &Host, dirs: &[Dir], pid: u32) -> bool {
    host.memberships(Some(pid))
        .map(|ms| {
            ms.iter().any(|m| {
                dirs.iter()
                    .any(|d| m.path == d.rel && m.controllers.iter().any(|c| c == d.controller))
            })
        })
        .unwrap_or(false)
}

impl SessionGroup for V1Group {
    fn procs_files(&self) -> Vec<PathBuf> {
        self.procs()
    }

    fn verify_member(&self, pid: u32) -> Result<(), Error> {
        let ms = self.host.memberships(Some(pid))?;
        for d in &self.dirs {
            let found = ms
                .iter()
                .find(|m| m.controllers.iter().any(|c| c == d.controller))
                .map(|m| m.path.as_str());
            if found != Some(d.rel.as_str()) {
                return Err(Error::Verify(format!(
                    "process {pid} is in {} group {found:?}, not in {}",
                    d.controller, d.rel
                )));
            }
        }
        let memory = self.dir("memory").expect("memory hierarchy");
        let want = host::page_floor(self.limits.memory_bytes);
        let got = host::number(&memory.join("memory.limit_in_bytes"));
        if got != Some(want) {
            return Err(Error::Verify(format!(
                "memory.limit_in_bytes is {got:?}, expected {want}"
            )));
        }
        let pids = self.dir("pids").expect("pids hierarchy");
        let got = host::number(&pids.join("pids.max"));
        if got != Some(self.limits.max_pids) {
            return Err(Error::Verify(format!(
                "pids.max is {got:?}, expected {}",
                self.limits.max_pids
            )));
        }
        Ok(())
    }

    fn oom_kills(&self) -> u64 {
        self.dir("memory")
            .and_then(|m| host::read(&m.join("memory.oom_control"), "read").ok())
            .and_then(|t| host::keyed(&t, "oom_kill"))
            .unwrap_or(0)
    }

    fn memory_current(&self) -> Option<u64> {
        host::number(&self.dir("memory")?.join("memory.usage_in_bytes"))
    }

    fn memory_peak(&self) -> Option<u64> {
        host::number(&self.dir("memory")?.join("memory.max_usage_in_bytes"))
    }

    fn reset_memory_peak(&self) -> bool {
        self.dir("memory")
            .is_some_and(|m| host::write(&m.join("memory.max_usage_in_bytes"), "0").is_ok())
    }

    fn kill_all(&self, timeout: Duration) -> Result<(), Error> {
        let (host, dirs) = (self.host.clone(), self.dirs.clone());
        host::kill_loop(
            &self.procs(),
            &move |pid| member_of_any(&host, &dirs, pid),
            timeout,
        )
    }

    fn kill_others(&self, keep: u32, timeout: Duration) -> Result<Vec<host::Leftover>, Error> {
        let (host, dirs) = (self.host.clone(), self.dirs.clone());
        host::kill_others(
            &self.procs(),
            keep,
            &move |pid| member_of_any(&host, &dirs, pid),
            timeout,
        )
    }

    fn remove(&self) -> Result<(), Error> {
        let mut first_error = None;
        for d in self.dirs.iter().rev() {
            if let Err(e) = host::rmdir(&d.path, Duration::from_secs(1)) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::Instant;

    /// A re-executed daemon is still in `<unit>/<name>/supervisor` of the memory hierarchy:
    /// its groups go below the unit again, as its first image's did.
    #[test]
    fn a_daemon_in_its_supervisor_group_finds_the_group_below_which_it_made_them() {
        let unit = "/system.slice/sandcelld.service";
        assert_eq!(
            without_own_supervisor(&format!("{unit}/sandcell/supervisor"), "sandcell"),
            unit
        );
        assert!(is_systemd_unit_group(&without_own_supervisor(
            &format!("{unit}/sandcell/supervisor"),
            "sandcell"
        )));
        assert_eq!(
            without_own_supervisor("/sandcell/supervisor", "sandcell"),
            "/"
        );
        // Anything else is left as it is.
        for other in [
            unit,
            "/",
            "/other/supervisor",
            "/x-sandcell/supervisor",
            "/sandcell/supervisor/more",
        ] {
            assert_eq!(without_own_supervisor(other, "sandcell"), other);
        }
    }

    /// Fake hierarchies and procfs in a temp dir.
    struct Fake {
        dir: PathBuf,
        host: Host,
    }

    impl Fake {
        fn new(with_cpu: bool) -> Fake {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let dir =
                std::env::temp_dir().join(format!("sandcell-v1-test-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let mut mountinfo = String::new();
            for (i, c) in ["memory", "pids", "cpu,cpuacct", "cpuset"]
                .iter()
                .enumerate()
            {
                if c.starts_with("cpu,") && !with_cpu {
                    continue;
                }
                let mp = dir.join("cg").join(c);
                std::fs::create_dir_all(&mp).unwrap();
                mountinfo.push_str(&format!(
                    "{} 31 0:{} / {} rw,nosuid - cgroup cgroup rw,{c}\n",
                    40 + i,
                    40 + i,
                    mp.display()
                ));
            }
            let proc_root = dir.join("proc");
            std::fs::create_dir_all(proc_root.join("self")).unwrap();
            std::fs::write(proc_root.join("self/mountinfo"), mountinfo).unwrap();
            std::fs::write(
                proc_root.join("self/cgroup"),
                "8:pids:/\n4:memory:/own/group\n1:cpu,cpuacct:/\n0::/\n",
            )
            .unwrap();
            Fake {
                host: Host { proc_root },
                dir,
            }
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn layout_under_own_group_or_configured_parent() {
        let f = Fake::new(true);
        let v1 = V1::open(f.host.clone(), None, "sandcell").unwrap();
        // /own/group is not a systemd unit's group: not nested into.
        assert_eq!(v1.memory.base_rel, "/sandcell/sessions");
        assert_eq!(v1.pids.base_rel, "/sandcell/sessions");
        std::fs::write(
            f.host.proc_root.join("self/cgroup"),
            "8:pids:/system.slice/sandcelld.service\n4:memory:/system.slice/sandcelld.service\n0::/\n",
        )
        .unwrap();
        let unit = V1::open(f.host.clone(), None, "sandcell").unwrap();
        assert_eq!(
            unit.memory.base_rel,
            "/system.slice/sandcelld.service/sandcell/sessions"
        );
        unit.release().unwrap();
        assert!(
            !f.dir
                .join("cg/memory/system.slice/sandcelld.service/sandcell")
                .exists()
        );
        assert!(v1.memory.base.is_dir());
        assert!(v1.supports_cpu());
        // "cpuset" must not be mistaken for "cpu".
        assert!(
            v1.cpu
                .as_ref()
                .unwrap()
                .base
                .starts_with(f.dir.join("cg/cpu,cpuacct"))
        );

        let v1 = V1::open(f.host.clone(), Some(Path::new("/")), "sc2").unwrap();
        assert_eq!(v1.memory.base_rel, "/sc2/sessions");
        assert!(f.dir.join("cg/memory/sc2/sessions").is_dir());
    }

    #[test]
    fn create_sets_limits_in_every_hierarchy() {
        let f = Fake::new(true);
        let v1 = V1::open(f.host.clone(), Some(Path::new("/")), "sandcell").unwrap();
        // Pretend swap accounting exists in this group: create the file once mkdir is done
        // by creating the group, then re-apply.
        let limits = GroupLimits {
            memory_bytes: 64 << 20,
            max_pids: 16,
            cpu_max: Some((50_000, 100_000)),
        };
        let g = v1.create("s1", &limits).unwrap();
        let mem = f.dir.join("cg/memory/sandcell/sessions/s1");
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        assert_eq!(
            read(mem.join("memory.limit_in_bytes")),
            (64u64 << 20).to_string()
        );
        assert_eq!(
            read(mem.join("memory.swappiness")),
            "0",
            "no memsw file: no swapping"
        );
        assert_eq!(
            read(f.dir.join("cg/pids/sandcell/sessions/s1/pids.max")),
            "16"
        );
        let cpu = f.dir.join("cg/cpu,cpuacct/sandcell/sessions/s1");
        assert_eq!(read(cpu.join("cpu.cfs_quota_us")), "50000");
        assert_eq!(read(cpu.join("cpu.cfs_period_us")), "100000");
        assert_eq!(g.procs_files().len(), 3);
        assert!(v1.create("s1", &limits).is_err());

        std::fs::write(
            mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        )
        .unwrap();
        assert_eq!(g.oom_kills(), 2);
        std::fs::write(mem.join("memory.max_usage_in_bytes"), "4096\n").unwrap();
        assert_eq!(g.memory_peak(), Some(4096));
    }

    #[test]
    fn cpu_limit_without_cpu_hierarchy_is_refused() {
        let f = Fake::new(false);
        let v1 = V1::open(f.host.clone(), Some(Path::new("/")), "sandcell").unwrap();
        assert!(!v1.supports_cpu());
        let limits = GroupLimits {
            memory_bytes: 1 << 20,
            max_pids: 4,
            cpu_max: Some((1, 2)),
        };
        assert!(
            v1.create("s", &limits)
                .unwrap_err()
                .to_string()
                .contains("cpu")
        );
    }

    #[test]
    fn missing_pids_hierarchy_is_an_error_with_a_hint() {
        let f = Fake::new(false);
        let mi = f.host.proc_root.join("self/mountinfo");
        let text = std::fs::read_to_string(&mi).unwrap();
        let text: String = text
            .lines()
            .filter(|l| !l.ends_with("rw,pids"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&mi, text).unwrap();
        let err = V1::open(f.host.clone(), Some(Path::new("/")), "sandcell").unwrap_err();
        assert!(err.to_string().contains("pids"), "{err}");
        assert!(err.to_string().contains("Delegate=yes"), "{err}");
    }

    // ---- The real hierarchy of this host (root, cgroup v1 memory + pids) ----

    /// The real v1 backend under a private parent, or why the test cannot run.
    fn real() -> Result<V1, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("needs root".into());
        }
        let mounts = Host::default().mounts().map_err(|e| e.to_string())?;
        if find_mount(&mounts, "memory").is_none() || find_mount(&mounts, "pids").is_none() {
            return Err("needs cgroup v1 memory and pids hierarchies (a hybrid host)".into());
        }
        let parent = PathBuf::from(format!("/sandcell-test-{}", std::process::id()));
        V1::open(Host::default(), Some(&parent), "sandcell").map_err(|e| e.to_string())
    }

    /// Removes the private parent groups made by [`real`].
    fn cleanup_real(v1: &V1) {
        for h in v1.hierarchies() {
            // base = <mount>/sandcell-test-<pid>/sandcell/sessions
            let sessions = h.base.clone();
            let name = sessions.parent().unwrap().to_path_buf();
            let parent = name.parent().unwrap().to_path_buf();
            for p in [sessions, name, parent] {
                let _ = std::fs::remove_dir(p);
            }
        }
    }

    /// Spawns `sh -c script` joined to `group` from pre_exec (writing "0" to each pre-opened
    /// cgroup.procs, as the daemon does).
    fn spawn_in(group: &dyn SessionGroup, script: &str) -> std::process::Child {
        use std::os::fd::AsRawFd;
        let files: Vec<std::fs::File> = group
            .procs_files()
            .iter()
            .map(|p| std::fs::OpenOptions::new().write(true).open(p).unwrap())
            .collect();
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure only calls write(2) on descriptors opened before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &fds {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(files);
        child
    }

    fn pids_current(group: &V1Group) -> u64 {
        host::number(&group.dir("pids").unwrap().join("pids.current")).unwrap_or(0)
    }

    #[test]
    fn real_v1_hierarchy_limits_kills_and_sweeps() {
        let v1 = match real() {
            Ok(v) => v,
            Err(why) => {
                eprintln!("skipping the real cgroup v1 test: {why}");
                return;
            }
        };
        let limits = GroupLimits {
            memory_bytes: 64 << 20,
            max_pids: 16,
            cpu_max: None,
        };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // detect() picks v1 on this hybrid host (its cgroup2 mount has no memory/pids).
            let parent = PathBuf::from(format!("/sandcell-test-{}", std::process::id()));
            let config = super::super::DetectConfig {
                v1_parent: Some(parent),
                v1_name: "sandcell".into(),
                host: Host::default(),
                supervisor_memory: None,
            };
            assert_eq!(super::super::detect(&config).unwrap().mode(), "v1");

            // Join + verify.
            let group = v1.create("join", &limits).unwrap();
            assert!(group.memory_current().is_some());
            let mut child = spawn_in(group.as_ref(), "sleep 30");
            group.verify_member(child.id()).unwrap();
            let outsider = std::process::id();
            assert!(
                group.verify_member(outsider).is_err(),
                "the test process is not a member"
            );
            group.kill_all(Duration::from_secs(5)).unwrap();
            let status = child.wait().unwrap();
            assert!(!status.success());
            group.remove().unwrap();
            for f in group.procs_files() {
                assert!(!f.exists(), "{} still exists", f.display());
            }

            // Fork bomb stops at pids.max.
            let group = v1.create("bomb", &limits).unwrap();
            let concrete = V1Group {
                host: Host::default(),
                dirs: v1
                    .hierarchies()
                    .into_iter()
                    .map(|h| Dir {
                        controller: h.controller,
                        path: h.base.join("bomb"),
                        rel: format!("{}/bomb", h.base_rel),
                    })
                    .collect(),
                limits: limits.clone(),
            };
            let mut bomb = spawn_in(group.as_ref(), "while :; do sleep 30 & done");
            let start = Instant::now();
            let mut refused = 0;
            while start.elapsed() < Duration::from_secs(5) {
                let events =
                    host::read(&concrete.dir("pids").unwrap().join("pids.events"), "read").unwrap();
                refused = host::keyed(&events, "max").unwrap_or(0);
                if refused > 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(refused > 0, "pids.max never refused a fork");
            let current = pids_current(&concrete);
            assert!(current <= 16, "pids.current {current} over pids.max 16");
            assert!(
                current >= 10,
                "the bomb did not get near the limit: {current}"
            );
            group.kill_all(Duration::from_secs(5)).unwrap();
            let _ = bomb.wait();
            // The bomb's children were orphaned: their zombies count in pids.current until
            // init (or a subreaper) reaps them, after cgroup.procs is already empty.
            let start = Instant::now();
            while pids_current(&concrete) > 0 && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_eq!(pids_current(&concrete), 0, "zombies were never reaped");
            group.remove().unwrap();

            // Memory hog is OOM-killed, counted once; peak near the limit.
            let group = v1.create("hog", &limits).unwrap();
            assert_eq!(group.oom_kills(), 0);
            let mut hog = spawn_in(group.as_ref(), "exec tail /dev/zero");
            let status = hog.wait().unwrap();
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "hog ended with {status:?}"
            );
            assert_eq!(group.oom_kills(), 1);
            let peak = group.memory_peak().unwrap();
            assert!(peak > 48 << 20 && peak <= 64 << 20, "peak {peak}");
            group.kill_all(Duration::from_secs(5)).unwrap();
            group.remove().unwrap();

            // Leftovers of a crashed daemon are swept: a live process and an empty group.
            let stale = v1.create("stale1", &limits).unwrap();
            let mut survivor = spawn_in(stale.as_ref(), "sleep 60");
            let _stale2 = v1.create("stale2", &limits).unwrap();
            let fresh = V1::open(
                Host::default(),
                Some(&PathBuf::from(format!(
                    "/sandcell-test-{}",
                    std::process::id()
                ))),
                "sandcell",
            )
            .unwrap();
            assert_eq!(
                fresh.sweep_stale().unwrap(),
                super::super::Swept {
                    groups: 2,
                    populated: vec!["stale1".to_string()]
                }
            );
            let status = survivor.wait().unwrap();
            assert!(!status.success(), "the stale worker survived the sweep");
            for h in v1.hierarchies() {
                assert!(
                    host::subdirs(&h.base).unwrap().is_empty(),
                    "{} not empty",
                    h.base.display()
                );
            }
        }));
        let _ = v1.sweep_stale();
        let released = v1.release();
        let parents_left: Vec<PathBuf> = v1
            .hierarchies()
            .iter()
            .filter_map(|h| h.base.parent().map(Path::to_path_buf))
            .filter(|p| p.exists())
            .collect();
        cleanup_real(&v1);
        if result.is_ok() {
            released.unwrap();
            assert!(parents_left.is_empty(), "release left {parents_left:?}");
        }
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}
