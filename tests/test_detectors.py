"""Capability detectors on real retail-environment conversations with known behaviour."""

from __future__ import annotations

import json

import pytest

from trace_plugin.environments import ToolCall
from trace_plugin.environments.planted import play
from trace_plugin.environments.retail import TOOLS, TRAIN_SEEDS, RetailEnv
from trace_plugin.mining.detectors import Trajectory, guess_role
from trace_plugin.mining.kinds import label_episode
from trace_plugin.mining.selection import Label
from trace_plugin.records.trajectory import Episode, Step

L, P, NA = Label.LACKING, Label.PRESENT, Label.NA
OFFERED = {t["function"]["name"] for t in TOOLS}


def task_of(kind: str):
    return next(t for t in (RetailEnv().reset(s) for s in TRAIN_SEEDS) if t.kind == kind)


def converse(seed: int, calls: list[dict], answer: str | None, *, preface: str | None = None) -> Trajectory:
    """Play ``calls`` in the real environment and build the OpenAI conversation they make."""
    env = RetailEnv()
    task = env.reset(seed)
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": task.prompt}]
    messages += play(env, calls, [preface] if preface is not None else [])
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return Trajectory.from_messages(messages, OFFERED)


def test_roles_are_guessed_from_names_and_overridable():
    assert [guess_role(n) for n in ("get_order", "find_user", "cancel_order", "exchangeItems", "ping")] == [
        "read",
        "read",
        "write",
        "write",
        "other",
    ]
    assert guess_role("ping", {"ping": "read"}) == "read"


def test_a_competent_episode_lacks_nothing():
    task = task_of("exchange_item")
    labels = label_episode(converse(task.seed, task.metadata["reference"], "Done: exchange requested."))
    assert L not in labels.values()
    assert labels["precondition_verification"] is P and labels["argument_grounding"] is P
    assert labels["error_recovery"] is NA


def test_writing_without_looking_first():
    task = task_of("cancel")
    find, _look, cancel = task.metadata["reference"]
    labels = label_episode(converse(task.seed, [find, cancel], "Cancelled."))
    assert labels["precondition_verification"] is L
    assert labels["argument_grounding"] is P  # the order id came from the user's ticket


def test_invented_ids():
    task = task_of("return_item")
    *reads, write = task.metadata["reference"]
    wrong = {**write, "arguments": {**write["arguments"], "item_ids": ["123456"]}}
    labels = label_episode(converse(task.seed, [*reads, wrong], "Return requested."))
    assert labels["argument_grounding"] is L
    assert labels["error_recovery"] is L or labels["policy_refusal"] is L


def test_attempting_what_the_policy_forbids_vs_refusing():
    task = task_of("refuse_cancel")
    find, look = task.metadata["reference"]
    forbidden = {
        "name": "cancel_order",
        "arguments": {"order_id": task.metadata["order_id"], "reason": "no longer needed"},
    }
    tried = label_episode(converse(task.seed, [find, look, forbidden], "Sorry, it failed."))
    assert tried["policy_refusal"] is L
    refused = label_episode(converse(task.seed, [find, look], "Sorry, I cannot cancel a delivered order."))
    assert refused["policy_refusal"] is P and refused["multi_step_completion"] is P


def test_a_write_refused_for_a_skipped_precondition_is_not_a_policy_refusal():
    """ "identify the user before changing an order" means a step was skipped, not that the
    policy forbids the change: it was once labelled a policy refusal, and a refused write
    counted as the request carried through."""
    task = task_of("cancel")
    _find, look, cancel = task.metadata["reference"]
    labels = label_episode(converse(task.seed, [look, cancel], "Sorry, I cannot cancel it."))
    assert labels["precondition_verification"] is L and labels["policy_refusal"] is NA
    assert labels["multi_step_completion"] is L and labels["write_completion"] is L


