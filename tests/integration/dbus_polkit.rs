//! The D-Bus control plane and polkit, with the real things: a private
//! `dbus-daemon` with a system-like configuration that includes the shipped bus policy,
//! the real `polkitd` on that bus with the shipped `.policy` and a rules file granting a test
//! group, unprivileged test users, and `sandcellctl` run as those users through `setpriv`.
//!
//! Also the warm pools' `Pools` property, which needs no polkitd.
//!
//! Needs root (useradd, polkit's action directory) and the packages `dbus-daemon` and
//! `polkitd`; without them each test prints why it skips.

use crate::common;

use common::bus::{Bus, Out, run, run_input};
use common::polkit::{POLKITD, Polkit, User};
use common::{Daemon, eventually, rand_hex};
use sandcell_client::KernelError;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

fn repo() -> PathBuf {
    common::manifest_dir().join("..")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Why these tests cannot run here, if they cannot.
fn skip_reason(need_polkit: bool) -> Option<(&'static str, String)> {
    if !is_root() {
        return Some((
            "root",
            "not root (useradd, polkit actions directory and setpriv need root)".into(),
        ));
    }
    if Command::new("dbus-daemon")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some((
            "dbus",
            "dbus-daemon missing (apt-get install dbus-daemon)".into(),
        ));
    }
    if Command::new("busctl").arg("--version").output().is_err() {
        return Some(("dbus", "busctl missing (apt-get install systemd)".into()));
    }
    if need_polkit && !Path::new(POLKITD).exists() {
        return Some((
            "polkit",
            format!("{POLKITD} missing (apt-get install polkitd)"),
        ));
    }
    None
}

/// `sandcellctl ARGS` as `user` (root when `None`), with the daemon's socket and the bus.
fn ctl(d: &Daemon, bus: &Bus, user: Option<&User>, args: &[&str], stdin: Option<&str>) -> Out {
    let exe = common::bin_dir().join("sandcellctl");
    let mut cmd = match user {
        None => Command::new(&exe),
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={}", u.uid))
                .arg(format!("--regid={}", u.gid))
                .arg("--init-groups")
                .arg(&exe);
            c
        }
    };
    cmd.args(args)
        .env("SANDCELL_SOCKET", &d.socket)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address);
    match stdin {
        None => run(&mut cmd),
        Some(text) => run_input(&mut cmd, text),
    }
}

/// `sandcellctl ARGS` as `user` in the background, `stdin` written and closed.
fn ctl_spawn(d: &Daemon, bus: &Bus, user: &User, args: &[&str], stdin: &str) -> Child {
    let mut child = Command::new("setpriv")
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .arg("--init-groups")
        .arg(common::bin_dir().join("sandcellctl"))
        .args(args)
        .env("SANDCELL_SOCKET", &d.socket)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child
}

