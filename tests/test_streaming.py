"""Streaming as production agents use it: tokens as they are generated, tool calls as
OpenAI deltas (name first, then argument fragments), usage when asked, capture as for a
non-streamed call, and a client that leaves mid-stream stopping its own rows only."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from support.requests import content_of, retail_ticket

from trace_plugin.gateway.app import CANCELLED, GatewayConfig, create_app
from trace_plugin.gateway.embedded import RowOutput, RowWatch
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.gateway.stops import StopMatcher
from trace_plugin.recorder import Recorder
from trace_plugin.tool_calls import ReplyStream, forced_opening, parse_completion

# -- the reply as deltas (pure) ------------------------------------------------------------------


def streamed(
    text: str, *, opening: str = "", max_calls: int | None = None, step: int = 1
) -> tuple[list, Any]:
    """Feed ``text`` ``step`` characters at a time; the deltas, and the whole reply's parse."""
    stream = ReplyStream(opening, max_calls=max_calls)
    deltas = []
    for start in range(0, len(text), step):
        deltas += stream.feed(text[start : start + step])
    parsed = parse_completion(opening + text, max_calls=max_calls)
    return deltas + stream.finish(parsed, opening + text), parsed


def assembled(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What an OpenAI client makes of the deltas: the content, and each call by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


CALL = (
    '<tool_call>\n{"name": "get_order", "arguments": '
    '{"order_id": "#W1", "note": {"say": "a } in a string"}}}\n</tool_call>'
)


def test_content_streams_as_it_comes_and_waits_only_at_what_may_open_a_call():
    stream = ReplyStream()
    assert stream.feed("Sure, one ") == [{"content": "Sure, one"}]  # trailing space waits
    assert stream.feed("moment. <tool") == [{"content": " moment."}]  # "<tool" may open a call
    assert stream.feed("box> is here") == [{"content": " <toolbox> is here"}]  # it did not


def test_a_call_goes_out_name_first_then_its_arguments_in_fragments():
    deltas, parsed = streamed("Checking.\n" + CALL)
    content, calls = assembled(deltas)
    assert content == "Checking." == parsed.content
    [call] = calls
    first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert call["name"] == "get_order" and first["function"] == {"name": "get_order", "arguments": ""}
    assert json.loads(call["arguments"]) == json.loads(parsed.tool_calls[0]["function"]["arguments"])
    assert sum("tool_calls" in d for d in deltas) > 10  # fragment by fragment, not whole
    assert call["id"] == parsed.tool_calls[0]["id"]  # the recorded reply keeps the id the client got


def test_the_name_goes_out_as_soon_as_it_is_written():
    stream = ReplyStream()
    [delta] = stream.feed('<tool_call>\n{"name": "get_order"')
    assert delta["tool_calls"][0]["function"] == {"name": "get_order", "arguments": ""}
    assert stream.feed(", ") == []
    # Arguments written as a JSON string: sent whole once the call closes, as parsed.
    text = '<tool_call>\n{"name": "a", "parameters": "{\\"x\\": 1}"}\n</tool_call>'
    deltas, parsed = streamed(text)
    [call] = assembled(deltas)[1]
    assert (
        (call["name"], call["arguments"])
        == ("a", parsed.tool_calls[0]["function"]["arguments"])
        == ("a", '{"x": 1}')
    )


def test_calls_of_other_shapes_go_out_whole_and_the_call_limit_holds():
    listed = (
        '<tool_call>\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": 1}}]\n</tool_call>'
    )
    deltas, parsed = streamed(listed)
    assert (
        [c["name"] for c in assembled(deltas)[1]]
        == ["a", "b"]
        == [c["function"]["name"] for c in parsed.tool_calls]
    )
    deltas, _ = streamed(listed, max_calls=1)
    assert [c["name"] for c in assembled(deltas)[1]] == ["a"]
    deltas, parsed = streamed(CALL + CALL, max_calls=1)
    assert len(assembled(deltas)[1]) == 1 == len(parsed.tool_calls)


def test_markup_that_does_not_parse_ends_as_content_and_none_streams_everything_as_content():
    broken = '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>'  # one brace short
    deltas, parsed = streamed(broken)
    assert not parsed.tool_calls and assembled(deltas)[0].endswith(broken)
    deltas, parsed = streamed(CALL, max_calls=0)
    assert assembled(deltas) == (CALL, []) and parsed.content == CALL


def test_a_forced_opening_streams_the_call_it_starts():
    opening = forced_opening("get_order")
    deltas, parsed = streamed('"order_id": "#W7"}}\n</tool_call>', opening=opening, step=4)
    [call] = assembled(deltas)[1]
    assert call["name"] == "get_order" and json.loads(call["arguments"]) == {"order_id": "#W7"}
    assert parsed.tool_calls[0]["id"] == call["id"]


def test_a_streamed_row_holds_back_what_may_begin_a_stop_and_never_sends_the_stop(tokenizer):
    text = "Thought: look up é and 日本. Observation: found it."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    sent: list[str] = []
    gone = {"now": False}
    stops = StopMatcher(["Observation:"])
    watches = [
        RowWatch(tokenizer, stops, RowOutput(sent.append)),
        RowWatch(tokenizer, stops, RowOutput(None, lambda: gone["now"])),
    ]
    stopped_at = None
    for i, token in enumerate(ids):
        gone["now"] = i >= 3
        done = [watch.push(token) for watch in watches]
        if done[0] and stopped_at is None:
            stopped_at = i
        assert done[1] == (i >= 3)  # the row nobody wants stops at once
        assert "Observation" not in "".join(sent)
    assert "".join(sent) == text[: text.index("Observation:")]
    assert stopped_at is not None and stopped_at < len(ids) - 1
    assert watches[1].cancelled and not watches[0].cancelled


@pytest.fixture(scope="module")
def tokenizer(embedded_backend):
    return embedded_backend.tokenizer


# -- through the embedded gateway, on the real model ---------------------------------------------


@pytest.fixture(scope="module")
def gateway(embedded_backend, tmp_path_factory):
    recorder = Recorder(f"sqlite:///{tmp_path_factory.mktemp('db') / 'stream.db'}")
    config = GatewayConfig(adapter_root=tmp_path_factory.mktemp("adapters"), agent="streaming")
    with start_in_thread(create_app(embedded_backend, config=config, recorder=recorder)) as server:
        server.recorder = recorder
        yield server
    recorder.close()


@pytest.fixture
def client(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def steps_of(gateway, episode_id: str) -> list[Any]:
    assert gateway.recorder.flush(30)
    episode = gateway.recorder.store.get_episode(episode_id)
    return episode.steps if episode else []


@pytest.mark.slow
def test_the_openai_client_gets_tokens_as_they_are_generated(client, embedded_backend):
    ask = {"model": embedded_backend.model_id, "temperature": 0, "max_tokens": 24}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat.completions.create(messages=messages, **ask)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **ask))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 10  # token by token, not the finished text re-chunked
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # usage only when asked for
    with_usage = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    usage = with_usage[-1].usage
    assert with_usage[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


@pytest.mark.slow
def test_the_completions_endpoint_streams_too(client, embedded_backend):
    ask = {"model": embedded_backend.model_id, "prompt": "The sea is", "temperature": 0, "max_tokens": 12}
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) >= 5 and "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_min_tokens_holds_the_reply_open(client, embedded_backend):
    ask = {"model": embedded_backend.model_id, "temperature": 0, "max_tokens": 40}
    ask["messages"] = [{"role": "user", "content": "Say hi."}]
    free = client.chat.completions.create(**ask)
    held = client.chat.completions.create(**ask, extra_body={"min_tokens": 30})
    assert free.usage.completion_tokens < 30 <= held.usage.completion_tokens
    with pytest.raises(BadRequestError, match="min_tokens"):
        client.chat.completions.create(**ask, extra_body={"min_tokens": 41})


