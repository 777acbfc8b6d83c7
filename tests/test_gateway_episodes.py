"""Every gateway episode ends: a reply without tool calls ends it, and so do a client that
hangs up mid-stream (``cancelled``), a conversation idle past the timeout after a tool
call, one pushed out of the tracked set, and the server stopping (``interrupted``). The
store and the miner skip ``running`` episodes, so one left running is lost to both.

A scripted backend stands in for the model: what ends an episode is the point, not what
the model says. The real model's hang-up is in ``test_streaming``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError
from support.backends import ScriptedBackend

from trace_plugin import Recorder
from trace_plugin.conversations import SHUT_DOWN, ConversationEpisodes, ModelCall
from trace_plugin.gateway.app import CANCELLED, GatewayConfig, GatewayConfigError, create_app
from trace_plugin.gateway.backend import SamplingParams
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.model_files import prepare_tokenizer, resolve_model
from trace_plugin.tracer import Tracer

CALL = '<tool_call>{"name": "get_order", "arguments": {"order_id": "O-1"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))


def ask(client: Any, episode: str, **extra: Any) -> Any:
    body = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "where is O-1?"}],
        "tools": TOOLS,
        "metadata": {"trace_episode_id": episode},
        **extra,
    }
    return client.post("/v1/chat/completions", json=body)


def status(recorder: Recorder, episode: str) -> tuple[str, str | None]:
    assert recorder.flush(15)
    with contextlib.suppress(OperationalError):  # nothing stored yet: no tables either
        stored = recorder.store.get_episode(episode)
        if stored is not None:
            return stored.status, stored.error
    return "absent", None


class SlowBackend(ScriptedBackend):
    """Streams its reply a few characters every 10 ms, so a client can leave mid-reply."""

    async def stream(self, prompt: str, params: SamplingParams, adapter: str | None) -> AsyncIterator[Any]:
        events = await super().stream(prompt, params, adapter)

        async def slowly() -> AsyncIterator[Any]:
            async for event in events:
                await asyncio.sleep(0.01)
                yield event

        return slowly()


def test_a_conversation_left_after_a_tool_call_ends_once_idle(tokenizer, local_recorder, tmp_path):
    config = GatewayConfig(adapter_root=tmp_path, agent="idle", conversation_timeout=0.4)
    app = create_app(ScriptedBackend(tokenizer, CALL), config=config, recorder=local_recorder)
    with TestClient(app) as client:
        reply = ask(client, "left-after-a-call").json()["choices"][0]
        assert reply["finish_reason"] == "tool_calls"  # the agent never comes back with the result
        assert status(local_recorder, "left-after-a-call") == ("running", None)
        deadline = time.monotonic() + 10  # the sweeper runs every timeout / 4 with no call to prompt it
        while status(local_recorder, "left-after-a-call")[0] == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status(local_recorder, "left-after-a-call") == ("completed", None)
    assert status(local_recorder, "left-after-a-call") == ("completed", None)  # the stop leaves it as it was


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -5, True, "600"])
def test_a_conversation_timeout_that_is_no_finite_positive_number_is_refused(tmp_path, timeout):
    """With nan the sweeper died (and 1 of 20 conversations never ended); with 0 it spun at
    a whole core."""
    with pytest.raises(GatewayConfigError, match="conversation_timeout is seconds, a finite number above 0"):
        GatewayConfig(adapter_root=tmp_path, conversation_timeout=timeout)


@pytest.mark.parametrize("timeout", ["nan", "inf"])
def test_serve_refuses_such_a_timeout_before_loading_a_model(tmp_path, timeout):
    from typer.testing import CliRunner

    from trace_plugin.cli import app

    args = ["serve", "--conversation-timeout", timeout, "--adapter-root", str(tmp_path)]
    refused = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    said = " ".join(refused.output.replace("│", " ").split())
    # nan fails the option's own minimum; inf passed it and ran a sweeper that never swept.
    assert refused.exit_code == 2 and "--conversation-timeout" in said, refused.output
    assert "Traceback" not in refused.output and "serving" not in said


def test_a_sweep_that_fails_is_logged_and_the_next_one_ends_the_conversation(
    tokenizer, local_recorder, tmp_path, monkeypatch, caplog
):
    sweep, failed = ConversationEpisodes.sweep, []

    def flaky(self):
        if not failed:
            failed.append(True)
            raise RuntimeError("the store hiccupped")
        return sweep(self)

    monkeypatch.setattr(ConversationEpisodes, "sweep", flaky)
    config = GatewayConfig(adapter_root=tmp_path, agent="idle", conversation_timeout=0.4)
    app = create_app(ScriptedBackend(tokenizer, CALL), config=config, recorder=local_recorder)
    with TestClient(app) as client:
        ask(client, "left-while-a-sweep-fails")
        deadline = time.monotonic() + 10
        while (
            status(local_recorder, "left-while-a-sweep-fails")[0] == "running" and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert failed and status(local_recorder, "left-while-a-sweep-fails") == ("completed", None)
    assert "sweeping idle conversations failed" in caplog.text


def test_no_conversation_stays_running_once_the_server_stops(tokenizer, local_recorder, tmp_path):
    config = GatewayConfig(adapter_root=tmp_path, agent="stopped")
    app = create_app(ScriptedBackend(tokenizer, CALL), config=config, recorder=local_recorder)
    with TestClient(app) as client:
        ask(client, "open-at-shutdown")
        assert status(local_recorder, "open-at-shutdown") == ("running", None)
    assert status(local_recorder, "open-at-shutdown") == ("interrupted", SHUT_DOWN)


def test_a_client_that_hangs_up_mid_stream_ends_its_episode_cancelled(tokenizer, local_recorder, tmp_path):
    """Over a real socket, as a client disconnects; the episode is ended once the server notices."""
    backend = SlowBackend(tokenizer, "A long reply, " * 200)
    config = GatewayConfig(adapter_root=tmp_path, agent="hangs-up")
    with start_in_thread(create_app(backend, config=config, recorder=local_recorder)) as server:
        body = {
            "model": "scripted",
            "stream": True,
            "messages": [{"role": "user", "content": "tell me"}],
            "metadata": {"trace_episode_id": "hung-up"},
        }
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
            next(response.iter_lines())  # one chunk, then the connection closes
        deadline = time.monotonic() + 15
        while status(local_recorder, "hung-up")[0] in ("absent", "running") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert status(local_recorder, "hung-up") == ("cancelled", CANCELLED)


def test_conversations_pushed_out_of_the_tracked_set_are_ended(local_recorder):
    tracer = Tracer("evicted", source="gateway", recorder=local_recorder)
    episodes = ConversationEpisodes(lambda agent: tracer, max_tracked=2)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "get_order", "arguments": "{}"}}]}  # fmt: skip
    for n in range(3):
        episodes.record(
            ModelCall("evicted", [{"role": "user", "content": f"q{n}"}], "m", reply=call, episode_id=f"e{n}")
        )
    assert status(local_recorder, "e0") == ("completed", None)  # pushed out by the third
    assert [status(local_recorder, f"e{n}")[0] for n in (1, 2)] == ["running", "running"]
    assert episodes.close() == 2
    assert [status(local_recorder, f"e{n}") for n in (1, 2)] == [("interrupted", SHUT_DOWN)] * 2
