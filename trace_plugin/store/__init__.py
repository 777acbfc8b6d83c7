"""SQL trajectory store (SQLAlchemy 2, Alembic): SQLite embedded, PostgreSQL for fleets."""

from trace_plugin.store.engine import DB_URL_ENV, data_dir, resolve_url
from trace_plugin.store.store import AgentStats, Store, tool_hash

__all__ = ["DB_URL_ENV", "AgentStats", "Store", "data_dir", "resolve_url", "tool_hash"]
