"""Placement and the memory plan: devices and budgets, checked before any engine starts."""

from __future__ import annotations

import contextlib

import psutil
import pytest
import torch
from conftest import MAX_MODEL_LEN, pipeline_llm
from vllm.usage.usage_lib import UsageContext

from vllm_omni.config import parse_pipeline
from vllm_omni.config.placement import GIB, PlacementError
from vllm_omni.engine.memory import weights_bytes
from vllm_omni.orchestrator.memory import device_memory, plan_pipeline

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts a machine without CUDA")


@pytest.fixture(autouse=True)
def no_global_kv_space(monkeypatch):
    # vLLM would let it override stage budgets; a user's shell may have it.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def pipeline(*placements, dit_args=None):
    """An LLM stage and a DiT stage with the given placements (None: no placement)."""
    stages = [
        {"name": "llm", "engine": "ar", "output": "text", "final_output": True},
        {"name": "dit", "engine": "diffusion", "output": "image", "final_output": True,
         "model": None, "engine_args": dit_args or {}},
    ]
    for stage, placement in zip(stages, placements, strict=True):
        if placement is not None:
            stage["placement"] = placement
    return parse_pipeline({"name": "placed", "stages": stages}, "test")


def plan(p, model: str, **engine_kwargs):
    kwargs = {"max_model_len": MAX_MODEL_LEN, **engine_kwargs}
    return plan_pipeline(p, model, kwargs, UsageContext.LLM_CLASS, ar_device_type="cpu")


def problems(p, model: str, **engine_kwargs) -> str:
    with pytest.raises(PlacementError) as err:
        plan(p, model, **engine_kwargs)
    return str(err.value)


@pytest.fixture(scope="module")
def digits_and_llm(tiny_qwen2):
    """The tiny LLM's folder, and a pipeline factory whose DiT is the digits model."""
    from vllm_omni.testing.digits import DIGITS_MODEL

    def make(*placements, dit_args=None):
        p = pipeline(*placements, dit_args=dit_args)
        p.stage("dit").model = str(DIGITS_MODEL)
        return p

    return tiny_qwen2, make


@no_gpu
def test_devices_this_machine_lacks(digits_and_llm):
    model, make = digits_and_llm
    msg = problems(make({"device": "cuda:0"}, {"device": "cuda:3"}), model)
    assert "stage 'llm': device cuda:0, but this machine has 0 CUDA device(s)" in msg
    assert "stage 'dit': device cuda:3" in msg  # every problem at once


def test_offload_is_refused_on_cpu(digits_and_llm):
    model, make = digits_and_llm
    msg = problems(make(None, None, dit_args={"offload": "model"}), model)
    assert "stage 'dit': offload 'model' moves weights between a GPU and the CPU" in msg
    from vllm_omni.engine.diffusion.core import EngineOptions

    with pytest.raises(ValueError, match="offload must be one of"):
        EngineOptions(offload="disk", device="cuda:0")


def test_budgets_must_hold_the_weights_and_fit_the_device(digits_and_llm):
    model, make = digits_and_llm
    weights = weights_bytes(model)
    assert weights > 0
    msg = problems(make({"memory_gib": weights / GIB / 2}, {"memory_gib": 1e-4}), model)
    assert "stage 'llm': its weights take" in msg and "memory_gib" in msg
    assert "stage 'dit': its weights take" in msg  # both named at once
    huge = {"device": "cpu", "memory_gib": 1e6}
    msg = problems(make(huge, {"memory_gib": 1.0}), model)
    assert "cpu: stages need at least" in msg and "llm 1000001" in msg and "dit 1.6" in msg
    ok = plan(make({"memory_gib": 0.5}, {"memory_gib": 0.5}), model)
    llm = ok.stage("llm")
    assert llm.source == "placement.memory_gib"
    assert llm.weights + llm.kv_cache + llm.activations == int(0.5 * GIB)
    assert llm.engine_args == {"kv_cache_memory_bytes": llm.kv_cache}


