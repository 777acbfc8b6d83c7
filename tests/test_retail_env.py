"""The bundled retail environment: deterministic, isolated, and graded correctly per task type."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_plugin.environments import ToolCall
from trace_plugin.environments.retail import KINDS, POLICY, TEST_SEEDS, TOOLS, TRAIN_SEEDS, RetailEnv

ALL_SEEDS = [*TRAIN_SEEDS, *TEST_SEEDS]
REFUSALS = {"refuse_cancel", "refuse_return"}


def play(seed: int, calls: list[dict]) -> tuple[RetailEnv, list[str]]:
    env = RetailEnv()
    env.reset(seed)
    return env, [env.step(ToolCall(c["name"], c["arguments"])) for c in calls]


def test_splits_are_fixed_disjoint_and_mixed():
    assert len(TRAIN_SEEDS) >= 200 and len(TEST_SEEDS) >= 100
    assert not set(TRAIN_SEEDS) & set(TEST_SEEDS)
    for seeds in (TRAIN_SEEDS, TEST_SEEDS):
        kinds = Counter(RetailEnv().reset(s).kind for s in seeds)
        assert set(kinds) == set(KINDS) and min(kinds.values()) >= len(seeds) // len(KINDS) - 1


@pytest.mark.parametrize("seed", ALL_SEEDS)
def test_reference_scores_one_and_doing_nothing_scores_zero_except_refusals(seed):
    env = RetailEnv()
    task = env.reset(seed)
    assert env.reward("").total == (1.0 if task.kind in REFUSALS else 0.0)
    for call in task.metadata["reference"]:
        assert "error" not in env.step(ToolCall(call["name"], call["arguments"]))
    answer = "Done: " + ", ".join(task.metadata["facts"])
    assert env.reward(answer).total == 1.0
    if task.metadata["facts"]:  # the user must be told the facts
        assert env.reward("Done.").total == 0.0 and env.reward("Done.").components["state"] == 1.0


@pytest.mark.parametrize(
    "seed", [s for s in ALL_SEEDS if RetailEnv().reset(s).kind not in REFUSALS | {"lookup"}][:60]
)
def test_a_wrong_id_in_the_action_scores_zero(seed):
    env = RetailEnv()
    task = env.reset(seed)
    *reads, write = task.metadata["reference"]
    args = json.loads(json.dumps(write["arguments"]))
    if "item_ids" in args and write["name"] == "return_items":
        order = env.world.orders[task.metadata["order_id"]]
        others = [i["item_id"] for i in order["items"] if i["item_id"] not in args["item_ids"]]
        args["item_ids"] = others[:1] or args["item_ids"][:-1] or ["000000"]
    else:  # the same action on another order of the same user, or an id that does not exist
        mine = [o for o in env.world.users[task.metadata["user_id"]]["orders"] if o != args["order_id"]]
        args["order_id"] = mine[0] if mine else "#W0000000"
    for call in [*reads, {"name": write["name"], "arguments": args}]:
        env.step(ToolCall(call["name"], call["arguments"]))
    assert env.reward("Done.").total == 0.0


def test_same_seed_same_world_same_observations():
    calls = RetailEnv().reset(17).metadata["reference"]
    (a, obs_a), (b, obs_b) = play(17, calls), play(17, calls)
    assert obs_a == obs_b and a.world.digest() == b.world.digest() and a.task == b.task
    assert RetailEnv().reset(18).prompt != RetailEnv().reset(17).prompt


def test_instances_share_no_state():
    a, b = RetailEnv(), RetailEnv()
    task = a.reset(1)
    b.reset(1)
    for call in task.metadata["reference"]:
        a.step(ToolCall(call["name"], call["arguments"]))
    assert a.world.digest() != b.world.digest() or task.kind in REFUSALS | {"lookup"}
    assert b.reward("").total == (1.0 if task.kind in REFUSALS else 0.0)


def test_errors_are_observations_and_writes_need_identification():
    env = RetailEnv()
    task = next(t for t in (RetailEnv().reset(s) for s in TRAIN_SEEDS) if t.kind == "cancel")
    env.reset(task.seed)
    order_id = task.metadata["order_id"]
    assert "unknown tool" in env.step(ToolCall("drop_database", {}))
    assert "bad arguments" in env.step(ToolCall("get_order", {"wrong": 1}))
    assert "email must be string" in env.step(ToolCall("find_user", {"email": 5}))
    assert "item_ids must be array" in env.step(
        ToolCall("return_items", {"order_id": order_id, "item_ids": "x"})
    )
    assert "not found" in env.step(ToolCall("get_order", {"order_id": "#W1"}))
    assert "identify the user" in env.step(
        ToolCall("cancel_order", {"order_id": order_id, "reason": "no longer needed"})
    )
    assert env.world.orders[order_id]["status"] == "pending"
    assert ToolCall.from_openai({"function": {"name": "f", "arguments": "{not json"}}).arguments == {
        "__unparsed__": "{not json"
    }


def test_transfer_ends_the_episode():
    env = RetailEnv()
    env.reset(0)
    assert not env.done
    env.step(ToolCall("transfer_to_human", {"summary": "user asked"}))
    assert env.done


def test_prompt_budget_with_the_smollm2_tokenizer():
    """The system policy plus every tool schema, as the shared template renders them.

    Training cost grows with prompt length; the issue's budget for the policy and the tool
    schemas is about 700 tokens. They take 692; the template frames them with its fixed
    tool preamble (116 tokens, byte-identical to TRL's template), 808 in all.
    """
    from transformers import AutoTokenizer

    from trace_plugin.chat_template import render
    from trace_plugin.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model())

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    prompt = render(tokenizer, [{"role": "system", "content": POLICY}], TOOLS)
    schemas = prompt.split("<tools>\n")[1].split("\n</tools>")[0]  # one JSON schema per line
    assert len(schemas.splitlines()) == len(TOOLS)
    assert tokens(POLICY) + tokens(schemas) <= 700
    assert tokens(prompt) <= 820
    assert len(POLICY.split()) <= 300


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from([t["function"]["name"] for t in TOOLS]),
    arguments=st.dictionaries(
        st.sampled_from(["email", "first_name", "last_name", "zip", "user_id", "order_id", "item_ids", "x"]),
        _json,
        max_size=4,
    ),
)
def test_any_arguments_give_an_observation_never_an_exception(name, arguments):
    """The protocol's promise: whatever a model writes, ``step`` answers with text."""
    env = RetailEnv()
    env.reset(3)
    assert isinstance(env.step(ToolCall(name, arguments)), str)
