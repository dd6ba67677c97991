"""Fixtures for the MCP server's tests: a real sandcelld (the Python client's fixture,
clients/python/tests/conftest.py: systemd-socket-activate, built workers, a private state
directory and cgroup name, as root) and the path of the built sandcellctl.

Run with the pinned MCP SDK venv (scripts/mcp-venv.sh) by scripts/test-mcp.sh.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "sandcell_daemon_fixture", ROOT / "clients/python/tests/conftest.py"
)
_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixture)

Daemon = _fixture.Daemon
ROOMY = _fixture.ROOMY
BIN = _fixture.BIN
daemon_factory = _fixture.daemon_factory  # re-exported as this directory's fixture


@pytest.fixture(scope="session")
def socket_path(daemon_factory) -> str:
    given = os.environ.get("SANDCELL_TEST_SOCKET")
    if given:
        return given
    return daemon_factory("mcp", ROOMY).socket


@pytest.fixture(scope="session")
def sandcellctl() -> str:
    path = BIN / "sandcellctl"
    if not path.exists():
        if os.environ.get("SANDCELL_REQUIRE_DAEMON") == "1":
            pytest.fail(f"SANDCELL_REQUIRE_DAEMON=1 but there is no built sandcellctl at {path}")
        pytest.skip(f"no built sandcellctl at {path} (build the workspace first)")
    return str(path)
