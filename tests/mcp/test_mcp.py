"""`sandcellctl mcp` against a real sandcelld, driven by the official MCP Python SDK over
stdio (and, for the hostile rows, by hand-written JSON-RPC lines on its stdin), and by the
MCP Inspector's command-line mode."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

TOOLS = {
    "run_code",
    "open_session",
    "execute",
    "interrupt",
    "close_session",
    "list_sessions",
    "inspect_variables",
    "upload_file",
    "download_file",
    "list_files",
    "delete_file",
    "list_environments",
}


@asynccontextmanager
async def connect(sandcellctl: str, socket_path: str):
    params = StdioServerParameters(command=sandcellctl, args=["--socket", socket_path, "mcp"])
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, w) as s:
            init = await s.initialize()
            s.init_result = init  # type: ignore[attr-defined]
            yield s


def run(sandcellctl, socket_path, body):
    async def main():
        async with connect(sandcellctl, socket_path) as s:
            return await body(s)

    return anyio.run(main)


def sc(result) -> dict:
    """The structured content of a tool result."""
    assert result.structured_content is not None, result
    return result.structured_content


def texts(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def valid_png(data: bytes) -> tuple[int, int]:
    """Checks the PNG signature, every chunk's CRC, IHDR first, IEND last and that the IDAT
    stream inflates; returns (width, height)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append(kind)
        if kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND", chunks
    zlib.decompress(idat)
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def test_initialize_and_list_tools(sandcellctl, socket_path):
    async def body(s):
        assert s.init_result.server_info.name == "sandcell"
        assert s.init_result.capabilities.tools is not None
        tools = (await s.list_tools()).tools
        return {t.name: t for t in tools}

    tools = run(sandcellctl, socket_path, body)
    assert set(tools) == TOOLS
    for t in tools.values():
        assert t.input_schema.get("type") == "object", t.name
        assert t.output_schema and t.output_schema.get("type") == "object", t.name
        assert t.description, t.name
    for name in ("open_session", "list_sessions"):
        assert "end when this MCP connection ends" in tools[name].description
    assert "code" in tools["run_code"].input_schema["required"]


def test_run_code_and_environments(sandcellctl, socket_path):
    async def body(s):
        r = await s.call_tool("run_code", {"code": "print(6 * 7)"})
        envs = await s.call_tool("list_environments", {"packages": True})
        r_env = await s.call_tool("run_code", {"code": "cat(6 * 7, '\\n')", "environment": "r"})
        return r, envs, r_env

    r, envs, r_env = run(sandcellctl, socket_path, body)
    assert not r.is_error, texts(r)
    assert sc(r)["stdout"] == "42\n" and sc(r)["status"] == "ok"
    assert sc(r)["session_ended"] is True
    assert "42" in texts(r)
    names = {e["name"]: e for e in sc(envs)["environments"]}
    assert {"python", "pydata", "r"} <= set(names)
    assert any(p["name"] == "numpy" for p in names["pydata"]["packages"])
    assert not r_env.is_error and sc(r_env)["stdout"].strip() == "42"


def test_cell_error_is_a_tool_error_with_traceback(sandcellctl, socket_path):
    async def body(s):
        return await s.call_tool("run_code", {"code": "def f():\n    return 1 / 0\nf()\n"})

    r = run(sandcellctl, socket_path, body)
    assert r.is_error
    out = sc(r)
    assert out["status"] == "error"
    assert out["error"]["kind"] == "ZeroDivisionError"
    assert "ZeroDivisionError" in texts(r) and "line 2" in (out["error"].get("traceback") or "")


