"""Hostile requests get a 4xx in OpenAI's error shape, and the gateway keeps serving.

A scripted backend stands in for the model, since what a request may do to the gateway is
the point, not generation; prompts are still rendered with the real tokenizer's template.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.backends import ScriptedBackend

from trace_plugin import Recorder
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.gateway.stops import StopMatcher
from trace_plugin.model_files import prepare_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))


@pytest.fixture(scope="module")
def backend(tokenizer) -> ScriptedBackend:
    return ScriptedBackend(tokenizer)


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Recorder:
    recorder = Recorder(f"sqlite:///{tmp_path_factory.mktemp('db') / 'hostile.db'}")
    yield recorder
    recorder.close()


@pytest.fixture(scope="module")
def app(backend, recorder, tmp_path_factory):
    config = GatewayConfig(
        adapter_root=tmp_path_factory.mktemp("adapters"),
        agent="hostile",
        allow_remote_admin=True,  # the test client is not a loopback address
    )
    return create_app(backend, config=config, recorder=recorder)


@pytest.fixture(scope="module")
def client(app) -> TestClient:
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def assert_openai_error(response, status: int | None = None) -> None:
    expected = response.status_code == status if status else 400 <= response.status_code < 500
    assert expected, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}


def asking(parts: list[Any]) -> dict[str, Any]:
    """A chat request whose user message is made of content ``parts``."""
    return chat(messages=[{"role": "user", "content": parts}])


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "prompt": "Once upon a time", "max_tokens": 1, **extra}


# -- the body limit holds on the bytes read ---------------------------------------------


def post_chunked(port: int, path: str, body: bytes, chunk: int = 16 * 1024) -> tuple[int, dict]:
    """POST ``body`` with chunked transfer (no Content-Length), stopping early if the server
    answers first; returns the status and the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        for start in range(0, len(body), chunk):
            if select.select([sock], [], [], 0)[0]:  # answered before the body ended
                break
            part = body[start : start + chunk]
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        else:
            sock.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


SMALL_LIMIT = 64 * 1024  # the same code path as the default 8 MB, faster to cross


def test_a_chunked_body_over_the_limit_is_refused_and_never_reaches_the_backend(backend, tmp_path):
    config = GatewayConfig(adapter_root=tmp_path, max_body_bytes=SMALL_LIMIT, record=False)
    huge = json.dumps(completion(prompt="x" * (16 * SMALL_LIMIT))).encode()
    fits = json.dumps(completion(prompt="y" * (SMALL_LIMIT // 2))).encode()
    with start_in_thread(create_app(backend, config=config)) as server:
        before = len(backend.prompts)
        status, answer = post_chunked(server.port, "/v1/completions", huge)
        assert status == 413 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert len(backend.prompts) == before and not any(p.startswith("xxx") for p in backend.prompts)
        status, answer = post_chunked(server.port, "/v1/completions", fits)  # still serving, chunked too
        assert status == 200 and answer["choices"][0]["text"] == backend.reply, answer


def test_stopping_the_server_lets_its_backend_close_to_the_end(tokenizer, tmp_path):
    """The lifespan closes the backend outside its cancelled task group: a close that awaits
    (the embedded engine's join) finishes, so no engine thread outlives the server (one left
    running at exit aborted the process: "terminate called without an active exception")."""
    import asyncio

    closed: list[bool] = []

    class SlowToClose(ScriptedBackend):
        async def close(self) -> None:
            await asyncio.sleep(0.05)
            closed.append(True)

    with start_in_thread(create_app(SlowToClose(tokenizer), config=GatewayConfig(adapter_root=tmp_path))):
        pass
    assert closed == [True]


# -- errors in OpenAI's shape, the framework's own too -----------------------------------


DEEP = 50_000


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b'{"model": "scripted", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400),
        (b"{not json", 400),
        (b"", 400),
        (b"[1, 2]", 400),
    ],
)
def test_unparsable_bodies_answer_in_openai_shape(client, content, status):
    r = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, status)


def test_framework_errors_answer_in_openai_shape(client):
    assert_openai_error(client.get("/v1/no-such-endpoint"), 404)
    r = client.get("/v1/chat/completions")
    assert_openai_error(r, 405)
    assert "POST" in r.headers["allow"]


