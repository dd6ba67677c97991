# sandcell's cell driver, installed in the guest interpreter as the module `_sandcell`.
#
# Trusted code, but it runs inside the sandbox next to untrusted cells: a cell can replace or
# break it, and by doing so only misreports its own session (see src/driver.rs).
#
# Each cell is run by one call of `run` (or `run_async` for sources that contain top-level
# `await`/`async`), compiled under the file name "<cell N>" so that tracebacks carry the
# cell's own line numbers. Unless the call says `display=0`, a final expression statement not
# followed by `;` is shown as in Jupyter and in the pydata engine (worker-native/python/worker.py): it is
# compiled apart in 'single' mode, so its value goes through sys.displayhook, which the driver
# sets to `_displayhook` (see there). The outcome, a JSON object, is the last thing the call sends to
# the host, on OUTCOME_STREAM (Eryx's result variable would cost a json.dumps with a fresh
# encoder on every cell). `snapshot` and `restore` store theirs as a dict in the user globals
# under RESULT, which Eryx serialises as the execution's JSON result and then removes.
#
# The worker calls `run` and `snapshot` through the builtin `__sandcell__` (see `_bind`):
# Eryx compiles the code string of every execution (a cost per syntax node), so that
# string is kept to one short call, and `_eryx_compile` spares even that compile.
import _eryx
import ast as _ast
import base64 as _base64
import binascii as _binascii
import builtins as _builtins
import gc as _gc
import importlib as _importlib
import io as _io
import json as _json
import linecache as _linecache
import marshal as _marshal
import os as _os
import pickle as _pickle
import sys as _sys
import traceback as _traceback
import types as _types

RESULT = '_eryx_sandcell_result'
MAX_MESSAGE_CHARS = 16384
MAX_FRAMES = 40
MAX_LINECACHE_CELLS = 64
MAX_NAMES = 4096
_CO_COROUTINE = 0x80
SNAPSHOT_STREAM = 7
OUTCOME_STREAM = 8
INSPECT_STREAM = 9
DISPLAY_STREAM = 11


def _encode(s):
    try:
        return s.encode('utf-8', 'surrogateescape')
    except UnicodeEncodeError:
        return s.encode('utf-8', 'backslashreplace')


class _BinaryWriter:
    """`sys.stdout.buffer`: forwards bytes to the host unchanged, after the pending text."""

    def __init__(self, text):
        self._text = text

    def write(self, b):
        b = bytes(b)
        if b:
            self._text.flush()
            _eryx._eryx_report_output(self._text._sid, b)
        return len(b)

    def flush(self):
        self._text.flush()

    def writable(self):
        return True

    def readable(self):
        return False

    def seekable(self):
        return False

    def isatty(self):
        return False

    @property
    def closed(self):
        return False


class _TextWriter:
    """`sys.stdout`/`sys.stderr`: line-buffered, sent to the host at each newline or carriage
    return (as CPython's line buffering does, so a `print(..., end='\\r')` progress line shows
    at once), at 8 KiB, on flush() and at the end of the cell; nothing is kept after that.

    Eryx's own writer accumulates the whole cell's output in guest memory; this one does not,
    so a long-running printing cell does not grow the guest. Line buffering turns a `print`
    (several writes) into one host call and one frame.
    """

    def __init__(self, sid):
        self._sid = sid
        self._pending = []
        self._size = 0
        self.buffer = _BinaryWriter(self)
        self.encoding = 'utf-8'
        self.errors = 'surrogateescape'
        self.newlines = None
        self.line_buffering = True

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError('write() argument must be str, not ' + type(s).__name__)
        if s:
            self._pending.append(s)
            self._size += len(s)
            if self._size >= 8192 or '\n' in s or '\r' in s:
                self.flush()
        return len(s)

    def flush(self):
        if self._pending:
            data = ''.join(self._pending)
            self._pending.clear()
            self._size = 0
            _eryx._eryx_report_output(self._sid, _encode(data))

    def discard(self):
        self._pending.clear()
        self._size = 0

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def writable(self):
        return True

    def readable(self):
        return False

    def seekable(self):
        return False

    def isatty(self):
        return False

    def fileno(self):
        import io
        raise io.UnsupportedOperation('fileno')

    @property
    def closed(self):
        return False


# Deep recursion overflows the WebAssembly stack (512 KiB fibres in Eryx 0.10), which aborts
# the whole worker instead of raising. Pure-Python recursion is safe to about 2000 frames here
# (measured), so requests for a higher limit (`sys.setrecursionlimit(10**6)` is common in
# generated code) are capped and deep recursion raises RecursionError instead.
MAX_RECURSION_LIMIT = 1500


def _capped_setrecursionlimit(limit, _orig=_sys.setrecursionlimit):
    """sys.setrecursionlimit, capped at MAX_RECURSION_LIMIT by the sandbox."""
    _orig(min(limit, MAX_RECURSION_LIMIT) if isinstance(limit, int) else limit)


_capped_setrecursionlimit._sandcell = True
if not getattr(_sys.setrecursionlimit, '_sandcell', False):
    _sys.setrecursionlimit = _capped_setrecursionlimit

_OUT = _TextWriter(0)
_ERR = _TextWriter(1)


def _flush_all():
    for w in (_OUT, _ERR):
        try:
            w.flush()
        except BaseException:
            w.discard()
_cells = []


def _message(e):
    try:
        m = str(e)
    except BaseException:
        m = '<exception str() failed>'
    if len(m) > MAX_MESSAGE_CHARS:
        m = m[:MAX_MESSAGE_CHARS] + '... [%d more characters]' % (len(m) - MAX_MESSAGE_CHARS)
    return m


