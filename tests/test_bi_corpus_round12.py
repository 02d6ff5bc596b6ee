"""Round 12 of the BI corpus: the aggregate SQL of ORMs and query builders not read before — Lightdash's backend
query builder, Prisma's aggregate / groupBy / count, Sequelize, TypeORM, Hibernate 6, Ecto and SQLAlchemy Core with
literal binds (what pandas.read_sql receives) — written over the demo tables in the shape each generator gives.

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the same statement (or, where marked, every released row is one of PostgreSQL's and groups of fewer
than k people are missing); as a dp role each is answered with PostgreSQL's column names.

Refused before this round: Prisma's aggregate() and count(), which read the rows in a derived table with ``OFFSET
$n``, bound to 0 without a ``skip``. A derived table's ``OFFSET 0`` skips no row and is now dropped before the
derived table is inlined (anonproxy/plan/flatten.py; a bound one is decided at Bind, anonproxy/plan/bind_values.py):
the tests below check that it changes no answer and that any other OFFSET, a LIMIT, max() and the row-level
shapes of these generators stay refused with a SQLSTATE, a message and a hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import answer, corpus_roles, dp_answers, suppress_answers_as_postgresql

LIGHTDASH = "lightdash/lightdash packages/backend/src/utils/QueryBuilder/MetricQueryBuilder.ts"
PRISMA = "prisma/prisma-engines query-engine/connectors/sql-query-connector/src/query_builder/read.rs"
SEQUELIZE = "sequelize/sequelize src/dialects/abstract/query-generator.js, src/model.js (count, aggregate)"
TYPEORM = "typeorm/typeorm src/query-builder/SelectQueryBuilder.ts"
HIBERNATE = ("hibernate/hibernate-orm hibernate-core/src/main/java/org/hibernate/dialect/"
             "PostgreSQLSqlAstTranslator.java")
ECTO = "elixir-ecto/ecto_sql lib/ecto/adapters/postgres/connection.ex"
SQLALCHEMY = "sqlalchemy/sqlalchemy lib/sqlalchemy/sql/compiler.py (literal_binds), pandas-dev/pandas pandas/io/sql.py"


@dataclass(frozen=True)
class Shape:
    source: str  # the repository and file whose shape the statement follows
    what: str
    sql: str
    complete: bool = True  # every group holds at least k people: suppression withholds nothing


CORPUS = [
    # Lightdash: the metrics CTE grouped by position, table calculations over `SELECT *` of it, ORDER BY the
    # metric's quoted alias, LIMIT
    Shape(LIGHTDASH, "metrics CTE, a table calculation over SELECT *",
          "WITH metrics AS (SELECT \"adult\".sex AS \"adult_sex\", COUNT(DISTINCT \"adult\".id) AS \"adult_count\", "
          "AVG(\"adult\".age) AS \"adult_average_age\" FROM \"public\".\"adult\" AS \"adult\" GROUP BY 1) SELECT *, "
          "adult_count * 2 AS \"calc3\" FROM metrics ORDER BY \"adult_count\" DESC LIMIT 500"),
    Shape(LIGHTDASH, "two tables LEFT OUTER JOINed on parenthesised keys, grouped by position",
          "SELECT \"visits\".channel AS \"visits_channel\", \"adult\".sex AS \"adult_sex\", COUNT(DISTINCT "
          "\"adult\".id) AS \"adult_count\", SUM(\"visits\".amount) AS \"visits_total_amount\" FROM "
          "\"public\".\"adult\" AS \"adult\" LEFT OUTER JOIN \"public\".\"visits\" AS \"visits\" ON (\"adult\".id) "
          "= (\"visits\".person_id) GROUP BY 1,2 ORDER BY \"visits_total_amount\" DESC LIMIT 500"),
    Shape(LIGHTDASH, "a month dimension: DATE_TRUNC('MONTH', ...) and a filter in WHERE",
          "WITH metrics AS (SELECT DATE_TRUNC('MONTH', \"visits\".visited_at) AS \"visits_visited_at_month\", "
          "COUNT(\"visits\".visit_id) AS \"visits_count\" FROM \"public\".\"visits\" AS \"visits\" WHERE "
          "((\"visits\".channel) IN ('web', 'app')) GROUP BY 1) SELECT * FROM metrics ORDER BY "
          "\"visits_visited_at_month\" DESC LIMIT 500"),
    # Lightdash's pivot: the metric query re-aggregated, ranked with DENSE_RANK() for rows and columns, the
    # number of columns counted, all over the released rows
    Shape("lightdash/lightdash packages/backend/src/utils/QueryBuilder/PivotQueryBuilder.ts",
          "pivot: group_by_query, pivot_query with DENSE_RANK() indexes, total_columns CROSS JOINed",
          "WITH original_query AS (SELECT \"adult\".sex AS \"adult_sex\", \"adult\".race AS \"adult_race\", "
          "COUNT(DISTINCT \"adult\".id) AS \"adult_count\" FROM \"public\".\"adult\" AS \"adult\" GROUP BY 1,2), "
          "group_by_query AS (SELECT \"adult_sex\", \"adult_race\", sum(\"adult_count\") AS \"adult_count_sum\" "
          "FROM original_query group by \"adult_sex\", \"adult_race\"), pivot_query AS (SELECT g.\"adult_sex\", "
          "g.\"adult_race\", g.\"adult_count_sum\", DENSE_RANK() OVER (ORDER BY g.\"adult_sex\" ASC) AS "
          "\"row_index\", DENSE_RANK() OVER (ORDER BY g.\"adult_race\" ASC) AS \"column_index\" FROM group_by_query "
          "g), filtered_rows AS (SELECT * FROM pivot_query WHERE \"row_index\" <= 500), total_columns AS (SELECT "
          "COUNT(*) AS total_columns FROM (SELECT DISTINCT \"adult_race\" FROM filtered_rows) AS distinct_groups) "
          "SELECT p.*, t.total_columns FROM pivot_query p CROSS JOIN total_columns t WHERE p.\"row_index\" <= 500 "
          "order by p.\"row_index\", p.\"column_index\""),
    # Prisma: aggregate() and count() read the rows in a derived table "sub" (with the pagination's OFFSET), then
    # aggregate its unqualified columns
    Shape(PRISMA, "aggregate(): _count, _avg, _sum over the rows in a derived table with OFFSET 0",
          "SELECT COUNT(\"id\"), AVG(\"age\"), SUM(\"age\"), COUNT(*) FROM (SELECT \"public\".\"adult\".\"id\", "
          "\"public\".\"adult\".\"age\" FROM \"public\".\"adult\" WHERE \"public\".\"adult\".\"sex\" = 'Female' "
          "OFFSET 0) AS \"sub\""),
    Shape(PRISMA, "count(): COUNT(*) over the rows in a derived table, WHERE 1=1",
          "SELECT COUNT(*) FROM (SELECT \"public\".\"adult\".\"id\" FROM \"public\".\"adult\" WHERE 1=1 OFFSET 0) "
          "AS \"sub\""),
    Shape(PRISMA, "groupBy(): fully qualified columns, _count and _sum, HAVING, ORDER BY the key",
          "SELECT \"public\".\"adult\".\"race\", COUNT(\"public\".\"adult\".\"id\"), SUM(\"public\".\"adult\"."
          "\"hours_per_week\") FROM \"public\".\"adult\" WHERE 1=1 GROUP BY \"public\".\"adult\".\"race\" HAVING "
          "COUNT(\"public\".\"adult\".\"id\") > 100 ORDER BY \"public\".\"adult\".\"race\" ASC OFFSET 0"),
    # Sequelize: the model's alias equals the table's name, count(DISTINCT("alias"."id")) with an include
    Shape(SEQUELIZE, "Model.sum(): sum(\"amount\") AS \"sum\" with a WHERE on the alias",
          "SELECT sum(\"amount\") AS \"sum\" FROM \"visits\" AS \"visits\" WHERE \"visits\".\"channel\" = 'web';"),
    Shape(SEQUELIZE, "Model.count({ include, distinct: true }): count(DISTINCT(\"adult\".\"id\")) over a join",
          "SELECT count(DISTINCT(\"adult\".\"id\")) AS \"count\" FROM \"adult\" AS \"adult\" INNER JOIN \"visits\" "
          "AS \"visits\" ON \"adult\".\"id\" = \"visits\".\"person_id\" AND \"visits\".\"channel\" = 'web';"),
    Shape(SEQUELIZE, "findAll({ attributes, group }): fn('count'), fn('avg'), ORDER BY the aggregate",
          "SELECT \"sex\", count(\"id\") AS \"n\", avg(\"age\") AS \"avg_age\" FROM \"adult\" AS \"adult\" GROUP BY "
          "\"sex\" ORDER BY count(\"id\") DESC;"),
    Shape(SEQUELIZE, "Model.count({ group }): the key and count(\"adult\".\"id\") AS \"count\"",
          "SELECT \"race\", count(\"adult\".\"id\") AS \"count\" FROM \"adult\" AS \"adult\" GROUP BY \"race\";"),
    Shape(SEQUELIZE, "fn('date_trunc', 'month', col(...)) grouped by the output alias",
          "SELECT date_trunc('month', \"visited_at\") AS \"month\", COUNT(\"visit_id\") AS \"n\" FROM \"visits\" AS "
          "\"visits\" GROUP BY \"month\" ORDER BY \"month\" ASC;"),
    Shape(SEQUELIZE, "findAll({ include: [{ model, attributes: [] }], group }): counts of the included rows",
          "SELECT \"adult\".\"sex\", COUNT(\"visits\".\"visit_id\") AS \"visitCount\" FROM \"adult\" AS \"adult\" "
          "LEFT OUTER JOIN \"visits\" AS \"visits\" ON \"adult\".\"id\" = \"visits\".\"person_id\" GROUP BY "
          "\"adult\".\"sex\";"),
    # TypeORM: aliases "<alias>_<column>", getCount's COUNT(DISTINCT("alias"."id")) AS "cnt", joins without spaces
    Shape(TYPEORM, "getRawMany(): \"adult_sex\", COUNT(...) AS \"cnt\", ORDER BY the alias, LIMIT and OFFSET",
          "SELECT \"adult\".\"sex\" AS \"adult_sex\", COUNT(\"adult\".\"id\") AS \"cnt\" FROM \"public\".\"adult\" "
          "\"adult\" WHERE \"adult\".\"age\" > 30 GROUP BY \"adult\".\"sex\" ORDER BY \"cnt\" DESC LIMIT 10 OFFSET 0"),
    Shape(TYPEORM, "getCount(): COUNT(DISTINCT(\"adult\".\"id\")) AS \"cnt\"",
          "SELECT COUNT(DISTINCT(\"adult\".\"id\")) AS \"cnt\" FROM \"public\".\"adult\" \"adult\" WHERE "
          "\"adult\".\"age\" > 30"),
    Shape(TYPEORM, "getCount() with innerJoin: the distinct ids of the people with an app visit",
          "SELECT COUNT(DISTINCT(\"adult\".\"id\")) AS \"cnt\" FROM \"public\".\"adult\" \"adult\" INNER JOIN "
          "\"public\".\"visits\" \"visit\" ON \"visit\".\"person_id\"=\"adult\".\"id\" WHERE \"visit\".\"channel\" = "
          "'app'"),
    Shape(TYPEORM, "leftJoin + addSelect(\"SUM(visit.amount)\", \"total\") + groupBy",
          "SELECT \"adult\".\"sex\" AS \"adult_sex\", SUM(\"visit\".\"amount\") AS \"total\" FROM "
          "\"public\".\"adult\" \"adult\" LEFT JOIN \"public\".\"visits\" \"visit\" ON "
          "\"visit\".\"person_id\"=\"adult\".\"id\" GROUP BY \"adult\".\"sex\""),
    # Hibernate 6: aliases a1_0, unnamed aggregates, avg(cast(... as float(53))), offset/fetch first
    Shape(HIBERNATE, "a1_0 aliases, ORDER BY the aggregate, offset ... rows fetch first ... rows only",
          "select a1_0.sex,count(a1_0.id) from public.adult a1_0 group by a1_0.sex order by count(a1_0.id) desc "
          "offset 0 rows fetch first 10 rows only"),
    Shape(HIBERNATE, "avg(cast(... as float(53))), a HAVING on count",
          "select a1_0.education,avg(cast(a1_0.age as float(53))),sum(a1_0.hours_per_week) from public.adult a1_0 "
          "where a1_0.age>=18 group by a1_0.education having count(a1_0.id)>100"),
    Shape(HIBERNATE, "count(distinct ...) over a join of the linked table",
          "select v1_0.channel,count(distinct a1_0.id) from public.visits v1_0 join public.adult a1_0 on "
          "a1_0.id=v1_0.person_id group by v1_0.channel"),
    Shape(HIBERNATE, "extract(year from ...) grouped by the repeated expression",
          "select extract(year from v1_0.visited_at),sum(v1_0.amount) from public.visits v1_0 group by "
          "extract(year from v1_0.visited_at) order by 1"),
    Shape(HIBERNATE, "Spring Data's count query of a page",
          "select count(a1_0.id) from public.adult a1_0 where a1_0.sex='Male'"),
    Shape(HIBERNATE, "a CASE dimension grouped by the repeated expression",
          "select case when a1_0.age<30 then 'young' else 'older' end,count(a1_0.id) from public.adult a1_0 group "
          "by case when a1_0.age<30 then 'young' else 'older' end"),
    Shape(HIBERNATE, "cast(... as date) and coalesce(sum(...),0) over a date range",
          "select cast(v1_0.visited_at as date),coalesce(sum(v1_0.amount),0) from public.visits v1_0 where "
          "v1_0.visited_at between '2025-03-01' and '2025-03-31' group by cast(v1_0.visited_at as date) order by 1"),
    # Ecto: aliases a0 / v0, typed literals (30::bigint), avg(...)::float, a subquery's s0 / sa0 aliases
    Shape(ECTO, "group_by with count and a typed literal in WHERE",
          "SELECT a0.\"sex\", count(a0.\"id\") FROM \"public\".\"adult\" AS a0 WHERE (a0.\"age\" > 30::bigint) "
          "GROUP BY a0.\"sex\""),
    Shape(ECTO, "Repo.aggregate(:avg) cast to float",
          "SELECT avg(a0.\"age\")::float FROM \"adult\" AS a0"),
    Shape(ECTO, "Repo.aggregate over a subquery: count(s0.\"id\") FROM (SELECT sa0.\"id\" AS \"id\" ...) AS s0",
          "SELECT count(s0.\"id\") FROM (SELECT sa0.\"id\" AS \"id\" FROM \"adult\" AS sa0 WHERE (sa0.\"sex\" = "
          "'Female')) AS s0"),
    Shape(ECTO, "date_trunc grouped by the repeated expression, coalesce(sum(...), 0)",
          "SELECT date_trunc('month', v0.\"visited_at\"), coalesce(sum(v0.\"amount\"), 0) FROM \"visits\" AS v0 "
          "GROUP BY date_trunc('month', v0.\"visited_at\")"),
    Shape(ECTO, "fragment(\"?::date\"): a cast to date grouped by the repeated expression",
          "SELECT v0.\"visited_at\"::date, count(v0.\"visit_id\") FROM \"visits\" AS v0 WHERE (v0.\"visited_at\" >= "
          "'2025-03-01'::timestamptz) AND (v0.\"visited_at\" < '2025-04-01'::timestamptz) GROUP BY "
          "v0.\"visited_at\"::date"),
    Shape(ECTO, "Repo.aggregate(:count) of a distinct query: the number of distinct values",
          "SELECT count(*) FROM (SELECT DISTINCT sa0.\"education\" AS \"education\" FROM \"adult\" AS sa0) AS s0"),
    # SQLAlchemy Core compiled with literal_binds (what pandas.read_sql is given)
    Shape(SQLALCHEMY, "count_1 labels, ORDER BY the aggregate, LIMIT ... OFFSET ...",
          "SELECT adult.sex, count(adult.id) AS count_1 FROM adult WHERE adult.age > 30 GROUP BY adult.sex ORDER BY "
          "count(adult.id) DESC LIMIT 10 OFFSET 0"),
    Shape(SQLALCHEMY, "CAST(avg(...) AS NUMERIC(10, 2)) and an expanded IN list",
          "SELECT adult.race, CAST(avg(adult.age) AS NUMERIC(10, 2)) AS avg_age FROM adult WHERE adult.race IN "
          "('White', 'Black') GROUP BY adult.race"),
    Shape(SQLALCHEMY, "select(func.count()).select_from(grouped subquery): the number of groups",
          "SELECT count(*) AS count_1 FROM (SELECT adult.sex AS sex, count(adult.id) AS n FROM adult GROUP BY "
          "adult.sex) AS anon_1"),
    Shape(SQLALCHEMY, "select(func.count()).select_from(select(adult).where(...).subquery()): every column inside",
          "SELECT count(*) AS count_1 FROM (SELECT adult.id AS id, adult.age AS age, adult.sex AS sex, adult.race AS "
          "race FROM adult WHERE adult.age > 30) AS anon_1"),
]


reporter, analyst = corpus_roles("dp_round12")


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.source.split()[0]}: {shape.what}" for shape in CORPUS])
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.source.split()[0]}: {shape.what}" for shape in CORPUS])
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


HIBERNATE_BOUND = ("select a1_0.race,count(a1_0.id) from public.adult a1_0 where a1_0.age>=%s group by a1_0.race "
                   "order by count(a1_0.id) desc offset %s rows fetch first %s rows only")
PRISMA_BOUND = ("SELECT COUNT(*), AVG(\"age\") FROM (SELECT \"public\".\"adult\".\"id\", \"public\".\"adult\".\"age\" "
                "FROM \"public\".\"adult\" WHERE \"public\".\"adult\".\"sex\" = %s OFFSET %s) AS \"sub\"")


def _bound(conn: psycopg.Connection[Any], sql: str, values: list[Any]) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``sql`` with ``values`` bound server-side (psycopg sends $1, $2 and Binds the values, as Prisma does)."""
    cursor = conn.cursor()
    cursor.execute(sql, values, prepare=True)
    return [column.name for column in cursor.description or []], cursor.fetchall()


