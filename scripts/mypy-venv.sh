#!/usr/bin/env bash
# mypy from PyPI, pinned, in a venv of its own over Debian's Python (no system site packages,
# so the check does not depend on what else the machine has): $SANDCELL_CACHE/mypy-venv.
# scripts/test-python-client.sh runs it on the Python client (mypy --strict). Idempotent:
# does nothing when the venv has the pinned version. Prints the venv's mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh >/dev/null
py=/usr/bin/python3
venv="${SANDCELL_CACHE:-/var/tmp/sandcell-cache}/mypy-venv"
pins=(mypy==2.4.1)
stamp="$venv/.sandcell-pins"
if [[ -x $venv/bin/mypy && -f $stamp && $(cat "$stamp") == "${pins[*]}" ]]; then
    echo "$venv/bin/mypy"
    exit 0
fi
if ! "$py" -c 'import ensurepip' 2>/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; }
fi
rm -rf "$venv"
"$py" -m venv "$venv" >&2
"$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}" >&2
echo "${pins[*]}" >"$stamp"
echo "$venv/bin/mypy"
