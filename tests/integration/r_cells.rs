//! R cells through a real sandcelld and real confined R workers.

use crate::common;

use common::{Daemon, eventually};
use sandcell_client::{State, Status};
use std::time::{Duration, Instant};

fn r_daemon(extra: &[(&str, &str)]) -> Option<Daemon> {
    if !std::path::Path::new("/usr/lib/R/bin/exec/R").exists() {
        return None;
    }
    let mut env = vec![("SANDCELL_LANGUAGES", "python,r")];
    env.extend_from_slice(extra);
    Some(Daemon::start(&env))
}

#[tokio::test]
async fn r_examples_print_exact_statistics() {
    let Some(d) = r_daemon(&[]) else {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    };
    let mut c = d.client().await;
    let dir = common::manifest_dir().join("../examples/r");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("R") {
            continue;
        }
        let out = c
            .run_collect("r", &std::fs::read_to_string(&p).unwrap(), None)
            .await
            .unwrap();
        assert_eq!(
            out.result.status,
            Status::Ok,
            "{}: {:?} {}",
            p.display(),
            out.result,
            out.stderr
        );
        assert_eq!(
            out.stdout,
            std::fs::read_to_string(p.with_extension("out")).unwrap(),
            "{}",
            p.display()
        );
        n += 1;
    }
    assert!(n >= 3);
}

#[tokio::test]
async fn r_session_persists_and_reports_errors_with_lines() {
    let Some(d) = r_daemon(&[]) else {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    };
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    c.execute_collect(&s, "x <- c(1, 2, 3)\nf <- function(v) sum(v) * 2")
        .await
        .unwrap();
    let out = c.execute_collect(&s, "cat(f(x), '\\n')").await.unwrap();
    assert_eq!(out.stdout, "12 \n");
    let out = c
        .execute_collect(&s, "y <- 1\n\nstop('boom')\n")
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Error);
    let e = out.result.error.unwrap();
    assert!(e.message.contains("boom"), "{e:?}");
    assert_eq!(e.line, Some(3), "{e:?}");
    // rm(list = ls(all.names = TRUE)) removes the user's variables and nothing of the worker's.
    c.execute_collect(&s, "rm(list = ls(all.names = TRUE))")
        .await
        .unwrap();
    let out = c
        .execute_collect(&s, "cat(exists('x'), length(ls(all.names = TRUE)), '\\n')")
        .await
        .unwrap();
    assert_eq!(out.stdout, "FALSE 0 \n", "{:?}", out.result);
    let out = c.execute_collect(&s, "cat('alive\\n')").await.unwrap();
    assert_eq!(out.stdout, "alive\n");
}

#[tokio::test]
async fn r_interrupts_end_exactly_the_cell() {
    let Some(d) = r_daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120")]) else {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    };
    let mut a = d.client().await;
    let s = a.open("r", None, None).await.unwrap().session;
    a.execute_collect(&s, "keep <- 'kept'").await.unwrap();
    for code in ["Sys.sleep(100)", "while (TRUE) {}"] {
        a.execute(&s, code).await.unwrap();
        let started = a.next_frame().await.unwrap().started.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut b = d.client().await;
        let t0 = Instant::now();
        assert!(b.interrupt(&s, started.cell).await.unwrap().delivered);
        let out = a.finish(|_| {}).await.unwrap();
        // A bound on hangs, not on speed: an interrupt the worker ignored would end only at
        // the 120 s wall time.
        eprintln!("figure: {code} interrupted in {:?}", t0.elapsed());
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{code}: took {:?}",
            t0.elapsed()
        );
        assert_eq!(
            out.result.status,
            Status::Interrupted,
            "{code}: {:?}",
            out.result
        );
        assert_eq!(out.result.state, State::Kept);
        let after = a.execute_collect(&s, "cat(keep, '\\n')").await.unwrap();
        assert_eq!(after.stdout, "kept \n");
    }
}

/// R ignores SIGINT while it waits in `system()`, so an interrupted cell of `system()` calls
/// can run on to its end: it is reported `interrupted`, never `ok`.
#[tokio::test]
async fn an_interrupted_r_cell_in_system_is_reported_interrupted() {
    let Some(d) = r_daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120")]) else {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    };
    let mut a = d.client().await;
    let s = a.open("r", None, None).await.unwrap().session;
    a.execute(
        &s,
        "for (i in 1:3) { system('sleep 2'); cat('iter', i, '\\n') }",
    )
    .await
    .unwrap();
    let started = a.next_frame().await.unwrap().started.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut b = d.client().await;
    assert!(b.interrupt(&s, started.cell).await.unwrap().delivered);
    let out = a.finish(|_| {}).await.unwrap();
    assert_eq!(out.result.status, Status::Interrupted, "{:?}", out.result);
    // The session goes on.
    let after = a.execute_collect(&s, "cat('alive\\n')").await.unwrap();
    assert_eq!(after.stdout, "alive\n");
}

#[tokio::test]
async fn r_flood_is_counted_exactly_without_growing_the_daemon() {
    // The wall time only bounds a hang: 300 MB of output takes several seconds on a loaded
    // machine, and this test is about counting, not speed.
    let Some(d) = r_daemon(&[
        ("SANDCELL_MAX_STDOUT_BYTES", "1000"),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "120"),
    ]) else {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    };
    let before = d.rss();
    let mut c = d.client().await;
    // 300 MB of output: 3e5 lines of 999 'x' plus newline.
    let out = c
        .run_collect(
            "r",
            "line <- strrep('x', 999); for (i in 1:300000) cat(line, '\\n', sep = '')",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.result.stdout.seen, 300_000_000);
    assert_eq!(out.result.stdout.kept, 1000);
    assert!(out.result.stdout.truncated);
    assert!(d.rss() < before + 32 * 1024 * 1024);
    assert!(eventually(Duration::from_secs(5), || d
        .descendants()
        .is_empty()));
}
