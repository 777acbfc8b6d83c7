"""Records as rows: the read filters, strings fitted to their columns, and the conversions
between record dataclasses and table rows, alike on SQLite and PostgreSQL."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from trace_plugin.records.capability import Capability
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job
from trace_plugin.records.outcome import Outcome, outcome_clauses
from trace_plugin.records.router_spec import CorpusEntry
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step
from trace_plugin.store import tables as t
from trace_plugin.store.engine import json_for_store

Record = Episode | Step | EpisodeEnd | Feedback


_R = TypeVar("_R", Episode, Step, Feedback, Capability, Expert, Job, Deployment)


@dataclass(slots=True)
class AgentStats:
    agent: str
    episodes: int
    finished: int
    with_outcome: int
    successes: int
    mean_reward: float | None

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.with_outcome if self.with_outcome else None


@dataclass(frozen=True, slots=True)
class OutcomeWindow:
    """A period's finished episodes with an outcome, and the successes among the latest of them."""

    labeled: int  # every one in the period
    recent: int  # the latest ``last`` of them (all, without a ``last``)
    successes: int  # among ``recent``

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.recent if self.recent else None


@dataclass(frozen=True, slots=True)
class EpisodeFilter:
    """Which episodes a read selects (bulk exports, the dashboard's list and counts); None
    (or no sources) means any. ``outcome`` is the one success rule's, ``unknown`` included;
    ``since`` is inclusive and ``until`` exclusive, on the start time (naive means UTC)."""

    agent: str | None = None
    outcome: Outcome | None = None
    sources: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    min_reward: float | None = None
    status: str | None = None
    adapter: str | None = None
    router: str | None = None  # a router version (``router_version``): what one deployment served

    def clauses(self) -> list[ColumnElement[bool]]:
        e = t.episodes.c
        where: list[ColumnElement[bool]] = [
            column == value
            for column, value in (
                (e.agent, self.agent),
                (e.status, self.status),
                (e.adapter, self.adapter),
                (e.router, self.router),
            )
            if value is not None
        ]
        if self.outcome is not None:
            where.append(getattr(outcome_clauses(e.label, e.reward), self.outcome))
        if self.sources:
            where.append(e.source.in_(self.sources))
        if self.since is not None:
            where.append(e.started_at >= _utc(self.since))
        if self.until is not None:
            where.append(e.started_at < _utc(self.until))
        if self.min_reward is not None:
            where.append(e.reward >= self.min_reward)
        return where


def tool_hash(schema: dict[str, Any]) -> str:
    """Content hash of a tool schema, so identical schemas are stored once."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def fit_string(value: Any, length: int | None) -> str | None:
    """A string as a column of ``length`` characters stores it, the same on every backend.

    PostgreSQL rejects NUL characters and strings longer than a ``varchar``, where SQLite
    keeps both, and neither stores a lone surrogate (it has no UTF-8 form). Those
    characters become U+FFFD, and an over-long string its first characters, ``~`` and 16
    hex digits of its SHA-256: distinct values stay distinct, and the same value always
    maps to the same key, so an over-long episode id chosen by a caller finds its episode
    again.
    """
    if value is None:
        return None
    value = _UNSTORABLE.sub("\ufffd", value if isinstance(value, str) else str(value))
    if length is None or len(value) <= length:
        return value
    return f"{value[: length - 17]}~{hashlib.sha256(value.encode()).hexdigest()[:16]}"


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


@functools.cache
def _fitter(length: int | None) -> Callable[[Any], str | None]:
    """``fit_string`` for one column, with the common case (short, clean ASCII) inline."""

    def fit(value: Any) -> str | None:
        if value is None or (
            type(value) is str
            and value.isascii()
            and "\x00" not in value
            and (length is None or len(value) <= length)
        ):
            return value
        return fit_string(value, length)

    return fit


@functools.cache
def _column_fitter(length: int | None) -> Callable[[Sequence[Any]], Sequence[str | None]]:
    """``fit_string`` over a whole column: one pass of C-level checks when every value
    is a short, clean ASCII ``str`` (almost always), else value by value."""
    fit = _fitter(length)

    def fit_column(values: Sequence[Any]) -> Sequence[str | None]:
        present = list(filter(None, values))  # None and "" need no fitting
        if set(map(type, present)) <= {str}:
            joined = "".join(present)
            short = length is None or max(map(len, present), default=0) <= length
            if short and joined.isascii() and "\x00" not in joined:
                return values
        return list(map(fit, values))

    return fit_column


def _utc(value: datetime) -> datetime:
    """A bound for a query on started_at: SQLite compares naive UTC text, so convert first."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; everything we write is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


