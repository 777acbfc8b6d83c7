"""The LLM analyzer: a model proposes the capabilities an agent lacks, then labels episodes with them.

TRACE's capability analysis, with any model litellm reaches. It complements the offline
miner, whose detectors only know generic capabilities, by finding environment-specific
ones. Three stages:

1. Discovery: the model reads a sample of failed and successful episodes, compacted to
   short text, and proposes up to ten candidate capabilities, each with a snake_case name,
   a description and the episodes that show it lacking.
2. Labeling: N isolated runs, each a fresh set of conversations over all episodes in
   batches, label every (episode, capability) pair NA, PRESENT or LACKING. The labeler
   does not see outcomes, so a label cannot simply echo the grade.
3. Selection: the offline miner's rule (``select``) over the N runs.

Every answer is parsed and validated locally, whatever the provider promises. An invalid
answer (not JSON, the wrong shape, an unknown capability, episode or label) is sent back
with what was wrong, up to ``retries`` times, then dropped and counted in ``Stats``:
a bad answer costs its batch, never the run.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from trace_plugin.errors import TracePluginError
from trace_plugin.mining.detectors import Trajectory
from trace_plugin.mining.miner import MAX_EXAMPLES, _metrics, involved, outcome
from trace_plugin.mining.selection import DEFAULT_RULE, Label, Run, SelectionRule, select
from trace_plugin.records.capability import Capability
from trace_plugin.records.trajectory import Episode, new_id
from trace_plugin.store import Store

log = logging.getLogger(__name__)

MAX_CAPABILITIES = 10
DISCOVERY_BATCH = 15  # episodes per discovery call
TEXT_CHARS = 400  # the user's request, the agent's messages
FIELD_CHARS = 160  # one call's arguments or result
ERROR_CHARS = 400  # errors are the evidence: they are cut later
MAX_CALLS = 12  # calls shown per episode: the first and last halves
EPISODE_CHARS = 4000
ANSWER_CHARS = 2000  # an invalid answer quoted back to the model

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)

# messages, then the JSON schema the answer must follow (OpenAI's ``json_schema`` object);
# returns the answer's text.
Complete = Callable[[list[dict[str, str]], dict[str, Any]], str]
T = TypeVar("T")


class LiteLLMComplete:
    """Completes through litellm: any provider, or an OpenAI-compatible server via ``api_base``.

    ``structured`` asks for the schema as ``response_format``; by default only where
    litellm knows the model supports it, since other servers may reject or ignore it.
    ``options`` go to ``litellm.completion`` unchanged (``api_base``, ``api_key``,
    ``max_tokens``, ``temperature``, ``mock_response``...).
    """

    def __init__(self, model: str, *, structured: bool | None = None, **options: Any) -> None:
        self.model = model
        self.structured = structured
        self.options = options

    def __call__(self, messages: list[dict[str, str]], schema: dict[str, Any]) -> str:
        import litellm

        if self.structured is None:
            try:
                self.structured = bool(litellm.supports_response_schema(model=self.model))
            except Exception:  # litellm raises for models it does not know
                self.structured = False
        extra = {"response_format": {"type": "json_schema", "json_schema": schema}} if self.structured else {}
        response = litellm.completion(model=self.model, messages=messages, **extra, **self.options)
        return response.choices[0].message.content or ""


@dataclass(slots=True)
class Stats:
    """What the model calls cost and how many answers were unusable.

    Always ``calls == requests + retries`` and ``invalid + errors == retries + dropped``.
    """

    requests: int = 0  # questions asked: one per discovery or labeling batch
    calls: int = 0  # completions made, retries included
    retries: int = 0
    invalid: int = 0  # answers that failed validation
    errors: int = 0  # calls that raised (network, provider, auth)
    dropped: int = 0  # questions given up on after the retries
    unlabeled: int = 0  # (run, episode) pairs left without labels by dropped batches
    last_problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Candidate:
    """A capability the model proposed, with the episodes it cited as lacking it."""

    name: str
    description: str
    examples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Analysis:
    """What one analysis found: the candidates proposed, the capabilities selected among them
    (with their evidence), and what it cost."""

    capabilities: list[Capability]
    candidates: list[Candidate]
    stats: Stats


class _Invalid(TracePluginError, ValueError):
    """An answer that cannot be used; its message tells the model what to fix."""


# -- compaction -----------------------------------------------------------------------------


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}… (+{len(text) - limit} chars)"


def render_episode(episode: Episode, alias: str, *, show_outcome: bool = True) -> str:
    """One episode as a few lines: request, calls with results, errors, final answer.

    Long contents are cut, errors less so: they are usually what explains a failure.
    """
    t = Trajectory.from_episode(episode)
    head = f"[{alias}]"
    if show_outcome:
        ok = outcome(episode)
        reward = "" if episode.reward is None else f", reward {episode.reward:.2f}"
        head += f" outcome: {'unknown' if ok is None else 'success' if ok else 'failure'}{reward}"
    lines = [head, f"user: {_cut(t.user, TEXT_CHARS)}"]
    if t.tools_offered:
        lines.append(f"tools offered: {_cut(', '.join(sorted(t.tools_offered)), FIELD_CHARS)}")
    texts = t.assistant_texts[:-1] if t.final_answer is not None else t.assistant_texts
    lines += [f"agent said: {_cut(text, TEXT_CHARS)}" for text in texts if text.strip()]
    calls = list(enumerate(t.calls, 1))
    if len(calls) > MAX_CALLS:
        half = MAX_CALLS // 2
        calls = [*calls[:half], (0, None), *calls[-half:]]
    for n, call in calls:
        if call is None:
            lines.append(f"… {len(t.calls) - MAX_CALLS} calls omitted …")
            continue
        arguments = _cut(json.dumps(call.arguments, ensure_ascii=False, default=str), FIELD_CHARS)
        result = f"ERROR {_cut(call.result, ERROR_CHARS)}" if call.error else _cut(call.result, FIELD_CHARS)
        lines.append(f"call {n}: {call.name}({arguments}) -> {result}")
    final = t.final_answer
    lines.append(f"final answer: {_cut(final, TEXT_CHARS)}" if final else "final answer: (none)")
    if episode.status not in ("completed", "running"):
        lines.append(f"status: {episode.status}")
    if episode.error:
        lines.append(f"agent error: {_cut(episode.error, ERROR_CHARS)}")
    return _cut_middle("\n".join(lines), EPISODE_CHARS)


def _cut_middle(text: str, limit: int) -> str:
    """Both ends survive: the request opens an episode, its failure usually closes it."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n… ({len(text) - limit} chars cut) …\n{text[head - limit :]}"


