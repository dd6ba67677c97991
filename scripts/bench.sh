#!/usr/bin/env bash
# Benchmark: Eryx in process (the floor) and sandcelld through its socket, in one run.
# Prints figures; asserts nothing. Usage: scripts/bench.sh [iterations]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh >/dev/null
n="${1:-50}"
echo "== Eryx in process (baseline)"
"$BIN/sandcell-python-runtime" bench --dir "$SANDCELL_TEST_PYTHON_RUNTIME" --iterations "$n"

run=$(mktemp -d /var/tmp/sandcell-bench.XXXXXX)
chmod 0711 "$run"
mode=()
[[ $(id -u) -eq 0 ]] || mode=(--insecure-dev)
SANDCELL_WORKER_DIR="$BIN" SANDCELL_PYTHON_RUNTIME_DIR="$SANDCELL_TEST_PYTHON_RUNTIME" \
SANDCELL_STATE_DIR="$run/state" SANDCELL_CGROUP_NAME="sandcell-bench-$$" SANDCELL_LANGUAGES=python \
SANDCELL_MAX_CONCURRENT_SESSIONS=128 SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES=$((128 * 134217728)) \
SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES=$((128 * 1073741824)) SANDCELL_LOG=warn \
    "$BIN/sandcelld" "${mode[@]}" --listen "$run/k.sock" 2>"$run/daemon.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 200); do [[ -S $run/k.sock ]] && break; sleep 0.05; done
sleep 1
echo "== sandcelld ($([[ ${#mode[@]} -eq 0 ]] && echo confined || echo insecure-dev))"
"$BIN/sandcell-bench" --socket "$run/k.sock" --daemon-pid "$daemon" --iterations "$n" --idle-sessions 100
