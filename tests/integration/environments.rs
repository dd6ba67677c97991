//! Named environments through a real sandcelld: `ListEnvironments` (names, languages, engines,
//! defaults, readiness, interpreter versions, packages), the `environment` parameter of `Open`
//! and `Run` (absent: the language's default; unknown: `NoSuchEnvironment` listing the known
//! ones; another language's: `EnvironmentMismatch`), an operator-declared environment, and a
//! warm pool per environment.

use crate::common;

use common::Daemon;
use sandcell_client::{Error, Status};
use sandcell_proto::kernel::KernelError;
use std::path::Path;

fn r_installed() -> bool {
    let ok = Path::new("/usr/lib/R/bin/exec/R").exists();
    if !ok {
        eprintln!("skipped: R is not installed (scripts/setup.sh installs r-base-core)");
    }
    ok
}

fn numpy_installed() -> bool {
    let ok = std::process::Command::new("/usr/bin/python3")
        .args(["-I", "-c", "import numpy, pandas"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: /usr/bin/python3 cannot import numpy and pandas");
    }
    ok
}

#[tokio::test]
async fn environments_are_listed_with_versions_and_packages() {
    if !r_installed() || !numpy_installed() {
        return;
    }
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", "python,r")]);
    let mut c = d.client().await;
    let envs = c.list_environments().await.unwrap();
    let names: Vec<&str> = envs.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["pydata", "python", "r"], "{envs:?}");
    let get = |n: &str| envs.iter().find(|e| e.name == n).unwrap();
    let (py, pd, r) = (get("python"), get("pydata"), get("r"));
    assert_eq!(
        (py.language.as_str(), py.engine.as_str(), py.default),
        ("python", "eryx", true)
    );
    assert_eq!(
        (pd.language.as_str(), pd.engine.as_str(), pd.default),
        ("python", "native", false)
    );
    assert_eq!(
        (r.language.as_str(), r.engine.as_str(), r.default),
        ("r", "native", true)
    );
    for e in [py, pd, r] {
        assert!(e.ready, "{} not ready: {:?}", e.name, e.reason);
        assert!(e.reason.is_none());
    }
    assert!(py.interpreter_version.starts_with("CPython 3."), "{py:?}");
    assert!(
        py.packages.is_empty(),
        "Eryx serves the standard library only"
    );
    assert!(pd.interpreter_version.starts_with("CPython 3."), "{pd:?}");
    assert!(r.interpreter_version.starts_with("R 4."), "{r:?}");
    let version = |e: &sandcell_proto::kernel::Environment, p: &str| {
        e.packages
            .iter()
            .find(|x| x.name.eq_ignore_ascii_case(p))
            .map(|x| x.version.clone())
    };
    for p in ["numpy", "pandas"] {
        let v = version(pd, p).unwrap_or_else(|| panic!("{p} not listed: {:?}", pd.packages));
        assert!(
            v.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "{p} {v}"
        );
    }
    // The version listed is the one the environment imports.
    let out = c
        .run_collect_in(
            "python",
            Some("pydata"),
            "import numpy\nprint(numpy.__version__)",
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.stdout.trim(), version(pd, "numpy").unwrap());
    assert!(version(r, "stats").is_some(), "{:?}", r.packages);
    let mut sorted = pd.packages.clone();
    sorted.sort_by_key(|p| p.name.to_ascii_lowercase());
    assert_eq!(sorted, pd.packages, "name order");
    // Listing again answers from what was checked at start.
    assert_eq!(c.list_environments().await.unwrap(), envs);
}

