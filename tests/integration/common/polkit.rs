//! polkitd on a private bus ([`super::bus`]) for the tests of polkit's decisions: the shipped
//! `.policy` installed, a rules file granting a test group (the shipped example rules with its
//! group name replaced), and test users in that group or not. Everything is removed on drop.
//! Needs root (useradd, polkit's directories).

use super::bus::{Bus, run};
use super::{eventually, manifest_dir, rand_hex};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The polkit daemon.
pub const POLKITD: &str = "/usr/lib/polkit-1/polkitd";
const ACTIONS_DIR: &str = "/usr/share/polkit-1/actions";
const RULES_DIR: &str = "/etc/polkit-1/rules.d";

impl Bus {
    /// Whether polkitd answers on this bus.
    pub fn polkit_up(&self) -> bool {
        run(self.busctl().args([
            "get-property",
            "org.freedesktop.PolicyKit1",
            "/org/freedesktop/PolicyKit1/Authority",
            "org.freedesktop.PolicyKit1.Authority",
            "BackendVersion",
        ]))
        .code
            == 0
    }
}

/// A test user: no home, no login shell.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// polkitd on a private bus, the shipped policy, the rules granting `group`, the test users.
pub struct Polkit {
    child: Option<Child>,
    address: String,
    installed: Vec<PathBuf>,
    users: Vec<String>,
    group: String,
}

impl Polkit {
    /// Installs the policy (unless the same file is there already) and the rules granting
    /// `group`, creates the group, starts polkitd on `bus` and waits until it answers.
    pub fn start(bus: &Bus, group: &str) -> Polkit {
        let repo = manifest_dir().join("..");
        let mut installed = Vec::new();
        let policy = Path::new(ACTIONS_DIR).join("org.sandcell.policy");
        let shipped = std::fs::read(repo.join("polkit/org.sandcell.policy")).unwrap();
        if std::fs::read(&policy).ok().as_deref() != Some(&shipped[..]) {
            assert!(
                !policy.exists(),
                "{} exists and differs from the shipped policy: not overwriting it",
                policy.display()
            );
            std::fs::write(&policy, &shipped).unwrap();
            installed.push(policy);
        }
        let example =
            std::fs::read_to_string(repo.join("polkit/50-sandcell.rules.example")).unwrap();
        assert_eq!(
            example.matches("isInGroup(\"sandcell\")").count(),
            1,
            "the example rules grant group sandcell once"
        );
        std::fs::create_dir_all(RULES_DIR).unwrap();
        let rules = Path::new(RULES_DIR).join(format!("50-sandcell-test-{group}.rules"));
        std::fs::write(
            &rules,
            example.replace(
                "isInGroup(\"sandcell\")",
                &format!("isInGroup(\"{group}\")"),
            ),
        )
        .unwrap();
        installed.push(rules);
        let mut p = Polkit {
            child: None,
            address: bus.address.clone(),
            installed,
            users: Vec::new(),
            group: group.to_owned(),
        };
        let st = run(Command::new("groupadd").arg(group));
        assert_eq!(st.code, 0, "groupadd: {}", st.stderr);
        p.start_polkitd(bus);
        p
    }

    /// Starts polkitd (again) and waits (at most 20 s) until it answers.
    pub fn start_polkitd(&mut self, bus: &Bus) {
        // setsid: polkitd must not share the test's session (without it, polkitd died
        // silently when the starting shell ended).
        self.child = Some(
            Command::new("setsid")
                .arg(POLKITD)
                .arg("--no-debug")
                .env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting polkitd"),
        );
        assert!(
            eventually(Duration::from_secs(20), || bus.polkit_up()),
            "polkitd did not come up on the private bus"
        );
    }

    /// Kills polkitd.
    pub fn stop_polkitd(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Creates a user `sct<tag><random>`, in the granted group if `in_group`.
    pub fn add_user(&mut self, tag: &str, in_group: bool) -> User {
        let name = format!("sct{tag}{}", rand_hex(3));
        let mut cmd = Command::new("useradd");
        cmd.args(["-M", "-N", "-s", "/usr/sbin/nologin"]);
        if in_group {
            cmd.args(["-G", &self.group]);
        }
        let st = run(cmd.arg(&name));
        assert_eq!(st.code, 0, "useradd {name}: {}", st.stderr);
        self.users.push(name.clone());
        let id = |flag: &str| -> u32 {
            run(Command::new("id").arg(flag).arg(&name))
                .stdout
                .trim()
                .parse()
                .unwrap()
        };
        User {
            uid: id("-u"),
            gid: id("-g"),
            name,
        }
    }
}

impl Drop for Polkit {
    fn drop(&mut self) {
        self.stop_polkitd();
        for f in &self.installed {
            let _ = std::fs::remove_file(f);
        }
        for u in &self.users {
            let _ = run(Command::new("userdel").arg(u));
        }
        let _ = run(Command::new("groupdel").arg(&self.group));
    }
}
