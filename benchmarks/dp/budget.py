#!/usr/bin/env python3
"""How far a dp budget goes, and how honest the accuracy it states is: one tree, or two side by side.

    PYTHONPATH=. python3 benchmarks/dp/budget.py [--tree DIR | --tree-rev REV] [--against REV]
                                                  [--draws-error 200] [--draws-coverage 400] [--json FILE]

Three measurements per tree (README.md, "Budget, optimum, coverage"):

a. **queries per budget**: the 64 queries of bi_workload.py, planned by the tree's own planner
   (``plan_dp`` with the policy the proxy loads), their cost read off each plan (basic ε, δ; and ρ, δ_add when
   the tree's DPPlan has them), then counted through the demo budget ε 10 / δ 1e-5 in order, cycling, under
   the ledger's rule; with each plan's per-statistic noise sd, so that "more answers" is checked to be at equal
   accuracy;
b. **error against the optimum**: the empirical sd of the released count of ``count(*), avg(age) GROUP BY
   marital_status`` over fresh draws through the real proxy, next to the sd of the cheapest mechanism that
   measures the count with the answer's two statistics;
c. **interval coverage**: how often the stated 95 % interval (the notice, and ``dp_interval_low/high`` when the
   tree has them) covers the truth, for counts, sums, averages (small groups included) and counts released
   through partition selection near the threshold.

``--against REV`` measures a second tree, a ``git worktree`` of REV in a temporary directory, in the same run
(one after the other on the same machine), and prints both with the ratios. Each tree is measured by a child
process of this script with ``PYTHONPATH`` and the working directory set to that tree, so its planner, its
SQL schema and its proxy are the ones measured (this script only reads what they return).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from bi_workload import BI_QUERIES

ROLE = "analyst"
EPSILON_Q, DELTA_Q = 0.5, 1e-7  # the demo analyst's per-query cost
BUDGET_E, BUDGET_D = 10.0, 1e-5  # the demo analyst's budget
TOLERANCE = 1e-12  # float sums of exact decimal costs
CONFIDENCE = 0.95
# b: a count next to an average over a key with a public domain (one group per person: reach 1)
ERROR_SQL = "SELECT marital_status, count(*) AS n, avg(age) AS mean FROM public.adult GROUP BY marital_status"
ERROR_MIN_GROUP = 100  # groups this small are left out of the sd (a count is clamped at 0)
# c: (kind, SQL, the column checked, the column holding avg's noisy count or None)
COVERAGE: tuple[tuple[str, str, str, str | None], ...] = (
    ("count", "SELECT education, count(*) AS n FROM public.adult GROUP BY education", "n", None),
    ("sum", "SELECT race, sum(hours_per_week) AS total FROM public.adult GROUP BY race", "total", None),
    ("avg", "SELECT native_country, count(age) AS n, avg(age) AS mean FROM public.adult GROUP BY native_country",
     "mean", "n"),
    ("count near threshold", "SELECT age, count(*) AS n FROM public.adult GROUP BY age", "n", None),
)
NEAR_KIND = COVERAGE[-1][0]
SMALL_GROUP = 100  # avg: "small" groups have fewer people than this
NEAR = 2.0  # near the threshold τ: a true count in [1, NEAR·τ]


# ---------------------------------------------------------------------------------------------------------------
# the parent: trees, children, the comparison


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--tree", type=Path, default=REPO, help="the tree measured as 'after' (default: this one)")
    where.add_argument("--tree-rev", help="measure a git worktree of this revision as 'after' instead")
    parser.add_argument("--against", help="a git revision measured as 'today', side by side (e.g. 3b13a8c)")
    parser.add_argument("--draws-error", type=int, default=400, help="fresh draws for b (default 400)")
    parser.add_argument("--draws-coverage", type=int, default=1000,
                        help="fresh draws per query for c (default 1000)")
    parser.add_argument("--draws-threshold", type=int, default=400,
                        help="fresh draws of c's partition-selection query (default 400; the slowest statement)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: measure the tree on sys.path
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)  # internal: today's figures, for a
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker(args)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        trees: list[tuple[str, Path, str]] = []  # (label, directory, revision)
        worktrees: list[Path] = []
        try:
            if args.against:
                trees.append(("today", _worktree(args.against, Path(tmp) / "against", worktrees), args.against))
            if args.tree_rev:
                trees.append(("after", _worktree(args.tree_rev, Path(tmp) / "tree", worktrees), args.tree_rev))
            else:
                trees.append(("after", args.tree.resolve(), _describe(args.tree.resolve())))
            sides = {label: _measure(label, directory, revision, args, Path(tmp))
                     for label, directory, revision in trees}
        finally:
            for path in worktrees:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
    report = _compare(sides, args)
    report["started_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))
    report["seconds"] = round(time.time() - started, 1)
    report["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average": os.getloadavg()}
    _print(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0


def _worktree(revision: str, path: Path, made: list[Path]) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision], check=True,
                   stdout=subprocess.DEVNULL)
    made.append(path)
    return path


def _describe(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def _measure(label: str, tree: Path, revision: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{label}.json"
    reference = tmp / "today.json"
    print(f"[{time.strftime('%H:%M:%S')}] measuring {label}: {tree} ({revision})", file=sys.stderr, flush=True)
    # The tree's own anonproxy package and proxy; no .pyc written into it (it may be another engineer's checkout).
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), "--tree", str(tree),
               "--draws-error", str(args.draws_error), "--draws-coverage", str(args.draws_coverage),
               "--draws-threshold", str(args.draws_threshold)]
    if label == "after" and reference.exists():
        command += ["--reference", str(reference)]
    subprocess.run(command, env=env, cwd=tree, check=True)
    side = json.loads(out.read_text())
    side["revision"] = revision
    side["tree"] = str(tree)
    return side


# ---------------------------------------------------------------------------------------------------------------
# a. queries per budget: the ledger's rules


def rho_max(epsilon: float, delta: float) -> float:
    """The largest ρ whose Bun–Steinke conversion ρ + 2√(ρ·ln(1/δ)) is at most ε."""
    log = math.log(1 / delta)
    return (math.sqrt(epsilon + log) - math.sqrt(log)) ** 2


def zcdp_epsilon(rho: float, delta: float) -> float:
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def fits(costs: list[dict[str, float]], accounting: str, epsilon: float = BUDGET_E, delta: float = BUDGET_D,
         cap: int = 100_000) -> int:
    """How many queries, asked in order and cycling, the budget allows before its first refusal."""
    if not costs:
        return 0
    spent = {"epsilon": 0.0, "delta": 0.0, "rho": 0.0, "delta_add": 0.0}
    for n in range(cap):
        cost = costs[n % len(costs)]
        after = {name: spent[name] + cost[name] for name in spent}
        if accounting == "basic":
            allowed = after["epsilon"] <= epsilon + TOLERANCE and after["delta"] <= delta + TOLERANCE
        else:
            allowed = after["delta_add"] < delta and after["rho"] <= rho_max(epsilon, delta - after["delta_add"]) \
                + TOLERANCE
        if not allowed:
            return n
        spent = after
    return cap


def pass_epsilon(costs: list[dict[str, float]], accounting: str) -> float:
    """The ε one pass over the workload shows as spent (basic: Σε; zcdp: the conversion at D − Σδ_add)."""
    if accounting == "basic":
        return sum(c["epsilon"] for c in costs)
    left = BUDGET_D - sum(c["delta_add"] for c in costs)
    return zcdp_epsilon(sum(c["rho"] for c in costs), left) if left > 0 else math.inf


def _budget_side(side: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for accounting, plans in side["plans"].items():
        answered = [p for p in plans if p["refused"] is None]
        costs = [{"epsilon": p["epsilon"], "delta": p["delta"], "rho": p.get("rho", p["epsilon"] ** 2 / 2),
                  "delta_add": p.get("delta_add", p["delta"])} for p in answered]
        rule = "basic" if accounting == "basic" else "zcdp"
        out[accounting] = {
            "rule": rule, "answered": len(answered), "refused": [p["id"] for p in plans if p["refused"]],
            "queries_within_budget": fits(costs, rule),
            "pass_epsilon": pass_epsilon(costs, rule),
            "pass_rho": sum(c["rho"] for c in costs), "pass_delta": sum(c["delta"] for c in costs),
            "pass_delta_add": sum(c["delta_add"] for c in costs),
        }
    return out


def _sd_ratios(today: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per query: after's noise sd over today's, for each statistic an output column reads (by position)."""
    rows = []
    for old, new in zip(today, after, strict=True):
        if old["refused"] or new["refused"]:
            rows.append({"id": old["id"], "ratios": [], "note": "refused"})
            continue
        # The statistics both plans measure (what, argument, centre, power), after's sd over today's.
        common = [k for k in new["statistic_sds"] if k in old["statistic_sds"]]
        ratios = [new["statistic_sds"][k] / old["statistic_sds"][k] for k in common
                  if old["statistic_sds"][k] and new["statistic_sds"][k]]
        rows.append({"id": old["id"], "ratios": ratios, "min": min(ratios, default=None),
                     "max": max(ratios, default=None), "statistics_today": old["statistics"],
                     "statistics_after": new["statistics"]})
    return rows


