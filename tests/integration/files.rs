//! Files in and out of sessions through a real sandcelld: uploads, listings,
//! downloads, the files a cell leaves, and what a hostile cell can plant.

use crate::common;

use common::Daemon;
use sandcell_client::{Client, Error, FileKind, KernelError, Status};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn has_r() -> bool {
    Path::new("/usr/lib/R/bin/exec/R").exists()
}

fn daemon(extra: &[(&str, &str)]) -> Daemon {
    let mut env = vec![("SANDCELL_LANGUAGES", "python,r")];
    env.extend_from_slice(extra);
    Daemon::start(&env)
}

/// The session's files directory on the host (`data/` of the session directory).
fn session_dir(d: &Daemon, session: &str) -> PathBuf {
    d.dir
        .path()
        .join("state/sessions")
        .join(session)
        .join("data")
}

fn kernel_error(r: Result<impl std::fmt::Debug, Error>) -> KernelError {
    match r {
        Err(Error::Kernel(e)) => e,
        other => panic!("expected a named error, got {other:?}"),
    }
}

async fn fetch(c: &mut Client, s: &str, name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    c.get_file(s, name, &mut out).await.unwrap();
    out
}

const CSV: &str = "x,y,group\n1,2.5,a\n2,3.5,b\n3,1.0,a\n4,8.25,b\n5,6.0,a\n";

#[tokio::test]
async fn r_reads_an_uploaded_csv_and_returns_a_summary_and_a_png() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    let up = c
        .put_bytes(&s, "data/in.csv", CSV.as_bytes())
        .await
        .unwrap();
    assert_eq!(
        (up.name.as_str(), up.size, up.kind),
        ("data/in.csv", CSV.len() as u64, FileKind::File)
    );
    assert_eq!(up.media_type, "text/csv");
    // Stored as the session's worker, private.
    let meta = std::fs::symlink_metadata(session_dir(&d, &s).join("data/in.csv")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o600);
    if !common::insecure() {
        assert!(meta.uid() >= 3_000_000_000, "owner {}", meta.uid());
        assert_eq!(meta.uid(), meta.gid());
    }

    let code = "d <- read.csv('data/in.csv')\n\
                print(summary(d$y))\n\
                plot(d$x, d$y, main = 'y by x')\n\
                write.csv(d[d$group == 'a', ], 'clean.csv', row.names = FALSE)\n";
    let out = c.execute_collect(&s, code).await.unwrap();
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{:?} {}",
        out.result,
        out.stderr
    );
    assert!(
        out.stdout.contains("Min.") && out.stdout.contains("8.25"),
        "{}",
        out.stdout
    );
    let names: Vec<_> = out.result.files.iter().map(|f| f.name.as_str()).collect();
    let png = format!("plot-{}-001.png", out.cell);
    assert_eq!(names, ["clean.csv", png.as_str()], "{:?}", out.result.files);
    let p = out.result.files.iter().find(|f| f.name == png).unwrap();
    assert_eq!(
        (p.kind, p.media_type.as_str()),
        (FileKind::File, "image/png")
    );
    assert!(p.size > 1000, "{p:?}");

    let bytes = fetch(&mut c, &s, &png).await;
    assert_eq!(bytes.len() as u64, p.size);
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let clean = String::from_utf8(fetch(&mut c, &s, "clean.csv").await).unwrap();
    assert_eq!(
        clean,
        "\"x\",\"y\",\"group\"\n1,2.5,\"a\"\n3,1,\"a\"\n5,6,\"a\"\n"
    );
    // A cell that changes nothing reports nothing; the listing still has everything.
    let out = c.execute_collect(&s, "z <- 1").await.unwrap();
    assert!(out.result.files.is_empty(), "{:?}", out.result.files);
    // Uploads and deletions between cells are the client's doing, never the next cell's
    // (the daemon re-lists the directory when it changed it since the last cell).
    c.put_bytes(&s, "later.txt", b"x").await.unwrap();
    let out = c.execute_collect(&s, "z <- 2").await.unwrap();
    assert!(out.result.files.is_empty(), "{:?}", out.result.files);
    c.delete_file(&s, "later.txt").await.unwrap();
    let out = c
        .execute_collect(&s, "writeLines('again', 'later.txt')")
        .await
        .unwrap();
    let names: Vec<_> = out.result.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["later.txt"]);
    c.delete_file(&s, "later.txt").await.unwrap();
    let (all, truncated) = c.list_files(&s).await.unwrap();
    let names: Vec<_> = all.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["clean.csv", "data", "data/in.csv", png.as_str()]);
    assert!(!truncated);
    // Two plots in one cell: two pages, two files, both complete before `done`.
    let out = c
        .execute_collect(&s, "hist(c(1, 2, 2, 3)); barplot(c(3, 1))")
        .await
        .unwrap();
    let names: Vec<_> = out.result.files.iter().map(|f| f.name.clone()).collect();
    assert_eq!(
        names,
        [
            format!("plot-{}-001.png", out.cell),
            format!("plot-{}-002.png", out.cell)
        ]
    );
    for n in &names {
        assert_eq!(&fetch(&mut c, &s, n).await[..4], b"\x89PNG");
    }
}

