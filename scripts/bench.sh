#!/usr/bin/env bash
# Benchmark, one run, figures only (no assertions): first sandcelld with the shipped defaults
# beside bubblewrap + python3, Jupyter (ipykernel, IRkernel) and Rscript, per environment p50,
# p99 and max of one-shot Run, open + cell + close and a session cell, with the ratios and the
# memory of each warm worker (scripts/bench_shipped.py); then the engines alone (Eryx in
# process, Rscript), and sandcelld through its socket, confined (as root), without and with
# warm pools of chosen sizes; the gap a client sees across a restart, a crash and a re-exec
# (scripts/bench_restart.py, root only).
# Usage: scripts/bench.sh [--iterations N] [--paced-iterations P] [--pace-ms MS] [--shipped-only]
#                         [--no-setup] [DETAIL_N]
#   --iterations N   samples per figure of the shipped-defaults comparison (default 10000)
#   --paced-iterations P
#                    samples of its one-shot and open + cell + close figures only (default N;
#                    each takes a new warm worker, so at the shipped refill rate of 4 a second
#                    and a 300 ms pace N = 10000 runs about five hours). Session cells: N in
#                    one session per environment; Rscript's start: N, within 5 to 200 (a sample
#                    takes a fifth of a second and the figure is a p50)
#   Exit status: 2 on a bad argument; 1 when the shipped-defaults comparison failed (the
#   other sections still run and print what they can); 0 otherwise.
#   --pace-ms MS     pause before each one-shot and open sample there (default 300, so that
#                    each finds its warm worker; 0 = back to back)
#   --shipped-only   only the shipped-defaults comparison
#   --no-setup       do not run scripts/setup.sh first (a machine already set up)
#   DETAIL_N         samples per figure of the other sections (default 50)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
iterations=10000 paced= pace=300 shipped_only=0 setup=1 n=50 shipped_failed=0
# count OPTION VALUE: VALUE when it is a whole number (0 or more), else a usage error.
count() {
    [[ ${2-} =~ ^[0-9]+$ ]] || { echo "bench.sh: $1 needs a whole number, not '${2-}'" >&2; exit 2; }
    echo "$2"
}
while [[ $# -gt 0 ]]; do
    case $1 in
        --iterations) iterations=$(count "$1" "${2-}"); shift 2 ;;
        --paced-iterations) paced=$(count "$1" "${2-}"); shift 2 ;;
        --pace-ms) pace=$(count "$1" "${2-}"); shift 2 ;;
        --shipped-only) shipped_only=1; shift ;;
        --no-setup) setup=0; shift ;;
        [0-9]*) n=$1; shift ;;
        *) echo "bench.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
((setup)) && bash scripts/setup.sh >/dev/null
# Everything printed is also kept for the summary of the latency targets at the end.
out=$(mktemp -d /var/tmp/sandcell-bench-out.XXXXXX)
trap 'rm -rf "$out"' EXIT
exec > >(tee "$out/log")

/usr/bin/python3 scripts/bench_shipped.py --bin "$BIN" --runtime "$SANDCELL_TEST_PYTHON_RUNTIME" \
    --iterations "$iterations" --paced-iterations "${paced:-$iterations}" --pace-ms "$pace" --json-out "$out/shipped.json" \
    || { shipped_failed=1; echo "(shipped-defaults bench failed)"; }
if ((shipped_only)); then
    echo
    python3 scripts/bench_summary.py "$out/log" - "$out/shipped.json" || echo "(summary failed)"
    exit "$shipped_failed"
fi

echo "== Eryx in process (the floor)"
"$BIN/sandcell-python-runtime" bench --dir "$SANDCELL_TEST_PYTHON_RUNTIME" --iterations "$n" \
    | tee "$out/eryx.json" | python3 -c 'import json, sys
for k, v in sorted(json.load(sys.stdin).items()):
    if isinstance(v, dict) and "p50_ms" in v:
        print("%-45s p50 %.3f ms, p99 %.3f ms" % (k, v["p50_ms"], v["p99_ms"]))' || true

echo "== Rscript -e 'cat(1)' start (10 runs, ms each)"
for _ in $(seq 10); do
    s=$(date +%s%N); Rscript -e 'cat(1)' >/dev/null; e=$(date +%s%N)
    printf '%s ' $(( (e - s) / 1000000 ))
done
echo

echo "== bare R worker (sandcell-worker-r driven directly over its pipes, no daemon)"
cargo test "${CARGO_FLAGS[@]}" -p sandcell-worker-native --test worker -- --nocapture --exact figures 2>&1 \
    | grep -iE "ready|round trip|rss|rscript|p50|p99" || echo "(figures test not found)"

