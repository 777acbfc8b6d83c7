"""Parsing a model's completion into OpenAI ``tool_calls``, never failing.

Models trained on the shared chat template answer with ``<tool_call>{json}</tool_call>``
blocks: an object ``{"name": ..., "arguments": {...}}`` or a list of them. Small models
get this wrong in every way (broken JSON, missing names, unclosed tags, prose around the
JSON). Anything we cannot parse exactly is returned as plain content with an explanation,
so a client sees what the model said instead of an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def forced_opening(call: str | bool) -> str:
    """The start of an assistant turn that calls ``call`` (a function's name, or True for
    any), exactly as the shared template renders one, up to where the model must go on: the
    name, or a named function's arguments object. Small models cannot be told to call; they
    can be started calling. A forced call is one call: the reply stops at its :data:`CLOSE`."""
    if call is False:
        return ""
    name = "" if call is True else json.dumps(call)[1:-1] + '", "arguments": {'
    return f'{OPEN}\n{{"name": "{name}'


def forced_reply(opening: str, text: str, stopped: bool) -> str:
    """The whole reply of a turn started with ``opening``: a forced call stopped at its
    closing tag, which the stop left out, gets it back."""
    if opening and stopped and CLOSE not in text:
        return f"{opening}{text}{CLOSE}"
    return opening + text


@dataclass(slots=True)
class ParsedCompletion:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    # Why tool-call markup could not be used, when there was some; None when there was none.
    error: str | None = None


def parse_completion(text: str, *, truncated: bool = False, max_calls: int | None = None) -> ParsedCompletion:
    """Split ``text`` into content and tool calls.

    ``truncated`` says generation hit its token limit: the finish reason is then
    ``length`` unless complete tool calls were parsed. ``max_calls`` keeps the first
    calls only (OpenAI's ``parallel_tool_calls: false`` is 1); with 0 (``tool_choice:
    "none"``) the whole text is content, whatever markup it holds.
    """
    plain_reason: FinishReason = "length" if truncated else "stop"
    if OPEN not in text or max_calls == 0:
        return ParsedCompletion(text, finish_reason=plain_reason)
    head, _, tail = text.partition(OPEN)
    blocks = _BLOCK.findall(text)
    rest = _BLOCK.sub("", text[len(head) :])
    if not blocks or OPEN in rest or CLOSE in rest:
        error = (
            "unclosed <tool_call>" if text.count(OPEN) > text.count(CLOSE) else "unbalanced tool-call tags"
        )
        return ParsedCompletion(text, finish_reason=plain_reason, error=error)
    if rest.strip():
        return ParsedCompletion(text, finish_reason=plain_reason, error="text after the tool calls")
    calls: list[dict[str, Any]] = []
    for block in blocks:
        parsed, error = _parse_block(block)
        if error:
            return ParsedCompletion(text, finish_reason=plain_reason, error=error)
        calls.extend(parsed)
    content = head.strip() or None
    return ParsedCompletion(content, tool_calls=calls[:max_calls], finish_reason="tool_calls")


def _parse_block(block: str) -> tuple[list[dict[str, Any]], str | None]:
    try:
        payload = json.loads(block)
    except json.JSONDecodeError as exc:
        return [], f"tool call is not valid JSON: {exc.msg} at position {exc.pos}"
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        return [], "empty tool-call list"
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return [], f"tool call must be an object, got {type(item).__name__}"
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            return [], "tool call has no name"
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return [], f"arguments of {name!r} are not valid JSON"
        if not isinstance(arguments, dict):
            return [], f"arguments of {name!r} must be an object"
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    return calls, None
