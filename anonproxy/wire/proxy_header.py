"""The PROXY protocol header (versions 1 and 2) that a TCP load balancer such as HAProxy sends first on a connection,
to say whose connection it relays. Sans-I/O: bytes in, a parsed header out.

The header comes before anything of PostgreSQL's protocol. A startup packet cannot be mistaken for one: it begins
with its length, at most a few kilobytes, while the headers begin with ``PROXY `` (v1) or ``\\r\\n\\r\\n`` (v2), which
as a length would be hundreds of megabytes.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from .protocol import ProtocolViolation

V1_PREFIX = b"PROXY "
V1_MAX_LENGTH = 107  # the specification's longest v1 line, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
_V2_FIXED = struct.Struct("!12sBBH")  # signature, version and command, family and transport, length of the rest
_V2_INET = struct.Struct("!4s4sHH")
_V2_INET6 = struct.Struct("!16s16sHH")


@dataclass(frozen=True)
class ProxyHeader:
    """Who the balancer says is at the other end. ``source`` is None when the header gives no address (v1
    ``UNKNOWN``, v2 ``LOCAL`` such as a health check, or a family other than TCP over IPv4/IPv6): the connection's
    own peer is then the client."""

    source: tuple[str, int] | None
    version: int


def may_be_proxy_header(buffer: bytes | bytearray) -> bool:
    """Whether the first bytes of a connection are those of a PROXY header rather than of a startup packet."""
    head = bytes(buffer[:len(V2_SIGNATURE)])
    return V1_PREFIX.startswith(head[:len(V1_PREFIX)]) or V2_SIGNATURE.startswith(head)


def read_proxy_header(buffer: bytes | bytearray) -> tuple[ProxyHeader | None, int]:
    """Parse a PROXY header from the front of ``buffer``: ``(header, bytes consumed)``, or ``(None, 0)`` when more
    bytes are needed. Raises ProtocolViolation (silent: the connection is closed) for a malformed header."""
    if buffer[:1] == V1_PREFIX[:1]:
        return _read_v1(bytes(buffer[:V1_MAX_LENGTH]))
    return _read_v2(buffer)


def _read_v1(data: bytes) -> tuple[ProxyHeader | None, int]:
    end = data.find(b"\r\n")
    if end < 0:
        if len(data) >= V1_MAX_LENGTH:
            raise _malformed(f"a v1 line longer than {V1_MAX_LENGTH} bytes")
        if not data.startswith(V1_PREFIX[:len(data)]):
            raise _malformed("it does not begin with 'PROXY '")
        return None, 0
    fields = data[:end].split(b" ")
    if fields[0] != V1_PREFIX.strip():
        raise _malformed("it does not begin with 'PROXY '")
    if len(fields) >= 2 and fields[1] == b"UNKNOWN":
        return ProxyHeader(None, 1), end + 2
    if len(fields) != 6 or fields[1] not in (b"TCP4", b"TCP6"):
        raise _malformed("a v1 line must be 'PROXY TCP4|TCP6 source destination source-port destination-port'")
    version = 4 if fields[1] == b"TCP4" else 6
    source = _v1_address(fields[2], version)
    _v1_address(fields[3], version)
    port = _v1_port(fields[4])
    _v1_port(fields[5])
    return ProxyHeader((source, port), 1), end + 2


def _v1_address(text: bytes, version: int) -> str:
    try:
        address = ipaddress.ip_address(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise _malformed(f"{text!r} is not an IP address") from None
    if address.version != version:
        raise _malformed(f"{address} is not an IPv{version} address")
    return str(address)


def _v1_port(text: bytes) -> int:
    # Ports are written in decimal without leading zeros (the specification), so no sign, no spaces, no "0123".
    if not text.isdigit() or (len(text) > 1 and text.startswith(b"0")) or int(text) > 65535:
        raise _malformed(f"{text!r} is not a port number")
    return int(text)


def _read_v2(buffer: bytes | bytearray) -> tuple[ProxyHeader | None, int]:
    if len(buffer) < _V2_FIXED.size:
        if not V2_SIGNATURE.startswith(bytes(buffer[:len(V2_SIGNATURE)])):
            raise _malformed("it does not begin with the v2 signature")
        return None, 0
    signature, version_command, family_transport, length = _V2_FIXED.unpack_from(buffer)
    if signature != V2_SIGNATURE:
        raise _malformed("it does not begin with the v2 signature")
    if version_command >> 4 != 2:
        raise _malformed(f"version {version_command >> 4} in a v2 header")
    command = version_command & 0x0F
    if command not in (0, 1):
        raise _malformed(f"unknown v2 command {command}")
    size = _V2_FIXED.size + length
    if len(buffer) < size:
        return None, 0
    body = bytes(buffer[_V2_FIXED.size:size])
    family, transport = family_transport >> 4, family_transport & 0x0F
    if command == 0 or transport != 1 or family not in (1, 2):
        # LOCAL (the balancer's own connection, e.g. a health check), or not TCP over IP: no client address.
        return ProxyHeader(None, 2), size
    layout, text = (_V2_INET, ipaddress.IPv4Address) if family == 1 else (_V2_INET6, ipaddress.IPv6Address)
    if len(body) < layout.size:
        raise _malformed(f"a v2 address block of {len(body)} bytes, fewer than its family needs ({layout.size})")
    source, _, source_port, _ = layout.unpack_from(body)  # what follows the addresses (TLVs) is not used
    return ProxyHeader((str(text(source)), source_port), 2), size


def _malformed(reason: str) -> ProtocolViolation:
    return ProtocolViolation(f"invalid PROXY protocol header: {reason}", silent=True)