def test_refused_calls_name_the_daemons_error(sandcellctl, socket_path):
    async def body(s):
        gone = await s.call_tool("execute", {"session": "no-such-session", "code": "1"})
        env = await s.call_tool("run_code", {"code": "1", "environment": "cobol"})
        limit = await s.call_tool(
            "run_code", {"code": "1", "limits": {"wall_time_seconds": 1e9}}
        )
        bad = await s.call_tool("run_code", {"cod": "1"})
        return gone, env, limit, bad

    gone, env, limit, bad = run(sandcellctl, socket_path, body)
    for r in (gone, env, limit, bad):
        assert r.is_error, r
    assert sc(gone)["error"] in (
        "org.sandcell.Kernel.NoSuchSession",
        "org.sandcell.Kernel.InvalidParameter",
    ), sc(gone)
    assert sc(env)["error"] == "org.sandcell.Kernel.NoSuchEnvironment"
    assert sc(limit)["error"] == "org.sandcell.Kernel.LimitExceeded", sc(limit)
    assert sc(limit)["parameters"]["limit"]
    assert sc(bad)["error"] == "sandcell.mcp.InvalidArguments"
    assert texts(gone).startswith("org.sandcell.Kernel.")


def test_session_tools_files_and_variables(sandcellctl, socket_path):
    async def body(s):
        o = sc(await s.call_tool("open_session", {"environment": "python"}))
        sid = o["session"]
        out = {"open": o}
        out["listed"] = sc(await s.call_tool("list_sessions", {}))
        await s.call_tool("execute", {"session": sid, "code": "x = 41"})
        out["exec"] = await s.call_tool("execute", {"session": sid, "code": "print(x + 1)"})
        out["vars"] = sc(await s.call_tool("inspect_variables", {"session": sid}))
        out["up_text"] = await s.call_tool(
            "upload_file", {"session": sid, "name": "a.txt", "text": "héllo\n"}
        )
        out["up_b64"] = await s.call_tool(
            "upload_file",
            {"session": sid, "name": "b.bin", "base64": base64.b64encode(b"\x00\xff\x01").decode()},
        )
        # Valid UTF-8 that is no text (control bytes) comes back in base64 too.
        await s.call_tool(
            "upload_file",
            {"session": sid, "name": "c.bin", "base64": base64.b64encode(b"\x00\x01\x02\x03").decode()},
        )
        out["down_ctl"] = await s.call_tool("download_file", {"session": sid, "name": "c.bin"})
        out["read"] = await s.call_tool(
            "execute", {"session": sid, "code": "print(open('a.txt').read().strip())"}
        )
        out["files"] = sc(await s.call_tool("list_files", {"session": sid}))
        out["down_text"] = await s.call_tool("download_file", {"session": sid, "name": "a.txt"})
        out["down_bin"] = await s.call_tool("download_file", {"session": sid, "name": "b.bin"})
        out["delete"] = await s.call_tool("delete_file", {"session": sid, "name": "a.txt"})
        out["files2"] = sc(await s.call_tool("list_files", {"session": sid}))
        out["too_big"] = await s.call_tool(
            "upload_file", {"session": sid, "name": "big", "text": "x" * (1024 * 1024 + 1)}
        )
        out["max_up"] = await s.call_tool(
            "upload_file",
            {"session": sid, "name": "max.bin", "base64": base64.b64encode(b"\x07" * 1024 * 1024).decode()},
        )
        out["close"] = await s.call_tool("close_session", {"session": sid})
        out["listed2"] = sc(await s.call_tool("list_sessions", {}))
        out["after"] = await s.call_tool("execute", {"session": sid, "code": "1"})
        return out

    o = run(sandcellctl, socket_path, body)
    sid = o["open"]["session"]
    assert [x["session"] for x in o["listed"]["sessions"]] == [sid]
    assert sc(o["exec"])["stdout"] == "42\n"
    assert any(v["name"] == "x" and "41" in v["repr"] for v in o["vars"]["variables"])
    assert not o["up_text"].is_error and sc(o["up_text"])["file"]["size"] == len("héllo\n".encode())
    assert sc(o["up_b64"])["file"]["size"] == 3
    assert sc(o["read"])["stdout"] == "héllo\n"
    assert {"a.txt", "b.bin"} <= {f["name"] for f in o["files"]["files"]}
    assert sc(o["down_text"])["encoding"] == "utf-8" and sc(o["down_text"])["data"] == "héllo\n"
    d = sc(o["down_bin"])
    assert d["encoding"] == "base64" and base64.b64decode(d["data"]) == b"\x00\xff\x01" and d["eof"]
    d = sc(o["down_ctl"])
    assert d["encoding"] == "base64" and base64.b64decode(d["data"]) == b"\x00\x01\x02\x03", d
    assert not o["delete"].is_error
    assert "a.txt" not in {f["name"] for f in o["files2"]["files"]}
    assert o["too_big"].is_error and sc(o["too_big"])["error"] == "sandcell.mcp.LimitExceeded"
    assert sc(o["max_up"])["file"]["size"] == 1024 * 1024, sc(o["max_up"])
    assert not o["close"].is_error
    assert o["listed2"]["sessions"] == []
    assert o["after"].is_error and sc(o["after"])["error"].startswith("org.sandcell.Kernel.")


