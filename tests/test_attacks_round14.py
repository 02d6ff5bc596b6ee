"""Red team, round 14: the protocol layer (anonproxy/proxy/gate*.py, routing, prepared statements and portals, the
service pool, the audit trail, cancel keys) attacked by a reader of the code, through the real gated proxy, with
the wire protocol written by hand where drivers cannot.

Attacked, each asserting the safe outcome: Flush without Sync; a portal suspended with max_rows, closed, executed
again; a portal read to its end, executed again in later batches; a simple Query inside an unfinished extended
batch; the client's statements and portals named as the proxy's kept portals; Describe of a rewritten statement
(what RowDescription tells: PostgreSQL's names and types, nothing more); a huge value bound where a constant is
needed, 20000 bound parameters; COPY both ways and DO blocks; notifications, advisory locks, set_config, pg_sleep
and nextval called per row of a gated aggregate (one person's value would leave through a channel, pg_locks or
pg_stat_activity); the trail's writer functions called by a gated role; more sessions than the pool has connections
idle in transaction blocks (some with a suspended portal); the trail locked by its owner while a statement waits for
its row; cancel requests with wrong keys and with the service backend's process id; clients gone while their
statements run, or right after an error on the service connection in an open batch; SET ROLE and SET SESSION
AUTHORIZATION; a client statement of the proxy's own name (``anonproxy.failed``); a dp portal read in parts, closed
and bound again (one charge); a dp answer flushed without Sync, then a Query inside that open batch (each charged
once).

Two gaps are fixed with this round (their tests failed before):

* a value bound where the statement needs a constant is written into the text the proxy analyses, and a value past
  max_statement_size made a text longer than any a client may send (a 300 KB LIKE pattern was analysed and
  answered); it is now refused with 54000;
* in a transaction block, a rewritten portal read to its end in the batch of its Bind was run again from its Bind
  by an Execute in a later batch, which got the whole answer a second time (on the data of that moment, without
  a row of its own in the audit trail) where PostgreSQL sends SELECT 0; it now gets SELECT 0.

Departures from PostgreSQL found that reveal nothing, since fixed (tests/test_gated_statement_management.py): a
DEALLOCATE of a rewritten statement's name went to the client's connection, which answered 26000 (the statement
lives on the service side) where PostgreSQL deallocates it; after DEALLOCATE ALL or DISCARD ALL a rewritten
statement still bound and ran where PostgreSQL answers 26000; a Describe of a rewritten portal in a later batch
than its Bind, before an Execute there kept it, got 34000.
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
from conftest import SERVICE_ROLE, Endpoint, fresh_dp_role

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


def _read_to_end_then_again(session: Raw) -> list[list[Message]]:
    """In a transaction block, a portal read to its end in the batch of its Bind, then executed in later batches,
    without and with a row limit."""
    assert session.query("begin")[-1] == (b"Z", b"T")
    session.send(parse(AGGREGATE), bind(portal=b"done"), execute(b"done"), SYNC)
    answers = [session.until(b"Z")]
    for later in (execute(b"done"), execute(b"done", max_rows=1)):
        session.send(later, SYNC)
        answers.append(session.until(b"Z"))
    assert session.query("rollback")[-1] == (b"Z", b"I")
    return answers


def test_a_portal_read_to_its_end_is_not_run_again_in_a_later_batch(reporter: Raw, postgresql_raw: Raw) -> None:
    """A rewritten portal read to its end stays at its end, as PostgreSQL's: an Execute of it in a later batch of
    the transaction gets no row (SELECT 0). Before, the proxy ran it again from its Bind (its service-side portal
    had ended at the Sync) and sent the whole answer a second time: a statement run again, on the data of that
    moment, without a row of its own in the audit trail."""
    got = _read_to_end_then_again(reporter)
    direct = _read_to_end_then_again(postgresql_raw)
    assert [types(answer) for answer in got] == [types(answer) for answer in direct]
    assert got[1:] == direct[1:] == [[(b"C", b"SELECT 0\0"), (b"Z", b"T")]] * 2
    assert len(rows(got[0])) == len(rows(direct[0]))


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

@pytest.mark.parametrize("role", ["reporter", "dp_round14"])
def test_describe_of_a_gated_statement_tells_what_postgresql_tells(
        analyst14: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str, postgresql_raw: Raw,
        role: str) -> None:
    """A Describe of a rewritten or dp statement (before any Bind) tells its parameter types and its columns' names
    and types as PostgreSQL's Describe of the client's statement does: nothing of the rewrite, nothing of the
    data; and it costs no budget."""
    sql = "select sex, count(*) as n, avg(age), sum(hours_per_week) from public.adult where age > $1 group by sex"
    session = Raw(gated_proxy.dsn(gated_database, user=role))
    try:
        budget = session.query("show anonproxy.budget")
        answers = []
        for asked in (session, postgresql_raw):
            asked.send(parse(sql, b"described"), describe(b"S", b"described"), SYNC)
            answers.append(asked.until(b"Z"))
        assert session.query("show anonproxy.budget") == budget
    finally:
        session.close()
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


SIDE_EFFECTS = [
    "select count(*) from public.adult where pg_notify('round14', id::text) is null",
    "select count(*) from public.adult where pg_advisory_lock(id) is null",
    "select count(*) from public.adult where pg_try_advisory_xact_lock(id) and age > 30",
    "select count(*) from public.adult where set_config('application_name', id::text, false) is not null",
    "select count(*) from public.adult where set_config('round14.x', id::text, false) is not null",
    "select count(*) from public.adult where pg_sleep(0) is null",
    "select sum(length(pg_notify('round14', age::text)::text)) from public.adult",
    "select count(*) filter (where pg_advisory_unlock_all() is null) from public.adult",
    "select count(*) from public.adult where nextval('round14') > 0",
    "select count(*) from public.adult where pg_backend_pid() > 0 and current_setting('round14.x', true) = id::text",
]


@pytest.fixture(scope="module")
def listener(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """A session of the database's superuser listening on the channel the attacks notify."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        conn.execute("listen round14")
        yield conn


