"""The asyncio client: :class:`AsyncClient` and :class:`AsyncSession`.

The same protocol code as the blocking client (``sandcell._protocol``), driven over
non-blocking sockets. Concurrent calls each take their own connection from a pool (the
daemon answers the calls of one connection one at a time), so ``asyncio.gather`` of many
``run`` calls runs them side by side, up to the daemon's admission limits. A cancelled call
closes its connection: the daemon interrupts that cell, and a session keeps its variables
(cells travel over the pool, not over the connection that keeps the session alive).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket as _socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from . import _protocol as P
from ._query import Completions, Help, op_complete, op_help
from .errors import (
    CapacityExceeded,
    ConnectionFailed,
    NoSuchHostCall,
    NoSuchSession,
    ProtocolError,
    SandcellError,
    Timeout,
    VarlinkError,
)
from .types import (
    CellResult,
    Retry,
    CellStatus,
    Environment,
    SessionSummary,
    FileInfo,
    HostCall,
    InterruptResult,
    Limits,
    Output,
    Started,
    limits_dict,
)

#: The error a cell's host call gets when the client streaming the cell has no handler.
NO_HANDLER = ("this client has no handler for host calls "
              "(pass host_call_handler= to execute or run)")

__all__ = ["AsyncClient", "AsyncSession"]

T = TypeVar("T")
OnOutput = Callable[[Output], Any]
OnStarted = Callable[[Started], Any]
#: A host-call handler: a plain function or a coroutine function of a :class:`HostCall`
#: that returns the result (a dict) or raises.
AsyncHostCallHandler = Callable[[HostCall], Any]


class _DeadlinePassed(Exception):
    """Internal: a reply did not arrive before the call's deadline (nothing was consumed)."""


class _Clock:
    """The deadline of one call (``time.monotonic()`` seconds, or ``None``) and what to do
    when it passes: ``await expire()`` returns a later deadline or raises."""

    def __init__(self, seconds: float | None, method: str,
                 expire: Callable[[], Any] | None = None):
        self.seconds = seconds
        self.method = method
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.expire = expire

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - time.monotonic()

    def timeout(self) -> Timeout:
        return Timeout(self.seconds or 0.0, self.method)


class _AConn:
    """One non-blocking connection driven by the running event loop."""

    def __init__(self, path: str):
        self.path = path
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        self.sock.setblocking(False)
        self.reader = P.MessageReader()
        self.queue: list[dict[str, Any]] = []
        self.in_call = False
        self.closed = False

    async def connect(self, timeout: float | None = None) -> None:
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

    async def send(self, call: P.Call, clock: _Clock | None = None) -> None:
        data = call.encode()
        loop = asyncio.get_running_loop()
        self.in_call = True
        if clock is not None and not clock.method:
            clock.method = call.method

        async def out() -> None:
            if call.fds:
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
            self.close()
            raise ConnectionFailed(e.errno, f"sending to {self.path}: {e}") from e

    async def reply(self, clock: _Clock | None = None) -> P.Reply:
        loop = asyncio.get_running_loop()
        while not self.queue:
            left = clock.remaining() if clock else None
            try:
                if left is not None and left <= 0:
                    raise _DeadlinePassed
                # A cancelled sock_recv consumes nothing: the connection stays in step.
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 256 * 1024), left)
            except TimeoutError:
                raise _DeadlinePassed from None
            except OSError as e:
                self.close()
                raise ConnectionFailed(e.errno, f"reading from {self.path}: {e}") from e
            if not data:
                self.close()
                raise ConnectionFailed(0, f"{self.path}: the daemon closed the connection")
            try:
                self.queue.extend(self.reader.feed(data))
            except ProtocolError:
                self.close()
                raise
        msg = self.queue.pop(0)
        try:
            r = P.parse_reply(msg)
        except VarlinkError:
            self.in_call = False
            raise
        if not r.continues:
            self.in_call = False
        return r

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


async def _reply(conn: _AConn, clock: _Clock | None) -> P.Reply:
    """The next reply, by the call's deadline (see the blocking client's ``_reply``)."""
    while True:
        try:
            return await conn.reply(clock)
        except _DeadlinePassed:
            assert clock is not None
            try:
                if clock.expire is None:
                    raise clock.timeout() from None
                clock.deadline = await clock.expire()
            except BaseException:
                conn.close()
                raise


