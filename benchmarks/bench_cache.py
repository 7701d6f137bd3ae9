"""Step caching on the trained digits model: speed-up against image quality, side by side.

For each cache setting, the same requests (prompt "a handwritten digit <word>", one seed
each) run through the diffusion engine at a given concurrency (closed loop); speed-up is
the uncached engine's wall time over the cached one's (medians over rounds that alternate
the settings), quality is PSNR / SSIM of each image against its uncached image. At
concurrency 1 the same is measured for diffusers' own FirstBlockCache on the pipeline called
once per request, against that pipeline uncached.

    python benchmarks/bench_cache.py --concurrency 1 8 --requests 16 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_omni.testing.digits import DIGITS_MODEL, WORDS, digit_classifier  # noqa: E402

SETTINGS: dict[str, dict | None] = {
    "uncached": None,
    "teacache 0.2": {"method": "teacache", "threshold": 0.2},
    "teacache 0.4": {"method": "teacache", "threshold": 0.4},
    "teacache 0.6": {"method": "teacache", "threshold": 0.6},
    "teacache 0.6 taylor": {"method": "teacache", "threshold": 0.6, "taylor": True},
    "block 0.05": {"method": "block", "threshold": 0.05},
    "block 0.1": {"method": "block", "threshold": 0.1},
    "block 0.2": {"method": "block", "threshold": 0.2},
    "block 0.2 taylor": {"method": "block", "threshold": 0.2, "taylor": True},
    "dual-block 0.2 (F1 B1)": {"method": "block", "threshold": 0.2, "last_blocks": 1},
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5) of HWC images in [0, 1]."""
    x = torch.from_numpy(a).double().permute(2, 0, 1)[:, None]
    y = torch.from_numpy(b).double().permute(2, 0, 1)[:, None]
    g = torch.exp(-((torch.arange(11) - 5.0) ** 2) / (2 * 1.5**2)).double()
    w = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]
    mu_x, mu_y = F.conv2d(x, w, padding=5), F.conv2d(y, w, padding=5)
    var_x = F.conv2d(x * x, w, padding=5) - mu_x**2
    var_y = F.conv2d(y * y, w, padding=5) - mu_y**2
    cov = F.conv2d(x * y, w, padding=5) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    return float((num / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))).mean())


def requests(n: int) -> list[tuple[str, int]]:
    return [(f"a handwritten digit {WORDS[i % 10]}", 1000 + i) for i in range(n)]


async def closed_loop(engine, reqs, cache, concurrency: int, steps: int):
    queue = list(enumerate(reqs))
    images: list = [None] * len(reqs)
    stats: list = [None] * len(reqs)

    async def worker():
        while queue:
            i, (prompt, seed) = queue.pop(0)
            params = {"seed": seed, "num_inference_steps": steps, "float_output": True}
            if cache:
                params["cache"] = cache
            outs = [o async for o in engine.generate(f"q{i}-{time.monotonic_ns()}", prompt, params)]
            images[i], stats[i] = outs[-1].float_images[0], outs[-1].cache

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - start, images, stats


def engine_side(model: str, args) -> list[dict]:
    from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions

    engine = AsyncDiffusionEngine(model, EngineOptions(num_threads=args.threads))
    rows = []
    try:
        reqs = requests(args.requests)
        for c in args.concurrency:
            times = {name: [] for name in SETTINGS}
            images, stats = {}, {}
            asyncio.run(closed_loop(engine, reqs[:2], None, c, args.steps))  # warm-up
            for _ in range(args.rounds):
                for name, cache in SETTINGS.items():
                    t, images[name], stats[name] = asyncio.run(
                        closed_loop(engine, reqs, cache, c, args.steps)
                    )
                    times[name].append(t)
            base = statistics.median(times["uncached"])
            for name in SETTINGS:
                rows.append(quality_row(f"engine c={c}", name, base, times[name],
                                        images["uncached"], images[name], stats[name],
                                        len(reqs)))
    finally:
        engine.shutdown()
    return rows


