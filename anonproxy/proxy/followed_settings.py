"""The client's session settings that a gated session's answers follow: one list, for every place that copies them.

Answers to a gated role are computed away from the client's own connection:
rewritten statements (suppress) run on a borrowed service connection, and
differentially private answers are made by the proxy. For them to print as
the client's own connection would print them, these settings are taken from
the client's session — at login (startup parameters and ``options``), and
again whenever the client changes them (``SET``, ``RESET``, a function, a
rolled-back transaction) — and applied where the answer is made.

The server reports changes of some of them with ParameterStatus; the others
it does not report, so the gate reads them with a query of its own on the
client's connection after the client ran something there.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..wire.results import Result

# How values print: text encoding, dates and times, time zone, intervals, floating-point digits.
FOLLOWED_SETTINGS: tuple[str, ...] = ("client_encoding", "DateStyle", "TimeZone", "IntervalStyle",
                                      "extra_float_digits")
# Those the server reports (ParameterStatus) at login and on every change.
REPORTED_SETTINGS: tuple[str, ...] = ("client_encoding", "DateStyle", "TimeZone", "IntervalStyle")
# Those it does not: read with ``current_setting`` on the client's own connection.
UNREPORTED_SETTINGS: tuple[str, ...] = tuple(name for name in FOLLOWED_SETTINGS if name not in REPORTED_SETTINGS)


# PostgreSQL's float8out/float4out: with extra_float_digits > 0 the shortest text that reads back exactly (what
# the proxy's answers hold); otherwise printf's %g with DBL_DIG (FLT_DIG) + extra_float_digits digits, at least 1.
_FLOAT_DIGITS = {701: 15, 700: 6}  # type oid (float8, float4) -> DBL_DIG, FLT_DIG


def follow_float_digits(result: Result, settings: dict[str, str]) -> Result:
    """``result`` (made by the proxy, floats in shortest form) with its float4/float8 values printed as the
    client's extra_float_digits says."""
    try:
        digits = int(settings.get("extra_float_digits", "1"))
    except ValueError:
        return result
    columns = [_FLOAT_DIGITS.get(column.type_oid) for column in result.columns]
    if digits > 0 or not any(columns):
        return result
    rows = tuple(tuple(value if value is None or base is None else _float_text(value, max(base + digits, 1))
                       for value, base in zip(row, columns, strict=True)) for row in result.rows)
    return replace(result, rows=rows)


def _float_text(text: bytes, precision: int) -> bytes:
    value = float(text)
    if math.isnan(value):
        return b"NaN"
    if math.isinf(value):
        return b"Infinity" if value > 0 else b"-Infinity"
    return b"%.*g" % (precision, value)
