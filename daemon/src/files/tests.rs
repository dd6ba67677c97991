//! Unit tests of the file operations on real temporary directories.

use super::put::dir_lock;
use super::*;

// Files are charged their allocated blocks (4 KiB each at least on common file
// systems), so the limits are in tens of KiB.
const LIMITS: Limits = Limits {
    max_file_bytes: 100_000,
    max_session_files_bytes: 150_000,
};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn read_any(
    dir: &Path,
    name: &str,
    offset: u64,
    max: u64,
) -> Result<(FileInfo, Vec<u8>, bool), Error> {
    read(dir, name, offset, max, None)
}

#[test]
fn an_upload_past_its_deadline_leaves_nothing() {
    let d = tmp();
    let src = tempfile::tempfile().unwrap();
    src.set_len(4 << 20).unwrap();
    let limits = Limits {
        max_file_bytes: 8 << 20,
        max_session_files_bytes: 8 << 20,
    };
    // The deadline passes before the first chunk is copied.
    let past = (std::time::Instant::now(), 60);
    let e = put_until(
        d.path(),
        "big",
        4 << 20,
        Source::Fd(src.into()),
        None,
        &limits,
        Some(past),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Deadline(60)), "{e:?}");
    let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
    assert!(left.is_empty(), "a partial file stayed: {left:?}");
    assert_eq!(list(d.path()).unwrap().usage.bytes, 0);
    // Waiting for another upload's lock counts against the deadline too.
    let lock = dir_lock(d.path());
    let held = lock.lock().unwrap();
    let soon = (
        std::time::Instant::now() + std::time::Duration::from_millis(50),
        60,
    );
    let e = put_until(
        d.path(),
        "x",
        1,
        Source::Inline(vec![1]),
        None,
        &limits,
        Some(soon),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Deadline(60)), "{e:?}");
    drop(held);
    put_until(
        d.path(),
        "x",
        1,
        Source::Inline(vec![1]),
        None,
        &limits,
        Some(soon),
    )
    .expect_err("still past");
    let later = (
        std::time::Instant::now() + std::time::Duration::from_secs(60),
        60,
    );
    put_until(
        d.path(),
        "x",
        1,
        Source::Inline(vec![1]),
        None,
        &limits,
        Some(later),
    )
    .unwrap();
}

#[test]
fn foreign_files_are_not_read() {
    let d = tmp();
    std::fs::write(d.path().join("mine"), "x").unwrap();
    let me = nix::unistd::geteuid().as_raw();
    assert_eq!(read(d.path(), "mine", 0, 1, Some(me)).unwrap().1, b"x");
    let other = read(d.path(), "mine", 0, 1, Some(me.wrapping_add(1)));
    assert!(matches!(other, Err(Error::Foreign(_))), "{other:?}");
}

#[test]
fn names_are_validated() {
    for bad in [
        "",
        "/etc/passwd",
        "../x",
        "a/../b",
        "a//b",
        "./a",
        "a\0b",
        "a/b/c/d/e",
        ".sandcell-put-x",
    ] {
        assert!(
            matches!(validate_name(bad), Err(Error::InvalidName { .. })),
            "{bad:?}"
        );
    }
    // What a worker can create is reachable; an upload may not create it.
    for odd in [
        "a\nb",
        "a\tb\rc",
        "-rf",
        "a/-b",
        "\x1b]0;x\x07",
        "invoice\u{202e}fdp.exe",
        "a\u{200b}b",
        "\u{2066}x",
    ] {
        assert!(validate_name(odd).is_ok(), "{odd:?}");
        assert!(
            matches!(validate_new_name(odd), Err(Error::InvalidName { .. })),
            "{odd:?}"
        );
    }
    assert!(validate_name(&"x".repeat(256)).is_err());
    assert_eq!(validate_name("data/in.csv").unwrap(), ["data", "in.csv"]);
    assert!(validate_name(".hidden").is_ok());
}

