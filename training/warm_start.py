"""The warm start: an expert's LoRA fine-tuned on its environment's verified reference plays
before GRPO, so that GRPO starts from a policy that sometimes succeeds.

Pure RL from SmolLM2-135M found no gradient: its groups were all failures, so every
advantage was zero. A synthesized environment holds a verified reference solution for
every seed; played through the environment (``EpisodePlayer.reference``) it becomes a
token sequence exactly like a rollout's, rendered behind the agent's own system prompt and
worked examples, with the task's tools, by our own chat template. We hand TRL's
``SFTTrainer`` those ids pre-tokenized with an assistant mask (its ``assistant_masks``
column), so the loss covers the model's replies only and TRL applies no template of its
own (TRL's templates would double-encode string arguments and train the newline serving
puts in the prompt). ``max_length`` is the longest play: SFT's default of 1024 tokens cuts
sequences from the end, and the retail prompt alone is about 1,350.

Plays never repeat a task that is evaluated: a play whose request and offered tools hash
(``task_key``) to one of an evaluated set is left out,
since seeds alone do not separate them (the generic family's no-call requests are three
fixed strings).

Beside them it rehearses what the deployed agent already does right: its successful
traffic (``export.successful_conversations``), rendered as serving rendered each turn
(``EpisodePlayer.served``). An expert trained on its environment alone serves every
request of the agent, and lost tickets the base model solved (the quick demo's gate saw
0.12 against the base's 0.25 on its own tasks); the rehearsal keeps them.

The loss pass runs a batch's common opening once (``opening_once_forward``), and a play
and a rehearsed conversation share none (the environment's prompt against the one serving
rendered): a batch holding both runs every row whole, about three times a plays-only step
in the headline's first run with rehearsal (74–81 s against 26–30). So the rows are
ordered (``BatchesOfOneKind``) so that every batch holds one kind of row where the counts
allow.

The adapter is published atomically (``.partial`` then rename) inside the expert's work
directory, and SFT checkpoints let a killed warm start resume where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from torch.utils.data import Sampler
from transformers import PrinterCallback, TrainerCallback

from trace_plugin.environments.base import DistinctPlays
from trace_plugin.export import Conversation
from training.checkpoints import checkpoint_step, latest_checkpoint, publish
from training.config import ExpertTrainingConfig
from training.episodes import EpisodePlayer, Rollout
from training.progress import StepProgress
from training.recompute import SharedPrefix, recomputed

WARM_START_DIR = "warm_start"  # the warm-started adapter, inside the expert's work directory
RESULT_FILE = "warm_start.json"


@dataclass(frozen=True)
class ReferencePlays:
    """The plays a warm start trains on, and how many seeds were passed over, by reason."""

    plays: list[Rollout]
    rehearsal: list[Rollout] = dataclasses.field(default_factory=list)  # the deployed agent's successes
    leaked: int = 0  # the task is one an evaluation plays
    repeated: int = 0  # the same request and tools as an earlier play
    unplayable: int = 0  # no reference, unsatisfiable, too many turns, or it did not succeed

    @property
    def longest(self) -> int:
        rows = [*self.plays, *self.rehearsal]
        return max((len(p.prompt_ids) + len(p.completion_ids) for p in rows), default=0)

    @property
    def kinds(self) -> list[int]:
        """Each row's kind, in ``rows`` order: 0 for a play, 1 for a rehearsed conversation."""
        return [0] * len(self.plays) + [1] * len(self.rehearsal)

    def rows(self) -> dict[str, list[list[int]]]:
        """``SFTTrainer``'s pre-tokenized columns: the whole play, and which tokens are the model's."""
        rows = [*self.plays, *self.rehearsal]
        return {
            "input_ids": [p.prompt_ids + p.completion_ids for p in rows],
            "assistant_masks": [[0] * len(p.prompt_ids) + p.env_mask for p in rows],
        }


def reference_plays(
    player: EpisodePlayer,
    seeds: Sequence[int],
    count: int,
    *,
    exclude: Collection[str] = (),
    rehearsal: Sequence[Conversation] = (),
) -> ReferencePlays:
    """Up to ``count`` successful reference plays from ``seeds``, in order, none of whose
    tasks is in ``exclude`` (task keys) or repeats an earlier play's, and beside them the
    ``rehearsal`` conversations as serving rendered them: none longer than the longest play,
    which sets the warm start's memory and step time (the quick demo's longest successes
    were an agent calling tools seven times before it answered), nor one it cannot render."""
    plays: list[Rollout] = []
    skipped: Counter[str] = Counter()
    distinct = DistinctPlays(player.env_factory, player.reference, exclude)
    for seed in seeds:
        if len(plays) == count:
            break
        play = distinct(seed)
        if isinstance(play, str):
            skipped[play] += 1
        else:
            plays.append(play)
    longest = max((len(p.prompt_ids) + len(p.completion_ids) for p in plays), default=0)
    served = [
        r for r in map(player.served, rehearsal) if r and len(r.prompt_ids) + len(r.completion_ids) <= longest
    ]
    return ReferencePlays(plays, served, skipped["leaked"], skipped["repeated"], skipped["unplayable"])


