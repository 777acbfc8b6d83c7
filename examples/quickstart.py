"""Capture an existing LangGraph agent with one line, then read what was recorded.

The agent is an ordinary ``create_agent`` graph with two tools. Its model is a scripted
stand-in so that this runs anywhere offline; point ``model`` at any chat model (for
example ``ChatOpenAI(base_url=...)``) and nothing else changes.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from langchain.agents import create_agent
from langchain_core.tools import tool
from rich.console import Console
from rich.table import Table

import trace_plugin
from integrations.scripted_chat_model import ScriptedChatModel, call_tools_then_answer

ORDERS = {"W100": "delivered", "W200": "pending"}


@tool
def get_order_details(order_id: str) -> str:
    """Status of an order."""
    if order_id not in ORDERS:
        raise ValueError(f"unknown order {order_id}")
    return f"order {order_id} is {ORDERS[order_id]}"


@tool
def cancel_pending_order(order_id: str) -> str:
    """Cancel an order that has not shipped."""
    return f"order {order_id} cancelled"


@trace_plugin.capture(agent="quickstart", reward=lambda state: "cancelled" in state["messages"][-1].content)
def build_agent(order_id: str):
    model = ScriptedChatModel(
        policy=call_tools_then_answer(
            ("get_order_details", {"order_id": order_id}), ("cancel_pending_order", {"order_id": order_id})
        )
    )
    return create_agent(model, [get_order_details, cancel_pending_order])


def main() -> None:
    console = Console()
    db = Path(tempfile.mkdtemp()) / "quickstart.db"
    trace_plugin.configure(f"sqlite:///{db}")

    for order_id in ("W100", "W200"):
        agent = build_agent(order_id)
        state = agent.invoke({"messages": [("user", f"Please cancel order {order_id}.")]})
        console.print(f"[bold]{order_id}[/]: {state['messages'][-1].content}")
    trace_plugin.flush()

    store = trace_plugin.Store(f"sqlite:///{db}")
    oldest_first = store.list_episodes("quickstart")[::-1]
    # A delayed label from a human reviewer: W100 was delivered, so cancelling it was wrong.
    trace_plugin.feedback(oldest_first[0].id, label="failure", comment="delivered orders cannot be cancelled")
    trace_plugin.flush()

    for summary in oldest_first:
        episode = store.get_episode(summary.id)
        table = Table(
            title=f"episode {episode.id}: {episode.status}, reward={episode.reward}, label={episode.label}",
            title_justify="left",
        )
        for column in ("#", "kind", "name", "output or error"):
            table.add_column(column, no_wrap=True)
        for step in episode.steps:
            detail = json.dumps(step.error or step.output)
            table.add_row(str(step.seq), step.kind, step.name, detail[:36] + "…" * (len(detail) > 36))
        console.print(table)
    console.print(f"\nRecorded into {db}. Browse it with: trace-plugin episodes list --db sqlite:///{db}")


if __name__ == "__main__":
    main()
