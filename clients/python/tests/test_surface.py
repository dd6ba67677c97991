"""The blocking and the asyncio clients are one source (``sandcell._core``): every core method
is published by both, under the same name, with the same parameters and documentation, as a
plain method in one and a coroutine in the other. Fails when the two halves drift."""

from __future__ import annotations

import inspect

import pytest

import sandcell
from sandcell import _core as C

PAIRS = [
    (C.ClientCore, sandcell.Client, sandcell.AsyncClient),
    (C.SessionCore, sandcell.Session, sandcell.AsyncSession),
]
#: What only one half has: the asyncio client's session streams, and each has its own way to
#: close (``close`` / ``aclose``) and its context-manager methods.
ONLY = {"AsyncSession": {"stream"}, "AsyncClient": {"aclose"}, "Client": {"close"}}


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def core_methods(core: type) -> set[str]:
    return {n[1:] for n, f in vars(core).items()
            if n.startswith("_") and not n.startswith("__") and inspect.iscoroutinefunction(f)
            and n[1:] in public(sandcell.Client) | public(sandcell.Session)}


@pytest.mark.parametrize("core,sync,aio", PAIRS, ids=lambda c: getattr(c, "__name__", ""))
def test_both_halves_publish_the_same_methods(core: type, sync: type, aio: type) -> None:
    mine = public(sync) - ONLY.get(sync.__name__, set())
    theirs = public(aio) - ONLY.get(aio.__name__, set())
    assert mine == theirs, mine ^ theirs
    for name in sorted(mine - {"backend", "session_type", "max_idle"}):
        s, a = getattr(sync, name), getattr(aio, name)
        if not callable(s):
            continue
        assert inspect.signature(s) == inspect.signature(a), name
        assert inspect.getdoc(s) == inspect.getdoc(a), name
        core_f = getattr(core, "_" + name, None)
        if core_f is None or not inspect.iscoroutinefunction(core_f):
            continue  # written in the half itself (close, session_by_id) or plain
        # One source: both wrap the core's coroutine, one blocking, one as a coroutine.
        assert s.__wrapped__ is core_f and a.__wrapped__ is core_f, name
        assert not inspect.iscoroutinefunction(s), name
        # AsyncClient.session returns an awaitable that is also an async context manager.
        assert inspect.iscoroutinefunction(a) or name == "session", name


def test_every_core_coroutine_is_published() -> None:
    for core, sync, aio in PAIRS:
        for n, f in vars(core).items():
            if n.startswith("_") and not n.startswith("__") and inspect.iscoroutinefunction(f):
                name = n[1:]
                if hasattr(sync, name):
                    assert getattr(sync, name).__wrapped__ is f
                    assert getattr(aio, name).__wrapped__ is f
                else:
                    # Internal steps (connecting, a cell's machinery), not methods.
                    assert name in {"connect", "acquire", "call", "cell", "module_hint", "language_of",
                                    "settle", "repeat", "close_ownerless"}, \
                        f"{core.__name__}.{n} is published by neither"


def test_help_shows_the_parameters() -> None:
    for cls in (sandcell.Client, sandcell.AsyncClient):
        sig = inspect.signature(cls.run)
        assert list(sig.parameters)[:3] == ["self", "code", "language"]
        assert "files" in sig.parameters and "retry" in sig.parameters
        assert cls.run.__name__ == "run"
        assert "one-shot" in (cls.run.__doc__ or "")
