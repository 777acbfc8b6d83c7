"""litellm capture, against the embedded gateway serving the real SmolLM2-135M."""

from __future__ import annotations

import pytest

from integrations.litellm import TraceLogger
from trace_plugin import Recorder
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.routing import router_version
from trace_plugin.gateway.server import start_in_thread

litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(embedded_backend):
    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as server:
        yield server


@pytest.fixture(scope="module")
def logger(tmp_path_factory):
    """One logger for the module: litellm keeps callbacks it has seen in internal lists."""
    recorder = Recorder(f"sqlite:///{tmp_path_factory.mktemp('lite') / 'trace.db'}")
    logger = TraceLogger(agent="lite", recorder=recorder)
    previous, litellm.callbacks = litellm.callbacks, [logger]
    yield logger
    litellm.callbacks = previous
    recorder.close()


def episodes(logger, agent):
    recorder = logger._tracer_for(agent).recorder
    assert recorder.flush(10)
    return [recorder.store.get_episode(e.id) for e in recorder.store.list_episodes(agent)]


def test_completion_is_recorded(gateway, embedded_backend, logger):
    response = litellm.completion(
        model=f"openai/{embedded_backend.model_id}",
        api_base=gateway.url + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "Name a color."}],
        temperature=0,
        max_tokens=10,
        metadata={"trace_agent": "lite-sync"},
    )
    assert logger.flush()
    [episode] = episodes(logger, "lite-sync")
    [step] = episode.steps
    assert episode.source == "litellm" and step.kind == "llm"
    assert step.input["messages"] == [{"role": "user", "content": "Name a color."}]
    assert step.output["content"] == response.choices[0].message.content
    assert step.prompt_tokens == response.usage.prompt_tokens and step.latency_ms > 0
    assert episode.status == "completed"
    # the gateway's answer says which router version chose which adapter (here: the base)
    assert (episode.router, episode.adapter) == (router_version({"kind": "static", "adapter": None}), None)


async def test_acompletion_grouped_by_episode_id(gateway, embedded_backend, logger):
    for question in ("Hi", "Bye"):
        await litellm.acompletion(
            model=f"openai/{embedded_backend.model_id}",
            api_base=gateway.url + "/v1",
            api_key="unused",
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            metadata={"trace_episode_id": "lite-1", "trace_agent": "lite-async"},
        )
    assert await logger.aflush()
    [episode] = episodes(logger, "lite-async")
    assert episode.id == "lite-1" and len(episode.steps) == 2


def test_failures_are_recorded_and_still_reach_the_caller(logger):
    with pytest.raises(Exception, match="Connection|connect"):
        litellm.completion(
            model="openai/x",
            api_base="http://127.0.0.1:9/v1",
            api_key="unused",
            messages=[{"role": "user", "content": "hi"}],
            num_retries=0,
            max_retries=0,
            metadata={"trace_agent": "lite-fail"},
        )
    assert logger.flush()
    [episode] = episodes(logger, "lite-fail")
    assert "onnect" in episode.steps[0].error


def test_tool_schemas_are_captured_with_mock_responses(logger):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_order", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    litellm.completion(
        model="openai/x",
        messages=[{"role": "user", "content": "o?"}],
        tools=tools,
        mock_response="It shipped.",
        metadata={"trace_agent": "lite-tools"},
    )
    assert logger.flush()
    [episode] = episodes(logger, "lite-tools")
    assert episode.steps[0].input["tools"] == ["get_order"]
    assert logger._tracer_for("lite-tools").recorder.store.tool_schemas("lite-tools") == tools


def _logged(call_id, messages, reply):
    """What litellm hands a logger for one call: the kwargs and the response."""
    kwargs = {
        "litellm_call_id": call_id,
        "messages": messages,
        "model": "x",
        "litellm_params": {"metadata": {"trace_agent": "lite-order"}},
    }
    response = litellm.ModelResponse(choices=[{"message": {"role": "assistant", **reply}}])
    return kwargs, response


def _two_call_conversation(tmp_path):
    """A recorder, a logger, and a tool-calling conversation's two calls, announced in order."""
    recorder = Recorder(f"sqlite:///{tmp_path / 'trace.db'}")
    recorder.store.upgrade()
    logger = TraceLogger(agent="lite", recorder=recorder)
    opening = [{"role": "user", "content": "Where is W1?"}]
    asked = {
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": "{}"}}]
    }
    follow_up = [
        *opening,
        {"role": "assistant", **asked},
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
    ]
    calls = _logged("a", opening, asked), _logged("b", follow_up, {"content": "It shipped."})
    for kwargs, _ in calls:
        logger.log_pre_api_call(model="x", messages=kwargs["messages"], kwargs=kwargs)
    return recorder, logger, calls


def test_a_conversation_logged_out_of_order_is_one_episode(tmp_path):
    """litellm logs sync calls on pool threads, so a conversation's second call can reach
    the logger first; it must still continue the first call's episode."""
    recorder, logger, (first, second) = _two_call_conversation(tmp_path)
    logger.log_success_event(*second, None, None)
    assert episodes(logger, "lite-order") == []  # the second waits for the first
    logger.log_success_event(*first, None, None)
    assert logger.flush()
    [episode] = episodes(logger, "lite-order")
    assert [s.output.get("content") for s in episode.steps] == [None, "It shipped."]
    assert episode.status == "completed"
    recorder.close()


def test_a_call_never_logged_holds_nothing_back_for_long(tmp_path, monkeypatch):
    """litellm may announce a call and never log it: the calls after it are not held for ever."""
    import integrations.litellm as module

    recorder, logger, (_, second) = _two_call_conversation(tmp_path)
    monkeypatch.setattr(module, "HOLD_S", 0.0)  # the first call has been unlogged for too long
    logger.log_success_event(*second, None, None)
    [episode] = episodes(logger, "lite-order")
    assert [s.output.get("content") for s in episode.steps] == ["It shipped."]
    recorder.close()
