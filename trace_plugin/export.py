"""Fine-tuning datasets out of the store, in the shapes other tools read as they are.

    from trace_plugin.export import dataset, write_jsonl
    write_jsonl(dataset(Store(), "support", format="openai", outcome="success"), Path("ft.jsonl"))

An episode's conversation is its agent's last model call, the messages it sent and the
reply it got (a model called inside a tool is not the agent's: the miner's rule), with
the tools that call offered. Three row shapes, since OpenAI and TRL disagree:

- ``openai``: OpenAI's chat fine-tuning line: tool-call ``arguments`` as JSON strings,
  ``tools`` an array, and a final assistant message (an episode that ends on a tool call
  is left out: OpenAI refuses it).
- ``trl``: the conversational shape TRL's ``SFTTrainer`` reads as it is: arguments as
  objects, as chat templates render them, and ``tools`` as a JSON string, since schemas
  that differ from row to row break Arrow's types (``datasets`` #7322; TRL parses it).
- ``tokens``: one row per LLM step the gateway served, the ids it generated from and
  sampled, with the episode's reward, adapter and router version, for off-policy RL.

Rows are made as they are read, a page of episodes at a time (``Store.iter_episodes``),
so an export of any size holds one page in memory. Reference plays (``reference_plays``)
give the ``trl`` and ``openai`` rows of the solutions an expert's warm start trains on.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import orjson

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.environments.base import DistinctPlays, Environment, play_reference, request_key
from trace_plugin.errors import TracePluginError
from trace_plugin.payload import Redactor, make_redactor, redact_text
from trace_plugin.records.trajectory import SOURCES, Episode
from trace_plugin.store import Store
from trace_plugin.store.store import EpisodeFilter

Format = Literal["openai", "trl", "tokens"]
OutcomeFilter = Literal["success", "failure", "any"]
Row = dict[str, Any]

# Why an episode (or a seed) gave no row: the keys of ``Export.left_out``.
RUNNING = "still running"
NO_CONVERSATION = "no readable model call"  # tool calls alone (MCP proxy), a failed call, a cut payload
ENDS_ON_TOOL_CALL = "ends on a tool call"
NO_TOKEN_IDS = "no token ids"  # recorded elsewhere than the gateway
UNPLAYABLE = "no successful reference within the turn limit"
REPEATED = "repeats an earlier seed's task"
NOT_OPENAI = "not OpenAI's format"  # followed by the first problem (openai_problems)

_ROLE_OF = {"human": "user", "ai": "assistant"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ExportError(TracePluginError, ValueError):
    """An export that cannot be made as asked."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """OpenAI chat messages (tool-call arguments as JSON strings), ending with the reply,
    and the OpenAI schemas of the tools offered."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    # The messages the agent's first model call was sent (system prompt, worked examples,
    # the request): the assistant messages after them are the ones its model wrote.
    opening: int = 0


class Export(Iterator[Row]):
    """Rows made from sources (episodes, or seeds) as the rows are consumed: ``total``
    sources to read, ``read`` so far, and ``left_out``, the sources that gave no row, by
    reason (running episodes are counted before the first row)."""

    def __init__(
        self,
        sources: Iterable[Any],
        rows_of: Callable[[Any], list[Row] | str],
        total: int,
        left_out: Counter[str] | None = None,
    ) -> None:
        self.total, self.read = total, 0
        self.left_out: Counter[str] = left_out or Counter()
        self._sources, self._rows_of = iter(sources), rows_of
        self._pending: deque[Row] = deque()

    def __next__(self) -> Row:
        while not self._pending:
            source = next(self._sources)
            self.read += 1
            rows = self._rows_of(source)
            if isinstance(rows, str):
                self.left_out[rows] += 1
            else:
                self._pending.extend(rows)
        return self._pending.popleft()


