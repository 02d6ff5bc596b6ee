"""Time functions over protected tables (issue 19 item 2), in both modes, with the no-error proof.

Decisions first, on an in-memory policy (a linked table of dates and timestamps, with and without declared time
bounds): what is admitted, what is refused and why, the refusals naming what the client wrote. Then through the
gated proxy over ``public.events``, a table linked to ``adult`` whose rows include the 'infinity' and '-infinity'
timestamps real data holds as sentinels: suppress-mode answers equal PostgreSQL's own for the released groups, dp
answers are noisy answers over the right buckets, and each attack (a cast or a field that fails on the infinite
row, a time zone that fails only when a row reaches it, an interval that overflows for one person's row, a bucket
that exists only because of one person's timestamp) is refused before any row is read, where PostgreSQL itself
shows the error the refusal keeps from leaking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
import sqlglot
from conftest import Endpoint, fresh_dp_role, wait_for_current_policy
from psycopg.types.string import TextLoader

from anonproxy.dp.answers import decoded, encoded
from anonproxy.dp.finish import Group, Measurement
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan import bounds, time_values
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy

K = 10
ADULT_TYPES = {"id": "integer", "age": "integer", "sex": "text"}
ADULT = ProtectedTable("public.adult", "id", {"id": ColumnPolicy("id", "identifier"),
                                              "age": ColumnPolicy("age", lower=17, upper=90)}, types=ADULT_TYPES)
EVENT_TYPES = {"event_id": "bigint", "person_id": "integer", "at": "timestamp with time zone", "day": "date",
               "local": "timestamp without time zone", "spent": "interval", "kind": "text", "epoch": "bigint"}
EVENT_COLUMNS = {"event_id": ColumnPolicy("event_id", "identifier"), "person_id": ColumnPolicy("person_id", "identifier"),
                 "kind": ColumnPolicy("kind", domain=("web", "app"))}
EVENTS = LinkedTable("public.events", "person_id", "public.adult", "id", EVENT_COLUMNS, types=EVENT_TYPES)
# Part of a server's tz database (pg_timezone_names, folded), as a policy read from PostgreSQL carries it: the zones
# the proof accepts ('Mars/Olympus' and the like are in none).
ZONES = frozenset({"utc", "gmt", "europe/paris", "asia/tokyo", "asia/kolkata", "america/new_york",
                   "pacific/kiritimati", "etc/gmt+12", "america/st_johns", "asia/kathmandu"})
POLICY = Policy(version=1, tables={"public.adult": ADULT}, links={"public.events": EVENTS}, zones=ZONES)
# The same, with the time columns' declared bounds (issue 19 item 1): then no infinity, and a narrow range.
BOUNDED = Policy(version=1, tables={"public.adult": ADULT}, links={"public.events": dataclasses.replace(
    EVENTS, columns=EVENT_COLUMNS | {
        "at": ColumnPolicy("at", earliest=datetime(2025, 1, 1, tzinfo=UTC), latest=datetime(2026, 12, 31, tzinfo=UTC)),
        "day": ColumnPolicy("day", earliest=datetime(2025, 1, 1), latest=datetime(2026, 12, 31)),
        "local": ColumnPolicy("local", earliest=datetime(2025, 1, 1), latest=datetime(2026, 12, 31))})},
    zones=ZONES)
SUPPRESS = RolePolicy("reporter", "suppress", SuppressionParams(k=K))
DP = RolePolicy("analyst", "dp")
PARAMS = DPParams(epsilon=1.0, delta=1e-6)


def decided(sql: str, role: RolePolicy, policy: Policy = POLICY) -> object:
    decision = decide(sql, role, policy)
    if isinstance(decision, Noisy):
        return plan_dp(decision.sql, role, policy, PARAMS)
    return decision


def admitted(sql: str, policy: Policy = POLICY) -> None:
    for role in (SUPPRESS, DP):
        decision = decided(sql, role, policy)
        assert not isinstance(decision, Reject), (role.mode, sql, decision)


def admitted_in_suppress_only(sql: str) -> None:
    """A WHERE condition that needs the range assumed of a time column without declared bounds (2000 BC to 200000
    AD): admitted in suppress mode; refused in dp mode, which assumes nothing of the data (a row at 294276 AD would
    fail it: docs/dp.md)."""
    assert not isinstance(decided(sql, SUPPRESS), Reject), sql
    decision = decided(sql, DP)
    assert isinstance(decision, Reject) and decision.sqlstate == "0A000" and decision.hint, (sql, decision)


def admitted_with_bounds(sql: str) -> None:
    """A WHERE condition that needs the declared time bounds: admitted in both modes; dp runs it only on the rows
    within them, with a CASE PostgreSQL evaluates first (docs/dp.md)."""
    admitted(sql, BOUNDED)
    plan = decided(sql, DP, BOUNDED)
    assert isinstance(plan, DPPlan) and "CASE WHEN" in plan.sql, plan


def refused(sql: str, *words: str, policy: Policy = POLICY, hint: str = "") -> None:
    for role in (SUPPRESS, DP):
        decision = decided(sql, role, policy)
        assert isinstance(decision, Reject), (role.mode, sql, decision)
        assert decision.sqlstate == "0A000" and decision.hint and hint in decision.hint, decision
        for word in words:
            assert word.lower() in decision.message.lower(), (word, decision.message)


# --- decisions ------------------------------------------------------------------------------------------------

ADMITTED = [
    # every date_trunc unit on timestamps, dates and timestamptz; 'week' included; a constant IANA zone
    *(f"select date_trunc('{unit}', at), count(*) from events group by 1" for unit in (
        "microseconds", "milliseconds", "second", "minute", "hour", "day", "week", "month", "quarter", "year",
        "decade", "century", "millennium")),
    "select date_trunc('week', day), date_trunc('WEEK', local), count(*) from events group by 1, 2",
    "select date_trunc('day', at, 'Europe/Paris'), count(*) from events group by 1",
    "select date_trunc('hour', spent), count(*) from events group by 1",  # an interval: every unit but week
    "select date_bin('15 minutes', local, timestamp '2001-01-01'), count(*) from events group by 1",
    # extract/date_part fields of each type, and their integer casts where no infinity can reach them
    ("select extract(hour from at), extract(timezone from at), date_part('minute', local), count(*) "
     "from events group by 1, 2, 3"),
    "select extract(dow from day), extract(isodow from at), count(*) from events group by 1, 2",
    "select cast(extract(dow from at) as integer) + 1, count(*) from events group by 1",  # NULL on infinity
    # casts between time types, date(x), AT TIME ZONE both ways, timezone()
    "select at::date, cast(at as timestamp), local::timestamptz, date(at), count(*) from events group by 1, 2, 3, 4",
    "select at at time zone 'UTC', local at time zone 'America/New_York', count(*) from events group by 1, 2",
    "select timezone('Asia/Tokyo', at), count(*) from events group by 1",
    # interval arithmetic with constants, the clock, to_timestamp and make_date of constants
    "select date_trunc('week', at + interval '1 day') + interval '-1 day', count(*) from events group by 1",
    "select count(*) from events where at >= now() - interval '30 days' and day > current_date - 7",
    ("select count(*) from events where local < localtimestamp and at < transaction_timestamp() "
     "and at <= statement_timestamp() and at < current_timestamp"),
    "select count(*) from events where at >= to_timestamp('2025-01-01 00:00:00', 'YYYY-MM-DD HH24:MI:SS')",
    "select count(*) from events where day >= make_date(2025, 1, 31)",
    # make_interval of number constants (MetricFlow's offset window), by name or by position
    "select date_trunc('day', at) + make_interval(days => 14), count(*) from events group by 1",
    "select count(*) from events where at > now() - make_interval(0, 1, 0, -2, 0, 0, 1)",
    "select to_char(date_trunc('month', at), 'YYYY-MM'), count(*) from events group by date_trunc('month', at)",
    # Looker: a constant subquery over the clock, with || of constants cast to an interval
    ("select count(*) from events where at >= ((SELECT (DATE_TRUNC('day', CURRENT_TIMESTAMP) + (-6 || ' day')"
     "::INTERVAL)))"),
    # date_bin's origin as a quoted string: it takes the source's type (timestamp or timestamptz)
    "select date_bin('1 hour', local, '2025-01-01'), date_bin('1 day', at, '2025-01-01 12:00+00'), count(*) "
    "from events group by 1, 2",
    # a date in date_bin: PostgreSQL casts it to the origin's type (a quoted origin's is timestamptz)
    "select date_bin('1 hour', day, '2025-01-01'), date_bin('7 days', day, timestamp '2025-01-06'), count(*) "
    "from events group by 1, 2",
    # ±infinity constants moved by an interval or a number of days stay infinite: PostgreSQL raises nothing
    ("select count(*) from events where at < 'infinity'::timestamptz + interval '1 day' "
     "and local > timestamp '-infinity' - interval '300000 years' and day < 'infinity'::date + 3"),
]


@pytest.mark.parametrize("sql", ADMITTED)
def test_time_functions_are_admitted_in_both_modes(sql: str) -> None:
    admitted(sql)


@pytest.mark.parametrize(("sql", "words"), [
    # week fails on an interval; hour on a date; timezone on a timestamp (PostgreSQL: only when a row reaches it)
    ("select date_trunc('week', spent), count(*) from events group by 1", ("week", "interval")),
    ("select extract(hour from day), count(*) from events group by 1", ("hour", "date")),
    ("select date_part('hour', day), count(*) from events group by 1", ("hour", "date")),
    ("select extract(timezone from local), count(*) from events group by 1", ("timezone", "timestamp")),
    # an 'infinity' timestamp has an infinite year: the integer cast fails on that row
    ("select cast(extract(year from at) as integer), count(*) from events group by 1", ("infinity",)),
    ("select count(*) from events where extract(epoch from at)::bigint > 0", ("infinity",)),
    # subtracting timestamps fails on infinite ones
    ("select count(*) from events where at - timestamptz '2025-01-01' > interval '1 day'", ("infinite",)),
    # a zone PostgreSQL does not know fails only when a row reaches it; a POSIX zone may shift by days
    ("select count(*) from events where person_id = 17 and (at at time zone 'Nope/Zone') > now()", ("time zone",)),
    ("select date_trunc('day', at at time zone 'UTC+99'), count(*) from events group by 1", ("time zone",)),
    ("select date_trunc('day', at, 'Mars/Olympus'), count(*) from events group by 1", ("time zone",)),
    ("select timezone(kind, at), count(*) from events group by 1", ("time zone",)),
    # an interval that overflows for the rows a CASE routes to it
    ("select count(*) from events where case when person_id = 17 then at + interval '300000 years' end > now()",
     ("range of dates",)),
    ("select count(*) from events where day - 100000000 > current_date", ("range of dates",)),
    ("select count(*) from events where at - interval '90000 years' > now()", ("range of dates",)),
    ("select count(*) from events where at + interval '100000 years' > now()", ("range of dates",)),
    ("select count(*) from events where at + spent > now()", ("constant interval",)),
    # date_bin's stride: no months, not zero or negative
    ("select date_bin('1 month', local, timestamp '2001-01-01'), count(*) from events group by 1", ("stride",)),
    ("select date_bin('0 days', local, timestamp '2001-01-01'), count(*) from events group by 1", ("stride",)),
    ("select date_bin('-1 day', local, timestamp '2001-01-01'), count(*) from events group by 1", ("stride",)),
    # an infinite origin fails for every finite row ("origin out of range"); one the proxy cannot read is refused
    ("select date_bin('1 hour', local, 'infinity'), count(*) from events group by 1", ("finite timestamp",)),
    ("select date_bin('1 hour', local, timestamp '-infinity'), count(*) from events group by 1", ("finite",)),
    ("select date_bin('1 hour', local, 'today'), count(*) from events group by 1", ("origin",)),
    # no date_bin of two arguments in PostgreSQL
    ("select date_bin('1 hour', local), count(*) from events group by 1", ("date_bin",)),
    # subtracting an infinite constant from a column fails for every finite row
    ("select count(*) from events where local - 'infinity'::timestamp > interval '1 day'", ("infinite",)),
    # to_timestamp runs when the statement runs: a constant it cannot read would fail only if a row reached it
    ("select count(*) from events where at > to_timestamp('2025-13-45', 'YYYY-MM-DD')", ("to_timestamp",)),
    # the volatile clock is not the statement's: it tells how long each row took
    ("select count(*) from events where at < clock_timestamp()", ("clock_timestamp",)),
    ("select count(*) from events where at < current_timestamp(3)", ("current_timestamp",)),
    # make_interval of a column is not a constant interval
    ("select count(*) from events where at > now() - make_interval(days => person_id)", ("make_interval",)),
    # a subquery with an aggregate, or over a column, is not a constant
    ("select count(*) from events where at > (select max(at))", ("subqueries",)),
])
def test_time_attacks_are_refused_in_both_modes(sql: str, words: tuple[str, ...]) -> None:
    refused(sql, *words)


def test_refusals_name_the_function_the_client_wrote() -> None:
    # sqlglot reads to_timestamp(x) as UnixToTime and to_timestamp(a, b) as StrToTime
    for sql in ("select count(*) from events where to_timestamp(epoch) > now()",
                "select count(*) from events where at > to_timestamp(kind, 'YYYY')"):
        for role in (SUPPRESS, DP):
            decision = decided(sql, role)
            assert isinstance(decision, Reject), decision
            assert "to_timestamp" in decision.message.lower(), decision.message
            assert "unix_to_time" not in decision.message.lower() and "str_to_time" not in decision.message.lower()


def test_declared_time_bounds_admit_what_infinity_would_break() -> None:
    for sql in ("select cast(extract(year from at) as integer), count(*) from events group by 1",
                "select extract(epoch from at)::bigint / 86400, count(*) from events group by 1",
                "select count(*) from events where at - timestamptz '2025-01-01' > interval '1 day'"):
        refused(sql)
        if " where " in sql:
            admitted_with_bounds(sql)
        else:
            admitted(sql, BOUNDED)


def test_a_quoted_date_bin_origin_stays_a_quoted_string() -> None:
    # sqlglot alone reads the third argument as a unit and renders it unquoted: 2025-01-01 00:30 (arithmetic)
    sql = "select date_bin('1 hour', local, '2025-01-01 00:30') as b, count(*) from events group by 1"
    for role in (SUPPRESS, DP):
        decision = decided(sql, role)
        assert not isinstance(decision, Reject), decision
        assert "date_bin('1 hour', local, '2025-01-01 00:30')" in decision.sql, decision.sql


def test_a_bc_constant_subtracted_from_a_bounded_column_is_admitted() -> None:
    # the BC constant is read: with declared bounds the difference fits an interval for every value they allow
    sql = "select count(*) from events where at - '4713-01-01 BC'::timestamptz > interval '2460000 days'"
    refused(sql, "infinite")
    admitted_with_bounds(sql)


@pytest.mark.parametrize("earliest", ["4713-01-01 BC", "4714-11-24 BC"])
def test_a_difference_that_may_pass_the_interval_range_stays_refused(truth: psycopg.Connection,
                                                                      earliest: str) -> None:
    """A column holding the whole timestamp range: its latest value minus 4713 BC is more than 2^63 microseconds.
    PostgreSQL fails there ("interval out of range", newer versions) or wraps around to a negative interval (older
    ones, without an overflow check): either way no right answer exists for that row, and the proof refuses."""
    sql = f"select timestamp '294276-12-31 23:59:59' - timestamp '{earliest}' > interval '0 days'"
    try:
        with truth.transaction():
            (positive,) = truth.execute(sql).fetchone()
        assert positive is False
    except psycopg.errors.DatetimeFieldOverflow:
        pass
    whole = bounds.ColumnFacts("t", "timestamp without time zone", earliest=time_values.TS_MIN,
                               latest=time_values.TS_END - 1)
    with pytest.raises(bounds.Unsafe, match="overflow an interval"):
        bounds.evaluate(sqlglot.parse_one(f"t - '{earliest}'::timestamp", read="postgres"), lambda column: whole)


def test_without_bounds_a_shift_larger_than_the_assumed_margin_asks_for_them() -> None:
    admitted_in_suppress_only("select count(*) from events where at + interval '100 years' > now()")
    # (later only moves the end of the range, 94,000 years from PostgreSQL's last timestamp; earlier moves its
    # start, 2,700 years from PostgreSQL's first)
    admitted_in_suppress_only("select count(*) from events where at + interval '5000 years' > now()")
    refused("select count(*) from events where at - interval '5000 years' > now()", "range of dates",
            hint="earliest and latest")
    admitted_with_bounds("select count(*) from events where at - interval '5000 years' > now()")
    # a shift one way moves one end of the range: 90,000 years later stays within it from 200000 AD, an earlier
    # start of the range stays where it was (it was also moved 90,000 years back, past 4714 BC)
    one_way = ("select count(*) from events where at + interval '90000 years' > now() "
               "and local - interval '-90000 years' > now()")
    admitted_in_suppress_only(one_way)
    admitted_with_bounds(one_way)


def test_a_cached_dp_answer_keeps_infinite_time_keys() -> None:
    # the dp connection reads dates and timestamps as text ('infinity' has no Python datetime); the answer cache
    # reads its keys back the same way, so a cached answer with such a key is found, not a miss charged again
    measurement = Measurement((1184, 1082), {"n": 20}, (
        Group(("infinity", "-infinity"), {"n": 12}), Group(("2025-01-01 00:00:00+00", "2025-01-01"), {"n": 40})))
    assert decoded(encoded(measurement)) == measurement


# --- through the proxy ----------------------------------------------------------------------------------------

CREATE = """
create table public.events (event_id bigint primary key, person_id integer not null references public.adult (id),
                            at timestamptz not null, day date not null, local timestamp not null,
                            spent interval not null, kind text not null, epoch bigint not null);
