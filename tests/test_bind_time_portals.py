"""Portals of a statement decided at Bind stay valid while the client binds it again for other values.

A statement with ``$n`` where the plan needs a constant (anonproxy/proxy/bind_time.py) is prepared for each value
class it is bound with. Drivers bind one prepared statement twice before executing (a batch of Bind/Execute
pairs, named portals open together: JDBC's fetch size, pipelines): each portal must still answer for its own
values, as the same SQL written with those values as constants does through the proxy.

A suppress portal read with a row limit, or in a later batch than its Bind, is kept by the proxy (its service
connection's portal ends at each Sync: docs/proxy.md, "Portals read a few rows at a time"): it answers with the
bytes PostgreSQL sends for the same portal, and lives as long as PostgreSQL's would.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import asyncpg
import psycopg
import pytest
from conftest import SERVICE_ROLE, Endpoint, fresh_dp_role, start_proxy, stop_proxy
from test_clients import jdbc_jar

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg
from anonproxy.wire.auth import PasswordAuthenticator
from anonproxy.wire.framing import MessageBuffer

CONTAINS = "select count(*) from adult where occupation ilike $1"
BY_PATTERN = "select sex, count(*) from adult where occupation ilike $1 group by sex order by 1"
OLDER = "select sex, count(*) from adult where age > $1 group by sex order by 1"  # decided at Parse
PATTERNS = ("%sales%", "%tech%", "%craft%", "%e%")


class RawClient:
    """A client speaking the extended protocol message by message (SCRAM login through anonproxy.wire.auth)."""

    def __init__(self, endpoint: Endpoint, database: str, user: str) -> None:
        self.sock = socket.create_connection((endpoint.host, endpoint.port), timeout=30)
        self.messages = MessageBuffer()
        self.pending: list[tuple[bytes, bytes]] = []
        self.sock.sendall(pg.startup_message({"user": user, "database": database, "client_encoding": "UTF8"}))
        auth = PasswordAuthenticator(user, user)
        while (message := self.receive())[0] != b"Z":
            if message[0] == b"R":
                self.sock.sendall(auth.respond(message[1]))

    def receive(self) -> tuple[bytes, bytes]:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the proxy closed the connection")
            self.pending.extend(self.messages.feed(data))
        return self.pending.pop(0)

    def batch(self, *messages: bytes) -> list[tuple[bytes, bytes]]:
        """Send ``messages`` and a Sync; the answers up to ReadyForQuery."""
        self.sock.sendall(b"".join(messages) + pg.message(b"S"))
        answers = []
        while (answer := self.receive())[0] != b"Z":
            answers.append(answer)
        return answers

    def close(self) -> None:
        self.sock.sendall(pg.message(b"X"))
        self.sock.close()


def parse(statement: bytes, sql: str) -> bytes:
    return pg.message(b"P", statement + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def bind(portal: bytes, statement: bytes, value: str) -> bytes:
    encoded = value.encode()
    return pg.message(b"B", portal + b"\0" + statement + b"\0" + struct.pack("!hhi", 0, 1, len(encoded)) + encoded
                      + struct.pack("!h", 0))


def execute(portal: bytes, rows: int = 0) -> bytes:
    return pg.message(b"E", portal + b"\0" + struct.pack("!i", rows))


def results(answers: list[tuple[bytes, bytes]]) -> list[list[tuple[str | None, ...]]]:
    """The rows of each Execute (text format), in order; an error fails with its fields."""
    out: list[list[tuple[str | None, ...]]] = [[]]
    for type_, body in answers:
        assert type_ != b"E", pg.parse_fields(body)
        if type_ == b"D":
            out[-1].append(_row(body))
        elif type_ in (b"C", b"s"):  # CommandComplete, PortalSuspended: that Execute is done
            out.append([])
    return out[:-1]


def _row(body: bytes) -> tuple[str | None, ...]:
    (count,), offset, values = struct.unpack_from("!h", body), 2, []
    for _ in range(count):
        (length,) = struct.unpack_from("!i", body, offset)
        offset += 4
        values.append(None if length < 0 else body[offset:offset + length].decode())
        offset += max(length, 0)
    return tuple(values)


def constant(sql: str, value: str) -> str:
    return sql.replace("$1", "'" + value.replace("'", "''") + "'")


def as_constants(proxy: Endpoint, database: str, role: str, sql: str) -> list[tuple[str | None, ...]]:
    """The rows of ``sql`` (constants, simple Query) through the proxy, as text."""
    with psycopg.connect(proxy.dsn(database, user=role), autocommit=True) as conn:
        rows: list[Any] = conn.execute(psycopg.sql.SQL(sql)).fetchall()  # type: ignore[arg-type]  # test text
    return [tuple(None if value is None else str(value) for value in row) for row in rows]


def test_two_portals_of_one_statement_bound_before_either_runs(gated_proxy: Endpoint, gated_database: str) -> None:
    """Parse, Bind p1 (one value), Bind p2 (another), Execute p1, Execute p2, Sync: each answers for its value."""
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        for sql in (CONTAINS, BY_PATTERN):
            answers = client.batch(parse(b"s", sql), bind(b"p1", b"s", PATTERNS[0]), bind(b"p2", b"s", PATTERNS[1]),
                                   execute(b"p1"), execute(b"p2"), pg.message(b"C", b"Ss\0"))
            expected = [as_constants(gated_proxy, gated_database, "reporter", constant(sql, value))
                        for value in PATTERNS[:2]]
            assert results(answers) == expected, sql
    finally:
        client.close()



def test_portals_outlive_the_close_of_their_statement(gated_proxy: Endpoint, gated_database: str) -> None:
    """Bind two values, Close the statement, Execute both portals (PostgreSQL keeps them): each answers for its
    value; the name is free for another statement afterwards."""
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        answers = client.batch(parse(b"s", BY_PATTERN), bind(b"p1", b"s", PATTERNS[0]), bind(b"p2", b"s", PATTERNS[1]),
                               pg.message(b"C", b"Ss\0"), execute(b"p1"), execute(b"p2"))
        expected = [as_constants(gated_proxy, gated_database, "reporter", constant(BY_PATTERN, value))
                    for value in PATTERNS[:2]]
        assert results(answers) == expected
        again = client.batch(parse(b"s", CONTAINS), bind(b"", b"s", PATTERNS[2]), execute(b""))
        assert results(again) == [as_constants(gated_proxy, gated_database, "reporter",
                                               constant(CONTAINS, PATTERNS[2]))]
    finally:
        client.close()

def test_many_portals_open_read_a_row_at_a_time(gated_proxy: Endpoint, gated_database: str) -> None:
    """Four portals of one statement, each for its own value, read one row at a time, interleaved (as JDBC's
    fetch size reads several open cursors), then the statement bound again for the first value."""
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        names = [f"c{number}".encode() for number in range(len(PATTERNS))]
        messages = [parse(b"s", BY_PATTERN)]
        messages += [bind(name, b"s", value) for name, value in zip(names, PATTERNS)]
        for _ in range(2):  # the two groups of each answer, a row per Execute
            messages += [execute(name, 1) for name in names]
        messages += [execute(name, 1) for name in names]  # each portal's end
        messages += [bind(b"", b"s", PATTERNS[0]), execute(b"")]
        got = results(client.batch(*messages))
        expected = {value: as_constants(gated_proxy, gated_database, "reporter", constant(BY_PATTERN, value))
                    for value in PATTERNS}
        for index, value in enumerate(PATTERNS):
            rows = [row for step in range(3) for row in got[step * len(PATTERNS) + index]]
            assert rows == expected[value], value
        assert got[-1] == expected[PATTERNS[0]]
        # The statement and its portals keep working in the next batch.
        assert results(client.batch(bind(b"p", b"s", PATTERNS[2]), execute(b"p"))) == [expected[PATTERNS[2]]]
    finally:
        client.close()




def test_a_pipeline_binds_one_statement_for_several_values(gated_proxy: Endpoint, gated_database: str) -> None:
    """psycopg's pipeline mode, the statement prepared on the server, values bound in binary format and text,
    alternating: each answer is that of its constants."""
    expected = {value: as_constants(gated_proxy, gated_database, "reporter", constant(BY_PATTERN, value))
                for value in PATTERNS}
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        sql = BY_PATTERN.replace("$1", "%s")
        with conn.pipeline():
            cursors = [(value, conn.execute(sql, [value], prepare=True, binary=binary))
                       for binary in (True, False) for value in PATTERNS + PATTERNS[::-1]]
        for value, cursor in cursors:
            assert [tuple(str(field) for field in row) for row in cursor.fetchall()] == expected[value], value


def test_dp_portals_of_one_statement_keep_their_values(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                       gated_database: str) -> None:
    """asyncpg cursors of one prepared statement in a transaction, in dp mode: two portals open at once, read a row
    at a time, interleaved; each answers the groups of its own value, as the constants do."""
    async def read(role: str) -> list[list[str]]:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                     database=gated_database)
        try:
            async with conn.transaction():
                statement = await conn.prepare(BY_PATTERN)
                first, second = await statement.cursor(PATTERNS[0]), await statement.cursor(PATTERNS[1])
                rows = [await first.fetch(1), await second.fetch(1), await first.fetch(5), await second.fetch(5)]
        finally:
            await conn.close()
        return [[row["sex"] for row in part] for part in rows]

    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "portal_analyst", epsilon=4) as role:
        got = asyncio.run(read(role))
        keys = {value: [row[0] for row in as_constants(gated_proxy, gated_database, role,
                                                       constant(BY_PATTERN, value))] for value in PATTERNS[:2]}
    assert got[0] + got[2] == keys[PATTERNS[0]] and got[1] + got[3] == keys[PATTERNS[1]]
    assert len(keys[PATTERNS[0]]) == 2


@pytest.mark.parametrize(("sql", "value"), [(BY_PATTERN, PATTERNS[0]), (OLDER, "40")])
def test_suppress_portals_across_syncs_in_a_transaction(gated_proxy: Endpoint, gated_database: str, sql: str,
                                                        value: str) -> None:
    """asyncpg cursors in a transaction as the reporter: each Bind and Execute is its own batch, and the rewritten
    statement runs on a service connection, whose portals end at each Sync; the proxy keeps the answer of a portal
    read with a row limit. Decided at Bind or not, two cursors open at once, read a row at a time, interleaved, answer
    what the same SQL with constants does."""
    async def read() -> list[list[tuple[str, ...]]]:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            async with conn.transaction():
                statement = await conn.prepare(sql)
                arguments = (int(value),) if sql == OLDER else (value,)
                first, second = await statement.cursor(*arguments), await statement.cursor(*arguments)
                parts = [await first.fetch(1), await second.fetch(2), await first.fetch(1), await first.fetch(5),
                         await second.fetch(5)]
            return [[tuple(str(field) for field in row) for row in part] for part in parts]
        finally:
            await conn.close()

    expected = as_constants(gated_proxy, gated_database, "reporter", constant(sql, value))
    parts = asyncio.run(read())
    assert len(expected) == 2
    assert parts[0] + parts[2] + parts[3] == expected and parts[1] + parts[4] == expected


def test_postgresql_keeps_a_portal_whose_statement_is_prepared_again(gated_proxy: Endpoint,
                                                                      gated_database: str) -> None:
    """What the re-preparing relies on, on PostgreSQL itself (dba: relayed): a portal outlives the Close of its
    statement and a new Parse under the same name, and still runs what it was bound to."""
    client = RawClient(gated_proxy, gated_database, "dba")
    try:
        answers = client.batch(parse(b"s", "select $1::text"), bind(b"p1", b"s", "a"), pg.message(b"C", b"Ss\0"),
                               parse(b"s", "select $1::text || '!'"), bind(b"p2", b"s", "b"),
                               execute(b"p1"), execute(b"p2"))
        assert results(answers) == [[("a",)], [("b!",)]]
    finally:
        client.close()


def jdbc_portals(proxy: Endpoint, database: str, role: str, fetch_size: int = 1) -> list[tuple[str, ...]]:
    """The lines of tests/clients/JdbcPortals.java run as ``role`` for the first two patterns."""
    java = shutil.which("java")
    assert java, "java (17+) is required for the JDBC client test"
    source = Path(__file__).parent / "clients" / "JdbcPortals.java"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(source), proxy.host, str(proxy.port), database, role,
                           *PATTERNS[:2], str(fetch_size)], check=False, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, f"JdbcPortals failed:\n{done.stdout}\n{done.stderr}"
    return [tuple(line.split("|", 2)) for line in done.stdout.splitlines()]


def test_jdbc_fetch_size_in_dp(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> None:
    """JDBC, two result sets of one statement read a row at a time, interleaved, in a transaction (dp mode): each
    answers the groups of its own value."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "jdbc_portal_analyst", epsilon=4) as role:
        lines = jdbc_portals(gated_proxy, gated_database, role)
        keys = {value: [row[0] for row in as_constants(gated_proxy, gated_database, role,
                                                       constant(BY_PATTERN, value))] for value in PATTERNS[:2]}
    for value in PATTERNS[:2]:
        assert [line[1] for line in lines if line[0] == value] == keys[value], lines