/// The `<interface name="NAME">...</interface>` element of an introspection document, with
/// surrounding whitespace of each line removed.
fn interface_block(xml: &str, name: &str) -> Option<String> {
    let start = xml.find(&format!("<interface name=\"{name}\">"))?;
    let end = start + xml[start..].find("</interface>")? + "</interface>".len();
    Some(
        xml[start..end]
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// Asserts that interface `name` of the live introspection `live` equals the one in
/// `dbus/NAME.xml`. With `SANDCELL_BLESS_XML=1` the file's interface is replaced instead
/// (after a deliberate interface change; review the diff).
fn check_interface(live: &str, name: &str) {
    let file = repo().join(format!("dbus/{name}.xml"));
    let shipped = std::fs::read_to_string(&file).unwrap();
    let want = interface_block(&shipped, name);
    let got = interface_block(live, name);
    if std::env::var_os("SANDCELL_BLESS_XML").is_some() && want != got {
        let start = live
            .find(&format!("  <interface name=\"{name}\">"))
            .unwrap();
        let end = start + live[start..].find("</interface>").unwrap() + "</interface>".len();
        let old_start = shipped
            .find(&format!("  <interface name=\"{name}\">"))
            .unwrap();
        let old_end =
            old_start + shipped[old_start..].find("</interface>").unwrap() + "</interface>".len();
        let updated = format!(
            "{}{}{}",
            &shipped[..old_start],
            &live[start..end],
            &shipped[old_end..]
        );
        std::fs::write(&file, updated).unwrap();
        eprintln!("blessed {}", file.display());
        return;
    }
    assert_eq!(
        got,
        want,
        "{} differs from the live interface (SANDCELL_BLESS_XML=1 rewrites it); live:\n{live}",
        file.display()
    );
}

fn introspect(bus: &Bus, path: &str) -> String {
    let o = run(bus.busctl().args([
        "introspect",
        "--xml-interface",
        "org.sandcell.Sandcell1",
        path,
    ]));
    assert_eq!(o.code, 0, "busctl introspect {path}: {}", o.stderr);
    o.stdout
}

/// A signal seen from sandcelld: member and a short rendering of its arguments.
#[derive(Debug, Clone)]
struct Seen {
    member: String,
    args: Vec<String>,
}

/// Records every signal sandcelld emits on `bus`.
async fn watch_signals(address: &str) -> Arc<Mutex<Vec<Seen>>> {
    use zbus::export::futures_core::Stream;
    let conn = zbus::connection::Builder::address(address)
        .unwrap()
        .build()
        .await
        .unwrap();
    let rule = zbus::MatchRule::builder()
        .msg_type(zbus::message::Type::Signal)
        .sender("org.sandcell.Sandcell1")
        .unwrap()
        .build();
    let mut stream = zbus::MessageStream::for_match_rule(rule, &conn, Some(256))
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = seen.clone();
    tokio::spawn(async move {
        let _conn = conn;
        loop {
            let next =
                std::future::poll_fn(|cx| std::pin::Pin::new(&mut stream).poll_next(cx)).await;
            let Some(Ok(msg)) = next else { break };
            let h = msg.header();
            let member = h.member().map(|m| m.to_string()).unwrap_or_default();
            let body = msg.body();
            let args: Vec<String> = match member.as_str() {
                "SessionOpened" => body
                    .deserialize::<(String, u32, String, OwnedObjectPath)>()
                    .map(|(a, b, c, d)| vec![a, b.to_string(), c, d.to_string()])
                    .unwrap_or_default(),
                "SessionClosed" => body
                    .deserialize::<(String, String)>()
                    .map(|(a, b)| vec![a, b])
                    .unwrap_or_default(),
                "CellFinished" => body
                    .deserialize::<(String, u64, String)>()
                    .map(|(a, b, c)| vec![a, b.to_string(), c])
                    .unwrap_or_default(),
                "WorkerOOMKilled" => body
                    .deserialize::<(String,)>()
                    .map(|(a,)| vec![a])
                    .unwrap_or_default(),
                "PropertiesChanged" => body
                    .deserialize::<(String, HashMap<String, OwnedValue>, Vec<String>)>()
                    .map(|(i, c, _)| {
                        let mut v = vec![i];
                        v.extend(c.keys().cloned());
                        v
                    })
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            out.lock().unwrap().push(Seen { member, args });
        }
    });
    seen
}

/// Waits until a signal matching `f` was seen.
async fn saw(seen: &Arc<Mutex<Vec<Seen>>>, timeout: Duration, f: impl Fn(&Seen) -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if seen.lock().unwrap().iter().any(&f) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

fn status_json(d: &Daemon, bus: &Bus) -> serde_json::Value {
    let o = ctl(d, bus, None, &["--json", "status"], None);
    assert_eq!(o.code, 0, "sandcellctl status: {}", o.stderr);
    serde_json::from_str(&o.stdout).unwrap()
}

fn max_sessions(status: &serde_json::Value) -> u64 {
    status["admission"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r[0] == "max_concurrent_sessions")
        .map(|r| r[2].as_u64().unwrap())
        .unwrap()
}

fn start_daemon(bus: &Bus) -> Daemon {
    let d = Daemon::start(&[("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)]);
    // The gateway users reach the socket through its mode; polkit is the gate under test.
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    d
}

/// The polkit test's world: a private system bus, polkit with a granted group, three users
/// (alice and bob in the group, carol not), a daemon that asks polkit, the bus signals seen,
/// and a Varlink client of root.
struct Polkitted {
    bus: Bus,
    pk: Polkit,
    alice: User,
    bob: User,
    carol: User,
    d: Daemon,
    seen: Arc<Mutex<Vec<Seen>>>,
    root: sandcell_client::Client,
}

/// Names the case that was running when a panic unwinds through it.
struct Case(&'static str);

impl Drop for Case {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "polkit_decides_for_varlink_and_dbus: case `{}` failed",
                self.0
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polkit_decides_for_varlink_and_dbus() {
    if let Some((tier, why)) = skip_reason(true) {
        sandcell_testing::skip!(tier, "{why}");
    }
    let bus = Bus::start();
    let group = format!("sctg{}", rand_hex(3));
    let mut pk = Polkit::start(&bus, &group);
    let alice = pk.add_user("a", true); // in the granted group
    let bob = pk.add_user("b", true); // in the granted group, another uid
    let carol = pk.add_user("c", false); // plain user
    let d = start_daemon(&bus);
    assert!(
        d.log_text().contains("polkit decides authorization"),
        "polkit not selected:\n{}",
        d.log_text()
    );
    let seen = watch_signals(&bus.address).await;

    let root = d.client().await;
    let mut f = Polkitted {
        bus,
        pk,
        alice,
        bob,
        carol,
        d,
        seen,
        root,
    };
    // Each case leaves the daemon with no session (the detached one is terminated by its
    // owner); the cases run in this order, and a failure names its case.
    macro_rules! case {
        ($name:ident $(, $arg:expr)*) => {{
            let _case = Case(stringify!($name));
            $name(&mut f $(, $arg)*).await
        }};
    }
    case!(root_runs_code_and_the_bus_announces_it);
    case!(a_plain_user_is_refused_and_no_worker_starts);
    let sid = case!(a_granted_user_opens_a_detached_session);
    case!(others_may_not_manage_the_session, &sid);
    case!(the_owner_interrupts_and_terminates_her_session, &sid);
    case!(root_terminates_anyones_session);
    case!(reload_and_sighup_apply_a_valid_file_and_refuse_an_invalid_one);
    case!(the_bus_policy_keeps_the_name_and_properties_to_root);
    let Polkitted { mut bus, pk, d, .. } = f;
    drop(d);
    bus.stop();
    drop(pk);
}

/// Root runs code (Varlink, polkit subject unix-process) and the bus announces the cell and the
/// one-shot session's end; the live interface is the checked-in one.
async fn root_runs_code_and_the_bus_announces_it(f: &mut Polkitted) {
    // The live interface is the checked-in one.
    check_interface(
        &introspect(&f.bus, "/org/sandcell/Sandcell1"),
        "org.sandcell.Manager1",
    );

    // Root: allowed (Varlink, polkit subject unix-process).
    let out = f
        .root
        .run_collect("python", "print(6 * 7)", None)
        .await
        .expect("root may run code");
    assert_eq!(out.stdout, "42\n");
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "CellFinished"
            && s.args.get(2).map(String::as_str) == Some("ok"))
        .await,
        "no CellFinished(ok) signal: {:?}",
        f.seen.lock().unwrap()
    );
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "SessionClosed")
        .await,
        "no SessionClosed signal for the one-shot run"
    );
}

/// A plain user is refused (PermissionDenied naming the action) and no worker or session
/// starts.
async fn a_plain_user_is_refused_and_no_worker_starts(f: &mut Polkitted) {
    // A plain user: PermissionDenied, and no worker starts.
    let before = f.seen.lock().unwrap().len();
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.carol),
        &["run", "-"],
        Some("print(1)\n"),
    );
    assert_eq!(o.code, 3, "plain user's run: {} {}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains("PermissionDenied") && o.stderr.contains("org.sandcell.execute"),
        "stderr: {}",
        o.stderr
    );
    assert!(
        f.d.descendants().is_empty(),
        "a worker started for a refused user"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !f.seen.lock().unwrap()[before..]
            .iter()
            .any(|s| s.member == "SessionOpened"),
        "a session opened for a refused user"
    );
    let st = status_json(&f.d, &f.bus);
    assert_eq!(st["active_sessions"], 0);
}

/// A user of the granted group opens a detached session that outlives the command; listing
/// shows others' sessions only with manage-sessions; the session object's interface is the
/// checked-in one. Returns the session id.
async fn a_granted_user_opens_a_detached_session(f: &mut Polkitted) -> String {
    // A user of the granted group: allowed; a detached session survives the command.
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["open", "--idle", "600"],
        None,
    );
    assert_eq!(o.code, 0, "granted user's open: {}", o.stderr);
    let sid = o.stdout.trim().to_string();
    assert_eq!(sid.len(), 32, "session id: {sid:?}");
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "SessionOpened"
            && s.args.first() == Some(&sid)
            && s.args.get(1) == Some(&f.alice.uid.to_string()))
        .await,
        "no SessionOpened({sid}, {}) signal",
        f.alice.uid
    );
    // Listing: others' sessions only with manage-sessions (root here).
    let o = ctl(&f.d, &f.bus, Some(&f.carol), &["--json", "list"], None);
    assert_eq!(o.code, 0, "carol's list: {}", o.stderr);
    assert_eq!(o.stdout.trim(), "[]", "carol sees alice's session");
    let o = ctl(&f.d, &f.bus, Some(&f.alice), &["--json", "list"], None);
    assert_eq!(o.code, 0, "alice's list: {}", o.stderr);
    assert!(
        o.stdout.contains(&sid),
        "alice does not see her session: {}",
        o.stdout
    );
    let o = ctl(&f.d, &f.bus, None, &["--json", "list"], None);
    assert_eq!(o.code, 0, "list: {}", o.stderr);
    let rows: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == sid.as_str())
        .expect("session listed");
    assert_eq!(row["uid"], f.alice.uid);
    assert_eq!(row["language"], "python");
    assert_eq!(row["state"], "idle");
    let path = format!("/org/sandcell/Sandcell1/session/{sid}");
    assert_eq!(row["path"], path.as_str());

    // The session object's interface is the checked-in one.
    check_interface(&introspect(&f.bus, &path), "org.sandcell.Session1");
    sid
}

