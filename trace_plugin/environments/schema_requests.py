"""The generic template family: requests written from tool schemas alone.

The other families read retail's conventions (``<noun>_id`` keys, verbs, statuses). An agent
over stateless tools (calculators, lookups by name, conversions; dotted or camelCase names,
nested and typed arguments) follows none of them, so for it this family writes, offline,
a request per tool that states every argument value, paired with the reference call.
Values are sampled by type, honouring enums, ranges and string formats (captured values
replace the defaults where production showed them). Each request offers its tool among a
few others (distractors, forbidden), a minority of requests fit no offered tool (the right
answer is no call), and some need two calls in one turn. Tools run as stateless
``respond`` behaviours whose answer is a number derived from the call, and the reward is the
``arguments`` check (right tool, right values and types, no invented parameters, with
partial credit per argument) and the answers told to the user.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trace_plugin.mining.detectors import name_words
from trace_plugin.records.env_spec import MAX_SLOTS, Action, Check, Column, TaskTemplate, ToolSpec

PLACEHOLDER = re.compile(r"\{(\w+)\}")
MAX_CALLED = 8  # tools a spec exercises (each with a schema, within the spec's size limit)
DISTRACTORS = 2  # other tools offered beside the one a request needs
NO_CALL_WEIGHT = 0.1  # a share no larger than validation's do-nothing bound allows
_NO_CALL_REQUESTS = [
    "Thanks, that was all I needed today.",
    "Hello! Who am I talking to?",
    "Please just say hi back, no need to look anything up.",
]
_FORMATS: dict[str, list[str]] = {
    "date": ["2026-03-14", "2025-11-02", "2026-07-21", "2024-12-31"],
    "date-time": ["2026-03-14T09:30:00Z", "2025-11-02T17:05:00Z", "2026-07-21T12:00:00Z"],
    "time": ["09:30", "17:05", "12:00"],
    "email": ["ava.lopez@example.com", "kenji.chen@example.com", "omar.silva@example.com"],
    "uri": ["https://example.com/a", "https://example.org/report", "https://example.net/x/1"],
}

Params = dict[str, Column]
Pool = Callable[[str], Column]  # a string parameter's name -> where its values come from


@dataclass(frozen=True, slots=True)
class _Call:
    """One tool's reference call: its schema, the arguments (placeholders), their value
    pools, and the sentence that states the values."""

    schema: dict[str, Any]
    params: Params
    arguments: dict[str, Any]
    statement: str
    phrased: str | None = None  # the request as a user of the tool worded it, when traffic showed one

    @property
    def name(self) -> str:
        return str(_function(self.schema)["name"])


def requests(
    tools: list[dict[str, Any]], column: Pool, phrasings: Mapping[str, Sequence[str]] | None = None
) -> tuple[list[TaskTemplate], list[Check], list[ToolSpec]]:
    """Templates, checks and the tools they use. ``column(param)`` gives the value pool of a
    string parameter with no enum or format (captured values, else named defaults).
    ``phrasings`` (tool -> captured requests with their argument values as ``{name}``
    placeholders, ``phrasing``) word a tool's request as its users did, with other values
    in it, instead of dictating each argument."""
    phrasings = phrasings or {}
    calls = [call for schema in tools if (call := _call(schema, column, phrasings)) is not None][:MAX_CALLED]
    if not calls:
        return [], [], []
    names = [call.name for call in calls]
    tasks = []
    for i, call in enumerate(calls):
        others = _others(names, i)
        tasks.append(
            TaskTemplate(
                kind=f"call_{_slug(call.name)}",
                params=call.params,
                prompt=call.phrased or f"{_purpose(call.schema)} {call.statement}",
                reference=[Action(tool=call.name, arguments=call.arguments)],
                tools=_shuffled([call.name, *others], i),
                forbidden=others,
            )
        )
    pair = next(
        (
            (a, b)
            for a, b in zip(calls, calls[1:], strict=False)
            if len(a.params) + len(b.params) <= MAX_SLOTS
        ),
        None,
    )
    if pair is not None:
        tasks.append(_two_calls(*pair))
    tasks.append(
        TaskTemplate(
            kind="no_call",
            weight=NO_CALL_WEIGHT * sum(t.weight for t in tasks),
            params={"request": Column(kind="choice", values=list(_NO_CALL_REQUESTS))},
            prompt="{request}",
            tools=names[: 1 + DISTRACTORS],
            forbidden=names[: 1 + DISTRACTORS],
        )
    )
    # No valid_calls check: a well-formed call of a made-up value would earn it, and the
    # arguments check already gives nothing for a wrong type or an invented parameter. Each
    # call's answer (a number derived from it) is a fact the reply must tell.
    checks = [Check(kind="arguments", weight=3), Check(kind="forbidden"), Check(kind="facts")]
    specs = [ToolSpec(schema=call.schema, behaviour="respond") for call in calls]
    return tasks, checks, specs


def _two_calls(a: _Call, b: _Call) -> TaskTemplate:
    """Two requests in one message, each needing its own call (parallel calls); the second
    call's placeholders are renamed apart (``{p0}`` -> ``{q0}``)."""
    return TaskTemplate(
        kind="two_calls",
        params={**a.params, **{f"q{k[1:]}": v for k, v in b.params.items()}},
        prompt=f"Two things. First: {_purpose(a.schema)} {a.statement} "
        f"Second: {_purpose(b.schema)} {_rename(b.statement)}",
        reference=[
            Action(tool=a.name, arguments=a.arguments),
            Action(tool=b.name, arguments=_rename(b.arguments)),
        ],
        tools=[a.name, b.name],
    )


