"""No client can pin the service pool: sessions that open a batch and never Sync.

The attack: more sessions than the pool has connections each send part of an extended-protocol batch without
Sync (asyncpg's ``prepare()``: Parse, Describe, Flush; or Parse, Bind, Execute, Flush) and keep it open. Before,
each held a pooled service connection for as long as it liked, and every other statement of the worker waited
behind them with no limit. Now a Parse is answered by the proxy, a lone Describe of a statement is closed with a
Sync of the proxy's own (the connection goes back at once), an open batch may keep its connection waiting for the
client at most ``service_yield_timeout`` while another statement waits for one, and ``service_hold_timeout`` in
any case (57014: the batch is ended, the session goes on), and a statement waits for a free connection at most
``service_wait_timeout`` (53300).

Each module proxy serves a database of its own under the demo policy (``reporter``: suppress mode). Raw sessions
log in with psycopg (SCRAM), then speak the wire protocol by hand on the same socket.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)
from pytest_postgresql.executors.noop import NoopExecutor

from anonproxy.config import ConfigError, ProxyConfig, load_config
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.gate import Gate
from anonproxy.proxy.service_statements import ServiceStatements
from anonproxy.route.decision import Rewrite
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer

DATABASE = "anonproxy_hold"
POOL_SIZE = 2
ATTACKERS = POOL_SIZE + 3
HOLD_TIMEOUT = 3  # seconds (service_hold_timeout of the first proxy)
WAIT_TIMEOUT = 2  # seconds (service_wait_timeout of the second proxy, whose hold timeout is long)
AGG = "select sex, count(*) from adult group by sex order by sex"
BOUND = HOLD_TIMEOUT + 10  # generous: "answered, not stuck", while the attackers would hold for ever
READ_LIMIT = 60  # seconds any expected answer may take: "not stuck for ever"


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: NoopExecutor) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.commit()
    return DATABASE


def _proxy(pg_server: EmbeddedPostgres, database: str, log_dir: Path, **settings: str) -> ProxyProcess:
    return start_proxy(f"host={pg_server.host} port={pg_server.port}", log_dir / "anonproxy.log", workers="1",
                       log_level="debug", service_pool_size=str(POOL_SIZE),
                       service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}", **settings)


@pytest.fixture(scope="module")
def holding(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Endpoint]:
    """A proxy whose open batches may keep a service connection waiting HOLD_TIMEOUT seconds (while another
    statement waits for one, the default service_yield_timeout: 0.05 s)."""
    proxy = _proxy(pg_server, database, tmp_path_factory.mktemp("hold"), service_hold_timeout=str(HOLD_TIMEOUT))
    yield proxy.endpoint
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.fixture(scope="module")
def waiting(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Endpoint]:
    """A proxy whose open batches may hold for long, even while others wait, but whose statements wait
    WAIT_TIMEOUT seconds at most."""
    proxy = _proxy(pg_server, database, tmp_path_factory.mktemp("wait"), service_hold_timeout="600",
                   service_yield_timeout="600", service_wait_timeout=str(WAIT_TIMEOUT))
    yield proxy.endpoint
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


class Raw:
    """A gated session speaking the wire protocol by hand."""

    def __init__(self, conn: psycopg.AsyncConnection[object], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn, self.reader, self.writer = conn, reader, writer

    @classmethod
    async def login(cls, endpoint: Endpoint) -> Raw:
        conn = await psycopg.AsyncConnection.connect(endpoint.dsn(DATABASE, user="reporter"), autocommit=True)
        # psycopg logged in (SCRAM) and is idle: its socket is ours from here on.
        reader, writer = await asyncio.open_connection(sock=socket.fromfd(conn.pgconn.socket, socket.AF_INET,
                                                                          socket.SOCK_STREAM))
        return cls(conn, reader, writer)

    def send(self, *messages: bytes) -> None:
        self.writer.write(b"".join(messages))

    async def read(self) -> tuple[bytes, bytes]:
        type_, length = struct.unpack("!ci", await self.reader.readexactly(5))
        return type_, await self.reader.readexactly(length - 4)

    async def until(self, *last: bytes) -> list[tuple[bytes, bytes]]:
        """Messages up to one of type ``last`` (or a FATAL error), within READ_LIMIT."""
        return await asyncio.wait_for(self._until(*last), READ_LIMIT)

    async def _until(self, *last: bytes) -> list[tuple[bytes, bytes]]:
        messages = []
        while True:
            messages.append(await self.read())
            type_, body = messages[-1]
            if type_ in last or type_ == b"E" and pg.parse_fields(body)["S"] == "FATAL":
                return messages

    async def query(self, sql: str) -> list[tuple[bytes, bytes]]:
        self.send(pg.query_message(sql))
        return await self.until(b"Z")

    async def close(self) -> None:
        self.writer.close()
        await self.conn.close()


def parse(sql: str, name: bytes = b"") -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def bind(statement: bytes = b"") -> bytes:
    return pg.message(b"B", b"\0" + statement + b"\0" + struct.pack("!hhh", 0, 0, 0))


def describe_statement(name: bytes = b"") -> bytes:
    return pg.message(b"D", b"S" + name + b"\0")


DESCRIBE_PORTAL = pg.message(b"D", b"P\0")
EXECUTE = pg.message(b"E", b"\0" + struct.pack("!i", 0))
FLUSH = pg.message(b"H")
SYNC = pg.message(b"S")


def types(messages: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [type_ for type_, _ in messages]


def rows(messages: list[tuple[bytes, bytes]]) -> list[list[bytes | None]]:
    return [list(pg.parse_data_row(body)) for type_, body in messages if type_ == b"D"]


async def reporter(endpoint: Endpoint) -> asyncpg.Connection:
    return await asyncpg.connect(host=endpoint.host, port=endpoint.port, user="reporter", password="reporter",
                                 database=DATABASE)


async def victim(endpoint: Endpoint) -> list[asyncpg.Record]:
    """Another session, logging in now: its statement must be answered."""
    conn = await reporter(endpoint)
    try:
        return await conn.fetch(AGG)
    finally:
        await conn.close()


def test_sessions_preparing_with_asyncpg_and_never_executing_hold_no_service_connection(holding: Endpoint) -> None:
    async def run() -> None:
        attackers = [await reporter(holding) for _ in range(ATTACKERS)]
        try:
            # prepare(): Parse, Describe, Flush, and no Sync until the statement is first executed.
            statements = [await asyncio.wait_for(conn.prepare(AGG), BOUND) for conn in attackers]
            assert [a.name for a in statements[0].get_attributes()] == ["sex", "count"]
            answer = await asyncio.wait_for(victim(holding), BOUND)
            assert [row["sex"] for row in answer] == ["Female", "Male"]
            # Long after: the prepared statements still run (prepared again on whichever connection is lent).
            await asyncio.sleep(HOLD_TIMEOUT + 1)
            for statement in statements:
                assert [tuple(row) for row in await statement.fetch()] == [tuple(row) for row in answer]
        finally:
            for conn in attackers:
                conn.terminate()

    asyncio.run(run())


def test_parse_describe_flush_without_sync_holds_no_service_connection(holding: Endpoint) -> None:
    async def run() -> None:
        attackers = [await Raw.login(holding) for _ in range(ATTACKERS)]
        try:
            for number, session in enumerate(attackers):
                session.send(parse(AGG, b"s%d" % number), describe_statement(b"s%d" % number), FLUSH)
            for session in attackers:
                assert types(await session.until(b"T", b"n", b"E")) == [b"1", b"t", b"T"]
            answer = await asyncio.wait_for(victim(holding), BOUND)
            # The attackers' batches go on as if nothing happened, past the hold timeout.
            await asyncio.sleep(HOLD_TIMEOUT + 1)
            for number, session in enumerate(attackers):
                session.send(bind(b"s%d" % number), EXECUTE, SYNC)
                got = await session.until(b"Z")
                assert types(got) == [b"2", b"D", b"D", b"C", b"Z"]
                assert rows(got) == [[row["sex"].encode(), str(row["count"]).encode()] for row in answer]
        finally:
            for session in attackers:
                await session.close()

    asyncio.run(run())


OPEN_BATCHES = pytest.mark.parametrize(
    "batch", [[parse(AGG), bind(), EXECUTE, FLUSH], [parse(AGG), bind(), DESCRIBE_PORTAL, FLUSH],
              [parse(AGG), bind(), EXECUTE]],  # (no Flush: the server keeps its answers until the Sync)
    ids=["parse-bind-execute-flush", "parse-bind-describe-flush", "parse-bind-execute"])


async def ended_batch(session: Raw) -> dict[str, str]:
    """The error that ended ``session``'s open batch; the session goes on."""
    got = await session.until(b"E")
    assert b"E" not in types(got[:-1])
    error = pg.parse_fields(got[-1][1])
    assert error["S"] == "ERROR" and error["C"] == "57014", error
    assert "without Sync" in error["M"] and "Sync" in error["H"]
    # The rest of the batch is ignored up to its Sync; the session goes on.
    session.send(bind(), EXECUTE, SYNC)
    assert types(await session.until(b"Z")) == [b"Z"]
    assert len(rows(await session.query(AGG))) == 2
    return error


