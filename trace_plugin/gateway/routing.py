"""Routers: which adapter serves a request that names the agent or the base model.

A router sees the conversation and the offered tools and names an adapter (its
unversioned name: the registry picks the live version) or None for the base model. Every
router is described by a JSON spec (``router.spec``, the wire form of a
:mod:`trace_plugin.records.router_spec` model), which is what deployments store and what the
gateway's admin API accepts, so a router version can be deployed, recorded and rolled back
like an adapter: static, keyword, the TRACE paper's base model as classifier, and a learned
mixture-of-experts gate over the base model's embedding of the request (trained by
``training.gate``), hard top-1. A gate's weights live in its spec, so a gate is versioned
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
from trace_plugin.records.router_spec import (
    ClassifierSpec,
    ExpertEntry,
    GateSpec,
    KeywordSpec,
    RouterSpec,
    RouterSpecError,
    StaticSpec,
    parse_router_spec,
    router_version,
)

__all__ = [
    "ClassifierRouter",
    "ExpertChoice",
    "GateRouter",
    "KeywordRouter",
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

    async def route(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> str | None: ...


class StaticRouter:
    """Always the same adapter (or always the base model)."""

    def __init__(self, adapter: str | None = None) -> None:
        self.adapter = adapter
        self.spec = StaticSpec(adapter=adapter).to_dict()

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        return self.adapter


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

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        text = _last_user(messages)
        for pattern, adapter in self.rules:
            if pattern.search(text):
                return adapter
        return self.default


@dataclass(frozen=True, slots=True)
class ExpertChoice:
    adapter: str  # the served name
    name: str  # the capability
    description: str


class _Decisions:
    """Routing decisions by request text: every turn of a conversation gets one expert."""

    def __init__(self, size: int = 4096) -> None:
        self._cache: OrderedDict[str, str | None] = OrderedDict()
        self.size = size

    def get(self, request: str) -> tuple[bool, str | None]:
        key = hashlib.sha256(request.encode()).hexdigest()
        if key not in self._cache:
            return False, None
        self._cache.move_to_end(key)
        return True, self._cache[key]

    def put(self, request: str, choice: str | None) -> None:
        self._cache[hashlib.sha256(request.encode()).hexdigest()] = choice
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)


class ClassifierRouter:
    """The base model as classifier (TRACE): one forward pass scores a letter per expert.

    The prompt lists each capability as ``A: name — description`` plus ``N: none``; the
    letters' next-token log-probabilities, renormalized over the letters, decide. Below
    ``threshold`` (or on ``N``) the request goes to the base model. Decisions are cached
    by the request (the latest user message: tool turns do not change it, few-shot
    examples before it do not matter), so every turn of a conversation has the same expert.
    """

    NONE = "N"

    def __init__(
        self,
        backend: Backend,
        experts: Sequence[ExpertChoice],
        *,
        threshold: float = 0.5,
        cache_size: int = 4096,
    ) -> None:
        if not experts or len(experts) > 13:
            raise RouterSpecError("a classifier router needs between 1 and 13 experts")
        self.backend, self.experts = backend, list(experts)
        self.threshold = threshold
        self.letters = [chr(ord("A") + i) for i in range(len(self.experts))]
        self._decisions = _Decisions(cache_size)
        self.spec = ClassifierSpec(
            experts=[ExpertEntry(adapter=e.adapter, name=e.name, description=e.description) for e in experts],
            threshold=threshold,
        ).to_dict()

    def prompt(self, request: str) -> str:
        options = "\n".join(
            f"{letter}: {e.name} — {e.description}"
            for letter, e in zip(self.letters, self.experts, strict=True)
        )
        system = (
            "Which skill does answering this request need most? Options:\n"
            f"{options}\n{self.NONE}: none of these\nReply with the letter only."
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": request[:1000]}]
        return self.backend.render(messages, None)

    def probabilities(self, top: dict[str, float]) -> dict[str, float]:
        """Renormalized letter probabilities from a position's top log-probabilities."""
        scores: dict[str, float] = {}
        for token, logprob in top.items():
            letter = token.strip().upper()
            if letter in (*self.letters, self.NONE) and len(letter) == 1:
                scores[letter] = scores.get(letter, 0.0) + math.exp(logprob)
        total = sum(scores.values())
        return {k: v / total for k, v in scores.items()} if total else {}

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        request = _last_user(messages)
        known, choice = self._decisions.get(request)
        if known:
            return choice
        [completion] = await self.backend.generate(
            self.prompt(request), SamplingParams(max_tokens=1, top_logprobs=20), None
        )
        probabilities = self.probabilities((completion.top_logprobs or [{}])[0])
        choice = None
        if probabilities:
            letter = max(probabilities, key=probabilities.__getitem__)
            if letter != self.NONE and probabilities[letter] >= self.threshold:
                choice = self.experts[self.letters.index(letter)].adapter
        self._decisions.put(request, choice)
        return choice


