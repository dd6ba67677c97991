//! Hostile tenants against the real daemon: the disk budget (hidden names, scratch, sparse
//! files, inodes, block reservations), host-global kernel resources (legacy AIO, sync),
//! authorization edges (polkit installed but not answering, sessions private on D-Bus), and
//! `sandcellctl run --artifacts` as a target (nothing overwritten or planted; odd names
//! reachable and printed escaped).
//!
//! R cells reach native code through `system()`: the probes below run `perl`'s `syscall`
//! in the cell's child, which inherits the worker's seccomp filter (a filter can never be
//! removed, so what the child cannot do the R process cannot either).

use crate::common;

use common::bus::{Bus, Out, run_input};
use common::{Daemon, eventually};
use sandcell_client::{Client, Error, FileKind, KernelError, Status};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn has_r() -> bool {
    Path::new("/usr/lib/R/bin/exec/R").exists() && Path::new("/usr/bin/perl").exists()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn r_daemon(extra: &[(&str, &str)]) -> Daemon {
    let mut env = vec![("SANDCELL_LANGUAGES", "r")];
    env.extend_from_slice(extra);
    Daemon::start(&env)
}

fn session_dir(d: &Daemon, session: &str) -> PathBuf {
    d.dir.path().join("state/sessions").join(session)
}

fn kernel_error(r: Result<impl std::fmt::Debug, Error>) -> KernelError {
    match r {
        Err(Error::Kernel(e)) => e,
        other => panic!("expected a named error, got {other:?}"),
    }
}

/// A Perl program run by an R cell through `system()`: each line prints `name=RESULT
/// errno=N` for one raw system call.
const SYSCALL_PROBE: &str = r#"
use strict;
my ($r, $ctx);
$ctx = pack("Q", 0);
$r = syscall(206, 1, $ctx);                      # io_setup(1, &ctx)
print "io_setup=$r errno=", $!+0, "\n";
$r = syscall(162);                               # sync()
print "sync=$r errno=", $!+0, "\n";
open(my $d, "<", "/dev/null") or die;
$r = syscall(306, fileno($d));                   # syncfs(fd)
print "syncfs=$r errno=", $!+0, "\n";
open(my $f, ">", "reserved") or die;
$r = syscall(285, fileno($f), 1, 0, 1073741824);  # fallocate(KEEP_SIZE, 1 GiB)
print "keep_size=$r errno=", $!+0, "\n";
$r = syscall(285, fileno($f), 0x11, 0, 1073741824);  # ZERO_RANGE|KEEP_SIZE
print "zero_keep=$r errno=", $!+0, "\n";
$r = syscall(285, fileno($f), 0, 0, 4096);       # mode 0 stays allowed
print "mode0=$r errno=", $!+0, "\n";
$r = syscall(285, fileno($f), 3, 0, 4096);       # PUNCH_HOLE|KEEP_SIZE stays allowed
print "punch=$r errno=", $!+0, "\n";
close($f);
my @st = stat("reserved");
print "blocks=$st[12] size=$st[7]\n";
"#;

fn probe_value<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in the cell's output:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r_cells_cannot_take_host_resources_or_reserve_blocks() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R or perl is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = r_daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    c.put_bytes(&s, "probe.pl", SYSCALL_PROBE.as_bytes())
        .await
        .unwrap();
    let aio_before = std::fs::read_to_string("/proc/sys/fs/aio-nr").unwrap_or_default();
    let out = c
        .execute_collect(
            &s,
            "cat(system('perl probe.pl 2>&1', intern = TRUE), sep = '\\n')",
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    let text = out.stdout.as_str();
    eprintln!("{text}");
    for (call, want) in [
        ("io_setup", "-1 errno=1"),
        ("sync", "-1 errno=1"),
        ("syncfs", "-1 errno=1"),
        ("keep_size", "-1 errno=1"),
        ("zero_keep", "-1 errno=1"),
        ("mode0", "0 errno=0"),
    ] {
        let got = probe_value(text, call);
        // errno is only meaningful after a failure; success prints whatever was left.
        if want.starts_with('0') {
            assert!(got.starts_with("0 "), "{call}: {got}");
        } else {
            assert_eq!(got, want, "{call}");
        }
    }
    let punch = probe_value(text, "punch");
    assert!(
        punch.starts_with("0 "),
        "punching a hole is allowed: {punch}"
    );
    let blocks: u64 = probe_value(text, "blocks")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        blocks * 512 < 1 << 20,
        "{blocks} blocks allocated: the 1 GiB reservation went through"
    );
    // The file as the daemon sees it, and the host's AIO counter.
    let st = std::fs::metadata(session_dir(&d, &s).join("data/reserved")).unwrap();
    assert!(std::os::unix::fs::MetadataExt::blocks(&st) * 512 < 1 << 20);
    let aio_after = std::fs::read_to_string("/proc/sys/fs/aio-nr").unwrap_or_default();
    eprintln!("fs.aio-nr before {aio_before:?} after {aio_after:?}");
    // The session is healthy and keeps its state.
    let out = c.execute_collect(&s, "x <- 41; cat(x + 1)").await.unwrap();
    assert_eq!(out.stdout, "42");
}