def _type_name(e):
    t = type(e)
    mod = getattr(t, '__module__', None)
    if mod in (None, 'builtins', '__main__', 'sandcell.host'):
        return t.__qualname__
    return mod + '.' + t.__qualname__


def _describe(e, fname):
    msg = _message(e)
    kind = _type_name(e)
    frames = _traceback.extract_tb(e.__traceback__)
    start = len(frames)
    for i, f in enumerate(frames):
        if f.filename.startswith('<cell '):
            start = i
            break
    frames = frames[start:]
    line = None
    for f in reversed(frames):
        if f.filename == fname:
            line = f.lineno
            break
    if isinstance(e, SyntaxError):
        if line is None and e.filename == fname:
            line = e.lineno
        tail = ''.join(_traceback.format_exception_only(type(e), e))
    else:
        tail = kind + (': ' + msg if msg else '') + '\n'
    out = []
    if frames:
        out.append('Traceback (most recent call last):\n')
        if len(frames) > 2 * MAX_FRAMES:
            out.extend(_traceback.StackSummary.from_list(frames[:MAX_FRAMES]).format())
            out.append('  ... %d frames omitted ...\n' % (len(frames) - 2 * MAX_FRAMES))
            out.extend(_traceback.StackSummary.from_list(frames[-MAX_FRAMES:]).format())
        else:
            out.extend(_traceback.StackSummary.from_list(frames).format())
    out.append(tail)
    return {'type': kind, 'message': msg, 'traceback': ''.join(out), 'line': line}


def _outcome(e, fname):
    if isinstance(e, SystemExit):
        code = e.code
        if code is None:
            rc = 0
        elif isinstance(code, int):
            rc = max(min(int(code), 2**63 - 1), -(2**63))
        else:
            try:
                _ERR.write(str(code) + '\n')
            except BaseException:
                pass
            rc = 1
        return {'status': 'exited', 'exit_code': rc}
    status = 'memory_exhausted' if isinstance(e, MemoryError) else 'error'
    return {'status': status, 'error': _describe(e, fname)}


def _begin(src, fname, display):
    text = _binascii.a2b_base64(src).decode('utf-8')
    _linecache.cache[fname] = (len(text), None, text.splitlines(True), fname)
    _cells.append(fname)
    while len(_cells) > MAX_LINECACHE_CELLS:
        _linecache.cache.pop(_cells.pop(0), None)
    return _compile(text, fname, display)


# --- The last expression ------------------------------------------------------------------
#
# The same rules as the pydata engine (worker-native/python/worker.py): a value that is not None shows
# its repr on stdout, as the cell's output (bounded like any other); `_` is bound to it; a
# repr that raises an Exception shows `<repr failed: Type: message>` (message cut at
# MAX_REPR_FAILURE_CHARS) and the cell goes on (an interrupt or a timeout during the repr
# still ends it); a cell whose last statement ends with `;` shows nothing. The driver installs
# `_displayhook` as sys.displayhook unless the user's code replaced it with one of its own.

MAX_REPR_FAILURE_CHARS = 200


def _failure_text(e):
    """`Type: message` of exception `e`, the message cut at MAX_REPR_FAILURE_CHARS."""
    try:
        msg = str(e)
    except BaseException:
        msg = ''
    if len(msg) > MAX_REPR_FAILURE_CHARS:
        msg = msg[:MAX_REPR_FAILURE_CHARS - 3] + '...'
    return _type_name(e) + (': ' + msg if msg else '')


def _repr_failed(e):
    return '<repr failed: %s>' % _failure_text(e)


def _displayhook(value):
    """sys.displayhook of the sandbox: the default one, but a failing repr shows a
    placeholder instead of failing the cell. With rich output, the value goes out as a MIME
    bundle (kind `result`) instead."""
    if value is None:
        return
    _builtins._ = None
    if _rich:
        _send_bundle('result', value)
    else:
        try:
            text = repr(value)
        except Exception as e:
            text = _repr_failed(e)
        _sys.stdout.write(text + '\n')
    _builtins._ = value


# --- Rich output -------------------------------------------------------------------------
#
# In a cell of a session with rich output (the request's `rich=1`, the driver's mode bit 2),
# the last expression's value and `sandcell.display(...)` go to the host as MIME bundles on
# DISPLAY_STREAM: `{"kind": "result"|"display", "data": {mime: value}}`, built through the
# display protocol of IPython/Jupyter (`_repr_mimebundle_`, then `_repr_html_`,
# `_repr_markdown_`, `_repr_latex_`, `_repr_png_`, `_repr_jpeg_`, `_repr_svg_`, `_repr_json_`;
# https://ipython.readthedocs.io/en/stable/config/integrating.html). A method that raises is
# left out with a line on stderr naming it; text/plain is always the repr. The worker bounds and checks the bundle (src/output.rs).

_rich = False
_REPR_METHODS = (('text/html', '_repr_html_'), ('text/markdown', '_repr_markdown_'),
                 ('text/latex', '_repr_latex_'), ('image/png', '_repr_png_'),
                 ('image/jpeg', '_repr_jpeg_'), ('image/svg+xml', '_repr_svg_'),
                 ('application/json', '_repr_json_'))
_MIME_CHARS = frozenset('abcdefghijklmnopqrstuvwxyz0123456789.+-/')


def _binary_mime(k):
    """Whether MIME type `k` carries binary data as base64 text (every image/* but
    image/svg+xml, and application/pdf, as nbformat stores them)."""
    return (k.startswith('image/') and k != 'image/svg+xml') or k == 'application/pdf'


