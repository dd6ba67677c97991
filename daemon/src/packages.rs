//! Per-session packages: the package sources an operator names per environment
//! (`wheelhouse` for native Python, `cran_repository` for R in sandcelld.toml), checked at
//! start and reload ([`Source::check`]) and listed by `ListEnvironments`
//! ([`Source::inventory`]: kind, package count and names, never the host path).
//!
//! The daemon never installs anything itself and never opens a package. A source is a
//! read-only path of the worker's view (`worker::spawn::plan`), named to the worker by one
//! environment variable ([`Source::env_var`]); the worker installs from it, in-process, into
//! [`SESSION_PACKAGES_DIR`] under its scratch directory, which lies on the session's bounded
//! file system: installed bytes count against the session's disk budget and vanish with it.
//! - Python (`worker-native/python/worker.py`, `sandcell.install`): wheels only (PEP 427,
//!   the binary distribution format); a source distribution is refused, because building one
//!   runs its code and needs compilers. Where the wheelhouse has a `SHA256SUMS` file (lines
//!   of `<sha256 hex>  <file name>`, as sha256sum(1) writes them) a wheel must be listed in
//!   it with its digest.
//! - R (`worker-native/r/worker.R`, `install.packages`): binary packages only (tarballs of
//!   installed package directories, as `R CMD INSTALL --build` makes them, whose
//!   `DESCRIPTION` has a `Built:` field), unpacked with R's internal untar; a source package
//!   is refused, because installing one runs `R CMD INSTALL` in a child process. Where the
//!   index has `MD5sum` fields (as `tools::write_PACKAGES` writes them) a tarball must match.

use sandcell_proto::kernel::{MAX_LISTED_PACKAGES, PackageSource};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The per-session package directory, relative to the worker's scratch directory (`TMPDIR`):
/// `python/` holds installed wheels (first on `sys.path`), `R/` installed R packages (first
/// on `.libPaths()`).
pub const SESSION_PACKAGES_DIR: &str = "packages";

/// Entries of a wheelhouse directory read at most when it is listed.
pub const MAX_SCANNED_ENTRIES: usize = 100_000;

/// Bytes of a CRAN repository's `src/contrib/PACKAGES` index read at most when it is listed.
pub const MAX_INDEX_BYTES: u64 = 16 * 1024 * 1024;

/// What kind of package source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A directory of Python wheels.
    Wheelhouse,
    /// A local CRAN-style repository of R binary packages.
    CranRepository,
}

impl Kind {
    /// The sandcelld.toml key naming it: `wheelhouse` or `cran_repository`.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Wheelhouse => "wheelhouse",
            Kind::CranRepository => "cran_repository",
        }
    }
}

/// An environment's package source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Its kind.
    pub kind: Kind,
    /// The host directory (absolute); shown to no client.
    pub path: PathBuf,
}

impl Source {
    /// A wheelhouse at `path`.
    pub fn wheelhouse(path: PathBuf) -> Self {
        Source {
            kind: Kind::Wheelhouse,
            path,
        }
    }

    /// A CRAN-style repository at `path`.
    pub fn cran_repository(path: PathBuf) -> Self {
        Source {
            kind: Kind::CranRepository,
            path,
        }
    }

