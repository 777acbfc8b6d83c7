"""The success rule, once: an episode's label decides; without one, a reward of at least 1.

Python code asks ``outcome_of`` (or ``succeeded``); SQL asks the clauses that
``outcome_clauses`` builds beside it from the same constant, so a query and a loop over
episodes can never disagree about what counts as a success.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement

Outcome = Literal["success", "failure", "unknown"]
SUCCESS_LABEL = "success"
FAILURE_LABEL = "failure"  # what a grade writes; any label but SUCCESS_LABEL is a failure
SUCCESS_REWARD = 1.0  # rewards are in [0, 1]: only a full score is a success


def reward_error(reward: Any) -> str | None:
    """Why ``reward`` cannot be stored, or None. One rule for every way in: a reward is a
    finite number in [0, 1], and anything else is refused, never clamped (a clamped 1.5
    would count as a success nobody scored)."""
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        return f"the reward {reward!r} is not a finite number"
    if not 0.0 <= reward <= 1.0:
        return f"the reward {reward!r} is outside [0, 1]"
    return None


def reward_succeeds(reward: float) -> bool:
    """Whether a reward alone, with no label, makes a success."""
    return reward >= SUCCESS_REWARD


def graded_label(reward: float) -> str:
    """The label an environment's grade gives an episode."""
    return SUCCESS_LABEL if reward_succeeds(reward) else FAILURE_LABEL


def outcome_of(label: str | None, reward: float | None) -> Outcome:
    if label is not None:
        return "success" if label == SUCCESS_LABEL else "failure"
    if reward is not None:
        return "success" if reward_succeeds(reward) else "failure"
    return "unknown"


def succeeded(label: str | None, reward: float | None) -> bool | None:
    """Success, failure, or None when neither a label nor a reward is known."""
    outcome = outcome_of(label, reward)
    return None if outcome == "unknown" else outcome == "success"


@dataclass(frozen=True, slots=True)
class OutcomeClauses:
    success: ColumnElement[bool]
    failure: ColumnElement[bool]
    unknown: ColumnElement[bool]


def outcome_clauses(label: Any, reward: Any) -> OutcomeClauses:
    """``outcome_of`` as SQL, over a table's ``label`` and ``reward`` columns."""
    return OutcomeClauses(
        success=or_(label == SUCCESS_LABEL, and_(label.is_(None), reward >= SUCCESS_REWARD)),
        failure=or_(
            and_(label.is_not(None), label != SUCCESS_LABEL), and_(label.is_(None), reward < SUCCESS_REWARD)
        ),
        unknown=and_(label.is_(None), reward.is_(None)),
    )
