"""Turning arbitrary captured objects into bounded, redacted JSON.

Capture hands the recorder whatever the agent produced: messages, pydantic models,
dataclasses, exceptions, objects with no JSON form. Everything is converted here, and
never fails. Plain data (with a ``default`` for a framework's own types) is serialized by
orjson at submit, which costs the agent microseconds and keeps its objects out of the
queue; anything orjson refuses, and anything to redact, waits for the recorder's thread
and its bounded walk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import reprlib
from collections.abc import Callable, Mapping
from datetime import date, datetime
from enum import Enum
from typing import Any

import orjson

from trace_plugin.store.engine import JsonText

DEFAULT_MAX_BYTES = 1_000_000
TRUNCATED = "__truncated__"
_MAX_DEPTH = 64
_MAX_NODES = 200_000  # containers converted per payload; past that, the rest is opaque

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


class Shaped:
    """A value whose foreign types (LangChain messages, say) ``default`` turns into JSON.

    orjson walks the value in C and calls ``default`` only for the objects it does not
    know, so a state of plain data and a few messages costs no walk in Python. When orjson
    gives up (a cycle, a lone surrogate) or a redactor must see every string,
    :func:`to_jsonable` applies ``default`` the same way. ``default`` raises TypeError for
    what it does not know either.
    """

    __slots__ = ("value", "default")

    def __init__(self, value: Any, default: Callable[[Any], Any]) -> None:
        self.value = value
        self.default = default


def to_jsonable(
    value: Any, redact: Redactor | None = None, default: Callable[[Any], Any] | None = None
) -> Any:
    """A JSON-compatible copy of ``value``; what has no JSON form becomes its type and repr.

    The walk is bounded three ways: depth, a cycle check on the current path, and a total
    node budget. Depth alone is not enough: a value whose two keys both point back at it
    reaches the depth cap along 2^64 paths.
    """
    return _Walk(redact, default).convert(value, 0)


class _Walk:
    __slots__ = ("redact", "default", "budget", "path")

    def __init__(self, redact: Redactor | None, default: Callable[[Any], Any] | None) -> None:
        self.redact = redact
        self.default = default
        self.budget = _MAX_NODES
        self.path: set[int] = set()  # ids of the containers being converted above this one

    def text(self, value: str) -> str:
        return self.redact(value) if self.redact else value

    def convert(self, value: Any, depth: int) -> Any:
        if isinstance(value, Lazy):
            value = value.fn(value.arg)
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else None  # JSON has no NaN or Infinity; orjson writes null
        self.budget -= 1
        if depth >= _MAX_DEPTH or self.budget < 0 or id(value) in self.path:
            return _opaque(value, self.redact)
        self.path.add(id(value))
        try:
            return self._container(value, depth + 1)
        finally:
            self.path.discard(id(value))

    def _container(self, value: Any, d: int) -> Any:
        if isinstance(value, Mapping):
            return {str(k): self.convert(v, d) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.convert(v, d) for v in value]
        if isinstance(value, datetime | date):
            return value.isoformat()
        if isinstance(value, Enum):
            return self.convert(value.value, d)
        if isinstance(value, bytes | bytearray):
            return {"__type__": type(value).__name__, "length": len(value)}
        if isinstance(value, BaseException):
            return {"__type__": type(value).__name__, "error": self.text(str(value))}
        if self.default is not None:
            try:
                shaped = self.default(value)
            except TypeError:  # not one of the default's types
                pass
            else:
                return self.convert(shaped, d)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.convert({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, d)
        dump = getattr(value, "model_dump", None)  # pydantic v2, which LangChain messages are
        if callable(dump) and not isinstance(value, type):
            try:
                return self.convert(dump(mode="json", exclude_none=True), d)
            except Exception:
                return _opaque(value, self.redact)
        return _opaque(value, self.redact)


# Builtin containers get reprlib's bounded repr: a plain repr of a value shared along
# many paths is as long as the walk it replaces.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 4, 200, 10_000


def _opaque(value: Any, redact: Redactor | None) -> dict[str, Any]:
    try:
        text = _REPR.repr(value) if isinstance(value, dict | list | tuple | set | frozenset) else repr(value)
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
    if isinstance(value, JsonText):  # encoded already, at submit (encode_now)
        return value
    text = _json_text(value, redact)
    return None if text is None else _bounded(text, max_bytes)


def encode_now(value: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
    """``value`` as bounded JSON text if orjson alone can encode it, else None.

    Capture calls this on the agent's thread, where it costs microseconds for a typical
    payload (about a millisecond per megabyte), so the queued record holds one string
    instead of the agent's objects. What orjson refuses (a cycle, a foreign type, a
    lone surrogate) and any :class:`Lazy` value wait for the writer's bounded walk. Not
    for payloads that must be redacted first.
    """
    if isinstance(value, Shaped):
        raw, default, options = value.value, value.default, _ORJSON | orjson.OPT_PASSTHROUGH_DATACLASS
    elif isinstance(value, JsonText):
        return str(value)
    elif isinstance(value, Lazy):
        return None
    else:
        raw, default, options = value, None, _ORJSON
    try:
        data = orjson.dumps(raw, default=default, option=options)
    except Exception:  # a refusal, or a default that failed
        return None
    return data.decode() if len(data) <= max_bytes else str(_bounded(data.decode(), max_bytes))


def _bounded(text: str, max_bytes: int) -> JsonText:
    """``text`` as stored: cut to ``max_bytes`` with the truncation marker when longer."""
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


def _json_text(value: Any, redact: Redactor | None) -> str | None:
    try:
        if isinstance(value, Lazy):
            value = value.fn(value.arg)
        default = None
        if isinstance(value, Shaped):
            value, default = value.value, value.default
        if value is None:
            return None
        if redact is None:  # fast path: orjson walks plain data in C
            with contextlib.suppress(TypeError):  # orjson.JSONEncodeError: a type, a cycle, a lone surrogate
                options = _ORJSON | (orjson.OPT_PASSTHROUGH_DATACLASS if default else 0)
                return orjson.dumps(value, default=default, option=options).decode()
        text = _dumps(to_jsonable(value, redact, default))
    except Exception as exc:  # a failing conversion (a Lazy's, a mapping's items()) must not lose the record
        error = f"not encodable: {type(exc).__name__}: {exc}"[:1_000]
        raw = value.arg if isinstance(value, Lazy) else value
        text = _dumps({"__type__": type(raw).__qualname__, "error": redact(error) if redact else error})
    # A lone surrogate has no UTF-8 form, so no database can store it.
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")
_ORJSON = orjson.OPT_NON_STR_KEYS


def clip_text(
    value: str | None, max_bytes: int = DEFAULT_MAX_BYTES, redact: Redactor | None = None
) -> str | None:
    """A plain-text column (errors) bounded and redacted like JSON payloads."""
    if value is None:
        return None
    if redact:
        value = redact(value)
    raw = value.encode(errors="surrogatepass")  # the store replaces lone surrogates
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
