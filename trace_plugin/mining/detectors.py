"""Generic capability detectors: NA / PRESENT / LACKING per episode, from its trajectory alone.

Detectors know nothing about a particular environment. They read an episode compacted
into a ``Trajectory`` (the conversation in OpenAI format, tool calls paired with
their results) and infer each tool's role, read or write, from its name; a role map
overrides the guess. What they look for:

- tool_call_format: every attempted tool call parses (no tool-call markup left in text);
- tool_selection: every call names a tool that exists;
- argument_grounding: ids in arguments were given by the user or returned by a tool;
- precondition_verification: a write to an entity follows a read of that entity, and
  none is refused for a step the agent skipped (identifying the user);
- multi_step_completion: after looking things up, the agent acts or explains why not;
- write_completion: the change the user asked for was made, on the object they named;
- error_recovery: after a tool error, the next call changes something;
- policy_refusal: a forbidden action is not attempted; the user is told why (a write
  refused for a missing precondition is not a policy refusal);
- communicating_facts: the final message reports what the tools returned;
- termination: the episode ends with a message to the user, without looping.

Each is bound to its kind, with the kind's description, in ``trace_plugin.mining.kinds``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.mining.selection import Label
from trace_plugin.records.trajectory import Episode

Role = Literal["read", "write", "other"]

_WRITE_VERBS = (
    "cancel",
    "modify",
    "update",
    "create",
    "delete",
    "remove",
    "return",
    "exchange",
    "refund",
    "book",
    "set",
    "add",
    "send",
    "submit",
    "change",
    "transfer",
    "pay",
    "apply",
    "register",
)
_READ_VERBS = (
    "get",
    "find",
    "list",
    "search",
    "lookup",
    "look",
    "check",
    "read",
    "fetch",
    "query",
    "calculate",
)
# Write verbs that ask for the same change: a request to "change" an order is done by a
# tool named modify_*, one to "return" it by refund_*.
_SAME_WRITE = (
    frozenset({"modify", "update", "change", "set"}),
    frozenset({"cancel", "delete", "remove"}),
    frozenset({"return", "refund"}),
    frozenset({"create", "add", "register", "book", "submit"}),
)
_MARKUP = re.compile(r"<tool_call>|<tool_response>|\{\s*\"name\"\s*:")
_REFUSAL = re.compile(r"\b(cannot|can't|can not|unable|not (?:possible|allowed|eligible)|sorry|only)\b", re.I)
_ID = re.compile(r"^(?=.*\d)[#\w.@:-]{3,}$")


def name_words(tool: str) -> list[str]:
    """A tool name's words, lower case, without its namespace: ``billing.getInvoice``,
    ``get_invoice`` and ``get-invoice`` are all ``["get", "invoice"]``."""
    function = re.split(r"[.:]", tool)[-1]
    return [w.lower() for w in re.split(r"[_\W]+|(?<=[a-z0-9])(?=[A-Z])", function) if w]


def guess_role(tool: str, overrides: Mapping[str, Role] | None = None) -> Role:
    """``read``/``write`` from the tool's name (its first word); ``overrides`` win."""
    if overrides and tool in overrides:
        return overrides[tool]
    first = (name_words(tool) or [""])[0]
    if first in _WRITE_VERBS:
        return "write"
    if first in _READ_VERBS:
        return "read"
    return "other"


@dataclass(slots=True)
class Call:
    name: str
    arguments: dict[str, Any]
    result: str = ""
    error: bool = False


