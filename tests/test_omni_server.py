"""Qwen2.5-Omni speaking through the OpenAI API: `vllm serve FOLDER --omni` on the tiny model,
the openai client asking for text and audio, compared with HF transformers."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import soundfile
import torch
from conftest import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THINKER_TOKENS, TALKER_TOKENS, SEED = 12, 40, 77
MESSAGES = [{"role": "user", "content": "Tell me a story about a red fox."}]
SPEECH = {  # the talker and code2wav settings of the reference run
    "temperature": 0,
    "max_tokens": THINKER_TOKENS,
    "extra_body": {"stage_sampling_params": {
        "talker": {"temperature": 0, "max_tokens": TALKER_TOKENS},
        "code2wav": {"seed": SEED},
    }},
}


@pytest.fixture(scope="module")
def hf_answer(tiny_omni):
    """HF's text and waveform for MESSAGES with the voice Ethan."""
    from conftest import hf_talker_with_attention_mask
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from vllm_omni.testing.tiny_omni import TALKER_EOS_IDS

    processor = AutoProcessor.from_pretrained(tiny_omni)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni).eval()
    hf_talker_with_attention_mask(model)
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, return_tensors="pt")
    torch.manual_seed(SEED)
    with torch.no_grad():
        sequences, waveform = model.generate(
            **inputs, return_audio=True, speaker="Ethan", thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS,
            talker_eos_token_id=TALKER_EOS_IDS,
        )
    tokens = sequences[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(tokens, skip_special_tokens=True), waveform.numpy()


@pytest.fixture(scope="module")
def server(tiny_omni, tmp_path_factory):
    srv = ServerProcess([tiny_omni, "--dtype", "float32", "--max-model-len", "1024"],
                        tmp_path_factory.mktemp("log") / "omni.log", timeout=360)
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def model_name(client) -> str:
    return client.models.list().data[0].id


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    data, rate = soundfile.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return data, rate


def test_chat_speaks_like_hf(client, hf_answer):
    text, waveform = hf_answer
    resp = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, **SPEECH,
    )
    message = resp.choices[0].message
    assert message.content is None and message.audio.transcript == text
    got, rate = decode_wav(message.audio.data)
    assert rate == 24000
    np.testing.assert_allclose(got, waveform, atol=1.5 / 32768)  # 16-bit samples


def test_streamed_transcript_then_audio(client, hf_answer):
    text, waveform = hf_answer
    stream = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, stream=True, **SPEECH,
    )
    transcript, data = [], []
    for chunk in stream:
        audio = getattr(chunk.choices[0].delta, "audio", None) if chunk.choices else None
        if audio:
            transcript.append(audio.transcript or "")
            if audio.data:
                data.append(base64.b64decode(audio.data))
    assert "".join(transcript) == text
    got = np.frombuffer(b"".join(data), dtype="<i2").astype(np.float32) / 32768
    np.testing.assert_allclose(got, waveform, atol=1.5 / 32768)


def test_text_only_by_default(client, hf_answer):
    resp = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, temperature=0, max_tokens=THINKER_TOKENS
    )
    assert resp.choices[0].message.content == hf_answer[0]
    assert getattr(resp.choices[0].message, "audio", None) is None


@pytest.mark.parametrize("kwargs, match", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "Nobody"}}, "unknown voice"),
    ({"modalities": ["text", "audio"], "audio": {"format": "ogg"}}, "not supported"),
    ({"modalities": ["audio"]}, "must also"),
    ({"modalities": ["text", "audio"], "n": 2}, "n=1"),
])
def test_bad_audio_requests_are_400(client, kwargs, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=model_name(client), messages=MESSAGES,
                                       max_tokens=4, **kwargs)


def test_image_input_answers_in_text_and_speech(client):
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
                    ).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is this?"},
    ]}]
    resp = client.chat.completions.create(model=model_name(client), messages=messages,
                                          temperature=0, max_tokens=4)
    text = resp.choices[0].message.content
    assert text
    spoken = client.chat.completions.create(
        model=model_name(client), messages=messages, temperature=0, max_tokens=4,
        modalities=["text", "audio"],
        extra_body={"stage_sampling_params": {"talker": {"max_tokens": 20}}},
    ).choices[0].message.audio
    assert spoken.transcript == text
    waveform, rate = decode_wav(spoken.data)
    assert rate == 24000 and len(waveform) > 0
