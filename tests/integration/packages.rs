//! Per-session packages through a real sandcelld: an environment's wheelhouse (pydata,
//! `sandcell.install`) and local CRAN-style repository (R, `install.packages`), built by the
//! test itself (nothing from the network): ListEnvironments shows what they offer and never
//! where they are; installs land in the session's own file system (counted against its disk
//! budget, over it refused, gone after Close) and import or load in the same session; a
//! source distribution, a hash mismatch, a name the source does not offer are refused with a
//! reason; the source is read-only to the cell.

use crate::common;

use common::Daemon;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Python defining `whl(name, version, files, deps=())`, which writes a pure-Python wheel
/// (`.dist-info` with METADATA, WHEEL, RECORD of sha256 digests) into `out` (`sys.argv[1]`)
/// with the standard library's zipfile and returns its path.
const WHEEL_WRITER: &str = r#"
import base64, hashlib, os, sys, zipfile
out = sys.argv[1]
def whl(name, version, files, deps=()):
    dist = "%s-%s.dist-info" % (name, version)
    entries = dict(files)
    entries[dist + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)
        + "".join("Requires-Dist: %s\n" % d for d in deps)).encode()
    entries[dist + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rec = []
    for k, v in entries.items():
        d = base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b"=").decode()
        rec.append("%s,sha256=%s,%d" % (k, d, len(v)))
    rec.append(dist + "/RECORD,,")
    entries[dist + "/RECORD"] = ("\n".join(rec) + "\n").encode()
    path = os.path.join(out, "%s-%s-py3-none-any.whl" % (name, version))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in entries.items():
            z.writestr(k, v)
    return path
"#;

/// Runs `script` after [`WHEEL_WRITER`] with `dir` as `out`.
fn write_wheels(dir: &Path, script: &str) {
    let st = Command::new("/usr/bin/python3")
        .args(["-I", "-c", &format!("{WHEEL_WRITER}{script}")])
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success(), "building the wheelhouse");
}

/// A wheelhouse built with the standard library's zipfile (the binary distribution format:
/// `.dist-info` with METADATA, WHEEL, RECORD of sha256 digests):
/// - `tinypkg 1.2` (a package with 1 MiB of data) requiring `tinydep>=1`, `tinydep 1.0`;
/// - `bigpkg 1.0` holding a 12 MiB file (over the test's disk budget);
/// - `badhash 1.0`, listed in SHA256SUMS with a wrong digest; `unlisted 1.0`, not listed;
/// - `srconly`, only a source distribution;
/// - `compiled 1.0`, with an extension module (`.so`);
/// - `metabomb 1.0`, 1.5 MB whose `WHEEL` member inflates to 1.5 GiB.
fn build_wheelhouse(dir: &Path) {
    let script = r#"
sums = []
def listed(path, digest=None):
    d = digest or hashlib.sha256(open(path, "rb").read()).hexdigest()
    sums.append("%s  %s" % (d, os.path.basename(path)))
listed(whl("tinypkg", "1.2", {"tinypkg/__init__.py": b"VALUE = 42\nfrom tinydep import X\n",
                              "tinypkg/blob.bin": os.urandom(1 << 20)}, deps=["tinydep>=1"]))
listed(whl("tinydep", "1.0", {"tinydep.py": b"X = 7\n"}))
listed(whl("bigpkg", "1.0", {"bigpkg/__init__.py": b"", "bigpkg/big.bin": os.urandom(12 << 20)}))
listed(whl("badhash", "1.0", {"badhash.py": b""}), "0" * 64)
whl("unlisted", "1.0", {"unlisted.py": b""})
listed(whl("compiled", "1.0", {"compiled/__init__.py": b"", "compiled/_ext.cpython-311-x86_64-linux-gnu.so": b"\x7fELF"}))
# A wheel of 1.5 MB whose WHEEL member inflates to 1.5 GiB.
bomb = os.path.join(out, "metabomb-1.0-py3-none-any.whl")
with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
    with z.open("metabomb-1.0.dist-info/WHEEL", "w", force_zip64=True) as f:
        zeros = bytes(1 << 20)
        for _ in range(1536):
            f.write(zeros)
    z.writestr("metabomb-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: metabomb\nVersion: 1.0\n")
    z.writestr("metabomb-1.0.dist-info/RECORD", "")
listed(bomb)
open(os.path.join(out, "srconly-1.0.tar.gz"), "wb").write(b"not built")
open(os.path.join(out, "SHA256SUMS"), "w").write("\n".join(sums) + "\n")
"#;
    write_wheels(dir, script);
}

