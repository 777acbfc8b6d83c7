"""A deployment: the experts and router version an agent is served with, and why.

Every improvement cycle that reaches the verdict records one: ``rejected`` (with the verdict's
reasons) or ``live``. A new live deployment supersedes the previous one; a rollback marks
it ``rolled_back`` and brings the previous one back. The gateway stamps the adapter
version on every episode it serves, which is what monitoring compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypedDict

from trace_plugin.records.trajectory import utcnow

# "canary": on trial, serving a share of the traffic beside the live one until the monitor
# promotes it (live) or rolls it back.
DeploymentStatus = Literal["live", "canary", "rejected", "superseded", "rolled_back"]


class CanaryTrial(TypedDict, total=False):
    """A canary's trial: the share of the traffic it was sent, and once the monitor judged
    it, how it ended."""

    share: float
    outcome: Literal["promoted", "rolled_back"]


@dataclass(slots=True)
class Deployment:
    id: str  # the cycle that produced it ("baseline" for the base model)
    agent: str
    status: DeploymentStatus
    adapters: dict[str, str] = field(default_factory=dict)  # capability -> name@version
    router: dict[str, Any] = field(default_factory=dict)  # the router spec the gateway runs
    evaluation: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    canary: CanaryTrial | None = None  # set when it went out as a canary
    created_at: datetime = field(default_factory=utcnow)
    updated_at: datetime = field(default_factory=utcnow)

    def end_trial(self, outcome: Literal["promoted", "rolled_back"]) -> None:
        """Record how its canary trial ended; the status is the caller's to set."""
        self.canary = {**(self.canary or {}), "outcome": outcome}
