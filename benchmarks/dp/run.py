#!/usr/bin/env python3
"""Accuracy and latency of anonproxy's dp mode, next to SmartNoise SQL, on the same workload.

A throwaway PostgreSQL set up like ``anonproxy up`` (adult, demo roles,
service role, demo policy) plus public.adult_region (keyed by the privacy
unit, for the two JOIN queries), and ``anonproxy serve`` with a service login.
``analyst`` (dp) gets a budget large enough for the whole run at ε 0.5 and
δ 1e-7 per query. Each query of dp_workload.py is asked --repeat times:

* through the proxy as analyst, once fresh (the answer cache of analyst is
  cleared, as the owner, before each repetition, so every repetition is a new
  noise draw and a new ledger charge: the "first-charge" path), then once more
  with the same text (the "seen" path: answered from the cache, no charge);
* directly as the superuser: the plain exact SQL (truth and latency
  reference) and the contribution-bounded SQL anonproxy runs (plan.sql).

SmartNoise SQL runs the same queries in its own venv (smartnoise_side.py)
over the same rows exported to CSV, at the same total ε and δ per query as
its own accountant counts them (and once more with ε and δ per measurement,
its nominal setting, for reference). Prints, per
query, median and p95 relative error of both, who answered, and the latency
anonproxy adds. See README.md for the error definition and the targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable
from anonproxy.policy.yaml_policy import demo_policy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dp_workload import QUERIES, REGION_POLICY_SQL, REGION_TABLE_SQL, Query

SUPPRESS_DIR = HERE.parent / "suppress"
# public.adult_region as REGION_POLICY_SQL declares it, for the plans run.py makes itself (the "bound" SQL).
REGION_LINK = LinkedTable("public.adult_region", "id", "public.adult", "id", {
    "region": ColumnPolicy("region", "quasi_identifier", domain=("North", "South", "East", "West")),
    "household_size": ColumnPolicy("household_size", "quasi_identifier", lower=1, upper=5),
})


def _load_suppress() -> ModuleType:
    """The suppress benchmark's run.py (proxy, connections, database set-up), with its own workload.py."""
    sys.path.insert(0, str(SUPPRESS_DIR))
    try:
        spec = importlib.util.spec_from_file_location("suppress_run", SUPPRESS_DIR / "run.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SUPPRESS_DIR))
    return module


suppress = _load_suppress()
BenchmarkError = suppress.BenchmarkError
percentile = suppress.percentile
progress = suppress.progress

ROLE = "analyst"
# The same questions through a second proxy whose audit trail is off, as a role of their own with the same budget
# (the answer cache is per role: one role would find the other proxy's answers already paid for).
ROLE_OFF = "analyst_trail_off"
EPSILON = 0.5
DELTA = 1e-7
DEFAULT_REPEAT = 50
SNSQL_PYTHON = Path("/tmp/snsql-venv/bin/python")
TARGET_ADDED_MS = 2.0
SERIES = ("first", "seen", "exact", "bounded", "first_off", "seen_off")  # *_off: through the proxy, trail off


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"runs per query (default {DEFAULT_REPEAT})")
    parser.add_argument("--snsql-python", type=Path, default=SNSQL_PYTHON, help="python of SmartNoise's venv")
    parser.add_argument("--json", type=Path, help="also write every answer, timing and the summary here")
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except (BenchmarkError, psycopg.Error) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    demo = demo_policy()
    policy = dataclasses.replace(demo, links={**demo.links, REGION_LINK.name: REGION_LINK})
    role = policy.role(ROLE)
    plans: dict[str, DPPlan | None] = {}
    for query in QUERIES:
        plan = plan_dp(query.sql, role, policy, DPParams(EPSILON, DELTA))
        plans[query.id] = plan if isinstance(plan, DPPlan) else None
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        progress("installing the schema, adult, the demo roles, the service role, the demo policy, adult_region")
        password = suppress._prepare_database(server, demo)
        admin = stack.enter_context(psycopg.connect(server.conninfo(dbname=suppress.DATABASE), autocommit=True))
        admin.execute(REGION_TABLE_SQL)
        admin.execute(REGION_POLICY_SQL)
        admin.execute(f"create role {ROLE_OFF} login password '{ROLE_OFF}'")
        admin.execute("select anonproxy.set_role_policy(%s, 'dp')", (ROLE_OFF,))
        # Basic accounting where the ledger has a choice: each answer is then (ε 0.5, δ 1e-7)-DP on its own, the
        # setting SmartNoise gets (under zcdp one answer's own ε is larger; zcdp pays off over many answers).
        names = admin.execute("select proargnames from pg_proc where proname = 'set_budget' "
                              "and pronamespace = 'anonproxy'::regnamespace").fetchall()
        accounting = ", accounting => 'basic'" if any(n[0] and "accounting" in n[0] for n in names) else ""
        for role_name in (ROLE, ROLE_OFF):
            admin.execute(f"select anonproxy.set_budget(%s::name, 'public.adult'::regclass, 1000000, 0.5, null, "
                          f"%s::numeric, %s::numeric{accounting})", (role_name, str(EPSILON), str(DELTA)))
        rows = admin.execute("select count(*) from public.adult").fetchone()[0]
        csv = Path(tmp) / "adult.csv"
        with csv.open("wb") as out, admin.cursor().copy("COPY public.adult TO STDOUT WITH (FORMAT csv, HEADER)") as cp:
            for chunk in cp:
                out.write(chunk)

        service_dsn = psycopg.conninfo.make_conninfo(user=policy.service_role, password=password,
                                                     dbname=suppress.DATABASE)
        proxy = stack.enter_context(suppress.GatedProxy(server.port, service_dsn))
        client = stack.enter_context(_wait_for_dp_gate(proxy.port))
        proxy_off = stack.enter_context(suppress.GatedProxy(server.port, service_dsn, audit_trail=False))
        client_off = stack.enter_context(_wait_for_dp_gate(proxy_off.port, ROLE_OFF))
        machine = suppress._machine(admin)
        progress(f"{proxy.name} on 127.0.0.1:{proxy.port}, {proxy_off.name} on 127.0.0.1:{proxy_off.port}; "
                 f"{rows} adult rows; machine: {machine}")

        truth = {q.id: admin.execute(q.sql, prepare=False).fetchall() for q in QUERIES}
        answers: dict[str, list[list[tuple[Any, ...]]]] = {q.id: [] for q in QUERIES}
        refusals: dict[str, str] = {}
        timings: dict[str, dict[str, list[float]]] = {q.id: {s: [] for s in SERIES} for q in QUERIES}
        for query in QUERIES:  # warm-up: every path once
            for text in (query.sql, query.sql):
                _timed(client, text)
                _timed(client_off, text)
            _timed(admin, query.sql)
        progress(f"anonproxy: {args.repeat} repetitions x {len(QUERIES)} queries")
        started = time.monotonic()
        cpu_before = {"on": proxy.cpu_seconds(), "off": proxy_off.cpu_seconds()}
        for n in range(args.repeat):
            admin.execute("delete from anonproxy.answer_cache where role_name in (%s, %s)", (ROLE, ROLE_OFF))
            for position, query in enumerate(QUERIES):
                # Trail on and off side by side, each going first every other time.
                sides = [("", client), ("_off", client_off)][::1 if (n + position) % 2 == 0 else -1]
                for suffix, conn in sides:
                    ms, result = _timed(conn, query.sql)
                    if isinstance(result, str):
                        refusals[query.id] = result
                        continue
                    if not suffix:
                        answers[query.id].append(result)
                    timings[query.id]["first" + suffix].append(ms)
                    ms, again = _timed(conn, query.sql)
                    if again != result:
                        raise BenchmarkError(f"{query.id}: the repeated query did not get the cached answer")
                    timings[query.id]["seen" + suffix].append(ms)
                if query.id in refusals:
                    continue
                timings[query.id]["exact"].append(_timed(admin, query.sql)[0])
                plan = plans[query.id]
                if plan is not None:
                    timings[query.id]["bounded"].append(_timed(admin, plan.sql)[0])
            if (n + 1) % 10 == 0:
                progress(f"  {n + 1}/{args.repeat}")
        anonproxy_seconds = time.monotonic() - started
        # Each proxy answered the same statements: its CPU time per statement, the trail's writer included.
        statements = 2 * sum(len(timings[q.id]["first"]) for q in QUERIES)
        proxy_cpu = {"on": proxy.cpu_seconds() - cpu_before["on"], "off": proxy_off.cpu_seconds() - cpu_before["off"]}
        proxy_cpu_ms = {side: 1000 * seconds / max(statements, 1) for side, seconds in proxy_cpu.items()}
        time.sleep(2)  # the trail-on proxy writes its buffer at least every second
        audit_rows = admin.execute("select count(*) from anonproxy.audit_trail").fetchone()[0]
        # After anonproxy's runs, not during them: the latencies above are measured on a quiet machine.
        smartnoise = _start_smartnoise(args, csv, Path(tmp) / "smartnoise.json", nominal=False)
        sn = _finish_smartnoise(smartnoise)
        nominal_state = _start_smartnoise(args, csv, Path(tmp) / "smartnoise-nominal.json", nominal=True)
        sn_nominal = _finish_smartnoise(nominal_state)
    results = [_query_result(q, truth[q.id], answers[q.id], refusals.get(q.id), timings[q.id], sn, sn_nominal)
               for q in QUERIES]
    summary = _summary(results, sn is not None) | {
        "proxy_cpu_ms_per_statement_trail_on": proxy_cpu_ms["on"],
        "proxy_cpu_ms_per_statement_trail_off": proxy_cpu_ms["off"],
        "audit_trail_rows_written": audit_rows,
    }
    _print_report(results, summary, args, sn)
    return {
        "settings": {"repeat": args.repeat, "epsilon_per_query": EPSILON, "delta_per_query": DELTA, "role": ROLE,
                     "rows": rows, "anonproxy_seconds": round(anonproxy_seconds, 1)},
        "machine": machine | {"smartnoise": None if sn is None else sn["versions"]},
        "smartnoise_error": smartnoise.get("error"),
        "summary": summary,
        "queries": results,
        "truth": {q.id: truth[q.id] for q in QUERIES},
    }


