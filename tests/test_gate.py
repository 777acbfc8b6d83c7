"""The learned per-layer gate: oracle labels, fitting, the router, per-layer mixtures, and the
real base model's embeddings."""

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


async def test_the_gate_weighs_each_layer_on_its_own_and_holds_the_decision():
    """Two layers over (base, a@1, b@1), read from the embedding's first coordinate: layer 0
    follows it, layer 1 leans to the base model; each layer's softmax is quantized alone."""
    table = {gate_input("left"): [-3.0, 0.0], gate_input("right"): [3.0, 0.0], gate_input("flat"): [0.0, 0.0]}
    spec = {
        "kind": "gate",
        "choices": [None, "a@1", "b@1"],
        "mean": [0.0, 0.0],
        "scale": [1.0, 1.0],
        "projection": [[1.0, 0.0]],
        "weight": [[[0.0], [2.0], [-2.0]], [[0.0], [0.0], [0.0]]],
        "bias": [[-20.0, 0.0, 0.0], [1.0, 0.0, 0.0]],
    }
    backend = Embeddings(table)
    gate = router_from_spec(spec, backend)
    assert gate.spec == spec
    right = await gate.route(ask("right"), None)
    # Layer 0: softmax(0, 6, -6) ≈ (0, 1, 0); layer 1: softmax(1, 0, 0) ≈ (0.58, 0.21, 0.21) → 0.6, 0.2, 0.2
    assert right.layers == (("a@1", (1.0, 0.2)), ("b@1", (0.0, 0.2)))
    assert right.weights == (("a@1", 0.6), ("b@1", 0.1)) and right.dominant() == Mixture.of("a@1")
    assert right.single() is None and ";layers=" in right.label()
    left = await gate.route(ask("left"), None)
    assert left.layers == (("a@1", (0.0, 0.2)), ("b@1", (1.0, 0.2))) and left.dominant() == Mixture.of("b@1")
    flat = await gate.route(
        ask("flat"), None
    )  # layer 0 halves between a and b; layer 1 keeps the base's share
    assert flat.layers == (("a@1", (0.5, 0.2)), ("b@1", (0.5, 0.2))) and flat.weights[0] == ("a@1", 0.35)
    assert flat.dominant() == Mixture.of("a@1")  # a tie between experts: the first name
    table[gate_input("right")] = [-3.0, 0.0]
    assert await gate.route(ask("right"), None) == right  # held for the conversation
    with pytest.raises(RouterSpecError, match="expects 2-d"):
        await router_from_spec(spec, Embeddings({gate_input("x"): [1.0, 2.0, 3.0]})).route(ask("x"), None)
    for bad in (
        {**spec, "choices": ["a@1", None, "b@1"]},  # the base's slot comes first
        {**spec, "choices": [None, "a@1"]},  # one weight row per choice
        {**spec, "projection": [[1.0]]},  # the embedding's size
        {**spec, "weight": [[[0.0, 1.0], [2.0, 1.0], [-2.0, 1.0]]] * 2},  # the projection's rank
        {**spec, "bias": [[0.0, 0.0, 0.0]]},  # one bias per layer
        {**spec, "scale": [1.0, 0.0]},
        {key: value for key, value in spec.items() if key != "mean"},
    ):
        with pytest.raises(RouterSpecError):
            router_from_spec(bad, None)