/// Failures on the daemon's side are server faults naming the session-relative path;
/// a request DeleteFile does not serve (a directory with entries) is the client's.
#[test]
fn server_faults_are_internal_errors_with_the_path() {
    let d = tmp();
    let gone = d.path().join("no-such-session");
    let e = list(&gone).unwrap_err();
    assert!(matches!(&e, Error::Io { path, .. } if path == "."), "{e:?}");
    match KernelError::from(e) {
        KernelError::InternalError { operation, reason } => {
            assert_eq!(operation, "open session directory");
            assert!(reason.starts_with(".: "), "{reason}");
            assert!(!reason.contains("no-such-session"), "a host path: {reason}");
        }
        other => panic!("{other:?}"),
    }
    // A session directory that is not a directory.
    std::fs::write(d.path().join("plain"), b"x").unwrap();
    let e = read(&d.path().join("plain"), "a.txt", 0, 10, None).unwrap_err();
    assert!(matches!(&e, Error::Io { path, .. } if path == "."), "{e:?}");
    put(
        d.path(),
        "full/a.txt",
        1,
        Source::Inline(b"a".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap();
    let e = delete(d.path(), "full").unwrap_err();
    assert!(
        matches!(&e, Error::NotRegular { name, kind: FileKind::Dir } if name == "full"),
        "{e:?}"
    );
    assert!(matches!(
        KernelError::from(e),
        KernelError::NotRegularFile { .. }
    ));
}

#[test]
fn put_read_list_delete_round_trip() {
    let d = tmp();
    let f = put(
        d.path(),
        "in.csv",
        4,
        Source::Inline(b"a,b\n".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap();
    assert_eq!(
        (f.size, f.kind, f.media_type.as_str()),
        (4, FileKind::File, "text/csv")
    );
    put(
        d.path(),
        "sub/x.txt",
        2,
        Source::Inline(b"hi".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap();
    let (_, bytes, eof) = read_any(d.path(), "in.csv", 1, 2).unwrap();
    assert_eq!((bytes.as_slice(), eof), (&b",b"[..], false));
    let (_, bytes, eof) = read_any(d.path(), "in.csv", 3, 100).unwrap();
    assert_eq!((bytes.as_slice(), eof), (&b"\n"[..], true));
    let l = list(d.path()).unwrap();
    let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["in.csv", "sub", "sub/x.txt"]);
    // Replacing keeps one file and the new content.
    put(
        d.path(),
        "in.csv",
        1,
        Source::Inline(b"z".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap();
    assert_eq!(read_any(d.path(), "in.csv", 0, 10).unwrap().1, b"z");
    delete(d.path(), "sub/x.txt").unwrap();
    assert!(matches!(
        read_any(d.path(), "sub/x.txt", 0, 1),
        Err(Error::NoSuchFile(_))
    ));
    assert!(std::fs::read_dir(d.path()).unwrap().all(|e| {
        !e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(TEMP_PREFIX)
    }));
}

#[test]
fn symlinks_and_fifos_are_reported_never_followed() {
    let d = tmp();
    let outside = tmp();
    std::fs::write(outside.path().join("secret"), "s3cret").unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), d.path().join("leak")).unwrap();
    std::os::unix::fs::symlink(outside.path(), d.path().join("dirlink")).unwrap();
    nix::unistd::mkfifo(
        &d.path().join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let l = list(d.path()).unwrap();
    let kinds: Vec<_> = l.files.iter().map(|f| (f.name.as_str(), f.kind)).collect();
    assert_eq!(
        kinds,
        [
            ("dirlink", FileKind::Symlink),
            ("fifo", FileKind::Special),
            ("leak", FileKind::Symlink)
        ]
    );
    for (name, kind) in [
        ("leak", FileKind::Symlink),
        ("dirlink/secret", FileKind::Symlink),
        ("fifo", FileKind::Special),
    ] {
        match read_any(d.path(), name, 0, 100) {
            Err(Error::NotRegular { kind: k, .. }) => assert_eq!(k, kind, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // Writing through a symlinked directory is refused; over a symlink replaces the link.
    assert!(matches!(
        put(
            d.path(),
            "dirlink/x",
            1,
            Source::Inline(b"x".to_vec()),
            None,
            &LIMITS
        ),
        Err(Error::NotRegular { .. })
    ));
    assert!(matches!(
        put(
            d.path(),
            "leak",
            1,
            Source::Inline(b"x".to_vec()),
            None,
            &LIMITS
        ),
        Err(Error::NotRegular {
            kind: FileKind::Symlink,
            ..
        })
    ));
    assert_eq!(
        std::fs::read_to_string(outside.path().join("secret")).unwrap(),
        "s3cret"
    );
    assert!(!outside.path().join("x").exists());
}

#[test]
fn limits_are_checked_before_reading() {
    let d = tmp();
    let e = put(
        d.path(),
        "big",
        100_001,
        Source::Inline(vec![0; 3]),
        None,
        &LIMITS,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                limit: "max_file_bytes",
                value: 100_001,
                ..
            }
        ),
        "{e}"
    );
    let e = put(d.path(), "m", 3, Source::Inline(vec![0; 2]), None, &LIMITS).unwrap_err();
    assert!(
        matches!(
            e,
            Error::BadSource {
                parameter: "size",
                ..
            }
        ),
        "{e}"
    );
    put(
        d.path(),
        "a",
        100_000,
        Source::Inline(vec![1; 100_000]),
        None,
        &LIMITS,
    )
    .unwrap();
    let e = put(
        d.path(),
        "b",
        60_000,
        Source::Inline(vec![1; 60_000]),
        None,
        &LIMITS,
    )
    .unwrap_err();
    match e {
        Error::TooLarge {
            limit: "max_session_files_bytes",
            value,
            max: 150_000,
        } => assert!(value >= 160_000, "{value}"),
        other => panic!("{other}"),
    }
    // Replacing `a` counts its new size only.
    put(
        d.path(),
        "a",
        90_000,
        Source::Inline(vec![1; 90_000]),
        None,
        &LIMITS,
    )
    .unwrap();
    // A sparse 1 GiB file passed as a descriptor is refused from fstat alone.
    let f = tempfile::tempfile().unwrap();
    f.set_len(1 << 30).unwrap();
    let e = put(
        d.path(),
        "huge",
        1 << 30,
        Source::Fd(f.into()),
        None,
        &LIMITS,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                limit: "max_file_bytes",
                ..
            }
        ),
        "{e}"
    );
    let mut f = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut f, b"hello").unwrap();
    put(d.path(), "fromfd", 5, Source::Fd(f.into()), None, &LIMITS).unwrap();
    assert_eq!(read_any(d.path(), "fromfd", 0, 100).unwrap().1, b"hello");
}

#[test]
fn hidden_entries_blocks_and_inodes_are_charged() {
    use std::os::unix::fs::FileExt;
    let d = tmp();
    let base = list(d.path()).unwrap().usage;
    assert_eq!(base.entries, 0);
    // Hidden names, the scratch directory and a name like an upload temporary count.
    std::fs::write(d.path().join(".hidden"), vec![1u8; 10_000]).unwrap();
    std::fs::create_dir(d.path().join(FLAT_SCRATCH_DIR)).unwrap();
    std::fs::write(d.path().join(FLAT_SCRATCH_DIR).join("x"), vec![1u8; 20_000]).unwrap();
    std::fs::write(d.path().join(format!("{TEMP_PREFIX}zz")), vec![1u8; 30_000]).unwrap();
    let l = list(d.path()).unwrap();
    let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, [".hidden"]);
    assert_eq!(l.usage.entries, 4);
    assert!(l.usage.bytes >= 60_000, "{:?}", l.usage);
    assert_eq!(l.regular_bytes(), l.usage.bytes);
    // A sparse file is charged its size; blocks reserved past the end are charged too.
    let sparse = std::fs::File::create(d.path().join("sparse")).unwrap();
    sparse.set_len(5_000_000).unwrap();
    let l2 = list(d.path()).unwrap();
    assert!(l2.usage.bytes >= l.usage.bytes + 5_000_000);
    let reserved = std::fs::File::create(d.path().join("reserved")).unwrap();
    let r = nix::fcntl::fallocate(
        &reserved,
        nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        8 << 20,
    );
    if r.is_ok() {
        let l3 = list(d.path()).unwrap();
        assert!(
            l3.usage.bytes >= l2.usage.bytes + (8 << 20),
            "{:?}",
            l3.usage
        );
        assert_eq!(
            l3.files.iter().find(|f| f.name == "reserved").unwrap().size,
            0
        );
    } else {
        eprintln!("fallocate(KEEP_SIZE) unsupported here; reservation not checked");
    }
    // Hard links are charged once.
    reserved.write_all_at(b"x", 0).unwrap();
    let before = list(d.path()).unwrap().usage;
    std::fs::hard_link(d.path().join(".hidden"), d.path().join("link")).unwrap();
    let after = list(d.path()).unwrap().usage;
    assert_eq!(after.entries, before.entries + 1);
    assert!(after.bytes < before.bytes + 10_000);
}

#[test]
fn the_entry_budget_counts_hidden_and_deep_entries() {
    let d = tmp();
    let deep = d.path().join(FLAT_SCRATCH_DIR).join("a/b/c/d/e/f");
    std::fs::create_dir_all(&deep).unwrap();
    let l = list(d.path()).unwrap();
    assert!(l.files.is_empty());
    assert_eq!(l.usage.entries, 7);
    assert!(!l.truncated && !l.usage.over);
    for i in 0..MAX_SESSION_ENTRIES {
        std::fs::write(deep.join(i.to_string()), "").unwrap();
    }
    let l = list(d.path()).unwrap();
    assert!(l.usage.over && l.truncated, "{:?}", l.usage);
    assert_eq!(l.regular_bytes(), u64::MAX);
    let e = put(
        d.path(),
        "x",
        1,
        Source::Inline(b"x".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                limit: "max_session_entries",
                ..
            }
        ),
        "{e}"
    );
    // Too deep to count is over budget too.
    let d = tmp();
    let mut p = d.path().join(FLAT_SCRATCH_DIR);
    for _ in 0..MAX_WALK_DEPTH {
        p = p.join("d");
    }
    std::fs::create_dir_all(&p).unwrap();
    assert!(list(d.path()).unwrap().usage.over);
}

#[test]
fn odd_names_a_worker_makes_are_listed_and_reachable() {
    use std::os::unix::ffi::OsStrExt;
    let d = tmp();
    std::fs::write(d.path().join("a\tb\nc"), "tab").unwrap();
    std::fs::write(d.path().join("-x"), "dash").unwrap();
    std::fs::write(
        d.path().join(std::ffi::OsStr::from_bytes(b"bad\xff")),
        "latin1",
    )
    .unwrap();
    let l = list(d.path()).unwrap();
    let names: Vec<_> = l.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["-x", "a\tb\nc"]);
    assert_eq!(l.usage.entries, 3);
    for n in names {
        read_any(d.path(), n, 0, 10).unwrap();
    }
    delete(d.path(), "a\tb\nc").unwrap();
}

#[test]
fn change_list_reports_new_and_modified_entries() {
    let d = tmp();
    std::fs::write(d.path().join("same"), "1").unwrap();
    std::fs::write(d.path().join("edit"), "1").unwrap();
    std::fs::create_dir(d.path().join(FLAT_SCRATCH_DIR)).unwrap();
    let before = list(d.path()).unwrap();
    std::fs::write(d.path().join("edit"), "22").unwrap();
    std::fs::write(d.path().join("new.png"), "x").unwrap();
    std::fs::write(d.path().join(FLAT_SCRATCH_DIR).join("junk"), "x").unwrap();
    std::os::unix::fs::symlink("/etc/shadow", d.path().join("leak")).unwrap();
    let after = list(d.path()).unwrap();
    let changed: Vec<_> = after
        .changed_since(&before)
        .into_iter()
        .map(|f| f.name)
        .collect();
    assert_eq!(changed, ["edit", "leak", "new.png"]);
}

#[test]
fn a_bounded_walk_gives_up_past_its_budget_and_hidden_entries_count() {
    let d = tmp();
    std::fs::write(d.path().join("a"), "1").unwrap();
    std::fs::create_dir(d.path().join(FLAT_SCRATCH_DIR)).unwrap();
    std::fs::write(d.path().join(FLAT_SCRATCH_DIR).join("x"), "1").unwrap();
    // Three entries, one listed: the budget counts what the walk visits.
    let full = list_within(d.path(), 3)
        .unwrap()
        .expect("within its budget");
    assert_eq!(full.usage.entries, 3);
    assert_eq!(full.files.len(), 1);
    assert!(list_within(d.path(), 2).unwrap().is_none());
    assert_eq!(list(d.path()).unwrap().usage, full.usage);
}

#[test]
fn uploads_from_sockets_are_refused() {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let u = UploadFd::new(a.into(), drop);
    assert!(matches!(
        inspect_upload(u),
        Err((_, UploadRefused::NotRegular))
    ));
    let f = tempfile::tempfile_in("/var/tmp").unwrap();
    let u = UploadFd::new(f.into(), drop);
    if let Err((_, e)) = inspect_upload(u) {
        // /var/tmp on an unusual file system says which.
        assert!(matches!(e, UploadRefused::FileSystem(_)), "{e}");
    }
}

/// A session directory laid out with `data/` and `tmp/`: names are relative to `data/`,
/// the scratch is never listed but always counted, and nothing outside `data/` is reached.
#[test]
fn the_split_layout_lists_the_files_directory_and_counts_the_scratch() {
    let d = tmp();
    lay_out(d.path(), None, None).unwrap();
    assert_eq!(files_dir(d.path()), d.path().join(FILES_DIR));
    std::fs::write(d.path().join(SCRATCH_DIR).join("t"), vec![1u8; 20_000]).unwrap();
    std::fs::create_dir(d.path().join(SCRATCH_DIR).join("sub")).unwrap();
    std::fs::write(d.path().join("stray"), "s").unwrap();
    std::fs::write(d.path().join(FILES_DIR).join("user.txt"), "u").unwrap();
    put(
        d.path(),
        "up/loaded.csv",
        2,
        Source::Inline(b"a\n".to_vec()),
        None,
        &LIMITS,
    )
    .unwrap();
    let l = list(d.path()).unwrap();
    let names: Vec<&str> = l.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["up", "up/loaded.csv", "user.txt"]);
    // data, tmp, stray, tmp/t, tmp/sub, data/user.txt, data/up, data/up/loaded.csv.
    assert_eq!(l.usage.entries, 8);
    assert!(l.usage.bytes >= 20_000, "{:?}", l.usage);
    assert!(!l.truncated);
    let (_, bytes, eof) = read(d.path(), "user.txt", 0, 10, None).unwrap();
    assert_eq!((bytes.as_slice(), eof), (&b"u"[..], true));
    assert!(matches!(
        read(d.path(), "stray", 0, 10, None),
        Err(Error::NoSuchFile(_))
    ));
    assert!(matches!(
        read(d.path(), "../tmp/t", 0, 10, None),
        Err(Error::InvalidName { .. })
    ));
    delete(d.path(), "user.txt").unwrap();
    assert!(d.path().join(SCRATCH_DIR).join("t").exists());
    // A cell's new scratch files are no change of its files.
    let before = list(d.path()).unwrap();
    std::fs::write(d.path().join(SCRATCH_DIR).join("new"), "n").unwrap();
    std::fs::write(d.path().join(FILES_DIR).join("new"), "n").unwrap();
    let changed: Vec<String> = list(d.path())
        .unwrap()
        .changed_since(&before)
        .into_iter()
        .map(|f| f.name)
        .collect();
    assert_eq!(changed, ["new"]);
}

/// A symlink planted as the files directory is never followed.
#[test]
fn a_symlink_for_the_files_directory_is_refused() {
    let d = tmp();
    let outside = tmp();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    std::os::unix::fs::symlink(outside.path(), d.path().join(FILES_DIR)).unwrap();
    assert!(matches!(
        read(d.path(), "secret", 0, 10, None),
        Err(Error::Io { .. })
    ));
    assert_eq!(files_dir(d.path()), d.path());
    let l = list(d.path()).unwrap();
    assert!(l.files.iter().all(|f| f.name != "secret"), "{:?}", l.files);
}