def _wait_for_dp_gate(port: int, role: str = ROLE) -> psycopg.Connection[Any]:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = suppress._connect(port, role, role)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        mode = conn.execute("SHOW anonproxy.mode", prepare=False).fetchone()
        if mode is None or mode[0] != "dp":
            raise BenchmarkError(f"the proxy puts {role} in mode {mode}, not dp")
        return conn


def _timed(conn: psycopg.Connection[Any], sql: str) -> tuple[float, list[tuple[Any, ...]] | str]:
    """(ms, rows), or (ms, the error message) when refused. One simple-protocol Query."""
    start = time.perf_counter_ns()
    try:
        with conn.cursor() as cur:
            cur.execute(sql, prepare=False)
            rows = cur.fetchall()
    except psycopg.Error as exc:
        return (time.perf_counter_ns() - start) / 1e6, f"{exc.sqlstate}: {str(exc).strip().splitlines()[0]}"
    return (time.perf_counter_ns() - start) / 1e6, rows


def _start_smartnoise(args: argparse.Namespace, csv: Path, out: Path, nominal: bool) -> dict[str, Any]:
    if not args.snsql_python.exists():
        return {"error": f"{args.snsql_python} not found (pip install smartnoise-sql in a venv there)"}
    command = [str(args.snsql_python), str(HERE / "smartnoise_side.py"), str(csv), str(out),
               "--repeat", str(args.repeat), "--epsilon", str(EPSILON), "--delta", str(DELTA)]
    command += ["--nominal"] if nominal else []
    progress(f"SmartNoise SQL, in its venv, after anonproxy ({'ε per measurement' if nominal else 'ε per query'})")
    return {"process": subprocess.Popen(command), "out": out}


