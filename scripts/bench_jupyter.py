#!/usr/bin/env python3
"""The sandcell-pydata Jupyter kernel beside Debian's ipykernel, through the same
jupyter_client code path (scripts/bench_pydata.py's bench_jupyter): kernel start (until it
answers kernel_info), the cell round trip of `print(1)` (execute request to the kernel's
idle status), and the wall time nbclient takes for examples/notebooks/pydata-regression.ipynb
on each kernel. Figures only, one run, no assertions; the goal: the sandcell kernel's round
trip at most ipykernel's, its start at most a tenth of it.

Usage (with scripts/jupyter-venv.sh's python, for nbclient):
    bench_jupyter.py --bin DIR --runtime DIR [--iterations N]
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "clients", "python", "src")
sys.path.insert(0, HERE)
sys.path.insert(0, SRC)
from bench_pydata import Daemon, bench_jupyter  # noqa: E402
from sandcell.jupyter.__main__ import write_specs  # noqa: E402


def start_to_kernel_info(kernel, n=5):
    """Kernel start as start_new_kernel times it, less wait_for_ready's closing wait: from
    KernelManager.start_kernel until a kernel_info_reply and a status on iopub (what
    wait_for_ready waits for before it drains iopub until 0.2 s pass without a message, a
    fixed 0.2 s in jupyter_client 7 and 8 whatever the kernel)."""
    import queue

    import jupyter_client

    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        km = jupyter_client.KernelManager(kernel_name=kernel)
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            while True:
                kc.kernel_info()
                try:
                    if kc.get_shell_msg(timeout=1)["msg_type"] != "kernel_info_reply":
                        continue
                    kc.get_iopub_msg(timeout=0.2)
                    break
                except queue.Empty:
                    continue
            samples.append(time.perf_counter() - t0)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    samples.sort()
    p50 = samples[len(samples) // 2]
    print("%-52s p50 %9.2f ms  (n=%d)" % ("%s start until kernel_info_reply" % kernel,
                                            p50 * 1e3, n))
    return p50


def notebook_seconds(kernel):
    try:
        import nbclient
        import nbformat
    except ImportError:
        print("(nbclient skipped: run scripts/jupyter-venv.sh)")
        return None
    nb = nbformat.read(os.path.join(HERE, "..", "examples", "notebooks",
                                    "pydata-regression.ipynb"), as_version=4)
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel).execute()
    s = time.perf_counter() - t0
    print("%-52s %9.2f s" % ("nbclient pydata-regression.ipynb on %s" % kernel, s))
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    a = ap.parse_args()
    # A warm pool, as a deployment serving notebooks would keep: a kernel start takes a worker.
    conf = '[environments.pydata]\nlanguage = "python"\nengine = "native"\npool_min = 4\npool_max = 8\n'
    d = Daemon(a.bin, a.runtime, conf, {"SANDCELL_POOL_REFILL_PER_SECOND": "200"})
    d.wait_log("warm worker ready", 4)
    specs = tempfile.mkdtemp(prefix="sandcell-bench-jupyter.", dir="/var/tmp")
    # sandcellctl's Rust kernel, built beside the daemon.
    write_specs(os.path.join(specs, "kernels"), sys.executable,
                os.path.join(os.path.abspath(a.bin), "sandcellctl"))
    os.environ["JUPYTER_PATH"] = specs
    os.environ["SANDCELL_SOCKET"] = d.sock
    os.environ["PYTHONPATH"] = os.path.abspath(SRC)
    try:
        print("== Jupyter kernels through jupyter_client: sandcell-pydata beside ipykernel")
        mine = bench_jupyter("sandcell-pydata", "print(1)", a.iterations)
        theirs = bench_jupyter("python3", "print(1)", a.iterations)
        ki_mine = start_to_kernel_info("sandcell-pydata")
        ki_theirs = start_to_kernel_info("python3")
        nb_mine = notebook_seconds("sandcell-pydata")
        nb_theirs = notebook_seconds("python3")
    finally:
        d.stop()
    print("== ratios (sandcell-pydata / ipykernel; goal: start <= 0.10, round trip <= 1)")
    if mine and theirs:
        print("%-60s %8.3f" % ("kernel start", mine[0] / theirs[0]))
        print("%-60s %8.3f" % ("cell round trip", mine[1] / theirs[1]))
    print("%-60s %8.3f" % ("kernel start until kernel_info_reply", ki_mine / ki_theirs))
    if nb_mine and nb_theirs:
        print("%-60s %8.3f" % ("nbclient pydata notebook", nb_mine / nb_theirs))


if __name__ == "__main__":
    main()
