"""The OpenAI-compatible HTTP server of vllm-omni (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from pathlib import Path
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.info import pipeline_info
from vllm_omni.entrypoints.openai.limits import (
    AdmissionMiddleware,
    APIKeyMiddleware,
    BodyLimitMiddleware,
)
from vllm_omni.entrypoints.openai.protocol import (
    ImageGenerationRequest,
    OmniChatCompletionRequest,
    OmniCompletionRequest,
    OmniHTTPError,
    SpeechRequest,
    VideoCreateRequest,
    error_response,
    parse_model,
)
from vllm_omni.entrypoints.openai.serving_base import (
    EntryRenderer,
    error_event,
    error_status,
    new_request_id,
    sse,
)
from vllm_omni.entrypoints.openai.serving_chat import OmniServingChat
from vllm_omni.entrypoints.openai.serving_completion import OmniServingCompletion
from vllm_omni.entrypoints.openai.serving_images import OmniServingImages
from vllm_omni.entrypoints.openai.serving_speech import OmniServingSpeech
from vllm_omni.entrypoints.openai.serving_videos import OmniServingVideos
from vllm_omni.entrypoints.openai.video_jobs import VideoJobs

logger = logging.getLogger(__name__)

# The web playground served at / (static files, no build step, nothing fetched from outside).
PLAYGROUND = Path(__file__).parent / "playground"

REQUESTS = prometheus_client.Counter(
    "vllm_omni:http_requests", "Finished API requests", ["endpoint", "status"]
)
TIMED_OUT = prometheus_client.Counter(
    "vllm_omni:requests_timed_out", "API requests stopped at --request-timeout"
)
LATENCY = prometheus_client.Histogram(
    "vllm_omni:http_request_seconds", "Time from request to last byte", ["endpoint"]
)


async def _parse_json(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OmniHTTPError(
            HTTPStatus.BAD_REQUEST, f"request body is not valid JSON: {e}"
        ) from None
    if not isinstance(data, dict):
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "request body must be a JSON object")
    return parse_model(model, data)


async def _parse_form(request: Request) -> dict[str, list[Any]]:
    """A multipart form as {field: [values]}, uploaded files read into bytes."""
    try:
        form = await request.form()
    except OmniHTTPError:  # a body over the size limit
        raise
    except Exception as e:  # malformed multipart bodies raise several kinds of errors
        raise OmniHTTPError(
            HTTPStatus.BAD_REQUEST, f"request body is not a valid form: {e}"
        ) from None
    fields: dict[str, list[Any]] = {}
    for key, value in form.multi_items():
        if not isinstance(value, str):
            value = await value.read()
        fields.setdefault(key, []).append(value)
    return fields


def _nested(fields: dict[str, Any]) -> dict[str, Any]:
    """Form fields with objects in brackets, as the openai client sends `extra_body`'s
    dicts in a multipart form ('cache[method]'), back into objects."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        name, sep, rest = key.partition("[")
        if not (sep and rest.endswith("]") and name):
            out[key] = value
            continue
        target = out.setdefault(name, {})
        if not isinstance(target, dict):
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"{name}: given as a value and an object",
                                name)
        parts = rest[:-1].split("][")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"{key}: conflicting fields", name)
        target[parts[-1]] = value
    return out


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts the request in
    every stage) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # disconnected, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.info("Client disconnected; request aborted")
        return None
    return task.result()


JSON_BODIES = {
    "/v1/chat/completions": OmniChatCompletionRequest,
    "/v1/completions": OmniCompletionRequest,
    "/v1/images/generations": ImageGenerationRequest,
    "/v1/audio/speech": SpeechRequest,
    "/v1/videos": VideoCreateRequest,
}
EDIT_FORM = {"type": "object", "required": ["image", "prompt"], "properties": {
    "image": {"type": "string", "format": "binary"}, "prompt": {"type": "string"},
    "model": {"type": "string"}, "n": {"type": "integer"}, "size": {"type": "string"},
    "seed": {"type": "integer"}, "num_inference_steps": {"type": "integer"},
    "strength": {"type": "number"}, "negative_prompt": {"type": "string"}}}


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
            for path, (kind, schema) in bodies.items():
                shared.update(schema.pop("$defs", {}))
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {kind: {"schema": schema}}}
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = build


