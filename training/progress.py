"""A rich progress bar over a TRL trainer's optimizer steps, with one figure beside it."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import TrainerCallback


class StepProgress(TrainerCallback):
    """A bar labelled ``label`` showing ``figure``; subclasses log a line per step with ``step``."""

    def __init__(self, console: Console, label: str, figure: str) -> None:
        columns = (
            TextColumn(label),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(f"{figure} {{task.fields[value]}}"),
            TimeElapsedColumn(),
        )
        self.progress = Progress(*columns, console=console)
        self.task = self.progress.add_task(label, total=None, value="-")
        self._start = time.monotonic()

    def __enter__(self) -> StepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.progress.update(self.task, total=state.max_steps, completed=state.global_step)

    def step(self, state: Any, value: float, line: str) -> None:
        """Advance to ``state``'s step with ``value`` shown, and log ``line`` with the step's seconds."""
        elapsed, self._start = time.monotonic() - self._start, time.monotonic()
        self.progress.update(self.task, completed=state.global_step, value=f"{value:.3f}")
        self.progress.console.log(f"{line}  {elapsed:.1f}s")
