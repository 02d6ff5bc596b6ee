"""One client session: a client connection paired with its upstream connection.

Life of a session:

1. STARTUP  the proxy reads untyped packets itself: SSLRequest (TLS or 'N'),
            GSSENCRequest ('N'), CancelRequest, StartupMessage.
2. AUTH     the StartupMessage goes upstream byte for byte (inside TLS when the
            upstream setting asks for it: upstream.py) and the proxy relays
            the authentication exchange the server asks for (SCRAM, md5,
            trust...). It reads the server's messages only to swap the
            secret key of the upstream BackendKeyData for one of its own
            (the process id stays the backend's: see cancel.py), and to
            take SCRAM-SHA-256-PLUS out of the mechanisms offered (its
            channel binding cannot span two connections: upstream_tls.py).
3. RELAY    after the first ReadyForQuery, bytes flow both ways untouched; the
            server-to-client stream is followed for message boundaries only.
   GATED    instead of RELAY when the policy puts the role in an anonymized
            mode: every message goes through the session's Gate (gate.py),
            with service connections borrowed from the worker's pool
            (service_pool.py) for rewritten queries; what the gate sends
            the client goes out in batches (output.py).

Errors the proxy raises itself reach the client as ErrorResponse; nothing
else (no traceback) ever does.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from ..config import IPNetwork, ProxyConfig, ServiceLogin, UpstreamAddress
from ..logs import RateLimitedLog
from ..plan.refusals import Refusal, Reject
from ..policy.model import Policy, RolePolicy
from ..route import reports
from ..route.commands import login_setting
from ..route.decide import decide
from ..route.decision import (
    AtBind,
    Decision,
    DeclareCursor,
    ExplainDP,
    Intercept,
    Noisy,
    Pass,
    Script,
    SessionSetting,
)
from ..wire import protocol as pg
from ..wire.framing import (
    BoundaryTracker,
    MessageBuffer,
    Piece,
    RelayingMessageBuffer,
    Rows,
)
from ..wire.proxy_header import may_be_proxy_header, read_proxy_header
from .analysis import Analyser, AnalysisFailed, AnalysisTimeout
from .audit_trail import (
    UNAVAILABLE,
    AuditRecord,
    AuditTrail,
    Spent,
    TrailUnavailable,
    Who,
    answered_record,
    execution_record,
    session_id,
)
from .cache import BoundedCache
from .cancel import (
    CancelRegistry,
    ClientKey,
    UpstreamKey,
    cancel_then_hang_up,
    send_cancel,
)
from .followed_settings import REPORTED_SETTINGS, follow_settings
from .gate import Execution, Gate, Owner, ProxyRequest, Reply
from .limits import MemoryLimits
from .login_options import LoginOptionError, LoginSetting, login_settings
from .noisy import NoisyAnswers, Refused, SessionLimits, Stop
from .output import ClientOutput
from .policy_watch import PolicyWatcher
from .servers import Servers
from .service import ServiceConnection, ServiceUnavailable
from .service_pool import PoolBusy, ServicePool
from .upstream import open_upstream
from .upstream_tls import UpstreamTLSError, without_channel_binding

log = logging.getLogger("anonproxy.session")

_session_ids = count(1)
TERMINATE = pg.message(b"X")
# A gated session's server messages longer than this (big rows) go to the client piece by piece, never held whole.
RELAYED_MESSAGE_SIZE = 64 * 1024
DECISION_CACHE_BYTES = 32 * 1024 * 1024  # statement texts and their rewrites, per worker


@dataclass
class ProxyContext:
    """What every session of one worker shares."""

    upstream: UpstreamAddress
    cancel_keys: CancelRegistry
    tls: ssl.SSLContext | None = None
    startup_timeout: float = 60.0
    trusted_proxies: tuple[IPNetwork, ...] = ()  # balancers whose PROXY protocol header names the client
    peer_addresses: tuple[IPNetwork, ...] = ()  # the other proxies, whose cancel requests are not passed on again
    policy: PolicyWatcher | None = None  # None: no service login configured, every role is direct
    service_login: ServiceLogin | None = None
    service_pool: ServicePool | None = None  # where gated sessions borrow service connections
    # Seconds a gated session's open batch may keep its borrowed service connection waiting for the client: at all,
    # and while another session waits for a connection.
    service_hold_timeout: float = ProxyConfig.service_hold_timeout
    service_yield_timeout: float = ProxyConfig.service_yield_timeout
    noisy: NoisyAnswers | None = None  # answers for roles in dp mode
    audit: AuditTrail | None = None  # None: the audit trail is off
    analyser: Analyser | None = None  # statement analysis off the event loop (None: on it)
    max_statement_size: int = ProxyConfig.max_statement_size  # of a gated session's Query or Parse, in bytes
    limits: MemoryLimits = field(default_factory=MemoryLimits)  # what a gated session may keep (cursors, statements)
    servers: Servers | None = None  # the primary and the standbys, when there are several servers
    sessions: set[ClientConnection] = field(default_factory=set)
    # Malformed startup packets and framing violations: one line each, but a client cannot flood the log.
    violations: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    _tasks: set[asyncio.Future[None]] = field(default_factory=set)
    _decisions: BoundedCache[tuple[str, str, int], Decision] = field(
        default_factory=lambda: BoundedCache(DECISION_CACHE_BYTES))

    def cached_decision(self, sql: str, role: RolePolicy, policy: Policy) -> Decision | None:
        """The decision already made on this text, for this role, under this policy version."""
        return self._decisions.get((sql, role.role, policy.version))

    async def decide(self, sql: str, role: RolePolicy, policy: Policy, *, asker: int) -> Decision:
        """The gate's decision for a statement text, cached by text, role and policy version; ``asker``: the
        session's id, whose turn an analysis takes. A dp role's measurement is priced in the same analysis call."""
        key = (sql, role.role, policy.version)
        decision = self._decisions.get(key)
        if decision is not None:
            return decision
        function: Callable[..., Any] = decide
        args: tuple[Any, ...] = (sql, role, policy)
        noisy = self.noisy if role.mode == "dp" else None
        if noisy is not None:  # what a dp statement measures is priced in the same analysis call
            function, args = noisy.deciding(decide, sql, role, policy)
        if self.analyser is None:
            outcome = function(*args)
        else:
            try:
                outcome = await self.analyser.run(function, *args, asker=asker, shared=(policy,))
            except AnalysisTimeout:  # cached: the same text is not analysed again
                outcome, noisy = too_complex(self.analyser.budget), None
            except AnalysisFailed as exc:
                log.error("statement analysis failed: %s", exc)
                return Reject("XX000", "internal error in anonproxy while analysing the statement")
        decision = noisy.decided(sql, role, policy, outcome) if noisy is not None else outcome
        self._decisions.put(key, decision, len(sql) + _weight(decision))
        return decision

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a background task, holding a reference so it is not collected mid-way."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _written_anyway(audit: AuditTrail, record: AuditRecord) -> None:
    """Write a row nobody waits for (its session is ending); a failure is the writer's to log."""
    with contextlib.suppress(TrailUnavailable):
        await audit.write(record)