def test_r_session_keeps_a_variable(sandcellctl, socket_path):
    async def body(s):
        sid = sc(await s.call_tool("open_session", {"environment": "r"}))["session"]
        a = await s.call_tool("execute", {"session": sid, "code": "v <- c(1, 2, 3)"})
        b = await s.call_tool("execute", {"session": sid, "code": "cat(sum(v) * 7, '\\n')"})
        await s.call_tool("close_session", {"session": sid})
        return a, b

    a, b = run(sandcellctl, socket_path, body)
    assert not a.is_error, texts(a)
    assert sc(b)["stdout"].strip() == "42", texts(b)


def test_pydata_plot_comes_back_as_a_png_image(sandcellctl, socket_path):
    code = (
        "import matplotlib.pyplot as plt\n"
        "import numpy as np\n"
        "x = np.linspace(0, 6.28, 50)\n"
        "plt.plot(x, np.sin(x))\n"
        "plt.show()\n"
    )

    async def body(s):
        sid = sc(await s.call_tool("open_session", {"environment": "pydata"}))["session"]
        r = await s.call_tool("execute", {"session": sid, "code": code})
        await s.call_tool("close_session", {"session": sid})
        return r

    r = run(sandcellctl, socket_path, body)
    assert not r.is_error, texts(r)
    images = [c for c in r.content if c.type == "image"]
    assert len(images) == 1, (sc(r), [c.type for c in r.content])
    assert images[0].mime_type == "image/png"
    w, h = valid_png(base64.b64decode(images[0].data))
    assert w > 100 and h > 100
    assert sc(r)["images"] and sc(r)["images"][0].endswith(".png")


def test_progress_carries_live_output(sandcellctl, socket_path):
    code = "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)\n"
    seen: list[tuple[float, str | None, float]] = []

    async def progress(p, total, message):
        seen.append((p, message, time.monotonic()))

    async def body(s):
        sid = sc(await s.call_tool("open_session", {}))["session"]
        r = await s.call_tool("execute", {"session": sid, "code": code}, progress_callback=progress)
        done = time.monotonic()
        await s.call_tool("close_session", {"session": sid})
        return r, done

    r, done = run(sandcellctl, socket_path, body)
    assert sc(r)["stdout"] == "tick 0\ntick 1\ntick 2\n"
    messages = "".join(m or "" for _, m, _ in seen)
    assert "tick 0" in messages and "tick 2" in messages, seen
    # Live: the first tick arrived well before the result.
    assert seen[0][2] < done - 0.4, seen


def test_cancellation_interrupts_the_cell_within_a_second(sandcellctl, socket_path):
    async def body(s):
        sid = sc(await s.call_tool("open_session", {}))["session"]
        started = anyio.Event()

        async def progress(p, total, message):
            started.set()

        async def long_cell():
            await s.call_tool(
                "execute",
                {"session": sid, "code": "print('sleeping', flush=True)\nimport time\ntime.sleep(60)"},
                progress_callback=progress,
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_cell)
            with anyio.fail_after(30):
                await started.wait()
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()
        # The session accepts a new cell once the interrupted one has ended.
        while True:
            r = await s.call_tool("execute", {"session": sid, "code": "print('after')"})
            if not (r.is_error and sc(r).get("error") == "org.sandcell.Kernel.SessionBusy"):
                break
            await anyio.sleep(0.05)
        free_after = time.monotonic() - cancelled_at
        await s.call_tool("close_session", {"session": sid})
        return r, free_after

    r, free_after = run(sandcellctl, socket_path, body)
    assert sc(r)["stdout"] == "after\n", texts(r)
    assert free_after < 1.0 + 0.5, f"the session was busy {free_after:.2f}s after the cancel"


