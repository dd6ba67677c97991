//! What a SIGTERM means: is systemd restarting the unit (keep the sessions) or stopping it
//! (end every worker)?
//!
//! systemd sends SIGTERM both for `systemctl stop` and for the stop half of `systemctl
//! restart`; the signal carries no reason. While it is delivered, the unit has a job
//! installed, and the job says which (org.freedesktop.systemd1(5)): the unit's `Job`
//! property (`(uo)`: job id and object path, `(0, "/")` for none) and that job's `JobType`
//! property. Measured on systemd 252 (Debian 12) and 257 (Debian 13) from inside
//! sandcelld.service's sandbox (PrivateNetwork=, RestrictAddressFamilies=AF_UNIX: the system
//! bus is a Unix socket):
//!
//! | operator or package action                         | `JobType` at SIGTERM |
//! |----------------------------------------------------|----------------------|
//! | `systemctl restart`                                 | `restart`            |
//! | `systemctl try-restart` (debhelper's upgrade path)  | `restart` (systemd collapses try-restart on an active unit) |
//! | `systemctl stop`, package removal, shutdown         | `stop`               |
//! | `kill -TERM <main pid>` by hand                     | no job               |
//!
//! Anything but `restart` ends every worker, as does any failure to ask (no system bus,
//! systemd not answering within [`ASK_TIMEOUT`], a daemon not run by systemd): ending sessions
//! loses work but never leaves a confined process running that nobody will come back for.

use std::time::Duration;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

/// How long the daemon waits for systemd's answer on SIGTERM: 2 seconds. systemd answers
/// property reads in milliseconds; a bus that does not answer in 2 s is treated as "cannot
/// ask" (sessions end), and the stop goes on well inside the unit's `TimeoutStopSec=`.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the daemon does with its sessions when it exits on SIGTERM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnTerm {
    /// systemd is restarting the unit: exit keeping every session for the next daemon.
    KeepSessions,
    /// systemd is stopping the unit (or the reason, a text for the log, says why the daemon
    /// could not tell): end every worker, as before.
    EndSessions(String),
}

/// Maps the job type systemd reports for the unit at SIGTERM (`None`: no job installed) to
/// what the daemon does. Only `restart` keeps sessions.
pub fn decide(job_type: Option<&str>) -> OnTerm {
    match job_type {
        Some("restart") | Some("try-restart") => OnTerm::KeepSessions,
        Some(other) => OnTerm::EndSessions(format!("systemd job {other:?}")),
        None => OnTerm::EndSessions("no systemd job: signalled outside systemctl".into()),
    }
}

/// The system bus connection and the unit's object path [`prepare`] made ready for
/// [`on_term`].
static PREPARED: std::sync::OnceLock<(zbus::Connection, OwnedObjectPath)> =
    std::sync::OnceLock::new();

/// How long [`prepare`] tries: 10 seconds (it runs in the background, once).
pub const PREPARE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to the system bus and resolves the object path of the daemon's own unit
/// (`Manager.GetUnitByPID`) once, ahead of any SIGTERM, so that [`on_term`] costs two
/// property reads on an open connection instead of a connection (authentication, `Hello`)
/// and three calls: under a slow machine's load that was most of a second of the restart's
/// gap. Does nothing outside systemd (no `INVOCATION_ID`); a failure is logged and leaves
/// [`on_term`] to do it all itself, as before. At most [`PREPARE_TIMEOUT`].
pub async fn prepare() {
    if std::env::var_os("INVOCATION_ID").is_none() || PREPARED.get().is_some() {
        return;
    }
    match tokio::time::timeout(PREPARE_TIMEOUT, own_unit()).await {
        Ok(Ok(p)) => {
            let _ = PREPARED.set(p);
        }
        Ok(Err(e)) => {
            tracing::info!(error = %e, "cannot ask systemd ahead of a SIGTERM; asking then")
        }
        Err(_) => tracing::info!(
            "systemd did not answer within {} s; asking at SIGTERM instead",
            PREPARE_TIMEOUT.as_secs()
        ),
    }
}

/// Asks systemd over the system bus what the job on the daemon's own unit is, within
/// [`ASK_TIMEOUT`], and [`decide`]s: on the connection [`prepare`] opened when there is one
/// (two property reads), else (or when that connection fails) on a new one. Never fails: an
/// error answers [`OnTerm::EndSessions`] with the error as its reason.
pub async fn on_term() -> OnTerm {
    let ask = async {
        if let Some((conn, unit)) = PREPARED.get() {
            match job_type_of(conn, unit).await {
                Ok(j) => return Ok(j),
                Err(e) => {
                    tracing::info!(error = %e, "the prepared system bus connection failed: asking on a new one")
                }
            }
        }
        own_job_type().await
    };
    match tokio::time::timeout(ASK_TIMEOUT, ask).await {
        Ok(Ok(job_type)) => decide(job_type.as_deref()),
        Ok(Err(e)) => OnTerm::EndSessions(format!("cannot ask systemd: {e}")),
        Err(_) => OnTerm::EndSessions(format!(
            "systemd did not answer within {} s",
            ASK_TIMEOUT.as_secs()
        )),
    }
}

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";

/// The `JobType` of the job installed on the unit this process belongs to, `None` when no
/// job is installed.
async fn own_job_type() -> Result<Option<String>, String> {
    let (conn, unit) = own_unit().await?;
    job_type_of(&conn, &unit).await
}

