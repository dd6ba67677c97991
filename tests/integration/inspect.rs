//! `Inspect` through a real sandcelld, for each engine (Eryx `python`, native `pydata`, `r`):
//! the user's variables with type, size, shape and a short repr; not a cell (cell numbers and
//! the namespace stay as they were); a failing repr gives a placeholder, a slow one runs into
//! the time budget and the session goes on; `SessionBusy` while a cell runs; `max_items`
//! bounds and truncation.

use crate::common;

use common::cells::{daemon, ok, open};
use common::{Daemon, pydata_available, r_available};
use sandcell_client::{Error, KernelError, Status};
use sandcell_proto::kernel::Variable;
use std::time::{Duration, Instant};

fn find<'a>(vars: &'a [Variable], name: &str) -> &'a Variable {
    vars.iter().find(|v| v.name == name).unwrap_or_else(|| {
        let names: Vec<_> = vars.iter().map(|v| v.name.as_str()).collect();
        panic!("{name} not listed among {names:?}")
    })
}

fn names(vars: &[Variable]) -> Vec<&str> {
    vars.iter().map(|v| v.name.as_str()).collect()
}

/// What every engine must do: placeholders, the budget, numbering, SessionBusy, max_items.
/// `setup` binds `x` (41), `bad` (a value whose repr fails) and `y_slow` (whose repr sleeps
/// 100 s, and after which, in name order, only `zz` comes); `busy` runs about 3 s.
async fn common_behaviour(
    d: &Daemon,
    language: &str,
    environment: Option<&str>,
    setup: &str,
    failed: &str,
    busy: &str,
    print_x: &str,
) {
    let mut c = d.client().await;
    let s = open(&mut c, language, environment).await;
    let first = ok(&mut c, &s, setup).await;

    // Limits on max_items.
    match c.inspect(&s, Some(0)).await {
        Err(Error::Kernel(KernelError::InvalidParameter { parameter, .. })) => {
            assert_eq!(parameter, "max_items")
        }
        other => panic!("max_items 0: {other:?}"),
    }
    match c.inspect(&s, Some(1001)).await {
        Err(Error::Kernel(KernelError::LimitExceeded { limit, max, .. })) => {
            assert_eq!((limit.as_str(), max), ("max_items", 1000))
        }
        other => panic!("max_items 1001: {other:?}"),
    }

    // The slow repr runs into the budget (4 s), the names after it are skipped, and the
    // answer comes well before the repr's 100 s.
    let t0 = Instant::now();
    let (vars, truncated) = c.inspect(&s, None).await.expect("inspect");
    let took = t0.elapsed();
    let mut sorted = names(&vars);
    sorted.sort_unstable();
    assert_eq!(names(&vars), sorted, "{language}: not in name order");
    assert!(took < Duration::from_secs(30), "{language}: {took:?}");
    assert!(!truncated, "{language}");
    for v in &vars {
        assert!(!v.name.starts_with('_'), "{language}: {}", v.name);
        assert_eq!(v.check(), Ok(()), "{language}: {v:?}");
    }
    let x = find(&vars, "x");
    assert!(x.repr.contains("41"), "{language}: {x:?}");
    assert!(x.size_bytes.is_some_and(|n| n > 0), "{language}: {x:?}");
    assert_eq!(find(&vars, "bad").repr, failed, "{language}");
    assert_eq!(find(&vars, "y_slow").repr, "<repr timed out>", "{language}");
    assert_eq!(
        find(&vars, "zz").repr,
        "<repr skipped: time budget used up>",
        "{language}"
    );

    // Truncation: the first names in name order.
    let (first_only, truncated) = c.inspect(&s, Some(1)).await.expect("inspect 1");
    assert_eq!(names(&first_only), names(&vars)[..1], "{language}");
    assert!(truncated, "{language}");

    // The session goes on, the variables are as they were and Inspect used no cell number.
    let out = ok(&mut c, &s, print_x).await;
    assert_eq!(out.stdout.trim_end(), "41", "{language}");
    assert_eq!(
        out.cell,
        first.cell + 1,
        "{language}: Inspect took a cell number"
    );

    // SessionBusy while a cell runs (asked from a second connection of the owner).
    c.execute(&s, busy).await.expect("busy cell");
    let mut other = d.client().await;
    let mut busy_seen = false;
    for _ in 0..40 {
        match other.inspect(&s, None).await {
            Err(Error::Kernel(KernelError::SessionBusy { cell, .. })) => {
                assert_eq!(cell, out.cell + 1, "{language}");
                busy_seen = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("{language}: {e}"),
        }
    }
    assert!(busy_seen, "{language}: no SessionBusy during a 3 s cell");
    let r = c.finish(|_| {}).await.expect("busy cell ends");
    assert_eq!(r.result.status, Status::Ok, "{language}");
    let (vars, _) = c.inspect(&s, None).await.expect("inspect after the cell");
    assert!(vars.iter().any(|v| v.name == "x"), "{language}");
    c.close(&s).await.unwrap();
}

/// A Python cell (both engines) whose variables include a repr that raises and one that
/// sleeps far past the Inspect budget.
const PYTHON_REPR_CELL: &str = "class Bad:\n    def __repr__(self):\n        raise ValueError('no')\n\nclass Slow:\n    def __repr__(self):\n        import time\n        time.sleep(100)\n        return 'slow'\n\nx = 41\nbad = Bad()\ny_slow = Slow()\nzz = 1\n";

#[tokio::test]
async fn python_eryx_lists_variables_and_keeps_the_session() {
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "python", None).await;
    ok(
        &mut c,
        &s,
        "import math\nimport json as j\nn = 3\nname = 'é' * 500\nitems = list(range(1000))\n_hidden = 1\ndef f(): pass\n",
    )
    .await;
    let (vars, truncated) = c.inspect(&s, None).await.expect("inspect");
    assert!(!truncated);
    // Modules, names starting with "_" and Eryx's own helpers are left out.
    assert_eq!(names(&vars), ["f", "items", "n", "name"]);
    assert_eq!(find(&vars, "n").kind, "int");
    assert_eq!(find(&vars, "n").repr, "3");
    let name = find(&vars, "name");
    assert_eq!(name.kind, "str");
    assert!(name.repr.chars().count() <= 200, "{name:?}");
    let items = find(&vars, "items");
    assert_eq!(items.kind, "list");
    assert!(items.repr.starts_with("[0, 1, 2"), "{items:?}");
    assert!(items.repr.len() < 100, "reprlib bounds the list: {items:?}");
    assert_eq!(find(&vars, "f").kind, "function");
    c.close(&s).await.unwrap();

    common_behaviour(
        &d,
        "python",
        None,
        PYTHON_REPR_CELL,
        "<repr failed: ValueError>",
        "import time\ntime.sleep(3)\n",
        "print(x)",
    )
    .await;
}

