"""``tool_choice`` and ``parallel_tool_calls`` enforced: the mechanism on a scripted backend,
then the real SmolLM2 through the embedded gateway."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI
from support.backends import ScriptedBackend
from support.requests import retail_ticket

from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.tool_calls import CLOSE, OPEN, forced_opening

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("get_order", "find_user")
]
USER = [{"role": "user", "content": "Where is my order #W1?"}]
NAMES = ("find_user", "get_order")


def forced(choice):
    return {"type": "function", "function": {"name": choice}}


class Recording(ScriptedBackend):
    """The scripted backend, keeping each request's sampling parameters too."""

    def __init__(self, tokenizer, reply: str) -> None:
        super().__init__(tokenizer, reply)
        self.params = []

    async def generate(self, prompt, params, adapter):
        self.params.append(params)
        return await super().generate(prompt, params, adapter)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))


def scripted(tokenizer, reply: str) -> tuple[Recording, OpenAI, object]:
    backend = Recording(tokenizer, reply)
    server = start_in_thread(create_app(backend, config=GatewayConfig(record=False)))
    return backend, OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), server


def test_a_required_call_is_started_for_the_model_and_the_reply_continues_it(tokenizer):
    # What a model writes after the forced opening of a call of get_order: the rest of its arguments.
    backend, client, server = scripted(tokenizer, '"order_id": "#W1"}}')  # stopped before </tool_call>
    with server:
        reply = client.chat.completions.create(
            model="scripted", messages=USER, tools=TOOLS, tool_choice=forced("get_order")
        )
        plain = backend.render(USER, TOOLS)
        assert backend.prompts[-1] == plain + forced_opening("get_order")  # the tools are rendered too
        [call] = reply.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_order", '{"order_id": "#W1"}')
        assert reply.choices[0].finish_reason == "tool_calls"
        assert OPEN[:-1] not in backend.params[-1].bad_words and CLOSE in backend.params[-1].stop  # one call

        backend.reply = 'find_user", "arguments": {}}\n</tool_call>'
        reply = client.chat.completions.create(
            model="scripted", messages=USER, tools=TOOLS, tool_choice="required"
        )
        assert backend.prompts[-1] == plain + forced_opening(True)
        assert reply.choices[0].message.tool_calls[0].function.name == "find_user"

        client.chat.completions.create(model="scripted", messages=USER, tools=TOOLS, tool_choice="none")
        assert (
            backend.prompts[-1] == plain and OPEN[:-1] in backend.params[-1].bad_words
        )  # rendered, not opened


def test_parallel_tool_calls_false_keeps_the_first_call_and_none_keeps_the_text(tokenizer):
    blocks = (f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>' for name in NAMES)
    two = "\n".join(blocks)
    _, client, server = scripted(tokenizer, two)

    def ask(**extra):
        return client.chat.completions.create(model="scripted", messages=USER, tools=TOOLS, **extra).choices[
            0
        ]

    with server:
        assert [c.function.name for c in ask().message.tool_calls] == list(NAMES)
        assert [c.function.name for c in ask(parallel_tool_calls=False).message.tool_calls] == ["find_user"]
        none = ask(tool_choice="none")  # what the model wrote anyway is its content, not a call
        assert (
            none.message.tool_calls is None and none.message.content == two and none.finish_reason == "stop"
        )


def test_a_choice_that_cannot_be_honoured_is_a_400(tokenizer):
    backend, client, server = scripted(tokenizer, "Hi.")
    with server:
        for body, needle in (
            ({"tool_choice": "required"}, "needs tools"),
            ({"tools": TOOLS, "tool_choice": forced("cancel_order")}, "not among the tools"),
            ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
        ):
            with pytest.raises(BadRequestError, match=needle):
                client.chat.completions.create(model="scripted", messages=USER, **body)
        assert backend.prompts == []  # refused before generation


# -- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(embedded_backend):
    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as server:
        yield OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), embedded_backend.model_id


@pytest.mark.slow
def test_tool_choice_on_the_real_model(real):
    client, model = real
    messages, tools = retail_ticket()  # the support agent's first turn: left alone, it calls a tool

    def ask(**extra):
        return client.chat.completions.create(
            model=model, messages=messages, tools=tools, temperature=0, max_tokens=60, **extra
        ).choices[0]

    assert ask().message.tool_calls  # left alone (auto), it calls
    refrained = ask(tool_choice="none")
    assert not refrained.message.tool_calls and refrained.finish_reason != "tool_calls"
    named = ask(tool_choice=forced("find_user"))
    assert [c.function.name for c in named.message.tool_calls] == ["find_user"]
    chat = [{"role": "user", "content": "Say hello in one word."}]  # a request no tool fits
    free = client.chat.completions.create(
        model=model, messages=chat, tools=tools, temperature=0, max_tokens=40
    )
    assert not free.choices[0].message.tool_calls
    required = client.chat.completions.create(
        model=model, messages=chat, tools=tools, temperature=0, max_tokens=40, tool_choice="required"
    )
    assert required.choices[0].message.tool_calls and required.choices[0].finish_reason == "tool_calls"
