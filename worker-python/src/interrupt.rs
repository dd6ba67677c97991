//! SIGINT: how the daemon stops the running cell (proto `worker.rs`: interrupts are signals).
//!
//! A `sigaction` handler (async-signal-safe: one `write(2)`) turns each SIGINT into a byte on a
//! self-pipe; a watcher thread reads the pipe and stops the cell through its [`Target`]. The
//! handler works whichever thread the kernel delivers to (the daemon may direct the signal at
//! the main thread with tgkill), and nothing in the handler touches locks.
//!
//! Stopping a guest takes two moves, because Eryx 0.10 sessions have no cancellation of their
//! own (a CPU-bound guest blocks its thread; dropping the handle does not
//! cancel):
//! - the engine's epoch is advanced past the cell's deadline, so a guest running WebAssembly
//!   traps at its next epoch check (a `while True: pass` ends within milliseconds);
//! - the cell's [`CancellationToken`] is cancelled, which the cell loop races against the
//!   execution, so a guest parked in a host call (`time.sleep`) is dropped at once.
//!
//! A guest waiting in `sandcell.host.call` is not stopped that way: the first SIGINT goes to
//! the waiting call ([`Target::host_call`], [`crate::host`]), which returns, and the guest
//! raises `KeyboardInterrupt` with its instance kept; the SIGINTs the daemon repeats (every
//! 250 ms) leave it [`HOST_CALL_UNWIND`] to end its cell that way, and one after that stops
//! the guest as above.
//!
//! A SIGINT that arrives while no request is served is ignored, and so is one that arrived
//! before the current request was taken up: [`Interrupter::begin_cell`] starts a new
//! generation and drains the self-pipe, and the watcher counts a SIGINT only for the
//! generation it read it in. A SIGINT the daemon sent to end the previous cell therefore never
//! stops the next one, however late the watcher thread runs. An interrupt meant for the new
//! cell that lands before the worker took up its request is discarded with them; the daemon
//! repeats SIGINT every 250 ms until an interrupted cell ends, so the next one stops it. A
//! SIGINT after the request was taken up but before the guest started stops the guest as soon
//! as it is armed.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use eryx::CancellationToken;

/// Write end of the self-pipe, read by the signal handler (-1 before [`install`]).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_sigint(_sig: libc::c_int) {
    let fd = PIPE_WRITE.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    // SAFETY: __errno_location returns this thread's errno slot; reading and restoring it is
    // async-signal-safe, and write(2) on a non-blocking pipe is async-signal-safe. A full pipe
    // (EAGAIN) loses only a duplicate wake-up.
    unsafe {
        let errno = libc::__errno_location();
        let saved = *errno;
        let byte = 1u8;
        let _ = libc::write(fd, (&byte as *const u8).cast(), 1);
        *errno = saved;
    }
}

/// What the watcher stops when a SIGINT arrives during a cell.
pub struct Target {
    /// Cancelled on SIGINT; the cell loop races it against the execution.
    pub token: CancellationToken,
    /// Set on SIGINT, so the cell loop can tell an interrupt from its own timeout.
    pub fired: Arc<AtomicBool>,
    /// Makes a guest running WebAssembly trap: advances the engine epoch past the cell's
    /// deadline (see [`Target::epoch_advance`]). Called at most once per cell.
    pub stop_guest: Box<dyn Fn() + Send + Sync>,
    /// Hands the SIGINT to a host call the guest waits in, if one does (returns true then):
    /// the call returns and the guest raises `KeyboardInterrupt`, with its instance kept
    /// ([`crate::host`]). Asked before each stop; a SIGINT no call takes stops the guest.
    pub host_call: Option<Box<dyn Fn() -> bool + Send + Sync>>,
}

