"""Red team, round 16: the error channel of constants PostgreSQL computes per row (the no-error proof's idea of a
folded constant), and of a timestamp merged with a timestamptz in dp mode.

The no-error proof (anonproxy.plan.bounds) took every subtree without columns or parameters for a constant that
PostgreSQL folds when it plans the statement, so that its error, if any, is raised for every database alike. That
holds for a quoted constant of no type yet ('2025-01-31'::date is read by date_in when the statement is parsed) and
for immutable functions, not for stable ones, which the planner does not fold: PostgreSQL runs them for the rows
that reach them, and CASE reaches them only for the rows its condition picks. The functions that follow DateStyle,
TimeZone or IntervalStyle are stable: text to date, timestamp or timestamptz; casts between timestamptz and the
other time types; extract() and to_char() of a timestamptz; the text form of a date, timestamp or interval. So

    CASE WHEN age = <a> AND income = <i> THEN 'garbage'::text::date > current_date ELSE false END

failed with 22007 exactly when someone of that age and income existed, and was answered otherwise, in both modes: a
one-bit answer about fewer than k people that no group-size rule or noise covered. The same with
coalesce('garbage', 'x')::date, lower('garbage')::timestamp, 'garbage'::varchar::timestamptz, a timestamptz
constant cast to timestamp past the range in the session's time zone (22008), extract(year from timestamptz
'infinity')::int (PostgreSQL's own 0A000 "cannot convert infinity to integer", told from the proxy's refusal by
its missing hint), to_char(timestamptz '2025-01-01', 'Mon')::int and (date '2025-01-01')::text::int (22P02). Each
case of ``test_a_constant_postgresql_computes_per_row_is_no_oracle`` failed before its fix (three commits to
bounds.py: typed constants cast to a time type; time functions over constants; a time's text); now such an
expression is proved like a column's: refused (0A000, whatever the data) where it could fail, admitted where
it stays in range (``test_typed_time_constants_within_range_are_answered``). Each attack shows PostgreSQL's own
error on the superuser connection first.

In dp mode, CASE and coalesce merging a timestamp with a timestamptz convert the timestamp in the session's time
zone, and PostgreSQL fails where that leaves its range. dp assumes nothing of an undeclared time column in its
conditions (any instant PostgreSQL holds), yet the merge was typed opaquely, never proved: ``WHERE coalesce(local,
at) > ...`` under TimeZone Etc/GMT+12 failed with 22008 exactly when someone's row was at 23:00 on PostgreSQL's last
day (``test_a_timestamp_merged_with_a_timestamptz_is_no_dp_oracle`` failed before the fix: 22008 with the row, an
answer without). The merge is now proved like that conversion: refused in dp mode without declared bounds (0A000),
admitted in suppress mode, which assumes such a column within 2000 BC to 200000 AD.

Tried without a leak, kept as guards: a UNION ALL merging timestamp and timestamptz keys (PostgreSQL fails on the
last-hour row; the proxy answers the same with it and without); temporary tables, views and functions that would
shadow a protected table or a builtin, and PREPARE TRANSACTION (refused); a search_path with pg_temp first (a
rewritten answer is PostgreSQL's); LIKE patterns ending in the escape character spelled as escape strings, Unicode
escapes, dollar quotes, inside upper() or built with ||, and a bad SIMILAR TO pattern (refused whatever the data).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, attack_roles, suppress_answers_as_postgresql, wait_for_current_policy

reporter, analyst = attack_roles("dp_round16", epsilon=1000, scope="module", timezone="Etc/GMT-14")

NOBODY = 3  # below adult's declared lower bound of age (15): no row has it

# {0}: a condition that holds for some rows or for none; each expression fails in PostgreSQL where a row reaches it.
REACHED_ONLY = [
    ("select count(*) from adult where case when {0} then 'garbage'::text::date > current_date else false end",
     "22007"),
    ("select count(*) from adult where case when {0} then 'garbage'::varchar::timestamptz > now() else false end",
     "22007"),
    ("select count(*) from adult where case when {0} then coalesce('garbage', 'x')::date > current_date "
     "else false end", "22007"),
    ("select count(*) from adult where case when {0} then lower('garbage')::timestamp > localtimestamp "
     "else false end", "22007"),
    # 23:00 UTC on the last day PostgreSQL holds is past it in local time 14 hours east of UTC (the session's zone)
    ("select count(*) from adult where case when {0} then '294276-12-31 23:00:00+00'::timestamptz::timestamp "
     "> localtimestamp else false end", "22008"),
    ("select sex, count(*) from adult group by sex, case when {0} then 'garbage'::text::date end", "22007"),
    ("select count(*) filter (where case when {0} then 'garbage'::text::date > current_date else false end) "
     "from adult", "22007"),
    ("select sex, count(case when {0} then 'garbage'::text::timestamptz end) from adult group by sex", "22007"),
    # time functions over constants that follow the session's time zone are stable: evaluated where a row reaches
    # them too (PostgreSQL's own "cannot convert infinity to integer" is a 0A000)
    ("select count(*) from adult where case when {0} then extract(year from timestamptz 'infinity')::int > 0 "
     "else false end", "0A000"),
    ("select count(*) from adult where case when {0} then extract(epoch from timestamptz 'infinity')::bigint > 0 "
     "else false end", "0A000"),
    ("select count(*) from adult where case when {0} then to_char(timestamptz '2025-01-01', 'Mon')::int > 0 "
     "else false end", "22P02"),
    # a time's or an interval's text follows DateStyle, TimeZone, IntervalStyle: written where a row reaches it
    ("select count(*) from adult where case when {0} then (timestamptz '2025-01-01')::text::int > 0 else false end",
     "22P02"),
    ("select count(*) from adult where case when {0} then (date '2025-01-01')::text::int > 0 else false end",
     "22P02"),
    ("select count(*) from adult where case when {0} then (interval '1 day')::text::int > 0 else false end",
     "22P02"),
]


def outcome(conn: psycopg.Connection[Any], sql: str) -> str:
    """"answered", or the SQLSTATE ``sql`` fails with."""
    try:
        conn.execute(sql).fetchall()
    except psycopg.Error as error:
        return str(error.sqlstate)
    return "answered"


def refused(conn: psycopg.Connection[Any], sql: str) -> str:
    """"refused" if the proxy refuses ``sql`` as written (0A000 with a hint), else :func:`outcome` (PostgreSQL's own
    0A000, "cannot convert infinity to integer", has no hint)."""
    try:
        conn.execute(sql).fetchall()
    except psycopg.Error as error:
        proxy = error.sqlstate == "0A000" and error.diag.message_hint is not None
        return "refused" if proxy else str(error.sqlstate)
    return "answered"


@pytest.fixture(scope="module")
def someone(truth: psycopg.Connection[Any]) -> str:
    """A condition that holds for fewer than k = 10 people: an age few people have, with one income."""
    age, income = truth.execute("select age, income from adult group by age, income having count(*) between 1 and 9 "
                                "order by age limit 1").fetchone()
    return f"age = {age} and income = '{income}'"


@pytest.mark.parametrize(("sql", "sqlstate"), REACHED_ONLY)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_constant_postgresql_computes_per_row_is_no_oracle(request: pytest.FixtureRequest,
                                                             truth: psycopg.Connection[Any], someone: str,
                                                             sql: str, sqlstate: str, role: str) -> None:
    """PostgreSQL fails only when someone meets the condition; through the proxy the outcome is the same whether
    anyone does or not: a refusal of the statement as written (0A000), never PostgreSQL's error."""
    conn = request.getfixturevalue(role)
    truth.execute("set timezone = 'Etc/GMT-14'")
    try:
        assert outcome(truth, sql.format(f"age = {NOBODY}")) == "answered"
        assert outcome(truth, sql.format(someone)) == sqlstate  # the channel, in PostgreSQL itself
    finally:
        truth.execute("reset timezone")
    outcomes = {refused(conn, sql.format(condition)) for condition in (f"age = {NOBODY}", someone)}
    assert outcomes == {"refused"}, (sql, outcomes)


