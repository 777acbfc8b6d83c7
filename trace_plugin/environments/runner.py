"""The runner: an agent through a set of tasks of any environment, each recorded with its reward.

Two kinds of agent are supported:
- a LangGraph agent carrying the capture decorator, built per task by
  ``build(env) -> graph`` so that its tools act on that task's environment. The
  decorator records the episode; the runner chooses its id and attaches the reward. A
  task that offers its own tools passes them in the graph's input as ``tools`` (OpenAI
  schemas), as a request to an agent whose tools differ per request carries them;
- ``ChatLoopAgent``, a plain tool-calling loop against any OpenAI-compatible
  endpoint, which records its own episodes.

Tasks run concurrently up to a limit, with a progress bar, and end in a results table.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trace_plugin.conversations import RECORD_HEADER
from trace_plugin.environments.base import (
    Environment,
    RewardBreakdown,
    Task,
    ToolCall,
    observation_error,
    offered_tools,
)
from trace_plugin.recorder import Recorder, default_recorder
from trace_plugin.records.outcome import graded_label, reward_succeeds
from trace_plugin.records.trajectory import Feedback, new_episode_id
from trace_plugin.tracer import Tracer


@dataclass(slots=True)
class EpisodeResult:
    seed: int
    kind: str
    reward: RewardBreakdown
    episode_id: str
    answer: str
    error: str | None = None


class Agent(Protocol):
    async def solve(self, env: Environment, task: Task, episode_id: str) -> str:
        """Work on ``task`` through ``env``'s tools; return the final message to the user."""
        ...


class LangGraphAgent:
    """A (decorated) LangGraph agent built per task around that task's environment."""

    def __init__(
        self, build: Callable[[Environment], Any], *, examples: Sequence[Any] = (), max_turns: int = 8
    ) -> None:
        self.build = build
        self.examples = list(examples)  # few-shot messages placed before the ticket
        self.max_turns = max_turns  # model calls per task; a looping agent fails the task instead

    async def solve(self, env: Environment, task: Task, episode_id: str) -> str:
        graph = self.build(env)
        config = {
            "metadata": {"trace_episode_id": episode_id, "task_seed": task.seed, "task_kind": task.kind},
            # A model call and its tool calls are two graph steps; the final answer is one more.
            "recursion_limit": 2 * self.max_turns + 1,
        }
        inputs: dict[str, Any] = {"messages": [*self.examples, ("user", task.prompt)]}
        if task.tools is not None:
            inputs["tools"] = task.tools
        state = await graph.ainvoke(inputs, config=config)
        return str(state["messages"][-1].content)


