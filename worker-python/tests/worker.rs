//! The real worker binary, driven over fds 3 and 4 as the daemon drives it.

mod common;

use std::time::{Duration, Instant};

use common::{Opts, Worker};
use sandcell_proto::worker::{MAX_OUTPUT_CHUNK, SessionState, Stream, WorkerStatus};

#[test]
fn print_output_is_exact_on_both_streams() {
    let mut w = Worker::start();
    let r = w.cell(
        1,
        "import sys\nprint('hello')\nprint('wörld ✓', file=sys.stderr)\nprint(1, 2, sep='-')\n",
    );
    assert_eq!(r.status, WorkerStatus::Ok, "{r:?}");
    assert_eq!(r.stdout, "hello\n1-2\n");
    assert_eq!(r.stderr, "wörld ✓\n");
    assert_eq!(r.state, SessionState::Kept, "{r:?}");
    assert!(r.fuel.unwrap() > 0, "fuel is reported");
}

#[test]
fn the_last_expression_is_shown_unless_the_request_says_display_0() {
    let mut w = Worker::start();
    let r = w.cell(1, "x = 21\nx * 2");
    assert_eq!(
        (r.status, r.stdout.as_str()),
        (WorkerStatus::Ok, "42\n"),
        "{r:?}"
    );
    assert_eq!(w.cell(2, "x * 2;").stdout, "");
    assert_eq!(w.cell(3, "None").stdout, "");
    let r = w.cell(
        4,
        "class B:\n    def __repr__(self):\n        raise ValueError('nope')\nB()",
    );
    assert_eq!(r.status, WorkerStatus::Ok, "{r:?}");
    assert_eq!(r.stdout, "<repr failed: ValueError: nope>\n");
    // The same source again (its code is reused from the compile cache), and without display.
    assert_eq!(w.cell(5, "x * 2").stdout, "42\n");
    assert_eq!(w.cell(6, "x * 2").stdout, "42\n");
    let off = Opts {
        timeout_ms: Some(30_000),
        display: Some(false),
        ..Opts::default()
    };
    for cell in 7..10 {
        let r = w.run(cell, "x * 2", &off);
        assert_eq!(
            (r.status, r.stdout.as_str()),
            (WorkerStatus::Ok, ""),
            "{r:?}"
        );
    }
    // A cell's own displayhook is kept.
    let r = w.cell(
        10,
        "import sys\nsys.displayhook = lambda v: print('hook', v)\nx",
    );
    assert_eq!(r.stdout, "hook 21\n", "{r:?}");
}

#[test]
fn a_session_starts_with_an_empty_namespace() {
    let mut w = Worker::start();
    let r = w.cell(
        1,
        "print(sorted(k for k in globals() if not k.startswith('_')))",
    );
    assert_eq!(r.stdout, "['invoke', 'list_callbacks']\n", "{r:?}");
    let r = w.cell(
        2,
        "import json, statistics\nprint(json.dumps(statistics.mean([1, 2, 3])))",
    );
    assert_eq!(r.stdout, "2\n");
}

#[test]
fn variables_persist_across_cells_including_result() {
    let mut w = Worker::start();
    assert_eq!(
        w.cell(
            1,
            "x = 41\nresult = 'mine'\ndef inc(v):\n    return v + 1\n"
        )
        .status,
        WorkerStatus::Ok
    );
    let r = w.cell(2, "print(inc(x), result)");
    assert_eq!(r.stdout, "42 mine\n", "{r:?}");
}