def dataset(
    store: Store,
    agent: str,
    *,
    format: Format = "trl",
    outcome: OutcomeFilter = "any",
    since: datetime | None = None,
    until: datetime | None = None,
    min_reward: float | None = None,
    limit: int | None = None,
    sources: Sequence[str] = (),
    redact: bool | Redactor | None = None,
) -> Export:
    """``agent``'s finished episodes as rows of ``format``, newest first.

    ``since`` is inclusive, ``until`` exclusive (naive means UTC); ``limit`` reads the
    newest that many; ``sources`` keeps episodes recorded by those sources (``langgraph``,
    ``gateway``, ``runner``...). ``redact`` applies the capture-time redactors to message
    text and tool-call arguments (``True``: the built-in patterns; a function: after them);
    the one a capture used is not stored, so this is not a promise of "as at capture".
    """
    if format not in get_args(Format):
        raise ExportError(f"format {format!r} is not one of {', '.join(get_args(Format))}")
    if outcome not in get_args(OutcomeFilter):
        raise ExportError(f"outcome {outcome!r} is not one of {', '.join(get_args(OutcomeFilter))}")
    if min_reward is not None and not math.isfinite(min_reward):
        raise ExportError(f"min_reward must be a finite number, not {min_reward!r}")
    for source in sources:  # a typo would export nothing, silently
        recorded = sum(store.episode_statuses(EpisodeFilter(agent, sources=(source,))).values())
        if source not in SOURCES and not recorded:
            raise ExportError(
                f"no episode of {agent!r} was recorded by source {source!r}; the built-in sources are "
                f"{', '.join(SOURCES)}"
            )
    redactor = make_redactor(redact)
    if format == "tokens" and redactor is not None:
        raise ExportError("token ids cannot be redacted: export messages (openai or trl) instead")
    where = EpisodeFilter(
        agent,
        outcome=None if outcome == "any" else outcome,
        sources=tuple(sources),
        since=since,
        until=until,
        min_reward=min_reward,
    )
    statuses = store.episode_statuses(where)
    running = statuses.pop("running", 0)
    finished = sum(statuses.values())
    total = finished if limit is None else min(limit, finished)

    episodes = store.iter_episodes(where, limit=limit)
    return Export(
        episodes,
        lambda episode: episode_rows(episode, format, redactor),
        total,
        Counter({RUNNING: running}) if running else None,
    )


def episode_rows(episode: Episode, format: Format, redactor: Redactor | None = None) -> list[Row] | str:
    """One episode's rows of ``format``, or why it gives none (a ``left_out`` reason)."""
    if episode.status == "running":
        return RUNNING
    if format == "tokens":
        return token_rows(episode) or NO_TOKEN_IDS
    found = conversation(episode)
    if found is None:
        return NO_CONVERSATION
    return _rows_of_conversation(_redacted(found, redactor) if redactor else found, format)


def reference_plays(
    env_factory: Callable[[], Environment],
    seeds: Sequence[int],
    *,
    format: Literal["openai", "trl"] = "trl",
    max_turns: int,
    max_observation_chars: int,
    examples: Sequence[dict[str, Any]] = (),
) -> Export:
    """The verified reference solutions of an environment's tasks on ``seeds`` as the warm
    start plays them (``training.episodes.EpisodePlayer.reference``, whose ids are these
    rows rendered by our chat template), behind the agent's ``examples``; a seed whose
    task repeats an earlier one's is passed over, as the warm start does. ``seeds`` are
    read as they are played (a ``range`` of any length costs nothing up front)."""
    distinct = DistinctPlays(
        env_factory,
        lambda seed: _reference_conversation(env_factory(), seed, max_turns, max_observation_chars, examples),
    )

    def rows_of(seed: int) -> list[Row] | str:
        play = distinct(seed)
        if isinstance(play, str):
            return {"repeated": REPEATED, "unplayable": UNPLAYABLE}[play]
        return _rows_of_conversation(play, format)

    return Export(seeds, rows_of, len(seeds))


# -- one episode ------------------------------------------------------------------------


