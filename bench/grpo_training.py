"""GRPO rollouts per second: our rollout function against TRL's built-in generation.

All train the same LoRA (r=8, all linear layers) on SmolLM2-135M with the same retail
prompts (the policy, nine tool schemas and a ticket), 4 rollouts per step, 48 tokens per
completion, one turn. The reward is a hash of the completion, so every group carries
signal and nothing is dropped: a cost comparison, not a learning one. The naive
configuration is TRL's as it comes (float32, its own generation). Ours runs in our default
precision (bf16 base weights where the hardware computes bf16 natively, LoRA and optimizer
float32) and, for ``bf16_speedup``, in float32; once with each rollout's prompt run on its
own (as TRL does), so that prompt sharing is measured apart. A last run uses the real
retail reward, where the base model's groups are all flat and ours drops them (dynamic
sampling), to show what that saves. Each configuration runs in its own process (peak RSS
is per process); the first step is warm-up and not counted.

With generation on a real vLLM server (``backend="vllm-server"``, bf16 where our default
is, the policy's LoRA loaded there by name at each step), the same configuration as our
default gives ``vllm_rollout_speedup``; the server starts before that run and stops after
it, so it takes no CPU from the others. That run also measures the sampling gap: the mean
|Δ log p| between the trained policy's tokens as vLLM sampled them and as training scores
them.

Generation on its own is timed in the support agent's setting, where prompts carry the
worked examples (about 1,400 tokens) and episodes take turns: two tickets of four
rollouts, two turns of up to 96 tokens, greedy, played with and without running the
batch's common opening once (alternating), in float32, with the tokens compared.

An expert's training as the improver runs it (a warm start, then multi-turn GRPO) is run
twice, with what each phase freed returned to the system between phases (the default) and
kept in the heap (glibc's own behaviour): ``freed_memory_peak_ratio`` and ``freed_memory_time_ratio``,
kept ÷ returned (full runs only).

Learning, last: three training seeds, each trained in float32 and in bf16 on a fixed task
with a dense reward (a one-turn retail reply that names the ticket's order id, in few
tokens). The mean reward curves are printed side by side, with the second half's mean per
seed: bf16 must learn as well as float32 does, and one seed is too noisy to say so (where
bf16 is the default precision: without native bf16 it is emulated, and not run).

    python bench/grpo_training.py [--quick] [--vllm]

(``--quick`` leaves the vLLM run out unless ``--vllm`` is given, and the prompt run per
rollout; where the default precision is float32, one run is both ours and float32.)

(Named so that it does not shadow the ``training`` package for the other benches.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GROUP = 4
LEARNING_SEEDS = (0, 1, 2)


def scored_reward(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 1000 / 1000


def named_and_brief(prompt: str, answer: str) -> float:
    """The learning task's reward: half for naming the ticket's order id, half for brevity."""
    named = any(order in answer for order in re.findall(r"#W\d+", prompt))
    return 0.5 * named + 0.5 * max(0.0, 1.0 - len(answer) / 200)


def run(which: str, steps: int, vllm_url: str | None = None) -> dict:
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

        from trace_plugin.model_files import load_model, resolve_model

        model, tokenizer = load_model(resolve_model(), precision="float32")
        prompts = retail_prompts(tokenizer, seeds)
        config = ExpertTrainingConfig(**common, precision="float32")
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
            warm_start_plays=0,  # GRPO's own throughput
            share_prompt=which != "ours_unshared",
            **({"precision": "float32"} if which == "ours_fp32" else {}),
            **({"backend": "vllm-server", "vllm_url": vllm_url} if which == "ours_vllm" else {}),
            **common,
        )
        result = ExpertTrainer(config, env, seeds, progress=False, callbacks=[steps_cb]).train()
        if which == "ours_vllm":
            gap = vllm_gap(result.adapter_dir, vllm_url, seeds[:8])
    durations = [b - a for a, b in zip(steps_cb.ends, steps_cb.ends[1:], strict=False)][1:]
    return {
        **({"sampling_gap": gap} if which == "ours_vllm" else {}),
        "seconds_per_step": sum(durations) / len(durations),
        "rollouts_per_s": GROUP * len(durations) / sum(durations),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
    }


def retail_prompts(tokenizer: Any, seeds: list[int]) -> list[str]:
    """The retail policy, tool schemas and each seed's ticket, rendered as the gateway serves them."""
    from trace_plugin.chat_template import render
    from trace_plugin.environments.retail import RetailEnv

    env = RetailEnv()
    system = {"role": "system", "content": env.system_prompt}
    return [
        render(tokenizer, [system, {"role": "user", "content": env.reset(seed).prompt}], env.tools)
        for seed in seeds
    ]


