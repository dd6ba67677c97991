#!/usr/bin/env python3
"""The `pydata` environment (native CPython, confined) beside the tools users would otherwise
pick, all from Debian packages, one run, figures only (no assertions):

- sandcelld through its socket (the `sandcell` Python client in clients/python): session open
  cold and from a warm pool, the first `import pandas` cell of a fresh session, a trivial
  cell, and a one-shot `print(1)` cold and from the pool;
- a Jupyter ipykernel and an IRkernel driven by jupyter_client: kernel start, and the cell
  round trip of `print(1)` / `cat(1)` (execute request to the kernel's idle status);
- a bubblewrap one-shot `python3 -c 'print(1)'` (read-only /usr, no network, new pid space).

Then the ratios sandcell / peer (the goal: every sandcell figure at most a tenth of the
matching Jupyter one, and a warm-pool one-shot below the bubblewrap one).

Usage: bench_pydata.py --bin DIR --runtime DIR [--iterations N]
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "clients", "python", "src"))
import sandcell  # noqa: E402


def ms(samples):
    s = sorted(samples)
    return statistics.median(s) * 1000.0, s[min(len(s) - 1, int(len(s) * 0.99))] * 1000.0


def show(label, samples):
    p50, p99 = ms(samples)
    print("%-52s p50 %9.2f ms  p99 %9.2f ms  (n=%d)" % (label, p50, p99, len(samples)))
    return p50


class Daemon:
    def __init__(self, bindir, runtime, config_text, extra_env=None):
        self.dir = tempfile.mkdtemp(prefix="sandcell-bench-pydata.", dir="/var/tmp")
        os.chmod(self.dir, 0o711)
        self.sock = os.path.join(self.dir, "k.sock")
        conf = os.path.join(self.dir, "sandcelld.toml")
        with open(conf, "w") as f:
            f.write(config_text)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "SANDCELL_WORKER_DIR": bindir,
            "SANDCELL_PYTHON_RUNTIME_DIR": runtime,
            "SANDCELL_STATE_DIR": os.path.join(self.dir, "state"),
            "SANDCELL_CGROUP_NAME": "sandcell-bench-pydata-%d" % os.getpid(),
            "SANDCELL_LANGUAGES": "python",
            "SANDCELL_MAX_CONCURRENT_SESSIONS": "32",
            "SANDCELL_MAX_AGGREGATE_GUEST_MEMORY_BYTES": str(32 * 134217728),
            "SANDCELL_MAX_AGGREGATE_WORKER_MEMORY_BYTES": str(32 * 1073741824),
            "SANDCELL_MAX_STARTS_PER_SECOND_PER_UID": "1000",
            "SANDCELL_MAX_START_BURST_PER_UID": "1000",
            "SANDCELL_EXECUTION_WALL_TIME_SECONDS": "60",
            "SANDCELL_LOG": "info",
        }
        env.update(extra_env or {})
        args = [os.path.join(bindir, "sandcelld"), "--listen", self.sock, "--config", conf]
        if os.geteuid() != 0:
            args.insert(1, "--insecure-dev")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        t0 = time.time()
        while time.time() - t0 < 60:
            with open(self.log.name) as f:
                if "ready to serve" in f.read():
                    break
            if self.proc.poll() is not None:
                raise SystemExit("sandcelld exited: " + open(self.log.name).read()[-2000:])
            time.sleep(0.05)
        self.client = sandcell.Client(self.sock)

    def wait_log(self, text, count, timeout=60.0):
        t0 = time.time()
        while time.time() - t0 < timeout:
            with open(self.log.name) as f:
                if f.read().count(text) >= count:
                    return True
            time.sleep(0.05)
        return False

    def stop(self):
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_sandcell(bindir, runtime, n):
    fig = {}
    print("== sandcelld, pydata environment (native CPython, confined), no pool")
    d = Daemon(bindir, runtime, "")
    c = d.client
    opens, imports, trivial, oneshot = [], [], [], []
    for _ in range(max(5, n // 10)):
        t0 = time.perf_counter()
        s = c.session("python", "pydata")
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = s.execute("import pandas")
        imports.append(time.perf_counter() - t0)
        assert r.status == "ok", r
        s.close()
    s = c.session("python", "pydata")
    s.execute("x = 1")
    for _ in range(n):
        t0 = time.perf_counter()
        r = s.execute("x")
        trivial.append(time.perf_counter() - t0)
        assert r.stdout == "1\n", r
    s.close()
    for _ in range(max(5, n // 10)):
        t0 = time.perf_counter()
        r = c.run("print(1)", "python", "pydata")
        oneshot.append(time.perf_counter() - t0)
        assert r.stdout == "1\n", r
    fig["open_cold"] = show("open (cold: start + confine + Ready)", opens)
    fig["import_pandas"] = show("first `import pandas` cell of a session", imports)
    fig["trivial"] = show("trivial cell (`x`) in a session", trivial)
    fig["oneshot_cold"] = show("one-shot Run print(1), cold", oneshot)
    d.stop()

    print("== sandcelld, pydata environment, warm pool (pool_min 4, pool_max 8)")
    conf = '[environments.pydata]\nlanguage = "python"\nengine = "native"\npool_min = 4\npool_max = 8\n'
    d = Daemon(bindir, runtime, conf, {"SANDCELL_POOL_REFILL_PER_SECOND": "200"})
    c = d.client
    d.wait_log("warm worker ready", 4)
    opens, oneshot = [], []
    for i in range(max(5, n // 10)):
        time.sleep(0.4)  # let the pool refill: this measures a take, not a start
        t0 = time.perf_counter()
        s = c.session("python", "pydata")
        opens.append(time.perf_counter() - t0)
        s.close()
    for _ in range(max(5, n // 10)):
        time.sleep(0.4)
        t0 = time.perf_counter()
        r = c.run("print(1)", "python", "pydata")
        oneshot.append(time.perf_counter() - t0)
        assert r.stdout == "1\n", r
    fig["open_pool"] = show("open (from the warm pool)", opens)
    fig["oneshot_pool"] = show("one-shot Run print(1), from the warm pool", oneshot)
    d.stop()

    print("== sandcelld, pydata with pandas preloaded, warm pool")
    conf = ('[environments.pydata]\nlanguage = "python"\nengine = "native"\n'
            'preload = ["numpy", "pandas"]\npool_min = 2\npool_max = 4\n')
    d = Daemon(bindir, runtime, conf, {"SANDCELL_POOL_REFILL_PER_SECOND": "200"})
    c = d.client
    d.wait_log("warm worker ready", 2)
    imports = []
    for _ in range(5):
        time.sleep(1.0)
        s = c.session("python", "pydata")
        t0 = time.perf_counter()
        s.execute("import pandas")
        imports.append(time.perf_counter() - t0)
        s.close()
    fig["import_pandas_preloaded"] = show("`import pandas` cell, preloaded pooled worker", imports)
    d.stop()
    return fig


def bench_jupyter(kernel, code, n):
    try:
        import jupyter_client
    except ImportError:
        print("(skipped: python3-jupyter-client is not installed)")
        return None
    starts, cells = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            km, kc = jupyter_client.manager.start_new_kernel(kernel_name=kernel, startup_timeout=60)
        except Exception as e:  # noqa: BLE001
            print("(skipped: kernel %s: %s)" % (kernel, e))
            return None
        starts.append(time.perf_counter() - t0)
        if len(starts) < 3:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    for _ in range(n):
        t0 = time.perf_counter()
        msg_id = kc.execute(code)
        while True:
            m = kc.get_iopub_msg(timeout=30)
            if (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                    and m["content"]["execution_state"] == "idle"):
                break
        cells.append(time.perf_counter() - t0)
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    return (show("%s kernel start (until ready)" % kernel, starts),
            show("%s cell round trip %r" % (kernel, code), cells))


def bench_bwrap(n):
    bwrap = shutil.which("bwrap")
    if not bwrap:
        print("(skipped: bubblewrap is not installed)")
        return None
    args = [bwrap, "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--unshare-all",
            "--die-with-parent", "--new-session", "/usr/bin/python3", "-I", "-c", "print(1)"]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = subprocess.run(args, capture_output=True, check=True).stdout
        samples.append(time.perf_counter() - t0)
        assert out == b"1\n", out
    return show("bubblewrap + python3 -c 'print(1)' one-shot", samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    a = ap.parse_args()
    n = a.iterations
    fig = bench_sandcell(a.bin, a.runtime, n)
    print("== peers (Debian packages)")
    py = bench_jupyter("python3", "print(1)", n)
    ir = bench_jupyter("ir", "cat(1)", n)
    bw = bench_bwrap(max(10, n // 2))
    print("== ratios (sandcell pydata / peer; goal <= 0.10 for Jupyter, < 1 for bubblewrap)")

    def ratio(label, mine, theirs):
        if theirs:
            print("%-60s %8.3f" % (label, mine / theirs))

    if py:
        ratio("open cold / ipykernel start", fig["open_cold"], py[0])
        ratio("open from pool / ipykernel start", fig["open_pool"], py[0])
        ratio("first import pandas cell / ipykernel start", fig["import_pandas"], py[0])
        ratio("trivial cell / ipykernel cell", fig["trivial"], py[1])
    if ir:
        ratio("open from pool / IRkernel start", fig["open_pool"], ir[0])
        ratio("trivial cell / IRkernel cell", fig["trivial"], ir[1])
    if bw:
        ratio("one-shot cold / bubblewrap one-shot", fig["oneshot_cold"], bw)
        ratio("one-shot from pool / bubblewrap one-shot", fig["oneshot_pool"], bw)


if __name__ == "__main__":
    main()