def test_sessions_end_with_the_connection_unless_detached(sandcellctl, socket_path):
    async def first(s):
        a = sc(await s.call_tool("open_session", {}))["session"]
        b = sc(await s.call_tool("open_session", {"detached_idle_seconds": 60}))["session"]
        await s.call_tool("execute", {"session": b, "code": "kept = 7"})
        return a, b

    a, b = run(sandcellctl, socket_path, first)

    async def second(s):
        deadline = time.monotonic() + 10
        while True:
            ra = await s.call_tool("execute", {"session": a, "code": "1"})
            if ra.is_error or time.monotonic() > deadline:
                break
            await anyio.sleep(0.1)
        rb = await s.call_tool("execute", {"session": b, "code": "print(kept * 6)"})
        await s.call_tool("close_session", {"session": b})
        return ra, rb

    ra, rb = run(sandcellctl, socket_path, second)
    assert ra.is_error and sc(ra)["error"] in (
        "org.sandcell.Kernel.NoSuchSession",
        "org.sandcell.Kernel.SessionEnded",
    ), sc(ra)
    assert sc(rb)["stdout"] == "42\n", texts(rb)


# ---------------------------------------------------------------- raw JSON-RPC: hostile rows


class Raw:
    """`sandcellctl mcp` with JSON-RPC lines written and read by hand."""

    def __init__(self, sandcellctl, socket_path):
        self.p = subprocess.Popen(
            [sandcellctl, "--socket", socket_path, "mcp"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        )
        self.buf = b""
        self.send(
            {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"},
                },
            }
        )
        assert self.reply(0)["result"]["serverInfo"]["name"] == "sandcell"
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send(self, msg) -> None:
        line = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        self.p.stdin.write(line + b"\n")
        self.p.stdin.flush()

    def read(self, timeout=30.0) -> dict:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            assert left > 0, "no answer in time"
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if r:
                chunk = os.read(self.p.stdout.fileno(), 1 << 20)
                assert chunk, "the server closed its output"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def reply(self, id_, timeout=30.0) -> dict:
        while True:
            m = self.read(timeout)
            if m.get("id") == id_ and "method" not in m:
                return m

    def unanswered_error(self, timeout=30.0) -> dict:
        """The next error response with `"id": null` (the member present, its value null)."""
        while True:
            m = self.read(timeout)
            if "error" in m and "id" in m and m["id"] is None:
                return m

    def rss_kib(self) -> tuple[int, int]:
        """The server's resident set and its high-water mark, KiB (/proc/PID/status)."""
        status = Path(f"/proc/{self.p.pid}/status").read_text()
        field = lambda name: int(next(l for l in status.splitlines() if l.startswith(name)).split()[1])
        return field("VmRSS:"), field("VmHWM:")

    def call(self, id_, tool, args, meta=None) -> None:
        params = {"name": tool, "arguments": args}
        if meta:
            params["_meta"] = meta
        self.send({"jsonrpc": "2.0", "id": id_, "method": "tools/call", "params": params})

    def close(self) -> int:
        self.p.stdin.close()
        return self.p.wait(20)


def test_cancel_notification_interrupts_and_says_interrupted(sandcellctl, socket_path):
    """The SDK answers no cancelled request (MCP "Cancellation"); the last progress
    notification of the call says how its cell ended."""
    r = Raw(sandcellctl, socket_path)
    r.call(1, "run_code", {"code": "print('go', flush=True)\nimport time\ntime.sleep(60)"},
           meta={"progressToken": "p1"})
    while True:  # the first progress notification: the cell runs
        m = r.read()
        if m.get("method") == "notifications/progress":
            break
    t0 = time.monotonic()
    r.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": 1, "reason": "test"}})
    while True:
        m = r.read(timeout=5)
        assert m.get("id") != 1, f"a response to the cancelled request: {m}"
        if m.get("method") == "notifications/progress" and "status" in m["params"].get("message", ""):
            break
    took = time.monotonic() - t0
    assert m["params"]["message"] == "[status: interrupted]", m
    # Not interrupted, the cell would sleep 60 s; the bound leaves room for a loaded machine.
    assert took < 15.0, f"the cell ended {took:.2f}s after the cancellation"
    r.call(2, "list_sessions", {})
    assert r.reply(2)["result"]["structuredContent"] == {"sessions": []}
    assert r.close() == 0


