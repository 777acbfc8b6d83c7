"""Payload encoding: any object in, bounded valid JSON out; PII masked."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st
from support.pii import HOSTILE_PII, UNMASKED

from trace_plugin.payload import Lazy, Shaped, clip_text, encode, encode_now, make_redactor, redact_pii, shape


@dataclass
class Point:
    x: int
    y: float


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


def test_to_jsonable_keeps_types_it_can_and_names_the_rest():
    value = {
        1: Point(1, 2.5),
        "when": datetime(2026, 1, 2, tzinfo=UTC),
        "tags": {"a"},
        "blob": b"\x00\x01",
        "nan": math.nan,
        "err": ValueError("boom"),
        "bad": BadRepr(),
        "lazy": Lazy(lambda raw: raw.upper(), "later"),
    }
    out = shape(value).value
    assert out["1"] == {"x": 1, "y": 2.5}
    assert out["when"] == "2026-01-02T00:00:00+00:00"
    assert out["tags"] == ["a"] and out["blob"] == {"__type__": "bytes", "length": 2}
    assert out["nan"] is None
    assert out["err"] == {"__type__": "ValueError", "error": "boom"}
    assert out["bad"] == {"__type__": "BadRepr", "repr": "<repr failed: RuntimeError>"}
    assert out["lazy"] == "LATER"
    json.dumps(out)


def test_an_object_met_again_is_a_pointer_to_where_it_was_first_stored():
    loop: list = []
    loop.append(loop)
    assert json.loads(encode(loop)) == [{"__ref__": ""}]
    child = {"a/b": [1], "~": "x"}
    shared = {"left": child, "right": child, "deep": {"again": child["a/b"]}, "empty": [(), ()]}
    assert json.loads(encode(shared)) == {
        "left": child,
        "right": {"__ref__": "/left"},
        "deep": {"again": {"__ref__": "/left/a~1b"}},  # RFC 6901: "/" is "~1", "~" is "~0"
        "empty": [[], []],  # nothing to share: an empty container is written out
    }


def test_truncation_keeps_valid_json_within_the_limit():
    text = encode({"big": "é" * 50_000}, max_bytes=1_000)
    assert len(text.encode()) <= 1_000
    marker = json.loads(text)
    assert marker["__truncated__"] is True and marker["bytes"] > 100_000
    assert clip_text("x" * 5_000, 100).endswith("5000 bytes]")


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
        lambda children: st.lists(children) | st.dictionaries(st.text() | st.integers(), children),
        max_leaves=30,
    ),
    st.integers(min_value=120, max_value=5_000),
)
def test_encode_never_raises_and_respects_the_limit(value, limit):
    text = encode(value, max_bytes=limit)
    if text is not None:
        json.loads(text)
        assert len(text.encode()) <= limit


def test_builtin_redaction_patterns():
    text = (
        "mail jane.doe+x@example.co.uk or call +44 20 7946 0958 / (415) 555-0134; "
        "card 4111-1111-1111-1111, not 4111-1111-1111-1112; order #W1234567 on 2026-11-29, zip 94105"
    )
    out = redact_pii(text)
    assert "example.co.uk" not in out and "7946" not in out and "555-0134" not in out
    assert "[CARD]" in out and "4111-1111-1111-1112" in out  # fails the Luhn check: not a card
    assert "#W1234567" in out and "2026-11-29" in out and "94105" in out


def test_custom_redactor_runs_after_the_builtin_patterns():
    redact = make_redactor(lambda s: s.replace("Alice", "[NAME]"))
    assert redact("Alice <alice@x.io>") == "[NAME] <[EMAIL]>"
    assert make_redactor(None) is None and make_redactor(False) is None


class Message:
    def __init__(self, text: str) -> None:
        self.text = text


def test_shaped_values_convert_foreign_types_the_same_on_every_path():
    def default(value):
        if isinstance(value, Message):
            return {"role": "user", "content": value.text}
        raise TypeError(type(value).__name__)

    state = {"messages": [Message("ann@example.com"), Message("hi")], "n": 1, "other": Point(1, 2.0)}
    fast = json.loads(encode(Shaped(state, default)))  # orjson, calling default
    redacted = json.loads(encode(Shaped(state, default), redact=make_redactor(True)))  # the walk
    assert fast["messages"][1] == redacted["messages"][1] == {"role": "user", "content": "hi"}
    assert (
        fast["messages"][0]["content"] == "ann@example.com"
        and redacted["messages"][0]["content"] == "[EMAIL]"
    )
    assert fast["other"] == redacted["other"] == {"x": 1, "y": 2.0}  # refused by default: the walk's form
    # Messages alone the default turns into JSON: orjson takes them on the agent's thread.
    assert encode_now(Shaped({"messages": state["messages"], "n": 1}, default)) is not None
    loop: list = [Message("x")]
    loop.append(loop)  # orjson must not take the cycle; the walk marks it and still converts the rest
    walked = json.loads(encode(Shaped(loop, default)))
    assert walked == [{"role": "user", "content": "x"}, {"__ref__": ""}]


def test_redaction_masks_numbers_and_keys_and_json_text_still_parses():
    """Capture's ``redact=True`` masked strings only: numbers and keys went through, and a
    JSON string argument (``"\\"x@y.com\\""``) came out as ``[EMAIL]``, no longer JSON."""
    stored = encode({"arguments": HOSTILE_PII, "raw": json.dumps(HOSTILE_PII), "quoted": '"x@y.com"'},
                    redact=make_redactor(True))  # fmt: skip
    assert not any(value in stored for value in UNMASKED) and "x@y.com" not in stored
    record = json.loads(stored)
    expected = {
        "card": "[CARD]", "phone": "[PHONE]", "[EMAIL]": {"orders": 2}, "[EMAIL]#2": {"orders": 3},
        "order": 1234567, "count": 12, "not_a_card": 4111111111111112,
    }  # fmt: skip
    assert record["arguments"] == expected
    assert json.loads(record["raw"]) == expected  # arguments as JSON text: masked inside, still JSON
    assert json.loads(record["quoted"]) == "[EMAIL]"
    assert encode(HOSTILE_PII) == json.dumps(HOSTILE_PII, separators=(",", ":"))  # without redaction: as is
