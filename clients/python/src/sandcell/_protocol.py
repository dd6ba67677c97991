"""The Varlink protocol of ``org.sandcell.Kernel`` without any I/O (sans-IO).

Both :class:`sandcell.Client` (blocking sockets) and :class:`sandcell.AsyncClient` (asyncio)
drive the same code here:

* :func:`encode_call` turns a call into bytes: one JSON object and a NUL terminator;
* :class:`MessageReader` turns received bytes back into messages (bounded in size);
* :func:`parse_reply` turns a message into a :class:`Reply` or raises the typed error;
* each method is an *operation*: a generator that yields :class:`Call` (send this call and
  give me its first reply), :data:`NEXT` (give me the next reply of the streaming call) and
  :class:`Emit` (call this user callback with this value), and returns the method's result.
  A driver only moves bytes and calls callbacks.

Varlink (https://varlink.org): a call is ``{"method": ..., "parameters": {...}}`` with
``"more": true`` for a streaming call; replies are ``{"parameters": {...}}``, with
``"continues": true`` on all but the last reply of a streaming call; an error is
``{"error": "<interface>.<Name>", "parameters": {...}}`` and ends the call. Calls on one
connection are answered in order, one at a time.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import LimitExceeded, ProtocolError, WrongNode, error_from_reply
from .types import (
    CellResult,
    Display,
    FileInfo,
    HostCall,
    InterruptResult,
    Output,
    Started,
    Variable,
)

INTERFACE = "org.sandcell.Kernel"
#: The daemon's socket when neither an argument nor ``SANDCELL_SOCKET`` names one.
DEFAULT_SOCKET = "/run/sandcell/org.sandcell.Kernel"
#: Largest reply accepted, bytes. The daemon's largest is a GetFile chunk (1 MiB of data,
#: about 1.4 MiB as base64) or a batch of output frames (256 KiB plus one frame).
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Largest Varlink message the daemon reads, bytes (the terminating NUL excluded): the
#: protocol's fixed bound (``MAX_MESSAGE_BYTES`` of the daemon's ``sandcell-proto`` crate,
#: stated in the interface description's opening comment). The daemon closes a connection
#: whose message is longer, so the client refuses such a call before sending it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: The ``limit`` of the :class:`sandcell.LimitExceeded` a call over
#: :data:`MAX_MESSAGE_BYTES` raises.
MESSAGE_LIMIT = "max_message_bytes"
#: Calls at least this long (bytes) are named in the error of a connection that broke while
#: they were sent or answered: the daemon may have closed it for the message's size.
LARGE_CALL_BYTES = 64 * 1024
#: Largest file content sent inline (base64) with PutFile, bytes; larger content is passed
#: as a file descriptor.
MAX_INLINE_BYTES = 2 * 1024 * 1024
#: Largest chunk one GetFile call returns, bytes.
MAX_CHUNK_BYTES = 1024 * 1024


def default_socket() -> str:
    """``$SANDCELL_SOCKET`` if set, else ``/run/sandcell/org.sandcell.Kernel``."""
    return os.environ.get("SANDCELL_SOCKET") or DEFAULT_SOCKET


def encode_call(
    method: str, parameters: dict[str, Any] | None = None, *, more: bool = False
) -> bytes:
    """The bytes of one Varlink call: ``method`` is the full name (``org.sandcell.Kernel.Run``)
    or a short name of ``org.sandcell.Kernel``. Raises :class:`sandcell.LimitExceeded`
    (``limit == "max_message_bytes"``) for a call longer than :data:`MAX_MESSAGE_BYTES`:
    nothing is sent."""
    if "." not in method:
        method = f"{INTERFACE}.{method}"
    msg: dict[str, Any] = {"method": method}
    if parameters:
        msg["parameters"] = parameters
    if more:
        msg["more"] = True
    data = json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_MESSAGE_BYTES:
        raise LimitExceeded(parameters={"limit": MESSAGE_LIMIT, "value": len(data),
                                        "max": MAX_MESSAGE_BYTES, "method": method})
    return data + b"\0"


REATTACH_ATTEMPTS = 13
"""How many times a detached session's ``execute`` (or a ``submit``) cut by a daemon restart
is repeated with its cell token, which follows the cell it started, before raising
:class:`sandcell.CallCut` (about 21 s in all)."""
REATTACH_FIRST_DELAY_SECONDS = 0.01
"""Seconds before the first repeat; doubled after each failure. Short: under
socket activation a connection made while the daemon restarts waits on the socket for the
successor, so a longer first wait only adds to the restart's gap."""
REATTACH_MAX_DELAY_SECONDS = 4.0
"""The longest wait between two repeats, seconds."""


