"""A capability: something the agent must be able to do, as mining found it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trace_plugin.records.trajectory import utcnow


@dataclass(slots=True)
class Capability:
    """One candidate from one mining pass, with the evidence behind its selection."""

    name: str
    description: str
    source: str  # "detector" (offline miner) or "llm" (LLM analyzer)
    selected: bool
    metrics: dict[str, Any]  # mean coverage and contrast, runs passed of N, per-run figures
    examples: list[str] = field(default_factory=list)  # failed episodes that lack it
    tools: list[str] = field(default_factory=list)  # tools those episodes called
    entities: list[str] = field(default_factory=list)  # what the calls acted on: "order" for order_id
    mining_run: str = ""
    mined_at: datetime = field(default_factory=utcnow)
