"""dp answers in the client's time zone, through the real proxy: a calendar key over a timestamptz column buckets
by the client's days and hours (its ``SET TIME ZONE``), as PostgreSQL buckets them for that client, and literals
in the WHERE clause are read in that zone too; a question asked in another zone is another question, charged
and cached as one, and a repeat in the same zone is free.

The gated database holds the demo's ``public.visits`` (visited_at bounded to 2025-01-01 .. 2026-12-31 23:59:59 UTC);
each test has a dp role of its own (ε 20 in all, 0.5 per query). The test server runs in UTC.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from psycopg.types.string import TextLoader

_names = itertools.count(1)
# The discrete Gaussian at ε 0.5 of a count (Δ = 1) has σ ≈ 2.8: |noise| > 28 has probability < 1e-20.
NOISE = 28
# Zones whose days and hours are not UTC's: a daylight-saving change (9 March 2025 has 23 hours in New York), a
# half-hour offset, and a zone given as an interval (PostgreSQL reports it as the POSIX spec '<+05:45>-05:45').
ZONES = ["America/New_York", "Asia/Kolkata", "interval '+05:45' hour to minute"]
DAILY = ("select date_trunc('day', visited_at) as day, count(*) from visits "
         "where visited_at >= '2025-03-01' and visited_at < '2025-03-15' group by 1 order by 1")
HOURLY = ("select date_trunc('hour', visited_at) as hour, count(*) from visits "
          "where visited_at >= '2025-03-09' and visited_at < '2025-03-10' group by 1 order by 1")
DATES = ("select visited_at::date as day, count(*) from visits "
         "where visited_at >= '2025-03-01' and visited_at < '2025-03-08' group by 1 order by 1")


@pytest.fixture(autouse=True)
def truth_as_it_was(truth: psycopg.Connection) -> Iterator[None]:
    """The shared connection to the data back at the server's own settings after each test."""
    yield
    truth.execute("reset timezone")
    truth.execute("reset datestyle")


@pytest.fixture
def conn(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
    role = f"dp_zone_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, role, epsilon=20), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as connection:
        yield connection


def in_zone(connection: psycopg.Connection, zone: str, sql: str) -> list[tuple[Any, ...]]:
    """``sql``'s rows on ``connection`` after ``SET TIME ZONE zone``."""
    connection.execute(f"set time zone {zone if zone.startswith('interval') else repr(zone)}")
    return connection.execute(sql).fetchall()


def buckets(truth: psycopg.Connection, zone: str, first: str, last: str, step: str) -> list[object]:
    """PostgreSQL's own list of the buckets from ``first`` to ``last`` (literals read in ``zone``)."""
    return [row[0] for row in in_zone(truth, zone, f"select generate_series(timestamptz '{first}', "
                                                   f"timestamptz '{last}', interval '{step}')")]


def repeat_visitors(truth: psycopg.Connection, zone: str, sql: str) -> int:
    """People with more than one row where ``sql`` reads (its WHERE): what the contribution bound may leave out."""
    where = sql.split(" where ")[1].split(" group by ")[0]
    return in_zone(truth, zone, f"select count(*) from (select person_id from visits where {where} "
                                "group by person_id having count(*) > 1) t")[0][0]


def assert_noisy_copy(answer: list[tuple[Any, ...]], exact: list[tuple[Any, ...]], slack: int) -> None:
    """The same keys as PostgreSQL's own answer, each count within the noise (and ``slack`` rows the contribution
    bound may drop) of the exact one."""
    assert [row[0] for row in answer] == [row[0] for row in exact]
    for (_, noisy), (_, count) in zip(answer, exact, strict=True):
        assert abs(noisy - count) <= NOISE + slack


def spent(connection: psycopg.Connection) -> str:
    return connection.execute("show anonproxy.budget").fetchone()[0]


@pytest.mark.parametrize("zone", ZONES)
def test_buckets_are_the_clients_days_and_hours(conn: psycopg.Connection, truth: psycopg.Connection,
                                                zone: str) -> None:
    daily = in_zone(conn, zone, DAILY)
    assert [row[0] for row in daily] == buckets(truth, zone, "2025-03-01", "2025-03-14", "1 day")
    assert_noisy_copy(daily, in_zone(truth, zone, DAILY), repeat_visitors(truth, zone, DAILY))
    hourly = in_zone(conn, zone, HOURLY)
    assert [row[0] for row in hourly] == buckets(truth, zone, "2025-03-09", "2025-03-09 23:00", "1 hour")
    assert_noisy_copy(hourly, in_zone(truth, zone, HOURLY), repeat_visitors(truth, zone, HOURLY))
    dates = in_zone(conn, zone, DATES)  # a cast to date: the client's calendar day of each visit
    assert_noisy_copy(dates, in_zone(truth, zone, DATES), repeat_visitors(truth, zone, DATES))


def test_new_york_has_a_23_hour_day(conn: psycopg.Connection) -> None:
    hours = [row[0] for row in in_zone(conn, "America/New_York", HOURLY)]
    assert len(hours) == 23 and [hour.hour for hour in hours] == [0, 1, *range(3, 24)]


def test_another_zone_is_another_question_and_a_repeat_is_free(conn: psycopg.Connection,
                                                               truth: psycopg.Connection) -> None:
    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))

    def ask(zone: str) -> tuple[list[tuple[Any, ...]], str]:
        notices.clear()
        rows = in_zone(conn, zone, DAILY)
        return rows, " ".join(notices)

    before = spent(conn)
    in_utc, said = ask("UTC")
    assert "this answer moved" in said
    after_utc = spent(conn)
    assert after_utc != before
    in_new_york, said = ask("America/New_York")
    assert "this answer moved" in said  # charged: not the UTC answer replayed
    after_new_york = spent(conn)
    assert after_new_york != after_utc
    assert [row[0] for row in in_utc] == buckets(truth, "UTC", "2025-03-01", "2025-03-14", "1 day")
    assert [row[0] for row in in_new_york] == buckets(truth, "America/New_York", "2025-03-01", "2025-03-14", "1 day")
    again, said = ask("America/New_York")
    assert "paid for when first asked" in said and spent(conn) == after_new_york
    assert again == in_new_york  # the same noisy measurement, not a new draw
    back, said = ask("UTC")
    assert "paid for when first asked" in said and spent(conn) == after_new_york
    assert back == in_utc


