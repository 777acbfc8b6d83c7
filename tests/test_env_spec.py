"""Synthesized environments: the spec language, its interpreter, the synthesizer, validation."""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trace_plugin.environments.base import ToolCall
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import POLICY, TOOLS
from trace_plugin.environments.synthesis import FAMILIES, Observations, observed_preconditions, synthesize
from trace_plugin.environments.validation import Band, adjust, calibrate, check_policies
from trace_plugin.mining.detectors import Trajectory
from trace_plugin.mining.kinds import KINDS, FamilyName
from trace_plugin.records.env_spec import (
    WRITES,
    Column,
    EnvSpec,
    SpecError,
    Table,
    TaskTemplate,
    ToolSpec,
    check_spec,
    parse_spec,
)
from trace_plugin.records.expert import Expert
from trace_plugin.records.router_spec import CorpusEntry
from trace_plugin.store import Store


def _play_reference(env: SpecEnv, seed: int) -> tuple[str, float]:
    task = env.reset(seed)
    for action in task.metadata["reference"]:
        env.step(ToolCall(action["name"], action["arguments"]))
    answer = " ".join(str(f) for f in task.metadata["facts"])
    return task.prompt, env.reward(answer).total


def test_every_kind_names_a_synthesis_family():
    assert {kind.family for kind in KINDS.values()} <= FAMILIES.keys() == set(get_args(FamilyName))


@pytest.mark.parametrize("capability", sorted(KINDS))
def test_every_family_keeps_the_targets_schemas_and_passes_validation(capability):
    spec = synthesize(capability, TOOLS, system_prompt=POLICY)
    by_name = {t["function"]["name"]: t for t in TOOLS}
    assert all(tool.schema_ == by_name[tool.name] for tool in spec.tools)  # names and schemas unchanged
    check = check_policies(spec, range(200))
    assert check.passed, check.problems
    assert check.reference_success == 1.0 and check.do_nothing_mean <= 0.2 and check.random_mean <= 0.2


def test_checks_are_aimed_at_the_capability():
    refusal = SpecEnv(synthesize("policy_refusal", TOOLS, system_prompt=POLICY))
    seed = next(s for s in range(100) if refusal.reset(s).metadata["forbidden"])
    task = refusal.reset(seed)
    read = task.metadata["reference"][0]
    refusal.step(ToolCall(read["name"], read["arguments"]))
    [forbidden] = task.metadata["forbidden"]
    write = refusal.step(ToolCall(forbidden, {**read["arguments"], "reason": "x", "item_ids": ["1"]}))
    reward = refusal.reward(str(task.metadata["facts"][0]))
    assert reward.components["forbidden"] == 0.0 and reward.total < 1.0, write

    grounding = SpecEnv(synthesize("argument_grounding", TOOLS, system_prompt=POLICY))
    task = grounding.reset(5)
    finder, lookup = task.metadata["reference"]
    found = json.loads(grounding.step(ToolCall(finder["name"], finder["arguments"])))
    assert found == [lookup["arguments"]["user_id"]]  # the id to ground comes from the search
    grounding.step(ToolCall(lookup["name"], {"user_id": "U000000"}))  # an invented id
    assert grounding.reward(str(task.metadata["facts"][0])).components["required_calls"] == 0.5


def test_errors_are_observations_and_bad_calls_do_not_count_as_valid():
    env = SpecEnv(synthesize("tool_call_format", TOOLS, system_prompt=POLICY))
    env.reset(0)
    assert "unknown tool" in env.step(ToolCall("drop_tables", {}))
    assert "missing" in env.step(ToolCall("get_order", {}))
    assert "not a JSON object" in env.step(ToolCall("get_order", {"__unparsed__": "{order"}))
    assert "must be string" in env.step(ToolCall("get_order", {"order_id": 7}))
    assert env.reward("").components["valid_calls"] == 0.0


def test_seeds_are_deterministic_and_instances_isolated():
    spec = synthesize("precondition_verification", TOOLS, system_prompt=POLICY)
    a, b = SpecEnv(spec), SpecEnv(spec)
    seed = next(s for s in range(100) if len(a.reset(s).metadata["reference"]) == 2)  # one with a write
    assert a.reset(seed) == b.reset(seed) and a.digest() == b.digest()
    prompt, reward = _play_reference(a, seed)
    assert reward == 1.0 and a.digest() != b.digest()  # a's write did not touch b
    assert b.reset(seed + 1).prompt != prompt


def test_observed_values_replace_the_defaults():
    observed = Observations.from_calls(
        [
            ({"order_id": "#W1234567"}, {"order_id": "#W1234567", "status": "pending"}),
            ({}, {"status": "delivered"}),
        ]
    )
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY, observations=observed)
    assert spec.tables["order"].columns["order_id"].pattern == "#W{d7}"
    assert spec.tables["order"].columns["status"].values == ["delivered", "pending"]
    assert SpecEnv(spec).reset(1).prompt.count("#W") in (0, 1)


def test_a_qualified_id_parameter_is_an_id_of_its_noun():
    """``new_item_ids`` names item ids: exchange tickets once asked for "new item ids new
    item ids 5", a value generated for a free-text parameter of that name."""
    observed = Observations.from_calls([({"item_id": "460452"}, {"item_id": "460452"})])
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY, observations=observed)
    exchange = next(t for t in spec.tasks if t.kind.startswith("exchange"))
    assert exchange.params["new_item_ids"].kind == "id"
    assert exchange.params["new_item_ids"].pattern == exchange.params["item_ids"].pattern == "{d6}"
    prompts = [SpecEnv(spec).reset(seed) for seed in range(32)]
    asked = [t.prompt for t in prompts if t.kind.startswith("exchange")]
    assert asked and not any("new item ids new" in prompt for prompt in asked)


