"""One greedy chat completion over HTTP, shared by the tests that compare served tokens."""

from __future__ import annotations

from typing import Any

import httpx


def chat(url: str, model: str, text: str, *, max_tokens: int = 12, **extra: Any) -> httpx.Response:
    """A single-user-turn chat completion at temperature 0, with the served token ids."""
    return httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "return_token_ids": True,
            **extra,
        },
    )
