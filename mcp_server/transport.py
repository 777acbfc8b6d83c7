"""Serving a low-level MCP server over stdio or streamable HTTP (at ``/mcp``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from mcp.server.lowlevel import Server
from starlette.applications import Starlette
from starlette.routing import Route


class _ClientHungUp(logging.Filter):
    """The SDK logs a traceback whenever a client closes its event stream; that is normal."""

    def filter(self, record: logging.LogRecord) -> bool:
        closed = record.exc_info is not None and type(record.exc_info[1]).__name__ == "ClosedResourceError"
        return not (closed and "standalone SSE writer" in record.getMessage())


logging.getLogger("mcp.server.streamable_http").addFilter(_ClientHungUp())


T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (the ``mcp`` extra installs it): an MCP
    hop is mostly event-loop and HTTP-parsing work, which uvloop and httptools halve."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def serve_stdio(server: Server) -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(server: Server, host: str = "127.0.0.1", port: int = 8100) -> None:
    import uvicorn

    await uvicorn.Server(uvicorn.Config(http_app(server), host=host, port=port, log_level="warning")).serve()


def http_app(server: Server) -> Starlette:
    """A Starlette app serving ``server`` over streamable HTTP at ``/mcp``."""
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    manager = StreamableHTTPSessionManager(app=server, stateless=False, json_response=True)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            yield

    return Starlette(routes=[Route("/mcp", endpoint=_ASGI(manager.handle_request))], lifespan=lifespan)


class _ASGI:
    """Starlette treats a plain function endpoint as request -> response; an object is raw ASGI."""

    def __init__(self, handle: Callable[..., Any]) -> None:
        self.handle = handle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.handle(scope, receive, send)
