//! Host calls through a real sandcelld: a cell calls a tool the client provides
//! (`from sandcell import host; host.call(...)`, R `host_call(...)`), the stream carries a
//! `host_call` frame, the client answers with `HostReply` from a second connection. Every
//! engine: Eryx (`python`, the WebAssembly guest), native Python (`pydata`) and R; the opt-in,
//! the reply timeout, an interrupt while a call waits, the bounds of a reply, another
//! session's call id and another uid's reply; an `Attach` replays a call that waits.

use crate::common;

use common::Daemon;
use sandcell_client::{
    CellResult, Client, Collected, HostCall, KernelError, OpenParams, RunParams, Status,
};
use serde_json::json;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn have_pydata() -> bool {
    Path::new("/usr/bin/python3").exists()
}

fn have_r() -> bool {
    Path::new("/usr/lib/R/bin/exec/R").exists()
        && Command::new("/usr/bin/Rscript")
            .args([
                "-e",
                "stopifnot(requireNamespace('jsonlite', quietly = TRUE))",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

fn daemon(extra: &[(&str, &str)]) -> Daemon {
    let mut env = vec![("SANDCELL_LANGUAGES", "python,r")];
    env.extend_from_slice(extra);
    Daemon::start(&env)
}

/// The environments to test: (language, environment) for each engine present (Eryx always).
fn engines() -> Vec<(&'static str, &'static str)> {
    let mut v = vec![("python", "python")];
    if have_pydata() {
        v.push(("python", "pydata"));
    } else {
        eprintln!("pydata skipped: /usr/bin/python3 is missing");
    }
    if have_r() {
        v.push(("r", "r"));
    } else {
        eprintln!("r skipped: R or its jsonlite package is missing (r-base-core, r-cran-jsonlite)");
    }
    v
}

async fn open(c: &mut Client, language: &str, env: &str, host_calls: bool) -> String {
    c.open_with(&OpenParams {
        language: language.into(),
        limits: None,
        detached_idle_seconds: None,
        environment: Some(env.into()),
        host_calls: host_calls.then_some(true),
        display_last_expression: None,
        rich_output: None,
        egress: None,
    })
    .await
    .expect("open")
    .session
}

/// Reads frames until a `host_call` (returned) or the result (a test failure).
async fn until_host_call(c: &mut Client) -> (u64, HostCall) {
    let mut cell = 0;
    loop {
        let f = c.next_frame().await.expect("frame");
        if let Some(s) = f.started {
            cell = s.cell;
        }
        if let Some(h) = f.host_call {
            return (cell, h);
        }
        assert!(f.result.is_none(), "no host call before {:?}", f.result);
    }
}

/// Reads frames until the result; returns stdout and the result. A `host_call` frame is a
/// test failure.
async fn until_result(c: &mut Client) -> (String, CellResult) {
    let mut out = String::new();
    loop {
        let f = c.next_frame().await.expect("frame");
        assert!(f.host_call.is_none(), "unexpected {:?}", f.host_call);
        if let Some(o) = f.output {
            out.push_str(&o.text);
        }
        if let Some(r) = f.result {
            return (out, r);
        }
    }
}

/// The add tool: `{"sum": a + b}`; any other name fails.
fn tool(_session: &str, h: &HostCall) -> Result<serde_json::Value, String> {
    match h.name.as_str() {
        "math.add" => {
            let a = h.arguments["a"].as_i64().ok_or("a is not an integer")?;
            let b = h.arguments["b"].as_i64().ok_or("b is not an integer")?;
            Ok(json!({ "sum": a + b, "echo": h.arguments["text"] }))
        }
        other => Err(format!("no tool named {other}")),
    }
}

fn code(language: &str, py: &str, r: &str) -> String {
    if language == "r" { r } else { py }.to_owned()
}

#[tokio::test]
async fn host_calls_round_trip_and_error_replies_raise_in_the_cell() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    let mut replies = d.client().await;
    for (language, env) in engines() {
        let s = open(&mut c, language, env, true).await;
        // A round trip: arguments out, result back (non-ASCII text both ways), ids from 1.
        let add = code(
            language,
            "from sandcell import host\nr = host.call('math.add', {'a': 2, 'b': 40, 'text': 'héllo'})\nprint(r['sum'], r['echo'])",
            "r <- host_call('math.add', list(a = 2L, b = 40L, text = 'héllo'))\ncat(r$sum, r$echo, '\\n')",
        );
        let mut calls = Vec::new();
        c.execute(&s, &add).await.unwrap();
        let out = c
            .finish_with_host_calls(
                &mut replies,
                |_| {},
                |sid, h| {
                    calls.push((sid.to_owned(), h.clone()));
                    tool(sid, h)
                },
            )
            .await
            .unwrap();
        assert_eq!(out.result.status, Status::Ok, "{env}: {:?}", out.result);
        assert_eq!(out.stdout.trim(), "42 héllo", "{env}");
        assert_eq!(calls.len(), 1, "{env}");
        assert_eq!(calls[0].0, s);
        assert_eq!(calls[0].1.call, 1, "{env}: ids start at 1 per session");
        assert_eq!(calls[0].1.cell, out.cell);
        assert_eq!(calls[0].1.name, "math.add");
        assert_eq!(calls[0].1.arguments["text"], "héllo");
        // An error reply raises in the cell, which can catch it; the next id is 2.
        let fail = code(
            language,
            "from sandcell import host\ntry:\n    host.call('nope', {})\nexcept host.HostCallError as e:\n    print('caught', e)\nhost.call('nope', {})",
            "tryCatch(host_call('nope'), hostCallError = function(e) cat('caught', conditionMessage(e), '\\n'))\nhost_call('nope')",
        );
        let mut ids = Vec::new();
        c.execute(&s, &fail).await.unwrap();
        let out: Collected = c
            .finish_with_host_calls(
                &mut replies,
                |_| {},
                |sid, h| {
                    ids.push(h.call);
                    tool(sid, h)
                },
            )
            .await
            .unwrap();
        assert_eq!(ids, [2, 3], "{env}");
        assert_eq!(out.stdout.trim(), "caught no tool named nope", "{env}");
        assert_eq!(out.result.status, Status::Error, "{env}: {:?}", out.result);
        let e = out.result.error.as_ref().unwrap();
        assert_eq!(
            e.kind,
            if language == "r" {
                "hostCallError"
            } else {
                "HostCallError"
            }
        );
        assert!(e.message.contains("no tool named nope"), "{env}: {e:?}");
        // The session goes on.
        let out = c
            .execute_collect(&s, &code(language, "print(6 * 7)", "cat(6 * 7, '\\n')"))
            .await
            .unwrap();
        assert_eq!(out.stdout.trim(), "42", "{env}");
        c.close(&s).await.unwrap();
        // A one-shot Run opts in too.
        c.run_with(&RunParams {
            language: language.into(),
            code: add.clone(),
            limits: None,
            environment: Some(env.into()),
            host_calls: Some(true),
            display_last_expression: None,
            rich_output: None,
            egress: None,
        })
        .await
        .unwrap();
        let out = c
            .finish_with_host_calls(&mut replies, |_| {}, tool)
            .await
            .unwrap();
        assert_eq!(out.result.status, Status::Ok, "{env}: {:?}", out.result);
        assert_eq!(out.stdout.trim(), "42 héllo", "{env}");
    }
}

#[tokio::test]
async fn a_host_call_without_opt_in_raises_at_once() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    for (language, env) in engines() {
        let s = open(&mut c, language, env, false).await;
        let t0 = Instant::now();
        c.execute(
            &s,
            &code(
                language,
                "from sandcell import host\nhost.call('math.add', {'a': 1, 'b': 2})",
                "host_call('math.add', list(a = 1, b = 2))",
            ),
        )
        .await
        .unwrap();
        let (_, r) = until_result(&mut c).await;
        // Without the opt-in the call raises at once; a call that waited would end only
        // at the 60 s host-call timeout. The bound leaves room for a loaded machine.
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{env}: {:?}",
            t0.elapsed()
        );
        assert_eq!(r.status, Status::Error, "{env}: {r:?}");
        let e = r.error.unwrap();
        assert!(e.kind.eq_ignore_ascii_case("hostCallError"), "{env}: {e:?}");
        assert!(e.message.contains("not enabled"), "{env}: {e:?}");
        // A Run without host_calls likewise.
        let out = c
            .run_collect_in(
                language,
                Some(env),
                &code(
                    language,
                    "from sandcell import host\nhost.call('x', {})",
                    "host_call('x')",
                ),
                None,
            )
            .await
            .unwrap();
        assert_eq!(out.result.status, Status::Error, "{env}: {:?}", out.result);
        // Nothing waits: a reply names no call.
        let e = c.host_reply(&s, 1, Ok(json!({}))).await.unwrap_err();
        assert!(
            matches!(
                e,
                sandcell_client::Error::Kernel(KernelError::NoSuchHostCall { call: 1, .. })
            ),
            "{e:?}"
        );
    }
}

