#!/usr/bin/env bash
# Soak: start sandcelld under socket activation (as scripts/demo.sh does, with a private state
# directory and cgroup name), drive it with concurrent clients (sandcell-soak) that check
# every result, then check that nothing is left over.
#
#   scripts/soak.sh [--clients N] [--cells M] [--seconds S] [--seed X] [--languages python,r]
#                   [--restart-every S]
#
# Defaults: 8 clients x 100 cells. Environment: SANDCELL_SOAK_KILL_GRACE_SECONDS (10, see
# below), SANDCELL_SOAK_LOG (the daemon's SANDCELL_LOG filter, default warn; info logs every
# cell handed over and continued across a restart). Budgets are raised so that N clients fit (sessions,
# memory budgets, per-uid quotas, connections: every client is this script's uid; worker
# start-up may take 120 s, since N clients start workers at once on few cores). Prints
# samples of the daemon's RSS and descriptors (all of them, every 5 s, in samples.csv of the run
# directory), throughput, every problem (warm pools are off: a pool grows while it is taken
# from and empties only after pool_empty_seconds, so its workers would count as leaks), then one closing line `soak: C cells, L lost, W wrong,
# K leaked` (the `soak: daemon log: ...` line follows it); exits non-zero unless all are 0.
# --restart-every S: the daemon is restarted every S seconds while the clients run, SIGUSR2
# (a planned exit keeping sessions), SIGKILL (a crash) and SIGUSR1 (a re-exec in place, the
# package upgrade's path) in turn, each successor started on the same socket, state and
# adoption directories as a restart of the unit does; the
# clients then run cells in detached Python sessions and follow a cut cell in the successor,
# and leaks also count keepers and mounted session file systems.
# Needs the binaries of scripts/setup.sh; builds sandcell-soak if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
clients=8
cells=100
extra=()
while [[ $# -gt 0 ]]; do
    case $1 in
    --clients) clients=$2; shift 2 ;;
    --cells) cells=$2; shift 2 ;;
    --seconds | --seed | --languages | --sample-seconds | --oneshot-percent | --samples-out | --restart-every)
        extra+=("$1" "$2"); shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "soak: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ -x $BIN/sandcelld && -x $BIN/sandcell-worker-python ]] || {
    echo "soak: $BIN/sandcelld or the workers are missing: run scripts/setup.sh first" >&2
    exit 2
}
if [[ ! -x $BIN/sandcell-soak || client/src/bin/soak.rs -nt $BIN/sandcell-soak ]]; then
    cargo build "${CARGO_FLAGS[@]}" -p sandcell-client --bin sandcell-soak
fi
languages=python
if [[ -x $BIN/sandcell-worker-r ]] && command -v R >/dev/null; then
    languages=python,r
fi
if [[ ! " ${extra[*]} " =~ " --languages " ]]; then
    extra+=(--languages "$languages")
fi

run=$(mktemp -d /var/tmp/sandcell-soak.XXXXXX)
chmod 0711 "$run"
# The daemon's RSS and descriptor count over time (a sample every 5 s unless told).
if [[ ! " ${extra[*]} " =~ " --samples-out " ]]; then
    extra+=(--samples-out "$run/samples.csv")
fi
sock="$run/org.sandcell.Kernel"
notify="$run/notify"
cgroup="sandcell-soak-$$"
uid_base=3900000000
uid_count=65536
# The kill grace (how long an interrupted or timed-out cell has to stop before its worker is
# killed and the session lost) is raised from 2 s to 10 s: on a loaded machine (N clients on
# few cores, load average far above the core count) a worker may not be scheduled within 2 s
# of its SIGINT, and the soak checks results and leaks, not scheduling latency. The default
# grace and the escalation itself are tested in tests/integration (faults.rs, cell_reports.rs).
kill_grace=${SANDCELL_SOAK_KILL_GRACE_SECONDS:-10}
log_level=${SANDCELL_SOAK_LOG:-warn}
# Each client holds at most one worker at a time; releases are asynchronous, so leave slack.
sessions=$((clients * 2 + 4))
mode=()
if [[ $(id -u) -ne 0 ]]; then
    echo "soak: not root: starting sandcelld with --insecure-dev (no cgroups, best-effort confinement)"
    mode=(--insecure-dev)