@pytest.mark.parametrize("fetch_size", [1, 2])
def test_jdbc_fetch_size_in_suppress(gated_proxy: Endpoint, gated_database: str, fetch_size: int) -> None:
    """The same as the reporter (suppress), with a fetch size of 1 and 2, autocommit off: each result set answers
    the groups of its own value, as the constants do."""
    lines = jdbc_portals(gated_proxy, gated_database, "reporter", fetch_size)
    assert all(line[0] in PATTERNS[:2] for line in lines), lines  # no "error" line
    for value in PATTERNS[:2]:
        expected = as_constants(gated_proxy, gated_database, "reporter", constant(BY_PATTERN, value))
        assert [tuple(line[1:]) for line in lines if line[0] == value] == expected, lines


def query(text: str) -> bytes:
    return pg.message(b"Q", text.encode() + b"\0")


def simple(client: RawClient, text: str) -> list[tuple[bytes, bytes]]:
    """Send a Query; its answers up to ReadyForQuery, which is included."""
    client.sock.sendall(query(text))
    answers = []
    while (answer := client.receive())[0] != b"Z":
        answers.append(answer)
    return answers + [answer]


def portal_read(endpoint: Endpoint, database: str, role: str, sql: str, value: str, max_rows: int,
                end: str) -> list[list[tuple[bytes, bytes]]]:
    """In a transaction: a portal bound and executed with ``max_rows``, then in batches of their own, Executes until
    its CommandComplete and one more, a Describe, then ``end`` ("close": its Close; "commit": COMMIT and a new
    transaction), and an Execute of the portal. The answers of each batch (ReadyForQuery dropped)."""
    client = RawClient(endpoint, database, role)
    try:
        simple(client, "BEGIN")
        batches = [client.batch(parse(b"s", sql), bind(b"p", b"s", value), execute(b"p", max_rows))]
        while not any(type_ == b"C" for type_, _ in batches[-1]):
            assert len(batches) < 10, batches
            batches.append(client.batch(execute(b"p", max_rows)))
        batches.append(client.batch(execute(b"p", max_rows)))  # a portal at its end: SELECT 0
        batches.append(client.batch(pg.message(b"D", b"Pp\0")))
        if end == "close":
            batches.append(client.batch(pg.message(b"C", b"Pp\0")))
        else:
            batches.append(simple(client, "COMMIT")[:-1])
            simple(client, "BEGIN")
        batches.append(client.batch(execute(b"p", max_rows)))
        simple(client, "ROLLBACK")
        return batches
    finally:
        client.close()


