"""Faithful identity: clients know their real backend pid; cancel keys stay the proxy's; protocol 3.2 is relayed.

Through the real proxy (two workers, so cancel requests cross workers) with psycopg, asyncpg and raw sockets;
the codec and the cancel registry also on their own (sans-I/O).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, ProxyProcess, start_proxy, stop_proxy

from anonproxy.config import UpstreamAddress
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.logs import RateLimitedLog
from anonproxy.proxy.cancel import CancelRegistry, UpstreamKey
from anonproxy.wire import protocol as pg

PROTOCOL_3_2 = 3 << 16 | 2


# -- the codec, without I/O -------------------------------------------------------------


@pytest.mark.parametrize("size", [4, 32, 256])
def test_backend_key_data_of_any_length_round_trips_byte_exact(size: int) -> None:
    secret = bytes(range(256))[:size]
    raw = pg.backend_key_data(4242, secret)
    assert raw == b"K" + struct.pack("!ii", 8 + size, 4242) + secret
    assert pg.parse_backend_key_data(raw[5:]) == (4242, secret)
    assert pg.backend_key_data(*pg.parse_backend_key_data(raw[5:])) == raw


@pytest.mark.parametrize("size", [0, 257])
def test_backend_key_data_with_an_impossible_key_is_a_violation(size: int) -> None:
    with pytest.raises(pg.ProtocolViolation, match="BackendKeyData"):
        pg.parse_backend_key_data(struct.pack("!i", 1) + b"k" * size)


@pytest.mark.parametrize("size", [4, 32, 256])
def test_cancel_request_with_a_long_key_round_trips(size: int) -> None:
    secret = bytes(reversed(range(256)))[:size]
    raw = pg.cancel_request(77, secret)
    assert raw[:4] == struct.pack("!i", 12 + size)
    assert pg.read_startup_packet(raw) == (pg.CancelRequest(77, secret), 12 + size)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (struct.pack("!iii", 12, pg.CANCEL_REQUEST_CODE, 77), "invalid length of cancel request packet"),
        (struct.pack("!iii", 12 + 257, pg.CANCEL_REQUEST_CODE, 77) + b"k" * 257,
         "invalid length of cancel request packet"),
        (b"GET / HTTP/1.1\r\n\r\n", "invalid length of startup packet"),
        (struct.pack("!i", 4) + b"\0\0\0\0", "invalid length of startup packet"),
    ],
)
def test_packets_postgresql_drops_without_a_word_are_silent_violations(raw: bytes, words: str) -> None:
    with pytest.raises(pg.ProtocolViolation, match=words) as caught:
        pg.read_startup_packet(raw)
    assert caught.value.silent


def test_a_protocol_3_2_startup_message_is_read_as_version_3_2() -> None:
    raw = pg.startup_message({"user": "alice", "_pq_.feature": "on"}, version=PROTOCOL_3_2)
    packet, size = pg.read_startup_packet(raw)
    assert size == len(raw)
    assert packet == pg.StartupMessage(PROTOCOL_3_2, {"user": "alice", "_pq_.feature": "on"})


def test_registry_gives_the_real_pid_and_a_fresh_secret_of_the_servers_length() -> None:
    registry = CancelRegistry()
    address = UpstreamAddress(host="127.0.0.1", port=5432)
    for size in (4, 32):
        upstream = UpstreamKey(address, 1234 + size, b"s" * size)
        key = registry.register(upstream)
        assert key.process_id == upstream.process_id
        assert len(key.secret_key) == size and key.secret_key != upstream.secret_key


def test_unregistering_a_stale_session_keeps_the_newer_one_with_the_same_pid() -> None:
    registry = CancelRegistry()
    address = UpstreamAddress(host="127.0.0.1", port=5432)
    old = registry.register(UpstreamKey(address, 99, b"oldk"))
    new = registry.register(UpstreamKey(address, 99, b"newk"))  # the pid was reused by the server
    registry.unregister(old)
    assert registry._keys[99][0] == new.secret_key  # noqa: SLF001 - the registry's own state, in its unit test


def test_rate_limited_log_leaves_out_lines_past_its_limit(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("anonproxy.test_identity")
    limited = RateLimitedLog(logger, limit=3, period=3600)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for number in range(10):
            limited.warning("violation %d", number)
    assert [record.getMessage() for record in caplog.records] == ["violation 0", "violation 1", "violation 2"]


# -- the pid clients see is their backend's --------------------------------------------


def test_psycopg_backend_pid_is_the_real_one(proxy: Endpoint, dbname: str) -> None:
    for _ in range(4):  # sessions land on both workers
        with psycopg.connect(proxy.dsn(dbname)) as conn:
            assert conn.execute("select pg_backend_pid()").fetchone() == (conn.info.backend_pid,)


def test_asyncpg_server_pid_is_the_real_one(proxy: Endpoint, dbname: str) -> None:
    async def main() -> list[tuple[int, int]]:
        pairs = []
        for _ in range(4):
            conn = await asyncpg.connect(proxy.url(dbname))
            try:
                pairs.append((conn.get_server_pid(), await conn.fetchval("select pg_backend_pid()")))
            finally:
                await conn.close()
        return pairs

    for known, real in asyncio.run(main()):
        assert known == real


def test_gated_session_knows_its_own_backend(gated_proxy: Endpoint, gated_database: str,
                                             pg_server: EmbeddedPostgres) -> None:
    """A reporter's pid is its own backend's (not the service connection's)."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), application_name="identity-reporter") \
            as conn, psycopg.connect(pg_server.conninfo(dbname=gated_database)) as admin:
        pids = admin.execute("select pid from pg_stat_activity where application_name = 'identity-reporter'"
                             ).fetchall()
        assert pids == [(conn.info.backend_pid,)]


def test_notification_pid_is_the_senders(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as listener, \
            psycopg.connect(proxy.dsn(dbname), autocommit=True) as sender:
        listener.execute("listen identity_channel")
        sender.execute("notify identity_channel, 'hello'")
        received = next(listener.notifies(timeout=20, stop_after=1))
        assert (received.pid, received.payload) == (sender.info.backend_pid, "hello")
        listener.execute("notify identity_channel, 'self'")
        received = next(listener.notifies(timeout=20, stop_after=1))
        assert received.pid == listener.info.backend_pid


def test_asyncpg_notification_pid_is_the_senders(proxy: Endpoint, dbname: str) -> None:
    async def main() -> tuple[int, int]:
        listener, sender = await asyncpg.connect(proxy.url(dbname)), await asyncpg.connect(proxy.url(dbname))
        try:
            received: asyncio.Queue[int] = asyncio.Queue()
            await listener.add_listener("identity_async", lambda _c, pid, _ch, _p: received.put_nowait(pid))
            await sender.execute("notify identity_async, 'x'")
            return await asyncio.wait_for(received.get(), 5), sender.get_server_pid()
        finally:
            await listener.close()
            await sender.close()

    notified_pid, sender_pid = asyncio.run(main())
    assert notified_pid == sender_pid


def test_terminating_the_known_pid_ends_exactly_that_session(proxy: Endpoint, dbname: str) -> None:
    victim = psycopg.connect(proxy.dsn(dbname), autocommit=True)
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as bystander, \
            psycopg.connect(proxy.dsn(dbname), autocommit=True) as admin:
        assert admin.execute("select pg_terminate_backend(%s)", [victim.info.backend_pid]).fetchone() == (True,)
        with pytest.raises(psycopg.OperationalError, match="terminating connection due to administrator command"):
            victim.execute("select 1")
        assert bystander.execute("select 1").fetchone() == (1,)
        assert admin.execute("select 1").fetchone() == (1,)
    victim.close()


# -- cancel keys: the proxy's secret, routed to the worker that issued it ------------------


def _sleep(conn: psycopg.Connection, seconds: float, outcome: dict[str, str]) -> None:
    try:
        conn.execute(f"select pg_sleep({seconds})")
        outcome["result"] = "finished"
    except psycopg.errors.QueryCanceled:
        outcome["result"] = "cancelled"


def test_cancel_reaches_the_right_session_on_either_worker(proxy: Endpoint, dbname: str) -> None:
    """Four sessions spread over the two workers; cancelling each stops that one only."""
    conns = [psycopg.connect(proxy.dsn(dbname), autocommit=True) for _ in range(4)]
    try:
        for target in range(len(conns)):
            outcomes: list[dict[str, str]] = [{} for _ in conns]
            threads = [threading.Thread(target=_sleep, args=(conn, 10 if i == target else 3, outcomes[i]))
                       for i, conn in enumerate(conns)]
            for thread in threads:
                thread.start()
            _wait_until_active(proxy, dbname, len(conns))
            conns[target].cancel_safe(timeout=5)
            for thread in threads:
                thread.join(15)
            assert [o["result"] for o in outcomes] == ["cancelled" if i == target else "finished"
                                                        for i in range(len(conns))]
    finally:
        for conn in conns:
            conn.close()


def _wait_until_active(proxy: Endpoint, dbname: str, count: int) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as watcher:
        deadline = time.monotonic() + 60
        while watcher.execute("select count(*) from pg_stat_activity where query like 'select pg_sleep(%%' "
                              "and state = 'active' and pid <> pg_backend_pid()").fetchone()[0] < count:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_the_upstream_secret_is_not_what_the_client_gets(proxy: Endpoint, dbname: str) -> None:
    """A cancel with the real pid but a made-up 4-byte key does nothing, on whichever worker it lands."""
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        for _ in range(4):
            outcome: dict[str, str] = {}
            thread = threading.Thread(target=_sleep, args=(conn, 0.5, outcome))
            thread.start()
            with socket.create_connection((proxy.host, proxy.port)) as sock:
                sock.sendall(pg.cancel_request(conn.info.backend_pid, b"\0\0\0\1"))
                assert sock.recv(1) == b""
            thread.join(5)
            assert outcome["result"] == "finished"


# -- protocol 3.2 and startup packets -------------------------------------------------------


def _open(endpoint: Endpoint) -> socket.socket:
    return socket.create_connection((endpoint.host, endpoint.port), timeout=10)


def _read(sock: socket.socket) -> tuple[bytes, bytes]:
    header = _exactly(sock, 5)
    type_, length = struct.unpack("!ci", header)
    return type_, _exactly(sock, length - 4)


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def _login_3_2(endpoint: Endpoint, dbname: str) -> list[tuple[bytes, bytes]]:
    with _open(endpoint) as sock:
        sock.sendall(pg.startup_message({"user": "trust_user", "database": dbname, "_pq_.anonproxy_test": "x"},
                                        version=PROTOCOL_3_2))
        messages = [_read(sock)]
        while messages[-1][0] not in (b"Z", b"E"):
            messages.append(_read(sock))
        return messages


def test_protocol_3_2_startup_gets_what_the_server_answers(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    via_proxy, directly = _login_3_2(proxy, dbname), _login_3_2(direct, dbname)
    # PostgreSQL 15 answers NegotiateProtocolVersion: newest minor version 0, and the option it does not know.
    assert directly[0] == (b"v", struct.pack("!ii", 3 << 16, 1) + b"_pq_.anonproxy_test\0")
    assert via_proxy[0] == directly[0]
    assert [t for t, _ in via_proxy] == [t for t, _ in directly]
    key = dict(via_proxy)[b"K"]
    assert len(key) == 8  # the server fell back to 3.0: a 4-byte key


@pytest.fixture
def logging_proxy(pg_server: EmbeddedPostgres, tmp_path: Path) -> Iterator[ProxyProcess]:
    """A proxy of its own, so that its log holds only this test's lines."""
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / "proxy.log", workers="1")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log()


def _wait_for_log(proxy: ProxyProcess, words: str) -> str:
    deadline = time.monotonic() + 60
    while words not in proxy.log():
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)
    return proxy.log()


@pytest.mark.parametrize(
    ("packet", "words"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "invalid length of startup packet"),
        (struct.pack("!i", 100_000) + b"\0" * 100, "invalid length of startup packet"),
        (struct.pack("!iii", 12, pg.CANCEL_REQUEST_CODE, 1), "invalid length of cancel request packet"),
    ],
)
def test_packets_postgresql_drops_silently_are_dropped_silently_and_logged(logging_proxy: ProxyProcess,
                                                                          packet: bytes, words: str) -> None:
    with _open(logging_proxy.endpoint) as sock:
        sock.sendall(packet)
        assert sock.recv(1) == b""
    log = _wait_for_log(logging_proxy, words)
    assert sum(words in line for line in log.splitlines()) == 1