def test_the_refusal_names_the_constant_and_the_safe_form(reporter: psycopg.Connection[Any]) -> None:
    """The refusal says why (a typed constant converted when a row reaches it) and how to write it instead."""
    with pytest.raises(psycopg.errors.FeatureNotSupported) as refused:
        reporter.execute(REACHED_ONLY[0][0].format(f"age = {NOBODY}"))
    assert "typed constant" in (refused.value.diag.message_primary or "")
    assert "DATE '" in (refused.value.diag.message_hint or "")


# Typed time constants that stay within range in every session time zone: proved, and answered as PostgreSQL.
WITHIN_RANGE = [
    "select channel, count(*) from visits where visited_at >= '2025-06-01'::date::timestamptz group by channel",
    "select channel, count(*) from visits where visited_at::timestamp >= '2025-06-01'::timestamptz::timestamp "
    "group by channel",
    "select channel, count(*) from visits where visited_at >= date '2025-06-01' group by channel",
    "select channel, count(*) from visits where visited_at < 'infinity'::date::timestamptz group by channel",
]


@pytest.mark.parametrize("sql", WITHIN_RANGE)
def test_typed_time_constants_within_range_are_answered(reporter: psycopg.Connection[Any],
                                                        truth: psycopg.Connection[Any], sql: str) -> None:
    for conn in (reporter, truth):
        conn.execute("set timezone = 'Etc/GMT-14'")
    try:
        suppress_answers_as_postgresql(reporter, truth, sql)
    finally:
        for conn in (reporter, truth):
            conn.execute("reset timezone")


