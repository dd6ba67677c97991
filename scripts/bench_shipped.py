#!/usr/bin/env python3
"""sandcelld with the shipped defaults (no configuration file, no pool or budget override)
beside the tools users would otherwise pick, in one run; figures only, no assertions.

For each environment (`python` = Eryx, `pydata` = native CPython with numpy, pandas and
matplotlib preloaded, `r`), through `sandcell-bench` on the daemon's socket:
- one-shot Run of a trivial cell (`print(1)` / `cat(1, '\\n')`),
- open + trivial cell + close,
- a trivial cell in an open session,
each as p50, p99 and max. One-shot and open samples are paced (`--pace-ms`, default 300: the
shipped refill rate is 4 warm workers a second, and the shipped start rate of one uid 20 a
second), so they measure a request that finds its warm worker, as a gateway's calls spread
over time do; `--pace-ms 0` measures back-to-back requests instead.

Beside them: bubblewrap + python3 one-shot, Jupyter ipykernel and IRkernel cells (via
jupyter_client), Rscript start; then the ratios, and the memory of each warm worker (its
session cgroup's memory use and its processes' RSS) and the daemon's idle RSS.

Usage: bench_shipped.py --bin DIR --runtime DIR [--iterations N] [--paced-iterations P]
                        [--pace-ms MS] [--daemon-bin DIR] [--json-out FILE]
  --iterations N     samples of each session-cell figure and of each peer (default 10000;
                     Rscript's start within 5 to 200)
  --paced-iterations P
                     samples of each one-shot and open + cell + close figure (default N).
                     Every such sample takes a new warm worker, and the refill starts at most
                     4 a second (pool_refill_per_second), so six series of P samples take at
                     least 6 x P x pace: P = 10000 at 300 ms is five hours
  --json-out FILE    also write the figures as JSON (read by bench_summary.py, whose table
                     ends scripts/bench.sh's output: see summary_table())
  --daemon-bin DIR   sandcelld and its workers from DIR instead of --bin (to compare a build
                     of another revision measured by this sandcell-bench)
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time


ENVS = [("python", "python"), ("pydata", "python"), ("r", "r")]


def stats(samples):
    """p50, p99 and max of `samples` (seconds) in ms."""
    s = sorted(samples)
    pick = lambda p: s[min(len(s) - 1, round((len(s) - 1) * p))] * 1000.0  # noqa: E731
    return pick(0.5), pick(0.99), s[-1] * 1000.0


def line(label, p50, p99, mx, n):
    print("%-50s p50 %8.2f  p99 %8.2f  max %8.2f ms  (n=%d)" % (label, p50, p99, mx, n))


def rss_kib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return 0


def session_groups(name):
    """Session cgroup directories of the daemon whose v1 `cgroup_name` is `name`, or of the
    v2 delegated root (the service's own group, found from the daemon's pid by the caller)."""
    v1 = "/sys/fs/cgroup/memory/%s/sessions" % name
    if os.path.isdir(v1):
        return v1, "memory.usage_in_bytes"
    return None, None


def group_memory(path, file):
    try:
        with open(os.path.join(path, file)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def group_rss_kib(path):
    total = 0
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            for p in f.read().split():
                total += rss_kib(int(p))
    except OSError:
        pass
    return total


def daemon_env(bindir, runtime, run_dir, cgroup, adopt, log):
    """The environment of a bench's sandcelld: this checkout's workers and Python runtime, the
    state directory and metrics file in `run_dir`, the cgroup name `cgroup`, the adoption
    directory `adopt` and the log filter `log`."""
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "SANDCELL_WORKER_DIR": bindir,
        "SANDCELL_PYTHON_RUNTIME_DIR": runtime,
        "SANDCELL_STATE_DIR": os.path.join(run_dir, "state"),
        "SANDCELL_CGROUP_NAME": cgroup,
        "SANDCELL_METRICS_FILE": os.path.join(run_dir, "metrics.prom"),
        "SANDCELL_ADOPT_DIR": adopt,
        "SANDCELL_LOG": log,
    }


class LogWatch:
    """Reading a daemon's log file (`self.log`) while its process (`self.proc`) runs."""

    def text(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_log(self, text, count, timeout):
        """Whether `text` appears `count` times within `timeout` seconds (False at once when
        the process has exited)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.text().count(text) >= count:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False


class Daemon(LogWatch):
    """sandcelld with the shipped defaults: no configuration file; only the paths of this
    checkout, a private state directory and cgroup name, and the socket are set."""

    def __init__(self, bindir, runtime):
        self.dir = tempfile.mkdtemp(prefix="sandcell-bench-shipped.", dir="/var/tmp")
        os.chmod(self.dir, 0o711)
        self.sock = os.path.join(self.dir, "k.sock")
        self.cgroup = "sandcell-bench-shipped-%d" % os.getpid()
        # The session records live where the shipped adopt_dir does, on tmpfs (/run under
        # systemd): on a disk file system (ext4 here) each cell's three record writes
        # (rename over the old record, which starts its writeback) cost milliseconds and made
        # the session cells' p50 and p99 five to ten times what they are on tmpfs.
        self.adopt = tempfile.mkdtemp(prefix="sandcell-bench-adopt.", dir="/dev/shm")
        env = daemon_env(bindir, runtime, self.dir, self.cgroup, self.adopt, "info")
        conf = os.path.join(self.dir, "sandcelld.toml")
        with open(conf, "w") as f:
            f.write("# empty: every key at its shipped default\n")
        args = [os.path.join(bindir, "sandcelld"), "--listen", self.sock, "--config", conf]
        if os.geteuid() != 0:
            args.insert(1, "--insecure-dev")
        self.log = os.path.join(self.dir, "daemon.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)
        if not self.wait_log("ready to serve", 1, 60):
            raise SystemExit("sandcelld did not start: " + self.text()[-2000:])

    def warm(self):
        """session id -> environment of the warm workers started so far."""
        out = {}
        for m in re.finditer(r"warm worker ready.*", self.text()):
            env = re.search(r"environment=(\S+)", m.group(0))
            sid = re.search(r"session=(\S+)", m.group(0))
            if env and sid:
                out[sid.group(1)] = env.group(1)
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.adopt, ignore_errors=True)


def pool_memory(d, envs):
    """Memory of each warm worker after the pools filled: (environment -> list of (cgroup
    bytes, RSS KiB)), and the daemon's RSS (KiB)."""
    want = len(envs)
    t0 = time.time()
    while time.time() - t0 < 120 and len(set(d.warm().values())) < want:
        time.sleep(0.2)
    time.sleep(2.0)  # let the last one settle after Ready
    root, file = session_groups(d.cgroup)
    per = {}
    for sid, env in d.warm().items():
        path = os.path.join(root, sid) if root else None
        if not path or not os.path.isdir(path):
            continue  # taken or retired meanwhile
        per.setdefault(env, []).append((group_memory(path, file), group_rss_kib(path)))
    return per, rss_kib(d.proc.pid)


def bench_env(bindir, sock, env, lang, n, paced, pace_ms):
    out = subprocess.run(
        [os.path.join(bindir, "sandcell-bench"), "--socket", sock, "--language", lang,
         "--environment", env, "--iterations", str(paced), "--cells", str(n),
         "--pace-ms", str(pace_ms),
         "--clients", "0", "--sessions", "0", "--idle-sessions", "0"],
        capture_output=True, text=True)
    figs = {}
    for ln in out.stdout.splitlines():
        if ln.startswith("{"):
            j = json.loads(ln)
            figs[j["figure"]] = j
    if out.returncode != 0:
        print("(sandcell-bench failed for %s: %s)" % (env, out.stderr.strip()[-500:]))
    return figs


def bench_rscript(n):
    if not shutil.which("Rscript"):
        print("(skipped: Rscript is not installed)")
        return None
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["Rscript", "-e", "cat(1)"], capture_output=True, check=True)
        samples.append(time.perf_counter() - t0)
    p = stats(samples)
    line("Rscript -e 'cat(1)' start", *p, len(samples))
    return p + (len(samples),)


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
    p = stats(samples)
    line("bubblewrap + python3 -I -c 'print(1)'", *p, len(samples))
    return p + (len(samples),)


