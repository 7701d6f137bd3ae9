"""The OpenAPI description of the routes: the handlers read bodies and parameters
themselves (to answer OpenAI-shaped errors), so FastAPI cannot see them; they are put in
/openapi.json here."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from vllm_omni.entrypoints.openai.protocol import (
    ImageGenerationRequest,
    LoadLoraAdapterRequest,
    OmniChatCompletionRequest,
    OmniCompletionRequest,
    SpeechRequest,
    UnloadLoraAdapterRequest,
    VideoCreateRequest,
)

JSON_BODIES = {
    "/v1/chat/completions": OmniChatCompletionRequest,
    "/v1/completions": OmniCompletionRequest,
    "/v1/images/generations": ImageGenerationRequest,
    "/v1/audio/speech": SpeechRequest,
    "/v1/videos": VideoCreateRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
EDIT_FORM = {"type": "object", "required": ["image", "prompt"], "properties": {
    "image": {"type": "string", "format": "binary"}, "prompt": {"type": "string"},
    "model": {"type": "string"}, "n": {"type": "integer"}, "size": {"type": "string"},
    "seed": {"type": "integer"}, "num_inference_steps": {"type": "integer"},
    "strength": {"type": "number"}, "negative_prompt": {"type": "string"},
    "priority": {"type": "integer"}}}

TRANSCRIPTION_FORM = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
    "language": {"type": "string"}, "prompt": {"type": "string"},
    "response_format": {"type": "string", "enum": ["json", "text"]},
    "temperature": {"type": "number"}, "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer"}}}


def _param(name: str, where: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema}


VIDEO_ID_PARAMS = {"parameters": [
    _param("video_id", "path", {"type": "string", "pattern": "^video_[0-9a-f]{32}$"})]}
VIDEO_CONTENT_PARAMS = {"parameters": [
    *VIDEO_ID_PARAMS["parameters"],
    _param("variant", "query", {"type": "string", "enum": ["video", "thumbnail"]})]}
VIDEO_LIST_PARAMS = {"parameters": [
    _param("after", "query", {"type": "string"}),
    _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}),
    _param("order", "query", {"type": "string", "enum": ["asc", "desc"]})]}


def describe_bodies(app: FastAPI) -> None:
    """Put each route's real request body in /openapi.json: the handlers read the body
    themselves (to answer OpenAI-shaped errors), so FastAPI cannot see their models."""
    from fastapi.openapi.utils import get_openapi

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            shared = spec.setdefault("components", {}).setdefault("schemas", {})
            bodies = {path: ("application/json", model.model_json_schema(
                ref_template="#/components/schemas/{model}")) for path, model in
                JSON_BODIES.items()}
            bodies["/v1/images/edits"] = ("multipart/form-data", EDIT_FORM)
            bodies["/v1/audio/transcriptions"] = ("multipart/form-data", TRANSCRIPTION_FORM)
            for path, (kind, schema) in bodies.items():
                shared.update(schema.pop("$defs", {}))
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {kind: {"schema": schema}}}
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = build
