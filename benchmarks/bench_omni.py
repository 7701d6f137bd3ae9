"""Qwen2.5-Omni speaking: vllm-omni's pipeline against HF transformers' `generate`.

    python benchmarks/bench_omni.py                      # the tiny model
    python benchmarks/bench_omni.py --requests 16 --rounds 2

Each request is a text prompt answered in text and speech: greedy thinker (`--text-tokens`),
greedy talker capped at `--codes` codec tokens (no early stop, so both sides do the same
work), code2wav with HF's defaults. Greedy decoding makes both sides compute the same tokens
(the tests check they are equal). HF side: one `model.generate(return_audio=True)` at a time
in arrival order, as a server around transformers would run it. Our side: AsyncOmniLLM with
the built-in pipeline, closed loop with `concurrency` requests in flight, once with code2wav
decoding each request whole (`vllm-omni`, HF's result) and once streamed (`vllm-omni
streamed`: audio chunk by chunk as the talker writes codes). Rounds alternate the order of the
sides; the summary reports medians and ratios. Real-time factor = wall seconds per second of
audio produced; time to first audio (TTFA) = from sending a request to its first audio chunk
(the whole latency where nothing is streamed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from vllm import SamplingParams

from vllm_omni.testing.tiny_models import get_or_make

KEYS = ("rps", "lat", "ttfa", "rtf")
TOPICS = ["a red fox", "the sea", "two cats", "a long road", "rain", "the moon", "bread", "music"]


async def closed_loop(send, concurrency: int, total: int) -> dict:
    """`total` requests, `concurrency` in flight: wall s, latencies, TTFAs, audio seconds.
    `send(i)` returns (seconds of audio, perf_counter time of its first audio)."""
    latencies: list[float] = []
    ttfas: list[float] = []
    audio = 0.0
    counter = iter(range(total))

    async def client() -> None:
        nonlocal audio
        for i in counter:
            t = time.perf_counter()
            seconds, first_audio = await send(i)
            audio += seconds
            latencies.append(time.perf_counter() - t)
            ttfas.append(first_audio - t)

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return {"wall": time.perf_counter() - start, "lat": latencies, "ttfa": ttfas,
            "audio": audio}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5-omni-tiny")
    ap.add_argument("--text-tokens", type=int, default=32)
    ap.add_argument("--codes", type=int, default=100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from vllm_omni.compat.torchvision_free import install
    from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM

    install()
    folder = str(get_or_make(args.model))
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    no_stop = []  # both sides speak exactly --codes codec tokens
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": f"Tell me about {t}."}]}],
            add_generation_prompt=True, tokenize=False)
        for t in TOPICS * 32
    ]
    worker = ThreadPoolExecutor(1)

    def hf_call(i: int) -> float:
        inputs = processor(text=prompts[i], return_tensors="pt")
        with torch.no_grad():
            _, wave = model.generate(
                **inputs, return_audio=True, thinker_max_new_tokens=args.text_tokens,
                thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=args.codes,
                talker_eos_token_id=no_stop, talker_min_new_tokens=args.codes,
            )
        return wave.numel() / 24000

    async def hf_send(i: int) -> tuple[float, float]:
        seconds = await asyncio.get_running_loop().run_in_executor(worker, hf_call, i)
        return seconds, time.perf_counter()

    async def run_all() -> dict:
        omni = AsyncOmniLLM(folder, dtype="float32", max_model_len=2048)
        rate = omni.audio_stage.info.sample_rate
        def params(stream: bool) -> list:
            return [SamplingParams(temperature=0, max_tokens=args.text_tokens),
                    {"temperature": 0, "max_tokens": args.codes, "stop_token_ids": [],
                     "min_tokens": args.codes}, {"stream": stream}]

        def ours(stream: bool):
            async def send(i: int) -> tuple[float, float]:
                seconds, first = 0.0, None
                async for out in omni.generate(prompts[i], params(stream),
                                               f"b{time.perf_counter_ns()}", ["text", "audio"]):
                    if out.audio is not None:
                        first = first or time.perf_counter()
                        seconds = len(out.audio.waveform) / rate
                return seconds, first
            return send

        sides = {"vllm-omni": ours(False), "vllm-omni streamed": ours(True),
                 "transformers": hf_send}
        results: dict = {}
        try:
            for side in sides.values():  # warm-up
                await closed_loop(side, 1, 1)
            for c in args.concurrency:
                n = max(args.requests, c)
                for r in range(args.rounds):
                    for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                        run = await closed_loop(sides[name], c, n)
                        res = results.setdefault((c, name), {k: [] for k in KEYS})
                        res["rps"].append(n / run["wall"])
                        res["lat"].append(statistics.median(run["lat"]))
                        res["ttfa"].append(statistics.median(run["ttfa"]))
                        res["rtf"].append(run["wall"] / run["audio"])
                        print(f"c={c} {name}: " + ", ".join(
                            f"{k} {v[-1]:.3f}" for k, v in res.items()), flush=True)
        finally:
            omni.shutdown()
        return results

    results = asyncio.run(run_all())
    print(f"\n{args.model}: {args.text_tokens} text tokens, {args.codes} codec tokens "
          f"({args.codes / 50:.1f} s of speech) per request, {torch.get_num_threads()} threads")
    print("| concurrency | side | req/s | vs transformers | latency s | TTFA s | "
          "TTFA / whole latency | RTF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        med = {name: {k: statistics.median(v) for k, v in results[(c, name)].items()}
               for name in ("vllm-omni", "vllm-omni streamed", "transformers")}
        whole = med["vllm-omni"]["lat"]
        for name, m in med.items():
            print(f"| {c} | {name} | {m['rps']:.2f} | "
                  f"**{m['rps'] / med['transformers']['rps']:.2f}** | {m['lat']:.2f} | "
                  f"{m['ttfa']:.2f} | {m['ttfa'] / whole:.0%} | {m['rtf']:.3f} |")
    print(json.dumps({f"{c}-{n}": v for (c, n), v in results.items()}))


if __name__ == "__main__":
    main()
