"""Bad input and bad luck: malformed bytes, vanishing peers, an upstream that is down or restarts.

Raw-socket tests speak the protocol by hand with the `trust_user` role, so no
password exchange is needed. Each case checks what the client receives and
that the proxy goes on serving everyone else.
"""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint, ProxyProcess, free_port, start_proxy, stop_proxy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg


def open_raw(endpoint: Endpoint) -> socket.socket:
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    type_, length = struct.unpack("!ci", recv_exactly(sock, 5))
    return type_, recv_exactly(sock, length - 4)


def read_until_ready(sock: socket.socket) -> list[tuple[bytes, bytes]]:
    messages = []
    while True:
        messages.append(read_message(sock))
        if messages[-1][0] in (b"Z",):
            return messages
        if messages[-1][0] == b"E" and pg.parse_fields(messages[-1][1])["S"] == "FATAL":
            return messages


def read_error(sock: socket.socket) -> dict[str, str]:
    type_, body = read_message(sock)
    assert type_ == b"E", (type_, body)
    return pg.parse_fields(body)


def assert_closed(sock: socket.socket) -> None:
    assert sock.recv(1) == b""


def login(sock: socket.socket, dbname: str) -> list[tuple[bytes, bytes]]:
    sock.sendall(pg.startup_message({"user": "trust_user", "database": dbname}))
    messages = read_until_ready(sock)
    assert messages[-1] == (b"Z", b"I"), messages
    return messages


def simple_query(sock: socket.socket, text: str) -> list[tuple[bytes, bytes]]:
    sock.sendall(pg.message(b"Q", text.encode() + b"\0"))
    return read_until_ready(sock)


def assert_proxy_serves(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname)) as conn:
        assert conn.execute("select count(*) from adult").fetchone() == (30162,)


def test_raw_session_by_hand(proxy: Endpoint, dbname: str) -> None:
    with open_raw(proxy) as sock:
        messages = login(sock, dbname)
        types = [t for t, _ in messages]
        assert types[0] == b"R" and b"S" in types and types.count(b"K") == 1
        rows = simple_query(sock, "select 40 + 2")
        assert (b"D", struct.pack("!hi", 1, 2) + b"42") in rows
        sock.sendall(pg.message(b"X"))
        assert_closed(sock)


def test_ssl_and_gssenc_requests_are_declined_without_tls(proxy: Endpoint, dbname: str) -> None:
    with open_raw(proxy) as sock:
        sock.sendall(struct.pack("!ii", 8, pg.GSSENC_REQUEST_CODE))
        assert recv_exactly(sock, 1) == b"N"
        sock.sendall(pg.ssl_request())
        assert recv_exactly(sock, 1) == b"N"
        login(sock, dbname)


def test_unencrypted_data_after_ssl_request_is_refused(proxy: Endpoint, dbname: str) -> None:
    with open_raw(proxy) as sock:
        sock.sendall(pg.ssl_request() + pg.startup_message({"user": "trust_user", "database": dbname}))
        error = read_error(sock)
        assert error["C"] == "08P01" and "unencrypted data after SSL request" in error["M"]
        assert_closed(sock)


@pytest.mark.parametrize(
    ("packet", "sqlstate", "words"),
    [
        (struct.pack("!ii", 8, 2 << 16), "0A000", "unsupported frontend protocol 2.0"),
        (struct.pack("!ii", 9, pg.PROTOCOL_V3) + b"\0", "28000", "no PostgreSQL user name"),
    ],
)
def test_bad_startup_packets_get_an_error(proxy: Endpoint, dbname: str, packet: bytes, sqlstate: str,
                                          words: str) -> None:
    with open_raw(proxy) as sock:
        sock.sendall(packet)
        error = read_error(sock)
        assert (error["S"], error["C"]) == ("FATAL", sqlstate)
        assert words in error["M"]
        assert_closed(sock)
    assert_proxy_serves(proxy, dbname)


def test_client_vanishing_at_every_startup_step(proxy: Endpoint, dbname: str) -> None:
    startup = pg.startup_message({"user": "scram_user", "database": dbname})
    for prefix in (b"", startup[:3], startup[:10], startup):
        with open_raw(proxy) as sock:
            sock.sendall(prefix)
    with open_raw(proxy) as sock:  # mid-SCRAM: the server's SASL request arrives, then we go
        sock.sendall(startup)
        assert read_message(sock)[0] == b"R"
    assert_proxy_serves(proxy, dbname)


@pytest.mark.parametrize(
    ("garbage", "sqlstate"),
    [
        (b"\xff" * 64, "08P01"),  # the server answers "invalid frontend message type"
        # The server only logs a bad length and hangs up; the proxy tells the client it did.
        (b"Q" + struct.pack("!i", 2), "08006"),
        (b"Q" + struct.pack("!i", (1 << 30) + 10), "08006"),
    ],
)
def test_invalid_messages_after_login(proxy: Endpoint, dbname: str, garbage: bytes, sqlstate: str) -> None:
    with open_raw(proxy) as sock:
        login(sock, dbname)
        sock.sendall(garbage)
        error = read_error(sock)
        assert (error["S"], error["C"]) == ("FATAL", sqlstate), error
        assert_closed(sock)
    assert_proxy_serves(proxy, dbname)


def test_a_misbehaving_client_does_not_disturb_others(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname)) as conn:
        conn.execute("select 1")
        for _ in range(20):
            with open_raw(proxy) as sock:
                sock.sendall(b"\x00\x00\x00\x05garbage")
        assert conn.execute("select count(*) from adult where sex = 'Female'").fetchone() == (9782,)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=120))
