"""A gated session's answers are written in batches (issue 23, item 4), through the real proxy.

* A 20,000-row answer that passes the gate reaches the client whole and in order, in a few write system calls
  (the worker's, counted with strace), not one per row.
* Clients that do not read such answers: the worker stops reading them from the server (backpressure), so its
  memory stays flat; each client then reads its whole answer, in order.
* The framing under the fast path: consecutive DataRows are handed on as one piece of raw bytes, whatever the
  reads' boundaries, and the stream comes out as it went in.

The proxy here runs one worker, so that the worker is the process the test started.
"""

from __future__ import annotations

import re
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from conftest import SERVICE_ROLE, ProxyProcess, start_proxy, stop_proxy
from psycopg import pq
from test_memory_bounds import MB, peak_growth, rss, send_unread

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import Piece, RelayingMessageBuffer, Rows

ROWS = 20_000
ANSWER = f"select g, 'row ' || g from generate_series(1, {ROWS}) g"
UNREAD_ROWS = 600_000
UNREAD = f"select g, repeat('x', 100) from generate_series(1, {UNREAD_ROWS}) g"
UNREAD_SESSIONS = 3  # ≈ 80 MB of answer each
UNREAD_BOUND = 60 * MB


@pytest.fixture(scope="module")
def worker(pg_server: EmbeddedPostgres, gated_database: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}",
                        tmp_path_factory.mktemp("lean") / "anonproxy.log", workers="1", log_level="debug",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def _writes_while(pid: int, action: Callable[[], object]) -> int:
    """The write system calls process ``pid`` (all its threads) makes while ``action`` runs."""
    strace = subprocess.Popen(["strace", "-c", "-f", "-e", "trace=write,writev,sendto,sendmsg", "-p", str(pid)],
                              stderr=subprocess.PIPE, text=True)
    assert strace.stderr is not None
    assert "attached" in strace.stderr.readline()  # attached before the action starts
    action()
    time.sleep(0.2)  # (what the worker still writes)
    strace.send_signal(signal.SIGINT)
    _, summary = strace.communicate(timeout=30)
    total = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?total$", summary, re.MULTILINE)
    assert total is not None, summary
    return int(total.group(1))


def test_a_long_gated_answer_is_written_in_a_few_system_calls(worker: ProxyProcess, gated_database: str) -> None:
    with psycopg.connect(worker.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        expected = [(g, f"row {g}") for g in range(1, ROWS + 1)]
        assert conn.execute(ANSWER).fetchall() == expected  # (decided once: the count below is the answer's)
        got: list[object] = []
        writes = _writes_while(worker.process.pid, lambda: got.extend(conn.execute(ANSWER).fetchall()))
    assert got == expected
    # One call per row before: 20,003. What one read from the server brings goes out in one write.
    assert writes < 200, f"{writes} write system calls for a {ROWS}-row answer"


def test_unread_gated_answers_are_held_back_and_arrive_whole(worker: ProxyProcess, gated_database: str) -> None:
    """UNREAD_SESSIONS reporter sessions send a query with a long answer (hundreds of thousands of small rows,
    passed by the gate row by row) and do not read it: the worker stops reading from the server, its memory
    stays within UNREAD_BOUND; then each session reads its answer, every row in order."""
    with send_unread(worker.endpoint, gated_database, "reporter", UNREAD) as conn:  # warm: decided, caches
        assert _rows_in_order(conn) == UNREAD_ROWS
    before = rss(worker.process.pid)
    sessions = [send_unread(worker.endpoint, gated_database, "reporter", UNREAD) for _ in range(UNREAD_SESSIONS)]
    try:
        growth = peak_growth(worker.process.pid, before, seconds=6)
        assert growth <= UNREAD_BOUND, f"the worker grew by {growth / MB:.0f} MB while its clients did not read"
        with psycopg.connect(worker.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as other:
            assert other.execute("select 1").fetchone() == (1,)  # the worker answers others meanwhile
        for conn in sessions:
            assert _rows_in_order(conn) == UNREAD_ROWS
    finally:
        for conn in sessions:
            conn.close()


def _rows_in_order(conn: psycopg.Connection) -> int:
    """Read the answer of ``UNREAD`` sent by ``send_unread``; check its rows come in order; their number."""
    count = 0
    while (result := conn.pgconn.get_result()) is not None:
        assert result.status == pq.ExecStatus.TUPLES_OK, result.error_message
        for row in range(result.ntuples):
            count += 1
            assert result.get_value(row, 0) == str(count).encode()
        assert result.get_value(result.ntuples - 1, 1) == b"x" * 100
    return count


def test_consecutive_rows_come_as_one_piece_whatever_the_reads() -> None:
    rows = [pg.message(b"D", b"\x00\x01" + struct.pack("!i", len(value)) + value)
            for value in (b"1", b"22", b"333", b"4444")]
    long_row = pg.message(b"D", b"y" * 500)
    stream = (pg.message(b"T", b"t") + b"".join(rows[:2]) + long_row + b"".join(rows[2:]) + pg.message(b"C", b"SELECT")
              + pg.message(b"Z", b"I"))
    for cut in range(1, len(stream)):
        for second_cut in (cut, (cut + len(stream)) // 2):
            buffer = RelayingMessageBuffer(limit=100)
            out = [item for chunk in (stream[:cut], stream[cut:second_cut], stream[second_cut:])
                   for item in buffer.feed(chunk)]
            again = b"".join(item.raw if isinstance(item, (Rows, Piece)) else pg.message(*item) for item in out)
            assert again == stream
            assert buffer.at_boundary and buffer.last_type == b"Z"
            assert all(item.raw[:1] == b"D" for item in out if isinstance(item, Rows))
    whole = RelayingMessageBuffer(limit=100).feed(stream)
    assert whole[1] == Rows(b"".join(rows[:2])) and whole[3] == Rows(b"".join(rows[2:]))
