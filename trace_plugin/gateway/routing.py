"""Routers: which adapter serves a request that names the agent or the base model.

A router sees the conversation and the offered tools and names an adapter (its
unversioned name: the registry picks the live version) or None for the base model. Every
router is described by a JSON spec (``router.spec``), which is what deployments store
and what the gateway's admin API accepts, so a router version can be deployed, recorded
and rolled back like an adapter:

- ``{"kind": "static", "adapter": NAME | null}``;
- ``{"kind": "keyword", "rules": [[[WORDS], NAME]], "default": NAME | null}``;
- ``{"kind": "classifier", "experts": [{"adapter", "name", "description"}], "threshold"}``:
  the TRACE paper's base model as classifier.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trace_plugin.chat_template import content_text
from trace_plugin.gateway.backend import Backend, SamplingParams


class Router(Protocol):
    spec: dict[str, Any]

    async def route(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> str | None: ...


class RouterSpecError(ValueError):
    pass


class StaticRouter:
    """Always the same adapter (or always the base model)."""

    def __init__(self, adapter: str | None = None) -> None:
        self.adapter = adapter
        self.spec = {"kind": "static", "adapter": adapter}

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
        self.spec = {"kind": "keyword", "rules": [[list(w), a] for w, a in rules], "default": default}

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
        self._cache: OrderedDict[str, str | None] = OrderedDict()
        self._cache_size = cache_size
        self.spec = {
            "kind": "classifier",
            "experts": [
                {"adapter": e.adapter, "name": e.name, "description": e.description} for e in experts
            ],
            "threshold": threshold,
        }

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
        key = hashlib.sha256(request.encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        [completion] = await self.backend.generate(
            self.prompt(request), SamplingParams(max_tokens=1, top_logprobs=20), None
        )
        probabilities = self.probabilities((completion.top_logprobs or [{}])[0])
        choice = None
        if probabilities:
            letter = max(probabilities, key=probabilities.__getitem__)
            if letter != self.NONE and probabilities[letter] >= self.threshold:
                choice = self.experts[self.letters.index(letter)].adapter
        self._cache[key] = choice
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return choice


def router_from_spec(spec: dict[str, Any], backend: Backend) -> Router:
    """Build the router a spec describes; RouterSpecError says what is wrong with it."""
    kind = spec.get("kind")
    try:
        if kind == "static":
            return StaticRouter(spec.get("adapter"))
        if kind == "keyword":
            return KeywordRouter(
                [(list(words), adapter) for words, adapter in spec["rules"]], spec.get("default")
            )
        if kind == "classifier":
            experts = [
                ExpertChoice(e["adapter"], e["name"], e.get("description", "")) for e in spec["experts"]
            ]
            return ClassifierRouter(backend, experts, threshold=float(spec.get("threshold", 0.5)))
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterSpecError(f"bad {kind} router spec: {exc}") from None
    raise RouterSpecError(f"unknown router kind {kind!r}; known: static, keyword, classifier")


def _last_user(messages: list[dict[str, Any]]) -> str:
    return next((content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
