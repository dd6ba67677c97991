#!/usr/bin/env python3
"""A gateway's tool loop, without a network: read a model's response (or one tool call) as
JSON from a file, run every ``code_interpreter`` call in sandcell, and print for each the
``code_interpreter_call`` item and the ``function_call_output`` to send back to the model.

    python3 examples/gateway/gateway.py examples/gateway/tool_call.json

Accepted input: a Responses API response (``{"output": [...]}``), a list of output items, a
single ``function_call`` item, or a Chat Completions message with ``tool_calls``. The daemon
is at ``$SANDCELL_SOCKET`` or ``/run/sandcell/org.sandcell.Kernel``. A real gateway declares
``sandcell.openai.function_tool()`` in its request and loops until the model stops calling.
"""

import json
import sys

import sandcell
from sandcell import openai as sco


def tool_calls(doc):
    """The code_interpreter calls in a model's output, in order."""
    if isinstance(doc, dict) and "output" in doc:
        doc = doc["output"]
    elif isinstance(doc, dict) and "tool_calls" in doc:
        doc = doc["tool_calls"]
    items = doc if isinstance(doc, list) else [doc]
    for it in items:
        fn = it.get("function", it)
        if it.get("type") in ("function_call", "function") and fn.get("name") == "code_interpreter":
            yield it


def main(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    with sandcell.Client() as client:
        for call in tool_calls(doc):
            code = sco.code_from_function_call(call)
            item = sco.code_interpreter_call(client, code)  # a fresh sandbox per call
            reply = sco.function_call_output({"call_id": call.get("call_id", call.get("id"))}, item)
            print(json.dumps({"item": item, "function_call_output": reply}, indent=2,
                             ensure_ascii=False))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gateway.py TOOL_CALL.json")
    main(sys.argv[1])
