"""Jobs: the improver's units of work, persisted so that a killed process resumes.

A job's id is ``cycle/stage/key`` (``key`` names the unit, e.g. one capability's
training), so the same work is never recorded, nor done, twice: a ``done`` job hands back
its outputs, a ``running`` one whose process died is simply run again, and every stage is
written to be idempotent when re-run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from trace_plugin.records.trajectory import utcnow

JobStatus = Literal["running", "done", "failed"]


@dataclass(slots=True)
class Job:
    agent: str
    cycle: str
    stage: str
    key: str
    status: JobStatus = "running"
    attempts: int = 1
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] | None = None
    error: str | None = None
    started_at: datetime = field(default_factory=utcnow)
    ended_at: datetime | None = None

    @property
    def id(self) -> str:
        return job_id(self.cycle, self.stage, self.key)

    @property
    def seconds(self) -> float | None:
        return (self.ended_at - self.started_at).total_seconds() if self.ended_at else None


def job_id(cycle: str, stage: str, key: str) -> str:
    return f"{cycle}/{stage}/{key}"