#[tokio::test]
async fn planted_symlinks_and_fifos_are_listed_and_never_followed() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let shadow_before = std::fs::read("/etc/shadow").unwrap_or_default();
    let mut c = d.client().await;
    let s = c.open("r", None, None).await.unwrap().session;
    let code = "file.symlink('/etc/shadow', 'leak')\n\
                file.symlink('/etc', 'etc')\n\
                system('mkfifo fifo')\n\
                cat(file.exists('fifo'), '\\n')";
    let out = c.execute_collect(&s, code).await.unwrap();
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{:?} {}",
        out.result,
        out.stderr
    );
    let kinds: Vec<_> = out
        .result
        .files
        .iter()
        .map(|f| (f.name.as_str(), f.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("etc", FileKind::Symlink),
            ("fifo", FileKind::Special),
            ("leak", FileKind::Symlink)
        ],
        "{}",
        out.stdout
    );
    let (listed, _) = c.list_files(&s).await.unwrap();
    assert!(
        listed
            .iter()
            .any(|f| f.name == "leak" && f.kind == FileKind::Symlink)
    );

    for (name, kind) in [
        ("leak", "symlink"),
        ("etc/shadow", "symlink"),
        ("etc/passwd", "symlink"),
        ("fifo", "special"),
    ] {
        let t0 = Instant::now();
        let e = kernel_error(c.get_file_chunk(&s, name, 0, None).await);
        assert_eq!(
            e,
            KernelError::NotRegularFile {
                name: name.into(),
                kind: kind.into()
            }
        );
        // Opening the FIFO must not wait for a writer (that wait never ends); the bound is
        // loose so a loaded machine cannot fail it.
        assert!(t0.elapsed() < Duration::from_secs(15), "{name}");
    }
    // Uploads neither write through nor replace what the cell planted.
    for name in ["leak", "etc/shadow", "fifo"] {
        let e = kernel_error(c.put_bytes(&s, name, b"pwned\n").await);
        assert!(
            matches!(e, KernelError::NotRegularFile { .. }),
            "{name}: {e:?}"
        );
    }
    assert_eq!(
        std::fs::read("/etc/shadow").unwrap_or_default(),
        shadow_before
    );
    // A hard link to a file the worker does not own (as if protected_hardlinks were off) is
    // never read with the daemon's rights.
    if !common::insecure() {
        // Inside the session's file system (a link cannot cross into it): root's, hidden.
        let secret = session_dir(&d, &s).join(".secret");
        std::fs::write(&secret, "root only\n").unwrap();
        std::fs::hard_link(&secret, session_dir(&d, &s).join("hl")).unwrap();
        let e = kernel_error(c.get_file_chunk(&s, "hl", 0, None).await);
        assert_eq!(
            e,
            KernelError::NotRegularFile {
                name: "hl".into(),
                kind: "foreign".into()
            }
        );
    }
    // Deleting the link removes the link only.
    c.delete_file(&s, "leak").await.unwrap();
    assert!(Path::new("/etc/shadow").exists());
    let e = kernel_error(c.get_file_chunk(&s, "leak", 0, None).await);
    assert_eq!(
        e,
        KernelError::NoSuchFile {
            name: "leak".into()
        }
    );
}

