"""One rank against several: Ulysses sequence parallel and CFG parallel, at equal images.

    python benchmarks/bench_diffusion_parallel.py                      # 2 CPU cores
    python benchmarks/bench_diffusion_parallel.py --device cuda --ranks 2   # GPUs

flux-small (the transformer dominates) at a size with thousands of image tokens. Each mode
is run by a one-rank engine and by a `--ranks` engine (one thread per rank on CPU, each rank
bound to its own core; one GPU per rank on CUDA), rounds interleaved; one request at a time,
end to end (text encoding and VAE decode run on rank 0 alone). CFG parallel runs requests
with a negative prompt and true_cfg_scale (Flux's true CFG: both branches per step). The
summary reports median seconds per request, the speed-up, the largest image difference, and
the communication share: the time rank 0 spent in collectives (waiting for its peers
included) over the request's time.

On a CPU shared with other work, wall-clock times say more about the neighbours than about
the engine, so the CPU time of each rank's process is read too (psutil): the "CPU-time
speed-up" is the one-rank engine's CPU time over the busiest rank's (the critical path
when every rank has its core to itself; time a rank spends waiting on a blocking
collective is not CPU time, so communication is not in it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np
import psutil

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.tiny_models import get_or_make

CFG = {"negative_prompt": "blurry, dark", "true_cfg_scale": 3.0}


def cpu_seconds(engine) -> list[float]:
    """CPU time so far of the engine core (rank 0) and of each other rank."""
    core = psutil.Process(engine.pid)
    return [sum(p.cpu_times()[:2]) for p in [core, *core.children()]]


async def one_request(engine, i: int, params: dict) -> tuple[float, np.ndarray, float, float]:
    """Wall seconds, images, communication seconds, CPU seconds of the busiest rank."""
    cpu = cpu_seconds(engine)
    start = time.perf_counter()
    async for out in engine.generate(f"r{i}", "a small red house by a lake",
                                     {**params, "float_output": True}):
        last = out
    wall = time.perf_counter() - start
    busiest = max(b - a for a, b in zip(cpu, cpu_seconds(engine), strict=True))
    return wall, last.float_images, last.comm_seconds or 0.0, busiest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="flux-small")
    parser.add_argument("--size", type=int, default=1024, help="square image side (pixels)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default="ulysses,cfg")
    args = parser.parse_args()

    folder = str(get_or_make(args.model))
    base = {"height": args.size, "width": args.size, "num_inference_steps": args.steps,
            "seed": 7}
    cpu = args.device == "cpu"
    common = {"device": args.device if cpu else "cuda:0", "progress_interval": 10.0,
              "adaptive_batch": False, "max_batch_size": 1,
              "max_image_pixels": args.size * args.size}
    single = {"num_threads": 1} if cpu else {}
    modes = {"ulysses": ({"ulysses_degree": args.ranks}, base),
             "cfg": ({"cfg_parallel_size": 2}, {**base, **CFG})}
    summary = {}
    for mode in args.modes.split(","):
        degrees, params = modes[mode]
        engines = {"1 rank": AsyncDiffusionEngine(folder, EngineOptions(**common, **single)),
                   f"{mode} x{max(degrees.values())}":
                   AsyncDiffusionEngine(folder, EngineOptions(**common, **degrees))}
        times: dict[str, list[float]] = {k: [] for k in engines}
        comm: dict[str, list[float]] = {k: [] for k in engines}
        cpu: dict[str, list[float]] = {k: [] for k in engines}
        images = {}
        try:
            for engine in engines.values():  # warm-up: first-call costs
                asyncio.run(one_request(engine, -1, {**params, "num_inference_steps": 1}))
            for r in range(args.rounds):
                for name, engine in engines.items():
                    seconds, image, comm_s, cpu_s = asyncio.run(one_request(engine, r, params))
                    times[name].append(seconds)
                    comm[name].append(comm_s / seconds)
                    cpu[name].append(cpu_s)
                    images[name] = image
                    print(f"{mode} round {r}: {name}: {seconds:.2f} s (communication "
                          f"{comm_s:.2f} s, busiest rank's CPU {cpu_s:.2f} s)", flush=True)
        finally:
            for engine in engines.values():
                engine.shutdown()
        one, many = (statistics.median(v) for v in times.values())
        cpu_one, cpu_many = (statistics.median(v) for v in cpu.values())
        a, b = images.values()
        summary[mode] = {
            "seconds_1_rank": round(one, 3),
            f"seconds_{args.ranks if mode == 'ulysses' else 2}_ranks": round(many, 3),
            "speedup": round(one / many, 3),
            "cpu_seconds_1_rank": round(cpu_one, 3),
            "cpu_seconds_busiest_rank": round(cpu_many, 3),
            "cpu_time_speedup": round(cpu_one / cpu_many, 3),
            "communication_share": round(statistics.median(list(comm.values())[1]), 3),
            "max_image_diff": float(np.abs(a - b).max()),
        }
    print(json.dumps({"model": args.model, "size": args.size, "steps": args.steps,
                      "device": args.device, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
