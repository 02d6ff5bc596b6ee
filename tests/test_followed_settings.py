"""The client's session settings shape gated answers as they shape PostgreSQL's own (one list:
anonproxy.proxy.followed_settings).

Each followed setting, set with SET or at login (``options=-c ...``), must change how a gated answer prints,
exactly as it changes PostgreSQL's rendering of the same values: extra_float_digits on a float average,
DateStyle on a date key, TimeZone on a timestamptz key, IntervalStyle on an interval key, bytea_output on a bytea
key.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy
from psycopg import sql
from psycopg.types.string import TextLoader

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.followed_settings import (
    FOLLOWED_SETTINGS,
    REPORTED_SETTINGS,
    UNREPORTED_SETTINGS,
)

# setting -> (a value other than the default, the query whose rendering it changes)
CASES = {
    "extra_float_digits": ("0", "select half, avg(score)::float8 as v from public.stays group by half order by 1"),
    "DateStyle": ("SQL, DMY", "select day as v, count(*) from public.stays group by day order by 1"),
    "TimeZone": ("Asia/Tokyo", "select at as v, count(*) from public.stays group by at order by 1"),
    "IntervalStyle": ("sql_standard", "select length as v, count(*) from public.stays group by length order by 1"),
    "bytea_output": ("escape", "select tag as v, count(*) from public.stays group by tag order by 1"),
}
DEFAULTS = {"extra_float_digits": "1", "DateStyle": "ISO, MDY", "TimeZone": "UTC", "IntervalStyle": "postgres",
            "bytea_output": "hex"}


def test_one_list() -> None:
    assert set(CASES) | {"client_encoding"} == set(FOLLOWED_SETTINGS)
    assert set(REPORTED_SETTINGS) | set(UNREPORTED_SETTINGS) == set(FOLLOWED_SETTINGS)


@pytest.fixture(scope="module")
def stays(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection]:
    """A protected table with float, date, timestamptz, interval and bytea columns: 1000 people, groups of 500
    (large enough for dp's partition selection to release both keys)."""
    conn = psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True)
    conn.execute("create table public.stays (person int, half int, score float8, day date, at timestamptz, "
                 "length interval, tag bytea)")
    conn.execute("insert into public.stays select p, p % 2, p / 7.0, date '2024-03-01' + (p % 2) * 40, "
                 "timestamptz '2024-03-01 22:30:00+00' + (p % 2) * interval '1 day', "
                 "interval '1 day 02:03:04' * (1 + p % 2), "
                 "decode(case p % 2 when 0 then '615c62' else '00ff0a' end, 'hex') "
                 "from generate_series(1, 1000) p")
    conn.execute("select anonproxy.protect_table('public.stays', 'person')")
    conn.execute("select anonproxy.set_column('public.stays', 'score', 'sensitive', 0, 10)")
    conn.execute("select anonproxy.apply_grants()")
    conn.execute("select anonproxy.set_budget('analyst', 'public.stays', 100, 0.001, null, 1, 0.00001)")
    yield conn
    conn.execute("select anonproxy.drop_budget('analyst', 'public.stays')")
    conn.execute("select anonproxy.unprotect_table('public.stays')")
    conn.execute("drop table public.stays")
    conn.close()


def _texts(conn: psycopg.Connection, query: str) -> list[tuple[str | None, ...]]:
    """The answer's values as the server (or the proxy) printed them."""
    for oid in ("float8", "date", "timestamptz", "interval", "numeric", "int8", "bytea"):
        conn.adapters.register_loader(oid, TextLoader)
    return conn.execute(query).fetchall()


def _truth(stays: psycopg.Connection, query: str, setting: str, value: str) -> list[tuple[str | None, ...]]:
    with stays.transaction():
        stays.execute("select set_config(%s, %s, true)", [setting, value])
        return _texts(stays, query)


