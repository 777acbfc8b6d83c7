"""The improver's parts: leases, persisted jobs, the deploy verdict, the router choice, monitoring."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from chat import chat
from rich.console import Console

from trace_plugin.environments.base import RewardBreakdown
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.validation import levels
from trace_plugin.improver import GateFit, Improver, ImproverConfig, Verdict, judge, router_spec
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job
from trace_plugin.records.router_spec import CorpusEntry
from trace_plugin.records.trajectory import Episode, EpisodeEnd, new_id, utcnow
from trace_plugin.store import Store
from trace_plugin.store.lease import Lease, LeaseHeld
from training.config import ExpertTrainingConfig

HOLD = """
import sys, time
from trace_plugin.store import Store
from trace_plugin.store.lease import Lease
Lease(Store(sys.argv[1]), "improver:a", ttl=1.0).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_one_holder_at_a_time_and_a_killed_holder_frees_the_lease(db_url):
    store = Store(db_url)
    store.upgrade()
    child = subprocess.Popen([sys.executable, "-c", HOLD, db_url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld):
            Lease(store, "improver:a", ttl=1.0).acquire()
        other = Lease(store, "improver:b", ttl=1.0).acquire()  # other names are independent
        other.release()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while True:  # PostgreSQL frees it with the connection; SQLite once the lease lapses
            try:
                lease = Lease(store, "improver:a", ttl=1.0).acquire()
                break
            except LeaseHeld:
                assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
                time.sleep(0.2)
        time.sleep(1.5)  # a live holder keeps renewing: still held after its ttl
        with pytest.raises(LeaseHeld):
            Lease(store, "improver:a", ttl=1.0).acquire()
        lease.release()
        Lease(store, "improver:a").acquire().release()
    finally:
        child.kill()
        store.close()


def test_the_verdict_accepts_only_a_clear_improvement_without_regressions():
    capabilities = {"fmt": {"base": 0.1, "current": 0.1, "candidate": 0.6}}
    better = {
        "capabilities": capabilities,
        "target": {"current": {"success": 0.25}, "candidate": {"success": 0.4}},
    }
    assert judge(better, margin=0.05, tolerance=0.05) == Verdict(accept=True, reasons=[])
    same = {**better, "target": {"current": {"success": 0.25}, "candidate": {"success": 0.27}}}
    verdict = judge(same, margin=0.05, tolerance=0.05)
    assert not verdict.accept and "does not beat" in verdict.reasons[0]
    regress = {
        "capabilities": {**capabilities, "refusal": {"base": 0.5, "current": 0.8, "candidate": 0.7}},
        "target": better["target"],
    }
    verdict = judge(regress, margin=0.05, tolerance=0.05)
    assert not verdict.accept and verdict.reasons == ["refusal regresses: 0.70 against the live 0.80"]
    tie = {**better, "target": {"current": {"success": 0.25}, "candidate": {"success": 0.25}}}
    assert "does not beat" in judge(tie, margin=0.0, tolerance=0.05).reasons[0]  # its experts improved
    flat = {"capabilities": {"fmt": {"base": 0.3, "current": 0.3, "candidate": 0.3}}}
    assert judge(flat, margin=0.0, tolerance=0.05).reasons == ["no capability improved on its held-out seeds"]


def test_one_expert_takes_all_traffic_several_are_classified(sqlite_url):
    store = Store(sqlite_url)
    store.upgrade()
    assert router_spec({"fmt": "fmt@abc"}, store, "a").to_dict() == {"kind": "static", "adapter": "fmt"}
    two = {"fmt": "fmt@abc", "refusal": "refusal@def"}
    spec = router_spec(two, store, "a").to_dict()
    assert spec["kind"] == "classifier" and [e["adapter"] for e in spec["experts"]] == ["fmt", "refusal"]
    assert "retrieval" not in spec  # no corpus: hard top-1
    corpus = [CorpusEntry(capability="fmt", request="r", solution="s", embedding=[1.0])]
    spec = router_spec(two, store, "a", corpus, top_p=0.8).to_dict()
    assert spec["retrieval"]["top_p"] == 0.8 and spec["retrieval"]["corpus"][0]["capability"] == "fmt"
    with pytest.raises(ValueError, match="router must be one of"):
        ImproverConfig("a", "http://x", "/tmp", router="bogus")


async def test_where_the_candidate_router_chooses_none_the_live_deployment_routes(sqlite_url, monkeypatch):
    """The candidate holds the live experts, but its classifier's "none" once served the bare
    base model: now the live deployment's router decides there."""
    store = Store(sqlite_url)
    store.upgrade()
    improver = Improver(store, ImproverConfig("a", "http://127.0.0.1:9", store.url, router="top1"))

    async def loaded(experts):
        return {"fmt": "fmt@1", "refusal": "refusal@2"}

    monkeypatch.setattr(improver, "load_candidates", loaded)
    assert "fallback" not in (await improver.route({})).router.to_dict()  # nothing live: the base
    live = {"kind": "static", "adapter": "fmt"}
    store.make_live(Deployment("c1", "a", "live", adapters={"fmt": "fmt@1"}, router=live))
    router = (await improver.route({})).router.to_dict()
    assert router["kind"] == "classifier" and router["fallback"] == live
    store.close()


def test_the_few_shot_context_experts_train_behind_can_be_seen_and_set(sqlite_url):
    """It was inferred as the commonest context in traffic, with no setting to show or set
    it: on a suite whose traffic showed other examples, the expert copied their names."""
    store = Store(sqlite_url)
    store.upgrade()
    given = [
        {"role": "user", "content": "Convert 3 km."},
        {"role": "assistant", "content": "3 km is 1.86 mi."},
    ]
    assert Improver(store, ImproverConfig("a", "http://x", store.url)).examples() == []  # no traffic yet
    assert Improver(store, ImproverConfig("a", "http://x", store.url, examples=given)).examples() == given
    off = ImproverConfig("a", "http://x", store.url, examples=given, train_with_examples=False)
    assert Improver(store, off).examples() == []
    store.close()


@pytest.mark.parametrize(
    ("merge", "alone", "chosen"), [(0.5, 0.25, "top_p"), (0.25, 0.5, "top1"), (0.5, 0.5, "top1")]
)
async def test_the_gate_chooses_between_the_top_p_merge_and_one_expert_per_request(
    sqlite_url, monkeypatch, merge, alone, chosen
):
    """TRACE found that routing one expert per request beat every merge (a merge dilutes an
    expert by its weight): the gate's own tasks decide, a tie going to the one expert."""
    from trace_plugin.demo import router_label
    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.runner import EpisodeResult
    from trace_plugin.improver import Routing, evaluation

    store = Store(sqlite_url)
    store.upgrade()
    success = {"router:c2": merge, "router:c2-top1": alone, "base": 0.0}

    async def evaluator(model, seeds):
        return [EpisodeResult(s, "k", RewardBreakdown(float(i < success[model] * len(seeds))), "", "")
                for i, s in enumerate(seeds)]  # fmt: skip

    improver = Improver(
        store, ImproverConfig("a", "http://x", store.url, target_seeds=[1, 2, 3, 4]), evaluator=evaluator
    )
    registered = {}

    async def set_router(spec, *, name=None):
        registered[name] = spec.to_dict() if hasattr(spec, "to_dict") else spec

    async def loaded(experts):
        return {}

    monkeypatch.setattr(improver.gateway, "set_router", set_router)
    monkeypatch.setattr(improver, "load_candidates", loaded)
    corpus = [
        CorpusEntry(capability=c, request="r", solution="s", embedding=[1.0]) for c in ("fmt", "refusal")
    ]
    merged = router_spec({"fmt": "fmt@1", "refusal": "refusal@2"}, store, "a", corpus, top_p=0.9)
    scores = await evaluation.evaluate(improver, "c2", {}, Routing(merged))
    assert scores.compared == {"top_p": merge, "top1": alone}
    assert scores.target.candidate.success == max(merge, alone)
    top_p = scores.router.retrieval.top_p
    assert (top_p == 0.9) == (chosen == "top_p") and registered["c2"] == scores.router.to_dict()
    assert (
        router_label(scores.router.to_dict())
        == {"top_p": "classifier, top-p", "top1": "classifier, top-1"}[chosen]
    )
    # One expert merges nothing: no choice to make.
    assert evaluation.top1_variant(router_spec({"fmt": "fmt@1"}, store, "a")) is None
    store.close()


async def test_experts_are_scored_on_their_environments_asked_plainly(sqlite_url, monkeypatch):
    """Calibration eases an environment for the base model until its requests name the tools
    ("… Use find_user, get_order and cancel_order."); the held-out scores that decide a
    deployment were taken there, on a skill no user's request calls on. They are now taken
    on the same tasks asked plainly."""
    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.runner import EpisodeResult
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.improver import Routing, evaluation

    store = Store(sqlite_url)
    store.upgrade()
    plain = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    named = plain.model_copy(update={"difficulty": plain.difficulty.model_copy(update={"name_tools": 1.0})})
    improver = Improver(store, ImproverConfig("a", "http://x", store.url))
    played = []

    async def play(spec, model, seeds):
        played.append((model, spec))
        return [EpisodeResult(s, "k", RewardBreakdown(0.0), "", "") for s in seeds]

    async def loaded(experts):
        return {"write_completion": "write_completion@1"}

    async def set_router(spec, *, name=None):
        pass

    monkeypatch.setattr(improver.gateway, "set_router", set_router)
    monkeypatch.setattr(improver, "load_candidates", loaded)
    monkeypatch.setattr(improver, "live_model", lambda: asyncio.sleep(0, "base"))
    monkeypatch.setattr(improver, "spec", lambda capability, experts=None: named)
    monkeypatch.setattr(improver, "play_spec", play)
    await evaluation.evaluate(
        improver, "c1", {}, Routing(router_spec({"write_completion": "w@1"}, store, "a"))
    )
    assert [model for model, _ in played] == ["base", "write_completion@1"]
    for _, spec in played:
        assert spec.tasks == named.tasks and spec.difficulty.name_tools == 0.0
        assert not [t for s in range(8) if " Use " in (t := SpecEnv(spec).reset(s).prompt)]
    store.close()


def test_no_training_task_is_one_a_report_or_the_gate_measures(sqlite_url, tmp_path):
    """Leakage was checked against the gate's tasks only: requests phrased like the target's
    traffic may repeat a reported task, and a report would then measure what was trained."""
    from trace_plugin.environments.base import task_keys
    from trace_plugin.environments.retail import POLICY, TEST_SEEDS, TOOLS, RetailEnv
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.improver.stages import evaluated_task_keys

    store = Store(sqlite_url)
    store.upgrade()
    test = list(TEST_SEEDS)
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)
    config = ImproverConfig(
        "a", "http://x", tmp_path, target="retail", target_seeds=test[48:50], reported_seeds=test[:4]
    )
    keys = evaluated_task_keys(config, spec, store)
    assert task_keys(RetailEnv, test[:4]) <= keys and task_keys(RetailEnv, test[48:50]) <= keys
    assert not task_keys(RetailEnv, test[4:8]) & keys
    store.close()


