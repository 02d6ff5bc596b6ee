#!/usr/bin/env python3
"""Per step, the worker's CPU and wall time of a dp question's first answer next to a seen (cached) one, in process.

The four questions of first_answer.py, asked of the real ``NoisyAnswers`` (no analysis process: its pricing runs
here) on a throwaway PostgreSQL set up like ``anonproxy up`` (breakdown.py's ``prepared``). Each round asks each
question first with the answer cache emptied (a first answer) and then again (seen); with ``--new-texts`` the first
is a new text (a new table alias), decided here (``decide``, CPU) and priced as it is asked. Every step the question
asks its driver (anonproxy.dp.question: Lookup, Price, Charge — which carries the check and the read —, Store,
Finish, ...) is timed around the driver's ``_do``: CPU (``time.process_time``, this process only: PostgreSQL's work
is not in it) and wall. Then the plain statement as the owner, the plan's bounded SQL as the service login and a
charge alone (BEGIN, charge, COMMIT), directly. Prints the median per call, in µs.

    PYTHONPATH=. python3 benchmarks/dp/first_answer_steps.py [--rounds 30] [--new-texts]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psycopg

from anonproxy.policy.store import load_policy
from anonproxy.proxy.gate import Parameters
from anonproxy.proxy.noisy import NoisyAnswers, SessionLimits
from anonproxy.route.decide import decide

_spec = importlib.util.spec_from_file_location("dp_breakdown", REPO / "benchmarks" / "dp" / "breakdown.py")
assert _spec is not None and _spec.loader is not None
_breakdown = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _breakdown
_spec.loader.exec_module(_breakdown)

QUESTIONS = ("select count(*) from adult", "select sex, count(*) from adult group by 1",
             "select education, avg(age) from adult group by 1", "select sum(capital_gain) from adult where age > 40")
CHARGE = "begin; select anonproxy.charge('analyst', 'public.adult', 0.5, 0, 0.125, 0, 'steps'); commit"
Times = dict[tuple[str, str, str], list[float]]  # (first | seen, step, cpu | wall) -> µs per call


def timed(times: Times, kind: str, step: str, wall: int, cpu: int) -> None:
    times.setdefault((kind, step, "cpu"), []).append((time.process_time_ns() - cpu) / 1000)
    times.setdefault((kind, step, "wall"), []).append((time.perf_counter_ns() - wall) / 1000)


async def asked(dsn: str, owner: psycopg.Connection[Any], rounds: int, new_texts: bool) -> tuple[Times, dict[str, Any]]:
    policy = load_policy(owner)
    role = policy.role("analyst")
    noisy = NoisyAnswers(dsn, analyser=None)
    do = noisy._do
    times: Times = {}
    now = {"kind": "warm", "question": ""}
    plans: dict[str, Any] = {}

    async def step(need: Any, asking: Any, conn: Any) -> Any:
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        try:
            return await do(need, asking, conn)
        finally:
            timed(times, now["kind"], type(need).__name__, wall, cpu)
            if type(need).__name__ == "Charge":
                plans[now["question"]] = need.plan

    noisy._do = step  # type: ignore[method-assign]
    decisions = {question: decide(question, role, policy) for question in QUESTIONS}
    try:
        for number in range(rounds + 2):  # two rounds to warm up
            for question in QUESTIONS:
                now["question"] = question
                decision = decisions[question]
                for kind in ("first", "seen"):
                    now["kind"] = kind if number >= 2 else "warm"
                    if kind == "first":
                        owner.execute("delete from anonproxy.answer_cache where role_name = 'analyst'")
                    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
                    if kind == "first" and new_texts:
                        decision = decide(question.replace(" from adult", f" from adult as r{number}"), role, policy)
                        timed(times, now["kind"], "decide", wall, cpu)
                    await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
                    timed(times, now["kind"], "whole answer", wall, cpu)
    finally:
        await noisy.close()
    return times, plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--new-texts", action="store_true", help="each first answer a new text (a new alias)")
    args = parser.parse_args()
    with ExitStack() as stack:
        side = _breakdown.prepared(stack, "steps", REPO, "basic")
        dsn = side.server.conninfo(**{key: value for key, value in
                                      psycopg.conninfo.conninfo_to_dict(side.service_dsn).items()
                                      if key in ("user", "password", "dbname")})
        started = Path("/proc/loadavg").read_text().split()[0]
        times, plans = asyncio.run(asked(dsn, side.owner, args.rounds, args.new_texts))
        service = stack.enter_context(psycopg.connect(dsn + " options='-c search_path=pg_catalog'", autocommit=True))
        for _ in range(args.rounds):
            for question in QUESTIONS:
                for step, conn, sql in (("direct: plain SQL", side.owner, question),
                                        ("direct: bounded SQL", service, plans[question].sql),
                                        ("direct: a charge", service, CHARGE)):
                    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
                    cursor = conn.execute(sql, prepare=False)
                    if cursor.description is not None:  # the charge's last statement, COMMIT, returns no rows
                        cursor.fetchall()
                    timed(times, "first", step, wall, cpu)
    print(f"{args.rounds} rounds, {'new texts' if args.new_texts else 'the same texts'}, load average {started} -> "
          f"{Path('/proc/loadavg').read_text().split()[0]}; µs, median per call (calls per question)")
    print(f"{'step':<22}{'first: calls':>13}{'CPU':>8}{'wall':>8}{'seen: calls':>13}{'CPU':>8}{'wall':>8}")
    for step in sorted({step for kind, step, _ in times if kind != "warm"}):
        cells = []
        for kind in ("first", "seen"):
            cpu, wall = times.get((kind, step, "cpu"), []), times.get((kind, step, "wall"), [])
            cells += [f"{len(cpu) / (args.rounds * len(QUESTIONS)):.1f}",
                      f"{statistics.median(cpu):.0f}" if cpu and not step.startswith("direct") else "-",
                      f"{statistics.median(wall):.0f}" if wall else "-"]
        print(f"{step:<22}{cells[0]:>13}{cells[1]:>8}{cells[2]:>8}{cells[3]:>13}{cells[4]:>8}{cells[5]:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
