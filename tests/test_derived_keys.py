"""Derived grouping keys (issue 11): arithmetic, rounding, width_bucket, numeric casts, text functions.

Decided for both modes on the demo policy as the proxy loads it from the database (column types included), then
answered through the real proxy: the reporter's released groups are exactly the dba's groups that hold at least
k people, and the analyst's released keys are among the dba's.
"""

from __future__ import annotations

from decimal import Decimal

import psycopg
import pytest
from conftest import Endpoint
from suppression_oracle import suppress

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan import bounds
from anonproxy.plan.final_sql import check_final_sql
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

K = 10

ACCEPTED = [
    "select age/10*10, count(*) from adult group by 1",
    'select floor(("age" - 10.0) / 10.0) * 10.0 + 10.0 as "age", count(*) from adult group by 1',
    "select width_bucket(age, 0, 100, 10), count(*) from adult group by 1",
    "select width_bucket(hours_per_week * 1.5, 0, 150, 5), count(*) from adult group by 1",
    "select age % 5, count(*) from adult group by 1",
    "select round(age / 7.0, 1), count(*) from adult group by 1",
    "select ceil(capital_gain / 1000.0), count(*) from adult group by 1",
    "select trunc(fnlwgt / 100000.0), count(*) from adult group by 1",
    "select age::bigint * 2147483647, count(*) from adult group by 1",
    "select 1e308 * capital_gain, count(*) from adult group by 1",
    "select case when age < 30 then 'young' when age < 60 then 'middle' else 'old' end, count(*) "
    "from adult group by 1",
    "select coalesce(nullif(workclass, 'Private'), 'private sector'), count(*) from adult group by 1",
    "select lower(substring(education from 1 for 3)), count(*) from adult group by 1",
    "select left(native_country, 2), right(sex, 1), count(*) from adult group by 1, 2",
    "select upper(trim(race)), count(*) from adult group by 1",
    "select length(occupation), count(*) from adult group by 1",
    "select age::text, count(*) from adult group by 1",
    "select sex, count(*) from adult group by sex, age / 20",
    "select sex, count(*) from adult where age / 10 = 3 and age % 2 = 0 group by sex",
    "select sex, sum(hours_per_week * 2), avg(age / 10 * 10) from adult group by sex",
]


# Accepted in suppress mode, where declared bounds are facts; in dp mode, where values outside them are tolerated
# (age 2148 would make age * 1000000 fail, -2147483648 -age), accepted with age read clamped into [15, 100].
WITHIN_DECLARED_BOUNDS = [
    "select -age, count(*) from adult group by 1",
    "select abs(age - 40), count(*) from adult group by 1",
    "select (age / 10)::smallint, count(*) from adult group by 1",
    "select age::numeric(5,0) / 5, count(*) from adult group by 1",
    "select age * 1000000, count(*) from adult group by 1",
]


@pytest.fixture(scope="module")
def policy(pg_server: EmbeddedPostgres, gated_database: str) -> Policy:
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as conn:
        return load_policy(conn)


def test_the_policy_knows_every_column_type(policy: Policy) -> None:
    adult = policy.tables["public.adult"]
    assert adult.types is not None
    assert adult.types["age"] == "integer" and adult.types["education"] == "text"
    assert set(adult.types) >= {"id", "age", "fnlwgt", "capital_gain", "hours_per_week", "income"}