def bench_jupyter(kernel, code, n):
    try:
        import jupyter_client
    except ImportError:
        print("(skipped: python3-jupyter-client is not installed)")
        return None
    # ipykernel's debugger warns about frozen modules on every start; the warning is noise here.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    try:
        km, kc = jupyter_client.manager.start_new_kernel(kernel_name=kernel, startup_timeout=60)
    except Exception as e:  # noqa: BLE001
        print("(skipped: kernel %s: %s)" % (kernel, e))
        return None
    cells = []
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
    p = stats(cells)
    line("%s kernel cell %r" % (kernel, code), *p, len(cells))
    return p + (len(cells),)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--paced-iterations", type=int)
    ap.add_argument("--pace-ms", type=int, default=300)
    ap.add_argument("--daemon-bin")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    n = a.iterations
    paced = n if a.paced_iterations is None else a.paced_iterations

    load0 = loadavg()
    print("== sandcelld, shipped defaults (no configuration file), %d session cells and peer "
          "samples, %d one-shot and open samples paced %d ms; load %s"
          % (n, paced, a.pace_ms, load0))
    d = Daemon(a.daemon_bin or a.bin, a.runtime)
    try:
        idle_rss = rss_kib(d.proc.pid)
        per, rss_pools = pool_memory(d, [e for e, _ in ENVS])
        print("-- warm workers after start (pool sizes derived from this machine)")
        for env, rows in sorted(per.items()):
            for mem, rss in rows:
                print("warm worker %-8s session cgroup %s MiB, RSS %.1f MiB" % (
                    env, "%.1f" % (mem / 2**20) if mem is not None else "?", rss / 1024.0))
        print("daemon RSS: %.1f MiB at ready, %.1f MiB with the pools full" % (
            idle_rss / 1024.0, rss_pools / 1024.0))
        figs = {}
        for env, lang in ENVS:
            f = bench_env(a.bin, d.sock, env, lang, n, paced, a.pace_ms)
            figs[env] = f
            for key, label in [("oneshot_latency", "one-shot Run"),
                               ("open_cell_close_latency", "open + cell + close"),
                               ("session_cell_latency", "session cell")]:
                if key in f:
                    j = f[key]
                    line("%s %s" % (env, label), j["p50"], j["p99"], j.get("max", float("nan")),
                         j["samples"])
    finally:
        d.stop()

    print("== peers (Debian packages), same run")
    bw = bench_bwrap(n)
    ipy = bench_jupyter("python3", "print(1)", n)
    ir = bench_jupyter("ir", "cat(1)", n)
    rs = bench_rscript(max(5, min(n, 200)))

    result = {
        "iterations": n, "paced_iterations": paced, "pace_ms": a.pace_ms, "loadavg": load0,
        "envs": {env: {k: {q: f[k].get(q) for q in ("p50", "p99", "max", "samples")}
                       for k in FIGURES if k in f} for env, f in figs.items()},
        "peers": {k: v for k, v in [("bwrap", bw), ("ipykernel", ipy), ("irkernel", ir),
                                     ("rscript", rs)] if v},
    }
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f)
    print_ratios(result)


