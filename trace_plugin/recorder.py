"""The recorder: moves capture records off the agent's threads and into the store.

Capture calls ``Recorder.submit``, which never raises: it encodes the record's
payloads with orjson (microseconds), packs the record into a tuple of plain values and
appends it to a bounded queue. One background thread writes the queue in batches, and
encodes what submit left to it: payloads to redact, and values orjson refuses. When the
database is down the thread holds its batch and retries; the queue fills and further
records are dropped and counted, with one warning per outage, until writes succeed again.

Every recorder with pending records is flushed when the interpreter exits and when the
process gets SIGTERM (the stop signal of ``docker stop``, systemd and Kubernetes), whose
default action would otherwise end it with its tail unwritten.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import attrgetter
from types import FrameType
from typing import Any

import orjson
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from trace_plugin.payload import DEFAULT_MAX_BYTES, Redactor, clip_text, encode, encode_now, make_redactor
from trace_plugin.records.outcome import reward_error
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step
from trace_plugin.store import Store
from trace_plugin.store.engine import JsonText
from trace_plugin.store.store import Record

log = logging.getLogger("trace_plugin")


@dataclass(frozen=True, slots=True)
class PayloadPolicy:
    """How a capture's payloads are bounded and redacted before they are stored."""

    max_bytes: int = DEFAULT_MAX_BYTES
    redact: Redactor | None = None

    @classmethod
    def of(cls, max_bytes: int | None = None, redact: Any = None) -> PayloadPolicy:
        return cls(max_bytes or DEFAULT_MAX_BYTES, make_redactor(redact))


DEFAULT_POLICY = PayloadPolicy()


# Each record type's JSON payload fields, and its plain-text fields bounded like them.
_JSON_FIELDS: dict[type, tuple[str, ...]] = {
    Episode: ("input", "output", "metadata"),
    Step: ("input", "output", "token_ids"),
    EpisodeEnd: ("output",),
    Feedback: (),
}
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {
    Episode: ("error",),
    Step: ("error",),
    EpisodeEnd: ("error",),
    Feedback: ("comment",),
}


def encode_record(record: Record, policy: PayloadPolicy) -> Record:
    """Encode a record's payload fields in place; it belongs to the recorder by now."""
    size, redact = policy.max_bytes, policy.redact
    for name in _JSON_FIELDS[type(record)]:
        setattr(record, name, encode(getattr(record, name), max_bytes=size, redact=redact))
    for name in _TEXT_FIELDS[type(record)]:
        setattr(record, name, clip_text(getattr(record, name), size, redact))
    return record


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a record type's fields sit in its packed tuple (see ``pack``)."""

    tag: int
    cls: type
    values: Callable[[Any], tuple[Any, ...]]
    json_at: tuple[int, ...]
    text_at: tuple[int, ...]
    tools_at: int | None


def _layouts() -> dict[type, _Layout]:
    layouts = {}
    for tag, cls in enumerate(_JSON_FIELDS):
        names = [f.name for f in dataclasses.fields(cls)]
        if names[-1] == "steps":  # an Episode's steps travel as records of their own
            names.pop()
        layouts[cls] = _Layout(
            tag,
            cls,
            attrgetter(*names),
            tuple(names.index(n) for n in _JSON_FIELDS[cls]),
            tuple(names.index(n) for n in _TEXT_FIELDS[cls]),
            names.index("tools") if "tools" in names else None,
        )
    return layouts


_LAYOUTS = _layouts()
_BY_TAG = list(_LAYOUTS.values())
_SCHEMA_SEPARATOR = "\n"  # never in orjson's compact output: newlines in strings are escaped


def pack(record: Record, max_bytes: int) -> tuple[Any, ...] | None:
    """``record`` encoded as a tuple of strings, numbers and datetimes, or None if orjson
    refuses a payload (the writer's bounded walk then takes the record as it is).

    The garbage collector stops tracking such a tuple at its first pass. Queued records
    did not get that: they wait a fraction of a second for the writer, long enough to be
    promoted to the oldest generation, and with a zero-latency agent those promotions
    set off a full collection of the agent's heap every few hundred runs.
    """
    layout = _LAYOUTS[type(record)]
    values = list(layout.values(record))
    for i in layout.json_at:
        if values[i] is not None:
            text = encode_now(values[i], max_bytes)
            if text is None:
                return None
            values[i] = text
    for i in layout.text_at:
        if values[i] is not None:
            values[i] = clip_text(values[i], max_bytes)
    tools = values[layout.tools_at] if layout.tools_at is not None else None
    if tools:  # never redacted or cut; one string, as a nested tuple is untracked only later
        try:
            values[layout.tools_at] = _SCHEMA_SEPARATOR.join(
                [orjson.dumps(schema).decode() for schema in tools]
            )
        except TypeError:  # not plain JSON: the store hashes the dicts
            return None
    return (layout.tag, *values)


