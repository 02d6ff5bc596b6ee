"""Memory bounded per session and per worker, through the real proxy (issue 21).

* Backpressure: a client that sends a query with a large answer and does not
  read it makes the proxy stop reading that answer from the server (its own
  connection for a direct role, the service connection for a gated one): the
  worker's resident memory stays flat, and the client gets the whole answer
  when it does read.
* The cursors the proxy holds for gated roles: a byte cap per cursor and per
  session and a cap on their number (54000, the setting named, the session
  goes on, no cursor left behind).
* Prepared statements a gated session keeps: a cap on their number and bytes.

The proxies here run with one worker, so that the worker is the process the
test started and its VmRSS (/proc/<pid>/status) is the worker's.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import SERVICE_ROLE, Endpoint, ProxyProcess, start_proxy, stop_proxy
from psycopg import pq

from anonproxy.config import ConfigError, load_config
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.cursors import Cursors
from anonproxy.proxy.limits import MemoryLimits
from anonproxy.route.decision import DeclareCursor, Rewrite
from anonproxy.wire import protocol as pg

MB = 1 << 20
SESSIONS = 6  # clients that do not read, at once
RSS_BOUND = 100 * MB  # the worker's growth allowed while they do not read (today's code: far more)
PAD = 100_000  # bytes of text in each row of the large answers
# A gated answer of large rows: every released (education, age) group, with a literal of PAD bytes.
GATED_QUERY = (f"select education, age, '{'x' * PAD}' as pad, count(*) from adult group by education, age "
               "order by education, age")
DIRECT_ROWS = 400
PIPELINED = 600  # statements a client pipelines without reading
DIRECT_QUERY = f"select i, repeat('x', {PAD}) as pad from generate_series(1, {DIRECT_ROWS}) as i"


def _proxy(pg_server: EmbeddedPostgres, gated_database: str, path: Path, **settings: str) -> ProxyProcess:
    return start_proxy(f"host={pg_server.host} port={pg_server.port}", path / "anonproxy.log", workers="1",
                       log_level="debug",
                       service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}",
                       **settings)


@pytest.fixture(scope="module")
def worker(pg_server: EmbeddedPostgres, gated_database: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """The proxy with its default settings, one worker."""
    proxy = _proxy(pg_server, gated_database, tmp_path_factory.mktemp("memory"))
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def rss(pid: int) -> int:
    """Resident memory of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def send_unread(endpoint: Endpoint, dbname: str, user: str, sql: str) -> psycopg.Connection:
    """A session that sends ``sql`` and reads nothing of the answer (libpq reads only when asked)."""
    conn = psycopg.connect(endpoint.dsn(dbname, user=user), autocommit=True)
    conn.pgconn.send_query(sql.encode())
    while conn.pgconn.flush():
        time.sleep(0.01)
    return conn


def read_answer(conn: psycopg.Connection) -> list[tuple[bytes | None, ...]]:
    """The whole answer of the query ``send_unread`` sent: its rows (raw text values)."""
    rows: list[tuple[bytes | None, ...]] = []
    while (result := conn.pgconn.get_result()) is not None:
        assert result.status == pq.ExecStatus.TUPLES_OK, result.error_message
        rows.extend(tuple(result.get_value(row, column) for column in range(result.nfields))
                    for row in range(result.ntuples))
    return rows


