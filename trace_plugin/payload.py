"""Turning arbitrary captured objects into bounded, redacted JSON.

Capture hands the recorder whatever the agent produced: messages, pydantic models,
dataclasses, exceptions, objects with no JSON form. Everything is converted here, and
never fails. Plain data (with a ``default`` for a framework's own types) that reaches no
object twice and fits the size budget is serialized by orjson at submit, which costs the
agent microseconds and keeps its objects out of the queue; anything else, and anything to
redact, waits for the recorder's thread and ``shape``.

Shaping costs time and memory bounded by what it keeps, never by the value as fully
expanded: each object is shaped once, however often it is referenced, and the walk stops
at the size budget. JSON has no aliases, so an object met again (a shared child, or a
cycle) is stored as ``{"__ref__": "/json/pointer"}``, the RFC 6901 pointer to where the
payload holds it first. Strings are values and are written out wherever they occur; the
budget bounds them.
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
from uuid import UUID

import orjson

from trace_plugin.store.engine import JsonText

DEFAULT_MAX_BYTES = 1_000_000
TRUNCATED = "__truncated__"
REF = "__ref__"
_MAX_DEPTH = 64
_MAX_NODES = 200_000  # objects shaped per payload; past that, the payload is cut
_SCAN_NODES = 10_000  # objects the agent's thread looks at before leaving a payload to the writer

Redactor = Callable[[str], str]
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode  # one encoder, not one per call
_CUT = object()  # what the walk returns once the budget is spent: left out of its container


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
    may not take it (a shared object, a cycle, too large) or a redactor must see every
    string, ``shape`` applies ``default`` the same way. ``default`` raises TypeError
    for what it does not know either.
    """

    __slots__ = ("value", "default")

    def __init__(self, value: Any, default: Callable[[Any], Any]) -> None:
        self.value = value
        self.default = default


@dataclasses.dataclass(frozen=True, slots=True)
class Shaping:
    """A payload as ``shape`` left it, and the work that took."""

    value: Any  # JSON-compatible; a prefix of the payload when ``cut``
    cut: bool  # the size or object budget ran out before the whole payload was shaped
    size: int  # bytes of JSON shaped (estimated), up to and including the value that hit the budget
    nodes: int  # objects shaped: each once, however often it is referenced


def shape(
    value: Any,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    redact: Redactor | None = None,
    default: Callable[[Any], Any] | None = None,
) -> Shaping:
    """A JSON-compatible copy of ``value``; what has no JSON form becomes its type and repr.

    Bounded by what it keeps: past ``max_bytes`` (estimated) or ``_MAX_NODES`` objects
    the walk stops, and an object met again is a ``{"__ref__": pointer}`` marker, so a
    value shared along 2^64 paths costs 64 steps. Depth is capped at 64.
    """
    walk = _Walk(redact, default, max_bytes)
    out = walk.convert(value, "", 0)
    return Shaping(None if out is _CUT else out, walk.cut, walk.size, walk.nodes)


