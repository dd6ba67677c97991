"""The blocking client: :class:`Client` and its :class:`Session`.

A :class:`Client` keeps a small pool of connections to the daemon's socket, so that it may
be shared by threads: each call takes an idle connection (or opens one) and gives it back
when its last reply is in. A :class:`Session` is opened on a connection of its own that
stays idle and keeps the session alive (a session that is not detached ends when that
connection closes); its cells and files travel over the pool. So a cell abandoned half-way
(an exception in ``on_output``, ``KeyboardInterrupt``) costs that cell only: its connection
is closed, the daemon interrupts the cell, and the session keeps its variables.

The methods are those of ``sandcell._core``, shared with :class:`sandcell.AsyncClient`, each
run to its end at once over blocking sockets; this module holds only that I/O.
"""

from __future__ import annotations

import os
import socket as _socket
import threading
import time
from typing import Any

from . import _core as C
from . import _protocol as P
from .errors import ConnectionFailed, Timeout

__all__ = ["Client", "Session"]

#: The error a cell's host call gets when the client streaming the cell has no handler.
NO_HANDLER = C.NO_HANDLER
OnOutput = C.OnOutput
OnStarted = C.OnStarted
HostCallHandler = C.HostCallHandler


class _Conn(C.ConnBase):
    """One blocking connection. Its coroutines never suspend: each returns when done."""

    def __init__(self, path: str):
        super().__init__(
            path, _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC))

    async def connect(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except TimeoutError as e:
            self.close()
            raise Timeout(timeout or 0.0, f"connecting to {self.path}") from e
        except OSError as e:
            self.close()
            raise ConnectionFailed(e.errno, f"connecting to {self.path}: {e.strerror or e}") from e
        # Calls wait by their own deadlines (see Clock), never by a socket timeout.
        self.sock.settimeout(None)

    async def send(self, call: P.Call, clock: C.Clock | None = None) -> None:
        data = self.begin(call, clock)
        left = clock.remaining() if clock else None
        try:
            if left is not None:
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            if call.fds:
                # The descriptors travel with the first bytes of the message.
                n = _socket.send_fds(self.sock, [data], list(call.fds))
                if n < len(data):
                    self.sock.sendall(data[n:])
            else:
                self.sock.sendall(data)
        except TimeoutError:
            # Part of a call may be out: the connection is out of step.
            self.close()
            raise (clock.timeout() if clock else Timeout(0.0, call.method)) from None
        except OSError as e:
            raise self.send_failed(e) from e
        finally:
            if left is not None and not self.closed:
                self.sock.settimeout(None)

    async def _recv(self, left: float | None) -> bytes:
        if left is not None:
            self.sock.settimeout(left)
        try:
            data: bytes = self.sock.recv(256 * 1024)
            return data
        finally:
            if left is not None and not self.closed:
                self.sock.settimeout(None)


class _Event(C.Event):
    async def wait(self, seconds: float) -> bool:
        return bool(self._e.wait(seconds))


class _Blocking(C.Backend):
    conn = _Conn

    async def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def event(self) -> C.Event:
        return _Event(threading.Event())


class Session(C.SessionCore):
    __doc__ = C.SessionCore.__doc__

    client: Client

    execute = C.blocking(C.SessionCore._execute)
    interrupt = C.blocking(C.SessionCore._interrupt)
    put_file = C.blocking(C.SessionCore._put_file)
    get_file = C.blocking(C.SessionCore._get_file)
    list_files = C.blocking(C.SessionCore._list_files)
    inspect = C.blocking(C.SessionCore._inspect)
    complete = C.blocking(C.SessionCore._complete)
    help = C.blocking(C.SessionCore._help)
    delete_file = C.blocking(C.SessionCore._delete_file)
    close = C.blocking(C.SessionCore._close)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(C.ClientCore[Session]):
    """A blocking client of sandcelld's Varlink interface (``org.sandcell.Kernel``).

    Args:
        socket: the daemon's socket path; default ``$SANDCELL_SOCKET``, else
            ``/run/sandcell/org.sandcell.Kernel``.
        timeout: the default deadline of every call, seconds (each of :meth:`run`,
            :meth:`Session.execute`, ... may give its own ``timeout=``); ``None`` (the
            default): no deadline, a cell runs as long as its wall-time limit lets it. A
            cell past its deadline is interrupted and its result has ``status ==
            "timeout"``; any other call past it raises :class:`sandcell.Timeout` (not
            :class:`ConnectionFailed`). It bounds connecting, too. Idle time between
            calls is never counted.
        node: the node identifier of this socket's daemon, if known. A node-qualified
            session id (``<node>.<id>``) of another node is then refused locally with
            :class:`sandcell.WrongNode` instead of reaching the wrong daemon.

    Raises :class:`sandcell.ConnectionFailed` when the socket cannot be reached. Usable as a
    context manager; :meth:`close` closes every connection (sessions that are not detached
    end with them; one whose owner connection a restart of sandcelld broke is closed
    explicitly). Safe to share between threads.
    """

    backend = _Blocking()
    session_type = Session

    def __init__(
        self, socket: str | os.PathLike[str] | None = None, *, timeout: float | None = None,
        node: str | None = None,
    ):
        super().__init__(socket, timeout=timeout, node=node, max_idle=8)
        # Fails early when the socket is unreachable.
        self._release(C.run_blocking(self._connect()))

    def close(self) -> None:
        """Closes every idle connection; later calls raise :class:`ConnectionFailed`. A
        session it opened without ``detached_idle_seconds`` whose owner connection a restart
        of sandcelld broke is closed first, so it still ends with this client."""
        if not self._closed:
            C.run_blocking(self._close_ownerless())
        self._close_idle()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    run = C.blocking(C.ClientCore[Session]._run)
    host_reply = C.blocking(C.ClientCore[Session]._host_reply)
    session = C.blocking(C.ClientCore[Session]._session)
    interrupt = C.blocking(C.ClientCore[Session]._interrupt)
    interrupt_session = C.blocking(C.ClientCore[Session]._interrupt_session)
    list_sessions = C.blocking(C.ClientCore[Session]._list_sessions)
    submit = C.blocking(C.ClientCore[Session]._submit)
    attach = C.blocking(C.ClientCore[Session]._attach)
    cell_status = C.blocking(C.ClientCore[Session]._cell_status)
    close_session = C.blocking(C.ClientCore[Session]._close_session)
    info = C.blocking(C.ClientCore[Session]._info)
    interface_description = C.blocking(C.ClientCore[Session]._interface_description)
    list_environments = C.blocking(C.ClientCore[Session]._list_environments)
