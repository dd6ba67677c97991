#!/usr/bin/env bash
# The main job, end to end: set up, start sandcelld under socket activation (as systemd
# would), run the real example cells in examples/ through sandcellctl, show a persistent
# session, and stop the daemon (every worker is reaped).
# With --jupyter, it also runs the notebooks in examples/notebooks through Jupyter's own
# nbconvert (Debian's jupyter-nbconvert) on the sandcell kernelspecs, installed for the demo
# under its directory. With --serve, the daemon keeps running after the examples until
# Ctrl-C, and the script prints the lines that point sandcellctl, the Python client and
# Jupyter at it from another shell.
set -euo pipefail
cd "$(dirname "$0")/.."
serve=false jupyter=false
for arg in "$@"; do
    case $arg in
    --serve) serve=true ;;
    --jupyter) jupyter=true ;;
    -h | --help)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        echo "usage: bash scripts/demo.sh [--jupyter] [--serve]"
        exit 0
        ;;
    *)
        echo "demo: unknown argument $arg (usage: bash scripts/demo.sh [--jupyter] [--serve])" >&2
        exit 2
        ;;
    esac
done
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
# Ctrl-C (or a SIGTERM) ends the script through its EXIT trap above, which says where the
# daemon's log is.
trap 'exit 130' INT TERM
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

if $jupyter; then
    # Jupyter's own tools from Debian: jupyter_client installs the kernelspecs, nbconvert
    # (through nbclient) starts each kernel from its kernelspec and runs every cell, as
    # JupyterLab would.
    # Debian's own Python: Debian's Jupyter packages are installed for it, whatever python3
    # comes first on PATH.
    py=/usr/bin/python3
    if [[ ! -x /usr/bin/jupyter-nbconvert ]] || ! $py -c 'import jupyter_client' 2>/dev/null; then
        echo "=== installing Jupyter's nbconvert and jupyter_client (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            jupyter-nbconvert python3-jupyter-client >/dev/null
    fi
    export JUPYTER_PATH="$run/jupyter/share/jupyter"
    PYTHONPATH="$PWD/clients/python/src" $py -m sandcell.jupyter install \
        --prefix "$run/jupyter" --sandcellctl "$BIN/sandcellctl"
    mkdir -p "$run/notebooks"
    for nb in examples/notebooks/*.ipynb; do
        echo
        echo "=== jupyter nbconvert --execute $nb (kernel $($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["metadata"]["kernelspec"]["name"])' "$nb"))"
        out="$run/notebooks/$(basename "$nb")"
        if /usr/bin/jupyter-nbconvert --to notebook --execute --output-dir "$run/notebooks" "$nb" 2>"$out.log"; then
            $py - "$out" <<'PY'
import base64, json, sys
nb = json.load(open(sys.argv[1]))
for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            text = "".join(o["text"]).rstrip()
            print(f"[{i + 1}] {o['name']}: " + text.replace("\n", "\n    "))
        elif o["output_type"] in ("display_data", "execute_result"):
            data = o["data"]
            if "image/png" in data:
                png = base64.b64decode("".join(data["image/png"]))
                print(f"[{i + 1}] image/png, {len(png)} bytes, PNG signature "
                      f"{'ok' if png[:8] == bytes.fromhex('89504e470d0a1a0a') else 'MISSING'}")
            else:
                text = "".join(data.get("text/plain", "")).rstrip()
                print(f"[{i + 1}] {o['output_type']} ({', '.join(sorted(data))}): "
                      + text.replace("\n", "\n    "))
        elif o["output_type"] == "error":
            print(f"[{i + 1}] error: {o['ename']}: {o['evalue']}")
print(f"executed notebook: {sys.argv[1]}")
PY
        else
            echo "(nbconvert failed, exit status $?; its log: $out.log)"
            tail -5 "$out.log" || true
        fi
    done
fi

if $serve; then
    echo
    echo "=== sandcelld keeps running (Ctrl-C stops it). In another shell:"
    echo "export SANDCELL_SOCKET=$sock"
    echo "export PATH=$BIN:\$PATH"
    if $jupyter; then
        echo "export JUPYTER_PATH=$JUPYTER_PATH    # the sandcell kernelspecs, for jupyter notebook / lab"
    fi
    wait $activator || true
fi
