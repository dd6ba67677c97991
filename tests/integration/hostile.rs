//! Hostile cells: each asserts that the wall holds AND that the daemon and a
//! second, concurrent session are unaffected. Python cells meet two walls (WASI inside Eryx,
//! then the OS confinement of the worker); R cells meet only the OS confinement.

use crate::common;

use common::{Daemon, eventually, r_available};
use sandcell_client::{Client, Collected, Status};
use std::time::Duration;

/// A bystander session that must keep working while hostile cells run next to it.
struct Bystander {
    client: Client,
    session: String,
    n: u64,
}

impl Bystander {
    async fn new(d: &Daemon) -> Bystander {
        let mut client = d.client().await;
        let session = client.open("python", None, None).await.unwrap().session;
        client.execute_collect(&session, "acc = 0").await.unwrap();
        Bystander {
            client,
            session,
            n: 0,
        }
    }

    /// Adds to its own state and checks the state is intact.
    async fn check(&mut self) {
        self.n += 1;
        let out = self
            .client
            .execute_collect(&self.session, "acc += 1\nprint(acc)")
            .await
            .unwrap();
        assert_eq!(
            out.result.status,
            Status::Ok,
            "bystander broke: {:?}",
            out.result
        );
        assert_eq!(
            out.stdout.trim(),
            self.n.to_string(),
            "bystander state changed"
        );
    }
}

async fn run(c: &mut Client, lang: &str, code: &str) -> Collected {
    c.run_collect(lang, code, None).await.unwrap()
}

fn daemon(extra: &[(&str, &str)]) -> Daemon {
    let mut env = vec![
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "4"),
        ("SANDCELL_LANGUAGES", "python,r"),
    ];
    if !std::path::Path::new("/usr/lib/R/bin/exec/R").exists() {
        env[1].1 = "python";
    }
    env.extend_from_slice(extra);
    Daemon::start(&env)
}

#[tokio::test]
async fn python_file_system_network_and_process_walls() {
    let d = daemon(&[]);
    let mut by = Bystander::new(&d).await;
    let mut c = d.client().await;
    let cases = [
        ("read /etc/shadow", "print(open('/etc/shadow').read())"),
        ("list /root", "import os\nprint(os.listdir('/root'))"),
        (
            "write outside",
            "open('/var/tmp/sandcell-escape', 'w').write('x')",
        ),
        (
            "tcp to 127.0.0.1",
            "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))",
        ),
        (
            "udp",
            "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 53))",
        ),
        (
            "unix socket of the daemon",
            &format!(
                "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})",
                d.socket.display().to_string()
            ),
        ),
        (
            "signal the daemon",
            &format!("import os\nos.kill({}, 9)", d.pid()),
        ),
        (
            "spawn a process",
            "import subprocess\nsubprocess.run(['id'])",
        ),
        ("fork", "import os\nos.fork()"),
        ("read /proc/1", "print(open('/proc/1/cmdline').read())"),
    ];
    for (what, code) in cases {
        let out = run(&mut c, "python", code).await;
        assert_eq!(
            out.result.status,
            Status::Error,
            "{what}: not blocked: {out:?}"
        );
        by.check().await;
    }
    assert!(!std::path::Path::new("/var/tmp/sandcell-escape").exists());
    assert!(d.child_alive());
}

#[tokio::test]
async fn python_resource_bombs_are_contained() {
    let d = daemon(&[
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "3"),
        ("SANDCELL_MAX_STDOUT_BYTES", "4096"),
        ("SANDCELL_MAX_FUEL", "1000000000000000"),
    ]);
    let mut by = Bystander::new(&d).await;
    let mut c = d.client().await;
    let out = run(&mut c, "python", "x = bytearray(1 << 30)").await;
    assert_eq!(
        out.result.status,
        Status::MemoryExhausted,
        "{:?}",
        out.result
    );
    by.check().await;
    let out = run(&mut c, "python", "while True:\n    pass").await;
    assert_eq!(out.result.status, Status::Timeout, "{:?}", out.result);
    by.check().await;
    let out = run(
        &mut c,
        "python",
        "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)",
    )
    .await;
    assert_eq!(out.result.stdout.kept, 4096);
    assert!(out.result.stdout.seen > 4096);
    by.check().await;
    assert!(d.child_alive());
}

