"""Which environments exist, and how a capability becomes a validated one.

Targets are the environments agents are judged on (``Target``): the bundled retail
one, those packages register under the entry-point group ``trace_plugin.targets``, and any
named as ``package.module:attribute`` (``load_target``). Synthesized environments are
stored specs, looked up by name (their latest version unless one is asked for). All come
out of ``env_factory`` as the same kind of factory, so the runner, the MCP server and
the trainer never know the difference.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.metadata import entry_points
from typing import Any

from trace_plugin.environments.base import Environment, Target
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.proposals import Complete, propose
from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv
from trace_plugin.environments.synthesis import CapturedInterface, is_generic, synthesize
from trace_plugin.environments.validation import (
    CALIBRATION_SEEDS,
    DEFAULT_BAND,
    Band,
    Play,
    calibrate,
    check_policies,
)
from trace_plugin.errors import TracePluginError
from trace_plugin.records.capability import Capability
from trace_plugin.records.env_spec import EnvSpec, SpecRecord
from trace_plugin.store import Store

TARGET_GROUP = "trace_plugin.targets"
# The longest retail task takes four tool calls and an answer; one turn to spare.
BUNDLED: dict[str, Target] = {"retail": Target("retail", RetailEnv, tuple(TEST_SEEDS), max_turns=6)}


class UnknownEnvironment(TracePluginError, LookupError):
    pass


class TargetError(TracePluginError, ValueError):
    """A target that was found but does not work: says what is wrong with it."""


def registered_targets() -> list[str]:
    """The targets installed packages register (entry-point group ``trace_plugin.targets``)."""
    return sorted({ep.name for ep in entry_points(group=TARGET_GROUP)})


def load_target(name: str) -> Target:
    """The target ``name``: bundled, registered by entry point, or ``package.module:attribute``."""
    if name in BUNDLED:
        return BUNDLED[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or the module failing as it loads
            raise TargetError(f"target {name!r}: cannot import {module_name!r}: {exc}") from exc
        if not hasattr(module, attribute):
            raise TargetError(f"target {name!r}: module {module_name!r} has no {attribute!r}")
        return _checked(name, getattr(module, attribute))
    found = [ep for ep in entry_points(group=TARGET_GROUP) if ep.name == name]
    if not found:
        known = ", ".join([*BUNDLED, *registered_targets()])
        raise UnknownEnvironment(
            f"unknown target {name!r}; known: {known}; or name one as package.module:attribute"
        )
    try:
        loaded = found[0].load()
    except Exception as exc:
        raise TargetError(f"target {name!r} ({found[0].value}) does not load: {exc}") from exc
    return _checked(name, loaded)


def _checked(name: str, loaded: Any) -> Target:
    """``loaded`` (a Target, or a function returning one) as a Target whose environment works."""
    target = _called(name, loaded) if callable(loaded) and not isinstance(loaded, Target | type) else loaded
    if not isinstance(target, Target):
        raise TargetError(
            f"target {name!r} is a {type(target).__name__}, not a trace_plugin.environments.Target "
            "(or a function returning one): Target(name, factory, test_seeds)"
        )
    seeds = target.test_seeds
    if not isinstance(seeds, Sequence) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise TargetError(f"target {name!r}: test_seeds must be a non-empty sequence of ints")
    try:
        env = target.factory()
        missing = [a for a in ("tools", "system_prompt", "reset", "step", "reward") if not hasattr(env, a)]
    except Exception as exc:
        raise TargetError(f"target {name!r}: its factory fails: {type(exc).__name__}: {exc}") from exc
    if missing:
        raise TargetError(f"target {name!r}: its environment has no {', '.join(missing)}")
    return target


def _called(name: str, function: Callable[..., Any]) -> Any:
    """What the function a target names returns; a TargetError, not its traceback, when it
    needs arguments or raises (it is user code, run from a command line)."""
    try:
        inspect.signature(function).bind()
    except TypeError as exc:
        raise TargetError(
            f"target {name!r}: {getattr(function, '__name__', function)!r} needs arguments ({exc}); "
            "name a Target, or a function that takes none and returns one"
        ) from exc
    except ValueError:  # no signature to read (some builtins): calling it tells
        pass
    try:
        return function()
    except Exception as exc:
        raise TargetError(f"target {name!r}: calling it failed: {type(exc).__name__}: {exc}") from exc


def target_turns(name: str) -> int | None:
    """The horizon the target ``name`` states; None for one that states none, or a synthesized environment."""
    if name in BUNDLED or ":" in name or name in registered_targets():
        return load_target(name).max_turns
    return None


def env_factory(
    name: str, store: Store | None = None, version: int | None = None
) -> Callable[[], Environment]:
    """A factory of the environment ``name``: a target, or a synthesized spec in ``store``."""
    if name in BUNDLED or ":" in name or name in registered_targets():
        return load_target(name).factory
    record = store.env_spec(name, version) if store is not None else None
    if record is None:
        stored = sorted({r.spec.name for r in store.env_specs()} if store else set())
        known = [*BUNDLED, *registered_targets(), *stored]
        raise UnknownEnvironment(f"unknown environment {name!r}; known: {', '.join(known)}")
    spec = record.spec
    return lambda: SpecEnv(spec)


def chat_player(base_url: str, model: str, *, agent: str, temperature: float = 1.0, **options: Any) -> Play:
    """Plays calibration episodes through an OpenAI-compatible endpoint (our gateway, vLLM)."""
    from trace_plugin.environments.runner import ChatLoopAgent
    from trace_plugin.records.trajectory import new_episode_id

    examples = list(options.pop("examples", ()))
    # A reply's length and the horizon: numbers, or one per environment (from its reference plays).
    per_spec = {key: options.pop(key) for key in ("max_tokens", "max_turns") if key in options}

    async def play(env: SpecEnv, seed: int) -> float:
        assert env.task is not None
        loop = ChatLoopAgent(
            base_url,
            model,
            agent=agent,
            temperature=temperature,
            examples=[*examples, *env.hint_messages],
            **options,
            **{key: value(env.spec) if callable(value) else value for key, value in per_spec.items()},
        )
        try:
            answer = await loop.solve(env, env.task, new_episode_id())
        except Exception:  # a failed call scores like a failed episode
            answer = ""
        return env.reward(answer).total

    return play


async def prepare_environment(
    store: Store,
    agent: str,
    capability: Capability,
    *,
    play: Play | None = None,
    hint_fraction: float = 0.5,
    band: Band = DEFAULT_BAND,
    seeds: Sequence[int] = CALIBRATION_SEEDS[:8],
    samples: int = 4,
    propose_with: Complete | None = None,
    progress: Callable[[str], None] | None = None,
) -> SpecRecord:
    """Synthesize an environment for ``capability`` from the agent's traffic, check and
    calibrate it, and store it: ``validated`` when usable, ``out_of_band`` when the base
    model's reward stayed outside the learnable band, ``rejected`` when its reward is broken.
    With ``propose_with`` an LLM may improve the offline spec; its proposal is used only
    if it validates, and the report says what happened to it.
    """
    captured = CapturedInterface.from_store(store, agent)
    # A spec exercises a bounded number of tools (the generic family's MAX_CALLED): those the
    # failing traffic called come first, so that an agent with many tools trains on its own.
    failing = {name: i for i, name in enumerate(capability.tools)}
    tools = sorted(captured.tools, key=lambda t: failing.get(t.get("function", t).get("name"), len(failing)))
    spec: EnvSpec = synthesize(
        capability.name,
        tools,
        system_prompt=captured.system_prompt,
        observations=captured.observations,
        description=capability.description,
    )
    proposal = None
    if propose_with is not None:
        proposal = propose(spec, capability.description, propose_with, tools=captured.tools)
        spec = proposal.spec or spec
    policies = check_policies(spec)
    report: dict[str, Any] = {
        "policies": asdict(policies),
        "capability": {"name": capability.name, "mining_run": capability.mining_run},
    }
    if not policies.passed and not is_generic(spec):
        # The family's spec is unusable here; the calls themselves still exercise the tools.
        generic = synthesize(
            capability.name,
            tools,
            system_prompt=captured.system_prompt,
            observations=captured.observations,
            description=capability.description,
            generic=True,
        )
        report["fallback"] = {"family_problems": list(policies.problems), "to": "generic"}
        spec, policies = generic, check_policies(generic)
        report["policies"] = asdict(policies)
    if proposal is not None:
        report["proposal"] = proposal.to_report()
    report["tools"] = {"exercised": len(spec.tools), "offered": len(tools)}
    if not policies.passed:
        return store.save_env_spec(agent, spec, "rejected", report)
    status = "validated"
    if play is not None:
        calibrated, calibration = await calibrate(
            spec,
            play,
            seeds=seeds,
            samples=samples,
            hint_fraction=hint_fraction,
            band=band,
            progress=progress,
        )
        if calibrated != spec:  # eased or made harder: the policies of the spec stored
            spec, report["policies"] = calibrated, asdict(check_policies(calibrated))
        report["calibration"] = calibration.to_dict()
        status = "validated" if calibration.in_band else "out_of_band"
    return store.save_env_spec(agent, spec, status, report)
