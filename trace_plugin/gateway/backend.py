"""What the gateway needs from a model server: prompts in, completions out, LoRA adapters.

Two implementations speak this protocol: the embedded CPU backend (transformers + PEFT,
``trace_plugin.gateway.embedded``) and a real vLLM server (``trace_plugin.gateway.vllm``). The
gateway renders chat prompts with the shared tool template and parses tool calls itself,
so both backends only ever see plain text prompts and produce the same tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from trace_plugin.errors import TracePluginError

Engine = Literal["embedded", "vllm"]  # what runs the model: in this process, or a local vLLM server


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0  # no end-of-sequence token before this many (vLLM's ``min_tokens``)
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()  # text the completion must never contain (vLLM's ``bad_words``)
    logprobs: bool = False
    top_logprobs: int = 0  # also return this many most likely tokens at each position
    # OpenAI's response_format (JSON text: the params are hashable), for a backend that
    # constrains decoding; None is plain text.
    response_format: str | None = None


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None  # per position: token text -> logprob


@dataclass(frozen=True, slots=True)
class Delta:
    """Text that completion ``index`` of a request has just generated (whole characters;
    text that may yet turn out to begin a stop string is held back until it does not)."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    """Completion ``index`` of a request is done: all of it, as ``generate`` returns it.

    Its text starts with what that index's deltas carried; anything after that (held-back
    text that began no stop string) is the stream's tail.
    """

    index: int
    completion: Completion


StreamEvent = Delta | Finished
# A request's events as they come; closing it early stops its generation.
Events = AsyncGenerator[StreamEvent, None]


class BackendError(TracePluginError, RuntimeError):
    """The model server failed or refused; carries an HTTP-like status for the gateway."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class Backend(Protocol):
    model_id: str  # the base model's name, as /v1/models lists it
    max_lora_rank: int
    structured_output: bool  # whether it can hold a reply to a JSON schema (``response_format``)

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat prompt for the next assistant turn (the shared tool template)."""
        ...

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        """``params.n`` completions of ``prompt`` with ``adapter`` (None: the base model)."""
        ...

    async def stream(self, prompt: str, params: SamplingParams, adapter: str | None) -> Events:
        """``generate``'s completions as they are generated: each index's deltas in order,
        then its ``Finished``. Awaiting it does the checks, so a request that cannot be
        served raises here, before anything is sent; closing the iterator early stops the
        generation (a client that went away)."""
        ...

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The base model's final hidden state at each text's last token, L2-normalized:
        vLLM's ``embed`` pooling, so a gate trained on one backend routes on the other."""
        ...

    async def load_adapter(self, name: str, path: Path) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def adapters(self) -> set[str]:
        """The adapter names the model server reports as loaded."""
        ...

    async def close(self) -> None: ...