_BASE64_SPACE = {32: None, 9: None, 10: None, 13: None}
_BASE64_CHARS = frozenset('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/')


def _is_base64(v):
    """Whether `v` is base64 as the host checks it (RFC 4648 section 4 with `=` padding;
    space, tab, CR and LF ignored); a binary type's value that is not is left out."""
    t = v.translate(_BASE64_SPACE)
    body = t.rstrip('=')
    return (len(t) % 4 == 0 and len(t) - len(body) <= 2
            and set(body) <= _BASE64_CHARS)


def _bundle(value, md=None):
    """The MIME bundle of `value` (a dict of JSON-ready values, text/plain always). `md`, a
    dict, receives the metadata the display protocol gives beside the data (the second item
    of a `_repr_mimebundle_` or `_repr_*_` tuple); the host checks it."""
    data = {}
    if md is None:
        md = {}
    if not isinstance(value, type):
        m = getattr(value, '_repr_mimebundle_', None)
        if callable(m):
            try:
                r = m()
                if isinstance(r, tuple):
                    if len(r) > 1 and isinstance(r[1], dict):
                        md.update(r[1])
                    r = r[0]
                if isinstance(r, dict):
                    data.update(r)
            except Exception as e:
                _repr_method_failed(value, '_repr_mimebundle_', e)
        for mime, name in _REPR_METHODS:
            if mime in data:
                continue
            f = getattr(value, name, None)
            if not callable(f):
                continue
            try:
                r = f()
            except Exception as e:
                _repr_method_failed(value, name, e)
                continue
            if isinstance(r, tuple):
                if len(r) > 1 and isinstance(r[1], dict):
                    md[mime] = r[1]
                r = r[0] if r else None
            if r is not None:
                data[mime] = r
    out = {}
    for k, v in data.items():
        if (not isinstance(k, str) or not 0 < len(k) <= 128 or k.count('/') != 1
                or not set(k) <= _MIME_CHARS or len(out) >= 15):
            continue
        if k == 'application/json' or k.endswith('+json'):
            try:
                _json.dumps(v)
            except Exception:
                continue
        elif isinstance(v, (bytes, bytearray)):
            v = (_base64.b64encode(v).decode('ascii') if _binary_mime(k)
                 else bytes(v).decode('utf-8', 'replace'))
        elif not isinstance(v, str):
            continue
        elif _binary_mime(k) and not _is_base64(v):
            continue
        out[k] = v
    text = out.get('text/plain')
    if not isinstance(text, str):
        try:
            text = repr(value)
        except Exception as e:
            text = _repr_failed(e)
    out['text/plain'] = text
    return out


def _repr_method_failed(value, name, e):
    """Says on stderr that `value`'s display method `name` raised `e` and was left out of
    the bundle (IPython's formatters print the traceback the same way and go on)."""
    _sys.stderr.write('sandcell: %s.%s raised %s; left out of the display\n'
                      % (_type_name(value), name, _failure_text(e)))


def _send_bundle(kind, value, data=None, metadata=None):
    md = {}
    if data is None:
        data = _bundle(value, md)
    if isinstance(metadata, dict):
        md.update(metadata)
    _flush_all()
    msg = {'kind': kind, 'data': data}
    if md:
        try:
            _json.dumps(md, allow_nan=False)
            msg['metadata'] = md
        except Exception:
            pass
    _eryx._eryx_report_output(DISPLAY_STREAM, _encode(_json.dumps(msg, ensure_ascii=False)))


def _new_display_id():
    global _display_ids
    _display_ids += 1
    return 'sandcell-%d' % _display_ids


_display_ids = 0


class DisplayHandle:
    """What `display(..., display_id=...)` returns, as IPython's DisplayHandle: `display(obj)`
    and `update(obj)` show `obj`. sandcell's bundles carry no display id, so an update
    appears as a new display after the earlier ones instead of replacing one."""

    def __init__(self, display_id):
        self.display_id = display_id

    def __repr__(self):
        return '<DisplayHandle display_id=%r>' % (self.display_id,)

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
    _show_objects(objs, raw, metadata)
    if display_id is not None and not kwargs.get('update'):
        return DisplayHandle(_new_display_id() if display_id is True else display_id)
    return None


def _show_objects(objs, raw, metadata):
    for obj in objs:
        if _rich:
            if raw and isinstance(obj, dict):
                data = dict(obj)
                data.setdefault('text/plain', '')
                _send_bundle('display', None, {k: v for k, v in _bundle_of_raw(data).items()},
                             metadata)
            else:
                _send_bundle('display', obj, None, metadata)
        else:
            try:
                text = repr(obj)
            except Exception as e:
                text = _repr_failed(e)
            _sys.stdout.write(text + '\n')


def _bundle_of_raw(data):
    class _Raw:
        def _repr_mimebundle_(self):
            return data
    return _bundle(_Raw())


display.__module__ = 'sandcell'
DisplayHandle.__module__ = 'sandcell'


_displayhook._sandcell = True


def _install_displayhook():
    hook = _sys.displayhook
    if hook is not _displayhook and (hook is _sys.__displayhook__
                                     or getattr(hook, '_sandcell', False)):
        _sys.displayhook = _displayhook


def _ends_with_semicolon(text, node):
    lines = text.splitlines()
    if node.end_lineno is None or node.end_lineno > len(lines):
        return False
    rest = lines[node.end_lineno - 1].encode('utf-8')[node.end_col_offset:]
    return rest.decode('utf-8', 'ignore').lstrip().startswith(';')