#[test]
fn exception_reports_the_users_line_and_traceback() {
    let mut w = Worker::start();
    let r = w.cell(1, "a = 1\nb = 0\nc = a / b\n");
    assert_eq!(r.status, WorkerStatus::Error);
    let e = r.err().clone();
    assert_eq!(e.kind, "ZeroDivisionError");
    assert_eq!(e.message, "division by zero");
    assert_eq!(e.line, Some(3));
    let tb = e.traceback.unwrap();
    assert!(tb.contains("\"<cell 1>\", line 3"), "{tb}");
    assert!(tb.contains("c = a / b"), "source line shown: {tb}");
    assert!(!tb.contains("sandcell"), "driver frames hidden: {tb}");
    assert!(
        tb.ends_with("ZeroDivisionError: division by zero\n"),
        "{tb}"
    );

    // A function from an earlier cell raising in a later one.
    w.cell(2, "def f():\n    raise ValueError('boom')\n");
    let r = w.cell(3, "\n\nf()\n");
    let e = r.err().clone();
    assert_eq!(
        (e.kind.as_str(), e.message.as_str(), e.line),
        ("ValueError", "boom", Some(3))
    );
    let tb = e.traceback.unwrap();
    assert!(
        tb.contains("\"<cell 3>\", line 3") && tb.contains("\"<cell 2>\", line 2"),
        "{tb}"
    );
    // Errors keep the session.
    assert_eq!(r.state, SessionState::Kept, "{r:?}");
    assert_eq!(w.cell(4, "print(a)").stdout, "1\n");

    // A syntax error names its line too.
    let r = w.cell(5, "x = 1\ny = (\n");
    assert_eq!(r.err().kind, "SyntaxError");
    assert_eq!(r.err().line, Some(2));
}

#[test]
fn huge_error_message_is_bounded() {
    let mut w = Worker::start();
    let r = w.cell(1, "raise ValueError('x' * 10**7)");
    let e = r.err().clone();
    assert_eq!(e.kind, "ValueError");
    assert!(
        e.message.len() <= sandcell_proto::worker::MAX_ERROR_MESSAGE + 100,
        "{}",
        e.message.len()
    );
    assert!(e.traceback.unwrap().len() <= sandcell_proto::worker::MAX_TRACEBACK + 100);
}

#[test]
fn sys_exit_is_exited_not_a_crash() {
    let mut w = Worker::start();
    w.cell(1, "keep = 7");
    let r = w.cell(
        2,
        "import sys\nprint('bye')\nsys.exit(3)\nprint('not reached')\n",
    );
    assert_eq!(r.status, WorkerStatus::Exited);
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.stdout, "bye\n");
    assert_eq!(w.cell(3, "raise SystemExit").exit_code, Some(0));
    assert_eq!(w.cell(4, "print(keep)").stdout, "7\n");
}

#[test]
fn os_exit_is_exited_not_a_trap_and_the_variables_come_back() {
    let mut w = Worker::start();
    w.cell(1, "keep = 7");
    let r = w.cell(2, "import os\nprint('bye', flush=True)\nos._exit(3)\n");
    assert_eq!(r.status, WorkerStatus::Exited, "{r:?}");
    // WASI preview 2's exit carries success or failure only: 3 reads as 1, and a warning
    // says so.
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    assert!(r.error.is_none(), "{r:?}");
    assert!(r.warnings.iter().any(|w| w.contains("os._exit")), "{r:?}");
    assert_eq!(r.stdout, "bye\n");
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert_eq!(w.cell(3, "import os\nos._exit(0)").exit_code, Some(0));
    assert_eq!(w.cell(4, "print(keep)").stdout, "7\n");
}

