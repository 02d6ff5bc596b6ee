"""Round 18: schema introspection through the gated proxy, as the tools send it.

GUI clients, drivers and BI tools learn the schema from the catalogs before they send anything else; a role the
proxy gates (``reporter``: suppress, a dp role) must get PostgreSQL's own answer to those reads, as PostgreSQL gives
it to that role, or the tool cannot list tables and columns. The tools themselves run here, through the proxy and
directly as the same role (the ``role`` setting), and their outputs must be equal: asyncpg's type introspection
and set_type_codec() (the installed package), pgjdbc's DatabaseMetaData and ResultSetMetaData (the Debian jar, run
by ``java``: tests/clients/JdbcMetadata.java), psql's meta-commands and tab completion (the installed binary) and
SQLAlchemy's reflection (the installed package). No driver's SQL is copied here: what a driver sends is what its
installed version sends. (Npgsql has no runtime on this machine: its type loading is not tested.)

Reads that would show protected data stay refused: row previews of a protected table and a table sample;
``pg_statistic`` (the raw statistics, values of protected columns); ``pg_stats`` is answered as PostgreSQL answers
the role itself, which holds no SELECT on protected tables, so it shows none of their rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy
from conftest import Endpoint, corpus_roles
from psycopg import sql
from test_clients import jdbc_jar

from anonproxy.embedded import EmbeddedPostgres

reporter, analyst = corpus_roles("dp_round18i")

CLIENT = Path(__file__).parent / "clients" / "JdbcMetadata.java"


def as_role(truth: psycopg.Connection[Any], role: str, statement: str, values: list[Any]
            ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """PostgreSQL's own answer to ``statement`` for ``role``: run directly under SET ROLE."""
    truth.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
    try:
        return _answer(truth, statement, values)
    finally:
        truth.execute("reset role")


