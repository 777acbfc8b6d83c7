"""Shared by the tests: requests."""

from __future__ import annotations

import json

from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]


def retail_ticket() -> tuple[list[dict], list[dict]]:
    """The support agent's first request on a retail ticket: policy, tools, few-shot, ticket."""
    from langchain_core.messages import convert_to_openai_messages

    from examples.support_agent.agent import few_shot_messages

    env = RetailEnv()
    task = env.reset(TEST_SEEDS[0])
    examples = convert_to_openai_messages(few_shot_messages())
    return [
        {"role": "system", "content": env.system_prompt},
        *examples,
        {"role": "user", "content": task.prompt},
    ], env.tools


def content_of(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""
