"""Concurrent clients around a hot-swap, shared by the gateway and vLLM-backend tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def swap_under_load(
    call: Callable[[], str], swap: Callable[[], None], *, clients: int = 8, before: int = 16, after: int = 16
) -> tuple[list[str], list[Exception], int]:
    """``clients`` threads call ``call()`` (returning the model that served) in a loop;
    ``swap()`` runs once ``before`` calls are done, and the threads stop ``after`` calls
    later. Returns the served models in completion order, the failures, and the index
    of the first call completed after the swap."""
    served: list[str] = []
    failures: list[Exception] = []
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                served.append(call())
            except Exception as exc:  # every failure is reported to the test
                failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    while len(served) < before and not failures:
        time.sleep(0.05)
    swap()
    mark = len(served)
    while len(served) < mark + after and not failures:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    return served, failures, mark