def test_synthesis_is_generic_over_tool_schemas():
    def tool(name, *params):
        properties = {p: {"type": "string"} for p in params}
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                "properties": properties, "required": list(params)}}}  # fmt: skip

    # The same tools under the names agents give them: snake_case, namespaced, camelCase.
    for names in (
        ("get_reservation", "cancel_reservation", "search_flight", "transfer_to_agent"),
        (
            "airline.get_reservation",
            "airline.cancel_reservation",
            "airline.search_flight",
            "airline.transfer",
        ),
        ("getReservation", "cancelReservation", "searchFlight", "transferToAgent"),
    ):
        airline = [
            tool(names[0], "reservation_id"),
            tool(names[1], "reservation_id", "reason"),
            tool(names[2], "origin", "destination"),
            tool(names[3], "summary"),
        ]
        for capability in ("tool_call_format", "precondition_verification", "policy_refusal"):
            spec = synthesize(capability, airline, system_prompt="You are an airline agent.")
            assert {t.name for t in spec.tools} <= set(names[:2]) and spec.tools
            assert check_policies(spec, range(50)).passed


HOSTILE = {
    "unknown behaviour": lambda s: s["tools"][0].update(behaviour="exec"),
    "check on a missing tool": lambda s: s["checks"].append(
        {"kind": "order", "before": "get_order", "after": "rm_rf"}
    ),
    "template calling a missing tool": lambda s: s["tasks"][0]["reference"].append({"tool": "os_system"}),
    "unsatisfiable slot": lambda s: s["tasks"][0]["slots"]["x"].update(where={"status": ["teleported"]}),
    "placeholder for a missing column": lambda s: s["tasks"][0].update(prompt="{x.password}"),
    "oversized state": lambda s: s["tables"]["order"].update(rows=10_000),
    "oversized spec": lambda s: s.update(description="x" * 70_000),
    "unknown field": lambda s: s.update(code="import os"),
    "tool name that is no function name": lambda s: s["tools"][0]["schema"]["function"].update(
        name="rm -rf /"
    ),
    "bad id pattern": lambda s: s["tables"]["order"]["columns"]["order_id"].update(pattern="{__import__}"),
}


@pytest.mark.parametrize("problem", sorted(HOSTILE))
def test_hostile_specs_are_rejected_with_a_reason(problem):
    data = json.loads(synthesize("tool_call_format", TOOLS, system_prompt=POLICY).to_json())
    HOSTILE[problem](data)
    with pytest.raises(SpecError) as error:
        parse_spec(data)
    assert str(error.value)


@pytest.mark.parametrize("garbage", ["", "not json", "[1, 2]", '{"name": 1}', "\x00" * 10])
def test_garbage_is_rejected(garbage):
    with pytest.raises(SpecError):
        parse_spec(garbage)


def test_a_spec_round_trips_through_json():
    spec = synthesize("policy_refusal", TOOLS, system_prompt=POLICY)
    assert parse_spec(spec.to_json()) == spec


# -- property tests over random valid specs -------------------------------------------------

_names = st.from_regex(r"[a-z]{3,8}", fullmatch=True)


@st.composite
def random_specs(draw) -> EnvSpec:
    entity = draw(_names)
    statuses = draw(st.lists(_names, min_size=2, max_size=4, unique=True))
    guard = draw(st.lists(st.sampled_from(statuses), min_size=1, max_size=len(statuses) - 1, unique=True))
    fields = draw(st.lists(_names.filter(lambda n: n not in ("status", "id")), max_size=3, unique=True))
    rows = draw(st.integers(1, 6))
    key = f"{entity}_id"
    schema = lambda name, *params: {  # noqa: E731
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },  # fmt: skip
    }
    data = {
        "name": f"{entity}-env",
        "capability": "property",
        "system_prompt": "Be helpful.",
        "tables": {
            entity: {
                "key": key,
                "rows": rows,
                "columns": {
                    key: {"kind": "id", "pattern": draw(st.sampled_from(["X{d6}", "#{d4}-{d3}", "id_{d8}"]))},
                    "status": {"kind": "choice", "values": statuses},
                    **{
                        f: {"kind": "text", "values": draw(st.lists(_names, min_size=1, max_size=5))}
                        for f in fields
                    },
                },
            }
        },
        "tools": [
            {"schema": schema(f"get_{entity}", key), "behaviour": "lookup", "table": entity, "key": key},
            {
                "schema": schema(f"close_{entity}", key, *fields),
                "behaviour": "update",
                "table": entity,
                "key": key,
                "guard": {"status": guard},
                "sets": {"status": "closed", **{f: f"${f}" for f in fields}},
            },
        ],
        "tasks": [
            {
                "kind": "close",
                "slots": {"x": {"table": entity, "where": {"status": guard}}},
                "params": {f: {"kind": "text", "values": ["new value"]} for f in fields},
                "prompt": f"Close {entity} {{x.{key}}}.",
                "reference": [
                    {"tool": f"get_{entity}", "arguments": {key: f"{{x.{key}}}"}},
                    {
                        "tool": f"close_{entity}",
                        "arguments": {key: f"{{x.{key}}}", **{f: f"{{{f}}}" for f in fields}},
                    },
                ],
            }
        ],
        "checks": [
            {"kind": "final_state", "weight": 2},
            {"kind": "order", "before": f"get_{entity}", "after": f"close_{entity}"},
            {"kind": "required_calls"},
        ],  # fmt: skip
        "difficulty": {"distractor_rows": draw(st.integers(0, 5))},
    }
    return parse_spec(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=random_specs(), seed=st.integers(-(10**9), 10**9))