_END_EPISODE = (
    update(t.episodes)
    .where(t.episodes.c.id == bindparam("b_id"))
    .values(
        status=func.coalesce(bindparam("b_status", type_=t.String()), t.episodes.c.status),
        output=bindparam("b_output", type_=t.Json),
        reward=func.coalesce(bindparam("b_reward", type_=t.Float()), t.episodes.c.reward),
        label=func.coalesce(bindparam("b_label", type_=t.String()), t.episodes.c.label),
        error=bindparam("b_error", type_=t.Text()),
        model=func.coalesce(bindparam("b_model", type_=t.String()), t.episodes.c.model),
        adapter=func.coalesce(bindparam("b_adapter", type_=t.String()), t.episodes.c.adapter),
        router=func.coalesce(bindparam("b_router", type_=t.String()), t.episodes.c.router),
        ended_at=bindparam("b_ended_at", type_=t.Timestamp),
    )
)


# Feedback overrides the outcome; ``b_*`` keys it does not carry are left as they were.
_APPLY_FEEDBACK = (
    update(t.episodes)
    .where(t.episodes.c.id == bindparam("b_id"))
    .values(
        reward=func.coalesce(bindparam("b_reward", type_=t.Float()), t.episodes.c.reward),
        label=func.coalesce(bindparam("b_label", type_=t.String()), t.episodes.c.label),
    )
)


def _columns(table: t.Table, cls: type) -> tuple[str, ...]:
    """The table's columns that are fields of the record class (all but surrogate keys)."""
    names = {f.name for f in fields(cls)}
    return tuple(c.name for c in table.columns if c.name in names)


_EPISODE_COLUMNS = _columns(t.episodes, Episode)


_STEP_COLUMNS = _columns(t.steps, Step)


_FEEDBACK_COLUMNS = _columns(t.feedback, Feedback)


_CAPABILITY_COLUMNS = _columns(t.capabilities, Capability)


_EXPERT_COLUMNS = _columns(t.experts, Expert)


_JOB_COLUMNS = _columns(t.jobs, Job)


_DEPLOYMENT_COLUMNS = _columns(t.deployments, Deployment)


def _json_column(values: Sequence[Any]) -> list[str | None]:
    return [None if v is None else json_for_store(v) for v in values]


def _sqlite_datetime_column(values: Sequence[datetime | None]) -> list[str | None]:
    """SQLAlchemy's SQLite format: naive UTC with microseconds (the offset cut off the end)."""
    utc = (v if v is None or v.tzinfo is UTC else v.astimezone(UTC) for v in values)
    return [None if v is None else v.isoformat(" ", "microseconds")[:-6] for v in utc]


def _to_row(record: Any, columns: tuple[str, ...]) -> dict[str, Any]:
    return {c: getattr(record, c) for c in columns}


def _from_row(cls: type[_R], row: Any, columns: tuple[str, ...]) -> _R:
    return cls(**{c: _aware(row[c]) if isinstance(row[c], datetime) else row[c] for c in columns})


def _expert_from_row(row: Any) -> Expert:
    expert = _from_row(Expert, row, _EXPERT_COLUMNS)
    expert.unhinted_curve = expert.unhinted_curve or []  # NULL for experts from before it was kept
    expert.corpus = [CorpusEntry.model_validate(entry) for entry in expert.corpus or ()]
    return expert


