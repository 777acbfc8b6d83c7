"""The Improver page on a store real improver cycles wrote, on both stores, then in a real
headless Chromium: one row per cycle, each expert's training curves, each deployment with
the episodes it served (the episode list's router-version filter), escaping and the CSP.

The cycles run the real Improver (mining, synthesis with calibration, the job ledger,
routing, the verdict, canary deployment and the monitor's promotion and rollback) with
only the model's work scripted: the gateway is an in-memory stand-in, training returns
fixed curves, and the plays score by who played.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.dashboards import (
    IMG,
    SCRIPT,
    artifacts,
    assert_secured,
    encoded,
    extras,
    navigate,
    times,
    values,
)

from trace_plugin.dashboard import create_dashboard, improver_page
from trace_plugin.environments.base import RewardBreakdown
from trace_plugin.environments.planted import corpus
from trace_plugin.environments.retail import TOOLS
from trace_plugin.environments.runner import EpisodeResult
from trace_plugin.gateway.server import RunningServer, start_in_thread
from trace_plugin.improver import Improver, ImproverConfig, stages
from trace_plugin.recorder import Recorder
from trace_plugin.records.router_spec import StaticSpec, router_version
from trace_plugin.records.trajectory import Episode, EpisodeEnd, new_id, utcnow
from trace_plugin.store import Store

AGENT = f"support {SCRIPT}"  # every page that names the agent must keep this inert
REWARD = [0.1, 0.3, 0.2, 0.6, 0.7]
UNHINTED = [0.0, None, 0.25, 0.5, 0.5]
FAILURE = f"CUDA out of memory {SCRIPT}{IMG}"  # a training job's error, shown as it was raised


class Gateway:
    """The gateway's admin API as the improver uses it, in memory."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.routers: dict[str | None, dict[str, Any]] = {}

    async def adapters(self) -> set[str]:
        return set(self.loaded)

    async def ensure_adapter(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def router(self, name: str | None = None) -> dict[str, Any] | None:
        return self.routers.get(name)

    async def set_router(self, spec: Any, *, name: str | None = None) -> None:
        self.routers[name] = spec if isinstance(spec, dict) else spec.to_dict()


@dataclass
class TrainingResult:
    """What ``training.executors`` hands back, as much of it as the train stage reads."""

    adapter_dir: Path
    adapter_sha256: str
    reward_curve: list[float]
    unhinted_curve: list[float | None]
    base_model: str
    base_model_sha256: str
    reference_plays: int = 3  # of the 4 its config allowed
    level_reached: int | None = None
    informative_group_frac: float | None = None


class Executor:
    """Training with fixed curves, and an adapter a gradient reached (so it is evaluated)."""

    fail = False

    def run(self, jobs: list[Any]) -> list[TrainingResult]:
        import torch
        from safetensors.torch import save_file

        if self.fail:
            raise RuntimeError(FAILURE)
        [job] = jobs
        out = Path(job.config["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        save_file({"layer.lora_B.weight": torch.ones(1, 1)}, str(out / "adapter_model.safetensors"))
        return [TrainingResult(out, "a" * 64, REWARD, UNHINTED, "embedded", "b" * 64)]


@dataclass
class Improved:
    """A store after five cycles; the cycle ids and router versions of their deployments."""

    store: Store
    cycles: list[str]
    versions: dict[str, str]  # deployment id -> router version
    served: dict[str, int | None]  # deployment id -> the episodes it served; None: never out


def _traffic(store: Store, policies: tuple[str, ...], seeds: range, start: datetime) -> None:
    """The agent's recorded runs, with the tool schemas it was given (what synthesis reads),
    spread from ``start`` to now."""
    episodes = corpus(list(seeds), policies)
    gap = (utcnow() - start) / (len(episodes) + 1)
    for i, e in enumerate(episodes, 1):
        e.agent, e.started_at = AGENT, start + gap * i
        for step in e.steps:
            step.tools = list(TOOLS) if step.kind == "llm" else step.tools
    store.write([r for e in episodes for r in (e, *e.steps)])


def _served(store: Store, router: dict[str, Any], successes: int, failures: int, start: datetime) -> None:
    """Episodes a router served, spread from ``start`` to now, with their rewards."""
    records: list[Any] = []
    gap = (utcnow() - start) / (successes + failures + 1)
    for i in range(successes + failures):
        episode = Episode(new_id(), AGENT, source="gateway", router=router_version(router),
                          started_at=start + gap * (i + 1))  # fmt: skip
        ok = i < successes
        records += [episode, EpisodeEnd(episode.id, "completed", reward=float(ok))]
    store.write(records)


def improve(url: str, root: Path) -> Improved:
    """Five cycles: a canary promoted, a canary rolled back, a candidate the verdict
    rejected, a canary still on trial, and one whose training failed."""
    store = Store(url)
    store.upgrade()
    _traffic(store, ("competent", "invents_ids"), range(40), utcnow() - timedelta(hours=1))
    executor, target = Executor(), {"candidate": 0.5}

    async def evaluator(model: str, seeds: list[int]) -> list[EpisodeResult]:
        """The target's tasks: the base model solves a quarter, a candidate what it is set to."""
        success = target["candidate"] if model.startswith("router:") else 0.25
        return [EpisodeResult(s, "lookup", RewardBreakdown(float(i < success * len(seeds))), "", "")
                for i, s in enumerate(seeds)]  # fmt: skip

    async def play(spec: Any, model: str, seeds: list[int]) -> list[EpisodeResult]:
        reward = 0.9 if "@" in model else 0.2  # an expert; the base model and the live router fail
        return [EpisodeResult(s, "k", RewardBreakdown(reward), "", "") for s in seeds]

    flips = itertools.cycle((0.0, 1.0))  # every calibration group informative, mean 0.5: in band

    async def calibration_play(env: Any, seed: int) -> float:
        return next(flips)

    recorder = Recorder(url)
    config = ImproverConfig(
        AGENT, "http://127.0.0.1:9", root, max_experts=1, target_seeds=[1, 2, 3, 4], eval_seeds=2,
        calibration_seeds=2, canary=0.25, monitor_window=4, rollback_drop=0.1, router="top1",
        train_with_examples=False,
        training={"num_generations": 2, "rollout_budget": 10, "warm_start_plays": 4},
    )  # fmt: skip
    improver = Improver(store, config, executor=executor, evaluator=evaluator, recorder=recorder)
    improver.gateway = Gateway()  # type: ignore[assignment]
    improver.play_spec = play  # type: ignore[method-assign]
    base = StaticSpec().to_dict()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "chat_player", lambda *_, **__: calibration_play)
        first = improver.run_cycle().deployed
        assert first is not None and improver.canary().id == first
        trial = improver.canary()
        _served(store, trial.router, 4, 0, trial.updated_at)
        _served(store, base, 2, 2, trial.updated_at)
        assert improver.monitor().id == first  # promoted: it beat the rest
        # New failures while it is live, before the next trial: what the next cycles mine.
        _traffic(store, ("competent", "withholds_facts"), range(40, 80), improver.live().updated_at)

        target["candidate"] = 0.75  # the live one's measurement is its own 0.5
        second = improver.run_cycle().deployed
        assert second is not None
        trial = improver.canary()
        _served(store, trial.router, 0, 4, trial.updated_at)
        _served(store, improver.live().router, 4, 0, trial.updated_at)
        assert improver.monitor().id == first  # rolled back to the live one

        target["candidate"] = 0.25  # worse than the live deployment on the target
        third = improver.run_cycle()
        assert third.deployed is None and "does not beat" in (third.reason or "")

        target["candidate"] = 1.0
        fourth = improver.run_cycle().deployed
        assert fourth is not None
        trial = improver.canary()
        _served(store, trial.router, 1, 2, trial.updated_at)
        _served(store, improver.live().router, 6, 3, trial.updated_at)

        executor.fail = True
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            improver.run_cycle()
    recorder.close(timeout=10)
    recorder.store.close()
    cycles = [j.cycle for j in store.jobs(AGENT) if j.stage == "cycle"]
    deployments = store.deployments(AGENT)
    versions = {d.id: router_version(d.router) for d in deployments}
    assert cycles[:2] == [first, second] and cycles[3] == fourth and len(cycles) == 5
    # The first served its trial, then the rest beside the next two trials. The second and
    # the fourth are of the same capabilities, so of one router version: each its own time.
    served = {first: 4 + 4 + 9, second: 4, cycles[2]: None, fourth: 3}
    assert versions[second] == versions[fourth] != versions[first]
    return Improved(store, cycles, versions, served)


def _rows(html: str, cls: str) -> list[str]:
    """Each ``<tr class="CLS"`` row's markup, in page order."""
    return [row.split("</tr>")[0] for row in html.split(f'<tr class="{cls}"')[1:]]


@pytest.mark.slow  # five improver cycles
def test_the_improver_page_shows_cycles_experts_and_deployments(db_url: str, tmp_path: Path) -> None:
    improved = improve(db_url, tmp_path / "adapters")
    store, cycles = improved.store, improved.cycles
    client = TestClient(create_dashboard(store))
    response = client.get("/improver")
    assert response.status_code == 200
    assert_secured(response)
    html = response.text
    assert "<script" not in html and "<img" not in html  # the agent's name and the error, escaped
    assert f'<option value="{AGENT.replace("<", "&lt;").replace(">", "&gt;")}" selected>' in html

    # One row per cycle, newest first: mined (with Cov and Δ), synthesized, trained, composed, verdict.
    rows = _rows(html, "cycle")
    assert [re.search(r'data-cycle="([^"]+)"', r).group(1) for r in rows] == cycles[::-1]
    failed, fourth, rejected, rolled_back, promoted = rows
    assert "argument_grounding" in promoted and "Cov 1.00 · Δ +1.00" in promoted
    # The next deficit, mined from the traffic the promoted deployment served.
    assert re.search(
        r"<strong>communicating_facts</strong>\s*<span class=\"muted\">Cov 1.00 · Δ \+0\.\d\d", rolled_back
    )
    assert re.search(
        r"<code>multi_step_completion-env</code> v\d+ <span class=\"badge success\">validated", fourth
    )
    assert "band 0.15–0.70, mean 0.50" in promoted and "learnable: mean reward 0.50" in promoted
    assert re.search(r'<a href="#expert-\w+"><code>argument_grounding@\w{8}</code></a>', promoted)
    assert re.search(r"5 steps · 10 rollouts\s+· 3 reference plays", promoted)  # used, not the most allowed
    assert "live agent 0.00" in promoted and "not trained" not in promoted  # the screen let it train
    version = improved.versions[cycles[0]]
    assert "static over argument_grounding" in promoted and f"<code>{version}</code>" in promoted
    assert '<span class="badge success">accepted</span>' in promoted
    assert f'deployed <a href="#deployment-{cycles[0]}">' in promoted
    # What became of each deployment, beside the cycle that made it.
    assert re.search(r'deployed <a [^>]+><code>[^<]+</code></a>\s*<span class="badge success">live', promoted)
    assert re.search(
        r'deployed <a [^>]+><code>[^<]+</code></a>\s*<span class="badge failure">rolled_back', rolled_back
    )
    assert re.search(r'deployed <a [^>]+><code>[^<]+</code></a>\s*<span class="badge unknown">canary', fourth)
    assert '<span class="badge failure">rejected</span>' in rejected and "does not beat" in rejected
    assert "train multi_step_completion failed" in failed and "(attempt 1)" in failed
    assert "CUDA out of memory &lt;script&gt;window.__pwned = 1&lt;/script&gt;&lt;img src=x" in failed
    assert '<span class="badge unknown">running</span>' in failed

    # Each expert's curves: reward at every step, the un-hinted reward where a step had one.
    experts = store.experts(AGENT)
    assert html.count('<div class="expert"') == len(experts) == 5
    for expert in experts[:4]:
        assert f'<svg id="curve-{expert.id}"' in html
    assert experts[4].status == "failed" and "No training step recorded yet." in html
    curve = html.split(f'<svg id="curve-{experts[0].id}"')[1].split("</svg>")[0]
    reward, unhinted = curve.split('<g class="series"')[1:]
    assert 'data-curve="reward"' in reward and reward.count('<circle class="point"') == len(REWARD)
    assert 'data-curve="un-hinted reward"' in unhinted and unhinted.count('<circle class="point"') == 4
    assert "un-hinted reward · step 3 · 0.250" in unhinted and "step 2 ·" not in unhinted

    # Each deployment: its status, a canary's share, before and after on the target, its episodes.
    deployments = {re.search(r'id="deployment-([^"]+)"', r).group(1): r for r in _rows(html, "deployment")}
    assert list(deployments) == [cycles[3], cycles[2], cycles[1], cycles[0]]
    assert (
        '<span class="badge success">live</span> <span class="badge success">promoted</span>'
        in (deployments[cycles[0]])
    )
    assert '<span class="badge failure">rolled_back</span>' in deployments[cycles[1]]
    assert "below" in deployments[cycles[1]] and "promoted" not in deployments[cycles[1]]
    assert '<span class="badge failure">rejected</span>' in deployments[cycles[2]]
    canary = deployments[cycles[3]]
    assert '<span class="badge unknown">canary</span>' in canary
    assert "3 of 12 routed episodes (25%) since it went out, sent 25%" in canary
    # What the page reads: each canary's trial as the improver recorded it, not its reasons' words.
    trials = {d.id: d.canary for d in improved.store.deployments(AGENT)}
    assert trials[cycles[0]] == {"share": 0.25, "outcome": "promoted"}
    assert trials[cycles[1]] == {"share": 0.25, "outcome": "rolled_back"}
    assert trials[cycles[2]] is None and trials[cycles[3]] == {"share": 0.25}
    for cycle, before_after in zip(cycles, ("25% → <strong>50%", "50% → <strong>75%", "50% → <strong>25%",
                                            "50% → <strong>100%"), strict=False):  # fmt: skip
        assert before_after in deployments[cycle] and "(4 tasks)" in deployments[cycle], cycle
    assert "argument_grounding: 0.20 → 0.20 → <strong>0.90</strong>" in deployments[cycles[0]]

    # The link to the episodes a deployment served: the episode list by router version, from
    # when it was recorded until it ended.
    for deployment, served in improved.served.items():
        row = deployments[deployment]
        if served is None:
            assert "never took traffic" in row and 'class="served"' not in row
            continue
        link = re.search(r'<a class="served" href="([^"]+)">(\d+) episodes?</a>', row)
        assert link is not None and int(link.group(2)) == served, deployment
        href = unescape(link.group(1))
        query = parse_qs(urlsplit(href).query)
        assert query["agent"] == [AGENT] and query["router"] == [improved.versions[deployment]]
        assert ("until" in query) == (deployment == cycles[1])  # the rolled back one ended
        listed = client.get(href).text
        assert re.search(r'<span id="count">(\d+)</span>', listed).group(1) == str(served), deployment
        assert listed.count(f"<code>{improved.versions[deployment]}</code>") == served
    store.close()


def test_the_improver_page_without_an_improver_and_for_another_agent(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.upgrade()
    client = TestClient(create_dashboard(store))
    html = client.get("/improver").text
    assert 'id="nothing-improved"' in html and '<a href="/improver" class="on">Improver</a>' in html
    other = client.get("/improver", params={"agent": SCRIPT}).text
    assert "No cycle recorded for &lt;script&gt;" in other and "<script" not in other
    bad = client.get("/improver", params={"agent": "a\x00"})
    assert bad.status_code == 400 and "<h1>400</h1>" in bad.text
    assert client.get("/episodes", params={"router": "a\x00"}).status_code == 400
    store.close()


def test_stage_outputs_this_version_cannot_read_leave_their_stage_missing(sqlite_url: str) -> None:
    """The page reads each job's outputs as its stage's typed output: a job written by another
    version (a key missing, a router kind unknown here) shows its stage as missing, and a
    router it cannot parse still shows its kind and version, never a broken page."""
    from trace_plugin.records.job import Job

    store = Store(sqlite_url)
    store.upgrade()
    unknown = {"kind": "orchestrator", "experts": ["a@1"]}
    for stage, key, outputs in [
        ("mine", "all", {"selected": ["fmt"]}),  # no "covered" nor "train"
        ("synthesize", "fmt", {"env": "fmt-env", "version": 1, "status": "validated"}),
        ("train", "fmt", {"adapter": "/x"}),  # no expert id nor curve
        ("route", "all", {"router": unknown}),
        ("verdict", "all", {"accept": True, "reasons": ["ok"]}),
        ("cycle", "all", {"reason": "not yet"}),  # no "deployed"
    ]:
        job = Job("a", "c1", stage, key)
        job.status, job.outputs = "done", outputs
        store.save_job(job)
    html = TestClient(create_dashboard(store)).get("/improver", params={"agent": "a"}).text
    assert "fmt-env" in html and "orchestrator" in html and router_version(unknown) in html
    [cycle] = improver_page.cycles(store, "a")
    assert cycle.mined is None and cycle.trained == [] and cycle.accept is True
    assert cycle.composed is not None and cycle.composed.adapters == []
    assert cycle.ended_because is None and cycle.deployed is None
    store.close()


# -- one store shared: generated queries, and a real browser ---------------------------------------


@pytest.fixture(scope="module")
def improved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Improved]:
    """Five cycles on a SQLite file, only read by the tests that share it."""
    root = tmp_path_factory.mktemp("improver")
    improved = improve(f"sqlite:///{root / 'trace.db'}", root / "adapters")
    yield improved
    improved.store.close()


@pytest.fixture(scope="module")
def served(improved: Improved) -> Iterator[tuple[RunningServer, Improved]]:
    with start_in_thread(create_dashboard(improved.store)) as server:
        yield server, improved


@st.composite
def improver_queries(draw: st.DrawFn, improved: Improved) -> str:
    """The two routes' parameters with the store's own values, some replaced by any other."""
    valid = {
        "agent": st.sampled_from([AGENT, "alpha"]),
        "router": st.sampled_from(sorted(improved.versions.values())),
        "since": times,
        "until": times,
    }
    params = draw(st.fixed_dictionaries({}, optional=valid))
    for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=2, unique=True)):
        params[key] = draw(values)
    return "&".join(encoded(params) + draw(extras))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), method=st.sampled_from(["GET", "HEAD"]))
