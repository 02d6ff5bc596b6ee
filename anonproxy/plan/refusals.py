"""Refusals: the SQLSTATEs, the Reject answer and the exception the front end and the back-ends raise.

Any pass may raise :class:`Refusal`; the router turns it into the :class:`Reject` it carries.
"""

from __future__ import annotations

from dataclasses import dataclass

# SQLSTATEs used for refusals.
INSUFFICIENT_PRIVILEGE = "42501"  # the statement kind or the data it would read is not allowed
FEATURE_NOT_SUPPORTED = "0A000"  # unparseable, or outside the SQL subset the rewriter understands
SYNTAX_ERROR = "42601"  # a command the proxy parses itself (cursors, SET) that PostgreSQL would not parse either
INVALID_CURSOR_DEFINITION = "42P11"  # SCROLL and NO SCROLL, as PostgreSQL says
INVALID_PARAMETER_VALUE = "22023"  # a setting out of range; a non-finite number compared with an aggregate
INVALID_TEXT_REPRESENTATION = "22P02"  # a string constant that is not a number, compared with an aggregate
NUMERIC_VALUE_OUT_OF_RANGE = "22003"  # a constant cast to an integer type it does not fit


@dataclass(frozen=True)
class Reject:
    """Answer with an ErrorResponse carrying this SQLSTATE, message and hint."""

    sqlstate: str
    message: str
    hint: str | None = None


class Refusal(Exception):
    """Raised inside the rewriter; ``decide`` turns it into a :class:`Reject`."""

    def __init__(self, sqlstate: str, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.reject = Reject(sqlstate, message, hint)


def unsupported(message: str, hint: str | None = None) -> Refusal:
    return Refusal(FEATURE_NOT_SUPPORTED, message, hint)


def forbidden(message: str, hint: str | None = None) -> Refusal:
    return Refusal(INSUFFICIENT_PRIVILEGE, message, hint)


# Lightdash counts a metric of a table that a one-to-many join repeats once per key with its fan-out CTEs; the
# proxy answers them where the keys are provably the table's rows (anonproxy.plan.fanout), else the one aggregate
# over the join, where count(DISTINCT <unit>) counts each person once.
FANOUT_HINT = ("Aggregate over the join directly: SELECT <dimensions>, count(DISTINCT <protected>.<unit>), "
               "sum(...) FROM <protected table> [LEFT] JOIN <linked table> ON <linked>.<key> = <protected>.<unit> "
               "GROUP BY <dimensions> (in Lightdash, a count distinct metric needs no fan-out CTEs). Fan-out keys "
               "are answered when they are the protected table's unique unit and plain columns of it or of one "
               "linked table joined on its declared key (or date_trunc of the linked table's), with conditions each "
               "over one of the two tables, and are joined back on that unit.")


def fanout_keys() -> Refusal:
    """The refusal of a SELECT DISTINCT derived table joined in FROM, as the keys of Lightdash's fan-out CTEs that
    :mod:`anonproxy.plan.fanout` could not prove to be the rows of a protected table."""
    return unsupported("a SELECT DISTINCT subquery joined in FROM (the keys of Lightdash's fan-out CTEs, "
                       "cte_keys_<table>) is not supported over protected tables unless its keys are provably the "
                       "rows of a protected table", FANOUT_HINT)
