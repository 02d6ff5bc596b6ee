#!/usr/bin/env python3
"""Issue 20, item 1, at scale: does a released answer in suppression mode depend on withheld data?

The property of tests/test_suppress_property.py with many more drawn statements than CI runs. A throwaway
PostgreSQL with the Adult table, set up by that module's ``govern`` (the demo policy, a table linked to adult, and
two roles with k = 10 only: one with the suppressed-rest row, one without), and ``anonproxy serve`` in front of it.
Each example draws a statement from a seeded random.Random, changes the values of people who are in withheld groups
only (directly in the database), runs the statement through the proxy before and after, and records a finding when
the two outcomes (rows, notices, error) differ. Prints how many examples ran, how many changed somebody, and the
findings, shortest statements first. Exit status 1 when there is a finding. See README.md.

The statement generator and the comparison are the test module's own: this script puts tests/ on sys.path and
imports tests/test_suppress_property.py (which imports tests/conftest.py for the proxy helpers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = (args.source or REPO).resolve()
    # The checkout under test sets the database up (its migrations) and runs the proxy; the generator is this one's.
    sys.path[:0] = [str(source), str(REPO / "tests")]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [os.environ.get("PYTHONPATH")])])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the ExitStack: servers stop
    report = run(args, source)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 1 if report["findings"] or report["oracle_disagreements"] or report["harness_errors"] else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="statements to draw (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="example i draws from random.Random(f'{seed}:{i}')")
    parser.add_argument("--show", type=int, default=10, help="findings to print in full (default 10)")
    parser.add_argument("--source", type=Path, default=None,
                        help="the checkout whose anonproxy sets the database up and serves (default: this one)")
    parser.add_argument("--json", type=Path, default=None, help="also write every finding as JSON")
    return parser


def run(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    import psycopg
    import test_suppress_property as prop

    from anonproxy import sample_data, schema
    from anonproxy.embedded import EmbeddedPostgres

    stats: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    disagreements: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedPostgres())
        with psycopg.connect(server.conninfo(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {prop.DATABASE}")
        with psycopg.connect(server.conninfo(dbname=prop.DATABASE)) as owner:
            schema.install(owner)
            sample_data.load_adult(owner)
            owner.commit()
            prop.govern(owner, prop.DATABASE)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="suppress-property-")))
        here = Path.cwd()
        os.chdir(source)  # `python -m anonproxy.cli` reads the package of its working directory first
        try:
            world, proxy = prop.start_world(server, prop.DATABASE, logs / "anonproxy.log")
        finally:
            os.chdir(here)
        stack.callback(prop.stop_proxy, proxy)
        stack.callback(world.owner.close)
        print(f"anonproxy from {source}; {args.examples} examples, seed {args.seed}", flush=True)
        started = time.monotonic()
        for i in range(args.examples):
            case = prop.draw_case(random.Random(f"{args.seed}:{i}"))
            try:
                what, finding = prop.examine(world, case)
            except AssertionError as exc:  # check_released_keys: the oracle and the proxy disagree on a verdict
                what, finding = "oracle disagreement", None
                disagreements.append({"example": i, "role": case.role, "message": str(exc)})
            except psycopg.Error as exc:  # the oracle's own queries: a generator bug, not a finding
                what, finding = "harness error", None
                errors.append({"example": i, "statement": case.statement(), "error": f"{exc.sqlstate}: {exc}"})
            stats[what] += 1
            stats[f"role {case.role}"] += 1
            stats[f"shape {_shape(case)}"] += 1
            if finding is not None:
                findings.append({"example": i, "role": finding.role, "statement": finding.statement,
                                 "change": finding.change.describe() + finding.note,
                                 "before": finding.before.describe(), "after": finding.after.describe()})
            if (i + 1) % 100 == 0:
                print(f"  {i + 1} examples, {len(findings)} findings, {time.monotonic() - started:.0f} s", flush=True)
        elapsed = time.monotonic() - started
        assert "Traceback" not in proxy.log(), proxy.log()
    _print(stats, findings, disagreements, errors, elapsed, args.show)
    return {"source": str(source), "examples": args.examples, "seed": args.seed, "seconds": round(elapsed, 1),
            "counts": dict(stats), "findings": findings, "oracle_disagreements": disagreements,
            "harness_errors": errors}


def _shape(case: Any) -> str:
    """A label for the statistics: the wrapper and what the grouped query holds."""
    wrapper = case.wrapper if case.wrapper in ("plain", "cursor") else "outer query"
    parts = [wrapper] + [name for name, present in (("join", " JOIN " in case.from_sql), ("HAVING", case.having),
                                                    ("window", any(i.endswith(" AS w") for i in case.items)),
                                                    ("ORDER BY", case.order)) if present]
    return ", ".join(parts)


def _print(stats: Counter[str], findings: list[dict[str, Any]], disagreements: list[dict[str, Any]],
           errors: list[dict[str, Any]], elapsed: float, show: int) -> None:
    examples = sum(stats[k] for k in ("compared", "differed", "no person to change", "oracle disagreement",
                                      "harness error"))
    print(f"\n{examples} examples in {elapsed:.0f} s: {stats['compared'] + stats['differed']} changed somebody in "
          f"withheld groups only ({stats['differed']} with a different answer), {stats['no person to change']} had "
          f"nobody to change, {len(disagreements)} oracle disagreements, {len(errors)} harness errors")
    for label in sorted(k for k in stats if k.startswith(("role ", "shape "))):
        print(f"  {stats[label]:5d}  {label}")
    if findings:
        print(f"\n{len(findings)} findings (a change of withheld data changed the answer); "
              f"the {min(show, len(findings))} shortest statements:")
        for f in sorted(findings, key=lambda f: len(f["statement"]))[:show]:
            print(f"\n  example {f['example']}, role {f['role']}\n  {f['statement']}\n  change: {f['change']}\n"
                  f"  before: {f['before']}\n  after:  {f['after']}")
    for d in disagreements[:show]:
        print(f"\n  example {d['example']}, role {d['role']}: {d['message']}")
    for e in errors[:show]:
        print(f"\n  example {e['example']}: harness error {e['error']}\n  {e['statement']}")
    if not (findings or disagreements or errors):
        print("no finding: every answer was the same before and after")


if __name__ == "__main__":
    sys.exit(main())
