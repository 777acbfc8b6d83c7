"""Routers: which adapter serves a request that names the agent or the base model.

A router sees the conversation and the offered tools and names an adapter (its
unversioned name: the registry picks the live version) or None for the base model. The
learned routers (the base model as classifier, the mixture-of-experts gate) implement
the same protocol in ``training``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol


class Router(Protocol):
    def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None: ...


class StaticRouter:
    """Always the same adapter (or always the base model)."""

    def __init__(self, adapter: str | None = None) -> None:
        self.adapter = adapter

    def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
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

    def route(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        text = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
        for pattern, adapter in self.rules:
            if pattern.search(text):
                return adapter
        return self.default
