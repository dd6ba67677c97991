#!/usr/bin/env bash
# The main job, end to end: set up, start sandcelld under socket activation (as systemd
# would), run the real example cells in examples/ through sandcellctl, show a persistent
# session, and stop the daemon (every worker is reaped).
# With --serve, the daemon keeps running after the examples until Ctrl-C, and the script prints
# the two lines that point sandcellctl (and the Python client) at it from another shell.
set -euo pipefail
cd "$(dirname "$0")/.."
serve=false
[[ ${1:-} == --serve ]] && serve=true
. scripts/env.sh
bash scripts/setup.sh

run=$(mktemp -d /var/tmp/sandcell-demo.XXXXXX)
chmod 0711 "$run"
sock="$run/org.sandcell.Kernel"
mode=()
if [[ $(id -u) -ne 0 ]]; then
    echo "demo: not root: starting sandcelld with --insecure-dev (no cgroups, best-effort confinement)"
    mode=(--insecure-dev)
fi
# systemd-socket-activate passes the daemon no environment but what -E names, as systemd would.
systemd-socket-activate -l "$sock" --fdname=varlink \
    -E SANDCELL_WORKER_DIR="$BIN" -E SANDCELL_PYTHON_RUNTIME_DIR="$SANDCELL_TEST_PYTHON_RUNTIME" \
    -E SANDCELL_STATE_DIR="$run/state" -E SANDCELL_CGROUP_NAME="sandcell-demo-$$" \
    -E SANDCELL_IDLE_EXIT_SECONDS=0 -E SANDCELL_METRICS_FILE="$run/metrics.prom" -E SANDCELL_ADOPT_DIR="$run/adopt" \
    "$BIN/sandcelld" "${mode[@]}" 2>"$run/daemon.log" &
activator=$!
trap 'kill -TERM $activator 2>/dev/null; wait $activator 2>/dev/null; echo "demo: daemon log: $run/daemon.log"' EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
chmod 0660 "$sock"
export SANDCELL_SOCKET="$sock"

for f in examples/python/*.py examples/r/*.R; do
    echo
    echo "=== sandcellctl run $f"
    "$BIN/sandcellctl" run "$f" || echo "(exit status $?)"
done

# The pydata examples read data files: --put uploads them into the cell's directory first.
if "$BIN/sandcellctl" environments | grep -q '^pydata '; then
    for f in examples/pydata/*.py; do
        echo
        echo "=== sandcellctl run -e pydata --put examples/pydata/mtcars.csv --put examples/pydata/sleep.csv $f"
        "$BIN/sandcellctl" run -e pydata --put examples/pydata/mtcars.csv \
            --put examples/pydata/sleep.csv "$f" || echo "(exit status $?)"
    done
else
    echo
    echo "=== (no pydata environment served here: the examples in examples/pydata are skipped)"
fi

echo
echo "=== a persistent Python session: variables survive across cells"
s=$("$BIN/sandcellctl" open --language python --idle 60)
echo "x = [n * n for n in range(10)]" | "$BIN/sandcellctl" exec "$s" -
echo "print('sum of squares:', sum(x))" | "$BIN/sandcellctl" exec "$s" -
echo "y = undefined_name" | "$BIN/sandcellctl" exec "$s" - || echo "(exit status $?: the cell failed, the session lives on)"
echo "print('x survived:', x[-1])" | "$BIN/sandcellctl" exec "$s" -
"$BIN/sandcellctl" close "$s"

echo
echo "=== a cell that fails, with its traceback and exit status"
printf 'def f(d):\n    return 1 / d\n\nf(0)\n' | "$BIN/sandcellctl" run - || echo "(exit status $?)"

if $serve; then
    echo
    echo "=== sandcelld keeps running (Ctrl-C stops it). In another shell:"
    echo "export SANDCELL_SOCKET=$sock"
    echo "export PATH=$BIN:\$PATH"
    wait $activator || true
fi