def too_complex(budget: float) -> Reject:
    return Reject("54001", f"statement too complex: anonproxy stopped analysing it after {budget:g} s",
                  "Simplify the statement (a long list of values is the usual cause); the limit is the proxy's "
                  "analysis_timeout setting.")


def _weight(decision: Decision) -> int:
    """About the bytes a decision holds beyond its key: its texts (a cursor's query's, a Script's parts') and a dp
    statement's packed measurement."""
    if isinstance(decision, Script):
        return sum(len(text) + _weight(part) for text, part in decision.parts)
    if isinstance(decision, DeclareCursor):
        return len(decision.name) + _weight(decision.query)
    if isinstance(decision, AtBind):
        return len(decision.sql) + len(decision.representative) + _weight(decision.described)
    packed = decision.plan.size if isinstance(decision, (Noisy, ExplainDP)) and decision.plan is not None else 0
    return packed + sum(len(getattr(decision, name, None) or "") for name in ("sql", "reported", "message", "hint")) \
        + sum(len(line) for line in getattr(decision, "lines", ()))


class State(enum.Enum):
    STARTUP = enum.auto()
    CONNECTING = enum.auto()
    AUTH = enum.auto()
    RELAY = enum.auto()
    GATED = enum.auto()
    CLOSED = enum.auto()


# The relay's test of the state on every read: a module constant, as an Enum member's lookup goes through
# EnumType.__getattr__ in Python 3.11 (about 5 % of a relaying worker's user-space instructions).
_RELAY = State.RELAY