echo "== confinement cost (median of 50 starts: process wall time, enter() and each layer)"
if [[ $(id -u) -eq 0 ]]; then
    cargo test "${CARGO_FLAGS[@]}" -p sandcell-confine --test probe bench_enter_cost -- --ignored --nocapture 2>&1 \
        | grep -E "median|^ +[a-z_-]+ +[0-9]+ us$" || echo "(confinement bench failed)"
else
    echo "(skipped: the confinement bench needs root for namespaces and identity changes)"
fi

mode=()
[[ $(id -u) -eq 0 ]] || mode=(--insecure-dev)
bench() { # label, language, extra bench args..., -- env assignments...
    local label=$1 lang=$2; shift 2
    local args=() envs=()
    while [[ $# -gt 0 && $1 != -- ]]; do args+=("$1"); shift; done
    [[ $# -gt 0 ]] && shift
    envs=("$@")
    local run; run=$(mktemp -d /var/tmp/sandcell-bench.XXXXXX); chmod 0711 "$run"
    # Session records on tmpfs, as the shipped adopt_dir (/run) is: on ext4 each cell's record
    # writes cost milliseconds (see bench_shipped.py).
    local adopt; adopt=$(mktemp -d /dev/shm/sandcell-bench-adopt.XXXXXX)
    env SANDCELL_WORKER_DIR="$BIN" SANDCELL_PYTHON_RUNTIME_DIR="$SANDCELL_TEST_PYTHON_RUNTIME" \
        SANDCELL_STATE_DIR="$run/state" SANDCELL_CGROUP_NAME="sandcell-bench-$$" SANDCELL_LANGUAGES=python,r SANDCELL_METRICS_FILE="$run/metrics.prom" SANDCELL_ADOPT_DIR="$adopt" \
        SANDCELL_MAX_CONCURRENT_SESSIONS=128 SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES=$((128 * 134217728)) \
        SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES=$((128 * 1073741824)) SANDCELL_LOG=info "${envs[@]}" \
        "$BIN/sandcelld" "${mode[@]}" --listen "$run/k.sock" 2>"$run/daemon.log" &
    local daemon=$!
    for _ in $(seq 400); do grep -q "ready to serve" "$run/daemon.log" 2>/dev/null && break; sleep 0.05; done
    sleep 1
    echo "== sandcelld, $lang, $label"
    "$BIN/sandcell-bench" --socket "$run/k.sock" --daemon-pid "$daemon" --language "$lang" --label "$label" \
        --cgroup-name "sandcell-bench-$$" --iterations "$n" "${args[@]}" || echo "bench failed; log: $run/daemon.log"
    kill -TERM "$daemon"; wait "$daemon" || true
    rm -rf "$run" "$adopt"
}
bench "cold (no pool)" python --clients 1,2,4,16 --sessions 1,2,4 --idle-sessions 100
bench "warm pool" python --clients 1,2,4,16 --sessions 0 --idle-sessions 0 --pace-ms 50 -- \
    SANDCELL_POOL_PYTHON_MIN=4 SANDCELL_POOL_PYTHON_MAX=16 SANDCELL_POOL_REFILL_PER_SECOND=200
bench "cold (no pool)" r --clients 1,2,4 --sessions 1,2,4 --idle-sessions 100
bench "warm pool" r --clients 1,2,4 --sessions 0 --idle-sessions 0 --pace-ms 400 -- \
    SANDCELL_POOL_R_MIN=4 SANDCELL_POOL_R_MAX=8 SANDCELL_POOL_REFILL_PER_SECOND=200

echo "== the pydata environment beside Jupyter (ipykernel, IRkernel) and bubblewrap"
/usr/bin/python3 scripts/bench_pydata.py --bin "$BIN" --runtime "$SANDCELL_TEST_PYTHON_RUNTIME" \
    --iterations "$n" || echo "(pydata bench failed)"
"$(bash scripts/jupyter-venv.sh)" scripts/bench_jupyter.py --bin "$BIN" \
    --runtime "$SANDCELL_TEST_PYTHON_RUNTIME" --iterations "$n" || echo "(jupyter bench failed)"

echo "== MCP: run_code through the MCP Python SDK beside Run through the Python client (print(1))"
PYTHONPATH=clients/python/src "$SANDCELL_CACHE/mcp-venv/bin/python" scripts/bench_mcp.py \
    --iterations "$n" || echo "(mcp bench failed)"

echo "== restart gap: SIGUSR2 + successor, SIGKILL + successor, SIGUSR1 re-exec (8 sessions, this machine)"
/usr/bin/python3 scripts/bench_restart.py --bin "$BIN" --runtime "$SANDCELL_TEST_PYTHON_RUNTIME" \
    --rounds 5 || echo "(restart bench failed)"

echo
# The shipped-defaults table last, so that the run ends with it.
python3 scripts/bench_summary.py "$out/log" "$out/eryx.json" || echo "(summary failed)"
echo
python3 scripts/bench_summary.py "$out/log" - "$out/shipped.json" || echo "(summary failed)"
exit "$shipped_failed"
