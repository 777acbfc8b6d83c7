"""The dashboard's read queries: filtered episode pages, success per time bucket, and the
tables of later stages when a migration has created them.

``Store`` answers the CLI's questions; the dashboard needs filters, counts and buckets the
CLI does not, so they live here, on the store's engine, in SQL that both dialects run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from sqlalchemy import ColumnElement, Engine, MetaData, Table, case, func, inspect, select
from sqlalchemy.engine import Connection

from trace_plugin.records.outcome import Outcome, outcome_clauses, outcome_of
from trace_plugin.records.router_spec import router_version
from trace_plugin.records.trajectory import EpisodeStatus
from trace_plugin.store import tables as t
from trace_plugin.store.store import EpisodeFilter

Bucket = Literal["minute", "hour", "day"]
BUCKET_STEPS: dict[Bucket, timedelta] = {
    "minute": timedelta(minutes=1),
    "hour": timedelta(hours=1),
    "day": timedelta(days=1),
}
MAX_BUCKETS = 180  # the finest bucket whose count over the data's range stays within this
CANARY_SERIES = " · canary"  # appended to an agent's name for the traffic its canary served
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
STATUSES: tuple[str, ...] = get_args(EpisodeStatus)
# Tables later stages will add; the dashboard shows them once a migration creates them.
STAGE_TABLES = ("env_specs", "experts", "deployments")

_e = t.episodes.c
# The one success rule (``trace_plugin.records.outcome``), as SQL over the episodes table.
_OUTCOME = outcome_clauses(_e.label, _e.reward)
SUCCESS, FAILURE, UNKNOWN = _OUTCOME.success, _OUTCOME.failure, _OUTCOME.unknown
_OUTCOME_CLAUSES: dict[Outcome, ColumnElement[bool]] = {
    "success": SUCCESS,
    "failure": FAILURE,
    "unknown": UNKNOWN,
}


def aware(value: Any) -> Any:
    """SQLite hands datetimes back naive; everything stored is UTC."""
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


@dataclass(frozen=True, slots=True)
class EpisodeRow:
    """One line of the episode list: the columns, not the payloads."""

    id: str
    agent: str
    source: str
    status: str
    reward: float | None
    label: str | None
    error: str | None
    model: str | None
    adapter: str | None
    router: str | None
    started_at: datetime
    ended_at: datetime | None

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.label, self.reward)


@dataclass(frozen=True, slots=True)
class Facets:
    """The values each filter can take, read from the data."""

    agents: list[str]
    sources: list[str]
    adapters: list[str]
    routers: list[str]


@dataclass(frozen=True, slots=True)
class BucketStat:
    """Episodes with an outcome that started in one time bucket, and how many succeeded."""

    agent: str
    start: datetime
    with_outcome: int
    successes: int

    @property
    def rate(self) -> float:
        return self.successes / self.with_outcome


@dataclass(frozen=True, slots=True)
class Marker:
    """A labelled instant drawn across the success plot (a deployment)."""

    at: datetime
    label: str


@dataclass(frozen=True, slots=True)
class StageTable:
    """The newest rows of a later stage's table, shown as they are."""

    name: str
    columns: list[str]
    rows: list[list[Any]]


_LIST_COLUMNS = [
    _e.id,
    _e.agent,
    _e.source,
    _e.status,
    _e.reward,
    _e.label,
    _e.error,
    _e.model,
    _e.adapter,
    _e.router,
    _e.started_at,
    _e.ended_at,
]


def list_episodes(engine: Engine, where: EpisodeFilter, *, limit: int, offset: int) -> list[EpisodeRow]:
    """A page of episodes, newest first."""
    query = (
        select(*_LIST_COLUMNS)
        .where(*where.clauses())
        .order_by(_e.started_at.desc(), _e.id)
        .limit(limit)
        .offset(offset)
    )
    with engine.connect() as conn:
        return [EpisodeRow(*(aware(v) for v in row)) for row in conn.execute(query)]


def count_episodes(engine: Engine, where: EpisodeFilter) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(t.episodes).where(*where.clauses())).scalar_one()


def facets(engine: Engine) -> Facets:
    with engine.connect() as conn:

        def distinct(column: Any) -> list[str]:
            query = select(column).distinct().where(column.is_not(None)).order_by(column)
            return list(conn.execute(query).scalars())

        return Facets(
            distinct(t.agents.c.name), distinct(_e.source), distinct(_e.adapter), distinct(_e.router)
        )


_SQLITE_TRUNCATE: dict[Bucket, str] = {
    "minute": "%Y-%m-%d %H:%M:00",
    "hour": "%Y-%m-%d %H:00:00",
    "day": "%Y-%m-%d 00:00:00",
}


def fitting_bucket(
    engine: Engine, *, agent: str | None = None, since: datetime | None = None, until: datetime | None = None
) -> Bucket:
    """The finest bucket that splits the filtered episodes' time range into at most
    ``MAX_BUCKETS``: a one-hour run gets minutes, so before and after a deployment show."""
    where = EpisodeFilter(agent=agent, since=since, until=until).clauses()
    query = select(func.min(_e.started_at), func.max(_e.started_at)).where(~UNKNOWN, *where)
    with engine.connect() as conn:
        first, last = conn.execute(query).one()
    if first is None:
        return "day"
    span = aware(_as_datetime(last)) - aware(_as_datetime(first))
    return next((b for b, step in BUCKET_STEPS.items() if span / step <= MAX_BUCKETS), "day")


