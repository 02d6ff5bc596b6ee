"""Red team, round 14: the protocol layer (anonproxy/proxy/gate*.py, routing, prepared statements and portals, the
service pool, the audit trail, cancel keys) attacked by a reader of the code, through the real gated proxy, with
the wire protocol written by hand where drivers cannot.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg

READ_LIMIT = 60.0  # seconds a message may take to arrive (a bound on a hang, not a timing)
AGGREGATE = "select sex, count(*) from public.adult group by sex order by sex"

Message = tuple[bytes, bytes]


class Raw:
    """A session that logged in with psycopg and then speaks the wire protocol by hand on the same socket."""

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.sock = socket.fromfd(self.conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(True)
        self.sock.settimeout(READ_LIMIT)
        self._buffer = b""
        self.backend_pid = self.conn.info.backend_pid

    def send(self, *messages: bytes) -> None:
        self.sock.sendall(b"".join(messages))

    def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the proxy hung up")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def read(self) -> Message:
        type_, length = struct.unpack("!ci", self._exactly(5))
        return type_, self._exactly(length - 4)

    def until(self, *last: bytes) -> list[Message]:
        """Messages up to one of the types ``last`` (or a FATAL error)."""
        got = []
        while True:
            got.append(self.read())
            type_, body = got[-1]
            if type_ in last or type_ == b"E" and pg.parse_fields(body)["S"] == "FATAL":
                return got

    def pending(self) -> bool:
        """Whether anything from the server is waiting to be read now."""
        return bool(self._buffer) or bool(select.select([self.sock], [], [], 0)[0])

    def query(self, sql: str) -> list[Message]:
        self.send(pg.query_message(sql))
        return self.until(b"Z")

    def close(self) -> None:
        self.sock.close()
        self.conn.close()


def parse(sql: str, name: bytes = b"", types: tuple[int, ...] = ()) -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack(f"!h{len(types)}I", len(types), *types))


def bind(values: tuple[bytes | None, ...] = (), statement: bytes = b"", portal: bytes = b"") -> bytes:
    encoded = b"".join(struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value
                       for value in values)
    return pg.message(b"B", portal + b"\0" + statement + b"\0" + struct.pack("!hh", 0, len(values)) + encoded
                      + struct.pack("!h", 0))


def execute(portal: bytes = b"", max_rows: int = 0) -> bytes:
    return pg.message(b"E", portal + b"\0" + struct.pack("!i", max_rows))


def describe(kind: bytes, name: bytes = b"") -> bytes:
    return pg.message(b"D", kind + name + b"\0")


def close(kind: bytes, name: bytes = b"") -> bytes:
    return pg.message(b"C", kind + name + b"\0")


FLUSH = pg.message(b"H")
SYNC = pg.message(b"S")


def types(messages: list[Message]) -> list[bytes]:
    return [type_ for type_, _ in messages]


def rows(messages: list[Message]) -> list[tuple[bytes | None, ...]]:
    return [pg.parse_data_row(body) for type_, body in messages if type_ == b"D"]


def errors(messages: list[Message]) -> list[str]:
    return [pg.parse_fields(body)["C"] for type_, body in messages if type_ == b"E"]


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[Raw]:
    session = Raw(gated_proxy.dsn(gated_database, user="reporter"))
    yield session
    session.close()


@pytest.fixture
def postgresql_raw(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[Raw]:
    """The same database straight from PostgreSQL, as its superuser: PostgreSQL's own protocol answers."""
    session = Raw(pg_server.conninfo(dbname=gated_database))
    yield session
    session.close()


def simple_answer(session: Raw, sql: str) -> list[tuple[bytes | None, ...]]:
    got = session.query(sql)
    assert not errors(got), got
    return rows(got)


# -- Flush without Sync, portals suspended and closed, a Query inside an open batch ------------------------------


def test_flush_without_sync_answers_the_rewritten_statement(reporter: Raw) -> None:
    """Parse, Bind, Execute and Flush of a gated aggregate: its answer comes before any Sync, the same as the
    simple protocol's; the Sync then ends the batch."""
    expected = simple_answer(reporter, AGGREGATE)
    reporter.send(parse(AGGREGATE), bind(), execute(), FLUSH)
    got = reporter.until(b"C")
    assert types(got) == [b"1", b"2"] + [b"D"] * len(expected) + [b"C"]
    assert rows(got) == expected
    reporter.send(SYNC)
    assert reporter.until(b"Z")[-1] == (b"Z", b"I")


def _suspend_close_execute(session: Raw) -> list[bytes]:
    session.send(parse(AGGREGATE), bind(), execute(max_rows=1), close(b"P"), execute(), SYNC)
    return types(session.until(b"Z"))


