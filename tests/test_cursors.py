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
import pyodbc
import pytest
from conftest import Endpoint, Up, free_port, fresh_dp_role
from test_rewrite import POLICY, SUPPRESS

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.statements import split
from anonproxy.proxy.cursors import MAX_CURSOR_ROWS, Cursors, NoScroll, Position, run
from anonproxy.proxy.gate import Gate
from anonproxy.route.commands import cursor_command
from anonproxy.route.decide import decide
from anonproxy.route.decision import (
    CloseCursor,
    DeclareCursor,
    FetchCursor,
    Pass,
    Rewrite,
    Script,
)
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer
from anonproxy.wire.results import Column, Result

K = 10
QUERY = "select education, count(*) as n from adult group by education order by education"
_names = itertools.count(1)


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


def in_savepoint(conn: psycopg.Connection, sql: str) -> str | None:
    """The SQLSTATE of ``sql`` run in a savepoint (PostgreSQL's errors abort the savepoint, not the transaction)."""
    try:
        with conn.transaction():
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
                except NoScroll:
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


# -- psqlODBC in declare/fetch mode (Tableau's driver), for real ------------------------------------------------


def odbc(proxy: Endpoint, dbname: str, user: str, **options: object) -> pyodbc.Connection:
    settings = {"DRIVER": "{PostgreSQL Unicode}", "SERVER": proxy.host, "PORT": proxy.port, "DATABASE": dbname,
                "UID": user, "PWD": user, "UseDeclareFetch": 1, "Fetch": 4, "SSLMode": "disable", **options}
    return pyodbc.connect(";".join(f"{key}={value}" for key, value in settings.items()), autocommit=True)


def test_psqlodbc_declare_fetch_mode(gated_proxy: Endpoint, gated_database: str,
                                     released: list[tuple[str, int]]) -> None:
    conn = odbc(gated_proxy, gated_database, "reporter")
    try:
        rows = conn.cursor().execute(QUERY).fetchall()  # 4 rows a FETCH: several round trips
        assert [tuple(row) for row in rows if row[0] is not None] == released
        tables = [row.table_name for row in conn.cursor().tables(schema="public")]
        assert "adult" in tables
    finally:
        conn.close()


def test_tableau_driver_through_anonproxy_up() -> None:
    """`anonproxy up`, then psqlODBC in declare/fetch mode (Tableau's driver and mode) as reporter and analyst."""
    port = free_port()
    up = Up("--port", str(port))
    try:
        server = Endpoint("127.0.0.1", port)
        for role in ("reporter", "analyst"):
            conn = odbc(server, "postgres", role, Fetch=2048)
            try:
                rows = conn.cursor().execute("select sex, count(*) from adult group by sex").fetchall()
            finally:
                conn.close()
            assert sorted(row[0] for row in rows) == ["Female", "Male"], role
    finally:
        up.stop()


def test_psqlodbc_sequence_as_sent(reporter: psycopg.Connection, released: list[tuple[str, int]]) -> None:
    """The exact messages psqlODBC 16 sent in UseDeclareFetch mode (from its CommLog), replayed."""
    name = '"SQL_CUR0x556342d4ecc0"'
    cur = reporter.execute(f"BEGIN;declare {name} cursor with hold for {QUERY};fetch 4 in {name}")
    statuses = [cur.statusmessage]
    while cur.nextset():
        statuses.append(cur.statusmessage)
    assert statuses == ["BEGIN", "DECLARE CURSOR", "FETCH 4"]
    rows = cur.fetchall()
    assert reporter.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    cur = reporter.execute(f"SAVEPOINT _EXEC_SVP_0x556342bd1730;fetch 4 in {name}")
    cur.nextset()
    rows += cur.fetchall()
    while batch := reporter.execute(f"fetch 4 in {name}").fetchall():
        rows += batch
    assert [row for row in rows if row[0] is not None] == released
    cur = reporter.execute(f"close {name};commit")
    assert cur.statusmessage == "CLOSE CURSOR"
    cur.nextset()
    assert cur.statusmessage == "COMMIT"
    assert reporter.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert sqlstate(reporter, f"fetch 4 in {name}") == "34000"


