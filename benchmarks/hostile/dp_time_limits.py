#!/usr/bin/env python3
"""Do a cancel and a statement_timeout stop a dp question, and do other sessions notice? See README.md.

A throwaway PostgreSQL set up like ``anonproxy up``, its Adult table made ``--copies`` times larger so that a dp
question's SQL takes seconds, and ``anonproxy serve`` with one worker (run.py's helpers). An ``analyst`` (dp mode)
asks slow dp questions, each new (so each is charged and runs its SQL): in phase ``cancel`` it cancels each one
``--after`` seconds after sending it (a CancelRequest, psycopg's ``cancel_safe``); in phase ``timeout`` it runs
them under ``statement_timeout`` = ``--after``; in phase ``cached`` it asks a question answered before (from the
cache, free) under ``statement_timeout`` = 1 ms. Meanwhile a ``dba`` (direct mode) on the same worker runs
``select 1`` in a loop and the worker's VmRSS is sampled. Prints, per phase, what the analyst got and how long
after its cancel (or its deadline) the answer came, the dba's p50/p99/max and the worker's memory growth; then the
targets: p99 at most 100 ms above the idle p99, growth at most 50 MB.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (  # noqa: E402  (the helpers of the hostile benchmark: database, proxy, timing, memory)
    DATABASE,
    REPO,
    _connect,
    _MemorySampler,
    _prepare_database,
    _progress,
    _proxy,
    _summary,
    _timed,
)

from anonproxy.embedded import EmbeddedPostgres  # noqa: E402

TARGET_ADDED_P99_MS = 100.0
TARGET_GROWTH_MB = 50.0
GROUPS = "age, education, occupation, workclass, race, sex"
QUESTION = f"select {GROUPS}, count(*) from adult where age < {{n}} group by {GROUPS}"  # every age is below 100


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
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=30, help="the Adult table, this many times over (30)")
    parser.add_argument("--rounds", type=int, default=5, help="questions per phase (5)")
    parser.add_argument("--after", type=float, default=0.5,
                        help="seconds after sending a question that it is cancelled, or its statement_timeout (0.5)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the checkout whose anonproxy package the proxy runs (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"source": str(args.source), "rounds": args.rounds, "after_s": args.after,
                              "phases": {}}
    with ExitStack() as stack:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = _prepare_database(server)
        _enlarge(server, args.copies)
        proxy, port = stack.enter_context(_proxy(server.port, service_dsn, args.source))
        dba = stack.enter_context(_connect(port, "dba"))
        with _connect(port, "analyst") as analyst:
            start = time.perf_counter()
            analyst.execute(QUESTION.format(n=100)).fetchall()  # warm: the table in the server's cache
            report["uncancelled_question_s"] = time.perf_counter() - start
        report["idle"] = _summary([_timed(dba) for _ in range(500)])
        _progress(f"a dp question takes {report['uncancelled_question_s']:.2f} s; idle dba p99 "
                  f"{report['idle']['p99_ms']:.2f} ms")
        phases = {"cancel": (range(101, 101 + args.rounds), args.after),
                   "timeout": (range(101 + args.rounds, 101 + 2 * args.rounds), args.after),
                   "cached": ([100] * args.rounds, 0.001)}
        for phase, (numbers, after) in phases.items():
            figures = _under_attack(proxy, port, dba, phase, list(numbers), after)
            report["phases"][phase] = figures
            _progress(f"{phase}: {figures['analyst']}")
    _print(report)
    return report


def _enlarge(server: EmbeddedPostgres, copies: int) -> None:
    """Adult ``copies`` times over (new ids), and a budget for the analyst that many questions cannot exhaust."""
    with psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        columns = [row[0] for row in conn.execute(
            "select column_name from information_schema.columns where table_schema = 'public' "
            "and table_name = 'adult' and column_name <> 'id' order by ordinal_position")]
        listed = ", ".join(f'"{column}"' for column in columns)
        conn.execute(f"insert into adult (id, {listed}) select id + n * 1000000, {listed} "
                     f"from adult, generate_series(1, {copies - 1}) n")
        conn.execute("analyze adult")
        conn.execute("select anonproxy.set_budget('analyst', 'public.adult', 1000, 0.001, null, 0.5, 0.0000001)")


def _under_attack(proxy: Any, port: int, dba: psycopg.Connection[Any], phase: str, numbers: list[int],
                  after: float) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    outcomes = context.Queue()
    sampler = _MemorySampler(proxy.pid)
    sampler.start()
    before = sampler.worker_rss
    analyst = context.Process(target=_attack, args=(port, phase, numbers, after, outcomes), daemon=True)
    analyst.start()
    latencies: list[float] = []
    while analyst.is_alive():
        latencies.append(_timed(dba))
    sampler.stop()
    analyst.join()
    results = [outcomes.get() for _ in numbers]
    return {"analyst": ", ".join(f"{outcome} {seconds:.3f} s after" for outcome, seconds in results),
            "stop_to_answer_s": [seconds for _, seconds in results], "dba": _summary(latencies),
            "worker_growth_mb": (sampler.worker_peak - before) / 2**20}


def _attack(port: int, phase: str, numbers: list[int], after: float, outcomes: Any) -> None:
    """The analyst: one new question per number; for each, what it got and how long after ``after`` seconds."""
    with _connect(port, "analyst") as conn:
        if phase != "cancel":
            conn.execute(f"set statement_timeout = {max(1, round(after * 1000))}")
        for number in numbers:
            sent = time.perf_counter()
            canceller = threading.Timer(after, conn.cancel_safe) if phase == "cancel" else None
            if canceller is not None:
                canceller.start()
            try:
                conn.execute(QUESTION.format(n=number)).fetchall()
                outcome = "answered"
            except psycopg.Error as exc:
                outcome = exc.sqlstate or type(exc).__name__
            outcomes.put((outcome, time.perf_counter() - sent - after))
            if canceller is not None:
                canceller.join()


def _print(report: dict[str, Any]) -> None:
    idle = report["idle"]["p99_ms"]
    print(f"\na dp question uncancelled: {report['uncancelled_question_s']:.2f} s; idle dba p99 {idle:.2f} ms")
    print(f"{'phase':>8}  {'dba answers':>11}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}  {'worker +MB':>10}  "
          "analyst (what it got, and when after the cancel or the deadline)")
    for phase, figures in report["phases"].items():
        dba = figures["dba"]
        print(f"{phase:>8}  {dba['count']:>11}  {dba['p50_ms']:>7.2f}  {dba['p99_ms']:>7.2f}  {dba['max_ms']:>7.1f}  "
              f"{figures['worker_growth_mb']:>10.1f}  {figures['analyst']}")
    added = max(figures["dba"]["p99_ms"] for figures in report["phases"].values()) - idle
    growth = max(figures["worker_growth_mb"] for figures in report["phases"].values())
    print(f"\ntarget p99 added <= {TARGET_ADDED_P99_MS:g} ms: worst {added:.2f} ms "
          f"{'PASS' if added <= TARGET_ADDED_P99_MS else 'FAIL'}")
    print(f"target worker growth <= {TARGET_GROWTH_MB:g} MB: worst {growth:.1f} MB "
          f"{'PASS' if growth <= TARGET_GROWTH_MB else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
