//! The prepared Python runtime directory and its manifest.
//!
//! `sandcell-python-runtime prepare --out DIR` produces, offline, from what the `eryx` and
//! `eryx-runtime` crates ship:
//!
//! ```text
//! DIR/manifest.json     this module's Manifest (versions, CPU features, sizes, hashes)
//! DIR/python.cwasm      pre-initialised CPython component, compiled ahead of time
//! DIR/python-stdlib/    the Python standard library Eryx embeds, mounted read-only in guests
//! ```
//!
//! The worker loads the directory read-only. It never uses Eryx's shared, unversioned
//! `/tmp/eryx-embedded` stdlib (Eryx 0.10 trusts that directory if it exists). Loading a `.cwasm` is `unsafe`
//! (wasmtime trusts the machine code in it), so [`load_executor`] refuses artefacts that
//! anyone but their owner (root or the worker's own uid) could have written, and refuses a
//! manifest whose Eryx version, engine configuration or CPU features do not match this host.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use eryx::PythonExecutor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::driver;

/// Eryx version this worker is built against (Cargo.toml pins `=0.10.1`).
pub const ERYX_VERSION: &str = "0.10.1";
/// CPython version inside eryx-runtime 0.10.1.
pub const PYTHON_VERSION: &str = "3.14";
/// Manifest file name inside the runtime directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Compiled component file name inside the runtime directory.
pub const CWASM_FILE: &str = "python.cwasm";
/// Standard library directory name inside the runtime directory.
pub const STDLIB_DIR: &str = "python-stdlib";
/// Version of the manifest layout.
pub const MANIFEST_FORMAT: u32 = 1;

/// Modules imported into the pre-initialised snapshot, so cells get them nearly free.
///
/// `dill` is what Eryx's state snapshots use; `_sandcell` (the driver) is installed by the
/// setup code. Measured effect: see the bench subcommand and the crate report.
pub const PREINIT_IMPORTS: &[&str] = &[
    "json",
    "re",
    "math",
    "cmath",
    "statistics",
    "decimal",
    "fractions",
    "datetime",
    "time",
    "csv",
    "collections",
    "itertools",
    "functools",
    "operator",
    "random",
    "pickle",
    "dill",
    "traceback",
    "linecache",
    "io",
    "base64",
    "ast",
    "types",
    "string",
    "textwrap",
    "heapq",
    "bisect",
    "copy",
    "dataclasses",
    "enum",
    "typing",
    "struct",
    "array",
    "hashlib",
    "importlib",
    "pprint",
];

/// A file artefact: name, size and SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    /// File name inside the runtime directory.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex SHA-256 of the content.
    pub sha256: String,
}

/// The extracted standard library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdlibInfo {
    /// Directory name inside the runtime directory.
    pub dir: String,
    /// Number of regular files.
    pub files: u64,
    /// Total bytes of regular files.
    pub bytes: u64,
    /// SHA-256 over every (relative path, NUL, content) in path order.
    pub sha256: String,
}

/// How and when the directory was prepared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preparation {
    /// Seconds since the Unix epoch when preparation finished.
    pub unix_time: u64,
    /// Wall seconds preparation took.
    pub seconds: f64,
    /// Peak resident set size of the preparing process, in bytes (getrusage).
    pub peak_rss_bytes: u64,
    /// Size of the pre-initialised component before ahead-of-time compilation, in bytes.
    pub component_bytes: u64,
}

/// `DIR/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// [`ERYX_VERSION`].
    pub eryx_version: String,
    /// Python version of the runtime.
    pub python_version: String,
    /// `PythonExecutor::ENGINE_CONFIG_VERSION` of the compiling Eryx.
    pub engine_config_version: u32,
    /// `<arch>-<os>` the cwasm was compiled for.
    pub target: String,
    /// CPU feature level: `native` (the preparing host's features).
    pub cpu_level: String,
    /// The host CPU features the cwasm may use (see [`host_cpu_features`]).
    pub cpu_features: Vec<String>,
    /// [`PREINIT_IMPORTS`] at preparation time.
    pub preinit_imports: Vec<String>,
    /// [`driver::DRIVER_HASH`] of the driver baked into the snapshot (0 when unknown).
    #[serde(default)]
    pub driver_hash: u64,
    /// The compiled component.
    pub cwasm: Artifact,
    /// The standard library.
    pub stdlib: StdlibInfo,
    /// Preparation figures.
    pub prepared: Preparation,
}

/// `<arch>-<os>` of this build.
pub fn target() -> String {
    format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS)
}

