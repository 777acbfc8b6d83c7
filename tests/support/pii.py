"""Shared by the tests: pii."""

from __future__ import annotations

# What a redacted capture and a redacted export both left unmasked (hardening round 4).
HOSTILE_PII = {
    "card": 4111111111111111,  # a card number given as a JSON number
    "phone": 15551234567,  # so is a phone number: JSON has no "+"
    "ann@example.com": {"orders": 2},  # an e-mail used as a key
    "bob@example.com": {"orders": 3},  # another: redacted keys must not collide
    "order": 1234567,
    "count": 12,
    "not_a_card": 4111111111111112,  # fails the Luhn check
}


UNMASKED = ["4111111111111111", "15551234567", "ann@example.com", "bob@example.com"]