def test_a_per_layer_mixture_is_plain_when_the_layers_agree_and_keeps_the_base_share_apart():
    assert Mixture.per_layer([{None: 0.0, "a": 0.7, "b": 0.3}] * 3) == Mixture.of({"a": 0.7, "b": 0.3})
    assert Mixture.per_layer([{None: 0.98, "a": 0.02}] * 3) == Mixture()  # the base in every layer
    layered = Mixture.per_layer([{None: 0.5, "a": 0.5}, {None: 0.0, "a": 1.0}])
    assert layered.layers == (("a", (0.5, 1.0)),) and layered.weights == (("a", 0.75),)
    assert layered.parts() == [("a", (0.5, 1.0))] and layered.single() is None
    assert layered.label().startswith("a:0.75;layers=")
    other = Mixture.per_layer([{None: 0.5, "a": 0.5}, {None: 0.05, "a": 0.95}])
    assert other.label() != layered.label() and other.served_name() != layered.served_name()
    resolved = layered.resolved({"a": "a@3"})
    assert resolved.layers == (("a@3", (0.5, 1.0)),) and resolved.label().startswith("a@3:0.75;layers=")
    with pytest.raises(ValueError, match="decided by its router"):
        Mixture.parse(layered.label())
    # An adapter unloaded since the decision: its share goes to the base model, layer by layer.
    both = Mixture.per_layer([{None: 0.2, "a": 0.4, "b": 0.4}, {None: 0.0, "a": 0.5, "b": 0.5}])
    assert both.restricted({"a"}).layers == (("a", (0.4, 0.5)),)
    assert both.restricted({"a", "b"}) is both and both.restricted(set()) == Mixture()
    assert Mixture.of({"a": 0.5, "b": 0.5}).restricted({"a"}) == Mixture.of("a")


async def test_a_fitted_gate_separates_what_its_labels_separate():
    rng = random.Random(0)
    centers = {None: [0.0, 0.0, 0.0], "a@1": [2.0, 0.0, 1.0], "b@1": [0.0, 2.0, -1.0]}

    def sample(label):
        return [c + rng.gauss(0, 0.3) for c in centers[label]]

    labels = [rng.choice(list(centers)) for _ in range(120)]
    spec = GateTrainer(GateConfig(epochs=200)).train([sample(y) for y in labels], labels, list(centers), 4)
    assert len(spec.weight) == len(spec.bias) == 4 and len(spec.projection) == GateConfig().rank
    held_out = {f"request {i}": rng.choice(list(centers)) for i in range(60)}
    table = {gate_input(text): sample(label) for text, label in held_out.items()}
    gate = router_from_spec(spec, Embeddings(table))
    decided = {text: await gate.route(ask(text), None) for text in held_out}
    right = [decided[text].dominant() == Mixture.of(label) for text, label in held_out.items()]
    assert sum(right) / len(right) >= 0.95
    with pytest.raises(ValueError, match="base model"):
        GateTrainer().train([[0.0]], ["a@1"], ["a@1", "b@1"], 2)
    with pytest.raises(ValueError, match="base model"):
        GateTrainer().train([[0.0]], ["a@1"], ["a@1", None], 2)
    with pytest.raises(ValueError, match="not choices"):
        GateTrainer().train([[0.0]], ["c@1"], [None, "a@1"], 2)
    with pytest.raises(ValueError, match="one layer or more"):
        GateTrainer().train([[0.0]], ["a@1"], [None, "a@1"], 0)


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

    layers = embedded_backend.model.config.num_hidden_layers
    spec = GateTrainer().train(embeddings, train_labels, [None, "lookup@1", "returns@1"], layers)
    gate = router_from_spec(spec, embedded_backend)
    right = [
        (await gate.route(ask(text), None)).dominant() == Mixture.of(label)
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
    router, report = await fit_gate(specs, adapters, play, embedded_backend.embed, range(12), layers=3)
    assert len(played) == 6 and report == {"tasks": 24, "labels": {a: 12 for a in adapters}}
    assert router.choices == [None, *adapters]
    gate = router_from_spec(router, embedded_backend)
    right = 0
    for spec, adapter in zip(specs, adapters, strict=True):
        for seed in range(100, 110):  # held-out practice tasks
            decided = await gate.route(ask(SpecEnv(spec).reset(seed).prompt), None)
            right += decided.dominant() == Mixture.of(adapter)
    assert right / 20 >= 0.9
