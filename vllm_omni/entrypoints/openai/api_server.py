"""The OpenAI-compatible HTTP server of vllm-omni (FastAPI + uvicorn): the servings, the
route table and the middlewares; one request's handling is handling.py's, the OpenAPI
description openapi.py's."""

from __future__ import annotations

import contextlib
import logging
import time
from argparse import Namespace
from http import HTTPStatus
from pathlib import Path
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from vllm_omni.engine.stage import Stage
from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.handling import FORM, Route, handle
from vllm_omni.entrypoints.openai.info import pipeline_info
from vllm_omni.entrypoints.openai.limits import (
    AdmissionMiddleware,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    Lane,
)
from vllm_omni.entrypoints.openai.openapi import (
    VIDEO_CONTENT_PARAMS,
    VIDEO_ID_PARAMS,
    VIDEO_LIST_PARAMS,
    describe_bodies,
)
from vllm_omni.entrypoints.openai.protocol import (
    ImageGenerationRequest,
    LoadLoraAdapterRequest,
    OmniChatCompletionRequest,
    OmniCompletionRequest,
    SpeechRequest,
    UnloadLoraAdapterRequest,
    VideoCreateRequest,
    error_response,
)
from vllm_omni.entrypoints.openai.realtime import RealtimeEndpoint
from vllm_omni.entrypoints.openai.serving_base import EntryRenderer
from vllm_omni.entrypoints.openai.serving_chat import OmniServingChat
from vllm_omni.entrypoints.openai.serving_completion import OmniServingCompletion
from vllm_omni.entrypoints.openai.serving_images import OmniServingImages
from vllm_omni.entrypoints.openai.serving_lora import OmniServingLora
from vllm_omni.entrypoints.openai.serving_speech import OmniServingSpeech
from vllm_omni.entrypoints.openai.serving_transcription import OmniServingTranscription
from vllm_omni.entrypoints.openai.serving_videos import OmniServingVideos
from vllm_omni.entrypoints.openai.video_jobs import VideoJobs

logger = logging.getLogger(__name__)

# The web playground served at / (static files, no build step, nothing fetched from outside).
PLAYGROUND = Path(__file__).parent / "playground"


def build_app(omni: AsyncOmniLLM, served_model_names: list[str], args: Namespace) -> FastAPI:
    app = FastAPI(title="vllm-omni", docs_url=None if args.disable_fastapi_docs else "/docs")
    add_middlewares(app, args, admission_lanes(omni))
    routes, realtime = api_routes(omni, served_model_names, args)
    for route in routes:
        app.add_api_route(route.path, _endpoint(route, args.request_timeout),
                          methods=[route.method], openapi_extra=route.openapi_extra)
    app.add_api_websocket_route("/v1/realtime", realtime.serve)
    add_service_routes(app, omni, served_model_names, args)
    describe_bodies(app)
    return app


def admission_lanes(omni: AsyncOmniLLM) -> list[tuple[str, Lane]]:
    """Where each API route's requests queue first: images and videos at the stage that
    draws them (a DiT behind a text encoder is where they wait), the rest at the entry
    stage."""
    lanes: dict[str, Lane] = {}

    def lane(stage: Stage) -> Lane:
        return lanes.setdefault(stage.name, Lane(stage.name, stage.info.max_running))

    routes = [(prefix, lane(stage)) for prefix, stage in
              (("/v1/images/", omni.image_stage), ("/v1/videos", omni.video_stage)) if stage]
    return [*routes, ("/v1/", lane(omni.entry_stage))]


def add_middlewares(app: FastAPI, args: Namespace, lanes: list[tuple[str, Lane]]) -> None:
    if args.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_credentials=args.allow_credentials,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
        )
    # The last added runs first: the key, then the body's size, then admission.
    app.add_middleware(AdmissionMiddleware, lanes=lanes, max_pending=args.max_pending_requests,
                       max_concurrent=args.max_concurrent_requests)
    app.add_middleware(BodyLimitMiddleware, limit=int(args.max_request_body_mb * (1 << 20)))
    api_keys = [k for k in (args.api_key or []) if k]
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys,
                           public_metrics=args.public_metrics)


