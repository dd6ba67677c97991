//! Files of a session's directory: `put` and `get`, and the halves of `run` that use them:
//! `run --put FILE[:NAME]` ([`put_spec`], [`check_uploads`]) and `run --artifacts DIR`
//! ([`save_artifacts`], which never overwrites a file nor follows a symlink in DIR).

use super::{Ctx, Outcome};
use crate::out::escape_name;
use sandcell_client::{Client, Error, FileInfo, FileKind};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `put SESSION FILE [NAME]`.
#[derive(Debug, clap::Args)]
pub struct Put {
    /// Session id.
    session: String,
    /// Local file (passed to the daemon as a descriptor).
    file: PathBuf,
    /// Relative path in the session directory.
    name: Option<String>,
}

impl Put {
    /// Uploads the file (a missing one is named before connecting) and prints `NAME SIZE
    /// bytes` (`--json`: the file's `FileInfo`).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        check_uploads([self.file.as_path()])?;
        let name = match self.name {
            Some(n) => n,
            None => file_name(&self.file),
        };
        let mut c = ctx.connect().await?;
        let info = c.put_file(&self.session, &name, &self.file).await?;
        if ctx.json {
            crate::out::json(&info);
        } else {
            outln!("{} {} bytes", escape_name(&info.name), info.size);
        }
        Ok(0)
    }
}

/// `get SESSION NAME [OUT]`.
#[derive(Debug, clap::Args)]
pub struct Get {
    /// Session id.
    session: String,
    /// Relative path in the session directory.
    name: String,
    /// Where to write.
    out: Option<PathBuf>,
}

impl Get {
    /// Downloads NAME into OUT (default: NAME's last component; `-`: standard output; an
    /// existing directory: NAME's last component in it). A file is written next to OUT as
    /// `.OUT.PID.sandcellctl-part`, created new (two downloads never share it), and renamed
    /// into place only when complete (removed on failure).
    ///
    /// Errors: [`Error::File`] when NAME has no last component to name OUT by (`.`, `..`)
    /// and no OUT is given, or the local file cannot be written; the daemon's errors.
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        let out = self.target()?;
        let mut c = ctx.connect().await?;
        if out.as_os_str() == "-" {
            c.get_file(&self.session, &self.name, std::io::stdout().lock())
                .await?;
            return Ok(0);
        }
        let leaf = out.file_name().unwrap_or_default().to_string_lossy();
        let tmp = out.with_file_name(format!(".{leaf}.{}.sandcellctl-part", std::process::id()));
        let f = std::fs::File::create_new(&tmp).map_err(|source| Error::File {
            // The temporary file is this command's own: the user named `out`.
            what: format!("create {}", out.display()),
            source,
        })?;
        let got = c
            .get_file(&self.session, &self.name, std::io::BufWriter::new(f))
            .await;
        if let Err(e) = got {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        std::fs::rename(&tmp, &out).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            Error::File {
                what: format!("rename to {}", out.display()),
                source,
            }
        })?;
        Ok(0)
    }

    /// Where the download goes: OUT, NAME's last component inside OUT when OUT is a
    /// directory, or NAME's last component here.
    fn target(&self) -> Result<PathBuf, Error> {
        let leaf = Path::new(&self.name).file_name();
        let named = |dir: &Path| match leaf {
            Some(l) => Ok(dir.join(l)),
            None => Err(Error::File {
                what: format!("cannot download {}", escape_name(&self.name)),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "it has no file name to save it as; give OUT",
                ),
            }),
        };
        match &self.out {
            Some(out) if out.as_os_str() != "-" && out.is_dir() => named(out),
            Some(out) => Ok(out.clone()),
            None => named(Path::new("")),
        }
    }
}

/// The last component of `path`, as the name a file gets in the session's directory.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Fails with `cannot upload PATH: ...` ([`Error::File`]) for the first of `paths` that
/// cannot be looked at, so that a missing input is named before any connection is tried.
pub fn check_uploads<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Result<(), Error> {
    for path in paths {
        if let Err(source) = std::fs::metadata(path) {
            let what = format!("cannot upload {}", path.display());
            return Err(Error::File { what, source });
        }
    }
    Ok(())
}

/// `run --put FILE[:NAME]`: the local path and the name in the cell's directory. The whole
/// argument is the path when a file of that name exists (a path may contain `:`); otherwise
/// it splits at the last `:`. Without a name, the path's file name.
pub fn put_spec(arg: &str) -> (PathBuf, String) {
    let whole = PathBuf::from(arg);
    let (path, name) = match arg.rsplit_once(':') {
        Some((p, n)) if !whole.exists() && !p.is_empty() && !n.is_empty() => {
            (PathBuf::from(p), Some(n.to_owned()))
        }
        _ => (whole, None),
    };
    let name = name.unwrap_or_else(|| file_name(&path));
    (path, name)
}

