"""The proxy's own login (service connection) against the real server: each password method."""

from __future__ import annotations

import asyncio
import struct

import pytest

from anonproxy.config import ServiceLogin, UpstreamAddress
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.proxy.service import ServiceConnection, ServiceUnavailable
from anonproxy.wire import protocol as pg
from anonproxy.wire.auth import (
    AUTH_SASL_FINAL,
    AuthenticationFailed,
    PasswordAuthenticator,
)


async def login_and_query(server: EmbeddedPostgres, user: str, password: str) -> list[tuple[bytes, bytes]]:
    received: list[tuple[bytes, bytes]] = []
    done = asyncio.get_running_loop().create_future()

    def on_message(type_: bytes, body: bytes) -> None:
        received.append((type_, body))
        if type_ == b"Z":
            done.set_result(None)

    login = ServiceLogin(UpstreamAddress(server.host, server.port), user, password, "postgres")
    service = await ServiceConnection.open(login, {"DateStyle": "ISO, DMY", "user": "ignored"}, on_message,
                                           lambda: None)
    service.send(pg.query_message("select current_user, current_setting('DateStyle'), "
                                  "current_setting('default_transaction_read_only')"))
    await asyncio.wait_for(done, 5)
    service.close()
    return received


@pytest.mark.parametrize("role", ["scram_user", "md5_user", "trust_user"])
def test_service_login_with_each_method(pg_server: EmbeddedPostgres, role: str) -> None:
    received = asyncio.run(login_and_query(pg_server, role, role))
    row = next(body for type_, body in received if type_ == b"D")
    values = []
    offset = 2
    for _ in range(3):
        (length,) = struct.unpack_from("!i", row, offset)
        values.append(row[offset + 4: offset + 4 + length].decode())
        offset += 4 + length
    # The role logged in, the client's DateStyle was copied, and the session is read-only.
    assert values == [role, "ISO, DMY", "on"]


def test_wrong_service_password_is_reported(pg_server: EmbeddedPostgres) -> None:
    with pytest.raises(ServiceUnavailable, match="password authentication failed"):
        asyncio.run(login_and_query(pg_server, "scram_user", "wrong"))


def test_a_server_that_cannot_prove_the_password_is_refused() -> None:
    """SCRAM authenticates the server too: a forged final message must fail."""
    auth = PasswordAuthenticator("u", "secret")
    first = auth.respond(struct.pack("!i", 10) + b"SCRAM-SHA-256\0\0")
    nonce = first.split(b"r=")[1].decode() + "server"
    auth.respond(struct.pack("!i", 11) + f"r={nonce},s=c2FsdA==,i=4096".encode())
    with pytest.raises(AuthenticationFailed, match="signature does not match"):
        auth.respond(struct.pack("!i", AUTH_SASL_FINAL) + b"v=" + b"A" * 44)