class _Walk:
    __slots__ = ("redact", "default", "room", "size", "nodes", "cut", "seen")

    def __init__(self, redact: Redactor | None, default: Callable[[Any], Any] | None, room: int) -> None:
        self.redact = redact
        self.default = default
        self.room = room
        self.size = 0
        self.nodes = 0
        self.cut = False
        # id of each object shaped -> (its pointer, the object): holding the object keeps
        # its id from being reused by a temporary (a default's result) during the walk.
        self.seen: dict[int, tuple[str, Any]] = {}

    def spend(self, size: int) -> None:
        self.size += size
        self.cut = self.cut or self.size > self.room

    def text(self, value: str) -> str:
        width = _utf8_width(value)
        left = self.room - self.size
        self.spend(len(value) * width + 2)
        if self.cut:
            value = value[: max(0, left) // width]
        return redact_text(value, self.redact) if self.redact else value

    def number(self, value: int | float, key: str) -> int | float | str:
        self.spend(8)
        if isinstance(value, float) and not math.isfinite(value):
            return None  # type: ignore[return-value]  # JSON has no NaN or Infinity; orjson writes null
        return redact_number(value, key, self.redact) if self.redact else value

    def convert(self, value: Any, at: str, depth: int) -> Any:
        if self.cut:
            return _CUT
        if isinstance(value, Lazy):
            value = value.fn(value.arg)
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, bool):
            self.spend(8)
            return value
        if isinstance(value, int | float):
            return self.number(value, at.rpartition("/")[2])
        if isinstance(value, datetime | date):
            return self.text(value.isoformat())
        if isinstance(value, Enum):
            return self.convert(value.value, at, depth)
        if isinstance(value, bytes | bytearray):
            self.spend(40)
            return {"__type__": type(value).__name__, "length": len(value)}
        if isinstance(value, BaseException):
            return {"__type__": type(value).__name__, "error": self.text(str(value))}
        if isinstance(value, Mapping | list | tuple | set | frozenset) and not value:
            self.spend(2)
            return {} if isinstance(value, Mapping) else []
        first = self.seen.get(id(value))
        if first is not None:
            self.spend(len(first[0]) + 14)
            return {REF: first[0]}
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            self.cut = True
            return _CUT
        if depth >= _MAX_DEPTH:
            return self.opaque(value)
        self.seen[id(value)] = (at, value)
        return self.container(value, at, depth + 1)

    def container(self, value: Any, at: str, d: int) -> Any:
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for k, v in value.items():
                key = str(k)
                self.spend(len(key) + 4)
                if self.redact:
                    key = _free_key(self.redact(key), out)  # an e-mail used as a key
                item = self.convert(v, f"{at}/{_escape(key)}", d)
                if item is _CUT:
                    break
                out[key] = item
            return out
        if isinstance(value, list | tuple | set | frozenset):
            items = []
            for i, v in enumerate(value):
                item = self.convert(v, f"{at}/{i}", d)
                if item is _CUT:
                    break
                items.append(item)
            return items
        if self.default is not None:
            try:
                shaped = self.default(value)
            except TypeError:  # not one of the default's types
                pass
            else:
                return self.shaped(shaped, at, d)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.shaped({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, at, d)
        dump = getattr(value, "model_dump", None)  # pydantic v2, which LangChain messages are
        if callable(dump) and not isinstance(value, type):
            try:
                return self.shaped(dump(mode="json", exclude_none=True), at, d)
            except Exception:
                return self.opaque(value)
        return self.opaque(value)

    def shaped(self, converted: Any, at: str, d: int) -> Any:
        """``converted``, an object's JSON form, in the object's place (and under its pointer)."""
        if isinstance(converted, Mapping | list | tuple):
            self.seen[id(converted)] = (at, converted)
            return self.container(converted, at, d)
        return self.convert(converted, at, d)

    def opaque(self, value: Any) -> dict[str, Any]:
        out = _opaque(value, self.redact)
        self.spend(len(out["repr"]) + len(out["__type__"]) + 24)
        return out


def _escape(key: str) -> str:
    """A key as an RFC 6901 pointer segment."""
    return key.replace("~", "~0").replace("/", "~1") if "~" in key or "/" in key else key


def _utf8_width(text: str) -> int:
    """Bytes per character in UTF-8, at most: the size estimate needs no encoded copy."""
    if text.isascii():
        return 1
    top = ord(max(text))
    return 2 if top < 0x800 else 3 if top < 0x10000 else 4


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


def fits_whole(
    value: Any, default: Callable[[Any], Any] | None, max_bytes: int, limit: int = _SCAN_NODES
) -> bool:
    """Whether orjson may encode ``value`` as it is: plain data (and ``default``'s types)
    reaching no object twice, within ``max_bytes`` (estimated), seen in ``limit`` steps.

    orjson expands a shared object at every reference and cuts only after the whole dump,
    so this look comes first; it visits each object once and gives up early.
    """
    seen: dict[int, Any] = {}  # id -> object, held so that its id stays its own
    kept: list[Any] = []
    size = 0
    stack = [value]
    while stack:
        v = stack.pop()
        kind = type(v)
        if kind is str:
            size += len(v) * _utf8_width(v) + 2
        elif kind in _SCALARS or v is None:
            size += 8
        elif kind is dict or kind is list or kind is tuple or isinstance(v, dict | list):
            if not v:
                size += 2
                continue
            if id(v) in seen or len(seen) >= limit:
                return False
            seen[id(v)] = v
            if isinstance(v, dict):
                size += sum(len(k) + 4 if type(k) is str else 24 for k in v)
                stack.extend(v.values())
            else:
                stack.extend(v)
        elif isinstance(v, str | int | float | datetime | date | UUID):  # subclasses orjson knows
            size += len(v) + 2 if isinstance(v, str) else 40
        elif default is not None and not isinstance(v, type):
            if id(v) in seen:
                return False
            try:
                shaped = default(v)
            except Exception:  # orjson would fail on it too
                return False
            seen[id(v)] = v
            kept.append(shaped)  # a temporary must keep its id while the look goes on
            stack.append(shaped)
        else:  # a dataclass, an Enum, a foreign object: the walk knows what to do with it
            return False
        if size > max_bytes:
            return False
    return True


_SCALARS = frozenset({int, float, bool})


def encode(
    value: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, redact: Redactor | None = None
) -> JsonText | None:
    """Serialize ``value`` for the store, cutting it to ``max_bytes`` with a marker.

    A cut payload is still valid JSON: ``{"__truncated__": true, "bytes": N, "preview": ...}``,
    where ``N`` is the size shaped before the cut (the whole payload's, when it was shaped whole).
    """
    if isinstance(value, JsonText):  # encoded already, at submit (encode_now)
        return value
    text = _json_text(value, max_bytes, redact)
    return None if text is None else text if isinstance(text, JsonText) else _bounded(text, max_bytes)


def encode_now(value: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
    """``value`` as bounded JSON text if orjson alone can encode it, else None.

    Capture calls this on the agent's thread, where it costs microseconds for a typical
    payload (about a millisecond per megabyte), so the queued record holds one string
    instead of the agent's objects. What orjson must not take (a shared object, a cycle,
    a foreign type, a lone surrogate, more than ``max_bytes``) and any ``Lazy``
    value wait for the writer's bounded walk. Not for payloads that must be redacted first.
    """
    if isinstance(value, Shaped):
        raw, default, options = value.value, value.default, _ORJSON | orjson.OPT_PASSTHROUGH_DATACLASS
    elif isinstance(value, JsonText):
        return str(value)
    elif isinstance(value, Lazy):
        return None
    else:
        raw, default, options = value, None, _ORJSON
    if not fits_whole(raw, default, max_bytes):
        return None
    try:
        data = orjson.dumps(raw, default=default, option=options)
    except Exception:  # a refusal, or a default that failed
        return None
    return data.decode() if len(data) <= max_bytes else str(_bounded(data.decode(), max_bytes))


def _bounded(text: str, max_bytes: int, size: int | None = None) -> JsonText:
    """``text`` as stored: cut to ``max_bytes`` with the truncation marker when longer, or
    always when ``size`` says the walk stopped at ``size`` bytes (``text`` is then a prefix)."""
    raw = text.encode()
    if size is None and len(raw) <= max_bytes:
        return JsonText(text)
    total = max(size or 0, len(raw))
    budget = max(0, max_bytes - 100)
    while True:  # the preview is escaped inside the marker, so shrink until the marker fits
        preview = raw[:budget].decode(errors="ignore")
        marker = json.dumps({TRUNCATED: True, "bytes": total, "preview": preview}, ensure_ascii=False)
        size = len(marker.encode())
        if size <= max_bytes or budget == 0:
            return JsonText(marker)
        budget = max(0, budget - (size - max_bytes) - 8)


def _json_text(value: Any, max_bytes: int, redact: Redactor | None) -> str | JsonText | None:
    try:
        if isinstance(value, Lazy):
            value = value.fn(value.arg)
        default = None
        if isinstance(value, Shaped):
            value, default = value.value, value.default
        if value is None:
            return None
        if redact is None and fits_whole(value, default, max_bytes, _MAX_NODES):  # orjson walks it in C
            with contextlib.suppress(TypeError):  # orjson.JSONEncodeError: a type, a lone surrogate
                options = _ORJSON | (orjson.OPT_PASSTHROUGH_DATACLASS if default else 0)
                return orjson.dumps(
                    value, default=default, option=options
                ).decode()  # it refuses lone surrogates
        shaped = shape(value, max_bytes=max_bytes, redact=redact, default=default)
        text = _no_surrogates(_dumps(shaped.value))
        return _bounded(text, max_bytes, shaped.size) if shaped.cut else text
    except Exception as exc:  # a failing conversion (a Lazy's, a mapping's items()) must not lose the record
        error = f"not encodable: {type(exc).__name__}: {exc}"[:1_000]
        raw = value.arg if isinstance(value, Lazy) else value
        return _dumps({"__type__": type(raw).__qualname__, "error": redact(error) if redact else error})


def _no_surrogates(text: str) -> str:
    """A lone surrogate has no UTF-8 form, so no database can store it."""
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


# A number under a key like these is a phone number whatever its digits (JSON has no "+").
_PHONE_KEY = re.compile(r"phone|mobile|(?:^|_)tel(?:$|_)|fax|msisdn", re.IGNORECASE)


def redact_number(number: int | float, key: str, redact: Redactor) -> int | float | str:
    """A JSON number as the redactor sees its digits (a card number given as a number is a
    card number), or ``[PHONE]`` under a key naming a phone; else the number itself."""
    if isinstance(number, bool):
        return number
    digits = str(number)
    if isinstance(number, int) and len(digits.lstrip("-")) >= 7 and _PHONE_KEY.search(key):
        return "[PHONE]"
    masked = redact(digits)
    return number if masked == digits else masked


def redact_text(text: str, redact: Redactor) -> str:
    """``text`` redacted; where it is JSON (tool-call arguments) and holds something to mask,
    the strings, keys and numbers inside it, so that it still parses."""
    masked = redact(text)
    if masked == text or text.lstrip()[:1] not in ("{", "[", '"'):
        return masked
    try:
        parsed = json.loads(text)
    except ValueError:
        return masked
    return json.dumps(redact_value(parsed, redact), ensure_ascii=False)


def redact_value(value: Any, redact: Redactor, key: str = "") -> Any:
    """Parsed JSON with every string, key and number passed through ``redact``."""
    if isinstance(value, str):
        return redact_text(value, redact)
    if isinstance(value, int | float):
        return redact_number(value, key, redact)
    if isinstance(value, list):
        return [redact_value(v, redact, key) for v in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out[_free_key(redact(str(k)), out)] = redact_value(v, redact, str(k))
        return out
    return value


def _free_key(key: str, taken: Mapping[str, Any]) -> str:
    """``key``, or with ``#2``, ``#3``... where two keys redact alike: none is lost."""
    n, free = 1, key
    while free in taken:
        n += 1
        free = f"{key}#{n}"
    return free


def make_redactor(redact: bool | Redactor | None) -> Redactor | None:
    """``True`` means the built-in patterns; a callable is applied after them."""
    if redact is None or redact is False:
        return None
    if redact is True:
        return redact_pii
    custom = redact
    return lambda text: custom(redact_pii(text))
