"""A retail support agent, written the way a team would write it.

``create_agent`` with ``ChatOpenAI(base_url=...)`` pointed at any OpenAI-compatible
endpoint, the retail environment's tools, and a short few-shot of worked examples (small
models make almost no correct tool calls without one). The capture decorator is the one
line trace-plugin adds.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from langchain.agents import create_agent
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI

import trace_plugin
from trace_plugin.environments import Environment, ToolCall

# Two worked examples, placed before the user's ticket: identify, look up, act, report.
FEW_SHOT: list[tuple[str, Any]] = [
    ("user", "Cancel order #W1000001, reason: ordered by mistake. My email is ann.lee12@example.com."),
    ("ai", {"tool_calls": [{"id": "ex1", "name": "find_user", "args": {"email": "ann.lee12@example.com"}}]}),
    ("tool", {"tool_call_id": "ex1", "content": '"ann_lee_1234"'}),
    ("ai", {"tool_calls": [{"id": "ex2", "name": "get_order", "args": {"order_id": "#W1000001"}}]}),
    ("tool", {"tool_call_id": "ex2", "content": '{"order_id": "#W1000001", "status": "pending"}'}),
    (
        "ai",
        {
            "tool_calls": [
                {
                    "id": "ex3",
                    "name": "cancel_order",
                    "args": {"order_id": "#W1000001", "reason": "ordered by mistake"},
                }
            ]
        },
    ),
    ("tool", {"tool_call_id": "ex3", "content": '{"order_id": "#W1000001", "status": "cancelled"}'}),
    ("ai", "Your order #W1000001 is cancelled."),
    ("user", "Return the Backpack from order #W2000002. I'm Bo Diaz, zip 80202."),
    (
        "ai",
        {
            "tool_calls": [
                {
                    "id": "ex4",
                    "name": "find_user",
                    "args": {"first_name": "Bo", "last_name": "Diaz", "zip": "80202"},
                }
            ]
        },
    ),
    ("tool", {"tool_call_id": "ex4", "content": '"bo_diaz_5678"'}),
    ("ai", {"tool_calls": [{"id": "ex5", "name": "get_order", "args": {"order_id": "#W2000002"}}]}),
    (
        "tool",
        {
            "tool_call_id": "ex5",
            "content": '{"status": "pending", "items": [{"item_id": "551234", "name": "Backpack"}]}',
        },
    ),
    ("ai", "Order #W2000002 is still pending, so its items cannot be returned yet."),
]


def few_shot_messages() -> list[Any]:
    """The few-shot as LangChain messages."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    messages: list[Any] = []
    for role, body in FEW_SHOT:
        if role == "user":
            messages.append(HumanMessage(body))
        elif role == "tool":
            messages.append(ToolMessage(body["content"], tool_call_id=body["tool_call_id"]))
        elif isinstance(body, dict):
            messages.append(AIMessage("", tool_calls=body["tool_calls"]))
        else:
            messages.append(AIMessage(body))
    return messages


def environment_tools(env: Environment) -> list[StructuredTool]:
    """The environment's tools, with its own compact JSON schemas, acting on ``env``."""

    def make(schema: dict[str, Any]) -> StructuredTool:
        name = schema["function"]["name"]

        def run(**arguments: Any) -> str:
            return env.step(ToolCall(name, arguments))

        return StructuredTool.from_function(
            func=run,
            name=name,
            description=schema["function"].get("description", name),
            args_schema=schema["function"]["parameters"],
        )

    return [make(schema) for schema in env.tools]


@trace_plugin.capture(agent="support-agent")
def build_support_agent(env: Environment, *, base_url: str, model: str, max_tokens: int = 96):
    # A small model goes on to invent the tool's answer after its call: stop it there.
    # An HTTP client per agent: langchain-openai's shared default one is bound to the first
    # event loop that used it, and this agent runs under several.
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        stop=["<tool_response>"],
        http_async_client=httpx.AsyncClient(timeout=600),
    )
    return create_agent(llm, environment_tools(env), system_prompt=env.system_prompt)


def main() -> None:
    import argparse
    import asyncio

    from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv
    from trace_plugin.environments.runner import LangGraphAgent, Runner, do_nothing_baseline, summarize

    parser = argparse.ArgumentParser(description="Run the support agent on the retail test split.")
    parser.add_argument(
        "--base-url", help="an OpenAI-compatible endpoint; default: start the embedded gateway"
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tasks", type=int, default=len(TEST_SEEDS))
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    seeds = list(TEST_SEEDS)[: args.tasks]

    server = None
    if args.base_url is None:
        from trace_plugin.gateway.app import GatewayConfig, create_app
        from trace_plugin.gateway.embedded import EmbeddedBackend
        from trace_plugin.gateway.server import start_in_thread

        server = start_in_thread(create_app(EmbeddedBackend(), config=GatewayConfig(record=False)))
        args.base_url = server.url + "/v1"
    agent = LangGraphAgent(
        lambda env: build_support_agent(env, base_url=args.base_url, model=args.model),
        examples=few_shot_messages(),
    )
    runner = Runner(RetailEnv, agent, concurrency=args.concurrency)
    results = asyncio.run(runner.run(seeds, description="support agent"))
    baseline = do_nothing_baseline(RetailEnv, seeds)
    runner.console.print(summarize(results, f"Support agent ({args.model}) on {len(seeds)} test tasks"))
    runner.console.print(summarize(baseline, "Do-nothing baseline on the same tasks"))
    if server is not None:
        server.stop()
    trace_plugin.flush()
    print(
        json.dumps(
            {
                "model": args.model,
                "tasks": len(seeds),
                "success": sum(r.reward.total for r in results) / len(results),
                "do_nothing": sum(r.reward.total for r in baseline) / len(baseline),
                "by_kind": {
                    k: sum(r.reward.total for r in results if r.kind == k)
                    / max(1, sum(r.kind == k for r in results))
                    for k in sorted({r.kind for r in results})
                },
            }
        )
    )


if __name__ == "__main__":
    main()
