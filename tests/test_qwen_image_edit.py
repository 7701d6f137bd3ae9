"""Qwen-Image-Edit on two stages: its Qwen2.5-VL text encoder on vLLM, seeing the input
image through the folder's processor (hidden states out) -> the DiT on our engine, with the
image's VAE latents beside the noise. Against diffusers' QwenImageEditPipeline for the same
seeds: concurrent requests with different prompts, images (two aspect ratios, so two image
grids), output sizes and seeds, with and without true CFG; then through the server with the
openai client (images.edit and chat with an image part)."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import struct
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import ServerProcess
from PIL import Image

from vllm_omni.config import resolve_pipeline
from vllm_omni.testing.tiny_models import make_tiny
from vllm_omni.transfer.connectors import unread_payloads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def picture(seed: int, width: int, height: int) -> Image.Image:
    """A smooth random picture (noise blown up), so that resizing keeps its content."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8))
    return small.resize((width, height), Image.BILINEAR)


WIDE, WIDE_2, SQUARE = picture(1, 60, 40), picture(2, 90, 60), picture(3, 40, 40)
# The first two differ only in their image (of the same aspect: the same grids, batched
# together); the others in everything, two with true CFG.
REQUESTS = [
    ("make it blue", WIDE, {"seed": 1, "height": 32, "width": 48}),
    ("make it blue", WIDE_2, {"seed": 1, "height": 32, "width": 48}),
    ("turn it into a painting", SQUARE, {"seed": 3, "height": 48, "width": 32,
                                         "negative_prompt": "blurry", "true_cfg_scale": 3.0}),
    ("make it night", WIDE, {"seed": 4, "height": 32, "width": 32,
                             "negative_prompt": "a much longer negative prompt",
                             "true_cfg_scale": 2.0}),
]
STEPS = {"num_inference_steps": 2}
FLOATS = {"float_output": True}  # compared as floats: asked of the engine


def shm_segments() -> set[str]:
    return unread_payloads()  # a pool's free segments are its memory, not a payload


@pytest.fixture(scope="module", autouse=True)
def shm_left_as_found():
    """Set up first, torn down last: after every engine of the module has stopped."""
    before = shm_segments()
    yield
    deadline = time.monotonic() + 10
    while shm_segments() - before and time.monotonic() < deadline:
        time.sleep(0.5)  # another test's request on this machine may still hold one
    assert not shm_segments() - before


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from vllm_omni.compat.torchvision_free import install

    install()  # in this process too: diffusers' processor as vLLM's
    return make_tiny("qwen-image-edit-tiny", tmp_path_factory.mktemp("qie") / "qie")


@pytest.fixture(scope="module")
def engines():
    """The module's running engines, one at a time: the offline pipeline and the server each
    hold both stages, and two of those do not fit a small CPU machine's memory plan."""
    held: dict = {}
    yield held
    stop_all(held)


def stop_all(held: dict) -> None:
    if "offline" in held:
        held.pop("offline").shutdown()
    if "server" in held:
        assert held.pop("server").stop(), "processes of the server were still alive"


@pytest.fixture
def two_stage(engines, folder):
    from vllm_omni import OmniLLM

    if "offline" not in engines:
        stop_all(engines)
        # fp32 on both stages (vLLM would run an fp32 checkpoint in bf16 on a CPU).
        engines["offline"] = OmniLLM(str(folder), dtype="float32",
                                     kv_cache_memory_bytes=1 << 28)
    return engines["offline"]


@pytest.fixture
def server(engines, folder, tmp_path_factory):
    if "server" not in engines:
        stop_all(engines)
        # fp32, as the reference (vLLM would run the fp32 encoder in bf16 on a CPU).
        engines["server"] = ServerProcess([str(folder), "--dtype", "float32"],
                                          tmp_path_factory.mktemp("log") / "qie-server.log",
                                          timeout=600)
    return engines["server"]