def test_prisma_binds_its_offset(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                 truth: psycopg.Connection[Any]) -> None:
    """Prisma's aggregate() binds the derived table's OFFSET: bound to 0 it is answered as PostgreSQL answers it
    (reporter) and with PostgreSQL's column names (dp); bound to a skip it is refused, naming the OFFSET."""
    expected = _bound(truth, PRISMA_BOUND, ["Female", 0])
    assert _bound(reporter, PRISMA_BOUND, ["Female", 0]) == expected
    names, rows = _bound(analyst, PRISMA_BOUND, ["Female", 0])
    assert names == expected[0] and rows
    _bound(truth, PRISMA_BOUND, ["Female", 10])
    for conn in (reporter, analyst):
        with pytest.raises(psycopg.Error) as caught:
            _bound(conn, PRISMA_BOUND, ["Female", 10])
        assert caught.value.sqlstate == "0A000", caught.value
        assert "OFFSET inside a derived table" in (caught.value.diag.message_primary or "")


def test_hibernate_binds_its_page(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                  truth: psycopg.Connection[Any]) -> None:
    """Hibernate binds the filter and the page (offset ? rows fetch first ? rows only) of an aggregate query:
    answered as PostgreSQL answers it (reporter) and with its column names (dp)."""
    values = [30, 1, 3]
    expected = _bound(truth, HIBERNATE_BOUND, values)
    assert _bound(reporter, HIBERNATE_BOUND, values) == expected
    names, rows = _bound(analyst, HIBERNATE_BOUND, values)
    assert names == expected[0] and rows


