"""Image generation over HTTP: `/v1/images/generations`, `/v1/images/edits`, and image
output of `/v1/chat/completions` for pipelines whose final output is images."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.protocol import OmniHTTPError, check_stage_names, parse_model
from vllm_omni.outputs import OmniRequestOutput

_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageGenerationRequest(BaseModel):
    """OpenAI's image generation fields, plus the diffusion controls as extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=16)
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT' or 'auto'")
    # Images are returned inline: this server keeps no files to link to.
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    user: str | None = None
    # Extensions (pass them in the openai client's `extra_body`).
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    strength: float | None = None
    # Step caching for this request (CacheConfig's fields; over the server's --cache-config).
    cache: dict[str, Any] | None = None

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, value: Any) -> Any:
        # A multipart form (images/edits) carries it as JSON text.
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value in (None, "auto"):
            return None
        w, sep, h = value.partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise ValueError(f"must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', got {value!r}")
        return value

    def diffusion_params(self) -> dict[str, Any]:
        params = self.model_dump(
            include={"negative_prompt", "num_inference_steps", "guidance_scale",
                     "true_cfg_scale", "seed", "strength", "cache"},
            exclude_none=True,
        )
        if self.size:
            w, _, h = self.size.partition("x")
            params.update(width=int(w), height=int(h))
        params["num_images"] = self.n
        return params


def encode_image(image: Image.Image, fmt: str, compression: int | None = None) -> str:
    buf = io.BytesIO()
    kwargs = {} if compression is None or fmt == "png" else {"quality": compression}
    image.save(buf, format=_PIL_FORMAT[fmt], **kwargs)
    return base64.b64encode(buf.getvalue()).decode()


def decode_image(data: bytes, field: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"{field}: not a readable image ({e})",
                            field) from None


def chat_image_prompt(messages: list[Any]) -> Any:
    """The diffusion prompt of a chat: the last user message's text, and its images (data
    URLs) for pipelines that edit images."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "messages: no user message to draw",
                            "messages")
    content = users[-1].get("content")
    if isinstance(content, str):
        return content
    texts, images = [], []
    for part in content or []:
        if part.get("type") == "text":
            texts.append(part["text"])
        elif part.get("type") == "image_url":
            url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else ""
            head, _, data = url.partition(";base64,")
            if not head.startswith("data:image/"):
                raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                    "image_url: only base64 data URLs are supported", "messages")
            images.append(decode_image(base64.b64decode(data), "messages"))
        else:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"messages: {part.get('type')!r} content is not supported here",
                                "messages")
    text = "\n".join(texts)
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


class ImageServing:
    def __init__(self, omni: AsyncOmniLLM, check_model: Callable[[str | None], None]) -> None:
        self.omni = omni
        self.check_model = check_model

    def stage_name(self) -> str:
        stage = self.omni.image_stage
        if stage is None:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST,
                f"pipeline {self.omni.pipeline.name!r} does not output images",
            )
        return stage.name

    async def generate_images(
        self, prompt: Any, diffusion: dict[str, Any], request_id: str, other: dict | None = None
    ) -> OmniRequestOutput:
        """Run the pipeline for its image output; `other` holds other stages' params."""
        name = self.stage_name()
        check_stage_names(other or {}, [s.name for s in self.omni.pipeline.stages])
        params = [
            diffusion if s.name == name else (other or {}).get(s.name)
            for s in self.omni.pipeline.stages
        ]
        final = None
        async for out in self.omni.generate(prompt, params, request_id, ["image"]):
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

    async def generations(self, request: ImageGenerationRequest, request_id: str) -> dict:
        self.check_model(request.model)
        out = await self.generate_images(request.prompt, request.diffusion_params(), request_id)
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
        self.check_model(request.model)
        images = [decode_image(data, "image") for data in uploads]
        prompt = {"prompt": request.prompt, "multi_modal_data": {"image": images}}
        out = await self.generate_images(prompt, request.diffusion_params(), request_id)
        return self._response(request, out)
