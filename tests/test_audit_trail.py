"""The audit trail (docs/audit-trail.md) through the real gated proxy, its SQL functions and its command.

The gated proxy is shared by the whole session: each test marks its statements with a tag of its own (a
comment) and reads back only the rows whose text holds it. Records reach the database asynchronously (the
proxy flushes its buffer at least every second): ``wait_for_records`` polls until they are there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path

import psycopg
import pytest
from conftest import SERVICE_ROLE, Endpoint, free_port, start_proxy, stop_proxy
from psycopg.types.json import Jsonb
from test_dp_proxy import analyst  # noqa: F401  (fixtures)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.audit_trail import (
    AuditTrail,
    TrailUnavailable,
    Who,
    execution_record,
)
from anonproxy.proxy.gate import Execution
from anonproxy.route.decision import Pass
from anonproxy.wire import protocol as pg

WAIT = 20.0  # seconds a record may take to reach the database before a test gives up
_runs = itertools.count(1)


def tag() -> str:
    return f"trail-{uuid.uuid4().hex[:12]}"


def records(owner: psycopg.Connection, marker: str) -> list[dict]:
    with owner.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from anonproxy.audit_trail where statement like %s order by at, id",
                           [f"%{marker}%"]).fetchall()


def wait_for_records(owner: psycopg.Connection, marker: str, count: int) -> list[dict]:
    deadline = time.monotonic() + WAIT
    while True:
        found = records(owner, marker)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_owner_sees_each_statement_its_decision_and_its_charge(
        gated_proxy: Endpoint, gated_database: str, analyst: str, truth: psycopg.Connection) -> None:  # noqa: F811
    marker = tag()
    answered = f"/* {marker} r1 */ select sex, count(*) from adult group by 1"
    refused = f"/* {marker} r2 */ select * from adult"
    catalog = f"/* {marker} r3 */ select count(*) from pg_catalog.pg_class"
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        assert len(conn.execute(answered).fetchall()) == 2
        with pytest.raises(psycopg.Error) as raised:
            conn.execute(refused)
        refused_state = raised.value.sqlstate
        conn.execute(catalog)
    question = f"/* {marker} a1 */ select sex, count(*) from adult group by 1"
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        conn.execute(question).fetchall()  # charged: ε 0.5, δ 1e-7
        conn.execute(question).fetchall()  # the same question: answered from the cache, free
        conn.execute(f"/* {marker} a2 */ select count(*) from adult where age > %s", [30])  # extended protocol
        with pytest.raises(psycopg.Error) as raised:
            conn.execute(f"/* {marker} a3 */ select age from adult")
        dp_refused_state = raised.value.sqlstate
        conn.execute(f"/* {marker} a4 */ show anonproxy.budget").fetchone()  # answered by the proxy itself

    found = wait_for_records(truth, marker, 8)
    by_text = [(r["login"], r["statement"].split("*/")[0].split()[-1], r["decision"], r["sqlstate"]) for r in found]
    assert by_text == [
        ("reporter", "r1", "answered", None),
        ("reporter", "r2", "refused", refused_state),
        ("reporter", "r3", "passed", None),
        (analyst, "a1", "answered", None),
        (analyst, "a1", "answered", None),
        (analyst, "a2", "answered", None),
        (analyst, "a3", "refused", dp_refused_state),
        (analyst, "a4", "answered", None),
    ]
    r1, r2, r3, a1, a1_again, a2, a3, a4 = found
    assert refused_state == "42501" and r2["message"].startswith("SELECT * is not allowed")
    for record in found:
        assert record["database"] == gated_database
        assert str(record["client_addr"]) == "127.0.0.1" and record["client_port"] > 0
        assert record["mode"] == ("suppress" if record["login"] == "reporter" else "dp")
    assert r1["relations"] == ["public.adult"] and r1["epsilon"] is None
    assert r3["relations"] == []
    assert r1["session_id"] == r2["session_id"] == r3["session_id"] != a1["session_id"]
    # The charges are the ledger's: a1 and a2 each charged the per-query ε, the cached answer nothing.
    charged = truth.execute("select epsilon, delta, rho, delta_add from anonproxy.budget_ledger "
                            "where role_name = %s order by id", [analyst]).fetchall()
    assert [(r["epsilon"], r["delta"], r["rho"], r["delta_add"]) for r in (a1, a2)] == charged
    assert a1["epsilon"] == a2["epsilon"] == Decimal("0.5") and a1["rho"] > 0 and a2["rho"] > 0
    assert (a1_again["epsilon"], a1_again["delta"], a1_again["rho"], a1_again["delta_add"]) == (0, 0, 0, 0)
    assert r1["rho"] is None and a3["rho"] is None and a4["rho"] is None
    assert a1["relations"] == a2["relations"] == ["public.adult"]
    assert (a1["rows_sent"], a2["rows_sent"]) == (2, 1)
    assert a3["epsilon"] is None and a3["sqlstate"] == dp_refused_state
    assert a4["epsilon"] is None and a4["rows_sent"] == 1


def test_gated_roles_and_the_service_role_cannot_read_the_trail(
        gated_proxy: Endpoint, gated_database: str, pg_server: EmbeddedPostgres) -> None:
    for role in ("reporter", "analyst"):
        with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
            for statement in ("select count(*) from anonproxy.audit_trail",
                              "select retention from anonproxy.audit_settings"):
                with pytest.raises(psycopg.Error) as raised:
                    conn.execute(statement)
                assert raised.value.sqlstate == "42501", (role, statement)
        # Directly on PostgreSQL too: no privilege, and the writer functions check their caller.
        with psycopg.connect(pg_server.conninfo(dbname=gated_database, user=role, password=role),
                             autocommit=True) as conn:
            for statement in ("select count(*) from anonproxy.audit_trail",
                              "select anonproxy.audit_write('[]')", "select anonproxy.audit_purge()",
                              "select anonproxy.set_audit_retention('1 day')"):
                with pytest.raises(psycopg.Error) as raised:
                    conn.execute(statement)
                assert raised.value.sqlstate == "42501", (role, statement)
    with psycopg.connect(pg_server.conninfo(dbname=gated_database, user=SERVICE_ROLE, password=SERVICE_ROLE),
                         autocommit=True) as service:
        assert service.execute("select anonproxy.audit_write('[]')").fetchone() == (0,)  # it may append
        for statement in ("select count(*) from anonproxy.audit_trail", "delete from anonproxy.audit_trail",
                          "select anonproxy.set_audit_retention('1 day')"):
            with pytest.raises(psycopg.Error) as raised:
                service.execute(statement)
            assert raised.value.sqlstate == "42501", statement


def _write(conn: psycopg.Connection, marker: str, ages_days: list[int]) -> None:
    now = time.time()
    conn.execute("select anonproxy.audit_write(%s)", [Jsonb([
        {"at": now - days * 86400, "login": "reporter", "database": "db", "session_id": "1.1", "mode": "suppress",
         "statement": f"/* {marker} {days} days */ select 1", "decision": "passed"} for days in ages_days])])


def test_retention_deletes_old_rows(postgresql: psycopg.Connection) -> None:
    postgresql.autocommit = True
    marker = tag()
    _write(postgresql, marker, [200, 100, 89, 0])
    assert postgresql.execute("select retention from anonproxy.audit_settings").fetchone() == (timedelta(days=90),)
    assert postgresql.execute("select anonproxy.audit_purge()").fetchone() == (2,)
    assert [r["statement"].split()[2] for r in records(postgresql, marker)] == ["89", "0"]
    postgresql.execute("select anonproxy.set_audit_retention('1 day')")
    assert postgresql.execute("select anonproxy.audit_purge()").fetchone() == (1,)
    assert [r["statement"].split()[2] for r in records(postgresql, marker)] == ["0"]
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        postgresql.execute("select anonproxy.set_audit_retention('-1 day')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="never updated"):
        postgresql.execute("update anonproxy.audit_trail set login = 'someone'")


def test_a_row_the_database_refuses_fails_only_that_row(gated_database: str, pg_server: EmbeddedPostgres,
                                                        truth: psycopg.Connection) -> None:  # noqa: F811
    marker = tag()
    service = pg_server.conninfo(dbname=gated_database, user=SERVICE_ROLE, password=SERVICE_ROLE)
    bad = Who("reporter", gated_database, f"test.{next(_runs)}", "not an address", 5)
    good = Who("reporter", gated_database, f"test.{next(_runs)}", "127.0.0.1", 5)

    async def scenario() -> list[BaseException | None]:
        writer = AuditTrail(service)
        await writer.start()
        # Asked for together: one batch, in which inet refuses the first address.
        outcomes = await asyncio.gather(
            *(writer.write(execution_record(who, "suppress", Execution(f"/* {marker} {name} */ select 1", Pass())))
              for who, name in ((bad, "bad"), (good, "good1"), (good, "good2"))), return_exceptions=True)
        await writer.stop()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[0], TrailUnavailable) and outcomes[1:] == [None, None]
    assert [r["statement"].split()[2] for r in records(truth, marker)] == ["good1", "good2"]


def test_an_unreachable_database_fails_the_write(gated_database: str, pg_server: EmbeddedPostgres) -> None:
    who = Who("reporter", gated_database, f"test.{next(_runs)}", "127.0.0.1", 5)

    async def scenario() -> None:
        writer = AuditTrail(f"host=127.0.0.1 port={free_port()} user={SERVICE_ROLE} connect_timeout=2", timeout=5)
        await writer.start()
        try:
            with pytest.raises(TrailUnavailable):
                await writer.write(execution_record(who, "suppress", Execution("select 1", Pass())))
        finally:
            await writer.stop()

    asyncio.run(scenario())


def test_each_row_is_committed_before_the_answer_leaves(gated_proxy: Endpoint, gated_database: str,
                                                         truth: psycopg.Connection) -> None:  # noqa: F811
    """No polling: when the client holds the answer, its row is already in the table (and stays one row)."""
    marker = tag()
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        for n in range(20):
            conn.execute(f"/* {marker} {n} */ select sex, count(*) from adult where age > {n + 20} group by 1")
            assert len(records(truth, marker)) == n + 1
    with psycopg.connect(gated_proxy.dsn(gated_database, user="analyst"), autocommit=True) as conn:
        conn.execute(f"/* {marker} dp */ select count(*) from adult where age > %s", [int(time.time()) % 40 + 20])
        found = records(truth, marker)
        assert len(found) == 21 and found[-1]["login"] == "analyst" and found[-1]["epsilon"] > 0


def test_a_prepared_statement_is_one_row_per_execution_with_its_values(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    marker = tag()
    statement = f"/* {marker} */ select sex, count(*) from adult where age <> %s group by 1"
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        for age in (30, 31, 32):
            conn.execute(statement, [age], prepare=True).fetchall()
        conn.execute(statement, [None], prepare=True).fetchall()
        conn.execute(statement, [33], binary=True).fetchall()
    found = records(truth, marker)
    assert [r["parameters"] for r in found] == [["30"], ["31"], ["32"], [None], ["33"]]
    assert all(r["decision"] == "answered" and r["relations"] == ["public.adult"] for r in found)


def test_asyncpg_without_a_statement_cache_leaves_one_row_per_execution(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    asyncpg = pytest.importorskip("asyncpg")
    marker = tag()

    async def scenario() -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database, statement_cache_size=0)
        try:
            for age in (40, 41):
                await conn.fetch(f"/* {marker} */ select sex, count(*) from adult where age > $1 group by 1", age)
        finally:
            await conn.close()

    asyncio.run(scenario())
    # asyncpg leaves the types to the server and binds in binary: values of undeclared type are kept in hex.
    assert [r["parameters"] for r in records(truth, marker)] == [["\\x00000028"], ["\\x00000029"]]


def test_no_byte_sequence_fails_a_row_and_the_text_is_kept_whole(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    marker = tag()
    padding = "x" * 20_000
    texts = [f"/* {marker} nul \0 in a comment */ select sex, count(*) from adult group by 1",
             f"/* {marker} controls \x01\x1b[31m\x7f */ select sex, count(*) from adult group by 1",
             f"/* {marker} long {padding} */ select race, count(*) from adult group by 1"]
    replies = _raw_session(gated_proxy, gated_database, "reporter",
                           b"".join(pg.query_message(text) for text in texts)
                           + pg.message(b"Q", f"/* {marker} bad utf8 ".encode() + b"\xff */\0"))
    assert replies.count(b"Z") == 4
    found = records(truth, marker)
    assert [r["decision"] for r in found] == ["answered", "answered", "answered", "refused"]
    assert found[0]["statement"] == texts[0].replace("\0", "\u2400")
    assert found[1]["statement"] == texts[1]
    assert found[2]["statement"] == texts[2] and found[2]["statement_sha256"] is None
    assert found[3]["sqlstate"] == "22021" and "\ufffd" in found[3]["statement"]


def test_a_statement_over_the_limit_and_a_framing_error_are_rows(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    def rows(sqlstate: str) -> list[str]:
        return [row[0] for row in truth.execute("select statement from anonproxy.audit_trail where sqlstate = %s "
                                                "and login = 'reporter' order by id", [sqlstate])]

    too_long, broken = len(rows("54000")), len(rows("08P01"))
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):
            conn.execute("select count(*) from adult where age in (" + ",".join(["1"] * 200_000) + ")")
        conn.execute("select 1")  # the session goes on
    assert len(rows("54000")) == too_long + 1 and rows("54000")[-1].startswith("(not read: longer than")
    # A Bind whose parameter count runs past its end: the session ends, and its row says why.
    # A message whose length field is shorter than the length field itself: the session ends, and its row says why.
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.settimeout(WAIT)
            sock.sendall(b"Q\0\0\0\x02")
            while sock.recv(1 << 16):
                pass  # until the proxy hangs up
    deadline = time.monotonic() + WAIT
    while len(rows("08P01")) == broken and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(rows("08P01")) == broken + 1 and rows("08P01")[-1] == "(not read: the message broke the protocol)"


def test_a_flood_of_refusals_slows_the_flooder_and_loses_nothing(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    """Pipelined refusals with a differencing statement answered among them: every one is a row."""
    marker = tag()
    refused = pg.query_message(f"/* {marker} r */ select fnlwgt from adult")
    answered = [pg.query_message(f"/* {marker} a{n} */ select sex, count(*) from adult where age <> {n + 30} "
                                 "group by 1") for n in range(6)]
    flood = b"".join(refused * 500 + answered[n] for n in range(6))
    replies = _raw_session(gated_proxy, gated_database, "reporter", flood)
    assert replies.count(b"Z") == 3006
    counts = dict(truth.execute("select decision, count(*) from anonproxy.audit_trail where statement like %s "
                                "group by 1", [f"%{marker}%"]).fetchall())
    assert counts == {"refused": 3000, "answered": 6}


def test_a_cursor_declared_in_a_script_is_answered_with_its_tables(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    """psqlODBC's way: BEGIN; DECLARE … WITH HOLD FOR <aggregate>; FETCH in one Query."""
    marker = tag()
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        conn.execute(f"BEGIN; DECLARE {marker.replace('-', '_')} CURSOR WITH HOLD FOR "
                     f"select /* {marker} */ sex, count(*) from adult group by 1; "
                     f"FETCH 10 IN {marker.replace('-', '_')}")
        conn.execute("COMMIT")
    answered = truth.execute("select relations from anonproxy.audit_trail where statement like %s "
                             "and decision = 'answered'", [f"%{marker}%"]).fetchall()
    assert answered == [(["public.adult"],)]


