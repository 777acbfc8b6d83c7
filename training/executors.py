"""Where experts train: in this process (the default) or in parallel on a Ray cluster.

A ``TrainingJob`` is plain data (the environment as a spec, seeds, the config as a
dict), so it can be shipped to another process or machine; ``run_job`` is what runs
on the other end. The Ray executor gives each expert one slot (a GPU where asked, else
CPUs): users who outgrow one machine point ``address`` at their cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trace_plugin.environments.interpreter import SpecEnv, worked_example
from trace_plugin.environments.validation import levels, plain_level, plainly_asked
from trace_plugin.export import Conversation
from trace_plugin.records.env_spec import EnvSpec
from training.config import ExpertTrainingConfig
from training.experts import ExpertResult, ExpertTrainer


@dataclass(frozen=True)
class TrainingJob:
    spec: dict[str, Any]  # the EnvSpec, as JSON data
    seeds: list[int]
    config: dict[str, Any]  # ExpertTrainingConfig fields; output_dir names the adapter's final place
    model: str | None = None  # local model dir; None is the embedded default
    examples: list[dict[str, Any]] = field(default_factory=list)  # the agent's few-shot context
    exclude: list[str] = field(default_factory=list)  # task keys of evaluated tasks: no warm-start play
    rehearsal: list[Conversation] = field(default_factory=list)  # the deployed agent's successes, as served
    progress: bool = True


def run_job(job: TrainingJob) -> ExpertResult:
    return job_trainer(job).train()


def job_trainer(job: TrainingJob) -> ExpertTrainer:
    """The trainer ``job`` describes: the warm start plays the spec's tasks asked plainly
    (``plainly_asked``), and GRPO climbs the spec's levels from the first so asked at or
    above the spec's own (from the spec's own, and never below it, without a warm start)."""
    spec = EnvSpec.model_validate(job.spec)
    config = ExpertTrainingConfig(**job.config)
    ladder, start = levels(spec)
    return ExpertTrainer(
        config,
        lambda: SpecEnv(spec),
        job.seeds,
        model=job.model,
        hint=worked_example(spec) or spec.hint,
        examples=job.examples,
        exclude=job.exclude,
        rehearsal=job.rehearsal,
        levels=[lambda level=level: SpecEnv(level) for level in ladder],
        start_level=start,
        warm_level=plain_level(ladder, start),
        warm_start_env=lambda: SpecEnv(plainly_asked(spec)),
        progress=job.progress,
    )


class Executor(Protocol):
    def run(self, jobs: Sequence[TrainingJob]) -> list[ExpertResult]: ...


class LocalExecutor:
    """One expert after another, in this process."""

    def run(self, jobs: Sequence[TrainingJob]) -> list[ExpertResult]:
        return [run_job(job) for job in jobs]


class RayExecutor:
    """Every expert at once on a Ray cluster (a local one when ``address`` is None)."""

    def __init__(self, address: str | None = None, *, num_cpus: float = 1, num_gpus: float = 0) -> None:
        self.address, self.num_cpus, self.num_gpus = address, num_cpus, num_gpus

    def run(self, jobs: Sequence[TrainingJob]) -> list[ExpertResult]:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
        remote = ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=0)(run_job)
        return ray.get([remote.remote(job) for job in jobs])
