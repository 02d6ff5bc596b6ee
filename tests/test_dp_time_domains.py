"""Public time domains in dp mode, through the real proxy: a calendar key of a time column with declared bounds lists
every bucket of the declared range (noisy, zero-filled where empty), without partition selection, narrowed by a
WHERE on the column; rows outside the declared range fall in no bucket.

The gated database holds the demo's ``public.visits`` (visited_at bounded to 2025-01-01 .. 2026-12-31 23:59:59 UTC),
and each test a dp role of its own (ε 20 in all, 0.5 per query, δ 1e-7 per query).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.store import load_policy

_names = itertools.count(1)
# The discrete Gaussian at ε 0.5 of a count (Δ = 1) has σ ≈ 2.8: |noise| > 28 has probability < 1e-20.
NOISE = 28
MONTHS = [datetime(2025 + m // 12, 1 + m % 12, 1, tzinfo=UTC) for m in range(24)]


@pytest.fixture
def conn(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
    role = f"dp_time_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, role, epsilon=20), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as connection:
        connection.execute("set timezone = 'UTC'")
        yield connection


def spent(conn: psycopg.Connection) -> str:
    return conn.execute("show anonproxy.budget").fetchone()[0]


def exact(truth: psycopg.Connection, sql: str) -> dict[object, int]:
    truth.execute("set timezone = 'UTC'")
    return {row[0]: row[1] for row in truth.execute(sql)}


def test_a_monthly_series_lists_every_month_noisy_and_no_delta(conn: psycopg.Connection,
                                                              truth: psycopg.Connection) -> None:
    sql = ("select date_trunc('month', visited_at) as month, count(*) from visits "
           "group by date_trunc('month', visited_at) order by 1")
    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    rows = conn.execute(sql).fetchall()
    assert [row[0] for row in rows] == MONTHS  # every month of the declared range, as timestamptz, in order
    # Each person counts once (one group, one row: the role's contribution bounds), in one of the months: the noisy
    # counts add up to the number of people, give or take the noise of 24 counts.
    people = truth.execute("select count(distinct person_id) from visits").fetchone()[0]
    assert abs(sum(n for _, n in rows) - people) <= 24 * NOISE
    assert all(abs(n - people / 24) < 300 for _, n in rows)
    # No partition selection: no δ spent; charged as a question over a declared domain is.
    declared = conn.execute("select channel, count(*) from visits group by channel").fetchall()
    assert [row[0] for row in declared] == ["web", "app", "store", "phone"]
    assert "it costs ρ=0.06382, δ=0 (zCDP" in notices[0]  # no δ: no partition selection
    # two questions of one count each, ρ 0.0638129 each (shown rounded up); δ untouched
    assert "delta 0.00001 of 0.00001 left" in spent(conn) and "rho 0.1277 spent" in spent(conn)


def test_a_daily_series_is_zero_filled_where_nobody_visited(conn: psycopg.Connection,
                                                             truth: psycopg.Connection) -> None:
    # Nobody visits on 2025-03-02 once its visits are moved a year later: the day is still listed, noisy around 0.
    day_visits = truth.execute("select count(*) from visits where visited_at >= '2025-03-02 00:00+00' "
                               "and visited_at < '2025-03-03 00:00+00'").fetchone()[0]
    assert day_visits > 50
    truth.execute("update visits set visited_at = visited_at + interval '1 year' "
                  "where visited_at >= '2025-03-02 00:00+00' and visited_at < '2025-03-03 00:00+00'")
    try:
        rows = conn.execute("select date_trunc('day', visited_at), count(*) from visits where visited_at >= '2025-03-01' "
                            "and visited_at < '2025-04-01' group by 1 order by 1").fetchall()
        people = truth.execute("select count(distinct person_id) from visits where visited_at >= '2025-03-01 00:00+00' "
                               "and visited_at < '2025-04-01 00:00+00'").fetchone()[0]
    finally:
        truth.execute("update visits set visited_at = visited_at - interval '1 year' "
                      "where visited_at >= '2026-03-02 00:00+00' and visited_at < '2026-03-03 00:00+00'")
    assert [row[0] for row in rows] == [datetime(2025, 3, 1, tzinfo=UTC) + timedelta(days=d) for d in range(31)]
    by_day = dict(rows)
    assert abs(by_day[datetime(2025, 3, 2, tzinfo=UTC)]) <= NOISE  # the empty day, zero-filled and noisy
    assert abs(sum(by_day.values()) - people) <= 31 * NOISE  # each person of March once, in one of its days


def test_where_narrows_the_buckets(conn: psycopg.Connection, truth: psycopg.Connection) -> None:
    def months(where: str) -> list[object]:
        return [row[0] for row in conn.execute(
            f"select date_trunc('month', visited_at), count(*) from visits where {where} group by 1 order by 1")]

    assert months("visited_at >= '2025-03-01' and visited_at < '2025-06-01'") == MONTHS[2:5]
    assert months("visited_at between '2025-03-15' and '2025-06-01'") == MONTHS[2:6]  # June 1st is in
    assert months("'2026-11-30' < visited_at") == MONTHS[22:]  # a strict bound, either way round
    assert months("visited_at = timestamptz '2025-02-10 12:00+00'") == MONTHS[1:2]
    assert months("visited_at >= '2027-01-01'") == []  # outside the declared range: no bucket
    # what is not understood leaves the whole range: an OR, a cast, another column
    assert months("visited_at < '2025-02-01' or channel = 'web'") == MONTHS
    assert months("date_trunc('day', visited_at) < '2025-02-01'") == MONTHS
    assert months("amount > 100") == MONTHS


def test_other_calendar_keys(conn: psycopg.Connection, truth: psycopg.Connection) -> None:
    days = conn.execute("select extract(dow from visited_at) as d, count(*) from visits group by 1 order by 1"
                        ).fetchall()
    assert [int(row[0]) for row in days] == list(range(7))
    hours = conn.execute("select date_trunc('hour', visited_at), count(*) from visits "
                         "where visited_at >= '2026-12-31' group by 1 order by 1").fetchall()
    assert [row[0] for row in hours] == [datetime(2026, 12, 31, h, tzinfo=UTC) for h in range(24)]
    labels = conn.execute("select to_char(visited_at, 'YYYY-MM') as m, count(*) from visits "
                          "where visited_at < '2025-04-01' group by 1 order by 1").fetchall()
    assert [row[0] for row in labels] == ["2025-01", "2025-02", "2025-03"]
    both = conn.execute("select channel, date_trunc('year', visited_at), count(*) from visits group by 1, 2"
                        ).fetchall()
    assert sorted((row[0], row[1].year) for row in both) == sorted(
        (channel, year) for channel in ("web", "app", "store", "phone") for year in (2025, 2026))


def test_grafanas_epoch_bins_list_every_hour_of_its_time_filter(conn: psycopg.Connection) -> None:
    """$__timeGroupAlias(visited_at, 1h) with $__timeFilter over one week and a metric column (the BI corpus's
    gf-macro-timegroup-hour-metric): every hour of the week for every channel, though an hour holds a few people."""
    rows = conn.execute("""
        SELECT floor(extract(epoch from visited_at)/3600)*3600 AS "time", channel AS metric, sum(amount) AS "revenue"
        FROM visits WHERE visited_at BETWEEN '2025-06-01T00:00:00Z' AND '2025-06-07T23:59:59Z'
        GROUP BY 1, 2 ORDER BY 1""").fetchall()
    first = datetime(2025, 6, 1, tzinfo=UTC).timestamp()
    assert {(int(row[0]), row[1]) for row in rows} == {
        (int(first) + 3600 * hour, channel) for hour in range(7 * 24) for channel in ("web", "app", "store", "phone")}
    assert len(rows) == 7 * 24 * 4


def test_one_persons_timestamp_outside_the_range_makes_no_bucket(conn: psycopg.Connection,
                                                                 truth: psycopg.Connection) -> None:
    """The attack: one person's visit in 1970 (and one in 2031) would be a group of one, released only because of
    them. The declared range lists no such month or year, and their rows count in no bucket of it either (the
    plan's exact statistics, before noise: each person counts once, so their sum is the number of people with a
    visit within the range, the newcomer whose only visits are outside it not among them)."""
    truth.execute("insert into adult select 40001, age, workclass, fnlwgt, education, education_num, marital_status, "
                  "occupation, relationship, race, sex, capital_gain, capital_loss, hours_per_week, native_country, "
                  "income from adult where id = 17")
    truth.execute("insert into visits values (900001, 40001, '1970-01-01 12:00+00', 'web', 42), "
                  "(900002, 40001, '2031-06-01 12:00+00', 'web', 42)")
    try:
        rows = conn.execute("select date_trunc('month', visited_at), count(*), sum(amount) from visits "
                            "group by 1 order by 1").fetchall()
        assert [row[0] for row in rows] == MONTHS
        years = conn.execute("select extract(year from visited_at), count(*) from visits group by 1 order by 1"
                             ).fetchall()
        assert [int(row[0]) for row in years] == [2025, 2026]
        policy = load_policy(truth)
        for key in ("extract(month from visited_at)", "date_trunc('year', visited_at)"):
            plan = plan_dp(f"select {key}, count(*) from visits group by 1", policy.role("analyst"), policy,
                           DPParams(0.5, 1e-7))
            assert isinstance(plan, DPPlan) and plan.selection is None
            counted = sum(row[1] for row in truth.execute(plan.sql))
            assert counted == 30162, key  # without the range's filter: 30163 (person 40001's 1970 visit)
    finally:
        truth.execute("delete from visits where visit_id in (900001, 900002)")
        truth.execute("delete from adult where id = 40001")


def test_without_time_bounds_partition_selection_as_before(conn: psycopg.Connection, truth: psycopg.Connection,
                                                           gated_proxy: Endpoint, gated_database: str) -> None:
    from conftest import wait_for_policy

    truth.execute("select anonproxy.set_time_bounds('public.visits', 'visited_at', null, null)")
    wait_for_policy(gated_proxy, gated_database,
                    truth.execute("select version from anonproxy.policy_version").fetchone()[0])
    try:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("select date_trunc('month', visited_at), count(*) from visits group by 1").fetchall()
        assert "it costs ρ=0.06382, δ=1e-07" in notices[0]  # the δ of partition selection
    finally:
        truth.execute("select anonproxy.set_time_bounds('public.visits', 'visited_at', '2025-01-01 00:00:00+00', "
                      "'2026-12-31 23:59:59+00')")
        wait_for_policy(gated_proxy, gated_database,
                        truth.execute("select version from anonproxy.policy_version").fetchone()[0])