def comparable(batches: list[list[tuple[bytes, bytes]]]) -> list[list[tuple[bytes, object]]]:
    """The answers, byte for byte, but for what tells the two apart without being the portal's: a RowDescription's
    table OIDs and column numbers (the rewrite reads other relations), an error's place in PostgreSQL's source."""
    def one(type_: bytes, body: bytes) -> tuple[bytes, object]:
        if type_ == b"T":
            return type_, [(name, type_oid) for name, type_oid in pg.parse_row_description(body)]
        if type_ == b"E":
            fields = pg.parse_fields(body)
            return type_, (fields["C"], fields["M"])
        return type_, body
    return [[one(type_, body) for type_, body in batch] for batch in batches]


@pytest.mark.parametrize("end", ["close", "commit"])
@pytest.mark.parametrize("max_rows", [1, 2, 3])
@pytest.mark.parametrize(("sql", "value"), [(BY_PATTERN, "%sales%"), (OLDER, "40")])
def test_a_suppress_portal_across_syncs_answers_as_postgresql(gated_proxy: Endpoint, gated_database: str, sql: str,
                                                              value: str, max_rows: int, end: str) -> None:
    """The reporter's portal (its statement decided at Bind, or at Parse), read with a row limit of 1, 2, and more
    than its rows, across Syncs in a transaction, then closed or ended by COMMIT, answers with the bytes PostgreSQL
    sends the dba for the same portal (whose answer releases the same groups): rows, PortalSuspended exactly where
    PostgreSQL sends it, CommandComplete with each Execute's count (SELECT 0 at the end), the RowDescription, the
    CloseComplete, and 34000 once the portal is gone."""
    relayed = as_constants(gated_proxy, gated_database, "dba", constant(sql, value))
    assert as_constants(gated_proxy, gated_database, "reporter", constant(sql, value)) == relayed
    assert len(relayed) == 2
    reporter = portal_read(gated_proxy, gated_database, "reporter", sql, value, max_rows, end)
    dba = portal_read(gated_proxy, gated_database, "dba", sql, value, max_rows, end)
    assert comparable(reporter) == comparable(dba)
    assert reporter[-1][0][0] == b"E" and pg.parse_fields(reporter[-1][0][1])["C"] == "34000"


