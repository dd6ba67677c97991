"""The asyncio client: :class:`AsyncClient` and :class:`AsyncSession`.

The same methods as the blocking client (written once, in ``sandcell._core``), as
coroutines over non-blocking sockets; this module holds only that I/O and what only asyncio
has (:meth:`AsyncSession.stream`). Concurrent calls each take their own connection from a pool
(the daemon answers the calls of one connection one at a time), so ``asyncio.gather`` of
many ``run`` calls runs them side by side, up to the daemon's admission limits. A cancelled
call closes its connection: the daemon interrupts that cell, and a session keeps its
variables (cells travel over the pool, not over the connection that keeps the session
alive).
"""

from __future__ import annotations

import asyncio
import os
import socket as _socket
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import Any, Generic, ParamSpec, TypeVar

from . import _core as C
from . import _protocol as P
from .errors import ConnectionFailed, Timeout
from .types import CellResult, Output, Started

__all__ = ["AsyncClient", "AsyncSession"]

#: The error a cell's host call gets when the client streaming the cell has no handler.
NO_HANDLER = C.NO_HANDLER
OnOutput = C.OnOutput
OnStarted = C.OnStarted
#: A host-call handler: a plain function or a coroutine function of a :class:`HostCall`
#: that returns the result (a dict) or raises.
AsyncHostCallHandler = C.HostCallHandler

T = TypeVar("T")
A = ParamSpec("A")


class _AConn(C.ConnBase):
    """One non-blocking connection driven by the running event loop."""

    def __init__(self, path: str):
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        super().__init__(path, sock)

    async def connect(self, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(self.sock, self.path), timeout
            )
        except TimeoutError as e:
            self.close()
            raise Timeout(timeout or 0.0, f"connecting to {self.path}") from e
        except OSError as e:
            self.close()
            raise ConnectionFailed(e.errno, f"connecting to {self.path}: {e.strerror or e}") from e

    async def _send_fds(self, data: bytes, fds: list[int]) -> int:
        loop = asyncio.get_running_loop()
        while True:
            try:
                return _socket.send_fds(self.sock, [data], fds)
            except BlockingIOError:
                fut: asyncio.Future[None] = loop.create_future()

                def ready(f: asyncio.Future[None] = fut) -> None:
                    if not f.done():
                        f.set_result(None)

                loop.add_writer(self.sock.fileno(), ready)
                try:
                    await fut
                finally:
                    loop.remove_writer(self.sock.fileno())

    async def send(self, call: P.Call, clock: C.Clock | None = None) -> None:
        data = self.begin(call, clock)
        loop = asyncio.get_running_loop()

        async def out() -> None:
            if call.fds:
                # The descriptors travel with the first bytes of the message.
                n = await self._send_fds(data, list(call.fds))
                if n < len(data):
                    await loop.sock_sendall(self.sock, data[n:])
            else:
                await loop.sock_sendall(self.sock, data)

        left = clock.remaining() if clock else None
        try:
            await asyncio.wait_for(out(), None if left is None else max(left, 0.0))
        except TimeoutError:
            self.close()  # part of the call may be out: the connection is out of step
            raise (clock.timeout() if clock else Timeout(0.0, call.method)) from None
        except OSError as e:
            raise self.send_failed(e) from e

    async def _recv(self, left: float | None) -> bytes:
        # A cancelled sock_recv consumes nothing: the connection stays in step.
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.sock_recv(self.sock, 256 * 1024), left)


class _AEvent(C.Event):
    async def wait(self, seconds: float) -> bool:
        try:
            return await asyncio.wait_for(self._e.wait(), seconds)
        except TimeoutError:
            return False


class _Asyncio(C.Backend):
    conn = _AConn
    stop_waiting = (asyncio.CancelledError,)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def event(self) -> C.Event:
        return _AEvent(asyncio.Event())