def _answer(conn: psycopg.Connection[Any], statement: str, values: list[Any]
            ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``statement`` with ``values`` bound server-side to its $1, $2 (a raw cursor sends the text as it is)."""
    cursor = psycopg.RawCursor(conn)
    cursor.execute(statement, values or None)
    return [column.name for column in cursor.description or []], cursor.fetchall()


# asyncpg (the installed package) introspects a type it has no codec for, with the WITH RECURSIVE over pg_type of
# asyncpg/introspection.py called with any($1::oid[]) (refused as unparsable before round 18), and looks a type up
# by name for set_type_codec(): types of the demo database's own, an enum, a domain, a composite and an array of one.
CUSTOM_TYPES = ("create type public.r18_mood as enum ('ok', 'sad')",
                "create domain public.r18_positive as integer check (value > 0)",
                "create type public.r18_pair as (a integer, b text)")
TYPED_QUERY = ("select 'sad'::public.r18_mood as mood, 3::public.r18_positive as positive, "
               "row(1, 'x')::public.r18_pair as pair, array['ok', 'sad']::public.r18_mood[] as moods, "
               "'{\"a\": [1, 2]}'::json as doc")


@pytest.fixture(name="custom_types")
def fixture_custom_types(truth: psycopg.Connection[Any]) -> Iterator[None]:
    for statement in CUSTOM_TYPES:
        truth.execute(statement)
    try:
        yield
    finally:
        truth.execute("drop type public.r18_pair, public.r18_mood; drop domain public.r18_positive")


async def _asyncpg_typed(connection: dict[str, Any]) -> tuple[list[tuple[str, str, str, str]], list[Any]]:
    """asyncpg's own introspection of TYPED_QUERY's types (its columns: name, type, kind, schema), and the values
    it then decodes; json decoded by a codec set with set_type_codec()."""
    conn = await asyncpg.connect(**connection)
    try:
        await conn.set_type_codec("json", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        prepared = await conn.prepare(TYPED_QUERY)
        columns = [(a.name, a.type.name, a.type.kind, a.type.schema) for a in prepared.get_attributes()]
        row = await prepared.fetchrow()
        assert row is not None
        return columns, [dict(value) if isinstance(value, asyncpg.Record) else value for value in row.values()]
    finally:
        await conn.close()


def test_asyncpg_type_introspection_as_postgresql(custom_types: None, reporter: psycopg.Connection[Any],
                                                  analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                  gated_database: str, pg_server: EmbeddedPostgres) -> None:
    for role in (reporter.info.user, analyst.info.user):
        through = asyncio.run(_asyncpg_typed({"host": gated_proxy.host, "port": gated_proxy.port, "user": role,
                                              "password": role, "database": gated_database}))
        direct = asyncio.run(_asyncpg_typed({"host": pg_server.host, "port": pg_server.port,
                                             "user": pg_server.superuser, "password": pg_server.password,
                                             "database": gated_database, "server_settings": {"role": role}}))
        assert through == direct, role
        assert through[1] == ["sad", 3, {"a": 1, "b": "x"}, ["ok", "sad"], {"a": [1, 2]}]
        assert [kind for _, _, kind, _ in through[0]] == ["scalar", "scalar", "composite", "array", "scalar"]


def jdbc_metadata(host: str, port: int, database: str, user: str, password: str, role: str | None = None
                  ) -> list[str]:
    """What pgjdbc (the Debian jar) reports through DatabaseMetaData and ResultSetMetaData (JdbcMetadata.java)."""
    java = shutil.which("java")
    assert java, "java is needed for the JDBC tests (Debian: default-jre-headless)"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(CLIENT), host, str(port), database, user, password,
                           *([role] if role else [])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


_RESULTS = ("result|", "rows|", "error|")


def test_pgjdbc_metadata_as_postgresql(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                       gated_proxy: Endpoint, gated_database: str,
                                       pg_server: EmbeddedPostgres) -> None:
    """DatabaseMetaData (getTables, getColumns, getPrimaryKeys, getIndexInfo, getImportedKeys, getSchemas,
    getCatalogs, getTypeInfo: pgjdbc's catalog reads, values bound server-side) as PostgreSQL answers the role
    itself; ResultSetMetaData of a column discovery, a grouped LIMIT 0 and a catalog query as PostgreSQL
    describes them to the owner (the role may not read adult directly)."""
    owner = jdbc_metadata(pg_server.host, pg_server.port, gated_database, pg_server.superuser, pg_server.password)
    owner_results = [line for line in owner if line.startswith(_RESULTS)]
    # (pgjdbc reads the table of a column from the catalogs by its oid; its getSchemaName is always empty)
    assert "result|SELECT * FROM public.adult WHERE 1=0|id|id|int4|4|adult||0|false|10|0" in owner_results
    assert not any(line.startswith("error|") for line in owner_results)
    for role in (reporter.info.user, analyst.info.user):
        through = jdbc_metadata(gated_proxy.host, gated_proxy.port, gated_database, role, role)
        direct = jdbc_metadata(pg_server.host, pg_server.port, gated_database, pg_server.superuser,
                               pg_server.password, role)
        catalog = [line for line in through if not line.startswith(_RESULTS)]
        assert catalog == [line for line in direct if not line.startswith(_RESULTS)], role
        assert [line for line in through if line.startswith(_RESULTS)] == owner_results, role
        for section in ("tables|public|adult|TABLE", "columns|adult|age|", "primary keys|adult|id|1|",
                        "schemas|public", "type info|int4|"):  # (the demo has no foreign key)
            assert any(line.startswith(section) for line in catalog), (role, section)


# psql meta-commands: postgres/postgres src/bin/psql/describe.c of PostgreSQL 15 (run by the installed psql 15
# binary, not read), each with a text its output on the demo database holds (None: may be empty)
PSQL_COMMANDS = {r"\dt": "adult", r"\d public.adult": 'Table "public.adult"', r"\d+ public.adult": "Access method",
                 r"\dn": "public", r"\df": None, r"\l": "anonproxy_gated", r"\du": "reporter", r"\dv": None,
                 r"\di": "adult", r"\dT": None, r"\dd": None}


def psql(conninfo: str, *commands: str, role: str | None = None) -> subprocess.CompletedProcess[str]:
    """The psql binary, each of ``commands`` as one -c, without psqlrc; ``role`` as a startup ``role`` setting."""
    environment = dict(os.environ, PGOPTIONS=f"-c role={role}") if role else dict(os.environ)
    arguments = ["psql", conninfo, "-X", "-v", "ON_ERROR_STOP=1"]
    for command in commands:
        arguments += ["-c", command]
    return subprocess.run(arguments, capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize("command", PSQL_COMMANDS)
def test_psql_describes_as_postgresql(command: str, reporter: psycopg.Connection[Any],
                                      analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                      gated_database: str, pg_server: EmbeddedPostgres) -> None:
    for role in (reporter.info.user, analyst.info.user):
        through = psql(gated_proxy.url(gated_database, user=role), command)
        direct = psql(pg_server.conninfo(dbname=gated_database), command, role=role)
        assert through.returncode == 0, through.stderr
        assert direct.returncode == 0, direct.stderr
        assert through.stdout == direct.stdout, (role, command)
        shown = PSQL_COMMANDS[command]
        assert shown is None or shown in through.stdout, through.stdout


def test_psql_expanded_display_of_a_catalog_read(reporter: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                 gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """``\\x`` then a catalog query: the same expanded record as PostgreSQL's."""
    query = "select relname, relkind, relnatts from pg_class where relname = 'adult'"
    through = psql(gated_proxy.url(gated_database, user="reporter"), r"\x", query)
    direct = psql(pg_server.conninfo(dbname=gated_database), r"\x", query, role="reporter")
    assert through.returncode == 0, through.stderr
    assert through.stdout == direct.stdout
    assert "-[ RECORD 1 ]" in through.stdout and "relname  | adult" in through.stdout


def completed(conninfo: str, typed: bytes, expected: bytes, role: str | None = None) -> bytes:
    """What interactive psql (readline, in a terminal) shows after ``typed``, its last key a TAB: read until
    ``expected`` appears, psql ends, or a bound on a hang passes."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: psql on the terminal
        try:
            os.environ.update({"TERM": "dumb", **({"PGOPTIONS": f"-c role={role}"} if role else {})})
            os.execvp("psql", ["psql", conninfo, "-X"])
        finally:
            os._exit(127)  # reached only when psql could not start: the child must not go on as pytest
    shown = _read(terminal, b"=> ")
    os.write(terminal, typed)
    shown += _read(terminal, expected)
    os.write(terminal, b"\x15\\q\n")  # clear the line, quit
    os.waitpid(pid, 0)
    os.close(terminal)
    return shown


def _read(terminal: int, until: bytes) -> bytes:
    shown = b""
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while until not in shown and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.5)[0]:
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # psql has ended
                break
            shown += chunk
    return shown


# psql's tab completion (postgres/postgres src/bin/psql/tab-complete.c of PostgreSQL 15, run by the installed psql
# 15 with readline, not read): a table name after FROM, a column of the table the statement names
COMPLETIONS = {"table": (b"select age from ad\t", b"select age from adult "),
               "column": (b"select * from adult where ag\t", b"select * from adult where age ")}


@pytest.mark.parametrize("what", COMPLETIONS)
def test_psql_tab_completion_as_postgresql(what: str, reporter: psycopg.Connection[Any],
                                           analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                           gated_database: str, pg_server: EmbeddedPostgres) -> None:
    typed, expected = COMPLETIONS[what]
    for role in (reporter.info.user, analyst.info.user):
        assert expected in completed(pg_server.conninfo(dbname=gated_database), typed, expected, role=role)
        assert expected in completed(gated_proxy.url(gated_database, user=role), typed, expected), role


def test_psql_preview_of_a_protected_table_is_refused(gated_proxy: Endpoint, gated_database: str) -> None:
    """What a GUI's "view data" sends, typed in psql: refused with a SQLSTATE and a message, no rows."""
    refused = psql(gated_proxy.url(gated_database, user="reporter"), "SELECT * FROM public.adult LIMIT 100")
    assert refused.returncode != 0
    assert "ERROR:" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stdout == ""


# SQLAlchemy's PostgreSQL reflection: sqlalchemy/sqlalchemy lib/sqlalchemy/dialects/postgresql/base.py (run by the
# installed package, not read: Inspector.get_columns and the rest build their queries from pg_catalog tables there)
def _inspected(dsn: str, options: str | None = None) -> dict[str, Any]:
    """What SQLAlchemy's Inspector reports about the demo schema over a connection to ``dsn``."""
    engine = sqlalchemy.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn, options=options) if options
        else psycopg.connect(dsn), poolclass=sqlalchemy.pool.NullPool)
    try:
        inspector = sqlalchemy.inspect(engine)
        return {
            "schemas": inspector.get_schema_names(),
            "tables": inspector.get_table_names(schema="public"),
            "views": inspector.get_view_names(schema="public"),
            "has adult": inspector.has_table("adult", schema="public"),
            "has nothing": inspector.has_table("no_such_table", schema="public"),
            "columns": [{**column, "type": str(column["type"])} for column in inspector.get_columns("adult", "public")],
            "primary key": inspector.get_pk_constraint("adult", schema="public"),
            "foreign keys": inspector.get_foreign_keys("visits", schema="public"),
            "indexes": inspector.get_indexes("adult", schema="public"),
            "unique": inspector.get_unique_constraints("adult", schema="public"),
            "checks": inspector.get_check_constraints("adult", schema="public"),
            "comment": inspector.get_table_comment("adult", schema="public"),
        }
    finally:
        engine.dispose()


