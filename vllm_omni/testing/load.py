"""A bounded load generator: a mix of the requests a running server offers, from many
concurrent clients, a share of which hang up halfway. Used by benchmarks/load.py and the
reliability test; it sends traffic only to the URL it is given (a local server).

Every request ends in one of: a success, an OpenAI-shaped error (a 4xx, or 503 when the
server is full), a hang-up by the client (on purpose), or a failure (no answer in time, a
5xx, a broken stream, an error without a message): what a serious server never gives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from collections import Counter, defaultdict
from typing import Any

import httpx

MESSAGES = [{"role": "user", "content": "Tell me a short story."}]


@dataclasses.dataclass
class Outcome:
    kind: str
    result: str  # "ok", "4xx", "503", "hangup", or "fail: ..."
    status: int | None
    seconds: float
    message: str | None = None  # the server's error message, for a refusal


def request_kinds(info: dict[str, Any]) -> list[str]:
    """The kinds of request a server can answer, from its /v1/omni/info."""
    kinds = []
    if "text" in info["outputs"]:
        kinds += ["chat", "chat_stream", "completion"]
    if info.get("image"):
        kinds.append("image")
    if info.get("audio"):
        kinds += ["spoken_chat", "speech"]
    return kinds


def _body(kind: str, info: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any]]:
    talker = {"talker": {"max_tokens": 30}}  # a random talker speaks until its limit
    if kind in ("chat", "chat_stream"):
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": rng.randint(4, 24),
                                        "stream": kind == "chat_stream"}
    if kind == "completion":
        return "/v1/completions", {"prompt": "Once upon a time", "max_tokens": rng.randint(4, 24)}
    if kind == "image":
        return "/v1/images/generations", {"prompt": "a handwritten digit seven",
                                          "seed": rng.randint(0, 9), "num_inference_steps": 4}
    if kind == "spoken_chat":
        return "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 8, "modalities": ["text", "audio"],
            "audio": {"voice": info["audio"]["voices"][0], "format": "wav"},
            "stage_sampling_params": talker}
    if kind == "speech":
        return "/v1/audio/speech", {"input": "hello", "response_format": "wav",
                                    "stage_sampling_params": talker}
    raise ValueError(f"unknown request kind {kind!r}")


def _judge(reply: httpx.Response, body: bytes) -> tuple[str, str | None]:
    if reply.status_code < 300:
        return "ok", None
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if not message:
        return f"fail: {reply.status_code} without an OpenAI-shaped error", None
    if reply.status_code == 503:
        return "503", message
    if reply.status_code < 500:
        return "4xx", message
    return f"fail: {reply.status_code} {message[:80]}", message


async def one(client: httpx.AsyncClient, kind: str, info: dict[str, Any], rng: random.Random,
              hang_up: bool, timeout: float) -> Outcome:
    path, body = _body(kind, info, rng)
    start = time.perf_counter()
    streamed = body.get("stream", False)
    try:
        async with asyncio.timeout(timeout):
            if hang_up:  # leave after the first bytes of the answer, or a moment in
                async with client.stream("POST", path, json=body) as reply:
                    if streamed or reply.status_code >= 300:
                        async for _ in reply.aiter_bytes():
                            break
                    else:
                        await asyncio.sleep(rng.uniform(0, 0.2))
                return Outcome(kind, "hangup", reply.status_code, time.perf_counter() - start)
            async with client.stream("POST", path, json=body) as reply:
                data = await reply.aread()
            result, message = _judge(reply, data)
            if result == "ok" and streamed and b"data: [DONE]" not in data:
                result = "fail: a stream without [DONE]"
            if result == "ok" and streamed and b'"error"' in data:
                result = "fail: " + data.decode(errors="replace")[-120:]
            return Outcome(kind, result, reply.status_code, time.perf_counter() - start,
                           message)
    except TimeoutError:
        return Outcome(kind, f"fail: no answer in {timeout:g} s", None, timeout)
    except httpx.HTTPError as e:
        return Outcome(kind, f"fail: {type(e).__name__}: {e}", None, time.perf_counter() - start)


async def run_mix(url: str, *, clients: int, requests: int, hangup_share: float = 0.2,
                  seed: int = 0, timeout: float = 300, api_key: str | None = None,
                  kinds: list[str] | None = None) -> list[Outcome]:
    """`requests` requests from `clients` concurrent clients, kinds drawn from what the
    server offers (or `kinds`), a `hangup_share` of them abandoned halfway."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout)) as client:
        info = (await client.get("/v1/omni/info")).raise_for_status().json()
        kinds = kinds or request_kinds(info)
        rng = random.Random(seed)
        plan = [(rng.choice(kinds), rng.random() < hangup_share, random.Random(rng.random()))
                for _ in range(requests)]
        queue: asyncio.Queue = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        outcomes: list[Outcome] = []

        async def worker() -> None:
            while not queue.empty():
                kind, hang_up, own_rng = queue.get_nowait()
                outcomes.append(await one(client, kind, info, own_rng, hang_up, timeout))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """Per kind: how many, how they ended, latency percentiles of the answered ones."""
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o)
    out = {}
    for kind, items in sorted(by_kind.items()):
        answered = sorted(o.seconds for o in items if o.result == "ok")
        q = statistics.quantiles(answered, n=100) if len(answered) >= 2 else answered * 99
        out[kind] = {
            "requests": len(items),
            "results": dict(Counter(o.result for o in items)),
            "statuses": dict(Counter(str(o.status) for o in items)),
            "refusals": dict(Counter(o.message for o in items if o.message).most_common(3)),
            **({"p50_s": round(q[49], 3), "p90_s": round(q[89], 3), "p99_s": round(q[98], 3)}
               if answered else {}),
        }
    return out


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.result.startswith("fail")]


def server_state(pid: int) -> dict[str, Any]:
    """The server's processes (alive, not zombies), their summed RSS, and the payloads in
    shared memory nobody has read (pooled segments that are free are the pools' memory):
    what a load must leave as it found."""
    import psutil

    from vllm_omni.transfer.connectors import unread_payloads

    root = psutil.Process(pid)
    procs = [p for p in [root, *root.children(recursive=True)]
             if p.status() != psutil.STATUS_ZOMBIE]
    segments = sorted(unread_payloads())
    return {"processes": sorted(p.pid for p in procs),
            "rss": sum(p.memory_info().rss for p in procs), "segments": segments}
