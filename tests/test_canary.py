"""Canary deployments: a share of the traffic to the deployment on trial, every episode
stamped with the arm that served it, and the monitor promoting or rolling it back from the
episodes' real outcomes, compared with the rest of the traffic."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from support.backends import ScriptedBackend

from trace_plugin import Recorder, Store
from trace_plugin.dashboard import create_dashboard
from trace_plugin.gateway.app import AGENT_HEADER, GatewayConfig, create_app
from trace_plugin.gateway.routing import CanaryRouter, StaticRouter
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.improver import ConfigError, Improver, ImproverConfig, stages
from trace_plugin.improver import monitor as monitor_module
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.router_spec import (
    KeywordSpec,
    RouterSpecError,
    StaticSpec,
    parse_router_spec,
    router_version,
)
from trace_plugin.records.trajectory import Feedback, utcnow

AGENT = "shop"
MAIN = StaticSpec().to_dict()  # the live deployment: the base model
TRIAL = KeywordSpec(rules=[], default=None).to_dict()  # on trial: also the base model, another version


def test_a_canary_spec_holds_two_routers_and_a_share():
    spec = parse_router_spec({"kind": "canary", "share": 0.2, "main": MAIN, "candidate": TRIAL})
    assert spec.adapters() == [None, None] and router_version(spec) != router_version(TRIAL)
    for bad in (
        {"kind": "canary", "share": 1.0, "main": MAIN, "candidate": TRIAL},
        {"kind": "canary", "share": 0.2, "main": MAIN, "candidate": {"kind": "canary", "share": 0.5}},
    ):
        with pytest.raises(RouterSpecError):
            parse_router_spec(bad)


def test_a_request_keeps_its_arm_and_the_arms_take_their_shares():
    router = CanaryRouter(StaticRouter(None), StaticRouter("trial"), 0.25)
    requests = [[{"role": "user", "content": f"request {i}"}] for i in range(2000)]
    arms = [router.arm(messages) is router.candidate for messages in requests]
    assert 0.22 < sum(arms) / len(arms) < 0.28
    turns = [
        *requests[7],
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "x"},
    ]
    assert router.arm(turns) is router.arm(requests[7])  # the agent's later turns: the same arm


@pytest.fixture
def world(tmp_path, db_url):
    """A recording gateway on a scripted model, the store, and an improver deploying as a
    canary on half the traffic, with a live deployment and one on trial."""
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))
    store = Store(db_url)
    store.upgrade()
    recorder = Recorder(store.url)
    app = create_app(
        ScriptedBackend(tokenizer, "Done."),
        config=GatewayConfig(adapter_root=tmp_path, agent=AGENT),
        recorder=recorder,
    )
    with start_in_thread(app) as server:
        config = ImproverConfig(AGENT, server.url, tmp_path, canary=0.5, monitor_window=10, rollback_drop=0.1)
        improver = Improver(store, config)
        live = Deployment("c1", AGENT, "live", router=MAIN)
        store.make_live(live)
        trial = Deployment("c2", AGENT, "rejected", router=TRIAL)
        store.save_deployment(trial)
        asyncio.run(stages.deploy(improver, trial))  # as the cycle's deploy stage does
        yield server, store, recorder, improver
    recorder.close()


def serve(server, recorder: Recorder, requests: int, good: bool) -> tuple[int, int]:
    """``requests`` conversations through the gateway, each graded as it would be later: the
    canary's episodes succeed when ``good`` (else fail), the rest succeed every other time.
    Returns how many each arm served."""
    trial = router_version(TRIAL)
    counts = [0, 0]
    for i in range(requests):
        body = {"model": "default", "messages": [{"role": "user", "content": f"Where is my order {i}?"}]}
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers={AGENT_HEADER: AGENT}, timeout=60
        )
        episode = response.headers["X-Trace-Episode"]
        assert recorder.flush(10)
        canary = recorder.store.get_episode(episode).router == trial  # the arm, on the episode
        counts[canary] += 1
        ok = good if canary else i % 2 == 0
        recorder.submit(
            Feedback(episode, reward=float(ok), label="success" if ok else "failure", source="user")
        )
    assert recorder.flush(10)
    return counts[1], counts[0]


def test_a_canary_that_does_better_than_the_rest_is_promoted(world):
    server, store, recorder, improver = world
    assert store.deployments(AGENT, status="canary")[0].id == "c2" and not improver.due()
    assert parse_router_spec(asyncio.run(improver.gateway.router())).kind == "canary"
    canary, rest = serve(server, recorder, 12, good=True)
    assert min(canary, rest) < 10 and improver.monitor() is None  # the window is not full yet
    page = TestClient(create_dashboard(store)).get("/success").text  # two series while on trial
    assert f'data-agent="{AGENT} · canary"' in page and f'data-agent="{AGENT}"' in page
    serve(server, recorder, 30, good=True)
    promoted = improver.monitor()
    assert promoted is not None and promoted.id == "c2"
    statuses = {d.id: d.status for d in store.deployments(AGENT)}
    assert statuses == {"c1": "superseded", "c2": "live"} and "promoted" in promoted.reasons[-1]
    assert asyncio.run(improver.gateway.router()) == TRIAL  # all the traffic now


def test_a_canary_that_does_worse_than_the_rest_is_rolled_back(world):
    server, store, recorder, improver = world
    serve(server, recorder, 40, good=False)
    kept = improver.monitor()
    assert kept is not None and kept.id == "c1"
    statuses = {d.id: (d.status, d.reasons) for d in store.deployments(AGENT)}
    assert statuses["c1"][0] == "live" and statuses["c2"][0] == "rolled_back"
    assert "canary success 0.00" in statuses["c2"][1][-1]
    assert asyncio.run(improver.gateway.router()) == MAIN and improver.monitor() is None


def test_the_cli_takes_a_canary_share(tmp_path):
    from typer.testing import CliRunner

    from trace_plugin.cli import app

    args = [
        "improve",
        "--agent",
        AGENT,
        "--gateway-url",
        "http://127.0.0.1:9",
        "--adapter-root",
        str(tmp_path),
    ]
    for share in ("1.5", "1e-300", "0.999"):
        refused = CliRunner().invoke(
            app, [*args, "--canary", share, "--db", f"sqlite:///{tmp_path / 'c.db'}"]
        )
        said = " ".join(refused.output.replace("│", " ").split())
        assert refused.exit_code == 2 and "Invalid value for --canary" in said, refused.output
        assert "between 0.01 and 0.99" in said and f"not {float(share)}" in said
    refused = CliRunner().invoke(
        app, [*args, "--canary-deadline", "0", "--db", f"sqlite:///{tmp_path / 'c.db'}"]
    )
    assert refused.exit_code == 2 and "Invalid value for --canary-deadline" in refused.output


def test_a_canary_too_small_to_fill_its_window_or_without_a_deadline_is_refused(tmp_path):
    for share in (1e-300, 0.0099, 0.995):
        with pytest.raises(ConfigError, match="between 0.01 and 0.99") as refused:
            ImproverConfig(AGENT, "http://127.0.0.1:9", tmp_path, canary=share)
        assert refused.value.setting == "canary" and isinstance(refused.value, ValueError)
    with pytest.raises(ConfigError, match="canary_deadline is seconds, above 0"):
        ImproverConfig(AGENT, "http://127.0.0.1:9", tmp_path, canary=0.5, canary_deadline=0)
    assert ImproverConfig(AGENT, "http://127.0.0.1:9", tmp_path, canary=0.01).canary_deadline == 86_400


def past_the_deadline(improver: Improver, monkeypatch) -> None:
    """The monitor's clock, moved to a second after the trial's deadline."""
    later = utcnow() + timedelta(seconds=improver.config.canary_deadline + 1)
    monkeypatch.setattr(monitor_module, "utcnow", lambda: later)


def test_a_canary_that_cannot_fill_its_window_is_rolled_back_at_its_deadline(world, monkeypatch):
    """Too few episodes to judge by the deadline: the trial ends, the agent is free again."""
    server, store, recorder, improver = world
    improver.config.min_new_episodes = 1  # a cycle is due but for the trial
    canary, rest = serve(server, recorder, 6, good=True)
    episodes = min(canary, rest)
    assert episodes < 5 and improver.monitor() is None and not improver.due()  # before the deadline
    past_the_deadline(improver, monkeypatch)
    kept = improver.monitor()
    assert kept is not None and kept.id == "c1" and improver.canary() is None
    trial = {d.id: d for d in store.deployments(AGENT)}["c2"]
    assert trial.status == "rolled_back"
    assert trial.reasons[-1] == f"rolled back: deadline passed with {episodes} of 10 episodes"
    assert asyncio.run(improver.gateway.router()) == MAIN and improver.due()  # a new cycle may start


def test_a_canary_with_half_its_window_is_decided_at_its_deadline(world, monkeypatch):
    server, store, recorder, improver = world
    canary, rest = serve(server, recorder, 14, good=True)
    episodes = min(canary, rest)
    assert 5 <= episodes < 10 and improver.monitor() is None  # the window is not full
    past_the_deadline(improver, monkeypatch)
    promoted = improver.monitor()
    assert promoted is not None and promoted.id == "c2" and promoted.status == "live"
    assert promoted.reasons[-1].startswith(f"decided at deadline on {episodes} of 10 episodes: promoted: ")
    assert asyncio.run(improver.gateway.router()) == TRIAL
