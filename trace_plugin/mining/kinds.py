"""The capability kinds, each defined once: its name, detector, description, and how an
environment aimed at it is synthesized (a template family and a hint).

Adding a kind is one entry in ``KINDS``. The registry lives in mining, below the
environments that synthesize from it: the miner needs each kind's detector and
description, the synthesizer its family and hint. A kind names its family rather than
holding the function, since the families are synthesis code that works on a target's
interface; ``trace_plugin.environments.synthesis.FAMILIES`` maps every ``FamilyName``
to its function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from trace_plugin.mining import detectors as d
from trace_plugin.mining.detectors import Detector, Role, Trajectory
from trace_plugin.mining.selection import Label

# The synthesis template families: which tickets and checks exercise a kind.
FamilyName = Literal["calls", "lookups", "facts", "grounding", "preconditions", "refusals", "completion"]


@dataclass(frozen=True, slots=True)
class CapabilityKind:
    name: str
    detect: Detector  # NA / PRESENT / LACKING per episode, from its trajectory alone
    description: str  # what the capability is, as the miner stores and the analyzer shows it
    family: FamilyName  # the synthesis template family aimed at it
    hint: str  # the guidance a synthesized environment shows a share of training rollouts
    # Whether a ticket cut down to its last call still exercises the kind (its tickets state
    # every value that call needs): calibration may ease to that. Not where the earlier
    # calls are the capability.
    single_step_keeps_it: bool = False


KINDS: Mapping[str, CapabilityKind] = {
    kind.name: kind
    for kind in (
        CapabilityKind(
            "tool_call_format",
            d.tool_call_format,
            "Emits tool calls in the expected format, with arguments that parse and fit.",
            "calls",
            'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call> only.',
        ),
        CapabilityKind(
            "tool_selection",
            d.tool_selection,
            "Calls tools that exist and fit the request.",
            "lookups",
            "Pick the tool whose name matches what you need to know.",
        ),
        CapabilityKind(
            "argument_grounding",
            d.argument_grounding,
            "Copies ids into arguments from the user's message or earlier tool results.",
            "grounding",
            "Copy ids exactly from the search result into the next call.",
        ),
        CapabilityKind(
            "precondition_verification",
            d.precondition_verification,
            "Reads an entity's state before changing it.",
            "preconditions",
            "Look the record up and check its status before changing it.",
        ),
        CapabilityKind(
            "multi_step_completion",
            d.multi_step_completion,
            "Carries a request through to the action it needs, or says why not.",
            "completion",
            "Look the record up, then make the requested change.",
            single_step_keeps_it=True,
        ),
        CapabilityKind(
            "write_completion",
            d.write_completion,
            "Makes the change the user asked for, on the object they named.",
            "completion",
            "Find the record the user named, then make exactly the change they asked for.",
        ),
        CapabilityKind(
            "error_recovery",
            d.error_recovery,
            "After a tool error, changes the call instead of repeating it or giving up.",
            "preconditions",
            "If a tool returns an error, fix the call instead of repeating it.",
        ),
        CapabilityKind(
            "policy_refusal",
            d.policy_refusal,
            "Does not attempt what the policy forbids, and tells the user why.",
            "refusals",
            "If the status does not allow the change, do not make it; say why.",
        ),
        CapabilityKind(
            "communicating_facts",
            d.communicating_facts,
            "Tells the user the facts the tools returned.",
            "facts",
            "Repeat the exact values the tool returned in your reply.",
        ),
        CapabilityKind(
            "termination",
            d.termination,
            "Ends with a message to the user, without looping.",
            "lookups",
            "After the tool answers, reply to the user in one sentence.",
        ),
    )
}


def label_episode(t: Trajectory, roles: Mapping[str, Role] | None = None) -> dict[str, Label]:
    """Every kind's label for one episode."""
    return {name: kind.detect(t, roles or {}) for name, kind in KINDS.items()}
