"""Unit tests of the sans-IO protocol core, the error classes and the OpenAI adapter's pure
parts. No daemon needed."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

import sandcell
from sandcell import _protocol as P
from sandcell import openai as sco
from sandcell.types import CellResult, FileInfo, Output, StreamStats

IDL = Path(__file__).resolve().parents[3] / "proto" / "org.sandcell.Kernel.varlink"


def idl_text() -> str:
    if not IDL.exists():
        pytest.skip(f"the interface definition is not at {IDL} (tests run outside the tree)")
    return IDL.read_text()


def test_every_idl_error_has_a_class_with_its_fields():
    text = idl_text()
    errors = re.findall(r"^error\s+(\w+)\s*\(([^)]*)\)", text, re.M)
    assert len(errors) >= 12, errors
    for name, fields in errors:
        # The hand-written classes, not one made on first sight.
        assert name in sandcell.errors.KERNEL_ERRORS, f"no class for error {name}"
        cls = getattr(sandcell, name)
        assert issubclass(cls, sandcell.VarlinkError)
        declared = [f.split(":")[0].strip() for f in fields.split(",") if f.strip()]
        assert list(cls.fields) == declared, (name, cls.fields, declared)


def test_every_idl_status_is_mapped():
    text = idl_text()
    m = re.search(r"# (ok, error, [^\n]*)\n\s*#\s*([^\n]*)\n\s*status: string", text)
    assert m, "the status list comment of CellResult moved"
    statuses = [s.strip() for s in (m.group(1) + " " + m.group(2)).replace(",", " ").split()]
    assert set(statuses) == set(sandcell.STATUSES)
    for s in statuses:
        assert s in sco.STATUS_MAP


def test_encode_call():
    b = P.encode_call("Run", {"language": "python", "code": "print('é')"}, more=True)
    assert b.endswith(b"\0") and b.count(b"\0") == 1
    msg = json.loads(b[:-1])
    assert msg == {
        "method": "org.sandcell.Kernel.Run",
        "parameters": {"language": "python", "code": "print('é')"},
        "more": True,
    }
    assert json.loads(P.encode_call("org.varlink.service.GetInfo")[:-1]) == {
        "method": "org.varlink.service.GetInfo"
    }


def test_reader_splits_and_joins():
    r = P.MessageReader()
    stream = b'{"parameters":{"a":1},"continues":true}\0{"parameters":{"b":"\xc3\xa9"}}\0'
    got = []
    for i in range(len(stream)):  # one byte at a time
        got += r.feed(stream[i : i + 1])
    assert got == [{"parameters": {"a": 1}, "continues": True}, {"parameters": {"b": "é"}}]
    assert r.pending == 0
    assert r.feed(stream) == got  # two at once


def test_reader_bounds_and_rejects():
    r = P.MessageReader(max_bytes=10)
    with pytest.raises(sandcell.ProtocolError):
        r.feed(b"x" * 11)
    with pytest.raises(sandcell.ProtocolError):
        P.MessageReader().feed(b"not json\0")
    with pytest.raises(sandcell.ProtocolError):
        P.MessageReader().feed(b"[1]\0")


def test_error_reply_is_typed():
    with pytest.raises(sandcell.CapacityExceeded) as e:
        P.parse_reply(
            {
                "error": "org.sandcell.Kernel.CapacityExceeded",
                "parameters": {"budget": "sessions", "in_use": 2, "requested": 1, "max": 2},
            }
        )
    assert (e.value.budget, e.value.in_use, e.value.requested, e.value.max) == ("sessions", 2, 1, 2)
    assert e.value.name == "org.sandcell.Kernel.CapacityExceeded"
    assert isinstance(e.value, sandcell.SandcellError)
    # The varlink service's InvalidParameter is the same class (it has no reason).
    with pytest.raises(sandcell.InvalidParameter) as e2:
        P.parse_reply({"error": "org.varlink.service.InvalidParameter", "parameters": {"parameter": "code"}})
    assert e2.value.parameter == "code" and e2.value.reason is None
    # An error of a newer daemon gets a class of its own, named after it.
    with pytest.raises(sandcell.VarlinkError) as e3:
        P.parse_reply({"error": "org.sandcell.Kernel.SomethingNew", "parameters": {"x": 1}})
    assert type(e3.value).__name__ == "SomethingNew" and e3.value.x == 1
    assert sandcell.SomethingNew is type(e3.value)


def drive(op, replies, emitted=None):
    """A minimal driver: hands out ``replies`` (dicts) in order."""
    it = iter(replies)
    sent = []
    value = None
    try:
        step = next(op)
        while True:
            if isinstance(step, P.Call):
                sent.append(step)
                value = P.parse_reply(next(it))
            elif step is P.NEXT:
                value = P.parse_reply(next(it))
            elif isinstance(step, P.Emit):
                step.callback(step.value)
                value = None
            step = op.send(value)
    except StopIteration as s:
        return s.value, sent


def frame(kind, body, continues=True):
    m = {"parameters": {"frame": {kind: body}}}
    if continues:
        m["continues"] = True
    return m


def test_cell_operation_emits_in_order():
    events = []
    replies = [
        frame("started", {"session": "a" * 32, "cell": 3}),
        frame("output", {"cell": 3, "seq": 0, "stream": "stdout", "text": "1\n"}),
        frame("output", {"cell": 3, "seq": 1, "stream": "stderr", "text": "w\n"}),
        frame("output", {"cell": 3, "seq": 2, "stream": "stdout", "text": "2\n"}),
        frame(
            "result",
            {
                "cell": 3,
                "status": "ok",
                "usage": {"wall_seconds": 0.5},
                "stdout": {"seen": 4, "kept": 4, "truncated": False},
                "stderr": {"seen": 2, "kept": 2, "truncated": False},
                "state": "kept",
                "session_ended": False,
                "warnings": [],
                "files": [{"name": "p.png", "size": 3, "media_type": "image/png", "kind": "file", "modified": 1.0}],
            },
            continues=False,
        ),
    ]
    op = P.op_cell("Execute", {"session": "s", "code": "x"}, events.append, events.append)
    res, sent = drive(op, replies)
    assert sent[0].more and sent[0].method == "Execute"
    assert [type(e).__name__ for e in events] == ["Started", "Output", "Output", "Output"]
    assert [e.seq for e in events[1:]] == [0, 1, 2]
    assert res.stdout == "1\n2\n" and res.stderr == "w\n" and res.ok
    assert res.session == "a" * 32 and res.cell == 3 and res.state == "kept"
    assert res.stdout_stats == StreamStats(4, 4, False)
    assert res.files[0].media_type == "image/png"


def test_cell_operation_hands_host_calls_to_the_handler():
    calls = []
    replies = [
        frame("started", {"session": "a" * 32, "cell": 2}),
        frame("host_call", {"cell": 2, "call": 1, "name": "math.add", "arguments": {"a": 1}}),
        frame(
            "result",
            {
                "cell": 2,
                "status": "ok",
                "usage": {"wall_seconds": 0.1},
                "stdout": {"seen": 0, "kept": 0, "truncated": False},
                "stderr": {"seen": 0, "kept": 0, "truncated": False},
                "state": "kept",
                "session_ended": False,
                "warnings": [],
                "files": [],
            },
            continues=False,
        ),
    ]
    op = P.op_cell("Execute", {"session": "s", "code": "x"}, None, None, calls.append)
    res, _ = drive(op, replies)
    assert res.ok
    assert calls == [sandcell.HostCall("a" * 32, 2, 1, "math.add", {"a": 1})]
    assert P.run_params("x", "python", None, None, host_calls=True)["host_calls"] is True
    assert "host_calls" not in P.open_params("python", None, None, None)


def test_cell_operation_stream_without_result():
    replies = [{"parameters": {"frame": {"started": {"session": "s", "cell": 1}}}}]
    with pytest.raises(sandcell.ProtocolError):
        drive(P.op_cell("Run", {}), replies)


def test_get_file_reads_until_eof():
    data = bytes(range(256)) * 10
    replies = [
        {"parameters": {"file": {}, "data": base64.b64encode(data[:1000]).decode(), "eof": False}},
        {"parameters": {"file": {}, "data": base64.b64encode(data[1000:]).decode(), "eof": True}},
    ]
    got, sent = drive(P.op_get_file("s", "f"), replies)
    assert got == data
    assert [c.parameters["offset"] for c in sent] == [0, 1000]


def test_node_qualified_ids():
    local = "0123456789abcdef0123456789abcdef"
    assert P.split_session_id(local) == (None, local)
    assert P.split_session_id(f"node-1.example.org.{local}") == ("node-1.example.org", local)
    assert P.split_session_id("not.an-id") == (None, "not.an-id")
    assert P.qualify_session_id("n1", f"n0.{local}") == f"n1.{local}"
    assert P.local_session_id(f"n1.{local}", None) == f"n1.{local}"
    assert P.local_session_id(f"n1.{local}", "n1") == local
    with pytest.raises(sandcell.WrongNode) as e:
        P.local_session_id(f"n2.{local}", "n1")
    assert isinstance(e.value, sandcell.NoSuchSession) and e.value.node == "n2"
    # The daemon's own WrongNode is the same class, with the same attributes.
    with pytest.raises(sandcell.WrongNode) as e2:
        P.parse_reply(
            {
                "error": "org.sandcell.Kernel.WrongNode",
                "parameters": {"session": f"n2.{local}", "node": "n2", "expected": "n1"},
            }
        )
    assert (e2.value.node, e2.value.expected) == ("n2", "n1")
    assert e2.value.name == "org.sandcell.Kernel.WrongNode"


def test_session_ended_is_a_no_such_session():
    local = "0123456789abcdef0123456789abcdef"
    with pytest.raises(sandcell.NoSuchSession) as e:
        P.parse_reply(
            {
                "error": "org.sandcell.Kernel.SessionEnded",
                "parameters": {"session": local, "reason": "idle_expired", "ended_at": 1.5},
            }
        )
    assert isinstance(e.value, sandcell.SessionEnded)
    assert (e.value.session, e.value.reason, e.value.ended_at) == (local, "idle_expired", 1.5)


def test_put_file_sources(tmp_path):
    assert P.file_source(b"x") == ("bytes", b"x")
    assert P.file_source(tmp_path) == ("path", str(tmp_path))
    with pytest.raises(TypeError):
        P.file_source(3)
    fd, inline, size, close = P.content_fd("bytes", b"abc")
    assert (fd, inline, size, close) == (None, b"abc", 3, False)
    big = b"\x01" * (P.MAX_INLINE_BYTES + 1)
    fd, inline, size, close = P.content_fd("bytes", big)
    try:
        assert inline is None and size == len(big) and close
        import os
        import stat

        assert os.pread(fd, 4, 0) == b"\x01" * 4
        st = os.fstat(fd)
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and st.st_size == len(big)
    finally:
        import os

        os.close(fd)
    with pytest.raises(OSError):
        P.content_fd("path", str(tmp_path))  # a directory


def result(status, **kw):
    outs = kw.pop("outputs", [Output(1, 0, "stdout", "hi\n")])
    return CellResult(status=status, outputs=outs, **kw)


def test_item_status_mapping():
    for s in sandcell.STATUSES:
        assert sco.item_status(result(s)) in ("completed", "incomplete", "failed")
    assert sco.item_status(result("ok")) == "completed"
    assert sco.item_status(result("error")) == "failed"
    assert sco.item_status(result("timeout")) == "incomplete"
    assert sco.item_status(result("worker_crashed")) == "failed"
    assert sco.item_status(result("exited", exit_code=0)) == "completed"
    assert sco.item_status(result("exited", exit_code=3)) == "failed"
    assert sco.item_status(result("brand_new")) == "failed"


def test_item_shape_and_logs():
    err = sandcell.CellError("ZeroDivisionError", "division by zero", "Traceback...\nZeroDivisionError: division by zero", 2)
    r = result(
        "error",
        error=err,
        stdout_stats=StreamStats(10, 4, True),
        outputs=[Output(1, 0, "stdout", "a"), Output(1, 1, "stderr", "b")],
    )
    item = sco._item("ci_x", "code", "cntr_s", r, [b"\x89PNG"], [])
    assert item["type"] == "code_interpreter_call" and item["status"] == "failed"
    assert item["outputs"][0]["type"] == "logs"
    logs = item["outputs"][0]["logs"]
    assert logs.startswith("ab\nTraceback...") and "6 bytes of stdout were dropped" in logs
    assert item["outputs"][1] == {"type": "image", "url": "data:image/png;base64,iVBORw=="}
    assert sco.session_id_of_container(item["container_id"]) == "s"


def test_r_error_logs_carry_the_message():
    err = sandcell.CellError("simpleError", "bad", '1: stop("bad") at line 1\n2: f() at line 2', 1, "f()")
    item = sco._item("ci_x", "f()", "cntr_s", result("error", error=err, outputs=[]), [], [])
    assert item["outputs"][0]["logs"] == (
        'Error in f() : bad\nTraceback:\n1: stop("bad") at line 1\n2: f() at line 2\n'
    )


def test_code_deltas_rebuild_the_code():
    code = "".join(f"print({i})  # {'x' * (i % 50)}\n" for i in range(200)) + "y" * 2000
    pieces = sco._code_deltas(code, 512)
    assert "".join(pieces) == code
    assert all(len(p) <= 512 for p in pieces)
    assert sco._code_deltas("", 512) == []


def test_function_tool_is_strict():
    t = sco.function_tool()
    assert t["type"] == "function" and t["name"] == "code_interpreter" and t["strict"] is True
    p = t["parameters"]
    assert p["required"] == ["code"] and p["additionalProperties"] is False
    assert list(p["properties"]) == ["code"] and p["properties"]["code"]["type"] == "string"
    c = sco.function_tool("chat")
    assert c["function"]["name"] == "code_interpreter" and c["function"]["strict"] is True
    call = {"type": "function_call", "name": "code_interpreter", "call_id": "call_1",
            "arguments": json.dumps({"code": "print(1)"})}
    assert sco.code_from_function_call(call) == "print(1)"
    with pytest.raises(ValueError):
        sco.code_from_function_call({"name": "other", "arguments": "{}"})
    out = sco.function_call_output(call, {"status": "completed", "outputs": [{"type": "logs", "logs": "1\n"}]})
    assert out["call_id"] == "call_1" and json.loads(out["output"])["logs"] == "1\n"


def test_file_info_and_limits_shapes():
    f = FileInfo.from_dict({"name": "é.csv", "size": 1, "media_type": "text/csv", "kind": "file", "modified": 2})
    assert f.name == "é.csv" and f.modified == 2.0
    assert sandcell.Limits(wall_time_seconds=1.5).to_dict() == {"wall_time_seconds": 1.5}
    assert P.run_params("x", "python", None, None) == {"language": "python", "code": "x"}
    assert P.run_params("x", "python", "pydata", {"fuel": 1})["environment"] == "pydata"
    assert "environment" not in P.open_params("r", None, None, None)
    assert P.open_params("r", None, None, 60)["detached_idle_seconds"] == 60
    assert "display_last_expression" not in P.run_params("x", "python", None, None)
    assert P.run_params("x", "python", None, None, display_last_expression=False)["display_last_expression"] is False
    assert "display_last_expression" not in P.open_params("r", None, None, None)
    assert P.open_params("r", None, None, None, display_last_expression=False)["display_last_expression"] is False


def test_idle_connection_check_never_waits_for_the_socket_timeout():
    # A socket with a timeout: a MSG_DONTWAIT peek first waited for that whole timeout in
    # CPython, so every call of a Client(timeout=5) took 5 s longer and then redialled.
    import socket
    import time

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.settimeout(5)
        t0 = time.monotonic()
        assert P.idle_connection_alive(a) is True
        assert time.monotonic() - t0 < 3  # never the socket's 5 s timeout
        b.sendall(b"stray")
        assert P.idle_connection_alive(a) is False  # out of step
        b.close()
        c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(5)
        d.close()
        t0 = time.monotonic()
        assert P.idle_connection_alive(c) is False  # the peer closed it
        assert time.monotonic() - t0 < 3  # never the socket's 5 s timeout
        c.close()
    finally:
        a.close()


def test_call_timeout_resolution_and_timeout_error():
    assert P.call_timeout(P.CLIENT_DEFAULT, 5) == 5.0
    assert P.call_timeout(P.CLIENT_DEFAULT, None) is None
    assert P.call_timeout(None, 5) is None
    assert P.call_timeout(2, None) == 2.0
    with pytest.raises(ValueError):
        P.call_timeout(-1, None)
    e = sandcell.Timeout(2.0, "org.sandcell.Kernel.Run")
    assert isinstance(e, TimeoutError) and isinstance(e, sandcell.SandcellError)
    assert not isinstance(e, sandcell.ConnectionFailed)
    assert "2 s" in str(e) and "Run" in str(e)


def test_every_error_reads_as_one_human_sentence():
    samples = {
        "parameter": "limits.fuel", "reason": "must be positive", "language": "julia",
        "supported": ["python", "r"], "limit": "max_source_bytes", "value": 70000,
        "max": 65536, "budget": "max_concurrent_sessions", "in_use": 8, "requested": 1,
        "session": "0123456789abcdef0123456789abcdef", "ended_at": 0.0, "cell": 3,
        "action": "org.sandcell.manage-sessions", "operation": "rename", "name": "a.csv",
        "kind": "dir", "environment": "pydatas", "known": ["python", "pydata", "r"],
        "environment_language": "r", "call": 2, "node": "n1", "expected": "n2",
        "method": "org.sandcell.Kernel.Foo", "interface": "x",
    }
    for name, cls in sandcell.errors.KERNEL_ERRORS.items():
        params = {f: samples[f] for f in cls.fields if f in samples}
        if name == "SessionEnded":
            params["reason"] = "idle_expired"
        text = str(sandcell.error_from_reply(f"org.sandcell.Kernel.{name}", params))
        assert "{" not in text and "=" not in text and "\n" not in text, (name, text)
        assert not text.startswith("org."), (name, text)
    e = sandcell.error_from_reply(
        "org.sandcell.Kernel.LimitExceeded",
        {"limit": "max_source_bytes", "value": 70000, "max": 65536})
    assert str(e).startswith("max_source_bytes exceeded: 70000 bytes asked, at most 65536")
    assert "sandcelld.toml" in str(e)
    # A lowering names the operator's key it may not exceed.
    e = sandcell.error_from_reply(
        "org.sandcell.Kernel.LimitExceeded", {"limit": "wall_time_seconds", "value": 90, "max": 10})
    assert "execution_wall_time_seconds" in str(e)
    # A session total is what the session would hold after the call, not what it asked.
    t = sandcell.error_from_reply(
        "org.sandcell.Kernel.LimitExceeded",
        {"limit": "max_session_entries", "value": 4097, "max": 4096})
    assert str(t).startswith("max_session_entries exceeded: the session would hold 4097, "
                             "at most 4096; delete files from the session"), str(t)
    assert "asked" not in str(t) and "fixed bound" in str(t)
    t = sandcell.error_from_reply(
        "org.sandcell.Kernel.LimitExceeded",
        {"limit": "max_session_files_bytes", "value": 300, "max": 256})
    assert "would hold 300 bytes" in str(t) and "raise max_session_files_bytes" in str(t)
    # The machine form stays available.
    assert "org.sandcell.Kernel.LimitExceeded" in repr(e) and e.parameters["max"] == 10


def test_an_unreachable_socket_is_one_sentence():
    with pytest.raises(sandcell.ConnectionFailed) as info:
        sandcell.Client("/nonexistent/sandcell.sock")
    text = str(info.value)
    assert text.startswith("cannot reach sandcelld: connecting to /nonexistent/sandcell.sock")
    assert "[Errno" not in text and info.value.errno == 2


def test_which_environment_has_a_module():
    envs = [
        {"name": "python", "language": "python", "ready": True, "packages": []},
        {"name": "pydata", "language": "python", "ready": True,
         "packages": [{"name": "pandas", "version": "1.5"},
                      {"name": "scikit-learn", "version": "1.2"}]},
        {"name": "r", "language": "r", "ready": True, "packages": [{"name": "pandas"}]},
    ]
    hint = P.module_hint("pandas", envs, "python")
    assert hint and "environment 'pydata' has it" in hint and "'r'" not in hint
    assert "environment='pydata'" in P.module_hint("sklearn", envs, "python")
    assert P.module_hint("torch", envs, "python") is None
    r = CellResult(status="error", error=sandcell.CellError(
        "ModuleNotFoundError", "No module named 'pandas.core'"))
    assert P.missing_module(r) == "pandas"
    assert sco.preferred_environment(envs, "python") == "pydata"
    assert sco.preferred_environment(envs[:1], "python") is None
    envs[1]["ready"] = False
    assert sco.preferred_environment(envs, "python") is None


def test_function_call_output_offers_images_as_input_image_parts():
    call = {"call_id": "call_2"}
    url = "data:image/png;base64,iVBORw0KGgo="
    item = {"status": "completed", "outputs": [{"type": "logs", "logs": "ok\n"},
                                               {"type": "image", "url": url}]}
    out = sco.function_call_output(call, item)
    parts = out["output"]
    assert parts[0]["type"] == "input_text"
    assert json.loads(parts[0]["text"]) == {"status": "completed", "logs": "ok\n", "images": 1}
    assert parts[1:] == [{"type": "input_image", "image_url": url}]
    flat = sco.function_call_output(call, item, image_parts=False)
    assert json.loads(flat["output"])["images"] == 1


def test_a_call_over_the_message_bound_is_refused_before_sending():
    # 4 MiB: the daemon closes a connection on a longer message (the interface's bound).
    assert P.MAX_MESSAGE_BYTES == 4 * 1024 * 1024
    with pytest.raises(sandcell.LimitExceeded) as e:
        P.encode_call("Run", {"code": "x" * (P.MAX_MESSAGE_BYTES + 1)})
    assert e.value.limit == "max_message_bytes" and e.value.max == P.MAX_MESSAGE_BYTES
    assert e.value.value > P.MAX_MESSAGE_BYTES
    assert "max_message_bytes" in str(e.value) and "4194304" in str(e.value)
    # Just under the bound is sent.
    room = P.MAX_MESSAGE_BYTES + 1 - len(P.encode_call("Run", {"code": ""}))
    assert len(P.encode_call("Run", {"code": "x" * room})) == P.MAX_MESSAGE_BYTES + 1


def test_a_connection_closed_on_a_large_call_names_the_message_bound(tmp_path):
    # A daemon whose bound is lower than the client's (an older or stricter one): it reads
    # a little, then closes the connection, as sandcelld does on an oversized message.
    import socket
    import threading

    path = str(tmp_path / "sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                got = 0
                while got < 256 * 1024:
                    b = c.recv(65536)
                    if not b:
                        break
                    got += len(b)

    threading.Thread(target=serve, daemon=True).start()
    try:
        with sandcell.Client(path) as c:
            with pytest.raises(sandcell.ConnectionFailed) as e:
                c.run("x = '" + "y" * (3 * 1024 * 1024) + "'")
        assert "max_message_bytes" in str(e.value) and "4194304" in str(e.value), str(e.value)
    finally:
        srv.close()


def test_egress_is_sent_only_when_given_as_a_list_of_names():
    assert "egress" not in P.run_params("x", "python", None, None)
    assert "egress" not in P.open_params("python", None, None, None)
    assert P.run_params("x", "python", "net", None, egress=("a.test",))["egress"] == ["a.test"]
    assert P.open_params("python", "net", None, None, egress=[])["egress"] == []
    for bad in ("a.test", b"a.test", [1]):
        try:
            P.open_params("python", "net", None, None, egress=bad)  # type: ignore[arg-type]
        except TypeError as e:
            assert "egress" in str(e)
        else:
            raise AssertionError(f"egress={bad!r} was sent")