def _call(schema: dict[str, Any], column: Pool, phrasings: Mapping[str, Sequence[str]]) -> _Call | None:
    """A tool's reference call, or None when its schema is not an object or needs more
    values than a template holds. Required arguments, and the first optional one at each
    level; worded as a captured request that states exactly those, where there is one."""
    parameters = _function(schema).get("parameters") or {"type": "object", "properties": {}}
    if parameters.get("type", "object") != "object" or not isinstance(parameters.get("properties", {}), dict):
        return None
    params: Params = {}
    stated: list[str] = []

    def fill(value_schema: dict[str, Any], path: list[str]) -> Any:
        kind = value_schema.get("type")
        if kind == "object" and not value_schema.get("enum"):
            return {k: fill(v, [*path, k]) for k, v in _chosen(value_schema).items()}
        if kind == "array":
            return [fill(value_schema.get("items") or {"type": "string"}, path)]
        slot = f"p{len(params)}"
        params[slot] = _column(value_schema, path[-1] if path else "value", column)
        stated.append(f"{' '.join(w for p in path for w in _words(p))}: {{{slot}}}")
        return f"{{{slot}}}"

    arguments = {k: fill(v, [k]) for k, v in _chosen(parameters).items()}
    if len(params) > MAX_SLOTS:
        return None
    statement = f"Use {'; '.join(stated)}." if stated else "Nothing else is needed."
    # A captured wording that states every required argument (and perhaps optional ones):
    # the call then passes exactly the arguments it states.
    slots = {k: v[1:-1] for k, v in arguments.items() if isinstance(v, str) and PLACEHOLDER.fullmatch(v)}
    required = set(parameters.get("required") or ())
    for text in phrasings.get(str(_function(schema).get("name")), ()):
        named = set(PLACEHOLDER.findall(text))
        if required <= named <= set(slots):
            phrased = PLACEHOLDER.sub(lambda m: "{" + slots[m[1]] + "}", text)
            kept = {slots[k] for k in named}
            told = [entry for entry in stated if set(PLACEHOLDER.findall(entry)) <= kept]
            return _Call(
                schema,
                {slot: pool for slot, pool in params.items() if slot in kept},
                {k: v for k, v in arguments.items() if k in named},
                f"Use {'; '.join(told)}.",
                phrased,
            )
    return _Call(schema, params, arguments, statement)


