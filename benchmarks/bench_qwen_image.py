"""Qwen-Image on two stages (Qwen2.5-VL encoder on vLLM -> DiT) against the one-stage
diffusers path (the encoder runs inside the DiT process, diffusers' `encode_prompt`).

    python benchmarks/bench_qwen_image.py                       # tiny model, c=1 and c=8
    python benchmarks/bench_qwen_image.py --model /path/to/Qwen-Image --size 512

Both sides run through AsyncOmniLLM (same orchestrator, same diffusion engine); only the
pipeline differs: the built-in `qwen_image` (picked from model_index.json) and
`config/pipelines/diffusion.yaml`. Closed loop: `concurrency` clients each send their next
request when the last one returns. One side's engines run at a time; within a side, rounds
alternate between the concurrencies and the summary reports medians and two-stage /
one-stage ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from bench_diffusion import closed_loop

from vllm_omni.config.loader import BUILTIN_DIR
from vllm_omni.testing.tiny_models import get_or_make

PROMPTS = ["a red cat on a sofa", "a big blue house by the sea at night, under a full moon",
           "two dogs", "a bowl of fruit on a wooden table, in soft morning light"]


def measure(args, side: str) -> dict[int, list[tuple[float, float]]]:
    from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM

    # One dtype for both sides (vLLM would run an fp32 checkpoint in bf16 on a CPU).
    kwargs = {"kv_cache_memory_bytes": 1 << 29, "dtype": args.dtype}
    if side == "one-stage":
        kwargs["stage_configs_path"] = str(BUILTIN_DIR / "diffusion.yaml")
    results: dict[int, list[tuple[float, float]]] = {c: [] for c in args.concurrency}
    stage_seconds: dict[str, list[float]] = {}

    async def run() -> None:
        engine = AsyncOmniLLM(args.model, disable_log_stats=True, **kwargs)
        dit = {"height": args.size, "width": args.size, "num_inference_steps": args.steps,
               "negative_prompt": "blurry" if args.cfg else None,
               "true_cfg_scale": 4.0 if args.cfg else 1.0}
        params = [None, dit] if len(engine.pipeline.stages) == 2 else [dit]
        counter = iter(range(1 << 30))

        async def send(i: int) -> None:
            n = next(counter)
            async for out in engine.generate(PROMPTS[i % len(PROMPTS)], params, f"{side}-{n}"):
                if out.finished:
                    for stage, seconds in out.metrics["stage_seconds"].items():
                        stage_seconds.setdefault(stage, []).append(seconds)

        try:
            await closed_loop(send, 2, 4)  # warm-up
            for _ in range(args.rounds):
                for c in args.concurrency:
                    wall, lat = await closed_loop(send, c, max(args.requests, c))
                    results[c].append((max(args.requests, c) / wall, statistics.median(lat)))
        finally:
            engine.shutdown()

    asyncio.run(run())
    results["stage_seconds"] = {k: statistics.median(v) for k, v in stage_seconds.items()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen-image-tiny", help="a tiny model name or a folder")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="per round (at least the concurrency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cfg", action="store_true", help="true CFG with a negative prompt")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if "/" not in args.model:
        args.model = str(get_or_make(args.model))
    sides = {side: measure(args, side) for side in ("two-stage", "one-stage")}
    summary = {}
    for c in args.concurrency:
        row = {}
        for side, res in sides.items():
            row[side] = {"images_per_s": statistics.median(r[0] for r in res[c]),
                         "median_latency_s": statistics.median(r[1] for r in res[c])}
        row["throughput_ratio"] = (row["two-stage"]["images_per_s"]
                                   / row["one-stage"]["images_per_s"])
        summary[f"c={c}"] = row
    summary["median_stage_seconds"] = {side: res["stage_seconds"] for side, res in sides.items()}
    print(json.dumps({"args": vars(args), "results": summary}, indent=2))


if __name__ == "__main__":
    main()
