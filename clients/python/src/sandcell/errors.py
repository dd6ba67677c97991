"""Exceptions of the sandcell client.

Every Varlink error the daemon can send becomes an exception class named after the error's
last component, carrying the error's parameters as attributes (and as the ``parameters``
dict)::

    try:
        client.run(code)
    except sandcell.CapacityExceeded as e:
        print(e.budget, e.in_use, e.requested, e.max)

The classes for ``org.sandcell.Kernel`` (see ``org.sandcell.Kernel.varlink``) are declared
here; the ``org.varlink.service`` errors that share a name (``InvalidParameter``,
``PermissionDenied``) map to the same class. An error name this module does not know yet
(a newer daemon) still gets a class of its own, made on first sight by :func:`error_class`
and derived from :class:`VarlinkError`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SandcellError",
    "ConnectionFailed",
    "ProtocolError",
    "VarlinkError",
    "SessionEnded",
    "Timeout",
    "WrongNode",
    "error_class",
    "error_from_reply",
    "KERNEL_ERRORS",
]


class SandcellError(Exception):
    """Base class of every exception this package raises."""


class ConnectionFailed(SandcellError, OSError):
    """The socket could not be reached, or the connection broke during a call.

    ``errno`` is the OS error number (0 when the daemon closed the connection);
    ``str(exc)`` is one sentence naming the socket and what to check."""

    def __str__(self) -> str:
        text = str(self.strerror) if self.strerror is not None else super().__str__()
        if text.startswith("connecting to ") and self.errno in (2, 111, 13):
            hint = {
                2: "no socket there: is sandcelld installed and its socket unit enabled? "
                   "$SANDCELL_SOCKET or socket= names another socket",
                111: "nothing listens there: is sandcelld's socket unit running?",
                13: "permission denied: the socket's mode or group does not admit this user",
            }[self.errno]
            return f"cannot reach sandcelld: {text} ({hint})"
        return text


class CallCut(ConnectionFailed):
    """The daemon closed the connection in the middle of a call (end of stream or
    ``ECONNRESET`` after the call was sent): sandcelld restarted (``systemctl restart``, a
    package upgrade, ``SIGUSR2``), crashed, or closed a connection whose message exceeded its
    bound. Reconnect at once: during a restart new connections wait on the activation socket.
    A cell of a detached session or a ``Submit`` cell goes on in the successor (follow it with
    ``Attach``); an ``Execute`` cell of a session that is not detached is interrupted and its
    session kept. A subclass of :class:`ConnectionFailed`."""

    def __str__(self) -> str:
        return (f"{super().__str__()}: the call was cut (sandcelld restarted or crashed); "
                "reconnect, and follow a running cell with Attach")


class Timeout(SandcellError, TimeoutError):
    """A call did not finish within its deadline (the ``timeout=`` of the client or of the
    call, seconds). Raised for calls other than cells, and for a cell that did not even
    start, or did not end within a grace period after the client interrupted it (a cell
    past its deadline is otherwise interrupted and returned with ``status == "timeout"``).
    Distinct from :class:`ConnectionFailed`: the daemon was reachable but slower than the
    deadline. The connection the call used is closed (the daemon then cancels what it was
    doing for it).

    Attributes:
        seconds: the deadline that passed, seconds.
        method: the Varlink method that did not finish (e.g. ``Run``).
    """

    def __init__(self, seconds: float, method: str):
        self.seconds = seconds
        self.method = method
        super().__init__(
            f"{method} did not finish within the client's deadline of {seconds:g} s "
            "(raise timeout= on the client or the call, or pass timeout=None for no deadline)"
        )


class ProtocolError(SandcellError):
    """The daemon sent something that is not a valid Varlink reply (or the stream ended
    before the call's last reply)."""


class VarlinkError(SandcellError):
    """An error reply of the daemon.

    Attributes:
        name: the full Varlink error name, e.g. ``org.sandcell.Kernel.NoSuchSession``.
        parameters: the error's parameters (a dict); each is also an attribute.
    """

    #: Parameter names the interface declares for this error (documentation and defaults).
    fields: tuple[str, ...] = ()

    def __init__(self, name: str | None = None, parameters: dict[str, Any] | None = None):
        self.name = name or f"org.sandcell.Kernel.{type(self).__name__}"
        self.parameters = dict(parameters or {})
        for f in self.fields:
            setattr(self, f, self.parameters.get(f))
        for k, v in self.parameters.items():
            if k.isidentifier() and not hasattr(VarlinkError, k) and k not in ("name",):
                setattr(self, k, v)
        super().__init__(self._message())

    def _message(self) -> str:
        """``str(exc)``: one human sentence (what happened, the limit and its configuration
        key where there is one, what to do). The machine form is :meth:`__repr__`."""
        try:
            text = self.describe()
        except Exception:  # a parameter of an unexpected type from a newer daemon
            text = None
        if text:
            return text
        short = self.name.rsplit(".", 1)[-1]
        details = "; ".join(f"{k}: {v}" for k, v in self.parameters.items())
        return f"the daemon refused the call with {short}" + (f" ({details})" if details else "")

    def describe(self) -> str | None:
        """The human sentence of this error, or ``None`` for the generic form. Subclasses
        override it."""
        return None

    def machine(self) -> str:
        """``<full error name>(param=value, ...)``: the error as the daemon sent it."""
        if not self.parameters:
            return self.name
        inner = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        return f"{self.name}({inner})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.machine()!r})"


#: Limit names of ``LimitExceeded`` that are (or lower) an operator's setting of
#: sandcelld.toml(5), by the key that sets them; the others are fixed bounds of the protocol.
LIMIT_KEYS = {
    "max_source_bytes": "max_source_bytes",
    "max_file_bytes": "max_file_bytes",
    "max_session_files_bytes": "max_session_files_bytes",
    "max_detached_idle_seconds": "max_detached_idle_seconds",
    "wall_time_seconds": "execution_wall_time_seconds",
    "fuel": "max_fuel",
    "guest_memory_bytes": "max_guest_memory_bytes",
    "stdout_bytes": "max_stdout_bytes",
    "stderr_bytes": "max_stderr_bytes",
}


# Limits on what a whole session directory holds: their value is what the session would hold
# after the call (in use plus the call's own), not what the call alone asked for.
SESSION_TOTALS = frozenset({"max_session_files_bytes", "max_session_entries", "max_listed_entries"})


def _unit(name: str) -> str:
    if name.endswith("_bytes") or name == "max_bytes":
        return " bytes"
    if name.endswith("_seconds"):
        return " s"
    return ""


def _names(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v) or "none"
    return str(v)


def _kernel(name: str, fields: tuple[str, ...], doc: str) -> type[VarlinkError]:
    return type(name, (VarlinkError,), {"fields": fields, "__doc__": doc, "__module__": __name__})


# org.sandcell.Kernel errors, by hand from the IDL (a unit test checks none is missing).


class InvalidParameter(VarlinkError):
    """A parameter is missing or malformed (``parameter``, ``reason``; the varlink service's
    own InvalidParameter has no reason)."""

    fields = ("parameter", "reason")
    parameter: str
    reason: str

    def describe(self) -> str | None:
        p, why = self.parameters.get("parameter"), self.parameters.get("reason")
        if p and why:
            return f"invalid parameter {p}: {why}"
        return f"invalid parameter {p}" if p else None


class UnsupportedLanguage(VarlinkError):
    """The language is not served by this daemon; ``supported`` lists those that are."""

    fields = ("language", "supported")
    language: str
    supported: list[str]

    def describe(self) -> str | None:
        return (f"language {self.language!r} is not served by this daemon "
                f"(it serves: {_names(self.supported)})")


class LimitExceeded(VarlinkError):
    """A per-call value exceeds its limit (e.g. source bytes): ``value`` > ``max``, both in
    the limit's unit (bytes, seconds)."""

    fields = ("limit", "value", "max")
    limit: str
    value: int
    max: int

    def describe(self) -> str | None:
        name = str(self.limit)
        unit = _unit(name)
        key = LIMIT_KEYS.get(name)
        if name in SESSION_TOTALS:
            raise_it = (f", or have an operator raise {key} in sandcelld.toml" if key
                        else " (a fixed bound of the protocol)")
            return (f"{name} exceeded: the session would hold {self.value}{unit}, at most "
                    f"{self.max}{unit}; delete files from the session (they count until "
                    f"removed){raise_it}")
        text = f"{name} exceeded: {self.value}{unit} asked, at most {self.max}{unit}"
        if name == "max_message_bytes":
            return (text + " in one call (a fixed bound of the protocol: the daemon closes a "
                    "connection on a longer message; nothing was sent); send less, and pass "
                    "large inputs as files (put_file, or files= of run)")
        if key is None:
            return text + " (a fixed bound of the protocol); send less"
        if key != name:
            return (text + f" (a request may only lower the operator's {key} of "
                    "sandcelld.toml); ask for less, or have an operator raise it")
        return text + f"; send less, or have an operator raise {key} in sandcelld.toml"


class CapacityExceeded(VarlinkError):
    """Admission refused: ``budget`` is used up (``in_use`` + ``requested`` > ``max``).
    Never queued; retry later or on another node. ``retry_after_seconds``, where the daemon
    knows it (the session start rate), is when a retry can succeed; ``None`` otherwise. The
    connection caps (``max_connections``, ``max_connections_per_uid``,
    ``connections_reserved``) refuse with this error too, then close the connection."""

    fields = ("budget", "in_use", "requested", "max", "retry_after_seconds")
    budget: str
    in_use: int
    requested: int
    max: int
    retry_after_seconds: float | None

    def describe(self) -> str | None:
        b = str(self.budget)
        where = (f"; an operator raises {b} in sandcelld.toml" if b.startswith("max_")
                 or b == "worker_uid_count" else "")
        when = ("later" if self.retry_after_seconds is None
                else f"in {float(self.retry_after_seconds):.2f} s")
        return (f"the daemon is at capacity: {b} has {self.in_use} in use of {self.max}, "
                f"{self.requested} more asked; retry {when} or on another node{where}")


class NoSuchSession(VarlinkError):
    """No such session, or not one the caller may use."""

    fields: tuple[str, ...] = ("session",)
    session: str

    def describe(self) -> str | None:
        return (f"no session {self.session} for this user (never opened, or ended and "
                "forgotten)")


class SessionEnded(NoSuchSession):
    """The session existed and has ended: ``reason`` says why (``closed``, ``disconnected``,
    ``idle_expired``, ``worker_crashed``, ``oom``, ``killed``, ``exited``, ``disk_quota``,
    ``terminated``, ``one_shot``, ``daemon_stopping``, ``daemon_restarted``; a newer daemon
    may add reasons) and ``ended_at`` when (seconds since the Unix epoch). Only the session's
    owner (and root) is told; the daemon remembers the newest 4096 ended sessions for at most
    24 hours, then answers :class:`NoSuchSession`. A subclass of :class:`NoSuchSession`, so
    code that catches that keeps working."""

    fields = ("session", "reason", "ended_at")
    session: str
    reason: str
    ended_at: float

    def describe(self) -> str | None:
        import time

        ago = ""
        if isinstance(self.ended_at, (int, float)):
            ago = f" {max(0.0, time.time() - self.ended_at):.0f} s ago"
        return f"session {self.session} ended{ago} ({self.reason}); open a new one"


class SessionBusy(VarlinkError):
    """The session is already running cell ``cell``."""

    fields = ("session", "cell")
    session: str
    cell: int

    def describe(self) -> str | None:
        return (f"session {self.session} is running cell {self.cell}; wait for it or "
                "interrupt it")


class PermissionDenied(VarlinkError):
    """polkit or the owner check refused the call (``action``)."""

    fields = ("action",)
    action: str

    def describe(self) -> str | None:
        a = self.parameters.get("action")
        return f"permission denied (polkit action {a})" if a else "permission denied"


class WorkerFailed(VarlinkError):
    """A worker could not be started or died before it was ready (``reason``)."""

    fields = ("reason",)
    reason: str

    def describe(self) -> str | None:
        return f"the worker failed: {self.reason}"


class InternalError(VarlinkError):
    """The daemon failed on its own side (a server fault: an I/O error in its state
    directory, a task of its own that did not finish). Nothing in the call was wrong and the
    session is unchanged; the call may be retried. ``operation`` names what failed,
    ``reason`` the OS error with the path relative to the session directory."""

    fields = ("operation", "reason")
    operation: str
    reason: str

    def describe(self) -> str | None:
        return (f"the daemon failed on its side ({self.operation}: {self.reason}); nothing "
                "in the call was wrong, it may be retried")


class InvalidFileName(VarlinkError):
    """A file name is refused: empty, absolute, "..", NUL or control characters, a leading
    "-", too long or too deep."""

    fields = ("name", "reason")
    name: str
    reason: str

    def describe(self) -> str | None:
        return f"invalid file name {self.name!r}: {self.reason}"


class NoSuchFile(VarlinkError):
    """The session directory has no entry of that name."""

    fields = ("name",)
    name: str

    def describe(self) -> str | None:
        return f"no file {self.name!r} in the session directory"


class NotRegularFile(VarlinkError):
    """The entry is not a regular file (``kind``: dir, symlink, special, foreign); it is not
    read or replaced."""

    fields = ("name", "kind")
    name: str
    kind: str

    def describe(self) -> str | None:
        return f"{self.name!r} is not a regular file (it is a {self.kind})"


class NoSuchEnvironment(VarlinkError):
    """No environment of that name is served; ``known`` lists the names that are (see
    :meth:`sandcell.Client.list_environments`)."""

    fields = ("environment", "known")
    environment: str
    known: list[str]

    def describe(self) -> str | None:
        return (f"no environment {self.environment!r} is served (served: "
                f"{_names(self.known)})")


class EnvironmentMismatch(VarlinkError):
    """The environment serves another language (``environment_language``) than the one
    asked for (``language``)."""

    fields = ("environment", "language", "environment_language")
    environment: str
    language: str
    environment_language: str

    def describe(self) -> str | None:
        return (f"environment {self.environment!r} serves {self.environment_language}, not "
                f"{self.language}")


class ShuttingDown(VarlinkError):
    """The daemon is shutting down and takes no new work."""

    def describe(self) -> str | None:
        return "the daemon is shutting down and takes no new work; retry in a moment"



class NoSuchCell(VarlinkError):
    """The session has no record of cell ``cell``: never started, not started by ``Submit``
    or by ``Execute`` on a detached session, or older than the session's newest 8 finished
    cells."""

    fields = ("session", "cell")
    session: str
    cell: int

    def describe(self) -> str | None:
        return f"session {self.session} has no record of cell {self.cell}"


class AttachmentReplaced(VarlinkError):
    """A newer ``Attach`` to cell ``cell`` took over; this attachment ends."""

    fields = ("session", "cell")
    session: str
    cell: int

    def describe(self) -> str | None:
        return f"a newer attach to cell {self.cell} of session {self.session} took over"


class NoSuchHostCall(VarlinkError):
    """``HostReply`` named a call that does not wait for an answer in that session (never
    made, already answered, timed out, its cell ended, or another session's call)."""

    fields = ("session", "call")
    session: str
    call: int

    def describe(self) -> str | None:
        return (f"host call {self.call} of session {self.session} does not wait for an "
                "answer (answered, timed out, or its cell ended)")


class EgressUnavailable(VarlinkError):
    """The environment has egress, but the daemon's service sandbox cannot give it (the
    shipped units allow no network until the operator links the packages' egress drop-ins);
    ``reason`` names what is missing and the drop-in. Raised by ``open`` and ``run``."""

    fields = ("environment", "reason")
    environment: str
    reason: str

    def describe(self) -> str | None:
        return f"environment {self.environment!r} has egress, but {self.reason}"


# org.varlink.service errors without a kernel namesake.


class InterfaceNotFound(VarlinkError):
    """The daemon does not offer that interface."""

    fields = ("interface",)
    interface: str

    def describe(self) -> str | None:
        return f"the daemon does not offer the interface {self.interface}"


class MethodNotFound(VarlinkError):
    """The daemon does not know the method (a daemon older than this client)."""

    fields = ("method",)
    method: str

    def describe(self) -> str | None:
        return f"the daemon does not know {self.method} (it is older than this client)"


class MethodNotImplemented(VarlinkError):
    """The daemon declares the method but does not serve it."""

    fields = ("method",)
    method: str

    def describe(self) -> str | None:
        return f"the daemon declares {self.method} but does not serve it"


class ExpectedMore(VarlinkError):
    """The method must be called with ``more``."""

    def describe(self) -> str | None:
        return "the method must be called with more (a client bug)"


class WrongNode(NoSuchSession):
    """A node-qualified session id names another node than the one this client talks to:
    ``node`` is the node the id names, ``expected`` the node of this socket (empty when its
    daemon gives unqualified ids). Raised by the client before any call when it knows its
    node (``Client(node=...)``), else by the daemon (``org.sandcell.Kernel.WrongNode``).
    Route the call to that node's socket."""

    fields = ("session", "node", "expected")
    session: str
    node: str
    expected: str | None

    def describe(self) -> str | None:
        return (f"session {self.session} belongs to node {self.node}, not this one "
                f"({self.expected or 'unqualified ids'}); call that node's socket")

    def __init__(
        self,
        session: str | None = None,
        node: str | dict[str, Any] | None = None,
        expected: str | None = None,
    ):
        if isinstance(node, dict):
            # From a daemon's error reply: (name, parameters).
            super().__init__(session, node)
        else:
            super().__init__(
                "sandcell.WrongNode", {"session": session, "node": node, "expected": expected}
            )


_REGISTRY: dict[str, type[VarlinkError]] = {
    c.__name__: c
    for c in (
        InvalidParameter,
        UnsupportedLanguage,
        LimitExceeded,
        CapacityExceeded,
        NoSuchSession,
        WrongNode,
        SessionEnded,
        SessionBusy,
        PermissionDenied,
        WorkerFailed,
        InternalError,
        InvalidFileName,
        NoSuchFile,
        NotRegularFile,
        NoSuchEnvironment,
        EnvironmentMismatch,
        ShuttingDown,
        NoSuchCell,
        AttachmentReplaced,
        NoSuchHostCall,
        EgressUnavailable,
        InterfaceNotFound,
        MethodNotFound,
        MethodNotImplemented,
        ExpectedMore,
    )
}

#: The error classes by short name, for ``org.sandcell.Kernel`` and ``org.varlink.service``.
KERNEL_ERRORS = _REGISTRY


def error_class(name: str) -> type[VarlinkError]:
    """The exception class for a Varlink error name (full or short).

    Unknown names (errors added by a newer daemon) get a class made on first sight, named
    after the short name and derived from :class:`VarlinkError`; it is then also importable
    as ``sandcell.errors.<Name>``.
    """
    short = name.rsplit(".", 1)[-1]
    cls = _REGISTRY.get(short)
    if cls is None:
        if not short.isidentifier():
            return VarlinkError
        cls = _kernel(short, (), f"The daemon's error {name}.")
        _REGISTRY[short] = cls
        globals()[short] = cls
    return cls


def error_from_reply(name: str, parameters: dict[str, Any] | None) -> VarlinkError:
    """The exception for an error reply ``{"error": name, "parameters": {...}}``."""
    return error_class(name)(name, parameters if isinstance(parameters, dict) else {})
