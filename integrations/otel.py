"""OpenTelemetry export: stored episodes as spans in the GenAI semantic conventions.

    from integrations.otel import export_episodes
    export_episodes(Store(), agent="support")   # OTLP/HTTP, set by OTEL_EXPORTER_OTLP_*

Each episode becomes one trace: an ``invoke_agent`` root span, and a child span per
step (``chat`` for LLM calls, ``execute_tool`` for tool calls, plain spans for graph
nodes), nested by ``parent_run_id`` and stamped with the recorded start and end times.
Message content, tool arguments and tool results are left out unless asked for, as the
conventions advise: they often hold personal data.

``episode_spans`` is the pure translation; ``emit`` replays its output on any
tracer; ``export_episodes`` reads the store and sends the spans.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from trace_plugin import __version__
from trace_plugin.errors import TracePluginError
from trace_plugin.records.trajectory import Episode, Step
from trace_plugin.store import Store

# GenAI semantic-convention attributes (development status; names as of semconv 1.37+).
OPERATION = "gen_ai.operation.name"
AGENT_NAME = "gen_ai.agent.name"
CONVERSATION_ID = "gen_ai.conversation.id"
REQUEST_MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
ERROR_TYPE = "error.type"
# Opt-in content.
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
# What the conventions have no name for.
EPISODE_ID = "trace_plugin.episode.id"
EPISODE_STATUS = "trace_plugin.episode.status"
EPISODE_REWARD = "trace_plugin.episode.reward"
EPISODE_LABEL = "trace_plugin.episode.label"
EPISODE_SOURCE = "trace_plugin.episode.source"
EPISODE_ADAPTER = "trace_plugin.episode.adapter"
STEP_KIND = "trace_plugin.step.kind"
STEP_SEQ = "trace_plugin.step.seq"

# The conventions' finish-reason vocabulary, from OpenAI's.
_FINISH_REASONS = {"tool_calls": "tool_call", "function_call": "tool_call"}
# How an episode ended, as the finish reason of the agent's output message.
_EPISODE_FINISH = {"completed": "stop", "error": "error"}
_ERROR_TYPE = re.compile(r"([A-Za-z_][\w.]*):")  # "ValueError: ..." as the tracer formats errors
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_PAGE = 200
_BATCH_SPANS = 512  # spans per OTLP request


@dataclass(frozen=True, slots=True)
class SpanSpec:
    """One span to emit; ``parent`` indexes the list it is in (None for the episode's root)."""

    name: str
    kind: SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    parent: int | None = None
    error: str | None = None


def episode_spans(episode: Episode, *, include_content: bool = False) -> list[SpanSpec]:
    """The spans of one episode, root first and every parent before its children.

    A step whose ``parent_run_id`` names an earlier step nests under it; any other step
    under the root (its parent is the episode's own run, or a run not recorded as a step).
    """
    root = _root_span(episode, include_content)
    specs = [root]
    index_of_run: dict[str, int] = {}
    for step in sorted(episode.steps, key=lambda s: s.seq):
        parent = index_of_run.get(step.parent_run_id or "", 0)
        start, end = _step_times(step, root.start_ns)
        specs.append(
            SpanSpec(
                name=_step_name(step),
                kind=SpanKind.CLIENT if step.kind == "llm" else SpanKind.INTERNAL,
                start_ns=start,
                end_ns=end,
                attributes=_step_attributes(step, episode, include_content),
                parent=parent,
                error=step.error,
            )
        )
        if step.run_id:
            index_of_run.setdefault(step.run_id, len(specs) - 1)  # a later step cannot be a parent
    if episode.ended_at is None:  # not ended (or never told): it lasted as long as its steps
        specs[0] = replace(root, end_ns=max(s.end_ns for s in specs))
    return specs


def emit(specs: Sequence[SpanSpec], tracer: Tracer) -> None:
    """Replay ``specs`` as ended spans with their own timestamps, as one new trace."""
    spans: list[trace.Span] = []
    for spec in specs:
        # An empty context for the root: never a child of whatever span the caller is in.
        parent = Context() if spec.parent is None else trace.set_span_in_context(spans[spec.parent])
        span = tracer.start_span(
            spec.name, context=parent, kind=spec.kind, attributes=spec.attributes, start_time=spec.start_ns
        )
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        span.end(end_time=spec.end_ns)
        spans.append(span)


def export_episodes(
    store: Store,
    agent: str | None = None,
    *,
    since: datetime | None = None,
    limit: int | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    include_content: bool = False,
) -> int:
    """Export finished episodes, newest first; returns how many.

    ``since`` keeps episodes started at or after it (naive means UTC). Running episodes
    are skipped: a span cannot be amended once sent, so export them when they end.

    Without ``tracer_provider`` the spans go over OTLP/HTTP as the standard
    ``OTEL_EXPORTER_OTLP_*`` variables say (``OTEL_SERVICE_NAME`` defaults to
    ``trace-plugin``), and a refused batch raises RuntimeError. A provider you pass gets
    the spans through its own processors and is flushed, not shut down.
    """
    sink = _OtlpSink() if tracer_provider is None else None
    if sink is not None:
        provider, flush = sink.provider, sink.flush
    else:
        provider, flush = tracer_provider, getattr(tracer_provider, "force_flush", lambda: True)
    tracer = provider.get_tracer("trace-plugin", __version__)
    exported = pending = 0
    try:
        for episode in _finished_episodes(store, agent, since, limit):
            specs = episode_spans(episode, include_content=include_content)
            emit(specs, tracer)
            exported += 1
            pending += len(specs)
            if pending >= _BATCH_SPANS:
                flush()
                pending = 0
        flush()
    finally:
        if sink is not None:
            sink.close()
    return exported


class ExportError(TracePluginError, RuntimeError):
    """The OTLP exporter refused a batch of spans."""


class _OtlpSink:
    """A provider whose spans we send in batches ourselves.

    The SDK's batch processor drops spans once its queue is full, which a bulk export
    does at once, and only logs a refused request; here nothing is dropped and a refusal
    reaches the caller.
    """

    def __init__(self) -> None:
        self.buffer = InMemorySpanExporter()
        self.exporter = OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
        resource = Resource.create({SERVICE_NAME: "trace-plugin"}).merge(OTELResourceDetector().detect())
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(SimpleSpanProcessor(self.buffer))

    def flush(self) -> None:
        spans = self.buffer.get_finished_spans()
        self.buffer.clear()
        if spans and self.exporter.export(spans) is not SpanExportResult.SUCCESS:
            raise ExportError(
                f"OTLP export of {len(spans)} span(s) failed; the opentelemetry log above says why"
            )

    def close(self) -> None:
        self.provider.shutdown()
        self.exporter.shutdown()


def _finished_episodes(
    store: Store, agent: str | None, since: datetime | None, limit: int | None
) -> Iterator[Episode]:
    """Finished episodes with their steps, newest first, a page of summaries at a time."""
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    seen: set[str] = set()  # episodes inserted meanwhile shift the pages: skip repeats
    offset = yielded = 0
    while True:
        page = store.list_episodes(agent, limit=_PAGE, offset=offset)
        for summary in page:
            if (limit is not None and yielded >= limit) or (since is not None and summary.started_at < since):
                return
            if summary.status == "running" or summary.id in seen:
                continue
            seen.add(summary.id)
            episode = store.get_episode(summary.id)
            if episode is not None:
                yield episode
                yielded += 1
        if len(page) < _PAGE:
            return
        offset += _PAGE


# -- one episode ----------------------------------------------------------------------------


def _root_span(episode: Episode, include_content: bool) -> SpanSpec:
    attributes: dict[str, Any] = {
        OPERATION: "invoke_agent",
        AGENT_NAME: episode.agent,
        CONVERSATION_ID: episode.id,
        REQUEST_MODEL: episode.model,
        EPISODE_ID: episode.id,
        EPISODE_STATUS: episode.status,
        EPISODE_REWARD: episode.reward,
        EPISODE_LABEL: episode.label,
        EPISODE_SOURCE: episode.source,
        EPISODE_ADAPTER: episode.adapter,
    }
    error = (episode.error or "error") if episode.status == "error" else None
    if error is not None:
        attributes[ERROR_TYPE] = _error_type(error)
    if include_content and episode.input is not None:
        attributes[INPUT_MESSAGES] = _json(_agent_input(episode.input))
    if include_content and episode.output is not None:
        attributes[OUTPUT_MESSAGES] = _json(_agent_output(episode))
    start = _ns(episode.started_at)
    return SpanSpec(
        name=f"invoke_agent {episode.agent}",
        kind=SpanKind.INTERNAL,  # the recorded agents ran in their callers' processes
        start_ns=start,
        end_ns=_ns(episode.ended_at) if episode.ended_at else start,
        attributes=_present(attributes),
        error=error,
    )


def _step_name(step: Step) -> str:
    if step.kind == "llm":
        return f"{_llm_operation(step)} {step.name}"
    if step.kind == "tool":
        return f"execute_tool {step.name}"
    return step.name


def _llm_operation(step: Step) -> str:
    """``text_completion`` for LangChain's plain-text LLMs, which record ``{"prompts": [...]}``."""
    return "text_completion" if isinstance(step.input, dict) and "prompts" in step.input else "chat"


def _step_attributes(step: Step, episode: Episode, include_content: bool) -> dict[str, AttributeValue]:
    attributes: dict[str, Any] = {STEP_KIND: step.kind, STEP_SEQ: step.seq, CONVERSATION_ID: episode.id}
    if step.kind == "llm":
        choices = _choices(step.output)
        reasons = [reason for _, reason in choices]
        attributes |= {
            OPERATION: _llm_operation(step),
            REQUEST_MODEL: step.name,
            INPUT_TOKENS: step.prompt_tokens,
            OUTPUT_TOKENS: step.completion_tokens,
            FINISH_REASONS: reasons if choices and None not in reasons else None,
        }
        if include_content:
            attributes[INPUT_MESSAGES] = _json([_semconv_message(m) for m in _llm_input(step.input)])
            if choices:
                outputs = [_semconv_message(m) | {"finish_reason": r or "unknown"} for m, r in choices]
                attributes[OUTPUT_MESSAGES] = _json(outputs)
    elif step.kind == "tool":
        attributes |= {OPERATION: "execute_tool", TOOL_NAME: step.name, TOOL_CALL_ID: step.tool_call_id}
        if include_content:
            attributes[TOOL_ARGUMENTS] = _text(step.input)
            attributes[TOOL_RESULT] = _text(step.output)
    if step.error is not None:
        attributes[ERROR_TYPE] = _error_type(step.error)
    return _present(attributes)


def _step_times(step: Step, fallback_ns: int) -> tuple[int, int]:
    """Start and end in ns; a missing end is rebuilt from the latency, and the other way round."""
    latency = timedelta(milliseconds=step.latency_ms or 0)
    start = step.started_at or (step.ended_at - latency if step.ended_at else None)
    end = step.ended_at or (start + latency if start else None)
    start_ns = _ns(start) if start else fallback_ns
    return start_ns, _ns(end) if end else start_ns


# -- content in the conventions' message format ----------------------------------------------


def _messages(value: Any) -> list[dict[str, Any]] | None:
    """OpenAI-format messages in ``value``: a list, one message, or a ``{"messages": ...}`` state.

    LangChain's ``("user", "hi")`` shorthand counts as a message too.
    """
    if isinstance(value, dict):
        value = value.get("messages", [value] if "role" in value else None)
    if not isinstance(value, list):
        return None
    messages = []
    for item in value:
        if isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str):
            item = {"role": item[0], "content": item[1]}
        if not (isinstance(item, dict) and "role" in item):
            return None
        messages.append(item)
    return messages


