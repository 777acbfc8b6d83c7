"""The store's improver half: capabilities, environment specs, experts, the job ledger,
deployments and their outcome windows."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, case, func, literal, select, update
from sqlalchemy.engine import Connection

from trace_plugin.records.capability import Capability
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec, SpecRecord
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job
from trace_plugin.records.outcome import outcome_clauses
from trace_plugin.records.trajectory import utcnow
from trace_plugin.store import tables as t
from trace_plugin.store.rows import (
    _CAPABILITY_COLUMNS,
    _DEPLOYMENT_COLUMNS,
    _EXPERT_COLUMNS,
    _JOB_COLUMNS,
    OutcomeWindow,
    _aware,
    _expert_from_row,
    _from_row,
    _to_row,
)


class ImproverRecords:
    """What the improver keeps (a part of ``Store``: its engines)."""

    engine: Engine
    _read_engine: Engine

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
