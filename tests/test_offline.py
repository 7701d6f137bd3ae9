"""OmniLLM / AsyncOmniLLM on vLLM's engine: the same tokens as vLLM's own LLM."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Tell me a story about a cat",
    "one two three four",
    "image audio video speech model stage pipeline",
    "A quick brown fox jumps",
]


def test_greedy_tokens_equal_vllm(omni_llm, vllm_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = omni_llm.generate(PROMPTS, params)
    ref = vllm_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    assert len(ours) == len(PROMPTS)
    for o, r in zip(ours, ref, strict=True):
        assert o.finished and o.stage == "llm" and o.output_type == "text"
        assert o.prompt_token_ids == r.prompt_token_ids
        assert o.token_ids == list(r.outputs[0].token_ids)
        assert o.text == r.outputs[0].text
        assert len(o.token_ids) == 24
        # Read as a vLLM user reads a RequestOutput.
        assert [c.text for c in o.outputs] == [c.text for c in r.outputs]
        assert list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)


def test_default_sampling_and_seeded_sampling_equal_vllm(omni_llm, vllm_llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    ours = omni_llm.generate(PROMPTS[:3], [seeded])  # list form: one entry per stage
    ref = vllm_llm.generate(
        PROMPTS[:3], SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    )
    assert [o.token_ids for o in ours] == [list(r.outputs[0].token_ids) for r in ref]
    # a dict of overrides on the stage defaults works too
    (greedy,) = omni_llm.generate(PROMPTS[0], [{"temperature": 0.0, "max_tokens": 5}])
    assert len(greedy.token_ids) <= 5


def test_n_choices(omni_llm):
    (out,) = omni_llm.generate(
        PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    )
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]


def test_wrong_number_of_stage_params_is_an_error(omni_llm):
    with pytest.raises(ValueError, match="1 stages"):
        omni_llm.generate(PROMPTS[0], [SamplingParams(), SamplingParams()])


def test_progress_bar(omni_llm, capsys):
    omni_llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in capsys.readouterr().err


def test_async_stream_and_abort_mid_stream_stops_the_engine(omni_llm):
    """AsyncOmniLLM streams deltas; closing the stream aborts the request in the engine."""
    from vllm.sampling_params import RequestOutputKind

    engine = omni_llm.engine
    vllm_engine = engine.stages["llm"].engine

    async def scenario():
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1500,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        deltas = []
        stream = engine.generate(PROMPTS[0], params, request_id="abort-me")
        async for out in stream:
            deltas.append(out)
            if len(deltas) == 3:
                break
        await stream.aclose()
        # Checked at once: finishing naturally would take 1,500 decode steps.
        return deltas, vllm_engine.get_num_unfinished_requests()

    deltas, running = asyncio.run_coroutine_threadsafe(scenario(), omni_llm._loop).result(60)
    assert len(deltas) == 3 and all(not d.finished for d in deltas)
    assert all(len(d.token_ids) >= 1 for d in deltas)
    assert running == 0
