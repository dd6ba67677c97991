"""What the blocking and the asyncio clients share: one source for both.

Every method of :class:`sandcell.Client` and :class:`sandcell.AsyncClient` (and of their
sessions) is written once here, as a coroutine (``_run``, ``_execute``, ...), over a small
I/O interface: a connection class with ``connect``, ``send``, ``reply`` and ``close``
(:class:`ConnBase`), ``sleep`` and an event (:class:`Backend`). The asyncio client
(``sandcell.aio``) publishes these coroutines as they are, over non-blocking sockets; the
blocking client (``sandcell.client``) runs each to its end at once (:func:`blocking`) over
blocking sockets, whose coroutines never suspend. The Varlink protocol itself is the sans-IO
core in ``sandcell._protocol``; what stays in the two modules is only their I/O.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import inspect
import os
import secrets
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, cast

from . import _protocol as P
from ._query import Completions, Help, op_complete, op_help
from .errors import (
    CallCut,
    CapacityExceeded,
    ConnectionFailed,
    NoSuchCell,
    NoSuchHostCall,
    NoSuchSession,
    ProtocolError,
    SandcellError,
    SessionBusy,
    ShuttingDown,
    Timeout,
    VarlinkError,
)
from .types import (
    CellResult,
    CellStatus,
    Environment,
    FileInfo,
    HostCall,
    InterruptResult,
    Limits,
    Output,
    Retry,
    SessionSummary,
    Started,
    limits_dict,
)

#: The error a cell's host call gets when the client streaming the cell has no handler.
NO_HANDLER = ("this client has no handler for host calls "
              "(pass host_call_handler= to execute or run)")

T = TypeVar("T")
A = ParamSpec("A")
#: An ``on_output`` callback: called with each :class:`sandcell.Output` frame (with
#: :class:`sandcell.AsyncClient` it may be a coroutine function).
OnOutput = Callable[[Output], Any]
#: An ``on_started`` callback, called with the :class:`sandcell.Started` frame.
OnStarted = Callable[[Started], Any]
#: A host-call handler: a function (with :class:`sandcell.AsyncClient` also a coroutine
#: function) of a :class:`sandcell.HostCall` that returns the result (a dict) or raises.
HostCallHandler = Callable[[HostCall], Any]


class DeadlinePassed(Exception):
    """Internal: a reply did not arrive before the call's deadline (nothing was consumed)."""


class Clock:
    """The deadline of one call (``time.monotonic()`` seconds, or ``None``) and what to do
    when it passes: ``await expire()`` returns a later deadline to keep reading until (the
    cell was interrupted) or raises."""

    def __init__(self, seconds: float | None, method: str,
                 expire: Callable[[], Awaitable[float]] | None = None):
        self.seconds = seconds
        self.method = method
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.expire = expire

    def remaining(self) -> float | None:
        """Seconds left (negative once passed), or ``None`` without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - time.monotonic()

    def timeout(self) -> Timeout:
        """The :class:`sandcell.Timeout` of this call."""
        return Timeout(self.seconds or 0.0, self.method)


class ConnBase:
    """One connection's protocol state; subclasses move the bytes (``connect``, ``send``,
    ``_recv``) blocking or with asyncio. Knows whether a call is open: a connection left in
    the middle of one is closed, never reused."""

    def __init__(self, path: str, sock: Any):
        self.path = path
        self.sock = sock
        self.reader = P.MessageReader()
        self.queue: list[dict[str, Any]] = []
        self.in_call = False
        self.closed = False
        self.sent = 0  # bytes of the last call sent (named when the connection breaks)

    async def connect(self, timeout: float | None) -> None:
        """Connects to :attr:`path`, by ``timeout`` seconds; raises
        :class:`sandcell.Timeout` or :class:`sandcell.ConnectionFailed` (closed then)."""
        raise NotImplementedError

    async def send(self, call: P.Call, clock: Clock | None = None) -> None:
        """Sends ``call`` by the clock's deadline; raises :class:`sandcell.LimitExceeded`
        (nothing sent), :class:`sandcell.Timeout` or :class:`sandcell.ConnectionFailed`."""
        raise NotImplementedError

    async def _recv(self, left: float | None) -> bytes:
        """Up to 256 KiB received within ``left`` seconds (``None``: no bound); raises
        ``TimeoutError`` having consumed nothing, or ``OSError``."""
        raise NotImplementedError

    def begin(self, call: P.Call, clock: Clock | None) -> bytes:
        """The bytes of ``call``, marking the connection as in a call."""
        data = call.encode()
        self.sent = len(data)
        self.in_call = True
        if clock is not None and not clock.method:
            clock.method = call.method
        return data

    def send_failed(self, e: OSError) -> ConnectionFailed:
        """The error of a send that failed with ``e``; the connection is closed."""
        self.close()
        return ConnectionFailed(e.errno, f"sending to {self.path}: {e}{P.broken_note(self.sent)}")

    async def reply(self, clock: Clock | None = None) -> P.Reply:
        """The next reply; raises :class:`DeadlinePassed` (nothing consumed) when the clock's
        deadline passes first, the typed error of an error reply,
        :class:`sandcell.ConnectionFailed` or :class:`sandcell.ProtocolError`."""
        while not self.queue:
            left = clock.remaining() if clock else None
            if left is not None and left <= 0:
                raise DeadlinePassed
            try:
                data = await self._recv(left)
            except TimeoutError:
                raise DeadlinePassed from None
            except OSError as e:
                self.close()
                kind = CallCut if e.errno == errno.ECONNRESET else ConnectionFailed
                raise kind(
                    e.errno, f"reading from {self.path}: {e}{P.broken_note(self.sent)}"
                ) from e
            if not data:
                self.close()
                raise CallCut(0, f"{self.path}: the daemon closed the connection"
                                 f"{P.broken_note(self.sent)}")
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
        """Closes the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            self.sock.close()