def _wait_for_policy(proxy: Endpoint, dbname: str, stays: psycopg.Connection) -> None:
    """The proxy reloads the policy by NOTIFY, each worker on its own: wait until every worker has the version that
    protects the table (a fresh connection may land on either)."""
    wait_for_policy(proxy, dbname, int(stays.execute("select version from anonproxy.policy_version").fetchone()[0]))


@pytest.mark.parametrize("setting", list(CASES))
@pytest.mark.parametrize("how", ["set", "startup"])
def test_suppress_answers_follow_the_setting(gated_proxy: Endpoint, gated_database: str, stays: psycopg.Connection,
                                             setting: str, how: str) -> None:
    _wait_for_policy(gated_proxy, gated_database, stays)
    value, query = CASES[setting]
    dsn = gated_proxy.dsn(gated_database, user="reporter")
    if how == "startup":
        dsn = psycopg.conninfo.make_conninfo(dsn, options=f"-c {setting}=" + value.replace(" ", "\\ "))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set TimeZone = 'UTC'") if setting != "TimeZone" else None
        conn.execute("set DateStyle = 'ISO, MDY'") if setting != "DateStyle" else None
        before = _texts(conn, query) if how == "set" else None
        if how == "set":
            conn.execute(sql.SQL("set {} = {}").format(sql.SQL(setting), sql.Literal(value)))
        after = _texts(conn, query)
    expected = _truth(stays, query, setting, value)
    default = _truth(stays, query, setting, DEFAULTS[setting])
    assert expected != default  # the setting matters for this answer
    assert after == expected
    if before is not None:
        assert before == default


@pytest.mark.parametrize("setting", list(CASES))
@pytest.mark.parametrize("how", ["set", "startup"])
def test_dp_answers_follow_the_setting(gated_proxy: Endpoint, gated_database: str, stays: psycopg.Connection,
                                       setting: str, how: str) -> None:
    """A dp answer (noisy values, exact keys) prints its keys and floats as the client's settings say; the
    same question asked again under other settings is the same (cached) answer, printed again, unless they
    change what its SQL reads: another TimeZone or DateStyle field order is another question
    (tests/test_dp_time_zones.py)."""
    _wait_for_policy(gated_proxy, gated_database, stays)
    value, query = CASES[setting]
    if setting == "extra_float_digits":  # dp: a noisy sum of the float column (a float8, of few digits here)
        value, query = "-12", "select sum(score) as v from public.stays"
    dsn = gated_proxy.dsn(gated_database, user="analyst")
    if how == "startup":
        dsn = psycopg.conninfo.make_conninfo(dsn, options=f"-c {setting}=" + value.replace(" ", "\\ "))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set TimeZone = 'UTC'") if setting != "TimeZone" else None
        conn.execute("set DateStyle = 'ISO, MDY'") if setting != "DateStyle" else None
        if how == "set":
            conn.execute(sql.SQL("set {} = {}").format(sql.SQL(setting), sql.Literal(value)))
        after = _texts(conn, query)
        conn.execute(sql.SQL("set {} = {}").format(sql.SQL(setting), sql.Literal(DEFAULTS[setting])))
        before = _texts(conn, query)
    assert after != before
    if setting == "extra_float_digits":
        assert after == [("%.3g" % float(before[0][0]),)]  # DBL_DIG - 12 significant digits
    else:  # the keys: exact, printed as PostgreSQL prints them
        truth = f"select distinct {query.split()[1]}::text from public.stays order by 1"
        assert [row[0] for row in after] == [row[0] for row in _truth(stays, truth, setting, value)]
        assert [row[0] for row in before] == [row[0] for row in _truth(stays, truth, setting, DEFAULTS[setting])]
        if setting == "IntervalStyle":
            assert [row[1] for row in after] == [row[1] for row in before]  # the same noisy counts


