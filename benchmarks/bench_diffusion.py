"""The diffusion engine against calling the diffusers pipeline once per request.

    python benchmarks/bench_diffusion.py --model flux-tiny   # overhead dominates
    python benchmarks/bench_diffusion.py --model flux-small  # the transformer dominates

Closed loop: `concurrency` clients each send their next request when the last one returns,
`requests` in all per round. The diffusers side is what a server without step batching does:
one worker takes requests in arrival order and runs `pipeline(...)` for each. Our side is
AsyncDiffusionEngine (engine core in its own process, step-level batching). Both use the
same number of torch threads; rounds alternate between the sides and the summary reports
medians and ours/diffusers ratios. The engine core blocks while idle, so it takes no CPU
from the diffusers side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.tiny_models import get_or_make


async def closed_loop(send, concurrency: int, total: int) -> tuple[float, list[float]]:
    """Run `total` requests with `concurrency` in flight; (wall seconds, latencies)."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def client() -> None:
        for i in counter:
            t = time.perf_counter()
            await send(i)
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return time.perf_counter() - start, latencies


def params(args, i: int) -> dict:
    return {"height": args.size, "width": args.size, "num_inference_steps": args.steps,
            "seed": i}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux-tiny")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="per round (at least the concurrency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cuda: the same comparison on a GPU")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from diffusers import DiffusionPipeline

    folder = str(get_or_make(args.model))
    torch.set_num_threads(args.threads)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    worker = ThreadPoolExecutor(1)  # one request at a time, in arrival order
    engine = AsyncDiffusionEngine(
        folder, EngineOptions(num_threads=args.threads, max_batch_size=args.max_batch_size,
                              max_image_pixels=args.size * args.size, device=args.device,
                              dtype=args.dtype)
    )
    prompts = [f"a picture of thing number {i}" for i in range(256)]

    def diffusers_call(i: int) -> None:
        p = params(args, i)
        gen = torch.Generator().manual_seed(p.pop("seed"))
        pipe(prompts[i], generator=gen, **p)

    async def diffusers_send(i: int) -> None:
        await asyncio.get_running_loop().run_in_executor(worker, diffusers_call, i)

    async def ours_send(i: int) -> None:
        async for _ in engine.generate(f"r{time.perf_counter_ns()}", prompts[i], params(args, i)):
            pass

    sides = {"vllm-omni": ours_send, "diffusers": diffusers_send}
    results = {}

    async def run_all() -> None:
        for side in sides.values():  # warm-up
            await closed_loop(side, 2, 2)
        for c in args.concurrency:
            n = max(args.requests, c)
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    wall, lat = await closed_loop(sides[name], c, n)
                    res = results.setdefault((c, name), {"ips": [], "lat": []})
                    res["ips"].append(n / wall)
                    res["lat"].append(statistics.median(lat))
                    print(f"c={c} {name}: {n / wall:.2f} img/s, median latency "
                          f"{statistics.median(lat):.3f} s", flush=True)

    try:
        asyncio.run(run_all())
    finally:
        engine.shutdown()
    print(f"\n{args.model} {args.size}x{args.size}, {args.steps} steps, {args.threads} threads, "
          f"{args.device}, {args.dtype}")
    print("| concurrency | vllm-omni img/s | diffusers img/s | throughput ratio | "
          "vllm-omni latency s | diffusers latency s | latency ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for c in args.concurrency:
        ours, base = results[(c, "vllm-omni")], results[(c, "diffusers")]
        oi, bi = statistics.median(ours["ips"]), statistics.median(base["ips"])
        ol, bl = statistics.median(ours["lat"]), statistics.median(base["lat"])
        print(f"| {c} | {oi:.2f} | {bi:.2f} | **{oi / bi:.2f}** | {ol:.3f} | {bl:.3f} | "
              f"{ol / bl:.2f} |")
        summary.append({"concurrency": c, "ours_ips": ours["ips"], "diffusers_ips": base["ips"]})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
