"""Request models (vLLM's OpenAI request models plus vllm-omni's extension fields, and the
image and speech requests), and the errors that become OpenAI-style error responses."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse


class AudioOutputParams(BaseModel):
    """OpenAI's `audio` request field: how to speak when `modalities` has "audio"."""

    voice: str | None = None
    format: str = "wav"


class OmniChatCompletionRequest(ChatCompletionRequest):
    audio: AudioOutputParams | None = Field(
        default=None, description='Voice and format of the spoken answer (modalities "audio").'
    )
    stage_sampling_params: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description="Per-stage sampling overrides, keyed by stage name "
        '(e.g. {"talker": {"temperature": 0.9}}). They apply over the request\'s '
        "own sampling fields for the text stage and over the stage defaults elsewhere.",
    )
    modalities: list[str] | None = Field(
        default=None,
        description='Outputs to compute, as in OpenAI\'s API (e.g. ["text"]); stages that '
        "only serve other outputs are skipped. Default: every final output of the pipeline.",
    )
    lora_scale: float | None = Field(
        default=None, description="The weight of the LoRA adapter `model` names (a "
        "diffusion pipeline's adapters are models).")

    @model_validator(mode="after")
    def _chat_messages_only(self) -> OmniChatCompletionRequest:
        # vLLM's message union also admits openai-harmony `Message` objects (gpt-oss's
        # format: author, recipient, channel), which its chat renderer cannot read: such a
        # body is the caller's mistake, not a server error.
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] is not a chat message: it needs a 'role' "
                                 "(system, user, assistant, tool, ...) and its 'content'")
        return self


class OmniCompletionRequest(CompletionRequest):
    stage_sampling_params: dict[str, dict[str, Any]] | None = Field(
        default=None, description="Per-stage sampling overrides, keyed by stage name."
    )


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
    # As vLLM's: lower is served first, where the stage's scheduling_policy is "priority".
    priority: int | None = None
    # The weight of the LoRA adapter the request's `model` names.
    lora_scale: float | None = None
    # Per-stage overrides by stage name (the LLM before a DiT, say), over the fields above.
    stage_sampling_params: dict[str, dict[str, Any]] | None = None

    @field_validator("cache", "stage_sampling_params", mode="before")
    @classmethod
    def _json_in_forms(cls, value: Any) -> Any:
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
                     "true_cfg_scale", "seed", "strength", "cache", "priority"},
            exclude_none=True,
        )
        if self.size:
            w, _, h = self.size.partition("x")
            params.update(width=int(w), height=int(h))
        params["num_images"] = self.n
        return params


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter (its `lora_int_id` is taken, unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def parse_size(value: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' as (width, height); a ValueError naming the form otherwise."""
    w, sep, h = value.partition("x")
    if not (sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise ValueError(f"must be 'WIDTHxHEIGHT' (e.g. '832x480'), got {value!r}")
    return int(w), int(h)


class VideoCreateRequest(BaseModel):
    """OpenAI's video creation fields (a multipart form from the openai client, or JSON),
    plus the diffusion controls as extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    # OpenAI sends seconds as a string ("4"); any positive number of seconds is taken.
    seconds: float | None = Field(default=None, gt=0)
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT'")
    # An image for image-to-video models: an uploaded file, or {"image_url": data URL}.
    input_reference: Any = None
    # Extensions (pass them in the openai client's `extra_body`).
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1, le=120)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    # Step caching for this request (CacheConfig's fields; over the server's --cache-config).
    cache: dict[str, Any] | None = None
    priority: int | None = None  # as the images API's
    lora_scale: float | None = None  # the weight of the LoRA adapter `model` names
    # Per-stage overrides by stage name (the LLM before a DiT, say), over the fields above.
    stage_sampling_params: dict[str, dict[str, Any]] | None = None

    @field_validator("cache", "stage_sampling_params", mode="before")
    @classmethod
    def _cache(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value  # a form's JSON text

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value


class SpeechRequest(BaseModel):
    """OpenAI's speech request, plus `stage_sampling_params` (per-stage overrides)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = None
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    stage_sampling_params: dict[str, dict[str, Any]] | None = None


class OmniHTTPError(Exception):
    """An error that becomes an OpenAI-style error response."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def parse_model(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """Validate `data` as `model`; a failure is a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = f"{field}: {err['msg']}" if field else err["msg"]
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, msg, field) from None
    except (TypeError, AttributeError, KeyError) as e:
        # vLLM's "before" validators read fields before pydantic has checked their types
        # (`"messages": false` meets a `for msg in messages`): still the body's fault.
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                            f"request body does not match the schema: {e}") from None


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    kind = status.phrase.replace(" ", "") + ("Error" if status < 500 else "")
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=int(status))


async def rendered(call: Awaitable[Any]) -> Any:
    """What a vLLM renderer made of a request. Renderers answer some bad requests with an
    ErrorResponse and raise for others, as vLLM's own server expects of them: a media URL
    they may not read (RuntimeError), a payload that does not decode (ValueError). Each is
    the request's fault: a 4xx with vLLM's message."""
    try:
        result = await call
    except (ValueError, RuntimeError) as e:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, str(e)) from e
    if isinstance(result, ErrorResponse):
        err = result.error
        raise OmniHTTPError(HTTPStatus(err.code), err.message, err.param)
    return result


def check_stage_names(overrides: dict[str, Any], names: list[str]) -> None:
    """A 400 when `stage_sampling_params` names stages the pipeline does not have."""
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise OmniHTTPError(
            HTTPStatus.BAD_REQUEST,
            f"stage_sampling_params names unknown stages {unknown}; stages are {names}",
            "stage_sampling_params",
        )
