//! `Complete` and `Help` through a real sandcelld, for each engine (Eryx `python`, native
//! `pydata`, `r`): matches and the replaced range at a cursor (module names after `import`,
//! attributes, R's own completion), help text for the name at the cursor or the call it is
//! in; not a cell (cell numbers, `_` and the namespace stay as they were); bounds (oversized
//! code, a cursor past the end, detail out of range) as typed errors; a slow `__getattr__`
//! runs into the time budget and the session goes on; `SessionBusy` while a cell runs.

use crate::common;

use common::cells::{daemon, ok, open};
use common::{Daemon, pydata_available, r_available};
use sandcell_client::{Client, Error, KernelError, Status};
use std::time::{Duration, Instant};

/// What both Python engines must do.
async fn python_behaviour(d: &Daemon, environment: Option<&str>) {
    let what = environment.unwrap_or("python");
    let mut c = d.client().await;
    let s = open(&mut c, "python", environment).await;
    let first = ok(
        &mut c,
        &s,
        "import os\ndef twice(x):\n    \"Twice x.\"\n    return 2 * x\n\nclass Slow:\n    def __getattr__(self, name):\n        import time\n        time.sleep(100)\n\nslow = Slow()\nvalue_one = 1\nvalue_two = 2\n41\n",
    )
    .await;

    // Module names after import, with the range of the partial name.
    let r = c.complete(&s, "import o", None).await.expect("complete");
    assert!(r.matches.iter().any(|m| m == "os"), "{what}: {r:?}");
    assert_eq!((r.cursor_start, r.cursor_end), (7, 8), "{what}");
    assert!(
        r.matches.iter().all(|m| m.starts_with('o')),
        "{what}: {r:?}"
    );

    // The session's names and builtins; a cursor inside the code; characters, not bytes.
    let r = c
        .complete(&s, "é = value_", Some(10))
        .await
        .expect("complete");
    assert_eq!(r.matches, ["value_one", "value_two"], "{what}");
    assert_eq!((r.cursor_start, r.cursor_end), (4, 10), "{what}");
    let r = c.complete(&s, "pri", None).await.expect("complete pri");
    assert!(r.matches.iter().any(|m| m == "print"), "{what}: {r:?}");
    let r = c
        .complete(&s, "os.pa\nx = 1", Some(5))
        .await
        .expect("complete attribute");
    assert!(r.matches.iter().any(|m| m == "os.path"), "{what}: {r:?}");
    assert_eq!((r.cursor_start, r.cursor_end), (0, 5), "{what}");

    // Help for the name at the cursor, and for the call the cursor is in.
    let h = c.help(&s, "print", None, None).await.expect("help");
    assert!(h.found, "{what}: {h:?}");
    let text = h.data["text/plain"].as_str().unwrap();
    assert!(text.contains("Signature: print("), "{what}: {text}");
    assert!(text.contains("Docstring:"), "{what}: {text}");
    let h = c
        .help(&s, "os.path.join(a, ", None, None)
        .await
        .expect("help in a call");
    assert!(h.found, "{what}: {h:?}");
    let text = h.data["text/plain"].as_str().unwrap();
    assert!(text.contains("os.path.join(a, *p)"), "{what}: {text}");
    let h = c
        .help(&s, "y = twice", None, Some(1))
        .await
        .expect("help with source");
    let text = h.data["text/plain"].as_str().unwrap();
    assert!(text.contains("Twice x."), "{what}: {text}");
    assert!(
        text.contains("return 2 * x"),
        "{what}: detail 1 shows the cell's source: {text}"
    );
    let h = c
        .help(&s, "no_such_name_here", None, None)
        .await
        .expect("help not found");
    assert!(!h.found, "{what}: {h:?}");

    // A completion that reaches a __getattr__ sleeping 100 s: the budget (2 s) ends it, the
    // answer is empty and comes in time, and the session goes on.
    let t0 = Instant::now();
    let r = c.complete(&s, "slow.x", None).await.expect("slow complete");
    assert!(r.matches.is_empty(), "{what}: {r:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "{what}: {:?}",
        t0.elapsed()
    );

    // Not a cell: the next cell has the next number and `_` is still the first cell's 41.
    let out = ok(&mut c, &s, "print(_, value_one)").await;
    assert_eq!(out.stdout.trim_end(), "41 1", "{what}");
    assert_eq!(
        out.cell,
        first.cell + 1,
        "{what}: a query took a cell number"
    );

    bounds(d, &mut c, &s, what).await;
    busy(d, &mut c, &s, "import time\ntime.sleep(3)\n", what).await;
    c.close(&s).await.unwrap();
}

