"""The agent's own evaluation suite, registered as the trace-plugin target ``functions``.

Each task is one question whose answer one function computes. The request offers that
function among up to three others (per-request tools, as the agent meets them in
production). A task is solved when the agent called the right function with the values
the user stated and told the user the result: half the reward each.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from function_agent import SYSTEM_PROMPT, tools
from trace_plugin.environments import RewardBreakdown, Target, Task, ToolCall

TEST_SEEDS = range(10_000, 10_048)  # held out: traffic and practice use seeds below 10,000
MAX_DISTRACTORS = 3

Question = tuple[str, dict[str, Any]]  # the user's words, the call that answers them


def _convert(rng: random.Random) -> Question:
    source, target = rng.choice([("km", "mi"), ("mi", "km"), ("kg", "lb"), ("lb", "kg")])
    value = rng.randint(2, 300)
    return f"How many {target} are {value} {source}?", {
        "value": value,
        "from_unit": source,
        "to_unit": target,
    }


def _compound(rng: random.Random) -> Question:
    principal, rate, years = (
        rng.choice([500, 1000, 2500, 10000]),
        rng.choice([2, 3.5, 5, 7]),
        rng.randint(2, 20),
    )
    return (
        f"I invest {principal} dollars at {rate}% a year for {years} years, compounded yearly. "
        "What is it worth then?",
        {"principal": principal, "rate": rate, "years": years},
    )


def _percent(rng: random.Random) -> Question:
    percent, value = rng.choice([5, 12.5, 15, 20, 35]), rng.randint(20, 900)
    return f"What is {percent}% of {value}?", {"percent": percent, "value": value}


def _limitation(rng: random.Random) -> Question:
    claim, where = rng.choice(["contract", "tort", "personal_injury"]), rng.choice(["england", "scotland"])
    spoken = claim.replace("_", " ")
    return (
        f"How long is the limitation period for a {spoken} claim in {where.title()}?",
        {"claim": claim, "jurisdiction": where},
    )


def _add_days(rng: random.Random) -> Question:
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    days = rng.randint(3, 120)
    return f"What date is {days} days after {date}?", {"date": date, "days": days}


def _currency(rng: random.Random) -> Question:
    source, target = rng.sample(sorted(tools.RATES), 2)
    amount = rng.randint(10, 5000)
    return f"How much is {amount} {source} in {target}?", {
        "amount": amount,
        "currencies": {"from": source, "to": target},
    }


QUESTIONS: dict[str, Callable[[random.Random], Question]] = {
    "units.convert": _convert,
    "finance.compoundInterest": _compound,
    "math.percentOf": _percent,
    "legal.limitationPeriod": _limitation,
    "calendar.addDays": _add_days,
    "finance.convertCurrency": _currency,
}


class FunctionsEnv:
    """One question at a time; the functions are the agent's own, run for real."""

    tools = [schema for schema, _ in tools.FUNCTIONS.values()]
    system_prompt = SYSTEM_PROMPT

    def __init__(self) -> None:
        self.task: Task | None = None
        self.calls: list[ToolCall] = []

    def reset(self, seed: int) -> Task:
        rng = random.Random(f"functions:{seed}")
        function = rng.choice(sorted(QUESTIONS))
        prompt, arguments = QUESTIONS[function](rng)
        others = rng.sample(
            [n for n in sorted(tools.FUNCTIONS) if n != function], rng.randint(0, MAX_DISTRACTORS)
        )
        offered = rng.sample([function, *others], len(others) + 1)
        expected = tools.call(function, arguments)
        metadata = {"reference": [{"name": function, "arguments": arguments}], "facts": [str(expected)]}
        kind = function.split(".")[-1]
        self.calls = []
        self.task = Task(seed, prompt, kind, metadata, [tools.FUNCTIONS[n][0] for n in offered])
        return self.task

    def step(self, call: ToolCall) -> str:
        self.calls.append(call)
        offered = {t["function"]["name"] for t in self.task.tools or ()} if self.task else set()
        if call.name not in offered:
            return json.dumps({"error": f"unknown function {call.name!r}"})
        return tools.answer(call.name, call.arguments)

    @property
    def done(self) -> bool:
        return False

    def reward(self, answer: str = "") -> RewardBreakdown:
        if self.task is None:
            return RewardBreakdown(0.0)
        [wanted] = self.task.metadata["reference"]
        called = any(c.name == wanted["name"] and _same(c.arguments, wanted["arguments"]) for c in self.calls)
        told = _mentions(answer, self.task.metadata["facts"][0])
        components = {"call": float(called), "answer": float(told)}
        return RewardBreakdown((components["call"] + components["answer"]) / 2, components)


def _same(made: Any, wanted: Any) -> bool:
    """Equal arguments: numbers by value, strings whatever their case and spacing."""
    if isinstance(wanted, dict):
        return (
            isinstance(made, dict)
            and made.keys() == wanted.keys()
            and all(_same(made[k], v) for k, v in wanted.items())
        )
    if isinstance(wanted, int | float) and not isinstance(wanted, bool):
        return isinstance(made, int | float) and not isinstance(made, bool) and abs(made - wanted) < 1e-6
    return isinstance(made, str) and made.strip().lower() == str(wanted).strip().lower()


def _mentions(answer: str, expected: str) -> bool:
    """Whether the answer states the result: a number within a cent, or the exact text."""
    try:
        value = float(expected)
    except ValueError:
        return expected in answer
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", answer)
    return any(abs(float(n.replace(",", "")) - value) < 0.01 for n in numbers)


TARGET = Target("functions", FunctionsEnv, TEST_SEEDS, max_turns=3)  # as the agent serves
