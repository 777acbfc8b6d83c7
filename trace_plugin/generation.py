"""Prefix-sharing generation with transformers: the one core under serving and training.

The embedded gateway backend (``trace_plugin.gateway.embedded``) and GRPO rollouts
(``training.experts``) both generate for batches of token-id prompts that open alike: an
agent's policy, tool schemas and worked examples, a group's ticket, a conversation's
earlier turns. On a CPU that opening costs more than the reply, so both run it once and
every row continues from its keys and values:

- ``prefill``: the keys and values of a prefix, continuing from a shorter one's;
- ``shared_prefix``: a batch's own common opening, run once and repeated per row
  (training); the gateway keeps prefixes across requests instead
  (``PrefixCache``);
- ``generate_batch``: ``model.generate`` over the rows' remaining tokens, left-padded
  after their cached prefixes, which may differ in length (``continuation_batch``),
  into a preallocated cache (``preallocated``): a batch that starts and ends together
  (a rollout group); the rows' cached prefixes may be their own (``stacked``), such as
  each conversation's keys and values from its previous turn (``row_layers``);
- ``SlotCache``: the cache of a batch that rows join and leave while it decodes (the
  gateway's continuous batching);
- ``TemperatureSampler``: plain temperature sampling for ``generate``, cheaper
  than its own;
- ``Fold``: a LoRA's low-rank product summed into its base weights while many tokens
  are decoded through one fixed adapter (a rollout, an evaluation through one expert).

Sampling settings, stopping, adapters and gradient mode are the callers'. torch and
transformers are imported on use, so the pure helpers cost nothing to import.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

Ids = tuple[int, ...]
# A cache's keys and values, per layer: what a prefix's entry holds.
Layers = list[tuple[Any, Any]]


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix_length(rows: Sequence[Sequence[int]], min_tokens: int = 64) -> int:
    """How many leading tokens all ``rows`` share, leaving each at least one to run; 0 if
    fewer than ``min_tokens`` (a prefill of its own would not pay)."""
    shared = min(min(common_length(rows[0], row) for row in rows), min(map(len, rows)) - 1)
    return shared if shared >= min_tokens else 0


def continuation_batch(
    rows: Sequence[Sequence[int]], skips: Sequence[int], pad: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Input ids and attention mask for a batch run on cached prefixes, row i's first
    ``skips[i]`` tokens.

    The cache holds every row's prefix from position 0, padded to the longest: each row is
    its cached prefix, padding, then the tokens still to run, and the mask keeps the
    padding out (positions count only unmasked tokens, so row i's next token sits at
    ``skips[i]``).
    """
    cached = max(skips, default=0)
    width = cached + max((len(row) - skip for row, skip in zip(rows, skips, strict=True)), default=0)
    ids, mask = [], []
    for row, skip in zip(rows, skips, strict=True):
        gap = width - len(row)
        ids.append([*row[:skip], *[pad] * gap, *row[skip:]])
        mask.append([1] * skip + [0] * gap + [1] * (len(row) - skip))
    return ids, mask


