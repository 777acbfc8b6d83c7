"""Turning arbitrary captured objects into bounded, redacted JSON.

Capture hands the recorder whatever the agent produced: messages, pydantic models,
dataclasses, exceptions, objects with no JSON form. Everything is converted here, on the
recorder's thread, so the agent never pays for it and never sees it fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from datetime import date, datetime
from enum import Enum
from typing import Any

from trace_plugin.store.engine import JsonText

DEFAULT_MAX_BYTES = 1_000_000
TRUNCATED = "__truncated__"
_MAX_DEPTH = 64

Redactor = Callable[[str], str]
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode  # one encoder, not one per call


class Lazy:
    """A value computed on the recorder's thread: ``Lazy(convert, raw)`` defers ``convert(raw)``.

    Capture callbacks run on the agent's thread; wrapping expensive conversions (message
    formatting, state snapshots) keeps that thread to a few attribute reads.
    """

    __slots__ = ("fn", "arg")

    def __init__(self, fn: Callable[[Any], Any], arg: Any) -> None:
        self.fn = fn
        self.arg = arg


def to_jsonable(value: Any, redact: Redactor | None = None, _depth: int = 0) -> Any:
    """A JSON-compatible copy of ``value``; what has no JSON form becomes its type and repr."""
    if isinstance(value, Lazy):
        value = value.fn(value.arg)
    if isinstance(value, str):
        return redact(value) if redact else value
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN or Infinity
    if _depth >= _MAX_DEPTH:
        return _opaque(value, redact)
    d = _depth + 1
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, redact, d) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_jsonable(v, redact, d) for v in value]
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Enum):
        return to_jsonable(value.value, redact, d)
    if isinstance(value, bytes | bytearray):
        return {"__type__": type(value).__name__, "length": len(value)}
    if isinstance(value, BaseException):
        return {"__type__": type(value).__name__, "error": to_jsonable(str(value), redact)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return to_jsonable(fields, redact, d)
    dump = getattr(value, "model_dump", None)  # pydantic v2, which LangChain messages are
    if callable(dump) and not isinstance(value, type):
        try:
            return to_jsonable(dump(mode="json", exclude_none=True), redact, d)
        except Exception:
            return _opaque(value, redact)
    return _opaque(value, redact)


def _opaque(value: Any, redact: Redactor | None) -> dict[str, Any]:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not lose the record
        text = f"<repr failed: {type(exc).__name__}>"
    text = text[:10_000]
    return {"__type__": type(value).__qualname__, "repr": redact(text) if redact else text}


def encode(
    value: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, redact: Redactor | None = None
) -> JsonText | None:
    """Serialize ``value`` for the store, cutting it to ``max_bytes`` with a marker.

    A cut payload is still valid JSON: ``{"__truncated__": true, "bytes": N, "preview": ...}``.
    """
    if isinstance(value, Lazy):
        value = value.fn(value.arg)
    if value is None:
        return None
    text = None
    if redact is None:  # fast path: most payloads are plain JSON already, and C dumps them
        with contextlib.suppress(TypeError, ValueError):
            text = _dumps(value)
    if text is None:
        text = _dumps(to_jsonable(value, redact))
    raw = text.encode()
    if len(raw) <= max_bytes:
        return JsonText(text)
    budget = max(0, max_bytes - 100)
    while True:  # the preview is escaped inside the marker, so shrink until the marker fits
        preview = raw[:budget].decode(errors="ignore")
        marker = json.dumps({TRUNCATED: True, "bytes": len(raw), "preview": preview}, ensure_ascii=False)
        size = len(marker.encode())
        if size <= max_bytes or budget == 0:
            return JsonText(marker)
        budget = max(0, budget - (size - max_bytes) - 8)


def clip_text(
    value: str | None, max_bytes: int = DEFAULT_MAX_BYTES, redact: Redactor | None = None
) -> str | None:
    """A plain-text column (errors) bounded and redacted like JSON payloads."""
    if value is None:
        return None
    if redact:
        value = redact(value)
    raw = value.encode()
    if len(raw) <= max_bytes:
        return value
    return raw[: max(0, max_bytes - 40)].decode(errors="ignore") + f"…[{TRUNCATED} {len(raw)} bytes]"


# -- PII redaction ----------------------------------------------------------------------

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?!\w)"
    r"|(?<![\w+])\+\d{1,3}(?:[\s.-]?\d{2,4}){3,5}(?!\w)"
)
_CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")


def _luhn_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    checksum = 0
    for i, digit in enumerate(reversed(digits)):
        if i % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        checksum += digit
    return checksum % 10 == 0


def redact_pii(text: str) -> str:
    """Mask e-mail addresses, phone numbers and payment card numbers (Luhn-checked)."""
    if not any(c.isdigit() or c == "@" for c in text):
        return text
    text = _EMAIL.sub("[EMAIL]", text)
    text = _CARD.sub(lambda m: "[CARD]" if _luhn_ok(m.group()) else m.group(), text)
    return _PHONE.sub("[PHONE]", text)


def make_redactor(redact: bool | Redactor | None) -> Redactor | None:
    """``True`` means the built-in patterns; a callable is applied after them."""
    if redact is None or redact is False:
        return None
    if redact is True:
        return redact_pii
    custom = redact
    return lambda text: custom(redact_pii(text))
