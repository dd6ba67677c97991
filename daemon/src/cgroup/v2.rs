//! cgroup v2: the production layout (kernel `Documentation/admin-guide/cgroup-v2.rst`).
//!
//! ```text
//! <delegated root>                 the service's own group (systemd Delegate=yes)
//! ├── supervisor/                  sandcelld itself, moved here at start
//! └── sessions/                    no processes; +memory +pids [+cpu] for its children
//!     └── <id>/                    one worker: memory.max, memory.swap.max=0, pids.max,
//!                                  cpu.max, memory.oom.group=1
//! ```
//!
//! Under systemd the session groups live in the companion unit `sandcell-sessions.service`
//! instead ([`SessionsHome`]: `<that unit>/sessions/<id>`, same limits), so that systemd's kill
//! of sandcelld.service's group on a restart, `systemctl kill`, a crash or an OOM kill of the
//! daemon does not reach the workers; `supervisor/` stays in sandcelld.service.
//!
//! Why `supervisor/`: the "no internal processes" rule. A group that distributes controllers
//! to its children (`cgroup.subtree_control`) may not hold processes itself, so the daemon
//! leaves the delegated root before enabling `+memory +pids +cpu` there.
//!
//! The delegated root is the daemon's own group, read from `/proc/self/cgroup` (`0::<path>`);
//! when that path already ends in `/supervisor` (a restarted daemon inside the same unit), its
//! parent is the root. A daemon in the root cgroup (`/`) has nothing delegated and is refused.
//!
//! Reading results: OOM kills from `memory.events` (`oom_kill`, counting the subtree),
//! peak from `memory.peak` (Linux 5.19+), kill with `cgroup.kill` (Linux 5.14+, falling back
//! to a pidfd kill loop), emptiness from `cgroup.events` (`populated 0`).
//!
//! Direct cgroupfs rather than the `cgroups-rs` crate: cgroups-rs 0.5 hard-codes the v2 root
//! to `/sys/fs/cgroup` (no delegated subtree), reads OOM events from v1 files on v2, and pulls
//! in zbus 5 and a second nix; the files used here are few and documented.

use super::host::{self, Host};
use super::{Backend, Error, GroupLimits, SessionGroup};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The v2 backend, rooted at a delegated subtree.
#[derive(Debug)]
pub struct V2 {
    host: Host,
    /// File-system path of the delegated root.
    root: PathBuf,
    /// File-system path of the group whose `sessions/` holds the session groups: the
    /// delegated root itself, or the companion unit's group ([`SessionsHome`]).
    home: PathBuf,
    /// Path of `home` relative to the cgroup2 mount, as `/proc/<pid>/cgroup` shows it
    /// (`/system.slice/sandcelld.service` or `/system.slice/sandcell-sessions.service`).
    home_rel: String,
    /// Whether the cpu controller is enabled for sessions.
    cpu: bool,
}

/// Controllers a session needs, and the optional one.
const REQUIRED: [&str; 2] = ["memory", "pids"];
const OPTIONAL_CPU: &str = "cpu";

impl V2 {
    /// Whether `root` (a group directory) offers memory and pids in `cgroup.controllers`.
    pub fn usable(root: &Path) -> bool {
        host::read(&root.join("cgroup.controllers"), "read")
            .map(|c| {
                let have: Vec<&str> = c.split_whitespace().collect();
                REQUIRED.iter().all(|r| have.contains(r))
            })
            .unwrap_or(false)
    }

    /// Before the daemon moves into an existing `<root>/supervisor` (a restart in the same
    /// unit, whose group systemd may keep between a crash and the next start): writes that
    /// group's `memory.max` and `memory.high` (bytes) first, so the daemon never runs, even
    /// briefly, under a limit anything else left there (an operator's or a test's write that
    /// OOM-killed its predecessor). Nothing to do when the group or its memory files do not
    /// exist yet (a first start); a write that fails is left to [`Backend::bound_supervisor`],
    /// which writes the same values after the move and reports its errors.
    pub fn preset_supervisor(root: &Path, max: u64, high: u64) {
        let supervisor = root.join("supervisor");
        if supervisor.join("memory.max").exists() {
            let _ = host::write(&supervisor.join("memory.max"), &max.to_string());
            let _ = host::write(&supervisor.join("memory.high"), &high.min(max).to_string());
        }
    }

