"""The relay (a direct role's session after login) under the byte streams a lean forwarder could get wrong.

The relay forwards whatever each read brought and follows only the server's message boundaries: messages cut
anywhere (one byte per write, mid-header), many messages in one read, a message bigger than any read, a client that
leaves mid-message. Raw sockets speak the protocol by hand as the `trust_user` role (no password exchange); every
answer is checked against what the statement must return, computed here.
"""

from __future__ import annotations

import socket
import time

import psycopg
from conftest import Endpoint
from test_robustness import assert_proxy_serves, login, open_raw, read_until_ready

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
