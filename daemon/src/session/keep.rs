//! Sessions kept for adoption: the actor's side of the keeper (`crate::keeper`) and of the
//! session record (`crate::records`), and the construction of a session around a worker
//! adopted from a previous daemon ([`Session::adopt`]).
//!
//! A session started with [`Keep`] starts its keeper before its first command and writes its
//! record then and whenever a recorded field changed (a cell's start and end, the cell
//! counter, the idle clock). Its end sends the keeper `end` and removes the record, so a stop
//! that ends sessions leaves nothing to adopt.

use super::*;
use crate::keeper::{self, Held, Lifeline};
use crate::records::{self, ProcId, Record};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// How this daemon keeps its sessions for a successor.
#[derive(Debug, Clone)]
pub struct Keep {
    /// `adopt_dir`: records and keeper sockets.
    pub dir: PathBuf,
    /// `adopt_timeout_seconds`.
    pub timeout: Duration,
}

/// The actor's keeper and record.
pub(super) struct Kept {
    keep: Keep,
    environment: String,
    lifeline: Option<Lifeline>,
    /// The keeper, when this daemon started it (its parent reaps it).
    child: Option<std::process::Child>,
    /// The keeper the session's warm worker came with, until [`Actor::start_keeper`] makes it
    /// the session's.
    warm: Option<keeper::WarmKeeper>,
    worker: Option<ProcId>,
    /// The last record written, and the idle clock it was written with.
    last: Option<(Record, Instant)>,
}

impl Kept {
    pub(super) fn new(
        keep: Keep,
        environment: String,
        lifeline: Option<Lifeline>,
        warm: Option<keeper::WarmKeeper>,
    ) -> Kept {
        Kept {
            keep,
            environment,
            lifeline,
            child: None,
            warm,
            worker: None,
            last: None,
        }
    }
}

fn interrupt_name(t: crate::worker::InterruptTarget) -> &'static str {
    match t {
        crate::worker::InterruptTarget::ProcessGroup => "process_group",
        crate::worker::InterruptTarget::Process => "process",
        crate::worker::InterruptTarget::MainThread => "main_thread",
    }
}

fn interrupt_of(s: &str) -> Option<crate::worker::InterruptTarget> {
    Some(match s {
        "process_group" => crate::worker::InterruptTarget::ProcessGroup,
        "process" => crate::worker::InterruptTarget::Process,
        "main_thread" => crate::worker::InterruptTarget::MainThread,
        _ => return None,
    })
}

/// Duplicates of a worker's descriptors as its keeper holds them ([`Held`]): its pidfd, its
/// session directory opened `O_DIRECTORY` (not following a symlink), the daemon's ends of its
/// request and reply pipes, of a native worker's stdout and stderr, and the session's egress
/// listener.
///
/// Errors: no pidfd (Linux before 5.3), a `dup(2)` or the open failed.
pub fn held_of(
    pidfd: Option<&crate::worker::WorkerPidfd>,
    session_dir: &Path,
    requests: BorrowedFd<'_>,
    replies: BorrowedFd<'_>,
    raw: Option<(BorrowedFd<'_>, BorrowedFd<'_>)>,
    egress: Option<BorrowedFd<'_>>,
) -> std::io::Result<Held> {
    let pidfd =
        pidfd.ok_or_else(|| std::io::Error::other("the kernel gave no pidfd (Linux 5.3+)"))?;
    let raw = match raw {
        Some((o, e)) => Some((o.try_clone_to_owned()?, e.try_clone_to_owned()?)),
        None => None,
    };
    Ok(Held {
        pidfd: pidfd.try_clone_fd()?,
        dir: open_dir(session_dir)?,
        requests: requests.try_clone_to_owned()?,
        replies: replies.try_clone_to_owned()?,
        raw,
        egress: egress.map(|l| l.try_clone_to_owned()).transpose()?,
    })
}

fn open_dir(path: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?
        .into())
}

impl Actor {
    /// Duplicates of the descriptors a keeper holds.
    fn held(&self) -> std::io::Result<Held> {
        held_of(
            self.pidfd.as_ref(),
            &self.session_dir,
            self.requests.as_fd(),
            self.replies.get_ref().as_fd(),
            self.stdout
                .as_ref()
                .zip(self.stderr.as_ref())
                .map(|(o, e)| (o.as_fd(), e.as_fd())),
            self.egress.as_ref().map(|(l, _)| l.as_fd()),
        )
    }

