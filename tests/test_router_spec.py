"""Router specs as models: today's dicts round-trip to the same JSON, so stored digests hold."""

from __future__ import annotations

import json

import pytest

from trace_plugin.gateway.routing import (
    ClassifierRouter,
    ExpertChoice,
    GateRouter,
    KeywordRouter,
    StaticRouter,
    router_from_spec,
    router_version,
)
from trace_plugin.records.router_spec import (
    ClassifierSpec,
    GateSpec,
    RouterSpecError,
    StaticSpec,
    parse_router_spec,
)

# The dicts as the gateway's routers, the improver and training/gate.py built them by hand.
TODAY = [
    {"kind": "static", "adapter": None},
    {"kind": "static", "adapter": "fmt"},
    {"kind": "keyword", "rules": [[["refund", "return"], "returns"], [["order"], "lookup"]], "default": None},
    {"kind": "keyword", "rules": [], "default": "a"},
    {
        "kind": "classifier",
        "experts": [
            {"adapter": "fmt", "name": "tool_call_format", "description": "Emits tool calls."},
            {"adapter": "refusal", "name": "policy_refusal", "description": "policy_refusal"},
        ],
        "threshold": 0.5,
    },
    {
        "kind": "gate",
        "choices": [None, "a", "b"],
        "mean": [0.0, 1.5],
        "scale": [1.0, 0.25],
        "projection": [[0.5, -1.25]],
        "weight": [[[1e-06], [2.0], [0.0]], [[3.5], [0.0], [-1.0]]],
        "bias": [[0.1, -0.2, 0.0], [0.0, 0.0, 0.0]],
    },
]


@pytest.mark.parametrize("spec", TODAY, ids=lambda s: s["kind"])
def test_todays_dicts_round_trip_to_identical_json_and_version(spec):
    model = parse_router_spec(spec)
    assert json.dumps(model.to_dict()) == json.dumps(spec)  # the same keys, in the same order
    assert router_version(model) == router_version(model.to_dict()) == router_version(spec)
    assert parse_router_spec(json.loads(json.dumps(model.to_dict()))) == model
    assert router_from_spec(spec, backend=None).spec == spec  # what the gateway serves and digests


def test_the_routers_specs_are_the_models_wire_form():
    experts = [ExpertChoice("fmt", "tool_call_format", "Emits tool calls.")]
    routers = [
        StaticRouter("a"),
        StaticRouter(None),
        KeywordRouter([(["refund"], "b")], default="a"),
        ClassifierRouter(None, experts, threshold=0.5),
        GateRouter(None, [None, "a"], [0.0], [1.0], [[1.0]], [[[1.0], [0.0]]], [[0.0, 0.0]]),
    ]
    for router in routers:
        assert json.dumps(router_from_spec(router.spec, None).spec) == json.dumps(router.spec)
    assert routers[0].spec == StaticSpec(adapter="a").to_dict() == {"kind": "static", "adapter": "a"}
    assert ClassifierSpec.model_validate(routers[3].spec).experts[0].adapter == "fmt"
    assert router_from_spec(GateSpec.model_validate(routers[4].spec), None).spec == routers[4].spec


def test_invalid_specs_say_what_is_wrong():
    with pytest.raises(RouterSpecError, match="unknown router kind 'x'"):
        parse_router_spec({"kind": "x"})
    with pytest.raises(RouterSpecError, match=r"bad gate router spec: .*weight: Field required"):
        parse_router_spec(
            {
                "kind": "gate",
                "choices": [None, "a"],
                "bias": [[0, 0]],
                "mean": [0],
                "scale": [1],
                "projection": [[1]],
            }
        )
    with pytest.raises(RouterSpecError, match="adapter"):
        parse_router_spec({"kind": "static", "adapter": 5})
    with pytest.raises(RouterSpecError, match="JSON object"):
        parse_router_spec(["static"])  # type: ignore[arg-type]
