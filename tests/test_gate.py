"""The learned gate: oracle labels, fitting, the router, and the real base model's embeddings."""

from __future__ import annotations

import random

import pytest

from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import TEST_SEEDS, TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.synthesis import synthesize
from trace_plugin.gateway.routing import RouterSpecError, gate_input, router_from_spec
from trace_plugin.records.mixture import Mixture
from training.gate import GateConfig, GateTrainer, fit_gate, oracle_choices


class Embeddings:
    """A backend whose embedding of a request is looked up in a table."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    async def embed(self, texts):
        return [self.table[text] for text in texts]


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "policy"}, {"role": "user", "content": text}]


def test_oracle_labels_are_the_best_choice_and_ties_go_to_the_base():
    scores = {None: [1.0, 0.0, 0.5, 0.0], "a@1": [1.0, 1.0, 0.0, 0.2], "b@1": [0.0, 1.0, 0.9, 0.2]}
    assert oracle_choices(scores) == [None, "a@1", "b@1", "a@1"]


async def test_the_gate_routes_top_one_and_falls_back_below_its_threshold():
    table = {
        gate_input("left"): [-3.0, 0.0],
        gate_input("right"): [3.0, 0.0],
        gate_input("Hello."): [0.1, 0.0],
    }
    spec = {
        "kind": "gate",
        "choices": [None, "a@1"],
        "weight": [[-1.0, 0.0], [1.0, 0.0]],
        "bias": [0.0, 0.0],
        "mean": [0.0, 0.0],
        "scale": [1.0, 1.0],
        "threshold": 0.0,
    }
    gate = router_from_spec(spec, Embeddings(table))
    assert gate.spec == spec
    assert await gate.route(ask("right"), None) == Mixture.of("a@1")
    assert await gate.route(ask("left"), None) == Mixture()
    unsure = router_from_spec({**spec, "threshold": 0.9}, Embeddings(table))
    assert await unsure.route(ask("Hello."), None) == Mixture()  # p(a@1) is 0.55 there
    with pytest.raises(RouterSpecError, match="expects 2-d"):
        await router_from_spec(spec, Embeddings({gate_input("x"): [1.0, 2.0, 3.0]})).route(ask("x"), None)
    for bad in (
        {**spec, "choices": ["a@1"], "weight": [[1.0, 0.0]], "bias": [0.0]},
        {**spec, "weight": [[1.0], [1.0]]},
        {**spec, "scale": [1.0, 0.0]},
        {key: value for key, value in spec.items() if key != "mean"},
    ):
        with pytest.raises(RouterSpecError):
            router_from_spec(bad, None)


async def test_a_fitted_gate_separates_what_its_labels_separate():
    rng = random.Random(0)
    centers = {None: [0.0, 0.0, 0.0], "a@1": [2.0, 0.0, 1.0], "b@1": [0.0, 2.0, -1.0]}

    def sample(label):
        return [c + rng.gauss(0, 0.3) for c in centers[label]]

    labels = [rng.choice(list(centers)) for _ in range(120)]
    spec = GateTrainer(GateConfig(epochs=200)).train([sample(y) for y in labels], labels, list(centers))
    held_out = {f"request {i}": rng.choice(list(centers)) for i in range(60)}
    table = {gate_input(text): sample(label) for text, label in held_out.items()}
    gate = router_from_spec(spec, Embeddings(table))
    right = [await gate.route(ask(text), None) == Mixture.of(label) for text, label in held_out.items()]
    assert sum(right) / len(right) >= 0.95
    with pytest.raises(ValueError, match="base model"):
        GateTrainer().train([[0.0]], ["a@1"], ["a@1", "b@1"])
    with pytest.raises(ValueError, match="not choices"):
        GateTrainer().train([[0.0]], ["c@1"], [None, "a@1"])


def family(kind: str) -> str | None:
    """What a request asks for, as its text shows: a lookup, a return or exchange, or else."""
    if kind == "lookup":
        return "lookup@1"
    return "returns@1" if "return" in kind or "exchange" in kind else None


@pytest.mark.slow
async def test_a_gate_on_the_real_base_models_hidden_state_routes_held_out_requests(embedded_backend):
    def requests(seeds):
        tasks = [RetailEnv().reset(s) for s in seeds]
        return [t.prompt for t in tasks], [family(t.kind) for t in tasks]

    train_text, train_labels = requests(list(TRAIN_SEEDS)[:160])
    test_text, test_labels = requests(list(TEST_SEEDS)[:64])
    embeddings = await embedded_backend.embed([gate_input(t) for t in train_text])
    assert len(embeddings[0]) == embedded_backend.model.config.hidden_size
    assert all(abs(sum(v * v for v in e) - 1.0) < 1e-4 for e in embeddings)  # normalized, as vLLM's
    again = await embedded_backend.embed([gate_input(train_text[0]), gate_input(train_text[1])])
    assert again[0] == pytest.approx(embeddings[0], abs=1e-5)  # batching and padding change nothing

    spec = GateTrainer().train(embeddings, train_labels, [None, "lookup@1", "returns@1"])
    gate = router_from_spec(spec, embedded_backend)
    right = [
        await gate.route(ask(text), None) == Mixture.of(label)
        for text, label in zip(test_text, test_labels, strict=True)
    ]
    majority = max(test_labels.count(label) for label in set(test_labels)) / len(test_labels)
    assert sum(right) / len(right) >= max(0.85, majority + 0.2)


@pytest.mark.slow
async def test_fit_gate_plays_every_choice_and_learns_which_environment_each_wins(embedded_backend):
    """Practice tasks from two synthesized environments; each expert wins its own."""
    specs = [
        synthesize(name, RetailEnv.tools, system_prompt=RetailEnv.system_prompt)
        for name in ("communicating_facts", "policy_refusal")
    ]
    played: list[tuple[str, str]] = []

    async def play(spec, model, seeds):
        played.append((spec.capability, model))
        return [1.0 if model == f"{spec.capability}@x" else 0.0 for _ in seeds]

    adapters = [f"{spec.capability}@x" for spec in specs]
    router, report = await fit_gate(specs, adapters, play, embedded_backend.embed, range(12))
    assert len(played) == 6 and report == {"tasks": 24, "labels": {a: 12 for a in adapters}}
    assert router.choices == [None, *adapters]
    gate = router_from_spec(router, embedded_backend)
    right = 0
    for spec, adapter in zip(specs, adapters, strict=True):
        for seed in range(100, 110):  # held-out practice tasks
            right += await gate.route(ask(SpecEnv(spec).reset(seed).prompt), None) == Mixture.of(adapter)
    assert right / 20 >= 0.9