    /// Starts the session's keeper (a session adopted with its keeper's lifeline only marks
    /// it; one whose warm worker came with a keeper makes that one its own, `keep`, and
    /// starts another only if it does not answer). A keeper that cannot start leaves the
    /// session running without one: it then ends with its daemon, as before adoption existed
    /// (logged).
    pub(super) async fn start_keeper(&mut self) {
        let Some(k) = self.kept.as_ref() else { return };
        let worker = keeper::start_time(self.pid).map(|t| ProcId {
            pid: self.pid,
            start_time: t,
        });
        if let Some(l) = &k.lifeline {
            crate::cgroup::host::protect_keeper(l.pid, l.start_time);
            if let Some(k) = self.kept.as_mut() {
                k.worker = worker;
            }
            return;
        }
        let started = match self.take_warm_keeper().await {
            Some(kept) => Ok(kept),
            None => {
                let Some(k) = self.kept.as_ref() else { return };
                let spec = keeper::Spec {
                    session: self.session.id.clone(),
                    socket: records::keeper_socket(&k.keep.dir, &self.session.id),
                    timeout: k.keep.timeout,
                    session_dir: self.session_dir.clone(),
                    procs: self.group.procs_files(),
                };
                match self.held() {
                    Ok(held) => tokio::task::spawn_blocking(move || keeper::start(&spec, &held))
                        .await
                        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string()))),
                    Err(e) => Err(e),
                }
            }
        };
        match started {
            Ok((life, child)) => {
                crate::cgroup::host::protect_keeper(life.pid, life.start_time);
                tracing::debug!(session = %self.session.id, keeper = life.pid, "keeper started");
                if let Some(k) = self.kept.as_mut() {
                    k.lifeline = Some(life);
                    k.child = Some(child);
                    k.worker = worker;
                }
            }
            Err(e) => {
                tracing::warn!(session = %self.session.id, error = %e, "no keeper: the session will not survive the daemon");
                self.kept = None;
            }
        }
    }

    /// Makes the keeper the session's warm worker came with the session's (`keep`, with the
    /// egress listener): its lifeline and process, or `None` when there is none or it did not
    /// answer (then it is ended, logged).
    async fn take_warm_keeper(&mut self) -> Option<(Lifeline, std::process::Child)> {
        let w = self.kept.as_mut().and_then(|k| k.warm.take())?;
        let egress = match &self.egress {
            Some((l, _)) => l.try_clone().ok(),
            None => None,
        };
        let joined = tokio::task::spawn_blocking(move || {
            let r = w.keep(egress.as_ref().map(|f| f.as_fd()));
            (w, r)
        })
        .await;
        match joined {
            Ok((w, Ok(()))) => {
                let keeper::WarmKeeper {
                    lifeline, child, ..
                } = w;
                Some((lifeline, child))
            }
            Ok((w, Err(e))) => {
                tracing::warn!(session = %self.session.id, error = %e, "the warm worker's keeper did not take the session; starting another");
                let _ = tokio::task::spawn_blocking(move || w.end()).await;
                None
            }
            Err(e) => {
                tracing::warn!(session = %self.session.id, error = %e, "the warm worker's keeper was lost; starting another");
                None
            }
        }
    }

    /// Writes the session's record when a recorded field changed (logged on failure: the
    /// session then may not be adopted).
    pub(super) fn persist(&mut self) {
        let Some(k) = self.kept.as_ref() else { return };
        let (Some(life), Some(worker)) = (&k.lifeline, k.worker) else {
            return;
        };
        let info = self.session.info.lock().unwrap().clone();
        let last_activity_unix_ms = match &k.last {
            Some((r, at)) if *at == info.last_activity => r.last_activity_unix_ms,
            _ => records::unix_ms(SystemTime::now() - info.last_activity.elapsed()),
        };
        let charge = self.permit.as_ref().map(|p| p.charge());
        let s = &self.session;
        let r = Record {
            version: records::VERSION,
            id: s.id.clone(),
            owner_uid: s.owner.uid,
            owner_gid: s.owner.gid,
            language: s.language.as_str().into(),
            environment: k.environment.clone(),
            engine: s.engine.clone(),
            interrupt: interrupt_name(self.interrupt).into(),
            raw_output: self.raw_output,
            limits: (&s.limits).into(),
            detached_idle_seconds: s.detached_idle.map(|d| d.as_secs()),
            started_unix_ms: records::unix_ms(s.started),
            last_activity_unix_ms,
            charge_guest_memory: charge.map_or(0, |c| c.guest_memory),
            charge_worker_memory: charge.map_or(0, |c| c.worker_memory),
            next_cell: self.next_cell,
            cells_run: info.cells_run,
            host_calls_made: self.host_calls_made,
            tokens: info.tokens.clone(),
            running_cell: info.running_cell,
            running: self.running.clone(),
            pending: self.pending,
            egress_hosts: self.egress.as_ref().map(|(_, h)| h.clone()),
            egress_counts: self
                .egress
                .as_ref()
                .and_then(|_| crate::egress::counts(&s.id)),
            keeper: ProcId {
                pid: life.pid,
                start_time: life.start_time,
            },
            worker,
            worker_uid: self.uid.as_ref().map(|u| u.uid()),
            cgroup_procs: self.group.procs_files(),
            session_dir: self.session_dir.clone(),
        };
        if k.last.as_ref().is_some_and(|(old, _)| *old == r) {
            return;
        }
        if let Err(e) = records::write(&k.keep.dir, &r) {
            tracing::warn!(session = %s.id, error = %e, "writing the session record");
        }
        if let Some(k) = self.kept.as_mut() {
            k.last = Some((r, info.last_activity));
        }
    }

    /// The session ends: the keeper is told (it exits without waiting for an adopter) and
    /// the record removed.
    pub(super) fn end_keeper(&mut self) {
        let Some(k) = self.kept.as_ref() else { return };
        if let Some(l) = &k.lifeline {
            l.end();
            crate::cgroup::host::unprotect_keeper(l.pid);
        }
        records::remove(&k.keep.dir, &self.session.id);
    }

    /// Reaps the keeper this daemon started (it exited on `end`, or the cgroup's kill took it).
    pub(super) async fn reap_keeper(&mut self) {
        let Some(mut child) = self.kept.as_mut().and_then(|k| k.child.take()) else {
            return;
        };
        let _ = tokio::time::timeout(
            crate::cgroup::KILL_TIMEOUT,
            tokio::task::spawn_blocking(move || child.wait()),
        )
        .await;
    }
}

/// A previous daemon's session whose keeper answered and whose record matches the live
/// processes: ready for [`Session::adopt`].
#[derive(Debug)]
pub struct Adoptable {
    /// The record.
    pub record: Record,
    lifeline: Lifeline,
    held: Held,
}

/// Why a recorded session is not adopted.
#[derive(Debug)]
pub enum NotAdopted {
    /// Its keeper is gone (or the session cannot be continued): `daemon_restarted`.
    Gone(String),
    /// The record does not match the live processes: `adoption_refused`. Nothing named by
    /// the record was signalled.
    Refused(String),
}

impl Adoptable {
    /// Tells the keeper to exit (the session is not adopted after all).
    pub fn end(&self) {
        self.lifeline.end();
    }
}