/// Another user (even of the granted group) may not manage the session `sid`, over D-Bus or
/// Varlink; reload is for administrators.
async fn others_may_not_manage_the_session(f: &mut Polkitted, sid: &str) {
    // Another user (even of the granted group) may not manage alice's session, over D-Bus
    // (PermissionDenied: manage-sessions) or Varlink (the session is not revealed).
    for who in [&f.bob, &f.carol] {
        let o = ctl(&f.d, &f.bus, Some(who), &["terminate", sid], None);
        assert_eq!(
            o.code, 3,
            "{} terminating alice's session: {}",
            who.name, o.stderr
        );
        assert!(
            o.stderr.contains("PermissionDenied") && o.stderr.contains("manage-sessions"),
            "stderr: {}",
            o.stderr
        );
        let o = ctl(&f.d, &f.bus, Some(who), &["interrupt", sid], None);
        assert_eq!(
            o.code, 3,
            "{} interrupting alice's session: {}",
            who.name, o.stderr
        );
    }
    let o = ctl(&f.d, &f.bus, Some(&f.bob), &["close", sid], None);
    assert_eq!(
        o.code, 3,
        "bob closing alice's session over Varlink: {}",
        o.stderr
    );
    assert!(o.stderr.contains("NoSuchSession"), "stderr: {}", o.stderr);
    assert_eq!(status_json(&f.d, &f.bus)["active_sessions"], 1);
    // Reload is for administrators.
    let o = ctl(&f.d, &f.bus, Some(&f.alice), &["reload"], None);
    assert_eq!(o.code, 3, "alice's reload: {}", o.stderr);
    assert!(
        o.stderr.contains("PermissionDenied"),
        "stderr: {}",
        o.stderr
    );
}

