"""The store's trajectory half: batched writes of capture records, and the reads of
episodes, steps, tool schemas and feedback."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from operator import attrgetter
from typing import Any

import orjson
from sqlalchemy import Engine, case, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from trace_plugin.records.outcome import outcome_clauses
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step, utcnow
from trace_plugin.store import tables as t
from trace_plugin.store.rows import (
    _APPLY_FEEDBACK,
    _END_EPISODE,
    _EPISODE_COLUMNS,
    _FEEDBACK_COLUMNS,
    _STEP_COLUMNS,
    AgentStats,
    EpisodeFilter,
    Record,
    _add_steps,
    _add_tools,
    _as_dict,
    _column_fitter,
    _end_row,
    _episode_from_row,
    _feedback_row,
    _fit,
    _fold_ends,
    _from_row,
    _json_column,
    _sqlite_datetime_column,
    _tool_name,
    tool_hash,
)


class EpisodeRecords:
    """Writes and reads of trajectories (a part of ``Store``: its engines and caches)."""

    engine: Engine
    _read_engine: Engine
    _known_agents: set[str]
    _known_tools: set[str]
    _hashes: dict[bytes, str]

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
