"""Time bounds in the policy (sql/0033): declared in SQL and YAML, checked like numeric bounds, read into the model,
dumped back, and linted (a bound that 1 to k − 1 people reach)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import (
    PolicyError,
    apply_policy,
    demo_policy,
    dump_policy,
    parse_policy,
)

SERVICE = "time_bounds_service"


@pytest.fixture
def db(postgresql: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """A superuser connection (autocommit) to a fresh copy of the sample data, the demo policy applied, and a table
    with a column of each time type."""
    postgresql.commit()
    postgresql.autocommit = True
    postgresql.execute(f"do $$ begin create role {SERVICE} login; exception when duplicate_object then null; end $$")
    apply_policy(postgresql, dataclasses.replace(demo_policy(), service_role=SERVICE))
    postgresql.execute("create table public.times (person_id integer not null, d date, ts timestamp, tz timestamptz, "
                       "n integer)")
    postgresql.execute("select anonproxy.link_table('public.times', 'person_id', 'public.adult')")
    for column in ("d", "ts", "tz", "n"):
        postgresql.execute("select anonproxy.set_column('public.times', %s, 'quasi_identifier')", [column])
    return postgresql


def bounds(conn: psycopg.Connection[Any], column: str) -> tuple[datetime | None, datetime | None]:
    found = load_policy(conn).links["public.times"].columns[column]
    return found.earliest, found.latest


def test_each_time_type_takes_bounds_in_its_own_terms(db: psycopg.Connection[Any]) -> None:
    db.execute("set timezone = 'Asia/Tokyo'")  # a timestamptz bound without an offset is UTC whatever the session's
    db.execute("select anonproxy.set_time_bounds('public.times', 'd', '2025-01-01', '2026-12-31')")
    db.execute("select anonproxy.set_time_bounds('public.times', 'ts', '2025-01-01 08:00', '2025-12-31 18:30:00.5')")
    db.execute("select anonproxy.set_time_bounds('public.times', 'tz', '2025-01-01 00:00', '2025-06-30 23:00-02')")
    assert bounds(db, "d") == (datetime(2025, 1, 1), datetime(2026, 12, 31))
    assert bounds(db, "ts") == (datetime(2025, 1, 1, 8), datetime(2025, 12, 31, 18, 30, 0, 500000))
    assert bounds(db, "tz") == (datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 7, 1, 1, tzinfo=UTC))
    # set_column again keeps them; NULL, NULL clears them
    db.execute("select anonproxy.set_column('public.times', 'd', 'public')")
    assert bounds(db, "d") == (datetime(2025, 1, 1), datetime(2026, 12, 31))
    db.execute("select anonproxy.set_time_bounds('public.times', 'd', null, null)")
    assert bounds(db, "d") == (None, None)


@pytest.mark.parametrize(("call", "sqlstate", "message"), [
    ("'n', '2025-01-01', '2026-01-01'", "42804",
     "column public.times.n is of type integer; time bounds need a date, timestamp or timestamptz column"),
    ("'ts', '2026-01-01', '2025-01-01'", "22023",
     "earliest bound 2026-01-01 is later than latest bound 2025-01-01 for column public.times.ts"),
    ("'ts', '2025-01-01', null", "22023",
     "column public.times.ts needs both an earliest and a latest bound, or neither"),
    ("'ts', 'soon', '2025-01-01'", "22007", ("earliest bound 'soon' of column public.times.ts is not a valid timestamp "
                                            "without time zone")),
    ("'tz', '2025-01-01', 'infinity'", "22008", ("latest bound 'infinity' of column public.times.tz is outside years "
                                                "1 to 9999")),
    ("'d', '2025-01-01', '20000-01-01'", "22008", ("latest bound '20000-01-01' of column public.times.d is outside "
                                                  "years 1 to 9999")),
    ("'d', '2025-01-01 12:00', '2026-01-01'", "22007", ("earliest bound '2025-01-01 12:00' of date column "
                                                       "public.times.d is not a date")),
    ("'person', '2025-01-01', '2026-01-01'", "42703", 'column "person" does not exist in table public.times'),
])  # fmt: skip
def test_sql_refusals_name_the_column_and_the_problem(db: psycopg.Connection[Any], call: str, sqlstate: str,
                                                      message: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"select anonproxy.set_time_bounds('public.times', {call})")
    assert (caught.value.sqlstate, caught.value.diag.message_primary) == (sqlstate, message)
    assert bounds(db, "ts") == (None, None)


def test_a_column_without_a_policy_is_named(db: psycopg.Connection[Any]) -> None:
    db.execute("select anonproxy.unset_column('public.times', 'ts')")
    with pytest.raises(psycopg.errors.UndefinedObject) as caught:
        db.execute("select anonproxy.set_time_bounds('public.times', 'ts', '2025-01-01', '2026-01-01')")
    assert caught.value.diag.message_primary == "column public.times.ts has no policy"
    assert caught.value.diag.message_hint == ("declare its kind first: select anonproxy.set_column('public.times', "
                                              "'ts', <kind>)")


YAML = """
tables:
  public.adult: {{unit: id}}