/// Connects to the keeper of record `r` (in `dir`) and checks what it hands over: the peer is
/// the recorded keeper (pid and start time), the pidfd names the recorded worker (pid and
/// start time), and the worker is in the recorded cgroup. A session whose record shows a
/// running cell is not adopted (its keeper is told to end).
///
/// Errors: [`NotAdopted`].
pub fn connect(dir: &Path, mut r: Record) -> Result<Adoptable, NotAdopted> {
    let sock = records::keeper_socket(dir, &r.id);
    let (lifeline, held) = keeper::adopt(&sock).map_err(|e| {
        NotAdopted::Gone(format!(
            "its keeper does not answer on {}: {e}",
            sock.display()
        ))
    })?;
    let refuse = |why: String| {
        lifeline.end();
        NotAdopted::Refused(why)
    };
    if lifeline.pid != r.keeper.pid || lifeline.start_time != r.keeper.start_time {
        return Err(refuse(format!(
            "the keeper is pid {} started at {}, the record names pid {} started at {}",
            lifeline.pid, lifeline.start_time, r.keeper.pid, r.keeper.start_time
        )));
    }
    let wpid = keeper::pidfd_pid(held.pidfd.as_fd());
    if wpid != Some(r.worker.pid) {
        return Err(refuse(format!(
            "the keeper's worker is pid {wpid:?}, the record names pid {}",
            r.worker.pid
        )));
    }
    let started = keeper::start_time(r.worker.pid);
    // The pidfd still names a live process after the read: the start time read was its own.
    if crate::cgroup::host::pidfd_exited(&held.pidfd) {
        lifeline.end();
        return Err(NotAdopted::Gone("the worker exited".into()));
    }
    if started != Some(r.worker.start_time) {
        return Err(refuse(format!(
            "the worker started at {started:?}, the record says {}",
            r.worker.start_time
        )));
    }
    if !r.cgroup_procs.is_empty()
        && !crate::cgroup::host::listed_pids(&r.cgroup_procs).contains(&r.worker.pid)
    {
        return Err(refuse("the worker is not in its recorded cgroup".into()));
    }
    if let Some(cell) = r.running_cell
        && (r.running.as_ref().is_some_and(|c| c.one_shot)
            || r.running.is_none() && r.pending.is_some_and(|p| p.one_shot))
    {
        lifeline.end();
        return Err(NotAdopted::Gone(format!(
            "cell {cell} of a one-shot Run was running when the daemon went away; its caller's \
             connection went with it"
        )));
    }
    if let Some(c) = r.running.as_mut().filter(|c| c.unconfirmed) {
        if request_arrived(&held, records::UNCONFIRMED_WAIT) {
            c.unconfirmed = false;
        } else {
            tracing::info!(session = %r.id, cell = c.cell, "the request of the cell never reached the worker (its pipes are empty and no `started` came)");
            r.pending = Some(records::PendingCell {
                stage: records::PendingStage::BeforeRequest,
                one_shot: c.one_shot,
            });
            r.running = None;
            // Made for the cell just before its request: nothing of it is in them.
            super::spool::remove(dir, &r.id);
            let _ = std::fs::remove_file(records::journal_path(dir, &r.id));
            let _ = std::fs::remove_file(records::before_path(dir, &r.id));
        }
    }
    // A cell whose request never reached the worker, or that ended with the session going
    // on, leaves the worker waiting for a request: the session is adopted idle.
    let idle = r.running.is_none()
        && r.pending.is_some_and(|p| {
            matches!(
                p.stage,
                records::PendingStage::BeforeRequest | records::PendingStage::Ended
            )
        });
    if let Some(cell) = r.running_cell
        && !idle
        && r.running.as_ref().is_none_or(|c| c.cell != cell)
        && ended_cell(dir, &r.id).is_none_or(|e| e.cell != cell)
    {
        lifeline.end();
        return Err(NotAdopted::Gone(format!(
            "the request of cell {cell} was being written to the worker when the daemon went \
             away: the worker may hold part of it"
        )));
    }
    if let (true, Some(cell), Some(p)) = (idle, r.running_cell, r.pending) {
        tracing::info!(session = %r.id, cell, stage = ?p.stage, "the cell was not with the worker when the daemon went away: the session is adopted idle");
    }
    Ok(Adoptable {
        record: r,
        lifeline,
        held,
    })
}

/// Whether the request written in one write(2) just before the predecessor died (a record
/// [`records::RunningCell::unconfirmed`]) reached the worker: its bytes are still in the
/// request pipe (`FIONREAD`, pipe(7)), or the reply pipe becomes readable within `wait` (the
/// worker's `started` line, or its end). Neither: the write never happened, since the pipe
/// takes a write that fits whole or not at all.
fn request_arrived(held: &Held, wait: Duration) -> bool {
    if crate::sys::pipe_unread(held.requests.as_fd()).is_ok_and(|n| n > 0) {
        return true;
    }
    crate::sys::readable_within(held.replies.as_fd(), wait)
}

/// Whether the empty pipe of `requests` takes `len` bytes in one write(2): nothing unread in
/// it and a capacity of at least `len` (pipe(7)).
fn pipe_takes_whole(requests: &pipe::Sender, len: usize) -> bool {
    let fd = requests.as_fd();
    crate::sys::pipe_unread(fd).is_ok_and(|n| n == 0)
        && crate::sys::pipe_capacity(fd).is_ok_and(|c| c >= len)
}

/// How this daemon reaches an adopted session's directory `path`, whose file system the
/// keeper's descriptor `dir` holds: `None` when `path` shows that very directory here (the
/// predecessor ran in this mount namespace), else `Some(dir)`, to be reached through
/// [`view_path`].
///
/// Under its unit a daemon has a private mount namespace (`PrivateMounts=yes`, systemd.exec(5))
/// and each start gets a new one: the session's tmpfs was mounted in the predecessor's, where
/// only its keepers (and the worker's own namespace) keep it, and `path` here is the empty
/// directory beneath. It cannot be bound here either: `mount(MS_BIND)` and
/// `open_tree(OPEN_TREE_CLONE)` of a mount outside the caller's namespace answer `EINVAL`
/// (fs/namespace.c, `check_mnt`), and joining the predecessor's namespace with setns(2)
/// needs `CAP_SYS_CHROOT` and a single-threaded caller. A path through the descriptor needs
/// neither: the kernel follows `/proc/self/fd/N` to the directory itself, in whatever mount
/// it is (proc(5)).
///
/// Errors: `path` or `dir` cannot be read, or `dir` is not a directory.
pub(crate) fn view(path: &Path, dir: OwnedFd) -> std::io::Result<Option<OwnedFd>> {
    use std::os::unix::fs::MetadataExt;
    let held = std::fs::File::from(dir.try_clone()?).metadata()?;
    if !held.is_dir() {
        return Err(std::io::Error::other(
            "the keeper's session directory descriptor is not a directory",
        ));
    }
    match std::fs::symlink_metadata(path) {
        Ok(there) if there.dev() == held.dev() && there.ino() == held.ino() => Ok(None),
        Ok(_) => Ok(Some(dir)),
        Err(e) => Err(std::io::Error::new(
            e.kind(),
            format!("{}: {e}", path.display()),
        )),
    }
}

