"""TLS from the proxy to PostgreSQL, across a network namespace (docs/proxy.md, "TLS to PostgreSQL").

PostgreSQL runs inside a network namespace made here (ip netns, a veth pair), so the proxy reaches it over a real
link, not loopback. The server has ``ssl = on`` with certificates made here by openssl, and its pg_hba.conf refuses
every connection without TLS (``hostnossl … reject``) and without a client certificate signed by the test's CA
(the service role logs in by certificate alone): a connection the proxy makes at all is encrypted, and
``pg_stat_ssl`` says so for each kind (relayed sessions, gated sessions, the service pool, dp answers and the
ledger, the audit trail, the policy watcher). A TCP tap in front of the server shows that every connection,
cancel requests included, turns to TLS right after its SSLRequest.

Run as root (network namespaces); the namespace goes at the end, also after a failure.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import asyncpg
import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    ProxyProcess,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)
from netns import Host, hosts
from tls_network import Certificates, Tap, certificates

from anonproxy import sample_data, schema
from anonproxy.config import load_config
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.views.hierarchies import load_adult_hierarchies
from anonproxy.wire import protocol as pg

DATABASE = "tls_db"
NET = 201  # the server's LAN: 10.201.0.0/24
SERVER_NAME = "db.anonproxy.test"
TLS_HANDSHAKE = 0x16  # the first byte of a TLS handshake record


@dataclass(frozen=True)
class World:
    space: Host
    certs: Certificates
    server: EmbeddedPostgres

    def upstream(self, sslmode: str = "verify-full", host: str | None = None, port: int | None = None,
                 rootcert: Path | None = None, client_cert: bool = True) -> str:
        """An upstream setting for the proxy."""
        parts = [f"host={host or self.space.inside}", f"port={port or self.server.port}", f"sslmode={sslmode}"]
        if sslmode.startswith("verify"):
            parts.append(f"sslrootcert={rootcert or self.certs.ca}")
        if client_cert:
            parts += [f"sslcert={self.certs.client_cert}", f"sslkey={self.certs.client_key}"]
        return " ".join(parts)

    def superuser(self) -> psycopg.Connection:
        """The test's own connection to the database, in TLS with the client certificate (as the server demands)."""
        return psycopg.connect(self.server.conninfo(dbname=DATABASE) + f" {self.upstream()}", autocommit=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with hosts(NET, 1) as (space,), certificates([SERVER_NAME], [space.inside], SERVICE_ROLE) as certs:
        settings = {"ssl": "on", "ssl_cert_file": str(certs.server_cert), "ssl_key_file": str(certs.server_key),
                    "ssl_ca_file": str(certs.ca)}
        hba = [f"hostssl all {SERVICE_ROLE} {space.network} cert",  # the service login: its certificate alone
               f"hostssl all all {space.network} scram-sha-256 clientcert=verify-ca",
               "hostnossl all all 0.0.0.0/0 reject"]
        with EmbeddedPostgres(hba_extra=hba, settings=settings, host=space.inside, wrapper=space.command()) as server:
            found = World(space, certs, server)
            with psycopg.connect(server.conninfo() + f" {found.upstream()}", autocommit=True) as conn:
                conn.execute(f"create database {DATABASE}")
            with found.superuser() as conn:
                schema.install(conn)
                sample_data.load_demo(conn)
                load_adult_hierarchies(conn)
                govern_by_demo_policy(conn, DATABASE)
            yield found


def _proxy(upstream: str, log: Path, **settings: str) -> ProxyProcess:
    return start_proxy(upstream, log, service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={DATABASE}",
                       log_level="debug", **settings)


def _stopped_cleanly(proxy: ProxyProcess) -> str:
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.process.returncode == 0, proxy.log()
    return proxy.log()


@pytest.fixture(scope="module")
def proxy(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """The proxy, with sslmode=verify-full and its client certificate, in two workers."""
    running = _proxy(world.upstream(), tmp_path_factory.mktemp("tls") / "proxy.log", workers="2")
    yield running
    _stopped_cleanly(running)


def _connect(proxy: ProxyProcess, user: str) -> psycopg.Connection:
    return psycopg.connect(proxy.endpoint.dsn(DATABASE, user=user, password=user), autocommit=True)


def test_the_server_refuses_plaintext(world: World) -> None:
    """The ground the other tests stand on: nothing reaches this server without TLS."""
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(world.server.conninfo(dbname=DATABASE) + " sslmode=disable")


def test_every_kind_of_connection_is_encrypted_and_presents_the_client_certificate(world: World,
                                                                                     proxy: ProxyProcess) -> None:
    with _connect(proxy, "dba") as dba, _connect(proxy, "reporter") as reporter, \
            _connect(proxy, "analyst") as analyst, world.superuser() as owner:
        # The relayed session's own connection, seen from inside it.
        assert dba.execute("select ssl, client_dn from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == \
            (True, f"/CN={SERVICE_ROLE}")
        # A rewritten query (on a pooled service connection), a dp answer (its connection charges the ledger);
        # both are written to the audit trail before they are answered.
        assert reporter.execute("select sex, count(*) from adult group by 1 order by 1").fetchall()
        assert analyst.execute("select count(*) from adult").fetchone()[0] > 0
        assert owner.execute("select count(*) from anonproxy.audit_trail where login in ('reporter', 'analyst')"
                             ).fetchone()[0] >= 2
        backends = owner.execute(
            "select a.usename, a.application_name, s.ssl, s.client_dn from pg_stat_activity a "
            "join pg_stat_ssl s using (pid) where a.datname = %s and a.pid <> pg_backend_pid()",
            [DATABASE]).fetchall()
    assert {(ssl, dn) for _, _, ssl, dn in backends} == {(True, f"/CN={SERVICE_ROLE}")}, backends
    assert {"dba", "reporter", "analyst", SERVICE_ROLE} <= {user for user, *_ in backends}
    service = [name for user, name, *_ in backends if user == SERVICE_ROLE]
    assert {"anonproxy service", "anonproxy audit"} <= set(service)  # the service pool, the trail writer
    # Besides those, the psycopg connections: each worker's policy watcher, and the dp answers' (and ledger's).
    assert len([name for name in service if name not in ("anonproxy service", "anonproxy audit")]) >= 3, backends


def test_prefer_encrypts_when_the_server_offers_tls(world: World, tmp_path: Path) -> None:
    """sslmode=prefer: no verification, but TLS whenever the server has it."""
    upstream = world.upstream("prefer")
    assert "sslmode=prefer" in upstream and "sslrootcert" not in upstream
    running = _proxy(upstream, tmp_path / "proxy.log", workers="1")
    try:
        with _connect(running, "dba") as dba:
            assert dba.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (True,)
    finally:
        _stopped_cleanly(running)


def _sleep_cancelled(conn: psycopg.Connection, outcome: dict[str, str]) -> None:
    try:
        conn.execute("select pg_sleep(30)")
        outcome["result"] = "finished"
    except psycopg.errors.QueryCanceled:
        outcome["result"] = "cancelled"


def test_every_connection_turns_to_tls_after_its_ssl_request_cancel_requests_too(world: World,
                                                                                  tmp_path: Path) -> None:
    """Through a tap that records what the proxy sends: each connection starts with an SSLRequest, and the next byte
    is the start of a TLS handshake. The proxy's cancel request is one of them, and the server acts on it."""
    with Tap((world.space.inside, world.server.port)) as tap:
        # verify-ca: the tap's address is not in the server's certificate.
        running = _proxy(world.upstream("verify-ca", host="127.0.0.1", port=tap.port), tmp_path / "proxy.log",
                         workers="2")
        try:
            with _connect(running, "reporter") as reporter:
                assert reporter.execute("select sex, count(*) from adult group by 1").fetchall()
            with _connect(running, "dba") as dba:
                outcome: dict[str, str] = {}
                thread = threading.Thread(target=_sleep_cancelled, args=(dba, outcome))
                thread.start()
                _wait_for_sleep(world)
                before = len(tap.sent)
                dba.cancel_safe(timeout=10)
                thread.join(15)
                assert outcome == {"result": "cancelled"}
                assert len(tap.sent) > before  # the cancel request's connection
        finally:
            _stopped_cleanly(running)
    assert len(tap.sent) >= 5  # start-up check, policy watchers, audit trail, sessions, service, cancel
    for first in tap.sent:
        assert bytes(first[:8]) == pg.ssl_request() and first[8] == TLS_HANDSHAKE, first


def _wait_for_sleep(world: World) -> None:
    with world.superuser() as owner:
        deadline = time.monotonic() + 60
        while not owner.execute("select count(*) from pg_stat_activity where query = 'select pg_sleep(30)' "
                                "and state = 'active'").fetchone()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def _refused(proxy: ProxyProcess, user: str, database: str = DATABASE) -> asyncpg.PostgresError:
    """The error a login through ``proxy`` gets (asyncpg: libpq gives no SQLSTATE for a refused login)."""
    async def login() -> None:
        conn = await asyncpg.connect(host=proxy.endpoint.host, port=proxy.endpoint.port, user=user, password=user,
                                     database=database, ssl=False)
        await conn.close()

    with pytest.raises(asyncpg.PostgresError) as caught:
        asyncio.run(login())
    return caught.value


def test_verify_full_with_a_wrong_host_name_fails_cleanly(world: World, tmp_path: Path) -> None:
    """The proxy is told 127.0.0.1 (a tap to the server), which the server's certificate does not name."""
    with Tap((world.space.inside, world.server.port)) as tap:
        running = start_proxy(world.upstream("verify-full", host="127.0.0.1", port=tap.port),
                              tmp_path / "proxy.log", workers="1")
        try:
            errors = [_refused(running, user) for user in ("dba", "reporter", "analyst")]
        finally:
            log = _stopped_cleanly(running)
    for error in errors:
        assert error.sqlstate == "08006"
        assert error.message.startswith("certificate verification failed: "), error.message
        assert "127.0.0.1" in error.message
        assert "sslrootcert" in error.hint
    assert log.count("certificate verification failed") == 1, log  # once, however many clients meet it


def test_verify_ca_with_an_unknown_ca_fails_cleanly(world: World, tmp_path: Path) -> None:
    running = start_proxy(world.upstream("verify-ca", rootcert=world.certs.other_ca), tmp_path / "proxy.log",
                          workers="1")
    try:
        error = _refused(running, "dba")
    finally:
        _stopped_cleanly(running)
    assert error.sqlstate == "08006"
    # (OpenSSL's words: the server sends its CA along, "self-signed certificate in certificate chain")
    assert error.message.startswith("certificate verification failed: ") and "sslmode=verify-ca" in error.message, \
        error.message


def test_a_revoked_server_certificate_fails_verification(world: World, tmp_path: Path) -> None:
    running = start_proxy(f"{world.upstream()} sslcrl={world.certs.revoked}", tmp_path / "proxy.log", workers="1")
    try:
        error = _refused(running, "dba")
    finally:
        _stopped_cleanly(running)
    assert error.sqlstate == "08006"
    assert error.message.startswith("certificate verification failed: certificate revoked"), error.message


def test_without_its_client_certificate_the_proxy_is_refused_by_the_server(world: World, tmp_path: Path) -> None:
    """The server asks every connection for a certificate signed by the test's CA: the login works above only
    because the proxy presents one; without it, the client hears the server's own refusal."""
    running = start_proxy(world.upstream(client_cert=False), tmp_path / "proxy.log", workers="1")
    try:
        error = _refused(running, "dba")
    finally:
        _stopped_cleanly(running)
    assert error.sqlstate == "28000"
    assert error.message == "connection requires a valid client certificate"


def test_require_against_a_server_without_tls_fails_cleanly(pg_server: EmbeddedPostgres, tmp_path: Path) -> None:
    """The suite's own server has ssl off."""
    running = start_proxy(f"host={pg_server.host} port={pg_server.port} sslmode=require", tmp_path / "proxy.log",
                          workers="1")
    try:
        error = _refused(running, "scram_user", "postgres")
    finally:
        log = _stopped_cleanly(running)
    assert error.sqlstate == "08006"
    assert "does not accept TLS" in error.message and "sslmode=require" in error.message, error.message
    assert log.count("does not accept TLS") == 1, log


def _serve(**settings: str) -> subprocess.CompletedProcess[str]:
    """`anonproxy serve` with these settings, expected to stop at once."""
    env = {**os.environ, "ANONPROXY_LISTEN_PORT": "0", **{f"ANONPROXY_{k.upper()}": v for k, v in settings.items()}}
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "serve"], capture_output=True, text=True,
                          check=False, env=env, timeout=30)


@pytest.mark.parametrize("upstream, named", [
    ("host=db sslmode=verify-full sslrootcert=/nonexistent/root.crt", "sslrootcert"),
    ("host=db sslmode=verify-full", "sslrootcert"),
    ("host=db sslmode=verify-everything", "sslmode"),
    ("host=db sslmode=allow", "sslmode=allow"),
    ("host=db sslcert=/nonexistent/client.crt sslkey=/nonexistent/client.key", "sslcert"),
    ("host=db sslcert=/etc/hostname", "sslkey"),
    ("host=db sslpassword=secret", "sslpassword"),
    ("host=db sslmode=verify-ca sslrootcert=system", "sslrootcert=system needs sslmode=verify-full"),
])
def test_a_bad_tls_setting_stops_serve_with_one_line_naming_it(upstream: str, named: str) -> None:
    result = _serve(upstream=upstream)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("anonproxy: configuration error: upstream ") and named in result.stderr, \
        result.stderr


def test_a_client_key_others_may_read_is_refused(world: World, tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_bytes(world.certs.client_key.read_bytes())
    key.chmod(0o644)
    result = _serve(upstream=f"host=db sslcert={world.certs.client_cert} sslkey={key}")
    assert result.returncode == 2
    assert "group or world access" in result.stderr and str(key) in result.stderr, result.stderr


def test_tls_to_the_server_is_off_unless_configured() -> None:
    """Not libpq's prefer: a client in TLS to the proxy, with libpq's default channel binding, could not log in to a
    server reached in TLS (test_scram_reaches_the_server_without_channel_binding)."""
    config = load_config(environ={"ANONPROXY_UPSTREAM": "host=db.internal port=5432"})
    assert config.upstream_address.tls.mode == "disable" and not config.upstream_address.tls.required
    assert "sslmode=disable" in config.service_conninfo


def test_tls_settings_belong_in_upstream_not_service_dsn() -> None:
    result = _serve(upstream="host=db", service_dsn="user=s password=s dbname=d sslmode=require")
    assert result.returncode == 2
    assert "service_dsn may not give sslmode" in result.stderr, result.stderr


def test_scram_reaches_the_server_without_channel_binding(world: World, tmp_path: Path) -> None:
    """The server in TLS offers SCRAM-SHA-256-PLUS; the proxy relays SCRAM-SHA-256 alone. A client in plaintext
    logs in (libpq refuses -PLUS offered over plaintext); one in TLS to the proxy logs in with channel binding
    off; one that asks for channel binding, or offers it, is refused (the binding would be to the proxy's TLS, not
    the server's)."""
    running = start_proxy(world.upstream(), tmp_path / "proxy.log", workers="1",
                          tls_cert=str(world.certs.client_cert), tls_key=str(world.certs.client_key))
    try:
        dsn = running.endpoint.dsn(DATABASE, user="dba", password="dba")
        with psycopg.connect(f"{dsn} sslmode=disable") as conn:
            assert conn.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (True,)
        with psycopg.connect(f"{dsn} sslmode=require channel_binding=disable") as conn:
            assert conn.pgconn.ssl_in_use
            assert conn.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (True,)
        with pytest.raises(psycopg.OperationalError, match="channel binding"):
            psycopg.connect(f"{dsn} sslmode=require channel_binding=require")
        # libpq's default, channel_binding=prefer, over TLS: "y" (it could bind, but nothing is offered), which the
        # server, in TLS itself, takes for a downgrade (docs/proxy.md, "SCRAM and channel binding").
        with pytest.raises(psycopg.OperationalError, match="SCRAM channel binding negotiation error"):
            psycopg.connect(f"{dsn} sslmode=require")
    finally:
        _stopped_cleanly(running)


class EagerServer:
    """A hostile stand-in for a server (or someone in between): it answers an SSLRequest with 'S' and, in the same
    packet, plaintext that would pass for the server's first messages if it were read as if it had been encrypted
    (CVE-2021-23222)."""

    INJECTED = pg.message(b"R", b"\0\0\0\0") + pg.ready_for_query()

    def __enter__(self) -> Self:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
        self._thread.join(5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                if conn.recv(8) == pg.ssl_request():
                    conn.sendall(b"S" + self.INJECTED)
                    conn.recv(1024)  # (until the proxy hangs up)


def test_plaintext_after_the_servers_ssl_answer_is_refused(tmp_path: Path) -> None:
    with EagerServer() as server:
        running = start_proxy(f"host=127.0.0.1 port={server.port} sslmode=require", tmp_path / "proxy.log",
                              workers="1")
        try:
            error = _refused(running, "dba", "postgres")
        finally:
            _stopped_cleanly(running)
    assert error.sqlstate == "08006"
    assert "sent unencrypted data after its answer to anonproxy's SSL request" in error.message, error.message