/// A new system bus connection and the object path of the unit this process belongs to.
async fn own_unit() -> Result<(zbus::Connection, OwnedObjectPath), String> {
    if std::env::var_os("INVOCATION_ID").is_none() {
        return Err("not started by systemd (no INVOCATION_ID)".into());
    }
    let address = crate::dbus::system_bus_address().ok_or("no system bus")?;
    let conn = zbus::connection::Builder::address(address.as_str())
        .map_err(|e| e.to_string())?
        .build()
        .await
        .map_err(|e| e.to_string())?;
    let unit: OwnedObjectPath = conn
        .call_method(
            Some(SYSTEMD),
            MANAGER_PATH,
            Some("org.freedesktop.systemd1.Manager"),
            "GetUnitByPID",
            &(std::process::id(),),
        )
        .await
        .map_err(|e| format!("GetUnitByPID: {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("GetUnitByPID: {e}"))?;
    Ok((conn, unit))
}

/// The `JobType` of the job installed on `unit`, `None` when no job is installed.
async fn job_type_of(
    conn: &zbus::Connection,
    unit: &OwnedObjectPath,
) -> Result<Option<String>, String> {
    let job = property(conn, unit, "org.freedesktop.systemd1.Unit", "Job").await?;
    let (_id, job): (u32, OwnedObjectPath) =
        job.try_into().map_err(|e| format!("Job property: {e}"))?;
    if job.as_str() == "/" {
        return Ok(None);
    }
    let job_type = property(conn, &job, "org.freedesktop.systemd1.Job", "JobType").await?;
    let job_type: String = job_type
        .try_into()
        .map_err(|e| format!("JobType property: {e}"))?;
    Ok(Some(job_type))
}

async fn property(
    conn: &zbus::Connection,
    path: &OwnedObjectPath,
    interface: &str,
    name: &str,
) -> Result<OwnedValue, String> {
    conn.call_method(
        Some(SYSTEMD),
        path.as_str(),
        Some("org.freedesktop.DBus.Properties"),
        "Get",
        &(interface, name),
    )
    .await
    .map_err(|e| format!("{interface}.{name}: {e}"))?
    .body()
    .deserialize::<OwnedValue>()
    .map_err(|e| format!("{interface}.{name}: {e}"))
}

/// `sandcelld --hold-sessions`: the main process of `sandcell-sessions.service`, the
/// companion unit (Delegate=yes) whose group holds the session groups outside
/// sandcelld.service's own, so that systemd's kill of the daemon's group (restart,
/// `systemctl kill`, crash, OOM kill: `KillMode=control-group`) does not reach the workers.
///
/// Moves itself from the unit's group (`/proc/self/cgroup`, under `cgroup_mount`, normally
/// `/sys/fs/cgroup`) into `holder/`, enables memory, pids and (when offered) cpu for the
/// children of the group and of `sessions/`, reports READY=1 to systemd, then sleeps until
/// SIGTERM or SIGINT and returns. Stopping the unit (`systemctl stop sandcell-sessions`, package
/// removal) then kills every process in its group: every worker (KillMode=control-group).
///
/// Errors: not in a cgroup2 group other than the root, or a cgroup file that cannot be
/// written (the unit lacks `Delegate=yes`).
pub fn hold_sessions(cgroup_mount: &std::path::Path) -> std::io::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    use std::io::{Error, ErrorKind};
    // Block the stop signals before anything else, so that one sent while setting up is
    // taken by the wait below rather than killing the holder half-way.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    stop.thread_block().map_err(Error::from)?;
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| Error::new(ErrorKind::Unsupported, "not in a cgroup2 group"))?;
    let rel = rel
        .strip_suffix(&format!("/{}", crate::cgroup::v2::HOLDER))
        .unwrap_or(rel);
    if rel == "/" {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "in the root cgroup: run from sandcell-sessions.service (Delegate=yes)",
        ));
    }
    let dir = cgroup_mount.join(rel.trim_start_matches('/'));
    let holder = dir.join(crate::cgroup::v2::HOLDER);
    match std::fs::create_dir(&holder) {
        Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    std::fs::write(holder.join("cgroup.procs"), std::process::id().to_string())?;
    let offered = std::fs::read_to_string(dir.join("cgroup.controllers"))?;
    let enable: Vec<String> = ["memory", "pids", "cpu"]
        .iter()
        .filter(|c| offered.split_whitespace().any(|o| o == **c))
        .map(|c| format!("+{c}"))
        .collect();
    let enable = enable.join(" ");
    // On a hybrid host (memory and pids are cgroup v1 hierarchies) nothing is offered here:
    // the daemon keeps its v1 layout and this unit only idles.
    if !enable.is_empty() {
        std::fs::write(dir.join("cgroup.subtree_control"), &enable)?;
    }
    let sessions = dir.join("sessions");
    match std::fs::create_dir(&sessions) {
        Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    if !enable.is_empty() {
        std::fs::write(sessions.join("cgroup.subtree_control"), &enable)?;
    }
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("holding the session groups"),
    ]);
    loop {
        match stop.wait() {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_restart_keeps_sessions() {
        assert_eq!(decide(Some("restart")), OnTerm::KeepSessions);
        assert_eq!(decide(Some("try-restart")), OnTerm::KeepSessions);
        for other in ["stop", "start", "reload", "verify-active", "nop"] {
            assert!(
                matches!(decide(Some(other)), OnTerm::EndSessions(_)),
                "{other}"
            );
        }
        assert!(matches!(decide(None), OnTerm::EndSessions(_)));
    }

    #[tokio::test]
    async fn outside_systemd_sessions_end() {
        // The test runner is not a systemd unit's main process with a job: whatever the bus
        // says, the answer must be "end" and must come within the bound.
        let t = std::time::Instant::now();
        let got = on_term().await;
        assert!(matches!(got, OnTerm::EndSessions(_)), "{got:?}");
        assert!(t.elapsed() <= ASK_TIMEOUT + Duration::from_millis(500));
    }
}
