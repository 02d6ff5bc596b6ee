#!/usr/bin/env python3
"""Two versions of anonproxy.anonymize_mondrian side by side: the same calls, alternating, on one server.

Each version is a SQL file that defines anonproxy.anonymize_mondrian (a
migration of the source tree, or the same file taken from an older commit
with ``git show COMMIT:sql/NNNN_….sql > old.sql``). For every repetition and
each version in turn, the script installs that version and makes one
``create_anonymized_view`` release (Mondrian, k = 10, the QIs and hierarchies
of run.py) of each table, and reports per version the medians of: the whole
call (client wall time), the method alone (its own clock,
``method_facts.elapsed``), and the CPU time the server process spent in the
whole call (from /proc/<pid>/stat, so it needs the server on this machine; the
machine's load changes wall times far more than CPU times). It checks that
both versions release the same cells for every row, and prints the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # the tables, QIs and hierarchies of the main benchmark

from anonproxy.embedded import EmbeddedPostgres


def backend_cpu(pid: int) -> float:
    """User + system CPU seconds of one server process (clock ticks of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def release(conn: psycopg.Connection, table: str) -> tuple[float, float, float, str]:
    """Whole-call wall s, method s, backend CPU s, and a digest of the released rows."""
    pid = conn.info.backend_pid
    target = f"public.side_{table}"
    cpu, started = backend_cpu(pid), time.perf_counter()
    conn.execute("select anonproxy.create_anonymized_view(%s, %s, %s, %s, k => %s, method => 'mondrian', "
                 "hierarchies => %s)", (f"public.{table}", target, bench.QI, bench.SENSITIVE, bench.K,
                                        Jsonb(bench.hierarchies("mondrian"))))
    wall, cpu = time.perf_counter() - started, backend_cpu(pid) - cpu
    row = conn.execute("select (method_facts ->> 'elapsed')::float from anonproxy.releases where target = %s",
                       (target,)).fetchone()
    digest = conn.execute(f"select md5(string_agg(t::text, '|' order by t::text)) from {target} t").fetchone()
    conn.execute("select anonproxy.drop_release(%s)", (target,))
    assert row is not None and digest is not None
    return wall, float(row[0]), cpu, str(digest[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="SQL file defining the first version")
    parser.add_argument("after", type=Path, help="SQL file defining the second version")
    parser.add_argument("--repeat", type=int, default=5, help="alternations on adult")
    parser.add_argument("--big-repeat", type=int, default=2, help="alternations on adult_big (0: skip it)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of adult_big when it is built here")
    parser.add_argument("--dsn", help="a server where run.py's tables already are (default: start one)")
    args = parser.parse_args()
    versions = {"before": args.before.read_text(), "after": args.after.read_text()}

    with ExitStack() as stack:
        if args.dsn:
            conn = stack.enter_context(psycopg.connect(args.dsn))
        else:
            server = stack.enter_context(EmbeddedPostgres(settings=bench.SERVER_SETTINGS))
            conn = stack.enter_context(psycopg.connect(server.conninfo()))
            bench.prepare(conn, args.rows if args.big_repeat else 0, 0.42)
        conn.autocommit = True
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results: dict[tuple[str, str], list[tuple[float, float, float, str]]] = {}
        for table, repeat in (("adult", args.repeat), ("adult_big", args.big_repeat)):
            for _ in range(repeat):
                for name, definition in versions.items():
                    conn.execute(definition)
                    results.setdefault((table, name), []).append(release(conn, table))
        conn.execute(versions["after"])
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    print(f"{'table':<10} {'version':<7} {'runs':>4} {'call s':>7} {'method s':>9} {'server CPU s':>13}  cells")
    for (table, name), runs in results.items():
        same = {r[3] for r in runs} == {r[3] for r in results[(table, 'before')]}
        print(f"{table:<10} {name:<7} {len(runs):>4} {statistics.median(r[0] for r in runs):>7.2f} "
              f"{statistics.median(r[1] for r in runs):>9.2f} {statistics.median(r[2] for r in runs):>13.2f}  "
              f"{'same as before' if same else 'DIFFERENT from before'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
