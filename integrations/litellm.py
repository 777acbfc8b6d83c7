"""litellm capture: a ``CustomLogger`` that records every ``completion`` / ``acompletion``.

    import litellm
    from integrations.litellm import TraceLogger
    litellm.callbacks = [TraceLogger(agent="support")]

Calls are grouped into episodes like the gateway's: by ``metadata={"trace_episode_id":
...}`` on the call, else by following the conversation. litellm runs loggers after the
call returns, on its own workers, so a conversation's second call can be logged before its
first: a call that continues a conversation waits, off the agent's thread, until the calls
made before it are recorded. Call ``logger.flush()`` (or ``await logger.aflush()``) before
reading the store in the same process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download at import

from litellm.integrations.custom_logger import CustomLogger  # noqa: E402

from trace_plugin.conversations import ConversationEpisodes, ModelCall, served_by  # noqa: E402
from trace_plugin.recorder import Recorder  # noqa: E402
from trace_plugin.tracer import Tracer  # noqa: E402

log = logging.getLogger("trace_plugin")
HOLD_S = 30.0  # the longest a call waits for an earlier, still unlogged one


class TraceLogger(CustomLogger):
    """Records litellm calls as LLM steps. Never raises into litellm or the caller."""

    def __init__(
        self, agent: str = "litellm", *, recorder: Recorder | None = None, redact: Any = None
    ) -> None:
        super().__init__()
        self.agent = agent
        self._tracers: dict[str, Tracer] = {}
        self._recorder, self._redact = recorder, redact
        self.episodes = ConversationEpisodes(self._tracer_for)
        self._order = itertools.count()
        # litellm_call_id -> (order, when announced), for calls announced but not logged yet
        self._pending: dict[str, tuple[int, float]] = {}
        self._held: list[tuple[int, ModelCall]] = []  # logged before the calls made earlier
        self._idle = threading.Condition()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every call made so far has been recorded (litellm logs from its own
        thread pool and event-loop worker, after the call has returned). A call still held
        back at the deadline is recorded as it is."""
        with self._idle:
            done = self._idle.wait_for(lambda: not self._pending and not self._held, timeout)
            if not done:
                self._release(everything=True)
            return done

    async def aflush(self, timeout: float = 10.0) -> bool:
        """``flush`` for async code: lets litellm's logging tasks on this loop run."""
        deadline = time.monotonic() + timeout
        while self._pending or self._held:
            if time.monotonic() > deadline:
                with self._idle:
                    self._release(everything=True)
                return False
            await asyncio.sleep(0.01)
        return True

    def _tracer_for(self, agent: str) -> Tracer:
        if agent not in self._tracers:
            self._tracers[agent] = Tracer(
                agent, source="litellm", recorder=self._recorder, redact=self._redact
            )
        return self._tracers[agent]

    # litellm passes these by keyword, with exactly these names.
    def log_pre_api_call(self, model, messages, kwargs) -> None:
        call_id = kwargs.get("litellm_call_id")
        if call_id:
            with self._idle:
                self._pending[call_id] = (next(self._order), time.monotonic())

    def log_success_event(self, kwargs, response_obj, start_time, end_time) -> None:
        self._record(kwargs, response_obj, start_time, end_time, error=None)

    def log_failure_event(self, kwargs, response_obj, start_time, end_time) -> None:
        self._record(kwargs, None, start_time, end_time, error=_error_text(kwargs, response_obj))

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time) -> None:
        self._record(kwargs, response_obj, start_time, end_time, error=None)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time) -> None:
        self._record(kwargs, None, start_time, end_time, error=_error_text(kwargs, response_obj))

    def _record(self, kwargs: dict[str, Any], response: Any, start: Any, end: Any, error: str | None) -> None:
        call = None
        try:
            call = _model_call(kwargs, response, start, end, error, self.agent)
        except Exception:  # capture must never break the caller
            log.exception("trace-plugin: could not record a litellm call")
        with self._idle:
            order, _ = self._pending.pop(kwargs.get("litellm_call_id"), (next(self._order), None))
            if call is not None:
                self._held.append((order, call))
            self._release(everything=False)
            self._idle.notify_all()

    def _release(self, *, everything: bool) -> None:
        """Record, in call order, each held call whose place is settled or that no
        earlier unlogged call could settle. A call unlogged for ``HOLD_S`` holds nothing back
        (litellm may never log it). Runs under ``self._idle``."""
        self._held.sort(key=lambda held: held[0])
        recent = time.monotonic() - HOLD_S
        progress = True
        while progress and self._held:
            progress = False
            first_unlogged = min((o for o, at in self._pending.values() if at > recent), default=None)
            for index, (order, call) in enumerate(self._held):
                earlier = first_unlogged is not None and first_unlogged < order
                if everything or not earlier or self.episodes.placed(call):
                    del self._held[index]
                    self._store(call)
                    progress = True
                    break

    def _store(self, call: ModelCall) -> None:
        try:
            self.episodes.record(call)
        except Exception:  # capture must never break the caller
            log.exception("trace-plugin: could not record a litellm call")


def _model_call(
    kwargs: dict[str, Any], response: Any, start: Any, end: Any, error: str | None, agent: str
) -> ModelCall:
    metadata = (kwargs.get("litellm_params") or {}).get("metadata") or {}
    optional = kwargs.get("optional_params") or {}
    reply, usage = None, {}
    router, adapter = served_by(getattr(response, "system_fingerprint", None)) or (None, None)
    if response is not None and getattr(response, "choices", None):
        reply = response.choices[0].message.model_dump(exclude_none=True)
        usage = getattr(response, "usage", None) or {}
    return ModelCall(
        agent=metadata.get("trace_agent") or agent,
        messages=[dict(m) for m in kwargs.get("messages") or []],
        model=str(kwargs.get("model")),
        reply=reply,
        tools=optional.get("tools") or kwargs.get("tools"),
        episode_id=metadata.get("trace_episode_id"),
        adapter=adapter,
        router=router,
        error=error,
        prompt_tokens=getattr(usage, "prompt_tokens", None),
        completion_tokens=getattr(usage, "completion_tokens", None),
        latency_ms=_ms(start, end),
        started_at=_utc(start),
    )


def _error_text(kwargs: dict[str, Any], response: Any) -> str:
    exc = kwargs.get("exception") or response
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(exc)


def _utc(value: Any) -> datetime | None:
    return value.astimezone(UTC) if isinstance(value, datetime) else None  # naive means local time


def _ms(start: Any, end: Any) -> float | None:
    if isinstance(start, datetime) and isinstance(end, datetime):
        return (end - start).total_seconds() * 1000
    return None
