"""A real improver process on a tiny budget, for tests that kill it (see test_improver_restarts).

An optional fourth argument names a stage after which the process stops and waits to be
killed, so that a kill aimed at that stage cannot land after the cycle has moved on.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from trace_plugin.improver import Improver, ImproverConfig
from trace_plugin.recorder import Recorder
from trace_plugin.store import Store

db, gateway_url, adapter_root = sys.argv[1:4]
pause_after = sys.argv[4] if len(sys.argv) > 4 else None


class PausingImprover(Improver):
    async def _job(self, cycle, stage, key, work):
        outputs = await super()._job(cycle, stage, key, work)
        if stage == pause_after:
            await asyncio.sleep(3600)
        return outputs


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
    },
)
recorder = Recorder(db)
deployment = PausingImprover(Store(db), config, recorder=recorder).run_once(wait=60)
recorder.close()
print("deployed", deployment.id if deployment else None, flush=True)
