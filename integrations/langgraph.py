"""LangGraph / LangChain capture through the callback system (no monkey-patching).

A ``TraceCallbackHandler`` turns LangChain run events into tracer calls: each root
run becomes an episode, LLM and tool runs become steps paired by ``run_id``, and graph
nodes become ``node`` steps, except a node whose update is nothing but what its own model
and tool steps returned (``create_agent``'s model and tools nodes): those steps are its
record. The handler reaches a graph either bound to it with ``with_config`` (the
decorator) or through a configure hook while a ``with capture(...)`` block is active.
"""

from __future__ import annotations

import dataclasses
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import orjson
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tracers.context import register_configure_hook
from langgraph.types import Command

from trace_plugin.capture import register_framework
from trace_plugin.conversations import served_by
from trace_plugin.payload import Shaped
from trace_plugin.records.trajectory import Step, StepKind, utcnow
from trace_plugin.tracer import ActiveEpisode, Tracer

# Config metadata key with which a caller chooses the episode id of a run.
EPISODE_ID_KEY = "trace_episode_id"

_active_handler: ContextVar[TraceCallbackHandler | None] = ContextVar(
    "trace_plugin_langgraph_handler", default=None
)
register_configure_hook(_active_handler, inheritable=True)

_INTERRUPTS = {"GraphInterrupt", "GraphBubbleUp", "GeneratorExit", "CancelledError"}


@dataclass(slots=True)
class _Run:
    """What the handler remembers about a LangChain run until it ends."""

    episode: ActiveEpisode
    is_root: bool
    id: str  # the run id as stored, converted once: children store it as their parent's
    parent_run_id: str | None
    kind: StepKind | None = None  # None: a run we only track to find its children's episode
    name: str = ""
    seq: int = 0
    input: Any = None
    tools: Any = None
    tool_call_id: str | None = None
    started_at: Any = None
    t0: float = 0.0
    node: _Run | None = None  # the graph node this run executes in
    returned: dict[int, Any] | None = None  # a node's: what its model and tool steps returned, by id