def conversation(episode: Episode) -> Conversation | None:
    """The agent's last model call as a conversation ending with its reply, or None when
    there is none to read: no model call (tool calls alone), or one that failed or whose
    payload was cut."""
    tool_runs = {s.run_id for s in episode.steps if s.kind == "tool" and s.run_id}
    calls = [
        s
        for s in episode.steps
        if s.kind == "llm" and isinstance(s.input, dict) and s.parent_run_id not in tool_runs
    ]
    if not calls:
        return None
    last = calls[-1]
    raw = last.input.get("messages")
    reply = last.output
    if isinstance(reply, dict) and isinstance(reply.get("choices"), list):  # n > 1: the one it went on with
        reply = reply["choices"][0] if reply["choices"] else None
    if isinstance(reply, str):
        reply = {"role": "assistant", "content": reply}
    messages = _messages([*raw, reply]) if isinstance(raw, list) and reply is not None else None
    if not messages or messages[-1]["role"] != "assistant":
        return None
    first = calls[0].input.get("messages")
    opening = len(_messages(first) or []) if isinstance(first, list) else len(messages) - 1
    return Conversation(messages, list(last.tools or []), min(opening, len(messages) - 1))


def _messages(raw: list[Any]) -> list[dict[str, Any]] | None:
    """``raw`` as ``_message`` gives each, with tool calls and results paired by id;
    None if one is not a chat message."""
    messages = []
    for item in raw:
        message = _message(item)
        if message is None:
            return None
        messages.append(message)
    return _paired(messages)


def _message(raw: Any) -> dict[str, Any] | None:
    """One message in OpenAI's form with text content, or None if it is not a chat message."""
    if isinstance(raw, list | tuple) and len(raw) == 2 and isinstance(raw[0], str):  # ("user", "hi")
        raw = {"role": raw[0], "content": raw[1]}
    if not isinstance(raw, dict):
        return None
    role = raw.get("role")
    role = _ROLE_OF.get(role, role)
    if role not in _ROLES:
        return None
    text = content_text(raw.get("content"))
    if role == "tool":
        return {"role": "tool", "tool_call_id": raw.get("tool_call_id"), "content": text}
    message: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant" and raw.get("tool_calls"):
        message["tool_calls"] = [_tool_call(c) for c in raw["tool_calls"] if isinstance(c, dict)]
    return message


def _tool_call(raw: dict[str, Any]) -> dict[str, Any]:
    function = raw.get("function", raw)
    arguments = function.get("arguments")
    if isinstance(arguments, str) and "\\u" in arguments:
        arguments = arguments_object(arguments)  # a lone surrogate's escape, parsed, is U+FFFD
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {
        "id": raw.get("id"),
        "type": "function",
        "function": {"name": str(function.get("name", "")), "arguments": arguments},
    }


