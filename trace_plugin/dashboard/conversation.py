"""An episode's conversation as the agent saw it, flattened for display."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.records.trajectory import Episode


def pretty(value: Any) -> str:
    """Payloads as indented JSON; strings that hold JSON (tool results often do) too."""
    if isinstance(value, str):
        parsed = arguments_object(value)
        if not isinstance(parsed, dict | list):
            return value
        value = parsed
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None


def _message(raw: Any) -> Message:
    if not isinstance(raw, dict):  # e.g. a LangChain (role, text) tuple
        return Message("?", pretty(raw))
    calls = []
    for call in raw.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append(
            ToolCall(
                call.get("id") if isinstance(call, dict) else None,
                str(function.get("name", "?")),
                pretty(arguments_object(function.get("arguments"))),
            )
        )
    return Message(
        str(raw.get("role", "?")), content_text(raw.get("content")), calls, raw.get("tool_call_id")
    )


def conversation(episode: Episode) -> list[Message]:
    """The last call of the agent's own model, its messages plus its reply.

    A model called inside a tool is not the agent's conversation (the miner's rule too);
    episodes without LLM steps (MCP proxy) fall back to the messages of their input.
    """
    tool_runs = {s.run_id for s in episode.steps if s.kind == "tool" and s.run_id}
    llm = [
        s
        for s in episode.steps
        if s.kind == "llm" and isinstance(s.input, dict) and s.parent_run_id not in tool_runs
    ]
    if llm:
        last = llm[-1]
        messages = list(last.input.get("messages") or [])
        if last.output is not None:
            reply = (
                last.output
                if isinstance(last.output, dict)
                else {"role": "assistant", "content": last.output}
            )
            messages.append(reply)
    else:
        messages = episode.input.get("messages") or [] if isinstance(episode.input, dict) else []
    return [_message(m) for m in messages]