class TraceCallbackHandler(BaseCallbackHandler):
    """Records every root run it sees as one episode of ``tracer``'s agent."""

    run_inline = True  # cheap and thread-safe: no executor hop in async runs
    raise_error = False
    ignore_retriever = True
    ignore_custom_event = True

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        # Keyed by the run id's integer: a UUID hashes in Python, and each run is looked up
        # a few times per callback.
        self._runs: dict[int, _Run] = {}

    def episode_id_of(self, run_id: UUID | None) -> str | None:
        run = self._runs.get(run_id.int) if run_id is not None else None
        return run.episode.id if run else None

    # -- run bookkeeping -----------------------------------------------------------------

    def _begin(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        inputs: Any,
        metadata: dict[str, Any] | None,
        model: str | None = None,
    ) -> _Run:
        parent = self._runs.get(parent_run_id.int) if parent_run_id else None
        if parent is not None:
            node = parent if parent.kind == "node" else parent.node
            run = _Run(parent.episode, False, str(run_id), parent.id, node=node)
        else:  # a root run, or one whose parent ran outside this capture
            meta = {k: v for k, v in (metadata or {}).items() if not k.startswith(("ls_", "langgraph_"))}
            episode = self.tracer.start_episode(
                openai_json(inputs),
                episode_id=meta.pop(EPISODE_ID_KEY, None),
                metadata=meta,
                model=model,
            )
            run = _Run(episode, True, str(run_id), str(parent_run_id) if parent_run_id else None)
        self._runs[run_id.int] = run
        return run

    def _open_step(self, run: _Run, kind: StepKind, name: str, input: Any) -> None:
        run.kind, run.name, run.input = kind, name, input
        run.seq = run.episode.next_seq()
        run.started_at, run.t0 = utcnow(), time.perf_counter()

    def _close(
        self,
        run_id: UUID,
        output: Any = None,
        error: BaseException | str | None = None,
        final_state: Any = None,
        **extra: Any,
    ) -> None:
        run = self._runs.pop(run_id.int, None)
        if run is None:
            return
        if run.kind is not None:
            if isinstance(error, BaseException):
                error = f"{type(error).__name__}: {error}"
            self.tracer.record_step(
                Step(
                    episode_id=run.episode.id,
                    seq=run.seq,
                    kind=run.kind,
                    name=run.name,
                    input=run.input,
                    output=output,
                    error=error,
                    tool_call_id=run.tool_call_id,
                    latency_ms=(time.perf_counter() - run.t0) * 1000,
                    started_at=run.started_at,
                    ended_at=utcnow(),
                    run_id=run.id,
                    parent_run_id=run.parent_run_id,
                    tools=run.tools,
                    **extra,
                )
            )
        if run.is_root:
            if isinstance(error, BaseException) and type(error).__name__ in _INTERRUPTS:
                self.tracer.end_episode(run.episode, error=error, status="interrupted")
            elif error is not None:
                self.tracer.end_episode(run.episode, error=error)
            else:
                self.tracer.end_episode(run.episode, output=output, final_state=final_state)
            _converted.clear()  # its messages are stored: kept, they would age into the oldest generation

    # -- chains and graph nodes ------------------------------------------------------------

    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        run = self._begin(run_id, parent_run_id, inputs, metadata)
        name = kwargs.get("name")
        if not run.is_root and metadata and name and metadata.get("langgraph_node") == name:
            # The input is the whole graph state, already in earlier steps: only updates are kept.
            self._open_step(run, "node", name, None)
            run.returned = {}

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.get(run_id.int)
        if run is not None and run.returned and _repeats(outputs, run.returned):
            del self._runs[run_id.int]  # its model and tool steps hold all it says: a step costs time only
            return
        self._close(run_id, output=openai_json(outputs), final_state=outputs)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._close(run_id, error=error)

    # -- model calls -------------------------------------------------------------------

    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        params = kwargs.get("invocation_params") or {}
        model = params.get("model") or params.get("model_name") or (metadata or {}).get("ls_model_name")
        run = self._begin(run_id, parent_run_id, messages, metadata, model=model)
        if model and run.episode.model is None:
            run.episode.model = model
        tools = params.get("tools")
        self._open_step(run, "llm", model or kwargs.get("name") or "chat_model", None)
        names = [_tool_name(t) for t in tools] if tools else []
        run.input = openai_json({"messages": messages[0] if messages else [], "tools": names})
        run.tools = tools or None

    def on_llm_start(
        self,
        serialized: dict[str, Any] | None,
        prompts: list[str],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        run = self._begin(run_id, parent_run_id, prompts, metadata)
        self._open_step(run, "llm", kwargs.get("name") or "llm", {"prompts": prompts})

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        generation = response.generations[0][0] if response.generations and response.generations[0] else None
        usage: dict[str, Any] = {}
        if isinstance(generation, ChatGeneration):
            final: Any = generation.message
            self._returned(run_id, final)
            output: Any = openai_json(final)
            usage = getattr(final, "usage_metadata", None) or {}
            self._note_serving(run_id, (final.response_metadata or {}).get("system_fingerprint"))
        else:
            final = output = generation.text if generation is not None else None
        token_usage = (response.llm_output or {}).get("token_usage") or {}
        self._close(
            run_id,
            output=output,
            final_state=final,
            prompt_tokens=usage.get("input_tokens") or token_usage.get("prompt_tokens"),
            completion_tokens=usage.get("output_tokens") or token_usage.get("completion_tokens"),
        )

    def _returned(self, run_id: UUID, value: Any) -> None:
        """Note, for the node this run executes in, a value its step returned."""
        run = self._runs.get(run_id.int)
        if run is not None and run.node is not None:
            run.node.returned[id(value)] = value  # held, so no other object can take its id meanwhile

    def _note_serving(self, run_id: UUID, system_fingerprint: str | None) -> None:
        """Behind our gateway, the answer names the adapter and router version that served it."""
        served = served_by(system_fingerprint)
        run = self._runs.get(run_id.int)
        if served is not None and run is not None:
            run.episode.router, run.episode.adapter = served

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._close(run_id, error=error)

    # -- tools ---------------------------------------------------------------------------

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        run = self._begin(run_id, parent_run_id, inputs if inputs is not None else input_str, metadata)
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        self._open_step(run, "tool", name, inputs if inputs is not None else input_str)
        run.tool_call_id = kwargs.get("tool_call_id")

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._returned(run_id, output)
        error = None
        if isinstance(output, ToolMessage):
            run = self._runs.get(run_id.int)
            if run is not None and run.tool_call_id is None:
                run.tool_call_id = output.tool_call_id
            if output.status == "error":  # a ToolException handled by the tool itself
                error = output.text if hasattr(output, "text") else str(output.content)
            output = output.content
        self._close(run_id, output=output, error=error, final_state=output)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._close(run_id, error=error)


def _repeats(update: Any, returned: dict[int, Any]) -> bool:
    """Whether a node's update holds nothing but messages its own model and tool steps returned:
    ``{"messages": [...]}``, or a list of such updates or of ``Command``s that only update."""
    updates = update if type(update) is list else [update]
    for one in updates:
        if type(one) is Command:
            if one.goto != () or one.graph is not None or one.resume is not None:
                return False
            one = one.update
        messages = one.get("messages") if type(one) is dict and len(one) == 1 else None
        if type(messages) is not list or not messages:
            return False
        if not all(returned.get(id(m)) is m for m in messages):
            return False
    return bool(updates)


_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "function"}


