"""Red team, as a property: calendar answers over the demo's ``visits`` do not depend on one person beyond the rules.

Generated statements (a calendar key of ``visited_at`` — date_trunc of a unit, extract of a field, to_char with a
fixed format, a cast to date, date_bin — with or without a channel, a WHERE narrowing the time range or not,
count/sum/avg) run through the proxy on the data, then again after one person gets visits of their own: one at an
instant no one else has, inside the declared range (2025-2026), and one outside it (2031), where no bucket of the
public range lies. The owner's connection computes the truth. What must hold:

* suppress (the demo reporter, k = 10): every released bucket has at least k people, its values are PostgreSQL's
  own, and the added person's lone instant (a bucket of one person) is never released;
* dp (an analyst with a budget of its own): a calendar key of a bounded column has a public domain, so the set of
  buckets released is the same with and without the person: it depends on the statement and the declared range
  only, never on whether one person's visit lies in or outside the range.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

K = 10
SEED = 20261129
EXAMPLES = 10
KEYS = [
    "date_trunc('{unit}', visited_at)",
    "extract({field} from visited_at)",
    "to_char(visited_at, '{format}')",
    "cast(visited_at as date)",
    "date_bin(interval '{stride}', visited_at, timestamptz '2025-01-01 00:00:00+00')",
]
UNITS = ["week", "month", "quarter", "year", "day"]
FIELDS = ["month", "quarter", "year", "dow", "isodow", "hour"]
FORMATS = ["YYYY-MM", "YYYY", "IYYY-IW", "Q", "Dy"]
STRIDES = ["7 days", "30 days", "12 hours"]
AGGREGATES = ["count(*)", "sum(amount)", "avg(amount)"]
LONE = "2025-07-14 03:17:29.123456+00"  # an instant none of the demo's visits has (they are whole seconds)
OUTSIDE = "2031-06-15 12:00:00+00"  # after the declared range


@dataclass(frozen=True)
class Statement:
    """A drawn statement: its grouping keys, its aggregate, its WHERE clause (may be empty)."""

    keys: tuple[str, ...]
    aggregate: str
    where: str

    def sql(self, extra: str = "") -> str:
        """The client's statement; ``extra``: more columns after the aggregate (the truth's)."""
        columns = ", ".join(f"{key} as k{i}" for i, key in enumerate(self.keys))
        group = ", ".join(str(i + 1) for i in range(len(self.keys)))
        return f"select {columns}, {self.aggregate} as v{extra} from visits{self.where} group by {group}"

    def __str__(self) -> str:
        return self.sql()


def draw(rng: random.Random) -> Statement:
    key = rng.choice(KEYS).format(unit=rng.choice(UNITS), field=rng.choice(FIELDS), format=rng.choice(FORMATS),
                                  stride=rng.choice(STRIDES))
    where = ""
    if rng.random() < 0.5:
        month = rng.randrange(1, 13)
        where = (f" where visited_at >= timestamptz '2025-{month:02d}-01 00:00:00+00' "
                 f"and visited_at < timestamptz '2026-{month:02d}-01 00:00:00+00'")
    return Statement((key, "channel") if rng.random() < 0.3 else (key,), rng.choice(AGGREGATES), where)


STATEMENTS = [draw(random.Random(SEED + n)) for n in range(EXAMPLES)]
# suppress only: a key as fine as the person's lone instant (dp lists no public domain that fine)
FINE = Statement(("date_trunc('second', visited_at)",), "count(*)",
                 " where visited_at between timestamptz '2025-07-14 03:00:00+00' and timestamptz '2025-07-14 04:00:00+00'")


@pytest.fixture(scope="module")
def person(truth: psycopg.Connection[Any]) -> int:
    return int(truth.execute("select min(person_id) from public.visits").fetchone()[0])


@pytest.fixture
def added(truth: psycopg.Connection[Any], person: int) -> Iterator[None]:
    """The person's own visits, for the time of one test (the shared database is left as it was)."""
    first = int(truth.execute("select max(visit_id) from public.visits").fetchone()[0]) + 1
    truth.execute("insert into public.visits values (%s, %s, %s, 'web', 10), (%s, %s, %s, 'web', 10)",
                  [first, person, LONE, first + 1, person, OUTSIDE])
    try:
        yield
    finally:
        truth.execute("delete from public.visits where visit_id >= %s", [first])


def truth_of(truth: psycopg.Connection[Any], statement: Statement) -> dict[tuple[Any, ...], tuple[Any, int]]:
    """Each bucket of ``statement`` as PostgreSQL computes it: its value and its distinct people."""
    rows = truth.execute(statement.sql(", count(distinct person_id)")).fetchall()
    return {tuple(row[:-2]): (row[-2], row[-1]) for row in rows}


def same(left: Any, right: Any) -> bool:
    if isinstance(left, Decimal) or isinstance(right, Decimal):
        return abs(Decimal(left) - Decimal(right)) <= Decimal("1e-9") * max(1, abs(Decimal(right)))
    return bool(left == right)


@pytest.fixture(scope="module")
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def check_released(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], statement: Statement) -> None:
    expected = truth_of(truth, statement)
    for row in reporter.execute(statement.sql()).fetchall():
        key, value = tuple(row[:-1]), row[-1]
        if all(part is None for part in key):
            continue  # the suppressed-rest row, if the role has one
        assert key in expected, (statement, row)
        truth_value, count = expected[key]
        assert count >= K, (statement, row, count)
        assert same(value, truth_value), (statement, row, truth_value)


@pytest.mark.parametrize("statement", [*STATEMENTS, FINE], ids=str)
def test_suppress_releases_only_buckets_of_k_people_with_one_person_added(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], statement: Statement,
        request: pytest.FixtureRequest) -> None:
    check_released(reporter, truth, statement)
    request.getfixturevalue("added")
    check_released(reporter, truth, statement)


@pytest.fixture(scope="module")
def analyst(gated_proxy: Endpoint, gated_database: str,
            truth: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "rt_time_property", epsilon=2 * EXAMPLES + 2) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        yield conn


def budget(conn: psycopg.Connection[Any]) -> Any:
    return conn.execute("show anonproxy.budget").fetchone()


@pytest.mark.parametrize("statement", STATEMENTS, ids=str)
def test_dp_calendar_buckets_do_not_depend_on_one_person(analyst: psycopg.Connection[Any], statement: Statement,
                                                         request: pytest.FixtureRequest) -> None:
    before = {tuple(row[:-1]) for row in analyst.execute(statement.sql()).fetchall()}
    request.getfixturevalue("added")
    left = budget(analyst)
    after = {tuple(row[:-1]) for row in analyst.execute(statement.sql()).fetchall()}
    assert budget(analyst) != left  # measured again on the changed data, not the cached answer
    assert before and before == after, (statement, before ^ after)


def test_the_person_s_lone_second_is_a_bucket_of_one_that_is_withheld(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], added: None) -> None:
    """FINE's buckets include the added person's lone second, a bucket of one person: it is in PostgreSQL's answer,
    not in the reporter's."""
    lone = {key for key, (_, count) in truth_of(truth, FINE).items() if count < K}
    assert lone
    released = {tuple(row[:-1]) for row in reporter.execute(FINE.sql()).fetchall()}
    assert not lone & released