@pytest.mark.slow
def test_a_streamed_tool_call_comes_as_deltas_and_is_recorded_as_a_plain_call(
    client, gateway, embedded_backend
):
    messages, tools = retail_ticket()
    ask = {"model": embedded_backend.model_id, "messages": messages, "tools": tools, "temperature": 0}
    ask |= {"max_tokens": 64, "tool_choice": "required"}
    whole = client.chat.completions.create(**ask)
    [expected] = whole.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **ask))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    parts = [p for d in deltas for p in d.get("tool_calls", ())]
    assert parts[0]["function"]["name"] == expected.function.name and parts[0]["id"]
    assert all("name" not in p.get("function", {}) for p in parts[1:]) and len(parts) > 3
    [call] = assembled(deltas)[1]
    assert json.loads(call["arguments"]) == json.loads(expected.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Recorded as the non-streamed call was, under the id the client assembled.
    assert gateway.recorder.flush(30)
    store = gateway.recorder.store
    outputs = {
        step.output["tool_calls"][0]["id"]: step.output
        for episode in store.list_episodes(agent="streaming")
        for step in steps_of(gateway, episode.id)
        if step.output and step.output.get("tool_calls")
    }
    plain, streamed_output = outputs[expected.id], outputs[call["id"]]
    for output in (plain, streamed_output):
        output["tool_calls"][0].pop("id")
    assert streamed_output == plain


@pytest.mark.slow
async def test_langchain_streams_through_a_langgraph_agent(gateway, embedded_backend):
    """``ChatOpenAI(streaming=True)`` in a LangGraph agent under ``astream``: the model's
    tokens arrive as message chunks, and the call LangChain assembles from them is the one
    the same model answers without streaming."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    messages, tools = retail_ticket()

    def model(streaming: bool) -> Any:
        chat = ChatOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", model=embedded_backend.model_id,
            temperature=0, max_tokens=64, streaming=streaming,
        )  # fmt: skip
        return chat.bind_tools(tools, tool_choice="required")

    streaming = model(True)
    acted: list[list[dict]] = []

    async def agent(state: MessagesState) -> dict:
        return {"messages": [await streaming.ainvoke(state["messages"])]}

    def act(state: MessagesState) -> dict:
        last = state["messages"][-1]
        acted.append(last.tool_calls if isinstance(last, AIMessage) else [])
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("act", act)
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "act")
    graph.add_edge("act", END)
    chunks = []
    async for message, meta in graph.compile().astream({"messages": messages}, stream_mode="messages"):
        if meta["langgraph_node"] == "agent":
            chunks.append(message)
    assert len(chunks) > 3  # streamed, not one message
    assert sum(len(c.tool_call_chunks) for c in chunks) > 2  # the call arrived in pieces
    whole = await model(False).ainvoke(messages)
    [[call]] = acted
    [expected] = whole.tool_calls
    assert (call["name"], call["args"]) == (expected["name"], expected["args"])


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_stops_its_row_only(gateway, embedded_backend):
    """Two streams share a batch; one client reads a few chunks and hangs up. Its row
    stops (the backend counts it), the other's reply is what it would have been alone,
    and the left call is recorded as cancelled with what was sent."""
    story = {"role": "user", "content": "Write a very long story about a lighthouse keeper."}
    other = {"role": "user", "content": "Name three colours."}
    ask = {"model": embedded_backend.model_id, "temperature": 0, "stream": True}
    alone = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={**ask, "stream": False, "messages": [other], "max_tokens": 32},
        timeout=120,
    ).json()["choices"][0]["message"]["content"]
    before = embedded_backend.cancelled_rows
    texts: dict[str, str] = {}

    def leave() -> None:
        body = {**ask, "messages": [story], "max_tokens": 400, "metadata": {"trace_episode_id": "left-early"}}
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            texts["left"] = "".join(content_of(line) for line, _ in zip(lines, range(6), strict=False))
        # leaving the block closes the connection mid-stream

    def stay() -> None:
        body = {**ask, "messages": [other], "max_tokens": 32}
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=120) as response:
            texts["stayed"] = "".join(content_of(line) for line in response.iter_lines())

    threads = [threading.Thread(target=leave), threading.Thread(target=stay)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert texts["stayed"] == alone
    [step] = _eventually(lambda: steps_of(gateway, "left-early"))
    assert step.error == CANCELLED
    assert step.output["content"].startswith(texts["left"]) and texts["left"]
    ended = _eventually(
        lambda: steps_of(gateway, "left-early") and gateway.recorder.store.get_episode("left-early")
    )
    assert (ended.status, ended.error) == ("cancelled", CANCELLED)  # ended, not left running
    assert _eventually(lambda: embedded_backend.cancelled_rows == before + 1)  # counted once generate returns


def _eventually(probe: Any, tries: int = 100) -> Any:
    """``probe()`` once it is truthy: what the server does after a client hangs up happens
    when it notices, a moment later. Its last value if it never is."""
    import time

    for _ in range(tries):
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    return value