def broken_note(sent_bytes: int) -> str:
    """What to add to the error of a connection that broke during a call of ``sent_bytes``
    bytes: for a large call, that the daemon closes a connection whose message exceeds its
    bound (:data:`MAX_MESSAGE_BYTES`, ``max_message_bytes``); else nothing."""
    if sent_bytes < LARGE_CALL_BYTES:
        return ""
    return (f" (the call was {sent_bytes} bytes; the daemon closes a connection whose message "
            f"exceeds its {MESSAGE_LIMIT} of {MAX_MESSAGE_BYTES} bytes)")


class MessageReader:
    """Splits received bytes into Varlink messages (JSON objects terminated by NUL).

    ``feed`` returns the complete messages so far; a message longer than ``max_bytes``, or
    one that is not a JSON object, raises :class:`ProtocolError`.
    """

    def __init__(self, max_bytes: int = MAX_REPLY_BYTES):
        self._buf = bytearray()
        self._max = max_bytes

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        start = len(self._buf)
        self._buf += data
        while True:
            i = self._buf.find(b"\0", start)
            if i < 0:
                break
            raw = bytes(self._buf[:i])
            del self._buf[: i + 1]
            start = 0
            try:
                msg = json.loads(raw)
            except ValueError as e:
                raise ProtocolError(f"reply is not JSON: {e}") from None
            if not isinstance(msg, dict):
                raise ProtocolError("reply is not a JSON object")
            out.append(msg)
        if len(self._buf) > self._max:
            raise ProtocolError(f"reply exceeds {self._max} bytes")
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message buffered."""
        return len(self._buf)


@dataclass(frozen=True)
class Reply:
    """One reply: its ``parameters`` and whether more replies of the same call follow."""

    parameters: dict[str, Any]
    continues: bool = False


def parse_reply(msg: dict[str, Any]) -> Reply:
    """The reply in ``msg``; raises the typed :class:`sandcell.VarlinkError` subclass for an
    error reply."""
    if "error" in msg:
        raise error_from_reply(str(msg["error"]), msg.get("parameters"))
    params = msg.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError("reply parameters are not an object")
    return Reply(params, bool(msg.get("continues")))


def idle_connection_alive(sock: Any) -> bool:
    """Whether an idle connection is still usable: nothing to read (the daemon has not
    closed it, as it does with connections idle for its ``connection_idle_seconds``) and no
    error or hang-up pending. Polls with a zero timeout (poll(2)), so it never waits, whatever
    timeout the socket object carries (a ``recv`` with ``MSG_DONTWAIT`` on a socket with a
    timeout first waits for that whole timeout in CPython)."""
    import select

    try:
        fd = sock.fileno()
        if fd < 0:
            return False
        p = select.poll()
        p.register(fd, select.POLLIN | select.POLLPRI)
        events = p.poll(0)
    except (OSError, ValueError):
        return False
    # Readable: b"" (the daemon closed it) or a stray reply (the connection is out of step);
    # POLLHUP / POLLERR / POLLNVAL: broken. Any event means the connection is not reusable.
    return not events


class _ClientDefault:
    """The type of :data:`CLIENT_DEFAULT`."""

    def __repr__(self) -> str:
        return "CLIENT_DEFAULT"


#: A call's ``timeout=`` when not given: the client's own ``timeout``.
CLIENT_DEFAULT = _ClientDefault()

#: Seconds a cell past its deadline is given to end after the client interrupts it, before
#: the client closes its connection (the daemon then interrupts it, too) and raises
#: :class:`sandcell.Timeout`.
INTERRUPT_GRACE_SECONDS = 10.0


def call_timeout(given: float | None | _ClientDefault, client: float | None) -> float | None:
    """The deadline of one call, seconds from now: ``given`` unless it is
    :data:`CLIENT_DEFAULT`, else the client's ``timeout``; ``None`` for none. Raises
    ``ValueError`` for a negative or NaN value."""
    t = client if isinstance(given, _ClientDefault) else given
    if t is None:
        return None
    t = float(t)
    if not t >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, not {t!r}")
    return t


def timed_out_result(r: CellResult, seconds: float) -> CellResult:
    """``r``, a cell the client interrupted at its deadline, reported as ``timeout`` (a cell
    that ended some other way at the same moment keeps its status), with a warning."""
    if r.status == "interrupted":
        r.status = "timeout"
        r.warnings.append(
            f"the client's deadline of {seconds:g} s passed; the client interrupted the cell"
        )
    return r


# --- operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Operation step: send this call and resume with its first :class:`Reply`.

    ``fds`` are file descriptors passed with the call (``SCM_RIGHTS``); the driver does not
    close them.
    """

    method: str
    parameters: dict[str, Any]
    more: bool = False
    fds: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return encode_call(self.method, self.parameters, more=self.more)


