"""A plain litellm tool-calling agent, captured by trace-plugin's litellm callback.

The agent is ordinary litellm code; the one added line registers ``TraceLogger``. With
``--base-url`` it talks to any OpenAI-compatible server (our gateway, vLLM); without it,
litellm's ``mock_response`` stands in for the model so that it runs anywhere offline.

Run: python examples/litellm_agent.py [--base-url http://127.0.0.1:8000/v1 --model default]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402

from integrations.litellm import TraceLogger  # noqa: E402
from trace_plugin.recorder import Recorder  # noqa: E402

ORDERS = {"W100": "delivered"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Status of an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]
SCRIPT = [  # what the stand-in model says, turn by turn
    {
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_order", "arguments": '{"order_id": "W100"}'},
            }
        ]
    },
    {"content": "Your order W100 has been delivered."},
]


def run(user: str, *, model: str, base_url: str | None) -> str:
    messages = [{"role": "system", "content": "You are a support agent."}, {"role": "user", "content": user}]
    for turn in range(4):
        options = {"api_base": base_url, "api_key": "unused"} if base_url else {"mock_response": _mock(turn)}
        reply = litellm.completion(model=model, messages=messages, tools=TOOLS, **options).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            order_id = json.loads(call.function.arguments).get("order_id", "")
            result = ORDERS.get(order_id, "unknown order")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def _mock(turn: int) -> litellm.ModelResponse:
    return litellm.ModelResponse(choices=[{"message": {"role": "assistant", **SCRIPT[min(turn, 1)]}}])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url")
    parser.add_argument("--model", default="openai/default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(f"sqlite:///{Path(tmp) / 'trace.db'}")
        logger = TraceLogger(agent="litellm-agent", recorder=recorder)
        litellm.callbacks = [logger]  # the one line trace-plugin adds
        answer = run("Where is my order W100?", model=args.model, base_url=args.base_url)
        print("answer:", answer)
        logger.flush()
        recorder.flush()
        [episode] = recorder.store.list_episodes("litellm-agent")
        steps = recorder.store.get_episode(episode.id).steps
        print(f"recorded episode {episode.id}: {len(steps)} model calls")
        for step in steps:
            print(" ", step.kind, step.name, json.dumps(step.output)[:100])
        recorder.close()


if __name__ == "__main__":
    main()