fn world_readable(dir: &Path) {
    let st = Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success());
}

fn temp_dir(prefix: &str) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    world_readable(d.path());
    d
}

/// A sandcelld.toml (in its own directory) with the environment `pydata` (native
/// `/usr/bin/python3`) installing from `wheelhouse`.
fn pydata_config(wheelhouse: &Path) -> (tempfile::TempDir, PathBuf) {
    let dir = temp_dir("sandcell-pkgconf-");
    let conf = dir.path().join("sandcelld.toml");
    std::fs::write(
        &conf,
        format!(
            "[environments.pydata]\nlanguage = \"python\"\nengine = \"native\"\n\
             interpreter = \"/usr/bin/python3\"\nwheelhouse = \"{}\"\n",
            wheelhouse.display()
        ),
    )
    .unwrap();
    (dir, conf)
}

/// A sandcelld.toml (in its own directory) with the default environment `r` installing from
/// the CRAN-style repository `repo`.
fn r_config(repo: &Path) -> (tempfile::TempDir, PathBuf) {
    let dir = temp_dir("sandcell-pkgconf-");
    let conf = dir.path().join("sandcelld.toml");
    std::fs::write(
        &conf,
        format!(
            "[environments.r]\nlanguage = \"r\"\nengine = \"native\"\ndefault = true\n\
             cran_repository = \"{}\"\n",
            repo.display()
        ),
    )
    .unwrap();
    (dir, conf)
}

fn session_dir(d: &Daemon, id: &str) -> PathBuf {
    d.dir.path().join("state/sessions").join(id)
}

