"""What writing the back-ends' SQL as sqlglot trees would cost, next to the first-sight decision it is part of.

For every query of the suppress workload (benchmarks/suppress/workload.py) as a suppress role, and of the dp
workload (benchmarks/dp/dp_workload.py) as a dp role, it takes the statements the back-end writes on first sight
today (suppress: the answer and its reported form; dp: the plan's SQL and its measurement SQL, the answer cache's
key) and times, per query (each a median over ``--repeat`` runs):

* ``decision``: the whole first-sight decision as today (suppress ``decide()``; dp ``decide()`` then
  ``plan_checked()``: what benchmarks/parses/decide_time.py times), a new text each time;
* ``text``: the part of that decision the back-end spends writing those statements as text today (the calls of
  ``rewrite``, ``reported`` and ``suppressed`` from ``decide()``, of ``bounded_sql`` from the dp plan), timed
  inside the decision;
* ``build``: building the same statements as trees with the ``exp.*`` constructors, node by node, no parse (the
  tree sqlglot reads from the statement, rebuilt by calling each node's class with its arguments: a lower bound
  of what a back-end that builds its SQL as a tree does, which also decides what to build);
* ``render``: rendering those trees once with the project's renderer (anonproxy.plan.render.sql);
* ``floor``: the least any tree of Python objects costs, one per node: a tuple per node built again, and
  rendered by joining its children's text (not SQL: only the per-node work every renderer does).

Printed per mode: the medians over queries of each, the median node count and length of the statements, and
(build + render) as a share of the decision and as a multiple of ``text``. On a busy shared machine the
milliseconds, and even these ratios, move from run to run: count instructions instead (below).

    python3 benchmarks/parses/tree_cost.py [--repeat 20]

Instructions, not time: ``--count MODE PASSES`` builds and renders the trees of every statement MODE's workload
writes PASSES times and prints nothing, for valgrind to count (as benchmarks/parses/decide_time.py's ``--count``:
PASSES 5 minus PASSES 1, divided by 4 and by the number of queries written, is the trees' instructions per
first-sight decision)::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python3 .../tree_cost.py --count suppress 5

``--what floor`` counts the floor's tuples instead, ``--what decisions`` the first-sight decisions of the same
queries (those the back-end writes SQL for: dp's workload has queries refused for lack of declared bounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_WRITING_MS = [0.0]  # time spent in the back-ends' SQL writers, added up by _timed

Decide = Callable[[str], tuple[str, ...]]


def _workloads() -> dict[str, tuple[Decide, list[str]]]:
    """Per mode: a function deciding a statement on first sight and returning the SQL the back-end wrote, and the
    workload's queries."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks" / "suppress"),
                    str(ROOT / "benchmarks" / "dp")]
    import dp_workload
    import workload
    from test_rewrite import POLICY, SUPPRESS

    from anonproxy.dp.answers import plan_checked
    from anonproxy.dp.model import DPParams, DPPlan
    from anonproxy.route.decide import decide
    from anonproxy.route.decision import Noisy, Rewrite

    dp_role = dataclasses.replace(SUPPRESS, mode="dp")
    params = DPParams(epsilon=1, delta=1e-6)

    def suppress(sql: str) -> tuple[str, ...]:
        decision = decide(sql, SUPPRESS, POLICY)
        if not isinstance(decision, Rewrite):
            return ()
        return tuple(text for text in (decision.sql, decision.reported) if text)

    def dp(sql: str) -> tuple[str, ...]:
        decision = decide(sql, dp_role, POLICY)
        if not isinstance(decision, Noisy):
            return ()
        plan = plan_checked(decision.sql, dp_role, POLICY, params)
        return (plan.sql, plan.measured) if isinstance(plan, DPPlan) else ()

    return {"suppress": (suppress, [q.sql for q in workload.QUERIES]),
            "dp": (dp, [q.sql for q in dp_workload.QUERIES])}


