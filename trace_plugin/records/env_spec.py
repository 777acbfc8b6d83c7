"""``EnvSpec``: a training environment as declarative data.

A synthesized environment is never code. It is this pydantic model (stored as JSON in the
database, versioned) which ``SpecEnv``
interprets. Every part comes from a fixed vocabulary:

- **tables** of typed columns, filled by seeded generators (id patterns, value pools,
  numeric ranges);
- **tools**: the target's own tool schemas, each bound to a behaviour (lookup by key,
  list/filter, guarded update, create, terminate, compute, or a stateless ``respond``);
- **task templates**: tickets whose slots are filled from sampled rows, with a reference
  action sequence that follows by construction, and optionally the subset of tools the
  ticket offers (agents whose tools differ per request);
- **checks**: a weighted reward program (valid call format, required calls, argument
  values with partial credit, order, forbidden calls, final state, facts communicated);
- an optional **hint** and **difficulty** knobs.

``check_spec`` rejects anything the interpreter could not run faithfully, with the
reason: unknown behaviours, references to missing tools, tables or columns, templates
whose slots cannot be satisfied, oversized state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trace_plugin.errors import TracePluginError
from trace_plugin.records.trajectory import utcnow

FORMAT_VERSION = 1

MAX_SPEC_BYTES = 64 * 1024
MAX_TABLES, MAX_COLUMNS, MAX_ROWS = 8, 16, 50
MAX_TOOLS, MAX_TEMPLATES, MAX_SLOTS, MAX_ACTIONS, MAX_POOL = 16, 16, 8, 8, 64
MAX_TEXT = 2000
MAX_SHAPE_DEPTH = 4

Name = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# A tool's name as agents write them (``pkg.func``, ``getWeather``, ``search-v2``): what the
# gateway accepts and MCP allows. Tables, columns, slots and parameters stay identifiers.
TOOL_NAME = r"^[A-Za-z0-9_.:-]{1,128}$"
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\}")
_DIGITS = re.compile(r"\{d(\d{1,2})\}")

Behaviour = Literal["lookup", "list", "update", "create", "terminate", "compute", "respond"]
WRITES: frozenset[Behaviour] = frozenset({"update", "create"})  # the behaviours that change a table
CheckKind = Literal[
    "valid_calls", "required_calls", "arguments", "order", "forbidden", "final_state", "facts"
]
Value = str | int | float | bool  # a pool's values keep their JSON type


class SpecError(TracePluginError, ValueError):
    """A spec the interpreter will not run, and why."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Column(_Model):
    """How a column's values are generated: ``id`` from a pattern (``{dN}`` is N random
    digits, the rest literal), ``choice``/``text`` from a pool, ``int`` from a range,
    ``number`` from a range to two decimals."""

    kind: Literal["id", "choice", "text", "int", "number"]
    pattern: str | None = Field(None, max_length=64)
    values: list[Value] = Field(default_factory=list, max_length=MAX_POOL)
    low: int | float = 0
    high: int | float = 100

    @field_validator("values")
    @classmethod
    def _short_values(cls, values: list[Value]) -> list[Value]:
        if any(isinstance(v, str) and len(v) > 200 for v in values):
            raise ValueError("pool values are at most 200 characters")
        return values


class Table(_Model):
    key: str
    columns: dict[str, Column] = Field(max_length=MAX_COLUMNS)
    rows: int = Field(3, ge=1, le=MAX_ROWS)


