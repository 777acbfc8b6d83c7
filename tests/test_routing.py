"""Routers: specs, the classifier router on the real base model."""

from __future__ import annotations

import math

import pytest

from trace_plugin.gateway.backend import Completion, SamplingParams
from trace_plugin.gateway.routing import (
    ClassifierRouter,
    ExpertChoice,
    KeywordRouter,
    RouterSpecError,
    StaticRouter,
    router_from_spec,
    router_version,
)
from trace_plugin.records.mixture import Mixture

EXPERTS = [
    ExpertChoice("fmt@1", "tool_call_format", "Emits tool calls in the expected format."),
    ExpertChoice("refusal@1", "policy_refusal", "Does not attempt what the policy forbids."),
]


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "policy"}, {"role": "user", "content": text}]


async def test_specs_round_trip():
    for router in (StaticRouter("a"), StaticRouter(None), KeywordRouter([(["refund"], "b")], default="a")):
        assert router_from_spec(router.spec, backend=None).spec == router.spec
    assert await router_from_spec({"kind": "keyword", "rules": [[["refund"], "b"]]}, None).route(
        user("a refund please"), None
    ) == Mixture.of("b")
    for bad in ({"kind": "gate"}, {"kind": "classifier", "experts": []}, {"kind": "classifier"}, {}):
        with pytest.raises(RouterSpecError):
            router_from_spec(bad, backend=None)


def test_letter_probabilities_are_renormalized_over_the_options():
    router = ClassifierRouter(backend=None, experts=EXPERTS)
    top = {
        " A": math.log(0.3),
        "A": math.log(0.1),
        "B": math.log(0.2),
        "N": math.log(0.1),
        "the": math.log(0.3),
    }
    probabilities = router.probabilities(top, "AB")
    assert probabilities == pytest.approx({"A": 0.4 / 0.7, "B": 0.2 / 0.7, "N": 0.1 / 0.7})
    assert router.probabilities(top, "A") == pytest.approx({"A": 0.4 / 0.5, "N": 0.1 / 0.5})
    assert router.probabilities({"hello": -0.1}, "AB") == {}


@pytest.mark.slow
async def test_the_base_model_classifies_in_one_forward_pass(embedded_backend):
    calls = 0
    generate = embedded_backend.generate

    async def counting(prompt, params, adapter):
        nonlocal calls
        calls += 1
        assert params.max_tokens == 1 and adapter is None
        return await generate(prompt, params, adapter)

    class Counting:  # the real backend, counting its forward passes
        render = staticmethod(embedded_backend.render)

    backend = Counting()
    backend.generate = counting
    router = ClassifierRouter(backend, EXPERTS, threshold=0.0)
    prompt = router.prompt("Cancel my order #W1234567.", [(e, None) for e in EXPERTS])
    assert "A: tool_call_format" in prompt and "N: none of these" in prompt
    [completion] = await generate(prompt, SamplingParams(max_tokens=1, top_logprobs=20), None)
    probabilities = router.probabilities(completion.top_logprobs[0], "AB")
    assert probabilities and sum(probabilities.values()) == pytest.approx(1.0)
    best = max(probabilities, key=probabilities.__getitem__)
    expected = Mixture.of(None if best == "N" else {"A": "fmt@1", "B": "refusal@1"}[best])
    conversation = user("Cancel my order #W1234567.")
    assert await router.route(conversation, None) == expected
    # a later turn of the same conversation (a tool result appended) reuses the decision
    assert await router.route([*conversation, {"role": "tool", "content": "{}"}], None) == expected
    assert calls == 1
    strict = ClassifierRouter(backend, EXPERTS, threshold=1.01)  # nothing is ever that sure
    assert await strict.route(conversation, None) == Mixture()


# -- retrieval and top-p (TRACE's router) ------------------------------------------------------

THREE = [*EXPERTS, ExpertChoice("lookup@2", "order_lookup", "Looks the order up before acting.")]


def corpus_entry(capability: str, vector: list[float], request: str = "a request") -> dict:
    return {"capability": capability, "request": request, "solution": "get_order(...)", "embedding": vector}


def retrieval_spec(**retrieval) -> dict:
    corpus = [
        corpus_entry("tool_call_format", [1.0, 0.0, 0.0], "fix my call"),
        corpus_entry("tool_call_format", [0.9, 0.1, 0.0]),
        corpus_entry("policy_refusal", [0.0, 1.0, 0.0], "give me a discount"),
        corpus_entry("order_lookup", [0.0, 0.0, 1.0], "where is W1?"),
    ]
    experts = [{"adapter": e.adapter, "name": e.name, "description": e.description} for e in THREE]
    return {"kind": "classifier", "experts": experts, "retrieval": {"corpus": corpus, **retrieval}}