@pytest.mark.parametrize("sql", [
    "SELECT count(*) FROM (SELECT id FROM public.adult WHERE age > 30 {}) AS sub",
    # one person: answered alike (withheld) with and without the OFFSET 0
    "SELECT count(*), avg(age) FROM (SELECT id, age FROM public.adult WHERE id = 17 {}) AS sub",
    "SELECT sub.sex, count(*) FROM (SELECT sex FROM public.adult WHERE age > 88 {}) AS sub GROUP BY 1",
    "WITH rows AS (SELECT sex, age FROM public.adult {}) SELECT sex, sum(age) FROM rows GROUP BY sex",
])
def test_offset_zero_changes_nothing(sql: str, reporter: psycopg.Connection[Any]) -> None:
    """A derived table's OFFSET 0 skips no row: the proxy gives the statement with it the answer it gives the
    statement without it, a count of one person included (which it withholds: not PostgreSQL's count of 1)."""
    without = answer(reporter, sql.format(""))
    assert (1,) not in [row[:1] for row in without[1]]
    for offset in ("OFFSET 0", "OFFSET 0 ROWS", "OFFSET '0'", "OFFSET 0::bigint"):
        names, rows = answer(reporter, sql.format(offset))
        assert names == without[0]
        assert sorted(rows, key=repr) == sorted(without[1], key=repr)


