"""The Realtime socket against the chat endpoint: time from the end of a user's audio turn to
its first audio, through the same server.

    python benchmarks/bench_realtime.py                        # the tiny Qwen2.5-Omni
    python benchmarks/bench_realtime.py --model qwen2_5-omni-scaled --turns 16

Starts `vllm serve MODEL --omni`. Every turn is the same second of audio and a spoken answer
(greedy thinker `--text-tokens`, talker `--codes` codec tokens without early stop). Realtime:
a fresh session per turn (connecting is not timed), the audio appended, then the clock starts
at `input_audio_buffer.commit` + `response.create` and stops at the first
`response.output_audio.delta`. Chat: the clock starts at sending the streamed request with
the audio as an `input_audio` part and stops at the first chunk carrying audio. Closed loops
of `concurrency` turns in flight, the two sides alternating per round; medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import soundfile

from vllm_omni.testing.tiny_models import get_or_make

VOICE = "Chelsie"


def turn_audio() -> np.ndarray:
    t = np.arange(24000) / 24000
    return (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) * 32767).astype("<i2")


def start_server(folder: str, log: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "vllm"), "serve", folder, "--omni", "--dtype",
         "float32", "--max-model-len", "2048", "--port", str(port), "--host", "127.0.0.1"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")


async def main_async(args: argparse.Namespace, url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    pcm = turn_audio()
    buf = io.BytesIO()
    soundfile.write(buf, pcm, 24000, format="WAV", subtype="PCM_16")
    wav = base64.b64encode(buf.getvalue()).decode()
    stages = {"talker": {"temperature": 0, "max_tokens": args.codes, "min_tokens": args.codes,
                         "stop_token_ids": []}}

    async def realtime_turn() -> float:
        async with client.realtime.connect(model=model) as conn:
            await conn.recv()
            await conn.session.update(session={
                "temperature": 0, "stage_sampling_params": stages,
                "max_output_tokens": args.text_tokens, "audio": {"output": {"voice": VOICE}}})
            await conn.recv()
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm.tobytes()).decode())
            start = time.perf_counter()
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = None
            while (event := await conn.recv()).type != "response.done":
                if event.type == "response.output_audio.delta" and first is None:
                    first = time.perf_counter()
            return first - start

    async def chat_turn() -> float:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, stream=True, temperature=0, max_tokens=args.text_tokens,
            modalities=["text", "audio"], audio={"voice": VOICE, "format": "pcm16"},
            messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}],
            extra_body={"stage_sampling_params": stages})
        first = None
        async for chunk in stream:
            audio = getattr(chunk.choices[0].delta, "audio", None) if chunk.choices else None
            if audio is not None and getattr(audio, "data", None) and first is None:
                first = time.perf_counter()
        return first - start

    async def loop(turn, concurrency: int) -> list[float]:
        times: list[float] = []
        counter = iter(range(args.turns))

        async def worker() -> None:
            for _ in counter:
                times.append(await turn())

        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return times

    await loop(chat_turn, 1)  # warm-up
    for c in args.concurrency:
        found: dict[str, list[float]] = {"realtime": [], "chat": []}
        for r in range(args.rounds):
            order = [("realtime", realtime_turn), ("chat", chat_turn)]
            for name, turn in order if r % 2 == 0 else order[::-1]:
                found[name] += await loop(turn, c)
        rt, chat = (statistics.median(found[k]) for k in ("realtime", "chat"))
        print(f"c={c}: time to first audio, median over {len(found['chat'])} turns: "
              f"realtime {rt * 1000:.0f} ms, chat {chat * 1000:.0f} ms, "
              f"realtime / chat = {rt / chat:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5-omni-tiny")
    ap.add_argument("--text-tokens", type=int, default=16)
    ap.add_argument("--codes", type=int, default=60)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    folder = str(get_or_make(args.model))
    proc, url = start_server(folder, Path(tempfile.mkdtemp()) / "server.log")
    try:
        asyncio.run(main_async(args, url))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