impl Target {
    /// A `stop_guest` that increments `executor`'s engine epoch `ticks` times (the cell's
    /// timeout in 10 ms epoch ticks plus margin, so its deadline is certainly passed).
    pub fn epoch_advance(
        executor: Arc<eryx::PythonExecutor>,
        ticks: u64,
    ) -> Box<dyn Fn() + Send + Sync> {
        Box::new(move || {
            let engine = executor.engine();
            for _ in 0..ticks {
                engine.increment_epoch();
            }
        })
    }
}

#[derive(Default)]
struct State {
    /// A request is being served (from its header until its `Done`).
    in_cell: bool,
    /// A SIGINT arrived during this request before a target was armed.
    pending: bool,
    /// Counts requests taken up ([`Interrupter::begin_cell`]); a SIGINT read in an earlier
    /// generation is stale.
    generation: u64,
    target: Option<Target>,
    /// The armed target's guest was stopped (token and epoch): later SIGINTs do nothing more.
    stopped: bool,
    /// When a waiting host call of the armed target took a SIGINT (the guest then raises
    /// `KeyboardInterrupt`).
    host_call_took: Option<std::time::Instant>,
}

/// After a waiting host call took a SIGINT, how long the SIGINTs the daemon repeats (every
/// 250 ms) leave the guest to raise `KeyboardInterrupt` and end its cell, keeping its
/// instance, before one stops the guest (which discards the instance, and with it what the
/// cell assigned). On a loaded machine the guest may need more than one repeat's interval to
/// unwind; a cell that catches the interrupt and runs on is still stopped after this, well
/// within the daemon's default kill grace of 2 s.
const HOST_CALL_UNWIND: std::time::Duration = std::time::Duration::from_secs(1);

/// Shared between the cell loop and the watcher thread.
#[derive(Default)]
pub struct Interrupter {
    state: Mutex<State>,
    /// Read end of the self-pipe (non-blocking), drained when a request is taken up; -1
    /// before [`install`].
    pipe_read: AtomicI32,
}

/// Reads everything `fd` (non-blocking) holds now; returns whether it held anything.
fn drain(fd: i32) -> bool {
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 64];
    let mut any = false;
    loop {
        // SAFETY: reading into a local buffer; `fd` is the self-pipe, never closed.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            any = true;
        } else if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        } else {
            return any;
        }
    }
}

impl Interrupter {
    /// An interrupter with no self-pipe yet ([`install`] gives it one).
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A request is taken up: SIGINTs count from now on. Those already written to the
    /// self-pipe, or read by the watcher in an earlier generation, are stale and dropped.
    pub fn begin_cell(&self) {
        let mut s = self.lock();
        s.generation += 1;
        drain(self.pipe_read.load(Ordering::SeqCst));
        s.in_cell = true;
        s.pending = false;
        s.target = None;
    }

    /// The current generation, for a SIGINT about to be read.
    fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Arms `target` for the running cell; fires at once if a SIGINT already arrived.
    pub fn arm(&self, target: Target) {
        let mut s = self.lock();
        let pending = s.pending;
        s.target = Some(target);
        s.stopped = false;
        s.host_call_took = None;
        if pending {
            Self::fire_locked(&mut s);
        }
    }

    /// The guest call of the armed target has ended: forgets the target and returns once any
    /// SIGINT being handled has finished stopping the guest.
    ///
    /// `stop_guest` advances the engine epoch thousands of times from the watcher thread, and
    /// the cell loop wakes at the first of them (or at the token). Without this wait the
    /// remaining ticks would land on the instance rebuilt next and expire its deadline, and a
    /// SIGINT arriving during that rebuild would do the same. Later SIGINTs of this request
    /// only mark it pending.
    pub fn disarm(&self) {
        let mut s = self.lock();
        s.target = None;
    }

    /// The cell's `Done` is about to be sent: later SIGINTs are ignored.
    pub fn end_cell(&self) {
        let mut s = self.lock();
        s.in_cell = false;
        s.pending = false;
        s.target = None;
    }

    /// Handles one SIGINT arriving now.
    pub fn fire(&self) {
        let g = self.generation();
        self.fire_in(g);
    }

