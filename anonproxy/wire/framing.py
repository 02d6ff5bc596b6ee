"""Incremental framing of typed protocol messages, without I/O.

Two tools for two jobs:

* ``MessageBuffer`` collects whole messages when the proxy must look inside
  them (the authentication exchange).
* ``BoundedMessageBuffer`` does the same for a client whose messages are
  read (a gated session), with a size limit per message type: the body of
  a longer message is dropped as it streams in, never buffered.
* ``RelayingMessageBuffer`` collects whole messages of a server whose
  messages are read (a gated session's), but hands on a long one (a big
  row) piece by piece as it arrives, to be forwarded, never held whole,
  and consecutive rows (DataRow) as one ``Rows`` of raw bytes, which the
  gate forwards without looking into each.
* ``BoundaryTracker`` follows message boundaries of a stream that is
  forwarded untouched, without copying it, so the proxy knows whether the
  upstream is idle and whether it may inject a message of its own.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

from .protocol import ProtocolViolation, read_header

# PostgreSQL accepts messages up to 1 GB; anything larger is a broken peer.
MAX_MESSAGE_SIZE = 1 << 30
_LENGTH = struct.Struct("!i")
_DATA_ROW = b"D"[0]


class MessageBuffer:
    """Accumulates bytes and yields complete ``(type, body)`` messages: a ``BoundedMessageBuffer`` without
    per-type limits, so every body is kept."""

    def __init__(self, max_size: int = MAX_MESSAGE_SIZE) -> None:
        self._messages = BoundedMessageBuffer({}, max_size)

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """Add bytes; return the messages they complete, leaving a partial one buffered."""
        return [(type_, body) for type_, body in self._messages.feed(data) if body is not None]

    def take_rest(self) -> bytes:
        """Bytes received after the last complete message (and forget them)."""
        return self._messages.take_rest()


class BoundedMessageBuffer:
    """``MessageBuffer`` with limits read from each message's header, before its body arrives.

    A message whose type has a limit in ``limits`` and whose body is longer
    is dropped as it streams in and yielded as ``(type, None)`` in its place;
    any other message longer than ``max_size`` is a protocol violation. So at
    most one message of ``max_size`` bytes is ever held.
    """

    def __init__(self, limits: dict[bytes, int], max_size: int) -> None:
        self._buffer = bytearray()
        self._limits = limits
        self._max_size = max_size
        self._dropping = 0  # bytes of a too-long message still to come, and to drop

    def feed(self, data: bytes) -> list[tuple[bytes, bytes | None]]:
        """Add bytes; return the messages they complete (a too-long one with body None)."""
        if self._dropping:
            dropped = min(self._dropping, len(data))
            self._dropping -= dropped
            data = data[dropped:]
        self._buffer += data
        messages: list[tuple[bytes, bytes | None]] = []
        offset = 0
        while len(self._buffer) - offset >= 5:
            type_, size = read_header(self._buffer, offset)
            limit = self._limits.get(type_)
            if limit is not None and size - 5 > limit:
                messages.append((type_, None))
                available = len(self._buffer) - offset
                if available < size:
                    self._dropping = size - available
                    offset = len(self._buffer)
                    break
                offset += size
                continue
            if size > self._max_size:
                raise ProtocolViolation(f"message of type {type_!r} is too large: {size} bytes", "54000")
            if len(self._buffer) - offset < size:
                break
            messages.append((type_, bytes(self._buffer[offset + 5 : offset + size])))
            offset += size
        del self._buffer[:offset]
        return messages

    def take_rest(self) -> bytes:
        """Bytes received after the last complete message (and forget them)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


class Piece(NamedTuple):
    """Bytes of a long message, to forward as they are; ``first``: they start with its header."""

    type_: bytes
    raw: bytes
    first: bool


class Rows(NamedTuple):
    """Consecutive whole DataRow messages, as they came."""

    raw: bytes


