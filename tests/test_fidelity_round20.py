"""Round 20: what drivers see of a gated answer's columns, as PostgreSQL describes them.

A RowDescription field carries more than a name and a type: the table OID and column number a column reads
(pgjdbc's getTableName, psqlODBC's base column), the type's length (psycopg's internal_size) and its modifier
(numeric(10,2)'s precision and scale, varchar(20)'s length). A cursor the proxy holds for a gated role kept only
names and types; now it keeps the whole field PostgreSQL gave for the rewritten statement, so that DECLARE/FETCH,
psycopg's server-side cursors and psqlODBC's declare/fetch mode describe the answer as the same statement without
a cursor does, and, where the rewrite leaves each column as it was (a role without a suppressed-rest row), as
PostgreSQL describes the client's own statement. A dp answer, which the proxy writes itself, names a table for its
key columns only (tests/test_dp_key_fields.py); each of its columns has its type's length (a bigint count: 8), as
PostgreSQL gives it.

``float(p)`` is read as PostgreSQL's grammar reads it (real for p <= 24, double precision above): the column's
type and name, and a parameter's type, are PostgreSQL's.

Expected values come from PostgreSQL itself: the same statement on a direct connection (the superuser's: a
description does not depend on the role).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pyodbc
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_policy
from test_cursors import odbc

from anonproxy.embedded import EmbeddedPostgres

Field = tuple[bytes | None, int, int, int, int, int]

# Each reads a column of a table (adult.age, visits.amount: numeric(10,2)), a cast with a modifier (varchar(20))
# and an aggregate (no table, as in PostgreSQL).
STATEMENTS = ["select age, education::varchar(20) as e, count(*) as n from adult group by 1, 2",
              "select amount, channel, count(*) as n from visits group by amount, channel"]


def fields(cursor: psycopg.Cursor[Any]) -> list[Field]:
    """The RowDescription as PostgreSQL (or the proxy) sent it: name, table OID, column number, type OID, type
    length, type modifier."""
    result = cursor.pgresult
    assert result is not None
    return [(result.fname(i), result.ftable(i), result.ftablecol(i), result.ftype(i), result.fsize(i),
             result.fmod(i)) for i in range(result.nfields)]


def declared(conn: psycopg.Connection[Any], statement: str) -> list[Field]:
    """A held cursor's description, simple protocol: DECLARE, then FETCH (its RowDescription)."""
    with conn.transaction():
        conn.execute(f"declare described cursor for {statement}")
        return fields(conn.execute("fetch 2 from described"))


