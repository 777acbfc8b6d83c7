"""The offline miner on real captured LangGraph episodes with a planted deficit."""

from __future__ import annotations

from support.plays import scripted
from typer.testing import CliRunner

from trace_plugin.cli import app
from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.runner import LangGraphAgent, Runner
from trace_plugin.mining.miner import OfflineMiner


async def test_a_planted_deficit_is_found_and_stored(local_recorder):
    seeds = list(TRAIN_SEEDS)[:48]
    for invent in (False, True):
        agent = LangGraphAgent(lambda env, invent=invent: scripted(env, local_recorder, invent_ids=invent))
        await Runner(RetailEnv, agent, recorder=local_recorder, concurrency=8).run(seeds)
    assert local_recorder.flush(20)

    capabilities = OfflineMiner(local_recorder.store).mine("planted")
    selected = [c.name for c in capabilities if c.selected]
    assert selected == ["argument_grounding"], [(c.name, c.metrics) for c in capabilities]
    top = capabilities[0]
    assert top.metrics["coverage"] > 0.9 and top.metrics["contrast"] > 0.9 and top.metrics["passed"] == 10
    assert top.examples and all(local_recorder.store.get_episode(e).label == "failure" for e in top.examples)
    assert set(top.tools) & {"cancel_order", "modify_address", "return_items", "exchange_items"}
    assert top.entities[0] == "order" and "user" not in top.entities[:1]

    stored = local_recorder.store.capabilities("planted")
    assert [c.name for c in stored] == [c.name for c in capabilities]
    assert stored[0].mining_run == top.mining_run and stored[0].description
    assert stored[0].entities == top.entities

    runner = CliRunner()
    result = runner.invoke(
        app,
        ["capabilities", "list", "--agent", "planted", "--db", local_recorder.store.url],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0 and "argument_grounding" in result.output
    result = runner.invoke(
        app, ["mine", "--agent", "planted", "--db", local_recorder.store.url], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0 and "argument_grounding" in result.output and "selected" in result.output
    result = runner.invoke(
        app,
        [
            "capabilities",
            "show",
            "argument_grounding",
            "--agent",
            "planted",
            "--db",
            local_recorder.store.url,
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0 and "example failure" in result.output and "Copies ids" in result.output
    result = runner.invoke(
        app, ["capabilities", "show", "nope", "--agent", "planted", "--db", local_recorder.store.url]
    )
    assert result.exit_code == 1


def test_envs_list_and_show():
    runner = CliRunner()
    listed = runner.invoke(app, ["envs", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "retail" in listed.output and "bundled" in listed.output
    shown = runner.invoke(app, ["envs", "show", "retail", "--seed", "10001"], env={"COLUMNS": "200"})
    assert (
        shown.exit_code == 0
        and "find_user" in shown.output
        and RetailEnv().reset(10001).prompt[:30] in shown.output
    )
    assert runner.invoke(app, ["envs", "show", "nope"]).exit_code != 0


def test_the_planted_deficit_corpus_is_recovered_exactly():
    from trace_plugin.environments.planted import PLANTED, POLICIES, corpus
    from trace_plugin.mining.miner import mine_episodes

    episodes = corpus(list(TRAIN_SEEDS)[:40])
    # every deficient policy fails somewhere and succeeds somewhere; the others never fail
    for policy in POLICIES:
        labels = {e.label for e in episodes if e.metadata["policy"] == policy}
        assert labels == ({"success", "failure"} if policy in PLANTED else {"success"}), policy
    selected = {c.name for c in mine_episodes(episodes) if c.selected}
    assert selected == {kind for kinds in PLANTED.values() for kind in kinds}
