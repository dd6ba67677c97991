"""The Jupyter kernels (sandcell.jupyter) against a real sandcelld, through Jupyter's own
libraries: jupyter_kernel_test's conformance tests for each kernelspec, nbclient executing the
notebooks in examples/notebooks, and interrupt and restart through jupyter_client's
KernelManager.

jupyter_kernel_test, nbclient and nbformat come from scripts/jupyter-venv.sh (a venv over
Debian's Python, whose ipykernel and jupyter_client are used); scripts/test-jupyter.sh runs
this file with it. Without them the module skips, saying why, unless
``SANDCELL_REQUIRE_JUPYTER=1`` makes that a failure.
"""

from __future__ import annotations

import base64
import os
import struct
import sys
import tempfile
import time
import zlib
from queue import Empty
from pathlib import Path
from unittest import SkipTest

import pytest

try:
    import jupyter_kernel_test as jkt
    import nbclient
    import nbformat
    from jupyter_client.manager import KernelManager
except ImportError as e:  # pragma: no cover - depends on the machine
    if os.environ.get("SANDCELL_REQUIRE_JUPYTER") == "1":
        raise
    sys.stderr.write(f"test_jupyter: skipped: {e} (run scripts/jupyter-venv.sh)\n")
    pytest.skip(f"Jupyter test tools missing: {e}", allow_module_level=True)

from sandcell.jupyter.__main__ import write_specs

#: Where the built binaries are (as conftest.py finds sandcelld).
BIN = Path(os.environ.get("SANDCELL_BIN", Path(os.environ.get("CARGO_TARGET_DIR",
                                                              "/var/tmp/sandcell-target")) / "release"))

SRC = Path(__file__).resolve().parents[1] / "src"
NOTEBOOKS = Path(__file__).resolve().parents[3] / "examples" / "notebooks"


@pytest.fixture(scope="module", autouse=True)
def kernelspecs(socket_path):
    """The three kernelspecs in a private Jupyter data directory, pointing at this daemon."""
    d = tempfile.mkdtemp(prefix="sandcell-jupyter.", dir="/var/tmp")
    # The Rust kernel of the sandcellctl built beside the daemon under test;
    # SANDCELL_JUPYTER_PYTHON_KERNEL=1 tests the ipykernel-based fallback instead.
    ctl = None if os.environ.get("SANDCELL_JUPYTER_PYTHON_KERNEL") == "1" else str(BIN / "sandcellctl")
    write_specs(os.path.join(d, "kernels"), sys.executable, ctl)
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "SANDCELL_SOCKET", "PYTHONPATH")}
    os.environ["JUPYTER_PATH"] = d
    os.environ["SANDCELL_SOCKET"] = socket_path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SRC)] + ([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else []))
    yield d
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def skip(why: str) -> None:
    sys.stderr.write(f"test_jupyter: skipped: {why}\n")
    raise SkipTest(why)