# --- dp: a timestamp merged with a timestamptz -------------------------------------------------------------------

# A table linked to adult with a timestamp and a timestamptz column, no declared time bounds: dp assumes nothing of
# their values (a row may hold any instant PostgreSQL holds).
TIMES = """
create table public.r16_times (event_id bigint primary key, person_id integer not null references public.adult (id),
                               local timestamp not null, at timestamptz not null, kind text not null);
insert into public.r16_times
select id, id, timestamp '2025-01-01' + make_interval(mins => id), timestamptz '2025-01-01 00:00+00', 
       case when id % 2 = 0 then 'web' else 'app' end
from public.adult;
"""
SET_COLUMN = ("select anonproxy.set_column('public.r16_times'::regclass, %s::name, %s::text, null::numeric, "
              "null::numeric, %s::text[])")
LAST_HOUR = "294276-12-31 23:00"  # PostgreSQL's last day: 12 hours west of UTC, past its range in UTC
WEST = "Etc/GMT+12"


@pytest.fixture(scope="module")
def times(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    with truth.transaction():
        truth.execute(TIMES)
        truth.execute("select anonproxy.link_table('public.r16_times'::regclass, 'person_id', 'public.adult'::regclass)")
        for column, kind, domain in (("event_id", "identifier", None), ("person_id", "identifier", None),
                                     ("kind", "quasi_identifier", ["web", "app"])):
            truth.execute(SET_COLUMN, [column, kind, domain])
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute("select anonproxy.unlink_table('public.r16_times')")
        truth.execute("drop table public.r16_times")
        wait_for_current_policy(truth, gated_proxy, gated_database)


@contextmanager
def last_hour(truth: psycopg.Connection[Any]) -> Iterator[None]:
    """One person's row at 23:00 on PostgreSQL's last day (a timestamp without time zone); put back afterwards."""
    event, local = truth.execute("select event_id, local from public.r16_times order by event_id limit 1").fetchone()
    truth.execute("update public.r16_times set local = %s::timestamp where event_id = %s", [LAST_HOUR, event])
    try:
        yield
    finally:
        truth.execute("update public.r16_times set local = %s where event_id = %s", [local, event])


MERGED = [
    "select count(*) from r16_times where coalesce(local, at) > timestamptz '2025-01-01 00:00+00'",
    "select count(*) from r16_times where (case when kind in ('web', 'app') then local else at end) > now()",
    "select kind, count(*) from r16_times where coalesce(local, at) >= timestamptz '2000-01-01 00:00+00' "
    "group by kind",
]


@pytest.mark.parametrize("sql", MERGED)
def test_a_timestamp_merged_with_a_timestamptz_is_no_dp_oracle(analyst: psycopg.Connection[Any],
                                                              truth: psycopg.Connection[Any], times: None,
                                                              sql: str) -> None:
    """CASE and coalesce merge a timestamp with a timestamptz as timestamptz, reading the timestamp in the session's
    time zone: PostgreSQL fails on the row of one person's last hour 12 hours west of UTC. Through the proxy, in dp
    mode, the outcome is the same with that row and without it, never PostgreSQL's error."""
    truth.execute(f"set timezone = '{WEST}'")
    analyst.execute(f"set timezone = '{WEST}'")
    try:
        with last_hour(truth):
            assert outcome(truth, sql) == "22008"  # the channel, in PostgreSQL itself
            first = outcome(analyst, sql)
        second = outcome(analyst, sql)
    finally:
        truth.execute("reset timezone")
        analyst.execute("set timezone = 'Etc/GMT-14'")
    assert first == second == "0A000", (sql, first, second)


def test_suppress_merges_a_timestamp_it_assumes_within_range(reporter: psycopg.Connection[Any],
                                                            truth: psycopg.Connection[Any], times: None) -> None:
    """Suppress mode takes a time column without declared bounds to lie between 2000 BC and 200000 AD (docs/
    suppression.md), far from PostgreSQL's ends in any time zone: the merge is admitted, answered as PostgreSQL."""
    suppress_answers_as_postgresql(reporter, truth, MERGED[2])


# --- session state: objects that could shadow what rewritten SQL reads ----------------------------------------------

# A temporary table or function named as a protected table or a builtin (pg_temp is searched first for tables), a
# two-phase commit that would keep a transaction, and its locks, past the session.
SHADOWS = [
    "create temp table adult (id integer, sex text, age integer)",
    "create temp view adult as select 1 as id, 'Female' as sex",
    "create function pg_temp.lower(text) returns text language sql as 'select ''x'''",
    "create function pg_temp.count(integer) returns integer language sql as 'select 1'",
    "prepare transaction 'r16'",
]
BY_SEX = "select sex, count(*), sum(capital_gain) from adult group by sex"


@pytest.mark.parametrize("sql", SHADOWS)
def test_a_shadowing_object_or_a_prepared_transaction_is_refused(reporter: psycopg.Connection[Any],
                                                                 sql: str) -> None:
    """Refused as a statement outside what the role may send, with its SQLSTATE; the session goes on."""
    with pytest.raises(psycopg.Error) as error:
        reporter.execute(sql)
    assert error.value.sqlstate in ("42501", "0A000"), (sql, error.value.sqlstate)
    assert reporter.execute("select 1").fetchone() == (1,)


@pytest.mark.parametrize("search_path", ["pg_temp, public", "public, pg_temp, pg_catalog", "\"$user\", public"])
def test_a_search_path_with_pg_temp_first_changes_no_answer(reporter: psycopg.Connection[Any],
                                                            truth: psycopg.Connection[Any], search_path: str) -> None:
    """With pg_temp or pg_catalog placed anywhere on the search path, a rewritten statement reads the protected
    table and the builtins it names (the service connection's own path, every table schema-qualified): answered
    as PostgreSQL."""
    for conn in (reporter, truth):
        conn.execute(f"set search_path = {search_path}")
    try:
        suppress_answers_as_postgresql(reporter, truth, BY_SEX)
        assert reporter.execute("show search_path").fetchone() == truth.execute("show search_path").fetchone()
    finally:
        reporter.execute("reset search_path")
        truth.execute("reset search_path")


UNION_OF_KEYS = ("select local, count(*) from r16_times group by local "
                 "union all select at, count(*) from r16_times group by at")


@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_set_operation_merging_timestamp_keys_is_no_oracle(request: pytest.FixtureRequest,
                                                              truth: psycopg.Connection[Any], times: None,
                                                              role: str) -> None:
    """UNION ALL of a timestamp key and a timestamptz key converts the first branch's keys in the session's time
    zone: PostgreSQL fails on the last-hour row 12 hours west of UTC. Through the proxy the outcome is the same with
    that row and without it."""
    conn = request.getfixturevalue(role)
    for each in (conn, truth):
        each.execute(f"set timezone = '{WEST}'")
    try:
        with last_hour(truth):
            assert outcome(truth, UNION_OF_KEYS) == "22008"  # the channel, in PostgreSQL itself
            first = outcome(conn, UNION_OF_KEYS)
        second = outcome(conn, UNION_OF_KEYS)
    finally:
        truth.execute("reset timezone")
        conn.execute("reset timezone" if role == "reporter" else "set timezone = 'Etc/GMT-14'")
    assert first == second, (first, second)
    assert not first.startswith(("22", "XX")), first


# --- LIKE patterns spelled so that a check on the literal's text could misread them -----------------------------

# A trailing escape character fails LIKE only when the match reaches it (a row whose text matches the rest), and a
# bad SIMILAR TO pattern only when a row reaches it: each spelled as an escape string, a Unicode escape, a dollar
# quote, inside upper(), or put together with ||.
PATTERNS = [
    r"occupation like E'Sales\\'",
    r"occupation like U&'Sales\005c'",
    r"occupation like $$Sales\$$",
    r"occupation like upper(E'Sales\\')",
    r"occupation like 'Sales\' || ''",
    r"occupation like ('Sal' || 'es\')",
    "occupation similar to 'S('",
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_pattern_that_may_fail_is_refused_however_spelled(request: pytest.FixtureRequest, someone: str,
                                                             pattern: str, role: str) -> None:
    """Refused by the proxy (0A000 with a hint) whether or not any row reaches the pattern."""
    conn = request.getfixturevalue(role)
    sql = f"select count(*) from adult where case when {{0}} then {pattern} else false end"
    outcomes = {refused(conn, sql.format(condition)) for condition in (f"age = {NOBODY}", someone)}
    assert outcomes == {"refused"}, (pattern, outcomes)