def build_app(omni: AsyncOmniLLM, served_model_names: list[str], args: Namespace) -> FastAPI:
    from vllm.renderers.chat_utils import load_chat_template

    # The entry stage's renderer, shared: chat, completions and speech render alike.
    renderer = EntryRenderer(
        omni,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
    )
    images_serving = OmniServingImages(omni, served_model_names)
    chat_serving = OmniServingChat(omni, served_model_names, renderer, images_serving,
                                   response_role=args.response_role)
    completion_serving = OmniServingCompletion(omni, served_model_names, renderer)
    speech_serving = OmniServingSpeech(omni, served_model_names, renderer)
    video_jobs = VideoJobs(args.max_video_jobs, args.video_job_ttl, args.video_dir)
    videos_serving = OmniServingVideos(omni, served_model_names, video_jobs,
                                       args.max_video_seconds)
    info = pipeline_info(omni, served_model_names)
    app = FastAPI(title="vllm-omni", docs_url=None if args.disable_fastapi_docs else "/docs")
    if args.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_credentials=args.allow_credentials,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
        )

    # The last added runs first: the key, then the body's size, then admission.
    app.add_middleware(AdmissionMiddleware, limit=args.max_pending_requests)
    app.add_middleware(BodyLimitMiddleware, limit=int(args.max_request_body_mb * (1 << 20)))
    api_keys = [k for k in (args.api_key or []) if k]
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys,
                           public_metrics=args.public_metrics)
    timeout = args.request_timeout

    async def serve(
        request: Request, endpoint: str, body_type: type[BaseModel] | None, id_prefix: str,
        method, forms: bool = False,
    ) -> Response:
        """Parse the body (JSON as `body_type`, or a multipart form when it is None; with
        `forms`, either, as `body_type`), run `method(body, request_id)`, and answer with its
        result: JSON, an SSE stream, or an OpenAI-style error."""

        async def handler():
            if body_type is None:
                body = await _parse_form(request)
            elif forms and request.headers.get("content-type", "").startswith(
                    ("multipart/form-data", "application/x-www-form-urlencoded")):
                fields = await _parse_form(request)
                body = parse_model(body_type, _nested({k: v[-1] for k, v in fields.items()}))
            else:
                body = await _parse_json(request, body_type)
            rid = request.headers.get("X-Request-Id") or new_request_id(id_prefix)
            return await method(body, rid)

        start = time.perf_counter()
        try:
            # Read whole now (the disconnect watcher also reads from the socket), and within
            # the deadline: a stalled upload must not hold a slot of --max-pending-requests.
            await _read_body(request, start, timeout)
            result = await _cancel_on_disconnect(request, _within(handler(), start, timeout))
        except Exception as e:
            status, message, param = error_status(e)
            if status == HTTPStatus.GATEWAY_TIMEOUT:
                logger.warning("Request to %s: %s", endpoint, message)
            elif status >= 500:
                logger.exception("Request to %s failed", endpoint)
            REQUESTS.labels(endpoint, str(int(status))).inc()
            return error_response(status, message, param)
        if result is None:  # client went away
            REQUESTS.labels(endpoint, "499").inc()
            return Response(status_code=499)
        if isinstance(result, Response):  # a file, or a stream of bytes (audio)
            REQUESTS.labels(endpoint, "200").inc()
            return result
        if isinstance(result, AsyncIterator):
            return StreamingResponse(
                _observed(result, endpoint, start, timeout), media_type="text/event-stream"
            )
        REQUESTS.labels(endpoint, "200").inc()
        LATENCY.labels(endpoint).observe(time.perf_counter() - start)
        if isinstance(result, BaseModel):
            result = result.model_dump(exclude_none=True)
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat", OmniChatCompletionRequest, "chatcmpl",
                           chat_serving.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(
            request, "completions", OmniCompletionRequest, "cmpl", completion_serving.completion
        )

    @app.post("/v1/images/generations")
    async def image_generations(request: Request) -> Response:
        return await serve(
            request, "images", ImageGenerationRequest, "img", images_serving.generations
        )

    @app.post("/v1/images/edits")
    async def image_edits(request: Request) -> Response:
        return await serve(request, "image_edits", None, "imgedit", images_serving.edits)

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        return await serve(request, "speech", SpeechRequest, "speech",
                           speech_serving.speech)

    @app.post("/v1/videos")
    async def create_video(request: Request) -> Response:
        return await serve(request, "videos", VideoCreateRequest, "video",
                           videos_serving.create, forms=True)

    async def answer(endpoint: str, work) -> Response:
        """A video route's answer (JSON, or a file's bytes) or its OpenAI-style error."""
        try:
            result = work()
            if inspect.isawaitable(result):
                result = await result
        except OmniHTTPError as e:
            REQUESTS.labels(endpoint, str(int(e.status))).inc()
            return error_response(e.status, e.message, e.param)
        REQUESTS.labels(endpoint, "200").inc()
        if isinstance(result, tuple):
            data, media_type = result
            return Response(data, media_type=media_type)
        return JSONResponse(result)

    # Parameters are read by the handlers (to answer OpenAI-shaped errors) and described to
    # /openapi.json here.
    @app.get("/v1/videos", openapi_extra=VIDEO_LIST_PARAMS)
    async def list_videos(request: Request) -> Response:
        q = request.query_params
        return await answer("videos_list", lambda: videos_serving.list(
            q.get("after"), q.get("limit"), q.get("order")))

    @app.get("/v1/videos/{video_id}", openapi_extra=VIDEO_ID_PARAMS)
    async def retrieve_video(request: Request) -> Response:
        video_id = request.path_params["video_id"]
        return await answer("videos_retrieve", lambda: videos_serving.retrieve(video_id))

    @app.delete("/v1/videos/{video_id}", openapi_extra=VIDEO_ID_PARAMS)
    async def delete_video(request: Request) -> Response:
        video_id = request.path_params["video_id"]
        return await answer("videos_delete", lambda: videos_serving.delete(video_id))

    @app.get("/v1/videos/{video_id}/content", openapi_extra=VIDEO_CONTENT_PARAMS)
    async def video_content(request: Request) -> Response:
        video_id, variant = request.path_params["video_id"], request.query_params.get("variant")
        return await answer("videos_content", lambda: videos_serving.content(video_id, variant))

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

    describe_bodies(app)
    return app


