//! Egress policy through a real sandcelld: an environment's `egress` table is what
//! `ListEnvironments` and `sandcelld --check` report (hosts, ports, caps), absent everywhere
//! else (no network by default), and an Eryx environment with egress is refused at start.
//!
//! Under the shipped unit's sandbox (tests/integration/common/unit_sandbox.rs): without the
//! packages' egress drop-in, Open and Run of an egress environment are refused
//! (`EgressUnavailable`, naming the drop-in); with it, a cell fetches through the proxy.
//!
//! The proxy itself (allowlist, address classes, caps, revocation, a real "internet" in a
//! network namespace) is tested by the sandcell-egress crate (`egress/tests/`).

use crate::common;

use common::Daemon;
use common::unit_sandbox::{self, UnitSandbox};
use sandcell_proto::kernel::KernelError;
use sandcell_testing::netns::{PROXY_NS, PrivateNet};
use std::process::Command;

const EGRESS_ENV: &str = "[environments.net]\nlanguage = \"python\"\nengine = \"native\"\n\
    interpreter = \"/usr/bin/python3\"\n\
    egress = { hosts = [\"Data.Example.org\", \"*.pythonhosted.org\"], ports = [443], \
    max_bytes = 1048576, max_connections = 4 }\n";

fn write_conf(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("sandcell-egressconf-")
        .tempdir()
        .unwrap();
    let conf = dir.path().join("sandcelld.toml");
    std::fs::write(&conf, text).unwrap();
    (dir, conf)
}

#[test]
fn check_names_each_environments_egress_policy() {
    let (_dir, conf) = write_conf(EGRESS_ENV);
    let out = Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--config")
        .arg(&conf)
        .arg("--check")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let egress: Vec<&str> = text
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("egress:"))
        .collect();
    assert!(
        egress.contains(
            &"egress: data.example.org *.pythonhosted.org; ports 443; \
              1048576 bytes, 4 connections at once, 1024 in all, 300 s each"
        ),
        "{text}"
    );
    assert_eq!(
        egress
            .iter()
            .filter(|l| l.ends_with("egress: none"))
            .count(),
        egress.len() - 1,
        "every other environment has none: {text}"
    );

    // The Eryx engine has no sockets to give: refused with the reason.
    let (_dir, conf) = write_conf(
        "[environments.wasm]\nlanguage = \"python\"\nengine = \"eryx\"\n\
         egress = { hosts = [\"a.org\"] }\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--config")
        .arg(&conf)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the eryx engine has no egress"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_environments_reports_the_policy() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sandcell_testing::skip!("root", "the daemon needs root");
    }
    let (_dir, conf) = write_conf(EGRESS_ENV);
    let d = Daemon::start_with_config(&conf, &[]);
    let mut c = d.client().await;
    let envs = c.list_environments().await.unwrap();
    let net = envs.iter().find(|e| e.name == "net").expect("net");
    let g = net.egress.as_ref().expect("the policy is listed");
    assert_eq!(g.hosts, ["data.example.org", "*.pythonhosted.org"]);
    assert_eq!(g.ports, [443]);
    assert_eq!(
        (
            g.max_bytes,
            g.max_connections,
            g.max_total_connections,
            g.max_seconds
        ),
        (1 << 20, 4, 1024, 300)
    );
    for e in envs.iter().filter(|e| e.name != "net") {
        assert!(e.egress.is_none(), "{} has no network: {e:?}", e.name);
    }
}

/// The worker side: a session of an egress environment has the proxy variables and may make
/// TCP sockets (connecting only to the proxy port: Landlock where the ABI has network rules,
/// and in any case nothing but loopback exists in its namespace), never UDP or raw ones; a
/// session of an environment without egress may make no socket at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_workers_get_tcp_sockets_and_the_proxy_variables_only() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sandcell_testing::skip!("root", "the daemon needs root");
    }
    if !common::pydata_available() {
        sandcell_testing::skip!("pydata", "/usr/bin/python3 cannot import numpy and pandas");
    }
    let (_dir, conf) = write_conf(EGRESS_ENV);
    let d = Daemon::start_with_config(&conf, &[]);
    let mut c = d.client().await;
    let cell = r#"import os, socket
print("proxy", os.environ.get("HTTP_PROXY"), os.environ.get("https_proxy"))
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return "errno %d" % e.errno
print("tcp", attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()))
print("tcp6", attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()))
print("udp", attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)))
print("unix", attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)))
def outside():
    s = socket.socket()
    s.settimeout(3)
    s.connect(("11.0.0.2", 80))
