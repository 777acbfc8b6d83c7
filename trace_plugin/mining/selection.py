"""TRACE's selection rule: which candidate capabilities the agent demonstrably lacks.

Every labeling run assigns each (episode, capability) pair NA, PRESENT or LACKING. For a
capability, with LF/PF the failed episodes labeled LACKING/PRESENT and LP/PP the
successful ones:

- coverage ``Cov = LF / failed``: how much of the failure it explains;
- ``ER- = LF / (LF + PF)`` and ``ER+ = LP / (LP + PP)``: how often it is missing in failed
  and in successful episodes;
- contrast ``Δ = ER- − ER+``: missing it must go with failing.

A run passes when ``Cov ≥ ρ`` and ``Δ ≥ δ``; a capability is selected when it passes in
at least K of N runs (the paper's defaults: ρ = 0.10, δ = 0.20, K = 8, N = 10). For the
offline miner, whose detectors are deterministic, the N runs are bootstrap resamples of
the episodes. Selected capabilities are ranked by mean Δ, then by mean coverage: with no
success at all, Δ is just the share of applicable failures that lack a capability, and
many tie at 1; the one missing from more of the failures explains more of them.

One extension, ours: a deficit every episode shares has Δ = 0, because successes that
did not need the capability lack it too (a model that cannot format a tool call at all
still "succeeds" where refusing was right). The contrast rule cannot see it, yet it is
the first thing to train. A run also passes *pervasively* when the capability is missing
from at least ``pervasive`` of both the failed and the successful episodes it applies to
(ER- and ER+) and its coverage reaches ρ; K such runs select it, ranked after the
contrastive selections. ``pervasive=None`` is the paper's rule. (Applicable, not all: a
write the agent never makes applies only to the tickets that ask for one, yet where the
rest succeed, refusing being right, the contrast rule cannot see it either.)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Label(StrEnum):
    NA = "NA"
    PRESENT = "PRESENT"
    LACKING = "LACKING"


@dataclass(frozen=True, slots=True)
class SelectionRule:
    rho: float = 0.10  # minimum coverage of failures
    delta: float = 0.20  # minimum contrast
    k: int = 8  # runs that must pass ...
    n: int = 10  # ... out of this many
    pervasive: float | None = 0.9  # missing from this share of failures and successes alike


DEFAULT_RULE = SelectionRule()


@dataclass(frozen=True, slots=True)
class RunMetrics:
    coverage: float
    er_failed: float  # ER-
    er_success: float  # ER+
    lacking_failed: int  # LF
    present_failed: int  # PF
    lacking_success: int  # LP
    present_success: int  # PP

    @property
    def contrast(self) -> float:
        return self.er_failed - self.er_success

    def passes(self, rule: SelectionRule) -> bool:
        return self.coverage >= rule.rho and self.contrast >= rule.delta

    def pervasive(self, rule: SelectionRule) -> bool:
        return (
            rule.pervasive is not None
            and self.coverage >= rule.rho
            and min(self.er_failed, self.er_success) >= rule.pervasive
        )


@dataclass(frozen=True, slots=True)
class Selection:
    capability: str
    runs: tuple[RunMetrics, ...]
    passed: int
    selected: bool
    reason: str = "contrast"  # or "pervasive": see the module docstring

    @property
    def mean_coverage(self) -> float:
        return sum(r.coverage for r in self.runs) / len(self.runs)

    @property
    def mean_contrast(self) -> float:
        return sum(r.contrast for r in self.runs) / len(self.runs)


def run_metrics(labels: Sequence[Label], success: Sequence[bool]) -> RunMetrics:
    """The rule's figures for one capability over episodes (``labels[i]`` for episode i)."""
    lf = pf = lp = pp = 0
    for label, ok in zip(labels, success, strict=True):
        if label is Label.LACKING:
            lp, lf = (lp + 1, lf) if ok else (lp, lf + 1)
        elif label is Label.PRESENT:
            pp, pf = (pp + 1, pf) if ok else (pp, pf + 1)
    failed = sum(1 for ok in success if not ok)
    return RunMetrics(
        coverage=lf / failed if failed else 0.0,
        er_failed=lf / (lf + pf) if lf + pf else 0.0,
        er_success=lp / (lp + pp) if lp + pp else 0.0,
        lacking_failed=lf,
        present_failed=pf,
        lacking_success=lp,
        present_success=pp,
    )


Run = tuple[Mapping[str, Sequence[Label]], Sequence[bool]]  # labels per capability, outcomes


def select(runs: Sequence[Run], rule: SelectionRule = DEFAULT_RULE) -> list[Selection]:
    """Apply the rule to N labeling runs, each a (capability -> labels, outcomes) pair over
    the same episodes in the same order. Returns every capability seen, the selected ones
    first, each group ranked by mean Δ."""
    capabilities = sorted({c for labels, _ in runs for c in labels})
    results = []
    for capability in capabilities:
        metrics = tuple(run_metrics(labels[capability], ok) for labels, ok in runs if capability in labels)
        passed = sum(m.passes(rule) for m in metrics)
        pervasive = sum(m.pervasive(rule) for m in metrics)
        if passed < rule.k and pervasive >= rule.k:
            results.append(Selection(capability, metrics, pervasive, True, "pervasive"))
        else:
            results.append(Selection(capability, metrics, passed, passed >= rule.k))
    return sorted(
        results,
        key=lambda s: (
            not s.selected,
            s.reason != "contrast",
            -s.mean_contrast,
            -s.mean_coverage,
            s.capability,
        ),
    )


def bootstrap_runs(
    labels: Mapping[str, Sequence[Label]], success: Sequence[bool], n: int, *, seed: int = 0
) -> list[Run]:
    """N bootstrap resamples of one deterministic labeling: the offline miner's runs."""
    rng = random.Random(seed)
    count = len(success)
    runs: list[Run] = []
    for _ in range(n):
        picks = [rng.randrange(count) for _ in range(count)]
        runs.append(
            ({c: [values[i] for i in picks] for c, values in labels.items()}, [success[i] for i in picks])
        )
    return runs
