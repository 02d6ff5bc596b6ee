"""The answer cache keeps the noisy measurement: statements that differ only after it cost nothing more and show the
same numbers (through the real proxy, a dp role with its own budget: ε 2 in all, 0.5 per query).

Re-sorting, re-limiting, OFFSET, HAVING over released values, renamed and reordered output columns, an added
expression over the same aggregates, whitespace, case and operator spacing: one charge, the same noisy values.
A changed WHERE or another aggregate is a new question, charged. An answer cached in an older format is a miss.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

from anonproxy.wire.results import Column, Result

_names = itertools.count(1)

BASE = "select education, count(*), avg(age) from adult group by education"


@pytest.fixture
def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_cache_{next(_names)}") as role:
        yield role


@pytest.fixture
def conn(gated_proxy: Endpoint, gated_database: str, analyst: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as connection:
        yield connection


def left(conn: psycopg.Connection) -> str:
    return conn.execute("show anonproxy.budget").fetchone()[0]


def by_name(conn: psycopg.Connection, sql: str) -> list[dict[str, object]]:
    cursor = conn.execute(sql)
    names = [column.name for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def test_a_superset_chart_re_sorted_re_limited_renamed_and_swapped_costs_once(conn: psycopg.Connection) -> None:
    base = {row[0]: (row[1], row[2]) for row in conn.execute(BASE).fetchall()}
    assert "epsilon 1.5 of 2 left" in left(conn)
    assert len(base) == 16  # every declared education value

    def same(rows: list[tuple[str, int, Decimal]]) -> None:
        for education, count, mean in rows:
            assert (count, mean) == base[education], education

    # Re-sorted, re-limited, paged.
    ordered = conn.execute(f"{BASE} order by 2 desc").fetchall()
    assert [row[1] for row in ordered] == sorted((n for n, _ in base.values()), reverse=True)
    same(ordered)
    top = conn.execute(f"{BASE} order by 2 desc limit 5").fetchall()
    assert top == ordered[:5]
    assert conn.execute(f"{BASE} order by 2 desc limit 3 offset 2").fetchall() == ordered[2:5]
    assert conn.execute(f"{BASE} order by education limit 4").fetchall() == sorted(ordered)[:4]
    # Renamed, swapped, spelled differently.
    renamed = by_name(conn, "select education as degree, count(*) as people, avg(age) as mean_age from adult "
                            "group by education order by people")
    same([(row["degree"], row["people"], row["mean_age"]) for row in renamed])  # type: ignore[misc]
    swapped = conn.execute("select avg(age), count(*), education from adult group by education").fetchall()
    same([(e, n, m) for m, n, e in swapped])
    spelled = conn.execute("SELECT   Education,COUNT( * ),AVG(\"age\")\nFROM public.adult  GROUP  BY 1").fetchall()
    same(spelled)
    # HAVING over released values (aggregates and keys), and an expression over the same aggregates.
    having = conn.execute(f"{BASE} having count(*)>1000 and education <> 'Bachelors'").fetchall()
    assert {row[0] for row in having} == {e for e, (n, _) in base.items() if n > 1000 and e != "Bachelors"}
    same(having)
    rounded = conn.execute("select education, count(*), avg(age), round(avg(age), 1) as r from adult "
                           "group by education").fetchall()
    same([row[:3] for row in rounded])
    assert all(row[3] == row[2].quantize(Decimal("0.1"), ROUND_HALF_UP) for row in rounded)
    # A BI tool's nested shape over the same aggregates.
    nested = conn.execute("select * from (select education, count(*) as c, avg(age) as a from adult "
                          "group by education) as virtual_table order by c desc limit 3").fetchall()
    same(nested)
    assert "epsilon 1.5 of 2 left" in left(conn), "every variant was the one measurement: charged once"
    explained = "\n".join(row[0] for row in conn.execute("explain (anonproxy) select count(*) as n, education, "
                                                         "avg(age) from adult group by 2 order by n desc limit 1"))
    assert "cached: the same question" in explained


def test_a_quantile_is_the_same_draw_whatever_the_statement_around_it(conn: psycopg.Connection, analyst: str,
                                                                      truth: psycopg.Connection) -> None:
    first = conn.execute("select sex, median(age), count(*) from adult group by sex").fetchall()
    again = conn.execute("select count(*) as n, median(age) as m, sex from adult group by sex order by m desc").fetchall()
    assert {(sex, m, n) for n, m, sex in again} == set(first)
    assert "epsilon 1.5 of 2 left" in left(conn)
    # The cache holds the noisy measurement only: keys, and one noisy number per statistic and quantile — never the
    # ages the median was drawn from.
    (stored,) = truth.execute("select answer from anonproxy.answer_cache where role_name = %s", [analyst]).fetchone()
    header, _, body = bytes(stored).partition(b"\n")
    assert header == b"anonproxy-measurement/2"
    groups = json.loads(body)["groups"]
    assert sorted(group["k"] for group in groups) == [["Female"], ["Male"]]
    assert all(len(group["v"]) == 2 and all(tag in ("i", "d", "f") and isinstance(text, str)
                                            for tag, text in group["v"].values()) for group in groups)


def test_swapped_columns_of_different_types_keep_their_types(conn: psycopg.Connection) -> None:
    first = conn.execute("select sex, count(*), sum(age * 1.5) from adult group by sex")
    types = [column.type_code for column in first.description]
    rows = first.fetchall()
    swapped = conn.execute("select sum(age * 1.5) as s, sex, count(*) as n from adult group by sex order by n")
    assert [column.type_code for column in swapped.description] == [types[2], types[0], types[1]]
    assert types[1:] == [20, 1700]  # bigint, numeric
    assert sorted((sex, n, s) for s, sex, n in swapped.fetchall()) == sorted(rows)
    assert "epsilon 1.5 of 2 left" in left(conn)


def test_the_order_of_group_by_is_not_a_new_question(conn: psycopg.Connection) -> None:
    # Two keys with declared public domains: every (sex, race) pair, in the domains' order of each statement's keys.
    races = ["White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"]
    first = conn.execute("select sex, race, count(*), avg(age) from adult group by sex, race").fetchall()
    assert [row[:2] for row in first] == [(sex, race) for sex in ("Female", "Male") for race in races]
    assert "epsilon 1.5 of 2 left" in left(conn)
    swapped = conn.execute("select race, sex, avg(age), count(*) from adult group by race, sex").fetchall()
    assert {(sex, race, n, mean) for race, sex, mean, n in swapped} == set(first)
    assert [row[:2] for row in swapped] == [(race, sex) for race in races for sex in ("Female", "Male")]
    by_position = conn.execute("select count(*) as n, race as r, sex, avg(age) from adult group by 3, 2 "
                               "order by n desc limit 4").fetchall()
    assert {(sex, race, n, mean) for n, race, sex, mean in by_position} <= set(first) and len(by_position) == 4
    assert "epsilon 1.5 of 2 left" in left(conn), "one measurement"
    # A key without a public domain (released by partition selection) next to one with: the same.
    ages = conn.execute("select age / 10 * 10 as decade, sex, count(*) from adult group by 1, 2").fetchall()
    assert "epsilon 1 of 2 left" in left(conn)
    again = conn.execute("select sex, age / 10 * 10, count(*) from adult group by sex, age / 10 * 10").fetchall()
    assert {(decade, sex, n) for sex, decade, n in again} == set(ages) and len(ages) >= 8
    assert "epsilon 1 of 2 left" in left(conn), "one measurement"


def test_a_changed_where_or_aggregate_is_a_new_question(conn: psycopg.Connection) -> None:
    conn.execute(BASE).fetchall()
    assert "epsilon 1.5 of 2 left" in left(conn)
    conn.execute("select education, count(*), avg(age) from adult where age > 30 group by education").fetchall()
    assert "epsilon 1 of 2 left" in left(conn), "another WHERE: another measurement"
    conn.execute("select education, count(*), sum(age) from adult group by education").fetchall()
    assert "epsilon 0.5 of 2 left" in left(conn), "another aggregate: another measurement"
    conn.execute("select education, count(*) from adult group by education").fetchall()
    assert "epsilon 0 of 2 left" in left(conn), "fewer statistics: another ε split, another measurement"
    # Each of them again, sorted: free.
    conn.execute("select education, count(*), avg(age) from adult where age>30 group by 1 order by 3").fetchall()
    conn.execute("select education, count(*) from adult group by education order by 2 desc limit 1").fetchall()
    assert "epsilon 0 of 2 left" in left(conn)


def test_an_answer_cached_in_the_old_format_is_a_miss(conn: psycopg.Connection, truth: psycopg.Connection,
                                                      analyst: str) -> None:
    conn.execute(BASE).fetchall()
    assert "epsilon 1.5 of 2 left" in left(conn)
    # What the cache held before answers were cached by meaning: the wire answer itself.
    old = Result((Column("education", 25), Column("count", 20), Column("avg", 1700)),
                 ((b"Bachelors", b"999999", b"1"),)).simple()
    changed = truth.execute("update anonproxy.answer_cache set answer = %s where role_name = %s", [old, analyst])
    assert changed.rowcount == 1
    explained = "\n".join(row[0] for row in conn.execute(f"explain (anonproxy) {BASE}"))
    assert "not cached" in explained
    rows = conn.execute(BASE).fetchall()  # no error: a miss, answered afresh and charged
    assert len(rows) == 16 and all(row[1] != 999999 for row in rows)
    assert "epsilon 1 of 2 left" in left(conn)


def test_limit_and_offset_parameters_re_limit_the_same_measurement(conn: psycopg.Connection,
                                                                    gated_proxy: Endpoint, gated_database: str,
                                                                    analyst: str) -> None:
    # psycopg binds %s server-side: LIMIT $1 in the extended protocol, as SQLAlchemy's .limit() and Prisma's take
    ordered = conn.execute(f"{BASE} order by 2 desc").fetchall()
    assert "epsilon 1.5 of 2 left" in left(conn)
    assert conn.execute(f"{BASE} order by 2 desc limit %s", [3]).fetchall() == ordered[:3]
    assert conn.execute(f"{BASE} order by 2 desc limit %s offset %s", [2, 5]).fetchall() == ordered[5:7]
    assert conn.execute(f"{BASE} order by 2 desc limit %s", [None]).fetchall() == ordered, "LIMIT NULL: all"
    assert conn.execute(f"{BASE} order by 2 desc offset %s", [None]).fetchall() == ordered, "OFFSET NULL: 0"
    with pytest.raises(psycopg.errors.InvalidRowCountInLimitClause, match="LIMIT must not be negative"):
        conn.execute(f"{BASE} order by 2 desc limit %s", [-1])
    # the same parameter in WHERE too: then its value is part of the question
    conn.execute("select education, count(*), avg(age) from adult where age > %s group by education "
                 "order by 2 desc limit %s", [30, 4]).fetchall()
    assert "epsilon 1 of 2 left" in left(conn)

    async def binary() -> list[tuple]:  # asyncpg binds int8 in binary
        connection = await asyncpg.connect(gated_proxy.url(gated_database, user=analyst))
        try:
            return [tuple(row) for row in await connection.fetch(f"{BASE} order by 2 desc limit $1 offset $2", 4, 1)]
        finally:
            await connection.close()

    assert [(e, n, float(m)) for e, n, m in asyncio.run(binary())] == [(e, n, float(m)) for e, n, m in ordered[1:5]]
    assert "epsilon 1 of 2 left" in left(conn), "re-limiting cost nothing"