def test_an_evaluated_task_is_kept_out_of_training_in_every_phrasing(sqlite_url, tmp_path):
    """The warm start plays requests without the tools named, GRPO climbs to levels that
    name them in half or none: the same held-out task asked another way was not excluded."""
    from trace_plugin.environments.base import task_keys
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.environments.validation import plainly_asked, training_forms
    from trace_plugin.improver.config import HELD_OUT_SEEDS
    from trace_plugin.improver.stages import evaluated_task_keys

    store = Store(sqlite_url)
    store.upgrade()
    plain = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    named = plain.model_copy(update={"difficulty": plain.difficulty.model_copy(update={"name_tools": 1.0})})
    config = ImproverConfig("a", "http://x", tmp_path, eval_seeds=4)
    keys = evaluated_task_keys(config, named, store)
    held_out = HELD_OUT_SEEDS[:4]
    asked_plainly = task_keys(lambda: SpecEnv(plainly_asked(named)), held_out)
    assert asked_plainly <= keys and asked_plainly - task_keys(lambda: SpecEnv(named), held_out)
    assert len(training_forms(named)) > 2
    store.close()


def test_jobs_and_deployments_are_stored_once_per_id(db_url):
    store = Store(db_url)
    store.upgrade()
    job = Job("a", "c1", "train", "fmt", inputs={"env": "fmt-env"})
    store.save_job(job)
    job.status, job.outputs, job.ended_at = "done", {"expert": "x"}, utcnow()
    store.save_job(job)
    [loaded] = store.jobs("a", "c1")
    assert loaded.id == "c1/train/fmt" and loaded.outputs == {"expert": "x"} and loaded.seconds is not None
    deployment = Deployment("c1", "a", "rejected", adapters={"fmt": "fmt@1"}, reasons=["worse"])
    store.save_deployment(deployment)
    deployment.status = "live"
    store.save_deployment(deployment)
    assert [(d.id, d.status) for d in store.deployments("a")] == [("c1", "live")]
    store.close()


