"""The SQL the service runs is rendered from the checked tree (anonproxy.plan.render): it must mean what the client wrote.

For a wide corpus of select items (every function, operator, cast and literal form the analysis admits, in the
spellings BI tools and people use), PostgreSQL runs the client's text and the rendered item (with the output name
the analysis gives it) over a table of typed columns holding edge values and NULLs: column names, type OIDs and
every value must be equal.
"""

from __future__ import annotations

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan import render
from anonproxy.plan.names import output_name
from anonproxy.plan.statements import split
from anonproxy.plan.tables import quote
from anonproxy.route.decide import parse_statement

TABLE = """
create temporary table t (i integer, b bigint, n numeric(10,2), f double precision, r real, s text,
                          v varchar(10), c char(4), d date, ts timestamp, tz timestamptz, ok boolean);
insert into t values
  (1, 9000000000, 12.34, 1.5, 2.25, 'Alpha', 'x', 'ab', '2020-02-29', '2020-02-29 13:14:15', '2020-02-29 13:14:15+02', true),
  (-7, -1, -0.01, -1e-300, -3.5, 'it''s', 'back\\slash', 'z', '1999-12-31', '1999-12-31 23:59:59', '1970-01-01 00:00:00+00', false),
  (0, 0, 0, 0, 0, '', '', '', '2000-01-01', '2000-01-01 00:00:00', '2000-01-01 00:00:00+00', null),
  (null, null, null, null, null, null, null, null, null, null, null, null),
  (100, 123456789012, 99999999.99, 1e300, 1e30, '  padded  ', 'ümlaut', 'four', '2024-12-31', '2024-12-31 00:00:01', '2024-06-30 12:00:00-05', true)
"""

ITEMS = [
    # columns, names, quoting, literals
    "i", "t.i", '"i"', "i as \"select\"", "i as from_", "s", "'it''s'", "'a\\b'", "$$dollar$$", "1.50", ".5", "1e3",
    "-2147483648", "true", "null::int", "i /* a comment */", "i -- a comment\n",
    # arithmetic and rounding
    "i + 1", "i - 1", "i * 2", "i / 3", "i % 3", "mod(i, 3)", "b * 2", "n / 3", "n % 2", "f * 2", "r / 2",
    "-i", "- -i", "abs(i)", "i ^ 2", "power(i, 2)", "floor(n)", "ceil(n)", "ceiling(n)", "round(n)", "round(n, 1)",
    "trunc(n)", "trunc(n, 1)", "round(f)", "floor((i - 10.0) / 10.0) * 10.0 + 10.0", "i / 10 * 10",
    "width_bucket(i, 0, 100, 10)", "width_bucket(f, -1, 1, 4)", "sign(n)",
    # casts
    "i::text", "cast(i as text)", "i::bigint", "i::int8", "i::smallint", "i::numeric", "i::numeric(6,1)",
    "i::decimal", "i::float", "i::float4", "i::real", "i::double precision", "n::int", "f::numeric", "s::varchar(3)",
    "i::varchar", "c::text", "d::text", "ts::date", "d::timestamp", "tz::date", "ok::text", "'42'::int",
    "cast('2020-01-01' as date)", "date '2020-01-01'", "i::\"char\"",
    # conditionals
    "case when i > 0 then 'pos' when i < 0 then 'neg' else 'zero' end", "case i when 1 then 'one' end",
    "coalesce(s, 'n/a')", "coalesce(i, 0)", "nullif(i, 0)", "nullif(s, '')", "greatest(i, 1)", "least(i, 1)",
    # text
    "lower(s)", "upper(s)", "length(s)", "char_length(s)", "substring(s, 1, 3)", "substring(s from 2 for 2)",
    "substring(s for 3)", "substring(s from 2)", "substr(s, 2, 2)", "left(s, 2)", "right(s, 2)", "left(s, -1)",
    "trim(s)", "btrim(s)", "ltrim(s)", "rtrim(s)", "trim(both ' ' from s)", "trim(leading ' ' from s)",
    "trim(trailing from s)", "rtrim(s, 'a')", "length(c)", "char_length(c)",
    # dates and times
    "date_trunc('month', d)", "date_trunc('MONTH', ts)", "date_trunc('year', tz)", "date_trunc('week', d)::date",
    "extract(year from d)", "extract(month from ts)", "extract(dow from d)", "extract(isodow from tz)",
    "extract(quarter from d)", "extract(epoch from ts)", "extract('year' from d)", "date_part('year', d)",
    "date_part('month', ts)", "date_part('epoch', tz)", "date_part('dow', d)::int", "extract(year from d)::int",
    "to_char(d, 'YYYY-MM')", "to_char(ts, 'FMMonth YYYY')", "to_char(ts, 'HH24:MI Dy DD Mon')",
    "to_char(tz, 'YYYY-\"Q\"Q')", "to_char(d, 'IYYY-IW')", "to_char(n, '999D99')", "d + interval '1 day'",
    # predicates (as values)
    "i > 1", "i <> 1", "i != 1", "i between 0 and 10", "i not between 0 and 10", "i in (1, 2)",
    "i not in (1, 2)", "i is null", "i is not null", "ok is true", "ok is not false", "ok is unknown",
    "i is distinct from 1", "i is not distinct from 1", "s like 'A%'", "s ilike 'a%'", "s not like '%s'",
    "not ok", "ok and i > 0", "ok or i > 0",
]


@pytest.fixture(scope="module")
def conn(pg_server: EmbeddedPostgres) -> psycopg.Connection:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as connection:
        connection.execute(TABLE)
        yield connection


def rendered(item: str) -> str:
    """The select item as the analysis renders it: from its node, with the name PostgreSQL gives the client's."""
    statement = split(f"select {item} from t")[0]
    node = parse_statement(statement).expressions[0]
    name = output_name(node, statement.source) or "?column?"
    return f"{render.sql(node.this if node.key == 'alias' else node)} AS {quote(name)}"


def answer(conn: psycopg.Connection, item: str) -> tuple[list[tuple[str, int]], list[tuple]]:
    cursor = conn.execute(f"select {item}\nfrom t order by ctid")
    assert cursor.description is not None
    return [(column.name, column.type_code) for column in cursor.description], cursor.fetchall()


@pytest.mark.parametrize("item", ITEMS)
def test_the_rendered_item_means_what_the_client_wrote(conn: psycopg.Connection, item: str) -> None:
    assert answer(conn, rendered(item)) == answer(conn, item)


def test_comments_never_reach_the_rendered_sql() -> None:
    text = rendered("i /* x */ -- */ , (select secret from elsewhere) --\n")
    assert "/*" not in text and "--" not in text and "secret" not in text


@pytest.mark.parametrize("item", ITEMS)
def test_rendering_leaves_the_tree_as_it_was(item: str) -> None:
    """render.sql renders without copying the tree first: it must not change it (the analysis renders pieces of a
    tree it goes on reading)."""
    tree = parse_statement(split(f"select {item}, count(*) filter (where i > 1) from t where s like 'a%' group by 1 "
                                 "having count(*) > 1 order by 2 desc nulls last limit 5 offset 1")[0])
    for node in [tree, *tree.walk()]:
        before = node.copy()
        render.sql(node)
        assert node == before
