"""The client's session settings shape gated answers as they shape PostgreSQL's own (one list:
anonproxy.proxy.followed_settings).

Each followed setting, set with SET or at login (``options=-c ...``), must change how a gated answer prints,
exactly as it changes PostgreSQL's rendering of the same values: extra_float_digits on a float average,
DateStyle on a date key, TimeZone on a timestamptz key, IntervalStyle on an interval key.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.types.string import TextLoader

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.followed_settings import FOLLOWED_SETTINGS, REPORTED_SETTINGS, UNREPORTED_SETTINGS
from conftest import Endpoint

# setting -> (a value other than the default, the query whose rendering it changes)
CASES = {
    "extra_float_digits": ("0", "select half, avg(score)::float8 as v from public.stays group by half order by 1"),
    "DateStyle": ("SQL, DMY", "select day as v, count(*) from public.stays group by day order by 1"),
    "TimeZone": ("Asia/Tokyo", "select at as v, count(*) from public.stays group by at order by 1"),
    "IntervalStyle": ("sql_standard", "select length as v, count(*) from public.stays group by length order by 1"),
}
DEFAULTS = {"extra_float_digits": "1", "DateStyle": "ISO, MDY", "TimeZone": "UTC", "IntervalStyle": "postgres"}


def test_one_list() -> None:
    assert set(CASES) | {"client_encoding"} == set(FOLLOWED_SETTINGS)
    assert set(REPORTED_SETTINGS) | set(UNREPORTED_SETTINGS) == set(FOLLOWED_SETTINGS)


@pytest.fixture(scope="module")
def stays(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection]:
    """A protected table with float, date, timestamptz and interval columns: 40 people, groups of 20."""
    conn = psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True)
    conn.execute("create table public.stays (person int, half int, score float8, day date, at timestamptz, length interval)")
    conn.execute("insert into public.stays select p, p % 2, p / 7.0, date '2024-03-01' + (p % 2) * 40, "
                 "timestamptz '2024-03-01 22:30:00+00' + (p % 2) * interval '1 day', "
                 "interval '1 day 02:03:04' * (1 + p % 2) from generate_series(1, 40) p")
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
    for oid in ("float8", "date", "timestamptz", "interval", "numeric", "int8"):
        conn.adapters.register_loader(oid, TextLoader)
    return conn.execute(query).fetchall()


def _truth(stays: psycopg.Connection, query: str, setting: str, value: str) -> list[tuple[str | None, ...]]:
    with stays.transaction():
        stays.execute("select set_config(%s, %s, true)", [setting, value])
        return _texts(stays, query)


def _wait_for_policy(proxy: Endpoint, dbname: str, role: str) -> None:
    """The proxy reloads the policy by NOTIFY: wait until the table is protected for it."""
    import time

    deadline = time.monotonic() + 10
    with psycopg.connect(proxy.dsn(dbname, user=role), autocommit=True) as conn:
        while True:
            try:
                conn.execute("select count(*) from public.stays").fetchall()
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.mark.parametrize("setting", list(CASES))
@pytest.mark.parametrize("how", ["set", "startup"])
def test_suppress_answers_follow_the_setting(gated_proxy: Endpoint, gated_database: str, stays: psycopg.Connection,
                                             setting: str, how: str) -> None:
    _wait_for_policy(gated_proxy, gated_database, "reporter")
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


def test_dp_answers_follow_extra_float_digits(gated_proxy: Endpoint, gated_database: str,
                                              stays: psycopg.Connection) -> None:
    """A dp average of a float column prints with the client's extra_float_digits (SET and at login)."""
    _wait_for_policy(gated_proxy, gated_database, "analyst")
    query = "select avg(score) as v from public.stays"
    for dsn_extra, set_first in (("", True), (" options='-c extra_float_digits=-2'", False)):
        with psycopg.connect(gated_proxy.dsn(gated_database, user="analyst") + dsn_extra, autocommit=True) as conn:
            shortest = None
            if set_first:
                conn.execute("set extra_float_digits = 1")
                shortest = _texts(conn, query)[0][0]
                conn.execute("set extra_float_digits = -2")
            rounded = _texts(conn, query)[0][0]
        assert rounded is not None
        assert len(rounded.replace("-", "").replace(".", "").lstrip("0")) <= 13  # DBL_DIG - 2 digits
        if shortest is not None:  # the same (cached, free) answer, printed with fewer digits
            assert rounded == "%.13g" % float(shortest)
