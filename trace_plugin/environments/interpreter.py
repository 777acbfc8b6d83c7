"""``SpecEnv``: runs an ``EnvSpec`` as an environment of the shared protocol.

The interpreter is the only code a synthesized environment ever runs: tool behaviours,
generators and checks come from a fixed vocabulary, so a spec (even one an LLM proposed)
can do nothing but describe data. Each ``reset(seed)`` generates the tables, samples a
template and its slots (forcing the slots' ``where`` columns so the ticket is
satisfiable), and replays the reference actions on a copy of the state: that copy is what
``final_state`` compares against, and a reference action that fails marks the task
unsatisfiable in its metadata.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from trace_plugin.chat_template import assistant_text
from trace_plugin.environments.base import (
    RewardBreakdown,
    Task,
    ToolCall,
    argument_problem,
    reference_answer,
    reference_turns,
)
from trace_plugin.errors import TracePluginError
from trace_plugin.records.env_spec import PLACEHOLDER, Check, Column, EnvSpec, TaskTemplate, ToolSpec

Rows = dict[str, dict[str, dict[str, Any]]]  # table -> key -> row

_DIGITS = re.compile(r"\{d(\d{1,2})\}")


# Checks that doing nothing or guessing would pass (no forbidden call, state unchanged, no
# write out of order, a fact that happens to be named): they earn credit only once the agent
# has made one of the reference calls.
GATED = frozenset({"forbidden", "final_state", "order", "facts"})


class ToolError(TracePluginError):
    pass


def generate(column: Column, rng: random.Random) -> Any:
    if column.kind == "id":
        return _DIGITS.sub(
            lambda m: "".join(rng.choice("0123456789") for _ in range(int(m[1]))), column.pattern or ""
        )
    if column.kind == "int":
        return rng.randint(int(column.low), int(column.high))
    if column.kind == "number":
        return round(rng.uniform(column.low, column.high), 2)
    return rng.choice(column.values)


class SpecEnv:
    """One episode of a synthesized environment at a time; instances share nothing."""

    def __init__(self, spec: EnvSpec, *, hinted: bool = False) -> None:
        self.spec = spec
        self.tools = [t.schema_ for t in spec.tools]
        self.system_prompt = spec.system_prompt
        # The hint, shown as a worked example the agent sees just before the ticket.
        self.hint_messages = worked_example(spec) if hinted else []
        self.task: Task | None = None
        self.offered: frozenset[str] = frozenset(t.name for t in spec.tools)
        self.rows: Rows = {}
        self.calls: list[ToolCall] = []
        self._succeeded: set[str] = set()  # tools called without an error this episode
        self._expected: Rows = {}
        self._done = False
        self._creates = 0

    # -- the protocol -------------------------------------------------------------------

    def reset(self, seed: int) -> Task:
        rng = random.Random(f"{self.spec.name}:{seed}")
        self.rows = self._generate(rng)
        template = rng.choices(self.spec.tasks, weights=[t.weight for t in self.spec.tasks])[0]
        self.offered = frozenset(template.tools or [t.name for t in self.spec.tools])
        values = self._bind(template, rng)
        reference = [{"name": a.tool, "arguments": _fill(a.arguments, values)} for a in template.reference]
        if self.spec.difficulty.single_step:
            reference = reference[-1:]
        facts = [_fill(f, values) for f in template.facts]
        self.calls, self._succeeded, self._done, self._creates = [], set(), False, 0
        initial = copy.deepcopy(self.rows)
        failures = []
        for action in reference:
            observation = self.step(ToolCall(action["name"], action["arguments"]))
            if observation.startswith('{"error"'):
                failures.append(f"{action['name']}: {observation}")
            elif self.spec.tool(action["name"]).behaviour == "respond":
                facts.append(json.loads(observation)["result"])  # what the call was for: tell it
        self._expected, self.rows = self.rows, initial
        self.calls, self._succeeded, self._done, self._creates = [], set(), False, 0
        metadata = {
            "reference": reference,
            "facts": facts,
            "forbidden": list(template.forbidden),
            "hint": self.spec.hint,
            "satisfiable": not failures,
            "reference_errors": failures,
            # Calls of stateless tools need no result of each other: one turn makes them all.
            "parallel": len(reference) > 1
            and all(self.spec.tool(r["name"]).behaviour == "respond" for r in reference),
        }
        if template.answer:
            metadata["reference_answer"] = _fill(template.answer, values)
        schemas = {t.name: t.schema_ for t in self.spec.tools}
        tools = [schemas[name] for name in template.tools] or None
        prompt = _fill(template.prompt, values)
        if reference and _named(seed, self.spec.difficulty.name_tools):
            prompt += f" Use {' and '.join(dict.fromkeys(r['name'] for r in reference))}."
        self.task = Task(seed, prompt, template.kind, metadata, tools)
        return self.task

    @property
    def done(self) -> bool:
        return self._done

    def step(self, call: ToolCall) -> str:
        self.calls.append(call)
        tool = self._tool(call.name)
        if tool is None:
            return _error(f"unknown tool {call.name!r}")
        problem = argument_problem(tool.parameters, call.arguments)
        if problem:
            return _error(f"bad arguments for {call.name}: {problem}")
        missing = [name for name in tool.requires if name not in self._succeeded]
        if missing:
            return _error(tool.requires_error or f"call {' and '.join(missing)} first")
        try:
            result = json.dumps(self._run(tool, call.arguments))
        except ToolError as exc:
            return _error(str(exc))
        self._succeeded.add(call.name)
        return result

    def reward(self, answer: str = "") -> RewardBreakdown:
        if self.task is None:
            return RewardBreakdown(0.0)
        engaged = self._engaged()
        scores = [
            (check, self._score(check, answer) if engaged or check.kind not in GATED else 0.0)
            for check in self.spec.checks
        ]
        total = sum(c.weight * score for c, score in scores) / sum(c.weight for c in self.spec.checks)
        return RewardBreakdown(round(total, 6), {c.label: score for c, score in scores})

    def _tool(self, name: str) -> ToolSpec | None:
        """The tool ``name`` if this task offers it."""
        return self.spec.tool(name) if name in self.offered else None

    # -- state --------------------------------------------------------------------------

    def _generate(self, rng: random.Random) -> Rows:
        rows: Rows = {}
        for name, table in self.spec.tables.items():
            rows[name] = {}
            count = table.rows + self.spec.difficulty.distractor_rows
            for _ in range(count * 4):  # retries: generated keys may collide
                if len(rows[name]) == count:
                    break
                row = {column: generate(spec, rng) for column, spec in table.columns.items()}
                rows[name].setdefault(str(row[table.key]), row)
        return rows

    def _bind(self, template: TaskTemplate, rng: random.Random) -> dict[str, Any]:
        values: dict[str, Any] = {name: generate(column, rng) for name, column in template.params.items()}
        used: set[tuple[str, str]] = set()
        for slot_name, slot in template.slots.items():
            keys = [k for k in sorted(self.rows[slot.table]) if (slot.table, k) not in used]
            key = rng.choice(keys)
            used.add((slot.table, key))
            row = self.rows[slot.table][key]
            for column, allowed in slot.where.items():
                if row[column] not in allowed:
                    row[column] = rng.choice(allowed)
            values[slot_name] = row
        return values

    def digest(self, rows: Rows | None = None) -> str:
        return hashlib.sha256(json.dumps(rows or self.rows, sort_keys=True, default=str).encode()).hexdigest()

    # -- behaviours ---------------------------------------------------------------------

    def _run(self, tool: ToolSpec, arguments: dict[str, Any]) -> Any:
        if tool.behaviour == "terminate":
            self._done = True
            return "transferred"
        if tool.behaviour == "respond":  # a stateless API: any well-formed call has its answer
            return {"result": respond_result(tool.name, arguments)}
        table_name = tool.table or ""
        table, key_column = self.rows[table_name], self.spec.tables[table_name].key
        if tool.behaviour in ("lookup", "update"):
            key = str(arguments[tool.key or ""]).strip()
            row = table.get(key)
            if row is None:
                raise ToolError(f"{table_name} {key} not found")
            if tool.behaviour == "lookup":
                return row if tool.returns is None else shaped(tool.returns, row, rest=True)
            for column, allowed in tool.guard.items():
                if row[column] not in allowed:
                    raise ToolError(f"{table_name} {key} is {row[column]}; this needs {' or '.join(allowed)}")
            changed = {column: _value(value, arguments) for column, value in tool.sets.items()}
            row.update(changed)
            laid = shaped(tool.returns, row) if tool.returns is not None else {}
            return laid or {key_column: key, **changed}
        if tool.behaviour == "create":
            self._creates += 1
            rng = random.Random(f"{self.digest()}:{self._creates}")
            new_key = str(generate(self.spec.tables[table_name].columns[key_column], rng))
            table[new_key] = {
                key_column: new_key,
                **{c: _value(v, arguments) for c, v in tool.sets.items()},
            }
            return {key_column: new_key}
        matches = [row for row in table.values() if _matches(row, tool.filters, arguments)]
        if tool.behaviour == "list":
            if not any(arguments.get(a) for a in tool.filters):
                raise ToolError(f"give one of {sorted(tool.filters)}")
            if not matches:
                raise ToolError(f"no {table_name} matches")
            if isinstance(tool.returns, str):  # the target answers its one match
                return matches[0][tool.returns]
            return [row[key_column] for row in matches]
        if tool.op == "count":  # compute
            return len(matches)
        numbers = [row[tool.column or ""] for row in matches]
        if not numbers:
            raise ToolError(f"no {table_name} matches")
        return {"sum": sum, "min": min, "max": max}[tool.op or "sum"](numbers)

    # -- checks -------------------------------------------------------------------------

    def _engaged(self) -> bool:
        """Whether the agent made at least one of the reference calls (or none were needed)."""
        assert self.task is not None
        reference = self.task.metadata["reference"]
        made = {(c.name, _normal(c.arguments)) for c in self.calls}
        return not reference or any((r["name"], _normal(r["arguments"])) in made for r in reference)

    def _score(self, check: Check, answer: str) -> float:
        assert self.task is not None
        reference = self.task.metadata["reference"]
        if check.kind == "valid_calls":
            if not self.calls:
                return 0.0 if reference else 1.0
            valid = [
                c
                for c in self.calls
                if (t := self._tool(c.name)) and not argument_problem(t.parameters, c.arguments)
            ]
            return len(valid) / len(self.calls)
        if check.kind == "required_calls":
            if not reference:
                return 1.0
            made = [(c.name, _normal(c.arguments)) for c in self.calls]
            return sum((r["name"], _normal(r["arguments"])) in made for r in reference) / len(reference)
        if check.kind == "arguments":
            if not reference:  # the right answer is no call
                return float(not self.calls)
            credit = [
                max(
                    (argument_credit(c.arguments, r["arguments"]) for c in self.calls if c.name == r["name"]),
                    default=0.0,
                )
                for r in reference
            ]
            return sum(credit) / len(credit)
        if check.kind == "order":
            names = [c.name for c in self.calls]
            if check.after in names:
                first_after = names.index(check.after)
                return float(check.before in names[:first_after])
            return 0.0 if any(r["name"] == check.after for r in reference) else 1.0
        if check.kind == "forbidden":
            return float(not any(c.name in self.task.metadata["forbidden"] for c in self.calls))
        if check.kind == "final_state":
            return float(self.digest() == self.digest(self._expected))
        facts = self.task.metadata["facts"]  # facts
        if not facts:  # nothing to tell: right, unless the right answer was no call and one was made
            return 1.0 if reference else float(not self.calls)
        return sum(str(f).lower() in answer.lower() for f in facts) / len(facts)


def respond_result(tool: str, arguments: dict[str, Any]) -> str:
    """A stateless tool's answer: a number derived from the call, so the same call always
    gets it and a call with other values almost surely another; the agent must tell it."""
    digest = hashlib.sha256(f"{tool}:{_normal(arguments)}".encode()).hexdigest()
    return f"{int(digest[:8], 16) % 100_000 / 100:.2f}"


def worked_example(spec: EnvSpec) -> list[dict[str, Any]]:
    """The hint as conversation turns: a ticket from a world no training seed uses, and the
    first reference call for it, made the way the tool template expects."""
    task = SpecEnv(spec).reset(-1)
    reference = task.metadata["reference"]
    if not reference:
        return []
    call = {"name": reference[0]["name"], "arguments": json.dumps(reference[0]["arguments"])}
    return [
        {"role": "user", "content": task.prompt},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "hint", "type": "function", "function": call}],
        },
    ]


def reply_budget(spec: EnvSpec, tokenizer: Any, seeds: Sequence[int] = range(32)) -> int:
    """Tokens a model needs for one reply in ``spec``: the longest reply of its reference
    plays on ``seeds`` (a turn's calls as the template writes them, or the answer to the
    user), EOS included, with a quarter to spare. The one source of the completion length
    for training, calibration and held-out play: real schemas' calls run past any fixed
    guess (a median of 50 SmolLM2 tokens where the demo allowed 48)."""
    longest = 0
    for seed in seeds:
        metadata = SpecEnv(spec).reset(seed).metadata
        turns = reference_turns(metadata)
        texts = [assistant_text(tokenizer, {"role": "assistant", "tool_calls": t}) for t in turns]
        answer = reference_answer(metadata)
        texts += [answer] if answer else []
        for text in texts:
            longest = max(longest, len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1)
    return longest + longest // 4 + 8


def turn_budget(spec: EnvSpec, seeds: Sequence[int] = range(32)) -> int:
    """Model turns the longest reference play of ``spec`` on ``seeds`` takes: a turn per
    round of calls, and one to answer the user. Below it, a play is cut short (the warm start
    drops it, and a rollout cannot succeed): a horizon never goes under it."""
    longest = 1
    for seed in seeds:
        metadata = SpecEnv(spec).reset(seed).metadata
        answered = reference_answer(metadata) is not None
        longest = max(longest, len(reference_turns(metadata)) + answered)
    return longest


def corpus_plays(spec: EnvSpec, seeds: Iterable[int], count: int) -> list[tuple[str, str]]:
    """Up to ``count`` successful trajectories of ``spec`` as a router retrieves them (the
    request, and the reference calls that solve it as text), its kinds of task taken in
    turn over ``seeds``. Drawn by weight alone, a corpus of a few plays can hold one kind
    (a headline's held four cancellations per expert), and then retrieval cannot tell a
    return from a cancellation."""
    by_kind: dict[str, list[tuple[str, str]]] = {}
    kinds = {t.kind for t in spec.tasks}
    for seed in seeds:
        task = SpecEnv(spec).reset(seed)
        if task.metadata["satisfiable"]:
            reference = task.metadata["reference"]
            calls = ", ".join(f"{r['name']}({json.dumps(r['arguments'], sort_keys=True)})" for r in reference)
            by_kind.setdefault(task.kind, []).append((task.prompt, calls or "a reply, with no tool call"))
        if set(by_kind) == kinds and min(map(len, by_kind.values())) >= count:
            break  # enough of every kind for any share of the count
    in_turn = itertools.chain.from_iterable(itertools.zip_longest(*by_kind.values()))
    return [play for play in in_turn if play is not None][:count]


def _named(seed: int, share: float) -> bool:
    """Whether the ticket of ``seed`` names its tools, at a ``share`` of tickets named: a
    draw of its own, so the ticket's other values are the same at every share."""
    return share >= 1.0 or (share > 0.0 and random.Random(f"name_tools/{seed}").random() < share)


def _fill(value: Any, values: dict[str, Any]) -> Any:
    """Placeholders replaced by sampled values; a string that is one placeholder keeps its type."""
    if isinstance(value, list):
        return [_fill(v, values) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, values) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def lookup(match: re.Match[str]) -> Any:
        slot, column = match[1], match[2]
        return values[slot][column] if column else values[slot]

    whole = PLACEHOLDER.fullmatch(value)
    if whole:
        return lookup(whole)
    return PLACEHOLDER.sub(lambda m: str(lookup(m)), value)


def argument_credit(made: dict[str, Any], wanted: dict[str, Any]) -> float:
    """Partial credit for a call of the right tool: the share of arguments, wanted or made,
    that were given with the wanted value and type; an invented argument counts against."""
    names = set(made) | set(wanted)
    if not names:
        return 1.0
    right = sum(n in made and n in wanted and _normal(made[n]) == _normal(wanted[n]) for n in names)
    return right / len(names)


def shaped(shape: Any, row: dict[str, Any], *, rest: bool = False) -> dict[str, Any]:
    """``row`` laid out as the target lays out its answers: each string of ``shape`` is the
    value of the column it names, and what the row lacks is left out (a list holds the one
    item its skeleton describes). With ``rest``, the columns the shape does not place follow,
    so that a lookup still shows every fact a ticket may ask for."""

    def fill(part: Any) -> Any:
        if isinstance(part, str):
            return row.get(part)
        if isinstance(part, dict):
            filled = {key: fill(inner) for key, inner in part.items()}
            return {key: value for key, value in filled.items() if value not in (None, {}, [])}
        return [item for item in map(fill, part) if item not in (None, {}, [])]

    laid = fill(shape)
    if rest:
        placed = set(_leaves(shape))
        laid.update({column: value for column, value in row.items() if column not in placed})
    return laid


def _leaves(shape: Any) -> Iterator[str]:
    if isinstance(shape, str):
        yield shape
    else:
        for inner in shape.values() if isinstance(shape, dict) else shape:
            yield from _leaves(inner)


def _value(value: str, arguments: dict[str, Any]) -> Any:
    return arguments.get(value[1:]) if value.startswith("$") else value


def _matches(row: dict[str, Any], filters: dict[str, str], arguments: dict[str, Any]) -> bool:
    return all(
        str(row[column]).strip().lower() == str(arguments[argument]).strip().lower()
        for argument, column in filters.items()
        if arguments.get(argument) not in (None, "")
    )


def _normal(arguments: Any) -> str:
    """Arguments compared loosely: case and surrounding spaces of strings, order of lists,
    a whole float and its integer; types otherwise count (``12`` is not ``"12"``)."""

    def norm(value: Any) -> Any:
        if isinstance(value, str):
            return value.strip().lower()
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return sorted((norm(v) for v in value), key=str)
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        return value

    return json.dumps(norm(arguments), sort_keys=True, default=str)


def _error(message: str) -> str:
    return json.dumps({"error": message})
