"""Statement analysis off the event loop, with a time budget, shared fairly between sessions.

Parsing and rewriting a statement (sqlglot, pure Python) is CPU-bound and
grows with the statement's length: a 1 MB ``IN`` list takes tens of seconds.
Run on a worker's event loop it would stall every session of the worker,
direct ones included. So each worker hands analysis to child processes of
its own (``analysis_processes`` of them, each driven from a helper thread of
its own, one statement at a time); the loop only awaits.

A thread could not be stopped when a statement overruns its budget; a process
can. The child that overruns is killed (its memory goes with it) and its
spare, started beforehand, takes its place, so the next statement does not
wait for an interpreter to start. The child is a plain ``python -m`` process
(worker processes are daemonic and may not use multiprocessing's own
children); it talks over a socket pair with multiprocessing's pickled messages.

An argument a caller names ``shared`` (the policy, some 29 kB pickled, most of a new text's request) crosses to
a child once: the child holds it (the ``HELD`` last ones) and later calls name it by a number. The parent holds
the same objects, so an object it finds held is the one the child has; a new child holds nothing.

Statements waiting for a process are queued per session (the caller names
who is asking) and taken in turns (``FairQueue``): the session served longest
ago, or never, goes first. A session that floods heavy statements gets one
turn while every other waiting session gets one, so a session's first
statement waits only for an analysis under way (at most one budget) and for
other sessions' first statements sent before it, not for everything queued.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from itertools import count
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

log = logging.getLogger("anonproxy.analysis")

T = TypeVar("T")
Item = TypeVar("Item")
READY = "ready"  # what a child says once it can take requests
STARTUP_TIMEOUT = 60.0
# Askers whose last turn is remembered; one forgotten beyond this counts as never served (a few hundred kB at most).
REMEMBERED_ASKERS = 10_000
# Shared values a child holds between calls: a worker's current policy, and those its sessions may still be on.
HELD = 4


class AnalysisTimeout(Exception):
    """The statement was not analysed within the budget; its analysis was stopped."""


class AnalysisFailed(Exception):
    """The analysis raised; the message names the exception (no traceback)."""


class FairQueue(Generic[Item]):
    """Work waiting, queued per asker and taken in turns: first the asker whose last turn is oldest (never served
    counts as oldest), ties in order of arrival. Pure: no I/O, no clock."""

    def __init__(self, remembered: int = REMEMBERED_ASKERS) -> None:
        self._waiting: dict[Hashable, deque[tuple[int, Item]]] = {}  # asker -> (arrival, item), oldest first
        self._turns: OrderedDict[Hashable, int] = OrderedDict()  # asker -> its last turn, oldest first
        self._remembered = remembered
        self._clock = count(1)  # arrivals and turns, one sequence

    def __len__(self) -> int:
        return sum(len(items) for items in self._waiting.values())

    def put(self, asker: Hashable, item: Item) -> None:
        self._waiting.setdefault(asker, deque()).append((next(self._clock), item))

    def take(self) -> Item | None:
        """The next item by turns, or None when nothing waits."""
        if not self._waiting:
            return None
        asker = min(self._waiting, key=lambda key: (self._turns.get(key, 0), self._waiting[key][0][0]))
        items = self._waiting[asker]
        _, item = items.popleft()
        if not items:
            del self._waiting[asker]
        self._turns[asker] = next(self._clock)
        self._turns.move_to_end(asker)
        if len(self._turns) > self._remembered:
            self._turns.popitem(last=False)
        return item

    def drain(self) -> list[Item]:
        """Everything waiting, removed."""
        items = [item for queue in self._waiting.values() for _, item in queue]
        self._waiting.clear()
        return items


class _Child:
    """One analysis process and the parent's end of its socket."""

    def __init__(self, logging_args: tuple[str, str]) -> None:
        parent, child = socket.socketpair()
        with child:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno()), *logging_args],
                                            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        self.connection = Connection(parent.detach())
        self._ready = False
        self._held: OrderedDict[int, tuple[int, Any]] = OrderedDict()  # id(value) -> (its number, the value)
        self._numbers = count()

    def wait_ready(self) -> None:
        """Wait until the child has imported the analysis code: its start-up is not part of any budget."""
        if not self._ready:
            if not self.connection.poll(STARTUP_TIMEOUT) or self.connection.recv() != READY:
                raise EOFError("the analysis process did not start")
            self._ready = True

    def send(self, function: Callable[..., Any], args: tuple[Any, ...], shared: tuple[Any, ...]) -> None:
        """Send the call ``function(*args)``: an argument that is (by identity) one of ``shared`` goes as a number
        when the child holds it already, else along with the call (the child holds it from then on, and lets go
        of the one used longest ago beyond HELD)."""
        held = self._held.copy()  # recorded once sent: a call that does not pickle changes nothing
        new: dict[int, Any] = {}
        numbers: dict[int, int] = {}  # position in args -> number of the value held
        for position, value in enumerate(args):
            if not any(value is one for one in shared):
                continue
            if id(value) not in held:  # held values are kept alive here: an id held is that very object
                held[id(value)] = (next(self._numbers), value)
                new[held[id(value)][0]] = value
            held.move_to_end(id(value))
            numbers[position] = held[id(value)][0]
        dropped = [held.popitem(last=False)[1][0] for _ in range(len(held) - HELD)]
        plain = tuple(None if position in numbers else value for position, value in enumerate(args))
        self.connection.send((function, plain, numbers, new, dropped))
        self._held = held

    def stop(self) -> None:
        self.connection.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class _Lane:
    """One analysis process (and its spare), driven one call at a time from a helper thread of its own."""

    def __init__(self, budget: float, logging_args: tuple[str, str]) -> None:
        self.budget = budget
        self._logging_args = logging_args  # the child logs as the worker does (final SQL check refusals)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="anonproxy-analysis")
        self._child: _Child | None = None
        self._spare: _Child | None = None

    def start(self) -> None:
        """Start the child (and its spare) now rather than at the first statement."""
        self._thread.submit(lambda: self._ensure().wait_ready())

    def submit(self, function: Callable[..., T], args: tuple[Any, ...], shared: tuple[Any, ...]) -> Future[T]:
        return self._thread.submit(self._call, function, args, shared)

    def close(self) -> None:
        """Stop the processes now (an analysis under way ends with AnalysisFailed)."""
        for child in (self._child, self._spare):
            if child is not None and child.process.poll() is None:
                child.process.kill()
        self._thread.submit(self._stop_all)
        self._thread.shutdown(wait=False)

    # -- in the helper thread ------------------------------------------------------

    def _call(self, function: Callable[..., T], args: tuple[Any, ...], shared: tuple[Any, ...]) -> T:
        child = self._ensure()
        try:
            child.wait_ready()
            child.send(function, args, shared)
            if not child.connection.poll(self.budget):
                raise AnalysisTimeout()
            ok, value = child.connection.recv()
        except AnalysisTimeout:
            self._replace()
            raise
        except (OSError, EOFError) as exc:
            self._replace()
            raise AnalysisFailed(f"the analysis process ended ({type(exc).__name__})") from None
        if not ok:
            raise AnalysisFailed(value)
        return value  # type: ignore[no-any-return]

    def _ensure(self) -> _Child:
        if self._child is None:
            self._child = self._spare or _Child(self._logging_args)
            self._spare = None
        if self._spare is None:
            self._spare = _Child(self._logging_args)
        return self._child

    def _replace(self) -> None:
        """Kill the current child; the spare takes over (a new spare starts at the next call)."""
        assert self._child is not None
        self._child.stop()
        self._child = None
        log.info("statement analysis stopped after %.1f s; its process was replaced", self.budget)

    def _stop_all(self) -> None:
        for child in (self._child, self._spare):
            if child is not None:
                child.stop()
        self._child = self._spare = None


