"""Fixtures: a real sandcelld, started as scripts/demo.sh starts it (systemd-socket-activate,
worker binaries from the build, a private state directory and cgroup name, as root).

``SANDCELL_TEST_SOCKET`` points the tests at a daemon that is already running instead (the
tests that need a daemon of their own, with other limits, then skip). Without root, a build
or systemd-socket-activate the daemon tests skip, saying why, unless
``SANDCELL_REQUIRE_DAEMON=1`` (set by scripts/test-python-client.sh when root) makes that a
failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import sandcell

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", "/var/tmp/sandcell-target"))
BIN = Path(os.environ.get("SANDCELL_BIN", TARGET / "release"))
RUNTIME = Path(
    os.environ.get(
        "SANDCELL_TEST_PYTHON_RUNTIME",
        Path(os.environ.get("SANDCELL_CACHE", "/var/tmp/sandcell-cache")) / "python-runtime",
    )
)

#: Room for 16 concurrent one-shot runs and the tests' sessions.
ROOMY = {
    "SANDCELL_MAX_CONCURRENT_SESSIONS": "24",
    "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES": str(24 * 128 * 1024 * 1024),
    "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES": str(24 * 1024 * 1024 * 1024),
    "SANDCELL_MAX_SESSIONS_PER_UID": "24",
    "SANDCELL_MAX_DETACHED_SESSIONS_PER_UID": "8",
    "SANDCELL_MAX_GUEST_MEMORY_BYTES_PER_UID": str(24 * 128 * 1024 * 1024),
    "SANDCELL_MAX_WORKER_MEMORY_BYTES_PER_UID": str(24 * 1024 * 1024 * 1024),
    "SANDCELL_MAX_START_BURST_PER_UID": "200",
}


class Daemon:
    """One sandcelld under systemd-socket-activate; ``socket`` is its Varlink socket."""

    def __init__(self, name: str, env: dict[str, str]):
        self.dir = Path(tempfile.mkdtemp(prefix=f"sandcell-pytest-{name}.", dir="/var/tmp"))
        self.dir.chmod(0o711)
        self.socket = str(self.dir / "org.sandcell.Kernel")
        self.log_path = self.dir / "daemon.log"
        full = {
            "SANDCELL_WORKER_DIR": str(BIN),
            "SANDCELL_PYTHON_RUNTIME_DIR": str(RUNTIME),
            "SANDCELL_STATE_DIR": str(self.dir / "state"),
            "SANDCELL_CGROUP_NAME": f"sandcell-pytest-{name}-{os.getpid()}",
            "SANDCELL_IDLE_EXIT_SECONDS": "0",
            "SANDCELL_NODE_ID": "node-a.example",
            # The capacity file in the private directory, never /run/sandcell/metrics.prom.
            "SANDCELL_METRICS_FILE": str(self.dir / "metrics.prom"),
            "SANDCELL_ADOPT_DIR": str(self.dir / "adopt"),
            **env,
        }
        args = ["systemd-socket-activate", "-l", self.socket, "--fdname=varlink"]
        for k, v in full.items():
            args += ["-E", f"{k}={v}"]
        args.append(str(BIN / "sandcelld"))
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(100):
            if os.path.exists(self.socket):
                break
            time.sleep(0.05)
        else:
            self.stop()
            pytest.fail(f"sandcelld's socket did not appear; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _why_no_daemon() -> str | None:
    if os.geteuid() != 0:
        return "sandcelld's tests run as root (cgroups, per-session uids)"
    if not (BIN / "sandcelld").exists():
        return f"no built sandcelld in {BIN} (run scripts/setup.sh)"
    if not (RUNTIME).exists():
        return f"no prepared Python runtime at {RUNTIME} (run scripts/setup.sh)"
    if shutil.which("systemd-socket-activate") is None:
        return "systemd-socket-activate is not installed"
    return None


@pytest.fixture(scope="session")
def daemon_factory():
    started: list[Daemon] = []

    def make(name: str, env: dict[str, str] | None = None) -> Daemon:
        why = _why_no_daemon()
        if why and os.environ.get("SANDCELL_REQUIRE_DAEMON") == "1":
            pytest.fail(f"SANDCELL_REQUIRE_DAEMON=1 but {why}")
        if why:
            pytest.skip(why)
        d = Daemon(name, env or {})
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
        if os.environ.get("SANDCELL_KEEP_TEST_DIRS") != "1":
            shutil.rmtree(d.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def socket_path(daemon_factory) -> str:
    given = os.environ.get("SANDCELL_TEST_SOCKET")
    if given:
        return given
    return daemon_factory("main", ROOMY).socket


@pytest.fixture
def client(socket_path):
    with sandcell.Client(socket_path) as c:
        yield c
