# sandcell native Python worker: the persistent CPython side of the daemon <-> worker protocol.
#
# Started by the `sandcell-worker-python-native` launcher (worker-native/src/python_native.rs)
# after confinement, as `/usr/bin/python3 -I -B <this file>` (or `-c <this source>`), with the
# descriptor layout of proto/src/worker.rs, the same as the R worker's:
#   fd 0  /dev/null
#   fd 1  the cells' stdout: a pipe the daemon drains and bounds
#   fd 2  the cells' stderr: likewise
#   fd 3  requests: "<op> <cell> <len>[ key=value]...\n" followed by exactly <len> payload bytes
#   fd 4  replies: one JSON object per line (ready, then one done per exec, echoing the
#         request's nonce); this worker never sends output or dropped frames
#
# Invariants (each has a test in worker-native/tests/python_native.rs):
# - The protocol descriptors are not stdout or stderr: nothing a cell prints, and nothing a C
#   extension writes to fds 1 and 2, can corrupt a reply. Both are close-on-exec, so programs a
#   cell starts do not inherit them, and a forked child closes them.
# - Cells run in a fresh `__main__` module, not in the worker's globals; each cell's source is
#   registered with linecache under `<cell N>` (the name the Eryx engine uses too), so
#   tracebacks show the user's lines and line numbers. A final expression statement is shown
#   as in Jupyter (its repr on stdout, through sys.displayhook, `_` bound to it), unless the
#   cell ends with `;` or the request says `display=0`; the value None shows nothing. The
#   worker's sys.displayhook (`displayhook`, unless a cell installs its own) shows
#   `<repr failed: Type: message>` (message cut at MAX_REPR_FAILURE_CHARS) when the repr
#   raises an Exception, and the cell goes on; the Eryx engine's driver does the same.
# - One SIGINT ends exactly one cell, with KeyboardInterrupt in the main thread: the handler
#   raises only while the cell's own code runs ("armed"). A SIGINT that lands after the request
#   was read but before the cell's first bytecode is kept and raised when the cell starts; one
#   that lands while the worker itself works (compiling, saving plots, writing a reply) or
#   between cells is dropped: the daemon repeats SIGINT until the cell's `done`. Python runs
#   signal handlers only in the main thread, at the next bytecode boundary, so native code (a
#   long BLAS call) is interrupted when it returns.
# - `exit()`, `quit()`, `sys.exit(n)` end the session: `done` with status `exited` and the exit
#   code, then the process exits with it. `os._exit` and fatal signals end the process without
#   a `done`; the daemon reports worker_crashed.
# - The header option `timeout_ms` arms ITIMER_REAL; its SIGALRM ends the cell with status
#   `timeout` (the daemon enforces its own deadline in every case).
# - matplotlib uses Agg (MPLBACKEND from the launcher). `plt.show()` and every figure still
#   open when a cell ends are saved as plot-<cell>-NNN.png in the session directory and closed,
#   except figures the cell saved itself with savefig (closed without a second copy),
#   so they arrive in the cell's `files`; pyplot is patched when a cell imports it (an import
#   hook), never imported by the worker itself unless preloaded.
# - Every string the worker reports is bounded (message 16 KiB, traceback 32 KiB, innermost
#   100 frames) and valid UTF-8 (lone surrogates escaped), so a reply line never exceeds the
#   1 MiB the daemon accepts.
# - A protocol violation by the daemon (malformed header, unknown op) ends the worker with
#   status 2 and a message on stderr; end of input on fd 3 or an `exit` request, status 0.
# - An `inspect` request (Varlink Inspect) is not a cell: it lists the variables of `__main__`
#   (name order; not names starting with `_`, not modules) with type, approximate size, shape
#   (numpy arrays, pandas objects) and a reprlib repr of at most MAX_REPR_CHARS characters,
#   and answers with one `inspected` line of at most MAX_INSPECT_LINE bytes. It binds nothing
#   (no displayhook, so `_` stays), prints nothing (sys.stdout and sys.stderr are a sink while
#   it runs) and gives the user's code it calls (repr, __sizeof__, memory_usage) `timeout_ms`
#   in all, through the same SIGALRM and SIGINT handlers as a cell: a call that raises shows
#   `<repr failed: Type>`, the call the budget ends `<repr timed out>`, and the values after it
#   `<repr skipped: time budget used up>` (their size and shape left out).
# - `complete` and `help` requests (Varlink Complete and Help) are not cells either: the code
#   is the payload, the cursor a character position; rlcompleter over `__main__` (module names
#   after import/from, from the finders, without importing), and for help the signature, type,
#   docstring (and with detail=1 the source) of the name at the cursor. Same sink, same budget
#   through SIGALRM and SIGINT as an inspect; an answer that fails or times out is empty.
#
# - Host calls (`from sandcell import host; host.call("name", {...})`): only in a cell whose
#   request says `host_calls=1` (the session or run opted in), else HostCallError at once,
#   without a line. The name (1 to 128 bytes of [A-Za-z0-9_.-]) and the arguments (a dict, at
#   most 256 KiB of JSON) are checked here first; then one `host_call` line (echoing the nonce,
#   numbered per session from 1) and a wait for the `host_reply` request naming that call,
#   read straight from fd 3 (nothing is buffered ahead of it: the daemon writes nothing else
#   while a cell runs) after a select() with SIGINT and SIGALRM armed, so an interrupt or the
#   cell's timeout ends the wait. A `host_reply` naming another call (one given up on) is
#   skipped, here and between requests. One call at a time per cell (a second thread's call
#   raises HostCallError).
#
# Environment read here (set by the launcher): SANDCELL_SESSION_DIR (plots go there; appended
# to sys.path so uploaded modules import), SANDCELL_PYTHON_PATH (colon-separated extra library
# directories, put first on sys.path), SANDCELL_PYTHON_PRELOAD (comma-separated modules
# imported before `ready`, so a pooled worker has them loaded when its session opens).

import ast
import builtins
import gc
import io
import json
import linecache
import os
import re
import reprlib
import select
import threading
import signal
import sys
import time
import traceback
import types

MAX_WORKER_LINE = 1024 * 1024  # bytes, newline excluded
MAX_HEADER_LINE = 256  # bytes, newline excluded
MAX_ERROR_MESSAGE = 16 * 1024  # bytes
MAX_TRACEBACK = 32 * 1024  # bytes
MAX_FRAMES = 100  # innermost traceback frames shown
MAX_LINECACHE_BYTES = 16 * 1024 * 1024  # cell sources kept for tracebacks, oldest dropped first
REQ_FD = 3
REP_FD = 4
INSPECT_DEFAULT_ITEMS = 100  # variables an inspect lists unless max_items says otherwise
INSPECT_MAX_ITEMS = 1000
MAX_VARIABLE_NAME = 256  # bytes; longer names are left out (and `truncated` is set)
MAX_VARIABLE_TYPE = 256  # bytes
MAX_REPR_CHARS = 200  # characters, "..." included
MAX_SHAPE_DIMS = 64
MAX_REPR_FAILURE_CHARS = 200  # characters of the message in `<repr failed: Type: message>`
MAX_INSPECT_LINE = 512 * 1024  # bytes of one `inspected` line
MAX_HOST_CALL_NAME = 128  # bytes of [A-Za-z0-9_.-]
MAX_HOST_CALL_ARGUMENTS = 256 * 1024  # bytes of JSON
MAX_DISPLAY_BYTES = 512 * 1024  # bytes of a bundle's JSON; over it, text/plain only
DISPLAY_FALLBACK_BYTES = 4096  # bytes of text/plain a replaced bundle keeps
WORKER_GLOBALS = globals()


class _State:
    __slots__ = (
        "armed",
        "in_cell",
        "pending",
        "cell",
        "plot_seq",
        "pid",
        "sources",
        "sources_bytes",
        "timer",
        "nonce",
        "host_calls",
        "host_seq",
        "host_busy",
        "waiting",
        "rich",
        "display_ids",
        "figures_drawn",
    )