GOALS = ("one-shot <= bubblewrap for python and pydata, R one-shot <= 0.1 x Rscript start, "
         "cell p99 <= 3 x its p50")


def ratio_rows(result):
    """(label, ratio or None, goal or None) of the goals and comparisons, from `result` (the
    JSON --json-out writes)."""
    envs, peers = result.get("envs", {}), result.get("peers", {})

    def fig(env, key, q="p50"):
        return envs.get(env, {}).get(key, {}).get(q)

    def peer(name):
        p = peers.get(name)
        return p[0] if p else None

    def ratio(label, mine, theirs, goal=None):
        return (label, mine / theirs if mine is not None and theirs else None, goal)

    rows = []
    for env in ("python", "pydata"):
        rows.append(ratio("%s one-shot / bubblewrap one-shot" % env,
                          fig(env, "oneshot_latency"), peer("bwrap"), 1.0))
    rows.append(ratio("r one-shot / Rscript start", fig("r", "oneshot_latency"),
                      peer("rscript"), 0.1))
    for env, _ in ENVS:
        rows.append(ratio("%s session cell p99 / its p50" % env,
                          fig(env, "session_cell_latency", "p99"),
                          fig(env, "session_cell_latency"), 3.0))
    for env in ("python", "pydata"):
        rows.append(ratio("%s session cell / ipykernel cell" % env,
                          fig(env, "session_cell_latency"), peer("ipykernel")))
    rows.append(ratio("r session cell / IRkernel cell", fig("r", "session_cell_latency"),
                      peer("irkernel")))
    return rows


