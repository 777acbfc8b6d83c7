"""Routers: which adapters serve a request that names the agent or the base model.

A router sees the conversation and the offered tools and returns a
``Mixture``: adapters (by unversioned name: the registry
picks the live versions) and their weights, empty for the base model; one adapter at
weight 1 is a plain choice. Every
router is described by a JSON spec (``router.spec``, the wire form of a
``trace_plugin.records.router_spec`` model), which is what deployments store and what the
gateway's admin API accepts, so a router version can be deployed, recorded and rolled back
like an adapter: static, keyword, the TRACE paper's base model as classifier, and its
learned per-layer mixture-of-experts gate over the base model's embedding of the request
(trained by ``training.gate``). A gate's weights live in its spec, so a gate is versioned
and rolled back like any router.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trace_plugin.chat_template import content_text, gate_input
from trace_plugin.gateway.backend import Backend, SamplingParams
from trace_plugin.records.mixture import Mixture
from trace_plugin.records.router_spec import (
    CanarySpec,
    ClassifierSpec,
    CorpusEntry,
    ExpertEntry,
    GateSpec,
    KeywordSpec,
    Retrieval,
    RouterSpec,
    RouterSpecError,
    StaticSpec,
    parse_router_spec,
    router_version,
)

__all__ = [
    "CanaryRouter",
    "ClassifierRouter",
    "ExpertChoice",
    "GateRouter",
    "KeywordRouter",
    "Mixture",
    "Router",
    "RouterSpecError",
    "StaticRouter",
    "gate_input",
    "referenced_adapters",
    "router_from_spec",
    "router_version",
]


class Router(Protocol):
    spec: dict[str, Any]

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture: ...


class StaticRouter:
    """Always the same adapter (or always the base model)."""

    def __init__(self, adapter: str | None = None) -> None:
        self.adapter = adapter
        self.spec = StaticSpec(adapter=adapter).to_dict()

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture:
        return Mixture.of(self.adapter)


class KeywordRouter:
    """The first rule whose keyword occurs in the latest user message, else ``default``.

    Rules are ``(keywords, adapter)`` pairs; keywords match whole words, case-insensitively.
    """

    def __init__(self, rules: Sequence[tuple[Sequence[str], str]], default: str | None = None) -> None:
        self.rules = [
            (re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.I), a) for words, a in rules
        ]
        self.default = default
        self.spec = KeywordSpec(rules=[(list(w), a) for w, a in rules], default=default).to_dict()

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture:
        text = _last_user(messages)
        for pattern, adapter in self.rules:
            if pattern.search(text):
                return Mixture.of(adapter)
        return Mixture.of(self.default)


@dataclass(frozen=True, slots=True)
class ExpertChoice:
    adapter: str  # the served name
    name: str  # the capability
    description: str


class _Decisions:
    """Routing decisions by request text: every turn of a conversation gets one expert."""

    def __init__(self, size: int = 4096) -> None:
        self._cache: OrderedDict[str, Mixture] = OrderedDict()
        self.size = size

    def get(self, request: str) -> Mixture | None:
        key = hashlib.sha256(request.encode()).hexdigest()
        if key not in self._cache:
            return None
        self._cache.move_to_end(key)
        return self._cache[key]

    def put(self, request: str, choice: Mixture) -> None:
        self._cache[hashlib.sha256(request.encode()).hexdigest()] = choice
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)


class ClassifierRouter:
    """The base model as classifier (TRACE): one forward pass scores a letter per candidate.

    The prompt lists each candidate as ``A: name — description`` plus ``N: none``; the
    letters' next-token probabilities, renormalized over the letters, decide. Without
    ``retrieval`` every expert is a candidate and the top letter wins if it reaches
    ``threshold`` (hard top-1). With it (TRACE's router), the request's embedding retrieves
    the ``k`` most similar successful trajectories; their capabilities are the candidates,
    each shown with its retrieved trajectory, which keeps the choice small as capabilities
    grow. If ``N`` is the most probable label, ``fallback`` routes (the deployment the
    candidate would replace; without one the base model serves); otherwise the smallest set
    of labels whose probability exceeds ``top_p`` is kept, and the candidates in it are
    weighted by their probabilities. Decisions are cached by the request (the latest user
    message: tool turns do not change it), so a conversation keeps its mixture.
    """

    NONE = "N"
    LETTERS = "ABCDEFGHIJKLM"  # N is taken

    def __init__(
        self,
        backend: Backend,
        experts: Sequence[ExpertChoice],
        *,
        threshold: float = 0.5,
        retrieval: Retrieval | None = None,
        fallback: Router | None = None,
        cache_size: int = 4096,
    ) -> None:
        if not experts or len(experts) > len(self.LETTERS):
            raise RouterSpecError(f"a classifier router needs between 1 and {len(self.LETTERS)} experts")
        self.backend, self.experts = backend, list(experts)
        self.threshold, self.retrieval, self.fallback = threshold, retrieval, fallback
        self._by_name = {e.name: e for e in self.experts}
        self._corpus = [(_unit(e.embedding), e) for e in retrieval.corpus] if retrieval else []
        self._decisions = _Decisions(cache_size)
        self.spec = ClassifierSpec(
            experts=[ExpertEntry(adapter=e.adapter, name=e.name, description=e.description) for e in experts],
            threshold=threshold,
            retrieval=retrieval,
            fallback=parse_router_spec(fallback.spec) if fallback is not None else None,
        ).to_dict()

    async def candidates(self, request: str) -> list[tuple[ExpertChoice, CorpusEntry | None]]:
        """The experts to choose from, each with the trajectory that made it a candidate."""
        if self.retrieval is None:
            return [(e, None) for e in self.experts]
        [query] = await self.backend.embed([gate_input(request)])
        if len(query) != len(self._corpus[0][0]):
            raise RouterSpecError(
                f"the corpus holds {len(self._corpus[0][0])}-d embeddings, got {len(query)}"
            )
        unit = _unit(query)
        nearest = sorted(
            self._corpus, key=lambda item: -sum(a * b for a, b in zip(unit, item[0], strict=True))
        )
        found: dict[str, CorpusEntry] = {}
        for _, entry in nearest[: self.retrieval.k]:
            found.setdefault(entry.capability, entry)
        return [(self._by_name[name], entry) for name, entry in found.items()]

    def prompt(self, request: str, candidates: Sequence[tuple[ExpertChoice, CorpusEntry | None]]) -> str:
        options = []
        for letter, (expert, example) in zip(self.LETTERS, candidates, strict=False):
            options.append(f"{letter}: {expert.name} — {expert.description}")
            if example is not None:
                options.append(f"   e.g. {example.request[:300]!r} was solved by: {example.solution[:300]}")
        system = (
            "Which skill does answering this request need most? Options:\n"
            + "\n".join(options)
            + f"\n{self.NONE}: none of these\nReply with the letter only."
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": request[:1000]}]
        return self.backend.render(messages, None)

    def probabilities(self, top: dict[str, float], letters: str) -> dict[str, float]:
        """Label probabilities (``letters`` and ``N``), renormalized, from a position's top logprobs."""
        scores: dict[str, float] = {}
        for token, logprob in top.items():
            label = token.strip().upper()
            if len(label) == 1 and label in (*letters, self.NONE):
                scores[label] = scores.get(label, 0.0) + math.exp(logprob)
        total = sum(scores.values())
        return {k: v / total for k, v in scores.items()} if total else {}

    def decide(self, probabilities: dict[str, float], adapters: Sequence[str]) -> Mixture:
        """The mixture label probabilities call for; ``adapters[i]`` is letter i's."""
        if not probabilities:
            return Mixture()
        ranked = sorted(probabilities, key=lambda label: -probabilities[label])
        if ranked[0] == self.NONE:
            return Mixture()
        if self.retrieval is None:
            best = ranked[0]
            return Mixture.of(
                adapters[self.LETTERS.index(best)] if probabilities[best] >= self.threshold else None
            )
        kept, mass = [], 0.0
        for label in ranked:  # the nucleus: the smallest set whose probability exceeds top_p
            kept.append(label)
            mass += probabilities[label]
            if mass > self.retrieval.top_p:
                break
        return Mixture.of({adapters[self.LETTERS.index(k)]: probabilities[k] for k in kept if k != self.NONE})

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture:
        request = _last_user(messages)
        if (known := self._decisions.get(request)) is not None:
            return known
        candidates = await self.candidates(request)
        [completion] = await self.backend.generate(
            self.prompt(request, candidates), SamplingParams(max_tokens=1, top_logprobs=20), None
        )
        letters = self.LETTERS[: len(candidates)]
        probabilities = self.probabilities((completion.top_logprobs or [{}])[0], letters)
        choice = self.decide(probabilities, [expert.adapter for expert, _ in candidates])
        if not choice.weights and self.fallback is not None:
            choice = await self.fallback.route(messages, tools)
        self._decisions.put(request, choice)
        return choice


class GateRouter:
    """The paper's learned gate: per decoder layer, a softmax over the base model and the
    experts, computed once from the request's embedding and held for the conversation.

    ``choices[0]`` is the base model's slot (None); ``choices[i]`` the adapter of class i.
    The result is a per-layer ``Mixture`` (one composed adapter on either backend),
    or a plain one when every layer agrees.
    """

    def __init__(
        self,
        backend: Backend,
        choices: Sequence[str | None],
        mean: Sequence[float],
        scale: Sequence[float],
        projection: Sequence[Sequence[float]],
        weight: Sequence[Sequence[Sequence[float]]],
        bias: Sequence[Sequence[float]],
        *,
        cache_size: int = 4096,
    ) -> None:
        if len(choices) < 2 or choices[0] is not None or None in choices[1:]:
            raise RouterSpecError("a gate's choices are the base model (None) first, then one expert or more")
        if not projection or any(len(row) != len(mean) for row in projection) or len(scale) != len(mean):
            raise RouterSpecError("gate projection rows, mean and scale must have the embedding's size")
        if not weight or len(bias) != len(weight):
            raise RouterSpecError("a gate needs one weight matrix and one bias per layer, one layer or more")
        for heads, offsets in zip(weight, bias, strict=True):
            if len(heads) != len(choices) or len(offsets) != len(choices):
                raise RouterSpecError("every layer of a gate has one weight row and bias per choice")
            if any(len(row) != len(projection) for row in heads):
                raise RouterSpecError("gate weight rows must have the projection's rank")
        if any(s <= 0 for s in scale):
            raise RouterSpecError("gate scales must be positive")
        self.backend, self.choices = backend, list(choices)
        self.mean, self.scale = list(map(float, mean)), list(map(float, scale))
        self.projection = [list(map(float, row)) for row in projection]
        self.weight = [[list(map(float, row)) for row in heads] for heads in weight]
        self.bias = [list(map(float, offsets)) for offsets in bias]
        self._decisions = _Decisions(cache_size)
        self.spec = GateSpec(
            choices=self.choices,
            mean=self.mean,
            scale=self.scale,
            projection=self.projection,
            weight=self.weight,
            bias=self.bias,
        ).to_dict()

    def probabilities(self, embedding: Sequence[float]) -> list[list[float]]:
        """Per layer, the probability of each choice."""
        if len(embedding) != len(self.mean):
            raise RouterSpecError(f"the gate expects {len(self.mean)}-d embeddings, got {len(embedding)}")
        x = [(v - m) / s for v, m, s in zip(embedding, self.mean, self.scale, strict=True)]
        z = [sum(p * v for p, v in zip(row, x, strict=True)) for row in self.projection]
        return [
            _softmax(
                [
                    sum(w * v for w, v in zip(row, z, strict=True)) + b
                    for row, b in zip(heads, offsets, strict=True)
                ]
            )
            for heads, offsets in zip(self.weight, self.bias, strict=True)
        ]

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture:
        request = _last_user(messages)
        if (known := self._decisions.get(request)) is not None:
            return known
        [embedding] = await self.backend.embed([gate_input(request)])
        layers = self.probabilities(embedding)
        choice = Mixture.per_layer([dict(zip(self.choices, row, strict=True)) for row in layers])
        self._decisions.put(request, choice)
        return choice


class CanaryRouter:
    """A deployment on trial: ``share`` of the requests go to ``candidate``, the rest to
    ``main``, by a hash of the latest user message (an agent's turns on one request share
    it). The gateway asks for the request's ``arm`` and stamps that router's version on the
    episode, so the monitor can compare the two."""

    def __init__(self, main: Router, candidate: Router, share: float) -> None:
        self.main, self.candidate, self.share = main, candidate, share
        self.spec = CanarySpec(share=share, main=main.spec, candidate=candidate.spec).to_dict()

    def arm(self, messages: list[dict[str, Any]]) -> Router:
        digest = hashlib.sha256(_last_user(messages).encode()).digest()
        return self.candidate if int.from_bytes(digest[:8], "big") / 2**64 < self.share else self.main

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Mixture:
        return await self.arm(messages).route(messages, tools)


def router_from_spec(spec: RouterSpec | dict[str, Any], backend: Backend) -> Router:
    """Build the router a spec (a model, or a dict validated as one) describes;
    RouterSpecError says what is wrong with it."""
    model = parse_router_spec(spec)
    if isinstance(model, CanarySpec):
        main, candidate = (router_from_spec(arm, backend) for arm in (model.main, model.candidate))
        return CanaryRouter(main, candidate, model.share)
    try:
        if isinstance(model, StaticSpec):
            return StaticRouter(model.adapter)
        if isinstance(model, KeywordSpec):
            return KeywordRouter(model.rules, model.default)
        if isinstance(model, ClassifierSpec):
            experts = [ExpertChoice(e.adapter, e.name, e.description) for e in model.experts]
            fallback = router_from_spec(model.fallback, backend) if model.fallback is not None else None
            return ClassifierRouter(
                backend, experts, threshold=model.threshold, retrieval=model.retrieval, fallback=fallback
            )
        return GateRouter(
            backend, model.choices, model.mean, model.scale, model.projection, model.weight, model.bias
        )
    except RouterSpecError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterSpecError(f"bad {model.kind} router spec: {exc}") from None


def referenced_adapters(spec: RouterSpec | dict[str, Any]) -> set[str]:
    """Every adapter a (valid) router spec can send requests to."""
    return {name for name in parse_router_spec(spec).adapters() if name is not None}


def _softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _unit(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _last_user(messages: list[dict[str, Any]]) -> str:
    return next((content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
