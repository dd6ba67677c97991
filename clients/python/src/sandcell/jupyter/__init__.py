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


def kernelspec(name: str, python: str = "python3",
               sandcellctl: str | None = "sandcellctl") -> dict[str, object]:
    """The ``kernel.json`` of kernel ``name``.

    With ``sandcellctl`` (a command or path; the default), the kernel is sandcellctl's
    Rust kernel, started as ``sandcellctl kernel -f {connection_file} --kernel NAME``: it
    answers ``kernel_info`` within milliseconds of its start and adds about a millisecond to
    a cell. With ``sandcellctl=None``, the ipykernel-based kernel of
    :mod:`sandcell.jupyter.kernel`, started as ``python -m sandcell.jupyter -f
    {connection_file}`` and told its kernel by :data:`KERNEL_ENV` (a fallback for machines
    without sandcellctl). Both are interrupted by message (an ``interrupt_request`` on the
    control channel becomes sandcell's ``Interrupt``; a signal to the kernel process would
    not reach the confined cell)."""
    _, _, display, language = KERNELS[name]
    spec: dict[str, object] = {
        "display_name": display,
        "language": language,
        "interrupt_mode": "message",
        "metadata": {"debugger": False},
    }
    if sandcellctl is not None:
        spec["argv"] = [sandcellctl, "kernel", "-f", "{connection_file}", "--kernel", name]
        spec["env"] = {}
    else:
        spec["argv"] = [python, "-m", "sandcell.jupyter", "-f", "{connection_file}"]
        # ipykernel imports debugpy, which warns about frozen modules on every start.
        spec["env"] = {KERNEL_ENV: name, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    return spec


__all__ = ["KERNELS", "KERNEL_ENV", "kernelspec"]
