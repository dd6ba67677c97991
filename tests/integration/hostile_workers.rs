//! Hostile workers: an R cell that writes the reply pipe (fd 4) and the output pipes from
//! child processes, floods, forges and leaves processes behind. Each test drives the real
//! daemon with real R workers and asserts the bound: what reaches the client, the daemon's own
//! memory and responsiveness, deadlines, and a bystander session that keeps working.

use crate::common;

use common::{Daemon, eventually, r_available};
use sandcell_client::{Client, Status};
use sandcell_proto::kernel::Limits;
use std::time::{Duration, Instant};

fn daemon(extra: &[(&str, &str)]) -> Daemon {
    let mut env = vec![
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "6"),
        ("SANDCELL_LANGUAGES", "python,r"),
    ];
    env.extend_from_slice(extra);
    Daemon::start(&env)
}

/// A bystander session that must keep working while hostile cells run next to it.
struct Bystander {
    client: Client,
    session: String,
    n: u64,
}

impl Bystander {
    async fn new(d: &Daemon) -> Bystander {
        let mut client = d.client().await;
        let session = client.open("python", None, None).await.unwrap().session;
        client.execute_collect(&session, "acc = 0").await.unwrap();
        Bystander {
            client,
            session,
            n: 0,
        }
    }

    /// Adds to its own state and checks it, within a few seconds.
    async fn check(&mut self) {
        self.n += 1;
        let t0 = Instant::now();
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            self.client
                .execute_collect(&self.session, "acc += 1\nprint(acc)"),
        )
        .await
        .expect("bystander cell took over 10 s")
        .unwrap();
        assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
        assert_eq!(
            out.stdout.trim(),
            self.n.to_string(),
            "bystander state changed"
        );
        eprintln!("bystander cell: {:?}", t0.elapsed());
    }
}

/// CPU seconds (user + system) the process `pid` used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = s.rfind(')').map(|i| &s[i + 2..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = (11..=12)
        .filter_map(|i| f.get(i)?.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn limits(wall: f64, stdout: u64) -> Limits {
    Limits {
        wall_time_seconds: Some(wall),
        stdout_bytes: Some(stdout),
        stderr_bytes: Some(stdout),
        ..Default::default()
    }
}

/// A forged `output` frame declaring `bytes: 0`, written to fd 4 by a child process as fast as
/// `yes` can: an R worker never sends output frames, so the first one ends it; the client
/// gets at most its cap and the daemon's memory does not grow.
#[tokio::test]
async fn forged_output_flood_on_the_reply_pipe_ends_the_worker() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let mut by = Bystander::new(&d).await;
    let rss0 = d.rss();
    let mut c = d.client().await;
    let s = c
        .open("r", Some(&limits(8.0, 1024)), None)
        .await
        .unwrap()
        .session;
    let code = r#"writeLines(sprintf('{"t":"output","cell":1,"stream":"stdout","data":"%s","bytes":0}', strrep("x", 8000)), "frame.txt")
system('yes "$(cat frame.txt)" >&4')
cat("not reached\n")"#;
    let t0 = Instant::now();
    let out = c.execute_collect(&s, code).await.unwrap();
    let took = t0.elapsed();
    let rss1 = d.rss();
    eprintln!(
        "forged output flood: status {:?} in {took:?}, client got {} bytes (cap 1024), daemon RSS {} -> {} KiB",
        out.result.status,
        out.stdout.len(),
        rss0 / 1024,
        rss1 / 1024
    );
    assert_eq!(out.result.status, Status::WorkerCrashed, "{:?}", out.result);
    let msg = out
        .result
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    assert!(msg.contains("protocol violation"), "{msg}");
    assert!(
        out.stdout.len() <= 1024,
        "{} bytes through a 1 KiB cap",
        out.stdout.len()
    );
    assert!(out.result.stdout.kept <= 1024, "{:?}", out.result.stdout);
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        rss1 < rss0 + 8 * 1024 * 1024,
        "daemon RSS grew {} KiB",
        (rss1 - rss0) / 1024
    );
    by.check().await;
    assert!(d.child_alive());
}