#[tokio::test]
async fn bad_names_are_refused_with_typed_errors() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    for name in [
        "../escape",
        "a/../../escape",
        "/etc/passwd",
        "nul\0byte",
        "-rf",
        "",
        "a/b/c/d/e",
        "line\nbreak",
    ] {
        let e = kernel_error(c.put_bytes(&s, name, b"x").await);
        assert!(
            matches!(&e, KernelError::InvalidFileName { name: n, .. } if n == name),
            "put {name:?}: {e:?}"
        );
        // A leading '-' and a line break are refused for uploads only: a cell may create
        // such names, so they stay reachable for GetFile and DeleteFile.
        let reachable = matches!(name, "-rf" | "line\nbreak");
        let e = kernel_error(c.get_file_chunk(&s, name, 0, None).await);
        assert!(
            if reachable {
                matches!(e, KernelError::NoSuchFile { .. })
            } else {
                matches!(e, KernelError::InvalidFileName { .. })
            },
            "get {name:?}: {e:?}"
        );
        let e = kernel_error(c.delete_file(&s, name).await);
        assert!(
            if reachable {
                matches!(e, KernelError::NoSuchFile { .. })
            } else {
                matches!(e, KernelError::InvalidFileName { .. })
            },
            "delete {name:?}: {e:?}"
        );
    }
    assert!(!d.dir.path().join("state/escape").exists());
    let e = kernel_error(c.get_file_chunk(&s, "absent.csv", 0, None).await);
    assert_eq!(
        e,
        KernelError::NoSuchFile {
            name: "absent.csv".into()
        }
    );
    let e = kernel_error(
        c.put_bytes("0123456789abcdef0123456789abcdef", "x", b"x")
            .await,
    );
    assert!(matches!(e, KernelError::NoSuchSession { .. }), "{e:?}");
}

