"""Red team, round 11: the session settings and the clock a seen suppress statement is prepared under, dp set
operations (what a branch may read, what each costs), dp time guards around an 'infinity' visit (set-operation
branches, outer queries, HAVING, ORDER BY, JOIN conditions, date_bin, one-way intervals) and around visits at
PostgreSQL's first and last instants (WHERE and JOIN conditions), and suppress's HAVING, ORDER BY and outer queries
over a withheld aggregate.

Each attack asserts the safe outcome, through the real gated proxy with a real driver, against PostgreSQL's own
answers where the proxy should answer as PostgreSQL does."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, attack_roles

Rows = list[tuple[Any, ...]]


reporter, analyst = attack_roles("dp_round11")


def outcome(conn: psycopg.Connection[Any], sql: str) -> Rows | str:
    """The rows of ``sql`` (sorted), or the SQLSTATE it is refused with."""
    try:
        return sorted(conn.execute(sql).fetchall(), key=str)
    except psycopg.Error as error:
        return str(error.sqlstate)


# --- suppress: a seen statement runs prepared, under the session's settings -------------------------------------

# A constant PostgreSQL reads with the session's TimeZone or DateStyle, once, when the statement is parsed.
BEFORE_JUNE = "select channel, count(*) from visits where visited_at < '2025-06-01 00:00' group by channel"
BEFORE_FEBRUARY = "select channel, count(*) from visits where visited_at < '01/02/2025' group by channel"


@pytest.mark.parametrize(("sql", "setting", "values"), [
    (BEFORE_JUNE, "timezone", ["UTC", "Pacific/Kiritimati", "America/Adak"]),
    (BEFORE_FEBRUARY, "datestyle", ["ISO, MDY", "ISO, DMY"]),
])
def test_a_statement_prepared_under_one_setting_answers_under_the_next(reporter: psycopg.Connection[Any],
                                                                       truth: psycopg.Connection[Any], sql: str,
                                                                       setting: str, values: list[str]) -> None:
    """The rewrite of a seen Query runs as the service connection's prepared statement, which PostgreSQL parsed
    once: its constants were read under the settings of that Parse. The same text sent after SET TimeZone (or
    DateStyle) is answered as PostgreSQL answers it under the new setting, not with the first one's constant
    (each group here holds thousands: the suppressed answer is PostgreSQL's). Failed before the statement's name
    covered those settings: the second zone got the first zone's counts."""
    try:
        for value in values * 2:
            reporter.execute(f"set {setting} = '{value}'")
            truth.execute(f"set {setting} = '{value}'")
            # prepare=False: psycopg would prepare a statement run five times, which PostgreSQL then keeps as parsed
            expected = sorted(truth.execute(sql, prepare=False).fetchall())
            assert sorted(reporter.execute(sql, prepare=False).fetchall()) == expected, value
    finally:
        truth.execute(f"reset {setting}")
    answers = set()
    for value in values:
        truth.execute(f"set {setting} = '{value}'")
        answers.add(tuple(sorted(truth.execute(sql, prepare=False).fetchall())))
    truth.execute(f"reset {setting}")
    assert len(answers) == len(values)  # the settings do change PostgreSQL's answer


@pytest.mark.parametrize("constant", ["'now'", "timestamptz 'NOW'"])
def test_a_constant_read_with_the_clock_is_read_again_at_each_run(reporter: psycopg.Connection[Any],
                                                                  truth: psycopg.Connection[Any],
                                                                  constant: str) -> None:
    """'now' in a constant is the time PostgreSQL parses it at: a statement kept prepared would answer with the
    time of its first Parse ever after. A visit made between two runs of the same text counts in the second
    answer, as in PostgreSQL's (the web group holds thousands). Failed before such statements ran as plain
    Queries: the second answer missed the visit."""
    sql = f"select channel, count(*) from visits where visited_at < {constant} group by channel"
    first = sorted(reporter.execute(sql, prepare=False).fetchall())
    assert first == sorted(truth.execute(sql, prepare=False).fetchall())
    # a visit at the clock of this statement: before the 'now' of every statement after it
    truth.execute("insert into visits select max(visit_id) + 1, min(person_id), clock_timestamp(), 'web', 1 "
                  "from visits")
    try:
        second = sorted(reporter.execute(sql, prepare=False).fetchall())
        assert second == sorted(truth.execute(sql, prepare=False).fetchall()) and second != first
    finally:
        truth.execute("delete from visits where visit_id = (select max(visit_id) from visits)")


# --- dp: set operations ------------------------------------------------------------------------------------------


def _budget(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("show anonproxy.budget").fetchone()[0])


def _rho_spent(conn: psycopg.Connection[Any]) -> float:
    found = re.search(r"rho ([0-9.e-]+) spent", _budget(conn))
    assert found is not None, _budget(conn)
    return float(found.group(1))


@pytest.mark.parametrize(("sql", "sqlstate"), [
    # a branch that reads no table: no measurement, no noise
    ("select count(*) from adult union all select 1", "0A000"),
    ("select count(*) from adult except select 5", "0A000"),
    # a branch over a relation outside the policy
    ("select count(*) from adult union all select count(*) from pg_class", "42501"),
    # a branch the proxy cannot answer alone in dp (an extreme)
    ("select count(*) from adult union all select max(age) from adult", "42501"),
])
def test_a_dp_set_operation_with_a_branch_dp_cannot_answer_is_refused_before_any_charge(
        analyst: psycopg.Connection[Any], sql: str, sqlstate: str) -> None:
    before = _budget(analyst)
    with pytest.raises(psycopg.Error) as caught:
        analyst.execute(sql).fetchall()
    assert caught.value.sqlstate == sqlstate, caught.value
    assert _budget(analyst) == before


def test_each_branch_of_a_dp_set_operation_is_charged_as_its_own_question(analyst: psycopg.Connection[Any]) -> None:
    """Two count branches cost two questions' ρ (each count alone costs one); each branch is then in the answer
    cache: asked alone, it costs nothing more. INTERSECT and EXCEPT of the same branches cost nothing either
    (they compare the noisy rows already paid for)."""
    one = "select count(*) from adult where age > 41"
    other = "select count(*) from adult where age > 42"
    alone = "select count(*) from adult where age > 43"
    start = _rho_spent(analyst)
    analyst.execute(alone).fetchall()
    per_question = _rho_spent(analyst) - start
    assert per_question > 0
    analyst.execute(f"{one} union all {other}").fetchall()
    both = _rho_spent(analyst) - start - per_question
    assert both == pytest.approx(2 * per_question, rel=1e-3)
    spent = _rho_spent(analyst)
    for sql in (one, other, f"{one} intersect {other}", f"{other} except {one}"):
        analyst.execute(sql).fetchall()
        assert _rho_spent(analyst) == spent, sql


# --- dp: time guards around an 'infinity' visit ------------------------------------------------------------------

INFINITE_VISIT = [
    # set-operation branches, each with a key over the bounded time column
    "select extract(epoch from visited_at)::bigint / 86400 as d, count(*) from visits group by 1 "
    "union all select extract(epoch from visited_at)::bigint / 3600, count(*) from visits group by 1",
    "select channel, count(*) from visits group by 1 "
    "union select 'x', count(distinct extract(year from visited_at)::int) from visits",
    # an outer query over such a key, ordered and limited
    "select d from (select extract(epoch from visited_at)::bigint / 86400 as d, count(*) as n from visits "
    "group by 1) q order by n desc limit 1",
    # HAVING and ORDER BY reading an aggregate of the time column
    "select channel, count(*) from visits group by channel "
    "having count(distinct extract(epoch from visited_at)::bigint / 86400) > 5",
    "select channel, count(*) from visits group by channel "
    "order by count(distinct extract(epoch from visited_at)::bigint / 86400) limit 1",
    # a JOIN condition that fails on an infinite value
    "select a.sex, count(*) from adult a join visits v on v.person_id = a.id "
    "and v.visited_at - timestamptz '2025-01-01 00:00:00+00' > interval '1 day' group by 1",
    # date_bin from an origin, a day difference, a mixed-sign interval in an aggregate's FILTER
    "select date_bin('1 day', visited_at, timestamptz '2000-01-01 00:00:00+00') as d, count(*) from visits "
    "group by 1 order by 2 desc limit 1",
    "select visited_at::date - date '2025-01-01' as d, count(*) from visits group by 1 order by 2 desc limit 1",
    "select channel, count(*) filter (where visited_at + interval '1 year -400 days' "
    "> timestamptz '2025-06-01 00:00:00+00') from visits group by 1",
    "select channel, sum(extract(epoch from visited_at - timestamptz '2025-01-01 00:00:00+00')) from visits "
    "group by 1",
]


@pytest.mark.parametrize("sql", INFINITE_VISIT)
def test_an_infinite_visit_changes_no_dp_outcome(analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                                 sql: str) -> None:
    """Whether the statement is answered, and its SQLSTATE when refused, are the same with one person's
    'infinity' visit as without it."""
    without = _answered(analyst, sql)
    truth.execute("insert into visits select max(visit_id) + 1, min(person_id), 'infinity', 'web', 1 from visits")
    try:
        assert _answered(analyst, sql) == without
    finally:
        truth.execute("delete from visits where visited_at = 'infinity'")


# PostgreSQL's last and first instants, and its infinities: values it holds, outside visited_at's declared range
# and outside the 2000 BC to 200000 AD the proof assumed of a column whose declared range it did not trust.
EXTREME_VISITS = ["294276-12-31 23:59:59+00", "4714-11-24 00:00:00+00 BC", "infinity", "-infinity"]
AT_THE_EDGES = [
    "select count(*) from visits where visited_at + interval '1 day' > timestamptz '2025-06-01 00:00:00+00'",
    "select count(*) from visits where visited_at - interval '1 day' > timestamptz '2025-06-01 00:00:00+00'",
    "select count(*) from visits where date_trunc('month', visited_at) = timestamptz '2025-06-01 00:00:00+00'",
    "select count(*) from visits where visited_at at time zone 'America/New_York' > timestamp '2025-06-01'",
    "select a.sex, count(*) from adult a join visits v on v.person_id = a.id "
    "and v.visited_at + interval '1 hour' > timestamptz '2025-06-01 00:00:00+00' group by 1",
]


def _answered(conn: psycopg.Connection[Any], sql: str) -> str:
    result = outcome(conn, sql)
    return result if isinstance(result, str) else "answered"


@pytest.mark.parametrize("sql", AT_THE_EDGES)
def test_a_visit_at_the_end_of_time_changes_no_dp_outcome(analyst: psycopg.Connection[Any],
                                                          truth: psycopg.Connection[Any], sql: str) -> None:
    """dp did not take visited_at's declared range as a fact in WHERE and JOIN conditions, but took such a
    column to lie between 2000 BC and 200000 AD: a shift, a truncation or a time zone there failed (22008) on one
    person's visit at PostgreSQL's last or first instant, un-noised, as PostgreSQL fails with it. Failed before
    dp ran such a WHERE clause only on rows within the declared range (a CASE, evaluated first) and took the
    whole range PostgreSQL holds in JOIN conditions: now the WHERE clauses are answered, the JOIN condition
    refused on its structure (0A000), with or without such a visit."""
    without = _answered(analyst, sql)
    assert without == ("0A000" if " join " in sql else "answered")
    failures = set()
    for value in EXTREME_VISITS:
        truth.execute("insert into visits select max(visit_id) + 1, min(person_id), %s, 'web', 1 from visits",
                      [value])
        try:
            try:
                truth.execute(sql).fetchall()
            except psycopg.errors.DatetimeFieldOverflow:
                failures.add(value)
            assert _answered(analyst, sql) == without, value
        finally:
            truth.execute("delete from visits where visit_id = (select max(visit_id) from visits)")
    assert failures  # PostgreSQL fails on at least one of them


# Keys and aggregates over a time column without declared bounds: the proof takes it to lie between 2000 BC and
# 200000 AD (or at ±infinity), where a truncation or a shift of up to centuries cannot fail.
UNDECLARED = [
    "select date_trunc('month', visited_at) as m, count(*) from visits group by 1",
    "select date_trunc('week', visited_at) as w, count(*) from visits group by 1",
    "select visited_at + interval '1 day' as d, count(*) from visits group by 1",
    "select channel, count(distinct date_trunc('day', visited_at - interval '1 hour')) from visits group by 1",
]


def test_a_visit_at_the_end_of_time_changes_no_dp_outcome_without_declared_bounds(
        analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any], gated_proxy: Endpoint,
        gated_database: str) -> None:
    """Failed before dp kept such a column's rows within what the proof assumes (a condition beside the WHERE):
    the month truncation of a visit at 4714 BC and the shift of one at 294276 AD failed (22008), un-noised."""
    from conftest import wait_for_policy

    def reload() -> None:
        wait_for_policy(gated_proxy, gated_database,
                        truth.execute("select version from anonproxy.policy_version").fetchone()[0])

    truth.execute("select anonproxy.set_time_bounds('public.visits', 'visited_at', null, null)")
    reload()
    try:
        without = {sql: _answered(analyst, sql) for sql in UNDECLARED}
        assert set(without.values()) == {"answered"}, without
        failures = set()
        for value in EXTREME_VISITS:
            truth.execute("insert into visits select max(visit_id) + 1, min(person_id), %s, 'web', 1 from visits",
                          [value])
            try:
                for sql in UNDECLARED:
                    try:
                        truth.execute(f"select count(*) from ({sql}) as q").fetchone()  # (no 294276 AD in Python)
                    except psycopg.errors.DatetimeFieldOverflow:
                        failures.add((sql, value))
                    assert _answered(analyst, sql) == "answered", (sql, value)
            finally:
                truth.execute("delete from visits where visit_id = (select max(visit_id) from visits)")
        assert len(failures) >= 2, failures  # PostgreSQL fails on them
    finally:
        truth.execute("select anonproxy.set_time_bounds('public.visits', 'visited_at', '2025-01-01 00:00:00+00', "
                      "'2026-12-31 23:59:59+00')")
        reload()


