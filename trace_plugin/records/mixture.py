"""A mixture: the adapters that serve one request, and their weights (TRACE's composition).

A router decides a mixture once from a conversation's opening and holds it for the whole
conversation. The served model is W' = W + Σ_c α_c B_c A_c in every adapted layer; an
empty mixture is the base model, and one adapter at weight 1 is today's single expert.

Weights are quantized to a grid (:data:`GRID`) when a mixture is made, so that nearby
decisions share one composed adapter, its name (:meth:`Mixture.served_name`) is
deterministic, and what is recorded is exactly what was served. A mixture's wire form
(:meth:`Mixture.label`) is ``refunds@3:0.6,lookup@1:0.4``; a single adapter's is its name.
Imports no torch: routers, the gateway and the records share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

GRID = 0.05  # weight resolution: 20 steps between 0 and 1


@dataclass(frozen=True, slots=True)
class Mixture:
    """Adapter names (versioned or not) and their weights, sorted by name; empty: the base."""

    weights: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, weights: Mapping[str, float] | str | None = None) -> Mixture:
        """A mixture from adapter weights (renormalized to sum to 1, then quantized), one
        adapter's name (weight 1), or None (the base model)."""
        if weights is None:
            return cls()
        if isinstance(weights, str):
            return cls(((weights, 1.0),))
        if any(not isinstance(w, int | float) or w != w or w < 0 for w in weights.values()):
            raise ValueError(f"mixture weights must be non-negative numbers: {dict(weights)}")
        total = sum(weights.values())
        if total == 0:
            return cls()
        # Largest remainders: floor every share to the grid, then hand the steps still
        # missing to the largest fractions, so the quantized weights sum to exactly 1.
        exact = {name: w / total / GRID for name, w in weights.items()}
        steps = {name: int(x) for name, x in exact.items()}
        missing = round(1 / GRID) - sum(steps.values())
        for name in sorted(exact, key=lambda n: (steps[n] - exact[n], n))[:missing]:
            steps[name] += 1
        return cls(tuple(sorted((n, round(s * GRID, 2)) for n, s in steps.items() if s > 0)))

    @classmethod
    def parse(cls, label: str | None) -> Mixture:
        """The mixture a :meth:`label` names, normalized as :meth:`of` makes every mixture
        (a recorded label comes back unchanged; a client's ``a:3,b:1`` is ``a:0.75,b:0.25``)."""
        if not label:
            return cls()
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
        """The one adapter this mixture is, when it is one at weight 1."""
        return self.weights[0][0] if len(self.weights) == 1 else None

    def label(self) -> str:
        """The wire form recorded on episodes and responses; "" for the base model."""
        if single := self.single():
            return single
        return ",".join(f"{name}:{weight:g}" for name, weight in self.weights)

    def resolved(self, versions: Mapping[str, str]) -> Mixture:
        """The same weights on the versions serving each name now (``refunds`` → ``refunds@3``)."""
        return Mixture(tuple(sorted((versions.get(n, n), w) for n, w in self.weights)))

    def served_name(self) -> str:
        """The composed adapter's name in a backend: derived from the label, so the same
        mixture is composed and loaded once however often it is asked for."""
        return "mix-" + hashlib.sha256(self.label().encode()).hexdigest()[:16]
