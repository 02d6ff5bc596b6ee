"""First-sight decision time, in process: this tree against another revision, alternated in one run.

For every query of the suppress workload (benchmarks/suppress/workload.py) as a suppress role, and of the dp
workload (benchmarks/dp/dp_workload.py) as a dp role, it times what the proxy does on first sight of a statement
before any I/O: ``decide()`` (suppress: classification and rewrite), and for dp what the proxy does before its
first ledger round trip: ``decide()`` then the plan and the final SQL check — since issue 18, ``decide()`` measures
and ``priced_checked()`` prices that measurement once; before, ``plan_checked()`` planned the text at the default
cost and, for a role with another cost (mode ``dp-cost``: ε 1, δ 1e-6), again at that cost. Each timing uses a new
text (a numbered leading comment), so nothing is cached. The policy is tests/test_rewrite.py's, as each tree has
it.

Each tree runs in its own interpreter (``--child``); the trees alternate, ``--rounds`` times. Printed: per mode,
the median over queries of each query's median time, and the largest query median, per tree and round.

    python3 benchmarks/parses/decide_time.py --against 4ad7d93 [--rounds 3] [--repeat 40]

Times on a shared machine are noisy; instruction counts are not. ``--count MODE PASSES`` decides every query of
MODE's workload PASSES times (new texts each pass) and prints nothing, for valgrind to count, in the tree of
the current directory (the real interpreter, not a shim)::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python3 .../decide_time.py --count suppress 5

(PASSES 5 minus PASSES 1, divided by 4 and by the number of queries: instructions per decision.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def actions() -> dict[str, tuple[Callable[[str], None], list[str]]]:
    """Per mode, what the proxy does on first sight of a statement, and the workload's queries (this tree's code,
    the benchmark's own workloads)."""
    sys.path[:0] = [".", "tests", str(ROOT / "benchmarks" / "suppress"), str(ROOT / "benchmarks" / "dp")]
    import dp_workload  # noqa: PLC0415 (the workloads are this tree's, read from the benchmark's own copy)
    import workload  # noqa: PLC0415
    from test_rewrite import POLICY, SUPPRESS  # noqa: PLC0415

    from anonproxy.route.decide import decide  # noqa: PLC0415
    from anonproxy.route.decision import Noisy  # noqa: PLC0415

    try:  # the layout since the back-ends got their own packages
        from anonproxy.dp.answers import plan_checked  # noqa: PLC0415
        from anonproxy.dp.model import DPParams  # noqa: PLC0415
    except ImportError:  # before (4ad7d93): dp planning in anonproxy.privacy, its check in the proxy
        from anonproxy.privacy.dp_plan import DPParams  # type: ignore[no-redef]  # noqa: PLC0415

        from anonproxy.proxy.noisy import plan_checked  # type: ignore[no-redef]  # noqa: PLC0415
    try:  # measure, then price (issue 18): decide() measures, the proxy prices the measurement once
        from anonproxy.dp.answers import priced_checked  # noqa: PLC0415
    except ImportError:
        priced_checked = None

    dp_role = dataclasses.replace(SUPPRESS, mode="dp")
    default = DPParams(epsilon=0.5, delta=1e-7)  # the proxy's default per-query cost
    own = DPParams(epsilon=1, delta=1e-6)  # a role whose per-query cost is not the default

    def suppress(sql: str) -> None:
        decide(sql, SUPPRESS, POLICY)

    def dp_at(params: DPParams) -> Callable[[str], None]:
        """What the proxy does on first sight of a dp statement for a role priced at ``params``: before, decide(),
        then the plan at the default cost (to learn the table) and, for another cost, the plan at it; since issue
        18, decide() (which measures) and the measurement priced once at the role's cost."""
        def dp(sql: str) -> None:
            decision = decide(sql, dp_role, POLICY)
            if not isinstance(decision, Noisy):
                return
            if priced_checked is not None:
                priced_checked(decision.plan, dp_role, POLICY, params)
                return
            plan_checked(decision.sql, dp_role, POLICY, default)
            if params != default:
                plan_checked(decision.sql, dp_role, POLICY, params)
        return dp

    dp_queries = [q.sql for q in dp_workload.QUERIES]
    return {"suppress": (suppress, [q.sql for q in workload.QUERIES]), "dp": (dp_at(default), dp_queries),
            "dp-cost": (dp_at(own), dp_queries)}


def child(repeat: int) -> None:
    """Time the current working directory's tree; print JSON {mode: [median ms per query]}."""
    figures: dict[str, list[float]] = {}
    for mode, (action, queries) in actions().items():
        medians = []
        for number, sql in enumerate(queries):
            action(f"/* warm {number} */ {sql}")
            times = []
            for serial in range(repeat):
                text = f"/* decide-time {number} #{serial} */ {sql}"
                start = time.perf_counter()
                action(text)
                times.append((time.perf_counter() - start) * 1000)
            medians.append(statistics.median(times))
        figures[mode] = medians
    print(json.dumps(figures))


def count(mode: str, passes: int) -> None:
    """Decide every query of ``mode``'s workload ``passes`` times, each time as a new text."""
    action, queries = actions()[mode]
    for serial in range(passes):
        for number, sql in enumerate(queries):
            action(f"/* decide-count {number} #{serial} */ {sql}")


def run(tree: Path, repeat: int) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--repeat", str(repeat)],
                          cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="4ad7d93", help="the revision to compare with (default: 4ad7d93)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=40, help="first-sight texts per query")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", nargs=2, metavar=("MODE", "PASSES"), help="decide without timing (for valgrind)")
    args = parser.parse_args()
    if args.count:
        count(args.count[0], int(args.count[1]))
        return
    if args.child:
        child(args.repeat)
        return
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.against],
                       check=True, capture_output=True)
        try:
            for round_ in range(1, args.rounds + 1):
                for label, tree in ((args.against, old), ("this tree", ROOT)):
                    figures = run(tree, args.repeat)
                    for mode, medians in figures.items():
                        print(f"round {round_}  {label:10} {mode:8}  median over queries "
                              f"{statistics.median(medians):6.3f} ms   max {max(medians):6.3f} ms")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)


if __name__ == "__main__":
    main()
