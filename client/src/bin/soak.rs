//! `sandcell-soak`: drives a running sandcelld with many concurrent clients and checks every
//! result against what its cell must produce.
//!
//! Each client runs `--cells` cells, mixed across the served languages: one-shot `Run`s and
//! cells of persistent sessions, of the kinds ok, error, timeout, interrupt (from a second
//! connection), print flood (exact seen/kept counts past the stdout cap), file upload and
//! download (`PutFile`, a cell that transforms the file, `GetFile`, `DeleteFile`) and state
//! (a variable set in the session's first cell). Then, with every client gone, it compares
//! what the daemon holds with what it held before: worker processes, session cgroups (v1
//! memory/pids/cpu and v2), session directories, processes running as worker uids, admission
//! (sessions in use and connections, from the daemon's sd_notify `STATUS=` lines when
//! `--notify-socket` is given) and the daemon's open descriptors.
//!
//! Prints samples of the daemon's RSS and descriptor count over time, throughput, each
//! problem found, and last exactly one line `soak: C cells, L lost, W wrong, K leaked` (lost:
//! a call without a result; wrong: a result that differs from the expected one; leaked: the
//! sum of what is left over). Exits 1 unless all three are 0.
//!
//! With `--restart-every S` the daemon is restarted every S seconds while the clients run
//! (`restarts`: SIGUSR2, SIGKILL and SIGUSR1 in turn, the successor started by
//! `--daemon-start` on the same socket and state, or the same process re-executed in place);
//! leaks then also count keepers and session file systems.

#[path = "soak/restarts.rs"]
mod restarts;

use clap::Parser;
use sandcell_client::{Client, Collected, Error, Limits, State, Status};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Soak a running sandcelld.
#[derive(Debug, Parser)]
struct Args {
    /// Socket of the daemon.
    #[arg(long)]
    socket: PathBuf,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Cells per client.
    #[arg(long, default_value_t = 100)]
    cells: usize,
    /// Stop starting new cells after this many seconds (cells then count what ran).
    #[arg(long)]
    seconds: Option<f64>,
    /// Languages to mix.
    #[arg(long, value_delimiter = ',', default_value = "python,r")]
    languages: Vec<String>,
    /// pid of the daemon (RSS, descriptors, worker processes).
    #[arg(long)]
    daemon_pid: Option<u32>,
    /// cgroup_name of the daemon (v1 session groups are `<hierarchy>/.../<name>/sessions/*`).
    #[arg(long)]
    cgroup_name: Option<String>,
    /// state_dir of the daemon (session directories are `<state_dir>/sessions/*`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Datagram socket to bind for the daemon's sd_notify messages (pass the same path to the
    /// daemon as NOTIFY_SOCKET); its STATUS= lines give sessions in use and connections.
    #[arg(long)]
    notify_socket: Option<PathBuf>,
    /// worker_uid_base of the daemon.
    #[arg(long, default_value_t = 3_000_000_000)]
    uid_base: u32,
    /// worker_uid_count of the daemon.
    #[arg(long, default_value_t = 65_536)]
    uid_count: u32,
    /// Seed of the cell mix.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds between samples of the daemon's RSS and descriptors.
    #[arg(long, default_value_t = 5.0)]
    sample_seconds: f64,
    /// Seconds a call (a whole cell included) may take before it counts as lost.
    #[arg(long, default_value_t = 120.0)]
    call_timeout: f64,
    /// Percentage of cells run one-shot (`Run`, a fresh worker each) instead of in sessions.
    #[arg(long, default_value_t = 20)]
    oneshot_percent: u64,
    /// Write every sample as CSV (seconds, rss_bytes, fds, workers, cells, cgroups, dirs).
    #[arg(long)]
    samples_out: Option<PathBuf>,
    /// Restart the daemon every this many seconds while the clients run (SIGUSR2, SIGKILL and
    /// a re-exec in place, SIGUSR1, in turn; needs `--daemon-pid` and `--daemon-start`). Clients then run cells in
    /// detached Python sessions, followed across restarts.
    #[arg(long, requires_all = ["daemon_pid", "daemon_start"])]
    restart_every: Option<f64>,
    /// A shell command that starts a successor daemon on the same socket and state and prints
    /// its pid.
    #[arg(long)]
    daemon_start: Option<String>,
    /// adopt_dir of the daemon (its keepers are counted as leaks once every session ended).
    #[arg(long)]
    adopt_dir: Option<PathBuf>,
}

/// Bytes of stdout kept per cell: every session and one-shot run asks for this cap, so floods
/// are truncated and their counts can be checked exactly.
const CAP: u64 = 4096;
/// Wall time of sessions that may run timeout cells, and of one-shot timeout cells, seconds.
const SESSION_WALL: f64 = 10.0;
const ONESHOT_WALL: f64 = 0.5;

