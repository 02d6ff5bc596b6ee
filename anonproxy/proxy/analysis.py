"""Statement analysis off the event loop, with a time budget.

Parsing and rewriting a statement (sqlglot, pure Python) is CPU-bound and
grows with the statement's length: a 1 MB ``IN`` list takes tens of seconds.
Run on a worker's event loop it would stall every session of the worker,
direct ones included. So each worker hands analysis to a child process of
its own, one statement at a time, from a helper thread; the loop only awaits.

A thread could not be stopped when a statement overruns its budget; a process
can. The child that overruns is killed (its memory goes with it) and a spare,
started beforehand, takes its place, so the next statement does not wait for
an interpreter to start. The child is a plain ``python -m`` process (worker
processes are daemonic and may not use multiprocessing's own children); it
talks over a socket pair with multiprocessing's pickled messages.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar

log = logging.getLogger("anonproxy.analysis")

T = TypeVar("T")
READY = "ready"  # what a child says once it can take requests
STARTUP_TIMEOUT = 60.0


class AnalysisTimeout(Exception):
    """The statement was not analysed within the budget; its analysis was stopped."""


class AnalysisFailed(Exception):
    """The analysis raised; the message names the exception (no traceback)."""


class _Child:
    """One analysis process and the parent's end of its socket."""

    def __init__(self, logging_args: tuple[str, str]) -> None:
        parent, child = socket.socketpair()
        with child:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno()), *logging_args],
                                            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        self.connection = Connection(parent.detach())
        self._ready = False

    def wait_ready(self) -> None:
        """Wait until the child has imported the analysis code: its start-up is not part of any budget."""
        if not self._ready:
            if not self.connection.poll(STARTUP_TIMEOUT) or self.connection.recv() != READY:
                raise EOFError("the analysis process did not start")
            self._ready = True

    def stop(self) -> None:
        self.connection.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Analyser:
    """Runs ``function(*args)`` in the child process; at most ``budget`` seconds each."""

    def __init__(self, budget: float, log_level: str = "info", log_format: str = "text") -> None:
        self.budget = budget
        self._logging_args = (log_level, log_format)  # the child logs as the worker does (final SQL check refusals)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="anonproxy-analysis")
        self._child: _Child | None = None
        self._spare: _Child | None = None

    def start(self) -> None:
        """Start the child (and its spare) now rather than at the first statement."""
        self._thread.submit(lambda: self._ensure().wait_ready())

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """The function's value; raises AnalysisTimeout or AnalysisFailed. Calls run one at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, function, args)

    def close(self) -> None:
        """Stop the processes now (an analysis under way ends with AnalysisFailed)."""
        for child in (self._child, self._spare):
            if child is not None and child.process.poll() is None:
                child.process.kill()
        self._thread.submit(self._stop_all)
        self._thread.shutdown(wait=False)

    # -- in the helper thread ------------------------------------------------------

    def _call(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        child = self._ensure()
        try:
            child.wait_ready()
            child.connection.send((function, args))
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


def _serve(connection: Connection) -> None:
    """The child: answer ``(function, args)`` requests until the parent closes the socket."""
    try:
        connection.send(READY)
    except OSError:
        return
    while True:
        try:
            function, args = connection.recv()
        except (EOFError, OSError):
            return
        try:
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
    import anonproxy.rewrite.classify  # noqa: F401

    _serve(Connection(int(sys.argv[1])))
