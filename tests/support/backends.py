"""Shared by the tests: backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from trace_plugin.adapter_files import write_safetensors
from trace_plugin.gateway.backend import Completion, Delta, Finished, SamplingParams


class ScriptedBackend:
    """Answers every prompt with the same reply, and keeps every prompt it was asked."""

    model_id = "scripted"
    max_lora_rank = 64
    structured_output = False

    def __init__(self, tokenizer: Any, reply: str = "All done.") -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.prompts: list[str] = []

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        from trace_plugin.chat_template import render

        return render(self.tokenizer, messages, tools)

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        self.prompts.append(prompt)
        return [Completion(self.reply, [1, 2, 3], "stop", [4, 5]) for _ in range(params.n)]

    async def stream(self, prompt: str, params: SamplingParams, adapter: str | None) -> AsyncIterator[Any]:
        """The reply a few characters at a time, per completion."""
        completions = await self.generate(prompt, params, adapter)

        async def events() -> AsyncIterator[Any]:
            for index, completion in enumerate(completions):
                for start in range(0, len(completion.text), 3):
                    yield Delta(index, completion.text[start : start + 3])
                yield Finished(index, completion)

        return events()

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in texts]

    async def load_adapter(self, name: str, path: Path) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def adapters(self) -> set[str]:
        return set()

    async def close(self) -> None: ...


def lora_dir(path, rank: int, modules: dict[str, tuple[np.ndarray, np.ndarray]], **config) -> None:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, **config})
    )
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
    write_safetensors(path / "adapter_model.safetensors", tensors)


class Recording:
    """A backend that serves nothing but records what is loaded, for the registry's bookkeeping."""

    model_id, max_lora_rank = "base", 64

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.unloaded: list[str] = []

    async def load_adapter(self, name, path) -> None:
        self.loaded.append(name)

    async def unload_adapter(self, name) -> None:
        self.unloaded.append(name)

    async def adapters(self) -> set[str]:
        return set(self.loaded) - set(self.unloaded)

    async def generate(self, prompt, params, adapter):
        return []
