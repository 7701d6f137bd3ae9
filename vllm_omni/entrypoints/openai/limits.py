"""What the server refuses before it does work: bodies over a size, requests beyond a number
in flight, and (with a key) callers without the key. Plain ASGI middlewares: Starlette's
BaseHTTPMiddleware would hide client disconnects from streaming responses."""

from __future__ import annotations

import secrets
from http import HTTPStatus

import prometheus_client

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError, error_response

PENDING = prometheus_client.Gauge(
    "vllm_omni:requests_in_flight", "API requests being served (admitted, not yet answered)"
)
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


class AdmissionMiddleware:
    """At most `limit` API requests in flight (a stream counts until its last byte); beyond
    that a 503 with Retry-After at once, instead of a queue without bound."""

    def __init__(self, app, limit: int | None) -> None:
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if not _is_api_request(scope):
            await self.app(scope, receive, send)
            return
        if self.limit is not None and self.in_flight >= self.limit:
            REFUSED.labels("busy").inc()
            response = error_response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the server is serving {self.in_flight} requests, its limit "
                "(--max-pending-requests); retry later")
            response.headers["Retry-After"] = "1"
            await response(scope, receive, send)
            return
        self.in_flight += 1
        PENDING.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            PENDING.dec()


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
