"""Error and overflow side channels of derived expressions (issue 11).

An expression that fails for some rows and not others answers a question about
them: ``GROUP BY 1/(age - 37)`` fails exactly when someone is 37. Two kinds of
test here:

* through the real proxy, as the reporter (suppress) and the analyst (dp):
  every such attack is refused with 0A000 or 42501 and a hint;
* the proof against PostgreSQL itself: a table holding each type's extreme
  values (int limits, NaN, ±Infinity, the smallest floats, empty strings) is
  protected and its policy loaded from the database; every expression the
  proxy admits runs over those rows without error, and every one it refuses
  does fail on them — so the refusals are needed, and the admissions are sound.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import Endpoint

from anonproxy.dp.model import DPParams
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import Policy, RolePolicy, SuppressionParams
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

ATTACKS = [
    "select 1/(age-37), count(*) from adult group by 1",
    "select count(*) from adult group by 1/(age-37)",
    "select count(*) from adult where 100 / (age - 37) > 1",
    "select age % (age - 37), count(*) from adult group by 1",
    "select age*2147483647, count(*) from adult group by 1",
    "select count(*) from adult group by fnlwgt * fnlwgt",
    "select -(age * 100000000), count(*) from adult group by 1",
    "select (age::text)::int, count(*) from adult group by 1",
    "select education::numeric, count(*) from adult group by 1",
    "select cast(native_country as bigint), count(*) from adult group by 1",
    "select count(*) from adult where income::int = 1",
    "select to_char(age, 'FM999'), count(*) from adult group by 1",
    # to_char(age, $1): the format is decided at Bind as if written (tests/test_bind_time.py)
    "select substring(education from age), count(*) from adult group by 1",
    "select substring(education from 1 for age - 40), count(*) from adult group by 1",
    "select left(education, age - 40), count(*) from adult group by 1",
    "select substring(education from 'a(.*)'), count(*) from adult group by 1",
    "select width_bucket(age, 0, 0, 10), count(*) from adult group by 1",
    "select width_bucket(age, 0, 100, 0), count(*) from adult group by 1",
    "select width_bucket(age, 0, age, 10), count(*) from adult group by 1",
    "select count(*) from adult group by case when id = 17 then 1/0 end",
    "select count(*) from adult where case when age = 37 then 1/0 else 1 end = 1",
    "select count(*) from adult where case when age = 37 then age / 0 else 1 end = 1",
    "select repeat(education, 100000000), count(*) from adult group by 1",
    "select lpad(education, 100000000), count(*) from adult group by 1",
    "select date_trunc(education, age), count(*) from adult group by 1",
    "select count(*) from adult group by age + $1",
    "select round(age, age), count(*) from adult group by 1",
    "select sex, sum(capital_gain * 100000) from adult group by sex",
    "select sex, sum(fnlwgt * 1000000000) from adult group by sex",
    "select power(age, 100), count(*) from adult group by 1",
    "select age || 'x', count(*) from adult group by 1",
]


def _decision_through(conn: psycopg.Connection, sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    return caught.value


@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_error_side_channels_are_refused_through_the_proxy(gated_proxy: Endpoint, gated_database: str,
                                                          role: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        for sql in ATTACKS:
            error = _decision_through(conn, sql)
            assert error.sqlstate in ("0A000", "42501"), (sql, error.sqlstate, str(error))
            assert error.diag.message_hint, (sql, str(error))


# --- the proof against PostgreSQL's own behaviour ---------------------------------------------------------------

EDGE_TABLE = """
create table public.edge (
    id integer primary key, i2 smallint, i4 integer, i8 bigint, n numeric, n52 numeric(5,2), f4 real,
    f8 double precision, t text, d date, ts timestamp, b4 integer, bn numeric, bf double precision
)
"""
# Each type's extremes, in separate rows (a row of ordinary values first). b4, bn and bf are declared in [0, 100]
# and hold values within that, the smallest positive double among them.
EDGE_ROWS = """
insert into public.edge values
    (1, 1, 1, 1, 1.5, 1.5, 1.5, 1.5, 'abc', '2000-01-31', '2000-01-31 12:00', 50, 50.5, 50.5),
    (2, 32767, 2147483647, 9223372036854775807, 'NaN', 'NaN', 'NaN', 'NaN', '', 'infinity', 'infinity',
     100, 100, 100),
    (3, -32768, -2147483648, -9223372036854775808, 'Infinity', 999.99, 'Infinity', 'Infinity', 'x', '-infinity',
     '-infinity', 0, 0, 0),
    (4, 0, 0, 0, '-Infinity', -999.99, 3.4e38, 1.7e308, 'éé', '5874897-12-31', '294276-12-31 23:59', 1,
     1e-300, 5e-324),
    (5, -1, -1, -1, 1e-400, 0.01, 1e-45, -5e-324, '12', '4713-01-01 BC', '1000-01-01', 99, 99.99, 1e-300),
    (6, 2, 2, 2, repeat('9', 131072)::numeric, 2, 2, 2, 'abc', '2000-01-31', '2000-01-31', 2, 1e-400, 2)
