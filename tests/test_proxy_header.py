"""The PROXY protocol: behind a TCP load balancer, the audit trail records the client, not the balancer.

The codec is tested on bytes; the proxy behind a real HAProxy (the Debian package) in TCP mode, which sends a v1 or
a v2 header on every connection it relays (``send-proxy``, ``send-proxy-v2``) and health-checks the proxy with the
header too. The balancer connects from 127.0.0.2, the only address in the proxy's ``trusted_proxies``; clients
connect from 127.0.0.1 (every 127.x address is this machine's loopback). A header from any other address, or a
malformed one, closes the connection without a word, as PostgreSQL does with bytes it cannot read.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import (
    GATED_DATABASE,
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    free_port,
    start_proxy,
    stop_proxy,
)
from haproxy import server_states

from anonproxy.config import ConfigError, load_config
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire.protocol import ProtocolViolation
from anonproxy.wire.proxy_header import (
    ProxyHeader,
    may_be_proxy_header,
    read_proxy_header,
)

DATABASE = GATED_DATABASE  # the demo policy's (its trail rows are told apart by their statements' comments)
BALANCER = "127.0.0.2"  # the source address of HAProxy's connections to the proxy, and the only trusted one
AGG = "select sex, count(*) from adult group by sex order by sex"
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


def v2_header(command: int, family: int, addresses: bytes, tlvs: bytes = b"") -> bytes:
    """A v2 header as the specification lays it out (written here independently of the codec)."""
    body = addresses + tlvs
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(body)) + body


def v2_inet(source: str, source_port: int, destination: str = "192.0.2.1", destination_port: int = 6432) -> bytes:
    return v2_header(1, 0x11, ipaddress.IPv4Address(source).packed + ipaddress.IPv4Address(destination).packed
                     + struct.pack("!HH", source_port, destination_port))


def v2_inet6(source: str, source_port: int, tlvs: bytes = b"") -> bytes:
    return v2_header(1, 0x21, ipaddress.IPv6Address(source).packed + ipaddress.IPv6Address("2001:db8::1").packed
                     + struct.pack("!HH", source_port, 6432), tlvs)


# -- the codec ---------------------------------------------------------------------------------------------------

STARTUP = struct.pack("!II", 8, 196608)


@pytest.mark.parametrize(("data", "header"), [
    (b"PROXY TCP4 198.51.100.7 192.0.2.1 51234 6432\r\n", ProxyHeader(("198.51.100.7", 51234), 1)),
    (b"PROXY TCP6 2001:db8::7 2001:db8::1 443 6432\r\n", ProxyHeader(("2001:db8::7", 443), 1)),
    (b"PROXY UNKNOWN\r\n", ProxyHeader(None, 1)),
    (b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n", ProxyHeader(None, 1)),
    (v2_inet("198.51.100.7", 51234), ProxyHeader(("198.51.100.7", 51234), 2)),
    (v2_inet6("2001:db8::7", 65535, tlvs=b"\x05\x00\x03abc"), ProxyHeader(("2001:db8::7", 65535), 2)),
    (v2_header(0, 0x00, b""), ProxyHeader(None, 2)),  # LOCAL: the balancer's own connection (a health check)
    (v2_header(0, 0x11, bytes(12)), ProxyHeader(None, 2)),  # LOCAL with addresses: they are not the client's
    (v2_header(1, 0x31, bytes(216)), ProxyHeader(None, 2)),  # a Unix socket: no address
    (v2_header(1, 0x12, bytes(12)), ProxyHeader(None, 2)),  # UDP over IPv4: not a client of ours
])
def test_headers_are_read_whole_and_only_them(data: bytes, header: ProxyHeader) -> None:
    assert may_be_proxy_header(data[:1])
    # Every proper prefix asks for more; the whole header is read, and what follows it is left alone.
    for end in range(1, len(data)):
        assert read_proxy_header(data[:end]) == (None, 0)
    assert read_proxy_header(data + STARTUP) == (header, len(data))


def test_a_startup_packet_is_not_a_header() -> None:
    for packet in (STARTUP, struct.pack("!II", 8, 80877103), struct.pack("!III", 16, 80877102, 1)):
        assert not may_be_proxy_header(packet[:1]) and not may_be_proxy_header(packet)


@pytest.mark.parametrize("data", [
    b"PROXY TCP4 198.51.100.7 192.0.2.1 51234\r\n",  # a field missing
    b"PROXY TCP4 2001:db8::7 192.0.2.1 51234 6432\r\n",  # IPv6 under TCP4
    b"PROXY TCP6 198.51.100.7 2001:db8::1 51234 6432\r\n",
    b"PROXY TCP4 198.51.100.256 192.0.2.1 51234 6432\r\n",
    b"PROXY TCP4 198.51.100.7 192.0.2.1 65536 6432\r\n",
    b"PROXY TCP4 198.51.100.7 192.0.2.1 051234 6432\r\n",  # leading zero
    b"PROXY TCP4 198.51.100.7 192.0.2.1 -1 6432\r\n",
    b"PROXY UDP4 198.51.100.7 192.0.2.1 51234 6432\r\n",
    b"PROXY  TCP4 198.51.100.7 192.0.2.1 51234 6432\r\n",
    b"PROXY TCP4 " + b"1" * 100,  # no CRLF within the longest line allowed
    b"PROXZ",
    V2_SIGNATURE[:5] + b"X",
    v2_header(1, 0x11, bytes(8)),  # an IPv4 block too short
    v2_header(1, 0x21, bytes(12)),  # an IPv6 block too short
    v2_header(2, 0x11, bytes(12)),  # no such command
    V2_SIGNATURE + bytes([0x10, 0x11]) + struct.pack("!H", 12) + bytes(12),  # version 1 in a v2 header
])
def test_malformed_headers_are_violations_that_close_the_connection(data: bytes) -> None:
    with pytest.raises(ProtocolViolation) as raised:
        read_proxy_header(data + STARTUP)
    assert raised.value.silent and "PROXY protocol header" in str(raised.value)


def test_trusted_proxies_setting() -> None:
    config = load_config(environ={"ANONPROXY_TRUSTED_PROXIES": "127.0.0.2, 10.1.0.0/16,2001:db8::/32"})
    assert [str(network) for network in config.trusted_proxy_networks] == [
        "127.0.0.2/32", "10.1.0.0/16", "2001:db8::/32"]
    assert load_config(environ={}).trusted_proxy_networks == ()
    with pytest.raises(ConfigError, match="trusted_proxies: 'balancer' is not an IP address"):
        load_config(environ={"ANONPROXY_TRUSTED_PROXIES": "balancer"})


def test_peers_setting() -> None:
    config = load_config(environ={"ANONPROXY_PEERS": "10.0.0.11:6432, [2001:db8::12]:7000"})
    assert config.peer_endpoints == (("10.0.0.11", 6432), ("2001:db8::12", 7000))
    for bad in ("proxy2:6432", "10.0.0.11", "10.0.0.11:0", "10.0.0.11:x"):
        with pytest.raises(ConfigError, match="peers: "):
            load_config(environ={"ANONPROXY_PEERS": bad})


# -- through HAProxy and the real proxy --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def anonproxy(pg_server: EmbeddedPostgres, gated_database: str, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ProxyProcess]:
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}",
                        tmp_path_factory.mktemp("proxy-protocol") / "anonproxy.log", workers="1", log_level="debug",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}",
                        trusted_proxies=BALANCER)
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


class HAProxy:
    """HAProxy in TCP mode in front of the proxy: one frontend sending v1 headers, one sending v2."""

    def __init__(self, target: Endpoint, directory: Path) -> None:
        self.v1 = Endpoint("127.0.0.1", free_port())
        self.v2 = Endpoint("127.0.0.1", free_port())
        self.stats = directory / "stats.sock"
        config = directory / "haproxy.cfg"
        config.write_text(f"""