def _compile_cell(text, fname, display, flags):
    """(code of the cell, code of its shown last expression or None)."""
    if not display:
        return compile(text, fname, 'exec', flags, True), None
    tree = compile(text, fname, 'exec', flags | _ast.PyCF_ONLY_AST, True)
    body = tree.body
    if not body or type(body[-1]) is not _ast.Expr or _ends_with_semicolon(text, body[-1]):
        return compile(tree, fname, 'exec', flags, True), None
    last = _ast.Interactive(body=[body.pop()])
    return (compile(tree, fname, 'exec', flags, True),
            compile(last, fname, 'single', flags, True))


# --- Compiled cells, by source -----------------------------------------------------------
#
# Compiling in the guest costs more than running a short cell (figures: ARCHITECTURE.md,
# "Measured figures"), and cells are often run again unchanged. A source seen a second time
# is compiled with every warning recorded; if it compiles cleanly (no warning at all, so no
# filter setting could make a later compile of it warn), its code is kept, and later runs of
# the same source reuse it under their own file name (`replace(co_filename=...)`, nested code
# objects included), raising the same `compile` audit event a compile would. A source that
# warns or fails is compiled afresh every time, so its warnings and errors show as always.

MAX_CACHED_SOURCE = 16384
MAX_CACHED_SOURCES = 64
_SEEN_ONCE = 1
_UNCACHEABLE = 2
_compiled_cells = {}  # (display, source) -> (code, code or None), _SEEN_ONCE or _UNCACHEABLE


def _refile(code, fname):
    consts = code.co_consts
    for c in consts:
        if type(c) is _types.CodeType:
            consts = tuple(_refile(x, fname) if type(x) is _types.CodeType else x
                           for x in consts)
            return code.replace(co_filename=fname, co_consts=consts)
    return code.replace(co_filename=fname)


def _compile(text, fname, display):
    """(code of the cell, code of its shown last expression or None); see _compile_cell."""
    flags = _ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    if len(text) > MAX_CACHED_SOURCE:
        return _compile_cell(text, fname, display, flags)
    key = (display, text)
    known = _compiled_cells.get(key)
    if type(known) is tuple:
        _sys.audit('compile', text, fname)
        return tuple(None if c is None else _refile(c, fname) for c in known)
    if known is None:
        if len(_compiled_cells) >= MAX_CACHED_SOURCES:
            del _compiled_cells[next(iter(_compiled_cells))]
        _compiled_cells[key] = _SEEN_ONCE
    elif known == _SEEN_ONCE:
        import warnings
        code = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                code = _compile_cell(text, fname, display, flags)
        except BaseException:
            caught = True
        if code is not None and not caught:
            _compiled_cells[key] = code
            return code
        _compiled_cells[key] = _UNCACHEABLE
    return _compile_cell(text, fname, display, flags)


_OK = {'status': 'ok'}
_OK_JSON = b'{"status": "ok"}'
_OK_UNCHANGED_JSON = b'{"status": "ok", "unchanged": true}'


def _report(g, res):
    """Sends the outcome, saying whether the namespace is provably as last snapshotted."""
    unchanged = _saved_refs is not None and _unchanged(g)
    if res is _OK:
        data = _OK_UNCHANGED_JSON if unchanged else _OK_JSON
    else:
        if unchanged:
            res = dict(res, unchanged=True)
        data = _json.dumps(res).encode()
    _eryx._eryx_report_output(OUTCOME_STREAM, data)


def run(src, g, cell, display=1):
    """Runs one cell without top-level await; the outcome goes to the host (`_report`).
    `display`: bit 1, the last expression is shown; bit 2, rich output."""
    global _rich
    _rich = bool(display & 2)
    fname = '<cell %d>' % cell
    saved = _sys.stdout, _sys.stderr
    _sys.stdout, _sys.stderr = _OUT, _ERR
    res = None
    try:
        code, shown = _begin(src, fname, display & 1)
        if (code.co_flags | (shown.co_flags if shown else 0)) & _CO_COROUTINE:
            res = {'status': 'error', 'error': {
                'type': 'RuntimeError', 'message': 'top-level await reached the sync driver',
                'traceback': None, 'line': None}}
        else:
            exec(code, g)
            if shown is not None:
                _install_displayhook()
                exec(shown, g)
            res = _OK
    except BaseException as e:
        res = _outcome(e, fname)
    finally:
        _flush_all()
        _sys.stdout, _sys.stderr = saved
    _report(g, res)


def _run_here(src=None, cell=None, display=1):
    """`run` in the namespace of the calling code (the worker's one-line cell call); without
    arguments, of the call `_eryx_compile` just took apart."""
    global _pending
    if src is None:
        if _pending is None:
            raise TypeError('__sandcell__() missing required arguments')
        (src, cell, display), _pending = _pending, None
    run(src, _sys._getframe(1).f_globals, cell, display)


async def run_async(src, g, cell, display=1):
    """Runs one cell that may use top-level await; the outcome goes to the host (`_report`).
    `display`: bit 1, the last expression is shown; bit 2, rich output."""
    global _rich
    _rich = bool(display & 2)
    fname = '<cell %d>' % cell
    saved = _sys.stdout, _sys.stderr
    _sys.stdout, _sys.stderr = _OUT, _ERR
    res = None
    try:
        code, shown = _begin(src, fname, display & 1)
        if shown is not None:
            _install_displayhook()
        for c in (code, shown):
            if c is None:
                pass
            elif c.co_flags & _CO_COROUTINE:
                await _types.FunctionType(c, g)()
            else:
                exec(c, g)
        res = _OK
    except BaseException as e:
        res = _outcome(e, fname)
    finally:
        _flush_all()
        _sys.stdout, _sys.stderr = saved
    _report(g, res)


