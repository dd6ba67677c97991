//! The session disk budget is held by the kernel, against cells that write as fast as they
//! can: an R cell running `dd` through `system()` (one big file, and many files each under the
//! budget), R's own `writeBin`, and an Eryx Python cell writing to `/mnt/data`. Each session
//! directory is its own tmpfs of the budget's size, so the write past the budget fails
//! (`EFBIG` for one file, RLIMIT_FSIZE; `ENOSPC` for many), the usage the test itself observes
//! in the session directory never exceeds the budget, and the session lives on to free its
//! space; other sessions and later sessions work.

use crate::common;

use common::Daemon;
use sandcell_client::{Client, Status};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The budget of these tests: 64 MiB per session directory.
const BUDGET: u64 = 64 << 20;

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
/// session, the result, the peak observed and the cell's duration.
async fn write_until_refused(
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

/// The kernel held the budget: never more than the budget in the directory, the session
/// alive with its files, and, after `free` (a cell removing them), room again.
#[allow(clippy::too_many_arguments)]
async fn assert_bounded(
    d: &Daemon,
    c: &mut Client,
    what: &str,
    s: &str,
    out: &sandcell_client::Collected,
    peak: u64,
    took: Duration,
    free: &str,
) {
    eprintln!(
        "{what}: status {:?}, ended after {took:?}, peak {} MiB observed (budget {} MiB), error {:?}",
        out.result.status,
        peak >> 20,
        BUDGET >> 20,
        out.result.error.as_ref().map(|e| &e.message)
    );
    assert_ne!(
        out.result.status,
        Status::WorkerCrashed,
        "{what}: {:?}",
        out.result
    );
    assert!(
        peak <= BUDGET,
        "{what}: {peak} bytes observed, over the budget {BUDGET}"
    );
    assert!(
        !out.result.session_ended,
        "{what}: the kernel's refusal should leave the session: {:?}",
        out.result
    );
    let dir = session_dir(d, s);
    assert!(charged(&dir) <= BUDGET, "{what}");
    let out = c.execute_collect(s, free).await.unwrap();
    assert_eq!(out.result.status, Status::Ok, "{what}: freeing: {out:?}");
    assert!(out.stdout.contains("room"), "{what}: {out:?}");
}

/// What a refused write says in a cell: `ENOSPC`'s text natively; Eryx 0.10's WASI layer
/// reports the host's `ENOSPC` as a generic I/O error.
const REFUSED: [&str; 2] = ["No space left on device", "I/O error"];

/// The cell met the kernel's refusal (`ENOSPC`) and went on to its end.
fn refused_and_went_on(what: &str, out: &sandcell_client::Collected) {
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(
        REFUSED.iter().any(|r| all.contains(r)),
        "{what}: no refused write seen: {out:?}"
    );
    assert!(out.stdout.contains("after"), "{what}: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r_writers_meet_the_kernel_bound_at_the_budget() {
    if !has_r() {
        return;
    }
    let d = daemon("r");
    let mut c = d.client().await;
    // A session that stays within its budget, running before and after the writers.
    let keep = c.open("r", None, None).await.unwrap().session;
    c.execute_collect(&keep, "kept <- 42").await.unwrap();
    let free = "unlink(list.files()); writeBin(raw(1e6), 'small'); cat('room', file.size('small'))";

    // One file: RLIMIT_FSIZE (the budget) stops dd itself with EFBIG at 64 MiB.
    let (s, out, peak, took) = write_until_refused(
        &d,
        &mut c,
        "r",
        "system('yes | dd of=big bs=1M count=3000 iflag=fullblock 2>&1'); cat('after')",
    )
    .await;
    assert!(out.stdout.contains("after"), "{out:?}");
    assert_bounded(&d, &mut c, "one big file", &s, &out, peak, took, free).await;

    // Many files, each under the budget: the session's file system refuses the write.
    let (s, out, peak, took) = write_until_refused(
        &d,
        &mut c,
        "r",
        "for (i in 1:60) system(sprintf('yes | dd of=big%d bs=1M count=50 iflag=fullblock 2>&1 | grep -m1 -o \"No space left on device\"', i)); cat('after')",
    )
    .await;
    refused_and_went_on("many files", &out);
    assert_bounded(&d, &mut c, "many files", &s, &out, peak, took, free).await;
    assert!(took < Duration::from_secs(20), "{took:?}");

    // Written by R itself, many files: each write past the budget fails or comes up short.
    let (s, out, peak, took) = write_until_refused(
        &d,
        &mut c,
        "r",
        "z <- raw(8 * 2^20); for (i in 1:400) try(writeBin(z, sprintf('w%d', i)), silent = TRUE); cat('after')",
    )
    .await;
    assert!(out.stdout.contains("after"), "{out:?}");
    assert_bounded(&d, &mut c, "writeBin", &s, &out, peak, took, free).await;

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
async fn python_writers_meet_the_kernel_bound_at_the_budget() {
    let d = daemon("python");
    let mut c = d.client().await;
    let keep = c.open("python", None, None).await.unwrap().session;
    c.execute_collect(&keep, "kept = 42").await.unwrap();
    let free = "import os\nfor f in os.listdir('/mnt/data'):\n    os.remove('/mnt/data/' + f)\nopen('/mnt/data/small', 'wb').write(bytes(1000))\nprint('room')\n";

    // Many files of 10 MiB each through the /mnt/data mount.
    let (s, out, peak, took) = write_until_refused(
        &d,
        &mut c,
        "python",
        "z = bytes(10 << 20)\ntry:\n    for i in range(300):\n        with open(f'/mnt/data/f{i}', 'wb') as f:\n            f.write(z)\nexcept OSError as e:\n    print(e.strerror)\nprint('after')\n",
    )
    .await;
    refused_and_went_on("python files", &out);
    assert_bounded(&d, &mut c, "python files", &s, &out, peak, took, free).await;

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
    assert!(out.stdout.contains("refused"), "{out:?}");
    assert!(
        charged(&session_dir(&d, &s)) <= BUDGET,
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
/// files may be incomplete. The entry budget (4096) is the session file system's inode count:
/// the entry past it is refused (`ENOSPC`) and the session lives on.
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
    assert!(session_dir(&d, &s).join("data/a/b/c/d/deep").exists());
    let out = c.execute_collect(&s, "print(kept)").await.unwrap();
    assert_eq!(out.stdout, "7\n");
    // The entry past the budget is refused by the kernel; the session lives on.
    let out = c
        .execute_collect(
            &s,
            "made = 0\ntry:\n    for i in range(5000):\n        open(f'/mnt/data/m{i}', 'w').close()\n        made += 1\nexcept OSError as e:\n    print(e.strerror)\nprint(made)\n",
        )
        .await
        .unwrap();
    eprintln!("entries: {:?}", out.stdout);
    assert!(
        REFUSED.iter().any(|r| out.stdout.contains(r)),
        "{:?} {:?}",
        out.stdout,
        out.result.error
    );
    assert!(!out.result.session_ended, "{:?}", out.result.status);
    let entries = count_entries(&session_dir(&d, &s));
    assert!(entries <= 4096, "{entries} entries");
    let out = c.execute_collect(&s, "print(kept)").await.unwrap();
    assert_eq!(out.stdout, "7\n");
}

/// Every entry below `dir`, at any depth.
fn count_entries(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        n += 1;
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            n += count_entries(&e.path());
        }
    }
    n
}

/// The memory-cgroup file giving what `pid`'s group is charged now, bytes (cgroup v1
/// `memory.usage_in_bytes`, v2 `memory.current`).
fn memory_usage_file(pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for l in text.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            return Some(PathBuf::from(format!(
                "/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"
            )));
        }
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(PathBuf::from(format!(
        "/sys/fs/cgroup{path}/memory.current"
    )))
}

fn usage(file: &Path) -> u64 {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn mounted(session: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| m.contains(session))
}

/// A session's files live in its own tmpfs, whose pages are charged to the session's memory
/// cgroup, whoever writes them: the cell, or the daemon storing an upload (its copier joins
/// the session's group). The daemon's own group is not charged for the upload, and closing the
/// session unmounts its file system. Prints the figures: session open latency, write
/// throughput, memory charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_files_are_charged_to_the_session_and_unmounted_at_its_end() {
    if common::insecure() {
        sandcell_testing::skip!("cgroups", "no session cgroups in development mode");
    }
    let langs = if has_r() { "python,r" } else { "python" };
    let d = daemon(langs);
    let mut c = d.client().await;
    // Session open latency (a fresh worker each: no pool in these tests).
    let mut opens = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        let s = c.open("python", None, None).await.unwrap().session;
        opens.push(t0.elapsed());
        c.close(&s).await.unwrap();
    }
    opens.sort();
    eprintln!("python session open: median {:?} (of 5)", opens[2]);

    let s = c.open("python", None, None).await.unwrap().session;
    assert!(mounted(&s), "no session file system mounted");
    // The worker: the descendant in the session's own group (a keeper or a process still
    // being started can be in the daemon's group for a moment).
    let mut session_mem = None;
    assert!(common::eventually(Duration::from_secs(5), || {
        session_mem = d
            .descendants()
            .into_iter()
            .filter_map(memory_usage_file)
            .find(|f| f.to_string_lossy().contains(s.as_str()));
        session_mem.is_some()
    }));
    let session_mem = session_mem.expect("the worker's memory cgroup");
    let daemon_mem = memory_usage_file(d.pid()).expect("the daemon's memory cgroup");
    let (s0, d0) = (usage(&session_mem), usage(&daemon_mem));
    // An upload of 16 MiB by descriptor.
    let mut f = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut f, &vec![3u8; 16 << 20]).unwrap();
    c.put_file(&s, "up.bin", f.path()).await.unwrap();
    let (s1, d1) = (usage(&session_mem), usage(&daemon_mem));
    eprintln!(
        "upload of 16 MiB: session group +{} KiB, daemon group {:+} KiB",
        (s1.saturating_sub(s0)) >> 10,
        (d1 as i64 - d0 as i64) >> 10
    );
    // 32 MiB written by the cell.
    let out = c
        .execute_collect(
            &s,
            "import time\nt = time.perf_counter()\nwith open('/mnt/data/cell.bin', 'wb') as f:\n    for _ in range(32):\n        f.write(bytes(1 << 20))\nprint(round(32 / (time.perf_counter() - t)))\n",
        )
        .await
        .unwrap();
    let s2 = usage(&session_mem);
    eprintln!(
        "python cell writing 32 MiB: {} MiB/s, session group +{} KiB",
        out.stdout.trim(),
        (s2.saturating_sub(s1)) >> 10
    );
    assert!(
        s1 >= s0 + (15 << 20),
        "the upload was not charged to the session: {s0} -> {s1}"
    );
    assert!(
        d1 < d0 + (8 << 20),
        "the upload was charged to the daemon: {d0} -> {d1}"
    );
    assert!(
        s2 >= s1 + (30 << 20),
        "the cell's files were not charged to the session: {s1} -> {s2}"
    );
    if has_r() {
        let r = c.open("r", None, None).await.unwrap().session;
        let out = c
            .execute_collect(
                &r,
                "system('yes | dd of=tp bs=1M count=48 iflag=fullblock 2>&1 | tail -1')",
            )
            .await
            .unwrap();
        eprintln!("R dd of 48 MiB: {}", out.stdout.trim());
        c.close(&r).await.unwrap();
    }
    c.close(&s).await.unwrap();
    assert!(
        common::eventually(Duration::from_secs(10), || !mounted(&s)),
        "the session file system outlived its session"
    );
}
