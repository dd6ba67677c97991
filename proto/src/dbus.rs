//! The row types of sandcelld's D-Bus interface `org.sandcell.Manager1`, shared by the daemon
//! and `sandcellctl` (the XML in `dbus/org.sandcell.Manager1.xml` gives their signatures; a
//! daemon test pins them to it).
//!
//! The object path of a session row is a type parameter, so this crate needs no D-Bus library:
//! both sides use `zbus::zvariant::OwnedObjectPath`.

/// One row of `ListSessions` (`(ssuusttto)`): id, language, owner uid, owner pid, state
/// (`starting`, `idle`, `running`, `ended`), started (microseconds since the Unix epoch),
/// cells run, memory in use (bytes; `u64::MAX` when unknown), object path.
pub type SessionRow<Path> = (String, String, u32, u32, String, u64, u64, u64, Path);

/// One row of the `Pools` property (`(suuuutt)`): environment name, idle workers now, target now,
/// configured minimum, configured maximum (all counts of workers), workers taken from the
/// pool since the daemon started, opens that found no idle worker since the daemon started.
pub type PoolRow = (String, u32, u32, u32, u32, u64, u64);

/// One row of the `PackageSources` property (`(sstbas)`): environment name, kind
/// (`wheelhouse` or `cran_repository`), number of packages offered, installs checked against
/// a hash manifest, the package names in name order (at most 500; empty when the source
/// cannot be read now).
pub type PackageSourceRow = (String, String, u64, bool, Vec<String>);

/// One row of the `Admission` property (`(stt)`): budget name, amount in use, the budget.
pub type AdmissionRow = (String, u64, u64);