def _episodes(store: Store, agent: str, successes: int, failures: int, start) -> None:
    records = []
    for i in range(successes + failures):
        episode = Episode(new_id(), agent, source="test", started_at=start + timedelta(seconds=i))
        ok = i < successes
        label = "success" if ok else "failure"
        records += [episode, EpisodeEnd(episode.id, "completed", reward=float(ok), label=label)]
    store.write(records)


def test_monitor_rolls_back_when_live_success_falls(sqlite_url, monkeypatch):
    store = Store(sqlite_url)
    store.upgrade()
    start = utcnow() - timedelta(hours=2)
    old = Deployment("c1", "a", "superseded", router={"kind": "static", "adapter": None}, created_at=start)
    new = Deployment(
        "c2", "a", "live", router={"kind": "static", "adapter": "fmt"}, created_at=start + timedelta(hours=1)
    )
    store.save_deployment(old)
    store.save_deployment(new)
    _episodes(store, "a", 8, 2, start + timedelta(minutes=1))  # 80% under the previous deployment
    config = ImproverConfig("a", "http://127.0.0.1:9", store.url, monitor_window=10, rollback_drop=0.1)
    improver = Improver(store, config)
    routers = []

    async def set_router(spec, *, name=None):
        routers.append(spec)

    monkeypatch.setattr(improver.gateway, "set_router", set_router)
    _episodes(store, "a", 8, 2, start + timedelta(hours=1, minutes=1))  # as good as before
    assert improver.monitor() is None and routers == []
    _episodes(store, "a", 0, 10, start + timedelta(hours=1, minutes=5))  # now 0% over the window
    restored = improver.monitor()
    assert restored is not None and restored.id == "c1" and routers == [old.router]
    statuses = {d.id: (d.status, d.reasons) for d in store.deployments("a")}
    assert statuses["c1"][0] == "live" and statuses["c2"][0] == "rolled_back"
    assert "fell below 0.80" in statuses["c2"][1][-1]
    assert improver.monitor() is None  # nothing older to fall back to


def _two_experts(store: Store, model_dir, root) -> dict[str, str]:
    """Two ready experts of synthesized retail capabilities (random adapters): capability -> id."""
    from trace_plugin.environments.retail import RetailEnv
    from trace_plugin.environments.synthesis import synthesize
    from training.lora import random_adapter

    experts = {}
    for i, capability in enumerate(("communicating_facts", "policy_refusal")):
        spec = synthesize(capability, RetailEnv.tools, system_prompt=RetailEnv.system_prompt)
        record = store.save_env_spec("a", spec, "validated", {})
        expert = Expert("a", capability, record.spec.name, record.version, "embedded", "", {}, status="ready")
        expert.adapter_path = str(random_adapter(model_dir, root / capability, seed=i))
        store.save_expert(expert)
        experts[capability] = expert.id
    return experts


