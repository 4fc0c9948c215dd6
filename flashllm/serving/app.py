"""The FastAPI application: routes, OpenAI-shaped errors, API keys, body limits, health and metrics."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from flashllm import __version__
from flashllm.serving.embeddings_api import create_embedding
from flashllm.serving.generation import ServerContext
from flashllm.serving.openai_api import create_chat_completion, create_completion
from flashllm.serving.protocol import APIError
from flashllm.serving.responses_api import create_response, delete_response, retrieve_response
from flashllm.serving.tokenize_api import create_detokenize, create_tokenize

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/ready"})
DEFAULT_MAX_BODY_BYTES = 4 << 20


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class APIKeyMiddleware:
    """Every route but PUBLIC_PATHS needs `Authorization: Bearer <key>`.

    Keys are compared as SHA-256 digests with hmac.compare_digest against every configured key
    (no early exit), so timing says nothing about how much of a key matched. The path is the ASGI
    scope's, never rebuilt from the Host header; anything not exactly public is protected.
    """

    def __init__(self, app: ASGIApp, api_keys: Iterable[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        given = hashlib.sha256(token).digest()
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(given, digest)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            # which of two keys counts is exactly what a proxy and this server might disagree on
            err = APIError(400, "the request has more than one Authorization header; send exactly one",
                           code="duplicate_authorization")
            await error_response(err)(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error_response(err)(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


Handler = Callable[[ServerContext, Request, bytes], Awaitable[Response]]


def create_app(ctx: ServerContext, api_keys: Iterable[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
               ) -> FastAPI:
    """The server's ASGI app around one running AsyncEngine (`ctx.engine`)."""
    app = FastAPI(title="flashllm", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    def post(path: str, handler: Handler) -> None:
        async def endpoint(request: Request) -> Response:
            media_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
            if media_type.lower() != "application/json":  # media types are case-insensitive (RFC 9110)
                raise APIError(415, "send the body as application/json", code="unsupported_media_type")
            return await handler(ctx, request, await read_body(request, max_body_bytes))

        app.add_api_route(path, endpoint, methods=["POST"])

    post("/v1/completions", create_completion)
    post("/v1/chat/completions", create_chat_completion)
    post("/tokenize", create_tokenize)
    post("/detokenize", create_detokenize)
    post("/v1/embeddings", create_embedding)
    post("/v1/responses", create_response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return await retrieve_response(ctx, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def forget_response(response_id: str) -> Response:
        return await delete_response(ctx, response_id)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = [{"id": name, "object": "model", "created": started, "owned_by": "flashllm",
                     "parent": ctx.model_name, "max_model_len": ctx.max_model_len} for name in ctx.loras]
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": started,
                                            "owned_by": "flashllm", "max_model_len": ctx.max_model_len,
                                            **ctx.model_info}, *adapters]}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.error is not None:
            return JSONResponse({"status": "failed", "error": type(ctx.engine.error).__name__}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if ctx.engine.error is not None or ctx.engine.draining:
            return JSONResponse({"status": "draining" if ctx.engine.draining else "failed"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    _install_error_handlers(app, ctx)
    keys = list(api_keys)
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
    return app


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"


def _printable(text: str) -> str:
    """`text` with control characters escaped: a path is echoed into replies and log lines, one line each."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _install_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        # on any route that reads a body (the LoRA admin ones too): routine on the internet and free
        # to cause, so one INFO line and a counter, never the traceback of the catch-all below
        ctx.metrics.client_disconnect()
        logger.info("client %s went away before sending the whole body of %s", _client(request),
                    _printable(request.url.path[:100]))
        return Response(status_code=400)  # nobody is left to read it

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> Response:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # the path is echoed back, so control characters in it are escaped rather than returned raw
        message = f"{request.method} {_printable(request.url.path[:200])}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, kind, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error while serving a request", exc_info=exc)
        return error_response(APIError(500, "internal server error; the server log has the details",
                                       "internal_error", code="internal_error"))
