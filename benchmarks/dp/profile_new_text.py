#!/usr/bin/env python3
"""Where the proxy's CPU goes for a new dp text, per function (issue 24, "dp new question ≤ 2× relayed").

A throwaway PostgreSQL set up like ``anonproxy up`` (benchmarks/dp/breakdown.py's set-up); in one process, what a
worker and its analysis process do for a new text of ``analyst``: the analysis call (``decide`` and the pricing,
``NoisyAnswers.deciding``), the pickling of that call's request and reply both ways (what crosses to the analysis
process, which holds the policy from an earlier call; deciding, and the answer cache's key tokens of the plan,
``answers.folded``, are also timed again on their own), then ``NoisyAnswers.answer`` (ledger round trips, noise, the
answer's rows). The benchmark's ten
``suppress_scale`` shapes over ``adult``, each asked ``--rounds`` times as a new text (a new alias). Prints CPU ms per new text
(``time.process_time``: waiting for PostgreSQL costs nothing), total and per step, and the CPU of the service
login's backends per question (PostgreSQL's side, from ``/proc``); with ``--profile``, under cProfile with that CPU
clock, the functions with the most CPU (cumulative and own). ``--same-text`` asks each shape's one text again and
again with the answer cache emptied before each (a new question whose plan the worker has: no analysis call),
``--seen`` with its answer kept (a question already answered).

    PYTHONPATH=. python3 benchmarks/dp/profile_new_text.py [--rounds 10] [--same-text | --seen]
        [--profile [--top 40] [--pstats out.prof]]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import io
import os
import pickle
import pstats
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from anonproxy.dp.answers import folded
from anonproxy.dp.model import DPPlan
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


breakdown = _module("dp_breakdown", REPO / "benchmarks" / "dp" / "breakdown.py")


def _cpu(call: Callable[[], object]) -> float:
    begun = time.process_time()
    call()
    return time.process_time() - begun


def _folded_again(outcome: tuple[Any, ...]) -> None:
    """The answer cache's key tokens of the priced plan, computed again (the function's cache emptied first)."""
    plan = outcome[2]
    if isinstance(plan, DPPlan):
        folded.cache_clear()
        folded(plan.measured)


def _service_cpu_ms(owner: Any, user: str) -> dict[int, float]:
    """CPU (ms) of each backend of the service login: the dp connections' server side."""
    rows = owner.execute("select pid from pg_stat_activity where usename = %s", [user]).fetchall()
    return {pid: breakdown.cpu_ms(pid) for (pid,) in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="new texts per shape")
    parser.add_argument("--profile", action="store_true", help="under cProfile (which about triples the CPU)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--pstats", type=Path, help="write cProfile's statistics there")
    parser.add_argument("--same-text", action="store_true",
                        help="ask each shape's one text again and again, the answer cache emptied before each (a new "
                             "question on a text seen before: its plan cached, no analysis call)")
    parser.add_argument("--seen", action="store_true",
                        help="ask each shape's one text again and again, its answer kept (a question already "
                             "answered: no charge)")
    args = parser.parse_args()
    same = args.same_text or args.seen
    with ExitStack() as stack:
        side = breakdown.prepared(stack, "this checkout", REPO, "zcdp")
        policy = load_policy(side.owner)
        role = policy.role("analyst")
        dsn = side.server.conninfo(**{key: value for key, value in
                                      breakdown.psycopg.conninfo.conninfo_to_dict(side.service_dsn).items()
                                      if key in ("user", "password", "dbname")})
        steps: dict[str, float] = {"analysis call": 0.0, "pickling both ways": 0.0, "answer": 0.0}
        parts: dict[str, float] = {"deciding": 0.0, "the cache key's tokens": 0.0}  # within the analysis call
        sizes: list[int] = []
        user = breakdown.psycopg.conninfo.conninfo_to_dict(side.service_dsn)["user"]
        server: dict[int, float] = {}  # the service backends' CPU when the measured rounds begin
        profile = cProfile.Profile(time.process_time) if args.profile else None

        async def run() -> int:
            noisy = NoisyAnswers(dsn, analyser=None)
            asked = 0
            decisions: dict[str, Noisy] = {}
            try:
                for number in range(args.rounds + 1):
                    if number == 1:
                        server.update(_service_cpu_ms(side.owner, user))
                    for _, template in breakdown.SHAPES:
                        text = template.format(n=0 if same else number)
                        measured = number > 0  # round 0 warms the caches and connections
                        if args.same_text:
                            side.owner.execute("delete from anonproxy.answer_cache where role_name = 'analyst'")
                        if measured and profile is not None:
                            profile.enable()
                        begun = time.process_time()
                        if same and number > 0:  # the worker's decision is cached (proxy.session)
                            await noisy.answer(decisions[text], role, policy, Parameters(), SessionLimits())
                            if profile is not None:
                                profile.disable()
                            asked += 1
                            steps["answer"] += time.process_time() - begun
                            continue
                        function, call = noisy.deciding(decide, text, role, policy)
                        outcome = function(*call)
                        decided = time.process_time()
                        # the analysis process holds the policy from the call before (analysis.py, shared)
                        held = tuple(None if value is policy else value for value in call)
                        request = pickle.dumps((function, held), pickle.HIGHEST_PROTOCOL)
                        reply = pickle.dumps((True, outcome), pickle.HIGHEST_PROTOCOL)
                        assert pickle.loads(request) and pickle.loads(reply)
                        pickled = time.process_time()
                        decision = noisy.decided(text, role, policy, outcome)
                        assert isinstance(decision, Noisy), decision
                        decisions[text] = decision
                        await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
                        answered = time.process_time()
                        if measured:
                            if profile is not None:
                                profile.disable()
                            asked += 1
                            sizes.append(len(request) + len(reply))
                            steps["analysis call"] += decided - begun
                            if profile is None:
                                parts["deciding"] += _cpu(partial(decide, text, role, policy))
                                parts["the cache key's tokens"] += _cpu(partial(_folded_again, outcome))
                            steps["pickling both ways"] += pickled - decided
                            steps["answer"] += answered - pickled
                spent = {pid: cpu - server.get(pid, 0.0) for pid, cpu in _service_cpu_ms(side.owner, user).items()}
                server.clear()
                server.update(spent)
            finally:
                await noisy.close()
            return asked

        started = breakdown.load()
        asked = asyncio.run(run())
        print(f"load {started} -> {breakdown.load()}; {asked} questions")
        print(f"CPU per question: {sum(steps.values()) * 1000 / asked:.2f} ms")
        print(f"  the service backends' CPU per question (PostgreSQL's side, 1/{os.sysconf('SC_CLK_TCK')} s ticks): "
              f"{sum(server.values()) / asked:.2f} ms")
        for step, seconds in steps.items():
            print(f"  {step}: {seconds * 1000 / asked:.2f} ms")
            if step == "analysis call" and profile is None:
                for part, spent in parts.items():
                    print(f"    of which {part}, measured again: {spent * 1000 / asked:.2f} ms")
        if sizes:
            print(f"  bytes pickled per new text (request and reply): {sum(sizes) // len(sizes)}")
        if profile is None:
            return 0
        if args.pstats is not None:
            profile.dump_stats(str(args.pstats))
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.top)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
