//! Rich output (`rich_output` on `Open` and `Run`) through a real sandcelld, for each engine:
//! the last expression's value as a `result` bundle through the display protocol
//! (`_repr_html_`, `_repr_mimebundle_`), `sandcell.display(...)` as `display` bundles, in
//! order with the output frames (one `seq` for both); pydata's matplotlib figures as valid
//! PNG bundles besides the file, IPython's `display()`; R's printed values as text/plain;
//! the budget: a bundle over the 512 KiB cap, or over what is left of the cell's stdout
//! budget, replaced by its text/plain with a note, and the exact seen/kept counts of
//! `CellResult.displays`. Without `rich_output` nothing changes (no display frames at all).

use crate::common;

use common::{Daemon, pydata_available, r_available};
use sandcell_client::{Client, Collected, Frame, Limits, OpenParams, RunParams, Status};
use sandcell_proto::cell::Stream;
use sandcell_proto::kernel::{Display, DisplayKind};
use sandcell_testing::b64decode;

/// The stdout cap of the daemon these tests start, bytes.
const STDOUT_CAP: u64 = 64 * 1024;

fn daemon() -> Daemon {
    let cap = STDOUT_CAP.to_string();
    let mut env = vec![("SANDCELL_MAX_STDOUT_BYTES", cap.as_str())];
    if r_available() {
        env.push(("SANDCELL_LANGUAGES", "python,r"));
    }
    Daemon::start(&env)
}

async fn open(c: &mut Client, language: &str, env: Option<&str>) -> String {
    open_limited(c, language, env, None).await
}

/// [`open`] with lower `limits`.
async fn open_limited(
    c: &mut Client,
    language: &str,
    env: Option<&str>,
    limits: Option<Limits>,
) -> String {
    c.open_with(&OpenParams {
        language: language.into(),
        limits,
        detached_idle_seconds: None,
        environment: env.map(str::to_owned),
        host_calls: None,
        display_last_expression: None,
        rich_output: Some(true),
        egress: None,
    })
    .await
    .expect("open")
    .session
}

/// Runs `code` in session `s`, returning every frame after `started` (result last).
async fn frames(c: &mut Client, s: &str, code: &str) -> Vec<Frame> {
    c.execute(s, code).await.expect("execute");
    let mut out = Vec::new();
    loop {
        let f = c.next_frame().await.expect("frame");
        let last = f.result.is_some();
        if f.started.is_none() {
            out.push(f);
        }
        if last {
            return out;
        }
    }
}

fn displays(fs: &[Frame]) -> Vec<&Display> {
    fs.iter().filter_map(|f| f.display.as_ref()).collect()
}

/// The cell's stdout and stderr text, each joined in frame order.
fn stdout_stderr(fs: &[Frame]) -> (String, String) {
    let (mut out, mut err) = (String::new(), String::new());
    for o in fs.iter().filter_map(|f| f.output.as_ref()) {
        match o.stream {
            Stream::Stdout => out.push_str(&o.text),
            Stream::Stderr => err.push_str(&o.text),
        }
    }
    (out, err)
}

/// Checks a cell that showed `n` bundles, bundle `i`'s text/plain `shown(i)`, each followed by
/// `out(i)` on stdout and `err(i)` on stderr (empty: nothing): every bundle comes after all
/// the text printed before it and before any printed after it.
fn assert_interleaved(
    fs: &[Frame],
    n: usize,
    shown: impl Fn(usize) -> String,
    out: impl Fn(usize) -> String,
    err: impl Fn(usize) -> String,
) {
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let (mut seen, mut text) = (0usize, [String::new(), String::new()]);
    let check_segment = |seen: usize, text: &mut [String; 2]| {
        if seen > 0 {
            let want = [out(seen - 1), err(seen - 1)];
            assert_eq!(
                *text,
                want,
                "the text between bundles {} and {seen}",
                seen - 1
            );
        } else {
            assert_eq!(
                *text,
                [String::new(), String::new()],
                "text before bundle 0"
            );
        }
        *text = [String::new(), String::new()];
    };
    for f in fs {
        if let Some(o) = &f.output {
            text[usize::from(o.stream == Stream::Stderr)].push_str(&o.text);
        }
        if let Some(d) = &f.display {
            if seen == n {
                break;
            }
            check_segment(seen, &mut text);
            assert_eq!(self::text(d), shown(seen), "bundle {seen}");
            seen += 1;
        }
    }
    check_segment(seen, &mut text);
    assert_eq!(seen, n, "bundles shown");
}

