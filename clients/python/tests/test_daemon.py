"""The blocking client against a real sandcelld: every method, typed errors, live output,
session persistence, interrupts, files (non-ASCII names, descriptor passing), detached
sessions and node-qualified ids."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

import sandcell
from sandcell import _protocol as P
from sandcell._core import run_blocking


def test_info_and_every_live_error_has_a_class(client):
    info = client.info()
    assert "org.sandcell.Kernel" in info["interfaces"]
    idl = client.interface_description()
    names = re.findall(r"^error\s+(\w+)", idl, re.M)
    assert "NoSuchSession" in names
    for n in names:
        assert n in sandcell.errors.KERNEL_ERRORS, f"the daemon's error {n} has no class"


def test_run_python(client):
    r = client.run("x = 6 * 7\nprint(x)\n")
    assert r.status == "ok" and r.ok and r.error is None
    assert r.stdout == "42\n" and r.stderr == ""
    assert r.stdout_stats == sandcell.StreamStats(3, 3, False)
    assert r.usage.wall_seconds > 0
    assert r.state == "none" and r.session_ended
    assert len(sandcell.split_session_id(r.session)[1]) == 32 and r.cell >= 1


def test_last_expression_shows_unless_turned_off(client):
    assert client.run("x = 21\nx * 2").stdout == "42\n"
    assert client.run("x = 21\nx * 2", display_last_expression=False).stdout == ""
    with client.session(display_last_expression=False) as s:
        assert s.execute("x = 21\nx * 2\nprint(x)").stdout == "21\n"
    with client.session() as s:
        assert s.execute("x = 21\nx * 2").stdout == "42\n"


def test_run_r(client):
    r = client.run("cat(sum(1:10), '\\n')", language="r")
    assert r.status == "ok", r
    assert r.stdout.strip() == "55"


def test_run_error_has_traceback_and_line(client):
    r = client.run("def f(d):\n    return 1 / d\n\nf(0)\n")
    assert r.status == "error" and not r.ok
    assert r.error.type == "ZeroDivisionError"
    assert "division" in r.error.message
    assert r.error.line in (2, 4)
    assert r.error.traceback and "ZeroDivisionError" in r.error.traceback


def test_output_truncation_counts(client):
    r = client.run("print('x' * 5000)", limits=sandcell.Limits(stdout_bytes=1000))
    assert r.status == "ok"
    assert r.stdout_stats.seen == 5001 and r.stdout_stats.kept == 1000
    assert r.stdout_stats.truncated and r.truncated
    assert len(r.stdout.encode()) == 1000


def test_live_output_in_order(client):
    seen: list[tuple[float, sandcell.Output]] = []
    code = "import time\nfor i in range(4):\n    print('line', i, flush=True)\n    time.sleep(0.3)\n"
    t0 = time.monotonic()
    r = client.run(code, on_output=lambda o: seen.append((time.monotonic(), o)))
    t_end = time.monotonic()
    assert r.status == "ok", r
    frames = [o for _, o in seen]
    assert [o.seq for o in frames] == list(range(len(frames)))
    assert "".join(o.text for o in frames) == r.stdout == "".join(f"line {i}\n" for i in range(4))
    # The first line reached the callback while the cell still slept (live, not at the end).
    assert seen[0][0] - t0 < (t_end - t0) - 0.5, (seen[0][0] - t0, t_end - t0)
    assert len(frames) >= 2


def test_live_output_r(client):
    seen: list[float] = []
    code = "for (i in 1:3) { cat('r', i, '\\n'); Sys.sleep(0.3) }"
    r = client.run(code, language="r", on_output=lambda o: seen.append(time.monotonic()))
    done = time.monotonic()
    assert r.status == "ok", r
    assert r.stdout == "r 1 \nr 2 \nr 3 \n"
    assert done - seen[0] > 0.4


def test_session_persists_variables(client):
    with client.session("python") as s:
        assert len(sandcell.split_session_id(s.id)[1]) == 32 and s.engine
        assert s.execute("x = [n * n for n in range(10)]").ok
        assert s.execute("print(sum(x))").stdout == "285\n"
        bad = s.execute("y = undefined_name")
        assert bad.status == "error" and bad.error.type == "NameError"
        assert bad.state == "kept" and not bad.session_ended
        assert s.execute("print(x[-1])").stdout == "81\n"
        assert s.last_cell == 4
    with pytest.raises(sandcell.NoSuchSession):
        client.session_by_id(s.id).execute("print(1)")


def test_inspect_lists_variables_without_a_cell(client):
    with client.session("python") as s:
        s.execute("x = 41\nitems = list(range(100))\n_hidden = 1\nimport math\n")
        vs = s.inspect()
        assert [v.name for v in vs] == ["items", "x"]
        assert not vs.truncated
        x = vs[1]
        assert (x.type, x.repr, x.shape) == ("int", "41", None)
        assert x.size_bytes and x.size_bytes > 0
        assert vs[0].repr.startswith("[0, 1, 2")
        first = s.inspect(max_items=1)
        assert [v.name for v in first] == ["items"] and first.truncated
        with pytest.raises(sandcell.LimitExceeded):
            s.inspect(max_items=1001)
        # Not a cell: the next cell is number 2.
        assert s.execute("print(x)").cell == 2


def test_complete_and_help_between_cells(client):
    with client.session("python") as s:
        s.execute("import os\nvalue_one = 1\nvalue_two = 2\n")
        c = s.complete("import o")
        assert isinstance(c, sandcell.Completions)
        assert "os" in c.matches and (c.cursor_start, c.cursor_end) == (7, 8)
        c = s.complete("x = value_", cursor=10)
        assert c.matches == ["value_one", "value_two"] and not c.truncated
        h = s.help("os.path.join(", detail=0)
        assert isinstance(h, sandcell.Help) and h.found
        assert "Signature: os.path.join(a, *p)" in h.text
        assert not s.help("no_such_name").found
        with pytest.raises(sandcell.InvalidParameter):
            s.complete("abc", cursor=4)
        with pytest.raises(sandcell.InvalidParameter):
            s.help("abc", detail=2)
        with pytest.raises(sandcell.LimitExceeded):
            s.complete("x" * (64 * 1024 + 1))
        # Not a cell: the next cell is number 2.
        assert s.execute("print(value_one)").cell == 2
    with client.session("r") as s:
        c = s.complete("pri")
        assert "print" in c.matches and (c.cursor_start, c.cursor_end) == (0, 3)
        assert "print(x, ...)" in s.help("print(").text


def test_r_session_persists(client):
    with client.session("r") as s:
        s.execute("m <- lm(mpg ~ wt, data = mtcars)")
        r = s.execute("cat(round(coef(m)[['wt']], 2))")
        assert r.stdout == "-5.34", r


def test_r_plots_and_values_arrive_as_displays(client):
    from sandcell import openai as sco

    with client.session("r", rich_output=True) as s:
        seen = []
        r = s.execute("plot(1:5)\ncat('drawn\\n')\n6 * 7", seen.append)
        assert r.status == "ok" and r.stdout == "drawn\n", r
        kinds = [(d.kind, d.text) for d in r.displays]
        assert kinds == [("result", "[1] 42"), ("display", f"<R plot 480x480: plot-{r.cell}-001.png>")]
        png = r.displays[1].png
        assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")
        assert png == s.get_file(f"plot-{r.cell}-001.png")
        # Live, in order: the output, then the value, then the page.
        assert [type(o).__name__ for o in seen] == ["Output", "Display", "Display"], seen
        # The OpenAI adapter on a rich R session: the page from its bundle, one image.
        item = sco.code_interpreter_call(client, "barplot(c(2, 1))", session=s)
        images = [o for o in item["outputs"] if o["type"] == "image"]
        assert item["status"] == "completed" and len(images) == 1, item["outputs"]


def test_interrupt_keeps_the_session(client):
    with client.session("python") as s:
        s.execute("kept = 'yes'")
        out: dict = {}

        def run():
            out["r"] = s.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(30)\n")

        t = threading.Thread(target=run)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        ir = s.interrupt()
        t.join(20)
        assert ir.delivered, ir
        assert out["r"].status == "interrupted"
        assert time.monotonic() - t0 < 15
        assert s.execute("print(kept)").stdout == "yes\n"
        late = s.interrupt()  # nothing running now
        assert not late.delivered and late.reason


def test_client_interrupt_by_id(client):
    with client.session("r") as s:
        started = threading.Event()

        def on_started(st):
            started.set()

        out: dict = {}
        t = threading.Thread(
            target=lambda: out.setdefault("r", s.execute("Sys.sleep(30)", on_started=on_started))
        )
        t.start()
        assert started.wait(10)
        time.sleep(0.3)
        ir = client.interrupt(s.id, s.last_cell)
        t.join(20)
        assert ir.delivered, ir
        assert out["r"].status == "interrupted"


def test_callback_exception_costs_the_cell_not_the_session(client):
    with client.session("python") as s:
        s.execute("v = 7")

        class Stop(Exception):
            pass

        def boom(o):
            raise Stop()

        with pytest.raises(Stop):
            s.execute("import time\nprint('a', flush=True)\ntime.sleep(20)\n", on_output=boom)
        # The abandoned cell is interrupted by the daemon; the session and v remain.
        for _ in range(50):
            try:
                r = s.execute("print(v)")
                break
            except sandcell.SessionBusy:
                time.sleep(0.1)
        assert r.stdout == "7\n"


NAMES = ["données-été.csv", "日本語.txt", "emoji-🙂.bin"]


def test_file_round_trips_non_ascii_names(client, tmp_path):
    with client.session("python") as s:
        payloads = {n: (f"{n}\n".encode() + bytes(range(256))) for n in NAMES}
        for n, data in payloads.items():
            info = s.put_file(n, data)
            assert info.name == n and info.size == len(data) and info.kind == "file"
        listed = {f.name: f for f in s.list_files()}
        assert set(NAMES) <= set(listed)
        assert listed["données-été.csv"].media_type == "text/csv"
        for n, data in payloads.items():
            assert s.get_file(n) == data
        # The cell sees them in its working directory and writes one back.
        r = s.execute(
            "import os\n"
            "print(sorted(n for n in os.listdir('.') if not n.startswith('.')))\n"
            "open('résultat-ü.txt', 'w', encoding='utf-8').write('ça marche\\n')\n"
        )
        assert r.status == "ok", r
        for n in NAMES:
            assert n in r.stdout
        assert [f.name for f in r.files] == ["résultat-ü.txt"]
        assert s.get_file("résultat-ü.txt") == "ça marche\n".encode()
        s.delete_file("résultat-ü.txt")
        with pytest.raises(sandcell.NoSuchFile):
            s.get_file("résultat-ü.txt")


def test_large_files_by_descriptor(client, tmp_path):
    import hashlib

    big = os.urandom(2 * 1024 * 1024 + 17)  # over the inline bound: staged, passed as a descriptor
    src = tmp_path / "grand fichier ä.bin"
    src.write_bytes(big[::-1])
    with client.session("python") as s:
        assert s.put_file("big.bin", big).size == len(big)
        assert s.put_file("from-path.bin", src).size == len(big)  # path: descriptor passed
        with open(src, "rb") as f:
            assert s.put_file("from-fileobj.bin", f).size == len(big)
        assert s.get_file("big.bin") == big  # three GetFile chunks
        r = s.execute(
            "import hashlib\n"
            "for n in ('from-path.bin', 'from-fileobj.bin'):\n"
            "    print(hashlib.sha256(open(n, 'rb').read()).hexdigest())\n"
        )
        assert r.stdout == (hashlib.sha256(big[::-1]).hexdigest() + "\n") * 2, r
        assert s.put_file("empty", b"").size == 0
        assert s.get_file("empty") == b""


def test_typed_errors(client):
    with pytest.raises(sandcell.NoSuchSession) as e:
        client.session_by_id("0" * 32).execute("print(1)")
    assert e.value.session == "0" * 32
    with pytest.raises(sandcell.UnsupportedLanguage) as e2:
        client.run("x", language="cobol")
    assert "python" in e2.value.supported
    with pytest.raises(sandcell.LimitExceeded) as e3:
        client.run("#" * 70_000)
    assert e3.value.limit == "max_source_bytes" and e3.value.value == 70_000
    with pytest.raises(sandcell.LimitExceeded) as e4:
        client.run("print(1)", limits={"wall_time_seconds": 100_000})
    assert e4.value.limit == "wall_time_seconds"
    with pytest.raises(sandcell.InvalidParameter) as e5:
        client.run("print(1)", limits={"guest_memory_bytes": 1024})
    assert "guest_memory_bytes" in e5.value.parameter
    with pytest.raises(sandcell.NoSuchSession):
        client.close_session("f" * 32)
    with client.session("python") as s:
        with pytest.raises(sandcell.InvalidFileName):
            s.put_file("../escape", b"x")
        with pytest.raises(sandcell.NoSuchFile) as e6:
            s.get_file("absent.txt")
        assert e6.value.name == "absent.txt"
        s.execute("import os\nos.mkdir('adir')")
        with pytest.raises(sandcell.NotRegularFile) as e7:
            s.get_file("adir")
        assert e7.value.kind == "dir"
        # A second cell while one runs, and a file while one runs: SessionBusy.
        t = threading.Thread(target=lambda: s.execute("import time\ntime.sleep(2)"))
        t.start()
        time.sleep(0.7)
        with pytest.raises(sandcell.SessionBusy):
            s.execute("print(1)")
        with pytest.raises(sandcell.SessionBusy):
            s.put_file("x.txt", b"x")
        t.join()
    with pytest.raises(sandcell.MethodNotFound):
        run_blocking(client._call(P.op_simple("NoSuchMethod", {})))
    with pytest.raises(sandcell.VarlinkError):
        run_blocking(client._call(P.op_simple("Run", {"language": "python", "code": "1"})))


def test_capacity_exceeded(daemon_factory):
    if os.environ.get("SANDCELL_TEST_SOCKET"):
        pytest.skip("needs a daemon of its own (SANDCELL_TEST_SOCKET is set)")
    d = daemon_factory("tiny", {"SANDCELL_MAX_CONCURRENT_SESSIONS": "1"})
    with sandcell.Client(d.socket) as c:
        with c.session("python"):
            with pytest.raises(sandcell.CapacityExceeded) as e:
                c.run("print(1)")
            assert e.value.max == 1 and e.value.budget
        # The session's end released its charge.
        assert c.run("print(1)").ok


def test_idle_connections_closed_by_the_daemon_are_replaced(daemon_factory):
    if os.environ.get("SANDCELL_TEST_SOCKET"):
        pytest.skip("needs a daemon of its own (SANDCELL_TEST_SOCKET is set)")
    d = daemon_factory("idle", {"SANDCELL_CONNECTION_IDLE_SECONDS": "1"})
    with sandcell.Client(d.socket) as c, c.session("python") as s:
        assert c.run("print(1)").stdout == "1\n"
        s.execute("k = 5")
        time.sleep(2.5)  # the daemon closes the pooled connection; the session's stays
        assert c.run("print(2)").stdout == "2\n"
        assert s.execute("print(k)").stdout == "5\n"


def test_connection_failed(tmp_path):
    with pytest.raises(sandcell.ConnectionFailed):
        sandcell.Client(str(tmp_path / "no-socket"))


def test_detached_session_and_node_qualified_ids(socket_path):
    with sandcell.Client(socket_path) as c1:
        s = c1.session("python", detached_idle_seconds=60)
        s.execute("z = 'survives'")
        sid = s.id
    # The first client is gone; the detached session lives on.
    with sandcell.Client(socket_path, node="node-a.example") as c2:
        qualified = P.qualify_session_id("node-a.example", sid)
        s2 = c2.session_by_id(qualified)
        assert s2.execute("print(z)").stdout == "survives\n"
        assert c2.interrupt(qualified, 1).delivered is False
        with pytest.raises(sandcell.WrongNode):
            c2.session_by_id(P.qualify_session_id("node-b", sid))
        with pytest.raises(sandcell.WrongNode):
            c2.close_session(P.qualify_session_id("node-b", sid))
        s2.close()
        with pytest.raises(sandcell.NoSuchSession):
            c2.session_by_id(sid).execute("print(z)")
    # The daemon (node node-a.example, see conftest) gives qualified ids and answers an id of
    # another node with its own WrongNode when the client does not know its node.
    assert sandcell.split_session_id(sid)[0] == "node-a.example"
    with sandcell.Client(socket_path) as c3:
        with pytest.raises(sandcell.WrongNode) as e:
            c3.session_by_id(P.qualify_session_id("node-b", sid)).execute("1")
        assert (e.value.node, e.value.expected) == ("node-b", "node-a.example")


def test_session_ends_with_its_client(socket_path):
    c = sandcell.Client(socket_path)
    s = c.session("python")
    s.execute("a = 1")
    s._owner.close()  # the connection that owns a non-detached session goes away
    c.close()
    with sandcell.Client(socket_path) as c2:
        for _ in range(50):
            try:
                c2.session_by_id(s.id).execute("print(a)")
            except sandcell.NoSuchSession:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the session outlived its owner's connection")


def test_environment_pass_through(client):
    try:
        envs = client.list_environments()
    except sandcell.MethodNotFound:
        pytest.skip("this daemon has no named environments (ListEnvironments)")
    names = [e["name"] if isinstance(e, dict) else str(e) for e in envs]
    assert names
    name = "python" if "python" in names else names[0]
    info = next((e for e in envs if isinstance(e, dict) and e.get("name") == name), {})
    lang = info.get("language", "python" if "py" in name else "r")
    code = "print(1)" if lang == "python" else "cat(1, '\\n')"
    assert client.run(code, language=lang, environment=name).stdout.strip() == "1"


def test_an_environment_implies_its_language(client):
    try:
        envs = client.list_environments()
    except sandcell.MethodNotFound:
        pytest.skip("this daemon has no named environments (ListEnvironments)")
    r_envs = [e["name"] for e in envs if e.get("language") == "r"]
    if not r_envs:
        pytest.skip("this daemon serves no R environment")
    # No language given: the environment's own (R), not the default python.
    assert client.run("cat(6 * 7)", environment=r_envs[0]).stdout == "42"
    with client.session(environment=r_envs[0]) as s:
        assert s.execute("x <- 5; cat(x + 1)").stdout == "6"
    # A language given that is not the environment's is still the daemon's refusal.
    with pytest.raises(sandcell.EnvironmentMismatch):
        client.run("1", language="python", environment=r_envs[0])


def test_thread_shared_client(client):
    results = []

    def work(i):
        results.append(client.run(f"print({i} * 2)").stdout)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(results) == sorted(f"{i * 2}\n" for i in range(4))


def test_install_layout():
    # The package is importable from its source tree with its typed marker.
    root = Path(sandcell.__file__).parent
    assert (root / "py.typed").exists()


def test_host_calls_round_trip_and_errors(client):
    try:
        names = [e["name"] for e in client.list_environments()]
    except sandcell.MethodNotFound:
        pytest.skip("this daemon has no named environments")
    if "pydata" not in names:
        pytest.skip("no pydata environment")
    seen = []

    def tool(h):
        seen.append(h)
        if h.name == "fail":
            raise RuntimeError("tool broke")
        return {"sum": h.arguments["a"] + h.arguments["b"]}

    code = (
        "from sandcell import host\n"
        "print(host.call('add', {'a': 2, 'b': 40})['sum'])\n"
        "host.call('fail', {})\n"
    )
    r = client.run(code, environment="pydata", host_call_handler=tool)
    assert r.stdout == "42\n", r
    assert r.status == "error" and "tool broke" in r.error.message, r
    assert [h.call for h in seen] == [1, 2] and seen[0].session == r.session
    # Without a handler the run does not opt in: the call raises at once.
    r = client.run("from sandcell import host\nhost.call('add', {})", environment="pydata")
    assert r.status == "error" and "not enabled" in r.error.message, r
    with client.session(environment="pydata", host_calls=True) as s:
        r = s.execute(
            "from sandcell import host\nprint(host.call('add', {'a': 1, 'b': 1})['sum'])",
            host_call_handler=tool,
        )
        assert r.stdout == "2\n", r
        with pytest.raises(sandcell.NoSuchHostCall):
            client.host_reply(s.id, 1, {"late": True})


def test_client_timeout_is_a_deadline_not_a_delay(socket_path):
    # timeout= bounds each call; it used to add itself to every call (a 1 ms call took 5 s).
    with sandcell.Client(socket_path, timeout=5) as c:
        c.info()
        t0 = time.monotonic()
        for _ in range(5):
            c.info()
        per_call = (time.monotonic() - t0) / 5
        assert per_call < 2, f"{per_call:.3f} s per call with timeout=5"
        t0 = time.monotonic()
        assert c.run("print(1)").stdout == "1\n"
        assert time.monotonic() - t0 < 4.5


def test_a_silent_cell_past_its_deadline_is_a_timeout_not_a_connection_error(socket_path):
    with sandcell.Client(socket_path, timeout=2) as c:
        t0 = time.monotonic()
        r = c.run("import time\ntime.sleep(8)\nprint('late')")
        took = time.monotonic() - t0
        assert r.status == "timeout", r
        assert "late" not in r.stdout
        assert any("deadline of 2 s" in w for w in r.warnings), r.warnings
        assert 1.5 < took < 7, took
        # Per call: a longer deadline, or none, lets the cell finish.
        assert c.run("import time\ntime.sleep(3)\nprint('done')", timeout=None).stdout == "done\n"
        with c.session() as s:
            s.execute("kept = 41")
            r = s.execute("import time\ntime.sleep(8)", timeout=1)
            assert r.status == "timeout" and r.state in ("kept", "restored"), r
            # The session is free at once: no SessionBusy, variables kept.
            assert s.execute("print(kept + 1)").stdout == "42\n"


def test_a_refusal_reads_as_a_sentence_naming_its_setting(client):
    with pytest.raises(sandcell.LimitExceeded) as info:
        client.run("x = 1\n" + "#" * (1 << 20))
    text = str(info.value)
    assert text.startswith("max_source_bytes exceeded:"), text
    assert "sandcelld.toml" in text and "{" not in text
    with pytest.raises(sandcell.NoSuchEnvironment) as info:
        client.run("1", environment="no-such-env")
    assert "no environment 'no-such-env' is served (served:" in str(info.value)


def test_interrupt_returns_when_the_cell_has_ended(client):
    with client.session() as s:
        s.execute("kept = 5")
        out: dict = {}
        t = threading.Thread(
            target=lambda: out.setdefault("r", s.execute("import time\ntime.sleep(30)")))
        t.start()
        assert run_blocking(s._started.wait(10))
        time.sleep(0.3)
        assert s.interrupt().delivered
        # No SessionBusy: the interrupted cell has ended when interrupt() returns.
        assert s.execute("print(kept)").stdout == "5\n"
        t.join(10)
        assert out["r"].status == "interrupted"


def test_ctrl_c_in_a_cell_frees_its_session_before_it_propagates(client):
    with client.session() as s:
        s.execute("kept = 6")

        def ctrl_c(o):
            raise KeyboardInterrupt

        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.execute("import time\nprint('a', flush=True)\ntime.sleep(30)", on_output=ctrl_c)
        assert time.monotonic() - t0 < 15
        assert s.execute("print(kept)").stdout == "6\n"  # at once, no SessionBusy


def test_run_with_input_files_runs_the_pydata_examples_as_written(client):
    names = [e["name"] if isinstance(e, dict) else str(e) for e in client.list_environments()]
    if "pydata" not in names:
        pytest.skip("the daemon serves no pydata environment")
    examples = Path(__file__).resolve().parents[3] / "examples" / "pydata"
    if not examples.exists():
        pytest.skip(f"the examples are not at {examples} (tests run outside the tree)")
    missing = []
    for script in sorted(examples.glob("*.py")):
        r = client.run(script.read_text(), environment="pydata",
                       files=[examples / "mtcars.csv", examples / "sleep.csv"])
        if r.status == "error" and r.error.type == "ModuleNotFoundError":
            # A host whose pydata environment lacks a library an example uses (a minimal
            # system-test image without statsmodels): that example is reported below.
            missing.append(f"{script.name}: {r.error.message}")
            continue
        assert r.status == "ok", (script.name, r.error, r.stderr)
        assert r.stdout == script.with_suffix(".out").read_text(), script.name
    r = client.run("print(open('d.txt').read())", files={"d.txt": b"inline"})
    assert r.stdout == "inline\n", r
    with pytest.raises(FileNotFoundError):
        client.run("1", files=[examples / "no-such.csv"])
    if missing:
        pytest.skip("examples not run, their library is missing in pydata: " + "; ".join(missing))


def test_a_missing_module_names_the_environment_that_has_it(client):
    envs = client.list_environments()
    pydata = [e for e in envs if isinstance(e, dict) and e.get("name") == "pydata"
              and e.get("ready") is not False]
    if not pydata:
        pytest.skip("the daemon serves no ready pydata environment")
    r = client.run("import pandas")  # the default python environment (Eryx)
    assert r.status == "error" and r.error.type == "ModuleNotFoundError", r
    assert any("environment 'pydata' has it" in w for w in r.warnings), r.warnings


def test_opt_in_retry_on_capacity_exceeded(daemon_factory):
    d = daemon_factory("capacity", {"SANDCELL_MAX_CONCURRENT_SESSIONS": "1"})
    with sandcell.Client(d.socket) as c:
        held = c.session()
        try:
            with pytest.raises(sandcell.CapacityExceeded) as info:
                c.run("print(1)")  # no retry by default
            assert "retry later" in str(info.value)
            t0 = time.monotonic()
            with pytest.raises(sandcell.CapacityExceeded):
                c.run("print(1)", retry=sandcell.Retry(attempts=3, initial_seconds=0.2,
                                                     max_seconds=0.4, jitter=False))
            assert 0.5 < time.monotonic() - t0 < 5  # 0.2 + 0.4 s of backoff, bounded
            threading.Timer(1.0, held.close).start()
            r = c.run("print('admitted')", retry=sandcell.Retry(attempts=20, max_seconds=0.5))
            assert r.stdout == "admitted\n"
        finally:
            held.close()


def test_a_host_call_without_a_handler_fails_at_once(client):
    with client.session(host_calls=True) as s:
        t0 = time.monotonic()
        r = s.execute("from sandcell import host\nhost.call('tool', {'a': 1})")
        assert time.monotonic() - t0 < 15  # not the daemon's 60 s host-call timeout
        assert r.status == "error", r
        assert "no handler for host calls" in (r.error.message + (r.error.traceback or "")), r


def test_own_sessions_are_listed_and_interrupted_without_a_cell_number(client):
    with client.session("python", detached_idle_seconds=60) as s:
        with pytest.raises(sandcell.NoSuchCell):
            client.interrupt(s.id, 99)  # never reached: NoSuchCell, not not_running
        started = threading.Event()
        out: dict = {}
        t = threading.Thread(
            target=lambda: out.setdefault(
                "r", s.execute("import time\ntime.sleep(30)", on_started=lambda st: started.set())
            )
        )
        t.start()
        assert started.wait(10)
        rows = client.list_sessions()
        row = next(r for r in rows if s.id.endswith(r["session"]))
        assert row["state"] == "running" and row["running_cell"] == s.last_cell, row
        assert row["detached_idle_seconds"] == 60
        ir = client.interrupt_session(s.id)
        t.join(20)
        assert ir.delivered and ir.cell == s.last_cell, ir
        assert out["r"].status == "interrupted"
        assert client.interrupt_session(s.id).reason == "not_running"


def test_environments_state_their_default_limits(client):
    envs = {e["name"]: e for e in client.list_environments()}
    limits = envs["python"]["limits"]
    assert limits["wall_time_seconds"] > 0 and limits["fuel"] > 0, limits
    assert limits["memory_bytes"] > 0 and limits["disk_bytes"] > 0, limits


def test_a_start_rate_refusal_says_when_to_retry_and_retry_waits_that_long(daemon_factory):
    if os.environ.get("SANDCELL_TEST_SOCKET"):
        pytest.skip("needs a daemon of its own (SANDCELL_TEST_SOCKET is set)")
    d = daemon_factory(
        "rate",
        # One start every 4 s: the second run is refused however long the first took on a
        # loaded machine (a faster rate refilled the bucket during a slow first run).
        {"SANDCELL_MAX_STARTS_PER_SECOND_PER_UID": "0.25", "SANDCELL_MAX_START_BURST_PER_UID": "1"},
    )
    with sandcell.Client(d.socket) as c:
        assert c.run("print(1)").ok
        with pytest.raises(sandcell.CapacityExceeded) as e:
            c.run("print(2)")
        assert e.value.budget == "max_starts_per_second_per_uid"
        assert 0 < e.value.retry_after_seconds <= 4, e.value.retry_after_seconds
        assert "retry in" in str(e.value)
        # The hint, not the 30 s backoff asked for, decides the wait.
        t0 = time.monotonic()
        r = c.run("print(3)", retry=sandcell.Retry(attempts=3, initial_seconds=30, max_seconds=30,
                                                jitter=False))
        assert r.stdout == "3\n"
        assert time.monotonic() - t0 < 20


def test_a_request_over_the_message_bound_is_limit_exceeded(client):
    # 20 MiB of source: refused before sending with the typed limit (the daemon would close
    # the connection on it), and the client goes on working.
    with pytest.raises(sandcell.LimitExceeded) as e:
        client.run("x = 1\n" + "#" * (20 * 1024 * 1024))
    assert e.value.limit == "max_message_bytes" and e.value.max == 4 * 1024 * 1024
    assert "max_message_bytes" in str(e.value)
    with client.session("python") as s:
        with pytest.raises(sandcell.LimitExceeded):
            s.execute("#" * (20 * 1024 * 1024))
        assert s.execute("print(6 * 7)").stdout == "42\n"
    assert client.run("print(1)").stdout == "1\n"
