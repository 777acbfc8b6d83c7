"""What an expert's training run learns and costs: a plain dataclass that imports no torch.

The improver reads and stores it on every cycle, also where training runs elsewhere (Ray),
so it must load without the ML stack; TRL's and PEFT's objects are built from it lazily.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.model_files import Precision

PLACE_FIELDS = ("vllm_url",)  # where a run takes place, not what it learns


@dataclass(frozen=True)
class ExpertTrainingConfig:
    """Everything that decides what an expert learns and what a run costs.

    The defaults are the ``cpu-small`` preset: SmolLM2-135M on a few CPU cores.
    """

    lora_rank: int = 8
    lora_alpha: int = 16
    # "all-linear" is every linear layer but the LM head (TRL cannot train a LoRA on it).
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    learning_rate: float = 3e-4
    num_generations: int = 4  # the GRPO group size: rollouts per task, compared with each other
    groups_per_step: int = 1  # distinct tasks per optimizer step
    rollout_budget: int = 200  # total rollouts; fixes the number of steps
    max_completion_length: int = 64  # tokens the model may generate in one turn
    max_turns: int = 6  # model turns per episode; the episode ends at the first turn without tool calls
    # Tool results are cut to this many characters: prompt tokens dominate CPU cost.
    max_observation_chars: int = 800
    temperature: float = 1.0
    # Share of rollouts generated with the hint (when a hint is given and no warm start ran).
    hint_fraction: float = 0.25
    resample_rounds: int = 1  # replays of zero-signal groups on fresh seeds, per step
    # GRPO stops once this many steps in a row had every group flat after resampling
    # (prime-rl drops such groups; a run of them means the environment no longer teaches
    # this policy anything; 0: never).
    flat_stop_steps: int = 3
    # GRPO stops before a step could take the rollouts actually played (resampled groups
    # included) past this many, and resamples only within it: for comparisons at equal
    # rollouts spent, not offered (None: no limit but ``rollout_budget``'s steps).
    spend_limit: int | None = None
    # RLVE's adaptive difficulty: GRPO moves to its environment's next level once the mean
    # success of its last ``level_window`` steps in a row at a level reaches
    # ``level_up_success``, before the groups go flat (an environment without levels has
    # one); and back down one, to no lower than where it started, once such a window stays
    # under ``level_down_success``, TRACE's band's floor: below it few groups hold both a
    # success and a failure, and the steps teach by partial credit alone (the headline's
    # experts climbed once and then logged success 0.00 for 18 and 20 steps).
    level_up_success: float = 0.9
    level_down_success: float = 0.2
    level_window: int = 2
    # TRACE's band allows at most this share of a step's groups to be all-success: in the
    # first step, those groups are played again a level up (and again, up to the top), so
    # it finds the level where the warm-started expert is in band. Later steps move by the
    # window alone: one all-success group of four is too little to climb on.
    max_all_success_groups: float = 0.2
    checkpoint_every: int = 10  # steps between checkpoints a re-run resumes from
    # Rollout counts (each a whole number of steps) at which the adapter is also kept, in
    # ``snapshots/<rollouts>`` of the final directory: a success-against-rollouts curve
    # from one run.
    snapshots: tuple[int, ...] = ()
    # The warm start (``training.warm_start``): before GRPO, the LoRA is fine-tuned on this
    # many verified reference plays of the environment (0: GRPO alone, as the paper trains).
    warm_start_plays: int = 32
    # Beside them, up to this share of their number of the deployed agent's successful
    # conversations, as serving rendered them (``EpisodePlayer.served``): the expert keeps
    # what the agent already does right.
    rehearsal_share: float = 0.25
    # Two passes, though the loss is low after one: with one (2026-12-07) the quick preset's
    # writes expert scored 0.11 on its held-out seeds (0.99 in the last quick demo with two)
    # and its GRPO found no success at its level (no informative group; half with two).
    warm_start_epochs: int = 2
    warm_start_batch_size: int = 4
    warm_start_learning_rate: float = 5e-4
    # A group whose rollouts all failed (hinted ones too) gets the task's reference play in
    # place of one member, so it still teaches something (``RolloutFunction._demonstrate``).
    demonstrate: bool = True
    seed: int = 0
    output_dir: str = "experts/expert"  # the final adapter directory
    # Who generates the rollouts: "transformers" (in this process), "vllm" (TRL's colocated
    # vLLM, on a GPU) or "vllm-server" (the vLLM server at ``vllm_url``, with the policy's
    # LoRA loaded there by name at each step: ``training.vllm_rollouts``).
    backend: Literal["transformers", "vllm", "vllm-server"] = "transformers"
    vllm_url: str | None = None
    # The base model's weights; "auto" is bf16 where the hardware computes it natively
    # (``model_files.bf16_supported``), float32 elsewhere. Generation, the loss pass and
    # backward then run in bf16, while the LoRA weights and the optimizer state stay float32
    # (PEFT keeps adapters float32). bf16 weights rather than autocast: on this CPU, autocast
    # recasts every weight at every decode step and generates slower than float32 does.
    precision: Precision = "auto"
    gradient_checkpointing: bool = False
    # A group's rollouts share their prompt: generation runs the batch's common opening once
    # (``hf_generate``) and the loss pass each distinct prompt once (``shared_prefix_logps``).
    # Both need the key/value cache, which gradient checkpointing turns off.
    share_prompt: bool = True
    vllm_gpu_memory_utilization: float = 0.3  # colocated vLLM's share of GPU memory

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError("num_generations must be at least 2: GRPO compares rollouts within a group")
        if self.steps < 1:
            raise ValueError(
                f"rollout_budget {self.rollout_budget} is less than one step of "
                f"{self.rollouts_per_step} rollouts"
            )
        per_step = self.rollouts_per_step
        for rollouts in self.snapshots:
            if rollouts % per_step or not per_step <= rollouts <= self.steps * per_step:
                raise ValueError(
                    f"snapshot at {rollouts} rollouts is not a step of {per_step} within the budget"
                )
        if not 0.0 <= self.hint_fraction <= 1.0:
            raise ValueError("hint_fraction must be in [0, 1]")
        if self.precision not in get_args(Precision):
            raise ValueError(f"precision must be one of {get_args(Precision)}, not {self.precision!r}")
        if self.warm_start_plays < 0 or not 0 <= self.rehearsal_share <= 1:
            raise ValueError("warm_start_plays must be >= 0, and rehearsal_share within [0, 1]")
        if min(self.warm_start_epochs, self.warm_start_batch_size) < 1:
            raise ValueError("the warm start's epochs and batch size must be >= 1")
        if (self.backend == "vllm-server") != (self.vllm_url is not None):
            raise ValueError('backend "vllm-server" needs vllm_url, and vllm_url needs that backend')
        if self.flat_stop_steps < 0:
            raise ValueError("flat_stop_steps must be >= 0")
        if self.spend_limit is not None and self.spend_limit < self.rollouts_per_step:
            raise ValueError(
                f"spend_limit {self.spend_limit} is less than one step of {self.rollouts_per_step}"
            )
        if self.share_prompt and self.gradient_checkpointing:
            raise ValueError("share_prompt needs the key/value cache, which gradient checkpointing disables")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ExpertTrainingConfig:
        """``cpu-small`` (the embedded SmolLM2 on this CPU) or ``gpu`` (vLLM colocated generation)."""
        presets: dict[str, dict[str, Any]] = {
            "cpu-small": {},
            "gpu": {
                "lora_rank": 16,
                "lora_alpha": 32,
                "learning_rate": 1e-4,
                "num_generations": 8,
                "groups_per_step": 8,
                "rollout_budget": 64 * 200,
                "max_completion_length": 256,
                "max_turns": 10,
                "max_observation_chars": 4000,
                "checkpoint_every": 25,
                "backend": "vllm",
                "precision": "bfloat16",
                "gradient_checkpointing": True,
                "share_prompt": False,
            },
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    @property
    def rollouts_per_step(self) -> int:
        return self.num_generations * self.groups_per_step

    @property
    def steps(self) -> int:
        return self.rollout_budget // self.rollouts_per_step

    def stop_reason(self, history: Sequence[dict[str, Any]]) -> str | None:
        """Why GRPO stops after the steps logged in ``history`` (TRL's log history), or None:
        "flat" (``flat_stop_steps`` flat steps in a row) or "spent" (no room for another step
        within ``spend_limit``). A pure function of the logs, which a checkpoint keeps, so a
        resumed run stops where the killed one would have."""
        steps = [entry for entry in history if "rollouts/spent" in entry]
        window = steps[-self.flat_stop_steps :] if self.flat_stop_steps else []
        if len(window) == self.flat_stop_steps > 0 and all(
            entry["dynamic_sampling/dropped_groups"] >= self.groups_per_step for entry in window
        ):
            return "flat"
        spent = sum(entry["rollouts/spent"] for entry in steps)
        if self.spend_limit is not None and spent + self.rollouts_per_step > self.spend_limit:
            return "spent"
        return None

    def level(
        self, history: Sequence[dict[str, Any]], start: int, top: int, *, floor: int | None = None
    ) -> int:
        """The level GRPO plays next after the steps logged in ``history``: ``start`` first;
        one up once the last ``level_window`` steps, all at the current level, averaged
        ``level_up_success`` (never above ``top``); one down once they averaged under
        ``level_down_success``, never below ``floor`` (``start`` unless given): the levels
        under the calibrated one narrow the tickets to fewer templates, another task rather
        than an easier one (a quick demo that stepped down there trained on writes alone and
        scored 0.39 on its environment's held-out seeds, where runs that stayed above scored
        0.50 to 0.75).
        A pure function of the logs, which a checkpoint keeps, so a resumed run plays
        where the killed one would have."""
        steps = [entry for entry in history if "curriculum/level" in entry]
        if not steps:
            return start
        current = int(steps[-1]["curriculum/level"])
        window = list(itertools.takewhile(lambda e: e["curriculum/level"] == current, reversed(steps)))
        window = window[: self.level_window]
        if len(window) < self.level_window:
            return current
        success = sum(e["episodes/success"] for e in window) / len(window)
        if success >= self.level_up_success:
            return min(current + 1, top)
        if success < self.level_down_success:
            return max(current - 1, start if floor is None else floor)
        return current

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(data["lora_target_modules"], tuple):
            data["lora_target_modules"] = list(data["lora_target_modules"])
        data["snapshots"] = list(self.snapshots)  # as JSON stores it
        return data

    @property
    def rehearsal_plays(self) -> int:
        """How many of the deployed agent's conversations the warm start rehearses, at most."""
        return int(self.warm_start_plays * self.rehearsal_share)

    def learning_dict(self) -> dict[str, Any]:
        """``to_dict`` without where the run takes place: a run resumed against a vLLM
        server on another port is the same run."""
        return {k: v for k, v in self.to_dict().items() if k not in PLACE_FIELDS}

    def lora_config(self) -> Any:
        from peft import LoraConfig

        targets = self.lora_target_modules
        return LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=targets if isinstance(targets, str) else list(targets),
            lora_dropout=0.0,  # generation and loss then see the same network
            task_type="CAUSAL_LM",
        )

    def grpo_config(self, work_dir: Path) -> Any:
        """TRL's ``GRPOConfig``."""
        from trl import GRPOConfig

        return GRPOConfig(**self.grpo_kwargs(work_dir))

    def grpo_kwargs(self, work_dir: Path) -> dict[str, Any]:
        """TRL's settings: one group per micro-batch, one generation round per optimizer step.

        beta=0 needs no reference model (one forward pass less per step); ``dapo`` token
        normalization and per-group reward scaling are TRL's defaults. With
        ``steps_per_generation`` equal to the accumulation steps the rollouts are on-policy,
        so TRL skips the old-log-prob pass.
        """
        vllm = self.backend == "vllm"
        return dict(
            **self._trainer_kwargs(work_dir),
            max_steps=self.steps,
            per_device_train_batch_size=self.num_generations,
            gradient_accumulation_steps=self.groups_per_step,
            num_generations=self.num_generations,
            max_completion_length=self.max_completion_length,
            temperature=self.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=self.learning_rate,
            lr_scheduler_type="constant",
            beta=0.0,
            num_iterations=1,
            loss_type="dapo",
            scale_rewards="group",
            remove_unused_columns=False,
            log_completions=False,
            use_vllm=vllm,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            generation_kwargs={"bad_words": list(REPLY_FORBIDDEN)} if vllm else None,
            # Our rollouts return no sampling log-probs (hinted ones were sampled under another prompt).
            vllm_importance_sampling_correction=False,
        )

    def sft_config(self, work_dir: Path, max_length: int) -> Any:
        """TRL's ``SFTConfig`` for the warm start: its epochs, batch and learning rate, and
        ``max_length`` the longest play (TRL's default of 1024 truncates from the end)."""
        from trl import SFTConfig

        return SFTConfig(
            **self._trainer_kwargs(work_dir),
            num_train_epochs=self.warm_start_epochs,
            per_device_train_batch_size=self.warm_start_batch_size,
            learning_rate=self.warm_start_learning_rate,
            lr_scheduler_type="constant",
            max_length=max_length,
        )

    def _trainer_kwargs(self, work_dir: Path) -> dict[str, Any]:
        """What both trainers share: precision, device, checkpoints, quiet logs."""
        return dict(
            output_dir=str(work_dir),
            bf16=False,  # no autocast: the weights are already in ``precision``
            use_cpu=not _cuda_available(),
            # Explicit: TRL's SFT default recomputes activations, which also turns off the
            # key/value cache the shared prompt passes need.
            activation_checkpointing=self.gradient_checkpointing,
            seed=self.seed,
            logging_steps=1,
            save_strategy="steps",
            save_steps=self.checkpoint_every,
            save_total_limit=2,
            report_to="none",
            disable_tqdm=True,  # our own progress bars show reward and loss
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
