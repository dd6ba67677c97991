//! Step 5: identity.
//!
//! Order matters: `setgroups([])` first (it needs CAP_SETGID, lost with the uid), then
//! `setresgid`, then `setresuid`, each setting real, effective and saved ids so there is no
//! way back. The kernel clears the permitted and effective capability sets on the switch from
//! uid 0 to a non-zero uid (no SECBIT_NO_SETUID_FIXUP is set); [`crate::caps`] verifies it.
//! Afterwards every id is read back: a partial switch is an error, not a warning.

use std::io;

/// Switches to `uid`/`gid` with no supplementary groups and checks the result.
///
/// Errors: the OS error of the failing call (`EPERM` when not root), or a description of an
/// id that did not change.
pub fn switch(uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: setgroups with size 0 does not read the (null) list.
    if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
        return Err(context("setgroups([])"));
    }
    // SAFETY: plain integer arguments.
    if unsafe { libc::setresgid(gid, gid, gid) } != 0 {
        return Err(context("setresgid"));
    }
    // SAFETY: plain integer arguments.
    if unsafe { libc::setresuid(uid, uid, uid) } != 0 {
        return Err(context("setresuid"));
    }
    verify(uid, gid)
}

/// Reads back real/effective/saved uid and gid and the supplementary groups.
///
/// Errors: a description of the first id that differs.
pub fn verify(uid: u32, gid: u32) -> io::Result<()> {
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: the three pointers are valid for writes of one uid_t each.
    if unsafe { libc::getresuid(&mut r, &mut e, &mut s) } != 0 {
        return Err(context("getresuid"));
    }
    if (r, e, s) != (uid, uid, uid) {
        return Err(io::Error::other(format!(
            "uids are {r}/{e}/{s} after setresuid({uid})"
        )));
    }
    // SAFETY: as above, for gid_t.
    if unsafe { libc::getresgid(&mut r, &mut e, &mut s) } != 0 {
        return Err(context("getresgid"));
    }
    if (r, e, s) != (gid, gid, gid) {
        return Err(io::Error::other(format!(
            "gids are {r}/{e}/{s} after setresgid({gid})"
        )));
    }
    // SAFETY: size 0 asks only for the count; the null list is not written.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n != 0 {
        return Err(io::Error::other(format!(
            "{n} supplementary groups remain after setgroups([])"
        )));
    }
    Ok(())
}

fn context(call: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{call}: {e}"))
}
