#!/usr/bin/env bash
# The test tiers. Exits non-zero on any failure.
#
#   scripts/test.sh            the default tier, what .ci/run runs: sets up the machine
#                              (scripts/setup.sh), then formatting and lint checks, the packages'
#                              checks and every test that runs here: unit tests, integration
#                              tests with real Eryx, R, cgroups, Landlock, seccomp and socket
#                              activation, the unit-sandbox tier, the Python client, soak, fuzz
#   scripts/test.sh --quick    the edit loop, a few minutes warm: cargo fmt --check, clippy, and
#                              the unit tests of every crate (the session actor's tests against
#                              scripted fake workers included); no setup, no daemon
#   scripts/test.sh --system   the system-test tier: scripts/vm-test.sh (a Debian VM with systemd
#                              as PID 1 and pure cgroup v2, about 15 minutes per kernel); further
#                              arguments go to it (e.g. --kernel backports)
set -euo pipefail
cd "$(dirname "$0")/.."
tier=default
case "${1:-}" in
    --quick) tier=quick; shift ;;
    --system) shift; exec bash scripts/vm-test.sh "$@" ;;
    --default) shift ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "test: unknown argument '$1' (--quick, --system or none)" >&2; exit 2 ;;
esac
[[ $# -eq 0 ]] || { echo "test: unexpected arguments: $*" >&2; exit 2; }
. scripts/env.sh
[[ $tier == quick ]] || bash scripts/setup.sh
# The tiers this machine must run (names: sandcell_testing::TIERS in testing/src/lib.rs). A test
# that would skip one of them for lack of what it needs fails instead, so a machine that lost R,
# root or polkit cannot pass. A machine without some tier sets its own list, e.g.
# SANDCELL_REQUIRE_TIERS=root,cgroups,landlock; an empty list lets every tier skip.
export SANDCELL_REQUIRE_TIERS="${SANDCELL_REQUIRE_TIERS-root,cgroups,landlock,r,pydata,dbus,polkit,socket-activation,netns,built,fonts}"
echo "== required test tiers: ${SANDCELL_REQUIRE_TIERS:-none}"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (warnings denied)"
cargo clippy "${CARGO_FLAGS[@]}" --workspace --all-targets -- -D warnings
if [[ $tier == quick ]]; then
    echo "== cargo test: unit tests of every crate (the session actor against fake workers)"
    cargo test "${CARGO_FLAGS[@]}" --workspace --lib --bins --no-fail-fast -- --test-threads=2
    echo "== quick tier passed; the default tier (bash scripts/test.sh) runs everything CI runs"
    exit 0
fi
echo "== packages (man pages and example config checked against the code; lintian, rpmlint)"
bash scripts/package.sh --deb --rpm
echo "note: the system-test tier (a VM with systemd as PID 1 and pure cgroup v2) is not part of"
echo "      this run; it takes about 15 minutes per kernel: bash scripts/test.sh --system"
echo "== every integration test file is a module of the one integration binary (tests/integration/main.rs)"
for f in tests/integration/*.rs; do
    m=$(basename "$f" .rs)
    [[ $m == main ]] && continue
    grep -qx "mod $m;" tests/integration/main.rs \
        || { echo "test: $f is not a module of tests/integration/main.rs (add 'mod $m;'): it would never run" >&2; exit 1; }
done
[[ ! -e daemon/tests ]] || { echo "test: daemon/tests/ exists; integration tests live in tests/integration/" >&2; exit 1; }
echo "== cargo test"
cargo test "${CARGO_FLAGS[@]}" --workspace --no-fail-fast -- --test-threads=2
echo "== cargo test under the unit's sandbox: units/sandcelld.service's seccomp filters, bounding"
echo "   set and no_new_privs, applied without systemd (tests/integration/common/unit_sandbox.rs);"
echo "   the suites covering every org.sandcell.Kernel method and the metrics file"
SANDCELL_TEST_UNIT_SANDBOX=1 cargo test "${CARGO_FLAGS[@]}" -p sandcelld --no-fail-fast \
    --test integration -- --test-threads=2 unit_sandbox:: files:: submit_attach:: inspect:: \
    host_calls:: pydata:: metrics:: daemon_restart::a_reexec --skip python_files::
echo "== python client (clients/python) against a real sandcelld; docs/deploy manifests"
bash scripts/test-python-client.sh
echo "== sandcellctl mcp: MCP Python SDK, raw JSON-RPC and MCP Inspector against a real sandcelld"; bash scripts/test-mcp.sh
echo "== Jupyter kernels: jupyter_kernel_test and nbclient against a real sandcelld"
bash scripts/test-jupyter.sh
echo "== JupyterLab in headless Chromium: a plot and a DataFrame from sandcell-pydata (about 35 s warm)"
bash scripts/test-jupyterlab.sh
echo "== soak: 8 clients x 100 cells against a socket-activated sandcelld, every result checked"
bash scripts/soak.sh --clients 8 --cells 100
echo "== soak with restarts: 4 clients in detached sessions while sandcelld is restarted every 6 s"
echo "   (SIGUSR2, SIGKILL and SIGUSR1 in turn, a successor on the same state or the same process"
echo "   re-executed): 0 lost, 0 wrong, 0 leaked"
bash scripts/soak.sh --clients 4 --cells 100 --seconds 45 --restart-every 6
echo "== fuzz: every decoder, about a minute (the build is kept in /var/tmp/sandcell-fuzz-target)"
bash scripts/fuzz.sh 60
