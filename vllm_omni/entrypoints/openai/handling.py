"""One API request's handling, whatever its route: its body read and parsed within the
deadline, its work cancelled when the client goes away or the deadline passes (which aborts
it in every stage), every failure mapped to an OpenAI-shaped error in one place, and its
result answered as JSON, a file, or an SSE stream that is counted and bounded too."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import prometheus_client
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError, error_response, parse_model
from vllm_omni.entrypoints.openai.serving_base import (
    error_event,
    error_status,
    new_request_id,
    sse,
)

logger = logging.getLogger(__name__)

REQUESTS = prometheus_client.Counter(
    "vllm_omni:http_requests", "Finished API requests", ["endpoint", "status"]
)
TIMED_OUT = prometheus_client.Counter(
    "vllm_omni:requests_timed_out", "API requests stopped at --request-timeout"
)
LATENCY = prometheus_client.Histogram(
    "vllm_omni:http_request_seconds", "Time from request to last byte", ["endpoint"]
)

FORM = "form"  # a Route's `body`: a multipart form, as {field: [values]}


@dataclass(frozen=True)
class Route:
    """One API route. With a `body` (a request model, or FORM), `call(body, request_id)`
    does the work; without, `call(request)` reads the path and query itself. `forms`: the
    body model may also come as a multipart form (the openai client sends files so)."""

    method: str
    path: str
    endpoint: str  # its name in the metrics
    call: Callable[..., Any]
    body: type[BaseModel] | str | None = None
    id_prefix: str = "req"
    forms: bool = False
    openapi_extra: dict[str, Any] | None = None


async def handle(request: Request, route: Route, timeout: float | None) -> Response:
    """Run the route's work for `request` and answer with its result or its error."""
    start = time.perf_counter()
    try:
        if route.body is None:
            result = route.call(request)
            if inspect.isawaitable(result):
                result = await result
        else:
            # Read whole now (the disconnect watcher also reads from the socket), and within
            # the deadline: a stalled upload must not hold a slot of --max-pending-requests.
            await _read_body(request, start, timeout)
            work = _within(_parsed_call(request, route), start, timeout)
            result = await _cancel_on_disconnect(request, work)
    except Exception as e:
        status, message, param = error_status(e)
        if status == HTTPStatus.GATEWAY_TIMEOUT:
            logger.warning("Request to %s: %s", route.endpoint, message)
        elif status >= 500:
            logger.exception("Request to %s failed", route.endpoint)
        REQUESTS.labels(route.endpoint, str(int(status))).inc()
        return error_response(status, message, param)
    if result is None:  # client went away
        REQUESTS.labels(route.endpoint, "499").inc()
        return Response(status_code=499)
    if isinstance(result, AsyncIterator):
        return StreamingResponse(_observed(result, route.endpoint, start, timeout),
                                 media_type="text/event-stream")
    REQUESTS.labels(route.endpoint, "200").inc()
    if isinstance(result, Response):  # a file, or a stream of bytes (audio)
        return result
    LATENCY.labels(route.endpoint).observe(time.perf_counter() - start)
    if isinstance(result, tuple):  # a file's bytes and their media type
        data, media_type = result
        return Response(data, media_type=media_type)
    if isinstance(result, BaseModel):
        result = result.model_dump(exclude_none=True)
    return JSONResponse(result)


async def _parsed_call(request: Request, route: Route) -> Any:
    if route.body == FORM:
        body = await _parse_form(request)
    elif route.forms and request.headers.get("content-type", "").startswith(
            ("multipart/form-data", "application/x-www-form-urlencoded")):
        fields = await _parse_form(request)
        body = parse_model(route.body, _nested({k: v[-1] for k, v in fields.items()}))
    else:
        body = await _parse_json(request, route.body)
    rid = request.headers.get("X-Request-Id") or new_request_id(route.id_prefix)
    return await route.call(body, rid)


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