#[tokio::test]
async fn pydata_installs_wheels_from_the_wheelhouse_into_the_session() {
    if !common::pydata_available() {
        eprintln!("skipped: /usr/bin/python3 cannot import numpy and pandas (the pydata tier)");
        return;
    }
    let wh = temp_dir("sandcell-wheelhouse-");
    build_wheelhouse(wh.path());
    world_readable(wh.path());
    let (_conf_dir, conf) = pydata_config(wh.path());
    // A disk budget of 8 MiB: tinypkg (1 MiB) fits, bigpkg (12 MiB) does not.
    let budget = (8u64 << 20).to_string();
    let d = Daemon::start_with_config(
        &conf,
        &[
            ("SANDCELL_MAX_SESSION_FILES_BYTES", &budget),
            ("SANDCELL_MAX_FILE_BYTES", &budget),
        ],
    );
    let mut c = d.client().await;

    // ListEnvironments: kind, count, names, the manifest; never the host path.
    let envs = c.list_environments().await.unwrap();
    let pd = envs.iter().find(|e| e.name == "pydata").expect("pydata");
    assert_eq!(pd.package_sources.len(), 1, "{pd:?}");
    let src = &pd.package_sources[0];
    assert_eq!(src.kind, "wheelhouse");
    assert_eq!(
        src.names,
        [
            "badhash", "bigpkg", "compiled", "metabomb", "tinydep", "tinypkg", "unlisted"
        ],
        "{src:?}"
    );
    assert_eq!(src.packages, 7);
    assert!(src.hash_manifest);
    let listed = serde_json::to_string(&envs).unwrap();
    assert!(
        !listed.contains(&*wh.path().to_string_lossy()),
        "the host path leaked: {listed}"
    );
    let py = envs.iter().find(|e| e.name == "python").unwrap();
    assert!(py.package_sources.is_empty());

    let o = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .expect("open pydata");
    let s = o.session.clone();
    let wh_path = wh.path().display().to_string();
    let cell = format!(
        r#"import os, sandcell
def used():
    st = os.statvfs(os.environ["TMPDIR"])
    return (st.f_blocks - st.f_bfree) * st.f_frsize
before = used()
print(sandcell.install("tinypkg==1.2"))
import tinypkg
print(tinypkg.VALUE, tinypkg.X, tinypkg.__file__.startswith(os.environ["SANDCELL_PACKAGES_DIR"]))
print("grew", used() - before >= 1 << 20)
def refused(*a):
    try:
        sandcell.install(*a)
    except sandcell.InstallError as e:
        return str(e)
    return "installed"
for name in ["srconly", "nothere", "badhash", "unlisted", "bigpkg", "compiled", "metabomb"]:
    print(name, "->", refused(name))
print("after bigpkg", used() - before < 4 << 20, os.path.exists(os.path.join(os.environ["TMPDIR"], "packages/python/bigpkg")))
try:
    open("{wh_path}/planted.py", "w")
    print("wheelhouse writable")
except OSError as e:
    print("wheelhouse read-only", type(e).__name__)
"#
    );
    let out = c.execute_collect(&s, &cell).await.unwrap();
    let text = &out.stdout;
    assert!(
        text.contains("['tinypkg 1.2', 'tinydep 1.0']\n42 7 True\n")
            && text.contains("grew True\n"),
        "{text}\n{:?}\n{}",
        out.result,
        out.stderr
    );
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} -> ")))
            .unwrap_or_else(|| panic!("no line for {name}: {text}"))
            .to_owned()
    };
    assert!(
        line("srconly").contains("only a source distribution"),
        "{text}"
    );
    assert!(line("nothere").contains("not in the wheelhouse"), "{text}");
    assert!(
        line("badhash").contains("does not match its SHA256SUMS digest"),
        "{text}"
    );
    assert!(
        line("unlisted").contains("not listed in the wheelhouse's SHA256SUMS"),
        "{text}"
    );
    assert!(line("bigpkg").contains("disk budget"), "{text}");
    // Compiled code cannot load from the noexec session files: refused, saying why.
    assert!(
        line("compiled").contains("holds compiled code") && line("compiled").contains("noexec"),
        "{text}"
    );
    // Metadata is inflated only as far as its bound: an InstallError, not the session's OOM.
    assert!(line("metabomb").contains("metabomb"), "{text}");
    assert!(!line("metabomb").ends_with("installed"), "{text}");
    assert!(text.contains("after bigpkg True False\n"), "{text}");
    assert!(
        text.contains("wheelhouse read-only"),
        "a cell could write the wheelhouse: {text}"
    );
    assert!(!wh.path().join("planted.py").exists());

    // Installed in this session only: another session does not see it.
    let o2 = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .unwrap();
    let other = c
        .execute_collect(
            &o2.session,
            "try:\n    import tinypkg\n    print('visible')\nexcept ImportError:\n    print('absent')\n",
        )
        .await
        .unwrap();
    assert_eq!(other.stdout, "absent\n", "{:?}", other.result);
    // A notebook's `%pip install` or `!pip install` is not Python: its SyntaxError names the
    // session's own installer.
    for escape in ["%pip install tinypkg", "!pip install tinypkg"] {
        let r = c.execute_collect(&o2.session, escape).await.unwrap().result;
        let e = r.error.expect("a SyntaxError");
        assert_eq!(e.kind, "SyntaxError", "{e:?}");
        assert!(e.message.contains("sandcell.install("), "{e:?}");
        // On the traceback's last line too, which is what a notebook shows.
        let tb = e.traceback.clone().unwrap_or_default();
        let last = tb.trim_end().lines().last().unwrap_or_default();
        assert!(last.contains("sandcell.install("), "{e:?}");
    }
    c.close(&o2.session).await.unwrap();

    // Gone with the session.
    let dir = session_dir(&d, &s);
    assert!(dir.exists(), "{}", dir.display());
    c.close(&s).await.unwrap();
    assert!(
        common::eventually(std::time::Duration::from_secs(10), || !dir.exists()),
        "the session directory outlived Close: {}",
        dir.display()
    );
}