global
    stats socket {self.stats} level admin
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend v1
    bind {self.v1.host}:{self.v1.port}
    default_backend v1
frontend v2
    bind {self.v2.host}:{self.v2.port}
    default_backend v2
backend v1
    option pgsql-check user scram_user
    server anonproxy {target.host}:{target.port} source {BALANCER} send-proxy check check-send-proxy inter 500
backend v2
    option pgsql-check user scram_user
    server anonproxy {target.host}:{target.port} source {BALANCER} send-proxy-v2 check check-send-proxy inter 500
""")
        self.process = subprocess.Popen([shutil.which("haproxy") or "haproxy", "-db", "-f", str(config)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def status(self) -> dict[str, str]:
        """Each backend's server status."""
        return {backend: state for (backend, _), state in server_states(self.stats).items()}

    def stop(self) -> str:
        self.process.terminate()
        output, _ = self.process.communicate(timeout=10)
        return output.decode(errors="replace")


@pytest.fixture(scope="module")
def haproxy(anonproxy: ProxyProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HAProxy]:
    balancer = HAProxy(anonproxy.endpoint, tmp_path_factory.mktemp("haproxy"))
    deadline = time.monotonic() + 30
    while True:  # HAProxy is up, and its health checks (headers included) find the proxy up
        try:
            if balancer.status() == {"v1": "UP", "v2": "UP"}:
                break
        except OSError:
            pass
        if balancer.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"HAProxy did not find anonproxy up:\n{balancer.stop()}\n{anonproxy.log()}")
        time.sleep(0.2)
    yield balancer
    balancer.stop()