    /// The variable of the worker's environment that names the source:
    /// `SANDCELL_WHEELHOUSE` or `SANDCELL_CRAN_REPOSITORY`.
    pub fn env_var(&self) -> &'static str {
        match self.kind {
            Kind::Wheelhouse => "SANDCELL_WHEELHOUSE",
            Kind::CranRepository => "SANDCELL_CRAN_REPOSITORY",
        }
    }

    /// Checks that the source can serve: a readable directory and, for a CRAN repository, a
    /// readable `src/contrib/PACKAGES` index.
    ///
    /// Errors: what is wrong, as a sentence for the configuration error.
    pub fn check(&self) -> Result<(), String> {
        let meta = std::fs::metadata(&self.path).map_err(|e| format!("{e}"))?;
        if !meta.is_dir() {
            return Err("not a directory".into());
        }
        std::fs::read_dir(&self.path).map_err(|e| format!("cannot be listed: {e}"))?;
        if self.kind == Kind::CranRepository {
            let index = self.path.join("src/contrib/PACKAGES");
            std::fs::File::open(&index).map_err(|e| {
                format!(
                    "src/contrib/PACKAGES: {e} (write the index with \
                     tools::write_PACKAGES(\"<repository>/src/contrib\", type = \"source\"))"
                )
            })?;
        }
        Ok(())
    }

    /// What the source offers, as `ListEnvironments` reports it: kind, number of packages,
    /// their names (name order, at most [`MAX_LISTED_PACKAGES`]), and whether a hash manifest
    /// is there. A source that cannot be read now (it went away after start) lists nothing and
    /// says why; the host path is never shown.
    ///
    /// Kept from the last call while the files it was read from are unchanged (modification
    /// time and size of the directory and of the index or manifest: adding, removing or
    /// renaming a wheel changes the directory's), so a client calling `ListEnvironments` in a
    /// loop costs a few stat(2) calls per source, not a scan of up to
    /// [`MAX_SCANNED_ENTRIES`] entries or [`MAX_INDEX_BYTES`] of index each time.
    pub fn inventory(&self) -> PackageSource {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        type Cache = Mutex<HashMap<(PathBuf, &'static str), (Fingerprint, PackageSource)>>;
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let key = (self.path.clone(), self.kind.key());
        let now = self.fingerprint();
        if let Some((seen, inv)) = cache.lock().unwrap().get(&key)
            && *seen == now
        {
            return inv.clone();
        }
        let inv = self.scan();
        let mut c = cache.lock().unwrap();
        // Keys are configured sources; a reload that names new ones replaces the lot when
        // there are many.
        if c.len() >= 256 {
            c.clear();
        }
        c.insert(key, (now, inv.clone()));
        inv
    }

    /// Modification time and size of each file [`Source::scan`] reads (`None`: absent).
    fn fingerprint(&self) -> Fingerprint {
        let files: [PathBuf; 2] = match self.kind {
            Kind::Wheelhouse => [self.path.clone(), self.path.join("SHA256SUMS")],
            Kind::CranRepository => [
                self.path.join("src/contrib"),
                self.path.join("src/contrib/PACKAGES"),
            ],
        };
        files.map(|f| {
            std::fs::metadata(f)
                .ok()
                .map(|m| (m.modified().ok(), m.len()))
        })
    }

    fn scan(&self) -> PackageSource {
        let mut out = PackageSource {
            kind: self.kind.key().into(),
            packages: 0,
            names: Vec::new(),
            names_truncated: false,
            hash_manifest: false,
            reason: None,
        };
        let names = match self.kind {
            Kind::Wheelhouse => {
                out.hash_manifest = self.path.join("SHA256SUMS").is_file();
                wheelhouse_names(&self.path)
            }
            Kind::CranRepository => {
                let index = self.path.join("src/contrib/PACKAGES");
                out.hash_manifest = true;
                read_bounded(&index).map(|text| {
                    out.hash_manifest = text.lines().any(|l| l.starts_with("MD5sum:"));
                    cran_index_names(&text)
                })
            }
        };
        match names {
            Ok(names) => {
                out.packages = names.len() as u64;
                out.names_truncated = names.len() > MAX_LISTED_PACKAGES;
                out.names = names.into_iter().take(MAX_LISTED_PACKAGES).collect();
            }
            Err(e) => {
                out.hash_manifest = false;
                out.reason = Some(format!("cannot be read: {}", e.kind()));
            }
        }
        out
    }
}

/// What [`Source::fingerprint`] returns: per file, its modification time and size.
type Fingerprint = [Option<(Option<std::time::SystemTime>, u64)>; 2];

fn read_bounded(path: &Path) -> std::io::Result<String> {
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_INDEX_BYTES)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// The distinct project names (normalized) of the wheels in `dir`, from the file names
/// alone; at most [`MAX_SCANNED_ENTRIES`] entries are read.
fn wheelhouse_names(dir: &Path) -> std::io::Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for e in std::fs::read_dir(dir)?.take(MAX_SCANNED_ENTRIES) {
        let e = e?;
        if let Some((name, _)) = e.file_name().to_str().and_then(wheel_name) {
            names.insert(name);
        }
    }
    Ok(names)
}