/// Runs `code` in a fresh R session of `d` and returns its result (the session may end).
async fn r_cell(c: &mut Client, code: &str) -> (String, sandcell_client::Collected) {
    let s = c.open("r", None, None).await.unwrap().session;
    let out = c.execute_collect(&s, code).await.unwrap();
    (s, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_files_scratch_sparse_files_and_inodes_are_held_to_the_budget() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R or perl is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    // 4 MiB per session directory.
    let d = r_daemon(&[
        ("SANDCELL_MAX_SESSION_FILES_BYTES", "4194304"),
        ("SANDCELL_MAX_FILE_BYTES", "1048576"),
        ("SANDCELL_MAX_CONCURRENT_SESSIONS", "4"),
    ]);
    let mut c = d.client().await;
    // Within budget: a session with 1.5 MB in a hidden file and 1.5 MB of scratch lives.
    let (s, out) = r_cell(
        &mut c,
        "writeBin(as.raw(rep(1L, 1.5e6)), '.hidden'); \
         writeBin(as.raw(rep(1L, 1.5e6)), tempfile()); cat('ok')",
    )
    .await;
    assert_eq!(out.stdout, "ok", "{:?}", out.result);
    assert!(!out.result.session_ended, "{:?}", out.result);
    let names: Vec<String> = out.result.files.iter().map(|f| f.name.clone()).collect();
    assert!(names.contains(&".hidden".to_string()), "{names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with(".tmp")),
        "scratch is not listed: {names:?}"
    );
    // Uploads see the 3 MB hidden and scratch files hold: one more MiB fits, two do not
    // (counting only listed files, 1.5 MB + 2 MiB would have fit).
    c.put_bytes(&s, "more.bin", &vec![0u8; 1 << 20])
        .await
        .expect("one MiB fits");
    let e = kernel_error(
        c.put_bytes(&s, "more2.bin", &vec![0u8; 1 << 20])
            .await
            .map(|_| ()),
    );
    match &e {
        KernelError::LimitExceeded { limit, value, max } => {
            assert_eq!(limit, "max_session_files_bytes");
            eprintln!("second upload refused: {value} > {max}");
        }
        other => panic!("a second MiB fit next to hidden files: {other:?}"),
    }

    // Hidden files, scratch files and inodes are refused by the session's own file system
    // (its size and inode count are the budgets): the session lives, within them.
    for (what, code) in [
        (
            "hidden files",
            "for (i in 1:5) try(writeBin(as.raw(rep(1L, 1e6)), sprintf('.h%d', i)), silent = TRUE); cat('wrote')",
        ),
        (
            "scratch files",
            "for (i in 1:5) try(writeBin(as.raw(rep(1L, 1e6)), tempfile()), silent = TRUE); cat('wrote')",
        ),
        (
            "many empty files (inodes)",
            "d <- file.path(tempdir(), 'many'); dir.create(d); \
             invisible(suppressWarnings(file.create(file.path(d, seq_len(5000))))); cat('wrote')",
        ),
    ] {
        let (s, out) = r_cell(&mut c, code).await;
        eprintln!("{what}: {:?} {:?}", out.stdout, out.result.status);
        assert_eq!(out.stdout, "wrote", "{what}: {:?}", out.result);
        assert!(!out.result.session_ended, "{what}: {:?}", out.result);
        let (bytes, entries) = held(&session_dir(&d, &s));
        assert!(bytes <= 4194304, "{what}: {bytes} bytes held");
        assert!(entries <= 4096, "{what}: {entries} entries held");
        c.close(&s).await.unwrap();
    }
    // A sparse file costs the session file system nothing, but the walk charges its size:
    // over budget, its session ends.
    {
        let what = "a sparse file";
        // Each under RLIMIT_FSIZE (the 4 MiB budget), together over it.
        let code = "system('truncate -s 3M .sparse; truncate -s 3M .sparse2'); cat('wrote')";
        let (s, out) = r_cell(&mut c, code).await;
        // Stopped by the disk watch during the cell, or found over budget after it.
        let stopped =
            out.result.error.as_ref().map(|e| e.kind.as_str()) == Some("DiskQuotaExceeded");
        assert!(stopped || out.stdout == "wrote", "{what}: {:?}", out.result);
        assert!(
            out.result.session_ended,
            "{what}: the session outlived its budget: {:?}",
            out.result
        );
        assert!(!out.result.warnings.is_empty(), "{what}: no warning");
        eprintln!("{what}: {}", out.result.warnings.join("; "));
        let dir = session_dir(&d, &s);
        assert!(
            eventually(Duration::from_secs(10), || !dir.exists()),
            "{what}: the directory was not removed"
        );
        let e = kernel_error(c.execute_collect(&s, "1").await.map(|_| ()));
        assert!(
            matches!(&e, KernelError::SessionEnded { reason, .. } if reason == "disk_quota"),
            "{e:?}"
        );
    }
}

/// Bytes of the regular files below `dir` (the larger of size and blocks) and its entries, at
/// any depth.
fn held(dir: &std::path::Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut entries) = (0, 0);
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.metadata() else { continue };
        entries += 1;
        if m.is_file() {
            bytes += m.len().max(m.blocks() * 512);
        } else if m.is_dir() {
            let (b, n) = held(&e.path());
            bytes += b;
            entries += n;
        }
    }
    (bytes, entries)
}

