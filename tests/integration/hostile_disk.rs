//! The session disk budget holds during a cell, against cells that write as fast as they can:
//! an R cell running `dd` through `system()` (one big file, and many files each under the
//! budget) and an Eryx Python cell writing to `/mnt/data`. Each cell is stopped, the usage
//! the test itself observes in the session directory stays within the budget plus the
//! documented overshoot, the session ends with its files removed, and other sessions and
//! later sessions work.

mod common;

use common::{Daemon, eventually};
use sandcell_client::{Client, KernelError, Status};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The budget of these tests: 64 MiB per session directory.
const BUDGET: u64 = 64 << 20;

/// What may be written past the budget before the cell is stopped (sandcelld(8), "Disk"):
/// what the cell writes between two walks of the disk watch (at most 250 ms apart) plus one
/// walk and the kill. At the ~1 GiB/s this machine's disk takes, about 300 MiB; usually far
/// less (the walks of a small directory are 25 ms apart).
const OVERSHOOT: u64 = 320 << 20;

fn has_r() -> bool {
    let ok = Path::new("/usr/lib/R/bin/exec/R").exists()
        && Path::new("/usr/bin/dd").exists()
        && Path::new("/usr/bin/yes").exists();
    if !ok {
        eprintln!("skipped: R or dd is not installed (scripts/setup.sh installs r-base-core)");
    }
    ok
}

fn session_dir(d: &Daemon, session: &str) -> PathBuf {
    d.dir.path().join("state/sessions").join(session)
}

/// What a directory costs as the daemon charges it: per inode the larger of its size and its
/// allocated blocks, every entry at any depth (errors from entries vanishing are ignored).
fn charged(dir: &Path) -> u64 {
    let mut total = 0u64;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        total += if m.is_file() {
            m.len().max(m.blocks() * 512)
        } else {
            m.blocks() * 512
        };
        if m.is_dir() {
            total += charged(&e.path());
        }
    }
    total
}

/// Samples [`charged`] of `dir` every few milliseconds until dropped; `peak()` is the most it saw.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(dir: PathBuf) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(charged(&dir), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Sampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

fn daemon(languages: &str) -> Daemon {
    Daemon::start(&[
        ("SANDCELL_LANGUAGES", languages),
        ("SANDCELL_MAX_SESSION_FILES_BYTES", &BUDGET.to_string()),
        ("SANDCELL_MAX_FILE_BYTES", &(16u64 << 20).to_string()),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "30"),
    ])
}

/// Runs `code` in a fresh session of `language` while sampling its directory; returns the
/// result, the peak observed and the cell's duration.
async fn write_until_stopped(
    d: &Daemon,
    c: &mut Client,
    language: &str,
    code: &str,
) -> (String, sandcell_client::Collected, u64, Duration) {
    let s = c.open(language, None, None).await.unwrap().session;
    let sampler = Sampler::start(session_dir(d, &s));
    let t0 = Instant::now();
    let out = c.execute_collect(&s, code).await.unwrap();
    let took = t0.elapsed();
    let peak = sampler.finish();
    (s, out, peak, took)
}

/// The cell was stopped by the budget during the cell (not after it ended on its own), its
/// session ended and its directory went.
async fn assert_stopped(
    d: &Daemon,
    c: &mut Client,
    what: &str,
    s: &str,
    out: &sandcell_client::Collected,
    peak: u64,
    took: Duration,
) {
    eprintln!(
        "{what}: status {:?}, stopped after {took:?}, peak {} MiB observed (budget {} MiB), error {:?}",
        out.result.status,
        peak >> 20,
        BUDGET >> 20,
        out.result.error.as_ref().map(|e| &e.message)
    );
    assert!(
        out.result.session_ended,
        "{what}: the session outlived its budget: {:?}",
        out.result
    );
    assert!(
        peak <= BUDGET + OVERSHOOT,
        "{what}: {peak} bytes observed, over the budget {BUDGET} + overshoot {OVERSHOOT}"
    );
    let dir = session_dir(d, s);
    assert!(
        eventually(Duration::from_secs(10), || !dir.exists()),
        "{what}: the over-budget files were not removed"
    );
    match c.execute_collect(s, "1").await {
        Err(sandcell_client::Error::Kernel(KernelError::NoSuchSession { .. })) => {}
        Err(sandcell_client::Error::Kernel(e)) if format!("{e:?}").contains("SessionEnded") => {}
        other => panic!("{what}: the ended session answered {other:?}"),
    }
}