def test_hostile_input_gets_errors_and_the_server_stays_up(sandcellctl, socket_path):
    r = Raw(sandcellctl, socket_path)
    # Malformed JSON-RPC: not JSON (JSON-RPC 2.0 §5.1: -32700 Parse error, id null), JSON
    # that is no message, an unknown method, bad parameters, an unknown tool.
    r.send(b"{this is not json")
    e = r.unanswered_error()
    assert e["error"]["code"] == -32700, e
    r.send(b"\xff\xfe\x00 binary")
    assert r.unanswered_error()["error"]["code"] == -32700
    r.send(b"[1, 2, 3]")
    assert r.unanswered_error()["error"]["code"] == -32600
    r.send({"jsonrpc": "2.0", "id": 2, "method": "no/such/method"})
    assert "error" in r.reply(2)
    r.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": 5}})
    assert "error" in r.reply(3)
    # Parameters that do not fit a method the specification defines: -32602, not "not found".
    r.send({"jsonrpc": "2.0", "id": 31, "method": "tools/call",
            "params": {"name": "run_code", "arguments": "print(1)"}})
    res = r.reply(31)
    assert res["error"]["code"] == -32602, res
    # An unknown tool is a protocol error (MCP "Server: Tools", "Error Handling"): -32602.
    r.call(4, "no_such_tool", {})
    res = r.reply(4)
    assert res["error"]["code"] == -32602, res
    assert "no_such_tool" in res["error"]["message"]
    # Huge arguments: a 6 MiB line is over the 4 MiB line cap (answered -32600 naming the
    # cap, with the request's id read from the line's start); 3 MiB and 200 KiB of code are
    # over the daemon's max_source_bytes and refused before sending with its own error.
    r.call(5, "run_code", {"code": "#" + "x" * (6 * 1024 * 1024)})
    res = r.reply(5, timeout=60)
    assert res["error"]["code"] == -32600, str(res)[:500]
    assert "4194304" in res["error"]["message"], res
    assert res["error"]["data"] == {"max_line_bytes": 4194304}, res
    for id_, n in ((6, 3 * 1024 * 1024), (8, 200 * 1024)):
        r.call(id_, "run_code", {"code": "#" + "x" * n})
        res = r.reply(id_, timeout=60)
        sc_ = res["result"]["structuredContent"]
        assert res["result"]["isError"] and sc_["error"] == "org.sandcell.Kernel.LimitExceeded", str(res)[:500]
        assert sc_["parameters"] == {"limit": "max_source_bytes", "value": n + 1, "max": 65536}, sc_
        assert "before sending" in sc_["message"]
    # A flood: 300 calls at once; each is answered (done or refused as Busy).
    for i in range(300):
        r.call(1000 + i, "list_environments", {})
    answered, busy = set(), 0
    while len(answered) < 300:
        m = r.read(timeout=120)
        if 1000 <= (m.get("id") or 0) < 1300 and "method" not in m:
            answered.add(m["id"])
            if m.get("result", {}).get("isError"):
                assert m["result"]["structuredContent"]["error"] == "sandcell.mcp.Busy", m
                busy += 1
    print(f"flood: 300 answered, {busy} refused as Busy", file=sys.stderr)
    # Still up, and the daemon unaffected.
    r.call(7, "run_code", {"code": "print(1 + 1)"})
    res = r.reply(7)
    assert res["result"]["structuredContent"]["stdout"] == "2\n"
    assert r.p.poll() is None
    assert r.close() == 0

    import sandcell  # the Python client, beside: the daemon still serves others

    with sandcell.Client(socket_path) as c:
        assert c.run("print(3)").stdout == "3\n"


