"""Environment specs proposed by an LLM, accepted only once they validate.

The model sees the capability and the offline synthesizer's spec, and answers with a
whole ``EnvSpec`` as JSON (richer tickets, better-aimed checks). Whatever it writes is
data: ``parse_spec`` rejects anything malformed,
oversized or referencing what does not exist; a proposal may only use the target's own
tool schemas, unchanged; and the reference, do-nothing and random policies must score as
a usable reward requires. A rejected answer goes back to the model with the reason, up to
``retries`` times; after that the caller keeps the offline spec.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trace_plugin.environments.validation import check_policies
from trace_plugin.records.env_spec import EnvSpec, SpecError, parse_spec

# messages -> the model's text (e.g. ``trace_plugin.mining.analyzer.LiteLLMComplete``)
Complete = Callable[[list[dict[str, str]], dict[str, Any]], str]

SYSTEM = """You design training environments for one capability of a tool-using agent.
An environment is JSON data in a fixed language (no code). Improve the given spec so its
tasks exercise the capability more directly: vary the tickets, aim the checks at it.
Keep every tool schema exactly as given. Answer with the complete JSON spec only."""


@dataclass(slots=True)
class Proposal:
    spec: EnvSpec | None  # None: every answer was rejected
    problems: list[str] = field(default_factory=list)  # why each rejected answer was

    def to_report(self) -> dict[str, Any]:
        return {"accepted": self.spec is not None, "problems": self.problems}


def propose(
    base: EnvSpec,
    description: str,
    complete: Complete,
    *,
    tools: list[dict[str, Any]] | None = None,
    retries: int = 2,
) -> Proposal:
    """Ask for a better spec than ``base``; validate every answer before accepting one.

    ``tools`` are the target's captured schemas, which a proposal may use (default: the
    ones ``base`` uses)."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Capability {base.capability}: {description}\n\nSpec:\n{base.to_json()}",
        },
    ]
    schema = {"name": "env_spec", "schema": EnvSpec.model_json_schema(by_alias=True)}
    problems: list[str] = []
    for _ in range(retries + 1):
        try:
            answer = complete(messages, schema)
        except Exception as exc:  # the provider failed: nothing to validate
            problems.append(f"completion failed: {type(exc).__name__}: {exc}")
            continue
        problem, spec = _validate(answer, base, tools or [t.schema_ for t in base.tools])
        if spec is not None:
            return Proposal(spec, problems)
        problems.append(problem)
        messages += [
            {"role": "assistant", "content": answer[:4000]},
            {"role": "user", "content": f"Rejected: {problem}. Send the corrected complete JSON spec."},
        ]
    return Proposal(None, problems)


def _validate(answer: str, base: EnvSpec, tools: list[dict[str, Any]]) -> tuple[str, EnvSpec | None]:
    text = answer.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        spec = parse_spec(text)
    except SpecError as exc:
        return str(exc), None
    allowed = {json.dumps(t, sort_keys=True) for t in tools}
    altered = [t.name for t in spec.tools if json.dumps(t.schema_, sort_keys=True) not in allowed]
    if altered:
        return f"tools {altered} are not the target's schemas, unchanged", None
    if spec.capability != base.capability:
        return f"capability must stay {base.capability!r}", None
    check = check_policies(spec)
    if not check.passed:
        return "; ".join(check.problems), None
    return "", spec