class Event:
    """A flag another thread or task may wait for, over ``threading.Event`` (the blocking
    client) or ``asyncio.Event`` (:class:`sandcell.AsyncClient`); subclasses wait."""

    def __init__(self, inner: Any):
        self._e = inner

    def set(self) -> None:
        self._e.set()

    def clear(self) -> None:
        self._e.clear()

    def is_set(self) -> bool:
        return bool(self._e.is_set())

    async def wait(self, seconds: float) -> bool:
        """Returns once set (True), or after ``seconds`` (False)."""
        raise NotImplementedError


class Backend:
    """The I/O of one client kind: its connection class, sleeping and events."""

    conn: Callable[[str], ConnBase]
    #: Exceptions that end a wait for an abandoned cell early (a second cancellation).
    stop_waiting: tuple[type[BaseException], ...] = ()

    async def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def event(self) -> Event:
        raise NotImplementedError

    async def result(self, value: Any) -> Any:
        """What a callback returned, awaited first when it is awaitable (a coroutine
        function's call: with the blocking client it must not suspend)."""
        if inspect.isawaitable(value):
            return await value
        return value


async def reply(conn: ConnBase, clock: Clock | None) -> P.Reply:
    """The next reply, by the call's deadline: when it passes, ``clock.expire()`` may extend
    it (a cell being interrupted); otherwise the connection is closed and
    :class:`sandcell.Timeout` raised."""
    while True:
        try:
            return await conn.reply(clock)
        except DeadlinePassed:
            assert clock is not None
            try:
                if clock.expire is None:
                    raise clock.timeout() from None
                clock.deadline = await clock.expire()
            except BaseException:
                conn.close()
                raise


async def drive(conn: ConnBase, op: P.Operation[T], backend: Backend,
                clock: Clock | None = None) -> T:
    """Runs an operation on a connection, by ``clock``'s deadline when given; a callback's
    awaitable is awaited where ``backend`` says so."""
    value: Any = None
    try:
        step = next(op)
        while True:
            if isinstance(step, P.Call):
                await conn.send(step, clock)
                value = await reply(conn, clock)
            elif step is P.NEXT:
                value = await reply(conn, clock)
            elif isinstance(step, P.Emit):
                try:
                    await backend.result(step.callback(step.value))
                except BaseException as e:  # thrown into the operation, which re-raises it
                    step = op.throw(e)
                    continue
                value = None
            step = op.send(value)
    except StopIteration as done:
        return cast(T, done.value)
    finally:
        op.close()


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine of the blocking client to its end. Its awaits never suspend (the
    blocking connections' coroutines return when done), so one step ends it."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("a blocking sandcell call awaited something that suspends "
                       "(use sandcell.AsyncClient in asyncio code)")


def _public(f: Callable[..., Any], g: Callable[..., Any]) -> None:
    """Names ``g``, a wrapper of the core's ``f`` (``_run``), as the public method (``run``)."""
    functools.update_wrapper(g, f)
    g.__name__ = f.__name__.lstrip("_")
    g.__qualname__ = g.__name__


def blocking(f: Callable[A, Coroutine[Any, Any, T]]) -> Callable[A, T]:
    """The blocking method of a core coroutine method (same parameters and documentation)."""

    def call(*args: A.args, **kwargs: A.kwargs) -> T:
        return run_blocking(f(*args, **kwargs))

    _public(f, call)
    return call


def coroutine(f: Callable[A, Coroutine[Any, Any, T]]) -> Callable[A, Coroutine[Any, Any, T]]:
    """The coroutine method of a core coroutine method, under its public name."""

    async def call(*args: A.args, **kwargs: A.kwargs) -> T:
        return await f(*args, **kwargs)

    _public(f, call)
    return call


S = TypeVar("S", bound="SessionCore")


