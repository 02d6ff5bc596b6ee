"""PostgreSQL protocol v3 messages: constants, parsers and builders.

Pure functions over bytes, no I/O (sans-I/O in the manner of h11): the
networking layer in ``anonproxy.proxy`` feeds bytes in and writes the bytes
these functions return.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# Codes carried in the version field of untyped (startup-phase) packets.
PROTOCOL_V3 = 3 << 16
CANCEL_REQUEST_CODE = 80877102
SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104

# PostgreSQL's own limit for a startup packet (MAX_STARTUP_PACKET_LENGTH).
MAX_STARTUP_PACKET = 10_000
# Protocol 3.2 (PostgreSQL 18) cancel keys are 1 to 256 bytes; 3.0 ones are 4 (MAX_CANCEL_KEY_LENGTH).
MAX_CANCEL_KEY = 256

_I32 = struct.Struct("!i")
_HEADER = struct.Struct("!ci")


class ProtocolViolation(Exception):
    """The peer sent bytes that are not valid protocol v3; carries a SQLSTATE."""

    def __init__(self, message: str, sqlstate: str = "08P01", *, silent: bool = False) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        # PostgreSQL only logs such a violation (COMMERROR) and hangs up without a word to the client.
        self.silent = silent


@dataclass(frozen=True)
class SSLRequest:
    pass


@dataclass(frozen=True)
class GSSENCRequest:
    pass


@dataclass(frozen=True)
class CancelRequest:
    process_id: int
    secret_key: bytes  # 4 bytes in protocol 3.0, up to MAX_CANCEL_KEY in 3.2


@dataclass(frozen=True)
class StartupMessage:
    version: int
    parameters: dict[str, str] = field(default_factory=dict)

    @property
    def user(self) -> str:
        return self.parameters["user"]

    @property
    def database(self) -> str:
        return self.parameters.get("database") or self.user


StartupPacket = SSLRequest | GSSENCRequest | CancelRequest | StartupMessage


def read_startup_packet(buffer: bytes | bytearray) -> tuple[StartupPacket | None, int]:
    """Parse one untyped startup-phase packet from the front of ``buffer``.

    Returns ``(packet, bytes consumed)``, or ``(None, 0)`` when more bytes are
    needed. Raises ProtocolViolation for a packet PostgreSQL would refuse.
    """
    if len(buffer) < 4:
        return None, 0
    (length,) = _I32.unpack_from(buffer, 0)
    if length < 8 or length > MAX_STARTUP_PACKET:
        raise ProtocolViolation(f"invalid length of startup packet: {length}", silent=True)
    if len(buffer) < length:
        return None, 0
    return parse_startup_packet(bytes(buffer[4:length])), length


def parse_startup_packet(body: bytes) -> StartupPacket:
    """Parse the body of a startup-phase packet (everything after the length)."""
    (code,) = _I32.unpack_from(body, 0)
    if code == SSL_REQUEST_CODE and len(body) == 4:
        return SSLRequest()
    if code == GSSENC_REQUEST_CODE and len(body) == 4:
        return GSSENCRequest()
    if code == CANCEL_REQUEST_CODE:
        if not 8 < len(body) <= 8 + MAX_CANCEL_KEY:
            raise ProtocolViolation(f"invalid length of cancel request packet: {len(body) + 4}", silent=True)
        (process_id,) = _I32.unpack_from(body, 4)
        return CancelRequest(process_id, body[8:])
    major, minor = code >> 16, code & 0xFFFF
    if major != 3:
        raise ProtocolViolation(
            f"unsupported frontend protocol {major}.{minor}: "
            "server supports 3.0 to 3.0",
            sqlstate="0A000",
        )
    return StartupMessage(code, _parse_parameters(body[4:]))


def _parse_parameters(data: bytes) -> dict[str, str]:
    if not data.endswith(b"\0"):
        raise ProtocolViolation("invalid startup packet layout: expected terminator as last byte")
    items = data[:-1].split(b"\0")
    if items == [b""]:
        items = []
    if items and items[-1] == b"":
        items.pop()  # the list ends with an empty name
    if len(items) % 2:
        raise ProtocolViolation("invalid startup packet layout: a parameter has no value")
    try:
        decoded = [item.decode("utf-8") for item in items]
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("invalid startup packet: parameters are not valid UTF-8") from exc
    parameters = dict(zip(decoded[0::2], decoded[1::2]))
    if not parameters.get("user"):
        raise ProtocolViolation("no PostgreSQL user name specified in startup packet", "28000")
    return parameters


def startup_message(parameters: dict[str, str], version: int = PROTOCOL_V3) -> bytes:
    body = b"".join(k.encode() + b"\0" + v.encode() + b"\0" for k, v in parameters.items())
    body = _I32.pack(version) + body + b"\0"
    return _I32.pack(len(body) + 4) + body


def cancel_request(process_id: int, secret_key: bytes) -> bytes:
    return struct.pack("!iii", 12 + len(secret_key), CANCEL_REQUEST_CODE, process_id) + secret_key


def ssl_request() -> bytes:
    return struct.pack("!ii", 8, SSL_REQUEST_CODE)


def message(type_: bytes, body: bytes = b"") -> bytes:
    """A typed message: one type byte, a length that counts itself, the body."""
    return _HEADER.pack(type_, len(body) + 4) + body


def read_header(buffer: bytes | bytearray | memoryview, offset: int) -> tuple[bytes, int]:
    """Type byte and total size (type byte included) of the message at offset."""
    type_, length = _HEADER.unpack_from(buffer, offset)
    if length < 4:
        raise ProtocolViolation(f"invalid message length {length} for message type {type_!r}")
    return type_, length + 1


# Field codes of ErrorResponse / NoticeResponse.
SEVERITY, SEVERITY_NONLOCALIZED, SQLSTATE, MESSAGE, DETAIL, HINT = b"S", b"V", b"C", b"M", b"D", b"H"


def error_response(
    sqlstate: str,
    text: str,
    *,
    severity: str = "ERROR",
    detail: str | None = None,
    hint: str | None = None,
    type_: bytes = b"E",
) -> bytes:
    """ErrorResponse (or NoticeResponse with ``type_=b"N"``)."""
    fields = [(SEVERITY, severity), (SEVERITY_NONLOCALIZED, severity), (SQLSTATE, sqlstate), (MESSAGE, text)]
    if detail:
        fields.append((DETAIL, detail))
    if hint:
        fields.append((HINT, hint))
    body = b"".join(code + value.encode("utf-8", "replace") + b"\0" for code, value in fields)
    return message(type_, body + b"\0")


def parse_fields(body: bytes) -> dict[str, str]:
    """Fields of an ErrorResponse / NoticeResponse body, keyed by field code."""
    fields: dict[str, str] = {}
    for item in body.split(b"\0"):
        if item:
            fields[chr(item[0])] = item[1:].decode("utf-8", "replace")
    return fields


def backend_key_data(process_id: int, secret_key: bytes) -> bytes:
    return message(b"K", _I32.pack(process_id) + secret_key)


def parse_backend_key_data(body: bytes) -> tuple[int, bytes]:
    """Process id and secret key: 4 bytes in protocol 3.0, up to MAX_CANCEL_KEY in 3.2."""
    if not 4 < len(body) <= 4 + MAX_CANCEL_KEY:
        raise ProtocolViolation(f"invalid BackendKeyData message: a key of {len(body) - 4} bytes")
    return _I32.unpack_from(body)[0], body[4:]


def parameter_status(name: str, value: str) -> bytes:
    return message(b"S", name.encode() + b"\0" + value.encode() + b"\0")


def ready_for_query(status: bytes = b"I") -> bytes:
    return message(b"Z", status)


def read_cstring(body: bytes, offset: int = 0) -> tuple[bytes, int]:
    """A NUL-terminated string at ``offset`` and the offset after it."""
    end = body.find(b"\0", offset)
    if end < 0:
        raise ProtocolViolation("invalid string in message: no terminator")
    return body[offset:end], end + 1


def parse_message(name: bytes, query: str, rest: bytes) -> bytes:
    """A Parse message; ``rest`` is the parameter-type part copied from the client's."""
    return message(b"P", name + b"\0" + query.encode() + b"\0" + rest)


