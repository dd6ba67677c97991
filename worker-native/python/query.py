# Complete and Help, shared by both Python engines: the native worker (worker.py) and the
# Eryx engine's driver (worker-python/src/driver.py). Each program is built from this file
# followed by its own source (the launcher's embedded script, the packages' installed
# sandcell-worker.py and the driver compiled into sandcell-worker-python all concatenate
# them), so both engines answer Varlink Complete and Help with the same code. Only the
# standard library is used, under names starting with `_q_` so that nothing here shadows a
# name of the program it is prepended to.
#
# Neither is a cell: nothing is bound (no `_`), nothing is printed (sys.stdout and sys.stderr are
# a sink meanwhile) and no module is imported for it that the session had not imported
# (module names come from the import system's finders, pkgutil.iter_modules, which lists
# directories without importing). Positions are characters of the code (Jupyter's
# cursor_pos). The user's code a query may call (rlcompleter's attribute lookups: __dir__,
# __getattr__, descriptors other than properties; docstrings and signatures of user objects)
# runs through `call`, which bounds it by the request's `timeout_ms`; past it the answer is
# empty (no matches, not found).

import builtins as _q_builtins
import sys as _q_sys
import types as _q_types


def _q_clean(s):
    """`s` as text that encodes to UTF-8 (lone surrogates become backslash escapes)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _q_type_name(cls):
    """`module.Qualname` of the class `cls`, the bare name for builtins and __main__."""
    mod = getattr(cls, "__module__", None)
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "object")
    if mod in (None, "builtins", "__main__"):
        return name
    return "%s.%s" % (mod, name)


COMPLETE_MAX_MATCHES = 500
MAX_MATCH_BYTES = 256
HELP_TEXT_BYTES = 64 * 1024
HELP_SOURCE_CHARS = 32 * 1024
_IMPORT_LINE = r"\s*(?:from\s+([\w.]*)|import\s+(?:[\w.]+\s*,\s*)*([\w.]*)|from\s+([\w.]+)\s+import\s+(?:\(?\s*)?(?:\w+\s*,\s*)*(\w*))$"


def _query_module_names(prefix):
    """Importable module names starting with `prefix` (dotted: submodules of an imported
    package only)."""
    import pkgutil
    head, dot, tail = prefix.rpartition(".")
    if dot:
        pkg = _q_sys.modules.get(head)
        path = getattr(pkg, "__path__", None)
        if path is None:
            return []
        names = [m.name for m in pkgutil.iter_modules(list(path))]
        return [head + "." + n for n in names if n.startswith(tail)]
    names = set(_q_sys.builtin_module_names)
    names.update(m.name for m in pkgutil.iter_modules())
    names.update(k for k in list(_q_sys.modules) if "." not in k)
    return [n for n in names
            if n.startswith(prefix) and (prefix.startswith("_") or not n.startswith("_"))]


def query_complete(ns, code, cursor, max_items, call):
    """(matches, cursor_start, cursor_end, truncated) at character `cursor` of `code` in the
    namespace `ns`; `call(fn, *args)` runs code that may reach the user's."""
    import re
    import rlcompleter
    cursor = max(0, min(cursor, len(code)))
    line = code[:cursor].rsplit("\n", 1)[-1]
    m = re.match(_IMPORT_LINE, line)
    if m is not None and m.group(3) is not None:
        token = m.group(4)
        mod = _q_sys.modules.get(m.group(3))
        names = list(call(dir, mod)) if mod is not None else []
        names += [n.rpartition(".")[2] for n in _query_module_names(m.group(3) + "." + token)]
        found = [n for n in names if isinstance(n, str) and n.startswith(token)]
    elif m is not None:
        token = m.group(1) if m.group(1) is not None else m.group(2)
        found = _query_module_names(token)
    else:
        token = re.search(r"[\w.]*$", line).group()
        if not token or token[0].isdigit() or token[0] == ".":
            return [], cursor, cursor, False
        completer = rlcompleter.Completer(ns)
        if "." in token:
            found = call(completer.attr_matches, token)
        else:
            found = call(completer.global_matches, token)
    seen = set()
    out = []
    truncated = False
    for f in found:
        if not isinstance(f, str):
            continue
        f = f.rstrip("( :")
        if not f or f in seen:
            continue
        seen.add(f)
        if len(_q_clean(f).encode("utf-8")) > MAX_MATCH_BYTES:
            truncated = True
            continue
        out.append(_q_clean(f))
    # Private names (a leading "_" after the last dot) after public ones, each in name order.
    out.sort(key=lambda s: (s.rpartition(".")[2].startswith("_"), s))
    if len(out) > max_items:
        out, truncated = out[:max_items], True
    return out, cursor - len(token), cursor, truncated


def _query_name_at(code, cursor):
    """The dotted name at `cursor`, else the callee of the call the cursor is in, else None."""
    import re
    before, after = code[:cursor], code[cursor:]
    name = re.search(r"[\w.]*$", before).group() + re.match(r"\w*", after).group()
    name = name.strip(".")
    ident = r"[^\W\d]\w*(?:\.[^\W\d]\w*)*"
    if re.fullmatch(ident, name):
        return name
    depth = 0
    for i in range(len(before) - 1, max(-1, len(before) - 4096), -1):
        c = before[i]
        if c == ")":
            depth += 1
        elif c == "(":
            if depth == 0:
                m = re.search("(" + ident + r")\s*$", before[:i])
                return m.group(1) if m else None
            depth -= 1
    return None


def query_help(ns, code, cursor, detail, call):
    """(found, text) for the name at character `cursor` of `code` in `ns`: signature, type,
    docstring, with `detail` >= 1 also the source; `call` as for query_complete."""
    import inspect as pyinspect
    import reprlib
    import keyword
    cursor = max(0, min(cursor, len(code)))
    name = _query_name_at(code, cursor)
    if name is None or keyword.iskeyword(name.split(".")[0]):
        return False, ""
    parts = name.split(".")
    missing = object()
    obj = ns.get(parts[0], missing)
    if obj is missing:
        obj = getattr(_q_builtins, parts[0], missing)
    if obj is missing:
        obj = _q_sys.modules.get(parts[0], missing)
    for p in parts[1:]:
        if obj is missing:
            break
        obj = call(getattr, obj, p, missing)
    if obj is missing:
        return False, ""
    lines = []
    try:
        sig = call(pyinspect.signature, obj)
        lines.append("Signature: %s%s" % (name, sig))
    except (TypeError, ValueError):
        pass
    lines.append("Type:      %s" % _q_type_name(type(obj)))
    if not (callable(obj) or isinstance(obj, _q_types.ModuleType)):
        text = call(reprlib.repr, obj)
        lines.append("Value:     %s" % text)
    try:
        where = call(pyinspect.getfile, obj)
        lines.append("File:      %s" % where)
    except (TypeError, OSError):
        pass
    doc = call(pyinspect.getdoc, obj)
    lines.append("Docstring:\n%s" % (doc if isinstance(doc, str) and doc else "<no docstring>"))
    if detail >= 1:
        try:
            src = call(pyinspect.getsource, obj)
            if len(src) > HELP_SOURCE_CHARS:
                src = src[:HELP_SOURCE_CHARS] + "\n... [cut]"
            lines.append("Source:\n%s" % src)
        except (TypeError, OSError):
            pass
    text = _q_clean("\n".join(str(x) for x in lines))
    b = text.encode("utf-8")
    if len(b) > HELP_TEXT_BYTES:
        text = b[: HELP_TEXT_BYTES - 16].decode("utf-8", "ignore") + "\n... [cut]"
    return True, text
