"""Serving a low-level MCP server over stdio or streamable HTTP (at ``/mcp``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import mcp.types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.message import SessionMessage
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

IDLE_TIMEOUT = 1800.0
"""Seconds a streamable-HTTP session may go without a request in flight before it is closed
and its state reclaimed: a client that leaves without ending its session (no DELETE) would
otherwise hold it until the server exits."""

MAX_SESSIONS = 64
"""Streamable-HTTP sessions open at once, past which a new one is refused: each holds its
state until it ends or idles out (the proxy's, with a stdio upstream, a process of its own,
about 90 MB), so a client that never ends its sessions could otherwise pile them up."""

TOO_MANY_SESSIONS = -32003
"""The JSON-RPC error code (from the range JSON-RPC leaves to servers) refusing a session
past ``max_sessions``."""

KNOWN_METHODS = frozenset(
    typing.get_args(request.model_fields["method"].annotation)[0]
    for request in typing.get_args(types.ClientRequest.model_fields["root"].annotation)
)


class _ClientHungUp(logging.Filter):
    """The SDK logs a traceback whenever a client closes its event stream; that is normal."""

    def filter(self, record: logging.LogRecord) -> bool:
        closed = record.exc_info is not None and type(record.exc_info[1]).__name__ == "ClosedResourceError"
        return not (closed and "standalone SSE writer" in record.getMessage())


logging.getLogger("mcp.server.streamable_http").addFilter(_ClientHungUp())


T = TypeVar("T")
LifespanT = TypeVar("LifespanT")


class McpServer(Server[LifespanT, Any]):
    """A low-level server that answers a method MCP does not define with -32601 (Method not
    found). The SDK's session checks each request against the methods it knows before any
    handler runs, and answers every failure there, an unknown method too, with -32602
    (Invalid params). ``tools_changed`` declares that its tool list changes (and that it
    says so with ``notifications/tools/list_changed``)."""

    def __init__(self, name: str, *, tools_changed: bool = False, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.tools_changed = tools_changed

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        notification_options = notification_options or NotificationOptions(tools_changed=self.tools_changed)
        return super().create_initialization_options(notification_options, experimental_capabilities)

    async def run(
        self,
        read_stream: MemoryObjectReceiveStream[SessionMessage | Exception],
        write_stream: MemoryObjectSendStream[SessionMessage],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        send, receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)

        async def forward_known() -> None:
            # Either end may close first: the client's (the transport ends) or the session's.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                async with read_stream, send:
                    async for message in read_stream:
                        request = message.message.root if isinstance(message, SessionMessage) else None
                        if isinstance(request, types.JSONRPCRequest) and request.method not in KNOWN_METHODS:
                            error = types.ErrorData(code=types.METHOD_NOT_FOUND, message="Method not found")
                            answer = types.JSONRPCError(jsonrpc="2.0", id=request.id, error=error)
                            await write_stream.send(SessionMessage(types.JSONRPCMessage(answer)))
                        else:
                            await send.send(message)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(forward_known)
            await super().run(receive, write_stream, *args, **kwargs)
            tasks.cancel_scope.cancel()


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


async def serve_http(
    server: Server,
    host: str = "127.0.0.1",
    port: int = 8100,
    idle_timeout: float = IDLE_TIMEOUT,
    max_sessions: int = MAX_SESSIONS,
) -> None:
    import uvicorn

    app = http_app(server, idle_timeout=idle_timeout, max_sessions=max_sessions)
    await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()


def http_app(
    server: Server, *, idle_timeout: float = IDLE_TIMEOUT, max_sessions: int = MAX_SESSIONS
) -> Starlette:
    """A Starlette app serving ``server`` over streamable HTTP at ``/mcp``; a session with
    nothing in flight for ``idle_timeout`` seconds is closed as if its client had ended it,
    and while ``max_sessions`` are open a new one is refused (HTTP 503, a JSON-RPC error)."""
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    manager = StreamableHTTPSessionManager(
        app=server,
        stateless=False,
        json_response=True,
        session_idle_timeout=idle_timeout,
        max_sessions=max_sessions,
    )
    message = (
        f"Too many open sessions: this server holds at most {max_sessions} at once (max_sessions, "
        "--max-sessions); retry once one is ended or idles out"
    )
    refusal = JSONResponse(
        {"jsonrpc": "2.0", "id": "server-error", "error": {"code": TOO_MANY_SESSIONS, "message": message}},
        status_code=503,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            yield

    endpoint = _Endpoint(manager.handle_request, refusal)
    return Starlette(routes=[Route("/mcp", endpoint=endpoint)], lifespan=lifespan)


class _Endpoint:
    """The session manager as a raw ASGI endpoint (Starlette treats a plain function as
    request -> response, an object as raw ASGI). The manager refuses a session past its
    ``max_sessions`` with a 503 that names neither the cap nor the setting, and answers
    503 for nothing else; that answer is replaced by ``refusal``, which does."""

    def __init__(self, handle: Callable[[Scope, Receive, Send], Awaitable[None]], refusal: Response) -> None:
        self.handle = handle
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = False

        async def unless_refused(message: Message) -> None:
            nonlocal refused
            refused = refused or (message["type"] == "http.response.start" and message["status"] == 503)
            if not refused:
                await send(message)

        await self.handle(scope, receive, unless_refused)
        if refused:
            await self.refusal(scope, receive, send)
