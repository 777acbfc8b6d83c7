"""Shared by the tests: dashboards."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import strategies as st

from trace_plugin import Store
from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.app import MAX_PAGE, SECURITY_HEADERS
from trace_plugin.records.capability import Capability
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step, new_id

T0 = datetime(2026, 3, 1, tzinfo=UTC)


SCRIPT = "<script>window.__pwned = 1</script>"


IMG = '<img src=x onerror="window.__pwned = 2">'


ROOT = Path(__file__).parent.parent


@dataclass
class Corpus:
    store: Store
    ids: dict[str, str]


def dashboard_episode(
    key: str,
    agent: str,
    hours: float,
    source: str,
    *,
    reward: float | None = None,
    label: str | None = None,
    adapter: str | None = None,
    status: str = "completed",
    error: str | None = None,
    note: str = "where is O-1?",
    result: str = '{"status": "shipped"}',
) -> list[Any]:
    """A two-turn tool-calling run: ask, call get_order, answer."""
    e = Episode(
        id=f"{key}-{new_id()[:8]}",
        agent=agent,
        source=source,
        adapter=adapter,
        started_at=T0 + timedelta(hours=hours),
        input={"messages": [{"role": "user", "content": note}]},
    )
    arguments = {"order_id": "O-1", "note": note}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_order", "arguments": json.dumps(arguments)},
    }
    asked = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": note}]
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    done = {"role": "assistant", "content": "Order O-1 has shipped."}
    tool_msg = {"role": "tool", "tool_call_id": "call_1", "content": result}
    return [
        e,
        Step(e.id, 0, "llm", "m", input={"messages": asked, "tools": ["get_order"]}, output=reply),
        Step(e.id, 1, "tool", "get_order", input=arguments, output=result,
             tool_call_id="call_1", latency_ms=3.5),
        Step(e.id, 2, "llm", "m", input={"messages": [*asked, reply, tool_msg], "tools": ["get_order"]},
             output=done),
        EpisodeEnd(e.id, status, output=done, reward=reward, label=label, error=error),
    ]  # fmt: skip


def seed(url: str) -> Corpus:
    """Nine episodes over three days with known counts per filter (see the tests)."""
    store = Store(url)
    store.upgrade()
    runs = {
        "a1": dashboard_episode("a1", "alpha", 1, "langgraph", reward=1.0, adapter="billing@1"),
        "a2": dashboard_episode("a2", "alpha", 2, "langgraph", reward=0.0, adapter="billing@1"),
        "a3": dashboard_episode(
            "a3", "alpha", 26, "langgraph", reward=0.5, label="success", adapter="billing@2"
        ),
        "a4": dashboard_episode("a4", "alpha", 27, "gateway"),
        "a5": dashboard_episode("a5", "alpha", 50, "gateway", label="failure", adapter="billing@2"),
        "a6": dashboard_episode("a6", "alpha", 51, "gateway", reward=1.0),
        "b1": dashboard_episode("b1", "beta", 3, "api", reward=1.0),
        "b2": dashboard_episode(
            "b2", "beta", 30, "api", reward=0.0, status="error", error="ValueError: boom"
        ),
        "x": dashboard_episode(
            "x", "mallory", 4, "api", error=f"failed on {SCRIPT}", note=SCRIPT, result=SCRIPT + IMG
        ),
    }
    for records in runs.values():
        store.write(records)
    ids = {key: records[0].id for key, records in runs.items()}
    store.write([Feedback(ids["x"], reward=0.0, label="failure", source="user", comment=f"bad {SCRIPT}")])
    metrics = {"rule": {"rho": 0.1, "delta": 0.2, "k": 8, "n": 10}}
    store.save_capabilities(
        "alpha",
        [
            Capability(
                "argument_grounding",
                "Use ids the user gave.",
                "detector",
                True,
                {**metrics, "coverage": 0.5, "contrast": 0.42, "passed": 9, "runs": 10},
                examples=[ids["a2"], ids["a5"]],
                tools=["get_order"],
                mining_run="run-1",
            ),
            Capability(
                "termination",
                "Stop when done.",
                "detector",
                False,
                {**metrics, "coverage": 0.25, "contrast": -0.1, "passed": 0, "runs": 10},
                examples=[ids["a2"]],
                mining_run="run-1",
            ),
        ],
    )
    return Corpus(store, ids)


def artifacts() -> Path:
    """``$TRACE_PLUGIN_ARTIFACTS``, else tests/artifacts, which ignores itself for git."""
    configured = os.environ.get("TRACE_PLUGIN_ARTIFACTS")
    path = Path(configured) if configured else ROOT / "tests" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    if not configured:
        (path / ".gitignore").write_text("*\n")
    return path


def navigate(browser: Any, element: Any) -> None:
    """Click something that loads a page, and wait until the old one is gone."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page = browser.find_element(By.TAG_NAME, "html")
    element.click()

    def gone(_: Any) -> bool:
        try:
            page.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as error:
            # Chrome, asked mid-navigation, reports the old node as detached this way.
            if "does not belong to the document" not in (error.msg or ""):
                raise
            return True
        return False

    WebDriverWait(browser, 15).until(gone)