# --- State snapshots -------------------------------------------------------------------
#
# Eryx's own snapshot_state() dill-pickles every global twice with dill's pure-Python pickler
# (figures: docs/internals/figures.md). This one uses the C
# pickler for everything it can, and only handles what lives in the cell namespace itself:
# functions (code marshalled, globals rebound to the namespace on load) and classes (dill,
# methods rebound on load). Module bindings are recorded by name and re-imported.

_target = None  # the namespace a restore is loading into


def _rebind(f, g):
    n = _types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
    n.__kwdefaults__ = f.__kwdefaults__
    n.__qualname__ = f.__qualname__
    n.__doc__ = f.__doc__
    n.__dict__.update(f.__dict__)
    try:
        n.__annotations__ = f.__annotations__
    except Exception:
        pass
    return n


def _make_function(code, name, qualname, defaults, kwdefaults, closure, attrs):
    f = _types.FunctionType(_marshal.loads(code), _target if _target is not None else {},
                            name, defaults, closure)
    f.__qualname__ = qualname
    f.__kwdefaults__ = kwdefaults
    f.__dict__.update(attrs)
    return f


def _make_class(blob):
    import dill
    cls = dill.loads(blob)
    if _target is not None:
        for k, v in list(vars(cls).items()):
            if isinstance(v, _types.FunctionType):
                setattr(cls, k, _rebind(v, _target))
    return cls


def _make_cell(*contents):
    return _types.CellType(*contents)


class _Pickler(_pickle.Pickler):
    def reducer_override(self, obj):
        t = type(obj)
        if t is _types.FunctionType and getattr(obj, '__module__', None) == '__main__':
            return (_make_function, (_marshal.dumps(obj.__code__), obj.__name__, obj.__qualname__,
                                     obj.__defaults__, obj.__kwdefaults__, obj.__closure__,
                                     dict(obj.__dict__)))
        if t is _types.CellType:
            try:
                return (_make_cell, (obj.cell_contents,))
            except ValueError:
                return (_make_cell, ())
        if isinstance(obj, type) and getattr(obj, '__module__', None) == '__main__':
            import dill
            return (_make_class, (dill.dumps(obj, recurse=True),))
        return NotImplemented


def _dumps(value):
    buf = _io.BytesIO()
    _Pickler(buf, protocol=5).dump(value)
    return buf.getvalue()


# Eryx's callback infrastructure in the namespace: re-created by Eryx, never snapshotted.
_INFRA = frozenset(('invoke', 'list_callbacks', '_EryxNamespace', '_EryxCallbackLeaf'))


def _user_items(g):
    for k, v in list(g.items()):
        if k.startswith('__') or k.startswith('_eryx_') or k in _INFRA:
            continue
        yield k, v


# The C pickler recurses once per nesting level, and deep recursion aborts the worker (see
# MAX_RECURSION_LIMIT): measured, 800 nested lists or 500 linked objects pickle, 600 linked
# objects (1200 object hops) do not. Values nested deeper than this many hops are left out of
# the snapshot and named instead.
MAX_PICKLE_DEPTH = 800
_NO_FOLLOW = (type, _types.ModuleType, _types.FunctionType, _types.BuiltinFunctionType,
              _types.MethodType, _types.CodeType, _types.FrameType, _types.GeneratorType)


def _depth_ok(root, limit=MAX_PICKLE_DEPTH):
    """Whether root's object graph (containers and instances) is at most `limit` deep.

    Iterative; only GC-tracked referents are followed, so flat data costs C-speed scans."""
    if not _gc.is_tracked(root):
        return True
    stack = [(root, 1)]
    seen = set()
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        i = id(o)
        if i in seen or isinstance(o, _NO_FOLLOW):
            continue
        seen.add(i)
        for r in filter(_gc.is_tracked, _gc.get_referents(o)):
            stack.append((r, d + 1))
    return True


# Whether a snapshot can be skipped. After a snapshot whose values are all immutable (numbers,
# strings, bytes, None, and tuples/frozensets of those, exact types only) and module bindings,
# `_saved_refs` holds those objects by name (holding them keeps their ids from being reused);
# a cell after which every name is bound to the very same object, and every module still has
# its name, left the namespace exactly as snapshotted, and `run` says so (`unchanged`), so the
# worker keeps the snapshot it has instead of taking the same one again. Any mutable value
# (list, dict, function, class, instance) turns this off until the next snapshot.
_saved_refs = None
_saved_modules = {}
_ATOMIC = frozenset((int, float, complex, str, bytes, bool, type(None)))
_MAX_IMMUTABLE_ITEMS = 64


def _immutable(v, depth=0):
    t = type(v)
    if t in _ATOMIC:
        return True
    if (t is tuple or t is frozenset) and depth < 3 and len(v) <= _MAX_IMMUTABLE_ITEMS:
        for x in v:
            if not _immutable(x, depth + 1):
                return False
        return True
    return False


def _unchanged(g):
    refs = _saved_refs
    n = 0
    try:
        for k, v in g.items():
            if k.startswith('__') or k.startswith('_eryx_') or k in _INFRA:
                continue
            if refs.get(k, refs) is not v:
                return False
            if k in _saved_modules and v.__name__ != _saved_modules[k]:
                return False
            n += 1
    except BaseException:
        return False
    return n == len(refs)