def valid_png(data: bytes) -> bool:
    """A PNG with its signature, an IHDR first, an IEND last and every chunk's CRC right."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    off, first, last = 8, None, None
    while off + 12 <= len(data):
        (n,) = struct.unpack(">I", data[off:off + 4])
        kind = data[off + 4:off + 8]
        body = data[off + 8:off + 8 + n]
        (crc,) = struct.unpack(">I", data[off + 8 + n:off + 12 + n])
        if zlib.crc32(kind + body) != crc:
            return False
        first = first or kind
        last = kind
        off += 12 + n
    return first == b"IHDR" and last == b"IEND" and off == len(data)


class Common:
    """Samples every kernel supports; what a kernel does not support says so when skipped."""

    code_history_pattern = "6*7"
    supported_history_operations = ("tail", "range", "search")
    code_execute_result = [{"code": "6*7", "result": "42"}]

    def test_pager(self) -> None:
        skip("pager payloads (help in a pager) are not produced by sandcell kernels")

    def test_clear_output(self) -> None:
        skip("clear_output is not supported by sandcell kernels")


class TestPythonKernel(Common, jkt.KernelTests):
    kernel_name = "sandcell-python"
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "pri", "matches": {"print"}},
                          {"text": "isinst", "matches": {"isinstance"}},
                          {"text": "import keywo", "matches": {"keyword"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2", "for i in range(3):"]
    invalid_code_samples = ["import = 7q", "1 +* 2"]
    code_generate_error = "raise ValueError('boom')"
    code_display_data = [{
        "code": "from sandcell import display\n"
                "display({'text/html': '<b>x</b>', 'text/plain': 'x'}, raw=True)",
        "mime": "text/html"}]
    code_inspect_sample = "print"


class TestPydataKernel(TestPythonKernel):
    kernel_name = "sandcell-pydata"
    code_display_data = [
        {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
         "mime": "image/png"},
        {"code": "from IPython.display import display, HTML\ndisplay(HTML('<i>h</i>'))",
         "mime": "text/html"},
        {"code": "import pandas as pd\nfrom sandcell import display\n"
                 "display(pd.DataFrame({'a': [1, 2]}))", "mime": "text/html"},
    ]


class TestRKernel(Common, jkt.KernelTests):
    kernel_name = "sandcell-r"
    language_name = "R"
    file_extension = ".r"
    code_hello_world = 'cat("hello, world\\n")'
    code_stderr = 'message("test")'
    completion_samples = [{"text": "printCoef", "matches": {"printCoefmat"}},
                          {"text": "my_variable <- 1\nmy_var", "matches": {"my_variable"}}]
    complete_code_samples = ["1", "x <- 2", "f <- function(x) {\n  x\n}"]
    incomplete_code_samples = ["f <- function(x) {", "1 +", "'abc"]
    invalid_code_samples = ["x <- 1)", "}"]
    code_generate_error = 'stop("boom")'
    code_execute_result = [{"code": "6*7", "result": "[1] 42"}]
    code_display_data = [{"code": "plot(1:3)", "mime": "image/png"}]

    def test_completion(self) -> None:
        # The second sample completes a name the history assigns: run it first.
        self.execute_helper("my_variable <- 1")
        super().test_completion()

    code_inspect_sample = "print"


# -- completion and help from the session, through jupyter_client ---------------------------


def ask(kc, kind: str, code: str, **kw) -> dict:
    """The content of the reply to one complete_request or inspect_request."""
    msg_id = getattr(kc, kind)(code, **kw)
    while True:
        reply = kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            assert reply["content"]["status"] == "ok", reply["content"]
            return reply["content"]


@pytest.mark.parametrize("kernel", ["sandcell-python", "sandcell-pydata"])
def test_python_completion_and_help_come_from_the_session(kernel):
    km = KernelManager(kernel_name=kernel)
    km.start_kernel()
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        r = ask(kc, "complete", "import o")
        assert "os" in r["matches"] and (r["cursor_start"], r["cursor_end"]) == (7, 8), r
        # A name only the session has: the kernel's own history never saw it bound.
        kc.execute_interactive("globals()['hidden_' + 'name'] = 1", timeout=60)
        r = ask(kc, "complete", "hidden_n")
        assert r["matches"] == ["hidden_name"], r
        r = ask(kc, "inspect", "len(", detail_level=0)
        assert r["found"] and "Signature: len(" in r["data"]["text/plain"], r
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_r_completion_and_help_come_from_the_session():
    km = KernelManager(kernel_name="sandcell-r")
    km.start_kernel()
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        r = ask(kc, "complete", "pri")
        assert "print" in r["matches"] and (r["cursor_start"], r["cursor_end"]) == (0, 3), r
        kc.execute_interactive("df <- data.frame(alpha = 1)", timeout=60)
        r = ask(kc, "complete", "df$al")
        assert r["matches"] == ["df$alpha"], r
        r = ask(kc, "inspect", "print")
        assert r["found"] and "print(x, ...)" in r["data"]["text/plain"], r
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# -- notebooks through nbclient --------------------------------------------------------------


def run_notebook(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name=nb.metadata.kernelspec.name,
                            allow_errors=False).execute()
    return nb


def outputs(cell) -> tuple[str, list[dict], list[dict]]:
    stream = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    results = [o for o in cell.outputs if o.output_type == "execute_result"]
    displays = [o for o in cell.outputs if o.output_type == "display_data"]
    return stream, results, displays


def test_plain_python_notebook():
    nb = run_notebook("plain-python.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "sum of squares: 285" in outputs(code[0])[0]
    (r,) = outputs(code[1])[1]
    assert r.data["text/html"] == "<b>hello, notebook</b>"
    assert r.data["text/plain"] == "Greeting('notebook')"
    _, results, displays = outputs(code[2])
    assert displays[0].data["text/markdown"] == "**markdown** from a cell"
    assert results[0].data["text/plain"] == "81"
    assert [c.execution_count for c in code] == [1, 2, 3]


def test_pydata_notebook():
    nb = run_notebook("pydata-regression.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    (r,) = outputs(code[0])[1]
    assert "<table" in r.data["text/html"] and "mean" in r.data["text/plain"]
    text = outputs(code[1])[0]
    assert text.startswith("slope 2.0") or text.startswith("slope 1.9"), text
    _, _, displays = outputs(code[2])
    pngs = [base64.b64decode(d.data["image/png"]) for d in displays if "image/png" in d.data]
    assert len(pngs) == 1 and valid_png(pngs[0]) and len(pngs[0]) > 5000
    (r,) = outputs(code[3])[1]
    assert "<table" in r.data["text/html"]


def test_r_notebook():
    nb = run_notebook("r-ggplot2.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    (r,) = outputs(code[0])[1]
    assert "(Intercept)" in r.data["text/plain"] and "-5.344" in r.data["text/plain"]
    assert "R-squared: 0.753" in outputs(code[1])[0]
    _, _, displays = outputs(code[2])
    pngs = [base64.b64decode(d.data["image/png"]) for d in displays if "image/png" in d.data]
    assert len(pngs) == 1 and valid_png(pngs[0]), [d.data.keys() for d in displays]
    # From the cell's display frames (the worker's bundle), not a file fetched afterwards.
    plot = [d for d in displays if "image/png" in d.data][0]
    assert plot.data["text/plain"].startswith("<R plot "), plot.data["text/plain"]


# -- interrupt and restart through KernelManager ---------------------------------------------


def execute(kc, code: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    msgs: list[dict] = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=msgs.append)
    return reply["content"], [m for m in msgs if m["msg_type"] not in ("status", "execute_input")]


@pytest.mark.parametrize("kernel", ["sandcell-python", "sandcell-pydata"])
def test_interrupt_and_restart(kernel):
    km = KernelManager(kernel_name=kernel)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        assert execute(kc, "x = 41")[0]["status"] == "ok"
        # A cell that never ends: interrupted by message, the variables stay.
        msg_id = kc.execute("while True:\n    pass")
        time.sleep(1.0)
        t0 = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t0 < 10
        # ipykernel aborts the requests queued behind a failed cell for a moment after it
        # (stop_on_error), as IPython's kernel does.
        time.sleep(0.5)
        content, msgs = execute(kc, "x + 1")
        assert content["status"] == "ok"
        assert [m["content"]["data"]["text/plain"] for m in msgs
                if m["msg_type"] == "execute_result"] == ["42"]
        # A restart is a new session: the variables are gone.
        km.restart_kernel()
        kc.wait_for_ready(timeout=60)
        content, _ = execute(kc, "x")
        assert content["status"] == "error" and content["ename"] == "NameError"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_crash_restart_says_why():
    """A worker that dies under a cell ends the session; the next cell runs in a new one and
    says so in the notebook."""
    km = KernelManager(kernel_name="sandcell-pydata")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        execute(kc, "y = 1")
        content, _ = execute(kc, "import os\nos._exit(3)")
        assert content["status"] == "error"
        assert "session ended" in content["evalue"], content
        content, msgs = execute(kc, "print('alive')")
        assert content["status"] == "ok"
        text = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
        assert "a new session was started" in text and "worker_crashed" in text, text
        assert "alive" in text
        content, _ = execute(kc, "y")
        assert content["ename"] == "NameError"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_input_and_comms_are_refused():
    km = KernelManager(kernel_name="sandcell-python")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        content, _ = execute(kc, "input('name? ')")
        assert content["status"] == "error" and "input() is refused" in content["evalue"]
        msg = kc.session.msg("comm_open", {"comm_id": "c1", "target_name": "jupyter.widget",
                                           "data": {}})
        kc.shell_channel.send(msg)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = kc.get_iopub_msg(timeout=10)
            if m["msg_type"] == "comm_close":
                assert m["content"]["comm_id"] == "c1"
                break
        else:
            pytest.fail("no comm_close for an unsupported comm")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("kernel", ["sandcell-python", "sandcell-pydata"])
def test_cell_cannot_reach_the_kernel_or_the_users_files(kernel):
    """The hostile suite's promise through the kernel: a cell cannot connect to the kernel's
    own sockets (its connection file's ports, on which a notebook server also listens) or
    read the connection file and its key."""
    km = KernelManager(kernel_name=kernel)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        info = km.get_connection_info()
        ports = [info[k] for k in ("shell_port", "iopub_port", "control_port", "hb_port")]
        code = (
            f"for port in {ports!r}:\n"
            "    try:\n"
            "        import socket\n"
            "        with socket.socket() as s:\n"
            "            s.settimeout(2)\n"
            "            s.connect(('127.0.0.1', port))\n"
            "        print('reached', port)\n"
            "    except (OSError, ImportError) as e:\n"
            "        print('refused', type(e).__name__)\n"
            "try:\n"
            f"    print(open({km.connection_file!r}).read()[:20])\n"
            "except OSError as e:\n"
            "    print('unreadable', type(e).__name__)\n"
        )
        content, msgs = execute(kc, code)
        text = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
        assert content["status"] == "ok", content
        assert "reached" not in text and text.count("refused") == 4, text
        assert "unreadable" in text, text
        key = info["key"].decode() if isinstance(info["key"], bytes) else info["key"]
        assert key not in text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_forged_messages_are_dropped():
    """A message signed with another key (or unsigned) gets no reply and no output, and the
    kernel still answers the next signed one."""
    from jupyter_client.session import Session

    km = KernelManager(kernel_name="sandcell-python")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        for key in (b"not-the-key", b""):
            forger = Session(key=key, signature_scheme="hmac-sha256")
            msg = forger.msg("execute_request", {"code": "print('forged')", "silent": False,
                                                 "store_history": True, "user_expressions": {},
                                                 "allow_stdin": False, "stop_on_error": True})
            forger.send(kc.shell_channel.socket, msg)
            # Replies to other requests (wait_for_ready may send kernel_info more than once)
            # may come; none to the forged one.
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                try:
                    reply = kc.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
                except Empty:
                    break
                assert reply["parent_header"].get("msg_id") != msg["header"]["msg_id"], reply
        content, msgs = execute(kc, "print('signed')")
        assert content["status"] == "ok"
        text = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
        assert text == "signed\n", text
        assert content["execution_count"] == 1, content
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_kernel_answers_before_its_session_and_reports_an_open_failure(kernelspecs):
    """kernel_info is answered without waiting for the session; a session that cannot be
    opened (here: no daemon at the socket) is the first cell's error, not a dead kernel."""
    if os.environ.get("SANDCELL_JUPYTER_PYTHON_KERNEL") == "1":
        skip("the ipykernel-based kernel opens its session before it answers")
    import json

    d = os.path.join(kernelspecs, "kernels", "sandcell-nodaemon")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "kernel.json"), "w", encoding="utf-8") as f:
        json.dump({"argv": [str(BIN / "sandcellctl"), "kernel", "-f", "{connection_file}",
                            "--kernel", "sandcell-python"],
                   "display_name": "no daemon", "language": "python",
                   "interrupt_mode": "message",
                   "env": {"SANDCELL_SOCKET": "/nonexistent/sandcell.sock"}}, f)
    km = KernelManager(kernel_name="sandcell-nodaemon")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=30)
        msg_id = kc.kernel_info()
        info = kc.get_shell_msg(timeout=10)
        assert info["parent_header"]["msg_id"] == msg_id
        assert info["content"]["implementation"] == "sandcell"
        assert info["content"]["language_info"]["name"] == "python"
        for _ in range(2):  # the next cell tries again, and fails the same way
            content, _ = execute(kc, "print(1)")
            assert content["status"] == "error", content
            assert "could not open a sandcell session" in content["evalue"], content
            assert "cannot reach sandcelld" in content["evalue"], content
        assert km.is_alive()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
