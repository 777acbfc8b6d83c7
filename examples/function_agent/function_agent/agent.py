"""The agent: LangGraph, function calling, and the tools each request brings.

A request is ``{"messages": [...], "tools": [OpenAI function schemas]}``: the functions it
may use differ from one request to the next, so the model binds the request's own tools
on every turn. ``run`` executes a call: in production the functions of
:mod:`function_agent.tools` (``tools.answer``); inside a trace-plugin environment, that
environment's ``step``. One decorator records every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypedDict

import httpx
from langchain_core.messages import AnyMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

import trace_plugin
from function_agent import SYSTEM_PROMPT, tools

AGENT = "function-agent"

Run = Callable[[str, dict[str, Any]], str]  # a function's name and arguments -> what it returned


class Request(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    tools: list[dict[str, Any]]  # the functions this request offers


@trace_plugin.capture(agent=AGENT)
def build_function_agent(run: Run = tools.answer, *, base_url: str, model: str, max_tokens: int = 96) -> Any:
    # A small model goes on to invent the function's answer after its call: stop it there.
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        stop=["<tool_response>"],
        http_async_client=httpx.AsyncClient(timeout=600),
    )

    async def think(request: Request) -> dict[str, Any]:
        offered = request.get("tools") or []
        bound = llm.bind_tools(offered) if offered else llm
        reply = await bound.ainvoke([SystemMessage(SYSTEM_PROMPT), *request["messages"]])
        return {"messages": [reply]}

    async def act(request: Request) -> dict[str, Any]:
        calls = request["messages"][-1].tool_calls
        return {"messages": [ToolMessage(run(c["name"], c["args"]), tool_call_id=c["id"]) for c in calls]}

    def route(request: Request) -> str:
        return "act" if getattr(request["messages"][-1], "tool_calls", None) else END

    graph = StateGraph(Request)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_conditional_edges("think", route, ["act", END])
    graph.add_edge("act", "think")
    return graph.compile()
