"""The MCP recording proxy: between any MCP client and any MCP server, recording every call.

It is transparent: tools are listed as the upstream lists them and calls are forwarded
with their results and errors unchanged (the proxy does not re-validate arguments). It
records the upstream's tool schemas and every call (arguments, result, error, latency)
as tool steps, grouped into episodes by a trajectory id in the request's ``_meta``
(``trace_episode_id``), else by the ``X-Trace-Episode`` header over HTTP, else by MCP
session. When the upstream fails, the client gets an error result and the proxy keeps
serving.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Any

import mcp.types as types
from mcp import ClientSession

from mcp_server.transport import McpServer
from trace_plugin.gateway.server import RunningServer, free_port
from trace_plugin.recorder import Recorder
from trace_plugin.tracer import ActiveEpisode, Tracer

EPISODE_META_KEYS = ("trace_episode_id", "trajectory_id")


@contextlib.asynccontextmanager
async def connect(upstream: str | list[str]) -> AsyncIterator[ClientSession]:
    """A session to the upstream: a streamable-HTTP URL, or a command run over stdio."""
    if isinstance(upstream, str) and upstream.startswith(("http://", "https://")):
        from mcp.client.streamable_http import streamablehttp_client

        transport = streamablehttp_client(upstream)
    else:
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        command = upstream.split() if isinstance(upstream, str) else list(upstream)
        transport = stdio_client(StdioServerParameters(command=command[0], args=command[1:]))
    async with transport as streams, ClientSession(streams[0], streams[1]) as session:
        await session.initialize()
        yield session


def build_proxy(
    upstream: ClientSession, *, agent: str = "mcp-proxy", recorder: Recorder | None = None
) -> McpServer[Any]:
    server: McpServer[Any] = McpServer("trace-plugin-proxy")
    tracer = Tracer(agent, source="mcp-proxy", recorder=recorder)
    by_key: dict[str, ActiveEpisode] = {}
    by_session: weakref.WeakKeyDictionary[Any, ActiveEpisode] = weakref.WeakKeyDictionary()
    schemas: list[dict[str, Any]] = []

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        tools = (await upstream.list_tools()).tools
        schemas[:] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.inputSchema},
            }
            for t in tools
        ]
        return tools

    def episode() -> tuple[ActiveEpisode, bool]:
        context = server.request_context
        meta = context.meta.model_dump() if context.meta is not None else {}
        key = next((str(meta[k]) for k in EPISODE_META_KEYS if meta.get(k)), None)
        request = context.request
        if key is None and request is not None:
            key = request.headers.get("x-trace-episode")
        if key is not None:
            if key not in by_key:
                by_key[key] = tracer.start_episode(None, episode_id=key)
                return by_key[key], True
            return by_key[key], False
        if context.session not in by_session:
            by_session[context.session] = tracer.start_episode(None)
            return by_session[context.session], True
        return by_session[context.session], False

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        active, first = episode()
        tools = list(schemas) if first and schemas else None
        with tracer.step(active, "tool", name, arguments, tools=tools) as step:
            try:
                result = await upstream.call_tool(name, arguments)
            except Exception as exc:  # the upstream died or refused: an error result, recorded
                result = types.CallToolResult(
                    content=[
                        types.TextContent(type="text", text=f"upstream error: {type(exc).__name__}: {exc}")
                    ],
                    isError=True,
                )
            text = "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))
            step.output = result.structuredContent if result.structuredContent is not None else text
            step.error = text if result.isError else None
        return result

    return server


def start_proxy_in_thread(
    upstream: str | list[str],
    *,
    agent: str = "mcp-proxy",
    recorder: Recorder | None = None,
    timeout: float = 60,
) -> RunningServer:
    """The proxy over streamable HTTP on a daemon thread: the upstream session and the HTTP
    server share that thread's event loop, as MCP sessions must."""
    import asyncio
    import threading

    import uvicorn

    from mcp_server.transport import http_app, run

    port = free_port()
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        try:
            async with connect(upstream) as session:
                app = http_app(build_proxy(session, agent=agent, recorder=recorder))
                server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
                holder["server"] = server
                serving = asyncio.create_task(server.serve())
                while not server.started and not serving.done():
                    await asyncio.sleep(0.01)
                ready.set()
                await serving
        finally:
            ready.set()

    thread = threading.Thread(target=lambda: run(main()), name=f"mcp-proxy-{port}", daemon=True)
    thread.start()
    if not ready.wait(timeout) or "server" not in holder or not holder["server"].started:
        raise RuntimeError(f"the MCP proxy did not start (upstream {upstream!r})")
    return RunningServer(holder["server"], thread, "127.0.0.1", port)