def messages(raw: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The ``(type, body)`` of each whole message in ``raw``."""
    offset = 0
    while offset < len(raw):
        type_, size = read_header(raw, offset)
        yield type_, raw[offset + 5 : offset + size]
        offset += size


def offsets(raw: bytes, types: bytes) -> list[int]:
    """The offsets of the messages in ``raw`` (whole ones, as the proxy made or framed them) whose type is one of the
    bytes of ``types``: their headers read, no body copied (this runs on every answer a gated session gets)."""
    found: list[int] = []
    offset = 0
    while offset < len(raw):
        if raw[offset] in types:
            found.append(offset)
        offset += 1 + _LENGTH.unpack_from(raw, offset + 1)[0]
    return found


class RelayingMessageBuffer:
    """Whole messages up to ``limit`` bytes as ``(type, body)``, consecutive DataRows among them as one ``Rows``;
    longer ones as ``Piece``s; in stream order."""

    def __init__(self, limit: int) -> None:
        self._buffer = bytearray()
        self._limit = limit
        self._type = b""  # of the long message under way
        self._remaining = 0  # of its bytes still to come
        self.last_type = b""  # of the last message (or piece) handed on

    @property
    def at_boundary(self) -> bool:
        """Nothing of a message is held or still expected."""
        return not self._remaining and not self._buffer

    def feed(self, data: bytes) -> list[tuple[bytes, bytes] | Piece | Rows]:
        out: list[tuple[bytes, bytes] | Piece | Rows] = []
        if self._remaining:
            piece = data[: self._remaining]
            self._remaining -= len(piece)
            data = data[len(piece):]
            out.append(Piece(self._type, piece, False))
        self._buffer += data
        offset = 0
        while len(self._buffer) - offset >= 5:
            type_, size = read_header(self._buffer, offset)
            available = len(self._buffer) - offset
            if size > self._limit:
                taken = min(available, size)
                out.append(Piece(type_, bytes(self._buffer[offset : offset + taken]), True))
                offset += taken
                if taken < size:
                    self._type, self._remaining = type_, size - taken
                    break
                continue
            if available < size:
                break
            if type_ == b"D":
                end = self._rows_end(offset + size)
                out.append(Rows(bytes(self._buffer[offset:end])))
                offset = end
                continue
            out.append((type_, bytes(self._buffer[offset + 5 : offset + size])))
            offset += size
        del self._buffer[:offset]
        if out:
            last = out[-1]
            self.last_type = b"D" if isinstance(last, Rows) else last[0]
        return out

    def _rows_end(self, end: int) -> int:
        """Where the run of whole DataRows (up to ``limit`` bytes each) that goes on at ``end`` stops: one header
        read per row, nothing copied (the hot loop of a gated session's long answers)."""
        buffer, limit, unpack = self._buffer, self._limit, _LENGTH.unpack_from
        stop = len(buffer) - 5
        while end <= stop and buffer[end] == _DATA_ROW:
            length = unpack(buffer, end + 1)[0]
            if length < 4 or length >= limit or end + 1 + length > len(buffer):
                break  # invalid, long or partial: the main loop deals with it
            end += 1 + length
        return end


class BoundaryTracker:
    """Follows the message boundaries of a server-to-client stream.

    ``feed`` costs O(1) for data inside a long message and one length read
    per message otherwise; it never copies the stream. It is the relay's
    only work per read besides the write, so it reads nothing but lengths
    and, once per read, the type of the last message begun.
    """

    def __init__(self) -> None:
        self._remaining = 0  # bytes of the current message not yet seen
        self.last_type = b""  # type of the current (or last complete) message
        self._header = b""  # a header split across two feeds
        self.idle = True  # the last complete message was ReadyForQuery, and no other has begun since

    @property
    def at_boundary(self) -> bool:
        return self._remaining == 0 and not self._header

    def feed(self, data: bytes) -> None:
        if self._header:
            data = self._header + data
            self._header = b""
        size = len(data)
        carried = offset = self._remaining
        if offset > size:  # all inside the current message
            self._remaining = offset - size
            return
        last = -1  # where the last message begun in ``data`` starts
        unpack = _LENGTH.unpack_from
        while size - offset >= 5:
            last = offset
            length = unpack(data, offset + 1)[0]
            if length < 4:
                raise ProtocolViolation(f"invalid message length {length} for message type {data[last:last + 1]!r}")
            offset += 1 + length
        if offset < size:  # (at most 4 bytes: a header cut short)
            self._header = data[offset:]
            self._remaining = 0
        else:
            self._remaining = offset - size
        if last >= 0:
            self.last_type = data[last : last + 1]
            self.idle = offset <= size and self.last_type == b"Z"
        elif carried:  # only the end of the current message came
            self.idle = self.last_type == b"Z"
