"""Value types of the ``org.sandcell.Kernel`` interface, as Python dataclasses.

Sizes are in bytes, times in seconds, as on the wire. Each type has ``from_dict`` (the wire
shape in) and, where a client sends it, ``to_dict`` (the wire shape out, optional fields left
out when ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast

__all__ = [
    "Limits",
    "Started",
    "Output",
    "StreamStats",
    "CellError",
    "Usage",
    "FileInfo",
    "CellResult",
    "InterruptResult",
    "STATUSES",
    "Status",
    "Environment",
    "EnvironmentLimits",
    "SessionSummary",
    "Package",
    "CellStatus",
    "Retry",
]

#: A cell's status, as :data:`STATUSES` lists them (a newer daemon may add one: code that
#: matches on it keeps a default branch).
Status = Literal[
    "ok",
    "error",
    "interrupted",
    "timeout",
    "fuel_exhausted",
    "memory_exhausted",
    "oom",
    "exited",
    "worker_crashed",
    "cancelled",
]


class Package(TypedDict):
    """An installed package of an environment: distribution (Python) or package (R)
    ``name`` and its ``version`` string."""

    name: str
    version: str


class Environment(TypedDict, total=False):
    """One environment as :meth:`sandcell.Client.list_environments` returns it (a dict).

    Keys: ``name``; ``language`` (``python`` or ``r``); ``engine`` (``eryx``, ``native``,
    ``r``); ``default`` (the language's default); ``interpreter_version``; ``ready`` and,
    when not, ``reason``; ``packages`` (:class:`Package` dicts) and ``packages_truncated``;
    ``package_sources`` (:class:`PackageSource` dicts: what a session can install, absent
    when nothing); ``egress`` (:class:`EgressPolicy`, absent: no network); ``limits``
    (:class:`EnvironmentLimits`).
    """

    name: str
    language: str
    engine: str
    default: bool
    interpreter_version: str
    ready: bool
    reason: str | None
    packages: list[Package]
    packages_truncated: bool
    package_sources: list[PackageSource]
    egress: EgressPolicy
    limits: EnvironmentLimits


class EgressPolicy(TypedDict):
    """An environment's egress policy, as :meth:`sandcell.Client.list_environments` reports it
    (absent: no network at all): ``hosts`` (lowercase DNS names and leading ``*.`` wildcards,
    which match names strictly below) a session may reach through sandcell's proxy
    (``HTTP_PROXY``/``HTTPS_PROXY`` in the worker), on ``ports``, with caps per session:
    ``max_bytes`` relayed (both directions), ``max_connections`` open at once,
    ``max_total_connections`` over its life, ``max_seconds`` per connection."""

    hosts: list[str]
    ports: list[int]
    max_bytes: int
    max_connections: int
    max_total_connections: int
    max_seconds: int


class PackageSource(TypedDict, total=False):
    """A package source the operator named for an environment, as
    :meth:`sandcell.Client.list_environments` reports it (what it offers, never its host
    path): ``kind`` (``wheelhouse``: Python wheels, ``sandcell.install(...)``;
    ``cran_repository``: R binary packages, ``install.packages(...)``); ``packages`` (the
    number of distinct packages); ``names`` (their names in name order, Python names
    normalized as PEP 503 says, at most 500) and ``names_truncated``; ``hash_manifest``
    (installs are checked against a ``SHA256SUMS`` file or the CRAN index's ``MD5sum``
    fields); ``reason`` (why nothing is listed: the source cannot be read now)."""

    kind: str
    packages: int
    names: list[str]
    names_truncated: bool
    hash_manifest: bool
    reason: str


class EnvironmentLimits(TypedDict, total=False):
    """The limits a session of an environment gets when the client asks for none (the
    highest it may ask for), each from a sandcelld.toml key: ``wall_time_seconds`` of one
    cell (``execution_wall_time_seconds``); ``memory_bytes`` of one session
    (``max_worker_memory_bytes``); Eryx only: ``guest_memory_bytes``
    (``max_guest_memory_bytes``) and ``fuel`` of one cell (``max_fuel``: about one unit per
    WebAssembly instruction); ``disk_bytes`` of the session directory
    (``max_session_files_bytes``) and ``file_bytes`` of one file (``max_file_bytes``);
    ``stdout_bytes``, ``stderr_bytes`` kept per cell; ``cpus`` (``worker_cpus``, 0: no cap);
    ``detached_idle_seconds`` (``max_detached_idle_seconds``); ``source_bytes`` of one cell's
    code (``max_source_bytes``; absent from older daemons)."""

    wall_time_seconds: float
    memory_bytes: int
    guest_memory_bytes: int
    fuel: int
    disk_bytes: int
    file_bytes: int
    stdout_bytes: int
    stderr_bytes: int
    cpus: float
    detached_idle_seconds: int
    source_bytes: int


class SessionSummary(TypedDict, total=False):
    """One of the caller's sessions as :meth:`sandcell.Client.list_sessions` returns it (a
    dict): ``session`` (its id), ``language``, ``state`` (``idle``, ``running``, ``ended``,
    ``starting``), ``running_cell`` (when one runs), ``cells_run``, ``started`` (seconds
    since the Unix epoch), ``detached_idle_seconds`` (detached sessions only) and
    ``this_connection`` (it belongs to this client's connection)."""

    session: str
    language: str
    state: str
    running_cell: int
    cells_run: int
    started: float
    detached_idle_seconds: int
    this_connection: bool


class CellStatus(TypedDict, total=False):
    """A cell's state as :meth:`sandcell.Client.cell_status` returns it (a dict):
    ``state`` is ``running``, a :data:`Status` or ``lost``; ``result`` (once it ended) is
    the daemon's result dict, with ``retained`` (bytes seen, kept and dropped per stream)."""

    state: str
    result: dict[str, Any]


#: Every status a cell can end with (``CellResult.status``).
STATUSES = (
    "ok",
    "error",
    "interrupted",
    "timeout",
    "fuel_exhausted",
    "memory_exhausted",
    "oom",
    "exited",
    "worker_crashed",
    "cancelled",
)


@dataclass(frozen=True)
class Limits:
    """Per-session limits a client may ask for; each may only lower the operator's limit
    (a higher value is refused with :class:`sandcell.LimitExceeded`).

    Attributes:
        wall_time_seconds: wall-time limit of one cell, seconds.
        fuel: WebAssembly fuel budget of one cell (Python only).
        guest_memory_bytes: interpreter memory limit (Python: Eryx guest memory), bytes.
        stdout_bytes: stdout bytes kept per cell; the rest is counted and dropped.
        stderr_bytes: stderr bytes kept per cell; the rest is counted and dropped.
    """

    wall_time_seconds: float | None = None
    fuel: int | None = None
    guest_memory_bytes: int | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Retry:
    """An opt-in, bounded retry of a one-shot run refused with
    :class:`sandcell.CapacityExceeded` (admission: nothing ran, so a retry cannot run the
    code twice), with exponential backoff and full jitter (a random wait between 0 and the
    backoff, so many clients refused together do not come back together).

    Attributes:
        attempts: calls at most, the first included (at least 1).
        initial_seconds: the first backoff, seconds.
        max_seconds: no backoff longer than this, seconds.
        multiplier: each backoff is the previous one times this.
        jitter: wait a random time up to the backoff (True) or the backoff itself.

    A refusal that carries ``retry_after_seconds`` (when the daemon knows when capacity
    frees) waits that long instead, capped at ``max_seconds``. After the last attempt the
    refusal is raised.
    """

    attempts: int = 4
    initial_seconds: float = 0.5
    max_seconds: float = 8.0
    multiplier: float = 2.0
    jitter: bool = True

    def delay(self, attempt: int, error: Any = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (from 1)."""
        import random

        hinted = getattr(error, "retry_after_seconds", None)
        if isinstance(hinted, (int, float)) and hinted >= 0:
            return min(float(hinted), self.max_seconds)
        backoff = min(self.max_seconds, self.initial_seconds * self.multiplier ** (attempt - 1))
        return random.uniform(0, backoff) if self.jitter else backoff


def limits_dict(limits: Limits | dict[str, Any] | None) -> dict[str, Any] | None:
    """The wire form of ``limits`` (a :class:`Limits` or a plain dict), ``None`` for none."""
    if limits is None:
        return None
    if isinstance(limits, Limits):
        return limits.to_dict()
    return {k: v for k, v in dict(limits).items() if v is not None}


@dataclass(frozen=True)
class Started:
    """First frame of a running cell: its session id and cell number (for interrupt)."""

    session: str
    cell: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Started:
        return cls(session=d["session"], cell=int(d["cell"]))


@dataclass(frozen=True)
class HostCall:
    """A cell calls a tool the client provides (the ``host_call`` frame of a session or run
    opened with ``host_calls``).

    Attributes:
        session: the session id (from the cell's started frame).
        cell: the calling cell.
        call: the call id, per session from 1 (``HostReply`` names it).
        name: the tool's name, 1 to 128 characters of ``[A-Za-z0-9_.-]``.
        arguments: the cell's arguments, a dict (at most 256 KiB of JSON).
    """

    session: str
    cell: int
    call: int
    name: str
    arguments: dict[str, Any]

    @classmethod
    def from_dict(cls, session: str, d: dict[str, Any]) -> HostCall:
        args = d.get("arguments")
        return cls(session=session, cell=int(d["cell"]), call=int(d["call"]), name=str(d["name"]),
                   arguments=args if isinstance(args, dict) else {})


@dataclass(frozen=True)
class Output:
    """A chunk of a cell's output, as it arrived.

    Attributes:
        cell: the cell number.
        seq: frame sequence number within the cell, from 0.
        stream: ``"stdout"`` or ``"stderr"``.
        text: the chunk; bytes that are not UTF-8 appear as ``\\xNN``.
    """

    cell: int
    seq: int
    stream: str
    text: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Output:
        return cls(cell=int(d["cell"]), seq=int(d["seq"]), stream=d["stream"], text=d["text"])


@dataclass(frozen=True)
class Display:
    """A MIME bundle a cell showed (sessions and runs opened with ``rich_output=True``).

    Attributes:
        cell: the cell number.
        seq: frame sequence number within the cell, shared with :class:`Output` frames.
        kind: ``"result"`` (the value of the cell's last expression, a notebook's
            ``execute_result``) or ``"display"`` (a display call, a figure, R graphics,
            a notebook's ``display_data``).
        data: MIME type to representation, as in the Jupyter display protocol:
            ``text/plain`` always; ``text/html``, ``text/markdown``, ``text/latex``,
            ``image/svg+xml`` text; ``image/png`` and ``image/jpeg`` base64 text;
            ``application/json`` any JSON value. At most 512 KiB of JSON in all.
        note: why the daemon or worker replaced the bundle by its ``text/plain`` (over the
            512 KiB cap or the cell's output budget), else ``None``.
        metadata: the bundle's metadata as the display protocol gives it, for example
            ``{"image/png": {"width": 200}}``; at most 4 KiB of JSON, empty when none.
    """

    cell: int
    seq: int
    kind: str
    data: dict[str, Any]
    note: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The ``text/plain`` representation."""
        t = self.data.get("text/plain", "")
        return t if isinstance(t, str) else str(t)

    @property
    def png(self) -> bytes | None:
        """The ``image/png`` representation, decoded, or ``None``."""
        v = self.data.get("image/png")
        if not isinstance(v, str):
            return None
        import base64
        import binascii

        try:
            return base64.b64decode(v, validate=False)
        except (binascii.Error, ValueError):
            return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Display:
        data = d.get("data")
        return cls(cell=int(d["cell"]), seq=int(d["seq"]), kind=str(d.get("kind", "display")),
                   data=dict(data) if isinstance(data, dict) else {"text/plain": ""},
                   note=d.get("note"),
                   metadata=dict(md) if isinstance(md := d.get("metadata"), dict) else {})


@dataclass(frozen=True)
class StreamStats:
    """Output accounting of one stream of one cell, in bytes of the original output:
    ``seen`` produced, ``kept`` delivered, ``truncated`` when seen > kept."""

    seen: int = 0
    kept: int = 0
    truncated: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StreamStats:
        d = d or {}
        return cls(
            seen=int(d.get("seen", 0)), kept=int(d.get("kept", 0)), truncated=bool(d.get("truncated"))
        )


@dataclass(frozen=True)
class CellError:
    """An error raised by the cell's code.

    Attributes:
        type: exception class (Python) or condition class (R).
        message: the error message.
        traceback: the traceback, with the cell's own line numbers, or ``None``.
        line: the failing line of the cell, from 1, or ``None``.
        call: the failing call (R), or ``None``.
    """

    type: str
    message: str
    traceback: str | None = None
    line: int | None = None
    call: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CellError | None:
        if not d:
            return None
        return cls(
            type=d.get("type", ""),
            message=d.get("message", ""),
            traceback=d.get("traceback"),
            line=d.get("line"),
            call=d.get("call"),
        )


@dataclass(frozen=True)
class Usage:
    """Resource use of one cell: ``wall_seconds``, ``cpu_seconds``, ``peak_memory_bytes``
    and ``fuel`` (Python); those the worker could not measure are ``None``."""

    wall_seconds: float = 0.0
    cpu_seconds: float | None = None
    peak_memory_bytes: int | None = None
    fuel: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Usage:
        d = d or {}
        return cls(
            wall_seconds=float(d.get("wall_seconds", 0.0)),
            cpu_seconds=d.get("cpu_seconds"),
            peak_memory_bytes=d.get("peak_memory_bytes"),
            fuel=d.get("fuel"),
        )


@dataclass(frozen=True)
class Variable:
    """One variable of a session, as :meth:`Session.inspect` lists it.

    Attributes:
        name: the name it is bound to (names starting with ``_`` are not listed).
        type: Python: the type, module-qualified unless builtin (``int``,
            ``pandas.core.frame.DataFrame``); R: the first class (``data.frame``).
        size_bytes: approximate size (numpy ``nbytes``, pandas ``memory_usage(deep=False)``,
            ``sys.getsizeof``; R ``object.size``), or None when it could not be had in time.
        shape: dimensions of arrays, data frames and matrices, else None.
        repr: a short representation, at most 200 characters; a placeholder in angle brackets
            when it failed or ran out of time (``<repr failed: ValueError>``,
            ``<repr timed out>``).
    """

    name: str
    type: str
    size_bytes: int | None
    shape: tuple[int, ...] | None
    repr: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Variable:
        shape = d.get("shape")
        return cls(
            name=d["name"],
            type=d.get("type", ""),
            size_bytes=d.get("size_bytes"),
            shape=tuple(int(x) for x in shape) if shape is not None else None,
            repr=d.get("repr", ""),
        )


@dataclass(frozen=True)
class FileInfo:
    """One entry of a session directory, as lstat sees it (a symlink is never followed).

    Attributes:
        name: path relative to the session directory, ``/``-separated.
        size: bytes (of the link itself for a symlink; 0 for a directory or special file).
        media_type: guessed from the name's extension, e.g. ``image/png``.
        kind: ``file``, ``dir``, ``symlink`` or ``special``.
        modified: last modification, seconds since the Unix epoch.
    """

    name: str
    size: int
    media_type: str
    kind: str
    modified: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileInfo:
        return cls(
            name=d["name"],
            size=int(d.get("size", 0)),
            media_type=d.get("media_type", "application/octet-stream"),
            kind=d.get("kind", "file"),
            modified=float(d.get("modified", 0.0)),
        )


@dataclass
class CellResult:
    """How a cell ended, with the output the client collected.

    Attributes:
        status: one of :data:`STATUSES` (``ok``, ``error``, ``interrupted``, ``timeout``,
            ``fuel_exhausted``, ``memory_exhausted``, ``oom``, ``exited``,
            ``worker_crashed``, ``cancelled``).
        stdout: the kept stdout text, concatenated in order.
        stderr: the kept stderr text.
        error: the error the cell's code raised, or ``None``.
        usage: resource use (seconds, bytes).
        files: files created or changed by the cell in the session directory.
        stdout_stats, stderr_stats: bytes seen and kept, and whether output was dropped.
        outputs: every output frame in arrival order (stdout and stderr interleaved).
        displays: every :class:`Display` bundle in arrival order (``rich_output`` only).
        displays_stats: bytes of bundle JSON seen and kept (``rich_output`` only).
        session: the session id (for a one-shot run, the id of its discarded sandbox).
        cell: the cell number.
        exit_code: the exit code when the cell ended the interpreter (``exited``).
        state: what became of the session's variables: ``kept``, ``restored``, ``lost`` or
            ``none`` (one-shot run).
        session_ended: the session ended with this cell.
        warnings: the daemon's warnings about this cell (e.g. why the session ended).
        raw: the result as the daemon sent it.
    """

    status: Status
    stdout: str = ""
    stderr: str = ""
    error: CellError | None = None
    usage: Usage = field(default_factory=Usage)
    files: list[FileInfo] = field(default_factory=list)
    stdout_stats: StreamStats = field(default_factory=StreamStats)
    stderr_stats: StreamStats = field(default_factory=StreamStats)
    outputs: list[Output] = field(default_factory=list)
    displays: list[Display] = field(default_factory=list)
    displays_stats: StreamStats | None = None
    session: str = ""
    cell: int = 0
    exit_code: int | None = None
    state: str = "none"
    session_ended: bool = False
    warnings: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True when the cell ran to its end without an error."""
        return self.status == "ok"

    @property
    def truncated(self) -> bool:
        """True when output of either stream was dropped at the daemon's cap."""
        return self.stdout_stats.truncated or self.stderr_stats.truncated

    @classmethod
    def from_frames(
        cls, started: Started | None, outputs: list[Output], result: dict[str, Any],
        displays: list[Display] | None = None,
    ) -> CellResult:
        """Builds the result from a cell's frames: ``started``, the outputs in order, the
        display bundles in order and the final ``result`` dict."""
        return cls(
            # A status a newer daemon adds passes through as its string.
            status=cast(Status, result.get("status", "")),
            stdout="".join(o.text for o in outputs if o.stream == "stdout"),
            stderr="".join(o.text for o in outputs if o.stream == "stderr"),
            error=CellError.from_dict(result.get("error")),
            usage=Usage.from_dict(result.get("usage")),
            files=[FileInfo.from_dict(f) for f in result.get("files") or []],
            stdout_stats=StreamStats.from_dict(result.get("stdout")),
            stderr_stats=StreamStats.from_dict(result.get("stderr")),
            outputs=list(outputs),
            displays=list(displays or []),
            displays_stats=(StreamStats.from_dict(result["displays"])
                            if isinstance(result.get("displays"), dict) else None),
            session=started.session if started else "",
            cell=int(result.get("cell", started.cell if started else 0)),
            exit_code=result.get("exit_code"),
            state=result.get("state", "none"),
            session_ended=bool(result.get("session_ended")),
            warnings=list(result.get("warnings") or []),
            raw=result,
        )


@dataclass(frozen=True)
class InterruptResult:
    """Answer to an interrupt: ``delivered`` is False, with a ``reason``, when the cell was
    not running (finished, not started, or another cell). ``cell``: the cell that was running
    (set by :meth:`sandcell.Client.interrupt_session`)."""

    delivered: bool
    reason: str = ""
    cell: int | None = None