#[tokio::test]
async fn per_file_and_per_session_limits_are_typed() {
    // A file is charged the larger of its size and its allocated blocks (4 KiB blocks here).
    let d = daemon(&[
        ("SANDCELL_MAX_FILE_BYTES", "12000"),
        ("SANDCELL_MAX_SESSION_FILES_BYTES", "20000"),
    ]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let e = kernel_error(c.put_bytes(&s, "a", &[7; 12001]).await);
    assert_eq!(
        e,
        KernelError::LimitExceeded {
            limit: "max_file_bytes".into(),
            value: 12001,
            max: 12000
        }
    );
    c.put_bytes(&s, "a", &[7; 12000]).await.unwrap();
    let e = kernel_error(c.put_bytes(&s, "b", &[7; 9000]).await);
    assert!(
        matches!(&e, KernelError::LimitExceeded { limit, value, max: 20000 }
            if limit == "max_session_files_bytes" && *value >= 21000),
        "{e:?}"
    );
    // Replacing a file counts its new size, not both, once stored. While the new copy is
    // written both take room in the session's file system (20000 bytes rounded down to
    // 4 pages): 3 pages of "a" and 1 of its replacement fit.
    c.put_bytes(&s, "a", &[8; 4000]).await.unwrap();
    c.put_bytes(&s, "b", &[9; 9000]).await.unwrap();
    assert_eq!(fetch(&mut c, &s, "a").await, vec![8; 4000]);
    // Within the budget as the walk counts it (4096 + 9000 bytes), but the file system is
    // full (4 of 4 pages) and the new copy of "b" needs 3 more: the kernel's refusal is the
    // same typed error, never an internal one, and the old "b" stays.
    let e = kernel_error(c.put_bytes(&s, "b", &[10; 9000]).await);
    assert!(
        matches!(&e, KernelError::LimitExceeded { limit, max: 20000, .. }
            if limit == "max_session_files_bytes"),
        "{e:?}"
    );
    assert_eq!(fetch(&mut c, &s, "b").await, vec![9; 9000]);
    // Bounded reads: max_bytes over 1 MiB is refused, smaller chunks are honoured.
    let e = kernel_error(c.get_file_chunk(&s, "a", 0, Some(2 << 20)).await);
    assert!(
        matches!(e, KernelError::LimitExceeded { ref limit, .. } if limit == "max_bytes"),
        "{e:?}"
    );
    let (_, chunk, eof) = c.get_file_chunk(&s, "a", 3950, Some(100)).await.unwrap();
    assert_eq!((chunk.len(), eof), (50, true));
}

#[tokio::test]
async fn a_declared_gigabyte_is_refused_before_anything_is_read() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let rss0 = d.rss();
    // Declared 1 GiB with a tiny file behind it: refused from the declaration alone.
    let small = tempfile::tempfile().unwrap();
    let t0 = Instant::now();
    let e = kernel_error(
        c.put_fd_declared(&s, "big.bin", small.into(), 1 << 30)
            .await,
    );
    assert_eq!(
        e,
        KernelError::LimitExceeded {
            limit: "max_file_bytes".into(),
            value: 1 << 30,
            max: 64 << 20
        }
    );
    // A sparse 1 GiB file passed by descriptor: refused from fstat, never read.
    let sparse = tempfile::tempfile().unwrap();
    sparse.set_len(1 << 30).unwrap();
    let e = kernel_error(c.put_fd(&s, "big.bin", sparse).await);
    assert!(
        matches!(e, KernelError::LimitExceeded { ref limit, value, .. } if limit == "max_file_bytes" && value == 1 << 30),
        "{e:?}"
    );
    // The same file declared small: the descriptor's size is checked before reading.
    let sparse = tempfile::tempfile().unwrap();
    sparse.set_len(1 << 30).unwrap();
    let e = kernel_error(c.put_fd_declared(&s, "big.bin", sparse.into(), 10).await);
    assert!(matches!(e, KernelError::LimitExceeded { .. }), "{e:?}");
    // Never read: the RSS bound below is the sharp check; this one only catches a read of
    // both GiB, with room for a loaded machine.
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    assert!(
        d.rss() < rss0 + 8 * 1024 * 1024,
        "daemon grew from {rss0} to {}",
        d.rss()
    );
    let (files, _) = c.list_files(&s).await.unwrap();
    assert!(files.is_empty(), "{files:?}");
    assert!(
        std::fs::read_dir(session_dir(&d, &s))
            .unwrap()
            .flatten()
            .all(|e| e.file_name() == ".tmp" || e.metadata().map(|m| m.len()).unwrap_or(0) < 4096),
        "nothing big was written"
    );
}

/// Uploading a local FIFO or directory is refused by the client at once (it opens the path
/// non-blocking and checks it), instead of waiting for a writer that never comes.
#[tokio::test]
async fn uploading_a_fifo_or_a_directory_is_refused_at_once() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let dir = tempfile_dir();
    let fifo = dir.join("fifo");
    let cpath = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(cpath.as_ptr(), 0o600) }, 0);
    for p in [fifo.as_path(), dir.as_path()] {
        // The timeout is the check: reading a FIFO with no writer would never end.
        let e = tokio::time::timeout(Duration::from_secs(15), c.put_file(&s, "x", p))
            .await
            .expect("put_file hung");
        assert!(matches!(e, Err(Error::File { .. })), "{p:?}: {e:?}");
    }
    let (files, _) = c.list_files(&s).await.unwrap();
    assert!(files.is_empty(), "{files:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let p = std::env::temp_dir().join(format!("sandcell-fifo-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir(&p).unwrap();
    p
}

