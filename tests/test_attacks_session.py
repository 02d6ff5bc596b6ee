"""Attacks on a gated session's life: policy changes under prepared statements, time, hostile input.

Through the real proxy (one worker, so that a dba and a reporter share its
event loop) with real drivers, on a database of its own under the demo
policy: the tests change the policy, and the protected table is made about
thirty times larger so that its aggregates take long enough to be stopped
by a statement timeout. Expected answers come from a superuser connection.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import SERVICE_ROLE, Endpoint, ProxyProcess, start_proxy, stop_proxy
from psycopg import pq

from anonproxy import demo
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.refusals import Reject
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import (
    apply_policy,
    demo_policy,
    dump_policy,
    parse_policy,
)
from anonproxy.proxy.cache import BoundedCache
from anonproxy.proxy.gate import Gate
from anonproxy.route.decision import Decision, Noisy, Pass, Rewrite
from anonproxy.wire import protocol as pg
from anonproxy.wire.auth import PasswordAuthenticator
from anonproxy.wire.framing import (
    BoundedMessageBuffer,
    MessageBuffer,
    Piece,
    RelayingMessageBuffer,
)

DATABASE = "anonproxy_hostile"
COPIES = 30  # the demo table, this many times over (new ids): about a million rows
SLOW = "select age, education, occupation, count(*) from adult group by age, education, occupation"
# Slow enough on the 30-fold table that a 20 ms limit always cuts it short, however warm the server's cache.
DP_SLOW = "select age, education, occupation, count(*) from adult group by age, education, occupation"
SMALL = "select sex, count(*) from adult group by sex order by sex"


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: object) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")  # type: ignore[attr-defined]
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        demo.create_demo_roles(conn, DATABASE)
        demo.reset_service_role(conn, SERVICE_ROLE)
        conn.execute(f"alter role {SERVICE_ROLE} password '{SERVICE_ROLE}'")
        columns = [row[0] for row in conn.execute(
            "select column_name from information_schema.columns where table_schema = 'public' "
            "and table_name = 'adult' and column_name <> 'id' order by ordinal_position")]
        listed = ", ".join(f'"{column}"' for column in columns)
        conn.execute(f"insert into adult (id, {listed}) select id + n * 1000000, {listed} "
                     f"from adult, generate_series(1, {COPIES - 1}) n")
        apply_policy(conn, demo_policy())
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        conn.execute("analyze adult")
    return DATABASE


@pytest.fixture(scope="module")
def hostile_proxy(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[ProxyProcess]:
    log_path = tmp_path_factory.mktemp("hostile") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1", log_level="debug",
                        analysis_timeout="2",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.process.returncode == 0, proxy.log()


@pytest.fixture(scope="module")
def endpoint(hostile_proxy: ProxyProcess) -> Endpoint:
    return hostile_proxy.endpoint


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as conn:
        yield conn


def connect(endpoint: Endpoint, user: str, **kwargs: object) -> psycopg.Connection:
    return psycopg.connect(endpoint.dsn(DATABASE, user=user), autocommit=True, **kwargs)


def change_policy(truth: psycopg.Connection, watcher: psycopg.Connection, statement: str) -> None:
    """Run a policy change and wait until the proxy (seen through ``watcher``'s session) has loaded it."""
    truth.execute(statement)
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    deadline = time.monotonic() + 15
    while int(watcher.execute("show anonproxy.policy_version").fetchone()[0]) < version:
        assert time.monotonic() < deadline, "the proxy did not reload the policy"
        time.sleep(0.05)


REPORTER_POLICY = "select anonproxy.set_role_policy('reporter', 'suppress', 10, 2, 85, 10, true)"
ANALYST_POLICY = "select anonproxy.set_role_policy('analyst', 'dp')"


def long_statement(size: int) -> str:
    """An aggregate with an IN list of about ``size`` bytes."""
    values = ",".join(str(17 + i % 70) for i in range(size // 3))
    return f"select sex, count(*) from adult where age in ({values}) group by sex"


# -- Policy changes reach prepared statements ------------------------------------------------------------------


def test_a_prepared_statement_obeys_a_raised_k(endpoint: Endpoint, truth: psycopg.Connection) -> None:
    with connect(endpoint, "reporter") as conn:
        before = conn.execute(SMALL, prepare=True).fetchall()
        assert [row for row in before if row[0] is not None] == \
            truth.execute("select sex, count(*) from adult group by sex order by sex").fetchall()
        try:
            change_policy(truth, conn, "select anonproxy.set_role_policy('reporter', 'suppress', 10000000)")
            after = conn.execute(SMALL, prepare=True).fetchall()
            # No group has ten million people: every one is withheld now.
            assert [row for row in after if row[0] is not None] == []
        finally:
            change_policy(truth, conn, REPORTER_POLICY)
        assert conn.execute(SMALL, prepare=True).fetchall() == before


def test_a_prepared_statement_is_refused_once_the_role_is_denied(endpoint: Endpoint,
                                                                truth: psycopg.Connection) -> None:
    with connect(endpoint, "reporter") as conn, connect(endpoint, "analyst") as watcher:
        conn.execute(SMALL, prepare=True).fetchall()
        try:
            change_policy(truth, watcher, "select anonproxy.set_role_policy('reporter', 'deny')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="denies role \"reporter\""):
                conn.execute(SMALL, prepare=True)
            # Refused at each execution, not only the first.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(SMALL, prepare=True)
        finally:
            change_policy(truth, watcher, REPORTER_POLICY)
        assert conn.execute(SMALL, prepare=True).fetchall()[0][1] > 0


def test_a_prepared_dp_statement_is_refused_once_the_role_is_denied(endpoint: Endpoint,
                                                                   truth: psycopg.Connection) -> None:
    with connect(endpoint, "analyst") as conn, connect(endpoint, "reporter") as watcher:
        assert len(conn.execute(SMALL, prepare=True).fetchall()) == 2
        try:
            change_policy(truth, watcher, "select anonproxy.set_role_policy('analyst', 'deny')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="denies role \"analyst\""):
                conn.execute(SMALL, prepare=True)
        finally:
            change_policy(truth, watcher, ANALYST_POLICY)
        assert len(conn.execute(SMALL, prepare=True).fetchall()) == 2


def test_prepared_statements_follow_a_change_of_mode(endpoint: Endpoint, truth: psycopg.Connection) -> None:
    """dp -> suppress: the statement the proxy answered with noise is prepared on the service connection and
    answered exactly; suppress -> dp: the rewritten statement is answered with noise instead."""
    exact = truth.execute(SMALL).fetchall()
    with connect(endpoint, "analyst") as analyst, connect(endpoint, "reporter") as reporter:
        noisy = analyst.execute(SMALL, prepare=True)
        assert noisy.pgresult is not None
        assert reporter.execute(SMALL, prepare=True).fetchall()[:2] == exact
        try:
            change_policy(truth, analyst, "select anonproxy.set_role_policy('analyst', 'suppress')")
            change_policy(truth, reporter, "select anonproxy.set_role_policy('reporter', 'dp')")
            truth.execute("select anonproxy.set_budget('reporter', 'public.adult', 10, 0.00001)")
            change_policy(truth, reporter, "select anonproxy.set_role_policy('reporter', 'dp')")
            assert analyst.execute(SMALL, prepare=True).fetchall()[:2] == exact
            notices: list[str] = []
            reporter.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
            assert len(reporter.execute(SMALL, prepare=True).fetchall()) == 2
            assert any("differentially private" in notice for notice in notices), notices
        finally:
            change_policy(truth, analyst, ANALYST_POLICY)
            change_policy(truth, reporter, REPORTER_POLICY)
            truth.execute("select anonproxy.drop_budget('reporter', 'public.adult')")


# -- Time ---------------------------------------------------------------------------------------------------------


def test_the_clients_statement_timeout_stops_a_rewritten_query(endpoint: Endpoint) -> None:
    with connect(endpoint, "reporter") as conn:
        conn.execute("set statement_timeout = 20")
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute(SLOW)
        conn.execute("reset statement_timeout")
        assert len(conn.execute(SLOW).fetchall()) > 100  # the same query, without the timeout
        assert conn.execute(SMALL).fetchall()[0][1] > 0


def test_a_statement_timeout_from_startup_options_or_role_defaults(endpoint: Endpoint,
                                                                    truth: psycopg.Connection) -> None:
    with connect(endpoint, "reporter", options="-c statement_timeout=20") as conn:
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute(SLOW)
    truth.execute(f"alter role reporter in database {DATABASE} set statement_timeout = 20")
    try:
        with connect(endpoint, "reporter") as conn:
            with pytest.raises(psycopg.errors.QueryCanceled):
                conn.execute(SLOW, prepare=True)  # the extended protocol too
    finally:
        truth.execute(f"alter role reporter in database {DATABASE} reset statement_timeout")


def test_the_policys_maximum_statement_time_per_mode(endpoint: Endpoint, truth: psycopg.Connection) -> None:
    with connect(endpoint, "reporter") as reporter, connect(endpoint, "analyst") as analyst:
        try:
            change_policy(truth, reporter, "select anonproxy.set_max_statement_time('suppress', '20 ms')")
            with pytest.raises(psycopg.errors.QueryCanceled):
                reporter.execute(SLOW)
            # A longer statement_timeout of the client's own does not lift the policy's maximum.
            reporter.execute("set statement_timeout = '10min'")
            with pytest.raises(psycopg.errors.QueryCanceled):
                reporter.execute(SLOW)
            change_policy(truth, analyst, "select anonproxy.set_max_statement_time('dp', '20 ms')")
            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                analyst.execute(DP_SLOW)
        finally:
            truth.execute("select anonproxy.set_max_statement_time('suppress', '30 s')")
            change_policy(truth, reporter, "select anonproxy.set_max_statement_time('dp', '30 s')")
        assert len(reporter.execute(SLOW).fetchall()) > 100


def test_a_dp_query_past_the_clients_statement_timeout(endpoint: Endpoint) -> None:
    with connect(endpoint, "analyst") as conn:
        conn.execute("set statement_timeout = 20")
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute(DP_SLOW + " having count(*) > 0")
        assert conn.execute("select 1").fetchone() == (1,)


def test_max_statement_time_in_the_policy_file(truth: psycopg.Connection) -> None:
    text = dump_policy(demo_policy()) + "max_statement_time: {suppress: 1500ms, dp: 2min}\n"
    policy = parse_policy(text)
    assert (policy.statement_limit("suppress"), policy.statement_limit("dp")) == (1500, 120_000)
    assert parse_policy(dump_policy(policy)).max_statement_ms == policy.max_statement_ms
    with pytest.raises(ValueError, match=r"max_statement_time.dp: must be a duration"):
        parse_policy(dump_policy(demo_policy()) + "max_statement_time: {dp: 30}\n")
    with pytest.raises(ValueError, match=r"unknown key 'direct'"):
        parse_policy(dump_policy(demo_policy()) + "max_statement_time: {direct: 1s}\n")
    truth.execute("begin")
    try:
        apply_policy(truth, policy)
        assert load_policy(truth).max_statement_ms == {"suppress": 1500, "dp": 120_000}
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            truth.execute("select anonproxy.set_max_statement_time('direct', '1 s')")
    finally:
        truth.execute("rollback")


# -- Hostile input ----------------------------------------------------------------------------------------------


def test_a_statement_over_the_size_limit_gets_54000_and_the_session_goes_on(endpoint: Endpoint) -> None:
    big = long_statement(300_000)
    assert len(big) > 256 * 1024
    with connect(endpoint, "reporter") as conn:
        with pytest.raises(psycopg.errors.ProgramLimitExceeded, match="statement too long") as error:
            conn.execute(big)
        assert error.value.diag.sqlstate == "54000" and "max_statement_size" in (error.value.diag.message_hint or "")
        assert conn.execute(SMALL).fetchall()[0][1] > 0
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):
            conn.execute(big + " having count(*) > %s", (1,))  # a Parse message
        assert conn.execute(SMALL, prepare=True).fetchall()[0][1] > 0


def test_invalid_utf8_gets_22021(endpoint: Endpoint) -> None:
    statement = b"select sex, count(*) from adult where education = 'Bachelors\xff' group by sex"
    with connect(endpoint, "reporter") as conn:
        result = conn.pgconn.exec_(statement)
        assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"22021"
        assert result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) == \
            b'invalid byte sequence for encoding "UTF8": 0xff'
        result = conn.pgconn.prepare(b"s1", statement.replace(b"\xff", b"\xe2\x28\xa1"))
        assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"22021"
        assert result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY).endswith(b"0xe2 0x28 0xa1")
        assert conn.execute(SMALL).fetchall()[0][1] > 0


