"""dp mode reads a bounded integer or numeric column clamped into its declared bounds where the no-error proof
needs them (anonproxy.plan.clamp, docs/dp.md "Arithmetic on bounded columns").

Integer arithmetic the proof admits only within the declared bounds (``age + 1``, ``hours_per_week * 52``,
``capital_gain - capital_loss``, ``-age``) is answered in dp mode: its SQL reads those columns as
``LEAST(GREATEST(col, lo), hi)`` (NULL kept), so one person outside the bounds can make no row fail, and counts as
the bound. Through the gated proxy with a real driver: answers within the noise the proxy states (its 95 %
interval, dp_interval_low/high) of PostgreSQL's own; and, over generated expressions with one person far outside
the bounds, never an error but a refusal decided on the statement alone (the same without that person)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from conftest import attack_roles

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy

# The demo declares age in [15, 100], hours_per_week in [0, 100], capital_gain in [0, 100000], capital_loss in
# [0, 5000]; the adult data lies within them.
BOUNDED = ("age", "hours_per_week", "capital_gain", "capital_loss")


analyst = attack_roles("dp_clamped", epsilon=1000)[1]


@contextmanager
def outlier(truth: psycopg.Connection[Any]) -> Iterator[int]:
    """One person far outside every declared bound (values at the ends of integer's range), put back afterwards:
    that person's id."""
    row = truth.execute("select id, age, hours_per_week, capital_gain, capital_loss from adult order by id "
                        "limit 1").fetchone()
    truth.execute("update adult set age = -2147483648, hours_per_week = 2147483647, capital_gain = 2147483647, "
                  "capital_loss = -2147483648 where id = %s", [row[0]])
    try:
        yield int(row[0])
    finally:
        truth.execute("update adult set age = %s, hours_per_week = %s, capital_gain = %s, capital_loss = %s "
                      "where id = %s", [*row[1:], row[0]])


def _budget(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("show anonproxy.budget").fetchone()[0])


# (statement with its 95 % interval: value, low, high; PostgreSQL's statement of the same value)
ANSWERED = [
    ("select count(*) as n, dp_interval_low(n), dp_interval_high(n) from adult where age + 1 > 30",
     "select count(*) from adult where age + 1 > 30"),
    ("select sum(hours_per_week * 52) as s, dp_interval_low(s), dp_interval_high(s) from adult",
     "select sum(hours_per_week * 52) from adult"),
    ("select avg(capital_gain - capital_loss) as a, dp_interval_low(a), dp_interval_high(a) from adult",
     "select avg(capital_gain - capital_loss) from adult"),
    ("select count(*) as n, dp_interval_low(n), dp_interval_high(n) from adult where -age < -40",
     "select count(*) from adult where -age < -40"),
]


@pytest.mark.parametrize(("sql", "expected"), ANSWERED)
def test_integer_arithmetic_on_bounded_columns_is_answered_close_to_postgresql(
        analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any], sql: str, expected: str) -> None:
    """Refused in dp before (0A000, "Cast to numeric first"); now answered, within four times the half-width of
    the 95 % interval the proxy states of PostgreSQL's answer (a Laplace error past that has odds of 20⁻⁴)."""
    true = float(truth.execute(expected).fetchone()[0])
    value, low, high = (float(v) for v in analyst.execute(sql).fetchone())
    assert low <= value <= high
    assert abs(value - true) <= 4 * (high - low) / 2, (value, low, high, true)


@pytest.mark.parametrize("key", ["age * 2", "-age"])
def test_a_key_of_integer_arithmetic_is_answered_close_to_postgresql(analyst: psycopg.Connection[Any],
                                                                      truth: psycopg.Connection[Any],
                                                                      key: str) -> None:
    """GROUP BY age * 2 and -age: the groups released (partition selection) are PostgreSQL's groups, every group
    of 100 people or more among them, each count within four half-widths of its stated 95 % interval of
    PostgreSQL's count. (A small group is released only when its noise took it past the threshold: its count is
    not compared.)"""
    expected = dict(truth.execute(f"select {key}, count(*) from adult group by 1").fetchall())
    rows = analyst.execute(f"select {key} as k, count(*) as n, dp_interval_low(n), dp_interval_high(n) "
                           "from adult group by 1").fetchall()
    released = {k: (n, low, high) for k, n, low, high in rows}
    assert set(released) <= set(expected)
    large = {k: count for k, count in expected.items() if count >= 100}
    assert len(large) > 20 and set(large) <= set(released)  # ages 17 to 90: most groups are far past the threshold
    for k, count in large.items():
        n, low, high = released[k]
        assert abs(n - count) <= 4 * (high - low) / 2, (k, n, low, high, count)


def test_an_out_of_bounds_person_counts_at_the_bound(analyst: psycopg.Connection[Any],
                                                     truth: psycopg.Connection[Any]) -> None:
    """PostgreSQL fails on the outlier's row (-age overflows integer); the proxy reads age clamped into [15, 100]:
    the outlier, at age -2147483648, counts as 15 in WHERE -age > -16 (selected by the clamped value), and the
    answer is PostgreSQL's count of the clamped reading, within the stated noise."""
    with outlier(truth) as person:
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):
            truth.execute("select count(*) from adult where -age > -16").fetchall()
        clamped = truth.execute("select count(*) from adult where -least(greatest(age, 15), 100) > -16").fetchone()[0]
        assert clamped == truth.execute("select count(*) from adult where age = 15 or id = %s",
                                        [person]).fetchone()[0]
        value, low, high = analyst.execute("select count(*) as n, dp_interval_low(n), dp_interval_high(n) "
                                           "from adult where -age > -16").fetchone()
    assert abs(value - clamped) <= 4 * (high - low) / 2, (value, low, high, clamped)


