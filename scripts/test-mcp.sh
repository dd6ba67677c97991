#!/usr/bin/env bash
# `sandcellctl mcp` against a real sandcelld (started by the tests, as the Python client's tests
# start it): the official MCP Python SDK as the client over stdio, hand-written JSON-RPC for
# the hostile rows, and the MCP Inspector's --cli mode. The pinned clients come from
# scripts/mcp-venv.sh. Needs scripts/setup.sh's build. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/mcp-venv.sh
[[ $(id -u) -eq 0 ]] && export SANDCELL_REQUIRE_DAEMON=1
export CARGO_TARGET_DIR SANDCELL_CACHE SANDCELL_TEST_PYTHON_RUNTIME
PYTHONPATH="$PWD/clients/python/src" timeout 900 "$SANDCELL_CACHE/mcp-venv/bin/python" -m pytest \
    -p no:cacheprovider -q -rs "$@" tests/mcp