#[derive(Default)]
struct Stats {
    cells: AtomicU64,
    calls: AtomicU64,
    lost: AtomicU64,
    wrong: AtomicU64,
    kinds: Mutex<BTreeMap<String, u64>>,
    problems: Mutex<Vec<String>>,
    classes: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn problem(&self, counter: &AtomicU64, what: String) {
        counter.fetch_add(1, Ordering::SeqCst);
        // Group by what happened: ids and numbers left out, the first words kept.
        let class: Vec<&str> = what
            .split_whitespace()
            .map(|w| {
                let w = w.trim_end_matches(':');
                let hexish = w.len() >= 8 && w.bytes().all(|b| b.is_ascii_hexdigit());
                if hexish || w.bytes().all(|b| b.is_ascii_digit()) {
                    "#"
                } else {
                    w
                }
            })
            .take(14)
            .collect();
        *self
            .classes
            .lock()
            .unwrap()
            .entry(class.join(" "))
            .or_default() += 1;
        let mut p = self.problems.lock().unwrap();
        if p.len() < 100 {
            eprintln!("soak: {what}");
            p.push(what);
        }
    }
    fn lost(&self, what: String) {
        self.problem(&self.lost, format!("LOST {what}"));
    }
    fn wrong(&self, what: String) {
        self.problem(&self.wrong, format!("WRONG {what}"));
    }
    fn cell(&self, lang: &str, kind: &str, oneshot: bool) {
        self.cells.fetch_add(1, Ordering::SeqCst);
        let key = format!("{lang}/{}{kind}", if oneshot { "run/" } else { "session/" });
        *self.kinds.lock().unwrap().entry(key).or_default() += 1;
    }
}

/// SplitMix64's output function: distinct seeds for clients with neighbouring ids.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xorshift64*: a reproducible mix per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Ok,
    Error,
    Timeout,
    Interrupt,
    Flood,
    File,
    State,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Ok => "ok",
            Kind::Error => "error",
            Kind::Timeout => "timeout",
            Kind::Interrupt => "interrupt",
            Kind::Flood => "flood",
            Kind::File => "file",
            Kind::State => "state",
        }
    }
}

