#!/usr/bin/env bash
# Installs the system packages sandcell needs on Debian 12, builds every binary (release), and
# prepares the Python runtime (Eryx, offline, from crates.io only). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

# R (and a font for text in plots) for the R worker; systemd for systemd-socket-activate and
# busctl; dbus and polkitd for the control-plane tests; util-linux (setpriv) and passwd
# (useradd) for tests that act as other users; lintian, groff, rpm and rpmlint for the package
# checks; procps for diagnostics; linux-libc-dev for the system-call numbers the unit-sandbox
# test tier reads (asm/unistd_64.h). The `pydata` environment (native CPython) uses Debian's
# scientific stack, and R cells get the most used CRAN packages Debian ships; fontconfig builds
# the font cache plots read. scripts/bench.sh puts the tools users would otherwise pick
# beside sandcell: a Jupyter ipykernel and IRkernel driven by jupyter_client, and a
# bubblewrap one-shot. iproute2 (ip) builds the private network the egress tests use.
packages=(r-base-core r-cran-jsonlite fonts-dejavu-core systemd dbus polkitd util-linux passwd
    lintian groff-base rpm rpmlint procps linux-libc-dev
    python3 python3-numpy python3-pandas python3-scipy python3-matplotlib python3-statsmodels
    python3-sklearn r-cran-ggplot2 r-cran-data.table fontconfig
    python3-ipykernel python3-jupyter-client r-cran-irkernel bubblewrap iproute2)
# The system-test tier (scripts/vm-test.sh) needs more; it installs them itself when run.
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Font caches built once per host, read-only to workers: no session rebuilds them on its first
# plot.
bash scripts/font-cache.sh

# The Jupyter test tools (jupyter_kernel_test, nbclient, nbformat), pinned, from PyPI.
bash scripts/jupyter-venv.sh >/dev/null
# mypy, pinned, from PyPI: the Python client's type check (mypy --strict).
bash scripts/mypy-venv.sh >/dev/null

echo "setup: building (release) into $CARGO_TARGET_DIR"
cargo build "${CARGO_FLAGS[@]}" --workspace

echo "setup: preparing the Python runtime in $SANDCELL_TEST_PYTHON_RUNTIME"
"$BIN/sandcell-python-runtime" prepare --out "$SANDCELL_TEST_PYTHON_RUNTIME" >/dev/null
# The pinned MCP clients `sandcellctl mcp`'s tests use (MCP Python SDK venv, MCP Inspector).
bash scripts/mcp-venv.sh
echo "setup: done"
