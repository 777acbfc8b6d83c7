"""Any environment, served over MCP, so any MCP client can practise in it.

The server lists the environment's tools (their JSON schemas as ``inputSchema``; the SDK
validates arguments against them and answers violations with ``isError`` results) plus
two control tools: ``env_reset`` (a seed in, the user's ticket out) and ``env_reward``
(the agent's final message in, the reward breakdown out). Each MCP session gets its own
environment instance, so many clients practise at once without seeing each other's
state, and every episode played is recorded in the store with its reward. An episode
left without ``env_reward`` (its session closed or expired, or a new ``env_reset``) is
recorded as interrupted.

A task that offers its own tools changes its session's list at ``env_reset``: the server
then sends ``notifications/tools/list_changed``, and the reset's result names the tools.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import mcp.types as types

from mcp_server.transport import McpServer
from trace_plugin.environments import Environment, ToolCall, observation_error, offered_tools
from trace_plugin.recorder import Recorder
from trace_plugin.records.outcome import graded_label
from trace_plugin.records.trajectory import Feedback
from trace_plugin.tracer import ActiveEpisode, Tracer

RESET, REWARD = "env_reset", "env_reward"
CONTROL_TOOLS = [
    types.Tool(
        name=RESET,
        description="Start a new episode; returns the user's request.",
        inputSchema={"type": "object", "properties": {"seed": {"type": "integer"}}, "required": ["seed"]},
    ),
    types.Tool(
        name=REWARD,
        description="Finish the episode with your final message to the user; returns the reward.",
        inputSchema={"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    ),
]


@dataclass
class _Session:
    env: Environment
    episode: ActiveEpisode | None = None
    tools: list[types.Tool] | None = None  # what the current task offers, when it differs


def mcp_tools(schemas: list[dict[str, Any]]) -> list[types.Tool]:
    return [
        types.Tool(
            name=t["function"]["name"],
            description=t["function"].get("description"),
            inputSchema=t["function"]["parameters"],
        )
        for t in schemas
    ]


def build_server(
    name: str, env_factory: Callable[[], Environment], *, recorder: Recorder | None = None
) -> McpServer[_Session]:
    """An MCP server for environment ``name``; instances come from ``env_factory``."""
    tracer = Tracer(f"env:{name}", source="mcp-env", recorder=recorder)

    def interrupt(state: _Session, why: str) -> None:
        if state.episode is not None:
            tracer.end_episode(state.episode, status="interrupted", error=why)
            state.episode = None

    @contextlib.asynccontextmanager
    async def session(_: McpServer[_Session]) -> AsyncIterator[_Session]:
        """One MCP session's environment, held exactly as long as the session lives."""
        state = _Session(env_factory())
        try:
            yield state
        finally:
            interrupt(state, f"the session ended before {REWARD}")

    server = McpServer(f"trace-plugin-env-{name}", lifespan=session, tools_changed=True)
    env_tools = mcp_tools(env_factory().tools)

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        state = server.request_context.lifespan_context
        return [*(env_tools if state.tools is None else state.tools), *CONTROL_TOOLS]

    @server.call_tool()
    async def call_tool(tool: str, arguments: dict[str, Any]) -> Any:
        state = server.request_context.lifespan_context
        if tool == RESET:
            interrupt(state, f"{RESET} was called again before {REWARD}")
            task = state.env.reset(int(arguments["seed"]))
            offered = offered_tools(state.env, task)
            state.episode = tracer.start_episode(
                {"messages": [{"role": "user", "content": task.prompt}]},
                metadata={"task_seed": task.seed, "task_kind": task.kind, "environment": name},
            )
            before, state.tools = state.tools, None if task.tools is None else mcp_tools(task.tools)
            if state.tools != before:
                await server.request_context.session.send_tool_list_changed()
            return {
                "prompt": task.prompt,
                "kind": task.kind,
                "system_prompt": state.env.system_prompt,
                "tools": [t["function"]["name"] for t in offered],
            }
        if state.episode is None:
            raise ValueError(f"call {RESET} with a seed first")
        if tool == REWARD:
            reward = state.env.reward(str(arguments.get("answer", "")))
            answer = {"role": "assistant", "content": arguments.get("answer", "")}
            tracer.end_episode(state.episode, output=answer)
            label = graded_label(reward.total)
            tracer.recorder.submit(
                Feedback(
                    state.episode.id,
                    reward=reward.total,
                    label=label,
                    source="environment",
                    comment=json.dumps(reward.components),
                )
            )
            state.episode = None
            return {"total": reward.total, "components": reward.components}
        with tracer.step(state.episode, "tool", tool, arguments) as step:
            step.output = observation = state.env.step(ToolCall(tool, arguments))
            step.error = observation_error(observation)
        is_error = step.error is not None
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=observation)], isError=is_error
        )

    return server
