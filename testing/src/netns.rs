//! A private "internet" for the egress tests: two network namespaces joined by a veth pair,
//! nothing else (addresses 11.0.0.0/24; nothing leaves the machine, the host's network is
//! untouched). [`PROXY_NS`]'s side is 11.0.0.1, where the proxy runs; [`WEB_NS`]'s is
//! 11.0.0.2, where [`PrivateNet::serve_http`] starts a web server on port 80.
//!
//! Needs root and iproute2's `ip` (ip-netns(8)); the namespaces and every process started
//! here end when the [`PrivateNet`] is dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Index of the proxy's namespace in [`PrivateNet::ns`] (address 11.0.0.1).
pub const PROXY_NS: usize = 0;
/// Index of the web server's namespace in [`PrivateNet::ns`] (address 11.0.0.2).
pub const WEB_NS: usize = 1;
/// The web server's address.
pub const WEB_ADDR: &str = "11.0.0.2";

/// Two namespaces and a veth pair between them, torn down on drop.
pub struct PrivateNet {
    /// The namespaces' names (ip-netns(8)): `[PROXY_NS]`, `[WEB_NS]`.
    pub ns: [String; 2],
    children: Vec<Child>,
}

impl Drop for PrivateNet {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Runs `ip args`; panics with its stderr when it fails.
pub fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Whether iproute2's `ip` runs here.
pub fn ip_available() -> bool {
    Command::new("ip").arg("-V").output().is_ok()
}

impl PrivateNet {
    /// Creates the namespaces `<tag>p<pid>` and `<tag>w<pid>` and the veth pair (interface
    /// names from `tag` and the pid: at most 15 bytes, so `tag` is at most 3 bytes), both
    /// sides and both loopbacks up. Panics when `ip` fails.
    pub fn new(tag: &str) -> PrivateNet {
        let pid = std::process::id();
        let ns = [format!("{tag}p{pid}"), format!("{tag}w{pid}")];
        let net = PrivateNet {
            ns: ns.clone(),
            children: Vec::new(),
        };
        let (vp, vw) = (format!("{tag}p{pid}"), format!("{tag}w{pid}"));
        ip(&["netns", "add", &ns[PROXY_NS]]);
        ip(&["netns", "add", &ns[WEB_NS]]);
        ip(&[
            "link",
            "add",
            &vp,
            "netns",
            &ns[PROXY_NS],
            "type",
            "veth",
            "peer",
            "name",
            &vw,
            "netns",
            &ns[WEB_NS],
        ]);
        ip(&[
            "-n",
            &ns[PROXY_NS],
            "addr",
            "add",
            "11.0.0.1/24",
            "dev",
            &vp,
        ]);
        ip(&["-n", &ns[WEB_NS], "addr", "add", "11.0.0.2/24", "dev", &vw]);
        for (n, dev) in [(&ns[PROXY_NS], &vp), (&ns[WEB_NS], &vw)] {
            ip(&["-n", n, "link", "set", dev, "up"]);
            ip(&["-n", n, "link", "set", "lo", "up"]);
        }
        net
    }

    /// Starts `/usr/bin/python3 -m http.server 80` on [`WEB_ADDR`] serving `www`.
    pub fn serve_http(&mut self, www: &Path) {
        let mut c = self.command_in(WEB_NS, Path::new("/usr/bin/python3"));
        c.args(["-m", "http.server", "80", "--bind", WEB_ADDR, "--directory"])
            .arg(www)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.spawn(c);
    }

    /// A command running `program` in namespace `which` ([`PROXY_NS`] or [`WEB_NS`]), for
    /// [`PrivateNet::spawn`].
    pub fn command_in(&self, which: usize, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[which]]).arg(program);
        c
    }

    /// A command running `program` itself (no `ip` in between) in namespace `which`: the
    /// child joins the namespace with setns(2) between fork and exec, so a seccomp filter
    /// installed by a later `pre_exec` (a unit's sandbox) applies to `program` only.
    pub fn command_setns(&self, which: usize, program: &Path) -> Command {
        use std::os::fd::{AsRawFd, OwnedFd};
        use std::os::unix::process::CommandExt;
        let ns: OwnedFd = std::fs::File::open(format!("/run/netns/{}", self.ns[which]))
            .unwrap()
            .into();
        let mut c = Command::new(program);
        // SAFETY: setns(2) on a descriptor opened before the fork; the closure owns it, and
        // it is closed at exec (O_CLOEXEC).
        unsafe {
            c.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }

    /// Spawns `cmd`, killed and reaped on drop; returns its index for [`PrivateNet::stop`].
    pub fn spawn(&mut self, mut cmd: Command) -> usize {
        self.children.push(cmd.spawn().unwrap());
        self.children.len() - 1
    }

    /// Kills (SIGKILL) and reaps the process that [`PrivateNet::spawn`] numbered `index`.
    pub fn stop(&mut self, index: usize) {
        let c = &mut self.children[index];
        let _ = c.kill();
        let _ = c.wait();
    }
}
