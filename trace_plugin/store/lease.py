"""A lease: at most one holder of a name at a time, across processes and machines.

On PostgreSQL it is a session advisory lock, held by one dedicated connection: the
server releases it the moment that connection dies, so a killed holder frees it at once
(a clean release unlocks explicitly, since the pool keeps the session).
On SQLite, which has no such thing, it is a row with an expiry that the holder renews
from a background thread; a holder that dies stops renewing and the lease lapses after
``ttl`` seconds.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, text

from trace_plugin.errors import TracePluginError
from trace_plugin.records.trajectory import utcnow
from trace_plugin.store import tables as t
from trace_plugin.store.store import Store


class LeaseHeld(TracePluginError, RuntimeError):
    """Someone else holds the lease."""


class Lease:
    def __init__(self, store: Store, name: str, *, ttl: float = 30.0) -> None:
        self.store, self.name, self.ttl = store, name, ttl
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._conn: Any = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> Lease:
        if self.store.dialect == "postgresql":
            conn = self.store.engine.connect()
            key = self._key()
            if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
                conn.close()
                raise LeaseHeld(f"{self.name} is held by another process")
            conn.commit()
            self._conn = conn
            return self
        if not self._claim():
            with self.store.engine.connect() as conn:
                holder = conn.execute(select(t.leases.c.owner).where(t.leases.c.name == self.name)).scalar()
            raise LeaseHeld(f"{self.name} is held by {holder}")
        self._renewer = threading.Thread(target=self._renew, name=f"lease-{self.name}", daemon=True)
        self._renewer.start()
        return self

    def release(self) -> None:
        if self._conn is not None:  # the pool keeps the session open: unlock explicitly
            self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._key()})
            self._conn.commit()
            self._conn.close()
            self._conn = None
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self.store.engine.begin() as conn:
            conn.execute(
                t.leases.delete().where(t.leases.c.name == self.name, t.leases.c.owner == self.owner)
            )

    def _key(self) -> int:
        return int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:8], "big", signed=True)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _claim(self) -> bool:
        """Take the row if it is free, lapsed or ours; one statement, so two claimants cannot both win."""
        now = utcnow()
        expires = now + timedelta(seconds=self.ttl)
        c = t.leases.c
        with self.store.engine.begin() as conn:
            conn.execute(
                self.store._insert_ignore(t.leases), [{"name": self.name, "owner": "", "expires_at": now}]
            )
            taken = conn.execute(
                t.leases.update()
                .where(c.name == self.name, or_(c.owner == self.owner, c.owner == "", c.expires_at < now))
                .values(owner=self.owner, expires_at=expires)
            ).rowcount
        return bool(taken)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self._claim()