    /// Handles one SIGINT read in `generation`: ignored between requests and when a newer
    /// request has been taken up since.
    fn fire_in(&self, generation: u64) {
        let mut s = self.lock();
        if !s.in_cell || s.generation != generation {
            return;
        }
        if s.target.is_none() {
            s.pending = true;
            return;
        }
        Self::fire_locked(&mut s);
    }

    /// Runs with the state lock held for the whole stop, which is what [`Interrupter::disarm`]
    /// waits on.
    fn fire_locked(s: &mut State) {
        let Some(t) = s.target.as_ref() else { return };
        t.fired.store(true, Ordering::SeqCst);
        if s.stopped
            || s.host_call_took
                .is_some_and(|at| at.elapsed() < HOST_CALL_UNWIND)
        {
            return;
        }
        if t.host_call.as_ref().is_some_and(|take| take()) {
            s.host_call_took = Some(std::time::Instant::now());
            return;
        }
        s.stopped = true;
        t.token.cancel();
        (t.stop_guest)();
    }
}

/// Installs the SIGINT handler and starts the watcher thread feeding `interrupter`.
///
/// Call after confinement (which closes unlisted descriptors) and before other threads start.
///
/// Errors: creating the pipe, installing the handler or spawning the thread failed.
pub fn install(interrupter: Arc<Interrupter>) -> io::Result<()> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned these two descriptors; nothing else owns them.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    for fd in [&read_end, &write_end] {
        // SAFETY: F_SETFL on a descriptor we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    interrupter
        .pipe_read
        .store(read_end.as_raw_fd(), Ordering::SeqCst);
    // The write end lives as long as the process: the handler may run at any time.
    PIPE_WRITE.store(
        std::os::fd::IntoRawFd::into_raw_fd(write_end),
        Ordering::SeqCst,
    );

    // SAFETY: a zeroed sigaction is a valid starting point; the handler is an extern "C" fn
    // that only performs async-signal-safe calls; the masks are initialised by sigemptyset.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
        // An inherited blocked SIGINT would make the worker uninterruptible (a blocked signal stays blocked across execve(2)).
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }

    std::thread::Builder::new()
        .name("sigint-watcher".into())
        .spawn(move || {
            let fd = read_end.as_raw_fd();
            loop {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; waits without a timeout.
                let n = unsafe { libc::poll(&mut p, 1, -1) };
                if n < 0 {
                    if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return;
                }
                if p.revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                    return;
                }
                // The generation is taken before the bytes: a request taken up in between
                // drains them first, or makes them stale.
                let g = interrupter.generation();
                if drain(fd) {
                    interrupter.fire_in(g);
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn target(count: &Arc<AtomicU32>) -> (Target, CancellationToken, Arc<AtomicBool>) {
        let token = CancellationToken::new();
        let fired = Arc::new(AtomicBool::new(false));
        let c = Arc::clone(count);
        let t = Target {
            token: token.clone(),
            fired: Arc::clone(&fired),
            stop_guest: Box::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
            }),
            host_call: None,
        };
        (t, token, fired)
    }

    #[test]
    fn a_waiting_host_call_takes_the_sigint_and_a_later_one_stops_the_guest() {
        let i = Interrupter::default();
        let count = Arc::new(AtomicU32::new(0));
        let waiting = Arc::new(AtomicBool::new(true));
        i.begin_cell();
        let (mut t, token, fired) = target(&count);
        let w = Arc::clone(&waiting);
        t.host_call = Some(Box::new(move || w.swap(false, Ordering::SeqCst)));
        i.arm(t);
        i.fire();
        assert!(
            fired.load(Ordering::SeqCst),
            "the cell knows it was interrupted"
        );
        assert!(!token.is_cancelled(), "the call took it");
        assert_eq!(count.load(Ordering::SeqCst), 0);
        // The daemon's repeats while the guest raises KeyboardInterrupt leave its instance.
        i.fire();
        assert!(!token.is_cancelled(), "a repeat within the unwind time");
        assert_eq!(count.load(Ordering::SeqCst), 0);
        std::thread::sleep(HOST_CALL_UNWIND + std::time::Duration::from_millis(50));
        i.fire();
        i.fire();
        assert!(token.is_cancelled());
        assert_eq!(count.load(Ordering::SeqCst), 1, "stopped once");
    }

    #[test]
    fn sigint_between_cells_is_ignored_without_a_waiting_request() {
        let i = Interrupter::default();
        let count = Arc::new(AtomicU32::new(0));
        i.fire();
        i.begin_cell();
        let (t, token, fired) = target(&count);
        i.arm(t);
        assert!(!token.is_cancelled() && !fired.load(Ordering::SeqCst));
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn sigint_before_arming_fires_on_arm_once() {
        let i = Interrupter::default();
        let count = Arc::new(AtomicU32::new(0));
        i.begin_cell();
        i.fire();
        let (t, token, fired) = target(&count);
        i.arm(t);
        assert!(token.is_cancelled() && fired.load(Ordering::SeqCst));
        i.fire();
        i.fire();
        assert_eq!(
            count.load(Ordering::SeqCst),
            1,
            "the guest is stopped once per cell"
        );
        i.end_cell();
        // The next cell starts clean.
        i.begin_cell();
        let (t, token, _) = target(&count);
        i.arm(t);
        assert!(!token.is_cancelled());
    }

    #[test]
    fn disarm_waits_for_a_stop_in_progress_and_ignores_later_sigints() {
        let i = Arc::new(Interrupter::default());
        let ticks = Arc::new(AtomicU32::new(0));
        let token = CancellationToken::new();
        let fired = Arc::new(AtomicBool::new(false));
        let t = Arc::clone(&ticks);
        i.begin_cell();
        i.arm(Target {
            token: token.clone(),
            fired: Arc::clone(&fired),
            // A slow stop, as under load: the cell loop wakes at the token, long before the
            // last tick.
            stop_guest: Box::new(move || {
                for _ in 0..50 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    t.fetch_add(1, Ordering::SeqCst);
                }
            }),
            host_call: None,
        });
        let watcher = {
            let i = Arc::clone(&i);
            std::thread::spawn(move || i.fire())
        };
        while !token.is_cancelled() {
            std::thread::yield_now();
        }
        i.disarm();
        assert_eq!(ticks.load(Ordering::SeqCst), 50, "disarm returned mid-stop");
        watcher.join().unwrap();
        i.fire();
        assert_eq!(ticks.load(Ordering::SeqCst), 50, "a stop after disarm");
    }

    #[test]
    fn a_sigint_from_an_earlier_request_never_stops_the_next() {
        let i = Interrupter::new();
        let count = Arc::new(AtomicU32::new(0));
        i.begin_cell();
        // Read by the watcher during the first request, handled after the next was taken up.
        let stale = i.generation();
        i.end_cell();
        i.begin_cell();
        i.fire_in(stale);
        let (t, token, fired) = target(&count);
        i.arm(t);
        assert!(!token.is_cancelled() && !fired.load(Ordering::SeqCst));
        // A SIGINT of this request's generation stops it.
        i.fire();
        assert!(token.is_cancelled());
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn sigints_still_in_the_pipe_when_a_request_is_taken_up_are_dropped() {
        let mut fds = [0; 2];
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: a two-int array for pipe2.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), flags) };
        assert_eq!(r, 0);
        // SAFETY: fresh descriptors owned by nothing else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let i = Interrupter::new();
        i.pipe_read.store(r.as_raw_fd(), Ordering::SeqCst);
        // SAFETY: writing one byte from a static to a pipe we own.
        let n = unsafe { libc::write(w.as_raw_fd(), b"i".as_ptr().cast(), 1) };
        assert_eq!(n, 1);
        i.begin_cell();
        assert!(
            !drain(r.as_raw_fd()),
            "begin_cell left the stale byte in the pipe"
        );
    }
}