/// Why a file name from a cell is not saved under `--artifacts`, or its components.
///
/// Refused: an empty or absolute name, an empty, `.` or `..` component, any component that
/// starts with `.` (a cell must not plant `.bashrc`, `.git/config` or `.ssh/authorized_keys`
/// in DIR), control characters (a name with a newline misleads whoever reads the listing
/// line by line), and more than 4 components (the daemon's own bound).
fn artifact_parts(name: &str) -> Result<Vec<&str>, &'static str> {
    if name.is_empty() {
        return Err("empty name");
    }
    if name.starts_with('/') {
        return Err("absolute name");
    }
    if name
        .chars()
        .any(|c| c.is_control() || sandcell_proto::text::is_invisible_format(c))
    {
        return Err("control or invisible characters in the name");
    }
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 4 {
        return Err("more than 4 components");
    }
    for p in &parts {
        if p.is_empty() {
            return Err("empty component");
        }
        if p.starts_with('.') {
            return Err("a component starts with '.' (hidden files, '.' and '..' are not saved)");
        }
        // A name like `-rf` in DIR turns a later `rm *` there into `rm -rf ...`.
        if p.starts_with('-') {
            return Err("a component starts with '-' (it would read as an option to shell tools)");
        }
    }
    Ok(parts)
}

/// `openat(dir, name, flags | O_CLOEXEC | O_NOFOLLOW, mode)`: never follows a symlink in the
/// last component; `name` is one component.
fn open_at(
    dir: &std::fs::File,
    name: &str,
    flags: i32,
    mode: u32,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = std::ffi::CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `dir` is an open directory and `c` NUL-terminated for the call's duration.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            mode as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor returned by the kernel, owned from here on.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Opens (creating) the directory `name` beneath `dir`: `mkdirat` then `openat` with
/// `O_DIRECTORY | O_NOFOLLOW`, so a symlink in DIR is never followed.
fn subdir_at(dir: &std::fs::File, name: &str) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let c = std::ffi::CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: as in `open_at`; mkdirat never follows a symlink in its last component.
    if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o777) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

/// Saves the regular files among `files` (a cell's `files`) from `session` into `dir`,
/// printing each path saved (escaped), and nothing else is written. Every file is created
/// new (`O_CREAT | O_EXCL | O_NOFOLLOW`) beneath a descriptor of DIR, with subdirectories
/// opened `O_NOFOLLOW`: an existing file is never overwritten, a symlink never followed.
/// Names [`artifact_parts`] refuses, existing files, symlinks and special files are skipped
/// with a note on standard error.
///
/// Errors: [`Error::File`] when DIR cannot be created or opened, or a download cannot be
/// written (the partial file is removed); the daemon's errors for a download.
pub async fn save_artifacts(
    c: &mut Client,
    session: &str,
    files: &[FileInfo],
    dir: &Path,
) -> Result<(), Error> {
    let local = |what: String| move |source| Error::File { what, source };
    std::fs::create_dir_all(dir).map_err(local(format!("create {}", dir.display())))?;
    let root = std::fs::File::open(dir).map_err(local(format!("open {}", dir.display())))?;
    for f in files {
        let shown = escape_name(&f.name);
        if f.kind != FileKind::File {
            if f.kind != FileKind::Dir {
                errln!("sandcellctl: not saved: {shown} is a {}", f.kind.as_str());
            }
            continue;
        }
        let parts = match artifact_parts(&f.name) {
            Ok(p) => p,
            Err(why) => {
                errln!("sandcellctl: not saved: {shown}: {why}");
                continue;
            }
        };
        let (leaf, parents) = parts.split_last().expect("at least one component");
        let mut cur = root.try_clone().map_err(local("dup".into()))?;
        let mut blocked = None;
        for p in parents {
            match subdir_at(&cur, p) {
                Ok(d) => cur = d,
                Err(e) => {
                    blocked = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = blocked {
            errln!("sandcellctl: not saved: {shown}: {e}");
            continue;
        }
        let path = dir.join(&f.name);
        let out = match open_at(
            &cur,
            leaf,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o666,
        ) {
            Ok(out) => out,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                errln!(
                    "sandcellctl: not saved: {} exists (never overwritten)",
                    escape_name(&path.display().to_string())
                );
                continue;
            }
            Err(e) => {
                errln!("sandcellctl: not saved: {shown}: {e}");
                continue;
            }
        };
        let mut w = std::io::BufWriter::new(out);
        let got = c.get_file(session, &f.name, &mut w).await;
        let flushed = got.and_then(|_| {
            w.flush().map_err(|source| Error::File {
                what: format!("write {}", path.display()),
                source,
            })
        });
        if let Err(e) = flushed {
            // Remove the partial file we created (by its descriptor's directory).
            if let Ok(cname) = std::ffi::CString::new(*leaf) {
                use std::os::fd::AsRawFd;
                // SAFETY: `cur` is open and `cname` NUL-terminated; removes our own file.
                unsafe { libc::unlinkat(cur.as_raw_fd(), cname.as_ptr(), 0) };
            }
            return Err(e);
        }
        outln!("{}", escape_name(&path.display().to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::artifact_parts;

    #[test]
    fn hidden_absolute_and_dot_names_are_not_saved() {
        for bad in [
            ".bashrc",
            ".git/config",
            ".ssh/authorized_keys",
            "a/.ssh/authorized_keys",
            "../x",
            "a/../../x",
            "./x",
            "/etc/passwd",
            "a//b",
            "",
            "a\nb",
            "a\tb",
            "x\u{202e}fdp.exe",
            "a/b/c/d/e",
            "-rf",
            "plots/--force",
        ] {
            assert!(artifact_parts(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            artifact_parts("plots/p-1.png").unwrap(),
            ["plots", "p-1.png"]
        );
    }
}
