"""OpenTelemetry export: captured episodes as GenAI spans, checked against the stored episode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from agents import TOOLS, build, model_for, user
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import trace_plugin
from integrations import otel
from integrations.otel import episode_spans, export_episodes
from trace_plugin import Recorder, Store
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step, new_id

CONTENT_KEYS = {otel.INPUT_MESSAGES, otel.OUTPUT_MESSAGES, otel.TOOL_ARGUMENTS, otel.TOOL_RESULT}
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def ns(value: datetime) -> int:
    return round(value.timestamp() * 1e6) * 1000


def export_to_memory(store: Store, **kwargs: Any) -> tuple[int, list[ReadableSpan]]:
    """Export inside a span of the caller's: each episode must still start a trace of its own."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with TracerProvider().get_tracer("caller").start_as_current_span("caller's request"):
        count = export_episodes(store, tracer_provider=provider, **kwargs)
    return count, list(memory.get_finished_spans())


def run_agent(rec: Recorder, *calls: tuple[str, dict[str, Any]], kind: str = "create_react_agent") -> Episode:
    """One real LangGraph run through the capture path; tool errors become messages."""
    from langgraph.prebuilt import ToolNode

    tools = ToolNode(TOOLS, handle_tool_errors=True) if kind == "create_react_agent" else TOOLS
    graph = trace_plugin.capture(agent="support", recorder=rec)(build(kind, model_for(*calls), tools))
    graph.invoke(user("where is O-1?"))
    assert rec.flush(10)
    [summary] = rec.store.list_episodes("support")
    return rec.store.get_episode(summary.id)


def roots(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is None]


def parent_of(span: ReadableSpan, spans: list[ReadableSpan]) -> ReadableSpan:
    return next(s for s in spans if s.context.span_id == span.parent.span_id)


def test_captured_episode_exports_as_its_span_tree(recorder):
    episode = run_agent(
        recorder,
        ("get_order", {"order_id": "O-1"}),
        ("broken", {"order_id": "O-2"}),
        ("summarize", {"order_id": "O-3"}),
    )
    recorder.store.write([Feedback(episode.id, reward=0.5, label="partial")])
    episode = recorder.store.get_episode(episode.id)

    count, spans = export_to_memory(recorder.store)

    assert count == 1 and len(spans) == len(episode.steps) + 1
    assert len({s.context.trace_id for s in spans}) == 1
    [root] = roots(spans)
    assert root.name == "invoke_agent support" and root.kind is SpanKind.INTERNAL
    assert dict(root.attributes) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "support",
        "gen_ai.conversation.id": episode.id,
        "gen_ai.request.model": "scripted",
        "trace_plugin.episode.id": episode.id,
        "trace_plugin.episode.status": "completed",
        "trace_plugin.episode.reward": 0.5,
        "trace_plugin.episode.label": "partial",
        "trace_plugin.episode.source": "langgraph",
    }
    assert (root.start_time, root.end_time) == (ns(episode.started_at), ns(episode.ended_at))
    assert root.status.status_code is StatusCode.UNSET

    by_seq = {s.attributes["trace_plugin.step.seq"]: s for s in spans if s is not root}
    assert sorted(by_seq) == [s.seq for s in episode.steps]
    run_ids = {s.run_id: s.seq for s in episode.steps if s.run_id}
    for step in episode.steps:
        span, attrs = by_seq[step.seq], by_seq[step.seq].attributes
        assert (span.start_time, span.end_time) == (ns(step.started_at), ns(step.ended_at))
        assert attrs["trace_plugin.step.kind"] == step.kind
        parent_seq = run_ids.get(step.parent_run_id or "")
        expected_parent = by_seq[parent_seq] if parent_seq is not None and parent_seq < step.seq else root
        assert span.parent.span_id == expected_parent.context.span_id
        if step.kind == "llm":
            assert span.name == f"chat {step.name}" and span.kind is SpanKind.CLIENT
            assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == step.name
            assert attrs.get("gen_ai.usage.input_tokens") == step.prompt_tokens
            assert attrs.get("gen_ai.usage.output_tokens") == step.completion_tokens
        elif step.kind == "tool":
            assert span.name == f"execute_tool {step.name}" and span.kind is SpanKind.INTERNAL
            assert attrs["gen_ai.operation.name"] == "execute_tool" and attrs["gen_ai.tool.name"] == step.name
            assert attrs["gen_ai.tool.call.id"] == step.tool_call_id
            # Under the graph node that ran it where that node is stored: the one that ran "broken" is,
            # since its update holds the error message ToolNode made; the others repeat their tool's result.
            assert parent_of(span, spans).name == ("tools" if step.error else root.name)
        else:
            assert span.name == step.name and "gen_ai.operation.name" not in attrs
        if step.error:
            assert span.status.status_code is StatusCode.ERROR and span.status.description == step.error
            assert attrs["error.type"] == "RuntimeError"
        else:
            assert span.status.status_code is StatusCode.UNSET and "error.type" not in attrs
        assert not CONTENT_KEYS & set(attrs), "content is opt-in"

    errors = [s.name for s in spans if s.status.status_code is StatusCode.ERROR]
    assert errors == ["execute_tool broken"]
    [summarizer] = [s for s in spans if s.name == "chat summarizer"]
    assert parent_of(summarizer, spans).name == "execute_tool summarize"  # an LLM called inside a tool
    first_chat, last_chat = [s for s in spans if s.name == "chat scripted"]
    assert first_chat.attributes["gen_ai.response.finish_reasons"] == ("tool_call",)
    assert "gen_ai.response.finish_reasons" not in last_chat.attributes  # not recorded, so not claimed


