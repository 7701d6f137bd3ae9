"""Under load, past its limits and without the key, the server answers every request (a
success, or an OpenAI-shaped 4xx / 503 / 504) and is left as it was."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

import httpx
import pytest
from conftest import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 5
LONG = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tiny_qwen2, tmp_path_factory):
    """A server with every operating flag set (and no playground)."""
    shm_before = set(os.listdir("/dev/shm"))
    srv = ServerProcess([tiny_qwen2, "--api-key", KEY, "--max-concurrent-requests", "3",
                         "--request-timeout", str(TIMEOUT), "--max-request-body-mb", "1",
                         "--no-playground"],
                        tmp_path_factory.mktemp("limits") / "server.log")
    # vLLM's engine queues live there (entries of other processes may come and go).
    assert set(os.listdir("/dev/shm")) - shm_before
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"
    # Nothing of the server is left in the shared-memory filesystem once it has stopped.
    assert not set(os.listdir("/dev/shm")) - shm_before


def test_no_playground_flag(limited):
    assert httpx.get(limited.url + "/").status_code == 404
    info = httpx.get(limited.url + "/v1/omni/info", headers=AUTH).json()
    assert info["outputs"] == ["text"]


def metric(srv, name: str, headers: dict | None = AUTH) -> float:
    text = httpx.get(srv.url + "/metrics", headers=headers).text
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def wait_idle(srv, seconds: float = 10) -> None:
    """Until the engine holds no request: what an abort in every stage leaves."""
    deadline = time.monotonic() + seconds
    while metric(srv, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(srv, "vllm:num_requests_running") == 0


def stalled_upload(srv: ServerProcess) -> socket.socket:
    """A chat request whose headers arrive and whose body never ends: it holds a slot
    without any work in the engine (a loaded machine can stall the test for seconds)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n{".encode())
    return sock


def answer_of(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def test_beyond_the_limit_is_503_at_once_and_stalled_uploads_end_at_the_timeout(limited):
    refused_before = metric(limited, "vllm_omni:requests_refused_total")
    timed_out_before = metric(limited, "vllm_omni:requests_timed_out_total")
    uploads = [stalled_upload(limited) for _ in range(3)]
    for _ in range(100):
        if metric(limited, "vllm_omni:requests_in_flight") == 3:
            break
        time.sleep(0.05)
    start = time.perf_counter()
    refused = httpx.post(limited.url + "/v1/chat/completions", json=LONG, headers=AUTH,
                         timeout=60)
    assert time.perf_counter() - start < 2
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert "--max-concurrent-requests" in refused.json()["error"]["message"]
    for answer in map(answer_of, uploads):
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert f"did not arrive within {TIMEOUT} s".encode() in answer
    assert metric(limited, "vllm_omni:requests_refused_total") == refused_before + 1
    assert metric(limited, "vllm_omni:requests_timed_out_total") == timed_out_before + 3
    assert metric(limited, "vllm_omni:requests_in_flight") == 0


def test_streams_end_at_the_timeout_with_an_error_event(limited):
    async def scenario():
        async with httpx.AsyncClient(base_url=limited.url, headers=AUTH, timeout=60) as c:
            async def long_stream():
                async with c.stream("POST", "/v1/chat/completions",
                                    json={**LONG, "stream": True}) as r:
                    assert r.status_code == 200
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            return await asyncio.gather(*(long_stream() for _ in range(3)))

    timed_out_before = metric(limited, "vllm_omni:requests_timed_out_total")
    for stream in asyncio.run(scenario()):  # cut at the deadline: an error event, [DONE]
        assert stream[-1] == "data: [DONE]"
        assert f"took longer than {TIMEOUT} s" in stream[-2]
    assert metric(limited, "vllm_omni:requests_timed_out_total") == timed_out_before + 3
    wait_idle(limited)
    assert metric(limited, "vllm_omni:requests_in_flight") == 0


def test_a_request_past_the_timeout_is_504_and_stopped(limited):
    start = time.perf_counter()
    r = httpx.post(limited.url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=60)
    assert r.status_code == 504, r.text
    assert "stopped in every stage" in r.json()["error"]["message"]
    assert time.perf_counter() - start < TIMEOUT + 2
    wait_idle(limited)


def test_a_body_over_the_limit_is_413(limited):
    big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(limited.url + "/v1/chat/completions", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(limited.url + "/v1/images/edits", content=chunks(), timeout=30,
                   headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413
    assert httpx.get(limited.url + "/health").status_code == 200


def test_every_route_but_health_needs_the_key(limited):
    spec = httpx.get(limited.url + "/openapi.json", headers=AUTH).json()
    routes = [(method, path) for path, item in spec["paths"].items() for method in item]
    # The real request bodies, extension fields included, with their shared parts resolvable.
    def fields(path: str, kind: str = "application/json") -> set[str]:
        body = spec["paths"][path]["post"]["requestBody"]["content"][kind]["schema"]
        return set(body["properties"])

    assert {"messages", "stage_sampling_params", "modalities", "audio"} <= fields(
        "/v1/chat/completions")
    assert {"prompt", "stage_sampling_params"} <= fields("/v1/completions")
    assert {"prompt", "size", "num_inference_steps", "seed", "cache"} <= fields(
        "/v1/images/generations")
    assert {"input", "voice", "stage_sampling_params"} <= fields("/v1/audio/speech")
    assert {"prompt", "seconds", "size", "num_frames", "fps", "seed"} <= fields("/v1/videos")
    assert {"image", "prompt"} <= fields("/v1/images/edits", "multipart/form-data")
    assert {"file", "language", "stream"} <= fields("/v1/audio/transcriptions",
                                                    "multipart/form-data")
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs <= set(spec["components"]["schemas"])
    assert ("post", "/v1/chat/completions") in routes and ("get", "/v1/omni/plan") in routes
    for method, path in routes:
        status = httpx.request(method, limited.url + path.replace("{", "").replace("}", ""),
                               timeout=30).status_code
        assert status == (200 if path == "/health" else 401), (method, path)
    for path in ("/openapi.json", "/metrics", "/docs"):
        assert httpx.get(limited.url + path).status_code == 401, path
    assert httpx.get(limited.url + "/v1/models",
                     headers={"Authorization": "Bearer wrong"}).status_code == 401
