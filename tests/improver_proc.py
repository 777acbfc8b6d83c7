"""A real improver process on a tiny budget, for tests that kill it (see test_improver_restarts)."""

from __future__ import annotations

import sys
from pathlib import Path

from trace_plugin.improver import Improver, ImproverConfig
from trace_plugin.recorder import Recorder
from trace_plugin.store import Store

db, gateway_url, adapter_root = sys.argv[1:4]
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
deployment = Improver(Store(db), config, recorder=recorder).run_once(wait=60)
recorder.close()
print("deployed", deployment.id if deployment else None, flush=True)
