#!/usr/bin/env bash
# The Jupyter kernels (clients/python/src/sandcell/jupyter) against a real sandcelld started
# by the tests (as scripts/test-python-client.sh does): jupyter_kernel_test's conformance tests
# for sandcell-python, sandcell-pydata and sandcell-r; nbclient executing examples/notebooks;
# interrupt, restart and a crashed worker through jupyter_client's KernelManager. Uses the
# pinned venv of scripts/jupyter-venv.sh (over Debian's ipykernel and jupyter_client). Needs
# scripts/setup.sh's build. The kernelspecs start the built sandcellctl's kernel;
# SANDCELL_JUPYTER_PYTHON_KERNEL=1 tests the ipykernel-based fallback instead. Exits non-zero
# on any failure, including "no tests collected".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
py=$(bash scripts/jupyter-venv.sh)
[[ $(id -u) -eq 0 ]] && export SANDCELL_REQUIRE_DAEMON=1
export SANDCELL_REQUIRE_JUPYTER=1
rc=0
PYTHONPATH="$PWD/clients/python/src" timeout 900 "$py" -m pytest -p no:cacheprovider -q -rs \
    clients/python/tests/test_jupyter.py || rc=$?
case $rc in
    0) echo "jupyter kernels: all tests passed" ;;
    5) echo "jupyter kernels: pytest collected no tests" >&2; exit 1 ;;
    124) echo "jupyter kernels: pytest timed out" >&2; exit 1 ;;
    *) echo "jupyter kernels: pytest failed (exit status $rc)" >&2; exit 1 ;;
esac
