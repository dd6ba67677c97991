"""Jupyter kernels backed by sandcell: ``sandcell-python``, ``sandcell-pydata`` and
``sandcell-r``.

Each kernel is a program the notebook user's Jupyter starts from a kernelspec; it speaks the
Jupyter messaging protocol (https://jupyter-client.readthedocs.io/en/stable/messaging.html)
on the connection file's sockets and maps it onto one sandcell session (see
:mod:`sandcell.jupyter.kernel`). ``python3 -m sandcell.jupyter install [--user|--prefix DIR]``
installs the kernelspecs.
"""

from __future__ import annotations

#: Kernel name -> (sandcell language, environment or None, display name, Jupyter language).
KERNELS: dict[str, tuple[str, str | None, str, str]] = {
    "sandcell-python": ("python", None, "Python (sandcell)", "python"),
    "sandcell-pydata": ("python", "pydata", "Python (sandcell pydata)", "python"),
    "sandcell-r": ("r", None, "R (sandcell)", "R"),
}

#: Environment variable a kernelspec sets to choose its kernel (a key of :data:`KERNELS`).
KERNEL_ENV = "SANDCELL_JUPYTER_KERNEL"


def kernelspec(name: str, python: str = "python3") -> dict[str, object]:
    """The ``kernel.json`` of kernel ``name``: started as ``python -m sandcell.jupyter -f
    {connection_file}``, told its kernel by :data:`KERNEL_ENV`, interrupted by message (an
    ``interrupt_request`` on the control channel becomes sandcell's ``Interrupt``; a
    signal to the kernel process would not reach the confined cell)."""
    _, _, display, language = KERNELS[name]
    return {
        "argv": [python, "-m", "sandcell.jupyter", "-f", "{connection_file}"],
        "display_name": display,
        "language": language,
        "interrupt_mode": "message",
        # ipykernel imports debugpy, which warns about frozen modules on every start.
        "env": {KERNEL_ENV: name, "PYDEVD_DISABLE_FILE_VALIDATION": "1"},
        "metadata": {"debugger": False},
    }


__all__ = ["KERNELS", "KERNEL_ENV", "kernelspec"]
