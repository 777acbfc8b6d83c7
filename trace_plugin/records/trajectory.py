"""The trajectory model: what every capture source records and every later stage reads.

An ``Episode`` is one run of an agent on one task. Its ``Step`` list is the
ordered sequence of LLM calls, tool calls and graph-node executions. ``Feedback``
is a reward or label that arrives after the run (a user rating, a delayed check).

Capture sources build these records and hand them to the recorder; the store returns
them from queries. LLM steps use the OpenAI chat format for messages and tool calls
whatever the source, so mining and training see one shape.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

StepKind = Literal["llm", "tool", "node"]
AGENT_NAME_LENGTH = 200  # the store's limit; a longer name is refused when a capture is set up
EpisodeStatus = Literal["running", "completed", "error", "interrupted", "cancelled"]


def check_agent_name(agent: Any) -> str:
    """``agent`` if it can name an agent in every store, else a ValueError saying why."""
    if not isinstance(agent, str) or not agent.strip():
        raise ValueError(f"an agent name must be a non-empty string, not {agent!r:.80}")
    if len(agent) > AGENT_NAME_LENGTH or "\x00" in agent:
        raise ValueError(
            f"agent name {agent[:40]!r}… is {len(agent)} characters; at most {AGENT_NAME_LENGTH}, with no NUL"
        )
    return agent


def new_id() -> str:
    """A fresh random id: chosen by the client, so callers know it before it is stored."""
    return uuid.uuid4().hex


def new_episode_id() -> str:
    """A fresh episode id: 32 hex digits like ``new_id``'s, but time-ordered
    (milliseconds since the epoch, then 80 random bits, as in UUIDv7).

    Every capture source mints one per run, and the store indexes steps and links by it:
    new episodes land at the end of those indexes, where random ids scattered each
    batch's inserts over them. Its first digits are a timestamp: show its end, not its
    start, where a few characters must tell episodes apart.
    """
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class Step:
    """One event inside an episode; ``seq`` orders steps by their start. A number can be
    missing: LangGraph capture stores no step for a node that only repeats its own steps."""

    episode_id: str
    seq: int
    kind: StepKind
    name: str
    input: Any = None
    output: Any = None
    error: str | None = None
    tool_call_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    run_id: str | None = None
    parent_run_id: str | None = None
    token_ids: Any = None
    # OpenAI-format schemas of the tools offered to an LLM call; stored de-duplicated.
    tools: list[dict[str, Any]] | None = None


# The sources this package's capture paths record (``Episode.source``); a caller may name
# its own.
SOURCES = ("langgraph", "gateway", "mcp-proxy", "mcp-env", "runner", "environment", "litellm", "api")


@dataclass(slots=True)
class Episode:
    """One trajectory. ``reward`` and ``label`` hold the latest known outcome."""

    id: str
    agent: str
    source: str = "api"
    status: EpisodeStatus = "running"
    input: Any = None
    output: Any = None
    reward: float | None = None
    label: str | None = None
    error: str | None = None
    model: str | None = None
    adapter: str | None = None  # the LoRA adapter that served it (name@version), None: the base
    router: str | None = None  # the version of the router that chose it (``router_version``)
    started_at: datetime = field(default_factory=utcnow)
    ended_at: datetime | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.metadata is None:  # no metadata, stored and read back as the default's {}
            self.metadata = {}


@dataclass(slots=True)
class EpisodeEnd:
    """The end of a running episode: an update to the row its start created."""

    episode_id: str
    status: EpisodeStatus
    output: Any = None
    reward: float | None = None
    label: str | None = None
    error: str | None = None
    model: str | None = None
    adapter: str | None = None  # learned during the episode (a gateway's answer says it)
    router: str | None = None
    ended_at: datetime = field(default_factory=utcnow)


@dataclass(slots=True)
class Feedback:
    """A delayed reward or label; the latest one also becomes the episode's outcome."""

    episode_id: str
    reward: float | None = None
    label: str | None = None
    source: str = "api"
    comment: str | None = None
    created_at: datetime = field(default_factory=utcnow)
