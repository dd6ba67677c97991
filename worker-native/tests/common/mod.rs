//! What both worker test binaries share.

use std::process::{Child, Command};
use std::time::Duration;

/// Spawns `cmd`, retrying while its executable is "busy" (ETXTBSY): a launcher this test
/// binary copied can be, for as long as another test thread's fork still holds the copy's
/// write descriptor before its exec.
pub fn spawn_retrying(cmd: &mut Command) -> Child {
    let mut tries = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            r => return r.expect("spawn launcher"),
        }
    }
}
