"""Issue 20: the headline number of a dashboard is answered in suppression mode.

A total over everyone in the FROM clause is public (the rows of any GROUP BY add up to it), so query-set-size
control releases it: n >= k, and n = N or n <= N - k. The SQL below is what each tool sends for its headline card
(the tools' own generators, as in tests/bi_corpus/); each must come back as the demo `reporter` (suppress, k = 10,
dominance, p %, rest row) with exactly the value PostgreSQL gives the owner, in the simple and the extended
protocol, with no notice. A total over all but one to k - 1 people is still withheld, with the notice that says
why.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint

CARDS = {
    "Metabase number card": 'SELECT COUNT(*) AS "count" FROM "public"."adult"',
    "Metabase pivot grand total": 'SELECT ABS(3) AS "pivot-grouping", COUNT(*) AS "count" FROM "public"."adult" '
                                  'GROUP BY ABS(3) ORDER BY ABS(3) ASC',
    "Superset big number": "SELECT COUNT(*) AS count \nFROM public.adult \n LIMIT 10000",
    "Superset big number of a metric": 'SELECT AVG(hours_per_week) AS "AVG(hours_per_week)" \nFROM public.adult \n'
                                       " LIMIT 10000",
    "Grafana stat panel": "SELECT AVG(age) FROM adult LIMIT 50 ",
    "Power BI card": 'select count(1) as "a0" from "public"."adult" as "$Table"',
    "Power BI card of a sum": 'select sum("rows"."hours_per_week") as "a0" from "public"."adult" as "rows"',
    "DBeaver row count": "SELECT COUNT(*) FROM public.adult",
    "SQLAlchemy count": "SELECT count(*) AS count_1 FROM adult",
    "a WHERE everyone passes": "select count(*), sum(hours_per_week) from adult where age >= 0",
}

# Totals over all but 1 to k - 1 people: one subtraction from the public total would single them out.
ALL_BUT_A_FEW = [
    "select count(*) from adult where id <> 17",
    "select sum(hours_per_week) from adult where id not in (17, 18, 19)",
    "select count(*) from adult where not (age = 90 and native_country = 'Philippines')",
]


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as connection:
        yield connection


def _asked(connection: psycopg.Connection[Any], sql: str, prepare: bool) -> tuple[list[tuple[Any, ...]], list[str]]:
    notices: list[str] = []
    connection.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
    rows = connection.execute(sql, prepare=prepare).fetchall()  # prepare: the extended protocol, named statement
    return rows, notices


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "prepared"])
@pytest.mark.parametrize("sql", CARDS.values(), ids=CARDS.keys())
def test_a_headline_card_is_answered_exactly(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                             sql: str, prepare: bool) -> None:
    rows, notices = _asked(reporter, sql, prepare)
    assert rows == truth.execute(sql).fetchall()
    assert len(rows) == 1
    assert notices == []


@pytest.mark.parametrize("sql", ALL_BUT_A_FEW)
def test_a_total_of_all_but_a_few_is_withheld(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                              sql: str) -> None:
    everyone = truth.execute("select count(*) from adult").fetchone()[0]
    counted = truth.execute(sql.replace("sum(hours_per_week)", "count(*)")).fetchone()[0]
    assert 0 < everyone - counted < 10  # the premise: the WHERE leaves 1 to k - 1 people out
    rows, notices = _asked(reporter, sql, prepare=False)
    assert rows == []
    assert notices == ["anonproxy: the total was withheld by query-set-size control"]
