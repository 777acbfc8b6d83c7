"""Capability experts: one LoRA adapter per capability, trained by GRPO in its environment.

The trainer is TRL's ``GRPOTrainer`` with a PEFT LoRA; we supply only the rollouts. Of
TRL's three ways to get them we use ``rollout_func``, because our environment protocol
and the TRACE recipe need three things the other two cannot give:

- ``environment_factory`` exposes an environment's *Python methods* as tools, renders
  their schemas from docstrings, and conditions the loss on exactly the prompt it
  generated from. Our environments offer OpenAI schemas and ``step(ToolCall)``; the
  deployed gateway renders the offered tools with ``TOOL_CHAT_TEMPLATE``, and training must
  see the same tokens. Hints (below) need the generation prompt and the loss prompt to
  differ, and dynamic sampling needs the episode rewards before the batch is handed back.
- A single-decision formulation (one tool choice per prompt) would need a reward we
  invent per step; ours is ``env.reward(answer).total``, a verifier of the whole episode.

So ``EpisodePlayer`` plays whole episodes, all rollouts of a batch in lockstep with
one batched ``generate`` per turn, each a ``Rollout``, and the rollout function
(``RolloutFunction``) returns, per rollout, the
un-hinted prompt ids, the completion ids (model turns and tool results interleaved) with
an ``env_mask`` that keeps tool-result tokens out of the loss, and the episode reward for
the reward function to pass through. TRL then computes the group advantages and the loss.

Hints (TRACE): for ``hint_fraction`` of the rollouts, guidance (text appended to the
user's ticket, or worked example turns placed before it) is added *for generation only*;
the returned prompt ids are the un-hinted ones, so the log-probabilities and the gradient
are those of the un-hinted policy. The hinted samples are treated as on-policy (no
importance weight), which is what the paper does.

Dynamic sampling: a group whose rewards are all equal has zero advantage in TRL (it
normalizes per group), so it moves nothing but still dilutes the token-normalized
``dapo`` loss. We replay such groups on fresh seeds up to ``resample_rounds`` times, and
drop the ones still flat: TRL would give them zero advantage and, masked, zero weight, so
they are handed back as one-token stubs that cost no forward/backward pass (a step whose
groups are all flat then costs only its rollouts). Counts go to the step log.

Heavy imports (torch, transformers, peft, trl) live here, never in ``trace_plugin``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import PrinterCallback, TrainerCallback

from trace_plugin.adapter_files import file_sha256, weights_digest
from trace_plugin.environments.base import Environment, Task, task_keys, unseen_seeds
from trace_plugin.export import Conversation
from trace_plugin.freed_memory import trim
from trace_plugin.generation import folded, until_eos
from trace_plugin.model_files import load_model, resolve_model
from trace_plugin.records.outcome import reward_succeeds
from training.checkpoints import STATE, latest_checkpoint, publish
from training.config import PLACE_FIELDS, ExpertTrainingConfig
from training.episodes import EpisodePlayer, Generate, HintValue, Rollout, hf_generate
from training.progress import StepProgress
from training.recompute import SharedPrefix, recomputed
from training.vllm_rollouts import server_policy
from training.warm_start import WARM_START_DIR, WarmStartResult, WarmStartTrainer

Hint = HintValue | Callable[[Task], HintValue | None]

RESULT_FILE = "expert.json"
SNAPSHOTS = "snapshots"  # the adapter at earlier rollout counts, inside an expert's directory


def _vllm_generate(trainer: Any) -> Generate:
    """TRL's colocated vLLM (weights already synced by TRL before each rollout call)."""
    eos, limit = trainer.processing_class.eos_token_id, trainer.args.max_completion_length

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        _, completions, _, _ = trainer.vllm_generation.generate(
            prompts=prompts, images=None, num_generations=1
        )
        # A stop on EOS must end with EOS, as it does with transformers, for the turn to count as finished.
        return [
            ids + [eos] if len(ids) < limit and eos not in ids else until_eos(ids, eos) for ids in completions
        ]

    return generate


# -- the rollout function TRL calls ---------------------------------------------------------------


