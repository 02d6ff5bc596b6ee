"""The proxy server: worker processes sharing a port with SO_REUSEPORT.

``run_proxy`` binds the port, starts ``config.workers`` worker processes (or
serves in-process when there is one), and stops them on SIGINT/SIGTERM.
Each worker is an event loop (uvloop when installed) accepting clients on its
own SO_REUSEPORT socket and, with several workers, cancel requests forwarded
by its siblings on a Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import ssl
import tempfile
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import psycopg

from .. import schema
from ..config import ProxyConfig
from ..policy.model import Policy
from ..wire import protocol as pg
from .analysis import Analyser
from .audit_trail import AuditTrail
from .cancel import CancelRegistry, answer_sibling, cancel_socket_path
from .limits import MemoryLimits
from .noisy import NoisyAnswers
from .policy_watch import PolicyWatcher
from .servers import Servers
from .service_pool import ServicePool
from .service_role import HINT, excess_privileges
from .session import ClientConnection, ProxyContext
from .upstream_tls import client_context

log = logging.getLogger("anonproxy.server")

SHUTDOWN_GRACE = 5.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


class ProxyStartError(RuntimeError):
    """The proxy cannot start serving (e.g. its port is taken)."""


def tls_context(config: ProxyConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def bind_socket(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Worker:
    """One event loop serving clients; usable in-process (``up``, tests) or in a child."""

    def __init__(self, config: ProxyConfig, port: int, index: int = 0, run_dir: Path | None = None) -> None:
        self.config = config
        self.port = port
        # The primary among several upstream hosts, and the standbys (None: one server, as configured).
        servers = Servers(config) if config.replicated else None
        analyser = Analyser(config.analysis_timeout, config.analysis_processes, config.log_level,
                            config.log_format) if config.service_dsn else None
        self.context = ProxyContext(
            upstream=config.upstream_address,
            cancel_keys=CancelRegistry(index, run_dir, config.peer_endpoints),
            tls=tls_context(config),
            startup_timeout=config.startup_timeout,
            trusted_proxies=config.trusted_proxy_networks,
            peer_addresses=config.peer_networks,
            policy=PolicyWatcher(config.service_conninfo, self._policy_changed) if config.service_dsn else None,
            service_login=config.service_login if config.service_dsn else None,
            noisy=NoisyAnswers(config.service_conninfo, analyser=analyser, login=config.service_login,
                               servers=servers) if config.service_dsn else None,
            analyser=analyser,
            audit=AuditTrail(config.service_conninfo) if config.service_dsn and config.audit_trail else None,
            max_statement_size=config.max_statement_size,
            service_pool=ServicePool(config.service_login, config.service_pool_size, config.service_wait_timeout,
                                     servers) if config.service_dsn else None,
            service_hold_timeout=config.service_hold_timeout,
            service_yield_timeout=config.service_yield_timeout,
            limits=MemoryLimits.of(config),
            servers=servers,
        )
        self._index = index
        self._run_dir = run_dir
        self._servers: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.context.servers is not None:
            await self.context.servers.start()  # the primary first: every other connection goes there
        if self.context.analyser is not None:
            self.context.analyser.start()
        if self.context.policy is not None:
            await self.context.policy.start()
        else:
            log.warning("no service_dsn: every role is forwarded unchanged and PostgreSQL's grants alone "
                        "protect the data")
        if self.context.audit is not None:
            await self.context.audit.start()
        sock = bind_socket(self.config.listen_host, self.port)
        self._servers.append(await loop.create_server(lambda: ClientConnection(self.context), sock=sock, backlog=1024))
        if self._run_dir is not None:
            path = cancel_socket_path(self._run_dir, self._index)
            self._servers.append(await loop.create_unix_server(lambda: ForwardedCancel(self.context), str(path)))

    def _policy_changed(self, policy: Policy) -> None:
        """Relayed sessions whose role the new policy anonymizes must not go on unfiltered."""
        for session in list(self.context.sessions):
            session.enforce(policy)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        if self.context.policy is not None:
            await self.context.policy.stop()
        if self.context.noisy is not None:
            await self.context.noisy.close()
        if self.context.analyser is not None:
            self.context.analyser.close()
        if self.context.service_pool is not None:
            self.context.service_pool.close()  # the free ones; a session's goes when the session ends
        for session in list(self.context.sessions):
            session.fail("57P01", "terminating connection because anonproxy is shutting down")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE):
                for server in self._servers:
                    await server.wait_closed()
        if self.context.audit is not None:
            await self.context.audit.stop()  # after the sessions: their last records are written too
        if self.context.servers is not None:
            await self.context.servers.stop()


class ForwardedCancel(asyncio.Protocol):
    """A sibling worker passes on a CancelRequest whose key it did not issue.

    If this worker did, it cancels and answers one byte; the connection is
    closed once the server has acted, which tells the sibling (and through it
    the client) that the cancel is done.
    """

    def __init__(self, context: ProxyContext) -> None:
        self._context = context
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buffer += data
        try:
            packet, _ = pg.read_startup_packet(self._buffer)
        except pg.ProtocolViolation:
            self._transport.close()
            return
        if isinstance(packet, pg.CancelRequest):
            self._context.spawn(answer_sibling(self._context.cancel_keys, packet.process_id, packet.secret_key,
                                               self._transport))


async def serve_until_stopped(worker: Worker, ready: Callable[[], None] | None = None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await worker.start()
    if ready is not None:
        ready()
    await stop.wait()
    await worker.stop()


def _dies_with(supervisor: int) -> bool:
    """Have Linux send this worker SIGTERM when its supervisor dies, kill -9 included: an orphan worker would keep
    the port, and a restarted proxy could not bind it. False when the supervisor is already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a killed supervisor leaves its workers running
        pass
    return os.getppid() == supervisor


