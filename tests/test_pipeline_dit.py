"""A three-stage pipeline across both engines: LLM -> LLM -> DiT, where the DiT fans in both
LLMs' texts, against the same three steps run by hand with vLLM and diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MAX_MODEL_LEN, pipeline_llm
from vllm import SamplingParams

from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PIPELINE = """
name: prompt-to-image
stages:
  - name: first
    engine: ar
    sampling_params: {{temperature: 0.0, max_tokens: 6, ignore_eos: true}}
    output: text
  - name: second
    engine: ar
    inputs: [first]
    input_processor: vllm_omni.processors:upstream_text
    sampling_params: {{temperature: 0.0, max_tokens: 5, ignore_eos: true}}
    output: text
    final_output: true
  - name: dit
    engine: diffusion
    model: {dit}
    inputs: [first, second]
    input_processor: vllm_omni.processors:joined_text
    sampling_params: {{height: 64, width: 64, num_inference_steps: 3, seed: 9,
                      float_output: true}}
    output: image
    final_output: true
"""

PROMPTS = ["Draw me a cat", "a blue house by the sea"]


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    return make_tiny("flux-tiny", tmp_path_factory.mktemp("dit") / "flux-tiny")


@pytest.fixture(scope="module")
def three_stage(tiny_qwen2, dit_folder, tmp_path_factory):
    with pipeline_llm(tiny_qwen2, PIPELINE.format(dit=dit_folder),
                      tmp_path_factory.mktemp("pipelines"), max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def test_three_stages_equal_the_steps_by_hand(three_stage, vllm_llm, dit_folder):
    outs = three_stage.generate(PROMPTS)
    assert sorted(o.stage for o in outs) == sorted(["second", "dit"] * len(PROMPTS))
    assert_equals_steps_by_hand(outs, vllm_llm, dit_folder)


def assert_equals_steps_by_hand(outs, vllm_llm, dit_folder) -> None:
    """Texts equal the two vLLM generations run by hand, images diffusers' for both texts
    (also where the stages ran on a Ray cluster, tests/test_ray_cluster.py)."""
    from diffusers import DiffusionPipeline

    first = vllm_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))
    second = vllm_llm.generate([r.outputs[0].text for r in first],
                               SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    pipe = DiffusionPipeline.from_pretrained(dit_folder)
    pipe.set_progress_bar_config(disable=True)
    texts = [o.text for o in outs if o.stage == "second"]
    images = [o.tensors["images"][0].numpy() for o in outs if o.stage == "dit"]
    for text, image, ref1, ref2 in zip(texts, images, first, second, strict=True):
        assert text == ref2.outputs[0].text
        joined = ref1.outputs[0].text + "\n\n" + ref2.outputs[0].text
        want = pipe(joined, height=64, width=64, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(9), output_type="np").images[0]
        np.testing.assert_allclose(image, want, atol=1e-4, rtol=0)


def test_text_only_skips_the_dit(three_stage):

    engine = three_stage.engine

    async def collect(modalities):
        return [o async for o in engine.generate(PROMPTS[0], None, None, modalities)
                if o.finished]

    text_only = three_stage._run(collect(["text"]))
    assert [o.stage for o in text_only] == ["second"]
    both = three_stage._run(collect(["image"]))
    assert [o.stage for o in both] == ["dit"] and len(both[0].images) == 1


def test_per_stage_params_reach_the_dit(three_stage):
    outs = three_stage.generate(PROMPTS[0], [None, None, {"width": 96, "num_images": 2}])
    (dit,) = [o for o in outs if o.stage == "dit"]
    assert [im.size for im in dit.images] == [(96, 64), (96, 64)]
    with pytest.raises(Exception, match="stage 'dit'.*multiple of"):
        three_stage.generate(PROMPTS[0], [None, None, {"width": 50}])
