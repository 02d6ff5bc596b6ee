#!/usr/bin/env python3
"""How lean is the gated path? A 20k-row answer written to a gated client against the same answer relayed.

A throwaway PostgreSQL set up like ``anonproxy up`` and one ``anonproxy serve`` (1 worker, so the worker is the
process measured) per checkout: this one, and with ``--baseline DIR`` another (e.g. the commit before the batched
writes), side by side. For each proxy, the same 20,000-row answer (``ROWS``) is read by ``dba`` (direct: relayed
bytes), ``reporter`` (suppress) and ``analyst`` (dp): the statement touches no protected table, so for both gated
roles it passes the gate, which reads every message of the answer:

* writes: the proxy's write system calls for one answer (``strace -c -f -e trace=write,writev,sendto,sendmsg``
  attached to the worker);
* CPU: the worker's CPU time per answer (user + system, from ``/proc/PID/task/*/schedstat``), over ``--repeat``
  answers, the proxies and roles taking turns answer by answer so the machine's load falls on all alike; the
  median of the per-answer figures, and the gated/relayed ratio per proxy and gated role. Target: ≤ 1.5.
See README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402

from anonproxy.dp.model import DPParams, DPPlan  # noqa: E402
from anonproxy.dp.plan import plan_dp  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from anonproxy.policy.yaml_policy import demo_policy  # noqa: E402


def _audit_trail_benchmark() -> Any:
    """benchmarks/audit_trail/run.py, whose set-up (database as `up` makes it, `serve` from a checkout) this reuses."""
    spec = importlib.util.spec_from_file_location("audit_trail_run", REPO / "benchmarks" / "audit_trail" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


_setup = _audit_trail_benchmark()
Proxy, open_session, prepare_database, progress, start_proxy = (
    _setup.Proxy, _setup.open_session, _setup.prepare_database, _setup.progress, _setup.start_proxy)

ROWS = "select g, 'row ' || g from generate_series(1, 20000) g"
RELAYED = "dba"
GATED = ("reporter", "analyst")  # suppress, dp
ROLES = (RELAYED, *GATED)
DP_QUESTIONS = ("select count(*) from adult", "select sex, count(*) from adult group by 1",
                "select education, avg(age) from adult group by 1")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to measure side by side")
    parser.add_argument("--repeat", type=int, default=40, help="answers per proxy and role for the CPU figure")
    parser.add_argument("--charges", type=int, default=30, help="first answers per proxy and dp question")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    _print(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with ExitStack() as stack:
        progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = prepare_database(server)
        sources = [("this checkout", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
        proxies = [stack.enter_context(start_proxy(name, source, True, server.port, service_dsn, workers=1))
                   for name, source in sources]
        sessions = {(proxy.name, role): stack.enter_context(open_session(proxy.port, role))
                    for proxy in proxies for role in ROLES}
        for conn in sessions.values():  # warm: decided, cached, a service connection in the pool
            assert len(conn.execute(ROWS).fetchall()) == 20000
        writes = {key: _writes(_proxy(proxies, key[0]), conn) for key, conn in sessions.items()}
        cpu: dict[tuple[str, str], list[float]] = {key: [] for key in sessions}
        progress(f"CPU: {args.repeat} answers per proxy and role, in turn")
        for _ in range(args.repeat):
            for key, conn in sessions.items():
                cpu[key].append(_cpu_ms(_proxy(proxies, key[0]), conn))
        for proxy in proxies:
            figures = {role: {"writes": writes[proxy.name, role],
                              "cpu_ms_p50": statistics.median(cpu[proxy.name, role]),
                              "cpu_ms_all": cpu[proxy.name, role]} for role in ROLES}
            figures["ratio"] = {role: figures[role]["cpu_ms_p50"] / figures[RELAYED]["cpu_ms_p50"] for role in GATED}
            report[proxy.name] = figures
        owner = stack.enter_context(psycopg.connect(server.conninfo(dbname=_setup.DATABASE), autocommit=True))
        analysts = {proxy.name: stack.enter_context(open_session(proxy.port, "analyst")) for proxy in proxies}
        report["first charge"] = _first_charges(owner, analysts, args.charges)
    return report


def _first_charges(owner: psycopg.Connection[Any], analysts: dict[str, psycopg.Connection[Any]],
                   repeat: int) -> dict[str, Any]:
    """Latency a dp question's first answer (charged, measured, noised, cached; planned before) adds over the same
    question asked directly as the owner (``direct``), and over the contribution-bounded SQL the proxy runs in its
    place, asked directly (``bounded``): per proxy, the median over DP_QUESTIONS of the p50 differences."""
    policy = demo_policy()
    bounded = {}
    for question in DP_QUESTIONS:
        plan = plan_dp(question, policy.role("analyst"), policy, DPParams(0.5, 0.0000001))
        assert isinstance(plan, DPPlan)
        bounded[question] = plan.sql
    owner.execute("select anonproxy.set_budget('analyst'::name, 'public.adult'::regclass, 1000000, 0.5, null, "
                  "0.5, 0.0000001)")
    times: dict[tuple[str, str], list[float]] = {}
    progress(f"first charges: {repeat} per proxy and question, in turn")
    for question in DP_QUESTIONS:  # warm: planned once on each proxy
        for conn in analysts.values():
            conn.execute(question).fetchall()
    for _ in range(repeat):
        for question in DP_QUESTIONS:
            for name, conn, sql in [*((name, conn, question) for name, conn in analysts.items()),
                                    ("direct", owner, question), ("bounded", owner, bounded[question])]:
                owner.execute("delete from anonproxy.answer_cache where role_name = 'analyst'")  # a first answer
                started = time.perf_counter()
                conn.execute(sql, prepare=False).fetchall()
                times.setdefault((name, question), []).append((time.perf_counter() - started) * 1000)
    def added(name: str, reference: str) -> float:
        return statistics.median(statistics.median(times[name, q]) - statistics.median(times[reference, q])
                                 for q in DP_QUESTIONS)

    return {"added_ms_p50": {name: added(name, "direct") for name in analysts},
            "over_bounded_ms_p50": {name: added(name, "bounded") for name in analysts},
            "p50_ms": {f"{name}: {q}": statistics.median(values) for (name, q), values in times.items()}}


def _proxy(proxies: list[Proxy], name: str) -> Proxy:
    return next(proxy for proxy in proxies if proxy.name == name)


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns."""
    return sum(int(stat.read_text().split()[0]) for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"))


def _cpu_ms(proxy: Proxy, conn: psycopg.Connection[Any]) -> float:
    before = _cpu_ns(proxy.pid)
    assert len(conn.execute(ROWS).fetchall()) == 20000
    return (_cpu_ns(proxy.pid) - before) / 1e6


def _writes(proxy: Proxy, conn: psycopg.Connection[Any]) -> int:
    """The write system calls of the proxy while it sends one answer."""
    strace = subprocess.Popen(["strace", "-c", "-f", "-e", "trace=write,writev,sendto,sendmsg", "-p", str(proxy.pid)],
                              stderr=subprocess.PIPE, text=True)
    time.sleep(1)  # attached
    assert len(conn.execute(ROWS).fetchall()) == 20000
    time.sleep(0.2)
    strace.send_signal(signal.SIGINT)
    _, summary = strace.communicate(timeout=30)
    total = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?total$", summary, re.MULTILINE)
    if total is None:
        raise RuntimeError(f"no strace summary:\n{summary}")
    return int(total.group(1))


def _print(report: dict[str, Any]) -> None:
    charges = report.pop("first charge")
    print(f"\nOne answer of 20,000 rows ({ROWS!r}), worker of each proxy:")
    for name, figures in report.items():
        for role in ROLES:
            kind = "relayed" if role == RELAYED else "gated"
            print(f"  {name:<14} {role:<9} ({kind:<7}) writes {figures[role]['writes']:6d}   "
                  f"CPU p50 {figures[role]['cpu_ms_p50']:7.2f} ms")
        for role, ratio in figures["ratio"].items():
            print(f"  {name:<14} gated ({role}) / relayed CPU: {ratio:.2f} (target ≤ 1.5)")
    report["first charge"] = charges
    print("\nA dp question's first answer, p50 through the proxy − p50 directly (median over the questions):")
    for name, added in charges["added_ms_p50"].items():
        print(f"  {name:<14} {added:+.2f} ms (target ≤ 2 ms); over the bounded SQL asked directly: "
              f"{charges['over_bounded_ms_p50'][name]:+.2f} ms")
    for label, ms in charges["p50_ms"].items():
        print(f"    {label:<70} p50 {ms:7.2f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
