"""The OpenAI-compatible gateway: serving, per-request expert routing, hot-swap, capture.

``create_app(backend, ...)`` returns a FastAPI app with ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings`` (the base model's), ``/v1/models`` and
``/health``, plus vLLM's runtime LoRA admin endpoints. A request's ``model`` picks an
adapter by name (the vLLM convention); a request naming the base model or the agent is
routed by the router; ``base`` is always the base model itself, and ``router:NAME`` a
candidate router. Every call is recorded as a step of an episode in the store.

The routes live in ``trace_plugin.gateway.routes``, one router a concern, and serve
with the app's ``GatewayState``; this module assembles them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trace_plugin.gateway.backend import Backend
from trace_plugin.gateway.routes import admin, chat, completions, embeddings, models
from trace_plugin.gateway.routing import Router, StaticRouter
from trace_plugin.gateway.state import (
    ADAPTER_HEADER,
    AGENT_HEADER,
    BASE_MODEL,
    CANCELLED,
    DEFAULT_MODEL,
    ENDED_EARLY,
    EPISODE_HEADER,
    MAX_BODY_BYTES,
    ROUTER_PREFIX,
    GatewayConfig,
    GatewayConfigError,
    GatewayError,
    GatewayState,
)
from trace_plugin.recorder import Recorder

logger = logging.getLogger(__name__)
__all__ = [
    "ADAPTER_HEADER",
    "AGENT_HEADER",
    "BASE_MODEL",
    "CANCELLED",
    "DEFAULT_MODEL",
    "ENDED_EARLY",
    "EPISODE_HEADER",
    "MAX_BODY_BYTES",
    "ROUTER_PREFIX",
    "BodyLimit",
    "GatewayConfig",
    "GatewayConfigError",
    "GatewayError",
    "create_app",
]


def create_app(
    backend: Backend,
    *,
    config: GatewayConfig | None = None,
    router: Router | None = None,
    recorder: Recorder | None = None,
) -> FastAPI:
    gateway = GatewayState(backend, config or GatewayConfig(), router or StaticRouter(None), recorder)
    app = FastAPI(
        title="trace-plugin gateway",
        version="1",
        lifespan=_lifespan,
        exception_handlers={
            GatewayError: _gateway_error,
            RequestValidationError: _invalid,
            HTTPException: _http_error,
        },
    )
    app.state.gateway, app.state.backend = gateway, backend
    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes)
    for routes in (models, chat, completions, embeddings, admin):
        app.include_router(routes.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: GatewayState = app.state.gateway
    gateway.registry.clear_mixtures()
    for name, path in gateway.config.adapters.items():
        await gateway.registry.load(name, path)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_sweep, gateway)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
    finally:  # outside the cancelled scope, or the backend's close is cancelled at its first await
        gateway.episodes.close()  # none left running
        await gateway.backend.close()


async def _sweep(gateway: GatewayState) -> None:
    """End conversations left open past the timeout while no new call comes to do it. A
    sweep that fails is logged and the next one runs: one bad sweep must not leave every
    later conversation open."""
    while True:
        await anyio.sleep(min(gateway.config.conversation_timeout / 4, 30.0))
        try:
            gateway.episodes.sweep()
        except Exception:
            logger.exception("sweeping idle conversations failed; the next sweep runs as usual")


# -- errors in OpenAI's shape --------------------------------------------------------------


async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.type, exc.code)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid request")
    return _error(400, f"{where}: {message}" if where else message, param=where or None)


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (unknown path, a body that cannot be parsed,
    such as one nested too deep) in OpenAI's shape too."""
    response = _error(exc.status_code, str(exc.detail))
    response.headers.update(exc.headers or {})
    return response


def _error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


class BodyLimit:
    """Refuses a request body over ``max_bytes`` with a 413: at once when its Content-Length
    says so, else as soon as the bytes read pass it (a chunked body declares no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body over {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _error(413, too_large)(scope, receive, send)
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:  # FastAPI passes an HTTPException from here on as it is
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)