#[tokio::test]
async fn an_unanswered_host_call_times_out_in_the_cell() {
    let d = daemon(&[("SANDCELL_HOST_CALL_TIMEOUT_SECONDS", "1")]);
    let mut c = d.client().await;
    let mut replies = d.client().await;
    for (language, env) in engines() {
        let s = open(&mut c, language, env, true).await;
        let t0 = Instant::now();
        c.execute(
            &s,
            &code(
                language,
                "from sandcell import host\nhost.call('slow', {})",
                "host_call('slow')",
            ),
        )
        .await
        .unwrap();
        let (_, h) = until_host_call(&mut c).await;
        let (_, r) = until_result(&mut c).await;
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(5),
            "{env}: {took:?}"
        );
        assert_eq!(r.status, Status::Error, "{env}: {r:?}");
        let e = r.error.unwrap();
        assert!(e.message.contains("timed out"), "{env}: {e:?}");
        // Too late: the call is finished.
        let e = replies
            .host_reply(&s, h.call, Ok(json!({"late": true})))
            .await
            .unwrap_err();
        assert_no_such_host_call(&e);
        // The session goes on (and the late answer never reaches a later cell).
        let out = c
            .execute_collect(&s, &code(language, "print('after')", "cat('after\\n')"))
            .await
            .unwrap();
        assert_eq!(out.stdout.trim(), "after", "{env}: {:?}", out.result);
    }
}