/// The path through which this process reaches the directory `dir` is open on, in any mount
/// namespace: `/proc/self/fd/<dir>/.` (the trailing `.` makes `dir` an inner component, so
/// `O_NOFOLLOW` and `RESOLVE_BENEATH` opens of the path itself work). Valid while `dir` is
/// open: the session holds it for its whole life.
pub(crate) fn view_path(dir: &OwnedFd) -> PathBuf {
    PathBuf::from(format!(
        "/proc/self/fd/{}/.",
        std::os::fd::AsRawFd::as_raw_fd(dir)
    ))
}

/// What [`Session::adopt`] needs besides the keeper's descriptors.
pub struct AdoptWith {
    /// The owner.
    pub owner: Caller,
    /// The session's group (existing).
    pub group: Arc<dyn SessionGroup>,
    /// The worker's uid, leased again.
    pub uid: Option<UidLease>,
    /// The admission charge, taken again.
    pub permit: Permit,
    /// Idle bound of a session that was not detached.
    pub adopted_idle: Option<Duration>,
    /// Runs once everything is released.
    pub on_end: OnEnd,
    /// Session events.
    pub events: tokio::sync::broadcast::Sender<Event>,
    /// How it is kept from now on.
    pub keep: Keep,
    /// The egress grant to give the adopted worker's listener again (its hosts within the
    /// environment's allowlist in force now), when its record names one.
    pub egress: Option<crate::config::EgressConfig>,
}

