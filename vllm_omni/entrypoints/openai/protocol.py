"""Request models: vLLM's OpenAI request models plus vllm-omni's extension fields."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
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


class OmniCompletionRequest(CompletionRequest):
    stage_sampling_params: dict[str, dict[str, Any]] | None = Field(
        default=None, description="Per-stage sampling overrides, keyed by stage name."
    )


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


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    kind = status.phrase.replace(" ", "") + ("Error" if status < 500 else "")
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=int(status))


def raise_for_error(result: Any) -> Any:
    """vLLM's renderers return an ErrorResponse instead of raising: raise it as a 4xx."""
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