/// The owner interrupts (nothing running, then a running cell: the session keeps its variables)
/// and terminates her session `sid` over D-Bus.
async fn the_owner_interrupts_and_terminates_her_session(f: &mut Polkitted, sid: &String) {
    // The owner manages her own session over D-Bus.
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["--json", "interrupt", sid],
        None,
    );
    assert_eq!(o.code, 1, "interrupt with no cell running: {}", o.stderr);
    let r: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(r["delivered"], false);
    assert_eq!(r["reason"], "not_running");
    // A running cell is interrupted over D-Bus; the session keeps its state.
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["exec", sid, "-"],
        Some("x = 7\n"),
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let mut busy = ctl_spawn(
        &f.d,
        &f.bus,
        &f.alice,
        &["exec", sid, "-"],
        "while True:\n    pass\n",
    );
    assert!(
        eventually(Duration::from_secs(10), || {
            let o = ctl(&f.d, &f.bus, None, &["--json", "list"], None);
            o.stdout.contains("\"running\"")
        }),
        "the cell did not start running"
    );
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["--json", "interrupt", sid],
        None,
    );
    assert_eq!(
        o.code, 0,
        "interrupting a running cell: {} {}",
        o.stdout, o.stderr
    );
    let r: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(r["delivered"], true, "{r}");
    let st = busy.wait().unwrap();
    assert_eq!(
        st.code(),
        Some(5),
        "the interrupted exec exits 5 (interrupted)"
    );
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "CellFinished"
            && s.args.first() == Some(sid)
            && s.args.get(2).map(String::as_str) == Some("interrupted"))
        .await,
        "no CellFinished(interrupted)"
    );
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["exec", sid, "-"],
        Some("print(x)\n"),
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stdout, "7\n", "the session kept its variables");
    let o = ctl(&f.d, &f.bus, Some(&f.alice), &["terminate", sid], None);
    assert_eq!(o.code, 0, "alice terminating her session: {}", o.stderr);
    let reason = format!("terminated by uid {}", f.alice.uid);
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "SessionClosed"
            && s.args.first() == Some(sid)
            && s.args.get(1) == Some(&reason))
        .await,
        "no SessionClosed({sid}, {reason:?})"
    );
    assert!(
        eventually(Duration::from_secs(5), || f.d.descendants().is_empty()),
        "worker left after terminate"
    );
    assert_eq!(status_json(&f.d, &f.bus)["active_sessions"], 0);
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "PropertiesChanged"
            && s.args.iter().any(|a| a == "ActiveSessions"))
        .await,
        "no PropertiesChanged(ActiveSessions)"
    );
}

