"""The agent's functions: stateless computations and lookups, as its production serves them.

Each request to the agent offers a few of these (its ``tools``), as function-calling APIs do.
Names follow their own conventions (``units.convert``, ``finance.compoundInterest``); no
argument is an ``<noun>_id`` and nothing is stored between calls.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

UNITS = {"km": ("m", 1000.0), "mi": ("m", 1609.344), "kg": ("g", 1000.0), "lb": ("g", 453.59237)}
RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0}  # per US dollar, fixed for the suite
LIMITATION_YEARS = {
    ("contract", "england"): 6,
    ("contract", "scotland"): 5,
    ("tort", "england"): 6,
    ("tort", "scotland"): 5,
    ("personal_injury", "england"): 3,
    ("personal_injury", "scotland"): 3,
}


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    (base, factor), (other, divisor) = UNITS[from_unit], UNITS[to_unit]
    if base != other:
        raise ValueError(f"cannot convert {from_unit} to {to_unit}")
    return round(value * factor / divisor, 2)


def compound_interest(principal: float, rate: float, years: int) -> float:
    return round(principal * (1 + rate / 100) ** years, 2)


def percent_of(percent: float, value: float) -> float:
    return round(percent * value / 100, 2)


def limitation_period(claim: str, jurisdiction: str) -> int:
    return LIMITATION_YEARS[(claim, jurisdiction)]


def add_days(date: str, days: int) -> str:
    return (datetime.date.fromisoformat(date) + datetime.timedelta(days=days)).isoformat()


def convert_currency(amount: float, currencies: dict[str, str]) -> float:
    return round(amount / RATES[currencies["from"]] * RATES[currencies["to"]], 2)


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_UNIT = {"type": "string", "enum": sorted(UNITS)}
_CURRENCY = {"type": "string", "enum": sorted(RATES)}

# name -> (OpenAI schema, implementation taking the call's arguments)
FUNCTIONS: dict[str, tuple[dict[str, Any], Callable[..., Any]]] = {
    "units.convert": (
        _schema(
            "units.convert",
            "Convert a length or a mass between units.",
            {"value": {"type": "number"}, "from_unit": _UNIT, "to_unit": _UNIT},
            ["value", "from_unit", "to_unit"],
        ),
        convert_units,
    ),
    "finance.compoundInterest": (
        _schema(
            "finance.compoundInterest",
            "The value of an investment compounded yearly.",
            {
                "principal": {"type": "number", "minimum": 1},
                "rate": {"type": "number", "minimum": 0, "maximum": 20, "description": "percent per year"},
                "years": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            ["principal", "rate", "years"],
        ),
        compound_interest,
    ),
    "math.percentOf": (
        _schema(
            "math.percentOf",
            "A percentage of a value.",
            {"percent": {"type": "number"}, "value": {"type": "number"}},
            ["percent", "value"],
        ),
        percent_of,
    ),
    "legal.limitationPeriod": (
        _schema(
            "legal.limitationPeriod",
            "How many years a claim may be brought after the event, by jurisdiction.",
            {
                "claim": {"type": "string", "enum": ["contract", "tort", "personal_injury"]},
                "jurisdiction": {"type": "string", "enum": ["england", "scotland"]},
            },
            ["claim", "jurisdiction"],
        ),
        limitation_period,
    ),
    "calendar.addDays": (
        _schema(
            "calendar.addDays",
            "The date a number of days after another date.",
            {"date": {"type": "string", "format": "date"}, "days": {"type": "integer"}},
            ["date", "days"],
        ),
        add_days,
    ),
    "finance.convertCurrency": (
        _schema(
            "finance.convertCurrency",
            "Convert an amount of money between currencies.",
            {
                "amount": {"type": "number"},
                "currencies": {
                    "type": "object",
                    "properties": {"from": _CURRENCY, "to": _CURRENCY},
                    "required": ["from", "to"],
                },
            },
            ["amount", "currencies"],
        ),
        convert_currency,
    ),
}


def call(name: str, arguments: dict[str, Any]) -> Any:
    """Run one function; a wrong name or arguments raise."""
    if name not in FUNCTIONS:
        raise KeyError(f"no function {name!r}")
    return FUNCTIONS[name][1](**arguments)


def answer(name: str, arguments: dict[str, Any]) -> str:
    """What the model reads back: the function's result, or its error, as JSON text."""
    try:
        return json.dumps({"result": call(name, arguments)})
    except (KeyError, TypeError, ValueError) as exc:
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})
