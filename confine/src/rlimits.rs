//! Step 2: resource limits.
//!
//! Set while still root, soft and hard to the same value, so the worker can never raise them.
//! They are per-process backstops; the session cgroup (memory.max, pids.max) is the real wall,
//! because RLIMIT_NPROC counts every task of the *uid* (a shared worker uid would let one
//! session starve another) and RLIMIT_AS counts virtual, not charged, memory.

use crate::Plan;
use std::io;

/// One limit the plan sets: resource, value, and why.
struct Limit {
    resource: libc::__rlimit_resource_t,
    name: &'static str,
    value: u64,
}

/// The limits `plan` asks for, in the order they are applied.
fn limits(plan: &Plan) -> Vec<Limit> {
    let mut v = vec![
        // No core dumps: a dump of the worker would write the cell's memory (and whatever the
        // engine holds) to a file outside the session, as root-owned cores sometimes are.
        Limit {
            resource: libc::RLIMIT_CORE,
            name: "RLIMIT_CORE",
            value: 0,
        },
        Limit {
            resource: libc::RLIMIT_NOFILE,
            name: "RLIMIT_NOFILE",
            value: plan.max_open_files,
        },
        Limit {
            resource: libc::RLIMIT_FSIZE,
            name: "RLIMIT_FSIZE",
            value: plan.max_file_bytes,
        },
        Limit {
            resource: libc::RLIMIT_NPROC,
            name: "RLIMIT_NPROC",
            value: plan.max_processes,
        },
    ];
    if let Some(bytes) = plan.max_address_space {
        v.push(Limit {
            resource: libc::RLIMIT_AS,
            name: "RLIMIT_AS",
            value: bytes,
        });
    }
    v
}

/// Applies every limit of the plan (soft = hard = value).
///
/// Errors: the OS error of `setrlimit`, prefixed with the limit's name.
pub fn apply(plan: &Plan) -> io::Result<()> {
    for limit in limits(plan) {
        let value = libc::rlimit {
            rlim_cur: limit.value,
            rlim_max: limit.value,
        };
        // SAFETY: value is a valid rlimit struct that outlives the call.
        if unsafe { libc::setrlimit(limit.resource, &value) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("setrlimit {} = {}: {e}", limit.name, limit.value),
            ));
        }
    }
    Ok(())
}
