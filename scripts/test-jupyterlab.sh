#!/usr/bin/env bash
# JupyterLab in a real browser on a sandcell kernel: starts sandcelld (socket-activated, as
# scripts/demo.sh does), JupyterLab from PyPI with the sandcell kernelspecs in a private
# Jupyter data directory, and drives Debian's headless Chromium through chromedriver and
# selenium to open a notebook on `sandcell-pydata`, run a cell that draws a matplotlib plot
# and one that shows a pandas DataFrame, and check that the image and the HTML table are in
# the page. Saves a screenshot under /var/tmp and prints its path.
#
# Installs what it needs: chromium and chromium-driver from Debian (apt-get, when missing);
# jupyterlab and selenium, pinned, from PyPI into $SANDCELL_CACHE/jupyterlab-venv (over
# Debian's Python with its site packages, so Debian's ipykernel and jupyter_client run the
# kernels, as scripts/jupyter-venv.sh does). Needs scripts/setup.sh's build. Exits non-zero
# when a check fails, and says which.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
t0=$(date +%s)

need=()
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
/usr/bin/python3 -c 'import ipykernel, jupyter_client' 2>/dev/null || need+=(python3-ipykernel python3-jupyter-client)
/usr/bin/python3 -c 'import matplotlib, pandas' 2>/dev/null || need+=(python3-matplotlib python3-pandas)
/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if ((${#need[@]})); then
    echo "== apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi

venv="$SANDCELL_CACHE/jupyterlab-venv"
pins=(jupyterlab==4.2.5 selenium==4.25.0)
stamp="$venv/.sandcell-pins"
if ! [[ -x $venv/bin/python && -f $stamp && $(cat "$stamp") == "${pins[*]}" ]]; then
    echo "== venv $venv: ${pins[*]}"
    rm -rf "$venv"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}"
    # No news pop-up over the notebook in the screenshot.
    mkdir -p "$venv/share/jupyter/lab/settings"
    echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' \
        >"$venv/share/jupyter/lab/settings/overrides.json"
    echo "${pins[*]}" >"$stamp"
fi
py="$venv/bin/python"
t_setup=$(date +%s)

run=$(mktemp -d /var/tmp/sandcell-jupyterlab.XXXXXX)
chmod 0711 "$run"
sock="$run/org.sandcell.Kernel"
mode=()
[[ $(id -u) -eq 0 ]] || mode=(--insecure-dev)
systemd-socket-activate -l "$sock" --fdname=varlink \
    -E SANDCELL_WORKER_DIR="$BIN" -E SANDCELL_PYTHON_RUNTIME_DIR="$SANDCELL_TEST_PYTHON_RUNTIME" \
    -E SANDCELL_STATE_DIR="$run/state" -E SANDCELL_CGROUP_NAME="sandcell-jupyterlab-$$" \
    -E SANDCELL_IDLE_EXIT_SECONDS=0 -E SANDCELL_METRICS_FILE="$run/metrics.prom" \
    -E SANDCELL_ADOPT_DIR="$run/adopt" \
    "$BIN/sandcelld" "${mode[@]}" 2>"$run/daemon.log" &
daemon=$!
lab=
keep=true
cleanup() {
    [[ -n $lab ]] && kill -TERM "$lab" 2>/dev/null && wait "$lab" 2>/dev/null
    kill -TERM "$daemon" 2>/dev/null
    wait "$daemon" 2>/dev/null || true
    # After the daemon: it unmounts its sessions' file systems as it stops.
    $keep || rm -rf "$run"
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || { echo "test-jupyterlab: sandcelld did not start; log: $run/daemon.log" >&2; exit 1; }

# The kernelspecs in a private data directory; the kernels run on the venv's interpreter with
# the client from this tree.
export JUPYTER_PATH="$run/jupyter" JUPYTER_CONFIG_DIR="$run/jupyter-config"
export JUPYTER_RUNTIME_DIR="$run/jupyter-runtime" SANDCELL_SOCKET="$sock"
export PYTHONPATH="$PWD/clients/python/src"
"$py" -m sandcell.jupyter write-specs "$JUPYTER_PATH/kernels" "$py" "$BIN/sandcellctl"
mkdir -p "$run/notebooks"
"$py" - "$run/notebooks/lab.ipynb" <<'EOF'
import sys
import nbformat
nb = nbformat.v4.new_notebook()
nb.metadata["kernelspec"] = {"name": "sandcell-pydata", "display_name": "Python (sandcell pydata)",
                             "language": "python"}
nb.cells = [
    nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\n"
                              "plt.plot([1, 4, 2, 5, 3], marker='o')\nplt.title('sandcell-pydata')\nplt.show()"),
    nbformat.v4.new_code_cell("import pandas as pd\n"
                              "pd.DataFrame({'engine': ['pydata', 'eryx', 'r'], 'cells': [3, 2, 1]})"),
]
nbformat.write(nb, sys.argv[1])
EOF

port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
token=$("$py" -c 'import secrets; print(secrets.token_hex(16))')
"$venv/bin/jupyter" lab --no-browser --allow-root --ip=127.0.0.1 --port="$port" \
    --IdentityProvider.token="$token" --ServerApp.root_dir="$run/notebooks" \
    --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
    >"$run/jupyterlab.log" 2>&1 &
lab=$!
for _ in $(seq 300); do
    curl -fsS "http://127.0.0.1:$port/api/status?token=$token" >/dev/null 2>&1 && break
    sleep 0.2
done
t_lab=$(date +%s)

shot="/var/tmp/sandcell-jupyterlab-$(date -u +%Y%m%dT%H%M%SZ).png"
rc=0
"$py" - "http://127.0.0.1:$port/lab/tree/lab.ipynb?token=$token" "$shot" <<'EOF' || rc=$?
import sys
import time
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import WebDriverWait
from selenium.webdriver.support import expected_conditions as EC

url, shot = sys.argv[1], sys.argv[2]
opts = webdriver.ChromeOptions()
opts.binary_location = "/usr/bin/chromium"
for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
    opts.add_argument(a)
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
ok = False
try:
    driver.get(url)
    wait = WebDriverWait(driver, 90)
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")))
    # The kernel is up when the toolbar's kernel name shows it and the status is idle.
    wait.until(lambda d: "sandcell" in d.find_element(
        By.CSS_SELECTOR, ".jp-Notebook-toolbar, .jp-NotebookPanel-toolbar").text.lower())
    first = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")[0]
    first.find_element(By.CSS_SELECTOR, ".jp-InputArea-prompt").click()
    t = time.monotonic()
    ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).send_keys(Keys.ENTER) \
        .key_up(Keys.SHIFT).perform()
    img = wait.until(EC.presence_of_element_located(
        (By.CSS_SELECTOR, ".jp-OutputArea-output img[src^='data:image/png']")))
    table = wait.until(EC.presence_of_element_located(
        (By.CSS_SELECTOR, ".jp-OutputArea-output table.dataframe, .jp-RenderedHTMLCommon table")))
    ran = time.monotonic() - t
    wait.until(lambda d: img.get_property("naturalWidth") > 0)
    width = img.get_property("naturalWidth")
    rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
    cells = [c.text for c in table.find_elements(By.CSS_SELECTOR, "tbody td")]
    print(f"image: {width} px wide; table: {len(rows)} rows {cells}; both cells in {ran:.1f} s")
    assert width >= 300, width
    assert len(rows) == 3 and "pydata" in cells and "eryx" in cells, cells
    ok = True
finally:
    driver.save_screenshot(shot)
    driver.quit()
sys.exit(0 if ok else 1)
EOF
t_end=$(date +%s)
echo "screenshot: $shot"
echo "times: setup $((t_setup - t0)) s, daemon and JupyterLab $((t_lab - t_setup)) s, browser $((t_end - t_lab)) s, total $((t_end - t0)) s"
if ((rc != 0)); then
    echo "test-jupyterlab: the page did not show the plot and the table; logs: $run/jupyterlab.log $run/daemon.log" >&2
    exit 1
fi
echo "jupyterlab: the plot and the DataFrame are in the page"
keep=false
