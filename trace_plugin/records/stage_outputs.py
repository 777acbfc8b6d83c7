"""What each stage of a cycle hands the next: typed, and stored as a dict in its job row.

A stage returns one of these dataclasses; ``Output.to_dict`` is what ``Job.outputs``
holds (the store speaks only plain records), and ``Output.from_dict`` is what a resumed
cycle reads back, so a stage that finished before a kill is never run again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from trace_plugin.records.router_spec import RouterSpec, parse_router_spec

T = TypeVar("T", bound="Output")
OMIT_NONE = {"omit_none": True}  # a field left out of the stored dict when it is None


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields(value)
            if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)
        }
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class Output:
    """A stage's result (or a part of one): a dataclass stored as ``Job.outputs``."""

    stage: ClassVar[str]  # the stage that returns it, for the top-level ones

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        return cls(**data)


@dataclass(frozen=True)
class Mined(Output):
    """Which capabilities mining selected, which the live deployment covers, and the rest,
    best first: the cycle trains up to ``max_experts`` of them."""

    stage: ClassVar[str] = "mine"
    selected: list[str]
    covered: list[str]
    train: list[str]
    mining_run: str | None = field(default=None, metadata=OMIT_NONE)  # the pass whose rows it read


@dataclass(frozen=True)
class Synthesized(Output):
    """The environment a capability's expert trains in, and whether it may.

    An ``out_of_band`` environment trains: its band was measured on the base model, while
    GRPO trains the warm-started expert, which its reference plays lift into the band. Only
    a broken one (``rejected``) or none at all does not; whether the live agent still fails
    it is the screen's question (``Screened``)."""

    stage: ClassVar[str] = "synthesize"
    TRAINABLE: ClassVar[tuple[str, ...]] = ("validated", "out_of_band")
    env: str
    version: int
    status: str  # an env spec's status, or "unsynthesizable": no environment could be built
    reason: str = ""  # why not, when it was not built

    @property
    def trainable(self) -> bool:
        return self.status in self.TRAINABLE


@dataclass(frozen=True)
class Screened(Output):
    """The live agent in a capability's new environment, before anything is trained for it:
    a capability is trained only where the agent as it serves now still fails."""

    stage: ClassVar[str] = "screen"
    served: str  # the model name the live agent was played as ("base" when nothing is live)
    success: float  # on the environment's held-out seeds
    mean_reward: float
    train: bool  # success below the config's retrain_below


@dataclass(frozen=True)
class Trained(Output):
    """An expert the cycle trained: ``GatewayAdmin.ensure_adapter(adapter_name, adapter)``
    loads it into a gateway whatever the cycle then made of it."""

    stage: ClassVar[str] = "train"
    expert: str  # the expert's id
    adapter: str  # its adapter directory
    reward_curve: list[float]
    unhinted_curve: list[float | None] = field(default_factory=list)  # absent from older jobs
    noop: bool = False  # no gradient reached its adapter: it is the base model
    adapter_name: str = ""  # the name it is served under; absent from older jobs
    warm_start_plays: int | None = None  # the reference plays its warm start used; absent from older jobs
    level: int | None = None  # the highest difficulty level GRPO reached (None: one level, or older)
    informative_group_frac: float | None = None  # GRPO's groups with un-hinted signal, over its steps


@dataclass(frozen=True)
class GateFit(Output):
    """How a learned gate was fitted: on how many practice tasks, and which choice won them."""

    tasks: int
    labels: dict[str, int]


@dataclass(frozen=True)
class Routing(Output):
    """The candidate router; for a learned gate, how it was fitted."""

    stage: ClassVar[str] = "route"
    router: RouterSpec
    gate: GateFit | None = field(default=None, metadata=OMIT_NONE)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Routing:
        gate = data.get("gate")
        return cls(parse_router_spec(data["router"]), GateFit.from_dict(gate) if gate else None)


@dataclass(frozen=True)
class Scores(Output):
    """One capability's mean reward on its held-out seeds."""

    base: float
    current: float  # the live deployment (the base model when there is none)
    candidate: float


@dataclass(frozen=True)
class Summary(Output):
    """Episodes of one model on the target's tasks: how many, the success rate, by task kind."""

    stage: ClassVar[str] = "target"
    n: int
    success: float
    by_kind: dict[str, float]
    episodes: list[dict[str, Any]]


@dataclass(frozen=True)
class TargetScores(Output):
    current: Summary
    candidate: Summary

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetScores:
        return cls(Summary.from_dict(data["current"]), Summary.from_dict(data["candidate"]))


@dataclass(frozen=True)
class Evaluation(Output):
    """The candidate against the live deployment: per capability, and on the target."""

    stage: ClassVar[str] = "evaluate"
    adapters: dict[str, str]  # capability -> served name, the live experts and this cycle's
    router: RouterSpec
    capabilities: dict[str, Scores]
    target: TargetScores | None = field(default=None, metadata=OMIT_NONE)
    # The target success of the routers the gate chose ``router`` from ({"top_p", "top1"}),
    # when it had a choice; empty otherwise.
    compared: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evaluation:
        target = data.get("target")
        return cls(
            dict(data["adapters"]),
            parse_router_spec(data["router"]),
            {c: Scores.from_dict(s) for c, s in data["capabilities"].items()},
            TargetScores.from_dict(target) if target is not None else None,
            dict(data.get("compared", {})),
        )


@dataclass(frozen=True)
class Verdict(Output):
    """Whether the candidate may take the traffic, and if not, why not."""

    stage: ClassVar[str] = "verdict"
    accept: bool
    reasons: list[str]


@dataclass(frozen=True)
class Deployed(Output):
    stage: ClassVar[str] = "deploy"
    deployment: str


@dataclass(frozen=True)
class CycleEnd(Output):
    """What a cycle came to: the deployment it made, or None and why; and either way the
    experts it trained (no-ops included) and the candidate router it composed of them, so
    that a candidate the gate rejected, or an expert no candidate was composed of, can be
    tried by hand."""

    stage: ClassVar[str] = "cycle"
    deployed: str | None
    reason: str | None = field(default=None, metadata=OMIT_NONE)
    trained: dict[str, Trained] = field(default_factory=dict)  # capability -> its expert
    router: RouterSpec | None = field(default=None, metadata=OMIT_NONE)
    # capability -> the live agent's success in its new environment, trained or not
    live_scores: dict[str, float] = field(default_factory=dict)
    passed_over: dict[str, str] = field(default_factory=dict)  # capability -> why it was not trained

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CycleEnd:
        router = data.get("router")
        return cls(
            data["deployed"],
            data.get("reason"),
            {c: Trained.from_dict(t) for c, t in data.get("trained", {}).items()},
            parse_router_spec(router) if router is not None else None,
            dict(data.get("live_scores", {})),
            dict(data.get("passed_over", {})),
        )


# What a done job of each stage holds, for a resumed cycle to read back.
OUTPUTS: dict[str, type[Output]] = {
    o.stage: o
    for o in (
        *(Mined, Synthesized, Screened, Trained, Routing),
        *(Evaluation, Verdict, Deployed, Summary, CycleEnd),
    )
}