def until_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` up to and including the first ``eos`` (all of them when there is none)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def prefill(model: Any, ids: Sequence[int], *, past: Layers | None = None) -> tuple[Any, Any]:
    """A ``DynamicCache`` holding the keys and values of ``past`` followed by ``ids`` (one
    row), and the logits at its last position (the first reply token's distribution)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=past, config=model.config)
    out = model(
        input_ids=torch.tensor([ids], device=model.device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[0, -1]


def layers(cache: Any) -> Layers:
    """A ``DynamicCache``'s keys and values per layer, as ``prefill`` continues from them."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def shared_prefix(model: Any, rows: Sequence[Sequence[int]], min_tokens: int = 64) -> tuple[int, Any]:
    """The tokens every row of the batch can skip, and their keys and values run once and
    repeated per row (0 and None when they share too little: ``shared_prefix_length``)."""
    skip = shared_prefix_length(rows, min_tokens)
    if not skip:
        return 0, None
    cache, _ = prefill(model, rows[0][:skip])
    cache.batch_repeat_interleave(len(rows))
    return skip, cache


def preallocated(model: Any, prefix: Any, length: int) -> Any:
    """A ``StaticCache`` for ``length`` positions holding ``prefix``'s keys and values.

    A ``DynamicCache`` grows by concatenation, copying every layer's whole cache at every
    decode step; on a CPU, over a long agent prompt, that copying cost a quarter of
    generation. A static cache writes each new position in place.
    """
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    if prefix is not None:
        for layer, (keys, values) in enumerate(prefix if isinstance(prefix, list) else layers(prefix)):
            cache.update(keys, values, layer)
    return cache


def stacked(rows: Sequence[Layers | None]) -> Layers:
    """Rows' own prefixes' keys and values (one row each, of any lengths; None: nothing
    cached) as one batch's cache, each row from position 0 and zero-padded to the longest:
    the layout ``continuation_batch`` runs on, with per-row skips."""
    template = next(row for row in rows if row is not None)
    longest = max(row[0][0].shape[2] for row in rows if row is not None)
    stacked_layers: Layers = []
    for layer, (keys, values) in enumerate(template):
        shape = (len(rows), keys.shape[1], longest, keys.shape[3])
        k, v = keys.new_zeros(shape), values.new_zeros(shape)
        for i, row in enumerate(rows):
            if row is not None:
                length = row[layer][0].shape[2]
                k[i, :, :length], v[i, :, :length] = row[layer][0][0], row[layer][1][0]
        stacked_layers.append((k, v))
    return stacked_layers


def row_layers(cache: Any, row: int, positions: Sequence[int]) -> Layers:
    """Row ``row``'s keys and values at ``positions`` of a batch's cache, as one row of its own."""
    import torch

    index = torch.tensor(positions, device=cache.layers[0].keys.device)
    return [
        (layer.keys[row : row + 1, :, index], layer.values[row : row + 1, :, index]) for layer in cache.layers
    ]


class SlotCache:
    """The keys and values of a decode batch that rows join and leave while it runs.

    Row i of the batch lives in slot i, at its own length: a step writes each row's new
    position at that row's length, and attends each row to its own positions only
    (``step_inputs``). A row joins with its prompt's keys and values (``put``) and
    leaves by having the last row moved into its slot (``move``), so the running rows
    are always slots ``0 .. rows - 1`` and every step is one batch without holes.

    transformers sees it as the model's ``cache``: only ``update`` is called, with the
    explicit positions and 4-D mask the step passes.
    """

    def __init__(self, model: Any, slots: int, capacity: int) -> None:
        import torch

        config = model.config
        heads = config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (slots, getattr(config, "num_key_value_heads", heads), capacity, dim)
        new = lambda: torch.zeros(shape, dtype=model.dtype, device=model.device)  # noqa: E731
        self.keys = [new() for _ in range(config.num_hidden_layers)]
        self.values = [new() for _ in range(config.num_hidden_layers)]
        self.lengths = [0] * slots
        self.rows = 0
        self._at: Any = None  # this step's write positions, one per row
        self._index: Any = None  # and the rows they are in

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    def grow(self, slots: int, capacity: int) -> None:
        """Room for ``slots`` rows of ``capacity`` positions, keeping what every slot holds."""
        old_slots, old_capacity = self.slots, self.capacity
        if slots <= old_slots and capacity <= old_capacity:
            return
        for caches in (self.keys, self.values):
            for layer, cache in enumerate(caches):
                shape = (max(slots, old_slots), cache.shape[1], max(capacity, old_capacity), cache.shape[3])
                grown = cache.new_zeros(shape)
                grown[:old_slots, :, :old_capacity] = cache
                caches[layer] = grown
        self.lengths += [0] * (self.slots - old_slots)

    def put(self, slot: int, kv: Layers) -> None:
        """Slot ``slot`` holds ``kv`` (one row's keys and values per layer) and nothing after."""
        length = kv[0][0].shape[2]
        for layer, (keys, values) in enumerate(kv):
            self.keys[layer][slot, :, :length] = keys[0]
            self.values[layer][slot, :, :length] = values[0]
        self.lengths[slot] = length

    def move(self, source: int, slot: int) -> None:
        """Slot ``slot`` holds what ``source`` holds."""
        length = self.lengths[source]
        for cache in (*self.keys, *self.values):
            cache[slot, :, :length] = cache[source, :, :length]
        self.lengths[slot] = length

    def step_inputs(self) -> tuple[Any, Any]:
        """Position ids and attention mask (over the whole slot) for a step of the running
        rows, one new token each."""
        import torch

        device = self.keys[0].device
        self._index = torch.arange(self.rows, device=device)
        self._at = torch.tensor(self.lengths[: self.rows], device=device)
        visible = torch.arange(self.capacity, device=device)[None, :] <= self._at[:, None]
        return self._at[:, None], visible[:, None, None, :]

    def update(self, keys: Any, values: Any, layer: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """transformers' cache interface: store a step's keys and values, and return the
        running rows' whole slots. Cut to the longest row they would be strided views, which
        the attention kernels copy at every layer of every step (continuous batching then
        gained 1.08x over static batches in one bf16 run, against 1.40x whole); the mask
        hides the positions a row has not reached."""
        rows = self.rows
        self.keys[layer][self._index, :, self._at] = keys[:, :, 0]
        self.values[layer][self._index, :, self._at] = values[:, :, 0]
        return self.keys[layer][:rows], self.values[layer][:rows]

    def advance(self) -> None:
        """After a step: every running row is a position longer."""
        for slot in range(self.rows):
            self.lengths[slot] += 1


class TemperatureSampler:
    """Sampling at ``temperature`` as a logits processor, for ``generate`` run greedily.

    ``generate``'s own sampling (``torch.multinomial``) draws an exponential variate for
    every vocabulary entry of every row: about 3 ms a token for SmolLM2's 49k entries on
    a CPU, a twentieth of a decode step. One uniform per row against the cumulative
    distribution draws from the same distribution. It runs after ``generate``'s own
    processors (banned words) and leaves only the drawn token finite, for the greedy
    step to pick.
    """

    def __init__(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, not {temperature!r}")
        self.temperature = temperature

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        token = draw(torch.softmax(scores.float() / self.temperature, dim=-1))
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


def draw(probs: Any, generator: Any = None) -> Any:
    """A token per row of ``probs`` (shape ``[..., vocab]``, rows not necessarily summing to
    one), as ``[..., 1]``: one uniform per row against the cumulative distribution."""
    import torch

    cdf = probs.cumsum(-1)
    drawn = torch.rand(*probs.shape[:-1], 1, generator=generator, device=probs.device) * cdf[..., -1:]
    token = torch.searchsorted(cdf, drawn, right=True)
    # A draw rounded up to the total falls past the end: take a token with mass instead.
    return torch.where(token < probs.size(-1), token, probs.argmax(-1, keepdim=True))


class Generated(NamedTuple):
    """What ``generate_batch`` ran: ``generate``'s output, the input's width (each row's
    new tokens start there) and the cache it decoded into (every row's keys and values,
    laid out as ``continuation_batch`` laid out the input)."""

    out: Any
    width: int
    cache: Any


def generate_batch(
    model: Any,
    rows: Sequence[Sequence[int]],
    pad: int,
    *,
    skip: int | Sequence[int] = 0,
    cache: Any = None,
    **generate_kwargs: Any,
) -> Generated:
    """``model.generate`` over ``rows``, their first ``skip`` tokens (one count for every
    row, or one per row) already in ``cache`` (a transformers cache, or ``Layers``).

    ``generate_kwargs`` are ``generate``'s (sampling, stopping, adapters), and name
    ``max_new_tokens`` (or a ``generation_config`` that does): the cache is sized by it.
    """
    import torch

    skips = [skip] * len(rows) if isinstance(skip, int) else skip
    ids, mask = continuation_batch(rows, skips, pad)
    new = generate_kwargs.get("max_new_tokens") or generate_kwargs["generation_config"].max_new_tokens
    generate_kwargs["cache"] = static = preallocated(model, cache, len(ids[0]) + new)
    out = model.generate(
        input_ids=torch.tensor(ids, device=model.device),
        attention_mask=torch.tensor(mask, device=model.device),
        **generate_kwargs,
    )
    return Generated(out, len(ids[0]), static)


class Fold:
    """A PEFT model's active LoRA adapters summed into its base weights, until ``restore``.

    Decoding samples many tokens through an adapter that does not change meanwhile, and
    PEFT's separate low-rank path cost a fifth of a CPU decode step. Each adapted layer's
    base weight is swapped for a merged copy (summed in float32, rounded once) and the
    original put back on ``restore``; PEFT's own unmerge would subtract in the base
    dtype and drift. Run the model with its adapters disabled while folded
    (``model.disable_adapter()``), or they would be added twice.
    """

    def __init__(self, model: Any) -> None:
        import torch
        from peft.tuners.lora import Linear

        self._saved: list[tuple[Any, Any]] = []
        try:
            with torch.no_grad():
                for layer in model.modules():
                    if not isinstance(layer, Linear) or layer.merged:
                        continue
                    active = [a for a in layer.active_adapters if a in layer.lora_A]
                    if active:
                        weight = layer.get_base_layer().weight
                        delta = sum(layer.get_delta_weight(a) for a in active)
                        self._saved.append((weight, weight.data))
                        weight.data = (weight.data.float() + delta).to(weight.dtype)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put every base weight back exactly as it was."""
        for weight, data in self._saved:
            weight.data = data
        self._saved = []


@contextmanager
def folded(model: Any) -> Iterator[None]:
    """Inside, ``model`` (a PEFT model) runs as one plain network: W + scale·BA in each adapted layer."""
    fold = Fold(model)
    try:
        with model.disable_adapter():
            yield
    finally:
        fold.restore()