# -- bad input is a 4xx before anything is generated -------------------------------------


HOSTILE = [
    ("/v1/chat/completions", chat(metadata={"trace_episode_id": {"a": 1}}), "trace_episode_id"),
    ("/v1/chat/completions", chat(metadata={"trace_episode_id": ["a"]}), "trace_episode_id"),
    ("/v1/chat/completions", chat(metadata={"trace_agent": ["a"]}), "trace_agent"),
    ("/v1/completions", completion(metadata={"trace_episode_id": {"a": 1}}), "trace_episode_id"),
    ("/v1/chat/completions", chat(metadata={"trace_episode_id": "e" * 1001}), "trace_episode_id"),
    ("/v1/chat/completions", chat(seed=2**70), "seed"),
    ("/v1/completions", completion(seed=-(2**64)), "seed"),
    ("/v1/chat/completions", chat(stop=["s"] * 2000), "stop"),
    ("/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("/v1/chat/completions", chat(stop=""), "stop"),
    ("/v1/completions", completion(stop=["z" * 201]), "stop"),
    ("/v1/completions", completion(prompt=["p"] * 2000), "prompt"),
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/load_lora_adapter", {"lora_name": "a@1", "lora_path": "a\x00b"}, "NUL"),
    ("/v1/load_lora_adapter", {"lora_name": "a@1", "lora_path": "a" * 5000}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "a@1", "lora_path": "a" * 300}, "too long"),  # one name too long
]


@pytest.mark.parametrize(("path", "body", "needle"), HOSTILE)
def test_bad_input_gets_a_4xx_before_generation(client, backend, path, body, needle):
    before = len(backend.prompts)
    r = client.post(path, json=body)
    assert_openai_error(r)
    assert needle in r.json()["error"]["message"]
    assert len(backend.prompts) == before, "nothing may be generated for a request that is refused"
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200  # and it keeps serving


@pytest.mark.parametrize(
    ("headers", "needle"),
    [({"X-Trace-Episode": "e" * 1001}, "X-Trace-Episode"), ({"X-Trace-Agent": "a" * 201}, "X-Trace-Agent")],
)
def test_trace_headers_are_bounded_like_the_store(client, backend, headers, needle):
    before = len(backend.prompts)
    r = client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert_openai_error(r, 400)
    assert needle in r.json()["error"]["message"] and len(backend.prompts) == before


# -- a stop list costs the same however long it is ---------------------------------------


def lines_run(work: Callable[[], Any]) -> int:
    """How many Python lines ``work`` executes: its cost, counted rather than timed."""
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


TEXT = "The order W17 shipped on Monday; the refund for W18 is pending. " * 20


def decoy_stops(n: int) -> list[str]:
    """``n`` stop strings that start like words of ``TEXT`` but never complete in it."""
    words = sorted(set(TEXT.replace(";", " ").replace(".", " ").split()))
    return [f"{words[i % len(words)]}#{i}" for i in range(n)]


def test_stop_matching_work_does_not_grow_with_the_list():
    one, many = StopMatcher(decoy_stops(1)), StopMatcher(decoy_stops(2000))
    assert one.cut(TEXT) is None and many.cut(TEXT) is None
    cost_one, cost_many = lines_run(lambda: one.feed(TEXT)), lines_run(lambda: many.feed(TEXT))
    assert cost_many < 2 * cost_one, (cost_one, cost_many)  # 2000 times the strings, not the work
    assert StopMatcher([*decoy_stops(2000), "W18"]).cut(TEXT) == TEXT[: TEXT.index("W18")]


def test_stop_matcher_finds_what_a_scan_of_every_string_finds():
    for stops, text in [
        (["he", "she", "his", "hers"], "ushers"),
        (["b", "abc"], "xabc"),
        (["abcd", "bc"], "abcd"),
        (["lo", "hello w"], "hello world"),
        (["\n\n", "Observation:"], "Thought: look it up\nObservation: 3"),
        (["zz"], "no stop here"),
    ]:
        # The first stop string to complete; the longest of those that complete there.
        ends = [(i + len(s), -len(s)) for s in stops for i in range(len(text)) if text.startswith(s, i)]
        expected = text[: sum(min(ends))] if ends else None
        assert StopMatcher(stops).cut(text) == expected, (stops, text)
        state, end = StopMatcher(stops).feed(text[:3])  # fed in pieces, it finds the same place
        if end is None:
            assert (StopMatcher(stops).feed(text[3:], state)[1] is None) == (expected is None)