def test_a_trail_that_cannot_be_written_refuses_the_statement(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:  # noqa: F811
    """A row the database refuses (here a constraint the owner added) is a statement not answered."""
    truth.execute("alter table anonproxy.audit_trail add constraint no_reporter check (login <> 'reporter') not valid")
    try:
        with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute("select sex, count(*) from adult group by 1")
            assert raised.value.sqlstate == "58030" and "audit trail" in str(raised.value)
            assert raised.value.diag.message_hint is not None
            truth.execute("alter table anonproxy.audit_trail drop constraint no_reporter")
            assert len(conn.execute("select sex, count(*) from adult group by 1").fetchall()) == 2
    finally:
        truth.execute("alter table anonproxy.audit_trail drop constraint if exists no_reporter")


def test_a_worker_killed_under_load_loses_no_answered_row(pg_server: EmbeddedPostgres, gated_database: str,
                                                          truth: psycopg.Connection,  # noqa: F811
                                                          tmp_path: Path) -> None:
    """kill -9 of the proxy while four sessions are answered: every answer a client received has its row."""
    marker = tag()
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / "killed.log", workers="1",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}")
    received: list[str] = []

    def client(number: int) -> None:
        with contextlib.suppress(psycopg.Error), psycopg.connect(
                proxy.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as conn:
            for n in itertools.count():
                text = f"/* {marker} {number}.{n} */ select sex, count(*) from adult where age > {n % 40 + 20} group by 1"
                conn.execute(text).fetchall()
                received.append(text)

    try:
        _wait_for_gate(proxy.endpoint, gated_database)
        threads = [threading.Thread(target=client, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + WAIT
        while len(received) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.process.kill()
        for thread in threads:
            thread.join(WAIT)
    finally:
        proxy.process.kill()
        proxy.process.wait()
    answered = set(received)
    recorded = {r["statement"] for r in records(truth, marker)}
    assert len(answered) >= 200 and answered <= recorded


def _raw_session(endpoint: Endpoint, database: str, user: str, messages: bytes) -> bytes:
    """Log in with psycopg, then send ``messages`` at once on its socket and read until one ReadyForQuery per
    Query: the answers' message types, in order (what psycopg cannot send: a NUL in a text, pipelined Queries)."""
    with psycopg.connect(endpoint.dsn(database, user=user), autocommit=True) as conn:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.settimeout(120)
            sock.sendall(messages)
            reader, types, expected = _Reader(sock), bytearray(), _queries(messages)
            while types.count(b"Z") < expected:
                types += reader.next()[0]
        return bytes(types)


def _queries(messages: bytes) -> int:
    count, offset = 0, 0
    while offset < len(messages):
        count += messages[offset:offset + 1] == b"Q"
        offset += 1 + int.from_bytes(messages[offset + 1:offset + 5], "big")
    return count


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def next(self) -> tuple[bytes, bytes]:
        while len(self._buffer) < 5 or len(self._buffer) < 1 + int.from_bytes(self._buffer[1:5], "big"):
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the proxy closed the connection")
            self._buffer += chunk
        size = 1 + int.from_bytes(self._buffer[1:5], "big")
        message, self._buffer = self._buffer[:size], self._buffer[size:]
        return message[:1], message[5:]


def trail_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "trail", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def sessions(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> Iterator[str]:  # noqa: F811
    """A reporter's and the demo analyst's statements, tagged, in the trail; yields the tag."""
    marker = tag()
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        conn.execute(f"/* {marker} */ select race, count(*) from adult group by 1").fetchall()
        for _ in range(3):
            with pytest.raises(psycopg.Error):
                conn.execute(f"/* {marker} */ select fnlwgt from adult")
    with psycopg.connect(gated_proxy.dsn(gated_database, user="analyst"), autocommit=True) as conn:
        conn.execute(f"/* {marker} */ select count(*) from adult where age < %s", [int(time.time()) % 50 + 20])
        with pytest.raises(psycopg.Error):
            conn.execute(f"/* {marker} */ select fnlwgt from adult")
    assert len(wait_for_records(truth, marker, 6)) == 6
    yield marker


def test_the_command_prints_the_filtered_rows(sessions: str, pg_server: EmbeddedPostgres,
                                              gated_database: str) -> None:
    owner = pg_server.conninfo(dbname=gated_database)
    since = (datetime.now() - timedelta(minutes=10)).isoformat(timespec="seconds")
    shown = trail_command("--dsn", owner, "--role", "reporter", "--since", since, "--limit", "1000")
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if sessions in line]
    assert len(lines) == 4
    assert all(" reporter " in line and " suppress " in line for line in lines)
    assert sum(" refused 42501 " in line for line in lines) == 3
    assert sum(" answered " in line and "public.adult" in line for line in lines) == 1
    assert shown.stdout.splitlines()[0].split()[:3] == ["time", "login", "client"]
    # The other filters: a login, a time window, a limit.
    analyst_only = trail_command("--dsn", owner, "--role", "analyst", "--since", since, "--limit", "1000")
    assert [" analyst " in line for line in analyst_only.stdout.splitlines() if sessions in line] == [True, True]
    future = trail_command("--dsn", owner, "--since", "2999-01-01")
    assert future.returncode == 0 and sessions not in future.stdout and "(0 statements)" in future.stdout
    past = trail_command("--dsn", owner, "--until", "2000-01-01")
    assert sessions not in past.stdout
    one = trail_command("--dsn", owner, "--limit", "1")
    assert one.stdout.strip().endswith("(1 statement)")


def test_the_command_refuses_a_gated_role(sessions: str, pg_server: EmbeddedPostgres, gated_database: str) -> None:
    shown = trail_command("--dsn", pg_server.conninfo(dbname=gated_database, user="reporter", password="reporter"))
    assert shown.returncode == 1
    assert "permission denied" in shown.stderr and "owner of the anonproxy schema" in shown.stderr
    assert "Traceback" not in shown.stderr


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.headings: list[str] = []
        self.cells: list[str] = []
        self._into: list[str] | None = None

    def handle_starttag(self, name: str, attrs: list[tuple[str, str | None]]) -> None:
        if name == "img":
            self.images.append(dict(attrs))
        elif name in ("h2", "td"):
            self._into = self.headings if name == "h2" else self.cells
            self._into.append("")

    def handle_endtag(self, name: str) -> None:
        if name in ("h2", "td"):
            self._into = None

    def handle_data(self, data: str) -> None:
        if self._into is not None:
            self._into[-1] += data


def test_the_html_page_shows_budgets_spent_and_refused_statements(
        sessions: str, pg_server: EmbeddedPostgres, gated_database: str, tmp_path: Path) -> None:
    out = tmp_path / "trail.html"
    made = trail_command("--dsn", pg_server.conninfo(dbname=gated_database), "--html", str(out))
    assert made.returncode == 0, made.stderr
    page = _Page()
    page.feed(out.read_text(encoding="utf-8"))
    assert page.headings == ["Privacy budget spent by each dp role", "Statements refused most often"]
    assert len(page.images) == 2
    for image in page.images:
        src = image["src"] or ""
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "analyst" in page.cells  # a row of the budget table
    assert f"/* {sessions} */ select fnlwgt from adult" in page.cells  # refused three times by the reporter


def test_the_trail_can_be_turned_off(pg_server: EmbeddedPostgres, gated_database: str,
                                     truth: psycopg.Connection, tmp_path: Path) -> None:  # noqa: F811
    marker = tag()
    settings = {"service_dsn": f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}"}
    for audit_trail in ("off", "on"):
        proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / f"{audit_trail}.log",
                            audit_trail=audit_trail, **settings)
        try:
            _wait_for_gate(proxy.endpoint, gated_database)
            with psycopg.connect(proxy.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as conn:
                conn.execute(f"/* {marker} {audit_trail} */ select sex, count(*) from adult group by 1").fetchall()
        finally:
            stop_proxy(proxy)  # a proxy that stops writes its buffer first
        assert "Traceback" not in proxy.log()
    assert [r["statement"].split()[2] for r in records(truth, marker)] == ["on"]


def _wait_for_gate(endpoint: Endpoint, database: str) -> None:
    """The proxy refuses gated roles until it has loaded the policy."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            with psycopg.connect(endpoint.dsn(database, user="reporter"), autocommit=True) as conn:
                conn.execute("show anonproxy.mode")
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