def test_sqlalchemy_reflection_as_postgresql(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                             gated_proxy: Endpoint, gated_database: str,
                                             pg_server: EmbeddedPostgres) -> None:
    for role in (reporter.info.user, analyst.info.user):
        through = _inspected(gated_proxy.dsn(gated_database, user=role))
        direct = _inspected(pg_server.conninfo(dbname=gated_database), options=f"-c role={role}")
        assert through == direct, role
        assert through["has adult"] and [column["name"] for column in through["columns"]][0] == "id"


@pytest.fixture(name="adult_analyzed")
def fixture_adult_analyzed(truth: psycopg.Connection[Any]) -> None:
    """adult with statistics, so that pg_stats has rows for it for whoever may read them."""
    truth.execute("analyze public.adult")


def test_pg_stats_of_a_protected_table_are_postgresql_s_answer_for_the_role(
        adult_analyzed: None, reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
        truth: psycopg.Connection[Any]) -> None:
    """pg_stats hides the statistics of columns the role may not SELECT: none of adult's, as on PostgreSQL."""
    query = ("select attname, most_common_vals::text, histogram_bounds::text from pg_stats "
             "where schemaname = 'public' and tablename = 'adult'")
    assert truth.execute(query).fetchall(), "the owner sees adult's statistics"
    for conn in (reporter, analyst):
        assert _answer(conn, query, []) == as_role(truth, conn.info.user, query, []) == (
            ["attname", "most_common_vals", "histogram_bounds"], [])