class ChatLoopAgent:
    """A tool-calling loop against an OpenAI-compatible endpoint; records its own episodes."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        agent: str = "chat-loop",
        api_key: str = "unused",
        max_turns: int = 8,
        temperature: float = 0.0,
        max_tokens: int = 256,
        examples: Sequence[dict[str, Any]] = (),
        recorder: Recorder | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # It records its own episodes: a recording gateway must not make a second one of them.
        self.headers = {"Authorization": f"Bearer {api_key}", RECORD_HEADER: "false"}
        self.model, self.max_turns = model, max_turns
        self.temperature, self.max_tokens = temperature, max_tokens
        self.examples = list(examples)  # few-shot messages placed after the system prompt
        self.tracer = Tracer(agent, source="runner", recorder=recorder)

    async def solve(self, env: Environment, task: Task, episode_id: str) -> str:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": env.system_prompt},
            *self.examples,
            {"role": "user", "content": task.prompt},
        ]
        active = self.tracer.start_episode(
            {"messages": messages[-1:]},
            episode_id=episode_id,
            model=self.model,
            metadata={"task_seed": task.seed, "task_kind": task.kind},
        )
        import httpx  # the ``serve`` extra; only this agent talks HTTP

        try:
            # A client per episode: it belongs to this event loop and is closed with the episode.
            async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=600) as client:
                answer = await self._loop(client, env, offered_tools(env, task), messages, active)
        except Exception as exc:
            self.tracer.end_episode(active, error=exc)
            raise
        self.tracer.end_episode(active, output={"role": "assistant", "content": answer})
        return answer

    async def _loop(
        self,
        client: Any,
        env: Environment,
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        active: Any,
    ) -> str:
        for _ in range(self.max_turns):
            reply = await self._complete(client, messages, tools, active)
            messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                return reply.get("content") or ""
            for call in calls:
                observation = self._step(env, call, active)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation})
            if env.done:
                break
        return ""

    async def _complete(
        self, client: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], active: Any
    ) -> dict:
        body = {
            "model": self.model,
            "messages": messages,
            "tools": tools,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        names = [t["function"]["name"] for t in tools]
        with self.tracer.step(
            active, "llm", self.model, {"messages": list(messages), "tools": names}, tools=tools
        ) as step:
            response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            data = response.json()
            reply = data["choices"][0]["message"]
            usage = data.get("usage") or {}
            step.output = reply
            step.prompt_tokens, step.completion_tokens = (
                usage.get("prompt_tokens"),
                usage.get("completion_tokens"),
            )
        return {k: v for k, v in reply.items() if v is not None}

    def _step(self, env: Environment, call: dict[str, Any], active: Any) -> str:
        tool_call = ToolCall.from_openai(call)
        with self.tracer.step(
            active, "tool", tool_call.name, tool_call.arguments, tool_call_id=call.get("id")
        ) as step:
            step.output = observation = env.step(tool_call)
            step.error = observation_error(observation)
        return observation


class Runner:
    """Runs ``agent`` on ``seeds`` of fresh environments from ``env_factory``."""

    def __init__(
        self,
        env_factory: Callable[[], Environment],
        agent: Agent,
        *,
        concurrency: int = 4,
        recorder: Recorder | None = None,
        console: Console | None = None,
    ) -> None:
        self.env_factory, self.agent, self.concurrency = env_factory, agent, concurrency
        self._recorder = recorder
        self.console = console or Console()

    async def run(self, seeds: Sequence[int], *, description: str = "episodes") -> list[EpisodeResult]:
        limit = asyncio.Semaphore(self.concurrency)
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[mean]:.2f}"),
            TimeElapsedColumn(),
        )
        results: list[EpisodeResult] = []
        with Progress(*columns, console=self.console, transient=False) as progress:
            bar = progress.add_task(description, total=len(seeds), mean=0.0)

            async def one(seed: int) -> None:
                async with limit:
                    result = await self._episode(seed)
                results.append(result)
                mean = sum(r.reward.total for r in results) / len(results)
                progress.update(bar, advance=1, mean=mean)

            await asyncio.gather(*(one(s) for s in seeds))
        return sorted(results, key=lambda r: r.seed)

    async def _episode(self, seed: int) -> EpisodeResult:
        env = self.env_factory()
        task = env.reset(seed)
        episode_id = new_episode_id()
        answer, error = "", None
        try:
            answer = await self.agent.solve(env, task, episode_id)
        except Exception as exc:  # one failing episode is a result, not the end of the run
            error = f"{type(exc).__name__}: {exc}"
        reward = env.reward(answer)
        recorder = self._recorder or default_recorder()
        label = graded_label(reward.total)
        recorder.submit(
            Feedback(
                episode_id,
                reward=reward.total,
                label=label,
                source="environment",
                comment=json.dumps(reward.components),
            )
        )
        return EpisodeResult(seed, task.kind, reward, episode_id, answer, error)


def do_nothing_baseline(env_factory: Callable[[], Environment], seeds: Sequence[int]) -> list[EpisodeResult]:
    """What an agent that calls no tool and says nothing would score on each task."""
    results = []
    for seed in seeds:
        env = env_factory()
        task = env.reset(seed)
        results.append(EpisodeResult(seed, task.kind, env.reward(""), "", ""))
    return results


def summarize(results: Sequence[EpisodeResult], title: str = "Results") -> Table:
    """Success rate and mean reward overall and per task kind, with mean reward components."""
    by_kind: dict[str, list[EpisodeResult]] = defaultdict(list)
    for r in results:
        by_kind[r.kind].append(r)
    components = sorted({c for r in results for c in r.reward.components})
    table = Table(title=title)
    for column in ("task kind", "n", "success", "mean reward", *components, "errors"):
        table.add_column(column, justify="left" if column == "task kind" else "right")
    for kind, rows in [*sorted(by_kind.items()), ("all", list(results))]:
        n = len(rows)
        success = sum(reward_succeeds(r.reward.total) for r in rows) / n
        mean = sum(r.reward.total for r in rows) / n
        parts = [f"{sum(r.reward.components.get(c, 0.0) for r in rows) / n:.2f}" for c in components]
        table.add_row(
            kind, str(n), f"{success:.0%}", f"{mean:.2f}", *parts, str(sum(r.error is not None for r in rows))
        )
    return table
