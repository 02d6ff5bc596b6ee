#!/usr/bin/env python3
"""Can a client empty the audit trail, or a crash leave answers unrecorded? Rows against answers, after each attack.

Against this checkout and, with ``--baseline DIR``, another one (e.g. the commit before the synchronous trail):

1. Flood: a reporter pipelines ``--refusals`` refused statements in one write, with six answered differencing
   statements spread among them, while a dba runs ``select 1`` and another reporter a seen suppress statement in
   a loop. Reports the rows the trail holds for the flood against the statements sent, how long the flood took,
   the other sessions' p50/p99 during it, and the worker's RSS growth.
2. kill -9: four reporter sessions run suppress statements in a loop on a proxy with one worker (the process
   itself); after ``--answers`` answers the process is killed. Reports how many answers the clients received and
   how many of them have no row.
See README.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import (  # noqa: E402
    REPO,
    connect,
    open_session,
    prepare_database,
    progress,
    rank,
    start_proxy,
)

from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from anonproxy.wire import protocol as pg  # noqa: E402

SEEN = "select education, count(*) from adult where age > 30 group by 1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to attack too, for comparison")
    parser.add_argument("--refusals", type=int, default=40_000, help="refused statements in the flood")
    parser.add_argument("--answers", type=int, default=300, help="answers received before the kill")
    args = parser.parse_args()
    sources = [("this checkout", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    with ExitStack() as stack:
        progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = prepare_database(server)
        owner = stack.enter_context(psycopg.connect(server.conninfo(dbname="postgres"), autocommit=True))
        for name, source in sources:
            with start_proxy(name, source, True, server.port, service_dsn, workers=1) as proxy:
                flood = _flood(proxy.port, proxy.pid, owner, args.refusals)
            print(f"{name}, flood: {flood['rows']} rows for {flood['sent']} statements "
                  f"({flood['answered_rows']} of 6 answered) in {flood['seconds']:.1f} s; others during it: "
                  f"dba p50 {flood['dba']['p50_ms']:.1f} / p99 {flood['dba']['p99_ms']:.1f} ms, reporter p50 "
                  f"{flood['reporter']['p50_ms']:.1f} / p99 {flood['reporter']['p99_ms']:.1f} ms; "
                  f"worker RSS +{flood['rss_growth_mb']:.0f} MB", flush=True)
            with start_proxy(name, source, True, server.port, service_dsn, workers=1) as proxy:
                killed = _kill(proxy.port, proxy.pid, owner, args.answers)
            print(f"{name}, kill -9: {killed['received']} answers received, {killed['unrecorded']} without a row",
                  flush=True)
    return 0


def _flood(port: int, pid: int, owner: psycopg.Connection[Any], refusals: int) -> dict[str, Any]:
    marker = f"flood-{uuid.uuid4().hex[:8]}"
    refused = pg.query_message(f"/* {marker} */ select fnlwgt from adult")
    answered = [pg.query_message(f"/* {marker} */ select sex, count(*) from adult where age <> {n + 30} group by 1")
                for n in range(6)]
    share = refusals // 6
    messages = b"".join(refused * share + answered[n] for n in range(6))
    sent = share * 6 + 6
    latencies: dict[str, list[float]] = {"dba": [], "reporter": []}
    done = threading.Event()

    def other(role: str, text: str) -> None:
        with connect(port, role) as conn:
            while not done.is_set():
                start = time.perf_counter()
                conn.execute(text).fetchall()
                latencies[role].append((time.perf_counter() - start) * 1000)
                time.sleep(0.01)

    rss_before = _rss(pid)
    peak = [rss_before]
    threads = [threading.Thread(target=other, args=("dba", "select 1")),
               threading.Thread(target=other, args=("reporter", SEEN))]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    with open_session(port, "reporter") as conn, socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        sock.settimeout(600)
        writer = threading.Thread(target=sock.sendall, args=(messages,))
        writer.start()
        ready, buffer = 0, b""
        while ready < sent:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("the proxy closed the flooding session")
            buffer += chunk
            ready, buffer = ready + _count_ready(buffer), _tail(buffer)
            peak[0] = max(peak[0], _rss(pid))
        writer.join()
    seconds = time.perf_counter() - start
    time.sleep(2.0)  # an asynchronous trail writes within a second
    done.set()
    for thread in threads:
        thread.join()
    counts = dict(owner.execute("select decision, count(*) from anonproxy.audit_trail where statement like %s "
                                "group by 1", [f"%{marker}%"]).fetchall())
    return {"sent": sent, "rows": sum(v for k, v in counts.items()), "answered_rows": counts.get("answered", 0),
            "seconds": seconds, "rss_growth_mb": (peak[0] - rss_before) / 1024,
            **{role: {"p50_ms": rank(v, 0.5), "p99_ms": rank(v, 0.99), "count": len(v)}
               for role, v in latencies.items()}}


def _count_ready(buffer: bytes) -> int:
    """ReadyForQuery messages among the whole messages at the start of ``buffer``."""
    count, offset = 0, 0
    while offset + 5 <= len(buffer):
        size = 1 + int.from_bytes(buffer[offset + 1:offset + 5], "big")
        if offset + size > len(buffer):
            break
        count += buffer[offset:offset + 1] == b"Z"
        offset += size
    return count


def _tail(buffer: bytes) -> bytes:
    """What follows the whole messages at the start of ``buffer``."""
    offset = 0
    while offset + 5 <= len(buffer):
        size = 1 + int.from_bytes(buffer[offset + 1:offset + 5], "big")
        if offset + size > len(buffer):
            break
        offset += size
    return buffer[offset:]


def _kill(port: int, pid: int, owner: psycopg.Connection[Any], answers: int) -> dict[str, int]:
    marker = f"kill-{uuid.uuid4().hex[:8]}"
    received: list[str] = []

    def client(number: int) -> None:
        try:
            with connect(port, "reporter") as conn:
                for n in itertools.count():
                    text = (f"/* {marker} {number}.{n} */ select sex, count(*) from adult where age > {n % 40 + 20} "
                            "group by 1")
                    conn.execute(text).fetchall()
                    received.append(text)
        except psycopg.Error:
            pass  # the proxy was killed

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    while len(received) < answers:
        time.sleep(0.005)
    os.kill(pid, 9)
    for thread in threads:
        thread.join()
    time.sleep(2.0)
    recorded = {row[0] for row in owner.execute("select statement from anonproxy.audit_trail where statement like %s",
                                                [f"%{marker}%"])}
    return {"received": len(received), "unrecorded": len(set(received) - recorded)}


def _rss(pid: int) -> int:
    """VmRSS of ``pid`` in kB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
