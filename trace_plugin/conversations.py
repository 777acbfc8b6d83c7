"""Grouping separate model calls into episodes: the gateway's and litellm's capture.

Neither source sees the agent's run, only its model calls. A call belongs to the episode
its client names (the gateway's ``X-Trace-Episode`` header, or ``trace_episode_id`` in
the request metadata). Otherwise we follow the conversation: an agent's next call repeats
the messages of its last call plus the reply and what came after, so a call whose
messages extend a recorded exchange continues that exchange's episode, and any other call
starts a new one. A reply without tool calls ends the episode; a later call extending it
reopens nothing, it just adds steps and a newer end.

A conversation whose last reply asked for tools may never be continued (a terminating
tool, the agent's turn cap, a client that gave up), so nothing would end it: it is ended
``completed`` once idle past ``idle_timeout`` (``ConversationEpisodes.sweep``) or
pushed out of the tracked set, and ``interrupted`` by ``ConversationEpisodes.close``
at shutdown. A call can also end its episode itself (``ModelCall.end``): a client that
hung up mid-reply ends it ``cancelled``. None is left ``running``, where mining would
never see it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.records.trajectory import EpisodeEnd, EpisodeStatus, Step, utcnow
from trace_plugin.tracer import ActiveEpisode, Tracer

_MAX_TRACKED = 10_000
IDLE_TIMEOUT = 600.0  # seconds after a reply with tool calls before a silent conversation is over
SHUT_DOWN = "the server stopped with the conversation open"
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
    end: EpisodeStatus | None = None  # end the episode with this status, ``error`` its reason


@dataclass(slots=True)
class _Conversation:
    """A tracked episode; it is open while it is in ``ConversationEpisodes._open``."""

    tracer: Tracer
    active: ActiveEpisode
    last_call: float  # time.monotonic() of its latest call
    model: str
    reply: dict[str, Any] | None = None


class ConversationEpisodes:
    """Records model calls as steps of the episodes they belong to, per agent."""

    def __init__(
        self,
        tracer_for: Callable[[str], Tracer],
        *,
        idle_timeout: float = IDLE_TIMEOUT,
        max_tracked: int = _MAX_TRACKED,
    ) -> None:
        self._tracer_for = tracer_for
        self.idle_timeout = idle_timeout
        self._max_tracked = max_tracked
        self._by_id: OrderedDict[str, _Conversation] = OrderedDict()  # least recently called first
        self._open: OrderedDict[str, _Conversation] = OrderedDict()  # those open, the same order
        self._by_digest: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()  # litellm calls its loggers from many threads

    def record(self, call: ModelCall) -> str:
        """Store ``call`` as an LLM step; returns its episode id. Conversations idle past
        ``idle_timeout`` are ended on the way."""
        with self._lock:
            self._sweep()
            conversation = self._begin(call)
            tracer, active = conversation.tracer, conversation.active
            if call.reply is not None:
                self._remember(self._by_digest, prefix_digests([*call.messages, call.reply])[-1], active.id)
            conversation.reply, conversation.model = call.reply, call.model
            is_open = call.end is None and (call.reply is None or bool(call.reply.get("tool_calls")))
            if is_open:  # never past max_tracked: it holds only conversations _by_id tracks
                self._open[active.id] = conversation
                self._open.move_to_end(active.id)
            else:
                self._open.pop(active.id, None)
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
        if call.end is not None:
            _end(conversation, call.end, call.error)
        elif not is_open:
            _end(conversation, "completed")
        return active.id

    def sweep(self) -> int:
        """End the open conversations idle past ``idle_timeout``; returns how many."""
        with self._lock:
            return self._sweep()

    def close(self) -> int:
        """End every open conversation (``interrupted``): the server is stopping."""
        with self._lock:
            ended = list(self._open.values())
            self._open.clear()
        for conversation in ended:
            _end(conversation, "interrupted", SHUT_DOWN)
        return len(ended)

    def _sweep(self) -> int:
        deadline = time.monotonic() - self.idle_timeout
        ended = 0
        while self._open:
            conversation = next(iter(self._open.values()))
            if conversation.last_call > deadline:
                break  # the rest were called later
            self._open.popitem(last=False)
            _end(conversation, "completed")
            ended += 1
        return ended

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

    def _begin(self, call: ModelCall) -> _Conversation:
        episode_id = call.episode_id if call.episode_id is not None else self._known_prefix(call)
        if episode_id is not None and episode_id in self._by_id:
            self._by_id.move_to_end(episode_id)
            conversation = self._by_id[episode_id]
            conversation.last_call = time.monotonic()
            return conversation
        tracer = self._tracer_for(call.agent)
        active = tracer.start_episode(
            call.input if call.input is not None else {"messages": call.messages},
            episode_id=episode_id,
            model=call.model,
            adapter=call.adapter,
            router=call.router,
        )
        conversation = _Conversation(tracer, active, time.monotonic(), call.model)
        for evicted in self._remember(self._by_id, active.id, conversation):
            if self._open.pop(evicted.active.id, None) is not None:
                _end(evicted, "completed")
        return conversation

    def _remember(self, table: OrderedDict, key: Any, value: Any) -> list[Any]:
        """Track ``key``; returns the values pushed out past ``max_tracked``."""
        table[key] = value
        table.move_to_end(key)
        evicted = []
        while len(table) > self._max_tracked:
            evicted.append(table.popitem(last=False)[1])
        return evicted


def _end(conversation: _Conversation, status: EpisodeStatus, error: str | None = None) -> None:
    tracer, active = conversation.tracer, conversation.active
    end = EpisodeEnd(active.id, status, output=conversation.reply, error=error, model=conversation.model)
    tracer.recorder.submit(end, tracer.policy)


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("function", tool).get("name", "?"))