"""

# Admitted: none of these may fail on any row above.
ADMITTED = [
    "i4 / 10 * 10", "i4 % 7", "i4 / 3", "i2 + 1", "i2::int + 1", "i4::bigint * 2", "i4::numeric * 1000",
    "i8::numeric * i8::numeric", "-i2::int", "abs(i4::bigint)", "floor(i8)", "round(i4 / 7.0, 2)",
    "floor((i4 - 10.0) / 10.0) * 10.0 + 10.0", "width_bucket(i4, 0, 100, 10)", "width_bucket(b4 * 1.5, 0, 150, 5)",
    "width_bucket(bf, 0, 100, 4)", "width_bucket(bn, 0, 100, 4)", "n52 * 100", "(n52 * 10)::numeric(6,1)",
    "b4 * 2147483", "bn * 1e100", "bn::int", "bf::int", "bf + 1", "bf - 1.5", "bf * 2", "floor(bf / 1e-200)",
    "f8::numeric", "f8 + 0", "i4::float8 * 1e290", "i2 * 1.5", "n * 0.5", "n / 10", "n % 5", "n::text", "f8::text",
    "extract(year from d)", "extract(month from ts)", "to_char(ts, 'YYYY-MM')", "date_trunc('day', ts)",
    "substring(t from 2 for 3)", "left(t, 2)", "right(t, -1)", "length(t)", "upper(trim(t))",
    "case when i4 > 0 then i4 / 2 else 0 end", "coalesce(b4 * 10, 0)", "nullif(i4 % 2, 0)",
    "n > 1.5", "i4 > f8", "i8 = f4", "case when i4 > 0 then b4 else bf end",
]
# Refused: each fails on some row above (so the refusal closes a real side channel).
REFUSED = [
    "i4 * 2", "i4 + 1", "-i4", "abs(i4)", "i2 * i2", "i8 * 2", "i4 / (i4 - 1)", "i4 % (i2 + 1)", "i8::int",
    "i4::smallint", "n::int", "n * 10", "n + 1", "f8::int", "f8 * 2", "f8 / 10", "f8 * 0.5", "f4 * f4",
    "bf / 10", "bf * 0.5", "bf::real / 10", "width_bucket(f8, 0, 100, 10)", "width_bucket(n, 0, 100, 10)",
    "(n52 * 10)::numeric(4,1)", "t::int", "t::numeric", "extract(year from d)::int", "bn::float4 * 1",
    "i4 * 1.0 / 0", "substring(t from 1 for i4)",
    # a numeric compared or merged with a float is converted to float, and may not fit
    "n > 1.5::float8", "case when i4 > 0 then n else f8 end", "coalesce(n, f8)", "bn > f8",
]


@pytest.fixture
def edge(dbname: str, direct: Endpoint, gated_database: str) -> tuple[psycopg.Connection, Policy]:
    """public.edge protected in a fresh database (gated_database: the service role the grants need exists)."""
    conn = psycopg.connect(direct.dsn(dbname), autocommit=True)
    conn.execute(EDGE_TABLE)
    conn.execute(EDGE_ROWS)
    conn.execute("select anonproxy.protect_table('public.edge', 'id')")
    for column in ("b4", "bn", "bf"):
        conn.execute("select anonproxy.set_column('public.edge', %s, 'sensitive', 0, 100)", (column,))
    return conn, load_policy(conn)


SUPPRESS = RolePolicy("r", "suppress", SuppressionParams(k=10))
DP = RolePolicy("a", "dp")


def _admitted(sql: str, policy: Policy) -> bool:
    suppress = decide(sql, SUPPRESS, policy)
    dp = decide(sql, DP, policy)
    if isinstance(dp, Noisy):
        dp = plan_dp(dp.sql, DP, policy, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(suppress, (Rewrite, Reject)), suppress
    # dp trusts declared bounds only where it reads the column clamped (docs/dp.md): what it admits suppress admits
    assert isinstance(suppress, Rewrite) or isinstance(dp, Reject), (sql, suppress, dp)
    return isinstance(suppress, Rewrite)


def test_admitted_expressions_never_fail_on_extreme_values(edge: tuple[psycopg.Connection, Policy]) -> None:
    conn, policy = edge
    for expression in ADMITTED:
        assert _admitted(f"select {expression}, count(*) from edge group by 1", policy), expression
        conn.execute(f"select ({expression})::text from public.edge").fetchall()  # raises if the proof was wrong


def test_refused_expressions_do_fail_on_some_extreme_value(edge: tuple[psycopg.Connection, Policy]) -> None:
    conn, policy = edge
    for expression in REFUSED:
        sql = f"select {expression}, count(*) from edge group by 1"
        decision = decide(sql, SUPPRESS, policy)
        assert isinstance(decision, Reject) and decision.sqlstate in ("0A000", "42501") and decision.hint, \
            (expression, decision)
        assert not _admitted(sql, policy), expression
        failures = 0
        for row in range(1, 7):
            try:
                conn.execute(f"select {expression} from public.edge where id = {row}").fetchall()
            except psycopg.Error:
                failures += 1
        # Fails for some rows and not others: the error is a side channel (or fails for every row, as a constant
        # division by zero does when the statement is planned).
        assert failures >= 1, expression


def test_the_policy_reads_types_of_every_column(edge: tuple[psycopg.Connection, Policy]) -> None:
    conn, policy = edge
    types = policy.tables["public.edge"].types
    assert types is not None
    assert types["n52"] == "numeric(5,2)" and types["f4"] == "real" and types["ts"] == "timestamp without time zone"
    assert types["i2"] == "smallint" and "t" in types  # undeclared columns too
    # A linked table's columns, and a domain read as its base type.
    conn.execute("create domain public.money2 as numeric(8,2) check (value >= 0)")
    conn.execute("create table public.edge_visits (person integer, cost public.money2, note varchar(20))")
    conn.execute("select anonproxy.link_table('public.edge_visits', 'person', 'public.edge')")
    linked = load_policy(conn).links["public.edge_visits"].types
    assert linked == {"person": "integer", "cost": "numeric(8,2)", "note": "character varying(20)"}
    visits = "select count(*) from edge_visits v where v.cost * 1000 > 5 and left(v.note, 2) = 'ab'"
    assert isinstance(decide(visits, SUPPRESS, load_policy(conn)), Rewrite)
