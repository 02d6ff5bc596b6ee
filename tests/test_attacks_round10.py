"""Red team, round 10: date_bin's origin far from the data (suppress), the dp answer cache's key on Unicode-escaped
and dollar-quoted tokens, outer queries over released rows (window functions, DISTINCT ON, LATERAL), arithmetic
over a withheld aggregate (suppress), and declared bounds in dp's no-error proof (facts only where dp reads the
column clamped).

Each attack asserts the safe outcome. date_bin subtracts its origin from the value in 64 bits of microseconds, and
PostgreSQL raises "interval out of range" past them: the timestamp range (4714 BC to 294276 AD) spans more than
that, so an origin at its start fails for the values far enough from it only. That is checked on the no-error
proof itself (with PostgreSQL's own error beside it); the key's tokens on PostgreSQL's readings; the other attacks
run through the real gated proxy with a real driver."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from conftest import attack_roles

from anonproxy.dp.answers import folded
from anonproxy.plan import bounds
from anonproxy.plan import time_values as tv
from anonproxy.plan.statements import parse_statement, split

Rows = list[tuple[Any, ...]]
BY_AGE = "select age, count(*) as n from adult group by age"


reporter, analyst = attack_roles("dp_round10")


@pytest.fixture(scope="module")
def rare_age(truth: psycopg.Connection[Any]) -> int:
    """An age fewer than k = 10 people have: its group is withheld when asked alone."""
    row = truth.execute("select age from adult group by age having count(*) between 1 and 9 order by age limit 1")
    return int(row.fetchone()[0])


# --- suppress: date_bin from an origin too far from the data -------------------------------------------------------

# A timestamp column known to lie in 150000 AD (facts as the proof takes them), moved by 1,227,000,000 hours (about
# 139,973 years): every value stays a timestamp (10027 to 289974 AD), but more than 2^63 microseconds after 4713 BC.
FAR_FACTS = bounds.ColumnFacts("at", "timestamp", earliest=tv.civil(150000), latest=tv.civil(150001))
SHIFTED = "{0} + interval '700000000 hours' + interval '527000000 hours'"


def _proved(sql: str) -> bounds.Value:
    """The proof's value of the select item of ``sql`` over a column ``at`` of FAR_FACTS."""
    item = parse_statement(split(f"select {sql}")[0]).expressions[0]
    return bounds.evaluate(item, lambda column: FAR_FACTS)


def test_a_date_bin_origin_too_far_from_the_values_is_refused(truth: psycopg.Connection[Any]) -> None:
    """date_bin('1 day', x, TIMESTAMP '4713-01-01 BC') subtracts the origin in 64 bits: PostgreSQL fails with
    "interval out of range" for the values further than 2^63 microseconds from it, though the values and the origin
    are timestamps. The proof used to admit it (it checked the range of the result only); such an error would depend
    on the rows. Not reachable through a policy today (declared bounds end by 9999 AD, undeclared columns are taken
    to lie in 2000 BC to 200000 AD, and a shift moves both ends), so checked on the proof itself."""
    moved = SHIFTED.format("timestamp '150000-06-01'")
    with pytest.raises(psycopg.Error) as caught:
        truth.execute(f"select date_bin('1 day', {moved}, timestamp '4713-01-01 BC')").fetchall()
    assert caught.value.sqlstate == "22008", caught.value
    assert _proved(SHIFTED.format("at")).high < tv.TS_END  # the value moved is a timestamp
    with pytest.raises(bounds.Unsafe, match="too far from the origin"):
        _proved(f"date_bin('1 day', {SHIFTED.format('at')}, timestamp '4713-01-01 BC')")


def test_a_date_bin_origin_near_the_values_is_admitted(truth: psycopg.Connection[Any]) -> None:
    """The same values from an origin in 2000 AD: within 2^63 microseconds of every one, admitted, and PostgreSQL
    answers for the furthest."""
    moved = SHIFTED.format("timestamp '150001-01-01'")
    assert truth.execute(f"select date_bin('1 day', {moved}, timestamp '2000-01-01') is not null").fetchone() == (True,)
    assert _proved(f"date_bin('1 day', {SHIFTED.format('at')}, timestamp '2000-01-01')").type == "timestamp"


# --- dp: the answer cache's key on escaped and dollar-quoted tokens ---------------------------------------------

