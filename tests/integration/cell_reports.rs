//! Accurate cell reports and clean cell boundaries, against the real daemon: a cell past its
//! wall time is reported as `timeout` however it ends, and ends within the wall time plus the
//! grace; output cut at a cap ends on a character boundary; the processes a cell leaves
//! behind are gone (reaped, not zombies holding `pids.max`) before the next cell starts; a
//! daemon that cannot start for its configuration or confinement exits with 78 (EX_CONFIG).

use crate::common;

use common::Daemon;
use sandcell_client::{Limits, Status};
use std::path::Path;
use std::time::Instant;

fn has_r() -> bool {
    let ok = Path::new("/usr/lib/R/bin/exec/R").exists();
    if !ok {
        eprintln!("skipped: R is not installed (scripts/setup.sh installs r-base-core)");
    }
    ok
}

fn wall(seconds: f64) -> Limits {
    Limits {
        wall_time_seconds: Some(seconds),
        ..Default::default()
    }
}

/// The daemon's default grace (`kill_grace_seconds`).
const GRACE: f64 = 2.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r_cells_past_their_wall_time_are_timeouts_and_end_in_time() {
    if !has_r() {
        return;
    }
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", "r")]);
    let mut c = d.client().await;
    let s = c.open("r", Some(&wall(2.0)), None).await.unwrap().session;
    c.execute_collect(&s, "x <- 1").await.unwrap();
    for (what, code) in [
        ("Sys.sleep", "Sys.sleep(100)"),
        // The SIGINT ends the child; R goes on and would report ok.
        ("system()", "system('sleep 100'); cat('after')"),
        ("busy loop", "repeat {}"),
    ] {
        let t0 = Instant::now();
        let out = c.execute_collect(&s, code).await.unwrap();
        let took = t0.elapsed().as_secs_f64();
        eprintln!(
            "{what}: {:?} after {took:.2} s (wall 2 s), error {:?}",
            out.result.status,
            out.result.error.as_ref().map(|e| &e.message)
        );
        assert_eq!(
            out.result.status,
            Status::Timeout,
            "{what}: {:?}",
            out.result
        );
        assert!(
            took < 2.0 + GRACE + 1.0,
            "{what}: a timeout took {took:.2} s, past the wall time plus the grace"
        );
        if !out.result.session_ended {
            let out = c.execute_collect(&s, "cat(x)").await.unwrap();
            assert_eq!(out.stdout, "1", "{what}: {:?}", out.result);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_cut_at_a_cap_ends_on_a_character_boundary() {
    let langs = if has_r() { "python,r" } else { "python" };
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", langs)]);
    let mut c = d.client().await;
    let caps = Limits {
        stdout_bytes: Some(5),
        ..Default::default()
    };
    let mut cells = vec![("python", "print('✓' * 100)")];
    if langs.contains('r') {
        cells.push(("r", "cat(strrep('\u{2713}', 100))"));
    }
    for (language, code) in cells {
        let s = c.open(language, Some(&caps), None).await.unwrap().session;
        let out = c.execute_collect(&s, code).await.unwrap();
        eprintln!("{language}: {:?} {:?}", out.stdout, out.result.stdout);
        assert_eq!(
            out.stdout, "✓",
            "{language}: the cut character is dropped, not escaped"
        );
        assert!(out.result.stdout.truncated);
        assert_eq!(out.result.stdout.kept, 3, "{language}");
        assert_eq!(
            out.result.stdout.seen,
            300 + u64::from(language == "python")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leftover_processes_are_reaped_before_the_next_cell() {
    if !has_r() {
        return;
    }
    // 64 tasks per session: R and its threads, a shell, and sleepers up to near the limit.
    let d = Daemon::start(&[
        ("SANDCELL_LANGUAGES", "r"),
        ("SANDCELL_MAX_WORKER_PIDS", "64"),
    ]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    for round in 0..3 {
        let out = c
            .execute_collect(
                &s,
                "system('for i in $(seq 1 45); do sleep 100 & done; echo started'); cat('forked')",
            )
            .await
            .unwrap();
        assert_eq!(out.stdout, "started\nforked", "{round}: {:?}", out.result);
        assert!(
            out.result.warnings.iter().any(|w| w.contains("stopped")),
            "{round}: {:?}",
            out.result.warnings
        );
        // At once: the 45 killed sleepers must not hold the session's pids any more.
        let t0 = Instant::now();
        let out = c
            .execute_collect(
                &s,
                "r <- system('for i in $(seq 1 40); do sleep 0.2 & done; wait; echo forked', intern = TRUE); cat(r)",
            )
            .await
            .unwrap();
        eprintln!(
            "round {round}: next cell {:?} in {:?}",
            out.result.status,
            t0.elapsed()
        );
        assert_eq!(
            out.stdout, "forked",
            "{round}: {:?} {:?}",
            out.stderr, out.result
        );
        assert_eq!(out.result.status, Status::Ok);
    }
}

#[test]
fn refusals_to_start_exit_with_ex_config() {
    let daemon = env!("CARGO_BIN_EXE_sandcelld");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.toml"), "[limits]\nno_such_key = 1\n").unwrap();
    std::fs::write(dir.path().join("none.toml"), "").unwrap();
    let run = |cmd: &mut std::process::Command| {
        let out = cmd
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .env("SANDCELL_STATE_DIR", dir.path().join("state"))
            .env("SANDCELL_CGROUP_NAME", "sandcell-test-exconfig")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A configuration the daemon refuses.
    let (code, err) = run(std::process::Command::new(daemon)
        .arg("--config")
        .arg(dir.path().join("bad.toml")));
    assert_eq!(code, Some(78), "{err}");
    // No socket to serve.
    let (code, err) = run(std::process::Command::new(daemon)
        .arg("--config")
        .arg(dir.path().join("none.toml")));
    assert_eq!(code, Some(78), "{err}");
    // Not root (and not --insecure-dev): strict confinement is impossible.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let sock = dir.path().join("k.sock");
        let mut cmd = std::process::Command::new(daemon);
        cmd.arg("--config")
            .arg(dir.path().join("none.toml"))
            .arg("--listen")
            .arg(&sock);
        std::os::unix::process::CommandExt::uid(&mut cmd, 65534);
        std::os::unix::process::CommandExt::gid(&mut cmd, 65534);
        let (code, err) = run(&mut cmd);
        assert_eq!(code, Some(78), "{err}");
    }
}

/// `usage.peak_memory_bytes` is one cell's peak, not the session's: a cell that allocated
/// 160 MB and freed it is followed by a small cell whose peak is far below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cells_peak_memory_is_its_own() {
    if !has_r() || common::insecure() {
        return;
    }
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", "r")]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    let big = c
        .execute_collect(
            &s,
            "x <- numeric(2e7); x[1] <- 1; rm(x); invisible(gc()); cat('freed')",
        )
        .await
        .unwrap();
    assert_eq!(big.stdout, "freed", "{:?}", big.result);
    let small = c.execute_collect(&s, "cat(1 + 1)").await.unwrap();
    assert_eq!(small.stdout, "2", "{:?}", small.result);
    let p1 = big.result.usage.peak_memory_bytes.expect("peak of cell 1");
    let p2 = small
        .result
        .usage
        .peak_memory_bytes
        .expect("peak of cell 2");
    eprintln!("peak memory: cell 1 {p1} bytes, cell 2 {p2} bytes");
    assert!(p1 >= 160_000_000, "cell 1 allocated 160 MB, peak {p1}");
    assert!(
        p2 + 100_000_000 < p1,
        "cell 2's peak {p2} is not its own (cell 1's was {p1})"
    );
}