impl Session {
    /// A session around the adopted worker of `a`: its actor reads the same pipes, signals
    /// through the same pidfd, and keeps the session's id, owner, limits, cell counter and
    /// idle clock. The keeper's connection is the session's lifeline from now on.
    ///
    /// Errors: the descriptors cannot be registered, or the session directory cannot be
    /// reached ([`view`]).
    pub fn adopt(a: Adoptable, w: AdoptWith) -> std::io::Result<Arc<Session>> {
        let Adoptable {
            record: r,
            lifeline,
            held,
        } = a;
        let dir_view = view(&r.session_dir, held.dir)?;
        let language = Language::parse(&r.language)
            .ok_or_else(|| std::io::Error::other(format!("language {:?}", r.language)))?;
        let interrupt = interrupt_of(&r.interrupt)
            .ok_or_else(|| std::io::Error::other(format!("interrupt {:?}", r.interrupt)))?;
        let pidfd = crate::worker::WorkerPidfd::from_owned(held.pidfd);
        let child = crate::worker::process::WorkerProcess::adopted(r.worker.pid, &pidfd)?;
        // The egress grant ended with the predecessor's control connection: given again,
        // and a duplicate of the listener kept for the next successor.
        let egress = match (held.egress, &w.egress) {
            (Some(listener), Some(policy)) => {
                let kept = listener.try_clone().ok();
                let (id, pid, policy) = (r.id.clone(), r.worker.pid, policy.clone());
                let hosts = policy.hosts.clone();
                // The counters file is rewritten at each read, the record at each cell's start
                // and end: the larger of the two, counter by counter.
                let keep_dir = w.keep.dir.clone();
                let used = r
                    .egress_counts
                    .unwrap_or_default()
                    .max(crate::records::read_egress(&keep_dir, &r.id).unwrap_or_default());
                tokio::spawn(async move {
                    crate::egress::open(&id, pid, listener, &policy, used, Some(keep_dir)).await;
                });
                kept.map(|l| (l, hosts))
            }
            (Some(listener), None) => {
                // No grant any more (the environment no longer allows the session's hosts):
                // the keeper still holds the listener, so shut it for every holder; a
                // connect is then refused at once instead of waiting in a backlog nobody
                // serves (shutdown(2) of a listening TCP socket stops it listening, Linux
                // net/ipv4/af_inet.c `inet_shutdown`).
                let shut = nix::sys::socket::shutdown(
                    std::os::fd::AsRawFd::as_raw_fd(&listener),
                    nix::sys::socket::Shutdown::Both,
                );
                tracing::info!(session = %r.id, shut = shut.is_ok(), "the adopted session's egress is not granted again: its connections are refused");
                None
            }
            (None, _) => None,
        };
        let (stdout, stderr) = match held.raw {
            Some((o, e)) => (
                Some(pipe::Receiver::from_owned_fd(o)?),
                Some(pipe::Receiver::from_owned_fd(e)?),
            ),
            None => (None, None),
        };
        // A retained cell that ended before the predecessor went away (its result in the
        // journal, perhaps not yet delivered): answered as ended, never continued.
        let ended = ended_cell(&w.keep.dir, &r.id).filter(|e| {
            r.running.as_ref().is_none_or(|c| c.cell == e.cell)
                && r.running_cell.is_none_or(|c| c == e.cell)
        });
        let running = r
            .running
            .clone()
            .filter(|_| r.running_cell.is_some() && ended.is_none());
        // A cell whose request never reached the worker: its `started` frame may have reached
        // its client (it goes out before the request is written) and the client follows it.
        let never_ran = r.running_cell.filter(|_| {
            ended.is_none()
                && r.running.is_none()
                && r.pending
                    .is_some_and(|p| p.stage == records::PendingStage::BeforeRequest && !p.one_shot)
        });
        if ended.is_some() {
            super::spool::remove(&w.keep.dir, &r.id);
        }
        let (mut resume, relay) = match running {
            Some(running) => {
                let (resume, relay) = Resume::new(&w.keep.dir, &r.id, running);
                (Some(resume), relay)
            }
            None => (None, None),
        };
        // The reply bytes a predecessor that exited keeping its sessions had read and not
        // handled: read first, so the stream goes on exactly where it was.
        let mut rest = match super::journal::take_rest(&records::rest_path(&w.keep.dir, &r.id)) {
            Ok(rest) => rest.filter(|_| resume.is_some()),
            Err(e) => {
                tracing::warn!(session = %r.id, error = %e, "the reply bytes handed over cannot be read: the stream is resynchronised");
                None
            }
        };
        if let (Some(res), Some(_)) = (resume.as_mut(), rest.as_ref()) {
            res.exact = true;
        }
        // A spooled cell: every stream goes on at the offset its journal handled, whatever
        // way the predecessor ended (the spool holds what it had read and not journaled).
        if let Some(res) = resume.as_mut() {
            if let Some(at) = res.restored.as_ref().and_then(|j| j.spool) {
                match super::spool::Spool::resume(&w.keep.dir, &r.id, at) {
                    Ok((sp, [out, err, replies])) => {
                        rest = Some(replies);
                        res.exact = true;
                        res.spool = Some((sp, [out, err]));
                    }
                    Err(e) => {
                        tracing::warn!(session = %r.id, error = %e, "the running cell's spool cannot be read: its stream is resynchronised");
                        res.notes.push(format!(
                            "the output the previous daemon had read and not yet retained could not be read back ({e})"
                        ));
                        super::spool::remove(&w.keep.dir, &r.id);
                    }
                }
            } else {
                super::spool::remove(&w.keep.dir, &r.id);
            }
        }
        let now = SystemTime::now();
        let last = std::time::UNIX_EPOCH + Duration::from_millis(r.last_activity_unix_ms);
        let idle_for = now.duration_since(last).unwrap_or_default();
        let last_activity = Instant::now()
            .checked_sub(idle_for)
            .unwrap_or_else(Instant::now);
        let session = Self::launch(Launch {
            id: r.id.clone(),
            language,
            engine: r.engine.clone(),
            environment: r.environment.clone(),
            owner: w.owner,
            detached_idle: r.detached_idle_seconds.map(Duration::from_secs),
            adopted_idle: w.adopted_idle,
            limits: (&r.limits).into(),
            on_end: w.on_end,
            events: w.events,
            child,
            pid: r.worker.pid,
            pidfd: Some(pidfd),
            requests: pipe::Sender::from_owned_fd(held.requests)?,
            replies: LineReader::with_buffered(
                pipe::Receiver::from_owned_fd(held.replies)?,
                rest.unwrap_or_default(),
            ),
            stdout,
            stderr,
            group: w.group,
            session_dir: r.session_dir.clone(),
            uid: w.uid,
            permit: w.permit,
            interrupt,
            raw_output: r.raw_output,
            next_cell: r.next_cell,
            cells_run: r.cells_run,
            tokens: recorded_tokens(&r.tokens, never_ran),
            host_calls_made: r.host_calls_made,
            last_activity,
            started: std::time::UNIX_EPOCH + Duration::from_millis(r.started_unix_ms),
            keep: Some(w.keep),
            lifeline: Some(lifeline),
            warm: None,
            dir_view,
            resume,
            egress,
        });
        if let Some(e) = ended {
            // Its record holds the result (and what the journal retained of its output, as an
            // `Attach` replays it) before the first client is served.
            match session.cells.reserve() {
                Ok(charge) => {
                    crate::cells::ended(&session, e.cell, e.streams, e.result, charge);
                    tracing::info!(session = %session.id, cell = e.cell, "the cell that ended before the restart is answered from its journal");
                }
                Err(err) => {
                    tracing::warn!(session = %session.id, cell = e.cell, in_use = err.in_use, "no room to retain the ended cell's output and result");
                }
            }
        }
        if let Some(cell) = never_ran {
            // Answered as `cancelled` with nothing run, so that an `Attach` or `CellStatus` of
            // its client gets a definite answer instead of `NoSuchCell`. The record's next
            // cell number is past it already.
            match session.cells.reserve() {
                Ok(charge) => crate::cells::ended(
                    &session,
                    cell,
                    Default::default(),
                    never_ran_result(cell),
                    charge,
                ),
                Err(err) => {
                    tracing::warn!(session = %session.id, cell, in_use = err.in_use, "no room to retain the result of the cell that never ran");
                }
            }
        }
        if let Some((cell, rx, streams)) = relay {
            // Joins the session's log before the session is listed, so an `Attach` or
            // `CellStatus` finds it. No room in the daemon-wide retention budget (a fresh
            // daemon has it all): the frames' channel closes, and the cell is continued as
            // one whose client went away (interrupted, the session kept).
            match session.cells.reserve() {
                Ok(charge) => crate::cells::resume(session.clone(), rx, cell, streams, charge),
                Err(e) => {
                    tracing::warn!(session = %session.id, cell, in_use = e.in_use, "no room to retain the continued cell's output: it is interrupted");
                }
            }
        }
        Ok(session)
    }
}

/// The result a session's last retained cell left in its journal (`journal.rs`), when the
/// cell ended before its daemon went away, with what the journal retained of its output.
pub(super) fn ended_cell(dir: &Path, id: &str) -> Option<EndedCell> {
    let path = records::journal_path(dir, id);
    if !path.exists() {
        return None;
    }
    let j = super::journal::read(&path).ok()?;
    let result = j.result.clone()?;
    Some(EndedCell {
        cell: result.cell,
        streams: j.retention(),
        result,
    })
}

