"""What the server refuses before it does work: bodies over a size, requests that would wait
beyond a number (or beyond a cap on all in flight), and (with a key) callers without the key.
Plain ASGI middlewares: Starlette's BaseHTTPMiddleware would hide client disconnects from
streaming responses."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from http import HTTPStatus

import prometheus_client

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError, error_response

IN_FLIGHT = prometheus_client.Gauge(
    "vllm_omni:requests_in_flight", "API requests being served (admitted, not yet answered)"
)
# Admission's count, by the stage a request enters first: as many as the stage runs at once
# are running, the rest wait in its queue.
RUNNING = prometheus_client.Gauge(
    "vllm_omni:requests_running", "Admitted API requests their first stage can run now",
    ["stage"])
WAITING = prometheus_client.Gauge(
    "vllm_omni:requests_waiting", "Admitted API requests beyond what their first stage runs "
    "at once", ["stage"])
REFUSED = prometheus_client.Counter(
    "vllm_omni:requests_refused", "API requests refused before any work", ["reason"]
)
# Routes a caller may use without the API key: liveness, and the playground's static page
# (it holds no data; it asks for the key and sends it on every API call).
PUBLIC_PATHS = ("/health",)
PUBLIC_PREFIXES = ("/playground/",)


def _is_api_request(scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith(
        "/v1/")


class BodyTooLarge(OmniHTTPError):
    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-body-mb)")


class BodyLimitMiddleware:
    """A 413 for a body over `limit` bytes: at once where Content-Length says so, else as
    soon as that many bytes have been read (the reader gets BodyTooLarge)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            REFUSED.labels("too_large").inc()
            error = BodyTooLarge(self.limit)
            await error_response(error.status, error.message)(scope, receive, send)
            return
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    REFUSED.labels("too_large").inc()
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, bounded_receive, send)


@dataclass
class Lane:
    """The requests of the routes that lead to one stage first, and how many of them that
    stage runs at once (`capacity`; None: no bound it reports): past it they wait."""

    stage: str
    capacity: int | None
    in_flight: int = 0

    @property
    def waiting(self) -> int:
        return 0 if self.capacity is None else max(0, self.in_flight - self.capacity)

    @property
    def running(self) -> int:
        return self.in_flight - self.waiting


class AdmissionMiddleware:
    """Admission without an unbounded queue. Each API route leads to a lane (`lanes`: path
    prefixes, the first that matches, to the lane of the stage those requests enter first).
    A request is admitted while its stage can run it at once; past that it may wait while
    fewer than `max_pending` requests wait in all lanes together, and past `max_concurrent`
    in flight none is admitted. A refusal is a 503 with Retry-After at once. A stream counts
    until its last byte."""

    def __init__(self, app, lanes: list[tuple[str, Lane]], max_pending: int | None = None,
                 max_concurrent: int | None = None) -> None:
        self.app, self.lanes = app, lanes
        self.max_pending, self.max_concurrent = max_pending, max_concurrent
        self.distinct = list({id(lane): lane for _, lane in lanes}.values())
        self.in_flight = 0
        for lane in self.distinct:  # shown from the start, not from the first request
            self._count(lane, 0)

    def _lane(self, path: str) -> Lane | None:
        return next((lane for prefix, lane in self.lanes if path.startswith(prefix)), None)

    def _refusal(self, lane: Lane | None) -> str | None:
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            return (f"the server is serving {self.in_flight} requests, its limit "
                    "(--max-concurrent-requests); retry later")
        if self.max_pending is None or lane is None or lane.capacity is None:
            return None
        if lane.in_flight < lane.capacity:
            return None  # its stage runs it at once
        waiting = sum(other.waiting for other in self.distinct)
        if waiting < self.max_pending:
            return None
        return (f"{waiting} requests are waiting already (stage {lane.stage!r} runs "
                f"{lane.capacity} at once), the limit (--max-pending-requests); retry later")

    def _count(self, lane: Lane | None, change: int) -> None:
        self.in_flight += change
        IN_FLIGHT.inc(change)
        if lane is not None:
            lane.in_flight += change
            RUNNING.labels(lane.stage).set(lane.running)
            WAITING.labels(lane.stage).set(lane.waiting)

    async def __call__(self, scope, receive, send) -> None:
        if not _is_api_request(scope):
            await self.app(scope, receive, send)
            return
        lane = self._lane(scope["path"])
        refusal = self._refusal(lane)
        if refusal is not None:
            REFUSED.labels("busy").inc()
            response = error_response(HTTPStatus.SERVICE_UNAVAILABLE, refusal)
            response.headers["Retry-After"] = "1"
            await response(scope, receive, send)
            return
        self._count(lane, 1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._count(lane, -1)


class APIKeyMiddleware:
    """Bearer-token check on every route but the public ones (and /metrics, unless
    `--public-metrics`); keys are compared in constant time."""

    def __init__(self, app, keys: list[str], public_metrics: bool = False) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in keys]
        self.public = PUBLIC_PATHS + (("/metrics",) if public_metrics else ())

    def _open(self, path: str) -> bool:
        return path in self.public or path == "/" or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not self._open(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not any(secrets.compare_digest(given, k) for k in self.expected):
                response = error_response(HTTPStatus.UNAUTHORIZED, "invalid or missing API key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
