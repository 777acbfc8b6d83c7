"""Rows through different LoRA adapters in one forward pass, the way vLLM batches them.

PEFT's mixed batch (``adapter_names``) runs each adapter's rows apart in every LoRA layer:
an index, a cast to float32, two matmuls, a scale and an indexed add, per adapter and per
layer; at decode sizes those small ops cost more than the layers' own work (58% of an
evaluation through mixtures, profiled). Here each layer holds every loaded adapter's
weights stacked (A and B transposed, padded to one rank, the scaling folded into B, in the
model's dtype, as vLLM keeps them), and a forward hook adds every row's delta with one
gather and two batched matmuls, whatever the number of adapters: the punica/S-LoRA scheme
in plain torch. Stack 0 is zeros, for rows on the base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class LoraBatch:
    """Every adapter loaded in a PEFT model, stacked per LoRA layer for batched routing.

    Built afresh after each adapter load or unload. Run the model with PEFT's own LoRA
    layers disabled and no adapter folded in, or the deltas would be added twice.
    """

    def __init__(self, model: Any) -> None:
        import torch
        from peft.tuners.lora import Linear, LoraLayer

        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        names = sorted({name for layer in layers for name in layer.lora_A})
        for layer in layers:
            plain = isinstance(layer, Linear) and not layer.lora_variant and not any(layer.lora_bias.values())
            if not plain and layer.lora_A:
                raise ValueError(
                    "only plain LoRA on linear layers can be served (no DoRA, no LoRA bias, "
                    "no embedding or convolution adapters)"
                )
        self.index: dict[str | None, int] = {None: 0, **{name: i + 1 for i, name in enumerate(names)}}
        rank = max((layer.r[name] for layer in layers for name in layer.lora_A), default=1)
        self._stacks: dict[Any, tuple[Any, Any]] = {}
        self._rows: Any = None
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer().weight
                a = base.new_zeros(len(self.index), base.shape[1], rank)
                b = base.new_zeros(len(self.index), rank, base.shape[0])
                for name in layer.lora_A:
                    r, i = layer.r[name], self.index[name]
                    a[i, :, :r] = layer.lora_A[name].weight.T.to(base.dtype)
                    b[i, :r] = (layer.lora_B[name].weight.float().T * layer.scaling[name]).to(base.dtype)
                self._stacks[layer] = (a, b)
        self._hooks = [layer.register_forward_hook(self._add_deltas) for layer in layers]

    @contextmanager
    def routing(self, adapters: list[str | None]) -> Iterator[None]:
        """Inside, row i of the model's input runs through ``adapters[i]`` (None: the base)."""
        import torch

        self._rows = torch.tensor([self.index[a] for a in adapters])
        try:
            yield
        finally:
            self._rows = None

    def close(self) -> None:
        """Remove the hooks; the model runs as PEFT alone would."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._stacks = [], {}

    def _add_deltas(self, layer: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        if self._rows is None:
            return None
        a, b = self._stacks[layer]
        x = inputs[0].to(a.dtype)
        return output + (x @ a[self._rows]) @ b[self._rows]