class ToolSpec(_Model):
    """One of the target's tools (its OpenAI schema, unchanged) bound to a behaviour."""

    schema_: dict[str, Any] = Field(alias="schema")
    behaviour: Behaviour
    table: str | None = None
    key: str | None = None  # the argument naming the row (lookup, update)
    filters: dict[str, str] = Field(default_factory=dict)  # argument -> column (list, compute)
    guard: dict[str, list[str]] = Field(default_factory=dict)  # column -> allowed values (update)
    sets: dict[str, str] = Field(default_factory=dict)  # column -> "$argument" or a literal
    op: Literal["count", "sum", "min", "max"] | None = None  # compute
    column: str | None = None  # compute
    # Tools that must have succeeded earlier in the episode before this one runs (the
    # target refused it until they had), and the target's words when they have not.
    requires: list[str] = Field(default_factory=list)
    requires_error: str = ""
    # The shape of the target's answers, so that the expert reads what the target will show
    # it: a JSON skeleton whose strings name the row's columns (a lookup's or an update's
    # answer), or one column's name (a list that answers its first match's value of it, as
    # a search that answers one user id). None: the row, or the matching keys.
    returns: Any = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("returns")
    @classmethod
    def _skeleton(cls, returns: Any) -> Any:
        def depth(value: Any) -> int:
            if isinstance(value, str):
                return 0
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return 1 + max(map(depth, value.values()), default=0)
            if isinstance(value, list) and len(value) <= 1:
                return 1 + max(map(depth, value), default=0)
            raise ValueError("returns is built of objects, one-element lists and column names")

        if returns is not None and (depth(returns) > MAX_SHAPE_DEPTH or len(json.dumps(returns)) > MAX_TEXT):
            raise ValueError(f"returns is at most {MAX_SHAPE_DEPTH} deep and {MAX_TEXT} characters")
        return returns

    @property
    def name(self) -> str:
        return str(self.function.get("name", ""))

    @property
    def function(self) -> dict[str, Any]:
        return self.schema_.get("function", self.schema_)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.get("parameters") or {}


class Slot(_Model):
    """A row sampled from ``table``; ``where`` forces the listed columns into allowed values."""

    table: str
    where: dict[str, list[str]] = Field(default_factory=dict)


class Action(_Model):
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # strings may hold placeholders


class TaskTemplate(_Model):
    """A ticket. ``{slot.column}`` names a sampled row's value, ``{param}`` a sampled value."""

    kind: str = Field(max_length=64)
    weight: float = Field(1.0, gt=0, le=100)
    slots: dict[str, Slot] = Field(default_factory=dict, max_length=MAX_SLOTS)
    params: dict[str, Column] = Field(default_factory=dict, max_length=MAX_SLOTS)
    prompt: str = Field(max_length=MAX_TEXT)
    reference: list[Action] = Field(default_factory=list, max_length=MAX_ACTIONS)
    facts: list[str] = Field(default_factory=list, max_length=MAX_ACTIONS)
    forbidden: list[str] = Field(default_factory=list, max_length=MAX_TOOLS)
    tools: list[str] = Field(default_factory=list, max_length=MAX_TOOLS)  # offered; empty: all
    # What the reference tells the user at the end (placeholders allowed); None: its facts.
    answer: str | None = Field(None, max_length=MAX_TEXT)

    def offers(self, tool: str) -> bool:
        return not self.tools or tool in self.tools


class Check(_Model):
    kind: CheckKind
    weight: float = Field(1.0, gt=0, le=100)
    before: str | None = None  # order: a call to ``before`` must precede every call to ``after``
    after: str | None = None

    @property
    def label(self) -> str:
        return f"order:{self.before}<{self.after}" if self.kind == "order" else self.kind


class Difficulty(_Model):
    distractor_rows: int = Field(0, ge=0, le=MAX_ROWS)  # extra rows per table, none of them the answer
    # The share of tickets whose request names the tools its reference calls (a hint in the
    # request; which tickets, the seed decides). A share between none and all is a level
    # between them, not a cliff (specs before it said true or false: all or none).
    name_tools: float = Field(0.0, ge=0.0, le=1.0)
    # Only the reference's last call is asked for (the lookups before it are left out); for
    # kinds whose tickets already state every value that call needs.
    single_step: bool = False


class EnvSpec(_Model):
    format_version: Literal[1] = FORMAT_VERSION
    name: str
    capability: str
    description: str = Field("", max_length=MAX_TEXT)
    system_prompt: str = Field(max_length=4 * MAX_TEXT)
    tables: dict[str, Table] = Field(max_length=MAX_TABLES)
    tools: list[ToolSpec] = Field(min_length=1, max_length=MAX_TOOLS)
    tasks: list[TaskTemplate] = Field(min_length=1, max_length=MAX_TEMPLATES)
    checks: list[Check] = Field(min_length=1, max_length=12)
    hint: str | None = Field(None, max_length=MAX_TEXT)
    difficulty: Difficulty = Difficulty()

    def tool(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)