/// What a cell must produce.
#[derive(Debug, Clone)]
struct Expect {
    status: Status,
    /// The whole stdout the cell writes; the result keeps its first `CAP` bytes.
    stdout: String,
    /// stderr must be empty (checked for cells that end normally).
    no_stderr: bool,
    /// Error class and exact message.
    error: Option<(&'static str, String)>,
    /// Acceptable states.
    states: &'static [State],
    session_ended: bool,
}

fn check(e: &Expect, got: &Collected, started_cell: Option<u64>) -> Result<(), String> {
    let r = &got.result;
    let mut bad = Vec::new();
    if r.status != e.status {
        bad.push(format!("status {:?}, expected {:?}", r.status, e.status));
    }
    let seen = e.stdout.len() as u64;
    let kept = seen.min(CAP);
    if got.stdout.as_bytes() != &e.stdout.as_bytes()[..kept as usize] {
        bad.push(format!(
            "stdout {:?} (len {}), expected the first {kept} bytes of {:?}",
            trunc(&got.stdout),
            got.stdout.len(),
            trunc(&e.stdout)
        ));
    }
    if (r.stdout.seen, r.stdout.kept, r.stdout.truncated) != (seen, kept, seen > kept) {
        bad.push(format!(
            "stdout counts seen {} kept {} truncated {}, expected {seen}/{kept}/{}",
            r.stdout.seen,
            r.stdout.kept,
            r.stdout.truncated,
            seen > kept
        ));
    }
    if e.no_stderr && (!got.stderr.is_empty() || r.stderr.seen != 0) {
        bad.push(format!(
            "stderr {:?} ({} bytes seen)",
            trunc(&got.stderr),
            r.stderr.seen
        ));
    }
    match (&e.error, &r.error) {
        (None, None) => {}
        (Some((kind, msg)), Some(err)) => {
            if (!kind.is_empty() && err.kind != *kind) || err.message != *msg {
                bad.push(format!(
                    "error {}: {:?}, expected {kind}: {msg:?}",
                    err.kind, err.message
                ));
            }
        }
        (None, Some(err)) if e.status != Status::Ok && e.status != Status::Error => {
            // Timeouts and interrupts may describe themselves.
            let _ = err;
        }
        (x, y) => bad.push(format!("error {y:?}, expected {x:?}")),
    }
    if !e.states.contains(&r.state) {
        bad.push(format!(
            "state {:?}, expected one of {:?}",
            r.state, e.states
        ));
    }
    if r.session_ended != e.session_ended {
        bad.push(format!("session_ended {}", r.session_ended));
    }
    if let Some(c) = started_cell
        && (r.cell != c || got.cell != c)
    {
        bad.push(format!(
            "result of cell {} (started {}), expected {c}",
            r.cell, got.cell
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("; "))
    }
}

fn trunc(s: &str) -> String {
    if s.len() <= 80 {
        return s.to_owned();
    }
    let mut end = 80;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// A cell's source and what it must produce.
fn cell_code(lang: &str, kind: Kind, n: u64, rng: &mut Rng, oneshot: bool) -> (String, Expect) {
    let py = lang == "python";
    let session_states: &'static [State] = &[State::Kept];
    let mut e = Expect {
        status: Status::Ok,
        stdout: String::new(),
        no_stderr: true,
        error: None,
        states: if oneshot {
            &[State::None]
        } else {
            session_states
        },
        session_ended: oneshot,
    };
    let code = match kind {
        Kind::Ok => {
            let (a, b) = (rng.below(10_000), rng.below(10_000));
            e.stdout = format!("{}\n", a + b);
            if py {
                format!("print({a} + {b})")
            } else {
                format!("cat({a} + {b}, '\\n', sep = '')")
            }
        }
        Kind::Error => {
            e.status = Status::Error;
            e.no_stderr = false;
            if py {
                e.error = Some(("ValueError", format!("soak-{n}")));
                format!("x_{n} = 1\nraise ValueError('soak-{n}')\n")
            } else {
                e.error = Some(("simpleError", format!("soak-{n}")));
                format!("x_{n} <- 1\nstop('soak-{n}')\n")
            }
        }
        Kind::Flood => {
            let k = 20 + rng.below(200);
            e.stdout = format!("{}\n", "y".repeat(99)).repeat(k as usize);
            if py {
                format!("for i in range({k}):\n    print('y' * 99)\n")
            } else {
                format!("for (i in 1:{k}) cat(strrep('y', 99), '\\n', sep = '')")
            }
        }
        Kind::Timeout | Kind::Interrupt => {
            e.status = if kind == Kind::Timeout {
                Status::Timeout
            } else {
                Status::Interrupted
            };
            e.no_stderr = false;
            // A session's variables survive an interrupt; a timeout may rebuild the
            // interpreter (Python), restoring them or saying they are lost.
            if !oneshot {
                e.states = if kind == Kind::Timeout {
                    &[State::Kept, State::Restored, State::Lost]
                } else {
                    &[State::Kept, State::Restored]
                };
            }
            let busy = rng.below(4) == 0;
            match (py, busy) {
                (true, false) => "import time\ntime.sleep(60)\n".into(),
                (true, true) => "while True:\n    pass\n".into(),
                (false, false) => "Sys.sleep(60)".into(),
                (false, true) => "repeat {}".into(),
            }
        }
        Kind::State => {
            // Filled in by the caller, which knows the session's value.
            String::new()
        }
        Kind::File => String::new(),
    };
    (code, e)
}

#[derive(Clone)]
struct Ctx {
    socket: PathBuf,
    stats: Arc<Stats>,
    timeout: Duration,
    deadline: Option<Instant>,
}

async fn timed<T>(
    ctx: &Ctx,
    f: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, String> {
    ctx.stats.calls.fetch_add(1, Ordering::Relaxed);
    match tokio::time::timeout(ctx.timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{e}")),
        Err(_) => Err(format!("no answer within {:?}", ctx.timeout)),
    }
}

/// Whether an error is one of the daemon's named refusals (a result, but a wrong one) rather
/// than a call without an answer.
fn refusal(e: &str) -> bool {
    !(e.starts_with("varlink:")
        || e.starts_with("connecting")
        || e.starts_with("no answer")
        || e.contains("closed the cell's stream"))
}

/// Records a failed call; returns whether the connection must be replaced.
fn failed(ctx: &Ctx, what: &str, e: String) -> bool {
    if refusal(&e) {
        ctx.stats.wrong(format!("{what}: refused: {e}"));
        false
    } else {
        ctx.stats.lost(format!("{what}: {e}"));
        true
    }
}

async fn connect(ctx: &Ctx) -> Option<Client> {
    match timed(ctx, Client::connect(&ctx.socket)).await {
        Ok(c) => Some(c),
        Err(e) => {
            ctx.stats.lost(format!("connect: {e}"));
            None
        }
    }
}

fn past(ctx: &Ctx) -> bool {
    ctx.deadline.is_some_and(|d| Instant::now() >= d)
}

fn limits(wall: Option<f64>) -> Limits {
    Limits {
        wall_time_seconds: wall,
        stdout_bytes: Some(CAP),
        ..Default::default()
    }
}

async fn client_task(ctx: Ctx, id: usize, cells: usize, languages: Vec<String>, seed: u64) {
    let mut rng = Rng(splitmix64(splitmix64(seed) ^ id as u64) | 1);
    let Some(mut c) = connect(&ctx).await else {
        return;
    };
    let Some(mut side) = connect(&ctx).await else {
        return;
    };
    let mut done = 0usize;
    let mut n = (id as u64) * 1_000_000;
    while done < cells && !past(&ctx) {
        let lang = languages[rng.below(languages.len() as u64) as usize].clone();
        // Sessions run 8 cells on average: choose a one-shot run with the probability that
        // makes `oneshot_percent` of all cells one-shot.
        let x = ctx_oneshot(&ctx) as f64 / 100.0;
        let p = if x >= 1.0 {
            1.0
        } else {
            x * 8.0 / (x * 8.0 + (1.0 - x))
        };
        if (rng.below(1_000_000) as f64) < p * 1_000_000.0 {
            n += 1;
            let kind = match rng.below(10) {
                0..=3 => Kind::Ok,
                4..=5 => Kind::Error,
                6..=7 => Kind::Flood,
                _ => Kind::Timeout,
            };
            let (code, e) = cell_code(&lang, kind, n, &mut rng, true);
            let wall = (kind == Kind::Timeout).then_some(ONESHOT_WALL);
            let what = format!("client {id} {lang} run {}", kind.name());
            let l = limits(wall);
            let r = timed(&ctx, async {
                c.run(&lang, &code, Some(&l)).await?;
                c.finish(|_| {}).await
            })
            .await;
            done += 1;
            ctx.stats.cell(&lang, kind.name(), true);
            match r {
                Ok(got) => {
                    if let Err(why) = check(&e, &got, None) {
                        ctx.stats.wrong(format!("{what}: {why}"));
                    }
                }
                Err(err) => {
                    if failed(&ctx, &what, err) {
                        match connect(&ctx).await {
                            Some(x) => c = x,
                            None => return,
                        }
                    }
                }
            }
            continue;
        }
        // A session of a few cells.
        let can_time_out = rng.below(4) == 0;
        let l = limits(can_time_out.then_some(SESSION_WALL));
        let what = format!("client {id} {lang} session");
        let s = match timed(&ctx, c.open(&lang, Some(&l), None)).await {
            Ok(o) => o.session,
            Err(err) => {
                if failed(&ctx, &format!("{what} open"), err) {
                    match connect(&ctx).await {
                        Some(x) => c = x,
                        None => return,
                    }
                }
                continue;
            }
        };
        let len = 3 + rng.below(10) as usize;
        let mut value: Option<u64> = None;
        let mut broken = false;
        let mut ended = false;
        let mut prev = Kind::State;
        for i in 0..len {
            if done >= cells || past(&ctx) {
                break;
            }
            n += 1;
            let kind = if i == 0 || value.is_none() {
                Kind::State
            } else {
                match rng.below(100) {
                    0..=29 => Kind::Ok,
                    30..=41 => Kind::Error,
                    42..=53 => Kind::Flood,
                    54..=67 => Kind::File,
                    68..=81 => Kind::State,
                    82..=93 => Kind::Interrupt,
                    _ if can_time_out => Kind::Timeout,
                    _ => Kind::Ok,
                }
            };
            let what = format!(
                "client {id} {lang} session {s} cell {} {} (after {})",
                i + 1,
                kind.name(),
                prev.name()
            );
            prev = kind;
            done += 1;
            ctx.stats.cell(&lang, kind.name(), false);
            let outcome = match kind {
                Kind::State => state_cell(&ctx, &mut c, &s, &lang, &mut value, &mut rng).await,
                Kind::File => file_cell(&ctx, &mut c, &s, &lang, n, &mut rng).await,
                Kind::Interrupt => {
                    let (code, e) = cell_code(&lang, kind, n, &mut rng, false);
                    interrupt_cell(&ctx, &mut c, &mut side, &s, &code, &e).await
                }
                _ => {
                    let (code, e) = cell_code(&lang, kind, n, &mut rng, false);
                    match timed(&ctx, c.execute_collect(&s, &code)).await {
                        Ok(got) => {
                            if got.result.state == State::Lost {
                                value = None;
                            }
                            check(&e, &got, None).map_err(Outcome::Wrong)
                        }
                        Err(err) => Err(Outcome::Call(err)),
                    }
                }
            };
            match outcome {
                Ok(()) => {}
                Err(Outcome::Wrong(why)) => {
                    // A session that ended with a wrong result is gone: one wrong, not one
                    // per remaining cell.
                    let gone = why.contains("session_ended true");
                    ctx.stats.wrong(format!("{what}: {why}"));
                    if gone {
                        ended = true;
                        break;
                    }
                }
                Err(Outcome::Call(err)) => {
                    if failed(&ctx, &what, err) {
                        broken = true;
                        break;
                    }
                }
            }
        }
        if broken {
            match connect(&ctx).await {
                Some(x) => c = x,
                None => return,
            }
            continue;
        }
        if ended {
            continue;
        }
        if let Err(err) = timed(&ctx, c.close(&s)).await
            && failed(&ctx, &format!("{what} {s} close"), err)
        {
            match connect(&ctx).await {
                Some(x) => c = x,
                None => return,
            }
        }
    }
}

fn ctx_oneshot(_ctx: &Ctx) -> u64 {
    ONESHOT_PERCENT.load(Ordering::Relaxed)
}

static ONESHOT_PERCENT: AtomicU64 = AtomicU64::new(20);

enum Outcome {
    /// The result differs from the expected one.
    Wrong(String),
    /// The call failed.
    Call(String),
}

async fn state_cell(
    ctx: &Ctx,
    c: &mut Client,
    s: &str,
    lang: &str,
    value: &mut Option<u64>,
    rng: &mut Rng,
) -> Result<(), Outcome> {
    let py = lang == "python";
    let e = Expect {
        status: Status::Ok,
        stdout: String::new(),
        no_stderr: true,
        error: None,
        states: &[State::Kept],
        session_ended: false,
    };
    match *value {
        None => {
            let v = rng.below(1_000_000_000);
            let code = if py {
                format!("soak_v = {v}")
            } else {
                format!("soak_v <- {v}")
            };
            let got = timed(ctx, c.execute_collect(s, &code))
                .await
                .map_err(Outcome::Call)?;
            check(&e, &got, None).map_err(Outcome::Wrong)?;
            *value = Some(v);
            Ok(())
        }
        Some(v) => {
            let code = if py {
                "print(soak_v)"
            } else {
                "cat(format(soak_v, scientific = FALSE), '\\n', sep = '')"
            };
            let got = timed(ctx, c.execute_collect(s, code))
                .await
                .map_err(Outcome::Call)?;
            let e = Expect {
                stdout: format!("{v}\n"),
                ..e
            };
            check(&e, &got, None).map_err(|w| Outcome::Wrong(format!("variable lost: {w}")))
        }
    }
}

async fn interrupt_cell(
    ctx: &Ctx,
    c: &mut Client,
    side: &mut Client,
    s: &str,
    code: &str,
    e: &Expect,
) -> Result<(), Outcome> {
    let started = timed(ctx, async {
        c.execute(s, code).await?;
        c.next_frame().await
    })
    .await
    .map_err(Outcome::Call)?;
    let Some(st) = started.started else {
        return Err(Outcome::Wrong(format!(
            "first frame {started:?}, not started"
        )));
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut delivered = false;
    for _ in 0..100 {
        let r = timed(ctx, side.interrupt(s, st.cell))
            .await
            .map_err(Outcome::Call)?;
        if r.delivered {
            delivered = true;
            break;
        }
        if r.reason != "not_running" {
            return Err(Outcome::Wrong(format!(
                "interrupt not delivered: {}",
                r.reason
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if !delivered {
        return Err(Outcome::Wrong("interrupt never delivered in 10 s".into()));
    }
    let mut got = timed(ctx, c.finish(|_| {})).await.map_err(Outcome::Call)?;
    got.session = st.session.clone();
    got.cell = st.cell;
    check(e, &got, Some(st.cell)).map_err(Outcome::Wrong)
}

async fn file_cell(
    ctx: &Ctx,
    c: &mut Client,
    s: &str,
    lang: &str,
    n: u64,
    rng: &mut Rng,
) -> Result<(), Outcome> {
    let lines = 1 + rng.below(50);
    let mut data = String::new();
    for _ in 0..lines {
        let w = 1 + rng.below(60);
        for _ in 0..w {
            data.push((b'a' + rng.below(26) as u8) as char);
        }
        data.push('\n');
    }
    let (inp, out) = (format!("in-{n}.txt"), format!("out-{n}.txt"));
    let info = timed(ctx, c.put_bytes(s, &inp, data.as_bytes()))
        .await
        .map_err(Outcome::Call)?;
    if info.size != data.len() as u64 || info.name != inp {
        return Err(Outcome::Wrong(format!("PutFile answered {info:?}")));
    }
    let code = if lang == "python" {
        format!("d = open('{inp}').read()\nopen('{out}', 'w').write(d.upper())\nprint(len(d))\n")
    } else {
        format!(
            "d <- readChar('{inp}', 1e6, useBytes = TRUE)\nwriteChar(toupper(d), '{out}', eos = NULL)\ncat(nchar(d), '\\n', sep = '')\n"
        )
    };
    let got = timed(ctx, c.execute_collect(s, &code))
        .await
        .map_err(Outcome::Call)?;
    let e = Expect {
        status: Status::Ok,
        stdout: format!("{}\n", data.len()),
        no_stderr: true,
        error: None,
        states: &[State::Kept],
        session_ended: false,
    };
    check(&e, &got, None).map_err(Outcome::Wrong)?;
    let listed: Vec<_> = got.result.files.iter().filter(|f| f.name == out).collect();
    if listed.len() != 1 || listed[0].size != data.len() as u64 {
        return Err(Outcome::Wrong(format!(
            "the cell's files {:?} do not show {out} of {} bytes",
            got.result.files,
            data.len()
        )));
    }
    let mut back = Vec::new();
    let (_, nbytes) = timed(ctx, c.get_file(s, &out, &mut back))
        .await
        .map_err(Outcome::Call)?;
    if back != data.to_uppercase().as_bytes() || nbytes != data.len() as u64 {
        return Err(Outcome::Wrong(format!(
            "GetFile {out} gave {} bytes differing from the expected {}",
            back.len(),
            data.len()
        )));
    }
    for name in [&inp, &out] {
        timed(ctx, c.delete_file(s, name))
            .await
            .map_err(Outcome::Call)?;
    }
    Ok(())
}

// ---- what the daemon holds ----

fn rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// (pid, ppid, real uid) of every process.
fn processes() -> Vec<(u32, u32, u32)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let field = |name: &str| -> Option<u32> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        if let (Some(ppid), Some(uid)) = (field("PPid:"), field("Uid:")) {
            v.push((pid, ppid, uid));
        }
    }
    v
}

fn descendants(of: u32, procs: &[(u32, u32, u32)]) -> u64 {
    let mut set = vec![of];
    let mut i = 0;
    while i < set.len() {
        let p = set[i];
        for &(pid, ppid, _) in procs {
            if ppid == p && !set.contains(&pid) {
                set.push(pid);
            }
        }
        i += 1;
    }
    set.len() as u64 - 1
}

/// Session groups: `<name>/sessions/*` in every v1 hierarchy, and `sessions/*` under the
/// daemon's own v2 group.
fn cgroups(name: Option<&str>, pid: Option<u32>) -> u64 {
    fn children(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .count() as u64
    }
    fn walk(dir: &Path, name: &str, depth: usize, n: &mut u64) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let p = e.path();
            if e.file_name() == name {
                *n += children(&p.join("sessions"));
            } else if depth > 0 && e.file_name() != "sessions" {
                walk(&p, name, depth - 1, n);
            }
        }
    }
    let mut n = 0;
    if let Some(name) = name {
        for h in ["memory", "pids", "cpu,cpuacct", "cpu"] {
            let root = Path::new("/sys/fs/cgroup").join(h);
            if h == "cpu"
                && std::fs::canonicalize(&root).ok()
                    == std::fs::canonicalize(Path::new("/sys/fs/cgroup/cpu,cpuacct")).ok()
            {
                continue; // the same hierarchy under two names
            }
            walk(&root, name, 4, &mut n);
        }
    }
    if let Some(pid) = pid
        && let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        && let Some(path) = s.lines().find_map(|l| l.strip_prefix("0::"))
    {
        for mount in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
            let dir = Path::new(mount).join(path.trim_start_matches('/'));
            if dir.join("cgroup.procs").exists() {
                n += children(&dir.join("sessions"));
                break;
            }
        }
    }
    n
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Snapshot {
    workers: u64,
    cgroups: u64,
    dirs: u64,
    uids: u64,
    fds: u64,
    sessions: u64,
    connections: u64,
    /// Session file systems mounted below `<state_dir>/sessions`.
    mounts: u64,
    /// Keepers listening in `adopt_dir`.
    keepers: u64,
}

/// The daemon's pid now: `--daemon-pid`, or with restarts the one running now.
fn daemon_pid(a: &Args) -> Option<u32> {
    match RESTARTED.get() {
        Some(d) => Some(d.pid.load(Ordering::SeqCst)).filter(|p| *p != 0),
        None => a.daemon_pid,
    }
}

/// The daemon being restarted (`--restart-every`).
static RESTARTED: std::sync::OnceLock<Arc<restarts::Daemon>> = std::sync::OnceLock::new();

impl Snapshot {
    fn take(a: &Args, status: &Status2) -> Snapshot {
        let procs = processes();
        let end = a.uid_base as u64 + a.uid_count as u64;
        let (sessions, connections) = status.lock().unwrap().map(|s| (s.0, s.1)).unwrap_or((0, 0));
        // Across restarts the workers are no daemon's children and each daemon has its own
        // descriptors: workers count by uid (`uids`), descriptors are not compared.
        let restarting = a.restart_every.is_some();
        let pid = daemon_pid(a);
        Snapshot {
            workers: pid
                .filter(|_| !restarting)
                .map(|p| descendants(p, &procs))
                .unwrap_or(0),
            cgroups: cgroups(a.cgroup_name.as_deref(), pid),
            dirs: a
                .state_dir
                .as_ref()
                .map(|d| {
                    std::fs::read_dir(d.join("sessions"))
                        .map(|r| r.count() as u64)
                        .unwrap_or(0)
                })
                .unwrap_or(0),
            uids: procs
                .iter()
                .filter(|&&(_, _, uid)| (a.uid_base as u64..end).contains(&(uid as u64)))
                .count() as u64,
            fds: pid.filter(|_| !restarting).and_then(fds).unwrap_or(0),
            sessions,
            connections,
            mounts: a.state_dir.as_deref().map(restarts::mounts).unwrap_or(0),
            keepers: a.adopt_dir.as_deref().map(restarts::keepers).unwrap_or(0),
        }
    }

    /// What `self` holds beyond `before`, per item.
    fn leaked(&self, before: &Snapshot) -> Vec<(&'static str, u64)> {
        vec![
            (
                "worker processes",
                self.workers.saturating_sub(before.workers),
            ),
            (
                "session cgroups",
                self.cgroups.saturating_sub(before.cgroups),
            ),
            ("session directories", self.dirs.saturating_sub(before.dirs)),
            ("worker uids in use", self.uids.saturating_sub(before.uids)),
            ("daemon descriptors", self.fds.saturating_sub(before.fds)),
            (
                "admitted sessions",
                self.sessions.saturating_sub(before.sessions),
            ),
            (
                "connections",
                self.connections.saturating_sub(before.connections),
            ),
            (
                "session file systems",
                self.mounts.saturating_sub(before.mounts),
            ),
            ("keepers", self.keepers.saturating_sub(before.keepers)),
        ]
    }
}

/// The daemon's last STATUS= line: (sessions in use, connections, when received).
type Status2 = Arc<Mutex<Option<(u64, u64, Instant)>>>;

fn listen_notify(path: &Path, status: Status2) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(path);
    let sock = std::os::unix::net::UnixDatagram::bind(path)?;
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]);
            for line in text.lines() {
                // "<used> sessions (max <m>), <c> connections, cgroups <mode>"
                let Some(s) = line.strip_prefix("STATUS=") else {
                    continue;
                };
                let words: Vec<&str> = s.split_whitespace().collect();
                let used = words.first().and_then(|w| w.parse().ok());
                let conns = words
                    .iter()
                    .position(|w| w.starts_with("connections"))
                    .and_then(|i| words.get(i.wrapping_sub(1)))
                    .and_then(|w| w.parse().ok());
                if let (Some(u), Some(c)) = (used, conns) {
                    *status.lock().unwrap() = Some((u, c, Instant::now()));
                }
            }
        }
    });
    Ok(())
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    ONESHOT_PERCENT.store(a.oneshot_percent.min(100), Ordering::Relaxed);
    let status: Status2 = Arc::new(Mutex::new(None));
    if let Some(p) = &a.notify_socket {
        listen_notify(p, status.clone())?;
    }
    let stats = Arc::new(Stats::default());
    let ctx = Ctx {
        socket: a.socket.clone(),
        stats: stats.clone(),
        timeout: Duration::from_secs_f64(a.call_timeout),
        deadline: None,
    };

