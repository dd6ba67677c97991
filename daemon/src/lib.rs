//! sandcelld: runs untrusted Python and R cells for local gateways, one confined worker per
//! session. See ARCHITECTURE.md at the repository root for the bird's-eye view.
//!
//! Code map:
//! - [`core`]: sessions, admission, identities, authorization order; no protocol knowledge.
//! - [`session`]: one session's actor: runs cells, bounds output, interrupts, releases.
//! - [`worker`]: starting a worker (charge, uid, cgroup, Ready: `worker/start.rs`; the one
//!   confinement seam: `worker/spawn.rs`), reading it, signalling it.
//! - [`cgroup`]: session cgroups (v2, v1 hybrid).
//! - [`pool`]: warm pools of pre-started, confined, Ready workers, filled from a `Source`.
//! - [`admission`], [`identity`], [`auth`], [`config`]: budgets, callers and uids, decisions,
//!   settings.
//! - [`varlink`]: the `org.sandcell.Kernel` shim.
//! - [`dbus`]: the `org.sandcell.Sandcell1` control plane shim; [`polkit`]: the polkit authority.
//! - [`files`]: files in and out of session directories (never following a symlink).
//! - [`cells`]: cells that outlive their client; [`environments`]: environments' reports.
//! - [`notify`]: systemd readiness, status, watchdog; [`metrics`]: the capacity file
//!   (Prometheus text format) for node exporters; [`counters`]: the counters it reports.
//! - [`lifecycle`]: what a SIGTERM means; [`reexec`]: the re-exec in place (SIGUSR1).
//! - [`memory`]: the daemon's own memory bound, derived from its caps.
//! - [`stages`]: per-stage timings of a request (debug lines, target `sandcelld::timing`).
//! - [`sys`]: the safe wrappers of the system calls made by hand (pidfds, random bytes).
//!
//! Dependencies point down: the shims and the metrics file use the core, the core uses the
//! rest, and no module imports one that imports it.

pub mod admission;
pub mod adopt;
pub mod auth;
pub mod cells;
pub mod cgroup;
pub mod config;
pub mod core;
pub mod counters;
pub mod dbus;
pub mod egress;
pub mod ended;
pub mod environments;
pub mod files;
pub mod identity;
pub mod keeper;
pub mod lifecycle;
pub mod loglimit;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod notify;
pub mod packages;
pub mod polkit;
pub mod pool;
pub mod records;
pub mod reexec;
pub mod resolve;
pub mod session;
pub mod session_fs;
pub mod stages;
pub mod sys;
pub mod varlink;
pub mod worker;
