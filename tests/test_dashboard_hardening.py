"""The dashboard against hostile requests, on both stores: values no database can take are
400 pages, every answer carries the security headers (the guard's 403 and a crash's 500
too), HEAD answers as GET does without the body, and generated query strings on every route
never get a 5xx."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from support.dashboards import (
    KEYS,
    VALID,
    Corpus,
    assert_secured,
    encoded,
    extras,
    quoted,
    seed,
    values,
)

from trace_plugin.dashboard import create_dashboard
from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.app import MAX_PAGE, SECURITY_HEADERS
from trace_plugin.gateway.server import start_in_thread


@pytest.fixture
def dashboard(db_url: str) -> Iterator[tuple[TestClient, Corpus]]:
    """The seeded dashboard on each store; a crash is a 500 answer here, not an exception."""
    corpus = seed(db_url)
    yield TestClient(create_dashboard(corpus.store), raise_server_exceptions=False), corpus
    corpus.store.close()


def assert_error_page(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.url, response.text[:500])
    assert response.headers["content-type"].startswith("text/html")
    assert f"<h1>{status}</h1>" in response.text
    assert_secured(response)


BAD_VALUES = [
    "/episodes?page=99999999999999999999999",  # past a 64-bit OFFSET: SQLite and PostgreSQL raised
    f"/episodes?page={MAX_PAGE + 1}",
    "/episodes?page=0",
    "/episodes?page=-99999999999999999999",
    "/episodes?page=" + "9" * 5000,
    "/episodes?page=two",
    "/episodes?agent=%00",  # PostgreSQL text cannot hold a NUL: it raised
    "/episodes?source=a%00b",
    "/episodes?adapter=%00",
    "/episodes?router=%00",
    "/success?agent=%00",
    "/capabilities?agent=%00",
    "/capabilities?agent=alpha&run=%00",
    "/improver?agent=%00",
    "/episodes?since=0001-01-01T00:00%2B01:00",  # in UTC before year 1
    "/success?until=9999-12-31T23:59-01:00",  # in UTC after year 9999
]


@pytest.mark.parametrize("url", BAD_VALUES)
def test_values_no_database_can_take_are_400_pages(dashboard: tuple[TestClient, Corpus], url: str) -> None:
    client, _ = dashboard
    assert_error_page(client.get(url), 400)


def test_the_last_page_the_bound_allows_is_served(dashboard: tuple[TestClient, Corpus]) -> None:
    client, _ = dashboard
    last = client.get("/episodes", params={"page": MAX_PAGE})
    assert last.status_code == 200 and 'class="episode-row"' not in last.text
    assert f'href="/episodes?page={MAX_PAGE - 1}"' in last.text  # back towards the data


def test_every_answer_carries_the_security_headers(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = seed(sqlite_url)
    app = create_dashboard(corpus.store, admin_token="s3cret")
    client = TestClient(app, raise_server_exceptions=False, client=("127.0.0.1", 50000))
    assert_error_page(client.post("/episodes"), 403)  # the guard refuses before any route runs
    remote = TestClient(app, raise_server_exceptions=False)  # "testclient": not loopback
    assert_error_page(remote.get("/episodes"), 401)
    assert_error_page(client.request("OPTIONS", "/episodes"), 403)
    not_allowed = client.post("/episodes", headers={"Authorization": "Bearer s3cret"})
    assert_error_page(not_allowed, 405)
    assert set(not_allowed.headers["allow"].split(", ")) == {"GET", "HEAD"}
    assert_error_page(client.get("/nowhere"), 404)
    assert_error_page(client.get("/episodes/no-such-episode"), 404)
    assert_error_page(client.get("/success", params={"bucket": "week"}), 400)
    redirect = client.get("/", follow_redirects=False)
    assert redirect.status_code == 307
    assert_secured(redirect)

    def fail(*_: object, **__: object) -> int:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(q, "count_episodes", fail)
    crashed = client.get("/episodes")
    assert_error_page(crashed, 500)
    assert "went away" not in crashed.text  # the log has the details, not the page
    corpus.store.close()


def test_head_answers_as_get_does_without_the_body(sqlite_url: str) -> None:
    corpus = seed(sqlite_url)
    app = create_dashboard(corpus.store)
    client = TestClient(app)
    paths = ["/", "/episodes?agent=alpha", f"/episodes/{corpus.ids['a3']}", "/episodes/missing",
             "/success?bucket=day", "/capabilities", "/improver", "/episodes?page=0",
             f"/export/trl/{corpus.ids['a3']}"]  # fmt: skip
    for path in paths:
        got = client.get(path, follow_redirects=False)
        head = client.head(path, follow_redirects=False)
        assert (head.status_code, head.content) == (got.status_code, b""), path
        for name in ("content-type", "content-length", "location", *SECURITY_HEADERS):
            assert head.headers.get(name) == got.headers.get(name), (path, name)

    # Through the real server: the headers, then nothing.
    with start_in_thread(app) as server, socket.create_connection((server.host, server.port), 10) as s:
        s.sendall(b"HEAD /episodes HTTP/1.1\r\nHost: dashboard\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    header, _, body = answer.partition(b"\r\n\r\n")
    assert header.startswith(b"HTTP/1.1 200") and b"content-security-policy" in header.lower()
    assert body == b""
    corpus.store.close()


# -- generated query strings -------------------------------------------------------------------

# {real} is a stored episode's id, {any} a generated one.
ROUTES = ["/", "/episodes", "/success", "/capabilities", "/improver", "/episodes/{real}", "/episodes/{any}",
          "/export/trl/{real}", "/export/openai/{any}", "/export/{any}/{real}", "/nowhere"]  # fmt: skip


@st.composite
def queries(draw: st.DrawFn) -> str:
    """Values the routes take, some replaced by any other, then the extras."""
    params = draw(st.fixed_dictionaries({}, optional=VALID))
    for key in draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)):
        params[key] = draw(values)
    return "&".join(encoded(params) + draw(extras))


@settings(
    max_examples=75,
    deadline=None,
    # The fixture's store is only read, so sharing it between examples is what is wanted.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    query=queries(),
    method=st.sampled_from(["GET", "HEAD", "POST"]),
    episode_id=st.text(st.characters(exclude_categories=["Co"]), max_size=16),  # surrogates, CR, LF too
    body=st.binary(max_size=16) | st.sampled_from([b"\xed\xa0\x80", b'{"x": "\\ud800"}\r\n']),
)
@example(query="page=99999999999999999999999", method="GET", episode_id="", body=b"")  # 500s before the fix
@example(query="agent=%00", method="GET", episode_id="", body=b"")
@example(query="agent=%ED%A0%80", method="GET", episode_id="\ud800\r\n", body=b"\xed\xa0\x80")
def test_generated_query_strings_never_get_a_5xx(
    dashboard: tuple[TestClient, Corpus], query: str, method: str, episode_id: str, body: bytes
) -> None:
    """Each query string (and body) goes to every route."""
    client, corpus = dashboard
    for route in ROUTES:
        path = route.format(real=corpus.ids["a3"], any=quoted(episode_id))
        response = client.request(method, f"{path}?{query}", content=body, follow_redirects=False)
        event(f"{route} {response.status_code}")  # --hypothesis-show-statistics: what the examples reached
        assert response.status_code < 500, (method, path, query, response.text[:500])
        assert_secured(response)


def test_exports_take_the_id_exactly_as_linked_and_refuse_a_blank_format(db_url: str) -> None:
    """``/export/%20/ID`` answered 200 with ``ID.None.jsonl``, ``/export/trl/%20pad%20``
    served the episode ``pad`` (the id was stripped), and ids holding CR or LF could not be
    reached. A redacted export is offered beside each raw one."""
    from support.dashboards import dashboard_episode

    corpus = seed(db_url)
    for key in ("pad", " pad ", "line\r\nbreak", "mail ann@example.com"):
        records = dashboard_episode(
            "x", "alpha", 5, "api", reward=1.0, note=f"I am ann@example.com ({key!r})"
        )
        records[0].id = key
        for record in records[1:]:
            record.episode_id = key
        corpus.store.write(records)
    client = TestClient(create_dashboard(corpus.store), raise_server_exceptions=False)
    for blank in ("%20", "%09", "None"):
        assert_error_page(client.get(f"/export/{blank}/pad"), 400)
    for key in ("pad", " pad ", "line\r\nbreak"):
        page = client.get(f"/episodes/{quote(key, safe='')}")
        assert page.status_code == 200, key
        linked = f'href="/export/trl/{quote(key, safe="")}"'
        assert linked in page.text and f'href="/export/trl/{quote(key, safe="")}?redact=true"' in page.text
        export = client.get(f"/export/trl/{quote(key, safe='')}")
        assert export.status_code == 200 and repr(key) in export.json()["messages"][1]["content"], key
        assert "\r" not in export.headers["content-disposition"]
    assert_error_page(client.get("/export/trl/%20nobody%20"), 404)
    redacted = client.get(
        f"/export/openai/{quote('mail ann@example.com', safe='')}", params={"redact": "true"}
    )
    assert (
        redacted.status_code == 200 and "ann@example.com" not in redacted.text and "[EMAIL]" in redacted.text
    )
    assert "redacted" in redacted.headers["content-disposition"]
    assert_error_page(client.get("/export/tokens/pad", params={"redact": "true"}), 400)
    corpus.store.close()