class RolloutFunction:
    """TRL's ``rollout_func`` and reward function for one environment.

    Dataset rows only name a seed (``{"seed": 17}``); the conversation is built here.
    """

    def __init__(
        self,
        config: ExpertTrainingConfig,
        player: EpisodePlayer,
        seeds: Sequence[int],
        hint: Hint | None,
        generate: Callable[[Any], AbstractContextManager[Generate]],
        *,
        levels: Sequence[Callable[[], Environment]] = (),
        start_level: int = 0,
        floor_level: int | None = None,
    ) -> None:
        self.config, self.player, self.seeds, self.hint = config, player, list(seeds), hint
        self.backend = generate  # trainer -> a context holding the policy's Generate
        # The environment's difficulty levels, easiest first (none: the player's one), the
        # one GRPO starts at, and the lowest it may step down to (None: where it starts).
        self.levels, self.start_level = list(levels), start_level
        self.floor_level = start_level if floor_level is None else min(floor_level, start_level)
        self._stats: dict[str, float] = {}
        self._tasks: dict[tuple[int, int], Task] = {}

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        size, start = self.config.num_generations, time.monotonic()
        rng = random.Random(f"{self.config.seed}/{trainer.state.global_step}")
        level = None
        if self.levels:
            level = self.config.level(
                trainer.state.log_history, self.start_level, len(self.levels) - 1, floor=self.floor_level
            )
            self.player.env_factory = self.levels[level]
        with self.backend(trainer) as generate:
            group_seeds = [json.loads(p)["seed"] for p in prompts[::size]]
            groups = self._play_groups(group_seeds, rng, generate)
            room = self._replay_room(trainer.state.log_history, len(groups))
            climbed = 0
            # The first step finds the level; later steps move by the window (``config.level``).
            finding = not any("curriculum/level" in entry for entry in trainer.state.log_history)
            top = len(self.levels) - 1
            while finding and level is not None and level < top and room and self._mastered(groups):
                level += 1
                self.player.env_factory = self.levels[level]
                retry = [i for i, g in enumerate(groups) if _all_succeeded(g)][:room]
                room -= len(retry)
                replayed = self._play_groups([group_seeds[i] for i in retry], rng, generate)
                for i, group in zip(retry, replayed, strict=True):
                    groups[i] = group
                climbed += len(retry)
            flat = [i for i, g in enumerate(groups) if _flat(g)]
            zero_signal, resampled = len(flat), 0
            used = set(group_seeds)
            fresh = [s for s in self.seeds if s not in used]
            for _ in range(self.config.resample_rounds):
                if not flat or not fresh or not room:
                    break
                retry = flat[: min(len(fresh), room)]
                room -= len(retry)
                seeds = [fresh.pop(rng.randrange(len(fresh))) for _ in retry]
                for i, group in zip(retry, self._play_groups(seeds, rng, generate), strict=True):
                    groups[i] = group
                resampled += len(retry)
                flat = [i for i in flat if _flat(groups[i])]
        demonstrated = self._demonstrate(groups, flat) if self.config.demonstrate else 0
        flat = [i for i in flat if _flat(groups[i])]
        eos = self.player.eos
        for i in flat:
            # Still no signal: drop the group. It would add zero to the loss and, masked, zero to the
            # normalizer, so it is replaced by a one-token stub that costs no forward/backward pass.
            for rollout in groups[i]:
                rollout.prompt_ids, rollout.completion_ids, rollout.env_mask = (
                    rollout.prompt_ids[-1:],
                    [eos],
                    [0],
                )
        rollouts = [r for g in groups for r in g]
        sampled = [r for r in rollouts if not r.demonstration]  # what the policy did, alone
        unhinted = [r.reward for r in sampled if not r.hinted]
        played = len(group_seeds) + climbed + resampled
        self._stats = {
            "rollouts/offered": len(group_seeds) * size,
            "rollouts/spent": played * size,  # resampled groups were played too
            "dynamic_sampling/informative_groups": (len(groups) - len(flat)) / len(groups),
            "dynamic_sampling/unhinted_informative_groups": sum(_informative_unhinted(g) for g in groups)
            / len(groups),
            "episodes/reward": sum(r.reward for r in sampled) / len(sampled),
            "episodes/success": sum(reward_succeeds(r.reward) for r in sampled) / len(sampled),
            "episodes/unhinted_reward": sum(unhinted) / len(unhinted) if unhinted else math.nan,
            "episodes/hinted_fraction": sum(r.hinted for r in sampled) / len(sampled),
            "episodes/turns": sum(r.turns for r in sampled) / len(sampled),
            "dynamic_sampling/zero_signal_groups": zero_signal,
            "dynamic_sampling/resampled_groups": resampled,
            "curriculum/climbed_groups": climbed,
            "dynamic_sampling/demonstrations": demonstrated,
            "dynamic_sampling/dropped_groups": len(flat),
            "timing/rollout_seconds": time.monotonic() - start,
            # Each check's mean over the policy's rollouts: which one holds success down.
            **{f"checks/{label}": mean for label, mean in _check_means(sampled).items()},
        }
        if level is not None:
            self._stats["curriculum/level"] = level
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rollouts],
            "env_reward": [r.reward for r in rollouts],
        }

    def _mastered(self, groups: list[list[Rollout]]) -> bool:
        """Whether more of the step's groups all succeeded than TRACE's band allows."""
        return sum(map(_all_succeeded, groups)) > self.config.max_all_success_groups * len(groups)

    def _replay_room(self, history: Sequence[dict[str, Any]], groups: int) -> int:
        """How many groups this step may replay (a level up, or resampled): within
        ``spend_limit`` (after this step's own groups and the steps before it, as logged);
        without one, the levels and ``resample_rounds`` are the only bounds."""
        if self.config.spend_limit is None:
            return sys.maxsize
        spent = (
            int(sum(entry.get("rollouts/spent", 0) for entry in history))
            + groups * self.config.num_generations
        )
        return max(0, (self.config.spend_limit - spent) // self.config.num_generations)

    def env_reward(
        self, completions: list[Any], env_reward: list[float], log_metric: Any, **_: Any
    ) -> list[float]:
        """The environment's own verdict, computed during the rollout; also logs the batch stats."""
        for name, value in self._stats.items():
            if not math.isnan(value):
                log_metric(name, float(value))
        return list(env_reward)

    def _demonstrate(self, groups: list[list[Rollout]], flat: list[int]) -> int:
        """In each flat group of failures, the task's reference play takes the last member's
        place; returns how many groups got one.

        With per-group scaling and no importance ratio the demonstration's loss is an
        advantage-weighted SFT term, and the failures beside it are pushed down: off-policy
        mixing of this kind can collapse entropy, so it is limited to groups that would
        otherwise teach nothing (hints failed there too), one demonstration per group, and
        TRL's logged ``entropy`` shows what it does."""
        count = 0
        for i in flat:
            group = groups[i]
            if reward_succeeds(group[0].reward):
                continue  # all succeeded: nothing to show
            demonstration = self.player.reference(group[-1].seed)
            if demonstration is not None and demonstration.reward > group[0].reward:
                groups[i] = [*group[:-1], demonstration]
                count += 1
        return count

    def _play_groups(self, seeds: list[int], rng: random.Random, generate: Generate) -> list[list[Rollout]]:
        """One group per seed, all played in one lockstep batch: a generate call per turn for
        the whole step, not per group. On a GPU a small model's decode step costs about its
        kernel launches whatever the rows; played one group after another, a step of four
        groups took over three minutes on an H200."""
        size, hints = self.config.num_generations, []
        for seed in seeds:
            hint = None
            if self.hint is not None:
                hint = self.hint(self._task(seed)) if callable(self.hint) else self.hint
            # Stochastic rounding: exactly hint_fraction of the rollouts in expectation, hinted ones first.
            hinted = int(self.config.hint_fraction * size + rng.random()) if hint else 0
            hints += [hint] * hinted + [None] * (size - hinted)
        rollouts = self.player.play([seed for seed in seeds for _ in range(size)], hints, generate)
        return [rollouts[i : i + size] for i in range(0, len(rollouts), size)]

    def _task(self, seed: int) -> Task:
        key = (id(self.player.env_factory), seed)  # one task per level and seed
        if key not in self._tasks:
            self._tasks[key] = self.player.env_factory().reset(seed)
        return self._tasks[key]


def _check_means(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Each named check's mean score over ``rollouts`` (a rollout without it counts as none)."""
    labels = dict.fromkeys(label for r in rollouts for label in r.checks)
    return {label: sum(r.checks.get(label, 0.0) for r in rollouts) / len(rollouts) for label in labels}


def _flat(group: list[Rollout]) -> bool:
    return len({r.reward for r in group}) == 1


def _all_succeeded(group: list[Rollout]) -> bool:
    """Whether the policy, asked plainly, solved the task every time: hinted rollouts that
    fail beside plain ones that all succeed make a group informative, not the level hard."""
    plain = [r for r in group if not r.hinted and not r.demonstration]
    return all(reward_succeeds(r.reward) for r in plain or group)


def _informative_unhinted(group: list[Rollout]) -> bool:
    """Whether the group's un-hinted samples hold both a success and a failure: hints can make a group
    informative while the policy, asked plainly, always does the same."""
    return len({reward_succeeds(r.reward) for r in group if not r.hinted and not r.demonstration}) > 1


# -- the loss pass --------------------------------------------------------------------------------


HEAD_POSITIONS = 2048  # completion positions scored per forward of the loss pass


def shared_prefix_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of the completions, as TRL's loss pass computes them, but
    with each distinct prompt run through the model once instead of once per rollout.

    A group's rollouts share their (un-hinted) prompt, which is most of every sequence, and
    the forward and backward passes over it are most of a CPU step. Rows with equal prompts
    run the prompt (less its last token) once; its key/value cache is repeated per row, and
    the rows continue from the prompt's last token through their completions with TRL's
    fused log-prob head. Positions and masks are those of the full sequences, and gradients
    flow back through the shared cache into the LoRA weights of the prompt pass. With
    ``recompute`` each decoder layer is replayed in backward instead of keeping its
    activations (``training.recompute``).
    """
    cut = input_ids.size(1) - logits_to_keep - 1  # the shared part: the prompt less its last token
    if cut < 1:  # one-token prompts (dropped groups' stubs): nothing to share
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        entropy = out.entropy[:, -logits_to_keep:] if compute_entropy else None
        return out.log_probs[:, -logits_to_keep:], entropy
    groups: dict[bytes, list[int]] = {}
    for row in range(input_ids.size(0)):
        key = input_ids[row, :cut].cpu().numpy().tobytes() + attention_mask[row, :cut].cpu().numpy().tobytes()
        groups.setdefault(key, []).append(row)
    order: list[int] = []
    logps, entropies = [], []
    for rows in groups.values():
        with recomputed(model) if recompute else nullcontext():
            prompt = SharedPrefix(model, input_ids[rows[:1], :cut], attention_mask[rows[:1], :cut])
            # A few rows at a time: TRL's fused head scores up to 32,768 positions in one
            # chunk, whose float32 logits over the whole vocabulary (and their softmax)
            # would otherwise be the pass's largest tensors.
            per_call = max(1, HEAD_POSITIONS // logits_to_keep)
            for start in range(0, len(rows), per_call):
                chunk = rows[start : start + per_call]
                tail = input_ids[chunk, cut:]
                labels = tail.masked_fill(attention_mask[chunk, cut:] == 0, -100)
                out = model(
                    input_ids=tail,
                    attention_mask=attention_mask[chunk],
                    cache=prompt.cache(len(chunk)),
                    labels=labels,
                    fused_lm_head=True,
                )
                order += chunk
                logps.append(out.log_probs)
                if compute_entropy:
                    entropies.append(out.entropy)
    inverse = torch.argsort(torch.tensor(order))
    return torch.cat(logps)[inverse], torch.cat(entropies)[inverse] if compute_entropy else None


def _shared_prefix_trainer() -> type:
    """TRL's ``GRPOTrainer`` with ``shared_prefix_logps`` as its loss pass (text only)."""
    from trl import GRPOTrainer

    class SharedPrefixGRPOTrainer(GRPOTrainer):
        def _get_per_token_logps_and_entropies(
            self,
            model: Any,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            logits_to_keep: int,
            batch_size: int | None = None,
            compute_entropy: bool = False,
            compute_aux_loss: bool = False,
            **multimodal: Any,
        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            if compute_aux_loss or any(v is not None for v in multimodal.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                    compute_aux_loss, **multimodal,
                )  # fmt: skip
            with self.accelerator.autocast():
                logps, entropies = shared_prefix_logps(
                    model, input_ids, attention_mask, logits_to_keep, compute_entropy
                )
            return logps, entropies, None

    return SharedPrefixGRPOTrainer


# -- training ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertResult:
    """A finished expert: the adapter on disk and how it was made."""

    adapter_dir: Path
    adapter_sha256: str  # of adapter_model.safetensors
    # Mean episode reward per optimizer step, over the rollouts trained on (hinted ones and
    # resampled groups included), and over the un-hinted ones alone (None: a step had none):
    # whether the expert learned to act without its hints.
    reward_curve: list[float]
    unhinted_curve: list[float | None]
    config: dict[str, Any]
    base_model: Path
    base_model_sha256: str  # of the base model's weight files
    steps: int
    logs: list[dict[str, float]]  # TRL's step logs (reward, loss, dynamic-sampling counts, ...)
    resumed_from_step: int | None = None  # the checkpoint this run continued from
    # The rollouts offered by the steps after which the adapter was kept (``snapshot``).
    snapshots: list[int] = dataclasses.field(default_factory=list)
    reference_plays: int = 0  # warm-start plays trained on before GRPO (apart from the rollouts)
    rehearsed: int = 0  # the deployed agent's successful conversations the warm start trained on too
    warm_start_losses: list[float] = dataclasses.field(default_factory=list)
    # Rollouts played by GRPO, resampled groups included (``rollout_budget`` is what its steps
    # offer), and why it stopped short of its steps ("flat", "spent"), if it did.
    rollouts_spent: int = 0
    stopped: str | None = None

    @property
    def level_reached(self) -> int | None:
        """The highest difficulty level GRPO played (None: its environment had no levels)."""
        levels = [int(entry["curriculum/level"]) for entry in self.logs if "curriculum/level" in entry]
        return max(levels) if levels else None

    @property
    def informative_group_frac(self) -> float | None:
        """The share of GRPO's groups, over all its steps, that held both a success and a
        failure of the un-hinted policy (None: no step)."""
        values = [
            entry["dynamic_sampling/unhinted_informative_groups"]
            for entry in self.logs
            if "dynamic_sampling/unhinted_informative_groups" in entry
        ]
        return sum(values) / len(values) if values else None

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["adapter_dir"], data["base_model"] = str(self.adapter_dir), str(self.base_model)
        return json.dumps(data, indent=2)

    def spent_at(self, rollouts: int) -> int:
        """The rollouts spent (resampled groups included) by the step that offered ``rollouts``."""
        steps = rollouts // (self.config["num_generations"] * self.config["groups_per_step"])
        return int(sum(entry.get("rollouts/spent", 0) for entry in self.logs[:steps]))

    def snapshot(self, rollouts: int) -> Path:
        """The adapter as it was after ``rollouts`` training rollouts (one of ``snapshots``)."""
        if rollouts not in self.snapshots:
            raise KeyError(f"no snapshot at {rollouts} rollouts; kept: {self.snapshots}")
        return self.adapter_dir / SNAPSHOTS / str(rollouts)

    @classmethod
    def load(cls, adapter_dir: Path) -> ExpertResult:
        data = json.loads((adapter_dir / RESULT_FILE).read_text())
        data["adapter_dir"], data["base_model"] = Path(adapter_dir), Path(data["base_model"])
        data.setdefault("unhinted_curve", [])  # published before it was recorded
        # What is on disk: a run stopped early recorded, before 2026-12-06, snapshots its steps never reached.
        data["snapshots"] = [
            r for r in data.get("snapshots", []) if (adapter_dir / SNAPSHOTS / str(r)).is_dir()
        ]
        return cls(**data)


class ExpertTrainer:
    """GRPO with LoRA on one environment's training seeds; the adapter appears only when complete.

    Work happens in ``.<name>.partial`` beside the final directory: TRL's checkpoints, then
    the adapter, which is renamed into place (atomic on one filesystem) as the last act.
    A re-run with the same output dir resumes from the last complete checkpoint written
    under the same config and seeds, or restarts cleanly; once the final directory exists, a
    re-run with the same config returns its recorded result.
    """

    def __init__(
        self,
        config: ExpertTrainingConfig,
        env_factory: Callable[[], Environment],
        seeds: Sequence[int],
        *,
        model: str | Path | None = None,
        hint: Hint | None = None,
        examples: Sequence[dict[str, Any]] = (),
        exclude: Collection[str] = (),
        rehearsal: Sequence[Conversation] = (),
        levels: Sequence[Callable[[], Environment]] = (),
        start_level: int = 0,
        warm_level: int | None = None,
        warm_start_env: Callable[[], Environment] | None = None,
        progress: bool = True,
        callbacks: Sequence[TrainerCallback] = (),
        console: Console | None = None,
    ) -> None:
        if not seeds:
            raise ValueError("no training seeds")
        self.config, self.env_factory, self.seeds = config, env_factory, list(seeds)
        # The tasks the warm start plays (None: env_factory's), phrased as the target's users
        # write them where GRPO's first level names the tools: a play's calls are right
        # whatever its request says, and an expert shown named tools waits for the names.
        self.warm_start_env = warm_start_env or env_factory
        # GRPO's difficulty levels, easiest first, and the one it starts at (env_factory's):
        # it climbs them as it masters each (ExpertTrainingConfig.level), never below
        # ``start_level``. A warm-started policy starts at ``warm_level`` (None: the same),
        # its requests asked as the warm start asked them: where they named the tools, the
        # levels that define success would teach a policy to wait for names no user gives.
        self.levels, self.start_level = list(levels), start_level
        self.warm_level = start_level if warm_level is None else warm_level
        self.exclude = sorted(set(exclude))  # task keys the warm start must not play (evaluated tasks)
        self.rehearsal = list(rehearsal)[: config.rehearsal_plays]  # the deployed agent's successes
        self.warm_start: WarmStartResult | None = None
        self.model_dir = resolve_model(model)
        self.hint, self.examples, self.progress = hint, list(examples), progress
        self.callbacks = list(callbacks)
        self.console = console or Console()
        self.final_dir = Path(config.output_dir)
        self.work_dir = self.final_dir.with_name(f".{self.final_dir.name}.partial")

    def train(self) -> ExpertResult:
        if (self.final_dir / RESULT_FILE).is_file():
            done = ExpertResult.load(self.final_dir)
            learned = {k: v for k, v in done.config.items() if k not in PLACE_FIELDS}
            if learned != self.config.learning_dict():
                raise FileExistsError(f"{self.final_dir} holds an expert trained with another config")
            return done
        if self.final_dir.exists():
            raise FileExistsError(
                f"{self.final_dir} exists and is not a finished expert; remove it or choose another"
            )
        # What the process freed before (an evaluation's caches) and after (the trainer)
        # goes back to the system: training's peak does not stand on the heap's leftovers.
        trim()
        try:
            return self._train()
        finally:
            trim()

    def _train(self) -> ExpertResult:
        checkpoint = self._resumable_checkpoint()
        trainer = self._build()
        if checkpoint is not None and self.config.stop_reason(_logged(checkpoint).log_history):
            # The killed run had stopped there (the stop saves a checkpoint): publish it as it was.
            trainer._load_from_checkpoint(str(checkpoint))
            trainer.state = _logged(checkpoint)
            return self._publish(trainer, checkpoint)
        bar = _ProgressBar(self.console) if self.progress else None
        if bar is not None:
            trainer.add_callback(bar)
        with bar or nullcontext():
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        return self._publish(trainer, checkpoint)

    def _resumable_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of a run with this very config; otherwise a clean slate."""
        stamp = self.work_dir / "config.json"
        wanted = json.dumps(
            {
                "config": self.config.learning_dict(),
                "seeds": self.seeds,
                "exclude": self.exclude,
                "rehearsal": hashlib.sha256(
                    json.dumps([dataclasses.asdict(r) for r in self.rehearsal]).encode()
                ).hexdigest(),
            },
            sort_keys=True,
        )
        if self.work_dir.exists() and (not stamp.is_file() or stamp.read_text() != wanted):
            shutil.rmtree(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)
        return latest_checkpoint(self.work_dir)

    def _build(self) -> Any:
        from datasets import Dataset
        from trl import GRPOTrainer

        config = self.config
        model, tokenizer = load_model(self.model_dir, precision=config.precision)

        def player_of(env_factory: Callable[[], Environment]) -> EpisodePlayer:
            return EpisodePlayer(
                tokenizer,
                env_factory,
                max_turns=config.max_turns,
                max_observation_chars=config.max_observation_chars,
                examples=self.examples,
            )

        player = player_of(self.env_factory)
        peft_config = config.lora_config()
        if config.warm_start_plays:
            from peft import PeftModel

            warm = WarmStartTrainer(
                config,
                player_of(self.warm_start_env),
                self.seeds,
                self.work_dir,
                exclude=self.exclude,
                rehearsal=self.rehearsal,
                progress=self.progress,
                callbacks=self.callbacks,
                console=self.console,
            )
            self.warm_start = warm.train(model)
            trim()  # the warm start's activations, freed: before GRPO's peak, not under it
            if self.warm_start is not None:
                # GRPO continues on the warm-started adapter (a fresh base model under it: SFT
                # wrapped the first one in place). ``peft_config`` would make a new, empty LoRA.
                base, _ = load_model(self.model_dir, precision=config.precision)
                model = PeftModel.from_pretrained(base, str(self.warm_start.adapter_dir), is_trainable=True)
                peft_config = None

        @contextmanager
        def backend(trainer: Any) -> Iterator[Generate]:
            if config.backend == "vllm":
                yield _vllm_generate(trainer)
                return
            model = trainer.accelerator.unwrap_model(trainer.model)
            if config.backend == "vllm-server":
                with server_policy(
                    config.vllm_url,  # type: ignore[arg-type]
                    model,
                    self.work_dir,
                    eos=tokenizer.eos_token_id,
                    max_tokens=config.max_completion_length,
                    temperature=config.temperature,
                ) as generate:
                    yield generate
                return
            with folded(model):  # one rollout call, one policy: its LoRA merged while it plays
                yield hf_generate(
                    model,
                    tokenizer,
                    max_new_tokens=config.max_completion_length,
                    temperature=config.temperature,
                    share_prefix=config.share_prompt,
                )

        seeds = self._grpo_seeds()
        # Hints help a policy that cannot act yet. A warm-started one was taught whole plays,
        # and a hint's half-conversation (a ticket and its first call, no result) contradicts
        # them: the quick demo's expert scored 0.05 hinted against 0.30 plainly, on 8 seeds.
        hint = self.hint if self.warm_start is None else None
        start = self.start_level if self.warm_start is None else self.warm_level
        rollouts = RolloutFunction(
            config,
            player,
            seeds,
            hint,
            backend,
            levels=self.levels,
            start_level=start,
            floor_level=self.start_level,
        )
        # Prompts are plain strings naming a seed: no chat-format schema for datasets to merge.
        dataset = Dataset.from_dict({"prompt": [json.dumps({"seed": s}) for s in seeds]})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
            trainer = (_shared_prefix_trainer() if config.share_prompt else GRPOTrainer)(
                model=model,
                reward_funcs=rollouts.env_reward,
                args=config.grpo_config(self.work_dir),
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=peft_config,
                rollout_func=rollouts,
                callbacks=self.callbacks,
            )
        trainer.remove_callback(PrinterCallback)  # raw log dicts; the progress bar prints a readable line
        trainer.add_callback(_EarlyStop(config))
        if config.snapshots:
            trainer.add_callback(
                _Snapshots(self.work_dir / SNAPSHOTS, config.rollouts_per_step, config.snapshots)
            )
        return trainer

    def _grpo_seeds(self) -> list[int]:
        """The seeds GRPO samples: none whose task the warm start trained on or an evaluation
        plays (a memorized task scores alike in every rollout of its group)."""
        played = task_keys(self.env_factory, self.warm_start.play_seeds) if self.warm_start else set()
        seeds = unseen_seeds(self.env_factory, self.seeds, played | set(self.exclude))
        if not seeds:
            self.console.log(
                "[yellow]every training task was warm-started on or is evaluated: GRPO samples them[/]"
            )
            return self.seeds
        return seeds

    def _publish(self, trainer: Any, checkpoint: Path | None) -> ExpertResult:
        staging = self.work_dir / "adapter"
        if staging.exists():
            shutil.rmtree(staging)
        trainer.model.save_pretrained(staging)
        logs = [
            {k: float(v) for k, v in entry.items() if isinstance(v, int | float)}
            for entry in trainer.state.log_history
            if "reward" in entry
        ]
        stopped = trainer.state.global_step < self.config.steps
        result = ExpertResult(
            adapter_dir=self.final_dir,
            adapter_sha256=weights_digest(staging),
            reward_curve=[entry["episodes/reward"] for entry in logs],
            unhinted_curve=[_number(entry.get("episodes/unhinted_reward")) for entry in logs],
            config=self.config.to_dict(),
            base_model=self.model_dir,
            base_model_sha256=weights_sha256(self.model_dir),
            steps=trainer.state.global_step,
            logs=logs,
            resumed_from_step=int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else None,
            # Those its steps reached: a run stopped early (flat, or out of rollouts) kept fewer.
            snapshots=[r for r in self.config.snapshots if (self.work_dir / SNAPSHOTS / str(r)).is_dir()],
            reference_plays=self.warm_start.plays if self.warm_start else 0,
            rehearsed=self.warm_start.rehearsed if self.warm_start else 0,
            warm_start_losses=self.warm_start.losses if self.warm_start else [],
            rollouts_spent=int(sum(entry.get("rollouts/spent", 0) for entry in logs)),
            stopped=self.config.stop_reason(trainer.state.log_history) if stopped else None,
        )
        if result.snapshots:  # kept in the work dir, so a resumed run still has the earlier ones
            (self.work_dir / SNAPSHOTS).rename(staging / SNAPSHOTS)
        if self.warm_start:  # the adapter before GRPO, for the warm start's own ablation
            self.warm_start.adapter_dir.rename(staging / WARM_START_DIR)
        (staging / RESULT_FILE).write_text(result.to_json())
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        publish(staging, self.final_dir)
        shutil.rmtree(self.work_dir, ignore_errors=True)
        return result


def _logged(checkpoint: Path) -> Any:
    """A checkpoint's ``TrainerState``: its step and log history."""
    from transformers import TrainerState

    return TrainerState.load_from_json(str(checkpoint / STATE))


class _EarlyStop(TrainerCallback):
    """Ends GRPO when its config's ``stop_reason``
    says so, saving a checkpoint there so that a resumed run finds the same stop."""

    def __init__(self, config: ExpertTrainingConfig) -> None:
        self.config = config

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if logs and "rollouts/spent" in logs and self.config.stop_reason(state.log_history):
            control.should_training_stop = True
            control.should_save = True


class _Snapshots(TrainerCallback):
    """Saves the adapter after the steps that complete the configured rollout counts."""

    def __init__(self, root: Path, per_step: int, rollouts: Sequence[int]) -> None:
        self.root, self.per_step, self.rollouts = root, per_step, set(rollouts)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        done = state.global_step * self.per_step
        if done in self.rollouts:
            staging, final = self.root / f".{done}.partial", self.root / str(done)
            model.save_pretrained(staging)
            shutil.rmtree(final, ignore_errors=True)  # a resumed run redid this step
            publish(staging, final)


class _ProgressBar(StepProgress):
    """GRPO's bar with the step's mean reward, and one log line per step."""

    def __init__(self, console: Console) -> None:
        super().__init__(console, "GRPO", "reward")

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if not logs or "reward" not in logs:
            return
        reward = logs.get("episodes/reward", logs["reward"])  # sampled rollouts only, demonstrations apart
        unhinted = logs.get("episodes/unhinted_reward")
        checks = {k.removeprefix("checks/"): v for k, v in logs.items() if k.startswith("checks/")}
        weakest = min(checks, key=checks.__getitem__) if checks else None
        self.step(
            state,
            reward,
            f"step {state.global_step}/{state.max_steps}  reward {reward:.3f}"
            + (f"  unhinted {unhinted:.3f}" if unhinted is not None else "")
            + f"  success {logs.get('episodes/success', 0.0):.2f}"
            + (f"  level {logs['curriculum/level']:.0f}" if "curriculum/level" in logs else "")
            + (f"  weakest check {weakest} {checks[weakest]:.2f}" if weakest else "")
            + f"  zero-signal groups {logs.get('dynamic_sampling/zero_signal_groups', 0):.0f}"
            + f" (resampled {logs.get('dynamic_sampling/resampled_groups', 0):.0f},"
            + f" demonstrated {logs.get('dynamic_sampling/demonstrations', 0):.0f},"
            + f" dropped {logs.get('dynamic_sampling/dropped_groups', 0):.0f})"
            + (f"  entropy {logs['entropy']:.2f}" if "entropy" in logs else ""),
        )


# -- evaluation and hashes --------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalResult:
    mean_reward: float
    success_rate: float  # share of episodes with reward 1
    rewards: dict[int, float]  # per seed


def evaluate(
    model_dir: str | Path | None,
    adapter_dir: str | Path | None,
    env_factory: Callable[[], Environment],
    seeds: Sequence[int],
    *,
    config: ExpertTrainingConfig | None = None,
    examples: Sequence[dict[str, Any]] = (),
    batch_size: int = 16,
) -> EvalResult:
    """Greedy episodes with training's rendering and limits (turns, tokens per turn, tool results)."""
    config = config or ExpertTrainingConfig()
    model, tokenizer = load_model(model_dir, precision=config.precision)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    if torch.cuda.is_available():
        model = model.to("cuda")
    model.eval()
    player = EpisodePlayer(
        tokenizer,
        env_factory,
        max_turns=config.max_turns,
        max_observation_chars=config.max_observation_chars,
        examples=examples,
    )
    generate = hf_generate(
        model, tokenizer, max_new_tokens=config.max_completion_length, temperature=None, batch_size=batch_size
    )
    seeds = list(seeds)
    rewards: dict[int, float] = {}
    for start in range(0, len(seeds), batch_size):
        chunk = seeds[start : start + batch_size]
        for rollout in player.play(chunk, [None] * len(chunk), generate):
            rewards[rollout.seed] = rollout.reward
    n = max(len(rewards), 1)
    return EvalResult(sum(rewards.values()) / n, sum(map(reward_succeeds, rewards.values())) / n, rewards)


def _number(value: float | None) -> float | None:
    """A logged mean as JSON keeps it: NaN (no rollout to average) is None."""
    return None if value is None or math.isnan(value) else value


def weights_sha256(model_dir: Path) -> str:
    """A content hash of a model directory's weight files (names and bytes), for provenance."""
    digest = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no weight files in {model_dir}")
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()