@pytest.mark.slow
async def test_the_classifier_retrieves_from_reference_plays_and_routes_a_mixture(
    sqlite_url, embedded_backend, tmp_path
):
    """TRACE's router from the route stage: a corpus of each environment's reference plays,
    embedded through the real gateway, kept with its expert and pinned in the spec; a
    request of one environment retrieves that capability first, and the candidate router
    serves what it decides."""

    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.routing import router_from_spec
    from trace_plugin.gateway.server import start_in_thread
    from trace_plugin.records.expert import split_name
    from trace_plugin.records.mixture import Mixture

    store = Store(sqlite_url)
    store.upgrade()
    experts = _two_experts(store, embedded_backend.model_dir, tmp_path)
    config = GatewayConfig(adapter_root=tmp_path, agent="a", record=False)
    with start_in_thread(create_app(embedded_backend, config=config)) as gateway:
        improver = Improver(store, ImproverConfig("a", gateway.url, tmp_path, corpus_seeds=3))
        router = (await improver.route(experts)).router.to_dict()
        corpus = router["retrieval"]["corpus"]
        assert router["kind"] == "classifier" and router["retrieval"]["top_p"] == 0.9
        assert sorted(e["capability"] for e in corpus) == ["communicating_facts"] * 3 + ["policy_refusal"] * 3
        assert all(len(e["embedding"]) == 576 and "(" in e["solution"] for e in corpus)
        served = router_from_spec(router, embedded_backend)
        for capability in experts:
            request = SpecEnv(improver.spec(capability)).reset(77).prompt  # a task outside the corpus
            candidates = await served.candidates(request)
            assert candidates[0][0].name == capability
        await improver.gateway.set_router(router, name="cycle-1")
        r = chat(gateway.url, "router:cycle-1", request, max_tokens=2)
        assert r.status_code == 200, r.text
        decided, model = await served.route([{"role": "user", "content": request}], None), r.json()["model"]
        if decided:  # the gateway served the mixture the router decides, on the live versions
            assert [(split_name(n)[0], w) for n, w in Mixture.parse(model).weights] == list(decided.weights)
        else:
            assert model == embedded_backend.model_id
        top1 = Improver(store, ImproverConfig("a", gateway.url, tmp_path, router="top1"))
        assert "retrieval" not in (await top1.route(experts)).router.to_dict()
        # Each expert keeps its corpus: the next router reads it instead of playing and embedding again.
        kept = [entry.model_dump() for i in experts.values() for entry in store.expert(i).corpus]
        assert sorted(kept, key=json.dumps) == sorted(corpus, key=json.dumps)
        improver.gateway.embed = None  # type: ignore[assignment]  # not called again
        assert (await improver.route(experts)).router.to_dict() == router


@pytest.mark.slow
async def test_a_learned_gate_is_fitted_on_practice_tasks_and_served_as_a_candidate(
    sqlite_url, embedded_backend, tmp_path
):
    """Two experts: the route stage plays each choice on practice tasks (scripted here),
    embeds the requests through the real gateway, fits the gate, and the gateway takes it."""
    import httpx

    from trace_plugin.environments.retail import RetailEnv
    from trace_plugin.environments.runner import EpisodeResult
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    store = Store(sqlite_url)
    store.upgrade()
    experts = _two_experts(store, embedded_backend.model_dir, tmp_path)
    config = GatewayConfig(adapter_root=tmp_path, agent="a", record=False)
    with start_in_thread(create_app(embedded_backend, config=config)) as gateway:
        improver = Improver(
            store, ImproverConfig("a", gateway.url, tmp_path, router="gate", gate_seeds=6, eval_seeds=2)
        )

        async def scripted(spec, model, seeds):  # each expert wins its own environment's tasks
            won = model == spec.capability
            return [EpisodeResult(s, "k", RewardBreakdown(float(won), {}), "", "") for s in seeds]

        improver.play_spec = scripted
        routing = await improver.route(experts)
        router = routing.router.to_dict()
        assert router["kind"] == "gate" and router["choices"] == [
            None,
            "communicating_facts",
            "policy_refusal",
        ]
        assert routing.gate == GateFit(tasks=12, labels={"communicating_facts": 6, "policy_refusal": 6})
        # Fitted again outside a cycle (as bench/improvement.py does), from the ready experts' environments.
        again = await improver.learned_router(await improver.load_candidates(experts))
        assert again.router.to_dict() == router
        await improver.gateway.set_router(router, name="cycle-1")  # what the evaluate stage does
        served = httpx.get(f"{gateway.url}/v1/router", params={"name": "cycle-1"}).json()
        assert served == router
        facts = synthesize("communicating_facts", RetailEnv.tools, system_prompt=RetailEnv.system_prompt)
        request = SpecEnv(facts).reset(99).prompt
        r = chat(gateway.url, "router:cycle-1", request, max_tokens=2)
        assert r.status_code == 200
        # Served per layer (or plainly where the layers agree): its own expert has the largest share.
        pairs = [f"{pair}:1".split(":")[:2] for pair in r.json()["model"].split(";")[0].split(",")]
        assert max(pairs, key=lambda pair: float(pair[1]))[0].startswith("communicating_facts@")


def test_success_rates_per_period_come_from_one_query(db_url):
    """What the monitor and the triggers read: per deployment period, the labeled episodes
    and the successes among the latest of them (labels decide; else a reward of 1)."""
    store = Store(db_url)
    store.upgrade()
    start = utcnow() - timedelta(hours=2)
    _episodes(store, "a", 3, 1, start)  # before the first boundary: outside every period
    _episodes(store, "a", 8, 2, start + timedelta(minutes=30))  # the successes come first
    _episodes(store, "a", 1, 3, start + timedelta(hours=1))
    _episodes(store, "b", 5, 0, start + timedelta(hours=1))  # another agent
    unlabeled = Episode(new_id(), "a", source="test", started_at=start + timedelta(hours=1, minutes=9))
    by_reward = Episode(new_id(), "a", source="test", started_at=start + timedelta(hours=1, minutes=8))
    running = Episode(new_id(), "a", source="test", started_at=start + timedelta(hours=1, minutes=7))
    store.write(
        [
            unlabeled,
            EpisodeEnd(unlabeled.id, "completed"),
            by_reward,
            EpisodeEnd(by_reward.id, "completed", reward=1.0),
        ]
    )
    store.write([running])
    boundaries = [start + timedelta(minutes=20), start + timedelta(hours=1)]
    before, now = store.outcome_windows("a", boundaries, last=4)
    assert (before.labeled, before.recent, before.successes) == (
        10,
        4,
        2,
    )  # the latest 4: 2 of them succeeded
    assert (now.labeled, now.recent, now.successes) == (5, 4, 1)  # the reward-only success is the latest
    [everything] = store.outcome_windows("a", [None])
    assert (everything.labeled, everything.successes, everything.success_rate) == (19, 13, 13 / 19)
    assert store.outcome_windows("nobody", [None])[0].success_rate is None
    store.close()