def test_the_embedded_stop_criterion_stops_rows_at_the_token_completing_a_stop(tokenizer):
    from trace_plugin.gateway.embedded import RowWatch

    text = "Thought: I should look up é and 日本. Observation: found it. Done."
    ids = tokenizer(text, add_special_tokens=False).input_ids

    def run(stops: StopMatcher) -> list[int | None]:
        watches = [RowWatch(tokenizer, stops), RowWatch(tokenizer, stops)]
        stopped: list[int | None] = [None, None]
        for i in range(len(ids)):
            for row, token in enumerate([ids[i], ids[0]]):  # row 1 never stops
                if watches[row].push(token) and stopped[row] is None:
                    stopped[row] = i
        return stopped

    at, never = run(StopMatcher(["Observation:"]))
    assert at is not None and never is None and "Observation:" in tokenizer.decode(ids[: at + 1])
    assert "Observation:" not in tokenizer.decode(ids[:at])
    assert run(StopMatcher(["日本"]))[0] is not None  # a stop made of multi-byte characters
    one, many = StopMatcher(decoy_stops(1)), StopMatcher(decoy_stops(2000))
    cost_one, cost_many = lines_run(lambda: run(one)), lines_run(lambda: run(many))
    assert cost_many < 1.5 * cost_one, (cost_one, cost_many)


def test_a_text_part_that_is_not_text_is_a_400_whatever_router_is_live(client):
    """Found by the property test: with a keyword router live, a dict as a text part's
    text reached the router's text join and was a 500."""
    live = client.get("/v1/router").json()
    assert client.post("/v1/router", json={"kind": "keyword", "rules": []}).status_code == 200
    try:
        for text in ({"a": 1.0}, ["x"], 5):
            parts = [{"type": "text", "text": text}]
            response = client.post(
                "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": parts}])
            )
            assert_openai_error(response, 400)
        image = [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "Hi"}]
        response = client.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": image}])
        )
        assert response.status_code == 200, response.text
    finally:
        client.post("/v1/router", json=live)


# -- completions are recorded ------------------------------------------------------------


def test_completions_are_recorded_as_llm_steps(client, backend, recorder):
    r = client.post(
        "/v1/completions",
        json=completion(prompt="Say hi.", metadata={"trace_agent": "completer"}),
    )
    assert r.status_code == 200, r.text
    named = client.post(
        "/v1/completions",
        json=completion(prompt=["First.", "Second."]),
        headers={"X-Trace-Agent": "completer", "X-Trace-Episode": "cmpl-episode"},
    )
    assert named.headers["x-trace-episode"] == "cmpl-episode"
    assert recorder.flush(10)
    episode = recorder.store.get_episode(r.headers["x-trace-episode"])
    assert episode.agent == "completer" and episode.source == "gateway"
    [step] = episode.steps
    assert step.kind == "llm" and step.input == {"prompt": "Say hi."}
    assert step.output["content"] == backend.reply and step.completion_tokens == 3
    steps = recorder.store.get_episode("cmpl-episode").steps
    assert [s.input["prompt"] for s in steps] == ["First.", "Second."]


def test_an_episode_id_longer_than_the_store_keeps_is_served_and_found_again(client, recorder):
    long_id = "ticket-" + "9" * 200
    r = client.post("/v1/chat/completions", json=chat(), headers={"X-Trace-Episode": long_id})
    assert r.status_code == 200, r.text
    assert recorder.flush(10)
    episode = recorder.store.get_episode(long_id)
    assert episode is not None and len(episode.steps) == 1 and len(episode.id) == 64


