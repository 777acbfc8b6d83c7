"""The environment protocol every environment implements, bundled or synthesized.

An environment is a seeded, isolated world with tools: ``reset(seed)`` builds the world
and returns the user's ticket, ``step(call)`` runs one tool call and returns what the
tool said (errors included: an agent must be able to read and recover from them), and
``reward(answer)`` grades the episode from the final state and the agent's last message.
The same seed and the same calls always give the same observations and reward.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from trace_plugin.records.outcome import reward_succeeds


@dataclass(frozen=True, slots=True)
class Task:
    """What the user asks, everything they know stated up front, plus grading metadata.

    ``tools`` are the tools this request offers (OpenAI function schemas), for agents whose
    tools differ per request; None offers the environment's.
    """

    seed: int
    prompt: str
    kind: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class RewardBreakdown:
    """The episode's reward in [0, 1] and the named checks it was computed from."""

    total: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        """From an OpenAI ``tool_calls`` entry; arguments that are not a JSON object become {}."""
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {"__unparsed__": arguments}
        return cls(str(function.get("name", "")), arguments if isinstance(arguments, dict) else {})


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "array": list,
    "object": dict,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
}


def argument_problem(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit a tool's JSON schema (required, known, typed), or None.

    Environments check this before running a tool, so a model's malformed call becomes an
    error observation in process exactly as it does behind the MCP server's validation.
    """
    if "__unparsed__" in arguments:
        return "arguments are not a JSON object"
    properties = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"missing {missing}"
    unknown = [a for a in arguments if a not in properties]
    if unknown:
        return f"unexpected {unknown}"
    for name, value in arguments.items():
        kind = properties[name].get("type", "")
        expected = _JSON_TYPES.get(kind)
        if expected and (not isinstance(value, expected) or (isinstance(value, bool) and kind != "boolean")):
            return f"{name} must be {kind}"
    return None


def observation_error(observation: str) -> str | None:
    """The message of an error observation (``{"error": ...}``, the convention our
    environments use), or None for a normal one."""
    if not observation.startswith('{"error"'):
        return None
    try:
        return str(json.loads(observation)["error"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return observation


def offered_tools(env: Environment, task: Task) -> list[dict[str, Any]]:
    """The tools an agent working on ``task`` is offered: the task's own, else the environment's."""
    return env.tools if task.tools is None else task.tools


def reference_turns(metadata: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """A task's reference calls as an agent makes them: one turn each, or all in one turn
    where the task says they are independent (``parallel``)."""
    calls = metadata.get("reference") or []
    return [calls] if metadata.get("parallel") and calls else [[c] for c in calls]


def reference_answer(metadata: dict[str, Any]) -> str | None:
    """What a reference play tells the user at the end: the task's own answer when it gives
    one (``reference_answer``; None there: the calls end the task, no message follows), else
    the facts the user must be told, or a plain close."""
    if "reference_answer" in metadata:
        return metadata["reference_answer"]
    facts = [str(f) for f in metadata.get("facts") or []]
    if facts:
        return f"Here is what I found: {'; '.join(facts)}."
    return (
        "Done: your request is complete." if metadata.get("reference") else "Hello! How can I help you today?"
    )


def observe(env: Environment, call: dict[str, Any], max_chars: int) -> str:
    """What ``env`` answers to an OpenAI-shaped tool call, cut to ``max_chars`` (training's
    limit on tool results: prompt tokens dominate a CPU's cost)."""
    observation = env.step(ToolCall.from_openai(call))
    return observation[:max_chars] + "…" if len(observation) > max_chars else observation


@dataclass(frozen=True, slots=True)
class ReferencePlay:
    """A task's verified reference solution played in its environment: per turn, the calls
    and what the environment answered, then the answer told to the user (None: the play
    ended on a call). A turn's results are shown to the model only when something follows
    them (``shows_results``)."""

    task: Task
    tools: list[dict[str, Any]]
    turns: list[tuple[list[dict[str, Any]], list[str]]]
    told: str | None
    reward: float

    def shows_results(self, turn: int) -> bool:
        return turn < len(self.turns) - 1 or self.told is not None


def play_reference(
    env: Environment, seed: int, *, max_turns: int, max_observation_chars: int
) -> ReferencePlay | None:
    """Play the task's reference calls (``reference_turns``) with the environment's real
    results, then tell ``reference_answer``. None when the task has no reference, is
    unsatisfiable, takes more than ``max_turns``, or the play does not succeed. The warm
    start's token ids and the exported reference plays are both made from this one play."""
    task = env.reset(seed)
    if task.metadata.get("reference") is None or not task.metadata.get("satisfiable", True):
        return None
    turns = reference_turns(task.metadata)
    answer = reference_answer(task.metadata)
    if len(turns) + (answer is not None) > max_turns:
        return None
    tools = offered_tools(env, task)
    played: list[tuple[list[dict[str, Any]], list[str]]] = []
    told = None
    for i, turn in enumerate(turns):
        played.append(([dict(c) for c in turn], [observe(env, c, max_observation_chars) for c in turn]))
        if env.done or (i == len(turns) - 1 and answer is None):
            break
    else:
        told = answer
    reward = float(env.reward(told or "").total)
    return ReferencePlay(task, tools, played, told, reward) if reward_succeeds(reward) else None


def request_key(request: str) -> str:
    """A user request as tasks are compared: spacing and case do not make it another."""
    return " ".join(request.split()).lower()


def task_key(prompt: str, tools: list[dict[str, Any]] | None) -> str:
    """What makes two tasks the same to a model: the request and the tools it offers.

    Warm-start plays whose key is an evaluated task's are left out; seeds alone do not
    tell tasks apart (a family may draw the same request from different seeds)."""
    canonical = json.dumps([request_key(prompt), tools or []], sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seed_key(factory: Callable[[], Environment], seed: int) -> str:
    """The key (``task_key``) of ``factory``'s task on ``seed``."""
    env = factory()
    task = env.reset(seed)
    return task_key(task.prompt, offered_tools(env, task))


def task_keys(factory: Callable[[], Environment], seeds: Sequence[int]) -> set[str]:
    """The keys of ``factory``'s tasks on ``seeds``: the tasks an evaluation plays."""
    return {seed_key(factory, seed) for seed in seeds}


def unseen_seeds(
    factory: Callable[[], Environment], seeds: Sequence[int], exclude: Collection[str]
) -> list[int]:
    """``seeds`` whose tasks (``task_key``) are none of ``exclude``: a task GRPO samples
    must not be one the warm start memorized or an evaluation plays, or its groups go flat."""
    if not exclude:
        return list(seeds)
    return [seed for seed in seeds if seed_key(factory, seed) not in exclude]


PlayT = TypeVar("PlayT")


class DistinctPlays(Generic[PlayT]):
    """Reference plays of distinct tasks, one seed at a time: ``plays(seed)`` is the play
    (``play(seed)``), or why there is none: ``"leaked"`` (its task is one of ``exclude``,
    an evaluated task), ``"repeated"`` (an earlier play's task) or ``"unplayable"`` (no
    successful reference). The warm start and ``export-plays`` draw from it alike."""

    def __init__(
        self,
        factory: Callable[[], Environment],
        play: Callable[[int], PlayT | None],
        exclude: Collection[str] = (),
    ) -> None:
        self.factory, self.play, self.exclude = factory, play, frozenset(exclude)
        self.seen: set[str] = set()

    def __call__(self, seed: int) -> PlayT | str:
        key = seed_key(self.factory, seed)
        if key in self.exclude:
            return "leaked"
        if key in self.seen:
            return "repeated"
        play = self.play(seed)
        if play is None:
            return "unplayable"
        self.seen.add(key)
        return play


class Environment(Protocol):
    tools: list[dict[str, Any]]  # OpenAI function schemas: every tool any of its tasks offers
    system_prompt: str

    def reset(self, seed: int) -> Task: ...

    def step(self, call: ToolCall) -> str:
        """Run one tool call; the observation is text (often JSON). Never raises."""
        ...

    @property
    def done(self) -> bool: ...

    def reward(self, answer: str = "") -> RewardBreakdown:
        """Grade the episode so far, given the agent's final message to the user."""
        ...


@dataclass(frozen=True)
class Target:
    """An environment an agent is judged on, and its held-out tasks.

    A package offers one under the entry-point group ``trace_plugin.targets`` (the entry
    point names a ``Target`` or a function returning one), or anyone names it as
    ``package.module:attribute``; ``retail`` is bundled. A task may carry its reference
    solution in ``metadata["reference"]`` (OpenAI-style ``{"name", "arguments"}`` calls, with
    the ``facts`` the answer must tell): warm starts and demonstrations play it.
    """

    name: str
    factory: Callable[[], Environment]
    test_seeds: Sequence[int]
    # Model turns an agent gets per task (its horizon); None leaves the evaluator's default.
    max_turns: int | None = None