# -- prompts and answers --------------------------------------------------------------------

_DISCOVERY_PROMPT = f"""You analyse the trajectories of an AI agent to find the capabilities it lacks.
A capability is a behaviour the agent must exercise to solve some of its tasks, such as
checking an entity's state before changing it, or telling the user the facts a tool returned.
Contrast the failed episodes with the successful ones. Propose at most {MAX_CAPABILITIES}
capabilities whose absence explains failures, each with:
- "name": snake_case, such as verify_before_write;
- "description": two or three sentences: what the agent must do, and how to tell from a
  trajectory whether it did;
- "examples": ids (as in brackets, such as "e3") of episodes where the agent lacked it.
Answer with only a JSON object:
{{"capabilities": [{{"name": "...", "description": "...", "examples": ["e3"]}}]}}"""

_LABELING_PROMPT = """You label trajectories of an AI agent with capabilities. For every episode
and every capability, answer:
- "NA" when the episode did not call for the capability;
- "PRESENT" when it did and the agent exercised it;
- "LACKING" when it did and the agent did not.
Judge only from the trajectory. The capabilities:
{capabilities}
Answer with only a JSON object mapping each episode id to an object that maps every
capability name to its label, for example:
{example}"""


class _Proposal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = Field(min_length=1)
    examples: list[str]


class _Discovery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capabilities: list[_Proposal]


_LABELS = TypeAdapter(dict[str, dict[str, Label]])


def _json_object(answer: str) -> dict[str, Any]:
    """The answer's JSON object; fences and prose around one object are tolerated."""
    text = answer.strip()
    fenced = _FENCE.match(text)
    candidates = [text, fenced.group(1) if fenced else None, text[text.find("{") : text.rfind("}") + 1]]
    for candidate in candidates:
        if candidate:
            try:
                value = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise _Invalid("the answer is not a JSON object")


