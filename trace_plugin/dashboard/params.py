"""Query values, checked before any query runs: a value the databases cannot hold (a NUL, a
time past year 9999) is a 400 page, never a database error."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import HTTPException


def blank(value: str | None) -> str | None:
    """Empty form fields arrive as ``name=``: they mean no filter."""
    if value is None:
        return None
    return value.strip() or None


def text_value(value: str | None, name: str) -> str | None:
    """A free-text filter. PostgreSQL cannot hold a NUL, so no stored value has one (the
    store replaces it) and a filter with one is refused rather than sent to the database."""
    value = blank(value)
    if value is not None and "\x00" in value:
        raise HTTPException(400, f"{name}: NUL characters are not allowed")
    return value


def time_value(value: str | None, name: str) -> datetime | None:
    """A datetime-local field (or any ISO time) read as UTC unless it names its zone."""
    value = blank(value)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
        # A zone can carry a time past year 1 or 9999, which no datetime holds in UTC.
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise HTTPException(400, f"{name}: not an ISO date or time in years 1 to 9999: {value!r}") from exc


def choice_value(value: str | None, allowed: tuple[str, ...], name: str) -> Any:
    value = blank(value)
    if value is not None and value not in allowed:
        raise HTTPException(400, f"{name} must be one of {', '.join(allowed)}")
    return value