fi
# One daemon. The restart mode starts each successor the same way (same socket, state and
# adoption directories), so the start is a script of its own that prints the daemon's pid.
start_daemon() {
    exec systemd-socket-activate -l "$sock" --fdname=varlink \
        -E SANDCELL_WORKER_DIR="$BIN" -E SANDCELL_PYTHON_RUNTIME_DIR="$SANDCELL_TEST_PYTHON_RUNTIME" \
        -E SANDCELL_STATE_DIR="$run/state" -E SANDCELL_CGROUP_NAME="$cgroup" \
        -E SANDCELL_IDLE_EXIT_SECONDS=0 -E SANDCELL_LANGUAGES="$languages" -E SANDCELL_METRICS_FILE="$run/metrics.prom" -E SANDCELL_ADOPT_DIR="$run/adopt" \
        -E SANDCELL_POOLS=false \
        -E SANDCELL_WORKER_UID_BASE="$uid_base" -E SANDCELL_WORKER_UID_COUNT="$uid_count" \
        -E SANDCELL_EXECUTION_WALL_TIME_SECONDS=60 -E SANDCELL_MAX_FUEL=1000000000000000 \
        -E SANDCELL_KILL_GRACE_SECONDS="$kill_grace" \
        -E SANDCELL_WORKER_START_TIMEOUT_SECONDS=120 -E SANDCELL_CONNECTION_IDLE_SECONDS=3600 \
        -E SANDCELL_MAX_CONCURRENT_SESSIONS="$sessions" \
        -E SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES=$((sessions * 134217728)) \
        -E SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES=$((sessions * 1073741824)) \
        -E SANDCELL_MAX_GUEST_MEMORY_BYTES=134217728 -E SANDCELL_MAX_WORKER_MEMORY_BYTES=1073741824 \
        -E SANDCELL_MAX_SESSIONS_PER_UID="$sessions" \
        -E SANDCELL_MAX_GUEST_MEMORY_BYTES_PER_UID=$((sessions * 134217728)) \
        -E SANDCELL_MAX_WORKER_MEMORY_BYTES_PER_UID=$((sessions * 1073741824)) \
        -E SANDCELL_MAX_STARTS_PER_SECOND_PER_UID=1000 -E SANDCELL_MAX_START_BURST_PER_UID=100000 \
        -E SANDCELL_MAX_CONNECTIONS=$((clients * 4 + 64)) \
        -E SANDCELL_MAX_CONNECTIONS_PER_UID=$((clients * 4 + 64)) \
        -E NOTIFY_SOCKET="$notify" -E SANDCELL_LOG="$log_level" \
        "$BIN/sandcelld" "${mode[@]}"
}
{
    echo '#!/usr/bin/env bash'
    declare -p BIN SANDCELL_TEST_PYTHON_RUNTIME run sock notify cgroup uid_base uid_count \
        languages kill_grace log_level sessions clients mode
    declare -f start_daemon
    echo 'start_daemon >>"$run/daemon.log" 2>&1 </dev/null &'
    echo 'echo $! >"$run/daemon.pid"'
    echo 'echo $!'
} >"$run/start-daemon.sh"
chmod 0700 "$run/start-daemon.sh"
activator=$("$run/start-daemon.sh")
cleanup() {
    # The daemon running now (a successor, with --restart-every): SIGTERM ends its sessions.
    pid=$(cat "$run/daemon.pid" 2>/dev/null || echo "$activator")
    kill -TERM "$pid" 2>/dev/null || true
    # Not this shell's child (the start script's): wait until it is gone or a zombie.
    for _ in $(seq 300); do
        [[ -r /proc/$pid/stat ]] && ! grep -q ') Z ' "/proc/$pid/stat" 2>/dev/null || break
        sleep 0.1
    done
    echo "soak: daemon log: $run/daemon.log ($(grep -c -i -E 'warn|error' "$run/daemon.log" || true) warning/error lines); samples: $run/samples.csv"
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
chmod 0660 "$sock"

# systemd-socket-activate execs sandcelld in place on the first connection: same pid.
status=0
"$BIN/sandcell-soak" --socket "$sock" --clients "$clients" --cells "$cells" \
    --daemon-pid "$activator" --cgroup-name "$cgroup" --state-dir "$run/state" \
    --notify-socket "$notify" --uid-base "$uid_base" --uid-count "$uid_count" \
    --adopt-dir "$run/adopt" --daemon-start "$run/start-daemon.sh" \
    "${extra[@]}" || status=$?
exit "$status"
