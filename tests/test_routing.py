"""Routers: specs, the classifier router on the real base model."""

from __future__ import annotations

import math

import pytest

from trace_plugin.gateway.backend import SamplingParams
from trace_plugin.gateway.routing import (
    ClassifierRouter,
    ExpertChoice,
    KeywordRouter,
    RouterSpecError,
    StaticRouter,
    router_from_spec,
)

EXPERTS = [
    ExpertChoice("fmt@1", "tool_call_format", "Emits tool calls in the expected format."),
    ExpertChoice("refusal@1", "policy_refusal", "Does not attempt what the policy forbids."),
]


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "policy"}, {"role": "user", "content": text}]


async def test_specs_round_trip():
    for router in (StaticRouter("a"), StaticRouter(None), KeywordRouter([(["refund"], "b")], default="a")):
        assert router_from_spec(router.spec, backend=None).spec == router.spec
    assert (
        await router_from_spec({"kind": "keyword", "rules": [[["refund"], "b"]]}, None).route(
            user("a refund please"), None
        )
        == "b"
    )
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
    probabilities = router.probabilities(top)
    assert probabilities == pytest.approx({"A": 0.4 / 0.7, "B": 0.2 / 0.7, "N": 0.1 / 0.7})
    assert router.probabilities({"hello": -0.1}) == {}


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
    prompt = router.prompt("Cancel my order #W1234567.")
    assert "A: tool_call_format" in prompt and "N: none of these" in prompt
    [completion] = await generate(prompt, SamplingParams(max_tokens=1, top_logprobs=20), None)
    probabilities = router.probabilities(completion.top_logprobs[0])
    assert probabilities and sum(probabilities.values()) == pytest.approx(1.0)
    best = max(probabilities, key=probabilities.__getitem__)
    expected = None if best == "N" else {"A": "fmt@1", "B": "refusal@1"}[best]
    conversation = user("Cancel my order #W1234567.")
    assert await router.route(conversation, None) == expected
    # a later turn of the same conversation (a tool result appended) reuses the decision
    assert await router.route([*conversation, {"role": "tool", "content": "{}"}], None) == expected
    assert calls == 1
    strict = ClassifierRouter(backend, EXPERTS, threshold=1.01)  # nothing is ever that sure
    assert await strict.route(conversation, None) is None