def message_to_openai(message: BaseMessage) -> dict[str, Any]:
    """One message in OpenAI chat format: the shape every capture source stores.

    Leaner than ``convert_to_openai_messages`` (this runs for every recorded message);
    content is kept as LangChain holds it, a string or a list of blocks. A run's messages
    recur in many records (every LLM call's history, node updates, the final state), so
    conversions are kept by identity and reused, read-only, until a root run ends.
    """
    hit = _converted.get(id(message))
    if hit is not None and hit[0] is message:  # the entry holds the message: its id is not reused
        return hit[1]
    out: dict[str, Any] = {"role": _ROLES.get(message.type) or getattr(message, "role", message.type)}
    out["content"] = message.content
    if message.name:
        out["name"] = message.name
    tool_calls = message.tool_calls if isinstance(message, AIMessage) else None
    if tool_calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["name"], "arguments": _arguments(call.get("args", {}))},
            }
            for call in tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    if len(_converted) >= 512:
        _converted.clear()
    _converted[id(message)] = (message, out)
    return out


_converted: dict[int, tuple[BaseMessage, dict[str, Any]]] = {}


def _arguments(args: Any) -> str:
    """A tool call's arguments as OpenAI's JSON string (orjson: compact, and a tenth of ``json``'s time)."""
    return orjson.dumps(args, option=orjson.OPT_NON_STR_KEYS).decode()


def openai_json(value: Any) -> Shaped:
    """``value`` to be stored with LangChain messages anywhere inside in OpenAI chat format
    (serialized when its record is submitted, or on the recorder's thread if redacted)."""
    return Shaped(value, _openai_default)


def _openai_default(value: Any) -> Any:
    if isinstance(value, BaseMessage):
        return message_to_openai(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. a Command update
        names = _field_names.get(type(value))
        if names is None:
            names = _field_names[type(value)] = tuple(f.name for f in dataclasses.fields(value))
        fields = {name: getattr(value, name) for name in names}
        return {"__type__": type(value).__name__, **{k: v for k, v in fields.items() if v is not None}}
    raise TypeError(type(value).__qualname__)


_field_names: dict[type, tuple[str, ...]] = {}


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        inner = tool.get("function", tool)
        return str(inner.get("name", "?")) if isinstance(inner, dict) else "?"
    return getattr(tool, "name", type(tool).__name__)


# -- how a handler reaches a graph ------------------------------------------------------


def attach(runnable: Runnable, handler: TraceCallbackHandler) -> Runnable:
    """The runnable with ``handler`` bound; a compiled graph stays a compiled graph."""
    return runnable.with_config(callbacks=[handler])


def activate(handler: TraceCallbackHandler) -> Any:
    """Make ``handler`` see every LangChain run in this context; returns the reset token."""
    return _active_handler.set(handler)


def deactivate(token: Any) -> None:
    _active_handler.reset(token)


def current_episode_id() -> str | None:
    """The episode of the LangChain run executing now (inside a node, tool or model)."""
    config = var_child_runnable_config.get()
    manager = (config or {}).get("callbacks")
    parent = getattr(manager, "parent_run_id", None)
    for handler in getattr(manager, "handlers", None) or ():
        if isinstance(handler, TraceCallbackHandler):
            episode_id = handler.episode_id_of(parent)
            if episode_id is not None:
                return episode_id
    return None


class LangGraphFramework:
    """What ``trace_plugin.capture`` does with LangGraph graphs and LangChain runnables."""

    def accepts(self, target: Any) -> bool:
        return hasattr(target, "with_config")

    def handler(self, tracer: Tracer) -> TraceCallbackHandler:
        return TraceCallbackHandler(tracer)

    def attach(self, target: Runnable, handler: TraceCallbackHandler) -> Runnable:
        return attach(target, handler)

    def activate(self, handler: TraceCallbackHandler) -> Any:
        return activate(handler)

    def deactivate(self, token: Any) -> None:
        deactivate(token)

    def current_episode_id(self) -> str | None:
        return current_episode_id()


register_framework(__name__, LangGraphFramework())
