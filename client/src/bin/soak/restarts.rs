//! The soak with daemon restarts (`--restart-every S`): every S seconds the daemon is ended,
//! in turn with SIGUSR2 (a planned exit keeping its sessions) and SIGKILL (a crash), and its
//! successor started on the same socket, state and adoption directories (`--daemon-start`, a
//! command that starts one and prints its pid), as the unit's restart does; every third time
//! it re-executes in place instead (SIGUSR1, the package upgrade's path: same process). Meanwhile every client runs cells in one detached Python session: a cell cut by a
//! restart is followed in the successor ([`Client::finish_following`]), a call refused while
//! the daemon is away is tried again, and every result is checked. Every cell is idempotent
//! (`assert v in (previous, this)`, then `v = this`), so one sent again after a cut that hid
//! whether it ran gives the same answer. Lost: a cell without a result; wrong: a result that
//! differs, or a session the restart ended. Leaks are counted after the last restart, once
//! every session is closed.

use super::{Ctx, Rng, splitmix64};
use sandcell_client::{CellTrack, Client, Error, KernelError, Reattach, Status};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a call refused because the daemon is away is tried again, in all.
const AWAY: Duration = Duration::from_secs(60);

/// Cells followed across a restart (their call cut, the cell followed in the successor).
pub static FOLLOWED: AtomicU64 = AtomicU64::new(0);
/// `Execute`s sent again (the daemon was away, the cut hid whether the cell started, or the
/// session was still busy with the cell continued from before the cut).
pub static RESENT: AtomicU64 = AtomicU64::new(0);

