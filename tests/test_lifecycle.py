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
def doomed_server(tiny_qwen2, tmp_path_factory):
    log = tmp_path_factory.mktemp("doomed") / "server.log"
    srv = ServerProcess([tiny_qwen2, "--max-model-len", "2048"], log)
    yield srv
    srv.stop()


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
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    engine = next(
        p
        for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Engine")
    )
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
