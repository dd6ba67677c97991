//! A private system-like D-Bus for the control-plane tests: `dbus-daemon` on a socket in a
//! temporary directory, with the default context of Debian's system bus policy
//! (`/usr/share/dbus-1/system.conf`, minus what needs a real system: user switch, fork, pid
//! file, activation), the policies installed in `/usr/share/dbus-1/system.d` (polkitd's among
//! them) and the policy sandcell ships for its name.

use super::{eventually, manifest_dir};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Output of a finished command: exit code, stdout, stderr.
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` with no standard input and collects its output.
pub fn run(cmd: &mut Command) -> Out {
    let o = cmd
        .stdin(Stdio::null())
        .output()
        .expect("running a command");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// Runs `cmd` with `stdin` written to its standard input (then closed) and collects its
/// output.
pub fn run_input(cmd: &mut Command, stdin: &str) -> Out {
    use std::io::Write;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running a command");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// The bus; killed on drop.
pub struct Bus {
    pub child: Child,
    pub dir: tempfile::TempDir,
    /// `unix:path=...`, for `DBUS_SYSTEM_BUS_ADDRESS`.
    pub address: String,
    pub config: PathBuf,
}

impl Bus {
    /// Starts the bus and waits (at most 10 s) for its socket.
    pub fn start() -> Bus {
        let dir = tempfile::Builder::new()
            .prefix("sandcell-bus-")
            .tempdir_in("/var/tmp")
            .unwrap();
        // Traversable by the unprivileged test users (the socket itself is world-writable).
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        let socket = dir.path().join("system_bus_socket");
        let config = dir.path().join("system.conf");
        let shipped = manifest_dir().join("../dbus/org.sandcell.Sandcell1.conf");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <auth>EXTERNAL</auth>
  <listen>unix:path={socket}</listen>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus" send_member="UpdateActivationEnvironment"/>
  </policy>
  <includedir>/usr/share/dbus-1/system.d</includedir>
  <include>{shipped}</include>
</busconfig>
"#,
                socket = socket.display(),
                shipped = shipped.display()
            ),
        )
        .unwrap();
        let address = format!("unix:path={}", socket.display());
        let child = Self::spawn(&config, &socket);
        Bus {
            child,
            dir,
            address,
            config,
        }
    }

    fn spawn(config: &Path, socket: &Path) -> Child {
        let _ = std::fs::remove_file(socket);
        let child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting dbus-daemon");
        assert!(
            eventually(Duration::from_secs(10), || socket.exists()),
            "dbus-daemon did not create {}",
            socket.display()
        );
        child
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("system_bus_socket")
    }

    /// Kills the bus (every connection on it ends).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the bus again at the same address.
    pub fn restart(&mut self) {
        self.child = Self::spawn(&self.config, &self.socket());
    }

    /// `busctl --system` on this bus, as the test's own user.
    pub fn busctl(&self) -> Command {
        let mut c = Command::new("busctl");
        c.env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .arg("--system");
        c
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        self.stop();
    }
}