def _finish_smartnoise(state: dict[str, Any]) -> dict[str, Any] | None:
    if "process" not in state:
        progress(f"no SmartNoise: {state['error']}")
        return None
    code = state["process"].wait()
    if code != 0:
        state["error"] = f"smartnoise_side.py exited with code {code}"
        progress(state["error"])
        return None
    return json.loads(state["out"].read_text())


def relative_error(truth: list[tuple[Any, ...]], answer: list[Sequence[Any]], keys: int) -> float:
    """Mean over (groups of the truth x aggregate columns) of |noisy - true| / max(|true|, 1); a missing group: 1.0."""
    got = {tuple(str(v) for v in row[:keys]): row[keys:] for row in answer}
    errors = []
    for row in truth:
        noisy = got.get(tuple(str(v) for v in row[:keys]))
        for j, true in enumerate(row[keys:]):
            if noisy is None or noisy[j] is None:
                errors.append(1.0)
            else:
                errors.append(abs(float(noisy[j]) - float(true)) / max(abs(float(true)), 1.0))
    return statistics.fmean(errors) if errors else 0.0


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p95": percentile(ordered, 0.95)}


def _query_result(query: Query, truth: list[tuple[Any, ...]], answers: list[list[tuple[Any, ...]]],
                  refusal: str | None, timings: dict[str, list[float]], sn: dict[str, Any] | None,
                  sn_nominal: dict[str, Any] | None) -> dict[str, Any]:
    ap_errors = [relative_error(truth, answer, query.keys) for answer in answers]
    sn_query = None if sn is None else sn["queries"][query.id]
    sn_errors = [] if sn_query is None else [relative_error(truth, answer, query.keys) for answer in sn_query["runs"]]
    nominal = None if sn_nominal is None else sn_nominal["queries"][query.id]
    nominal_errors = [] if nominal is None else [relative_error(truth, answer, query.keys)
                                                 for answer in nominal["runs"]]
    p50 = {s: statistics.median(v) for s, v in timings.items() if v}
    return {
        "id": query.id, "kind": query.kind, "sql": query.sql,
        "anonproxy": {"answered": not refusal and bool(answers), "refusal": refusal, "error": _stats(ap_errors),
                      "errors": ap_errors},
        "smartnoise": None if sn_query is None else {
            "answered": not sn_query["error"] and bool(sn_errors), "refusal": sn_query["error"],
            "error": _stats(sn_errors), "errors": sn_errors, "cost": sn_query.get("cost"),
            "ms_p50": statistics.median(sn_query["ms"]) if sn_query["ms"] else None},
        "smartnoise_nominal": None if nominal is None else {
            "answered": not nominal["error"] and bool(nominal_errors), "error": _stats(nominal_errors),
            "cost": nominal.get("cost")},
        "ms_p50": p50,
        "ms_p95": {s: percentile(sorted(v), 0.95) for s, v in timings.items() if v},
        "added_first_ms": p50["first"] - p50["exact"] if "first" in p50 else None,
        "added_seen_ms": p50["seen"] - p50["exact"] if "seen" in p50 else None,
        "first_minus_bounded_ms": p50["first"] - p50["bounded"] if "first" in p50 and "bounded" in p50 else None,
        "trail_cost_first_ms": p50["first"] - p50["first_off"] if "first_off" in p50 else None,
        "trail_cost_seen_ms": p50["seen"] - p50["seen_off"] if "seen_off" in p50 else None,
    }


