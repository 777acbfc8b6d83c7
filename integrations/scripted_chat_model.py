"""A scripted tool-calling chat model, for tests, benchmarks and offline examples.

LangChain's fake chat models cannot bind tools, so agents built with ``create_agent`` or
``create_react_agent`` refuse them. This one binds tools like a real provider (OpenAI
schemas in the invocation parameters) and answers with whatever its policy returns for
the conversation so far. The policy is a pure function of the messages, so concurrent
runs cannot disturb each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool

Policy = Callable[[list[BaseMessage]], AIMessage]


class ScriptedChatModel(BaseChatModel):
    """Answers ``policy(messages)`` after ``latency`` seconds; records token usage."""

    policy: Policy
    latency: float = 0.0
    model_name: str = "scripted"

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _respond(self, messages: list[BaseMessage]) -> ChatResult:
        message = self.policy(messages)
        prompt_chars = sum(len(str(m.content)) for m in messages)
        message.usage_metadata = {
            "input_tokens": prompt_chars // 4,
            "output_tokens": len(str(message.content)) // 4 + 8 * len(message.tool_calls),
            "total_tokens": prompt_chars // 4 + len(str(message.content)) // 4,
        }
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.latency:
            time.sleep(self.latency)
        return self._respond(messages)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.latency:
            await asyncio.sleep(self.latency)
        return self._respond(messages)


def call_tools_then_answer(*calls: tuple[str, dict[str, Any]], answer: str = "Done.") -> Policy:
    """A policy that requests ``calls`` (in parallel) once, then answers from the results."""

    def policy(messages: list[BaseMessage]) -> AIMessage:
        if messages and messages[-1].type == "tool":
            results = [str(m.content) for m in messages if m.type == "tool"]
            return AIMessage(content=f"{answer} {' '.join(results)}".strip())
        turn = sum(1 for m in messages if m.type == "human")
        tool_calls = [
            {"name": name, "args": args, "id": f"call_{turn}_{i}", "type": "tool_call"}
            for i, (name, args) in enumerate(calls)
        ]
        return AIMessage(content="", tool_calls=tool_calls)

    return policy
