//! The integration tier: every test that drives a real `sandcelld` with real workers (Eryx,
//! R, native Python), cgroups, Landlock and seccomp, a private `dbus-daemon` with `polkitd`.
//!
//! One test binary with a module per area, so that an edit of the daemon links it once, not
//! once per area. A test's name starts with its area's module: `files::uploads_...`; one area
//! runs alone with a filter, e.g. `cargo test --release -p sandcelld --test integration
//! files::` (a filter matches anywhere in the name, so `files::` also selects
//! `python_files::`; add `--skip python_files::` to leave it out).
//!
//! Adding an area: write `tests/integration/<area>.rs` beginning with `use crate::common;`
//! (the harness: `common::Daemon`, `common::eventually`, ...), then add `mod <area>;` below.
//! scripts/test.sh fails when a file here is not a module of this binary.

mod common;

mod admission_dbus;
mod cell_reports;
mod completion;
mod confinement_levels;
mod daemon_restart;
mod dbus_polkit;
mod egress;
mod environments;
mod faults;
mod faults_daemon;
mod files;
mod host_calls;
mod hostile;
mod hostile_clients;
mod hostile_disk;
mod hostile_memory;
mod hostile_tenants;
mod hostile_workers;
mod inspect;
mod last_expression;
mod metrics;
mod node_ids;
mod packages;
mod pool;
mod pydata;
mod python_cells;
mod python_files;
mod r_cells;
mod rich_output;
mod session_ended;
mod submit_attach;
mod unit_sandbox;