def success_buckets(
    engine: Engine,
    bucket: Bucket,
    *,
    agent: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    canaries: Sequence[str] = (),
) -> list[BucketStat]:
    """Per agent and UTC minute, hour or day: the episodes with an outcome and their
    successes. Episodes served by one of the ``canaries`` router versions (a deployment on
    trial) form their own series, ``AGENT · canary``."""
    if engine.dialect.name == "postgresql":
        start: ColumnElement[Any] = func.date_trunc(bucket, func.timezone("UTC", _e.started_at))
    else:  # SQLite keeps naive UTC text, which strftime truncates
        start = func.strftime(_SQLITE_TRUNCATE[bucket], _e.started_at)
    where = EpisodeFilter(agent=agent, since=since, until=until).clauses()
    series = (
        case((_e.router.in_(canaries), _e.agent + CANARY_SERIES), else_=_e.agent) if canaries else _e.agent
    )
    # Bucket in a subquery: PostgreSQL would see date_trunc's two bound units as two expressions.
    inner = (
        select(
            series.label("agent"),
            start.label("start"),
            case((SUCCESS, 1), else_=0).label("success"),
        )
        .where(~UNKNOWN, *where)
        .subquery()
    )
    query = (
        select(inner.c.agent, inner.c.start, func.count(), func.sum(inner.c.success))
        .group_by(inner.c.agent, inner.c.start)
        .order_by(inner.c.agent, inner.c.start)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [BucketStat(a, aware(_as_datetime(s)), int(n), int(ok or 0)) for a, s, n, ok in rows]


def _reflect(conn: Connection, name: str) -> Table | None:
    """The table as the database has it, or None before its migration exists."""
    if not inspect(conn).has_table(name):
        return None
    return Table(name, MetaData(), autoload_with=conn)


def _first(table: Table, names: tuple[str, ...]) -> Any:
    return next((table.c[n] for n in names if n in table.c), None)


_TIME_COLUMNS = ("created_at", "started_at", "mined_at")


def deployment_markers(engine: Engine, agent: str | None = None) -> list[Marker]:
    """Every deployment that took traffic (live, superseded or rolled back), as plot markers."""
    d = t.deployments.c
    query = (
        select(d.created_at, d.id, d.status).where(d.status != "rejected").order_by(d.created_at).limit(500)
    )
    if agent is not None:
        query = query.where(d.agent == agent)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [Marker(aware(_as_datetime(at)), f"{ident} ({status})") for at, ident, status in rows]


def canary_routers(engine: Engine, agent: str | None = None) -> list[str]:
    """The router versions of the deployments on trial: the episodes they serve are the
    canary series."""
    d = t.deployments.c
    query = select(d.router).where(d.status == "canary")
    if agent is not None:
        query = query.where(d.agent == agent)
    with engine.connect() as conn:
        return [router_version(spec) for spec in conn.execute(query).scalars()]


def _as_datetime(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


def stage_tables(engine: Engine, agent: str | None, limit: int = 20) -> list[StageTable]:
    """The newest rows of each later-stage table that exists, for the agent when it has one."""
    found = []
    with engine.connect() as conn:
        for name in STAGE_TABLES:
            table = _reflect(conn, name)
            if table is None:
                continue
            query = select(table).limit(limit)
            if agent is not None and "agent" in table.c:
                query = query.where(table.c.agent == agent)
            newest = _first(table, _TIME_COLUMNS)
            if newest is not None:
                query = query.order_by(newest.desc())
            rows = [[aware(v) for v in row] for row in conn.execute(query)]
            found.append(StageTable(name, list(table.c.keys()), rows))
    return found


@dataclass(frozen=True, slots=True)
class MiningRun:
    id: str
    mined_at: datetime


def capability_agents(engine: Engine) -> list[str]:
    c = t.capabilities.c
    with engine.connect() as conn:
        return list(conn.execute(select(c.agent).distinct().order_by(c.agent)).scalars())


def mining_runs(engine: Engine, agent: str) -> list[MiningRun]:
    """The agent's mining passes, newest first."""
    c = t.capabilities.c
    mined = func.max(c.mined_at)
    query = select(c.mining_run, mined).where(c.agent == agent).group_by(c.mining_run).order_by(mined.desc())
    with engine.connect() as conn:
        return [MiningRun(run, aware(_as_datetime(at))) for run, at in conn.execute(query)]


def improver_agents(engine: Engine) -> list[str]:
    """The agents an improver has worked on: those with a job or a deployment."""
    j, d = t.jobs.c, t.deployments.c
    query = select(j.agent).union(select(d.agent))
    with engine.connect() as conn:
        return sorted(conn.execute(query).scalars())


def episodes_per_router(engine: Engine, agent: str, since: datetime | None = None) -> dict[str, int]:
    """How many of the agent's episodes each router version chose the adapters of (since
    ``since``): what each deployment served."""
    where = [_e.agent == agent, _e.router.is_not(None)]
    if since is not None:
        where.append(_e.started_at >= since)
    query = select(_e.router, func.count()).where(*where).group_by(_e.router)
    with engine.connect() as conn:
        return {router: int(n) for router, n in conn.execute(query)}