def unpack(packed: tuple[Any, ...]) -> Record:
    """The record ``pack`` made ``packed`` from, its payloads as ``JsonText``."""
    layout = _BY_TAG[packed[0]]
    values = list(packed[1:])
    for i in layout.json_at:
        if values[i] is not None:
            values[i] = JsonText(values[i])
    if layout.tools_at is not None and values[layout.tools_at]:
        values[layout.tools_at] = [
            JsonText(schema) for schema in values[layout.tools_at].split(_SCHEMA_SEPARATOR)
        ]
    return layout.cls(*values)


def _refuse_bad_reward(record: EpisodeEnd | Feedback) -> EpisodeEnd | Feedback:
    """``record`` without a reward the outcome rule cannot read, and why in the record
    (an episode's ``error``, a feedback's ``comment``): refused, never clamped."""
    problem = reward_error(record.reward)
    if problem is None:
        return record
    log.warning("trace-plugin: episode %s: %s; stored without it", record.episode_id, problem)
    note = f"reward refused: {problem}"
    if isinstance(record, EpisodeEnd):
        return replace(record, reward=None, error=f"{record.error}; {note}" if record.error else note)
    return replace(record, reward=None, comment=f"{record.comment}; {note}" if record.comment else note)


class _Unencoded:
    """A queued record whose payloads wait for the writer: to be redacted, or not plain JSON."""

    __slots__ = ("record", "policy")

    def __init__(self, record: Record, policy: PayloadPolicy) -> None:
        self.record = record
        self.policy = policy


