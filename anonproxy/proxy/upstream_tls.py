"""TLS on the proxy's own connections to PostgreSQL, as libpq's sslmode asks (docs/proxy.md, "TLS to PostgreSQL").

A connection starts in plaintext with an SSLRequest; the server answers one
byte, 'S' (go on in TLS) or 'N' (no TLS). Under ``prefer`` an 'N' goes on in
plaintext; under ``require`` and stronger it is an error. The answer must be
exactly one byte: a server (or someone in between) that sends more before the
handshake is refused, since those bytes would be read as if they had been
encrypted (CVE-2021-23222).

A server in TLS offers SCRAM with channel binding (SCRAM-SHA-256-PLUS), which
binds the login to the TLS connection it runs on. The client's login runs on
the client's connection to the proxy, not on the proxy's to the server, so the
binding could never match: the proxy takes that mechanism out of the list it
relays, and the client uses plain SCRAM-SHA-256.

One ``ssl.SSLContext`` per process (so per worker) per setting, built on first
use. A failure is logged once per worker until a connection succeeds again,
however many clients meet it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import struct

from ..config import UpstreamAddress, UpstreamTLS
from ..wire import protocol as pg

log = logging.getLogger("anonproxy.upstream")

_reported: set[str] = set()  # failures logged since the last connection that succeeded
_AUTH_SASL = struct.pack("!i", 10)
SCRAM_PLUS = b"SCRAM-SHA-256-PLUS"


class UpstreamTLSError(ConnectionError):
    """The server's TLS does not meet the upstream setting; the message is for the client, with a hint."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@functools.cache
def client_context(tls: UpstreamTLS) -> ssl.SSLContext | None:
    """The context for ``tls`` (None under sslmode=disable); raises OSError or ssl.SSLError for unusable files."""
    if tls.mode == "disable":
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # libpq's default ssl_min_protocol_version
    context.check_hostname = tls.mode == "verify-full"
    if tls.verified:
        context.verify_mode = ssl.CERT_REQUIRED
        if tls.rootcert == "system":
            context.load_default_certs()
        else:
            context.load_verify_locations(cafile=tls.rootcert)
        if tls.crl is not None:
            context.load_verify_locations(cafile=str(tls.crl))
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN  # as libpq: every certificate of the chain
    else:
        context.verify_mode = ssl.CERT_NONE  # prefer, require: encrypted, but the server is not authenticated
    if tls.cert is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context


class SSLAnswer(asyncio.Protocol):
    """The connection until the server has answered the SSLRequest (and, after 'S', until the handshake is done)."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # bytes the server sent inside TLS before the session's protocol took over

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None:  # (start_tls tells it again with the TLS transport)
            self.transport = transport  # type: ignore[assignment]
            self.transport.write(pg.ssl_request())  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            self.early.append(data)
            return
        assert self.transport is not None
        self.transport.pause_reading()  # nothing more is read in plaintext: TLS reads what follows
        if len(data) != 1:
            self.answer.set_exception(UpstreamTLSError(
                "the PostgreSQL server sent unencrypted data after its answer to anonproxy's SSL request",
                "Something between anonproxy and the server may be tampering with the connection."))
        else:
            self.answer.set_result(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(ConnectionError("the server closed the connection during the SSL request"))


async def negotiate(transport: asyncio.Transport, answer: SSLAnswer, address: UpstreamAddress) -> asyncio.Transport:
    """Go on in TLS if the server accepts it; else in plaintext if the setting allows. Returns the transport to use."""
    tls = address.tls
    context = client_context(tls)
    assert context is not None
    try:
        reply = await answer.answer
        if reply == b"N":
            if tls.required:
                raise UpstreamTLSError(
                    f"the PostgreSQL server at {address} does not accept TLS connections, and anonproxy's upstream "
                    f"setting asks for sslmode={tls.mode}",
                    "Turn ssl on in the server, or change sslmode in anonproxy's upstream setting.")
            _reported.clear()
            transport.resume_reading()
            return transport
        if reply != b"S":
            raise UpstreamTLSError(f"the PostgreSQL server at {address} answered anonproxy's SSL request with "
                                   f"{reply!r}", "Is the upstream setting's address a PostgreSQL server?")
        secure = await asyncio.get_running_loop().start_tls(transport, answer, context, server_hostname=address.host)
        if secure is None:
            raise ConnectionError("the server closed the connection during the TLS handshake")
    except ssl.SSLCertVerificationError as exc:
        transport.abort()
        raise _reported_once(UpstreamTLSError(
            f"certificate verification failed: {exc.verify_message} (PostgreSQL server at {address}, "
            f"upstream sslmode={tls.mode})",
            "Check sslrootcert and the host name in anonproxy's upstream setting against the server's "
            "certificate.")) from None
    except ssl.SSLError as exc:
        transport.abort()
        raise _reported_once(UpstreamTLSError(
            f"the TLS handshake with the PostgreSQL server at {address} failed: {exc.reason or exc}",
            "Check the TLS settings of anonproxy's upstream setting and the server's ssl settings.")) from None
    except UpstreamTLSError as exc:
        transport.abort()
        raise _reported_once(exc) from None
    _reported.clear()
    return secure  # type: ignore[return-value]


def _reported_once(error: UpstreamTLSError) -> UpstreamTLSError:
    if str(error) not in _reported:
        _reported.add(str(error))
        log.error("%s", error)
    return error


def without_channel_binding(body: bytes) -> bytes:
    """An Authentication message's body, with SCRAM-SHA-256-PLUS taken out of an AuthenticationSASL list."""
    if not body.startswith(_AUTH_SASL) or SCRAM_PLUS not in body:
        return body
    mechanisms = [name for name in body[4:].split(b"\0") if name and name != SCRAM_PLUS]
    return _AUTH_SASL + b"".join(name + b"\0" for name in mechanisms) + b"\0"