/// A cell that catches the error of a call given up at its wall time and calls again gets an
/// error at once, without a second `host_call` line: the daemon allows one call in flight and
/// would end the worker (and the session) for a second one. The cell ends `timeout` and the
/// session goes on.
#[tokio::test]
async fn a_cell_that_retries_after_its_wall_time_keeps_its_session() {
    let d = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "2")]);
    let mut c = d.client().await;
    for (_, env) in engines().into_iter().filter(|(l, _)| *l == "python") {
        let s = open(&mut c, "python", env, true).await;
        c.execute_collect(&s, "y = 7").await.unwrap();
        c.execute(
            &s,
            "from sandcell import host\nwhile True:\n    try:\n        host.call('slow', {})\n    except host.HostCallError:\n        pass\n",
        )
        .await
        .unwrap();
        let mut calls = 0;
        let r = loop {
            let f = c.next_frame().await.expect("frame");
            if f.host_call.is_some() {
                calls += 1;
            }
            if let Some(r) = f.result {
                break r;
            }
        };
        assert_eq!(r.status, Status::Timeout, "{env}: {r:?}");
        assert_eq!(calls, 1, "{env}: one call in flight, never a second line");
        let out = c.execute_collect(&s, "print(y)").await.unwrap();
        assert_eq!(out.stdout.trim(), "7", "{env}: {:?}", out.result);
    }
}

#[tokio::test]
async fn an_interrupt_while_a_call_waits_ends_the_cell_and_the_session_survives() {
    let d = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "30")]);
    let mut c = d.client().await;
    let mut other = d.client().await;
    for (language, env) in engines() {
        let s = open(&mut c, language, env, true).await;
        c.execute(
            &s,
            &code(
                language,
                "x = 41\nfrom sandcell import host\nhost.call('slow', {})",
                "x <- 41\nhost_call('slow')",
            ),
        )
        .await
        .unwrap();
        let (cell, h) = until_host_call(&mut c).await;
        let t0 = Instant::now();
        let r = other.interrupt(&s, cell).await.unwrap();
        assert!(r.delivered, "{env}: {r:?}");
        let (_, r) = until_result(&mut c).await;
        assert_eq!(r.status, Status::Interrupted, "{env}: {r:?}");
        assert!(!r.session_ended, "{env}");
        // An interrupt that did not reach the waiting call would end the cell only at the
        // 30 s wall time; the bound separates the two with room for a loaded machine.
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{env}: {:?}",
            t0.elapsed()
        );
        let e = other
            .host_reply(&s, h.call, Ok(json!({})))
            .await
            .unwrap_err();
        assert_no_such_host_call(&e);
        let out = c
            .execute_collect(&s, &code(language, "print(x + 1)", "cat(x + 1, '\\n')"))
            .await
            .unwrap();
        assert_eq!(out.stdout.trim(), "42", "{env}: {:?}", out.result);
    }
}