print("outside", attempt(outside))
"#;
    let o = c
        .open_in("python", Some("net"), None, None)
        .await
        .expect("open net");
    let out = c.execute_collect(&o.session, cell).await.unwrap();
    let t = &out.stdout;
    assert!(
        t.contains("proxy http://127.0.0.1:3128 http://127.0.0.1:3128\n"),
        "{t}\n{}",
        out.stderr
    );
    assert!(t.contains("tcp ok\ntcp6 ok\n"), "{t}\n{}", out.stderr);
    assert!(t.contains("udp errno 1\nunix errno 1\n"), "{t}");
    // Landlock (EACCES) or no route (ENETUNREACH): never connected.
    assert!(
        t.contains("outside errno 13\n") || t.contains("outside errno 101\n"),
        "{t}"
    );
    c.close(&o.session).await.unwrap();

    let o = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .expect("open pydata");
    let out = c.execute_collect(&o.session, cell).await.unwrap();
    let t = &out.stdout;
    assert!(t.contains("proxy None None\n"), "{t}");
    assert!(
        t.contains("tcp errno 1\ntcp6 errno 1\nudp errno 1\n"),
        "{t}"
    );
}

/// The whole path: a pydata-like session of an egress environment fetches an allowed host
/// with urllib through the proxy (the daemon made the listener in the worker's namespace and
/// granted it); another host is a 403 with the reason. The "internet" is a web server in a
/// network namespace the test creates, reached from the proxy's own namespace over a veth
/// pair; names come from the proxy's hosts file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_fetches_an_allowed_host_through_the_proxy() {
    fetch_through_the_proxy("sei", None).await;
}

/// The same path under the shipped unit's sandbox (units/sandcelld.service's seccomp
/// filters, bounding set and no_new_privs) with the packages' egress drop-in read after it
/// (units/egress/sandcelld.service.conf: `AF_INET AF_INET6`, `CAP_NET_ADMIN`): what an
/// operator gets after linking the drop-in in; the proxy runs under its own unit's sandbox
/// (units/sandcell-egress.service). A session of an environment without egress still
/// cannot make a TCP socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_unit_with_the_egress_drop_in_a_cell_fetches_through_the_proxy() {
    if !sandcell_testing::on_path("systemd-analyze") {
        sandcell_testing::skip!(
            "root",
            "systemd-analyze (systemd) expands the unit's system-call groups"
        );
    }
    let sandbox = UnitSandbox::from_unit_with(
        &unit_sandbox::unit_path(),
        &[unit_sandbox::egress_drop_in_path()],
    );
    fetch_through_the_proxy("seu", Some(&sandbox)).await;
}

/// The shipped unit without the drop-in cannot give egress: the daemon notices at start
/// (its probe: loopback up and an `AF_INET` socket in a throw-away namespace) and refuses
/// Open and Run of the egress environment with `EgressUnavailable`, whose reason names what
/// is missing and the drop-in; other environments open as before, and `--check` under the
/// same sandbox says UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_shipped_unit_egress_is_refused_at_open_naming_the_drop_in() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sandcell_testing::skip!("root", "the daemon needs root");
    }
    if !sandcell_testing::on_path("systemd-analyze") {
        sandcell_testing::skip!(
            "root",
            "systemd-analyze (systemd) expands the unit's system-call groups"
        );
    }
    let sandbox = UnitSandbox::of_unit();
    // A warm pool is asked for: an environment whose Opens are refused must not hold one.
    let (_dir, conf) = write_conf(&format!("{EGRESS_ENV}pool_min = 1\n"));
    let named = |reason: &str| {
        for part in [
            "/usr/share/sandcell/egress/sandcelld.service.conf",
            "CAP_NET_ADMIN",
            "AF_INET",
        ] {
            assert!(reason.contains(part), "{part} not in: {reason}");
        }
    };

    let mut check = Command::new(env!("CARGO_BIN_EXE_sandcelld"));
    check.arg("--config").arg(&conf).arg("--check");
    sandbox.apply(&mut check);
    let out = check.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("egress sandbox:"))
        .unwrap_or_else(|| panic!("no egress line: {text}"));
    assert!(line.contains("UNAVAILABLE"), "{line}");
    named(line);

    let d = Daemon::start_in_sandbox(&conf, &[("SANDCELL_POOLS", "true")], &sandbox);
    assert!(
        d.log_text().contains("egress unavailable"),
        "{}",
        d.log_text()
    );
    let mut c = d.client().await;
    let refused = |e: sandcell_client::Error| match e {
        sandcell_client::Error::Kernel(KernelError::EgressUnavailable {
            environment,
            reason,
        }) => {
            assert_eq!(environment, "net");
            named(&reason);
        }
        other => panic!("expected EgressUnavailable: {other:?}"),
    };
    refused(
        c.open_in("python", Some("net"), None, None)
            .await
            .expect_err("an egress environment opens under the shipped unit"),
    );
    refused(
        c.run_collect_in("python", Some("net"), "print(1)", None)
            .await
            .expect_err("an egress environment runs under the shipped unit"),
    );
    let o = c
        .open_in("python", Some("python"), None, None)
        .await
        .expect("an environment without egress opens as before");
    let out = c.execute_collect(&o.session, "print(6 * 7)").await.unwrap();
    assert_eq!(out.stdout, "42\n");
    c.close(&o.session).await.unwrap();
    // The pools filled what can be used (the shipped python environment) and left the
    // egress environment empty.
    assert!(
        common::eventually(std::time::Duration::from_secs(60), || d
            .log_text()
            .contains("warm worker ready environment=python")),
        "{}",
        d.log_text()
    );
    assert!(
        !d.log_text().contains("warm worker ready environment=net"),
        "{}",
        d.log_text()
    );
}