def test_malformed_startup_packets_answered_with_an_error_are_logged(logging_proxy: ProxyProcess) -> None:
    with _open(logging_proxy.endpoint) as sock:
        sock.sendall(struct.pack("!ii", 8, 2 << 16))
        type_, body = _read(sock)
        assert (type_, pg.parse_fields(body)["C"]) == (b"E", "0A000")
    _wait_for_log(logging_proxy, "unsupported frontend protocol 2.0")


def test_incomplete_startup_is_logged_but_a_bare_connection_is_not(logging_proxy: ProxyProcess) -> None:
    with _open(logging_proxy.endpoint):
        pass  # a port probe: nothing sent
    with _open(logging_proxy.endpoint) as sock:
        sock.sendall(b"\0\0")  # half a length
    log = _wait_for_log(logging_proxy, "incomplete startup packet")
    assert "(2 bytes)" in log
    assert sum("startup packet" in line for line in log.splitlines()) == 1


class Protocol32Server:
    """A stand-in for a PostgreSQL 18 server (none is installed here): it accepts any 3.x login without a
    password, sends a 32-byte BackendKeyData as protocol 3.2 does (process ids from 31337 up), and records the
    CancelRequests it gets."""

    SECRET = bytes(range(100, 132))

    def __init__(self) -> None:
        self.cancels: list[tuple[int, bytes]] = []
        self._pids = iter(range(31337, 40000))
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Protocol32Server:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            packet = await self._packet(reader)
            if isinstance(packet, pg.SSLRequest):  # no TLS here, as a server with ssl off answers
                writer.write(b"N")
                packet = await self._packet(reader)
            if isinstance(packet, pg.CancelRequest):
                self.cancels.append((packet.process_id, packet.secret_key))
            elif isinstance(packet, pg.StartupMessage):
                writer.write(pg.message(b"R", struct.pack("!i", 0)) + pg.parameter_status("client_encoding", "UTF8")
                             + pg.backend_key_data(next(self._pids), self.SECRET) + pg.ready_for_query())
                await writer.drain()
                await reader.read()  # until the client leaves
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _packet(reader: asyncio.StreamReader) -> pg.StartupPacket | None:
        (length,) = struct.unpack("!i", await reader.readexactly(4))
        return pg.read_startup_packet(struct.pack("!i", length) + await reader.readexactly(length - 4))[0]