@dataclass(frozen=True)
class WarmStartResult:
    """A finished warm start: the adapter, and what it was trained on."""

    adapter_dir: Path
    plays: int
    skipped: dict[str, int]  # seeds passed over, by reason
    losses: list[float]  # the training loss per logged step
    resumed_from_step: int | None = None  # the SFT checkpoint a killed run continued from
    play_seeds: list[int] = dataclasses.field(default_factory=list)  # the seeds it played (absent: older)
    rehearsed: int = 0  # the deployed agent's successful episodes beside the plays


class WarmStartTrainer:
    """Supervised fine-tuning of a fresh LoRA on reference plays, with TRL's ``SFTTrainer``.

    ``train`` returns the finished result; a re-run after a kill resumes from the last
    complete SFT checkpoint, and one after it finished returns at once.
    """

    def __init__(
        self,
        config: ExpertTrainingConfig,
        player: EpisodePlayer,
        seeds: Sequence[int],
        work_dir: Path,
        *,
        exclude: Collection[str] = (),
        rehearsal: Sequence[Conversation] = (),
        progress: bool = True,
        callbacks: Sequence[TrainerCallback] = (),
        console: Console | None = None,
    ) -> None:
        self.config, self.player, self.seeds = config, player, list(seeds)
        self.rehearsal = list(rehearsal)
        self.exclude, self.progress, self.callbacks = frozenset(exclude), progress, list(callbacks)
        self.console = console or Console()
        self.final_dir = work_dir / WARM_START_DIR
        self.partial_dir = work_dir / f"{WARM_START_DIR}.partial"

    def plays(self) -> ReferencePlays:
        count = self.config.warm_start_plays
        return reference_plays(self.player, self.seeds, count, exclude=self.exclude, rehearsal=self.rehearsal)

    def train(self, model: Any) -> WarmStartResult | None:
        """Fine-tune ``model`` (the base model) with the expert's LoRA; returns the adapter,
        or None when the environment has no play to give (no reference solutions, or none
        within the turn limit): GRPO then starts from a fresh LoRA, as the paper's does."""
        result_file = self.final_dir / RESULT_FILE
        if result_file.is_file():
            return WarmStartResult(self.final_dir, **json.loads(result_file.read_text()))
        plays = self.plays()
        if not plays.plays:
            self.console.log(
                "[yellow]no reference play to warm-start from[/] (evaluated tasks "
                f"{plays.leaked}, repeated {plays.repeated}, unplayable {plays.unplayable}): GRPO alone"
            )
            return None
        trainer = self.build(model, plays)
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = latest_checkpoint(self.partial_dir)
        bar = _Progress(self.console, len(plays.plays), len(plays.rehearsal)) if self.progress else None
        if bar is not None:
            trainer.add_callback(bar)
        with bar or nullcontext():
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        result = WarmStartResult(
            self.final_dir,
            plays=len(plays.plays),
            skipped={"leaked": plays.leaked, "repeated": plays.repeated, "unplayable": plays.unplayable},
            losses=[float(e["loss"]) for e in trainer.state.log_history if "loss" in e],
            resumed_from_step=checkpoint_step(checkpoint) if checkpoint else None,
            play_seeds=[p.seed for p in plays.plays],
            rehearsed=len(plays.rehearsal),
        )
        staging = self.partial_dir / "adapter"
        shutil.rmtree(staging, ignore_errors=True)
        trainer.model.save_pretrained(staging)
        fields = {k: v for k, v in dataclasses.asdict(result).items() if k != "adapter_dir"}
        (staging / RESULT_FILE).write_text(json.dumps(fields))
        publish(staging, self.final_dir)
        shutil.rmtree(self.partial_dir, ignore_errors=True)
        return result

    def build(self, model: Any, plays: ReferencePlays) -> Any:
        """TRL's ``SFTTrainer`` over the plays' ids, with the expert's own LoRA config."""
        from datasets import Dataset

        args = self.config.sft_config(self.partial_dir, plays.longest)  # never truncated
        trainer = _shared_opening_trainer()(
            kinds=plays.kinds,
            model=model,
            args=args,
            train_dataset=Dataset.from_dict(plays.rows()),
            processing_class=self.player.tokenizer,
            peft_config=self.config.lora_config(),
            callbacks=self.callbacks,
        )
        trainer.remove_callback(PrinterCallback)
        return trainer