def _summary(results: list[dict[str, Any]], with_sn: bool) -> dict[str, Any]:
    answered = [r for r in results if r["anonproxy"]["answered"]]
    both = [r for r in answered if with_sn and r["smartnoise"]["answered"]]
    better = [r for r in both if r["anonproxy"]["error"]["median"] <= r["smartnoise"]["error"]["median"]]
    seen = [r["added_seen_ms"] for r in answered]
    first = [r["added_first_ms"] for r in answered]
    over_bounded = [r["first_minus_bounded_ms"] for r in answered if r["first_minus_bounded_ms"] is not None]
    return {
        "anonproxy_answered": [r["id"] for r in answered],
        "anonproxy_refused": [r["id"] for r in results if not r["anonproxy"]["answered"]],
        "smartnoise_answered": [r["id"] for r in results if with_sn and r["smartnoise"]["answered"]],
        "both_answered": [r["id"] for r in both],
        "anonproxy_median_le_smartnoise": [r["id"] for r in better],
        "target_answers_all": len(answered) == len(results),
        "target_error": None if not with_sn else len(better) == len(both),
        "added_seen_ms_median_over_queries": statistics.median(seen) if seen else None,
        "added_seen_ms_max": max(seen) if seen else None,
        "added_first_ms_median_over_queries": statistics.median(first) if first else None,
        "added_first_ms_max": max(first) if first else None,
        "first_minus_bounded_ms_median_over_queries": statistics.median(over_bounded) if over_bounded else None,
        "trail_cost_first_ms_median_over_queries": _median([r["trail_cost_first_ms"] for r in answered]),
        "trail_cost_seen_ms_median_over_queries": _median([r["trail_cost_seen_ms"] for r in answered]),
        "target_added_seen": bool(seen) and max(seen) <= TARGET_ADDED_MS,
        "target_added_first": bool(first) and max(first) <= TARGET_ADDED_MS,
    }


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _print_report(results: list[dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace,
                  sn: dict[str, Any] | None) -> None:
    print()
    print(f"ε = {EPSILON} per query (δ = {DELTA:g}), {args.repeat} repetitions; relative error: median / p95")
    print(f"{'query':<5} {'kind':<24} {'anonproxy med':>13} {'p95':>8} {'SmartNoise med':>14} {'p95':>8} "
          f"{'SN/meas med':>11} {'SN cost':>7}  "
          f"{'first':>7} {'seen':>6} {'exact':>6} {'bound':>6} {'+first':>7} {'+seen':>6} {'SN ms':>6}")
    for r in results:
        ap, snr, nominal = r["anonproxy"], r["smartnoise"], r.get("smartnoise_nominal")
        ape = ap["error"] or {}
        sne = (snr or {}).get("error") or {}
        ap_med = _fmt(ape.get("median")) if ap["answered"] else "refused"
        sn_med = "n/a" if snr is None else (_fmt(sne.get("median")) if snr["answered"] else "refused")
        nominal_med = "n/a" if nominal is None else (
            _fmt((nominal["error"] or {}).get("median")) if nominal["answered"] else "refused")
        nominal_cost = "-" if nominal is None or not nominal["cost"] else f"{nominal['cost'][0]:g}"
        ms = r["ms_p50"]
        print(f"{r['id']:<5} {r['kind'][:24]:<24} {ap_med:>13} {_fmt(ape.get('p95')):>8} {sn_med:>14} "
              f"{_fmt(sne.get('p95')):>8} {nominal_med:>11} {nominal_cost:>7}  "
              f"{_fmt(ms.get('first'), '.2f'):>7} {_fmt(ms.get('seen'), '.2f'):>6} "
              f"{_fmt(ms.get('exact'), '.2f'):>6} {_fmt(ms.get('bounded'), '.2f'):>6} "
              f"{_fmt(r['added_first_ms'], '.2f'):>7} {_fmt(r['added_seen_ms'], '.2f'):>6} "
              f"{_fmt((snr or {}).get('ms_p50'), '.1f'):>6}")
    print()
    print(f"SmartNoise med/p95: SmartNoise at the same total ε {EPSILON} and δ {DELTA:g} per query as its accountant "
          f"composes them; SN/meas med: SmartNoise with ε {EPSILON} per measurement, whose total cost is 'SN cost'")
    print("latency columns: p50 ms; first = through the proxy, fresh noise + ledger charge; seen = same text again "
          "(cached answer); exact = plain SQL directly; bound = anonproxy's bounded SQL directly; "
          "+first/+seen = first/seen minus exact")
    for r in results:
        for system in ("anonproxy", "smartnoise"):
            info = r[system]
            if info is not None and not info["answered"]:
                print(f"  {r['id']} {system} refused: {info['refusal']}")
    s = summary
    print()
    print(f"anonproxy answers every workload query: {'PASS' if s['target_answers_all'] else 'MISS'} "
          f"({len(s['anonproxy_answered'])}/{len(results)}; refused {', '.join(s['anonproxy_refused']) or 'none'})")
    if sn is None:
        print("anonproxy median relative error <= SmartNoise's where both answer: not measured (no SmartNoise)")
    else:
        print(f"anonproxy median relative error <= SmartNoise's where both answer: "
              f"{'PASS' if s['target_error'] else 'MISS'} ({len(s['anonproxy_median_le_smartnoise'])}"
              f"/{len(s['both_answered'])}; SmartNoise answered {len(s['smartnoise_answered'])}/{len(results)})")
    print(f"added latency, seen statement (cached answer), p50 minus exact SQL p50: median over queries "
          f"{_fmt(s['added_seen_ms_median_over_queries'], '.2f')} ms, max {_fmt(s['added_seen_ms_max'], '.2f')} ms "
          f"(target <= {TARGET_ADDED_MS} ms): {'PASS' if s['target_added_seen'] else 'MISS'}")
    print(f"added latency, first charge (noise + ledger), p50 minus exact SQL p50: median over queries "
          f"{_fmt(s['added_first_ms_median_over_queries'], '.2f')} ms, max {_fmt(s['added_first_ms_max'], '.2f')} ms "
          f"(target <= {TARGET_ADDED_MS} ms): {'PASS' if s['target_added_first'] else 'MISS'}; "
          f"of which beyond the bounded SQL: median {_fmt(s['first_minus_bounded_ms_median_over_queries'], '.2f')} ms")
    print()
    print("the audit trail's cost: the same questions through the proxy with the trail on (first, seen) and through "
          "one with it off, side by side (p50 ms)")
    print(f"{'query':<5} {'first on':>9} {'off':>7} {'on-off':>7}   {'seen on':>8} {'off':>7} {'on-off':>7}")
    for r in results:
        ms = r["ms_p50"]
        print(f"{r['id']:<5} {_fmt(ms.get('first'), '.2f'):>9} {_fmt(ms.get('first_off'), '.2f'):>7} "
              f"{_fmt(r['trail_cost_first_ms'], '+.2f'):>7}   {_fmt(ms.get('seen'), '.2f'):>8} "
              f"{_fmt(ms.get('seen_off'), '.2f'):>7} {_fmt(r['trail_cost_seen_ms'], '+.2f'):>7}")
    print(f"audit trail cost, p50 on - off: first charge median over queries "
          f"{_fmt(s['trail_cost_first_ms_median_over_queries'], '+.2f')} ms, seen (cached answer) median "
          f"{_fmt(s['trail_cost_seen_ms_median_over_queries'], '+.2f')} ms")
    print(f"proxy CPU per statement over the measured runs (worker + supervisor, the trail's writer included): "
          f"trail on {s['proxy_cpu_ms_per_statement_trail_on']:.3f} ms, trail off "
          f"{s['proxy_cpu_ms_per_statement_trail_off']:.3f} ms; rows in anonproxy.audit_trail at the end: "
          f"{s['audit_trail_rows_written']}")


if __name__ == "__main__":
    sys.exit(main())