insert into public.events
select row_number() over (), id, t, (t at time zone 'UTC')::date, t at time zone 'UTC',
       make_interval(mins => id % 90), case when id % 2 = 0 then 'web' else 'app' end, extract(epoch from t)::bigint
from (select id, timestamptz '2025-01-01 00:00+00' + make_interval(secs => (id * 7919 + j * 104729) % 31536000) t
      from public.adult, generate_series(0, 2) j where j <= id % 3) people;
-- sentinels real data holds: one person's rows at ±infinity, and no other (a dp answer always reads them)
delete from public.events where person_id = (select max(id) from public.adult);
insert into public.events select 1000000 + n, (select max(id) from public.adult), v, v::date, v::timestamp,
       interval '1 minute', 'web', 0
from (values (1, timestamptz 'infinity'), (2, timestamptz '-infinity')) s (n, v);
analyze public.events;
"""
ENTITY = "select anonproxy.link_table('public.events'::regclass, 'person_id', 'public.adult'::regclass)"
SET_COLUMN = ("select anonproxy.set_column('public.events'::regclass, %s::name, %s::text, null::numeric, "
              "null::numeric, %s::text[])")


@pytest.fixture(scope="module")
def events(pg_server, gated_database: str, gated_proxy: Endpoint) -> Iterator[None]:  # type: ignore[no-untyped-def]
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner:
        with owner.transaction():
            owner.execute(CREATE)
            owner.execute(ENTITY)
            for column, kind, domain in (("event_id", "identifier", None), ("person_id", "identifier", None),
                                         ("kind", "quasi_identifier", ["web", "app"])):
                owner.execute(SET_COLUMN, [column, kind, domain])
        wait_for_current_policy(owner, gated_proxy, gated_database)
        try:
            yield
        finally:
            owner.execute("select anonproxy.unlink_table('public.events')")
            owner.execute("drop table public.events")
            wait_for_current_policy(owner, gated_proxy, gated_database)


def as_text(connection: psycopg.Connection) -> psycopg.Connection:
    """Dates and timestamps read as PostgreSQL writes them: Python's datetime has no infinity."""
    for name in ("date", "timestamp", "timestamptz", "interval"):
        connection.adapters.register_loader(name, TextLoader)
    return connection


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str, events: None) -> Iterator[psycopg.Connection]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as connection:
        yield as_text(connection)