/// One `sandcell.install` call is all or nothing, and wheels merge their directories:
/// - `nsa` and `nsb` both ship the namespace package `nsx/` (PEP 420, no `__init__.py`):
///   installed one after the other, both import;
/// - `top` requires `missingdep`, which the wheelhouse lacks: the call fails and leaves no `top`
///   (nor `fine`, named in the same failed call), and a second try fails the same way;
/// - `clasha` and `clashb` ship the same file: together refused with neither installed; one
///   after the other, the second is refused and the first file stays;
/// - `linked` is a symbolic link to a wheel outside the wheelhouse, which the session cannot
///   see: an InstallError saying so;
/// - no staging directory is left in the session's package directory.
///
/// The Eryx engine (`python`) has `sandcell.install` too: it raises `sandcell.InstallError`
/// saying native engines serve per-session packages.
#[tokio::test]
async fn pydata_install_is_all_or_nothing_and_merges_namespace_packages() {
    if !common::pydata_available() {
        eprintln!("skipped: /usr/bin/python3 cannot import numpy and pandas (the pydata tier)");
        return;
    }
    let wh = temp_dir("sandcell-wheelhouse-");
    write_wheels(
        wh.path(),
        r#"
whl("nsa", "1.0", {"nsx/a/__init__.py": b"A = 1\n"})
whl("nsb", "1.0", {"nsx/b/__init__.py": b"B = 2\n"})
whl("top", "1.0", {"top/__init__.py": b"T = 1\n"}, deps=["missingdep"])
whl("fine", "1.0", {"fine.py": b"F = 3\n"})
whl("clasha", "1.0", {"shared/mod.py": b"WHO = 'a'\n"})
whl("clashb", "1.0", {"shared/mod.py": b"WHO = 'b'\n"})
"#,
    );
    let store = temp_dir("sandcell-wheelstore-");
    write_wheels(store.path(), r#"whl("linked", "1.0", {"linked.py": b""})"#);
    std::os::unix::fs::symlink(
        store.path().join("linked-1.0-py3-none-any.whl"),
        wh.path().join("linked-1.0-py3-none-any.whl"),
    )
    .unwrap();
    world_readable(wh.path());
    world_readable(store.path());
    let (_conf_dir, conf) = pydata_config(wh.path());
    let d = Daemon::start_with_config(&conf, &[]);
    let mut c = d.client().await;
    let s = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .expect("open pydata")
        .session;
    let cell = r#"import os, sandcell
pkgs = os.environ["SANDCELL_PACKAGES_DIR"]
site = os.path.join(pkgs, "python")
def attempt(*a):
    try:
        return sandcell.install(*a)
    except sandcell.InstallError as e:
        return "InstallError: %s" % e
    except Exception as e:
        return "%s: %s" % (type(e).__name__, e)
print("nsa", attempt("nsa"))
print("nsb", attempt("nsb"))
from nsx import a, b
print("ns", a.A, b.B)
print("top", attempt("top"))
print("top again", attempt("top"))
print("fine+top", attempt("fine", "top"))
print("left", os.path.exists(os.path.join(site, "top")), os.path.exists(os.path.join(site, "fine.py")))
print("clash", attempt("clasha", "clashb"))
print("shared", os.path.exists(os.path.join(site, "shared")))
print("clasha", attempt("clasha"))
print("clashb", attempt("clashb"))
import shared.mod
print("who", shared.mod.WHO)
print("linked", attempt("linked"))
print("staging", sorted(e for e in os.listdir(pkgs) if e != "python"))
try:
    import top
    print("top imported")
except ImportError:
    print("top absent")
"#;
    let out = c.execute_collect(&s, cell).await.unwrap();
    let text = &out.stdout;
    let line = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| {
                panic!(
                    "no line for {key}: {text}\n{:?}\n{}",
                    out.result, out.stderr
                )
            })
            .to_owned()
    };
    assert_eq!(line("nsa"), "nsa ['nsa 1.0']", "{text}");
    assert_eq!(line("nsb"), "nsb ['nsb 1.0']", "{text}");
    assert_eq!(line("ns"), "ns 1 2", "{text}");
    for key in ["top", "top again", "fine+top"] {
        assert!(
            line(key).starts_with(&format!(
                "{key} InstallError: missingdep is not in the wheelhouse"
            )),
            "{text}"
        );
    }
    assert_eq!(line("left"), "left False False", "{text}");
    assert!(
        line("clash").starts_with(
            "clash InstallError: clashb-1.0-py3-none-any.whl: shared/mod.py would replace \
             the one clasha-1.0-py3-none-any.whl installs"
        ),
        "{text}"
    );
    assert_eq!(line("shared"), "shared False", "{text}");
    assert_eq!(line("clasha"), "clasha ['clasha 1.0']", "{text}");
    assert!(
        line("clashb").starts_with(
            "clashb InstallError: clashb-1.0-py3-none-any.whl: shared/mod.py is already \
             installed in this session"
        ),
        "{text}"
    );
    assert_eq!(line("who"), "who a", "{text}");
    assert!(
        line("linked").starts_with(
            "linked InstallError: linked-1.0-py3-none-any.whl cannot be read: it is a \
             symbolic link to a file outside the wheelhouse"
        ),
        "{text}"
    );
    assert_eq!(line("staging"), "staging []", "{text}");
    assert!(text.ends_with("top absent\n"), "{text}");

    // Eryx: the same names, a clear refusal.
    let e = c
        .open("python", None, None)
        .await
        .expect("open python")
        .session;
    let out = c
        .execute_collect(
            &e,
            "import sandcell\ntry:\n    sandcell.install('fine')\nexcept sandcell.InstallError as e:\n    print('InstallError:', e)\n",
        )
        .await
        .unwrap();
    assert!(
        out.stdout
            .starts_with("InstallError: sandcell.install is not available in the Eryx engine")
            && out.stdout.contains("native engines such as pydata"),
        "{}\n{:?}\n{}",
        out.stdout,
        out.result,
        out.stderr
    );
}

