//! What the tests of the between-cells questions (`Inspect`, `Complete`, `Help`) share: a
//! daemon serving every engine this machine has, a session of one, and a cell that must end
//! `ok`.

use super::{Daemon, r_available};
use sandcell_client::{Client, Collected, Status};

/// A daemon with a 60 s cell wall time, serving R too where R is installed.
pub fn daemon() -> Daemon {
    let mut env = vec![("SANDCELL_EXECUTION_WALL_TIME_SECONDS", "60")];
    if r_available() {
        env.push(("SANDCELL_LANGUAGES", "python,r"));
    }
    Daemon::start(&env)
}

/// Opens a session of `language` in `environment` (none: the language's default); its id.
pub async fn open(c: &mut Client, language: &str, environment: Option<&str>) -> String {
    c.open_in(language, environment, None, None)
        .await
        .expect("open")
        .session
}

/// Runs `code` in session `s`; panics unless it ends `ok`.
pub async fn ok(c: &mut Client, s: &str, code: &str) -> Collected {
    let out = c.execute_collect(s, code).await.expect("execute");
    assert_eq!(
        out.result.status,
        Status::Ok,
        "{code}: {:.400}",
        format!("{:?} {}", out.result, out.stderr)
    );
    out
}