/// Root terminates anyone's session, through the session object.
async fn root_terminates_anyones_session(f: &mut Polkitted) {
    // Root manages anyone's session.
    let o = ctl(
        &f.d,
        &f.bus,
        Some(&f.alice),
        &["open", "--idle", "600"],
        None,
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let sid2 = o.stdout.trim().to_string();
    // Through the session object this time.
    let o = run(f.bus.busctl().args([
        "call",
        "org.sandcell.Sandcell1",
        &format!("/org/sandcell/Sandcell1/session/{sid2}"),
        "org.sandcell.Session1",
        "Terminate",
    ]));
    assert_eq!(o.code, 0, "root terminating alice's session: {}", o.stderr);
    assert!(
        eventually(Duration::from_secs(5), || !ctl(
            &f.d,
            &f.bus,
            None,
            &["list"],
            None
        )
        .stdout
        .contains(&sid2)),
        "terminated session still listed"
    );
}

/// Reload, by the D-Bus call and by SIGHUP: a valid file applies, an invalid one is refused
/// and the old limits stay, and the figures are announced again. (The harness sets the
/// admission budgets through SANDCELL_* variables, which override the file, so the limit
/// observed here is max_source_bytes, through Varlink.)
async fn reload_and_sighup_apply_a_valid_file_and_refuse_an_invalid_one(f: &mut Polkitted) {
    // Reload: a valid file applies; an invalid one is refused and the old limits stay.
    // (The harness sets the admission budgets through SANDCELL_* variables, which override
    // the file, so the limit observed here is max_source_bytes, through Varlink.)
    let config = f.d.dir.path().join("none.toml");
    let sessions_budget = max_sessions(&status_json(&f.d, &f.bus));
    let source = format!("x = 1{}\n", " ".repeat(3000));
    let out = f
        .root
        .run_collect("python", &source, None)
        .await
        .expect("3 kB of source is within the default limit");
    assert_eq!(out.result.status, sandcell_client::Status::Ok);
    std::fs::write(&config, "[limits]\nmax_source_bytes = 2000\n").unwrap();
    let o = ctl(&f.d, &f.bus, None, &["reload"], None);
    assert_eq!(o.code, 0, "reload: {}", o.stderr);
    let source_limit =
        |e: Result<(), sandcell_client::Error>| match e {
            Err(sandcell_client::Error::Kernel(KernelError::LimitExceeded {
                limit, max, ..
            })) if limit == "max_source_bytes" => max,
            other => panic!("expected LimitExceeded(max_source_bytes), got {other:?}"),
        };
    assert_eq!(
        source_limit(
            f.root
                .run_collect("python", &source, None)
                .await
                .map(|_| ())
        ),
        2000
    );
    std::fs::write(&config, "[limits]\nmax_source_bytes = 0\n").unwrap();
    let o = ctl(&f.d, &f.bus, None, &["reload"], None);
    assert_eq!(o.code, 3, "invalid reload: {}", o.stderr);
    assert!(
        o.stderr.contains("InvalidConfig") && o.stderr.contains("max_source_bytes"),
        "stderr: {}",
        o.stderr
    );
    assert_eq!(
        source_limit(
            f.root
                .run_collect("python", &source, None)
                .await
                .map(|_| ())
        ),
        2000,
        "an invalid reload changed the limits"
    );
    assert_eq!(max_sessions(&status_json(&f.d, &f.bus)), sessions_budget);
    assert!(
        saw(&f.seen, Duration::from_secs(5), |s| s.member
            == "PropertiesChanged"
            && s.args.iter().any(|a| a == "Admission"))
        .await,
        "no PropertiesChanged(Admission) after reload"
    );

    // SIGHUP takes the same reload path: the file applies and the figures are announced again.
    let admission_changes = || {
        f.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.member == "PropertiesChanged" && s.args.iter().any(|a| a == "Admission"))
            .count()
    };
    let before = admission_changes();
    std::fs::write(&config, "[limits]\nmax_source_bytes = 2500\n").unwrap();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &f.d.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let t0 = Instant::now();
    loop {
        let max = source_limit(
            f.root
                .run_collect("python", &source, None)
                .await
                .map(|_| ()),
        );
        if max == 2500 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "SIGHUP did not apply the file: max {max}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t0 = Instant::now();
    while admission_changes() == before && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        admission_changes() > before,
        "no PropertiesChanged(Admission) after SIGHUP"
    );
}