def _llm_input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict) and isinstance(value.get("prompts"), list):
        return [{"role": "user", "content": str(p)} for p in value["prompts"]]
    return _messages(value) or []


def _choices(output: Any) -> list[tuple[dict[str, Any], str | None]]:
    """An LLM step's generations (a message, an API choice, or ``{"choices": [...]}`` of
    either, or plain text), each with its finish reason where the record shows it."""
    if isinstance(output, str):
        return [({"role": "assistant", "content": output}, None)]
    if not isinstance(output, dict):
        return []
    items = output["choices"] if isinstance(output.get("choices"), list) else [output]
    choices = []
    for item in items:
        message = item.get("message", item) if isinstance(item, dict) else None
        if not (isinstance(message, dict) and "role" in message):
            continue
        # A reply that calls tools ended to call them; a plain reply may have hit the length limit.
        reason = item.get("finish_reason") or ("tool_calls" if message.get("tool_calls") else None)
        choices.append((message, _FINISH_REASONS.get(reason, reason) if reason else None))
    return choices


def _semconv_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as the conventions' ``{"role", "parts"}`` message."""
    content = message.get("content")
    if message.get("role") == "tool":
        parts = [{"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}]
    elif isinstance(content, str):
        parts = [{"type": "text", "content": content}] if content else []
    elif isinstance(content, list):  # OpenAI content parts; non-text ones pass as generic parts
        parts = [
            {"type": "text", "content": p.get("text", "")} if p.get("type") == "text" else p
            for p in content
            if isinstance(p, dict)
        ]
    else:
        parts = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id"),
                "name": function.get("name"),
                "arguments": _parsed(function.get("arguments")),
            }
        )
    return {"role": message.get("role"), "parts": parts}