@OPEN_BATCHES
def test_open_batches_of_more_sessions_than_connections_yield_them_to_other_statements(holding: Endpoint,
                                                                                      batch: list[bytes]) -> None:
    async def run() -> None:
        attackers = [await Raw.login(holding) for _ in range(ATTACKERS)]
        try:
            for session in attackers:
                session.send(*batch)
            answer = await asyncio.wait_for(victim(holding), BOUND)
            assert [row["sex"] for row in answer] == ["Female", "Male"]
            errors = [await ended_batch(session) for session in attackers]
            # Those that held a connection while others waited gave it up; the last ones, at service_hold_timeout.
            assert any("service_yield_timeout (0.05 s) while other statements waited" in error["M"]
                       for error in errors), errors
            assert all("service_yield_timeout" in error["M"] or f"service_hold_timeout ({HOLD_TIMEOUT} s)"
                       in error["M"] for error in errors), errors
        finally:
            for session in attackers:
                await session.close()

    asyncio.run(run())


@OPEN_BATCHES
def test_an_open_batch_keeps_a_service_connection_waiting_at_most_service_hold_timeout(holding: Endpoint,
                                                                                      batch: list[bytes]) -> None:
    async def run() -> None:
        session = await Raw.login(holding)
        try:
            session.send(*batch)
            error = await ended_batch(session)
            assert f"service_hold_timeout ({HOLD_TIMEOUT} s)" in error["M"], error
            assert "service_hold_timeout" in error["H"]
        finally:
            await session.close()

    asyncio.run(run())