// ---------------------------------------------------------------------------------------
// Authorization edges: a private system bus (no polkitd on it) with polkit installed here.

impl Bus {
    fn busctl_as(&self, user: Option<&User>) -> Command {
        let mut c = match user {
            None => Command::new("busctl"),
            Some(u) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={}", u.uid))
                    .arg(format!("--regid={}", u.uid))
                    .arg("--clear-groups")
                    .arg("busctl");
                c
            }
        };
        c.env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .arg("--system");
        c
    }
}

/// A throw-away local user (no home, no shell), removed on drop.
struct User {
    name: String,
    uid: u32,
}

impl User {
    fn add() -> User {
        let name = format!("sctt{}", common::rand_hex(3));
        let st = Command::new("useradd")
            .args(["-M", "-N", "-s", "/usr/sbin/nologin", &name])
            .status()
            .unwrap();
        assert!(st.success(), "useradd {name}");
        let uid = String::from_utf8(
            Command::new("id")
                .arg("-u")
                .arg(&name)
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim()
        .parse()
        .unwrap();
        User { name, uid }
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

fn output(cmd: &mut Command) -> Out {
    let o = cmd.stdin(Stdio::null()).output().unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `sandcellctl ARGS` as `user` (root when `None`) with `stdin`.
fn ctl(d: &Daemon, bus: Option<&Bus>, user: Option<&User>, args: &[&str], stdin: &str) -> Out {
    let exe = common::bin_dir().join("sandcellctl");
    let mut cmd = match user {
        None => Command::new(&exe),
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={}", u.uid))
                .arg(format!("--regid={}", u.uid))
                .arg("--clear-groups")
                .arg(&exe);
            c
        }
    };
    cmd.args(args).env("SANDCELL_SOCKET", &d.socket);
    if let Some(b) = bus {
        cmd.env("DBUS_SYSTEM_BUS_ADDRESS", &b.address);
    }
    run_input(&mut cmd, stdin)
}

fn bus_skip_reason() -> Option<(&'static str, String)> {
    if !is_root() {
        return Some(("root", "not root (useradd and setpriv need root)".into()));
    }
    for tool in ["dbus-daemon", "busctl", "setpriv", "useradd"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            return Some(("dbus", format!("{tool} missing")));
        }
    }
    if sandcelld::polkit::installed().is_none() {
        return Some((
            "polkit",
            "polkit is not installed here (apt-get install polkitd)".into(),
        ));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polkit_installed_but_silent_fails_closed_and_sessions_stay_private() {
    if let Some((tier, why)) = bus_skip_reason() {
        sandcell_testing::skip!(tier, "{why}");
    }
    let bus = Bus::start();
    let d = Daemon::start(&[("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)]);
    std::fs::set_permissions(
        &d.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || d
            .log_text()
            .contains("authorization: FAIL-CLOSED")),
        "the daemon did not say it fails closed:\n{}",
        d.log_text()
    );
    let mallory = User::add();
    // A plain user who can open the socket is refused: polkit is installed but silent.
    let o = ctl(&d, Some(&bus), Some(&mallory), &["run", "-"], "print(1)\n");
    assert_eq!(o.code, 3, "stdout {} stderr {}", o.stdout, o.stderr);
    assert!(o.stderr.contains("org.sandcell.execute"), "{}", o.stderr);
    assert!(
        eventually(Duration::from_secs(5), || d
            .log_text()
            .contains(&format!("uid={}", mallory.uid))),
        "the refusal was not logged with the caller:\n{}",
        d.log_text()
    );
    // Root still runs code.
    let o = ctl(&d, Some(&bus), None, &["run", "-"], "print(6 * 7)\n");
    assert_eq!((o.code, o.stdout.as_str()), (0, "42\n"), "{}", o.stderr);

    // Root's detached session is invisible to mallory on D-Bus.
    let mut c = d.client().await;
    let sid = c.open("python", None, Some(600)).await.unwrap().session;
    let path = format!("/org/sandcell/Sandcell1/session/{sid}");
    let o = ctl(&d, Some(&bus), Some(&mallory), &["--json", "list"], "");
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        !o.stdout.contains(&sid),
        "listed to a stranger: {}",
        o.stdout
    );
    let o = ctl(&d, Some(&bus), None, &["--json", "list"], "");
    assert!(
        o.stdout.contains(&sid),
        "root does not see it: {}",
        o.stdout
    );
    for prop in ["OwnerUID", "OwnerPID", "State", "MemoryCurrent", "Id"] {
        let o = output(bus.busctl_as(Some(&mallory)).args([
            "get-property",
            "org.sandcell.Sandcell1",
            &path,
            "org.sandcell.Session1",
            prop,
        ]));
        assert_ne!(o.code, 0, "{prop} readable by a stranger: {}", o.stdout);
        assert!(
            o.stderr.contains("belongs to another user") || o.stderr.contains("ccess denied"),
            "{prop}: {}",
            o.stderr
        );
        let o = output(bus.busctl_as(None).args([
            "get-property",
            "org.sandcell.Sandcell1",
            &path,
            "org.sandcell.Session1",
            prop,
        ]));
        assert_eq!(o.code, 0, "{prop} not readable by root: {}", o.stderr);
    }
    // GetAll, and listing the objects by introspection.
    let o = output(bus.busctl_as(Some(&mallory)).args([
        "call",
        "org.sandcell.Sandcell1",
        &path,
        "org.freedesktop.DBus.Properties",
        "GetAll",
        "s",
        "org.sandcell.Session1",
    ]));
    // zbus leaves out the properties whose getter fails: a stranger gets an error or an
    // empty dictionary, never a value.
    assert!(
        o.code != 0 || o.stdout.trim() == "a{sv} 0",
        "GetAll answered a stranger: {}",
        o.stdout
    );
    let o = output(bus.busctl_as(Some(&mallory)).args([
        "introspect",
        "--xml-interface",
        "org.sandcell.Sandcell1",
        "/org/sandcell/Sandcell1/session",
    ]));
    assert!(
        !o.stdout.contains(&sid),
        "session ids listed to a stranger: {}",
        o.stdout
    );
    let o = output(bus.busctl_as(None).args([
        "introspect",
        "--xml-interface",
        "org.sandcell.Sandcell1",
        "/org/sandcell/Sandcell1/session",
    ]));
    assert!(o.stdout.contains(&sid), "root cannot list: {}", o.stderr);
    c.close(&sid).await.unwrap();
}

// ---------------------------------------------------------------------------------------
// sandcellctl as a target.

const PLANTING_CELL: &str = r#"
writeLines("pwned", ".bashrc")
dir.create(".git"); writeLines("[core]\n\tfsmonitor = evil", ".git/config")
dir.create(".ssh"); writeLines("ssh-ed25519 AAAA attacker", ".ssh/authorized_keys")
try(writeLines("outside", "../x"), silent = TRUE)
writeLines("cell version", "exists.txt")
writeLines("fine", "ok.txt")
dir.create("sub"); writeLines("nested", "sub/deep.txt")
writeLines("tab", "a\tb\nc")
writeLines("bidi", "x\u202etxt.exe")
cat("planted\n")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_never_overwrite_or_plant_and_odd_names_are_reachable() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R or perl is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = r_daemon(&[]);
    let work = tempfile::tempdir().unwrap();
    let out_dir = work.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    std::fs::write(out_dir.join("exists.txt"), "mine").unwrap();
    // A symlink in DIR pointing elsewhere is never followed.
    let elsewhere = work.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, out_dir.join("sub")).unwrap();
    let code = work.path().join("cell.R");
    std::fs::write(&code, PLANTING_CELL).unwrap();
    let o = ctl(
        &d,
        None,
        None,
        &[
            "run",
            "--artifacts",
            out_dir.to_str().unwrap(),
            code.to_str().unwrap(),
        ],
        "",
    );
    eprintln!("stdout:\n{}\nstderr:\n{}", o.stdout, o.stderr);
    assert_eq!(o.code, 0);
    assert!(o.stdout.starts_with("planted\n"), "{}", o.stdout);
    // Nothing hidden planted, nothing overwritten, nothing outside DIR or through a symlink.
    for planted in [".bashrc", ".git", ".ssh"] {
        assert!(!out_dir.join(planted).exists(), "{planted} was planted");
    }
    assert!(!work.path().join("x").exists());
    assert_eq!(
        std::fs::read_to_string(out_dir.join("exists.txt")).unwrap(),
        "mine"
    );
    assert!(!elsewhere.join("deep.txt").exists(), "followed a symlink");
    assert_eq!(
        std::fs::read_to_string(out_dir.join("ok.txt")).unwrap(),
        "fine\n"
    );
    // What is saved is exactly what is printed.
    let printed: Vec<&str> = o.stdout.lines().skip(1).collect();
    assert_eq!(printed, [out_dir.join("ok.txt").to_str().unwrap()]);
    let mut on_disk: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    assert_eq!(on_disk, ["exists.txt", "ok.txt", "sub"]);
    // Notes name each refusal, escaped: no raw tab, newline or bidi override reaches stderr.
    assert!(o.stderr.contains("a\\x09b\\x0ac"), "{}", o.stderr);
    assert!(o.stderr.contains("x\\u{202e}txt.exe"), "{}", o.stderr);
    assert!(!o.stderr.contains('\t') && !o.stderr.contains('\u{202e}'));
    assert!(
        o.stderr.contains("exists (never overwritten)"),
        "{}",
        o.stderr
    );

    // The odd name is listed and downloadable, by the library and by sandcellctl.
    let mut c = d.client().await;
    let s = c.open("r", None, Some(600)).await.unwrap().session;
    let out = c
        .execute_collect(&s, "writeLines('tab', 'a\\tb\\nc'); cat('ok')")
        .await
        .unwrap();
    assert_eq!(out.stdout, "ok", "{:?}", out.result);
    let names: Vec<&str> = out.result.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["a\tb\nc"]);
    let (listed, _) = c.list_files(&s).await.unwrap();
    assert!(
        listed
            .iter()
            .any(|f| f.name == "a\tb\nc" && f.kind == FileKind::File)
    );
    let mut got = Vec::new();
    c.get_file(&s, "a\tb\nc", &mut got).await.unwrap();
    assert_eq!(got, b"tab\n");
    let o = ctl(&d, None, None, &["get", &s, "a\tb\nc", "-"], "");
    assert_eq!((o.code, o.stdout.as_str()), (0, "tab\n"), "{}", o.stderr);
    // An upload may not create such a name.
    let e = kernel_error(c.put_bytes(&s, "up\nload", b"x").await.map(|_| ()));
    assert!(matches!(e, KernelError::InvalidFileName { .. }), "{e:?}");
    c.delete_file(&s, "a\tb\nc").await.unwrap();
    c.close(&s).await.unwrap();
}