class GateRouter:
    """A learned gate: softmax(W · standardized embedding + b) over the base and the experts.

    Hard top-1, as vLLM serves one adapter per request; below ``threshold`` the request
    goes to the base model. ``choices[i]`` is the adapter for class i (None: the base).
    """

    def __init__(
        self,
        backend: Backend,
        choices: Sequence[str | None],
        weight: Sequence[Sequence[float]],
        bias: Sequence[float],
        mean: Sequence[float],
        scale: Sequence[float],
        *,
        threshold: float = 0.0,
        cache_size: int = 4096,
    ) -> None:
        if len(choices) < 2 or not (len(choices) == len(weight) == len(bias)):
            raise RouterSpecError("a gate needs one weight row and bias per choice, two choices or more")
        if any(len(row) != len(mean) for row in weight) or len(scale) != len(mean):
            raise RouterSpecError("gate weight rows, mean and scale must have the embedding's size")
        if any(s <= 0 for s in scale):
            raise RouterSpecError("gate scales must be positive")
        self.backend, self.choices = backend, list(choices)
        self.weight, self.bias = [list(map(float, row)) for row in weight], list(map(float, bias))
        self.mean, self.scale = list(map(float, mean)), list(map(float, scale))
        self.threshold = threshold
        self._decisions = _Decisions(cache_size)
        self.spec = GateSpec(
            choices=self.choices,
            weight=self.weight,
            bias=self.bias,
            mean=self.mean,
            scale=self.scale,
            threshold=threshold,
        ).to_dict()

    def probabilities(self, embedding: Sequence[float]) -> list[float]:
        if len(embedding) != len(self.mean):
            raise RouterSpecError(f"the gate expects {len(self.mean)}-d embeddings, got {len(embedding)}")
        x = [(v - m) / s for v, m, s in zip(embedding, self.mean, self.scale, strict=True)]
        logits = [
            sum(w * v for w, v in zip(row, x, strict=True)) + b
            for row, b in zip(self.weight, self.bias, strict=True)
        ]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        total = sum(exps)
        return [e / total for e in exps]

    async def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        request = _last_user(messages)
        known, choice = self._decisions.get(request)
        if known:
            return choice
        [embedding] = await self.backend.embed([gate_input(request)])
        probabilities = self.probabilities(embedding)
        best = max(range(len(probabilities)), key=probabilities.__getitem__)
        choice = self.choices[best] if probabilities[best] >= self.threshold else None
        self._decisions.put(request, choice)
        return choice


def router_from_spec(spec: RouterSpec | dict[str, Any], backend: Backend) -> Router:
    """Build the router a spec (a model, or a dict validated as one) describes;
    RouterSpecError says what is wrong with it."""
    model = parse_router_spec(spec)
    try:
        if isinstance(model, StaticSpec):
            return StaticRouter(model.adapter)
        if isinstance(model, KeywordSpec):
            return KeywordRouter(model.rules, model.default)
        if isinstance(model, ClassifierSpec):
            experts = [ExpertChoice(e.adapter, e.name, e.description) for e in model.experts]
            return ClassifierRouter(backend, experts, threshold=model.threshold)
        return GateRouter(
            backend,
            model.choices,
            model.weight,
            model.bias,
            model.mean,
            model.scale,
            threshold=model.threshold,
        )
    except RouterSpecError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterSpecError(f"bad {model.kind} router spec: {exc}") from None


def referenced_adapters(spec: RouterSpec | dict[str, Any]) -> set[str]:
    """Every adapter a (valid) router spec can send requests to."""
    return {name for name in parse_router_spec(spec).adapters() if name is not None}


def _last_user(messages: list[dict[str, Any]]) -> str:
    return next((content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
