"""Engines for the store: SQLite embedded by default, PostgreSQL chosen by URL."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

DB_URL_ENV = "TRACE_PLUGIN_DB_URL"
HOME_ENV = "TRACE_PLUGIN_HOME"


def data_dir() -> Path:
    """Where trace-plugin keeps its files: ``$TRACE_PLUGIN_HOME`` or ``~/.trace-plugin``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".trace-plugin")


def resolve_url(url: str | None = None) -> str:
    """The URL given, else ``$TRACE_PLUGIN_DB_URL``, else a SQLite file in the data dir.

    ``postgresql://`` URLs get the psycopg 3 driver, the one the ``postgres`` extra installs.
    """
    url = url or os.environ.get(DB_URL_ENV) or f"sqlite:///{data_dir() / 'trace.db'}"
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


class JsonText(str):
    """JSON already serialized by the recorder; passed through instead of dumped twice."""

    __slots__ = ()


# In JSON text, left to right: an escaped backslash, a surrogate pair's two escapes (an
# emoji), or a lone surrogate's or NUL's escape; only the last two are replaced.
_ESCAPES = re.compile(
    r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u(?:[dD][89a-fA-F][0-9a-fA-F]{2}|0000)"
)


def _storable(match: re.Match[str]) -> str:
    return match[0] if len(match[0]) in (2, 12) else "\\ufffd"


def json_for_store(value: Any) -> str:
    r"""JSON text every backend stores alike: PostgreSQL's jsonb rejects ``\u0000`` and a lone
    surrogate's escape (``\ud800``), which SQLite keeps, and which no export could then
    encode as UTF-8; both become U+FFFD's escape on both. Surrogate pairs stay."""
    text = value if isinstance(value, JsonText) else json.dumps(value)
    return _ESCAPES.sub(_storable, text) if "\\u" in text else text


def make_engine(url: str) -> Engine:
    """An engine whose transactions behave the same under concurrent writers.

    SQLite runs in WAL mode with a busy timeout, and every write transaction starts with
    ``BEGIN IMMEDIATE``: a deferred BEGIN that later upgrades to a write lock fails with
    "database is locked" under concurrent writers instead of waiting. Reads go through
    ``engine.execution_options(sqlite_read=True)`` and keep a deferred BEGIN.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(
            url,
            json_serializer=json_for_store,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 5},
        )

    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, json_serializer=json_for_store, connect_args={"timeout": 30, "check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        read = conn.get_execution_options().get("sqlite_read", False)
        conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")

    return engine
