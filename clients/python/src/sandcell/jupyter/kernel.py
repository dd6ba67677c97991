"""The ipykernel-based sandcell Jupyter kernel: the Jupyter messaging protocol mapped onto one
sandcell session.

The kernelspecs start ``sandcellctl kernel`` (a kernel in Rust with the same behaviour, which
starts and answers without ipykernel's import and message machinery); this module is the
fallback, installed with ``python3 -m sandcell.jupyter install --python-kernel`` and tested
by the same suite (``SANDCELL_JUPYTER_PYTHON_KERNEL=1``).

Built on ipykernel's wrapper-kernel base, :class:`ipykernel.kernelbase.Kernel`, launched by
:class:`ipykernel.kernelapp.IPKernelApp` (https://jupyter-client.readthedocs.io/en/stable/
wrapperkernels.html). Why that and not jupyter_client + pyzmq by hand: the base already does
the wire protocol (message signing with the connection file's key, the five sockets, the
heartbeat thread, a control channel served on its own thread so an ``interrupt_request``
is answered while a cell runs, ``execute_input`` and ``status`` broadcasts, message
parenting); it is what Debian ships as python3-ipykernel, and what Jupyter's own docs name for
kernels that delegate execution elsewhere. What this module adds is only the mapping:

- ``execute_request``: one ``Execute`` of the session with rich output; output frames become
  ``stream`` messages, display frames ``display_data`` or (the last expression's value)
  ``execute_result`` with the kernel's ``execution_count`` (advanced only by a cell with
  ``store_history``, as IPython's kernel counts); an error becomes an ``error``
  message and reply with the traceback's lines. After the cell's output a ``stderr`` stream
  says what the result reports was cut (``sandcell: stdout truncated: kept 65536 of 1000001
  bytes``, also for stderr and display bundles) and gives its warnings and hints (e.g. which
  environment has a module the cell could not import), before the error.
  ``user_expressions`` are not evaluated (that would run code outside a cell): each key is
  answered with an error entry. IPython magics and shell escapes (``%timeit``, ``!ls``) are
  a ``SyntaxError``: cells are plain Python. R's plots come as ``image/png`` display
  frames like matplotlib's figures (the worker sends each page its default device wrote).
- ``interrupt_request`` (``interrupt_mode: message`` in the kernelspec): sandcell's
  ``Interrupt`` of the running cell; the session keeps its variables.
- ``shutdown_request``: ``Close``. A restart is a new kernel process (jupyter_client's
  ``restart_kernel``), so a new session. A session that ended under a cell (worker crashed,
  out of memory, ``exit()``) is reported in that cell, and the next cell opens a new session
  and says so first.
- ``complete_request``, ``inspect_request``: the session's ``Complete`` and ``Help`` (never a
  cell, never in the history; bounded in time by the daemon): Python completes through
  rlcompleter over the session's namespace and module names, R through its own completion;
  help is the signature and docstring, or R's help page. When the session cannot answer
  (it ended, or a cell runs: the daemon refuses queries beside a cell), the kernel answers
  locally: the language's keywords and builtins and the names its own history assigns, and
  for Python help for builtins from the kernel's interpreter (``pydoc``).
- ``is_complete_request``: decided locally from the language's parser: Python's ``codeop``
  (plus IPython's rule that an indented last line needs a blank line); for R a small
  heuristic (open brackets or strings, a trailing operator: incomplete; a closing bracket
  too many: invalid).
- ``history_request``: the kernel's own history of this kernel's cells (``tail``, ``range``,
  ``search`` with a glob pattern, ``unique``): each cell's code and result text cut at
  64 KiB, at most 16 MiB in all (the oldest cells go first).
- ``comm_open``: answered with ``comm_close`` (comms and widgets are not supported);
  ``comm_msg`` and ``comm_close`` are ignored.
- ``input()``: cells have no stdin (the confined worker's is ``/dev/null``), so Python's
  ``input()`` raises ``EOFError``; the kernel says why in the error's value.
"""

from __future__ import annotations

import asyncio
import builtins
import codeop
import fnmatch
import keyword
import os
import re
import threading
import warnings
from typing import Any

from ipykernel.kernelbase import Kernel

import sandcell

from . import KERNEL_ENV, KERNELS

