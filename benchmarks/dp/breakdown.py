#!/usr/bin/env python3
"""Where a dp question's first answer spends its time, step by step (issue 23 "first charge ≤ 2 ms", issue 24 "a new
dp question ≤ 2× the relayed statement").

One throwaway PostgreSQL per checkout (this one, and ``--baseline``'s if given), set up like ``anonproxy up`` with
that checkout's own migrations, installed by its own code; ``analyst`` gets a budget it never spends
(``--accounting``). Three parts:

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

    PYTHONPATH=. python3 benchmarks/dp/breakdown.py [--baseline DIR] [--parts 1,2,3] [--rounds 20] [--json out.json]

Parts 2 and 3 measure the baseline beside this checkout, interleaved; part 1 this checkout only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psycopg

from anonproxy import demo, sample_data
from anonproxy.dp.answers import priced_checked
from anonproxy.dp.model import DPParams
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
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


CHARGE = "select (anonproxy.charge('analyst', 'public.adult', 0.5, 0, 0.125, 0, 'breakdown')).epsilon_spent"
LEDGER_SIZES = (0, 1000, 10000)


@dataclass
class Side:
    """One tree measured: its own server, with its own migrations, and its own proxy (part 3)."""

    name: str
    tree: Path
    server: EmbeddedPostgres
    service_dsn: str
    owner: psycopg.Connection[Any]
    ledger: int = 0  # the analyst's charges so far

    def service(self) -> psycopg.Connection[Any]:
        dsn = self.server.conninfo(**{key: value for key, value in
                                      psycopg.conninfo.conninfo_to_dict(self.service_dsn).items()
                                      if key in ("user", "password", "dbname")})
        return psycopg.connect(dsn, autocommit=True)


def charges(sides: list[Side], count: int) -> dict[str, Any]:
    """The charge's round trip and its backend's CPU, per side and ledger size, the sides alternating in rounds of
    ten charges."""
    figures: dict[str, Any] = {"load": load()}
    with ExitStack() as stack:
        conns = {side.name: stack.enter_context(side.service()) for side in sides}
        for size in LEDGER_SIZES:
            for side in sides:
                held = side.owner.execute("select count(*) from anonproxy.budget_ledger "
                                          "where role_name = 'analyst'").fetchone()
                have = held[0] if held else 0
                if size > have:
                    side.owner.execute("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, "
                                       "delta_add, fingerprint) select 'analyst', 'public.adult', 0.5, 0, 0.125, 0, "
                                       "'filler' from generate_series(1, %s)", [size - have])
                    side.owner.execute("vacuum analyze anonproxy.budget_ledger")
            times: dict[str, list[float]] = {side.name: [] for side in sides}
            cpu: dict[str, float] = dict.fromkeys(times, 0.0)
            for round_ in range(count // 10):
                for side in sides if round_ % 2 == 0 else reversed(sides):
                    conn = conns[side.name]
                    before = cpu_ms(conn.info.backend_pid)
                    for _ in range(10):
                        begun = time.perf_counter()
                        with conn.pipeline():
                            conn.execute("begin isolation level read committed")
                            cursor = conn.execute(CHARGE)
                            conn.execute("commit")
                        cursor.fetchone()
                        times[side.name].append((time.perf_counter() - begun) * 1000)
                    cpu[side.name] += cpu_ms(conn.info.backend_pid) - before
            figures[str(size)] = {name: {"p50_ms": p50(values), "backend_cpu_ms": cpu[name] / len(values)}
                                  for name, values in times.items()}
    figures["load"] += f" -> {load()}"
    return figures


# -- 3. through the proxy --------------------------------------------------------------------------------------


def through_proxy(sides: list[Side], rounds: int) -> dict[str, Any]:
    """The shapes as the owner (relayed) and as analyst (a new text each time) through each side's proxy, the sides
    and the users alternating question by question."""
    with ExitStack() as stack:
        proxies = {side.name: stack.enter_context(_setup.start_proxy(side.name, side.tree, True, side.server.port,
                                                                     side.service_dsn, workers=1))
                   for side in sides}
        conns = {(name, user): stack.enter_context(_setup.connect(proxy.port, user))
                 for name, proxy in proxies.items() for user in ("dba", "analyst")}
        times: dict[tuple[str, str, str], list[float]] = {}
        cpu: dict[str, float] = dict.fromkeys(proxies, 0.0)
        serial = [10_000]

        def ask(name: str, user: str, template: str) -> float:
            serial[0] += 1
            text = template.format(n=serial[0] if user == "analyst" else 0)
            begun = time.perf_counter()
            conns[name, user].execute(text, prepare=False).fetchall()
            return (time.perf_counter() - begun) * 1000

        for name in proxies:
            for _, template in SHAPES:
                ask(name, "dba", template)
                ask(name, "analyst", template)
        started = load()
        for round_ in range(rounds):
            for index, (shape_id, template) in enumerate(SHAPES):
                names = list(proxies) if (round_ + index) % 2 == 0 else list(reversed(proxies))
                for name in names:
                    for user in ("dba", "analyst") if round_ % 2 == 0 else ("analyst", "dba"):
                        before = tree_cpu_ms(proxies[name].pid)
                        times.setdefault((name, shape_id, user), []).append(ask(name, user, template))
                        if user == "analyst":
                            cpu[name] += tree_cpu_ms(proxies[name].pid) - before
        report: dict[str, Any] = {"load": f"{started} -> {load()}"}
        for name in proxies:
            ratios = [p50(times[name, shape_id, "analyst"]) / p50(times[name, shape_id, "dba"])
                      for shape_id, _ in SHAPES]
            report[name] = {
                "per_shape": {shape_id: [round(p50(times[name, shape_id, "dba"]), 2),
                                         round(p50(times[name, shape_id, "analyst"]), 2)] for shape_id, _ in SHAPES},
                "analyst_over_relayed_median": p50(ratios), "analyst_over_relayed_range": [min(ratios), max(ratios)],
                "analyst_minus_relayed_median_ms": p50([p50(times[name, shape_id, "analyst"])
                                                        - p50(times[name, shape_id, "dba"]) for shape_id, _ in SHAPES]),
                "proxy_cpu_ms_per_analyst_question": cpu[name] / (rounds * len(SHAPES))}
        return report


def prepared(stack: ExitStack, name: str, tree: Path, accounting: str) -> Side:
    """A server set up as ``anonproxy up`` does, with ``tree``'s own migrations (installed by its own code)."""
    server = stack.enter_context(EmbeddedPostgres())
    install = ("import sys, psycopg; from anonproxy import schema; conn = psycopg.connect(sys.argv[1]); "
               "schema.install(conn); conn.close()")
    subprocess.run([sys.executable, "-c", install, server.conninfo(dbname=_setup.DATABASE)], check=True, cwd=tree,
                   env={**os.environ, "PYTHONPATH": str(tree)})
    policy = demo_policy()
    with psycopg.connect(server.conninfo(dbname=_setup.DATABASE)) as conn:
        sample_data.load_demo(conn)
        demo.create_demo_roles(conn, _setup.DATABASE)
        password = demo.reset_service_role(conn, policy.service_role)
        apply_policy(conn, policy)
        conn.commit()
    service_dsn = psycopg.conninfo.make_conninfo(user=policy.service_role, password=password, dbname=_setup.DATABASE)
    owner = stack.enter_context(psycopg.connect(server.conninfo(dbname=_setup.DATABASE), autocommit=True))
    owner.execute(BUDGET, [accounting])
    return Side(name, tree, server, service_dsn, owner)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="new texts per shape (parts 1 and 3)")
    parser.add_argument("--charges", type=int, default=200, help="charges per ledger size and side (part 2)")
    parser.add_argument("--accounting", choices=("basic", "zcdp"), default="zcdp")
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured beside this one (parts 2 and 3)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"code": os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    chosen = args.parts.split(",")
    with ExitStack() as stack:
        sides = [prepared(stack, "this checkout", REPO, args.accounting)]
        if args.baseline is not None:
            sides.insert(0, prepared(stack, "baseline", args.baseline.resolve(), args.accounting))
        parts: dict[str, Callable[[], dict[str, Any]]] = {}
        if "1" in chosen:
            this = sides[-1]
            parts["1 in process"] = lambda: in_process(this.server, this.owner, this.service_dsn, args.rounds)
        if "3" in chosen:
            parts["3 through the proxy"] = lambda: through_proxy(sides, args.rounds)
        if "2" in chosen:  # last: it fills the ledger
            parts["2 charge by ledger size"] = lambda: charges(sides, args.charges)
        for name, part in parts.items():
            report[name] = part()
            print(name, json.dumps(report[name], indent=1), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