def vllm_gap(adapter_dir: Path, vllm_url: str, seeds: list[int]) -> float:
    """Mean |Δ log p| of the trained policy's tokens, sampled by vLLM, scored as training does."""
    from peft import PeftModel

    from trace_plugin.model_files import load_model, resolve_model
    from training.vllm_rollouts import sampling_gap, server_policy

    base, tokenizer = load_model(resolve_model(), precision="auto")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    prompts = [tokenizer.encode(p) for p in retail_prompts(tokenizer, seeds)]
    with server_policy(
        vllm_url, model, Path(tempfile.mkdtemp()), eos=tokenizer.eos_token_id, max_tokens=48, temperature=1.0
    ) as generate:
        completions = generate(prompts)
        return sampling_gap(model, prompts, completions, generate.logprobs)


def learning(precision: str, steps: int, seed: int) -> dict:
    """A reward curve on the fixed learning task, trained in ``precision`` from training seed ``seed``."""
    warnings.filterwarnings("ignore")
    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
    from training.config import ExpertTrainingConfig
    from training.experts import ExpertTrainer

    class NamedAndBrief(RetailEnv):
        def reward(self, answer: str = "") -> RewardBreakdown:
            assert self.task is not None
            return RewardBreakdown(named_and_brief(self.task.prompt, answer))

    config = ExpertTrainingConfig(
        rollout_budget=2 * GROUP * steps,
        groups_per_step=2,  # two tickets a step: a steadier curve
        max_turns=1,
        max_completion_length=48,
        resample_rounds=0,
        hint_fraction=0.0,
        learning_rate=2e-3,  # to learn within a bench's steps
        precision=precision,  # type: ignore[arg-type]
        seed=seed,
        checkpoint_every=1000,
        warm_start_plays=0,  # the curve GRPO alone draws
        output_dir=tempfile.mkdtemp() + "/e",
    )
    result = ExpertTrainer(config, NamedAndBrief, list(TRAIN_SEEDS)[:64], progress=False).train()
    return {"reward_curve": result.reward_curve}


def generation(reps: int) -> dict:
    """Seconds per play of the support agent's episodes, with and without the shared opening."""
    warnings.filterwarnings("ignore")
    from examples.support_agent.agent import few_shot_messages
    from integrations.langgraph import message_to_openai
    from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
    from trace_plugin.model_files import load_model, resolve_model
    from training.episodes import EpisodePlayer, hf_generate

    model, tokenizer = load_model(resolve_model(), precision="float32")  # where the tokens must agree
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
        "prompt_tokens": len(
            player._prompt_ids(RetailEnv(), RetailEnv.tools, RetailEnv().reset(seeds[0]).prompt)
        ),
    }


def expert_memory(allocator: str, steps: int) -> dict:
    """An expert trained as the improver trains one (a synthesized retail writes
    environment: a warm start on 16 reference plays, then GRPO steps of 6 turns of up to 96
    tokens), with what each phase freed returned to the system between phases
    (``trace_plugin.freed_memory.trim``, the default) or kept in the heap: the peak resident
    memory and the wall time of each."""
    warnings.filterwarnings("ignore")
    from trace_plugin.environments.interpreter import SpecEnv
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.synthesis import synthesize
    from training import experts
    from training.config import ExpertTrainingConfig
    from training.experts import ExpertTrainer

    if allocator == "kept":
        experts.trim = lambda: None  # type: ignore[assignment]
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    config = ExpertTrainingConfig(
        output_dir=tempfile.mkdtemp() + "/e",
        rollout_budget=GROUP * steps,
        warm_start_plays=16,
        hint_fraction=0.5,
        precision="float32",
        max_turns=6,
        max_completion_length=96,
    )
    start = time.monotonic()
    ExpertTrainer(config, lambda: SpecEnv(spec), list(range(100, 164)), progress=False).train()
    return {
        "seconds": time.monotonic() - start,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
    }