class _Next:
    def __repr__(self) -> str:
        return "NEXT"


#: Operation step: resume with the next :class:`Reply` of the streaming call in progress.
NEXT = _Next()


@dataclass(frozen=True)
class Emit:
    """Operation step: call ``callback(value)`` (awaited when it returns an awaitable) and
    resume with ``None``. An exception from the callback is thrown into the operation."""

    callback: Callable[[Any], Any]
    value: Any


Step = Call | _Next | Emit
T = TypeVar("T")
#: An operation that returns a ``T``.
Operation = Generator[Step, Any, T]


def op_simple(method: str, parameters: dict[str, Any]) -> Operation[dict[str, Any]]:
    """One call, one reply: returns the reply's parameters."""
    reply: Reply = yield Call(method, parameters)
    return reply.parameters


def op_cell(
    method: str,
    parameters: dict[str, Any],
    on_output: Callable[[Output], Any] | None = None,
    on_started: Callable[[Started], Any] | None = None,
    on_host_call: Callable[[HostCall], Any] | None = None,
) -> Operation[CellResult]:
    """``Run`` or ``Execute`` with ``more``: emits the started frame and every output frame
    in order, as they arrive (with ``rich_output``, each :class:`Display` frame goes to
    ``on_output`` too, in its place), and each ``host_call`` frame to ``on_host_call``
    (which answers it over another connection), and returns the :class:`CellResult`."""
    reply = yield Call(method, parameters, more=True)
    started: Started | None = None
    outputs: list[Output] = []
    displays: list[Display] = []
    while True:
        frame = reply.parameters.get("frame")
        if not isinstance(frame, dict):
            raise ProtocolError("a cell reply without a frame")
        if frame.get("started") is not None:
            started = Started.from_dict(frame["started"])
            if on_started is not None:
                yield Emit(on_started, started)
        elif frame.get("output") is not None:
            out = Output.from_dict(frame["output"])
            outputs.append(out)
            if on_output is not None:
                yield Emit(on_output, out)
        elif frame.get("display") is not None:
            disp = Display.from_dict(frame["display"])
            displays.append(disp)
            if on_output is not None:
                yield Emit(on_output, disp)
        elif frame.get("host_call") is not None:
            call = HostCall.from_dict(started.session if started else "", frame["host_call"])
            if on_host_call is not None:
                yield Emit(on_host_call, call)
        elif frame.get("result") is not None:
            return CellResult.from_frames(started, outputs, frame["result"], displays)
        if not reply.continues:
            raise ProtocolError("the cell's stream ended before its result")
        reply = yield NEXT


def egress_hosts(egress: Sequence[str]) -> list[str]:
    """The ``egress`` parameter: a list of host names (a lone string is refused, since
    iterating it would send its characters)."""
    if isinstance(egress, (str, bytes)):
        raise TypeError("egress: a list of host names expected, not a string")
    hosts = list(egress)
    if not all(isinstance(h, str) for h in hosts):
        raise TypeError("egress: every host must be a str")
    return hosts


