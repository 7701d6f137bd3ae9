"""Multi-stage pipelines on real engines: a chain of two AR stages, stage errors, modalities."""

from __future__ import annotations

import asyncio

import pytest
from conftest import MAX_MODEL_LEN, pipeline_llm
from vllm import SamplingParams

from vllm_omni.errors import StageError, StageStartError

PROMPTS = ["Hello, my name is", "Tell me a story about a cat", "one two three"]

CHAIN = """
name: chain
stages:
  - name: first
    engine: ar
    sampling_params: {temperature: 0.0, max_tokens: 8, ignore_eos: true}
    output: text
  - name: second
    engine: ar
    inputs: [first]
    input_processor: vllm_omni.processors:upstream_text
    sampling_params: {temperature: 0.0, max_tokens: 6, ignore_eos: true}
    output: text
    final_output: true
"""


@pytest.fixture(scope="module")
def chain_llm(tiny_qwen2, tmp_path_factory):
    with pipeline_llm(tiny_qwen2, CHAIN, tmp_path_factory.mktemp("pipelines"),
                      max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def test_chain_equals_running_the_steps_by_hand(chain_llm, vllm_llm):
    outs = chain_llm.generate(PROMPTS)
    first = vllm_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    second = vllm_llm.generate(
        [r.outputs[0].text for r in first],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert [o.stage for o in outs] == ["second"] * len(PROMPTS)
    assert [o.token_ids for o in outs] == [list(r.outputs[0].token_ids) for r in second]
    assert [o.text for o in outs] == [r.outputs[0].text for r in second]


def test_per_stage_sampling_params(chain_llm):
    (out,) = chain_llm.generate(PROMPTS[0], [None, {"max_tokens": 3, "temperature": 0.0}])
    assert len(out.token_ids) == 3


def test_failing_stage_is_named(chain_llm):
    # The second stage's engine rejects the request: the error says which stage.
    with pytest.raises(StageError, match="stage 'second'.*logprobs") as err:
        chain_llm.generate(PROMPTS[0], [None, {"logprobs": 1000}])
    assert err.value.stage == "second"
    # the pipeline still serves requests afterwards
    assert len(chain_llm.generate(PROMPTS[0])[0].token_ids) == 6


def test_modalities_plan(chain_llm):
    engine = chain_llm.engine
    stages, returned = engine.plan(["text"])
    assert [s.name for s in stages] == ["first", "second"] and returned == {"second"}
    with pytest.raises(ValueError, match=r"cannot output \['audio'\]"):
        engine.plan(["text", "audio"])


def test_abort_mid_chain_stops_every_stage(chain_llm):
    from vllm.sampling_params import RequestOutputKind

    engine = chain_llm.engine

    async def scenario():
        long = SamplingParams(
            temperature=0, max_tokens=1500, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        stream = engine.generate(PROMPTS[0], [None, long], request_id="chain-abort")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        return [s.engine.get_num_unfinished_requests() for s in engine.stages.values()]

    unfinished = asyncio.run_coroutine_threadsafe(scenario(), chain_llm._loop).result(120)
    assert unfinished == [0, 0]


def test_every_failed_stage_start_is_named(tiny_qwen2, tmp_path):
    from vllm_omni import OmniLLM

    path = tmp_path / "broken.yaml"
    path.write_text(
        CHAIN.replace(
            "output: text\n  - name: second",
            "output: text\n    engine_args: {max_model_len: 999999}\n  - name: second",
            1,
        ).replace("input_processor:", f"model: {tmp_path}/no-such-model\n    input_processor:")
    )
    with pytest.raises(StageStartError) as err:
        OmniLLM(tiny_qwen2, stage_configs_path=str(path))
    message = str(err.value)
    assert "stage 'first' failed to start" in message and "999999" in message
    assert "stage 'second' failed to start" in message and "no-such-model" in message


SIDE_BY_SIDE = """
name: side-by-side
stages:
  - name: a
    engine: ar
    output: text
    final_output: true
  - name: b
    engine: ar
    output: text
    final_output: true
"""


def test_independent_stages_run_concurrently(tiny_qwen2, tmp_path):
    """Two stages that do not feed each other both stream while the other is still running."""
    from vllm.sampling_params import RequestOutputKind

    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)
    with pipeline_llm(tiny_qwen2, SIDE_BY_SIDE, tmp_path, max_model_len=MAX_MODEL_LEN) as llm:

        async def scenario():
            return [(out.stage, out.finished)
                    async for out in llm.engine.generate(PROMPTS[1], [long, long])]

        seen = asyncio.run_coroutine_threadsafe(scenario(), llm._loop).result(120)
    first_b = next(i for i, (stage, _) in enumerate(seen) if stage == "b")
    last_a = max(i for i, (stage, _) in enumerate(seen) if stage == "a")
    assert first_b < last_a, "stage b waited for stage a to finish"
    assert {stage for stage, finished in seen if finished} == {"a", "b"}
