"""AR stages over several ranks (vLLM's tensor parallelism): refused at start-up when the
ranks cannot split the model or get a core each, bound to cores for the user on CPU, and
equal to one rank: greedy tokens, hidden states, and Qwen2.5-Omni's speech."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
import torch
from conftest import MAX_MODEL_LEN, pipeline_llm
from vllm import SamplingParams
from vllm.usage.usage_lib import UsageContext

from vllm_omni.config import parse_pipeline
from vllm_omni.config.placement import PlacementError
from vllm_omni.engine.ar.parallel import BIND_ENV
from vllm_omni.orchestrator.memory import plan_pipeline

PROMPTS = ["Hello, my name is", "Tell me a story about a cat and a dog", "one"]
CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="TP=2 needs a core per rank")


@pytest.fixture(autouse=True)
def user_settings_unset(monkeypatch):
    # A user's shell may set these; each test sets what it asserts on.
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def one_stage(tp: int, name: str = "llm", **placement) -> dict:
    stage = {"name": name, "engine": "ar", "output": "text", "final_output": True,
             "engine_args": {"tensor_parallel_size": tp}}
    if placement:
        stage["placement"] = {"device": "cpu", **placement}
    return stage


def plan(model: str, *stages: dict):
    pipeline = parse_pipeline({"name": "parallel", "stages": list(stages)}, "test")
    return plan_pipeline(pipeline, model, {"max_model_len": MAX_MODEL_LEN},
                         UsageContext.LLM_CLASS, ar_device_type="cpu")


def test_impossible_ranks_are_refused_before_any_engine_starts(tiny_qwen2, tmp_path):
    """Every problem at once, each naming its stage, the option and the numbers."""
    too_many = len(CORES) + 1
    yaml = f"""
name: parallel
stages:
  - name: odd
    engine: ar
    engine_args: {{tensor_parallel_size: 3}}
    output: text
  - name: crowded
    engine: ar
    inputs: [odd]
    input_processor: vllm_omni.processors:upstream_text
    engine_args: {{tensor_parallel_size: 2, pipeline_parallel_size: {too_many}}}
    output: text
    final_output: true
