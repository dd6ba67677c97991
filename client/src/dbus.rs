//! sandcellctl's control-plane side: `org.sandcell.Manager1` on the system bus.
//!
//! The system bus is `$DBUS_SYSTEM_BUS_ADDRESS`, else `/run/dbus/system_bus_socket`. sandcelld
//! identifies the caller from the bus and asks polkit; calls carry the D-Bus
//! `ALLOW_INTERACTIVE_AUTHORIZATION` flag only with `--interactive` (a polkit agent, e.g.
//! `pkttyagent`, must then be running for the caller).
//!
//! Errors: [`Error::Bus`] when the bus or the daemon cannot be reached; [`Error::Refused`] with
//! the daemon's error name (`org.sandcell.Sandcell1.PermissionDenied`, `NoSuchSession`,
//! `InvalidConfig`, ...) and its message.

use serde::Serialize;
use zbus::proxy::MethodFlags;
use zbus::zvariant::OwnedObjectPath;

/// One row of `ListSessions` ([`sandcell_proto::dbus::SessionRow`]).
pub type Row = sandcell_proto::dbus::SessionRow<OwnedObjectPath>;
use sandcell_proto::dbus::{AdmissionRow, PackageSourceRow, PoolRow};

#[zbus::proxy(
    interface = "org.sandcell.Manager1",
    default_service = "org.sandcell.Sandcell1",
    default_path = "/org/sandcell/Sandcell1",
    gen_blocking = false
)]
trait Manager1 {
    fn list_sessions(&self) -> zbus::Result<Vec<Row>>;
    #[zbus(property)]
    fn active_sessions(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn admission(&self) -> zbus::Result<Vec<AdmissionRow>>;
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    #[zbus(property, name = "LandlockABI")]
    fn landlock_abi(&self) -> zbus::Result<i32>;
    #[zbus(property)]
    fn cgroup_mode(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn confinement(&self) -> zbus::Result<std::collections::HashMap<String, String>>;
    #[zbus(property)]
    fn pools(&self) -> zbus::Result<Vec<PoolRow>>;
    #[zbus(property)]
    fn package_sources(&self) -> zbus::Result<Vec<PackageSourceRow>>;
}

/// Errors of the control-plane commands.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bus or sandcelld's name could not be reached. Displayed as one sentence, `cannot
    /// reach the system bus: CAUSE` ([`bus_cause`]).
    #[error("cannot reach the system bus: {}", bus_cause(.0))]
    Bus(zbus::Error),
    /// sandcelld refused the call.
    #[error("{name}: {message}")]
    Refused {
        /// D-Bus error name, e.g. `org.sandcell.Sandcell1.PermissionDenied`.
        name: String,
        /// The daemon's message.
        message: String,
    },
}

impl From<zbus::Error> for Error {
    fn from(e: zbus::Error) -> Self {
        match e {
            zbus::Error::MethodError(name, message, _) => Error::Refused {
                name: name.to_string(),
                message: message.unwrap_or_default(),
            },
            other => Error::Bus(other),
        }
    }
}

/// Why the bus could not be reached, for a person: zbus's text without Rust's ` (os error
/// N)` suffix and without the backquotes around the address
/// (`Failed to connect to address unix:path=/run/dbus/system_bus_socket: No such file or
/// directory`).
pub fn bus_cause(e: &zbus::Error) -> String {
    let text = e.to_string().replace('`', "");
    match text.find(" (os error ") {
        Some(i) if text.ends_with(')') => text[..i].to_owned(),
        _ => text,
    }
}

/// A session as listed.
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    /// Session id.
    pub id: String,
    /// `python` or `r`.
    pub language: String,
    /// Owner uid.
    pub uid: u32,
    /// Owner pid (at connect time).
    pub pid: u32,
    /// `idle`, `running`, ...
    pub state: String,
    /// Opened at, µs since the Unix epoch.
    pub started_usec: u64,
    /// Cells finished.
    pub cells_run: u64,
    /// Memory charged to the worker's cgroup, bytes; `None` when unknown.
    pub memory_bytes: Option<u64>,
    /// D-Bus object path.
    pub path: String,
    /// The session's egress counters (its object's `Egress` property: `allowed`, `refused`,
    /// `bytes`, `connections`); `None` without an egress grant, or from a daemon without the
    /// property.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<std::collections::BTreeMap<String, u64>>,
}

/// Daemon-wide figures.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// sandcelld version.
    pub version: String,
    /// `v2`, `v1`, `none`.
    pub cgroup_mode: String,
    /// Landlock ABI of the kernel (0: none).
    pub landlock_abi: i32,
    /// The confinement decided at start (the `Confinement` property), sorted by key.
    pub confinement: std::collections::BTreeMap<String, String>,
    /// Sessions alive.
    pub active_sessions: u32,
    /// (budget, in use, maximum).
    pub admission: Vec<AdmissionRow>,
    /// Warm worker pools, one per environment.
    pub pools: Vec<PoolInfo>,
    /// Package sources, one per source of each environment (empty from a daemon without the
    /// `PackageSources` property).
    pub package_sources: Vec<SourceInfo>,
}

/// A package source of an environment (a row of the `PackageSources` property).
#[derive(Debug, Clone, Serialize)]
pub struct SourceInfo {
    /// The environment's name.
    pub environment: String,
    /// `wheelhouse` or `cran_repository`.
    pub kind: String,
    /// Packages offered.
    pub packages: u64,
    /// Installs are checked against a hash manifest.
    pub hash_manifest: bool,
    /// Package names in name order (at most 500).
    pub names: Vec<String>,
}

