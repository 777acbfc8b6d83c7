"""``trace_plugin.capture``: one line that records every run of an existing agent.

Three forms, all with the same options::

    @trace_plugin.capture(agent="support")      # on a function that builds the graph
    def build(): return workflow.compile()

    graph = trace_plugin.capture(agent="support")(graph)   # on a compiled graph

    with trace_plugin.capture(agent="support"):  # around any LangChain/LangGraph calls
        graph.invoke(...)

The graph needs no other change. This module knows no framework: what a capture does to a
graph comes from a ``Framework`` that an integration registers when it is imported.
The LangGraph one (``integrations.langgraph``) is imported only when a capture is first
applied, so ``import trace_plugin`` stays free of LangChain.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from trace_plugin.recorder import Recorder
from trace_plugin.records.trajectory import check_agent_name
from trace_plugin.tracer import RewardFn, Tracer


class Framework(Protocol):
    """An agent framework's side of a capture, as its integration implements it."""

    def accepts(self, target: Any) -> bool:
        """Whether ``target`` is a graph or runnable of this framework."""
        ...

    def handler(self, tracer: Tracer) -> Any:
        """The framework's callback handler recording its runs through ``tracer``."""
        ...

    def attach(self, target: Any, handler: Any) -> Any:
        """``target`` with ``handler`` bound to every run of it."""
        ...

    def activate(self, handler: Any) -> Any:
        """Make ``handler`` see every run in this context; returns what ``deactivate`` takes."""
        ...

    def deactivate(self, token: Any) -> None: ...

    def current_episode_id(self) -> str | None:
        """The episode of the framework's run executing now, if it is one being recorded."""
        ...


# The framework ``capture`` applies to, imported when a capture is first applied; it
# registers itself. Others may register too: each is asked for the current episode.
DEFAULT_FRAMEWORK = "integrations.langgraph"
_frameworks: dict[str, Framework] = {}


def register_framework(name: str, framework: Framework) -> None:
    """Called by an integration on import (``name`` is its module's)."""
    _frameworks[name] = framework


def _default_framework() -> Framework:
    if DEFAULT_FRAMEWORK not in _frameworks:
        importlib.import_module(DEFAULT_FRAMEWORK)
    return _frameworks[DEFAULT_FRAMEWORK]


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
        return _default_framework().handler(Tracer(self.agent or default_agent, **self._tracer_options))

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
        framework = _default_framework()
        if not framework.accepts(runnable):
            raise TypeError(
                f"trace_plugin.capture expects a LangGraph graph or LangChain runnable, "
                f"got {type(runnable).__name__}"
            )
        return framework.attach(runnable, self.handler(default_agent))

    # -- context manager ----------------------------------------------------------------

    def __enter__(self) -> Capture:
        self._tokens.append(_default_framework().activate(self.handler()))
        return self

    def __exit__(self, *exc: Any) -> None:
        _default_framework().deactivate(self._tokens.pop())

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
    for framework in list(_frameworks.values()):
        episode_id = framework.current_episode_id()
        if episode_id is not None:
            return episode_id
    return None