S = _State()
S.armed = False  # SIGINT/SIGALRM raise only while True (the cell's own code runs)
S.in_cell = False  # a request is being served
S.pending = False  # a SIGINT arrived during this request before the cell started
S.cell = 0
S.plot_seq = 0
S.pid = os.getpid()
S.sources = []  # linecache names of past cells, oldest first
S.sources_bytes = 0
S.timer = False  # ITIMER_REAL is armed for the running cell
S.nonce = None  # the running request's nonce
S.host_calls = False  # the running cell may make host calls
S.host_seq = 0  # id of the session's last host call
S.host_busy = False  # a host call waits for its answer
S.waiting = False  # a line that wants an answer is out: a signal handler's display does not wait
S.rich = False  # the running cell has rich output (`rich=1`): MIME bundles as `display` lines
S.display_ids = 0  # display ids handed out for `display(..., display_id=True)`
S.figures_drawn = 0  # figures save_figures() drew in the running cell

SESSION_DIR = os.environ.get("SANDCELL_SESSION_DIR") or os.getcwd()


class CellTimeout(BaseException):
    """Raised in the main thread when the cell's `timeout_ms` is over."""


# ---- text ----------------------------------------------------------------------------------


def clean(s):
    """`s` as text that encodes to UTF-8 (lone surrogates become backslash escapes)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def bound_text(s, limit):
    """At most `limit` bytes of `s` on a character boundary, then "... [N more bytes]"."""
    s = clean(s)
    if len(s) <= limit // 4:
        return s
    b = s.encode("utf-8")
    if len(b) <= limit:
        return s
    head = b[:limit].decode("utf-8", "ignore")
    return "%s... [%d more bytes]" % (head, len(b) - len(head.encode("utf-8")))


def bound_tail(s, limit):
    """At most `limit` bytes of the end of `s`, after "[N bytes not shown] ...\\n"."""
    s = clean(s)
    b = s.encode("utf-8")
    if len(b) <= limit:
        return s
    tail = b[len(b) - limit :].decode("utf-8", "ignore")
    return "[%d bytes not shown] ...\n%s" % (len(b) - len(tail.encode("utf-8")), tail)


# ---- protocol ------------------------------------------------------------------------------


def protocol_fail(msg):
    try:
        os.write(2, ("sandcell worker: protocol error: %s\n" % msg).encode("utf-8", "replace"))
    finally:
        os._exit(2)


def send(obj):
    line = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(line) > MAX_WORKER_LINE:
        protocol_fail("reply line too long")
    data = memoryview(line + b"\n")
    while data:
        n = os.write(REP_FD, data)  # EINTR is retried (PEP 475); SIGINT is not armed here
        data = data[n:]


_inp = io.open(REQ_FD, "rb", buffering=1 << 16, closefd=False)


def read_request():
    """(op, cell, payload, opts) or None at end of input."""
    hdr = _inp.readline(MAX_HEADER_LINE + 1)
    if not hdr:
        return None
    if not hdr.endswith(b"\n"):
        if len(hdr) > MAX_HEADER_LINE:
            protocol_fail("request header too long")
        return None
    S.in_cell = True  # from here a SIGINT belongs to this request
    try:
        parts = hdr[:-1].decode("ascii").split(" ")
    except UnicodeDecodeError:
        protocol_fail("request header is not ASCII")
    if len(parts) < 3 or not parts[1].isdigit() or not parts[2].isdigit():
        protocol_fail("malformed request header: %r" % hdr[:256])
    opts = {}
    for kv in parts[3:]:
        k, eq, v = kv.partition("=")
        if not eq:
            protocol_fail("bad option %r" % kv[:64])
        if k == "nonce":
            if len(v) != 16 or any(c not in "0123456789abcdef" for c in v):
                protocol_fail("malformed nonce")
            opts["nonce"] = v
        elif v.isdigit():
            opts[k] = int(v)
    n = int(parts[2])
    payload = _inp.read(n) if n else b""
    if len(payload) < n:
        return None
    return parts[0], int(parts[1]), payload, opts


# ---- host calls ----------------------------------------------------------------------------


class HostCallError(Exception):
    """A host call failed: the client's tool reported an error, it did not answer in time, or
    host calls are not enabled for this session."""


HOST_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def host_call(name, arguments=None):
    """Calls the client's tool `name` with `arguments` (a dict) and returns its result (a
    dict); raises HostCallError with the tool's error."""
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not 0 < len(name) <= MAX_HOST_CALL_NAME or not set(name) <= HOST_NAME_CHARS:
        raise ValueError("a host call's name is 1 to %d characters of [A-Za-z0-9_.-]" % MAX_HOST_CALL_NAME)
    if not isinstance(arguments, dict):
        raise TypeError("a host call's arguments are a dict, not %s" % type(arguments).__name__)
    if os.getpid() != S.pid or not S.in_cell or not S.host_calls:
        raise HostCallError("host calls are not enabled for this session (open it with host_calls)")
    if S.host_busy:
        raise HostCallError("another host call of this cell waits for its answer")
    if S.waiting:
        raise HostCallError("a host call cannot be made while the worker waits for the daemon "
                            "(from a signal handler)")
    args = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if len(args.encode("utf-8")) > MAX_HOST_CALL_ARGUMENTS:
        raise ValueError("a host call's arguments are at most %d bytes of JSON" % MAX_HOST_CALL_ARGUMENTS)
    armed = S.armed
    S.host_busy = True
    try:
        S.armed = False  # a line is never cut by an interrupt: SIGINT now is kept in S.pending
        S.waiting = True
        S.host_seq += 1
        call = S.host_seq
        msg = {"t": "host_call", "cell": S.cell, "call": call, "name": name, "arguments": json.loads(args)}
        if S.nonce is not None:
            msg["nonce"] = S.nonce
        send(msg)
        payload = request_wait(lambda parts: parts[0] == "host_reply" and "call=%d" % call in parts[3:],
                               armed, "a host call")
    finally:
        S.armed = armed
        S.host_busy = False
        S.waiting = False
    if armed and S.pending:
        raise KeyboardInterrupt
    answer = json.loads(payload)
    if "error" in answer:
        raise HostCallError(str(answer["error"]))
    return answer.get("result")


def request_wait(wanted, armed, what):
    """The payload of the request `wanted(parts)` accepts (`parts`: its header's fields), read
    from fd 3; waits in select() with SIGINT and SIGALRM armed (when the caller had them
    armed). While a cell runs the daemon sends only what the worker waits for: a `host_reply`
    or `displayed` not wanted is stale (the answer to a call given up on, a `displayed` an
    interrupted display stopped waiting for or a daemon that continued the cell after a
    restart sent) and skipped. Bytes after a wanted `host_reply` break the protocol; after a
    wanted `displayed` only another stale `displayed` can follow, and it is dropped. `what`
    names the wait in a protocol error. Never re-entered: callers set S.waiting from before
    their line until the answer, and a signal handler that runs meanwhile displays without
    waiting (send_bundle) and cannot make a host call (a nested wait could read the outer
    one's answer and leave it waiting for ever)."""
    buf = b""
    while True:
        nl = buf.find(b"\n")
        if nl > MAX_HEADER_LINE or (nl < 0 and len(buf) > MAX_HEADER_LINE):
            protocol_fail("request header too long")
        if nl >= 0:
            parts = buf[:nl].decode("ascii", "replace").split(" ")
            if len(parts) < 3 or parts[0] not in ("host_reply", "displayed") or not parts[2].isdigit():
                protocol_fail("unexpected request while %s waits: %r" % (what, buf[:64]))
            end = nl + 1 + int(parts[2])
            if len(buf) >= end:
                payload, buf = buf[nl + 1 : end], buf[end:]
                if wanted(parts):
                    if buf and parts[0] == "host_reply":
                        protocol_fail("bytes after a host reply")
                    return payload
                continue
        if armed and S.pending:
            raise KeyboardInterrupt
        S.armed = armed
        try:
            select.select([REQ_FD], [], [])
        finally:
            S.armed = False
        chunk = os.read(REQ_FD, 1 << 16)
        if not chunk:
            protocol_fail("end of input while %s waits" % what)
        buf += chunk


