"""An expert: one LoRA adapter trained for one capability, as the store records it.

Training (``training/``, with the heavy dependencies) produces it; the improver, gate and
gateway read it. A record is ``ready`` only once its adapter is complete on disk and its
sha256 is known: a crash mid-training leaves ``training`` or ``failed``, never ``ready``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from trace_plugin.records.router_spec import CorpusEntry
from trace_plugin.records.trajectory import new_id, utcnow

ACTS_ALONE = 0.9  # an un-hinted reward this high on average already acts without hints

ExpertStatus = Literal["training", "ready", "failed"]


@dataclass(slots=True)
class Expert:
    agent: str
    capability: str
    env_name: str
    env_version: int
    base_model: str
    base_model_hash: str
    config: dict[str, Any]
    status: ExpertStatus = "training"
    reward_curve: list[float] = field(default_factory=list)
    unhinted_curve: list[float | None] = field(default_factory=list)  # the un-hinted rollouts' alone
    # The verified reference plays its warm start trained on (the config's warm_start_plays
    # is only the most it may): None before it trained, or from before it was kept.
    warm_start_plays: int | None = None
    evaluation: dict[str, Any] = field(default_factory=dict)
    adapter_path: str | None = None
    adapter_sha256: str | None = None
    # Successful trajectories of its environment, embedded by the base model: what TRACE's
    # router retrieves this expert by. Computed once, when a router first needs them.
    corpus: list[CorpusEntry] = field(default_factory=list)
    id: str = field(default_factory=new_id)
    created_at: datetime = field(default_factory=utcnow)

    @property
    def learned_unhinted(self) -> bool:
        """Whether it acts without hints: over at least four steps, its un-hinted reward rose
        as a trend (the later half of its steps averages more than the earlier half), or it
        was near the top all along (the later half averages ``ACTS_ALONE`` or more: the warm
        start taught it, and a reward at the top cannot rise). One lucky rollout (four a
        step) is not learning; otherwise hinted rollouts and demonstrations carried its
        reward, and it may have learned nothing it can do alone, whatever it scores elsewhere."""
        values = [v for v in self.unhinted_curve if v is not None]
        half = len(values) // 2
        later, earlier = sum(values[-half:]), sum(values[:half])
        return len(values) >= 4 and (later > earlier or later >= ACTS_ALONE * half)

    @property
    def adapter_name(self) -> str:
        """The name it is served under: the capability, versioned by the record's id
        (``name@version``, which ``split_name`` parses)."""
        return f"{self.capability}@{self.id[:8]}"


def split_name(full: str) -> tuple[str, str | None]:
    """``"refunds@3"`` → ``("refunds", "3")``; an unversioned name has version None."""
    name, sep, version = full.partition("@")
    return name, (version if sep else None)
