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

So :class:`EpisodePlayer` plays whole episodes, all rollouts of a batch in lockstep with
one batched ``generate`` per turn, each a :class:`Rollout`, and the rollout function
(:class:`RolloutFunction`) returns, per rollout, the
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
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import GenerationConfig, LogitsProcessorList, PrinterCallback, TrainerCallback

from trace_plugin.chat_template import TOOL_CHAT_TEMPLATE, forbidden_token_ids, render
from trace_plugin.environments.base import Environment, Task, ToolCall, offered_tools
from trace_plugin.generation import TemperatureSampler, folded, generate_batch, shared_prefix, until_eos
from trace_plugin.model_files import load_model, resolve_model
from trace_plugin.records.outcome import reward_succeeds
from trace_plugin.tool_calls import parse_completion
from training.config import ExpertTrainingConfig
from training.lora import ADAPTER_WEIGHTS

# Text appended to the ticket, or worked example turns placed just before it (a small
# model copies a demonstrated tool call far more readily than it follows an instruction).
HintValue = str | list[dict[str, Any]]
Hint = HintValue | Callable[[Task], HintValue | None]
# A generation backend: token-id prompts in, one list of completion ids (EOS included when
# the model stopped) per prompt out.
Generate = Callable[[list[list[int]]], list[list[int]]]

RESULT_FILE = "expert.json"
SNAPSHOTS = "snapshots"  # the adapter at earlier rollout counts, inside an expert's directory


# -- episodes -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Rollout:
    """One episode played for training, as the loss sees it, and what the environment made of it.

    Not :class:`trace_plugin.records.trajectory.Episode`, the stored record of an agent's run.
    """

    seed: int
    prompt_ids: list[int]  # the un-hinted prompt: what the loss conditions on
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: model token, 0: tool-result token
    answer: str = ""
    reward: float = 0.0
    hinted: bool = False
    turns: int = 0