def install_host_module():
    """`sandcell.host` for the cells: `from sandcell import host; host.call(name, {...})`."""
    pkg = types.ModuleType("sandcell")
    mod = types.ModuleType("sandcell.host")
    mod.call = host_call
    mod.HostCallError = HostCallError
    mod.__all__ = ["call", "HostCallError"]
    pkg.host = mod
    pkg.display = display
    pkg.DisplayHandle = DisplayHandle
    pkg.install = install_packages  # per-session packages (see "packages" below)
    pkg.InstallError = InstallError
    pkg.__path__ = []
    sys.modules["sandcell"] = pkg
    sys.modules["sandcell.host"] = mod
    # `display(...)` without an import, as in IPython, where library code and notebooks
    # expect it; a cell's own `display` shadows it.
    if not hasattr(builtins, "display"):
        builtins.display = display


# ---- signals -------------------------------------------------------------------------------


def on_sigint(signum, frame):
    if S.armed:
        raise KeyboardInterrupt
    if S.in_cell:
        S.pending = True


def on_sigalrm(signum, frame):
    if S.armed:
        raise CellTimeout


def install_handlers():
    # Python's table is read first: no system call unless a cell replaced a handler.
    if signal.getsignal(signal.SIGINT) is not on_sigint:
        signal.signal(signal.SIGINT, on_sigint)
    if signal.getsignal(signal.SIGALRM) is not on_sigalrm:
        signal.signal(signal.SIGALRM, on_sigalrm)


def after_fork_in_child():
    # A child forked by a cell must never read requests or write replies.
    S.pid = -1
    for fd in (REQ_FD, REP_FD):
        try:
            os.close(fd)
        except OSError:
            pass


# ---- plots ---------------------------------------------------------------------------------


# Most figures left open at a cell's end that are drawn (as a PNG bundle and file); more are
# closed undrawn with a note (matplotlib itself warns from 20 open figures on,
# figure.max_open_warning). Figures shown with plt.show() are not counted.
MAX_FIGURES_PER_CELL = 20


def save_figures(at_end=False):
    """Saves every open pyplot figure as plot-<cell>-NNN.png (and, with rich output, sends it
    as a PNG bundle; one drawing serves both) and closes it. `at_end`: the figures left open
    at the cell's end, of which at most MAX_FIGURES_PER_CELL are drawn."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        nums = plt.get_fignums()
    except Exception:
        return
    undrawn = 0
    for num in nums:
        try:
            if at_end:
                if S.figures_drawn >= MAX_FIGURES_PER_CELL:
                    undrawn += 1
                    continue
                S.figures_drawn += 1
            fig = plt.figure(num)
            saved = getattr(fig, "_sandcell_saved", False)
            png = figure_png(fig) if S.rich or not saved else None
            if S.rich and png is not None:
                send_bundle("display", png_bundle(fig, png))
            if saved:
                continue  # the cell saved it itself (savefig): no second copy (closed below)
            S.plot_seq += 1
            path = os.path.join(SESSION_DIR, "plot-%d-%03d.png" % (S.cell, S.plot_seq))
            if png is None:
                fig.savefig(path, format="png")  # fails again, with the reason shown below
            else:
                with open(path, "wb") as f:
                    f.write(png)
        except Exception as e:
            sys.stderr.write("sandcell: could not save figure %s: %s\n" % (num, clean(str(e))))
        finally:
            try:
                plt.close(num)
            except Exception:
                pass
    if undrawn:
        sys.stderr.write("sandcell: %d more open figures closed without being drawn (at most %d "
                         "are drawn per cell)\n" % (undrawn, MAX_FIGURES_PER_CELL))


def close_figures():
    """Closes, undrawn, the figures still open after the cell (its drawing of them was cut by
    the wall time or an interrupt): drawing runs user code, which must not run unbounded."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        n = len(plt.get_fignums())
        plt.close("all")
    except Exception:
        return
    if n:
        sys.stderr.write("sandcell: %d open figures closed without being drawn (the cell ended "
                         "before they were)\n" % n)


def patch_pyplot(plt):
    def show(*args, **kwargs):
        """Saves every open figure as plot-<cell>-NNN.png in the session directory."""
        save_figures()

    plt.show = show
    # A figure the cell saved itself (plt.savefig / fig.savefig) is not captured again as
    # plot-<cell>-NNN.png: the file the cell chose is its image.
    try:
        import matplotlib.figure as mfigure

        real_savefig = mfigure.Figure.savefig
        if not getattr(real_savefig, "_sandcell", False):

            def savefig(self, *args, **kwargs):
                out = real_savefig(self, *args, **kwargs)
                try:
                    self._sandcell_saved = True
                except Exception:
                    pass
                return out

            savefig._sandcell = True
            savefig.__doc__ = real_savefig.__doc__
            mfigure.Figure.savefig = savefig
    except Exception:
        pass


class PatchOnImport:
    """A meta path finder that runs ``patch(module)`` right after any module named in
    ``names`` is executed, wherever it is imported from (the real finder still finds it)."""

    def __init__(self, names, patch):
        self.names = names
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module
        patch = self.patch

        def exec_module(module):
            real(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


# ---- cells ---------------------------------------------------------------------------------


def register_source(name, src):
    lines = src.splitlines(True)
    linecache.cache[name] = (len(src), None, lines, name)
    S.sources.append((name, len(src)))
    S.sources_bytes += len(src)
    while S.sources_bytes > MAX_LINECACHE_BYTES and len(S.sources) > 1:
        old, size = S.sources.pop(0)
        linecache.cache.pop(old, None)
        S.sources_bytes -= size


def ends_with_semicolon(src, node):
    lines = src.splitlines()
    if node.end_lineno is None or node.end_lineno > len(lines):
        return False
    rest = lines[node.end_lineno - 1].encode("utf-8")[node.end_col_offset :].decode("utf-8", "ignore")
    return rest.lstrip().startswith(";")


def failure_text(e):
    """`Type: message` of exception `e`, the message cut at MAX_REPR_FAILURE_CHARS."""
    try:
        msg = str(e)
    except BaseException:
        msg = ""
    if len(msg) > MAX_REPR_FAILURE_CHARS:
        msg = msg[: MAX_REPR_FAILURE_CHARS - 3] + "..."
    return type_name(type(e)) + (": " + msg if msg else "")


def repr_failed(e):
    """The placeholder shown for a last expression whose repr raised `e`."""
    return "<repr failed: %s>" % failure_text(e)


def repr_method_failed(value, name, e):
    """Says on stderr that `value`'s display method `name` raised `e` and was left out of
    the bundle (IPython's formatters print the traceback the same way and go on)."""
    sys.stderr.write("sandcell: %s.%s raised %s; left out of the display\n"
                     % (type_name(type(value)), name, failure_text(e)))


def displayhook(value):
    """sys.displayhook of the worker: the default one, but a failing repr shows a
    placeholder instead of failing the cell. With rich output the value goes out as a MIME
    bundle (kind `result`)."""
    if value is None:
        return
    builtins._ = None
    if S.rich:
        md = {}
        data = bundle(value, None, md)
        send_bundle("result", data, md)
    else:
        try:
            text = repr(value)
        except Exception as e:
            text = repr_failed(e)
        sys.stdout.write(text + "\n")
    builtins._ = value


# ---- rich output ---------------------------------------------------------------------------
#
# With `rich=1`, the last expression's value, `sandcell.display(...)`, IPython's display()
# (where IPython is installed) and figures go to the daemon as `display` lines: a MIME bundle
# built through the display protocol of IPython/Jupyter (`_repr_mimebundle_`, then
# `_repr_html_`, `_repr_markdown_`, `_repr_latex_`, `_repr_png_`, `_repr_jpeg_`, `_repr_svg_`,
# `_repr_json_`; https://ipython.readthedocs.io/en/stable/config/integrating.html), text/plain
# always; a method that raises is left out with a line on stderr naming it. stdout and stderr
# are flushed first, so the bundle follows what the cell printed. A bundle over
# MAX_DISPLAY_BYTES is replaced by its text/plain (cut) with a note: the reply line must stay
# under MAX_WORKER_LINE, and the daemon checks and bounds it again.

REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("image/svg+xml", "_repr_svg_"),
    ("application/json", "_repr_json_"),
)
MIME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.+-/")


JSON_MAX_DEPTH = 100