/// Typed errors for out-of-bounds parameters (any engine: checked before the worker).
async fn bounds(_d: &Daemon, c: &mut Client, s: &str, what: &str) {
    let big = "x".repeat(64 * 1024 + 1);
    match c.complete(s, &big, None).await {
        Err(Error::Kernel(KernelError::LimitExceeded { limit, .. })) => {
            assert_eq!(limit, "max_source_bytes", "{what}")
        }
        other => panic!("{what}: oversized code: {other:?}"),
    }
    match c.complete(s, "abc", Some(4)).await {
        Err(Error::Kernel(KernelError::InvalidParameter { parameter, .. })) => {
            assert_eq!(parameter, "cursor", "{what}")
        }
        other => panic!("{what}: cursor past the end: {other:?}"),
    }
    match c.help(s, "é", Some(2), None).await {
        Err(Error::Kernel(KernelError::InvalidParameter { parameter, .. })) => {
            assert_eq!(parameter, "cursor", "{what}: the cursor counts characters")
        }
        other => panic!("{what}: cursor past the end: {other:?}"),
    }
    match c.help(s, "x", None, Some(2)).await {
        Err(Error::Kernel(KernelError::InvalidParameter { parameter, .. })) => {
            assert_eq!(parameter, "detail", "{what}")
        }
        other => panic!("{what}: detail 2: {other:?}"),
    }
    // Many matches are capped, and say so.
    let r = c.complete(s, "", None).await.expect("empty code");
    assert!(r.matches.len() <= 500, "{what}");
}

/// `SessionBusy` while a cell runs (asked from a second connection of the owner).
async fn busy(d: &Daemon, c: &mut Client, s: &str, cell: &str, what: &str) {
    c.execute(s, cell).await.expect("busy cell");
    let mut other = d.client().await;
    let mut seen = 0;
    for _ in 0..40 {
        let a = other.complete(s, "pri", None).await;
        let b = other.help(s, "print", None, None).await;
        for e in [a.err(), b.err()].into_iter().flatten() {
            match e {
                Error::Kernel(KernelError::SessionBusy { .. }) => seen += 1,
                e => panic!("{what}: {e}"),
            }
        }
        if seen >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen >= 2, "{what}: no SessionBusy during a 3 s cell");
    let r = c.finish(|_| {}).await.expect("busy cell ends");
    assert_eq!(r.result.status, Status::Ok, "{what}");
    let r = c.complete(s, "pri", None).await.expect("complete after");
    assert!(r.matches.iter().any(|m| m == "print"), "{what}: {r:?}");
}

#[tokio::test]
async fn python_eryx_completes_and_helps() {
    let d = daemon();
    python_behaviour(&d, None).await;
}

#[tokio::test]
async fn pydata_completes_and_helps() {
    if !pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "/usr/bin/python3 cannot import numpy and pandas (scripts/setup.sh installs them)"
        )
    }
    let d = daemon();
    python_behaviour(&d, Some("pydata")).await;
    // Attributes of an imported package's objects, as numpy users type them.
    let mut c = d.client().await;
    let s = open(&mut c, "python", Some("pydata")).await;
    ok(&mut c, &s, "import numpy as np\n").await;
    let r = c.complete(&s, "np.zer", None).await.expect("complete np");
    assert!(r.matches.iter().any(|m| m == "np.zeros"), "{r:?}");
    let h = c.help(&s, "np.zeros(", None, None).await.expect("help np");
    assert!(h.found, "{h:?}");
    c.close(&s).await.unwrap();
}

#[tokio::test]
async fn r_completes_and_helps() {
    if !r_available() {
        sandcell_testing::skip!("r", "R is not installed (scripts/setup.sh installs r-base)")
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "r", None).await;
    let first = ok(
        &mut c,
        &s,
        "df <- data.frame(alpha = 1, beta = 2)\nvalue_one <- 1\n",
    )
    .await;
    let r = c.complete(&s, "pri", None).await.expect("complete");
    assert!(r.matches.iter().any(|m| m == "print"), "{r:?}");
    assert_eq!((r.cursor_start, r.cursor_end), (0, 3));
    let r = c
        .complete(&s, "x <- 1\ny <- df$al", None)
        .await
        .expect("complete $");
    assert_eq!(r.matches, ["df$alpha"]);
    assert_eq!((r.cursor_start, r.cursor_end), (12, 17));
    let r = c.complete(&s, "value_o", None).await.expect("complete");
    assert_eq!(r.matches, ["value_one"]);

    let h = c.help(&s, "print(", None, None).await.expect("help");
    assert!(h.found, "{h:?}");
    let text = h.data["text/plain"].as_str().unwrap();
    assert!(text.contains("print(x, ...)"), "{text}");
    assert!(text.contains("Description"), "R's help page: {text}");
    let h = c.help(&s, "no_such_thing", None, None).await.expect("help");
    assert!(!h.found, "{h:?}");

    // Not a cell: .Last.value and numbering stay.
    let out = ok(&mut c, &s, "cat(value_one, '\\n')").await;
    assert_eq!(out.cell, first.cell + 1, "a query took a cell number");
    assert_eq!(out.stdout.trim(), "1");

    bounds(&d, &mut c, &s, "r").await;
    busy(&d, &mut c, &s, "Sys.sleep(3)", "r").await;
    c.close(&s).await.unwrap();
}