def test_outside_a_transaction_a_suppress_portal_ends_at_sync(gated_proxy: Endpoint, gated_database: str) -> None:
    """Outside a transaction block, the portal kept for a row limit ends with its batch, as PostgreSQL's does."""
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        first = client.batch(parse(b"s", BY_PATTERN), bind(b"p", b"s", "%sales%"), execute(b"p", 1))
        assert [type_ for type_, _ in first] == [b"1", b"2", b"D", b"s"]
        later = client.batch(execute(b"p", 1))
        assert later[0][0] == b"E" and pg.parse_fields(later[0][1])["C"] == "34000"
        assert results(client.batch(bind(b"p", b"s", "%tech%"), execute(b"p"))) == [
            as_constants(gated_proxy, gated_database, "reporter", constant(BY_PATTERN, "%tech%"))]
    finally:
        client.close()


COUNTRIES = "select native_country, count(*) from adult group by native_country order by 1"


def test_suppressed_rest_and_notice_arrive_once(gated_proxy: Endpoint, gated_database: str) -> None:
    """A suppress answer with withheld groups read a row at a time across Syncs: its rows (the suppressed rest
    among them, once) are those of the same Query, and its NOTICE comes once, after the first row."""
    notices: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        conn.add_notice_handler(lambda diagnostic: notices.append(diagnostic.message_primary or ""))
        expected = [tuple(None if field is None else str(field) for field in row)
                    for row in conn.execute(COUNTRIES).fetchall()]
    assert len(notices) == 1 and "the row with NULL in native_country holds them" in notices[0], notices
    assert [row for row in expected if row[0] is None] == [(None, "12")]  # the suppressed rest
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        simple(client, "BEGIN")
        answers = client.batch(parse(b"", COUNTRIES), pg.message(b"B", b"p\0\0" + struct.pack("!hhh", 0, 0, 0)),
                               execute(b"p", 1))
        assert [type_ for type_, _ in answers] == [b"1", b"2", b"D", b"s", b"N"]
        while answers[-1][0] != b"C":
            answers += client.batch(execute(b"p", 1))
        simple(client, "COMMIT")
    finally:
        client.close()
    rows = [_row(body) for type_, body in answers if type_ == b"D"]
    assert rows == expected
    told = [pg.parse_fields(body)["M"] for type_, body in answers if type_ == b"N"]
    assert told == notices


