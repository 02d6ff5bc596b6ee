#!/usr/bin/env python3
"""Where a dp question's first answer spends its time, step by step (issue 23 "first charge ≤ 2 ms", issue 24 "a new
dp question ≤ 2× the relayed statement").

One throwaway PostgreSQL set up like ``anonproxy up`` (benchmarks/audit_trail/run.py's set-up); ``analyst`` gets a
budget it never spends (``--accounting``). Three parts:

1. **In process**: the real ``NoisyAnswers`` (no analysis process: its pricing runs here) asked the questions of
   benchmarks/suppress_scale over ``adult`` (s01–s10), each a new text (a new alias) so that nothing is cached:
   ``decide()`` and the pricing in CPU time, and every I/O step's wall time (lookup; the charge's round trip,
   which carries the check and the read; the store; finishing), p50 per step, median over the questions. Also the
   plain statement as the owner and the bounded SQL (the plan's) as the service login, directly.
2. **The charge against the ledger's size**: ``anonproxy.charge`` (BEGIN, charge, COMMIT in one round trip) for a
   role whose ledger holds 0, 1,000 and 10,000 charges (inserted as the owner), p50 wall and the backend's CPU per
   charge (``/proc/PID/stat``).
3. **Through the proxy** (``anonproxy serve``, 1 worker): the same shapes as the owner (relayed) and as analyst (a
   new text each time), interleaved; p50 of each, their ratio, and the proxy's CPU per question (the worker and its
   analysis processes, from ``/proc``).

    PYTHONPATH=. python3 benchmarks/dp/breakdown.py [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psycopg

from anonproxy.dp.answers import priced_checked
from anonproxy.dp.model import DPParams
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy
from anonproxy.proxy.gate import Parameters
from anonproxy.proxy.noisy import NoisyAnswers, SessionLimits
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy


def _module(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_setup = _module("audit_trail_run", REPO / "benchmarks" / "audit_trail" / "run.py")
SHAPES = [(shape_id, template) for shape_id, template in (
    ("s01", "select education, count(*) from adult t{n} group by education"),
    ("s02", "select sex, race, count(*) from adult t{n} group by sex, race"),
    ("s03", "select occupation, sum(capital_gain), avg(hours_per_week) from adult t{n} group by occupation"),
    ("s04", ("select education, count(*) from adult t{n} where age between 30 and 49 and sex = 'Female' "
             "group by education")),
    ("s05", "select native_country, count(*) from adult t{n} group by native_country having count(*) > 100"),
    ("s06", "select occupation, count(*) as n from adult t{n} group by occupation order by n desc limit 5"),
    ("s07", ("select workclass, count(*), count(*) * 100.0 / sum(count(*)) over () as share from adult t{n} "
             "group by workclass")),
    ("s08", "select count(*) from adult t{n} where age > 30"),
    ("s09", "select education, round(avg(hours_per_week), 1) from adult t{n} group by education"),
    ("s10", "select age / 10 * 10 as decade, count(*) from adult t{n} group by 1 order by 1"),
)]
BUDGET = ("select anonproxy.set_budget('analyst'::name, 'public.adult'::regclass, 10000000, 0.5, null, 0.5, "
          "0.0000001, %s)")
STEPS = ("decide (CPU)", "price and check (CPU)", "Lookup", "Charge", "Store", "Finish")


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_ms(pid: int) -> float:
    """utime + stime of ``pid``, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def tree_cpu_ms(root: int) -> float:
    """CPU of ``root`` and of every living descendant."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    family, total = {root}, 0.0
    for pid in sorted(parents):
        if parents[pid] in family or pid == root:
            family.add(pid)
    for pid in family:
        try:
            total += cpu_ms(pid)
        except OSError:
            continue
    return total


# -- 1. in process ---------------------------------------------------------------------------------------------


def in_process(server: EmbeddedPostgres, owner: psycopg.Connection[Any], service_dsn: str,
               rounds: int) -> dict[str, Any]:
    policy = load_policy(owner)
    role = policy.role("analyst")
    steps: dict[tuple[str, str], list[float]] = {}
    direct: dict[tuple[str, str], list[float]] = {}
    dsn = server.conninfo(**{key: value for key, value in psycopg.conninfo.conninfo_to_dict(service_dsn).items()
                             if key in ("user", "password", "dbname")})
    service = psycopg.connect(dsn + " options='-c search_path=pg_catalog'", autocommit=True)

    async def run() -> None:
        noisy = NoisyAnswers(dsn, analyser=None)
        do = noisy._do
        current = [""]

        async def timed(need: Any, asking: Any, conn: Any) -> Any:
            begun = time.perf_counter()
            cpu = time.process_time()
            try:
                return await do(need, asking, conn)
            finally:
                name = type(need).__name__
                value = (time.process_time() - cpu if name == "Price" else time.perf_counter() - begun) * 1000
                key = "price and check (CPU)" if name == "Price" else name
                steps.setdefault((current[0], key), []).append(value)

        noisy._do = timed  # type: ignore[method-assign]
        try:
            for number in range(rounds + 1):
                for shape_id, template in SHAPES:
                    text = template.format(n=number)
                    cpu = time.process_time()
                    decision = decide(text, role, policy)
                    decided = (time.process_time() - cpu) * 1000
                    assert isinstance(decision, Noisy), (shape_id, decision)
                    current[0] = shape_id if number else "warm"
                    await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
                    if number:
                        steps.setdefault((shape_id, "decide (CPU)"), []).append(decided)
                        plan = priced_checked(decision.plan, role, policy, DPParams(0.5, 1e-7))
                        for kind, conn, sql in (("plain", owner, text), ("bounded", service, plan.sql)):
                            begun = time.perf_counter()
                            conn.execute(sql, prepare=False).fetchall()
                            direct.setdefault((shape_id, kind), []).append((time.perf_counter() - begun) * 1000)
        finally:
            await noisy.close()

    started = load()
    asyncio.run(run())
    service.close()
    per_step = {step: p50([p50(steps.get((shape_id, step), [])) for shape_id, _ in SHAPES]) for step in STEPS}
    per_direct = {kind: p50([p50(direct[shape_id, kind]) for shape_id, _ in SHAPES]) for kind in ("plain", "bounded")}
    return {"load": f"{started} -> {load()}", "steps_p50_ms": per_step, "direct_p50_ms": per_direct,
            "per_shape": {shape_id: {step: p50(steps.get((shape_id, step), [])) for step in STEPS}
                          | {kind: p50(direct[shape_id, kind]) for kind in ("plain", "bounded")}
                          for shape_id, _ in SHAPES}}


# -- 2. the charge against the ledger's size -------------------------------------------------------------------


CHARGE = ("select (anonproxy.charge('analyst', 'public.adult', 0.5, 0, 0.125, 0, 'breakdown')).epsilon_spent")


def charges(owner: psycopg.Connection[Any], service_dsn: str, server: EmbeddedPostgres,
            count: int) -> dict[str, Any]:
    dsn = server.conninfo(**{key: value for key, value in psycopg.conninfo.conninfo_to_dict(service_dsn).items()
                             if key in ("user", "password", "dbname")})
    figures: dict[str, Any] = {"load_before": load()}
    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.info.backend_pid
        held = owner.execute("select count(*) from anonproxy.budget_ledger where role_name = 'analyst'").fetchone()
        have = held[0] if held else 0
        for size in (0, 1000, 10000):
            if size > have:
                owner.execute("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add,"
                              " fingerprint) select 'analyst', 'public.adult', 0.5, 0, 0.125, 0, 'filler' "
                              "from generate_series(1, %s)", [size - have])
                owner.execute("vacuum analyze anonproxy.budget_ledger")
                have = size
            times, cpu = [], cpu_ms(backend)
            for _ in range(count):
                begun = time.perf_counter()
                with conn.pipeline():
                    conn.execute("begin isolation level read committed")
                    cursor = conn.execute(CHARGE)
                    conn.execute("commit")
                cursor.fetchone()
                times.append((time.perf_counter() - begun) * 1000)
            have += count
            figures[str(size)] = {"p50_ms": p50(times), "backend_cpu_ms": (cpu_ms(backend) - cpu) / count}
    figures["load_after"] = load()
    return figures


# -- 3. through the proxy --------------------------------------------------------------------------------------


def through_proxy(server: EmbeddedPostgres, service_dsn: str, rounds: int) -> dict[str, Any]:
    with ExitStack() as stack:
        proxy = stack.enter_context(_setup.start_proxy("this checkout", REPO, True, server.port, service_dsn,
                                                       workers=1))
        conns = {user: stack.enter_context(_setup.connect(proxy.port, user)) for user in ("dba", "analyst")}
        times: dict[tuple[str, str], list[float]] = {}
        serial = [10_000]

        def ask(user: str, template: str) -> float:
            serial[0] += 1
            text = template.format(n=serial[0] if user == "analyst" else 0)
            begun = time.perf_counter()
            conns[user].execute(text, prepare=False).fetchall()
            return (time.perf_counter() - begun) * 1000

        for _, template in SHAPES:
            ask("dba", template)
            ask("analyst", template)
        started, cpu_analyst = load(), 0.0
        for round_ in range(rounds):
            for index, (shape_id, template) in enumerate(SHAPES):
                order = ("dba", "analyst") if (round_ + index) % 2 == 0 else ("analyst", "dba")
                for user in order:
                    before = tree_cpu_ms(proxy.pid)
                    times.setdefault((shape_id, user), []).append(ask(user, template))
                    if user == "analyst":
                        cpu_analyst += tree_cpu_ms(proxy.pid) - before
        ratios = [p50(times[shape_id, "analyst"]) / p50(times[shape_id, "dba"]) for shape_id, _ in SHAPES]
        return {"load": f"{started} -> {load()}",
                "per_shape": {shape_id: {"relayed_p50_ms": p50(times[shape_id, "dba"]),
                                         "analyst_p50_ms": p50(times[shape_id, "analyst"])}
                              for shape_id, _ in SHAPES},
                "analyst_over_relayed_median": p50(ratios), "analyst_over_relayed_range": [min(ratios), max(ratios)],
                "proxy_cpu_ms_per_analyst_question": cpu_analyst / (rounds * len(SHAPES))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="new texts per shape (parts 1 and 3)")
    parser.add_argument("--charges", type=int, default=200, help="charges per ledger size (part 2)")
    parser.add_argument("--accounting", choices=("basic", "zcdp"), default="zcdp")
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"code": os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    parts: dict[str, Callable[..., dict[str, Any]]] = {}
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = _setup.prepare_database(server)
        owner = stack.enter_context(psycopg.connect(server.conninfo(dbname=_setup.DATABASE), autocommit=True))
        owner.execute(BUDGET, [args.accounting])
        chosen = args.parts.split(",")
        if "1" in chosen:
            parts["1 in process"] = lambda: in_process(server, owner, service_dsn, args.rounds)
        if "3" in chosen:
            parts["3 through the proxy"] = lambda: through_proxy(server, service_dsn, args.rounds)
        if "2" in chosen:  # last: it fills the ledger
            parts["2 charge by ledger size"] = lambda: charges(owner, service_dsn, server, args.charges)
        for name, part in parts.items():
            report[name] = part()
            print(name, json.dumps(report[name], indent=1), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
