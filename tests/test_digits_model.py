"""The demo's trained image model draws the digit it is asked for (through the engine)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.entrypoints.cli.main import DIGITS_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def nearest_centroid():
    """Classify 8x8 digit images (0..16 ink) by the closest class mean of sklearn's digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    centroids = np.stack([data.images[data.target == d].mean(0) for d in range(10)])
    return lambda img: int(np.argmin(((centroids - img) ** 2).sum((1, 2))))


def to_8x8(image: np.ndarray) -> np.ndarray:
    """A 32x32 RGB image in [0, 1], dark ink on white -> 8x8 ink in sklearn's 0..16 scale."""
    gray = torch.from_numpy(image).float().mean(-1)[None, None]
    return (1 - F.avg_pool2d(gray, 4)[0, 0].numpy()) * 16


def test_digits_are_recognisable():
    classify = nearest_centroid()
    engine = AsyncDiffusionEngine(str(DIGITS_MODEL), EngineOptions(progress_interval=10))

    async def draw(prompt: str, seed: int):
        outs = [o async for o in engine.generate(f"{prompt}-{seed}", prompt, {"seed": seed})]
        return outs[-1].images[0]

    async def all_digits():
        prompts = [(f"a handwritten digit {w}", d, s) for d, w in enumerate(WORDS) for s in (0, 1)]
        images = await asyncio.gather(*[draw(p, s) for p, _, s in prompts])
        return [(d, img) for (_, d, _), img in zip(prompts, images, strict=True)]

    try:
        drawn = asyncio.run(all_digits())
    finally:
        engine.shutdown()
    assert drawn[0][1].shape == (32, 32, 3)
    right = [classify(to_8x8(img)) == d for d, img in drawn]
    # A nearest-centroid classifier gets ~90% of sklearn's own digits right.
    assert sum(right) >= 0.7 * len(right), right
