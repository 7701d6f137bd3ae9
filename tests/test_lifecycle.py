"""A stage engine that dies: in-flight requests fail, /health says so, shutdown is clean."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from conftest import ServerProcess, live_processes_in_group


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory):
    """`vllm serve --omni` with no model: the built-in default, made on first use."""
    folder = tmp_path_factory.mktemp("doomed")
    srv = ServerProcess(
        # Eager mode decodes slower (~ms a step), so a 4000-token request is surely still
        # running when the engine is killed; compiled, the tiny model can finish first.
        ["--max-model-len", "4096", "--enforce-eager"],
        folder / "server.log",
        env={"VLLM_OMNI_CACHE_DIR": str(folder / "cache")},
    )
    yield srv
    srv.stop()


def test_default_model_is_built_locally_and_served(doomed_server):
    models = httpx.get(doomed_server.url + "/v1/models").json()["data"]
    assert "qwen2-tiny" in models[0]["id"] and "/cache/models/" in models[0]["id"]
    reply = httpx.post(
        doomed_server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ).json()
    assert reply["usage"]["completion_tokens"] >= 1


def test_dead_engine_fails_in_flight_requests_and_health(doomed_server):
    srv = doomed_server
    assert httpx.get(srv.url + "/health").status_code == 200
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    # Found first: on an idle machine the tiny model decodes thousands of tokens a second, so
    # the kill must follow the first token at once to land mid-request.
    engine = next(
        p
        for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Engine")
    )
    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    os.kill(engine.pid, signal.SIGKILL)

    reader.join(30)
    assert not reader.is_alive(), "the in-flight request hung after its engine died"
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert errors and errors[0]["code"] == 503, events[-3:]
    assert events[-1] == "[DONE]"

    deadline = time.monotonic() + 15
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health still says healthy"
        time.sleep(0.5)
    after = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
    assert after.status_code == 503 and "engine" in after.json()["error"]["message"]

    assert srv.stop(), "processes were left behind after SIGTERM"
    assert not live_processes_in_group(srv.proc.pid)