class AsyncSession(C.SessionCore):
    """A persistent session of an :class:`AsyncClient`; the methods of
    :class:`sandcell.Session` as coroutines, and :meth:`stream`."""

    client: AsyncClient

    execute = C.coroutine(C.SessionCore._execute)
    interrupt = C.coroutine(C.SessionCore._interrupt)
    put_file = C.coroutine(C.SessionCore._put_file)
    get_file = C.coroutine(C.SessionCore._get_file)
    list_files = C.coroutine(C.SessionCore._list_files)
    inspect = C.coroutine(C.SessionCore._inspect)
    complete = C.coroutine(C.SessionCore._complete)
    help = C.coroutine(C.SessionCore._help)
    delete_file = C.coroutine(C.SessionCore._delete_file)
    close = C.coroutine(C.SessionCore._close)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def stream(
        self,
        code: str,
        *,
        host_call_handler: AsyncHostCallHandler | None = None,
        timeout: float | None | P._ClientDefault = P.CLIENT_DEFAULT,
    ) -> AsyncIterator[Started | Output | CellResult]:
        """Runs a cell and yields its frames as they arrive, beside the callbacks of
        :meth:`execute`: the :class:`Started` frame, each :class:`Output`, and last the
        :class:`CellResult`::

            async for frame in session.stream("for i in range(3): print(i)"):
                if isinstance(frame, sandcell.Output):
                    print(frame.text, end="")
                elif isinstance(frame, sandcell.CellResult):
                    print(frame.status)

        Closing the iterator early interrupts the cell and waits for its end, as a cancelled
        :meth:`execute` does. Python closes an abandoned async iterator only later (at its
        finalization), so to leave the loop with ``break`` and run the next cell at once,
        close it then: ``async with contextlib.aclosing(session.stream(code)) as frames:
        async for frame in frames: ...``. Raises what :meth:`execute` raises."""
        queue: asyncio.Queue[Started | Output | CellResult | BaseException] = asyncio.Queue()

        async def run() -> None:
            try:
                r = await self.execute(code, queue.put_nowait, on_started=queue.put_nowait,
                                       host_call_handler=host_call_handler, timeout=timeout)
                queue.put_nowait(r)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, raised there
                queue.put_nowait(e)

        task = asyncio.ensure_future(run())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, CellResult):
                    return
        finally:
            if not task.done():
                task.cancel()
                try:
                    await asyncio.shield(task)
                except (asyncio.CancelledError, Exception):
                    pass


S = TypeVar("S", bound=C.SessionCore)


class _Opening(Generic[S]):
    """``client.session(...)``: awaitable, and an async context manager that closes the
    session at its end."""

    def __init__(self, open: Callable[[], Coroutine[Any, Any, S]]):
        self._open = open
        self._session: S | None = None

    def __await__(self) -> Generator[Any, None, S]:
        return self._open().__await__()

    async def __aenter__(self) -> S:
        self._session = await self._open()
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session._close()


def _opening(f: Callable[A, Coroutine[Any, Any, S]]) -> Callable[A, _Opening[S]]:
    """``session`` of the core, returning an :class:`_Opening` (``await`` it or ``async
    with`` it)."""

    def call(*args: A.args, **kwargs: A.kwargs) -> _Opening[S]:
        return _Opening(lambda: f(*args, **kwargs))

    C._public(f, call)
    return call


class AsyncClient(C.ClientCore[AsyncSession]):
    """An asyncio client of sandcelld's Varlink interface (``org.sandcell.Kernel``).

    The same methods as :class:`sandcell.Client`, as coroutines. Use ``async with
    AsyncClient() as c:`` (connects at once and fails early with
    :class:`sandcell.ConnectionFailed`) or call :meth:`aclose` when done. Belongs to one event
    loop. ``on_output`` callbacks may be plain functions or coroutine functions.

    Args:
        socket: the daemon's socket path; default ``$SANDCELL_SOCKET``, else
            ``/run/sandcell/org.sandcell.Kernel``.
        node: the node identifier of this socket's daemon, if known (see
            :class:`sandcell.Client`).
        max_idle: idle connections kept for reuse.
        timeout: the default deadline of every call, seconds (``run`` and
            ``AsyncSession.execute`` take their own ``timeout=``); ``None`` (the default):
            none. As in :class:`sandcell.Client`: a cell past it is interrupted and reported
            with ``status == "timeout"``, other calls raise :class:`sandcell.Timeout`.
    """

    backend = _Asyncio()
    session_type = AsyncSession

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, node: str | None = None,
                 max_idle: int = 16, timeout: float | None = None):
        super().__init__(socket, timeout=timeout, node=node, max_idle=max_idle)

    async def __aenter__(self) -> AsyncClient:
        self._release(await self._connect())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes every idle connection; later calls raise :class:`ConnectionFailed`. A
        session it opened without ``detached_idle_seconds`` whose owner connection a restart
        of sandcelld broke is closed first, so it still ends with this client."""
        if not self._closed:
            await self._close_ownerless()
        self._close_idle()

    run = C.coroutine(C.ClientCore[AsyncSession]._run)
    host_reply = C.coroutine(C.ClientCore[AsyncSession]._host_reply)
    session = _opening(C.ClientCore[AsyncSession]._session)
    interrupt = C.coroutine(C.ClientCore[AsyncSession]._interrupt)
    interrupt_session = C.coroutine(C.ClientCore[AsyncSession]._interrupt_session)
    list_sessions = C.coroutine(C.ClientCore[AsyncSession]._list_sessions)
    submit = C.coroutine(C.ClientCore[AsyncSession]._submit)
    attach = C.coroutine(C.ClientCore[AsyncSession]._attach)
    cell_status = C.coroutine(C.ClientCore[AsyncSession]._cell_status)
    close_session = C.coroutine(C.ClientCore[AsyncSession]._close_session)
    info = C.coroutine(C.ClientCore[AsyncSession]._info)
    interface_description = C.coroutine(C.ClientCore[AsyncSession]._interface_description)
    list_environments = C.coroutine(C.ClientCore[AsyncSession]._list_environments)