def peak_growth(pid: int, before: int, seconds: float) -> int:
    """The worker's highest VmRSS growth over ``seconds`` (stops early once past the bound: no need to wait)."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and peak <= RSS_BOUND:
        peak = max(peak, rss(pid) - before)
        time.sleep(0.05)
    return peak


def warm_up(endpoint: Endpoint, dbname: str, user: str, sql: str) -> int:
    """One session that reads its answer as it comes (the worker's lasting memory: the analysis child, caches);
    the number of rows it got."""
    with send_unread(endpoint, dbname, user, sql) as conn:
        return len(read_answer(conn))


@pytest.mark.parametrize("user", ["reporter", "dba"])
def test_unread_answers_do_not_grow_the_worker(worker: ProxyProcess, gated_database: str, user: str) -> None:
    """SESSIONS clients send a query with a large answer (tens of MB each) and do not read: the worker stops
    reading those answers from the server (reporter: the service connection; dba: its own), so its memory stays
    within RSS_BOUND; then each client reads and gets its whole answer."""
    query = GATED_QUERY if user == "reporter" else DIRECT_QUERY
    expected = warm_up(worker.endpoint, gated_database, user, query)
    assert expected * PAD * SESSIONS > 2 * RSS_BOUND  # today's code, holding them all, exceeds the bound by far
    before = rss(worker.process.pid)
    sessions = [send_unread(worker.endpoint, gated_database, user, query) for _ in range(SESSIONS)]
    try:
        growth = peak_growth(worker.process.pid, before, seconds=8)
        assert growth <= RSS_BOUND, f"the worker grew by {growth / MB:.0f} MB while {SESSIONS} clients did not read"
        # Another session is answered meanwhile.
        with psycopg.connect(worker.endpoint.dsn(gated_database, user=user), autocommit=True) as other:
            assert other.execute("select 1").fetchone() == (1,)
        for conn in sessions:
            rows = read_answer(conn)
            assert len(rows) == expected
            assert all(row[-2 if user == "reporter" else 1] == b"x" * PAD for row in rows)
    finally:
        for conn in sessions:
            conn.close()



def test_an_unread_answer_gives_its_service_connection_up_when_another_statement_waits(
        pg_server: EmbeddedPostgres, gated_database: str, tmp_path: Path) -> None:
    """With one service connection, a reporter that reads nothing of its answer would keep it from every other
    statement: past service_hold_timeout without progress, its session ends (57014) as soon as another
    statement waits, and that statement is answered."""
    proxy = _proxy(pg_server, gated_database, tmp_path, service_pool_size="1", service_hold_timeout="1",
                   service_wait_timeout="120")
    try:
        unread = send_unread(proxy.endpoint, gated_database, "reporter", GATED_QUERY)
        _wait_until_running_for_the_service(pg_server, gated_database)  # analysed, and the connection is its
        time.sleep(0.5)  # its answer fills the buffers, and the proxy stops reading it
        with psycopg.connect(proxy.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as other:
            started = time.monotonic()
            assert len(other.execute("select sex, count(*) from adult group by 1").fetchall()) == 2
            assert time.monotonic() - started < 60  # not the 120 s of service_wait_timeout
        results = []
        while (result := unread.pgconn.get_result()) is not None:
            results.append(result)
        errors = [r for r in results if r.status == pq.ExecStatus.FATAL_ERROR]
        assert any(r.error_field(pq.DiagnosticField.SQLSTATE) == b"57014" and b"service_hold_timeout" in
                   r.error_message for r in errors), [r.error_message for r in errors]
        unread.close()
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log()


def _wait_until_running_for_the_service(pg_server: EmbeddedPostgres, database: str) -> None:
    """Until the service role's backend runs the large answer's query (its analysis may take a while)."""
    deadline = time.monotonic() + 60
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as owner:
        while not owner.execute("select count(*) > 0 from pg_stat_activity where usename = %s and state = 'active' "
                                "and query like %s",
                                [SERVICE_ROLE, f"%{'x' * 100}%"]).fetchone()[0]:
            assert time.monotonic() < deadline, "the unread query never ran on the service connection"
            time.sleep(0.05)


def test_pipelined_statements_do_not_pile_up_for_the_service(worker: ProxyProcess, gated_database: str) -> None:
    """A reporter pipelines PIPELINED rewritten statements (each with a 200 kB literal, kept in the rewrite) and
    reads no answer: once the service connection's server stops taking them (it is sending an answer nobody
    reads), the proxy stops reading from the client, so the statements wait in the client's socket, not in the
    worker (today's code holds every answer, and the statements behind them); then every answer arrives."""
    sql = f"select '{'x' * 200_000}' as pad, count(*) from adult".encode()
    warm_up(worker.endpoint, gated_database, "reporter", sql.decode())
    before = rss(worker.process.pid)
    with psycopg.connect(worker.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        pgconn = conn.pgconn
        pgconn.nonblocking = 1
        pgconn.enter_pipeline_mode()
        for _ in range(PIPELINED):
            pgconn.send_query_params(sql, None)
        pgconn.pipeline_sync()
        pgconn.flush()
        growth, deadline = 0, time.monotonic() + 8
        while time.monotonic() < deadline and growth <= RSS_BOUND:
            pgconn.flush()  # as much as the proxy takes
            growth = max(growth, rss(worker.process.pid) - before)
            time.sleep(0.05)
        assert growth <= RSS_BOUND, f"the worker grew by {growth / MB:.0f} MB while the client did not read"
        assert pipeline_answers(pgconn) == PIPELINED
        pgconn.exit_pipeline_mode()


def pipeline_answers(pgconn: pq.PGconn) -> int:
    """Send what is left and read every answer up to the pipeline's Sync; how many rows of 200 kB came."""
    rows = 0
    while True:
        pgconn.flush()
        wait_readable(pgconn)
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                continue  # between two statements' answers
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                return rows
            assert result.status == pq.ExecStatus.TUPLES_OK, result.error_message
            rows += sum(result.get_value(row, 0) == b"x" * 200_000 for row in range(result.ntuples))


def wait_readable(pgconn: pq.PGconn) -> None:
    select.select([pgconn.socket], [], [], 1)


# -- the cursors the proxy holds -------------------------------------------------------------------------------

CURSOR_SIZE = 1 << 20
SESSION_CURSOR_SIZE = 2 << 20
CURSORS = 3


@pytest.fixture(scope="module")
def capped(pg_server: EmbeddedPostgres, gated_database: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """The proxy with small memory limits per session."""
    proxy = _proxy(pg_server, gated_database, tmp_path_factory.mktemp("capped"), max_cursor_size=str(CURSOR_SIZE),
                   max_session_cursor_size=str(SESSION_CURSOR_SIZE), max_session_cursors=str(CURSORS),
                   max_prepared_statements="5", max_prepared_size="65536")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.fixture
def reporter(capped: ProxyProcess, gated_database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(capped.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def by_education(pad: int) -> str:
    """A suppressed aggregate of 16 rows (one per education), each with ``pad`` bytes of text."""
    return f"select education, '{'x' * pad}' as pad, count(*) from adult group by education"


def refusal(conn: psycopg.Connection, sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql)
    return caught.value


def absent(conn: psycopg.Connection, name: str) -> bool:
    """Whether cursor ``name`` does not exist (PostgreSQL's 34000: the FETCH passes, no cursor of the proxy's)."""
    try:
        conn.execute(f"fetch 1 from {name}")
    except psycopg.Error as exc:
        return exc.sqlstate == "34000"
    return False


def fetch_all(conn: psycopg.Connection, name: str) -> list[tuple[object, ...]]:
    return conn.execute(f"fetch all from {name}").fetchall()


def test_a_cursor_over_max_cursor_size_is_refused(reporter: psycopg.Connection) -> None:
    """A DECLARE whose answer is larger than max_cursor_size: 54000 naming the limit and the setting; no cursor;
    the session goes on (a smaller cursor of the same name works). Extended protocol (psycopg), then simple."""
    error = refusal(reporter, f"declare big cursor with hold for {by_education(100_000)}")
    assert error.sqlstate == "54000"
    assert "anonproxy holds at most 1 MB per cursor" in error.diag.message_primary
    assert "max_cursor_size" in (error.diag.message_hint or "")
    assert absent(reporter, "big")
    result = reporter.pgconn.exec_(f"declare big cursor with hold for {by_education(100_000)}".encode())
    assert result.status == pq.ExecStatus.FATAL_ERROR
    assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"54000"
    assert absent(reporter, "big")
    reporter.execute(f"declare big cursor with hold for {by_education(10)}")
    assert len(fetch_all(reporter, "big")) == 16
    reporter.execute("close big")


def test_cursors_over_max_session_cursor_size_are_refused(reporter: psycopg.Connection) -> None:
    """Two cursors of 800 kB fit in max_session_cursor_size (2 MB), a third does not: 54000 naming the setting,
    the third absent, the first two whole; once one is closed, the third is declared."""
    for name in ("one", "two"):
        reporter.execute(f"declare {name} cursor with hold for {by_education(50_000)}")
    error = refusal(reporter, f"declare three cursor with hold for {by_education(50_000)}")
    assert error.sqlstate == "54000"
    assert "of cursors per session" in error.diag.message_primary
    assert "max_session_cursor_size" in (error.diag.message_hint or "")
    assert absent(reporter, "three")
    assert len(fetch_all(reporter, "one")) == 16
    reporter.execute("close one")
    reporter.execute(f"declare three cursor with hold for {by_education(50_000)}")
    assert [len(fetch_all(reporter, name)) for name in ("two", "three")] == [16, 16]
    reporter.execute("close all")


def test_cursors_over_max_session_cursors_are_refused(reporter: psycopg.Connection) -> None:
    """max_session_cursors (3) cursors held, a fourth is refused before its query runs (54000 naming the setting),
    in a transaction block too (whose savepoint it fails, as an error in PostgreSQL); after a CLOSE it is declared."""
    for name in ("c1", "c2", "c3"):
        reporter.execute(f"declare {name} cursor with hold for {by_education(1)}")
    error = refusal(reporter, f"declare c4 cursor with hold for {by_education(1)}")
    assert error.sqlstate == "54000"
    assert "anonproxy holds at most 3 cursors per session" in error.diag.message_primary
    assert "max_session_cursors" in (error.diag.message_hint or "")
    assert absent(reporter, "c4")
    with reporter.transaction():
        with pytest.raises(psycopg.Error) as caught, reporter.transaction():  # a savepoint, rolled back to
            reporter.execute(f"declare c4 cursor for {by_education(1)}")
        assert caught.value.sqlstate == "54000"
        assert reporter.execute("select 1").fetchone() == (1,)
        reporter.execute("close c1")
        reporter.execute(f"declare c4 cursor for {by_education(1)}")
        assert len(fetch_all(reporter, "c4")) == 16
    reporter.execute("close all")


# -- prepared statements ---------------------------------------------------------------------------------------


def prepare(conn: psycopg.Connection, name: str, sql: str) -> str | None:
    """Parse of a named statement (the extended protocol); the SQLSTATE of its error, if any."""
    result = conn.pgconn.prepare(name.encode(), sql.encode())
    if result.status == pq.ExecStatus.COMMAND_OK:
        return None
    assert result.error_field(pq.DiagnosticField.MESSAGE_HINT) is not None
    return (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()


def test_prepared_statements_over_max_prepared_statements_are_refused(reporter: psycopg.Connection) -> None:
    """Five named statements kept (max_prepared_statements), a sixth is refused with 54000; the five still run;
    once one is gone (DEALLOCATE, as psycopg sends it), the sixth is prepared. The unnamed statement never counts."""
    for number in range(5):
        assert prepare(reporter, f"s{number}", f"select {number}") is None
    assert prepare(reporter, "s5", "select 5") == "54000"
    result = reporter.pgconn.prepare(b"s5", b"select 5")
    assert b"max_prepared_statements" in (result.error_field(pq.DiagnosticField.MESSAGE_HINT) or b"")
    assert prepare(reporter, "", "select 'unnamed'") is None
    assert reporter.pgconn.exec_prepared(b"s4", []).get_value(0, 0) == b"4"
    assert reporter.execute("select 1").fetchone() == (1,)
    reporter.execute("deallocate s0")
    assert prepare(reporter, "s5", "select 5") is None
    assert reporter.pgconn.exec_prepared(b"s5", []).get_value(0, 0) == b"5"
    reporter.execute("deallocate all")
    assert prepare(reporter, "s0", "select 0") is None


def test_prepared_statements_over_max_prepared_size_are_refused(reporter: psycopg.Connection) -> None:
    """Statements of 40 kB each: one fits in max_prepared_size (64 kB), a second does not (54000 naming the
    setting); a rewritten aggregate's rewrite counts too."""
    padded = f"select '{'x' * 40_000}' as pad"
    assert prepare(reporter, "big1", padded) is None
    assert prepare(reporter, "big2", padded) == "54000"
    result = reporter.pgconn.prepare(b"big2", padded.encode())
    assert b"max_prepared_size" in (result.error_field(pq.DiagnosticField.MESSAGE_HINT) or b"")
    assert reporter.pgconn.exec_prepared(b"big1", []).get_value(0, 0) == b"x" * 40_000
    assert prepare(reporter, "agg", by_education(15_000)) == "54000"  # 15 kB of text, several times that rewritten
    reporter.execute("deallocate big1")
    assert prepare(reporter, "agg", by_education(15_000)) is None
    rows = reporter.pgconn.exec_prepared(b"agg", [])
    assert rows.ntuples == 16


@pytest.mark.parametrize(("setting", "value"), [("max_cursor_size", "100"), ("max_session_cursor_size", "0"),
                                                ("max_session_cursors", "0"), ("max_prepared_statements", "-1"),
                                                ("max_prepared_size", str(2 << 30))])
def test_limits_out_of_range_stop_the_proxy_at_load_time(setting: str, value: str) -> None:
    with pytest.raises(ConfigError, match=setting):
        load_config(environ={f"ANONPROXY_{setting.upper()}": value})


def test_limits_are_read_from_the_environment() -> None:
    config = load_config(environ={"ANONPROXY_MAX_CURSOR_SIZE": "65536", "ANONPROXY_MAX_PREPARED_STATEMENTS": "7"})
    limits = MemoryLimits.of(config)
    assert (limits.cursor_size, limits.statements) == (65536, 7)
    assert MemoryLimits.of(load_config(environ={})) == MemoryLimits()


def test_a_captured_answer_past_the_room_is_dropped_as_it_comes() -> None:
    """The service connection's answer to a gated DECLARE: rows are kept up to the room the limits leave, then
    dropped as they arrive (only counted), and the answer is a 54000 naming max_cursor_size, no cursor made."""
    cursors = Cursors(MemoryLimits(cursor_size=4096, session_cursor_size=1 << 20))
    capture = cursors.capture(DeclareCursor("c", Rewrite("select …")))
    assert capture.feed(b"T", pg.row_description(["pad"])[5:]) is None
    row = pg.data_row(["x" * 100])[5:]
    kept = []
    for _ in range(100):
        assert capture.feed(b"D", row) is None
        kept.append(len(capture.rows))
    assert max(kept) == 4096 // len(row) and kept[-1] == 0
    answer = capture.feed(b"C", b"SELECT 100\0")
    assert isinstance(answer, bytes) and answer[:1] == b"E"
    fields = pg.parse_fields(answer[5:])
    assert fields["C"] == "54000" and "max_cursor_size" in fields["H"]
    assert not cursors.held("c")