def phrasing(request: str, arguments: Mapping[str, Any]) -> str | None:
    """``request`` with each of the call's argument values as a ``{name}`` placeholder: how a
    user worded what this call answers. None unless every argument is a plain value the
    request states once, word for word."""
    text = request.replace("{", "(").replace("}", ")")
    if not arguments:
        return None
    for name, value in arguments.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, str | int | float)
            or not re.fullmatch(r"\w+", name)
        ):
            return None
        shown = re.escape(str(value))
        if not str(value).strip() or len(re.findall(rf"(?<![\w.]){shown}(?![\w]|\.\d)", text)) != 1:
            return None
        text = re.sub(rf"(?<![\w.]){shown}(?![\w]|\.\d)", "{" + name + "}", text)
    return text


def _chosen(schema: dict[str, Any]) -> dict[str, Any]:
    """An object's required properties, plus its first optional one."""
    properties = {k: v if isinstance(v, dict) else {} for k, v in (schema.get("properties") or {}).items()}
    required = [k for k in schema.get("required", []) if k in properties]
    optional = [k for k in properties if k not in required][:1]
    return {k: properties[k] for k in [*required, *optional]}


def _column(schema: dict[str, Any], name: str, column: Pool) -> Column:
    """Where a value of ``schema``'s type comes from."""
    if schema.get("enum"):
        return Column(
            kind="choice", values=[v for v in schema["enum"] if isinstance(v, str | int | float)][:64]
        )
    kind = schema.get("type")
    if kind == "boolean":
        return Column(kind="choice", values=[True, False])
    if kind in ("integer", "number"):
        low, high = _range(schema, integer=kind == "integer")
        return Column(kind="int" if kind == "integer" else "number", low=low, high=high)
    if schema.get("format") in _FORMATS:
        return Column(kind="choice", values=_FORMATS[schema["format"]])
    return column(name)


def _range(schema: dict[str, Any], *, integer: bool) -> tuple[int | float, int | float]:
    low = schema.get("minimum", schema.get("exclusiveMinimum", 1 if integer else 0))
    high = schema.get("maximum", schema.get("exclusiveMaximum", low + 100))
    if integer:
        low, high = int(low) + ("exclusiveMinimum" in schema), int(high) - ("exclusiveMaximum" in schema)
    return (low, high) if low <= high else (high, low)


def _purpose(schema: dict[str, Any]) -> str:
    """What the request is for: the tool description's first sentence, else its name's words."""
    function = _function(schema)
    description = str(function.get("description") or "").strip().replace("{", "(").replace("}", ")")
    sentence = re.split(r"(?<=[.!?])\s", description, maxsplit=1)[0][:200].rstrip(".!? ")
    return f"I need this: {sentence or ' '.join(name_words(function['name']))}."


def _function(schema: dict[str, Any]) -> dict[str, Any]:
    return schema.get("function", schema)


def _words(name: str) -> list[str]:
    return name_words(name) or [name]


def _slug(name: str) -> str:
    return "_".join(name_words(name))[:56] or "tool"


def _others(names: list[str], i: int) -> list[str]:
    """The distractors beside tool ``i``: the next tools, deterministically."""
    return [names[(i + k) % len(names)] for k in range(1, min(DISTRACTORS, len(names) - 1) + 1)]


def _shuffled(names: list[str], i: int) -> list[str]:
    """The offered tools in an order that varies per template, so position tells nothing."""
    k = i % len(names)
    return names[k:] + names[:k]


def _rename(value: Any) -> Any:
    if isinstance(value, str):
        return re.sub(r"\{p(\d+)\}", r"{q\1}", value)
    if isinstance(value, list):
        return [_rename(v) for v in value]
    if isinstance(value, dict):
        return {k: _rename(v) for k, v in value.items()}
    return value