@pytest.mark.parametrize("sql", ACCEPTED)
def test_derived_keys_are_accepted_in_both_modes(policy: Policy, sql: str) -> None:
    reporter = decide(sql, policy.role("reporter"), policy)
    assert isinstance(reporter, Rewrite), reporter
    analyst = decide(sql, policy.role("analyst"), policy)
    assert isinstance(analyst, Noisy), analyst
    if "sum(" in sql:
        return  # dp mode adds up declared columns only (sum of an expression is refused for lack of bounds)
    plan = plan_dp(analyst.sql, policy.role("analyst"), policy, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(plan, DPPlan), plan
    check_final_sql(plan.sql, policy)  # PostgreSQL's grammar reads the generated SQL: every function allowed


@pytest.mark.parametrize("sql", WITHIN_DECLARED_BOUNDS)
def test_keys_that_fail_outside_the_declared_bounds_read_the_column_clamped_in_dp(policy: Policy, sql: str) -> None:
    assert isinstance(decide(sql, policy.role("reporter"), policy), Rewrite)
    analyst = decide(sql, policy.role("analyst"), policy)
    assert isinstance(analyst, Noisy), analyst
    plan = plan_dp(analyst.sql, policy.role("analyst"), policy, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(plan, DPPlan), plan
    assert "CASE WHEN NOT age IS NULL THEN least(greatest(age, CAST(15 AS INT)), CAST(100 AS INT)) END" in plan.sql
    check_final_sql(plan.sql, policy)


def test_a_refusal_quotes_the_key_as_written_not_clamped(policy: Policy) -> None:
    """The clamp is the proxy's reading of the column, not the client's words: a message names the key as written."""
    sql = "select age * 1000000, count(*) from adult group by 1"  # no public domain: its groups need δ > 0
    analyst = decide(sql, policy.role("analyst"), policy)
    assert isinstance(analyst, Noisy), analyst
    refused = plan_dp(analyst.sql, policy.role("analyst"), policy, DPParams(epsilon=1.0, delta=0.0))
    assert isinstance(refused, Reject), refused
    assert refused.message.startswith('GROUP BY "age" * 1000000 needs δ > 0'), refused.message


def test_the_proof_gives_types_and_intervals() -> None:
    """floor((age - 10.0) / 10.0) * 10.0 + 10.0 over age in [15, 100] is numeric within [10, 100]."""
    import sqlglot

    def facts(column: object) -> bounds.ColumnFacts:
        return bounds.ColumnFacts("age", "integer", Decimal(15), Decimal(100))

    value = bounds.evaluate(sqlglot.parse_one('floor(("age" - 10.0) / 10.0) * 10.0 + 10.0', read="postgres"), facts)
    assert value.type == "numeric" and value.low == 10 and value.high == 100 and not value.nan
    value = bounds.evaluate(sqlglot.parse_one("age / 10 * 10", read="postgres"), facts)
    assert (value.type, value.low, value.high, value.scale) == ("int4", 10, 100, 0)
    value = bounds.evaluate(sqlglot.parse_one("floor(age)", read="postgres"), facts)
    assert value.type == "float8"  # floor(integer) is floor(double precision)


# (expression, type, low, high) over columns: age integer in [15, 100], big bigint, n numeric(5,2), f double
# precision, d date (no bounds declared but age's).
TYPED = [
    ("age / 10 * 10", "int4", 10, 100),
    ("age % 7", "int4", 0, 6),
    ("-age", "int4", -100, -15),
    ("abs(age - 40)", "int4", 0, 60),
    ("age * 1.5", "numeric", Decimal("22.5"), 150),
    ("age::smallint * 300", "int4", 4500, 30000),  # smallint * integer is integer
    ("age::smallint * age::smallint", "int2", 225, 10000),
    ("round(age / 7.0, 1)", "numeric", Decimal("2.1"), Decimal("14.3")),
    ("width_bucket(age, 0, 100, 10)", "int4", 0, 11),
    ("length(t)", "int4", 0, 2**30),
    ("case when age < 30 then 1 else 2.5 end", "numeric", 1, Decimal("2.5")),
    ("n * 100", "numeric", Decimal("-99999"), Decimal("99999")),
    ("f + 0", "float8", None, None),
    ("extract(month from d)", "float8", 1, 12),
]
# (expression, words of the reason)
UNSAFE = [
    ("age::smallint * age::smallint * age::smallint", "overflow smallint"),
    ("f * 2", "overflow double precision"),
    ("big + 1", "overflow bigint"),
    ("age / (age - 40)", "division by"),
    ("age % 0", "modulo by"),
    ("f / 10", "underflow"),
    ("f::int", "NaN or Infinity"),
    ("width_bucket(f, 0, 1, 2)", "NaN"),
    ("n::numeric(4,2) ", "does not fit"),
    ("t::int", "cast to INT"),
    ("substring(t from 1 for age)", "integer constants"),
    ("round(age, age)", "integer constant"),
    ("to_char(d, t)", "constant format"),
    ("age + $1", "parameter"),
    ("d + 1.5", "constant interval"),
    ("d + interval '300000 years'", "range of dates"),
    ("lower(t) + 1", "type text"),
    ("sum(big::numeric * 1000)", "1e+15"),
]


def _facts(column: object) -> bounds.ColumnFacts:
    import sqlglot.expressions as exp
    assert isinstance(column, exp.Column)
    name = column.name
    types = {"age": "integer", "big": "bigint", "n": "numeric(5,2)", "f": "double precision", "d": "date",
             "t": "text"}
    if name == "age":
        return bounds.ColumnFacts(name, types[name], Decimal(15), Decimal(100))
    return bounds.ColumnFacts(name, types[name])


@pytest.mark.parametrize(("expression", "kind", "low", "high"), TYPED)
def test_types_and_intervals(expression: str, kind: str, low: object, high: object) -> None:
    import sqlglot
    value = bounds.evaluate(sqlglot.parse_one(expression, read="postgres"), _facts)
    assert value.type == kind
    if low is not None:
        assert (value.low, value.high) == (low, high), value


@pytest.mark.parametrize(("expression", "words"), UNSAFE)
def test_unsafe_expressions_say_why(expression: str, words: str) -> None:
    import sqlglot
    with pytest.raises(bounds.Unsafe) as caught:
        bounds.evaluate(sqlglot.parse_one(expression, read="postgres"), _facts)
    assert words.lower() in caught.value.reason.lower(), caught.value.reason
    assert caught.value.hint


def _rows(conn: psycopg.Connection, sql: str) -> list[tuple]:
    return [tuple(row) for row in conn.execute(sql).fetchall()]


THROUGH_THE_PROXY = [
    "select age/10*10 as decade, count(*) from adult group by 1",
    'select floor(("age" - 10.0) / 10.0) * 10.0 + 10.0 as "age", count(*) from adult group by 1',
    "select width_bucket(age, 0, 100, 10), count(*) from adult group by 1",
    "select age % 7, count(*) from adult group by 1",
    "select lower(substring(education from 1 for 3)), count(*) from adult group by 1",
    "select round(hours_per_week / 8.0), count(*) from adult where age / 10 = 3 group by 1",
    "select length(native_country), count(*) from adult group by 1",
]


@pytest.mark.parametrize("sql", THROUGH_THE_PROXY)
def test_reporter_gets_the_dbas_groups_of_k_or_more(gated_proxy: Endpoint, gated_database: str, policy: Policy,
                                                    sql: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="dba"), autocommit=True) as dba:
        truth = _rows(dba, sql)
        everyone = dba.execute("select count(*) from adult").fetchone()[0]  # N: one row per person
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as reporter:
        released = _rows(reporter, sql)
    # The reporter's rules on the dba's groups (one row per person: a group's count is its people). Its dominance
    # and p % rules look at sums and averages only, and these queries have none: k decides alone.
    counts = {row[0]: row[-1] for row in truth}
    assert None not in counts, "a NULL key would look like the rest row"
    rules = policy.role("reporter").suppression
    assert rules is not None and rules.k == K
    verdict = suppress(counts, k=rules.k, everyone=everyone, rest=rules.suppressed_rest)
    groups = {row for row in released if row[0] is not None}
    assert groups == {row for row in truth if row[0] in verdict.released}
    # The suppressed-rest row (keys NULL) holds every withheld group, when it passes the same rules.
    rest = [row for row in released if row[0] is None]
    assert rest == ([(None, sum(counts[key] for key in verdict.withheld))] if verdict.rest else [])
    assert len(groups) >= 2


@pytest.mark.parametrize("sql", THROUGH_THE_PROXY[:4])
def test_analyst_gets_some_of_the_dbas_keys_with_noise(gated_proxy: Endpoint, gated_database: str, sql: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="dba"), autocommit=True) as dba:
        truth = {row[0]: row[1] for row in _rows(dba, sql)}
    with psycopg.connect(gated_proxy.dsn(gated_database, user="analyst"), autocommit=True) as analyst:
        released = _rows(analyst, sql)
    assert released and {row[0] for row in released} <= set(truth)
    largest = max(truth, key=lambda key: truth[key])
    assert largest in {row[0] for row in released}  # thousands of people: far past the threshold


def test_refusals_show_the_safe_form(policy: Policy) -> None:
    for sql, hint in [
        ("select 1/(age-37), count(*) from adult group by 1", "Divide by a non-zero constant"),
        ("select fnlwgt * 10000, count(*) from adult group by 1", "Cast to numeric first"),
        ("select (education)::int, count(*) from adult group by 1", "Cast columns to text"),
    ]:
        for role in ("reporter", "analyst"):
            decision = decide(sql, policy.role(role), policy)
            if isinstance(decision, Noisy):
                decision = plan_dp(decision.sql, policy.role(role), policy, DPParams(epsilon=1.0, delta=1e-6))
            assert isinstance(decision, Reject), decision
            assert decision.sqlstate == "0A000" and hint in (decision.hint or ""), decision
