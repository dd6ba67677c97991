#!/usr/bin/env bash
# The peers' MCP tools the MCP server's tests use as clients, pinned, in $SANDCELL_CACHE:
#   mcp-venv/  the official MCP Python SDK (PyPI `mcp`) in a venv of Debian's Python 3.11;
#   mcp-npm/   the MCP Inspector (npm @modelcontextprotocol/inspector, its --cli mode).
# The conformance suite (npm @modelcontextprotocol/conformance 0.1.16, still the latest) is not
# installed: `conformance server` requires `--url <url>` (its client is Streamable HTTP only,
# no stdio), and on Debian's Node 20 it does not load ("SyntaxError: The requested module 'fs'
# does not provide an export named 'globSync'": Node 22 API).
# Inspector 1.0.3 declares Node >= 22.7.5 but its --cli mode runs on Debian's Node 20 (the
# latest, 2.12.0, declares Node >= 22.19.0).
# Idempotent: a tree holding the pinned versions is kept. Called by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
MCP_PY_VERSION=2.3.0
INSPECTOR_VERSION=1.0.3
py=/usr/bin/python3   # Debian's Python 3.11 (a python3 on PATH may be another interpreter)

venv="$SANDCELL_CACHE/mcp-venv"
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mcp') != '$MCP_PY_VERSION')" 2>/dev/null; then
    echo "mcp-venv: installing mcp==$MCP_PY_VERSION into $venv"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "mcp==$MCP_PY_VERSION" pytest
fi

npmdir="$SANDCELL_CACHE/mcp-npm"
want="@modelcontextprotocol/inspector@$INSPECTOR_VERSION"
if [[ $(cat "$npmdir/.pinned" 2>/dev/null) != "$want" ]]; then
    command -v npm >/dev/null || {
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null ||
            { apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; }
    }
    echo "mcp-venv: installing $want into $npmdir"
    mkdir -p "$npmdir"
    # shellcheck disable=SC2086
    npm install --prefix "$npmdir" --no-audit --no-fund --loglevel=error $want
    echo "$want" >"$npmdir/.pinned"
fi