def _measures(stat: Any) -> str:
    """What a statistic measures, the same in both trees whatever its SQL column is called."""
    return f"{stat.kind}:{stat.argument or ''}:{stat.center}:{stat.power}"


# ---------------------------------------------------------------------------------------------------------------
# b, c: figures from the draws


def discrete_laplace_sd(scale: float) -> float:
    alpha = math.exp(-1 / scale)
    return math.sqrt(2 * alpha) / (1 - alpha)


def _error_side(side: dict[str, Any]) -> dict[str, Any]:
    e = side["error"]
    errors = [d for draw in e["draws"] for d in draw]
    empirical = math.sqrt(statistics.fmean(d * d for d in errors)) if errors else math.nan
    # The optimum: the answer needs two statistics (the count, shared as avg's denominator, and avg's centred
    # sum); the count's share ε_q/2, sensitivity reach·c = 1, the cheapest mechanism at that share and the
    # accuracy contract's sd: discrete Laplace t = 1/(ε_q/2).
    optimum = discrete_laplace_sd(1 / (EPSILON_Q / 2))
    return {"draws": len(e["draws"]), "errors": len(errors), "empirical_sd": empirical,
            "mean_error": statistics.fmean(errors) if errors else math.nan, "optimum_sd": optimum,
            "ratio": empirical / optimum, "stated_sd": e["stated_sd"], "statistics": e["statistics"]}