/// The result a successor gives cell `cell`, whose request never reached the worker when
/// its predecessor went away: `cancelled` (the call that started it was cut), no usage and
/// no output, the variables kept (the worker never saw the cell), and a warning saying so.
/// The tokens a successor keeps from a record: well-formed ones of cells other than
/// `never_ran` (a repeat of that call runs its code: it never reached the worker), the
/// newest [`sandcell_proto::kernel::CELL_TOKENS_KEPT`], each token once.
fn recorded_tokens(recorded: &[(u64, String)], never_ran: Option<u64>) -> Vec<(u64, String)> {
    let mut tokens = Vec::new();
    for (cell, token) in recorded {
        if Some(*cell) != never_ran && sandcell_proto::kernel::check_cell_token(token).is_ok() {
            super::actor::remember_token(&mut tokens, *cell, token.clone());
        }
    }
    tokens
}

#[cfg(test)]
pub(super) fn recorded_tokens_for_test(
    recorded: &[(u64, String)],
    never_ran: Option<u64>,
) -> Vec<(u64, String)> {
    recorded_tokens(recorded, never_ran)
}

fn never_ran_result(cell: u64) -> sandcell_proto::kernel::CellResult {
    use sandcell_proto::kernel::{CellResult, State, Status};
    CellResult {
        cell,
        status: Status::Cancelled,
        error: None,
        exit_code: None,
        usage: Default::default(),
        stdout: Default::default(),
        stderr: Default::default(),
        state: State::Kept,
        session_ended: false,
        warnings: vec![
            "the daemon went away before this cell's code reached the worker: none of it ran, \
             and the session's variables are as they were"
                .into(),
        ],
        files: Vec::new(),
        displays: None,
        retained: None,
    }
}

/// A retained cell that had ended when its daemon went away ([`ended_cell`]).
pub(super) struct EndedCell {
    pub(super) cell: u64,
    pub(super) result: sandcell_proto::kernel::CellResult,
    pub(super) streams: [crate::cells::Kept; 2],
}

/// A cell a predecessor daemon was running, as its successor continues it
/// ([`Actor::resume_cell`]).
pub(super) struct Resume {
    /// What the record says of it.
    pub(super) running: records::RunningCell,
    /// Where its frames go: the relay (`cells::resume`) of a retained cell; a closed channel
    /// otherwise (its `Execute` went with the predecessor's connection).
    frames: mpsc::Sender<Frame>,
    /// Its journal, read (a retained cell).
    restored: Option<super::journal::Restored>,
    /// Warnings for its result.
    notes: Vec<String>,
    /// The predecessor handed the reply stream over (it exited keeping its sessions): the
    /// reader starts exactly where its reader was, and needs no resynchronisation.
    exact: bool,
    /// The listing of the session directory before the cell, when the predecessor kept it.
    before: Option<crate::files::Listing>,
    /// Its spool, continued (`spool.rs`), and the raw stdout and stderr bytes the
    /// predecessor had taken and not journaled (read again first).
    spool: Option<(super::spool::Spool, [Vec<u8>; 2])>,
}

/// What the relay of a continued cell starts from: (cell, the actor's frames, the retained
/// output).
type RelayStart = (u64, mpsc::Receiver<Frame>, [crate::cells::Kept; 2]);

impl Resume {
    /// The continuation of `running` of session `id`, reading its journal in `dir`.
    fn new(dir: &Path, id: &str, running: records::RunningCell) -> (Resume, Option<RelayStart>) {
        let mut notes = vec![format!(
            "the daemon restarted while this cell ran; the cell went on in the same worker{}",
            if running.retained {
                " and its output was retained across the restart"
            } else {
                ", but the call that started it was cut: it was interrupted"
            }
        )];
        let (tx, rx) = mpsc::channel(crate::core::FRAME_QUEUE);
        let before = match super::journal::read_before(&records::before_path(dir, id)) {
            Ok(l) => Some(l),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(session = %id, cell = running.cell, error = %e, "the listing before the running cell cannot be read");
                }
                notes.push(
                    "the files this cell changed are not listed: the listing before it did not survive the restart"
                        .into(),
                );
                None
            }
        };
        if !running.retained {
            drop(rx);
            return (
                Resume {
                    running,
                    frames: tx,
                    restored: None,
                    notes,
                    exact: false,
                    before,
                    spool: None,
                },
                None,
            );
        }
        let restored = match super::journal::read(&records::journal_path(dir, id)) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(session = %id, cell = running.cell, error = %e, "the running cell's journal cannot be read: its output before the restart is not retained");
                notes.push(format!(
                    "the output retained before the daemon restarted could not be read ({e}); only what followed is retained"
                ));
                Default::default()
            }
        };
        if let Some(c) = restored.counts.as_ref().filter(|c| c.unsent > 0) {
            notes.push(format!(
                "{} bytes of output the previous daemon had read but not yet retained were lost with it",
                c.unsent
            ));
        }
        let streams = restored.retention();
        let cell = running.cell;
        (
            Resume {
                running,
                frames: tx,
                restored: Some(restored),
                notes,
                exact: false,
                before,
                spool: None,
            },
            Some((cell, rx, streams)),
        )
    }
}

fn phase_name(p: super::Phase) -> &'static str {
    match p {
        super::Phase::Running => "running",
        super::Phase::Interrupted => "interrupted",
        super::Phase::TimedOut => "timed_out",
    }
}

