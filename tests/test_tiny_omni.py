"""The tiny Qwen2.5-Omni: HF loads all three stages; vLLM's thinker equals HF's token for token,
for text, image + audio, and video input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REFERENCE_KV_BYTES
from PIL import Image

N_TOKENS = 16

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cases() -> dict[str, tuple[list[dict], dict]]:
    """name -> (user content parts, multimodal data as vLLM takes it)."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
    audio = (0.1 * np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000)).astype(np.float32)
    video = rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    return {
        "text": ([{"type": "text", "text": "Tell me a story about a red fox."}], {}),
        "image+audio": (
            [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What is this?"}],
            {"image": image, "audio": (audio, 16000)},
        ),
        "video": ([{"type": "video"}, {"type": "text", "text": "Describe it."}], {"video": video}),
    }


def _hf_inputs(data: dict) -> dict:
    """vLLM's multi_modal_data as the HF processor's keyword arguments."""
    names = {"image": "images", "audio": "audio", "video": "videos"}
    return {
        names[k]: [v[0] if k == "audio" else v] for k, v in data.items()
    }


@pytest.fixture(scope="module")
def omni(tiny_omni):
    """The folder, and per case its prompt, multimodal data and HF's greedy thinker tokens."""
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    folder = tiny_omni
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert model.has_talker and set(model.speaker_map) == {"Chelsie", "Ethan"}
    assert model.config.thinker_config.text_config.vocab_size == len(processor.tokenizer)
    cases = {}
    for name, (content, data) in _cases().items():
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        assert prompt.endswith("<|im_start|>assistant\n")
        inputs = processor(text=prompt, return_tensors="pt", **_hf_inputs(data))
        with torch.no_grad():
            sequences = model.generate(
                **inputs, return_audio=False, thinker_max_new_tokens=N_TOKENS,
                thinker_do_sample=False,
            )
        tokens = sequences[0, inputs["input_ids"].shape[1]:].tolist()
        cases[name] = (prompt, data, inputs["input_ids"].shape[1], tokens)
    return folder, cases


def test_hf_loads_all_stages_and_generates(omni):
    _, cases = omni
    for _, _, _, tokens in cases.values():
        # A context-dependent continuation, not one token repeated: a comparison means something.
        assert len(tokens) == N_TOKENS and len(set(tokens)) > 1
    assert len({tuple(c[3]) for c in cases.values()}) == len(cases)  # the inputs are read


def test_vllm_thinker_matches_hf_greedy(omni):
    from vllm import LLM, SamplingParams

    folder, cases = omni
    llm = LLM(
        str(folder), dtype="float32", max_model_len=2048, disable_log_stats=True,
        limit_mm_per_prompt={"image": 1, "audio": 1, "video": 1},
        kv_cache_memory_bytes=REFERENCE_KV_BYTES,
    )
    try:
        outs = llm.generate(
            [{"prompt": prompt, "multi_modal_data": data} for prompt, data, _, _ in cases.values()],
            SamplingParams(temperature=0.0, max_tokens=N_TOKENS),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    for (name, (_, _, prompt_len, hf_tokens)), out in zip(cases.items(), outs, strict=True):
        assert len(out.prompt_token_ids) == prompt_len, name  # same placeholders expanded
        assert list(out.outputs[0].token_ids) == hf_tokens, name