class EpisodePlayer:
    """Plays batches of episodes of any environment in lockstep, one ``generate`` per turn.

    Prompts are rendered as the gateway renders them (``TOOL_CHAT_TEMPLATE`` with the
    OpenAI tool schemas the task offers), so an expert is trained on the tokens it
    will be served. Later turns are built by appending token ids (model output, then the
    template's tool-response block), never by re-rendering: the loss must score exactly
    the tokens that were sampled.
    """

    def __init__(
        self,
        tokenizer: Any,
        env_factory: Callable[[], Environment],
        *,
        max_turns: int,
        max_observation_chars: int,
        examples: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.tokenizer, self.env_factory = tokenizer, env_factory
        self.max_turns, self.max_observation_chars = max_turns, max_observation_chars
        self.examples = list(examples)  # few-shot messages placed after the system prompt
        self.eos = tokenizer.eos_token_id
        self._tool_head = self._template([{"role": "user", "content": "x"}, _DUMMY_CALL], False)

    def play(
        self, seeds: Sequence[int], hints: Sequence[HintValue | None], generate: Generate
    ) -> list[Rollout]:
        envs = [self.env_factory() for _ in seeds]
        rollouts, contexts = [], []
        for env, seed, hint in zip(envs, seeds, hints, strict=True):
            task = env.reset(seed)
            tools = offered_tools(env, task)
            prompt_ids = self._prompt_ids(env, tools, task.prompt)
            rollouts.append(Rollout(seed, prompt_ids, hinted=hint is not None))
            if isinstance(hint, list):
                contexts.append(self._prompt_ids(env, tools, task.prompt, hint))
            else:
                contexts.append(
                    self._prompt_ids(env, tools, f"{task.prompt}\n\nHint: {hint}") if hint else prompt_ids
                )
        active = list(range(len(rollouts)))
        for turn in range(1, self.max_turns + 1):
            if not active:
                break
            outputs = generate([contexts[i] + rollouts[i].completion_ids for i in active])
            still = []
            for i, ids in zip(active, outputs, strict=True):
                rollout, env = rollouts[i], envs[i]
                rollout.completion_ids += ids
                rollout.env_mask += [1] * len(ids)
                rollout.turns = turn
                stopped = bool(ids) and ids[-1] == self.eos
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                parsed = parse_completion(text, truncated=not stopped)
                if not (stopped and parsed.tool_calls):
                    rollout.answer = parsed.content or ""
                    continue
                observations = [self._observe(env, call) for call in parsed.tool_calls]
                if env.done or turn == self.max_turns:
                    continue  # ended by the environment, or out of turns: no final message
                suffix = self.tokenizer(self._tool_suffix(observations), add_special_tokens=False)[
                    "input_ids"
                ]
                rollout.completion_ids += suffix
                rollout.env_mask += [0] * len(suffix)
                still.append(i)
            active = still
        for rollout, env in zip(rollouts, envs, strict=True):
            rollout.reward = float(env.reward(rollout.answer).total)
        return rollouts

    def _prompt_ids(
        self, env: Environment, tools: list[dict[str, Any]], user: str, turns: Sequence[dict[str, Any]] = ()
    ) -> list[int]:
        messages = [{"role": "system", "content": env.system_prompt}, *self.examples, *turns]
        text = render(self.tokenizer, [*messages, {"role": "user", "content": user}], tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _observe(self, env: Environment, call: dict[str, Any]) -> str:
        observation = env.step(ToolCall.from_openai(call))
        if len(observation) > self.max_observation_chars:
            observation = observation[: self.max_observation_chars] + "…"
        return observation

    def _tool_suffix(self, observations: list[str]) -> str:
        """The template's text between an assistant turn's EOS and the next assistant turn."""
        tools = [{"role": "tool", "content": o} for o in observations]
        full = self._template([{"role": "user", "content": "x"}, _DUMMY_CALL, *tools], True)
        end = self._tool_head.rindex(self.tokenizer.eos_token) + len(self.tokenizer.eos_token)
        return full[end:]

    def _template(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=TOOL_CHAT_TEMPLATE,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )


_DUMMY_CALL = {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}


def hf_generate(
    model: Any,
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float | None,
    batch_size: int = 64,
    share_prefix: bool = True,
) -> Generate:
    """A transformers backend: left-padded batches; ``temperature=None`` decodes greedily.

    A batch's prompts open alike (the policy, tool schemas and worked examples; a group's
    ticket too, on every turn), and on a CPU that prompt costs more than the reply. With
    ``share_prefix`` the common opening runs once and every row continues from its keys
    and values (:func:`trace_plugin.generation.shared_prefix`), on the generation core the
    gateway's embedded backend serves requests with.
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bad_words_ids=forbidden_token_ids(tokenizer),  # decode as the gateway serves
        do_sample=False,  # sampling, if any, is TemperatureSampler's
    )
    sampler = LogitsProcessorList([TemperatureSampler(temperature)] if temperature is not None else [])

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            with torch.no_grad():
                skip, cache = shared_prefix(model, chunk) if share_prefix else (0, None)
                result, width = generate_batch(
                    model,
                    chunk,
                    tokenizer.pad_token_id,
                    skip=skip,
                    cache=cache,
                    generation_config=config,
                    logits_processor=sampler,
                )
            out += [until_eos(row[width:].tolist(), tokenizer.eos_token_id) for row in result]
        return out

    return generate


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
    ) -> None:
        self.config, self.player, self.seeds, self.hint = config, player, list(seeds), hint
        self.backend = generate  # trainer -> a context holding the policy's Generate
        self._stats: dict[str, float] = {}
        self._tasks: dict[int, Task] = {}

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        size, start = self.config.num_generations, time.monotonic()
        rng = random.Random(f"{self.config.seed}/{trainer.state.global_step}")
        with self.backend(trainer) as generate:
            group_seeds = [json.loads(p)["seed"] for p in prompts[::size]]
            groups = self._play_groups(group_seeds, rng, generate)
            flat = [i for i, g in enumerate(groups) if _flat(g)]
            zero_signal, resampled = len(flat), 0
            used = set(group_seeds)
            fresh = [s for s in self.seeds if s not in used]
            for _ in range(self.config.resample_rounds):
                if not flat or not fresh:
                    break
                retry = flat[: len(fresh)]
                seeds = [fresh.pop(rng.randrange(len(fresh))) for _ in retry]
                for i, group in zip(retry, self._play_groups(seeds, rng, generate), strict=True):
                    groups[i] = group
                resampled += len(retry)
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
        unhinted = [r.reward for r in rollouts if not r.hinted]
        self._stats = {
            "episodes/success": sum(reward_succeeds(r.reward) for r in rollouts) / len(rollouts),
            "episodes/unhinted_reward": sum(unhinted) / len(unhinted) if unhinted else math.nan,
            "episodes/hinted_fraction": sum(r.hinted for r in rollouts) / len(rollouts),
            "episodes/turns": sum(r.turns for r in rollouts) / len(rollouts),
            "dynamic_sampling/zero_signal_groups": zero_signal,
            "dynamic_sampling/resampled_groups": resampled,
            "dynamic_sampling/dropped_groups": len(flat),
            "timing/rollout_seconds": time.monotonic() - start,
        }
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rollouts],
            "env_reward": [r.reward for r in rollouts],
        }

    def env_reward(
        self, completions: list[Any], env_reward: list[float], log_metric: Any, **_: Any
    ) -> list[float]:
        """The environment's own verdict, computed during the rollout; also logs the batch stats."""
        for name, value in self._stats.items():
            if not math.isnan(value):
                log_metric(name, float(value))
        return list(env_reward)

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
        if seed not in self._tasks:
            self._tasks[seed] = self.player.env_factory().reset(seed)
        return self._tasks[seed]


def _flat(group: list[Rollout]) -> bool:
    return len({r.reward for r in group}) == 1


# -- the loss pass --------------------------------------------------------------------------------


def shared_prefix_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of the completions, as TRL's loss pass computes them, but
    with each distinct prompt run through the model once instead of once per rollout.

    A group's rollouts share their (un-hinted) prompt, which is most of every sequence, and
    the forward and backward passes over it are most of a CPU step. Rows with equal prompts
    run the prompt (less its last token) once; its key/value cache is repeated per row, and
    the rows continue from the prompt's last token through their completions with TRL's
    fused log-prob head. Positions and masks are those of the full sequences, and gradients
    flow back through the shared cache into the LoRA weights of the prompt pass.
    """
    from peft import PeftModel

    unwrapped = model.get_base_model() if isinstance(model, PeftModel) else model
    backbone = unwrapped.get_decoder()
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
        cache = backbone(
            input_ids=input_ids[rows[:1], :cut], attention_mask=attention_mask[rows[:1], :cut], use_cache=True
        ).cache
        cache.batch_repeat_interleave(len(rows))
        tail = input_ids[rows, cut:]
        labels = tail.masked_fill(attention_mask[rows, cut:] == 0, -100)
        out = model(
            input_ids=tail,
            attention_mask=attention_mask[rows],
            cache=cache,
            labels=labels,
            fused_lm_head=True,
        )
        order += rows
        logps.append(out.log_probs)
        if compute_entropy:
            entropies.append(out.entropy)
    inverse = torch.argsort(torch.tensor(order))
    return torch.cat(logps)[inverse], torch.cat(entropies)[inverse] if compute_entropy else None


def _shared_prefix_trainer() -> type:
    """TRL's ``GRPOTrainer`` with :func:`shared_prefix_logps` as its loss pass (text only)."""
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
    snapshots: list[int] = dataclasses.field(default_factory=list)  # rollout counts kept (``snapshot``)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["adapter_dir"], data["base_model"] = str(self.adapter_dir), str(self.base_model)
        return json.dumps(data, indent=2)

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
        progress: bool = True,
        callbacks: Sequence[TrainerCallback] = (),
        console: Console | None = None,
    ) -> None:
        if not seeds:
            raise ValueError("no training seeds")
        self.config, self.env_factory, self.seeds = config, env_factory, list(seeds)
        self.model_dir = resolve_model(model)
        self.hint, self.examples, self.progress = hint, list(examples), progress
        self.callbacks = list(callbacks)
        self.console = console or Console()
        self.final_dir = Path(config.output_dir)
        self.work_dir = self.final_dir.with_name(f".{self.final_dir.name}.partial")

    def train(self) -> ExpertResult:
        if (self.final_dir / RESULT_FILE).is_file():
            done = ExpertResult.load(self.final_dir)
            if done.config != self.config.to_dict():
                raise FileExistsError(f"{self.final_dir} holds an expert trained with another config")
            return done
        if self.final_dir.exists():
            raise FileExistsError(
                f"{self.final_dir} exists and is not a finished expert; remove it or choose another"
            )
        checkpoint = self._resumable_checkpoint()
        trainer = self._build()
        bar = _ProgressBar(self.console, self.config.steps) if self.progress else None
        if bar is not None:
            trainer.add_callback(bar)
        with bar or nullcontext():
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        return self._publish(trainer, checkpoint)

    def _resumable_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of a run with this very config; otherwise a clean slate."""
        stamp = self.work_dir / "config.json"
        wanted = json.dumps({"config": self.config.to_dict(), "seeds": self.seeds}, sort_keys=True)
        if self.work_dir.exists() and (not stamp.is_file() or stamp.read_text() != wanted):
            shutil.rmtree(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)
        # trainer_state.json is the last file a checkpoint save writes.
        complete = [c for c in self.work_dir.glob("checkpoint-*") if (c / "trainer_state.json").is_file()]
        for partial in set(self.work_dir.glob("checkpoint-*")) - set(complete):
            shutil.rmtree(partial)
        return max(complete, key=lambda c: int(c.name.rsplit("-", 1)[1]), default=None)

    def _build(self) -> Any:
        from datasets import Dataset
        from trl import GRPOTrainer

        config = self.config
        model, tokenizer = load_model(self.model_dir, precision=config.precision)
        player = EpisodePlayer(
            tokenizer,
            self.env_factory,
            max_turns=config.max_turns,
            max_observation_chars=config.max_observation_chars,
            examples=self.examples,
        )

        @contextmanager
        def backend(trainer: Any) -> Iterator[Generate]:
            if config.backend == "vllm":
                yield _vllm_generate(trainer)
                return
            model = trainer.accelerator.unwrap_model(trainer.model)
            with folded(model):  # one rollout call, one policy: its LoRA merged while it plays
                yield hf_generate(
                    model,
                    tokenizer,
                    max_new_tokens=config.max_completion_length,
                    temperature=config.temperature,
                    share_prefix=config.share_prompt,
                )

        rollouts = RolloutFunction(config, player, self.seeds, self.hint, backend)
        # Prompts are plain strings naming a seed: no chat-format schema for datasets to merge.
        dataset = Dataset.from_dict({"prompt": [json.dumps({"seed": s}) for s in self.seeds]})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
            trainer = (_shared_prefix_trainer() if config.share_prompt else GRPOTrainer)(
                model=model,
                reward_funcs=rollouts.env_reward,
                args=config.grpo_config(self.work_dir),
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=config.lora_config(),
                rollout_func=rollouts,
                callbacks=self.callbacks,
            )
        trainer.remove_callback(PrinterCallback)  # raw log dicts; the progress bar prints a readable line
        if config.snapshots:
            trainer.add_callback(
                _Snapshots(self.work_dir / SNAPSHOTS, config.rollouts_per_step, config.snapshots)
            )
        return trainer

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
        result = ExpertResult(
            adapter_dir=self.final_dir,
            adapter_sha256=file_sha256(staging / ADAPTER_WEIGHTS),
            reward_curve=[entry["reward"] for entry in logs],
            unhinted_curve=[_number(entry.get("episodes/unhinted_reward")) for entry in logs],
            config=self.config.to_dict(),
            base_model=self.model_dir,
            base_model_sha256=weights_sha256(self.model_dir),
            steps=trainer.state.global_step,
            logs=logs,
            resumed_from_step=int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else None,
            snapshots=list(self.config.snapshots),
        )
        if self.config.snapshots:  # kept in the work dir, so a resumed run still has the earlier ones
            (self.work_dir / SNAPSHOTS).rename(staging / SNAPSHOTS)
        (staging / RESULT_FILE).write_text(result.to_json())
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(self.final_dir)
        shutil.rmtree(self.work_dir, ignore_errors=True)
        return result


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
            staging.rename(final)


class _ProgressBar(TrainerCallback):
    """A rich bar with the step's mean reward, and one log line per step."""

    def __init__(self, console: Console, total: int) -> None:
        columns = (
            TextColumn("GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TimeElapsedColumn(),
        )
        self.progress = Progress(*columns, console=console)
        self.task = self.progress.add_task("train", total=total, reward="-")
        self._start = time.monotonic()

    def __enter__(self) -> _ProgressBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.progress.update(self.task, completed=state.global_step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if not logs or "reward" not in logs:
            return
        elapsed, self._start = time.monotonic() - self._start, time.monotonic()
        self.progress.update(self.task, completed=state.global_step, reward=f"{logs['reward']:.2f}")
        unhinted = logs.get("episodes/unhinted_reward")
        self.progress.console.log(
            f"step {state.global_step}/{state.max_steps}  reward {logs['reward']:.3f}"
            + (f"  unhinted {unhinted:.3f}" if unhinted is not None else "")
            + f"  success {logs.get('episodes/success', 0.0):.2f}"
            + f"  zero-signal groups {logs.get('dynamic_sampling/zero_signal_groups', 0):.0f}"
            + f" (resampled {logs.get('dynamic_sampling/resampled_groups', 0):.0f},"
            + f" dropped {logs.get('dynamic_sampling/dropped_groups', 0):.0f})"
            + f"  {elapsed:.1f}s"
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """A content hash of a model directory's weight files (names and bytes), for provenance."""
    digest = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no weight files in {model_dir}")
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()