@pytest.mark.parametrize(("sql", "sqlstate", "message"), [
    # Prisma's skip: the rows after the first n, in an order PostgreSQL chooses
    ("SELECT COUNT(*) FROM (SELECT \"public\".\"adult\".\"id\" FROM \"public\".\"adult\" WHERE 1=1 OFFSET 5) AS "
     "\"sub\"", "0A000", "OFFSET inside a derived table is not supported"),
    # Prisma's take: a LIMIT beside the OFFSET 0 still picks some rows
    ("SELECT AVG(\"age\") FROM (SELECT \"public\".\"adult\".\"age\" FROM \"public\".\"adult\" WHERE 1=1 LIMIT 1 "
     "OFFSET 0) AS \"sub\"", "0A000", "LIMIT inside a derived table is not supported"),
    # an OFFSET that is not a constant
    ("SELECT count(*) FROM (SELECT id FROM public.adult OFFSET (SELECT min(age) FROM public.adult)) AS sub", "0A000",
     None),
    # TypeORM's getManyAndCount pages the entities' ids: row-level
    ("SELECT DISTINCT \"distinctAlias\".\"adult_id\" AS \"ids_adult_id\" FROM (SELECT \"adult\".\"id\" AS "
     "\"adult_id\", \"adult\".\"age\" AS \"adult_age\" FROM \"public\".\"adult\" \"adult\") \"distinctAlias\" "
     "ORDER BY \"adult_id\" ASC LIMIT 10", "42501", "is an identifying column"),
    # Ecto's Repo.exists?: whether anyone matches, a row-level probe
    ("SELECT TRUE FROM \"public\".\"adult\" AS a0 WHERE (a0.\"age\" > 88) LIMIT 1", "42501", "must aggregate"),
    # Prisma's _max / Hibernate's max(): an extreme is often one person's value
    ("SELECT MAX(\"age\") FROM (SELECT \"public\".\"adult\".\"age\" FROM \"public\".\"adult\" WHERE 1=1 OFFSET 0) "
     "AS \"sub\"", "42501", "max() is not"),
])
def test_what_stays_refused(sql: str, sqlstate: str, message: str | None, reporter: psycopg.Connection[Any],
                            analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """PostgreSQL answers each; the proxy refuses each in both modes, with a SQLSTATE, a message and a hint."""
    truth.execute(sql).fetchall()
    for conn in (reporter, analyst):
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(sql).fetchall()
        error = caught.value
        assert error.sqlstate == sqlstate, error
        assert message is None or message in (error.diag.message_primary or ""), error
        assert error.diag.message_hint, error
