"""Tool-call parsing: every malformed shape becomes plain content, never an exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_plugin.tool_calls import parse_completion


def names(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_plain_text():
    parsed = parse_completion("Your order has shipped.")
    assert (parsed.content, parsed.tool_calls, parsed.finish_reason, parsed.error) == (
        "Your order has shipped.",
        [],
        "stop",
        None,
    )
    assert parse_completion("It was cut", truncated=True).finish_reason == "length"


def test_object_form_with_leading_text():
    parsed = parse_completion(
        'Let me check.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "W1"}}\n</tool_call>'
    )
    assert parsed.finish_reason == "tool_calls" and parsed.content == "Let me check."
    assert names(parsed) == [("get_order", {"order_id": "W1"})]
    assert parsed.tool_calls[0]["id"].startswith("call_") and parsed.tool_calls[0]["type"] == "function"


def test_list_form_and_several_blocks():
    text = (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>\n'
        '<tool_call>{"name": "c", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    parsed = parse_completion(text)
    assert names(parsed) == [("a", {}), ("b", {"x": 1}), ("c", {"y": 2})]
    assert len({c["id"] for c in parsed.tool_calls}) == 3
    assert parsed.content is None


def test_complete_calls_win_over_truncation():
    parsed = parse_completion('<tool_call>{"name": "a", "arguments": {}}</tool_call>', truncated=True)
    assert parsed.finish_reason == "tool_calls"


MALFORMED = {
    "unclosed": '<tool_call>{"name": "a", "arguments": {}}',
    "cut mid json": '<tool_call>{"name": "a", "argu',
    "broken json": "<tool_call>{name: a}</tool_call>",
    "no name": '<tool_call>{"arguments": {}}</tool_call>',
    "empty name": '<tool_call>{"name": " ", "arguments": {}}</tool_call>',
    "name not a string": '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "arguments a list": '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    "arguments bad string": '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>',
    "list of strings": '<tool_call>["a"]</tool_call>',
    "empty list": "<tool_call>[]</tool_call>",
    "scalar": "<tool_call>42</tool_call>",
    "empty block": "<tool_call></tool_call>",
    "stray close": '<tool_call>{"name": "a"}</tool_call></tool_call>',
    "nested open": '<tool_call><tool_call>{"name": "a"}</tool_call>',
    "text after": '<tool_call>{"name": "a", "arguments": {}}</tool_call> and then I said more',
    "close only": "done </tool_call>",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tool_calls_come_back_as_content(case):
    text = MALFORMED[case]
    parsed = parse_completion(text)
    if case == "close only":  # no opening tag: just text
        assert parsed.error is None and parsed.content == text
        return
    assert parsed.tool_calls == [] and parsed.content == text
    assert parsed.finish_reason == "stop" and parsed.error
    assert parse_completion(text, truncated=True).finish_reason == "length"


ALPHABET = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        ":",
        ",",
        '"a"',
        "1",
        " ",
        "\n",
        "x",
        '"',
        "\\",
    ]
)


@settings(max_examples=2000, deadline=None)
@given(st.lists(ALPHABET, max_size=30).map("".join), st.booleans())
def test_fuzz_never_raises_and_keeps_the_text(text, truncated):
    parsed = parse_completion(text, truncated=truncated)
    if parsed.tool_calls:
        assert parsed.finish_reason == "tool_calls"
        for call in parsed.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    else:
        assert parsed.content == text
        assert parsed.finish_reason == ("length" if truncated else "stop")