def test_stage_outputs_survive_the_job_row():
    from trace_plugin.improver import Evaluation, Routing, Scores, Summary, TargetScores
    from trace_plugin.records.router_spec import StaticSpec

    summary = Summary(n=1, success=1.0, by_kind={"k": 1.0}, episodes=[{"seed": 1, "reward": 1.0}])
    evaluation = Evaluation(
        adapters={"fmt": "fmt@1"},
        router=StaticSpec(adapter="fmt"),
        capabilities={"fmt": Scores(base=0.1, current=0.1, candidate=0.5)},
        target=TargetScores(current=summary, candidate=summary),
    )
    stored = evaluation.to_dict()
    assert stored["router"] == {"kind": "static", "adapter": "fmt"} and stored["target"]["current"]["n"] == 1
    assert Evaluation.from_dict(stored) == evaluation
    assert "target" not in Evaluation({}, StaticSpec(), {}).to_dict()
    routing = Routing(router=StaticSpec(adapter=None), gate=GateFit(tasks=2, labels={"base": 2}))
    assert Routing.from_dict(routing.to_dict()) == routing
    assert Routing(StaticSpec()).to_dict() == {"router": {"kind": "static", "adapter": None}}


def test_an_adapter_with_nan_weights_never_reaches_the_verdict(sqlite_url, tmp_path, monkeypatch):
    """A diverged run's adapter (NaN weights) went on to be routed and judged; the gateway
    would refuse to load it. The improver runs the gateway's check first, and says why."""
    import numpy as np
    from support.backends import lora_dir

    from trace_plugin.improver import Mined, Screened, Synthesized, Trained, stages

    store = Store(sqlite_url)
    store.upgrade()
    improver = Improver(store, ImproverConfig("a", "http://127.0.0.1:9", store.url))
    monkeypatch.setattr(stages, "mine", lambda _: Mined(selected=["fmt"], covered=[], train=["fmt"]))

    async def synthesized(capability):
        return Synthesized(env=f"{capability}-env", version=1, status="validated")

    async def screened(env):
        return Screened("base", 0.0, 0.0, True)

    adapter = tmp_path / "fmt" / "e1"
    lora_dir(adapter, 2, {"m.q": (np.ones((2, 3), np.float32), np.full((4, 2), np.nan, np.float32))})
    monkeypatch.setattr(improver, "synthesize", synthesized)
    monkeypatch.setattr(improver, "screen", screened)
    monkeypatch.setattr(stages, "train", lambda *_: Trained("e1", str(adapter), [0.5], [0.5]))

    async def routed(experts):
        raise AssertionError("an adapter that cannot serve is not routed")

    monkeypatch.setattr(improver, "route", routed)
    end = improver.run_cycle()
    assert end.deployed is None and "NaN or Inf" in end.reason and "NaN or Inf" in end.passed_over["fmt"]


def test_an_expert_no_gradient_reached_is_not_evaluated(sqlite_url, monkeypatch):
    """A no-op adapter is the base model: the cycle skips it, and ends when nothing is left."""
    from trace_plugin.improver import Mined, Screened, Synthesized, Trained, stages

    store = Store(sqlite_url)
    store.upgrade()
    said = Console(file=io.StringIO(), width=200)
    improver = Improver(store, ImproverConfig("a", "http://127.0.0.1:9", store.url), console=said)
    monkeypatch.setattr(stages, "mine", lambda _: Mined(selected=["fmt"], covered=[], train=["fmt"]))

    async def synthesized(capability):
        return Synthesized(env=f"{capability}-env", version=1, status="validated")

    async def screened(env):
        return Screened("base", 0.0, 0.0, True)

    monkeypatch.setattr(improver, "synthesize", synthesized)
    monkeypatch.setattr(improver, "screen", screened)
    noop = Trained("e1", "/adapters/fmt/e1", [0.0], [0.0], noop=True)
    monkeypatch.setattr(stages, "train", lambda *_: noop)

    async def routed(experts):
        raise AssertionError("a cycle of no-op experts routes nothing")

    monkeypatch.setattr(improver, "route", routed)
    assert improver.run_once() is None
    # run_once returns None for a rejection too: it says which this was.
    assert "no deployment: no gradient reached the adapters of ['fmt']" in said.file.getvalue()
    [cycle] = [j for j in store.jobs("a") if j.stage == "cycle"]
    assert cycle.outputs == {
        "deployed": None,
        "reason": "no gradient reached the adapters of ['fmt']",
        "trained": {"fmt": noop.to_dict()},
        "live_scores": {"fmt": 0.0},
        "passed_over": {},
    }
    assert (
        Trained.from_dict(noop.to_dict()) == noop
        and not Trained.from_dict({**noop.to_dict(), "noop": False}).noop
    )


