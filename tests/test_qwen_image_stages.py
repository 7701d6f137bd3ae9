"""Qwen-Image on two stages: its Qwen2.5-VL text encoder on vLLM (hidden states out) ->
the DiT on our engine, against diffusers' QwenImagePipeline for the same seeds, for
concurrent requests with different prompts, lengths and seeds, with and without true CFG
(whose negative prompt runs through the same encoder)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni.config import resolve_pipeline
from vllm_omni.config.loader import BUILTIN_DIR
from vllm_omni.testing.tiny_models import make_tiny

SIZE = {"height": 32, "width": 48, "num_inference_steps": 2}
FLOATS = {"float_output": True}  # compared as floats: asked of the engine
# Prompts of different lengths, some with true CFG (two of them share a negative prompt).
REQUESTS = [
    ("a cat", {"seed": 1}),
    ("a big blue house by the sea, at night, under a full moon", {"seed": 2}),
    ("a red apple", {"seed": 3, "negative_prompt": "blurry", "true_cfg_scale": 3.0}),
    ("two small dogs playing in the snow", {"seed": 4, "negative_prompt": "dark",
                                            "true_cfg_scale": 2.0}),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny("qwen-image-tiny", tmp_path_factory.mktemp("qi") / "qwen-image-tiny")


def test_the_pipeline_class_picks_two_stages_and_the_yaml_one(folder):
    pipeline = resolve_pipeline(folder)
    assert pipeline.name == "qwen_image"
    assert [(s.name, s.engine, s.output) for s in pipeline.stages] == [
        ("encoder", "ar", "hidden_states"), ("dit", "diffusion", "image")]
    one_stage = resolve_pipeline(folder, BUILTIN_DIR / "diffusion.yaml")
    assert [s.engine for s in one_stage.stages] == ["diffusion"]


def test_the_encoder_stage_reads_the_folders_text_encoder_and_tokenizer(folder):
    from vllm_omni.config import PipelineConfigError, parse_pipeline
    from vllm_omni.engine.ar.stage import stage_engine_args

    encoder = resolve_pipeline(folder).stage("encoder")
    args = stage_engine_args(str(folder), encoder, {})
    assert (args.model, args.tokenizer) == (str(folder / "text_encoder"),
                                            str(folder / "tokenizer"))
    dit = {"name": "dit", "engine": "diffusion", "output": "image", "final_output": True,
           "subfolder": "transformer"}
    with pytest.raises(PipelineConfigError, match="subfolder is an option of 'ar' stages"):
        parse_pipeline({"name": "p", "stages": [dit]}, "p.yaml")


def test_an_encoder_the_cpu_attention_cannot_run_is_refused_at_start(folder, tmp_path):
    """The same weights as 4 heads of 16 (4 x 16 query rows, 2 x 16 key rows: the shapes
    of 2 x 32 and 1 x 32): a real model transformers runs, which vLLM's CPU attention has no
    kernel for. The server refuses it before serving, naming the stage, the head size and
    the sizes it runs, and offers the one-stage pipeline; it does not serve /health first
    and die at the first request."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    heads16 = tmp_path / "qwen-image-head16"
    shutil.copytree(folder, heads16)
    config_path = heads16 / "text_encoder" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"].update(num_attention_heads=4, num_key_value_heads=2)
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 3]
    config_path.write_text(json.dumps(config))
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(heads16 / "text_encoder")
    assert encoder(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 259)

    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(heads16), "--omni", "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("stage 'encoder': its model's attention head size is 16; vLLM's CPU attention "
            "runs head sizes 32, 64") in proc.stderr, proc.stderr[-3000:]
    offered = re.search(r"also runs as pipeline 'diffusion': --stage-configs-path (\S+)",
                        proc.stderr)
    assert offered and Path(offered[1]) == BUILTIN_DIR / "diffusion.yaml", proc.stderr[-3000:]
    assert "Uvicorn running" not in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def two_stage(folder):
    from vllm_omni import OmniLLM

    # fp32 on both stages (vLLM would run an fp32 checkpoint in bf16 on a CPU).
    llm = OmniLLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 28)
    yield llm
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_concurrent_requests_equal_diffusers(two_stage, folder):
    from diffusers import DiffusionPipeline

    engine = two_stage.engine

    async def one(i, prompt, dit):
        outs = [o async for o in engine.generate(prompt, [None, {**SIZE, **dit, **FLOATS}],
                                                 f"r{i}")
                if o.finished]
        return outs

    async def all_at_once():
        return await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(REQUESTS)))

    results = two_stage._run(all_at_once())
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for (prompt, dit), outs in zip(REQUESTS, results, strict=True):
        (out,) = outs
        assert out.stage == "dit" and out.prompt == prompt
        assert set(out.metrics["stage_seconds"]) == {"encoder", "dit"}
        kwargs = {k: v for k, v in dit.items() if k != "seed"}
        want = pipe(prompt, generator=torch.Generator().manual_seed(dit["seed"]),
                    output_type="np", **SIZE, **kwargs).images[0]
        got = out.tensors["images"][0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=prompt)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dit_stage_refuses_text_it_cannot_encode(two_stage):
    # The DiT loads no text encoder: only the encoder stage can turn text into states.
    dit = two_stage.engine.orchestrator.stages["dit"]

    async def direct():
        return [o async for o in dit.generate("direct", "x", dit.sampling_params(SIZE))]

    with pytest.raises(ValueError, match="without its text encoder"):
        two_stage._run(direct())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_encoder_states_equal_diffusers_prompt_embeds(two_stage, folder):
    # The tiny DiT's image moves little with the prompt (the template's rows dominate), so
    # the conditioning itself is checked: the encoder stage's states, minus the template
    # prefix the DiT drops, are diffusers' `encode_prompt` embeddings (its mask's rows).
    from diffusers import DiffusionPipeline

    from vllm_omni.models.qwen_image.stages import encoder_prompts
    from vllm_omni.transfer.connectors import SharedMemoryConnector

    encoder = two_stage.engine.orchestrator.stages["encoder"]
    texts = [p for p, _ in REQUESTS] + ["blurry"]

    async def states(i, text):
        prompt = encoder_prompts({}, {"prompt": text}, encoder, {})
        outs = [o async for o in encoder.generate(f"enc{i}", prompt,
                                                  encoder.sampling_params(None))]
        rows = SharedMemoryConnector().get(outs[-1].tensor_handles["hidden_states"])
        return rows["hidden_states"][: len(outs[-1].prompt_token_ids)]

    async def all_at_once():
        return await asyncio.gather(*(states(i, t) for i, t in enumerate(texts)))

    got = two_stage._run(all_at_once())
    pipe = DiffusionPipeline.from_pretrained(folder)
    embeds, mask = pipe.encode_prompt(texts, device="cpu")
    drop = pipe.prompt_template_encode_start_idx
    for rows, want, m in zip(got, embeds, mask, strict=True):
        want = want[m.bool()]
        assert rows.shape[0] - drop == want.shape[0]
        torch.testing.assert_close(rows[drop:], want, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chat_draws_the_last_user_message(two_stage):
    # The encoder writes no text, so chat is not rendered by its chat template: the last
    # user message is the prompt, as on a one-stage diffusion pipeline.
    import base64
    import io

    from PIL import Image

    from vllm_omni.entrypoints.openai.protocol import OmniChatCompletionRequest
    from vllm_omni.entrypoints.openai.serving_base import EntryRenderer
    from vllm_omni.entrypoints.openai.serving_chat import OmniServingChat
    from vllm_omni.entrypoints.openai.serving_images import OmniServingImages

    omni = two_stage.engine
    renderer = EntryRenderer(omni)
    assert renderer.get() is None
    chat = OmniServingChat(omni, ["m"], renderer, OmniServingImages(omni, ["m"]))
    request = OmniChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "a cat"}],
        stage_sampling_params={"dit": {**SIZE, "seed": 1}})
    body = two_stage._run(chat.chat(request, "chat-1"))
    (part,) = body["choices"][0]["message"]["content"]
    png = base64.b64decode(part["image_url"]["url"].partition(",")[2])
    got = np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)
    (want,) = two_stage.generate("a cat", [None, {**SIZE, "seed": 1}])
    assert np.abs(got - np.asarray(want.images[0], dtype=np.int16)).max() <= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_input_image_is_refused_with_a_message(two_stage):
    from PIL import Image

    image = Image.new("RGB", (32, 32), "red")
    with pytest.raises(Exception, match="stage 'encoder'.*takes no input image"):
        two_stage.generate({"prompt": "make it blue", "multi_modal_data": {"image": [image]}},
                           [None, SIZE])