    // Warm up: one cell of each language, one-shot and in a session, so that the daemon's
    // lazily made state (cgroup parents, caches) is in the baseline.
    {
        let mut c = Client::connect(&a.socket).await?;
        for lang in &a.languages {
            let code = if lang == "python" {
                "print(1)"
            } else {
                "cat(1, '\\n')"
            };
            let out = c.run_collect(lang, code, None).await?;
            anyhow::ensure!(
                out.result.status == Status::Ok,
                "warm-up {lang}: {:?}",
                out.result
            );
            let s = c.open(lang, None, None).await?.session;
            c.execute_collect(&s, code).await?;
            c.close(&s).await?;
        }
    }
    let before = settle(&a, &status, None, Duration::from_secs(10)).await;
    println!(
        "soak: before: {} workers, {} session cgroups, {} session dirs, {} worker uids, {} daemon fds, {} sessions admitted, {} connections{}",
        before.workers,
        before.cgroups,
        before.dirs,
        before.uids,
        before.fds,
        before.sessions,
        before.connections,
        if a.notify_socket.is_some() {
            ""
        } else {
            " (no --notify-socket: admission not read)"
        }
    );

    let t0 = Instant::now();
    let ctx = Ctx {
        deadline: a.seconds.map(|s| t0 + Duration::from_secs_f64(s)),
        ..ctx
    };
    let mut tasks = Vec::new();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut restarter = None;
    if let (Some(every), Some(start), Some(pid)) =
        (a.restart_every, a.daemon_start.clone(), a.daemon_pid)
    {
        let d = Arc::new(restarts::Daemon::default());
        d.pid.store(pid, Ordering::SeqCst);
        let _ = RESTARTED.set(d.clone());
        let (socket, stop) = (a.socket.clone(), stop.clone());
        let every = Duration::from_secs_f64(every.max(1.0));
        restarter = Some(std::thread::spawn(move || {
            restarts::restarter(d, every, start, socket, stop)
        }));
        for id in 0..a.clients {
            tasks.push(tokio::spawn(restarts::client_task(
                ctx.clone(),
                id,
                a.cells,
                a.seed,
            )));
        }
    } else {
        for id in 0..a.clients {
            tasks.push(tokio::spawn(client_task(
                ctx.clone(),
                id,
                a.cells,
                a.languages.clone(),
                a.seed,
            )));
        }
    }
    // Samples while the clients run.
    // (seconds, daemon RSS, daemon fds, worker processes, cells, session cgroups, session
    // directories): the cgroup and directory counts show the leak probes see live sessions.
    let mut samples: Vec<(f64, u64, u64, u64, u64, u64, u64)> = Vec::new();
    let every = Duration::from_secs_f64(a.sample_seconds.max(0.2));
    let all = futures_join(tasks);
    tokio::pin!(all);
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            r = &mut all => { r?; break; }
            _ = tick.tick() => {
                if let Some(pid) = daemon_pid(&a) {
                    let procs = processes();
                    let live = Snapshot::take(&a, &status);
                    let s = (
                        t0.elapsed().as_secs_f64(),
                        rss(pid).unwrap_or(0),
                        fds(pid).unwrap_or(0),
                        descendants(pid, &procs),
                        stats.cells.load(Ordering::SeqCst),
                        live.cgroups,
                        live.dirs,
                    );
                    samples.push(s);
                }
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cells = stats.cells.load(Ordering::SeqCst);
    if let Some(r) = restarter {
        stop.store(true, Ordering::SeqCst);
        let gaps = r
            .join()
            .map_err(|_| anyhow::anyhow!("the restarter panicked"))??;
        let max = gaps.iter().cloned().fold(0.0, f64::max);
        let mean = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
        println!(
            "soak: {} restarts (SIGUSR2 and SIGKILL alternately) and {} re-execs in place (SIGUSR1); socket back after {mean:.2} s on average, {max:.2} s at most",
            gaps.len(),
            RESTARTED
                .get()
                .map_or(0, |d| d.restarts.load(Ordering::SeqCst))
                .saturating_sub(gaps.len() as u64)
        );
        println!(
            "soak: {} cells followed into a successor after their call was cut, {} Executes sent again while the daemon was away",
            restarts::FOLLOWED.load(Ordering::SeqCst),
            restarts::RESENT.load(Ordering::SeqCst)
        );
        let closed = restarts::close_all(&ctx).await;
        println!("soak: {closed} sessions closed");
    }
    if let Some(pid) = daemon_pid(&a) {
        let live = Snapshot::take(&a, &status);
        samples.push((
            secs,
            rss(pid).unwrap_or(0),
            fds(pid).unwrap_or(0),
            descendants(pid, &processes()),
            cells,
            live.cgroups,
            live.dirs,
        ));
    }
    if let Some(p) = &a.samples_out {
        let mut csv = String::from("seconds,rss_bytes,fds,workers,cells,cgroups,dirs\n");
        for s in &samples {
            csv.push_str(&format!(
                "{:.1},{},{},{},{},{},{}\n",
                s.0, s.1, s.2, s.3, s.4, s.5, s.6
            ));
        }
        std::fs::write(p, csv)?;
    }
    let step = samples.len().div_ceil(20).max(1);
    for (i, s) in samples.iter().enumerate() {
        if i % step == 0 || i + 1 == samples.len() {
            println!(
                "soak: t={:6.1}s daemon rss {:>9} fds {:4} workers {:3} session cgroups {:3} dirs {:3} cells {}",
                s.0,
                mib(s.1),
                s.2,
                s.3,
                s.5,
                s.6,
                s.4
            );
        }
    }
    if !samples.is_empty() {
        let peak_rss = samples.iter().map(|s| s.1).max().unwrap_or(0);
        let peak_fds = samples.iter().map(|s| s.2).max().unwrap_or(0);
        let min_rss = samples.iter().map(|s| s.1).min().unwrap_or(0);
        let min_fds = samples.iter().map(|s| s.2).min().unwrap_or(0);
        println!(
            "soak: daemon rss first {} min {} peak {} last {}; fds first {} min {} peak {} last {} ({} samples every {:.1} s)",
            mib(samples[0].1),
            mib(min_rss),
            mib(peak_rss),
            mib(samples.last().unwrap().1),
            samples[0].2,
            min_fds,
            peak_fds,
            samples.last().unwrap().2,
            samples.len(),
            every.as_secs_f64()
        );
    }
    println!(
        "soak: {cells} cells and {} calls by {} clients in {secs:.1} s: {:.1} cells/s",
        stats.calls.load(Ordering::SeqCst),
        a.clients,
        cells as f64 / secs
    );
    let kinds = stats.kinds.lock().unwrap().clone();
    println!(
        "soak: mix: {}",
        kinds
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    for (class, n) in stats.classes.lock().unwrap().iter() {
        println!("soak: {n:6} x {class}");
    }

    // Every client is gone: wait for the daemon to release, then compare.
    let ended = Instant::now();
    let after = settle(&a, &status, Some((&before, ended)), Duration::from_secs(30)).await;
    let leaks = after.leaked(&before);
    let leaked: u64 = leaks.iter().map(|l| l.1).sum();
    println!(
        "soak: after: {} workers, {} session cgroups, {} session dirs, {} worker uids, {} daemon fds, {} sessions admitted, {} connections, {} session file systems, {} keepers",
        after.workers,
        after.cgroups,
        after.dirs,
        after.uids,
        after.fds,
        after.sessions,
        after.connections,
        after.mounts,
        after.keepers
    );
    for (what, n) in &leaks {
        if *n > 0 {
            println!("soak: LEAKED {n} {what}");
        }
    }
    let (lost, wrong) = (
        stats.lost.load(Ordering::SeqCst),
        stats.wrong.load(Ordering::SeqCst),
    );
    println!("soak: {cells} cells, {lost} lost, {wrong} wrong, {leaked} leaked");
    if lost + wrong + leaked > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// Waits until the daemon holds no more than `before` (or, for the baseline, until two
/// snapshots a second apart agree), at most `max`. With a notify socket, only STATUS lines
/// received after `since` count.
async fn settle(
    a: &Args,
    status: &Status2,
    target: Option<(&Snapshot, Instant)>,
    max: Duration,
) -> Snapshot {
    let t0 = Instant::now();
    let mut last = Snapshot::take(a, status);
    loop {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let now = Snapshot::take(a, status);
        let fresh = a.notify_socket.is_none()
            || status.lock().unwrap().is_some_and(|s| {
                target.is_none_or(|(_, since)| s.2 > since + Duration::from_millis(1100))
            });
        let done = match target {
            None => now == last,
            Some((before, _)) => now.leaked(before).iter().all(|l| l.1 == 0),
        };
        if (done && fresh) || t0.elapsed() >= max {
            return now;
        }
        last = now;
    }
}

/// Awaits every task; the first panic or error is returned.
async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) -> anyhow::Result<()> {
    for t in tasks {
        t.await?;
    }
    Ok(())
}