def test_a_statement_waits_for_a_service_connection_at_most_service_wait_timeout(waiting: Endpoint) -> None:
    async def run() -> None:
        attackers = [await Raw.login(waiting) for _ in range(POOL_SIZE)]
        patient = await Raw.login(waiting)
        try:
            for session in attackers:
                session.send(parse(AGG), bind(), EXECUTE, FLUSH)
                assert types(await session.until(b"C")) == [b"1", b"2", b"D", b"D", b"C"]
            # Both connections are held (for up to 600 s): the simple query gets an error, not a stall.
            got = await asyncio.wait_for(patient.query(AGG), WAIT_TIMEOUT + 10)
            assert types(got) == [b"E", b"Z"]
            error = pg.parse_fields(got[0][1])
            assert error["S"] == "ERROR" and error["C"] == "53300", error
            assert f"service_wait_timeout ({WAIT_TIMEOUT} s)" in error["M"] and "service_pool_size" in error["H"]
            # In the extended protocol, the rest of the batch is skipped up to Sync.
            patient.send(parse(AGG), bind(), EXECUTE, SYNC)
            got = await asyncio.wait_for(patient.until(b"Z"), WAIT_TIMEOUT + 10)
            assert types(got) == [b"1", b"E", b"Z"] and pg.parse_fields(got[1][1])["C"] == "53300"
            # Once an attacker ends its batch, the session goes on.
            attackers[0].send(SYNC)
            assert types(await attackers[0].until(b"Z")) == [b"Z"]
            assert len(rows(await asyncio.wait_for(patient.query(AGG), WAIT_TIMEOUT + 10))) == 2
        finally:
            for session in [*attackers, patient]:
                await session.close()

    asyncio.run(run())


