"""Red team round 21: time zones, session settings and values bound at Bind, attacked by someone who reads the code.

Part A (time; anonproxy/plan/time_values.py, dp/time_domains.py). A session ``SET TimeZone`` (named zones with
and without DST, a half-hour offset, a POSIX zone) before grouped statements over the visits' times: day and hour
truncation, ``date_trunc`` with a third (zone) argument, ``AT TIME ZONE``, ``to_char``, ``extract``, over narrow
windows around the DST changes of 2025, where most groups hold fewer than k people. Generated with a fixed seed;
every group the reporter releases is one PostgreSQL answers under the same TimeZone, with its count, and holds at
least k people by PostgreSQL's own count(DISTINCT person_id). No leak found.

Part B (session settings the proxy follows; proxy/followed_settings.py). Under DateStyle DMY, IntervalStyle
sql_standard, a POSIX TimeZone, a custom GUC, lc_time and a negative extra_float_digits, statements whose
evaluation could fail per row (an unknown or bound time zone, a cast of a custom setting, interval arithmetic that
leaves the range, an epoch cast to integer, a day-month literal, a bad field) give both gated roles the same
outcome (rows or SQLSTATE) whether their WHERE picks one person or nobody, and never XX000. No leak found.

Part B' (IntervalStyle; anonproxy/plan/time_values.py). Finding (a leak): PostgreSQL reads an interval whose
first field alone is signed with a minus ('-0 days 7000 years') as 7000 years on under IntervalStyle postgres, and as
7000 years back under sql_standard, where the minus applies to every field. The no-error proof read it the first
way only (a shift forward: within range for the visits' declared 2025-2026), while the service connection follows
the client's IntervalStyle: after ``SET IntervalStyle = sql_standard`` the reporter got 22008 (timestamp out of
range) when its WHERE picked a person with a visit, and rows when it picked nobody; likewise a date_bin stride
('-1 days 34 hours': 10 hours to the proof, 58 hours back to PostgreSQL, "stride must be greater than zero"). Fixed in
``time_values.parse_interval`` (such a text is not a constant the proof relies on) and ``bounds._time_arithmetic``
(refused, 0A000, naming the interval, hinting at a sign for every field), in both modes whatever the session's
style; an interval with every field signed is read as before. Finding (a wrong answer, no leak): the analysis
folded ``extract(epoch from interval '-1 day 2 hours')`` to IntervalStyle postgres's -79200, so under sql_standard
the reporter's ``count(*) / extract(...)`` was not PostgreSQL's (-93600 there); the same fix leaves it unfolded.

Part C (values bound at Bind; proxy/bind_time.py). A ``date_trunc`` unit and a ``HAVING count(*) >`` operand bound
in binary format: text bound in binary is read as its UTF-8 text, an integer in binary where a unit is needed is
refused before anything runs (the same SQLSTATE whoever the WHERE picks), never XX000. No finding.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import psycopg
import pytest
from conftest import attack_roles

reporter, analyst = attack_roles("dp_round21", epsilon=100, scope="module")

K = 10  # the demo reporter's k

ZONES = ["UTC", "Asia/Tokyo", "America/New_York", "Europe/Berlin", "Asia/Kolkata", "Australia/Lord_Howe", "UTC+3"]
KEYS = ["date_trunc('hour', v.visited_at)", "date_trunc('day', v.visited_at)",
        "date_trunc('week', v.visited_at, 'Asia/Tokyo')", "(v.visited_at AT TIME ZONE 'America/New_York')::date",
        "to_char(v.visited_at, 'YYYY-MM-DD HH24')", "extract(hour from v.visited_at)", "v.visited_at::date",
        "date_trunc('hour', v.visited_at AT TIME ZONE 'Europe/Berlin')"]
# Around the DST changes of 2025 (New York, Berlin, Lord Howe), a few hours to a day and a half: small groups.
WINDOWS = ["2025-03-09 04:00+00", "2025-03-30 00:00+00", "2025-04-05 14:00+00", "2025-10-26 00:00+00",
           "2025-11-02 04:00+00"]
HOURS = [3, 7, 30]


def _generated(seed: int, count: int) -> list[tuple[str, str]]:
    """``count`` (zone, WHERE-and-key statement) pairs drawn with a fixed seed."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        start, hours = rng.choice(WINDOWS), rng.choice(HOURS)
        where = (f"v.visited_at >= timestamptz '{start}' "
                 f"AND v.visited_at < timestamptz '{start}' + interval '{hours} hours'")
        drawn.append((rng.choice(ZONES), f"{rng.choice(KEYS)} AS k FROM public.visits v WHERE {where} GROUP BY 1"))
    return drawn


def _set_zone(zone: str, *conns: psycopg.Connection[Any]) -> None:
    for conn in conns:
        conn.execute(f"SET TimeZone = '{zone}'")


