"""A dp answer's RowDescription describes its GROUP BY key columns as PostgreSQL does: the table OID and column
number of a plain column, and its type's modifier (varchar(20)'s length, numeric(10,2)'s precision and scale);
an aggregate column reads no table, in PostgreSQL as in the proxy.

The answer is the proxy's own (noisy values), written from the measurement; what is compared is the description
alone: of the answer (simple protocol), of a prepared statement (Parse, Describe), of a cached answer (the same
statement asked again), and pgjdbc's ResultSetMetaData (getTableName, getPrecision, getScale). Expected values
come from PostgreSQL itself, the same statement on a direct connection.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from test_clients import jdbc_jar
from test_fidelity_round20 import fields, prepared_fields

from anonproxy.embedded import EmbeddedPostgres

JDBC_CLIENT = Path(__file__).parent / "clients" / "JdbcDescribed.java"

# A declared public domain (sex), a key by partition selection (age), a cast with a modifier (no table, its
# typmod), two keys, and a linked table's text and numeric(10,2) keys.
STATEMENTS = ["select sex, count(*) as n from adult group by sex",
              "select age, count(*) as n from adult group by age",
              "select education::varchar(20) as e, count(*) as n from adult group by 1",
              "select race, sex, avg(hours_per_week) as h from adult group by race, sex",
              "select channel, count(*) as n from visits group by channel",
              "select amount, count(*) as n from visits group by amount"]


@pytest.fixture(scope="module", name="analyst")
def fixture_analyst(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                    gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "key_fields_analyst", epsilon=100, delta=0.5) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("statement", STATEMENTS)
def test_dp_answer_describes_keys_as_postgresql(analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                                statement: str) -> None:
    direct = fields(truth.execute(statement))
    assert fields(analyst.execute(statement)) == direct  # measured
    assert fields(analyst.execute(statement)) == direct  # from the answer cache
    assert prepared_fields(analyst, statement) == prepared_fields(truth, statement)


def test_dp_answer_with_parameters_describes_keys_as_postgresql(analyst: psycopg.Connection[Any],
                                                                truth: psycopg.Connection[Any]) -> None:
    """A statement with parameters (the extended protocol: Parse, Bind, Describe of the portal): its key columns
    as PostgreSQL describes them, whichever of its parameters the keys' own FROM and WHERE read."""
    statement = "select sex, sum(hours_per_week) as h from adult where age > %s and education <> %s group by sex"
    direct = fields(truth.execute(statement, [30, "Masters"]))
    assert direct[0][1:3] != (0, 0)
    assert fields(analyst.execute(statement, [30, "Masters"])) == direct
    numbered = statement.replace("%s", "$1", 1).replace("%s", "$2")
    assert prepared_fields(analyst, numbered) == prepared_fields(truth, numbered)


def jdbc_described(host: str, port: int, database: str, user: str, password: str) -> list[str]:
    """pgjdbc's ResultSetMetaData of each of STATEMENTS (tests/clients/JdbcDescribed.java, the Debian jar)."""
    java = shutil.which("java")
    assert java, "java is needed for the JDBC tests (Debian: default-jre-headless)"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(JDBC_CLIENT), host, str(port), database, user, password,
                           *STATEMENTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_pgjdbc_describes_dp_keys_as_postgresql(analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """pgjdbc's getTableName (read from the catalogs by the table OID), precision and scale (from the type
    modifier) of a dp answer's columns: those PostgreSQL gives for the same statements."""
    direct = jdbc_described(pg_server.host, pg_server.port, gated_database, pg_server.superuser,
                            pg_server.password)
    assert [line.split("|")[2:6] for line in direct][:2] == [["sex", "sex", "text", "adult"], ["n", "n", "int8", ""]]
    role = analyst.info.user
    assert jdbc_described(gated_proxy.host, gated_proxy.port, gated_database, role, role) == direct