def _worker_main(config: ProxyConfig, port: int, index: int, run_dir: Path, ready: Event, supervisor: int) -> None:
    from ..logs import setup_logging

    if not _dies_with(supervisor):
        return
    setup_logging(config.log_level, config.log_format)
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve_until_stopped(Worker(config, port, index, run_dir), ready.set))
    finally:
        loop.close()


def run_proxy(config: ProxyConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM. ``ready(port)`` is called once clients can connect."""
    try:
        # An exclusive bind first: another process sharing the port through
        # SO_REUSEPORT (a second anonproxy, say) would otherwise split our clients.
        with bind_socket(config.listen_host, config.listen_port, reuse_port=False) as probe:
            port = probe.getsockname()[1]
        # Hold the port while workers come and go.
        placeholder = bind_socket(config.listen_host, port)
        tls_context(config)  # unreadable certificate files fail here, not in each worker
    except (OSError, ssl.SSLError) as exc:
        raise ProxyStartError(f"cannot listen on {config.listen_host}:{config.listen_port}: {exc}") from exc
    try:
        client_context(config.upstream_address.tls)  # (built here, before the workers fork: each has its copy)
    except (OSError, ssl.SSLError) as exc:
        placeholder.close()
        raise ProxyStartError(f"the TLS files of the upstream setting cannot be used: {exc}") from exc
    if config.service_dsn:
        _check_service_login(config)
    try:
        if config.workers == 1:
            loop = new_event_loop()
            try:
                worker = Worker(config, port)
                loop.run_until_complete(serve_until_stopped(worker, ready and (lambda: ready(port))))
            finally:
                loop.close()
        else:
            _supervise(config, port, ready)
    finally:
        placeholder.close()


def _check_service_login(config: ProxyConfig) -> None:
    """Refuse to start when the service login is a superuser or a member of a role that widens what it reads, or
    when the database lacks migrations this version ships (its SQL would call functions that do not exist). If
    the server cannot be reached now, the workers check both when they load the policy."""
    try:
        with psycopg.connect(config.service_conninfo, connect_timeout=5, autocommit=True) as conn:
            problem = excess_privileges(conn)
            missing = schema.missing_versions(conn)
            database = conn.info.dbname
    except psycopg.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("could not check the service login's privileges and the schema version at start (%s); the "
                    "workers check them when they load the policy", reason)
        return
    if problem is not None:
        raise ProxyStartError(f"{problem}; refusing to start. {HINT}")
    if missing:
        raise ProxyStartError(f"{schema.outdated_message(missing, database)}; refusing to start")


def _supervise(config: ProxyConfig, port: int, ready: Callable[[int], None] | None) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="anonproxy-"))
    fork = multiprocessing.get_context("fork")
    stopping = False

    def start(index: int) -> multiprocessing.process.BaseProcess:
        event = fork.Event()
        process = fork.Process(target=_worker_main, args=(config, port, index, run_dir, event, os.getpid()),
                               daemon=True)
        process.start()
        if not event.wait(30):
            raise RuntimeError(f"worker {index} did not start")
        return process

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    workers = {}
    try:
        workers = {index: start(index) for index in range(config.workers)}
        if ready is not None:
            ready(port)
        while not stopping:
            for index, process in list(workers.items()):
                process.join(timeout=0.5 / len(workers))
                if process.exitcode is not None and not stopping:
                    log.error("worker %d exited with code %s; restarting it", index, process.exitcode)
                    workers[index] = start(index)
    finally:
        for process in workers.values():
            if process.is_alive():
                process.terminate()
        for process in workers.values():
            process.join(SHUTDOWN_GRACE + 1)
            if process.is_alive():
                process.kill()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(run_dir, ignore_errors=True)
