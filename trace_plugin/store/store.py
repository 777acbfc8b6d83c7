"""The trajectory store: batched writes of capture records and the queries built on them.

``Store`` is a front over its two halves, each a module of its own: trajectories
(``episodes.py``) and what the improver keeps (``improver_records.py``); both speak only
record types (``rows.py`` converts them).
"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import Engine, text

from trace_plugin.store.engine import make_engine, resolve_url
from trace_plugin.store.episodes import EpisodeRecords
from trace_plugin.store.improver_records import ImproverRecords
from trace_plugin.store.rows import (
    AgentStats,
    EpisodeFilter,
    OutcomeWindow,
    Record,
    fit_string,
    tool_hash,
)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_UPGRADE_LOCK = threading.Lock()
_PG_MIGRATION_LOCK = 0x7472_6163  # "trac": serializes concurrent upgrades on PostgreSQL

__all__ = ["AgentStats", "EpisodeFilter", "OutcomeWindow", "Record", "Store", "fit_string", "tool_hash"]


class Store(EpisodeRecords, ImproverRecords):
    """SQL storage for trajectories, on SQLite (the default) or PostgreSQL.

    ``write`` takes capture records in the order they happened and stores them in one
    transaction; the recorder calls it from its background thread. Queries return the
    dataclasses of ``trace_plugin.records.trajectory``.
    """

    def __init__(self, url: str | None = None, *, engine: Engine | None = None) -> None:
        self.url = resolve_url(url)
        self.engine = engine or make_engine(self.url)
        self._read_engine = self.engine.execution_options(sqlite_read=True)
        self._known_agents: set[str] = set()
        self._known_tools: set[str] = set()
        # Agents offer the same schemas on every call: hash each distinct one once (see _hash_of).
        self._hashes: dict[bytes, str] = {}

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    def upgrade(self, revision: str = "head") -> None:
        """Bring the schema to ``revision`` with Alembic; safe to run from many processes."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        # Alembic keeps its running context in module globals: one upgrade per process at a time.
        with _UPGRADE_LOCK, self.engine.begin() as conn:  # BEGIN IMMEDIATE on SQLite: one upgrader at a time
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