def trail_rows(pg_server: EmbeddedPostgres, statement: str) -> list[tuple[str, int]]:
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as owner:
        return [(str(addr), port) for addr, port in owner.execute(
            "select client_addr, client_port from anonproxy.audit_trail where statement = %s order by id",
            [statement]).fetchall()]


def local_port(conn: psycopg.Connection) -> int:
    with socket.socket(fileno=conn.pgconn.socket) as sock:
        try:
            return sock.getsockname()[1]
        finally:
            sock.detach()  # the socket is psycopg's


@pytest.mark.parametrize("frontend", ["v1", "v2"])
def test_the_trail_records_the_client_behind_the_balancer(haproxy: HAProxy, pg_server: EmbeddedPostgres,
                                                          frontend: str) -> None:
    endpoint = getattr(haproxy, frontend)
    statement = f"{AGG} -- through HAProxy {frontend}"
    with psycopg.connect(endpoint.dsn(DATABASE, "reporter")) as conn:
        port = local_port(conn)
        assert conn.execute(statement).fetchall()
    # The client's own address and port (its connection to HAProxy), not the balancer's 127.0.0.2.
    assert trail_rows(pg_server, statement) == [("127.0.0.1", port)]


def test_cancel_requests_pass_through_the_balancer(haproxy: HAProxy) -> None:
    with psycopg.connect(haproxy.v2.dsn(DATABASE)) as conn:
        timer = threading.Timer(1.0, conn.cancel)
        timer.start()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("select pg_sleep(60)")
        timer.join()


def test_without_a_header_the_peer_is_the_client(anonproxy: ProxyProcess, pg_server: EmbeddedPostgres) -> None:
    statement = f"{AGG} -- directly"
    with psycopg.connect(anonproxy.endpoint.dsn(DATABASE, "reporter")) as conn:
        port = local_port(conn)
        conn.execute(statement).fetchall()
    assert trail_rows(pg_server, statement) == [("127.0.0.1", port)]


class HeaderForwarder:
    """A balancer of our own, on a trusted address: it sends the header it is given, then relays both ways."""

    def __init__(self, target: Endpoint, header: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = Endpoint("127.0.0.1", self.listener.getsockname()[1])
        self.target, self.header = target, header
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection((self.target.host, self.target.port), source_address=(BALANCER, 0))
        server.sendall(self.header)
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_an_ipv6_client_with_tlvs(anonproxy: ProxyProcess, pg_server: EmbeddedPostgres) -> None:
    forwarder = HeaderForwarder(anonproxy.endpoint, v2_inet6("2001:db8::42", 40000, tlvs=b"\x04\x00\x02hi"))
    statement = f"{AGG} -- from IPv6"
    with psycopg.connect(forwarder.endpoint.dsn(DATABASE, "reporter")) as conn:
        conn.execute(statement).fetchall()
    assert trail_rows(pg_server, statement) == [("2001:db8::42", 40000)]


def hung_up_silently(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("header", [b"PROXY TCP4 203.0.113.9 192.0.2.1 4242 6432\r\n", v2_inet("203.0.113.9", 4242)])
def test_a_header_from_an_untrusted_address_is_refused(anonproxy: ProxyProcess, header: bytes) -> None:
    # From 127.0.0.1, not in trusted_proxies: whoever sends it could name any address.
    with socket.create_connection((anonproxy.endpoint.host, anonproxy.endpoint.port),
                                  source_address=("127.0.0.1", 0)) as sock:
        sock.sendall(header + STARTUP)
        assert hung_up_silently(sock)
    assert "PROXY protocol header from an address not in trusted_proxies" in anonproxy.log()
    with psycopg.connect(anonproxy.endpoint.dsn(DATABASE)) as conn:  # the proxy goes on serving
        assert conn.execute("select 1").fetchone() == (1,)


def test_a_malformed_header_from_the_balancer_closes_its_connection(anonproxy: ProxyProcess) -> None:
    with socket.create_connection((anonproxy.endpoint.host, anonproxy.endpoint.port),
                                  source_address=(BALANCER, 0)) as sock:
        sock.sendall(b"PROXY TCP4 203.0.113.9 192.0.2.1 99999 6432\r\n" + STARTUP)
        assert hung_up_silently(sock)
    assert "invalid PROXY protocol header: b'99999' is not a port number" in anonproxy.log()


def test_a_header_comes_first_or_not_at_all(anonproxy: ProxyProcess) -> None:
    """After the first startup packet (here an SSLRequest answered 'N'), a header is just bad bytes."""
    with socket.create_connection((anonproxy.endpoint.host, anonproxy.endpoint.port),
                                  source_address=(BALANCER, 0)) as sock:
        sock.sendall(struct.pack("!II", 8, 80877103))
        assert sock.recv(1) == b"N"
        sock.sendall(b"PROXY TCP4 203.0.113.9 192.0.2.1 4242 6432\r\n")
        assert hung_up_silently(sock)