def assert_secured(response: httpx.Response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (response.status_code, name, response.headers)


EDGES = ["", " ", "\x00", "alpha\x00", "0", "-1", "1e3", "nan", str(MAX_PAGE), str(MAX_PAGE + 1),
         "99999999999999999999999", "0001-01-01T00:00+01:00", "9999-12-31T23:59-01:00"]  # fmt: skip


offsets = st.timedeltas(min_value=-timedelta(hours=23, minutes=59), max_value=timedelta(hours=23, minutes=59))


times = st.datetimes(timezones=st.none() | offsets.map(timezone)).map(lambda d: d.isoformat())


values = st.one_of(
    st.sampled_from(EDGES),
    st.text(max_size=24),  # any code point but a surrogate, NUL and controls included
    st.text(st.characters(categories=["Cs", "Cc"]), max_size=4),  # lone surrogates, CR, LF
    st.integers(1, 30).flatmap(lambda n: st.text("0123456789", min_size=n, max_size=n)),  # past 64 bits too
    times,
)


# What each route parameter takes, so that generated requests get past validation to the queries.
VALID: dict[str, st.SearchStrategy[str]] = {
    "agent": st.sampled_from(["alpha", "beta", "mallory"]),
    "outcome": st.sampled_from(q.OUTCOMES),
    "status": st.sampled_from(q.STATUSES),
    "source": st.sampled_from(["langgraph", "gateway", "api"]),
    "adapter": st.sampled_from(["billing@1", "billing@2"]),
    "router": st.sampled_from(["r-000000000000"]),
    "since": times,
    "until": times,
    "page": st.integers(1, 3).map(str),
    "bucket": st.sampled_from(["auto", "minute", "hour", "day"]),
    "run": st.just("run-1"),
}


KEYS = sorted(VALID)


def quoted(text: str) -> str:
    """Percent-encoded UTF-8, a lone surrogate as the bytes it would have (invalid UTF-8)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def encoded(pairs: dict[str, str]) -> list[str]:
    return [f"{quoted(k)}={quoted(v)}" for k, v in pairs.items()]


extras = st.one_of(
    st.dictionaries(st.text(max_size=6), values, max_size=2).map(encoded),  # names no route reads
    # Percent-encoded bytes, invalid UTF-8 among them.
    st.lists(
        st.builds(
            lambda k, raw: f"{k}={''.join(f'%{b:02X}' for b in raw)}",
            st.sampled_from(KEYS),
            st.binary(max_size=12),
        ),
        max_size=2,
    ),
    st.lists(st.text(alphabet="%=&;+?aZ09 ", max_size=16), max_size=2),  # malformed pieces, sent as they are
)