/// The source of an R package `name` (`version`) in `dir/name` exporting `fun()`, which
/// returns "hello from <name> <version>".
fn r_package_source(dir: &Path, name: &str, version: &str, fun: &str) {
    let p = dir.join(name);
    std::fs::create_dir_all(p.join("R")).unwrap();
    std::fs::write(
        p.join("DESCRIPTION"),
        format!(
            "Package: {name}\nVersion: {version}\nTitle: Test\nDescription: A test package.\n\
             License: MIT\nAuthor: t\nMaintainer: t <t@example.org>\n"
        ),
    )
    .unwrap();
    std::fs::write(p.join("NAMESPACE"), format!("export({fun})\n")).unwrap();
    std::fs::write(
        p.join("R/hello.R"),
        format!("{fun} <- function() \"hello from {name} {version}\"\n"),
    )
    .unwrap();
}

/// `R CMD INSTALL --build` of the package source `src`: its binary tarball lands in `contrib`.
fn r_build_binary(src: &Path, contrib: &Path) {
    let lib = temp_dir("sandcell-rlib-");
    let st = Command::new("R")
        .args(["CMD", "INSTALL", "--build", "-l"])
        .arg(lib.path())
        .arg(src)
        .current_dir(contrib)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "R CMD INSTALL --build: {}",
        String::from_utf8_lossy(&st.stderr)
    );
}

