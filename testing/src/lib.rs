//! Test support shared by sandcell's crates: one way for a test to skip, with one message
//! format, and the guard that keeps a machine from going green while it silently skips
//! something it is meant to test.
//!
//! A test that needs something this machine may lack (root, R, polkit, ...) names the *tier*
//! it needs when it skips:
//!
//! ```ignore
//! if !sandcell_testing::is_root() {
//!     sandcell_testing::skip!("root", "needs root to switch uid");
//! }
//! ```
//!
//! which prints `SKIP [root] <crate>::<test>: needs root to switch uid` on stderr and returns
//! from the test (any function returning `()` or an `Option`/`Default` value). When the tier
//! is listed in [`REQUIRE_ENV`] (`SANDCELL_REQUIRE_TIERS=root,r,...`, or `all`), the skip is a
//! failure instead: the test panics with the same message. `scripts/test.sh` sets the list for
//! the machine it runs on, so a CI machine that lost R or root fails instead of passing.
//!
//! [`netns`] is the private network the egress tests reach through the proxy.
//!
//! [`worker`] is the one harness the worker tests of the three engines drive their workers
//! with.

pub mod netns;
pub mod worker;

/// The environment variable listing the tiers this machine must run (comma-separated names
/// from [`TIERS`], or `all`). Unset or empty: every tier may skip.
pub const REQUIRE_ENV: &str = "SANDCELL_REQUIRE_TIERS";

/// Every tier a test may skip for, with what it needs.
pub const TIERS: &[(&str, &str)] = &[
    (
        "root",
        "the tests run as root (uid switches, namespaces, useradd)",
    ),
    (
        "cgroups",
        "root and a cgroup hierarchy the daemon can delegate (not SANDCELL_TEST_INSECURE)",
    ),
    (
        "landlock",
        "a kernel whose Landlock ABI covers the level tested",
    ),
    ("r", "R (r-base-core) and what the R tests call (perl)"),
    (
        "pydata",
        "/usr/bin/python3 with numpy, pandas, scipy, matplotlib, statsmodels",
    ),
    ("dbus", "dbus-daemon, busctl, setpriv and useradd"),
    ("polkit", "polkitd (or sandcell's action file) installed"),
    ("socket-activation", "systemd-socket-activate"),
    (
        "netns",
        "iproute2's ip, to build a private network in network namespaces",
    ),
    (
        "built",
        "the workspace's binaries are built (cargo build --workspace --bins)",
    ),
    (
        "fonts",
        "a fontconfig cache for the fonts R and matplotlib use (scripts/font-cache.sh)",
    ),
    (
        "sys-resource",
        "CAP_SYS_RESOURCE in the tests' effective set (some VMs and containers withhold it)",
    ),
];

/// Whether `tier` must not skip on this machine ([`REQUIRE_ENV`]).
pub fn required(tier: &str) -> bool {
    required_in(
        std::env::var(REQUIRE_ENV).unwrap_or_default().as_str(),
        tier,
    )
}

fn required_in(list: &str, tier: &str) -> bool {
    list.split(',')
        .map(str::trim)
        .any(|t| t == tier || t == "all")
}

/// Reports that `test` skips (all of it, or the part `why` names) for lack of `tier`: prints
/// `SKIP [tier] test: why`, and panics with that message when the tier is required.
///
/// Panics also when `tier` is not one of [`TIERS`] (a typo must not make a skip unguardable).
pub fn skipped(tier: &str, test: &str, why: &str) {
    assert!(
        TIERS.iter().any(|(t, _)| *t == tier),
        "unknown test tier {tier:?} (see sandcell_testing::TIERS)"
    );
    let line = format!("SKIP [{tier}] {test}: {why}");
    if required(tier) {
        panic!("{line}\n(tier `{tier}` is required here by {REQUIRE_ENV})");
    }
    eprintln!("{line}");
}

/// The name of the function a [`skip!`] expands in, from the type name of a nested item.
#[doc(hidden)]
pub fn test_name(item_type_name: &'static str) -> &'static str {
    let name = item_type_name
        .strip_suffix("::__sandcell_skip_here")
        .unwrap_or(item_type_name);
    name.strip_suffix("::{{closure}}").unwrap_or(name)
}

/// Skips the calling test for lack of a tier: `skip!("r", "R is not installed ({})", path)`.
/// Prints `SKIP [tier] test: why` and returns `Default::default()` from the enclosing
/// function; when the tier is required ([`REQUIRE_ENV`]) it panics instead.
#[macro_export]
macro_rules! skip {
    ($tier:expr, $($why:tt)+) => {{
        fn __sandcell_skip_here() {}
        $crate::skipped(
            $tier,
            $crate::test_name(::std::any::type_name_of_val(&__sandcell_skip_here)),
            &format!($($why)+),
        );
        return ::std::default::Default::default();
    }};
}

/// Reports a skipped *part* of the calling test (the test goes on): same message and the same
/// failure for a required tier as [`skip!`].
#[macro_export]
macro_rules! skip_part {
    ($tier:expr, $($why:tt)+) => {{
        fn __sandcell_skip_here() {}
        $crate::skipped(
            $tier,
            $crate::test_name(::std::any::type_name_of_val(&__sandcell_skip_here)),
            &format!($($why)+),
        );
    }};
}

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Whether `program` is an executable file on `PATH`.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            std::fs::metadata(d.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Standard base64 (RFC 4648) to bytes; `None` on a character outside the alphabet.
pub fn b64decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes().filter(|&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_tiers_are_parsed() {
        assert!(required_in("root,r", "r"));
        assert!(required_in(" root , r ", "root"));
        assert!(required_in("all", "polkit"));
        assert!(!required_in("", "r"));
        assert!(!required_in("rr", "r"));
    }

    fn skips() -> Option<u32> {
        skip_part!("fonts", "part {}", 1);
        if std::env::var_os(REQUIRE_ENV).is_none() {
            skip!("fonts", "whole");
        }
        Some(1)
    }

    #[test]
    fn skip_returns_the_default_and_names_the_test() {
        if std::env::var_os(REQUIRE_ENV).is_none() {
            assert_eq!(skips(), None);
        }
        fn __sandcell_skip_here() {}
        let name = test_name(std::any::type_name_of_val(&__sandcell_skip_here));
        assert!(
            name.ends_with("tests::skip_returns_the_default_and_names_the_test"),
            "{name}"
        );
    }

    #[test]
    #[should_panic(expected = "unknown test tier")]
    fn unknown_tiers_are_refused() {
        skipped("no-such-tier", "t", "why");
    }
}