def snapshot(g):
    """Pickles the namespace and streams it to the host on SNAPSHOT_STREAM."""
    global _saved_refs, _saved_modules
    _saved_refs = None
    modules = {}
    values = {}
    skipped = []
    refs = {}
    for k, v in _user_items(g):
        if isinstance(v, _types.ModuleType):
            modules[k] = v.__name__
        elif _depth_ok(v):
            values[k] = v
        else:
            skipped.append(k + ' (nested too deeply)')
        if refs is not None:
            if k in modules or _immutable(v):
                refs[k] = v
            else:
                refs = None
    try:
        blob = _dumps(values)
    except BaseException:
        good = {}
        for k, v in values.items():
            try:
                _dumps(v)
                good[k] = v
            except BaseException:
                skipped.append(k + ' (not picklable)')
        blob = _dumps(good)
    _eryx._eryx_report_output(SNAPSHOT_STREAM, blob)
    g[RESULT] = {'status': 'ok', 'modules': modules, 'names': list(values)[:MAX_NAMES],
                 'missing': skipped[:MAX_NAMES]}
    if refs is not None and not skipped:
        _saved_refs, _saved_modules = refs, modules


# --- Inspect ---------------------------------------------------------------------------
#
# `inspect` lists the user's variables for the host (Varlink Inspect) without running a cell:
# no `_`, no output (sys.stdout/sys.stderr are a sink meanwhile), no new name. It sends, on
# INSPECT_STREAM, first the names and types of the variables it lists ({"names": [[name,
# type], ...], "truncated": bool}), then one {"i": index, "size_bytes", "shape", "repr"} per
# variable as it computes them, so that the host still has the names when the user's code
# (repr, __sizeof__, memory_usage) outlives the execution's time limit. That code gets
# `budget_ms` in all: a trace function ends Python-level loops past it and `time.sleep` is
# bounded by it while the user's code runs (`<repr timed out>`, then `<repr skipped: ...>`
# for the rest); code stuck in C or in a sleep bound before the listing began runs into the
# host's time limit instead (see src/session.rs, `PySession::inspect`).

MAX_REPR_CHARS = 200
MAX_VARIABLE_NAME = 256
MAX_VARIABLE_TYPE = 256
MAX_SHAPE_DIMS = 64


class _BudgetUsedUp(BaseException):
    pass


class _Sink:
    encoding = 'utf-8'

    def write(self, s):
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False


def _short(text):
    if len(text) > MAX_REPR_CHARS:
        text = text[:MAX_REPR_CHARS - 3] + '...'
    return text


def _user_call(deadline, fn, *args, **kwargs):
    import time
    if time.monotonic() >= deadline:
        raise _BudgetUsedUp
    mono = time.monotonic
    real_sleep = time.sleep

    def tracer(frame, event, arg):
        if mono() >= deadline:
            raise _BudgetUsedUp
        return tracer

    def bounded_sleep(secs):
        left = deadline - mono()
        if secs >= left:
            real_sleep(max(left, 0))
            raise _BudgetUsedUp
        real_sleep(secs)

    time.sleep = bounded_sleep
    _sys.settrace(tracer)
    try:
        return fn(*args, **kwargs)
    finally:
        _sys.settrace(None)
        time.sleep = real_sleep


