"""What the final SQL check (anonproxy.plan.final_sql) adds to a first-sight decision.

For every query of the suppress benchmark's workload (both the demo reporter's rules — dominance, p %, rest
row — and plain k), and every query of the dp benchmark's workload, the SQL the generator produces is checked
``--runs`` times; the script prints its size, the minimum and the median time of ``check_final_sql`` alone, and
the time of the decision itself (``decide`` without the check, ``plan_dp``) for comparison. Pure CPU: no
database is needed. The check runs once per statement text, role and policy version (decisions and plans are
cached), so this is the cost of the first sight only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent / "suppress"), str(HERE.parent / "dp")]

from dp_workload import QUERIES as DP_QUERIES  # noqa: E402
from workload import QUERIES as SUPPRESS_QUERIES  # noqa: E402

from anonproxy.dp.model import DPParams, DPPlan  # noqa: E402
from anonproxy.dp.plan import plan_dp  # noqa: E402
from anonproxy.plan.final_sql import check_final_sql  # noqa: E402
from anonproxy.policy.model import ColumnPolicy, LinkedTable, SuppressionParams  # noqa: E402
from anonproxy.policy.yaml_policy import demo_policy  # noqa: E402
from anonproxy.route import decide as classify  # noqa: E402
from anonproxy.route.decide import decide  # noqa: E402
from anonproxy.route.decision import Rewrite


def timed(function: Callable[[int], object], runs: int) -> tuple[float, float]:
    """Minimum and median in ms; the argument varies per run so nothing is cached."""
    times = []
    for run in range(runs):
        start = time.perf_counter()
        function(run)
        times.append(time.perf_counter() - start)
    return min(times) * 1000, statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    policy = demo_policy()
    region = LinkedTable("public.adult_region", "id", "public.adult", "id", columns={
        "region": ColumnPolicy("region", "quasi_identifier", domain=("North", "South", "East", "West")),
        "household_size": ColumnPolicy("household_size", "quasi_identifier", 1, 5)})
    policy = replace(policy, links={"public.adult_region": region})
    cells = policy.role("reporter")
    roles = {"cells": cells, "plain k": replace(cells, suppression=SuppressionParams(k=10))}
    checks: list[tuple[float, float]] = []
    print(f"{'query':<18} {'SQL bytes':>9} {'check min':>10} {'check p50':>10} {'decision p50':>13}")
    for label, role in roles.items():
        for query in SUPPRESS_QUERIES:
            decision = decide(query.sql, role, policy)
            assert isinstance(decision, Rewrite), (query.id, decision)
            low, middle = timed(lambda run: check_final_sql(decision.sql, policy), args.runs)
            real = classify.verify
            classify.verify = lambda *_: None  # the decision without the check
            try:
                _, decided = timed(lambda run: decide(query.sql + " " * (run % 64), role, policy), args.runs)
            finally:
                classify.verify = real
            checks.append((low, middle))
            print(f"{query.id} {label:<14} {len(decision.sql):>9} {low:>10.3f} {middle:>10.3f} {decided:>13.3f}")
    analyst = policy.role("analyst")
    for query in DP_QUERIES:
        plan = plan_dp(query.sql, analyst, policy, DPParams(0.5, 1e-7))
        if not isinstance(plan, DPPlan):
            print(f"{query.id} dp             refused by the planner: {plan.message}")
            continue
        low, middle = timed(lambda run: check_final_sql(plan.sql, policy), args.runs)
        _, planned = timed(lambda run: plan_dp(query.sql + " " * (run % 64), analyst, policy,
                                               DPParams(0.5, 1e-7)), args.runs)
        checks.append((low, middle))
        print(f"{query.id} dp{'':<12} {len(plan.sql):>9} {low:>10.3f} {middle:>10.3f} {planned:>13.3f}")
    lows, middles = [low for low, _ in checks], [middle for _, middle in checks]
    print(f"over {len(checks)} generated statements: check min: median {statistics.median(lows):.3f} ms, "
          f"max {max(lows):.3f} ms; check p50: median {statistics.median(middles):.3f} ms, "
          f"max {max(middles):.3f} ms")


if __name__ == "__main__":
    main()
