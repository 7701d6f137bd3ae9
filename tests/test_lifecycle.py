"""A stage engine that dies: in-flight requests fail, /health says so, shutdown is clean."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from conftest import ServerProcess, live_processes_in_group, wait_for
from PIL import Image


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory):
    """`vllm serve --omni` with no model and no flags (the README's first command): the
    built-in default, made on first use, with the memory plan's budgets."""
    folder = tmp_path_factory.mktemp("doomed")
    srv = ServerProcess(
        [],
        folder / "server.log",
        env={"VLLM_OMNI_CACHE_DIR": str(folder / "cache")},
    )
    yield srv
    srv.stop()


def test_default_model_is_built_locally_and_served(doomed_server):
    """The demo: chat from the tiny LLM made on first use, images from the trained digits DiT."""
    models = httpx.get(doomed_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["omni-demo"]  # a short name; the path is in the log
    reply = httpx.post(
        doomed_server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ).json()
    assert reply["usage"]["completion_tokens"] >= 1
    assert isinstance(reply["choices"][0]["message"]["content"], str)  # text only by default
    images = httpx.post(
        doomed_server.url + "/v1/images/generations",
        timeout=120,
        json={"prompt": "a handwritten digit seven", "seed": 1, "num_inference_steps": 8},
    ).json()
    image = Image.open(io.BytesIO(base64.b64decode(images["data"][0]["b64_json"])))
    assert image.size == (32, 32)


def test_memory_plan_is_shown_and_holds(doomed_server):
    """The plan is logged as a table and served as JSON; it adds up, fits what was free, and
    the stage processes (proportional set size, shared pages split) stay within it."""
    plan = httpx.get(doomed_server.url + "/v1/omni/plan").json()
    assert [s["stage"] for s in plan["stages"]] == ["llm", "digits"]
    assert {s["source"] for s in plan["stages"]} == {"planned"}
    for s in plan["stages"]:
        assert s["total"] == s["weights"] + s["kv_cache"] + s["activations"] + s["runtime"]
    (cpu,) = plan["devices"]
    assert cpu["planned"] == sum(s["total"] for s in plan["stages"]) <= cpu["usable"]
    log = doomed_server.log_path.read_text()
    assert "Memory plan of pipeline 'demo'" in log and "of " in log and "usable" in log
    api = psutil.Process(doomed_server.proc.pid)
    pss = sum(p.memory_full_info().pss for p in api.children(recursive=True))
    print(f"stage processes {pss / 2**30:.3f} GiB, planned {cpu['planned'] / 2**30:.3f} GiB")
    assert 0 < pss <= cpu["planned"], (pss, plan)


def in_flight(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm_omni:requests_in_flight"))


def test_dead_engine_fails_in_flight_requests_and_health(doomed_server):
    srv = doomed_server
    assert httpx.get(srv.url + "/health").status_code == 200
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 1900,
        "ignore_eos": True,
    }
    events: list[str] = []
    status: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            status.append(resp.status_code)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    engine = next(
        p
        for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Engine")
    )
    # Frozen first, so the request cannot finish before the engine dies, however fast the
    # machine (the tiny model decodes thousands of tokens a second): it is surely in flight.
    os.kill(engine.pid, signal.SIGSTOP)
    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: in_flight(srv) >= 1, "the request reached the server")
    assert reader.is_alive(), "the request finished while its engine was frozen"
    os.kill(engine.pid, signal.SIGKILL)

    reader.join(30)
    assert not reader.is_alive(), "the in-flight request hung after its engine died"
    # No output came before the engine died, so the error is the HTTP status (a stream that
    # had started would end with an error event instead).
    assert status == [503], (status, events[-3:])

    deadline = time.monotonic() + 15
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health still says healthy"
        time.sleep(0.5)
    after = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
    assert after.status_code == 503 and "engine" in after.json()["error"]["message"], after.text

    assert srv.stop(), "processes were left behind after SIGTERM"
    assert not live_processes_in_group(srv.proc.pid)
