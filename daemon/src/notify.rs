//! systemd notifications (sd_notify(3)): READY=1 after the readiness probe, STATUS= with live
//! counts, WATCHDOG=1 at half the watchdog interval, STOPPING=1 on SIGTERM, RELOADING=1 before a re-exec in place. Without
//! `NOTIFY_SOCKET` every call is a no-op.

use sd_notify::NotifyState;
use std::time::Duration;

/// Sends READY=1 and a status line, with WATCHDOG=1 when systemd watches the daemon (a re-exec in
/// place is a reload for systemd, which need not restart the watchdog's clock).
pub fn ready(status: &str) {
    let mut states = vec![NotifyState::Ready, NotifyState::Status(status)];
    if watchdog_interval().is_some() {
        states.push(NotifyState::Watchdog);
    }
    let _ = sd_notify::notify(&states);
}

/// Sends RELOADING=1 with MONOTONIC_USEC (which systemd 253 and later expect with it for
/// `Type=notify-reload` units; others ignore it) and a status line: the daemon re-executes in
/// place ([`crate::reexec`]); the new image's READY=1 ends the reload.
pub fn reloading() {
    let mut states = vec![NotifyState::Reloading, NotifyState::Status("re-executing")];
    if let Ok(now) = NotifyState::monotonic_usec_now() {
        states.push(now);
    }
    let _ = sd_notify::notify(&states);
}

/// Sends a status line.
pub fn status(status: &str) {
    let _ = sd_notify::notify(&[NotifyState::Status(status)]);
}

/// Sends STOPPING=1.
pub fn stopping() {
    let _ = sd_notify::notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// Half the watchdog interval systemd asked for, if it asked (`WATCHDOG_USEC`).
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|d| !d.is_zero())
        .map(|d| d / 2)
}

/// Sends WATCHDOG=1.
pub fn watchdog() {
    let _ = sd_notify::notify(&[NotifyState::Watchdog]);
}
