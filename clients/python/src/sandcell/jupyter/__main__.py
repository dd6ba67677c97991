"""``python3 -m sandcell.jupyter``: with ``install``, installs the kernelspecs (sandcellctl's
Rust kernel; ``--python-kernel``: the ipykernel-based one); else runs the ipykernel-based
kernel (Jupyter starts it so, with ``-f CONNECTION_FILE``; the kernel is chosen by
``SANDCELL_JUPYTER_KERNEL``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import KERNELS, kernelspec


def install(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m sandcell.jupyter install",
                                description="Install the sandcell kernelspecs for Jupyter.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the user's Jupyter data dir")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels (a venv, a package)")
    p.add_argument("--sandcellctl", default="sandcellctl",
                   help="the sandcellctl the kernelspecs start (default: sandcellctl on PATH)")
    p.add_argument("--python-kernel", action="store_true",
                   help="install the ipykernel-based kernel instead of sandcellctl's")
    p.add_argument("--python", default="python3",
                   help="with --python-kernel, the interpreter the kernelspecs start "
                        "(default: python3 on PATH)")
    p.add_argument("--kernel", action="append", choices=sorted(KERNELS),
                   help="only this kernel (repeatable; default: all)")
    p.add_argument("--force", action="store_true",
                   help="install even when the sandcellctl the kernelspecs start is not found "
                        "(it may be installed later)")
    a = p.parse_args(argv)
    try:
        from jupyter_client.kernelspec import KernelSpecManager
    except ImportError:
        # One line, no traceback: the kernelspecs are installed through Jupyter's own
        # package, which this client does not depend on.
        print(f"{p.prog}: Jupyter's jupyter_client package is not installed for "
              f"{sys.executable}; install it first, e.g. `pip install jupyter_client` or "
              "`apt install python3-jupyter-client`", file=sys.stderr)
        return 1
    # Checked after jupyter_client: without it nothing can be installed at all.
    if not a.python_kernel and shutil.which(a.sandcellctl) is None:
        # Jupyter would start the kernel and fail with FileNotFoundError on every launch.
        what = (f"{a.sandcellctl!r} is not an executable file" if os.sep in a.sandcellctl
                else f"{a.sandcellctl!r} is not on PATH")
        advice = ("pass --sandcellctl /path/to/sandcellctl, or --python-kernel for the "
                  "ipykernel-based kernel (needs only this Python package and ipykernel)")
        if not a.force:
            print(f"{p.prog}: {what}, so the kernels could not start; {advice}; --force "
                  "installs anyway", file=sys.stderr)
            return 2
        print(f"{p.prog}: warning: {what}; the kernels will not start until it is "
              f"({advice})", file=sys.stderr)

    ksm = KernelSpecManager()
    for name in a.kernel or sorted(KERNELS):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "kernel.json"), "w", encoding="utf-8") as f:
                json.dump(kernelspec(name, a.python,
                                     None if a.python_kernel else a.sandcellctl), f, indent=1)
            dest = ksm.install_kernel_spec(d, name, user=a.user, prefix=a.prefix)
        print(f"installed {name} in {dest}")
    return 0


def write_specs(dest: str, python: str = "python3",
                sandcellctl: str | None = "sandcellctl") -> None:
    """Writes every kernelspec under ``dest/<name>/kernel.json`` (for packaging): the
    Rust kernel of ``sandcellctl``, or with ``sandcellctl=None`` the ipykernel-based one
    started by ``python`` (see :func:`kernelspec`)."""
    for name in sorted(KERNELS):
        d = os.path.join(dest, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        with open(os.path.join(d, "kernel.json"), "w", encoding="utf-8") as f:
            json.dump(kernelspec(name, python, sandcellctl), f, indent=1)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "install":
        return install(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "write-specs":
        # write-specs DIR [PYTHON] [SANDCELLCTL]; SANDCELLCTL "-": the ipykernel kernel.
        args = sys.argv[2:5]
        ctl = args[2] if len(args) > 2 else "sandcellctl"
        write_specs(args[0], args[1] if len(args) > 1 else "python3",
                    None if ctl == "-" else ctl)
        return 0
    from .kernel import launch

    launch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
