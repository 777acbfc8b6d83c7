"""Shared by the tests: plays."""

from __future__ import annotations

import copy
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage

import trace_plugin
from integrations.scripted_chat_model import ScriptedChatModel

# The support agent's kind of few-shot, in OpenAI form (string arguments), as serving receives it.
EXAMPLES: list[dict[str, Any]] = [
    {"role": "user", "content": "Status of order #W1000001? My email is ann.lee12@example.com."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "ex1",
                "type": "function",
                "function": {"name": "get_order", "arguments": '{"order_id": "#W1000001"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "ex1", "content": '{"order_id": "#W1000001", "status": "pending"}'},
    {"role": "assistant", "content": "Your order #W1000001 is pending."},
]


def scripted(env, recorder, *, invent_ids: bool):
    """Replays the reference; with ``invent_ids`` every write targets an id nobody gave it."""
    from examples.support_agent.agent import environment_tools

    plan = copy.deepcopy(env.task.metadata["reference"])
    if invent_ids:
        for call in plan:
            if "order_id" in call["arguments"] and call["name"] not in ("get_order",):
                call["arguments"]["order_id"] = "#W9999999"
    facts = " ".join(env.task.metadata["facts"])

    def policy(messages):
        done = sum(1 for m in messages if m.type == "tool")
        if done < len(plan):
            return AIMessage(
                "",
                tool_calls=[{"id": f"c{done}", "name": plan[done]["name"], "args": plan[done]["arguments"]}],
            )
        return AIMessage(f"Your order is {facts} now." if facts else "All done, your request is complete.")

    graph = create_agent(
        ScriptedChatModel(policy=policy), environment_tools(env), system_prompt=env.system_prompt
    )
    return trace_plugin.capture(agent="planted", recorder=recorder)(graph)
