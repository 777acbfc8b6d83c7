"""Grouping gateway calls into episodes, so any OpenAI-compatible agent is captured.

A call belongs to the episode its client names (the ``X-Trace-Episode`` header, or
``metadata.trace_episode_id`` in the body). Otherwise the gateway follows the
conversation: an agent's next call repeats the messages of its last call plus the reply
and what came after, so a call whose messages extend a recorded exchange continues that
exchange's episode, and any other call starts a new one.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.tracer import ActiveEpisode, Tracer

_MAX_TRACKED = 10_000


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


class ConversationEpisodes:
    """Finds or starts the episode of each gateway call, per agent."""

    def __init__(self, tracer_for: Any) -> None:
        self._tracer_for = tracer_for  # agent name -> Tracer
        self._by_id: OrderedDict[str, tuple[Tracer, ActiveEpisode]] = OrderedDict()
        self._by_digest: OrderedDict[bytes, str] = OrderedDict()

    def begin(
        self,
        agent: str,
        messages: list[dict[str, Any]],
        episode_id: str | None,
        *,
        model: str,
        adapter: str | None,
    ) -> tuple[Tracer, ActiveEpisode]:
        if episode_id is None:
            for digest in reversed(prefix_digests(messages)):
                if digest in self._by_digest:
                    episode_id = self._by_digest[digest]
                    break
        if episode_id is not None and episode_id in self._by_id:
            self._by_id.move_to_end(episode_id)
            return self._by_id[episode_id]
        tracer = self._tracer_for(agent)
        active = tracer.start_episode(
            {"messages": messages}, episode_id=episode_id, model=model, adapter=adapter
        )
        self._remember(self._by_id, active.id, (tracer, active))
        return tracer, active

    def after_reply(self, episode_id: str, messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """Remember the exchange so the agent's next call finds this episode."""
        digest = prefix_digests([*messages, reply])[-1]
        self._remember(self._by_digest, digest, episode_id)

    @staticmethod
    def _remember(table: OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _MAX_TRACKED:
            table.popitem(last=False)