def test_the_reference_always_succeeds_and_seeds_are_deterministic(spec, seed):
    first, second = SpecEnv(spec), SpecEnv(spec)
    prompt, reward = _play_reference(first, seed)
    assert reward == 1.0
    assert second.reset(seed).prompt == prompt
    assert SpecEnv(spec).reset(seed) == second.reset(seed)


# -- calibration ---------------------------------------------------------------------------


async def test_calibration_adjusts_difficulty_until_in_band():
    spec = synthesize("precondition_verification", TOOLS, system_prompt=POLICY)
    spec = spec.model_copy(update={"difficulty": spec.difficulty.model_copy(update={"distractor_rows": 4})})

    async def play(env: SpecEnv, seed: int) -> float:
        """A stand-in model: without distractors it solves the even seeds; with them, nothing."""
        task = env.task
        if env.spec.difficulty.distractor_rows == 0 and seed % 2 == 0:
            for action in task.metadata["reference"]:
                env.step(ToolCall(action["name"], action["arguments"]))
        return env.reward(" ".join(map(str, task.metadata["facts"]))).total

    calibrated, report = await calibrate(spec, play, seeds=range(8), samples=2, band=Band(informative=0.0))
    assert [(a["in_band"], a["mean_reward"]) for a in report.attempts] == [(False, 0.0), (True, 0.5)]
    assert report.attempts[0]["difficulty"]["distractor_rows"] == 4
    assert calibrated.difficulty.distractor_rows == 0 and report.in_band


def test_adjust_has_a_last_step():
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)
    steps = 0
    while (spec := adjust(spec, 0.0)) is not None:
        steps += 1
    assert 0 < steps < 8  # the ladder ends: easing knobs, then templates halved down to one a kind
    assert (
        adjust(synthesize("tool_call_format", TOOLS, system_prompt=POLICY), 0.95).difficulty.distractor_rows
        == 4
    )


def _ladder(spec: EnvSpec) -> list[EnvSpec]:
    steps = []
    while (spec := adjust(spec, 0.0)) is not None:
        steps.append(spec)
    return steps


def test_easing_multi_step_completion_ends_at_single_calls_stated_in_full_with_partial_credit():
    steps = _ladder(synthesize("multi_step_completion", TOOLS, system_prompt=POLICY))
    single = next(s for s in steps if s.difficulty.single_step)
    assert single.difficulty.name_tools and not any(c.kind == "arguments" for c in single.checks)
    last = steps[-1]
    assert any(c.kind == "arguments" for c in last.checks)
    assert len(last.tasks) == len({t.kind for t in last.tasks})  # one template a kind
    for spec in steps:  # each step still passes validation: doing nothing and random calls fail
        assert check_policies(spec, range(40)).passed
    env = SpecEnv(single)
    for seed in range(20):
        task = env.reset(seed)
        (call,) = task.metadata["reference"]  # one call, the write
        assert call["name"] != "get_order"
        for value in call["arguments"].values():  # the ticket states every value it needs
            assert all(str(v) in task.prompt for v in (value if isinstance(value, list) else [value]))
        assert _play_reference(env, seed)[1] == 1.0
        env.reset(seed)
        env.step(ToolCall("get_order", {"order_id": call["arguments"]["order_id"]}))
        looked_up = env.reward("")  # only looking it up earns little: the write is the point
        assert looked_up.components["final_state"] == 0.0 and looked_up.total < 0.2


def test_partial_credit_rewards_a_call_of_the_right_tool_with_some_right_arguments():
    steps = _ladder(synthesize("multi_step_completion", TOOLS, system_prompt=POLICY))
    credited = next(s for s in steps if any(c.kind == "arguments" for c in s.checks))
    env = SpecEnv(credited)
    task = env.reset(3)
    (call,) = task.metadata["reference"]
    wrong = {k: ("nope" if k != "order_id" else v) for k, v in call["arguments"].items()}
    env.step(ToolCall(call["name"], wrong))
    partly = env.reward("").total
    env.reset(3)
    assert env.reward("").total == 0.0 < partly < 0.5


@pytest.mark.parametrize("capability", ["argument_grounding", "precondition_verification", "policy_refusal"])
def test_easing_never_drops_the_calls_that_are_the_capability(capability):
    for spec in _ladder(synthesize(capability, TOOLS, system_prompt=POLICY)):
        assert not spec.difficulty.single_step


@pytest.mark.parametrize("capability", sorted(KINDS))
def test_easing_keeps_the_writes_of_an_environment_whose_tickets_write(capability):
    """Easing once kept the shortest tickets, again at every attempt: a writes environment
    ended as one lookup, and precondition_verification as "read, don't write" tickets."""

    def writing(spec: EnvSpec) -> list[str]:
        writes = {t.name for t in spec.tools if t.behaviour in WRITES}
        return [t.kind for t in spec.tasks if any(a.tool in writes for a in t.reference)]

    spec = synthesize(capability, TOOLS, system_prompt=POLICY)
    for step in _ladder(spec) if writing(spec) else ():
        assert writing(step), f"{capability}: an easing step left no ticket that writes"