def print_ratios(result):
    print("== ratios (p50 unless said; goals: %s)" % GOALS)
    for label, r, goal in ratio_rows(result):
        if r is None:
            print("%-62s (figure missing)" % label)
            continue
        verdict = "" if goal is None else ("  met" if r <= goal else "  missed")
        print("%-62s %8.3f%s" % (label, r, verdict))


def summary_table(result):
    """The one table that ends scripts/bench.sh: p50, p99 and max (ms) of each environment's
    one-shot Run, open + cell + close and session cell with the shipped defaults, the peers of
    the same run, then the goals' ratios with met/missed."""
    print("== summary: shipped defaults, %s session cells and peer samples, %s one-shot and "
          "open samples paced %s ms; load before the run %s"
          % (result.get("iterations"), result.get("paced_iterations", result.get("iterations")),
             result.get("pace_ms"), result.get("loadavg", "?")))
    print("%-40s %9s %9s %9s %8s" % ("figure (ms)", "p50", "p99", "max", "n"))
    for env, _ in ENVS:
        for key, label in FIGURES.items():
            j = result.get("envs", {}).get(env, {}).get(key)
            if j:
                print("%-40s %9.2f %9.2f %9.2f %8d" % ("%s %s" % (env, label), j["p50"],
                      j["p99"], j["max"] if j["max"] is not None else float("nan"),
                      j["samples"]))
            else:
                print("%-40s (figure missing)" % ("%s %s" % (env, label)))
    for name, label in PEERS.items():
        p = result.get("peers", {}).get(name)
        if p:
            print("%-40s %9.2f %9.2f %9.2f %8d" % (label, p[0], p[1], p[2], p[3]))
        else:
            print("%-40s (not run)" % label)
    print("%-62s %8s  goal" % ("ratio (p50 unless said)", ""))
    for label, r, goal in ratio_rows(result):
        if r is None:
            print("%-62s (figure missing)" % label)
        else:
            verdict = "" if goal is None else ("  <= %-4g %s" % (goal, "met" if r <= goal
                                                               else "missed"))
            print("%-62s %8.3f%s" % (label, r, verdict))


FIGURES = {"oneshot_latency": "one-shot Run", "open_cell_close_latency": "open + cell + close",
           "session_cell_latency": "session cell"}
PEERS = {"bwrap": "bubblewrap + python3 one-shot", "ipykernel": "ipykernel cell 'print(1)'",
         "irkernel": "IRkernel cell 'cat(1)'", "rscript": "Rscript -e 'cat(1)' start"}


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"

if __name__ == "__main__":
    main()