# What waits for a lane: the call and the future its caller awaits.
_Work = tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...], asyncio.Future[Any]]


class Analyser:
    """Runs ``function(*args)`` in a child process; at most ``budget`` seconds each, ``processes`` at a time, the
    callers taking turns."""

    def __init__(self, budget: float, processes: int = 2, log_level: str = "info", log_format: str = "text") -> None:
        self.budget = budget
        self._idle = [_Lane(budget, (log_level, log_format)) for _ in range(processes)]
        self._lanes = tuple(self._idle)
        self._waiting: FairQueue[_Work] = FairQueue()
        self._closed = False

    def start(self) -> None:
        """Start the children (and their spares) now rather than at the first statement."""
        for lane in self._lanes:
            lane.start()

    async def run(self, function: Callable[..., T], *args: Any, asker: Hashable, shared: tuple[Any, ...] = ()) -> T:
        """The function's value; raises AnalysisTimeout or AnalysisFailed. ``asker`` (a session's key) is whose
        turn the call takes; ``shared``: arguments the child may hold from one call to the next (never changed
        once made, such as a policy), sent to each child once."""
        if self._closed:
            raise AnalysisFailed("the proxy is shutting down")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.put(asker, (function, args, shared, future))
        self._dispatch()
        return await future

    def close(self) -> None:
        """Stop the processes now; an analysis under way or waiting ends with AnalysisFailed."""
        self._closed = True
        for *_, future in self._waiting.drain():
            if not future.done():
                future.set_exception(AnalysisFailed("the proxy is shutting down"))
        for lane in self._lanes:
            lane.close()

    def _dispatch(self) -> None:
        """Hand waiting calls, by turns, to the idle lanes."""
        while self._idle and not self._closed and (work := self._waiting.take()) is not None:
            function, args, shared, future = work
            if future.cancelled():  # its caller is gone
                continue
            lane = self._idle.pop()
            done = asyncio.wrap_future(lane.submit(function, args, shared))
            done.add_done_callback(partial(self._finished, lane, future))

    def _finished(self, lane: _Lane, future: asyncio.Future[Any], outcome: asyncio.Future[Any]) -> None:
        self._idle.append(lane)
        # Read even when nobody awaits any more, so that asyncio does not log an exception as never retrieved.
        failure = AnalysisFailed("the analysis was cancelled") if outcome.cancelled() else outcome.exception()
        if not future.done():
            if failure is not None:
                future.set_exception(failure)
            else:
                future.set_result(outcome.result())
        self._dispatch()


def _serve(connection: Connection) -> None:
    """The child: answer the calls :meth:`_Child.send` sends until the parent closes the socket."""
    try:
        connection.send(READY)
    except OSError:
        return
    held: dict[int, Any] = {}  # number -> a shared value, as the parent numbered it
    while True:
        try:
            function, plain, numbers, new, dropped = connection.recv()
        except (EOFError, OSError):
            return
        for number in dropped:
            held.pop(number, None)
        held.update(new)
        try:
            args = tuple(held[numbers[position]] if position in numbers else value
                         for position, value in enumerate(plain))
            reply = (True, function(*args))
        except Exception as exc:  # a bug in the analysis: the worker logs it and refuses the statement
            reply = (False, f"{type(exc).__name__}: {exc}")
        try:
            connection.send(reply)
        except OSError:
            return  # the parent is gone
        except Exception as exc:  # the value does not pickle
            connection.send((False, f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    # Interrupts are for the proxy, which stops this process itself; the parent's exit closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from anonproxy.logs import setup_logging

    setup_logging(*sys.argv[2:4])
    import anonproxy.dp.answers  # noqa: F401  imported before the first request, not during it
    import anonproxy.route.decide  # noqa: F401

    _serve(Connection(int(sys.argv[1])))
