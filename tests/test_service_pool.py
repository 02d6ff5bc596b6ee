"""Gated sessions share a bounded pool of service connections per worker.

A proxy of this module's own (one worker, ``service_pool_size`` 2) on a database of its own, so that the
service backends counted in pg_stat_activity are this proxy's alone. Expected answers come from a superuser
connection to the same database.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    ProxyProcess,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)
from pytest_postgresql.executors.noop import NoopExecutor

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.gate import Gate
from anonproxy.proxy.service_statements import ServiceStatements
from anonproxy.route.decision import Pass, Rewrite
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer

DATABASE = "anonproxy_pool"
POOL_SIZE = 2
SESSIONS = 10
BY_SEX = "select sex, count(*) from adult where age > %s group by sex order by sex"
BY_RACE = "select race, count(*) from adult where age > %s group by race order by race"
# Constants cast to text: their text is made by the service backend, with the session's settings.
SHAPED = ("select sex, count(*), (date '2020-01-02')::text, (timestamptz '2020-01-02 10:00+00')::text, "
          "(0.333333333333333314829616256247::float8)::text from adult group by sex order by sex")


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: NoopExecutor) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.commit()
    return DATABASE


@pytest.fixture(scope="module")
def pooled(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ProxyProcess]:
    log_path: Path = tmp_path_factory.mktemp("pool") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1", log_level="debug",
                        service_pool_size=str(POOL_SIZE),
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as conn:
        yield conn


def reporter(proxy: ProxyProcess, **kwargs: object) -> psycopg.Connection:
    return psycopg.connect(proxy.endpoint.dsn(DATABASE, user="reporter"), autocommit=True, **kwargs)


def service_backends(conn: psycopg.Connection) -> int:
    return conn.execute("select count(*) from pg_stat_activity where datname = %s and usename = %s "
                        "and application_name = 'anonproxy service'", [DATABASE, SERVICE_ROLE]).fetchone()[0]


def expected(truth: psycopg.Connection, query: str, age: int) -> list[tuple[object, ...]]:
    return [row for row in truth.execute(query, [age]).fetchall() if row[1] >= 10]


def shaped(dsn: str, datestyle: str, timezone: str, float_digits: int) -> tuple[str, str, str]:
    """What PostgreSQL itself prints for SHAPED's constants under these settings."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select set_config('DateStyle', %s, false), set_config('TimeZone', %s, false), "
                     "set_config('extra_float_digits', %s, false)", [datestyle, timezone, str(float_digits)])
        return conn.execute("select (date '2020-01-02')::text, (timestamptz '2020-01-02 10:00+00')::text, "
                            "(0.333333333333333314829616256247::float8)::text").fetchone()


@pytest.fixture(scope="module")
def direct(pg_server: EmbeddedPostgres, database: str) -> str:
    """A superuser's DSN for the module's database."""
    return pg_server.conninfo(dbname=database)