/// A binary package `tinyr` (as `R CMD INSTALL --build` makes it), a source package `srcr`
/// and `symr` (below), indexed by `tools::write_PACKAGES`.
fn build_cran_repository(root: &Path) {
    let work = temp_dir("sandcell-rbuild-");
    let contrib = root.join("src/contrib");
    std::fs::create_dir_all(&contrib).unwrap();
    r_package_source(work.path(), "tinyr", "0.1.0", "tiny_hello");
    r_package_source(work.path(), "srcr", "0.1.0", "src_hello");
    r_build_binary(&work.path().join("tinyr"), &contrib);
    let st = Command::new("tar")
        .args(["czf"])
        .arg(contrib.join("srcr_0.1.0.tar.gz"))
        .arg("-C")
        .arg(work.path())
        .arg("srcr")
        .status()
        .unwrap();
    assert!(st.success());
    // `symr`: a binary package's layout with a link member (`symr/lnk -> ../../..`) and a
    // file beneath the link, which an extraction that follows links writes outside.
    let script = r#"
import io, sys, tarfile
out = sys.argv[1]
with tarfile.open(out, "w:gz") as t:
    def add(name, data):
        i = tarfile.TarInfo(name)
        i.size = len(data)
        t.addfile(i, io.BytesIO(data))
    add("symr/DESCRIPTION", b"Package: symr\nVersion: 0.1.0\nTitle: T\nDescription: T.\nLicense: MIT\n")
    add("symr/Meta/package.rds", b"x")
    link = tarfile.TarInfo("symr/lnk")
    link.type = tarfile.SYMTYPE
    link.linkname = "../../.."
    t.addfile(link)
    add("symr/lnk/ESCAPED.txt", b"out\n")
"#;
    let st = Command::new("/usr/bin/python3")
        .args(["-I", "-c", script])
        .arg(contrib.join("symr_0.1.0.tar.gz"))
        .status()
        .unwrap();
    assert!(st.success(), "building symr");
    let st = Command::new("Rscript")
        .args([
            "-e",
            "tools::write_PACKAGES(commandArgs(TRUE)[1], type = 'source')",
        ])
        .arg(&contrib)
        .status()
        .unwrap();
    assert!(st.success(), "write_PACKAGES");
    world_readable(root);
}

