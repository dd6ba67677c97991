//! The hostile suite at every Landlock level the confinement policy distinguishes.
//!
//! Each test starts one real daemon (root, strict mode, cgroups) whose Landlock ABI is lowered
//! with the test-only `SANDCELL_TEST_LANDLOCK_ABI` (`none`: no Landlock, the mount namespace
//! alone), and runs the same R and Python cells at each level: ordinary file handling inside
//! the session directory works (a tempfile renamed into it, a rename across its directories,
//! a PNG plot, Python file I/O), and every hostile cell fails the same way, with no effect on
//! the host (lowering the worker's own `oom_score_adj` included). Levels above the running
//! kernel's ABI are skipped, saying so.

use crate::common;

use common::{Daemon, r_available};
use sandcell_client::{Client, Collected, Status};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The tier `level` lacks here and why, if it cannot run.
fn skip(level: &str) -> Option<(&'static str, String)> {
    if !is_root() {
        return Some(("root", "needs root (strict mode)".into()));
    }
    if common::insecure() {
        return Some((
            "cgroups",
            "SANDCELL_TEST_INSECURE is set: the levels are a strict-mode matter".into(),
        ));
    }
    let kernel = sandcell_confine::landlock::kernel_abi().unwrap_or(0);
    match level.parse::<i32>() {
        Ok(n) if n > kernel => Some((
            "landlock",
            format!("the kernel's landlock abi is {kernel} < {n}"),
        )),
        _ => None,
    }
}

/// A world-writable directory outside every session, with a world-writable file in it: only
/// the sandbox keeps a cell from them.
struct Outside {
    dir: PathBuf,
    victim: PathBuf,
}