# --- suppress: HAVING, ORDER BY and outer queries over a withheld aggregate ----------------------------------------

WITHHELD = [
    "select sex, count(*) from adult group by sex having count(*) filter (where age = {0}) = 1",
    "select sex, count(*) from adult group by sex having count(*) filter (where age = {0}) = 0",
    "select sex, count(*) from adult group by sex "
    "having case when count(*) filter (where age = {0}) = 1 then 1 / 0 else 1 end = 1",
    "select sex, count(*) from adult group by sex having count(*) - count(*) filter (where age = {0}) < count(*)",
    "select sex, count(*) from adult group by sex order by count(*) filter (where age = {0}) desc, sex limit 1",
    "select sex, count(*) from adult group by sex order by count(*) filter (where age = {0}), sex limit 1 offset 1",
    "select sex, count(*) from adult group by sex order by sum(case when age = {0} then 1 else 0 end) desc, 1 "
    "limit 1",
    "select sex, count(*), row_number() over (order by count(*) filter (where age = {0})) from adult group by sex",
    "select sex, n from (select sex, count(*) as n, count(*) filter (where age = {0}) as m from adult "
    "group by sex) q order by m desc nulls last, sex limit 1",
    "select sex, n, sum(m) over () from (select sex, count(*) as n, count(*) filter (where age = {0}) as m "
    "from adult group by sex) q",
    "select age, string_agg(sex, ',') from adult where age = {0} group by age",
    "select age, sex, count(*) from adult where age >= {0} group by grouping sets ((age), (sex), ())",
]


