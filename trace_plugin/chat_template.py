"""The one tool-aware chat template, shared by serving and training.

Small models such as SmolLM2-135M ship a ChatML template with no tools section: their
tokenizers silently ignore ``tools=``. We render every prompt with Qwen2.5's ChatML tool
layout instead (``<tools>`` in the system turn, ``<tool_call>{json}</tool_call>`` in
assistant turns, ``<tool_response>`` for results). The file is byte-identical to TRL's
``qwen2_5.jinja``, which is how TRL recognizes it and parses tool calls during GRPO, so
the gateway and the trainer produce exactly the same tokens for the same conversation.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

TOOL_CHAT_TEMPLATE = resources.files("trace_plugin").joinpath("templates/tool_chatml.jinja").read_text()

# Text no assistant turn may produce: the template's marker for a tool's answer, which is
# the user side's to write. Given worked examples, SmolLM2-135M opens almost every reply by
# imitating it (inventing the tool's answer) instead of calling the tool: 0 of 16 retail
# tickets drew a tool call, against 11 of 16 with it forbidden. Serving and training both
# forbid it (transformers' ``bad_words_ids``, vLLM's ``bad_words``), so a policy is trained
# under the decoding it is served with.
REPLY_FORBIDDEN: tuple[str, ...] = ("<tool_response",)


def to_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the form the template expects.

    OpenAI sends tool-call arguments as a JSON string and may send content as ``None`` or
    a list of parts; the template wants an arguments object and a string.
    """
    out = []
    for message in messages:
        m = {"role": message["role"], "content": content_text(message.get("content"))}
        if message.get("tool_calls"):
            m["tool_calls"] = [
                {"name": c["function"]["name"], "arguments": arguments_object(c["function"].get("arguments"))}
                for c in message["tool_calls"]
            ]
        out.append(m)
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for the next assistant turn."""
    return tokenizer.apply_chat_template(
        to_template_messages(messages),
        tools=tools or None,  # OpenAI form, as TRL passes them: identical prompt tokens
        chat_template=TOOL_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )


def assistant_text(tokenizer: Any, message: dict[str, Any]) -> str:
    """What a model writes for the assistant ``message`` after the generation prompt, up to
    (not including) EOS: the template's own rendering of it, so training and serving agree."""
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}],
        chat_template=TOOL_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, message], chat_template=TOOL_CHAT_TEMPLATE, tokenize=False
    )
    if not full.startswith(head):
        raise ValueError("the chat template renders an assistant turn unlike its generation prompt")
    return full[len(head) : full.rindex(tokenizer.eos_token)]


def forbidden_token_ids(tokenizer: Any, words: tuple[str, ...] = REPLY_FORBIDDEN) -> list[list[int]]:
    """``words`` as token sequences for transformers' ``bad_words_ids``."""
    return [tokenizer(word, add_special_tokens=False).input_ids for word in words]


def gate_input(request: str) -> str:
    """What the gate embeds: the request in a frame that asks for the skill it needs, so
    the last token's hidden state summarizes that (one place, for training and serving)."""
    return f"Customer request: {request[:1000]}\nThe skill this request needs most is"


def content_text(content: Any) -> str:
    """Message content as one string (text parts joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as an object when they parse, else as given. A lone surrogate's
    escape in them (stored as text, harmless there) becomes U+FFFD as it is parsed: no
    UTF-8 file or database can hold the character itself."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return _no_lone_surrogates(parsed) if "\\u" in arguments else parsed
    return arguments if arguments is not None else {}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings and keys made U+FFFD (a parsed
    pair is one character already, so any surrogate left is lone)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_no_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(v) for k, v in value.items()}
    return value
