"""A planted-deficit corpus: scripted policies on the retail environment, each lacking one
known capability, mixed with a competent policy and with harmless variation.

It is how the miner is evaluated: the capabilities it selects should be exactly the
planted ones. Episodes are built the way the gateway records them (one LLM step holding
the whole conversation) and graded by the real environment.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from typing import Any

from trace_plugin.environments import Task, ToolCall
from trace_plugin.environments.retail import TOOLS, RetailEnv
from trace_plugin.mining.kinds import KINDS
from trace_plugin.records.outcome import graded_label
from trace_plugin.records.trajectory import Episode, Step, new_episode_id

REFUSALS = ("refuse_cancel", "refuse_return")
Plan = tuple[list[dict[str, Any]], list[str], str]  # calls, broken assistant texts, final answer


def _competent(task: Task, env: RetailEnv) -> Plan:
    calls = copy.deepcopy(task.metadata["reference"])
    if task.kind in REFUSALS:
        status = env.world.orders[task.metadata["order_id"]]["status"]
        return calls, [], f"Sorry, I cannot do that: order {task.metadata['order_id']} is {status}."
    facts = " ".join(task.metadata["facts"])
    return calls, [], f"Done: order {task.metadata['order_id']} {facts}".strip() + "."


def _invents_ids(task: Task, env: RetailEnv) -> Plan:
    calls, texts, answer = _competent(task, env)
    for call in calls:
        if call["name"] not in ("find_user", "get_order", "get_product") and "order_id" in call["arguments"]:
            call["arguments"]["order_id"] = "#W9999999"
    return calls, texts, answer


def _stops_early(task: Task, env: RetailEnv) -> Plan:
    calls, texts, answer = _competent(task, env)
    reads = [c for c in calls if c["name"] in ("find_user", "get_order", "get_product")]
    return reads, texts, answer if task.kind in REFUSALS else "Here are your order details."


def _withholds_facts(task: Task, env: RetailEnv) -> Plan:
    calls, texts, answer = _competent(task, env)
    return calls, texts, answer if task.kind in REFUSALS else "Done."


def _broken_format(task: Task, env: RetailEnv) -> Plan:
    calls, texts, answer = _competent(task, env)
    if task.kind in REFUSALS:
        return [], ['<tool_call>{"name": "get_order", "arguments": }'], answer
    return [], ['<tool_call>{"name": "get_order", "arguments": }'], "Sorry, something went wrong."


def _distractor(task: Task, env: RetailEnv) -> Plan:
    """Competent, with harmless variation: an extra lookup and a different phrasing."""
    calls, texts, answer = _competent(task, env)
    user = env.world.orders[task.metadata["order_id"]]["user_id"]
    return (
        [calls[0], {"name": "get_user", "arguments": {"user_id": user}}, *calls[1:]],
        texts,
        "Hi! " + answer,
    )


POLICIES: dict[str, Callable[[Task, RetailEnv], Plan]] = {
    "competent": _competent,
    "invents_ids": _invents_ids,
    "stops_early": _stops_early,
    "withholds_facts": _withholds_facts,
    "broken_format": _broken_format,
    "distractor": _distractor,
}
# The capabilities each deficient policy lacks; the others lack none. Stopping after the
# lookups lacks two: it neither carries the request through nor makes the change asked for.
# Policy refusal is not planted: the retail environment refuses forbidden writes itself,
# leaving the state, and so the grade, unchanged, and an agent that ignores the policy
# still succeeds.
PLANTED: dict[str, tuple[str, ...]] = {
    "invents_ids": (KINDS["argument_grounding"].name,),
    "stops_early": (KINDS["multi_step_completion"].name, KINDS["write_completion"].name),
    "withholds_facts": (KINDS["communicating_facts"].name,),
    "broken_format": (KINDS["tool_call_format"].name,),
}


def play(env: RetailEnv, calls: Sequence[dict[str, Any]], broken: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The conversation turns of an agent that says ``broken`` texts, then makes ``calls``
    one at a time against ``env``: OpenAI-format assistant calls and tool results."""
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": text} for text in broken]
    for i, call in enumerate(calls):
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}],
            }
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"c{i}",
                "content": env.step(ToolCall(call["name"], call["arguments"])),
            }
        )
    return messages


def episode(policy: str, seed: int) -> Episode:
    """One graded episode of ``policy`` on ``seed``, recorded as the gateway would."""
    env = RetailEnv()
    task = env.reset(seed)
    calls, broken, answer = POLICIES[policy](task, env)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": task.prompt},
    ]
    messages += play(env, calls, broken)
    reply = {"role": "assistant", "content": answer}
    reward = env.reward(answer).total
    record = Episode(
        id=new_episode_id(),
        agent="planted",
        source="planted",
        status="completed",
        input={"messages": messages[1:2]},
        output=reply,
        reward=reward,
        label=graded_label(reward),
        metadata={"policy": policy, "seed": seed},
    )
    names = [t["function"]["name"] for t in TOOLS]
    record.steps = [
        Step(record.id, 0, "llm", "scripted", input={"messages": messages, "tools": names}, output=reply)
    ]
    return record


def corpus(seeds: Sequence[int], policies: Sequence[str] = tuple(POLICIES)) -> list[Episode]:
    """Every policy on every seed."""
    return [episode(policy, seed) for policy in policies for seed in seeds]
