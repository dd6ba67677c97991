"""The asyncio client against a real sandcelld: 16 concurrent calls, sessions, files,
interrupts and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import sandcell


def arun(coro):
    return asyncio.run(coro)


def test_sixteen_concurrent_runs(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            order: dict[int, list[int]] = {i: [] for i in range(16)}

            async def one(i):
                code = f"for k in range(3):\n    print({i}, k)\n"
                return await c.run(code, on_output=lambda o: order[i].append(o.seq))

            t0 = time.monotonic()
            results = await asyncio.gather(*(one(i) for i in range(16)))
            return results, order, time.monotonic() - t0

    results, order, wall = arun(main())
    assert [r.status for r in results] == ["ok"] * 16, [(r.status, r.warnings) for r in results]
    for i, r in enumerate(results):
        assert r.stdout == "".join(f"{i} {k}\n" for k in range(3))
        assert order[i] == sorted(order[i])
    assert len({r.session for r in results}) == 16  # a fresh sandbox each
    print(f"16 concurrent one-shot runs: {wall:.2f} s wall")


def test_sixteen_concurrent_cells_across_sessions(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            async with c.session("python") as a, c.session("r") as b:
                await a.execute("n = 0")
                await b.execute("n <- 100")

                async def py(i):
                    return await a.execute(f"print({i})")

                async def r(i):
                    return await b.execute(f"cat({i})")

                # Cells of one session run one at a time: the daemon refuses a second one
                # (SessionBusy); run them in sequence per session, both sessions side by side.
                async def chain(f):
                    out = []
                    for i in range(8):
                        out.append(await f(i))
                    return out

                return await asyncio.gather(chain(py), chain(r))

    pys, rs = arun(main())
    assert [x.stdout for x in pys] == [f"{i}\n" for i in range(8)]
    assert [x.stdout for x in rs] == [f"{i}" for i in range(8)]


def test_async_put_file_by_descriptor(socket_path, tmp_path):
    import os

    data = os.urandom(300_000)
    src = tmp_path / "fichier-ü.bin"
    src.write_bytes(data)

    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            async with c.session("python") as s:
                info = await s.put_file("by-path.bin", src)  # the descriptor is passed
                big = await s.put_file("big.bin", data * 8)  # 2.4 MB: staged, passed as a descriptor
                return info.size, big.size, await s.get_file("by-path.bin")

    size, big, back = arun(main())
    assert (size, big, back) == (len(data), len(data) * 8, data)


def test_async_session_methods(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            async with c.session("python") as s:
                frames = []

                async def on_out(o):  # a coroutine callback is awaited
                    frames.append(o.text)

                r = await s.execute("x = 5\nprint('x is', x)", on_output=on_out)
                assert r.ok and frames == ["x is 5\n"]
                info = await s.put_file("données.txt", "é\n".encode())
                assert info.name == "données.txt"
                assert [f.name for f in await s.list_files()] == ["données.txt"]
                assert await s.get_file("données.txt") == "é\n".encode()
                await s.delete_file("données.txt")
                assert list(await s.list_files()) == []
                with pytest.raises(sandcell.NoSuchFile):
                    await s.get_file("données.txt")

                task = asyncio.create_task(s.execute("import time\ntime.sleep(30)"))
                await asyncio.sleep(0.5)
                ir = await s.interrupt()
                res = await asyncio.wait_for(task, 20)
                assert ir.delivered and res.status == "interrupted"
                assert (await s.execute("print(x)")).stdout == "5\n"
                sid = s.id
            with pytest.raises(sandcell.NoSuchSession):
                await c.session_by_id(sid).execute("1")
            with pytest.raises(sandcell.UnsupportedLanguage):
                await c.run("1", language="cobol")
            assert (await c.info())["product"]
            assert "error NoSuchSession" in await c.interface_description()
            # By id: a detached session, interrupted and closed through the client.
            d = await c.session("r", detached_idle_seconds=30)
            task = asyncio.create_task(d.execute("Sys.sleep(30)"))
            await asyncio.sleep(0.5)
            ir = await c.interrupt(d.id, d.last_cell)
            assert ir.delivered and (await asyncio.wait_for(task, 20)).status == "interrupted"
            assert (await c.session_by_id(d.id).execute("cat(1)")).stdout == "1"
            await c.close_session(d.id)
            with pytest.raises(sandcell.NoSuchSession):
                await c.close_session(d.id)

    arun(main())


def test_cancelled_call_costs_the_cell_not_the_session(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            s = await c.session("python")
            try:
                await s.execute("kept = 3")
                task = asyncio.create_task(s.execute("import time\ntime.sleep(30)"))
                await asyncio.sleep(0.5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                for _ in range(50):
                    try:
                        return (await s.execute("print(kept)")).stdout
                    except sandcell.SessionBusy:
                        await asyncio.sleep(0.1)
            finally:
                await s.close()

    assert arun(main()) == "3\n"


def test_async_host_call_handlers(socket_path):
    # The default environment (Eryx): a coroutine handler and a plain one.
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            seen = []

            async def tool(h):
                seen.append(h)
                await asyncio.sleep(0.01)  # other tasks run while the cell waits
                if h.name == "fail":
                    raise RuntimeError("tool broke")
                return {"sum": h.arguments["a"] + h.arguments["b"]}

            code = (
                "from sandcell import host\n"
                "print(host.call('add', {'a': 2, 'b': 40})['sum'])\n"
                "host.call('fail', {})\n"
            )
            r = await c.run(code, host_call_handler=tool)
            assert r.stdout == "42\n", r
            assert r.status == "error" and "tool broke" in r.error.message, r
            assert [h.call for h in seen] == [1, 2] and seen[0].session == r.session
            # Without a handler the run does not opt in: the call raises at once.
            r = await c.run("from sandcell import host\nhost.call('add', {})")
            assert r.status == "error" and "not enabled" in r.error.message, r
            async with c.session(host_calls=True) as s:
                r = await s.execute(
                    "from sandcell import host\nprint(host.call('add', {'a': 1, 'b': 1}))",
                    host_call_handler=lambda h: {"plain": h.arguments["a"]},
                )
                assert r.stdout == "{'plain': 1}\n", r
                with pytest.raises(sandcell.NoSuchHostCall):
                    await c.host_reply(s.id, 1, {"late": True})

    arun(main())


def test_async_timeout_is_a_per_call_deadline(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path, timeout=5) as c:
            await c.info()
            t0 = time.monotonic()
            for _ in range(5):
                await c.info()
            per_call = (time.monotonic() - t0) / 5
            t1 = time.monotonic()
            r = await c.run("import time\ntime.sleep(8)", timeout=1.5)
            took = time.monotonic() - t1
            async with c.session() as s:
                await s.execute("kept = 1")
                r2 = await s.execute("import time\ntime.sleep(8)", timeout=1)
                after = await s.execute("print(kept)")
            return per_call, r, took, r2, after

    per_call, r, took, r2, after = arun(main())
    assert per_call < 0.5, per_call
    assert r.status == "timeout" and 1 < took < 7, (r, took)
    assert r2.status == "timeout" and after.stdout == "1\n", (r2, after)


def test_a_cancelled_execute_frees_the_session(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            async with c.session() as s:
                await s.execute("kept = 3")
                task = asyncio.create_task(s.execute("import time\ntime.sleep(30)"))
                await s._started.wait(10)
                assert s._started.is_set()
                await asyncio.sleep(0.3)
                task.cancel()
                t0 = time.monotonic()
                with pytest.raises(asyncio.CancelledError):
                    await task
                settled = time.monotonic() - t0
                # At once: no SessionBusy, variables kept.
                return settled, await s.execute("print(kept)")

    settled, r = arun(main())
    assert r.stdout == "3\n" and settled < 15, (r, settled)


def test_stream_yields_started_outputs_and_the_result(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            async with c.session() as s:
                frames = [f async for f in s.stream("for i in range(3):\n    print(i, flush=True)")]
                # Closing it early interrupts the cell and frees the session.
                code = "import time\nprint('a', flush=True)\ntime.sleep(30)"
                async with contextlib.aclosing(s.stream(code)) as early:
                    async for f in early:
                        if isinstance(f, sandcell.Output):
                            break
                after = await s.execute("print('free')")
                return frames, after

    frames, after = arun(main())
    assert isinstance(frames[0], sandcell.Started)
    assert isinstance(frames[-1], sandcell.CellResult) and frames[-1].status == "ok"
    assert "".join(f.text for f in frames if isinstance(f, sandcell.Output)) == "0\n1\n2\n"
    assert after.stdout == "free\n"


def test_public_types():
    import typing

    assert set(typing.get_args(sandcell.Status)) == set(sandcell.STATUSES)
    assert sandcell.FileList and sandcell.VariableList and sandcell.Environment
    hints = typing.get_type_hints(sandcell.Client.list_environments)
    assert hints["return"] == list[sandcell.Environment]
    assert typing.get_type_hints(sandcell.Client.cell_status)["return"] is sandcell.CellStatus


def test_async_request_over_the_message_bound_is_limit_exceeded(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            with pytest.raises(sandcell.LimitExceeded) as e:
                await c.run("#" * (20 * 1024 * 1024))
            assert e.value.limit == "max_message_bytes"
            return (await c.run("print(2)")).stdout

    assert arun(main()) == "2\n"