def run_params(
    code: str,
    language: str,
    environment: str | None,
    limits: dict[str, Any] | None,
    host_calls: bool = False,
    display_last_expression: bool | None = None,
    rich_output: bool = False,
    egress: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Parameters of Run: optional ones only when given (a daemon refuses unknown ones)."""
    p: dict[str, Any] = {"language": language, "code": code}
    if host_calls:
        p["host_calls"] = True
    if environment is not None:
        p["environment"] = environment
    if limits:
        p["limits"] = limits
    if display_last_expression is not None:
        p["display_last_expression"] = bool(display_last_expression)
    if rich_output:
        p["rich_output"] = True
    if egress is not None:
        p["egress"] = egress_hosts(egress)
    return p


def open_params(
    language: str,
    environment: str | None,
    limits: dict[str, Any] | None,
    detached_idle_seconds: int | None,
    host_calls: bool = False,
    display_last_expression: bool | None = None,
    rich_output: bool = False,
    egress: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Parameters of Open: optional ones only when given."""
    p: dict[str, Any] = {"language": language}
    if host_calls:
        p["host_calls"] = True
    if environment is not None:
        p["environment"] = environment
    if limits:
        p["limits"] = limits
    if detached_idle_seconds is not None:
        p["detached_idle_seconds"] = int(detached_idle_seconds)
    if display_last_expression is not None:
        p["display_last_expression"] = bool(display_last_expression)
    if rich_output:
        p["rich_output"] = True
    if egress is not None:
        p["egress"] = egress_hosts(egress)
    return p


def op_interrupt(session: str, cell: int) -> Operation[InterruptResult]:
    r = yield Call("Interrupt", {"session": session, "cell": int(cell)})
    return InterruptResult(bool(r.parameters.get("delivered")), str(r.parameters.get("reason", "")))


def op_interrupt_session(session: str) -> Operation[InterruptResult]:
    """InterruptSession: whatever cell the session runs now."""
    r = yield Call("InterruptSession", {"session": session})
    cell = r.parameters.get("cell")
    return InterruptResult(
        bool(r.parameters.get("delivered")),
        str(r.parameters.get("reason", "")),
        int(cell) if cell is not None else None,
    )


def op_put_inline(session: str, name: str, data: bytes) -> Operation[FileInfo]:
    """PutFile with the content inline (base64), at most :data:`MAX_INLINE_BYTES`."""
    p: dict[str, Any] = {"session": session, "name": name, "size": len(data)}
    if data:
        p["data"] = base64.b64encode(data).decode("ascii")
    r = yield Call("PutFile", p)
    return FileInfo.from_dict(r.parameters["file"])


def op_put_fd(session: str, name: str, fd: int, size: int) -> Operation[FileInfo]:
    """PutFile with the content a regular file passed as descriptor ``fd`` (index 0)."""
    r = yield Call("PutFile", {"session": session, "name": name, "size": size, "fd": 0}, fds=(fd,))
    return FileInfo.from_dict(r.parameters["file"])


def op_get_file(session: str, name: str, max_total: int | None = None) -> Operation[bytes]:
    """GetFile in chunks of at most 1 MiB until the end (or ``max_total`` bytes).

    ``max_bytes`` is always sent (the daemon refuses 0 and more than 1 MiB)."""
    data = bytearray()
    if max_total is not None and max_total <= 0:
        return b""
    while True:
        # max_bytes is always given: it bounds each reply, whatever the daemon's default.
        chunk_max = MAX_CHUNK_BYTES
        if max_total is not None:
            chunk_max = max(0, min(MAX_CHUNK_BYTES, max_total - len(data)))
        p: dict[str, Any] = {
            "session": session,
            "name": name,
            "offset": len(data),
            "max_bytes": chunk_max,
        }
        r = yield Call("GetFile", p)
        try:
            chunk = base64.b64decode(r.parameters.get("data", ""), validate=True)
        except ValueError as e:
            raise ProtocolError(f"GetFile data is not base64: {e}") from None
        data += chunk
        if r.parameters.get("eof") or (max_total is not None and len(data) >= max_total):
            return bytes(data)
        if not chunk:
            raise ProtocolError("GetFile returned no data before the end of the file")


class FileList(list[FileInfo]):
    """A session directory's entries; ``truncated`` when the daemon's listing bound (1000
    entries, 4 levels) left some out."""

    truncated: bool = False


def op_list_files(session: str) -> Operation["FileList"]:
    r = yield Call("ListFiles", {"session": session})
    out = FileList(FileInfo.from_dict(f) for f in r.parameters.get("files") or [])
    out.truncated = bool(r.parameters.get("truncated"))
    return out


class VariableList(list[Variable]):
    """A session's variables (name order); ``truncated`` when more exist than are listed
    (over ``max_items`` or the reply's 512 KiB bound)."""

    truncated: bool = False


def op_inspect(session: str, max_items: int | None = None) -> Operation["VariableList"]:
    params: dict[str, Any] = {"session": session}
    if max_items is not None:
        params["max_items"] = max_items
    r = yield Call("Inspect", params)
    out = VariableList(Variable.from_dict(v) for v in r.parameters.get("variables") or [])
    out.truncated = bool(r.parameters.get("truncated"))
    return out


# --- node-qualified session ids ------------------------------------------------------------

_LOCAL_ID = re.compile(r"[0-9a-f]{32}")


def split_session_id(session: str) -> tuple[str | None, str]:
    """Splits a session id into ``(node, local id)``.

    A daemon's own id is 32 lowercase hex characters. A *node-qualified* id is
    ``<node>.<local id>``: the node identifier (a machine id, host name or any name without
    NUL; dots allowed) before the last dot. ``node`` is ``None`` for an unqualified id.
    """
    node, dot, local = session.rpartition(".")
    if dot and node and _LOCAL_ID.fullmatch(local):
        return node, local
    return None, session


def qualify_session_id(node: str, session: str) -> str:
    """``<node>.<local id>``: the node-qualified form of ``session`` (idempotent)."""
    _, local = split_session_id(session)
    return f"{node}.{local}"


def local_session_id(session: str, expected_node: str | None) -> str:
    """The id to send to a daemon. When the client knows which node it talks to
    (``expected_node``), a node-qualified id's node is checked here and its local part is
    sent; otherwise the id goes as given, and a daemon with a node identifier checks the
    node itself (answering ``WrongNode`` for another node's id).

    Raises :class:`sandcell.WrongNode` when the id names another node than ``expected_node``.
    """
    node, local = split_session_id(session)
    if expected_node is None:
        return session
    if node is not None and node != expected_node:
        raise WrongNode(session, node, expected_node)
    return local


def input_files(files: Any) -> list[tuple[str, Any]]:
    """The ``files=`` of a one-shot run as ``(name, source)`` pairs: a mapping of name to
    content (bytes, a path or a binary file, as :meth:`sandcell.Session.put_file` takes), or
    an iterable of local paths, each stored under its file name. Raises ``TypeError`` for
    anything else, ``FileNotFoundError`` (naming the file) for a path that does not exist,
    before anything is sent."""
    if files is None:
        return []
    if isinstance(files, (str, bytes, os.PathLike)):
        raise TypeError("files= takes a mapping of name to content, or a list of paths")
    if hasattr(files, "items"):
        pairs = [(str(k), v) for k, v in files.items()]
    else:
        pairs = []
        for p in files:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError("files= as a list holds paths (str or os.PathLike)")
            pairs.append((os.path.basename(os.fspath(p)), p))
    for name, source in pairs:
        if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
            raise FileNotFoundError(2, f"input file for {name!r} not found", os.fspath(source))
    return pairs


# --- which environment has a module ---------------------------------------------------------

#: Import names whose distribution (package) name differs, for the hint below.
MODULE_PACKAGES = {
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "bs4": "beautifulsoup4",
    "cv2": "opencv-python",
    "dateutil": "python-dateutil",
    "skimage": "scikit-image",
}

_MISSING_MODULE = re.compile(r"No module named '([^'.]+)")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def missing_module(result: CellResult) -> str | None:
    """The top-level module a cell failed to import (``ModuleNotFoundError``), or None."""
    e = result.error
    if e is None or e.type != "ModuleNotFoundError":
        return None
    m = _MISSING_MODULE.search(e.message or "")
    return m.group(1) if m else None


def module_hint(module: str, environments: Any, language: str) -> str | None:
    """A sentence naming the environments (of ``language``, ready) whose installed packages
    include ``module``, from a ``ListEnvironments`` answer; None when none has it."""
    want = {_norm(module), _norm(MODULE_PACKAGES.get(module, module))}
    having = []
    for env in environments or []:
        if not isinstance(env, dict) or env.get("language") != language:
            continue
        if env.get("ready") is False:
            continue
        names = {_norm(str(p.get("name", ""))) for p in env.get("packages") or []
                 if isinstance(p, dict)}
        if want & names:
            having.append(str(env.get("name")))
    if not having:
        return None
    envs = ", ".join(repr(h) for h in having)
    return (f"{module} is not installed in this environment; environment {envs} has it "
            f"(environment={having[0]!r}, or sandcellctl run -e {having[0]})")


# --- put_file sources ------------------------------------------------------------------------


def file_source(data_or_path: Any) -> tuple[str, Any]:
    """Classifies a put_file argument: ``("bytes", b)`` for content in memory (bytes,
    bytearray, memoryview; a str is a path), ``("path", p)`` for a path, ``("fileobj", f)``
    for an open binary file with ``fileno()`` or ``read()``."""
    if isinstance(data_or_path, (bytes, bytearray, memoryview)):
        return "bytes", bytes(data_or_path)
    if isinstance(data_or_path, (str, os.PathLike)):
        return "path", os.fspath(data_or_path)
    if hasattr(data_or_path, "fileno") or hasattr(data_or_path, "read"):
        return "fileobj", data_or_path
    raise TypeError("put_file takes bytes, a path (str or os.PathLike) or a binary file object")


#: Where content too large to send inline is staged as an unnamed file (``O_TMPFILE``) before
#: its descriptor is passed: memory first, then the temporary directory. The daemon reads
#: only regular files on local file systems listed in its mount table, which excludes a
#: memfd (its mount is internal).
STAGING_DIRS = ("/dev/shm", None)


def _staged(data: bytes) -> int:
    """An unnamed regular file (``O_TMPFILE``, mode 0600) holding ``data``, positioned at 0.
    Tries each of :data:`STAGING_DIRS` (``None``: ``tempfile.gettempdir()``), moving on when
    one is missing, refuses ``O_TMPFILE`` or runs out of space."""
    import tempfile

    last: OSError | None = None
    for d in STAGING_DIRS:
        try:
            fd = os.open(d or tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as e:
            last = e
            continue
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.lseek(fd, 0, os.SEEK_SET)
            return fd
        except OSError as e:  # e.g. ENOSPC in a small /dev/shm
            os.close(fd)
            last = e
    raise last or OSError("no directory to stage the upload in")


def content_fd(kind: str, value: Any) -> tuple[int | None, bytes | None, int, bool]:
    """Prepares a put_file source: ``(fd, inline data, size, close_fd)``.

    Content in memory up to 2 MiB goes inline; larger content is staged in an unnamed file
    (see :data:`STAGING_DIRS`) whose descriptor is passed. A path is opened read-only here
    and must be a regular file; so must an open file object's descriptor.
    """
    import stat

    if kind == "bytes":
        if len(value) <= MAX_INLINE_BYTES:
            return None, value, len(value), False
        return _staged(value), None, len(value), True
    if kind == "path":
        fd = os.open(value, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        close = True
    else:
        try:
            fd = value.fileno()
            close = False
        except (AttributeError, OSError, ValueError):
            data = value.read()
            return content_fd("bytes", data)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{value!r} is not a regular file") if stat.S_ISDIR(
                st.st_mode
            ) else OSError(f"{value!r} is not a regular file")
    except BaseException:
        if close:
            os.close(fd)
        raise
    return fd, None, st.st_size, close
