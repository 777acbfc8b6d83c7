"""The dashboard on a real store: pages, filters, the episode view, escaping, read-only,
then the same pages in a real headless Chromium."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from support.dashboards import IMG, SCRIPT, T0, Corpus, artifacts, navigate, seed

from trace_plugin import Store
from trace_plugin.dashboard import create_dashboard
from trace_plugin.gateway.server import RunningServer, start_in_thread
from trace_plugin.records.trajectory import Episode, EpisodeEnd, new_episode_id, new_id


def count(html: str) -> int:
    found = re.search(r'<span id="count">(\d+)</span>', html)
    assert found, html[:2000]
    return int(found.group(1))


@pytest.fixture
def corpus(sqlite_url: str) -> Iterator[Corpus]:
    c = seed(sqlite_url)
    yield c
    c.store.close()


@pytest.fixture
def client(corpus: Corpus) -> TestClient:
    return TestClient(create_dashboard(corpus.store))


FILTER_COUNTS = [
    ({}, 9),
    ({"agent": "alpha"}, 6),
    ({"agent": "beta"}, 2),
    ({"outcome": "success"}, 4),  # a1, a3 (label beats reward 0.5), a6, b1
    ({"outcome": "failure"}, 4),  # a2, a5 (label), b2, x (feedback)
    ({"outcome": "unknown"}, 1),
    ({"source": "gateway"}, 3),
    ({"adapter": "billing@2"}, 2),
    ({"status": "error"}, 1),
    ({"since": "2026-03-02T00:00"}, 5),
    ({"until": "2026-03-02T00:00"}, 4),
    ({"since": "2026-03-01T02:00", "until": "2026-03-01T04:00"}, 2),  # a2, b1: until is exclusive
    ({"since": "2026-03-02T01:00+01:00"}, 5),  # a zone given is honoured
    ({"agent": "alpha", "outcome": "failure"}, 2),
    ({"agent": "alpha", "outcome": "success", "source": "gateway"}, 1),
    ({"agent": "", "outcome": "", "since": ""}, 9),  # empty form fields filter nothing
]


def test_filters_and_buckets_on_both_dialects(db_url: str) -> None:
    c = seed(db_url)
    client = TestClient(create_dashboard(c.store))
    for params, expected in FILTER_COUNTS:
        response = client.get("/episodes", params=params)
        assert response.status_code == 200
        assert count(response.text) == expected, params
        assert response.text.count('class="episode-row"') == expected

    # Day buckets per agent: alpha 1/2, 1/1 (a4 has no outcome), 1/2; beta 1/1, 0/1; mallory 0/1.
    html = client.get("/success", params={"bucket": "day"}).text
    assert html.count('<circle class="point"') == 6
    rows = re.findall(r"<tr><td>(\w+)</td><td>([\d\- :]+)</td><td class=\"num\">(\d+)</td>\s*"
                      r"<td class=\"num\">(\d+)</td>", html)  # fmt: skip
    assert rows == [
        ("alpha", "2026-03-01 00:00", "2", "1"),
        ("alpha", "2026-03-02 00:00", "1", "1"),
        ("alpha", "2026-03-03 00:00", "2", "1"),
        ("beta", "2026-03-01 00:00", "1", "1"),
        ("beta", "2026-03-02 00:00", "1", "0"),
        ("mallory", "2026-03-01 00:00", "1", "0"),
    ]
    assert client.get("/success", params={"bucket": "hour"}).text.count('<circle class="point"') == 8
    hours = client.get("/success", params={"bucket": "hour", "agent": "alpha", "since": "2026-03-02T00:00"})
    assert hours.text.count('<circle class="point"') == 3

    page = client.get(f"/episodes/{c.ids['a3']}").text
    assert "get_order" in page and "Order O-1 has shipped." in page
    assert "argument_grounding" in client.get("/capabilities").text
    c.store.close()


def test_pagination_keeps_the_filters(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.upgrade()
    store.write([Episode(new_id(), "many", started_at=T0 + timedelta(minutes=i)) for i in range(120)])
    store.write([Episode(new_id(), "other", started_at=T0)])
    client = TestClient(create_dashboard(store))
    first = client.get("/episodes", params={"agent": "many"}).text
    assert count(first) == 120 and first.count('class="episode-row"') == 50
    assert 'href="/episodes?agent=many&amp;page=2"' in first and 'id="prev"' not in first
    last = client.get("/episodes", params={"agent": "many", "page": 3}).text
    assert last.count('class="episode-row"') == 20 and "page 3 of 3" in last and 'id="next"' not in last
    assert 'href="/episodes?agent=many&amp;page=2"' in last
    # Newest first across pages: the last row of the last page is the oldest episode.
    assert last.rstrip().count("2026-03-01 00:00:00") == 1
    store.close()


def test_episodes_minted_in_one_moment_stay_apart_on_the_page(sqlite_url: str) -> None:
    """Episode ids begin with their timestamp: the list shows their ends, which differ."""
    store = Store(sqlite_url)
    store.upgrade()
    ids = [new_episode_id() for _ in range(3)]
    store.write([Episode(i, "burst", started_at=T0) for i in ids])
    page = TestClient(create_dashboard(store)).get("/episodes", params={"agent": "burst"}).text
    shown = re.findall(r'<a href="/episodes/[^"]+"><code>([^<]+)</code>', page)
    assert sorted(shown) == sorted(i[-12:] for i in ids) and len(set(shown)) == 3
    store.close()


def test_episode_view_shows_conversation_tool_calls_errors_and_feedback(client: TestClient, corpus: Corpus):
    html = client.get(f"/episodes/{corpus.ids['b2']}").text
    assert 'id="reward">0.00<' in html and 'class="badge failure"' in html
    assert "ValueError: boom" in html
    # The conversation: system, user, the assistant's call with its arguments, the result, the answer.
    assert [m for m in re.findall(r'<div class="msg (\w+)">', html)] == [
        "system", "user", "assistant", "tool", "assistant"
    ]  # fmt: skip
    assert "calls <code>get_order</code>" in html and "&#34;order_id&#34;: &#34;O-1&#34;" in html
    # The tool step with its arguments and (JSON) result, pretty-printed.
    assert re.search(r'<pre class="tool-args">\{\s+&#34;order_id&#34;: &#34;O-1&#34;', html)
    assert re.search(r'<pre class="tool-result">\{\s+&#34;status&#34;: &#34;shipped&#34;', html)
    assert "3.5 ms" in html

    feedback = client.get(f"/episodes/{corpus.ids['x']}").text
    assert '<table id="feedback">' in feedback and "<td>user</td>" in feedback

    missing = client.get("/episodes/no-such-episode")
    assert missing.status_code == 404 and "no episode no-such-episode" in missing.text


def test_captured_script_renders_inert(client: TestClient, corpus: Corpus) -> None:
    escaped = "&lt;script&gt;window.__pwned = 1&lt;/script&gt;"
    html = client.get(f"/episodes/{corpus.ids['x']}").text
    assert "<script" not in html and "<img" not in html
    assert re.search(rf'<div class="msg user">\s*<div class="role">user</div>\s*<pre>{escaped}</pre>', html)
    assert re.search(rf'<pre class="tool-args">.*?&#34;note&#34;: &#34;{re.escape(escaped)}&#34;', html, re.S)
    assert f'<pre class="tool-result">{escaped}&lt;img src=x onerror=&#34;window.__pwned = 2&#34;&gt;' in html
    assert f'<pre class="error" id="episode-error">failed on {escaped}</pre>' in html
    assert f"bad {escaped}" in html  # the feedback comment
    assert "<script" not in client.get("/episodes", params={"agent": "mallory"}).text
    # Defence in depth: no script may run even if escaping failed.
    assert "default-src 'none'" in client.get("/episodes").headers["content-security-policy"]


def test_success_plot_draws_points_and_deployment_markers(client: TestClient, corpus: Corpus) -> None:
    html = client.get("/success", params={"bucket": "day"}).text
    assert '<svg id="success-plot"' in html and "<polyline" in html
    assert "alpha · 2026-03-01 UTC · 1/2 = 50%" in html
    assert '<g class="marker">' not in html  # nothing deployed yet

    from trace_plugin.records.deployment import Deployment

    def at(day: str) -> datetime:
        return datetime.fromisoformat(f"{day}T00:00:00+00:00")

    for deployment in (
        Deployment(f"c1 {SCRIPT}", "alpha", "superseded", created_at=at("2026-03-02")),
        Deployment("c2", "alpha", "rejected", created_at=at("2026-03-02")),  # never took traffic
        Deployment("c3", "beta", "live", created_at=at("2026-03-02")),
        Deployment("c4", "alpha", "live", created_at=at("2027-01-01")),  # after the plotted range
    ):
        corpus.store.save_deployment(deployment)
    html = client.get("/success", params={"agent": "alpha"}).text
    assert html.count('<g class="marker">') == 1  # beta's is another agent's; c4 is outside the range
    assert "c1 &lt;script&gt;" in html and "<script" not in html and "(superseded)" in html
    assert html.count("<li>") == 2  # both of alpha's deployments that took traffic are listed
    assert client.get("/success").text.count('<g class="marker">') == 2
    # The hook for later stages: the capabilities page shows the table once it exists.
    assert '<h2 class="stage" id="stage-deployments">' in client.get("/capabilities").text


def test_capabilities_page(client: TestClient, corpus: Corpus) -> None:
    html = client.get("/capabilities").text
    rows = html.split('<tr class="capability')[1:]
    assert len(rows) == 2
    assert " selected" in rows[0].split(">")[0] and "argument_grounding" in rows[0]
    assert '<td class="num">0.50</td>' in rows[0] and '<td class="num">+0.42</td>' in rows[0]
    assert '<td class="num">9/10</td>' in rows[0]
    assert (
        f'href="/episodes/{corpus.ids["a2"]}"' in rows[0]
        and f'href="/episodes/{corpus.ids["a5"]}"' in rows[0]
    )
    assert "termination" in rows[1] and '<td class="num">-0.10</td>' in rows[1] and "selected" not in rows[1]
    assert client.get(f"/episodes/{corpus.ids['a5']}").status_code == 200
    assert "Nothing mined yet" in client.get("/capabilities", params={"agent": "beta"}).text


LOOPBACK = ("127.0.0.1", 50000)


def _api_routes(routes: Any) -> Any:
    """Every APIRoute, inside the routers the app includes too."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _api_routes(inner.routes)
        elif isinstance(route, APIRoute):
            yield route


