"""A detached session's ``execute`` cut by a daemon restart (a planned exit, SIGUSR2, or a
crash, SIGKILL) follows its running cell in the successor by itself: no retry code in the
caller, every output line once, the cell's result, the same session afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

import sandcell
from conftest import ROOMY, Daemon


def _restart(d: Daemon, sig: int) -> None:
    """Ends ``d``'s sandcelld with ``sig`` (0: it has ended) and starts its successor on the same socket,
    state and adoption directories (as a restart of the unit does)."""
    if sig:
        os.kill(d.proc.pid, sig)
    d.proc.wait(30)
    d.log.close()
    try:
        os.unlink(d.socket)
    except FileNotFoundError:
        pass
    args = list(d.proc.args)
    d.log = open(d.log_path, "ab")
    d.proc = subprocess.Popen(args, stdout=d.log, stderr=subprocess.STDOUT)
    for _ in range(200):
        if os.path.exists(d.socket):
            return
        time.sleep(0.05)
    pytest.fail(f"the successor's socket did not appear; log: {d.log_path}")


def _stdout_once_idle(session, code, d):
    """The stripped stdout of `code` in `session` once its interrupted cell has ended (tried
    while the session answers SessionBusy, for about 20 s)."""
    for _ in range(100):
        try:
            return session.execute(code).stdout.strip()
        except sandcell.SessionBusy:
            time.sleep(0.2)
    pytest.fail(f"the interrupted cell never ended; log: {d.tail()}")


def _successor_after_seam(d: Daemon, setting: str) -> None:
    """Waits for ``d``'s sandcelld to kill itself at its test seam (``setting``, the
    ``NAME=VALUE`` it was started with) and starts the successor without it, on the same
    socket and state."""
    d.proc.wait(30)
    assert d.proc.returncode == -signal.SIGKILL, d.tail()
    args = list(d.proc.args)
    i = args.index(setting)
    del args[i - 1:i + 1]
    d.proc.args = args
    _restart(d, 0)


def _execute_in_thread(s: sandcell.Session, code: str,
                       got: list[str]) -> tuple[threading.Thread, list[object]]:
    """Starts ``s.execute(code)`` on a thread of its own, its output appended to ``got``;
    returns the thread and the list that receives its result or exception."""
    done: list[object] = []

    def run() -> None:
        try:
            done.append(s.execute(code, lambda o: got.append(o.text)))
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            done.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, done


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGKILL], ids=["usr2", "kill"])
def test_execute_cut_by_a_restart_reattaches(daemon_factory, sig):
    d = daemon_factory(f"restart-{sig.name.lower()}", ROOMY)
    got: list[str] = []
    with sandcell.Client(d.socket, timeout=120) as c:
        s = c.session("python", detached_idle_seconds=600)
        assert s.execute("w = 7").status == "ok"
        code = ("import time\nfor i in range(6):\n    print(i, flush=True)\n"
                "    time.sleep(0.5)\nw = 8")
        t, done = _execute_in_thread(s, code, got)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got, f"the cell never printed; log: {d.tail()}"
        _restart(d, sig)
        t.join(60)
        assert not t.is_alive(), "execute never returned after the restart"
        r = done[0]
        assert isinstance(r, sandcell.CellResult), f"{r!r}\n{d.tail()}"
        assert r.status == "ok", f"{r}\n{d.tail()}"
        assert "".join(got) == "".join(f"{i}\n" for i in range(6)), got
        assert s.execute("print(w)").stdout.strip() == "8"
        s.close()


def test_a_cut_call_is_typed(daemon_factory):
    """A session that is not detached: the cut ``execute`` raises :class:`CallCut` (a
    :class:`ConnectionFailed`) saying the daemon restarted, and the session is kept."""
    d = daemon_factory("restart-cut", ROOMY)
    with sandcell.Client(d.socket, timeout=120) as c:
        s = c.session("python")
        assert s.execute("w = 3").status == "ok"
        errors: list[BaseException] = []

        def run() -> None:
            try:
                s.execute("import time\ntime.sleep(30)")
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.5)
        _restart(d, signal.SIGUSR2)
        t.join(30)
        assert errors and isinstance(errors[0], sandcell.CallCut), errors
        assert "restarted" in str(errors[0])
        # The successor kept the session (its cell was interrupted): the variable is there.
        assert _stdout_once_idle(s, "print(w)", d) == "3"
        # Its close, whose owner connection the restart broke, goes over another one: the
        # session ends instead of living on in the successor without an owner.
        s.close()
    with sandcell.Client(d.socket, timeout=120) as c:
        with pytest.raises(sandcell.NoSuchSession):
            c.session_by_id(s.id, "python").execute("print(w)")


@pytest.mark.parametrize("point", ["request_written", "before_request"])
def test_a_cut_execute_runs_its_code_once(daemon_factory, point):
    """The daemon dies (its test seam, SIGKILL) while cell 2's request is written to the
    worker, or before it is: ``execute`` repeats the cut call with its cell token on the
    successor by itself, which follows the cell that reached the worker or runs the one
    that did not. Either way the code runs once."""
    seam = "SANDCELL_TEST_KILL_AT"
    d = daemon_factory(f"token-{point}", {**ROOMY, seam: f"{point}:2"})
    got: list[str] = []
    with sandcell.Client(d.socket, timeout=120) as c:
        s = c.session("python", detached_idle_seconds=600)
        assert s.execute("n = 0").status == "ok"
        code = "import time\nprint('in the cell', flush=True)\ntime.sleep(1)\nn += 1\nprint('n', n)"
        t, done = _execute_in_thread(s, code, got)
        _successor_after_seam(d, f"{seam}={point}:2")
        t.join(60)
        assert not t.is_alive(), "execute never returned after the restart"
        r = done[0]
        assert isinstance(r, sandcell.CellResult), f"{r!r}\n{d.tail()}"
        assert r.status == "ok", f"{r}\n{d.tail()}"
        assert "".join(got) == "in the cell\nn 1\n", got
        assert s.execute("print(n)").stdout.strip() == "1"
        s.close()


def test_a_cut_execute_with_nothing_to_follow_stays_cut(daemon_factory):
    """A session that is not detached, used through ``session_by_id`` (which cannot know
    that): its cut ``execute`` repeats the call with its token, the successor has nothing of
    the cell to follow (it interrupts the cut cell) and answers ``NoSuchCell``, and the
    caller gets the :class:`CallCut`, not that ``NoSuchCell``; the code did not run twice."""
    seam = "SANDCELL_TEST_KILL_AT"
    d = daemon_factory("token-not-detached", {**ROOMY, seam: "request_written:2"})
    with sandcell.Client(d.socket, timeout=120) as owner, \
            sandcell.Client(d.socket, timeout=120) as c:
        s0 = owner.session("python")
        assert s0.execute("n = 0").status == "ok"
        s = c.session_by_id(s0.id, "python")
        t, done = _execute_in_thread(s, "import time\ntime.sleep(2)\nn += 1", [])
        _successor_after_seam(d, f"{seam}=request_written:2")
        t.join(60)
        assert not t.is_alive(), "execute never returned after the restart"
        assert isinstance(done[0], sandcell.CallCut), f"{done[0]!r}\n{d.tail()}"
        assert _stdout_once_idle(s, "print(n)", d) in ("0", "1")
        s.close()


def test_sessions_a_crash_left_without_an_owner_end_with_their_client(daemon_factory):
    """Sessions that are not detached outlive a crash of sandcelld without an owner. One
    closed while no daemon runs raises :class:`ConnectionFailed` and may be closed again once
    the successor is up; one never closed is closed by the client's own ``close``. Neither
    lives on in the successor."""
    d = daemon_factory("restart-ownerless", ROOMY)
    with sandcell.Client(d.socket, timeout=120) as c:
        s = c.session("python")
        t = c.session("python")
        assert s.execute("w = 5").status == "ok"
        assert t.execute("w = 6").status == "ok"
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(30)
        with pytest.raises(sandcell.ConnectionFailed):
            t.close()
        _restart(d, 0)
        assert s.execute("print(w)").stdout.strip() == "5"
        t.close()
    with sandcell.Client(d.socket, timeout=120) as c:
        for sid in (s.id, t.id):
            with pytest.raises(sandcell.NoSuchSession):
                c.session_by_id(sid, "python").execute("print(w)")