#[tokio::test]
async fn an_attach_replays_the_host_call_that_waits() {
    let d = daemon(&[]);
    for (language, env) in engines() {
        let mut c = d.client().await;
        let s = c
            .open_with(&OpenParams {
                language: language.into(),
                limits: None,
                detached_idle_seconds: Some(120),
                environment: Some(env.into()),
                host_calls: Some(true),
                display_last_expression: None,
                rich_output: None,
                egress: None,
            })
            .await
            .expect("open")
            .session;
        let cell = c
            .submit(
                &s,
                &code(
                    language,
                    "from sandcell import host\nprint('before')\nr = host.call('math.add', {'a': 1, 'b': 2})\nprint(r['sum'])",
                    "cat('before\\n')\nr <- host_call('math.add', list(a = 1L, b = 2L))\ncat(r$sum, '\\n')",
                ),
            )
            .await
            .unwrap();
        // The first attachment sees the call (live or replayed) ...
        let mut first = d.client().await;
        first.attach(&s, cell).await.unwrap();
        let (_, h) = until_host_call(&mut first).await;
        // ... and one that replaces it gets the waiting call at the end of its replay.
        let mut second = d.client().await;
        second.attach(&s, cell).await.unwrap();
        let (_, again) = until_host_call(&mut second).await;
        assert_eq!((again.call, &again.name), (h.call, &h.name), "{env}");
        c.host_reply(&s, h.call, tool(&s, &h)).await.unwrap();
        let (out, r) = until_result(&mut second).await;
        assert_eq!(r.status, Status::Ok, "{env}: {r:?}");
        assert_eq!(out.trim(), "3", "{env}");
        // Answered: a later attachment replays no call.
        let mut third = d.client().await;
        third.attach(&s, cell).await.unwrap();
        let (out, r) = until_result(&mut third).await;
        assert_eq!(r.status, Status::Ok, "{env}: {r:?}");
        assert_eq!(
            out.split_whitespace().collect::<Vec<_>>(),
            ["before", "3"],
            "{env}"
        );
        c.close(&s).await.unwrap();
    }
}

/// Connects to the daemon as effective uid `uid` (this thread only: the raw system call, not
/// libc's wrapper that changes every thread), then back to root.
async fn connect_as(d: &Daemon, uid: u32) -> Client {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    // SAFETY: setresuid on the calling thread only; -1 keeps the real and saved uids (root).
    let set = |u: u32| unsafe {
        libc::syscall(libc::SYS_setresuid, -1i64, u as i64, -1i64);
    };
    set(uid);
    let c = Client::connect(&d.socket).await;
    set(0);
    c.expect("connect as another uid")
}

#[tokio::test(flavor = "current_thread")]
async fn host_replies_are_bounded_and_name_their_own_sessions_call() {
    let d = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "30")]);
    let mut c = d.client().await;
    let mut replies = d.client().await;
    for (_, env) in engines().into_iter().filter(|(l, _)| *l == "python") {
        bounded_replies(&d, &mut c, &mut replies, env).await;
    }
}