@pytest.fixture(scope="module")
def lone(truth: psycopg.Connection[Any]) -> tuple[int, int, str, int]:
    """An age only one person has: the age, their id and their sex; and a person of age 40 of the other sex."""
    age = truth.execute("select age from adult group by age having count(*) = 1 order by age limit 1").fetchone()[0]
    person, sex = truth.execute("select id, sex from adult where age = %s", [age]).fetchone()
    other = truth.execute("select min(id) from adult where age = 40 and sex <> %s", [sex]).fetchone()[0]
    return int(age), int(person), str(sex), int(other)


def _swap_sexes(truth: psycopg.Connection[Any], one: int, other: int) -> None:
    truth.execute("update adult a set sex = b.sex from adult b where a.id in (%s, %s) and b.id in (%s, %s) "
                  "and a.id <> b.id", [one, other, one, other])


@pytest.mark.parametrize("shape", WITHHELD)
def test_a_withheld_aggregate_tells_nothing_of_the_person(reporter: psycopg.Connection[Any],
                                                          truth: psycopg.Connection[Any],
                                                          lone: tuple[int, int, str, int], shape: str) -> None:
    """Which sex the one person of their age has: the answer (rows or SQLSTATE) is the same whichever it is
    (swapped with a person of age 40, so that each sex keeps its count), though PostgreSQL's own answer tells it
    for the first shape."""
    age, person, sex, other = lone
    sql = shape.format(age)
    as_is = outcome(reporter, sql)
    _swap_sexes(truth, person, other)
    try:
        assert outcome(reporter, sql) == as_is
    finally:
        _swap_sexes(truth, person, other)
    assert truth.execute("select sex from adult where id = %s", [person]).fetchone() == (sex,)
    if shape == WITHHELD[0]:
        assert [row[0] for row in truth.execute(sql).fetchall()] == [sex]