@pytest.fixture(scope="module")
def small_proxy(pg_server: EmbeddedPostgres, gated_database: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """The proxy keeping at most 1 kB of rows per cursor, or per portal read with a row limit."""
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}",
                        tmp_path_factory.mktemp("small") / "anonproxy.log", workers="1",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}",
                        max_cursor_size="1024", max_session_cursor_size="2048")
    yield proxy.endpoint
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def test_a_kept_portal_over_the_limit_is_refused(small_proxy: Endpoint, gated_database: str) -> None:
    """A portal read with a row limit whose answer is larger than the proxy keeps: 54000, naming the limit, with a
    hint to read without a row limit; the batch is skipped up to Sync, the error fails the transaction block as in
    PostgreSQL, the session goes on and the same statement read without a row limit answers."""
    client = RawClient(small_proxy, gated_database, "reporter")
    try:
        simple(client, "BEGIN")
        padded = f"select education, '{'x' * 100}' as pad, count(*) from adult group by education"  # 16 rows
        answers = client.batch(parse(b"s", padded), pg.message(b"B", b"p\0s\0" + struct.pack("!hhh", 0, 0, 0)),
                               execute(b"p", 1), execute(b"p", 1))
        assert [type_ for type_, _ in answers] == [b"1", b"2", b"E"]
        fields = pg.parse_fields(answers[-1][1])
        assert fields["C"] == "54000" and "1 kB" in fields["M"] and "without a row limit" in fields["H"], fields
        assert simple(client, "ROLLBACK")[-1] == (b"Z", b"I")
        simple(client, "BEGIN")
        rows = client.batch(pg.message(b"B", b"q\0s\0" + struct.pack("!hhh", 0, 0, 0)), execute(b"q"))
        assert [type_ for type_, _ in rows] == [b"2"] + [b"D"] * 16 + [b"C"]
        simple(client, "COMMIT")
    finally:
        client.close()