STYLES = [
    {"DateStyle": date_style, "TimeZone": zone, "IntervalStyle": interval_style, "extra_float_digits": digits}
    for date_style, zone, interval_style, digits in [
        ("ISO, MDY", "UTC", "postgres", "1"), ("SQL, DMY", "Asia/Tokyo", "sql_standard", "0"),
        ("SQL, MDY", "America/Sao_Paulo", "iso_8601", "-3"), ("Postgres, DMY", "Asia/Kolkata", "postgres_verbose", "2"),
        ("Postgres, MDY", "Europe/Berlin", "postgres", "-15"), ("German", "America/New_York", "sql_standard", "1"),
        ("ISO, DMY", "Australia/Lord_Howe", "iso_8601", "0"),
    ]
]


def test_printing_matches_postgresql(pg_server: EmbeddedPostgres) -> None:
    """The proxy's printing of its own answers, against PostgreSQL's for the same values and settings."""
    import datetime as dt

    from anonproxy.proxy.followed_settings import follow_settings
    from anonproxy.wire.results import Column, Result, text_value

    utc = dt.timezone.utc
    values = [
        (701, 1 / 3, "%s::float8"), (701, 123456789.125, "%s::float8"), (701, -2.5e-7, "%s::float8"),
        (701, 9678.0, "%s::float8"), (701, 1e15, "%s::float8"), (701, 123456789012345680.0, "%s::float8"),
        (701, 0.0001, "%s::float8"), (701, 0.00001234, "%s::float8"), (701, -0.0, "%s::float8"),
        (701, -0.0425531914893617, "%s::float8"), (701, -9678.5, "%s::float8"),
        (701, 100.0, "%s::float8"), (700, 0.1, "%s::float4"), (700, 1234567.0, "%s::float4"),
        (700, 3.0e-5, "%s::float4"),
        (1082, dt.date(2024, 3, 1), "%s::date"), (1082, dt.date(1999, 12, 31), "%s::date"),
        (1114, dt.datetime(2024, 3, 1, 22, 30), "%s::timestamp"),
        (1114, dt.datetime(2024, 7, 9, 1, 2, 3, 450000), "%s::timestamp"),
        (1184, dt.datetime(2024, 3, 1, 22, 30, tzinfo=utc), "%s::timestamptz"),
        (1184, dt.datetime(2024, 7, 1, 5, 6, 7, 8, tzinfo=utc), "%s::timestamptz"),
        (1186, dt.timedelta(days=1, seconds=7384), "%s::interval"),
        (1186, dt.timedelta(seconds=59, microseconds=500000), "%s::interval"),
        (1186, dt.timedelta(days=3), "%s::interval"), (1186, dt.timedelta(0), "%s::interval"),
        (1186, -dt.timedelta(days=2, seconds=3723), "%s::interval"), (1186, -dt.timedelta(seconds=61), "%s::interval"),
    ]
    result = Result(tuple(Column(f"c{i}", oid) for i, (oid, _, _) in enumerate(values)),
                    ((*(text_value(value, oid) for oid, value, _ in values),),))
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        for style in STYLES:
            printed = [v.decode() for v in follow_settings(result, style).rows[0]]
            with conn.transaction():
                for name, value in style.items():
                    conn.execute("select set_config(%s, %s, true)", [name, value])
                query = "select " + ", ".join(f"({cast})::text" for _, _, cast in values)
                arguments = [value if not isinstance(value, dt.timedelta) else
                             ("-" if value < dt.timedelta(0) else "") + f"{abs(value).days} days "
                             f"{abs(value).seconds} seconds {abs(value).microseconds} microseconds"
                             for _, value, _ in values]
                # A negative interval is negative in each part (how the proxy holds it).
                arguments = [a if not (isinstance(v, dt.timedelta) and v < dt.timedelta(0)) else
                             " ".join(("-" + w if w[0].isdigit() else w) for w in a[1:].split())
                             for a, (_, v, _) in zip(arguments, values, strict=True)]
                expected = list(conn.execute(query, arguments).fetchone())
            assert printed == expected, style