def parse_spec(data: str | bytes | dict[str, Any]) -> EnvSpec:
    """Parse and check untrusted spec data (an LLM's proposal, a file); raise SpecError."""
    raw = data if isinstance(data, str | bytes) else json.dumps(data)
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is {len(raw)} bytes; the limit is {MAX_SPEC_BYTES}")
    try:
        spec = EnvSpec.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise SpecError(f"{where}: {first['msg']} ({exc.error_count()} problem(s))") from None
    check_spec(spec)
    return spec


def check_spec(spec: EnvSpec) -> None:
    """The semantic rules pydantic cannot express; raises SpecError with the first problem."""
    if len(spec.to_json()) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    for name, table in spec.tables.items():
        _name(name, "table")
        for column_name, column in table.columns.items():
            _name(column_name, f"column of {name}")
            _column(column, f"{name}.{column_name}")
        if table.key not in table.columns or table.columns[table.key].kind != "id":
            raise SpecError(f"table {name}: key {table.key!r} must be one of its columns, of kind id")
        if table.rows + spec.difficulty.distractor_rows > MAX_ROWS:
            raise SpecError(f"table {name}: more than {MAX_ROWS} rows with distractors")
    names = [t.name for t in spec.tools]
    if len(set(names)) != len(names):
        raise SpecError("tool names must be unique")
    for tool in spec.tools:
        _tool(spec, tool)
    for template in spec.tasks:
        _template(spec, template)
    for check in spec.checks:
        if check.kind == "order":
            for end in (check.before, check.after):
                if end is None or spec.tool(end) is None:
                    raise SpecError(f"order check references missing tool {end!r}")


def _name(name: str, what: str) -> None:
    if not Name.match(name):
        raise SpecError(f"{what} name {name!r} is not an identifier")


def _column(column: Column, where: str) -> None:
    if column.kind == "id":
        if not column.pattern or not _DIGITS.search(column.pattern):
            raise SpecError(f"{where}: an id column needs a pattern with {{dN}} digits")
        if (
            "{" in _DIGITS.sub("", column.pattern)
            or sum(int(n) for n in _DIGITS.findall(column.pattern)) > 16
        ):
            raise SpecError(f"{where}: id pattern {column.pattern!r} is malformed or too long")
    elif column.kind in ("choice", "text") and not column.values:
        raise SpecError(f"{where}: a {column.kind} column needs values")
    elif column.kind in ("int", "number") and column.low > column.high:
        raise SpecError(f"{where}: low > high")
    elif column.kind == "int" and not (isinstance(column.low, int) and isinstance(column.high, int)):
        raise SpecError(f"{where}: an int column's range is of integers")


def _tool(spec: EnvSpec, tool: ToolSpec) -> None:
    if not re.match(TOOL_NAME, tool.name):
        raise SpecError(f"tool name {tool.name!r} is not a function name (letters, digits, _ . : -)")
    parameters = tool.parameters
    if parameters.get("type", "object") != "object" or not isinstance(parameters.get("properties", {}), dict):
        raise SpecError(f"tool {tool.name}: parameters must be a JSON object schema")
    arguments = set(parameters.get("properties", {}))
    for required in tool.requires:
        if required == tool.name or spec.tool(required) is None:
            raise SpecError(f"tool {tool.name}: requires {required!r}, which is not another of its tools")
    if tool.behaviour in ("terminate", "respond"):
        return
    table = spec.tables.get(tool.table or "")
    if table is None:
        raise SpecError(f"tool {tool.name}: {tool.behaviour} needs a table; {tool.table!r} does not exist")
    if tool.behaviour in ("lookup", "update") and tool.key not in arguments:
        raise SpecError(f"tool {tool.name}: key argument {tool.key!r} is not one of its parameters")
    for argument, column in tool.filters.items():
        if argument not in arguments or column not in table.columns:
            raise SpecError(
                f"tool {tool.name}: filter {argument}->{column} names a missing argument or column"
            )
    if isinstance(tool.returns, str) and (tool.behaviour != "list" or tool.returns not in table.columns):
        raise SpecError(f"tool {tool.name}: only a list answers one column, and {tool.returns!r} must be one")
    if isinstance(tool.returns, list | dict) and (
        tool.behaviour not in ("lookup", "update") or not isinstance(tool.returns, dict)
    ):
        raise SpecError(f"tool {tool.name}: only a lookup or an update answers an object shape")
    for column, allowed in tool.guard.items():
        if column not in table.columns or not allowed:
            raise SpecError(f"tool {tool.name}: guard on missing column {column!r} or with no values")
    for column, value in tool.sets.items():
        if column not in table.columns or column == table.key:
            raise SpecError(f"tool {tool.name}: cannot set column {column!r}")
        if value.startswith("$") and value[1:] not in arguments:
            raise SpecError(f"tool {tool.name}: sets {column} from missing argument {value[1:]!r}")
    if tool.behaviour == "compute" and (
        tool.op is None or (tool.op != "count" and tool.column not in table.columns)
    ):
        raise SpecError(f"tool {tool.name}: compute needs an op and, except for count, a column")
    if tool.behaviour == "compute" and tool.op != "count" and table.columns[tool.column or ""].kind != "int":
        raise SpecError(f"tool {tool.name}: {tool.op} needs an int column")


