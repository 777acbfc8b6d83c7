"""Small environments of the protocol, for tests where the prompt's length is only cost."""

from __future__ import annotations

import hashlib
import json

from trace_plugin.environments.base import RewardBreakdown, Task, ToolCall


class EchoEnv:
    """A minimal environment of the protocol: echo the seed back, then tell the user."""

    tools = [
        {
            "type": "function",
            "function": {
                "name": "echo",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        }
    ]
    system_prompt = "Echo the number, then say it."

    def __init__(self) -> None:
        self.seed, self.calls, self._done = 0, [], False

    def reset(self, seed: int) -> Task:
        self.seed, self.calls, self._done = seed, [], False
        return Task(seed, f"My number is {seed}.", "echo", {"answer": f"number {seed}"})

    @property
    def done(self) -> bool:
        return self._done

    def step(self, call: ToolCall) -> str:
        self.calls.append(call)
        if call.name != "echo":
            return json.dumps({"error": f"unknown tool {call.name!r}"})
        return json.dumps({"echo": call.arguments.get("text", "")})

    def reward(self, answer: str = "") -> RewardBreakdown:
        echoed = any(c.arguments.get("text") == str(self.seed) for c in self.calls)
        said = str(self.seed) in answer
        return RewardBreakdown(float(echoed and said), {"echoed": float(echoed), "said": float(said)})


class ScoredEchoEnv(EchoEnv):
    """EchoEnv graded by a deterministic score that tells any two answers apart: every group has signal."""

    def reward(self, answer: str = "") -> RewardBreakdown:
        return RewardBreakdown(int(hashlib.sha256(answer.encode()).hexdigest(), 16) % 1000 / 1000)
