"""The service connection: the proxy's own login, where rewritten queries run.

Gated sessions (roles in an anonymized mode) borrow service connections to
the same database from their worker's pool (service_pool.py). A service
connection logs in as the service role, which may read the protected
tables; the client's own role may not. The session is read-only. It goes
in TLS as the upstream setting asks (upstream.py); a server that fails that
setting is told to the client as a refusal (08006, the reason).

When the server refuses the login (53300 too many clients, 57P03 starting
up, 28P01…) or ends the connection with a FATAL error, its SQLSTATE and
message are kept (:class:`ServerRefusal`), so the client is told the real
reason rather than a generic one of the proxy's.

Flow control is the borrowing session's: it pauses reading while its client
does not read, and hears through ``on_full`` when the server stops taking
what is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ServiceLogin
from ..wire import protocol as pg
from ..wire.auth import AuthenticationFailed, PasswordAuthenticator
from ..wire.framing import MessageBuffer
from .cancel import UpstreamKey
from .followed_settings import FOLLOWED_SETTINGS
from .service_statements import ServiceStatements
from .upstream import open_upstream
from .upstream_tls import UpstreamTLSError

log = logging.getLogger("anonproxy.service")


@dataclass(frozen=True)
class ServerRefusal:
    """An ErrorResponse of the server's, to pass on to the client."""

    sqlstate: str
    message: str
    detail: str | None = None
    hint: str | None = None

    @classmethod
    def parse(cls, body: bytes) -> ServerRefusal:
        fields = pg.parse_fields(body)
        return cls(fields.get("C") or "08006", fields.get("M") or "the server refused the service connection",
                   fields.get("D"), fields.get("H"))


class _Refused(Exception):
    def __init__(self, refusal: ServerRefusal) -> None:
        super().__init__(f"{refusal.message} (SQLSTATE {refusal.sqlstate})")
        self.refusal = refusal


class ServiceUnavailable(Exception):
    def __init__(self, reason: str, refusal: ServerRefusal | None = None) -> None:
        super().__init__(reason)
        self.refusal = refusal  # the server's own reason, when it gave one


class ServiceConnection(asyncio.Protocol):
    """After login, every message the server sends goes to ``on_message``."""

    def __init__(self, login: ServiceLogin, on_message: Callable[[bytes, bytes], None],
                 on_lost: Callable[[], None]) -> None:
        self._login = login
        # Where the server's messages and the loss go: the pool swaps them as sessions borrow the connection.
        self.on_message = on_message
        self.on_lost = on_lost
        # Told True when the server stops taking what is sent (the write buffer passed its high-water mark: it is
        # busy sending an answer nobody reads), False once it takes it again; None: nobody listens.
        self.on_full: Callable[[bool], None] | None = None
        self._lost = False
        self._messages = MessageBuffer()
        self._auth = PasswordAuthenticator(login.user, login.password)
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.key: UpstreamKey | None = None
        self.fatal: ServerRefusal | None = None  # the FATAL error the server ended the connection with
        self.statements = ServiceStatements()  # the named statements on it, kept from one borrowing session to the next

    @classmethod
    async def open(cls, login: ServiceLogin, client_parameters: dict[str, str],
                   on_message: Callable[[bytes, bytes], None], on_lost: Callable[[], None]) -> ServiceConnection:
        parameters = {name: value for name, value in client_parameters.items() if name in FOLLOWED_SETTINGS}
        # Read-only, and every table in rewritten SQL is schema-qualified: nothing depends on search_path. No JIT:
        # the planner's estimates of the generated CTEs (joins of cells with steps) overshoot jit_above_cost by far,
        # and compiling them took seconds for statements that run in a tenth of that.
        parameters.update(user=login.user, database=login.database, application_name="anonproxy service",
                          options="-c default_transaction_read_only=on -c search_path=pg_catalog -c jit=off")
        try:
            _, service = await open_upstream(login.address, lambda: cls(login, on_message, on_lost))
            service.transport.write(pg.startup_message(parameters))
            await asyncio.wait_for(service._ready, 10)
        except _Refused as exc:
            raise ServiceUnavailable(str(exc), exc.refusal) from exc
        except UpstreamTLSError as exc:  # the client is told why, as if the server had refused
            raise ServiceUnavailable(str(exc), ServerRefusal("08006", str(exc), hint=exc.hint)) from exc
        except (OSError, TimeoutError, AuthenticationFailed, pg.ProtocolViolation) as exc:
            raise ServiceUnavailable(str(exc) or type(exc).__name__) from exc
        return service

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for type_, body in self._messages.feed(data):
                if not self._ready.done():
                    self._login_message(type_, body)
                elif type_ == b"E" and pg.parse_fields(body).get("V") in ("FATAL", "PANIC"):
                    self.fatal = ServerRefusal.parse(body)  # the server hangs up next: told with the loss
                else:
                    self.on_message(type_, body)
        except (AuthenticationFailed, pg.ProtocolViolation, _Refused) as exc:
            self._give_up(exc)

    def _login_message(self, type_: bytes, body: bytes) -> None:
        if type_ == b"R":
            self.transport.write(self._auth.respond(body))
        elif type_ == b"K":
            process_id, secret_key = pg.parse_backend_key_data(body)
            self.key = UpstreamKey(self._login.address, process_id, secret_key)
        elif type_ == b"E":
            raise _Refused(ServerRefusal.parse(body))
        elif type_ == b"Z":
            if not self._auth.done:
                raise AuthenticationFailed("the server did not authenticate the service role")
            self._ready.set_result(None)

    def _give_up(self, exc: Exception) -> None:
        if not self._ready.done():
            self._ready.set_exception(exc)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._ready.done():
            self._ready.set_exception(ConnectionError("the server closed the service connection during login"))
        elif not self._ready.cancelled() and self._ready.exception() is None:
            self.on_lost()  # (a login that failed is reported by ``open``, not as a loss)

    def pause_writing(self) -> None:
        if self.on_full is not None:
            self.on_full(True)

    def resume_writing(self) -> None:
        if self.on_full is not None:
            self.on_full(False)

    @property
    def closed(self) -> bool:
        return self._lost or self.transport is None or self.transport.is_closing()

    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(pg.message(b"X"))
            self.transport.close()


async def login_refusal(login: ServiceLogin) -> ServerRefusal | None:
    """Why the server refuses the service role's login now (None: it accepts it, or gave no reason).

    libpq reports a refused login as text only; this login of our own reads the server's SQLSTATE.
    """
    try:
        service = await ServiceConnection.open(login, {}, lambda type_, body: None, lambda: None)
    except ServiceUnavailable as exc:
        return exc.refusal
    service.close()
    return None
