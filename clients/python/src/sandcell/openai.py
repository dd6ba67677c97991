"""The OpenAI Responses API ``code_interpreter`` tool, executed by sandcell.

* :func:`code_interpreter_call` runs code and returns a ``code_interpreter_call`` output
  item (a dict, as the Responses API defines it).
* :func:`code_interpreter_events` does the same as an async iterator of the streaming events
  of that item's lifecycle, for gateways that stream.
* :func:`function_tool` is the strict function declaration for models that only know
  function calling; :func:`function_call_output` answers such a call.

The item::

    {"type": "code_interpreter_call", "id": "ci_<hex>", "status": "completed",
     "code": "print(1)", "container_id": "cntr_<session id>",
     "outputs": [{"type": "logs", "logs": "1\\n"},
                 {"type": "image", "url": "data:image/png;base64,..."}]}

Containers. Without ``session``, each call gets a fresh sandbox that is not reused (an
``auto`` container): a session is opened, the cell runs, the PNG files it made are read, and
the session is closed. With ``session`` (a :class:`sandcell.Session`, an
:class:`sandcell.AsyncSession` or a session id), the call runs in it, variables and files
persist, and ``container_id`` names it (``cntr_`` + the session id; see
:func:`session_id_of_container`).

Status mapping (sandcell cell status -> item status):

=====================================================  ==========================
``ok``                                                 ``completed``
``exited`` with exit code 0 (or none)                  ``completed``
``error`` (the code raised)                            ``failed``
``exited`` with another exit code                      ``failed``
``oom``, ``worker_crashed`` (the sandbox died)         ``failed``
``interrupted``, ``timeout``, ``fuel_exhausted``,      ``incomplete``
``memory_exhausted``, ``cancelled`` (stopped at a
limit or on request; output up to that point kept)
any other (newer) status                               ``failed``
=====================================================  ==========================

Logs are the cell's stdout and stderr interleaved in the order they arrived. When the
cell's error traceback is not already in them it is appended, and so is one bracketed line
saying why a cell that did not complete stopped, and how many bytes of output the daemon
dropped at its cap. A daemon's refusal (``CapacityExceeded``, ``LimitExceeded``, ...) is
raised as the typed exception, not turned into an item: the gateway decides whether to retry.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from .aio import AsyncClient, AsyncSession
from .client import Client, Session
from .types import CellError, CellResult, FileInfo, Limits, Output

__all__ = [
    "code_interpreter_call",
    "code_interpreter_events",
    "function_tool",
    "function_call_output",
    "item_status",
    "session_id_of_container",
    "STATUS_MAP",
    "PREFERRED_ENVIRONMENT",
    "preferred_environment",
]

#: sandcell cell status -> ``code_interpreter_call`` status (``exited`` depends on the exit
#: code: see :func:`item_status`).
STATUS_MAP = {
    "ok": "completed",
    "error": "failed",
    "exited": "completed",
    "oom": "failed",
    "worker_crashed": "failed",
    "interrupted": "incomplete",
    "timeout": "incomplete",
    "fuel_exhausted": "incomplete",
    "memory_exhausted": "incomplete",
    "cancelled": "incomplete",
}

_WHY = {
    "interrupted": "the cell was interrupted",
    "timeout": "the cell reached its wall-time limit",
    "fuel_exhausted": "the cell used up its fuel (instruction budget)",
    "memory_exhausted": "the cell reached its interpreter memory limit",
    "cancelled": "the cell was cancelled",
    "oom": "the sandbox ran out of memory and was killed; its variables are lost",
    "worker_crashed": "the sandbox crashed; its variables are lost",
}

#: Images put into an item at most, and bytes of one image at most (larger ones are left
#: out with a note in the logs).
MAX_IMAGES = 10
MAX_IMAGE_BYTES = 8 * 1024 * 1024

CONTAINER_PREFIX = "cntr_"

#: The environment a fresh sandbox of Python code uses when no ``environment`` is given:
#: ``pydata`` (native CPython with numpy, pandas, scipy, matplotlib, statsmodels: what a
#: model's code expects, and where its plots come from) when the daemon serves it and it is
#: ready, else the daemon's default for the language. Pass ``environment=`` to choose.
PREFERRED_ENVIRONMENT = "pydata"


def preferred_environment(environments: Any, language: str) -> str | None:
    """:data:`PREFERRED_ENVIRONMENT` when ``environments`` (a ``ListEnvironments`` answer)
    has it ready for ``language``, else None (the daemon's default)."""
    for env in environments or []:
        if (isinstance(env, dict) and env.get("name") == PREFERRED_ENVIRONMENT
                and env.get("language") == language and env.get("ready") is not False):
            return PREFERRED_ENVIRONMENT
    return None


_CACHE_ATTR = "_sandcell_openai_environment"


def _default_environment(client: Client, language: str) -> str | None:
    """The environment for a fresh sandbox of ``client`` (asked once per client)."""
    cached: dict[str, str | None] = getattr(client, _CACHE_ATTR, {})
    if language not in cached:
        from .errors import SandcellError

        try:
            cached[language] = preferred_environment(client.list_environments(), language)
        except SandcellError:
            cached[language] = None
        setattr(client, _CACHE_ATTR, cached)
    return cached[language]


async def _adefault_environment(client: AsyncClient, language: str) -> str | None:
    cached: dict[str, str | None] = getattr(client, _CACHE_ATTR, {})
    if language not in cached:
        from .errors import SandcellError

        try:
            cached[language] = preferred_environment(await client.list_environments(), language)
        except SandcellError:
            cached[language] = None
        setattr(client, _CACHE_ATTR, cached)
    return cached[language]


def item_status(result: CellResult) -> str:
    """The ``code_interpreter_call`` status of a cell result (see the module's table)."""
    if result.status == "exited":
        return "completed" if result.exit_code in (0, None) else "failed"
    return STATUS_MAP.get(result.status, "failed")


def session_id_of_container(container_id: str) -> str:
    """The sandcell session id inside a ``container_id`` this module made."""
    if container_id.startswith(CONTAINER_PREFIX):
        return container_id[len(CONTAINER_PREFIX) :]
    return container_id


def _logs(result: CellResult, notes: list[str]) -> str:
    logs = "".join(o.text for o in result.outputs)
    err = result.error
    if err is not None:
        text = _error_text(err)
        if text.strip() and text.strip() not in logs:
            if logs and not logs.endswith("\n"):
                logs += "\n"
            logs += text
    extra = list(notes)
    if result.status in _WHY:
        extra.append(_WHY[result.status])
    elif result.status == "exited":
        extra.append(f"the code ended the interpreter (exit code {result.exit_code})")
    for name, st in (("stdout", result.stdout_stats), ("stderr", result.stderr_stats)):
        if st.truncated:
            extra.append(f"{st.seen - st.kept} bytes of {name} were dropped (kept {st.kept})")
    for e in extra:
        if logs and not logs.endswith("\n"):
            logs += "\n"
        logs += f"[sandcell: {e}]\n"
    return logs


def _error_text(err: CellError) -> str:
    """The error as a console would show it: Python's traceback ends with "Type: message";
    R's traceback lists the calls only, so the message (and the failing call) go first."""
    tb = (err.traceback or "").rstrip("\n")
    lines = tb.split("\n")
    if tb.startswith("Traceback") or any(ln.startswith(f"{err.type}:") for ln in lines[-3:]):
        return tb + "\n"  # Python's own rendering, ending in "Type: message"
    head = f"Error in {err.call} : {err.message}" if err.call else f"{err.type}: {err.message}"
    return head + "\n" + (f"Traceback:\n{tb}\n" if tb else "")


def _pngs(result: CellResult) -> list[FileInfo]:
    return [f for f in result.files if f.kind == "file" and f.media_type == "image/png"]


def _shown(result: CellResult) -> bool:
    """Whether the cell's display bundles carry its figures (a session with rich output, in
    any engine: matplotlib's figures, R's plots): then the files are not read back."""
    return any(d.png is not None for d in result.displays)


def _new_item_id() -> str:
    return "ci_" + secrets.token_hex(24)


def _item(item_id: str, code: str, container_id: str, result: CellResult,
          images: list[bytes], notes: list[str]) -> dict[str, Any]:
    outputs: list[dict[str, Any]] = []
    logs = _logs(result, notes)
    # A session with rich output: its bundles carry the figures (in the order shown, also
    # saved as files) and the other values' text.
    shown = [d.png for d in result.displays if d.png is not None]
    if shown:
        images = shown[:MAX_IMAGES]
    texts = "".join(d.text + "\n" for d in result.displays if d.png is None and d.text)
    if texts:
        logs += texts
    if logs:
        outputs.append({"type": "logs", "logs": logs})
    for png in images:
        url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        outputs.append({"type": "image", "url": url})
    return {
        "type": "code_interpreter_call",
        "id": item_id,
        "status": item_status(result),
        "code": code,
        "container_id": container_id,
        "outputs": outputs,
    }


def _select_images(result: CellResult) -> tuple[list[FileInfo], list[str]]:
    pngs = _pngs(result)
    notes: list[str] = []
    chosen: list[FileInfo] = []
    for f in pngs:
        if f.size > MAX_IMAGE_BYTES:
            notes.append(f"image {f.name} ({f.size} bytes) is larger than {MAX_IMAGE_BYTES}")
        elif len(chosen) >= MAX_IMAGES:
            notes.append(f"image {f.name} left out (more than {MAX_IMAGES} images)")
        else:
            chosen.append(f)
    return chosen, notes


def code_interpreter_call(
    client: Client | AsyncClient,
    code: str,
    *,
    session: Session | AsyncSession | str | None = None,
    language: str = "python",
    environment: str | None = None,
    limits: Limits | dict[str, Any] | None = None,
    item_id: str | None = None,
    on_output: Callable[[Output], Any] | None = None,
) -> Any:
    """Runs ``code`` and returns the ``code_interpreter_call`` item (a dict).

    With a :class:`sandcell.Client` the call blocks and returns the dict; with an
    :class:`sandcell.AsyncClient` it returns a coroutine that returns the dict.

    Args:
        session: run in this session (a session object or id) instead of a fresh sandbox.
        language, environment, limits: as for :meth:`sandcell.Client.session` (only for a
            fresh sandbox). Without ``environment``, Python runs in ``pydata`` when the
            daemon serves it (see :data:`PREFERRED_ENVIRONMENT`).
        item_id: the item's id (default ``ci_`` + 48 random hex digits).
        on_output: called with each output frame, live.

    Raises the daemon's refusals as typed exceptions (:class:`sandcell.CapacityExceeded`, ...).
    """
    if isinstance(client, AsyncClient):
        return _acall(client, code, session, language, environment, limits, item_id, on_output)
    item_id = item_id or _new_item_id()
    own: Session | None = None
    if session is None:
        if environment is None:
            environment = _default_environment(client, language)
        own = client.session(language, environment, limits=limits)
        s = own
    elif isinstance(session, str):
        s = client.session_by_id(session)
    else:
        s = session  # type: ignore[assignment]
    try:
        result = s.execute(code, on_output)
        chosen, notes = _select_images(result)
        images = []
        if not result.session_ended and not _shown(result):
            images = [s.get_file(f.name) for f in chosen]
        return _item(item_id, code, CONTAINER_PREFIX + s.id, result, images, notes)
    finally:
        if own is not None:
            own.close()


async def _acall(client: AsyncClient, code: str, session: Any, language: str,
                 environment: str | None, limits: Any, item_id: str | None,
                 on_output: Any) -> dict[str, Any]:
    item: dict[str, Any] = {}
    async for ev in code_interpreter_events(
        client, code, session=session, language=language, environment=environment,
        limits=limits, item_id=item_id, on_output=on_output,
    ):
        if ev["type"] == "response.output_item.done":
            item = ev["item"]
    return item


def _code_deltas(code: str, chunk: int) -> list[str]:
    """The code in pieces of whole lines, each at most about ``chunk`` characters."""
    out: list[str] = []
    cur = ""
    for line in code.splitlines(keepends=True):
        if cur and len(cur) + len(line) > chunk:
            out.append(cur)
            cur = ""
        cur += line
        while len(cur) > chunk:
            out.append(cur[:chunk])
            cur = cur[chunk:]
    if cur:
        out.append(cur)
    return out


async def code_interpreter_events(
    client: AsyncClient,
    code: str,
    *,
    session: AsyncSession | str | None = None,
    language: str = "python",
    environment: str | None = None,
    limits: Limits | dict[str, Any] | None = None,
    item_id: str | None = None,
    output_index: int = 0,
    sequence_start: int = 0,
    delta_chars: int = 512,
    on_output: Callable[[Output], Any] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Runs ``code`` and yields the Responses API streaming events of its
    ``code_interpreter_call`` item, each with ``sequence_number`` (from ``sequence_start``,
    consecutive), ``output_index`` and ``item_id``:

    1. ``response.output_item.added`` (the item, ``status: "in_progress"``, empty code);
    2. ``response.code_interpreter_call.in_progress``;
    3. ``response.code_interpreter_call_code.delta`` (the code in pieces of whole lines,
       at most about ``delta_chars`` characters each), then
       ``response.code_interpreter_call_code.done`` (the whole code);
    4. ``response.code_interpreter_call.interpreting`` (the cell runs now);
    5. ``response.code_interpreter_call.completed`` when the cell has ended, whatever its
       status (the lifecycle is over; the item's status says how it ended);
    6. ``response.output_item.done`` with the final item, as :func:`code_interpreter_call`
       returns it.

    A fresh sandbox (in ``pydata`` when served and no ``environment`` is given, as for
    :func:`code_interpreter_call`) is opened before the first event, so a refusal
    (:class:`sandcell.CapacityExceeded`, ...) is raised before anything was yielded.
    ``client`` must be an :class:`sandcell.AsyncClient`.
    """
    if not isinstance(client, AsyncClient):
        raise TypeError("code_interpreter_events needs a sandcell.AsyncClient")
    item_id = item_id or _new_item_id()
    seq = sequence_start
    own: AsyncSession | None = None
    s: AsyncSession
    if session is None:
        if environment is None:
            environment = await _adefault_environment(client, language)
        own = await client.session(language, environment, limits=limits)
        s = own
    elif isinstance(session, str):
        s = client.session_by_id(session)
    else:
        s = session
    container_id = CONTAINER_PREFIX + s.id

    def ev(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        e = {"type": kind, "sequence_number": seq, "output_index": output_index}
        if "item" not in fields:
            e["item_id"] = item_id
        e.update(fields)
        seq += 1
        return e

    try:
        yield ev(
            "response.output_item.added",
            item={
                "type": "code_interpreter_call",
                "id": item_id,
                "status": "in_progress",
                "code": "",
                "container_id": container_id,
                "outputs": None,
            },
        )
        yield ev("response.code_interpreter_call.in_progress")
        for piece in _code_deltas(code, max(1, delta_chars)):
            yield ev("response.code_interpreter_call_code.delta", delta=piece)
        yield ev("response.code_interpreter_call_code.done", code=code)
        yield ev("response.code_interpreter_call.interpreting")
        result = await s.execute(code, on_output)
        chosen, notes = _select_images(result)
        images = []
        if not result.session_ended and not _shown(result):
            images = [await s.get_file(f.name) for f in chosen]
        item = _item(item_id, code, container_id, result, images, notes)
        yield ev("response.code_interpreter_call.completed")
        yield ev("response.output_item.done", item=item)
    finally:
        if own is not None:
            await asyncio.shield(own.close())


def function_tool(api: str = "responses", description: str | None = None) -> dict[str, Any]:
    """The strict function declaration of ``code_interpreter`` (one required string
    argument ``code``, no other), for models that only know function calling.

    ``api="responses"`` gives the Responses API's flat shape (``{"type": "function",
    "name": ..., "parameters": ..., "strict": true}``); ``api="chat"`` the Chat Completions
    shape (``{"type": "function", "function": {...}}``).
    """
    desc = description or (
        "Run Python code in a fresh sandbox and return its output (stdout, stderr, the "
        "traceback of an error, and PNG images it saved). Files are read from and written "
        "to /mnt/data. No network access."
    )
    fn = {
        "name": "code_interpreter",
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python code to run."}
            },
            "required": ["code"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    if api == "chat":
        return {"type": "function", "function": fn}
    if api != "responses":
        raise ValueError("api is 'responses' or 'chat'")
    return {"type": "function", **fn}


def function_call_output(call: dict[str, Any], item: dict[str, Any], *,
                         image_parts: bool = True) -> dict[str, Any]:
    """The ``function_call_output`` input item that answers a model's ``function_call``
    (``call``) of ``code_interpreter`` with the result ``item``.

    Without images (or with ``image_parts=False``), ``output`` is a JSON string with the
    status, the logs and the number of images. With images, ``output`` is a list of input
    content parts, so the model sees the plots: an ``input_text`` part holding that JSON
    string, then one ``{"type": "input_image", "image_url": "data:image/png;base64,..."}``
    part per image, in the item's order (the Responses API's function-call output content).
    """
    logs = "".join(o.get("logs", "") for o in item.get("outputs") or [] if o["type"] == "logs")
    urls = [o.get("url", "") for o in item.get("outputs") or [] if o["type"] == "image"]
    summary = json.dumps({"status": item["status"], "logs": logs, "images": len(urls)},
                         ensure_ascii=False)
    output: Any = summary
    if image_parts and urls:
        output = [{"type": "input_text", "text": summary}] + [
            {"type": "input_image", "image_url": url} for url in urls
        ]
    return {
        "type": "function_call_output",
        "call_id": call.get("call_id", ""),
        "output": output,
    }


def code_from_function_call(call: dict[str, Any]) -> str:
    """The ``code`` argument of a model's ``function_call`` item (Responses API) or
    ``tool_calls[i]`` entry (Chat Completions). Raises ``ValueError`` when it is not a call
    of ``code_interpreter`` with a string ``code``."""
    fn = call.get("function", call)
    if fn.get("name") != "code_interpreter":
        raise ValueError(f"not a code_interpreter call: {fn.get('name')!r}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        args = json.loads(args)
    code = args.get("code") if isinstance(args, dict) else None
    if not isinstance(code, str):
        raise ValueError("the call has no string argument 'code'")
    return code