impl Outside {
    fn new(level: &str) -> Outside {
        let dir = PathBuf::from(format!(
            "/var/tmp/sandcell-levels-{}-{level}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o666)).unwrap();
        Outside { dir, victim }
    }

    /// Nothing but the victim, intact.
    fn assert_untouched(&self, level: &str) {
        assert_eq!(
            std::fs::read_to_string(&self.victim).unwrap(),
            "precious",
            "level {level}: the victim changed"
        );
        let names: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["victim".to_string()], "level {level}");
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn exec(c: &mut Client, session: &str, code: &str) -> Collected {
    c.execute_collect(session, code).await.unwrap()
}

fn oom_score_adj(pid: u32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether this process's effective capabilities include CAP_SYS_RESOURCE (bit 24), which the
/// daemon it starts then inherits.
fn has_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

/// With CAP_SYS_RESOURCE the daemon's write of 1000 also raised each worker's
/// `oom_score_adj_min` (proc(5)): even root without that capability cannot lower it.
fn oom_floor_holds(level: &str, workers: &[u32]) {
    if !has_sys_resource() {
        sandcell_testing::skip_part!(
            "sys-resource",
            "level {level}: no CAP_SYS_RESOURCE here, so the daemon cannot raise the workers' \
             oom_score_adj_min; the read-only procfs and Landlock hold the value instead"
        );
        return;
    }
    for &w in workers {
        if oom_score_adj(w) != Some(1000) {
            continue;
        }
        let st = Command::new("setpriv")
            .args(["--bounding-set", "-sys_resource", "--", "sh", "-c"])
            .arg(format!("echo 0 > /proc/{w}/oom_score_adj"))
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(
            !st.success(),
            "level {level}: worker {w}'s oom_score_adj lowered by a process without CAP_SYS_RESOURCE"
        );
        assert_eq!(oom_score_adj(w), Some(1000), "level {level}: worker {w}");
    }
}

/// The whole suite at one level.
async fn suite(level: &str) {
    if let Some((tier, why)) = skip(level) {
        sandcell_testing::skip!(tier, "level {level}: {why}");
    }
    let outside = Outside::new(level);
    let languages = if r_available() {
        "python,r"
    } else {
        sandcell_testing::skip_part!("r", "level {level}: R is not installed, Python only");
        "python"
    };
    let d = Daemon::start(&[
        ("SANDCELL_LANGUAGES", languages),
        ("SANDCELL_TEST_LANDLOCK_ABI", level),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "4"),
        ("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "20"),
    ]);
    let log = d.log_text();
    let want_abi = match level.parse::<i32>() {
        Ok(n) if n >= 2 => format!("landlock_abi=Some({n})"),
        _ => "landlock_abi=None".into(),
    };
    assert!(log.contains("TEST ONLY"), "the cap is not logged:\n{log}");
    assert!(
        log.contains(&want_abi),
        "level {level}: {want_abi} not in:\n{log}"
    );
    assert!(log.contains("strict"), "level {level}: not strict:\n{log}");
    assert!(
        log.contains("mount-namespace"),
        "level {level}: no mount namespace:\n{log}"
    );
    let mut c = d.client().await;
    let pid = d.pid();

    // Python (Eryx): file handling inside /mnt/data works; host files stay out of reach.
    let py = c.open("python", None, None).await.unwrap().session;
    let out = exec(
        &mut c,
        &py,
        "import os, tempfile\n\
         os.makedirs('d', exist_ok=True)\n\
         open('a.txt', 'w').write('hello')\n\
         os.rename('a.txt', 'd/a.txt')\n\
         with tempfile.NamedTemporaryFile('w', dir='.', delete=False) as f:\n    f.write('t')\n    name = f.name\n\
         os.replace(name, 'final.txt')\n\
         print(open('d/a.txt').read(), open('final.txt').read())",
    )
    .await;
    assert_eq!(out.result.status, Status::Ok, "level {level}: {out:?}");
    assert_eq!(out.stdout.trim(), "hello t", "level {level}");
    for (what, code) in [
        (
            "read /etc/shadow",
            "print(open('/etc/shadow').read())".to_string(),
        ),
        (
            "read /etc/hostname",
            "print(open('/etc/hostname').read())".into(),
        ),
        (
            "write outside",
            format!(
                "open({:?}, 'w').write('x')",
                outside.dir.join("py").display().to_string()
            ),
        ),
        ("signal the daemon", format!("import os\nos.kill({pid}, 9)")),
    ] {
        let out = exec(&mut c, &py, &code).await;
        assert_eq!(
            out.result.status,
            Status::Error,
            "level {level}: {what}: {out:?}"
        );
    }

    if r_available() {
        let r = c.open("r", None, None).await.unwrap().session;
        // Ordinary R file handling: tempfile() lives in a subdirectory of the session, so
        // renaming it into the session directory crosses directories.
        let out = exec(
            &mut c,
            &r,
            "tf <- tempfile(fileext = '.txt'); writeLines('hello', tf)\n\
             stopifnot(file.rename(tf, 'moved.txt'))\n\
             dir.create('sub'); writeLines('x', 'sub/a.txt')\n\
             stopifnot(file.rename('sub/a.txt', 'b.txt'))\n\
             png('plot.png'); plot(1:10); invisible(dev.off())\n\
             stopifnot(file.info('plot.png')$size > 0)\n\
             cat(readLines('moved.txt'), readLines('/proc/self/oom_score_adj'), '\\n')",
        )
        .await;
        assert_eq!(out.result.status, Status::Ok, "level {level}: {out:?}");
        assert_eq!(out.stdout.trim(), "hello 1000", "level {level}");

        // A cell cannot lower its OOM score back towards the daemon's (-500 under the unit):
        // neither R itself nor a child of it, through /proc/self or its parent's /proc entry.
        let out = exec(
            &mut c,
            &r,
            "for (v in c('0', '-500')) {\n\
               ok <- tryCatch({ writeLines(v, '/proc/self/oom_score_adj'); TRUE },\n\
                              error = function(e) FALSE, warning = function(w) FALSE)\n\
               if (ok) stop('lowered to ', v)\n\
             }\n\
             system(paste0('echo -500 > /proc/', Sys.getpid(), '/oom_score_adj 2>/dev/null'))\n\
             system('echo 0 > /proc/self/oom_score_adj 2>/dev/null')\n\
             cat(readLines('/proc/self/oom_score_adj'), '\\n')",
        )
        .await;
        assert_eq!(out.result.status, Status::Ok, "level {level}: {out:?}");
        assert_eq!(
            out.stdout.split_whitespace().collect::<Vec<_>>(),
            ["1000"],
            "level {level}: a cell lowered its oom_score_adj: {out:?}"
        );
        oom_floor_holds(level, &d.descendants());

        // Every worker is the OOM killer's first choice, whatever the daemon's own score.
        let workers = d.descendants();
        assert!(!workers.is_empty());
        for w in workers {
            if let Some(adj) = oom_score_adj(w) {
                assert_eq!(adj, 1000, "level {level}: worker {w}");
            }
        }

        let socket = d.socket.display().to_string();
        let victim = outside.victim.display().to_string();
        let out_dir = outside.dir.display().to_string();
        let cases: Vec<(&str, String)> = vec![
            ("read /etc/shadow", "readLines('/etc/shadow')".into()),
            ("read /etc/hostname", "readLines('/etc/hostname')".into()),
            (
                "list /root",
                "stopifnot(length(list.files('/root', all.files = TRUE)) > 0)".into(),
            ),
            ("write outside", format!("writeLines('x', '{out_dir}/r')")),
            (
                "truncate a world-writable host file",
                format!("stopifnot(system('truncate -s 0 {victim}') == 0)"),
            ),
            (
                "rename out of the session",
                format!(
                    "writeLines('x', 'out.txt'); stopifnot(file.rename('out.txt', '{out_dir}/moved'))"
                ),
            ),
            (
                "hard-link a host file in",
                "stopifnot(file.link('/etc/passwd', 'pw'))".into(),
            ),
            (
                "hard-link the victim in",
                format!("stopifnot(file.link('{victim}', 'v'))"),
            ),
            (
                "connect to the daemon's socket",
                format!(
                    "stopifnot(system2('/usr/bin/python3', c('-c', shQuote('import socket; \
                     socket.socket(socket.AF_UNIX).connect(\"{socket}\")'))) == 0)"
                ),
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
                "leave the session cgroup",
                "writeLines(as.character(Sys.getpid()), '/sys/fs/cgroup/pids/cgroup.procs')".into(),
            ),
            (
                "execute a binary dropped into the session",
                "file.copy('/bin/true', 't'); Sys.chmod('t', '755'); stopifnot(system('./t') == 0)"
                    .into(),
            ),
        ];
        for (what, code) in cases {
            let out = exec(&mut c, &r, &code).await;
            assert_eq!(
                out.result.status,
                Status::Error,
                "level {level}: {what}: {out:?}"
            );
        }
        // The session survives its hostile cells.
        let out = exec(&mut c, &r, "cat(readLines('moved.txt'))").await;
        assert_eq!(out.stdout, "hello", "level {level}: {out:?}");
    }
    assert!(d.child_alive(), "level {level}: the daemon died");
    outside.assert_untouched(level);
}

macro_rules! level {
    ($name:ident, $level:expr) => {
        #[tokio::test]
        async fn $name() {
            suite($level).await;
        }
    };
}

level!(landlock_abi_7, "7");
level!(landlock_abi_6, "6");
level!(landlock_abi_5, "5");
level!(landlock_abi_4, "4");
level!(landlock_abi_3, "3");
level!(landlock_abi_2_debian_12, "2");
level!(landlock_abi_1, "1");
level!(landlock_none_mount_namespace_only, "none");

/// `sandcelld --check` at a lowered ABI: kernel, ABI, cgroups and each layer's state, exit 0
/// when strict mode would start.
#[test]
fn check_prints_the_layers_at_each_level() {
    if !is_root() {
        sandcell_testing::skip!("root", "needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("none.toml");
    std::fs::write(&config, "").unwrap();
    let kernel = sandcell_confine::landlock::kernel_abi().unwrap_or(0);
    for (level, want) in [
        (
            "2",
            vec![
                "landlock-refer       active",
                "landlock-truncate    missing",
            ],
        ),
        ("1", vec!["landlock-fs          substituted"]),
        ("none", vec!["landlock-fs          missing"]),
    ] {
        if level.parse::<i32>().is_ok_and(|n| n > kernel) {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_sandcelld"))
            .arg("--config")
            .arg(&config)
            .arg("--check")
            .env("SANDCELL_TEST_LANDLOCK_ABI", level)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "level {level}:\n{text}");
        for w in want.iter().chain(&[
            "mount-namespace      active",
            "kernel:",
            "cgroups:",
            "strict mode: would start",
        ]) {
            assert!(text.contains(w), "level {level}: {w:?} not in\n{text}");
        }
        assert!(text.contains("TEST ONLY"), "{text}");
    }
}