def _template(spec: EnvSpec, template: TaskTemplate) -> None:
    where = f"task {template.kind}"
    per_table: dict[str, int] = {}
    for slot_name, slot in template.slots.items():
        _name(slot_name, f"{where}: slot")
        table = spec.tables.get(slot.table)
        if table is None:
            raise SpecError(f"{where}: slot {slot_name} samples missing table {slot.table!r}")
        per_table[slot.table] = per_table.get(slot.table, 0) + 1
        if per_table[slot.table] > table.rows:
            raise SpecError(f"{where}: more {slot.table} slots than rows; unsatisfiable")
        for column, allowed in slot.where.items():
            generated = table.columns.get(column)
            if generated is None or generated.kind != "choice" or not set(allowed) <= set(generated.values):
                raise SpecError(f"{where}: slot {slot_name} requires {column} in {allowed}; unsatisfiable")
            if not allowed:
                raise SpecError(f"{where}: slot {slot_name} allows no value of {column}; unsatisfiable")
    for param_name, column in template.params.items():
        _name(param_name, f"{where}: param")
        _column(column, f"{where}.{param_name}")
    texts = [template.prompt, *template.facts, *(_strings(a.arguments) for a in template.reference)]
    texts += [template.answer] if template.answer else []
    for text in texts:
        for slot, column in PLACEHOLDER.findall(text):
            if column:
                table = spec.tables.get(template.slots[slot].table) if slot in template.slots else None
                if table is None or column not in table.columns:
                    raise SpecError(f"{where}: placeholder {{{slot}.{column}}} names no slot column")
            elif slot not in template.params:
                raise SpecError(f"{where}: placeholder {{{slot}}} names no param")
    for name in template.tools:
        if spec.tool(name) is None:
            raise SpecError(f"{where}: offers missing tool {name!r}")
    if len(set(template.tools)) != len(template.tools):
        raise SpecError(f"{where}: offers a tool twice")
    for action in [*template.reference]:
        tool = spec.tool(action.tool)
        if tool is None:
            raise SpecError(f"{where}: reference calls missing tool {action.tool!r}")
        if not template.offers(action.tool):
            raise SpecError(f"{where}: reference calls {action.tool}, which the task does not offer")
        unknown = set(action.arguments) - set(tool.parameters.get("properties", {}))
        if unknown:
            raise SpecError(f"{where}: reference passes unknown arguments {sorted(unknown)} to {tool.name}")
    for name in template.forbidden:
        if spec.tool(name) is None:
            raise SpecError(f"{where}: forbids missing tool {name!r}")
        if any(a.tool == name for a in template.reference):
            raise SpecError(f"{where}: forbids {name}, which its reference calls")


def _strings(value: Any) -> str:
    """Every string inside an argument value, joined, for placeholder checks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_strings(v) for v in value)
    if isinstance(value, dict):
        return " ".join(_strings(v) for v in value.values())
    return ""


@dataclass(slots=True)
class SpecRecord:
    """A stored spec: its version per name, whether it passed validation, and the report."""

    agent: str
    spec: EnvSpec
    version: int
    status: str  # "validated" or "rejected"
    report: dict[str, Any]
    created_at: datetime = field(default_factory=utcnow)
