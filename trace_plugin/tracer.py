"""The framework-neutral tracer: episodes and steps as capture sources see them.

Integrations (LangGraph callbacks, the gateway, the MCP proxy, litellm) translate their
own events into calls on a ``Tracer``; it stamps ids, order and times and submits
records to the recorder. Nothing here serializes payloads: that happens on the recorder's
thread, so these calls stay cheap on the agent's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from trace_plugin.recorder import PayloadPolicy, Recorder, default_recorder, install_term_handler
from trace_plugin.records.outcome import reward_error
from trace_plugin.records.trajectory import (
    Episode,
    EpisodeEnd,
    EpisodeStatus,
    Step,
    StepKind,
    check_agent_name,
    new_episode_id,
    utcnow,
)

log = logging.getLogger("trace_plugin")

RewardFn = Callable[[Any], float | bool | None]


@dataclass(slots=True)
class ActiveEpisode:
    """An episode being recorded; hands out step numbers in start order."""

    id: str
    model: str | None = None
    adapter: str | None = None  # set when the serving side reports it, written at the end
    router: str | None = None
    _seq: itertools.count = field(default_factory=itertools.count)

    def next_seq(self) -> int:
        return next(self._seq)  # atomic under the GIL: safe from parallel tool threads


class Tracer:
    """Records episodes of one agent through a recorder (the process default if None)."""

    def __init__(
        self,
        agent: str,
        *,
        source: str = "api",
        reward: RewardFn | None = None,
        redact: Any = None,
        max_payload_bytes: int | None = None,
        metadata: dict[str, Any] | None = None,
        on_episode: Callable[[str], Any] | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.agent = check_agent_name(agent)
        self.source = source
        self.reward_fn = reward
        self.metadata = metadata or {}
        self.on_episode = on_episode
        self.policy = PayloadPolicy.of(max_payload_bytes, redact)
        self._recorder = recorder
        install_term_handler()  # here too: the default recorder may first be used off the main thread

    @property
    def recorder(self) -> Recorder:
        return self._recorder or default_recorder()

    def start_episode(
        self,
        input: Any = None,
        *,
        episode_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        model: str | None = None,
        adapter: str | None = None,
        router: str | None = None,
    ) -> ActiveEpisode:
        episode = Episode(
            id=new_episode_id() if episode_id in (None, "") else str(episode_id),
            agent=self.agent,
            source=self.source,
            input=input,
            model=model,
            adapter=adapter,
            router=router,
            metadata={**self.metadata, **(metadata or {})},
        )
        self.recorder.submit(episode, self.policy)
        return ActiveEpisode(episode.id, model=model, adapter=adapter, router=router)

    def record_step(self, step: Step) -> None:
        self.recorder.submit(step, self.policy)

    @contextmanager
    def step(
        self, active: ActiveEpisode, kind: StepKind, name: str, input: Any = None, **fields: Any
    ) -> Iterator[Step]:
        """Time a step: fill in ``output``/``error`` inside the block; it is recorded on exit."""
        step = Step(active.id, active.next_seq(), kind, name, input=input, started_at=utcnow(), **fields)
        t0 = time.perf_counter()
        try:
            yield step
        finally:
            step.latency_ms = (time.perf_counter() - t0) * 1000
            step.ended_at = utcnow()
            self.record_step(step)

    def end_episode(
        self,
        active: ActiveEpisode,
        *,
        output: Any = None,
        error: BaseException | str | None = None,
        status: EpisodeStatus | None = None,
        final_state: Any = None,
    ) -> None:
        """Close an episode; ``reward=`` of the tracer scores ``final_state`` (or ``output``).

        A reward function that fails or returns no number still ends the episode: it is
        stored completed, with no reward and the scoring error in ``error``. One that
        raises KeyboardInterrupt or SystemExit ends it as ``error``, as a tool raising
        either does, and the exception goes on up.
        """
        reward = None
        if self.reward_fn is not None and error is None:
            try:
                reward, scoring_error = self._score(final_state if final_state is not None else output)
            except BaseException as exc:  # not an Exception: the process is being stopped
                self._close(active, output=output, error=exc, status="error", reward=None)
                raise
            if scoring_error is not None:
                error, status = scoring_error, status or "completed"
        self._close(active, output=output, error=error, status=status, reward=reward)

    def _close(
        self,
        active: ActiveEpisode,
        *,
        output: Any,
        error: BaseException | str | None,
        status: EpisodeStatus | None,
        reward: float | None,
    ) -> None:
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        end = EpisodeEnd(
            active.id,
            status=status or ("error" if error else "completed"),
            output=output,
            reward=reward,
            error=error,
            model=active.model,
            adapter=active.adapter,
            router=active.router,
        )
        self.recorder.submit(end, self.policy)
        if self.on_episode is not None:
            try:
                self.on_episode(active.id)
            except Exception:
                log.exception("trace-plugin: on_episode callback failed")

    def _score(self, state: Any) -> tuple[float | None, str | None]:
        """The reward for ``state``, or None and why the reward function gave none."""
        try:
            value = self.reward_fn(state)  # type: ignore[misc]
            reward = None if value is None else float(value)
        except Exception as exc:
            log.exception("trace-plugin: reward function failed for agent %r", self.agent)
            return None, f"scoring failed: {type(exc).__name__}: {exc}"
        problem = None if reward is None else reward_error(reward)
        if problem is not None:
            log.warning("trace-plugin: reward function for agent %r returned %r", self.agent, value)
            return None, f"scoring failed: {problem}"
        return reward, None
