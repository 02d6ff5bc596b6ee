"""Red team, as a property: a time expression the proof admits never fails on a value the proof allows.

Time functions fail for the rows that reach them ("timestamp out of range", "time zone not recognized", "unit not
recognized"...), and such an error tells whether a row did. The proof (anonproxy.plan.bounds) admits an expression
over a date or timestamp column only if no value the column may hold makes it fail: without declared bounds,
2000 BC to 200000 AD or ±infinity, in any session time zone (POSIX zones up to 167 hours from UTC included).

Generated chains of one to three steps over the test policy's ``events`` (date_trunc of every unit, with a zone or
not, AT TIME ZONE, constant intervals up to the range's margin, casts between the time types, date_bin with far
origins, date plus integer, to_char), with names spelled as PostgreSQL does not know them among the valid ones (a
zone with a space around it, the Kelvin sign for k), are decided in suppress mode; each one admitted, in WHERE or
GROUP BY, is evaluated by PostgreSQL on the extreme values of its column under extreme session time zones, and must
not fail.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest
from test_time_functions import SUPPRESS, decided

from anonproxy.plan.refusals import Reject

SEED = 1129
EXAMPLES = 150
KELVIN = "\u212a"
UNITS = ["microseconds", "second", "minute", "hour", "day", "week", "month", "quarter", "year", "decade", "century",
         "millennium", f"wee{KELVIN}", "WEEK"]
ZONES = ["UTC", "Pacific/Kiritimati", "Etc/GMT+12", "America/St_Johns", "Asia/Kathmandu", "Europe/Paris", " UTC",
         "Europe/Paris ", f"Asia/{KELVIN}olkata", "asia/kolkata"]
SESSION_ZONES = ["UTC", "Pacific/Kiritimati", "Etc/GMT+12", "<+167>-167", "<-167>+167"]
TYPES = {"at": "timestamptz", "local": "timestamp", "day": "date"}
EXTREMES = {
    "at": ["2000-01-01 00:00:00+00 BC", "200000-12-31 23:59:59.999999+00", "infinity", "-infinity"],
    "local": ["2000-01-01 00:00:00 BC", "200000-12-31 23:59:59.999999", "infinity", "-infinity"],
    "day": ["2000-01-01 BC", "200000-12-31", "infinity", "-infinity"],
}
AMOUNTS = [1, 30, 1000, 50000, 90000, 94000, 94270, 94276, 94277, 95000]


def step(rng: random.Random, e: str) -> str:
    shift = f"interval '{rng.choice(AMOUNTS)} {rng.choice(['years', 'days', 'hours', 'months'])}'"
    return rng.choice([
        lambda: f"date_trunc('{rng.choice(UNITS)}', {e})",
        lambda: f"date_trunc('{rng.choice(UNITS)}', {e}, '{rng.choice(ZONES)}')",
        lambda: f"({e} AT TIME ZONE '{rng.choice(ZONES)}')",
        lambda: f"timezone('{rng.choice(ZONES)}', {e})",
        lambda: f"({e} + {shift})",
        lambda: f"({e} - {shift})",
        lambda: f"cast({e} as {rng.choice(list(TYPES.values()))})",
        lambda: (f"date_bin(interval '{rng.choice(['1 day', '15 minutes', '1000 days'])}', cast({e} as timestamp), "
                 f"timestamp '{rng.choice(['2001-01-01', '1000-01-01 BC', '150000-01-01'])}')"),
        lambda: f"({e} + {rng.choice([1, 100000, 34000000, 35000000])})",
        lambda: f"to_char({e}, 'YYYY-MM-DD HH24')",
        lambda: f"extract('{rng.choice(['week', f'wee{KELVIN}', 'year'])}' from {e})",
    ])()


def draw(rng: random.Random) -> tuple[str, str]:
    column = rng.choice(list(TYPES))
    expression = column
    for _ in range(rng.randint(1, 3)):
        expression = step(rng, expression)
    return column, expression


def fails(truth: psycopg.Connection[Any], column: str, expression: str) -> str | None:
    """PostgreSQL's error on one of the column's extreme values under one of the session zones, if any."""
    for zone in SESSION_ZONES:
        for value in EXTREMES[column]:
            try:
                with truth.transaction():
                    truth.execute("select pg_catalog.set_config('TimeZone', %s, true)", [zone])
                    truth.execute(f"select ({expression}) from (values (cast(%s as {TYPES[column]}))) t ({column})",
                                  [value])
            except psycopg.errors.UndefinedFunction:
                return None  # no such function or operator for these types: fails on every database alike
            except psycopg.Error as error:
                return f"{zone} {value}: {error.sqlstate} {error.diag.message_primary}"
    return None


def test_admitted_time_expressions_never_fail_on_allowed_values(truth: psycopg.Connection[Any]) -> None:
    rng = random.Random(SEED)
    admitted = 0
    for _ in range(EXAMPLES):
        column, expression = draw(rng)
        for sql in (f"select count(*) from events where person_id = 17 and ({expression}) is not null",
                    f"select {expression}, count(*) from events group by 1"):
            if isinstance(decided(sql, SUPPRESS), Reject):
                continue
            admitted += 1
            failure = fails(truth, column, expression)
            assert failure is None, (sql, failure)
    assert admitted >= EXAMPLES // 2  # the generator reaches what the proof admits, not only refusals


@pytest.mark.parametrize("name", [" UTC", "UTC ", f"Asia/{KELVIN}olkata"])
def test_postgresql_knows_no_such_zone(truth: psycopg.Connection[Any], name: str) -> None:
    """The names the generator mixes in are errors for PostgreSQL (when a row reaches them): what the proof must
    refuse."""
    with pytest.raises(psycopg.errors.InvalidParameterValue), truth.transaction():
        truth.execute("select timestamptz '2025-01-01' at time zone %s", [name])
