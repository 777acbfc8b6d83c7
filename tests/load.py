"""Concurrent clients around a hot-swap, shared by the gateway and vLLM-backend tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    """One completed call: the model that served it, and whether it was sent after the
    swap had returned (so only the new version may serve it)."""

    model: str
    after_swap: bool


def swap_under_load(
    call: Callable[[], str], swap: Callable[[], None], *, clients: int = 8, before: int = 16, after: int = 16
) -> tuple[list[Served], list[Exception]]:
    """``clients`` threads call ``call()`` (returning the model that served) in a loop;
    ``swap()`` runs once ``before`` calls are done, and the threads stop ``after`` calls
    later. Returns the calls in completion order and the failures."""
    served: list[Served] = []
    failures: list[Exception] = []
    stop = threading.Event()
    swapped = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            after_swap = swapped.is_set()
            try:
                served.append(Served(call(), after_swap))
            except Exception as exc:  # every failure is reported to the test
                failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    while len(served) < before and not failures:
        time.sleep(0.05)
    swap()
    swapped.set()
    mark = len(served)
    while len(served) < mark + after and not failures:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    return served, failures


def http_swap_under_load(
    url: str, name: str, version: str, path: str, **load: int
) -> tuple[list[Served], list[Exception]]:
    """:func:`swap_under_load` over HTTP against a gateway at ``url``: OpenAI clients ask for
    ``name`` while the admin API loads ``name@version`` from ``path``."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    def call() -> str:
        messages = [{"role": "user", "content": "Hi"}]
        return client.chat.completions.create(
            model=name, messages=messages, max_tokens=2, temperature=0
        ).model

    def swap() -> None:
        body = {"lora_name": f"{name}@{version}", "lora_path": path}
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)
        assert response.status_code == 200, response.text

    return swap_under_load(call, swap, **load)