/// One engine's part of `host_replies_are_bounded_and_name_their_own_sessions_call`.
async fn bounded_replies(d: &Daemon, c: &mut Client, replies: &mut Client, env: &str) {
    let a = open(replies, "python", env, true).await;
    let b = open(c, "python", env, true).await;
    c.execute(
        &b,
        "from sandcell import host\nr = host.call('t', {'n': 1})\nprint(len(r['v']))",
    )
    .await
    .unwrap();
    let (_, h) = until_host_call(c).await;
    assert_eq!(h.call, 1, "{env}");
    let kernel = |e: sandcell_client::Error| match e {
        sandcell_client::Error::Kernel(k) => k,
        other => panic!("{other:?}"),
    };
    // Session a has no call 1 waiting: b's call id does not work there.
    let e = kernel(replies.host_reply(&a, 1, Ok(json!({}))).await.unwrap_err());
    assert!(
        matches!(&e, KernelError::NoSuchHostCall { session, call: 1 } if *session == a),
        "{env}: {e:?}"
    );
    // Another uid cannot answer (nor learn that the session exists).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let mut nobody = connect_as(d, 65534).await;
        let e = kernel(nobody.host_reply(&b, 1, Ok(json!({}))).await.unwrap_err());
        assert!(
            matches!(e, KernelError::NoSuchSession { .. }),
            "{env}: {e:?}"
        );
    }
    // Oversized: LimitExceeded, and the call still waits.
    let big = "x".repeat(sandcell_proto::kernel::MAX_HOST_CALL_RESULT);
    let e = kernel(
        replies
            .host_reply(&b, 1, Ok(json!({ "v": big })))
            .await
            .unwrap_err(),
    );
    assert!(
        matches!(&e, KernelError::LimitExceeded { limit, .. } if limit == "host_call_result_bytes"),
        "{env}: {e:?}"
    );
    let e = kernel(
        replies
            .host_reply(
                &b,
                1,
                Err("e".repeat(sandcell_proto::kernel::MAX_HOST_CALL_ERROR + 1)),
            )
            .await
            .unwrap_err(),
    );
    assert!(
        matches!(&e, KernelError::LimitExceeded { limit, .. } if limit == "host_call_error_bytes"),
        "{env}: {e:?}"
    );
    let e = kernel(
        replies
            .host_reply(&b, 1, Ok(json!([1, 2])))
            .await
            .unwrap_err(),
    );
    assert!(
        matches!(e, KernelError::InvalidParameter { .. }),
        "{env}: {e:?}"
    );
    let e = kernel(replies.host_reply(&b, 2, Ok(json!({}))).await.unwrap_err());
    assert!(
        matches!(e, KernelError::NoSuchHostCall { call: 2, .. }),
        "{env}: {e:?}"
    );
    // The largest result that fits goes through; a second answer to the same call does not.
    let fits = "y".repeat(sandcell_proto::kernel::MAX_HOST_CALL_RESULT - 100);
    replies
        .host_reply(&b, 1, Ok(json!({ "v": fits })))
        .await
        .unwrap();
    let e = kernel(replies.host_reply(&b, 1, Ok(json!({}))).await.unwrap_err());
    assert!(
        matches!(e, KernelError::NoSuchHostCall { call: 1, .. }),
        "{env}: {e:?}"
    );
    let (out, r) = until_result(c).await;
    assert_eq!(r.status, Status::Ok, "{env}: {r:?}");
    assert_eq!(
        out.trim(),
        (sandcell_proto::kernel::MAX_HOST_CALL_RESULT - 100).to_string(),
        "{env}"
    );
    c.close(&b).await.unwrap();
    replies.close(&a).await.unwrap();
}

#[tokio::test]
async fn sandcellctl_answers_host_calls_with_a_command() {
    if !have_pydata() {
        sandcell_testing::skip!("pydata", "/usr/bin/python3 is missing");
    }
    let d = daemon(&[]);
    let ctl = |handler: &str| {
        let mut child = Command::new(common::bin_dir().join("sandcellctl"))
            .args(["run", "-e", "pydata", "--host-call-handler", handler, "-"])
            .env("SANDCELL_SOCKET", &d.socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(
                b"from sandcell import host\nprint(host.call('lookup', {'k': 'v'})['answer'])\n",
            )
            .unwrap();
        child.wait_with_output().unwrap()
    };
    // The handler sees the call on stdin and prints the result.
    let o = ctl(
        r#"python3 -c 'import json,sys; c=json.load(sys.stdin); print(json.dumps({"answer": c["name"] + ":" + c["arguments"]["k"] + ":" + str(c["call"])}))'"#,
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "lookup:v:1\n");
    // A failing handler: its stderr is the error raised in the cell.
    let o = ctl("cat >/dev/null; echo 'tool broke' >&2; exit 3");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("HostCallError: tool broke"), "{err}");
}

/// `e` is the daemon's `NoSuchHostCall`.
fn assert_no_such_host_call(e: &sandcell_client::Error) {
    assert!(
        matches!(
            e,
            sandcell_client::Error::Kernel(KernelError::NoSuchHostCall { .. })
        ),
        "{e:?}"
    );
}
