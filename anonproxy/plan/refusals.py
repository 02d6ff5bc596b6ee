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
