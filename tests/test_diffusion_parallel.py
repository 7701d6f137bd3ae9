"""Diffusion stages over two ranks (real processes, gloo, one core each) against the
one-process engine: Ulysses and ring sequence parallel (Flux), CFG parallel; bad degrees
refused before anything starts; a rank killed mid-request fails the request naming the
stage and leaves no process behind."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import prometheus_client
import psutil
import pytest
import yaml
from conftest import pipeline_llm
from vllm.usage.usage_lib import UsageContext

from vllm_omni.config.loader import parse_pipeline
from vllm_omni.config.placement import PlacementError
from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions
from vllm_omni.orchestrator.memory import plan_pipeline
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PIPELINE = """
name: parallel-dit
stages:
  - name: dit
    engine: diffusion
    sampling_params: {height: 64, width: 64, num_inference_steps: 4}
    output: image
    final_output: true
"""
CFG = {"negative_prompt": "blurry", "true_cfg_scale": 2.5}
# A batch: several seeds, prompts, step counts, with and without guidance.
# Compared as floats: the engine hands them back only when asked.
FLOATS = {"float_output": True}
REQUESTS = [
    ("a red cat", {"seed": 1, **FLOATS}),
    ("a blue dog on a longer prompt", {"seed": 2, "num_inference_steps": 6, **CFG, **FLOATS}),
    ("green", {"seed": 3, **CFG, **FLOATS}),
    ("a red cat", {"seed": 4, "num_images": 2, **CFG, **FLOATS}),
]
# Thresholds near the tiny model's step-to-step changes: some steps cached, some not, so
# the decision itself (one per request, from the whole sequence) is what is compared.
CACHED = ("a cached cat", {"seed": 5, "num_inference_steps": 8,
                           "cache": {"method": "teacache", "threshold": 0.1,
                                     "warmup_steps": 1}, **CFG, **FLOATS})


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return make_tiny("flux-tiny", tmp_path_factory.mktemp("dit") / "flux-tiny")


@pytest.fixture(scope="module")
def reference(flux):
    """The one-process engine's images for REQUESTS (batched together) and CACHED."""
    async def run(engine, rid, prompt, params):
        outs = [out async for out in engine.generate(
            rid, prompt, {"height": 64, "width": 64, "num_inference_steps": 4, **params})]
        return outs[-1].float_images, outs[-1].cache

    async def everything(engine):
        batch = await asyncio.gather(*(run(engine, f"r{i}", p, kw)
                                       for i, (p, kw) in enumerate(REQUESTS)))
        return batch, await run(engine, "cached", *CACHED)

    engine = AsyncDiffusionEngine(str(flux), EngineOptions(progress_interval=0))
    try:
        return asyncio.run(everything(engine))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=[{"ulysses_degree": 2}, {"ring_degree": 2},
                                        {"cfg_parallel_size": 2}], ids=str)
def parallel(request, flux, tmp_path_factory):
    with pipeline_llm(str(flux), PIPELINE, tmp_path_factory.mktemp("pipeline"),
                      diffusion_parallel=request.param, stage_restarts=0) as llm:
        yield llm