def test_a_client_that_does_not_read_cannot_grow_the_server(sandcellctl, socket_path):
    """Requests written while the answers are not read: the server stops reading (at most 32
    requests unanswered, then the pipes fill) instead of queueing answers; read, all come."""
    r = Raw(sandcellctl, socket_path)
    total = 50_000
    sent = [0]

    def writer():
        for i in range(total):
            r.send({"jsonrpc": "2.0", "id": 10 + i, "method": "ping"})
            sent[0] += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(3)
    rss, hwm = r.rss_kib()
    print(f"not reading: {sent[0]} of {total} lines written, server RSS {rss} KiB, "
          f"high-water {hwm} KiB", file=sys.stderr)
    assert sent[0] < total, "the server read every line while nothing read its answers"
    assert hwm < 64 * 1024, f"the server grew to {hwm} KiB while its answers were not read"
    ids = set()
    while len(ids) < total:
        m = r.read(timeout=60)
        if "method" not in m:
            assert "result" in m, m
            ids.add(m["id"])
    assert ids == set(range(10, 10 + total))
    t.join(10)
    assert r.close() == 0


def test_code_cap_is_the_daemons_max_source_bytes(sandcellctl, socket_path):
    """The daemon reports max_source_bytes in ListEnvironments (limits.source_bytes); code of
    exactly that many bytes runs, one byte more is refused before it is sent."""
    import sandcell

    with sandcell.Client(socket_path) as c:
        caps = {e["name"]: e["limits"].get("source_bytes") for e in c.list_environments()}
    assert set(caps.values()) == {65536}, caps
    cap = caps["python"]
    fits = "print('fits')\n#" + "x" * (cap - len("print('fits')\n#"))
    assert len(fits.encode()) == cap

    async def body(s):
        ok = await s.call_tool("run_code", {"code": fits})
        over = await s.call_tool("run_code", {"code": fits + "x"})
        sid = sc(await s.call_tool("open_session", {}))["session"]
        over_exec = await s.call_tool("execute", {"session": sid, "code": fits + "é"})
        await s.call_tool("close_session", {"session": sid})
        return ok, over, over_exec

    ok, over, over_exec = run(sandcellctl, socket_path, body)
    assert not ok.is_error and sc(ok)["stdout"] == "fits\n", texts(ok)
    assert over.is_error and sc(over)["error"] == "org.sandcell.Kernel.LimitExceeded"
    assert sc(over)["parameters"] == {"limit": "max_source_bytes", "value": cap + 1, "max": cap}
    assert "max_source_bytes" in texts(over)
    assert sc(over_exec)["parameters"] == {"limit": "max_source_bytes", "value": cap + 2, "max": cap}


def test_protocol_errors_through_the_sdk(sandcellctl, socket_path):
    """Through the official SDK: an unknown tool and an oversized request each end in a
    JSON-RPC error for that request (MCPError), not a hang or a tool result."""
    from mcp.shared.exceptions import MCPError

    async def body(s):
        errors = {}
        with anyio.fail_after(60):
            for name, tool, args in (
                ("unknown", "no_such_tool", {}),
                ("oversized", "upload_file", {"session": "x", "name": "a", "text": "y" * (5 << 20)}),
            ):
                try:
                    await s.call_tool(tool, args)
                except MCPError as e:
                    errors[name] = e.error
            after = await s.call_tool("run_code", {"code": "print(5)"})
        return errors, after

    errors, after = run(sandcellctl, socket_path, body)
    assert errors["unknown"].code == -32602, errors
    assert errors["oversized"].code == -32600 and "4194304" in errors["oversized"].message, errors
    assert sc(after)["stdout"] == "5\n"


