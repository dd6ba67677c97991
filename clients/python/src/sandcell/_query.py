"""``Complete`` and ``Help``: what an editor asks a session between cells (the Varlink
methods of the same names). Positions are characters of the code, as Jupyter's
``cursor_pos``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._protocol import Call, Operation

COMPLETE_MAX_MATCHES = 500
"""Most matches one completion returns (``truncated`` says more exist)."""


@dataclass(frozen=True)
class Completions:
    """The answer to :meth:`Session.complete`.

    Attributes:
        matches: replacements of ``code[cursor_start:cursor_end]`` (at most 500, each at most
            256 bytes).
        cursor_start: start of the replaced range, characters.
        cursor_end: its end (the cursor), characters.
        truncated: more matches exist than are listed.
    """

    matches: list[str]
    cursor_start: int
    cursor_end: int
    truncated: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completions:
        return cls(
            matches=[str(m) for m in d.get("matches") or []],
            cursor_start=int(d.get("cursor_start", 0)),
            cursor_end=int(d.get("cursor_end", 0)),
            truncated=bool(d.get("truncated", False)),
        )


@dataclass(frozen=True)
class Help:
    """The answer to :meth:`Session.help`.

    Attributes:
        found: whether a name was found at the cursor.
        data: a MIME bundle (``text/plain`` always: Python the signature, type and
            docstring; R the arguments and the help page), at most 512 KiB of JSON.
    """

    found: bool
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The bundle's ``text/plain``."""
        t = self.data.get("text/plain", "")
        return t if isinstance(t, str) else ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Help:
        data = d.get("data") or {}
        return cls(found=bool(d.get("found")), data=dict(data) if isinstance(data, dict) else {})


def op_complete(session: str, code: str, cursor: int | None = None) -> Operation[Completions]:
    params: dict[str, Any] = {"session": session, "code": code}
    if cursor is not None:
        params["cursor"] = cursor
    r = yield Call("Complete", params)
    return Completions.from_dict(r.parameters)


def op_help(
    session: str, code: str, cursor: int | None = None, detail: int | None = None
) -> Operation[Help]:
    params: dict[str, Any] = {"session": session, "code": code}
    if cursor is not None:
        params["cursor"] = cursor
    if detail is not None:
        params["detail"] = detail
    r = yield Call("Help", params)
    return Help.from_dict(r.parameters)