/// CPU features of this host that Cranelift may use, sorted. A cwasm compiled for `native`
/// may use any of them; a host missing one of them cannot load it.
pub fn host_cpu_features() -> Vec<String> {
    #[allow(unused_mut)]
    let mut v: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_x86_feature_detected!($f) { v.push($f); } )* };
        }
        probe!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "avx",
            "avx2",
            "fma",
            "bmi1",
            "bmi2",
            "lzcnt",
            "avx512f",
            "avx512vl",
            "avx512dq",
            "avx512bw",
            "avx512vbmi",
            "cmpxchg16b"
        );
    }
    let mut v: Vec<String> = v.into_iter().map(String::from).collect();
    v.sort();
    v
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, streamed.
///
/// Errors: the file cannot be read.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Walks `dir` and returns (files, bytes, sha256) over (relative path, NUL, content) in order.
///
/// Errors: a file or directory cannot be read, or a symbolic link is found (the stdlib has none).
pub fn hash_tree(dir: &Path) -> io::Result<(u64, u64, String)> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let ty = entry.file_type()?;
            let path = entry.path();
            if ty.is_symlink() {
                return Err(io::Error::other(format!(
                    "symbolic link in stdlib: {}",
                    path.display()
                )));
            } else if ty.is_dir() {
                walk(base, &path, out)?;
            } else if ty.is_file() {
                out.push(
                    path.strip_prefix(base)
                        .map_err(io::Error::other)?
                        .to_path_buf(),
                );
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    walk(dir, dir, &mut files)?;
    files.sort();
    let mut h = Sha256::new();
    let mut total = 0u64;
    for rel in &files {
        let data = fs::read(dir.join(rel))?;
        total += data.len() as u64;
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update([0u8]);
        h.update((data.len() as u64).to_le_bytes());
        h.update(&data);
    }
    Ok((files.len() as u64, total, hex(&h.finalize())))
}

impl Manifest {
    /// Reads `dir/manifest.json`.
    ///
    /// Errors: missing, unreadable or not a manifest.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Why this manifest cannot be used by this build on this host, if it cannot: a different
    /// manifest format, Eryx version, engine configuration or target, or a CPU feature the
    /// host lacks.
    pub fn incompatibility(&self) -> Option<String> {
        if self.format != MANIFEST_FORMAT {
            return Some(format!(
                "manifest format {} (expected {MANIFEST_FORMAT})",
                self.format
            ));
        }
        if self.eryx_version != ERYX_VERSION {
            return Some(format!(
                "prepared by eryx {} (this build uses {ERYX_VERSION})",
                self.eryx_version
            ));
        }
        if self.engine_config_version != PythonExecutor::ENGINE_CONFIG_VERSION {
            return Some(format!(
                "engine config version {} (this build uses {})",
                self.engine_config_version,
                PythonExecutor::ENGINE_CONFIG_VERSION
            ));
        }
        if self.target != target() {
            return Some(format!(
                "compiled for {} (this host is {})",
                self.target,
                target()
            ));
        }
        let host: BTreeSet<String> = host_cpu_features().into_iter().collect();
        let missing: Vec<&String> = self
            .cpu_features
            .iter()
            .filter(|f| !host.contains(*f))
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "compiled for CPU features this host lacks: {missing:?}"
            ));
        }
        None
    }

    /// Whether `prepare` would produce the same thing: compatible, same CPU features (so a
    /// cwasm from a weaker host gets recompiled here), same snapshot contents, and the
    /// artefacts are present with the recorded sizes. Cheap: no hashing.
    pub fn is_current(&self, dir: &Path) -> bool {
        self.incompatibility().is_none()
            && self.cpu_features == host_cpu_features()
            && self.preinit_imports
                == PREINIT_IMPORTS
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
            && self.driver_hash == driver::DRIVER_HASH
            && fs::metadata(dir.join(&self.cwasm.file))
                .map(|m| m.len() == self.cwasm.bytes)
                .unwrap_or(false)
            && dir.join(&self.stdlib.dir).join("encodings").is_dir()
    }
}

/// Refuses a path that someone other than root or this process's uid owns, or that group or
/// others may write: the worker executes the machine code in the cwasm.
fn check_trusted(path: &Path) -> Result<()> {
    let meta = fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != euid {
        bail!(
            "{} is owned by uid {}, neither root nor this process",
            path.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "{} is writable by group or others (mode {:o})",
            path.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

/// Loads the prepared runtime in `dir` as an Eryx executor whose result variable is the
/// driver's ([`driver::RESULT_VARIABLE`]) and whose stdlib is `dir/python-stdlib`.
///
/// Errors: no or incompatible manifest, untrusted or missing artefacts (see module docs), or
/// Eryx cannot deserialize the cwasm.
pub fn load_executor(dir: &Path) -> Result<(PythonExecutor, Manifest)> {
    let manifest = Manifest::read(dir)?;
    if let Some(why) = manifest.incompatibility() {
        bail!(
            "runtime in {} is not usable here: {why}; run sandcell-python-runtime prepare",
            dir.display()
        );
    }
    let cwasm = dir.join(&manifest.cwasm.file);
    let stdlib = dir.join(&manifest.stdlib.dir);
    check_trusted(dir)?;
    check_trusted(&cwasm)?;
    check_trusted(&stdlib)?;
    let len = fs::metadata(&cwasm)?.len();
    if len != manifest.cwasm.bytes {
        bail!(
            "{} has {len} bytes, the manifest says {}",
            cwasm.display(),
            manifest.cwasm.bytes
        );
    }
    // SAFETY: the cwasm was produced by `sandcell-python-runtime prepare` with this Eryx
    // version and engine configuration (checked against the manifest above), and it and its
    // directory are writable only by root or by this uid (check_trusted), so the machine code
    // wasmtime maps is the code that prepare compiled.
    let executor = unsafe { PythonExecutor::from_precompiled_file(&cwasm) }
        .with_context(|| format!("loading {}", cwasm.display()))?
        .with_python_stdlib(stdlib)
        .with_result_variable(driver::RESULT_VARIABLE);
    Ok((executor, manifest))
}
