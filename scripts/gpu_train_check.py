"""Train one expert briefly with vLLM generation (TRL colocate mode) on a GPU machine.

Prints rollouts/s and the reward curve. Needs the ``vllm`` and ``train`` extras and a GPU.
Usage: scripts/gpu_train_check.sh [MODEL_DIR]  (default: the embedded SmolLM2-135M)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import POLICY, TOOLS
from trace_plugin.environments.synthesis import synthesize
from training.config import ExpertTrainingConfig
from training.experts import ExpertTrainer


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)
    config = ExpertTrainingConfig.preset(
        "gpu", rollout_budget=64 * 8, output_dir=tempfile.mkdtemp() + "/tool_call_format"
    )
    started = time.monotonic()
    result = ExpertTrainer(
        config, lambda: SpecEnv(spec), list(range(2000)), model=model, hint=spec.hint
    ).train()
    seconds = time.monotonic() - started
    print(
        json.dumps(
            {
                "steps": result.steps,
                "rollouts_per_s": round(config.rollout_budget / seconds, 3),
                "reward_curve": [round(r, 3) for r in result.reward_curve],
                "adapter": str(result.adapter_dir),
            }
        )
    )


if __name__ == "__main__":
    main()
