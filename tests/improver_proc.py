"""A real improver process on a tiny budget, for tests that kill it (see test_improver_restarts).

An optional fourth argument names a point where the process prints ``paused at POINT``
and waits to be killed, so that a kill aimed there cannot land anywhere else:

- ``STAGE:done``: that stage's job is recorded done;
- ``synthesize:stored``: the environment is stored, its job not yet done;
- ``train:checkpoint``: training wrote its first checkpoint;
- ``evaluate:played``: the evaluation played its first held-out episodes;
- ``deploy:commit``: inside the transaction that makes the deployment live, before its commit.

Every optimizer step prints ``trained step N``, so a test sees where training resumed.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.engine import Connection
from transformers import TrainerCallback

import training.executors
from trace_plugin.environments.base import RewardBreakdown
from trace_plugin.environments.runner import EpisodeResult
from trace_plugin.improver import Deployed, Improver, ImproverConfig, Synthesized
from trace_plugin.recorder import Recorder
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec
from trace_plugin.store import Store
from trace_plugin.store import tables as t
from training.experts import ExpertTrainer

db, gateway_url, adapter_root = sys.argv[1:4]
pause_at = sys.argv[4] if len(sys.argv) > 4 else None


def pause(point: str) -> None:
    """Stop for good at ``point`` when it is the one asked for: the test kills the process."""
    if point == pause_at:
        print("paused at", point, flush=True)
        time.sleep(3600)


class Steps(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print("trained step", state.global_step, flush=True)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pause("train:checkpoint")  # TRL calls it once the checkpoint is complete


def hashed_rewards(env_factory: Callable[[], Any]) -> Callable[[], Any]:
    """The environment with a reward that differs from answer to answer, so every group
    has a gradient and the expert is never a no-op the improver would skip: a restart test
    needs an expert to evaluate and deploy, whatever it learned."""

    def make() -> Any:
        env = env_factory()
        env.reward = lambda answer="": RewardBreakdown(
            int(hashlib.sha256(answer.encode()).hexdigest(), 16) % 1000 / 1000
        )
        return env

    return make


class ReportingTrainer(ExpertTrainer):
    def __init__(self, config: Any, env_factory: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        kwargs["levels"] = [hashed_rewards(level) for level in kwargs.get("levels", ())]  # GRPO plays these
        super().__init__(config, hashed_rewards(env_factory), *args, **kwargs, callbacks=[Steps()])


training.executors.ExpertTrainer = ReportingTrainer  # what the local executor trains with


class PausingImprover(Improver):
    deploying: str | None = None  # the deployment deploy is switching to
    stage: str | None = None  # the stage whose job runs now

    async def run_job(self, cycle: str, stage: str, key: str, work: Callable[[], Any]) -> Any:
        self.stage = stage
        outputs = await super().run_job(cycle, stage, key, work)
        pause(f"{stage}:done")
        return outputs

    async def synthesize(self, capability: str) -> Synthesized:
        outputs = await super().synthesize(capability)
        pause("synthesize:stored")
        return outputs

    async def play_spec(self, spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        results = await super().play_spec(spec, model, seeds)
        if self.stage == "evaluate":  # the screen plays environments too
            pause("evaluate:played")
        return results

    async def deploy(self, deployment: Deployment) -> Deployed:
        self.deploying = deployment.id
        return await super().deploy(deployment)


config = ImproverConfig(
    agent="planted",
    gateway_url=gateway_url,
    adapter_root=Path(adapter_root),
    target="retail",
    target_seeds=[10_000, 10_001],
    min_new_episodes=0,
    max_experts=1,
    calibrate=False,
    eval_seeds=2,
    margin=-1.0,  # accept whatever comes out: these tests are about restarts, not quality
    tolerance=1.0,
    train_with_examples=False,
    max_tokens=24,
    lease_ttl=2.0,
    training={
        "num_generations": 2,
        "rollout_budget": 4,
        "max_completion_length": 16,
        "max_turns": 2,
        "checkpoint_every": 1,
        "warm_start_plays": 2,  # the warm start runs, and resumes, inside the improver too
        "warm_start_epochs": 1,
        "warm_start_batch_size": 2,
    },
)
store, recorder = Store(db), Recorder(db)
improver = PausingImprover(store, config, recorder=recorder)


@event.listens_for(store.engine, "commit")
def before_commit(conn: Connection) -> None:
    """Pause in the transaction that leaves the new deployment live (as it sees it), uncommitted."""
    if improver.deploying is not None:
        c = t.deployments.c
        if conn.execute(select(c.id).where(c.id == improver.deploying, c.status == "live")).first():
            pause("deploy:commit")


deployment = improver.run_once(wait=60)
recorder.close()
print("deployed", deployment.id if deployment else None, flush=True)