@pytest.mark.parametrize(("zone", "statement"), _generated(21, 14))
def test_a_session_zone_releases_no_group_under_k(reporter: psycopg.Connection[Any],
                                                  truth: psycopg.Connection[Any], zone: str, statement: str) -> None:
    """Every released group is PostgreSQL's, with PostgreSQL's count, and holds at least k people (its own
    count(DISTINCT person_id) under the same TimeZone); the windows are narrow enough that some groups are small."""
    _set_zone(zone, reporter, truth)
    try:
        released = reporter.execute(f"SELECT {statement.replace(' AS k ', ' AS k, count(*) AS n ', 1)}").fetchall()
        expected = {key: (rows, people) for key, rows, people in truth.execute(
            f"SELECT {statement.replace(' AS k ', ' AS k, count(*), count(DISTINCT v.person_id) ', 1)}")}
    finally:
        _set_zone("UTC", reporter, truth)
    for key, rows in released:
        if key is None:
            continue  # the suppressed rest
        assert key in expected, (key, zone)
        assert expected[key][0] == rows and expected[key][1] >= K, (key, rows, expected[key], zone)


def test_the_windows_hold_groups_under_k(truth: psycopg.Connection[Any]) -> None:
    """The attack means something: the generated statements meet groups of fewer than k people."""
    small = 0
    for zone, statement in _generated(21, 14):
        _set_zone(zone, truth)
        small += sum(people < K for (people,) in truth.execute(
            f"SELECT count(DISTINCT v.person_id) FROM (SELECT {statement.replace(' AS k ', ' AS k, v.person_id ', 1)}"
            ", v.person_id) AS g(k, person_id) JOIN public.visits v USING (person_id) GROUP BY g.k"))
    _set_zone("UTC", truth)
    assert small > 0


SETTINGS = ["SET DateStyle = 'ISO, DMY'", "SET IntervalStyle = 'sql_standard'", "SET TimeZone = 'UTC+3'",
            "SET my.span = '1 day'", "SET lc_time = 'C'", "SET extra_float_digits = -15"]
# Statements whose evaluation could fail for some row; {p}: a person's id, or one nobody has.
PER_ROW = [
    ("SELECT date_trunc('week', v.visited_at, 'JST') AS k, count(*) FROM public.visits v WHERE v.person_id = {p} "
     "GROUP BY 1", None),
    ("SELECT date_trunc('week', v.visited_at, %s) AS k, count(*) FROM public.visits v WHERE v.person_id = {p} "
     "GROUP BY 1", ("Mars/Olympus",)),
    ("SELECT (v.visited_at AT TIME ZONE %s)::date AS k, count(*) FROM public.visits v WHERE v.person_id = {p} "
     "GROUP BY 1", ("UTC+99",)),
    ("SELECT to_char(v.visited_at, %s) AS k, count(*) FROM public.visits v WHERE v.person_id = {p} GROUP BY 1",
     ("TMMonth",)),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} "
     "AND v.visited_at > now() - current_setting('my.span')::interval", None),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at + interval '290000 years' > now()",
     None),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at - timestamptz '2025-01-01' "
     "> interval '-1 day 2 hours'", None),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND extract(epoch from v.visited_at)::int > 5",
     None),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at > '01/02/2025'", None),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at > %s", ("2025-13-45",)),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND date_part(%s, v.visited_at) > 1",
     ("fortnight",)),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at > timezone(%s, now()::timestamp)",
     ("Mars/Olympus",)),
    ("SELECT count(*) FROM public.visits v WHERE v.person_id = {p} AND v.visited_at > %s::timestamp AT TIME ZONE 'UTC'",
     ("infinity",)),
]


def _outcome(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...] | None) -> str:
    """'rows' or the SQLSTATE of the error."""
    try:
        conn.execute(sql, params).fetchall()
    except psycopg.Error as error:
        assert error.sqlstate != "XX000", error
        return str(error.sqlstate)
    return "rows"


@pytest.fixture(scope="module")
def someone(truth: psycopg.Connection[Any]) -> int:
    row = truth.execute("SELECT min(person_id) FROM public.visits").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("sql", "params"), PER_ROW)
def test_no_error_depends_on_one_person_under_the_sessions_settings(reporter: psycopg.Connection[Any],
                                                                     analyst: psycopg.Connection[Any], someone: int,
                                                                     sql: str, params: tuple[Any, ...] | None) -> None:
    """The same outcome whether the WHERE picks one person or nobody, for both gated roles, under every setting."""
    for conn in (reporter, analyst):
        for setting in SETTINGS:
            conn.execute(setting)
        try:
            assert _outcome(conn, sql.format(p=someone), params) == _outcome(conn, sql.format(p=-1), params)
        finally:
            conn.execute("RESET ALL")


def test_a_unit_bound_in_binary_is_read_as_its_text(reporter: psycopg.Connection[Any],
                                                    truth: psycopg.Connection[Any]) -> None:
    """A text value bound in binary format where a date_trunc unit is needed: PostgreSQL's own groups."""
    sql = "SELECT date_trunc(%b, v.visited_at) AS k, count(*) FROM public.visits v GROUP BY 1"
    got = reporter.execute(sql, ("month",)).fetchall()
    assert Counter(got) == Counter(truth.execute(sql.replace("%b", "%s"), ("month",)).fetchall())


