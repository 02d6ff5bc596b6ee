#!/usr/bin/env python3
"""Daily and hourly dp series over one year of the demo's dated table, with and without visited_at's time bounds.

A throwaway PostgreSQL set up like ``anonproxy up`` (adult, visits, demo roles, service role, demo policy) and
``anonproxy serve`` with a service login (the suppress benchmark's helpers, as run.py uses them). The demo analyst
(accuracy ε 0.5 and δ 1e-7 per query, zCDP accounting) gets a budget large enough for the run and asks, through the
proxy, count(*) and sum(amount) by day and by hour of 2025 (``where visited_at >= '2025-01-01' and visited_at <
'2026-01-01'``), --repeat times each (the answer cache cleared before each: a new noise draw each time):

* **after**: visited_at with the demo's time bounds (2025-01-01 .. 2026-12-31 23:59:59 UTC): a public time domain;
* **before**: the same questions once the owner cleared the bounds (set_time_bounds(..., null, null)): each bucket
  must pass partition selection.

Per series: the share of the year's buckets released (the truth has a visit in every day and nearly every hour) and
the median relative error |noisy − true| / max(|true|, 1) over the released buckets, against the plain SQL's answer
(so it includes the contribution bounds' effect: at the demo's settings one group per person, one row in it).
--groups and --rows declare other contribution bounds for the analyst (anonproxy.set_contribution_bounds: at most g
groups per person, c rows per person in each); --after-only skips the run without time bounds. Prints a markdown
table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import demo_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ROLE, _timed, _wait_for_dp_gate, progress, suppress  # noqa: E402

YEAR = "where visited_at >= '2025-01-01 00:00+00' and visited_at < '2026-01-01 00:00+00'"
SERIES = {
    "daily count": f"select date_trunc('day', visited_at), count(*) from visits {YEAR} group by 1",
    "daily sum(amount)": f"select date_trunc('day', visited_at), sum(amount) from visits {YEAR} group by 1",
    "hourly count": f"select date_trunc('hour', visited_at), count(*) from visits {YEAR} group by 1",
    "hourly sum(amount)": f"select date_trunc('hour', visited_at), sum(amount) from visits {YEAR} group by 1",
}
BUCKETS = {"daily": 365, "hourly": 365 * 24}
BOUNDS = "'2025-01-01 00:00:00+00', '2026-12-31 23:59:59+00'"


def measure(client: psycopg.Connection[Any], admin: psycopg.Connection[Any], repeat: int,
            truth: dict[str, dict[Any, float]]) -> dict[str, dict[str, Any]]:
    figures = {}
    for name, sql in SERIES.items():
        released, errors = [], []
        for _ in range(repeat):
            admin.execute("delete from anonproxy.answer_cache where role_name = %s", (ROLE,))
            _, rows = _timed(client, sql)
            if isinstance(rows, str):
                raise SystemExit(f"{name}: refused: {rows}")
            answer = {row[0]: row[1] for row in rows if row[1] is not None}
            buckets = BUCKETS[name.split()[0]]
            released.append(len(answer) / buckets)
            errors += [abs(float(value) - truth[name].get(key, 0.0)) / max(abs(truth[name].get(key, 0.0)), 1.0)
                       for key, value in answer.items()]
        figures[name] = {"released": statistics.fmean(released),
                         "median_relative_error": statistics.median(errors) if errors else None}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--groups", type=int, default=1, help="max_groups_per_person of the analyst (default 1)")
    parser.add_argument("--rows", type=int, default=1,
                        help="max_rows_per_person_and_group of the analyst (default 1)")
    parser.add_argument("--after-only", action="store_true", help="only the run with the time bounds declared")
    args = parser.parse_args()
    policy = demo_policy()
    with ExitStack() as stack:
        progress("starting PostgreSQL, loading adult and visits, the demo policy")
        server = stack.enter_context(EmbeddedPostgres())
        password = suppress._prepare_database(server, policy)
        admin = stack.enter_context(psycopg.connect(server.conninfo(dbname=suppress.DATABASE), autocommit=True))
        admin.execute("set timezone = 'UTC'")
        admin.execute("select anonproxy.set_budget(%s::name, 'public.adult'::regclass, 1000000, 0.5, null, 0.5, "
                      "0.0000001)", (ROLE,))
        admin.execute("select anonproxy.set_contribution_bounds(%s::name, 'public.adult'::regclass, %s, %s)",
                      (ROLE, args.groups, args.rows))
        truth = {name: {row[0]: float(row[1]) for row in admin.execute(sql)} for name, sql in SERIES.items()}
        service_dsn = psycopg.conninfo.make_conninfo(user=policy.service_role, password=password,
                                                     dbname=suppress.DATABASE)
        proxy = stack.enter_context(suppress.GatedProxy(server.port, service_dsn))
        client = stack.enter_context(_wait_for_dp_gate(proxy.port))
        client.execute("set timezone = 'UTC'")
        progress(f"after: time bounds declared, contribution bounds g = {args.groups}, c = {args.rows}; "
                 f"{args.repeat} repetitions of {len(SERIES)} series")
        after = measure(client, admin, args.repeat, truth)
        if args.after_only:
            _print({"after": after}, args)
            return 0
        admin.execute("select anonproxy.set_time_bounds('public.visits', 'visited_at', null, null)")
        version = admin.execute("select version from anonproxy.policy_version").fetchone()[0]
        while int(client.execute("show anonproxy.policy_version").fetchone()[0]) < version:
            time.sleep(0.1)
        progress("before: no time bounds")
        before = measure(client, admin, args.repeat, truth)
        admin.execute(f"select anonproxy.set_time_bounds('public.visits', 'visited_at', {BOUNDS})")
    _print({"before": before, "after": after}, args)
    return 0


def _print(runs: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """The markdown table of ``runs`` (before and after, or after alone), and the JSON file if asked."""
    print(f"contribution bounds: g = {args.groups}, c = {args.rows}")
    print("| series (2025) | buckets | " + " | ".join(f"released {run}" for run in runs) + " | "
          + " | ".join(f"median rel. error {run}" for run in runs) + " |")
    print("|---|---|" + "---|" * (2 * len(runs)))
    for name in SERIES:
        print(f"| {name} | {BUCKETS[name.split()[0]]} | "
              + " | ".join(f"{run[name]['released']:.2%}" for run in runs.values()) + " | "
              + " | ".join(_error(run[name]["median_relative_error"]) for run in runs.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "groups": args.groups, "rows": args.rows, **runs},
                                        indent=2))


def _error(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
