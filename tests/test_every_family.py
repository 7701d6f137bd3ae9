"""Every tiny image pipeline the factory builds is served from its folder and answers the
images API with what diffusers makes for the same seed: the step-level families and the ones
that run whole requests (PixArt-Sigma, Sana). Wan makes videos: tests/test_videos.py."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from conftest import ServerProcess
from PIL import Image

from vllm_omni.testing.tiny_diffusers import DIFFUSERS_MODELS
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The image-to-image models need an input image: tests/test_images_server.py and
# tests/test_qwen_image_edit.py edit with them.
TEXT_TO_IMAGE = [m for m in DIFFUSERS_MODELS
                 if m not in ("sd3-img2img-tiny", "qwen-image-edit-tiny", "wan-tiny",
                              "wan-i2v-tiny")]
REQUEST = {"prompt": "a red cat", "size": "64x64", "seed": 3, "num_inference_steps": 2}


def reference_frames(folder, pipeline_class: str) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"height": 64, "width": 64, "num_inference_steps": 2, "output_type": "np",
              "generator": torch.Generator().manual_seed(REQUEST["seed"])}
    if pipeline_class in ("PixArtSigmaPipeline", "SanaPipeline"):
        kwargs["use_resolution_binning"] = False
    return pipe(REQUEST["prompt"], **kwargs).images


@pytest.mark.parametrize("name", TEXT_TO_IMAGE)
def test_each_family_is_served_and_equals_diffusers(name, tmp_path_factory):
    folder = make_tiny(name, tmp_path_factory.mktemp("family") / name)
    pipeline_class = __import__("json").loads((folder / "model_index.json").read_text())[
        "_class_name"]
    srv = ServerProcess([str(folder)], tmp_path_factory.mktemp("log") / f"{name}.log")
    try:
        reply = httpx.post(srv.url + "/v1/images/generations", json=REQUEST, timeout=300)
        assert reply.status_code == 200, reply.text
        data = reply.json()["data"]
    finally:
        assert srv.stop(), "processes of the server were still alive after SIGTERM"
    want = reference_frames(folder, pipeline_class)
    assert len(data) == len(want)
    for item, ref in zip(data, want, strict=True):
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))),
                         dtype=np.int16)
        ref8 = np.asarray((ref * 255).round().astype("uint8"), dtype=np.int16)
        assert got.shape == (64, 64, 3)
        assert np.abs(got - ref8).max() <= 1, name  # 8-bit rounding of equal float images
