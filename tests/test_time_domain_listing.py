"""The buckets a calendar key's time domain lists (anonproxy/dp/time_domains.py), checked by PostgreSQL itself: for
each key shape, session time zone and WHERE narrowing, the listing equals the keys of a fine sample of the instants
the range and the WHERE leave — no bucket missing, none that no instant of the range can reach. Includes the shapes
other parts of the allowlist admit (``::date``, ``date_bin``), which get their domain from the tree's shape."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest
from sqlglot import exp

from anonproxy.dp.time_domains import TimeColumn, calendar_domain
from anonproxy.plan.render import sql as render
from anonproxy.plan.statements import parse_statement, split

COLUMN = TimeColumn("ts", "timestamptz", datetime(2025, 3, 1, tzinfo=UTC), datetime(2025, 4, 15, 23, 59, 59, tzinfo=UTC))
KEYS = ["date_trunc('day', ts)", "date_trunc('hour', ts)", "date_trunc('week', ts)", "date_trunc('month', ts)",
        "date_trunc('quarter', ts)", "extract(dow from ts)", "date_part('doy', ts)", "extract(month from ts)",
        "to_char(ts, 'YYYY-MM-DD')", "ts::date", "date_trunc('month', ts)::date", "cast(extract(year from ts) as int)",
        "date_bin('15 minutes', ts, timestamptz '2025-01-01 00:07:00+00')",
        "date_bin('1 day', ts, '2025-01-01 05:30')",  # a quoted origin: a timestamptz in the session's time zone
        "floor(extract(epoch from ts)/86400)*86400", "floor((extract(epoch from ts))/3600)*3600",  # Grafana
        "extract(month from ts) / 3 + 1"]
WHERES = [None, "ts >= '2025-03-09 01:30' and ts < '2025-03-20 05:00'", "'2025-04-02 12:00' < ts",
          "ts between '2025-03-31 23:00' and '2025-04-01 01:00'", "ts = '2025-03-01 10:46:40+00'"]  # (an instant of the sample below)
ZONES = ["UTC", "Asia/Kolkata", "America/New_York"]
EDGES = ("(timestamptz '2025-03-09 01:30'), (timestamptz '2025-03-20 05:00' - interval '1 microsecond'), "
         "(timestamptz '2025-04-02 12:00' + interval '1 microsecond'), (timestamptz '2025-03-31 23:00'), "
         "(timestamptz '2025-04-01 01:00')")


def parsed(key: str, where: str | None) -> tuple[exp.Expression, exp.Expression | None]:
    tree = parse_statement(split(f"select {key} from t" + (f" where {where}" if where else ""))[0])
    condition = tree.args.get("where")
    return tree.expressions[0], condition.this if condition is not None else None


def column_of(node: exp.Expression) -> TimeColumn | None:
    return COLUMN if isinstance(node, exp.Column) and node.name == "ts" else None


def test_not_every_key_is_a_calendar_key() -> None:
    for key in ("ts", "ts::text", "date_trunc('day', ts, 'Europe/Paris')", "to_char(ts, 'YYYY-MM-DD HH24:MI:SS.MS')",
                "to_char(ts, 'Mon YYYY')", "extract(epoch from ts)", "date_trunc('microseconds', ts)",
                "extract(epoch from ts)", "floor(extract(epoch from ts) / 0.5)",
                "extract(month from ts) + extract(day from ts)"):
        assert calendar_domain(parsed(key, None)[0], None, column_of) is None, key
    # two years of minutes: more buckets than listed (partition selection instead)
    assert calendar_domain(parsed("date_trunc('minute', ts)", None)[0], None, column_of) is None


def test_listings_match_a_fine_sample_of_the_range(postgresql: psycopg.Connection) -> None:
    postgresql.autocommit = True
    for zone in ZONES:
        postgresql.execute("select set_config('TimeZone', %s, false)", [zone])
        for key in KEYS:
            for where in WHERES:
                node, condition = parsed(key, where)
                domain = calendar_domain(node, condition, column_of)
                assert domain is not None, key
                listed = {row[0] for row in postgresql.execute(domain.sql)}
                # every 97 seconds over the declared range, its last instant, and the WHERE's edges (as the
                # session reads them)
                sample = ("select ts from generate_series(timestamptz '2025-03-01 00:00:00+00', "
                          "timestamptz '2025-04-15 23:59:59+00', interval '97 seconds') as s(ts) "
                          "union all select timestamptz '2025-04-15 23:59:59+00' union all select edge from (values "
                          f"{EDGES}) as e(edge)")
                expected = {row[0] for row in postgresql.execute(
                    f"select distinct {render(node)} from ({sample}) as s" + (f" where {where}" if where else ""))}
                assert listed == expected, (zone, key, where, sorted(listed ^ expected)[:5])


@pytest.mark.parametrize("where", WHERES[1:])
def test_narrowing_only_shrinks_the_listing(postgresql: psycopg.Connection, where: str) -> None:
    whole = calendar_domain(parsed("date_trunc('day', ts)", None)[0], None, column_of)
    narrowed = calendar_domain(*parsed("date_trunc('day', ts)", where), column_of)
    assert whole is not None and narrowed is not None
    all_days = {row[0] for row in postgresql.execute(whole.sql)}
    some_days = {row[0] for row in postgresql.execute(narrowed.sql)}
    assert len(all_days) == 46 and 0 < len(some_days) < 46 and some_days <= all_days