class ClientConnection(asyncio.Protocol):
    def __init__(self, context: ProxyContext) -> None:
        self.context = context
        self.id = next(_session_ids)
        self.state = State.STARTUP
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None
        self._startup_buffer = bytearray()
        self._header_expected = True  # a PROXY protocol header may come first, before any startup packet
        self._client_address: tuple[str, int] | None = None  # the client a trusted balancer's header named
        self._pending: list[bytes] = []  # client bytes that arrive while connecting upstream
        self._tls_active = False
        self._startup_timer: asyncio.TimerHandle | None = None
        self._key: ClientKey | None = None  # what the client's BackendKeyData said
        self._startup: pg.StartupMessage | None = None
        self.server_parameters: dict[str, str] = {}  # ParameterStatus at login
        self.gate: Gate | None = None
        self._output: ClientOutput | None = None  # what the gate writes to the client, in batches
        self.service: ServiceConnection | None = None  # borrowed from the pool while the gate needs it
        self._borrowing: asyncio.Task[None] | None = None
        self._question: Stop | None = None  # the dp question being answered: a cancel of the client's stops it
        # service_hold_timeout and service_yield_timeout, while an open batch keeps the service connection idle
        self._hold_timers: list[asyncio.TimerHandle] = []
        # service_hold_timeout while the client reads nothing of an answer on the service connection it holds
        self._unread_timer: asyncio.TimerHandle | None = None
        self._unread_holder = object()  # this session in the pool's list of holders it may ask to give up
        # Whether the client sent something the server has not yet answered with
        # ReadyForQuery: approximate under pipelining, used only to cancel abandoned queries.
        self.awaiting_server = False
        self.terminating = False  # the client sent Terminate: the server will hang up
        self.dp_limits = SessionLimits(asker=self.id)  # SET anonproxy.epsilon / anonproxy.delta
        self._who: Who | None = None  # who the audit trail says asked (gated sessions)
        self._client_full = False  # the client's write buffer is above its high-water mark (pause_writing)
        self._service_backlog = False  # the service connection's write buffer is (its on_full)

    # -- asyncio.Protocol -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.context.sessions.add(self)
        loop = asyncio.get_running_loop()
        self._startup_timer = loop.call_later(self.context.startup_timeout, self._startup_timed_out)

    def data_received(self, data: bytes) -> None:
        try:
            if self.state is _RELAY:
                self.upstream.transport.write(data)  # type: ignore[union-attr]
                if data.endswith(TERMINATE):
                    self.terminating = True
                else:
                    self.awaiting_server = True
            elif self.state is State.GATED:
                self.terminating = data.endswith(TERMINATE)
                self.gate.client_data(data)  # type: ignore[union-attr]
            elif self.state is State.AUTH:
                self.upstream.transport.write(data)  # type: ignore[union-attr]
            elif self.state is State.STARTUP:
                self._startup_received(data)
            elif self.state is State.CONNECTING:
                # Held until the next state; read no more meanwhile, so that this stays one read's worth.
                self._pending.append(data)
                self.transport.pause_reading()  # type: ignore[union-attr]
        except pg.ProtocolViolation as exc:
            self.protocol_violation(exc)
        except Exception:
            log.exception("session %d: internal error", self.id)
            self.fail("XX000", "internal error in anonproxy; the connection is closed")

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost tidies up

    def connection_lost(self, exc: Exception | None) -> None:
        previous = self.state
        self.state = State.CLOSED
        self.context.sessions.discard(self)
        self._cancel_startup_timer()
        self._time_hold(False)
        self._watch_unread()  # (closed: stops watching)
        if previous is State.STARTUP and self._startup_buffer:
            # As PostgreSQL: a connection closed before any byte is normal (a port probe); a partial packet is not.
            self.context.violations.warning("session %d: incomplete startup packet from %s (%d bytes)", self.id,
                                            self._peer(), len(self._startup_buffer))
        if self._key is not None:
            self.context.cancel_keys.unregister(self._key)
        upstream, service, gate = self.upstream, self.service, self.gate
        if self._borrowing is not None:
            self._borrowing.cancel()
        if gate is not None:
            self.awaiting_server = gate.in_flight[Owner.UPSTREAM] > 0
            if service is not None and gate.in_flight[Owner.SERVICE] and service.key is not None:
                self.context.spawn(send_cancel(service.key))
        if self._question is not None:  # no one will read its answer
            self.context.spawn(self._question.cancel())
        if service is not None:
            # Mid-statement or mid-batch (else it would have been handed back): its state is unknown.
            self.service = None
            self._service_pool().discard(service)
        if upstream is not None and not upstream.closed:
            if previous in (State.RELAY, State.GATED) and self.awaiting_server and upstream.key is not None:
                # The client vanished mid-query: stop the query instead of letting it run on.
                log.info("session %d: client gone during a query, cancelling it", self.id)
                self.context.spawn(send_cancel(upstream.key))
            upstream.transport.close()

    def pause_writing(self) -> None:
        self._client_full = True
        self._follow_client()

    def resume_writing(self) -> None:
        self._client_full = False
        self._follow_client()

    def _follow_client(self) -> None:
        """Backpressure: while the client does not read what it was sent, read nothing more for it from the server
        side (its own connection, and the service connection it holds); go on once it has read."""
        transports = [self.upstream.transport] if self.upstream is not None and not self.upstream.closed else []
        if self.service is not None and not self.service.closed:
            transports.append(self.service.transport)
        for transport in transports:
            if self._client_full:
                transport.pause_reading()
            else:
                transport.resume_reading()
        self._watch_unread()

    def _watch_unread(self) -> None:
        """A client that reads nothing of its answer keeps the service connection the answer comes from: after
        service_hold_timeout without progress, it gives it up as soon as another statement waits for one."""
        unread = self._client_full and self.service is not None and self.state is State.GATED
        if unread and self._unread_timer is None:
            self._unread_timer = asyncio.get_running_loop().call_later(self.context.service_hold_timeout,
                                                                       self._unread_too_long)
        elif not unread:
            if self._unread_timer is not None:
                self._unread_timer.cancel()
                self._unread_timer = None
            if self.context.service_pool is not None:
                self.context.service_pool.holding_busy(self._unread_holder)

    def _unread_too_long(self) -> None:
        self._unread_timer = None
        if self._client_full and self.service is not None and self.context.service_pool is not None:
            self.context.service_pool.holding_idle(self._unread_holder, self._give_up_unread)

    def _give_up_unread(self) -> None:
        """Another statement waits for the connection this session's unread answer keeps: end the session (its
        protocol state mid-answer cannot be kept), and the connection, whose state is unknown, with it."""
        service = self.service
        if not (self._client_full and service is not None and self.state is State.GATED):
            return
        limit = self.context.service_hold_timeout
        log.info("session %d: its client read nothing of its answer for service_hold_timeout (%g s) while another "
                 "statement waited for a service connection; ending the session", self.id, limit)
        self.service = None
        if service.key is not None and self._key is not None:
            self.context.cancel_keys.remove(self._key, service.key)
        self._service_pool().discard(service)
        self.fail("57014", "terminating connection: the client read nothing of its answer for more than "
                           f"service_hold_timeout ({limit:g} s) while other statements waited for a service "
                           "connection of anonproxy",
                  hint="Read answers as they arrive. The limit is the proxy's service_hold_timeout setting.")

    # -- startup phase ----------------------------------------------------

    def _startup_received(self, data: bytes) -> None:
        self._startup_buffer += data
        try:
            if self._header_expected and not self._proxy_header_read():
                return
            while self.state is State.STARTUP:
                packet, size = pg.read_startup_packet(self._startup_buffer)
                if packet is None:
                    return
                raw = bytes(self._startup_buffer[:size])
                del self._startup_buffer[:size]
                self._handle_startup_packet(packet, raw)
        except pg.ProtocolViolation as exc:
            self._startup_buffer.clear()  # reported here, not again as incomplete when the connection closes
            self.protocol_violation(exc)

    def _proxy_header_read(self) -> bool:
        """Read the PROXY protocol header a trusted balancer sends first, if the connection begins with one; False
        while more of it is needed. Raises ProtocolViolation for a header from an untrusted peer: anyone else could
        name any address, and the audit trail would believe it."""
        if not may_be_proxy_header(self._startup_buffer):
            self._header_expected = False
            return True
        if not self._peer_within(self.context.trusted_proxies):
            raise pg.ProtocolViolation("PROXY protocol header from an address not in trusted_proxies", silent=True)
        header, size = read_proxy_header(self._startup_buffer)
        if header is None:
            return False
        del self._startup_buffer[:size]
        self._header_expected = False
        if header.source is not None:
            log.debug("session %d: client %s:%d, through the balancer %s", self.id, *header.source, self._peer())
            self._client_address = header.source
        return True

    def _peer_within(self, networks: tuple[IPNetwork, ...]) -> bool:
        """Whether the connection comes from one of ``networks`` (its own peer, whatever a header says)."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        if not isinstance(peer, tuple) or not networks:
            return False
        try:
            address = ipaddress.ip_address(peer[0])
        except ValueError:  # e.g. an IPv6 address with a zone
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in networks)

    def _client_endpoint(self) -> tuple[str, int] | None:
        """The client's address and port: as a trusted balancer named them, else the connection's peer."""
        if self._client_address is not None:
            return self._client_address
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return (peer[0], peer[1]) if isinstance(peer, tuple) else None

    def protocol_violation(self, exc: pg.ProtocolViolation) -> None:
        """Log one line (rate-limited), then answer as PostgreSQL would: an error, or a silent hang-up."""
        self.context.violations.warning("session %d: protocol violation from %s: %s", self.id, self._peer(), exc)
        if self.state is State.GATED and self.context.audit is not None and self._who is not None:
            # The session ends: its row is written after it, as a refusal of what could not be read.
            record = execution_record(self._who, self._current()[1].mode, Execution(
                "(not read: the message broke the protocol)", Reject(exc.sqlstate, str(exc))))
            self.context.spawn(_written_anyway(self.context.audit, record))
        if not exc.silent:
            self.fail(exc.sqlstate, str(exc))
        elif self.transport is not None:
            self.state = State.CLOSED
            self.close()

    def _peer(self) -> str:
        peer = self._client_endpoint()
        return f"{peer[0]}:{peer[1]}" if peer is not None else "a local socket"

    def _handle_startup_packet(self, packet: pg.StartupPacket, raw: bytes) -> None:
        assert self.transport is not None
        if isinstance(packet, pg.SSLRequest):
            if self._startup_buffer:
                # Bytes sent after SSLRequest before the handshake would bypass TLS (CVE-2021-23214).
                raise pg.ProtocolViolation("received unencrypted data after SSL request")
            if self.context.tls is None or self._tls_active:
                self.transport.write(b"N")
            else:
                self.transport.write(b"S")
                self.transport.pause_reading()
                self.context.spawn(self._start_tls())
                self.state = State.CONNECTING  # nothing may be read until the handshake is done
        elif isinstance(packet, pg.GSSENCRequest):
            self.transport.write(b"N")
        elif isinstance(packet, pg.CancelRequest):
            self.state = State.CLOSED
            self.transport.pause_reading()
            self.context.spawn(cancel_then_hang_up(self.context.cancel_keys, packet.process_id, packet.secret_key,
                                                   self.transport,
                                                   from_peer=self._peer_within(self.context.peer_addresses)))
        else:
            self._startup = packet
            self.state = State.CONNECTING
            self._pending.append(raw)
            self._pending.append(bytes(self._startup_buffer))
            self._startup_buffer.clear()
            self.context.spawn(self._connect_upstream(packet))

    async def _start_tls(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.transport is not None and self.context.tls is not None
        try:
            transport = await loop.start_tls(self.transport, self, self.context.tls, server_side=True)
        except (OSError, ssl.SSLError, ConnectionError, TimeoutError) as exc:
            log.info("session %d: TLS handshake failed: %s", self.id, exc)
            self.transport.abort()
            return
        if transport is None or self.state is State.CLOSED:
            return
        self.transport = transport  # type: ignore[assignment]
        self._tls_active = True
        self.state = State.STARTUP

    async def _connect_upstream(self, startup: pg.StartupMessage) -> None:
        servers = self.context.servers
        address = self.context.upstream if servers is None else servers.primary
        try:
            try:
                _, upstream = await open_upstream(address, lambda: UpstreamConnection(self))
            except UpstreamTLSError:
                raise  # the server is there: its TLS is what fails
            except (OSError, TimeoutError):
                if servers is None:
                    raise
                servers.failed(address)  # the primary may have changed: once more, to the one a probe finds now
                address = await servers.find_primary()
                _, upstream = await open_upstream(address, lambda: UpstreamConnection(self))
        except UpstreamTLSError as exc:  # (logged once by upstream_tls, not for every client)
            self.fail("08006", str(exc), hint=exc.hint)
            return
        except (OSError, TimeoutError) as exc:
            log.warning("session %d: cannot connect to upstream %s: %s", self.id, address, exc)
            self.fail("08006", "anonproxy cannot reach the PostgreSQL server",
                      hint="The server may be down or restarting; try again shortly.")
            return
        if self.state is State.CLOSED:
            upstream.transport.close()  # type: ignore[attr-defined]
            return
        self.upstream = upstream  # type: ignore[assignment]
        self.state = State.AUTH
        log.debug("session %d: user %r database %r connected upstream", self.id, startup.user, startup.database)
        self.upstream.transport.writelines(self._pending)  # type: ignore[union-attr]
        self._pending.clear()
        self.transport.resume_reading()  # type: ignore[union-attr]

    def _startup_timed_out(self) -> None:
        if self.state in (State.STARTUP, State.CONNECTING, State.AUTH):
            log.info("session %d: startup not completed in %.0f s", self.id, self.context.startup_timeout)
            self.fail("08P01", "startup and authentication did not complete in time")

    def _cancel_startup_timer(self) -> None:
        if self._startup_timer is not None:
            self._startup_timer.cancel()
            self._startup_timer = None

    # -- called by the upstream side ---------------------------------------

    def authenticated(self, key: UpstreamKey) -> bytes:
        """The upstream sent BackendKeyData: return the client's (same process id, the proxy's secret)."""
        self._key = self.context.cancel_keys.register(key, self._cancel_question)
        return pg.backend_key_data(self._key.process_id, self._key.secret_key)

    def login_complete(self, ready: bytes) -> None:
        """The server accepted the login: relay, or gate the session as the policy says."""
        self._cancel_startup_timer()
        assert self._startup is not None and self.transport is not None
        watcher = self.context.policy
        if watcher is not None and not watcher.loaded:
            self.fail("57P03", "anonproxy has not loaded its privacy policy yet", hint="Try again shortly.")
            return
        policy = watcher.policy if watcher is not None else Policy()
        role = policy.role(self._startup.user)
        if role.mode == "direct":
            self.state = State.RELAY
            self.transport.write(ready)
            self.upstream.start_relay()  # type: ignore[union-attr]
            return
        if role.mode == "deny":
            self.fail("42501", f'role "{role.role}" may not connect through anonproxy',
                      hint="The privacy policy denies this role; ask the DBA.")
            return
        refusal = self.context.servers.dp_refusal() if role.mode == "dp" and self.context.servers else None
        if refusal is not None:  # the ledger could lose charges in a fail-over (docs/replicas.md)
            self.fail(refusal[0], refusal[1], hint=refusal[2])
            return
        # The gate reads statements as UTF-8 with standard strings, as the server must.
        if (self.server_parameters.get("client_encoding"), self.server_parameters.get("standard_conforming_strings")) \
                != ("UTF8", "on"):
            self.fail("0A000", f'role "{role.role}" is in {role.mode} mode and must use client_encoding UTF8 '
                               "with standard_conforming_strings on",
                      hint="Connect with client_encoding=UTF8.")
            return
        login = self.context.service_login
        if login is None or self._startup.database != login.database:
            self.fail("42501", f'role "{role.role}" is in {role.mode} mode and may only use the database '
                               f"the privacy policy governs ({login.database if login else 'none configured'})")
            return
        try:
            proxied = self._login_settings(role)
        except Refused as refused:
            self.fail(refused.sqlstate, str(refused), hint=refused.hint, detail=refused.detail)
            return
        if not proxied:
            self._open_gate(ready)
            return
        # The session's anonproxy.* settings are checked against its budget first: hold the client meanwhile.
        self.state = State.CONNECTING
        self.transport.pause_reading()
        self.context.spawn(self._apply_login_settings(role, proxied, ready))

    def _login_settings(self, role: RolePolicy) -> list[tuple[SessionSetting, LoginSetting]]:
        """The settings the client gave at login, each checked as the same SET after login would be (raises
        Refused, naming it); returns those the proxy applies itself (anonproxy.epsilon, anonproxy.delta)."""
        assert self._startup is not None
        try:
            settings = login_settings(self._startup.parameters)
        except LoginOptionError as exc:
            raise Refused("0A000", f"login option {exc} is not supported through anonproxy for roles in {role.mode} "
                          "mode", "Give settings as -c name=value (or --name=value) in options.") from None
        proxied = []
        for setting in settings:
            try:
                decision = login_setting(setting.name, setting.value, role.mode)
            except Refusal as refusal:
                reject = refusal.reject
                raise Refused(reject.sqlstate, reject.message, reject.hint,
                              f"The setting was given at login ({setting.given}).") from None
            if decision is not None:
                proxied.append((decision, setting))
        return proxied

    async def _apply_login_settings(self, role: RolePolicy, proxied: list[tuple[SessionSetting, LoginSetting]],
                                    ready: bytes) -> None:
        """Apply the session's anonproxy.* settings given at login as SET would, then open the gate; or refuse the
        login with the reason, never ignoring a setting."""
        noisy = self.context.noisy
        try:
            if noisy is None:
                raise Refused("0A000", "differential-privacy mode needs the proxy's service login")
            for decision, setting in proxied:
                try:
                    await noisy.set(decision, role.role, self.dp_limits, at_login=True)
                except Refused as refused:
                    raise Refused(refused.sqlstate, str(refused), refused.hint,
                                  f"The setting was given at login ({setting.given}).") from None
        except Refused as refused:
            self.fail(refused.sqlstate, str(refused), hint=refused.hint, detail=refused.detail)
            return
        except Exception:
            log.exception("session %d: internal error while applying login settings", self.id)
            self.fail("XX000", "internal error in anonproxy; the connection is closed")
            return
        if self.state is State.CONNECTING and self.transport is not None:
            self._open_gate(ready)

    def _open_gate(self, ready: bytes) -> None:
        assert self._startup is not None and self.upstream is not None and self.transport is not None
        self._who = Who(self._startup.user, self._startup.database, session_id(self.id),
                        *(self._client_endpoint() or ()))
        output = self._output = ClientOutput(self.transport)
        gate = Gate(
            decide=self._decide,
            settings=self._settings,
            write_client=output.write,
            send_upstream=self.upstream.transport.write,
            send_service=lambda data: self.service.send(data),  # type: ignore[union-attr]
            ask_proxy=lambda request: self.context.spawn(self._answer_for_gate(request)),
            version=lambda: self._current()[0].version,
            time_limit=self._time_limit,
            max_statement_size=self.context.max_statement_size,
            pause_client=self._pause_reading,
            acquire_service=self._acquire_service,
            release_service=self._release_service,
            reset_session=self.dp_limits.reset,
            service_settings=self._output_settings(),
            record=self._record if self.context.audit is not None else None,
            hold_timer=self._time_hold,
            limits=self.context.limits,
        )
        self.gate = gate
        self.state = State.GATED
        self.transport.write(ready)
        self.upstream.open_gate(gate)
        pending, self._pending = b"".join(self._pending), []
        self.transport.resume_reading()  # (before: the gate may pause it again)
        gate.client_data(pending)

    def _output_settings(self) -> dict[str, str]:
        """The settings that shape how values print, as the session starts: applied on every service connection
        it borrows (the gate follows later changes the server reports, and reads the others itself)."""
        return {name: self.server_parameters[name] for name in REPORTED_SETTINGS if name in self.server_parameters}

    def _service_pool(self) -> ServicePool:
        assert self.context.service_pool is not None  # a gated session has a service login, hence a pool
        return self.context.service_pool

    def _acquire_service(self) -> None:
        """The gate needs a service connection: borrow one (the gate hears when it is there)."""
        self._borrowing = asyncio.ensure_future(self._borrow())

    async def _borrow(self) -> None:
        pool = self._service_pool()
        try:
            service = await pool.acquire()
        except ServiceUnavailable as exc:
            log.error("session %d: cannot open a service connection: %s", self.id, exc)
            if exc.refusal is not None:  # the server's own reason (53300 too many clients, 57P03...)
                error = pg.error_response(exc.refusal.sqlstate, exc.refusal.message, hint=exc.refusal.hint,
                                          detail="PostgreSQL refused the service connection anonproxy opens for "
                                                 "rewritten statements.")
            else:
                error = pg.error_response("08006", "anonproxy cannot open its service connection to the "
                                                   "PostgreSQL server",
                                          hint="Check the service role's login in the proxy's service_dsn setting.")
            if self.state is State.GATED and self.gate is not None:
                self.gate.service_refused(error)
            return
        except PoolBusy:
            pool_size, waited = pool.size, pool.wait_timeout
            log.warning("session %d: no service connection was free within service_wait_timeout (%g s)", self.id,
                        waited)
            if self.state is State.GATED and self.gate is not None:
                self.gate.service_refused(pg.error_response(
                    "53300", f"all {pool_size} service connections of this anonproxy worker stayed in use for "
                             f"service_wait_timeout ({waited:g} s): the statement did not run",
                    hint="Retry the statement. The limits are the proxy's service_pool_size and "
                         "service_wait_timeout settings."))
            return
        except Exception:
            log.exception("session %d: internal error while borrowing a service connection", self.id)
            self.fail("XX000", "internal error in anonproxy; the connection is closed")
            return
        finally:
            self._borrowing = None
        if self.state is not State.GATED or self.gate is None:
            pool.release(service)
            return
        service.on_message, service.on_lost, service.on_full = (self.gate.service_message, self._service_lost,
                                                                 self._service_full)
        self.service = service
        self._follow_client()  # paused at once if the client is not reading
        if service.key is not None and self._key is not None:
            self.context.cancel_keys.add(self._key, service.key)  # the client's cancel reaches it now
        self.gate.service_acquired(service.statements)

    def _service_full(self, full: bool) -> None:
        """Backpressure towards the client: while the service connection's server takes nothing more of what the
        gate sends it (it is busy sending an answer the client does not read), read nothing more from the client."""
        self._service_backlog = full
        self._pause_reading(full)

    def _release_service(self, clean: bool) -> None:
        """The gate is done with the service connection: back to the pool (closed if not left idle)."""
        service, self.service = self.service, None
        assert service is not None
        service.on_full = None
        self._watch_unread()
        if self._service_backlog:
            self._service_full(False)
        if service.key is not None and self._key is not None:
            self.context.cancel_keys.remove(self._key, service.key)
        if clean:
            service.transport.resume_reading()  # if the client's backpressure paused it: the next session reads it
            self._service_pool().release(service)
        else:
            self._service_pool().discard(service)

    def _time_hold(self, start: bool) -> None:
        """The gate's hold limits: started when an open batch keeps the borrowed connection waiting for the
        client (service_hold_timeout; past service_yield_timeout, the pool may reclaim it for a waiting session),
        stopped when it goes on."""
        for timer in self._hold_timers:
            timer.cancel()
        self._hold_timers.clear()
        if self.context.service_pool is not None:
            self.context.service_pool.holding_busy(self)
        if start:
            loop = asyncio.get_running_loop()
            self._hold_timers = [
                loop.call_later(self.context.service_hold_timeout, self._hold_expired),
                loop.call_later(self.context.service_yield_timeout, self._service_pool().holding_idle, self,
                                self._yield_service),
            ]

    def _hold_expired(self) -> None:
        self._end_hold("service_hold_timeout", self.context.service_hold_timeout, "", logging.INFO)

    def _yield_service(self) -> None:
        """The pool reclaims the connection: another session waits for one."""
        self._end_hold("service_yield_timeout", self.context.service_yield_timeout,
                       " while other statements waited for one", logging.DEBUG)  # (frequent under load)

    def _end_hold(self, setting: str, limit: float, why: str, level: int) -> None:
        """End the open batch that kept the service connection waiting for the client longer than ``setting``."""
        if self.state is not State.GATED or self.gate is None:
            return
        log.log(level, "session %d: a batch kept a service connection waiting without Sync for %s (%g s)%s; "
                       "ending it", self.id, setting, limit, why)
        error = pg.error_response(
            "57014", f"canceling the batch: it kept a service connection of anonproxy waiting without Sync for "
                     f"more than {setting} ({limit:g} s){why}",
            hint="End each batch with Sync soon after its last message; the rest of this batch, up to its Sync, "
                 f"is ignored. The limit is the proxy's {setting} setting.")
        try:
            self.gate.service_hold_expired(error)
        except Exception:
            log.exception("session %d: internal error while ending a batch that held a service connection", self.id)
            self.fail("XX000", "internal error in anonproxy; the connection is closed")

    def enforce(self, policy: Policy) -> None:
        """A new policy: end a relayed session whose role is no longer direct.

        (A gated session follows the new policy statement by statement.)
        """
        if self.state is not State.RELAY or self._startup is None:
            return
        mode = policy.role(self._startup.user).mode
        if mode == "direct":
            return
        log.info("session %d: role %r is now in %s mode; closing its direct session", self.id,
                 self._startup.user, mode)
        upstream = self.upstream
        if upstream is not None and upstream.tracker.at_boundary:
            self.fail("57P01", f"terminating connection: the privacy policy now puts role "
                               f'"{self._startup.user}" in {mode} mode', hint="Reconnect.")
        elif self.transport is not None:
            self.state = State.CLOSED
            self.transport.close()  # mid-message: no room for an ErrorResponse

    async def _answer_for_gate(self, request: ProxyRequest) -> None:
        """What the gate asked the proxy: a dp answer or description, EXPLAIN (ANONPROXY), a dp SHOW or SET."""
        policy, role = self._current()
        noisy, decision, limits = self.context.noisy, request.decision, self.dp_limits
        reply: Reply
        spent = Spent()  # for the audit trail
        explained = reports.explained(decision)  # made when the statement was decided: nothing runs
        try:
            if explained is not None:
                reply = explained
            elif noisy is None:
                raise Refused("0A000", "differential-privacy mode needs the proxy's service login")
            elif isinstance(decision, Intercept) and decision.setting == "budget":
                reply = await noisy.budget(role.role)
            elif isinstance(decision, Intercept):
                if role.mode != "dp":
                    raise Refused("0A000", f"anonproxy.{decision.setting} applies to roles in dp mode",
                                  f'Role "{role.role}" is in {role.mode} mode.')
                reply = await noisy.show(decision.setting, role.role, limits)
            elif isinstance(decision, SessionSetting):
                reply = await noisy.set(decision, role.role, limits)
            elif isinstance(decision, ExplainDP):
                reply = await noisy.explain(decision, role, policy, request.parameters, limits,
                                            dict(request.settings))
            elif request.describe:
                assert isinstance(decision, Noisy)
                reply = await noisy.describe(decision, role, policy, request.parameters, limits)
            else:
                assert isinstance(decision, Noisy)
                self._question = Stop(request.timeout_ms)
                reply = await noisy.answer(decision, role, policy, request.parameters, limits,
                                           self._question, spent, dict(request.settings))
                reply = follow_settings(reply, dict(request.settings))
        except Refused as refused:
            reply = refused.response
            spent.sqlstate, spent.message = refused.sqlstate, str(refused)
        except Exception:
            log.exception("session %d: internal error while answering in dp mode", self.id)
            spent.sqlstate, spent.message = "XX000", "internal error in anonproxy while answering the query"
            reply = pg.error_response(spent.sqlstate, spent.message)
        finally:
            self._question = None
        if self.context.audit is not None and self._who is not None and not request.describe:
            record = answered_record(self._who, role.mode, request.sql, decision, request.parameters, spent, reply)
            try:
                await self.context.audit.write(record)
            except TrailUnavailable:
                if spent.sqlstate is None:  # an answer: not sent unrecorded (a refusal goes as it is)
                    reply = pg.error_response(UNAVAILABLE.sqlstate, UNAVAILABLE.message, hint=UNAVAILABLE.hint)
        if self.state is State.GATED and self.gate is not None:
            self.gate.proxy_answered(reply)

    async def _cancel_question(self) -> None:
        """A CancelRequest with this session's key: stop the dp question being answered, if any."""
        if self._question is not None:
            log.info("session %d: cancel request: stopping its dp question", self.id)
            await self._question.cancel()

    def _current(self) -> tuple[Policy, RolePolicy]:
        """The policy in force now, and this session's role in it (it may change mid-session)."""
        assert self._startup is not None
        policy = self.context.policy.policy if self.context.policy is not None else Policy()
        return policy, policy.role(self._startup.user)

    def _decide(self, sql: str) -> Decision | None:
        """The decision on ``sql`` now, or None: it is being analysed, and the gate hears of it later."""
        policy, role = self._current()
        if role.mode == "direct":
            return Pass()
        if role.mode == "deny":
            return Reject("42501", f'the privacy policy now denies role "{role.role}"', "Reconnect later.")
        decision = self.context.cached_decision(sql, role, policy)
        if decision is None:
            self.context.spawn(self._analyse(sql, role, policy))
        return decision

    async def _analyse(self, sql: str, role: RolePolicy, policy: Policy) -> None:
        decision = await self.context.decide(sql, role, policy, asker=self.id)
        if self.state is State.GATED and self.gate is not None:
            self.gate.decided(sql, decision, policy.version)

    def _record(self, execution: Execution) -> None:
        """The gate's statement, to record in the audit trail before it goes on (``gate.recorded``)."""
        assert self.context.audit is not None and self._who is not None
        record = execution_record(self._who, self._current()[1].mode, execution)
        self.context.spawn(self._write_record(self.context.audit, record))

    async def _write_record(self, audit: AuditTrail, record: AuditRecord) -> None:
        try:
            await audit.write(record)
            refusal = None
        except TrailUnavailable:
            # What would run is refused; a refusal goes as it is (nothing leaves; the writer logs the lost row).
            refusal = None if record.decision == "refused" else UNAVAILABLE
        if self.state is State.GATED and self.gate is not None:
            self.gate.recorded(refusal)

    def _pause_reading(self, pause: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _time_limit(self) -> int:
        """The policy's maximum statement time for the role's mode, in ms."""
        policy, role = self._current()
        return policy.statement_limit(role.mode)

    def _settings(self) -> dict[str, str]:
        policy, role = self._current()
        return {"role": role.role, "mode": role.mode, "k": str(role.suppression.k),
                "policy_version": str(policy.version)}

    def _service_lost(self) -> None:
        service, self.service = self.service, None
        if service is not None:
            self._service_pool().discard(service)
        if self.state is State.CLOSED:
            return
        fatal = service.fatal if service is not None else None
        log.warning("session %d: the service connection was lost%s", self.id,
                    f": {fatal.message} (SQLSTATE {fatal.sqlstate})" if fatal else "")
        if fatal is not None:  # the server said why: pass it on
            self.fail(fatal.sqlstate, fatal.message, hint="Reconnect.",
                      detail="PostgreSQL ended the service connection this session's statement ran on.")
        else:
            self.fail("08006", "anonproxy lost its service connection to the PostgreSQL server", hint="Reconnect.")

    def fail(self, sqlstate: str, message: str, *, hint: str | None = None, detail: str | None = None) -> None:
        """Send a FATAL ErrorResponse and close the client connection."""
        if self.transport is not None and not self.transport.is_closing():
            self.flush()
            self.transport.write(pg.error_response(sqlstate, message, severity="FATAL", hint=hint, detail=detail))
            self.transport.close()
        self.state = State.CLOSED

    def flush(self) -> None:
        """Write what the gate sent the client and is still kept for its batch (before any other write)."""
        if self._output is not None:
            self._output.flush()

    def close(self) -> None:
        """Close the client connection after what was sent to it."""
        self.flush()
        self.transport.close()  # type: ignore[union-attr]


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.tracker = BoundaryTracker()
        self.key: UpstreamKey | None = None
        self.closed = False
        self._auth_messages: MessageBuffer | None = MessageBuffer()
        self._gate: Gate | None = None
        self._gated_messages = RelayingMessageBuffer(RELAYED_MESSAGE_SIZE)
        self._held: list[bytes] = []  # server bytes after login, before relaying or gating starts
        self.relaying = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            if self._gate is not None:  # (its message buffer follows the boundaries: no tracker)
                self._to_gate(data)
                return
            self.tracker.feed(data)
            if self.relaying:
                self.client.transport.write(data)  # type: ignore[union-attr]
                if self.tracker.idle:
                    self.client.awaiting_server = False
            elif self._auth_messages is not None:
                self._auth_received(data)
            else:
                self._held.append(data)  # login done, relay or gate not decided yet
        except pg.ProtocolViolation as exc:
            log.warning("session %d: upstream sent an invalid message: %s", self.client.id, exc)
            self.transport.abort()
        except Exception:
            log.exception("session %d: internal error", self.client.id)
            self.transport.abort()

    def _auth_received(self, data: bytes) -> None:
        assert self._auth_messages is not None
        out: list[bytes] = []
        for type_, body in self._auth_messages.feed(data):
            if type_ == b"K":
                process_id, secret_key = pg.parse_backend_key_data(body)
                self.key = UpstreamKey(self.client.context.upstream, process_id, secret_key)
                out.append(self.client.authenticated(self.key))
                continue
            if type_ == b"R":
                body = without_channel_binding(body)  # (the client's login is not on the server's TLS connection)
            if type_ == b"S":
                name, offset = pg.read_cstring(body)
                self.client.server_parameters[name.decode()] = pg.read_cstring(body, offset)[0].decode()
            if type_ == b"Z":
                # Anything after the first ReadyForQuery is ordinary traffic.
                self._held.append(self._auth_messages.take_rest())
                self._auth_messages = None
                self.client.transport.writelines(out)  # type: ignore[union-attr]
                self.client.login_complete(pg.message(type_, body))
                return
            out.append(pg.message(type_, body))
        self.client.transport.writelines(out)  # type: ignore[union-attr]

    def start_relay(self) -> None:
        """Forward bytes untouched from now on."""
        self.relaying = True
        self.client.transport.writelines(self._held)  # type: ignore[union-attr]
        self._held.clear()

    def open_gate(self, gate: Gate) -> None:
        """From now on, whole messages go to the session's gate."""
        self._gate = gate
        self._to_gate(b"".join(self._held))
        self._held.clear()

    def _to_gate(self, data: bytes) -> None:
        assert self._gate is not None
        for message in self._gated_messages.feed(data):
            if isinstance(message, Rows):
                self._gate.upstream_rows(message)
            elif isinstance(message, Piece):
                self._gate.upstream_piece(message)
            else:
                self._gate.upstream_message(*message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        client = self.client
        if client.state is State.CLOSED:
            return
        # Unless the client asked for it or the server said why (a FATAL ErrorResponse), tell the client.
        boundaries = self._gated_messages if self._gate is not None else self.tracker
        if boundaries.at_boundary and boundaries.last_type != b"E" and not client.terminating:
            log.warning("session %d: upstream connection lost", client.id)
            client.fail("08006", "the connection to the PostgreSQL server was lost",
                        hint="The server may be restarting; reconnect.")
        else:
            client.state = State.CLOSED
            client.close()

    def pause_writing(self) -> None:
        self.client.transport.pause_reading()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self.client.transport.resume_reading()  # type: ignore[union-attr]