async def _drive(conn: _AConn, op: P.Operation[T], clock: _Clock | None = None) -> T:
    """Runs an operation on a connection, by ``clock``'s deadline when given; callbacks may
    be coroutine functions."""
    value: Any = None
    try:
        step = next(op)
        while True:
            if isinstance(step, P.Call):
                await conn.send(step, clock)
                value = await _reply(conn, clock)
            elif step is P.NEXT:
                value = await _reply(conn, clock)
            elif isinstance(step, P.Emit):
                try:
                    r = step.callback(step.value)
                    if inspect.isawaitable(r):
                        await r
                except BaseException as e:  # thrown into the operation, which re-raises it
                    step = op.throw(e)
                    continue
                value = None
            step = op.send(value)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        op.close()


class AsyncClient:
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

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, node: str | None = None,
                 max_idle: int = 16, timeout: float | None = None):
        self.socket = os.fspath(socket) if socket is not None else P.default_socket()
        self.node = node
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: list[_AConn] = []
        self._closed = False

    async def _connect(self) -> _AConn:
        c = _AConn(self.socket)
        await c.connect(self.timeout)
        return c

    def _clock(self) -> _Clock | None:
        """A deadline of the client's ``timeout`` for one call on a connection of its own."""
        return None if self.timeout is None else _Clock(self.timeout, "")

    async def _acquire(self) -> _AConn:
        if self._closed:
            raise ConnectionFailed(0, "the client is closed")
        while self._idle:
            c = self._idle.pop()
            if not c.closed and P.idle_connection_alive(c.sock):
                return c
            c.close()
        return await self._connect()

    def _release(self, conn: _AConn) -> None:
        if conn.closed or conn.in_call or conn.queue or conn.reader.pending:
            conn.close()
        elif self._closed or len(self._idle) >= self.max_idle:
            conn.close()
        else:
            self._idle.append(conn)

    async def _call(self, op: P.Operation[T], timeout: Any = P.CLIENT_DEFAULT) -> T:
        seconds = P.call_timeout(timeout, self.timeout)
        conn = await self._acquire()
        try:
            return await _drive(conn, op, None if seconds is None else _Clock(seconds, ""))
        finally:
            self._release(conn)

    async def _cell(self, method: str, params: dict[str, Any], on_output: OnOutput | None,
                    on_started: OnStarted | None,
                    host_call_handler: AsyncHostCallHandler | None,
                    timeout: Any, language: str = "python") -> CellResult:
        """Runs a cell by its deadline; see the blocking client's ``_cell``."""
        seconds = P.call_timeout(timeout, self.timeout)
        started: list[Started] = []
        interrupted = False

        async def on_start(s: Started) -> None:
            started.append(s)
            if on_started is not None:
                r = on_started(s)
                if inspect.isawaitable(r):
                    await r

        async def expire() -> float:
            nonlocal interrupted
            if interrupted or not started:
                raise clock.timeout()
            interrupted = True
            s = started[0]
            try:
                await self._call(
                    P.op_interrupt(P.local_session_id(s.session, self.node), s.cell),
                    timeout=P.INTERRUPT_GRACE_SECONDS,
                )
            except SandcellError:
                pass  # it ended meanwhile, or the daemon is slow: the grace period decides
            return time.monotonic() + P.INTERRUPT_GRACE_SECONDS

        clock = _Clock(seconds, method, expire)
        op = P.op_cell(method, params, on_output, on_start, self._host_answerer(host_call_handler))
        conn = await self._acquire()
        try:
            r = await _drive(conn, op, clock if seconds is not None else None)
        except BaseException:
            # Cancelled, or an exception of a callback: the cell is interrupted and its end
            # awaited, so its session is free when the cancellation propagates.
            await self._settle(conn, started[0] if started else None)
            raise
        finally:
            self._release(conn)
        if interrupted:
            r = P.timed_out_result(r, seconds or 0.0)
        module = P.missing_module(r)
        if module is not None:
            hint = await self._module_hint(module, language)
            if hint:
                r.warnings.append(hint)
        return r

    async def _module_hint(self, module: str, language: str) -> str | None:
        """Which served environment has ``module`` (a cell failed to import it), from
        ``ListEnvironments``; None when none has it or the daemon cannot say."""
        try:
            envs = await self.list_environments()
        except SandcellError:
            return None
        return P.module_hint(module, envs, language)

    async def _settle(self, conn: _AConn, started: Started | None) -> None:
        """Ends a cell abandoned while ``conn`` still streams it: interrupts it over another
        connection and reads ``conn`` up to its result, for at most
        :data:`P.INTERRUPT_GRACE_SECONDS` (then the connection is closed and the daemon
        interrupts the cell itself). A second cancellation meanwhile stops waiting."""
        if conn.closed or not conn.in_call or started is None:
            return
        try:
            await self._call(P.op_interrupt(P.local_session_id(started.session, self.node),
                                            started.cell), timeout=P.INTERRUPT_GRACE_SECONDS)
            clock = _Clock(P.INTERRUPT_GRACE_SECONDS, "Interrupt")
            while conn.in_call and not conn.closed:
                await _reply(conn, clock)
        except (SandcellError, asyncio.CancelledError):
            conn.close()

    async def __aenter__(self) -> AsyncClient:
        self._release(await self._connect())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes every idle connection; later calls raise :class:`ConnectionFailed`."""
        self._closed = True
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    async def run(
        self,
        code: str,
        language: str = "python",
        environment: str | None = None,
        limits: Limits | dict[str, Any] | None = None,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
        host_call_handler: AsyncHostCallHandler | None = None,
        display_last_expression: bool | None = None,
        rich_output: bool = False,
        timeout: float | None | P._ClientDefault = P.CLIENT_DEFAULT,
        files: Mapping[str, Any] | Iterable[str | os.PathLike[str]] | None = None,
        retry: Retry | None = None,
    ) -> CellResult:
        """Runs ``code`` in a fresh sandbox (one-shot ``Run``); see
        :meth:`sandcell.Client.run` for arguments (``timeout``: this call's deadline;
        ``files``: input files, uploaded to a session opened for the cell; ``retry``: a
        :class:`sandcell.Retry` on ``CapacityExceeded``), result and errors. ``host_call_handler`` may be a coroutine function; the cell waits
        for it (other tasks run meanwhile)."""
        if retry is not None:
            attempt = 1
            while True:
                try:
                    return await self.run(
                        code, language, environment, limits, on_output, on_started=on_started,
                        host_call_handler=host_call_handler,
                        display_last_expression=display_last_expression,
                        rich_output=rich_output, timeout=timeout,
                        files=files)
                except CapacityExceeded as e:
                    if attempt >= max(1, retry.attempts):
                        raise
                    await asyncio.sleep(retry.delay(attempt, e))
                    attempt += 1
        inputs = P.input_files(files)
        if inputs:
            async with self.session(language, environment, limits=limits,
                                    host_calls=host_call_handler is not None,
                                    display_last_expression=display_last_expression, rich_output=rich_output) as s:
                for name, source in inputs:
                    await s.put_file(name, source)
                return await s.execute(code, on_output, on_started=on_started,
                                       host_call_handler=host_call_handler, timeout=timeout)
        params = P.run_params(code, language, environment, limits_dict(limits),
                              host_calls=host_call_handler is not None,
                              display_last_expression=display_last_expression, rich_output=rich_output)
        return await self._cell("Run", params, on_output, on_started, host_call_handler,
                                timeout, language)

    async def host_reply(self, session: str, call: int, result: dict[str, Any] | None = None,
                         error: str | None = None) -> None:
        """Answers host call ``call`` of ``session`` (``HostReply``); see
        :meth:`sandcell.Client.host_reply`."""
        params: dict[str, Any] = {"session": P.local_session_id(session, self.node), "call": call}
        if error is not None:
            params["error"] = error
        if result is not None:
            params["result"] = result
        await self._call(P.op_simple("HostReply", params))

    def _host_answerer(
        self, handler: AsyncHostCallHandler | None
    ) -> Callable[[HostCall], Any] | None:
        """The ``host_call`` frame callback for ``handler``: awaits it (when it returns an
        awaitable) and answers over another pooled connection (the cell's own one streams its
        frames until the result)."""
        if handler is None:
            # A session opened with host_calls whose execute has no handler: the cell's call
            # fails at once instead of waiting for the daemon's host-call timeout.
            async def refuse(h: HostCall) -> None:
                try:
                    await self.host_reply(h.session, h.call, None, NO_HANDLER)
                except NoSuchHostCall:
                    pass

            return refuse

        async def answer(h: HostCall) -> None:
            try:
                result, error = handler(h), None
                if inspect.isawaitable(result):
                    result = await result
                if not isinstance(result, dict):
                    result, error = None, "the host's tool returned %s, not a dict" % type(result).__name__
            except Exception as e:  # the tool's failure is the cell's error, not ours
                result, error = None, (str(e) or type(e).__name__)[: 16 * 1024 - 64]
            try:
                await self.host_reply(h.session, h.call, result, error)
            except NoSuchHostCall:
                pass  # timed out or interrupted meanwhile: the cell's result says so

        return answer

    def session(
        self,
        language: str = "python",
        environment: str | None = None,
        detached_idle_seconds: int | None = None,
        limits: Limits | dict[str, Any] | None = None,
        host_calls: bool = False,
        *,
        display_last_expression: bool | None = None,
        rich_output: bool = False,
    ) -> _Opening:
        """Opens a persistent session: ``s = await client.session()`` or ``async with
        client.session() as s:`` (closed at the end). See :meth:`sandcell.Client.session`;
        with ``host_calls``, the ``host_call_handler`` of :meth:`AsyncSession.execute`
        answers its cells' calls."""
        return _Opening(self, language, environment, detached_idle_seconds, limits,
                        display_last_expression, host_calls, rich_output)

    async def _open(self, language: str, environment: str | None,
                    detached_idle_seconds: int | None,
                    limits: Limits | dict[str, Any] | None,
                    display_last_expression: bool | None = None,
                    host_calls: bool = False, rich_output: bool = False) -> AsyncSession:
        owner = await self._connect()
        try:
            params = P.open_params(language, environment, limits_dict(limits), detached_idle_seconds,
                                   host_calls=host_calls,
                                   display_last_expression=display_last_expression,
                                   rich_output=rich_output)
            r = await _drive(owner, P.op_simple("Open", params), self._clock())
        except BaseException:
            owner.close()
            raise
        return AsyncSession(self, r["session"], r.get("engine", ""), language, owner,
                            detached=detached_idle_seconds is not None)

    def session_by_id(self, session: str, language: str = "") -> AsyncSession:
        """An :class:`AsyncSession` for an existing session of the same user, by id (may be
        node-qualified); see :meth:`sandcell.Client.session_by_id`."""
        P.local_session_id(session, self.node)
        return AsyncSession(self, session, "", language, None, detached=True)

    async def interrupt(self, session: str, cell: int) -> InterruptResult:
        """Interrupts cell ``cell`` of ``session``; see :meth:`sandcell.Client.interrupt`."""
        return await self._call(P.op_interrupt(P.local_session_id(session, self.node), cell))

    async def submit(self, session: str, code: str) -> int:
        """Starts a cell without waiting; see :meth:`sandcell.Client.submit`."""
        params = {"session": P.local_session_id(session, self.node), "code": code}
        return int((await self._call(P.op_simple("Submit", params)))["cell"])

    async def attach(
        self,
        session: str,
        cell: int,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
    ) -> CellResult:
        """Follows a cell; see :meth:`sandcell.Client.attach`."""
        params = {"session": P.local_session_id(session, self.node), "cell": cell}
        return await self._call(P.op_cell("Attach", params, on_output, on_started))

    async def interrupt_session(self, session: str) -> InterruptResult:
        """Interrupts whatever cell ``session`` runs now (``InterruptSession``), as
        :meth:`sandcell.Client.interrupt_session`."""
        return await self._call(P.op_interrupt_session(P.local_session_id(session, self.node)))

    async def list_sessions(self) -> list[SessionSummary]:
        """The caller's own sessions (``ListSessions``), as
        :meth:`sandcell.Client.list_sessions`."""
        r = await self._call(P.op_simple("ListSessions", {}))
        return list(r.get("sessions") or [])

    async def cell_status(self, session: str, cell: int) -> CellStatus:
        """A cell's state without waiting; see :meth:`sandcell.Client.cell_status`."""
        params = {"session": P.local_session_id(session, self.node), "cell": cell}
        return cast(CellStatus, await self._call(P.op_simple("CellStatus", params)))

    async def close_session(self, session: str) -> None:
        """Ends a session by id."""
        await self._call(
            P.op_simple("Close", {"session": P.local_session_id(session, self.node)})
        )

    async def info(self) -> dict[str, Any]:
        """``org.varlink.service.GetInfo``."""
        return await self._call(P.op_simple("org.varlink.service.GetInfo", {}))

    async def interface_description(self, interface: str = P.INTERFACE) -> str:
        """The running daemon's IDL of ``interface``."""
        r = await self._call(
            P.op_simple("org.varlink.service.GetInterfaceDescription", {"interface": interface})
        )
        return str(r.get("description", ""))

    async def list_environments(self) -> list[Environment]:
        """The daemon's named environments; :class:`MethodNotFound` on a daemon without."""
        r = await self._call(P.op_simple("ListEnvironments", {}))
        return list(r.get("environments") or [])