fn text(d: &Display) -> &str {
    d.data["text/plain"].as_str().unwrap()
}

fn valid_png(b: &[u8]) -> bool {
    b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 100 && b.ends_with(b"IEND\xaeB`\x82")
}

/// What both Python engines must do, the same way.
async fn python_engine(d: &Daemon, env: Option<&str>) {
    let mut c = d.client().await;
    let s = open(&mut c, "python", env).await;
    let fs = frames(
        &mut c,
        &s,
        "class H:\n    def _repr_html_(self): return '<b>h</b>'\n    def __repr__(self): return 'H()'\n\
         from sandcell import display\nprint('before')\ndisplay(H())\nprint('after')\nH()",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    // Order: output, display, output, result; one seq for both kinds of frame.
    let kinds: Vec<&str> = fs
        .iter()
        .map(|f| match (&f.output, &f.display, &f.result) {
            (Some(_), _, _) => "output",
            (_, Some(d), _) => d.kind.as_str(),
            _ => "result_frame",
        })
        .collect();
    let seqs: Vec<u64> = fs
        .iter()
        .filter_map(|f| {
            f.output
                .as_ref()
                .map(|o| o.seq)
                .or(f.display.as_ref().map(|d| d.seq))
        })
        .collect();
    assert_eq!(
        kinds,
        ["output", "display", "output", "result", "result_frame"],
        "{fs:?}"
    );
    assert_eq!(seqs, [0, 1, 2, 3]);
    let ds = displays(&fs);
    assert_eq!(ds[0].kind, DisplayKind::Display);
    assert_eq!(ds[1].kind, DisplayKind::Result);
    for d in &ds {
        assert_eq!(d.data["text/html"], "<b>h</b>");
        assert_eq!(text(d), "H()");
    }
    // stdout carries only what the cell printed; the bundles are counted apart, exactly.
    assert_eq!(r.stdout.kept, "before\nafter\n".len() as u64);
    let bundle_bytes: u64 = ds
        .iter()
        .map(|d| serde_json::to_vec(&d.data).unwrap().len() as u64)
        .sum();
    let st = r.displays.expect("displays counted");
    assert_eq!(
        (st.seen, st.kept, st.truncated),
        (bundle_bytes, bundle_bytes, false)
    );

    // Displays and the text printed around them, 300 times back to back in one cell: each
    // bundle between exactly the text printed before and after it, on both streams (a native
    // worker's text comes through raw pipes, its bundles through the reply pipe).
    let fs = frames(
        &mut c,
        &s,
        "import sys\nfrom sandcell import display\n\
         for i in range(300):\n    display(i)\n    print('p%d' % i)\n    \
         sys.stderr.write('e%d\\n' % i)",
    )
    .await;
    assert_interleaved(
        &fs,
        300,
        |i| format!("{i}"),
        |i| format!("p{i}\n"),
        |i| format!("e{i}\n"),
    );

    // A bundle over the cap: text/plain only, with a note, never a cut image.
    let fs = frames(
        &mut c,
        &s,
        "from sandcell import display\n\
         display({'text/plain': 'big', 'image/png': 'A' * (600 * 1024)}, raw=True)\n7",
    )
    .await;
    let ds = displays(&fs);
    assert_eq!(ds.len(), 2, "{ds:?}");
    assert_eq!(ds[0].data.len(), 1);
    assert_eq!(text(ds[0]), "big");
    assert!(
        ds[0].note.as_deref().unwrap_or("").contains("cap"),
        "{:?}",
        ds[0]
    );
    assert_eq!(text(ds[1]), "7");

    // A binary type's value that is not base64 is left out of its bundle (the daemon would
    // take the bundle for a forged frame); base64 with line breaks is kept.
    let fs = frames(
        &mut c,
        &s,
        "from sandcell import display\n\
         display({'text/plain': 'bad', 'image/png': 'not base64!', 'application/pdf': 'QQ='}, raw=True)\n\
         display({'text/plain': 'good', 'image/png': 'iVBO\\nRw0K\\n', 'image/gif': b'GIF89a'}, raw=True)\n8",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 3, "{ds:?}");
    assert_eq!((text(ds[0]), ds[0].data.len()), ("bad", 1), "{:?}", ds[0]);
    assert_eq!(ds[1].data["image/png"], "iVBO\nRw0K\n");
    assert_eq!(ds[1].data["image/gif"], "R0lGODlh");
    assert_eq!(text(ds[2]), "8");

    // Metadata travels with its bundle (an image's width from a `_repr_png_` tuple, a
    // display call's `metadata`) and is counted with it; metadata that is not JSON is left
    // out, the bundle kept.
    let fs = frames(
        &mut c,
        &s,
        "from sandcell import display\n\
         class P:\n    def _repr_png_(self): return (b'PNG', {'width': 20})\n\
         display(P(), metadata={'isolated': True})\n\
         display({'text/plain': 'odd'}, raw=True, metadata={'a': float('nan')})\nP()",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 3, "{ds:?}");
    assert_eq!(ds[0].data["image/png"], "UE5H");
    assert_eq!(ds[0].metadata["image/png"]["width"], 20, "{:?}", ds[0]);
    assert_eq!(ds[0].metadata["isolated"], true, "{:?}", ds[0]);
    assert!(ds[1].metadata.is_empty(), "{:?}", ds[1]);
    assert_eq!(ds[2].metadata["image/png"]["width"], 20, "{:?}", ds[2]);
    let counted: u64 = ds
        .iter()
        .map(|d| {
            let md = if d.metadata.is_empty() {
                0
            } else {
                serde_json::to_vec(&d.metadata).unwrap().len()
            };
            (serde_json::to_vec(&d.data).unwrap().len() + md) as u64
        })
        .sum();
    let st = r.displays.expect("displays counted");
    assert_eq!((st.seen, st.kept), (counted, counted));

    // Over what is left of the stdout budget: the text/plain instead.
    let fs = frames(
        &mut c,
        &s,
        &format!(
            "print('x' * {})\nfrom sandcell import display\n\
             display({{'text/plain': 'small', 'text/html': 'y' * 4000}}, raw=True)",
            STDOUT_CAP - 1000
        ),
    )
    .await;
    let ds = displays(&fs);
    assert_eq!(ds.len(), 1);
    assert_eq!(ds[0].data.len(), 1, "{:?}", ds[0].note);
    assert!(ds[0].note.as_deref().unwrap().contains("budget"));
    let r = fs.last().unwrap().result.as_ref().unwrap();
    let st = r.displays.unwrap();
    assert!(st.truncated && st.seen > 4000 && st.kept < 100, "{st:?}");

    // A display method that raises is left out of the bundle and named on stderr; the other
    // methods still count. `display_id` gives a handle whose update is a new display, as
    // IPython's DisplayHandle (without replacing the earlier one).
    let fs = frames(
        &mut c,
        &s,
        "class B:\n    def _repr_html_(self): raise ValueError('no html')\n\
         \x20   def _repr_markdown_(self): return '*b*'\n    def __repr__(self): return 'B()'\n\
         from sandcell import display\nh = display(1, display_id=True)\nh.update(2)\n\
         print(type(h).__name__, h.display_id == display('x', display_id=h.display_id).display_id)\nB()",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    let texts: Vec<&str> = ds.iter().map(|d| text(d)).collect();
    assert_eq!(texts, ["1", "2", "'x'", "B()"], "{ds:?}");
    let b = ds[3];
    assert_eq!(
        b.data.get("text/markdown").and_then(|v| v.as_str()),
        Some("*b*")
    );
    assert!(!b.data.contains_key("text/html"), "{b:?}");
    let (out, err) = stdout_stderr(&fs);
    assert_eq!(out, "DisplayHandle True\n");
    assert!(
        err.contains("B._repr_html_ raised ValueError: no html"),
        "{err:?}"
    );

    // A carriage return sends the line at once, as CPython's line buffering does (a progress
    // line that rewrites itself), without waiting for a newline or the cell's end.
    let fs = frames(
        &mut c,
        &s,
        "import time\nprint('10%', end='\\r')\ntime.sleep(0.5)\nprint('100%')",
    )
    .await;
    let outs: Vec<&str> = fs
        .iter()
        .filter_map(|f| f.output.as_ref().map(|o| o.text.as_str()))
        .collect();
    assert_eq!(outs, ["10%\r", "100%\n"], "{fs:?}");
    c.close(&s).await.unwrap();

    // Without rich_output: no display frames, the value on stdout as before.
    c.run_with(&RunParams {
        language: "python".into(),
        code: "from sandcell import display\ndisplay(1)\n2".into(),
        limits: None,
        environment: env.map(str::to_owned),
        host_calls: None,
        display_last_expression: None,
        rich_output: None,
        egress: None,
    })
    .await
    .unwrap();
    let out: Collected = c.finish(|_| {}).await.unwrap();
    assert!(out.displays.is_empty());
    assert_eq!(out.stdout, "1\n2\n");
    assert!(out.result.displays.is_none());
}

#[tokio::test]
async fn eryx_sends_display_bundles() {
    let d = daemon();
    python_engine(&d, None).await;
}

/// A native worker's display line may ask for a `displayed` answer; one that asks and never
/// reads its request pipe is ended as a protocol violation once the answers waiting for it
/// pass their bound, and the daemon serves on.
#[tokio::test]
async fn a_worker_asking_for_answers_it_never_reads_is_ended() {
    if !pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "/usr/bin/python3 cannot import numpy (scripts/setup.sh installs it)"
        )
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "python", Some("pydata")).await;
    let fs = frames(
        &mut c,
        &s,
        "import os\n\
         line = b'{\"t\":\"display\",\"cell\":1,\"kind\":\"display\",\"data\":{\"text/plain\":\"x\"},\"wait\":true}\\n'\n\
         for _ in range(100000):\n    os.write(4, line)",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::WorkerCrashed, "{r:?}");
    assert!(r.session_ended, "{r:?}");
    // A signal handler that displays while the main thread waits for its own answer: the
    // handler's display does not wait (a nested wait could take the outer one's answer and
    // leave it waiting until the wall time).
    let s = open(&mut c, "python", Some("pydata")).await;
    let fs = frames(
        &mut c,
        &s,
        "import os, signal, threading, time\n\
         signal.signal(signal.SIGUSR1, lambda *a: display('tick'))\n\
         stop = False\n\
         def kick():\n    while not stop:\n        os.kill(os.getpid(), signal.SIGUSR1)\n        \
         time.sleep(0.005)\n\
         t = threading.Thread(target=kick)\nt.start()\n\
         for i in range(3000):\n    display(i)\n\
         stop = True\nt.join()\nprint('end')",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert!(
        ds.iter().any(|d| text(d) == "'tick'"),
        "{} bundles",
        ds.len()
    );
    assert_eq!(stdout_stderr(&fs).0, "end\n");
    let s = open(&mut c, "python", Some("pydata")).await;
    let fs = frames(&mut c, &s, "print(6 * 7)").await;
    assert_eq!(stdout_stderr(&fs).0, "42\n");
}

#[tokio::test]
async fn pydata_sends_display_bundles_and_figures() {
    if !pydata_available() {
        sandcell_testing::skip!(
            "pydata",
            "/usr/bin/python3 cannot import numpy (scripts/setup.sh installs it)"
        )
    }
    let d = daemon();
    python_engine(&d, Some("pydata")).await;
    let mut c = d.client().await;
    let s = open(&mut c, "python", Some("pydata")).await;
    let fs = frames(
        &mut c,
        &s,
        "import matplotlib.pyplot as plt\nimport pandas as pd\n\
         from IPython.display import display, Markdown\n\
         plt.plot([1, 3, 2])\nplt.show()\ndisplay(Markdown('**m**'))\n\
         pd.DataFrame({'a': [1, 2]})",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 3, "{ds:?}");
    let png = b64decode(ds[0].data["image/png"].as_str().unwrap()).unwrap();
    assert!(valid_png(&png), "{} bytes", png.len());
    assert!(text(ds[0]).starts_with("<Figure size"));
    assert_eq!(ds[1].data["text/markdown"], "**m**");
    assert_eq!(ds[2].kind, DisplayKind::Result);
    assert!(ds[2].data["text/html"].as_str().unwrap().contains("<table"));
    // The figure is still saved as a file, as without rich output.
    assert!(
        r.files.iter().any(|f| f.name == "plot-1-001.png"),
        "{:?}",
        r.files
    );
    // JSON the daemon cannot read (NaN, 200 levels deep) is left out of its bundle, which
    // keeps its text/plain; the session goes on with its variables.
    let fs = frames(
        &mut c,
        &s,
        "x = 5\nfrom sandcell import display\n\
         display({'text/plain': 'nan', 'application/json': float('nan')}, raw=True)\n\
         deep = d = []\nfor _ in range(200):\n    d.append([])\n    d = d[0]\n\
         display({'text/plain': 'deep', 'application/json': {'a': deep}}, raw=True)\n\
         display({'text/plain': 'fine', 'application/json': {'a': [1.5]}}, raw=True)\nx",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 4, "{ds:?}");
    for (d, t) in ds.iter().zip(["nan", "deep"]) {
        assert_eq!(text(d), t);
        assert_eq!(d.data.len(), 1, "{d:?}");
    }
    assert_eq!(ds[2].data["application/json"]["a"][0], 1.5);
    assert_eq!(text(ds[3]), "5");

    // Figures left open are drawn after the cell's own code, outside its wall time and
    // interrupt: at most 20 per cell (bundle and file from one drawing), the rest closed
    // undrawn with a note.
    let fs = frames(
        &mut c,
        &s,
        "import matplotlib.pyplot as plt
for i in range(25):
    plt.figure(figsize=(1, 1), dpi=20)",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 20, "{ds:?}");
    assert!(ds.iter().all(|d| d.data.contains_key("image/png")));
    let plots = r
        .files
        .iter()
        .filter(|f| f.name.starts_with(&format!("plot-{}-", r.cell)))
        .count();
    assert_eq!(plots, 20, "{:?}", r.files);
    let (_, err) = stdout_stderr(&fs);
    assert!(
        err.contains("5 more open figures closed without being drawn"),
        "{err:?}"
    );
    // Figures shown with plt.show() inside the cell are not counted: 22 shown, 22 drawn.
    let fs = frames(
        &mut c,
        &s,
        "for i in range(22):\n    plt.figure(figsize=(1, 1), dpi=20)\n    plt.show()",
    )
    .await;
    assert_eq!(displays(&fs).len(), 22);
    assert!(!stdout_stderr(&fs).1.contains("closed without"), "{fs:?}");
    c.close(&s).await.unwrap();

    // Drawing a figure left open runs user code (a draw callback): it is bound by the cell's
    // wall time and the session survives it, as the cell's own code would.
    let limits = Limits {
        wall_time_seconds: Some(2.0),
        ..Limits::default()
    };
    let s = open_limited(&mut c, "python", Some("pydata"), Some(limits)).await;
    let fs = frames(
        &mut c,
        &s,
        "import time\nimport matplotlib.pyplot as plt\nkeep = 7\nf = plt.figure()\n\
         f.canvas.mpl_connect('draw_event', lambda e: time.sleep(30))",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Timeout, "{r:?}");
    let out = c.execute_collect(&s, "print(keep)").await.unwrap();
    assert_eq!(out.stdout, "7\n", "{:?}", out.result);
    c.close(&s).await.unwrap();
}

#[tokio::test]
async fn r_sends_printed_values_as_text_bundles() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    }
    let d = daemon();
    let mut c = d.client().await;
    let s = open(&mut c, "r", None).await;
    let fs = frames(&mut c, &s, "x <- 21\nx\ncat('hi\\n')\ninvisible(1)\nx * 2").await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 2, "{fs:?}");
    assert_eq!((ds[0].kind, text(ds[0])), (DisplayKind::Display, "[1] 21"));
    assert_eq!((ds[1].kind, text(ds[1])), (DisplayKind::Result, "[1] 42"));
    assert_eq!(r.stdout.kept, 3, "only cat() on stdout");

    // Printed values and the text around them, 300 times in one cell (of another session:
    // the plot files below are named by cell number): each bundle between the text written
    // before and after it.
    let code: String = (0..300)
        .map(|i| format!("{i}L\ncat('p{i}\\n')\nmessage('e{i}')\n"))
        .collect();
    let s2 = open(&mut c, "r", None).await;
    let fs = frames(&mut c, &s2, &code).await;
    assert_interleaved(
        &fs,
        300,
        |i| format!("[1] {i}"),
        |i| format!("p{i}\n"),
        |i| format!("e{i}\n"),
    );

    // Plots: each page of the default device as an image/png bundle after the cell's output
    // (a valid PNG, byte for byte the file, which is still saved and listed), counted in
    // `displays` exactly.
    let fs = frames(
        &mut c,
        &s,
        "plot(1:10)\ncat('drawn\\n')\nbarplot(c(3, 1, 2))\ninvisible(NULL)",
    )
    .await;
    let r = fs.last().unwrap().result.as_ref().unwrap();
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let ds = displays(&fs);
    assert_eq!(ds.len(), 2, "{fs:?}");
    let first_display = fs.iter().position(|f| f.display.is_some()).unwrap();
    assert!(
        fs[..first_display]
            .iter()
            .any(|f| f.output.as_ref().is_some_and(|o| o.text == "drawn\n")),
        "the pages follow the cell's output: {fs:?}"
    );
    for (i, d) in ds.iter().enumerate() {
        let name = format!("plot-2-{:03}.png", i + 1);
        assert_eq!(d.kind, DisplayKind::Display);
        assert_eq!(text(d), format!("<R plot 480x480: {name}>"));
        let png = b64decode(d.data["image/png"].as_str().unwrap()).unwrap();
        assert!(valid_png(&png), "{} bytes", png.len());
        let f = r
            .files
            .iter()
            .find(|f| f.name == name)
            .expect("the file too");
        assert_eq!(f.size, png.len() as u64);
        let mut got = Vec::new();
        c.get_file(&s, &name, &mut got).await.unwrap();
        assert_eq!(got, png);
    }
    let bundle_bytes: u64 = ds
        .iter()
        .map(|d| serde_json::to_vec(&d.data).unwrap().len() as u64)
        .sum();
    let st = r.displays.expect("displays counted");
    assert_eq!((st.seen, st.kept), (bundle_bytes, bundle_bytes));

    // IRkernel's size options, as R notebooks set them: 4 x 3 inches at 100 ppi.
    let fs = frames(
        &mut c,
        &s,
        "options(repr.plot.width = 4, repr.plot.height = 3, repr.plot.res = 100)
plot(1:3)",
    )
    .await;
    let ds = displays(&fs);
    assert_eq!(ds.len(), 1, "{ds:?}");
    assert!(
        text(ds[0]).starts_with("<R plot 400x300:"),
        "{:?}",
        text(ds[0])
    );
    c.close(&s).await.unwrap();
}