#[tokio::test]
async fn big_files_go_by_descriptor_and_come_back_in_chunks() {
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let data: Vec<u8> = (0..5 * 1024 * 1024 + 17)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let mut f = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut f, &data).unwrap();
    let up = c.put_file(&s, "blob.bin", f.path()).await.unwrap();
    assert_eq!(up.size, data.len() as u64);
    let mut back = Vec::new();
    let (info, n) = c.get_file(&s, "blob.bin", &mut back).await.unwrap();
    assert_eq!((info.size, n), (data.len() as u64, data.len() as u64));
    assert!(back == data, "content differs");
    // Inline uploads are bounded below the message size: 2 MiB + 1 KiB inline (a message
    // that fits the 4 MiB bound) is refused, typed.
    let e = kernel_error(
        c.put_bytes(&s, "inline.bin", &vec![1; (2 << 20) + 1024])
            .await,
    );
    assert!(
        matches!(e, KernelError::LimitExceeded { ref limit, .. } if limit == "inline_bytes"),
        "{e:?}"
    );
}

#[tokio::test]
async fn uploads_wait_for_the_running_cell() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let d = daemon(&[]);
    let mut a = d.client().await;
    let s = a.open("r", None, None).await.unwrap().session;
    a.execute(&s, "Sys.sleep(30)").await.unwrap();
    let started = a.next_frame().await.unwrap().started.unwrap();
    let mut b = d.client().await;
    let e = kernel_error(b.put_bytes(&s, "late.csv", b"x\n").await);
    assert_eq!(
        e,
        KernelError::SessionBusy {
            session: s.clone(),
            cell: started.cell
        }
    );
    // Reading and listing do not wait.
    b.list_files(&s).await.unwrap();
    assert!(b.interrupt(&s, started.cell).await.unwrap().delivered);
    a.finish(|_| {}).await.unwrap();
    b.put_bytes(&s, "late.csv", b"x\n").await.unwrap();
    let out = a
        .execute_collect(&s, "cat(readLines('late.csv'), '\\n')")
        .await
        .unwrap();
    assert_eq!(out.stdout, "x \n");
}

