"""A bare parameter in HAVING compared with sum(), avg(), min() or max(): described with the type PostgreSQL
infers there (the aggregate's result type), through the real proxy, in both modes, with asyncpg (which encodes a
bound value by the described type) and psycopg (prepared, binary).

Each statement's parameter types are compared with PostgreSQL's own description of the same statement; the
answers filter as PostgreSQL's do (suppression: equal to PostgreSQL's answer, every group being large; dp: every
noisy value released satisfies the filter).
"""

from __future__ import annotations

import asyncio
import operator
import struct
from decimal import Decimal
from typing import Any

import asyncpg
import psycopg
from conftest import Endpoint, fresh_dp_role
from psycopg import pq

from anonproxy.embedded import EmbeddedPostgres

# (statement, the value bound): avg of integer is numeric, sum of integer bigint (min() and max() are refused in dp
# mode; suppression prepares the statement it runs with PostgreSQL, which describes it).
HAVING = [
    ("SELECT education, avg(age) AS a FROM adult GROUP BY education HAVING avg(age) > $1 ORDER BY 1",
     Decimal("38.5")),
    ("SELECT education, sum(hours_per_week) AS h FROM adult GROUP BY education HAVING sum(hours_per_week) >= $1 "
     "ORDER BY 1", 20000),
    ("SELECT education, sum(age) AS s FROM adult GROUP BY education HAVING $1 < sum(age) ORDER BY 1", 50000),
    ("SELECT education, avg(hours_per_week) AS h FROM adult GROUP BY education HAVING (avg(hours_per_week)) <= $1 "
     "ORDER BY 1", Decimal("40")),
]


def described(conn: psycopg.Connection[Any], sql: str) -> list[int]:
    """The parameter type OIDs the server describes for ``sql`` (Parse, then Describe of the statement)."""
    prepared = conn.pgconn.prepare(b"described", sql.encode())
    assert prepared.status == pq.ExecStatus.COMMAND_OK, prepared.error_message
    try:
        description = conn.pgconn.describe_prepared(b"described")
        return [description.param_type(i) for i in range(description.nparams)]
    finally:
        conn.execute("DEALLOCATE described")


def passes(sql: str, value: Any, number: Any) -> bool:
    """Whether ``number`` satisfies the HAVING condition of ``sql`` with ``value`` bound."""
    condition = sql.split("HAVING ")[1].split(" ORDER")[0].replace("(avg", "avg").replace(")) ", ") ")
    _, symbol, right = condition.split(" ")
    compare = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}[symbol]
    return bool(compare(number, value) if right == "$1" else compare(value, number))


def test_suppression_describes_having_operands_as_postgresql(gated_proxy: Endpoint, gated_database: str,
                                                             truth: psycopg.Connection[Any]) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as reporter:
        for sql, value in HAVING:
            expected = described(truth, sql)
            assert described(reporter, sql) == expected, sql
            answer = truth.execute(sql.replace("$1", "%s"), [value]).fetchall()
            assert answer and len(answer) < 16, sql  # the filter keeps some groups and drops others
            got = reporter.execute(sql.replace("$1", "%s"), [value], prepare=True, binary=True).fetchall()
            assert got == answer, sql

    async def run() -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            for sql, value in HAVING:
                statement = await conn.prepare(sql)
                assert [t.oid for t in statement.get_parameters()] == described(truth, sql), sql
                rows = [tuple(row) for row in await statement.fetch(value)]
                assert rows == truth.execute(sql.replace("$1", "%s"), [value]).fetchall(), sql
        finally:
            await conn.close()

    asyncio.run(run())


def test_dp_describes_having_operands_as_postgresql(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                    gated_database: str, truth: psycopg.Connection[Any]) -> None:
    async def run(role: str) -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                     database=gated_database)
        try:
            for sql, value in HAVING:
                statement = await conn.prepare(sql)
                assert [t.oid for t in statement.get_parameters()] == described(truth, sql), sql
                for row in await statement.fetch(value):
                    assert passes(sql, value, row[1]), (sql, tuple(row))
        finally:
            await conn.close()

    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "having_types_analyst", epsilon=100) as role:
        asyncio.run(run(role))
        with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as analyst:
            for sql, value in HAVING:
                assert described(analyst, sql) == described(truth, sql), sql
                for row in analyst.execute(sql.replace("$1", "%s"), [value], prepare=True, binary=True):
                    assert passes(sql, value, row[1]), (sql, row)


def test_dp_refuses_a_malformed_binary_numeric_as_postgresql(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                             gated_database: str,
                                                             truth: psycopg.Connection[Any]) -> None:
    """A numeric bound in binary format that is not one (too short, a digit past 9999, an unknown sign, bytes
    left over): refused with PostgreSQL's SQLSTATE and message for it, before anything is measured or charged."""
    sql = HAVING[0][0].encode()
    malformed = [b"\x00\x01", struct.pack("!hhHhh", 1, 0, 0, 0, 10000), struct.pack("!hhHhh", 1, 0, 0x1234, 0, 3),
                 struct.pack("!hhHhhh", 1, 0, 0, 0, 3, 4)]

    def refused(conn: psycopg.Connection[Any]) -> list[tuple[bytes | None, bytes | None]]:
        errors = []
        for value in malformed:
            result = conn.pgconn.exec_params(sql, [value], [1700], [1])
            assert result.status == pq.ExecStatus.FATAL_ERROR
            errors.append((result.error_field(pq.DiagnosticField.SQLSTATE),
                           result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)))
        return errors

    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "malformed_numeric_analyst") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as analyst:
        before = analyst.execute("show anonproxy.budget").fetchall()
        assert refused(analyst) == refused(truth)
        assert analyst.execute("show anonproxy.budget").fetchall() == before