def test_generated_query_strings_on_the_improvers_store_never_get_a_5xx(
    improved: Improved, data: st.DataObject, method: str
) -> None:
    """The Improver page answers a page or a 400, never a 5xx, and the episode list by any
    router version the store holds is a page too."""
    client = TestClient(create_dashboard(improved.store), raise_server_exceptions=False)
    query = data.draw(improver_queries(improved))
    for route in ("/improver", "/episodes"):
        response = client.request(method, f"{route}?{query}")
        assert response.status_code in (200, 400), (method, route, query, response.text[:500])
        assert_secured(response)


@pytest.mark.slow
def test_browser_improver_page_and_its_router_filter(
    browser: Any,  # noqa: F811  (the fixture)
    served: tuple[RunningServer, Improved],
) -> None:
    from selenium.webdriver.common.by import By

    server, improved = served
    browser.get(f"{server.url}/episodes")
    navigate(browser, browser.find_element(By.LINK_TEXT, "Improver"))
    assert browser.execute_script("return window.__pwned === undefined")
    assert (
        browser.find_elements(By.TAG_NAME, "script") == [] and browser.find_elements(By.TAG_NAME, "img") == []
    )
    cycles = browser.find_elements(By.CSS_SELECTOR, "tr.cycle")
    assert [c.get_attribute("data-cycle") for c in cycles] == improved.cycles[::-1]
    assert FAILURE in cycles[0].find_element(By.CSS_SELECTOR, ".failed-job pre").text
    assert browser.find_element(By.ID, "f-agent").text.strip() == AGENT  # the option's text, as written

    plots = browser.find_elements(By.CSS_SELECTOR, ".expert svg")
    assert len(plots) == 4 and all(p.size["width"] > 400 and p.size["height"] > 150 for p in plots)
    points = plots[0].find_elements(By.CSS_SELECTOR, '[data-curve="reward"] circle.point')
    ys = [float(p.get_attribute("cy")) for p in points]
    assert len(ys) == 5 and ys[4] < ys[3] < ys[1] < ys[2] < ys[0]  # higher reward, higher on the plot
    assert len(plots[0].find_elements(By.TAG_NAME, "polyline")) == 2
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, height + 160)  # the whole page: the window's frame takes some
    browser.save_screenshot(str(artifacts() / "dashboard-improver.png"))  # docs/improver.png is a copy

    canary = browser.find_element(By.ID, f"deployment-{improved.cycles[3]}")
    assert "3 of 12 routed episodes (25%)" in canary.find_element(By.CSS_SELECTOR, ".share").text
    navigate(browser, canary.find_element(By.CSS_SELECTOR, "a.served"))
    version = improved.versions[improved.cycles[3]]
    assert browser.find_element(By.ID, "count").text == "3"
    assert browser.find_element(By.ID, "f-router").get_attribute("value") == version
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.episode-row")
    assert len(rows) == 3 and {r.find_elements(By.TAG_NAME, "td")[9].text for r in rows} == {version}

    # The filter by hand, on its own: the live deployment's version typed in.
    navigate(browser, browser.find_element(By.LINK_TEXT, "clear"))
    assert browser.find_element(By.ID, "f-router").get_attribute("value") == ""
    browser.find_element(By.ID, "f-router").send_keys(improved.versions[improved.cycles[0]])
    navigate(browser, browser.find_element(By.ID, "f-apply"))
    assert browser.find_element(By.ID, "count").text == str(improved.served[improved.cycles[0]])
    assert browser.execute_script("return window.__pwned === undefined")
    browser.set_window_size(1280, 1000)