# Texts PostgreSQL reads differently though they differ only in the case of an escaped or dollar-quoted token: one
# key for both would answer the second question with the first one's noisy answer, charged nothing.
ESCAPED = [
    ('select U&"A" from key_tokens10', 'select U&"a" from key_tokens10'),
    ("select U&'!0041' uescape '!' from key_tokens10", "select U&'!0061' uescape '!' from key_tokens10"),
    ("select U&'\\0041' from key_tokens10", "select U&'\\0061' from key_tokens10"),
    ("select $$A$$ from key_tokens10", "select $$a$$ from key_tokens10"),
    ("select $q$A$q$ from key_tokens10", "select $Q$A$Q$ || 'x' from key_tokens10"),
    ("select E'\\x41' from key_tokens10", "select E'\\x61' from key_tokens10"),
]


@pytest.fixture
def key_table(truth: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    truth.execute('create temp table key_tokens10 (a int, "A" int)')
    truth.execute("insert into key_tokens10 values (1, 2)")
    yield truth
    truth.execute("drop table key_tokens10")


@pytest.mark.parametrize(("one", "other"), ESCAPED)
def test_escaped_tokens_read_differently_have_different_keys(key_table: psycopg.Connection[Any], one: str,
                                                             other: str) -> None:
    def read(sql: str) -> tuple[list[str], Rows]:
        cursor = key_table.execute(sql)
        return [column.name for column in cursor.description or []], cursor.fetchall()

    assert read(one) != read(other)
    assert folded(one) != folded(other)


# --- suppress: outer queries over released rows ----------------------------------------------------------------


def test_a_window_over_released_rows_adds_up_released_rows(reporter: psycopg.Connection[Any],
                                                           rare_age: int) -> None:
    """sum(n) OVER () and rank() OVER (ORDER BY n) in an outer query: computed over what the inner query releases
    (its groups and the suppressed-rest row), never over the rare age's withheld group."""
    released = reporter.execute(BY_AGE).fetchall()
    rows = reporter.execute(f"select age, n, sum(n) over (), count(*) over () from ({BY_AGE}) q").fetchall()
    assert sorted(rows, key=str) == sorted(((age, n, sum(m for _, m in released), len(released))
                                            for age, n in released), key=str)
    assert rare_age not in {age for age, *_ in rows}


def test_distinct_on_over_released_rows_picks_among_them(reporter: psycopg.Connection[Any], rare_age: int) -> None:
    """DISTINCT ON (n) over the released rows: one row per released count, the smallest age first; a rare age's
    count (fewer than k) is not among them."""
    released = reporter.execute(BY_AGE).fetchall()
    rows = reporter.execute(f"select distinct on (n) age, n from ({BY_AGE}) q order by n, age").fetchall()
    first: dict[int, Any] = {}
    for age, n in sorted(released, key=lambda row: (row[1], row[0] is None, row[0])):
        first.setdefault(n, age)
    assert rows == sorted(((age, n) for n, age in first.items()), key=lambda row: row[1])
    assert rare_age not in {age for age, _ in rows}


@pytest.mark.parametrize("sql", [
    # an aggregate per outer row, correlated through LATERAL: a count per age, the rare one's included
    "select q.age, l.n from (select age from adult group by age) q, "
    "lateral (select count(*) as n from adult a where a.age = q.age) l",
    "select q.age, l.n from (select age, count(*) as c from adult group by age) q "
    "cross join lateral (select q.c * 1 as n) l where q.age = {0}",
    "select l.n from (select 1) q, lateral (select count(*) as n from adult where age = {0}) l",
])
def test_lateral_around_an_aggregate_is_refused(reporter: psycopg.Connection[Any], rare_age: int, sql: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        reporter.execute(sql.format(rare_age)).fetchall()
    assert caught.value.sqlstate == "0A000", caught.value
    assert caught.value.diag.message_hint, caught.value


# --- suppress: arithmetic over a withheld aggregate --------------------------------------------------------------


@pytest.fixture(scope="module")
def small_group(truth: psycopg.Connection[Any]) -> tuple[int, int, int]:
    """An age that 2 to 9 people have (withheld), with its people's capital gains summing above 0: the age, its
    count and that sum."""
    row = truth.execute("select age, count(*), sum(capital_gain) from adult group by age "
                        "having count(*) between 2 and 9 and sum(capital_gain) > 0 order by age limit 1").fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def _overflowing(value: int) -> tuple[int, int]:
    """Two bigint factors: ``value`` times the first leaves bigint, times the second does not (a search's step)."""
    return 2**63 // value + 1, 2**63 // (value + 1) + 1


@pytest.mark.parametrize("shape", [
    "select age, count(*) * {1} from adult where age = {0} group by age",
    "select age, count(*) from adult where age = {0} group by age having count(*) * {1} > 0",
    "select age, count(*) from adult where age = {0} group by age order by count(*) * {1}",
    "select * from (select age, count(*) as n from adult where age = {0} group by age) q where n * {1} > 0",
])
def test_a_product_of_a_withheld_count_raises_no_error(reporter: psycopg.Connection[Any],
                                                       truth: psycopg.Connection[Any],
                                                       small_group: tuple[int, int, int], shape: str) -> None:
    """count(*) * F overflows bigint exactly when the count reaches 2^63 / F: were it computed on a withheld group,
    a search over F would read the group's size from the error. PostgreSQL fails on it; through the proxy the group
    is withheld first, for F just past and just within the limit alike."""
    age, people, _ = small_group
    high, low = _overflowing(people)
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        truth.execute(shape.format(age, high)).fetchall()
    for factor in (high, low):
        assert reporter.execute(shape.format(age, factor)).fetchall() == []


def test_a_product_of_one_group_s_sum_raises_no_error(reporter: psycopg.Connection[Any],
                                                      small_group: tuple[int, int, int]) -> None:
    """sum(CASE WHEN age = A THEN capital_gain ELSE 0 END) * F by sex: only the withheld age's people add to the
    sum, so the product overflows where their total reaches 2^63 / F. The answer is the same for F past and within
    that limit (cells dominated by those few people withheld), without error."""
    age, _, total = small_group
    answers = []
    for factor in _overflowing(total):
        sql = (f"select sex, sum(case when age = {age} then capital_gain else 0 end) * {factor} as s from adult "
               "group by sex order by 1")
        answers.append([(sex, value is None) for sex, value in reporter.execute(sql).fetchall()])
    assert answers[0] == answers[1]


# --- dp: declared bounds are where values are clamped: facts only where the SQL reads the column clamped --------

# The demo declares age in [15, 100] and capital_gain in [0, 100000]: within them none of these overflows integer
# (100 * 21,000,000 and 100,000 * 21,000 are below 2^31), but one person outside them makes each fail.
TRUSTING_BOUNDS = [
    "select count(*) from adult where capital_gain * 21000 > 0",
    "select sex, count(*) from adult where age * 21000000 > 0 group by sex",
    "select age * 21000000 as k, count(*) from adult group by 1",
    "select sum(capital_gain * 21000) from adult",
]
# Even within the bounds these overflow integer (100,000 * 22,000 and 100 * 22,000,000 are past 2^31).
OVERFLOWING_WITHIN_BOUNDS = [
    "select count(*) from adult where capital_gain * 22000 > 0",
    "select sum(age * 22000000) from adult",
]


@contextmanager
def out_of_bounds(truth: psycopg.Connection[Any]) -> Iterator[None]:
    """One person at capital gain 150,000 and age 150, outside the declared bounds (which dp tolerates: the lint
    only warns), put back afterwards."""
    row = truth.execute("select id, capital_gain, age from adult order by id limit 1").fetchone()
    truth.execute("update adult set capital_gain = 150000, age = 150 where id = %s", [row[0]])
    try:
        yield
    finally:
        truth.execute("update adult set capital_gain = %s, age = %s where id = %s", [row[1], row[2], row[0]])


@pytest.mark.parametrize("sql", TRUSTING_BOUNDS)
def test_dp_reads_bounded_columns_clamped_against_errors(analyst: psycopg.Connection[Any],
                                                         truth: psycopg.Connection[Any], sql: str) -> None:
    """An expression proved not to fail only within the declared bounds fails on an out-of-bounds person's row in
    PostgreSQL, and would fail un-noised (a search over the factor would read their capital gain) if dp trusted
    the bounds of the raw column. dp reads capital_gain and age clamped into their bounds there: with that person
    present the statement is answered, with noise, and charged; no error."""
    with out_of_bounds(truth):
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):
            truth.execute(sql).fetchall()
        before = str(analyst.execute("show anonproxy.budget").fetchone()[0])
        rows = analyst.execute(sql).fetchall()
        assert rows and all(value is not None for row in rows for value in row), rows
        assert str(analyst.execute("show anonproxy.budget").fetchone()[0]) != before


@pytest.mark.parametrize("sql", OVERFLOWING_WITHIN_BOUNDS)
def test_dp_refuses_what_overflows_within_the_bounds(analyst: psycopg.Connection[Any],
                                                     truth: psycopg.Connection[Any], sql: str) -> None:
    """Refused on its structure (0A000), with or without the out-of-bounds person, charging nothing; the hint is
    the numeric spelling (the bounds are already used)."""
    def refusal() -> tuple[str, str, str]:
        before = str(analyst.execute("show anonproxy.budget").fetchone()[0])
        with pytest.raises(psycopg.Error) as caught:
            analyst.execute(sql).fetchall()
        assert str(analyst.execute("show anonproxy.budget").fetchone()[0]) == before
        diag = caught.value.diag
        return str(caught.value.sqlstate), diag.message_primary or "", diag.message_hint or ""

    with out_of_bounds(truth):
        sqlstate, message, hint = refusal()
    assert (sqlstate, message, hint) == refusal()
    assert sqlstate == "0A000" and "overflow" in message, message
    assert "::numeric" in hint and "declare" not in hint, hint


def test_dp_answers_the_same_arithmetic_in_numeric(analyst: psycopg.Connection[Any]) -> None:
    """The safe spelling the hint gives, numeric arithmetic (no overflow short of 10^131072), is answered."""
    rows = analyst.execute("select sum(capital_gain::numeric * 21000) from adult").fetchall()
    assert len(rows) == 1 and rows[0][0] is not None
    assert analyst.execute("select count(*) from adult where capital_gain::numeric * 21000 > 0").fetchall()


@pytest.mark.parametrize("sql", [
    "select count(*) from visits where visited_at - timestamptz '2025-01-01 00:00:00+00' > interval '1 day'",
    "select channel, count(*) from visits where extract(year from visited_at)::int > 2000 group by channel",
])
def test_dp_does_not_trust_declared_time_bounds_against_errors(analyst: psycopg.Connection[Any],
                                                               truth: psycopg.Connection[Any], sql: str) -> None:
    """visited_at is declared within 2025-2026, and dp leaves rows outside that range out of its answers; but an
    expression proved within it (a difference of timestamps, an integer year) fails on one person's 'infinity'
    visit, un-noised. PostgreSQL fails with that visit; through the proxy the WHERE clause runs only on the rows
    within the declared range (round 11: a CASE evaluated before it; refused here before), so the statement is
    answered, with or without the visit."""
    truth.execute("insert into visits select max(visit_id) + 1, min(person_id), 'infinity', 'web', 1 from visits")
    try:
        with pytest.raises(psycopg.Error):
            truth.execute(sql).fetchall()
        for _ in range(2):
            assert analyst.execute(sql).fetchall()
            truth.execute("delete from visits where visited_at = 'infinity'")
    finally:
        truth.execute("delete from visits where visited_at = 'infinity'")


@pytest.mark.parametrize("sql", [
    "select cast(extract(year from visited_at) as integer) as y, count(*) from visits group by 1",
    "select date_trunc('month', visited_at) as m, count(*) from visits group by 1",
    # not calendar keys: dp's SQL keeps the rows within the declared range all the same (docs/dp.md)
    "select extract(epoch from visited_at)::bigint / 86400 as d, count(*) from visits group by 1",
    "select (extract(epoch from visited_at)::bigint / 3600) % 24 as h, count(*) from visits group by 1",
    "select channel, count(distinct extract(year from visited_at)::int) from visits group by 1",
])
def test_a_dp_key_over_a_time_column_does_not_fail_on_an_infinite_visit(analyst: psycopg.Connection[Any],
                                                                        truth: psycopg.Connection[Any],
                                                                        sql: str) -> None:
    """Calendar keys of visited_at, whose declared range dp's SQL keeps rows within: one person's 'infinity' visit
    changes neither whether the statement is answered nor its SQLSTATE when refused."""
    def outcome() -> str:
        try:
            analyst.execute(sql).fetchall()
        except psycopg.Error as error:
            return str(error.sqlstate)
        return "answered"

    without = outcome()
    assert without == "answered", sql
    truth.execute("insert into visits select max(visit_id) + 1, min(person_id), 'infinity', 'web', 1 from visits")
    try:
        assert outcome() == without
    finally:
        truth.execute("delete from visits where visited_at = 'infinity'")


def test_a_dp_time_guard_keeps_the_rows_a_left_join_leaves_without_a_visit(analyst: psycopg.Connection[Any],
                                                                           truth: psycopg.Connection[Any]) -> None:
    """The range condition dp adds for a time column an aggregate reads keeps rows where the column is NULL: a
    LEFT JOIN that finds no visit (here: none of the channel asked) leaves every adult counted, as PostgreSQL
    counts them, not dropped by the condition."""
    sql = ("select a.sex, count(*) as n, count(distinct extract(epoch from v.visited_at)::bigint / 86400) as days "
           "from adult a left join visits v on v.person_id = a.id and v.channel = 'nowhere' group by 1 order by 1")
    expected = {sex: n for sex, n, _ in truth.execute(sql).fetchall()}
    got = {sex: n for sex, n, _ in analyst.execute(sql).fetchall()}
    assert set(got) == set(expected), (got, expected)
    for sex, n in expected.items():  # noisy counts: within a few hundred of thousands
        assert abs(got[sex] - n) < 200, (sex, got[sex], n)