def described_columns(cursor: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    """psycopg's cursor.description: name, type_code, display_size, internal_size, precision, scale, null_ok."""
    return [tuple(column) for column in cursor.description or []]


def server_side(conn: psycopg.Connection[Any], statement: str) -> tuple[list[Field], list[tuple[Any, ...]]]:
    """psycopg's named cursor: DECLARE in the extended protocol, Describe of its portal (fields and
    cursor.description), then FETCH FORWARD."""
    with conn.transaction(), conn.cursor("described") as cursor:
        cursor.execute(statement)
        described = fields(cursor), described_columns(cursor)
        cursor.fetchmany(2)
        assert described_columns(cursor) == described[1]
        return described


@pytest.fixture(scope="module", name="plain")
def fixture_plain(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                  gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """A role in suppress mode with k = 10 only (no suppressed-rest row: the rewrite keeps each column as read)."""
    role = "fidelity_reporter"
    truth.execute(f"drop role if exists {role}")
    truth.execute(f"create role {role} login password '{role}'")
    truth.execute("select anonproxy.set_role_policy(%s, 'suppress', 10)", [role])
    wait_for_policy(gated_proxy, gated_database, truth.execute("select version from anonproxy.policy_version"
                                                               ).fetchone()[0])
    try:
        with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
            yield conn
    finally:
        truth.execute("select anonproxy.drop_role_policy(%s)", [role])
        truth.execute(f"drop owned by {role}")
        truth.execute(f"drop role {role}")


@pytest.fixture(name="reporter")
def fixture_reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("statement", STATEMENTS)
def test_held_cursor_describes_as_postgresql(plain: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                             statement: str) -> None:
    """Where the rewrite keeps each column as read, a held cursor's fields (DECLARE/FETCH; psycopg's named cursor,
    its cursor.description with precision, scale and internal_size) are PostgreSQL's for the statement itself."""
    direct = fields(truth.execute(statement))
    assert direct[0][1] != 0 and direct[-1][1:3] == (0, 0)  # a column of a table; an aggregate reads none
    assert fields(plain.execute(statement)) == direct  # the rewritten statement without a cursor
    assert declared(plain, statement) == direct
    with truth.transaction(), truth.cursor("direct") as cursor:
        cursor.execute(statement)
        expected = described_columns(cursor)
    assert server_side(plain, statement) == (direct, expected)


def prepared_fields(conn: psycopg.Connection[Any], statement: str) -> list[Field]:
    """The extended protocol's Describe of a prepared statement (Parse, Describe; never executed)."""
    conn.pgconn.prepare(b"described", statement.encode())
    try:
        result = conn.pgconn.describe_prepared(b"described")
        return [(result.fname(i), result.ftable(i), result.ftablecol(i), result.ftype(i), result.fsize(i),
                 result.fmod(i)) for i in range(result.nfields)]
    finally:
        conn.pgconn.exec_(b"deallocate described")


@pytest.mark.parametrize("statement", STATEMENTS)
def test_other_gated_paths_describe_as_postgresql(plain: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                                  statement: str) -> None:
    """The same fields on the gated paths without a cursor: a prepared statement's Describe, and a column
    discovery (LIMIT 0, answered without reading a row)."""
    assert prepared_fields(plain, statement) == prepared_fields(truth, statement)
    discovery = f"{statement} limit 0"
    assert fields(plain.execute(discovery)) == fields(truth.execute(discovery))


@pytest.mark.parametrize("statement", STATEMENTS)
def test_held_cursor_describes_as_the_rewritten_answer(reporter: psycopg.Connection[Any],
                                                       truth: psycopg.Connection[Any], statement: str) -> None:
    """The demo's reporter adds a suppressed-rest row (a UNION ALL with NULL keys), after which PostgreSQL reports
    no table and no modifier for the key columns: a held cursor says what the rewritten statement says without a
    cursor, its types and lengths PostgreSQL's own."""
    answer = fields(reporter.execute(statement))
    assert declared(reporter, statement) == answer
    assert server_side(reporter, statement)[0] == answer
    direct = fields(truth.execute(statement))
    assert [(name, oid, size) for name, _, _, oid, size, _ in answer] == [
        (name, oid, size) for name, _, _, oid, size, _ in direct]


def test_psqlodbc_declare_fetch_describes_as_postgresql(plain: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                        gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """psqlODBC in UseDeclareFetch mode (BEGIN; declare ...; fetch): the columns' description (numeric(10,2)'s
    precision and scale, varchar(20)'s size) as psqlODBC gives it on a direct connection."""
    def description(conn: pyodbc.Connection, statement: str) -> list[tuple[Any, ...]]:
        try:
            return [tuple(column) for column in conn.cursor().execute(statement).description]
        finally:
            conn.close()

    role = plain.info.user
    for statement in STATEMENTS:
        through = description(odbc(gated_proxy, gated_database, role), statement)
        direct = description(odbc(Endpoint(pg_server.host, pg_server.port), gated_database, pg_server.superuser,
                                  PWD=pg_server.password), statement)
        assert through == direct, statement


def test_dp_answer_column_lengths_are_postgresql_s(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                   gated_database: str) -> None:
    """A dp answer the proxy writes itself: each column's type length is its type's (count's bigint: 8), as
    PostgreSQL gives it; a held cursor of it too."""
    statement = "select sex, count(*) as n from adult group by sex"
    direct = fields(truth.execute(statement))
    with fresh_dp_role(truth, gated_proxy, gated_database, "fidelity_dp", epsilon=10) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        answer = fields(conn.execute(statement))
        held = declared(conn, statement)
    assert [(name, oid, size) for name, _, _, oid, size, _ in answer] == [
        (name, oid, size) for name, _, _, oid, size, _ in direct]
    assert held == answer


# -- float(p) -------------------------------------------------------------------------------------------------

FLOATS = ["select (age * 2)::float(24), cast(age / 2 as float(53)), count(*) from adult group by 1, 2",
          "select cast(age as float(10)) as a, (age + 1)::float(25), count(*) from adult group by 1, 2",
          "select count(*)::float(24), 2::float(1) from adult"]


@pytest.mark.parametrize("statement", FLOATS)
def test_float_precision_columns_as_postgresql(plain: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                               statement: str) -> None:
    """float(p): the column's name (float4, float8 or its operand's) and type (real for p <= 24, double precision
    above) are PostgreSQL's."""
    expected = [(name, oid) for name, _, _, oid, _, _ in fields(truth.execute(statement))]
    assert [(name, oid) for name, _, _, oid, _, _ in fields(plain.execute(statement))] == expected


def test_float_precision_parameter_types_as_postgresql(plain: psycopg.Connection[Any],
                                                       truth: psycopg.Connection[Any]) -> None:
    """A parameter cast to float(p) in a gated statement: its type, as the Describe of the prepared statement
    reports it (ParameterDescription), is PostgreSQL's."""
    statement = ("select sex, count(*) from adult where age::float(24) > $1::float(24) and hours_per_week > "
                 "$2::float(53) group by sex")

    def parameter_types(conn: psycopg.Connection[Any]) -> list[int]:
        conn.pgconn.prepare(b"floats", statement.encode())
        described = conn.pgconn.describe_prepared(b"floats")
        conn.pgconn.exec_(b"deallocate floats")
        return [described.param_type(i) for i in range(described.nparams)]

    assert parameter_types(truth) == [700, 701]
    assert parameter_types(plain) == parameter_types(truth)