class _Flush:
    """A marker in the queue: set once everything queued before it is stored or dropped."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()
_clock = time.monotonic  # the writer's cadence; a test drives it by hand


class Recorder:
    """Batched, non-blocking writes of capture records into a ``Store``."""

    def __init__(
        self,
        store: Store | str | None = None,
        *,
        max_queue: int = 100_000,
        batch_size: int = 2_000,
        interval: float = 0.2,
        retry_interval: float = 1.0,
    ) -> None:
        self.store = store if isinstance(store, Store) else Store(store)
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.interval = interval
        self.retry_interval = retry_interval
        self.written = 0
        self.dropped = 0
        # A deque, not a queue.Queue: appending takes no lock, so a signal handler that
        # interrupts the agent's thread mid-submit can still flush without deadlocking.
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._schema_ready = False
        self._outage: str | None = None
        # Closing: the writer stops retrying an outage. Past close's deadline what it still
        # held is counted as dropped (it would die with the process) and it writes no more.
        self._closing = threading.Event()
        self._abandoned = False
        self._held = 0  # records the writer is storing now
        _live.add(self)
        install_term_handler()

    # -- agent side: never blocks, never raises --------------------------------------------

    def submit(self, record: Record, policy: PayloadPolicy = DEFAULT_POLICY) -> None:
        try:
            if isinstance(record, EpisodeEnd | Feedback) and record.reward is not None:
                record = _refuse_bad_reward(record)
            self._ensure_thread()
            if len(self._queue) >= self.max_queue:
                self._count_drop(1, queue_full=True)
            else:
                # A redactor must see every string: the writer encodes those records.
                packed = pack(record, policy.max_bytes) if policy.redact is None else None
                self._queue.append(packed if packed is not None else _Unencoded(record, policy))
        except Exception:  # capture must never break the agent
            self._count_drop(1)
            log.exception("trace-plugin: could not queue a record")

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything submitted so far is stored (or dropped). False on timeout."""
        marker = self._mark()
        return marker is None or marker.done.wait(timeout)

    def _mark(self, *, from_signal: bool = False) -> _Flush | None:
        """Queue a flush marker and wake the writer; None when nothing is pending.

        From a signal handler the wake-up goes through a short-lived thread: setting an
        Event takes a lock that the interrupted thread may be holding.
        """
        if self._thread is None or not self._thread.is_alive():
            return None if not self._queue else _Flush()  # never set: no writer will reach it
        marker = _Flush()
        self._queue.append(marker)
        if from_signal:
            threading.Thread(target=self._wake.set, daemon=True).start()
        else:
            self._wake.set()
        return marker

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush, then stop the writer thread, all within ``timeout``. Returns whether
        everything was stored; what was not (the database down or read-only) is counted in
        ``dropped``."""
        deadline = None if timeout is None else _clock() + timeout
        flushed = self.flush(timeout)
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._closing.set()
            self._queue.append(_STOP)
            self._wake.set()
            thread.join(None if deadline is None else max(0.0, deadline - _clock()))
            if thread.is_alive():
                with self._lock:
                    self._abandoned = True
                    lost = self._held + sum(1 for item in self._queue if _is_record(item))
                    self.dropped += lost
                if lost:
                    log.warning("trace-plugin: closed with %d records not stored (counted in .dropped)", lost)
        self._thread = None
        return flushed

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._closing.clear()
            self._abandoned = False
            thread = threading.Thread(target=self._run, name="trace-plugin-writer", daemon=True)
            thread.start()
            self._thread = thread
        install_term_handler()

    def _after_fork_in_child(self) -> None:
        """A forked child has none of its parent's threads; the queue and connections are not its own."""
        self._thread = None
        self._queue = deque()
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self.store.engine.dispose(close=False)

    def _count_drop(self, n: int, *, queue_full: bool = False) -> None:
        """Count dropped records; the queue filling up is the one cause not logged where it happens."""
        with self._lock:
            if self._abandoned:
                return  # close counted them already
            first = self.dropped == 0
            self.dropped += n
        if queue_full and first and self._outage is None:
            log.warning("trace-plugin: recorder queue full; dropping records (counted in .dropped)")

    # -- writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        """Drain the queue every ``interval`` seconds, or at once when a flush asks.

        Waking per record would hand the GIL back and forth with the agent's threads for
        every event; waking a few times a second keeps the agent's own threads running.
        The cadence runs from the start of each drain, so a record waits at most one
        interval plus one drain, however long the drains take.
        """
        stop = False
        next_drain = _clock() + self.interval
        while not stop:
            self._wake.wait(max(0.0, next_drain - _clock()))
            self._wake.clear()
            next_drain = _clock() + self.interval
            batch, markers = [], []
            while True:
                try:
                    item = self._queue.popleft()
                except IndexError:
                    break
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, _Flush):
                    markers.append(item)
                    continue
                batch.append(item)
                if len(batch) >= self.batch_size:
                    self._store_batch(batch)
                    batch = []
            self._store_batch(batch)
            for marker in markers:
                marker.done.set()

    def _store_batch(self, batch: list[tuple[Any, ...] | _Unencoded]) -> None:
        records = self._encode(batch)
        if records:
            self._write_until_stored(records)

    def _encode(self, batch: list[tuple[Any, ...] | _Unencoded]) -> list[Record]:
        records = []
        for item in batch:
            try:
                if isinstance(item, _Unencoded):
                    records.append(encode_record(item.record, item.policy))
                else:
                    records.append(unpack(item))
            except Exception:
                self._count_drop(1)
                cls = type(item.record) if isinstance(item, _Unencoded) else _BY_TAG[item[0]].cls
                log.exception("trace-plugin: could not encode a %s record", cls.__name__)
        return records

    def _write_until_stored(self, records: list[Record]) -> None:
        """Write a batch, retrying through outages until the recorder closes; isolate
        records the database rejects."""
        self._held = len(records)
        try:
            self._write_or_drop(records)
        finally:
            self._held = 0

    def _write_or_drop(self, records: list[Record]) -> None:
        while not self._abandoned:
            try:
                if not self._schema_ready:
                    self.store.upgrade()
                    self._schema_ready = True
                self.store.write(records)
            except IntegrityError:
                self._write_one_by_one(records)
            except (DBAPIError, SQLAlchemyError, OSError) as exc:
                if isinstance(exc, DBAPIError) and not _is_outage(exc):
                    self._write_one_by_one(records)
                else:
                    self._note_outage(exc)
                    if self._closing.wait(self.retry_interval):
                        self._count_drop(len(records))  # closing: no more retries
                        return
                    continue
            except Exception:
                log.exception("trace-plugin: unexpected error writing %d records", len(records))
                self._count_drop(len(records))
                return
            else:
                self.written += len(records)
            if self._outage is not None:
                log.warning("trace-plugin: database reachable again; %d records dropped so far", self.dropped)
                self._outage = None
            return

    def _write_one_by_one(self, records: list[Record]) -> None:
        for record in records:
            try:
                self.store.write([record])
                self.written += 1
            except SQLAlchemyError as exc:
                self._count_drop(1)
                log.warning("trace-plugin: dropped a %s record: %s", type(record).__name__, _first_line(exc))

    def _note_outage(self, exc: Exception) -> None:
        if self._outage is None:
            self._outage = _first_line(exc)
            log.warning(
                "trace-plugin: cannot write to %s (%s); buffering up to %d records and retrying",
                self.store.engine.url.render_as_string(hide_password=True),
                self._outage,
                self.max_queue,
            )


def _is_record(item: Any) -> bool:
    """Whether a queue item is a record (not a flush marker or the stop)."""
    return item is not _STOP and not isinstance(item, _Flush)


def _is_outage(exc: DBAPIError) -> bool:
    """Connection loss, locks and read-only files pass with time; bad data does not."""
    return exc.connection_invalidated or type(exc).__name__ in ("OperationalError", "InterfaceError")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


# -- the process-wide default recorder ---------------------------------------------------

_default: Recorder | None = None
_default_lock = threading.Lock()


def default_recorder() -> Recorder:
    """The process's recorder, created on first use for ``$TRACE_PLUGIN_DB_URL``."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Recorder()
    return _default