def _agent_input(value: Any) -> list[dict[str, Any]]:
    """What the agent was asked: its messages, or its input as one user message."""
    messages = _messages(value)
    if messages is None:
        return [{"role": "user", "parts": [{"type": "text", "content": _text(value)}]}]
    return [_semconv_message(m) for m in messages]


def _agent_output(episode: Episode) -> list[dict[str, Any]]:
    """The agent's answer: the last message of its output, or its output as text."""
    messages = _messages(episode.output)
    if messages:
        message = _semconv_message(messages[-1])
    else:
        message = {"role": "assistant", "parts": [{"type": "text", "content": _text(episode.output)}]}
    return [message | {"finish_reason": _EPISODE_FINISH.get(episode.status, episode.status)}]


# -- small conversions ------------------------------------------------------------------------


def _ns(value: datetime) -> int:
    """Nanoseconds since the epoch, exact to the stored microsecond (naive means UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // timedelta(microseconds=1) * 1000


def _error_type(error: str) -> str:
    """The exception's name when the error reads ``Name: message``; else the conventions' ``_OTHER``."""
    match = _ERROR_TYPE.match(error)
    return match.group(1) if match else "_OTHER"


def _json(value: Any) -> str:
    """Structured content as a JSON string: span attributes cannot hold nested values."""
    return json.dumps(value, ensure_ascii=False, default=str)


def _text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else _json(value)


def _parsed(arguments: Any) -> Any:
    """Tool-call arguments as an object: OpenAI sends them as a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _present(attributes: dict[str, Any]) -> dict[str, AttributeValue]:
    return {k: v for k, v in attributes.items() if v is not None}