def test_top_p_keeps_the_smallest_nucleus_and_the_base_label_wins_outright():
    router = router_from_spec(retrieval_spec(top_p=0.7), backend=None)
    ab = ["fmt@1", "refusal@1"]
    assert router.decide({"A": 0.5, "B": 0.3, "N": 0.2}, ab) == Mixture.of({"fmt@1": 0.5, "refusal@1": 0.3})
    assert router.decide({"A": 0.75, "B": 0.15, "N": 0.1}, ab) == Mixture.of("fmt@1")  # A alone exceeds p
    assert router.decide({"A": 0.4, "N": 0.35, "B": 0.25}, ab) == Mixture.of("fmt@1")  # N kept: no weight
    assert router.decide({"N": 0.4, "A": 0.35, "B": 0.25}, ab) == Mixture()  # the base is likeliest
    assert router.decide({}, ab) == Mixture()
    everything = router_from_spec(retrieval_spec(top_p=1.0), backend=None)
    assert everything.decide({"A": 0.6, "B": 0.3, "N": 0.1}, ab) == Mixture.of({"fmt@1": 2, "refusal@1": 1})
    top1 = ClassifierRouter(backend=None, experts=EXPERTS, threshold=0.5)
    assert top1.decide({"A": 0.45, "B": 0.35, "N": 0.2}, ab) == Mixture()  # below the threshold
    assert top1.decide({"A": 0.55, "B": 0.35, "N": 0.1}, ab) == Mixture.of("fmt@1")


class Embeddings:
    """A backend whose embedding of every request is one fixed vector."""

    def __init__(self, vector: list[float]) -> None:
        self.vector = vector

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [self.vector for _ in texts]


async def test_retrieval_makes_the_nearest_trajectories_capabilities_the_candidates():
    router = router_from_spec(retrieval_spec(k=2), backend=Embeddings([0.95, 0.05, 0.3]))
    candidates = await router.candidates("whatever")
    # The two nearest entries are both tool_call_format's: one candidate, with its nearest example.
    assert [(e.name, x.request) for e, x in candidates] == [("tool_call_format", "fix my call")]
    wide = router_from_spec(retrieval_spec(k=4), backend=Embeddings([0.1, 0.2, 2.0]))  # not unit length
    assert [e.name for e, _ in await wide.candidates("x")] == [
        "order_lookup",
        "policy_refusal",
        "tool_call_format",
    ]
    prompt_router = router_from_spec(retrieval_spec(k=1), backend=None)
    prompt_router.backend = type("R", (), {"render": staticmethod(lambda m, t: m[0]["content"])})()
    text = prompt_router.prompt("where is it", [(THREE[2], candidates[0][1])])
    assert "A: order_lookup" in text and "'fix my call' was solved by: get_order(...)" in text
    assert "B:" not in text and "N: none of these" in text
    with pytest.raises(RouterSpecError, match="3-d embeddings, got 2"):
        await router_from_spec(retrieval_spec(), backend=Embeddings([1.0, 0.0])).candidates("x")


def test_a_retrieval_spec_round_trips_and_a_top1_spec_keeps_its_digest():
    spec = retrieval_spec(k=3, top_p=0.8)
    router = router_from_spec(spec, backend=None)
    assert router_from_spec(router.spec, backend=None).spec == router.spec
    assert router.spec["retrieval"]["k"] == 3 and len(router.spec["retrieval"]["corpus"]) == 4
    top1 = ClassifierRouter(None, EXPERTS).spec
    assert "retrieval" not in top1  # the wire form (and so the version) of a top-1 router is unchanged
    experts = [{"adapter": e.adapter, "name": e.name, "description": e.description} for e in EXPERTS]
    assert router_version(top1) == router_version(
        {"kind": "classifier", "experts": experts, "threshold": 0.5}
    )
    for bad, needle in (
        ({"corpus": [corpus_entry("nobody", [1.0])]}, "without an expert"),
        (
            {"corpus": [corpus_entry("order_lookup", [1.0]), corpus_entry("order_lookup", [1.0, 0.0])]},
            "one size",
        ),
        ({"corpus": []}, "corpus"),
        ({"corpus": [corpus_entry("order_lookup", [1.0])], "k": 0}, "k"),
        ({"corpus": [corpus_entry("order_lookup", [1.0])], "top_p": 1.5}, "top_p"),
    ):
        with pytest.raises(RouterSpecError, match=needle):
            router_from_spec({**retrieval_spec(), "retrieval": bad}, backend=None)


class Letters:
    """A backend whose classifier's next-token distribution is fixed (and every request's
    embedding, [1, 0, 0]): only the routing decision made of it is under test."""

    def __init__(self, probabilities: dict[str, float]) -> None:
        self.top = {label: math.log(p) for label, p in probabilities.items()}

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return messages[-1]["content"]

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        return [Completion("N", [0], "length", top_logprobs=[self.top])]

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0, 0.0] for _ in texts]


@pytest.mark.parametrize("retrieval", [False, True], ids=["top1", "top_p"])
async def test_where_the_classifier_chooses_none_the_deployment_it_replaces_serves(retrieval):
    """A candidate holding the live expert once served the bare base model whenever its
    classifier said "none", losing what the live agent already did well."""
    live = {"kind": "static", "adapter": "refusal@1"}
    spec = retrieval_spec(k=4) if retrieval else ClassifierRouter(None, THREE).spec
    none = Letters({"N": 0.7, "A": 0.2, "B": 0.1})
    assert await router_from_spec(spec, none).route(user("hello"), None) == Mixture()
    router = router_from_spec({**spec, "fallback": live}, none)
    assert await router.route(user("hello"), None) == Mixture.of("refusal@1")
    assert router.spec["fallback"] == live and router_from_spec(router.spec, none).spec == router.spec
    assert "fallback" not in router_from_spec(spec, none).spec  # a spec without one keeps its digest
    # A clear choice is still the classifier's own.
    sure = Letters({"A": 0.95, "N": 0.05})
    assert await router_from_spec({**spec, "fallback": live}, sure).route(user("hello"), None) == Mixture.of(
        "fmt@1"
    )
