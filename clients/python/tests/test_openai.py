"""sandcell.openai against a real sandcelld: the code_interpreter_call item and its streaming
events for an ok cell, a failing cell and a cell that draws a plot."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sandcell
from sandcell import openai as sco

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ITEM_KEYS = {"type", "id", "status", "code", "container_id", "outputs"}
EVENTS = [
    "response.output_item.added",
    "response.code_interpreter_call.in_progress",
    "response.code_interpreter_call_code.delta",
    "response.code_interpreter_call_code.done",
    "response.code_interpreter_call.interpreting",
    "response.code_interpreter_call.completed",
    "response.output_item.done",
]


def plot_cell(client) -> tuple[str, str | None, str]:
    """(language, environment, code) of a cell that draws a PNG: Python in the pydata
    environment when the daemon has it, else R (whose default device writes PNGs)."""
    try:
        envs = client.list_environments()
        names = [e["name"] if isinstance(e, dict) else str(e) for e in envs]
    except sandcell.MethodNotFound:
        names = []
    if "pydata" in names:
        code = (
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [1, 4, 9])\nplt.savefig('plot.png')\nplt.close('all')\nprint('saved')\n"
        )
        return "python", "pydata", code
    return "r", None, "plot(1:10, (1:10)^2, main = 'squares')\ncat('saved\\n')\n"


def test_item_for_an_ok_cell(client):
    item = sco.code_interpreter_call(client, "print(sum(range(10)))")
    assert set(item) == ITEM_KEYS
    assert item["type"] == "code_interpreter_call" and item["id"].startswith("ci_")
    assert item["status"] == "completed"
    assert item["code"] == "print(sum(range(10)))"
    assert item["container_id"].startswith("cntr_")
    assert item["outputs"] == [{"type": "logs", "logs": "45\n"}]
    json.dumps(item)  # plain JSON


def test_item_for_a_failing_cell(client):
    item = sco.code_interpreter_call(client, "print('before')\n1 / 0\n")
    assert item["status"] == "failed"
    logs = item["outputs"][0]["logs"]
    assert logs.startswith("before\n") and "ZeroDivisionError" in logs


def test_item_for_a_timeout_is_incomplete(client):
    item = sco.code_interpreter_call(
        client, "import time\nprint('start', flush=True)\ntime.sleep(10)\n",
        limits={"wall_time_seconds": 1},
    )
    assert item["status"] == "incomplete"
    assert "start" in item["outputs"][0]["logs"] and "wall-time" in item["outputs"][0]["logs"]


def test_item_with_a_plot(client):
    language, env, code = plot_cell(client)
    item = sco.code_interpreter_call(client, code, language=language, environment=env)
    assert item["status"] == "completed", item
    images = [o for o in item["outputs"] if o["type"] == "image"]
    assert len(images) == 1, item["outputs"]
    url = images[0]["url"]
    assert url.startswith("data:image/png;base64,")
    png = base64.b64decode(url.split(",", 1)[1])
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert item["outputs"][0] == {"type": "logs", "logs": "saved\n"}


def test_a_given_session_is_reused(client):
    with client.session("python") as s:
        a = sco.code_interpreter_call(client, "v = 21", session=s)
        b = sco.code_interpreter_call(client, "print(v * 2)", session=s)
        c = sco.code_interpreter_call(client, "print(v)", session=s.id)
    assert a["container_id"] == b["container_id"] == c["container_id"] == "cntr_" + s.id
    assert sco.session_id_of_container(a["container_id"]) == s.id
    assert b["outputs"] == [{"type": "logs", "logs": "42\n"}]
    assert a["outputs"] == [] and a["id"] != b["id"]
    # Without a session each call is a fresh, discarded container.
    x = sco.code_interpreter_call(client, "w = 1")
    y = sco.code_interpreter_call(client, "print(w)")
    assert x["container_id"] != y["container_id"] and y["status"] == "failed"


def collect(socket_path, code, **kw):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            return [e async for e in sco.code_interpreter_events(c, code, **kw)]

    return asyncio.run(main())


def check_events(events, code):
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.code_interpreter_call_code.delta"]
    assert kinds == EVENTS[:2] + [EVENTS[2]] * len(deltas) + EVENTS[3:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["output_index"] == 0 for e in events)
    added, done = events[0]["item"], events[-1]["item"]
    assert added["status"] == "in_progress" and added["code"] == "" and added["outputs"] is None
    item_id = added["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events)
    assert done["id"] == item_id and done["container_id"] == added["container_id"]
    assert "".join(d["delta"] for d in deltas) == code
    assert events[len(deltas) + 2]["code"] == code
    assert set(done) == ITEM_KEYS
    return done


def test_events_for_an_ok_cell(socket_path):
    code = "".join(f"print({i})\n" for i in range(3))
    done = check_events(collect(socket_path, code, delta_chars=9), code)
    assert done["status"] == "completed"
    assert done["outputs"] == [{"type": "logs", "logs": "0\n1\n2\n"}]


def test_events_for_a_failing_cell(socket_path):
    code = "raise ValueError('nope')\n"
    done = check_events(collect(socket_path, code, sequence_start=0), code)
    assert done["status"] == "failed"
    assert "ValueError: nope" in done["outputs"][0]["logs"]


def test_events_for_a_plot(socket_path, client):
    language, env, code = plot_cell(client)
    events = collect(socket_path, code, language=language, environment=env, output_index=2,
                     sequence_start=10)
    assert [e["sequence_number"] for e in events] == list(range(10, 10 + len(events)))
    assert all(e["output_index"] == 2 for e in events)
    done = events[-1]["item"]
    assert done["status"] == "completed"
    imgs = [o for o in done["outputs"] if o["type"] == "image"]
    assert len(imgs) == 1
    assert base64.b64decode(imgs[0]["url"].split(",", 1)[1]).startswith(PNG_MAGIC)


def test_async_item(socket_path):
    async def main():
        async with sandcell.AsyncClient(socket_path) as c:
            return await sco.code_interpreter_call(c, "print('async')")

    item = asyncio.run(main())
    assert item["status"] == "completed" and item["outputs"][0]["logs"] == "async\n"


def test_gateway_example(socket_path, tmp_path):
    example = Path(__file__).resolve().parents[3] / "examples" / "gateway"
    if not example.exists():
        pytest.skip("examples/gateway is not beside this tree")
    env = {"SANDCELL_SOCKET": socket_path, "PYTHONPATH": str(Path(sandcell.__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, str(example / "gateway.py"), str(example / "tool_call.json")],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout
    printed = json.loads(out)
    item = printed["item"]
    assert item["type"] == "code_interpreter_call" and item["status"] == "completed"
    assert printed["function_call_output"]["call_id"] == "call_example_1"
    assert "8 queens: 92 solutions" in item["outputs"][0]["logs"]
    lines = subprocess.run(
        [sys.executable, str(example / "gateway.py"), "--stream", str(example / "tool_call.json")],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert events[0]["type"] == EVENTS[0] and events[-1]["type"] == EVENTS[-1]
    assert events[-1]["item"]["outputs"] == item["outputs"]


def test_the_adapter_runs_python_in_pydata_when_served(client):
    envs = client.list_environments()
    if not any(isinstance(e, dict) and e.get("name") == "pydata" and e.get("ready") is not False
               for e in envs):
        pytest.skip("the daemon serves no ready pydata environment")
    item = sco.code_interpreter_call(client, "import pandas\nprint(pandas.DataFrame({'a': [1]}).shape)")
    assert item["status"] == "completed", item
    assert item["outputs"][0]["logs"] == "(1, 1)\n"
    # Overridable: the Eryx environment by name.
    item = sco.code_interpreter_call(client, "import pandas", environment="python")
    assert item["status"] == "failed"


def test_a_saved_figure_is_one_image_not_two(client):
    envs = client.list_environments()
    if not any(isinstance(e, dict) and e.get("name") == "pydata" and e.get("ready") is not False
               for e in envs):
        pytest.skip("the daemon serves no ready pydata environment")
    code = ("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.savefig('p.png')\n"
            "fig = plt.figure()\nplt.plot([3, 2, 1])\n")  # the second figure left open, unsaved
    item = sco.code_interpreter_call(client, code, environment="pydata")
    assert item["status"] == "completed", item
    images = [o for o in item["outputs"] if o["type"] == "image"]
    assert len(images) == 2, [o.get("url", "")[:40] for o in images]  # p.png and the open one
    with client.session(environment="pydata") as s:
        r = s.execute(code)
        names = sorted(f.name for f in r.files)
        assert names == ["p.png", f"plot-{r.cell}-001.png"], names
