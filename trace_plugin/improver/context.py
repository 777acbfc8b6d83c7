"""What a stage may use of the improver: the ``CycleContext`` protocol.

Stages (``stages.py``), evaluation and the monitor take this, not the ``Improver``
class: they import nothing of ``loop.py``, which composes them, and they reach only the
public face below. ``Improver`` satisfies it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from trace_plugin.environments.runner import EpisodeResult
    from trace_plugin.gateway import GatewayAdmin
    from trace_plugin.improver.config import ImproverConfig
    from trace_plugin.recorder import Recorder
    from trace_plugin.records.deployment import Deployment
    from trace_plugin.records.env_spec import EnvSpec
    from trace_plugin.records.expert import Expert
    from trace_plugin.records.stage_outputs import Routing, Summary
    from trace_plugin.store import Store
    from training.config import ExpertTrainingConfig


class CycleContext(Protocol):
    store: Store
    config: ImproverConfig
    console: Console
    gateway: GatewayAdmin
    recorder: Recorder
    executor: Any
    evaluator: Callable[[str, Sequence[int]], Awaitable[list[EpisodeResult]]]

    def live(self) -> Deployment | None: ...

    def canary(self) -> Deployment | None: ...

    async def live_model(self) -> str: ...

    async def live_summary(self, seeds: Sequence[int] | None = None) -> Summary: ...

    def examples(self) -> list[dict[str, Any]]: ...

    def training_config(self, **overrides: Any) -> ExpertTrainingConfig: ...

    def spec(self, capability: str, experts: dict[str, str] | None = None) -> EnvSpec: ...

    def env_of(self, expert: Expert) -> EnvSpec: ...

    def expert_of(self, capability: str, experts: dict[str, str] | None = None) -> Expert: ...

    async def play_spec(self, spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[EpisodeResult]: ...

    async def load_candidates(self, experts: dict[str, str]) -> dict[str, str]: ...

    async def learned_router(
        self, adapters: dict[str, str], experts: dict[str, str] | None = None
    ) -> Routing: ...