/// The daemon being restarted: its pid now (0 while none runs) and how many restarts.
#[derive(Default)]
pub struct Daemon {
    pub pid: AtomicU32,
    pub restarts: AtomicU64,
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// Starts a daemon with `start` (a shell command printing its pid) and waits for `socket`.
fn start(start: &str, socket: &Path) -> anyhow::Result<u32> {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(start)
        .stdin(std::process::Stdio::null())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "the daemon start command failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let t0 = Instant::now();
    while !socket.exists() {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(20),
            "the successor's socket did not appear"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(pid)
}

/// Every `every`, until `stop` is set: ends the daemon (SIGUSR2, SIGKILL), waits for its exit,
/// removes its socket and starts the successor, or (every third time) has it re-execute in
/// place (SIGUSR1). Returns the gaps of the restarts (end signal to the successor's socket),
/// seconds.
pub fn restarter(
    d: Arc<Daemon>,
    every: Duration,
    start_cmd: String,
    socket: PathBuf,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<Vec<f64>> {
    let mut gaps = Vec::new();
    let mut turn = 0u64;
    loop {
        let t = Instant::now();
        while t.elapsed() < every {
            if stop.load(Ordering::SeqCst) {
                return Ok(gaps);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let pid = d.pid.load(Ordering::SeqCst);
        let sig = [libc::SIGUSR2, libc::SIGKILL, libc::SIGUSR1][(turn % 3) as usize];
        turn += 1;
        let t0 = Instant::now();
        if sig == libc::SIGUSR1 {
            // SAFETY: a signal to the daemon this program started (or the script's first one).
            unsafe { libc::kill(pid as libc::pid_t, sig) };
            // The same process goes on (its clients' cut calls follow into the new image): it
            // must still be there, and answer a call on its socket, within 30 s (asked from
            // 0.2 s on, when the old image has long stopped accepting).
            std::thread::sleep(Duration::from_millis(200));
            loop {
                anyhow::ensure!(
                    !gone(pid),
                    "daemon {pid} died on SIGUSR1 (re-exec in place)"
                );
                if answers(&socket) {
                    break;
                }
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "daemon {pid}: no answer 30 s after SIGUSR1"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            anyhow::ensure!(
                !gone(pid),
                "daemon {pid} died after SIGUSR1 (re-exec in place)"
            );
            d.restarts.fetch_add(1, Ordering::SeqCst);
            println!(
                "soak: restart {} (SIGUSR1): daemon {pid} re-executed in place, answering after {:.2} s",
                d.restarts.load(Ordering::SeqCst),
                t0.elapsed().as_secs_f64()
            );
            continue;
        }
        // SAFETY: a signal to the daemon this program started (or the script's first one).
        unsafe { libc::kill(pid as libc::pid_t, sig) };
        while !gone(pid) {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "daemon {pid} did not exit on signal {sig}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        d.pid.store(0, Ordering::SeqCst);
        let _ = std::fs::remove_file(&socket);
        let new = start(&start_cmd, &socket)?;
        d.pid.store(new, Ordering::SeqCst);
        d.restarts.fetch_add(1, Ordering::SeqCst);
        gaps.push(t0.elapsed().as_secs_f64());
        println!(
            "soak: restart {} ({}): daemon {pid} -> {new}, socket back after {:.2} s",
            d.restarts.load(Ordering::SeqCst),
            if sig == libc::SIGKILL {
                "SIGKILL"
            } else {
                "SIGUSR2"
            },
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Whether the daemon on `socket` answers `org.varlink.service.GetInfo` within 30 s with a
/// reply that is not an error.
fn answers(socket: &Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    if s.write_all(b"{\"method\":\"org.varlink.service.GetInfo\"}\0")
        .is_err()
    {
        return false;
    }
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while !reply.contains(&0) && reply.len() < 1 << 20 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
        }
    }
    reply.contains(&0) && !String::from_utf8_lossy(&reply).contains("\"error\"")
}

/// Whether `e` says the daemon is away (connect refused or missing, call cut, `ShuttingDown`):
/// the call is tried again.
fn away(e: &Error) -> bool {
    matches!(
        e,
        Error::Connect { .. } | Error::Kernel(KernelError::ShuttingDown {})
    ) || e.is_call_cut()
}

/// Runs `call` on a connection (a new one after a failure) until it answers something other
/// than "the daemon is away", for at most [`AWAY`].
async fn again<T, F>(ctx: &Ctx, c: &mut Option<Client>, mut call: F) -> Result<T, Error>
where
    F: for<'a> FnMut(
        &'a mut Client,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<T, Error>> + Send + 'a>,
    >,
{
    let t0 = Instant::now();
    let mut delay = Duration::from_millis(50);
    loop {
        if c.is_none() {
            match Client::connect(&ctx.socket).await {
                Ok(conn) => *c = Some(conn),
                Err(e) if away(&e) && t0.elapsed() < AWAY => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        let r = call(c.as_mut().expect("connected just above")).await;
        match r {
            Err(e) if away(&e) && t0.elapsed() < AWAY => {
                *c = None;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// One client of the restart soak: a detached Python session, then `cells` cells in it.
pub async fn client_task(ctx: Ctx, id: usize, cells: usize, seed: u64) {
    let mut rng = Rng(splitmix64(splitmix64(seed) ^ id as u64) | 1);
    let mut c: Option<Client> = None;
    let opened = again(&ctx, &mut c, |c| {
        Box::pin(async move { c.open("python", None, Some(120)).await })
    })
    .await;
    let session = match opened {
        Ok(r) => r.session,
        Err(e) => {
            ctx.stats.lost(format!("client {id} open: {e}"));
            return;
        }
    };
    let mut prev: u64 = 0;
    let first = format!("v = {prev}");
    if let Err(e) = run_cell(&ctx, &mut c, &session, &first, "").await {
        ctx.stats.lost(format!("client {id} first cell: {e}"));
        return;
    }
    let mut done = 0;
    while done < cells && !super::past(&ctx) {
        let n = (id as u64) * 1_000_000 + done as u64 + 1;
        let (kind, body, want) = match rng.below(3) {
            0 => ("state", String::new(), format!("v {n}\n")),
            1 => {
                let k = 2 + rng.below(6);
                let want: String =
                    (0..k).map(|i| format!("{i}\n")).collect::<String>() + &format!("v {n}\n");
                (
                    "slow",
                    format!(
                        "import time\nfor i in range({k}):\n    print(i, flush=True)\n    time.sleep(0.25)\n"
                    ),
                    want,
                )
            }
            _ => ("burst", "print('x' * 3000)\n".to_string(), {
                "x".repeat(3000) + "\n" + &format!("v {n}\n")
            }),
        };
        let code = format!("assert v in ({prev}, {n}), v\n{body}v = {n}\nprint('v', v)");
        done += 1;
        ctx.stats.cell("python", kind, false);
        match run_cell(&ctx, &mut c, &session, &code, &want).await {
            Ok(()) => prev = n,
            Err(CellFailure::Wrong(w)) => {
                ctx.stats.wrong(format!("client {id} {kind} cell: {w}"));
                // The session's value is unknown now: set it again.
                let reset = format!("v = {n}");
                if run_cell(&ctx, &mut c, &session, &reset, "").await.is_err() {
                    return;
                }
                prev = n;
            }
            Err(CellFailure::Lost(e)) => {
                ctx.stats.lost(format!("client {id} {kind} cell: {e}"));
                return;
            }
        }
    }
}

enum CellFailure {
    Lost(String),
    Wrong(String),
}

impl std::fmt::Display for CellFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CellFailure::Lost(e) | CellFailure::Wrong(e) => f.write_str(e),
        }
    }
}

/// Runs `code` in `session` to its result, across restarts: the `Execute` is sent with one
/// cell token, and again with it while the daemon is away (the daemon then follows the cell
/// the token names, if one started, so the code runs once), the started cell is followed
/// across restarts. `want`: the whole
/// stdout expected (empty: not checked); the status must be ok.
async fn run_cell(
    ctx: &Ctx,
    c: &mut Option<Client>,
    session: &str,
    code: &str,
    want: &str,
) -> Result<(), CellFailure> {
    let t0 = Instant::now();
    let mut delay = Duration::from_millis(50);
    let mut sent = 0u32;
    let token = sandcell_client::cell_token();
    loop {
        if t0.elapsed() > AWAY * 2 {
            return Err(CellFailure::Lost("no result within 120 s".into()));
        }
        if c.is_none() {
            match Client::connect(&ctx.socket).await {
                Ok(conn) => *c = Some(conn),
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                    continue;
                }
            }
        }
        let conn = c.as_mut().expect("connected just above");
        ctx.stats.calls.fetch_add(1, Ordering::Relaxed);
        if sent > 0 {
            RESENT.fetch_add(1, Ordering::Relaxed);
        }
        sent += 1;
        let r = tokio::time::timeout(ctx.timeout, async {
            conn.execute_with_token(session, code, Some(&token)).await?;
            let policy = Reattach {
                attempts: 40,
                first_delay: Duration::from_millis(50),
                max_delay: Duration::from_secs(1),
            };
            let mut track = CellTrack::executing(policy, session, code, &token);
            let got = conn.finish_following(&mut track, |_| {}).await;
            if track.reattached() > 0 {
                FOLLOWED.fetch_add(1, Ordering::Relaxed);
            }
            got.map(|g| (g, track.reattached()))
        })
        .await
        .unwrap_or_else(|_| {
            Err(Error::File {
                what: "no answer in time".into(),
                source: std::io::Error::from(std::io::ErrorKind::TimedOut),
            })
        });
        match r {
            Ok((got, track_reattached)) => {
                if got.result.status != Status::Ok {
                    return Err(CellFailure::Wrong(format!(
                        "status {} ({:?})",
                        got.result.status.as_str(),
                        got.result.error
                    )));
                }
                if !want.is_empty() && got.stdout != want {
                    // What the daemon retained of the cell tells a loss in the daemon from
                    // one in the client's following.
                    let retained = retained_stdout(ctx, session, got.cell).await;
                    return Err(CellFailure::Wrong(format!(
                        "stdout {:?}, not {:?} (cell {}, followed again {} times; the daemon retained {:?})",
                        super::trunc(&got.stdout),
                        super::trunc(want),
                        got.cell,
                        track_reattached,
                        retained
                            .map(|s| super::trunc(&s))
                            .map_err(|e| e.to_string())
                    )));
                }
                return Ok(());
            }
            Err(Error::Kernel(KernelError::SessionBusy { .. })) => {
                // Another cell runs (not this token's): wait for its end.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) if away(&e) => {
                *c = None;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e @ Error::Kernel(_)) => return Err(CellFailure::Wrong(e.to_string())),
            Err(e) => return Err(CellFailure::Lost(e.to_string())),
        }
    }
}

/// The stdout the daemon retained of `cell` of `session`, replayed by an `Attach` on a new
/// connection.
async fn retained_stdout(ctx: &Ctx, session: &str, cell: u64) -> Result<String, Error> {
    let mut c = Client::connect(&ctx.socket).await?;
    c.attach(session, cell).await?;
    Ok(c.finish(|_| {}).await?.stdout)
}

/// Closes every session of this uid (the clients' and any a cut `Open` made), trying again
/// while the daemon is away. Returns how many were closed.
pub async fn close_all(ctx: &Ctx) -> usize {
    let mut c = None;
    let listed = again(ctx, &mut c, |c| {
        Box::pin(async move { c.list_sessions().await })
    })
    .await;
    let Ok((sessions, _)) = listed else {
        return 0;
    };
    let mut n = 0;
    for s in sessions {
        let id = s.session.clone();
        let r = again(ctx, &mut c, |c| {
            let id = id.clone();
            Box::pin(async move { c.close(&id).await })
        })
        .await;
        if r.is_ok() {
            n += 1;
        }
    }
    n
}

/// Keeper processes (`sandcelld-keeper`) listening under `adopt_dir`.
pub fn keepers(adopt_dir: &Path) -> u64 {
    let want = adopt_dir.join("keepers");
    let want = want.to_string_lossy();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                c.starts_with(b"sandcelld-keeper\0")
                    && String::from_utf8_lossy(&c).contains(want.as_ref())
            })
        })
        .count() as u64
}

/// File systems mounted below `<state_dir>/sessions` in this mount namespace.
pub fn mounts(state_dir: &Path) -> u64 {
    let below = state_dir.join("sessions");
    let below = below.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split(' ')
                .nth(4)
                .is_some_and(|p| p.starts_with(below.as_ref()) && p.len() > below.len())
        })
        .count() as u64
}