def test_read_only_and_admin_token(corpus: Corpus) -> None:
    app = create_dashboard(corpus.store, admin_token="s3cret")
    routes = list(_api_routes(app.routes))
    assert len(routes) >= 7 and {m for r in routes for m in r.methods} == {"GET", "HEAD"}
    client = TestClient(app, client=LOOPBACK)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert client.request(method, "/episodes").status_code == 403
        for wrong in ("Bearer nope", "Bearer s3cr\u00e9t".encode("latin-1"), "s3cret"):
            assert client.request(method, "/episodes", headers={"Authorization": wrong}).status_code == 403
        # The token passes the guard; nothing mutates, so there is no such route.
        assert (
            client.request(method, "/episodes", headers={"Authorization": "Bearer s3cret"}).status_code == 405
        )
    # Without a token configured, nothing but reads ever gets through.
    assert TestClient(create_dashboard(corpus.store)).post("/episodes").status_code == 403
    assert client.get("/episodes").status_code == 200


def test_beyond_loopback_every_page_needs_the_token(corpus: Corpus) -> None:
    """Exports are raw episodes, and the dashboard had no token: with one set, a client
    beyond loopback gets nothing without it; a browser gives it once as ``?token=`` and
    keeps it in an HTTP-only, same-site cookie."""
    app = create_dashboard(corpus.store, admin_token="s3cret")
    remote = TestClient(app, client=("203.0.113.9", 50000))
    export = f"/export/trl/{corpus.ids['a5']}"
    for path in ("/episodes", f"/episodes/{corpus.ids['a5']}", export, "/nowhere"):
        refused = remote.get(path)
        assert refused.status_code == 401 and "token" in refused.text, path
        assert refused.headers["content-security-policy"]  # refusals carry the security headers
    assert remote.get(export, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert remote.get(export, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    first = remote.get("/episodes", params={"token": "s3cret"})
    assert first.status_code == 200
    cookie = first.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert remote.get(export).status_code == 200  # the cookie carries it from now on
    assert TestClient(app, client=LOOPBACK).get(export).status_code == 200  # loopback as before


def test_the_cli_refuses_to_serve_beyond_loopback_without_a_token(tmp_path) -> None:
    from typer.testing import CliRunner

    from trace_plugin.cli import app as cli

    db = f"sqlite:///{tmp_path / 'd.db'}"
    for args, needle in ((["--host", "0.0.0.0"], "give --token"), (["--token", " "], "blank token")):
        result = CliRunner().invoke(cli, ["dashboard", *args, "--db", db])
        assert result.exit_code == 2 and needle in result.output, result.output


def test_bad_filter_values_are_400_pages(client: TestClient) -> None:
    for params in ({"outcome": "maybe"}, {"since": "yesterday"}, {"status": "<script>"}):
        response = client.get("/episodes", params=params)
        assert response.status_code == 400 and "<h1>400</h1>" in response.text
    assert client.get("/success", params={"bucket": "week"}).status_code == 400
    assert client.get("/").url.path == "/episodes"


# -- a real browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Corpus]]:
    corpus = seed(f"sqlite:///{tmp_path_factory.mktemp('dash') / 'trace.db'}")
    with start_in_thread(create_dashboard(corpus.store)) as server:
        yield server, corpus
    corpus.store.close()


def test_browser_episodes_filter_and_episode(browser: Any, served: tuple[RunningServer, Corpus]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    server, corpus = served
    browser.get(f"{server.url}/episodes")
    assert browser.find_element(By.ID, "count").text == "9"
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.episode-row")) == 9

    Select(browser.find_element(By.ID, "f-agent")).select_by_visible_text("alpha")
    Select(browser.find_element(By.ID, "f-outcome")).select_by_visible_text("failure")
    navigate(browser, browser.find_element(By.ID, "f-apply"))
    assert browser.find_element(By.ID, "count").text == "2"
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.episode-row")
    assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in rows] == ["alpha", "alpha"]
    assert Select(browser.find_element(By.ID, "f-agent")).first_selected_option.text == "alpha"

    navigate(browser, rows[0].find_element(By.TAG_NAME, "a"))  # the newest: a5
    assert browser.find_element(By.ID, "episode-id").text == corpus.ids["a5"]
    assert "calls get_order" in browser.find_element(By.CSS_SELECTOR, ".tool-call").text
    assert '"status": "shipped"' in browser.find_element(By.CSS_SELECTOR, ".tool-result").text
    browser.save_screenshot(str(artifacts() / "dashboard-episode.png"))


def test_browser_keeps_captured_script_inert(browser: Any, served: tuple[RunningServer, Corpus]) -> None:
    from selenium.webdriver.common.by import By

    server, corpus = served
    browser.get(f"{server.url}/episodes/{corpus.ids['x']}")
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user pre").text == SCRIPT
    assert SCRIPT in browser.find_element(By.CSS_SELECTOR, ".tool-args").text
    assert browser.find_element(By.CSS_SELECTOR, ".tool-result").text == SCRIPT + IMG
    assert browser.find_elements(By.TAG_NAME, "script") == []
    assert browser.find_elements(By.TAG_NAME, "img") == []
    assert browser.execute_script("return window.__pwned === undefined")
    browser.save_screenshot(str(artifacts() / "dashboard-escaping.png"))


def test_browser_success_plot_draws(browser: Any, served: tuple[RunningServer, Corpus]) -> None:
    from selenium.webdriver.common.by import By

    server, _ = served
    browser.get(f"{server.url}/success?bucket=day")
    plot = browser.find_element(By.ID, "success-plot")
    assert plot.size["width"] > 500 and plot.size["height"] > 200
    points = plot.find_elements(By.CSS_SELECTOR, "circle.point")
    assert len(points) == 6 and all(p.size["width"] > 0 for p in points)
    assert len(plot.find_elements(By.TAG_NAME, "polyline")) == 2  # alpha and beta; mallory has one point
    # Points lie inside the plot, at y for their rate: alpha's 50% points share a height.
    ys = [
        float(p.get_attribute("cy"))
        for p in plot.find_elements(By.CSS_SELECTOR, '[data-agent="alpha"] circle')
    ]
    assert ys[0] == ys[2] > ys[1]
    browser.save_screenshot(str(artifacts() / "dashboard-success.png"))
    browser.get(f"{server.url}/capabilities")
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.capability")) == 2
    browser.save_screenshot(str(artifacts() / "dashboard-capabilities.png"))


def test_the_automatic_bucket_fits_the_datas_time_range(db_url: str) -> None:
    """A one-hour run is not one daily dot: the default bucket is the finest that keeps the
    range within MAX_BUCKETS, so before and after a deployment can be told apart."""
    store = Store(db_url)
    store.upgrade()

    def run(at: datetime, reward: float) -> None:
        episode = Episode(new_id(), "run", started_at=at)
        store.write([episode, EpisodeEnd(episode.id, "completed", reward=reward)])

    start = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)
    for minute in range(0, 60, 5):  # an hour of traffic, failing first, then succeeding
        run(start + timedelta(minutes=minute), float(minute >= 30))
    client = TestClient(create_dashboard(store))
    html = client.get("/success").text
    assert "(one per minute)" in html and html.count('<circle class="point"') == 12
    assert "(one per hour)" in client.get("/success", params={"bucket": "hour"}).text
    run(start + timedelta(days=30), 1.0)
    assert "(one per day)" in client.get("/success").text  # a month of data: days
    assert "(one per minute)" in client.get("/success", params={"until": "2026-03-02T00:00"}).text
    store.close()


def test_one_episode_filter_serves_the_store_and_the_dashboard(sqlite_url) -> None:
    """There were two over one table: the store's took time bounds as UTC, the dashboard's
    did not, and only the dashboard's knew the "unknown" outcome. One does both."""
    from datetime import timedelta as td

    from trace_plugin.dashboard import queries
    from trace_plugin.store.store import EpisodeFilter

    corpus = seed(sqlite_url)
    assert queries.EpisodeFilter is EpisodeFilter
    alpha = [e.id for e in corpus.store.iter_episodes(EpisodeFilter("alpha", outcome="unknown"))]
    assert sorted(alpha) == sorted([corpus.ids["a4"]])  # no reward, no label: unknown
    # A naive bound is UTC; the same instant in another zone selects the same episodes.
    start = T0 + td(hours=26)
    naive = EpisodeFilter("alpha", since=start.replace(tzinfo=None))
    zoned = EpisodeFilter("alpha", since=start.astimezone(timezone(td(hours=-5))))
    engine = corpus.store.engine
    assert queries.count_episodes(engine, naive) == queries.count_episodes(engine, zoned) == 4
    corpus.store.close()