def _timed(function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _WRITING_MS[0] += (time.perf_counter() - start) * 1000
    return timed


def _time_writers() -> None:
    """Time every call of the back-ends' SQL writers where the decision makes it (the names their callers read)."""
    import anonproxy.dp.plan as dp_plan
    import anonproxy.route.decide as route

    for module, name in ((route, "rewrite"), (route, "reported"), (route, "suppressed"), (dp_plan, "bounded_sql")):
        setattr(module, name, _timed(getattr(module, name)))


def rebuild(node: Any) -> Any:
    """``node`` built again with the exp.* constructors, children first (lists and plain values as they are)."""
    from sqlglot import exp

    if isinstance(node, list):
        return [rebuild(child) for child in node]
    if not isinstance(node, exp.Expr):
        return node
    built = type(node)(**{key: rebuild(value) for key, value in node.args.items()})
    if node.meta:  # date_part's mark (anonproxy.plan.render)
        built.meta.update(node.meta)
    return built


Lean = tuple[str, tuple[Any, ...]]  # a node's kind and its children (Lean nodes or text)


def lean(node: Any) -> Any:
    """``node`` as nested tuples, one per node (the input of the floor's build)."""
    from sqlglot import exp

    if isinstance(node, list):
        return ("list", tuple(lean(child) for child in node))
    if not isinstance(node, exp.Expr):
        return str(node)
    return (node.key, tuple(lean(value) for value in node.args.values() if value is not None
                            and not isinstance(value, bool)))


def lean_copy(node: Any) -> Any:
    return (node[0], tuple(lean_copy(child) for child in node[1])) if isinstance(node, tuple) else node


def lean_render(node: Any) -> str:
    return " ".join(lean_render(child) for child in node[1]) if isinstance(node, tuple) else node


def _median_ms(action: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


@dataclasses.dataclass
class _Query:
    decision: float
    text: float
    build: float
    render: float
    floor: float
    nodes: int
    length: int


def _measure(decide: Decide, number: int, query: str, repeat: int) -> _Query | None:
    import sqlglot

    from anonproxy.plan.render import sql as render
    from anonproxy.plan.statements import DIALECT

    texts = decide(query)
    if not texts:
        return None
    serial = iter(range(10**9))

    def first_sight() -> None:
        decide(f"/* tree-cost {number} #{next(serial)} */ {query}")

    decision = _median_ms(first_sight, repeat)
    writing = []
    for _ in range(repeat):
        _WRITING_MS[0] = 0.0
        first_sight()
        writing.append(_WRITING_MS[0])
    trees = [sqlglot.parse_one(text, dialect=DIALECT) for text in texts]
    built = [rebuild(tree) for tree in trees]
    assert [render(tree) for tree in built] == [render(tree) for tree in trees]  # the same statements
    leans = [lean(tree) for tree in trees]
    return _Query(
        decision=decision,
        text=statistics.median(writing),
        build=_median_ms(lambda: [rebuild(tree) for tree in trees], repeat),
        render=_median_ms(lambda: [render(tree) for tree in built], repeat),
        floor=_median_ms(lambda: [lean_render(lean_copy(tree)) for tree in leans], repeat),
        nodes=sum(1 for tree in trees for _ in tree.walk()),
        length=sum(len(text) for text in texts),
    )


def count(decide: Decide, queries: list[str], passes: int, what: str) -> None:
    """``passes`` times over the queries the back-end writes SQL for: build and render their statements' trees
    (``trees``), or the floor's tuples (``floor``), or decide them on first sight again (``decisions``)."""
    import sqlglot

    from anonproxy.plan.render import sql as render
    from anonproxy.plan.statements import DIALECT

    written = {query: texts for query in queries if (texts := decide(query))}
    trees = [sqlglot.parse_one(text, dialect=DIALECT) for texts in written.values() for text in texts]
    leans = [lean(tree) for tree in trees]
    for serial in range(passes):
        if what == "floor":
            for tuples in leans:
                lean_render(lean_copy(tuples))
        elif what == "trees":
            for tree in trees:
                render(rebuild(tree))
        else:
            for number, query in enumerate(written):
                decide(f"/* tree-count {number} #{serial} */ {query}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--count", nargs=2, metavar=("MODE", "PASSES"), help="build and render, for valgrind")
    parser.add_argument("--what", choices=("trees", "floor", "decisions"), default="trees", help="what --count runs")
    args = parser.parse_args()
    workloads = _workloads()
    if args.count:
        decide, queries = workloads[args.count[0]]
        count(decide, queries, int(args.count[1]), args.what)
        return
    _time_writers()
    for mode, (decide, queries) in workloads.items():
        measured = [m for number, query in enumerate(queries) if (m := _measure(decide, number, query, args.repeat))]

        def median(field: str, of: list[_Query] = measured) -> float:
            return statistics.median(getattr(m, field) for m in of)

        share = [(m.build + m.render) / m.decision for m in measured]
        multiple = [(m.build + m.render) / m.text for m in measured]
        print(f"{mode}: {len(measured)} of {len(queries)} queries written by the back-end; medians over them:\n"
              f"  decision {median('decision'):.3f} ms, of which text {median('text'):.3f} ms\n"
              f"  trees: build {median('build'):.3f} ms + render {median('render'):.3f} ms = "
              f"{statistics.median(share):.2f} x the decision (min {min(share):.2f}, max {max(share):.2f}), "
              f"{statistics.median(multiple):.0f} x the text\n"
              f"  floor (a tuple per node, built and joined): {median('floor'):.3f} ms\n"
              f"  statements: {median('nodes'):.0f} nodes, {median('length'):.0f} characters")


if __name__ == "__main__":
    main()