def test_easing_halves_the_phrasings_of_each_kind_and_never_drops_a_kind_of_write():
    """Halving the templates across kinds left a writes environment with two cancellations
    (a headline's cycle 2): the live expert solved it, and the target's returns, exchanges
    and modifications, still failing, were never taught."""
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    # Four phrasings a kind.
    phrased = spec.model_copy(update={"tasks": [t for t in spec.tasks for _ in range(4)]})
    kinds = sorted({t.kind for t in spec.tasks})
    steps = _ladder(phrased)
    assert [sorted({t.kind for t in step.tasks}) for step in steps] == [kinds] * len(steps)
    assert len(steps[-1].tasks) == len(kinds) < len(phrased.tasks)  # down to one template a kind


def test_easing_keeps_every_way_a_ticket_identifies_its_user():
    """Halving a kind's phrasings left a headline's writes environment identifying users by
    email alone (five templates, each "My email is ..."), and its expert, 0.87 on that
    environment, invented an email for every target user who gave a name and a zip."""
    from trace_plugin.environments.synthesis import Precondition

    needs = Precondition(("find_user", "get_order"), "identify the user before changing an order")
    observations = Observations(preconditions={"cancel_order": needs})
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=observations)
    phrased = spec.model_copy(update={"tasks": [t for t in spec.tasks for _ in range(2)]})

    def ways(step: EnvSpec) -> set[tuple[str, tuple[str, ...]]]:
        return {(t.kind, tuple(sorted(t.reference[0].arguments))) for t in step.tasks}

    assert {w for _, w in ways(spec)} == {("email",), ("first_name", "last_name", "zip")}
    steps = _ladder(phrased)
    assert len(steps[-1].tasks) < len(phrased.tasks)
    for step in steps:
        assert ways(step) == ways(spec)


def test_a_read_tool_that_needs_more_than_its_key_is_not_bound_as_a_lookup():
    """A lookup passes only the key: bound as one, ``get_ticket(ticket_id, details)`` would be
    called without ``details`` by the spec's own reference, and the spec rejected."""

    def tool(name: str, *required: str) -> dict:
        properties = {p: {"type": "string"} for p in required}
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {"type": "object", "properties": properties, "required": list(required)},
            },
        }

    tools = [tool("get_ticket", "ticket_id", "details"), tool("get_user", "user_id")]
    spec = synthesize("tool_call_format", tools, system_prompt="Help.")
    assert spec.tool("get_ticket") is None or spec.tool("get_ticket").behaviour != "lookup"
    assert check_policies(spec).passed


# -- storage -------------------------------------------------------------------------------


def test_an_expert_acts_without_hints_if_its_unhinted_reward_rose_as_a_trend_or_was_at_the_top():
    def expert(curve):
        return Expert("a", "c", "c-env", 1, "m", "", {}, unhinted_curve=curve)

    assert expert([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]).learned_unhinted  # the warm start taught it
    assert expert([1.0, 1.0, 1.0, 1.0, 0.75, 1.0]).learned_unhinted
    assert not expert([1.0, 1.0, 1.0, 0.5, 0.75, 0.75]).learned_unhinted  # it fell

    assert expert([None, 0.0, 0.0, 0.25, 0.25]).learned_unhinted
    assert expert([0.1, 0.0, None, 0.2, 0.1, 0.3]).learned_unhinted
    assert not expert([0.0, 0.25, 0.0, 0.0]).learned_unhinted  # one lucky step is not a trend
    assert not expert([0.0, 0.0, 0.25]).learned_unhinted  # too few steps to tell
    assert not expert([0.3, 0.1, 0.2, 0.2]).learned_unhinted
    assert not expert([None, None]).learned_unhinted and not expert([]).learned_unhinted


def test_specs_and_experts_are_stored_and_versioned(db_url):
    store = Store(db_url)
    store.upgrade()
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)
    first = store.save_env_spec("support", spec, "validated", {"reference_success": 1.0})
    harder = spec.model_copy(update={"difficulty": spec.difficulty.model_copy(update={"distractor_rows": 4})})
    second = store.save_env_spec("support", harder, "rejected", {"calibration": {"in_band": False}})
    assert (first.version, second.version) == (1, 2)
    latest = store.env_spec(spec.name)
    assert (
        latest is not None and latest.version == 2 and latest.spec == harder and latest.status == "rejected"
    )
    assert store.env_spec(spec.name, 1).spec == spec
    assert [r.version for r in store.env_specs("support")] == [2, 1]

    expert = Expert("support", "tool_call_format", spec.name, 1, "smollm2", "ab" * 32, {"lr": 3e-4})
    store.save_expert(expert)
    expert.status, expert.reward_curve, expert.adapter_sha256 = "ready", [0.1, 0.4], "cd" * 32
    store.save_expert(expert)
    [loaded] = store.experts("support", status="ready")
    assert loaded.id == expert.id and loaded.reward_curve == [0.1, 0.4] and loaded.config == {"lr": 3e-4}
    assert loaded.corpus == [] and store.experts("support", status="training") == []
    # Its retrieval corpus is kept with it, typed as the router spec holds it.
    entry = CorpusEntry(
        capability="tool_call_format", request="Where is #W1?", solution="get_order()", embedding=[0.5, -1.25]
    )
    expert.corpus, expert.unhinted_curve = [entry], [0.0, None, 0.25]
    store.save_expert(expert)
    assert store.expert(expert.id).corpus == [entry] == store.experts("support")[0].corpus
    assert store.expert(expert.id).unhinted_curve == [0.0, None, 0.25]
    # How many plays its warm start used is kept with it (migration 0009), not only on disk.
    assert store.expert(expert.id).warm_start_plays is None
    expert.warm_start_plays = 29
    store.save_expert(expert)
    assert store.expert(expert.id).warm_start_plays == 29 == store.experts("support")[0].warm_start_plays
    store.close()


