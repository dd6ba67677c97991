#!/usr/bin/env python3
"""The latency targets from one scripts/bench.sh run: each figure beside its bare baseline, the
ratio, and whether the target is met. Figures only; nothing here fails a build.

Usage: bench_summary.py BENCH_LOG ERYX_JSON [SHIPPED_JSON]
  BENCH_LOG  everything bench.sh printed (its "== sandcelld, <language>, <label>" headers
             followed by sandcell-bench's JSON lines, the bare R worker's figures line, the
             Rscript start times and the confinement bench)
  ERYX_JSON  the JSON object `sandcell-python-runtime bench` printed
  SHIPPED_JSON  the figures bench_shipped.py --json-out wrote: printed first, as one table of
             p50, p99 and max per environment beside the peers, with the goals' ratios
"""
import os
import json
import re
import statistics
import sys


def main():
    if len(sys.argv) > 3:
        shipped_summary(sys.argv[3])
    if len(sys.argv) < 3 or not os.path.exists(sys.argv[2]):
        return
    log_path, eryx_path = sys.argv[1], sys.argv[2]
    with open(eryx_path) as f:
        eryx = json.load(f)
    runs = {}  # (language, label) -> {figure: json}
    section = None
    rscript = []
    bare_r = None
    enter_us = None
    lines = open(log_path, encoding="utf-8", errors="replace").read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"== sandcelld, (\w+), (.*)$", line)
        if m:
            section = (m.group(1), m.group(2))
            runs[section] = {}
            continue
        if line.startswith("== "):
            section = None
        if line.startswith("== Rscript") and i + 1 < len(lines):
            rscript = [float(x) for x in lines[i + 1].split()]
        m = re.search(r"trivial cell p50 ([0-9.]+)(µs|ms)", line)
        if m:
            bare_r = float(m.group(1)) / (1000.0 if m.group(2) == "µs" else 1.0)
        m = re.search(r"native, netns\+ipc: .*enter\(\) ([0-9]+) us", line)
        if m:
            enter_us = int(m.group(1))
        if section and line.startswith("{"):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            runs[section].setdefault(j.get("figure"), j)

    def fig(lang, label_start, name, key="p50"):
        for (l, label), figs in runs.items():
            if l == lang and label.startswith(label_start) and name in figs:
                return figs[name].get(key)
        return None

    fresh = eryx.get("fresh_sandbox_build_and_execute", {}).get("p50_ms")
    session = eryx.get("session_execute_raw", {}).get("p50_ms")
    rs = statistics.median(rscript) if rscript else None
    rows = [
        ("one-shot Python, cold <= 1.5x Eryx fresh sandbox", fresh,
         fig("python", "cold", "oneshot_latency"), 1.5),
        ("one-shot Python, warm pool < Eryx fresh sandbox", fresh,
         fig("python", "warm", "oneshot_latency"), 1.0),
        ("Python session cell <= 1.3x Eryx session execute", session,
         fig("python", "cold", "session_cell_latency"), 1.3),
        ("R session cell <= 1.5x bare R worker", bare_r,
         fig("r", "cold", "session_cell_latency"), 1.5),
        ("R open, warm pool < 10% of Rscript start", rs,
         fig("r", "warm", "session_open", "value"), 0.10),
    ]
    print("== latency targets (p50, ms; ratio = sandcell / bare)")
    for name, bare, got, limit in rows:
        if bare is None or got is None:
            print(f"{name:52} (figure missing)")
            continue
        ratio = got / bare
        verdict = "met" if ratio <= limit else "missed"
        print(f"{name:52} bare {bare:9.3f}  sandcell {got:9.3f}  ratio {ratio:6.3f}  {verdict}")
    if enter_us is not None:
        verdict = "met" if enter_us < 2000 else "missed"
        print(f"{'confinement enter() < 2 ms':52} {enter_us} us  {verdict}")
    idle = [f["daemon_rss"]["idle_bytes"] for f in runs.values() if "daemon_rss" in f]
    if idle:
        worst = max(idle) / 2**20
        verdict = "met" if worst < 15 else "missed"
        print(f"{'daemon idle RSS < 15 MB':52} {worst:.1f} MiB (largest of {len(idle)} runs)  {verdict}")


def shipped_summary(path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_shipped

    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        print("(no shipped-defaults figures: %s)" % e)
        return
    bench_shipped.summary_table(result)


if __name__ == "__main__":
    main()
