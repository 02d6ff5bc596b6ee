#!/usr/bin/env python3
"""A dp question's first answer, this checkout and a baseline checkout side by side, interleaved question by question.

Two throwaway PostgreSQL servers set up like ``anonproxy up`` (benchmarks/audit_trail/run.py's set-up) with this
checkout's migrations; on the baseline's server the ledger functions migration 0032 changed are put back as they
were before it (``store_answer`` of 0003, ``data_version`` without its plan setting), so each side runs its own
code on its own schema. One ``anonproxy serve`` (1 worker) per checkout. ``analyst`` gets a basic budget it never
spends. Each round asks every question on both sides (the order of the sides alternating from round to round):
through the proxy with the answer cache emptied (a first answer: lookup, check, charge, read, store), and directly
as the owner (the plain query). Prints, per side, the p50 of each and the added latency (first p50 − direct p50),
and the median over the questions. See README.md ("Fewer round trips").
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402

from anonproxy.embedded import EmbeddedPostgres  # noqa: E402

_spec = importlib.util.spec_from_file_location("audit_trail_run", REPO / "benchmarks" / "audit_trail" / "run.py")
assert _spec is not None and _spec.loader is not None
_setup = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _setup
_spec.loader.exec_module(_setup)

QUESTIONS = ("select count(*) from adult", "select sex, count(*) from adult group by 1",
             "select education, avg(age) from adult group by 1", "select sum(capital_gain) from adult where age > 40")
BUDGET = ("select anonproxy.set_budget('analyst'::name, 'public.adult'::regclass, 10000000, 0.5, null, 0.5, "
          "0.0000001, 'basic')")


def before_0032() -> list[str]:
    """The statements that put the ledger functions 0032 changed back as they were."""
    text = (REPO / "sql" / "0003_ledger.sql").read_text()
    start = text.index("create function anonproxy.store_answer")
    end = text.index("$$;", text.index("$$", start) + 2) + 3
    return ["create or replace " + text[start + len("create "):end],
            "alter function anonproxy.data_version(text[]) reset plan_cache_mode"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with (e.g. main)")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    with ExitStack() as stack:
        sides = {}
        for name, tree in (("baseline", args.baseline.resolve()), ("this checkout", REPO)):
            server = stack.enter_context(EmbeddedPostgres())
            service = _setup.prepare_database(server)
            owner = stack.enter_context(psycopg.connect(server.conninfo(dbname=_setup.DATABASE), autocommit=True))
            for sql in before_0032() if name == "baseline" else []:
                owner.execute(sql)
            owner.execute(BUDGET)
            proxy = stack.enter_context(_setup.start_proxy(name, tree, True, server.port, service, workers=1))
            sides[name] = (owner, stack.enter_context(_setup.open_session(proxy.port, "analyst")))
        for question in QUESTIONS:  # warm: planned, a pooled connection
            for _, analyst in sides.values():
                analyst.execute(question).fetchall()
        times: dict[tuple[str, str, str], list[float]] = {}
        started, load = time.strftime("%H:%M:%S", time.gmtime()), open("/proc/loadavg").read().split()[:3]
        for round_ in range(args.rounds):
            order = list(sides.items()) if round_ % 2 == 0 else list(reversed(sides.items()))
            for question in QUESTIONS:
                for name, (owner, analyst) in order:
                    for kind, conn in (("first", analyst), ("direct", owner)):
                        owner.execute("delete from anonproxy.answer_cache where role_name = 'analyst'")
                        begun = time.perf_counter()
                        conn.execute(question, prepare=False).fetchall()
                        times.setdefault((name, kind, question), []).append((time.perf_counter() - begun) * 1000)
        print(f"{args.rounds} rounds, {started}-{time.strftime('%H:%M:%S', time.gmtime())} UTC, load average "
              f"{' '.join(load)} -> {' '.join(open('/proc/loadavg').read().split()[:3])}")
        for name in sides:
            added = []
            for question in QUESTIONS:
                first = statistics.median(times[name, "first", question])
                direct = statistics.median(times[name, "direct", question])
                added.append(first - direct)
                print(f"  {name:<14} first p50 {first:7.2f} ms  direct p50 {direct:7.2f} ms  +{first - direct:6.2f}"
                      f"  {question}")
            print(f"  {name:<14} added, median over the questions: {statistics.median(added):+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
