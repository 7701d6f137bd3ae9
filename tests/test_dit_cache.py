"""Step caching in the diffusion engine: per-request state under step-level batching.

Real engine-core processes on the factory's tiny pipelines; the uncached engine is the
reference (it equals diffusers, see test_diffusion_engine.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.engine.diffusion.cache import CacheConfig, CacheSlot
from vllm_omni.engine.runtime import EngineStartError
from vllm_omni.testing.tiny_models import make_tiny

SIZE = {"height": 64, "width": 64}
# Thresholds so high that only the guards decide: the pattern of steps is known in advance.
ALWAYS = {"threshold": 1e9, "warmup_steps": 1, "max_consecutive": 2}


async def run(engine, rid: str, prompt: str, **params):
    outs = [out async for out in engine.generate(rid, prompt,
                                                 {**SIZE, "float_output": True, **params})]
    return outs[-1].float_images, outs[-1].cache


def run_sync(coro):
    return asyncio.run(coro)


# -- the slot's decisions, without an engine ----------------------------------------------


def decisions(config: CacheConfig, signals: list[float]) -> list[bool]:
    slot = CacheSlot(config)
    out = []
    for i, s in enumerate(signals):
        reuse = slot.decide(torch.full((4,), s))
        if not reuse:
            slot.store(float(i), torch.zeros(4), None)
        out.append(reuse)
    return out


def test_guards_bound_what_is_cached():
    c = CacheConfig(method="block", **ALWAYS)
    # First step: nothing cached yet; then reuse at most twice in a row.
    assert decisions(c, [1.0] * 8) == [False, True, True, False, True, True, False, True]
    c = CacheConfig(method="block", threshold=1e9, warmup_steps=3, max_consecutive=9,
                    max_cached=2)
    assert decisions(c, [1.0] * 7) == [False, False, False, True, True, False, False]


def test_block_compares_with_the_last_computed_step():
    c = CacheConfig(method="block", threshold=0.15, warmup_steps=0, max_consecutive=9)
    # Drift of 0.1 per step: reused while within 15% of the step last computed.
    assert decisions(c, [1.0, 1.1, 1.2, 1.3, 1.4]) == [False, True, False, True, False]


def test_teacache_accumulates_rescaled_changes():
    c = CacheConfig(method="teacache", threshold=0.25, warmup_steps=0, max_consecutive=9)
    # Changes of 10% accumulate: 0.1, 0.2, 0.3 -> computed, and the sum restarts.
    got = decisions(c, [1.0, 1.1, 1.21, 1.331, 1.4641, 1.61051])
    assert got == [False, True, True, False, True, True]
    doubled = c.model_copy(update={"coefficients": [2.0, 0.0]})  # 2x: fewer reuses
    assert decisions(doubled, [1.0, 1.1, 1.21, 1.331]) == [False, True, False, True]


def test_taylor_forecasts_from_the_last_two_computed_steps():
    slot = CacheSlot(CacheConfig(method="block", taylor=True))
    slot.store(900.0, torch.tensor([1.0]), torch.tensor([10.0]))
    slot.store(800.0, torch.tensor([2.0]), torch.tensor([20.0]))
    hidden, encoder = slot.residual(700.0)
    assert hidden.item() == pytest.approx(3.0) and encoder.item() == pytest.approx(30.0)
    plain = CacheSlot(CacheConfig(method="block"))
    plain.store(900.0, torch.tensor([1.0]), None)
    plain.store(800.0, torch.tensor([2.0]), None)
    assert plain.residual(700.0)[0].item() == 2.0


def test_config_is_validated():
    from vllm_omni.engine.diffusion.params import DiffusionParams

    for bad, words in [
        ({"method": "fast"}, "cache.method"),
        ({"method": "block", "threshold": -1}, "cache.threshold"),
        ({"method": "block", "coefficients": [1.0]}, "coefficients"),
        ({"method": "block", "colour": 1}, "cache.colour"),
    ]:
        with pytest.raises(ValueError, match=words):
            DiffusionParams.parse({"cache": bad})
    # A request's fields go over the server's, one by one; None turns caching off.
    server = {"cache": {"method": "teacache", "threshold": 0.3}}
    merged = DiffusionParams.parse({"cache": {"threshold": 0.1}}).merged(server)
    assert (merged.cache.method, merged.cache.threshold) == ("teacache", 0.1)
    assert not DiffusionParams.parse({"cache": None}).merged(server).cache.enabled


def test_server_flags():
    from argparse import Namespace

    from vllm_omni.entrypoints.cli.main import cache_config

    def flags(backend, config):
        return cache_config(Namespace(cache_backend=backend, cache_config=config))

    assert flags(None, None) is None
    assert flags("block", '{"threshold": 0.2}') == {"method": "block", "threshold": 0.2}
    for backend, config, words in [
        (None, '{"threshold": 0.2}', "needs --cache-backend"),
        ("block", "{threshold", "not valid JSON"),
        ("teacache", '{"warmup_steps": -1}', "warmup_steps"),
    ]:
        with pytest.raises(SystemExit, match=words):
            flags(backend, config)


# -- in the engine --------------------------------------------------------------------------

# A second (unconditional) branch for each family.
CFG = {
    "flux-tiny": {"negative_prompt": "blurry", "true_cfg_scale": 2.5},
    "sd3-tiny": {"negative_prompt": "blurry", "guidance_scale": 5.0},
    "qwen-image-tiny": {"negative_prompt": "a longer negative prompt", "true_cfg_scale": 3.0},
}


@pytest.fixture(scope="module", params=list(CFG))
def family(request, tmp_path_factory):
    folder = make_tiny(request.param, tmp_path_factory.mktemp("cache") / request.param)
    engine = AsyncDiffusionEngine(str(folder), EngineOptions(progress_interval=10))
    yield request.param, engine
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["teacache", "block"])
def test_threshold_zero_is_bitwise_uncached(family, method):
    name, engine = family
    for extra in ({}, CFG[name]):
        params = {"seed": 4, "num_inference_steps": 5, **extra}
        want, stats = run_sync(run(engine, "plain", "a red cat", **params))
        assert stats is None
        cache = {"method": method, "threshold": 0.0, "warmup_steps": 0}
        got, stats = run_sync(run(engine, "zero", "a red cat", cache=cache, **params))
        assert np.array_equal(got, want)
        # SD3 guides with a second branch by default (guidance_scale 7).
        branches = 2 if extra or name == "sd3-tiny" else 1
        assert stats == {"method": method, "computed_steps": 5 * branches, "cached_steps": 0}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_settings_in_one_batch(family):
    """Requests with other cache settings (or none) denoised together each behave as alone;
    guidance branches keep their own state."""
    name, engine = family
    steps = 7
    requests = [
        ("a", "a red cat", {"cache": {"method": "teacache", **ALWAYS}}),
        ("b", "a blue dog", {}),
        ("c", "green", {"cache": {"method": "block", "last_blocks": 0, **ALWAYS}}),
        ("d", "a red cat", {"cache": {"method": "teacache", "threshold": 0.2}}),
    ]

    async def together():
        return await asyncio.gather(*[
            run(engine, rid, p, seed=i, num_inference_steps=steps, **kw)
            for i, (rid, p, kw) in enumerate(requests)
        ])

    batched = run_sync(together())
    rows = 2 if name == "sd3-tiny" else 1  # SD3 guides with a second branch by default
    for i, ((rid, prompt, kw), (image, stats)) in enumerate(zip(requests, batched, strict=True)):
        alone, alone_stats = run_sync(run(engine, rid + "-alone", prompt, seed=i,
                                          num_inference_steps=steps, **kw))
        assert stats == alone_stats, rid
        np.testing.assert_allclose(image, alone, atol=1e-4, rtol=0, err_msg=rid)
    # The guards alone decide a and c: computed at steps 0, 3, 6, reused at the other four.
    assert batched[0][1] == {"method": "teacache", "computed_steps": 3 * rows,
                             "cached_steps": 4 * rows}
    assert batched[2][1] == {"method": "block", "computed_steps": 3 * rows,
                             "cached_steps": 4 * rows}
    assert batched[1][1] is None
    # Reused steps change the image (they are not silently computed).
    plain, _ = run_sync(run(engine, "a-plain", "a red cat", seed=0, num_inference_steps=steps))
    assert not np.allclose(batched[0][0], plain, atol=1e-4)

    cfg = {"seed": 9, "num_inference_steps": steps, **CFG[name], "num_images": 2}
    _, stats = run_sync(run(engine, "cfg", "x", cache={"method": "block", **ALWAYS}, **cfg))
    assert stats["computed_steps"] + stats["cached_steps"] == steps * 2 * 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cached_steps_are_deterministic_for_a_seed(family):
    name, engine = family
    cache = {"method": "teacache", "threshold": 0.5, "warmup_steps": 1, "max_consecutive": 4}
    runs = [run_sync(run(engine, f"r{i}", "a red cat", seed=3, num_inference_steps=12,
                         cache=cache)) for i in range(2)]
    assert runs[0][1] == runs[1][1]
    rows = 2 if name == "sd3-tiny" else 1
    assert runs[0][1]["computed_steps"] + runs[0][1]["cached_steps"] == 12 * rows
    np.testing.assert_array_equal(runs[0][0], runs[1][0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_cache_settings_for_the_model(family):
    name, engine = family
    with pytest.raises(ValueError, match="leave no block to skip"):
        run_sync(run(engine, "bad", "x", cache={"method": "block", "first_blocks": 99}))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_that_cannot_be_cached_says_so(tmp_path):
    folder = make_tiny("sd3-img2img-tiny", tmp_path / "i2i")
    engine = AsyncDiffusionEngine(str(folder))
    try:
        with pytest.raises(ValueError, match="cannot be cached"):
            run_sync(run(engine, "c", "x", cache={"method": "teacache"}))
    finally:
        engine.shutdown()
    with pytest.raises(EngineStartError, match="cannot be cached"):
        AsyncDiffusionEngine(str(folder), EngineOptions(defaults={"cache": {"method": "block"}}))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reuse_across_batches_of_other_text_lengths(tmp_path):
    """Qwen-Image pads a batch's texts to its longest: a request that stored its residual in a
    batch of one text length reuses it in a batch of another, and keeps its own image."""
    from diffusers import DiffusionPipeline

    from vllm_omni.engine.diffusion.adapters import adapter_for
    from vllm_omni.engine.diffusion.params import DiffusionParams
    from vllm_omni.engine.diffusion.request import DiffusionRequest

    pipe = DiffusionPipeline.from_pretrained(make_tiny("qwen-image-tiny", tmp_path / "q"))
    adapter = adapter_for(pipe, "cpu")
    cache = {"method": "block", **ALWAYS}

    def request(rid: str, prompt: str, seed: int) -> DiffusionRequest:
        params = DiffusionParams.parse({**SIZE, "seed": seed, "num_inference_steps": 4,
                                        "cache": cache})
        return DiffusionRequest(rid, prompt, adapter.resolve(params))

    def run(joiner: bool) -> np.ndarray:
        short = request("short", "a cat", 1)
        with torch.inference_mode():
            adapter.encode([short])
            adapter.prepare(short)
            adapter.denoise([short])  # step 0 computed alone, at the short text's length
            batch = [short]
            if joiner:
                long = request("long", "a much longer prompt about a cat on a mat", 2)
                adapter.encode([long])
                adapter.prepare(long)
                batch.append(long)
            while not short.denoised:
                adapter.denoise([r for r in batch if not r.denoised])
            adapter.decode([short])
        assert short.cache_stats()["cached_steps"] == 2
        return short.images[0]

    np.testing.assert_allclose(run(joiner=True), run(joiner=False), atol=1e-4, rtol=0)