@dataclass(slots=True)
class Trajectory:
    """An episode compacted for analysis: what the user said, the calls, what the agent said."""

    user: str
    calls: list[Call] = field(default_factory=list)
    assistant_texts: list[str] = field(default_factory=list)  # every assistant message's text
    final_answer: str | None = None  # the last assistant message without tool calls
    tools_offered: set[str] = field(default_factory=set)

    def offered_calls(self) -> list[Call]:
        """The calls of tools the agent was offered (all of them when that is unknown): the
        names a small model makes up ("James", "London, UK") are not tools it used."""
        return [c for c in self.calls if not self.tools_offered or c.name in self.tools_offered]

    @classmethod
    def from_messages(
        cls,
        messages: list[dict[str, Any]],
        tools_offered: set[str] | None = None,
        *,
        request: str | None = None,
    ) -> Trajectory:
        """From an OpenAI-format conversation ending with the agent's last message.

        Everything up to the user's ``request`` (by default the first user message) was
        given to the agent: system prompt, few-shot examples. Only what follows is the
        agent's own behaviour.
        """
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        matching = [
            i for i in users if request is not None and content_text(messages[i].get("content")) == request
        ]
        start = matching[-1] if matching else (users[0] if users else -1)
        trajectory = cls(
            user=content_text(messages[start].get("content")) if start >= 0 else "",
            tools_offered=set(tools_offered or ()),
        )
        pending: dict[str, Call] = {}
        for message in messages[start + 1 :]:
            role, text = message.get("role"), content_text(message.get("content"))
            if role == "assistant":
                trajectory.assistant_texts.append(text)
                calls = message.get("tool_calls") or []
                for raw in calls:
                    function = raw.get("function", raw)
                    arguments = arguments_object(function.get("arguments"))
                    call = Call(function.get("name", ""), arguments if isinstance(arguments, dict) else {})
                    trajectory.calls.append(call)
                    pending[raw.get("id") or str(len(trajectory.calls))] = call
                trajectory.final_answer = None if calls else text
            elif role == "tool":
                call = pending.get(message.get("tool_call_id") or "")
                if call is not None:
                    call.result = text
                    call.error = _is_error(text)
        return trajectory

    @classmethod
    def from_episode(cls, episode: Episode) -> Trajectory:
        """The richest view the episode's steps allow: the last LLM call's conversation plus
        its reply, else (MCP proxy, runner without LLM steps) the tool steps alone."""
        request = _last_user_text(episode.input)
        tool_runs = {s.run_id for s in episode.steps if s.kind == "tool" and s.run_id}
        llm = [  # the agent's own model calls, not a model a tool called internally
            s
            for s in episode.steps
            if s.kind == "llm" and isinstance(s.input, dict) and s.parent_run_id not in tool_runs
        ]
        if llm:
            last = llm[-1]
            reply = (
                last.output
                if isinstance(last.output, dict)
                else {"role": "assistant", "content": last.output}
            )
            offered = set(last.input.get("tools") or ())
            return cls.from_messages([*last.input.get("messages", []), reply], offered, request=request)
        user = request or ""
        calls = [
            Call(s.name, s.input if isinstance(s.input, dict) else {}, _text(s.output), s.error is not None)
            for s in episode.steps
            if s.kind == "tool"
        ]
        output = episode.output if isinstance(episode.output, dict) else {}
        answer = content_text(output.get("content")) if output else None
        return cls(user=user, calls=calls, assistant_texts=[answer] if answer else [], final_answer=answer)


def _last_user_text(value: Any) -> str | None:
    """The last user message in an episode's input (OpenAI dicts or LangChain tuples)."""
    messages = value.get("messages") if isinstance(value, dict) else None
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
        if isinstance(message, list | tuple) and len(message) == 2 and message[0] in ("user", "human"):
            return str(message[1])
    return None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _is_error(text: str) -> bool:
    return text.startswith('{"error"') or text.lower().startswith(("error", "upstream error"))


def _ids(value: Any) -> list[str]:
    """Id-like strings inside an argument value: they contain a digit and no spaces."""
    if isinstance(value, str):
        return [value] if _ID.match(value.strip()) else []
    if isinstance(value, list):
        return [i for v in value for i in _ids(v)]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _ids(v)]
    return []


# -- the detectors ------------------------------------------------------------------------

