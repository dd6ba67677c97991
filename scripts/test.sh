#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh), then runs formatting and lint checks and every test
# tier that runs here: unit tests, and integration tests with real Eryx, R, cgroups, Landlock,
# seccomp and socket activation. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh
# The tiers this machine must run (names: sandcell_testing::TIERS in testing/src/lib.rs). A test
# that would skip one of them for lack of what it needs fails instead, so a machine that lost R,
# root or polkit cannot pass. A machine without some tier sets its own list, e.g.
# SANDCELL_REQUIRE_TIERS=root,cgroups,landlock; an empty list lets every tier skip.
export SANDCELL_REQUIRE_TIERS="${SANDCELL_REQUIRE_TIERS-root,cgroups,landlock,r,pydata,dbus,polkit,socket-activation,built,fonts}"
echo "== required test tiers: ${SANDCELL_REQUIRE_TIERS:-none}"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (warnings denied)"
cargo clippy "${CARGO_FLAGS[@]}" --workspace --all-targets -- -D warnings
echo "== packages (man pages and example config checked against the code; lintian, rpmlint)"
bash scripts/package.sh --deb --rpm
echo "note: the system-test tier (a VM with systemd as PID 1 and pure cgroup v2) is not part of"
echo "      this run; it takes about 15 minutes: bash scripts/vm-test.sh"
echo "== every integration test is a test target (tests/integration/*.rs in daemon/Cargo.toml)"
for f in tests/integration/*.rs; do
    grep -qF "path = \"../$f\"" daemon/Cargo.toml \
        || { echo "test: $f is not listed as a [[test]] in daemon/Cargo.toml: it would never run" >&2; exit 1; }
done
[[ ! -e daemon/tests ]] || { echo "test: daemon/tests/ exists; integration tests live in tests/integration/" >&2; exit 1; }
echo "== cargo test"
cargo test "${CARGO_FLAGS[@]}" --workspace --no-fail-fast -- --test-threads=2
echo "== cargo test under the unit's sandbox: units/sandcelld.service's seccomp filters, bounding"
echo "   set and no_new_privs, applied without systemd (tests/integration/common/unit_sandbox.rs);"
echo "   the suites covering every org.sandcell.Kernel method and the metrics file"
SANDCELL_TEST_UNIT_SANDBOX=1 cargo test "${CARGO_FLAGS[@]}" -p sandcelld --no-fail-fast \
    --test unit_sandbox --test files --test submit_attach --test inspect --test host_calls \
    --test pydata --test metrics -- --test-threads=2
echo "== python client (clients/python) against a real sandcelld; docs/deploy manifests"
bash scripts/test-python-client.sh
bash scripts/test-jupyter.sh
echo "== soak: 8 clients x 100 cells against a socket-activated sandcelld, every result checked"
bash scripts/soak.sh --clients 8 --cells 100
echo "== fuzz: every decoder, about a minute (the build is kept in /var/tmp/sandcell-fuzz-target)"
bash scripts/fuzz.sh 60