def test_write_guards_come_from_the_writes_that_went_through_in_traffic(db_url):
    """The guard was the alphabetically first status observed anywhere ("cancelled"), so the
    environment refused writes its own system prompt allowed. Now it is the status each write
    tool's target showed when a call of it went through; without such a call, the first status
    that reads as open."""
    from trace_plugin.environments.planted import corpus
    from trace_plugin.environments.retail import TRAIN_SEEDS
    from trace_plugin.environments.synthesis import CapturedInterface

    store = Store(db_url)
    store.upgrade()
    episodes = corpus(list(TRAIN_SEEDS)[:40], ("competent",))
    store.write([r for e in episodes for r in (e, *e.steps)])
    captured = CapturedInterface.from_store(store, "planted")
    assert dict(captured.observations.guards) == {
        "cancel_order": ["pending"],
        "modify_address": ["pending"],
        "return_items": ["delivered"],
        "exchange_items": ["delivered"],
    }
    spec = synthesize(
        "multi_step_completion", TOOLS, system_prompt=POLICY, observations=captured.observations
    )
    assert spec.tool("return_items").guard == {"status": ["delivered"]}
    unseen = Observations({"status": ["cancelled", "delivered", "pending"]})
    spec = synthesize("multi_step_completion", TOOLS, system_prompt=POLICY, observations=unseen)
    assert spec.tool("cancel_order").guard == {"status": ["pending"]}  # not "cancelled"
    store.close()


def test_write_preconditions_come_from_the_targets_own_refusals(db_url, monkeypatch):
    """Retail refuses every write until find_user succeeded ("identify the user before
    changing an order"), and the synthesized writes never called it: an expert trained there
    wrote without identifying the user, and the target refused it. The environment now
    refuses as the target does, with the target's words, and its tickets say who the user
    is, as the target's users do."""
    from trace_plugin.environments import planted
    from trace_plugin.environments.retail import TRAIN_SEEDS
    from trace_plugin.environments.synthesis import CapturedInterface

    def skips_identity(task, env):  # writes straight after the read: the target refuses
        calls, texts, answer = planted._competent(task, env)
        return [c for c in calls if c["name"] != "find_user"], texts, answer

    monkeypatch.setitem(planted.POLICIES, "skips_identity", skips_identity)
    store = Store(db_url)
    store.upgrade()
    for policies in (("skips_identity",), ("skips_identity", "competent")):
        agent = "+".join(policies)
        episodes = planted.corpus(list(TRAIN_SEEDS)[:24], policies)
        for e in episodes:
            e.agent = agent
        store.write([r for e in episodes for r in (e, *e.steps)])
        captured = CapturedInterface.from_store(store, agent)
        refused = captured.observations.preconditions["cancel_order"]
        # Refusals alone: the policy sentence worded like the error names find_user. With
        # writes that went through after it, the traffic alone says so.
        assert refused.tools == ("find_user",), agent
        assert refused.error == "identify the user before changing an order"
        spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=captured.observations)
        # Writes the traffic says nothing about need what another write on orders needs.
        assert {t.name: t.requires for t in spec.tools if t.behaviour == "update"} == {
            name: ["find_user"]
            for name in ("cancel_order", "modify_address", "return_items", "exchange_items")
        }
        env, ways = SpecEnv(spec), set()
        for seed in range(16):
            task = env.reset(seed)
            assert task.metadata["satisfiable"], task.metadata["reference_errors"]
            reference = task.metadata["reference"]
            assert reference[0]["name"] == "find_user"
            # Users identify themselves either way, as the search allows: an expert that only
            # ever saw emails skipped find_user on the target's tickets that gave a name.
            found = reference[0]["arguments"]
            ways.add(tuple(found))
            if "email" in found:
                assert f"My email is {found['email']}." in task.prompt
            else:  # in the environment's words or, for some tickets, in the target's users'
                assert any(
                    said in task.prompt
                    for said in (
                        f"My first name is {found['first_name']}, last name is {found['last_name']} "
                        f"and zip is {found['zip']}.",
                        f"I'm {found['first_name']} {found['last_name']}, zip {found['zip']}.",
                    )
                ), task.prompt
            write = reference[-1]
            assert json.loads(env.step(ToolCall(write["name"], write["arguments"]))) == {
                "error": "identify the user before changing an order"
            }
            for action in reference:
                assert "error" not in json.loads(env.step(ToolCall(action["name"], action["arguments"])))
            assert env.reward("done").total == 1.0
        assert ways == {("email",), ("first_name", "last_name", "zip")}, agent
    # One refusal is no rule, and a competent agent's traffic shows no refusal at all.
    competent = planted.corpus(list(TRAIN_SEEDS)[:24], ("competent",))
    trajectories = [Trajectory.from_episode(e) for e in competent]
    assert observed_preconditions(trajectories, POLICY)["cancel_order"].tools == ()
    plays = (Trajectory.from_episode(planted.episode("skips_identity", s)) for s in range(24))
    lone = [t for t in plays if [c.name for c in t.calls if c.error] == ["cancel_order"]]
    assert "cancel_order" not in observed_preconditions(lone[:1], POLICY)
    assert observed_preconditions(lone, POLICY)["cancel_order"].tools == ("find_user",)
    assert "cancel_order" not in observed_preconditions(lone, "")  # nothing links the error to a tool
    store.close()


