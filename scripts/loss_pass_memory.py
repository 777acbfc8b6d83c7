"""Peak resident memory of one GRPO loss pass, forward and backward: a group of four rollouts
of SmolLM2-135M (bf16 where the CPU computes it natively) with the default LoRA, a shared
1,400-token prompt and 1,000-token completions (a multi-turn retail rollout's shape). The
README's memory figures come from it.

    .venv/bin/python scripts/loss_pass_memory.py [--keep-activations] [--tail TOKENS] [--precision P]

Run it alone: the figure is the process's peak, and glibc's heap keeps what it freed
(``MALLOC_MMAP_THRESHOLD_=131072`` in its environment shows how much of it is fragmentation).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_plugin.model_files import Precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-activations", action="store_true", help="no layer replayed in backward")
    parser.add_argument("--tail", type=int, default=1000, help="completion tokens per rollout")
    parser.add_argument("--precision", choices=get_args(Precision), default="auto", help="as training's")
    args = parser.parse_args()

    import torch
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trace_plugin.model_files import load_model, resolve_model
    from training.config import ExpertTrainingConfig
    from training.experts import shared_prefix_logps

    model, _ = load_model(resolve_model(), precision=args.precision)
    model = get_peft_model(model, ExpertTrainingConfig().lora_config())
    add_fused_lm_head(model.get_base_model(), temperature=1.0, outputs=("log_probs", "entropy"))
    model.train()  # as TRL trains it: layers replay only in training
    prompt, rows = 1400, 4
    ids = torch.randint(100, 40000, (rows, prompt + args.tail))
    ids[:, :prompt] = ids[0, :prompt]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    start = time.monotonic()
    logps, _ = shared_prefix_logps(
        model, ids, torch.ones_like(ids), args.tail, False, recompute=not args.keep_activations
    )
    logps.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"peak {peak:.2f} GB (model loaded: {before:.2f} GB), {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
