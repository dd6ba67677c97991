#!/usr/bin/env python3
"""A gateway's tool loop, without a network: read a model's response (or one tool call) as
JSON from a file, run every ``code_interpreter`` call in sandcell, and print for each the
``code_interpreter_call`` item and the ``function_call_output`` to send back to the model.

    python3 examples/gateway/gateway.py examples/gateway/tool_call.json
    python3 examples/gateway/gateway.py --stream examples/gateway/tool_call.json

With ``--stream`` it prints the Responses API streaming events of each call instead, one JSON
object per line, as a streaming gateway would forward them (server-sent events).

Accepted input: a Responses API response (``{"output": [...]}``), a list of output items, a
single ``function_call`` item, or a Chat Completions message with ``tool_calls``. The daemon
is at ``$SANDCELL_SOCKET`` or ``/run/sandcell/org.sandcell.Kernel``. A real gateway declares
``sandcell.openai.function_tool()`` in its request and loops until the model stops calling.
"""

import asyncio
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


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(path):
    doc = load(path)
    with sandcell.Client() as client:
        for call in tool_calls(doc):
            code = sco.code_from_function_call(call)
            item = sco.code_interpreter_call(client, code)  # a fresh sandbox per call
            reply = sco.function_call_output({"call_id": call.get("call_id", call.get("id"))}, item)
            print(json.dumps({"item": item, "function_call_output": reply}, indent=2,
                             ensure_ascii=False))


async def stream(path):
    doc = load(path)
    seq = 0
    async with sandcell.AsyncClient() as client:
        for index, call in enumerate(tool_calls(doc)):
            code = sco.code_from_function_call(call)
            async for event in sco.code_interpreter_events(
                client, code, output_index=index, sequence_start=seq
            ):
                print(json.dumps(event, ensure_ascii=False), flush=True)
                seq = event["sequence_number"] + 1


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--stream"] and len(args) == 2:
        asyncio.run(stream(args[1]))
    elif len(args) == 1:
        main(args[0])
    else:
        sys.exit("usage: gateway.py [--stream] TOOL_CALL.json")
