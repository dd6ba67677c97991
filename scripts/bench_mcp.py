"""The run_code tool of `sandcellctl mcp` through the official MCP Python SDK (one stdio
connection) beside the same `print(1)` through the Python client (one connection), calls
interleaved, against one sandcelld started as the tests start it (tests/mcp/conftest.py).
Prints p50 and p99 of each, in ms, and what MCP adds at p50 (goal: under 2 ms), also as
paired differences (each MCP call minus the Python client's call beside it); then the same
with JSON-RPC lines written by hand, which leaves out the MCP SDK client's own cost.
Run by scripts/bench.sh with the venv of scripts/mcp-venv.sh and PYTHONPATH=clients/python/src.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests/mcp"))
from conftest import BIN, ROOMY, Daemon  # noqa: E402

import sandcell  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(n: int, socket: str) -> None:
    params = StdioServerParameters(command=str(BIN / "sandcellctl"), args=["--socket", socket, "mcp"])
    mcp_ms, py_ms, bare_ms = [], [], []
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        await s.list_tools()
        with sandcell.Client(socket) as c:
            for i in range(n + 5):
                async def via_mcp() -> float:
                    t = time.perf_counter()
                    res = await s.call_tool("run_code", {"code": "print(1)"})
                    assert res.structured_content["stdout"] == "1\n", res
                    return (time.perf_counter() - t) * 1000

                def via_python() -> float:
                    t = time.perf_counter()
                    assert c.run("print(1)").stdout == "1\n"
                    return (time.perf_counter() - t) * 1000

                # Alternate which goes first: neither always finds the pool just refilled.
                if i % 2:
                    m = await via_mcp()
                    p = via_python()
                else:
                    p = via_python()
                    m = await via_mcp()
                t = time.perf_counter()
                await s.call_tool("list_sessions", {})
                b = (time.perf_counter() - t) * 1000
                if i >= 5:  # warm-up
                    mcp_ms.append(m)
                    py_ms.append(p)
                    bare_ms.append(b)
        # The same path without a worker start: execute print(1) in an open session.
        sid = (await s.call_tool("open_session", {})).structured_content["session"]
        ex_mcp, ex_py = [], []
        with sandcell.Client(socket) as c, c.session() as sess:
            for i in range(n + 5):
                t = time.perf_counter()
                res = await s.call_tool("execute", {"session": sid, "code": "print(1)"})
                m = (time.perf_counter() - t) * 1000
                assert res.structured_content["stdout"] == "1\n", res
                t = time.perf_counter()
                assert sess.execute("print(1)").stdout == "1\n"
                p = (time.perf_counter() - t) * 1000
                if i >= 5:
                    ex_mcp.append(m)
                    ex_py.append(p)
        await s.call_tool("close_session", {"session": sid})
    rows = (
        ("python client Run", py_ms),
        ("MCP run_code (SDK, stdio)", mcp_ms),
        ("python client session execute", ex_py),
        ("MCP execute (SDK, stdio)", ex_mcp),
        ("MCP list_sessions (no daemon call)", bare_ms),
    )
    for label, xs in rows:
        print("%-40s p50 %.2f ms, p99 %.2f ms (%d calls)" % (label, pct(xs, 0.5), pct(xs, 0.99), len(xs)))
    added = statistics.median(mcp_ms) - statistics.median(py_ms)
    print("MCP adds at p50: %.2f ms for run_code (goal: under 2 ms)" % added)
    added = statistics.median(ex_mcp) - statistics.median(ex_py)
    print("MCP adds at p50: %.2f ms for execute in an open session" % added)
    for label, a, b in (("run_code", mcp_ms, py_ms), ("execute", ex_mcp, ex_py)):
        diffs = sorted(x - y for x, y in zip(a, b))
        print("MCP adds to %s (paired, SDK): p50 %.2f ms, p99 %.2f ms"
              % (label, pct(diffs, 0.5), pct(diffs, 0.99)))


def raw(n: int, socket: str) -> None:
    """The server's own cost: run_code and list_sessions with JSON-RPC lines written by hand."""
    from test_mcp import Raw

    r = Raw(str(BIN / "sandcellctl"), socket)
    run_ms, bare_ms = [], []
    for i in range(n + 5):
        t = time.perf_counter()
        r.call(i, "run_code", {"code": "print(1)"})
        assert r.reply(i)["result"]["structuredContent"]["stdout"] == "1\n"
        m = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        r.call(100000 + i, "list_sessions", {})
        r.reply(100000 + i)
        b = (time.perf_counter() - t) * 1000
        if i >= 5:
            run_ms.append(m)
            bare_ms.append(b)
    # execute print(1) in an open session, interleaved with the Python client's: the server's
    # own share of a cell call, without the MCP SDK client's.
    r.call(-1, "open_session", {})
    sid = r.reply(-1)["result"]["structuredContent"]["session"]
    ex_raw, ex_py = [], []
    with sandcell.Client(socket) as c, c.session() as sess:
        for i in range(n + 5):
            t = time.perf_counter()
            r.call(200000 + i, "execute", {"session": sid, "code": "print(1)"})
            assert r.reply(200000 + i)["result"]["structuredContent"]["stdout"] == "1\n"
            m = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            assert sess.execute("print(1)").stdout == "1\n"
            p = (time.perf_counter() - t) * 1000
            if i >= 5:
                ex_raw.append(m)
                ex_py.append(p)
    r.close()
    for label, xs in (("MCP run_code (raw JSON-RPC lines)", run_ms),
                      ("MCP list_sessions (raw JSON-RPC lines)", bare_ms),
                      ("python client session execute", ex_py),
                      ("MCP execute (raw JSON-RPC lines)", ex_raw)):
        print("%-40s p50 %.2f ms, p99 %.2f ms (%d calls)" % (label, pct(xs, 0.5), pct(xs, 0.99), len(xs)))
    diffs = sorted(a - b for a, b in zip(ex_raw, ex_py))
    print("the server adds to execute (paired, raw lines): p50 %.2f ms, p99 %.2f ms"
          % (pct(diffs, 0.5), pct(diffs, 0.99)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=50)
    a = ap.parse_args()
    # A warm pool: the cell's own cost is steady, so the difference is the MCP path's.
    d = Daemon(
        "bench-mcp",
        {
            **ROOMY,
            "SANDCELL_POOL_PYTHON_MIN": "4",
            "SANDCELL_POOL_PYTHON_MAX": "8",
            "SANDCELL_POOL_REFILL_PER_SECOND": "200",
        },
    )
    try:
        anyio.run(main, a.iterations, d.socket)
        raw(a.iterations, d.socket)
    finally:
        d.stop()
