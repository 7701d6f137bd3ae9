"""Hidden states out of an AR stage (vLLM worker extension) equal HF transformers'."""

from __future__ import annotations

import pytest
import torch
from conftest import pipeline_llm
from vllm import SamplingParams

PROMPTS = ["Hello, my name is", "Tell me a story about a cat and a dog", "one"]

PIPELINE = """
name: hidden
stages:
  - name: llm
    engine: ar
    engine_args: {dtype: float32}
    output: hidden_states
    final_output: true
"""


@pytest.fixture(scope="module")
def hidden_llm(tiny_qwen2, tmp_path_factory):
    with pipeline_llm(tiny_qwen2, PIPELINE, tmp_path_factory.mktemp("hidden"),
                      max_model_len=512) as llm:
        yield llm


def test_hidden_states_equal_hf(hidden_llm, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    outs = hidden_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    for out in outs:
        # Rows for the prompt, then one per decode step; the last sampled token has none.
        ids = out.prompt_token_ids + out.token_ids[:-1]
        with torch.no_grad():
            ref = model.model(torch.tensor([ids])).last_hidden_state[0]
            greedy = model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 :]
        hidden = out.tensors["hidden_states"]
        assert hidden.shape == ref.shape
        torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
        assert greedy.argmax(-1).tolist() == out.token_ids  # and the tokens are HF's too


def _hf_rows(model, out) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([out.prompt_token_ids + out.token_ids[:-1]])
    with torch.no_grad():
        states = model.model(ids, output_hidden_states=True).hidden_states
    return states[0][0], states[-1][0]


def test_a_prefix_from_the_cache_keeps_its_rows(hidden_llm, tiny_qwen2):
    """The stage runs compiled with prefix caching on: a request whose prompt starts with a
    cached prefix skips its forward pass, and still gets every row, HF's."""
    from transformers import AutoModelForCausalLM

    shared = " ".join(["the cat and the dog went out"] * 40)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = hidden_llm.generate(shared + " in the rain", params)[0]
    # Same prefix, then the first answer's tokens and more: the next turn of a conversation.
    second = hidden_llm.generate(
        {"prompt_token_ids": first.prompt_token_ids + first.token_ids + [11, 12, 13]},
        params)[0]
    assert second.num_cached_tokens > len(first.prompt_token_ids) // 2
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    for out in (first, second):
        embeds, hidden = _hf_rows(model, out)
        assert out.tensors["hidden_states"].shape == hidden.shape
        torch.testing.assert_close(out.tensors["embeds"], embeds, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.tensors["hidden_states"], hidden, atol=1e-4, rtol=1e-4)


def test_hidden_states_of_a_batch_do_not_mix(hidden_llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = hidden_llm.generate(PROMPTS[1], params)[0].tensors["hidden_states"]
    batched = hidden_llm.generate(PROMPTS * 3, params)
    for out in batched[1::3]:
        torch.testing.assert_close(out.tensors["hidden_states"], alone, atol=1e-5, rtol=1e-5)
