"""``python3 -m sandcell.jupyter install`` on a machine without Jupyter: one line saying what
to install, a non-zero exit status, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Runs the module as ``python3 -m sandcell.jupyter install`` does, with jupyter_client made
# unimportable (``None`` in ``sys.modules`` fails its import as a missing package does).
RUN = (
    "import runpy, sys; sys.modules['jupyter_client'] = None; "
    "sys.argv = ['sandcell.jupyter', 'install', '--user']; "
    "runpy.run_module('sandcell.jupyter', run_name='__main__', alter_sys=True)"
)


def test_install_without_jupyter_client_says_what_to_install() -> None:
    p = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True,
                       env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "jupyter_client" in lines[0] and "install" in lines[0], lines[0]
    assert p.stdout == ""


def test_kernelspecs_start_sandcellctl_unless_the_python_kernel_is_asked_for() -> None:
    sys.path.insert(0, str(SRC))
    from sandcell.jupyter import KERNEL_ENV, kernelspec

    spec = kernelspec("sandcell-pydata")
    assert spec["argv"] == ["sandcellctl", "kernel", "-f", "{connection_file}",
                            "--kernel", "sandcell-pydata"]
    assert spec["interrupt_mode"] == "message"
    spec = kernelspec("sandcell-r", "/usr/bin/python3", None)
    assert spec["argv"] == ["/usr/bin/python3", "-m", "sandcell.jupyter", "-f",
                            "{connection_file}"]
    assert spec["env"][KERNEL_ENV] == "sandcell-r"
