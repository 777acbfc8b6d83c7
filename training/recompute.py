"""Activation recomputation for loss passes that continue from a shared prompt's keys and values.

GRPO's loss pass runs a group's prompt once and each rollout from its keys and values
(``training.experts.shared_prefix_logps``), and the warm start does the same for a
batch's common opening (``training.warm_start.opening_once_forward``). Backward then
needs every decoder layer's activations for every token: about 76 KB a token a layer for
SmolLM2-135M in bf16 with LoRA on every linear layer (PEFT runs adapters in float32, so
each adapted projection keeps a float32 copy of its input), 13.5 GB for four rollouts of
2,400 tokens. Recomputing each layer in backward keeps only the layers' inputs.

transformers' gradient checkpointing drops the cache, because a layer that writes its keys
and values would write them again when backward replays it. ``ReplayCache`` writes
nothing: it returns the held prefix's keys and values followed by the new ones, and keeps
the first keys and values each layer computed, so a replay reads what the forward read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from trace_plugin.generation import Layers


class ReplayCache(DynamicCache):
    """A cache that a checkpointed pass may run through twice (forward, then backward's replay).

    ``update`` stores nothing: it returns ``past`` (the prefix's keys and values, per layer)
    followed by the new states, and keeps each layer's first new states in ``captured``:
    the prompt's keys and values when the pass is the prompt's.
    """

    def __init__(self, config: Any, past: Layers | None = None) -> None:
        super().__init__(ddp_cache_data=past, config=config)
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.captured.setdefault(layer_idx, (key_states, value_states))
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is None or not layer.is_initialized:
            return key_states, value_states
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)

    def layers_kv(self, rows: int) -> Layers:
        """What the pass captured, each layer's keys and values repeated for ``rows`` rows."""
        return [
            (keys.expand(rows, *keys.shape[1:]), values.expand(rows, *values.shape[1:]))
            for keys, values in (self.captured[i] for i in range(len(self.captured)))
        ]


class SharedPrefix:
    """A prefix (a group's prompt, a batch's opening) run once through ``model``'s decoder
    into a ``ReplayCache``; ``cache(rows)`` is what ``rows`` continuations of it read, its
    keys and values repeated, through which gradients reach the prefix's LoRA weights. The
    one place both loss passes share it from."""

    def __init__(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        from peft import PeftModel

        unwrapped = model.get_base_model() if isinstance(model, PeftModel) else model
        self.config = unwrapped.config
        self.kv = ReplayCache(self.config)
        # the cache is read by every layer, use_cache or not
        unwrapped.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, cache=self.kv)

    def cache(self, rows: int) -> ReplayCache:
        return ReplayCache(self.config, self.kv.layers_kv(rows))


@contextmanager
def recomputed(model: Any) -> Iterator[None]:
    """Inside, a training pass through ``model``'s decoder layers keeps only their inputs and
    replays each layer in backward (non-reentrant ``torch.utils.checkpoint``), reading its
    cache, which must be a ``ReplayCache``."""
    from peft import PeftModel

    unwrapped = model.get_base_model() if isinstance(model, PeftModel) else model
    layers = unwrapped.get_decoder().layers
    saved = [
        (layer.gradient_checkpointing, layer.__dict__.get("_can_checkpoint_with_cache")) for layer in layers
    ]
    replay = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    try:
        for layer in layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = replay
            layer._can_checkpoint_with_cache = True  # a ReplayCache is read, never written
        yield
    finally:
        for layer, (on, with_cache) in zip(layers, saved, strict=True):
            layer.gradient_checkpointing = on
            if with_cache is None:
                layer.__dict__.pop("_can_checkpoint_with_cache", None)
            else:
                layer._can_checkpoint_with_cache = with_cache