def test_write_completion_reads_what_the_user_asked_for():
    task = task_of("cancel")
    find, look, cancel = task.metadata["reference"]
    assert label_episode(converse(task.seed, [find, look, cancel], "Cancelled."))["write_completion"] is P
    other = {
        "name": "modify_address",
        "arguments": {
            "order_id": task.metadata["order_id"],
            "address1": "1 Elm St",
            "city": "Austin",
            "zip": "78701",
        },
    }
    wrong = label_episode(converse(task.seed, [find, look, other], "Done."))
    assert (
        wrong["write_completion"] is L and wrong["multi_step_completion"] is P
    )  # it wrote, not what was asked
    assert label_episode(converse(task.seed, [find, look], "Here is your order."))["write_completion"] is L
    # The policy forbids it: declining, or a write the policy refused, is the policy's case.
    forbidden = task_of("refuse_cancel")
    find, look = forbidden.metadata["reference"]
    declined = converse(forbidden.seed, [find, look], "Sorry, I cannot cancel a delivered order.")
    assert label_episode(declined)["write_completion"] is NA
    tried = {
        "name": "cancel_order",
        "arguments": {"order_id": forbidden.metadata["order_id"], "reason": "no longer needed"},
    }
    assert (
        label_episode(converse(forbidden.seed, [find, look, tried], "It failed."))["write_completion"] is NA
    )
    invented = {**cancel, "arguments": {**cancel["arguments"], "order_id": "#W0000001"}}
    assert label_episode(converse(task.seed, [find, look, invented], "Done."))["write_completion"] is NA
    lookup = task_of("lookup")
    assert (
        label_episode(converse(lookup.seed, lookup.metadata["reference"], "Shipped."))["write_completion"]
        is NA
    )


def test_stopping_after_the_lookups():
    task = task_of("modify_address")
    find, look, _modify = task.metadata["reference"]
    labels = label_episode(converse(task.seed, [find, look], "Here is your order."))
    assert labels["multi_step_completion"] is L


def test_broken_tool_call_markup_and_no_final_message():
    task = task_of("lookup")
    labels = label_episode(converse(task.seed, [], None, preface='<tool_response>\n"w123"\n</tool_response>'))
    assert labels["tool_call_format"] is L and labels["termination"] is L
    assert labels["tool_selection"] is NA


def test_answering_from_guesses_with_tools_offered_lacks_tool_selection():
    task = task_of("lookup")
    guessed = label_episode(converse(task.seed, [], "Your order shipped on Monday."))
    assert guessed["tool_selection"] is L  # it had the tools and called none
    refused = label_episode(converse(task.seed, [], "Sorry, I cannot look that up."))
    assert refused["tool_selection"] is NA
    unoffered = Trajectory.from_messages(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    )
    assert label_episode(unoffered)["tool_selection"] is NA  # no tools, nothing to select


def test_unknown_tools_repeated_failures_and_loops():
    task = task_of("lookup")
    bogus = {"name": "lookup_everything", "arguments": {"q": "x1"}}
    labels = label_episode(converse(task.seed, [bogus, bogus, bogus], "I could not do it."))
    assert labels["tool_selection"] is L and labels["error_recovery"] is L and labels["termination"] is L


def test_reporting_what_the_tools_said():
    task = task_of("lookup")
    calls = task.metadata["reference"]
    status = task.metadata["facts"][0]
    assert label_episode(converse(task.seed, calls, f"Your order is {status}."))["communicating_facts"] is P
    assert label_episode(converse(task.seed, calls, "All good!"))["communicating_facts"] is L