@pytest.fixture
def owner(pg_server, gated_database: str) -> Iterator[psycopg.Connection]:  # type: ignore[no-untyped-def]
    """PostgreSQL's own answers, as the database owner."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as connection:
        yield as_text(connection)


SERIES = [
    "select date_trunc('week', at) as w, count(*) from events group by 1 order by 1",
    ("select date_trunc('month', at at time zone 'UTC') as m, kind, count(*), sum(extract(dow from at)) "
     "from events group by 1, 2 order by 1, 2"),
    ("select cast(at as date) as d, count(*) from events where at >= timestamptz '2025-06-01' "
     "and at < timestamptz '2025-06-08' group by 1 order by 1"),
    ("select (date_trunc('week', (at + interval '1 day')) + interval '-1 day') as w, count(*) from events "
     "group by 1 order by 1"),
    "select extract(isodow from at) as dow, count(*) from events group by 1 order by 1",
    ("select date_bin('6 hours', local, timestamp '2025-01-01') as b, count(*) from events "
     "where local < timestamp '2025-01-15' group by 1 order by 1"),
    ("select to_char(date_trunc('month', at), 'YYYY-MM') as m, count(*) from events "
     "where at >= to_timestamp('2025-01-01 00:00:00', 'YYYY-MM-DD HH24:MI:SS') group by date_trunc('month', at) "
     "order by 1"),
    ("select date(at) as d, count(*) from events where at >= ((SELECT (DATE_TRUNC('day', timestamptz "
     "'2025-03-10') + (-6 || ' day')::INTERVAL))) and at < timestamptz '2025-03-10' group by 1 order by 1"),
    # a quoted origin, half past: the bins start at :30 as PostgreSQL's do
    ("select date_bin('6 hours', local, '2025-01-01 00:30') as b, count(*) from events "
     "where local < timestamp '2025-01-15' group by 1 order by 1"),
    ("select date_bin('1 day', at, '2025-01-01 12:00+00') as b, count(*) from events "
     "where at < timestamptz '2025-01-15' group by 1 order by 1"),
    # a date binned from a quoted origin: cast to timestamptz, as PostgreSQL casts it
    ("select date_bin('7 days', day, '2025-01-06') as b, count(*) from events "
     "where day < date '2025-03-01' group by 1 order by 1"),
]


@pytest.mark.parametrize("sql", SERIES)
def test_suppress_answers_equal_postgresql_for_released_buckets(reporter: psycopg.Connection,
                                                                owner: psycopg.Connection, sql: str) -> None:
    rows = reporter.execute(sql).fetchall()
    expected = owner.execute(sql).fetchall()
    released = [row for row in rows if row[0] is not None]
    assert released, rows
    assert all(row in expected for row in released), (released, expected)
    assert all(row[-1] >= K for row in released if isinstance(row[-1], int))
    # the 'infinity' bucket is one person's: withheld
    assert not any(str(value) in ("infinity", "-infinity") for row in released for value in row)


def test_the_clock_filters_like_postgresql(reporter: psycopg.Connection, owner: psycopg.Connection) -> None:
    sql = ("select kind, count(*) from events where at > now() - interval '30 days' "
           "or day >= current_date - 700 group by 1 order by 1")
    assert reporter.execute(sql).fetchall() == owner.execute(sql).fetchall()


# Constants PostgreSQL folds without error: ±infinity moved stays infinite; a BC constant from a bounded column.
FOLDED = [
    ("select kind, count(*) from events where at < 'infinity'::timestamptz + interval '1 day' "
     "group by 1 order by 1"),
    # (<= keeps the one person of the infinite rows: a filter leaving out fewer than k people is withheld)
    ("select kind, count(*) from events where at > '-infinity'::timestamptz - interval '1 year' "
     "and day <= 'infinity'::date + 3 and local <= timestamp 'infinity' + interval '5 months' group by 1 order by 1"),
    ("select count(*) from visits where visited_at - '4713-01-01 BC'::timestamptz > interval '2460700 days'"),
]


@pytest.mark.parametrize("sql", FOLDED)
def test_folded_time_constants_answer_like_postgresql(reporter: psycopg.Connection, owner: psycopg.Connection,
                                                      sql: str) -> None:
    expected = owner.execute(sql).fetchall()
    assert expected and all(row[-1] >= K for row in expected)  # big groups: suppression releases them all
    assert reporter.execute(sql).fetchall() == expected


def test_dp_answers_the_time_constants(gated_proxy: Endpoint, gated_database: str, events: None,
                                       owner: psycopg.Connection) -> None:
    binned = ("select date_bin('1 day', at, '2025-01-01 12:00+00') as b, count(*) from events "
              "where at >= timestamptz '2025-03-01' and at < timestamptz '2025-04-01' group by 1")
    expected = [dict(owner.execute(sql).fetchall()) for sql in (binned, FOLDED[0])]
    with fresh_dp_role(owner, gated_proxy, gated_database, "dp_time_constants") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        answers = [dict(as_text(conn).execute(sql).fetchall()) for sql in (binned, FOLDED[0])]
        # a WHERE that needs the declared time bounds: run on the rows within them only
        assert conn.execute(FOLDED[2]).fetchone()[0] > 0
    # every bin released is one of PostgreSQL's (its keys as PostgreSQL writes them), and so is each kind
    assert answers[0] and set(answers[0]) <= set(expected[0]), (answers[0], expected[0])
    assert set(answers[1]) == set(expected[1]) == {"web", "app"}
    # noisy counts of the size of the true ones (contribution bounding keeps a few rows per person: below them)
    for answer, truth in zip(answers, expected, strict=True):
        assert all(truth[key] / 4 < count < truth[key] + 100 for key, count in answer.items()), (answer, truth)


ATTACKS = [
    # each fails in PostgreSQL because of the one person whose rows are at ±infinity
    "select cast(extract(year from at) as integer) as y, count(*) from events group by 1",
    "select count(*) from events where at - timestamptz '2025-01-01' > interval '1 day'",
]


@pytest.mark.parametrize("sql", ATTACKS)
def test_errors_one_row_would_raise_are_refused_before_any_row(reporter: psycopg.Connection,
                                                               owner: psycopg.Connection, sql: str) -> None:
    with pytest.raises(psycopg.Error), owner.transaction():
        owner.execute(sql)  # the leak: PostgreSQL fails because of the infinite row
    with pytest.raises(psycopg.Error) as caught:
        reporter.execute(sql)
    assert caught.value.sqlstate == "0A000" and caught.value.diag.message_hint, caught.value


def test_an_unknown_time_zone_is_refused_whether_or_not_a_row_reaches_it(reporter: psycopg.Connection,
                                                                          owner: psycopg.Connection) -> None:
    template = ("select count(*) from events where person_id = {person} "
                "and (at at time zone 'Nope/Zone') > timestamp '2000-01-01'")
    owner.execute(template.format(person=-1))  # no row: PostgreSQL answers
    with pytest.raises(psycopg.errors.InvalidParameterValue), owner.transaction():
        owner.execute(template.format(person="(select min(id) from adult)"))  # a row: it fails
    for person in (-1, 17):
        with pytest.raises(psycopg.Error) as caught:
            reporter.execute(template.format(person=person))
        assert caught.value.sqlstate == "0A000" and "time zone" in str(caught.value)


def test_dp_series_over_calendar_buckets(gated_proxy: Endpoint, gated_database: str, events: None,
                                         owner: psycopg.Connection) -> None:
    sql = ("select to_char(date_trunc('month', at), 'YYYY-MM') as m, count(*) from events "
           "where at >= now() - interval '5 years' group by date_trunc('month', at)")
    expected = dict(owner.execute(sql).fetchall())
    with fresh_dp_role(owner, gated_proxy, gated_database, "dp_time_analyst") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        rows = conn.execute(sql).fetchall()
        left = conn.execute("show anonproxy.budget").fetchone()
        # asked again: the cached answer, read back with its keys as they were, at no further cost
        assert conn.execute(sql).fetchall() == rows
        assert conn.execute("show anonproxy.budget").fetchone() == left
        keyed = "select date_trunc('month', at) as m, count(*) from events group by 1"
        first = as_text(conn).execute(keyed).fetchall()
        assert first and conn.execute(keyed).fetchall() == first
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(ATTACKS[0])
        assert caught.value.sqlstate == "0A000"
    assert rows and all(month in expected for month, _ in rows), (rows, expected)
    # each month holds thousands of events: every one released; the 'infinity' row's bucket (to_char gives NULL) is
    # one person's: partition selection withholds it
    assert expected.pop(None) == 1 and len(rows) == len(expected) == 12, rows
    # dp counts a person's rows in at most a few groups (contribution bounding, docs/dp.md), then adds noise of a
    # scale of a few units: below the true count, yet of its size
    assert all(expected[month] / 4 < count < expected[month] + 100 for month, count in rows), (rows, expected)


@pytest.mark.parametrize("interval", ["14 day", "2 hours 30 minutes", "1 year", "-1 year +5 months", "13 months",
                                      "3 years 7 months 2 days 4 seconds", "-25 months -1 day"])
def test_the_epoch_of_a_constant_interval_is_postgresql_s(truth: psycopg.Connection, interval: str) -> None:
    """The proof's value of extract(epoch from a constant interval), and the constant the analysis folds it to (a
    divisor the final check accepts), equal what PostgreSQL computes."""
    (expected,) = truth.execute("select extract(epoch from %s::interval)", [interval]).fetchone()
    proven = bounds.evaluate(sqlglot.parse_one(f"extract(epoch from interval '{interval}')", read="postgres"),
                             lambda column: bounds.ColumnFacts(column.name, None))
    assert proven.constant and proven.value == expected
    sql = f"select count(*) / extract(epoch from interval '{interval}') from events"
    rewritten = decided(sql, SUPPRESS).sql
    assert f"{abs(expected)})" in rewritten and "extract" not in rewritten.lower(), rewritten