@pytest.mark.parametrize("p", [None, -1])
def test_an_integer_bound_in_binary_where_a_unit_is_needed_is_refused(reporter: psycopg.Connection[Any],
                                                                      someone: int, p: int | None) -> None:
    """A binary int where the unit is text: refused before it runs, the same whoever the WHERE picks."""
    person = someone if p is None else p
    sql = f"SELECT date_trunc(%b::text, v.visited_at) AS k, count(*) FROM public.visits v WHERE v.person_id = {person} GROUP BY 1"
    with pytest.raises(psycopg.Error) as refused:
        reporter.execute(sql, (5,)).fetchall()
    assert refused.value.sqlstate not in (None, "XX000")


def test_a_having_count_bound_in_binary_is_decided_as_the_constant(reporter: psycopg.Connection[Any]) -> None:
    """HAVING count(*) > $1 bound as a binary integer: the same groups as the constant written."""
    bound = reporter.execute("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) > %b "
                             "ORDER BY 1", (100,)).fetchall()
    written = reporter.execute("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) > 100 "
                               "ORDER BY 1").fetchall()
    assert bound == written


# Part B': a minus on the first field only, read as IntervalStyle says; generated with a fixed seed. Where each is
# used: a shift out of range (7000 years back: before 4714 BC) and a stride date_bin refuses when negative.
SHAPES = ["SELECT count(*) FROM public.visits v WHERE v.person_id = {{p}} AND v.visited_at + interval '{years}' > now()",
          "SELECT date_bin('{hours}', v.visited_at, timestamptz '2025-01-01') AS k, count(*) FROM public.visits v "
          "WHERE v.person_id = {{p}} GROUP BY 1"]


def _style_dependent(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    statements = []
    for _ in range(count):
        first = f"-{rng.choice([0, 1])} days"
        statements.append(rng.choice(SHAPES).format(years=f"{first} {rng.randint(6800, 9000)} years",
                                                    hours=f"{first} {rng.randint(25, 72)} hours"))
    return statements


@pytest.mark.parametrize("sql", _style_dependent(21, 6))
@pytest.mark.parametrize("style", ["postgres", "sql_standard"])
def test_an_interval_read_by_the_sessions_style_raises_no_error_for_one_person(
        reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any],
        someone: int, sql: str, style: str) -> None:
    """The same outcome whether the WHERE picks a person with visits or nobody, for both gated roles, under either
    IntervalStyle: a refusal naming the interval's sign, whereas PostgreSQL under sql_standard fails only for the
    person (so the attack means something)."""
    truth.execute(f"SET IntervalStyle = '{style}'")
    try:
        if style == "sql_standard":
            assert _outcome(truth, sql.format(p=someone), None) not in ("rows", "0A000")
            assert _outcome(truth, sql.format(p=-1), None) == "rows"
    finally:
        truth.execute("RESET IntervalStyle")
    for conn in (reporter, analyst):
        conn.execute(f"SET IntervalStyle = '{style}'")
        try:
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(sql.format(p=someone)).fetchall()
            assert refused.value.sqlstate == "0A000"
            assert _outcome(conn, sql.format(p=-1), None) == "0A000"
        finally:
            conn.execute("RESET IntervalStyle")


@pytest.mark.parametrize("style", ["postgres", "sql_standard"])
def test_an_interval_with_every_field_signed_is_answered(reporter: psycopg.Connection[Any],
                                                         truth: psycopg.Connection[Any], style: str) -> None:
    """'-1 day -2 hours' means the same under every style: PostgreSQL's groups, as before."""
    sql = ("SELECT date_trunc('day', v.visited_at - interval '-1 day -2 hours') AS k, count(*) FROM public.visits v "
           "GROUP BY 1")
    for conn in (reporter, truth):
        conn.execute(f"SET IntervalStyle = '{style}'")
    try:
        assert Counter(reporter.execute(sql).fetchall()) == Counter(truth.execute(sql).fetchall())
    finally:
        for conn in (reporter, truth):
            conn.execute("RESET IntervalStyle")


def test_the_epoch_of_an_interval_read_by_the_sessions_style_is_not_folded(reporter: psycopg.Connection[Any],
                                                                         truth: psycopg.Connection[Any]) -> None:
    """extract(epoch from interval '-1 day 2 hours') was folded to the number IntervalStyle postgres gives (-79200):
    under sql_standard the reporter's answer was not PostgreSQL's (-93600 there). Now PostgreSQL's, or refused."""
    sql = ("SELECT a.sex, count(*) / extract(epoch from interval '-1 day 2 hours') AS r FROM public.adult a "
           "GROUP BY 1 ORDER BY 1")
    for conn in (reporter, truth):
        conn.execute("SET IntervalStyle = 'sql_standard'")
    try:
        try:
            got = reporter.execute(sql).fetchall()
        except psycopg.Error as refused:
            assert refused.sqlstate == "0A000", refused
        else:
            assert got == truth.execute(sql).fetchall()
    finally:
        for conn in (reporter, truth):
            conn.execute("RESET IntervalStyle")
