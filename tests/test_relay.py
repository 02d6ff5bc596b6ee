"""The relay (a direct role's session after login) under the byte streams a lean forwarder could get wrong.

The relay forwards whatever each read brought and follows only the server's message boundaries: messages cut
anywhere (one byte per write, mid-header), many messages in one read, a message bigger than any read, a client that
leaves mid-message. Raw sockets speak the protocol by hand as the `trust_user` role (no password exchange); every
answer is checked against what the statement must return, computed here.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from conftest import Endpoint, start_proxy
from test_robustness import (
    assert_closed,
    assert_proxy_serves,
    login,
    open_raw,
    read_error,
    read_until_ready,
    simple_query,
)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg


def _query(text: str) -> bytes:
    return pg.message(b"Q", text.encode() + b"\0")


def _values(messages: list[tuple[bytes, bytes]]) -> list[bytes | None]:
    """The first column of each DataRow."""
    return [pg.parse_data_row(body)[0] for type_, body in messages if type_ == b"D"]


def test_a_query_sent_one_byte_per_write_is_relayed(proxy: Endpoint, dbname: str) -> None:
    with open_raw(proxy) as sock:
        login(sock, dbname)
        for byte in _query("select 6 * 7"):
            sock.sendall(bytes([byte]))
            time.sleep(0.001)  # (pacing, so that the proxy reads the bytes one by one)
        messages = read_until_ready(sock)
        assert _values(messages) == [b"42"] and messages[-1] == (b"Z", b"I")
        # And a message cut inside its header, the rest with the next message.
        both = _query("select 'first'") + _query("select 'second'")
        sock.sendall(both[:3])
        time.sleep(0.05)
        sock.sendall(both[3:])
        assert _values(read_until_ready(sock) + read_until_ready(sock)) == [b"first", b"second"]


def test_a_pipelined_burst_comes_back_whole_and_in_order(proxy: Endpoint, dbname: str) -> None:
    """Thousands of queries in one write, and answers longer than any read (the server's stream cut everywhere)."""
    count = 3000
    texts = [f"select {i}" if i % 500 else f"select repeat('{i % 10}', 300000)" for i in range(count)]
    with open_raw(proxy) as sock:
        login(sock, dbname)
        sock.sendall(b"".join(_query(text) for text in texts))
        for i in range(count):
            values = _values(read_until_ready(sock))
            assert values == [str(i).encode() if i % 500 else str(i % 10).encode() * 300000], i
        sock.sendall(_query("select 'after'"))
        assert _values(read_until_ready(sock)) == [b"after"]


def test_a_message_bigger_than_any_read_reaches_the_server_whole(proxy: Endpoint, dbname: str) -> None:
    text = "x" * 5_000_000
    with open_raw(proxy) as sock:
        login(sock, dbname)
        sock.sendall(_query(f"select length('{text}'), md5('{text}')"))
        (row,) = [pg.parse_data_row(body) for type_, body in read_until_ready(sock) if type_ == b"D"]
    with psycopg.connect(proxy.dsn(dbname)) as conn:
        assert conn.execute("select 5000000, md5(repeat('x', 5000000))").fetchone() == \
            (int(row[0] or b""), (row[1] or b"").decode())


def test_a_client_leaving_mid_message_ends_its_backend(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    with open_raw(proxy) as sock:
        messages = login(sock, dbname)
        pid = next(pg.parse_backend_key_data(body)[0] for type_, body in messages if type_ == b"K")
        whole = _query("select 'never finished' || repeat('y', 1000)")
        sock.sendall(whole[: len(whole) // 2])  # the header promises more than ever comes
        sock.shutdown(socket.SHUT_RDWR)
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as admin:
        deadline = time.monotonic() + 60
        while admin.execute("select count(*) from pg_stat_activity where pid = %s", [pid]).fetchone() != (0,):
            assert time.monotonic() < deadline, "the backend of a client that left mid-message is still there"
            time.sleep(0.1)
    assert_proxy_serves(proxy, dbname)


def test_the_server_s_messages_are_relayed_byte_for_byte(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    """What the client reads through the relay is exactly what PostgreSQL sends directly: notices, errors, rows
    and ReadyForQuery with their transaction status, in a transaction that fails and is rolled back."""
    script = ["begin", "select 1/0", "select 1", "rollback",
              "do $$ begin raise notice 'hello %', repeat('n', 70000); end $$", "select generate_series(1, 5000)"]
    answers = []
    for endpoint in (proxy, direct):
        with open_raw(endpoint) as sock:
            login(sock, dbname)
            sock.sendall(b"".join(_query(text) for text in script))
            answers.append([message for _ in script for message in read_until_ready(sock)])
    assert answers[0] == answers[1]
    assert [body for type_, body in answers[0] if type_ == b"Z"] == [b"T", b"E", b"E", b"I", b"I", b"I"]


# -- Ends of a relayed session that a new forwarder could get wrong ------------------------------------------------

def _backend_state(admin: psycopg.Connection, pid: int) -> str | None:
    row = admin.execute("select state from pg_stat_activity where pid = %s", [pid]).fetchone()
    return None if row is None else str(row[0])


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing: a loaded machine is slow
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_client_gone_during_a_query_has_its_query_cancelled(proxy: Endpoint, direct: Endpoint,
                                                               dbname: str) -> None:
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as admin:
        with open_raw(proxy) as sock:
            messages = login(sock, dbname)
            pid = next(pg.parse_backend_key_data(body)[0] for type_, body in messages if type_ == b"K")
            sock.sendall(_query("select pg_sleep(600)"))
            _wait(lambda: _backend_state(admin, pid) == "active", "the query did not start")
        _wait(lambda: _backend_state(admin, pid) != "active", "the query of a client that left is still running")
    assert_proxy_serves(proxy, dbname)


def test_the_server_ending_a_relayed_session_tells_the_client_why(proxy: Endpoint, direct: Endpoint,
                                                                  dbname: str) -> None:
    with open_raw(proxy) as sock:
        messages = login(sock, dbname)
        pid = next(pg.parse_backend_key_data(body)[0] for type_, body in messages if type_ == b"K")
        with psycopg.connect(direct.dsn(dbname), autocommit=True) as admin:
            assert admin.execute("select pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        fields = read_error(sock)  # the server's own FATAL, relayed, and nothing of the proxy's after it
        assert (fields["S"], fields["C"]) == ("FATAL", "57P01")
        assert "administrator command" in fields["M"]
        assert_closed(sock)
    assert_proxy_serves(proxy, dbname)


def test_shutdown_ends_relayed_sessions_idle_busy_or_unread(pg_server: EmbeddedPostgres, dbname: str,
                                                             tmp_path: Path) -> None:
    """SIGTERM: an idle and a busy relayed session get the proxy's FATAL 57P01; a client that reads nothing of a
    long answer (its relay blocked writing to it) does not keep the proxy from exiting; no traceback."""
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / "p.log", workers="1",
                        log_level="debug")
    try:
        idle, busy, unread = open_raw(proxy.endpoint), open_raw(proxy.endpoint), open_raw(proxy.endpoint)
        with idle, busy, unread:
            for sock in (idle, busy, unread):
                login(sock, dbname)
            assert _values(simple_query(idle, "select 'idle'")) == [b"idle"]
            busy.sendall(_query("select pg_sleep(600)"))
            unread.sendall(_query("select repeat('u', 100000) from generate_series(1, 2000)"))  # 200 MB, never read
            with psycopg.connect(pg_server.conninfo(dbname=dbname), autocommit=True) as admin:
                _wait(lambda: admin.execute("select count(*) from pg_stat_activity where datname = current_database()"
                                            " and (wait_event = 'ClientWrite' or query = 'select pg_sleep(600)')"
                                            ).fetchone() == (2,),
                      "the busy and the unread sessions did not get under way")
            proxy.process.send_signal(signal.SIGTERM)
            for sock in (idle, busy):
                fields = read_error(sock)
                assert (fields["S"], fields["C"]) == ("FATAL", "57P01")
                assert "anonproxy is shutting down" in fields["M"]
                assert_closed(sock)
            assert proxy.process.wait(60) == 0
    finally:
        if proxy.process.poll() is None:
            proxy.process.kill()
    assert "Traceback" not in proxy.log(), proxy.log()

