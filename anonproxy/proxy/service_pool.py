"""The worker's pool of service connections, shared by its gated sessions.

A gated session holds a service connection only while its rewritten
statements run there: it checks one out when it first needs it and gives it
back once the service side answered ReadyForQuery, idle, with nothing of the
session's left in flight. So N gated sessions need N backends of their own
plus at most ``size`` service backends per worker, not 2N.

Connections are opened lazily, up to ``size``; when all are busy, sessions
wait in line (first come, first served), each for at most ``wait_timeout``
seconds: then it gets :class:`PoolBusy` (a session answers its statement
with an error), never an open-ended stall. A session whose open batch keeps
its connection waiting for the client registers with ``holding_idle``: while
a session waits in line, the pool asks every such holder to give its
connection up (``give_up``; the session ends the batch and hands it back).

At checkout, a connection must answer a Sync with ReadyForQuery: one that
does not (the server ended it while it was idle, e.g. a restart) is dropped
and another opened in its place. When the server refuses a new one (53300
too many clients, 57P03…), the waiting session gets the server's own reason
(:class:`ServiceUnavailable` with its refusal).

With several servers (proxy/servers.py), a new connection goes to the standby
in rotation with the least lag, else to the primary; one that cannot be opened
on a standby takes it out of rotation and is opened on the next choice, so the
statement waiting for it does not fail. At checkout, a connection to a server
no longer in rotation (lagging, gone, promoted away) is closed and replaced.

The pool does not reset connections itself: every session starts its use of
a connection with a Close of each statement the previous one prepared there
for its client, ``RESET ALL`` and its own settings (see service_side.py), so
nothing of a previous session is seen; the proxy's own prepared statements of
rewritten Queries stay, recorded with the connection (service_statements.py).
A connection handed back in an unknown state (mid-statement, in a
transaction) is closed instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable

from ..config import ServiceLogin, UpstreamAddress
from ..wire import protocol as pg
from .servers import Servers
from .service import ServiceConnection, ServiceUnavailable

log = logging.getLogger("anonproxy.service")

SYNC = pg.message(b"S")
ALIVE_TIMEOUT = 10.0  # seconds the server may take to answer the liveness check at checkout

# Startup parameters of a pooled connection: neutral; each session applies its own settings at checkout.
POOL_PARAMETERS = {"client_encoding": "UTF8"}


class PoolBusy(Exception):
    """Every connection of the pool stayed checked out for the whole of the pool's ``wait_timeout``."""