def test_a_dba_is_answered_while_a_reporters_long_statement_is_analysed(endpoint: Endpoint) -> None:
    """The analysis runs off the worker's event loop: the dba's answers arrive before the reporter's; and it is
    stopped after analysis_timeout (2 s here) with 54001."""
    events: list[str] = []
    outcome: list[BaseException | object] = []

    def report() -> None:
        with connect(endpoint, "reporter") as conn:
            try:
                outcome.append(conn.execute(long_statement(250_000)).fetchall())
            except psycopg.Error as exc:
                outcome.append(exc)
            events.append("reporter")

    with connect(endpoint, "dba") as dba:
        reporter = threading.Thread(target=report)
        reporter.start()
        time.sleep(0.5)  # let the statement reach the proxy (a wait, not a measurement)
        while reporter.is_alive():
            assert dba.execute("select 1").fetchone() == (1,)
            events.append("dba")
        reporter.join()
    assert "dba" in events[: events.index("reporter")], events
    assert isinstance(outcome[0], psycopg.errors.StatementTooComplex), outcome
    assert "analysis_timeout" in (outcome[0].diag.message_hint or "")
    with connect(endpoint, "reporter") as conn:  # a new analysis process took over
        assert conn.execute(SMALL).fetchall()[0][1] > 0


