"""The proxy server: a supervisor handing each client to the worker process with the fewest sessions.

``run_proxy`` binds the port, starts ``config.workers`` worker processes (or
serves in-process when there is one), and stops them on SIGINT/SIGTERM.
Each worker is an event loop (uvloop when installed). With several workers,
the supervisor accepts the clients and passes each socket (SCM_RIGHTS, over
a Unix socket pair per worker) to the worker with the fewest open sessions:
SO_REUSEPORT's hash of the addresses would split them unevenly (8 sessions
went 4/4 to 7/1 between pgbench runs), and the busier worker then delays
its clients while the other idles. Each worker also takes cancel requests
forwarded by its siblings on a Unix socket. One worker accepts on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
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
LISTEN_BACKLOG = 1024
HANDED_AT_ONCE = 64  # clients a worker takes from its hand-off socket per turn of its loop


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


@dataclass
class Handoff:
    """A worker's end of the supervisor's hand-off: the Unix socket its clients' sockets come over, and the shared
    count, by worker, of the sessions that have ended (the supervisor's count of each worker's open sessions)."""

    channel: socket.socket
    ended: ctypes.Array[ctypes.c_long]
    index: int

    def session_ended(self) -> None:
        self.ended[self.index] += 1  # (only this worker writes its slot)


class Worker:
    """One event loop serving clients; usable in-process (``up``, tests) or in a child. It accepts clients on its
    own socket, or, given a ``handoff``, takes those the supervisor passes it."""

    def __init__(self, config: ProxyConfig, port: int, index: int = 0, run_dir: Path | None = None,
                 handoff: Handoff | None = None) -> None:
        self.config = config
        self.port = port
        self._handoff = handoff
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
            session_ended=handoff.session_ended if handoff is not None else None,
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
        if self._handoff is None:
            sock = bind_socket(self.config.listen_host, self.port)
            self._servers.append(await loop.create_server(lambda: ClientConnection(self.context), sock=sock,
                                                          backlog=LISTEN_BACKLOG))
        else:
            self._handoff.channel.setblocking(False)
            loop.add_reader(self._handoff.channel.fileno(), self._take_clients)
        if self._run_dir is not None:
            path = cancel_socket_path(self._run_dir, self._index)
            self._servers.append(await loop.create_unix_server(lambda: ForwardedCancel(self.context), str(path)))

    def _take_clients(self) -> None:
        """Serve the client sockets the supervisor has passed."""
        assert self._handoff is not None
        channel = self._handoff.channel
        for _ in range(HANDED_AT_ONCE):
            try:
                message, fds, _, _ = socket.recv_fds(channel, 1, 1)
            except (BlockingIOError, InterruptedError):
                return
            if not message:  # the supervisor has gone (and this worker with it: see _dies_with)
                asyncio.get_running_loop().remove_reader(channel.fileno())
                return
            for fd in fds:
                self.context.spawn(self._serve(socket.socket(fileno=fd)))

    async def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: ClientConnection(self.context), sock)
        except OSError as exc:  # the client has already gone
            log.debug("a client handed over by the supervisor could not be served: %s", exc)
            sock.close()
            assert self._handoff is not None
            self._handoff.session_ended()

    def _policy_changed(self, policy: Policy) -> None:
        """Relayed sessions whose role the new policy anonymizes must not go on unfiltered."""
        for session in list(self.context.sessions):
            session.enforce(policy)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        if self._handoff is not None:
            asyncio.get_running_loop().remove_reader(self._handoff.channel.fileno())
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


def _worker_main(config: ProxyConfig, port: int, handoff: Handoff, siblings: list[socket.socket], run_dir: Path,
                 ready: Event, supervisor: int) -> None:
    from ..logs import setup_logging

    for channel in siblings:  # the supervisor's ends of the other workers' hand-off sockets, copied by the fork
        channel.close()
    if not _dies_with(supervisor):
        return
    setup_logging(config.log_level, config.log_format)
    loop = new_event_loop()
    try:
        worker = Worker(config, port, handoff.index, run_dir, handoff)
        loop.run_until_complete(serve_until_stopped(worker, ready.set))
    finally:
        loop.close()


def run_proxy(config: ProxyConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM. ``ready(port)`` is called once clients can connect."""
    try:
        # An exclusive bind first: another process sharing the port through
        # SO_REUSEPORT (a second anonproxy, say) would otherwise split our clients.
        with bind_socket(config.listen_host, config.listen_port, reuse_port=False) as probe:
            port = probe.getsockname()[1]
        # Hold the port while workers come and go (several workers: the supervisor's listening socket).
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
            _supervise(config, placeholder, ready)
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


def _supervise(config: ProxyConfig, listener: socket.socket, ready: Callable[[int], None] | None) -> None:
    port = listener.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="anonproxy-"))
    fork = multiprocessing.get_context("fork")
    ended = fork.RawArray(ctypes.c_long, config.workers)  # sessions ended, by worker (each writes its own)
    handed = [0] * config.workers  # clients handed to each worker
    channels: dict[int, socket.socket] = {}  # the supervisor's end of each worker's hand-off socket
    stopping = False

    def start(index: int) -> multiprocessing.process.BaseProcess:
        if index in channels:
            channels.pop(index).close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handed[index], ended[index] = 0, 0
        event = fork.Event()
        process = fork.Process(target=_worker_main, daemon=True,
                               args=(config, port, Handoff(theirs, ended, index), list(channels.values()), run_dir,
                                     event, os.getpid()))
        process.start()
        theirs.close()
        ours.setblocking(False)
        channels[index] = ours
        if not event.wait(30):
            raise RuntimeError(f"worker {index} did not start")
        return process

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    workers = {}
    selector = selectors.DefaultSelector()
    try:
        workers = {index: start(index) for index in range(config.workers)}
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ)
        if ready is not None:
            ready(port)
        while not stopping:
            if selector.select(timeout=0.5):
                _hand_out(listener, channels, handed, ended)
            for index, process in list(workers.items()):
                if process.exitcode is not None and not stopping:
                    log.error("worker %d exited with code %s; restarting it", index, process.exitcode)
                    workers[index] = start(index)
    finally:
        selector.close()
        for process in workers.values():
            if process.is_alive():
                process.terminate()
        for process in workers.values():
            process.join(SHUTDOWN_GRACE + 1)
            if process.is_alive():
                process.kill()
        for channel in channels.values():
            channel.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(run_dir, ignore_errors=True)


def _hand_out(listener: socket.socket, channels: dict[int, socket.socket], handed: list[int],
              ended: ctypes.Array[ctypes.c_long]) -> None:
    """Pass each client waiting on the listener to the worker with the fewest open sessions (the next one if its
    hand-off socket is full or gone, as when it is being restarted)."""
    while True:
        try:
            client, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        with client:
            by_sessions = sorted(channels, key=lambda index: handed[index] - ended[index])
            for index in by_sessions:
                try:
                    socket.send_fds(channels[index], [b"c"], [client.fileno()])
                except OSError:
                    continue
                handed[index] += 1
                break
            else:
                log.error("no worker could take a client; its connection is closed")