def test_a_spec_may_require_only_its_own_other_tools():
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    cancel = spec.tool("cancel_order")
    for requires in (["cancel_order"], ["no_such_tool"]):
        broken = spec.model_copy(
            update={
                "tools": [
                    cancel.model_copy(update={"requires": requires}) if t is cancel else t for t in spec.tools
                ]
            }
        )
        with pytest.raises(SpecError, match="requires"):
            check_spec(broken)


def test_preconditions_are_learned_on_a_target_shape_that_is_not_retail():
    """Nothing in the rule is retail's: a clinic whose bookings change only once the member
    was verified, in its own words, and a stateless function-calling target, which writes
    nothing and so needs nothing."""
    from trace_plugin.mining.detectors import Call

    def tool(name: str, *required: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
        properties = {p: {"type": "string"} for p in (*required, *optional)}
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": properties, "required": list(required)}}}  # fmt: skip

    clinic = [
        tool("find_member", optional=("phone", "last_name")),
        tool("get_booking", "booking_id"),
        tool("cancel_booking", "booking_id", "note"),
        tool("change_booking", "booking_id", "slot"),
    ]
    policy = "You book visits.\nVerify the member with find_member before you change a booking.\nBe brief."
    refused = '{"error": "member not verified: verify before changing a booking"}'
    traffic = [
        Trajectory(
            f"cancel B-{i}",
            [
                Call("get_booking", {"booking_id": f"B-{i}"}, '{"booking_id": "B-1", "status": "booked"}'),
                Call("cancel_booking", {"booking_id": f"B-{i}", "note": "sick"}, refused, error=True),
            ],
            tools_offered={t["function"]["name"] for t in clinic},  # as the episode recorded them
        )
        for i in range(3)
    ]
    [precondition] = observed_preconditions(traffic, policy).values()
    assert precondition.tools == ("find_member",) and precondition.error.startswith("member not verified")
    spec = synthesize(
        "write_completion",
        clinic,
        system_prompt=policy,
        observations=Observations(preconditions={"cancel_booking": precondition}),
    )
    assert {t.name: t.requires for t in spec.tools if t.behaviour == "update"} == {
        "cancel_booking": ["find_member"],
        "change_booking": ["find_member"],  # another write on bookings, unseen in traffic
    }
    env = SpecEnv(spec)
    task = env.reset(0)
    [identify, *_, write] = task.metadata["reference"]
    assert (
        identify["name"] == "find_member" and f"My phone is {identify['arguments']['phone']}." in task.prompt
    )
    assert json.loads(env.step(ToolCall(write["name"], write["arguments"])))["error"].startswith(
        "member not verified"
    )
    # A function-calling target: stateless tools, nothing written, nothing required.
    calls = [
        Trajectory("convert 3 km", [Call("convert_units", {"value": 3, "unit": "km"}, '{"result": 1.86}')])
    ]
    assert observed_preconditions(calls * 3, "Use the tools.") == {}


def _skips_identity(task, env):
    """Retail's competent plays less ``find_user``: the target refuses their writes, and its
    traffic then shows that the search is required."""
    from trace_plugin.environments import planted

    calls, texts, answer = planted._competent(task, env)
    return [c for c in calls if c["name"] != "find_user"], texts, answer


def _captured(url: str, monkeypatch, policies: tuple[str, ...]):
    """A store holding 48 retail train tasks played by ``policies`` (``skips_identity``
    among them, if named), and the interface captured from it."""
    from trace_plugin.environments import planted
    from trace_plugin.environments.retail import TRAIN_SEEDS
    from trace_plugin.environments.synthesis import CapturedInterface

    monkeypatch.setitem(planted.POLICIES, "skips_identity", _skips_identity)
    store = Store(url)
    store.upgrade()
    episodes = planted.corpus(list(TRAIN_SEEDS)[:48], policies)
    store.write([r for e in episodes for r in (e, *e.steps)])
    return store, CapturedInterface.from_store(store, episodes[0].agent)


def test_the_environment_answers_as_the_target_answers(sqlite_url, monkeypatch):
    """The headline's writes expert learned an environment whose ``find_user`` answered a
    list of ids and whose ``get_order`` a flat row; on the target, which answers one user id
    and an order with its address nested, it looped ``find_user``, ``get_order`` until its
    turns ran out. The environment now lays its answers out as the target's traffic shows
    them, and a write leaves the status word the target uses ("cancelled")."""
    store, captured = _captured(sqlite_url, monkeypatch, ("skips_identity", "competent"))
    observations = captured.observations
    assert observations.shapes["find_user"] == ""
    address = {"address1": "address1", "city": "city", "zip": "zip"}
    assert observations.shapes["get_order"]["address"] == address
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=observations)
    env, seen = SpecEnv(spec), set()
    for seed in range(16):
        task = env.reset(seed)
        for action in task.metadata["reference"]:
            answer = json.loads(env.step(ToolCall(action["name"], action["arguments"])))
            seen.add(action["name"])
            if action["name"] == "find_user":
                assert answer in env.rows["user"]  # one user id, as the target answers
            if action["name"] == "get_order":
                assert list(answer)[:3] == ["order_id", "status", "address"], answer
                assert set(answer["address"]) == {"address1", "city", "zip"}
            if action["name"] == "cancel_order":
                assert answer == {"order_id": action["arguments"]["order_id"], "status": "cancelled"}
        assert env.reward("done").total == 1.0
    assert {"find_user", "get_order", "cancel_order"} <= seen
    # A shape is data the interpreter lays out, never more: a hostile one is refused.
    deep: Any = "status"
    for _ in range(6):
        deep = {"a": deep}
    get_order = spec.tool("get_order").model_dump(by_alias=True)
    with pytest.raises(ValidationError, match="deep"):
        ToolSpec.model_validate({**get_order, "returns": deep})
    with pytest.raises(ValidationError, match="column names"):
        ToolSpec.model_validate({**get_order, "returns": {"a": 3}})
    find_user = spec.tool("find_user").model_copy(update={"returns": "nope"})
    tools = [find_user if t.name == "find_user" else t for t in spec.tools]
    with pytest.raises(SpecError, match="answers one column"):
        check_spec(spec.model_copy(update={"tools": tools}))
    store.close()


