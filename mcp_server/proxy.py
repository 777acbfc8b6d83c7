"""The MCP recording proxy: between any MCP client and any MCP server, recording every call.

It is transparent: tools are listed as the upstream lists them and calls are forwarded
with their results and errors unchanged (the proxy does not re-validate arguments). Each
client's MCP session gets a session of its own to the upstream (a process of its own for
a stdio command), opened on first use and closed with it, so clients never see each
other's state. It records the upstream's tool schemas and every call (arguments, result,
error, latency) as tool steps, grouped into episodes by a trajectory id in the request's
``_meta`` (``trace_episode_id``), else by the ``X-Trace-Episode`` header over HTTP, else
by MCP session. An episode ends when the last session that used it closes or expires.
When the upstream fails, the client gets an error result and the proxy keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import mcp.types as types
from anyio.abc import TaskGroup, TaskStatus
from mcp import ClientSession

from mcp_server.transport import IDLE_TIMEOUT, MAX_SESSIONS, McpServer, http_app
from trace_plugin.gateway.server import RunningServer, start_in_thread
from trace_plugin.recorder import Recorder
from trace_plugin.tracer import ActiveEpisode, Tracer

EPISODE_META_KEYS = ("trace_episode_id", "trajectory_id")

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


class _Upstream:
    """A client session's own session to the upstream, opened on first use and held by a
    task of its own until ``close``: its transport's cancel scopes must be left by the task
    that entered them, and every request is handled in a task of its own."""

    def __init__(self, target: str | list[str], tasks: TaskGroup) -> None:
        self._target = target
        self._tasks = tasks
        self._session: ClientSession | None = None
        self._opening = anyio.Lock()
        self._closed = anyio.Event()
        self._failed = False
        self._calls: set[anyio.CancelScope] = set()

    async def call(self, operation: Callable[[ClientSession], Awaitable[T]]) -> T:
        """``operation`` on the upstream session, or ``ConnectionError`` once that has failed."""
        async with self._opening:
            if self._session is None:
                self._session = await self._tasks.start(self._hold)
            session = self._session
        with anyio.CancelScope() as call:
            if not self._failed:
                self._calls.add(call)
                try:
                    return await operation(session)
                finally:
                    self._calls.discard(call)
        raise ConnectionError("the upstream session failed")

    async def _hold(self, *, task_status: TaskStatus[ClientSession]) -> None:
        opened = False
        try:
            async with connect(self._target) as session:
                task_status.started(session)
                opened = True
                await self._closed.wait()
        except Exception:
            if not opened:
                raise  # to the call that opens it, which answers an error result
            # The SDK's HTTP client raises out of its task group when the upstream goes away,
            # cancelling the session under calls still waiting for their answers.
            logger.warning("the upstream session of a client session failed", exc_info=True)
            self._failed = True
            for call in self._calls:
                call.cancel()

    def close(self) -> None:
        self._closed.set()


@dataclass
class _Session:
    """What the proxy holds for one client session."""

    upstream: _Upstream
    episode: ActiveEpisode | None = None
    keys: set[str] = field(default_factory=set)  # the trajectory ids it recorded steps under


@dataclass
class _Keyed:
    """An episode named by a trajectory id, shared by the sessions that used the id."""

    episode: ActiveEpisode
    sessions: int = 0


def build_proxy(
    upstream: str | list[str], *, agent: str = "mcp-proxy", recorder: Recorder | None = None
) -> McpServer[_Session]:
    """A proxy to ``upstream``: a streamable-HTTP URL, or a command run over stdio."""
    tracer = Tracer(agent, source="mcp-proxy", recorder=recorder)
    keyed: dict[str, _Keyed] = {}
    schemas: list[dict[str, Any]] = []

    @contextlib.asynccontextmanager
    async def session(_: McpServer[_Session]) -> AsyncIterator[_Session]:
        """One client session: its upstream session and episodes end with it."""
        async with anyio.create_task_group() as tasks:
            state = _Session(_Upstream(upstream, tasks))
            try:
                yield state
            finally:
                if state.episode is not None:
                    tracer.end_episode(state.episode)
                for key in state.keys:
                    shared = keyed[key]
                    shared.sessions -= 1
                    if shared.sessions == 0:
                        tracer.end_episode(keyed.pop(key).episode)
                state.upstream.close()

    server = McpServer("trace-plugin-proxy", lifespan=session)

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        state = server.request_context.lifespan_context
        tools = (await state.upstream.call(lambda session: session.list_tools())).tools
        schemas[:] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.inputSchema},
            }
            for t in tools
        ]
        return tools

    def episode(state: _Session) -> tuple[ActiveEpisode, bool]:
        """The episode a call belongs to, and whether this call starts it."""
        context = server.request_context
        meta = context.meta.model_dump() if context.meta is not None else {}
        key = next((str(meta[k]) for k in EPISODE_META_KEYS if meta.get(k)), None)
        request = context.request
        if key is None and request is not None:
            key = request.headers.get("x-trace-episode")
        if key is None:
            if state.episode is None:
                state.episode = tracer.start_episode(None)
                return state.episode, True
            return state.episode, False
        first = key not in keyed
        if first:
            keyed[key] = _Keyed(tracer.start_episode(None, episode_id=key))
        if key not in state.keys:
            state.keys.add(key)
            keyed[key].sessions += 1
        return keyed[key].episode, first

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        state = server.request_context.lifespan_context
        active, first = episode(state)
        tools = list(schemas) if first and schemas else None
        with tracer.step(active, "tool", name, arguments, tools=tools) as step:
            try:
                result = await state.upstream.call(lambda session: session.call_tool(name, arguments))
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
    idle_timeout: float = IDLE_TIMEOUT,
    max_sessions: int = MAX_SESSIONS,
) -> RunningServer:
    """The proxy over streamable HTTP on a daemon thread."""
    proxy = build_proxy(upstream, agent=agent, recorder=recorder)
    return start_in_thread(http_app(proxy, idle_timeout=idle_timeout, max_sessions=max_sessions))
