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
    "WrongNode",
    "error_class",
    "error_from_reply",
    "KERNEL_ERRORS",
]


class SandcellError(Exception):
    """Base class of every exception this package raises."""


class ConnectionFailed(SandcellError, OSError):
    """The socket could not be reached, or the connection broke during a call."""


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
        if not self.parameters:
            return self.name
        inner = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        return f"{self.name}({inner})"


def _kernel(name: str, fields: tuple[str, ...], doc: str) -> type[VarlinkError]:
    return type(name, (VarlinkError,), {"fields": fields, "__doc__": doc, "__module__": __name__})


# org.sandcell.Kernel errors, by hand from the IDL (a unit test checks none is missing).


class InvalidParameter(VarlinkError):
    """A parameter is missing or malformed (``parameter``, ``reason``; the varlink service's
    own InvalidParameter has no reason)."""

    fields = ("parameter", "reason")


class UnsupportedLanguage(VarlinkError):
    """The language is not served by this daemon; ``supported`` lists those that are."""

    fields = ("language", "supported")


class LimitExceeded(VarlinkError):
    """A per-call value exceeds its limit (e.g. source bytes): ``value`` > ``max``, both in
    the limit's unit (bytes, seconds)."""

    fields = ("limit", "value", "max")


class CapacityExceeded(VarlinkError):
    """Admission refused: ``budget`` is used up (``in_use`` + ``requested`` > ``max``).
    Never queued; retry later or on another node."""

    fields = ("budget", "in_use", "requested", "max")


class NoSuchSession(VarlinkError):
    """No such session, or not one the caller may use."""

    fields: tuple[str, ...] = ("session",)


class SessionEnded(NoSuchSession):
    """The session existed and has ended: ``reason`` says why (``closed``, ``disconnected``,
    ``idle_expired``, ``worker_crashed``, ``oom``, ``killed``, ``exited``, ``disk_quota``,
    ``terminated``, ``one_shot``, ``daemon_stopping``, ``daemon_restarted``; a newer daemon
    may add reasons) and ``ended_at`` when (seconds since the Unix epoch). Only the session's
    owner (and root) is told; the daemon remembers the newest 4096 ended sessions for at most
    24 hours, then answers :class:`NoSuchSession`. A subclass of :class:`NoSuchSession`, so
    code that catches that keeps working."""

    fields = ("session", "reason", "ended_at")


class SessionBusy(VarlinkError):
    """The session is already running cell ``cell``."""

    fields = ("session", "cell")


class PermissionDenied(VarlinkError):
    """polkit or the owner check refused the call (``action``)."""

    fields = ("action",)


class WorkerFailed(VarlinkError):
    """A worker could not be started or died before it was ready (``reason``)."""

    fields = ("reason",)


class InternalError(VarlinkError):
    """The daemon failed on its own side (a server fault: an I/O error in its state
    directory, a task of its own that did not finish). Nothing in the call was wrong and the
    session is unchanged; the call may be retried. ``operation`` names what failed,
    ``reason`` the OS error with the path relative to the session directory."""

    fields = ("operation", "reason")


class InvalidFileName(VarlinkError):
    """A file name is refused: empty, absolute, "..", NUL or control characters, a leading
    "-", too long or too deep."""

    fields = ("name", "reason")


class NoSuchFile(VarlinkError):
    """The session directory has no entry of that name."""

    fields = ("name",)


class NotRegularFile(VarlinkError):
    """The entry is not a regular file (``kind``: dir, symlink, special, foreign); it is not
    read or replaced."""

    fields = ("name", "kind")


class NoSuchEnvironment(VarlinkError):
    """No environment of that name is served; ``known`` lists the names that are (see
    :meth:`sandcell.Client.list_environments`)."""

    fields = ("environment", "known")


class EnvironmentMismatch(VarlinkError):
    """The environment serves another language (``environment_language``) than the one
    asked for (``language``)."""

    fields = ("environment", "language", "environment_language")


class ShuttingDown(VarlinkError):
    """The daemon is shutting down and takes no new work."""


class NoSuchCell(VarlinkError):
    """The session has no record of cell ``cell``: never started, not started by ``Submit``
    or by ``Execute`` on a detached session, or older than the session's newest 8 finished
    cells."""

    fields = ("session", "cell")


class AttachmentReplaced(VarlinkError):
    """A newer ``Attach`` to cell ``cell`` took over; this attachment ends."""

    fields = ("session", "cell")


class NoSuchHostCall(VarlinkError):
    """``HostReply`` named a call that does not wait for an answer in that session (never
    made, already answered, timed out, its cell ended, or another session's call)."""

    fields = ("session", "call")


# org.varlink.service errors without a kernel namesake.


class InterfaceNotFound(VarlinkError):
    """The daemon does not offer that interface."""

    fields = ("interface",)


class MethodNotFound(VarlinkError):
    """The daemon does not know the method (a daemon older than this client)."""

    fields = ("method",)


class MethodNotImplemented(VarlinkError):
    """The daemon declares the method but does not serve it."""

    fields = ("method",)


class ExpectedMore(VarlinkError):
    """The method must be called with ``more``."""


class WrongNode(NoSuchSession):
    """A node-qualified session id names another node than the one this client talks to:
    ``node`` is the node the id names, ``expected`` the node of this socket (empty when its
    daemon gives unqualified ids). Raised by the client before any call when it knows its
    node (``Client(node=...)``), else by the daemon (``org.sandcell.Kernel.WrongNode``).
    Route the call to that node's socket."""

    fields = ("session", "node", "expected")

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
