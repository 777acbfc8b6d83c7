"""The learned mixture-of-experts gate: how much of each expert (and of the base) each layer gets.

TRACE's second composition: a small gate on the frozen base model's hidden state, with
the base model and the experts frozen. For each practice task, every choice (the base
model and each expert) is played; the task's label is the choice that scored best
(``oracle_choices``). The gate standardizes the request's embedding
(``trace_plugin.chat_template.gate_input``, embedded by the serving backend), projects
it to a few dimensions shared by all layers, and gives each decoder layer its own softmax
over the choices (``GateRouter``). It is warm-started as
the paper's is, on the supervised labels, every layer fitted to them; the paper's optional
fine-tuning by GRPO on the capability environments is not done here. Small enough to fit
on CPU in seconds, and to store in the router spec that deployments keep.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trace_plugin.chat_template import gate_input
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.records.env_spec import EnvSpec
from trace_plugin.records.router_spec import GateSpec


@dataclass
class GateConfig:
    """How the gate is fitted.

    Args:
        epochs: full-batch passes of Adam; the data is a few hundred rows at most.
        learning_rate: Adam's step size.
        weight_decay: L2 penalty; the embedding has hundreds of dimensions and the
            labels are few, so the gate must stay simple.
        rank: the size of the projection every layer's softmax reads.
        seed: for the initialization.
    """

    epochs: int = 300
    learning_rate: float = 0.05
    weight_decay: float = 1e-2
    rank: int = 16
    seed: int = 0


def oracle_choices(scores: Mapping[str | None, Sequence[float]]) -> list[str | None]:
    """Per task, the choice that scored best; ties go to the base model (None) when it is
    among the best, since it needs no adapter, else to the first best in ``scores``' order."""
    names = list(scores)
    columns = list(zip(*(scores[n] for n in names), strict=True))
    best: list[str | None] = []
    for column in columns:
        top = max(column)
        winners = [n for n, v in zip(names, column, strict=True) if v == top]
        best.append(None if None in winners else winners[0])
    return best


class GateTrainer:
    """Fits a gate to (embedding, best choice) pairs; ``train`` returns its router spec."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()

    def train(
        self,
        embeddings: Sequence[Sequence[float]],
        labels: Sequence[str | None],
        choices: Sequence[str | None],
        layers: int,
    ) -> GateSpec:
        """Every one of ``layers`` softmaxes is fitted to the labels (cross-entropy, averaged)."""
        import torch

        if len(embeddings) != len(labels) or not embeddings:
            raise ValueError("the gate needs one label per embedding, and at least one of each")
        if len(choices) < 2 or choices[0] is not None or None in choices[1:]:
            raise ValueError("the gate chooses between the base model (None, first) and at least one expert")
        if layers < 1:
            raise ValueError(f"the gate needs one layer or more, not {layers}")
        unknown = set(labels) - set(choices)
        if unknown:
            raise ValueError(f"labels that are not choices: {sorted(map(str, unknown))}")
        torch.manual_seed(self.config.seed)
        x = torch.tensor([list(e) for e in embeddings], dtype=torch.float32)
        y = torch.tensor([list(choices).index(label) for label in labels])
        mean, scale = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
        x = (x - mean) / scale
        projection = torch.nn.Linear(x.shape[1], self.config.rank, bias=False)
        weight = torch.nn.Parameter(0.1 * torch.randn(layers, len(choices), self.config.rank))
        bias = torch.nn.Parameter(torch.zeros(layers, len(choices)))
        optimizer = torch.optim.Adam(
            [*projection.parameters(), weight, bias],
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
        )
        for _ in range(self.config.epochs):
            optimizer.zero_grad()
            logits = torch.einsum("nk,lck->lnc", projection(x), weight) + bias[:, None, :]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(choices)), y.repeat(layers))
            loss.backward()
            optimizer.step()
        return GateSpec(
            choices=list(choices),
            mean=_rounded(mean),
            scale=_rounded(scale),
            projection=_rounded(projection.weight),
            weight=_rounded(weight),
            bias=_rounded(bias),
        )


def _rounded(tensor: Any) -> Any:
    """Six significant digits: a gate's spec is stored as JSON with every deployment."""

    def rounded(values: Any) -> Any:
        return [rounded(v) for v in values] if isinstance(values, list) else float(f"{values:.6g}")

    return rounded(tensor.detach().tolist())


Play = Callable[[EnvSpec, str, Sequence[int]], Awaitable[list[float]]]
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]


async def fit_gate(
    specs: Sequence[EnvSpec],
    adapters: Sequence[str],
    play: Play,
    embed: Embed,
    seeds: Sequence[int],
    layers: int,
    config: GateConfig | None = None,
) -> tuple[GateSpec, dict[str, Any]]:
    """Play the base model and every adapter on ``seeds`` of every environment, label each
    task with its best choice, and fit a gate over ``layers`` decoder layers to the tasks'
    requests.

    ``play(spec, model, seeds)`` returns one reward per seed (``model`` is ``"base"`` or an
    adapter name); ``embed`` is the serving backend's. Returns the router spec and a report.
    """
    choices: list[str | None] = [None, *adapters]
    scores: dict[str | None, list[float]] = {choice: [] for choice in choices}
    requests: list[str] = []
    for spec in specs:
        for choice in choices:
            scores[choice] += await play(spec, choice or "base", seeds)
        requests += [SpecEnv(spec).reset(seed).prompt for seed in seeds]
    labels = oracle_choices(scores)
    embeddings = await embed([gate_input(r) for r in requests])
    router = GateTrainer(config).train(embeddings, labels, choices, layers)
    counts = Counter("base" if label is None else label for label in labels)
    return router, {"tasks": len(labels), "labels": dict(counts)}
