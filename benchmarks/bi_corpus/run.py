#!/usr/bin/env python3
"""Coverage of the BI corpus (tests/bi_corpus/) through `anonproxy up`, as a markdown table.

Starts `anonproxy up` (a throwaway PostgreSQL with the demo data, roles and
policy, and the proxy, with the dated table `public.visits` the corpus's
time series read) on a free port, gives the demo `analyst` a budget large enough for
the whole corpus, replays every tool's statements as `reporter` (suppress) and
`analyst` (dp), and the widened corpus's also as `dba` (direct: the SQL is
valid PostgreSQL), and prints the coverage per tool and mode of the
established corpus, of the widened one and of its time series, and the
refusals with SQLSTATE and message, grouped by cause. Exit status 0 when, over
the established corpus, at least 90 % of the aggregates to answer are answered
in each mode, and over both every catalog statement is answered and every
statement that must be refused is, and no session breaks; 1 otherwise. See
README.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from bi_corpus import replay  # noqa: E402

ROLES = {"reporter": "suppress", "analyst": "dp"}
DIRECT = {"dba": "direct"}  # replays the widened corpus to check its SQL
TARGET_AGGREGATE_SHARE = 0.9
TARGET_WIDENED_SHARE = 0.95  # issue 19, with every time series answered
STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_up(port: int) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """`anonproxy up --port PORT`, read until it prints its connection strings; returns them by role."""
    process = subprocess.Popen([sys.executable, "-m", "anonproxy", "up", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    urls: dict[str, str] = {}
    output: list[str] = []
    deadline = time.monotonic() + STARTUP_SECONDS
    for line in process.stdout:
        output.append(line)
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith("postgresql://"):
            urls[parts[0]] = parts[1]
        if "Press Ctrl-C" in line or time.monotonic() > deadline:
            break
    if not {"owner", *ROLES, *DIRECT} <= set(urls):
        process.kill()
        raise SystemExit("anonproxy up did not start:\n" + "".join(output))
    return process, urls


def stop_up(process: subprocess.Popen[str]) -> str:
    """Stop `anonproxy up`; what it printed after its connection strings (the proxy's log)."""
    process.send_signal(signal.SIGTERM)
    try:
        rest, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        rest, _ = process.communicate()
    return rest or ""


def raise_analyst_budget(owner_url: str) -> None:
    """ε 1000 and δ 0.01 in all for the throwaway demo's analyst; the per-query charge stays the demo's."""
    with psycopg.connect(owner_url, autocommit=True) as owner:
        owner.execute("select anonproxy.set_budget('analyst', 'public.adult'::regclass, 1000, 0.01, null, 0.5, "
                      "0.0000001)")


def failures(outcomes: list[replay.Outcome]) -> list[str]:
    """What the test suite asserts per statement, as lines."""
    found = []
    for outcome in outcomes:
        entry = outcome.entry
        if outcome.connection_lost or outcome.sqlstate == "XX000":
            found.append(f"{entry.id} ({outcome.role}): the session broke ({outcome.why})")
        elif entry.kind == "catalog" and not outcome.answered:
            found.append(f"{entry.id} ({outcome.role}): catalog statement refused ({outcome.why})")
        elif entry.expected(outcome.mode) == "refuse" and (
                outcome.answered or outcome.rows or outcome.sqlstate not in replay.REFUSAL_STATES):
            found.append(f"{entry.id} ({outcome.role}): should be refused ({outcome.why or 'answered'})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every outcome to this file")
    args = parser.parse_args()

    entries = replay.load()
    widened = [entry for entry in entries if entry.corpus == "widened"]
    process, urls = start_up(free_port())
    try:
        raise_analyst_budget(urls["owner"])
        outcomes = replay.replay(entries, {role: urls[role] for role in ROLES}, ROLES)
        direct = replay.replay(widened, {role: urls[role] for role in DIRECT}, DIRECT)
    finally:
        stop_up(process)

    established = [o for o in outcomes if o.entry.corpus == "established"]
    new = [o for o in outcomes if o.entry.corpus == "widened"]
    report_established(entries, established)
    report_widened(widened, new, direct)
    problems = failures(outcomes) + [f"{o.entry.id} (dba): PostgreSQL refused it ({o.why})"
                                     for o in direct if not o.answered]
    if problems:
        print("\nStatements not handled as their kind requires:\n")
        print("\n".join(f"- {line}" for line in problems))
    shares = {role: replay.aggregate_share(established, role) for role in ROLES}
    print("\nAggregates of the established corpus answered: "
          + ", ".join(f"{role} {share:.0%}" for role, share in shares.items())
          + f" (target {TARGET_AGGREGATE_SHARE:.0%})")
    widened_shares = {role: replay.aggregate_share(new, role) for role in ROLES}
    series_refused = [f"{o.entry.id} ({o.role})" for o in new if o.entry.time_series and not o.answered]
    print("Aggregates of the widened corpus answered: "
          + ", ".join(f"{role} {share:.0%}" for role, share in widened_shares.items())
          + f" (target {TARGET_WIDENED_SHARE:.0%}); time series refused: {', '.join(series_refused) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps([
            {"id": o.entry.id, "tool": o.entry.tool, "corpus": o.entry.corpus, "time_series": o.entry.time_series,
             "kind": o.entry.kind, "role": o.role, "mode": o.mode,
             "answered": o.answered, "rows": o.rows, "sqlstate": o.sqlstate, "message": o.message}
            for o in outcomes], indent=1))
    met = min(shares.values()) >= TARGET_AGGREGATE_SHARE and min(widened_shares.values()) >= TARGET_WIDENED_SHARE
    return 0 if not problems and met and not series_refused else 1


def report_established(entries: list[replay.Entry], outcomes: list[replay.Outcome]) -> None:
    chosen = [entry for entry in entries if entry.corpus == "established"]
    aggregates = sum(1 for entry in chosen if entry.kind == "aggregate")
    print(f"## Established corpus: {len(chosen)} entries from {len({e.tool for e in chosen})} tools, "
          f"{aggregates} aggregates\n")
    print(replay.coverage_table(outcomes))
    for role, mode in ROLES.items():
        print(f"\nAggregates refused to {role} ({mode}):\n")
        print(replay.refusals_table([outcome for outcome in outcomes if outcome.role == role]))


def report_widened(entries: list[replay.Entry], outcomes: list[replay.Outcome],
                   direct: list[replay.Outcome]) -> None:
    aggregates = sum(1 for entry in entries if entry.kind == "aggregate")
    valid = sum(1 for outcome in direct if outcome.answered)
    print(f"\n## Widened corpus (issue 19): {len(entries)} entries from {len({e.tool for e in entries})} tools, "
          f"{aggregates} aggregates, {sum(e.time_series for e in entries)} time series; "
          f"{valid}/{len(direct)} answered by PostgreSQL itself (dba, direct)\n")
    print(replay.coverage_table(outcomes))
    print("\n### Time series (over public.visits)\n")
    print(replay.coverage_table([outcome for outcome in outcomes if outcome.entry.time_series]))
    print("\n### Refusals of the widened corpus, by cause\n")
    print(replay.causes_table(outcomes))
    for role, mode in ROLES.items():
        print(f"\n### Aggregates of the widened corpus refused to {role} ({mode})\n")
        print(replay.refusals_table([outcome for outcome in outcomes if outcome.role == role]))


if __name__ == "__main__":
    sys.exit(main())