def test_the_limits_are_settings() -> None:
    defaults = ProxyConfig()
    assert (defaults.service_pool_size, defaults.service_hold_timeout, defaults.service_yield_timeout,
            defaults.service_wait_timeout) == (10, 10.0, 0.05, 30.0)
    config = load_config(None, environ={"ANONPROXY_SERVICE_HOLD_TIMEOUT": "2.5",
                                        "ANONPROXY_SERVICE_YIELD_TIMEOUT": "0.2",
                                        "ANONPROXY_SERVICE_WAIT_TIMEOUT": "60"})
    assert (config.service_hold_timeout, config.service_yield_timeout, config.service_wait_timeout) == (2.5, 0.2, 60)
    for setting in ("service_hold_timeout", "service_yield_timeout", "service_wait_timeout"):
        for value in ("0", "3601"):
            with pytest.raises(ConfigError, match=f"{setting} must be more than 0 and at most 3600 seconds"):
                load_config(None, environ={f"ANONPROXY_{setting.upper()}": value})


# -- the gate's part, message by message (sans-I/O) ------------------------------------------------------------


class Holding:
    """A gate that borrows its service connection and tells when its hold timer runs: the test plays the pool,
    the server and the timer."""

    def __init__(self) -> None:
        self.client, self.service = bytearray(), bytearray()
        self.timer: list[bool] = []
        self.asked = 0
        self.released: list[bool] = []
        self.gate = Gate(decide=lambda sql: Rewrite(f"rewritten {sql}"), settings=lambda: {},
                         write_client=self.client.extend, send_upstream=lambda data: None,
                         send_service=self.service.extend, ask_proxy=lambda request: None,
                         acquire_service=self.acquire, release_service=self.released.append,
                         hold_timer=self.timer.append)

    def acquire(self) -> None:
        self.asked += 1

    def sent(self) -> list[bytes]:
        messages = MessageBuffer().feed(bytes(self.service))
        self.service.clear()
        return [type_ for type_, _ in messages]

    def received(self) -> list[bytes]:
        messages = MessageBuffer().feed(bytes(self.client))
        self.client.clear()
        return [type_ for type_, _ in messages]

    def server_answers(self, *types_: bytes) -> None:
        for type_ in types_:
            self.gate.service_message(type_, b"I" if type_ == b"Z" else b"SELECT 1\0" if type_ == b"C" else b"")


def test_the_hold_timer_runs_only_while_an_open_batch_waits_for_the_client() -> None:
    wires = Holding()
    wires.gate.client_data(parse("agg") + FLUSH)
    assert wires.received() == [b"1"] and not wires.service and wires.timer == []  # nothing borrowed
    wires.gate.client_data(bind() + EXECUTE + FLUSH)
    wires.gate.service_acquired(ServiceStatements())
    assert wires.sent() == [b"Q", b"P", b"B", b"E", b"H"]
    wires.server_answers(b"C", b"Z", b"1", b"2", b"D")
    assert wires.timer == []  # PostgreSQL is still working for the client
    wires.server_answers(b"C")
    assert wires.timer == [True]  # all answered, no Sync: waiting for the client
    wires.gate.client_data(SYNC)
    assert wires.timer == [True, False]
    wires.server_answers(b"Z")
    assert wires.released == [True] and wires.received() == [b"2", b"D", b"C", b"Z"]