def _pydantic_errors(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in error.errors()[:8])


def _discovery_schema(aliases: Sequence[str]) -> dict[str, Any]:
    proposal = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "examples": {"type": "array", "items": {"type": "string", "enum": list(aliases)}},
        },
        "required": ["name", "description", "examples"],
        "additionalProperties": False,
    }
    return {
        "name": "capabilities",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"capabilities": {"type": "array", "items": proposal}},
            "required": ["capabilities"],
            "additionalProperties": False,
        },
    }


def _parse_discovery(answer: str, aliases: Sequence[str]) -> list[_Proposal]:
    try:
        proposals = _Discovery.model_validate(_json_object(answer)).capabilities
    except ValidationError as exc:
        raise _Invalid(f"wrong shape: {_pydantic_errors(exc)}") from None
    problems = []
    if len(proposals) > MAX_CAPABILITIES:
        problems.append(f"{len(proposals)} capabilities, at most {MAX_CAPABILITIES} allowed")
    names = [p.name for p in proposals]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        problems.append(f"names not in snake_case: {', '.join(map(repr, bad))}")
    repeated = sorted(n for n, k in Counter(names).items() if k > 1)
    if repeated:
        problems.append(f"repeated names: {', '.join(repeated)}")
    unknown = sorted({e for p in proposals for e in p.examples} - set(aliases))
    if unknown:
        problems.append(f"unknown episode ids {', '.join(unknown)}; use the ids shown in brackets")
    if problems:
        raise _Invalid("; ".join(problems))
    return proposals


def _labeling_schema(aliases: Sequence[str], names: Sequence[str]) -> dict[str, Any]:
    labels = {
        "type": "object",
        "properties": {n: {"type": "string", "enum": [label.value for label in Label]} for n in names},
        "required": list(names),
        "additionalProperties": False,
    }
    return {
        "name": "labels",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": dict.fromkeys(aliases, labels),
            "required": list(aliases),
            "additionalProperties": False,
        },
    }


def _parse_labels(answer: str, aliases: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, Label]]:
    try:
        labels = _LABELS.validate_python(_json_object(answer))
    except ValidationError as exc:
        raise _Invalid(f"wrong shape or labels: {_pydantic_errors(exc)}") from None
    problems = []
    if unknown := sorted(set(labels) - set(aliases)):
        problems.append(f"unknown episode ids {', '.join(unknown)}")
    if missing := [a for a in aliases if a not in labels]:
        problems.append(f"episodes not labeled: {', '.join(missing)}")
    for alias, row in labels.items():
        if alias not in aliases:
            continue
        if unknown := sorted(set(row) - set(names)):
            problems.append(f"{alias}: unknown capabilities {', '.join(unknown)}")
        if missing := [n for n in names if n not in row]:
            problems.append(f"{alias}: capabilities not labeled: {', '.join(missing)}")
    if problems:
        raise _Invalid("; ".join(problems))
    return labels


# -- asking ---------------------------------------------------------------------------------


@dataclass
class _Asker:
    """Asks, validates, retries with the problem stated, and counts."""

    complete: Complete
    retries: int
    stats: Stats = field(default_factory=Stats)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(
        self, messages: list[dict[str, str]], schema: dict[str, Any], parse: Callable[[str], T]
    ) -> T | None:
        with self.lock:
            self.stats.requests += 1
        for attempt in range(self.retries + 1):
            with self.lock:
                self.stats.calls += 1
                self.stats.retries += attempt > 0
            try:
                answer = self.complete(messages, schema)
            except Exception as exc:  # a provider failure costs this question only
                self._problem("errors", f"{type(exc).__name__}: {exc}")
                continue
            try:
                return parse(answer)
            except _Invalid as exc:
                self._problem("invalid", str(exc))
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer[:ANSWER_CHARS]},
                    {
                        "role": "user",
                        "content": f"That answer is invalid: {exc}. Answer again with only the "
                        "corrected JSON object.",
                    },
                ]
        with self.lock:
            self.stats.dropped += 1
        return None

    def _problem(self, counter: str, problem: str) -> None:
        log.warning("LLM analyzer: %s", problem)
        with self.lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            self.stats.last_problem = problem

    def map(self, jobs: Sequence[Callable[[], T]], concurrency: int) -> list[T]:
        if concurrency <= 1:
            return [job() for job in jobs]
        with ThreadPoolExecutor(concurrency, thread_name_prefix="llm-analyzer") as pool:
            return list(pool.map(lambda job: job(), jobs))


