"""A direct session's relay on blocking sockets: one thread per direction, no event loop per message.

Once a direct session is logged in over plain TCP or a Unix socket, its two sockets are handed to a
:class:`ThreadRelay`: each direction is a thread that reads with a blocking ``recv_into`` and writes what it read
with ``sendall`` (CPython releases the GIL in both). Against the event loop's relay this saves the
``epoll_wait`` and the loop's work per event (a callback, its GIL hand-off, a new ``bytes`` per read), and the
kernel's wake-ups stay one per read (benchmarks/passthrough/README.md has the figures). A peer that reads
nothing blocks the other's thread in ``sendall``: TCP's own backpressure, as between client and server.

The asyncio transports keep owning the sockets: they are paused while the threads run (the threads use
duplicates of the file descriptors, in blocking mode) and get them back, non-blocking again, once both threads
have stopped; then ``ended`` runs on the event loop with the side that stopped the relay, and the session closes
as its asyncio path would. :meth:`ThreadRelay.stop` ends the relay from the event loop (a policy change, a
shutdown): shutting down the reading side of both sockets wakes a thread blocked in ``recv_into``.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import threading
from collections.abc import Callable

BUFFER_SIZE = 256 * 1024  # as uvloop's read buffer


class Side(enum.Enum):
    """Who ended the relay first."""

    CLIENT = "client"  # the client closed its connection (or it failed)
    SERVER = "server"  # the server closed its connection (or it failed, or sent an invalid message)
    STOPPED = "stopped"  # the event loop called stop()


Watch = Callable[[bytes], None]  # sees each read before it is written on (runs in a relay thread)


class ThreadRelay:
    def __init__(self, client: socket.socket, server: socket.socket, *, watch_client: Watch, watch_server: Watch,
                 ended: Callable[[Side, BaseException | None], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._client, self._server = _blocking_duplicate(client), _blocking_duplicate(server)
        self._ended = ended
        self._lock = threading.Lock()
        self._running = 2  # threads not yet finished
        self._first: Side | None = None
        self._error: BaseException | None = None  # what made the server's side stop, if not a closed socket
        for source, target, side, watch in ((self._client, self._server, Side.CLIENT, watch_client),
                                            (self._server, self._client, Side.SERVER, watch_server)):
            threading.Thread(target=self._pump, args=(source, target, side, watch), daemon=True,
                             name=f"relay-{side.value}").start()

    def stop(self) -> None:
        """End the relay (from the event loop): ``ended`` runs once both threads have stopped."""
        self._finish(Side.STOPPED, None)

    def _pump(self, source: socket.socket, target: socket.socket, side: Side, watch: Watch) -> None:
        buffer = bytearray(BUFFER_SIZE)
        view = memoryview(buffer)
        receive, send = source.recv_into, target.sendall
        error: BaseException | None = None
        try:
            while True:
                size = receive(buffer)
                if not size:
                    break
                data = bytes(view[:size])
                watch(data)
                send(data)
        except OSError:
            pass  # a reset or a shut-down socket: the end of this direction, like a clean close
        except Exception as exc:  # noqa: BLE001 (watch() refused the stream: the session says why, on the loop)
            error = exc
        finally:
            view.release()
        self._finish(side, error)
        self._thread_done()

    def _finish(self, side: Side, error: BaseException | None) -> None:
        with self._lock:
            if self._first is not None:
                return
            self._first, self._error = side, error
        for sock in (self._client, self._server):  # wakes the other thread, blocked in recv_into
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # already closed by the peer

    def _thread_done(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running:
                return
        for sock in (self._client, self._server):
            sock.setblocking(False)  # (shared with the transport's descriptor)
            sock.close()
        assert self._first is not None
        self._loop.call_soon_threadsafe(self._ended, self._first, self._error)


def _blocking_duplicate(sock: socket.socket) -> socket.socket:
    duplicate = socket.socket(sock.family, sock.type, fileno=socket.dup(sock.fileno()))
    duplicate.setblocking(True)
    return duplicate
