"""The server's app: FastAPI with OpenAI's API (openai_api.py) and Anthropic's Messages API
(anthropic_api.py) on one service (service.py), plus GET /health, GET /metrics (Prometheus) and
GET / (a page that streams a completion and colours the tokens that came from the draft).

Errors are answered in the body of the API they came through: OpenAI's under /v1/completions,
/v1/chat/completions and everything else, Anthropic's under /v1/messages. Bad input is HTTP 400
naming the field, the allowed range and the value; unknown models 404; bodies over the limit 413,
bodies that do not arrive in time 408. Anything else that goes wrong is ours: a logged 500 with
the same body, and the server goes on.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import anthropic_api, openai_api
from .service import INTERNAL, APIError, Defaults, Service, bad
from .worker import Worker

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive
GENERATING = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
              "/v1/messages": "messages"}  # endpoints whose refusals the metrics count

log = logging.getLogger("tinydraft_mlx.server")


def error_response(path: str, err: APIError) -> JSONResponse:
    """`err` in the error body of the API that `path` belongs to."""
    if path.startswith(anthropic_api.PATHS):
        return anthropic_api.error_response(err)
    return openai_api.error_response(err)


def create_app(worker: Worker, model_name: str, defaults: Defaults | None = None, *,
               max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The FastAPI app serving `worker`'s models as `model_name`. The worker thread starts with
    the app and stops (waiting jobs cancelled) when it shuts down."""
    service = Service(worker, model_name, defaults or Defaults())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="tinydraft-mlx", lifespan=lifespan)
    def count(path: str, method: str, err: APIError) -> None:
        """A refusal counts as a rejected request of a generating endpoint it was sent to (a
        POST: another method is not a request of it), or of any path when it is a 503."""
        endpoint = GENERATING.get(path) if method == "POST" else None
        if not err.counted and (endpoint is not None and err.status < 500 or err.status == 503):
            service.metrics.rejected(endpoint or path)

    app.add_middleware(RequestLimits, max_bytes=max_body_bytes, body_timeout=body_timeout,
                       count=count)
    app.state.service = service

    def answer(request: Request, err: APIError) -> JSONResponse:
        count(request.url.path, request.method, err)
        return error_response(request.url.path, err)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return answer(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return answer(request, _validation_error(err))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        return answer(request, APIError(500, INTERNAL, kind="server_error",
                                        code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return answer(request, _http_error(err))

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("tinydraft_mlx").joinpath(
            "static/index.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, kind = service.metrics.render()
        return Response(body, media_type=kind)

    openai_api.register(app, service)
    anthropic_api.register(app, service)
    return app


def _http_error(err: StarletteHTTPException) -> APIError:
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed",
            408: "request_timeout"}.get(err.status_code)
    return APIError(err.status_code, str(err.detail), code=code, kind=kind,
                    headers=getattr(err, "headers", None))


class RequestLimits:
    """ASGI middleware: a request body over `max_bytes` gets 413 with OpenAI's error body, whether
    its Content-Length says so up front or a chunked body grows past it while being read; a body
    that has not fully arrived within `body_timeout` seconds gets 408. A body sent without a
    Content-Type is read as JSON (the only format the API takes)."""

    def __init__(self, app: Any, max_bytes: int, body_timeout: float = BODY_TIMEOUT,
                 count: Callable[[str, str, APIError], None] | None = None) -> None:
        self.app, self.max_bytes, self.body_timeout = app, max_bytes, body_timeout
        self.count = count  # (path, method, error): books a refusal answered here

    def _too_large(self) -> StarletteHTTPException:
        return StarletteHTTPException(413, f"the request body is larger than {self.max_bytes} "
                                           "bytes")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if b"content-type" not in headers and scope.get("method") == "POST":
            scope = {**scope, "headers": [*scope.get("headers", []),
                                          (b"content-type", b"application/json")]}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            path = scope.get("path", "")
            err = APIError(413, self._too_large().detail, code="request_too_large")
            if self.count is not None:
                self.count(path, scope.get("method", ""), err)
            return await error_response(path, err)(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        seen, complete = 0, False

        async def limited() -> dict:
            nonlocal seen, complete
            if complete:  # the body is in: what follows is the disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within "
                                                  f"{self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


# a union member pydantic names in an error location (prompt.list[int][0]): not a field
_UNION_TAG = re.compile(r"str|int|float|bool|none|[a-z-]+\[.*\]")


def _validation_error(err: RequestValidationError) -> APIError:
    """pydantic's first complaint as one sentence naming the field and the value."""
    first = err.errors()[0]
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return bad(None, "the request body is empty: send a JSON object with the request's "
                   "fields", code="invalid_json")
    if first.get("type") == "json_invalid":
        return bad(None, f"the request body is not valid JSON: {first.get('msg')}",
                    code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes):
        return bad(None, "the request body must be a JSON object, sent as application/json",
                    code="invalid_json")
    param = ""  # e.g. messages[0].role
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _UNION_TAG.fullmatch(part):
            param += f".{part}" if param else str(part)
    param = param or None
    value = first.get("input")
    got = "" if first.get("type") == "missing" else f" (got {value!r})"
    where = f"{param}: " if param else ""
    return bad(param, f"{where}{first.get('msg')}{got}")