def _alias(i: int) -> str:
    return f"e{i + 1}"


def _discover(
    episodes: Sequence[Episode],
    success: Sequence[bool],
    asker: _Asker,
    sample: int,
    seed: int,
    concurrency: int,
) -> list[Candidate]:
    """Candidates from a sample that favours failures two to one; several calls are merged,
    the names proposed most often first."""
    rng = random.Random(seed)
    failed, passed = [i for i, ok in enumerate(success) if not ok], [i for i, ok in enumerate(success) if ok]
    rng.shuffle(failed)
    rng.shuffle(passed)
    n_failed = min(len(failed), max(math.ceil(sample * 2 / 3), sample - len(passed)))
    chosen = failed[:n_failed] + passed[: sample - n_failed]
    rng.shuffle(chosen)
    batches = [chosen[i : i + DISCOVERY_BATCH] for i in range(0, len(chosen), DISCOVERY_BATCH)]

    def job(batch: list[int]) -> list[_Proposal] | None:
        aliases = [_alias(i) for i in batch]
        text = "\n\n".join(render_episode(episodes[i], _alias(i)) for i in batch)
        messages = [{"role": "system", "content": _DISCOVERY_PROMPT}, {"role": "user", "content": text}]
        return asker.ask(messages, _discovery_schema(aliases), lambda a: _parse_discovery(a, aliases))

    merged: dict[str, Candidate] = {}
    votes: Counter[str] = Counter()
    by_alias = {_alias(i): e.id for i, e in enumerate(episodes)}
    for proposals in asker.map([lambda b=b: job(b) for b in batches], concurrency):
        for p in proposals or ():
            votes[p.name] += 1
            candidate = merged.setdefault(p.name, Candidate(p.name, p.description.strip()))
            candidate.examples += [by_alias[a] for a in p.examples if by_alias[a] not in candidate.examples]
    ranked = sorted(merged, key=lambda name: -votes[name])  # stable: first proposed first among ties
    return [merged[name] for name in ranked[:MAX_CAPABILITIES]]


def _label_run(
    episodes: Sequence[Episode],
    candidates: Sequence[Candidate],
    asker: _Asker,
    batch_size: int,
    seed: int,
) -> list[Callable[[], dict[int, dict[str, Label]]]]:
    """One run's batches, as jobs: the episodes in a fresh order, each batch a fresh conversation."""
    names = [c.name for c in candidates]
    listing = "\n".join(f"- {c.name}: {c.description}" for c in candidates)
    order = random.Random(seed).sample(range(len(episodes)), k=len(episodes))

    def job(batch: list[int]) -> dict[int, dict[str, Label]]:
        aliases = [_alias(i) for i in batch]
        example = json.dumps({aliases[0]: {n: list(Label)[k % 3] for k, n in enumerate(names)}})
        system = _LABELING_PROMPT.format(capabilities=listing, example=example)
        text = "\n\n".join(render_episode(episodes[i], _alias(i), show_outcome=False) for i in batch)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        labels = asker.ask(
            messages, _labeling_schema(aliases, names), lambda a: _parse_labels(a, aliases, names)
        )
        if labels is None:
            with asker.lock:
                asker.stats.unlabeled += len(batch)
            return {}
        return {i: labels[_alias(i)] for i in batch}

    return [lambda b=order[i : i + batch_size]: job(b) for i in range(0, len(order), batch_size)]


# -- the analysis ---------------------------------------------------------------------------