class ClientCore(Generic[S]):
    """The state and the methods both clients share; see :class:`sandcell.Client`."""

    backend: Backend
    session_type: Callable[..., S]
    max_idle: int

    def __init__(self, socket: str | os.PathLike[str] | None, *, timeout: float | None,
                 node: str | None, max_idle: int):
        self.socket = os.fspath(socket) if socket is not None else P.default_socket()
        self.timeout = timeout
        self.node = node
        self.max_idle = max_idle
        self._idle: list[ConnBase] = []
        self._lock = threading.Lock()
        self._closed = False
        # Sessions this client opened that end with their owner connection (not detached).
        self._owned: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- connections ------------------------------------------------------------------------

    async def _connect(self) -> ConnBase:
        c = self.backend.conn(self.socket)
        await c.connect(self.timeout)
        return c

    async def _acquire(self) -> ConnBase:
        with self._lock:
            if self._closed:
                raise ConnectionFailed(0, "the client is closed")
            while self._idle:
                c = self._idle.pop()
                if not c.closed and P.idle_connection_alive(c.sock):
                    return c
                c.close()
        return await self._connect()

    def _release(self, conn: ConnBase) -> None:
        # A connection left in the middle of a call (a cell abandoned half-way) is closed:
        # the daemon then interrupts that cell.
        if conn.closed or conn.in_call or conn.queue or conn.reader.pending:
            conn.close()
            return
        with self._lock:
            if self._closed or len(self._idle) >= self.max_idle:
                conn.close()
            else:
                self._idle.append(conn)

    async def _close_ownerless(self) -> None:
        """Before the client closes: each session it opened without ``detached_idle_seconds``
        whose owner connection broke (a restart of sandcelld, whose successor keeps the session
        without an owner until ``max_detached_idle_seconds`` idle) is closed over another
        connection, so it still ends with this client. Sessions whose owner connection is
        intact end when it closes, as before. Best effort: a daemon that cannot be reached
        leaves them to their idle timeout."""
        for s in list(self._owned):
            owner = s._owner
            if s._closed or owner is None or owner.closed or P.idle_connection_alive(owner.sock):
                continue
            try:
                await s._close()
            except SandcellError:
                pass

    def _close_idle(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    async def _call(self, op: P.Operation[T], timeout: Any = P.CLIENT_DEFAULT) -> T:
        seconds = P.call_timeout(timeout, self.timeout)
        conn = await self._acquire()
        try:
            return await drive(conn, op, self.backend,
                               None if seconds is None else Clock(seconds, ""))
        finally:
            self._release(conn)

    def _clock(self) -> Clock | None:
        """A deadline of the client's ``timeout`` for one call on a connection of its own."""
        return None if self.timeout is None else Clock(self.timeout, "")

    async def _cell(self, method: str, params: dict[str, Any], on_output: OnOutput | None,
                    on_started: OnStarted | None, host_call_handler: HostCallHandler | None,
                    timeout: Any, language: str = "python") -> CellResult:
        """Runs a cell (``Run`` or ``Execute``) by its deadline: past it, the cell is
        interrupted (over another connection) and given :data:`P.INTERRUPT_GRACE_SECONDS` to
        end; its result then says ``timeout``."""
        seconds = P.call_timeout(timeout, self.timeout)
        started: list[Started] = []
        interrupted = False

        async def on_start(s: Started) -> None:
            started.append(s)
            if on_started is not None:
                await self.backend.result(on_started(s))

        async def expire() -> float:
            nonlocal interrupted
            if interrupted or not started:
                raise clock.timeout()
            interrupted = True
            s = started[0]
            try:
                await self._call(P.op_interrupt(P.local_session_id(s.session, self.node), s.cell),
                                 timeout=P.INTERRUPT_GRACE_SECONDS)
            except SandcellError:
                pass  # it ended meanwhile, or the daemon is slow: the grace period decides
            return time.monotonic() + P.INTERRUPT_GRACE_SECONDS

        clock = Clock(seconds, method, expire)
        op = P.op_cell(method, params, on_output, on_start, self._host_answerer(host_call_handler))
        conn = await self._acquire()
        try:
            r = await drive(conn, op, self.backend, clock if seconds is not None else None)
        except BaseException:
            # KeyboardInterrupt, a cancellation, or an exception of a callback: the cell is
            # interrupted and its end awaited, so its session is free when it propagates.
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
            envs = await self._list_environments()
        except SandcellError:
            return None
        return P.module_hint(module, envs, language)

    async def _settle(self, conn: ConnBase, started: Started | None) -> None:
        """Ends a cell abandoned while ``conn`` still streams it: interrupts it over another
        connection and reads ``conn`` up to its result, for at most
        :data:`P.INTERRUPT_GRACE_SECONDS` (then the connection is closed and the daemon
        interrupts the cell itself). A second cancellation meanwhile stops waiting."""
        if conn.closed or not conn.in_call or started is None:
            return
        give_up: tuple[type[BaseException], ...] = (SandcellError, *self.backend.stop_waiting)
        try:
            await self._call(P.op_interrupt(P.local_session_id(started.session, self.node),
                                            started.cell), timeout=P.INTERRUPT_GRACE_SECONDS)
            clock = Clock(P.INTERRUPT_GRACE_SECONDS, "Interrupt")
            while conn.in_call and not conn.closed:
                await reply(conn, clock)
        except give_up:
            conn.close()

    def _host_answerer(self, handler: HostCallHandler | None) -> Callable[[HostCall], Any]:
        """The ``host_call`` frame callback for ``handler``: runs it (awaiting its awaitable
        with :class:`sandcell.AsyncClient`) and answers over another pooled connection (the
        cell's own one streams its frames until the result)."""

        async def answer(h: HostCall) -> None:
            if handler is None:
                # A session opened with host_calls whose execute has no handler: the cell's
                # call fails at once instead of waiting for the daemon's host-call timeout.
                result, error = None, NO_HANDLER
            else:
                try:
                    result, error = await self.backend.result(handler(h)), None
                    if not isinstance(result, dict):
                        result, error = None, ("the host's tool returned %s, not a dict"
                                               % type(result).__name__)
                except Exception as e:  # the tool's failure is the cell's error, not ours
                    result, error = None, (str(e) or type(e).__name__)[: 16 * 1024 - 64]
            try:
                await self._host_reply(h.session, h.call, result, error)
            except NoSuchHostCall:
                pass  # timed out or interrupted meanwhile: the cell's result says so

        return answer

    # -- methods ----------------------------------------------------------------------------

    async def _run(
        self,
        code: str,
        language: str | None = None,
        environment: str | None = None,
        limits: Limits | dict[str, Any] | None = None,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
        host_call_handler: HostCallHandler | None = None,
        display_last_expression: bool | None = None,
        rich_output: bool = False,
        timeout: float | None | P._ClientDefault = P.CLIENT_DEFAULT,
        files: Mapping[str, Any] | Iterable[str | os.PathLike[str]] | None = None,
        retry: Retry | None = None,
        egress: Sequence[str] | None = None,
    ) -> CellResult:
        """Runs ``code`` in a fresh sandbox that is discarded afterwards (one-shot ``Run``).

        Args:
            code: the cell's source (UTF-8; at most the daemon's ``max_source_bytes``).
            language: ``"python"`` or ``"r"`` (those the daemon serves). Default: the
                language of ``environment`` when one is given (from ``ListEnvironments``),
                else ``"python"``.
            environment: a named environment of the daemon (sent only when given).
            limits: lowerings of the operator's limits (:class:`sandcell.Limits`).
            on_output: called with each :class:`sandcell.Output` frame, live and in order
                (with :class:`sandcell.AsyncClient` it may be a coroutine function).
                An exception it raises abandons the cell and propagates.
            on_started: called with the :class:`sandcell.Started` frame (session, cell).
            host_call_handler: lets the cell call tools (``host_calls``): called with each
                :class:`sandcell.HostCall`; what it returns (a dict) is the call's result in
                the cell, an exception it raises is raised there (as ``HostCallError`` with
                ``str(exception)``). Without it a host call raises in the cell at once. With
                :class:`sandcell.AsyncClient` it may be a coroutine function; the cell waits
                for it (other tasks run meanwhile).
            display_last_expression: ``False`` for print()-only output: the value of the
                cell's last expression is not shown (by default it is, as in a REPL:
                Python shows the repr of a final expression that is not ``None`` and not
                followed by ``;``, R auto-prints visible values). Sent only when given.
            rich_output: ``True``: what a notebook shows comes as :class:`sandcell.Display`
                MIME bundles (``result.displays``, and to ``on_output`` in order): the last
                expression's value through the display protocol (``_repr_html_``, ...),
                ``sandcell.display(...)``, figures as ``image/png``.
            timeout: this call's deadline, seconds (default: the client's ``timeout``;
                ``None``: none). Past it the cell is interrupted and the result has
                ``status == "timeout"``; :class:`sandcell.Timeout` is raised when the cell
                had not started yet or did not end within 10 s of the interrupt.
            files: input files the cell reads from its working directory: a mapping of
                name to content (bytes, a path or a binary file, as
                :meth:`Session.put_file`), or a list of local paths stored under their file
                names. The cell then runs in a session opened for it and closed afterwards
                (``Open``, ``PutFile``..., ``Execute``, ``Close``); its result's ``state``
                is the session's. A missing local file raises ``FileNotFoundError`` before
                anything is sent.
            retry: an opt-in :class:`sandcell.Retry`: a run refused with
                :class:`CapacityExceeded` (nothing ran) is tried again after a backoff, at
                most ``retry.attempts`` calls in all; the last refusal is raised.
            egress: narrows the cell's network to these hosts (names or ``*.domain``
                wildcards), each on the environment's egress allowlist; a host outside it
                raises :class:`InvalidParameter` (parameter ``egress``) naming it, and the
                proxy answers other hosts with HTTP 403. Default: the environment's whole
                list. Sent only when given.

        Returns the :class:`sandcell.CellResult`; a cell that raised is a result with
        ``status == "error"``, not an exception. Raises the daemon's refusals as typed
        exceptions: :class:`CapacityExceeded`, :class:`LimitExceeded` (also
        ``max_message_bytes``: a call over the protocol's 4 MiB bound, refused before
        sending), :class:`UnsupportedLanguage`, :class:`InvalidParameter`,
        :class:`WorkerFailed`, ...
        """
        if retry is not None:
            attempt = 1
            while True:
                try:
                    return await self._run(
                        code, language, environment, limits, on_output, on_started=on_started,
                        host_call_handler=host_call_handler,
                        display_last_expression=display_last_expression,
                        rich_output=rich_output, timeout=timeout, files=files,
                        egress=egress)
                except CapacityExceeded as e:
                    if attempt >= max(1, retry.attempts):
                        raise
                    await self.backend.sleep(retry.delay(attempt, e))
                    attempt += 1
        language = await self._language_of(language, environment)
        inputs = P.input_files(files)
        if inputs:
            s = await self._session(language, environment, limits=limits,
                                    host_calls=host_call_handler is not None,
                                    display_last_expression=display_last_expression,
                                    rich_output=rich_output, egress=egress)
            try:
                for name, source in inputs:
                    await s._put_file(name, source)
                return await s._execute(code, on_output, on_started=on_started,
                                        host_call_handler=host_call_handler, timeout=timeout)
            finally:
                await s._close()
        params = P.run_params(code, language, environment, limits_dict(limits),
                              host_calls=host_call_handler is not None,
                              display_last_expression=display_last_expression,
                              rich_output=rich_output, egress=egress)
        return await self._cell("Run", params, on_output, on_started, host_call_handler,
                                timeout, language)

    async def _host_reply(self, session: str, call: int, result: dict[str, Any] | None = None,
                          error: str | None = None) -> None:
        """Answers host call ``call`` of ``session`` (``HostReply``): exactly one of
        ``result`` (a dict of at most 256 KiB of JSON, returned to the cell) and ``error``
        (at most 16 KiB, raised in it). Raises :class:`NoSuchHostCall` when the call does not
        wait (answered, timed out, its cell ended), :class:`LimitExceeded`,
        :class:`InvalidParameter`."""
        params: dict[str, Any] = {"session": P.local_session_id(session, self.node), "call": call}
        if error is not None:
            params["error"] = error
        if result is not None:
            params["result"] = result
        await self._call(P.op_simple("HostReply", params))

    async def _session(
        self,
        language: str | None = None,
        environment: str | None = None,
        detached_idle_seconds: int | None = None,
        limits: Limits | dict[str, Any] | None = None,
        host_calls: bool = False,
        *,
        display_last_expression: bool | None = None,
        rich_output: bool = False,
        egress: Sequence[str] | None = None,
    ) -> S:
        """Opens a persistent session (``Open``): one interpreter whose variables persist
        across cells. Use it as a context manager (``with``; ``async with`` for
        :class:`sandcell.AsyncClient`, or ``await`` it), or call its ``close``. With
        ``host_calls``, its cells may call tools (answered by the ``host_call_handler`` of
        its ``execute``).

        Args:
            language: ``"python"`` or ``"r"``. Default: the language of ``environment``
                when one is given (from ``ListEnvironments``), else ``"python"``.
            detached_idle_seconds: when set, the session survives this client (it is not
                tied to a connection) and ends after that many seconds without a cell.
            display_last_expression: ``False``: no cell of the session shows its last
                expression's value (see ``run``). Sent only when given.
            rich_output: ``True``: every cell's display bundles (see ``run``).
            egress: the session's subset of its environment's egress allowlist (see
                ``run``).

        Raises :class:`CapacityExceeded`, :class:`UnsupportedLanguage`,
        :class:`LimitExceeded`, :class:`WorkerFailed`, ...
        """
        language = await self._language_of(language, environment)
        owner = await self._connect()
        try:
            params = P.open_params(language, environment, limits_dict(limits), detached_idle_seconds,
                                   host_calls=host_calls,
                                   display_last_expression=display_last_expression,
                                   rich_output=rich_output, egress=egress)
            r = await drive(owner, P.op_simple("Open", params), self.backend, self._clock())
        except BaseException:
            owner.close()
            raise
        session = self.session_type(self, r["session"], r.get("engine", ""), language, owner,
                                    detached=detached_idle_seconds is not None)
        if detached_idle_seconds is None:
            self._owned.add(session)
        return session

    def session_by_id(self, session: str, language: str = "") -> S:
        """A session object for an existing session of the same user, by id (for example a
        detached one opened by another process). The id may be node-qualified
        (``<node>.<id>``). Nothing is checked until the first call
        (:class:`NoSuchSession` then); its ``close`` ends the session.
        """
        P.local_session_id(session, self.node)
        return self.session_type(self, session, "", language, None, detached=True)

    async def _interrupt(self, session: str, cell: int) -> InterruptResult:
        """Interrupts cell ``cell`` of ``session`` (any session of the same user). The
        session keeps its variables. ``delivered`` is False, with a reason, when that cell is
        not running."""
        return await self._call(P.op_interrupt(P.local_session_id(session, self.node), cell))

    async def _interrupt_session(self, session: str) -> InterruptResult:
        """Interrupts whatever cell ``session`` runs now, without knowing its number
        (``InterruptSession``; any session of the same user). ``cell`` in the answer is the
        cell that was running; ``delivered`` is False with reason ``not_running`` when none
        was. Raises :class:`NoSuchSession`."""
        return await self._call(P.op_interrupt_session(P.local_session_id(session, self.node)))

    async def _list_sessions(self) -> list[SessionSummary]:
        """The caller's own sessions (its uid's, opened from any connection), oldest first
        (``ListSessions``; at most 1000)."""
        r = await self._call(P.op_simple("ListSessions", {}))
        return list(r.get("sessions") or [])

    async def _submit(self, session: str, code: str) -> int:
        """Starts ``code`` as the next cell of ``session`` and returns its number at once
        (``Submit``). The cell runs on without this client; its output is retained (the first
        and last 64 KiB of each stream) for ``attach``. A call cut by a daemon restart is
        repeated with the same cell token, so the code is started once. Raises
        :class:`SessionBusy`, :class:`NoSuchSession`, :class:`CapacityExceeded`
        (``retained_output_bytes``), ..."""
        params = {"session": P.local_session_id(session, self.node), "code": code,
                  "token": secrets.token_hex(16)}
        try:
            return int((await self._call(P.op_simple("Submit", params)))["cell"])
        except CallCut:
            pass
        r = await self._repeat(lambda: self._call(P.op_simple("Submit", params)))
        return int(r["cell"])

    async def _repeat(self, call: Callable[[], Awaitable[T]]) -> T:
        """Repeats ``call`` (a cell call whose ``token`` names its cell) after a daemon restart
        cut it, on a new connection to the same socket: up to :data:`P.REATTACH_ATTEMPTS`
        attempts, waiting :data:`P.REATTACH_FIRST_DELAY_SECONDS` doubled after each failure
        (at most :data:`P.REATTACH_MAX_DELAY_SECONDS`) while the daemon is not back
        (:class:`ConnectionFailed`, :class:`ShuttingDown`). The daemon follows the cell the
        cut call started, or starts it if none did. Raises the last :class:`CallCut` once the
        attempts are spent, and any other error (:class:`SessionEnded`, ...) at once."""
        delay = P.REATTACH_FIRST_DELAY_SECONDS
        last: SandcellError | None = None
        for _ in range(P.REATTACH_ATTEMPTS):
            await self.backend.sleep(delay)
            delay = min(delay * 2, P.REATTACH_MAX_DELAY_SECONDS)
            try:
                return await call()
            except (ConnectionFailed, ShuttingDown) as e:
                last = e
        assert last is not None
        raise last

    async def _attach(
        self,
        session: str,
        cell: int,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
    ) -> CellResult:
        """Follows cell ``cell`` of ``session`` (``Attach``): the retained output, then live
        output, until its :class:`sandcell.CellResult` (``raw["retained"]`` has the bytes
        seen, kept and dropped per stream). Raises :class:`NoSuchCell`,
        :class:`AttachmentReplaced` (a newer attach took over)."""
        params = {"session": P.local_session_id(session, self.node), "cell": cell}
        return await self._call(P.op_cell("Attach", params, on_output, on_started))

    async def _cell_status(self, session: str, cell: int) -> CellStatus:
        """The cell's state without waiting (``CellStatus``): ``{"state": "running"}``, or
        its status (``"ok"``, ``"error"``, ...) with ``"result"`` (the daemon's result dict,
        with ``retained`` counts). Raises :class:`NoSuchCell`."""
        params = {"session": P.local_session_id(session, self.node), "cell": cell}
        return cast(CellStatus, await self._call(P.op_simple("CellStatus", params)))

    async def _close_session(self, session: str) -> None:
        """Ends a session by id: its worker and everything it started are killed."""
        await self._call(
            P.op_simple("Close", {"session": P.local_session_id(session, self.node)})
        )

    async def _info(self) -> dict[str, Any]:
        """The daemon's ``org.varlink.service.GetInfo``: vendor, product, version,
        interfaces."""
        return await self._call(P.op_simple("org.varlink.service.GetInfo", {}))

    async def _interface_description(self, interface: str = P.INTERFACE) -> str:
        """The running daemon's IDL of ``interface`` (``GetInterfaceDescription``)."""
        r = await self._call(
            P.op_simple("org.varlink.service.GetInterfaceDescription", {"interface": interface})
        )
        return str(r.get("description", ""))

    async def _language_of(self, language: str | None, environment: str | None) -> str:
        """``language`` when given; else the language of the named ``environment`` as the
        daemon reports it (one ``ListEnvironments``); else ``"python"``. An environment the
        daemon does not list (or a daemon without ``ListEnvironments``) gives ``"python"``:
        the daemon then answers the call with its own error."""
        if language is not None:
            return language
        if environment is None:
            return "python"
        try:
            envs = await self._list_environments()
        except SandcellError:
            return "python"
        for e in envs:
            if e.get("name") == environment:
                return str(e.get("language") or "python")
        return "python"

    async def _list_environments(self) -> list[Environment]:
        """The daemon's named environments (``ListEnvironments``), as the daemon reports
        them. Raises :class:`MethodNotFound` on a daemon without environments."""
        r = await self._call(P.op_simple("ListEnvironments", {}))
        return list(r.get("environments") or [])


class SessionCore:
    """A persistent session: cells share one interpreter and one directory.

    Attributes:
        id: the session id as the daemon gave it (may be node-qualified).
        engine: the interpreter's description, e.g. ``"eryx 0.10.1"``.
        language: the language it was opened with.
        detached: True when it does not end with this client.
        last_cell: the number of the last cell started, or ``None``.
    """

    def __init__(self, client: ClientCore[Any], session_id: str, engine: str, language: str,
                 owner: ConnBase | None, *, detached: bool):
        self.client = client
        self.id = session_id
        self.engine = engine
        self.language = language
        self.detached = detached
        self.last_cell: int | None = None
        self._owner = owner
        self._local = P.local_session_id(session_id, client.node)
        self._running = client.backend.event()
        self._started = client.backend.event()
        self._cell_done = client.backend.event()
        self._cell_done.set()
        self._closed = False
        # Its owner connection broke (a restart of sandcelld) before a Close was delivered.
        self._owner_lost = False

    def __repr__(self) -> str:
        return f"<sandcell.{type(self).__name__} {self.id} {self.language} {self.engine!r}>"

    async def _execute(
        self,
        code: str,
        on_output: OnOutput | None = None,
        *,
        on_started: OnStarted | None = None,
        host_call_handler: HostCallHandler | None = None,
        timeout: float | None | P._ClientDefault = P.CLIENT_DEFAULT,
    ) -> CellResult:
        """Runs a cell in this session; its variables persist for the next cell.

        ``on_output`` is called with each :class:`sandcell.Output` frame, live and in order.
        ``timeout`` is this cell's deadline, seconds (default: the client's; ``None``: none):
        past it the cell is interrupted, the session keeps its variables and the result has
        ``status == "timeout"`` (see the client's ``run``). ``host_call_handler`` answers the
        cell's host calls in a session opened with ``host_calls`` (see ``run``).
        Returns the :class:`sandcell.CellResult` (a cell that raised has ``status ==
        "error"``). Raises :class:`NoSuchSession` (closed or expired), :class:`SessionBusy`
        (a cell of another caller is running), :class:`LimitExceeded`, ...
        """
        backend = self.client.backend

        async def started(s: Started) -> None:
            self.last_cell = s.cell
            if self._started.is_set():
                return  # the repeat of a cut call: the caller heard of its cell already
            self._started.set()
            if on_started is not None:
                await backend.result(on_started(s))

        # A detached session's cell gets a token: a call cut by a daemon restart is repeated
        # with it, and the daemon follows the cell it started (if it did) instead of running
        # the code twice.
        params: dict[str, Any] = {"session": self._local, "code": code}
        if self.detached:
            params["token"] = secrets.token_hex(16)

        # What was delivered, so that the replay of a re-attach repeats nothing: characters
        # per stream (the replay may chunk them differently) and display frames by number.
        chars: dict[str, int] = {}
        displays: set[int] = set()

        async def output(o: Any) -> None:
            if isinstance(o, Output):
                chars[o.stream] = chars.get(o.stream, 0) + len(o.text)
            else:
                displays.add(o.seq)
            if on_output is not None:
                await backend.result(on_output(o))

        self._started.clear()
        self._cell_done.clear()
        self._running.set()
        try:
            try:
                return await self.client._cell(
                    "Execute", params, output, started, host_call_handler, timeout,
                    self.language or "python")
            except CallCut as e:
                if "token" not in params:
                    raise
                cut = e

            skip = dict(chars)

            async def fresh(o: Any) -> None:
                if isinstance(o, Output):
                    n = min(skip.get(o.stream, 0), len(o.text))
                    skip[o.stream] = skip.get(o.stream, 0) - n
                    if n == len(o.text):
                        return
                    if n:
                        o = dataclasses.replace(o, text=o.text[n:])
                elif o.seq in displays:
                    return
                await output(o)

            try:
                return await self.client._repeat(
                    lambda: self.client._cell("Execute", params, fresh, started,
                                              host_call_handler, timeout,
                                              self.language or "python"))
            except (NoSuchCell, SessionBusy):
                # The cell ran, but nothing of it is kept to follow (a session that ends with
                # its connection, opened here by id): the cut stands.
                raise cut from None
        finally:
            self._running.clear()
            self._cell_done.set()

    async def _interrupt(self, cell: int | None = None,
                         wait_seconds: float = 5.0) -> InterruptResult:
        """Interrupts the running cell (or cell ``cell``); for use from another thread (or
        task) while ``execute`` runs. Without ``cell``, waits up to ``wait_seconds`` for the
        running cell's number. The session keeps its variables.

        When the interrupted cell is this object's running ``execute``, returns only once
        that cell has ended (at most ``wait_seconds`` more), so the session takes the next
        cell at once (no :class:`SessionBusy`)."""
        if cell is None:
            if self._running.is_set():
                await self._started.wait(wait_seconds)
            if self.last_cell is None:
                return InterruptResult(False, "no cell has run in this session")
            cell = self.last_cell
        own = self._running.is_set() and cell == self.last_cell
        r = await self.client._call(P.op_interrupt(self._local, cell))
        if r.delivered and own:
            await self._cell_done.wait(wait_seconds)
        return r

    async def _put_file(self, name: str, data_or_path: Any) -> FileInfo:
        """Stores a file in the session directory (mode 0600), replacing a regular file of
        that name atomically.

        ``data_or_path`` is the content (bytes; up to 2 MiB sent inline, larger through a
        staged unnamed file's descriptor), a path (str or ``os.PathLike``: the file is opened
        here and its descriptor passed to the daemon, so it is never read into memory), or an
        open binary file (its descriptor is passed). Returns the stored file's
        :class:`FileInfo`.

        Raises :class:`LimitExceeded` (``max_file_bytes``, ``max_session_files_bytes``),
        :class:`InvalidFileName`, :class:`NotRegularFile`, :class:`SessionBusy`,
        :class:`NoSuchSession`; ``OSError`` when the local file cannot be opened.
        """
        kind, value = P.file_source(data_or_path)
        fd, inline, size, close = P.content_fd(kind, value)
        try:
            if fd is None:
                return await self.client._call(P.op_put_inline(self._local, name, inline or b""))
            return await self.client._call(P.op_put_fd(self._local, name, fd, size))
        finally:
            if close and fd is not None:
                os.close(fd)

    async def _get_file(self, name: str) -> bytes:
        """The content of a regular file of the session directory (read in 1 MiB chunks).

        Raises :class:`NoSuchFile`, :class:`NotRegularFile` (a directory, symlink or special
        file), :class:`InvalidFileName`, :class:`NoSuchSession`."""
        return await self.client._call(P.op_get_file(self._local, name))

    async def _list_files(self) -> P.FileList:
        """The session directory's entries (lstat, never followed; at most 1000 entries,
        4 levels deep; ``.truncated`` when some were left out)."""
        return await self.client._call(P.op_list_files(self._local))

    async def _inspect(self, max_items: int | None = None) -> P.VariableList:
        """The session's variables between cells, in name order: :class:`Variable` (name,
        type, approximate size, shape, short repr), at most ``max_items`` (1 to 1000; the
        daemon's default is 100; ``.truncated`` when more exist). Not a cell: cell numbers and
        history (``_``, R's ``.Last.value``) stay as they were.

        Raises :class:`SessionBusy` while a cell runs, :class:`LimitExceeded` for
        ``max_items`` over 1000, :class:`WorkerFailed` when the worker did not answer in time
        (the session ended)."""
        return await self.client._call(P.op_inspect(self._local, max_items))

    async def _complete(self, code: str, cursor: int | None = None) -> Completions:
        """Completion at ``cursor`` (characters; None: the end) of ``code``, between cells:
        :class:`Completions` (``matches`` replacing ``code[cursor_start:cursor_end]``). Python
        completes through rlcompleter and module names, R through its own completion. Not a
        cell.

        Raises :class:`SessionBusy` while a cell runs, :class:`LimitExceeded` for code over
        ``max_source_bytes``, :class:`InvalidParameter` for a cursor past the end,
        :class:`WorkerFailed` when the worker did not answer in time (the session ended)."""
        return await self.client._call(op_complete(self._local, code, cursor))

    async def _help(
        self, code: str, cursor: int | None = None, detail: int | None = None
    ) -> Help:
        """Help for the name at ``cursor`` of ``code`` (or the call it is in): :class:`Help`
        (``found``, a MIME bundle: signature and docstring, R's help page; ``detail=1`` adds
        the source). Not a cell; raises as :meth:`complete`."""
        return await self.client._call(op_help(self._local, code, cursor, detail))

    async def _delete_file(self, name: str) -> None:
        """Removes a file, symlink (the link itself) or empty directory."""
        await self.client._call(
            P.op_simple("DeleteFile", {"session": self._local, "name": name})
        )

    async def _close(self) -> None:
        """Ends the session: its worker and everything it started are killed and reaped.
        Idempotent; a session that is already gone is not an error.

        When the session's owner connection broke (a restart of sandcelld: the successor
        keeps the session without an owner, until ``max_detached_idle_seconds`` idle), the
        ``Close`` goes over another connection; if that cannot reach the daemon either, it
        raises :class:`ConnectionFailed` and a later ``close`` tries again."""
        if self._closed:
            return
        try:
            if self._owner is not None and not self._owner.closed:
                try:
                    await drive(self._owner, P.op_simple("Close", {"session": self._local}),
                                self.client.backend, self.client._clock())
                    self._closed = True
                    return
                except ConnectionFailed:
                    self._owner_lost = True
            await self.client._call(P.op_simple("Close", {"session": self._local}))
        except NoSuchSession:
            # It already ended (expired, crashed, closed elsewhere).
            pass
        except (ConnectionFailed, Timeout):
            if self._owner_lost:
                raise
        finally:
            if self._owner is not None:
                self._owner.close()
        self._closed = True