def test_psqlodbc_in_dp_mode_is_charged_once(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection,
                                            dp_role: str) -> None:
    conn = odbc(gated_proxy, gated_database, dp_role)
    try:
        before = conn.cursor().execute("show anonproxy.budget").fetchone()[0]
        rows = conn.cursor().execute("select education, count(*) from adult group by education").fetchall()
        after = conn.cursor().execute("show anonproxy.budget").fetchone()[0]
    finally:
        conn.close()
    assert len(rows) == 16  # the declared public domain of education, fetched 4 at a time
    spent = truth.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", [dp_role]).fetchone()[0]
    assert spent == 1
    assert before != after


@pytest.fixture
def dp_role(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A fresh dp role with ε 2 in all, 0.5 per query, on public.adult."""
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_cursor_{next(_names)}") as role:
        yield role


def test_dp_cursor_keeps_the_charged_answer(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection,
                                           dp_role: str) -> None:
    notices: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=dp_role), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        with conn.transaction():
            conn.execute("declare c scroll cursor for select sex, count(*) from adult group by sex order by sex")
            assert any("differentially private" in n for n in notices)
            forward = conn.execute("fetch all from c").fetchall()
            backward = conn.execute("fetch backward all from c").fetchall()
            assert backward == forward[::-1]
            assert conn.execute("fetch absolute 2 from c").fetchall() == forward[1:2]
    charges = truth.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", [dp_role])
    assert charges.fetchone() == (1,)


# -- extended protocol ------------------------------------------------------------------------------------------


def test_asyncpg_fetch_move_close_in_binary(gated_proxy: Endpoint, gated_database: str,
                                            released: list[tuple[str, int]]) -> None:
    """asyncpg sends FETCH through Parse / Bind / Execute and asks for binary results."""
    async def scenario() -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            async with conn.transaction():
                await conn.execute(f"declare c scroll cursor for {QUERY}")
                first = await conn.fetch("fetch 2 from c")  # extended protocol, binary results
                assert await conn.execute("move forward 1 in c") == "MOVE 1"
                rest = await conn.fetch("fetch all from c")
                back = await conn.fetch("fetch prior from c")
                assert back == rest[-1:]
                await conn.execute("close c")
                with pytest.raises(asyncpg.InvalidCursorNameError):
                    await conn.fetch("fetch 1 from c")
            whole = await conn.fetch(QUERY)  # the same answer, without a cursor
            assert [tuple(r) for r in first + rest] == [tuple(r) for r in whole[:2] + whole[3:]]
            assert [tuple(r) for r in whole if r[0] is not None] == released
        finally:
            await conn.close()

    asyncio.run(scenario())


# -- attacks ---------------------------------------------------------------------------------------------------

ROW_LEVEL = [
    "select * from adult",
    "select age from adult where id = 17",
    "select count(*) from adult where case when id = 17 and income = '>50K' then 1/0 else 1 end = 1",
    "select sex, sum(capital_gain * 100000000) from adult group by sex",
    "select (select age from adult where id = 17)",
]


@pytest.mark.parametrize("query", ROW_LEVEL)
def test_declare_gets_the_refusal_of_its_query(reporter: psycopg.Connection, query: str) -> None:
    """A cursor is not a new channel: its query is refused exactly as when sent alone; FETCH finds no cursor."""
    plain = sqlstate(reporter, query)
    assert plain in ("42501", "0A000")
    with reporter.transaction():
        assert in_savepoint(reporter, f"declare c cursor for {query}") == plain  # (the refusal fails the block)
        assert sqlstate(reporter, "fetch all from c") == "34000"  # PostgreSQL never saw a cursor c
    assert sqlstate(reporter, f'BEGIN;declare "SQL_CUR1" cursor with hold for {query};fetch 100 in "SQL_CUR1"') \
        == plain
    reporter.execute("rollback")


def test_direct_cursor_over_a_protected_table_is_denied(pg_server: EmbeddedPostgres, gated_database: str) -> None:
    """Bypassing the proxy, the role's own cursors over protected tables fail inside PostgreSQL."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database, user="reporter", password="reporter")) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("declare c cursor with hold for select age from adult")


def test_no_scroll_cursor_refuses_backward_moves(reporter: psycopg.Connection) -> None:
    with reporter.transaction():
        reporter.execute(f"declare c cursor for {QUERY}")
        reporter.execute("fetch 2 from c")
        assert sqlstate(reporter, "fetch prior from c") == "55000"
    with reporter.transaction():
        reporter.execute(f"declare c no scroll cursor for {QUERY}")
        reporter.execute("fetch 2 from c")
        for command in ("fetch backward 1 from c", "move absolute 1 in c", "fetch first from c",
                        "fetch relative -1 from c", "fetch last from c"):
            assert in_savepoint(reporter, command) == "55000", command
        assert reporter.execute("fetch absolute 3 from c").fetchall()  # forward: allowed


def test_cursor_names_fold_and_collide_as_postgresql_s(reporter: psycopg.Connection) -> None:
    with reporter.transaction():
        reporter.execute("declare catalog cursor for select relname from pg_class")  # passed through
        assert in_savepoint(reporter, f"declare CATALOG cursor for {QUERY}") == "42P03"
        reporter.execute(f"declare Held cursor for {QUERY}")
        assert in_savepoint(reporter, "declare held cursor for select relname from pg_class") == "42P03"
        assert in_savepoint(reporter, f'declare "held" cursor for {QUERY}') == "42P03"
        reporter.execute(f'declare "Held" cursor for {QUERY}')  # another name
        assert reporter.execute('fetch 1 from "Held"').fetchall() == reporter.execute("fetch 1 from HELD").fetchall()
        assert reporter.execute("fetch 1 from catalog").fetchall()  # still PostgreSQL's own


def test_close_all_closes_held_and_passed_cursors(reporter: psycopg.Connection) -> None:
    with reporter.transaction():
        reporter.execute("declare catalog cursor for select relname from pg_class")
        reporter.execute(f"declare held cursor for {QUERY}")
        assert reporter.execute("close all").statusmessage == "CLOSE CURSOR ALL"
        for name in ("held", "catalog"):
            assert in_savepoint(reporter, f"fetch from {name}") == "34000"


def test_fetch_after_close(reporter: psycopg.Connection) -> None:
    reporter.execute(f"declare c cursor with hold for {QUERY}")
    reporter.execute("close c")
    assert sqlstate(reporter, "fetch from c") == "34000"
    assert sqlstate(reporter, "close c") == "34000"


def test_cursor_in_an_aborted_transaction(reporter: psycopg.Connection) -> None:
    reporter.execute(f"declare kept cursor with hold for {QUERY}")
    reporter.execute("begin")
    reporter.execute(f"declare inside cursor for {QUERY}")
    assert sqlstate(reporter, "select 1/0") == "22012"
    for command in ("fetch from kept", "fetch from inside", "move next in kept", f"declare other cursor for {QUERY}",
                    "close kept"):
        assert sqlstate(reporter, command) == "25P02", command
    reporter.execute("rollback")
    assert sqlstate(reporter, "fetch from inside") == "34000"
    assert reporter.execute("fetch from kept").fetchall()  # WITH HOLD, committed before: survives the rollback
    reporter.execute("close kept")


def test_script_error_skips_the_rest(reporter: psycopg.Connection) -> None:
    """In one message, a failing statement ends it, as in PostgreSQL; the implicit block allows WITHOUT HOLD."""
    cur = reporter.execute(f"declare c cursor for {QUERY};fetch 2 from c")
    cur.nextset()
    assert len(cur.fetchall()) == 2
    assert sqlstate(reporter, "fetch from c") == "34000"  # gone with the message's implicit transaction
    assert sqlstate(reporter, f"declare c cursor with hold for {QUERY};fetch prior from c;fetch 1 from c") == "55000"
    assert sqlstate(reporter, "fetch from c") == "34000"  # the failed message's transaction rolled back


def test_row_cap() -> None:
    rows = tuple((str(i).encode(),) for i in range(MAX_CURSOR_ROWS + 1))
    answer = Cursors().declare(DeclareCursor("c", Rewrite("")), Result((Column("n", 20),), rows), committed=False)
    assert answer[:1] == b"E" and b"54000" in answer and b"at most" in answer


def test_psql(gated_proxy: Endpoint, gated_database: str, released: list[tuple[str, int]]) -> None:
    script = f"begin;\ndeclare c binary scroll cursor for {QUERY};\nclose c;\n" \
             f"declare c scroll cursor for {QUERY};\nmove last in c;\nfetch backward 2 from c;\ncommit;\n"
    psql = shutil.which("psql") or "/usr/bin/psql"
    out = subprocess.run([psql, "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", gated_proxy.url(gated_database, "reporter")],
                         input=script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:5] == ["BEGIN", "DECLARE CURSOR", "CLOSE CURSOR", "DECLARE CURSOR", "MOVE 1"]
    # The two rows before the last (every education group holds at least k people: no suppressed rest row).
    assert lines[5:] == [f"{education}|{n}" for education, n in reversed(released[-3:-1])] + ["COMMIT"]


# -- classification ------------------------------------------------------------------------------------------


def test_classification() -> None:
    declare = decide('DECLARE "SQL_CUR0x1" binary scroll CURSOR WITH HOLD FOR SELECT count(*) FROM adult', SUPPRESS,
                     POLICY)
    assert isinstance(declare, DeclareCursor) and isinstance(declare.query, Rewrite)
    assert (declare.name, declare.binary, declare.scroll, declare.hold) == ("SQL_CUR0x1", True, True, True)
    assert decide("declare c cursor for select relname from pg_class", SUPPRESS, POLICY) == DeclareCursor("c", Pass())
    assert decide("FETCH 100 FROM C", SUPPRESS, POLICY) == FetchCursor("c", "forward", 100)
    assert decide("move backward all in c", SUPPRESS, POLICY) == FetchCursor("c", "backward", None, move=True)
    assert decide("fetch last c", SUPPRESS, POLICY) == FetchCursor("c", "absolute", -1)
    assert decide("fetch -3 from c", SUPPRESS, POLICY) == FetchCursor("c", "forward", -3)
    assert decide("CLOSE ALL", SUPPRESS, POLICY) == CloseCursor(None)
    script = decide('BEGIN;declare "x" cursor for select count(*) from adult;fetch 100 in "x"', SUPPRESS, POLICY)
    assert isinstance(script, Script) and [type(d).__name__ for _, d in script.parts] == \
        ["Pass", "DeclareCursor", "FetchCursor"]
    for bad, state in [("fetch 3000000000 from c", "42601"), ("fetch next c d", "42601"),
                       ("declare c scroll no scroll cursor for select 1", "42P11"),
                       ("declare c cursor for insert into t values (1)", "42501"),
                       ("begin; declare c cursor for select count(*) from adult; show anonproxy.k", "0A000")]:
        decision = decide(bad, SUPPRESS, POLICY)
        assert getattr(decision, "sqlstate", None) == state, (bad, decision)


def test_psycopg_server_side_cursor(reporter: psycopg.Connection, released: list[tuple[str, int]]) -> None:
    """psycopg's named cursors: DECLARE through the extended protocol, Describe of the cursor's portal, FETCH FORWARD n
    (binary too), and a parameter bound into the gated query."""
    with reporter.transaction():
        with reporter.cursor("named") as cur:
            cur.itersize = 3
            cur.execute("select education, count(*) as n from adult where age > %s group by education "
                        "order by education", [0])
            assert [d.name for d in cur.description] == ["education", "n"]
            rows = [row for row in cur if row[0] is not None]
        assert rows == released
        with reporter.cursor("binary_named", binary=True) as cur:
            cur.execute(QUERY)
            assert [row for row in cur.fetchmany(100) if row[0] is not None] == released


def test_pipelined_messages_around_a_script(gated_proxy: Endpoint, gated_database: str) -> None:
    """Queries sent before a multi-statement cursor message is answered keep their own answers (libpq pipeline)."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        with conn.pipeline():
            first = conn.execute("select 1")
            conn.execute("begin")
            script = conn.execute(f"declare c cursor for {QUERY}", prepare=False)
            fetch = conn.execute("fetch 2 from c")
            last = conn.execute("select 2")
        assert first.fetchone() == (1,) and last.fetchone() == (2,)
        assert script.statusmessage == "DECLARE CURSOR" and len(fetch.fetchall()) == 2
        conn.execute("rollback")


def test_script_waits_for_earlier_answers() -> None:
    """The sans-I/O gate: a Query sent before a multi-statement cursor message keeps its own ReadyForQuery, and the
    message's parts go one by one, the client seeing one ReadyForQuery for them."""
    client, upstream, service = bytearray(), [], []
    gate = Gate(lambda sql: decide(sql, SUPPRESS, POLICY), dict, client.extend, upstream.append, service.append,
                lambda request: None)
    gate.client_data(pg.query_message("select 1") + pg.query_message(
        "begin;declare c cursor for select count(*) from adult;fetch 1 from c"))
    assert upstream == [pg.query_message("select 1")] and service == []
    for message in (pg.row_description(["?column?"], [23]), pg.data_row(["1"]), pg.command_complete("SELECT 1"),
                    pg.ready_for_query(b"I")):
        for type_, body in MessageBuffer().feed(message):
            gate.upstream_message(type_, body)
    assert upstream[1:] == [pg.query_message("begin")]
    for message in (pg.command_complete("BEGIN"), pg.ready_for_query(b"T")):
        for type_, body in MessageBuffer().feed(message):
            gate.upstream_message(type_, body)
    assert len(service) == 1 and service[0][:1] == b"Q" and b"count" in service[0]
    for message in (pg.row_description(["count"], [20]), pg.data_row(["32561"]), pg.command_complete("SELECT 1"),
                    pg.ready_for_query(b"I")):
        for type_, body in MessageBuffer().feed(message):
            gate.service_message(type_, body)
    answers = [(type_, body) for type_, body in MessageBuffer().feed(bytes(client))]
    assert [type_ for type_, _ in answers] == [b"T", b"D", b"C", b"Z", b"C", b"C", b"T", b"D", b"C", b"Z"]
    assert [body for type_, body in answers if type_ == b"C"] == [b"SELECT 1\0", b"BEGIN\0", b"DECLARE CURSOR\0",
                                                                    b"FETCH 1\0"]
    assert answers[-1][1] == b"T"


def test_dp_declare_of_a_refused_query_is_refused_and_free(gated_proxy: Endpoint, gated_database: str,
                                                          truth: psycopg.Connection, dp_role: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=dp_role), autocommit=True) as conn:
        for query in ("select age from adult where id = 17", "select count(*) from adult where 1/(age - 40) > 0"):
            plain = sqlstate(conn, query)
            assert plain is not None
            with conn.transaction():
                assert in_savepoint(conn, f"declare c cursor for {query}") == plain
                assert sqlstate(conn, "fetch all from c") == "34000"
            assert sqlstate(conn, f'BEGIN;declare "SQL_CUR2" cursor with hold for {query};fetch 10 in "SQL_CUR2"') \
                == plain
            conn.execute("rollback")
    charges = truth.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", [dp_role]).fetchone()
    assert charges == (0,)