def _selecting(
    store: Store, monkeypatch, names: list[str], *, unsynthesizable: str = "", **config: Any
) -> tuple[Improver, list]:
    """An improver (at most one expert a cycle) whose mining selects ``names``, each given a
    retail environment but ``unsynthesizable``, and whose training records the capability it
    was given and moves no weight: which capabilities a cycle trains is what is tested."""
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.improver import Mined, Trained, stages
    from trace_plugin.records.capability import Capability
    from trace_plugin.records.env_spec import SpecError

    store.save_capabilities("a", [Capability(n, n, "detector", True, {}, mining_run="r1") for n in names])
    settings = {"calibrate": False, "max_experts": 1, **config}
    monkeypatch.setattr(stages, "mine", lambda _: Mined(selected=names, covered=[], train=names))

    async def prepare(store, agent, capability, **_):
        if capability.name == unsynthesizable:
            raise SpecError(f"the target's tools offer nothing to exercise {unsynthesizable!r} with")
        report = {"capability": {"name": capability.name, "mining_run": capability.mining_run}}
        return store.save_env_spec(
            agent, synthesize(capability.name, TOOLS, system_prompt=POLICY), "validated", report
        )

    trained: list[str] = []

    def train(improver, cycle, capability, env):
        trained.append(capability)
        return Trained("e1", "/adapters/e1", [0.0], [0.0], noop=True)

    monkeypatch.setattr(stages, "prepare_environment", prepare)
    monkeypatch.setattr(stages, "train", train)
    return Improver(store, ImproverConfig("a", "http://127.0.0.1:9", store.url, **settings)), trained


def test_max_capabilities_caps_the_experts_over_all_cycles_but_not_a_retrain(sqlite_url, monkeypatch):
    """The headline's preset trains three experts in all over two cycles of two: a cycle
    trains a new capability only while the agent's ready experts cover fewer than
    ``max_capabilities``, and retraining a covered one adds none."""
    from trace_plugin.improver import CycleEnd, Screened

    store = Store(sqlite_url)
    store.upgrade()
    for capability in ("tool_call_format", "write_completion"):
        store.save_expert(Expert("a", capability, f"{capability}-env", 1, "embedded", "", {}, status="ready"))
    names = ["argument_grounding", "write_completion", "policy_refusal"]
    improver, trained = _selecting(store, monkeypatch, names, max_experts=2, max_capabilities=2)

    async def screened(env):
        return Screened("base", 0.0, 0.0, True)

    monkeypatch.setattr(improver, "screen", screened)
    improver.run_once()
    assert trained == ["write_completion"]  # covered: a retrain; the two others are new
    end = CycleEnd.from_dict(next(j for j in store.jobs("a") if j.stage == "cycle").outputs)
    assert "more than 2 capabilities" in end.passed_over["argument_grounding"]
    assert "more than 2 capabilities" in end.passed_over["policy_refusal"]


def test_a_capability_no_environment_can_exercise_is_passed_over_and_the_next_one_trains(
    sqlite_url, monkeypatch
):
    """Synthesis that finds nothing to exercise a capability with (a SpecError) no longer
    ends the cycle, nor takes one of its ``max_experts`` places: that capability is recorded
    as unsynthesizable, with the reason, and the next selected one is synthesized and trained,
    up to ``max_experts`` of them."""
    from trace_plugin.improver import Screened, Synthesized

    store = Store(sqlite_url)
    store.upgrade()
    names = ["communicating_facts", "tool_call_format", "argument_grounding"]
    improver, trained = _selecting(store, monkeypatch, names, unsynthesizable="communicating_facts")

    async def screened(env):  # the live agent fails every environment
        return Screened("base", 0.0, 0.0, True)

    monkeypatch.setattr(improver, "screen", screened)
    assert improver.run_once() is None
    assert trained == ["tool_call_format"]
    jobs = {(j.stage, j.key): j for j in store.jobs("a")}
    skipped = Synthesized.from_dict(jobs["synthesize", "communicating_facts"].outputs)
    assert skipped.status == "unsynthesizable" and "nothing to exercise" in skipped.reason
    assert (
        jobs["cycle", "all"].outputs["reason"] == "no gradient reached the adapters of ['tool_call_format']"
    )


