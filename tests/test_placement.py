"""Placement: per-stage devices and memory budgets, checked before any engine starts."""

from __future__ import annotations

import contextlib

import psutil
import pytest
import torch
from conftest import MAX_MODEL_LEN, pipeline_llm

from vllm_omni.config import parse_pipeline
from vllm_omni.config.placement import (
    GIB,
    PlacementError,
    ar_placement_args,
    check_placement,
    weights_bytes,
)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts a machine without CUDA")


@pytest.fixture(autouse=True)
def no_global_kv_space(monkeypatch):
    # conftest sets it for the other tests; vLLM would let it override stage budgets.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def pipeline(*placements):
    """An LLM stage and a DiT stage with the given placements (None: no placement)."""
    stages = [
        {"name": "llm", "engine": "ar", "output": "text", "final_output": True},
        {"name": "dit", "engine": "diffusion", "output": "image", "final_output": True},
    ]
    for stage, placement in zip(stages, placements, strict=True):
        if placement is not None:
            stage["placement"] = placement
    return parse_pipeline({"name": "placed", "stages": stages}, "test")


def problems(p, model: str) -> str:
    with pytest.raises(PlacementError) as err:
        check_placement(p, model, "cpu")
    return str(err.value)


@no_gpu
def test_devices_this_machine_lacks(tiny_qwen2):
    msg = problems(pipeline({"device": "cuda:0"}, {"device": "cuda:3"}), tiny_qwen2)
    assert "stage 'llm': device cuda:0, but this machine has 0 CUDA device(s)" in msg
    assert "stage 'dit': device cuda:3" in msg  # every problem at once


def test_budgets_must_hold_the_weights_and_fit_the_device(tiny_qwen2):
    weights = weights_bytes(tiny_qwen2)
    assert weights > 0
    msg = problems(pipeline({"memory_gib": weights / GIB / 2}, None), tiny_qwen2)
    assert "stage 'llm': its weights take" in msg and "memory_gib" in msg
    huge = {"device": "cpu", "memory_gib": 1e6}
    msg = problems(pipeline(huge, {"memory_gib": 1.0}), tiny_qwen2)
    assert "cpu: stages ['llm', 'dit'] ask for 1000001.00 GiB together" in msg
    check_placement(pipeline({"memory_gib": 0.5}, {"memory_gib": 0.5}), tiny_qwen2, "cpu")


def test_bad_placement_fields_name_the_stage():
    from vllm_omni.config import PipelineConfigError

    with pytest.raises(PipelineConfigError, match=r"stage 'llm'.*placement.device"):
        pipeline({"device": "tpu"}, None)
    with pytest.raises(PipelineConfigError, match=r"placement.memory_gib"):
        pipeline({"memory_gib": -1}, None)


@no_gpu
def test_nothing_starts_when_placement_cannot_fit(tiny_qwen2, tmp_path):
    yaml = """
name: placed
stages:
  - name: llm
    output: text
    final_output: true
    placement: {device: "cuda:1"}
"""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(PlacementError, match="stage 'llm': device cuda:1"):
        with pipeline_llm(tiny_qwen2, yaml, tmp_path):
            pass
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, "an engine process started although the placement failed"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_budget_becomes_the_stage_kv_cache(tiny_qwen2, tmp_path, monkeypatch):
    yaml = f"""
name: placed
stages:
  - name: llm
    output: text
    final_output: true
    engine_args: {{max_model_len: {MAX_MODEL_LEN}, dtype: float32}}
    placement: {{device: cpu, memory_gib: 0.125}}
"""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    msg = problems(pipeline({"memory_gib": 0.125}, None), tiny_qwen2)
    assert "VLLM_CPU_KVCACHE_SPACE is set" in msg  # vLLM would let it win over the budget
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    stage = pipeline({"memory_gib": 0.125}, None).stage("llm")
    kv_bytes = ar_placement_args(stage, tiny_qwen2)["kv_cache_memory_bytes"]
    assert kv_bytes == int(0.125 * GIB) - weights_bytes(tiny_qwen2)
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(pipeline_llm(tiny_qwen2, yaml, tmp_path))
        config = llm.engine.stages["llm"].engine.vllm_config
        hf = config.model_config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
        blocks = config.cache_config.num_gpu_blocks
        assert blocks == kv_bytes // (per_token * config.cache_config.block_size)
        (out,) = llm.generate(["Hello"], use_tqdm=False)
        assert out.completions