def _timed_out(seconds: float) -> OmniHTTPError:
    TIMED_OUT.inc()
    return OmniHTTPError(HTTPStatus.GATEWAY_TIMEOUT,
                         f"the request took longer than {seconds:g} s (--request-timeout); "
                         "it was stopped in every stage")


def _left(start: float, timeout: float | None) -> float | None:
    """Seconds left to a request that began at `start` (a perf_counter time); None: no limit."""
    return None if timeout is None else max(timeout - (time.perf_counter() - start), 0)


async def _read_body(request: Request, start: float, timeout: float | None) -> None:
    try:
        await asyncio.wait_for(request.body(), _left(start, timeout))
    except TimeoutError:
        TIMED_OUT.inc()
        raise OmniHTTPError(HTTPStatus.REQUEST_TIMEOUT,
                            f"the request body did not arrive within {timeout:g} s "
                            "(--request-timeout)") from None


async def _within(work: Awaitable[Any], start: float, timeout: float | None) -> Any:
    """`work`, cancelled (which aborts the request in every stage) once the request is
    `timeout` seconds old."""
    try:
        return await asyncio.wait_for(work, _left(start, timeout))
    except TimeoutError:
        raise _timed_out(timeout) from None


async def _observed(
    stream: AsyncIterator[str], endpoint: str, start: float, timeout: float | None
) -> AsyncIterator[str]:
    """The SSE stream as it goes out: counted in the metrics, and ended with an error event
    when it runs past the request's deadline."""
    status = "200"
    try:
        while True:
            try:
                left = _left(start, timeout)
                if left is None:
                    item = await anext(stream)
                else:  # each wait bounded: no timeout spans a yield
                    item = await asyncio.wait_for(anext(stream), left)
            except StopAsyncIteration:
                break
            except TimeoutError:
                status = "504"
                yield error_event(_timed_out(timeout))
                yield sse("[DONE]")
                break
            yield item
    except BaseException:
        status = "499"  # the client went away mid-stream; closing `stream` aborted the request
        raise
    finally:
        REQUESTS.labels(endpoint, status).inc()
        LATENCY.labels(endpoint).observe(time.perf_counter() - start)


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