#[test]
fn timeout_stops_a_busy_loop_and_restores_variables() {
    let mut w = Worker::start();
    w.cell(
        1,
        "keep = [1, 2, 3]\ndef twice(v):\n    return 2 * v\nimport math as m\n",
    );
    let r = w.run(
        2,
        "while True: pass",
        &Opts {
            timeout_ms: Some(1000),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Timeout, "{r:?}");
    eprintln!(
        "FIGURES timeout_1000ms_busy_loop_done_after_ms={}",
        r.elapsed.as_millis()
    );
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert!(
        r.elapsed < Duration::from_millis(2500),
        "took {:?}",
        r.elapsed
    );
    let r = w.cell(3, "print(keep, twice(21), m.floor(2.5))");
    assert_eq!(r.stdout, "[1, 2, 3] 42 2\n", "{r:?}");
}

#[test]
fn timeout_stops_a_sleep() {
    let mut w = Worker::start();
    w.cell(1, "v = 'kept'");
    let r = w.run(
        2,
        "import time\ntime.sleep(60)",
        &Opts {
            timeout_ms: Some(500),
            ..Opts::default()
        },
    );
    eprintln!(
        "FIGURES timeout_500ms_sleep_done_after_ms={}",
        r.elapsed.as_millis()
    );
    assert_eq!(r.status, WorkerStatus::Timeout);
    assert!(r.elapsed < Duration::from_secs(2), "took {:?}", r.elapsed);
    assert_eq!(w.cell(3, "print(v)").stdout, "kept\n");
}

#[test]
fn fuel_exhaustion_is_reported_and_state_restored() {
    let mut w = Worker::start();
    w.cell(1, "keep = {'a': 1}");
    let r = w.run(
        2,
        "while True: pass",
        &Opts {
            timeout_ms: Some(30_000),
            fuel: Some(50_000_000),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::FuelExhausted, "{r:?}");
    assert!(r.fuel.unwrap() >= 50_000_000, "consumed {:?}", r.fuel);
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert_eq!(w.cell(3, "print(keep['a'])").stdout, "1\n");
    // A cell within its budget reports what it used.
    let r = w.run(
        4,
        "s = sum(range(1000))",
        &Opts {
            timeout_ms: Some(30_000),
            fuel: Some(50_000_000),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Ok);
    assert!(r.fuel.unwrap() > 0 && r.fuel.unwrap() < 50_000_000);
}

fn interrupt_after(w: &mut Worker, cell: u64, code: &str) -> (common::CellRun, Duration) {
    w.send(
        cell,
        code,
        &Opts {
            timeout_ms: Some(120_000),
            ..Opts::default()
        },
    );
    std::thread::sleep(Duration::from_millis(400));
    let t = Instant::now();
    w.sigint();
    let r = w.collect(cell, Duration::from_secs(10));
    (r, t.elapsed())
}

#[test]
fn sigint_ends_a_sleep_quickly_and_the_session_survives() {
    let mut w = Worker::start();
    w.cell(1, "y = 'still here'");
    let (r, after) = interrupt_after(&mut w, 2, "import time\nprint('before')\ntime.sleep(60)\n");
    assert_eq!(r.status, WorkerStatus::Interrupted, "{r:?}");
    eprintln!(
        "FIGURES sigint_sleep_done_after_ms={:.1}",
        after.as_secs_f64() * 1e3
    );
    assert!(
        after < Duration::from_secs(1),
        "Done {after:?} after SIGINT"
    );
    assert_eq!(r.stdout, "before\n");
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert_eq!(w.cell(3, "print(y)").stdout, "still here\n");
}

#[test]
fn sigint_ends_a_busy_loop_quickly() {
    let mut w = Worker::start();
    w.cell(1, "z = 5");
    let (r, after) = interrupt_after(&mut w, 2, "while True: pass");
    assert_eq!(r.status, WorkerStatus::Interrupted, "{r:?}");
    eprintln!(
        "FIGURES sigint_busy_loop_done_after_ms={:.1}",
        after.as_secs_f64() * 1e3
    );
    assert!(
        after < Duration::from_secs(1),
        "Done {after:?} after SIGINT"
    );
    assert_eq!(w.cell(3, "print(z)").stdout, "5\n");
}

#[test]
fn sigint_with_the_longest_timeout_is_still_quick() {
    let mut w = Worker::start();
    w.send(
        1,
        "while True: pass",
        &Opts {
            timeout_ms: Some(u64::MAX),
            ..Opts::default()
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    w.sigint();
    let r = w.collect(1, Duration::from_secs(10));
    eprintln!(
        "FIGURES sigint_busy_loop_24h_timeout_done_after_ms={:.1}",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(r.status, WorkerStatus::Interrupted);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

#[test]
fn sigint_right_after_the_request_still_reaches_that_cell() {
    let mut w = Worker::start();
    w.cell(1, "a = 1");
    let pid = w.child.id() as i32;
    for cell in 2..6 {
        w.send(
            cell,
            "import time\ntime.sleep(30)\na = 2\n",
            &Opts {
                timeout_ms: Some(60_000),
                ..Opts::default()
            },
        );
        let t = Instant::now();
        // As the daemon does: SIGINT at once, then every 250 ms until the cell ends (one that
        // lands before the worker took up the request is dropped with the stale ones).
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let repeat = std::thread::spawn(move || {
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: signalling our own child, which is not reaped before the test ends.
                unsafe { libc::kill(pid, libc::SIGINT) };
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let r = w.collect(cell, Duration::from_secs(10));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        repeat.join().unwrap();
        assert_eq!(r.status, WorkerStatus::Interrupted, "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
    assert_eq!(w.cell(6, "print(a)").stdout, "1\n");
}

#[test]
fn sigint_between_cells_is_ignored() {
    let mut w = Worker::start();
    w.cell(1, "n = 1");
    w.sigint();
    std::thread::sleep(Duration::from_millis(100));
    w.sigint();
    std::thread::sleep(Duration::from_millis(100));
    let r = w.cell(2, "n += 1\nprint(n)");
    assert_eq!(r.status, WorkerStatus::Ok);
    assert_eq!(r.stdout, "2\n");
    assert!(w.child.try_wait().unwrap().is_none());
}

#[test]
fn output_flood_is_bounded_with_exact_drop_counts() {
    let mut w = Worker::start();
    let r = w.run(
        1,
        "print('x' * 10**6)\nimport sys\nsys.stderr.write('e' * 5000);\n",
        &Opts {
            timeout_ms: Some(30_000),
            max_output: Some(1000),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Ok);
    assert_eq!(r.kept(Stream::Stdout), 1000);
    assert_eq!(r.stdout, "x".repeat(1000));
    assert_eq!(r.dropped_stdout, 1_000_001 - 1000);
    assert_eq!(r.kept(Stream::Stderr), 1000);
    assert_eq!(r.dropped_stderr, 4000);
}

#[test]
fn large_output_is_chunked_without_splitting_characters() {
    let mut w = Worker::start();
    let r = w.cell(1, "print('✓' * 100000)");
    assert_eq!(r.status, WorkerStatus::Ok);
    assert_eq!(r.kept(Stream::Stdout), 300_001);
    assert!(r.frames.len() >= 5);
    for (_, data, bytes) in &r.frames {
        assert!(*bytes as usize <= MAX_OUTPUT_CHUNK);
        assert!(!data.contains("\\x"), "no character was split");
    }
    assert_eq!(r.stdout, format!("{}\n", "✓".repeat(100000)));
}

#[test]
fn invalid_utf8_output_is_escaped() {
    let mut w = Worker::start();
    let r = w.cell(1, "import sys\nsys.stdout.buffer.write(b'a\\xffb');\n");
    assert_eq!(r.frames, vec![(Stream::Stdout, "a\\xffb".to_string(), 3)]);
}

#[test]
fn raw_fd_writes_never_reach_the_protocol() {
    let mut w = Worker::start();
    let r = w.cell(
        1,
        "import os\nos.write(1, b'rawmarker1')\nos.write(2, b'rawmarker2')\nprint('ok')\n",
    );
    assert_eq!(r.status, WorkerStatus::Ok, "{r:?}");
    assert_eq!(r.stdout, "ok\n");
    assert!(!format!("{r:?}").contains("rawmarker"));
    assert_eq!(w.cell(2, "print(2)").stdout, "2\n");
}

#[test]
fn memory_error_is_reported_and_the_worker_survives() {
    let mut w = Worker::start_with_memory(Some(128 * 1024 * 1024));
    w.cell(1, "small = list(range(10))");
    let r = w.cell(2, "big = bytearray(1024**3)");
    assert_eq!(r.status, WorkerStatus::MemoryExhausted, "{r:?}");
    assert_eq!(r.err().kind, "MemoryError");
    assert_eq!(r.err().line, Some(1));
    let r = w.cell(3, "print(sum(small))");
    assert_eq!(r.stdout, "45\n");
}

#[test]
fn top_level_await_works() {
    let mut w = Worker::start();
    let r = w.cell(1, "import asyncio\nawait asyncio.sleep(0)\nasync def f():\n    return 3\nv = await f()\nprint('async', v)\n");
    assert_eq!(r.status, WorkerStatus::Ok, "{r:?}");
    assert_eq!(r.stdout, "async 3\n");
    assert_eq!(w.cell(2, "print(v)").stdout, "3\n");
}

#[test]
fn unpicklable_variables_are_named_after_a_restore() {
    let mut w = Worker::start();
    w.cell(1, "gen = (i for i in range(3))\nkeep = 1\nclass P:\n    def __init__(self, v):\n        self.v = v\n    def get(self):\n        return self.v + keep\np = P(41)\n");
    let r = w.run(
        2,
        "while True: pass",
        &Opts {
            timeout_ms: Some(300),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Timeout);
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert!(
        r.warnings.iter().any(|w| w.contains("gen")),
        "{:?}",
        r.warnings
    );
    let r = w.cell(3, "print(p.get(), isinstance(p, P), 'gen' in globals())");
    assert_eq!(r.stdout, "42 True False\n", "{r:?}");
}

#[test]
fn deeply_nested_values_do_not_crash_the_snapshot() {
    let mut w = Worker::start();
    let r = w.cell(1, "class N:\n    def __init__(self, nxt):\n        self.nxt = nxt\nhead = None\nfor i in range(3000):\n    head = N(head)\nnested = []\nfor i in range(5000):\n    nested = [nested]\nflat = list(range(100000))\n");
    assert_eq!(r.status, WorkerStatus::Ok);
    let r = w.run(
        2,
        "while True: pass",
        &Opts {
            timeout_ms: Some(300),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Timeout);
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    let warn = r.warnings.join("; ");
    assert!(
        warn.contains("head (nested too deeply)") && warn.contains("nested (nested too deeply)"),
        "{warn}"
    );
    assert_eq!(
        w.cell(3, "print(len(flat), 'head' in globals(), N.__name__)")
            .stdout,
        "100000 False N\n"
    );
}

#[test]
fn removing_the_driver_does_not_break_the_session() {
    let mut w = Worker::start();
    w.cell(1, "import sys\ndel sys.modules['_sandcell']\nq = 9\n");
    let r = w.cell(2, "print(q)");
    assert_eq!(r.stdout, "9\n", "{r:?}");
    // Its entry point (re-installed) and Eryx's compile shortcut (simply not used then).
    w.cell(3, "import builtins\ndel builtins.__sandcell__\nq = 10\n");
    let r = w.cell(4, "print(q)");
    assert_eq!(r.stdout, "10\n", "{r:?}");
    w.cell(5, "import __main__\ndel __main__.compile\nq = 11\n");
    let r = w.cell(6, "print(q)");
    assert_eq!(
        (r.status, r.stdout.as_str()),
        (WorkerStatus::Ok, "11\n"),
        "{r:?}"
    );
    let r = w.run(
        7,
        "while True: pass",
        &Opts {
            timeout_ms: Some(300),
            ..Opts::default()
        },
    );
    assert_eq!(r.state, SessionState::Restored, "{r:?}");
    assert_eq!(w.cell(8, "print(q)").stdout, "11\n");
}

#[test]
fn the_driver_binds_no_name_a_cell_can_see_in_its_namespace() {
    let mut w = Worker::start();
    let r = w.cell(
        1,
        "print(sorted(k for k in globals() if 'sandcell' in k or k == 'compile'))",
    );
    assert_eq!(r.stdout, "[]\n", "{r:?}");
    // A cell's own `compile` is the builtin one.
    let r = w.cell(
        2,
        "import builtins\nprint(compile is builtins.compile, type(compile).__name__)",
    );
    assert_eq!(r.stdout, "True builtin_function_or_method\n", "{r:?}");
}

#[test]
fn a_repeated_cell_behaves_as_if_compiled_afresh() {
    // Sources run more than once reuse their compiled code (driver.py, "Compiled cells"):
    // file names, line numbers, warnings and errors must be those of a fresh compile.
    let mut w = Worker::start();
    let fail = "def f():\n    return 1 / 0\nprint((lambda: 0).__code__.co_filename, f.__code__.co_filename)\nf()\n";
    for cell in 1..=4 {
        let r = w.cell(cell, fail);
        let name = format!("<cell {cell}>");
        assert_eq!(r.stdout, format!("{name} {name}\n"), "{r:?}");
        let e = r.err().clone();
        assert_eq!((e.kind.as_str(), e.line), ("ZeroDivisionError", Some(2)));
        let tb = e.traceback.unwrap();
        assert!(
            tb.contains(&format!("File \"{name}\", line 2, in f")),
            "{tb}"
        );
        assert!(tb.contains("return 1 / 0"), "{tb}");
        assert!(!tb.contains(&format!("<cell {}>", cell - 1)), "{tb}");
    }
    // A compile-time warning shows on every run.
    for cell in 5..=8 {
        let r = w.cell(cell, "s = 'a\\d'\nprint(len(s))\n");
        assert_eq!(r.stdout, "3\n", "{r:?}");
        assert!(r.stderr.contains("SyntaxWarning"), "cell {cell}: {r:?}");
    }
    // A syntax error is reported every time, with the cell's own file name.
    for cell in 9..=11 {
        let e = w.cell(cell, "x = (1,\n").err().clone();
        assert_eq!(e.kind, "SyntaxError");
        assert!(e.traceback.unwrap().contains(&format!("<cell {cell}>")));
    }
}

#[test]
fn skipped_snapshots_of_an_unchanged_namespace_restore_exactly() {
    // After a snapshot of immutable values only, cells that leave every name bound to the
    // same object take no new snapshot (driver.py, `unchanged`); what a timeout restores must
    // still be the namespace as the last completed cell left it.
    let timeout = |w: &mut Worker, cell| {
        let r = w.run(
            cell,
            "while True: pass",
            &Opts {
                timeout_ms: Some(300),
                ..Opts::default()
            },
        );
        assert_eq!(r.status, WorkerStatus::Timeout, "{r:?}");
        assert_eq!(r.state, SessionState::Restored, "{r:?}");
    };
    let mut w = Worker::start();
    w.cell(
        1,
        "a = 1\ns = 'x'\nt = (1, ('y', 2.5), frozenset({3}), None)\nimport math as m\n",
    );
    w.cell(2, "print(a, s)");
    w.cell(3, "a = 2");
    w.cell(4, "print(a)");
    w.cell(5, "b = a + 1\ndel s");
    w.cell(6, "m = __import__('cmath')");
    w.cell(7, "print(b)");
    w.cell(8, "c = 5\n1 / 0");
    w.cell(9, "pass");
    timeout(&mut w, 10);
    let r = w.cell(11, "print(a, b, c, 's' in globals(), m.__name__, t)");
    assert_eq!(
        r.stdout, "2 3 5 False cmath (1, ('y', 2.5), frozenset({3}), None)\n",
        "{r:?}"
    );
    // A mutable value, even inside a tuple, is snapshotted after every cell.
    w.cell(12, "u = (1, [2])");
    w.cell(13, "u[1].append(3)");
    timeout(&mut w, 14);
    assert_eq!(w.cell(15, "print(u)").stdout, "(1, [2, 3])\n");
    // A module binding is restored by the module's name: a renamed module counts as changed.
    w.cell(16, "del u\nimport json as j");
    w.cell(17, "pass");
    w.cell(18, "j.__name__ = 'pickle'");
    timeout(&mut w, 19);
    assert_eq!(
        w.cell(20, "print(j.__name__, j is __import__('pickle'))")
            .stdout,
        "pickle True\n"
    );
}

#[test]
fn protocol_ends_cleanly() {
    // EOF -> 0.
    let mut w = Worker::start();
    w.close_requests();
    assert_eq!(w.wait_exit(Duration::from_secs(5)).code(), Some(0));

    // exit -> 0.
    let mut w = Worker::start();
    w.write_raw(b"exit 0 0\n");
    assert_eq!(w.wait_exit(Duration::from_secs(5)).code(), Some(0));

    // A malformed request: nothing written, exit 2.
    let mut w = Worker::start();
    w.write_raw(b"exec one two\n");
    let status = w.wait_exit(Duration::from_secs(5));
    assert_eq!(status.code(), Some(2));
    assert!(
        w.reply_eof(Duration::from_secs(2)),
        "nothing after a malformed request"
    );

    // Invalid UTF-8 source is a cell error, not a protocol error.
    let mut w = Worker::start();
    w.write_raw(b"exec 1 3\na\xffb");
    let r = w.collect(1, Duration::from_secs(10));
    assert_eq!(r.status, WorkerStatus::Error);
    assert_eq!(r.err().kind, "SyntaxError");
}

#[test]
fn figures() {
    let mut w = Worker::start();
    let ready = w.ready_after;
    let mut samples = Vec::new();
    for i in 0..200 {
        let r = w.cell(i + 1, "print(1)");
        assert_eq!(r.stdout, "1\n");
        samples.push(r.elapsed);
    }
    samples.sort();
    let p50 = samples[samples.len() / 2];
    let p99 = samples[samples.len() * 99 / 100];
    // Distinct sources: nothing compiled for an earlier cell is reused.
    let mut distinct = Vec::new();
    for i in 0..200 {
        let r = w.cell(1000 + i, &format!("print(1)\n# {i}\n"));
        assert_eq!(r.stdout, "1\n");
        distinct.push(r.elapsed);
    }
    distinct.sort();
    std::thread::sleep(Duration::from_millis(200));
    let rss = w.rss_bytes();
    eprintln!(
        "FIGURES start_to_ready_ms={:.1} trivial_cell_p50_ms={:.3} p99_ms={:.3} distinct_p50_ms={:.3} idle_rss_mb={:.1}",
        ready.as_secs_f64() * 1e3,
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        distinct[distinct.len() / 2].as_secs_f64() * 1e3,
        rss as f64 / 1048576.0
    );
    assert!(ready < Duration::from_secs(5));
    assert!(p50 < Duration::from_millis(50));
}

#[test]
fn guest_has_no_host_files_or_network() {
    let mut w = Worker::start();
    let r = w.cell(1, "open('/etc/passwd').read()");
    assert_eq!(r.status, WorkerStatus::Error);
    assert!(
        ["FileNotFoundError", "PermissionError", "OSError"].contains(&r.err().kind.as_str()),
        "{:?}",
        r.err()
    );
    let r = w.cell(2, "import os\nprint(sorted(os.listdir('/')))");
    assert!(!r.stdout.contains("etc"), "host root visible: {r:?}");
    let r = w.cell(
        3,
        "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\n",
    );
    assert_eq!(r.status, WorkerStatus::Error, "{r:?}");
    let r = w.cell(
        4,
        "import os\nprint(sorted(k for k in os.environ if not k.startswith('PYTHON')))",
    );
    assert_eq!(r.stdout, "[]\n", "environment is empty: {r:?}");
}

#[test]
fn output_is_streamed_while_the_cell_runs() {
    let mut w = Worker::start();
    for (cell, code) in [
        (
            1,
            "import time\nprint('first')\ntime.sleep(1.5)\nprint('second')\n",
        ),
        (
            2,
            "import time\nprint('first')\nt = time.time()\nwhile time.time() - t < 1.5:\n    pass\nprint('second')\n",
        ),
    ] {
        w.send(
            cell,
            code,
            &Opts {
                timeout_ms: Some(30_000),
                ..Opts::default()
            },
        );
        let t = Instant::now();
        assert!(matches!(
            w.next(Duration::from_secs(1)),
            Some(sandcell_proto::worker::WorkerMessage::Started { .. })
        ));
        match w.next(Duration::from_secs(1)) {
            Some(sandcell_proto::worker::WorkerMessage::Output { data, .. }) => {
                assert_eq!(data, "first\n")
            }
            other => panic!("cell {cell}: expected live output, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1));
        let rest = w.collect(cell, Duration::from_secs(10));
        assert_eq!(rest.stdout, "second\n");
        assert_eq!(rest.status, WorkerStatus::Ok);
    }
}

#[test]
fn deep_recursion_is_an_error_not_a_crash() {
    let mut w = Worker::start();
    w.cell(1, "kept = 'yes'");
    let r = w.cell(2, "def f(n):\n    return f(n + 1)\nf(0)\n");
    assert_eq!(r.status, WorkerStatus::Error, "{r:?}");
    eprintln!(
        "FIGURES recursion_error_kind={} state={:?}",
        r.err().kind,
        r.state
    );
    assert_eq!(w.cell(3, "print(kept)").stdout, "yes\n");
    // Generated code often raises the limit; the sandbox caps it so deep pure-Python
    // recursion still raises instead of overflowing the WebAssembly stack.
    let r = w.cell(
        4,
        "import sys\nsys.setrecursionlimit(10**6)\ndef g(n):\n    return g(n + 1)\ng(0)\n",
    );
    assert_eq!(r.status, WorkerStatus::Error, "{r:?}");
    assert_eq!(r.err().kind, "RecursionError");
    assert_eq!(
        w.cell(5, "import sys\nprint(kept, sys.getrecursionlimit())")
            .stdout,
        "yes 1500\n"
    );
}

/// Known Eryx 0.10 limit (also in 0.14): recursion through C code overflows the 512 KiB fibre
/// stack and wasmtime aborts the process. The worker dies by a signal without a `Done`; the
/// daemon must report the session as crashed. This test pins the behaviour so a fix is noticed.
#[test]
fn c_level_recursion_aborts_the_worker_known_eryx_limit() {
    let mut w = Worker::start();
    w.send(
        1,
        "class A:\n    def __repr__(self):\n        return repr(self)\nrepr(A())\n",
        &Opts {
            timeout_ms: Some(10_000),
            ..Opts::default()
        },
    );
    let status = w.wait_exit(Duration::from_secs(10));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{status:?}");
    assert!(matches!(
        w.next(Duration::from_millis(500)),
        Some(sandcell_proto::worker::WorkerMessage::Started { .. })
    ));
    assert!(
        w.next(Duration::from_millis(500)).is_none(),
        "no reply after the abort but its started line"
    );
}

/// With root, the worker runs under the real confinement sequence, strictly: another uid, no
/// capabilities, no_new_privs, Landlock, seccomp, empty network and IPC namespaces.
#[test]
fn runs_fully_confined_as_an_unprivileged_user() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sandcell_testing::skip!("root", "needs root to switch uid");
    }
    let plan = |dir: &std::path::Path| {
        std::os::unix::fs::chown(dir, Some(65534), Some(65534)).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&common::plan_json(dir)).unwrap();
        v["uid"] = 65534.into();
        v["gid"] = 65534.into();
        v["enforcement"] = "strict".into();
        v["new_net_namespace"] = true.into();
        v["new_ipc_namespace"] = true.into();
        v["max_processes"] = 64.into();
        v["max_open_files"] = 64.into();
        v.to_string()
    };
    let mut w = Worker::start_with(Some(128 << 20), Some(&plan));
    eprintln!(
        "FIGURES confined_start_to_ready_ms={:.1}",
        w.ready_after.as_secs_f64() * 1e3
    );
    assert_eq!(w.proc_status("Seccomp"), "2");
    assert_eq!(w.proc_status("NoNewPrivs"), "1");
    assert!(w.proc_status("Uid").starts_with("65534"));
    assert_eq!(w.proc_status("CapEff"), "0000000000000000");
    let r = w.cell(1, "x = 6 * 7\nprint(x)");
    assert_eq!(r.stdout, "42\n", "{r:?}");
    let (r, after) = interrupt_after(&mut w, 2, "while True: pass");
    assert_eq!(r.status, WorkerStatus::Interrupted);
    assert!(after < Duration::from_secs(1));
    let r = w.run(
        3,
        "import time\ntime.sleep(5)",
        &Opts {
            timeout_ms: Some(200),
            ..Opts::default()
        },
    );
    assert_eq!(r.status, WorkerStatus::Timeout);
    assert_eq!(w.cell(4, "print(x)").stdout, "42\n");
    let mut samples = Vec::new();
    for i in 0..100 {
        samples.push(w.cell(10 + i, "print(1)").elapsed);
    }
    samples.sort();
    eprintln!(
        "FIGURES confined_trivial_cell_p50_ms={:.3}",
        samples[50].as_secs_f64() * 1e3
    );
}

#[test]
fn a_bad_runtime_directory_is_reported_as_fatal() {
    let mut w = Worker::spawn(
        None,
        None,
        &[("SANDCELL_PYTHON_RUNTIME", "/nonexistent/runtime")],
    );
    match w.next(Duration::from_secs(10)) {
        Some(sandcell_proto::worker::WorkerMessage::Fatal { stage, reason }) => {
            assert_eq!(stage, "runtime");
            assert!(reason.contains("/nonexistent/runtime"), "{reason}");
        }
        other => panic!("expected Fatal, got {other:?}"),
    }
    assert_eq!(w.wait_exit(Duration::from_secs(5)).code(), Some(3));

    let mut w = Worker::spawn(None, None, &[("SANDCELL_GUEST_MEMORY_BYTES", "lots")]);
    assert!(matches!(
        w.next(Duration::from_secs(10)),
        Some(sandcell_proto::worker::WorkerMessage::Fatal { .. })
    ));
    assert_eq!(w.wait_exit(Duration::from_secs(5)).code(), Some(3));
}