def test_tickets_are_also_worded_as_the_targets_users_word_them(sqlite_url, monkeypatch):
    """The quick demo's expert, taught "Please cancel my order #W… (reason …). My first
    name is …, last name is … and zip is …", searched by name without the zip on the
    target's "I'm Kenji Lopez, zip 78701" and never wrote. Tickets are now also worded as
    captured requests were, every value they state drawn anew, and still solvable."""
    store, captured = _captured(sqlite_url, monkeypatch, ("skips_identity", "competent"))
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=captured.observations)
    cancels = {t.prompt: t.weight for t in spec.tasks if t.kind == "cancel_order"}
    users = (
        "Please cancel my order {x.order_id}, reason: {reason}. "
        "I'm {p0.first_name} {p0.last_name}, zip {p0.zip}."
    )
    assert (
        users in cancels
        and "Please ship order {x.order_id} to {address1}, {city} {zip} instead. My email is {p0.email}."
        in {t.prompt for t in spec.tasks}
    )
    assert sum(cancels.values()) == pytest.approx(1.0) and len(spec.tasks) <= 16
    # No wording of one write is given to another: an exchange is never worded as a return.
    for template in spec.tasks:
        verb = template.kind.split("_")[0]
        assert verb in template.prompt.lower() or template.prompt.startswith("Please ship"), template.prompt
    env, worded = SpecEnv(spec), 0
    for seed in range(64):
        task = env.reset(seed)
        assert task.metadata["satisfiable"], task.metadata["reference_errors"]
        if "I'm " not in task.prompt:
            continue
        worded += 1
        found = task.metadata["reference"][0]["arguments"]
        assert f"I'm {found['first_name']} {found['last_name']}, zip {found['zip']}." in task.prompt
        for action in task.metadata["reference"]:
            assert "error" not in json.loads(env.step(ToolCall(action["name"], action["arguments"])))
        assert env.reward("done").total == 1.0
    assert worded
    store.close()


def test_a_lookup_is_also_worded_as_users_ask_it_who_they_are_included_and_never_as_a_change(
    sqlite_url,
):
    """The headline's lookups environment asked "What is the status of order …?", where the
    target's users ask "What is the status of my order …? My email is …": its router corpus
    lay far from them, and all six reported lookups went to the writes expert. A captured
    wording that states a ticket's values and who the user is fits it too (the identity
    drawn from a row of its own); one that names a change ("I want to return …") does not.
    Calibration's easing once cut it back to "What is the status of order …?": the users'
    wordings now come first, and easing keeps the first."""
    from trace_plugin.environments import planted
    from trace_plugin.environments.retail import TRAIN_SEEDS
    from trace_plugin.environments.synthesis import CapturedInterface

    store = Store(sqlite_url)
    store.upgrade()
    episodes = planted.corpus(list(TRAIN_SEEDS)[:48], ("competent",))
    store.write([r for e in episodes for r in (e, *e.steps)])
    captured = CapturedInterface.from_store(store, episodes[0].agent)
    spec = synthesize("communicating_facts", TOOLS, system_prompt=POLICY, observations=captured.observations)
    prompts = {t.prompt for t in spec.tasks if t.kind == "lookup_order"}
    assert {
        "What is the status of my order {x.order_id}? My email is {p0.email}.",
        "What is the status of my order {x.order_id}? I'm {p0.first_name} {p0.last_name}, zip {p0.zip}.",
    } <= prompts
    assert not [p for p in prompts if re.search(r"\b(return|cancel|exchange|modify)", p, re.I)], prompts
    env, identified = SpecEnv(spec), 0
    for seed in range(32):
        task = env.reset(seed)
        assert task.metadata["satisfiable"], task.metadata["reference_errors"]
        if "My email is " in task.prompt:
            identified += 1
            email = task.prompt.split("My email is ")[1].rstrip(".")
            assert email in {row["email"] for row in env.rows["user"].values()}  # a user of its world
        for action in task.metadata["reference"]:
            assert "error" not in json.loads(env.step(ToolCall(action["name"], action["arguments"])))
        assert env.reward(" ".join(task.metadata["facts"])).total == 1.0
    assert identified
    # Easing keeps how users ask: down to one template, a lookup that says who is asking.
    steps = _ladder(spec)
    assert len(steps[-1].tasks) == 1 < len(spec.tasks)
    for step in steps:
        assert any(t.kind == "lookup_order" and "{p0." in t.prompt for t in step.tasks), step.tasks
    # The writes keep their own wordings: a cancellation is worded as users ask for one.
    writes = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=captured.observations)
    for template in writes.tasks:
        assert template.kind.split("_")[0] in template.prompt.lower() or "ship" in template.prompt
    store.close()


