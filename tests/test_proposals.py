"""LLM-proposed environment specs: accepted only after validation, through litellm's mock_response."""

from __future__ import annotations

import json

from trace_plugin.environments.proposals import propose
from trace_plugin.environments.retail import POLICY, TOOLS
from trace_plugin.environments.synthesis import synthesize
from trace_plugin.mining.analyzer import LiteLLMComplete


def scripted(*answers: str):
    """litellm answering with ``answers`` in turn (its mock_response), recording each prompt."""
    seen: list[list[dict]] = []
    pending = list(answers)

    def complete(messages, schema):
        seen.append(list(messages))
        return LiteLLMComplete("gpt-4o-mini", structured=False, mock_response=pending.pop(0))(
            messages, schema
        )

    return complete, seen


def test_a_valid_improvement_is_accepted_after_garbage_is_retried():
    base = synthesize("tool_selection", TOOLS, system_prompt=POLICY)  # single lookups
    better = json.loads(base.to_json())
    key = base.tables[base.tasks[0].slots["x"].table].key
    better["tasks"][0]["prompt"] = f"Quick question: what's the status of {{x.{key}}}?"
    complete, seen = scripted("I think you should add more tasks!", json.dumps(better))
    proposal = propose(base, "Emits tool calls in the expected format.", complete)
    assert proposal.spec is not None and proposal.spec.tasks[0].prompt.startswith("Quick question")
    assert len(proposal.problems) == 1 and "spec" in proposal.problems[0]
    assert seen[1][-1]["content"].startswith("Rejected:")  # the model was told why


def test_hostile_or_broken_proposals_are_rejected_and_the_caller_keeps_the_offline_spec():
    base = synthesize("tool_selection", TOOLS, system_prompt=POLICY)  # single lookups
    data = json.loads(base.to_json())
    invented = json.loads(base.to_json())
    invented["tools"][0]["schema"]["function"]["name"] = "run_shell"
    invented["tasks"][0]["reference"][0]["tool"] = "run_shell"
    lenient = json.loads(base.to_json())
    lenient["checks"] = [{"kind": "forbidden"}]  # rewards nothing but inaction...
    lenient["tasks"][0]["forbidden"] = []
    lenient["tasks"][0]["reference"] = []  # ...with nothing to do: doing nothing scores 1
    answers = [json.dumps(invented), json.dumps({**data, "code": "import os"}), json.dumps(lenient)]
    complete, _ = scripted(*answers)
    proposal = propose(base, "format", complete)
    assert proposal.spec is None and len(proposal.problems) == 3
    assert "run_shell" in proposal.problems[0] and "not the target's schemas" in proposal.problems[0]
    assert "code" in proposal.problems[1]
    assert "doing nothing" in proposal.problems[2]


def test_a_failing_provider_is_a_problem_not_a_crash():
    base = synthesize("tool_selection", TOOLS, system_prompt=POLICY)  # single lookups

    def broken(messages, schema):
        raise ConnectionError("provider unreachable")

    proposal = propose(base, "format", broken, retries=1)
    assert (
        proposal.spec is None
        and proposal.problems == ["completion failed: ConnectionError: provider unreachable"] * 2
    )


def test_a_proposal_may_use_other_tools_of_the_target():
    base = synthesize("tool_selection", TOOLS, system_prompt=POLICY)  # single lookups
    other = synthesize("argument_grounding", TOOLS, system_prompt=POLICY)  # find_user, get_user
    complete, _ = scripted(other.model_copy(update={"capability": "tool_selection"}).to_json())
    assert propose(base, "format", complete).spec is None  # find_user is not among base's tools
    complete, _ = scripted(other.model_copy(update={"capability": "tool_selection"}).to_json())
    accepted = propose(base, "format", complete, tools=TOOLS).spec
    assert accepted is not None and {t.name for t in accepted.tools} == {"find_user", "get_user"}
