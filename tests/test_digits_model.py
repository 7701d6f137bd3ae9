"""The demo's trained image model draws the digit it is asked for (through the engine)."""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.digits import DIGITS_MODEL, WORDS, digit_classifier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_digits_are_recognisable():
    classify = digit_classifier()
    engine = AsyncDiffusionEngine(str(DIGITS_MODEL), EngineOptions(progress_interval=10))

    async def draw(prompt: str, seed: int):
        outs = [o async for o in engine.generate(f"{prompt}-{seed}", prompt, {"seed": seed})]
        return outs[-1].images[0] / 255  # 8-bit pixels; the classifier reads [0, 1]

    async def all_digits():
        prompts = [(f"a handwritten digit {w}", d, s) for d, w in enumerate(WORDS) for s in (0, 1)]
        images = await asyncio.gather(*[draw(p, s) for p, _, s in prompts])
        return [(d, img) for (_, d, _), img in zip(prompts, images, strict=True)]

    try:
        drawn = asyncio.run(all_digits())
    finally:
        engine.shutdown()
    assert drawn[0][1].shape == (32, 32, 3)
    right = [classify(img) == d for d, img in drawn]
    # A nearest-centroid classifier gets ~90% of sklearn's own digits right.
    assert sum(right) >= 0.7 * len(right), right
