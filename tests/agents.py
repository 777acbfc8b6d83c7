"""Small real LangGraph agents for the capture tests, driven by the scripted model."""

from __future__ import annotations

import warnings
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import ToolException, tool

import trace_plugin
from integrations.scripted_chat_model import ScriptedChatModel, call_tools_then_answer


@tool
def get_order(order_id: str) -> str:
    """Look up an order by id."""
    return f"order {order_id} is pending"


@tool
def find_user(email: str) -> dict:
    """Find a user by e-mail."""
    return {"user_id": "u_" + email.split("@")[0], "email": email}


@tool
def whoami() -> str:
    """Report the episode this tool runs in."""
    return str(trace_plugin.current_episode_id())


@tool
def broken(order_id: str) -> str:
    """A tool that crashes."""
    raise RuntimeError(f"database exploded on {order_id}")


@tool
def refuse(order_id: str) -> str:
    """A tool that reports a handled failure."""
    raise ToolException(f"order {order_id} cannot be cancelled")


refuse.handle_tool_error = True


class Opaque:
    """A tool result with no JSON form."""

    def __repr__(self) -> str:
        return "<Opaque thing>"


@tool
def opaque(order_id: str) -> Any:
    """Returns an object that is not JSON-serializable."""
    return Opaque()


SUMMARIZER = ScriptedChatModel(
    policy=lambda messages: AIMessage(content="summary: all good"), model_name="summarizer"
)


@tool
def summarize(order_id: str) -> str:
    """A tool that itself calls an LLM."""
    return str(SUMMARIZER.invoke(f"summarize {order_id}").content)


TOOLS = [get_order, find_user, whoami, broken, refuse, opaque, summarize]


def model_for(*calls: tuple[str, dict[str, Any]], latency: float = 0.0) -> ScriptedChatModel:
    return ScriptedChatModel(policy=call_tools_then_answer(*calls), latency=latency)


def build(kind: str, model: ScriptedChatModel, tools=TOOLS):
    """A compiled agent graph from LangChain's ``create_agent`` or LangGraph's prebuilt."""
    if kind == "create_agent":
        from langchain.agents import create_agent

        return create_agent(model, tools)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(model, tools)


def user(text: str) -> dict[str, list[tuple[str, str]]]:
    return {"messages": [("user", text)]}


def last_text(state: dict[str, list[BaseMessage]]) -> str:
    return str(state["messages"][-1].content)