def _paired(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every tool call with an id, and every tool message with the id of the call it
    answers: a call recorded without one gets one made from its place, and a result
    without one answers the oldest call still unanswered (OpenAI requires both)."""
    unanswered: deque[str] = deque()
    for n, message in enumerate(messages):
        for i, call in enumerate(message.get("tool_calls") or ()):
            call["id"] = call["id"] or f"call_{n}_{i}"
            unanswered.append(call["id"])
        if message["role"] == "tool":
            if message["tool_call_id"] in unanswered:
                unanswered.remove(message["tool_call_id"])
            elif unanswered:
                message["tool_call_id"] = unanswered.popleft()
    return messages


def _rows_of_conversation(found: Conversation, format: Format) -> list[Row] | str:
    """A conversation as ``format``'s one row, or why that format cannot take it."""
    if format == "openai":
        row = openai_row(found)
        if row is None:
            return ENDS_ON_TOOL_CALL
        problems = openai_problems(row)  # OpenAI refuses a whole file over one bad line
        return f"{NOT_OPENAI}: {_MESSAGE_AT.sub('', problems[0])}" if problems else [row]
    return [trl_row(found)]


def openai_row(found: Conversation) -> Row | None:
    """OpenAI's chat fine-tuning line, or None for a conversation that ends on a tool call
    (OpenAI needs a final assistant message). An assistant message that only calls tools
    has no ``content``, as in OpenAI's examples."""
    if found.messages[-1].get("tool_calls"):
        return None
    messages = [
        {k: v for k, v in m.items() if k != "content"} if m.get("tool_calls") and not m["content"] else m
        for m in found.messages
    ]
    return {"messages": messages, "tools": found.tools} if found.tools else {"messages": messages}


def trl_row(found: Conversation) -> Row:
    """TRL's conversational row: arguments as objects, ``tools`` as JSON text."""
    messages = [
        {**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in found.messages
    ]
    return {"messages": messages, "tools": json.dumps(found.tools, ensure_ascii=False)}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {**call, "function": {**function, "arguments": arguments_object(function["arguments"])}}


def token_rows(episode: Episode) -> list[Row]:
    """One row per LLM step with token ids: the prompt's ids, the ids of the completion the
    episode went on with and, where the call asked for them, their log-probabilities."""
    rows = []
    for step in episode.steps:
        ids = step.token_ids
        if step.kind != "llm" or not isinstance(ids, dict) or not ids.get("completions"):
            continue
        logprobs = ids.get("logprobs")
        rows.append(
            {
                "episode_id": episode.id,
                "step": step.seq,
                "prompt_ids": ids["prompt"],
                "completion_ids": ids["completions"][0],
                "completion_logprobs": logprobs[0] if logprobs else None,
                "reward": episode.reward,
                "adapter": episode.adapter,
                "router": episode.router,
            }
        )
    return rows


def successful_conversations(
    store: Store,
    agent: str,
    count: int,
    *,
    since: datetime | None = None,
    exclude: Collection[str] = (),
) -> list[Conversation]:
    """Up to ``count`` of ``agent``'s newest successful episodes since ``since`` as the
    conversations the agent held: none whose user messages hold one of ``exclude``
    (``request_key``: the requests an evaluation plays), nor the same user messages twice
    (the agent's worked examples are user messages too, the same in every episode). What the
    deployed agent already does right, whichever way it was captured."""
    found: list[Conversation] = []
    excluded, seen = set(exclude), set()
    for episode in store.iter_episodes(EpisodeFilter(agent, outcome="success", since=since)):
        if len(found) == count:
            break
        held = conversation(episode)
        if held is None:
            continue
        asked = tuple(
            request_key(content_text(m.get("content"))) for m in held.messages if m["role"] == "user"
        )
        if asked and asked not in seen and not excluded.intersection(asked):
            seen.add(asked)
            found.append(held)
    return found


def _redacted(found: Conversation, redact: Redactor) -> Conversation:
    """Message text and tool-call arguments with ``redact`` applied (to arguments that are
    JSON: to the strings, keys and numbers inside, so they still parse)."""

    def call(c: dict[str, Any]) -> dict[str, Any]:
        return {
            **c,
            "function": {**c["function"], "arguments": redact_text(c["function"]["arguments"], redact)},
        }

    messages = []
    for m in found.messages:
        m = {**m, "content": redact(m["content"])}
        if "tool_calls" in m:
            m["tool_calls"] = [call(c) for c in m["tool_calls"]]
        messages.append(m)
    return Conversation(messages, found.tools, found.opening)


# -- OpenAI's format ---------------------------------------------------------------------

_ROLE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "weight"},
    "tool": {"role", "content", "tool_call_id"},
}
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_MESSAGE_AT = re.compile(r"^message \d+: ")  # reasons are counted without the place


