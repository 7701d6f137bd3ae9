"""`/v1/images/generations` and `/v1/images/edits`, and the image generation behind
`/v1/chat/completions` on a pipeline whose final output is images."""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

from vllm_omni.entrypoints.openai.images import decode_image, encode_image
from vllm_omni.entrypoints.openai.protocol import (
    ImageGenerationRequest,
    OmniHTTPError,
    parse_model,
)
from vllm_omni.entrypoints.openai.serving_base import OmniServing
from vllm_omni.outputs import OmniRequestOutput


class OmniServingImages(OmniServing):
    """Runs a request for the pipeline's image output and answers in OpenAI's images shape
    (base64 images inline, plus the seed, cache statistics and seconds per stage)."""

    def stage_name(self) -> str:
        """The stage whose images are the answer; a 400 for a pipeline that makes none."""
        stage = self.omni.image_stage
        if stage is None:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST,
                f"pipeline {self.omni.pipeline.name!r} does not output images",
            )
        return stage.name

    async def generate_images(
        self,
        prompt: Any,
        diffusion: dict[str, Any],
        request_id: str,
        stage_sampling_params: dict[str, dict[str, Any]] | None = None,
    ) -> OmniRequestOutput:
        """The image stage's finished output. `diffusion` are the image stage's parameters,
        `stage_sampling_params` the request's per-stage ones over them."""
        name = self.stage_name()
        overrides = self.stage_overrides(stage_sampling_params, {name: diffusion})
        final = None
        async for out in self.omni.generate(prompt, self.in_stage_order(overrides), request_id,
                                            ["image"]):
            if out.finished and out.stage == name:
                final = out
        assert final is not None, "the image stage finished without an output"
        return final

    def _response(self, request: ImageGenerationRequest, out: OmniRequestOutput) -> dict:
        data = [
            {"b64_json": encode_image(img, request.output_format, request.output_compression)}
            for img in out.images
        ]
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": request.output_format,
            "size": f"{out.images[0].width}x{out.images[0].height}" if out.images else None,
            "seed": out.metrics.get("seed"),
            "cache": out.metrics.get("cache"),
            "stage_seconds": dict(out.metrics.get("stage_seconds") or {}),
        }

    def _params(self, request: ImageGenerationRequest) -> dict[str, Any]:
        return {**request.diffusion_params(),
                **self.adapter_params(request.model, request.lora_scale)}

    async def generations(self, request: ImageGenerationRequest, request_id: str) -> dict:
        self.check_model(request.model, adapters=True)
        out = await self.generate_images(request.prompt, self._params(request), request_id,
                                         request.stage_sampling_params)
        return self._response(request, out)

    async def edits(self, form: dict[str, Any], request_id: str) -> dict:
        """`form`: the multipart fields; 'image' (or 'image[]') holds the uploaded images."""
        uploads = form.pop("image", []) + form.pop("image[]", [])
        if not uploads:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "image: at least one image is required",
                                "image")
        if form.pop("mask", None):
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "mask: masked edits are not supported",
                                "mask")
        request = parse_model(ImageGenerationRequest, {k: v[-1] for k, v in form.items()})
        self.check_model(request.model, adapters=True)
        images = [decode_image(data, "image") for data in uploads]
        prompt = {"prompt": request.prompt, "multi_modal_data": {"image": images}}
        out = await self.generate_images(prompt, self._params(request), request_id,
                                         request.stage_sampling_params)
        return self._response(request, out)