class _Opening:
    """``client.session(...)``: awaitable, and an async context manager that closes the
    session at its end."""

    def __init__(self, client: AsyncClient, *args: Any):
        self._client = client
        self._args = args
        self._session: AsyncSession | None = None

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._client._open(*self._args).__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._client._open(*self._args)
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


class AsyncSession:
    """A persistent session of an :class:`AsyncClient`; the methods of
    :class:`sandcell.Session` as coroutines."""

    def __init__(self, client: AsyncClient, session_id: str, engine: str, language: str,
                 owner: _AConn | None, *, detached: bool):
        self.client = client
        self.id = session_id
        self.engine = engine
        self.language = language
        self.detached = detached
        self.last_cell: int | None = None
        self._owner = owner
        self._local = P.local_session_id(session_id, client.node)
        self._running = False
        self._started = asyncio.Event()
        self._cell_done = asyncio.Event()
        self._cell_done.set()
        self._closed = False

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<sandcell.AsyncSession {self.id} {self.language} {self.engine!r}>"

    async def execute(
        self,
        code: str,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
        host_call_handler: AsyncHostCallHandler | None = None,
        timeout: float | None | P._ClientDefault = P.CLIENT_DEFAULT,
    ) -> CellResult:
        """Runs a cell in this session; see :meth:`sandcell.Session.execute` (``timeout``:
        this cell's deadline, seconds).
        ``host_call_handler`` (a plain or coroutine function) answers the cell's host calls
        in a session opened with ``host_calls``."""

        async def started(s: Started) -> None:
            self.last_cell = s.cell
            self._started.set()
            if on_started is not None:
                r = on_started(s)
                if inspect.isawaitable(r):
                    await r

        self._started.clear()
        self._cell_done.clear()
        self._running = True
        try:
            return await self.client._cell("Execute", {"session": self._local, "code": code},
                                           on_output, started, host_call_handler, timeout,
                                           self.language or "python")
        finally:
            self._running = False
            self._cell_done.set()

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

    async def interrupt(self, cell: int | None = None, wait_seconds: float = 5.0) -> InterruptResult:
        """Interrupts the running cell (or cell ``cell``) from another task. When that is
        this object's running :meth:`execute`, returns once the cell has ended (at most
        ``wait_seconds`` more), so the next cell is not refused with :class:`SessionBusy`."""
        if cell is None:
            if self._running:
                try:
                    await asyncio.wait_for(self._started.wait(), wait_seconds)
                except asyncio.TimeoutError:
                    pass
            if self.last_cell is None:
                return InterruptResult(False, "no cell has run in this session")
            cell = self.last_cell
        own = self._running and cell == self.last_cell
        r = await self.client._call(P.op_interrupt(self._local, cell))
        if r.delivered and own:
            try:
                await asyncio.wait_for(self._cell_done.wait(), wait_seconds)
            except asyncio.TimeoutError:
                pass
        return r

    async def put_file(self, name: str, data_or_path: Any) -> FileInfo:
        """Stores a file in the session directory; see :meth:`sandcell.Session.put_file`."""
        kind, value = P.file_source(data_or_path)
        fd, inline, size, close = P.content_fd(kind, value)
        try:
            if fd is None:
                return await self.client._call(P.op_put_inline(self._local, name, inline or b""))
            return await self.client._call(P.op_put_fd(self._local, name, fd, size))
        finally:
            if close and fd is not None:
                os.close(fd)

    async def get_file(self, name: str) -> bytes:
        """The content of a regular file of the session directory."""
        return await self.client._call(P.op_get_file(self._local, name))

    async def list_files(self) -> P.FileList:
        """The session directory's entries."""
        return await self.client._call(P.op_list_files(self._local))

    async def inspect(self, max_items: int | None = None) -> P.VariableList:
        """The session's variables between cells (see :meth:`sandcell.Session.inspect`)."""
        return await self.client._call(P.op_inspect(self._local, max_items))

    async def complete(self, code: str, cursor: int | None = None) -> Completions:
        """Completion at a cursor between cells (see :meth:`sandcell.Session.complete`)."""
        return await self.client._call(op_complete(self._local, code, cursor))

    async def help(self, code: str, cursor: int | None = None, detail: int | None = None) -> Help:
        """Help for the name at a cursor (see :meth:`sandcell.Session.help`)."""
        return await self.client._call(op_help(self._local, code, cursor, detail))

    async def delete_file(self, name: str) -> None:
        """Removes a file, symlink or empty directory."""
        await self.client._call(
            P.op_simple("DeleteFile", {"session": self._local, "name": name})
        )

    async def close(self) -> None:
        """Ends the session (idempotent; a session already gone is not an error)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._owner is not None and not self._owner.closed:
                await _drive(self._owner, P.op_simple("Close", {"session": self._local}),
                             self.client._clock())
            else:
                await self.client._call(P.op_simple("Close", {"session": self._local}))
        except (NoSuchSession, ConnectionFailed, Timeout):
            pass
        finally:
            if self._owner is not None:
                self._owner.close()