def inspect(g, max_items, budget_ms):
    """Sends the listing of g's variables on INSPECT_STREAM (see above)."""
    import reprlib
    import time
    deadline = time.monotonic() + budget_ms / 1000.0
    names = []
    truncated = False
    for k, v in list(g.items()):
        if (type(k) is not str or not k or k.startswith('_') or k in _INFRA
                or isinstance(v, _types.ModuleType)):
            continue
        if len(_encode(k)) > MAX_VARIABLE_NAME:
            truncated = True
            continue
        names.append(k)
    names.sort()
    if len(names) > max_items:
        names, truncated = names[:max_items], True
    listed = []
    for k in names:
        try:
            kind = _type_name(g[k])
        except BaseException:
            kind = '?'
        if len(_encode(kind)) > MAX_VARIABLE_TYPE:
            kind = kind[:MAX_VARIABLE_TYPE // 4]
        listed.append([_encode(k).decode('utf-8', 'replace'), _encode(kind).decode('utf-8', 'replace')])
    _eryx._eryx_report_output(INSPECT_STREAM, _json.dumps(
        {'names': listed, 'truncated': truncated}).encode())
    class BoundedRepr(reprlib.Repr):
        # reprlib hides a repr that raises (`<X instance at 0x...>`); this one does not.
        def repr_instance(self, x, level):
            s = _builtins.repr(x)
            if len(s) > self.maxother:
                s = s[:self.maxother - 3] + '...'
            return s

    r = BoundedRepr()
    r.maxstring = r.maxother = r.maxlong = MAX_REPR_CHARS
    saved = _sys.stdout, _sys.stderr
    _sys.stdout = _sys.stderr = _Sink()
    used_up = False
    try:
        for i, k in enumerate(names):
            item = {'i': i}
            if used_up:
                item['repr'] = '<repr skipped: time budget used up>'
            else:
                try:
                    value = g[k]
                    item.update(_measure(deadline, value))
                    text = _user_call(deadline, r.repr, value)
                    if not isinstance(text, str):
                        text = '<repr failed: not a str>'
                    item['repr'] = _short(_encode(text).decode('utf-8', 'replace'))
                except _BudgetUsedUp:
                    used_up = True
                    item['repr'] = '<repr timed out>'
                except BaseException as e:
                    try:
                        item['repr'] = _short('<repr failed: %s>' % _type_name(e))
                    except BaseException:
                        item['repr'] = '<repr failed>'
            _eryx._eryx_report_output(INSPECT_STREAM, _json.dumps(item).encode())
    finally:
        _sys.stdout, _sys.stderr = saved


def _measure(deadline, value):
    """size_bytes and shape of value (numpy/pandas by their own figures, else getsizeof)."""
    out = {}
    np = _sys.modules.get('numpy')
    pd = _sys.modules.get('pandas')
    try:
        if np is not None and isinstance(value, np.ndarray):
            out['size_bytes'] = int(value.nbytes)
            out['shape'] = [int(d) for d in value.shape][:MAX_SHAPE_DIMS]
        elif pd is not None and isinstance(value, (pd.DataFrame, pd.Series)):
            mem = _user_call(deadline, value.memory_usage, deep=False)
            out['size_bytes'] = int(mem if isinstance(mem, int) else mem.sum())
            out['shape'] = [int(d) for d in value.shape]
        else:
            out['size_bytes'] = int(_user_call(deadline, _sys.getsizeof, value))
    except _BudgetUsedUp:
        raise
    except BaseException:
        pass
    if out.get('size_bytes', 0) < 0:
        del out['size_bytes']
    return out


def _inspect_here(max_items, budget_ms):
    """`inspect` of the namespace of the calling code (the worker's one-line call)."""
    inspect(_sys._getframe(1).f_globals, max_items, budget_ms)


# --- Complete and Help: `query_complete` and `query_help` are the shared module query.py of the
# native worker, which src/driver.rs puts before this source.

QUERY_STREAM = 12


def _query_here(op, code_b64, cursor, arg, budget_ms):
    """`complete` (arg: max_items) or `help` (arg: detail) in the namespace of the calling code
    (the worker's one-line call); sends the answer's JSON on QUERY_STREAM."""
    import time
    g = _sys._getframe(1).f_globals
    deadline = time.monotonic() + budget_ms / 1000.0

    def call(fn, *args):
        return _user_call(deadline, fn, *args)

    try:
        code = _base64.b64decode(code_b64).decode('utf-8')
    except (ValueError, UnicodeDecodeError):
        code = ''
    saved = _sys.stdout, _sys.stderr
    _sys.stdout = _sys.stderr = _Sink()
    try:
        if op == 'complete':
            try:
                matches, start, end, truncated = query_complete(g, code, cursor, arg, call)
            except BaseException:
                c = max(0, min(cursor, len(code)))
                matches, start, end, truncated = [], c, c, False
            out = {'matches': matches, 'cursor_start': start, 'cursor_end': end,
                   'truncated': truncated}
        else:
            try:
                found, text = query_help(g, code, cursor, arg, call)
            except BaseException:
                found, text = False, ''
            out = {'found': found, 'data': {'text/plain': text}}
    finally:
        _sys.stdout, _sys.stderr = saved
    _eryx._eryx_report_output(QUERY_STREAM, _json.dumps(out).encode())


def _snapshot_here():
    """`snapshot` of the namespace of the calling code (the worker's one-line call)."""
    snapshot(_sys._getframe(1).f_globals)


# --- Eryx's compile of the worker's calls ------------------------------------------------
#
# Eryx 0.10.1 runs every execution through `_eryx_exec` in its `__main__` module, which
# compiles the code string with the name `compile`, looked up in that module before builtins.
# `_bind` puts `_eryx_compile` there (not in builtins: user code calling `compile` gets the
# real one). It recognises exactly the two lines the worker sends per cell
# (`__sandcell__('<base64>',N)` or `...,N,0)` without display, and the snapshot call) and
# returns code compiled once instead (`__sandcell__()`, which picks up the arguments from
# `_pending`); anything else, and any other arguments, go to the real compile. If a
# cell removes it, or Eryx stops looking it up there, the same lines are compiled as before
# and behave the same.

_real_compile = compile
_PREFIX = "__sandcell__('"
_SNAPSHOT_LINE = '__sandcell__.snapshot()\n'
_pending = None
_compiled = None  # (code of "__sandcell__()", code of _SNAPSHOT_LINE)


def _eryx_compile(source, filename, mode, flags=0, dont_inherit=False, optimize=-1, **kw):
    global _pending
    if (type(source) is str and filename == '<user>' and mode == 'exec'
            and flags == _ast.PyCF_ALLOW_TOP_LEVEL_AWAIT and not dont_inherit
            and optimize == -1 and not kw and _compiled is not None):
        if source.startswith(_PREFIX) and source.endswith(')\n'):
            j = source.find("',", 14)
            cell, comma, display = source[j + 2:-2].partition(',')
            if (j > 0 and cell.isascii() and cell.isdigit() and display in ('', '0', '2', '3')
                    and (display or not comma) and "'" not in source[14:j]):
                _pending = (source[14:j], int(cell), int(display) if display else 1)
                return _compiled[0]
        elif source == _SNAPSHOT_LINE:
            return _compiled[1]
    return _real_compile(source, filename, mode, flags, dont_inherit, optimize, **kw)


# --- Host calls --------------------------------------------------------------------------
#
# `from sandcell import host; host.call(name, {...})` calls a tool of the client and returns its
# result (src/host.rs). The request goes to the host-call file, which is not a file: the worker
# makes the call on the first read after a request and answers with one JSON object, `result`,
# `error` (the tool's, or the daemon's timeout), `raise` + `error` (refused by the worker before
# any line: not enabled, bad name or arguments) or `interrupted` (SIGINT while it waited). The
# checks here only give early, precise errors: the worker repeats every one of them.

HOST_FILE = '/tmp/.sandcell-host'
MAX_HOST_CALL_NAME = 128
MAX_HOST_CALL_ARGUMENTS = 256 * 1024
_HOST_NAME_CHARS = frozenset('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-')


class HostCallError(Exception):
    """A host call failed: the client's tool reported an error, it did not answer in time, or
    host calls are not enabled for this session."""


def host_call(name, arguments=None):
    """Calls the client's tool `name` with `arguments` (a dict) and returns its result (a
    dict); raises HostCallError with the tool's error."""
    if arguments is None:
        arguments = {}
    if (not isinstance(name, str) or not 0 < len(name) <= MAX_HOST_CALL_NAME
            or not set(name) <= _HOST_NAME_CHARS):
        raise ValueError("a host call's name is 1 to %d characters of [A-Za-z0-9_.-]"
                         % MAX_HOST_CALL_NAME)
    if not isinstance(arguments, dict):
        raise TypeError("a host call's arguments are a dict, not %s" % type(arguments).__name__)
    args = _json.dumps(arguments, ensure_ascii=False, separators=(',', ':'), allow_nan=False)
    if len(args.encode('utf-8')) > MAX_HOST_CALL_ARGUMENTS:
        raise ValueError("a host call's arguments are at most %d bytes of JSON"
                         % MAX_HOST_CALL_ARGUMENTS)
    data = ('{"name":%s,"arguments":%s}' % (_json.dumps(name), args)).encode('utf-8')
    _flush_all()
    fd = _os.open(HOST_FILE, _os.O_RDWR)
    try:
        view = memoryview(data)
        off = 0
        while off < len(data):
            off += _os.pwrite(fd, view[off:], off)
        parts = []
        off = 0
        while True:
            chunk = _os.pread(fd, 1 << 16, off)
            if not chunk:
                break
            parts.append(chunk)
            off += len(chunk)
    finally:
        _os.close(fd)
    answer = _json.loads(b''.join(parts))
    if 'result' in answer:
        return answer['result']
    if answer.get('interrupted'):
        raise KeyboardInterrupt
    kind = {'ValueError': ValueError, 'TypeError': TypeError}.get(answer.get('raise'),
                                                                  HostCallError)
    raise kind(str(answer.get('error', 'the host call failed')))


HostCallError.__module__ = 'sandcell.host'
host_call.__module__ = 'sandcell.host'
host_call.__qualname__ = host_call.__name__ = 'call'


class InstallError(Exception):
    """sandcell.install refused a package or could not install it (the native worker's name)."""


def install(*requirements, deps=True):
    """Per-session packages are not served in this engine: always raises InstallError."""
    raise InstallError(
        'sandcell.install is not available in the Eryx engine: its interpreter sees only its '
        'own file system and takes no package source; per-session packages are served only by '
        'native engines such as pydata (sandcell.install) and r (install.packages), from a '
        'wheelhouse or CRAN-style repository the operator names in sandcelld.toml')


def _install_host_module():
    """`sandcell.host` for the cells (kept when this driver installed it already, so
    `HostCallError` stays one class for the whole instance)."""
    if getattr(_sys.modules.get('sandcell.host'), 'call', None) is host_call:
        return
    pkg = _types.ModuleType('sandcell')
    mod = _types.ModuleType('sandcell.host')
    mod.call = host_call
    mod.HostCallError = HostCallError
    mod.__all__ = ['call', 'HostCallError']
    pkg.host = mod
    pkg.display = display
    pkg.DisplayHandle = DisplayHandle
    pkg.install = install
    pkg.InstallError = InstallError
    pkg.__path__ = []
    _sys.modules['sandcell'] = pkg
    _sys.modules['sandcell.host'] = mod
    # `display(...)` without an import, as in IPython; a cell's own `display` shadows it.
    # One an earlier instance of this driver left (its module's rich-output flag is never
    # set again) is replaced; one the user's code put there is kept.
    cur = getattr(_builtins, 'display', None)
    if cur is None or getattr(cur, '__module__', None) == 'sandcell':
        _builtins.display = display


def _bind():
    """Makes the worker's entry points reachable from its one-line calls as the builtin
    `__sandcell__` (`__sandcell__(src, cell)` runs a cell, `__sandcell__.snapshot()` takes a
    snapshot) without binding a name in the user namespace, and installs `_eryx_compile`."""
    global _compiled
    _install_host_module()
    _run_here.snapshot = _snapshot_here
    _run_here.inspect = _inspect_here
    _run_here.query = _query_here
    _builtins.__sandcell__ = _run_here
    flags = _ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    _compiled = (_real_compile('__sandcell__()\n', '<user>', 'exec', flags),
                 _real_compile(_SNAPSHOT_LINE, '<user>', 'exec', flags))
    main = _sys.modules.get('__main__')
    if main is not None and callable(getattr(main, '_eryx_exec', None)):
        main.compile = _eryx_compile


def clean(g):
    """Removes the module bindings Eryx's pre-initialisation leaves in a fresh namespace
    (`json`, `re`, ...): a session starts empty, as CPython's `__main__` does. The modules stay
    imported, so `import json` costs a dictionary lookup."""
    for k, v in list(_user_items(g)):
        if isinstance(v, _types.ModuleType):
            del g[k]


def restore(g, blob_b64, modules):
    """Loads a snapshot into g, re-imports modules; result `missing` lists what did not load."""
    global _target
    _target = g
    missing = []
    try:
        values = _pickle.loads(_base64.b64decode(blob_b64))
    finally:
        _target = None
    g.update(values)
    for k, m in modules.items():
        try:
            g[k] = _importlib.import_module(m)
        except BaseException:
            missing.append(k)
    g[RESULT] = {'status': 'ok', 'missing': missing}