#[tokio::test]
async fn r_walls_hold() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "10")]);
    let mut by = Bystander::new(&d).await;
    let mut c = d.client().await;
    let pid = d.pid();
    let cases: Vec<(&str, String)> = vec![
        ("read /etc/shadow", "readLines('/etc/shadow')".into()),
        (
            "list /root",
            "stopifnot(length(list.files('/root', all.files = TRUE)) > 0)".into(),
        ),
        (
            "write outside",
            "writeLines('x', '/etc/sandcell-escape-r')".into(),
        ),
        (
            "tcp to 127.0.0.1",
            "con <- socketConnection('127.0.0.1', 22, timeout = 2); close(con)".into(),
        ),
        (
            "signal the daemon",
            format!("stopifnot(tools::pskill({pid}, 9))"),
        ),
        (
            "read the daemon's /proc",
            format!("readLines('/proc/{pid}/cmdline')"),
        ),
        (
            "shell reads /etc/shadow",
            "stopifnot(system('cat /etc/shadow > /dev/null') == 0)".into(),
        ),
        (
            "shell network",
            "stopifnot(system('exec 3<>/dev/tcp/127.0.0.1/22') == 0)".into(),
        ),
    ];
    for (what, code) in cases {
        let out = run(&mut c, "r", &code).await;
        assert_eq!(
            out.result.status,
            Status::Error,
            "{what}: not blocked: {out:?}"
        );
        by.check().await;
    }
    assert!(!std::path::Path::new("/etc/sandcell-escape-r").exists());
    // A write to /tmp lands in the session's private /tmp, never the host's.
    let out = run(&mut c, "r", "writeLines('x', '/tmp/sandcell-escape-r')").await;
    assert_eq!(out.result.status, Status::Ok, "{out:?}");
    assert!(!std::path::Path::new("/tmp/sandcell-escape-r").exists());
    assert!(d.child_alive());
}

#[tokio::test]
async fn r_processes_are_confined_and_reaped() {
    if !r_available() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "20")]);
    let mut by = Bystander::new(&d).await;
    let mut c = d.client().await;
    // Inspection from inside: identity, capabilities, no_new_privs, seccomp, cgroup, fds.
    let out = run(&mut c, "r", "s <- readLines('/proc/self/status'); cat(grep('^(Uid|Gid|Groups|CapEff|CapBnd|CapPrm|NoNewPrivs|Seccomp):', s, value = TRUE), sep = '\\n'); cat(readLines('/proc/self/cgroup'), sep = '\\n'); cat('fds', sort(as.integer(list.files('/proc/self/fd'))), '\\n')").await;
    assert_eq!(out.result.status, Status::Ok, "{out:?}");
    let s = out.stdout;
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
    };
    if !common::insecure() {
        let uid: u64 = field("Uid:")[0].parse().unwrap();
        assert!(uid >= 3_000_000_000, "worker uid {uid}");
        assert!(field("Groups:").is_empty(), "{s}");
        assert_eq!(field("CapEff:")[0], "0000000000000000");
        assert_eq!(field("CapBnd:")[0], "0000000000000000");
        assert_eq!(field("NoNewPrivs:")[0], "1");
        assert_eq!(field("Seccomp:")[0], "2");
        assert!(s.contains("/sessions/"), "not in a session cgroup: {s}");
    }
    by.check().await;
    // Fork bomb: pids.max holds, the daemon and the bystander live.
    let out = run(
        &mut c,
        "r",
        "system(':(){ :|:& };:', wait = TRUE); cat('after\\n')",
    )
    .await;
    assert_ne!(out.result.status, Status::WorkerCrashed, "{out:?}");
    by.check().await;
    // Grandchildren left running are gone when the session ends.
    let mut s = d.client().await;
    let sess = s.open("r", None, None).await.unwrap().session;
    s.execute_collect(&sess, "system('sleep 1000 &')")
        .await
        .unwrap();
    s.close(&sess).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || d
            .descendants()
            .iter()
            .all(|p| !cmdline(*p).contains("sleep"))),
        "grandchild survived its session"
    );
    // Memory bomb: OOM or allocation error, host unharmed.
    let out = run(&mut c, "r", "x <- numeric(4e9); cat(length(x))").await;
    assert!(
        matches!(
            out.result.status,
            Status::Oom | Status::MemoryExhausted | Status::Error
        ),
        "{:?}",
        out.result
    );
    by.check().await;
    assert!(d.child_alive());
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}
