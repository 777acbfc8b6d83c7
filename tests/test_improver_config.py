"""The target an ImproverConfig names gives the improver its held-out tasks, whoever plays them."""

from __future__ import annotations

import asyncio

import pytest

from trace_plugin.environments.retail import TEST_SEEDS
from trace_plugin.errors import TracePluginError
from trace_plugin.improver import ConfigError, Improver, ImproverConfig
from trace_plugin.store import Store

URL = "http://127.0.0.1:9"


def test_a_config_takes_its_test_seeds_from_the_target_it_names(tmp_path):
    """By default the verdict decided on the very tasks then reported (the live deployment's
    score was the verdict's measurement). The target's test seeds are now split: the first
    ``target_tasks`` decide, the next are reported. Fewer than the target has is said."""
    with pytest.warns(UserWarning, match=f"decides on the first 32 of the {len(TEST_SEEDS)} test tasks"):
        config = ImproverConfig("a", URL, tmp_path, target="retail")
    assert list(config.target_seeds) == list(TEST_SEEDS)[:32]
    assert list(config.reported_seeds) == list(TEST_SEEDS)[32:64]
    with pytest.warns(UserWarning, match="first 3 of"):
        few = ImproverConfig("a", URL, tmp_path, target="retail", target_tasks=3)
    assert (list(few.target_seeds), list(few.reported_seeds)) == (list(TEST_SEEDS)[:3], list(TEST_SEEDS)[3:6])
    given = ImproverConfig("a", URL, tmp_path, target="retail", target_seeds=[7, 8])
    assert list(given.target_seeds) == [7, 8] and list(given.reported_seeds) == []  # seeds given are kept
    with pytest.raises(ConfigError, match="name the verdict's tasks too"):
        ImproverConfig("a", URL, tmp_path, target="retail", reported_seeds=[7, 8])
    assert ImproverConfig("a", URL, tmp_path).target_seeds == ()  # no target, no target evaluation


def test_an_evaluator_plays_the_tasks_of_the_target_the_config_names(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    store.upgrade()
    played: list[tuple[str, list[int]]] = []

    async def evaluator(model, seeds):
        played.append((model, list(seeds)))
        return []

    config = ImproverConfig("a", URL, tmp_path, target="retail", target_tasks=2)
    summary = asyncio.run(Improver(store, config, evaluator=evaluator).live_summary())
    # Nothing is live: the live agent is the base model, played by that name, on the
    # reported tasks (not the verdict's).
    assert played == [("base", list(TEST_SEEDS)[2:4])] and summary.n == 0


def test_a_target_or_seeds_that_cannot_be_played_are_refused_before_any_cycle(sqlite_url, tmp_path):
    with pytest.raises(ConfigError, match="unknown target 'nowhere'") as refused:
        ImproverConfig("a", URL, tmp_path, target="nowhere")
    assert refused.value.setting == "target"
    assert isinstance(refused.value, TracePluginError) and isinstance(refused.value, ValueError)
    store = Store(sqlite_url)
    store.upgrade()
    seeds_alone = ImproverConfig("a", URL, tmp_path, target_seeds=[1, 2])
    with pytest.raises(ConfigError, match="target_seeds need a target to play them in, or an evaluator"):
        Improver(store, seeds_alone)

    async def evaluator(model, seeds):
        return []

    assert Improver(store, seeds_alone, evaluator=evaluator).config.target_seeds == [1, 2]
