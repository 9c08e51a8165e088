"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, or on Anthropic's
routes (/v1/messages*) in Anthropic's, `{"type": "error", "error": {"type", "message"}}`, for
every way a request can fail: bad JSON or values (400), API key (401), unknown model or route
(404), body too large (413), queue full (429, with Retry-After), loading or shutting down
(503), and bugs (500: logged with their traceback, which the client never sees)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics
from .responses import error_body

ANTHROPIC_ROUTES = "/v1/messages"
# Anthropic's error types by status; 503 is its "overloaded" (it sends 529).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

log = logging.getLogger("mlx_speculate.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type_, headers


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
    }


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """`error` in the shape of the API `path` belongs to."""
    if path.startswith(ANTHROPIC_ROUTES):
        body = anthropic_error_body(error.status, error.message)
    else:
        body = error_body(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _from_validation(exc: RequestValidationError) -> APIError:
    first: dict[str, Any] = exc.errors()[0]
    where = [str(part) for part in first.get("loc", ())[1:]]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
    if first.get("type") == "missing" and not where:
        return APIError(400, "a JSON body is required", code="invalid_json")
    # Union members add the type they tried to the field's location ("stop.str"): drop it.
    param = ".".join(p for p in where if p not in _TYPE_TAGS and "[" not in p and "-" not in p)
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {message}", param=param or None, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install(app: FastAPI, metrics: Metrics) -> None:
    """Every error handler of the app; errors count in the requests metric by status."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "other")
        metrics.requests.labels(endpoint, str(error.status)).inc()
        return error_response(error, request.url.path)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _from_validation(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code)
        return respond(request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error on %s", request.url.path, exc_info=exc)
        error = APIError(500, f"internal error: {type(exc).__name__}", type_="server_error")
        return respond(request, error)


class BodyLimit:
    """Refuses bodies over `max_bytes` with 413, by Content-Length or, for chunked bodies, as
    they arrive (ASGI middleware: the route never sees a byte past the limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        too_large = HTTPException(413, f"the request body is larger than {self.max_bytes} bytes")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = APIError(413, str(too_large.detail), code="request_too_large")
            await error_response(error, scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_large  # FastAPI passes HTTPExceptions from body reading through
            return message

        await self.app(scope, limited, send)