def test_a_suppress_portal_executed_in_a_later_batch_without_a_row_limit(gated_proxy: Endpoint,
                                                                         gated_database: str) -> None:
    """In a transaction, a portal bound in one batch and executed, without a row limit, in the next: all its rows
    and CommandComplete, as the constants answer (its statement decided at Bind)."""
    client = RawClient(gated_proxy, gated_database, "reporter")
    try:
        simple(client, "BEGIN")
        assert [type_ for type_, _ in client.batch(parse(b"s", BY_PATTERN), bind(b"p", b"s", "%tech%"))] \
            == [b"1", b"2"]
        answers = client.batch(execute(b"p"))
        simple(client, "COMMIT")
    finally:
        client.close()
    assert answers[-1] == (b"C", b"SELECT 2\0")
    assert results(answers) == [as_constants(gated_proxy, gated_database, "reporter",
                                             constant(BY_PATTERN, "%tech%"))]


Step = str | tuple[bytes, ...]  # a Query's text, or a batch of messages (a Sync is added)


def conversation(endpoint: Endpoint, database: str, role: str, steps: list[Step]) -> list[list[tuple[bytes, bytes]]]:
    """The answers to each step: a Query's with its ReadyForQuery (the transaction status), a batch's without (an
    error on the service connection does not fail the client's transaction: docs/proxy.md)."""
    client = RawClient(endpoint, database, role)
    try:
        return [simple(client, step) if isinstance(step, str) else client.batch(*step) for step in steps]
    finally:
        client.close()


def as_postgresql(proxy: Endpoint, database: str, steps: list[Step]) -> list[list[tuple[bytes, object]]]:
    """The reporter's answers to ``steps``, checked against the dba's (PostgreSQL's own, the same groups
    released: asserted), and returned comparable."""
    assert as_constants(proxy, database, "reporter", constant(BY_PATTERN, "%sales%")) \
        == as_constants(proxy, database, "dba", constant(BY_PATTERN, "%sales%"))
    reporter = comparable(conversation(proxy, database, "reporter", steps))
    assert reporter == comparable(conversation(proxy, database, "dba", steps))
    return reporter


def sqlstate(answer: tuple[bytes, object]) -> object:
    """The SQLSTATE of a comparable ErrorResponse."""
    assert answer[0] == b"E", answer
    return cast(tuple[str, str], answer[1])[0]


def test_a_kept_portal_in_a_failed_transaction(gated_proxy: Endpoint, gated_database: str) -> None:
    """After an error in a transaction block, an Execute or a Describe of a kept portal gets 25P02, and so does a
    Bind of its statement (the rest of its batch skipped), as PostgreSQL answers; after ROLLBACK the portal is
    gone (34000)."""
    answers = as_postgresql(gated_proxy, gated_database, [
        "BEGIN", (parse(b"s", BY_PATTERN), bind(b"p", b"s", "%sales%"), execute(b"p", 1)), "select 1/0",
        (execute(b"p", 1),), (pg.message(b"D", b"Pp\0"),), (bind(b"q", b"s", "%sales%"), execute(b"q")), "ROLLBACK",
        (execute(b"p", 1),)])
    assert [sqlstate(answers[step][0]) for step in (3, 4, 5, 7)] == ["25P02", "25P02", "25P02", "34000"]
    assert len(answers[5]) == 1


