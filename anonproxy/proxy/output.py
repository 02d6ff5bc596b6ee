"""What a gated session sends its client, gathered and written in batches.

The gate hands on the server's answers message by message (it reads each: errors, ReadyForQuery, cursors…); one
``transport.write`` per message would be one system call per row. ``ClientOutput`` keeps what the gate writes during
one turn of the event loop (what one read from a server connection brought) and writes it at once at the end of the
turn, or as soon as it reaches ``limit`` bytes. Order is kept: everything the session sends its client in gated mode
goes through here, and ``flush`` comes before any direct write or close. Backpressure is the transport's, as before:
past its high-water mark it calls the session's ``pause_writing``, which stops reading from the servers; what is
kept here is never more than ``limit`` bytes and one message.
"""

from __future__ import annotations

import asyncio

BATCH_LIMIT = 64 * 1024  # bytes kept before writing, whatever the turn still brings


class ClientOutput:
    def __init__(self, transport: asyncio.Transport, limit: int = BATCH_LIMIT) -> None:
        self._transport = transport
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self.flush)  # at the end of this turn, after what the same read brings
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._limit:
            self.flush()

    def flush(self) -> None:
        """Write what is kept, in one call (nothing once the transport is closing: the client is gone)."""
        if not self._parts:
            return
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts.clear()
        self._size = 0
        if not self._transport.is_closing():
            self._transport.write(data)
