"""GRPO rollouts per second: our rollout function against TRL's built-in generation.

Both train the same LoRA (r=8, all linear layers) on SmolLM2-135M with the same retail
prompts (the policy, nine tool schemas and a ticket), 4 rollouts per step, 48 tokens per
completion, one turn. The reward is a hash of the completion, so every group carries
signal and nothing is dropped: a cost comparison, not a learning one. Ours runs twice,
with generation and the loss pass running each group's shared prompt once (the default)
and once per rollout (as TRL does), so that saving is measured on its own. A last run uses
the real retail reward, where the base model's groups are all flat and ours drops them
(dynamic sampling), to show what that saves. Each configuration runs in its own process
(peak RSS is per process); the first step is warm-up and not counted.

Generation on its own is timed in the support agent's setting, where prompts carry the
worked examples (about 1,400 tokens) and episodes take turns: two tickets of four
rollouts, two turns of up to 96 tokens, greedy, played with and without running the
batch's common opening once (alternating), with the tokens compared.

    python bench/grpo_training.py [--quick]

(Named so that it does not shadow the ``training`` package for the other benches.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GROUP = 4


def scored_reward(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 1000 / 1000


def run(which: str, steps: int) -> dict:
    """One configuration, in this process: seconds per step after the first."""
    warnings.filterwarnings("ignore")
    from transformers import TrainerCallback

    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
    from training.config import ExpertTrainingConfig
    from training.experts import ExpertTrainer

    class Scored(RetailEnv):
        def reward(self, answer: str = "") -> RewardBreakdown:
            return RewardBreakdown(scored_reward(answer))

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = [time.monotonic()]

        def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
            self.ends.append(time.monotonic())

    seeds, steps_cb = list(TRAIN_SEEDS)[:32], Steps()
    common = {"max_completion_length": 48, "checkpoint_every": 1000, "output_dir": tempfile.mkdtemp() + "/e"}
    if which == "naive":
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from trace_plugin.chat_template import render
        from trace_plugin.model_files import load_model, resolve_model

        model, tokenizer = load_model(resolve_model())
        env = RetailEnv()
        prompts = []
        for seed in seeds:
            task = env.reset(seed)
            messages = [
                {"role": "system", "content": env.system_prompt},
                {"role": "user", "content": task.prompt},
            ]
            prompts.append(render(tokenizer, messages, env.tools))
        config = ExpertTrainingConfig(**common)
        kwargs = config.grpo_kwargs(Path(tempfile.mkdtemp()))
        kwargs["max_steps"] = steps
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [scored_reward(c) for c in completions],
            args=GRPOConfig(**kwargs),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            peft_config=config.lora_config(),
            callbacks=[steps_cb],
        )
        steps_cb.ends = [time.monotonic()]
        trainer.train()
    else:
        env = RetailEnv if which == "ours_flat" else Scored
        config = ExpertTrainingConfig(
            rollout_budget=GROUP * steps,
            max_turns=1,
            resample_rounds=0,
            share_prompt=which != "ours_unshared",
            **common,
        )
        ExpertTrainer(config, env, seeds, progress=False, callbacks=[steps_cb]).train()
    durations = [b - a for a, b in zip(steps_cb.ends, steps_cb.ends[1:], strict=False)][1:]
    return {
        "seconds_per_step": sum(durations) / len(durations),
        "rollouts_per_s": GROUP * len(durations) / sum(durations),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
    }


def generation(reps: int) -> dict:
    """Seconds per play of the support agent's episodes, with and without the shared opening."""
    warnings.filterwarnings("ignore")
    from examples.support_agent.agent import few_shot_messages
    from integrations.langgraph import message_to_openai
    from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
    from trace_plugin.model_files import load_model, resolve_model
    from training.experts import EpisodePlayer, hf_generate

    model, tokenizer = load_model(resolve_model())
    model.eval()
    examples = [message_to_openai(m) for m in few_shot_messages()]
    player = EpisodePlayer(tokenizer, RetailEnv, max_turns=2, max_observation_chars=800, examples=examples)
    seeds = [seed for seed in list(TRAIN_SEEDS)[:2] for _ in range(GROUP)]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(reps):
        for share in (False, True):
            generate = hf_generate(model, tokenizer, max_new_tokens=96, temperature=None, share_prefix=share)
            start = time.monotonic()
            episodes = player.play(seeds, [None] * len(seeds), generate)
            seconds[share].append(time.monotonic() - start)
            tokens[share] = [e.completion_ids for e in episodes]
    return {
        "unshared_s": sum(seconds[False]) / reps,
        "shared_s": sum(seconds[True]) / reps,
        "same_tokens": tokens[False] == tokens[True],
        "prompt_tokens": len(player._prompt_ids(RetailEnv(), RetailEnv().reset(seeds[0]).prompt)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(generation(args.steps) if args.child == "generation" else run(args.child, args.steps))
        )
        return
    steps = 2 if args.quick else 4  # the first is warm-up
    results = {}
    for which in ("naive", "ours_unshared", "ours", "ours_flat", "generation"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                which,
                "--steps",
                str(steps // 2 if which == "generation" else steps),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results[which] = json.loads(out.strip().splitlines()[-1])
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO on SmolLM2-135M, CPU: {GROUP} rollouts/step, 48 tokens, retail prompts")
    for column in ("configuration", "s/step", "rollouts/s", "vs naive", "peak RSS GB"):
        table.add_column(column)
    labels = {
        "naive": "TRL built-in generation (naive)",
        "ours_unshared": "our rollout_func, prompt run per rollout",
        "ours": "our rollout_func, prompt run once per group",
        "ours_flat": "our rollout_func, real reward: flat groups dropped",
    }
    naive, played = results["naive"]["rollouts_per_s"], results.pop("generation")
    for which, r in results.items():
        table.add_row(
            labels[which],
            f"{r['seconds_per_step']:.1f}",
            f"{r['rollouts_per_s']:.3f}",
            f"{r['rollouts_per_s'] / naive:.2f}×",
            f"{r['peak_rss_gb']:.1f}",
        )
    Console().print(table)
    Console().print(
        f"generation, support agent prompts ({played['prompt_tokens']} tokens), 2 tickets x {GROUP}, 2 turns:"
        f" {played['unshared_s']:.1f} s prompt run per row, {played['shared_s']:.1f} s opening run once"
        f" ({played['unshared_s'] / played['shared_s']:.2f}x), same tokens: {played['same_tokens']}"
    )
    ours = results["ours"]
    print(
        json.dumps(
            {
                "bench": "training",
                "quick": args.quick,
                "rollouts_per_s": round(ours["rollouts_per_s"], 4),
                "naive_rollouts_per_s": round(naive, 4),
                "speedup": round(ours["rollouts_per_s"] / naive, 3),
                "speedup_without_prompt_sharing": round(
                    results["ours_unshared"]["rollouts_per_s"] / naive, 3
                ),
                "peak_rss_gb": round(max(r["peak_rss_gb"] for r in results.values()), 2),
                "speedup_with_flat_groups_dropped": round(results["ours_flat"]["rollouts_per_s"] / naive, 3),
                "generation_prefix_speedup": round(played["unshared_s"] / played["shared_s"], 3),
                "generation_same_tokens": played["same_tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
