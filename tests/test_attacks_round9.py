"""Red team, round 9: set operations of aggregate queries (suppress), and dp's time filters bound at Bind.

Each attack goes through the real gated proxy with a real driver and asserts the safe outcome: what a set
operation releases is what its branches release when asked alone (a withheld group stays withheld whatever the
operator), a disguised branch or a set operation outside the shapes answered is refused with its SQLSTATE, and a
time filter at the edges of the calendar (the first and last days Python's datetime holds, ±infinity, BC) is
answered as PostgreSQL reads it: the buckets of the declared range the filter leaves, the same bound as written.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

Rows = list[tuple[Any, ...]]
_names = itertools.count(1)
MONTHLY = ("select date_trunc('month', visited_at) as month, count(*) as n from visits "
           "where visited_at >= {0} and visited_at < {1} group by 1 order by 1")
DECLARED = [datetime(2025 + m // 12, m % 12 + 1, 1, tzinfo=UTC) for m in range(24)]  # visits' declared range


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """The demo's suppress role: k = 10, dominance (2, 85 %), p 10 %, a suppressed-rest row."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


@pytest.fixture
def analyst(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
            gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """A dp role of its own (ε 20 in all), its session in UTC."""
    role = f"dp_round9_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, role, epsilon=20), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        conn.execute("set timezone = 'UTC'")
        yield conn


def _refusal(conn: psycopg.Connection[Any], sql: str, params: list[Any] | None = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params).fetchall()
    return caught.value


def _spent(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("show anonproxy.budget").fetchone()[0])


def _written(sql: str, *values: str) -> str:
    return sql.format(*("'" + value + "'" for value in values))


# --- dp: time filters at the calendar's edges ------------------------------------------------------------------


@pytest.mark.parametrize("low, high", [
    ("0001-01-01", "9999-12-31"),  # Python's datetime.min and max days: an "all time" range an ORM sends
    ("0001-01-01 00:00:00+05", "9999-12-31 23:00:00-05"),  # their UTC instants fall outside Python's years
    ("-infinity", "infinity"),
    ("2025-03-01 BC", "infinity"),
])
def test_an_all_time_range_lists_the_declared_months(analyst: psycopg.Connection[Any], low: str, high: str) -> None:
    rows = analyst.execute(_written(MONTHLY, low, high)).fetchall()
    assert [row[0] for row in rows] == DECLARED


def test_an_all_time_range_bound_at_bind_is_the_constant_one(analyst: psycopg.Connection[Any]) -> None:
    before = _spent(analyst)
    rows = analyst.execute(MONTHLY.format("%s", "%s"), [datetime(1, 1, 1, tzinfo=UTC),
                                                        datetime(9999, 12, 31, tzinfo=UTC)], prepare=True).fetchall()
    assert [row[0] for row in rows] == DECLARED
    assert _spent(analyst) != before


def test_a_range_past_the_declared_one_lists_no_month(analyst: psycopg.Connection[Any]) -> None:
    for low, high in [("infinity", "infinity"), ("3000-01-01", "9999-12-31"), ("0001-01-01", "2024-12-01")]:
        assert analyst.execute(_written(MONTHLY, low, high)).fetchall() == []