#[tokio::test]
async fn r_installs_binary_packages_from_a_local_repository() {
    if !common::r_available() {
        eprintln!("skipped: R is not installed (scripts/setup.sh installs r-base-core)");
        return;
    }
    let repo = temp_dir("sandcell-cran-");
    build_cran_repository(repo.path());
    let (_conf_dir, conf) = r_config(repo.path());
    let d = Daemon::start_with_config(&conf, &[("SANDCELL_LANGUAGES", "python,r")]);
    let mut c = d.client().await;
    let envs = c.list_environments().await.unwrap();
    let r = envs.iter().find(|e| e.name == "r").expect("r");
    assert_eq!(r.package_sources.len(), 1, "{r:?}");
    let src = &r.package_sources[0];
    assert_eq!(
        (src.kind.as_str(), src.packages, src.names.clone()),
        (
            "cran_repository",
            3,
            vec!["srcr".to_string(), "symr".into(), "tinyr".into()]
        )
    );
    assert!(src.hash_manifest, "write_PACKAGES writes MD5sum fields");

    let o = c.open_in("r", Some("r"), None, None).await.expect("open r");
    let out = c
        .execute_collect(
            &o.session,
            "print(install.packages(\"tinyr\"))\nlibrary(tinyr)\ncat(tiny_hello(), \"\\n\")\n\
             cat(startsWith(find.package(\"tinyr\"), Sys.getenv(\"SANDCELL_PACKAGES_DIR\")), \"\\n\")\n\
             msg <- tryCatch({ install.packages(\"srcr\"); \"installed\" }, error = function(e) conditionMessage(e))\n\
             cat(\"srcr ->\", msg, \"\\n\")\n\
             msg <- tryCatch({ install.packages(\"nothere\"); \"installed\" }, error = function(e) conditionMessage(e))\n\
             cat(\"nothere ->\", msg, \"\\n\")\n\
             msg <- tryCatch({ install.packages(\"symr\"); \"installed\" }, error = function(e) conditionMessage(e))\n\
             cat(\"symr ->\", msg, \"\\n\")\n\
             cat(\"escaped\", length(list.files(Sys.getenv(\"TMPDIR\"), \"ESCAPED\", recursive = TRUE)), \"\\n\")\n",
        )
        .await
        .unwrap();
    let text = &out.stdout;
    assert!(
        text.contains("\"tinyr\"") && text.contains("hello from tinyr 0.1.0 \nTRUE \n"),
        "{text}\n{:?}\n{}",
        out.result,
        out.stderr
    );
    assert!(
        text.contains("srcr -> package srcr: srcr_0.1.0.tar.gz is a source package"),
        "{text}"
    );
    assert!(
        text.contains("nothere -> package nothere is not in the repository"),
        "{text}"
    );
    assert!(
        text.contains("symr -> package symr: symr_0.1.0.tar.gz has a link member (symr/lnk)")
            && text.contains("escaped 0 \n"),
        "{text}"
    );
    let dir = session_dir(&d, &o.session);
    c.close(&o.session).await.unwrap();
    assert!(
        common::eventually(std::time::Duration::from_secs(10), || !dir.exists()),
        "the session directory outlived Close"
    );
}

/// An index may list several versions of a package, in any order (`write_PACKAGES(latestOnly
/// = FALSE)`, or written by hand): `install.packages` takes the highest, not the last row.
#[tokio::test]
async fn r_installs_the_highest_version_the_index_lists() {
    if !common::r_available() {
        eprintln!("skipped: R is not installed (scripts/setup.sh installs r-base-core)");
        return;
    }
    let repo = temp_dir("sandcell-cran-");
    let contrib = repo.path().join("src/contrib");
    std::fs::create_dir_all(&contrib).unwrap();
    for version in ["2.0", "1.0"] {
        let work = temp_dir("sandcell-rbuild-");
        r_package_source(work.path(), "verr", version, "ver_hello");
        r_build_binary(&work.path().join("verr"), &contrib);
    }
    std::fs::write(
        contrib.join("PACKAGES"),
        "Package: verr\nVersion: 2.0\nNeedsCompilation: no\n\n\
         Package: verr\nVersion: 1.0\nNeedsCompilation: no\n",
    )
    .unwrap();
    world_readable(repo.path());
    let (_conf_dir, conf) = r_config(repo.path());
    let d = Daemon::start_with_config(&conf, &[("SANDCELL_LANGUAGES", "python,r")]);
    let mut c = d.client().await;
    let o = c.open_in("r", Some("r"), None, None).await.expect("open r");
    let out = c
        .execute_collect(
            &o.session,
            "install.packages(\"verr\")\nlibrary(verr)\ncat(ver_hello(), \"\\n\")\n",
        )
        .await
        .unwrap();
    assert_eq!(
        out.stdout, "hello from verr 2.0 \n",
        "{:?}\n{}",
        out.result, out.stderr
    );
}