def test_emails_come_from_the_requests_where_the_agents_calls_show_none(sqlite_url, monkeypatch):
    """The quick demo's agent never found a user by email, so the environment made emails
    up ("mia.novak@example.com"), and its expert read the target's "noah.okafor37@…" as a
    first and a last name. Users state their emails in their requests: those are the pool."""
    store, captured = _captured(sqlite_url, monkeypatch, ("skips_identity",))
    observations = captured.observations
    assert len(observations.values.get("email", ())) < 3  # the agent's calls show (almost) none
    stated = {e for r in observations.requests for e in re.findall(r"[\w.+-]+@[\w.-]+\.\w+", r)}
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=observations)
    emails = spec.tables["user"].columns["email"].values
    assert len(emails) >= 3 and set(emails) <= stated
    store.close()


def test_a_request_is_worded_with_the_longest_value_first():
    from trace_plugin.environments.synthesis import as_users_ask, ticket_phrasing, vocabulary

    tables = [
        Table(
            key="user_id",
            columns={
                "user_id": Column(kind="id", pattern="U{d4}"),
                "email": Column(kind="text", values=["ava.lopez@example.com"]),
                "first_name": Column(kind="text", values=["Ava", "Kenji"]),
            },
        )
    ]
    words = vocabulary(tables)
    assert (
        ticket_phrasing("I'm Kenji {really}, user U1234, email kenji.rossi@example.com.", words)
        == "I'm {first_name} (really), user {user_id}, email {email}."
    )
    # A hostile request (longer than a ticket may be) words nothing; a fitting one does.
    template = TaskTemplate(kind="close_user", slots={"x": {"table": "user"}}, prompt="Close {x.user_id}.")
    fitting, hostile = "Please close U1234.", "Please close U1234. " + "x" * 10_000
    assert [t.prompt for t in as_users_ask([template], [hostile], words)] == ["Close {x.user_id}."]
    worded = as_users_ask([template], [fitting, hostile], words)
    assert [(t.prompt, t.weight) for t in worded] == [
        ("Please close {x.user_id}.", 0.5),  # the users' wording first: easing keeps it
        ("Close {x.user_id}.", 0.5),
    ]


def test_a_required_lookup_of_the_written_row_is_the_tickets_own_row():
    """The headline's traffic showed cancels going through after find_user and get_order,
    so both became the write's precondition, and get_order was given a row of its own: the
    tickets named a second order ("My order id is ...") that the reference then read. The
    written row is the one to read."""
    from trace_plugin.environments.synthesis import Precondition

    needs = Precondition(("find_user", "get_order"), "identify the user before changing an order")
    observations = Observations(preconditions={"cancel_order": needs})
    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY, observations=observations)
    assert {t.name: t.requires for t in spec.tools}["cancel_order"] == ["find_user", "get_order"]
    env = SpecEnv(spec)
    for seed in range(16):
        task = env.reset(seed)
        assert task.metadata["satisfiable"], task.metadata["reference_errors"]
        reference = task.metadata["reference"]
        written = reference[-1]["arguments"]["order_id"]
        assert [a["arguments"]["order_id"] for a in reference if a["name"] == "get_order"] == [written]
        assert "My order id is" not in task.prompt, task.prompt


def test_a_routers_corpus_holds_every_kind_of_task_asked_plainly():
    """Drawn by weight, the first four writes are three kinds (two cancellations); a router's
    corpus takes the kinds in turn, and asks as users ask even where the level names tools."""
    from trace_plugin.environments.interpreter import corpus_plays
    from trace_plugin.environments.validation import plainly_asked
    from trace_plugin.improver.config import CORPUS_SEEDS

    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    kinds = sorted({t.kind for t in spec.tasks})
    assert len(kinds) == 4 and len({SpecEnv(spec).reset(s).kind for s in CORPUS_SEEDS[:4]}) < 4
    named = spec.model_copy(update={"difficulty": spec.difficulty.model_copy(update={"name_tools": 1.0})})
    assert " Use " in SpecEnv(named).reset(CORPUS_SEEDS[0]).prompt
    plain = plainly_asked(named)
    plays = corpus_plays(plain, CORPUS_SEEDS, 8)
    kind_of = {(task := SpecEnv(plain).reset(s)).prompt: task.kind for s in CORPUS_SEEDS}
    assert sorted(kind_of[request] for request, _ in plays) == sorted(kinds * 2)  # each kind twice
    assert not any(" Use " in request for request, _ in plays)
    assert all("(" in solution for _, solution in plays)