def test_content_is_exported_in_the_conventions_message_format_when_asked(local_recorder):
    episode = run_agent(local_recorder, ("get_order", {"order_id": "O-1"}))

    _, spans = export_to_memory(local_recorder.store, include_content=True)

    [root] = roots(spans)
    assert json.loads(root.attributes[otel.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "where is O-1?"}]}
    ]
    final = episode.output["messages"][-1]["content"]
    assert json.loads(root.attributes[otel.OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": final}], "finish_reason": "stop"}
    ]
    first_chat, last_chat = [s for s in spans if s.name == "chat scripted"]
    call = {"type": "tool_call", "id": "call_1_0", "name": "get_order", "arguments": {"order_id": "O-1"}}
    assert json.loads(first_chat.attributes[otel.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "where is O-1?"}]}
    ]
    assert json.loads(first_chat.attributes[otel.OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [call], "finish_reason": "tool_call"}
    ]
    assert json.loads(last_chat.attributes[otel.INPUT_MESSAGES])[1:] == [
        {"role": "assistant", "parts": [call]},
        {
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": "call_1_0", "response": "order O-1 is pending"}],
        },
    ]
    [tool] = [s for s in spans if s.name == "execute_tool get_order"]
    assert json.loads(tool.attributes[otel.TOOL_ARGUMENTS]) == {"order_id": "O-1"}
    assert tool.attributes[otel.TOOL_RESULT] == "order O-1 is pending"


def test_a_failed_episode_is_an_error_span(local_recorder):
    with pytest.raises(RuntimeError, match="database exploded"):
        run_agent(local_recorder, ("broken", {"order_id": "O-1"}), kind="create_agent")
    assert local_recorder.flush(10)
    [summary] = local_recorder.store.list_episodes()

    _, spans = export_to_memory(local_recorder.store)

    [root] = roots(spans)
    assert root.status.status_code is StatusCode.ERROR
    assert "database exploded on O-1" in root.status.description
    assert root.attributes["error.type"] == "RuntimeError"
    assert root.attributes["trace_plugin.episode.status"] == "error"
    assert root.end_time == ns(local_recorder.store.get_episode(summary.id).ended_at)
    [tool] = [s for s in spans if s.name == "execute_tool broken"]
    assert tool.status.status_code is StatusCode.ERROR


def write_run(store: Store, agent: str, started: datetime, *, finished: bool = True) -> str:
    episode = Episode(id=new_id(), agent=agent, input={"q": "hi"}, started_at=started)
    step = Step(episode.id, 0, "tool", "get_order", input={"order_id": "1"}, output="ok", tool_call_id="c1")
    step.started_at, step.ended_at = started, started + timedelta(milliseconds=5)
    end = EpisodeEnd(episode.id, "completed", ended_at=started + timedelta(milliseconds=9))
    store.write([episode, step, *([end] if finished else [])])
    return episode.id


def test_export_selects_finished_episodes_by_agent_time_and_limit(sqlite_url, monkeypatch):
    monkeypatch.setattr(otel, "_PAGE", 2)  # several pages, each from its own query
    store = Store(sqlite_url)
    store.upgrade()
    a = [write_run(store, "a", T0 + timedelta(seconds=i)) for i in range(5)]
    b = write_run(store, "b", T0 + timedelta(seconds=2))
    write_run(store, "a", T0 + timedelta(seconds=9), finished=False)  # still running: skipped

    def exported(**kwargs: Any) -> list[str]:
        count, spans = export_to_memory(store, **kwargs)
        ids = [s.attributes["trace_plugin.episode.id"] for s in roots(spans)]
        assert count == len(ids)
        return ids

    assert exported(agent="a") == a[::-1]
    assert exported(agent="a", limit=3) == a[:1:-1]
    assert exported(agent="a", since=(T0 + timedelta(seconds=3)).replace(tzinfo=None)) == a[:2:-1]
    assert set(exported()) == {*a, b}
    assert exported(agent="nobody") == []