def agent_turns(
    result: str, answer: str, *, name: str = "convert", offered: set[str] | None = None
) -> Trajectory:
    """One call of a stateless tool (not retail's), its result, then the agent's answer."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "Convert 1 km to miles."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
        {"role": "assistant", "content": answer},
    ]
    return Trajectory.from_messages(messages, {"convert"} if offered is None else offered)


def test_an_acknowledgement_is_no_fact_to_report_and_keys_are_not_facts():
    assert label_episode(agent_turns('{"status": "ok"}', "Done."))["communicating_facts"] is NA
    reported = agent_turns('{"miles": 0.621, "unit": "mi"}', "That is 0.621 miles.")
    assert label_episode(reported)["communicating_facts"] is P
    # Naming the result's keys ("miles", "unit") is not reporting its values.
    assert (
        label_episode(agent_turns('{"miles": 0.621}', "I converted it to miles."))["communicating_facts"] is L
    )


@pytest.mark.parametrize(
    "error",
    [
        '{"error": "1 validation error for convert"}',  # LangChain / pydantic
        "Error: 'x' is a required property",  # JSON Schema
        "Error: convert() got an unexpected keyword argument 'y'",  # Python
        '{"error": "Missing required parameter: unit"}',  # an HTTP API
        '{"error": "invalid type for x: expected number"}',
    ],
)
def test_argument_errors_in_the_words_other_tools_use_are_format_failures(error):
    assert label_episode(agent_turns(error, "Sorry."))["tool_call_format"] is L


def test_a_refused_action_is_not_a_format_failure():
    assert label_episode(agent_turns('{"error": "invalid order status"}', "Sorry."))["tool_call_format"] is P


def test_names_the_model_made_up_are_not_tools_it_used():
    from trace_plugin.mining.miner import involved

    invented = agent_turns('{"error": "unknown tool"}', "Hi James.", name="James")
    real = agent_turns('{"miles": 0.621}', "0.621 miles.")
    assert invented.offered_calls() == [] and [c.name for c in real.offered_calls()] == ["convert"]
    assert involved([c for t in (invented, real) for c in t.offered_calls()])[0] == ["convert"]
    assert agent_turns("x", "y", name="James", offered=set()).offered_calls()  # nothing known: all kept


@pytest.mark.parametrize("with_llm_steps", [True, False])
def test_trajectories_come_from_stored_episodes(with_llm_steps):
    task = task_of("cancel")
    conversation = converse(task.seed, task.metadata["reference"], "Cancelled.")
    episode = Episode(
        id="e",
        agent="a",
        input={"messages": [{"role": "user", "content": task.prompt}]},
        output={"role": "assistant", "content": "Cancelled."},
    )
    if with_llm_steps:  # the last LLM call carries the whole conversation
        env = RetailEnv()
        env.reset(task.seed)
        messages = [{"role": "user", "content": task.prompt}]
        for i, call in enumerate(task.metadata["reference"]):
            messages += [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"c{i}",
                            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": f"c{i}",
                    "content": env.step(ToolCall(call["name"], call["arguments"])),
                },
            ]
        episode.steps = [
            Step(
                "e",
                0,
                "llm",
                "m",
                input={"messages": messages, "tools": sorted(OFFERED)},
                output={"role": "assistant", "content": "Cancelled."},
            )
        ]
    else:  # only tool steps, as the MCP proxy records them
        env = RetailEnv()
        env.reset(task.seed)
        episode.steps = [
            Step(
                "e",
                i,
                "tool",
                c["name"],
                input=c["arguments"],
                output=env.step(ToolCall(c["name"], c["arguments"])),
            )
            for i, c in enumerate(task.metadata["reference"])
        ]
    stored = Trajectory.from_episode(episode)
    assert [(c.name, c.arguments) for c in stored.calls] == [
        (c.name, c.arguments) for c in conversation.calls
    ]
    assert stored.final_answer == "Cancelled." and stored.user == task.prompt
    assert label_episode(stored)["precondition_verification"] is P


def test_few_shot_examples_are_context_not_behaviour():
    """Worked examples in the prompt carry tool calls; only what follows the request counts."""
    example_call = {
        "id": "ex1",
        "type": "function",
        "function": {"name": "find_user", "arguments": '{"email": "a@b.c"}'},
    }
    given = [
        {"role": "user", "content": "Example request"},
        {"role": "assistant", "content": "", "tool_calls": [example_call]},
        {"role": "tool", "tool_call_id": "ex1", "content": '"ann_1"'},
        {"role": "assistant", "content": "Example answer."},
        {"role": "user", "content": "Cancel order #W1."},
    ]
    reply = {"role": "assistant", "content": '<tool_response>\n"w1"\n</tool_response>'}
    episode = Episode(id="e", agent="a", input={"messages": given})
    episode.steps = [
        Step(
            "e",
            0,
            "llm",
            "m",
            input={"messages": [{"role": "system", "content": "policy"}, *given]},
            output=reply,
        )
    ]
    trajectory = Trajectory.from_episode(episode)
    assert trajectory.user == "Cancel order #W1." and trajectory.calls == []
    labels = label_episode(trajectory)
    assert labels["tool_call_format"] is L and labels["tool_selection"] is NA and labels["termination"] is L


def test_every_detector_has_a_description():
    from trace_plugin.mining.kinds import KINDS

    assert all(callable(kind.detect) and kind.description for kind in KINDS.values())


def test_a_model_called_inside_a_tool_is_not_the_agent():
    agent_view = {"messages": [{"role": "user", "content": "Where is #W1?"}], "tools": ["get_order"]}
    episode = Episode(id="e", agent="a", input={"messages": [{"role": "user", "content": "Where is #W1?"}]})
    episode.steps = [
        Step(
            "e",
            0,
            "llm",
            "agent-model",
            input=agent_view,
            output={"role": "assistant", "content": "It shipped."},
        ),
        Step("e", 1, "tool", "summarize", input={}, output="ok", run_id="tool-run"),
        Step(
            "e",
            2,
            "llm",
            "inner-model",
            input={"messages": [{"role": "user", "content": "summarize"}]},
            output={"role": "assistant", "content": "summary"},
            parent_run_id="tool-run",
        ),
    ]
    trajectory = Trajectory.from_episode(episode)
    assert trajectory.user == "Where is #W1?" and trajectory.final_answer == "It shipped."