/// What the operator configured is visible to the operator without opening a session:
/// `sandcelld --check` names each environment's package sources (kind, count, hash-checked),
/// the manager's `PackageSources` D-Bus property lists them with their names, and
/// `sandcellctl status` prints them (as a table and in `--json`); never the host path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn package_sources_show_in_check_dbus_and_status() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: not root (the daemon and the bus need root)");
        return;
    }
    for tool in ["dbus-daemon", "busctl"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("skipped: {tool} missing");
            return;
        }
    }
    let wh = temp_dir("sandcell-wheelhouse-");
    build_wheelhouse(wh.path());
    world_readable(wh.path());
    let wh_path = wh.path().display().to_string();
    let (_conf_dir, conf) = pydata_config(wh.path());

    let out = Command::new(env!("CARGO_BIN_EXE_sandcelld"))
        .arg("--config")
        .arg(&conf)
        .arg("--check")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("pydata "))
        .unwrap_or_else(|| panic!("no pydata line in --check:\n{text}"));
    assert!(
        line.contains("packages: wheelhouse (7 packages, hash-checked)"),
        "{line}"
    );
    let python = text
        .lines()
        .find(|l| l.trim_start().starts_with("python "))
        .unwrap_or_else(|| panic!("no python line in --check:\n{text}"));
    assert!(python.ends_with("packages: none"), "{python}");
    assert!(!text.contains(&wh_path), "the host path leaked: {text}");

    // An environment with egress, for status's policies.
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(
        "\n[environments.net]\nlanguage = \"python\"\nengine = \"native\"\n\
         interpreter = \"/usr/bin/python3\"\n\
         egress = { hosts = [\"data.example.org\"], ports = [443] }\n",
    );
    std::fs::write(&conf, text).unwrap();
    let bus = common::bus::Bus::start();
    let d = Daemon::start_with_config(&conf, &[("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)]);
    let property = || {
        common::bus::run(bus.busctl().args([
            "--json=short",
            "get-property",
            "org.sandcell.Sandcell1",
            "/org/sandcell/Sandcell1",
            "org.sandcell.Manager1",
            "PackageSources",
        ]))
    };
    assert!(
        common::eventually(std::time::Duration::from_secs(20), || property().code == 0),
        "the manager object did not appear on the bus: {}",
        property().stderr
    );
    let o = property();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect(&o.stdout);
    assert_eq!(v["type"], "a(sstbas)", "{v}");
    assert_eq!(
        v["data"],
        serde_json::json!([[
            "pydata",
            "wheelhouse",
            7,
            true,
            [
                "badhash", "bigpkg", "compiled", "metabomb", "tinydep", "tinypkg", "unlisted"
            ]
        ]]),
        "{v}"
    );

    let ctl = |args: &[&str]| {
        common::bus::run(
            Command::new(common::bin_dir().join("sandcellctl"))
                .args(args)
                .env("SANDCELL_SOCKET", &d.socket)
                .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address),
        )
    };
    let o = ctl(&["status"]);
    assert_eq!(o.code, 0, "sandcellctl status: {}", o.stderr);
    assert!(
        o.stdout.lines().any(|l| l.trim()
            == "pydata wheelhouse: 7 packages, hash-checked: badhash bigpkg compiled metabomb tinydep tinypkg unlisted"),
        "sandcellctl status:\n{}",
        o.stdout
    );
    // Each environment's egress policy.
    let lines: Vec<&str> = o.stdout.lines().map(str::trim).collect();
    assert!(lines.contains(&"python: none"), "{}", o.stdout);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("net: egress (HTTP_PROXY): data.example.org; ports 443")),
        "{}",
        o.stdout
    );
    let o = ctl(&["--json", "status"]);
    assert_eq!(o.code, 0, "sandcellctl status --json: {}", o.stderr);
    let st: serde_json::Value = serde_json::from_str(&o.stdout).expect(&o.stdout);
    assert_eq!(st["egress"]["net"]["hosts"][0], "data.example.org", "{st}");
    assert!(st["egress"]["python"].is_null(), "{st}");
    assert_eq!(st["package_sources"][0]["environment"], "pydata", "{st}");
    assert_eq!(st["package_sources"][0]["packages"], 7, "{st}");
    assert!(!o.stdout.contains(&wh_path), "the host path leaked");
}