def hf_encoder_with_token_types(text_encoder) -> None:
    """Make diffusers' text encoder place the vision tokens as Qwen2.5-VL does.

    transformers 5.x computes Qwen2.5-VL's 3-D (multimodal RoPE) positions only when given
    the processor's `mm_token_type_ids`; diffusers 0.42.1's edit pipeline does not pass them
    (diffusers issue #14194), so the model silently falls back to 1-D text positions for
    the image tokens, unlike the model as trained and as vLLM runs it. This hands it the
    token types the processor computes (1 for image tokens), as diffusers' pending fix does."""
    image_token = text_encoder.config.image_token_id

    def add_token_types(_module, args, kwargs):
        ids = kwargs.get("input_ids")
        if kwargs.get("mm_token_type_ids") is None and kwargs.get("pixel_values") is not None:
            kwargs["mm_token_type_ids"] = (ids == image_token).long()
        return args, kwargs

    text_encoder.register_forward_pre_hook(add_token_types, with_kwargs=True)


@functools.cache
def reference_pipeline(folder: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    hf_encoder_with_token_types(pipe.text_encoder)
    return pipe


def reference(folder: Path, prompt: str, image: Image.Image, dit: dict) -> np.ndarray:
    """diffusers' image (float, HWC), or with `output: latent` its packed latents."""
    kwargs = {k: v for k, v in dit.items() if k not in ("seed", "output")}
    output = "latent" if dit.get("output") == "latent" else "np"
    out = reference_pipeline(folder)(
        image, prompt, generator=torch.Generator().manual_seed(dit["seed"]),
        output_type=output, **kwargs).images[0]
    return out.numpy() if output == "latent" else out


def test_the_pipeline_class_picks_the_edit_pipeline(folder):
    pipeline = resolve_pipeline(folder)
    assert pipeline.name == "qwen_image_edit"
    assert [(s.name, s.engine, s.output) for s in pipeline.stages] == [
        ("encoder", "ar", "hidden_states"), ("dit", "diffusion", "image")]


def test_vllm_processes_the_image_as_diffusers(two_stage, folder):
    # vLLM calls the processor its processing info returns: the folder's processor/, not
    # text_encoder/ (which has none), with the same pixel values and grid as diffusers'.
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from vllm_omni.models.qwen_image.stages import bare_pipeline

    encoder = two_stage.engine.orchestrator.stages["encoder"]
    info = MULTIMODAL_REGISTRY.create_processor(encoder.info.model_config).info
    pipe = reference_pipeline(folder)
    resized = bare_pipeline("QwenImageEditPipeline").image_processor.resize(WIDE, 832, 1248)
    text = pipe.prompt_template_encode.format("make it blue")
    want = pipe.processor(text=[text], images=resized, return_tensors="pt")
    # As vLLM calls it: with the engine's processor options (e.g. whether the vision tower
    # normalises the pixels itself, which would leave them raw here).
    got = info.ctx.call_hf_processor(info.get_hf_processor(),
                                     {"text": [text], "images": [resized]})
    assert want["image_grid_thw"].tolist() == got["image_grid_thw"].tolist()
    assert torch.equal(want["pixel_values"], got["pixel_values"])
    assert torch.equal(want["input_ids"], got["input_ids"])


def test_concurrent_edits_equal_diffusers(two_stage, folder):
    # Every request's latents (the DiT's own output: the tiny random VAE decoder squashes any
    # latents into a narrow band of colours, hiding differences), and two decoded images,
    # all in flight together.
    engine = two_stage.engine
    jobs = [(p, image, {**dit, "output": "latent"}) for p, image, dit in REQUESTS]
    jobs += REQUESTS[1:3]

    async def one(i, prompt, image, dit):
        request = {"prompt": prompt, "multi_modal_data": {"image": image}}
        return [o async for o in engine.generate(request, [None, {**STEPS, **dit, **FLOATS}],
                                                 f"e{i}")
                if o.finished]

    async def all_at_once():
        return await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))

    results = two_stage._run(all_at_once())
    latents = []
    for (prompt, image, dit), outs in zip(jobs, results, strict=True):
        (out,) = outs
        assert out.stage == "dit" and out.prompt == prompt
        want = reference(folder, prompt, image, {**STEPS, **dit})
        if dit.get("output") == "latent":
            got = out.tensors["latents"][0].numpy()
            latents.append(got)
        else:
            got = out.tensors["images"][0].numpy()
            assert got.shape == (dit["height"], dit["width"], 3)
        print(f"{dit.get('output', 'image')} of {prompt!r}: max |ours - diffusers| = "
              f"{np.abs(got - want).max():.2e} (of {np.abs(want).max():.2f})")
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=prompt)
    # The comparison means something: the input image alone moves the latents.
    assert np.abs(latents[0] - latents[1]).max() > 1e-2