/// Cell 1 leaves a process that writes a forged `done` for cell 2 after cell 1 ended: the
/// process is killed with its cell, and even a `done` that got through would lack cell 2's
/// nonce. A `done` without the request's nonce, written during the cell, ends the worker.
#[tokio::test]
async fn a_done_forged_by_an_earlier_cell_is_never_taken() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    let one = r#"writeLines('{"t":"done","cell":2,"status":"ok","warnings":["forged"]}', "done2.txt")
writeLines('{"t":"done","cell":3,"status":"ok","warnings":["forged"]}', "done3.txt")
system("(sleep 0.3; cat done2.txt >&4; sleep 0.3; cat done2.txt >&4) &")
cat("one\n")"#;
    let out = c.execute_collect(&s, one).await.unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.stdout, "one\n");
    eprintln!("cell 1 warnings: {:?}", out.result.warnings);
    assert!(
        out.result
            .warnings
            .iter()
            .any(|w| w.contains("left running were stopped")),
        "the leftover writer was not stopped: {:?}",
        out.result.warnings
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    let out = c
        .execute_collect(&s, "Sys.sleep(0.2); cat('real\\n')")
        .await
        .unwrap();
    assert_eq!(out.result.cell, 2);
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.stdout, "real\n", "cell 2's result is not the real one");
    assert!(
        !out.result.warnings.iter().any(|w| w.contains("forged")),
        "{:?}",
        out.result.warnings
    );
    // The same forgery written while cell 3 runs (no nonce): the worker ends.
    let out = c
        .execute_collect(
            &s,
            "system('cat done3.txt >&4'); Sys.sleep(1); cat('three\\n')",
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::WorkerCrashed, "{:?}", out.result);
    let msg = out
        .result
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    assert!(msg.contains("nonce"), "{msg}");
    assert!(!out.result.warnings.iter().any(|w| w.contains("forged")));
    assert!(d.child_alive());
}

/// `yes` on stdout with a client that does not read: the daemon's memory stays bounded, the
/// wall-time deadline holds, Close from another connection is answered at once, and a
/// bystander keeps working.
#[tokio::test]
async fn raw_output_flood_with_a_client_that_does_not_read() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[
        ("SANDCELL_MAX_STDOUT_BYTES", "1048576"),
        ("SANDCELL_MAX_STDERR_BYTES", "1048576"),
    ]);
    let mut by = Bystander::new(&d).await;
    let pid = d.pid();
    let rss0 = d.rss();

    // 1. The deadline: wall 2 s, grace 2 s (default); the client reads nothing for 3 s.
    let mut a = d.client().await;
    let s1 = a
        .open("r", Some(&limits(2.0, 1 << 20)), None)
        .await
        .unwrap()
        .session;
    let t0 = Instant::now();
    a.execute(&s1, "system('yes')").await.unwrap();
    let cpu0 = cpu_seconds(pid);
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cpu = (cpu_seconds(pid) - cpu0) / w0.elapsed().as_secs_f64();
    let rss1 = d.rss();
    by.check().await;
    let out = a.finish(|_| {}).await.unwrap();
    let took = t0.elapsed();
    eprintln!(
        "raw flood, unread client: status {:?} after {took:?} (wall 2 s + grace 2 s), client got {} bytes, \
         daemon CPU {:.0}% of a core, daemon RSS {} -> {} KiB",
        out.result.status,
        out.stdout.len(),
        cpu * 100.0,
        rss0 / 1024,
        rss1 / 1024
    );
    // SIGINT at the wall time ends `yes`; R's system() then returns and the cell ends
    // normally, or R takes the interrupt: either way within the deadline.
    assert!(
        matches!(
            out.result.status,
            Status::Ok | Status::Timeout | Status::Interrupted
        ),
        "{:?}",
        out.result
    );
    assert!(out.result.stdout.truncated, "{:?}", out.result.stdout);
    assert!(out.stdout.len() <= 1 << 20, "{}", out.stdout.len());
    assert!(
        took < Duration::from_secs(2 + 2 + 2 + 3),
        "deadline overshot: {took:?}"
    );
    assert!(
        rss1 < rss0 + 8 * 1024 * 1024,
        "daemon RSS grew {} KiB",
        (rss1 - rss0) / 1024
    );

    // 2. Close from another connection while the flood runs and its client does not read.
    let mut a2 = d.client().await;
    let s2 = a2
        .open("r", Some(&limits(10.0, 1 << 20)), None)
        .await
        .unwrap()
        .session;
    a2.execute(&s2, "system('yes >&2 & yes')").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut b = d.client().await;
    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), b.close(&s2))
        .await
        .expect("Close took over 10 s")
        .unwrap();
    let close_took = t0.elapsed();
    eprintln!("Close during a flood answered in {close_took:?}");
    assert!(close_took < Duration::from_secs(3), "{close_took:?}");
    by.check().await;
    let rss2 = d.rss();
    assert!(
        rss2 < rss0 + 8 * 1024 * 1024,
        "daemon RSS grew {} KiB",
        (rss2 - rss0) / 1024
    );
    assert!(d.child_alive());
}