def test_a_suspended_portal_closed_then_executed_is_gone_as_in_postgresql(reporter: Raw,
                                                                         postgresql_raw: Raw) -> None:
    """Execute with max_rows suspends the portal; Close ends it; an Execute of it afterwards fails (34000) and
    sends no row, as in PostgreSQL."""
    got = _suspend_close_execute(reporter)
    assert got == _suspend_close_execute(postgresql_raw)
    assert got == [b"1", b"2", b"D", b"s", b"3", b"E", b"Z"]


def test_a_query_inside_an_unfinished_batch(reporter: Raw, postgresql_raw: Raw) -> None:
    """A simple Query sent after Parse/Bind/Execute of a gated aggregate, before its Sync: both are answered, in
    order, as in PostgreSQL (which ends the open batch's implicit transaction with the Query)."""
    expected = simple_answer(reporter, AGGREGATE)
    for session in (reporter, postgresql_raw):
        session.send(parse(AGGREGATE), bind(), execute(), pg.query_message(AGGREGATE), SYNC)
    got = reporter.until(b"Z")
    got += reporter.until(b"Z")
    direct = postgresql_raw.until(b"Z")
    direct += postgresql_raw.until(b"Z")
    assert types(got) == types(direct)
    assert rows(got) == expected * 2
    assert simple_answer(reporter, AGGREGATE) == expected  # the session goes on

def test_describe_of_a_gated_statement_tells_what_postgresql_tells(reporter: Raw, postgresql_raw: Raw) -> None:
    """A Describe of a rewritten statement (before any Bind) tells its parameter types and its columns' names and
    types as PostgreSQL's Describe of the client's statement does: nothing of the rewrite, nothing of the data."""
    sql = "select sex, count(*) as n, avg(age) from public.adult where age > $1 group by sex"
    answers = []
    for session in (reporter, postgresql_raw):
        session.send(parse(sql, b"described"), describe(b"S", b"described"), SYNC)
        answers.append(session.until(b"Z"))
    got, direct = answers
    assert types(got) == types(direct) == [b"1", b"t", b"T", b"Z"]
    parameters = [body for type_, body in got if type_ == b"t"]
    assert parameters == [body for type_, body in direct if type_ == b"t"]
    columns = [pg.parse_row_description(body) for type_, body in got if type_ == b"T"]
    assert columns == [pg.parse_row_description(body) for type_, body in direct if type_ == b"T"]


def test_a_huge_bound_value_where_a_constant_is_needed_is_refused_as_too_long(reporter: Raw) -> None:
    """A value bound in a slot the statement needs as a constant (a LIKE pattern) is written into the statement
    the proxy analyses: a value past max_statement_size makes that text longer than any statement a client may
    send, refused as one (54000); the session goes on."""
    reporter.send(parse("select count(*) from public.adult where occupation like $1", b"huge", (25,)),
                  bind((b"%" * (300 * 1024),), b"huge"), execute(), SYNC)
    got = reporter.until(b"Z")
    assert errors(got) == ["54000"], got
    assert not rows(got)
    assert simple_answer(reporter, AGGREGATE)


def test_many_parameters_and_a_long_bind_are_answered_or_refused_cleanly(reporter: Raw,
                                                                        postgresql_raw: Raw) -> None:
    """A gated statement with 20000 parameters in an IN list, each bound: PostgreSQL's answer, or a refusal with
    a SQLSTATE; never an internal error, and the session goes on."""
    values = tuple(str(age).encode() for age in range(20000))
    placeholders = ", ".join(f"${n}" for n in range(1, len(values) + 1))
    sql = f"select count(*) from public.adult where age in ({placeholders})"
    reporter.send(parse(sql, b"many", (23,) * len(values)), bind(values, b"many"), execute(), SYNC)
    got = reporter.until(b"Z")
    assert not any(code.startswith("XX") for code in errors(got)), got
    if not errors(got):
        assert rows(got) == simple_answer(postgresql_raw, "select count(*) from public.adult")
    assert simple_answer(reporter, AGGREGATE)


# -- COPY, functions with side effects, session commands --------------------------------------------------------

COPIES = [
    "copy public.adult to stdout",
    "copy (select count(*) from public.adult) to stdout",
    "copy (select sex, count(*) from public.adult group by sex) to stdout",
    "copy public.adult (id) from stdin",
    "do $$ begin perform count(*) from public.adult; end $$",
    "do $$ begin execute 'copy (select id from public.adult) to stdout'; end $$",
]


@pytest.mark.parametrize("sql", COPIES)
def test_copy_and_do_by_a_gated_role_release_nothing(reporter: Raw, sql: str) -> None:
    """COPY of a protected table or of a query over it, either way, and a DO block that reads it: an error, never
    a CopyOutResponse or CopyInResponse, and the session goes on."""
    got = reporter.query(sql)
    assert types(got) == [b"E", b"Z"], got
    assert simple_answer(reporter, AGGREGATE)
