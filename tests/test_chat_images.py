"""Chat on a pipeline whose final output is an image (LLM -> DiT): the message carries the
outputs asked for (image parts, and the LLM's text where it is final), streaming included;
a request the pipeline cannot answer in any form is a 400."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import SERVER_MAX_MODEL_LEN, ServerProcess
from PIL import Image

from vllm_omni.testing.digits import DIGITS_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PIPELINE = f"""
name: chat-to-image
stages:
  - name: llm
    engine: ar
    output: text
    final_output: true
  - name: dit
    engine: diffusion
    model: {DIGITS_MODEL}
    inputs: [llm]
    input_processor: vllm_omni.processors:upstream_text
    sampling_params: {{num_inference_steps: 4}}
    output: image
    final_output: true
"""
BODY = {"messages": [{"role": "user", "content": "draw"}], "max_tokens": 6, "temperature": 0,
        "stage_sampling_params": {"dit": {"seed": 5}}}


@pytest.fixture(scope="module")
def chat_to_image(tiny_qwen2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-to-image")
    (folder / "pipeline.yaml").write_text(PIPELINE)
    srv = ServerProcess([tiny_qwen2, "--stage-configs-path", str(folder / "pipeline.yaml"),
                         "--max-model-len", str(SERVER_MAX_MODEL_LEN)], folder / "server.log")
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def pixels(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))),
                      dtype=np.int16)


def digits_image(prompt: str, seed: int) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(DIGITS_MODEL)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt, num_inference_steps=4, generator=torch.Generator().manual_seed(seed),
                 # the sizes the model was trained with, which the engine defaults to
                 height=32, width=32, max_sequence_length=32,
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def streamed(srv, body) -> list[dict]:
    deltas = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    return deltas


def test_chat_answers_with_text_and_the_image_it_drew(chat_to_image):
    client = openai.OpenAI(base_url=chat_to_image.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    both = client.chat.completions.create(
        model=model, messages=BODY["messages"], max_tokens=6, temperature=0,
        extra_body={"stage_sampling_params": BODY["stage_sampling_params"],
                    "modalities": ["text", "image"]})
    text_part, image_part = both.choices[0].message.content
    assert text_part["type"] == "text" and text_part["text"]
    assert both.usage.completion_tokens == 6
    drawn = pixels(image_part["image_url"]["url"])
    assert np.abs(drawn - digits_image(text_part["text"], 5)).max() <= 1

    only = client.chat.completions.create(
        model=model, messages=BODY["messages"], max_tokens=6, temperature=0,
        extra_body={"stage_sampling_params": BODY["stage_sampling_params"],
                    "modalities": ["image"]})
    (part,) = only.choices[0].message.content
    assert np.array_equal(pixels(part["image_url"]["url"]), drawn)


def test_streamed_chat_carries_the_image(chat_to_image):
    deltas = streamed(chat_to_image, {**BODY, "modalities": ["image"]})
    images = [d["content"] for d in deltas if isinstance(d.get("content"), list)]
    assert len(images) == 1 and not any(isinstance(d.get("content"), str) and d["content"]
                                        for d in deltas)
    ((part,),) = images
    text_then_image = streamed(chat_to_image, BODY)
    text = "".join(d["content"] for d in text_then_image if isinstance(d.get("content"), str))
    assert text and isinstance(text_then_image[-1]["content"], list)
    drawn = pixels(text_then_image[-1]["content"][0]["image_url"]["url"])
    assert np.array_equal(pixels(part["image_url"]["url"]), drawn)
    # The DiT drew the LLM's whole answer, as the unstreamed chat and diffusers do (a
    # stream's text arrives in deltas; the stage downstream reads the whole text).
    whole = httpx.post(chat_to_image.url + "/v1/chat/completions",
                       json={**BODY, "modalities": ["text", "image"]}, timeout=120).json()
    text_part, image_part = whole["choices"][0]["message"]["content"]
    assert text_part["text"] == text
    assert np.array_equal(pixels(image_part["image_url"]["url"]), drawn)
    assert np.abs(drawn - digits_image(text, 5)).max() <= 1


def test_what_chat_cannot_answer_is_a_400(chat_to_image):
    r = httpx.post(chat_to_image.url + "/v1/chat/completions",
                   json={**BODY, "modalities": ["audio"]}, timeout=30)
    assert r.status_code == 400 and "cannot output ['audio']" in r.json()["error"]["message"]
    done = httpx.post(chat_to_image.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
