"""TRL checkpoints and atomic publish, as the warm start and GRPO both resume and publish.

A run works in a ``.partial`` folder beside its final one: TRL writes ``checkpoint-N``
folders there (``trainer_state.json`` is the last file of each), and the finished adapter
is staged there and renamed into place as the last act, atomic on one filesystem, so a
final folder is always whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path

STATE = "trainer_state.json"  # the last file a checkpoint save writes


def latest_checkpoint(work_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``work_dir``; incomplete ones (a kill mid-save) are removed."""
    found = list(work_dir.glob("checkpoint-*"))
    complete = [c for c in found if (c / STATE).is_file()]
    for partial in set(found) - set(complete):
        shutil.rmtree(partial)
    return max(complete, key=checkpoint_step, default=None)


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1])


def publish(staging: Path, final: Path) -> None:
    """Move a staged folder into its final place in one rename."""
    staging.rename(final)