def query_message(text: str) -> bytes:
    return message(b"Q", text.encode() + b"\0")


# A RowDescription field less its format code, as PostgreSQL sends it: name, table OID and column number (0, 0: no
# table column), type OID, type length (pg_type.typlen), type modifier.
Field = tuple[str, int, int, int, int, int]


def row_description(names: list[str], type_oids: list[int] | None = None, formats: list[int] | None = None) -> bytes:
    """RowDescription (of type text unless ``type_oids`` says otherwise; text format unless ``formats`` does)."""
    oids = type_oids or [25] * len(names)
    return described([(name, 0, 0, oid, -1, -1) for name, oid in zip(names, oids, strict=True)], formats)


def described(fields: list[Field], formats: list[int] | None = None) -> bytes:
    """RowDescription of ``fields`` (text format unless ``formats`` says otherwise)."""
    codes = formats or [0] * len(fields)
    body = b"".join(name.encode() + b"\0" + struct.pack("!ihihih", table, attnum, oid, size, typmod, code)
                    for (name, table, attnum, oid, size, typmod), code in zip(fields, codes, strict=True))
    return message(b"T", struct.pack("!h", len(fields)) + body)


def parse_row_fields(body: bytes) -> list[Field]:
    """The fields of a RowDescription, as PostgreSQL sent them (format codes left out)."""
    (count,) = struct.unpack_from("!h", body)
    offset, fields = 2, list[Field]()
    for _ in range(count):
        name, offset = read_cstring(body, offset)
        table, attnum, oid, size, typmod, _ = struct.unpack_from("!ihihih", body, offset)
        fields.append((name.decode(), table, attnum, oid, size, typmod))
        offset += 18
    return fields