    /// Sets up the delegated root at `root` (file-system path; `root_rel` as in
    /// `/proc/<pid>/cgroup`): moves every process of the root into `supervisor/`, enables the
    /// controllers for `sessions/`'s children.
    ///
    /// Errors: [`Error::Unsupported`] with a hint when memory or pids is not delegated;
    /// [`Error::Io`] for a file that cannot be written (`EBUSY` on `cgroup.subtree_control`
    /// means processes outside sandcelld's control sit in the root).
    pub fn open(host: Host, root: PathBuf, root_rel: String) -> Result<V2, Error> {
        Self::open_with(host, root, root_rel, None)
    }

    /// [`V2::open`], with the session groups under `home` instead of the delegated root when
    /// it is given: `home` must offer memory and pids too, and must hold no process itself
    /// (its holder sits in `holder/`); the daemon enables the controllers for `home/sessions`'
    /// children. Errors: as [`V2::open`], for either group.
    pub fn open_with(
        host: Host,
        root: PathBuf,
        root_rel: String,
        home: Option<SessionsHome>,
    ) -> Result<V2, Error> {
        let controllers = host::read(&root.join("cgroup.controllers"), "read controllers of")?;
        let have: Vec<&str> = controllers.split_whitespace().collect();
        if let Some(missing) = REQUIRED.iter().find(|r| !have.contains(r)) {
            return Err(Error::Unsupported(format!(
                "controller {missing} is not available in {} (has: {controllers:?}); run \
                 sandcelld under systemd with Delegate=yes, or delegate memory and pids to it",
                root.display()
            )));
        }
        let cpu = have.contains(&OPTIONAL_CPU);
        let enable = if cpu {
            "+memory +pids +cpu"
        } else {
            "+memory +pids"
        };

        let supervisor = root.join("supervisor");
        host::mkdir(&supervisor, true)?;
        // Every process in the root (sandcelld itself, and anything systemd started with it)
        // moves to supervisor/; writing a pid to cgroup.procs moves the whole process.
        let procs = supervisor.join("cgroup.procs");
        for pid in host::listed_pids(&[root.join("cgroup.procs")]) {
            host::write(&procs, &pid.to_string())?;
        }
        host::write(&root.join("cgroup.subtree_control"), enable)?;
        let (home, home_rel) = match home {
            None => (root.clone(), root_rel),
            Some(h) => {
                let theirs = host::read(&h.dir.join("cgroup.controllers"), "read controllers of")?;
                let theirs: Vec<&str> = theirs.split_whitespace().collect();
                if let Some(missing) = REQUIRED
                    .iter()
                    .chain(cpu.then_some(&OPTIONAL_CPU))
                    .find(|r| !theirs.contains(r))
                {
                    return Err(Error::Unsupported(format!(
                        "controller {missing} is not available in {} (the sessions' unit needs                          Delegate=yes)",
                        h.dir.display()
                    )));
                }
                host::write(&h.dir.join("cgroup.subtree_control"), enable)?;
                (h.dir, h.rel)
            }
        };
        let sessions = home.join("sessions");
        host::mkdir(&sessions, true)?;
        host::write(&sessions.join("cgroup.subtree_control"), enable)?;
        Ok(V2 {
            host,
            root,
            home,
            home_rel,
            cpu,
        })
    }

    fn sessions(&self) -> PathBuf {
        self.home.join("sessions")
    }

    /// Where the session groups are: `<home>/sessions`, as `/proc/<pid>/cgroup` shows it.
    pub fn sessions_rel(&self) -> String {
        format!("{}/sessions", self.home_rel.trim_end_matches('/'))
    }
}

