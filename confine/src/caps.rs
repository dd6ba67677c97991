//! Steps 4, 6 and 7: capabilities and no_new_privs.
//!
//! Capabilities are cleared in two parts because of what each part needs:
//! - before the identity switch ([`drop_bounding_and_lock`]), while CAP_SETPCAP is still
//!   effective: empty the bounding set (no execve can ever gain a capability again, not even
//!   from file capabilities), clear the ambient set, and lock securebits so that uid 0 has no
//!   special meaning on execve and the setuid fix-up cannot be turned off;
//! - after it ([`clear_and_verify`]): the kernel has already cleared permitted and effective on
//!   the switch away from uid 0; clear inheritable too, and read all five sets back.
//!
//! Raw `prctl`/`capset` rather than the `caps` crate: the bounding loop runs up to the running
//! kernel's last capability (probed with `PR_CAPBSET_READ`), so a capability newer than any
//! crate's table is dropped as well.

use crate::Error;
use std::io;

/// `SECBIT_*` from `<linux/securebits.h>`.
const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;

/// The securebits every worker runs with: uid 0 gains nothing on execve (NOROOT), the setuid
/// fix-up that clears capabilities on a uid change stays on (NO_SETUID_FIXUP off, locked),
/// KEEP_CAPS stays off (locked), and the ambient set can never be raised.
const WORKER_SECUREBITS: libc::c_ulong = SECBIT_NOROOT
    | SECBIT_NOROOT_LOCKED
    | SECBIT_NO_SETUID_FIXUP_LOCKED
    | SECBIT_KEEP_CAPS_LOCKED
    | SECBIT_NO_CAP_AMBIENT_RAISE
    | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit sets as two 32-bit words.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The highest capability number the running kernel knows (40 on Linux 6.18).
pub fn last_cap() -> u32 {
    let mut cap = 0;
    // SAFETY: PR_CAPBSET_READ takes a capability number and only reads; EINVAL past the last.
    while unsafe { libc::prctl(libc::PR_CAPBSET_READ, (cap + 1) as libc::c_ulong, 0, 0, 0) } >= 0 {
        cap += 1;
    }
    cap
}

/// Step 4: empties the bounding and ambient sets and locks [`WORKER_SECUREBITS`].
///
/// Errors: [`Error::Unavailable`] when the caller lacks CAP_SETPCAP (`EPERM`): an unprivileged
/// development run, where there are no capabilities to lose anyway.
pub fn drop_bounding_and_lock() -> Result<(), Error> {
    let unavailable = |what: &str| Error::Unavailable {
        layer: "bounding-caps",
        reason: format!(
            "{what}: {} (needs CAP_SETPCAP: start the worker as root)",
            io::Error::last_os_error()
        ),
    };
    for cap in 0..=last_cap() {
        // SAFETY: PR_CAPBSET_DROP takes a capability number; no memory is passed.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(unavailable("prctl(PR_CAPBSET_DROP)"));
        }
    }
    // SAFETY: integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(unavailable("prctl(PR_CAP_AMBIENT_CLEAR_ALL)"));
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, WORKER_SECUREBITS, 0, 0, 0) } != 0 {
        return Err(unavailable("prctl(PR_SET_SECUREBITS)"));
    }
    Ok(())
}

/// Step 6: clears permitted, effective and inheritable, then verifies that all five sets are
/// empty. With `allow_bounding`, a non-empty bounding set is tolerated (development runs where
/// step 4 was skipped: an unprivileged process has nothing in its other sets).
///
/// Errors: the OS error of `capset`/`capget`, or which set is not empty.
pub fn clear_and_verify(allow_bounding: bool) -> io::Result<()> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: header and data are valid v3 structures (one header, two data words) that live
    // across the call; capset only reads them.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (effective, permitted, inheritable) = read_sets()?;
    if effective != 0 || permitted != 0 || inheritable != 0 {
        return Err(io::Error::other(format!(
            "capabilities remain: effective {effective:#x} permitted {permitted:#x} \
             inheritable {inheritable:#x}"
        )));
    }
    for cap in 0..=last_cap() {
        // SAFETY: integer arguments only; returns 1 if the capability is in the ambient set.
        let ambient = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_IS_SET as libc::c_ulong,
                cap as libc::c_ulong,
                0,
                0,
            )
        };
        if ambient == 1 {
            return Err(io::Error::other(format!(
                "capability {cap} is in the ambient set"
            )));
        }
        // SAFETY: integer arguments only; returns 1 if the capability is in the bounding set.
        let bounding = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
        if bounding == 1 && !allow_bounding {
            return Err(io::Error::other(format!(
                "capability {cap} is in the bounding set"
            )));
        }
    }
    Ok(())
}

/// The calling thread's (effective, permitted, inheritable) sets as 64-bit masks.
///
/// Errors: the OS error of `capget`.
pub fn read_sets() -> io::Result<(u64, u64, u64)> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header is a valid v3 header; data has room for the two words v3 writes.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| (u64::from(hi) << 32) | u64::from(lo);
    Ok((
        join(data[0].effective, data[1].effective),
        join(data[0].permitted, data[1].permitted),
        join(data[0].inheritable, data[1].inheritable),
    ))
}

/// Step 7: sets `PR_SET_NO_NEW_PRIVS` and reads it back.
///
/// Errors: the OS error of `prctl`, or a read-back that is not 1.
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: integer arguments only.
    match unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) } {
        1 => Ok(()),
        other => Err(io::Error::other(format!(
            "PR_GET_NO_NEW_PRIVS returned {other} after setting it"
        ))),
    }
}