class ServicePool:
    def __init__(self, login: ServiceLogin, size: int, wait_timeout: float, servers: Servers | None = None) -> None:
        self._login = login
        self._servers = servers  # None: every connection goes to the login's address
        self._where: dict[ServiceConnection, UpstreamAddress] = {}  # the server of each open connection
        self.size = size
        self.wait_timeout = wait_timeout
        self._free: deque[ServiceConnection] = deque()
        self._count = 0  # open or being opened, free or checked out
        # Sessions waiting for a connection: each gets one (or None: "open one yourself, a slot is free").
        self._waiters: deque[asyncio.Future[ServiceConnection | None]] = deque()
        self._idle_holders: dict[object, Callable[[], None]] = {}  # see ``holding_idle``

    async def acquire(self) -> ServiceConnection:
        """A live connection for this session alone, until ``release`` or ``discard``; :class:`PoolBusy` if
        none is handed back within ``wait_timeout``."""
        deadline = asyncio.get_running_loop().time() + self.wait_timeout
        while True:
            service = await self._next(deadline)
            if not self._in_rotation(service):
                log.info("a pooled service connection's server is out of rotation; replacing it")
            elif await self._alive(service):
                return service
            else:
                log.info("a pooled service connection was ended by the server; replacing it")
            self.discard(service)

    async def _next(self, deadline: float) -> ServiceConnection:
        """A free connection, a new one if there is room, or the first one handed back before ``deadline``."""
        while True:
            if self._free:
                return self._free.popleft()
            if self._count < self.size:
                return await self._open()
            waiter: asyncio.Future[ServiceConnection | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self._reclaim()
            try:
                async with asyncio.timeout_at(deadline):
                    service = await waiter
            except (asyncio.CancelledError, TimeoutError) as exc:
                if waiter.done() and not waiter.cancelled():
                    self._pass_on(waiter.result())  # handed to us as we were cancelled: to the next in line
                if isinstance(exc, TimeoutError):
                    raise PoolBusy from None
                raise
            if service is not None:
                return service

    async def _open(self) -> ServiceConnection:
        self._count += 1
        opening = asyncio.ensure_future(self._connect())
        try:
            service = await asyncio.shield(opening)  # a login half done when the session leaves must not leak
        except asyncio.CancelledError:
            opening.add_done_callback(self._opened_for_nobody)
            raise
        except BaseException:
            self._pass_on(None)
            raise
        self._idle(service)
        return service

    async def _connect(self) -> ServiceConnection:
        """A new connection: to the login's server, or to the reader the servers name now (a standby that cannot
        be reached leaves the rotation, and the next choice is tried)."""
        if self._servers is None:
            return await ServiceConnection.open(self._login, POOL_PARAMETERS, _ignore, _nothing)
        while True:
            address = self._servers.reader()
            try:
                service = await ServiceConnection.open(dataclasses.replace(self._login, address=address),
                                                       POOL_PARAMETERS, _ignore, _nothing)
            except ServiceUnavailable:
                self._servers.failed(address)
                if address == self._servers.primary:
                    raise
                continue
            self._where[service] = address
            return service

    def _in_rotation(self, service: ServiceConnection) -> bool:
        address = self._where.get(service)
        return self._servers is None or address is None or self._servers.serves(address)

    def _opened_for_nobody(self, opening: asyncio.Future[ServiceConnection]) -> None:
        """A connection opened for a session that left meanwhile: to the next in line, or free."""
        if opening.cancelled() or opening.exception() is not None:
            self._pass_on(None)
            return
        service = opening.result()
        self._idle(service)
        self._pass_on(service)

    async def _alive(self, service: ServiceConnection) -> bool:
        """Whether the server still answers on ``service`` (a Sync, answered with ReadyForQuery).

        A connection the server ended while it was idle may not look closed yet: a round trip tells.
        """
        if service.closed:
            return False
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(*_: object) -> None:
            if not answered.done():
                answered.set_result(None)

        service.on_message = lambda type_, body: done() if type_ == b"Z" else None
        service.on_lost = done
        service.send(SYNC)
        try:
            await asyncio.wait_for(answered, ALIVE_TIMEOUT)
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            self.discard(service)  # its state is unknown
            raise
        finally:
            self._idle(service)
        return not service.closed

    def release(self, service: ServiceConnection) -> None:
        """The session is done with ``service``: the next waiting session gets it."""
        if service.closed:
            self.discard(service)
            return
        self._idle(service)
        self._pass_on(service)

    def discard(self, service: ServiceConnection) -> None:
        """Close a checked-out connection whose state is unknown; its slot goes to the next waiting session."""
        service.on_message, service.on_lost = _ignore, _nothing
        service.close()
        self._where.pop(service, None)
        self._pass_on(None)

    def holding_idle(self, holder: object, give_up: Callable[[], None]) -> None:
        """``holder`` keeps a checked-out connection waiting for its client: ``give_up`` is called (soon, once)
        when a session waits for a connection, now or until ``holding_busy``."""
        self._idle_holders[holder] = give_up
        self._reclaim()

    def holding_busy(self, holder: object) -> None:
        """``holder`` no longer keeps its connection (if any) waiting for its client."""
        self._idle_holders.pop(holder, None)

    def _reclaim(self) -> None:
        """While a session waits, every idle holder is asked to give its connection up."""
        if not any(not waiter.done() for waiter in self._waiters):
            return
        holders, self._idle_holders = self._idle_holders, {}
        for give_up in holders.values():
            asyncio.get_running_loop().call_soon(give_up)  # not from within another session's call

    def close(self) -> None:
        while self._free:
            self._free.popleft().close()
        self._where.clear()

    def _idle(self, service: ServiceConnection) -> None:
        # Between sessions, a notice or a parameter change is nobody's; a loss is noticed at checkout.
        service.on_message, service.on_lost = _ignore, _nothing

    def _pass_on(self, service: ServiceConnection | None) -> None:
        """Hand ``service`` (None: a free slot) to the first session still waiting, or keep it."""
        if service is None:
            self._count -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(service)  # None: the waiter opens one itself, in the slot just freed
                return
        if service is not None:
            self._free.append(service)


def _ignore(type_: bytes, body: bytes) -> None:
    pass


def _nothing() -> None:
    pass