def test_reset_all_keeps_the_startup_options_of_a_service_connection(pg_server: EmbeddedPostgres) -> None:
    """What a borrowed connection is reset with keeps what it was opened with: read-only, pinned search_path."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True,
                         options="-c default_transaction_read_only=on -c search_path=pg_catalog") as conn:
        conn.execute("set search_path = public; set default_transaction_read_only = off; set DateStyle = German")
        conn.execute("reset all")
        assert conn.execute("show search_path").fetchone()[0] == "pg_catalog"
        assert conn.execute("show default_transaction_read_only").fetchone()[0] == "on"
        assert conn.execute("show DateStyle").fetchone()[0] == "ISO, MDY"


SETTINGS = [("ISO, MDY", "UTC", 1), ("German, DMY", "Asia/Tokyo", 0), ("SQL, DMY", "America/New_York", 1),
            ("Postgres, MDY", "Europe/Paris", 0), ("ISO, DMY", "Australia/Adelaide", 1)]


def test_ten_sessions_share_a_pool_of_two_and_keep_their_own_settings(pooled: ProxyProcess, direct: str,
                                                                      truth: psycopg.Connection) -> None:
    answers = {age: expected(truth, BY_SEX, age) for age in range(20, 26)}
    looks = {setting: shaped(direct, *setting) for setting in SETTINGS}
    counts: list[int] = []
    done = threading.Event()
    failures: list[BaseException] = []

    def watch() -> None:
        with psycopg.connect(direct, autocommit=True) as conn:
            while not done.is_set():
                counts.append(service_backends(conn))

    def session(number: int) -> None:
        datestyle, timezone, digits = SETTINGS[number % len(SETTINGS)]
        try:
            # Half set them at startup, half with SET once logged in.
            startup = f"-c extra_float_digits={digits}" + (f" -c TimeZone={timezone}" if number % 2 else "")
            with reporter(pooled, options=startup) as conn:
                conn.execute(f"set DateStyle = '{datestyle}'")
                if number % 2 == 0:
                    conn.execute(f"set TimeZone = '{timezone}'")
                for age in range(20, 26):
                    # Extended protocol, one named statement prepared once and used in every round.
                    assert conn.execute(BY_SEX, [age], prepare=True).fetchall() == answers[age]
                    # Simple protocol.
                    with conn.cursor() as cur:
                        cur.execute(BY_SEX.replace("%s", str(age)), prepare=False)
                        assert cur.fetchall() == answers[age]
                    rows = conn.execute(SHAPED, prepare=True).fetchall()
                    assert [row[2:] for row in rows] == [looks[datestyle, timezone, digits]] * 2
        except BaseException as exc:  # noqa: BLE001 — reported by the main thread
            failures.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=session, args=(number,)) for number in range(SESSIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    done.set()
    watcher.join(10)
    assert not failures, failures
    assert counts and max(counts) <= POOL_SIZE
    assert max(counts) >= 1


def test_statements_prepared_by_two_sessions_under_the_same_name_stay_apart(pooled: ProxyProcess,
                                                                          truth: psycopg.Connection) -> None:
    """psycopg names its first prepared statement the same in every session: each is prepared again, as its
    own, wherever the session's next statement runs."""
    with reporter(pooled) as one, reporter(pooled) as two:
        for age in range(30, 36):
            assert one.execute(BY_SEX, [age], prepare=True).fetchall() == expected(truth, BY_SEX, age)
            assert two.execute(BY_RACE, [age], prepare=True).fetchall() == expected(truth, BY_RACE, age)
            with one.transaction():  # across transactions of the client too
                assert one.execute(BY_SEX, [age], prepare=True).fetchall() == expected(truth, BY_SEX, age)


def test_asyncpg_statements_outlive_other_sessions_use_of_the_connections(pooled: ProxyProcess,
                                                                          truth: psycopg.Connection) -> None:
    """asyncpg prepares named statements and describes them before binding. (It prepares in a batch it leaves
    open, ended by the Sync of the statement's first execution: the session holds its connection until then, so
    one task preparing on more connections than the pool has would wait for itself.)"""
    async def run() -> None:
        conns = [await asyncpg.connect(host=pooled.endpoint.host, port=pooled.endpoint.port, user="reporter",
                                       password="reporter", database=DATABASE) for _ in range(POOL_SIZE)]
        try:
            statements = [await conn.prepare(BY_SEX.replace("%s", "$1")) for conn in conns]
            for age in range(40, 44):
                for conn, statement in zip(conns, statements):
                    await conn.fetch(BY_RACE.replace("%s", "$1"), age)  # another statement in between
                    rows = [tuple(row) for row in await statement.fetch(age)]
                    assert rows == expected(truth, BY_SEX, age)
        finally:
            for conn in conns:
                await conn.close()

    asyncio.run(run())


def test_an_idle_transaction_holds_no_service_connection(pooled: ProxyProcess, truth: psycopg.Connection) -> None:
    """Rewritten statements run one by one on the service side, outside the client's transaction: a client idle
    in a transaction does not keep a pooled connection from the others."""
    idle = [reporter(pooled) for _ in range(POOL_SIZE)]
    try:
        for conn in idle:
            conn.execute("begin")
            assert conn.execute(BY_SEX, [50]).fetchall() == expected(truth, BY_SEX, 50)

        async def another() -> list[tuple[object, ...]]:
            conn = await asyncpg.connect(host=pooled.endpoint.host, port=pooled.endpoint.port, user="reporter",
                                         password="reporter", database=DATABASE)
            try:
                return [tuple(row) for row in await conn.fetch(BY_SEX.replace("%s", "$1"), 51, timeout=60)]
            finally:
                await conn.close()

        assert asyncio.run(another()) == expected(truth, BY_SEX, 51)
        for conn in idle:
            assert conn.execute(BY_SEX, [52]).fetchall() == expected(truth, BY_SEX, 52)
            conn.execute("commit")
    finally:
        for conn in idle:
            conn.close()