def json_fits(v):
    """Whether `v` is JSON the daemon reads: finite numbers only (JSON has no NaN or Infinity,
    RFC 8259 section 6) and at most JSON_MAX_DEPTH levels of arrays and objects (the daemon's
    parser stops at 128 levels for the whole reply line). A value that is not is left out of
    its bundle, which keeps text/plain."""
    try:
        json.dumps(v, allow_nan=False)
    except Exception:
        return False
    stack = [(v, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list, tuple)):
            if depth > JSON_MAX_DEPTH:
                return False
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def binary_mime(k):
    """Whether MIME type `k` carries binary data as base64 text (every image/* but
    image/svg+xml, and application/pdf, as nbformat stores them)."""
    return (k.startswith("image/") and k != "image/svg+xml") or k == "application/pdf"


BASE64_SPACE = {32: None, 9: None, 10: None, 13: None}
BASE64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")


def is_base64(v):
    """Whether `v` is base64 as the daemon checks it (RFC 4648 section 4 with `=` padding;
    space, tab, CR and LF ignored). A binary type's value that is not is left out of its
    bundle: the daemon takes it for a forged frame."""
    t = v.translate(BASE64_SPACE)
    body = t.rstrip("=")
    return len(t) % 4 == 0 and len(t) - len(body) <= 2 and set(body) <= BASE64_CHARS


def bundle(value, raw=None, md=None):
    """The MIME bundle of `value` (JSON-ready values, text/plain always); `raw`: a bundle the
    caller gave. `md`, a dict, receives the metadata the display protocol gives beside the
    data (the second item of a `_repr_mimebundle_` or `_repr_*_` tuple)."""
    import base64

    data = dict(raw) if isinstance(raw, dict) else {}
    if md is None:
        md = {}
    if raw is None and not isinstance(value, type):
        m = getattr(value, "_repr_mimebundle_", None)
        if callable(m):
            try:
                r = m()
                if isinstance(r, tuple):
                    if len(r) > 1 and isinstance(r[1], dict):
                        md.update(r[1])
                    r = r[0] if r else None
                if isinstance(r, dict):
                    data.update(r)
            except Exception as e:
                repr_method_failed(value, "_repr_mimebundle_", e)
        for mime, name in REPR_METHODS:
            if mime in data:
                continue
            f = getattr(value, name, None)
            if not callable(f):
                continue
            try:
                r = f()
            except Exception as e:
                repr_method_failed(value, name, e)
                continue
            if isinstance(r, tuple):
                if len(r) > 1 and isinstance(r[1], dict):
                    md[mime] = r[1]
                r = r[0] if r else None
            if r is not None:
                data[mime] = r
    out = {}
    for k, v in data.items():
        if not isinstance(k, str) or not 0 < len(k) <= 128 or k.count("/") != 1 or not set(k) <= MIME_CHARS or len(out) >= 15:
            continue
        if k == "application/json" or k.endswith("+json"):
            if not json_fits(v):
                continue
        elif isinstance(v, (bytes, bytearray)):
            if binary_mime(k):
                v = base64.b64encode(bytes(v)).decode("ascii")
            else:
                v = bytes(v).decode("utf-8", "replace")
        elif not isinstance(v, str):
            continue
        elif binary_mime(k) and not is_base64(v):
            continue
        out[k] = clean(v) if isinstance(v, str) else v
    text = out.get("text/plain")
    if not isinstance(text, str):
        if raw is not None:
            text = ""
        else:
            try:
                text = repr(value)
            except Exception as e:
                text = repr_failed(e)
    out["text/plain"] = clean(text)
    return out


# The daemon's bound of a bundle's metadata is 4096 bytes of JSON as it writes it; measured
# here with every non-ASCII character escaped (never shorter than the daemon's UTF-8 text),
# below a margin for the different spelling of float exponents.
MAX_METADATA_BYTES = 3584


def metadata_fits(md):
    """`md` if it is metadata the daemon takes (a JSON object with string keys, JSON it reads,
    within MAX_METADATA_BYTES), else an empty dict: metadata is dropped, never the bundle."""
    if not isinstance(md, dict) or not md or not json_fits(md):
        return {}
    try:
        md = clean_json(md)
        n = len(json.dumps(md, ensure_ascii=True, separators=(",", ":"), allow_nan=False))
    except Exception:
        return {}
    return md if n <= MAX_METADATA_BYTES else {}


def clean_json(v):
    """`v` with its strings passed through clean() (as bundle values are)."""
    if isinstance(v, str):
        return clean(v)
    if isinstance(v, dict):
        return {clean(str(k)): clean_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean_json(x) for x in v]
    return v


def send_bundle(kind, data, metadata=None):
    """Sends one `display` line of the running cell (flushing the cell's output first), with
    `metadata` where metadata_fits() keeps it. From the worker's main thread the line asks
    for `displayed` and the worker waits for it (interruptibly, as a host call does): the
    daemon reads stdout and stderr apart from the line, and sends it once it has placed the
    bundle after what they held, so what the cell prints next cannot overtake the bundle."""
    for f in (sys.stdout, sys.stderr, STDOUT, STDERR):
        try:
            f.flush()
        except BaseException:
            pass
    note = None
    metadata = metadata_fits(metadata)
    size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if metadata:
        size += len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if size > MAX_DISPLAY_BYTES:
        text = data.get("text/plain", "").encode("utf-8")[:DISPLAY_FALLBACK_BYTES]
        data = {"text/plain": text.decode("utf-8", "ignore")}
        metadata = {}
        note = "bundle of %d bytes over the %d-byte cap: text/plain only" % (size, MAX_DISPLAY_BYTES)
    msg = {"t": "display", "cell": S.cell, "kind": kind, "data": data}
    if metadata:
        msg["metadata"] = metadata
    if note:
        msg["note"] = note
    # A display from another thread, a forked child or a signal handler running inside a wait
    # does not wait (a nested wait could take the outer one's answer): it is placed where the
    # daemon reads it.
    wait = (os.getpid() == S.pid and S.in_cell and not S.waiting
            and threading.current_thread() is threading.main_thread())
    if wait:
        msg["wait"] = True
    armed = S.armed
    try:
        S.armed = False  # a line is never cut by an interrupt: SIGINT now is kept in S.pending
        S.waiting = S.waiting or wait
        send(msg)
        if wait:
            request_wait(lambda parts: parts[0] == "displayed", armed, "a display")
    finally:
        S.armed = armed
        if wait:
            S.waiting = False
    if armed and S.pending:
        raise KeyboardInterrupt


def new_display_id():
    S.display_ids += 1
    return "sandcell-%d" % S.display_ids


class DisplayHandle:
    """What `display(..., display_id=...)` returns, as IPython's DisplayHandle: `display(obj)`
    and `update(obj)` show `obj`. sandcell's bundles carry no display id, so an update
    appears as a new display after the earlier ones instead of replacing one."""

    def __init__(self, display_id):
        self.display_id = display_id

    def __repr__(self):
        return "<DisplayHandle display_id=%r>" % (self.display_id,)

    def display(self, obj, **kwargs):
        display(obj, **kwargs)

    update = display


def display(*objs, raw=False, metadata=None, display_id=None, **kwargs):
    """Shows each object as a MIME bundle (a notebook's display_data) in a session with rich
    output, else its repr on stdout. `raw=True`: each object is already a bundle (a dict of
    MIME type to value). `metadata` (as IPython's display takes it) is added to each
    bundle's own. With `display_id` (True for a new one), returns a DisplayHandle, whose
    updates are new displays; other keywords of IPython's display (`update`, ...) are
    ignored."""
    show_objects(objs, raw, metadata)
    if display_id is not None and not kwargs.get("update"):
        return DisplayHandle(new_display_id() if display_id is True else display_id)
    return None


def show_objects(objs, raw, metadata):
    for obj in objs:
        if S.rich:
            md = {}
            data = bundle(obj, obj if raw and isinstance(obj, dict) else None, md)
            if isinstance(metadata, dict):
                md.update(metadata)
            send_bundle("display", data, md)
        else:
            try:
                text = repr(obj)
            except Exception as e:
                text = repr_failed(e)
            sys.stdout.write(text + "\n")


def figure_png(fig):
    """The PNG bytes of a matplotlib figure, or None when it cannot be drawn."""
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    except Exception:
        return None


def png_bundle(fig, png):
    """The bundle of figure `fig` drawn as `png`: image/png and a text/plain description."""
    import base64

    try:
        w, h = fig.get_size_inches() * fig.dpi
        text = "<Figure size %dx%d with %d Axes>" % (w, h, len(fig.axes))
    except Exception:
        text = "<Figure>"
    return {"text/plain": text, "image/png": base64.b64encode(png).decode("ascii")}