"""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(PlacementError) as err:
        with pipeline_llm(tiny_qwen2, yaml, tmp_path):
            pass
    message = str(err.value)
    # tiny Qwen2: 4 attention heads, 2 KV heads, 2 layers
    assert "stage 'odd': tensor_parallel_size 3 does not divide the model's 4 attention " \
           "heads" in message
    if len(CORES) < 3:
        assert f"stage 'odd': tensor_parallel_size 3 x pipeline_parallel_size 1 needs 3 " \
               f"cores, one per rank; {len(CORES)} core(s)" in message
    assert f"stage 'crowded': pipeline_parallel_size {too_many} is more than the model's " \
           "2 layers" in message
    assert f"stage 'crowded': tensor_parallel_size 2 x pipeline_parallel_size {too_many} " \
           f"needs {2 * too_many} cores" in message
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, "an engine process started although the ranks were refused"


def test_cores_placement_and_user_binding_are_checked(tiny_qwen2, monkeypatch):
    with pytest.raises(PlacementError, match=r"stage 'llm': tensor_parallel_size 2 x "
                       r"pipeline_parallel_size 1 needs 2 cores, one per rank; 1 core\(s\) "
                       r"placement.cores"):
        plan(tiny_qwen2, one_stage(2, cores=CORES[:1]))
    with pytest.raises(PlacementError, match=r"stage 'llm': placement.cores \[4096\] are not "
                       "among the cores this process may use"):
        plan(tiny_qwen2, one_stage(1, cores=[4096]))
    monkeypatch.setenv(BIND_ENV, "0")
    with pytest.raises(PlacementError, match=rf"stage 'llm': {BIND_ENV}='0' names 1 core "
                       r"set\(s\), the stage has 2 rank\(s\)"):
        plan(tiny_qwen2, one_stage(2))


@needs_two_cores
def test_the_plan_binds_each_rank_and_splits_the_kv_cache(tiny_qwen2, monkeypatch):
    one, two = plan(tiny_qwen2, one_stage(1, "one"), one_stage(2, "two")).stages
    # One rank keeps vLLM's own binding (the NUMA node, a core left to the scheduler).
    assert one.env == {BIND_ENV: None} and one.ranks == 1
    half = len(CORES) // 2
    assert two.env == {BIND_ENV: ",".join(map(str, CORES[:half])) + "|"
                       + ",".join(map(str, CORES[half : 2 * half]))}
    assert two.ranks == 2 and two.devices == ["cpu", "cpu"]
    # vLLM's kv_cache_memory_bytes is per rank; the plan counts both ranks' caches.
    assert two.engine_args["kv_cache_memory_bytes"] == two.kv_cache // 2
    assert two.runtime > one.runtime  # one more worker process
    (placed,) = plan(tiny_qwen2, one_stage(2, cores=CORES[::-1])).stages
    assert placed.env == {BIND_ENV: f"{CORES[-1]}|{CORES[-2]}"}
    monkeypatch.setenv(BIND_ENV, "0|1")  # the user's binding wins, and is left alone
    (given,) = plan(tiny_qwen2, one_stage(2)).stages
    assert given.env == {}


SIDE_BY_SIDE = """
name: tp-side-by-side
stages:
  - name: tp1
    engine: ar
    engine_args: {dtype: float32}
    output: hidden_states
    final_output: true
  - name: tp2
    engine: ar
    engine_args: {dtype: float32, tensor_parallel_size: 2}
    output: hidden_states
    final_output: true
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_two_cores
def test_two_ranks_equal_one(tiny_qwen2, tmp_path):
    """One pipeline, a TP=1 and a TP=2 stage of the same model (bound differently, so they
    start one after the other): same greedy tokens, same hidden states, both HF's."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pipeline_llm(tiny_qwen2, SIDE_BY_SIDE, tmp_path, max_model_len=512) as llm:
        tp2 = llm.engine.stages["tp2"].engine.vllm_config.parallel_config
        assert tp2.tensor_parallel_size == 2 and tp2.world_size == 2
        outs = llm.generate(PROMPTS, [params, params])
    by_stage = {s: [o for o in outs if o.stage == s] for s in ("tp1", "tp2")}
    assert [len(v) for v in by_stage.values()] == [len(PROMPTS)] * 2
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    for one, two in zip(by_stage["tp1"], by_stage["tp2"], strict=True):
        assert two.token_ids == one.token_ids
        assert set(two.tensors) == set(one.tensors)  # one copy of each, not one per rank
        for name in one.tensors:
            torch.testing.assert_close(two.tensors[name], one.tensors[name],
                                       atol=1e-5, rtol=1e-5)
        ids = one.prompt_token_ids + one.token_ids[:-1]
        with torch.no_grad():
            greedy = model(torch.tensor([ids])).logits[0, len(one.prompt_token_ids) - 1 :]
        assert greedy.argmax(-1).tolist() == two.token_ids


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_two_cores
def test_speech_with_two_ranks_equals_hf(tiny_omni):
    """`tensor_parallel_size=2` for the whole Qwen2.5-Omni pipeline (as `vllm serve -tp 2`
    gives it: the thinker and the talker, hidden states out and step inputs in across
    ranks) speaks HF's waveform, which the one-rank pipeline equals (test_omni_speech)."""
    from conftest import hf_talker_with_attention_mask
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from vllm_omni import OmniLLM
    from vllm_omni.testing.tiny_omni import TALKER_EOS_IDS

    thinker_tokens, talker_tokens, seed = 6, 16, 1234
    processor = AutoProcessor.from_pretrained(tiny_omni)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is two plus two?"}]}],
        add_generation_prompt=True, tokenize=False)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni).eval()
    hf_talker_with_attention_mask(model)
    inputs = processor(text=prompt, return_tensors="pt")
    torch.manual_seed(seed)  # token2wav draws its noise from the global generator
    with torch.no_grad():
        sequences, waveform = model.generate(
            **inputs, return_audio=True, thinker_max_new_tokens=thinker_tokens,
            thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=talker_tokens, talker_eos_token_id=TALKER_EOS_IDS)
    del model
    llm = OmniLLM(tiny_omni, dtype="float32", max_model_len=1024, tensor_parallel_size=2)
    try:
        for stage in ("thinker", "talker"):
            parallel = llm.engine.stages[stage].engine.vllm_config.parallel_config
            assert parallel.tensor_parallel_size == 2
        outs = llm.generate([prompt], [
            SamplingParams(temperature=0, max_tokens=thinker_tokens),
            {"temperature": 0, "max_tokens": talker_tokens},
            {"seed": seed},
        ], modalities=["text", "audio"])
    finally:
        llm.shutdown()
    by_stage = {o.stage: o for o in outs}
    assert by_stage["thinker"].token_ids == sequences[0, inputs["input_ids"].shape[1]:].tolist()
    np.testing.assert_allclose(by_stage["code2wav"].audio.waveform, waveform.numpy(),
                               atol=1e-5)
