"""``trace_plugin.capture``: one line that records every run of an existing agent.

Three forms, all with the same options::

    @trace_plugin.capture(agent="support")      # on a function that builds the graph
    def build(): return workflow.compile()

    graph = trace_plugin.capture(agent="support")(graph)   # on a compiled graph

    with trace_plugin.capture(agent="support"):  # around any LangChain/LangGraph calls
        graph.invoke(...)

The graph needs no other change. The LangGraph integration is imported only when a
capture is applied, so ``import trace_plugin`` stays free of LangChain.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from trace_plugin.recorder import Recorder
from trace_plugin.records.trajectory import check_agent_name
from trace_plugin.tracer import RewardFn, Tracer


class Capture:
    """A configured capture: a decorator and a (sync or async) context manager."""

    def __init__(
        self,
        agent: str | None = None,
        *,
        reward: RewardFn | None = None,
        redact: bool | Callable[[str], str] | None = None,
        max_payload_bytes: int | None = None,
        source: str = "langgraph",
        metadata: dict[str, Any] | None = None,
        on_episode: Callable[[str], Any] | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.agent = agent if agent is None else check_agent_name(agent)
        self._tracer_options = dict(
            source=source,
            reward=reward,
            redact=redact,
            max_payload_bytes=max_payload_bytes,
            metadata=metadata,
            on_episode=on_episode,
            recorder=recorder,
        )
        self._tokens: list[Any] = []

    def handler(self, default_agent: str = "default") -> Any:
        """A LangChain callback handler recording into this capture's agent."""
        from integrations.langgraph import TraceCallbackHandler

        return TraceCallbackHandler(Tracer(self.agent or default_agent, **self._tracer_options))

    # -- decorator ----------------------------------------------------------------------

    def __call__(self, target: Any) -> Any:
        if inspect.iscoroutinefunction(target):

            @functools.wraps(target)
            async def abuild(*args: Any, **kwargs: Any) -> Any:
                return self._attach(await target(*args, **kwargs), target.__name__)

            return abuild
        if inspect.isfunction(target) or inspect.ismethod(target):

            @functools.wraps(target)
            def build(*args: Any, **kwargs: Any) -> Any:
                return self._attach(target(*args, **kwargs), target.__name__)

            return build
        return self._attach(target, getattr(target, "name", None) or type(target).__name__)

    def _attach(self, runnable: Any, default_agent: str) -> Any:
        from integrations.langgraph import attach

        if not hasattr(runnable, "with_config"):
            raise TypeError(
                f"trace_plugin.capture expects a LangGraph graph or LangChain runnable, "
                f"got {type(runnable).__name__}"
            )
        return attach(runnable, self.handler(default_agent))

    # -- context manager ----------------------------------------------------------------

    def __enter__(self) -> Capture:
        from integrations.langgraph import activate

        self._tokens.append(activate(self.handler()))
        return self

    def __exit__(self, *exc: Any) -> None:
        from integrations.langgraph import deactivate

        deactivate(self._tokens.pop())

    async def __aenter__(self) -> Capture:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


def capture(target: Any = None, /, **options: Any) -> Any:
    """Record every run of a LangGraph agent as an episode; see the module docstring.

    Options: ``agent`` (name; defaults to the function's or graph's), ``reward`` (a
    function of the final state giving a reward in [0, 1]), ``redact`` (``True`` for the
    built-in PII patterns, or a ``str -> str`` function applied after them),
    ``max_payload_bytes`` (1 MB by default), ``metadata``, ``on_episode`` (called with
    each finished episode's id) and ``recorder``.
    """
    configured = Capture(**options)
    return configured if target is None else configured(target)


def current_episode_id() -> str | None:
    """The id of the episode being recorded around the caller (a node, tool or model)."""
    langgraph = sys.modules.get("integrations.langgraph")
    return langgraph.current_episode_id() if langgraph else None
