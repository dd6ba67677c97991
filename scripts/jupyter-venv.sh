#!/usr/bin/env bash
# The Jupyter test tools from PyPI, pinned, in a venv over Debian's Python:
# $SANDCELL_CACHE/jupyter-venv (--system-site-packages, so Debian's ipykernel, jupyter_client,
# pyzmq and numpy are the ones used). jupyter_kernel_test (the kernel conformance tests),
# nbclient and nbformat (executing the example notebooks) are not packaged by Debian 12.
# Idempotent: does nothing when the venv has the pinned versions. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh >/dev/null
py=/usr/bin/python3
venv="${SANDCELL_CACHE:-/var/tmp/sandcell-cache}/jupyter-venv"
pins=(jupyter_kernel_test==0.7.0 nbclient==0.10.0 nbformat==5.10.4)
stamp="$venv/.sandcell-pins"
if [[ -x $venv/bin/python && -f $stamp && $(cat "$stamp") == "${pins[*]}" ]]; then
    echo "$venv/bin/python"
    exit 0
fi
need=()
"$py" -c 'import ipykernel, jupyter_client' 2>/dev/null || need+=(python3-ipykernel python3-jupyter-client)
"$py" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if ((${#need[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi
rm -rf "$venv"
"$py" -m venv --system-site-packages "$venv" >&2
"$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}" >&2
echo "${pins[*]}" >"$stamp"
echo "$venv/bin/python"