#[tokio::test]
async fn pydata_lists_numpy_and_pandas_shapes() {
    if !pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "/usr/bin/python3 cannot import numpy and pandas (scripts/setup.sh installs them)"
        )
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "python", Some("pydata")).await;
    ok(
        &mut c,
        &s,
        "import numpy as np\nimport pandas as pd\na = np.zeros((3, 4), dtype=np.int64)\ndf = pd.DataFrame({'a': [1, 2, 3], 'b': [1.5, 2.5, 3.5]})\n",
    )
    .await;
    let (vars, _) = c.inspect(&s, None).await.expect("inspect");
    assert_eq!(names(&vars), ["a", "df"]);
    let a = find(&vars, "a");
    assert_eq!(a.kind, "numpy.ndarray");
    assert_eq!(a.shape.as_deref(), Some(&[3u64, 4][..]));
    assert_eq!(a.size_bytes, Some(96));
    let df = find(&vars, "df");
    assert_eq!(df.kind, "pandas.core.frame.DataFrame");
    assert_eq!(df.shape.as_deref(), Some(&[3u64, 2][..]));
    assert!(df.size_bytes.is_some_and(|n| n >= 48), "{df:?}");
    assert!(df.repr.contains("2.5"), "{df:?}");
    c.close(&s).await.unwrap();

    common_behaviour(
        &d,
        "python",
        Some("pydata"),
        PYTHON_REPR_CELL,
        "<repr failed: ValueError>",
        "import time\ntime.sleep(3)\n",
        "print(x)",
    )
    .await;
}

#[tokio::test]
async fn r_lists_data_frames_and_matrices() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "r", None).await;
    ok(
        &mut c,
        &s,
        "df <- data.frame(a = 1:3, b = c('x', 'y', 'z'))\nm <- matrix(1:6, nrow = 2)\nv <- 5\n.hidden <- 1\n",
    )
    .await;
    let (vars, _) = c.inspect(&s, None).await.expect("inspect");
    assert_eq!(names(&vars), ["df", "m", "v"]);
    let df = find(&vars, "df");
    assert_eq!(df.kind, "data.frame");
    assert_eq!(df.shape.as_deref(), Some(&[3u64, 2][..]));
    assert!(df.repr.starts_with("'data.frame':"), "{df:?}");
    let m = find(&vars, "m");
    assert_eq!(m.kind, "matrix");
    assert_eq!(m.shape.as_deref(), Some(&[2u64, 3][..]));
    let v = find(&vars, "v");
    assert_eq!((v.kind.as_str(), v.repr.as_str()), ("numeric", "num 5"));
    assert!(v.shape.is_none() && v.size_bytes.is_some_and(|n| n > 0));
    // .Last.value is left alone: the next cell's view of it is the last cell's own.
    let out = ok(
        &mut c,
        &s,
        "print(is.null(.Last.value) || !identical(.Last.value, df))",
    )
    .await;
    assert_eq!(out.stdout, "[1] TRUE\n");
    c.close(&s).await.unwrap();

    common_behaviour(
        &d,
        "r",
        None,
        "str.bad <- function(object, ...) stop('no')\nstr.slow <- function(object, ...) Sys.sleep(100)\nx <- 41\nbad <- structure(1, class = 'bad')\ny_slow <- structure(1, class = 'slow')\nzz <- 1\n",
        "<repr failed: simpleError>",
        "Sys.sleep(3)",
        "cat(x, '\\n', sep = '')",
    )
    .await;
}
