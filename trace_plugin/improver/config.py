"""What the improver watches, how hard it trains, and how careful it deploys."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast, get_args

from trace_plugin.environments.catalog import TargetError, UnknownEnvironment, load_target
from trace_plugin.improver.errors import ConfigError
from training.config import ExpertTrainingConfig

HELD_OUT_SEEDS = range(3_000_000, 3_000_200)  # synthesized environments' evaluation seeds
GATE_SEEDS = range(4_000_000, 4_000_200)  # the practice tasks a learned gate is fitted on
CORPUS_SEEDS = range(5_000_000, 5_000_200)  # the reference plays a classifier's retrieval corpus holds
TRAINING_SEEDS = range(0, 2_000)
CALIBRATION_SEEDS_START = 2_000_000
Router = Literal["classifier", "top1", "gate"]
# Each arm of a canary must fill monitor_window episodes: a tiny share (or a tiny rest) never does.
MIN_CANARY_SHARE = 0.01


@dataclass
class ImproverConfig:
    """What the improver watches, how hard it trains, and how careful it deploys.

    ``training`` is the ``ExpertTrainingConfig`` experts train with;
    given as a mapping, it holds overrides of the ``preset`` (and becomes that config). The
    horizon (``max_turns``) and reply length (``max_completion_length``) are derived per
    environment, from the target's stated horizon and the environment's reference plays,
    unless ``training`` sets them (``pinned``): then they are honoured.

    ``target`` names a ``Target`` (or, with ``target_seeds``
    given, a synthesized environment). ``target_seeds`` are the tasks the verdict decides
    on, ``reported_seeds`` those ``live_summary``
    reports (the verdict's where none are given): a score on the tasks that let a
    deployment through flatters it. Given neither, the target's test seeds are split: the
    first ``target_tasks`` decide, the next ``target_tasks`` are reported
    (``target_seeds``), whether the improver plays them or an ``evaluator`` it was given does.

    A canary trial ends within ``canary_deadline`` seconds of going out, so that one that
    cannot fill its window does not hold the agent: past it, a trial whose arms each have
    at least half of ``monitor_window`` episodes is judged on those, and one with fewer is
    rolled back; its reasons say which.
    """

    agent: str
    gateway_url: str  # the gateway serving the agent (no /v1)
    adapter_root: Path  # the gateway's adapter root: experts are written under it
    admin_token: str | None = None
    target: str | None = None  # a registered target environment, for held-out evaluation
    target_seeds: Sequence[int] = ()  # its held-out tasks the verdict decides on
    target_tasks: int = 32  # given neither: how many of the target's test seeds decide, and are reported
    # Target tasks a report measures apart from the verdict's: no training task may be one.
    reported_seeds: Sequence[int] = ()
    # triggers
    min_new_episodes: int = 50  # labeled episodes since the last cycle
    max_failure_rate: float | None = None  # or: the recent failure rate reached this
    every_seconds: float | None = None  # or: a schedule
    # mining and synthesis
    max_experts: int = 2  # capabilities trained per cycle, best ranked first
    # Capabilities the agent may have experts for in all, over every cycle (None: no cap):
    # each one serves as an adapter, and each costs a cycle's training. Retraining a covered
    # capability adds none.
    max_capabilities: int | None = None
    calibrate: bool = True
    calibration_seeds: int = 8
    calibration_samples: int = 4
    calibration_attempts: int = 5
    # training
    preset: str = "cpu-small"
    training: ExpertTrainingConfig | Mapping[str, Any] = field(default_factory=dict)
    train_with_examples: bool = True  # behind the agent's own few-shot context, as it is served
    # That context (OpenAI messages): None takes the commonest one in the agent's traffic.
    # Set it where traffic mixes contexts, or to train behind other examples than it shows.
    examples: Sequence[Mapping[str, Any]] | None = None
    model: str | None = None  # local base model dir; None is the embedded default
    # routing: several experts are chosen by the base model as "classifier" (TRACE's: retrieved
    # candidates, a top-p weighted mixture), as "top1" (the classifier's single best), or by a
    # learned "gate"
    router: Router = "classifier"
    corpus_seeds: int = 8  # reference plays per environment in its retrieval corpus, its kinds in turn
    top_p: float = 0.9  # the classifier's nucleus
    gate_seeds: int = 16  # practice tasks per environment the gate is fitted on
    # evaluation, verdict, monitor
    eval_seeds: int = 16  # held-out seeds per synthesized environment
    margin: float = 0.0  # the candidate must beat the live one on the target by more than this
    tolerance: float = 0.05  # no capability may fall more than this
    retrain_below: float = 0.9  # a covered capability is retrained only when its expert scores below
    monitor_window: int = 50  # episodes compared when monitoring
    rollback_drop: float = 0.1  # roll back when live success falls this far below the previous
    # Deploy as a canary on this share of the traffic (None: switch all of it): the monitor
    # promotes it, or rolls it back when its success over monitor_window episodes falls
    # rollback_drop below the rest of the traffic's over the same time.
    canary: float | None = None
    canary_deadline: float = 86_400.0  # seconds a trial may take to fill its window
    max_tokens: int = 160
    lease_ttl: float = 30.0  # on SQLite, how long a killed improver keeps others out
    # The training settings ``training`` set, apart from the preset's: honoured where the
    # improver would otherwise derive them per environment.
    pinned: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        # Absolute: experts are loaded by their stored path, which a gateway would resolve
        # under its own adapter root were it relative.
        self.adapter_root = Path(self.adapter_root).resolve()
        if self.canary is not None and not MIN_CANARY_SHARE <= self.canary <= 1 - MIN_CANARY_SHARE:
            raise ConfigError(
                "canary",
                f"canary is a share of the traffic between {MIN_CANARY_SHARE} and {1 - MIN_CANARY_SHARE}"
                f" (each arm must fill monitor_window episodes), not {self.canary}",
            )
        if not self.canary_deadline > 0:
            raise ConfigError(
                "canary_deadline", f"canary_deadline is seconds, above 0, not {self.canary_deadline}"
            )
        if self.router not in get_args(Router):
            raise ConfigError("router", f"router must be one of {get_args(Router)}, not {self.router!r}")
        preset = ExpertTrainingConfig.preset(self.preset)
        if isinstance(self.training, ExpertTrainingConfig):
            self.pinned = frozenset(
                f.name for f in fields(preset) if getattr(self.training, f.name) != getattr(preset, f.name)
            )
        else:
            self.pinned = frozenset(self.training)
            self.training = ExpertTrainingConfig.preset(self.preset, **dict(self.training))
        if self.target is not None and not self.target_seeds and not self.reported_seeds:
            self.target_seeds, self.reported_seeds = target_seeds(self.target, self.target_tasks)
        elif self.target is not None and not self.target_seeds:
            raise ConfigError("target_seeds", "reported_seeds are given: name the verdict's tasks too")

    @property
    def expert_training(self) -> ExpertTrainingConfig:
        """``training`` as its type: ``__post_init__`` made it a config."""
        return cast(ExpertTrainingConfig, self.training)


def target_seeds(target: str, tasks: int) -> tuple[list[int], list[int]]:
    """The target's tasks when none are given: the verdict's, the first ``tasks`` test seeds
    of the target ``target`` (``load_target``), and
    the reported ones, the next ``tasks`` (half each where it has fewer than twice as many),
    with a warning when the target has more: a verdict on fewer tasks than a team wrote
    should not pass unseen."""
    try:
        seeds = list(load_target(target).test_seeds)
    except (UnknownEnvironment, TargetError) as exc:
        raise ConfigError("target", str(exc)) from exc
    if len(seeds) > 2 * tasks:
        warnings.warn(
            f"the improver decides on the first {tasks} of the {len(seeds)} test tasks of target {target!r}"
            f" and reports the next {tasks} (ImproverConfig.target_tasks, or target_seeds and"
            " reported_seeds to name them)",
            stacklevel=3,
        )
    deciding = min(tasks, max(1, len(seeds) // 2))
    return seeds[:deciding], seeds[deciding : deciding + tasks]