#[tokio::test]
async fn environment_selection_defaults_unknown_and_mismatch() {
    if !r_installed() {
        return;
    }
    let d = Daemon::start(&[("SANDCELL_LANGUAGES", "python,r")]);
    let mut c = d.client().await;
    // Absent: the language's default (Eryx for Python, R for R).
    let o = c.open("python", None, None).await.unwrap();
    assert!(o.engine.to_lowercase().contains("eryx"), "{}", o.engine);
    c.close(&o.session).await.unwrap();
    let o = c
        .open_in("python", Some("python"), None, None)
        .await
        .unwrap();
    assert!(o.engine.to_lowercase().contains("eryx"), "{}", o.engine);
    c.close(&o.session).await.unwrap();
    let o = c.open_in("r", None, None, None).await.unwrap();
    assert!(o.engine.starts_with("R "), "{}", o.engine);
    c.close(&o.session).await.unwrap();
    let o = c
        .open_in("python", Some("pydata"), None, None)
        .await
        .unwrap();
    assert!(o.engine.starts_with("CPython"), "{}", o.engine);
    c.close(&o.session).await.unwrap();
    let out = c
        .run_collect_in("r", Some("r"), "cat(1 + 1, '\\n')", None)
        .await
        .unwrap();
    assert_eq!(
        (out.result.status, out.stdout.as_str()),
        (Status::Ok, "2 \n")
    );

    // Unknown: a typed error listing the names served.
    match c.open_in("python", Some("nope"), None, None).await {
        Err(Error::Kernel(KernelError::NoSuchEnvironment { environment, known })) => {
            assert_eq!(environment, "nope");
            assert_eq!(known, ["pydata", "python", "r"]);
        }
        other => panic!("expected NoSuchEnvironment, got {other:?}"),
    }
    match c
        .run_collect_in("python", Some("nope"), "print(1)", None)
        .await
    {
        Err(Error::Kernel(KernelError::NoSuchEnvironment { .. })) => {}
        other => panic!("expected NoSuchEnvironment from Run, got {other:?}"),
    }
    // Another language's environment.
    match c.open_in("r", Some("pydata"), None, None).await {
        Err(Error::Kernel(KernelError::EnvironmentMismatch {
            environment,
            language,
            environment_language,
        })) => {
            assert_eq!(
                (
                    environment.as_str(),
                    language.as_str(),
                    environment_language.as_str()
                ),
                ("pydata", "r", "python")
            );
        }
        other => panic!("expected EnvironmentMismatch, got {other:?}"),
    }
    match c
        .run_collect_in("python", Some("r"), "print(1)", None)
        .await
    {
        Err(Error::Kernel(KernelError::EnvironmentMismatch { .. })) => {}
        other => panic!("expected EnvironmentMismatch from Run, got {other:?}"),
    }
    // A language that is not served stays UnsupportedLanguage.
    match c.open_in("cobol", None, None, None).await {
        Err(Error::Kernel(KernelError::UnsupportedLanguage { .. })) => {}
        other => panic!("expected UnsupportedLanguage, got {other:?}"),
    }
    assert!(d.child_alive());
}

#[tokio::test]
async fn operator_environments_and_a_pool_per_environment() {
    if !numpy_installed() {
        return;
    }
    // An operator's environment (native Python with an extra library directory and a
    // preloaded module) made the Python default, with a warm pool of its own.
    let lib = tempfile::Builder::new()
        .prefix("sandcell-envlib-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(
        lib.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(lib.path().join("sitehelper.py"), "ANSWER = 42\n").unwrap();
    std::fs::set_permissions(
        lib.path().join("sitehelper.py"),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    let conf = format!(
        "[environments.science]\nlanguage = \"python\"\nengine = \"native\"\ndefault = true\nlibrary_paths = [\"{}\"]\npreload = [\"numpy\"]\npool_min = 1\npool_max = 1\n",
        lib.path().display()
    );
    let dir = tempfile::Builder::new()
        .prefix("sandcell-envconf-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let conf_path = dir.path().join("sandcelld.toml");
    std::fs::write(&conf_path, conf).unwrap();
    let d = Daemon::start_with_config(&conf_path, &[("SANDCELL_POOLS", "true")]);
    let mut c = d.client().await;
    let envs = c.list_environments().await.unwrap();
    let sci = envs.iter().find(|e| e.name == "science").expect("science");
    assert!(sci.default && sci.ready, "{sci:?}");
    let py = envs.iter().find(|e| e.name == "python").unwrap();
    assert!(
        !py.default,
        "the operator's default replaces the shipped one"
    );
    // The pool fills, and an Open without an environment takes its warm worker.
    assert!(
        common::eventually(std::time::Duration::from_secs(30), || d
            .log_text()
            .contains("warm worker ready environment=science")),
        "{}",
        d.log_text()
    );
    let o = c.open("python", None, None).await.unwrap();
    assert!(o.engine.starts_with("CPython"), "{}", o.engine);
    let out = c
        .execute_collect(
            &o.session,
            "import sys, sitehelper\nprint(sitehelper.ANSWER, 'numpy' in sys.modules)",
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "42 True\n", "{:?}", out.result);
    assert!(
        d.log_text().contains("warm=true"),
        "the open did not take the warm worker:\n{}",
        d.log_text()
    );
}
