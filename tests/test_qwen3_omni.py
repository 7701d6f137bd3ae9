"""Qwen3-Omni on the tiny model: the factory's folder is one HF's `generate(return_audio=True)`
speaks from, and the thinker stage (vLLM's MoE thinker, compiled) equals HF's thinker: greedy
tokens, and the rows the talker reads (input embeddings, the `accept_hidden_layer` output),
for text and for image + audio input; and served, the built-in pipeline answering the openai
client's chat like HF."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from conftest import pipeline_llm
from PIL import Image
from vllm import SamplingParams

from vllm_omni.testing.tiny_qwen3_omni import SAMPLE_RATE

TOKENS = 10
RNG = np.random.default_rng(0)
IMAGE = Image.fromarray(RNG.integers(0, 256, (64, 96, 3), dtype=np.uint8))
AUDIO = (0.1 * np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000)).astype(np.float32)

ROWS_PIPELINE = """
name: qwen3_rows
stages:
  - name: thinker
    engine: ar
    engine_args:
      dtype: float32
      hf_overrides: {architectures: [Qwen3OmniMoeThinkerWithTalkerRows]}
    output: hidden_states
    final_output: true
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_omni):
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_qwen3_omni)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_qwen3_omni).eval()
    return processor, model


def chat_prompt(processor, text: str, media: tuple[str, ...] = ()) -> str:
    parts = [{"type": m} for m in media] + [{"type": "text", "text": text}]
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )


def test_hf_speaks_the_tiny_model(hf_model):
    processor, model = hf_model
    inputs = processor(text=chat_prompt(processor, "Tell me a story."), return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        sequences, waveform = model.generate(
            **inputs, return_audio=True, thinker_max_new_tokens=TOKENS,
            thinker_do_sample=False, talker_max_new_tokens=20, speaker="Chelsie")
    reply = sequences[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(set(reply)) > 2  # the thinker's answer depends on its context
    wave = waveform.reshape(-1).numpy()
    assert np.isfinite(wave).all() and 0.01 < np.abs(wave).max() <= 1.0
    # 1,920 samples per codec frame at 24 kHz (12.5 frames/s), less code2wav's causal lead.
    frames = code2wav_frames(model, wave)
    assert 1 <= frames <= 20
    assert model.config.code2wav_config.num_quantizers == 16 and SAMPLE_RATE == 24000


def code2wav_frames(model, wave: np.ndarray) -> int:
    lead = model.code2wav.total_upsample - wave.size % model.code2wav.total_upsample
    return (wave.size + lead) // model.code2wav.total_upsample


@pytest.fixture(scope="module")
def rows_llm(tiny_qwen3_omni, tmp_path_factory):
    with pipeline_llm(tiny_qwen3_omni, ROWS_PIPELINE, tmp_path_factory.mktemp("q3rows"),
                      max_model_len=1024) as llm:
        yield llm


def test_thinker_tokens_and_talker_rows_equal_hf(rows_llm, hf_model):
    processor, model = hf_model
    accept = model.config.talker_config.accept_hidden_layer
    assert 0 < accept < model.config.thinker_config.text_config.num_hidden_layers
    cases = [(chat_prompt(processor, t), None) for t in ("Tell me a story.", "Two plus two?")]
    cases.append((chat_prompt(processor, "What is this?", ("image", "audio")),
                  {"image": IMAGE, "audio": (AUDIO, 16000)}))
    prompts = [{"prompt": p, "multi_modal_data": m} if m else p for p, m in cases]
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS)
    outs = rows_llm.generate(prompts, greedy)
    assert len(outs) == len(cases)
    # Again: the prompts' blocks now come from the prefix cache, and their rows with them.
    again = rows_llm.generate(prompts[:1], greedy)[0]
    for name, rows in outs[0].tensors.items():
        torch.testing.assert_close(again.tensors[name], rows, atol=1e-5, rtol=1e-5)
    for (prompt, media), out in zip(cases, outs, strict=True):
        inputs = processor(text=prompt, return_tensors="pt",
                           **({"images": [IMAGE], "audio": [AUDIO]} if media else {}))
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            greedy = model.thinker.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
        assert out.token_ids == greedy[0, inputs["input_ids"].shape[1]:].tolist()
        # Rows of the prompt and every fed token: the last sampled one has none.
        fed = torch.tensor([out.prompt_token_ids + out.token_ids[:-1]])
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        # With no attention mask HF's rope index places media tokens differently from its
        # own `generate`.
        with torch.no_grad():
            states = model.thinker(input_ids=fed, attention_mask=torch.ones_like(fed),
                                   output_hidden_states=True, **extra).hidden_states
        rows = out.tensors
        assert rows["embeds"].shape == states[0][0].shape
        torch.testing.assert_close(rows["embeds"], states[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rows["accept_hidden"], states[accept][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rows["hidden_states"], states[-1][0], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def q3_client(tiny_qwen3_omni, tmp_path_factory):
    from conftest import ServerProcess

    srv = ServerProcess([tiny_qwen3_omni, "--dtype", "float32", "--max-model-len", "1024"],
                        tmp_path_factory.mktemp("log") / "qwen3-omni.log", timeout=360)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def test_served_chat_with_an_image_answers_like_hf(q3_client, hf_model):
    """`vllm serve FOLDER --omni` picks the Qwen3-Omni pipeline; the openai client's chat with
    an image gets HF's greedy answer; speech, not built yet, is a 400 that says so."""
    processor, model = hf_model
    png = io.BytesIO()
    IMAGE.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is this?"},
    ]}]
    name = q3_client.models.list().data[0].id
    resp = q3_client.chat.completions.create(model=name, messages=messages, temperature=0,
                                             max_tokens=TOKENS)
    inputs = processor(text=chat_prompt(processor, "What is this?", ("image",)), images=[IMAGE],
                       return_tensors="pt")
    with torch.no_grad():
        greedy = model.thinker.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    reply = greedy[0, inputs["input_ids"].shape[1]:]
    assert resp.choices[0].message.content == processor.tokenizer.decode(
        reply, skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(reply)
    with pytest.raises(openai.BadRequestError, match="audio"):
        q3_client.chat.completions.create(model=name, messages=messages, max_tokens=2,
                                          modalities=["text", "audio"])


TALKER_PIPELINE = """
name: qwen3_talker
stages:
  - name: thinker
    engine: ar
    engine_args:
      dtype: float32
      hf_overrides: {architectures: [Qwen3OmniMoeThinkerWithTalkerRows]}
    output: text
    hidden_states: true
    final_output: true
    weights_prefix: thinker.
  - name: talker
    engine: ar
    inputs: [thinker]
    input_processor: vllm_omni.models.qwen3_omni.stages:thinker_to_talker
    step_inputs: true
    sampling_defaults: vllm_omni.models.qwen3_omni.stages:talker_sampling
    engine_args:
      dtype: float32
      hf_overrides: vllm_omni.models.qwen3_omni.talker:talker_hf_config
      skip_tokenizer_init: true
      generation_config: vllm
    output: hidden_states
    final_output: true
    weights_prefix: talker.
"""
FRAMES = 12


def test_talker_writes_hf_frames(hf_model, tiny_qwen3_omni, tmp_path):
    """The thinker -> talker stages on vLLM: every code of every frame (the talker's first
    code and the code predictor's 15) equals HF's `generate`, greedy, for two prompts in one
    batch."""
    processor, model = hf_model
    recorded = []
    decode = model.code2wav.chunked_decode

    def recording(codes, **kwargs):
        recorded.append(codes[0].clone())
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = recording
    texts = ["Tell me a story.", "Two plus two?"]
    refs = []
    for text in texts:
        inputs = processor(text=chat_prompt(processor, text), return_tensors="pt")
        with torch.no_grad():
            model.generate(**inputs, return_audio=True, thinker_max_new_tokens=TOKENS,
                           thinker_do_sample=False, talker_do_sample=False,
                           talker_max_new_tokens=FRAMES)
        refs.append(recorded.pop())  # (16, frames)
    with pipeline_llm(tiny_qwen3_omni, TALKER_PIPELINE, tmp_path, max_model_len=1024) as llm:
        outs = llm.generate(
            [chat_prompt(processor, t) for t in texts],
            [SamplingParams(temperature=0, max_tokens=TOKENS),
             {"temperature": 0, "max_tokens": FRAMES}])
    talker = [o for o in outs if o.stage == "talker"]
    assert len(talker) == len(texts)
    for out, ref in zip(talker, refs, strict=True):
        prompt = len(out.prompt_token_ids)
        codes = out.tensors["codes"][prompt:].T
        assert codes.shape == ref.shape
        assert codes.tolist() == ref.tolist()
        assert out.token_ids[: ref.shape[1]] == ref[0].tolist()