def openai_problems(row: Any) -> list[str]:
    """Why ``row`` is not an example of OpenAI's supervised chat fine-tuning format, as its
    guide and API reference document it: a ``messages`` list (and optionally ``tools``, an
    array of function tools, and ``parallel_tool_calls``); roles system, developer, user,
    assistant and tool with their own keys; tool calls with an id, type ``function`` and
    ``arguments`` a JSON string holding an object; every call answered by a tool message
    with its id before the conversation goes on; and a final assistant message."""
    if not isinstance(row, dict):
        return ["not an object"]
    problems = [f"unknown key {k!r}" for k in row if k not in {"messages", "tools", "parallel_tool_calls"}]
    tools = row.get("tools", [])
    if not isinstance(tools, list):
        return [*problems, "tools is not an array"]
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and tool.get("type") == "function"):
            problems.append(f"tool {tool!r:.60} is not a function tool")
            continue
        if not _FUNCTION_NAME.match(str(function.get("name"))):
            problems.append(f"tool name {function.get('name')!r} is not allowed")
        if not isinstance(function.get("parameters", {}), dict):
            problems.append(f"tool {function.get('name')!r}: parameters is not an object")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, "no messages"]
    unanswered: list[str] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLE_KEYS:
            problems.append(f"message {i}: role {role!r}")
            continue
        problems += [f"message {i}: unknown key {k!r}" for k in m if k not in _ROLE_KEYS[role]]
        if unanswered and role != "tool":
            problems.append(f"message {i}: tool calls {unanswered} are not answered")
            unanswered = []
        content = m.get("content")
        if role == "tool":
            if m.get("tool_call_id") not in unanswered:
                problems.append(f"message {i}: answers no open tool call ({m.get('tool_call_id')!r})")
            else:
                unanswered.remove(m["tool_call_id"])
            if not isinstance(content, str):
                problems.append(f"message {i}: tool content is not a string")
        elif role == "assistant":
            calls = m.get("tool_calls", [])
            if not (isinstance(content, str) and content) and not calls:
                problems.append(f"message {i}: an assistant message with neither content nor tool calls")
            if content is not None and not isinstance(content, str):
                problems.append(f"message {i}: content is not a string")
            if m.get("weight", 1) not in (0, 1):
                problems.append(f"message {i}: weight is not 0 or 1")
            for call in calls:
                function = call.get("function") or {}
                arguments = function.get("arguments")
                if not (isinstance(call.get("id"), str) and call["id"] and call.get("type") == "function"):
                    problems.append(f"message {i}: a tool call without an id or of another type")
                if not _FUNCTION_NAME.match(str(function.get("name"))):
                    problems.append(f"message {i}: calls a function named {function.get('name')!r}")
                if not isinstance(arguments, str):
                    problems.append(f"message {i}: arguments are not a string")
                elif not isinstance(_json_or_none(arguments), dict):
                    problems.append(f"message {i}: arguments are not a JSON object")
                unanswered.append(call.get("id"))
        elif not isinstance(content, str) or not content:
            problems.append(f"message {i}: {role} content is not a non-empty string")
    last = messages[-1]
    if not (isinstance(last, dict) and last.get("role") == "assistant" and not last.get("tool_calls")):
        problems.append("the last message is not an assistant's reply")
    return problems


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# -- reference plays --------------------------------------------------------------------


def _reference_conversation(
    env: Environment,
    seed: int,
    max_turns: int,
    max_observation_chars: int,
    examples: Sequence[dict[str, Any]] = (),
) -> Conversation | None:
    """The task's reference play (``play_reference``, as the warm start plays it) as
    messages behind the system prompt and the agent's ``examples``, or None where it has
    none that succeeds."""
    play = play_reference(env, seed, max_turns=max_turns, max_observation_chars=max_observation_chars)
    if play is None:
        return None
    system = {"role": "system", "content": env.system_prompt}
    messages = _messages([system, *examples]) or [system]
    messages.append({"role": "user", "content": play.task.prompt})
    for i, (turn, results) in enumerate(play.turns):
        calls = [_tool_call({"id": f"call_{i}_{k}", **c}) for k, c in enumerate(turn)]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        if play.shows_results(i):
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": r}
                for c, r in zip(calls, results, strict=True)
            ]
    if play.told is not None:
        messages.append({"role": "assistant", "content": play.told})
    return Conversation(messages, play.tools)


# -- writers ----------------------------------------------------------------------------


def jsonl(row: Row) -> bytes:
    """One row as a JSON line in UTF-8."""
    return orjson.dumps(row) + b"\n"


def write_jsonl(rows: Iterable[Row], path: Path) -> int:
    """``rows`` as JSON lines; returns how many."""
    count = 0
    with path.open("wb") as out:
        for row in rows:
            out.write(jsonl(row))
            count += 1
    return count


def save_hf(rows: Iterable[Row], path: Path) -> int:
    """``trl`` rows as a Hugging Face dataset on disk (``datasets.load_from_disk``), built
    through a temporary cache in batches; returns how many. Messages are ``Json`` values
    (``datasets`` >= 4.7), which keep each row's arguments as they are. The fingerprint is
    fresh: ``datasets`` would otherwise hash the generator, and rows cannot be pickled."""
    from datasets import Dataset, Features, Json, List, Value

    features = Features({"messages": List(Json()), "tools": Value("string")})
    with tempfile.TemporaryDirectory() as cache:
        built = Dataset.from_generator(
            lambda: iter(rows), features=features, cache_dir=cache, fingerprint=uuid.uuid4().hex
        )
        built.save_to_disk(str(path))
        return len(built)