def _episode_from_row(row: Any) -> Episode:
    episode = _from_row(Episode, row, _EPISODE_COLUMNS)
    episode.metadata = episode.metadata or {}
    return episode


def _add_steps(conn: Connection, episodes: Sequence[Episode]) -> None:
    """Read ``episodes``' steps into them, in order, in one query."""
    by_id = {e.id: e for e in episodes}
    if not by_id:
        return
    steps = t.steps.c
    query = select(t.steps).where(steps.episode_id.in_(list(by_id))).order_by(steps.episode_id, steps.seq)
    for row in conn.execute(query).mappings():
        by_id[row["episode_id"]].steps.append(_from_row(Step, row, _STEP_COLUMNS))


def _add_tools(conn: Connection, episodes: Sequence[Episode]) -> None:
    """Give each LLM step the schemas of the tools its input names, from its episode's."""
    offered: dict[str, dict[str, dict[str, Any]]] = {e.id: {} for e in episodes}
    if not offered:
        return
    links = t.episode_tools.c
    query = (
        select(links.episode_id, t.tool_schemas.c.name, t.tool_schemas.c.schema)
        .join(t.tool_schemas, t.tool_schemas.c.hash == links.tool_hash)
        .where(links.episode_id.in_(list(offered)))
        .order_by(links.episode_id, links.tool_hash)
    )
    for episode_id, name, schema in conn.execute(query):
        offered[episode_id].setdefault(name, schema)
    for episode in episodes:
        schemas = offered[episode.id]
        for step in episode.steps:
            names = step.input.get("tools") if step.kind == "llm" and isinstance(step.input, dict) else None
            if schemas and isinstance(names, list):
                step.tools = [schemas[n] for n in names if isinstance(n, str) and n in schemas]


def _fit(column: t.Column, value: Any) -> str | None:
    return _fitter(column.type.length)(value)


def _fold_ends(started: list[Episode], ends: list[EpisodeEnd]) -> list[EpisodeEnd]:
    """Apply each end to its episode when both are in one batch, as ``_END_EPISODE`` would,
    so most runs cost one insert instead of an insert and an update; returns the rest."""
    by_id = {e.id: e for e in started}
    rest = []
    for end in ends:
        episode = by_id.get(end.episode_id)
        if episode is None:
            rest.append(end)
            continue
        episode.status, episode.output, episode.error = end.status or episode.status, end.output, end.error
        episode.ended_at = end.ended_at
        for name in ("reward", "label", "model", "adapter", "router"):
            if (value := getattr(end, name)) is not None:
                setattr(episode, name, value)
    return rest


def _end_row(r: EpisodeEnd | Feedback) -> dict[str, Any]:
    e = t.episodes.c
    if isinstance(r, Feedback):
        return {"b_id": _fit(e.id, r.episode_id), "b_reward": r.reward, "b_label": _fit(e.label, r.label)}
    return {
        "b_id": _fit(e.id, r.episode_id),
        "b_status": r.status,
        "b_output": r.output,
        "b_reward": r.reward,
        "b_label": _fit(e.label, r.label),
        "b_error": _fit(e.error, r.error),
        "b_model": _fit(e.model, r.model),
        "b_adapter": _fit(e.adapter, r.adapter),
        "b_router": _fit(e.router, r.router),
        "b_ended_at": r.ended_at,
    }


def _feedback_row(f: Feedback) -> dict[str, Any]:
    c = t.feedback.c
    row = _to_row(f, _FEEDBACK_COLUMNS)
    for name in ("episode_id", "label", "source", "comment"):
        row[name] = _fit(c[name], row[name])
    return row


def _as_dict(schema: dict[str, Any] | str) -> dict[str, Any]:
    return json.loads(schema) if isinstance(schema, str) else schema


def _tool_name(schema: dict[str, Any]) -> str:
    """The name in an OpenAI tool schema (``{"type": "function", "function": {...}}``)."""
    inner = schema.get("function", schema)
    return str(inner.get("name", "?")) if isinstance(inner, dict) else "?"