@pytest.fixture(scope="module")
def analyst14(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
              gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_round14", epsilon=1000), \
            psycopg.connect(gated_proxy.dsn(gated_database, user="dp_round14"), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def reporter14(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def _service_traces(truth: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Advisory locks and application names of the service role's backends, which the attacks would touch."""
    return truth.execute("select 'lock', l.objid::text from pg_locks l join pg_stat_activity a using (pid) "
                         "where l.locktype = 'advisory' and a.usename = %s "
                         "union all select 'name', application_name from pg_stat_activity "
                         "where usename = %s and application_name !~ '^(anonproxy( |$)|$)'",
                         [SERVICE_ROLE, SERVICE_ROLE]).fetchall()


@pytest.mark.parametrize("sql", SIDE_EFFECTS)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_function_with_side_effects_never_runs_on_the_service_connection(
        reporter14: psycopg.Connection[Any], analyst14: psycopg.Connection[Any], listener: psycopg.Connection[Any],
        truth: psycopg.Connection[Any], role: str, sql: str) -> None:
    """Notifications, advisory locks, settings and sleeps called per row of a gated aggregate would send one
    person's values out of the answer (a NOTIFY the attacker listens to, a lock or application_name any session
    sees in pg_locks and pg_stat_activity) or hold a pooled connection: refused before anything runs."""
    conn = reporter14 if role == "reporter" else analyst14
    with pytest.raises(psycopg.Error) as refused:
        conn.execute(sql).fetchall()
    assert refused.value.sqlstate is not None and not refused.value.sqlstate.startswith("XX")
    assert not list(listener.notifies(timeout=0, stop_after=1))
    assert _service_traces(truth) == []


def test_a_gated_role_cannot_forge_or_purge_the_audit_trail(reporter14: psycopg.Connection[Any],
                                                           truth: psycopg.Connection[Any]) -> None:
    """The trail's writer functions keep PUBLIC's EXECUTE and check their caller: called by a gated role on its
    own connection (where the proxy passes catalog-like statements), they refuse and write nothing."""
    before = truth.execute("select count(*) from anonproxy.audit_trail").fetchone()[0]
    forged = '[{"at": 0, "login": "dba", "database": "x", "session_id": "x", "mode": "suppress", ' \
             '"statement": "forged", "decision": "answered"}]'
    for sql, params in [("select anonproxy.audit_write(%s::jsonb)", [forged]),
                        ("select anonproxy.audit_purge()", None),
                        ("delete from anonproxy.audit_trail", None),
                        ("truncate anonproxy.audit_trail", None)]:
        with pytest.raises(psycopg.Error) as refused:
            reporter14.execute(sql, params)
        assert refused.value.sqlstate == "42501", (sql, refused.value)
    assert truth.execute("select count(*) from anonproxy.audit_trail where statement = 'forged'").fetchone()[0] == 0
    assert truth.execute("select count(*) from anonproxy.audit_trail").fetchone()[0] >= before


# -- holding the service pool ------------------------------------------------------------------------------------

POOL = 2 * 10  # the gated proxy's service connections: 2 workers, service_pool_size 10 each


def _idle_in_a_block(session: Raw, suspended: bool) -> None:
    """A transaction block left open after a gated answer: read whole, or a portal suspended after one row (which
    PostgreSQL keeps across the Sync, until the block ends)."""
    assert session.query("begin")[-1] == (b"Z", b"T")
    if suspended:
        session.send(parse(AGGREGATE), bind(portal=b"kept"), execute(b"kept", max_rows=1), SYNC)
        got = session.until(b"Z")
        assert types(got) == [b"1", b"2", b"D", b"s", b"Z"], got
    else:
        assert simple_answer(session, AGGREGATE)


def test_sessions_idle_in_transaction_blocks_hold_no_service_connection(gated_proxy: Endpoint,
                                                                       gated_database: str) -> None:
    """More sessions than the pool has connections each open a transaction block, get a gated answer (half of them
    leave a portal suspended in it) and sit idle: another session's gated statement is answered (it would wait
    service_wait_timeout and fail if they held the pool), and the suspended portals go on from where they were."""
    sessions = [Raw(gated_proxy.dsn(gated_database, user="reporter")) for _ in range(POOL + 2)]
    try:
        for number, session in enumerate(sessions):
            _idle_in_a_block(session, suspended=number % 2 == 0)
        with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as victim:
            expected = victim.execute(AGGREGATE).fetchall()
        first = sessions[0]
        first.send(execute(b"kept"), SYNC)
        got = first.until(b"Z")
        assert types(got) == [b"D"] * (len(expected) - 1) + [b"C", b"Z"], got
        assert [tuple(value.decode() for value in row) for row in rows(got)] == \
            [(sex, str(count)) for sex, count in expected[1:]]
    finally:
        for session in sessions:
            session.close()



def test_clients_gone_mid_batch_after_a_service_error_leave_no_connection_behind(gated_proxy: Endpoint,
                                                                                gated_database: str) -> None:
    """More clients than the pool has connections each leave a batch open on a service connection right after an
    error there (PostgreSQL then skips everything up to a Sync: a connection handed on so would ignore the next
    session's statements) and hang up: the next sessions are answered as PostgreSQL answers them."""
    failing = "select count(*) from public.adult where age > 2147483647 + 1"  # 22003 where the answer is made
    for _ in range(POOL + 2):
        session = Raw(gated_proxy.dsn(gated_database, user="reporter"))
        session.send(parse(failing), bind(), execute(), FLUSH)
        assert errors(session.until(b"E")) == ["22003"]
        session.close()
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as victim:
        for _ in range(POOL + 2):
            assert victim.execute(AGGREGATE).fetchall()

# -- the audit trail and cancel requests ---------------------------------------------------------------------------


def _waiting_on_a_lock(truth: psycopg.Connection[Any], application_name: str, count: int = 1) -> int:
    """The process id of a backend of that name once ``count`` of them wait on a lock (bounded poll)."""
    deadline = time.monotonic() + READ_LIMIT  # a bound on a hang, not a timing
    while True:
        found = truth.execute("select pid from pg_stat_activity where application_name = %s "
                              "and wait_event_type = 'Lock'", [application_name]).fetchall()
        if len(found) >= count:
            return int(found[0][0])
        assert time.monotonic() < deadline, f"not {count} {application_name} waited on the lock"
        time.sleep(0.02)


def _trail_rows(truth: psycopg.Connection[Any], marker: str) -> list[tuple[Any, ...]]:
    return truth.execute("select decision, sqlstate from anonproxy.audit_trail where statement like %s",
                         [f"%{marker}%"]).fetchall()


def test_no_answer_leaves_while_the_trail_writer_is_held(reporter: Raw, truth: psycopg.Connection[Any],
                                                         pg_server: EmbeddedPostgres, gated_database: str) -> None:
    """The table's owner locks the trail, so the proxy's writer waits: the gated statement's answer does not leave
    while its row is not written; once the lock goes, the answer comes with its row committed (or, past the
    writer's time limit, the statement is refused with 58030 and nothing is answered)."""
    marker = "round14 trail held"
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as owner:
        owner.execute("lock table anonproxy.audit_trail in access exclusive mode")
        reporter.send(pg.query_message(f"{AGGREGATE} -- {marker}"))
        _waiting_on_a_lock(truth, "anonproxy audit")
        assert not reporter.pending()
        owner.rollback()
    got = reporter.until(b"Z")
    if errors(got):
        assert errors(got) == ["58030"] and not rows(got), got
    else:
        assert rows(got) and _trail_rows(truth, marker) == [("answered", None)]


def _cancel(endpoint: Endpoint, process_id: int, secret_key: bytes) -> None:
    """A CancelRequest to the proxy; returns once the proxy hung up (it has acted, or ignored the key)."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=READ_LIMIT) as sock:
        sock.sendall(pg.cancel_request(process_id, secret_key))
        assert sock.recv(1) == b""


def test_cancels_with_wrong_keys_stop_no_one_and_the_right_one_is_recorded(
        reporter: Raw, gated_proxy: Endpoint, truth: psycopg.Connection[Any], pg_server: EmbeddedPostgres,
        gated_database: str) -> None:
    """A gated statement waits on the service connection (the table's owner locks it). CancelRequests with the
    session's process id and a wrong key, and with the service backend's process id, stop nothing: once the lock
    goes, the answer comes. A statement cancelled with the session's own key gets 57014, and the trail holds its
    row either way."""
    marker = "round14 cancel"
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as owner:
        owner.execute("lock table public.adult in access exclusive mode")
        reporter.send(pg.query_message(f"{AGGREGATE} -- {marker} 1"))
        service_pid = _waiting_on_a_lock(truth, "anonproxy service")
        for process_id, key in [(reporter.backend_pid, b"\0\0\0\0"), (reporter.backend_pid, b"\xff" * 4),
                                (service_pid, b"\0\0\0\0"), (service_pid, b"\xff" * 4)]:
            _cancel(gated_proxy, process_id, key)
        owner.rollback()
    got = reporter.until(b"Z")
    assert not errors(got) and rows(got) == simple_answer(reporter, AGGREGATE)
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as owner:
        owner.execute("lock table public.adult in access exclusive mode")
        reporter.send(pg.query_message(f"{AGGREGATE} -- {marker} 2"))
        _waiting_on_a_lock(truth, "anonproxy service")
        reporter.conn.cancel_safe()
        got = reporter.until(b"Z")
        owner.rollback()
    assert errors(got) == ["57014"] and not rows(got), got
    assert len(_trail_rows(truth, f"{marker} 2")) == 1
    assert simple_answer(reporter, AGGREGATE)


def test_clients_gone_mid_statement_leave_the_pool_and_their_rows(gated_proxy: Endpoint, gated_database: str,
                                                                  pg_server: EmbeddedPostgres,
                                                                  truth: psycopg.Connection[Any]) -> None:
    """Rounds of clients whose gated statements run (waiting on the service connection: the table's owner locks
    it) hang up before their answers: each statement has its row in the trail, and after more such clients than
    the pool has connections, another session is answered (their connections went back to the pool)."""
    marker = "round14 gone"
    per_round = 8  # fewer than a worker's pool: all of a round run at once
    for round_ in range(3):
        with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as owner:
            owner.execute("lock table public.adult in access exclusive mode")
            sessions = [Raw(gated_proxy.dsn(gated_database, user="reporter")) for _ in range(per_round)]
            for number, session in enumerate(sessions):
                session.send(pg.query_message(f"{AGGREGATE} -- {marker} {round_} {number}"))
            _waiting_on_a_lock(truth, "anonproxy service", per_round)
            for session in sessions:
                session.close()
            owner.rollback()
        assert len(_trail_rows(truth, f"{marker} {round_} ")) == per_round
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as victim:
        assert victim.execute(AGGREGATE).fetchall()


# -- session commands and names the proxy uses --------------------------------------------------------------------

IDENTITY = ["set role dba", "set role analyst", "set session authorization dba", "set session authorization analyst",
            "select set_config('role', 'dba', false)", "select set_config('session_authorization', 'dba', false)"]


@pytest.mark.parametrize("sql", IDENTITY)
def test_a_gated_role_cannot_become_another(reporter14: psycopg.Connection[Any], sql: str) -> None:
    """SET ROLE, SET SESSION AUTHORIZATION and their set_config forms: refused (by PostgreSQL: the role is no
    member; or by the proxy), and the session still answers as reporter."""
    with pytest.raises(psycopg.Error) as refused:
        reporter14.execute(sql)
    assert refused.value.sqlstate == "42501", refused.value
    assert reporter14.execute("select current_user, session_user").fetchone() == ("reporter", "reporter")
    assert reporter14.execute("select count(*) from public.adult").fetchone()[0] >= 10


def test_a_client_statement_of_the_proxys_failing_name(reporter: Raw) -> None:
    """The client prepares a statement named as the proxy's own that fails a transaction block after an error from
    elsewhere (``anonproxy.failed``): a refusal in a block still fails the block (25P02 after it), and the
    client's statement of that name is still its own after the rollback."""
    reporter.send(parse("select 14", b"anonproxy.failed"), SYNC)
    assert types(reporter.until(b"Z")) == [b"1", b"Z"]
    assert reporter.query("begin")[-1] == (b"Z", b"T")
    refused = reporter.query("select age from public.adult")
    assert types(refused) == [b"E", b"Z"] and refused[-1] == (b"Z", b"E")
    assert errors(reporter.query("select 1")) == ["25P02"]
    assert reporter.query("rollback")[-1] == (b"Z", b"I")
    reporter.send(bind(statement=b"anonproxy.failed"), execute(), SYNC)
    assert rows(reporter.until(b"Z")) == [(b"14",)]



def _kept_name_used(session: Raw) -> list[list[bytes]]:
    """In a transaction block, the client's statement and portal named as those the proxy runs a kept portal
    under (``anonproxy_kept``), around portals read with a row limit (which the proxy keeps)."""
    assert session.query("begin")[-1] == (b"Z", b"T")
    count = "select count(*) from public.adult"
    batches = [(parse(AGGREGATE, b"anonproxy_kept"), parse(count, b"count"), bind(statement=b"count", portal=b"p"),
                execute(b"p", max_rows=1)),
               (bind(statement=b"anonproxy_kept", portal=b"anonproxy_kept"), execute(b"anonproxy_kept")),
               (bind(statement=b"count", portal=b"q"), execute(b"q", max_rows=1),
                bind(statement=b"anonproxy_kept", portal=b"r"), execute(b"r"))]
    answers = []
    for batch in batches:
        session.send(*batch, SYNC)
        answers.append(types(session.until(b"Z")))
    assert session.query("rollback")[-1] == (b"Z", b"I")
    return answers


def test_the_clients_names_may_be_the_kept_portals_names(reporter: Raw, postgresql_raw: Raw) -> None:
    """The proxy's kept portals run under ``anonproxy_kept`` on the service connection, closed first: a client's
    statement and portal of that name are still its own (answered as PostgreSQL answers them, no error)."""
    assert _kept_name_used(reporter) == _kept_name_used(postgresql_raw) == [
        [b"1", b"1", b"2", b"D", b"s", b"Z"], [b"2", b"D", b"D", b"C", b"Z"],
        [b"2", b"D", b"s", b"2", b"D", b"D", b"C", b"Z"]]

# -- dp answers through portals ------------------------------------------------------------------------------------


def test_a_dp_portal_read_in_parts_closed_and_bound_again_is_one_charged_answer(
        analyst14: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str,
        truth: psycopg.Connection[Any]) -> None:
    """A dp aggregate's portal described, read one row at a time, closed, and its statement bound and read again:
    every row the client gets is one answer's (the same as the question asked again in a simple Query), and the
    trail holds one charge for it (ε > 0), the rest answered at no charge."""
    session = Raw(gated_proxy.dsn(gated_database, user="dp_round14"))
    sql = "select sex, count(*) from public.adult where age > 41 group by sex order by sex"
    try:
        session.send(parse(sql, b"dp"), bind(statement=b"dp", portal=b"p"), describe(b"P", b"p"),
                     execute(b"p", max_rows=1), execute(b"p", max_rows=1), close(b"P", b"p"),
                     bind(statement=b"dp", portal=b"p"), execute(b"p"), SYNC)
        got = session.until(b"Z")
        assert not errors(got), got
        first, again = rows(got)[:2], rows(got)[2:]
        assert first == again == simple_answer(session, sql)
    finally:
        session.close()
    charges = truth.execute("select epsilon from anonproxy.audit_trail where login = 'dp_round14' "
                            "and statement = %s and decision = 'answered'", [sql]).fetchall()
    assert len(charges) == 3 and sorted(epsilon > 0 for (epsilon,) in charges) == [False, False, True], charges


def _answer_types(messages: list[Message]) -> list[bytes]:
    """The types of the messages but the notices (a dp answer's notes on its noise)."""
    return [type_ for type_ in types(messages) if type_ != b"N"]


def test_a_dp_answer_flushed_then_a_query_inside_the_open_batch(analyst14: psycopg.Connection[Any],
                                                               gated_proxy: Endpoint, gated_database: str,
                                                               truth: psycopg.Connection[Any]) -> None:
    """A dp question executed and flushed without Sync is answered at once; a simple Query sent inside that open
    batch is answered after it; each answer has its row in the trail, charged (ε > 0) once."""
    first = "select count(*) from public.adult where age > 52"
    second = "select count(*) from public.adult where age > 53"
    session = Raw(gated_proxy.dsn(gated_database, user="dp_round14"))
    try:
        session.send(parse(first), bind(), execute(), FLUSH)
        assert _answer_types(session.until(b"C")) == [b"1", b"2", b"D", b"C"]
        session.send(pg.query_message(second), SYNC)
        assert _answer_types(session.until(b"Z")) == [b"T", b"D", b"C", b"Z"]
        assert session.until(b"Z") == [(b"Z", b"I")]
    finally:
        session.close()
    for sql in (first, second):
        charges = truth.execute("select epsilon from anonproxy.audit_trail where login = 'dp_round14' "
                                "and statement = %s and decision = 'answered'", [sql]).fetchall()
        assert len(charges) == 1 and charges[0][0] > 0, (sql, charges)