def test_a_clamped_column_keeps_its_nulls(analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """amount (numeric(10,2), declared in [0, 1000]) times 100 cast to integer overflows for amounts the type holds,
    and is admitted with amount read clamped; the visits a LEFT JOIN finds none of leave amount NULL, and a NULL
    stays NULL (not the lower bound): count() of it is PostgreSQL's 0, not the 30,162 adults."""
    sql = ("select count((v.amount * 100)::int) as n, dp_interval_low(n), dp_interval_high(n) from adult a "
           "left join visits v on v.person_id = a.id and v.channel = 'nowhere'")
    assert truth.execute("select count((v.amount * 100)::int) from adult a left join visits v "
                         "on v.person_id = a.id and v.channel = 'nowhere'").fetchone()[0] == 0
    value, low, high = analyst.execute(sql).fetchone()
    assert abs(value) <= 4 * (high - low) / 2, (value, low, high)


@pytest.fixture(scope="module")
def policy(truth: psycopg.Connection[Any]) -> Policy:
    return load_policy(truth)


@pytest.mark.parametrize("sql", [
    "select sex, count(*), sum(age), avg(hours_per_week) from adult where age > 30 group by sex",
    "select count(*) from adult where capital_gain::numeric * 21000 > 0 and age between 20 and 30",
    "select age / 10 * 10 as decade, count(*) from adult group by 1",
    "select sum(age / 10), avg(hours_per_week::numeric * 52) from adult",
])
def test_statements_that_need_no_bounds_keep_their_sql(policy: Policy, sql: str) -> None:
    """A statement the proof admits without declared bounds reads no column clamped: its SQL, hence its answer
    cache key (the plan's measured SQL), is what it was before columns were ever clamped."""
    plan = plan_dp(sql, policy.role("analyst"), policy, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(plan, DPPlan), plan
    # (an aggregate's own clamp of its argument, CASE WHEN x IS NOT NULL THEN LEAST(GREATEST(...)), is as before)
    clamp = "CASE WHEN NOT "  # how a column read clamped is written (anonproxy.plan.clamp)
    assert clamp not in plan.sql and clamp not in plan.measured


# --- a property: generated arithmetic, one person outside the bounds --------------------------------------------

CONSTANTS = (1, 2, 7, 52, 999, 21000, 65536, 1000003, 21000000, 2147483647)


def _expression(rng: random.Random, depth: int) -> str:
    """Integer arithmetic over the bounded columns and constants: + - * and unary minus, nested."""
    if depth == 0 or rng.random() < 0.25:
        return rng.choice([*BOUNDED, *BOUNDED, str(rng.choice(CONSTANTS))])
    if rng.random() < 0.15:
        return f"-({_expression(rng, depth - 1)})"
    operator = rng.choice(["+", "-", "*", "*"])
    return f"({_expression(rng, depth - 1)} {operator} {_expression(rng, depth - 1)})"


def _statements(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    shapes = ["select count(*) from adult where {e} > {c}",
              "select sum({e}) from adult",
              "select avg({e}) from adult where {f} <> 0",
              "select sex, count(*) from adult where {e} < {c} group by sex",
              "select {e} as k, count(*) from adult group by 1"]
    statements = []
    while len(statements) < count:
        expression = _expression(rng, 3)
        if not any(column in expression for column in BOUNDED):
            continue
        statements.append(rng.choice(shapes).format(e=expression, f=_expression(rng, 2), c=rng.choice(CONSTANTS)))
    return statements


def _outcome(conn: psycopg.Connection[Any], sql: str) -> tuple[str, str]:
    """("answered", "") or the error's (SQLSTATE, message); a refusal charges nothing."""
    before = _budget(conn)
    try:
        conn.execute(sql).fetchall()
    except psycopg.Error as error:
        assert _budget(conn) == before, sql
        return str(error.sqlstate), error.diag.message_primary or ""
    return "answered", ""


def test_generated_arithmetic_never_fails_on_an_out_of_bounds_person(analyst: psycopg.Connection[Any],
                                                                      truth: psycopg.Connection[Any]) -> None:
    """Sixty statements of generated integer arithmetic over the bounded columns (a fixed seed), asked first with one
    person holding integer's extreme values in all four, then without: each is answered both times, or refused both
    times with the same refusal (0A000, decided on the statement: nothing charged). Never an error from a row."""
    statements = _statements(seed=20261129, count=60)
    with outlier(truth):
        with_outlier = [_outcome(analyst, sql) for sql in statements]
    without = [_outcome(analyst, sql) for sql in statements]
    for sql, first, second in zip(statements, with_outlier, without, strict=True):
        assert first == second, (sql, first, second)
        assert first[0] == "answered" or not first[0].startswith(("22", "XX")), (sql, first)
    answered = sum(outcome[0] == "answered" for outcome in with_outlier)
    assert 10 <= answered < len(statements), answered  # both kinds occur: the property is not vacuous