# Statement, the error, a text of its message. The previews are written from memory of the tools, not read.
REFUSED_READS: dict[str, tuple[str, type[psycopg.Error], str]] = {
    # DBeaver's and DataGrip's data editor: the first page of rows (from memory)
    "row preview": ("SELECT * FROM public.adult LIMIT 200", psycopg.errors.InsufficientPrivilege,
                    "SELECT * is not allowed over protected tables"),
    # pgAdmin's "View/Edit Data > First 100 Rows" (from memory)
    "first rows": ("SELECT * FROM public.adult ORDER BY id ASC LIMIT 100", psycopg.errors.InsufficientPrivilege,
                   "SELECT * is not allowed over protected tables"),
    "table sample": ("SELECT count(*) FROM public.adult TABLESAMPLE SYSTEM (10)", psycopg.errors.InsufficientPrivilege,
                     "TABLESAMPLE is not allowed over protected tables"),
    "raw statistics": ("SELECT stanullfrac, stavalues1::text FROM pg_catalog.pg_statistic "
                       "WHERE starelid = 'public.adult'::regclass", psycopg.errors.InsufficientPrivilege,
                       "pg_statistic is not available"),
    # an object identifier array parses since round 18; over protected rows its cast stays refused
    "oid array over protected rows": ("SELECT count(*) FROM public.adult WHERE id::oid = any('{1,2}'::oid[])",
                                      psycopg.errors.FeatureNotSupported, "cast to OID is not allowed"),
}


@pytest.mark.parametrize("name", REFUSED_READS)
def test_reads_of_protected_data_are_refused(name: str, reporter: psycopg.Connection[Any],
                                            analyst: psycopg.Connection[Any]) -> None:
    statement, error, message = REFUSED_READS[name]
    for conn in (reporter, analyst):
        with pytest.raises(error) as refused:
            conn.execute(statement)
        assert message in (refused.value.diag.message_primary or ""), refused.value