#: Names an R completion offers besides those the history assigns.
R_WORDS = sorted(set("""
if else repeat while function for in next break TRUE FALSE NULL Inf NaN NA NA_integer_
NA_real_ NA_character_ library require print cat paste paste0 sprintf format summary str head
tail nrow ncol length names colnames rownames data.frame matrix list vector c seq seq_len
seq_along rep sum mean median sd var min max range quantile table unique sort order rev
apply sapply lapply vapply mapply Map Reduce Filter do.call lm glm predict anova t.test
plot hist barplot boxplot lines points abline legend par png dev.off read.csv write.csv
readRDS saveRDS is.na ifelse which any all round signif abs sqrt exp log log10 nchar substr
strsplit gsub sub grepl regmatches toupper tolower factor levels as.numeric as.integer
as.character as.factor as.data.frame merge aggregate with within subset transform stop
warning message tryCatch invisible return Sys.time set.seed rnorm runif sample ggplot aes
geom_point geom_line geom_histogram geom_bar geom_boxplot facet_wrap labs theme_minimal
""".split()))


def python_is_complete(code: str) -> dict[str, Any]:
    """The ``is_complete_reply`` of Python ``code``, from ``codeop``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = codeop.compile_command(code, "<cell>", "exec")
    except (SyntaxError, OverflowError, ValueError):
        return {"status": "invalid"}
    lines = code.rstrip("\n").split("\n")
    last = lines[-1] if lines else ""
    if compiled is None:
        indent = re.match(r"\s*", last).group(0)  # type: ignore[union-attr]
        return {"status": "incomplete", "indent": indent + ("    " if last.rstrip().endswith(":") else "")}
    if len(lines) > 1 and last[:1] in (" ", "\t") and not code.endswith("\n\n"):
        # An indented block is open until a blank line, as in IPython's check_complete.
        return {"status": "incomplete", "indent": re.match(r"\s*", last).group(0)}  # type: ignore[union-attr]
    return {"status": "complete"}


_R_TRAILING = re.compile(r"(\+|-|\*|/|\^|\||&|,|<-|<<-|=|~|%[^%\n]*%|\|>|!|\$|@|:)\s*$")


def r_is_complete(code: str) -> dict[str, Any]:
    """The ``is_complete_reply`` of R ``code``, by a heuristic (not R's parser): brackets and
    strings left open or a trailing binary operator make it incomplete, a closing bracket
    without its opening one invalid."""
    depth: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    quote = None
    i = 0
    while i < len(code):
        ch = code[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch == "#":
            nl = code.find("\n", i)
            i = len(code) if nl < 0 else nl
            continue
        elif ch in "'\"`":
            quote = ch
        elif ch in "([{":
            depth.append(ch)
        elif ch in ")]}":
            if not depth or depth[-1] != pairs[ch]:
                return {"status": "invalid"}
            depth.pop()
        i += 1
    if quote or depth:
        return {"status": "incomplete", "indent": "  " * len(depth)}
    stripped = re.sub(r"#[^\n]*$", "", code.rstrip())
    if _R_TRAILING.search(stripped):
        return {"status": "incomplete", "indent": ""}
    return {"status": "complete"}


#: Bytes of a cell's code (and of its result's text) the history keeps.
MAX_HISTORY_CODE = 64 * 1024
#: Bytes of code and result text the whole history keeps (the oldest cells go first).
MAX_HISTORY_BYTES = 16 * 1024 * 1024


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, on a character boundary."""
    b = text.encode("utf-8", "surrogatepass")
    if len(b) <= limit:
        return text
    return b[:limit].decode("utf-8", "ignore")


def notices(r: Any) -> str:
    """The ``stderr`` lines saying what result ``r`` reports was cut and its warnings
    (``""`` when there is nothing to say)."""
    lines = []
    for name, st in (("stdout", r.stdout_stats), ("stderr", r.stderr_stats),
                     ("display bundles", r.displays_stats)):
        if st is not None and st.truncated:
            lines.append(f"sandcell: {name} truncated: kept {st.kept} of {st.seen} bytes\n")
    for w in r.warnings:
        # The client adds which environment has a module the cell could not import.
        label = "hint" if "is not installed in this environment" in w else "warning"
        lines.append(f"sandcell: {label}: {w}\n")
    return "".join(lines)


def _python_names(history: list[tuple[int, str]]) -> set[str]:
    import ast

    names: set[str] = set()
    for _, code in history:
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add((a.asname or a.name).split(".")[0])
    return names


class SandcellKernel(Kernel):
    """One Jupyter kernel on one sandcell session (see the module documentation)."""

    implementation = "sandcell"
    implementation_version = sandcell.__version__
    banner = "sandcell: cells run confined (Landlock, seccomp, cgroups) by sandcelld"
    help_links = [{"text": "sandcell", "url": "https://github.com/sandcell/sandcell"}]

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        name = os.environ.get(KERNEL_ENV, "sandcell-python")
        if name not in KERNELS:
            raise SystemExit(f"sandcell.jupyter: unknown kernel {name!r} in {KERNEL_ENV}")
        self.sc_name = name
        self.sc_language, self.sc_environment, _, self.jupyter_language = KERNELS[name]
        self.client = sandcell.Client(timeout=None)
        self.sc_session: sandcell.Session | None = None
        self.sc_history: list[tuple[int, str]] = []
        self.sc_outputs: dict[int, str] = {}
        #: Bytes of code and result text in the history.
        self.sc_history_bytes = 0
        self.sc_ended: str | None = None
        self.sc_version = self._interpreter_version()
        self.shell_handlers["comm_open"] = self.comm_open_unsupported
        self.shell_handlers["comm_msg"] = self.comm_ignored
        self.shell_handlers["comm_close"] = self.comm_ignored
        self._open()

    # -- the session ------------------------------------------------------------------------

    def _interpreter_version(self) -> str:
        try:
            envs = self.client.list_environments()
        except Exception:
            return ""
        for e in envs:
            get = e.get if isinstance(e, dict) else (lambda k, e=e: getattr(e, k, None))
            if get("language") != self.sc_language:
                continue
            if (self.sc_environment is None and get("default")) or get("name") == self.sc_environment:
                # "CPython 3.11.2", "CPython 3.14.0 (Eryx)", "R 4.2.2".
                m = re.search(r"\d+\.\d+(\.\d+)?", str(get("interpreter_version") or ""))
                return m.group(0) if m else ""
        return ""

    def _open(self) -> None:
        self.sc_session = self.client.session(self.sc_language, self.sc_environment,
                                              rich_output=True)

    @property
    def language_info(self) -> dict[str, Any]:
        if self.sc_language == "r":
            return {"name": "R", "version": self.sc_version, "mimetype": "text/x-r-source",
                    "file_extension": ".r", "pygments_lexer": "r", "codemirror_mode": "r"}
        return {"name": "python", "version": self.sc_version, "mimetype": "text/x-python",
                "file_extension": ".py", "pygments_lexer": "ipython3",
                "codemirror_mode": {"name": "ipython", "version": 3},
                "nbconvert_exporter": "python"}

    # -- execute ----------------------------------------------------------------------------

    def _stream(self, name: str, text: str) -> None:
        self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})

    def _error(self, ename: str, evalue: str, traceback: list[str]) -> dict[str, Any]:
        content = {"ename": ename, "evalue": evalue, "traceback": traceback}
        self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def do_execute(self, code: str, silent: bool, store_history: bool = True,
                   user_expressions: dict[str, Any] | None = None, allow_stdin: bool = False,
                   **_: Any) -> dict[str, Any]:
        if not silent and not store_history:
            # The base counts every cell that is not silent; IPython's kernel only stored ones.
            self.execution_count -= 1
        if store_history and not silent:
            self._remember(self.execution_count, code)
        exprs = {k: {"status": "error", "ename": "NotImplementedError",
                     "evalue": "the sandcell kernel does not evaluate user_expressions "
                               "(they would run code outside a cell)", "traceback": []}
                 for k in (user_expressions or {})}
        ok = {"status": "ok", "execution_count": self.execution_count, "payload": [],
              "user_expressions": exprs}
        if not code.strip():
            return ok
        if self.sc_session is None:
            try:
                self._open()
            except sandcell.VarlinkError as e:
                return self._error(type(e).__name__, f"could not open a sandcell session: {e}", [])
            if self.sc_ended and not silent:
                self._stream("stderr", f"sandcell: {self.sc_ended}; a new session was started "
                                       "(the variables of the old one are lost; tracebacks number "
                                       "its cells, <cell N>, from 1 again, apart from the "
                                       "execution count)\n")
            self.sc_ended = None
        session = self.sc_session
        assert session is not None
        count = self.execution_count

        def on_output(o: Any) -> None:
            if silent:
                return
            if isinstance(o, sandcell.Output):
                self._stream(o.stream, o.text)
                return
            if o.note:
                self._stream("stderr", f"sandcell: {o.note}\n")
            if o.kind == "result":
                if store_history and self.sc_history and self.sc_history[-1][0] == count:
                    text = _cut(o.text, MAX_HISTORY_CODE)
                    old = self.sc_outputs.get(count, "")
                    self.sc_outputs[count] = text
                    self.sc_history_bytes += (len(text.encode("utf-8", "surrogatepass"))
                                              - len(old.encode("utf-8", "surrogatepass")))
                self.send_response(self.iopub_socket, "execute_result",
                                   {"execution_count": count, "data": o.data,
                                    "metadata": o.metadata})
            else:
                self.send_response(self.iopub_socket, "display_data",
                                   {"data": o.data, "metadata": o.metadata, "transient": {}})

        try:
            r = session.execute(code, on_output)
        except sandcell.VarlinkError as e:
            self._drop_session(f"the session is gone ({e})")
            return self._error(type(e).__name__, str(e), [])
        note = notices(r)
        if note and not silent:
            self._stream("stderr", note)
        if r.session_ended:
            why = f"the session ended with cell {count} ({r.status}" + (
                f": {'; '.join(r.warnings)}" if r.warnings else "") + ")"
            self._drop_session(why)
        if r.status == "ok":
            return ok
        if r.status == "error" and r.error is not None:
            err = r.error
            evalue = err.message
            if err.type == "EOFError" and self.sc_language == "python":
                evalue += " (input() is refused: a sandcell cell has no stdin)"
            tb = (err.traceback or "").rstrip("\n").split("\n") if err.traceback else []
            if not tb or not tb[-1].startswith(err.type):
                tb.append(f"{err.type}: {evalue}")
            return self._error(err.type, evalue, tb)
        names = {"interrupted": "KeyboardInterrupt", "timeout": "TimeoutError",
                 "memory_exhausted": "MemoryError", "exited": "SystemExit"}
        if self.sc_language == "r":
            names["interrupted"] = "interrupt"  # R's own condition class
        ename = names.get(r.status, "SandcellError")
        evalue = r.error.message if r.error is not None else f"the cell ended: {r.status}"
        if r.status == "exited":
            evalue = f"the cell ended the interpreter (exit code {r.exit_code})"
        if r.session_ended:
            evalue += "; the session ended, the next cell starts a new one"
        return self._error(ename, evalue, [f"{ename}: {evalue}"])

    def _remember(self, count: int, code: str) -> None:
        """Adds a cell to the history, within its bounds."""
        code = _cut(code, MAX_HISTORY_CODE)
        self.sc_history.append((count, code))
        self.sc_history_bytes += len(code.encode("utf-8", "surrogatepass"))
        while len(self.sc_history) > 1 and (len(self.sc_history) > 10_000
                                            or self.sc_history_bytes > MAX_HISTORY_BYTES):
            n, c = self.sc_history.pop(0)
            out = self.sc_outputs.pop(n, "")
            self.sc_history_bytes -= len((c + out).encode("utf-8", "surrogatepass"))

    def _drop_session(self, why: str) -> None:
        s, self.sc_session = self.sc_session, None
        self.sc_ended = why
        if s is not None:
            try:
                s.close()
            except Exception:
                pass

    # -- interrupt, shutdown ----------------------------------------------------------------

    async def interrupt_request(self, stream: Any, ident: Any, parent: Any) -> None:
        s = self.sc_session
        if s is not None:
            loop = asyncio.get_running_loop()

            def interrupt() -> None:
                try:
                    s.interrupt(wait_seconds=2.0)
                except Exception as e:  # nothing running, or the session is gone
                    self.log.info("interrupt: %s", e)

            await loop.run_in_executor(None, interrupt)
        self.session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        s, self.sc_session = self.sc_session, None
        if s is not None:
            threading.Thread(target=s.close, daemon=True).start()
        return {"status": "ok", "restart": restart}

    # -- between cells ----------------------------------------------------------------------

    def do_is_complete(self, code: str) -> dict[str, Any]:
        return r_is_complete(code) if self.sc_language == "r" else python_is_complete(code)

    def _token(self, code: str, cursor_pos: int) -> str:
        m = re.search(r"[A-Za-z_.][A-Za-z0-9_.]*$", code[:cursor_pos])
        return m.group(0) if m else ""

    def _ask(self, what: str, *args: Any) -> Any:
        """The session's answer to ``complete`` or ``help``, or None when it cannot answer
        (no session, a cell runs, the session ended: then the next cell opens a new one)."""
        s = self.sc_session
        if s is None:
            return None
        try:
            return s.complete(*args) if what == "complete" else s.help(*args)
        except sandcell.SessionBusy:
            return None
        except (sandcell.WorkerFailed, sandcell.NoSuchSession, sandcell.SessionEnded) as e:
            self._drop_session(f"the session ended during a {what} ({e})")
            return None
        except sandcell.SandcellError as e:
            self.log.info("%s: %s", what, e)
            return None

    def do_complete(self, code: str, cursor_pos: int) -> dict[str, Any]:
        r = self._ask("complete", code, cursor_pos)
        if r is not None:
            return {"status": "ok", "matches": r.matches, "cursor_start": r.cursor_start,
                    "cursor_end": r.cursor_end, "metadata": {}}
        return self._local_complete(code, cursor_pos)

    def _local_complete(self, code: str, cursor_pos: int) -> dict[str, Any]:
        token = self._token(code, cursor_pos)
        if self.sc_language == "r":
            pool = set(R_WORDS)
            for _, c in self.sc_history:
                pool.update(re.findall(r"([A-Za-z.][A-Za-z0-9._]*)\s*(?:<-|<<-|=(?!=))", c))
        else:
            token = token.split(".")[-1] if "." in token else token
            pool = set(keyword.kwlist) | set(dir(builtins)) | _python_names(self.sc_history)
        matches = sorted(n for n in pool if token and n.startswith(token) and not n.startswith("__"))
        return {"status": "ok", "matches": matches, "cursor_start": cursor_pos - len(token),
                "cursor_end": cursor_pos, "metadata": {}}

    def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0,
                   omit_sections: Any = ()) -> dict[str, Any]:
        h = self._ask("help", code, cursor_pos, 1 if detail_level else 0)
        if h is not None:
            return {"status": "ok", "found": h.found, "data": h.data if h.found else {},
                    "metadata": {}}
        return self._local_inspect(code, cursor_pos)

    def _local_inspect(self, code: str, cursor_pos: int) -> dict[str, Any]:
        found: dict[str, Any] = {"status": "ok", "found": False, "data": {}, "metadata": {}}
        if self.sc_language != "python":
            return found
        pos = cursor_pos
        m = re.search(r"[A-Za-z_][A-Za-z0-9_]*$", code[:pos])
        tail = re.match(r"[A-Za-z0-9_]*", code[pos:])
        name = (m.group(0) if m else "") + (tail.group(0) if tail else "")
        obj = getattr(builtins, name, None)
        if not name or obj is None:
            return found
        import inspect
        import pydoc

        try:
            sig = f"{name}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            sig = name
        doc = pydoc.getdoc(obj)
        return {"status": "ok", "found": True, "metadata": {},
                "data": {"text/plain": f"Signature: {sig}\nDocstring:\n{doc}"}}

    def do_history(self, hist_access_type: str, output: bool, raw: bool, session: Any = None,
                   start: Any = None, stop: Any = None, n: Any = None, pattern: Any = None,
                   unique: bool = False, **_: Any) -> dict[str, Any]:
        items: list[tuple[int, int, Any]] = [(0, line, code) for line, code in self.sc_history]
        if hist_access_type == "tail":
            items = items[-int(n):] if n else items
        elif hist_access_type == "range":
            lo = int(start or 0)
            hi = int(stop) if stop else None
            items = [i for i in items if i[1] >= lo and (hi is None or i[1] < hi)]
        elif hist_access_type == "search":
            pat = pattern or "*"
            items = [i for i in items if fnmatch.fnmatch(i[2], pat)]
            if unique:
                seen: set[str] = set()
                items = [i for i in reversed(items)
                         if not (i[2] in seen or seen.add(i[2]))][::-1]  # type: ignore[func-returns-value]
            if n:
                items = items[-int(n):]
        else:
            items = []
        if output:
            items = [(s, line, (code, self.sc_outputs.get(line))) for s, line, code in items]
        return {"status": "ok", "history": items}

    async def comm_open_unsupported(self, stream: Any, ident: Any, parent: Any) -> None:
        content = parent.get("content") or {}
        self.session.send(self.iopub_socket, "comm_close", {
            "comm_id": content.get("comm_id", ""),
            "data": {"error": "comms (widgets) are not supported by sandcell kernels"},
        }, parent, ident=self._topic("comm_close"))

    async def comm_ignored(self, stream: Any, ident: Any, parent: Any) -> None:
        return None


def launch() -> None:
    """Runs the kernel chosen by ``SANDCELL_JUPYTER_KERNEL`` on the connection file given with
    ``-f`` (as Jupyter starts it)."""
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=SandcellKernel)