links:
  public.times:
    column: person_id
    references: public.adult
    columns:
      {column}
"""


@pytest.mark.parametrize(("column", "problem"), [
    ("tz: {kind: public, earliest: 2025-01-01}",
     "links.public.times.columns.tz: give both earliest and latest bounds, or neither"),
    ("tz: {kind: public, earliest: 2026-01-01, latest: 2025-01-01}",
     "links.public.times.columns.tz: earliest bound 2026-01-01 00:00:00 is later than latest bound 2025-01-01 00:00:00"),
    ("tz: {kind: public, earliest: '2025-01-01 00:00+00', latest: 2025-02-01}",
     "links.public.times.columns.tz: give earliest and latest both with an offset (+00) or both without"),
    ("tz: {kind: public, earliest: yesterday, latest: 2025-02-01}",
     ("links.public.times.columns.tz.earliest: must be a date or a date and time, like 2025-01-01 or "
     "2025-01-01 00:00:00+00; got 'yesterday'")),
    ("tz: {kind: public, earliest: 12, latest: 2025-02-01}",
     ("links.public.times.columns.tz.earliest: must be a date or a date and time, like 2025-01-01 or "
     "2025-01-01 00:00:00+00; got 12")),
])  # fmt: skip
def test_yaml_problems_name_their_path(column: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(YAML.format(column=column))
    assert problem in caught.value.problems


def test_yaml_bounds_apply_dump_and_read_back_the_same(db: psycopg.Connection[Any]) -> None:
    plain = "".join(f"      {column}: {{kind: quasi_identifier}}\n" for column in ("d", "ts", "tz"))
    text = dump_policy(load_policy(db))
    assert plain in text
    text = text.replace(plain, "      d: {kind: public, earliest: 2025-01-01, latest: 2025-12-31}\n"
                               "      ts: {kind: public, earliest: '2025-01-01T06:00:00', latest: 2025-03-01 12:00:00.25}\n"
                               "      tz: {kind: public, earliest: 2025-01-01 01:00:00+01, latest: '2025-12-31 23:59:59Z'}\n")
    db.execute("set timezone = 'America/New_York'")
    apply_policy(db, parse_policy(text))
    loaded = load_policy(db)
    times = loaded.links["public.times"].columns
    assert times["d"] == ColumnPolicy("d", "public", earliest=datetime(2025, 1, 1), latest=datetime(2025, 12, 31))
    assert (times["ts"].earliest, times["ts"].latest) == (datetime(2025, 1, 1, 6),
                                                          datetime(2025, 3, 1, 12, 0, 0, 250000))
    assert (times["tz"].earliest, times["tz"].latest) == (datetime(2025, 1, 1, tzinfo=UTC),
                                                          datetime(2025, 12, 31, 23, 59, 59, tzinfo=UTC))
    dumped = dump_policy(loaded)
    assert "tz: {kind: public, earliest: '2025-01-01 00:00:00+00', latest: '2025-12-31 23:59:59+00'}" in dumped
    apply_policy(db, parse_policy(dumped))
    assert dataclasses.replace(load_policy(db), version=0) == dataclasses.replace(loaded, version=0)


def test_the_demo_policy_bounds_every_visit(db: psycopg.Connection[Any]) -> None:
    visited_at = load_policy(db).links["public.visits"].columns["visited_at"]
    assert (visited_at.earliest, visited_at.latest) == (datetime(2025, 1, 1, tzinfo=UTC),
                                                        datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC))
    row = db.execute("select min(visited_at), max(visited_at), count(distinct person_id) from public.visits").fetchone()
    assert row is not None and visited_at.earliest <= row[0] and row[1] <= visited_at.latest and row[2] == 30162


def lint(pg_server: EmbeddedPostgres, dbname: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "policy", "lint", "--dsn",
                           pg_server.conninfo(dbname=dbname)], capture_output=True, text=True, timeout=120, check=False)


def test_lint_warns_about_a_time_bound_few_people_reach(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any],
                                                        dbname: str) -> None:
    # 1000 people over 100 days of 2025; bounds beyond every value: nobody reaches them (nor the demo's bounds)
    db.execute("insert into public.times (person_id, tz) select id, timestamptz '2025-01-01 00:00+00' + "
               "(id % 100) * interval '1 day' from public.adult where id <= 1000")
    db.execute("select anonproxy.set_time_bounds('public.times', 'tz', '2024-12-01 00:00+00', '2026-01-01 00:00+00')")
    done = lint(pg_server, dbname)
    assert done.returncode == 0, done.stdout + done.stderr
    # three people's visits move a year later: past the latest bound, which is now theirs
    db.execute("update public.times set tz = tz + interval '1 year' where person_id in (7, 8, 9)")
    reached = db.execute("select count(distinct person_id) from public.times where tz >= '2026-01-01 00:00+00'"
                         ).fetchone()
    assert reached == (3,)
    done = lint(pg_server, dbname)
    assert done.returncode == 1
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [("warning: public.times.tz: latest bound 2026-01-01 00:00:00+00: 3 people have a value at or "
                        "after it (fewer than k = 10); declare a public bound beyond every value, rounded outward")]