def _coverage_side(side: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for kind, data in side["coverage"].items():
        entry: dict[str, Any] = {"draws": data["draws"], "threshold": data.get("threshold"),
                                 "ms_per_draw": data.get("ms_per_draw")}
        for source in ("notice", "sql"):
            hits = data[source]
            entry[source] = None if hits is None else {
                "events": len(hits), "covered": (sum(hits) / len(hits)) if hits else None}
        if kind == "avg":
            small = data["notice_small"]
            entry["notice_small"] = {"events": len(small), "covered": sum(small) / len(small) if small else None}
            small_sql = data.get("sql_small")
            entry["sql_small"] = None if small_sql is None else {
                "events": len(small_sql), "covered": sum(small_sql) / len(small_sql) if small_sql else None}
        if "bias" in data:
            entry["released"] = len(data["bias"])
            entry["chances"] = data["chances"]
            entry["mean_bias"] = statistics.fmean(data["bias"]) if data["bias"] else None
            under = [b for b, low in zip(data["bias"], data["below"], strict=True) if low]
            over = [b for b, low in zip(data["bias"], data["below"], strict=True) if not low]
            entry["released_below_threshold"] = len(under)
            entry["mean_bias_below_threshold"] = statistics.fmean(under) if under else None
            entry["mean_bias_from_threshold"] = statistics.fmean(over) if over else None
            for source in ("notice", "sql"):
                hits = data[source]
                if hits:
                    low_hits = [h for h, low in zip(hits, data["below"], strict=True) if low]
                    entry[f"{source}_below_threshold"] = sum(low_hits) / len(low_hits) if low_hits else None
        out[kind] = entry
    return out


def _compare(sides: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"workload": len(BI_QUERIES), "budget": {"epsilon": BUDGET_E, "delta": BUDGET_D},
                              "per_query": {"epsilon": EPSILON_Q, "delta": DELTA_Q},
                              "draws_error": args.draws_error, "draws_coverage": args.draws_coverage,
                              "draws_threshold": args.draws_threshold, "sides": {}}
    for label, side in sides.items():
        report["sides"][label] = {"revision": side["revision"], "tree": side["tree"], "has_rho": side["has_rho"],
                                  "has_intervals": side["has_intervals"], "budget_accounting": side["accounting"],
                                  "budget": _budget_side(side), "error": _error_side(side),
                                  "coverage": _coverage_side(side), "plans": side["plans"],
                                  "seconds": side["seconds"]}
    if "today" in sides:
        today, after = sides["today"], sides["after"]
        t = report["sides"]["today"]["budget"]["basic"]["queries_within_budget"]
        report["comparison"] = {"queries_today": t}
        for variant in ("basic", "zcdp", "zcdp_equal_sd"):
            if variant not in after["plans"]:
                continue
            a = report["sides"]["after"]["budget"][variant]["queries_within_budget"]
            ratios = _sd_ratios(today["plans"]["basic"], after["plans"][variant])
            every = [r for row in ratios for r in row["ratios"]]
            report["comparison"][variant] = {
                "queries_after": a, "ratio": a / t if t else None,
                "sd_ratio_min": min(every, default=None), "sd_ratio_max": max(every, default=None),
                "queries_sd_equal": sum(1 for row in ratios if row["ratios"] and
                                        all(abs(r - 1) < 0.01 for r in row["ratios"])),
                "queries_sd_lower": [row["id"] for row in ratios if row["ratios"] and max(row["ratios"]) < 0.99],
                "queries_sd_higher": [row["id"] for row in ratios if row["ratios"] and max(row["ratios"]) > 1.01],
                "sd_ratios": ratios,
            }
        # The target's figure: at equal per-statistic sd when the tree can plan it, else at the same ε per query.
        target = next((v for v in ("zcdp_equal_sd", "zcdp", "basic") if v in report["comparison"]), None)
        report["comparison"]["target_variant"] = target
    return report


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _print(report: dict[str, Any]) -> None:
    print()
    print(f"workload: {report['workload']} BI queries (bi_workload.py); budget ε {report['budget']['epsilon']:g} / "
          f"δ {report['budget']['delta']:g}; per query ε {report['per_query']['epsilon']:g} / "
          f"δ {report['per_query']['delta']:g}")
    for label, side in report["sides"].items():
        print(f"\n== {label}: {side['revision']} ({side['tree']}); DPPlan.rho: {side['has_rho']}; "
              f"dp_interval_low/high: {side['has_intervals']}; the proxy budget's accounting: "
              f"{side['budget_accounting']}; {side['seconds']} s")
        for accounting, b in side["budget"].items():
            print(f"a. planned as {accounting:<5}: {b['answered']}/{report['workload']} planned "
                  f"(refused: {', '.join(b['refused']) or 'none'}); queries within the budget "
                  f"({b['rule']} rule): {b['queries_within_budget']}; one pass: ε {_fmt(b['pass_epsilon'], '.2f')}, "
                  f"Σρ {_fmt(b['pass_rho'], '.4f')}, Σδ {b['pass_delta']:.3g}, Σδ_add {b['pass_delta_add']:.3g}")
        e = side["error"]
        print(f"b. {ERROR_SQL}: released count over {e['draws']} draws ({e['errors']} group draws): empirical sd "
              f"{_fmt(e['empirical_sd'])}, mean error {_fmt(e['mean_error'], '+.3f')}, stated sd "
              f"{_fmt(e['stated_sd'])}; optimum sd {_fmt(e['optimum_sd'])}; ratio {_fmt(e['ratio'], '.3f')} "
              f"(target <= 1.1)")
        for kind, c in side["coverage"].items():
            parts = [f"c. {kind:<20} {c['draws']} draws ({_fmt(c['ms_per_draw'], '.0f')} ms each)"]
            for source in ("notice", "sql"):
                s = c[source]
                parts.append(f"{source}: " + ("n/a" if s is None or s["covered"] is None else
                                             f"{s['covered']:.4f} of {s['events']}"))
            if kind == "avg":
                for source in ("notice_small", "sql_small"):
                    s = c.get(source)
                    parts.append(f"{source} (n < {SMALL_GROUP}): " + (
                        "n/a" if s is None or s["covered"] is None else f"{s['covered']:.4f} of {s['events']}"))
            if "released" in c:
                parts.append(f"τ {c['threshold']}, released {c['released']} of {c['chances']} draws of groups of "
                             f"1..{NEAR:g}τ people, mean bias {_fmt(c['mean_bias'], '+.2f')}; of groups under τ: "
                             f"{c['released_below_threshold']} released, mean bias "
                             f"{_fmt(c['mean_bias_below_threshold'], '+.2f')}, covered (notice) "
                             f"{_fmt(c.get('notice_below_threshold'))}, (sql) {_fmt(c.get('sql_below_threshold'))}; "
                             f"groups of τ..{NEAR:g}τ: mean bias {_fmt(c['mean_bias_from_threshold'], '+.2f')}")
            print("; ".join(parts))
    comparison = report.get("comparison")
    if not comparison:
        return
    print(f"\nqueries within ε {report['budget']['epsilon']:g} / δ {report['budget']['delta']:g}, today (basic): "
          f"{comparison['queries_today']}")
    names = {"basic": "after, basic accounting, same ε per query",
             "zcdp": "after, zcdp, same ε per query (the proxy's default)",
             "zcdp_equal_sd": "after, zcdp, at today's per-statistic sd"}
    for variant, name in names.items():
        c = comparison.get(variant)
        if c is None:
            continue
        mark = " (target >= 1.5)" if variant == comparison["target_variant"] else ""
        print(f"  {name}: {c['queries_after']}: {_fmt(c['ratio'], '.2f')}x{mark}; per-statistic sd after/today "
              f"{_fmt(c['sd_ratio_min'], '.4f')} .. {_fmt(c['sd_ratio_max'], '.4f')}, equal (±1 %) in "
              f"{c['queries_sd_equal']} queries, lower in {len(c['queries_sd_lower'])} "
              f"({', '.join(c['queries_sd_lower']) or '-'}), higher in "
              f"{', '.join(c['queries_sd_higher']) or 'none'}")


# ---------------------------------------------------------------------------------------------------------------
# the child: one tree, on sys.path (PYTHONPATH) and as the working directory


@dataclass
class _Notices:
    lines: list[str] = field(default_factory=list)

    def __call__(self, diagnostic: Any) -> None:
        self.lines.append(diagnostic.message_primary or "")
        self.lines.extend((diagnostic.message_detail or "").splitlines())


def _worker(args: argparse.Namespace) -> int:
    import dataclasses

    import psycopg
    import run as dp_run  # this directory's run.py: the suppress benchmark's database and proxy helpers

    from anonproxy.dp import ledger
    from anonproxy.dp.model import DPParams, DPPlan
    from anonproxy.dp.plan import plan_dp
    from anonproxy.embedded import EmbeddedPostgres
    from anonproxy.policy.store import load_policy
    from anonproxy.policy.yaml_policy import demo_policy

    suppress = dp_run.suppress
    tree = args.tree.resolve()
    started = time.monotonic()
    has_rho = "rho" in {f.name for f in dataclasses.fields(DPPlan)}
    has_accounting = "accounting" in {f.name for f in dataclasses.fields(DPParams)}
    progress = suppress.progress

    class TreeProxy(suppress.GatedProxy):  # type: ignore[misc, name-defined]
        """``anonproxy serve`` started in the measured tree (``python -m`` puts its working directory first)."""

        def _start(self, command: list[str], env: dict[str, str] | None = None, cwd: Path | str = "/") -> None:
            super()._start(command, env=env, cwd=tree)

    def params(accounting: str) -> Any:
        return DPParams(EPSILON_Q, DELTA_Q, accounting=accounting) if has_accounting else DPParams(EPSILON_Q, DELTA_Q)

    def sd(stat: Any) -> float | None:
        noise = stat.noise()
        return None if noise is None else noise.stddev

    def describe(plan: Any) -> dict[str, Any]:
        by_name = {s.name: s for s in plan.statistics}
        columns = []
        for column in plan.columns:
            entry = {}
            for role in ("statistic", "denominator"):
                name = getattr(column, role, None)
                if name is not None and name in by_name and by_name[name].kind != "values":
                    entry[role] = sd(by_name[name])
            columns.append(entry)
        out = {"epsilon": float(plan.epsilon), "delta": float(plan.delta), "threshold": plan.threshold,
               "statistics": [f"{s.kind}:{s.argument or ''}" for s in plan.statistics], "column_sds": columns,
               "statistic_sds": {_measures(s): sd(s) for s in plan.statistics if s.kind != "values"},
               "refused": None}
        if has_rho:
            out |= {"rho": float(plan.rho), "delta_add": float(plan.delta_add)}
        return out

    with EmbeddedPostgres() as server:
        progress(f"[{tree.name}] installing the schema, adult, the demo roles and policy")
        demo = demo_policy()
        password = suppress._prepare_database(server, demo)
        with psycopg.connect(server.conninfo(dbname=suppress.DATABASE), autocommit=True) as admin:
            policy = load_policy(admin)  # as the proxy loads it: with the column types derived keys need
            role = policy.role(ROLE)

            # a. every query planned as the proxy would, under each accounting the tree knows
            plans: dict[str, list[dict[str, Any]]] = {}
            for accounting in (("basic", "zcdp") if has_accounting else ("basic",)):
                rows = []
                for query in BI_QUERIES:
                    plan = plan_dp(query.sql, role, policy, params(accounting))
                    if isinstance(plan, DPPlan):
                        rows.append({"id": query.id} | describe(plan))
                    else:
                        rows.append({"id": query.id, "refused": f"{plan.sqlstate}: {plan.message}"})
                plans[accounting] = rows
            if has_accounting and args.reference is not None:
                # zcdp at today's per-statistic sd: each query at ε_q·m_after/m_today (m: its noisy statistics),
                # so that each statistic gets the share ε_q/m_today it gets today (sd ∝ 1/share).
                today = {p["id"]: p for p in json.loads(args.reference.read_text())["plans"]["basic"]}
                rows = []
                for query, own in zip(BI_QUERIES, plans["zcdp"], strict=True):
                    old = today[query.id]
                    if own["refused"] or old["refused"]:
                        rows.append({"id": query.id, "refused": own["refused"] or old["refused"]})
                        continue
                    share = EPSILON_Q * len(own["statistic_sds"]) / len(old["statistic_sds"])
                    plan = plan_dp(query.sql, role, policy, DPParams(share, DELTA_Q, accounting="zcdp"))
                    rows.append({"id": query.id, "epsilon_q": share} | describe(plan))
                plans["zcdp_equal_sd"] = rows

            # the proxy's budget: large enough for every draw, per query the demo's; zcdp when the tree has it
            arguments = admin.execute("select proargnames from pg_proc where proname = 'set_budget' and "
                                      "pronamespace = 'anonproxy'::regnamespace").fetchall()
            named = any(row[0] and "accounting" in row[0] for row in arguments)
            extra = ", accounting => 'zcdp'" if named else ""
            admin.execute(f"select anonproxy.set_budget(%s::name, 'public.adult'::regclass, 1000000, 0.5, null, "
                          f"%s::numeric, %s::numeric{extra})", (ROLE, str(EPSILON_Q), str(DELTA_Q)))
            # Without the named argument the ledger picks its default rule (zcdp iff it affords more
            # one-statistic answers at the per-query ε), which is what the proxy's plans then use.
            default = "zcdp" if rho_max(1_000_000, 0.5) / (EPSILON_Q ** 2 / 4) > 1_000_000 / EPSILON_Q else "basic"
            # The proxy plans with its budget's accounting once the ledger reports it (ledger.Remaining.accounting).
            ledger_knows = "accounting" in {f.name for f in dataclasses.fields(ledger.Remaining)}
            accounting_used = ("zcdp" if named else default) if has_accounting and ledger_knows else "basic"
            service_dsn = psycopg.conninfo.make_conninfo(user=policy.service_role, password=password,
                                                         dbname=suppress.DATABASE)
            with TreeProxy(server.port, service_dsn) as proxy, dp_run._wait_for_dp_gate(proxy.port) as client:
                notices = _Notices()
                client.add_notice_handler(notices)

                def fresh(sql: str) -> list[tuple[Any, ...]]:
                    """A new draw: analyst's cached answers deleted first (as the owner), then the question."""
                    admin.execute("delete from anonproxy.answer_cache where role_name = %s", (ROLE,))
                    notices.lines.clear()
                    return client.execute(sql, prepare=False).fetchall()

                budget_plan = plan_dp(ERROR_SQL, role, policy, params(accounting_used))
                error = _draw_error(admin, fresh, budget_plan, args.draws_error, progress)
                intervals = _has_intervals(fresh)
                coverage = {}
                for kind, sql, column, count_column in COVERAGE:
                    plan = plan_dp(sql, role, policy, params(accounting_used))
                    coverage[kind] = _draw_coverage(admin, fresh, notices, kind, sql, column, count_column,
                                                    getattr(plan, "threshold", None), intervals,
                                                    args.draws_threshold if kind == NEAR_KIND else
                                                    args.draws_coverage, progress)
    args.worker.write_text(json.dumps({
        "has_rho": has_rho, "has_accounting": has_accounting, "has_intervals": intervals,
        "accounting": accounting_used, "plans": plans, "error": error, "coverage": coverage,
        "seconds": round(time.monotonic() - started, 1)}, default=str))
    return 0


def _draw_error(admin: Any, fresh: Any, plan: Any, draws: int, progress: Any) -> dict[str, Any]:
    truth = {row[0]: row[1] for row in admin.execute(ERROR_SQL)}
    stated = None
    statistics_used: list[str] = []
    if hasattr(plan, "columns"):
        by_name = {s.name: s for s in plan.statistics}
        count_column = plan.columns[1]
        noise = by_name[count_column.statistic].noise()
        stated = noise.stddev
        statistics_used = [f"{s.kind}:{s.argument or ''}" for s in plan.statistics]
    progress(f"b. {draws} draws of {ERROR_SQL}")
    out = []
    for _ in range(draws):
        rows = fresh(ERROR_SQL)
        out.append([int(n) - truth[key] for key, n, _mean in rows if truth.get(key, 0) >= ERROR_MIN_GROUP])
    return {"draws": out, "stated_sd": stated, "statistics": statistics_used}


def _has_intervals(fresh: Any) -> bool:
    import psycopg

    try:
        fresh("SELECT count(*) AS n, dp_interval_low(count(*)) AS lo, dp_interval_high(count(*)) AS hi "
              "FROM public.adult")
    except psycopg.Error:
        return False
    return True


_COUNT_LINE = re.compile(r"95% interval ±([0-9.eE+-]+)(?!\s*/)")
_RATIO_LINE = re.compile(r"95% interval ±([0-9.eE+-]+)/n")
# A per-row avg interval ±q/n, q in a stated range: the notice alone gives a row only the widest, q at a bound.
_RATIO_RANGE = re.compile(r"95% interval per row ±q/n .*?q from [0-9.eE+-]+ .*? to ([0-9.eE+-]+) \(at a bound\)")


def _stated(notices: list[str], column: str, ratio: bool) -> float | None:
    """The half-width (count, sum) or numerator A of ±A/n (avg) that the notice states for ``column``."""
    for line in notices:
        if line.startswith(f"{column}:"):
            found = (_RATIO_RANGE.search(line) or _RATIO_LINE.search(line)) if ratio else _COUNT_LINE.search(line)
            return float(found.group(1)) if found else None
    return None


def _draw_coverage(admin: Any, fresh: Any, notices: _Notices, kind: str, sql: str, column: str,
                   count_column: str | None, threshold: int | None, intervals: bool, draws: int,
                   progress: Any) -> dict[str, Any]:
    truth_rows = admin.execute(sql).fetchall()
    names = [d.name for d in admin.execute(sql).description]  # type: ignore[union-attr]
    at = names.index(column)
    truth = {row[0]: row[at] for row in truth_rows}
    sizes = {row[0]: row[names.index("n")] if "n" in names else None for row in truth_rows}
    asked = sql
    if intervals:  # the same statistics, the interval bounds read in SQL
        asked = sql.replace(" FROM ", f", dp_interval_low({column}) AS lo, dp_interval_high({column}) AS hi FROM ", 1)
    progress(f"c. {kind}: {draws} draws of {asked}")
    notice_hits: list[bool] = []
    notice_small: list[bool] = []
    sql_hits: list[bool] | None = [] if intervals else None
    sql_small: list[bool] | None = [] if intervals else None
    bias: list[float] = []
    below: list[bool] = []  # near the threshold: the released group's true count is below τ
    chances = 0
    near = kind == NEAR_KIND
    seconds = 0.0
    for _ in range(draws):
        start = time.perf_counter()
        rows = fresh(asked)
        seconds += time.perf_counter() - start
        got = {row[0]: row for row in rows}
        half = _stated(notices.lines, column, ratio=count_column is not None)
        for key, true in truth.items():
            if true is None:
                continue
            if near:
                if threshold is None or not 1 <= true <= NEAR * threshold:
                    continue
                chances += 1
            row = got.get(key)
            if row is None:
                continue
            value = float(row[at])
            if near:
                bias.append(value - float(true))
                below.append(true < threshold)  # type: ignore[operator]
            small = sizes.get(key) is not None and sizes[key] < SMALL_GROUP
            if half is not None:
                width = half / max(float(row[names.index(count_column)]), 1.0) if count_column else half
                hit = abs(value - float(true)) <= width + 1e-9 * max(abs(float(true)), 1.0)
                notice_hits.append(hit)
                if small:
                    notice_small.append(hit)
            if sql_hits is not None and sql_small is not None:
                hit = float(row[len(names)]) <= float(true) <= float(row[len(names) + 1])
                sql_hits.append(hit)
                if small:
                    sql_small.append(hit)
    out: dict[str, Any] = {"draws": draws, "threshold": threshold, "notice": notice_hits if notice_hits else None,
                           "sql": sql_hits, "ms_per_draw": 1000 * seconds / max(draws, 1)}
    if count_column is not None:
        out["notice_small"] = notice_small
        out["sql_small"] = sql_small
    if near:
        out["bias"] = bias
        out["below"] = below
        out["chances"] = chances
    return out


if __name__ == "__main__":
    sys.exit(main())