def test_a_cancel_reaches_the_backend_the_session_holds(pooled: ProxyProcess, direct: str,
                                                         truth: psycopg.Connection) -> None:
    """Two sessions' statements wait for a lock on the two pooled backends; one is cancelled, the other not."""
    answers: dict[str, object] = {}

    def ask(name: str, conn: psycopg.Connection) -> None:
        try:
            answers[name] = conn.execute(BY_SEX, [60]).fetchall()
        except psycopg.Error as exc:
            answers[name] = exc

    with reporter(pooled) as cancelled, reporter(pooled) as spared, \
            psycopg.connect(direct) as locker, psycopg.connect(direct, autocommit=True) as watcher:
        locker.execute("lock table adult in access exclusive mode")
        threads = [threading.Thread(target=ask, args=("cancelled", cancelled)),
                   threading.Thread(target=ask, args=("spared", spared))]
        for thread in threads:
            thread.start()
        while watcher.execute("select count(*) from pg_stat_activity where datname = %s and usename = %s and "
                              "wait_event_type = 'Lock'", [DATABASE, SERVICE_ROLE]).fetchone()[0] < 2:
            pass
        cancelled.cancel_safe()
        threads[0].join(30)
        assert isinstance(answers["cancelled"], psycopg.errors.QueryCanceled)
        assert "spared" not in answers  # still waiting for the lock
        locker.rollback()
        threads[1].join(30)
        assert answers["spared"] == expected(truth, BY_SEX, 60)
        # The cancelled session goes on.
        assert cancelled.execute(BY_SEX, [61]).fetchall() == expected(truth, BY_SEX, 61)


# -- the gate's part, message by message (sans-I/O) ------------------------------------------------------------


class Borrowing:
    """A gate that borrows its service connection: the test plays the pool and the server."""

    def __init__(self) -> None:
        self.client, self.service, self.upstream = bytearray(), bytearray(), bytearray()
        self.asked = 0
        self.released: list[bool] = []
        self.gate = Gate(decide=lambda sql: Pass() if sql == "select 1" else Rewrite(f"rewritten {sql}"),
                         settings=lambda: {}, write_client=self.client.extend, send_upstream=self.upstream.extend,
                         send_service=self.service.extend, ask_proxy=lambda request: None,
                         acquire_service=self.acquire, release_service=self.released.append,
                         service_settings={"DateStyle": "German, DMY"})

    def acquire(self) -> None:
        self.asked += 1

    def sent(self) -> list[tuple[bytes, bytes]]:
        messages = MessageBuffer().feed(bytes(self.service))
        self.service.clear()
        return messages

    def server_answers(self, *types: bytes) -> None:
        for type_ in types:
            self.gate.service_message(type_, b"I" if type_ == b"Z" else b"SELECT 1\0" if type_ == b"C" else b"")


def _parse(name: bytes, sql: str) -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def _bind(statement: bytes) -> bytes:
    return pg.message(b"B", b"\0" + statement + b"\0" + struct.pack("!hhh", 0, 0, 0))


EXECUTE_SYNC = pg.message(b"E", b"\0" + struct.pack("!i", 0)) + pg.message(b"S")