def test_a_protocol_3_2_key_is_relayed_at_its_length_and_cancels_across_workers(tmp_path: Path) -> None:
    with Protocol32Server() as upstream:
        proxy = start_proxy(f"host=127.0.0.1 port={upstream.port}", tmp_path / "proxy.log", workers="2")
        try:
            sessions = []
            for _ in range(4):  # sessions on both workers
                sock = _open(proxy.endpoint)
                sock.sendall(pg.startup_message({"user": "alice"}, version=PROTOCOL_3_2))
                messages = [_read(sock) for _ in range(4)]
                assert [t for t, _ in messages] == [b"R", b"S", b"K", b"Z"]
                key = messages[2][1]
                sessions.append((sock, key))
                assert len(key) == 4 + 32
                assert key[4:] != upstream.SECRET  # the proxy's own secret, as long as the server's
            pids = [struct.unpack_from("!i", key)[0] for _, key in sessions]
            assert sorted(pids) == list(range(31337, 31337 + 4))  # the server's process ids, unchanged
            for attempt in range(8):  # cancels land on the issuing worker and on the other one
                _sock, key = sessions[attempt % len(sessions)]
                with _open(proxy.endpoint) as cancel:
                    cancel.sendall(pg.cancel_request(pids[attempt % len(sessions)], key[4:]))
                    assert cancel.recv(1) == b""  # hung up once the server acted
            assert sorted(upstream.cancels) == sorted((pid, upstream.SECRET) for pid in pids * 2)
            for sock, _key in sessions:
                sock.close()
        finally:
            stop_proxy(proxy)
        assert "Traceback" not in proxy.log()