/// sandcellctl run --rich on an R file: the plot's text/plain on standard output and, on
/// standard error, that it carries an image/png; --json gives the whole display frame.
#[tokio::test]
async fn sandcellctl_shows_r_plots_and_values() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        )
    }
    let ctl = common::bin_dir().join("sandcellctl");
    if !ctl.exists() {
        sandcell_testing::skip!(
            "built",
            "{} not built (cargo build -p sandcell-client)",
            ctl.display()
        );
    }
    let d = daemon();
    let work = tempfile::tempdir().unwrap();
    let code = work.path().join("cell.R");
    std::fs::write(&code, "plot(1:3)\n6 * 7\n").unwrap();
    let run = |json: bool| {
        let mut cmd = std::process::Command::new(&ctl);
        cmd.arg("--socket").arg(&d.socket);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.arg("run").arg("--rich").arg(&code).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (out, err) = run(false);
    assert_eq!(out, "[1] 42\n<R plot 480x480: plot-1-001.png>\n", "{err}");
    assert!(
        err.contains("display also carries image/png (see --json)"),
        "{err}"
    );
    let (out, _) = run(true);
    let frames: Vec<Frame> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a frame per line"))
        .collect();
    let ds = displays(&frames);
    assert_eq!(ds.len(), 2, "{out}");
    assert_eq!(ds[0].kind, DisplayKind::Result);
    let png = b64decode(ds[1].data["image/png"].as_str().unwrap()).unwrap();
    assert!(valid_png(&png));
}