def child(which: str, steps: int, vllm_url: str | None) -> dict:
    if which == "generation":
        return generation(steps)
    if which.startswith("expert_memory@"):
        return expert_memory(which.removeprefix("expert_memory@"), steps)
    if which.startswith("learning_"):
        precision, seed = which.removeprefix("learning_").split("@")
        return learning(precision, steps, int(seed))
    return run(which, steps, vllm_url)


def spawn(which: str, steps: int, vllm_url: str | None = None) -> dict:
    """``child(which, steps)`` in a process of its own: peak RSS and caches stay per
    configuration. Logs its wall time: a step log, the whole run takes minutes."""
    from rich.console import Console

    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, "--steps", str(steps), "--vllm-url", vllm_url or ""],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    Console(stderr=True).log(f"{which}, {steps} steps: {time.perf_counter() - start:.1f} s")
    return json.loads(out.strip().splitlines()[-1])


def on_vllm(steps: int) -> dict:
    """Our default configuration with rollouts generated by a real vLLM server, started for it."""
    from trace_plugin.gateway.vllm_server import VLLMServer, VLLMSettings
    from trace_plugin.model_files import resolve_model, torch_dtype

    model = resolve_model()
    dtype = str(torch_dtype("auto")).removeprefix("torch.")
    log_path = Path(tempfile.mkdtemp()) / "vllm.log"
    settings = VLLMSettings(dtype=dtype, kv_cache_gib=1)
    with VLLMServer(model, served_name=model.name, log_path=log_path, settings=settings) as server:
        return spawn("ours_vllm", steps, server.url)


def vllm_json(on_vllm: dict | None, ours: dict) -> dict:
    if on_vllm is None:
        return {"vllm_rollout_speedup": None, "vllm_sampling_gap": None}
    return {
        "vllm_rollout_speedup": round(on_vllm["rollouts_per_s"] / ours["rollouts_per_s"], 3),
        "vllm_sampling_gap": round(on_vllm["sampling_gap"], 4),
    }


