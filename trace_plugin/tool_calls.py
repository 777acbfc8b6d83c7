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
    can be started calling. A forced call is one call: the reply stops at its ``CLOSE``."""
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


# -- streaming -----------------------------------------------------------------------------------

# A call's opening up to its name, name first as the template writes it: the name goes out
# then. The arguments object follows its key; a call of any other shape is sent whole once it closes.
_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class ReplyStream:
    """A reply's text, fed as it is generated, as OpenAI chat-completion chunk deltas.

    Content streams as it comes, up to a tool call's opening tag (text that may begin one,
    and trailing whitespace, wait). A call's first delta carries its id and name as soon
    as the name is written, then its arguments object follows in fragments as they are
    written; a call of another shape goes out whole when it closes. ``finish`` takes
    the parse of the whole reply (``parse_completion``: what the non-streamed response
    holds and capture records) and sends what the stream has not: calls still unsent or,
    for markup that did not parse after all, the text as content.
    """

    def __init__(self, opening: str = "", *, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.seen = ""  # every character fed, the forced opening first
        self.content = ""  # content sent so far
        self.ids: list[str] = []  # the ids of the calls sent so far
        self._pending = ""  # text read but not yet sent or passed over
        # "content", then per call "head" (before its name), "named" (name sent, arguments not
        # begun), "arguments", "tail" (after them, up to the closing tag)
        self._state = "content"
        self._scan = (0, False, False)  # in the arguments: nesting depth, in a string, after a backslash
        self._block = 0  # where the current call's text starts in ``seen``
        self._owed: list[dict[str, Any]] = []
        self._owed = self.feed(opening)  # a named forced call's first delta, sent with the first text

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.seen += text
        self._pending += text
        deltas, self._owed = self._owed, []
        if self.max_calls == 0:  # no calls (tool_choice "none"): all of it is content
            self._send_content(self._pending, deltas)
            self._pending = ""
            return deltas
        while self._advance(deltas):
            pass
        return deltas

    def finish(self, parsed: ParsedCompletion, reply: str) -> list[dict[str, Any]]:
        """The deltas still owed once the whole ``reply`` (the opening included) parsed as
        ``parsed``. The calls already sent keep their ids in ``parsed``, so that what is
        recorded is what the client assembled."""
        deltas = self.feed(reply[len(self.seen) :]) if reply.startswith(self.seen) else []
        if parsed.tool_calls:
            for call, sent in zip(parsed.tool_calls, self.ids, strict=False):
                call["id"] = sent
            for call in parsed.tool_calls[len(self.ids) :]:
                self._send_call(call, deltas)
            return deltas
        content = parsed.content or ""
        rest = content[len(self.content) :] if content.startswith(self.content) else content
        self._send_content(rest, deltas)
        return deltas

    def _advance(self, deltas: list[dict[str, Any]]) -> bool:
        """Send what the pending text allows; True when the state changed (read on)."""
        pending = self._pending
        if self._state == "content":
            at = pending.find(OPEN)
            if at < 0:
                ready = pending[: len(pending) - _partial(pending, OPEN)].rstrip()
                self._send_content(ready, deltas)
                self._pending = pending[len(ready) :]
                return False
            self._send_content(pending[:at].rstrip(), deltas)
            self._pending, self._state = pending[at + len(OPEN) :], "head"
            self._block = len(self.seen) - len(self._pending)  # where this call's text starts in seen
            if self.max_calls is not None and len(self.ids) >= self.max_calls:
                self._state = "tail"  # calls past the limit are dropped, as parse_completion drops them
            return True
        if self._state == "head":
            name = _CALL_NAME.match(pending)
            if name is not None:
                function = {"name": json.loads(f'"{name.group(1)}"'), "arguments": ""}
                self._send_call({"type": "function", "function": function}, deltas)
                self._pending, self._state = pending[name.end() :], "named"
                return True
            return self._whole_calls(deltas)
        if self._state == "named":
            key = _ARGUMENTS_KEY.match(pending)
            if key is not None:
                self._pending, self._state, self._scan = pending[key.end() :], "arguments", (0, False, False)
                return True
            return self._whole_calls(deltas, named=True)
        if self._state == "arguments":
            end = self._arguments_end(pending)
            sent = pending if end is None else pending[:end]
            if sent:
                deltas.append({"tool_calls": [{"index": len(self.ids) - 1, "function": {"arguments": sent}}]})
            if end is None:
                self._pending = ""
                return False
            self._pending, self._state = pending[end:], "tail"
            return True
        close = pending.find(CLOSE)  # the tail: the call's closing brace and tag, passed over
        if close < 0:
            return False
        self._pending, self._state = pending[close + len(CLOSE) :], "content"
        return True

    def _whole_calls(self, deltas: list[dict[str, Any]], *, named: bool = False) -> bool:
        """A call of another shape, sent whole once it closes (after its name, if that was
        sent already: then its arguments); False while it is still open."""
        close = self._pending.find(CLOSE)
        if close < 0:
            return False
        calls, error = _parse_block(self.seen[self._block : len(self.seen) - len(self._pending) + close])
        calls = calls if error is None else []
        if named and calls:
            first = calls.pop(0)["function"]["arguments"]
            deltas.append({"tool_calls": [{"index": len(self.ids) - 1, "function": {"arguments": first}}]})
        limit = None if self.max_calls is None else self.max_calls - len(self.ids)
        for call in calls[:limit]:
            self._send_call(call, deltas)
        self._pending, self._state = self._pending[close + len(CLOSE) :], "content"
        return True

    def _arguments_end(self, text: str) -> int | None:
        """Where the arguments object closes in ``text`` (continuing the scan so far)."""
        depth, in_string, escaped = self._scan
        for i, char in enumerate(text):
            if in_string:
                in_string, escaped = (True, False) if escaped else (char != '"', char == "\\")
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        self._scan = (depth, in_string, escaped)
        return None

    def _send_call(self, call: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
        call = {**call, "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}"}
        deltas.append({"tool_calls": [{"index": len(self.ids), **call}]})
        self.ids.append(call["id"])

    def _send_content(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            deltas.append({"content": text})
            self.content += text


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
