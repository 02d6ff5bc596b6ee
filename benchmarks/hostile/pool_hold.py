#!/usr/bin/env python3
"""Can sessions that open a batch and never Sync pin the service pool? Other reporters' latency meanwhile.

A throwaway PostgreSQL set up like ``anonproxy up`` and ``anonproxy serve`` with one worker and the default
settings (``service_pool_size`` 10). For each attack and each number of attackers, a fresh proxy; attacker
sessions (``reporter``, suppress mode, in a process of their own) each send part of an extended-protocol batch
and never its Sync:

* ``prepare``: Parse, Describe (statement), Flush: what asyncpg's ``prepare()`` sends;
* ``execute``: Parse, Bind, Execute, Flush;
* ``busy`` (for comparison, no attack): Parse, Bind, Execute, Sync, the aggregate in a loop.

An attacker whose batch is ended by the proxy (an ErrorResponse) sends Sync and opens the same batch again at
once, so that it holds as much as it can for the whole phase (and runs the aggregate again each time: compare
with ``busy``, the same load from well-behaved sessions). Meanwhile another reporter session runs a rewritten
aggregate in a loop, each timed from send to rows; the worker's VmRSS is sampled. Prints, per phase, the victim's
p50/p99/max and the worker's memory growth, then the targets: p99 <= 100 ms added to the idle p99, growth <= 50 MB.
See README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as hostile  # noqa: E402  (the database, proxy, memory and percentile helpers of run.py)

AGG = "select sex, count(*) from adult group by sex order by sex"
TARGET_ADDED_P99_MS = 100.0
TARGET_GROWTH_MB = 50.0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = run(args)
    except (RuntimeError, psycopg.Error) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default="prepare,execute,busy", help="of prepare, execute, busy (all)")
    parser.add_argument("--attackers", default="10,20", help="numbers of attacker sessions, one phase each (10,20)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase (30)")
    parser.add_argument("--source", type=Path, default=hostile.REPO,
                        help="the checkout whose anonproxy package the proxy runs (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    attacks = [attack.strip() for attack in args.attacks.split(",")]
    if not set(attacks) <= set(BATCHES):
        raise RuntimeError(f"unknown attacks {attacks}; known: {', '.join(BATCHES)}")
    counts = [int(count) for count in args.attackers.split(",")]
    report: dict[str, Any] = {"source": str(args.source), "seconds": args.seconds, "phases": {}}
    with ExitStack() as stack:
        hostile._progress("starting PostgreSQL")
        server = stack.enter_context(hostile.EmbeddedPostgres())
        service_dsn = hostile._prepare_database(server)
        with hostile._proxy(server.port, service_dsn, args.source) as (proxy, port):
            with hostile._connect(port, "reporter") as victim:
                report["idle"] = hostile._summary([_timed(victim) for _ in range(300)])
        hostile._progress(f"idle victim: p50 {report['idle']['p50_ms']:.2f} ms, "
                          f"p99 {report['idle']['p99_ms']:.2f} ms")
        for attack in attacks:
            for count in counts:
                with hostile._proxy(server.port, service_dsn, args.source) as (proxy, port):
                    figures = _phase(proxy, port, attack, count, args.seconds)
                name = f"{attack} x{count}"
                report["phases"][name] = figures
                victim_figures = figures["victim"]
                hostile._progress(f"{name}: victim {victim_figures['count']} answers, p50 "
                                  f"{victim_figures['p50_ms']:.2f} ms, p99 {victim_figures['p99_ms']:.2f} ms, max "
                                  f"{victim_figures['max_ms']:.0f} ms{figures['stalled']}; worker memory "
                                  f"+{figures['worker_growth_mb']:.1f} MB; attackers: {figures['attackers']}")
    _print(report)
    return report


def _timed(conn: psycopg.Connection[Any]) -> float:
    start = time.perf_counter()
    rows = conn.execute(AGG).fetchall()
    elapsed = (time.perf_counter() - start) * 1000
    if len(rows) != 2:
        raise RuntimeError(f"the aggregate answered {rows!r}")
    return elapsed


def _phase(proxy: Any, port: int, attack: str, count: int, seconds: float) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    outcomes = context.Queue()
    ready = context.Event()
    attackers = context.Process(target=_attack, args=(port, attack, count, seconds, ready, outcomes), daemon=True)
    conn = psycopg.connect(f"host={hostile.HOST} port={port} dbname={hostile.DATABASE} user=reporter "
                           "password=reporter", autocommit=True)
    _timed(conn)  # the statement's first analysis is not what is measured
    sampler = hostile._MemorySampler(proxy.pid)
    sampler.start()
    before = sampler.worker_rss
    attackers.start()
    if not ready.wait(60):
        raise RuntimeError("the attackers did not log in")
    latencies: list[float] = []
    stalled: list[float] = []
    done = threading.Event()

    def victim() -> None:  # a thread: an answer that never comes must not stop the phase
        try:
            with conn:
                while not done.is_set():
                    latencies.append(_timed(conn))
        except psycopg.OperationalError:
            pass  # the proxy stopped while a statement was still unanswered (counted as stalled)

    thread = threading.Thread(target=victim, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    done.set()
    thread.join(max(0.0, started + seconds + 30 - time.monotonic()))
    if thread.is_alive():  # its last statement was never answered: counted as waiting till the end
        stalled.append(time.monotonic() - started - sum(latencies) / 1000)
    sampler.stop()
    attackers.join(60)
    errors = outcomes.get() if not outcomes.empty() else "no report"
    if attackers.is_alive():
        attackers.kill()
    return {"victim": hostile._summary(latencies + [s * 1000 for s in stalled]),
            "stalled": f" (one statement unanswered after {stalled[0]:.0f} s)" if stalled else "",
            "attackers": errors, "worker_rss_before_mb": before / 2**20,
            "worker_growth_mb": (sampler.worker_peak - before) / 2**20}


def _message(type_: bytes, body: bytes = b"") -> bytes:
    return type_ + struct.pack("!i", len(body) + 4) + body


PARSE = _message(b"P", b"\0" + AGG.encode() + b"\0" + struct.pack("!h", 0))
BIND = _message(b"B", b"\0\0" + struct.pack("!hhh", 0, 0, 0))
EXECUTE = _message(b"E", b"\0" + struct.pack("!i", 0))
SYNC = _message(b"S")
BATCHES = {"prepare": PARSE + _message(b"D", b"S\0") + _message(b"H"),
           "execute": PARSE + BIND + EXECUTE + _message(b"H"),
           "busy": PARSE + BIND + EXECUTE + SYNC}


def _attack(port: int, attack: str, count: int, seconds: float, ready: Any, outcomes: Any) -> None:
    """The attackers, in a process of their own: ``count`` sessions holding their batch open for ``seconds``."""
    asyncio.run(_attackers(port, BATCHES[attack], count, seconds, ready, outcomes))


async def _attackers(port: int, batch: bytes, count: int, seconds: float, ready: Any, outcomes: Any) -> None:
    logins = [psycopg.connect(f"host={hostile.HOST} port={port} dbname={hostile.DATABASE} user=reporter "
                              "password=reporter", autocommit=True) for _ in range(count)]
    # psycopg logged in (SCRAM); its sockets are spoken on by hand from here on.
    streams = [await asyncio.open_connection(sock=socket.fromfd(conn.pgconn.socket, socket.AF_INET,
                                                                socket.SOCK_STREAM)) for conn in logins]
    ready.set()
    errors: dict[str, int] = {}
    await asyncio.gather(*(_hold(reader, writer, batch, time.monotonic() + seconds, errors)
                           for reader, writer in streams), return_exceptions=True)
    outcomes.put(", ".join(f"{n} x {code}" for code, n in sorted(errors.items())) or "no error")
    for _, writer in streams:
        writer.close()
    for conn in logins:
        conn.close()


async def _hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, batch: bytes, until: float,
                errors: dict[str, int]) -> None:
    """Send ``batch`` and keep it open; when the proxy ends it with an error, Sync and open it again (a batch
    with its Sync: again once answered)."""
    while time.monotonic() < until:
        writer.write(batch)
        try:
            while True:
                type_, body = await asyncio.wait_for(_read(reader), until - time.monotonic())
                if type_ in b"EZ":
                    break
        except TimeoutError:
            return
        if type_ == b"E":
            code = next(field[1:] for field in body.split(b"\0") if field[:1] == b"C").decode()
            errors[code] = errors.get(code, 0) + 1
            writer.write(SYNC)
            while (await _read(reader))[0] != b"Z":
                pass


async def _read(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    type_, length = struct.unpack("!ci", await reader.readexactly(5))
    return type_, await reader.readexactly(length - 4)


def _print(report: dict[str, Any]) -> None:
    idle = report["idle"]["p99_ms"]
    print()
    print(f"idle victim: p50 {report['idle']['p50_ms']:.2f} ms, p99 {idle:.2f} ms")
    print(f"{'phase':>12}  {'answers':>7}  {'p50 ms':>9}  {'p99 ms':>9}  {'max ms':>9}  {'worker +MB':>10}  attackers")
    for name, figures in report["phases"].items():
        victim = figures["victim"]
        print(f"{name:>12}  {victim['count']:>7}  {victim['p50_ms']:>9.2f}  {victim['p99_ms']:>9.2f}  "
              f"{victim['max_ms']:>9.0f}  {figures['worker_growth_mb']:>10.1f}  {figures['attackers']}"
              f"{figures['stalled']}")
    worst = max(figures["victim"]["p99_ms"] for figures in report["phases"].values()) - idle
    growth = max(figures["worker_growth_mb"] for figures in report["phases"].values())
    print(f"\ntarget p99 added <= {TARGET_ADDED_P99_MS:g} ms: worst {worst:.2f} ms "
          f"{'PASS' if worst <= TARGET_ADDED_P99_MS else 'FAIL'}")
    print(f"target worker growth <= {TARGET_GROWTH_MB:g} MB: worst {growth:.1f} MB "
          f"{'PASS' if growth <= TARGET_GROWTH_MB else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