def test_fuzz_server_with_random_startup_bytes(proxy: Endpoint, data: bytes) -> None:
    """Whatever arrives first, then end of input: the answer is nothing, 'N', an ErrorResponse
    or the server's authentication request, and the proxy hangs up — never a crash."""
    with open_raw(proxy) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) in (b"", b"N", b"E", b"R")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=200))
def test_fuzz_server_with_random_bytes_after_login(proxy: Endpoint, data: bytes) -> None:
    with open_raw(proxy) as sock:
        login(sock, "postgres")
        sock.settimeout(2)
        sock.sendall(data)
        try:
            sock.recv(1)
        except TimeoutError:
            pass


def test_fuzz_left_the_proxy_serving(proxy: Endpoint, dbname: str) -> None:
    assert_proxy_serves(proxy, dbname)


# -- the upstream is down, or restarts ------------------------------------------


@pytest.fixture
def restartable_server() -> Iterator[EmbeddedPostgres]:
    """A server of its own, in a persistent data directory so it can stop and start again."""
    base = Path(tempfile.mkdtemp(prefix="anonproxy-restart-"))
    base.chmod(0o755)  # the postgres OS user must reach the data directory inside
    server = EmbeddedPostgres(data_dir=base / "data", port=free_port(),
                              hba_extra=["host all trust_user 127.0.0.1/32 trust"])
    try:
        with server:
            with psycopg.connect(server.conninfo(), autocommit=True) as conn:
                conn.execute("create role trust_user login superuser")
            yield server
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def own_proxy(restartable_server: EmbeddedPostgres, tmp_path: Path) -> Iterator[ProxyProcess]:
    proxy = start_proxy(f"host=127.0.0.1 port={restartable_server.port}", tmp_path / "proxy.log")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log()


def trust_dsn(endpoint: Endpoint) -> str:
    return f"host={endpoint.host} port={endpoint.port} user=trust_user dbname=postgres"


def test_upstream_down_at_connect_then_back(restartable_server: EmbeddedPostgres, own_proxy: ProxyProcess) -> None:
    restartable_server.stop()
    with pytest.raises(psycopg.OperationalError, match="anonproxy cannot reach the PostgreSQL server"):
        psycopg.connect(trust_dsn(own_proxy.endpoint))
    restartable_server.start()
    with psycopg.connect(trust_dsn(own_proxy.endpoint)) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    assert "cannot connect to upstream" in own_proxy.log()


def test_upstream_restart_mid_session(restartable_server: EmbeddedPostgres, own_proxy: ProxyProcess) -> None:
    conn = psycopg.connect(trust_dsn(own_proxy.endpoint), autocommit=True)
    assert conn.execute("select 1").fetchone() == (1,)
    restartable_server.stop()
    restartable_server.start()
    with pytest.raises(psycopg.OperationalError, match="terminating connection due to administrator command"):
        conn.execute("select 1")
    conn.close()
    with psycopg.connect(trust_dsn(own_proxy.endpoint)) as fresh:
        assert fresh.execute("select 2").fetchone() == (2,)


def test_upstream_vanishing_mid_query_gives_the_client_an_error(restartable_server: EmbeddedPostgres,
                                                                own_proxy: ProxyProcess) -> None:
    with psycopg.connect(trust_dsn(own_proxy.endpoint), autocommit=True) as conn:
        upstream_pid = conn.execute("select pg_backend_pid()").fetchone()[0]

        def terminate() -> None:
            with psycopg.connect(restartable_server.conninfo(), autocommit=True) as admin:
                admin.execute("select pg_terminate_backend(%s)", [upstream_pid])

        threading.Timer(0.3, terminate).start()
        with pytest.raises(psycopg.OperationalError, match="terminating connection due to administrator command"):
            conn.execute("select pg_sleep(5)")
    assert_serves_trust(own_proxy.endpoint)


def assert_serves_trust(endpoint: Endpoint) -> None:
    with psycopg.connect(trust_dsn(endpoint)) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_startup_timeout_closes_idle_handshakes(pg_server: EmbeddedPostgres, tmp_path: Path) -> None:
    proxy = start_proxy(f"host=127.0.0.1 port={pg_server.port}", tmp_path / "p.log", startup_timeout="1")
    try:
        with open_raw(proxy.endpoint) as sock:
            sock.sendall(struct.pack("!i", 100))  # a length, then silence
            error = read_error(sock)
            assert error["C"] == "08P01" and "did not complete in time" in error["M"]
            assert_closed(sock)
    finally:
        stop_proxy(proxy)


# -- TLS towards clients ---------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_when_configured(pg_server: EmbeddedPostgres, certificate: tuple[Path, Path], dbname: str,
                             tmp_path: Path) -> None:
    cert, key = certificate
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / "tls.log",
                        tls_cert=str(cert), tls_key=str(key))
    try:
        with psycopg.connect(proxy.endpoint.dsn(dbname) + f" sslmode=verify-full sslrootcert={cert} host=localhost hostaddr=127.0.0.1"
                             ) as conn:
            assert conn.pgconn.ssl_in_use
            assert conn.execute("select count(*) from adult").fetchone() == (30162,)
        with psycopg.connect(proxy.endpoint.dsn(dbname) + " sslmode=disable") as conn:
            assert not conn.pgconn.ssl_in_use
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log()


def test_tls_required_by_client_but_not_configured(proxy: Endpoint, dbname: str) -> None:
    with pytest.raises(psycopg.OperationalError, match="server does not support SSL"):
        psycopg.connect(proxy.dsn(dbname) + " sslmode=require")