def api_routes(omni: AsyncOmniLLM, served_model_names: list[str], args: Namespace
               ) -> tuple[list[Route], RealtimeEndpoint]:
    """The OpenAI API's HTTP routes, each bound to its serving, and its Realtime socket."""
    from vllm.renderers.chat_utils import load_chat_template

    # The entry stage's renderer, shared: chat, completions and speech render alike.
    renderer = EntryRenderer(
        omni,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
    )
    images = OmniServingImages(omni, served_model_names)
    chat = OmniServingChat(omni, served_model_names, renderer, images,
                           response_role=args.response_role)
    completions = OmniServingCompletion(omni, served_model_names, renderer)
    speech = OmniServingSpeech(omni, served_model_names, renderer)
    transcription = OmniServingTranscription(omni, served_model_names, renderer)
    videos = OmniServingVideos(omni, served_model_names,
                               VideoJobs(args.max_video_jobs, args.video_job_ttl, args.video_dir),
                               args.max_video_seconds)

    def path(r: Request, name: str) -> str:
        return r.path_params[name]

    def query(r: Request, name: str) -> str | None:
        return r.query_params.get(name)

    lora = OmniServingLora(omni, served_model_names)
    realtime = RealtimeEndpoint(chat, [k for k in (args.api_key or []) if k],
                                args.max_realtime_sessions, args.realtime_idle_timeout,
                                transcription)
    return [
        Route("POST", "/v1/chat/completions", "chat", chat.chat,
              OmniChatCompletionRequest, "chatcmpl"),
        Route("POST", "/v1/completions", "completions", completions.completion,
              OmniCompletionRequest, "cmpl"),
        Route("POST", "/v1/images/generations", "images", images.generations,
              ImageGenerationRequest, "img"),
        Route("POST", "/v1/images/edits", "image_edits", images.edits, FORM, "imgedit"),
        Route("POST", "/v1/audio/speech", "speech", speech.speech, SpeechRequest, "speech"),
        Route("POST", "/v1/audio/transcriptions", "transcriptions", transcription.transcribe,
              FORM, "trsc"),
        Route("POST", "/v1/videos", "videos", videos.create, VideoCreateRequest, "video",
              forms=True),
        Route("POST", "/v1/load_lora_adapter", "load_lora", lora.load, LoadLoraAdapterRequest,
              "lora"),
        Route("POST", "/v1/unload_lora_adapter", "unload_lora", lora.unload,
              UnloadLoraAdapterRequest, "lora"),
        Route("GET", "/v1/videos", "videos_list", lambda r: videos.list(
            query(r, "after"), query(r, "limit"), query(r, "order")),
            openapi_extra=VIDEO_LIST_PARAMS),
        Route("GET", "/v1/videos/{video_id}", "videos_retrieve",
              lambda r: videos.retrieve(path(r, "video_id")), openapi_extra=VIDEO_ID_PARAMS),
        Route("DELETE", "/v1/videos/{video_id}", "videos_delete",
              lambda r: videos.delete(path(r, "video_id")), openapi_extra=VIDEO_ID_PARAMS),
        Route("GET", "/v1/videos/{video_id}/content", "videos_content",
              lambda r: videos.content(path(r, "video_id"), query(r, "variant")),
              openapi_extra=VIDEO_CONTENT_PARAMS),
    ], realtime


def _endpoint(route: Route, timeout: float | None):
    async def endpoint(request: Request) -> Response:
        return await handle(request, route, timeout)

    endpoint.__name__ = route.endpoint  # the operation's name in /openapi.json
    return endpoint


def add_service_routes(app: FastAPI, omni: AsyncOmniLLM, served_model_names: list[str],
                       args: Namespace) -> None:
    """What the server says of itself: models, pipeline info and plan, health, metrics, the
    playground, and OpenAI-shaped errors for unknown routes and methods."""
    info = pipeline_info(omni, served_model_names)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        text = omni.text_stage
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm-omni",
                "root": omni.model,
                **({"max_model_len": text.info.max_model_len} if text else {}),
            }
            for name in served_model_names
        ]
        data += [{"id": name, "object": "model", "created": int(time.time()),
                  "owned_by": "vllm-omni", "root": path, "parent": served_model_names[0]}
                 for name, path in omni.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/omni/info")
    async def omni_info() -> JSONResponse:
        """What the pipeline does: its stages, outputs, inputs, voices and image defaults."""
        return JSONResponse(info)

    if not args.no_playground:
        app.mount("/playground", StaticFiles(directory=PLAYGROUND, html=True), "playground")

        @app.get("/", include_in_schema=False)
        async def playground() -> Response:
            return FileResponse(PLAYGROUND / "index.html")

    @app.get("/v1/omni/plan")
    async def memory_plan() -> JSONResponse:
        """The memory plan the pipeline started with (bytes per stage and device)."""
        return JSONResponse(omni.memory_plan.as_dict())

    @app.get("/health")
    async def health() -> Response:
        try:
            await omni.check_health()
        except Exception as e:
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"unhealthy: {e}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(HTTPStatus.NOT_FOUND, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method} not allowed on {request.url.path}"
        )


def run_server(args: Namespace, engine_kwargs: dict[str, Any]) -> None:
    """Start the stages, then serve HTTP until interrupted; stages are shut down on exit."""
    import uvloop

    uvloop.run(serve_http(args, engine_kwargs))


async def serve_http(args: Namespace, engine_kwargs: dict[str, Any]) -> None:
    # Built inside the running loop, as vLLM builds its AsyncLLM, so its sockets bind to it.
    omni = AsyncOmniLLM(
        args.model,
        stage_configs_path=args.stage_configs_path,
        cache_config=getattr(args, "cache_config", None),
        stage_restarts=args.stage_restarts,
        stage_hang_timeout=args.stage_hang_timeout or None,
        diffusion_parallel=getattr(args, "diffusion_parallel", None),
        lora_modules={m.name: m.path for m in getattr(args, "lora_modules", None) or []},
        ray_address=getattr(args, "ray_address", None),
        ray_placement_timeout=getattr(args, "ray_placement_timeout", 60.0),
        **engine_kwargs,
    )
    try:
        names = args.served_model_name or [args.model]
        config = uvicorn.Config(
            build_app(omni, names, args),
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path or "",
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            timeout_keep_alive=5,
        )
        logger.info(
            "vllm-omni serving %s (pipeline %r) on http://%s:%d",
            names[0],
            omni.pipeline.name,
            args.host or "0.0.0.0",
            args.port,
        )
        await _Server(config, on_exit=omni.shutdown).serve()
    finally:
        omni.shutdown()


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT once serving ends, which would kill this process
    before its stages' engine processes are stopped (leaving them orphaned). Stop the stages
    first, while uvicorn's handlers are still installed."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                self._on_exit()