#[tokio::test]
async fn sandcellctl_saves_the_cells_artifacts() {
    if !has_r() {
        sandcell_testing::skip!(
            "r",
            "R is not installed (scripts/setup.sh installs r-base-core)"
        );
    }
    let ctl = common::bin_dir().join("sandcellctl");
    if !ctl.exists() {
        sandcell_testing::skip!(
            "built",
            "{} not built (cargo build -p sandcell-client)",
            ctl.display()
        );
    }
    let d = daemon(&[]);
    let work = tempfile::tempdir().unwrap();
    let code = work.path().join("cell.R");
    std::fs::write(&code, "plot(1:10)\nwriteLines('done', 'note.txt')\n").unwrap();
    let art = work.path().join("out");
    let out = std::process::Command::new(&ctl)
        .arg("--socket")
        .arg(&d.socket)
        .arg("run")
        .arg("--artifacts")
        .arg(&art)
        .arg(&code)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The created files are also named on standard error, with size and media type.
    let told = String::from_utf8_lossy(&out.stderr);
    assert!(
        told.contains("sandcellctl: file note.txt (5 bytes, text/plain)")
            && told.contains("sandcellctl: file plot-1-001.png (")
            && told.contains(" bytes, image/png)"),
        "{told}"
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    let mut paths: Vec<_> = printed.lines().map(PathBuf::from).collect();
    paths.sort();
    assert_eq!(
        paths,
        [art.join("note.txt"), art.join("plot-1-001.png")],
        "{printed}"
    );
    assert_eq!(
        std::fs::read_to_string(art.join("note.txt")).unwrap(),
        "done\n"
    );
    assert_eq!(
        &std::fs::read(art.join("plot-1-001.png")).unwrap()[..4],
        b"\x89PNG"
    );
}

fn fd_targets(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .map(|e| {
                    std::fs::read_link(e.path())
                        .unwrap_or_default()
                        .display()
                        .to_string()
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test]
async fn passed_descriptors_are_bounded_and_never_kept() {
    use zlink::Call;
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.list_files(&s).await.unwrap();
    let fds0 = open_fds(d.pid());
    let files = |n: usize| -> Vec<std::os::fd::OwnedFd> {
        (0..n)
            .map(|_| tempfile::tempfile().unwrap().into())
            .collect()
    };
    let list = serde_json::json!({
        "method": "org.sandcell.Kernel.ListFiles",
        "parameters": { "session": s },
    });
    // Descriptors sent with a call that takes none are refused (InvalidParameter fd) and
    // closed once it is answered.
    let mut raw = zlink::tokio::unix::connect(&d.socket).await.unwrap();
    for _ in 0..20 {
        raw.send_call(&Call::new(&list), files(3)).await.unwrap();
        let (reply, _) = raw
            .receive_reply::<sandcell_proto::kernel::ListFilesReply, KernelError>()
            .await
            .unwrap();
        assert!(
            matches!(&reply, Err(KernelError::InvalidParameter { parameter, .. }) if parameter == "fd"),
            "{reply:?}"
        );
    }
    // (The test's temporary files show as "/tmp/#<inode> (deleted)" in /proc/<pid>/fd.)
    let passed = |t: &String| t.starts_with("/tmp/") || t.ends_with("(deleted)");
    assert!(
        common::eventually(Duration::from_secs(5), || !fd_targets(d.pid())
            .iter()
            .any(passed)),
        "daemon holds passed descriptors: {:?}",
        fd_targets(d.pid())
    );
    // More than 4 with one message ends that connection, and only that one.
    let mut flood = zlink::tokio::unix::connect(&d.socket).await.unwrap();
    flood.send_call(&Call::new(&list), files(5)).await.unwrap();
    assert!(
        flood
            .receive_reply::<sandcell_proto::kernel::ListFilesReply, KernelError>()
            .await
            .is_err()
    );
    drop(flood);
    drop(raw);
    assert!(
        common::eventually(Duration::from_secs(5), || open_fds(d.pid()) <= fds0),
        "daemon holds {} descriptors, {fds0} before: {:?}",
        open_fds(d.pid()),
        fd_targets(d.pid())
    );
    c.list_files(&s).await.unwrap();
}

/// The directories named `name` under `root` (at most 8 levels down).
fn dirs_named(root: &Path, name: &str, depth: u32, out: &mut Vec<PathBuf>) {
    if depth == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            let p = e.path();
            if e.file_name() == name {
                out.push(p);
            } else {
                dirs_named(&p, name, depth - 1, out);
            }
        }
    }
}

/// An upload into a session whose cgroup is at its pids.max succeeds: the daemon's copier
/// process joins the group by migration, which pids.max does not refuse (only fork and
/// clone are refused, cgroup-v2.rst "PID"), so it is never an internal error; the cell reads
/// the file.
#[tokio::test]
async fn an_upload_into_a_session_at_its_process_limit_succeeds() {
    if common::insecure() {
        return;
    }
    let d = daemon(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let mut groups = Vec::new();
    dirs_named(Path::new("/sys/fs/cgroup"), &s, 8, &mut groups);
    let pids: Vec<PathBuf> = groups
        .into_iter()
        .filter(|g| g.join("pids.max").exists())
        .collect();
    assert!(!pids.is_empty(), "no pids group of session {s}");
    let group = &pids[0];
    let current = std::fs::read_to_string(group.join("pids.current")).unwrap();
    std::fs::write(group.join("pids.max"), current.trim()).unwrap();
    let info = c.put_bytes(&s, "in.txt", b"data").await.unwrap();
    assert_eq!(info.size, 4);
    let out = c
        .execute_collect(&s, "print(open('/mnt/data/in.txt').read())")
        .await
        .unwrap();
    assert_eq!(out.stdout, "data\n", "{:?}", out.result);
}