/// The normalized project name and the version of a wheel file name
/// (`{distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl`, PEP 427 and the
/// binary distribution format specification); `None` for anything else.
pub fn wheel_name(file: &str) -> Option<(String, String)> {
    let stem = file.strip_suffix(".whl")?;
    let parts: Vec<&str> = stem.split('-').collect();
    if !(5..=6).contains(&parts.len()) || parts.iter().any(|p| p.is_empty()) {
        return None;
    }
    Some((normalize(parts[0]), parts[1].to_owned()))
}

/// A Python project name normalized as PEP 503 says: lowercase, each run of `-`, `_`, `.`
/// one `-`.
pub fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
            continue;
        }
        if sep && !out.is_empty() {
            out.push('-');
        }
        sep = false;
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The `Package:` fields of a CRAN index (`PACKAGES`, Debian control file syntax), distinct,
/// in name order.
pub fn cran_index_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("Package:"))
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty() && n.len() <= 128)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_file_names_parse_and_normalize() {
        assert_eq!(
            wheel_name("Tiny_Pkg-1.2-py3-none-any.whl"),
            Some(("tiny-pkg".into(), "1.2".into()))
        );
        assert_eq!(
            wheel_name("a-1.0-1-cp311-cp311-manylinux_2_17_x86_64.whl"),
            Some(("a".into(), "1.0".into()))
        );
        assert_eq!(wheel_name("a-1.0.tar.gz"), None);
        assert_eq!(wheel_name("a-1.0-py3.whl"), None);
        assert_eq!(normalize("Foo.Bar__baz"), "foo-bar-baz");
    }

    #[test]
    fn cran_index_lists_package_fields() {
        let names = cran_index_names("Package: b\nVersion: 1\n\nPackage: a\nVersion: 2\n");
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn sources_are_checked_and_listed_without_paths() {
        let dir = std::env::temp_dir().join(format!("sc-packages-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src/contrib")).unwrap();
        std::fs::write(dir.join("x-1.0-py3-none-any.whl"), b"").unwrap();
        std::fs::write(dir.join("x-0.9-py3-none-any.whl"), b"").unwrap();
        std::fs::write(dir.join("y-1.0.tar.gz"), b"").unwrap();
        let wh = Source::wheelhouse(dir.clone());
        wh.check().unwrap();
        let inv = wh.inventory();
        assert_eq!(
            (inv.packages, inv.names.clone()),
            (1, vec!["x".to_string()])
        );
        assert!(!inv.hash_manifest);
        let cran = Source::cran_repository(dir.clone());
        assert!(cran.check().unwrap_err().contains("PACKAGES"));
        std::fs::write(dir.join("src/contrib/PACKAGES"), "Package: p\nMD5sum: 00\n").unwrap();
        cran.check().unwrap();
        let inv = cran.inventory();
        assert_eq!(inv.names, ["p"]);
        assert!(inv.hash_manifest);
        // Kept while the directory is unchanged: a wheel added with the directory's time
        // put back is not seen; one added normally is.
        let mtime = std::fs::metadata(&dir).unwrap().modified().unwrap();
        std::fs::write(dir.join("z-1.0-py3-none-any.whl"), b"").unwrap();
        std::fs::File::open(&dir)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(wh.inventory().packages, 1, "rescanned although unchanged");
        std::fs::write(dir.join("w-1.0-py3-none-any.whl"), b"").unwrap();
        assert_eq!(wh.inventory().names, ["w", "x", "z"]);
        assert!(
            Source::wheelhouse(dir.join("missing"))
                .check()
                .unwrap_err()
                .contains("No such file")
        );
        assert!(
            Source::wheelhouse(dir.join("y-1.0.tar.gz"))
                .check()
                .unwrap_err()
                .contains("not a directory")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