/// A background writer a cell leaves running stops with its cell: the file does not grow
/// between cells, and the next cell runs normally.
#[tokio::test]
async fn a_background_writer_stops_with_its_cell() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    let out = c
        .execute_collect(
            &s,
            "system(\"sh -c 'while :; do echo x >> f; done' &\"); Sys.sleep(0.3); cat('ok\\n')",
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert!(
        out.result
            .warnings
            .iter()
            .any(|w| w.contains("left running were stopped")),
        "{:?}",
        out.result.warnings
    );
    let s1 = file_size(&mut c, &s, "f").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s2 = file_size(&mut c, &s, "f").await;
    eprintln!("background writer: file {s1} bytes after its cell, {s2} bytes 1 s later");
    assert!(s1 > 0, "the writer never ran");
    assert_eq!(s1, s2, "the file kept growing between cells");
    let out = c
        .execute_collect(&s, "cat(file.size('f') > 0)")
        .await
        .unwrap();
    assert_eq!(out.stdout, "TRUE");
    assert!(
        !out.result
            .warnings
            .iter()
            .any(|w| w.contains("left running")),
        "{:?}",
        out.result.warnings
    );
}

/// Size of `name` in `session`'s directory as ListFiles reports it (0 if absent).
async fn file_size(c: &mut Client, session: &str, name: &str) -> u64 {
    let (files, _) = c.list_files(session).await.unwrap();
    files
        .iter()
        .find(|f| f.name == name)
        .map(|f| f.size)
        .unwrap_or(0)
}

/// The daemon bounds its own memory: it sits in a supervisor group with the memory limit its
/// caps imply.
#[tokio::test]
async fn the_daemon_memory_is_bounded() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || std::env::var_os("SANDCELL_TEST_INSECURE").is_some() {
        sandcell_testing::skip!("cgroups", "needs root and cgroups");
    }
    let d = daemon(&[]);
    let groups = std::fs::read_to_string(format!("/proc/{}/cgroup", d.pid())).unwrap();
    let limit = groups.lines().find_map(|l| {
        let mut it = l.splitn(3, ':');
        let (_, ctl, path) = (it.next()?, it.next()?, it.next()?);
        let file = if ctl.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else if ctl.is_empty() && path.ends_with("/supervisor") {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else {
            return None;
        };
        assert!(path.ends_with("/supervisor"), "daemon in {path}");
        std::fs::read_to_string(file)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    });
    // Derived from the caps in force (6 sessions, the default 1024 connections).
    let bound = sandcelld::memory::Bound::derive(&sandcelld::memory::Caps {
        max_connections: 1024,
        max_connections_per_uid: 256,
        max_concurrent_sessions: 6,
        max_sessions_per_uid: 5,
        memory_max_bytes: 0,
    });
    assert_eq!(limit, Some(bound.max), "{groups}");
    assert!(eventually(Duration::from_secs(1), || d.child_alive()));
}
