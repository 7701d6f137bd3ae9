"""The demo under load: a mix of clients is served and leaves the server as it was, and
admission bounds what waits beyond the stages' batches, not the batches."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from conftest import DEMO_AUTH, DEMO_KEY, wait_for

from vllm_omni.testing.load import failures, run_mix, server_state, summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers=DEMO_AUTH).text
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def test_a_mix_of_60_clients_is_all_answered_and_leaves_nothing(demo_server):
    # --max-pending-requests 16 bounds what waits beyond the stages' batches, not the batch:
    # 60 clients fit in what the demo's stages run at once, so none is refused.
    srv = demo_server
    before = server_state(srv.proc.pid)
    outcomes = asyncio.run(run_mix(srv.url, clients=60, requests=180, hangup_share=0.2,
                                   seed=1, timeout=180, api_key=DEMO_KEY))
    report = summary(outcomes)
    print(report)
    assert not failures(outcomes), failures(outcomes)[:5]
    assert not [o for o in outcomes if o.result == "503"], report
    assert set(report) == {"chat", "chat_stream", "completion", "image"}
    ok = sum(r["results"].get("ok", 0) for r in report.values())
    assert ok >= len(outcomes) // 2  # those that did not hang up are served
    assert any(o.result == "hangup" for o in outcomes)
    wait_for(lambda: metric(srv, "vllm_omni:requests_in_flight") == 0,
             "hung-up requests drained")
    after = server_state(srv.proc.pid)
    assert httpx.get(srv.url + "/health").status_code == 200
    assert after["processes"] == before["processes"]
    # /dev/shm is the machine's: segments another test left before this one are not the
    # load's doing.
    assert after["segments"] == before["segments"], (before["segments"], after["segments"])
    assert after["rss"] < before["rss"] * 1.25, (before["rss"], after["rss"])
    assert metric(srv, "vllm_omni:requests_in_flight") == 0


def test_past_the_batch_16_wait_and_the_rest_are_refused(demo_server):
    """More long chats at once than the LLM stage runs plus the 16 allowed to wait: the
    surplus gets 503 + Retry-After, every other one is served, and /metrics counts the
    running and the waiting apart while they are in flight."""
    srv = demo_server
    info = httpx.get(srv.url + "/v1/omni/info", headers=DEMO_AUTH).json()
    capacity = next(s["max_running"] for s in info["stages"] if s["name"] == "llm")
    count = max(200, capacity + 16 + 40)
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    seen: dict[str, float] = {}

    async def scenario():
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, headers=DEMO_AUTH, limits=limits,
                                     timeout=120) as client:
            done = asyncio.Event()

            async def chat():
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code, r.headers.get("Retry-After"), r.json()
                    lines = [line async for line in r.aiter_lines() if line]
                    return 200, None, lines[-1]

            async def watch():  # the gauges' peaks while the chats are in flight
                while not done.is_set():
                    text = (await client.get("/metrics")).text
                    for name in ("running", "waiting"):
                        value = float(re.search(
                            rf'^vllm_omni:requests_{name}{{stage="llm"}} (\S+)$', text, re.M)[1])
                        seen[name] = max(seen.get(name, 0), value)
                    await asyncio.sleep(0.05)

            async def chats():
                try:
                    return await asyncio.gather(*(chat() for _ in range(count)))
                finally:
                    done.set()

            results, _ = await asyncio.gather(chats(), watch())
            return results

    results = asyncio.run(scenario())
    refused = [r for r in results if r[0] != 200]
    assert refused and {r[0] for r in refused} == {503}, refused[:3]
    assert all(retry == "1" and "--max-pending-requests" in err["error"]["message"]
               for _, retry, err in refused)
    assert len(refused) <= count - capacity - 16
    ends = [last for status, _, last in results if status == 200]
    assert all(last == "data: [DONE]" for last in ends), [e for e in ends if e != "data: [DONE]"]
    assert seen["running"] == capacity and 0 < seen["waiting"] <= 16, seen
    wait_for(lambda: metric(srv, "vllm_omni:requests_in_flight") == 0,
             "the chats finished")
    assert metric(srv, "vllm_omni:requests_waiting") == 0
