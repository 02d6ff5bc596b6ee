"""Cursors through the proxy for gated roles: DECLARE / FETCH / MOVE / CLOSE, as PostgreSQL answers them.

A cursor over a query the proxy answers (reporter: suppression, k = 10; a dp
role) is held by the proxy; one over a query that passes (catalogs) lives on
the client's own connection. Expected answers come from PostgreSQL itself:
the same cursor commands run on a superuser connection over the same rows.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import subprocess
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from conftest import Endpoint
from test_gate import _wait_for_version as wait_for_version

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.cursors import Position, run
from anonproxy.rewrite.decision import FetchCursor

K = 10
QUERY = "select education, count(*) as n from adult group by education order by education"
_names = itertools.count(1)


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection]:
    conn = psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True)
    yield conn
    conn.close()


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def released(truth: psycopg.Connection) -> list[tuple[str, int]]:
    """What the reporter's QUERY releases: groups of at least k people."""
    return [(education, n) for education, n in truth.execute(QUERY).fetchall() if n >= K]


def sqlstate(conn: psycopg.Connection, sql: str) -> str | None:
    try:
        conn.execute(sql)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


# -- the portal arithmetic against PostgreSQL's own ------------------------------------------------------------

DIRECTIONS = ["next", "prior", "first", "last", "absolute {n}", "relative {n}", "{n}", "all", "forward",
              "forward {n}", "forward all", "backward", "backward {n}", "backward all"]


def test_fetch_and_move_arithmetic_matches_postgresql(truth: psycopg.Connection) -> None:
    """Random FETCH / MOVE sequences on a SCROLL cursor and a NO SCROLL one over 7 rows: the rows, counts and
    errors of cursors.run equal PostgreSQL's."""
    from anonproxy.rewrite.commands import cursor_command
    from anonproxy.rewrite.statements import split

    rng = random.Random(11)
    size = 7
    for scroll in (True, False):
        for _ in range(40):
            truth.execute("begin")
            truth.execute(f"declare k {'' if scroll else 'no '}scroll cursor for select g from generate_series(1, "
                          f"{size}) g")
            position = Position()
            for _ in range(8):
                words = rng.choice(["fetch", "move"]) + " " + rng.choice(DIRECTIONS).format(n=rng.randint(-9, 9))
                sql = f"{words} from k"
                command = cursor_command(split(sql)[0])
                try:
                    cur = truth.execute(sql)
                    expected = ([row[0] - 1 for row in cur.fetchall()] if cur.description else [],
                                int(cur.statusmessage.split()[-1]))
                except psycopg.errors.ObjectNotInPrerequisiteState:
                    expected = None
                try:
                    position, rows, count = run(command, size, scroll, position)
                    got = (rows if not command.move else [], count)
                except Exception:  # NoScroll
                    got = None
                assert got == expected, sql
                if expected is None:
                    break
            truth.execute("rollback")


# -- gated cursors, simple protocol --------------------------------------------------------------------------


def test_declare_fetch_close_in_a_transaction(reporter: psycopg.Connection, released: list[tuple[str, int]]) -> None:
    with reporter.transaction():
        cur = reporter.execute(f"declare c cursor for {QUERY}")
        assert cur.statusmessage == "DECLARE CURSOR"
        cur = reporter.execute("fetch 3 from c")
        assert cur.statusmessage == "FETCH 3"
        assert [d.name for d in cur.description] == ["education", "n"]
        first = cur.fetchall()
        cur = reporter.execute("fetch all in c")
        rest = cur.fetchall()
        assert cur.statusmessage == f"FETCH {len(rest)}"
        released_rows = [row for row in first + rest if row[0] is not None]
        assert released_rows == released
        assert reporter.execute("fetch next from c").fetchall() == []
        assert reporter.execute("move forward all in c").statusmessage == "MOVE 0"
        assert reporter.execute("close c").statusmessage == "CLOSE CURSOR"
        assert sqlstate(reporter, "fetch c") == "34000"  # PostgreSQL: the cursor does not exist (any more)


def test_without_hold_outside_a_transaction_block_is_refused(reporter: psycopg.Connection) -> None:
    assert sqlstate(reporter, f"declare c cursor for {QUERY}") == "25P01"
    assert sqlstate(reporter, "declare c cursor for select relname from pg_class") == "25P01"


def test_with_hold_survives_commit_and_without_hold_does_not(reporter: psycopg.Connection,
                                                           released: list[tuple[str, int]]) -> None:
    with reporter.transaction():
        reporter.execute(f"declare held cursor with hold for {QUERY}")
        reporter.execute(f"declare gone cursor without hold for {QUERY}")
    rows = [row for row in reporter.execute("fetch all from held").fetchall() if row[0] is not None]
    assert rows == released
    assert sqlstate(reporter, "fetch all from gone") == "34000"
    reporter.execute("close held")


def test_rollback_ends_a_with_hold_cursor_it_declared(reporter: psycopg.Connection) -> None:
    reporter.execute(f"declare before cursor with hold for {QUERY}")  # committed at once
    reporter.execute("begin")
    reporter.execute(f"declare during cursor with hold for {QUERY}")
    reporter.execute("rollback")
    assert sqlstate(reporter, "fetch from during") == "34000"
    assert reporter.execute("fetch from before").fetchall()
    reporter.execute("close before")
