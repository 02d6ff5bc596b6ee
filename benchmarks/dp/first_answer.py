#!/usr/bin/env python3
"""A dp question's first answer, this checkout and a baseline checkout side by side, interleaved question by question.

Two throwaway PostgreSQL servers set up like ``anonproxy up``, each with its own checkout's migrations, installed by
that checkout's code (benchmarks/dp/breakdown.py's ``prepared``), so each side runs its own code on its own schema.
One ``anonproxy serve`` (1 worker) per checkout. ``analyst`` gets a budget it never spends (``--accounting``, basic
by default) and, with ``--ledger N``, N earlier charges (a role that has asked N questions before). Each round asks every question on both sides (the order of the sides alternating from round to round):
through the proxy with the answer cache emptied (a first answer: lookup, check, charge, read, store; with
``--new-texts``, a new text each time: planned too, and not known to the worker as answered), and directly
as the owner (the plain query), then through the proxy again with the answer kept (a question already answered: no
charge). Prints, per side, the p50 of each and the added latency (first p50 − direct p50, seen p50 − direct p50),
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

_spec = importlib.util.spec_from_file_location("audit_trail_run", REPO / "benchmarks" / "audit_trail" / "run.py")
assert _spec is not None and _spec.loader is not None
_setup = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _setup
_spec.loader.exec_module(_setup)
_spec = importlib.util.spec_from_file_location("dp_breakdown", REPO / "benchmarks" / "dp" / "breakdown.py")
assert _spec is not None and _spec.loader is not None
_breakdown = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _breakdown
_spec.loader.exec_module(_breakdown)

QUESTIONS = ("select count(*) from adult", "select sex, count(*) from adult group by 1",
             "select education, avg(age) from adult group by 1", "select sum(capital_gain) from adult where age > 40")
FILLER = ("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint) "
          "select 'analyst', 'public.adult', 0.5, 0, 0.125, 0, 'filler' from generate_series(1, %s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with (e.g. main)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--accounting", choices=("basic", "zcdp"), default="basic")
    parser.add_argument("--ledger", type=int, default=0, help="charges the analyst made before the run")
    parser.add_argument("--new-texts", action="store_true",
                        help="ask each first answer as a new text (a new table alias: planned, and not known to the "
                             "worker as answered) instead of the same text with the answer cache emptied")
    args = parser.parse_args()
    with ExitStack() as stack:
        sides = {}
        for name, tree in (("baseline", args.baseline.resolve()), ("this checkout", REPO)):
            side = _breakdown.prepared(stack, name, tree, args.accounting)  # each tree's own migrations
            if args.ledger:
                side.owner.execute(FILLER, [args.ledger])
                side.owner.execute("vacuum analyze anonproxy.budget_ledger")
            proxy = stack.enter_context(_setup.start_proxy(name, tree, True, side.server.port, side.service_dsn,
                                                           workers=1))
            sides[name] = (side.owner, stack.enter_context(_setup.open_session(proxy.port, "analyst")))
        for question in QUESTIONS:  # warm: planned, a pooled connection
            for _, analyst in sides.values():
                analyst.execute(question).fetchall()
        times: dict[tuple[str, str, str], list[float]] = {}
        started, load = time.strftime("%H:%M:%S", time.gmtime()), Path("/proc/loadavg").read_text().split()[:3]
        for round_ in range(args.rounds):
            order = list(sides.items()) if round_ % 2 == 0 else list(reversed(sides.items()))
            for question in QUESTIONS:
                for name, (owner, analyst) in order:
                    text = question.replace(" from adult", f" from adult as r{round_}") if args.new_texts else question
                    for kind, conn in (("first", analyst), ("direct", owner), ("seen", analyst)):
                        if kind == "first":
                            owner.execute("delete from anonproxy.answer_cache where role_name = 'analyst'")
                        begun = time.perf_counter()
                        conn.execute(text, prepare=False).fetchall()
                        times.setdefault((name, kind, question), []).append((time.perf_counter() - begun) * 1000)
        print(f"{args.rounds} rounds, {started}-{time.strftime('%H:%M:%S', time.gmtime())} UTC, load average "
              f"{' '.join(load)} -> {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        for name in sides:
            added, seen_added = [], []
            for question in QUESTIONS:
                first, direct, seen = (statistics.median(times[name, kind, question])
                                       for kind in ("first", "direct", "seen"))
                added.append(first - direct)
                seen_added.append(seen - direct)
                print(f"  {name:<14} first p50 {first:7.2f} ms  direct p50 {direct:7.2f} ms  +{first - direct:6.2f}"
                      f"  seen p50 {seen:7.2f} ms  {seen - direct:+6.2f}  {question}")
            print(f"  {name:<14} added, median over the questions: first {statistics.median(added):+.2f} ms, "
                  f"seen {statistics.median(seen_added):+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
