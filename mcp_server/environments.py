"""Any environment, served over MCP, so any MCP client can practise in it.

The server lists the environment's tools (their JSON schemas as ``inputSchema``; the SDK
validates arguments against them and answers violations with ``isError`` results) plus
two control tools: ``env_reset`` (a seed in, the user's ticket out) and ``env_reward``
(the agent's final message in, the reward breakdown out). Each MCP session gets its own
environment instance, so many clients practise at once without seeing each other's
state, and every episode played is recorded in the store with its reward.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mcp.types as types

from mcp_server.transport import McpServer
from trace_plugin.environments import Environment, ToolCall, observation_error
from trace_plugin.recorder import Recorder
from trace_plugin.tracer import ActiveEpisode, Tracer
from trace_plugin.trajectory import Feedback

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


def build_server(
    name: str, env_factory: Callable[[], Environment], *, recorder: Recorder | None = None
) -> McpServer[Any]:
    """An MCP server for environment ``name``; instances come from ``env_factory``."""
    server: McpServer[Any] = McpServer(f"trace-plugin-env-{name}")
    tracer = Tracer(f"env:{name}", source="mcp-env", recorder=recorder)
    sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
    prototype = env_factory()
    env_tools = [
        types.Tool(
            name=t["function"]["name"],
            description=t["function"].get("description"),
            inputSchema=t["function"]["parameters"],
        )
        for t in prototype.tools
    ]

    def session() -> _Session:
        key = server.request_context.session
        if key not in sessions:
            sessions[key] = _Session(env_factory())
        return sessions[key]

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return [*env_tools, *CONTROL_TOOLS]

    @server.call_tool()
    async def call_tool(tool: str, arguments: dict[str, Any]) -> Any:
        state = session()
        if tool == RESET:
            task = state.env.reset(int(arguments["seed"]))
            state.episode = tracer.start_episode(
                {"messages": [{"role": "user", "content": task.prompt}]},
                metadata={"task_seed": task.seed, "task_kind": task.kind, "environment": name},
            )
            return {"prompt": task.prompt, "kind": task.kind, "system_prompt": state.env.system_prompt}
        if state.episode is None:
            raise ValueError(f"call {RESET} with a seed first")
        if tool == REWARD:
            reward = state.env.reward(str(arguments.get("answer", "")))
            answer = {"role": "assistant", "content": arguments.get("answer", "")}
            tracer.end_episode(state.episode, output=answer)
            label = "success" if reward.total >= 1.0 else "failure"
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