fn stopped_during_the_cell(what: &str, out: &sandcell_client::Collected) {
    assert_eq!(out.result.status, Status::Error, "{what}: {:?}", out.result);
    let e = out.result.error.as_ref().expect("an error says why");
    assert_eq!(e.kind, "DiskQuotaExceeded", "{what}: {e:?}");
    assert!(
        !out.stdout.contains("after"),
        "{what}: the cell ran to its end: {:?}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r_writers_are_stopped_at_the_budget_during_the_cell() {
    if !has_r() {
        return;
    }
    let d = daemon("r");
    let mut c = d.client().await;
    // A session that stays within its budget, running before and after the writers.
    let keep = c.open("r", None, None).await.unwrap().session;
    c.execute_collect(&keep, "kept <- 42").await.unwrap();

    // One file: RLIMIT_FSIZE (the budget) stops dd itself with EFBIG at 64 MiB.
    let (s, out, peak, took) = write_until_stopped(
        &d,
        &mut c,
        "r",
        "system('yes | dd of=big bs=1M count=3000 iflag=fullblock 2>&1'); cat('after')",
    )
    .await;
    assert_stopped(&d, &mut c, "one big file", &s, &out, peak, took).await;
    assert!(
        peak <= BUDGET + (1 << 20),
        "one file cannot outgrow RLIMIT_FSIZE: {peak}"
    );

    // Many files, each under the budget: the disk watch stops the cell.
    let (s, out, peak, took) = write_until_stopped(
        &d,
        &mut c,
        "r",
        "for (i in 1:60) system(sprintf('yes | dd of=big%d bs=1M count=50 iflag=fullblock 2>/dev/null', i)); cat('after')",
    )
    .await;
    stopped_during_the_cell("many files", &out);
    assert_stopped(&d, &mut c, "many files", &s, &out, peak, took).await;
    assert!(took < Duration::from_secs(20), "{took:?}");

    // Written by R itself, many files.
    let (s, out, peak, took) = write_until_stopped(
        &d,
        &mut c,
        "r",
        "z <- raw(8 * 2^20); for (i in 1:400) writeBin(z, sprintf('w%d', i)); cat('after')",
    )
    .await;
    stopped_during_the_cell("writeBin", &out);
    assert_stopped(&d, &mut c, "writeBin", &s, &out, peak, took).await;

    // Others are unaffected, and new sessions work.
    let out = c.execute_collect(&keep, "cat(kept)").await.unwrap();
    assert_eq!(out.stdout, "42", "{:?}", out.result);
    let s = c.open("r", None, None).await.unwrap().session;
    let out = c
        .execute_collect(&s, "writeBin(raw(1e6), 'small'); cat(file.size('small'))")
        .await
        .unwrap();
    assert_eq!(out.stdout, "1e+06", "{:?}", out.result);
    assert!(!out.result.session_ended);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_writers_are_stopped_at_the_budget_during_the_cell() {
    let d = daemon("python");
    let mut c = d.client().await;
    let keep = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&keep, "kept = 42").await.unwrap();

    // Many files of 10 MiB each through the /mnt/data mount.
    let (s, out, peak, took) = write_until_stopped(
        &d,
        &mut c,
        "python",
        "z = bytes(10 << 20)\nfor i in range(300):\n    with open(f'/mnt/data/f{i}', 'wb') as f:\n        f.write(z)\nprint('after')\n",
    )
    .await;
    stopped_during_the_cell("python files", &out);
    assert_stopped(&d, &mut c, "python files", &s, &out, peak, took).await;

    // One file past the budget: the write fails (EFBIG), the worker lives on to report it.
    let s = c.open("python", None, None).await.unwrap().session;
    let out = c
        .execute_collect(
            &s,
            "try:\n    with open('/mnt/data/one', 'wb') as f:\n        for i in range(100):\n            f.write(bytes(1 << 20))\nexcept OSError as e:\n    print('refused', e.errno)\n",
        )
        .await
        .unwrap();
    eprintln!("one python file: {:?} {:?}", out.stdout, out.result.status);
    assert_ne!(
        out.result.status,
        Status::WorkerCrashed,
        "SIGXFSZ must not kill the worker: {:?}",
        out.result
    );
    assert!(
        charged(&session_dir(&d, &s)) <= BUDGET + OVERSHOOT,
        "one file outgrew the budget"
    );

    let out = c.execute_collect(&keep, "print(kept)").await.unwrap();
    assert_eq!(out.stdout, "42\n", "{:?}", out.result);
    let out = c
        .run_collect(
            "python",
            "open('/mnt/data/x', 'w').write('hi'); print('ok')",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "ok\n", "{:?}", out.result);
}

/// A directory the listing shows only in part (names more than 4 levels deep, more than 1000
/// entries) within the budgets keeps its session and its files; the result says its list of
/// files may be incomplete. Past the entry budget (4096), the session ends.
#[tokio::test]
async fn a_deep_or_crowded_directory_within_the_budgets_keeps_its_session() {
    let d = daemon("python");
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let out = c
        .execute_collect(
            &s,
            "import os\nos.makedirs('/mnt/data/a/b/c/d')\nopen('/mnt/data/a/b/c/d/deep', 'w').write('1')\nfor i in range(1100):\n    open(f'/mnt/data/n{i}', 'w').close()\nkept = 7\n",
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{out:?}");
    assert!(!out.result.session_ended, "{out:?}");
    assert!(
        out.result
            .warnings
            .iter()
            .any(|w| w.contains("may be incomplete")),
        "{:?}",
        out.result.warnings
    );
    assert!(session_dir(&d, &s).join("a/b/c/d/deep").exists());
    let out = c.execute_collect(&s, "print(kept)").await.unwrap();
    assert_eq!(out.stdout, "7\n");
    // Past the entry budget the session ends and its directory goes.
    let out = c
        .execute_collect(
            &s,
            "for i in range(5000):\n    open(f'/mnt/data/m{i}', 'w').close()\n",
        )
        .await
        .unwrap();
    assert!(out.result.session_ended, "{out:?}");
    assert!(eventually(Duration::from_secs(10), || !session_dir(&d, &s).exists()));
}
