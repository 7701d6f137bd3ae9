"""Stage supervision: an engine that dies, or hangs, is restarted; its requests in flight
fail naming the stage, /health is 503 until it serves again, and later requests succeed."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest
from conftest import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HANG_TIMEOUT = 3
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def supervised(tiny_qwen2, tmp_path_factory):
    srv = ServerProcess([tiny_qwen2, "--stage-restarts", "2",
                         "--stage-hang-timeout", str(HANG_TIMEOUT)],
                        tmp_path_factory.mktemp("supervised") / "server.log")
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def engine_cores(srv) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if p.name().startswith("VLLM::EngineCore")]


def wait_health(srv, status: int, seconds: float) -> float:
    """Seconds until /health answers `status`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if httpx.get(srv.url + "/health", timeout=5).status_code == status:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health did not answer {status} within {seconds} s:\n"
                         + srv.log_path.read_text()[-3000:])


def stream_until_fault(srv, fault) -> list[dict]:
    """A long streamed chat; `fault()` at its first event (sent once the engine's first output
    is in, the earliest moment the request is surely in flight). Every event it got."""
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                fault()
    return events


def stream_error(srv, events: list[dict]) -> dict:
    """The error event a stream ended with (the stage's engine was made to fail)."""
    assert events and "error" in events[-1], (
        f"the stream ended without an error after {len(events)} events; the last: {events[-3:]}\n"
        + srv.log_path.read_text()[-3000:])
    return events[-1]["error"]


def check_recovered(srv, old: list[psutil.Process]) -> None:
    wait_health(srv, 503, 30)
    wait_health(srv, 200, 240)
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in old)
    assert len(engine_cores(srv)) == 1
    # The new engine found the first one's compiled model in vLLM's cache (vLLM's AOT
    # artifacts, which vllm-omni turns off on CPU, cannot be loaded back there).
    assert "load failure" not in srv.log_path.read_text()


def test_a_dead_engine_is_restarted(supervised):
    (core,) = engine_cores(supervised)
    events = stream_until_fault(supervised, lambda: os.kill(core.pid, signal.SIGKILL))
    error = stream_error(supervised, events)
    assert error["code"] == 503 and "stage 'llm'" in error["message"]
    check_recovered(supervised, [core])


def test_a_hung_engine_is_detected_and_restarted(supervised):
    wait_health(supervised, 200, 240)
    (core,) = engine_cores(supervised)
    start = time.monotonic()
    events = stream_until_fault(supervised, lambda: os.kill(core.pid, signal.SIGSTOP))
    error = stream_error(supervised, events)
    # Found by the watchdog (not answering for HANG_TIMEOUT), then killed: the stream ends.
    assert error["code"] == 503 and "stage 'llm'" in error["message"]
    assert time.monotonic() - start < HANG_TIMEOUT + 60
    check_recovered(supervised, [core])