def test_a_capability_the_live_agent_already_solves_is_not_trained_and_frees_its_place(
    sqlite_url, monkeypatch
):
    """Cycle 2 once trained environments the live cycle-1 expert already scored 1.00 on:
    selection read the base model's old failures and never asked the agent as it serves now.
    Each new environment is played by the live deployment, under its own router name, before
    training; one it solves frees its place for the next, and the cycle reports both scores."""
    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.runner import EpisodeResult
    from trace_plugin.improver import CycleEnd, Screened

    store = Store(sqlite_url)
    store.upgrade()
    store.make_live(Deployment("c1", "a", "live", adapters={}, router={"kind": "static", "adapter": "x"}))
    names = ["policy_refusal", "multi_step_completion", "communicating_facts"]
    improver, trained = _selecting(store, monkeypatch, names)
    registered, played, levels_played = {}, [], []

    async def set_router(spec, *, name=None):
        registered[name] = spec

    async def play(spec, model, seeds):  # the live agent solves refusals only
        played.append((spec.capability, model))
        levels_played.append(spec)
        solved = spec.capability == "policy_refusal"
        return [EpisodeResult(s, "k", RewardBreakdown(float(solved)), "", "") for s in seeds]

    monkeypatch.setattr(improver.gateway, "set_router", set_router)
    monkeypatch.setattr(improver, "play_spec", play)
    assert improver.run_once() is None
    assert trained == ["multi_step_completion"]
    assert played == [("policy_refusal", "router:c1"), ("multi_step_completion", "router:c1")]
    assert registered == {"c1": {"kind": "static", "adapter": "x"}}  # by its own name, not "default"
    # At the environment's hardest level, not the one calibration eased for the base model
    # (a headline's live expert passed eased writes tickets and skipped the writes it failed).
    stored = [store.env_spec(f"{c}-env", 1).spec for c, _ in played]
    assert levels_played == [levels(spec)[0][-1] for spec in stored]
    assert all(played != spec for played, spec in zip(levels_played, stored, strict=True))
    jobs = {(j.stage, j.key): j for j in store.jobs("a")}
    assert Screened.from_dict(jobs["screen", "policy_refusal"].outputs) == Screened(
        "router:c1", 1.0, 1.0, False
    )
    end = CycleEnd.from_dict(jobs["cycle", "all"].outputs)
    assert end.live_scores == {"policy_refusal": 1.0, "multi_step_completion": 0.0}
    assert "already succeeds 1.00" in end.passed_over["policy_refusal"]
    # A resumed cycle makes the same choices: the screen is a job, read back, not played again.
    played.clear()
    jobs["cycle", "all"].status = "running"
    store.save_job(jobs["cycle", "all"])
    improver.run_once()
    assert played == [] and trained == ["multi_step_completion"]


def test_each_cycle_mines_the_traffic_its_live_deployment_served(db_url):
    """Failures an earlier cycle already answered are not mined again: once a deployment is
    live, the improver mines only the traffic it served, and finds the next deficit there."""
    from trace_plugin.environments.planted import corpus
    from trace_plugin.improver import stages

    store = Store(db_url)
    store.upgrade()

    def traffic(policies: tuple[str, ...], seeds: range, start) -> None:
        episodes = corpus(list(seeds), policies)
        for i, e in enumerate(episodes):
            e.started_at = start + timedelta(seconds=i)
        store.write([r for e in episodes for r in (e, *e.steps)])

    improver = Improver(store, ImproverConfig("planted", "http://127.0.0.1:9", store.url, max_experts=1))
    before = utcnow() - timedelta(hours=1)
    traffic(("competent", "invents_ids"), range(40), before)
    first = stages.mine(improver)
    assert first.selected == ["argument_grounding"] and first.train == ["argument_grounding"]

    store.make_live(Deployment("c1", "planted", "live", adapters={"argument_grounding": "ag@1"}))
    assert stages.mine(improver).selected == []  # nothing served by c1 yet
    traffic(("competent", "withholds_facts"), range(40, 80), utcnow() + timedelta(seconds=1))
    second = stages.mine(improver)
    assert "communicating_facts" in second.selected and "argument_grounding" not in second.selected
    # All of them, best first: the cycle trains up to max_experts, passing over any it cannot.
    assert second.train == second.selected and second.covered == ["argument_grounding"]


def test_a_deployed_candidate_is_measured_once_on_the_target(sqlite_url, monkeypatch):
    """The cycle's evaluation played the candidate on the target's tasks; once it is live,
    that is the live deployment's measurement, and the next cycle does not play it again."""
    from trace_plugin.improver import (
        Deployed,
        Evaluation,
        Mined,
        Routing,
        Screened,
        Summary,
        Synthesized,
        TargetScores,
        Trained,
        stages,
    )
    from trace_plugin.improver import evaluation as evaluation_module
    from trace_plugin.records.router_spec import StaticSpec

    store = Store(sqlite_url)
    store.upgrade()
    played: list[str] = []

    async def evaluator(model, seeds):
        played.append(model)
        return []

    config = ImproverConfig("a", "http://127.0.0.1:9", store.url, target_seeds=[1, 2])
    improver = Improver(store, config, evaluator=evaluator)
    monkeypatch.setattr(stages, "mine", lambda _: Mined(selected=["fmt"], covered=[], train=["fmt"]))

    async def synthesized(capability):
        return Synthesized(env="fmt-env", version=1, status="validated")

    async def routed(experts):
        return Routing(StaticSpec(adapter="fmt@1"))

    base = Summary(n=2, success=0.0, by_kind={"lookup": 0.0}, episodes=[])
    better = Summary(n=2, success=1.0, by_kind={"lookup": 1.0}, episodes=[])

    async def screened(env):
        return Screened("base", 0.0, 0.0, True)

    async def evaluated(improver, cycle, experts, routing):
        return Evaluation({"fmt": "fmt@1"}, routing.router, {}, TargetScores(current=base, candidate=better))

    async def deployed(deployment):
        store.make_live(deployment)
        return Deployed(deployment.id)

    monkeypatch.setattr(improver, "synthesize", synthesized)
    monkeypatch.setattr(improver, "screen", screened)
    monkeypatch.setattr(stages, "train", lambda *_: Trained("e1", "/adapters/fmt/e1", [0.0], [0.0]))
    monkeypatch.setattr(improver, "route", routed)
    monkeypatch.setattr(evaluation_module, "evaluate", evaluated)
    monkeypatch.setattr(improver, "deploy", deployed)
    deployment = improver.run_once()
    assert deployment is not None and improver.live().id == deployment.id
    assert asyncio.run(improver.live_summary()) == better and played == []