def test_an_unflushed_batch_waits_for_the_client_at_once() -> None:
    wires = Holding()
    wires.gate.client_data(parse("agg") + bind() + EXECUTE)
    wires.gate.service_acquired(ServiceStatements())
    wires.server_answers(b"C", b"Z")
    assert wires.timer == [True]  # the server keeps the answers until a Flush or the Sync: nothing to wait for
    wires.gate.client_data(FLUSH)
    assert wires.timer == [True, False]
    wires.server_answers(b"1", b"2", b"C")
    assert wires.timer == [True, False, True]


def test_an_expired_hold_ends_the_batch_after_its_answers_and_hands_the_connection_back() -> None:
    wires = Holding()
    wires.gate.client_data(parse("agg") + bind() + EXECUTE + FLUSH)
    wires.gate.service_acquired(ServiceStatements())
    wires.server_answers(b"C", b"Z", b"1", b"2", b"C")
    assert wires.timer == [True]
    wires.sent()
    error = pg.error_response("57014", "held too long")
    wires.gate.service_hold_expired(error)
    assert wires.sent() == [b"S"] and wires.timer == [True, False]
    wires.gate.client_data(bind() + EXECUTE)  # skipped: the batch is over
    assert not wires.service
    wires.server_answers(b"Z")
    assert wires.released == [True]
    assert wires.received() == [b"1", b"2", b"C", b"E"]
    wires.gate.client_data(SYNC)
    assert wires.received() == [b"Z"] and not wires.service


def test_a_lone_describe_of_a_statement_is_closed_with_a_sync_of_ours() -> None:
    wires = Holding()
    wires.gate.client_data(parse("agg", b"s") + describe_statement(b"s") + FLUSH)
    wires.gate.service_acquired(ServiceStatements())
    assert wires.sent() == [b"Q", b"C", b"P", b"D", b"S"]
    wires.server_answers(b"C", b"Z", b"3", b"1", b"t", b"T", b"Z")
    assert wires.received() == [b"1", b"t", b"T"]  # our Sync's ReadyForQuery is not the client's
    assert wires.released == [True] and wires.timer == []
    # Followed by more of the batch, a Describe goes as it is.
    wires.gate.client_data(parse("agg") + describe_statement() + bind() + EXECUTE + SYNC)
    wires.gate.service_acquired(ServiceStatements())
    assert wires.asked == 2 and wires.sent() == [b"Q", b"P", b"D", b"B", b"E", b"S"]


def test_a_failing_lone_describe_skips_the_rest_of_the_batch_up_to_its_sync() -> None:
    wires = Holding()
    wires.gate.client_data(parse("agg", b"s") + describe_statement(b"s") + FLUSH)
    wires.gate.service_acquired(ServiceStatements())
    assert wires.sent() == [b"Q", b"C", b"P", b"D", b"S"]
    wires.server_answers(b"C", b"Z", b"3")
    wires.gate.service_message(b"E", pg.error_response("42703", "column does not exist")[5:])  # the rewrite's Parse
    wires.server_answers(b"Z")
    assert wires.released == [True]
    wires.gate.client_data(bind(b"s") + EXECUTE + SYNC)  # PostgreSQL would skip them: so does the gate
    assert wires.received() == [b"1", b"E", b"Z"] and wires.asked == 1 and not wires.service
    # A client that sent its Sync before the error came back skips nothing after it.
    wires.gate.client_data(describe_statement(b"s"))
    wires.gate.service_acquired(ServiceStatements())
    wires.sent()
    wires.gate.client_data(SYNC)
    wires.server_answers(b"C", b"Z", b"3")
    wires.gate.service_message(b"E", pg.error_response("42703", "column does not exist")[5:])
    wires.server_answers(b"Z")
    wires.gate.client_data(bind(b"s") + EXECUTE + SYNC)
    wires.gate.service_acquired(ServiceStatements())
    assert wires.sent()[-3:] == [b"B", b"E", b"S"]