def diffusers_side(model: str, args) -> list[dict]:
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig

    torch.set_num_threads(args.threads)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reqs = requests(args.requests)
    size = pipe.vae.config.sample_size
    settings = {"uncached": None}
    settings.update({f"FirstBlockCache {t}": ("diffusers", t) for t in (0.05, 0.1, 0.2)})
    # cache-dit (optional: pip install cache-dit) gets a pipeline of its own per setting:
    # its hooks and diffusers' do not mix on one pipeline.
    cache_dit_pipes = {}
    try:
        import cache_dit

        for t in (0.1, 0.2):
            own = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
            own.set_progress_bar_config(disable=True)
            cache_dit.enable_cache(own, cache_config=cache_dit.DBCacheConfig(
                Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=t,
                max_warmup_steps=2, max_continuous_cached_steps=3))  # the engine's guards
            cache_dit_pipes[t] = own
            settings[f"cache-dit DBCache F1B0 {t}"] = ("cache-dit", t)
    except ImportError:
        pass

    def run_all(setting):
        kind, threshold = setting or (None, None)
        target = cache_dit_pipes[threshold] if kind == "cache-dit" else pipe
        if kind == "diffusers":
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        start, images = time.perf_counter(), []
        for prompt, seed in reqs:
            images.append(target(prompt, height=size, width=size,
                                 num_inference_steps=args.steps,
                                 max_sequence_length=pipe.tokenizer_2.model_max_length,
                                 generator=torch.Generator().manual_seed(seed),
                                 output_type="np").images[0])
        if kind == "diffusers":
            pipe.transformer.disable_cache()
        return time.perf_counter() - start, images

    times = {name: [] for name in settings}
    images = {}
    with torch.inference_mode():
        run_all(None)  # warm-up
        for _ in range(args.rounds):
            for name, setting in settings.items():
                t, images[name] = run_all(setting)
                times[name].append(t)
    base = statistics.median(times["uncached"])
    return [quality_row("diffusers c=1", name, base, times[name], images["uncached"],
                        images[name], None, len(reqs)) for name in settings]


def quality_row(side, name, base, times, ref, got, stats, n) -> dict:
    t = statistics.median(times)
    classify = digit_classifier()
    right = [classify(img) == i % 10 for i, img in enumerate(got)]
    psnrs = [psnr(a, b) for a, b in zip(ref, got, strict=True)]
    finite = [p for p in psnrs if np.isfinite(p)]
    cached = None
    if stats and stats[0]:
        done = sum(s["cached_steps"] for s in stats)
        cached = done / sum(s["cached_steps"] + s["computed_steps"] for s in stats)
    return {
        "side": side,
        "setting": name,
        "images/s": n / t,
        "speed-up": base / t,
        "psnr_mean": statistics.mean(finite) if finite else float("inf"),
        "psnr_min": min(psnrs),
        "ssim_mean": statistics.mean(ssim(a, b) for a, b in zip(ref, got, strict=True)),
        "cached": cached,
        "digits_right": sum(right) / len(right),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DIGITS_MODEL))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-diffusers", action="store_true")
    args = ap.parse_args()
    rows = engine_side(args.model, args)
    print_rows(rows)
    if not args.skip_diffusers:
        print_rows(diffusers_side(args.model, args))


def print_rows(rows: list[dict]) -> None:
    print("| side | setting | images/s | speed-up | PSNR mean (min) dB | SSIM | steps cached "
          "| digit right |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cached = "-" if r["cached"] is None else f"{r['cached']:.0%}"
        print(f"| {r['side']} | {r['setting']} | {r['images/s']:.2f} | {r['speed-up']:.2f}x | "
              f"{r['psnr_mean']:.1f} ({r['psnr_min']:.1f}) | {r['ssim_mean']:.4f} | {cached} | "
              f"{r['digits_right']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
