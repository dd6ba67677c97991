//! The value of a cell's last expression through a real sandcelld, for each engine (Eryx
//! `python`, native `pydata`, `r`): shown as a REPL shows it by default (Python: the repr of a
//! final expression statement that is not None and not followed by `;`, through
//! `sys.displayhook`, `_` bound to it; a repr that raises shows a placeholder and the cell is
//! ok; R: visible values auto-printed), bounded by the stdout cap like any output, and not
//! shown at all with `display_last_expression: false` on `Open` or `Run`.

use crate::common;

use common::{Daemon, pydata_available, r_available};
use sandcell_client::{Client, Collected, OpenParams, RunParams, Status};

/// The stdout cap of the daemon these tests start, bytes.
const STDOUT_CAP: u64 = 1000;

fn daemon() -> Daemon {
    let cap = STDOUT_CAP.to_string();
    let mut env = vec![("SANDCELL_MAX_STDOUT_BYTES", cap.as_str())];
    if r_available() {
        env.push(("SANDCELL_LANGUAGES", "python,r"));
    }
    Daemon::start(&env)
}

async fn open(c: &mut Client, language: &str, env: Option<&str>, display: Option<bool>) -> String {
    c.open_with(&OpenParams {
        language: language.into(),
        limits: None,
        detached_idle_seconds: None,
        environment: env.map(str::to_owned),
        host_calls: None,
        display_last_expression: display,
        rich_output: None,
        egress: None,
    })
    .await
    .expect("open")
    .session
}

async fn ok(c: &mut Client, s: &str, code: &str) -> Collected {
    let out = c.execute_collect(s, code).await.expect("execute");
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{code}: {:.400}",
        format!("{:?} {}", out.result, out.stderr)
    );
    out
}

async fn run(
    c: &mut Client,
    language: &str,
    env: Option<&str>,
    code: &str,
    display: Option<bool>,
) -> Collected {
    c.run_with(&RunParams {
        language: language.into(),
        code: code.into(),
        limits: None,
        environment: env.map(str::to_owned),
        host_calls: None,
        display_last_expression: display,
        rich_output: None,
        egress: None,
    })
    .await
    .expect("run");
    c.finish(|_| {}).await.expect("result")
}

/// What both Python engines must do, the same way.
async fn python_engine(d: &Daemon, env: Option<&str>) {
    let mut c = d.client().await;
    let s = open(&mut c, "python", env, None).await;
    let shows = |code: &'static str, want: &'static str| (code, want);
    for (code, want) in [
        shows("x = 21", ""),
        shows("x * 2", "42\n"),
        // `_` is the last value shown.
        shows("_ + 1", "43\n"),
        shows("None", ""),
        shows("print('p')", "p\n"),
        shows("x * 2;", ""),
        shows("x * 2 ; # quiet", ""),
        shows("x * 2  # not quiet;", "42\n"),
        // Only the last statement, and only at top level.
        shows("x\nfor i in range(3):\n    i\n'é' * 2", "'éé'\n"),
        shows("if x:\n    x", ""),
        shows(
            "class Bad:\n    def __repr__(self):\n        raise ValueError('no repr here')\nBad()",
            "<repr failed: ValueError: no repr here>\n",
        ),
        shows(
            "class Empty:\n    def __repr__(self):\n        raise KeyError\nEmpty()",
            "<repr failed: KeyError>\n",
        ),
    ] {
        let out = ok(&mut c, &s, code).await;
        assert_eq!(out.stdout, want, "{env:?}: {code}");
    }
    // An error in the last expression is the cell's, with the user's line.
    let out = c.execute_collect(&s, "y = 1\n\n1 / (y - 1)").await.unwrap();
    assert_eq!(out.result.status, Status::Error, "{:?}", out.result);
    let e = out.result.error.as_ref().unwrap();
    assert_eq!(
        (e.kind.as_str(), e.line),
        ("ZeroDivisionError", Some(3)),
        "{e:?}"
    );
    assert!(
        e.traceback.as_deref().unwrap_or("").contains("line 3"),
        "{e:?}"
    );
    // The repr is output like any other: bounded by the stdout cap, counted exactly.
    let out = ok(&mut c, &s, "'x' * 5000").await;
    assert_eq!(out.result.stdout.seen, 5003, "{env:?}");
    assert_eq!(out.result.stdout.kept, STDOUT_CAP);
    assert!(out.result.stdout.truncated);
    assert_eq!(
        out.stdout,
        format!("'{}", "x".repeat(STDOUT_CAP as usize - 1))
    );
    c.close(&s).await.unwrap();

    // Turned off on Open: every cell of the session prints only what it prints.
    let s = open(&mut c, "python", env, Some(false)).await;
    assert_eq!(ok(&mut c, &s, "x = 21\nx * 2").await.stdout, "");
    assert_eq!(ok(&mut c, &s, "x * 2").await.stdout, "");
    assert_eq!(ok(&mut c, &s, "print(x)\nx").await.stdout, "21\n");
    c.close(&s).await.unwrap();
    // And on Run; explicitly on is the default.
    let out = run(&mut c, "python", env, "21 * 2", Some(false)).await;
    assert_eq!((out.result.status, out.stdout.as_str()), (Status::Ok, ""));
    let out = run(&mut c, "python", env, "21 * 2", Some(true)).await;
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, "42\n")
    );
    let out = run(&mut c, "python", env, "21 * 2", None).await;
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, "42\n")
    );
}

#[tokio::test]
async fn eryx_shows_the_last_expression_unless_turned_off() {
    let d = daemon();
    python_engine(&d, None).await;
    // Top-level await: the async path shows the last expression too.
    let mut c = d.client().await;
    let code = "import asyncio\nasync def f():\n    return 7\nawait f()";
    let out = run(&mut c, "python", None, code, None).await;
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, "7\n"),
        "{:?}",
        out.result
    );
    let out = run(&mut c, "python", None, code, Some(false)).await;
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, ""),
        "{:?}",
        out.result
    );
}

#[tokio::test]
async fn pydata_shows_the_last_expression_unless_turned_off() {
    if !pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "/usr/bin/python3 cannot import numpy (scripts/setup.sh installs it)"
        )
    }
    let d = daemon();
    python_engine(&d, Some("pydata")).await;
}

#[tokio::test]
async fn r_auto_prints_visible_values_unless_turned_off() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "r", None, None).await;
    assert_eq!(ok(&mut c, &s, "x <- 21\nx * 2").await.stdout, "[1] 42\n");
    assert_eq!(ok(&mut c, &s, "invisible(x)").await.stdout, "");
    c.close(&s).await.unwrap();
    let s = open(&mut c, "r", None, Some(false)).await;
    assert_eq!(ok(&mut c, &s, "x <- 21\nx * 2\nx").await.stdout, "");
    assert_eq!(ok(&mut c, &s, "print(x * 2)").await.stdout, "[1] 42\n");
    c.close(&s).await.unwrap();
    let out = run(&mut c, "r", None, "6 * 7", Some(false)).await;
    assert_eq!((out.result.status, out.stdout.as_str()), (Status::Ok, ""));
    let out = run(&mut c, "r", None, "6 * 7", None).await;
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, "[1] 42\n")
    );
}