def parse_row_description(body: bytes) -> list[tuple[str, int]]:
    """(name, type oid) of each column of a RowDescription."""
    return [(name, oid) for name, _, _, oid, _, _ in parse_row_fields(body)]


def data_row(values: list[str | bytes | None]) -> bytes:
    parts = [struct.pack("!h", len(values))]
    for value in values:
        if value is None:
            parts.append(_I32.pack(-1))
        else:
            encoded = value.encode() if isinstance(value, str) else value
            parts.append(_I32.pack(len(encoded)) + encoded)
    return message(b"D", b"".join(parts))


def parse_data_row(body: bytes) -> tuple[bytes | None, ...]:
    (count,) = struct.unpack_from("!h", body)
    offset, values = 2, list[bytes | None]()
    for _ in range(count):
        (size,) = _I32.unpack_from(body, offset)
        offset += 4
        if size < 0:
            values.append(None)
        else:
            values.append(body[offset:offset + size])
            offset += size
    return tuple(values)


def parameter_description(type_oids: list[int]) -> bytes:
    return message(b"t", struct.pack(f"!h{len(type_oids)}I", len(type_oids), *type_oids))


@dataclass(frozen=True)
class Parse:
    statement: bytes
    query: bytes
    parameter_types: tuple[int, ...]


def parse_parse(body: bytes) -> Parse:
    """The fields of a Parse message."""
    statement, offset = read_cstring(body)
    query, offset = read_cstring(body, offset)
    (count,) = _unpack("!h", body, offset)
    return Parse(statement, query, _unpack(f"!{count}I", body, offset + 2))


@dataclass(frozen=True)
class Bind:
    portal: bytes
    statement: bytes
    parameter_formats: tuple[int, ...]  # as sent: none (all text), one (for all), or one per value
    values: tuple[bytes | None, ...]
    result_formats: tuple[int, ...]  # the same convention, per result column


def parse_bind(body: bytes) -> Bind:
    """The fields of a Bind message; ProtocolViolation if they do not add up."""
    portal, offset = read_cstring(body)
    statement, offset = read_cstring(body, offset)
    (count,) = _unpack("!h", body, offset)
    parameter_formats = _unpack(f"!{count}h", body, offset + 2)
    offset += 2 + 2 * count
    (count,) = _unpack("!h", body, offset)
    offset += 2
    values: list[bytes | None] = []
    for _ in range(count):
        (size,) = _unpack("!i", body, offset)
        offset += 4
        if size < 0:
            values.append(None)
            continue
        if offset + size > len(body):
            raise ProtocolViolation("invalid Bind message: a parameter value is longer than the message")
        values.append(body[offset:offset + size])
        offset += size
    (count,) = _unpack("!h", body, offset)
    result_formats = _unpack(f"!{count}h", body, offset + 2)
    if offset + 2 + 2 * count != len(body):
        raise ProtocolViolation("invalid Bind message: unexpected bytes at its end")
    if len(parameter_formats) not in (0, 1, len(values)):
        raise ProtocolViolation(f"bind message has {len(parameter_formats)} parameter formats but "
                                f"{len(values)} parameters")
    return Bind(portal, statement, parameter_formats, tuple(values), result_formats)


def parse_execute(body: bytes) -> tuple[bytes, int]:
    """Portal name and row limit (0: all rows) of an Execute message."""
    portal, offset = read_cstring(body)
    (max_rows,) = _unpack("!i", body, offset)
    return portal, max_rows


def _unpack(layout: str, body: bytes, offset: int) -> tuple[int, ...]:
    try:
        return struct.unpack_from(layout, body, offset)
    except struct.error:
        raise ProtocolViolation("invalid message: it ends too early") from None


def command_complete(tag: str) -> bytes:
    return message(b"C", tag.encode() + b"\0")