Detector = Callable[[Trajectory, Mapping[str, Role]], Label]


# How tools and frameworks say a call's arguments were wrong: ours and LangChain's ("bad
# arguments", "validation error"), JSON Schema's, Python's, and HTTP APIs'. Not "invalid"
# alone: "invalid order status" is a refused action, not a malformed call.
_ARGUMENT_ERROR = re.compile(
    r"argument|parameter|validation|required (?:property|field)|is not of type|unexpected keyword"
    r"|missing \d* ?required|invalid (?:json|type|input|value for)",
    re.IGNORECASE,
)


def tool_call_format(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    malformed = any(_MARKUP.search(text) for text in t.assistant_texts)
    bad_args = any(c.error and _ARGUMENT_ERROR.search(c.result) for c in t.calls)
    if malformed or bad_args:
        return Label.LACKING
    return Label.PRESENT if t.calls else Label.NA


def tool_selection(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    """Calls tools that exist and fit. Offered tools, none called (nor a call attempted in
    broken markup), and an answer that is no refusal lacks it too: the agent answered from
    its own guesses, a new deployment's commonest failure."""
    if not t.calls:
        answer = t.final_answer or ""
        guessed = bool(answer) and not _REFUSAL.search(answer) and not _MARKUP.search(answer)
        return Label.LACKING if t.tools_offered and guessed else Label.NA
    unknown = any(
        (t.tools_offered and c.name not in t.tools_offered) or (c.error and "unknown tool" in c.result)
        for c in t.calls
    )
    return Label.LACKING if unknown else Label.PRESENT


def argument_grounding(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    seen, checked = t.user, False
    for call in t.calls:
        for value in _ids(call.arguments):
            checked = True
            if value not in seen:
                return Label.LACKING
        seen += "\n" + call.result
    return Label.PRESENT if checked else Label.NA


# How a system says a change waits on an earlier step ("identify the user before changing
# an order", "log in first"): the agent skipped a precondition; the policy did not forbid it.
_PRECONDITION = re.compile(
    r"\b(?:before|first|identif\w*|verif\w*|authenticat\w*|log(?:ged)? ?in|sign(?:ed)? ?in)\b", re.I
)


def precondition_verification(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    """A write's target (its first id argument) must have been read first, and no write may
    be refused for a precondition the agent skipped. Only targets the agent was given count:
    writing to an invented id is a grounding failure, not this one."""
    read_ids: set[str] = set()
    seen, writes = t.user, False
    for call in t.calls:
        role, ids = guess_role(call.name, roles), _ids(call.arguments)
        if role == "write" and call.error and _PRECONDITION.search(call.result):
            return Label.LACKING
        if role == "write" and ids and ids[0] in seen:
            writes = True
            if ids[0] not in read_ids:
                return Label.LACKING
        elif role == "read":
            read_ids.update(ids)
        seen += "\n" + call.result
    return Label.PRESENT if writes else Label.NA


def multi_step_completion(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    """After looking things up, the agent acts or says why not. A write refused for a
    skipped precondition is no action: it could still have been done, so saying sorry after
    it does not count. (One refused by the policy, or on an invented id, was an action; other
    detectors judge it.)"""
    reads = [c for c in t.calls if guess_role(c.name, roles) == "read" and not c.error]
    if not reads:
        return Label.NA
    writes = [c for c in t.calls if guess_role(c.name, roles) == "write"]
    if any(not (c.error and _PRECONDITION.search(c.result)) for c in writes):
        return Label.PRESENT
    if writes:
        return Label.LACKING
    return Label.PRESENT if t.final_answer and _REFUSAL.search(t.final_answer) else Label.LACKING


def write_completion(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    """The change the user asked for was made: a request with a write verb ("cancel",
    "return", "change"...) needs a write of that kind that went through, on an id the user
    gave or a lookup returned. An agent that gave up, or wrote something else, lacks it. The
    other detectors' cases are NA here: declining, or a write the policy refused (the
    policy's), and a write to an invented id (grounding's)."""
    asked = _write_kinds(*re.findall(r"[a-z]+", t.user.lower()))
    if not asked:
        return Label.NA
    seen, elsewhere = t.user, False
    for call in t.offered_calls():
        if guess_role(call.name, roles) == "write" and asked & _write_kinds(*name_words(call.name)[:1]):
            ids = _ids(call.arguments)
            if not call.error and ids and ids[0] in seen:
                return Label.PRESENT
            elsewhere |= _policy_refused(call) or bool(ids and ids[0] not in seen)
        seen += "\n" + call.result
    wrote = any(guess_role(c.name, roles) == "write" for c in t.calls)
    declined = not wrote and bool(t.final_answer and _REFUSAL.search(t.final_answer))
    return Label.NA if elsewhere or declined else Label.LACKING


def _write_kinds(*words: str) -> frozenset[str]:
    """The kinds of change ``words`` name: each write verb stands for its group."""
    return frozenset(
        next((min(group) for group in _SAME_WRITE if word in group), word)
        for word in words
        if word in _WRITE_VERBS
    )


def error_recovery(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    errors = [i for i, c in enumerate(t.calls) if c.error]
    if not errors:
        return Label.NA
    for i in errors:
        following = t.calls[i + 1] if i + 1 < len(t.calls) else None
        failed = t.calls[i]
        if following is None:
            if not t.final_answer:
                return Label.LACKING
        elif (following.name, following.arguments) == (failed.name, failed.arguments):
            return Label.LACKING
    return Label.PRESENT


_NOT_FOUND = re.compile(r"not found|no such|unknown|does not exist|invalid id", re.I)


def policy_refusal(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    """A write the system refused (not one on a missing entity, nor one waiting on a
    precondition such as identifying the user) means the policy was not heeded."""
    writes = [c for c in t.calls if guess_role(c.name, roles) == "write"]
    if any(_policy_refused(c) for c in writes):
        return Label.LACKING
    if t.final_answer and _REFUSAL.search(t.final_answer) and not writes:
        return Label.PRESENT
    return Label.NA


def _policy_refused(call: Call) -> bool:
    """The system refused the call, and not for a missing entity or a skipped precondition."""
    return call.error and not _NOT_FOUND.search(call.result) and not _PRECONDITION.search(call.result)


def communicating_facts(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    facts = {fact for c in t.calls if c.result and not c.error for fact in _facts(c.result)}
    if not facts:  # nothing to report: no results, or only acknowledgements such as {"status": "ok"}
        return Label.NA
    if not t.final_answer:
        return Label.LACKING
    answer = t.final_answer.lower()
    return Label.PRESENT if any(fact in answer for fact in facts) else Label.LACKING


_NEUTRAL = {
    "ok",
    "okay",
    "success",
    "succeeded",
    "successful",
    "done",
    "true",
    "false",
    "null",
    "none",
    "error",
}


def _facts(result: str) -> set[str]:
    """What a tool's result told the agent, lower case: the words of its values (a JSON
    result's keys are its shape, not facts), less bare acknowledgements."""
    try:
        parsed: Any = json.loads(result)
    except ValueError:
        parsed = result
    words = {w.lower() for value in _leaves(parsed) for w in re.findall(r"[\w#@.-]{3,}", value)}
    return words - _NEUTRAL


def _leaves(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [] if value is None or isinstance(value, bool) else [str(value)]


def termination(t: Trajectory, roles: Mapping[str, Role]) -> Label:
    looping = any(
        (a.name, a.arguments) == (b.name, b.arguments) == (c.name, c.arguments)
        for a, b, c in zip(t.calls, t.calls[1:], t.calls[2:], strict=False)
    )
    ended = bool(t.final_answer) and not _MARKUP.search(t.final_answer)  # markup is not a message
    return Label.PRESENT if ended and not looping else Label.LACKING