def generate_together(llm, requests):
    """Each request in its own thread, so the engine batches them."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(llm.generate, prompt, [params], use_tqdm=False)
                   for prompt, params in requests]
        return [f.result()[0] for f in futures]


def stage_processes(llm) -> tuple[psutil.Process, list[psutil.Process]]:
    core = psutil.Process(llm.engine.stages["dit"].engine.pid)
    return core, core.children()


def test_ranks_are_processes_of_their_own(parallel):
    _, ranks = stage_processes(parallel)
    assert [p.name() for p in ranks] == ["vllm-omni::DiffusionRank1"]


def test_a_batch_equals_the_one_process_engine(parallel, reference):
    outs = generate_together(parallel, REQUESTS)
    for out, (want, _) in zip(outs, reference[0], strict=True):
        np.testing.assert_allclose(out.tensors["images"].numpy(), want, atol=1e-4, rtol=0)


def test_a_cached_run_equals_the_one_process_engine(parallel, reference):
    want, want_cache = reference[1]
    out = parallel.generate(CACHED[0], [CACHED[1]], use_tqdm=False)[0]
    # Cached steps, and more computed ones than the guards (warm-up, at most 3 in a row)
    # force: the signal decided.
    assert want_cache["cached_steps"] > 0 and want_cache["computed_steps"] > 4
    assert out.metrics["cache"] == want_cache  # the same decisions, every branch counted
    np.testing.assert_allclose(out.tensors["images"].numpy(), want, atol=1e-4, rtol=0)


def test_a_killed_rank_fails_the_request_naming_the_stage(parallel):
    """Last test on each engine: it takes the stage down."""
    core, ranks = stage_processes(parallel)
    result: dict = {}

    def long_request():
        try:
            parallel.generate("a long one", [{"seed": 1, "num_inference_steps": 1000,
                                                "height": 64, "width": 64}],
                              use_tqdm=False)
        except Exception as e:
            result["error"] = e

    def steps_done() -> float:  # the stage counts the steps its engine reports, here
        return prometheus_client.REGISTRY.get_sample_value(
            "vllm_omni:diffusion_steps_total", {"stage": "dit"}) or 0.0

    before = steps_done()
    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 60
    while steps_done() < before + 2:  # into its steps
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.05)
    killed_at = time.monotonic()
    ranks[0].kill()
    thread.join(30)
    assert not thread.is_alive()
    assert time.monotonic() - killed_at < 10
    assert "stage 'dit'" in str(result["error"])
    assert "pixels" not in str(result["error"])  # it failed for the rank, not its size
    gone, alive = psutil.wait_procs([core, *ranks], timeout=10)
    assert not alive


def plan(flux_or_other, parallel: dict):
    pipeline = parse_pipeline(yaml.safe_load(PIPELINE), "test")
    return plan_pipeline(pipeline, str(flux_or_other), {}, UsageContext.LLM_CLASS,
                         ar_device_type="cpu", diffusion_parallel=parallel)


def test_bad_degrees_are_refused_before_anything_starts(flux, tmp_path_factory):
    with pytest.raises(PlacementError) as e:
        plan(flux, {"ulysses_degree": 4})
    message = str(e.value)
    assert "stage 'dit': ulysses_degree 4 does not divide the model's 2 attention heads" \
        in message
    assert "needs 4 cores, one per rank" in message
    sd3 = make_tiny("sd3-tiny", tmp_path_factory.mktemp("sd3") / "sd3-tiny")
    with pytest.raises(PlacementError, match="stage 'dit': ring_degree 2: "
                       "StableDiffusion3Pipeline has no sequence-parallel support"):
        plan(sd3, {"ring_degree": 2})
    assert plan(sd3, {"cfg_parallel_size": 2}).stages  # SD3: CFG parallel is fine


def test_degrees_compose_into_one_grid_of_ranks():
    """cfg x ring x ulysses ranks: each rank in one Ulysses group (a row) and one ring
    group (a column) inside its guidance group; every rank exactly once."""
    from vllm_omni.engine.diffusion.parallel.layout import Layout

    lay = Layout(ulysses=2, ring=3, cfg=2)
    assert lay.world == 12 and lay.sequence == 6
    assert [lay.coords(r) for r in (0, 1, 2, 7, 11)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 2, 1)]
    assert lay.ulysses_ranks(1, 2) == [10, 11] and lay.ring_ranks(1, 1) == [7, 9, 11]
    rows = [r for c in range(2) for i in range(3) for r in lay.ulysses_ranks(c, i)]
    assert sorted(rows) == list(range(12))
    with pytest.raises(ValueError, match="cfg_parallel_size is 1 or 2"):
        EngineOptions(cfg_parallel_size=3)
    with pytest.raises(ValueError, match="ulysses_degree must be a positive integer"):
        EngineOptions(ulysses_degree=0)