def test_the_encoder_states_equal_diffusers_prompt_embeds(two_stage, folder):
    # The conditioning itself, vision tokens included: the encoder stage's states, minus the
    # template rows the DiT drops, are diffusers' `encode_prompt` with the image.
    from vllm_omni.engine.diffusion.adapters.qwen_image_edit import edit_size
    from vllm_omni.models.qwen_image.stages import edit_encoder_prompts
    from vllm_omni.transfer.connectors import SharedMemoryConnector

    encoder = two_stage.engine.orchestrator.stages["encoder"]
    cases = [(prompt, image) for prompt, image, _ in REQUESTS[:3]]

    async def states(i, text, image):
        prompt = edit_encoder_prompts(
            {}, {"prompt": text, "multi_modal_data": {"image": image}}, encoder, {})
        outs = [o async for o in encoder.generate(f"enc{i}", prompt,
                                                  encoder.sampling_params(None))]
        rows = SharedMemoryConnector().get(outs[-1].tensor_handles["hidden_states"])
        return rows["hidden_states"][: len(outs[-1].prompt_token_ids)]

    async def all_at_once():
        return await asyncio.gather(*(states(i, *c) for i, c in enumerate(cases)))

    got = two_stage._run(all_at_once())
    pipe = reference_pipeline(folder)
    drop = pipe.prompt_template_encode_start_idx
    for rows, (text, image) in zip(got, cases, strict=True):
        width, height = edit_size(image)
        want, _ = pipe.encode_prompt(text, image=pipe.image_processor.resize(image, height,
                                                                             width))
        assert rows.shape[0] - drop == want.shape[1]
        torch.testing.assert_close(rows[drop:], want[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("images", [[], [WIDE, SQUARE]])
def test_an_edit_needs_exactly_one_image(two_stage, images):
    prompt = {"prompt": "make it blue", "multi_modal_data": {"image": images}}
    with pytest.raises(Exception, match="stage 'encoder'.*edits one input image"):
        two_stage.generate(prompt if images else "make it blue", [None, STEPS])


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.int16)


def assert_same_image(got: np.ndarray, want: np.ndarray) -> None:
    want8 = np.asarray((want * 255).round().astype("uint8"), dtype=np.int16)
    assert got.shape == want8.shape
    # 8-bit rounding of float images equal within 1e-4 can differ by one level.
    assert np.abs(got - want8).max() <= 1


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def huge_png_header(width: int, height: int) -> bytes:
    """A few bytes that declare a PNG of width x height pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def test_images_edit_through_the_server(server, folder):
    # 8-bit images: the tiny VAE decoder hides small differences; the latents above do not.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    # No size: the input image's, resized as the pipeline resizes it (1248x832 here).
    r = client.images.edit(image=("in.png", png(WIDE), "image/png"), prompt="make it blue",
                           extra_body={"seed": 5, "num_inference_steps": 1})
    assert r.size == "1248x832"
    want = reference(folder, "make it blue", WIDE, {"seed": 5, "num_inference_steps": 1})
    assert_same_image(decode(r.data[0].b64_json), want)

    # Chat with an image part edits it too.
    url = "data:image/png;base64," + base64.b64encode(png(SQUARE)).decode()
    dit = {"seed": 6, "height": 32, "width": 48, **STEPS}
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": [{"type": "text", "text": "make it green"},
                                               {"type": "image_url", "image_url": {"url": url}}]}],
        extra_body={"stage_sampling_params": {"dit": dit}})
    (part,) = chat.choices[0].message.content
    assert_same_image(decode(part["image_url"]["url"].partition(",")[2]),
                      reference(folder, "make it green", SQUARE, dit))


@pytest.mark.parametrize("files, words", [
    ({}, "image"),
    ({"image": ("a.png", b"not an image")}, "not a readable image"),
    ({"image": ("a.png", huge_png_header(20000, 20000))}, "image too large"),
])
def test_bad_edits_are_400(server, files, words):
    r = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"}, files=files or None,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_generating_without_an_image_is_400(server):
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "edits one input image" in r.json()["error"]["message"]
