"""The diffusion engine on a GPU, resident and with each offload mode, against diffusers.

    python benchmarks/bench_offload.py --model flux-small --size 512 --steps 20

For the engine resident on the GPU and for `offload: model | group | sequential`, the same
requests (a batch of two seeds) run through AsyncDiffusionEngine, and each image is compared
with diffusers' `pipeline(...)` on the same device for the same seed. Reported per mode: the
largest pixel difference, seconds per request, and the GPU memory the engine process held at
its peak (nvidia-smi). Offloading is GPU-only (the engine refuses it on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import threading
import time

import numpy as np
import psutil
import torch

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.tiny_models import get_or_make


class PeakGpuMemory:
    """The most GPU memory (MiB, nvidia-smi) this process's children held while inside."""

    def __init__(self) -> None:
        self.mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _used(self) -> int:
        children = {p.pid for p in psutil.Process().children(recursive=True)}
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False).stdout
        rows = (line.split(", ") for line in out.splitlines() if line)
        return sum(int(used) for pid, used in rows if int(pid) in children)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.mib = max(self.mib, self._used())
            time.sleep(0.05)

    def __enter__(self) -> PeakGpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def run_engine(engine: AsyncDiffusionEngine, prompts: list[str], params: list[dict]):
    async def one(i: int) -> np.ndarray:
        async for out in engine.generate(f"r{i}-{time.perf_counter_ns()}", prompts[i],
                                         {**params[i], "float_output": True}):
            if out.finished:
                return out.float_images[0]
        raise RuntimeError("no final output")

    return await asyncio.gather(*[one(i) for i in range(len(prompts))])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux-small")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", nargs="+", default=["resident", "model", "group", "sequential"])
    args = ap.parse_args()

    from diffusers import DiffusionPipeline

    folder = str(get_or_make(args.model))
    prompts = ["a picture of thing number 1", "a picture of another thing"]
    params = [{"height": args.size, "width": args.size, "num_inference_steps": args.steps,
               "seed": seed} for seed in (1, 2)]
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    want = []
    for prompt, p in zip(prompts, params, strict=True):
        p = dict(p)
        gen = torch.Generator().manual_seed(p.pop("seed"))
        want.append(pipe(prompt, generator=gen, output_type="np", **p).images[0])
    del pipe
    torch.cuda.empty_cache()

    rows = []
    for mode in args.modes:
        options = EngineOptions(device="cuda", dtype=args.dtype,
                                offload=None if mode == "resident" else mode,
                                max_image_pixels=args.size * args.size)
        with PeakGpuMemory() as peak:
            engine = AsyncDiffusionEngine(folder, options)
            try:
                asyncio.run(run_engine(engine, prompts, params))  # warm-up
                start = time.perf_counter()
                got = asyncio.run(run_engine(engine, prompts, params))
                seconds = (time.perf_counter() - start) / len(prompts)
            finally:
                engine.shutdown()
        diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
        rows.append((mode, diff, seconds, peak.mib))
        print(f"{mode}: max |ours - diffusers| {diff:.2e}, {seconds:.3f} s/request, "
              f"peak GPU {peak.mib} MiB", flush=True)

    print(f"\n{args.model} {args.size}x{args.size}, {args.steps} steps, {args.dtype}, "
          f"{torch.cuda.get_device_name()}")
    print("| mode | max pixel diff vs diffusers | s/request (batch of 2) | peak GPU MiB |")
    print("| --- | --- | --- | --- |")
    for mode, diff, seconds, mib in rows:
        print(f"| {mode} | {diff:.2e} | {seconds:.3f} | {mib} |")


if __name__ == "__main__":
    main()
