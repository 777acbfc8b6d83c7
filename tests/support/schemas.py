"""Shared by the tests: schemas."""

from __future__ import annotations


def function(name, properties, required=(), description=""):
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


# Stateless tools as a function-calling agent offers them: dotted and camelCase names, no
# ``_id`` parameters, nested objects, arrays, enums, ranged numbers, booleans, formats.
TOOLS = [
    function(
        "geometry.circleArea",
        {
            "radius": {"type": "number", "minimum": 0.5, "maximum": 20},
            "units": {"type": "string", "enum": ["cm", "m"]},
        },
        ["radius"],
        "Compute the area of a circle. Returns square units.",
    ),
    function(
        "convertCurrency",
        {
            "amount": {"type": "integer", "minimum": 1, "maximum": 5000},
            "from": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
            "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
            "rounded": {"type": "boolean"},
        },
        ["amount", "from", "to"],
        "Convert an amount of money between currencies.",
    ),
    function(
        "legal.search_cases",
        {
            "query": {"type": "string"},
            "filters": {
                "type": "object",
                "properties": {
                    "court": {"type": "string", "enum": ["supreme", "appeals"]},
                    "after": {"type": "string", "format": "date"},
                },
                "required": ["court", "after"],
            },
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        ["query", "filters"],
        "Search court cases {by text}.",
    ),
    function("weather.now", {"city": {"type": "string"}}, ["city"], "The current weather in a city."),
]