def test_episode_spans_rebuilds_missing_times_and_keeps_parents_before_children():
    t = T0
    steps = [
        Step(
            "e",
            0,
            "llm",
            "m",
            input={"prompts": ["hi"]},
            output="hello",
            ended_at=t + timedelta(seconds=2),
            latency_ms=500,
            run_id="r0",
            parent_run_id="r4",
        ),  # fmt: skip
        Step(
            "e",
            1,
            "tool",
            "lookup",
            started_at=t + timedelta(seconds=3),
            latency_ms=250,
            run_id="r1",
            error="lookup broke",
        ),  # fmt: skip
        Step(
            "e",
            2,
            "llm",
            "m",
            parent_run_id="r1",
            input={"messages": [{"role": "user", "content": "x"}]},
            output={
                "choices": [
                    {"message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
                    {"message": {"role": "assistant", "content": "b"}, "finish_reason": "length"},
                ]
            },
            started_at=t + timedelta(seconds=3.1),
            ended_at=t + timedelta(seconds=3.2),
        ),  # fmt: skip
        Step("e", 3, "node", "n", parent_run_id="unknown"),
        Step("e", 4, "tool", "later", run_id="r4", started_at=t + timedelta(seconds=4)),
    ]
    running = Episode(id="e", agent="x", status="running", started_at=t, steps=steps)

    specs = episode_spans(running)

    assert [s.parent for s in specs] == [None, 0, 0, 2, 0, 0]  # a later step is never a parent
    root, prompt, tool, chat, node, later = specs
    assert root.end_ns == ns(t + timedelta(seconds=4))  # not ended: the last step's end
    assert (
        prompt.name == "text_completion m" and prompt.attributes["gen_ai.operation.name"] == "text_completion"
    )
    assert (prompt.start_ns, prompt.end_ns) == (ns(t + timedelta(seconds=1.5)), ns(t + timedelta(seconds=2)))
    assert (tool.start_ns, tool.end_ns) == (ns(t + timedelta(seconds=3)), ns(t + timedelta(seconds=3.25)))
    assert tool.error == "lookup broke" and tool.attributes["error.type"] == "_OTHER"
    assert chat.attributes["gen_ai.response.finish_reasons"] == ["stop", "length"]
    assert "gen_ai.response.finish_reasons" not in prompt.attributes
    assert (node.start_ns, node.end_ns) == (root.start_ns, root.start_ns)  # no times at all
    assert later.start_ns == later.end_ns == ns(t + timedelta(seconds=4))


@dataclass
class Collector:
    """An OTLP/HTTP endpoint on localhost that keeps what it receives."""

    status: int = 200
    paths: list[str] = field(default_factory=list)
    requests: list[ExportTraceServiceRequest] = field(default_factory=list)

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


@pytest.fixture
def collector(monkeypatch) -> Iterator[Collector]:
    received = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.paths.append(self.path)
            received.requests.append(request)
            self.send_response(received.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield received
    server.shutdown()
    thread.join(5)


def test_otlp_export_follows_the_environment_and_drops_nothing(sqlite_url, collector):
    store = Store(sqlite_url)
    store.upgrade()
    for i in range(9):  # 2,709 spans: more than the SDK's batch processor queues
        episode = Episode(id=new_id(), agent="bulk", started_at=T0 + timedelta(seconds=i))
        steps = [Step(episode.id, n, "tool", f"t{n}", tool_call_id=f"c{n}") for n in range(300)]
        store.write([episode, *steps, EpisodeEnd(episode.id, "completed")])

    assert export_episodes(store) == 9

    spans = collector.spans()
    assert len(spans) == len({s.span_id for s in spans}) == 9 * 301
    assert len(collector.requests) > 1 and set(collector.paths) == {"/v1/traces"}
    [resource] = {
        a.value.string_value
        for r in collector.requests
        for rs in r.resource_spans
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert resource == "trace-plugin"
    assert {s.name for s in spans if not s.parent_span_id} == {"invoke_agent bulk"}


def test_otlp_service_name_comes_from_the_environment(sqlite_url, collector, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "support-agents")
    store = Store(sqlite_url)
    store.upgrade()
    write_run(store, "a", T0)

    assert export_episodes(store) == 1

    [request] = collector.requests
    attributes = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
    assert attributes["service.name"] == "support-agents"


def test_a_refused_otlp_batch_raises(sqlite_url, collector):
    collector.status = 400
    store = Store(sqlite_url)
    store.upgrade()
    write_run(store, "a", T0)

    with pytest.raises(RuntimeError, match="OTLP export of 2 span"):
        export_episodes(store)


def test_import_trace_plugin_does_not_import_opentelemetry():
    code = (
        "import sys, trace_plugin, trace_plugin.cli; print([m for m in sys.modules if 'opentelemetry' in m])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