def test_a_restarted_gateway_is_given_the_live_deployment_again(sqlite_url, monkeypatch):
    """A gateway starts on the base model: restore loads the live adapters, then its router."""
    from trace_plugin.improver import DeployError

    store = Store(sqlite_url)
    store.upgrade()
    improver = Improver(store, ImproverConfig("a", "http://127.0.0.1:9", store.url))
    calls: list[tuple] = []

    async def ensure_adapter(name, path):
        calls.append(("load", name, path))

    async def set_router(spec, *, name=None):
        calls.append(("route", spec))

    monkeypatch.setattr(improver.gateway, "ensure_adapter", ensure_adapter)
    monkeypatch.setattr(improver.gateway, "set_router", set_router)
    assert asyncio.run(improver.restore()) is None and calls == []  # nothing live: the base model

    expert = Expert("a", "fmt", "fmt-env", 1, "embedded", "", {}, status="ready")
    expert.adapter_path = "/adapters/fmt/e1"
    store.save_expert(expert)
    router = {"kind": "static", "adapter": expert.adapter_name}
    store.make_live(Deployment("c1", "a", "live", adapters={"fmt": expert.adapter_name}, router=router))
    assert asyncio.run(improver.restore()).id == "c1"
    assert calls == [("load", expert.adapter_name, "/adapters/fmt/e1"), ("route", router)]

    store.make_live(Deployment("c2", "a", "live", adapters={"fmt": "gone@1"}, router=router))
    with pytest.raises(DeployError, match="gone@1"):
        asyncio.run(improver.restore())


def test_a_relative_adapter_root_is_made_absolute(tmp_path, monkeypatch):
    """Experts are loaded by their stored path; a relative one would be resolved under the
    gateway's own adapter root and not found."""
    monkeypatch.chdir(tmp_path)
    config = ImproverConfig("a", "http://127.0.0.1:9", "adapters")
    assert config.adapter_root == tmp_path.resolve() / "adapters"


def test_transfer_compares_base_and_expert_on_the_tasks_whose_capability_the_base_lacked(sqlite_url):
    """``lacking_transfer`` reads each base episode's detector labels: an expert is judged on
    the tasks where its capability was LACKING, not on all of them."""
    from trace_plugin.environments.planted import corpus
    from trace_plugin.improver.evaluation import lacking_transfer
    from trace_plugin.mining.detectors import Trajectory
    from trace_plugin.mining.kinds import label_episode
    from trace_plugin.mining.selection import Label

    store = Store(sqlite_url)
    store.upgrade()
    episodes = corpus(list(range(6)), ("competent", "invents_ids"))
    for e in episodes:
        e.agent = "eval:a"
    store.write([r for e in episodes for r in (e, *e.steps)])
    summary = [{"episode_id": e.id, "reward": e.reward} for e in episodes]
    lacking = [
        i
        for i, e in enumerate(episodes)
        if label_episode(Trajectory.from_episode(e))["argument_grounding"] is Label.LACKING
    ]
    assert 0 < len(lacking) < len(episodes)
    expert = [1.0 if i in lacking else 0.0 for i in range(len(episodes))]  # right exactly there
    [row] = lacking_transfer(store, summary, {"argument_grounding": expert}, "eval:a").values()
    assert row == {"tasks": len(lacking), "base": 0.0, "expert": 1.0}


def test_an_expert_trains_with_the_reply_length_and_horizon_its_environment_needs(
    sqlite_url, tmp_path, monkeypatch
):
    """Not the preset's fixed guesses: the stage derives them from the environment, as
    calibration and held-out play do (``evaluation.reply_tokens``, ``episode_turns``): the
    target's stated horizon, never fewer turns than its longest reference play takes (a
    preset of 3 once cut off the target's 4- and 5-turn writes). What ``training`` sets is
    honoured, not silently replaced."""
    from trace_plugin.environments.interpreter import reply_budget, turn_budget
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.synthesis import synthesize
    from trace_plugin.improver import Synthesized, stages
    from trace_plugin.model_files import load_tokenizer

    (tmp_path / "short_target.py").write_text(
        "from trace_plugin.environments.base import Target\n"
        "from trace_plugin.environments.retail import RetailEnv\n"
        "SHORT = Target('short', RetailEnv, [1, 2], max_turns=1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    store = Store(sqlite_url)
    store.upgrade()
    spec = synthesize("multi_step_completion", TOOLS, system_prompt=POLICY)
    record = store.save_env_spec("a", spec, "validated", {})
    env = Synthesized(env=spec.name, version=record.version, status="validated")
    needed = turn_budget(spec)
    assert 1 < needed < 6

    class Captured(Exception):
        pass

    def trained_with(**options) -> dict:
        jobs: list = []

        class Capture:
            def run(self, given: list) -> list:
                jobs.extend(given)
                raise Captured

        improver = Improver(
            store, ImproverConfig("a", "http://127.0.0.1:9", tmp_path, **options), executor=Capture()
        )
        with pytest.raises(Captured):
            stages.train(improver, "c1", "multi_step_completion", env)
        return jobs[0].config

    derived = trained_with(target="retail")
    assert derived["max_completion_length"] == reply_budget(spec, load_tokenizer())
    assert derived["max_turns"] == 6  # retail's stated horizon
    assert trained_with(target="short_target:SHORT")["max_turns"] == needed  # never below the plays
    pinned = trained_with(target="retail", training={"max_completion_length": 48, "max_turns": 2})
    assert (pinned["max_completion_length"], pinned["max_turns"]) == (48, 2)
    config = ImproverConfig("a", "http://x", tmp_path, training=ExpertTrainingConfig(max_turns=4))
    assert config.pinned == {"max_turns"}