def analyze_episodes(
    episodes: Sequence[Episode],
    complete: Complete,
    *,
    rule: SelectionRule = DEFAULT_RULE,
    runs: int | None = None,
    batch_size: int = 8,
    sample: int = 30,
    retries: int = 2,
    concurrency: int = 1,
    seed: int = 0,
    candidates: Sequence[Candidate] | None = None,
) -> Analysis:
    """Discover candidates in ``episodes`` (each with a known outcome), label them in ``runs``
    runs (default ``rule.n``) and select with ``rule``. ``complete`` does the model calls.

    Given ``candidates`` (the detectors' capabilities, say), discovery is skipped and the
    model only labels."""
    success = [bool(outcome(e)) for e in episodes]
    asker = _Asker(complete, retries)
    if all(success):  # nothing failed: nothing to explain
        return Analysis([], [], asker.stats)
    if candidates is None:
        candidates = _discover(episodes, success, asker, sample, seed, concurrency)
    if not candidates:
        return Analysis([], [], asker.stats)
    count = rule.n if runs is None else runs
    batches = [
        (r, job)
        for r in range(count)
        for job in _label_run(episodes, candidates, asker, batch_size, seed + 1 + r)
    ]
    per_run: list[dict[int, dict[str, Label]]] = [{} for _ in range(count)]
    for (r, _), labels in zip(batches, asker.map([job for _, job in batches], concurrency), strict=True):
        per_run[r].update(labels)
    return Analysis(
        _capabilities(episodes, success, candidates, per_run, rule, asker.stats),
        list(candidates),
        asker.stats,
    )


def _capabilities(
    episodes: Sequence[Episode],
    success: Sequence[bool],
    candidates: Sequence[Candidate],
    per_run: Sequence[dict[int, dict[str, Label]]],
    rule: SelectionRule,
    stats: Stats,
) -> list[Capability]:
    """Capability records from the labeled runs; runs whose every batch was dropped are left out."""
    runs: list[Run] = []
    for labels in per_run:
        labeled = sorted(labels)
        if labeled:
            runs.append(
                (
                    {c.name: [labels[i][c.name] for i in labeled] for c in candidates},
                    [success[i] for i in labeled],
                )
            )
    descriptions = {c.name: c.description for c in candidates}
    mining_run = new_id()
    capabilities = []
    for selection in select(runs, rule):
        name = selection.capability
        votes = Counter(i for labels in per_run for i, row in labels.items() if row[name] is Label.LACKING)
        seen = Counter(i for labels in per_run for i in labels)
        # failed episodes that most runs labeled LACKING, the most agreed first
        lacking = sorted(
            (i for i in votes if not success[i] and 2 * votes[i] >= seen[i]), key=lambda i: (-votes[i], i)
        )
        calls = [c for i in lacking for c in Trajectory.from_episode(episodes[i]).offered_calls()]
        tools, entities = involved(calls)
        capabilities.append(
            Capability(
                name=name,
                description=descriptions[name],
                source="llm",
                selected=selection.selected,
                metrics={**_metrics(selection, rule), "llm": stats.as_dict()},
                examples=[episodes[i].id for i in lacking[:MAX_EXAMPLES]],
                tools=tools,
                entities=entities,
                mining_run=mining_run,
            )
        )
    return capabilities


@dataclass
class LLMAnalyzer:
    """Mines an agent's stored episodes with a model (any litellm model name) and TRACE's rule."""

    store: Store
    model: str
    rule: SelectionRule = DEFAULT_RULE
    runs: int | None = None  # labeling runs; default rule.n
    batch_size: int = 8
    sample: int = 30  # episodes shown to discovery
    retries: int = 2
    concurrency: int = 4
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # for litellm.completion: api_base, max_tokens...
    stats: Stats | None = field(default=None, init=False)  # the last mine's

    def mine(self, agent: str, *, limit: int | None = None, save: bool = True) -> list[Capability]:
        episodes = [e for e in self.store.load_episodes(agent, limit=limit) if outcome(e) is not None]
        analysis = analyze_episodes(
            episodes,
            LiteLLMComplete(self.model, **self.options),
            rule=self.rule,
            runs=self.runs,
            batch_size=self.batch_size,
            sample=self.sample,
            retries=self.retries,
            concurrency=self.concurrency,
            seed=self.seed,
        )
        self.stats = analysis.stats
        for capability in analysis.capabilities:
            capability.metrics["llm"]["model"] = self.model
        if save:
            self.store.save_capabilities(agent, analysis.capabilities)
        return analysis.capabilities
