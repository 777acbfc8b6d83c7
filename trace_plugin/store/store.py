"""The trajectory store: batched writes of capture records and the queries built on them."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

import orjson
from sqlalchemy import Engine, bindparam, case, func, literal, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from trace_plugin.records.capability import Capability
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec, SpecRecord
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job
from trace_plugin.records.outcome import Outcome, outcome_clauses
from trace_plugin.records.router_spec import CorpusEntry
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step, utcnow
from trace_plugin.store import tables as t
from trace_plugin.store.engine import json_for_store, make_engine, resolve_url

Record = Episode | Step | EpisodeEnd | Feedback
_R = TypeVar("_R", Episode, Step, Feedback, Capability, Expert, Job, Deployment)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_UPGRADE_LOCK = threading.Lock()
_PG_MIGRATION_LOCK = 0x7472_6163  # "trac": serializes concurrent upgrades on PostgreSQL


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


class Store:
    """SQL storage for trajectories, on SQLite (the default) or PostgreSQL.

    ``write`` takes capture records in the order they happened and stores them in one
    transaction; the recorder calls it from its background thread. Queries return the
    dataclasses of ``trace_plugin.records.trajectory``.
    """

    def __init__(self, url: str | None = None, *, engine: Engine | None = None) -> None:
        self.url = resolve_url(url)
        self.engine = engine or make_engine(self.url)
        self._read_engine = self.engine.execution_options(sqlite_read=True)
        self._known_agents: set[str] = set()
        self._known_tools: set[str] = set()
        # Agents offer the same schemas on every call: hash each distinct one once (see _hash_of).
        self._hashes: dict[bytes, str] = {}

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    # -- schema -------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Bring the schema to ``revision`` with Alembic; safe to run from many processes."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        # Alembic keeps its running context in module globals: one upgrade per process at a time.
        with _UPGRADE_LOCK, self.engine.begin() as conn:  # BEGIN IMMEDIATE on SQLite: one upgrader at a time
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, revision)

    # -- writes -------------------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> None:
        """Store records in one transaction, preserving their order's meaning.

        Episodes are inserted before the steps, ends and feedback that refer to them, so a
        batch may hold a whole run. Raises on any failure, and then nothing is written.
        """
        with self.engine.begin() as conn:
            new_agents, new_tools = self._write(conn, records)
        # Remembered only once committed: a rolled-back batch must insert them again.
        self._known_agents |= new_agents
        self._known_tools |= new_tools

    def _write(self, conn: Connection, records: Sequence[Record]) -> tuple[set[str], set[str]]:
        started = [r for r in records if isinstance(r, Episode)]
        step_rows = [r for r in records if isinstance(r, Step)]
        ends = [r for r in records if isinstance(r, EpisodeEnd)]
        feedback = [r for r in records if isinstance(r, Feedback)]

        new_agents = {_fit(t.agents.c.name, e.agent) for e in started} - self._known_agents
        if new_agents:
            now = utcnow()
            rows = [{"name": a, "created_at": now} for a in sorted(new_agents)]
            conn.execute(self._insert_ignore(t.agents), rows)
        ends = _fold_ends(started, ends)
        if started:
            self._bulk_insert(conn, t.episodes, _EPISODE_COLUMNS, started)
        if ends:
            conn.execute(_END_EPISODE, [_end_row(e) for e in ends])
        new_tools: set[str] = set()
        if step_rows:
            self._bulk_insert(conn, t.steps, _STEP_COLUMNS, step_rows)
            new_tools = self._write_tools(conn, step_rows)
        if feedback:
            conn.execute(t.feedback.insert(), [_feedback_row(f) for f in feedback])
            conn.execute(_APPLY_FEEDBACK, [_end_row(f) for f in feedback])
        return new_agents, new_tools

    def _write_tools(self, conn: Connection, step_rows: Iterable[Step]) -> set[str]:
        """Store unseen tool schemas once and link each to its episodes; returns new hashes."""
        schemas: dict[str, dict[str, Any] | str] = {}  # a dict, or its JSON text (see Recorder.submit)
        links: set[tuple[str, str]] = set()
        for s in step_rows:
            for schema in s.tools or ():
                h = self._hash_of(schema)
                schemas[h] = schema
                links.add((s.episode_id, h))
        if not links:
            return set()
        new = {h for h in schemas if h not in self._known_tools}
        if new:
            now = utcnow()
            rows = [
                {
                    "hash": h,
                    "name": _fit(t.tool_schemas.c.name, _tool_name(_as_dict(schemas[h]))),
                    "schema": schemas[h],
                    "created_at": now,
                }
                for h in sorted(new)
            ]
            conn.execute(self._insert_ignore(t.tool_schemas), rows)
        episode_ids, hashes = zip(*sorted(links), strict=True)
        episode_ids = _column_fitter(t.episode_tools.c.episode_id.type.length)(episode_ids)
        sql = self._insert_sql(t.episode_tools, ("episode_id", "tool_hash"), ignore_conflicts=True)
        conn.exec_driver_sql(sql, list(zip(episode_ids, hashes, strict=True)))
        return new

    def _hash_of(self, schema: dict[str, Any] | str) -> str:
        """``tool_hash``, cached by content: capture sources build a new dict per call.

        The key is the schema's JSON text (the recorder serializes schemas at submit) or
        orjson's sorted dump of a dict: bytes, so the cache holds nothing the garbage
        collector must scan (a cache keyed by the dicts themselves kept thousands of them
        alive and slowed every collection).
        """
        if isinstance(schema, str):
            key = schema.encode()
        else:
            try:
                key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
            except TypeError:  # not plain JSON: hash it the slow way, uncached
                return tool_hash(schema)
        digest = self._hashes.get(key)
        if digest is None:
            if len(self._hashes) >= 4_096:
                self._hashes.clear()
            digest = self._hashes[key] = tool_hash(_as_dict(schema))
        return digest

    def _bulk_insert(
        self, conn: Connection, table: t.Table, columns: tuple[str, ...], records: Sequence[Record]
    ) -> None:
        """Insert through the driver's ``executemany``, converting values ourselves.

        This is the recorder's hot path: SQLAlchemy's per-row parameter processing costs
        about five times the insert itself on SQLite. Values are stored exactly as
        SQLAlchemy would store them, so reads through it see no difference.
        """
        sql = self._insert_sql(table, columns)
        # Column by column: one attrgetter call per record, then each column converted
        # whole, a fraction of the cost of converting row by row.
        by_column = list(zip(*map(attrgetter(*columns), records), strict=True))
        for i, name in enumerate(columns):
            convert = self._converter(table.c[name].type)
            if convert is not None:
                by_column[i] = convert(by_column[i])
        conn.exec_driver_sql(sql, list(zip(*by_column, strict=True)))

    def _insert_sql(self, table: t.Table, columns: tuple[str, ...], *, ignore_conflicts: bool = False) -> str:
        """The driver-level INSERT of ``columns`` (SQLite and PostgreSQL share the syntax)."""
        placeholder = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        values = ", ".join([placeholder] * len(columns))
        sql = f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({values})"
        return sql + " ON CONFLICT DO NOTHING" if ignore_conflicts else sql

    def _converter(self, column_type: Any) -> Callable[[Sequence[Any]], Sequence[Any]] | None:
        """A column's values as the driver takes them. JSON columns take our JSON text
        (psycopg sends strings untyped, so it lands in jsonb as is); SQLite datetimes take
        SQLAlchemy's storage format, naive UTC; strings are fitted to their column
        (``fit_string``)."""
        if isinstance(column_type, t.JSON):
            return _json_column
        if isinstance(column_type, t.DateTime) and self.dialect == "sqlite":
            return _sqlite_datetime_column
        if isinstance(column_type, t.String):
            return _column_fitter(column_type.length)
        return None

    def _insert_ignore(self, table: t.Table) -> Any:
        dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        return dialect_insert(table).on_conflict_do_nothing()

    # -- queries ------------------------------------------------------------------------

    def list_episodes(
        self,
        agent: str | None = None,
        *,
        status: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[Episode]:
        """Episodes, newest first, without their steps."""
        query = select(t.episodes).order_by(t.episodes.c.started_at.desc(), t.episodes.c.id)
        if agent is not None:
            query = query.where(t.episodes.c.agent == agent)
        if status is not None:
            query = query.where(t.episodes.c.status == status)
        with self._read_engine.connect() as conn:
            rows = conn.execute(query.limit(limit).offset(offset)).mappings().all()
        return [_episode_from_row(r) for r in rows]

    def get_episode(self, episode_id: str) -> Episode | None:
        """One episode with its steps in order, each LLM step's tools as schemas (as
        ``iter_episodes`` gives them), or None."""
        episode_id = _fit(t.episodes.c.id, episode_id)
        with self._read_engine.connect() as conn:
            row = conn.execute(select(t.episodes).where(t.episodes.c.id == episode_id)).mappings()
            row = row.first()
            if row is None:
                return None
            episode = _episode_from_row(row)
            _add_steps(conn, [episode])
            _add_tools(conn, [episode])
        return episode

    def feedback_for(self, episode_id: str) -> list[Feedback]:
        episode_id = _fit(t.episodes.c.id, episode_id)
        query = select(t.feedback).where(t.feedback.c.episode_id == episode_id)
        with self._read_engine.connect() as conn:
            rows = conn.execute(query.order_by(t.feedback.c.id)).mappings().all()
        return [_from_row(Feedback, r, _FEEDBACK_COLUMNS) for r in rows]

    def tool_schemas(self, agent: str) -> list[dict[str, Any]]:
        """The distinct tool schemas ever offered to ``agent``, by name."""
        query = (
            select(t.tool_schemas.c.schema)
            .distinct()
            .join(t.episode_tools, t.episode_tools.c.tool_hash == t.tool_schemas.c.hash)
            .join(t.episodes, t.episodes.c.id == t.episode_tools.c.episode_id)
            .where(t.episodes.c.agent == agent)
        )
        with self._read_engine.connect() as conn:
            schemas = [r[0] for r in conn.execute(query)]
        return sorted(schemas, key=_tool_name)

    def load_episodes(
        self, agent: str, *, limit: int | None = None, finished: bool = True, since: datetime | None = None
    ) -> list[Episode]:
        """An agent's episodes with their steps (those started at ``since`` or later), newest
        first, in two queries."""
        query = select(t.episodes).where(t.episodes.c.agent == agent)
        if since is not None:
            query = query.where(t.episodes.c.started_at >= since)
        if finished:
            query = query.where(t.episodes.c.status != "running")
        query = query.order_by(t.episodes.c.started_at.desc(), t.episodes.c.id).limit(limit)
        with self._read_engine.connect() as conn:
            episodes = [_episode_from_row(r) for r in conn.execute(query).mappings()]
            for start in range(0, len(episodes), 500):  # bounded IN lists
                _add_steps(conn, episodes[start : start + 500])
        return episodes

    def episode_statuses(self, where: EpisodeFilter) -> dict[str, int]:
        """How many of the episodes ``where`` selects are in each status."""
        e = t.episodes.c
        query = select(e.status, func.count()).where(*where.clauses()).group_by(e.status)
        with self._read_engine.connect() as conn:
            return {status: n for status, n in conn.execute(query)}

    def iter_episodes(
        self, where: EpisodeFilter, *, limit: int | None = None, page: int = 100
    ) -> Iterator[Episode]:
        """The finished episodes ``where`` selects, newest first, with their steps, read
        ``page`` at a time: memory stays that of one page however many there are.

        Pages follow (started_at, id) from the last one read, not an offset, so each costs
        the same and episodes written meanwhile shift nothing. Each LLM step's ``tools``
        holds the schemas of the tools its input names, from those the episode was offered
        (the store keeps them once per episode, not per step).
        """
        e = t.episodes.c
        query = select(t.episodes).where(*where.clauses(), e.status != "running")
        query = query.order_by(e.started_at.desc(), e.id.desc())
        after: tuple[datetime, str] | None = None
        left = limit
        while left is None or left > 0:
            size = page if left is None else min(page, left)
            paged = query
            if after is not None:
                at, last = after
                # The bound alone first, so that the (agent, started_at) index ranges over it.
                paged = query.where(e.started_at <= at, or_(e.started_at < at, e.id < last))
            with self._read_engine.connect() as conn:
                episodes = [_episode_from_row(r) for r in conn.execute(paged.limit(size)).mappings()]
                _add_steps(conn, episodes)
                _add_tools(conn, episodes)
            yield from episodes
            if len(episodes) < size:
                return
            after = (episodes[-1].started_at, episodes[-1].id)
            left = None if left is None else left - len(episodes)

    def save_capabilities(self, agent: str, capabilities: Sequence[Capability]) -> None:
        rows = [{"agent": agent, **_to_row(c, _CAPABILITY_COLUMNS)} for c in capabilities]
        if rows:
            with self.engine.begin() as conn:
                conn.execute(self._insert_ignore(t.agents), [{"name": agent, "created_at": utcnow()}])
                conn.execute(t.capabilities.insert(), rows)

    def capabilities(self, agent: str, mining_run: str | None = None) -> list[Capability]:
        """The capabilities of one mining pass (the latest by default), selected first."""
        c = t.capabilities.c
        with self._read_engine.connect() as conn:
            if mining_run is None:
                latest = select(c.mining_run).where(c.agent == agent).order_by(c.mined_at.desc(), c.id.desc())
                mining_run = conn.execute(latest.limit(1)).scalar()
            if mining_run is None:
                return []
            query = select(t.capabilities).where(c.agent == agent, c.mining_run == mining_run).order_by(c.id)
            return [_from_row(Capability, r, _CAPABILITY_COLUMNS) for r in conn.execute(query).mappings()]

    # -- environments and experts -----------------------------------------------------

    def save_env_spec(self, agent: str, spec: EnvSpec, status: str, report: dict[str, Any]) -> SpecRecord:
        """Store ``spec`` as the next version of its name."""
        c = t.env_specs.c
        with self.engine.begin() as conn:
            conn.execute(self._insert_ignore(t.agents), [{"name": agent, "created_at": utcnow()}])
            latest = conn.execute(select(func.max(c.version)).where(c.name == spec.name)).scalar()
            record = SpecRecord(agent, spec, (latest or 0) + 1, status, report)
            conn.execute(
                t.env_specs.insert(),
                {
                    "agent": agent,
                    "name": spec.name,
                    "version": record.version,
                    "capability": spec.capability,
                    "spec": spec.model_dump(mode="json", by_alias=True),
                    "status": status,
                    "report": report,
                    "created_at": record.created_at,
                },
            )
        return record

    def env_specs(self, agent: str | None = None, *, name: str | None = None) -> list[SpecRecord]:
        """Stored specs, newest version first."""
        c = t.env_specs.c
        query = select(t.env_specs).order_by(c.name, c.version.desc())
        if agent is not None:
            query = query.where(c.agent == agent)
        if name is not None:
            query = query.where(c.name == name)
        with self._read_engine.connect() as conn:
            return [
                SpecRecord(
                    r["agent"],
                    EnvSpec.model_validate(r["spec"]),
                    r["version"],
                    r["status"],
                    r["report"],
                    _aware(r["created_at"]),
                )
                for r in conn.execute(query).mappings()
            ]

    def env_spec(self, name: str, version: int | None = None) -> SpecRecord | None:
        """One stored spec: the given version, else the latest."""
        records = self.env_specs(name=name)
        return next((r for r in records if version is None or r.version == version), None)

    def save_expert(self, expert: Expert) -> None:
        """Insert or update an expert record (status changes as training goes)."""
        row = _to_row(expert, _EXPERT_COLUMNS)
        row["corpus"] = [entry.model_dump() for entry in expert.corpus]
        self._upsert(t.experts, expert.agent, row)

    def expert(self, expert_id: str) -> Expert | None:
        with self._read_engine.connect() as conn:
            row = conn.execute(select(t.experts).where(t.experts.c.id == expert_id)).mappings().first()
        return None if row is None else _expert_from_row(row)

    def experts(self, agent: str | None = None, *, status: str | None = None) -> list[Expert]:
        c = t.experts.c
        query = select(t.experts).order_by(c.created_at, c.id)
        if agent is not None:
            query = query.where(c.agent == agent)
        if status is not None:
            query = query.where(c.status == status)
        with self._read_engine.connect() as conn:
            return [_expert_from_row(r) for r in conn.execute(query).mappings()]

    # -- the improver ---------------------------------------------------------------

    def save_job(self, job: Job) -> None:
        self._upsert(t.jobs, job.agent, {"id": job.id, **_to_row(job, _JOB_COLUMNS)})

    def job(self, job_id: str) -> Job | None:
        with self._read_engine.connect() as conn:
            row = conn.execute(select(t.jobs).where(t.jobs.c.id == job_id)).mappings().first()
        return None if row is None else _from_row(Job, row, _JOB_COLUMNS)

    def jobs(self, agent: str, cycle: str | None = None) -> list[Job]:
        c = t.jobs.c
        query = select(t.jobs).where(c.agent == agent).order_by(c.started_at, c.id)
        if cycle is not None:
            query = query.where(c.cycle == cycle)
        with self._read_engine.connect() as conn:
            return [_from_row(Job, r, _JOB_COLUMNS) for r in conn.execute(query).mappings()]

    def save_deployment(self, deployment: Deployment) -> None:
        deployment.updated_at = utcnow()
        self._upsert(t.deployments, deployment.agent, _to_row(deployment, _DEPLOYMENT_COLUMNS))

    def make_live(self, deployment: Deployment, *, retire: Deployment | None = None) -> None:
        """Store ``deployment`` as its agent's live one and supersede the one live before, in
        one transaction: a process killed during the switch leaves the old one live, never none.

        ``retire`` is stored in the same transaction with the status it carries (a rollback
        marks the deployment it replaces ``rolled_back``, with its reasons).
        """
        now = utcnow()
        c = t.deployments.c
        with self.engine.begin() as conn:
            if retire is not None:
                retire.updated_at = now
                self._upsert_row(conn, t.deployments, retire.agent, _to_row(retire, _DEPLOYMENT_COLUMNS))
            conn.execute(
                update(t.deployments)
                .where(c.agent == deployment.agent, c.status == "live", c.id != deployment.id)
                .values(status="superseded", updated_at=now)
            )
            row = {**_to_row(deployment, _DEPLOYMENT_COLUMNS), "status": "live", "updated_at": now}
            self._upsert_row(conn, t.deployments, deployment.agent, row)
        deployment.status, deployment.updated_at = "live", now

    def deployments(self, agent: str, *, status: str | None = None) -> list[Deployment]:
        """An agent's deployments, oldest first."""
        c = t.deployments.c
        query = select(t.deployments).where(c.agent == agent).order_by(c.created_at, c.id)
        if status is not None:
            query = query.where(c.status == status)
        with self._read_engine.connect() as conn:
            return [_from_row(Deployment, r, _DEPLOYMENT_COLUMNS) for r in conn.execute(query).mappings()]

    def outcome_windows(
        self, agent: str, starts: Sequence[datetime | None], *, last: int | None = None
    ) -> list[OutcomeWindow]:
        """Per period, ``agent``'s finished episodes with an outcome, in one query.

        ``starts`` (ascending) open the periods: each runs until the next start, the last one
        open-ended, and a None first start reaches back to the first episode. Successes are
        counted among each period's ``last`` latest episodes (all of them without ``last``).
        """
        e = t.episodes.c
        opened = [(e.started_at >= start, i) for i, start in reversed(list(enumerate(starts))) if start]
        period = case(*opened, else_=0) if opened else literal(0)
        where = [e.started_at >= starts[0]] if starts and starts[0] is not None else []
        return self._windows(agent, period, len(starts) or 1, where, last)

    def arm_outcomes(
        self, agent: str, since: datetime, router: str, *, last: int | None = None
    ) -> tuple[OutcomeWindow, OutcomeWindow]:
        """``agent``'s finished episodes with an outcome since ``since``: those the router
        version ``router`` served (a canary's candidate), and the rest; successes among the
        ``last`` latest of each."""
        e = t.episodes.c
        rest, served = self._windows(
            agent, case((e.router == router, 1), else_=0), 2, [e.started_at >= since], last
        )
        return served, rest

    def _windows(
        self, agent: str, group: Any, groups: int, where: list[Any], last: int | None
    ) -> list[OutcomeWindow]:
        """``agent``'s finished episodes with an outcome (and ``where``), per value of
        ``group`` (an integer expression in ``range(groups)``), the successes counted among
        each group's ``last`` latest; one query."""
        e = t.episodes.c
        outcome = outcome_clauses(e.label, e.reward)
        inner = (
            select(
                group.label("part"),
                case((outcome.success, 1), else_=0).label("ok"),
                func.row_number()
                .over(partition_by=group, order_by=(e.started_at.desc(), e.id.desc()))
                .label("rank"),
            )
            .where(e.agent == agent, e.status != "running", outcome.success | outcome.failure, *where)
            .subquery()
        )
        recent = inner.c.rank <= last if last is not None else inner.c.rank > 0
        totals = select(
            inner.c.part,
            func.count(),
            func.sum(case((recent, 1), else_=0)),
            func.sum(case((recent, inner.c.ok), else_=0)),
        ).group_by(inner.c.part)
        windows = [OutcomeWindow(0, 0, 0) for _ in range(groups)]
        with self._read_engine.connect() as conn:
            for index, labeled, in_recent, successes in conn.execute(totals):
                windows[index] = OutcomeWindow(labeled, int(in_recent or 0), int(successes or 0))
        return windows

    def _upsert(self, table: t.Table, agent: str, row: dict[str, Any]) -> None:
        """Update the row with this primary key, or insert it (the agent row first)."""
        with self.engine.begin() as conn:
            self._upsert_row(conn, table, agent, row)

    def _upsert_row(self, conn: Connection, table: t.Table, agent: str, row: dict[str, Any]) -> None:
        key = table.primary_key.columns.values()[0]
        conn.execute(self._insert_ignore(t.agents), [{"name": agent, "created_at": utcnow()}])
        if not conn.execute(table.update().where(key == row[key.name]), row).rowcount:
            conn.execute(table.insert(), row)

    def count(self, table: str) -> int:
        with self._read_engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(t.metadata.tables[table])).scalar_one()

    def stats(self) -> list[AgentStats]:
        """Per agent: episodes, how many have an outcome, successes and mean reward.

        Success is the one rule of ``trace_plugin.records.outcome``, as SQL.
        """
        e = t.episodes.c
        outcome = outcome_clauses(e.label, e.reward)
        query = (
            select(
                e.agent,
                func.count(),
                func.sum(case((e.status != "running", 1), else_=0)),
                func.sum(case((~outcome.unknown, 1), else_=0)),
                func.sum(case((outcome.success, 1), else_=0)),
                func.avg(e.reward),
            )
            .group_by(e.agent)
            .order_by(e.agent)
        )
        with self._read_engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            AgentStats(a, n, int(fin or 0), int(out or 0), int(ok or 0), avg)
            for a, n, fin, out, ok, avg in rows
        ]


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