def test_a_budget_too_small_for_one_sequence_is_named(digits_and_llm):
    model, make = digits_and_llm
    small = plan(make(None, None), model).stage("llm")
    # Room for the weights and activations, not for one max_model_len sequence of KV.
    memory = (small.weights + small.activations + small.kv_floor // 2) / GIB
    msg = problems(make({"memory_gib": memory}, None), model)
    assert "stage 'llm': memory_gib" in msg and "one sequence of max_model_len needs" in msg


def test_stages_that_cannot_share_a_device_fail_together(digits_and_llm):
    model, make = digits_and_llm
    free = device_memory("cpu").free / GIB
    msg = problems(make({"memory_gib": free * 0.6}, {"memory_gib": free * 0.6}), model)
    assert "cpu: stages need at least" in msg and "usable after 10% headroom" in msg


def test_plan_from_the_model_without_any_memory_setting(digits_and_llm):
    """No flag, no variable: the KV cache holds max_num_seqs full-length sequences of this
    model, computed from its config; the plan adds up and fits what is free."""
    from transformers import AutoConfig

    model, make = digits_and_llm
    p = plan(make(None, None), model, dtype="float32")
    llm, dit = p.stage("llm"), p.stage("dit")
    hf = AutoConfig.from_pretrained(model)
    head_dim = hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    max_num_seqs = 256  # vLLM's CPU default for offline use
    assert llm.source == "planned"
    assert llm.kv_cache == per_token * MAX_MODEL_LEN * max_num_seqs
    assert llm.engine_args == {"kv_cache_memory_bytes": llm.kv_cache}
    assert llm.weights == weights_bytes(model)  # float32 checkpoint at float32
    assert dit.kv_cache == 0 and dit.weights > 0 and dit.activations > 0
    (cpu,) = p.as_dict()["devices"]
    assert cpu["planned"] == llm.total + dit.total <= cpu["usable"] < cpu["free"]
    for row in p.as_dict()["stages"]:
        assert row["total"] == sum(row[k] for k in ("weights", "kv_cache", "activations",
                                                    "runtime"))
    table = p.table()
    assert table.splitlines()[0].split()[:3] == ["stage", "device", "weights"]
    assert "usable" in table.splitlines()[-1]


def test_user_settings_win(digits_and_llm, monkeypatch):
    model, make = digits_and_llm
    given = plan(make(None, None), model, kv_cache_memory_bytes=64 << 20).stage("llm")
    assert (given.source, given.kv_cache, given.engine_args) == (
        "kv_cache_memory_bytes", 64 << 20, {})
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = plan(make(None, None), model).stage("llm")
    assert (env.source, env.kv_cache, env.engine_args) == ("VLLM_CPU_KVCACHE_SPACE", GIB, {})
    msg = problems(make({"memory_gib": 0.5}, None), model)
    assert "VLLM_CPU_KVCACHE_SPACE is set" in msg  # vLLM would let it win over the budget


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
def test_cpu_budget_becomes_the_stage_kv_cache(tiny_qwen2, tmp_path):
    yaml = f"""
name: placed
stages:
  - name: llm
    output: text
    final_output: true
    engine_args: {{max_model_len: {MAX_MODEL_LEN}, dtype: float32}}
    placement: {{device: cpu, memory_gib: 0.125}}
"""
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(pipeline_llm(tiny_qwen2, yaml, tmp_path))
        planned = llm.engine.memory_plan.stage("llm")
        assert planned.kv_cache == int(0.125 * GIB) - planned.weights - planned.activations
        config = llm.engine.stages["llm"].engine.vllm_config
        hf = config.model_config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
        blocks = config.cache_config.num_gpu_blocks
        assert blocks == planned.kv_cache // (per_token * config.cache_config.block_size)
        (out,) = llm.generate(["Hello"], use_tqdm=False)
        assert out.outputs