def opening_once_forward(model: Any, input_ids: Any, attention_mask: Any, labels: Any) -> Any:
    """TRL's fused-head forward over a batch of plays, with their common opening run once.

    Every play opens with the same system prompt, tools and worked examples (about 850 of
    a retail play's 1,050 tokens), and on a CPU the forward and backward passes over them are
    most of a step. The opening, up to the first token any row trains on, runs once; its
    key/value cache is repeated per row and each row continues from it. Positions and masks
    are the full sequences', and gradients flow back through the cache into the opening's
    LoRA weights, so loss and gradients are those of the plain forward. Each decoder layer is
    replayed in backward instead of keeping its activations (``training.recompute``), in a
    batch that shares no opening too: a step's memory is bounded by its rows' length alone.
    """
    trained = (labels != -100).int()
    first_label = int(trained.argmax(dim=1).min()) if bool(trained.any()) else input_ids.size(1)
    same = (input_ids == input_ids[:1]).all(dim=0) & (attention_mask == 1).all(dim=0)
    common = int(same.int().cumprod(dim=0).sum())
    cut = min(common, first_label - 1)  # the label at ``cut`` is scored from inside the opening: none
    with recomputed(model):  # each layer replayed in backward: its activations are not kept
        if cut < 1:  # rows of different openings: each runs whole
            return model(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True
            )
        opening = SharedPrefix(model, input_ids[:1, :cut], attention_mask[:1, :cut])
        return model(
            input_ids=input_ids[:, cut:],
            attention_mask=attention_mask,
            cache=opening.cache(input_ids.size(0)),
            labels=labels[:, cut:],
            fused_lm_head=True,
        )


def _shared_opening_trainer() -> type:
    """TRL's ``SFTTrainer`` whose loss pass runs a batch's common opening once."""
    from trl import SFTTrainer

    class _OpeningOnce:
        """The model as ``SFTTrainer.compute_loss`` calls it, through ``opening_once_forward``."""

        def __init__(self, model: Any) -> None:
            self.model = model

        def __call__(self, *, input_ids: Any, attention_mask: Any, labels: Any, **_: Any) -> Any:
            return opening_once_forward(self.model, input_ids, attention_mask, labels)

    class SharedOpeningSFTTrainer(SFTTrainer):
        def __init__(self, *args: Any, kinds: Sequence[int], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kinds = list(kinds)

        def _get_train_sampler(self, train_dataset: Any = None) -> Sampler[int]:
            return BatchesOfOneKind(self.kinds, self.args.per_device_train_batch_size, self.args.seed)

        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            return super().compute_loss(_OpeningOnce(model), inputs, return_outputs, num_items_in_batch)

    return SharedOpeningSFTTrainer


class BatchesOfOneKind(Sampler[int]):
    """Every row once an epoch, shuffled, in whole batches of one kind in a shuffled order,
    then what is left of each kind (at most two batches, which may mix kinds). The order is
    the seed's and the epoch's, so a resumed run skips the batches the killed one trained
    (the trainer calls ``set_epoch``)."""

    def __init__(self, kinds: Sequence[int], batch_size: int, seed: int) -> None:
        self.kinds, self.batch_size, self.seed, self.epoch = list(kinds), batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.kinds)

    def __iter__(self) -> Iterator[int]:
        shuffle = random.Random(f"{self.seed}:{self.epoch}").shuffle
        batches: list[list[int]] = []
        rest: list[int] = []
        for kind in sorted(set(self.kinds)):
            rows = [i for i, k in enumerate(self.kinds) if k == kind]
            shuffle(rows)
            whole = len(rows) - len(rows) % self.batch_size
            batches += [rows[i : i + self.batch_size] for i in range(0, whole, self.batch_size)]
            rest += rows[whole:]
        shuffle(batches)
        return iter([row for batch in batches for row in batch] + rest)


class _Progress(StepProgress):
    """The warm start's bar with the step's loss, and one log line per step."""

    def __init__(self, console: Console, plays: int, rehearsed: int) -> None:
        rehearsal = f", {rehearsed} rehearsed" if rehearsed else ""
        super().__init__(console, f"warm start ({plays} plays{rehearsal})", "loss")

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if not logs or "loss" not in logs:
            return
        accuracy = logs.get("mean_token_accuracy")
        self.step(
            state,
            logs["loss"],
            f"warm start step {state.global_step}/{state.max_steps}  loss {logs['loss']:.3f}"
            + (f"  token accuracy {accuracy:.3f}" if accuracy is not None else ""),
        )
