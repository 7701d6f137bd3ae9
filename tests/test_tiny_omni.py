"""The tiny Qwen2.5-Omni: HF loads all three stages; vLLM's thinker should match HF's exactly."""

from __future__ import annotations

import pytest
import torch

N_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Tell me a story about a red fox."}]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """The folder, its chat prompt ids, and HF's greedy thinker tokens for them."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from vllm_omni.testing.tiny_models import make_tiny

    folder = make_tiny("qwen2_5-omni-tiny", tmp_path_factory.mktemp("omni") / "omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert model.has_talker and set(model.speaker_map) == {"Chelsie", "Ethan"}
    assert model.config.thinker_config.text_config.vocab_size == len(tokenizer)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):  # a BatchEncoding in newer transformers
        prompt_ids = prompt_ids["input_ids"]
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        sequences = model.generate(
            input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
            return_audio=False, thinker_max_new_tokens=N_TOKENS, thinker_do_sample=False,
        )
    return folder, prompt_ids, sequences[0, len(prompt_ids):].tolist()


def test_hf_loads_all_stages_and_generates(omni):
    _, _, hf_tokens = omni
    # A context-dependent continuation, not one token repeated: a comparison means something.
    assert len(hf_tokens) == N_TOKENS and len(set(hf_tokens)) > 1


def test_vllm_thinker_matches_hf_greedy(omni):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder, prompt_ids, hf_tokens = omni
    llm = LLM(str(folder), dtype="float32", max_model_len=1024, disable_log_stats=True)
    try:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids)],
            SamplingParams(temperature=0.0, max_tokens=N_TOKENS),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(out[0].outputs[0].token_ids) == hf_tokens