def second_half_mean(curve: list[float]) -> float:
    half = curve[len(curve) // 2 :]
    return sum(half) / len(half)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="with --quick: measure on vLLM too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.vllm_url or None)))
        return
    from trace_plugin.model_files import torch_dtype

    default = str(torch_dtype("auto")).removeprefix("torch.")
    steps = 2 if args.quick else 4  # the first is warm-up
    # Where the default precision is float32, "ours" is "ours_fp32": one run serves both.
    # The prompt run per rollout is the slowest run by far: full runs only.
    configurations = ["naive", "ours_fp32", "ours_unshared", "ours", "ours_flat"]
    if default == "float32":
        configurations.remove("ours_fp32")
    if args.quick:
        configurations.remove("ours_unshared")
    results = {which: spawn(which, steps) for which in configurations}
    if args.vllm or not args.quick:
        results["ours_vllm"] = on_vllm(steps)
    played = spawn("generation", steps // 2)
    # Full runs only (about six minutes each here): the allocator's pair, one after the other.
    memory = None if args.quick else {a: spawn(f"expert_memory@{a}", 2) for a in ("kept", "returned")}
    learning_steps, learning_seeds = (1, (0,)) if args.quick else (16, LEARNING_SEEDS)  # quick: a smoke run
    runs = {
        p: [spawn(f"learning_{p}@{seed}", learning_steps)["reward_curve"] for seed in learning_seeds]
        # bf16 where it is the default: emulated, one step takes minutes and proves nothing.
        for p in dict.fromkeys(("float32", default))
    }
    curves = {p: [sum(step) / len(step) for step in zip(*c, strict=True)] for p, c in runs.items()}
    halves = {p: [second_half_mean(c) for c in r] for p, r in runs.items()}

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO on SmolLM2-135M, CPU: {GROUP} rollouts/step, 48 tokens, retail prompts")
    for column in ("configuration", "s/step", "rollouts/s", "vs naive", "peak RSS GB"):
        table.add_column(column)
    labels = {
        "naive": "TRL built-in generation, float32 (naive)",
        "ours_fp32": "our rollout_func, prompt once per group, float32",
        "ours_unshared": f"our rollout_func, prompt run per rollout, {default}",
        "ours": f"our rollout_func, prompt once per group, {default} (default)",
        "ours_flat": "our default, real reward: flat groups dropped",
        "ours_vllm": f"our default, generated by a vLLM server, {default}",
    }
    naive = results["naive"]["rollouts_per_s"]
    for which, r in results.items():
        table.add_row(
            labels[which],
            f"{r['seconds_per_step']:.1f}",
            f"{r['rollouts_per_s']:.3f}",
            f"{r['rollouts_per_s'] / naive:.2f}×",
            f"{r['peak_rss_gb']:.1f}",
        )
    console = Console()
    console.print(table)
    if "ours_vllm" in results:
        console.print(
            f"vLLM sampling gap: mean |Δ log p| {results['ours_vllm']['sampling_gap']:.4f} nats per sampled"
            f" token, the trained policy's {default} tokens as vLLM sampled them and as training scores them"
        )
    console.print(
        f"generation, support agent prompts ({played['prompt_tokens']} tokens), 2 tickets x {GROUP}, 2 turns,"
        f" float32: {played['unshared_s']:.1f} s prompt run per row, {played['shared_s']:.1f} s opening run"
        f" once ({played['unshared_s'] / played['shared_s']:.2f}x), same tokens: {played['same_tokens']}"
    )
    if memory is not None:
        kept, returned = memory["kept"], memory["returned"]
        console.print(
            f"an expert's training (warm start on 16 plays, 2 GRPO steps of 6 turns), float32: peak RSS"
            f" {kept['peak_rss_gb']:.2f} GB with freed memory kept in the heap,"
            f" {returned['peak_rss_gb']:.2f} GB returned ({kept['seconds']:.0f} s against"
            f" {returned['seconds']:.0f} s)"
        )
    curve_table = Table(
        title=f"learning: mean reward per step, training seeds {list(learning_seeds)}, 2 x {GROUP} rollouts"
    )
    curve_table.add_column("step")
    for precision in curves:
        curve_table.add_column(precision)
    for step, rewards in enumerate(zip(*curves.values(), strict=True), 1):
        curve_table.add_row(str(step), *(f"{r:.3f}" for r in rewards))
    curve_table.add_row("2nd half", *(f"{second_half_mean(c):.3f}" for c in curves.values()))
    curve_table.add_row("per seed", *(" ".join(f"{h:.2f}" for h in halves[p]) for p in curves))
    console.print(curve_table)
    ours = results["ours"]
    print(
        json.dumps(
            {
                "bench": "training",
                "quick": args.quick,
                "precision": default,
                "rollouts_per_s": round(ours["rollouts_per_s"], 4),
                "naive_rollouts_per_s": round(naive, 4),
                "speedup": round(ours["rollouts_per_s"] / naive, 3),
                "bf16_speedup": round(ours["rollouts_per_s"] / results["ours_fp32"]["rollouts_per_s"], 3)
                if default == "bfloat16"
                else None,
                "speedup_without_prompt_sharing": round(results["ours_unshared"]["rollouts_per_s"] / naive, 3)
                if "ours_unshared" in results
                else None,
                "peak_rss_gb": round(max(r["peak_rss_gb"] for r in results.values()), 2),
                "speedup_with_flat_groups_dropped": round(results["ours_flat"]["rollouts_per_s"] / naive, 3),
                **vllm_json(results.get("ours_vllm"), ours),
                "generation_prefix_speedup": round(played["unshared_s"] / played["shared_s"], 3),
                # An expert's training: peak RSS and time with freed memory kept ÷ returned.
                "freed_memory_peak_ratio": round(
                    memory["kept"]["peak_rss_gb"] / memory["returned"]["peak_rss_gb"], 3
                )
                if memory
                else None,
                "freed_memory_time_ratio": round(memory["kept"]["seconds"] / memory["returned"]["seconds"], 3)
                if memory
                else None,
                "generation_same_tokens": played["same_tokens"],
                "learning_seeds": len(learning_seeds),
                "learning_second_half_float32": round(second_half_mean(curves["float32"]), 4),
                "learning_second_half_bf16": round(second_half_mean(curves["bfloat16"]), 4)
                if "bfloat16" in curves
                else None,
                "learning_second_half_per_seed": {p: [round(h, 4) for h in hs] for p, hs in halves.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
