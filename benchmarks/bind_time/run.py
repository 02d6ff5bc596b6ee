#!/usr/bin/env python3
"""A prepared-statement loop through the gated proxy, in two trees side by side: what deciding at Bind costs.

For each tree given (a checkout of the repository; default: this one), starts `anonproxy up` from it on a free
port and runs, as `reporter` (suppress) with psycopg's prepared statements (``prepare=True``: Parse once, then
Bind/Execute), three loops of ``--runs`` executions each, after ``--warmup`` executions:

* ``plain``: ``select education, count(*) from adult where age > %s group by 1``, the age alternating between
  two values: a parameter decided at Parse, the common prepared statement;
* ``like, one value``: ``select count(*) from adult where occupation ilike %s`` with the same pattern each time
  (decided at Bind: one value class, found in the caches);
* ``like, two values``: the same statement, the pattern alternating between two values (each Bind switches the
  value class: the statement is prepared again on the service connection).

Prints the median and 90th percentile of the time per execution (client side, milliseconds) per loop and tree;
a statement a tree refuses is printed as refused. The trees alternate ``--rounds`` times.

    python3 benchmarks/bind_time/run.py --tree /path/to/old/checkout --tree . [--rounds 2] [--runs 400]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

PLAIN = "select education, count(*) from adult where age > %s group by 1"
LIKE = "select count(*) from adult where occupation ilike %s"
LOOPS = {
    "plain": (PLAIN, [[30], [40]]),
    "like, one value": (LIKE, [["%sales%"]]),
    "like, two values": (LIKE, [["%sales%"], ["%tech%"]]),
}
STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_up(tree: Path) -> tuple[subprocess.Popen[str], str]:
    """`anonproxy up` from ``tree``; the reporter's connection string."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen([sys.executable, "-m", "anonproxy", "up", "--port", str(free_port())], cwd=tree,
                               env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    deadline = time.monotonic() + STARTUP_SECONDS
    reporter = ""
    for line in process.stdout:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "reporter" and parts[1].startswith("postgresql://"):
            reporter = parts[1]
        if "Press Ctrl-C" in line or time.monotonic() > deadline:
            break
    if not reporter:
        process.kill()
        raise SystemExit(f"anonproxy up did not start from {tree}")
    return process, reporter


def loop(url: str, sql: str, values: list[list[object]], warmup: int, runs: int) -> list[float] | str:
    """Seconds per execution, or the refusal."""
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            for i in range(warmup):
                conn.execute(sql, values[i % len(values)], prepare=True).fetchall()
        except psycopg.Error as exc:
            return f"refused ({exc.sqlstate})"
        times = []
        for i in range(runs):
            start = time.perf_counter()
            conn.execute(sql, values[i % len(values)], prepare=True).fetchall()
            times.append(time.perf_counter() - start)
        return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to run `anonproxy up` from")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--runs", type=int, default=400)
    args = parser.parse_args()
    trees = [tree.resolve() for tree in (args.tree or [Path(".")])]
    print("| round | tree | loop | median ms | p90 ms |\n|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        for tree in trees:
            process, url = start_up(tree)
            try:
                for name, (sql, values) in LOOPS.items():
                    times = loop(url, sql, values, args.warmup, args.runs)
                    if isinstance(times, str):
                        print(f"| {round_} | {tree.name} | {name} | {times} | |")
                        continue
                    p90 = statistics.quantiles(times, n=10)[-1]
                    print(f"| {round_} | {tree.name} | {name} | {statistics.median(times) * 1e3:.3f} | "
                          f"{p90 * 1e3:.3f} |", flush=True)
            finally:
                process.send_signal(signal.SIGTERM)
                process.communicate(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
