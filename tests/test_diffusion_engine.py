"""The diffusion engine against plain diffusers, on tiny pipelines built by the factory.

Each family runs in a real engine-core process; references run `pipeline(...)` here."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest
import torch

from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZE = {"height": 64, "width": 64}


def reference(pipe, prompt: str, seed: int, **kw) -> np.ndarray:
    kw = {**SIZE, **kw}
    n = kw.pop("num_images", 1)
    gen = torch.Generator().manual_seed(seed)
    return pipe(prompt, generator=gen, num_images_per_prompt=n, output_type="np", **kw).images


async def run(engine, rid: str, prompt: str, images=None, **params):
    steps = []
    async for out in engine.generate(rid, prompt, {**SIZE, "float_output": True, **params},
                                     images):
        steps.append(out.step)
    return out.float_images, steps


def run_sync(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", params=["flux-tiny", "sd3-tiny", "qwen-image-tiny"])
def family(request, tmp_path_factory):
    from diffusers import DiffusionPipeline

    folder = make_tiny(request.param, tmp_path_factory.mktemp("dit") / request.param)
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    engine = AsyncDiffusionEngine(str(folder), EngineOptions(max_batch_size=8, progress_interval=0))
    yield request.param, pipe, engine
    engine.shutdown()


# Guidance settings that exercise each family's second (unconditional) branch.
CFG = {
    "flux-tiny": {"negative_prompt": "blurry", "true_cfg_scale": 2.5},
    "sd3-tiny": {"negative_prompt": "blurry", "guidance_scale": 5.0},
    "qwen-image-tiny": {"negative_prompt": "a much longer negative prompt", "true_cfg_scale": 3.0},
}


def test_alone_equals_diffusers(family):
    name, pipe, engine = family
    got, steps = run_sync(run(engine, "alone", "a red cat", seed=11, num_inference_steps=4))
    assert steps == [1, 2, 3, 4]
    want = reference(pipe, "a red cat", 11, num_inference_steps=4)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_batched_equals_diffusers(family):
    """Requests of other prompts, seeds, step counts, image counts and guidance modes run
    together; each image equals its own diffusers run."""
    name, pipe, engine = family
    requests = [
        ("a red cat", 1, {"num_inference_steps": 4}),
        ("a blue dog on a much longer prompt", 2, {"num_inference_steps": 6, "num_images": 2}),
        ("green", 3, {"num_inference_steps": 5, **CFG[name]}),
        ("a red cat", 4, {"num_inference_steps": 4, **CFG[name]}),
        ("yellow", 5, {"num_inference_steps": 3, "height": 32, "width": 96}),
    ]

    async def all_at_once():
        return await asyncio.gather(
            *[run(engine, f"b{i}", p, seed=s, **kw) for i, (p, s, kw) in enumerate(requests)]
        )

    results = run_sync(all_at_once())
    for (prompt, seed, kw), (got, _) in zip(requests, results, strict=True):
        want = reference(pipe, prompt, seed, **kw)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"{prompt} {kw}")


def test_request_joins_running_batch(family):
    """A request that arrives mid-run starts at once (no waiting for the batch to finish)
    and still gets its own image."""
    name, pipe, engine = family

    async def scenario():
        order = []

        async def track(rid, prompt, seed, steps):
            async for out in engine.generate(rid, prompt, {**SIZE, "seed": seed,
                                                           "num_inference_steps": steps,
                                                           "float_output": True}):
                order.append((rid, out.step))
            return out.float_images

        long = asyncio.create_task(track("long", "a long one", 7, 40))
        while not any(rid == "long" and step >= 5 for rid, step in order):
            await asyncio.sleep(0.005)
        short = await track("short", "a short one", 8, 3)
        long_steps_when_short_done = max(s for rid, s in order if rid == "long")
        return short, await long, long_steps_when_short_done

    short, long, long_progress = run_sync(scenario())
    assert long_progress < 40, "the short request waited for the long one to finish"
    np.testing.assert_allclose(short, reference(pipe, "a short one", 8, num_inference_steps=3),
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(long, reference(pipe, "a long one", 7, num_inference_steps=40),
                               atol=1e-4, rtol=0)


def test_bad_parameters_are_value_errors(family):
    name, pipe, engine = family
    side = engine.info["defaults"]["height"]
    for params, words in [
        ({"height": 60}, "multiple of"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"true_cfg_scale": 3.0}, "negative_prompt"),
        ({"colour": "red"}, "colour"),
        # The memory plan holds a batch at the default size: one image past it is refused.
        ({"height": 3 * side, "width": 3 * side}, "max_image_pixels"),
    ]:
        with pytest.raises(ValueError, match=words):
            run_sync(run(engine, "bad", "x", **params))
    with pytest.raises(ValueError, match="no input image"):
        run_sync(run(engine, "bad", "x", images=[np.zeros((8, 8, 3), np.uint8)]))


def test_abort_between_steps_frees_the_slot(tmp_path):
    """With room for one running request, an aborted long request must give its slot to the
    next one, and the engine must stop computing it."""
    folder = make_tiny("flux-tiny", tmp_path / "flux")
    engine = AsyncDiffusionEngine(str(folder), EngineOptions(max_running=1, progress_interval=0))
    try:
        core = psutil.Process(engine._proc.pid)

        async def scenario():
            seen = asyncio.Event()

            async def long():
                params = {**SIZE, "num_inference_steps": 1000}
                async for out in engine.generate("long", "x", params):
                    if out.step >= 3:
                        seen.set()

            task = asyncio.create_task(long())
            await asyncio.wait({task, asyncio.create_task(seen.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            assert seen.is_set(), task.exception()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return await run(engine, "next", "y", seed=1, num_inference_steps=3)

        _, steps = run_sync(scenario())
        assert steps == [1, 2, 3]
        before = sum(core.cpu_times()[:2])
        time.sleep(1.0)
        assert sum(core.cpu_times()[:2]) - before < 0.3, "the engine kept working after abort"
    finally:
        engine.shutdown()


def test_whole_request_fallback_equals_diffusers(tmp_path):
    """A pipeline without a step adapter (SD3 image-to-image) runs whole requests, batched
    when settings match, each equal to its own diffusers run."""
    from diffusers import DiffusionPipeline

    folder = make_tiny("sd3-img2img-tiny", tmp_path / "i2i")
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    engine = AsyncDiffusionEngine(str(folder))
    assert engine.info["step_level"] is False
    try:
        rng = np.random.default_rng(0)
        from PIL import Image

        image = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
        got, _ = run_sync(run(engine, "e", "make it red", images=[image], seed=3,
                              num_inference_steps=4, strength=0.7))
        gen = torch.Generator().manual_seed(3)
        want = pipe("make it red", image=image, generator=gen, num_inference_steps=4,
                    strength=0.7, output_type="np", **SIZE).images
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        with pytest.raises(ValueError, match="does not take"):
            run_sync(run(engine, "bad", "x", true_cfg_scale=2.0, negative_prompt="n"))
    finally:
        engine.shutdown()


def test_engine_start_failure_is_reported(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "NoSuchPipeline"}')
    from vllm_omni.engine.runtime import EngineStartError

    with pytest.raises(EngineStartError, match="NoSuchPipeline|failed"):
        AsyncDiffusionEngine(str(tmp_path))


def test_latent_output_goes_through_shared_memory(family):
    from vllm_omni.transfer.connectors import SharedMemoryConnector

    name, pipe, engine = family

    async def last():
        params = {**SIZE, "seed": 3, "num_inference_steps": 3, "output": "latent"}
        outs = [out async for out in engine.generate("lat", "a red cat", params)]
        return outs[-1]

    out = run_sync(last())
    assert out.images is None
    got = SharedMemoryConnector().get(out.handle)["latents"]
    want = pipe("a red cat", generator=torch.Generator().manual_seed(3), num_inference_steps=3,
                output_type="latent", **SIZE).images
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
