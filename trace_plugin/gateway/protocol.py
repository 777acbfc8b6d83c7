"""The OpenAI-compatible request bodies the gateway accepts, validated with pydantic.

Unknown fields are ignored (clients send many we do not use, such as ``user`` or
``store``); known ones are checked, so a malformed request gets a 400 that says which
field is wrong.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trace_plugin.records.env_spec import TOOL_NAME

MAX_TOKENS = 4096
MAX_N = 8
MAX_EMBEDDING_INPUTS = 256
MAX_STOPS = 4  # OpenAI's documented bound ("up to 4 sequences"), and TGI's default max_stop_sequences
MAX_STOP_CHARS = 200
# Ours: neither OpenAI nor vLLM documents one. With n <= 8, one call asks for at most 128 completions.
MAX_PROMPTS = 16
MAX_PATH = 4096  # Linux's PATH_MAX
# An agent name is the store's String(200). A longer episode id than the store's 64 is
# stored under its fitted key (store.fit_string), so a client's own long id is not refused.
MAX_EPISODE_ID = 1_000
MAX_AGENT = 200
SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's bound (torch.long); torch.manual_seed takes no more

Word = Annotated[str, Field(min_length=1, max_length=200)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """One part of a message's content. Text parts reach the model (and the routers), so
    their text must be a string; other parts pass through as sent."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_messages_answer_a_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def to_openai(self) -> dict[str, Any]:
        """As a plain OpenAI message; ``developer`` is served as ``system``."""
        data = self.model_dump(exclude_none=True)
        if data["role"] == "developer":
            data["role"] = "system"
        for call in data.get("tool_calls") or []:
            if not isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return data


class FunctionSchema(_Lenient):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type 'object'")
        if not isinstance(value.get("properties", {}), dict):
            raise ValueError("'properties' of a function schema must be an object")
        return value


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSchema


class TraceMetadata(_Lenient):
    """The ``metadata`` keys the gateway reads (OpenAI's metadata, ours prefixed ``trace_``);
    other keys are passed over."""

    trace_episode_id: str | None = Field(None, min_length=1, max_length=MAX_EPISODE_ID)
    trace_agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT)


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk, with no choices, carries the usage


class _Sampling(_Lenient):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)  # vLLM's: no end of the reply before this many
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    return_token_ids: bool = False  # vLLM >= 0.10.2: prompt and completion token ids
    bad_words: list[Word] | None = Field(None, max_length=32)  # vLLM's: text the output must never contain
    metadata: TraceMetadata | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def streams_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChosenFunction(_Lenient):
    name: str = Field(min_length=1, max_length=128)


class NamedToolChoice(_Lenient):
    """``{"type": "function", "function": {"name": X}}``: the reply must call X."""

    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(_Lenient):
    name: str = Field("response", min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema.
    The JSON ones need a backend that constrains decoding (vLLM's structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self

    def constrained(self) -> str | None:
        """The format as the backend receives it (JSON text), None for plain text."""
        return None if self.type == "text" else json.dumps(self.model_dump(by_alias=True, exclude_none=True))


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call per reply
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False

    @model_validator(mode="after")
    def _choice_is_offered(self) -> ChatCompletionRequest:
        if self.tool_choice in ("none", "auto", None):
            return self
        offered = {tool.function.name for tool in self.tools or ()}
        if not offered:
            raise ValueError("tool_choice that requires a call needs tools")
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        if named is not None and named not in offered:
            raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
        return self

    def max_calls(self) -> int | None:
        """How many calls a reply may make: none under ``tool_choice: "none"``, one without
        parallel calls, else any number."""
        return 0 if self.tool_choice == "none" else 1 if self.parallel_tool_calls is False else None

    def forced_call(self) -> str | bool:
        """The function the reply must call, True for any, False when a call is not required."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice == "required"

    def wants_logprobs(self) -> bool:
        return self.logprobs


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    # legacy API: None is off, 0 the chosen tokens only, N also the N likeliest (vLLM allows 20)
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not 0 < len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"1 to {MAX_PROMPTS} prompts per request")
        if any(not prompt for prompt in prompts):
            raise ValueError("prompts must be non-empty strings")
        return value

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class EmbeddingRequest(_Lenient):
    model: str
    input: str | list[str] = Field(min_length=1)

    @field_validator("input")
    @classmethod
    def _bounded(cls, value: str | list[str]) -> str | list[str]:
        texts = [value] if isinstance(value, str) else value
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        if any(not text for text in texts):
            raise ValueError("inputs must be non-empty strings")
        return value


class LoadAdapterRequest(_Lenient):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH)

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("a path cannot contain a NUL character")
        return value


class UnloadAdapterRequest(_Lenient):
    lora_name: str = Field(min_length=1, max_length=200)


class RouteRequest(_Lenient):
    """What ``POST /v1/route`` asks: the mixture a model name would serve these messages with."""

    model: str = Field(min_length=1, max_length=400)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