def test_a_borrowed_connection_is_cleared_then_a_statement_prepared_before_is_prepared_again() -> None:
    wires = Borrowing()
    wires.gate.client_data(_parse(b"s", "agg") + _bind(b"s") + EXECUTE_SYNC)
    assert wires.asked == 1 and not wires.service  # nothing goes before the connection is there
    wires.gate.service_acquired(ServiceStatements())
    (setup, body), *rest = wires.sent()
    assert setup == b"Q" and body == b"RESET ALL;SET DateStyle TO 'German, DMY';\0"
    assert [type_ for type_, _ in rest] == [b"C", b"P", b"B", b"E", b"S"]  # prepared where first used
    wires.server_answers(b"C", b"Z", b"3", b"1", b"2", b"C", b"Z")  # (the answer to the setup query is hidden)
    assert wires.released == [True]
    assert [type_ for type_, _ in MessageBuffer().feed(bytes(wires.client))] == [b"1", b"2", b"C", b"Z"]
    wires.client.clear()
    # The next use borrows again (maybe another connection): cleared, and "s" prepared there before the Bind.
    wires.gate.client_data(_bind(b"s") + EXECUTE_SYNC)
    assert wires.asked == 2
    wires.gate.service_acquired(ServiceStatements())
    sent = wires.sent()
    assert [type_ for type_, _ in sent] == [b"Q", b"C", b"P", b"B", b"E", b"S"]
    assert pg.parse_parse(sent[2][1]).query == b"rewritten agg"
    wires.server_answers(b"C", b"Z", b"3", b"1", b"2", b"C", b"Z")
    assert [type_ for type_, _ in MessageBuffer().feed(bytes(wires.client))] == [b"2", b"C", b"Z"]
    assert wires.released == [True, True]


def test_a_connection_borrowed_again_keeps_the_proxys_statements_and_closes_the_clients() -> None:
    on_connection = ServiceStatements()
    first = Borrowing()
    first.gate.client_data(pg.query_message("total"))
    first.gate.service_acquired(on_connection)
    sent = first.sent()
    assert [type_ for type_, _ in sent] == [b"Q", b"C", b"P", b"B", b"D", b"E", b"S"]  # the Query's rewrite, prepared
    ours = pg.parse_parse(sent[2][1]).statement
    first.server_answers(b"C", b"Z", b"3", b"1", b"2", b"T", b"D", b"C", b"Z")
    first.gate.client_data(_parse(b"s", "agg") + _bind(b"s") + EXECUTE_SYNC)
    first.gate.service_acquired(on_connection)
    assert [type_ for type_, _ in first.sent()] == [b"Q", b"C", b"P", b"B", b"E", b"S"]
    first.server_answers(b"C", b"Z", b"3", b"1", b"2", b"C", b"Z")
    assert first.released == [True, True]
    # Another session borrows the same connection: "s" of the first one's client is closed, the proxy's kept.
    second = Borrowing()
    second.gate.client_data(pg.query_message("total"))
    second.gate.service_acquired(on_connection)
    sent = second.sent()
    assert sent[0] == (b"C", b"Ss\0") and sent[1][0] == b"Q" and sent[1][1].startswith(b"RESET ALL;")
    assert [type_ for type_, _ in sent[2:]] == [b"B", b"D", b"E", b"S"]
    assert pg.parse_bind(sent[2][1]).statement == ours
    second.server_answers(b"3", b"C", b"Z", b"2", b"T", b"D", b"C", b"Z")
    assert [type_ for type_, _ in MessageBuffer().feed(bytes(second.client))] == [b"T", b"D", b"C", b"Z"]


def test_an_open_batch_keeps_its_connection_until_sync() -> None:
    wires = Borrowing()
    wires.gate.client_data(_parse(b"", "agg") + _bind(b"") + pg.message(b"H"))  # Flush: the batch stays open
    wires.gate.service_acquired(ServiceStatements())
    wires.server_answers(b"C", b"Z", b"1", b"2")
    assert wires.released == []
    wires.gate.client_data(EXECUTE_SYNC)
    assert wires.asked == 1 and [type_ for type_, _ in wires.sent()][-2:] == [b"E", b"S"]
    wires.server_answers(b"C", b"Z")
    assert wires.released == [True]


def test_a_refused_connection_answers_the_statement_that_waited() -> None:
    wires = Borrowing()
    refusal = pg.error_response("53300", "sorry, too many clients already")
    wires.gate.client_data(pg.query_message("agg"))
    wires.gate.service_refused(refusal)
    assert [type_ for type_, _ in MessageBuffer().feed(bytes(wires.client))] == [b"E", b"Z"]
    wires.client.clear()
    # In the extended protocol the rest of the batch is skipped, up to Sync, as after any error.
    wires.gate.client_data(_parse(b"", "agg") + _bind(b"") + EXECUTE_SYNC)
    wires.gate.service_refused(refusal)  # (the Parse was answered by the gate: the Bind waited)
    assert [type_ for type_, _ in MessageBuffer().feed(bytes(wires.client))] == [b"1", b"E", b"Z"]
    assert not wires.service and wires.released == []