/// A package index under `www/simple` (PEP 503: a page per project linking its files; the
/// test's web server's directory listings are such pages) offering one pure-Python wheel,
/// `sctoy` 1.0, whose module has `VALUE = 42`.
fn write_index(www: &std::path::Path) {
    let script = r#"import base64, hashlib, os, sys, zipfile
d = os.path.join(sys.argv[1], "simple", "sctoy")
os.makedirs(d, exist_ok=True)
files = {
    "sctoy/__init__.py": "VALUE = 42\n",
    "sctoy-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: sctoy\nVersion: 1.0\n",
    "sctoy-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: sandcell-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, text in files.items():
    h = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record += "%s,sha256=%s,%d\n" % (name, h, len(text.encode()))
record += "sctoy-1.0.dist-info/RECORD,,\n"
with zipfile.ZipFile(os.path.join(d, "sctoy-1.0-py3-none-any.whl"), "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
    z.writestr("sctoy-1.0.dist-info/RECORD", record)
"#;
    let st = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(script)
        .arg(www)
        .status()
        .unwrap();
    assert!(st.success(), "the test's wheel");
}

/// A cell that runs pip (in process: `pip._internal.cli.main`) against the test's index
/// through the proxy, into `site/` of the session's directory, and imports the package.
const PIP_CELL: &str = r#"import contextlib, io, os, sys
from pip._internal.cli.main import main as pip
buf = io.StringIO()
with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
    rc = pip(["install", "--no-cache-dir", "--disable-pip-version-check", "--no-input",
              "--index-url", "http://data.test/simple", "--trusted-host", "data.test",
              "--target", os.path.abspath("site"), "sctoy"])
print("pip rc", rc)
if rc:
    print(buf.getvalue()[-3000:])
sys.path.insert(0, os.path.abspath("site"))
import sctoy
print("sctoy", sctoy.VALUE)
"#;

/// A cell that floods the proxy for about 8 s: 300 connections at once (over its
/// connection cap: refused by the proxy with 403), each sending half a request head a byte
/// per second (slowloris), none finished.
const FLOOD_CELL: &str = r#"import socket, time
held = []
for _ in range(300):
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=2)
        s.sendall(b"GET http://data.test/hello.txt HTTP/1.1\r\n")
        held.append(s)
    except OSError:
        pass
end = time.time() + 8
while time.time() < end:
    for s in held:
        try:
            s.sendall(b"X")
        except OSError:
            pass
    time.sleep(1)
print("flooded", len(held))
"#;

/// While one session floods the proxy ([`FLOOD_CELL`]), another session's fetches stay
/// prompt and the daemon answers: each fetch well under the proxy's 10 s head timeout, which
/// a stalled proxy would reach.
async fn flood_beside_a_fetch(d: &Daemon, c: &mut sandcell_client::Client) {
    let mut flooder = d.client().await;
    let f = flooder
        .open_in("python", Some("net"), None, None)
        .await
        .expect("open the flooding session");
    let o = c
        .open_in("python", Some("net"), None, None)
        .await
        .expect("open the fetching session");
    // Its worker and grant are ready before the flood starts.
    let warm = c
        .execute_collect(&o.session, &subset_cell("data.test", "other.test"))
        .await
        .unwrap();
    assert!(
        warm.stdout.contains("allowed: hello through the proxy"),
        "{}",
        warm.stdout
    );
    let flood = async {
        flooder
            .execute_collect(&f.session, FLOOD_CELL)
            .await
            .unwrap()
    };
    let fetch = async {
        // Let the flood reach the proxy first.
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let cell = "import time, urllib.request\n\
                    worst = 0\n\
                    for _ in range(5):\n\
                    \x20   t = time.time()\n\
                    \x20   urllib.request.urlopen('http://data.test/hello.txt', timeout=30).read()\n\
                    \x20   worst = max(worst, time.time() - t)\n\
                    print('worst %.3f' % worst)\n";
        let t = std::time::Instant::now();
        let out = c.execute_collect(&o.session, cell).await.unwrap();
        (out, t.elapsed())
    };
    let (flooded, (fetched, took)) = tokio::join!(flood, fetch);
    let worst: f64 = fetched
        .stdout
        .trim()
        .strip_prefix("worst ")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{}\n{}", fetched.stdout, fetched.stderr));
    eprintln!(
        "egress flood: the other session's slowest of 5 fetches {worst:.3} s, its cell {took:?}; {}",
        flooded.stdout.trim()
    );
    assert!(
        worst < 5.0 && took < std::time::Duration::from_secs(8),
        "stalled by another session's flood: worst fetch {worst} s, cell {took:?}\n{}\n{}",
        flooded.stdout,
        d.log_text()
    );
    assert!(
        flooded.stdout.starts_with("flooded "),
        "{}\n{}",
        flooded.stdout,
        flooded.stderr
    );
    // The daemon answered throughout, and still does.
    let t = std::time::Instant::now();
    c.list_environments().await.expect("the daemon answers");
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    flooder.close(&f.session).await.unwrap();
    c.close(&o.session).await.unwrap();
}

/// Session `session`'s egress counters as `sandcellctl list --json` shows them over the bus
/// at `bus` for the daemon at `socket` (null when absent).
fn listed_egress(bus: &str, socket: &std::path::Path, session: &str) -> serde_json::Value {
    let o = Command::new(common::bin_dir().join("sandcellctl"))
        .args(["list", "--json"])
        .env("DBUS_SYSTEM_BUS_ADDRESS", bus)
        .env("SANDCELL_SOCKET", socket)
        .output()
        .unwrap();
    serde_json::from_slice::<serde_json::Value>(&o.stdout)
        .ok()
        .and_then(|v| {
            v.as_array()?
                .iter()
                .find(|r| r["id"] == session)
                .map(|r| r["egress"].clone())
        })
        .unwrap_or_default()
}

/// A cell that fetches `hello.txt` from `allowed` (retrying while the proxy is not yet
/// serving: 502) and tries `other`, printing `allowed: BODY` and `other: CODE REASON`.
/// Runs [`subset_cell`] for `www.sub.test` (allowed) and `data.test` (not in the session's
/// subset) in `session` and asserts both answers; `when` and `d`'s log go into the message.
async fn fetch_subset(c: &mut sandcell_client::Client, session: &str, d: &Daemon, when: &str) {
    let out = c
        .execute_collect(session, &subset_cell("www.sub.test", "data.test"))
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", d.log_text()));
    assert!(
        out.stdout.contains("allowed: hello through the proxy\n")
            && out
                .stdout
                .contains("other: 403 sandcell egress: host not allowed: data.test\n"),
        "{when}: {}\n{}\n{}",
        out.stdout,
        out.stderr,
        d.log_text()
    );
}

fn subset_cell(allowed: &str, other: &str) -> String {
    format!(
        r#"import time, urllib.request, urllib.error
body = None
for _ in range(50):
    try:
        body = urllib.request.urlopen("http://{allowed}/hello.txt", timeout=10).read().decode()
        break
    except urllib.error.HTTPError as e:
        body = "http %d %s" % (e.code, e.read().decode().strip())
        if e.code != 502:
            break
    time.sleep(0.2)
print("allowed:", body.strip())
try:
    urllib.request.urlopen("http://{other}/hello.txt", timeout=10)
    print("other: fetched")
except urllib.error.HTTPError as e:
    print("other:", e.code, e.read().decode().strip())
"#
    )
}

async fn fetch_through_the_proxy(tag: &str, sandbox: Option<&UnitSandbox>) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sandcell_testing::skip!("root", "the daemon and network namespaces need root");
    }
    if !common::pydata_available() {
        sandcell_testing::skip!("pydata", "/usr/bin/python3 cannot import numpy and pandas");
    }
    if !sandcell_testing::netns::ip_available() {
        sandcell_testing::skip!("netns", "iproute2's ip is missing");
    }
    let proxy_bin = common::bin_dir().join("sandcell-egress");
    if !proxy_bin.exists() {
        sandcell_testing::skip!(
            "built",
            "{} not built (cargo build --workspace)",
            proxy_bin.display()
        );
    }
    let dir = tempfile::Builder::new()
        .prefix("sandcell-egress-e2e-")
        .tempdir()
        .unwrap();
    let www = dir.path().join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("hello.txt"), "hello through the proxy\n").unwrap();
    write_index(&www);
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "11.0.0.2 data.test other.test www.sub.test\n").unwrap();
    let mut net = PrivateNet::new(tag);
    net.serve_http(&www);
    let control = dir.path().join("control");
    // Under the unit tier the proxy runs under its own unit's sandbox too
    // (units/sandcell-egress.service: its system-call filter, no capabilities,
    // no_new_privs), so what it asks of the kernel per relayed socket is checked there.
    let proxy_sandbox = sandbox.map(|_| UnitSandbox::from_unit(&unit_sandbox::egress_unit_path()));
    let start_proxy = |net: &mut PrivateNet| {
        let mut proxy = match &proxy_sandbox {
            Some(ps) => {
                let mut c = net.command_setns(PROXY_NS, &proxy_bin);
                ps.apply(&mut c);
                c
            }
            None => net.command_in(PROXY_NS, &proxy_bin),
        };
        proxy
            .arg("--control")
            .arg(&control)
            .arg("--hosts-file")
            .arg(&hosts)
            .arg("--hosts-only");
        net.spawn(proxy)
    };
    let mut proxy = start_proxy(&mut net);
    assert!(
        common::eventually(std::time::Duration::from_secs(10), || control.exists()),
        "the proxy did not bind its control socket"
    );
    let metrics = dir.path().join("metrics.prom");
    // R's download.file through the proxy too, where R is installed (outside the unit
    // sandbox: that tier checks the units, not the languages).
    let with_r = sandbox.is_none() && common::r_available();
    if sandbox.is_none() && !with_r {
        eprintln!("skipping R's download.file through the proxy: R is not installed");
    }
    let r_env = if with_r {
        "[environments.rnet]\nlanguage = \"r\"\nengine = \"native\"\n\
         egress = { hosts = [\"data.test\"], ports = [80] }\n"
    } else {
        ""
    };
    let (_cdir, conf) = write_conf(&format!(
        "[daemon]\nmetrics_file = \"{}\"\nmetrics_interval_seconds = 1\n\n\
         [environments.net]\nlanguage = \"python\"\nengine = \"native\"\n\
         interpreter = \"/usr/bin/python3\"\n\
         egress = {{ hosts = [\"data.test\", \"*.sub.test\"], ports = [80] }}\n{r_env}",
        metrics.display()
    ));
    let languages = if with_r { "python,r" } else { "python" };
    let cgroup = format!("sandcell-egress-{}", common::rand_hex(5));
    // A private system bus outside the unit sandbox: the session's counters on D-Bus.
    let bus = sandbox.is_none().then(common::bus::Bus::start);
    let mut env = vec![
        ("SANDCELL_EGRESS_CONTROL", control.to_str().unwrap()),
        ("SANDCELL_METRICS_FILE", metrics.to_str().unwrap()),
        ("SANDCELL_LANGUAGES", languages),
        ("SANDCELL_CGROUP_NAME", cgroup.as_str()),
    ];
    if let Some(b) = &bus {
        env.push(("DBUS_SYSTEM_BUS_ADDRESS", b.address.as_str()));
    }
    let mut d = match sandbox {
        Some(s) => Daemon::start_in_sandbox(&conf, &env, s),
        None => Daemon::start_with_config(&conf, &env),
    };
    let mut c = d.client().await;
    let o = c
        .open_in("python", Some("net"), None, None)
        .await
        .expect("open net");
    let cell = &subset_cell("data.test", "other.test");
    let out = c.execute_collect(&o.session, cell).await.unwrap();
    let t = &out.stdout;
    assert!(
        t.contains("allowed: hello through the proxy\n"),
        "{t}\n{}\n{}",
        out.stderr,
        d.log_text()
    );
    assert!(
        t.contains("other: 403 sandcell egress: host not allowed: other.test\n"),
        "{t}\n{}",
        out.stderr
    );
    if let Some(b) = &bus {
        // The session's object on D-Bus counts its requests (asked of the proxy every 2 s),
        // and sandcellctl list shows them.
        let listed = |json: bool| {
            let mut cmd = Command::new(common::bin_dir().join("sandcellctl"));
            cmd.arg("list")
                .env("DBUS_SYSTEM_BUS_ADDRESS", &b.address)
                .env("SANDCELL_SOCKET", &d.socket);
            if json {
                cmd.arg("--json");
            }
            let o = cmd.output().unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let counted = |text: &str| {
            serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| {
                    v.as_array()?
                        .iter()
                        .find(|r| r["id"] == o.session.as_str())
                        .map(|r| r["egress"].clone())
                })
                .filter(|e| e["allowed"].as_u64() >= Some(1) && e["refused"].as_u64() >= Some(1))
        };
        assert!(
            common::eventually(std::time::Duration::from_secs(10), || counted(&listed(
                true
            ))
            .is_some()),
            "no egress counters in sandcellctl list --json: {}\n{}",
            listed(true),
            d.log_text()
        );
        let e = counted(&listed(true)).unwrap();
        assert!(
            e["bytes"].as_u64() > Some(0) && e["connections"].as_u64() >= Some(1),
            "{e}"
        );
        let table = listed(false);
        let line = table
            .lines()
            .find(|l| l.starts_with(o.session.as_str()))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(table.starts_with("SESSION") && table.lines().next().unwrap().ends_with("EGRESS"));
        assert!(
            line.ends_with(&format!("{}/{}", e["allowed"], e["refused"])),
            "{table}"
        );
        eprintln!("egress: sandcellctl list shows the session's counters: {e}");
    }
    c.close(&o.session).await.unwrap();

    // A session that asks for a subset reaches only that subset: the rest of the
    // environment's list is a 403 with the reason.
    let o = c
        .open_with(&sandcell_proto::kernel::OpenParams {
            language: "python".into(),
            environment: Some("net".into()),
            egress: Some(vec!["www.sub.test".into()]),
            ..Default::default()
        })
        .await
        .expect("open net with a subset");
    let out = c
        .execute_collect(&o.session, &subset_cell("www.sub.test", "data.test"))
        .await
        .unwrap();
    assert!(
        out.stdout.contains("allowed: hello through the proxy\n"),
        "{}\n{}\n{}",
        out.stdout,
        out.stderr,
        d.log_text()
    );
    assert!(
        out.stdout
            .contains("other: 403 sandcell egress: host not allowed: data.test\n"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    // The session keeps its grant, its own subset, across a daemon crash: its keeper holds a
    // duplicate of the listener, the record names the hosts, and the successor that adopts
    // the session grants the listener again (under the unit's sandbox too: the successor
    // receives the keeper's descriptors over its Unix socket and hands the listener to the
    // proxy under the same seccomp filters).
    // Kept to the end: its directory holds the state and adoption directories.
    let mut _first: Option<Daemon> = None;
    let state = d.dir.path().join("state");
    let adopt = d.dir.path().join("adopt");
    {
        let _ = d.child.kill();
        let _ = d.child.wait();
        let mut env2: Vec<(&str, &str)> = env.to_vec();
        env2.push(("SANDCELL_STATE_DIR", state.to_str().unwrap()));
        env2.push(("SANDCELL_ADOPT_DIR", adopt.to_str().unwrap()));
        let second = match sandbox {
            Some(s) => Daemon::start_on_in_sandbox(&d.socket.clone(), &conf, &env2, s),
            None => Daemon::start_on_with_config(&d.socket.clone(), &conf, &env2),
        };
        c = second.client().await;
        fetch_subset(&mut c, &o.session, &second, "after the restart").await;
        if let Some(b) = &bus {
            // Its counters, and so its budgets, go on from what it used before the crash (one
            // request served and one refused then, the same again now): the proxy kept them
            // when the crash revoked the grant.
            let egress = || listed_egress(&b.address, &second.socket, &o.session);
            assert!(
                common::eventually(std::time::Duration::from_secs(10), || {
                    let e = egress();
                    e["allowed"].as_u64() >= Some(2) && e["refused"].as_u64() >= Some(2)
                }),
                "the adopted session's egress counters started again from zero: {}\n{}",
                egress(),
                second.log_text()
            );
            eprintln!(
                "egress: the adopted session's counters went on across the crash: {}",
                egress()
            );
        }
        // The proxy restarts (killed, then started again) while the session lives: its
        // grants ended with it, and the daemon asks again until the new proxy answers, from
        // the counters it last read. The session's next fetch goes through.
        net.stop(proxy);
        let t_proxy = std::time::Instant::now();
        proxy = start_proxy(&mut net);
        fetch_subset(&mut c, &o.session, &second, "after the proxy's restart").await;
        assert!(
            second.log_text().contains("egress granted again"),
            "{}",
            second.log_text()
        );
        eprintln!(
            "egress: the session fetched through a restarted proxy ({:.1} s after its kill)",
            t_proxy.elapsed().as_secs_f64()
        );
        eprintln!(
            "egress: the adopted session fetched through its grant again ({})",
            if sandbox.is_some() {
                "under the unit's sandbox"
            } else {
                "without the unit's sandbox"
            }
        );
        _first = Some(std::mem::replace(&mut d, second));
    }
    c.close(&o.session).await.unwrap();
    // A one-shot Run's subset likewise.
    c.run_with(&sandcell_proto::kernel::RunParams {
        language: "python".into(),
        code: subset_cell("data.test", "www.sub.test"),
        environment: Some("net".into()),
        egress: Some(vec!["data.test".into()]),
        ..Default::default()
    })
    .await
    .expect("run net with a subset");
    let out = c.finish(|_| {}).await.expect("the run's result");
    assert!(
        out.stdout.contains("allowed: hello through the proxy\n")
            && out
                .stdout
                .contains("other: 403 sandcell egress: host not allowed: www.sub.test\n"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    // Never more than the environment's list: a typed error naming the host, before any
    // worker starts; and no egress at all for an environment without it.
    for (environment, host, says) in [
        ("net", "other.test", "other.test"),
        ("net", "*.test", "*.test"),
        ("net", "not a name", "not a DNS host name"),
        ("pydata", "data.test", "has no egress"),
    ] {
        let p = sandcell_proto::kernel::OpenParams {
            language: "python".into(),
            environment: Some(environment.into()),
            egress: Some(vec![host.into()]),
            ..Default::default()
        };
        match c.open_with(&p).await {
            Err(sandcell_client::Error::Kernel(KernelError::InvalidParameter {
                parameter,
                reason,
            })) => {
                assert_eq!(parameter, "egress");
                assert!(reason.contains(says), "{environment} {host}: {reason}");
            }
            other => panic!("{environment} {host}: {other:?}"),
        }
    }
    // pip through the proxy: an index the test serves, pip's own --index-url, the wheel
    // installed into the session's directory and imported.
    if sandbox.is_none() {
        let o = c
            .open_in("python", Some("net"), None, None)
            .await
            .expect("open net for pip");
        let out = c.execute_collect(&o.session, PIP_CELL).await.unwrap();
        assert!(
            out.stdout.contains("pip rc 0\n") && out.stdout.contains("sctoy 42\n"),
            "{}\n{}\n{}",
            out.stdout,
            out.stderr,
            d.log_text()
        );
        c.close(&o.session).await.unwrap();
    }
    if with_r {
        let o = c
            .open_in("r", Some("rnet"), None, None)
            .await
            .expect("open rnet");
        let out = c
            .execute_collect(
                &o.session,
                "r <- download.file('http://data.test/hello.txt', 'got.txt', quiet = TRUE)\n\
                 cat('r status', r, readLines('got.txt'), '\\n')\n\
                 said <- character()\n\
                 e <- withCallingHandlers(tryCatch({ download.file('http://other.test/hello.txt', \
                 'no.txt', method = 'libcurl', quiet = TRUE); 'fetched' }, \
                 error = function(e) conditionMessage(e)), warning = function(w) { \
                 said <<- c(said, conditionMessage(w)); invokeRestart('muffleWarning') })\n\
                 cat('other:', e, said, '\\n')\n",
            )
            .await
            .unwrap();
        assert!(
            out.stdout.contains("r status 0 hello through the proxy"),
            "{}\n{}\n{}",
            out.stdout,
            out.stderr,
            d.log_text()
        );
        assert!(
            out.stdout.contains("other:") && out.stdout.contains("403"),
            "{}\n{}",
            out.stdout,
            out.stderr
        );
        c.close(&o.session).await.unwrap();
    }
    // The metrics file sums the sessions' egress since this daemon started (the successor
    // of the crash above): the adopted session's and the one-shot Run's fetches, each one
    // request served and one refused, bytes relayed (and pip's and R's requests, when they
    // ran).
    let sample = |text: &str, name: &str, label: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    let counted = || {
        let text = std::fs::read_to_string(&metrics).unwrap_or_default();
        sample(
            &text,
            "sandcell_egress_requests_total{",
            "outcome=\"allowed\"",
        )
        .is_some_and(|n| n >= 2)
            && sample(
                &text,
                "sandcell_egress_requests_total{",
                "outcome=\"refused\"",
            )
            .is_some_and(|n| n >= 2)
            && sample(&text, "sandcell_egress_bytes_total{", "node=").is_some_and(|b| b > 300)
    };
    assert!(
        common::eventually(std::time::Duration::from_secs(15), counted),
        "{}",
        std::fs::read_to_string(&metrics).unwrap_or_default()
    );
    // The hostile suite with egress on: a flood beside another session's fetches.
    if sandbox.is_none() {
        flood_beside_a_fetch(&d, &mut c).await;
    }

    // An environment without egress: no TCP socket at all, whatever the unit allows.
    let o = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .expect("open pydata");
    let out = c
        .execute_collect(
            &o.session,
            "import socket\ntry:\n    socket.socket()\n    print('tcp ok')\n\
             except OSError as e:\n    print('tcp errno', e.errno)\n",
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "tcp errno 1\n", "{}", out.stderr);
    c.close(&o.session).await.unwrap();

    // The daemon and the proxy die together while a cell that fetched runs on: neither the
    // proxy's memory nor the record (written at the cell's start, with the counters read
    // before its fetches) holds what the session used; the counters file beside the record,
    // rewritten at each read (every 2 s), does, and the successor's grant goes on from it.
    let o = c
        .open_with(&sandcell_proto::kernel::OpenParams {
            language: "python".into(),
            environment: Some("net".into()),
            egress: Some(vec!["www.sub.test".into()]),
            detached_idle_seconds: Some(600),
            ..Default::default()
        })
        .await
        .expect("open net with a subset");
    let running = format!(
        "{}print('fetched', flush=True)\nwhile True:\n    time.sleep(0.1)\n",
        subset_cell("www.sub.test", "data.test")
    );
    let cell = c.submit(&o.session, &running).await.unwrap();
    let counts_file = adopt.join(format!("{}.egress", o.session));
    let read_counts = || -> serde_json::Value {
        std::fs::read(&counts_file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    };
    assert!(
        common::eventually(std::time::Duration::from_secs(10), || {
            let e = read_counts();
            e["allowed"].as_u64() >= Some(1) && e["refused"].as_u64() >= Some(1)
        }),
        "the counters file {}: {}",
        counts_file.display(),
        read_counts()
    );
    let _ = d.child.kill();
    let _ = d.child.wait();
    net.stop(proxy);
    start_proxy(&mut net);
    let mut env3: Vec<(&str, &str)> = env.to_vec();
    env3.push(("SANDCELL_STATE_DIR", state.to_str().unwrap()));
    env3.push(("SANDCELL_ADOPT_DIR", adopt.to_str().unwrap()));
    let third = match sandbox {
        Some(s) => Daemon::start_on_in_sandbox(&d.socket.clone(), &conf, &env3, s),
        None => Daemon::start_on_with_config(&d.socket.clone(), &conf, &env3),
    };
    let mut c = third.client().await;
    if let Some(b) = &bus {
        let egress = || listed_egress(&b.address, &third.socket, &o.session);
        // Before any new request: what the adopted grant started from.
        assert!(
            common::eventually(std::time::Duration::from_secs(10), || {
                let e = egress();
                e["allowed"].as_u64() >= Some(1) && e["refused"].as_u64() >= Some(1)
            }),
            "the adopted session's counters were lost with the daemon and the proxy: {}\n{}",
            egress(),
            third.log_text()
        );
        eprintln!(
            "egress: the counters went on across the daemon's and the proxy's death: {}",
            egress()
        );
    }
    c.interrupt(&o.session, cell).await.unwrap();
    c.attach(&o.session, cell).await.unwrap();
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), c.finish(|_| {}))
        .await
        .expect("the interrupted cell ended")
        .unwrap();
    assert!(
        out.stdout.contains("allowed: hello through the proxy\n")
            && out.stdout.contains("fetched\n"),
        "{}\n{}\n{}",
        out.stdout,
        out.stderr,
        third.log_text()
    );
    fetch_subset(
        &mut c,
        &o.session,
        &third,
        "after the daemon and the proxy died",
    )
    .await;

    // A session whose hosts the environment no longer allows when a successor adopts it
    // (the operator narrowed the list, then the daemon restarted): no grant, and its
    // listener is shut, so a connect is refused at once instead of waiting in a backlog
    // nobody serves until the cell's timeout.
    let mut d = third;
    let _ = d.child.kill();
    let _ = d.child.wait();
    let (_ndir, narrowed) = write_conf(
        "[environments.net]\nlanguage = \"python\"\nengine = \"native\"\n\
         interpreter = \"/usr/bin/python3\"\n\
         egress = { hosts = [\"data.test\"], ports = [80] }\n",
    );
    let fourth = match sandbox {
        Some(s) => Daemon::start_on_in_sandbox(&d.socket.clone(), &narrowed, &env3, s),
        None => Daemon::start_on_with_config(&d.socket.clone(), &narrowed, &env3),
    };
    let mut c = fourth.client().await;
    let out = c
        .execute_collect(
            &o.session,
            "import time, urllib.request\nt = time.monotonic()\ntry:\n    \
             urllib.request.urlopen('http://www.sub.test/hello.txt', timeout=60)\n    \
             print('fetched')\nexcept Exception as e:\n    print('error', repr(e))\n\
             print('after %.1f s' % (time.monotonic() - t))\n",
        )
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", fourth.log_text()));
    assert!(
        out.stdout.contains("Connection refused"),
        "{}\n{}\n{}",
        out.stdout,
        out.stderr,
        fourth.log_text()
    );
    let secs: f64 = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("after ")?.strip_suffix(" s")?.parse().ok())
        .unwrap_or(f64::MAX);
    assert!(secs < 10.0, "{}", out.stdout);
    eprintln!(
        "egress: a session whose hosts left the list was refused after {secs:.1} s: {}",
        out.stdout.lines().next().unwrap_or_default()
    );
    c.close(&o.session).await.unwrap();
    assert!(
        common::eventually(std::time::Duration::from_secs(10), || !counts_file.exists()),
        "{} outlived its session",
        counts_file.display()
    );
    drop(d);
}
