#!/usr/bin/env python3
"""Is statement analysis shared fairly? First-sight statement latency of other sessions while heavy clients flood.

A throwaway PostgreSQL set up like ``anonproxy up`` and ``anonproxy serve`` with one worker and otherwise default
settings (``analysis_timeout`` 5 s; ``analysis_processes`` where the proxy has it). For 1, 2 and 4 heavy clients
(``--heavy``), each a ``reporter`` session sending statements that run into the analysis budget (an aggregate with
a 256 kB IN list of sums, a new text each time), one after the other: once every heavy client has been
refused once, a ``reporter`` probe sends ``--probes`` first-sight statements (a short aggregate, a new text each
time), first each on a new session, then all on one session, and times each from send to answer. The worker's
VmRSS and its children's (the analysis processes) are sampled meanwhile. Prints p50/p99 of the probes per case.
See README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (  # noqa: E402  the hostile benchmark's helpers: database, proxy, sessions, memory, percentiles
    REPO,
    EmbeddedPostgres,
    _connect,
    _MemorySampler,
    _prepare_database,
    _progress,
    _proxy,
    _summary,
)

# Sums of one-digit values (``3+1``), many tokens and nodes per byte: about 10 s of analysis (CPU) on the test
# machine for 250 kB, so that each statement runs into the 5 s budget (run.py's 256 kB statement takes 3.3 s and is
# answered on an idle machine).
HEAVY_SIZE = 256_000  # just under the default max_statement_size
PROBE = "select sex, count(*) from adult group by sex"
# Each probe waits a random time up to the default budget first, so that probes fall at any point of the heavy
# analyses (the heavy clients' statements tend to start and end together).
PAUSE = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
    parser.add_argument("--heavy", default="1,2,4", help="numbers of heavy clients, one case each (1,2,4)")
    parser.add_argument("--probes", type=int, default=8, help="first-sight statements per probe kind and case (8)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the checkout whose anonproxy package the proxy runs (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"source": str(args.source), "probes": args.probes, "cases": {}}
    with ExitStack() as stack:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = _prepare_database(server)
        proxy, port = stack.enter_context(_proxy(server.port, service_dsn, args.source))
        with _connect(port, "reporter") as reporter:
            reporter.execute(PROBE).fetchall()  # the gate works and the analysis processes are ready
        quiet = _probe(proxy.pid, port, 0, args.probes)
        report["cases"]["0"] = quiet
        _progress(f"no heavy client: {_line(quiet)}")
        for heavy in (int(n) for n in args.heavy.split(",")):
            figures = _probe(proxy.pid, port, heavy, args.probes)
            report["cases"][str(heavy)] = figures
            _progress(f"{heavy} heavy: {_line(figures)}")
    _print(report)
    return report


def _probe(pid: int, port: int, heavy: int, probes: int) -> dict[str, Any]:
    """The probes' latencies while ``heavy`` clients flood, and the memory meanwhile."""
    # The heavy clients are processes of their own, so that building their statements does not hold this one's GIL.
    context = multiprocessing.get_context("fork")
    refused = context.Array("i", heavy)
    answered = context.Value("i", 0)  # heavy statements analysed within the budget after all
    stop = context.Event()
    sampler = _MemorySampler(pid)
    sampler.start()
    before = sampler.worker_rss
    clients = [context.Process(target=_flood, args=(port, n, refused, answered, stop), daemon=True)
               for n in range(heavy)]
    for client in clients:
        client.start()
    try:
        deadline = time.monotonic() + 60 * max(heavy, 1)
        while heavy and min(refused) == 0:  # every heavy client has had a turn and queued its next statement
            if time.monotonic() > deadline:
                raise RuntimeError("the heavy clients were not refused in time")
            time.sleep(0.1)
        new_sessions = [_first_sight(port, None, f"new {heavy}.{n}") for n in range(probes)]
        with _connect(port, "reporter") as conn:
            one_session = [_first_sight(port, conn, f"same {heavy}.{n}") for n in range(probes)]
    finally:
        stop.set()
        for client in clients:
            client.join(30)
            if client.is_alive():
                client.kill()
        sampler.stop()
    return {"new_session": _summary(new_sessions), "one_session": _summary(one_session),
            "heavy_refused": sum(refused), "heavy_answered": answered.value,
            "worker_growth_mb": (sampler.worker_peak - before) / 2**20,
            "analysis_peak_mb": sampler.children_peak / 2**20}


def _first_sight(port: int, conn: psycopg.Connection[Any] | None, label: str) -> float:
    """Milliseconds from sending a new statement text to its answer (on a new session when ``conn`` is None; its
    login is not timed), after a random pause."""
    time.sleep(random.uniform(0, PAUSE))
    statement = f"/* probe {label} */ {PROBE}"
    if conn is None:
        with _connect(port, "reporter") as new:
            return _timed(new, statement)
    return _timed(conn, statement)


def _timed(conn: psycopg.Connection[Any], statement: str) -> float:
    start = time.perf_counter()
    rows = conn.execute(statement, prepare=False).fetchall()
    elapsed = (time.perf_counter() - start) * 1000
    if not rows:
        raise RuntimeError("the probe got no rows")
    return elapsed


def _flood(port: int, n: int, refused: Any, answered: Any, stop: Any) -> None:
    """A heavy client: statements past the budget, a new text each, one after the other until ``stop``."""
    statement = _heavy_statement(HEAVY_SIZE)
    round_ = 0
    with _connect(port, "reporter") as conn:
        while not stop.is_set():
            round_ += 1
            try:
                conn.execute(f"/* heavy {n}.{round_} */ {statement}", prepare=False).fetchall()
                with answered.get_lock():
                    answered.value += 1
            except psycopg.errors.StatementTooComplex:
                refused[n] += 1


def _heavy_statement(size: int) -> str:
    """A suppress-mode aggregate with an IN list of sums: about ``size`` bytes of text."""
    head, tail = "select sex, count(*) from adult where age in (", ") group by sex"
    count = (size - len(head) - len(tail) - 40) // 4  # 40: room for the numbering comment
    return head + ",".join(f"{i % 10}+1" for i in range(count)) + tail


def _line(figures: dict[str, Any]) -> str:
    new, one = figures["new_session"], figures["one_session"]
    return (f"new session p50 {new['p50_ms']:.0f} ms p99 {new['p99_ms']:.0f} ms; one session p50 {one['p50_ms']:.0f} "
            f"ms p99 {one['p99_ms']:.0f} ms; worker +{figures['worker_growth_mb']:.1f} MB, analysis processes "
            f"{figures['analysis_peak_mb']:.0f} MB")


def _print(report: dict[str, Any]) -> None:
    print()
    print(f"{'heavy':>5}  {'new p50 ms':>10}  {'new p99 ms':>10}  {'same p50 ms':>11}  {'same p99 ms':>11}  "
          f"{'worker +MB':>10}  {'analysis MB':>11}  {'refused':>7}  {'answered':>8}")
    for heavy, figures in report["cases"].items():
        new, one = figures["new_session"], figures["one_session"]
        print(f"{heavy:>5}  {new['p50_ms']:>10.0f}  {new['p99_ms']:>10.0f}  {one['p50_ms']:>11.0f}  "
              f"{one['p99_ms']:>11.0f}  {figures['worker_growth_mb']:>10.1f}  {figures['analysis_peak_mb']:>11.0f}  "
              f"{figures['heavy_refused']:>7}  {figures['heavy_answered']:>8}")


if __name__ == "__main__":
    sys.exit(main())