/// Bus policy: only root owns the name; properties are read-only.
async fn the_bus_policy_keeps_the_name_and_properties_to_root(f: &mut Polkitted) {
    // Bus policy: only root owns the name; properties are read-only.
    let o = run(f.bus.busctl().args([
        "call",
        "org.sandcell.Sandcell1",
        "/org/sandcell/Sandcell1",
        "org.freedesktop.DBus.Properties",
        "Set",
        "ssv",
        "org.sandcell.Manager1",
        "Version",
        "s",
        "x",
    ]));
    assert_ne!(o.code, 0, "Set must fail");
    let o = run(Command::new("setpriv")
        .arg(format!("--reuid={}", f.carol.uid))
        .arg(format!("--regid={}", f.carol.gid))
        .arg("--clear-groups")
        .arg("busctl")
        .env("DBUS_SYSTEM_BUS_ADDRESS", &f.bus.address)
        .args([
            "--system",
            "call",
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "RequestName",
            "su",
            "org.sandcell.Sandcell1",
            "0",
        ]));
    assert_ne!(o.code, 0, "a plain user owned org.sandcell.Sandcell1");
    assert!(
        o.stderr.contains("denied") || o.stderr.contains("Access"),
        "{}",
        o.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn varlink_survives_the_bus_and_the_daemon_reconnects() {
    if let Some((tier, why)) = skip_reason(false) {
        sandcell_testing::skip!(tier, "{why}");
    }
    let mut bus = Bus::start();
    // No polkitd on this bus. Where polkit is installed (as here) the daemon fails closed and
    // only root may run code; elsewhere the socket's permissions decide. Root runs the test.
    let d = start_daemon(&bus);
    let ups = |d: &Daemon| d.log_text().matches("D-Bus control plane up").count();
    assert_eq!(ups(&d), 1, "{}", d.log_text());
    let expected = if std::path::Path::new("/usr/lib/polkit-1/polkitd").exists() {
        "FAIL-CLOSED: polkit is installed but not answering"
    } else {
        "socket's permissions stay the only authorization"
    };
    assert!(d.log_text().contains(expected), "{}", d.log_text());
    bus.stop();
    assert!(
        eventually(Duration::from_secs(10), || d
            .log_text()
            .contains("system bus connection lost")),
        "the daemon did not notice the bus going away:\n{}",
        d.log_text()
    );
    let mut c = d.client().await;
    let out = c
        .run_collect("python", "print('still here')", None)
        .await
        .expect("Varlink serves without the bus");
    assert_eq!(out.stdout, "still here\n");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    bus.restart();
    assert!(
        eventually(Duration::from_secs(40), || ups(&d) == 2),
        "no reconnect within 40 s:\n{}",
        d.log_text()
    );
    eprintln!("reconnected {:?} after the bus came back", t0.elapsed());
    let o = run(bus.busctl().args([
        "get-property",
        "org.sandcell.Sandcell1",
        "/org/sandcell/Sandcell1",
        "org.sandcell.Manager1",
        "ActiveSessions",
    ]));
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stdout.trim(), "u 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_kill_is_signalled() {
    if let Some((tier, why)) = skip_reason(false) {
        sandcell_testing::skip!(tier, "{why}");
    }
    if common::insecure() {
        sandcell_testing::skip!(
            "cgroups",
            "the daemon runs --insecure-dev (no cgroups), so the kernel cannot OOM-kill a \
             worker in its session group"
        );
    }
    if !Path::new("/usr/lib/R/bin/exec/R").exists() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let bus = Bus::start();
    // A native R worker has no allocation limit of its own (Python's guest memory limit
    // answers first with memory_exhausted), so a large R vector meets the cgroup's
    // memory.max and the kernel kills the worker.
    let d = Daemon::start(&[
        ("DBUS_SYSTEM_BUS_ADDRESS", &bus.address),
        ("SANDCELL_LANGUAGES", "r"),
        ("SANDCELL_MAX_GUEST_MEMORY_BYTES", "67108864"),
        ("SANDCELL_MAX_WORKER_MEMORY_BYTES", "268435456"),
        // At most half the worker's memory (the session's files are a tmpfs charged to it).
        ("SANDCELL_MAX_SESSION_FILES_BYTES", "67108864"),
    ]);
    let seen = watch_signals(&bus.address).await;
    let mut c = d.client().await;
    let out = c
        .run_collect(
            "r",
            "x <- numeric(1e8)\nx[] <- 1\ncat(sum(x), '\\n')\n",
            None,
        )
        .await
        .expect("the cell runs");
    assert_eq!(
        out.result.status,
        sandcell_client::Status::Oom,
        "the R vector did not meet memory.max: {:?}",
        out.result
    );
    assert!(
        saw(&seen, Duration::from_secs(10), |s| s.member
            == "WorkerOOMKilled"
            && s.args.first() == Some(&out.session))
        .await,
        "no WorkerOOMKilled({}) signal (cell status {:?}); seen: {:?}",
        out.session,
        out.result.status,
        seen.lock().unwrap()
    );
}

/// A row of `org.sandcell.Manager1.Pools`: language, idle, target, min, max, taken, missed.
type PoolRow = (String, u32, u32, u32, u32, u64, u64);

/// `Pools` read afresh (no property cache), by language.
async fn pools(conn: &zbus::Connection) -> HashMap<String, PoolRow> {
    let proxy: zbus::Proxy<'_> = zbus::proxy::Builder::new(conn)
        .destination("org.sandcell.Sandcell1")
        .unwrap()
        .path("/org/sandcell/Sandcell1")
        .unwrap()
        .interface("org.sandcell.Manager1")
        .unwrap()
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .unwrap();
    let rows: Vec<PoolRow> = proxy.get_property("Pools").await.expect("reading Pools");
    rows.into_iter().map(|r| (r.0.clone(), r)).collect()
}

/// Polls `Pools` until `f` holds for the row of `language`; returns the last row seen.
async fn pool_until(
    conn: &zbus::Connection,
    language: &str,
    timeout: Duration,
    f: impl Fn(&PoolRow) -> bool,
) -> (bool, PoolRow) {
    let t0 = Instant::now();
    loop {
        let row = pools(conn)
            .await
            .remove(language)
            .expect("a row per language");
        if f(&row) {
            return (true, row);
        }
        if t0.elapsed() >= timeout {
            return (false, row);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_are_visible_on_dbus() {
    if let Some((tier, why)) = skip_reason(false) {
        sandcell_testing::skip!(tier, "{why}");
    }
    let bus = Bus::start();
    // Python only (the harness's default), with a pool of 1 growing to 2; no polkitd: root
    // runs the test and the socket's permissions decide.
    let d = Daemon::start(&[
        ("DBUS_SYSTEM_BUS_ADDRESS", &bus.address),
        ("SANDCELL_POOLS", "true"),
        ("SANDCELL_POOL_PYTHON_MIN", "1"),
        ("SANDCELL_POOL_PYTHON_MAX", "2"),
    ]);
    let seen = watch_signals(&bus.address).await;
    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    check_interface(
        &introspect(&bus, "/org/sandcell/Sandcell1"),
        "org.sandcell.Manager1",
    );

    // The pool fills in the background: one idle Python worker, aiming for its minimum.
    let (ok, py) = pool_until(&conn, "python", Duration::from_secs(60), |r| r.1 == 1).await;
    assert!(
        ok,
        "python pool did not reach 1 idle worker: {py:?}\n{}",
        d.log_text()
    );
    assert_eq!(py, ("python".into(), 1, 1, 1, 2, 0, 0), "before any open");
    // R is not served here: no pool, and nothing counted.
    let r = pools(&conn).await.remove("r").expect("an r row");
    assert_eq!(r, ("r".into(), 0, 0, 0, 0, 0, 0));

    // Opening a session takes the warm worker; the pool then grows to its maximum.
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.expect("open");
    let (ok, py) = pool_until(&conn, "python", Duration::from_secs(10), |r| r.5 == 1).await;
    assert!(ok, "taken did not reach 1: {py:?}");
    assert_eq!(
        py.6, 0,
        "the open found a warm worker, nothing missed: {py:?}"
    );
    let (ok, py) = pool_until(&conn, "python", Duration::from_secs(60), |r| {
        r.1 == 2 && r.2 == 2
    })
    .await;
    assert!(
        ok,
        "python pool did not grow to its maximum under use: {py:?}\n{}",
        d.log_text()
    );
    assert_eq!((py.3, py.4, py.5, py.6), (1, 2, 1, 0), "{py:?}");
    assert!(
        saw(&seen, Duration::from_secs(5), |s| s.member
            == "PropertiesChanged"
            && s.args.first().map(String::as_str)
                == Some("org.sandcell.Manager1")
            && s.args.iter().any(|a| a == "Pools"))
        .await,
        "no PropertiesChanged(Pools); seen: {:?}",
        seen.lock().unwrap()
    );

    // sandcellctl status shows the same, as JSON and as a table.
    let st = status_json(&d, &bus);
    let pools_json = st["pools"].as_array().expect("pools in status --json");
    let py_json = pools_json
        .iter()
        .find(|p| p["language"] == "python")
        .expect("python in status --json");
    assert_eq!(py_json["taken"], 1, "{st}");
    assert_eq!(py_json["max"], 2, "{st}");
    let r_json = pools_json
        .iter()
        .find(|p| p["language"] == "r")
        .expect("r in status --json");
    assert_eq!(
        (&r_json["min"], &r_json["max"]),
        (&0.into(), &0.into()),
        "{st}"
    );
    let o = ctl(&d, &bus, None, &["status"], None);
    assert_eq!(o.code, 0, "sandcellctl status: {}", o.stderr);
    assert!(
        o.stdout
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["python", "2", "2", "1", "2", "1", "0"]),
        "sandcellctl status:\n{}",
        o.stdout
    );
    assert!(
        o.stdout.lines().any(
            |l| l.split_whitespace().collect::<Vec<_>>() == ["r", "0", "0", "0", "0", "0", "0"]
        ),
        "sandcellctl status:\n{}",
        o.stdout
    );
    c.close(&s.session).await.unwrap();
}