impl Backend for V2 {
    fn mode(&self) -> &'static str {
        "v2"
    }

    fn supports_cpu(&self) -> bool {
        self.cpu
    }

    fn create(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        host::check_id(id)?;
        if limits.cpu_max.is_some() && !self.cpu {
            return Err(Error::Unsupported(
                "a cpu limit was asked for but the cpu controller is not delegated; delegate it \
                 or set worker_cpus = 0"
                    .into(),
            ));
        }
        let dir = self.sessions().join(id);
        host::mkdir(&dir, false)?;
        let group = V2Group {
            host: self.host.clone(),
            rel: format!("{}/{id}", self.sessions_rel()),
            dir,
            limits: limits.clone(),
            peak: Default::default(),
        };
        if let Err(e) = group.apply_limits() {
            let _ = host::rmdir(&group.dir, Duration::ZERO);
            return Err(e);
        }
        Ok(Box::new(group))
    }

    fn bound_supervisor(&self, max: u64, high: u64) -> Result<Option<PathBuf>, Error> {
        // The root distributes memory to its children (open() enabled it), so supervisor/
        // has the memory interface files.
        let supervisor = self.root.join("supervisor");
        host::write(&supervisor.join("memory.max"), &max.to_string())?;
        host::write(&supervisor.join("memory.high"), &high.min(max).to_string())?;
        Ok(Some(supervisor))
    }

    fn adopt(&self, id: &str, limits: &GroupLimits) -> Result<Box<dyn SessionGroup>, Error> {
        host::check_id(id)?;
        let dir = self.sessions().join(id);
        if !dir.is_dir() {
            return Err(Error::Verify(format!("{} does not exist", dir.display())));
        }
        Ok(Box::new(V2Group {
            host: self.host.clone(),
            rel: format!("{}/{id}", self.sessions_rel()),
            dir,
            limits: limits.clone(),
            peak: Default::default(),
        }))
    }

    fn sweep_stale_except(&self, keep: &[String]) -> Result<super::Swept, Error> {
        // Every group gets its kill and removal even if an earlier one fails; the first error
        // is returned after all were tried.
        let mut swept = super::Swept::default();
        let mut first_error = None;
        let stale: Vec<(String, PathBuf, bool)> = host::subdirs(&self.sessions())?
            .into_iter()
            .filter(|name| !keep.contains(name))
            .map(|name| {
                let dir = self.sessions().join(&name);
                // `populated` counts the whole subtree (cgroup-v2.rst, "cgroup.events").
                let populated = host::read(&dir.join("cgroup.events"), "read")
                    .ok()
                    .and_then(|t| host::keyed(&t, "populated"))
                    != Some(0);
                // Every stale group is killed before any is waited for, so the kernel tears
                // their processes down together (a crashed daemon leaves its warm workers).
                if populated {
                    let _ = host::write(&dir.join("cgroup.kill"), "1");
                }
                (name, dir, populated)
            })
            .collect();
        for (name, dir, populated) in stale {
            match kill_tree(&dir, super::KILL_TIMEOUT).and_then(|()| remove_tree(&dir)) {
                Ok(()) => {
                    swept.groups += 1;
                    if populated {
                        swept.populated.push(name);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(swept), Err)
    }
}

/// The group of the companion unit `sandcell-sessions.service` (Delegate=yes), where
/// session groups live so that systemd's kill of sandcelld.service's own cgroup (on
/// `systemctl restart`, `systemctl kill`, a crash or an OOM kill of the daemon, with
/// `KillMode=control-group`) does not reach them:
///
/// ```text
/// <sessions unit>/
/// ├── holder/        the unit's main process (sandcelld --hold-sessions), nothing else
/// └── sessions/<id>  one session group each, as under the delegated root
/// ```
#[derive(Debug, Clone)]
pub struct SessionsHome {
    /// File-system path of the unit's group.
    pub dir: PathBuf,
    /// The same path relative to the cgroup2 mount (`/system.slice/sandcell-sessions.service`).
    pub rel: String,
}

/// The companion unit whose group holds the session groups under systemd.
pub const SESSIONS_UNIT: &str = "sandcell-sessions.service";

/// Where `--hold-sessions` puts the companion unit's main process, leaving the unit's group
/// free to distribute controllers (the "no internal processes" rule).
pub const HOLDER: &str = "holder";

/// One session's v2 group.
#[derive(Debug)]
pub struct V2Group {
    host: Host,
    dir: PathBuf,
    rel: String,
    limits: GroupLimits,
    /// `memory.peak` opened read-write and reset: reads through it give the peak since the
    /// reset (see [`SessionGroup::reset_memory_peak`]).
    peak: std::sync::Mutex<Option<std::fs::File>>,
}

impl V2Group {
    fn apply_limits(&self) -> Result<(), Error> {
        let l = &self.limits;
        host::write(&self.dir.join("memory.max"), &l.memory_bytes.to_string())?;
        // No swap: memory.max must be the whole budget. The file is missing when
        // the kernel has no swap support or no swap accounting; that is acceptable only while
        // no swap is active (/proc/swaps), since then nothing can extend the limit.
        match host::write(&self.dir.join("memory.swap.max"), "0") {
            Ok(()) => {}
            Err(Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound && !self.host.swap_active() => {}
            Err(e) => {
                return Err(Error::Unsupported(format!(
                    "{e}: swap is active but cannot be limited; boot with swap accounting \
                     (no swapaccount=0) or turn swap off"
                )));
            }
        }
        host::write(&self.dir.join("pids.max"), &l.max_pids.to_string())?;
        if let Some((quota, period)) = l.cpu_max {
            host::write(&self.dir.join("cpu.max"), &format!("{quota} {period}"))?;
        }
        // An OOM kill takes the whole group: a half-killed worker is worse than none.
        host::write(&self.dir.join("memory.oom.group"), "1")?;
        Ok(())
    }

    fn is_member(host: &Host, rel: &str, pid: u32) -> bool {
        host.memberships(Some(pid))
            .map(|m| m.iter().any(|m| m.id == 0 && m.path == rel))
            .unwrap_or(false)
    }
}

impl SessionGroup for V2Group {
    fn procs_files(&self) -> Vec<PathBuf> {
        vec![self.dir.join("cgroup.procs")]
    }

    fn verify_member(&self, pid: u32) -> Result<(), Error> {
        let m = self.host.memberships(Some(pid))?;
        let path = m.iter().find(|m| m.id == 0).map(|m| m.path.as_str());
        if path != Some(self.rel.as_str()) {
            return Err(Error::Verify(format!(
                "process {pid} is in {path:?}, not in {}",
                self.rel
            )));
        }
        let want = host::page_floor(self.limits.memory_bytes);
        let got = host::number(&self.dir.join("memory.max"));
        if got != Some(want) {
            return Err(Error::Verify(format!(
                "memory.max is {got:?}, expected {want}"
            )));
        }
        let got = host::number(&self.dir.join("pids.max"));
        if got != Some(self.limits.max_pids) {
            return Err(Error::Verify(format!(
                "pids.max is {got:?}, expected {}",
                self.limits.max_pids
            )));
        }
        let swap = self.dir.join("memory.swap.max");
        let got = host::number(&swap);
        if got != Some(0) && (swap.exists() || self.host.swap_active()) {
            return Err(Error::Verify(format!(
                "memory.swap.max is {got:?}, expected 0"
            )));
        }
        Ok(())
    }

    fn oom_kills(&self) -> u64 {
        host::read(&self.dir.join("memory.events"), "read")
            .ok()
            .and_then(|t| host::keyed(&t, "oom_kill"))
            .unwrap_or(0)
    }

    fn memory_current(&self) -> Option<u64> {
        host::number(&self.dir.join("memory.current"))
    }

    fn memory_peak(&self) -> Option<u64> {
        let window = self.peak.lock().unwrap_or_else(|e| e.into_inner());
        match window.as_ref() {
            Some(f) => host::number_at(f),
            None => host::number(&self.dir.join("memory.peak")),
        }
    }

    fn reset_memory_peak(&self) -> bool {
        let window = host::open_reset(&self.dir.join("memory.peak"), "reset\n").ok();
        let reset = window.is_some();
        *self.peak.lock().unwrap_or_else(|e| e.into_inner()) = window;
        reset
    }

    fn kill_all(&self, timeout: Duration) -> Result<(), Error> {
        let (host, rel) = (self.host.clone(), self.rel.clone());
        kill_tree_with(&self.dir, timeout, &move |pid| {
            V2Group::is_member(&host, &rel, pid)
        })
    }

    fn kill_others(&self, keep: u32, timeout: Duration) -> Result<Vec<host::Leftover>, Error> {
        let (host, rel) = (self.host.clone(), self.rel.clone());
        host::kill_others(
            &[self.dir.join("cgroup.procs")],
            keep,
            &move |pid| V2Group::is_member(&host, &rel, pid),
            timeout,
        )
    }

    fn remove(&self) -> Result<(), Error> {
        host::rmdir(&self.dir, Duration::from_secs(1))
    }
}

/// Kills everything in the group at `dir` and its descendants; see [`kill_tree_with`].
fn kill_tree(dir: &Path, timeout: Duration) -> Result<(), Error> {
    // A stale group's members are whatever cgroup.procs lists; no membership path is known
    // for a group a previous daemon made, so a pid read from the file is trusted once pinned.
    kill_tree_with(dir, timeout, &|_| true)
}

/// Writes `1` to `cgroup.kill` (SIGKILL to the subtree, atomic with respect to forks); on
/// kernels without it (before 5.14) loops over `cgroup.procs` with pidfds. Then waits for
/// `cgroup.events` to say `populated 0`.
///
/// Errors: [`Error::Verify`] if the group is still populated after `timeout`.
fn kill_tree_with(
    dir: &Path,
    timeout: Duration,
    is_member: &dyn Fn(u32) -> bool,
) -> Result<(), Error> {
    let start = Instant::now();
    let procs = [dir.join("cgroup.procs")];
    match host::write(&dir.join("cgroup.kill"), "1") {
        Ok(()) => {}
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            host::kill_loop(&procs, is_member, timeout)?;
        }
        Err(e) => return Err(e),
    }
    loop {
        let populated = host::read(&dir.join("cgroup.events"), "read")
            .ok()
            .and_then(|t| host::keyed(&t, "populated"));
        let empty = match populated {
            Some(p) => p == 0,
            None => host::listed_pids(&procs).is_empty(),
        };
        if empty {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(Error::Verify(format!(
                "{} still populated {timeout:?} after cgroup.kill",
                dir.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Removes `dir` and any child groups, deepest first.
fn remove_tree(dir: &Path) -> Result<(), Error> {
    for child in host::subdirs(dir)? {
        remove_tree(&dir.join(child))?;
    }
    host::rmdir(dir, Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake delegated root in a temp dir: regular files stand in for interface files.
    fn fake_root(controllers: &str) -> PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let root =
            std::env::temp_dir().join(format!("sandcell-v2-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("cgroup.controllers"), controllers).unwrap();
        std::fs::write(root.join("cgroup.procs"), "101\n102\n").unwrap();
        root
    }

    #[test]
    fn a_kept_supervisor_group_gets_its_bound_before_the_move() {
        let root = fake_root("memory pids\n");
        // A first start: no supervisor/ yet, nothing is made.
        V2::preset_supervisor(&root, 64 << 20, 48 << 20);
        assert!(!root.join("supervisor").exists());
        // The group a predecessor was OOM-killed in, its limit lowered to 1 MiB.
        std::fs::create_dir_all(root.join("supervisor")).unwrap();
        std::fs::write(root.join("supervisor/memory.max"), "1048576").unwrap();
        std::fs::write(root.join("supervisor/memory.high"), "max").unwrap();
        V2::preset_supervisor(&root, 64 << 20, 96 << 20);
        let read = |f: &str| std::fs::read_to_string(root.join("supervisor").join(f)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(
            read("memory.high"),
            (64u64 << 20).to_string(),
            "high at most max"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn open_moves_processes_and_enables_controllers() {
        let root = fake_root("cpuset cpu io memory hugetlb pids rdma misc\n");
        let v2 = V2::open(
            Host::default(),
            root.clone(),
            "/system.slice/sandcelld.service".into(),
        )
        .unwrap();
        assert!(v2.supports_cpu());
        // Each pid written separately (the fake file keeps the last write).
        assert_eq!(
            std::fs::read_to_string(root.join("supervisor/cgroup.procs")).unwrap(),
            "102"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap(),
            "+memory +pids +cpu"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("sessions/cgroup.subtree_control")).unwrap(),
            "+memory +pids +cpu"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn open_refuses_without_memory_or_pids() {
        let root = fake_root("cpu io pids\n");
        let err = V2::open(Host::default(), root.clone(), "/x".into()).unwrap_err();
        assert!(err.to_string().contains("memory"), "{err}");
        assert!(err.to_string().contains("Delegate=yes"), "{err}");
        assert!(!V2::usable(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn create_writes_limits_and_refuses_duplicates() {
        let root = fake_root("memory pids\n");
        let v2 = V2::open(Host::default(), root.clone(), "/svc".into()).unwrap();
        assert!(!v2.supports_cpu());
        let limits = GroupLimits {
            memory_bytes: 64 << 20,
            max_pids: 16,
            cpu_max: None,
        };
        let g = v2.create("s1", &limits).unwrap();
        let dir = root.join("sessions/s1");
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(read("memory.swap.max"), "0");
        assert_eq!(read("pids.max"), "16");
        assert_eq!(read("memory.oom.group"), "1");
        assert_eq!(g.procs_files(), vec![dir.join("cgroup.procs")]);
        assert!(v2.create("s1", &limits).is_err(), "duplicate id accepted");
        assert!(v2.create("../x", &limits).is_err(), "path id accepted");
        let cpu = GroupLimits {
            cpu_max: Some((50_000, 100_000)),
            ..limits
        };
        assert!(
            v2.create("s2", &cpu)
                .unwrap_err()
                .to_string()
                .contains("cpu")
        );

        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(g.oom_kills(), 1);
        std::fs::write(dir.join("memory.peak"), "12345\n").unwrap();
        assert_eq!(g.memory_peak(), Some(12345));
        // A reset writes to memory.peak and later reads go through the kept descriptor.
        assert!(g.reset_memory_peak());
        assert_eq!(read("memory.peak"), "reset\n");
        std::fs::write(dir.join("memory.peak"), "777\n").unwrap();
        assert_eq!(g.memory_peak(), Some(777));
        assert_eq!(g.memory_current(), None);

        // kill_all: cgroup.kill written, waits for populated 0.
        std::fs::write(dir.join("cgroup.events"), "populated 0\nfrozen 0\n").unwrap();
        g.kill_all(Duration::from_millis(100)).unwrap();
        assert_eq!(read("cgroup.kill"), "1");
        std::fs::write(dir.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        assert!(
            g.kill_all(Duration::from_millis(20)).is_err(),
            "populated group reported empty"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn verify_member_reads_proc() {
        let root = fake_root("memory pids\n");
        let proc_root = root.join("proc");
        std::fs::create_dir_all(proc_root.join("77")).unwrap();
        let host = Host {
            proc_root: proc_root.clone(),
        };
        let v2 = V2::open(host, root.clone(), "/svc".into()).unwrap();
        let limits = GroupLimits {
            memory_bytes: 64 << 20,
            max_pids: 16,
            cpu_max: None,
        };
        let g = v2.create("s1", &limits).unwrap();
        std::fs::write(proc_root.join("77/cgroup"), "0::/svc/sessions/s1\n").unwrap();
        g.verify_member(77).unwrap();
        std::fs::write(proc_root.join("77/cgroup"), "0::/svc/supervisor\n").unwrap();
        assert!(
            g.verify_member(77).is_err(),
            "member of the wrong group accepted"
        );
        std::fs::write(proc_root.join("77/cgroup"), "0::/svc/sessions/s1\n").unwrap();
        std::fs::write(root.join("sessions/s1/pids.max"), "max").unwrap();
        assert!(g.verify_member(77).is_err(), "missing pids limit accepted");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn sweep_kills_every_session_group() {
        let root = fake_root("memory pids\n");
        let v2 = V2::open(Host::default(), root.clone(), "/svc".into()).unwrap();
        for id in ["a", "b"] {
            let dir = root.join("sessions").join(id);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup.events"), "populated 0\n").unwrap();
        }
        // Fake interface files make rmdir fail with ENOTEMPTY on a regular file system;
        // remove_tree only removes directories, so clear the files the way cgroupfs would.
        let err = v2.sweep_stale();
        assert!(
            err.is_err(),
            "regular directories with files cannot be rmdir'ed"
        );
        for id in ["a", "b"] {
            let dir = root.join("sessions").join(id);
            assert_eq!(
                std::fs::read_to_string(dir.join("cgroup.kill")).unwrap(),
                "1"
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    // ---- The real cgroup2 mount of this host ----
    //
    // On the hybrid development host the cgroup2 mount (/sys/fs/cgroup/unified) has no memory
    // or pids controller, so V2::open refuses it; the mechanics that need no controller
    // (joining from pre_exec, membership, cgroup.kill, cgroup.events, rmdir, sweeping) are
    // exercised on it directly. Limits are tested on v1 here and in the VM system tests.

    fn real_mount() -> Result<PathBuf, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("needs root".into());
        }
        let mounts = Host::default().mounts().map_err(|e| e.to_string())?;
        let m = mounts
            .iter()
            .find(|m| m.fstype == "cgroup2" && m.root == "/")
            .ok_or("no cgroup2 mount")?;
        if !m.mount_point.join("cgroup.kill").exists()
            && !m.mount_point.join("cgroup.procs").exists()
        {
            return Err("cgroup2 mount has no interface files".into());
        }
        Ok(m.mount_point.clone())
    }

    fn spawn_in(procs: &Path, script: &str) -> std::process::Child {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let file = std::fs::OpenOptions::new().write(true).open(procs).unwrap();
        let fd = file.as_raw_fd();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c").arg(script).stdin(std::process::Stdio::null());
        // SAFETY: the closure only calls write(2) on a descriptor opened before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(file);
        child
    }

    #[test]
    fn real_cgroup2_join_kill_remove_and_sweep() {
        let mount = match real_mount() {
            Ok(m) => m,
            Err(why) => {
                eprintln!("skipping the real cgroup2 test: {why}");
                return;
            }
        };
        let name = format!("sandcell-test-{}", std::process::id());
        let top = mount.join(&name);
        host::mkdir(&top, false).unwrap();
        let result = std::panic::catch_unwind(|| {
            // A session group, joined from pre_exec; the child forks too.
            let dir = top.join("s1");
            host::mkdir(&dir, false).unwrap();
            let group = V2Group {
                host: Host::default(),
                dir: dir.clone(),
                rel: format!("/{name}/s1"),
                limits: GroupLimits {
                    memory_bytes: 0,
                    max_pids: 0,
                    cpu_max: None,
                },
                peak: Default::default(),
            };
            let mut child = spawn_in(&dir.join("cgroup.procs"), "sleep 60 & sleep 60; wait");
            assert!(V2Group::is_member(&group.host, &group.rel, child.id()));
            assert!(!V2Group::is_member(
                &group.host,
                &group.rel,
                std::process::id()
            ));
            let start = Instant::now();
            while host::listed_pids(&group.procs_files()).len() < 3
                && start.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                host::listed_pids(&group.procs_files()).len(),
                3,
                "sh and two sleeps"
            );
            group.kill_all(Duration::from_secs(5)).unwrap();
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
            assert_eq!(
                host::keyed(
                    &host::read(&dir.join("cgroup.events"), "read").unwrap(),
                    "populated"
                ),
                Some(0)
            );
            group.remove().unwrap();
            assert!(!dir.exists());

            // Stale groups of a crashed daemon, one with a live process, one nested.
            let root = top.join("root");
            host::mkdir(&root, false).unwrap();
            host::mkdir(&root.join("sessions"), false).unwrap();
            host::mkdir(&root.join("sessions/a"), false).unwrap();
            host::mkdir(&root.join("sessions/b"), false).unwrap();
            host::mkdir(&root.join("sessions/b/nested"), false).unwrap();
            let mut survivor = spawn_in(&root.join("sessions/a/cgroup.procs"), "sleep 60");
            let v2 = V2 {
                host: Host::default(),
                root: root.clone(),
                home: root.clone(),
                home_rel: format!("/{name}/root"),
                cpu: false,
            };
            assert_eq!(
                v2.sweep_stale().unwrap(),
                super::super::Swept {
                    groups: 2,
                    populated: vec!["a".to_string()]
                }
            );
            assert!(!survivor.wait().unwrap().success());
            assert!(host::subdirs(&root.join("sessions")).unwrap().is_empty());
        });
        // Clean up whatever is left, deepest first.
        let _ = kill_tree(&top, Duration::from_secs(5));
        let _ = remove_tree(&top);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}