class RawClient:
    """A client speaking the protocol byte by byte (SCRAM login through anonproxy.wire.auth)."""

    def __init__(self, endpoint: Endpoint, user: str) -> None:
        self.sock = socket.create_connection((endpoint.host, endpoint.port), timeout=30)
        self.messages = MessageBuffer()
        self.sock.sendall(pg.startup_message({"user": user, "database": DATABASE, "client_encoding": "UTF8"}))
        auth = PasswordAuthenticator(user, user)
        while (message := self.receive())[0] != b"Z":
            if message[0] == b"R":
                self.sock.sendall(auth.respond(message[1]))

    def receive(self) -> tuple[bytes, bytes]:
        pending: list[tuple[bytes, bytes]] = getattr(self, "_pending", [])
        while not pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the proxy closed the connection")
            pending.extend(self.messages.feed(data))
        self._pending = pending
        return pending.pop(0)


def worker_memory(process: ProxyProcess, field: str = "VmRSS") -> int:
    """Resident memory (VmRSS), or its peak (VmHWM), of the proxy's one worker (the serving process), in bytes."""
    for line in Path(f"/proc/{process.process.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def peak_growth_from_now(process: ProxyProcess) -> Callable[[], int]:
    """Reset the worker's peak resident memory to its current one; return how to read the growth since."""
    before = worker_memory(process)
    Path(f"/proc/{process.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    return lambda: worker_memory(process, "VmHWM") - before


def test_a_half_received_huge_statement_is_not_buffered(hostile_proxy: ProxyProcess, endpoint: Endpoint) -> None:
    client = RawClient(endpoint, "reporter")
    growth = peak_growth_from_now(hostile_proxy)
    client.sock.sendall(b"Q" + struct.pack("!i", 1 << 30))  # announces a 1 GB statement...
    chunk = b"x" * (1 << 20)
    for _ in range(96):  # ...and sends 96 MB of it
        client.sock.sendall(chunk)
    with connect(endpoint, "dba") as dba:  # the proxy has read what was sent
        assert dba.execute("select 1").fetchone() == (1,)
    assert growth() < 32 << 20
    client.sock.close()


def test_a_huge_row_for_a_gated_role_is_relayed_not_held(hostile_proxy: ProxyProcess, endpoint: Endpoint) -> None:
    """A statement that passes to the client's own connection (no protected table) may return a huge row: the
    proxy forwards it as it arrives instead of holding the whole message."""
    with connect(endpoint, "reporter") as conn:
        growth = peak_growth_from_now(hostile_proxy)
        (value,) = conn.execute("select repeat('x', 96 * 1024 * 1024)").fetchone()
        assert len(value) == 96 << 20
        assert growth() < 32 << 20
        assert conn.execute(SMALL).fetchall()[0][1] > 0


def test_other_oversized_messages_end_the_session(endpoint: Endpoint) -> None:
    client = RawClient(endpoint, "reporter")
    client.sock.sendall(b"B" + struct.pack("!i", 1 << 30))
    type_, body = client.receive()
    assert type_ == b"E" and pg.parse_fields(body)["C"] == "54000", pg.parse_fields(body)
    with pytest.raises(ConnectionError):
        client.receive()


# -- Units: the buffer, the cache, the gate's portals ---------------------------------------------------------


def test_a_bounded_buffer_drops_a_long_statement_as_it_streams_in() -> None:
    buffer = BoundedMessageBuffer({b"Q": 100}, max_size=1000)
    header = b"Q" + struct.pack("!i", 4 + 5000)
    assert buffer.feed(header + b"a" * 10) == [(b"Q", None)]
    for _ in range(4):
        assert buffer.feed(b"a" * 1000) == []
    after = pg.query_message("select 1")
    assert buffer.feed(b"a" * 990 + after) == [(b"Q", b"select 1\0")]
    with pytest.raises(pg.ProtocolViolation):
        buffer.feed(b"B" + struct.pack("!i", 4 + 2000))


def test_a_relaying_buffer_hands_on_a_long_message_in_pieces() -> None:
    buffer = RelayingMessageBuffer(limit=100)
    long = pg.message(b"D", b"y" * 1000)
    small = pg.message(b"Z", b"I")
    out = buffer.feed(small + long[:300])
    assert out == [(b"Z", b"I"), Piece(b"D", long[:300], True)]
    assert buffer.feed(long[300:] + small) == [Piece(b"D", long[300:], False), (b"Z", b"I")]


def test_the_cache_is_bounded_in_bytes() -> None:
    cache: BoundedCache[str, str] = BoundedCache(max_bytes=10_000)
    for index in range(100):
        cache.put(f"key {index}", "x" * 1000, 1000)
        assert cache.bytes <= 10_000
    assert cache.get("key 99") == "x" * 1000 and cache.get("key 0") is None
    cache.put("huge", "y", 20_000)  # alone over the bound: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 8


def _parse(name: bytes, sql: str) -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def _bind(portal: bytes, statement: bytes) -> bytes:
    return pg.message(b"B", portal + b"\0" + statement + b"\0" + struct.pack("!hhh", 0, 0, 0))


def _execute(portal: bytes) -> bytes:
    return pg.message(b"E", portal + b"\0" + struct.pack("!i", 0))


class PolicyGate:
    """A gate whose decisions depend on a policy version the test changes."""

    def __init__(self) -> None:
        self.version = 1
        self.decisions: dict[int, Decision] = {1: Rewrite("old rewrite"), 2: Rewrite("new rewrite"),
                                               3: Reject("42501", "denied"), 4: Noisy("agg")}
        self.client, self.service, self.upstream = bytearray(), bytearray(), bytearray()
        self.gate = Gate(decide=lambda sql: Pass() if sql == "select 1" else self.decisions[self.version],
                         settings=lambda: {}, write_client=self.client.extend, send_upstream=self.upstream.extend,
                         send_service=self.service.extend, ask_proxy=lambda request: None,
                         version=lambda: self.version)

    def service_messages(self) -> list[tuple[bytes, bytes]]:
        messages = MessageBuffer().feed(bytes(self.service))
        self.service.clear()
        return messages


def test_a_named_statement_is_prepared_again_under_a_new_rewrite() -> None:
    wires = PolicyGate()
    wires.gate.client_data(_parse(b"s", "agg") + _bind(b"", b"s") + _execute(b"") + pg.message(b"S"))
    sent = wires.service_messages()
    assert [t for t, _ in sent] == [b"C", b"P", b"B", b"E", b"S"]  # prepared on the service side where first used
    assert pg.parse_parse(sent[1][1]).query == b"old rewrite"
    for type_ in (b"3", b"1", b"2", b"C"):
        wires.gate.service_message(type_, b"SELECT 1\0" if type_ == b"C" else b"")
    wires.gate.service_message(b"Z", b"I")
    wires.client.clear()
    wires.version = 2
    wires.gate.client_data(_bind(b"", b"s") + _execute(b"") + pg.message(b"S"))
    sent = wires.service_messages()
    assert [t for t, _ in sent] == [b"C", b"P", b"B", b"E", b"S"]
    assert pg.parse_parse(sent[1][1]).query == b"new rewrite"
    for type_ in (b"3", b"1", b"2", b"C"):
        wires.gate.service_message(type_, b"SELECT 1\0" if type_ == b"C" else b"")
    wires.gate.service_message(b"Z", b"I")
    # The client sees the answers to its own messages only: BindComplete, CommandComplete, ReadyForQuery.
    assert [t for t, _ in MessageBuffer().feed(bytes(wires.client))] == [b"2", b"C", b"Z"]


def test_a_portal_bound_under_an_older_policy_is_not_executed() -> None:
    wires = PolicyGate()
    wires.gate.client_data(pg.query_message("select 1"))  # (Pass: upstream, which opens a transaction)
    wires.gate.upstream_message(b"Z", b"T")
    wires.gate.client_data(_parse(b"s", "agg") + _bind(b"p", b"s") + pg.message(b"H"))
    wires.service.clear()
    wires.version = 3  # the role is denied now
    wires.gate.client_data(_execute(b"p"))
    assert [t for t, _ in wires.service_messages()] == [b"S"]  # no Execute: the service's part of the batch ends
    wires.gate.service_message(b"Z", b"T")
    error = [body for type_, body in MessageBuffer().feed(bytes(wires.client)) if type_ == b"E"]
    assert pg.parse_fields(error[-1])["C"] == "42501"
    wires.upstream.clear()
    wires.gate.client_data(pg.message(b"S"))
    # In its transaction block, the refusal fails the transaction on the client's connection too.
    assert [t for t, _ in MessageBuffer().feed(bytes(wires.upstream))] == [b"P", b"S"]
    wires = PolicyGate()  # the rest in a new session's transaction block
    wires.gate.client_data(pg.query_message("select 1"))
    wires.gate.upstream_message(b"Z", b"T")
    wires.version = 2  # a new rewrite: the portal of the old one must be bound again
    wires.gate.client_data(_parse(b"s2", "agg") + _bind(b"q", b"s2") + pg.message(b"H"))
    wires.version = 4
    wires.gate.client_data(_execute(b"q"))
    assert [t for t, _ in wires.service_messages()] == [b"C", b"P", b"B", b"H", b"S"]
    wires.gate.service_message(b"Z", b"T")
    error = [body for type_, body in MessageBuffer().feed(bytes(wires.client)) if type_ == b"E"]
    assert pg.parse_fields(error[-1])["C"] == "55000"


def test_the_gate_stops_reading_while_too_much_waits() -> None:
    paused: list[bool] = []
    sent: list[bytes] = []
    decisions: dict[str, Decision] = {}  # none yet: the first statement is "being analysed"
    gate = Gate(decide=decisions.get, settings=lambda: {}, write_client=lambda data: None,
                send_upstream=sent.append, send_service=lambda data: None, ask_proxy=lambda request: None,
                pause_client=paused.append)
    sql = "select 1 -- " + "x" * 100_000
    for _ in range(20):  # 2 MB: the first waits for its decision, the others behind it
        gate.client_data(pg.query_message(sql))
    assert paused == [True] * len(paused) and paused
    decisions[sql] = Pass()
    gate.decided(sql, Pass(), 0)
    assert len(sent) == 20 and paused[-1] is False  # all on their way (to one owner): reading again
