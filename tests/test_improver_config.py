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
    # Fewer than the target has is said, not done silently.
    with pytest.warns(
        UserWarning, match=f"the first 32 of the {len(TEST_SEEDS)} test tasks of target 'retail'"
    ):
        assert list(ImproverConfig("a", URL, tmp_path, target="retail").target_seeds) == list(TEST_SEEDS)[:32]
    with pytest.warns(UserWarning, match="first 3 of"):
        few = ImproverConfig("a", URL, tmp_path, target="retail", target_tasks=3)
    assert list(few.target_seeds) == list(TEST_SEEDS)[:3]
    given = ImproverConfig("a", URL, tmp_path, target="retail", target_seeds=[7, 8])
    assert list(given.target_seeds) == [7, 8]  # seeds given are kept
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
    # Nothing is live: the live agent is the base model, played by that name.
    assert played == [("base", list(TEST_SEEDS)[:2])] and summary.n == 0


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
