"""LoRA adapters per request: mixed adapters in one step batch, against one adapter and
against diffusers switching adapters between requests.

    python benchmarks/bench_lora.py                      # flux-small on this CPU
    python benchmarks/bench_lora.py --device cuda --dtype bfloat16 --size 512

Each round sends `requests` requests at once (a burst of concurrent clients), four ways:
  mixed     our engine, request i on adapter i % adapters
  one       our engine, every request on adapter 0
  base      our engine, no adapter (what the hooks cost)
  diffusers one pipeline with every adapter loaded (PEFT), requests one at a time in arrival
            order, `set_adapters` to the request's adapter before each: what a server
            without multi-adapter batching does
Sides alternate within a round; the summary gives medians and the ratios. Peak memory is
the engine core's peak resident set (VmHWM) after the rounds, for an engine serving the
adapters and one serving none, each after the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.tiny_lora import make_lora
from vllm_omni.testing.tiny_models import get_or_make

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux-small")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from diffusers import DiffusionPipeline

    folder = str(get_or_make(args.model))
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    loras = {f"a{i}": str(make_lora(folder, work / f"a{i}", seed=i, rank=args.rank,
                                    targets=TARGETS)) for i in range(args.adapters)}
    torch.set_num_threads(args.threads)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    for name, path in loras.items():
        pipe.load_lora_weights(path, adapter_name=name)
    worker = ThreadPoolExecutor(1)
    common = dict(num_threads=args.threads, max_batch_size=args.requests, device=args.device,
                  dtype=args.dtype, adaptive_batch=False,
                  max_image_pixels=args.size * args.size)
    engine = AsyncDiffusionEngine(folder, EngineOptions(lora_modules=loras, **common))
    bare = AsyncDiffusionEngine(folder, EngineOptions(**common))
    names = list(loras)
    shape = {"height": args.size, "width": args.size, "num_inference_steps": args.steps}

    def diffusers_one(i: int) -> None:
        pipe.set_adapters([names[i % len(names)]], adapter_weights=[1.0])
        pipe(f"thing {i}", generator=torch.Generator(args.device).manual_seed(i), **shape)

    async def burst(eng, adapter_of) -> float:
        async def one(i: int) -> None:
            lora = adapter_of(i)
            params = {**shape, "seed": i, **({"lora": lora} if lora else {})}
            async for _ in eng.generate(f"r{time.monotonic_ns()}-{i}", f"thing {i}", params):
                pass

        start = time.perf_counter()
        await asyncio.gather(*[one(i) for i in range(args.requests)])
        return time.perf_counter() - start

    async def diffusers_burst() -> float:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        await asyncio.gather(*[loop.run_in_executor(worker, diffusers_one, i)
                               for i in range(args.requests)])
        return time.perf_counter() - start

    sides = {
        "mixed": lambda: burst(engine, lambda i: names[i % len(names)]),
        "one": lambda: burst(engine, lambda i: names[0]),
        "base": lambda: burst(bare, lambda i: None),
        "diffusers": diffusers_burst,
    }

    async def run() -> dict[str, list[float]]:
        await burst(engine, lambda i: names[i % len(names)])  # warm both engines
        await burst(bare, lambda i: None)
        seconds: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                seconds[side].append(await sides[side]())
        return seconds

    try:
        seconds = asyncio.run(run())
        memory = {"adapters": peak_rss(engine.pid), "none": peak_rss(bare.pid)}
    finally:
        engine.shutdown()
        bare.shutdown()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    throughput = {k: args.requests / v for k, v in med.items()}
    print(json.dumps({
        "config": vars(args), "seconds": seconds, "images_per_s": throughput,
        "mixed_vs_one": throughput["mixed"] / throughput["one"],
        "mixed_vs_diffusers": throughput["mixed"] / throughput["diffusers"],
        "one_vs_base": throughput["one"] / throughput["base"],
        "peak_rss": memory, "peak_adapters_vs_none": memory["adapters"] / memory["none"],
    }, indent=1))


if __name__ == "__main__":
    main()