def test_a_line_without_end_is_not_held(sandcellctl, socket_path):
    """1 GiB without a newline: answered as soon as it passes the 4 MiB cap, discarded as it
    arrives (the server's memory high-water mark stays far below it), and the server goes on
    with the next line."""
    r = Raw(sandcellctl, socket_path)
    rss0, _ = r.rss_kib()
    prefix = b'{"jsonrpc":"2.0","id":77,"method":"tools/call","params":{"name":"run_code","arguments":{"code":"'
    os.write(r.p.stdin.fileno(), prefix)
    chunk = b"x" * (1 << 20)
    answered_after = None
    for i in range(1024):
        r.p.stdin.write(chunk)
        if answered_after is None and i % 8 == 7:
            r.p.stdin.flush()
            ready, _, _ = select.select([r.p.stdout], [], [], 0)
            if ready:
                answered_after = i + 1
    r.p.stdin.flush()
    res = r.reply(77, timeout=60)
    assert res["error"]["code"] == -32600 and res["error"]["data"]["max_line_bytes"] == 4194304, res
    rss1, hwm = r.rss_kib()
    print(f"1 GiB line: answered after {answered_after} MiB; RSS {rss0} -> {rss1} KiB, "
          f"high-water mark {hwm} KiB", file=sys.stderr)
    assert answered_after is not None and answered_after <= 16, answered_after
    assert hwm < rss0 + 32 * 1024, (rss0, hwm)
    r.send(b'"}}}')  # the line's end; the next line is a call again
    r.call(78, "run_code", {"code": "print(8)"})
    assert r.reply(78, timeout=60)["result"]["structuredContent"]["stdout"] == "8\n"
    assert r.close() == 0


# ---------------------------------------------------------------- the MCP Inspector


def _inspector() -> str | None:
    cache = Path(os.environ.get("SANDCELL_CACHE", "/var/tmp/sandcell-cache"))
    cli = cache / "mcp-npm/node_modules/.bin/mcp-inspector"
    return str(cli) if cli.exists() and shutil.which("node") else None


def test_inspector_cli_lists_and_calls_tools(sandcellctl, socket_path):
    cli = _inspector()
    if cli is None:
        msg = "no MCP Inspector in $SANDCELL_CACHE/mcp-npm (run scripts/mcp-venv.sh) or no node"
        if os.environ.get("SANDCELL_REQUIRE_DAEMON") == "1":
            pytest.fail(msg)
        print(f"skip: {msg}", file=sys.stderr)
        pytest.skip(msg)
    base = [cli, "--cli", sandcellctl, "--socket", socket_path, "mcp"]
    listed = subprocess.run(base + ["--method", "tools/list"], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = {t["name"] for t in json.loads(listed.stdout)["tools"]}
    assert names == TOOLS
    called = subprocess.run(
        base + ["--method", "tools/call", "--tool-name", "run_code", "--tool-arg",
                "code=print(6 * 7)"],
        capture_output=True, text=True, timeout=120,
    )
    assert called.returncode == 0, called.stderr
    out = json.loads(called.stdout)
    assert out["structuredContent"]["stdout"] == "42\n", out
    # An unknown tool is a JSON-RPC error to the Inspector too (it exits non-zero).
    unknown = subprocess.run(
        base + ["--method", "tools/call", "--tool-name", "no_such_tool"],
        capture_output=True, text=True, timeout=120,
    )
    assert unknown.returncode != 0, unknown.stdout
    assert "-32602" in unknown.stdout + unknown.stderr, unknown.stderr[-2000:]


@pytest.mark.parametrize("stdin", ["pipe", "terminal"])
def test_sigterm_ends_the_server_before_initialize_and_on_a_terminal(sandcellctl, socket_path,
                                                                     stdin):
    """SIGTERM ends `sandcellctl mcp` with status 0 at any time, before `initialize` too, and
    when its stdin is a terminal (whose blocking read cannot be cancelled)."""
    import pty

    master = slave = None
    if stdin == "terminal":
        master, slave = pty.openpty()
    p = subprocess.Popen([sandcellctl, "--socket", socket_path, "mcp"],
                         stdin=slave if slave is not None else subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(15)
        try:
            assert p.wait(10) == 0, p.stderr.read()
        except subprocess.TimeoutExpired:
            pytest.fail(f"sandcellctl mcp ({stdin}) still runs 10 s after SIGTERM")
    finally:
        p.kill()
        p.wait()
        for fd in (master, slave):
            if fd is not None:
                os.close(fd)