/// One environment's warm worker pool (a row of the `Pools` property).
#[derive(Debug, Clone, Serialize)]
pub struct PoolInfo {
    /// The environment's name (`python`, `pydata`, `r`, or one the operator declared); the
    /// field keeps its earlier name, from when pools were per language.
    pub language: String,
    /// Idle warm workers now.
    pub idle: u32,
    /// How many idle workers the pool aims for now (the minimum, or the maximum while
    /// workers are being taken).
    pub target: u32,
    /// Configured minimum (0: no pool, or the environment is not served).
    pub min: u32,
    /// Configured maximum.
    pub max: u32,
    /// Workers taken from the pool since the daemon started.
    pub taken: u64,
    /// Opens that found no idle worker since the daemon started.
    pub missed: u64,
}

/// A connection to sandcelld's control plane.
#[derive(Debug)]
pub struct Admin {
    proxy: Manager1Proxy<'static>,
    interactive: bool,
}

impl Admin {
    /// Connects to the system bus; `interactive` lets polkit ask for a password.
    pub async fn connect(interactive: bool) -> Result<Admin, Error> {
        let conn = zbus::Connection::system().await.map_err(Error::Bus)?;
        let proxy = Manager1Proxy::new(&conn).await.map_err(Error::Bus)?;
        Ok(Admin { proxy, interactive })
    }

    async fn call<B, R>(&self, method: &str, body: &B) -> Result<R, Error>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        if !self.interactive {
            return Ok(self.proxy.inner().call(method, body).await?);
        }
        let r: Option<R> = self
            .proxy
            .inner()
            .call_with_flags(method, MethodFlags::AllowInteractiveAuth.into(), body)
            .await?;
        r.ok_or_else(|| Error::Bus(zbus::Error::Failure("no reply".into())))
    }

    /// Live sessions, oldest first, each with its egress counters (one property read per
    /// session).
    pub async fn list(&self) -> Result<Vec<SessionInfo>, Error> {
        let mut rows: Vec<SessionInfo> = self
            .proxy
            .list_sessions()
            .await?
            .into_iter()
            .map(|r| SessionInfo {
                id: r.0,
                language: r.1,
                uid: r.2,
                pid: r.3,
                state: r.4,
                started_usec: r.5,
                cells_run: r.6,
                memory_bytes: (r.7 != u64::MAX).then_some(r.7),
                path: r.8.to_string(),
                egress: None,
            })
            .collect();
        for row in &mut rows {
            row.egress = self.egress(&row.path).await;
        }
        Ok(rows)
    }

    /// The `Egress` property of the session object at `path`; `None` when it is empty or
    /// cannot be read (the session ended meanwhile, an older daemon).
    async fn egress(&self, path: &str) -> Option<std::collections::BTreeMap<String, u64>> {
        let proxy = zbus::Proxy::new(
            self.proxy.inner().connection(),
            "org.sandcell.Sandcell1",
            path.to_owned(),
            "org.sandcell.Session1",
        )
        .await
        .ok()?;
        let m: std::collections::HashMap<String, u64> = proxy.get_property("Egress").await.ok()?;
        (!m.is_empty()).then(|| m.into_iter().collect())
    }

    /// Daemon-wide figures.
    pub async fn status(&self) -> Result<Status, Error> {
        Ok(Status {
            version: self.proxy.version().await?,
            cgroup_mode: self.proxy.cgroup_mode().await?,
            landlock_abi: self.proxy.landlock_abi().await?,
            confinement: self.proxy.confinement().await?.into_iter().collect(),
            active_sessions: self.proxy.active_sessions().await?,
            admission: self.proxy.admission().await?,
            pools: self
                .proxy
                .pools()
                .await?
                .into_iter()
                .map(|r| PoolInfo {
                    language: r.0,
                    idle: r.1,
                    target: r.2,
                    min: r.3,
                    max: r.4,
                    taken: r.5,
                    missed: r.6,
                })
                .collect(),
            // A daemon from before the property: no sources shown, not an error.
            package_sources: self
                .proxy
                .package_sources()
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|r| SourceInfo {
                    environment: r.0,
                    kind: r.1,
                    packages: r.2,
                    hash_manifest: r.3,
                    names: r.4,
                })
                .collect(),
        })
    }

    /// Ends session `id`; returns after the daemon released it.
    pub async fn terminate(&self, id: &str) -> Result<(), Error> {
        self.call::<_, ()>("TerminateSession", &(id,)).await
    }

    /// Interrupts the running cell of `id`: (delivered, reason).
    pub async fn interrupt(&self, id: &str) -> Result<(bool, String), Error> {
        self.call("InterruptSession", &(id,)).await
    }

    /// Asks the daemon to re-read its configuration.
    pub async fn reload(&self) -> Result<(), Error> {
        self.call::<_, ()>("Reload", &()).await
    }
}

/// `2026-11-30T07:44:35Z` from µs since the epoch (UTC; proleptic Gregorian calendar).
pub fn utc(usec: u64) -> String {
    let secs = usec / 1_000_000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Bytes as `12.3 MiB`; `-` when unknown.
pub fn human_bytes(b: Option<u64>) -> String {
    let Some(b) = b else { return "-".into() };
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_bus_reads_as_a_sentence() {
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let e = Error::Bus(zbus::Error::InputOutput(std::sync::Arc::new(io)));
        let text = e.to_string();
        assert!(text.starts_with("cannot reach the system bus: "), "{text}");
        assert!(text.ends_with("No such file or directory"), "{text}");
    }

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_024_675_123_456), "2026-11-30T07:44:35Z");
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(None), "-");
        assert_eq!(human_bytes(Some(512)), "512 B");
        assert_eq!(human_bytes(Some(3 * 1024 * 1024 / 2)), "1.5 MiB");
    }
}
