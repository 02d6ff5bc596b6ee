"""The service connection: the proxy's own login, where rewritten queries run.

A gated session (a role in an anonymized mode) gets one service connection
to the same database. It logs in as the service role, which may read the
protected tables; the client's own role may not. The session is read-only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..config import ServiceLogin
from ..wire import protocol as pg
from ..wire.auth import AuthenticationFailed, PasswordAuthenticator
from ..wire.framing import MessageBuffer
from .cancel import UpstreamKey
from .upstream import open_upstream

log = logging.getLogger("anonproxy.service")

# Client settings copied into the service session, so values print the same way.
COPIED_PARAMETERS = ("client_encoding", "DateStyle", "TimeZone", "IntervalStyle", "extra_float_digits")


class ServiceUnavailable(Exception):
    pass


class ServiceConnection(asyncio.Protocol):
    """After login, every message the server sends goes to ``on_message``."""

    def __init__(self, login: ServiceLogin, on_message: Callable[[bytes, bytes], None],
                 on_lost: Callable[[], None]) -> None:
        self._login = login
        self._on_message = on_message
        self._on_lost = on_lost
        self._messages = MessageBuffer()
        self._auth = PasswordAuthenticator(login.user, login.password)
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.key: UpstreamKey | None = None

    @classmethod
    async def open(cls, login: ServiceLogin, client_parameters: dict[str, str],
                   on_message: Callable[[bytes, bytes], None], on_lost: Callable[[], None]) -> ServiceConnection:
        parameters = {name: value for name, value in client_parameters.items() if name in COPIED_PARAMETERS}
        # Read-only, and every table in rewritten SQL is schema-qualified: nothing depends on search_path.
        parameters.update(user=login.user, database=login.database, application_name="anonproxy service",
                          options="-c default_transaction_read_only=on -c search_path=pg_catalog")
        try:
            _, service = await open_upstream(login.address, lambda: cls(login, on_message, on_lost))
            service.transport.write(pg.startup_message(parameters))  # type: ignore[attr-defined]
            await asyncio.wait_for(service._ready, 10)  # type: ignore[attr-defined]
        except (OSError, TimeoutError, AuthenticationFailed, pg.ProtocolViolation) as exc:
            raise ServiceUnavailable(str(exc) or type(exc).__name__) from exc
        return service  # type: ignore[return-value]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for type_, body in self._messages.feed(data):
                if self._ready.done():
                    self._on_message(type_, body)
                else:
                    self._login_message(type_, body)
        except (AuthenticationFailed, pg.ProtocolViolation) as exc:
            self._give_up(exc)

    def _login_message(self, type_: bytes, body: bytes) -> None:
        if type_ == b"R":
            self.transport.write(self._auth.respond(body))
        elif type_ == b"K":
            process_id, secret_key = pg.parse_backend_key_data(body)
            self.key = UpstreamKey(self._login.address, process_id, secret_key)
        elif type_ == b"E":
            fields = pg.parse_fields(body)
            raise AuthenticationFailed(f"{fields.get('M', 'login refused')} (SQLSTATE {fields.get('C')})")
        elif type_ == b"Z":
            if not self._auth.done:
                raise AuthenticationFailed("the server did not authenticate the service role")
            self._ready.set_result(None)

    def _give_up(self, exc: Exception) -> None:
        if not self._ready.done():
            self._ready.set_exception(exc)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ready.done():
            self._ready.set_exception(ConnectionError("the server closed the service connection during login"))
        else:
            self._on_lost()

    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(pg.message(b"X"))
            self.transport.close()