def configure(db_url: str | None = None, **options: Any) -> Recorder:
    """Point capture at another database (or tune the recorder); flushes the previous one."""
    global _default
    with _default_lock:
        previous, _default = _default, Recorder(db_url, **options)
    if previous is not None:
        previous.close()
    return _default


def flush(timeout: float | None = 30.0) -> bool:
    """Wait until every record captured so far through the default recorder is stored.

    False if that timed out. A ``Recorder`` of your own has its own ``flush``.
    """
    return _default.flush(timeout) if _default is not None else True


def feedback(
    episode_id: str,
    *,
    reward: float | None = None,
    label: str | None = None,
    comment: str | None = None,
    source: str = "api",
) -> None:
    """Attach a delayed reward or label to an episode; it becomes the episode's outcome."""
    if reward is None and label is None:
        raise ValueError("feedback needs a reward or a label")
    problem = None if reward is None else reward_error(reward)
    if problem is not None:
        raise ValueError(problem)
    record = Feedback(episode_id, reward=reward, label=label, source=source, comment=comment)
    default_recorder().submit(record)


# -- flushing every recorder at exit and on SIGTERM -------------------------------------

_live: weakref.WeakSet[Recorder] = weakref.WeakSet()
TERM_FLUSH_ENV = "TRACE_PLUGIN_TERM_FLUSH_S"
_term_installed = False


def flush_all(timeout: float | None, *, from_signal: bool = False) -> bool:
    """Flush every live recorder at once, within ``timeout`` seconds in all (None: no limit)."""
    markers = [m for m in (r._mark(from_signal=from_signal) for r in list(_live)) if m is not None]
    if timeout is None:
        return all(m.done.wait() for m in markers)
    deadline = time.monotonic() + timeout
    return all(m.done.wait(max(0.0, deadline - time.monotonic())) for m in markers)


def install_term_handler() -> None:
    """Flush on SIGTERM, then hand the signal on; installed once, from the main thread.

    The flush waits at most ``$TRACE_PLUGIN_TERM_FLUSH_S`` seconds (5 by default, well
    inside ``docker stop``'s 10 s grace; 0 installs nothing). Then the handler the
    application had installed runs (uvicorn's graceful shutdown, say), or the default
    action ends the process as SIGTERM would have. An application that installs its own
    handler later replaces this one; its orderly exit then flushes through ``atexit``.
    """
    global _term_installed
    if _term_installed or threading.current_thread() is not threading.main_thread():
        return
    _term_installed = True
    timeout = float(os.environ.get(TERM_FLUSH_ENV, "5"))
    if timeout <= 0:
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: FrameType | None) -> None:
        flush_all(timeout, from_signal=True)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action, or a handler set outside Python
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    with contextlib.suppress(ValueError, OSError):  # not the main interpreter, or no signals here
        signal.signal(signal.SIGTERM, on_term)


def _after_fork_in_child() -> None:
    for recorder in list(_live):
        recorder._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_at_exit() -> None:
    timeout = float(os.environ.get("TRACE_PLUGIN_EXIT_FLUSH_S", "30"))
    flush_all(timeout)
