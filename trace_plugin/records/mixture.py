"""A mixture: the adapters that serve one request, and their weights (TRACE's composition).

A router decides a mixture once from a conversation's opening and holds it for the whole
conversation. The served model is W' = W + Σ_c α_c B_c A_c in every adapted layer; an
empty mixture is the base model, and one adapter at weight 1 is today's single expert.
The learned gate weighs the experts per layer instead, with a slot for the base model:
W'_l = W_l + Σ_c α_{l,c} B_c A_c, where each layer's α and base share sum to 1
(``Mixture.per_layer``).

Weights are quantized to a grid (``GRID``) when a mixture is made, so that nearby
decisions share one composed adapter, its name (``Mixture.served_name``) is
deterministic, and what is recorded is exactly what was served. A mixture's wire form
(``Mixture.label``) is ``refunds@3:0.6,lookup@1:0.4``; a single adapter's is its name;
a per-layer mixture's is its mean weights and a digest of the layers,
``refunds@3:0.55,lookup@1:0.2;layers=3f0c9a1b2e4d``.
Imports no torch: routers, the gateway and the records share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

GRID = 0.05  # weight resolution: 20 steps between 0 and 1
LAYERS = ";layers="  # in a label: what follows is the digest of per-layer weights

_K = TypeVar("_K", bound=Hashable)


def quantized(weights: Mapping[_K, float]) -> dict[_K, float]:
    """``weights`` renormalized to sum to 1 and quantized to the grid, zeros dropped.

    Largest remainders: every share is floored to the grid, then the steps still missing
    go to the largest fractions, so the quantized weights sum to exactly 1.
    """
    if any(not isinstance(w, int | float) or w != w or w < 0 for w in weights.values()):
        raise ValueError(f"mixture weights must be non-negative numbers: {dict(weights)}")
    total = sum(weights.values())
    if total == 0:
        return {}
    exact = {key: w / total / GRID for key, w in weights.items()}
    steps = {key: int(x) for key, x in exact.items()}
    missing = round(1 / GRID) - sum(steps.values())
    for key in sorted(exact, key=lambda k: (steps[k] - exact[k], str(k)))[:missing]:
        steps[key] += 1
    return {key: round(s * GRID, 2) for key, s in steps.items() if s > 0}


@dataclass(frozen=True, slots=True)
class Mixture:
    """Adapter names (versioned or not) and their weights, sorted by name; empty: the base.

    A per-layer mixture also holds ``layers``: per adapter, its weight in each layer. Its
    ``weights`` are then the means over layers, and sum to less than 1 where the base
    model kept a share.
    """

    weights: tuple[tuple[str, float], ...] = ()
    layers: tuple[tuple[str, tuple[float, ...]], ...] = ()

    @classmethod
    def of(cls, weights: Mapping[str, float] | str | None = None) -> Mixture:
        """A mixture from adapter weights (renormalized to sum to 1, then quantized), one
        adapter's name (weight 1), or None (the base model)."""
        if weights is None:
            return cls()
        if isinstance(weights, str):
            return cls(((weights, 1.0),))
        return cls(tuple(sorted(quantized(weights).items())))

    @classmethod
    def per_layer(cls, rows: Sequence[Mapping[str | None, float]]) -> Mixture:
        """A mixture weighed per layer: ``rows[l]`` is layer l's distribution over the base
        model (None) and the adapters, each row quantized on its own. Every row the same
        with no base share is a plain mixture; the base in every row is the base model."""
        layers = [quantized(row) for row in rows]
        names = sorted({name for row in layers for name in row if name is not None})
        if not names:
            return cls()
        if all(row == layers[0] for row in layers) and None not in layers[0]:
            return cls(tuple(sorted(layers[0].items())))  # type: ignore[arg-type]
        per_name = {name: tuple(row.get(name, 0.0) for row in layers) for name in names}
        means = tuple((name, round(sum(ws) / len(ws), 4)) for name, ws in per_name.items())
        return cls(means, tuple(per_name.items()))

    @classmethod
    def parse(cls, label: str | None) -> Mixture:
        """The mixture a ``label`` names, normalized as ``of`` makes every mixture
        (a recorded label comes back unchanged; a client's ``a:3,b:1`` is ``a:0.75,b:0.25``).
        A per-layer mixture's label names it but does not hold it: only its router can."""
        if not label:
            return cls()
        if LAYERS in label:
            raise ValueError(f"a per-layer mixture is decided by its router, not named by a label: {label!r}")
        if ":" not in label:
            return cls.of(label)
        pairs = [part.rpartition(":") for part in label.split(",")]
        try:
            return cls.of({name: float(weight) for name, _, weight in pairs})
        except ValueError:
            raise ValueError(f"not a mixture label (names and non-negative weights): {label!r}") from None

    def __bool__(self) -> bool:
        return bool(self.weights)

    @property
    def adapters(self) -> list[str]:
        return [name for name, _ in self.weights]

    def single(self) -> str | None:
        """The one adapter this mixture is, when it is one at weight 1 in every layer."""
        return self.weights[0][0] if len(self.weights) == 1 and not self.layers else None

    def parts(self) -> list[tuple[str, float | tuple[float, ...]]]:
        """What composing it takes: each adapter with its weight, or its weight per layer."""
        return list(self.layers) if self.layers else list(self.weights)

    def restricted(self, names: Collection[str]) -> Mixture:
        """This mixture without the adapters outside ``names`` (unloaded since it was
        decided): their shares go to the others, or per layer to the base model."""
        if all(name in names for name in self.adapters):
            return self
        if not self.layers:
            return Mixture.of({name: w for name, w in self.weights if name in names})
        kept = [(name, ws) for name, ws in self.layers if name in names]
        rows = [
            {None: max(0.0, 1.0 - sum(ws[layer] for _, ws in kept)), **{n: ws[layer] for n, ws in kept}}
            for layer in range(len(self.layers[0][1]))
        ]
        return Mixture.per_layer(rows)

    def dominant(self) -> Mixture:
        """The one choice with the largest mean share, the base model's included: what a
        mixture amounts to when compared with single choices (an oracle's, say)."""
        shares: dict[str | None, float] = {None: 1.0 - sum(w for _, w in self.weights), **dict(self.weights)}
        return Mixture.of(max(shares, key=lambda name: (shares[name], name is None)))

    def label(self) -> str:
        """The wire form recorded on episodes and responses; "" for the base model."""
        if single := self.single():
            return single
        pairs = ",".join(f"{name}:{weight:g}" for name, weight in self.weights)
        if not self.layers:
            return pairs
        digest = hashlib.sha256(repr(self.layers).encode()).hexdigest()[:12]
        return f"{pairs}{LAYERS}{digest}"

    def resolved(self, versions: Mapping[str, str]) -> Mixture:
        """The same weights on the versions serving each name now (``refunds`` → ``refunds@3``)."""
        return Mixture(
            tuple(sorted((versions.get(n, n), w) for n, w in self.weights)),
            tuple(sorted((versions.get(n, n), ws) for n, ws in self.layers)),
        )

    def served_name(self) -> str:
        """The composed adapter's name in a backend: derived from the label, so the same
        mixture is composed and loaded once however often it is asked for."""
        return "mix-" + hashlib.sha256(self.label().encode()).hexdigest()[:16]