def patch_ipython_display(mod):
    """IPython's display() (what library code calls) sends bundles as `sandcell.display`."""
    for name in ("display",):
        if hasattr(mod, name):
            setattr(mod, name, display)


def type_name(cls):
    mod = getattr(cls, "__module__", None)
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "Exception")
    if mod in (None, "builtins", "__main__"):
        return name
    return "%s.%s" % (mod, name)


# A notebook's shell escape or magic for pip (`!pip install x`, `%pip install x`): not
# Python, so a SyntaxError, whose message then names the session's own installer.
PIP_ESCAPE = re.compile(r"\s*[!%]\s*pip3?\s+install\b")
PIP_HINT = (" (shell escapes and magics are not run; install from the operator's package "
            "source with: import sandcell; sandcell.install(\"pkg==1.2\"))")


def users_frames(tb):
    """Traceback `tb` without the worker's own frames, wherever they are: before the cell's
    (the call into it) and after (the SIGINT handler that raised KeyboardInterrupt,
    sandcell.install raising InstallError), so it ends at the user's line."""
    user = []
    while tb is not None:
        if tb.tb_frame.f_globals is not WORKER_GLOBALS:
            user.append(tb)
        tb = tb.tb_next
    for a, b in zip(user, user[1:]):
        a.tb_next = b
    if user:
        user[-1].tb_next = None
    return user[0] if user else None


def describe(e, fname, compiling=False):
    """The `error` object of a reply for exception `e` raised by the cell named `fname`
    (`compiling`: raised while the worker parsed the cell, so no frame is the user's)."""
    tb = None if compiling else users_frames(e.__traceback__)
    # The same for the exceptions it was raised from or while handling (an interrupt caught
    # and turned into another error), which the traceback shows too.
    chained, c = set(), e
    while len(chained) < 16:
        c = c.__cause__ or c.__context__
        if c is None or id(c) in chained:
            break
        chained.add(id(c))
        try:
            c.__traceback__ = users_frames(c.__traceback__)
        except Exception:
            break
    line = None
    t = tb
    while t is not None:
        if t.tb_frame.f_code.co_filename == fname:
            line = t.tb_lineno
        t = t.tb_next
    if line is None and isinstance(e, SyntaxError) and e.filename == fname:
        line = e.lineno
    try:
        msg = str(e)
    except BaseException:
        msg = "<str() of the exception failed>"
    try:
        te = traceback.TracebackException(type(e), e, tb, limit=-MAX_FRAMES, compact=True)
        text = "".join(te.format())
    except BaseException:
        text = "%s: %s\n" % (type_name(type(e)), msg)
    err = {
        "type": bound_text(type_name(type(e)), 256),
        "message": bound_text(msg, MAX_ERROR_MESSAGE),
        "traceback": bound_tail(text, MAX_TRACEBACK),
    }
    if line is not None:
        err["line"] = line
    return err