impl Actor {
    /// Writes cell `run`'s `request` to the worker, keeping the record a successor reads to
    /// tell where the request was if this daemon dies meanwhile.
    ///
    /// A kept session whose request fits the request pipe's free capacity (the pipe is empty
    /// between cells; 64 KiB by default, pipe(7)) gets one non-blocking write(2), which
    /// Linux does not split when the request fits (fs/pipe.c): the record says the cell runs,
    /// [`records::RunningCell::unconfirmed`], before the write, and a successor asks the
    /// pipes whether it arrived. A larger request is written in parts, under a record
    /// that says so ([`records::PendingStage::WritingRequest`]): a successor cannot tell how
    /// much the worker holds, and ends the session. `wait` bounds the whole write.
    ///
    /// Errors: the write failed or took longer than `wait` (the worker is gone or stuck).
    pub(super) async fn write_request(
        &mut self,
        run: &mut CellRun,
        request: &[u8],
        retained: bool,
        before: Option<&crate::files::Listing>,
        wait: Duration,
    ) -> std::io::Result<()> {
        let mut from = 0;
        if self.kept.is_some() && pipe_takes_whole(&self.requests, request.len()) {
            self.keep_running_cell(run, retained, before, true);
            kill_seam("request_recorded", run.cell);
            match nix::unistd::write(&self.requests, request) {
                Ok(n) if n == request.len() => {
                    kill_seam("request_written", run.cell);
                    if let Some(c) = self.running.as_mut() {
                        c.unconfirmed = false;
                    }
                    self.persist();
                    return Ok(());
                }
                Ok(n) => from = n,
                Err(nix::errno::Errno::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            }
            // Not written whole after all: the record must not offer the cell.
            self.running = None;
        }
        self.pending = Some(records::PendingCell {
            stage: records::PendingStage::WritingRequest,
            one_shot: !run.keep_session,
        });
        self.persist();
        tokio::time::timeout(wait, self.requests.write_all(&request[from..]))
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))?;
        self.keep_running_cell(run, retained, before, false);
        Ok(())
    }

    /// The cell's request reaches the worker (`unconfirmed`: is about to, in one write): from
    /// now on its record says how a successor continues it, a retained cell's output is
    /// journaled (`journal.rs`), and the listing of the session directory before the cell
    /// (`before`) is kept beside the record (`records::before_path`), so a successor lists
    /// the files the cell changed.
    pub(super) fn keep_running_cell(
        &mut self,
        run: &mut CellRun,
        retained: bool,
        before: Option<&crate::files::Listing>,
        unconfirmed: bool,
    ) {
        let Some(k) = self.kept.as_ref() else { return };
        let path = records::before_path(&k.keep.dir, &self.session.id);
        match before.and_then(crate::files::Listing::encode_stamps) {
            Some(bytes) => {
                if let Err(e) = super::journal::write_before(&path, &bytes) {
                    tracing::warn!(session = %self.session.id, error = %e, "writing the listing before the cell: a successor would not list the files it changed");
                }
            }
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
        if !retained {
            // The result an earlier retained cell left is not the latest any more.
            let _ = std::fs::remove_file(records::journal_path(&k.keep.dir, &self.session.id));
        }
        if retained {
            let journal = super::journal::Journal::create(
                records::journal_path(&k.keep.dir, &self.session.id),
                &self.session.id,
            );
            if journal.is_live() {
                match super::spool::Spool::create(
                    &k.keep.dir,
                    &self.session.id,
                    self.replies.unconsumed(),
                ) {
                    Ok(sp) => run.spool = Some(sp),
                    Err(e) => {
                        tracing::warn!(session = %self.session.id, error = %e, "the running cell's spool cannot be made: a successor daemon could lose the output read before its journal batch");
                        super::spool::remove(&k.keep.dir, &self.session.id);
                    }
                }
            }
            run.journal = Some(journal);
            // The first batch: the spool offsets a successor starts from.
            run.seal(self.replies.buffered());
        }
        self.pending = None;
        self.running = Some(records::RunningCell {
            cell: run.cell,
            nonce: run.nonce.clone(),
            started_unix_ms: run.started_unix_ms,
            retained,
            phase: phase_name(run.phase).into(),
            cpu0: run.cpu0,
            host_waiting: None,
            one_shot: !run.keep_session,
            unconfirmed,
        });
        self.persist();
    }

    /// The daemon exits keeping its sessions ([`Command::HandOver`]): the output the cell's
    /// backlog holds goes into its journal as the frames it would have become, the reply
    /// bytes read and not yet handled (a frame's head, or whole frames) into
    /// `records::rest_path`, and the record is current. The successor then continues the
    /// stream exactly: nothing is lost and nothing needs resynchronising. The caller stops
    /// reading the worker's pipes.
    pub(super) fn hand_over_cell(&mut self, run: &mut CellRun) {
        let Some(k) = self.kept.as_ref() else { return };
        if self.running.is_none() {
            return;
        }
        let rest = records::rest_path(&k.keep.dir, &self.session.id);
        if run.spool.is_some() {
            // Everything is in the journal and the spools: the successor continues there.
            run.seal(self.replies.buffered());
            if run.spool.is_some() {
                self.cell_changed(run);
                tracing::info!(session = %self.session.id, cell = run.cell, next_seq = run.seq + run.backlog.sealed as u64, spooled = ?run.spooled_at, "running cell handed over (spooled)");
                return;
            }
        }
        if run.journal.is_some() {
            while let Some(c) = run.backlog.pop() {
                let text = run.chunk_text(&c);
                run.sent_chunk(run.seq, text);
                run.seq += 1;
            }
            run.commit_journal(true);
        }
        let bytes = self.replies.unconsumed();
        let n = bytes.len();
        if n > 0
            && let Err(e) = super::journal::write_rest(&rest, bytes)
        {
            tracing::warn!(session = %self.session.id, error = %e, "handing the reply bytes over: the successor resynchronises the stream");
        }
        self.cell_changed(run);
        tracing::info!(session = %self.session.id, cell = run.cell, reply_bytes = n, "running cell handed over");
    }

    /// The cell's escalation or its waiting host call changed: the record follows.
    pub(super) fn cell_changed(&mut self, run: &CellRun) {
        let Some(r) = self.running.as_mut() else {
            return;
        };
        r.phase = phase_name(run.phase).into();
        r.host_waiting = run.host.map(|h| h.0);
        self.persist();
    }

    /// The cell's result is known (and, for a retained cell, in its journal): its record no
    /// longer offers it to a successor, its spool goes, and its journal goes unless it holds
    /// the result (a successor then answers `CellStatus` and `Attach` for the ended cell).
    pub(super) fn end_running_cell(&mut self, run: &mut CellRun) {
        if self.running.take().is_none() {
            return;
        }
        let kept_result = run.journal.take().is_some_and(|j| j.is_live());
        if let Some(sp) = run.spool.take() {
            sp.remove();
        }
        self.persist();
        if let Some(k) = self.kept.as_ref() {
            if !kept_result {
                let _ = std::fs::remove_file(records::journal_path(&k.keep.dir, &self.session.id));
            }
            let _ = std::fs::remove_file(records::before_path(&k.keep.dir, &self.session.id));
        }
    }

    /// Continues the cell a predecessor daemon was running: the same nonce, the wall time
    /// counted from the cell's start (the restart's time counts), the escalation where it
    /// was, the caps, frame numbers and retained output from the journal. Its first reply
    /// line may be the tail of a frame the predecessor cut (`CellRun::resync`). A host call
    /// that waited is answered with an error: the client that was to answer it is gone. The
    /// files the cell changed are listed against the listing before it that the predecessor
    /// kept (`records::before_path`). Returns as [`Actor::execute_cell`].
    pub(super) async fn resume_cell(
        &mut self,
        r: Resume,
        cmds: &mut mpsc::Receiver<Command>,
    ) -> Option<(Ending, Option<oneshot::Sender<()>>)> {
        let Resume {
            running,
            frames,
            restored,
            notes,
            exact,
            before,
            spool,
        } = r;
        let limits = self.session.limits.clone();
        let mut run = CellRun::new(
            running.cell,
            running.nonce.clone(),
            frames,
            true,
            &limits,
            self.pid,
            self.oom_seen,
        );
        let started = std::time::UNIX_EPOCH + Duration::from_millis(running.started_unix_ms);
        let elapsed = SystemTime::now()
            .duration_since(started)
            .unwrap_or_default();
        let now = tokio::time::Instant::now();
        run.t0 = Instant::now()
            .checked_sub(elapsed)
            .unwrap_or_else(Instant::now);
        run.started_unix_ms = running.started_unix_ms;
        run.cpu0 = running.cpu0;
        if self.raw_output {
            // A native worker may wait for the `displayed` of a bundle the predecessor placed
            // and died before answering; one it did not wait for is skipped.
            run.queue_request(wire::Op::Displayed, &[]);
        }
        let t0 = tokio::time::Instant::from_std(run.t0);
        run.deadline = t0 + limits.wall + super::cell::WALL_SLACK;
        match running.phase.as_str() {
            "interrupted" => {
                run.phase = Phase::Interrupted;
                run.deadline = now + limits.grace;
            }
            "timed_out" => {
                run.phase = Phase::TimedOut;
                run.deadline = (t0 + limits.wall + limits.grace).max(now + KILL_AFTER_SIGINT_MIN);
            }
            _ => {}
        }
        let restored_frames = restored.as_ref().map_or(0, |j| j.outputs.len());
        let next_seq = restored
            .as_ref()
            .and_then(|j| j.counts.as_ref())
            .map(|c| c.next_seq);
        let spooled = restored.as_ref().and_then(|j| j.spool);
        let tail_bytes = spool
            .as_ref()
            .map(|(_, t)| [t[0].len(), t[1].len(), self.replies.buffered()]);
        if let Some(c) = restored.as_ref().and_then(|j| j.counts.clone()) {
            for (i, (cap, seen, kept, pending)) in c.caps.into_iter().enumerate() {
                if let Some(restored) = StreamCap::restore(cap, seen, kept, pending) {
                    run.caps[i] = restored;
                }
            }
            run.seq = c.next_seq;
            if run.displays.is_some() {
                run.displays = c.displays.or(run.displays);
            }
            run.sent = c.sent;
        }
        if let Some(j) = restored.as_ref() {
            run.journal = self.kept.as_ref().map(|k| {
                super::journal::Journal::resume(
                    records::journal_path(&k.keep.dir, &self.session.id),
                    &self.session.id,
                    j,
                )
            });
        }
        run.resync = !exact;
        if let Some((sp, tails)) = spool {
            // What the predecessor had taken from the raw pipes and not journaled: through
            // the caps again, then sealed with the new offsets before anything is sent.
            for (i, (tail, stream)) in tails
                .iter()
                .zip([Stream::Stdout, Stream::Stderr])
                .enumerate()
            {
                if let Some(t) = run.caps[i].push_bytes(tail) {
                    run.queue(stream, t);
                }
            }
            if run.journal.as_ref().is_some_and(|j| j.is_live()) {
                run.spool = Some(sp);
                run.seal(self.replies.buffered());
            } else {
                sp.remove();
            }
        }
        if let Some(call) = running.host_waiting {
            let payload = serde_json::to_vec(&serde_json::json!({
                "error": format!("host call {call} was not answered: the daemon restarted while it waited")
            }))
            .unwrap_or_default();
            self.answer_host_call(&mut run, call, &payload);
        }
        run.notes = notes;
        self.running = Some(running);
        tracing::info!(session = %self.session.id, cell = run.cell, elapsed_ms = elapsed.as_millis() as u64, retained = run.journal.is_some(), frames = restored_frames, next_seq, spooled = ?spooled, tails = ?tail_bytes, "continuing the cell the previous daemon was running");
        run.disk_scan = self.disk_scan.take();
        let end = self.cell_loop(&mut run, cmds).await;
        self.disk_scan = run.disk_scan.take();
        self.finish_cell(run, end, false, None, before, cmds).await
    }
}

/// A test seam: with `SANDCELL_TEST_KILL_AT=<point>:<n>` in its environment the daemon kills
/// itself with SIGKILL when cell number `n` of a session reaches `point`: `before_request`
/// (its record says no byte of its request was written yet), `request_recorded` (its record
/// offers the cell as running, `unconfirmed`, and its request is not written),
/// `request_written` (the same record, the request written whole) or `cell_ended` (its
/// record no longer offers it to a successor, and its result is not sent yet). Only the
/// integration tests set it.
pub(super) fn kill_seam(point: &str, cell: u64) {
    use std::sync::OnceLock;
    static AT: OnceLock<Option<(String, u64)>> = OnceLock::new();
    let Some((at, n)) = AT.get_or_init(|| {
        let v = std::env::var("SANDCELL_TEST_KILL_AT").ok()?;
        let (p, n) = v.split_once(':')?;
        Some((p.to_owned(), n.parse().ok()?))
    }) else {
        return;
    };
    if at == point && *n == cell {
        tracing::warn!(point, cell, "SANDCELL_TEST_KILL_AT: killing the daemon");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}
