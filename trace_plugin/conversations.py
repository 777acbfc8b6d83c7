"""Grouping separate model calls into episodes: the gateway's and litellm's capture.

Neither source sees the agent's run, only its model calls. A call belongs to the episode
its client names (the gateway's ``X-Trace-Episode`` header, or ``trace_episode_id`` in
the request metadata). Otherwise we follow the conversation: an agent's next call repeats
the messages of its last call plus the reply and what came after, so a call whose
messages extend a recorded exchange continues that exchange's episode, and any other call
starts a new one. A reply without tool calls ends the episode; a later call extending it
reopens nothing, it just adds steps and a newer end.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.records.trajectory import EpisodeEnd, Step, utcnow
from trace_plugin.tracer import ActiveEpisode, Tracer

_MAX_TRACKED = 10_000
# Sent as "false" by a client that records its own episode of its calls (the runner's chat
# loop), so that a recording server (the gateway) does not make a second episode of them.
RECORD_HEADER = "X-Trace-Record"


def _digest(previous: bytes, message: dict[str, Any]) -> bytes:
    """Chained digest of a message, blind to how clients re-serialize it (None vs "" content,
    argument JSON spacing and escaping)."""
    calls = [
        [c["function"]["name"], arguments_object(c["function"].get("arguments")), c.get("id")]
        for c in message.get("tool_calls") or []
    ]
    canonical = [
        message.get("role"),
        content_text(message.get("content")),
        calls,
        message.get("tool_call_id"),
    ]
    return hashlib.sha256(previous + json.dumps(canonical, sort_keys=True, default=str).encode()).digest()


def prefix_digests(messages: list[dict[str, Any]]) -> list[bytes]:
    """Digest of every prefix of ``messages`` (the i-th covers messages[: i + 1])."""
    digests, current = [], b""
    for message in messages:
        current = _digest(current, message)
        digests.append(current)
    return digests


_FINGERPRINT = "trace-plugin"


def fingerprint(router: str | None, adapter: str | None) -> str:
    """The gateway's ``system_fingerprint``: OpenAI's field for "the configuration that
    served this", which client libraries keep (LangChain's ``response_metadata``)."""
    return f"{_FINGERPRINT}/{router or '-'}/{adapter or '-'}"


def served_by(system_fingerprint: str | None) -> tuple[str | None, str | None] | None:
    """(router version, adapter) from a fingerprint of ours; None for anyone else's."""
    parts = (system_fingerprint or "").split("/", 2)
    if len(parts) != 3 or parts[0] != _FINGERPRINT:
        return None
    router, adapter = (None if part == "-" else part for part in parts[1:])
    return router, adapter


@dataclass(slots=True)
class ModelCall:
    """One chat-completion call as a capture source saw it (OpenAI message format)."""

    agent: str
    messages: list[dict[str, Any]]
    model: str
    reply: dict[str, Any] | None = None  # the first choice's assistant message
    tools: list[dict[str, Any]] | None = None
    input: Any = None  # what to store as the step's input; defaults to the messages and tool names
    episode_id: str | None = None
    adapter: str | None = None
    router: str | None = None  # the version of the router that chose ``adapter``
    output: Any = None  # what to store as the step's output; defaults to ``reply``
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    started_at: datetime | None = None
    token_ids: Any = None
    record: bool = True  # False: not recorded (its caller records its own episode of it)


class ConversationEpisodes:
    """Records model calls as steps of the episodes they belong to, per agent."""

    def __init__(self, tracer_for: Callable[[str], Tracer]) -> None:
        self._tracer_for = tracer_for
        self._by_id: OrderedDict[str, tuple[Tracer, ActiveEpisode]] = OrderedDict()
        self._by_digest: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()  # litellm calls its loggers from many threads

    def record(self, call: ModelCall) -> str:
        """Store ``call`` as an LLM step; returns its episode id."""
        with self._lock:
            tracer, active = self._begin(call)
            if call.reply is not None:
                self._remember(self._by_digest, prefix_digests([*call.messages, call.reply])[-1], active.id)
        tracer.record_step(
            Step(
                episode_id=active.id,
                seq=active.next_seq(),
                kind="llm",
                name=call.adapter or call.model,
                input=call.input
                if call.input is not None
                else {"messages": call.messages, "tools": [_tool_name(t) for t in call.tools or ()]},
                output=call.output if call.output is not None else call.reply,
                error=call.error,
                prompt_tokens=call.prompt_tokens,
                completion_tokens=call.completion_tokens,
                latency_ms=call.latency_ms,
                started_at=call.started_at,
                ended_at=utcnow(),
                token_ids=call.token_ids,
                tools=call.tools,
            )
        )
        if call.reply is not None and not call.reply.get("tool_calls"):
            end = EpisodeEnd(active.id, "completed", output=call.reply, model=call.model)
            tracer.recorder.submit(end, tracer.policy)
        return active.id

    def placed(self, call: ModelCall) -> bool:
        """Whether ``call``'s episode is settled: it names one, opens a conversation, or
        extends a recorded exchange. A source that logs calls out of order holds back the
        others until the earlier calls are in."""
        if call.episode_id is not None or not any(m.get("role") == "assistant" for m in call.messages):
            return True
        with self._lock:
            return self._known_prefix(call) is not None

    def _known_prefix(self, call: ModelCall) -> str | None:
        for digest in reversed(prefix_digests(call.messages)):
            if digest in self._by_digest:
                return self._by_digest[digest]
        return None

    def _begin(self, call: ModelCall) -> tuple[Tracer, ActiveEpisode]:
        episode_id = call.episode_id if call.episode_id is not None else self._known_prefix(call)
        if episode_id is not None and episode_id in self._by_id:
            self._by_id.move_to_end(episode_id)
            return self._by_id[episode_id]
        tracer = self._tracer_for(call.agent)
        active = tracer.start_episode(
            call.input if call.input is not None else {"messages": call.messages},
            episode_id=episode_id,
            model=call.model,
            adapter=call.adapter,
            router=call.router,
        )
        self._remember(self._by_id, active.id, (tracer, active))
        return tracer, active

    @staticmethod
    def _remember(table: OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _MAX_TRACKED:
            table.popitem(last=False)


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("function", tool).get("name", "?"))