# -- whatever the body, never a 5xx ------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"\x00" * 5,  # json.loads takes it for UTF-32, and cannot decode it
        b"[" * DEEP + b"]" * DEEP,
        json.dumps({"kind": "static", "adapter": [1]}).encode(),  # unhashable: every routed call would fail
        json.dumps({"kind": "keyword", "rules": [[["refund"], "a"]], "default": 5}).encode(),
    ],
)
def test_a_router_spec_of_the_wrong_shape_is_a_400_and_changes_nothing(client, content):
    live = client.get("/v1/router").json()
    assert_openai_error(client.post("/v1/router", content=content), 400)
    assert client.get("/v1/router").json() == live
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
extreme_numbers = st.sampled_from(
    [0, -1, 2**31, 2**63, 2**63 - 1, -(2**63) - 1, 2**70, 10**400, 1e308, -1e308, 1e-320, 0.5]
)
big_strings = st.integers(0, 200_000).map(lambda n: "é" * (n // 2) + "x" * (n - n // 2))


DEEP_MARK = "\x00deep\x00"  # stands for a value nested too deep for json.dumps to write
DEPTHS = (10, 100, 900, 1000, 3000, DEEP)
odd = json_values | extreme_numbers | big_strings | st.sampled_from([f"{DEEP_MARK}{d}" for d in DEPTHS])
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": st.text(max_size=40)}
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                "parameters": st.just({"type": "object"}),
            }
        ),
    }
)
model = st.sampled_from(["scripted", "base", "hostile", "nope", "router:x", ""])
sampling = {
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=10), max_size=4),
    "stream": st.booleans(),
    "metadata": st.fixed_dictionaries({}, optional={"trace_agent": st.text(min_size=1, max_size=20)}),
    "bad_words": st.lists(st.text(min_size=1, max_size=10), max_size=3),
    "return_token_ids": st.booleans(),
}
valid = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": model, "messages": st.lists(message, min_size=1, max_size=3)},
        optional={**sampling, "tools": st.lists(tool, max_size=2), "tool_choice": st.just("none")},
    ),
    "/v1/completions": st.fixed_dictionaries(
        {"model": model, "prompt": st.text(min_size=1, max_size=40)},
        optional={**sampling, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
    ),
    "/v1/embeddings": st.fixed_dictionaries(
        {"model": st.sampled_from(["scripted", "base", "nope"]), "input": st.text(max_size=40)}
    ),
    "/v1/load_lora_adapter": st.fixed_dictionaries(
        {"lora_name": st.text(max_size=20), "lora_path": st.text(max_size=40)}
    ),
    "/v1/unload_lora_adapter": st.fixed_dictionaries({"lora_name": st.text(max_size=20)}),
    "/v1/router": st.fixed_dictionaries(
        {"kind": st.sampled_from(["static", "keyword", "classifier", "gate", "x"])},
        optional={
            "adapter": json_values,
            "default": json_values,
            "rules": st.lists(st.tuples(st.lists(st.text(max_size=5), max_size=2), json_values), max_size=2),
            "experts": st.lists(json_values, max_size=2),
            "choices": json_values,
            "threshold": json_values,
        },
    ),
}


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """An endpoint and a body for it: valid, or with fields dropped, replaced by values of the
    wrong type, extreme numbers, deep nesting or large strings, or not JSON at all."""
    path = draw(st.sampled_from(sorted(valid)))
    body = draw(valid[path])
    how = draw(st.sampled_from(["valid", "mutated", "mutated", "nested", "raw"]))
    if how == "mutated":
        for key in draw(
            st.lists(st.sampled_from(sorted({*body, *sampling, "model", "messages", "prompt"})), max_size=3)
        ):
            if draw(st.booleans()):
                body.pop(key, None)
            else:
                body[key] = draw(odd)
    elif how == "nested" and isinstance(body.get("messages"), list):
        body["messages"][0]["content"] = draw(
            st.sampled_from([[{"type": "text", "text": draw(odd)}], draw(odd)])
        )
    data = json.dumps(body)
    for depth in DEPTHS:
        data = data.replace(json.dumps(f"{DEEP_MARK}{depth}"), '{"k": [' * depth + "1" + "]}" * depth)
    data = data.encode()
    if how == "raw":
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=8))
    return path, data


@settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(request=request_bodies())
def test_no_body_gets_a_5xx_and_every_4xx_is_in_openai_shape(client, request):
    path, data = request
    r = client.post(path, content=data, headers={"content-type": "application/json"})
    event(f"{path} {r.status_code}")  # --hypothesis-show-statistics: what the examples reached
    assert r.status_code < 500, (path, data[:300], r.text[:300])
    if r.status_code >= 400:
        assert_openai_error(r)


# -- lone surrogates, stored as U+FFFD on both stores ------------------------------------


def test_lone_surrogates_from_a_client_are_stored_as_replacement_characters_on_both_stores(
    backend, db_url, tmp_path
):
    """``\\ud800`` escapes arrive in ASCII JSON, which the payload check skips: SQLite kept
    them, so exports died (``surrogates not allowed``) and the dashboard answered 500, and
    PostgreSQL's jsonb refused the step and the whole batch. An escaped escape in a call's
    arguments becomes a lone surrogate only when the arguments are parsed. Both stores now
    hold U+FFFD, the same, exports finish and the pages answer 200; emoji stay."""
    from fastapi.testclient import TestClient

    from trace_plugin.dashboard.app import create_dashboard
    from trace_plugin.export import dataset, write_jsonl

    recorder = Recorder(db_url, retry_interval=0.05)
    config = GatewayConfig(adapter_root=tmp_path / "adapters", agent="hostile", allow_remote_admin=True)
    tool = {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Find \ud800 an order \U0001f600",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_order", "arguments": '{"order_id": "\\ud800 #W1"}'},
    }
    body = chat(
        messages=[
            {"role": "user", "content": "Where is my order? \udc00 \U0001f600"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "pending \ud800"},
        ],
        tools=[tool],
    )
    raw = json.dumps(body).encode()  # ASCII: the lone surrogates travel as escapes
    assert b"\\ud800" in raw and b"\\ud83d\\ude00" in raw
    with TestClient(create_app(backend, config=config, recorder=recorder)) as client:
        r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        episode_id = r.headers["x-trace-episode"]
    assert recorder.flush(10) and recorder.dropped == 0
    [step] = recorder.store.get_episode(episode_id).steps
    messages = step.input["messages"]
    assert messages[0]["content"] == "Where is my order? \ufffd \U0001f600"
    assert messages[2]["content"] == "pending \ufffd"
    stored = recorder.store.tool_schemas("hostile")
    assert stored[0]["function"]["description"] == "Find \ufffd an order \U0001f600"
    for format in ("trl", "openai"):
        path = tmp_path / f"{format}.jsonl"
        assert write_jsonl(dataset(recorder.store, "hostile", format=format), path) == 1
        [row] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert "\ufffd #W1" in json.dumps(row, ensure_ascii=False)  # the escaped escape, parsed
    with TestClient(create_dashboard(recorder.store)) as dashboard:
        assert dashboard.get(f"/episodes/{episode_id}").status_code == 200
        export = dashboard.get(f"/export/trl/{episode_id}")
        assert export.status_code == 200 and "\ufffd #W1" in export.text
    recorder.close(10)
    recorder.store.close()


def test_a_client_that_never_finishes_its_headers_gives_up_the_connection(app):
    """uvicorn's keep-alive timeout restarts on every byte: a client sending its headers a
    byte at a time held a file descriptor for as long as it liked. The headers now have a
    deadline of their own; a request within it, and one kept alive after it, are served."""
    with start_in_thread(app, header_timeout=0.6) as server:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.settimeout(5)
        started = time.monotonic()
        closed_after = None
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
            try:
                slow.sendall(bytes([byte]))
                time.sleep(0.05)
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - started
                    break
            except BlockingIOError:
                continue
            except OSError:  # reset: closed as well
                closed_after = time.monotonic() - started
                break
        assert closed_after is not None and closed_after < 3, closed_after
        slow.close()
        fine = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for pause in (0.0, 0.3):  # kept alive within the deadline: a second request is served too
            time.sleep(pause)
            fine.request("GET", "/health")
            answer = fine.getresponse()
            assert answer.status == 200 and answer.read()
        fine.close()