def test_explain_says_whether_this_zones_answer_is_cached(conn: psycopg.Connection) -> None:
    def explained(zone: str) -> str:
        return "\n".join(row[0] for row in in_zone(conn, zone, "explain (anonproxy) " + DAILY))

    in_zone(conn, "UTC", DAILY)
    assert "running it moves" not in explained("UTC")  # paid for: free
    assert "running it moves" in explained("America/New_York")  # another zone: another question


def test_dates_are_read_and_printed_in_the_clients_datestyle(conn: psycopg.Connection,
                                                             truth: psycopg.Connection) -> None:
    """'01/03/2025' is the 1st of March to a DMY client: its dp question reads it so, and its keys print as
    PostgreSQL prints them to it (SQL style, the zone's abbreviation)."""
    sql = ("select date_trunc('day', visited_at) as day, count(*) from visits "
           "where visited_at >= '01/03/2025' and visited_at < '04/03/2025' group by 1 order by 1")

    def texts(connection: psycopg.Connection) -> list[str]:
        connection.execute("set datestyle = 'SQL, DMY'")
        cursor = connection.cursor()
        cursor.adapters.register_loader("timestamptz", TextLoader)
        return [row[0] for row in cursor.execute(sql)]

    conn.execute("set time zone 'America/New_York'")
    truth.execute("set time zone 'America/New_York'")
    assert texts(conn) == texts(truth) == [f"0{day}/03/2025 00:00:00 EST" for day in (1, 2, 3)]


def test_an_output_style_alone_is_the_same_question(conn: psycopg.Connection) -> None:
    """DateStyle's output style (not its field order), IntervalStyle and extra_float_digits only change how the
    answer prints: the same measurement, free, printed again."""
    conn.execute("set datestyle = 'ISO, MDY'")
    first = in_zone(conn, "America/New_York", DATES)
    before = spent(conn)
    conn.execute("set datestyle = 'Postgres, MDY'")
    conn.execute("set intervalstyle = 'iso_8601'")
    conn.execute("set extra_float_digits = 0")
    assert conn.execute(DATES).fetchall() == first and spent(conn) == before


def test_attack_zone_switching_buys_no_free_draw_and_stops_at_the_budget(truth: psycopg.Connection,
                                                                        gated_proxy: Endpoint,
                                                                        gated_database: str) -> None:
    """An attacker who shifts the zone to move one person's visit between buckets, or to average fresh noise,
    pays for each zone's answer: with ε 1 in all (0.5 a question), two zones are answered (noisy), the third is refused before its
    SQL runs, and asking again in a zone already paid for gives that zone's same noisy answer, free."""
    role = f"dp_zone_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, role, epsilon=1), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as attacker:
        in_utc = in_zone(attacker, "UTC", HOURLY)
        in_new_york = in_zone(attacker, "America/New_York", HOURLY)
        assert "epsilon 0 of 1 left" in spent(attacker)
        with pytest.raises(psycopg.Error) as refused:
            in_zone(attacker, "Asia/Kolkata", HOURLY)
        assert refused.value.sqlstate == "53400"
        assert in_zone(attacker, "UTC", HOURLY) == in_utc
        assert in_zone(attacker, "America/New_York", HOURLY) == in_new_york
        exact = dict(in_zone(truth, "America/New_York", HOURLY))
        assert any(count != exact.get(hour, 0) for hour, count in in_new_york)  # noisy, not the exact counts