def test_kept_portals_and_savepoints(gated_proxy: Endpoint, gated_database: str) -> None:
    """ROLLBACK TO SAVEPOINT ends the kept portals bound since the savepoint and keeps the older ones; RELEASE
    SAVEPOINT keeps its portals, which then belong to the level around it; as in PostgreSQL."""
    answers = as_postgresql(gated_proxy, gated_database, [
        "BEGIN", (parse(b"s", BY_PATTERN), bind(b"p1", b"s", "%sales%"), execute(b"p1", 1)),
        "SAVEPOINT a", (bind(b"p2", b"s", "%sales%"), execute(b"p2", 1)),
        "SAVEPOINT b", (bind(b"p3", b"s", "%sales%"), execute(b"p3", 1)), "RELEASE SAVEPOINT b",
        "SAVEPOINT c", "ROLLBACK TO SAVEPOINT c", (execute(b"p3", 1),),  # released into a: kept
        "ROLLBACK TO a", (execute(b"p1", 1),), (execute(b"p2", 1),), "ROLLBACK"])
    assert [type_ for type_, _ in answers[9]] == [b"D", b"s"] and [type_ for type_, _ in answers[11]] == [b"D", b"s"]
    assert sqlstate(answers[12][0]) == "34000"


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
def test_a_transaction_ended_in_the_batch_ends_a_kept_portal(gated_proxy: Endpoint, gated_database: str,
                                                             end: str) -> None:
    """COMMIT or ROLLBACK in the same batch as later Executes of a kept portal (no Sync between) ends the portal
    for them: 34000, as in PostgreSQL."""
    ending = (parse(b"", end), pg.message(b"B", b"\0\0" + struct.pack("!hhh", 0, 0, 0)), execute(b""))
    answers = as_postgresql(gated_proxy, gated_database, [
        "BEGIN", (parse(b"s", BY_PATTERN), bind(b"p", b"s", "%sales%"), execute(b"p", 1)),
        (execute(b"p", 1), *ending, execute(b"p", 1))])
    assert [type_ for type_, _ in answers[2]] == [b"D", b"s", b"1", b"2", b"C", b"E"]
    assert sqlstate(answers[2][5]) == "34000"


def test_a_failed_bind_outside_a_transaction_block(gated_proxy: Endpoint, gated_database: str) -> None:
    """Outside a transaction block, a Bind whose value does not convert fails (22P02; the Execute with a row limit
    after it is skipped), and its portal is gone in the next batch (34000), as in PostgreSQL: it is not run again
    from the failed Bind."""
    answers = as_postgresql(gated_proxy, gated_database, [
        (parse(b"s", OLDER), bind(b"p", b"s", "abc"), execute(b"p", 1)), (execute(b"p", 1),)])
    assert [type_ for type_, _ in answers[0]] == [b"1", b"E"]
    assert sqlstate(answers[0][1]) == "22P02" and sqlstate(answers[1][0]) == "34000"


def commit_pipelined(endpoint: Endpoint, database: str, role: str) -> list[tuple[bytes, object]]:
    """In a transaction, a portal read with a row limit; then, sent at once, a COMMIT Query and a batch executing
    the portal again: the answers to these two, comparable."""
    client = RawClient(endpoint, database, role)
    try:
        simple(client, "BEGIN")
        client.batch(parse(b"s", BY_PATTERN), bind(b"p", b"s", "%sales%"), execute(b"p", 1))
        client.sock.sendall(query("COMMIT") + execute(b"p", 1) + pg.message(b"S"))
        answers = [client.receive()]
        while [type_ for type_, _ in answers].count(b"Z") < 2:
            answers.append(client.receive())
        return comparable([answers])[0]
    finally:
        client.close()


def test_a_commit_query_sent_before_an_execute_ends_a_kept_portal(gated_proxy: Endpoint, gated_database: str) -> None:
    """A COMMIT Query sent with a batch executing a kept portal, before its answer came: the portal is gone for
    that Execute (34000), as in PostgreSQL."""
    answers = commit_pipelined(gated_proxy, gated_database, "reporter")
    assert answers == commit_pipelined(gated_proxy, gated_database, "dba")
    assert [type_ for type_, _ in answers] == [b"C", b"Z", b"E", b"Z"] and sqlstate(answers[2]) == "34000"
