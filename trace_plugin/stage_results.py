"""Each stage of a long run kept as JSON under its folder, so that a run killed midway
picks up where it stopped: the demo's and the improvement bench's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StageResults:
    """``get(key, compute)`` reads the stage back if a run before finished it, else computes
    it and publishes it atomically (``.partial`` → rename): a kill leaves no half-written stage."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        path = self.folder / f"{key}.json"
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(value))
        partial.replace(path)
        return value