def exit_code_of(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code
    try:
        sys.stderr.write(clean(str(code)) + "\n")
    except BaseException:
        pass
    return 1


def run_cell(cell, payload, opts):
    """Runs one cell; returns (status, error or None, exit_code or None)."""
    S.cell = cell
    S.plot_seq = 0
    S.nonce = opts.get("nonce")
    S.host_calls = bool(opts.get("host_calls"))
    S.rich = bool(opts.get("rich"))
    S.figures_drawn = 0
    fname = "<cell %d>" % cell
    main = sys.modules["__main__"] = MAIN
    ns = main.__dict__
    try:
        src = payload.decode("utf-8")
        register_source(fname, src)
        tree = ast.parse(src, fname)
        last = None
        if (
            opts.get("display", 1)
            and tree.body
            and isinstance(tree.body[-1], ast.Expr)
            and not ends_with_semicolon(src, tree.body[-1])
        ):
            last = ast.Interactive(body=[tree.body.pop()])
        body = compile(tree, fname, "exec", dont_inherit=True)
        shown = compile(last, fname, "single", dont_inherit=True) if last is not None else None
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        err = describe(e, fname, compiling=True)
        if isinstance(e, SyntaxError) and PIP_ESCAPE.match(e.text or ""):
            # In the message and on the traceback's last line, which is what notebooks show.
            err["message"] = bound_text(err["message"] + PIP_HINT, MAX_ERROR_MESSAGE)
            err["traceback"] = bound_tail(err["traceback"].rstrip("\n") + PIP_HINT + "\n",
                                          MAX_TRACEBACK)
        return "error", err, None
    timeout = opts.get("timeout_ms")
    if timeout:
        signal.setitimer(signal.ITIMER_REAL, timeout / 1000.0)
        S.timer = True
    stopped = False  # ended by an interrupt or the wall time: nothing more is drawn
    try:
        try:
            S.armed = True
            if S.pending:
                raise KeyboardInterrupt
            exec(body, ns)
            if shown is not None:
                if sys.displayhook is sys.__displayhook__:
                    sys.displayhook = displayhook  # a cell put the default one back
                exec(shown, ns)
        except (KeyboardInterrupt, CellTimeout):
            stopped = True
            raise
        finally:
            try:
                # Figures left open are drawn while the cell's wall time and interrupts
                # still apply: drawing runs the user's code (draw callbacks, artists).
                if not stopped:
                    save_figures(at_end=True)
            finally:
                S.armed = False  # no eval-breaker check before this store: nothing can raise here
    except KeyboardInterrupt as e:
        # Its traceback says where the cell was, as IPython's does.
        return "interrupted", describe(e, fname), None
    except CellTimeout:
        return "timeout", {"type": "TimeoutError", "message": "cell exceeded its time limit of %d ms" % timeout}, None
    except SystemExit as e:
        return "exited", None, exit_code_of(e)
    except MemoryError as e:
        return "memory_exhausted", describe(e, fname), None
    except BaseException as e:
        return "error", describe(e, fname), None
    return "ok", None, None


# ---- inspect -------------------------------------------------------------------------------


class BudgetUsedUp(Exception):
    """The inspect's time budget is used up: no more of the user's code is called."""


class NullWriter:
    """sys.stdout and sys.stderr while an inspect calls the user's code."""

    encoding = "utf-8"

    def write(self, s):
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False


class BoundedRepr(reprlib.Repr):
    """reprlib's bounded repr, except that a repr that raises is not hidden (reprlib shows
    `<X instance at 0x...>` instead): the inspect shows `<repr failed: Type>`."""

    def repr_instance(self, x, level):
        s = builtins.repr(x)
        if len(s) > self.maxother:
            s = s[: self.maxother - 3] + "..."
        return s


REPR = BoundedRepr()
REPR.maxstring = MAX_REPR_CHARS
REPR.maxother = MAX_REPR_CHARS
REPR.maxlong = MAX_REPR_CHARS


def user_call(deadline, fn, *args, **kwargs):
    """fn(*args, **kwargs) with SIGINT and SIGALRM armed for the time left before `deadline`
    (time.monotonic()); BudgetUsedUp when none is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BudgetUsedUp
    signal.setitimer(signal.ITIMER_REAL, left)
    S.timer = True
    try:
        try:
            S.armed = True
            if S.pending:
                raise KeyboardInterrupt
            return fn(*args, **kwargs)
        finally:
            S.armed = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        S.timer = False


def short(text):
    text = clean(text)
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return text


def describe_variable(name, value, state):
    """The `Variable` of `value`; `state["deadline"]` becomes 0 once the budget is used up."""
    t = type(value)
    try:
        kind = bound_text(type_name(t), MAX_VARIABLE_TYPE - 64)  # room for the cut marker
    except BaseException:
        kind = "?"
    var = {"name": name, "type": kind}
    if state["deadline"] <= 0:
        var["repr"] = "<repr skipped: time budget used up>"
        return var
    np = sys.modules.get("numpy")
    pd = sys.modules.get("pandas")
    try:
        if np is not None and isinstance(value, np.ndarray):
            var["size_bytes"] = int(value.nbytes)
            var["shape"] = [int(d) for d in value.shape][:MAX_SHAPE_DIMS]
        elif pd is not None and isinstance(value, (pd.DataFrame, pd.Series)):
            mem = user_call(state["deadline"], value.memory_usage, deep=False)
            var["size_bytes"] = int(mem if isinstance(mem, int) else mem.sum())
            var["shape"] = [int(d) for d in value.shape]
        else:
            var["size_bytes"] = int(user_call(state["deadline"], sys.getsizeof, value))
    except (BudgetUsedUp, CellTimeout, KeyboardInterrupt):
        state["deadline"] = 0
        var["repr"] = "<repr timed out>"
        return var
    except BaseException:
        pass
    try:
        text = user_call(state["deadline"], REPR.repr, value)
        var["repr"] = short(text if isinstance(text, str) else "<repr failed: not a str>")
    except (BudgetUsedUp, CellTimeout, KeyboardInterrupt):
        state["deadline"] = 0
        var["repr"] = "<repr timed out>"
    except BaseException as e:
        try:
            var["repr"] = short("<repr failed: %s>" % type_name(type(e)))
        except BaseException:
            var["repr"] = "<repr failed>"
    if var.get("size_bytes", 0) < 0:
        del var["size_bytes"]
    return var


def inspect(opts):
    """(variables, truncated) of `__main__` for an `inspect` request (see the header)."""
    max_items = max(1, min(opts.get("max_items", INSPECT_DEFAULT_ITEMS), INSPECT_MAX_ITEMS))
    budget = opts.get("timeout_ms", 4000) / 1000.0
    state = {"deadline": time.monotonic() + budget}
    ns = MAIN.__dict__
    truncated = False
    names = []
    for k, v in list(ns.items()):
        if type(k) is not str or not k or k.startswith("_") or isinstance(v, types.ModuleType):
            continue
        if len(clean(k).encode("utf-8")) > MAX_VARIABLE_NAME:
            truncated = True
            continue
        names.append(k)
    names.sort()
    if len(names) > max_items:
        names = names[:max_items]
        truncated = True
    out = []
    size = 128  # the frame around the list
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = NullWriter()
    try:
        for k in names:
            if k not in ns:
                continue  # a repr removed it
            var = describe_variable(clean(k), ns[k], state)
            n = len(json.dumps(var, ensure_ascii=False).encode("utf-8")) + 1
            if size + n > MAX_INSPECT_LINE:
                truncated = True
                break
            size += n
            out.append(var)
    finally:
        sys.stdout, sys.stderr = saved
    return out, truncated


def serve_inspect(opts):
    try:
        variables, truncated = inspect(opts)
    except BaseException as e:
        sys.__stderr__.write("sandcell: inspect failed: %s\n" % clean(repr(e)))
        variables, truncated = [], True
    if os.getpid() != S.pid:
        os._exit(0)  # a child forked by a repr
    install_handlers()
    msg = {"t": "inspected", "variables": variables, "truncated": truncated}
    if "nonce" in opts:
        msg["nonce"] = opts["nonce"]
    send(msg)


# ---- complete and help (Varlink Complete and Help): `query_complete` and `query_help` are
# in query.py, which the launcher and the packages put before this source.


def serve_query(op, payload, opts):
    """Answers a `complete` or `help` request with one `completions` or `help` line; a query
    that fails or runs out of its budget answers empty."""
    budget = min(opts.get("timeout_ms", 2000), 2000) / 1000.0
    deadline = time.monotonic() + budget

    def call(fn, *args):
        return user_call(deadline, fn, *args)

    try:
        code = payload.decode("utf-8")
    except UnicodeDecodeError:
        code = ""
    cursor = opts.get("cursor", len(code))
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = NullWriter()
    try:
        if op == "complete":
            max_items = max(1, min(opts.get("max_items", COMPLETE_MAX_MATCHES), COMPLETE_MAX_MATCHES))
            try:
                matches, start, end, truncated = query_complete(MAIN.__dict__, code, cursor, max_items, call)
            except BaseException:
                c = max(0, min(cursor, len(code)))
                matches, start, end, truncated = [], c, c, False
            msg = {"t": "completions", "matches": matches, "cursor_start": start,
                   "cursor_end": end, "truncated": truncated}
        else:
            try:
                found, text = query_help(MAIN.__dict__, code, cursor, opts.get("detail", 0), call)
            except BaseException:
                found, text = False, ""
            msg = {"t": "help", "found": found, "data": {"text/plain": text}}
    finally:
        sys.stdout, sys.stderr = saved
    if os.getpid() != S.pid:
        os._exit(0)  # a child forked by the user's code
    install_handlers()
    if "nonce" in opts:
        msg["nonce"] = opts["nonce"]
    send(msg)


def finish_cell():
    """After every cell: back in the worker's own process, timers off, output flushed,
    streams and handlers restored, figures saved."""
    if os.getpid() != S.pid:
        # A forked child of the cell returned here: it must not touch the protocol.
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        os._exit(0)
    if S.timer:
        signal.setitimer(signal.ITIMER_REAL, 0)
        S.timer = False
    install_handlers()
    close_figures()
    for name, orig in (("stdout", STDOUT), ("stderr", STDERR)):
        cur = getattr(sys, name)
        for f in (cur, orig) if cur is not orig else (orig,):
            try:
                f.flush()
            except BaseException:
                pass
        if cur is not orig:
            setattr(sys, name, orig)


def serve():
    send({"t": "ready", "language": "python", "engine": ENGINE})
    while True:
        S.in_cell = False
        S.pending = False
        req = read_request()
        if req is None:
            break
        op, cell, payload, opts = req
        if op == "exit":
            break
        if op == "inspect":
            serve_inspect(opts)
            continue
        if op in ("complete", "help"):
            serve_query(op, payload, opts)
            continue
        if op in ("host_reply", "displayed"):
            continue  # the answer to a host call the last cell gave up on, or a stale `displayed`
        if op != "exec":
            protocol_fail("unknown request %r" % op[:32])
        # The request is whole: a successor daemon learns from this line that it arrived.
        started = {"t": "started", "cell": cell}
        if "nonce" in opts:
            started["nonce"] = opts["nonce"]
        send(started)
        status, error, code = run_cell(cell, payload, opts)
        try:
            finish_cell()
        except BaseException as e:  # a broken stream or figure must not lose the reply
            sys.__stderr__.write("sandcell: after the cell: %s\n" % clean(repr(e)))
        done = {"t": "done", "cell": cell, "status": status, "state": "kept"}
        if "nonce" in opts:
            done["nonce"] = opts["nonce"]
        if error is not None:
            done["error"] = error
        if code is not None:
            done["exit_code"] = code
        send(done)
        if status == "exited":
            os._exit(code & 0xFF)
    os._exit(0)


# ---- packages: per-session installs from the operator's wheelhouse --------------------------
#
# `sandcell.install("pkg==1.2", ...)` installs wheels (PEP 427) from the environment's
# wheelhouse (SANDCELL_WHEELHOUSE, a read-only directory of the worker's view) into
# SANDCELL_PACKAGES_DIR/python, a directory of the session's own file system (its bytes count
# against the session's disk budget and vanish with the session), put first on sys.path, so
# the package imports in the same session right away. Everything runs in this process (the
# worker starts no program): the requirement syntax and the wheel file names, tags and
# versions are read with `packaging` (PEP 440, PEP 508, the platform compatibility tags), a
# wheel is unpacked with zipfile as the binary distribution format specification says
# (`<name>.data/purelib` and `platlib` into the site directory; `scripts`, `headers` and
# `data` are not installed; every file checked against RECORD's sha256). Rules:
# - wheels only: a project the wheelhouse has only as a source distribution is refused (a
#   build runs the project's code and needs compilers);
# - where the wheelhouse has SHA256SUMS (sha256sum(1) format), a wheel must be listed there
#   with its digest, checked before the wheel is opened;
# - dependencies (Requires-Dist whose marker holds) come from the wheelhouse too, unless the
#   environment already has a matching version;
# - a wheel is unpacked into a staging directory and moved in whole, so a refused or failed
#   install (RECORD mismatch, unsafe member path, disk budget used up, interrupt) leaves
#   nothing behind; a project already installed in this session is not replaced.

WHEELHOUSE = os.environ.get("SANDCELL_WHEELHOUSE") or None
PACKAGES_DIR = os.environ.get("SANDCELL_PACKAGES_DIR") or None
MAX_INSTALLS = 256  # wheels one sandcell.install call installs at most, dependencies included
MAX_WHEEL_MEMBERS = 100000
MAX_WHEEL_METADATA_BYTES = 4 * 1024 * 1024


def _read_member(z, name):
    """At most MAX_WHEEL_METADATA_BYTES of member `name` of zip `z`, decompressed only that far
    (ZipFile.read inflates the whole member first: a small wheel whose metadata inflates to
    gigabytes would exhaust the session's memory)."""
    with z.open(name) as f:
        return f.read(MAX_WHEEL_METADATA_BYTES)


class InstallError(Exception):
    """sandcell.install refused a package or could not install it."""


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.tags import sys_tags
        from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
        from packaging.version import Version
    except ImportError as e:
        raise InstallError("sandcell.install needs the 'packaging' module (%s)" % e) from None
    return Requirement, sys_tags, canonicalize_name, parse_sdist_filename, parse_wheel_filename, Version


def _wheelhouse_catalog():
    """{name: [(version, file, tags)]}, {name: [sdist file]} of the wheelhouse."""
    _, _, canon, parse_sdist, parse_wheel, _ = _packaging()
    wheels, sdists = {}, {}
    for f in sorted(os.listdir(WHEELHOUSE)):
        if f.endswith(".whl"):
            try:
                name, version, _build, tags = parse_wheel(f)
            except Exception:
                continue
            wheels.setdefault(name, []).append((version, f, tags))
        elif f.endswith((".tar.gz", ".zip", ".tar.bz2", ".tgz")):
            try:
                name, _version = parse_sdist(f)
            except Exception:
                continue
            sdists.setdefault(name, []).append(f)
    return wheels, sdists


def _hash_manifest():
    """{file: sha256 hex} from the wheelhouse's SHA256SUMS, or None without one."""
    path = os.path.join(WHEELHOUSE, "SHA256SUMS")
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read(MAX_WHEEL_METADATA_BYTES)
    except FileNotFoundError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def _choose_wheel(req, wheels, sdists, catalog_names):
    """The wheel file that satisfies `req` best (highest version, compatible tags)."""
    _, sys_tags, canon, _, _, _ = _packaging()
    name = canon(req.name)
    have = wheels.get(name, [])
    if not have:
        if name in sdists:
            raise InstallError(
                "%s: the wheelhouse has only a source distribution (%s); sandcell installs "
                "wheels only, because building a source distribution runs the project's code "
                "and needs compilers: ask the operator for a wheel of it (pip wheel)"
                % (req.name, ", ".join(sdists[name][:3])))
        offered = sorted(catalog_names)
        listing = ", ".join(offered[:20]) + (" ..." if len(offered) > 20 else "")
        raise InstallError("%s is not in the wheelhouse (it offers: %s)" % (req.name, listing or "nothing"))
    supported = set(sys_tags())
    fits = [(v, f) for (v, f, tags) in have if tags & supported]
    if not fits:
        raise InstallError("%s: no wheel in the wheelhouse fits this interpreter (%s)"
                           % (req.name, ", ".join(f for (_, f, _) in have[:3])))
    ok = [(v, f) for (v, f) in fits if req.specifier.contains(v, prereleases=True)]
    if not ok:
        raise InstallError("%s: no wheel matches %s (the wheelhouse has %s)"
                           % (req.name, req.specifier,
                              ", ".join(sorted({str(v) for (v, _) in fits}))))
    return max(ok)


def _installed_version(name, site):
    """The version of distribution `name` this session can import: (version, in_session)."""
    import importlib.metadata as md
    _, _, canon, _, _, _ = _packaging()
    for d in md.distributions(path=[site]):
        if canon(d.metadata["Name"] or "") == name:
            return d.version, True
    try:
        return md.version(name), False
    except Exception:
        return None, False


def _safe_member(path):
    """A wheel member's path, relative and without '..', or InstallError."""
    if (not path or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("..", "") for p in path.rstrip("/").split("/"))):
        raise InstallError("unsafe path in the wheel: %r" % path[:200])
    return path


def _budget_error(e, what):
    """InstallError for an OSError that means the session's disk budget is used up, else None."""
    import errno
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return InstallError("%s: the session's disk budget is used up (%s); free space in the "
                            "session or ask for a larger max_session_files_bytes" % (what, e.strerror))
    return None


def _unpack_wheel(wheel_path, file_name, stage):
    """Unpacks one wheel into the empty directory `stage`; returns its dist-info METADATA
    text."""
    import base64
    import csv
    import hashlib
    import re
    import zipfile
    try:
        z = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as e:
        raise InstallError("%s: not a wheel (%s)" % (file_name, e)) from None
    with z:
        infos = z.infolist()
        if len(infos) > MAX_WHEEL_MEMBERS:
            raise InstallError("%s has more than %d files" % (file_name, MAX_WHEEL_MEMBERS))
        dist_info = sorted({i.filename.split("/")[0] for i in infos
                            if i.filename.split("/")[0].endswith(".dist-info")})
        if len(dist_info) != 1:
            raise InstallError("%s: not a wheel (no single .dist-info directory)" % file_name)
        dist_info = dist_info[0]
        # Compiled code would install and then fail to load: the session's file system is
        # mounted noexec, so the loader cannot map a library from it. Refused up front,
        # saying so (the safer choice than allowing code execution from files a cell can
        # rewrite).
        compiled = [i.filename for i in infos
                    if re.search(r"\.(so|so\.[0-9.]+|dylib|pyd)$", i.filename)]
        if compiled:
            raise InstallError(
                "%s holds compiled code (%s), which cannot be loaded from a session's files "
                "(they are mounted noexec); only pure-Python wheels install"
                % (file_name, compiled[0][:200]))
        data_dir = dist_info[:-len(".dist-info")] + ".data"
        wheel_meta = _read_member(z, dist_info + "/WHEEL").decode("utf-8", "replace")
        version = [l.split(":", 1)[1].strip() for l in wheel_meta.splitlines()
                   if l.startswith("Wheel-Version:")]
        if not version or version[0].split(".")[0] != "1":
            raise InstallError("%s: unsupported Wheel-Version %s" % (file_name, version))
        record = {}
        rec_text = _read_member(z, dist_info + "/RECORD").decode("utf-8", "replace")
        for row in csv.reader(rec_text.splitlines()):
            if len(row) >= 2 and row[1]:
                record[row[0]] = row[1]
        for info in infos:
            name = _safe_member(info.filename)
            if name.endswith("/"):
                continue
            if name.startswith(data_dir + "/"):
                parts = name.split("/", 2)
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: not installed in a session
                dest = _safe_member(parts[2])
            elif name.split("/")[0] == data_dir:
                continue
            else:
                dest = name
            expected = record.get(info.filename)
            if expected is None and not name.startswith(dist_info + "/RECORD"):
                raise InstallError("%s: %s is not in RECORD" % (file_name, name[:200]))
            target = os.path.join(stage, dest)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                out = open(target, "xb")
            except (FileExistsError, NotADirectoryError):
                raise InstallError("%s: %s clashes with another file of the wheel"
                                   % (file_name, dest[:200])) from None
            digest = hashlib.sha256()
            with z.open(info) as src, out:
                while True:
                    chunk = src.read(1 << 16)
                    if not chunk:
                        break
                    digest.update(chunk)
                    out.write(chunk)
            if expected is not None:
                algo, _, value = expected.partition("=")
                got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
                if algo != "sha256" or got != value.rstrip("="):
                    raise InstallError("%s: %s does not match its RECORD hash" % (file_name, name[:200]))
        with open(os.path.join(stage, dist_info, "INSTALLER"), "w") as f:
            f.write("sandcell\n")
        return _read_member(z, dist_info + "/METADATA").decode("utf-8", "replace")


def _plan_merge(unpacked, site):
    """Checks that the wheels unpacked in this call (`[(file_name, directory)]`, in order) merge
    into `site` without one file replacing another: directories merge (namespace packages,
    PEP 420, ship the same directory from several distributions), a file may take only a free
    path. Raises InstallError naming the first clash; changes nothing."""
    import stat
    claimed = {}  # relative path -> (is_dir, file_name) of the wheels before
    for file_name, root in unpacked:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            for name, is_dir in [(d, True) for d in dirnames] + [(f, False) for f in filenames]:
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if rel in claimed:
                    was_dir, owner = claimed[rel]
                    if is_dir and was_dir:
                        continue
                    raise InstallError("%s: %s would replace the one %s installs (both are in "
                                       "this install)" % (file_name, rel[:200], owner))
                try:
                    st = os.lstat(os.path.join(site, rel))
                except FileNotFoundError:
                    claimed[rel] = (is_dir, file_name)
                    continue
                if is_dir and stat.S_ISDIR(st.st_mode):
                    claimed[rel] = (True, file_name)
                    continue
                raise InstallError("%s: %s is already installed in this session (the wheel "
                                   "would replace it)" % (file_name, rel[:200]))


def _merge_into(src, dst, moved):
    """Moves the entries of directory `src` into directory `dst`, descending into directories
    both have; appends each rename to `moved` as (from, to)."""
    for entry in sorted(os.listdir(src)):
        s, d = os.path.join(src, entry), os.path.join(dst, entry)
        if os.path.isdir(d) and not os.path.islink(d) and os.path.isdir(s):
            _merge_into(s, d, moved)
        else:
            os.rename(s, d)
            moved.append((s, d))


def _check_readable(path, file_name):
    """InstallError unless the wheelhouse's `file_name` opens (a symbolic link to a file outside
    the wheelhouse does not: the session sees only the wheelhouse)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        if os.path.islink(path):
            target = os.path.realpath(path)
            home = os.path.realpath(WHEELHOUSE)
            if os.path.commonpath([target, home]) != home:
                raise InstallError(
                    "%s cannot be read: it is a symbolic link to a file outside the wheelhouse, "
                    "which sessions cannot see (%s); the operator can copy the file into the "
                    "wheelhouse" % (file_name, why)) from None
        raise InstallError("%s cannot be read in the wheelhouse (%s)" % (file_name, why)) from None


def install_packages(*requirements, deps=True):
    """Installs packages from the environment's wheelhouse into this session.

    `requirements` are PEP 508 strings (`"pkg"`, `"pkg==1.2"`, `"pkg>=1,<2"`). Wheels only;
    dependencies too unless `deps=False`. Returns the installed `"name version"` strings.
    All or nothing: every wheel of the call is unpacked into a staging directory next to the
    session's packages first and moved into place only when all of them resolved and
    unpacked; a call that fails leaves the session's packages as they were. Directories
    merge (namespace packages); a file never replaces another. Raises InstallError (the
    reason: no wheelhouse, not offered, source distribution only, hash mismatch, a file
    already installed, disk budget used up)."""
    import shutil
    Requirement, _, canon, _, _, _ = _packaging()
    if WHEELHOUSE is None or PACKAGES_DIR is None:
        raise InstallError("this environment has no wheelhouse: the operator can name one in "
                           "sandcelld.toml (wheelhouse = \"/path\" in its [environments.<name>] table)")
    reqs = []
    for r in requirements:
        if not isinstance(r, str):
            raise TypeError("sandcell.install takes requirement strings, e.g. 'pkg==1.2'")
        try:
            reqs.append(Requirement(r))
        except Exception as e:
            raise InstallError("%r is not a requirement: %s" % (r[:200], e)) from None
    if not reqs:
        raise InstallError("name at least one package, e.g. sandcell.install('pkg==1.2')")
    site = os.path.join(PACKAGES_DIR, "python")
    # The staging directory sits beside `site` on the session's file system (its bytes count
    # against the disk budget; renames into `site` move no data) and is never on sys.path.
    staging = os.path.join(PACKAGES_DIR, ".staging-python-%d" % os.getpid())
    try:
        os.makedirs(site, mode=0o700, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging, mode=0o700)
    except OSError as e:
        err = _budget_error(e, "sandcell.install")
        if err is not None:
            raise err from None
        raise
    if site not in sys.path:
        sys.path.insert(0, site)
        sys.path_importer_cache.pop(site, None)
    try:
        return _install_staged(reqs, deps, site, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _install_staged(reqs, deps, site, staging):
    Requirement, _, canon, _, _, _ = _packaging()
    wheels, sdists = _wheelhouse_catalog()
    manifest = _hash_manifest()
    names = set(wheels) | set(sdists)
    queue = [(r, True) for r in reqs]
    seen = set()
    done = []
    unpacked = []  # (file name, its staging directory), in install order
    while queue:
        req, top = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canon(req.name)
        if name in seen:
            continue
        seen.add(name)
        have, in_session = _installed_version(name, site)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        if have is not None and in_session:
            raise InstallError("%s %s is already installed in this session; a session keeps "
                               "the first version it installs (open a new session for %s)"
                               % (req.name, have, req))
        if len(done) >= MAX_INSTALLS:
            raise InstallError("more than %d wheels in one install" % MAX_INSTALLS)
        _, file_name = _choose_wheel(req, wheels, sdists, names)
        path = os.path.join(WHEELHOUSE, file_name)
        _check_readable(path, file_name)
        if manifest is not None:
            import hashlib
            want = manifest.get(file_name)
            if want is None:
                raise InstallError("%s is not listed in the wheelhouse's SHA256SUMS: refused"
                                   % file_name)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            if digest.hexdigest() != want:
                raise InstallError("%s does not match its SHA256SUMS digest: refused" % file_name)
        stage = os.path.join(staging, str(len(unpacked)))
        try:
            os.mkdir(stage)
            metadata = _unpack_wheel(path, file_name, stage)
        except OSError as e:
            err = _budget_error(e, file_name)
            if err is not None:
                raise err from None
            raise
        unpacked.append((file_name, stage))
        version = file_name.split("-")[1]
        done.append("%s %s" % (req.name, version))
        if deps:
            for line in metadata.splitlines():
                if line.startswith("Requires-Dist:"):
                    try:
                        queue.append((Requirement(line.split(":", 1)[1].strip()), False))
                    except Exception:
                        pass
    _plan_merge(unpacked, site)
    moved = []
    try:
        for _, stage in unpacked:
            _merge_into(stage, site, moved)
    except BaseException:
        for s, d in reversed(moved):
            try:
                os.rename(d, s)
            except OSError:
                pass
        raise
    import importlib
    importlib.invalidate_caches()
    return done


# ---- start ---------------------------------------------------------------------------------

ENGINE = "CPython %d.%d.%d" % sys.version_info[:3]
STDOUT = sys.stdout
STDERR = sys.stderr
try:
    STDOUT.reconfigure(line_buffering=True)
except Exception:
    pass
for fd in (REQ_FD, REP_FD):
    os.set_inheritable(fd, False)
os.register_at_fork(after_in_child=after_fork_in_child)
install_handlers()
install_host_module()
sys.displayhook = displayhook
# matplotlib.pyplot: figures left open become PNG bundles; IPython's display() feeds ours.
sys.meta_path.insert(0, PatchOnImport(("matplotlib.pyplot",), patch_pyplot))
sys.meta_path.insert(0, PatchOnImport(("IPython.display", "IPython.core.display_functions"),
                                      patch_ipython_display))

for p in reversed([p for p in os.environ.get("SANDCELL_PYTHON_PATH", "").split(":") if p]):
    sys.path.insert(0, p)
sys.path.append(SESSION_DIR)
sys.argv = [""]

MAIN = types.ModuleType("__main__")
MAIN.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = MAIN

for name in [m.strip() for m in os.environ.get("SANDCELL_PYTHON_PRELOAD", "").split(",") if m.strip()]:
    try:
        __import__(name)
    except Exception as e:
        sys.stderr.write("sandcell: preloading %s failed: %s\n" % (name, clean(repr(e))))
sys.stderr.flush()

# Everything made so far (the interpreter's and the driver's objects, and the preloaded
# modules': tens of thousands with pandas) goes to the permanent generation (gc.freeze,
# Python >= 3.7), so a collection of the oldest generation, which CPython starts now and then
# during some cell, scans only what the session made instead of all of them: with pandas
# loaded that scan alone takes tens of milliseconds, one cell's tail latency. Frozen objects
# are never collected, which only matters for cycles among them that a cell breaks loose;
# freezing is a constant-time move (no collection first, which would cost the start-up the
# very scan it saves the cells).
gc.freeze()

serve()
